// The quantized cache formats, InnerQ (innerq2 .. innerq5; docs/DESIGN.md section 3) and KIVI
// (kivi2, kivi4; 3.5): per sequence a sink and a recent window of f16 rows in its slot, and
// quantized blocks of G tokens in pages of the pool (ggml_innerq/iq-qcache.h). When a store
// flushes is the policy of kv-plan.c; a rewind keeps the blocks below it and the windows' rows.
#include "hparams.h"
#include "kv-cache.h"
#include "status.h"

#include <limits.h>
#include <math.h>

static bool innerq_has_type(enum iq_type t) {
    return t == IQ_TYPE_INNERQ2 || t == IQ_TYPE_INNERQ3 || t == IQ_TYPE_INNERQ4 || t == IQ_TYPE_INNERQ5;
}

static bool kivi_has_type(enum iq_type t) { return t == IQ_TYPE_KIVI2 || t == IQ_TYPE_KIVI4; }

// The default windows' caps: the rule of thumb's values at L = 8192, where growing them was
// measured to pay (docs/ACCURACY.md, "The windows at n_ctx 8192"). Past that f16 rows would take
// a fixed share of the cache (n_ctx/12.8 rows, 4.0 effective bits at G 64 instead of 3.0); with
// the caps the preset stays under 3.3 (CPU, G 64) and 3.8 (GPU, G 32) effective bits from 32K on.
// Value row scales take 0.0625 bits of those (D 64): with them the caps are S 64, R 448, which
// at n_ctx 8192 measured 0.82x / 0.73x / 0.98x the KLD of S 128, R 512 without them
// (docs/ACCURACY.md, "Value row scales").
#define KV_SINK_CAP 128
#define KV_RECENT_CAP 512
#define KV_SINK_CAP_SCALED 64
#define KV_RECENT_CAP_SCALED 448

static innerq_status quant_defaults(struct kv_config * cfg) {
    if (!iq_qcache_config_default(cfg->type_k, cfg->type_v, cfg->qcfg.group, &cfg->qcfg)) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "%s", iq_error_get());
    }
    return INNERQ_OK;
}

// The key channels RoPE rotates in pairs share a normalization; after a rotation along head_dim
// there are no pairs.
static void quant_rope_dims(const innerq_context_params * p, const struct llama_hparams * hp, struct kv_config * cfg) {
    cfg->qcfg.rope_dims = hp != NULL && p->kv_norm_pairs && !cfg->rot_k ? hp->n_rot / 2 * 2 : 0;
}

// KIVI keeps its published definition: no sink, R = 128, asymmetric, no normalization.
static innerq_status kivi_configure(const innerq_context_params * p, const struct llama_hparams * hp,
                                    struct kv_config * cfg) {
    const innerq_status st = quant_defaults(cfg);
    quant_rope_dims(p, hp, cfg);
    return st;
}

static innerq_status innerq_configure_rest(const innerq_context_params * p, const struct llama_hparams * hp,
                                           struct kv_config * cfg);

