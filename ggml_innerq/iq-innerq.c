// The InnerQ / KIVI quantized KV cache: layout, reference quantizer, stores and flushes,
// reference attention. The layout is documented in iq-innerq.h.
#include "iq-innerq.h"

#include "iq.h"

#include <math.h>
#include <stdlib.h>

#define IQ_QCACHE_ALIGN 64

bool iq_qcache_type_is_quantized(enum iq_type type) {
    return type == IQ_TYPE_IQ2 || type == IQ_TYPE_IQ3 || type == IQ_TYPE_IQ4 || type == IQ_TYPE_KIVI2 ||
           type == IQ_TYPE_KIVI4;
}

static int32_t iq_innerq_bits(enum iq_type type) {
    return type == IQ_TYPE_IQ2 ? 2 : type == IQ_TYPE_IQ3 ? 3 : type == IQ_TYPE_IQ4 ? 4 : 0;
}

static int32_t iq_kivi_bits(enum iq_type type) {
    return type == IQ_TYPE_KIVI2 ? 2 : type == IQ_TYPE_KIVI4 ? 4 : 0;
}

bool iq_qcache_config_default(enum iq_type type_k, enum iq_type type_v, int32_t group,
                              struct iq_qcache_config * cfg) {
    group = group != 0 ? group : 64;
    if (iq_innerq_bits(type_k) && iq_innerq_bits(type_v)) {
        *cfg = (struct iq_qcache_config) {iq_innerq_bits(type_k), iq_innerq_bits(type_v), IQ_QAXIS_CHANNELS,
                                          IQ_QAXIS_TOKENS, group, 32, 96, IQ_QUANT_HYBRID, true, true, 0};
        return true;
    }
    if (iq_kivi_bits(type_k) && iq_kivi_bits(type_v)) {
        *cfg = (struct iq_qcache_config) {iq_kivi_bits(type_k), iq_kivi_bits(type_v), IQ_QAXIS_TOKENS,
                                          IQ_QAXIS_CHANNELS, group, 0, 128, IQ_QUANT_ASYM, false, false, 0};
        return true;
    }
    iq_error_set("KV cache types %s/%s: keys and values must both be InnerQ (innerq2/innerq3/innerq4) or both KIVI",
                 iq_type_name(type_k), iq_type_name(type_v));
    return false;
}

// ---- layout ----

static size_t iq_align(size_t n) { return (n + IQ_QCACHE_ALIGN - 1) / IQ_QCACHE_ALIGN * IQ_QCACHE_ALIGN; }

static size_t iq_qblock_bytes(int32_t bits, int32_t head_dim, int32_t group) {
    return (size_t) head_dim * group * bits / 8 + 2 * sizeof(iq_fp16_t) * (size_t) head_dim;
}

static bool iq_qcache_config_check(const struct iq_qcache_config * cfg, int32_t head_dim, int32_t n_kv_head,
                                   int32_t n_ctx) {
    const int32_t g = cfg->group;
    if (cfg->bits_k < 2 || cfg->bits_k > 4 || cfg->bits_v < 2 || cfg->bits_v > 4) {
        iq_error_set("quantized KV cache: bits must be 2, 3 or 4 (got %d, %d)", cfg->bits_k, cfg->bits_v);
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
        (unsigned) cfg->mode > IQ_QUANT_SYM || (unsigned) cfg->axis_k > IQ_QAXIS_TOKENS ||
        (unsigned) cfg->axis_v > IQ_QAXIS_TOKENS) {
        iq_error_set("quantized KV cache: invalid shape or configuration (n_kv_head %d, n_ctx %d, sink %d, "
                     "recent %d)", n_kv_head, n_ctx, cfg->n_sink, cfg->n_recent);
        return false;
    }
    if (cfg->rope_dims < 0 || cfg->rope_dims > head_dim || cfg->rope_dims % 2 != 0) {
        iq_error_set("quantized KV cache: rope_dims %d must be even and at most head_dim %d", cfg->rope_dims,
                     head_dim);
        return false;
    }
    return true;
}

