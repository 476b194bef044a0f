// Reference block quantization and dequantization (the specification of every format).
//
// Rounding follows ggml's quantize_row_*_ref exactly (truncation after +0.5 / +8.5 offsets,
// roundf for q8_0/q8_1, round-to-nearest-even for q8_K), so the bytes equal gguf.quants'.
#include "iq-quants.h"

#include <math.h>

// Dequantization must round the product before adding (as ggml and numpy do): a fused
// multiply-add would change the last bit, so the compiler may not contract.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

// ---- plain types ----

void iq_dequantize_row_f32(const void * x, float * y, int64_t n) { memcpy(y, x, (size_t) n * sizeof(float)); }

void iq_quantize_row_f32(const float * x, void * y, int64_t n) { memcpy(y, x, (size_t) n * sizeof(float)); }

void iq_dequantize_row_f16(const void * x, float * y, int64_t n) {
    const iq_fp16_t * h = x;
    for (int64_t i = 0; i < n; i++) {
        y[i] = iq_fp16_to_fp32(h[i]);
    }
}

void iq_quantize_row_f16(const float * x, void * y, int64_t n) {
    iq_fp16_t * h = y;
    for (int64_t i = 0; i < n; i++) {
        h[i] = iq_fp32_to_fp16(x[i]);
    }
}

void iq_dequantize_row_bf16(const void * x, float * y, int64_t n) {
    const iq_bf16_t * h = x;
    for (int64_t i = 0; i < n; i++) {
        y[i] = iq_bf16_to_fp32(h[i]);
    }
}

void iq_quantize_row_bf16(const float * x, void * y, int64_t n) {
    iq_bf16_t * h = y;
    for (int64_t i = 0; i < n; i++) {
        h[i] = iq_fp32_to_bf16(x[i]);
    }
}

// ---- block statistics shared by the quantizers ----

// The element of largest magnitude, with its sign (the first one on ties).
static float iq_block_absmax_signed(const float * x, int n) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    return max;
}

static float iq_block_absmax(const float * x, int n) {
    float amax = 0.0f;
    for (int j = 0; j < n; j++) {
        amax = fmaxf(amax, fabsf(x[j]));
    }
    return amax;
}

static void iq_block_min_max(const float * x, int n, float * min, float * max) {
    *min = INFINITY;
    *max = -INFINITY;
    for (int j = 0; j < n; j++) {
        *min = x[j] < *min ? x[j] : *min;
        *max = x[j] > *max ? x[j] : *max;
    }
}

// The inverse of iq_unpack_codes_32 (layout in iq-quants.h).
static void iq_pack_codes_32(const uint8_t * q, uint8_t * qs, uint8_t * qh) {
    uint32_t h = 0;
    for (int j = 0; j < 16; j++) {
        qs[j] = (uint8_t) ((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4));
        h |= (uint32_t) ((q[j] >> 4) & 1) << j;
        h |= (uint32_t) ((q[j + 16] >> 4) & 1) << (j + 16);
    }
    if (qh != NULL) {
        memcpy(qh, &h, sizeof(h));
    }
}

void iq_unpack_codes_32(const uint8_t * qs, const uint8_t * qh, uint8_t * q) {
    uint32_t h = 0;
    if (qh != NULL) {
        memcpy(&h, qh, sizeof(h));
    }
    for (int j = 0; j < 16; j++) {
        q[j] = (uint8_t) ((qs[j] & 0xF) | (((h >> j) & 1) << 4));
        q[j + 16] = (uint8_t) ((qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4));
    }
}

// Symmetric b-bit codes: the largest magnitude maps to code 0 (value -2^(b-1) * d).
static float iq_quantize_codes_sym(const float * x, int bits, uint8_t * q) {
    const int half = 1 << (bits - 1);
    const float d = iq_block_absmax_signed(x, 32) / (float) -half;
    const float id = d ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j++) {
        const int v = (int8_t) (x[j] * id + ((float) half + 0.5f));
        q[j] = (uint8_t) (v < 2 * half - 1 ? v : 2 * half - 1);
    }
    return d;
}

// Asymmetric b-bit codes over [min, max].
static float iq_quantize_codes_asym(const float * x, int bits, uint8_t * q, float * min) {
    const int top = (1 << bits) - 1;
    float max;
    iq_block_min_max(x, 32, min, &max);
    const float d = (max - *min) / (float) top;
    const float id = d ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j++) {
        const int v = (int8_t) ((x[j] - *min) * id + 0.5f);
        q[j] = (uint8_t) (v < top ? v : top);
    }
    return d;
}

// ---- 32-element blocks ----

