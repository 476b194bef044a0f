// The weight types' dot products for aarch64, written once over the int8 dot product of 16
// lanes. Included by quants-neon.c and quants-dotprod.c after they define
//   IQ_ARM_DOT(acc, a, b): the int32x4 acc plus the products of the int8x16 a and b, summed in
//     groups (which lane holds which product does not matter: every caller sums the lanes);
//   IQ_QUANTS_TABLE: the name of the table of iq_cpu_type_traits.
// Code products are summed exactly in integers and each block's scales are applied as the scalar
// code applies them, so the results differ from the reference only by the order of the float
// sums. q5_K's and q6_K's codes and the K-quants' scales are unpacked by the portable helpers of
// iq-quants.h, and the K-quants' and iq4_xs' row loops are the scalar kernels' (quants-rows.h);
// the types not listed here run the scalar kernels. The activation quantizers write the scalar
// ones' bytes: fcvtas rounds as roundf, fcvtns as lrintf.
#include "arm-kernels.h"
#include "quants-rows.h"

#include "iq-quants.h"

#include <arm_neon.h>
#include <math.h>
#include <string.h>

#define IQ_ARM_INLINE static inline __attribute__((always_inline))

IQ_ARM_INLINE float arm_h2f(iq_fp16_t h) {
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}

// sum a . y over 32 int8 values, a in two registers.
IQ_ARM_INLINE int32_t arm_dot32(int8x16_t a0, int8x16_t a1, const int8_t * y) {
    int32x4_t acc = IQ_ARM_DOT(vdupq_n_s32(0), a0, vld1q_s8(y));
    acc = IQ_ARM_DOT(acc, a1, vld1q_s8(y + 16));
    return vaddvq_s32(acc);
}

// The 32 codes of 16 bytes packed as q4_0's: elements 0..15 the low nibbles, 16..31 the high.
IQ_ARM_INLINE void arm_nibbles(const uint8_t * qs, int8x16_t * lo, int8x16_t * hi) {
    const uint8x16_t b = vld1q_u8(qs);
    *lo = vreinterpretq_s8_u8(vandq_u8(b, vdupq_n_u8(15)));
    *hi = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
}

// Rows of f32 or f16 against f32: four accumulators of four lanes, the tail in scalar.
IQ_ARM_INLINE float32x4_t arm_load4(const void * x, int64_t i, bool half) {
    return half ? vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *) x + i))) : vld1q_f32((const float *) x + i);
}

IQ_ARM_INLINE float arm_dot_rows_f32(int64_t n, const void * x, const float * y, bool half) {
    float32x4_t acc[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int k = 0; k < 4; k++) {
            acc[k] = vfmaq_f32(acc[k], arm_load4(x, i + 4 * k, half), vld1q_f32(y + i + 4 * k));
        }
    }
    float sum = vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
    for (; i < n; i++) {
        sum += (half ? iq_fp16_to_fp32(((const iq_fp16_t *) x)[i]) : ((const float *) x)[i]) * y[i];
    }
    return sum;
}

static void arm_vec_dot_f32_f32(int64_t n, float * s, const void * x, const void * y) {
    *s = arm_dot_rows_f32(n, x, y, false);
}

static void arm_vec_dot_f16_f32(int64_t n, float * s, const void * x, const void * y) {
    *s = arm_dot_rows_f32(n, x, y, true);
}

// q4_0 / q5_0 / iq4_nl . q8_0 and q4_1 / q5_1 . q8_1: a block's codes (signed, zero point
// removed) as two registers; codes(x, i, lo, hi) writes those of block i.
typedef void (*arm_codes_fn)(const void * x, int64_t i, int8x16_t * lo, int8x16_t * hi);

IQ_ARM_INLINE void arm_codes_q4_0(const void * x, int64_t i, int8x16_t * lo, int8x16_t * hi) {
    arm_nibbles(((const block_q4_0 *) x)[i].qs, lo, hi);
    *lo = vsubq_s8(*lo, vdupq_n_s8(8));
    *hi = vsubq_s8(*hi, vdupq_n_s8(8));
}

IQ_ARM_INLINE void arm_codes_q4_1(const void * x, int64_t i, int8x16_t * lo, int8x16_t * hi) {
    arm_nibbles(((const block_q4_1 *) x)[i].qs, lo, hi);
}

