// One layer's KV cache as the ATTENTION and KV_STORE ops see it (docs/DESIGN.md 3.6).
//
// The storage is shared by the sequences of a context (a pool). Plain types hold rows of
// head_dim elements in pages of `page` tokens; quantized types hold each sequence's windows and
// key norms in its slot and their quantized blocks in pages of one block (G tokens). Which
// pages a sequence holds is the page table, an I32 tensor [n_table, n_slots] of the cache:
// row `slot`, entry j is the page of the sequence's tokens [j * page, (j + 1) * page) (plain)
// or of its quantized block j. What each sequence of a step does is the step's input tensor
// `seqs`, I32 [IQ_KV_S_COUNT, n_seq] (struct iq_kv_seq rows). Both are sources of the ops;
// op_params hold only the static configuration, so a step's graph depends on shapes alone.
// The runtime (src/kv-*.c) owns the bookkeeping: it writes the tables and the step's rows
// before the graph runs and commits its counters after; ops never change what a host reads.
#pragma once

#include "iq-qcache.h"
#include "iq.h"

#ifdef __cplusplus
extern "C" {
#endif

struct iq_kv_layer {
    enum iq_type type_k, type_v;
    int32_t head_dim, n_kv_head;
    int32_t n_ctx;    // tokens one sequence may hold
    int32_t page;     // tokens per page: plain rows, or G (one quantized block)
    int32_t n_pages;  // pages of the pool
    int32_t n_slots;  // sequences (windows and norms of quantized types; rows of the page table)
    // sliding-window attention: a query at position p attends to positions p - window < p' <= p
    // (0: to every position before it); the cache still holds every position
    int32_t window;
    // Plain types (f32, f16, q8_0, q4_0): rows along D, head-major: row (head h, page p, token
    // o of the page) is h * nb[2] + (p * page + o) * nb[1], ne = {head_dim, page * n_pages, n_kv_head}.
    struct iq_tensor * k;
    struct iq_tensor * v;
    // Quantized types (InnerQ innerq2 .. innerq5, KIVI kivi2/kivi4): the configuration and one
    // tensor per region (iq-qcache.h, shapes of iq_qcache_region_shape); k and v are NULL.
    struct iq_qcache_config qcfg;
    struct iq_tensor * region[IQ_QREGION_COUNT];
};

// A row of a step's `seqs` tensor: one sequence's tokens in the batch and its counters before
// the step (quantized types: the runtime's flush plan too). Its tokens are the batch's rows
// [token0, token0 + n_tokens), at positions n_past, n_past + 1, ...
struct iq_kv_seq {
    int32_t slot;
    int32_t token0, n_tokens;
    int32_t n_past;                // tokens the sequence holds before the step
    int32_t n_sink, n_quant;       // quantized types: sink and quantized tokens (the window holds the rest)
    struct iq_qcache_flush flush;  // quantized types: what storing the tokens does
};
enum iq_kv_seq_field {  // the same fields as I32 columns (a backend's kernels index them)
    IQ_KV_S_SLOT = 0,
    IQ_KV_S_TOKEN0,
    IQ_KV_S_N_TOKENS,
    IQ_KV_S_N_PAST,
    IQ_KV_S_N_SINK,
    IQ_KV_S_N_QUANT,
    IQ_KV_S_N_SINK_NEW,
    IQ_KV_S_N_FLUSH,
    IQ_KV_S_SET_NORMS,
    IQ_KV_S_COUNT,
};

// op_params of ATTENTION and KV_STORE (int32 each): the static configuration only.
enum iq_kv_param {
    IQ_KV_P_SCALE = 0,       // ATTENTION: f32 scale of q.k
    IQ_KV_P_DECODE = 1,      // ATTENTION: decode semantics (iq_attention_set_decode_semantics)
    IQ_KV_P_N_CTX = 2,
    IQ_KV_P_PAGE = 3,
    IQ_KV_P_BITS_K = 4,      // quantized types: the configuration (struct iq_qcache_config)
    IQ_KV_P_BITS_V = 5,
    IQ_KV_P_GROUP = 6,
    IQ_KV_P_SINK_CAP = 7,    // S
    IQ_KV_P_RECENT_CAP = 8,  // R
    IQ_KV_P_ROPE_DIMS = 9,
    IQ_KV_P_FLAGS = 10,      // IQ_KV_F_*
    IQ_KV_P_WINDOW = 11,     // the layer's sliding window (iq_kv_layer.window)
    IQ_KV_P_COUNT = 12,
};
enum iq_kv_flag {
    IQ_KV_F_AXIS_K_TOKENS = 1,
    IQ_KV_F_AXIS_V_TOKENS = 2,
    IQ_KV_F_MODE_SHIFT = 2,  // two bits: enum iq_quant_mode
    IQ_KV_F_KEY_NORM = 16,
    IQ_KV_F_SCORE_CORRECTION = 32,
    IQ_KV_F_QUANTIZED = 64,
    IQ_KV_F_VALUE_SCALES = 128,
    IQ_KV_F_PARAMS8 = 256,
    IQ_KV_F_KEY_LEVELS = 512,
};
// Sources of ATTENTION (q, k, v) and KV_STORE (after, k, v), then the step's sequences, the
// page table and the storage (plain: k, v; quantized: the regions in enum iq_qregion order).
enum iq_kv_src {
    IQ_KV_SRC_SEQS = 3,
    IQ_KV_SRC_PAGES = 4,
    IQ_KV_SRC_STORAGE = 5,
};

// Plain cache types, stored as rows of a ggml type that converts both ways (which of them a
// runtime offers is its choice: src/kv-format.h); the others are iq-qcache.h's.
bool iq_kv_type_is_plain(enum iq_type type);

// The layer an ATTENTION or KV_STORE op reads and writes, from its op_params and sources (the
// tensors are the op's sources). false (+ iq_error_set) if they do not describe a cache.
bool iq_kv_layer_of_op(const struct iq_tensor * op, struct iq_kv_layer * layer);
// The rows of the op's `seqs` (host memory: the CPU backend reads them when the graph runs).
static inline const struct iq_kv_seq * iq_kv_seqs_of_op(const struct iq_tensor * op) {
    return (const struct iq_kv_seq *) op->src[IQ_KV_SRC_SEQS]->data;
}
static inline int32_t iq_kv_n_seq(const struct iq_tensor * op) { return (int32_t) op->src[IQ_KV_SRC_SEQS]->ne[1]; }
// Row `slot` of the op's page table (host memory) and its length.
static inline const int32_t * iq_kv_pages_of_op(const struct iq_tensor * op, int32_t slot) {
    const struct iq_tensor * t = op->src[IQ_KV_SRC_PAGES];
    return (const int32_t *) ((const char *) t->data + (size_t) slot * t->nb[1]);
}
static inline int32_t iq_kv_n_table(const struct iq_tensor * op) { return (int32_t) op->src[IQ_KV_SRC_PAGES]->ne[0]; }

// Checks the step's rows against the layer, the batch of n_tokens and the page table (host
// memory), so that no op reads or writes outside the cache whatever its inputs: slots in
// range, each sequence's tokens inside the batch and apart from the others', counters that
// fit (iq_qcache_store_check), and every page the sequence reads or writes in the pool.
// false + iq_error_set otherwise.
bool iq_kv_seqs_check(const struct iq_tensor * op, const struct iq_kv_layer * layer);

// Sequence s's view of a quantized layer (iq-qcache.h): its slot's windows and norms, its page
// table row, its counters before the step, and its flush plan. The layer and the op's rows
// must have passed iq_kv_seqs_check.
void iq_kv_qcache_of_seq(const struct iq_tensor * op, const struct iq_kv_layer * layer, int32_t s,
                         struct iq_qcache * c, struct iq_qcache_flush * flush);

// Row of plain storage t (layer->k or ->v) holding position pos of KV head h for a sequence
// whose page table row is pages.
static inline void * iq_kv_plain_row(const struct iq_kv_layer * layer, const struct iq_tensor * t,
                                     const int32_t * pages, int32_t h, int64_t pos) {
    const int64_t row = (int64_t) pages[pos / layer->page] * layer->page + pos % layer->page;
    return (char *) t->data + (size_t) h * t->nb[2] + (size_t) row * t->nb[1];
}

#ifdef __cplusplus
}
#endif
