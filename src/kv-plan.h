// The quantized KV cache's policy (docs/DESIGN.md 3.2, 3.3): its counters, the flush plan of a
// batch, and the commit after the batch ran. The ops carry a plan out (iq_qcache_store_head);
// the counters live here, on the host, whatever device holds the storage.
#pragma once

#include "iq-kv.h"

#ifdef __cplusplus
extern "C" {
#endif

// A quantized cache's counters besides the tokens stored (n_past, kept by the cache for every
// type): the window holds n_past - n_sink - n_quant tokens.
struct kv_qstate {
    int32_t n_sink, n_quant;
    bool norms_ready;  // the key normalization is set (by the first flush; docs/DESIGN.md 3.3)
};

// The step's row (counters before and flush plan; iq-kv.h) of storing n tokens after n_past: the
// sink fills first, then while the window holds >= R + G tokens its oldest G are quantized; the
// first flush sets the key normalization. The row's slot and tokens are the caller's. false (+
// iq_error_set) if the tokens do not fit in n_ctx.
bool kv_qplan(const struct iq_qcache_config * cfg, int32_t n_ctx, int32_t n_past, const struct kv_qstate * s,
              int32_t n, struct iq_kv_seq * out);
// The counters after the step of row b ran (n_past is the caller's).
void kv_qcommit(const struct iq_qcache_config * cfg, const struct iq_kv_seq * b, struct kv_qstate * s);
// How many tokens appended one at a time make the next flush: it runs after the last of them.
// A store of at most this many tokens flushes at most once, at its end, as single stores do.
int32_t kv_quntil_flush(const struct iq_qcache_config * cfg, int32_t n_past, const struct kv_qstate * s);
// The counters after n_past tokens, however they were cut into stores: every store flushes
// until the window holds fewer than R + G tokens, so the window ends at R..R+G-1 tokens (or
// below R + G without a flush) and the quantized region at the multiple of G that leaves it so.
struct kv_qstate kv_qcounters(const struct iq_qcache_config * cfg, int32_t n_past);

#ifdef __cplusplus
}
#endif