IQ_ARM_INLINE void arm_codes_q8_0(const void * x, int64_t i, int8x16_t * lo, int8x16_t * hi) {
    *lo = vld1q_s8(((const block_q8_0 *) x)[i].qs);
    *hi = vld1q_s8(((const block_q8_0 *) x)[i].qs + 16);
}

IQ_ARM_INLINE void arm_codes_32(const uint8_t * qs, const uint8_t * qh, int offset, int8x16_t * lo, int8x16_t * hi) {
    uint8_t q[32];
    iq_unpack_codes_32(qs, qh, q);
    *lo = vsubq_s8(vreinterpretq_s8_u8(vld1q_u8(q)), vdupq_n_s8((int8_t) offset));
    *hi = vsubq_s8(vreinterpretq_s8_u8(vld1q_u8(q + 16)), vdupq_n_s8((int8_t) offset));
}

IQ_ARM_INLINE void arm_codes_q5_0(const void * x, int64_t i, int8x16_t * lo, int8x16_t * hi) {
    arm_codes_32(((const block_q5_0 *) x)[i].qs, ((const block_q5_0 *) x)[i].qh, 16, lo, hi);
}

IQ_ARM_INLINE void arm_codes_q5_1(const void * x, int64_t i, int8x16_t * lo, int8x16_t * hi) {
    arm_codes_32(((const block_q5_1 *) x)[i].qs, ((const block_q5_1 *) x)[i].qh, 0, lo, hi);
}

IQ_ARM_INLINE void arm_codes_iq4_nl(const void * x, int64_t i, int8x16_t * lo, int8x16_t * hi) {
    static const int8_t values[16] = {IQ4NL_VALUES};
    const int8x16_t table = vld1q_s8(values);
    int8x16_t l, h;
    arm_nibbles(((const block_iq4_nl *) x)[i].qs, &l, &h);
    *lo = vqtbl1q_s8(table, vreinterpretq_u8_s8(l));
    *hi = vqtbl1q_s8(table, vreinterpretq_u8_s8(h));
}

// Blocks of xs bytes that start with their fp16 d (and m, for the q8_1 side).
IQ_ARM_INLINE float arm_sym_dot(int64_t n, const void * x, size_t xs, const block_q8_0 * y, arm_codes_fn codes) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n / 32; i++) {
        int8x16_t lo, hi;
        codes(x, i, &lo, &hi);
        const iq_fp16_t d = *(const iq_fp16_t *) ((const char *) x + i * xs);
        sum += (float) arm_dot32(lo, hi, y[i].qs) * (arm_h2f(d) * arm_h2f(y[i].d));
    }
    return sum;
}

IQ_ARM_INLINE float arm_asym_dot(int64_t n, const void * x, size_t xs, const block_q8_1 * y, arm_codes_fn codes) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n / 32; i++) {
        int8x16_t lo, hi;
        codes(x, i, &lo, &hi);
        const iq_fp16_t * dm = (const iq_fp16_t *) ((const char *) x + i * xs);
        sum += (float) arm_dot32(lo, hi, y[i].qs) * (arm_h2f(dm[0]) * arm_h2f(y[i].d)) + arm_h2f(dm[1]) * arm_h2f(y[i].s);
    }
    return sum;
}

#define IQ_ARM_DOT_32(wt, yt, kind)                                                          \
    static void arm_vec_dot_##wt##_##yt(int64_t n, float * s, const void * x, const void * y) { \
        *s = arm_##kind##_dot(n, x, sizeof(block_##wt), y, arm_codes_##wt);                   \
    }
IQ_ARM_DOT_32(q4_0, q8_0, sym)
IQ_ARM_DOT_32(q5_0, q8_0, sym)
IQ_ARM_DOT_32(q8_0, q8_0, sym)
IQ_ARM_DOT_32(iq4_nl, q8_0, sym)
IQ_ARM_DOT_32(q4_1, q8_1, asym)
IQ_ARM_DOT_32(q5_1, q8_1, asym)
#undef IQ_ARM_DOT_32

