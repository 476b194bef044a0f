// The InnerQ / KIVI quantized KV cache: configuration, storage layout, what a store does given
// its flush plan, and reading stored tokens. The layout is documented in iq-qcache.h; the
// block format is in iq-qblock.c, the reference attention in iq-qcache-ref.c; when to flush
// and the counters are the runtime's (src/kv-plan.c).
#include "iq-qcache.h"

#include "iq.h"

#include <math.h>

#define IQ_QCACHE_ALIGN 64

bool iq_qcache_type_is_quantized(enum iq_type type) {
    return type == IQ_TYPE_INNERQ2 || type == IQ_TYPE_INNERQ3 || type == IQ_TYPE_INNERQ4 || type == IQ_TYPE_INNERQ5 ||
           type == IQ_TYPE_KIVI2 || type == IQ_TYPE_KIVI4;
}

static int32_t iq_innerq_bits(enum iq_type type) {
    return type == IQ_TYPE_INNERQ2 ? 2
           : type == IQ_TYPE_INNERQ3 ? 3
           : type == IQ_TYPE_INNERQ4 ? 4
           : type == IQ_TYPE_INNERQ5 ? 5
                                     : 0;
}

static int32_t iq_kivi_bits(enum iq_type type) {
    return type == IQ_TYPE_KIVI2 ? 2 : type == IQ_TYPE_KIVI4 ? 4 : 0;
}

bool iq_qcache_config_default(enum iq_type type_k, enum iq_type type_v, int32_t group,
                              struct iq_qcache_config * cfg) {
    group = group != 0 ? group : 64;
    if (iq_innerq_bits(type_k) && iq_innerq_bits(type_v)) {
        *cfg = (struct iq_qcache_config) {iq_innerq_bits(type_k), iq_innerq_bits(type_v), IQ_QAXIS_CHANNELS,
                                          IQ_QAXIS_TOKENS, group, 32, 96, IQ_QUANT_HYBRID, true, true, 0, false,
                                          false, false};
        return true;
    }
    if (iq_kivi_bits(type_k) && iq_kivi_bits(type_v)) {
        *cfg = (struct iq_qcache_config) {iq_kivi_bits(type_k), iq_kivi_bits(type_v), IQ_QAXIS_TOKENS,
                                          IQ_QAXIS_CHANNELS, group, 0, 128, IQ_QUANT_ASYM, false, false, 0, false,
                                          false, false};
        return true;
    }
    iq_error_set("KV cache types %s/%s: keys and values must both be InnerQ (innerq2 .. innerq5) or both KIVI",
                 iq_type_name(type_k), iq_type_name(type_v));
    return false;
}

// ---- layout ----

static size_t iq_align(size_t n) { return (n + IQ_QCACHE_ALIGN - 1) / IQ_QCACHE_ALIGN * IQ_QCACHE_ALIGN; }

