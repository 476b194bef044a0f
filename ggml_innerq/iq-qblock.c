// The block format of the quantized KV cache and its reference group quantizer
// (iq-qcache.h; the arithmetic is iq-qcache-math.h's).
#include "iq-qcache.h"

// ---- reference group quantizer ----

void iq_quant_group(const float * x, int32_t n, int32_t bits, enum iq_quant_mode mode,
                    uint8_t * u, iq_fp16_t * d, iq_fp16_t * m) {
    iq_quant_group_hd(x, n, bits, (int) mode, u, d, m);
}

// ---- tiles and blocks ----

void iq_qtile_pack(const uint8_t * u, int32_t bits, uint8_t * dst) { iq_qtile_pack_codes(u, bits, dst); }

void iq_qtile_unpack(const uint8_t * src, int32_t bits, uint8_t * u) {
    for (int p = 0; p < IQ_QTILE; p++) {
        u[p] = iq_qtile_code(src, bits, p);
    }
}

// The row scales of a block's G token-major f16 rows: their codes into sc[G] (the block's
// bytes after m[D]) and their values into rs[G].
static void iq_qblock_row_scales(const iq_fp16_t * rows, int32_t head_dim, int32_t group, uint8_t * sc, float * rs) {
    float x[IQ_QCACHE_MAX_HEAD_DIM];
    for (int32_t t = 0; t < group; t++) {
        for (int32_t c = 0; c < head_dim; c++) {
            x[c] = iq_fp16_to_fp32(rows[(size_t) t * head_dim + c]);
        }
        sc[t] = iq_row_scale_code(x, head_dim);
        rs[t] = iq_row_scale(sc[t]);
    }
}

void iq_qblock_quantize(const iq_fp16_t * rows, enum iq_qaxis axis, int32_t bits, int32_t head_dim, int32_t group,
                        enum iq_quant_mode mode, const float * norm, bool row_scales, uint8_t * block) {
    uint8_t codes[IQ_QGROUP_MAX * IQ_QCACHE_MAX_HEAD_DIM];  // token-major, as rows
    iq_fp16_t * d = (iq_fp16_t *) iq_qblock_params(block, bits, head_dim, group);
    iq_fp16_t * m = d + head_dim;
    const bool along_c = axis == IQ_QAXIS_CHANNELS;
    float rs[IQ_QGROUP_MAX];
    if (row_scales) {
        iq_qblock_row_scales(rows, head_dim, group, block + iq_qblock_bytes(bits, head_dim, group), rs);
    }
    for (int32_t gi = 0; gi < head_dim; gi++) {
        iq_qblock_quantize_group(rows, along_c, bits, head_dim, group, (int) mode, norm, row_scales ? rs : NULL, gi,
                                 codes, d, m);
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

void iq_qblock_dequantize(const uint8_t * block, enum iq_qaxis axis, int32_t bits, int32_t head_dim, int32_t group,
                          const float * norm, bool row_scales, int32_t a, int32_t b, float * rows) {
    const uint8_t * sc = block + iq_qblock_bytes(bits, head_dim, group);
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
            const int32_t gi = iq_qblock_group_of(axis == IQ_QAXIS_CHANNELS, group, t, c);
            const size_t i = (size_t) (t - a) * head_dim + c;
            float x = df[gi] * u[i] + mf[gi];
            x = row_scales ? x * iq_row_scale(sc[t]) : x;
            rows[i] = norm ? x * norm[c] : x;
        }
    }
}