static innerq_status innerq_configure(const innerq_context_params * p, const struct llama_hparams * hp,
                                      struct kv_config * cfg) {
    innerq_status st = quant_defaults(cfg);
    if (st != INNERQ_OK) {
        return st;
    }
    struct iq_qcache_config * q = &cfg->qcfg;
    // default windows scale with the length one sequence may expect (docs/INNERQ.md, "Windows"):
    // the rule of thumb w_sink = L/64, w_recent = L/16 for L = n_ctx / n_slots, with this
    // runtime's earlier fixed windows (S 32, R 96) as the floors and KV_*_CAP as the caps; a
    // window of more than n_ctx behaves as one of n_ctx
    const int32_t len = cfg->n_slots > 0 ? cfg->n_ctx / cfg->n_slots : 0, n_ctx = cfg->n_ctx > 0 ? cfg->n_ctx : INT32_MAX;
    q->value_scales = cfg->value_scales;
    q->params8 = cfg->params8;
    q->key_levels = cfg->key_levels;
    const int32_t sink_cap = q->value_scales ? KV_SINK_CAP_SCALED : KV_SINK_CAP;
    const int32_t recent_cap = q->value_scales ? KV_RECENT_CAP_SCALED : KV_RECENT_CAP;
    const int32_t sink_floor = q->n_sink, recent_floor = q->n_recent;
    const int32_t sink = len / 64 < sink_cap ? len / 64 : sink_cap;
    const int32_t recent = len / 16 < recent_cap ? len / 16 : recent_cap;
    q->n_sink = p->kv_sink >= 0 ? (p->kv_sink < n_ctx ? p->kv_sink : n_ctx) : sink > q->n_sink ? sink : q->n_sink;
    q->n_recent = p->kv_recent >= 0 ? (p->kv_recent < n_ctx ? p->kv_recent : n_ctx)
                                    : recent > q->n_recent ? recent : q->n_recent;
    if (p->kv_recent < 0 && hp != NULL && hp->n_swa > 0 && hp->n_swa + q->group > q->n_recent) {
        // the sliding window and one block more: a sliding-window layer then reads every
        // position it sees at f16 (the windows hold the same positions on every layer; on Gemma 3
        // 270M this halves the cache's KLD against f16, docs/ACCURACY.md) and keeps no blocks
        // (kv_config_window_only); the block more lets a rewind of up to G + 1 tokens keep the
        // rows such a layer reads (quant_keep)
        const int64_t r = (int64_t) hp->n_swa + q->group;
        q->n_recent = r < n_ctx ? (int32_t) r : n_ctx;
    }
    // the preset's own windows (cfg->preset_budget): the floors, and a sliding window's rows as above
    const int64_t preset_recent = hp != NULL && hp->n_swa > 0 && hp->n_swa + q->group > recent_floor
                                      ? (int64_t) hp->n_swa + q->group : recent_floor;
    cfg->preset_sink = sink_floor < n_ctx ? sink_floor : n_ctx;
    cfg->preset_recent = preset_recent < n_ctx ? (int32_t) preset_recent : n_ctx;
    q->mode = !p->kv_hybrid ? IQ_QUANT_ASYM : p->kv_search ? IQ_QUANT_SEARCH : IQ_QUANT_HYBRID;
    q->key_norm = p->kv_norm;
    q->score_correction = p->kv_debias;
    if (p->kv_bits != 0.0f) {
        // the whole cache's bits at n_ctx: at least the smallest layout's without windows (which
        // the cache checks with them, kv_layout_budget), at most f16's
        const double lo = kv_auto_bits_min(q->group, cfg->params8), hi = 16.0;
        if (!isfinite(p->kv_bits) || p->kv_bits < lo - 1e-6 || p->kv_bits > hi) {
            return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_bits %g is out of range: %.3g .. %.3g effective bits per "
                               "element at group %d (windows, (d, m) and norms included)", p->kv_bits, lo, hi, q->group);
        }
        if (cfg->n_slots > 1) {
            // a pool of sequences: no one prompt to choose from; the preset's fixed order within
            // the budget instead (kv-cache.c, kv_preset_layout)
            cfg->pool_bits = p->kv_bits;
            return innerq_configure_rest(p, hp, cfg);
        }
        // until the layout is chosen every layer holds the smallest format
        cfg->kv_bits = p->kv_bits;
        cfg->type_k = cfg->type_v = IQ_TYPE_INNERQ2;
        q->bits_k = q->bits_v = KV_AUTO_BITS_MIN;
    }
    return innerq_configure_rest(p, hp, cfg);
}

// The rotation, and the key options it rules out.
static innerq_status innerq_configure_rest(const innerq_context_params * p, const struct llama_hparams * hp,
                                           struct kv_config * cfg) {
    struct iq_qcache_config * q = &cfg->qcfg;
    if (hp != NULL && kv_rot_supported(hp->head_dim)) {
        // the rotation: InnerQ (not KIVI), head_dim a power of two
        const int32_t rot = p->kv_rot < 0 ? 3 : p->kv_rot;
        cfg->rot_k = (rot & 1) != 0;
        cfg->rot_v = (rot & 2) != 0;
    }
    quant_rope_dims(p, hp, cfg);
    if (cfg->rot_k) {
        // Rotated keys have no outlier channels for the normalization to flatten, and with them
        // both the normalization and the score correction were measured to cost accuracy
        // (docs/ACCURACY.md): they apply to unrotated keys only.
        q->key_norm = false;
        q->score_correction = false;
    }
    // The correction's variance is the uniform grid's (d^2 / 12): keys on the key levels go without
    // it (they are meant for rotated keys, where it is off anyway).
    q->score_correction = q->score_correction && !q->key_levels;
    return INNERQ_OK;
}

// A page is a block; one sequence of n_ctx tokens fills at most iq_qcache_blocks_max of them,
// and so do all sequences together while they hold n_ctx tokens (each keeps S + R of its
// tokens in its windows, in its slot).
static void quant_shape(struct kv_config * cfg) {
    cfg->page = cfg->qcfg.group;
    cfg->n_table = iq_qcache_blocks_max(&cfg->qcfg, cfg->n_ctx);
    cfg->n_pages = cfg->n_table;
}