// Fills the sizes and offsets of c (not the state); returns the buffer size.
static size_t iq_qcache_layout(struct iq_qcache * c, const struct iq_qcache_config * cfg, int32_t head_dim,
                               int32_t n_kv_head, int32_t n_ctx) {
    c->cfg = *cfg;
    c->head_dim = head_dim;
    c->n_kv_head = n_kv_head;
    c->n_ctx = n_ctx;
    c->cap_recent = cfg->n_recent + cfg->group;
    // At n_ctx tokens the window holds at least R, so the blocks never exceed this.
    const int32_t n_quantizable = n_ctx - cfg->n_sink - cfg->n_recent;
    c->cap_blocks = n_quantizable > 0 ? n_quantizable / cfg->group : 0;
    c->block_bytes_k = iq_qblock_bytes(cfg->bits_k, head_dim, cfg->group);
    c->block_bytes_v = iq_qblock_bytes(cfg->bits_v, head_dim, cfg->group);
    const size_t hd = (size_t) n_kv_head * head_dim;
    size_t off = 0;
    c->off_norm = off;
    off += iq_align(hd * sizeof(float));
    c->off_sink_k = off;
    off += iq_align(hd * cfg->n_sink * sizeof(iq_fp16_t));
    c->off_sink_v = off;
    off += iq_align(hd * cfg->n_sink * sizeof(iq_fp16_t));
    c->off_recent_k = off;
    off += iq_align(hd * c->cap_recent * sizeof(iq_fp16_t));
    c->off_recent_v = off;
    off += iq_align(hd * c->cap_recent * sizeof(iq_fp16_t));
    c->off_quant_k = off;
    off += iq_align((size_t) n_kv_head * c->cap_blocks * c->block_bytes_k);
    c->off_quant_v = off;
    off += iq_align((size_t) n_kv_head * c->cap_blocks * c->block_bytes_v);
    return off;
}

size_t iq_qcache_size(const struct iq_qcache_config * cfg, int32_t head_dim, int32_t n_kv_head, int32_t n_ctx) {
    if (!iq_qcache_config_check(cfg, head_dim, n_kv_head, n_ctx)) {
        return 0;
    }
    struct iq_qcache c;
    return iq_qcache_layout(&c, cfg, head_dim, n_kv_head, n_ctx);
}

bool iq_qcache_init(struct iq_qcache * c, const struct iq_qcache_config * cfg, int32_t head_dim,
                    int32_t n_kv_head, int32_t n_ctx, void * data, size_t size) {
    if (!iq_qcache_config_check(cfg, head_dim, n_kv_head, n_ctx)) {
        return false;
    }
    const size_t need = iq_qcache_layout(c, cfg, head_dim, n_kv_head, n_ctx);
    if (data == NULL || size < need) {
        iq_error_set("quantized KV cache: buffer of %zu bytes, %zu needed", data ? size : 0, need);
        return false;
    }
    c->data = data;
    iq_qcache_clear(c);
    return true;
}

void iq_qcache_clear(struct iq_qcache * c) {
    c->n_tokens = c->n_sink = c->n_quant = c->n_recent = 0;
    c->norms_ready = false;
    float * norm = (float *) (c->data + c->off_norm);
    for (size_t i = 0; i < (size_t) c->n_kv_head * c->head_dim; i++) {
        norm[i] = 1.0f;
    }
}

// ---- reference group quantizer ----

// v clamped to the integers [lo, hi] and rounded half away from zero (as C roundf), plus
// offset; NaN (from inputs beyond fp16 range) gives lo. After the clamp v - trunc(v) is exact.
static uint8_t iq_quant_code(float v, int32_t lo, int32_t hi, int32_t offset) {
    v = v > (float) hi ? (float) hi : v;
    v = v >= (float) lo ? v : (float) lo;
    const int32_t i = (int32_t) v;
    const float f = v - (float) i;
    return (uint8_t) (i + (f >= 0.5f) - (f <= -0.5f) + offset);
}

