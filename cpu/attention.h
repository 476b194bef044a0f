// How the attention and kv_store ops read and write one KV-cache type.
//
// Every cache type is a row of one table (iq_attn_cache_fns_get), so the attention kernel
// (ops-attention.c: online softmax over tiles, GQA, work split and merge) is written once.
// The kernel hands a type a stretch of positions [t0, t0 + n) of one KV head (n <= IQ_ATTN_TILE)
// together with all nq query vectors that read that head, so a stored code is loaded once
// for all of them. K functions come from the row of type_k, V functions from type_v.
#pragma once

#include "iq-kv.h"

#include <stdbool.h>
#include <stdint.h>

#define IQ_ATTN_TILE 64  // positions per tile

struct iq_attn_cache_fns {
    // s[j * ss + t] = dot(q + j * head_dim, K[head, t0 + t]) for j < nq, t < n.
    // q is already multiplied by the softmax scale.
    void (*scores)(const struct iq_kv_layer * layer, int head, int64_t t0, int n, int nq, const float * q, float * s,
                   int64_t ss, float * scratch);
    // o + j * head_dim += sum_t p[j * ps + t] * V[head, t0 + t] for j < nq.
    void (*accum)(const struct iq_kv_layer * layer, int head, int64_t t0, int n, int nq, const float * p, int64_t ps,
                  float * o, float * scratch);
    // Stores n rows of f32 keys (is_v false) or values of one KV head at positions t0..;
    // row i is x + i * xs.
    void (*store)(struct iq_kv_layer * layer, bool is_v, int head, int64_t t0, int n, const float * x, int64_t xs);
};

// scratch holds IQ_ATTN_TILE * head_dim floats for the calling thread.

// The row of a cache type; NULL if attention can't read it.
const struct iq_attn_cache_fns * iq_attn_cache_fns_get(enum iq_type type);

// Plain types (f32, f16, q8_0, q4_0): head-major rows along D (attention-plain.c).
extern const struct iq_attn_cache_fns iq_attn_plain_fns;