// q4_K / q5_K . q8_K: x = d sc_j u - dmin m_j per sub-block j of 32. 32 bytes of qs hold
// sub-blocks 2k (low nibbles) and 2k + 1 (high nibbles); bits 2k and 2k + 1 of qh[l] (q5_K) are
// bit 4 of their element l.
IQ_ARM_INLINE float arm_dot_block_k4(const uint8_t * scales, const uint8_t * qs, const uint8_t * qh, iq_fp16_t d,
                                     iq_fp16_t dmin, const block_q8_K * y) {
    uint8_t sc[8], m[8];
    iq_unpack_scales_k4(scales, sc, m);
    int32_t sumi = 0, summ = 0;
    for (int k = 0; k < 4; k++) {
        const uint8x16_t b0 = vld1q_u8(qs + 32 * k), b1 = vld1q_u8(qs + 32 * k + 16);
        uint8x16_t l0 = vandq_u8(b0, vdupq_n_u8(15)), l1 = vandq_u8(b1, vdupq_n_u8(15));
        uint8x16_t h0 = vshrq_n_u8(b0, 4), h1 = vshrq_n_u8(b1, 4);
        if (qh != NULL) {
            const uint8x16_t q0 = vld1q_u8(qh), q1 = vld1q_u8(qh + 16), sixteen = vdupq_n_u8(16);
            const uint8x16_t bl = vdupq_n_u8((uint8_t) (1u << (2 * k))), bh = vdupq_n_u8((uint8_t) (2u << (2 * k)));
            l0 = vorrq_u8(l0, vandq_u8(vtstq_u8(q0, bl), sixteen));
            l1 = vorrq_u8(l1, vandq_u8(vtstq_u8(q1, bl), sixteen));
            h0 = vorrq_u8(h0, vandq_u8(vtstq_u8(q0, bh), sixteen));
            h1 = vorrq_u8(h1, vandq_u8(vtstq_u8(q1, bh), sixteen));
        }
        const int8_t * yq = y->qs + 64 * k;
        sumi += sc[2 * k] * arm_dot32(vreinterpretq_s8_u8(l0), vreinterpretq_s8_u8(l1), yq);
        sumi += sc[2 * k + 1] * arm_dot32(vreinterpretq_s8_u8(h0), vreinterpretq_s8_u8(h1), yq + 32);
    }
    for (int j = 0; j < 8; j++) {
        summ += m[j] * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
    }
    return arm_h2f(d) * y->d * (float) sumi - arm_h2f(dmin) * y->d * (float) summ;
}

// q6_K: the 16 groups of 16 of a block's signed codes, each times its int8 scale.
IQ_ARM_INLINE int32_t arm_dot_sums_q6_K(const int8_t * q, const int8_t * sc, const int8_t * y) {
    int32_t isum = 0;
    for (int g = 0; g < QK_K / 16; g++) {
        const int32x4_t acc = IQ_ARM_DOT(vdupq_n_s32(0), vld1q_s8(q + 16 * g), vld1q_s8(y + 16 * g));
        isum += sc[g] * vaddvq_s32(acc);
    }
    return isum;
}

// q2_K / q3_K . q8_K: codes 0..3 (q2_K) or -4..3 (q3_K: 4 less where the hmask bit is clear), one
// scale per 16 elements. Element 128 h + 32 j + l is bits 2j, 2j + 1 of qs[32 h + l], its hmask
// bit 4 h + j of hmask[l].
IQ_ARM_INLINE float arm_dot_block_k2(const uint8_t * qs, const uint8_t * hmask, const int8_t * sc, iq_fp16_t d,
                                     const block_q8_K * yb) {
    const int8_t * y = yb->qs;
    int32_t sum = 0;
    for (int h = 0; h < 2; h++) {
        const uint8x16_t b[2] = {vld1q_u8(qs + 32 * h), vld1q_u8(qs + 32 * h + 16)};
        for (int j = 0; j < 4; j++) {
            for (int k = 0; k < 2; k++) {
                const int g = 8 * h + 2 * j + k;
                uint8x16_t u = vandq_u8(vshlq_u8(b[k], vdupq_n_s8((int8_t) (-2 * j))), vdupq_n_u8(3));
                int8x16_t q = vreinterpretq_s8_u8(u);
                if (hmask != NULL) {
                    const uint8x16_t set = vtstq_u8(vld1q_u8(hmask + 16 * k), vdupq_n_u8((uint8_t) (1u << (4 * h + j))));
                    q = vsubq_s8(q, vreinterpretq_s8_u8(vbicq_u8(vdupq_n_u8(4), set)));
                }
                sum += sc[g] * vaddvq_s32(IQ_ARM_DOT(vdupq_n_s32(0), q, vld1q_s8(y + 16 * g)));
            }
        }
    }
    return arm_h2f(d) * yb->d * (float) sum;
}