void iq_quantize_row_q4_0(const float * x, void * y, int64_t n) {
    block_q4_0 * b = y;
    for (int64_t i = 0; i < n / QK4_0; i++, x += QK4_0) {
        uint8_t q[32];
        b[i].d = iq_fp32_to_fp16(iq_quantize_codes_sym(x, 4, q));
        iq_pack_codes_32(q, b[i].qs, NULL);
    }
}

void iq_quantize_row_q4_1(const float * x, void * y, int64_t n) {
    block_q4_1 * b = y;
    for (int64_t i = 0; i < n / QK4_1; i++, x += QK4_1) {
        uint8_t q[32];
        float min;
        b[i].d = iq_fp32_to_fp16(iq_quantize_codes_asym(x, 4, q, &min));
        b[i].m = iq_fp32_to_fp16(min);
        iq_pack_codes_32(q, b[i].qs, NULL);
    }
}

void iq_quantize_row_q5_0(const float * x, void * y, int64_t n) {
    block_q5_0 * b = y;
    for (int64_t i = 0; i < n / QK5_0; i++, x += QK5_0) {
        uint8_t q[32];
        b[i].d = iq_fp32_to_fp16(iq_quantize_codes_sym(x, 5, q));
        iq_pack_codes_32(q, b[i].qs, b[i].qh);
    }
}

void iq_quantize_row_q5_1(const float * x, void * y, int64_t n) {
    block_q5_1 * b = y;
    for (int64_t i = 0; i < n / QK5_1; i++, x += QK5_1) {
        uint8_t q[32];
        float min;
        b[i].d = iq_fp32_to_fp16(iq_quantize_codes_asym(x, 5, q, &min));
        b[i].m = iq_fp32_to_fp16(min);
        iq_pack_codes_32(q, b[i].qs, b[i].qh);
    }
}

// q8_0 and q8_1 share codes; q8_1 also stores s = d * sum(codes) for the asymmetric products.
static float iq_quantize_codes_q8(const float * x, int8_t * q, int * sum) {
    const float d = iq_block_absmax(x, 32) / 127.0f;
    const float id = d ? 1.0f / d : 0.0f;
    *sum = 0;
    for (int j = 0; j < 32; j++) {
        const float v = x[j] * id;
        q[j] = v == v ? (int8_t) roundf(v) : 0;  // NaN (or inf times 0): code 0 on every ISA
        *sum += q[j];
    }
    return d;
}

void iq_quantize_row_q8_0(const float * x, void * y, int64_t n) {
    block_q8_0 * b = y;
    for (int64_t i = 0; i < n / QK8_0; i++, x += QK8_0) {
        int sum;
        b[i].d = iq_fp32_to_fp16(iq_quantize_codes_q8(x, b[i].qs, &sum));
    }
}

void iq_quantize_row_q8_1(const float * x, void * y, int64_t n) {
    block_q8_1 * b = y;
    for (int64_t i = 0; i < n / QK8_1; i++, x += QK8_1) {
        int sum;
        const float d = iq_quantize_codes_q8(x, b[i].qs, &sum);
        b[i].d = iq_fp32_to_fp16(d);
        b[i].s = iq_fp32_to_fp16((float) sum * d);
    }
}

void iq_dequantize_row_q4_0(const void * x, float * y, int64_t n) {
    const block_q4_0 * b = x;
    for (int64_t i = 0; i < n / QK4_0; i++, y += QK4_0) {
        uint8_t q[32];
        const float d = iq_fp16_to_fp32(b[i].d);
        iq_unpack_codes_32(b[i].qs, NULL, q);
        for (int j = 0; j < 32; j++) {
            y[j] = (float) (q[j] - 8) * d;
        }
    }
}

void iq_dequantize_row_q4_1(const void * x, float * y, int64_t n) {
    const block_q4_1 * b = x;
    for (int64_t i = 0; i < n / QK4_1; i++, y += QK4_1) {
        uint8_t q[32];
        const float d = iq_fp16_to_fp32(b[i].d), m = iq_fp16_to_fp32(b[i].m);
        iq_unpack_codes_32(b[i].qs, NULL, q);
        for (int j = 0; j < 32; j++) {
            y[j] = (float) q[j] * d + m;
        }
    }
}

void iq_dequantize_row_q5_0(const void * x, float * y, int64_t n) {
    const block_q5_0 * b = x;
    for (int64_t i = 0; i < n / QK5_0; i++, y += QK5_0) {
        uint8_t q[32];
        const float d = iq_fp16_to_fp32(b[i].d);
        iq_unpack_codes_32(b[i].qs, b[i].qh, q);
        for (int j = 0; j < 32; j++) {
            y[j] = (float) (q[j] - 16) * d;
        }
    }
}

