// The KV cache of a context: one pool of storage shared by its sequences (docs/DESIGN.md 3.6).
//
// Per layer an iq_kv_layer (ggml_innerq/iq-kv.h) whose storage is tensors of one backend
// buffer, laid out by the cache's format (kv-format.h). Each sequence has a slot (its windows
// and norms for quantized formats) and a page table naming the pages of the pool it holds;
// pages are counted, so a prefix copied to several sequences is stored once. The cache owns
// the bookkeeping, on the host: each sequence's counters, the pages, the tables. A step's ops
// get each sequence's row (kv_cache_step); the graph's KV_STORE ops move the data, and
// kv_cache_step_commit updates the bookkeeping once the graph has run.
//
// The cache's concerns are files of their own: configuration and defaults (kv-config.c), the
// formats (kv-fmt-*.c), storage and its layout (kv-layout.c), the pool's pages (kv-pool.c),
// steps (kv-cache.c), removing and copying tokens (kv-rewind.c), states (kv-state.c), the
// automatic layout (kv-auto.c).
#pragma once

#include "innerq.h"
#include "iq-backend.h"
#include "iq-kv.h"
#include "kv-auto.h"
#include "kv-config.h"
#include "kv-format.h"
#include "kv-plan.h"
#include "kv-pool.h"

struct llama_hparams;
struct device_kind;

#define KV_MAX_DEVICES 2  // a model split between the CPU and a GPU

// `count` consecutive batches of `len` tokens, evaluated with decode semantics or not (a
// one-token batch is recorded without: it is the same either way). A sequence keeps the
// batches its tokens came in: whether a prefix of them is what a fresh evaluation would store
// depends on them (exact rewinds).
struct kv_run {
    int32_t len, count;
    bool decode_semantics;
};

// One sequence: the tokens it holds, a quantized format's counters besides, the pages its
// table names, and the batches its tokens came in.
struct kv_seq {
    int32_t n_past;
    struct kv_qstate q;
    int32_t n_pages;
    struct kv_run * runs;
    int32_t n_runs, cap_runs;
};

struct kv_cache {
    struct kv_config cfg;
    int32_t n_layer, n_head, head_dim, n_kv_head;
    float kq_scale;
    struct iq_kv_layer * layers;
    struct kv_seq * seqs;        // [n_slots]
    struct kv_pool pool;         // the pages: who holds them
    int32_t * table;             // the page tables, [n_slots][n_table] (host copy of `pages`)
    // The devices the storage is on (a model split between the CPU and a GPU: two): each holds
    // the layers that run there (layer_dev), and its own copy of the page table and rotation.
    int32_t n_dev;
    int32_t * layer_dev;                        // [n_layer]: the device of each layer's storage
    struct iq_tensor * pages[KV_MAX_DEVICES];  // I32 [n_table, n_slots] in buf[d]: the ops' page table
    // The automatic layout (kv_bits > 0, kv-auto.h): every layer starts with 2-bit keys and
    // values; at the first flush (layout_ready) each gets its own bits, within cfg.units (the
    // sum of b_k + b_v over the layers). The quantized regions of all layers share one arena of
    // the budget's bytes (auto_off, auto_size in buf), placed there by the layout.
    bool layout_ready;
    size_t align, auto_off, auto_size;
    // the queries of the KV_AUTO_PROBE positions before the first flush, per layer
    // [n_layer][KV_AUTO_PROBE][n_head][head_dim], which the layout is measured with
    float * probe;
    double (*err)[2][KV_AUTO_CANDIDATES];  // what the choice measured per layer (innerq_kv_layer_info)
    // Hadamard rotation along head_dim (cfg.rot_k, cfg.rot_v): the D x D orthonormal matrix, f32
    // in each device's buffer (a MUL_MAT weight, so every backend runs it)
    struct iq_tensor * rot[KV_MAX_DEVICES];
    struct iq_context * ctx;     // the storage's tensor structs
    // the places of the layers' blocks (in their device's buffer), of each device's page table
    // and rotation, each buffer's size and their sum
    size_t * layer_off, pages_off[KV_MAX_DEVICES], rot_off[KV_MAX_DEVICES], dev_size[KV_MAX_DEVICES], size;
    iq_buffer * buf[KV_MAX_DEVICES];
};

// The cache of a model of hp for params, its defaults those of device kind `kind`: layer il's
// storage in a buffer of be[layer_dev[il]] (layer_dev NULL: every layer on be[0]).
innerq_status kv_cache_init(const struct llama_hparams * hp, const struct device_kind * kind, iq_backend * const * be,
                            int32_t n_dev, const int32_t * layer_dev, const innerq_context_params * params,
                            int32_t n_ctx, int32_t n_slots, struct kv_cache ** out);
void kv_cache_free(struct kv_cache * cache);
// Writes entries of the page tables (bytes [offset, offset + size) of `pages`) on every device.
void kv_pages_set(struct kv_cache * cache, const int32_t * data, size_t offset, size_t size);
// Bytes of the cache's buffers (0 before they are allocated).
uint64_t kv_cache_size(const struct kv_cache * cache);
// The configuration and the bytes of the buffer kv_cache_init would allocate on a device of kind
// dev (its defaults and alignment), computed without allocating it.
innerq_status kv_cache_size_of(const struct llama_hparams * hp, const struct device_kind * dev,
                               const innerq_context_params * params, int32_t n_ctx, int32_t n_slots,
                               struct kv_config * cfg, uint64_t * bytes);
// Forgets every token of every sequence (and the automatic layout's choice).
innerq_status kv_cache_clear(struct kv_cache * cache);

