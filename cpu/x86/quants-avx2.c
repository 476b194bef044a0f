// AVX2 + FMA + F16C kernels: dot products, activation quantizers and row dequantization.
//
// Integer products use vpmaddubsw (unsigned x signed bytes -> i16 pairs) then vpmaddwd
// against ones (-> i32). Signed x signed products move the sign of x onto y first, which is
// exact because activation codes lie in [-127, 127] (our quantizers never emit -128).
// Quantizers and dequantizers give the reference's bytes / floats exactly.
#include "x86-kernels.h"

#include "iq-quants.h"

#include <immintrin.h>

#define IQ_INLINE static inline __attribute__((always_inline))

// Dequantization must round the product before adding, like the reference (see iq-quants.c).
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

// ---- helpers ----

static inline float iq_hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int iq_hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

static inline float iq_h2f(iq_fp16_t h) { return _cvtsh_ss(h); }

static inline __m256i iq_load_256(const void * p) { return _mm256_loadu_si256((const __m256i *) p); }

// Sums of 4 adjacent u8 x s8 products, per i32 lane.
static inline __m256i iq_dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// Sums of 2 adjacent s8 x s8 products, per i16 lane (|x|, |y| <= 127: no saturation).
static inline __m256i iq_mul_s8s8(__m256i x, __m256i y) {
    return _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
}

// Sums of 4 adjacent s8 x s8 products, per i32 lane (|y| <= 127).
static inline __m256i iq_dot_s8s8(__m256i x, __m256i y) {
    return _mm256_madd_epi16(iq_mul_s8s8(x, y), _mm256_set1_epi16(1));
}

// The iq4_nl values in both 128-bit lanes, for vpshufb lookups of 4-bit codes.
static inline __m256i iq_iq4nl_table(void) { return _mm256_broadcastsi128_si256(_mm_setr_epi8(IQ4NL_VALUES)); }

// 16 bytes of packed nibbles -> 32 codes: low nibbles (elements 0..15), then high ones.
static inline __m256i iq_unpack_nibbles_32(const uint8_t * qs) {
    const __m128i q = _mm_loadu_si128((const __m128i *) qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

// 32 bits (little-endian) -> 32 bytes, 0xFF where the bit is set.
static inline __m256i iq_expand_bits_32(const uint8_t * qh) {
    uint32_t h;
    memcpy(&h, qh, sizeof(h));
    const __m256i pick = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int) h), pick);
    return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

// ---- f32 / f16 / bf16 rows ----

// 8 elements from element i of a row as f32, and one element (for the tail).
typedef __m256 (*iq_load8_fn)(const void * row, int64_t i);
typedef float (*iq_load1_fn)(const void * row, int64_t i);

IQ_INLINE __m256 iq_load8_f32(const void * row, int64_t i) { return _mm256_loadu_ps((const float *) row + i); }

IQ_INLINE __m256 iq_load8_f16(const void * row, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) ((const iq_fp16_t *) row + i)));
}

IQ_INLINE __m256 iq_load8_bf16(const void * row, int64_t i) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *) ((const iq_bf16_t *) row + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

IQ_INLINE float iq_load1_f32(const void * row, int64_t i) { return ((const float *) row)[i]; }
IQ_INLINE float iq_load1_f16(const void * row, int64_t i) { return iq_fp16_to_fp32(((const iq_fp16_t *) row)[i]); }
IQ_INLINE float iq_load1_bf16(const void * row, int64_t i) { return iq_bf16_to_fp32(((const iq_bf16_t *) row)[i]); }

// Four accumulators hide the FMA latency; the tail is summed in scalar.
IQ_INLINE float iq_dot_rows_f32(int64_t n, const void * x, const float * y, iq_load8_fn load8, iq_load1_fn load1) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            acc[k] = _mm256_fmadd_ps(load8(x, i + 8 * k), _mm256_loadu_ps(y + i + 8 * k), acc[k]);
        }
    }
    for (; i + 8 <= n; i += 8) {
        acc[0] = _mm256_fmadd_ps(load8(x, i), _mm256_loadu_ps(y + i), acc[0]);
    }
    float sum = iq_hsum_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (; i < n; i++) {
        sum += load1(x, i) * y[i];
    }
    return sum;
}

static void iq_vec_dot_f32_f32_avx2(int64_t n, float * s, const void * x, const void * y) {
    *s = iq_dot_rows_f32(n, x, y, iq_load8_f32, iq_load1_f32);
}

static void iq_vec_dot_f16_f32_avx2(int64_t n, float * s, const void * x, const void * y) {
    *s = iq_dot_rows_f32(n, x, y, iq_load8_f16, iq_load1_f16);
}

static void iq_vec_dot_bf16_f32_avx2(int64_t n, float * s, const void * x, const void * y) {
    *s = iq_dot_rows_f32(n, x, y, iq_load8_bf16, iq_load1_bf16);
}

IQ_INLINE void iq_convert_row_f32(const void * x, float * y, int64_t n, iq_load8_fn load8, iq_load1_fn load1) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(y + i, load8(x, i));
    }
    for (; i < n; i++) {
        y[i] = load1(x, i);
    }
}

static void iq_dequantize_row_f16_avx2(const void * x, float * y, int64_t n) {
    iq_convert_row_f32(x, y, n, iq_load8_f16, iq_load1_f16);
}

static void iq_dequantize_row_bf16_avx2(const void * x, float * y, int64_t n) {
    iq_convert_row_f32(x, y, n, iq_load8_bf16, iq_load1_bf16);
}

// ---- 32-element blocks . q8_0 / q8_1 ----
//
// Every block starts with its fp16 d (then m for q4_1 / q5_1; q8_1 has d then s), so one driver
// serves all formats: per block, the codes' i32 products scaled by d_x d_y, plus m_x s_y for
// the asymmetric ones. Two accumulators alternate to hide the FMA latency.

typedef __m256i (*iq_block_dot_fn)(const void * x, const void * y);

static inline iq_fp16_t iq_fp16_at(const char * p) {
    iq_fp16_t h;
    memcpy(&h, p, sizeof(h));
    return h;
}

static inline int iq_load_u32(const char * p) {
    int v;
    memcpy(&v, p, sizeof(v));
    return v;
}