static void iq_quant_asym(const float * x, int32_t n, int32_t levels, uint8_t * u, iq_fp16_t * d,
                          iq_fp16_t * m) {
    float lo = x[0], hi = x[0];
    for (int32_t i = 1; i < n; i++) {
        const float xi = x[i];
        lo = xi < lo ? xi : lo;
        hi = xi > hi ? xi : hi;
    }
    *d = iq_fp32_to_fp16((hi - lo) / (float) (levels - 1));
    *m = iq_fp32_to_fp16(lo);
    const float df = iq_fp16_to_fp32(*d), mf = iq_fp16_to_fp32(*m);
    for (int32_t i = 0; i < n; i++) {
        u[i] = df == 0.0f ? 0 : iq_quant_code((x[i] - mf) / df, 0, levels - 1, 0);
    }
}

// Two's complement grid: the element of largest magnitude a lands exactly on code 0 (s = -L/2).
static void iq_quant_sym(const float * x, int32_t n, int32_t levels, uint8_t * u, iq_fp16_t * d,
                         iq_fp16_t * m) {
    float a = x[0];
    for (int32_t i = 1; i < n; i++) {
        const float xi = x[i];
        a = fabsf(xi) > fabsf(a) ? xi : a;
    }
    const int32_t half = levels / 2;
    *d = iq_fp32_to_fp16(-2.0f * a / (float) levels);
    const float df = iq_fp16_to_fp32(*d);
    *m = iq_fp32_to_fp16(-(float) half * df);  // exact: a power of two times an fp16
    for (int32_t i = 0; i < n; i++) {
        u[i] = df == 0.0f ? (uint8_t) half : iq_quant_code(x[i] / df, -half, half - 1, half);
    }
}

static double iq_quant_l1(const float * x, int32_t n, const uint8_t * u, iq_fp16_t d, iq_fp16_t m) {
    const double df = iq_fp16_to_fp32(d), mf = iq_fp16_to_fp32(m);
    double err = 0.0;
    for (int32_t i = 0; i < n; i++) {
        err += fabs((double) x[i] - (df * u[i] + mf));
    }
    return err;
}

void iq_quant_group(const float * x, int32_t n, int32_t bits, enum iq_quant_mode mode,
                    uint8_t * u, iq_fp16_t * d, iq_fp16_t * m) {
    const int32_t levels = 1 << bits;
    bool constant = true;
    for (int32_t i = 1; i < n && constant; i++) {
        constant = x[i] == x[0];
    }
    if (constant) {
        *d = 0;
        *m = iq_fp32_to_fp16(x[0]);
        memset(u, 0, (size_t) n);
        return;
    }
    if (mode == IQ_QUANT_SYM) {
        iq_quant_sym(x, n, levels, u, d, m);
        return;
    }
    iq_quant_asym(x, n, levels, u, d, m);
    if (mode == IQ_QUANT_HYBRID) {
        uint8_t us[IQ_QGROUP_MAX];
        iq_fp16_t ds, ms;
        iq_quant_sym(x, n, levels, us, &ds, &ms);
        if (iq_quant_l1(x, n, us, ds, ms) < iq_quant_l1(x, n, u, *d, *m)) {
            memcpy(u, us, (size_t) n);
            *d = ds;
            *m = ms;
        }
    }
}

// ---- tiles and blocks ----

void iq_qtile_pack(const uint8_t * u, int32_t bits, uint8_t * dst) {
    if (bits == 4) {
        for (int p = 0; p < 32; p++) {
            dst[p] = (uint8_t) ((u[p] & 15) | (u[p + 32] & 15) << 4);
        }
        return;
    }
    for (int p = 0; p < 16; p++) {
        dst[p] = (uint8_t) ((u[p] & 3) | (u[p + 16] & 3) << 2 | (u[p + 32] & 3) << 4 | (u[p + 48] & 3) << 6);
    }
    if (bits == 3) {
        for (int j = 0; j < 8; j++) {
            uint8_t b = 0;
            for (int k = 0; k < 8; k++) {
                b |= (uint8_t) (((u[8 * j + k] >> 2) & 1) << k);
            }
            dst[16 + j] = b;
        }
    }
}