static bool iq_qcache_config_check(const struct iq_qcache_config * cfg, int32_t head_dim, int32_t n_kv_head,
                                   int32_t n_ctx) {
    const int32_t g = cfg->group;
    // 5-bit codes are InnerQ's only (the KIVI kernels read 2 and 4 bits)
    const int32_t max_k = cfg->axis_k == IQ_QAXIS_CHANNELS ? 5 : 4, max_v = cfg->axis_v == IQ_QAXIS_TOKENS ? 5 : 4;
    if (cfg->bits_k < 2 || cfg->bits_k > max_k || cfg->bits_v < 2 || cfg->bits_v > max_v) {
        iq_error_set("quantized KV cache: bits must be 2 to %d for keys and 2 to %d for values (got %d, %d)", max_k,
                     max_v, cfg->bits_k, cfg->bits_v);
        return false;
    }
    if (g != 32 && g != 64 && g != 128) {
        iq_error_set("quantized KV cache: group size must be 32, 64 or 128 (got %d)", g);
        return false;
    }
    if (head_dim <= 0 || head_dim % 16 != 0 || head_dim > IQ_QCACHE_MAX_HEAD_DIM ||
        (cfg->axis_k == IQ_QAXIS_CHANNELS && head_dim % g != 0) ||
        (cfg->axis_v == IQ_QAXIS_CHANNELS && head_dim % g != 0)) {
        iq_error_set("quantized KV cache: head_dim %d must be a multiple of 16 (and of the group size %d for "
                     "groups along channels), at most %d", head_dim, g, IQ_QCACHE_MAX_HEAD_DIM);
        return false;
    }
    if (n_kv_head <= 0 || n_ctx <= 0 || cfg->n_sink < 0 || cfg->n_recent < 0 ||
        (unsigned) cfg->mode > IQ_QUANT_SEARCH || (unsigned) cfg->axis_k > IQ_QAXIS_TOKENS ||
        (unsigned) cfg->axis_v > IQ_QAXIS_TOKENS) {
        iq_error_set("quantized KV cache: invalid shape or configuration (n_kv_head %d, n_ctx %d, sink %d, "
                     "recent %d)", n_kv_head, n_ctx, cfg->n_sink, cfg->n_recent);
        return false;
    }
    if (cfg->value_scales && cfg->axis_v != IQ_QAXIS_TOKENS) {
        iq_error_set("quantized KV cache: value row scales need values grouped along tokens (InnerQ)");
        return false;
    }
    if (cfg->params8 && (cfg->axis_k != IQ_QAXIS_CHANNELS || cfg->axis_v != IQ_QAXIS_TOKENS)) {
        iq_error_set("quantized KV cache: 8-bit group parameters are for InnerQ caches (keys along channels, "
                     "values along tokens)");
        return false;
    }
    if (cfg->key_levels && (cfg->axis_k != IQ_QAXIS_CHANNELS || cfg->mode != IQ_QUANT_SEARCH ||
                            cfg->score_correction)) {
        iq_error_set("quantized KV cache: key levels are for InnerQ keys with the searched quantizer and no score "
                     "correction (its variance is the uniform grid's)");
        return false;
    }
    if (cfg->rope_dims < 0 || cfg->rope_dims > head_dim || cfg->rope_dims % 2 != 0) {
        iq_error_set("quantized KV cache: rope_dims %d must be even and at most head_dim %d", cfg->rope_dims,
                     head_dim);
        return false;
    }
    return true;
}

bool iq_qcache_pool_layout(struct iq_qcache * c, const struct iq_qcache_config * cfg, int32_t head_dim,
                           int32_t n_kv_head, int32_t n_ctx, int32_t n_slots, int32_t n_pages) {
    if (!iq_qcache_config_check(cfg, head_dim, n_kv_head, n_ctx)) {
        return false;
    }
    if (n_slots < 1 || n_pages < 0) {
        iq_error_set("quantized KV cache: %d sequences, %d pages", n_slots, n_pages);
        return false;
    }
    memset(c, 0, sizeof(*c));
    c->cfg = *cfg;
    c->head_dim = head_dim;
    c->n_kv_head = n_kv_head;
    c->n_ctx = n_ctx;
    c->n_slots = n_slots;
    c->cap_recent = cfg->n_recent + cfg->group;
    c->cap_blocks = n_pages;
    c->n_table = n_pages;
    c->block_bytes_k = iq_qblock_bytes_fmt(cfg->bits_k, head_dim, cfg->group, iq_qcache_fmt(cfg, false));
    c->block_bytes_v = iq_qblock_bytes_fmt(cfg->bits_v, head_dim, cfg->group, iq_qcache_fmt(cfg, true));
    const size_t hd = (size_t) n_slots * n_kv_head * head_dim;
    c->bytes[IQ_QREGION_NORM] = hd * sizeof(float);
    c->bytes[IQ_QREGION_SINK_K] = c->bytes[IQ_QREGION_SINK_V] = hd * cfg->n_sink * sizeof(iq_fp16_t);
    c->bytes[IQ_QREGION_RECENT_K] = c->bytes[IQ_QREGION_RECENT_V] = hd * c->cap_recent * sizeof(iq_fp16_t);
    c->bytes[IQ_QREGION_QUANT_K] = (size_t) n_kv_head * n_pages * c->block_bytes_k;
    c->bytes[IQ_QREGION_QUANT_V] = (size_t) n_kv_head * n_pages * c->block_bytes_v;
    size_t off = 0;
    for (int r = 0; r < IQ_QREGION_COUNT; r++) {
        c->off[r] = off;
        off += iq_align(c->bytes[r]);
    }
    c->size = off;
    return true;
}

int32_t iq_qcache_blocks_max(const struct iq_qcache_config * cfg, int32_t n_ctx) {
    // at n_ctx tokens the window holds at least R, so the blocks never exceed this
    const int32_t n_quantizable = n_ctx - cfg->n_sink - cfg->n_recent;
    return n_quantizable > 0 && cfg->group > 0 ? n_quantizable / cfg->group : 0;
}