IQ_INLINE void iq_step_block_32(const char * x, const char * y, bool asym, iq_block_dot_fn dot, __m256 * acc,
                                float * summs) {
    const __m256 d = _mm256_set1_ps(iq_h2f(iq_fp16_at(x)) * iq_h2f(iq_fp16_at(y)));
    *acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot(x, y)), *acc);
    if (asym) {
        *summs += iq_h2f(iq_fp16_at(x + 2)) * iq_h2f(iq_fp16_at(y + 2));
    }
}

// The same for ncols activation rows y + c * by at once: each block's codes are made once, and
// each column runs exactly the single-row arithmetic (its own two accumulators, the same order),
// its scales read as f32 from ys + c * bys (the same values iq_h2f gives, multiplied the same).
typedef __m256i (*iq_block_codes_fn)(const void * x);
typedef __m256i (*iq_codes_dot_fn)(__m256i codes, const void * y);

// Block i of the columns into one of the two accumulator sets (acc, summs).
IQ_INLINE void iq_step_block_32_cols(const char * xb, const char * y, size_t ys, size_t by, const float * yf,
                                     size_t byf, int64_t i, int ncols, bool asym, iq_block_codes_fn codes,
                                     iq_codes_dot_fn dot, __m256 * acc, float * summs) {
    const __m256i q = codes(xb);
    const __m256 dx = _mm256_set1_ps(iq_h2f(iq_fp16_at(xb)));
    const float mx = asym ? iq_h2f(iq_fp16_at(xb + 2)) : 0.0f;
#pragma GCC unroll 4
    for (int c = 0; c < IQ_VEC_DOT_COLS; c++) {
        if (c < ncols) {
            const float * f = yf + c * byf + 2 * i;
            const __m256 d = _mm256_mul_ps(dx, _mm256_broadcast_ss(f));  // dx * dy, rounded as a float
            acc[c] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot(q, y + c * by + i * ys)), acc[c]);
            if (asym) {
                summs[c] += mx * f[1];
            }
        }
    }
}

IQ_INLINE void iq_dot_blocks_32_cols(int64_t nb, const void * vx, size_t xs, const void * vy, size_t ys, size_t by,
                                     const float * yf, size_t byf, int ncols, bool asym, iq_block_codes_fn codes,
                                     iq_codes_dot_fn dot, float * s, size_t bs) {
    const char * x = vx;
    const char * y = vy;
    // two sets, as the single-row driver alternates its two (blocks 2j and 2j + 1): unrolled by
    // two so that each set is indexed by constants and stays in registers
    __m256 acc0[IQ_VEC_DOT_COLS], acc1[IQ_VEC_DOT_COLS];
    float summs0[IQ_VEC_DOT_COLS], summs1[IQ_VEC_DOT_COLS];
#pragma GCC unroll 4
    for (int c = 0; c < IQ_VEC_DOT_COLS; c++) {
        acc0[c] = acc1[c] = _mm256_setzero_ps();
        summs0[c] = summs1[c] = 0.0f;
    }
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        iq_step_block_32_cols(x + i * xs, y, ys, by, yf, byf, i, ncols, asym, codes, dot, acc0, summs0);
        iq_step_block_32_cols(x + (i + 1) * xs, y, ys, by, yf, byf, i + 1, ncols, asym, codes, dot, acc1, summs1);
    }
    if (i < nb) {
        iq_step_block_32_cols(x + i * xs, y, ys, by, yf, byf, i, ncols, asym, codes, dot, acc0, summs0);
    }
#pragma GCC unroll 4
    for (int c = 0; c < IQ_VEC_DOT_COLS; c++) {
        if (c < ncols) {
            s[c * bs] = iq_hsum_ps(_mm256_add_ps(acc0[c], acc1[c])) + (summs0[c] + summs1[c]);
        }
    }
}

IQ_INLINE float iq_dot_blocks_32(int64_t nb, const void * vx, size_t xs, const void * vy, size_t ys, bool asym,
                                 iq_block_dot_fn dot) {
    const char * x = vx;
    const char * y = vy;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float summs0 = 0.0f, summs1 = 0.0f;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        iq_step_block_32(x + i * xs, y + i * ys, asym, dot, &acc0, &summs0);
        iq_step_block_32(x + (i + 1) * xs, y + (i + 1) * ys, asym, dot, &acc1, &summs1);
    }
    if (i < nb) {
        iq_step_block_32(x + i * xs, y + i * ys, asym, dot, &acc0, &summs0);
    }
    return iq_hsum_ps(_mm256_add_ps(acc0, acc1)) + (summs0 + summs1);
}

// A block's codes as signed bytes (dot with q8_0's) or unsigned ones (dot with q8_1's).

IQ_INLINE __m256i iq_codes_dot_q8_0(__m256i codes, const void * vy) {
    return iq_dot_s8s8(codes, iq_load_256(((const block_q8_0 *) vy)->qs));
}

IQ_INLINE __m256i iq_codes_dot_q8_1(__m256i codes, const void * vy) {
    return iq_dot_u8s8(codes, iq_load_256(((const block_q8_1 *) vy)->qs));
}

// q4_0: codes - 8 are signed, so the sign trick applies.
IQ_INLINE __m256i iq_codes_q4_0(const void * vx) {
    return _mm256_sub_epi8(iq_unpack_nibbles_32(((const block_q4_0 *) vx)->qs), _mm256_set1_epi8(8));
}

// q5_0: OR-ing 0xF0 into codes whose bit 4 is clear gives (code - 16) as a signed byte.
IQ_INLINE __m256i iq_codes_q5_0(const void * vx) {
    const block_q5_0 * x = vx;
    const __m256i hi = _mm256_andnot_si256(iq_expand_bits_32(x->qh), _mm256_set1_epi8((char) 0xF0));
    return _mm256_or_si256(iq_unpack_nibbles_32(x->qs), hi);
}

IQ_INLINE __m256i iq_codes_q8_0(const void * vx) { return iq_load_256(((const block_q8_0 *) vx)->qs); }

// q4_1 / q5_1: unsigned codes go straight into vpmaddubsw.
IQ_INLINE __m256i iq_codes_q4_1(const void * vx) { return iq_unpack_nibbles_32(((const block_q4_1 *) vx)->qs); }