static double quant_bytes_per_token(const struct kv_config * cfg, const struct llama_hparams * hp) {
    const double heads = (double) kv_config_block_layers(cfg, hp) * hp->n_head_kv;  // window-only layers: none
    const int32_t g = cfg->qcfg.group;
    const bool p8 = cfg->qcfg.params8;
    const double per_group = (p8 ? 16.0 : 32.0) / g;  // (d, m) per group: two fp16, or a byte each
    const double refs = p8 ? 2.0 * IQ_P8_REFS / g : 0.0;  // bytes: a key and a value block's references per G tokens
    const int32_t units = cfg->units > 0 ? cfg->units : kv_auto_units(cfg->kv_bits, g, p8, hp->n_layer);
    // the layers' code bits: the automatic layout's budget, or kv_layer_bits' (units), else the types'
    const double codes = cfg->kv_bits > 0.0 || cfg->units > 0 ? (double) units / hp->n_layer
                                                                : cfg->qcfg.bits_k + cfg->qcfg.bits_v;
    return heads * (hp->head_dim * (codes + 2.0 * per_group) / 8.0 + refs + (cfg->qcfg.value_scales ? 1.0 : 0.0));
}

static bool quant_region_pooled(const struct kv_cache * c, int r) {
    return c->cfg.kv_bits > 0.0 && (r == IQ_QREGION_QUANT_K || r == IQ_QREGION_QUANT_V);
}

static void quant_layout_of(const struct kv_cache * c, const struct iq_kv_layer * l, struct iq_qcache * lay) {
    iq_qcache_pool_layout(lay, &l->qcfg, c->head_dim, c->n_kv_head, c->cfg.n_ctx, c->cfg.n_slots, l->n_pages);
}

// Per layer one tensor per region, at the offsets of iq_qcache_pool_layout of the layer's
// configuration; with the automatic layout the quantized regions go to its arena (kv-layout.c).
static innerq_status quant_layer_init(struct kv_cache * c, int32_t il, size_t * bytes) {
    struct iq_kv_layer * l = &c->layers[il];
    struct iq_qcache lay;
    if (!iq_qcache_pool_layout(&lay, &l->qcfg, c->head_dim, c->n_kv_head, c->cfg.n_ctx, c->cfg.n_slots,
                               l->n_pages)) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "KV cache %s/%s: %s", iq_type_name(l->type_k),
                           iq_type_name(l->type_v), iq_error_get());
    }
    for (int r = 0; r < IQ_QREGION_COUNT; r++) {
        enum iq_type type;
        int64_t ne[4];
        iq_qcache_region_shape(&lay, (enum iq_qregion) r, &type, ne);
        l->region[r] = iq_new_tensor(c->ctx, type, 4, ne);
        if (l->region[r] == NULL) {
            return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "KV cache: %s", iq_error_get());
        }
        iq_set_name(l->region[r], "cache_q%d.%d", r, il);
    }
    *bytes = c->cfg.kv_bits > 0.0 ? lay.off[IQ_QREGION_QUANT_K] : lay.size;
    return INNERQ_OK;
}

static void quant_layer_place(struct kv_cache * c, int32_t il, size_t off) {
    struct iq_kv_layer * l = &c->layers[il];
    struct iq_qcache lay;
    quant_layout_of(c, l, &lay);
    for (int r = 0; r < IQ_QREGION_COUNT; r++) {
        if (!quant_region_pooled(c, r)) {
            iq_tensor_place(l->region[r], c->buf[c->layer_dev[il]], off + lay.off[r]);
        }
    }
}

static void quant_plan(const struct kv_config * cfg, const struct kv_seq * s, int32_t n, struct iq_kv_seq * row) {
    kv_qplan(&cfg->qcfg, cfg->n_ctx, s->n_past, &s->q, n, row);  // the caller checked that n fits
}

static int32_t quant_pages_after(const struct kv_config * cfg, const struct iq_kv_seq * row) {
    return row->n_quant / cfg->qcfg.group + row->flush.n_flush;
}

static void quant_commit(const struct kv_config * cfg, const struct iq_kv_seq * row, struct kv_seq * s) {
    kv_qcommit(&cfg->qcfg, row, &s->q);
}

static int32_t quant_until_flush(const struct kv_config * cfg, const struct kv_seq * s) {
    return kv_quntil_flush(&cfg->qcfg, s->n_past, &s->q);
}