bool iq_qcache_layout(struct iq_qcache * c, const struct iq_qcache_config * cfg, int32_t head_dim,
                      int32_t n_kv_head, int32_t n_ctx) {
    return iq_qcache_pool_layout(c, cfg, head_dim, n_kv_head, n_ctx, 1, iq_qcache_blocks_max(cfg, n_ctx));
}

size_t iq_qcache_size(const struct iq_qcache_config * cfg, int32_t head_dim, int32_t n_kv_head, int32_t n_ctx) {
    struct iq_qcache c;
    return iq_qcache_layout(&c, cfg, head_dim, n_kv_head, n_ctx) ? c.size : 0;
}

void iq_qcache_bind(struct iq_qcache * c, void * base) {
    for (int r = 0; r < IQ_QREGION_COUNT; r++) {
        c->region[r] = (uint8_t *) base + c->off[r];
    }
}

void iq_qcache_view(struct iq_qcache * c, int32_t slot, const int32_t * pages, int32_t n_table) {
    const size_t hd = (size_t) c->n_kv_head * c->head_dim * (size_t) slot;
    c->region[IQ_QREGION_NORM] += hd * sizeof(float);
    c->region[IQ_QREGION_SINK_K] += hd * c->cfg.n_sink * sizeof(iq_fp16_t);
    c->region[IQ_QREGION_SINK_V] += hd * c->cfg.n_sink * sizeof(iq_fp16_t);
    c->region[IQ_QREGION_RECENT_K] += hd * c->cap_recent * sizeof(iq_fp16_t);
    c->region[IQ_QREGION_RECENT_V] += hd * c->cap_recent * sizeof(iq_fp16_t);
    c->pages = pages;
    c->n_table = n_table;
}

void iq_qcache_types(const struct iq_qcache_config * cfg, enum iq_type * type_k, enum iq_type * type_v) {
    static const enum iq_type innerq[] = {IQ_TYPE_INNERQ2, IQ_TYPE_INNERQ3, IQ_TYPE_INNERQ4, IQ_TYPE_INNERQ5};
    const int32_t b[2] = {cfg->bits_k, cfg->bits_v};
    enum iq_type * out[2] = {type_k, type_v};
    for (int i = 0; i < 2; i++) {
        const int32_t bits = b[i] < 2 ? 2 : b[i] > 5 ? 5 : b[i];
        *out[i] = cfg->axis_k == IQ_QAXIS_TOKENS ? (bits <= 2 ? IQ_TYPE_KIVI2 : IQ_TYPE_KIVI4) : innerq[bits - 2];
    }
}

void iq_qcache_region_shape(const struct iq_qcache * c, enum iq_qregion r, enum iq_type * type, int64_t ne[4]) {
    ne[0] = c->head_dim;
    ne[2] = c->n_kv_head;
    ne[3] = c->n_slots;
    switch (r) {
        case IQ_QREGION_NORM:
            *type = IQ_TYPE_F32;
            ne[1] = c->n_kv_head;
            ne[2] = c->n_slots;
            ne[3] = 1;
            break;
        case IQ_QREGION_SINK_K:
        case IQ_QREGION_SINK_V:
            *type = IQ_TYPE_F16;
            ne[1] = c->cfg.n_sink;
            break;
        case IQ_QREGION_RECENT_K:
        case IQ_QREGION_RECENT_V:
            *type = IQ_TYPE_F16;
            ne[1] = c->cap_recent;
            break;
        default:
            *type = IQ_TYPE_I8;
            ne[0] = (int64_t) (r == IQ_QREGION_QUANT_K ? c->block_bytes_k : c->block_bytes_v);
            ne[1] = c->cap_blocks;
            ne[3] = 1;
            break;
    }
}

// ---- stores and flushes ----

bool iq_qcache_pages_check(const struct iq_qcache * c, int32_t n_blocks) {
    if (n_blocks > c->n_table) {
        iq_error_set("quantized KV cache: %d blocks, the page table has %d entries", n_blocks, c->n_table);
        return false;
    }
    // a layer without blocks (window-only, cap_blocks 0) writes none: its pages are the others'
    for (int32_t j = 0; c->pages != NULL && c->cap_blocks > 0 && j < n_blocks; j++) {
        if (c->pages[j] < 0 || c->pages[j] >= c->cap_blocks) {
            iq_error_set("quantized KV cache: block %d is page %d, not one of the pool's %d", j, c->pages[j],
                         c->cap_blocks);
            return false;
        }
    }
    return true;
}