IQ_INLINE __m256i iq_codes_q5_1(const void * vx) {
    const block_q5_1 * x = vx;
    const __m256i hi = _mm256_and_si256(iq_expand_bits_32(x->qh), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(iq_unpack_nibbles_32(x->qs), hi);
}

// iq4_nl: the codes' values are signed bytes (-127..113), so the sign trick applies.
IQ_INLINE __m256i iq_codes_iq4_nl(const void * vx) {
    return _mm256_shuffle_epi8(iq_iq4nl_table(), iq_unpack_nibbles_32(((const block_iq4_nl *) vx)->qs));
}

IQ_INLINE __m256i iq_block_dot_q4_0(const void * x, const void * y) { return iq_codes_dot_q8_0(iq_codes_q4_0(x), y); }
IQ_INLINE __m256i iq_block_dot_q5_0(const void * x, const void * y) { return iq_codes_dot_q8_0(iq_codes_q5_0(x), y); }
IQ_INLINE __m256i iq_block_dot_q8_0(const void * x, const void * y) { return iq_codes_dot_q8_0(iq_codes_q8_0(x), y); }
IQ_INLINE __m256i iq_block_dot_q5_1(const void * x, const void * y) { return iq_codes_dot_q8_1(iq_codes_q5_1(x), y); }
IQ_INLINE __m256i iq_block_dot_iq4_nl(const void * x, const void * y) {
    return iq_codes_dot_q8_0(iq_codes_iq4_nl(x), y);
}

static void iq_vec_dot_q4_0_q8_0_avx2(int64_t n, float * s, const void * x, const void * y) {
    *s = iq_dot_blocks_32(n / QK4_0, x, sizeof(block_q4_0), y, sizeof(block_q8_0), false, iq_block_dot_q4_0);
}

static void iq_vec_dot_q5_0_q8_0_avx2(int64_t n, float * s, const void * x, const void * y) {
    *s = iq_dot_blocks_32(n / QK5_0, x, sizeof(block_q5_0), y, sizeof(block_q8_0), false, iq_block_dot_q5_0);
}

static void iq_vec_dot_iq4_nl_q8_0_avx2(int64_t n, float * s, const void * x, const void * y) {
    *s = iq_dot_blocks_32(n / QK4_NL, x, sizeof(block_iq4_nl), y, sizeof(block_q8_0), false, iq_block_dot_iq4_nl);
}

static void iq_vec_dot_q8_0_q8_0_avx2(int64_t n, float * s, const void * x, const void * y) {
    *s = iq_dot_blocks_32(n / QK8_0, x, sizeof(block_q8_0), y, sizeof(block_q8_0), false, iq_block_dot_q8_0);
}

static void iq_vec_dot_q5_1_q8_1_avx2(int64_t n, float * s, const void * x, const void * y) {
    *s = iq_dot_blocks_32(n / QK5_1, x, sizeof(block_q5_1), y, sizeof(block_q8_1), true, iq_block_dot_q5_1);
}

// All IQ_VEC_DOT_COLS columns (the common case) with the column count known to the compiler.
#define IQ_DOT_COLS_32(name, wt, yt, asym)                                                                    \
    static void iq_vec_dot_cols_##name##_avx2(int64_t n, float * s, size_t bs, const void * x, const void * y,  \
                                              size_t by, const float * yf, size_t byf, int ncols) {           \
        if (ncols == IQ_VEC_DOT_COLS) {                                                                       \
            iq_dot_blocks_32_cols(n / 32, x, sizeof(block_##wt), y, sizeof(block_##yt), by, yf, byf,          \
                                  IQ_VEC_DOT_COLS, asym, iq_codes_##wt, iq_codes_dot_##yt, s, bs);            \
        } else {                                                                                              \
            iq_dot_blocks_32_cols(n / 32, x, sizeof(block_##wt), y, sizeof(block_##yt), by, yf, byf, ncols,   \
                                  asym, iq_codes_##wt, iq_codes_dot_##yt, s, bs);                             \
        }                                                                                                     \
    }
IQ_DOT_COLS_32(q4_0, q4_0, q8_0, false)
IQ_DOT_COLS_32(q5_0, q5_0, q8_0, false)
IQ_DOT_COLS_32(q8_0, q8_0, q8_0, false)
IQ_DOT_COLS_32(q5_1, q5_1, q8_1, true)
IQ_DOT_COLS_32(iq4_nl, iq4_nl, q8_0, false)

// ---- q4_1 . q8_1: one activation row, or up to 8 in lanes ----
//
// Every column's arithmetic, alone or in lanes: each block's exact integer sum of products i_b,
// then acc[b % 4] = fma(m_x, s_y, fma(d_x d_y, i_b, acc[b % 4])) and the product
// (acc0 + acc2) + (acc1 + acc3). Alone, four blocks' sums share a vector. In lanes
// (iq_cpu_act_lanes' layout), a weight block's codes are made once and multiplied against all
// the columns at once: each 32-byte load holds 4 / 8 bytes of every column, the weight's
// matching codes broadcast to each column's lanes, so vpmaddubsw works for every column and the
// float steps for 8 columns cost what they cost for one.

// d and m (q4_1) or d and s (q8_1) of nv <= 4 blocks `stride` apart, as f32 (0 past nv).
IQ_INLINE void iq_block_scales_4(const char * p, size_t stride, int nv, __m128 * d, __m128 * m) {
    __m128i h = _mm_cvtsi32_si128(iq_load_u32(p));
    if (nv > 1) {
        h = _mm_insert_epi32(h, iq_load_u32(p + stride), 1);
    }
    if (nv > 2) {
        h = _mm_insert_epi32(h, iq_load_u32(p + 2 * stride), 2);
    }
    if (nv > 3) {
        h = _mm_insert_epi32(h, iq_load_u32(p + 3 * stride), 3);
    }
    const __m256 f = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(h), _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    *d = _mm256_castps256_ps128(f);
    *m = _mm256_extractf128_ps(f, 1);
}

// The 8 i32 partial sums of block b of x . y (0 past nv).
IQ_INLINE __m256i iq_isum_q4_1(const block_q4_1 * x, const block_q8_1 * y, int b, int nv) {
    return b < nv ? iq_dot_u8s8(iq_codes_q4_1(x + b), iq_load_256(y[b].qs)) : _mm256_setzero_si256();
}

// Blocks 0 .. nv - 1 (nv <= 4) into lanes 0 .. nv - 1 of acc.
IQ_INLINE __m128 iq_step_4_blocks_q4_1(const block_q4_1 * x, const block_q8_1 * y, int nv, __m128 acc) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(iq_isum_q4_1(x, y, 0, nv), iq_isum_q4_1(x, y, 1, nv)),
                                        _mm256_hadd_epi32(iq_isum_q4_1(x, y, 2, nv), iq_isum_q4_1(x, y, 3, nv)));
    const __m128i isum = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    __m128 dx, mx, dy, sy;
    iq_block_scales_4((const char *) x, sizeof(block_q4_1), nv, &dx, &mx);
    iq_block_scales_4((const char *) y, sizeof(block_q8_1), nv, &dy, &sy);
    acc = _mm_fmadd_ps(_mm_mul_ps(dx, dy), _mm_cvtepi32_ps(isum), acc);
    return _mm_fmadd_ps(mx, sy, acc);
}

static void iq_vec_dot_q4_1_q8_1_avx2(int64_t n, float * s, const void * vx, const void * vy) {
    const block_q4_1 * x = vx;
    const block_q8_1 * y = vy;
    const int64_t nb = n / QK4_1;
    __m128 acc = _mm_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        acc = iq_step_4_blocks_q4_1(x + b, y + b, 4, acc);
    }
    if (b < nb) {
        acc = iq_step_4_blocks_q4_1(x + b, y + b, (int) (nb - b), acc);
    }
    const __m128 t = _mm_add_ps(acc, _mm_movehl_ps(acc, acc));  // acc0 + acc2, acc1 + acc3
    *s = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// A weight block against a pack's block p: per lane, its column's exact i32 sum (4 lanes: in
// both lanes of the column's pair). The u8 x s8 pairs add up in i16 over the whole block:
// 16 products of at most 15 x 127 each fit.
IQ_INLINE __m256i iq_lanes_isum_q4_1(const block_q4_1 * x, const char * p, const int lanes) {
    const __m256i c = iq_codes_q4_1(x);
    const __m256i lo = _mm256_permute2x128_si256(c, c, 0x00), hi = _mm256_permute2x128_si256(c, c, 0x11);
#define IQ_LANES_MUL(half, imm, j) _mm256_maddubs_epi16(_mm256_shuffle_epi32(half, imm), iq_load_256(p + 32 * (j)))
    __m256i s;
    if (lanes == 8) {  // load j: elements 4j .. 4j + 3 of every column
        s = _mm256_add_epi16(_mm256_add_epi16(IQ_LANES_MUL(lo, 0x00, 0), IQ_LANES_MUL(lo, 0x55, 1)),
                             _mm256_add_epi16(IQ_LANES_MUL(lo, 0xAA, 2), IQ_LANES_MUL(lo, 0xFF, 3)));
        s = _mm256_add_epi16(s, _mm256_add_epi16(_mm256_add_epi16(IQ_LANES_MUL(hi, 0x00, 4), IQ_LANES_MUL(hi, 0x55, 5)),
                                                 _mm256_add_epi16(IQ_LANES_MUL(hi, 0xAA, 6), IQ_LANES_MUL(hi, 0xFF, 7))));
    } else {  // load j: elements 8j .. 8j + 7 of every column
        s = _mm256_add_epi16(_mm256_add_epi16(IQ_LANES_MUL(lo, 0x44, 0), IQ_LANES_MUL(lo, 0xEE, 1)),
                             _mm256_add_epi16(IQ_LANES_MUL(hi, 0x44, 2), IQ_LANES_MUL(hi, 0xEE, 3)));
    }
#undef IQ_LANES_MUL
    const __m256i i = _mm256_madd_epi16(s, _mm256_set1_epi16(1));
    return lanes == 8 ? i : _mm256_add_epi32(i, _mm256_shuffle_epi32(i, 0xB1));
}

IQ_INLINE __m256 iq_lanes_step_q4_1(const block_q4_1 * x, const char * p, const int lanes, __m256 acc) {
    const __m256 f = _mm256_cvtepi32_ps(iq_lanes_isum_q4_1(x, p, lanes));
    const float * dy = (const float *) (p + IQ_LANES_D);
    const float * sy = (const float *) (p + IQ_LANES_S);
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(iq_h2f(x->d)), _mm256_loadu_ps(dy)), f, acc);
    return _mm256_fmadd_ps(_mm256_set1_ps(iq_h2f(x->m)), _mm256_loadu_ps(sy), acc);
}

