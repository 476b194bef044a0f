// One layer's KV cache as the attention op sees it. The runtime (src/kv-cache.c) owns the
// storage and the bookkeeping; backends read and write the data through this description.
#pragma once

#include "iq.h"

struct iq_qcache;

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
    // Quantized types (InnerQ iq2/iq3/iq4, KIVI kivi2/kivi4): the layer's regions and state
    // (iq-innerq.h), over memory of a host buffer; k and v are NULL.
    struct iq_qcache * qc;
};

// Cache types a layer can hold: plain ones, stored as rows of a ggml type ...
bool iq_kv_type_is_plain(enum iq_type type);
// ... and every type a cache may use (plain or quantized).
bool iq_kv_type_is_cache(enum iq_type type);

#ifdef __cplusplus
}
#endif
