// The pool's pages (kv-pool.h).
#include "kv-pool.h"

#include <stdlib.h>

static void kv_heap_push(struct kv_pool * p, int32_t page) {
    int32_t i = p->n_free++;
    while (i > 0 && p->heap[(i - 1) / 2] > page) {
        p->heap[i] = p->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    p->heap[i] = page;
}

static int32_t kv_heap_pop(struct kv_pool * p) {
    const int32_t top = p->heap[0], last = p->heap[--p->n_free];
    int32_t i = 0;
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= p->n_free) {
            break;
        }
        c += c + 1 < p->n_free && p->heap[c + 1] < p->heap[c];
        if (p->heap[c] >= last) {
            break;
        }
        p->heap[i] = p->heap[c];
        i = c;
    }
    if (p->n_free > 0) {
        p->heap[i] = last;
    }
    return top;
}

bool kv_pool_init(struct kv_pool * p, int32_t n_pages) {
    p->n_pages = n_pages;
    p->refs = calloc((size_t) (n_pages > 0 ? n_pages : 1), sizeof(int32_t));
    p->heap = malloc(sizeof(int32_t) * (size_t) (n_pages > 0 ? n_pages : 1));
    if (p->refs == NULL || p->heap == NULL) {
        kv_pool_free(p);
        return false;
    }
    kv_pool_reset(p);
    return true;
}

void kv_pool_free(struct kv_pool * p) {
    free(p->refs);
    free(p->heap);
    p->refs = p->heap = NULL;
    p->n_pages = p->n_free = 0;
}

void kv_pool_reset(struct kv_pool * p) {
    for (int32_t i = 0; i < p->n_pages; i++) {
        p->refs[i] = 0;
        p->heap[i] = i;  // sorted: a min-heap
    }
    p->n_free = p->n_pages;
}

int32_t kv_pool_take(struct kv_pool * p) {
    if (p->n_free == 0) {
        return -1;
    }
    const int32_t page = kv_heap_pop(p);
    p->refs[page] = 1;
    return page;
}

void kv_pool_hold(struct kv_pool * p, int32_t page) { p->refs[page]++; }

void kv_pool_drop(struct kv_pool * p, int32_t page) {
    if (--p->refs[page] == 0) {
        kv_heap_push(p, page);
    }
}