void iq_dequantize_row_q5_1(const void * x, float * y, int64_t n) {
    const block_q5_1 * b = x;
    for (int64_t i = 0; i < n / QK5_1; i++, y += QK5_1) {
        uint8_t q[32];
        const float d = iq_fp16_to_fp32(b[i].d), m = iq_fp16_to_fp32(b[i].m);
        iq_unpack_codes_32(b[i].qs, b[i].qh, q);
        for (int j = 0; j < 32; j++) {
            y[j] = (float) q[j] * d + m;
        }
    }
}

void iq_dequantize_row_q8_0(const void * x, float * y, int64_t n) {
    const block_q8_0 * b = x;
    for (int64_t i = 0; i < n / QK8_0; i++, y += QK8_0) {
        const float d = iq_fp16_to_fp32(b[i].d);
        for (int j = 0; j < 32; j++) {
            y[j] = (float) b[i].qs[j] * d;
        }
    }
}

void iq_dequantize_row_q8_1(const void * x, float * y, int64_t n) {
    const block_q8_1 * b = x;
    for (int64_t i = 0; i < n / QK8_1; i++, y += QK8_1) {
        const float d = iq_fp16_to_fp32(b[i].d);
        for (int j = 0; j < 32; j++) {
            y[j] = (float) b[i].qs[j] * d;
        }
    }
}

// ---- 256-element super-blocks ----

void iq_unpack_scales_k4(const uint8_t * scales, uint8_t * sc, uint8_t * m) {
    uint64_t s, mm;
    iq_unpack_scales_k4_u64(scales, &s, &mm);
    for (int j = 0; j < 8; j++) {
        sc[j] = (uint8_t) (s >> (8 * j));
        m[j] = (uint8_t) (mm >> (8 * j));
    }
}

void iq_unpack_codes_k4(const uint8_t * qs, const uint8_t * qh, uint8_t * q) {
    for (int k = 0; k < 4; k++, qs += 32, q += 64) {
        for (int l = 0; l < 32; l++) {
            const int h = qh ? qh[l] >> (2 * k) : 0;
            q[l] = (uint8_t) ((qs[l] & 0xF) | ((h & 1) << 4));
            q[l + 32] = (uint8_t) ((qs[l] >> 4) | ((h & 2) << 3));
        }
    }
}