// iq4_xs: iq4_nl's values with a signed 6-bit scale per 32 elements (16 bytes of qs).
IQ_ARM_INLINE int32_t arm_dot_sums_iq4_xs(const uint8_t * qs, const int8_t * sc, const int8_t * y) {
    static const int8_t values[16] = {IQ4NL_VALUES};
    const int8x16_t table = vld1q_s8(values);
    int32_t sumi = 0;
    for (int b = 0; b < QK_K / 32; b++) {
        int8x16_t lo, hi;
        arm_nibbles(qs + 16 * b, &lo, &hi);
        lo = vqtbl1q_s8(table, vreinterpretq_u8_s8(lo));
        hi = vqtbl1q_s8(table, vreinterpretq_u8_s8(hi));
        sumi += sc[b] * arm_dot32(lo, hi, y + 32 * b);
    }
    return sumi;
}

// q4_K, q5_K, q6_K, q2_K, q3_K, iq4_xs . q8_K: the row loops of quants-rows.h over the block
// functions above.
IQ_QUANTS_ROWS_K(arm, arm_dot_block_k4, arm_dot_sums_q6_K, arm_dot_block_k2, arm_dot_sums_iq4_xs, arm_h2f)

// ---- activation quantizers (same bytes as iq_quantize_row_q8_0 / _q8_1 / _q8_K) ----

IQ_ARM_INLINE iq_fp16_t arm_f2h(float f) {
    return vget_lane_u16(vreinterpret_u16_f16(vcvt_f16_f32(vdupq_n_f32(f))), 0);
}

// 32 i32 (eight registers, element order) -> 32 i8 in order; the values fit, nothing saturates.
IQ_ARM_INLINE void arm_store_s32_s8(const int32x4_t * q, int8_t * y) {
    for (int k = 0; k < 2; k++) {
        const int16x8_t a = vcombine_s16(vqmovn_s32(q[4 * k]), vqmovn_s32(q[4 * k + 1]));
        const int16x8_t b = vcombine_s16(vqmovn_s32(q[4 * k + 2]), vqmovn_s32(q[4 * k + 3]));
        vst1q_s8(y + 16 * k, vcombine_s8(vqmovn_s16(a), vqmovn_s16(b)));
    }
}

// One q8_0 / q8_1 block: codes rounded half away from zero (fcvtas, as roundf) to qs, returns
// d, sets the code sum. The maxima skip NaNs (fmaxnm), as fmaxf and the scalar compares do.
IQ_ARM_INLINE float arm_quantize_block_q8(const float * x, int8_t * qs, int * sum) {
    float32x4_t v[8];
    float32x4_t amax = vdupq_n_f32(0.0f);
    for (int k = 0; k < 8; k++) {
        v[k] = vld1q_f32(x + 4 * k);
        amax = vmaxnmq_f32(amax, vabsq_f32(v[k]));
    }
    const float d = vmaxnmvq_f32(amax) / 127.0f;
    const float id = d ? 1.0f / d : 0.0f;
    int32x4_t q[8];
    int32x4_t s = vdupq_n_s32(0);
    for (int k = 0; k < 8; k++) {
        q[k] = vcvtaq_s32_f32(vmulq_n_f32(v[k], id));
        s = vaddq_s32(s, q[k]);
    }
    *sum = vaddvq_s32(s);
    arm_store_s32_s8(q, qs);
    return d;
}

static void arm_quantize_row_q8_0(const float * x, void * vy, int64_t n) {
    block_q8_0 * y = vy;
    for (int64_t i = 0; i < n / QK8_0; i++) {
        int sum;
        y[i].d = arm_f2h(arm_quantize_block_q8(x + QK8_0 * i, y[i].qs, &sum));
    }
}

