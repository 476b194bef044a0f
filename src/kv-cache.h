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
#include "kv-auto.h"
#include "kv-plan.h"

struct llama_hparams;

// `count` consecutive batches of `len` tokens, evaluated with decode semantics or not (a
// one-token batch is recorded without: it is the same either way). The cache keeps the batches
// its tokens came in: whether a prefix of them is what a fresh evaluation would store depends
// on them (innerq_cache_truncate).
struct kv_run {
    int32_t len, count;
    bool decode_semantics;
};

struct kv_cache {
    int32_t n_layer;
    int32_t n_ctx;
    int32_t n_past;              // tokens stored (every layer holds the same tokens)
    enum iq_type type_k, type_v;
    bool quantized;              // the types of iq-qcache.h
    // quantized types: the configuration (each layer's own, layers[il].qcfg, may have other
    // bits: kv_layer_bits, kv_bits) ...
    struct iq_qcache_config qcfg;
    struct kv_qstate qstate;       // ... and the counters besides n_past
    // The automatic layout (kv_bits > 0, kv-auto.h): every layer starts with 2-bit keys and
    // values; at the first flush (layout_ready) each gets its own bits, within units (the sum
    // of b_k + b_v over the layers). The quantized regions of all layers share one pool of
    // the budget's bytes (pool_off, pool_size in buf), placed there by the layout.
    double kv_bits;
    int32_t units;
    bool layout_ready;
    size_t align, pool_off, pool_size;
    // the queries of the KV_AUTO_PROBE positions before the first flush, per layer
    // [n_layer][KV_AUTO_PROBE][n_head][head_dim], which the layout is measured with
    float * probe;
    double (*err)[2][KV_AUTO_CANDIDATES];  // what the choice measured per layer (innerq_kv_layer_info)
    int32_t n_head;
    float kq_scale;
    struct kv_run * runs;        // the batches of tokens [0, n_past), in order
    int32_t n_runs, cap_runs;
    struct iq_kv_layer * layers;
    // Hadamard rotation along head_dim (quantized types): keys and queries after RoPE (rot_k),
    // values before the store and the attention output after it (rot_v); rot: the D x D
    // orthonormal matrix, f32 in the cache's buffer (a MUL_MAT weight, so every backend runs it)
    bool rot_k, rot_v;
    struct iq_tensor * rot;
    struct iq_context * ctx;     // the storage's tensor structs
    iq_buffer * buf;
};

// The cache's types and, for quantized types, its configuration, from the context parameters
// (kv_k / kv_v: a type name, the preset "innerq" (innerq3 keys, innerq2 values), or NULL: the default,
// which is the preset with the backend's group (device_kv_group_default) or else the largest
// group dividing head_dim, or f16 where none does; kv_group 0 is the backend's group).
// gpu: the cache is on the GPU (whose default group is 32, the CPU's 64: device_kv_group_default).
innerq_status kv_cache_config(const innerq_context_params * params, int32_t head_dim, bool gpu, enum iq_type * type_k,
                              enum iq_type * type_v, struct iq_qcache_config * qcfg);
// Bytes of cache one more token takes in all layers (quantized types: in the quantized region,
// b + 32/G bits per element, or the budget kv_bits (> 0) of the automatic layout; the windows
// are a fixed cost on top).
double kv_cache_bytes_per_token(const struct llama_hparams * hp, enum iq_type type_k, enum iq_type type_v,
                                const struct iq_qcache_config * qcfg, double kv_bits);
// Checks params->kv_layer_bits ("IL:K:V,..."; NULL or "": none) and, with n_layer > 0, fills
// bits[il] (keys, values) of the layers it names (the others are left as they are).
innerq_status kv_layer_bits_parse(const char * spec, int32_t n_layer, int32_t (*bits)[2]);

// Whether the Hadamard rotation fits head_dim (a power of two, 16..256).
bool kv_rot_supported(int32_t head_dim);
innerq_status kv_cache_init(const struct llama_hparams * hp, iq_backend * be, const innerq_context_params * params,
                            int32_t n_ctx, struct kv_cache ** out);
// Tokens that can be evaluated in one batch with decode semantics: up to and including the
// one after which the cache flushes (INT32_MAX for plain types, which never flush).
int32_t kv_cache_until_flush(const struct kv_cache * cache);
// The snapshot of the bookkeeping (and for quantized types the flush plan) that the ops of a
// batch of n tokens get; false (+ iq_error_set) if they do not fit.
bool kv_cache_batch(const struct kv_cache * cache, int32_t n, struct iq_kv_batch * batch);
// The automatic layout's choice (kv-auto.h): tokens that can be stored before it is due (0:
// now, before the next token; INT32_MAX: no choice pending), whether a batch of n tokens
// after n_past computes queries the choice is measured with (its graph then outputs every
// layer's queries, and kv_cache_probe_save keeps them), and the choice itself, from the rows in
// the windows and those queries (measured on n_threads threads).
int32_t kv_cache_until_layout(const struct kv_cache * cache);
bool kv_cache_probing(const struct kv_cache * cache, int32_t n_past, int32_t n);
void kv_cache_probe_save(struct kv_cache * cache, struct iq_tensor * const * q, int32_t n_past, int32_t n);
innerq_status kv_cache_layout_choose(struct kv_cache * cache, int32_t n_threads);
// Layer il's layout and the share of its stored groups the quantizer put on the symmetric grid.
innerq_status kv_cache_layer_info(const struct kv_cache * cache, int32_t il, innerq_kv_layer_info * out);
// Commits the bookkeeping of a batch made by kv_cache_batch after its graph ran; false (+
// iq_error_set) if there is no memory to record the batch (the tokens are then not committed).
bool kv_cache_commit(struct kv_cache * cache, const struct iq_kv_batch * batch, int32_t n, bool decode_semantics);
// The longest prefix n <= n_keep of the tokens stored whose state a fresh evaluation of n tokens
// in one innerq_decode call (batches of n_batch, decode semantics as given) shares with this
// cache (docs/INNERQ.md, "Rewinding the cache"); kv_cache_truncate(n) then gives that state.
int32_t kv_cache_rewind_point(const struct kv_cache * cache, int32_t n_keep, int32_t n_batch, bool decode_semantics);
innerq_status kv_cache_truncate(struct kv_cache * cache, int32_t n);

// States (innerq_state_save/load): the counters, the batches and the storage in use, in a byte
// stream. Writing with w == NULL counts the bytes. kv_cache_state_read checks everything before
// it changes the cache: on failure (+ innerq_fail) the cache is as it was.
struct kv_stream {
    uint8_t * w;
    const uint8_t * r;
    size_t pos, size;
};
// Appends n bytes (w == NULL: counts them); takes n bytes, false if fewer are left.
void kv_stream_put(struct kv_stream * s, const void * data, size_t n);
bool kv_stream_get(struct kv_stream * s, void * data, size_t n);
// with_layout: the stream holds each layer's bits (states from version 3 on); without, every
// layer has the cache configuration's.
void kv_cache_state_write(const struct kv_cache * cache, struct kv_stream * s);
innerq_status kv_cache_state_read(struct kv_cache * cache, struct kv_stream * s, bool with_layout);
void kv_cache_free(struct kv_cache * cache);
// Forgets every token and the key normalization.
innerq_status kv_cache_clear(struct kv_cache * cache);
uint64_t kv_cache_size(const struct kv_cache * cache);
