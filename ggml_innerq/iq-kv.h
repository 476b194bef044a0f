// One layer's KV cache as the attention op sees it. The runtime (src/kv-cache.c) owns the
// storage and the bookkeeping; backends read and write the data through this description.
#pragma once

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
};

// Cache types a layer can hold.
bool iq_kv_type_is_plain(enum iq_type type);

#ifdef __cplusplus
}
#endif