void iq_unpack_codes_q6_K(const uint8_t * ql, const uint8_t * qh, int8_t * q) {
    for (int h = 0; h < 2; h++, ql += 64, qh += 32, q += 128) {
        for (int l = 0; l < 32; l++) {
            q[l] = (int8_t) (((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
            q[l + 32] = (int8_t) (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
            q[l + 64] = (int8_t) (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            q[l + 96] = (int8_t) (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
    }
}

// x = (d * scale) * code - dmin * min, per sub-block of 32 (the order ggml rounds in).
static void iq_dequantize_block_k4(const uint8_t * scales, const uint8_t * qs, const uint8_t * qh,
                                   float d, float dmin, float * y) {
    uint8_t q[QK_K], sc[8], m[8];
    iq_unpack_scales_k4(scales, sc, m);
    iq_unpack_codes_k4(qs, qh, q);
    for (int j = 0; j < 8; j++) {
        const float dj = d * sc[j], mj = dmin * m[j];
        for (int l = 32 * j; l < 32 * j + 32; l++) {
            y[l] = dj * (float) q[l] - mj;
        }
    }
}

void iq_dequantize_row_q4_K(const void * x, float * y, int64_t n) {
    const block_q4_K * b = x;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        iq_dequantize_block_k4(b[i].scales, b[i].qs, NULL, iq_fp16_to_fp32(b[i].d), iq_fp16_to_fp32(b[i].dmin), y);
    }
}

void iq_dequantize_row_q5_K(const void * x, float * y, int64_t n) {
    const block_q5_K * b = x;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        iq_dequantize_block_k4(b[i].scales, b[i].qs, b[i].qh, iq_fp16_to_fp32(b[i].d), iq_fp16_to_fp32(b[i].dmin), y);
    }
}

void iq_dequantize_row_q6_K(const void * x, float * y, int64_t n) {
    const block_q6_K * b = x;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        int8_t q[QK_K];
        const float d = iq_fp16_to_fp32(b[i].d);
        iq_unpack_codes_q6_K(b[i].ql, b[i].qh, q);
        for (int l = 0; l < QK_K; l++) {
            y[l] = (d * b[i].scales[l / 16]) * (float) q[l];
        }
    }
}

void iq_unpack_codes_k2(const uint8_t * qs, const uint8_t * hmask, int8_t * q) {
    for (int e = 0; e < QK_K; e++) {
        const int h = e / 128, j = e / 32 % 4, l = e % 32;
        const int low = (qs[32 * h + l] >> (2 * j)) & 3;
        q[e] = (int8_t) (hmask == NULL || (hmask[l] >> (4 * h + j)) & 1 ? low : low - 4);
    }
}

void iq_unpack_scales_q3_K(const uint8_t * scales, int8_t * sc) {
    for (int g = 0; g < 16; g++) {
        const int low = g < 8 ? scales[g] & 0xF : scales[g - 8] >> 4;
        const int high = (scales[8 + g % 4] >> (2 * (g / 4))) & 3;
        sc[g] = (int8_t) ((low | high << 4) - 32);
    }
}

// x = (d (scale & 15)) code - dmin (scale >> 4), per group of 16.
void iq_dequantize_row_q2_K(const void * x, float * y, int64_t n) {
    const block_q2_K * b = x;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        int8_t q[QK_K];
        const float d = iq_fp16_to_fp32(b[i].d), dmin = iq_fp16_to_fp32(b[i].dmin);
        iq_unpack_codes_k2(b[i].qs, NULL, q);
        for (int g = 0; g < QK_K / 16; g++) {
            const float dl = d * (float) (b[i].scales[g] & 0xF), ml = dmin * (float) (b[i].scales[g] >> 4);
            for (int l = 16 * g; l < 16 * g + 16; l++) {
                y[l] = dl * (float) q[l] - ml;
            }
        }
    }
}

void iq_dequantize_row_q3_K(const void * x, float * y, int64_t n) {
    const block_q3_K * b = x;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        int8_t q[QK_K], sc[16];
        const float d = iq_fp16_to_fp32(b[i].d);
        iq_unpack_codes_k2(b[i].qs, b[i].hmask, q);
        iq_unpack_scales_q3_K(b[i].scales, sc);
        for (int l = 0; l < QK_K; l++) {
            y[l] = (d * (float) sc[l / 16]) * (float) q[l];
        }
    }
}

void iq_dequantize_row_q8_K(const void * x, float * y, int64_t n) {
    const block_q8_K * b = x;
    for (int64_t i = 0; i < n / QK_K; i++, y += QK_K) {
        for (int j = 0; j < QK_K; j++) {
            y[j] = b[i].d * (float) b[i].qs[j];
        }
    }
}

// q8_K: scale -127/max so the largest magnitude lands on -127 (never -128), codes rounded to
// nearest even; bsums (sums of 16 codes) let the K-quant products apply their mins cheaply.
void iq_quantize_row_q8_K(const float * x, void * y, int64_t n) {
    block_q8_K * b = y;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        const float max = iq_block_absmax_signed(x, QK_K);
        if (max == 0.0f) {
            memset(&b[i], 0, sizeof(b[i]));
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < QK_K; j++) {
            const long v = lrintf(iscale * x[j]);
            b[i].qs[j] = (int8_t) (v < 127 ? v : 127);
        }
        for (int j = 0; j < QK_K / 16; j++) {
            int sum = 0;
            for (int l = 0; l < 16; l++) {
                sum += b[i].qs[16 * j + l];
            }
            b[i].bsums[j] = (int16_t) sum;
        }
        b[i].d = 1.0f / iscale;
    }
}

// ---- non-linear 4-bit codes ----

static const int8_t iq4nl_values[16] = {IQ4NL_VALUES};

void iq_unpack_values_iq4(const uint8_t * qs, int8_t * v) {
    uint8_t q[32];
    iq_unpack_codes_32(qs, NULL, q);
    for (int j = 0; j < 32; j++) {
        v[j] = iq4nl_values[q[j]];
    }
}

void iq_unpack_scales_iq4_xs(uint16_t scales_h, const uint8_t * scales_l, int8_t * sc) {
    for (int b = 0; b < QK_K / 32; b++) {
        const int low = (scales_l[b / 2] >> (4 * (b % 2))) & 0xF, high = (scales_h >> (2 * b)) & 3;
        sc[b] = (int8_t) ((low | high << 4) - 32);
    }
}

void iq_dequantize_row_iq4_nl(const void * x, float * y, int64_t n) {
    const block_iq4_nl * b = x;
    for (int64_t i = 0; i < n / QK4_NL; i++, y += QK4_NL) {
        int8_t v[32];
        const float d = iq_fp16_to_fp32(b[i].d);
        iq_unpack_values_iq4(b[i].qs, v);
        for (int j = 0; j < 32; j++) {
            y[j] = d * (float) v[j];
        }
    }
}

void iq_dequantize_row_iq4_xs(const void * x, float * y, int64_t n) {
    const block_iq4_xs * b = x;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t sc[QK_K / 32];
        const float d = iq_fp16_to_fp32(b[i].d);
        iq_unpack_scales_iq4_xs(b[i].scales_h, b[i].scales_l, sc);
        for (int s = 0; s < QK_K / 32; s++, y += 32) {
            int8_t v[32];
            const float dl = d * (float) sc[s];
            iq_unpack_values_iq4(b[i].qs + 16 * s, v);
            for (int j = 0; j < 32; j++) {
                y[j] = dl * (float) v[j];
            }
        }
    }
}
