// The KV cache's storage, for the cache's own files (defined in kv-layout.c): making it, the key norms of a
// slot, copies of pages and windows, the automatic layout's arena and its probe queries.
#pragma once

#include "kv-cache.h"

// Every layer's tensors, the page table, the automatic layout's arena and the rotation: their
// places in one buffer and its size (cache->size; no memory of a backend taken), then the
// buffer of the backend with the tensors in it.
innerq_status kv_storage_plan(struct kv_cache * cache);
innerq_status kv_storage_alloc(struct kv_cache * cache, iq_backend * const * be);
// The automatic layout's code bits (cfg.units) for its budget, kv_bits effective bits per element
// at n_ctx: the most whose whole planned buffer, windows and all, fits in it (the arena's size
// and the plan follow). INNERQ_ERR_INVALID_ARGUMENT if the windows and the smallest layout
// already exceed it.
innerq_status kv_layout_budget(struct kv_cache * cache);
// Sets sequence `slot`'s key normalization to 1 (no flush has set it).
innerq_status kv_norms_reset(struct kv_cache * cache, int32_t slot);
// The first `rows` rows of page `from` to page `to` (plain formats), every layer and head.
bool kv_page_copy(struct kv_cache * cache, int32_t from, int32_t to, int32_t rows);
// Slot `from`'s norms, first n_sink sink rows and first n_recent window rows to slot `to`
// (quantized formats), every layer and head.
bool kv_slot_copy(struct kv_cache * cache, int32_t from, int32_t to, int32_t n_sink, int32_t n_recent);
// Gives every layer the bits bits[il] (keys, values; NULL: the smallest, before the automatic
// layout's choice) and re-lays its quantized regions in the arena.
void kv_layout_set(struct kv_cache * cache, const int32_t (*bits)[2]);
// The probe queries of the automatic layout: the first position measured, the floats of one
// position's queries, where layer il's queries of position pos are, and how many of them a
// sequence of n_past tokens keeps while the choice is pending (ready: made).
int32_t kv_probe_first(const struct kv_cache * cache);
size_t kv_probe_row(const struct kv_cache * cache);
float * kv_probe_at(const struct kv_cache * cache, int32_t il, int32_t pos);
int32_t kv_probe_kept(const struct kv_cache * cache, int32_t n_past, bool ready);
