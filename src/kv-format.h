// Cache formats: each is a row of one table (kv_format_find), holding everything the runtime
// does differently for it: its options, its storage and the pool's shape for it, what a step
// does to a sequence (plan and commit), what a rewind keeps, and which storage a sequence
// uses (states, copies). The ops read the storage a row lays out (iq-kv.h); the specification
// of what a store and an attention do is the tensor library's reference code (plain rows:
// iq_type_traits; quantized: iq-qcache.h). Adding a format is a file of its own and a row.
#pragma once

#include "innerq.h"
#include "iq-kv.h"

struct kv_cache;
struct kv_config;
struct kv_seq;
struct llama_hparams;

// A part of a sequence's storage: bytes [offset, offset + size) of tensor t.
typedef void (*kv_chunk_fn)(struct iq_tensor * t, size_t offset, size_t size, void * arg);

struct kv_format {
    const char * name;
    bool quantized;  // regions of iq-qcache.h (the ops' quantized path); else plain rows
    // Whether keys or values of this type are stored in this format.
    bool (*has_type)(enum iq_type type);
    // The options of the format from the parameters for a model of hp (NULL: names and options
    // only), cfg's types, group request, n_ctx and n_slots set; the pool's shape for cfg->n_ctx
    // tokens of cfg->n_slots sequences (page, n_pages, n_table).
    innerq_status (*configure)(const innerq_context_params * p, const struct llama_hparams * hp,
                               struct kv_config * cfg);
    void (*shape)(struct kv_config * cfg);
    // Bytes of cache one more token takes in all layers, where the cache grows.
    double (*bytes_per_token)(const struct kv_config * cfg, const struct llama_hparams * hp);
    // Layer il's storage tensors in the cache's arena and the bytes of their block; then, once
    // the buffer is made, their places in it from offset off (the block's start).
    innerq_status (*layer_init)(struct kv_cache * c, int32_t il, size_t * bytes);
    void (*layer_place)(struct kv_cache * c, int32_t il, size_t off);
    // The step's row of a sequence that stores n tokens (counters before, the flush plan); the
    // pages it holds once the step ran; the counters after.
    void (*plan)(const struct kv_config * cfg, const struct kv_seq * s, int32_t n, struct iq_kv_seq * row);
    int32_t (*pages_after)(const struct kv_config * cfg, const struct iq_kv_seq * row);
    void (*commit)(const struct kv_config * cfg, const struct iq_kv_seq * row, struct kv_seq * s);
    // Tokens stored one at a time until (and with) the one after which the cache flushes
    // (INT32_MAX: never): a batch of at most that many flushes at most once, at its end.
    int32_t (*until_flush)(const struct kv_config * cfg, const struct kv_seq * s);
    // The counters of the longest prefix n' <= n of the sequence that keeps its rows as they are
    // stored when the tokens from n' on are removed (docs/DESIGN.md 3.6); returns n'.
    int32_t (*keep)(const struct kv_config * cfg, const struct kv_seq * s, int32_t n, struct kv_seq * out);
    // The largest n in (lo, hi] whose state a fresh evaluation of n tokens would store in the
    // same rows (exact rewinds; docs/INNERQ.md, "Rewinding the cache"), or 0 if none.
    int32_t (*exact_fit)(const struct kv_config * cfg, const struct kv_seq * s, int32_t lo, int32_t hi);
    // The storage sequence `slot` uses with counters s, in the order states hold it.
    void (*walk)(const struct kv_cache * c, int32_t slot, const struct kv_seq * s, kv_chunk_fn fn, void * arg);
};

extern const struct kv_format kv_format_plain;   // f32, f16, q8_0, q4_0 rows (kv-fmt-plain.c)
extern const struct kv_format kv_format_innerq;  // innerq2 .. innerq5 (kv-fmt-quant.c)
extern const struct kv_format kv_format_kivi;    // kivi2, kivi4 (kv-fmt-quant.c)
#ifdef INNERQ_TEST_FORMATS
extern const struct kv_format kv_format_test;    // bf16 in pages of one tile, test builds only (kv-fmt-test.c)
#endif

// Whether a format stores keys or values of this type (the cache type names: kv-config.c).
bool kv_format_has_type(enum iq_type type);

// The format of a pair of cache types; NULL (+ innerq_fail) if they do not pair.
const struct kv_format * kv_format_of(enum iq_type type_k, enum iq_type type_v);
