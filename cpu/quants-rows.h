// The dot products of the weight types with 256-element blocks against q8_K (q4_K, q5_K, q6_K,
// q2_K, q3_K, iq4_xs), written once over a file's block functions, for the scalar kernels (quants.c)
// and the aarch64 ones (arm/quants-arm.h): each file brings a block's integer code products and
// its fp16 conversion; the scale unpacking, the float steps and the row loop are here, so a
// kernel differs from the scalar one only inside its block functions.
#pragma once

#include "iq-quants.h"

#define IQ_QUANTS_ROW_INLINE static inline __attribute__((always_inline))

// q4_K / q5_K: d sc_j (u . y) - dmin m_j (bsums) of one block (qh: q5_K's fifth bits, NULL for
// q4_K).
typedef float (*iq_dot_block_k4_fn)(const uint8_t * scales, const uint8_t * qs, const uint8_t * qh, iq_fp16_t d,
                                    iq_fp16_t dmin, const block_q8_K * y);
// q2_K / q3_K: d y->d sum_g sc[g] (q . y) over the 16 groups of 16 of one block (hmask: q3_K's
// high bits, NULL for q2_K).
typedef float (*iq_dot_block_k2_fn)(const uint8_t * qs, const uint8_t * hmask, const int8_t * sc, iq_fp16_t d,
                                    const block_q8_K * y);
// q6_K: sum_g sc[g] (q . y) over the 16 groups of 16 of one block's signed codes q.
typedef int32_t (*iq_dot_sums_q6_K_fn)(const int8_t * q, const int8_t * sc, const int8_t * y);
// iq4_xs: sum_b sc[b] (v . y) over the 8 sub-blocks of 32 of one block, v the table values of
// the codes in qs.
typedef int32_t (*iq_dot_sums_iq4_xs_fn)(const uint8_t * qs, const int8_t * sc, const int8_t * y);

// One block of each type against its q8_K block y, over a file's block functions.
IQ_QUANTS_ROW_INLINE float iq_dot_block_q4_K(const block_q4_K * x, const block_q8_K * y, iq_dot_block_k4_fn block) {
    return block(x->scales, x->qs, NULL, x->d, x->dmin, y);
}

IQ_QUANTS_ROW_INLINE float iq_dot_block_q5_K(const block_q5_K * x, const block_q8_K * y, iq_dot_block_k4_fn block) {
    return block(x->scales, x->qs, x->qh, x->d, x->dmin, y);
}

// q6_K: signed 6-bit codes, one int8 scale per 16 elements.
IQ_QUANTS_ROW_INLINE float iq_dot_block_q6_K(const block_q6_K * x, const block_q8_K * y, iq_dot_sums_q6_K_fn sums,
                                             float (*h2f)(iq_fp16_t)) {
    int8_t q[QK_K];
    iq_unpack_codes_q6_K(x->ql, x->qh, q);
    const int32_t isum = sums(q, x->scales, y->qs);
    return h2f(x->d) * y->d * (float) isum;
}

// q2_K: x = d (s & 15) u - dmin (s >> 4); the min term needs only the activation sums over each
// group (bsums). h2f converts dmin as the block function converts d.
IQ_QUANTS_ROW_INLINE float iq_dot_block_q2_K(const block_q2_K * x, const block_q8_K * y, iq_dot_block_k2_fn block,
                                             float (*h2f)(iq_fp16_t)) {
    int8_t sc[QK_K / 16];
    int summ = 0;
    for (int g = 0; g < QK_K / 16; g++) {
        sc[g] = (int8_t) (x->scales[g] & 0xF);
        summ += (x->scales[g] >> 4) * y->bsums[g];
    }
    return block(x->qs, NULL, sc, x->d, y) - h2f(x->dmin) * y->d * (float) summ;
}

// q3_K: signed 6-bit scales.
IQ_QUANTS_ROW_INLINE float iq_dot_block_q3_K(const block_q3_K * x, const block_q8_K * y, iq_dot_block_k2_fn block) {
    int8_t sc[QK_K / 16];
    iq_unpack_scales_q3_K(x->scales, sc);
    return block(x->qs, x->hmask, sc, x->d, y);
}

// iq4_xs: a signed 6-bit scale per 32 elements.
IQ_QUANTS_ROW_INLINE float iq_dot_block_iq4_xs(const block_iq4_xs * x, const block_q8_K * y,
                                               iq_dot_sums_iq4_xs_fn sums, float (*h2f)(iq_fp16_t)) {
    int8_t sc[QK_K / 32];
    iq_unpack_scales_iq4_xs(x->scales_h, x->scales_l, sc);
    const int32_t sumi = sums(x->qs, sc, y->qs);
    return h2f(x->d) * y->d * (float) sumi;
}

// The row: n / QK_K blocks of xs bytes, dot(block, its q8_K block) summed in order.
IQ_QUANTS_ROW_INLINE float iq_dot_row_k(int64_t n, const void * x, size_t xs, const block_q8_K * y,
                                        float (*dot)(const void * x, const block_q8_K * y)) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        sum += dot((const char *) x + i * xs, &y[i]);
    }
    return sum;
}

// Defines prefix_vec_dot_<type>_q8_K for q4_K, q5_K, q6_K, q2_K, q3_K and iq4_xs over one file's
// block functions and its fp16 conversion.
#define IQ_QUANTS_ROW_K(prefix, type, ...)                                                               \
    IQ_QUANTS_ROW_INLINE float prefix##_dot_##type(const void * x, const block_q8_K * y) {               \
        return iq_dot_block_##type(x, y, __VA_ARGS__);                                                   \
    }                                                                                                    \
    static void prefix##_vec_dot_##type##_q8_K(int64_t n, float * s, const void * vx, const void * vy) { \
        *s = iq_dot_row_k(n, vx, sizeof(block_##type), vy, prefix##_dot_##type);                         \
    }
#define IQ_QUANTS_ROWS_K(prefix, block_k4, sums_q6_K, block_k2, sums_iq4_xs, h2f)                        \
    IQ_QUANTS_ROW_K(prefix, q4_K, block_k4)                                                              \
    IQ_QUANTS_ROW_K(prefix, q5_K, block_k4)                                                              \
    IQ_QUANTS_ROW_K(prefix, q6_K, sums_q6_K, h2f)                                                        \
    IQ_QUANTS_ROW_K(prefix, q2_K, block_k2, h2f)                                                         \
    IQ_QUANTS_ROW_K(prefix, q3_K, block_k2)                                                              \
    IQ_QUANTS_ROW_K(prefix, iq4_xs, sums_iq4_xs, h2f)