static uint8_t iq_qtile_code(const uint8_t * tile, int32_t bits, int p) {
    if (bits == 4) {
        return (tile[p % 32] >> (4 * (p / 32))) & 15;
    }
    uint8_t u = (tile[p % 16] >> (2 * (p / 16))) & 3;
    if (bits == 3) {
        u |= (uint8_t) (((tile[16 + p / 8] >> (p % 8)) & 1) << 2);
    }
    return u;
}

void iq_qtile_unpack(const uint8_t * src, int32_t bits, uint8_t * u) {
    for (int p = 0; p < IQ_QTILE; p++) {
        u[p] = iq_qtile_code(src, bits, p);
    }
}

// Token t and channel c of code p of tile ti: the inverse of the layout in iq-innerq.h.
static void iq_qtile_coords(enum iq_qaxis axis, int32_t head_dim, int32_t group, int32_t ti, int p, int32_t * t,
                            int32_t * c) {
    const int32_t quads = (axis == IQ_QAXIS_CHANNELS ? head_dim : group) / 4;
    const int32_t lane = ti / quads * 16 + p / 4, sub = ti % quads * 4 + p % 4;
    *t = axis == IQ_QAXIS_CHANNELS ? lane : sub;
    *c = axis == IQ_QAXIS_CHANNELS ? sub : lane;
}

// The group holding token t, channel c, i.e. the index of its d and m.
static int32_t iq_qblock_group(enum iq_qaxis axis, int32_t group, int32_t t, int32_t c) {
    return axis == IQ_QAXIS_CHANNELS ? c / group * group + t : c;
}

// Quantizes G token-major f16 rows [G][D] (keys divided by norm) into a block.
static void iq_qblock_quantize(const iq_fp16_t * rows, enum iq_qaxis axis, int32_t bits, int32_t head_dim,
                               int32_t group, enum iq_quant_mode mode, const float * norm, uint8_t * block) {
    uint8_t codes[IQ_QGROUP_MAX * IQ_QCACHE_MAX_HEAD_DIM];  // token-major, as rows
    iq_fp16_t * d = (iq_fp16_t *) iq_qblock_params(block, bits, head_dim, group);
    iq_fp16_t * m = d + head_dim;
    for (int32_t gi = 0; gi < head_dim; gi++) {
        // group gi: channels [c0, c0 + G) of token t0 (channels axis) or tokens [0, G) of channel gi
        const bool along_c = axis == IQ_QAXIS_CHANNELS;
        const int32_t t0 = along_c ? gi % group : 0, c0 = along_c ? gi / group * group : gi;
        const size_t first = (size_t) t0 * head_dim + c0, step = along_c ? 1 : (size_t) head_dim;
        float x[IQ_QGROUP_MAX];
        uint8_t u[IQ_QGROUP_MAX];
        for (int32_t s = 0; s < group; s++) {
            const int32_t c = along_c ? c0 + s : c0;
            x[s] = iq_fp16_to_fp32(rows[first + s * step]);
            x[s] = norm ? x[s] / norm[c] : x[s];
        }
        iq_quant_group(x, group, bits, mode, u, &d[gi], &m[gi]);
        for (int32_t s = 0; s < group; s++) {
            codes[first + s * step] = u[s];
        }
    }
    const int32_t n_tiles = head_dim * group / IQ_QTILE;
    for (int32_t ti = 0; ti < n_tiles; ti++) {
        uint8_t tile[IQ_QTILE];
        for (int p = 0; p < IQ_QTILE; p++) {
            int32_t t, c;
            iq_qtile_coords(axis, head_dim, group, ti, p, &t, &c);
            tile[p] = codes[(size_t) t * head_dim + c];
        }
        iq_qtile_pack(tile, bits, block + (size_t) ti * 8 * bits);
    }
}