IQ_INLINE void iq_vec_dot_lanes_q4_1_body(int64_t n, float * s, size_t bs, const char * x, size_t bx, int nrows,
                                          const char * y, int ncols, const int lanes) {
    const int64_t nb = n / QK4_1;
    for (int r = 0; r < nrows; r++) {
        const block_q4_1 * xr = (const block_q4_1 *) (x + r * bx);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
        int64_t b = 0;
        for (; b + 4 <= nb; b += 4) {
            acc0 = iq_lanes_step_q4_1(xr + b, y + b * IQ_LANES_BLOCK, lanes, acc0);
            acc1 = iq_lanes_step_q4_1(xr + b + 1, y + (b + 1) * IQ_LANES_BLOCK, lanes, acc1);
            acc2 = iq_lanes_step_q4_1(xr + b + 2, y + (b + 2) * IQ_LANES_BLOCK, lanes, acc2);
            acc3 = iq_lanes_step_q4_1(xr + b + 3, y + (b + 3) * IQ_LANES_BLOCK, lanes, acc3);
        }
        acc0 = b < nb ? iq_lanes_step_q4_1(xr + b, y + b * IQ_LANES_BLOCK, lanes, acc0) : acc0;
        acc1 = b + 1 < nb ? iq_lanes_step_q4_1(xr + b + 1, y + (b + 1) * IQ_LANES_BLOCK, lanes, acc1) : acc1;
        acc2 = b + 2 < nb ? iq_lanes_step_q4_1(xr + b + 2, y + (b + 2) * IQ_LANES_BLOCK, lanes, acc2) : acc2;
        float out[8];
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(acc0, acc2), _mm256_add_ps(acc1, acc3)));
        for (int c = 0; c < ncols; c++) {
            s[c * bs + r] = out[c * (8 / lanes)];
        }
    }
}