// ---- steps (kv-cache.c) ----
// A sequence's part of a step: its slot and its rows of the batch.
struct kv_step_seq {
    int32_t slot, token0, n_tokens;
};
// Tokens sequence `slot` can take one at a time with decode semantics in one batch: up to and
// including the one after which the cache flushes (INT32_MAX for plain types, which never do).
int32_t kv_cache_until_flush(const struct kv_cache * cache, int32_t slot);
// The rows of a step's sequences (rows[i] for in[i]: counters, flush plan) and the pages it
// needs, taken from the pool and written to the tables (host and `pages`). false (+
// iq_error_set) if they do not fit; nothing changed then.
bool kv_cache_step(struct kv_cache * cache, const struct kv_step_seq * in, int32_t n, struct iq_kv_seq * rows);
// After the step's graph ran: each sequence's counters and its record of batches (room for it
// was made by kv_cache_step).
void kv_cache_step_commit(struct kv_cache * cache, const struct iq_kv_seq * rows, int32_t n, bool decode_semantics);
// The pages of the pool the sequences take when each stores n[slot] more tokens (n_past + n <=
// n_ctx): what the tokens fill, and the copies of shared last pages they store into.
int64_t kv_cache_pages_needed(const struct kv_cache * cache, const int32_t * n);
// After a step that did not run: the pages kv_cache_step took go back.
void kv_cache_step_abort(struct kv_cache * cache, const struct iq_kv_seq * rows, int32_t n);

// ---- the automatic layout (kv-layout.c) ----
// Tokens sequence `slot` can store before the layout's choice is due (0: now, before its next
// token; INT32_MAX: no choice pending), whether a batch of n tokens after n_past of it
// computes queries the choice is measured with (its graph then outputs every layer's queries,
// and kv_cache_probe_save keeps them), and the choice itself, from that sequence's windows and
// those queries (measured on n_threads threads).
int32_t kv_cache_until_layout(const struct kv_cache * cache, int32_t slot);
bool kv_cache_probing(const struct kv_cache * cache, int32_t slot, int32_t n);
void kv_cache_probe_save(struct kv_cache * cache, struct iq_tensor * const * q, int32_t row0, int32_t n_past,
                         int32_t n);
// ahead (or NULL): the rows of the next ahead->n tokens of the sequence, which a measuring step
// evaluated without storing them (decode.c): each layer's queries, keys and values as attention
// gets them (f32 [head_dim, n_head or n_kv_head, at least n], contiguous, in any backend's memory;
// the first n tokens are read). The choice then measures the windows' rows and these, with the
// last KV_AUTO_PROBE queries of all.
struct kv_ahead {
    struct iq_tensor * const * q, * const * k, * const * v;
    int32_t n;
};
innerq_status kv_cache_layout_choose(struct kv_cache * cache, int32_t slot, int32_t n_threads,
                                     const struct kv_ahead * ahead);
// Layer il's layout and, for sequence `slot`, the share of its stored groups the quantizer put
// on the symmetric grid.
innerq_status kv_cache_layer_info(const struct kv_cache * cache, int32_t slot, int32_t il, innerq_kv_layer_info * out);

// ---- removing and copying tokens (kv-rewind.c) ----
// Removes sequence `slot`'s tokens from position n on. Kept tokens stay as they are stored
// (exact false): a quantized sequence keeps its blocks below n and its windows' rows below n,
// and where n cuts a block, that block's tokens go too; *n_kept <= n says where the sequence
// now ends (the caller evaluates [*n_kept, n) again: fewer than G tokens). exact: the state a
// fresh evaluation of *n_kept tokens in one call would hold (batches of n_batch, decode
// semantics as given), rewinding further where this cache cannot give it.
innerq_status kv_cache_seq_keep(struct kv_cache * cache, int32_t slot, int32_t n, bool exact, int32_t n_batch,
                                bool decode_semantics, int32_t * n_kept);
// Forgets sequence `slot` (its pages go back to the pool).
void kv_cache_seq_clear(struct kv_cache * cache, int32_t slot);
// Makes sequence dst a copy of the first n tokens of src (as kv_cache_seq_keep keeps them; dst's
// tokens are dropped first): dst shares src's pages, and gets copies of its windows and norms.
// *n_copied: the tokens dst holds.
innerq_status kv_cache_seq_copy(struct kv_cache * cache, int32_t src, int32_t dst, int32_t n, int32_t * n_copied);

// ---- states (kv-state.c) ----
// A byte stream: writing with w == NULL counts the bytes.
struct kv_stream {
    uint8_t * w;
    const uint8_t * r;
    size_t pos, size;
};
// Appends n bytes (w == NULL: counts them); takes n bytes, false if fewer are left.
void kv_stream_put(struct kv_stream * s, const void * data, size_t n);
bool kv_stream_get(struct kv_stream * s, void * data, size_t n);
// Sequence `slot` as it is: its counters, batches, the layout and the storage it uses.
void kv_cache_seq_write(const struct kv_cache * cache, int32_t slot, struct kv_stream * s);
// Reads what kv_cache_seq_write wrote into sequence `slot`, after checking all of it (with_layout:
// the stream holds each layer's bits, states from version 3 on); *n_pages: the pages it takes.
// Without apply it only checks and moves past it. On failure (+ innerq_fail) the cache is as it was.
innerq_status kv_cache_seq_read(struct kv_cache * cache, int32_t slot, struct kv_stream * s, bool with_layout,
                                bool apply, int32_t * n_pages);