void iq_qblock_codes(const uint8_t * block, enum iq_qaxis axis, int32_t bits, int32_t head_dim, int32_t group,
                     int32_t a, int32_t b, uint8_t * u) {
    const bool by_channel = axis == IQ_QAXIS_CHANNELS;
    const int32_t quads = (by_channel ? head_dim : group) / 4;
    const int32_t n_tiles = head_dim * group / IQ_QTILE;
    for (int32_t ti = 0; ti < n_tiles; ti++) {
        // the tile holds lanes lane0 .. lane0+15 and subs sub0 .. sub0+3 (iq_qtile_coords)
        const int32_t lane0 = ti / quads * 16, sub0 = ti % quads * 4;
        const int32_t t_lo = by_channel ? lane0 : sub0, t_hi = t_lo + (by_channel ? 16 : 4);
        if (t_hi <= a || t_lo >= b) {
            continue;  // none of its tokens is asked for
        }
        uint8_t tile[IQ_QTILE];
        iq_qtile_unpack(block + (size_t) ti * 8 * bits, bits, tile);
        for (int32_t l = 0; l < 16; l++) {
            for (int32_t q = 0; q < 4; q++) {
                const int32_t t = by_channel ? lane0 + l : sub0 + q, c = by_channel ? sub0 + q : lane0 + l;
                if (t >= a && t < b) {
                    u[(size_t) (t - a) * head_dim + c] = tile[4 * l + q];
                }
            }
        }
    }
}

void iq_qblock_dequantize(const uint8_t * block, enum iq_qaxis axis, int32_t bits, int32_t head_dim, int32_t group,
                          const float * norm, int32_t a, int32_t b, float * rows) {
    uint8_t u[IQ_QGROUP_MAX * IQ_QCACHE_MAX_HEAD_DIM];
    iq_qblock_codes(block, axis, bits, head_dim, group, a, b, u);
    const iq_fp16_t * d = iq_qblock_params(block, bits, head_dim, group);
    const iq_fp16_t * m = d + head_dim;
    float df[IQ_QCACHE_MAX_HEAD_DIM], mf[IQ_QCACHE_MAX_HEAD_DIM];  // a block has head_dim groups
    for (int32_t gi = 0; gi < head_dim; gi++) {
        df[gi] = iq_fp16_to_fp32(d[gi]);
        mf[gi] = iq_fp16_to_fp32(m[gi]);
    }
    for (int32_t t = a; t < b; t++) {
        for (int32_t c = 0; c < head_dim; c++) {
            const int32_t gi = iq_qblock_group(axis, group, t, c);
            const size_t i = (size_t) (t - a) * head_dim + c;
            const float x = df[gi] * u[i] + mf[gi];
            rows[i] = norm ? x * norm[c] : x;
        }
    }
}

// ---- stores and flushes ----

// How n new tokens split: into the sink, and how many blocks the flush after them quantizes.
struct iq_qcache_plan {
    int32_t n_sink_new, n_blocks;
};

static struct iq_qcache_plan iq_qcache_plan(const struct iq_qcache * c, int32_t n) {
    const int32_t room = c->cfg.n_sink - c->n_sink;
    const int32_t to_sink = n < room ? n : room;
    const int32_t in_recent = c->n_recent + n - to_sink;
    const int32_t r = c->cfg.n_recent, g = c->cfg.group;
    return (struct iq_qcache_plan) {to_sink, in_recent >= r + g ? (in_recent - r) / g : 0};
}

int32_t iq_qcache_until_flush(const struct iq_qcache * c) {
    return (c->cfg.n_sink - c->n_sink) + (c->cfg.n_recent + c->cfg.group - c->n_recent);
}

