// The quantized KV cache's policy (kv-plan.h).
#include "kv-plan.h"

bool kv_qplan(const struct iq_qcache_config * cfg, int32_t n_ctx, int32_t n_past, const struct kv_qstate * s,
              int32_t n, struct iq_kv_seq * out) {
    if (n < 1 || (int64_t) n_past + n > n_ctx) {
        iq_error_set("quantized KV cache: %d tokens + %d new exceed the context of %d", n_past, n, n_ctx);
        return false;
    }
    const int32_t room = cfg->n_sink - s->n_sink;
    const int32_t to_sink = n < room ? n : room;
    const int32_t window = n_past - s->n_sink - s->n_quant + n - to_sink;  // before the flush
    const int32_t r = cfg->n_recent, g = cfg->group;
    const int32_t blocks = window >= r + g ? (window - r) / g : 0;
    out->n_past = n_past;
    out->n_sink = s->n_sink;
    out->n_quant = s->n_quant;
    out->flush = (struct iq_qcache_flush) {
        .n_sink_new = to_sink, .n_flush = blocks, .set_norms = blocks > 0 && cfg->key_norm && !s->norms_ready,
    };
    return true;
}

void kv_qcommit(const struct iq_qcache_config * cfg, const struct iq_kv_seq * b, struct kv_qstate * s) {
    s->n_sink = b->n_sink + b->flush.n_sink_new;
    s->n_quant = b->n_quant + b->flush.n_flush * cfg->group;
    s->norms_ready = s->norms_ready || b->flush.set_norms;
}

int32_t kv_quntil_flush(const struct iq_qcache_config * cfg, int32_t n_past, const struct kv_qstate * s) {
    const int32_t n_recent = n_past - s->n_sink - s->n_quant;
    return (cfg->n_sink - s->n_sink) + (cfg->n_recent + cfg->group - n_recent);
}

struct kv_qstate kv_qcounters(const struct iq_qcache_config * cfg, int32_t n_past) {
    const int32_t sink = n_past < cfg->n_sink ? n_past : cfg->n_sink;
    const int32_t window = n_past - sink, r = cfg->n_recent, g = cfg->group;
    const int32_t n_quant = window >= r + g ? (window - r) / g * g : 0;
    return (struct kv_qstate) { .n_sink = sink, .n_quant = n_quant, .norms_ready = cfg->key_norm && n_quant > 0 };
}