static void iq_vec_dot_lanes_q4_1_avx2(int64_t n, float * s, size_t bs, const void * x, size_t bx, int nrows,
                                       const void * y, int lanes, int ncols) {
    if (lanes == 8) {
        iq_vec_dot_lanes_q4_1_body(n, s, bs, x, bx, nrows, y, ncols, 8);
    } else {
        iq_vec_dot_lanes_q4_1_body(n, s, bs, x, bx, nrows, y, ncols, 4);
    }
}

// ---- K-quants . q8_K ----

// sum_j m_j * (bsums[2j] + bsums[2j + 1]) as 4 i32 lanes.
static inline __m128i iq_k4_min_sums(const block_q8_K * y, uint64_t m) {
    const __m128i b0 = _mm_loadu_si128((const __m128i *) y->bsums);
    const __m128i b1 = _mm_loadu_si128((const __m128i *) (y->bsums + 8));
    const __m128i m16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long) m));
    return _mm_madd_epi16(_mm_hadd_epi16(b0, b1), m16);
}

// One q4_K / q5_K block: per 64 elements, two sub-blocks of u8 codes (bit 4 from qh for q5_K).
static inline void iq_dot_block_k4_avx2(const uint8_t * scales, const uint8_t * qs, const uint8_t * qh,
                                        float d, float dmin, const block_q8_K * y, __m256 * acc,
                                        __m128 * accm) {
    uint64_t sc, m;
    iq_unpack_scales_k4_u64(scales, &sc, &m);
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i hbits = qh ? iq_load_256(qh) : _mm256_setzero_si256();
    __m256i sumi = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const __m256i q = iq_load_256(qs + 32 * k);
        __m256i lo = _mm256_and_si256(q, mask);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
        if (qh) {
            const __m256i one = _mm256_set1_epi8(1);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * k), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * k + 1), one), 4));
        }
        const __m256i plo = _mm256_maddubs_epi16(lo, iq_load_256(y->qs + 64 * k));
        const __m256i phi = _mm256_maddubs_epi16(hi, iq_load_256(y->qs + 64 * k + 32));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(plo, _mm256_set1_epi16((short) ((sc >> (16 * k)) & 0xFF))));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(phi, _mm256_set1_epi16((short) ((sc >> (16 * k + 8)) & 0xFF))));
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * y->d), _mm256_cvtepi32_ps(sumi), *acc);
    *accm = _mm_fmadd_ps(_mm_set1_ps(dmin * y->d), _mm_cvtepi32_ps(iq_k4_min_sums(y, m)), *accm);
}

static inline float iq_hsum_ps128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static void iq_vec_dot_q4_K_q8_K_avx2(int64_t n, float * s, const void * vx, const void * vy) {
    const block_q4_K * x = vx;
    const block_q8_K * y = vy;
    __m256 acc = _mm256_setzero_ps();
    __m128 accm = _mm_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        iq_dot_block_k4_avx2(x[i].scales, x[i].qs, NULL, iq_h2f(x[i].d), iq_h2f(x[i].dmin), &y[i], &acc, &accm);
    }
    *s = iq_hsum_ps(acc) - iq_hsum_ps128(accm);
}

static void iq_vec_dot_q5_K_q8_K_avx2(int64_t n, float * s, const void * vx, const void * vy) {
    const block_q5_K * x = vx;
    const block_q8_K * y = vy;
    __m256 acc = _mm256_setzero_ps();
    __m128 accm = _mm_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        iq_dot_block_k4_avx2(x[i].scales, x[i].qs, x[i].qh, iq_h2f(x[i].d), iq_h2f(x[i].dmin), &y[i], &acc, &accm);
    }
    *s = iq_hsum_ps(acc) - iq_hsum_ps128(accm);
}

// q6_K: codes are used unsigned (0..63) and the offset comes back as 32 * sum_g sc_g bsum_g.
// Per half of 128: ql[0..31] / ql[32..63] low nibbles are elements 0..31 / 32..63, their high
// nibbles 64..95 / 96..127; qh[l] bits (0,1), (2,3), (4,5), (6,7) top those four groups.
static inline void iq_codes_q6_K_half(const uint8_t * ql, const uint8_t * qh, __m256i * q) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x30);
    const __m256i h = iq_load_256(qh);
    const __m256i l0 = iq_load_256(ql), l1 = iq_load_256(ql + 32);
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m2));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m2));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(h, m2));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(h, 2), m2));
}

static void iq_vec_dot_q6_K_q8_K_avx2(int64_t n, float * s, const void * vx, const void * vy) {
    const block_q6_K * x = vx;
    const block_q8_K * y = vy;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        const __m128i sc8 = _mm_loadu_si128((const __m128i *) x[i].scales);
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        const __m256i bsums = iq_load_256(y[i].bsums);
        __m256i sumi = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bsums), 5);
        sumi = _mm256_sub_epi32(_mm256_setzero_si256(), sumi);
#pragma GCC unroll 4
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            iq_codes_q6_K_half(x[i].ql + 64 * h, x[i].qh + 32 * h, q);
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                // 32 elements = scale groups g, g + 1 in the low / high 128-bit lanes.
                const int g = 8 * h + 2 * k;
                const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(x[i].scales[g + 1]), _mm_set1_epi16(x[i].scales[g]));
                const __m256i p = _mm256_maddubs_epi16(q[k], iq_load_256(y[i].qs + 128 * h + 32 * k));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scv));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(iq_h2f(x[i].d) * y[i].d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = iq_hsum_ps(acc);
}

// q2_K / q3_K: per half h of 128, byte l of qs[32 h ..] holds elements 32 j + l (j = 0..3) in
// bits 2j, 2j+1; q3_K adds bit 4 h + j of hmask[l] as bit 2 (codes 0..7 = signed code + 4).
// 32 elements are scale groups g, g + 1 (low / high 128-bit lane). Returns sum_g sc_g sum(u y).
static inline __m256i iq_dot_k2_avx2(const uint8_t * qs, const uint8_t * hmask, const int16_t * sc, const int8_t * y) {
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const __m256i hm = hmask ? iq_load_256(hmask) : _mm256_setzero_si256();
    __m256i sumi = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i q = iq_load_256(qs + 32 * h);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m256i u = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3);
            if (hmask) {
                u = _mm256_or_si256(u, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + j), one), 2));
            }
            const int g = 8 * h + 2 * j;
            const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
            const __m256i p = _mm256_maddubs_epi16(u, iq_load_256(y + 128 * h + 32 * j));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scv));
        }
    }
    return sumi;
}