bool iq_qcache_store_check(const struct iq_qcache * c, int32_t n) {
    if (n < 0 || c->n_tokens + n > c->n_ctx) {
        iq_error_set("quantized KV cache: %d tokens + %d new exceed the context of %d", c->n_tokens, n, c->n_ctx);
        return false;
    }
    return true;
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
    for (int32_t ch = 0; ch + 1 < c->cfg.rope_dims; ch += 2) {
        norm[ch] = norm[ch + 1] = norm[ch] > norm[ch + 1] ? norm[ch] : norm[ch + 1];
    }
    for (int32_t ch = 0; ch < dim; ch++) {
        norm[ch] = norm[ch] > 0.0f ? sqrtf(norm[ch]) : 1.0f;
    }
}

// Quantizes the window's oldest G tokens into block j and shifts the rest down.
static void iq_qcache_flush_block(const struct iq_qcache * c, int32_t h, int32_t j, int32_t n_window) {
    const struct iq_qcache_config * cfg = &c->cfg;
    const size_t row = (size_t) c->head_dim;
    iq_fp16_t * rk = iq_qcache_recent(c, false, h);
    iq_fp16_t * rv = iq_qcache_recent(c, true, h);
    iq_qblock_quantize(rk, cfg->axis_k, cfg->bits_k, c->head_dim, cfg->group, cfg->mode, iq_qcache_norm(c, h),
                       iq_qcache_block(c, false, h, j));
    iq_qblock_quantize(rv, cfg->axis_v, cfg->bits_v, c->head_dim, cfg->group, cfg->mode, NULL,
                       iq_qcache_block(c, true, h, j));
    memmove(rk, rk + cfg->group * row, (size_t) (n_window - cfg->group) * row * sizeof(iq_fp16_t));
    memmove(rv, rv + cfg->group * row, (size_t) (n_window - cfg->group) * row * sizeof(iq_fp16_t));
}

void iq_qcache_store_head(const struct iq_qcache * c, int32_t h, const float * k, const float * v, int32_t n) {
    const struct iq_qcache_plan plan = iq_qcache_plan(c, n);
    const int32_t dim = c->head_dim, g = c->cfg.group;
    const size_t ld = (size_t) c->n_kv_head * dim;
    k += (size_t) h * dim;
    v += (size_t) h * dim;
    for (int32_t i = 0; i < plan.n_sink_new; i++) {
        iq_row_to_fp16(k + i * ld, iq_qcache_sink(c, false, h) + (size_t) (c->n_sink + i) * dim, dim);
        iq_row_to_fp16(v + i * ld, iq_qcache_sink(c, true, h) + (size_t) (c->n_sink + i) * dim, dim);
    }
    iq_fp16_t * rk = iq_qcache_recent(c, false, h);
    iq_fp16_t * rv = iq_qcache_recent(c, true, h);
    if (plan.n_blocks > 0 && c->cfg.key_norm && !c->norms_ready) {
        iq_qcache_norms_compute(c, h, rk, c->n_recent, k + plan.n_sink_new * ld, ld, plan.n_blocks * g);
    }
    // Flushing whenever the window is full gives the same blocks as flushing after the store.
    int32_t n_window = c->n_recent, block = c->n_quant / g;
    for (int32_t i = plan.n_sink_new; i < n; i++) {
        iq_row_to_fp16(k + i * ld, rk + (size_t) n_window * dim, dim);
        iq_row_to_fp16(v + i * ld, rv + (size_t) n_window * dim, dim);
        if (++n_window == c->cap_recent) {
            iq_qcache_flush_block(c, h, block++, n_window);
            n_window -= g;
        }
    }
}

void iq_qcache_store_commit(struct iq_qcache * c, int32_t n) {
    const struct iq_qcache_plan plan = iq_qcache_plan(c, n);
    const int32_t flushed = plan.n_blocks * c->cfg.group;
    c->n_sink += plan.n_sink_new;
    c->n_recent += n - plan.n_sink_new - flushed;
    c->n_quant += flushed;
    c->n_tokens += n;
    c->norms_ready = c->norms_ready || (plan.n_blocks > 0 && c->cfg.key_norm);
}

