// The KV cache of one sequence: per layer an iq_kv_layer (ggml_innerq/iq-kv.h) whose storage
// lives in one backend buffer. Plain types (f32, f16, q8_0, q4_0) are rows of a ggml type;
// quantized types (InnerQ innerq2/innerq3/innerq4, KIVI kivi2/kivi4) keep their regions, flushes and key
// normalization in an iq_qcache per layer (ggml_innerq/iq-innerq.h). The cache tracks how many
// tokens are stored; the graph's KV_STORE ops move the data.
#pragma once

#include "innerq.h"
#include "iq-backend.h"
#include "iq-innerq.h"
#include "iq-kv.h"

struct llama_hparams;

struct kv_cache {
    int32_t n_layer;
    int32_t n_ctx;
    int32_t n_past;              // tokens stored
    enum iq_type type_k, type_v;
    struct iq_kv_layer * layers;
    struct iq_qcache * qc;       // [n_layer] for quantized types, else NULL
    struct iq_context * ctx;     // tensor structs of plain storage
    iq_buffer * buf;
};

// The cache's types and, for quantized types, its configuration, from the context parameters
// (kv_k / kv_v: a type name, the preset "innerq" (innerq3 keys, innerq2 values), or NULL: the default,
// which is the preset with the largest group dividing head_dim, or f16 where none does).
innerq_status kv_cache_config(const innerq_context_params * params, int32_t head_dim, enum iq_type * type_k,
                              enum iq_type * type_v, struct iq_qcache_config * qcfg);
// Bytes of cache one more token takes in all layers (quantized types: in the quantized region,
// b + 32/G bits per element; the windows are a fixed cost on top).
double kv_cache_bytes_per_token(const struct llama_hparams * hp, enum iq_type type_k, enum iq_type type_v,
                                const struct iq_qcache_config * qcfg);

innerq_status kv_cache_init(const struct llama_hparams * hp, iq_backend * be, const innerq_context_params * params,
                            int32_t n_ctx, struct kv_cache ** out);
// Tokens that can be evaluated in one batch with decode semantics: up to and including the
// one after which the cache flushes (INT32_MAX for plain types, which never flush).
int32_t kv_cache_until_flush(const struct kv_cache * cache);
void kv_cache_free(struct kv_cache * cache);
void kv_cache_clear(struct kv_cache * cache);
uint64_t kv_cache_size(const struct kv_cache * cache);
