// The KV cache of one sequence: per layer an iq_kv_layer (ggml_innerq/iq-kv.h) whose storage
// lives in one backend buffer. The cache tracks how many tokens are stored; the graph's
// KV_STORE ops move the data.
#pragma once

#include "innerq.h"
#include "iq-backend.h"
#include "iq-kv.h"

struct llama_hparams;

struct kv_cache {
    int32_t n_layer;
    int32_t n_ctx;
    int32_t n_past;              // tokens stored
    enum iq_type type_k, type_v;
    struct iq_kv_layer * layers;
    struct iq_context * ctx;     // tensor structs of the storage
    iq_buffer * buf;
};

// Resolves params->kv_k / kv_v (NULL: the default type) to cache types.
innerq_status kv_cache_types(const innerq_context_params * params, enum iq_type * type_k, enum iq_type * type_v);
// Bytes of cache one token takes in all layers.
double kv_cache_bytes_per_token(const struct llama_hparams * hp, enum iq_type type_k, enum iq_type type_v);

innerq_status kv_cache_init(const struct llama_hparams * hp, iq_backend * be, const innerq_context_params * params,
                            int32_t n_ctx, struct kv_cache ** out);
void kv_cache_free(struct kv_cache * cache);
void kv_cache_clear(struct kv_cache * cache);
uint64_t kv_cache_size(const struct kv_cache * cache);
