// One layer's KV cache as the attention and kv_store ops see it. The runtime (src/kv-cache.c)
// owns the storage and the bookkeeping; ops read and write the storage, never the bookkeeping:
// what they need of it is a snapshot (struct iq_kv_batch) recorded in their op_params when the
// graph is built, and the runtime commits its counters after the graph ran.
#pragma once

#include "iq-qcache.h"
#include "iq.h"

#ifdef __cplusplus
extern "C" {
#endif

struct iq_kv_layer {
    enum iq_type type_k, type_v;
    int32_t head_dim, n_kv_head, n_ctx;
    // Plain types (f32, f16, q8_0, q4_0): rows of head_dim elements along D, head-major:
    // the row of KV head h, token t is h * n_ctx + t, i.e. ne = {head_dim, n_ctx, n_kv_head}.
    struct iq_tensor * k;
    struct iq_tensor * v;
    // Quantized types (InnerQ innerq2/innerq3/innerq4, KIVI kivi2/kivi4): the configuration and one tensor
    // per region (iq-qcache.h, shapes of iq_qcache_region_shape); k and v are NULL. The ops
    // take the regions as sources IQ_KV_SRC_REGION + r.
    struct iq_qcache_config qcfg;
    struct iq_tensor * region[IQ_QREGION_COUNT];
};

// The runtime's bookkeeping of a layer's cache for one batch, before it runs.
struct iq_kv_batch {
    int32_t n_past;                 // tokens stored before the batch
    // quantized types (zeros for plain ones):
    int32_t n_sink, n_quant;        // sink and quantized tokens before the batch (the window holds the rest)
    struct iq_qcache_flush flush;   // what storing the batch does (the runtime's flush plan)
};

// op_params of ATTENTION and KV_STORE (int32 each): the batch snapshot, then for quantized
// types the configuration, so that a backend runs them from op_params and sources alone.
enum iq_kv_param {
    IQ_KV_P_N_PAST = 0,
    IQ_KV_P_SCALE = 1,       // ATTENTION: f32 scale of q.k
    IQ_KV_P_DECODE = 2,      // ATTENTION: decode semantics (iq_attention_set_decode_semantics)
    IQ_KV_P_N_SINK = 3,
    IQ_KV_P_N_QUANT = 4,
    IQ_KV_P_N_SINK_NEW = 5,  // the flush plan (KV_STORE; ATTENTION records it too)
    IQ_KV_P_N_FLUSH = 6,
    IQ_KV_P_SET_NORMS = 7,
    IQ_KV_P_BITS_K = 8,      // the configuration (struct iq_qcache_config)
    IQ_KV_P_BITS_V = 9,
    IQ_KV_P_GROUP = 10,
    IQ_KV_P_SINK_CAP = 11,   // S
    IQ_KV_P_RECENT_CAP = 12, // R
    IQ_KV_P_ROPE_DIMS = 13,
    IQ_KV_P_FLAGS = 14,      // IQ_KV_F_*
    IQ_KV_P_COUNT = 15,
};
enum iq_kv_flag {
    IQ_KV_F_AXIS_K_TOKENS = 1,
    IQ_KV_F_AXIS_V_TOKENS = 2,
    IQ_KV_F_MODE_SHIFT = 2,  // two bits: enum iq_quant_mode
    IQ_KV_F_KEY_NORM = 16,
    IQ_KV_F_SCORE_CORRECTION = 32,
};
// Sources of ATTENTION (q, k, v) and KV_STORE (after, k, v) before the quantized regions.
#define IQ_KV_SRC_REGION 3

// Cache types a layer can hold: plain ones, stored as rows of a ggml type ...
bool iq_kv_type_is_plain(enum iq_type type);
// ... and every type a cache may use (plain or quantized).
bool iq_kv_type_is_cache(enum iq_type type);

// The quantized cache an ATTENTION or KV_STORE op reads and writes: its layout and counters
// from op_params, its regions' data from the sources (device addresses on a GPU), and the
// flush plan of a KV_STORE. false (+ iq_error_set) for a plain cache or invalid parameters.
bool iq_kv_qcache_of_op(const struct iq_tensor * op, struct iq_qcache * c, struct iq_qcache_flush * flush);

#ifdef __cplusplus
}
#endif