bool iq_qcache_store(struct iq_qcache * c, const float * k, const float * v, int32_t n) {
    if (!iq_qcache_store_check(c, n)) {
        return false;
    }
    for (int32_t h = 0; h < c->n_kv_head; h++) {
        iq_qcache_store_head(c, h, k, v, n);
    }
    iq_qcache_store_commit(c, n);
    return true;
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
                         iq_qcache_norm(c, h), a, a + 1, k);
    iq_qblock_dequantize(iq_qcache_block(c, true, h, j), cfg->axis_v, cfg->bits_v, dim, cfg->group, NULL, a, a + 1, v);
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

// ---- reference attention ----

void iq_attn_state_init(float * st, int32_t n_head, int32_t head_dim) {
    for (int32_t i = 0; i < n_head; i++) {
        float * s = st + (size_t) i * IQ_ATTN_STATE(head_dim);
        s[0] = -INFINITY;
        s[1] = 0.0f;
        memset(s + 2, 0, (size_t) head_dim * sizeof(float));
    }
}

void iq_attn_state_merge(float * dst, const float * src, int32_t n_head, int32_t head_dim) {
    for (int32_t i = 0; i < n_head; i++) {
        float * a = dst + (size_t) i * IQ_ATTN_STATE(head_dim);
        const float * b = src + (size_t) i * IQ_ATTN_STATE(head_dim);
        const float mx = a[0] > b[0] ? a[0] : b[0];
        if (mx == -INFINITY) {
            continue;
        }
        const float fa = expf(a[0] - mx), fb = expf(b[0] - mx);
        a[0] = mx;
        for (int32_t c = 1; c < head_dim + 2; c++) {
            a[c] = a[c] * fa + b[c] * fb;
        }
    }
}

void iq_attn_state_finish(const float * st, int32_t n_head, int32_t head_dim, float * out) {
    for (int32_t i = 0; i < n_head; i++) {
        const float * s = st + (size_t) i * IQ_ATTN_STATE(head_dim);
        const float inv = s[1] > 0.0f ? 1.0f / s[1] : 0.0f;
        for (int32_t c = 0; c < head_dim; c++) {
            out[(size_t) i * head_dim + c] = s[2 + c] * inv;
        }
    }
}

// One key/value pair into the states of r query heads; bias[i] (or 0) is subtracted from
// head i's score.
static void iq_attend_token(const float * k, const float * v, const float * q, int32_t r, int32_t head_dim,
                            float scale, const float * bias, float * st) {
    for (int32_t i = 0; i < r; i++) {
        const float * qi = q + (size_t) i * head_dim;
        float * s = st + (size_t) i * IQ_ATTN_STATE(head_dim);
        float dot = 0.0f;
        for (int32_t c = 0; c < head_dim; c++) {
            dot += qi[c] * k[c];
        }
        dot = dot * scale - (bias != NULL ? bias[i] : 0.0f);
        if (dot > s[0]) {
            const float f = expf(s[0] - dot);
            for (int32_t c = 1; c < head_dim + 2; c++) {
                s[c] *= f;
            }
            s[0] = dot;
        }
        const float p = expf(dot - s[0]);
        s[1] += p;
        for (int32_t c = 0; c < head_dim; c++) {
            s[2 + c] += p * v[c];
        }
    }
}

