// The block format of the quantized KV cache and its reference group quantizer
// (iq-qcache.h; the arithmetic is iq-qcache-math.h's).
#include "iq-qcache.h"

#include <math.h>
#include <stdatomic.h>
#include <string.h>

// ---- reference group quantizer ----

void iq_quant_group(const float * x, int32_t n, int32_t bits, enum iq_quant_mode mode, bool key_levels,
                    uint8_t * u, iq_fp16_t * d, iq_fp16_t * m) {
    iq_quant_group_hd(x, n, bits, (int) mode, key_levels, u, d, m);
}

// ---- the searched quantizer of iq_qblock_quantize ----

static _Atomic(iq_qsearch_fn) iq_qsearch_installed;

void iq_qblock_set_search(iq_qsearch_fn fn) { atomic_store_explicit(&iq_qsearch_installed, fn, memory_order_relaxed); }

// ---- tiles and blocks ----

void iq_qtile_pack(const uint8_t * u, int32_t bits, uint8_t * dst) { iq_qtile_pack_codes(u, bits, dst); }

void iq_qtile_unpack(const uint8_t * src, int32_t bits, uint8_t * u) {
    for (int p = 0; p < IQ_QTILE; p++) {
        u[p] = iq_qtile_code(src, bits, p);
    }
}

// The row scales of a block's G token-major f16 rows: their codes into sc[G] (the block's
// bytes after its parameters) and their values into rs[G].
static void iq_qblock_row_scales(const iq_fp16_t * rows, int32_t head_dim, int32_t group, uint8_t * sc, float * rs) {
    for (int32_t t = 0; t < group; t++) {
        sc[t] = iq_row_scale_code_h(rows + (size_t) t * head_dim, head_dim);
        rs[t] = iq_row_scale(sc[t]);
    }
}

// 8-bit group parameters (iq-qcache-math.h): the (d, m) of a block's groups, searched in fp16,
// coded against the block's references into params, and each group's codes chosen again on the
// decoded grid (rows as iq_qblock_quantize_group reads them; lv: on the key levels).
static void iq_qblock_code_params(const iq_fp16_t * rows, bool along_c, int32_t bits, bool lv, int32_t head_dim,
                                  int32_t group, const float * norm, const float * rs, const iq_fp16_t * d,
                                  const iq_fp16_t * m, uint8_t * codes, uint8_t * params) {
    const float centre = iq_grid_centre(1 << bits, lv);
    iq_p8_write_refs(d, m, head_dim, centre, params);
    for (int32_t gi = 0; gi < head_dim; gi++) {
        iq_p8_code_group(params, head_dim, centre, gi, d[gi], m[gi]);
    }
    for (int32_t gi = 0; gi < head_dim; gi++) {
        iq_fp16_t dd, mm;
        iq_p8_decode_group(params, head_dim, centre, gi, &dd, &mm);
        iq_qblock_recode_group(rows, along_c, bits, lv, head_dim, group, norm, rs, gi, iq_p8_is_sym(d[gi], m[gi], centre),
                               dd, mm, codes);
    }
}

// iq_qblock_quantize_group of the searched mode for groups g0 .. g0 + IQ_QSEARCH_LANES - 1 (those
// below head_dim) at once, by search (lanes past head_dim search copies of group g0).
static void iq_qblock_search_lanes(iq_qsearch_fn search, const iq_fp16_t * rows, bool along_c, int32_t bits,
                                   int32_t head_dim, int32_t group, bool lv, const float * norm, const float * rscale,
                                   int32_t g0, uint8_t * codes, iq_fp16_t * d, iq_fp16_t * m) {
    enum { L = IQ_QSEARCH_LANES };
    const int32_t nl = head_dim - g0 < L ? head_dim - g0 : L;
    float x[IQ_QGROUP_MAX * L];
    for (int l = 0; l < L; l++) {
        float xs[IQ_QGROUP_MAX];
        iq_qblock_group_values(rows, along_c, head_dim, group, norm, rscale, g0 + (l < nl ? l : 0), xs);
        for (int32_t s = 0; s < group; s++) {
            x[s * L + l] = xs[s];
        }
    }
    uint8_t u[IQ_QGROUP_MAX * L];
    iq_fp16_t dl[L], ml[L];
    search(x, group, bits, lv, u, dl, ml);
    for (int l = 0; l < nl; l++) {
        size_t first, step;
        int32_t c0;
        iq_qblock_group_span(along_c, head_dim, group, g0 + l, &first, &step, &c0);
        d[g0 + l] = dl[l];
        m[g0 + l] = ml[l];
        for (int32_t s = 0; s < group; s++) {
            codes[first + s * step] = u[s * L + l];
        }
    }
}