// sum_g w_g bsums_g over the 16 groups of a q8_K block (w: 16 i16).
static inline int iq_bsums_dot(const int16_t * w, const block_q8_K * y) {
    return iq_hsum_epi32(_mm256_madd_epi16(iq_load_256(w), iq_load_256(y->bsums)));
}

// q2_K: x = d (s & 15) u - dmin (s >> 4); the mins meet the activation sums (bsums).
static void iq_vec_dot_q2_K_q8_K_avx2(int64_t n, float * s, const void * vx, const void * vy) {
    const block_q2_K * x = vx;
    const block_q8_K * y = vy;
    __m256 acc = _mm256_setzero_ps();
    float summ = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int16_t sc[16], m[16];
        const __m128i s8 = _mm_loadu_si128((const __m128i *) x[i].scales);
        _mm256_storeu_si256((__m256i *) sc, _mm256_cvtepu8_epi16(_mm_and_si128(s8, _mm_set1_epi8(0x0F))));
        _mm256_storeu_si256((__m256i *) m, _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), _mm_set1_epi8(0x0F))));
        const __m256i sumi = iq_dot_k2_avx2(x[i].qs, NULL, sc, y[i].qs);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(iq_h2f(x[i].d) * y[i].d), _mm256_cvtepi32_ps(sumi), acc);
        summ += iq_h2f(x[i].dmin) * y[i].d * (float) iq_bsums_dot(m, &y[i]);
    }
    *s = iq_hsum_ps(acc) - summ;
}

// q3_K: the codes are used as u = code + 4 (0..7), and 4 sum_g sc_g bsums_g comes off.
static void iq_vec_dot_q3_K_q8_K_avx2(int64_t n, float * s, const void * vx, const void * vy) {
    const block_q3_K * x = vx;
    const block_q8_K * y = vy;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t sc8[16];
        int16_t sc[16];
        iq_unpack_scales_q3_K(x[i].scales, sc8);
        _mm256_storeu_si256((__m256i *) sc, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) sc8)));
        const __m256i sumi = iq_dot_k2_avx2(x[i].qs, x[i].hmask, sc, y[i].qs);
        const __m256i off = _mm256_setr_epi32(4 * iq_bsums_dot(sc, &y[i]), 0, 0, 0, 0, 0, 0, 0);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(iq_h2f(x[i].d) * y[i].d), _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi, off)), acc);
    }
    *s = iq_hsum_ps(acc);
}

// iq4_xs: per sub-block of 32, iq4_nl's values and a signed scale on the i16 pair sums.
static void iq_vec_dot_iq4_xs_q8_K_avx2(int64_t n, float * s, const void * vx, const void * vy) {
    const block_iq4_xs * x = vx;
    const block_q8_K * y = vy;
    const __m256i table = iq_iq4nl_table();
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t sc[QK_K / 32];
        iq_unpack_scales_iq4_xs(x[i].scales_h, x[i].scales_l, sc);
        __m256i sumi = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int b = 0; b < QK_K / 32; b++) {
            const __m256i v = _mm256_shuffle_epi8(table, iq_unpack_nibbles_32(x[i].qs + 16 * b));
            const __m256i p = iq_mul_s8s8(v, iq_load_256(y[i].qs + 32 * b));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_set1_epi16(sc[b])));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(iq_h2f(x[i].d) * y[i].d), _mm256_cvtepi32_ps(sumi), acc);
    }
    *s = iq_hsum_ps(acc);
}

// ---- activation quantizers (same bytes as iq_quantize_row_q8_0 / _q8_1 / _q8_K) ----

