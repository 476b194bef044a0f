// The KV cache of one sequence: per layer an iq_kv_layer (ggml_innerq/iq-kv.h) whose storage
// is tensors of one backend buffer. Plain types (f32, f16, q8_0, q4_0) are rows of a ggml type;
// quantized types (InnerQ innerq2/innerq3/innerq4, KIVI kivi2/kivi4) are one tensor per region
// (ggml_innerq/iq-qcache.h). The cache owns the bookkeeping, on the host: the tokens stored and
// the quantized regions' counters (kv-plan.h). A batch's ops get a snapshot of it
// (kv_cache_batch); the graph's KV_STORE ops move the data, and kv_cache_commit updates the
// bookkeeping once the graph has run.
#pragma once

#include "innerq.h"
#include "iq-backend.h"
#include "iq-qcache.h"
#include "iq-kv.h"
#include "kv-plan.h"

struct llama_hparams;

struct kv_cache {
    int32_t n_layer;
    int32_t n_ctx;
    int32_t n_past;              // tokens stored (every layer holds the same tokens)
    enum iq_type type_k, type_v;
    bool quantized;              // the types of iq-qcache.h
    struct iq_qcache_config qcfg;  // quantized types: the configuration ...
    struct kv_qstate qstate;       // ... and the counters besides n_past
    struct iq_kv_layer * layers;
    struct iq_context * ctx;     // the storage's tensor structs
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
// The snapshot of the bookkeeping (and for quantized types the flush plan) that the ops of a
// batch of n tokens get; false (+ iq_error_set) if they do not fit.
bool kv_cache_batch(const struct kv_cache * cache, int32_t n, struct iq_kv_batch * batch);
// Commits the bookkeeping of a batch made by kv_cache_batch after its graph ran.
void kv_cache_commit(struct kv_cache * cache, const struct iq_kv_batch * batch, int32_t n);
void kv_cache_free(struct kv_cache * cache);
// Forgets every token and the key normalization.
innerq_status kv_cache_clear(struct kv_cache * cache);
uint64_t kv_cache_size(const struct kv_cache * cache);