// Tokens from n on go: the window's rows below n stay (the window may hold fewer than R), a
// block that n cuts goes with its tokens (a value group spans the block's G tokens), and below
// the sink's end the sink's rows stay and the normalization waits for the next first flush.
static int32_t quant_keep(const struct kv_config * cfg, const struct kv_seq * s, int32_t n, struct kv_seq * out) {
    *out = *s;
    n = n < s->n_past ? n : s->n_past;
    const int32_t sink = s->q.n_sink, quant = s->q.n_quant, g = cfg->qcfg.group;
    if (n >= sink + quant) {
        out->n_past = n;
    } else if (n >= sink) {
        out->q.n_quant = (n - sink) / g * g;
        out->n_past = sink + out->q.n_quant;
    } else {
        out->q.n_sink = n;
        out->q.n_quant = 0;
        out->n_past = n;
    }
    if (out->q.n_quant > 0 && out->n_past - out->q.n_sink - out->q.n_quant < cfg->swa_rows) {
        // a window-only layer would lack the window's oldest positions (they were flushed into
        // blocks it does not keep): back to the sink, whose rows every layer holds
        out->q.n_quant = 0;
        out->n_past = out->q.n_sink;
    }
    out->q.norms_ready = out->q.norms_ready && out->q.n_quant > 0;
    out->n_pages = out->q.n_quant / g;
    return out->n_past;
}

// A quantized cache can give back the state of n tokens only while it still holds that
// state's recent window in f16, that is while n needs the same quantized blocks it stores
// (n >= S + R + n_quant; tokens flushed since are lost), or n needs none and no window
// (n <= S: the sink alone).
static int32_t quant_exact_fit(const struct kv_config * cfg, const struct kv_seq * s, int32_t lo, int32_t hi) {
    if (s->q.n_quant == 0 || hi >= cfg->qcfg.n_sink + cfg->qcfg.n_recent + s->q.n_quant) {
        return hi;
    }
    const int32_t sink = hi < cfg->qcfg.n_sink ? hi : cfg->qcfg.n_sink;
    return sink > lo ? sink : 0;
}

// Per layer the regions in order (enum iq_qregion): the slot's norms, per head the sink's rows,
// the window's rows, then per head the blocks in table order (pages that follow each other in
// the pool as one chunk).
static void quant_walk(const struct kv_cache * c, int32_t slot, const struct kv_seq * s, kv_chunk_fn fn, void * arg) {
    const int32_t * table = c->table + (size_t) slot * c->cfg.n_table;
    const int32_t n_recent = s->n_past - s->q.n_sink - s->q.n_quant, n_blocks = s->q.n_quant / c->cfg.qcfg.group;
    for (int32_t il = 0; il < c->n_layer; il++) {
        struct iq_tensor * const * reg = c->layers[il].region;
        fn(reg[IQ_QREGION_NORM], (size_t) slot * reg[IQ_QREGION_NORM]->nb[2], reg[IQ_QREGION_NORM]->nb[2], arg);
        const int32_t rows[] = {s->q.n_sink, s->q.n_sink, n_recent, n_recent};
        for (int r = IQ_QREGION_SINK_K; r <= IQ_QREGION_RECENT_V; r++) {
            for (int64_t h = 0; h < reg[r]->ne[2] && rows[r - IQ_QREGION_SINK_K] > 0; h++) {
                fn(reg[r], (size_t) slot * reg[r]->nb[3] + (size_t) h * reg[r]->nb[2],
                   (size_t) rows[r - IQ_QREGION_SINK_K] * reg[r]->nb[1], arg);
            }
        }
        for (int r = IQ_QREGION_QUANT_K; r <= IQ_QREGION_QUANT_V && c->layers[il].n_pages > 0; r++) {
            for (int64_t h = 0; h < reg[r]->ne[2]; h++) {
                for (int32_t j = 0; j < n_blocks;) {
                    int32_t e = j + 1;
                    while (e < n_blocks && table[e] == table[e - 1] + 1) {
                        e++;
                    }
                    fn(reg[r], (size_t) h * reg[r]->nb[2] + (size_t) table[j] * reg[r]->nb[1],
                       (size_t) (e - j) * reg[r]->nb[1], arg);
                    j = e;
                }
            }
        }
    }
}

#define QUANT_FORMAT_ROWS                  \
    .quantized = true,                     \
    .shape = quant_shape,                  \
    .bytes_per_token = quant_bytes_per_token, \
    .layer_init = quant_layer_init,        \
    .layer_place = quant_layer_place,      \
    .plan = quant_plan,                    \
    .pages_after = quant_pages_after,      \
    .commit = quant_commit,                \
    .until_flush = quant_until_flush,      \
    .keep = quant_keep,                    \
    .exact_fit = quant_exact_fit,          \
    .walk = quant_walk

const struct kv_format kv_format_innerq = {
    .name = "innerq",
    .has_type = innerq_has_type,
    .configure = innerq_configure,
    QUANT_FORMAT_ROWS,
};

const struct kv_format kv_format_kivi = {
    .name = "kivi",
    .has_type = kivi_has_type,
    .configure = kivi_configure,
    QUANT_FORMAT_ROWS,
};