// roundf (half away from zero) of values well inside the i32 range.
static inline __m256i iq_roundf_epi32(__m256 v) {
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 sign = _mm256_and_ps(v, _mm256_set1_ps(-0.0f));
    const __m256 absdiff = _mm256_andnot_ps(sign, _mm256_sub_ps(v, t));
    const __m256 up = _mm256_cmp_ps(absdiff, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 step = _mm256_and_ps(up, _mm256_or_ps(sign, _mm256_set1_ps(1.0f)));
    return _mm256_cvttps_epi32(_mm256_add_ps(t, step));
}

// 32 i32 (four registers, element order) -> 32 i8 in order.
static inline __m256i iq_pack_epi32_epi8(const __m256i * v) {
    const __m256i a = _mm256_packs_epi32(v[0], v[1]);
    const __m256i b = _mm256_packs_epi32(v[2], v[3]);
    const __m256i c = _mm256_packs_epi16(a, b);
    return _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline __m256 iq_abs_ps(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

static inline float iq_hmax_ps(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// One q8_0 / q8_1 block: codes to qs, returns d, sets the code sum.
static inline float iq_quantize_block_q8_avx2(const float * x, int8_t * qs, int * sum) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        amax = _mm256_max_ps(amax, iq_abs_ps(v[k]));
    }
    const float d = iq_hmax_ps(amax) / 127.0f;
    const __m256 id = _mm256_set1_ps(d ? 1.0f / d : 0.0f);
    __m256i q[4];
    for (int k = 0; k < 4; k++) {
        const __m256 s = _mm256_mul_ps(v[k], id);
        q[k] = iq_roundf_epi32(_mm256_and_ps(s, _mm256_cmp_ps(s, s, _CMP_ORD_Q)));  // NaN: 0, as the reference
    }
    *sum = iq_hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    _mm256_storeu_si256((__m256i *) qs, iq_pack_epi32_epi8(q));
    return d;
}

static void iq_quantize_row_q8_0_avx2(const float * x, void * vy, int64_t n) {
    block_q8_0 * y = vy;
    for (int64_t i = 0; i < n / QK8_0; i++) {
        int sum;
        y[i].d = _cvtss_sh(iq_quantize_block_q8_avx2(x + QK8_0 * i, y[i].qs, &sum), _MM_FROUND_TO_NEAREST_INT);
    }
}

static void iq_quantize_row_q8_1_avx2(const float * x, void * vy, int64_t n) {
    block_q8_1 * y = vy;
    for (int64_t i = 0; i < n / QK8_1; i++) {
        int sum;
        const float d = iq_quantize_block_q8_avx2(x + QK8_1 * i, y[i].qs, &sum);
        y[i].d = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        y[i].s = _cvtss_sh((float) sum * d, _MM_FROUND_TO_NEAREST_INT);
    }
}

// q8_K: the scale comes from the first element of largest magnitude (its sign matters).
static void iq_quantize_row_q8_K_avx2(const float * x, void * vy, int64_t n) {
    block_q8_K * y = vy;
    for (int64_t i = 0; i < n / QK_K; i++, x += QK_K) {
        __m256 amax = _mm256_setzero_ps();
        for (int k = 0; k < QK_K; k += 8) {
            amax = _mm256_max_ps(amax, iq_abs_ps(_mm256_loadu_ps(x + k)));
        }
        const float amax1 = iq_hmax_ps(amax);
        if (amax1 == 0.0f) {
            memset(&y[i], 0, sizeof(y[i]));
            continue;
        }
        const __m256 vmax = _mm256_set1_ps(amax1);
        float max = 0.0f;
        for (int k = 0; k < QK_K; k += 8) {
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(iq_abs_ps(_mm256_loadu_ps(x + k)), vmax, _CMP_EQ_OQ));
            if (hit) {
                max = x[k + __builtin_ctz((unsigned) hit)];
                break;
            }
        }
        const float iscale = -127.0f / max;
        const __m256 vs = _mm256_set1_ps(iscale);
        for (int k = 0; k < QK_K; k += 32) {
            __m256i q[4];
            for (int j = 0; j < 4; j++) {
                q[j] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vs, _mm256_loadu_ps(x + k + 8 * j))),
                                        _mm256_set1_epi32(127));
            }
            y[i].bsums[k / 16] = (int16_t) iq_hsum_epi32(_mm256_add_epi32(q[0], q[1]));
            y[i].bsums[k / 16 + 1] = (int16_t) iq_hsum_epi32(_mm256_add_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *) (y[i].qs + k), iq_pack_epi32_epi8(q));
        }
        y[i].d = 1.0f / iscale;
    }
}

// ---- row dequantization (same floats as the reference) ----

// 16 u8 codes -> (code - offset) * d (+ *m) into y[0..15].
static inline void iq_store_codes_16(__m128i codes, int offset, float d, const float * m, float * y) {
    const __m256 vd = _mm256_set1_ps(d);
    for (int k = 0; k < 2; k++) {
        const __m128i c8 = k ? _mm_unpackhi_epi64(codes, codes) : codes;
        const __m256i c = _mm256_sub_epi32(_mm256_cvtepu8_epi32(c8), _mm256_set1_epi32(offset));
        const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(c), vd);
        _mm256_storeu_ps(y + 8 * k, m ? _mm256_add_ps(v, _mm256_set1_ps(*m)) : v);
    }
}

static inline void iq_store_codes_32(__m256i codes, int offset, float d, const float * m, float * y) {
    iq_store_codes_16(_mm256_castsi256_si128(codes), offset, d, m, y);
    iq_store_codes_16(_mm256_extracti128_si256(codes, 1), offset, d, m, y + 16);
}

static void iq_dequantize_row_q4_0_avx2(const void * vx, float * y, int64_t n) {
    const block_q4_0 * x = vx;
    for (int64_t i = 0; i < n / QK4_0; i++) {
        iq_store_codes_32(iq_unpack_nibbles_32(x[i].qs), 8, iq_h2f(x[i].d), NULL, y + QK4_0 * i);
    }
}

static void iq_dequantize_row_q4_1_avx2(const void * vx, float * y, int64_t n) {
    const block_q4_1 * x = vx;
    for (int64_t i = 0; i < n / QK4_1; i++) {
        const float m = iq_h2f(x[i].m);
        iq_store_codes_32(iq_unpack_nibbles_32(x[i].qs), 0, iq_h2f(x[i].d), &m, y + QK4_1 * i);
    }
}

static inline __m256i iq_codes_q5(const uint8_t * qs, const uint8_t * qh) {
    return _mm256_or_si256(iq_unpack_nibbles_32(qs), _mm256_and_si256(iq_expand_bits_32(qh), _mm256_set1_epi8(0x10)));
}

static void iq_dequantize_row_q5_0_avx2(const void * vx, float * y, int64_t n) {
    const block_q5_0 * x = vx;
    for (int64_t i = 0; i < n / QK5_0; i++) {
        iq_store_codes_32(iq_codes_q5(x[i].qs, x[i].qh), 16, iq_h2f(x[i].d), NULL, y + QK5_0 * i);
    }
}

static void iq_dequantize_row_q5_1_avx2(const void * vx, float * y, int64_t n) {
    const block_q5_1 * x = vx;
    for (int64_t i = 0; i < n / QK5_1; i++) {
        const float m = iq_h2f(x[i].m);
        iq_store_codes_32(iq_codes_q5(x[i].qs, x[i].qh), 0, iq_h2f(x[i].d), &m, y + QK5_1 * i);
    }
}

static void iq_dequantize_row_q8_0_avx2(const void * vx, float * y, int64_t n) {
    const block_q8_0 * x = vx;
    for (int64_t i = 0; i < n / QK8_0; i++, y += QK8_0) {
        const __m256 d = _mm256_set1_ps(iq_h2f(x[i].d));
        for (int k = 0; k < 4; k++) {
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (x[i].qs + 8 * k)));
            _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
        }
    }
}

