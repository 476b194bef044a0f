// Cache types and the quantized cache of an op (iq-kv.h).
#include "iq-kv.h"

#include "iq-qcache.h"

bool iq_kv_type_is_plain(enum iq_type type) {
    return type == IQ_TYPE_F32 || type == IQ_TYPE_F16 || type == IQ_TYPE_Q8_0 || type == IQ_TYPE_Q4_0;
}

bool iq_kv_type_is_cache(enum iq_type type) { return iq_kv_type_is_plain(type) || iq_qcache_type_is_quantized(type); }

bool iq_kv_qcache_of_op(const struct iq_tensor * op, struct iq_qcache * c, struct iq_qcache_flush * flush) {
    const struct iq_kv_layer * layer = op->op_ptr;
    if ((op->op != IQ_OP_ATTENTION && op->op != IQ_OP_KV_STORE) || layer == NULL ||
        !iq_qcache_type_is_quantized(layer->type_k)) {
        iq_error_set("%s: not an op over a quantized KV cache", iq_op_name(op->op));
        return false;
    }
    const int32_t * p = op->op_params;
    const int32_t flags = p[IQ_KV_P_FLAGS];
    const struct iq_qcache_config cfg = {
        .bits_k = p[IQ_KV_P_BITS_K],
        .bits_v = p[IQ_KV_P_BITS_V],
        .axis_k = flags & IQ_KV_F_AXIS_K_TOKENS ? IQ_QAXIS_TOKENS : IQ_QAXIS_CHANNELS,
        .axis_v = flags & IQ_KV_F_AXIS_V_TOKENS ? IQ_QAXIS_TOKENS : IQ_QAXIS_CHANNELS,
        .group = p[IQ_KV_P_GROUP],
        .n_sink = p[IQ_KV_P_SINK_CAP],
        .n_recent = p[IQ_KV_P_RECENT_CAP],
        .mode = (enum iq_quant_mode) (flags >> IQ_KV_F_MODE_SHIFT & 3),
        .key_norm = (flags & IQ_KV_F_KEY_NORM) != 0,
        .score_correction = (flags & IQ_KV_F_SCORE_CORRECTION) != 0,
        .rope_dims = p[IQ_KV_P_ROPE_DIMS],
    };
    if (!iq_qcache_layout(c, &cfg, layer->head_dim, layer->n_kv_head, layer->n_ctx)) {
        return false;
    }
    for (int r = 0; r < IQ_QREGION_COUNT; r++) {
        const struct iq_tensor * t = op->src[IQ_KV_SRC_REGION + r];
        if (t == NULL || t->data == NULL || iq_nbytes(t) < c->bytes[r]) {
            iq_error_set("%s: region %d of the quantized cache is missing or too small", iq_op_name(op->op), r);
            return false;
        }
        c->region[r] = t->data;
    }
    c->n_tokens = p[IQ_KV_P_N_PAST];
    c->n_sink = p[IQ_KV_P_N_SINK];
    c->n_quant = p[IQ_KV_P_N_QUANT];
    c->n_recent = c->n_tokens - c->n_sink - c->n_quant;
    *flush = (struct iq_qcache_flush) {p[IQ_KV_P_N_SINK_NEW], p[IQ_KV_P_N_FLUSH], p[IQ_KV_P_SET_NORMS]};
    return true;
}
