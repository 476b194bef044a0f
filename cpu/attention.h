// How the attention and kv_store ops read and write one KV-cache type.
//
// Every cache type is a row of one table (iq_attn_cache_fns_get), so the attention op
// (ops-attention.c: GQA grouping, the split of work over threads, the exact merge) is
// written once. A type adds stored positions of one KV head to the online-softmax states of
// all the query vectors that read that head at once, so a stored code is loaded once for all
// of them. States of disjoint position ranges merge exactly, so the op splits long caches
// over threads freely.
#pragma once

#include "iq-kv.h"
#include "ops.h"

#include <stdbool.h>
#include <stdint.h>

#define IQ_ATTN_TILE 64  // positions per tile of scores

// Online-softmax state of one query vector: {max, sum, acc[head_dim]}, with
// acc = sum_t exp(s_t - max) v_t and sum = sum_t exp(s_t - max) (max = -inf, sum = 0: empty).
static inline int64_t iq_attn_state_size(int64_t head_dim) { return head_dim + 2; }

// Floats of scratch a type's attend gets for nq query vectors.
static inline int64_t iq_attn_scratch_size(int64_t head_dim, int64_t nq) {
    return nq * IQ_ATTN_TILE + 2 * IQ_ATTN_TILE * head_dim;
}

// One sequence's cache as an op reads or writes it: the layer, the sequence's page table row,
// and for a quantized type its view (windows and norms of its slot, counters before the step)
// and flush plan (iq_kv_qcache_of_seq).
struct iq_attn_cache {
    const struct iq_kv_layer * layer;
    const int32_t * pages;
    struct iq_qcache qc;
    struct iq_qcache_flush flush;
};

struct iq_attn_cache_fns {
    // Adds stored positions [t0, t1) of KV head `head` to the states st (nq of them, one after
    // the other) of query vectors q (nq rows of head_dim floats, already multiplied by the
    // softmax scale). The vectors come in groups of r: the r query heads of one query, in
    // order. Every query vector sees every one of these positions.
    void (*attend)(const struct iq_attn_cache * cache, int head, int64_t t0, int64_t t1, int nq, int r,
                   const float * q, float * st, float * scratch);
    // Stores KV head `head` of n batch tokens of a sequence (k, v: f32 [n][n_kv_head][head_dim],
    // the sequence's rows of the op's k and v) after the n_past positions the sequence holds,
    // and does what the type does after a store (the flush plan). Heads and sequences write
    // apart from each other: the op spreads them over its threads.
    void (*store_head)(const struct iq_attn_cache * cache, int head, const float * k, const float * v, int32_t n,
                       int32_t n_past);
};

// The row of a cache type; NULL if the CPU backend can't hold it. A layer's K and V types
// must share a row.
const struct iq_attn_cache_fns * iq_attn_cache_fns_get(enum iq_type type);

// Adds n rows of keys k and values v (f32, or f16 where *_half; row t at element t * ks / t * vs)
// to the states of nq query vectors. visible[j] (or all n where visible is NULL) is how many
// of the rows, from the first, query vector j sees. s: nq * IQ_ATTN_TILE floats; n <= IQ_ATTN_TILE.
// Shared by the plain types, the batch's own rows and any type with rows of f32 / f16.
void iq_attn_rows(int d, int n, const void * k, bool k_half, int64_t ks, const void * v, bool v_half, int64_t vs,
                  int nq, const float * q, const int * visible, float * st, float * s);
// The same with the vector kernels of one ISA (the InnerQ kernel tables' windows).
struct iq_vec_fns;
void iq_attn_rows_vec(const struct iq_vec_fns * vec, int d, int n, const void * k, bool k_half, int64_t ks,
                      const void * v, bool v_half, int64_t vs, int nq, const float * q, const int * visible, float * st,
                      float * s);

// Plain types (f32, f16, q8_0, q4_0): head-major rows along D (attention-plain.c).
extern const struct iq_attn_cache_fns iq_attn_plain_fns;
// Quantized types (InnerQ, KIVI): regions and kernels of iq-qcache.h (attention-qcache.c).
extern const struct iq_attn_cache_fns iq_attn_innerq_fns;