// x = (d sc_j) q - dmin m_j per sub-block j; the subtraction is an exact add of -(dmin m_j).
static inline void iq_dequantize_block_k4_avx2(const uint8_t * scales, const uint8_t * qs, const uint8_t * qh,
                                               float d, float dmin, float * y) {
    uint8_t sc[8], m[8];
    iq_unpack_scales_k4(scales, sc, m);
    const __m256i mask = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
    const __m256i hbits = qh ? iq_load_256(qh) : _mm256_setzero_si256();
    for (int k = 0; k < 4; k++, y += 64) {
        const __m256i q = iq_load_256(qs + 32 * k);
        // Bit 2k of qh[l] lands on bit 4 after a left shift by 4 - 2k (right shift for k > 2).
        const __m256i h0 = k < 2 ? _mm256_slli_epi16(hbits, 4 - 2 * k) : _mm256_srli_epi16(hbits, 2 * k - 4);
        const __m256i h1 = k < 2 ? _mm256_slli_epi16(hbits, 3 - 2 * k) : _mm256_srli_epi16(hbits, 2 * k - 3);
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(q, mask), _mm256_and_si256(h0, b4));
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), mask), _mm256_and_si256(h1, b4));
        const float m0 = -(dmin * m[2 * k]), m1 = -(dmin * m[2 * k + 1]);
        iq_store_codes_32(lo, 0, d * sc[2 * k], &m0, y);
        iq_store_codes_32(hi, 0, d * sc[2 * k + 1], &m1, y + 32);
    }
}

static void iq_dequantize_row_q4_K_avx2(const void * vx, float * y, int64_t n) {
    const block_q4_K * x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        iq_dequantize_block_k4_avx2(x[i].scales, x[i].qs, NULL, iq_h2f(x[i].d), iq_h2f(x[i].dmin), y + QK_K * i);
    }
}

static void iq_dequantize_row_q5_K_avx2(const void * vx, float * y, int64_t n) {
    const block_q5_K * x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        iq_dequantize_block_k4_avx2(x[i].scales, x[i].qs, x[i].qh, iq_h2f(x[i].d), iq_h2f(x[i].dmin), y + QK_K * i);
    }
}

static void iq_dequantize_row_q6_K_avx2(const void * vx, float * y, int64_t n) {
    const block_q6_K * x = vx;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const float d = iq_h2f(x[i].d);
        for (int h = 0; h < 2; h++, y += 128) {
            __m256i q[4];
            iq_codes_q6_K_half(x[i].ql + 64 * h, x[i].qh + 32 * h, q);
            for (int k = 0; k < 4; k++) {
                const int g = 8 * h + 2 * k;
                iq_store_codes_16(_mm256_castsi256_si128(q[k]), 32, d * x[i].scales[g], NULL, y + 32 * k);
                iq_store_codes_16(_mm256_extracti128_si256(q[k], 1), 32, d * x[i].scales[g + 1], NULL, y + 32 * k + 16);
            }
        }
    }
}

const struct iq_cpu_type_traits iq_cpu_quants_avx2[IQ_TYPE_GGUF_END] = {
    [IQ_TYPE_F32] = {.vec_dot = iq_vec_dot_f32_f32_avx2},
    [IQ_TYPE_F16] = {.vec_dot = iq_vec_dot_f16_f32_avx2, .to_float = iq_dequantize_row_f16_avx2},
    [IQ_TYPE_BF16] = {.vec_dot = iq_vec_dot_bf16_f32_avx2, .to_float = iq_dequantize_row_bf16_avx2},
    [IQ_TYPE_Q4_0] = {.from_float = iq_quantize_row_q8_0_avx2, .vec_dot = iq_vec_dot_q4_0_q8_0_avx2,
                      .to_float = iq_dequantize_row_q4_0_avx2, .vec_dot_cols = iq_vec_dot_cols_q4_0_avx2},
    [IQ_TYPE_Q4_1] = {.from_float = iq_quantize_row_q8_1_avx2, .vec_dot = iq_vec_dot_q4_1_q8_1_avx2,
                      .to_float = iq_dequantize_row_q4_1_avx2, .vec_dot_lanes = iq_vec_dot_lanes_q4_1_avx2},
    [IQ_TYPE_Q5_0] = {.from_float = iq_quantize_row_q8_0_avx2, .vec_dot = iq_vec_dot_q5_0_q8_0_avx2,
                      .to_float = iq_dequantize_row_q5_0_avx2, .vec_dot_cols = iq_vec_dot_cols_q5_0_avx2},
    [IQ_TYPE_Q5_1] = {.from_float = iq_quantize_row_q8_1_avx2, .vec_dot = iq_vec_dot_q5_1_q8_1_avx2,
                      .to_float = iq_dequantize_row_q5_1_avx2, .vec_dot_cols = iq_vec_dot_cols_q5_1_avx2},
    [IQ_TYPE_Q8_0] = {.from_float = iq_quantize_row_q8_0_avx2, .vec_dot = iq_vec_dot_q8_0_q8_0_avx2,
                      .to_float = iq_dequantize_row_q8_0_avx2, .vec_dot_cols = iq_vec_dot_cols_q8_0_avx2},
    [IQ_TYPE_Q4_K] = {.from_float = iq_quantize_row_q8_K_avx2, .vec_dot = iq_vec_dot_q4_K_q8_K_avx2,
                      .to_float = iq_dequantize_row_q4_K_avx2},
    [IQ_TYPE_Q5_K] = {.from_float = iq_quantize_row_q8_K_avx2, .vec_dot = iq_vec_dot_q5_K_q8_K_avx2,
                      .to_float = iq_dequantize_row_q5_K_avx2},
    [IQ_TYPE_Q6_K] = {.from_float = iq_quantize_row_q8_K_avx2, .vec_dot = iq_vec_dot_q6_K_q8_K_avx2,
                      .to_float = iq_dequantize_row_q6_K_avx2},
    [IQ_TYPE_Q2_K] = {.from_float = iq_quantize_row_q8_K_avx2, .vec_dot = iq_vec_dot_q2_K_q8_K_avx2},
    [IQ_TYPE_Q3_K] = {.from_float = iq_quantize_row_q8_K_avx2, .vec_dot = iq_vec_dot_q3_K_q8_K_avx2},
    [IQ_TYPE_IQ4_NL] = {.from_float = iq_quantize_row_q8_0_avx2, .vec_dot = iq_vec_dot_iq4_nl_q8_0_avx2,
                        .vec_dot_cols = iq_vec_dot_cols_iq4_nl_avx2},
    [IQ_TYPE_IQ4_XS] = {.from_float = iq_quantize_row_q8_K_avx2, .vec_dot = iq_vec_dot_iq4_xs_q8_K_avx2},
};