bool iq_qcache_store_check(const struct iq_qcache * c, const struct iq_qcache_flush * f, int32_t n) {
    const int32_t g = c->cfg.group;
    const int32_t window = c->n_recent + n - f->n_sink_new;  // window tokens before the flush
    const bool counters = c->n_sink >= 0 && c->n_sink <= c->cfg.n_sink && c->n_quant >= 0 && c->n_quant % g == 0 &&
                          c->n_recent >= 0 && c->n_recent < c->cap_recent &&
                          c->n_tokens == c->n_sink + c->n_quant + c->n_recent;
    if (!counters || n < 1 || c->n_tokens + n > c->n_ctx) {
        iq_error_set("quantized KV cache: %d tokens (sink %d, quantized %d, window %d) + %d new exceed the context "
                     "of %d or its regions", c->n_tokens, c->n_sink, c->n_quant, c->n_recent, n, c->n_ctx);
        return false;
    }
    if (f->n_sink_new < 0 || f->n_sink_new > n || c->n_sink + f->n_sink_new > c->cfg.n_sink || f->n_flush < 0 ||
        (int64_t) f->n_flush * g > window || window - f->n_flush * g > c->cap_recent ||
        (f->set_norms && f->n_flush == 0)) {
        iq_error_set("quantized KV cache: flush plan (%d to the sink, %d blocks, norms %d) does not fit a store of %d "
                     "tokens after %d", f->n_sink_new, f->n_flush, f->set_norms, n, c->n_tokens);
        return false;
    }
    return iq_qcache_pages_check(c, c->n_quant / g + f->n_flush);
}

static void iq_row_to_fp16(const float * x, iq_fp16_t * y, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        y[i] = iq_fp32_to_fp16(x[i]);
    }
}

// n_c = sqrt(max |K_tc|) over the n_flush oldest window tokens: the n_old stored ones, then new
// rows. The two channels of a RoPE pair (2i, 2i+1 below rope_dims) share the max of both: the
// rotation moves a pair's magnitude between its channels as the position advances, so the max of
// one channel over the first flush's positions says little about later ones (docs/INNERQ.md).
static void iq_qcache_norms_compute(const struct iq_qcache * c, int32_t h, const iq_fp16_t * old, int32_t n_old,
                                    const float * k_new, size_t ld, int32_t n_flush) {
    const int32_t dim = c->head_dim;
    float * norm = (float *) iq_qcache_norm(c, h);
    for (int32_t ch = 0; ch < dim; ch++) {
        float mx = 0.0f;
        for (int32_t t = 0; t < n_flush; t++) {
            const float x = t < n_old ? iq_fp16_to_fp32(old[(size_t) t * dim + ch])
                                      : iq_fp16_to_fp32(iq_fp32_to_fp16(k_new[(size_t) (t - n_old) * ld + ch]));
            mx = fabsf(x) > mx ? fabsf(x) : mx;
        }
        norm[ch] = mx;
    }
    float mx[IQ_QCACHE_MAX_HEAD_DIM];
    memcpy(mx, norm, (size_t) dim * sizeof(float));
    for (int32_t ch = 0; ch < dim; ch++) {
        norm[ch] = iq_qcache_norm_of(mx, c->cfg.rope_dims, ch);
    }
}

// Quantizes the window's oldest G tokens into block j and shifts the rest down.
static void iq_qcache_flush_block(const struct iq_qcache * c, int32_t h, int32_t j, int32_t n_window) {
    const struct iq_qcache_config * cfg = &c->cfg;
    const size_t row = (size_t) c->head_dim;
    iq_fp16_t * rk = iq_qcache_recent(c, false, h);
    iq_fp16_t * rv = iq_qcache_recent(c, true, h);
    if (c->cap_blocks > 0) {  // a window-only layer drops its flushed rows
        iq_qblock_quantize(rk, cfg->axis_k, cfg->bits_k, c->head_dim, cfg->group, cfg->mode, iq_qcache_norm(c, h),
                           iq_qcache_fmt(cfg, false), iq_qcache_block(c, false, h, j));
        iq_qblock_quantize(rv, cfg->axis_v, cfg->bits_v, c->head_dim, cfg->group, cfg->mode, NULL,
                           iq_qcache_fmt(cfg, true), iq_qcache_block(c, true, h, j));
    }
    memmove(rk, rk + cfg->group * row, (size_t) (n_window - cfg->group) * row * sizeof(iq_fp16_t));
    memmove(rv, rv + cfg->group * row, (size_t) (n_window - cfg->group) * row * sizeof(iq_fp16_t));
}