// The score correction of quantized token t for r query heads (iq_qcache_config.score_correction):
// var_t / 2 = sum_g d_tg^2 / 24 * sum_{c in g} (scale q_c n_c)^2; 0 outside the quantized region.
static void iq_qcache_score_bias(const struct iq_qcache * c, int32_t h, int32_t t, const float * q, int32_t r,
                                 float scale, float * bias) {
    const struct iq_qcache_config * cfg = &c->cfg;
    const int32_t dim = c->head_dim, g = cfg->group, j = (t - c->n_sink) / g, a = (t - c->n_sink) % g;
    const bool quantized = t >= c->n_sink && t < c->n_sink + c->n_quant;
    const iq_fp16_t * d = iq_qblock_params(iq_qcache_block(c, false, h, quantized ? j : 0), cfg->bits_k, dim, g);
    const float * norm = iq_qcache_norm(c, h);
    for (int32_t i = 0; i < r; i++) {
        bias[i] = 0.0f;
        for (int32_t gi = 0; quantized && gi < dim / g; gi++) {
            float q2 = 0.0f;
            for (int32_t ch = gi * g; ch < (gi + 1) * g; ch++) {
                const float qn = scale * q[(size_t) i * dim + ch] * norm[ch];
                q2 += qn * qn;
            }
            const float dg = iq_fp16_to_fp32(d[gi * g + a]);
            bias[i] += dg * dg * q2 / 24.0f;
        }
    }
}

void iq_qcache_attend_ref(const struct iq_qcache * c, int32_t h, const float * q, int32_t r, float scale,
                          int32_t t0, int32_t t1, float * st) {
    enum { HEADS = 64 };  // query heads per pass (the biases of one token)
    float k[IQ_QCACHE_MAX_HEAD_DIM], v[IQ_QCACHE_MAX_HEAD_DIM], bias[HEADS];
    const bool correct = c->cfg.score_correction && c->cfg.axis_k == IQ_QAXIS_CHANNELS;
    const size_t dim = (size_t) c->head_dim;
    for (int32_t t = t0; t < t1; t++) {
        iq_qcache_read_token(c, h, t, k, v);
        for (int32_t i = 0; i < r; i += HEADS) {
            const int32_t n = r - i < HEADS ? r - i : HEADS;
            if (correct) {
                iq_qcache_score_bias(c, h, t, q + i * dim, n, scale, bias);
            }
            iq_attend_token(k, v, q + i * dim, n, c->head_dim, scale, correct ? bias : NULL,
                            st + (size_t) i * IQ_ATTN_STATE(dim));
        }
    }
}

void iq_attend_rows_ref(const float * k, const float * v, size_t ld, int32_t n, const float * q, int32_t r,
                        int32_t head_dim, float scale, float * st) {
    for (int32_t t = 0; t < n; t++) {
        iq_attend_token(k + t * ld, v + t * ld, q, r, head_dim, scale, NULL, st);
    }
}

bool iq_qcache_attention_ref(const struct iq_qcache * c, const float * q, int32_t n_head, const float * k,
                             const float * v, int32_t n_q, float scale, float * out) {
    const int32_t dim = c->head_dim, n_kv = c->n_kv_head;
    if (n_head <= 0 || n_head % n_kv != 0) {
        iq_error_set("attention: %d query heads is not a multiple of %d KV heads", n_head, n_kv);
        return false;
    }
    const int32_t r = n_head / n_kv;
    float * st = malloc((size_t) r * IQ_ATTN_STATE(dim) * sizeof(float));
    if (st == NULL) {
        iq_error_set("attention: out of memory");
        return false;
    }
    for (int32_t i = 0; i < n_q; i++) {
        for (int32_t h = 0; h < n_kv; h++) {
            const size_t head0 = ((size_t) i * n_head + (size_t) h * r) * dim;
            iq_attn_state_init(st, r, dim);
            iq_qcache_attend_ref(c, h, q + head0, r, scale, 0, c->n_tokens, st);
            if (k != NULL && v != NULL) {
                iq_attend_rows_ref(k + (size_t) h * dim, v + (size_t) h * dim, (size_t) n_kv * dim, i + 1, q + head0,
                                   r, dim, scale, st);
            }
            iq_attn_state_finish(st, r, dim, out + head0);
        }
    }
    free(st);
    return true;
}
