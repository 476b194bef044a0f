// The pages of a KV cache's pool and who holds them: a page is held by every sequence whose page
// table names it (a shared prefix is held by each sequence that copied it), and goes back to
// the free pages when the last lets go. Free pages are taken lowest first, so the pages of a
// lone sequence are the pool's in order.
#pragma once

#include <stdbool.h>
#include <stdint.h>

struct kv_pool {
    int32_t n_pages;
    int32_t * refs;   // holders per page (0: free)
    int32_t * heap;   // the free pages, a min-heap of n_free
    int32_t n_free;
};

// false if there is no memory for n_pages.
bool kv_pool_init(struct kv_pool * pool, int32_t n_pages);
void kv_pool_free(struct kv_pool * pool);
// Every page free.
void kv_pool_reset(struct kv_pool * pool);
// The lowest free page, now held once; -1 if none is free.
int32_t kv_pool_take(struct kv_pool * pool);
// One more holder of a held page; one less (the page is free again after the last).
void kv_pool_hold(struct kv_pool * pool, int32_t page);
void kv_pool_drop(struct kv_pool * pool, int32_t page);
static inline int32_t kv_pool_used(const struct kv_pool * pool) { return pool->n_pages - pool->n_free; }