void iq_qcache_store_head(const struct iq_qcache * c, const struct iq_qcache_flush * f, int32_t h, const float * k,
                          const float * v, int32_t n) {
    const int32_t dim = c->head_dim, g = c->cfg.group;
    const size_t ld = (size_t) c->n_kv_head * dim;
    k += (size_t) h * dim;
    v += (size_t) h * dim;
    for (int32_t i = 0; i < f->n_sink_new; i++) {
        iq_row_to_fp16(k + i * ld, iq_qcache_sink(c, false, h) + (size_t) (c->n_sink + i) * dim, dim);
        iq_row_to_fp16(v + i * ld, iq_qcache_sink(c, true, h) + (size_t) (c->n_sink + i) * dim, dim);
    }
    iq_fp16_t * rk = iq_qcache_recent(c, false, h);
    iq_fp16_t * rv = iq_qcache_recent(c, true, h);
    if (f->set_norms && c->cap_blocks > 0) {  // the norms scale blocks only
        iq_qcache_norms_compute(c, h, rk, c->n_recent, k + f->n_sink_new * ld, ld, f->n_flush * g);
    }
    // The window holds R + G rows: a block is flushed as soon as it is full (the same blocks as
    // flushing after the store), and the plan's remaining blocks after the last row.
    int32_t n_window = c->n_recent, block = c->n_quant / g, flushes = f->n_flush;
    for (int32_t i = f->n_sink_new; i < n; i++) {
        iq_row_to_fp16(k + i * ld, rk + (size_t) n_window * dim, dim);
        iq_row_to_fp16(v + i * ld, rv + (size_t) n_window * dim, dim);
        if (++n_window == c->cap_recent && flushes > 0) {
            iq_qcache_flush_block(c, h, block++, n_window);
            n_window -= g;
            flushes--;
        }
    }
    for (; flushes > 0; flushes--) {
        iq_qcache_flush_block(c, h, block++, n_window);
        n_window -= g;
    }
}

// ---- reading ----

void iq_qcache_read_token(const struct iq_qcache * c, int32_t h, int32_t t, float * k, float * v) {
    const struct iq_qcache_config * cfg = &c->cfg;
    const int32_t dim = c->head_dim;
    if (t < c->n_sink || t >= c->n_sink + c->n_quant) {
        const bool sink = t < c->n_sink;
        const size_t row = (size_t) (sink ? t : t - c->n_sink - c->n_quant) * dim;
        const iq_fp16_t * kr = (sink ? iq_qcache_sink(c, false, h) : iq_qcache_recent(c, false, h)) + row;
        const iq_fp16_t * vr = (sink ? iq_qcache_sink(c, true, h) : iq_qcache_recent(c, true, h)) + row;
        for (int32_t i = 0; i < dim; i++) {
            k[i] = iq_fp16_to_fp32(kr[i]);
            v[i] = iq_fp16_to_fp32(vr[i]);
        }
        return;
    }
    const int32_t j = (t - c->n_sink) / cfg->group, a = (t - c->n_sink) % cfg->group;
    iq_qblock_dequantize(iq_qcache_block(c, false, h, j), cfg->axis_k, cfg->bits_k, dim, cfg->group,
                         iq_qcache_norm(c, h), iq_qcache_fmt(cfg, false), a, a + 1, k);
    iq_qblock_dequantize(iq_qcache_block(c, true, h, j), cfg->axis_v, cfg->bits_v, dim, cfg->group, NULL,
                         iq_qcache_fmt(cfg, true), a, a + 1, v);
}

static int32_t iq_qcache_cut(const struct iq_qcache * c, int32_t n_parts, int32_t p) {
    int32_t t = (int32_t) ((int64_t) c->n_tokens * p / n_parts);
    if (t > c->n_sink && t < c->n_sink + c->n_quant) {
        t = c->n_sink + (t - c->n_sink) / c->cfg.group * c->cfg.group;
    }
    return t;
}

void iq_qcache_split(const struct iq_qcache * c, int32_t n_parts, int32_t part, int32_t * t0, int32_t * t1) {
    *t0 = iq_qcache_cut(c, n_parts, part);
    *t1 = iq_qcache_cut(c, n_parts, part + 1);
}