static void arm_quantize_row_q8_1(const float * x, void * vy, int64_t n) {
    block_q8_1 * y = vy;
    for (int64_t i = 0; i < n / QK8_1; i++) {
        int sum;
        const float d = arm_quantize_block_q8(x + QK8_1 * i, y[i].qs, &sum);
        y[i].d = arm_f2h(d);
        y[i].s = arm_f2h((float) sum * d);
    }
}

// q8_K: the scale comes from the first element of largest magnitude (its sign matters); codes
// rounded to nearest even (fcvtns, as lrintf).
static void arm_quantize_row_q8_K(const float * x, void * vy, int64_t n) {
    block_q8_K * y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        float32x4_t amax = vdupq_n_f32(0.0f);
        for (int k = 0; k < QK_K; k += 4) {
            amax = vmaxnmq_f32(amax, vabsq_f32(vld1q_f32(x + k)));
        }
        const float amax1 = vmaxnmvq_f32(amax);
        if (amax1 == 0.0f) {
            memset(&y[i], 0, sizeof(y[i]));
            continue;
        }
        int first = 0;
        while (fabsf(x[first]) != amax1) {
            first++;
        }
        const float iscale = -127.0f / x[first];
        for (int k = 0; k < QK_K; k += 32) {
            int32x4_t q[8];
            for (int j = 0; j < 8; j++) {
                q[j] = vminq_s32(vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + k + 4 * j), iscale)), vdupq_n_s32(127));
            }
            y[i].bsums[k / 16] = (int16_t) vaddvq_s32(vaddq_s32(vaddq_s32(q[0], q[1]), vaddq_s32(q[2], q[3])));
            y[i].bsums[k / 16 + 1] = (int16_t) vaddvq_s32(vaddq_s32(vaddq_s32(q[4], q[5]), vaddq_s32(q[6], q[7])));
            arm_store_s32_s8(q, y[i].qs + k);
        }
        y[i].d = 1.0f / iscale;
    }
}

const struct iq_cpu_type_traits IQ_QUANTS_TABLE[IQ_TYPE_GGUF_END] = {
    [IQ_TYPE_F32] = {.vec_dot = arm_vec_dot_f32_f32},
    [IQ_TYPE_F16] = {.vec_dot = arm_vec_dot_f16_f32},
    [IQ_TYPE_Q4_0] = {.from_float = arm_quantize_row_q8_0, .vec_dot = arm_vec_dot_q4_0_q8_0},
    [IQ_TYPE_Q4_1] = {.from_float = arm_quantize_row_q8_1, .vec_dot = arm_vec_dot_q4_1_q8_1},
    [IQ_TYPE_Q5_0] = {.from_float = arm_quantize_row_q8_0, .vec_dot = arm_vec_dot_q5_0_q8_0},
    [IQ_TYPE_Q5_1] = {.from_float = arm_quantize_row_q8_1, .vec_dot = arm_vec_dot_q5_1_q8_1},
    [IQ_TYPE_Q8_0] = {.from_float = arm_quantize_row_q8_0, .vec_dot = arm_vec_dot_q8_0_q8_0},
    [IQ_TYPE_Q4_K] = {.from_float = arm_quantize_row_q8_K, .vec_dot = arm_vec_dot_q4_K_q8_K},
    [IQ_TYPE_Q5_K] = {.from_float = arm_quantize_row_q8_K, .vec_dot = arm_vec_dot_q5_K_q8_K},
    [IQ_TYPE_Q6_K] = {.from_float = arm_quantize_row_q8_K, .vec_dot = arm_vec_dot_q6_K_q8_K},
    [IQ_TYPE_Q2_K] = {.from_float = arm_quantize_row_q8_K, .vec_dot = arm_vec_dot_q2_K_q8_K},
    [IQ_TYPE_Q3_K] = {.from_float = arm_quantize_row_q8_K, .vec_dot = arm_vec_dot_q3_K_q8_K},
    [IQ_TYPE_IQ4_NL] = {.from_float = arm_quantize_row_q8_0, .vec_dot = arm_vec_dot_iq4_nl_q8_0},
    [IQ_TYPE_IQ4_XS] = {.from_float = arm_quantize_row_q8_K, .vec_dot = arm_vec_dot_iq4_xs_q8_K},
};