void iq_qblock_quantize(const iq_fp16_t * rows, enum iq_qaxis axis, int32_t bits, int32_t head_dim, int32_t group,
                        enum iq_quant_mode mode, const float * norm, unsigned fmt, uint8_t * block) {
    uint8_t codes[IQ_QGROUP_MAX * IQ_QCACHE_MAX_HEAD_DIM];  // token-major, as rows
    iq_fp16_t d[IQ_QCACHE_MAX_HEAD_DIM], m[IQ_QCACHE_MAX_HEAD_DIM];
    const bool along_c = axis == IQ_QAXIS_CHANNELS;
    uint8_t * params = block + iq_qblock_params_offset(bits, head_dim, group);
    float rs[IQ_QGROUP_MAX];
    if (fmt & IQ_QBLOCK_ROW_SCALES) {
        iq_qblock_row_scales(rows, head_dim, group, block + iq_qblock_scales_offset(bits, head_dim, group, fmt), rs);
    }
    const float * rsp = (fmt & IQ_QBLOCK_ROW_SCALES) ? rs : NULL;
    const bool lv = iq_qblock_levels(bits, fmt);
    const iq_qsearch_fn search = atomic_load_explicit(&iq_qsearch_installed, memory_order_relaxed);
    if (mode == IQ_QUANT_SEARCH && search != NULL) {
        for (int32_t g0 = 0; g0 < head_dim; g0 += IQ_QSEARCH_LANES) {
            iq_qblock_search_lanes(search, rows, along_c, bits, head_dim, group, lv, norm, rsp, g0, codes, d, m);
        }
    } else {
        for (int32_t gi = 0; gi < head_dim; gi++) {
            iq_qblock_quantize_group(rows, along_c, bits, head_dim, group, (int) mode, lv, norm, rsp, gi, codes, d, m);
        }
    }
    if (fmt & IQ_QBLOCK_P8) {
        iq_qblock_code_params(rows, along_c, bits, lv, head_dim, group, norm, rsp, d, m, codes, params);
    } else {
        memcpy(params, d, sizeof(iq_fp16_t) * (size_t) head_dim);
        memcpy(params + sizeof(iq_fp16_t) * (size_t) head_dim, m, sizeof(iq_fp16_t) * (size_t) head_dim);
    }
    const int32_t n_tiles = head_dim * group / IQ_QTILE;
    for (int32_t ti = 0; ti < n_tiles; ti++) {
        iq_qblock_pack_tile(codes, along_c, bits, head_dim, group, ti, block + (size_t) ti * 8 * bits);
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

const iq_fp16_t * iq_qblock_params_of(const uint8_t * block, int32_t bits, int32_t head_dim, int32_t group, unsigned fmt,
                                      iq_fp16_t * buf) {
    const uint8_t * params = block + iq_qblock_params_offset(bits, head_dim, group);
    if (!(fmt & IQ_QBLOCK_P8)) {
        return (const iq_fp16_t *) params;
    }
    iq_p8_decode_block(params, head_dim, iq_grid_centre(1 << bits, iq_qblock_levels(bits, fmt)), buf);
    return buf;
}

void iq_qblock_dequantize(const uint8_t * block, enum iq_qaxis axis, int32_t bits, int32_t head_dim, int32_t group,
                          const float * norm, unsigned fmt, int32_t a, int32_t b, float * rows) {
    const uint8_t * sc = block + iq_qblock_scales_offset(bits, head_dim, group, fmt);
    uint8_t u[IQ_QGROUP_MAX * IQ_QCACHE_MAX_HEAD_DIM];
    iq_qblock_codes(block, axis, bits, head_dim, group, a, b, u);
    iq_fp16_t buf[2 * IQ_QCACHE_MAX_HEAD_DIM];
    const iq_fp16_t * d = iq_qblock_params_of(block, bits, head_dim, group, fmt, buf);
    const iq_fp16_t * m = d + head_dim;
    float df[IQ_QCACHE_MAX_HEAD_DIM], mf[IQ_QCACHE_MAX_HEAD_DIM];  // a block has head_dim groups
    for (int32_t gi = 0; gi < head_dim; gi++) {
        df[gi] = iq_fp16_to_fp32(d[gi]);
        mf[gi] = iq_fp16_to_fp32(m[gi]);
    }
    const bool row_scales = (fmt & IQ_QBLOCK_ROW_SCALES) != 0, lv = iq_qblock_levels(bits, fmt);
    for (int32_t t = a; t < b; t++) {
        for (int32_t c = 0; c < head_dim; c++) {
            const int32_t gi = iq_qblock_group_of(axis == IQ_QAXIS_CHANNELS, group, t, c);
            const size_t i = (size_t) (t - a) * head_dim + c;
            float x = df[gi] * iq_grid_level(lv, u[i]) + mf[gi];
            x = row_scales ? x * iq_row_scale(sc[t]) : x;
            rows[i] = norm ? x * norm[c] : x;
        }
    }
}
