// AVX-512 (F/BW/VL/DQ) dot products, in two builds: with VNNI (vpdpbusd / vpdpwssd) and
// without (vpmaddubsw + vpmaddwd). Each kernel body is written once and instantiated for both.
//
// Quantizers and row dequantization come from the AVX2 table (they are off the hot path).
#include "x86-kernels.h"

#include "iq-quants.h"

#include <immintrin.h>
#include <stddef.h>

#define IQ_INLINE static inline __attribute__((always_inline))

// ---- helpers ----

// acc + sums of 4 adjacent u8 x s8 products per i32 lane (u <= 128, |s| <= 127: no i16
// saturation on the non-VNNI path).
IQ_INLINE __m512i iq_dpbusd(__m512i acc, __m512i u, __m512i s, const bool vnni) {
    if (vnni) {
        return _mm512_dpbusd_epi32(acc, u, s);
    }
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}

// acc + sums of 2 adjacent i16 x i16 products per i32 lane.
IQ_INLINE __m512i iq_dpwssd(__m512i acc, __m512i a, __m512i b, const bool vnni) {
    if (vnni) {
        return _mm512_dpwssd_epi32(acc, a, b);
    }
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
}

// y with the sign of x: |x| times it gives the s8 x s8 products (exact, as |y| <= 127).
IQ_INLINE __m512i iq_sign_of(__m512i y, __m512i x) {
    return _mm512_mask_sub_epi8(y, _mm512_movepi8_mask(x), _mm512_setzero_si512(), y);
}

// Signed x signed: the sign of x moves onto y.
IQ_INLINE __m512i iq_dot_s8s8(__m512i x, __m512i y, const bool vnni) {
    return iq_dpbusd(_mm512_setzero_si512(), _mm512_abs_epi8(x), iq_sign_of(y, x), vnni);
}

// The iq4_nl values in every 128-bit lane, for vpshufb lookups of 4-bit codes.
IQ_INLINE __m512i iq_iq4nl_table(void) { return _mm512_broadcast_i32x4(_mm_setr_epi8(IQ4NL_VALUES)); }

IQ_INLINE __m512i iq_load_2x256(const void * a, const void * b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) a)),
                              _mm256_loadu_si256((const __m256i *) b), 1);
}

// Two blocks of 16 packed-nibble bytes -> 64 codes: [a low, a high, b low, b high] nibbles.
IQ_INLINE __m512i iq_unpack_nibbles_2x32(const uint8_t * a, const uint8_t * b) {
    const __m512i v = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) a)), 0xFF00,
                                                  _mm_loadu_si128((const __m128i *) b));
    const __m512i shift = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    return _mm512_and_si512(_mm512_srlv_epi64(v, shift), _mm512_set1_epi8(0x0F));
}

// Two 32-bit qh words -> 64-bit mask of the bits, in element order.
IQ_INLINE __mmask64 iq_bits_2x32(const uint8_t * a, const uint8_t * b) {
    uint32_t ha, hb;
    memcpy(&ha, a, 4);
    memcpy(&hb, b, 4);
    return _cvtu64_mask64(((uint64_t) hb << 32) | ha);
}

static inline float iq_hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

// ---- f32 / f16 / bf16 rows ----

// 16 elements from element i of a row, as f32 (m masks the lanes to load).
typedef __m512 (*iq_load16_fn)(const void * row, int64_t i, __mmask16 m);

IQ_INLINE __m512 iq_load16_f32(const void * row, int64_t i, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *) row + i);
}

IQ_INLINE __m512 iq_load16_f16(const void * row, int64_t i, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const iq_fp16_t *) row + i));
}

IQ_INLINE __m512 iq_load16_bf16(const void * row, int64_t i, __mmask16 m) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const iq_bf16_t *) row + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// Four accumulators hide the FMA latency; the tail uses masked loads.
IQ_INLINE float iq_dot_rows_f32(int64_t n, const void * x, const float * y, iq_load16_fn load) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            acc[k] = _mm512_fmadd_ps(load(x, i + 16 * k, 0xFFFF), _mm512_loadu_ps(y + i + 16 * k), acc[k]);
        }
    }
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16) ((1u << (n - i)) - 1);
        acc[0] = _mm512_fmadd_ps(load(x, i, m), _mm512_maskz_loadu_ps(m, y + i), acc[0]);
    }
    return iq_hsum512(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

static void iq_vec_dot_f32_f32_avx512(int64_t n, float * s, const void * x, const void * y) {
    *s = iq_dot_rows_f32(n, x, y, iq_load16_f32);
}

static void iq_vec_dot_f16_f32_avx512(int64_t n, float * s, const void * x, const void * y) {
    *s = iq_dot_rows_f32(n, x, y, iq_load16_f16);
}

static void iq_vec_dot_bf16_f32_avx512(int64_t n, float * s, const void * x, const void * y) {
    *s = iq_dot_rows_f32(n, x, y, iq_load16_bf16);
}

// ---- 32-element blocks: eight per step, two per register ----
//
// A step takes 8 blocks; register j holds the i32 products of blocks 2j, 2j + 1 (8 lanes each).
// The lanes are summed per block by a transpose-add, the fp16 scales of all 8 blocks are
// converted at once, and one FMA applies them: lane 2k holds d_x d_y times block k's integer
// sum, lane 2k + 1 holds m_x s_y (zero for the symmetric formats). The last nb % 8 blocks go
// pair by pair with scalar scales (an odd last block pairs with itself, weighted zero).

#define IQ_KEEP_D 0x0000FFFFu    // symmetric formats: d only
#define IQ_KEEP_DM 0xFFFFFFFFu   // asymmetric formats: d and m (x), d and s (y)

// Integer products of blocks a, b (x and y pointers to each block).
typedef __m512i (*iq_pair_dot_fn)(const void * xa, const void * xb, const void * ya, const void * yb, bool vnni);

// [sum(block 0), 1, sum(block 1), 1, ...] from the four pair registers.
IQ_INLINE __m512 iq_block_sums(const __m512i * p) {
    // Per 128-bit lane L, u holds the lane sums [p0_L, p1_L, p2_L, p3_L].
    const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
    const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
    // Block 2j is lanes 0 + 1 of p_j, block 2j + 1 lanes 2 + 3.
    const __m512 v = _mm512_cvtepi32_ps(_mm512_add_epi32(u, _mm512_shuffle_i32x4(u, u, _MM_SHUFFLE(2, 3, 0, 1))));
    const __m512i order = _mm512_setr_epi32(0, 16, 8, 16, 1, 16, 9, 16, 2, 16, 10, 16, 3, 16, 11, 16);
    return _mm512_permutex2var_ps(v, order, _mm512_set1_ps(1.0f));
}

static inline int iq_load_u32(const char * p) {
    int v;
    memcpy(&v, p, 4);
    return v;
}

// Four 32-bit words at byte stride `stride` (scalar loads: faster than a gather here).
IQ_INLINE __m128i iq_load_words_4(const char * p, int stride) {
    __m128i v = _mm_cvtsi32_si128(iq_load_u32(p));
    v = _mm_insert_epi32(v, iq_load_u32(p + stride), 1);
    v = _mm_insert_epi32(v, iq_load_u32(p + 2 * stride), 2);
    return _mm_insert_epi32(v, iq_load_u32(p + 3 * stride), 3);
}

IQ_INLINE __m256i iq_load_words_8(const char * p, int stride) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(iq_load_words_4(p, stride)),
                                   iq_load_words_4(p + 4 * stride, stride), 1);
}

// [d_x d_y, m_x s_y] per block: x and y start with the fp16 pairs (d, m) and (d, s); keep
// masks the second halves off for the formats that have only d.
IQ_INLINE __m512 iq_scale_products_8(const char * x, int xs, const char * y, int ys, uint32_t keep) {
    const __m256i k = _mm256_set1_epi32((int) keep);
    const __m256i wx = _mm256_and_si256(iq_load_words_8(x, xs), k);
    const __m256i wy = _mm256_and_si256(iq_load_words_8(y, ys), k);
    return _mm512_mul_ps(_mm512_cvtph_ps(wx), _mm512_cvtph_ps(wy));
}

IQ_INLINE void iq_step_blocks_32(const char * x, int xs, const char * y, int ys, uint32_t keep, iq_pair_dot_fn pair,
                                 __m512 * acc, const bool vnni) {
    __m512i p[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        p[j] = pair(x + 2 * j * xs, x + (2 * j + 1) * xs, y + 2 * j * ys, y + (2 * j + 1) * ys, vnni);
    }
    *acc = _mm512_fmadd_ps(iq_scale_products_8(x, xs, y, ys, keep), iq_block_sums(p), *acc);
}

static inline float iq_fp16_at(const char * p) {
    iq_fp16_t h;
    memcpy(&h, p, sizeof(h));
    return _cvtsh_ss(h);  // F16C
}

// d_x d_y (and m_x s_y) of one block, or zeros when it is a padding copy.
static inline float iq_block_d(const char * x, const char * y, bool real) { return real ? iq_fp16_at(x) * iq_fp16_at(y) : 0.0f; }

static inline float iq_block_m(const char * x, const char * y, bool real) {
    return real ? iq_fp16_at(x + 2) * iq_fp16_at(y + 2) : 0.0f;
}

IQ_INLINE void iq_tail_blocks_32(const char * x, int xs, const char * y, int ys, int cnt, uint32_t keep,
                                 iq_pair_dot_fn pair, __m512 * acc, float * summs, const bool vnni) {
    for (int a = 0; a < cnt; a += 2) {
        const bool has_b = a + 1 < cnt;
        const int b = has_b ? a + 1 : a;
        const char *xa = x + a * xs, *xb = x + b * xs, *ya = y + a * ys, *yb = y + b * ys;
        const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(iq_block_d(xa, ya, true)),
                                            _mm256_set1_ps(iq_block_d(xb, yb, has_b)), 1);
        *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(pair(xa, xb, ya, yb, vnni)), *acc);
        if (keep == IQ_KEEP_DM) {
            *summs += iq_block_m(xa, ya, true) + iq_block_m(xb, yb, has_b);
        }
    }
}

IQ_INLINE float iq_dot_blocks_32(int64_t nb, const void * vx, int xs, const void * vy, int ys, uint32_t keep,
                                 iq_pair_dot_fn pair, const bool vnni) {
    const char * x = vx;
    const char * y = vy;
    __m512 acc = _mm512_setzero_ps();
    float summs = 0.0f;
    int64_t i = 0;
    for (; i + 8 <= nb; i += 8) {
        iq_step_blocks_32(x + i * xs, xs, y + i * ys, ys, keep, pair, &acc, vnni);
    }
    iq_tail_blocks_32(x + i * xs, xs, y + i * ys, ys, (int) (nb - i), keep, pair, &acc, &summs, vnni);
    return iq_hsum512(acc) + summs;
}

IQ_INLINE __m512i iq_load_y_2x32(const void * ya, const void * yb, size_t off) {
    return iq_load_2x256((const char *) ya + off, (const char *) yb + off);
}

// Codes with a zero point z: sum (u - z) y = sum u y - z sum y, both as u8 x s8 products.
IQ_INLINE __m512i iq_dot_offset(__m512i u, int z, __m512i y, const bool vnni) {
    const __m512i zy = iq_dpbusd(_mm512_setzero_si512(), _mm512_set1_epi8((char) z), y, vnni);
    return _mm512_sub_epi32(iq_dpbusd(_mm512_setzero_si512(), u, y, vnni), zy);
}

IQ_INLINE __m512i iq_pair_q8_0(const void * xa, const void * xb, const void * ya, const void * yb, bool vnni) {
    const size_t off = offsetof(block_q8_0, qs);
    return iq_dot_s8s8(iq_load_y_2x32(xa, xb, off), iq_load_y_2x32(ya, yb, off), vnni);
}

IQ_INLINE __m512i iq_pair_q4_0(const void * xa, const void * xb, const void * ya, const void * yb, bool vnni) {
    const __m512i u = iq_unpack_nibbles_2x32(((const block_q4_0 *) xa)->qs, ((const block_q4_0 *) xb)->qs);
    return iq_dot_offset(u, 8, iq_load_y_2x32(ya, yb, offsetof(block_q8_0, qs)), vnni);
}

IQ_INLINE __m512i iq_pair_q5_0(const void * xa, const void * xb, const void * ya, const void * yb, bool vnni) {
    const block_q5_0 * a = xa;
    const block_q5_0 * b = xb;
    __m512i u = iq_unpack_nibbles_2x32(a->qs, b->qs);
    u = _mm512_mask_add_epi8(u, iq_bits_2x32(a->qh, b->qh), u, _mm512_set1_epi8(16));
    return iq_dot_offset(u, 16, iq_load_y_2x32(ya, yb, offsetof(block_q8_0, qs)), vnni);
}

IQ_INLINE __m512i iq_pair_q4_1(const void * xa, const void * xb, const void * ya, const void * yb, bool vnni) {
    const __m512i u = iq_unpack_nibbles_2x32(((const block_q4_1 *) xa)->qs, ((const block_q4_1 *) xb)->qs);
    return iq_dpbusd(_mm512_setzero_si512(), u, iq_load_y_2x32(ya, yb, offsetof(block_q8_1, qs)), vnni);
}

IQ_INLINE __m512i iq_pair_q5_1(const void * xa, const void * xb, const void * ya, const void * yb, bool vnni) {
    const block_q5_1 * a = xa;
    const block_q5_1 * b = xb;
    __m512i u = iq_unpack_nibbles_2x32(a->qs, b->qs);
    u = _mm512_mask_add_epi8(u, iq_bits_2x32(a->qh, b->qh), u, _mm512_set1_epi8(16));
    return iq_dpbusd(_mm512_setzero_si512(), u, iq_load_y_2x32(ya, yb, offsetof(block_q8_1, qs)), vnni);
}

IQ_INLINE __m512i iq_pair_iq4_nl(const void * xa, const void * xb, const void * ya, const void * yb, bool vnni) {
    const __m512i u = iq_unpack_nibbles_2x32(((const block_iq4_nl *) xa)->qs, ((const block_iq4_nl *) xb)->qs);
    return iq_dot_s8s8(_mm512_shuffle_epi8(iq_iq4nl_table(), u), iq_load_y_2x32(ya, yb, offsetof(block_q8_0, qs)), vnni);
}

IQ_INLINE void iq_vec_dot_iq4_nl_q8_0_body(int64_t n, float * s, const void * x, const void * y, const bool vnni) {
    *s = iq_dot_blocks_32(n / QK4_NL, x, sizeof(block_iq4_nl), y, sizeof(block_q8_0), IQ_KEEP_D, iq_pair_iq4_nl, vnni);
}

IQ_INLINE void iq_vec_dot_q8_0_q8_0_body(int64_t n, float * s, const void * x, const void * y, const bool vnni) {
    *s = iq_dot_blocks_32(n / QK8_0, x, sizeof(block_q8_0), y, sizeof(block_q8_0), IQ_KEEP_D, iq_pair_q8_0, vnni);
}

IQ_INLINE void iq_vec_dot_q4_0_q8_0_body(int64_t n, float * s, const void * x, const void * y, const bool vnni) {
    *s = iq_dot_blocks_32(n / QK4_0, x, sizeof(block_q4_0), y, sizeof(block_q8_0), IQ_KEEP_D, iq_pair_q4_0, vnni);
}

IQ_INLINE void iq_vec_dot_q5_0_q8_0_body(int64_t n, float * s, const void * x, const void * y, const bool vnni) {
    *s = iq_dot_blocks_32(n / QK5_0, x, sizeof(block_q5_0), y, sizeof(block_q8_0), IQ_KEEP_D, iq_pair_q5_0, vnni);
}

IQ_INLINE void iq_vec_dot_q4_1_q8_1_body(int64_t n, float * s, const void * x, const void * y, const bool vnni) {
    *s = iq_dot_blocks_32(n / QK4_1, x, sizeof(block_q4_1), y, sizeof(block_q8_1), IQ_KEEP_DM, iq_pair_q4_1, vnni);
}

IQ_INLINE void iq_vec_dot_q5_1_q8_1_body(int64_t n, float * s, const void * x, const void * y, const bool vnni) {
    *s = iq_dot_blocks_32(n / QK5_1, x, sizeof(block_q5_1), y, sizeof(block_q8_1), IQ_KEEP_DM, iq_pair_q5_1, vnni);
}

// ---- K-quants . q8_K, 64 elements per register ----

// i16 lane i of 64 elements -> its scale group among 4 (i / 8), as i16 lanes.
IQ_INLINE __m512i iq_groups_of_64(void) {
    return _mm512_cvtepu8_epi16(_mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                                 3, 3, 3, 3, 3, 3, 3, 3));
}

// q4_K / q5_K: chunk k holds sub-blocks 2k (low nibbles) and 2k + 1 (high nibbles) of 32 bytes;
// scales multiply the i16 pair sums, the mins meet the activation sums (bsums) once per block.
IQ_INLINE void iq_dot_block_k4(const uint8_t * scales, const uint8_t * qs, const uint8_t * qh, float d,
                               float dmin, const block_q8_K * y, __m512 * acc, __m128 * accm, const bool vnni) {
    uint64_t sc, m;
    iq_unpack_scales_k4_u64(scales, &sc, &m);
    const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long) sc)));
    const __m512i shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m512i hbits = qh ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) qh)) : _mm512_setzero_si512();
    const __m512i hsel = _mm512_inserti64x4(_mm512_set1_epi8(1), _mm256_set1_epi8(2), 1);
    __m512i sumi = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (qs + 32 * k)));
        __m512i qx = _mm512_and_si512(_mm512_srlv_epi64(q, shift), mask);
        if (qh) {
            const __mmask64 hm = _mm512_test_epi8_mask(hbits, _mm512_slli_epi64(hsel, 2 * k));
            qx = _mm512_mask_add_epi8(qx, hm, qx, _mm512_set1_epi8(16));
        }
        const __m512i p = _mm512_maddubs_epi16(qx, _mm512_loadu_si512(y->qs + 64 * k));
        const __m512i idx = _mm512_inserti64x4(_mm512_set1_epi16((short) (2 * k)), _mm256_set1_epi16((short) (2 * k + 1)), 1);
        sumi = iq_dpwssd(sumi, p, _mm512_permutexvar_epi16(idx, sc16), vnni);
    }
    *acc = _mm512_fmadd_ps(_mm512_set1_ps(d * y->d), _mm512_cvtepi32_ps(sumi), *acc);
    const __m128i b0 = _mm_loadu_si128((const __m128i *) y->bsums);
    const __m128i b1 = _mm_loadu_si128((const __m128i *) (y->bsums + 8));
    const __m128i mins = _mm_madd_epi16(_mm_hadd_epi16(b0, b1), _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long) m)));
    *accm = _mm_fmadd_ps(_mm_set1_ps(dmin * y->d), _mm_cvtepi32_ps(mins), *accm);
}

static inline float iq_hsum128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

IQ_INLINE void iq_vec_dot_q4_K_q8_K_body(int64_t n, float * s, const void * vx, const void * vy, const bool vnni) {
    const block_q4_K * x = vx;
    const block_q8_K * y = vy;
    __m512 acc = _mm512_setzero_ps();
    __m128 accm = _mm_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        iq_dot_block_k4(x[i].scales, x[i].qs, NULL, _cvtsh_ss(x[i].d), _cvtsh_ss(x[i].dmin), &y[i], &acc, &accm, vnni);
    }
    *s = iq_hsum512(acc) - iq_hsum128(accm);
}

IQ_INLINE void iq_vec_dot_q5_K_q8_K_body(int64_t n, float * s, const void * vx, const void * vy, const bool vnni) {
    const block_q5_K * x = vx;
    const block_q8_K * y = vy;
    __m512 acc = _mm512_setzero_ps();
    __m128 accm = _mm_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        iq_dot_block_k4(x[i].scales, x[i].qs, x[i].qh, _cvtsh_ss(x[i].d), _cvtsh_ss(x[i].dmin), &y[i], &acc, &accm, vnni);
    }
    *s = iq_hsum512(acc) - iq_hsum128(accm);
}

// q6_K: per half of 128, ql (64 bytes) gives elements 0..63 (low nibbles) and 64..127 (high);
// qh (32 bytes, both register halves) gives their top two bits. Codes are used unsigned and
// the offset returns as 32 * sum_g sc_g bsum_g.
IQ_INLINE void iq_vec_dot_q6_K_q8_K_body(int64_t n, float * s, const void * vx, const void * vy, const bool vnni) {
    const block_q6_K * x = vx;
    const block_q8_K * y = vy;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x30);
    const __m512i shl = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2), shr = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    const __m512i groups = iq_groups_of_64();
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) x[i].scales));
        const __m256i offs = _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *) y[i].bsums)), 5);
        __m512i sumi = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(offs));
        const __m512i sc = _mm512_castsi256_si512(sc16);
#pragma GCC unroll 4
        for (int h = 0; h < 2; h++) {
            const __m512i l = _mm512_loadu_si512(x[i].ql + 64 * h);
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (x[i].qh + 32 * h)));
            const __m512i q[2] = {
                _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi64(qh, shl), m2)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), _mm512_and_si512(_mm512_srlv_epi64(qh, shr), m2)),
            };
#pragma GCC unroll 4
            for (int c = 0; c < 2; c++) {
                // 64 elements = scale groups g .. g + 3, 8 i16 lanes each.
                const int g = 8 * h + 4 * c;
                const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16((short) g), groups);
                const __m512i p = _mm512_maddubs_epi16(q[c], _mm512_loadu_si512(y[i].qs + 128 * h + 64 * c));
                sumi = iq_dpwssd(sumi, p, _mm512_permutexvar_epi16(idx, sc), vnni);
            }
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(_cvtsh_ss(x[i].d) * y[i].d), _mm512_cvtepi32_ps(sumi), acc);
    }
    *s = iq_hsum512(acc);
}

// q2_K / q3_K: per half h of 128, byte l of qs[32 h ..] holds elements 32 j + l (j = 0..3) in
// bits 2j, 2j+1; q3_K adds bit 4 h + j of hmask[l] as bit 2 (codes 0..7 = signed code + 4).
// A register takes j = 2c, 2c + 1 (64 elements, scale groups 8 h + 4 c ..); sc16: the 16
// scales as i16. Returns sum_g sc_g sum(u y) per i32 lane.
IQ_INLINE __m512i iq_dot_k2(const uint8_t * qs, const uint8_t * hmask, __m512i sc16, const int8_t * y, const bool vnni) {
    const __m512i m3 = _mm512_set1_epi8(3);
    const __m512i shift = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    const __m512i hm = hmask ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) hmask)) : _mm512_setzero_si512();
    __m512i sumi = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (qs + 32 * h)));
#pragma GCC unroll 2
        for (int c = 0; c < 2; c++) {
            __m512i u = _mm512_and_si512(_mm512_srlv_epi64(q, _mm512_add_epi64(shift, _mm512_set1_epi64(4 * c))), m3);
            if (hmask) {
                const int bit = 4 * h + 2 * c;
                const __m512i sel = _mm512_inserti64x4(_mm512_set1_epi8((char) (1 << bit)), _mm256_set1_epi8((char) (2 << bit)), 1);
                u = _mm512_mask_add_epi8(u, _mm512_test_epi8_mask(hm, sel), u, _mm512_set1_epi8(4));
            }
            const __m512i p = _mm512_maddubs_epi16(u, _mm512_loadu_si512(y + 128 * h + 64 * c));
            const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16((short) (8 * h + 4 * c)), iq_groups_of_64());
            sumi = iq_dpwssd(sumi, p, _mm512_permutexvar_epi16(idx, sc16), vnni);
        }
    }
    return sumi;
}

// sum_g w_g bsums_g over the 16 groups of a q8_K block (w: 16 i16).
IQ_INLINE int iq_bsums_dot(__m256i w, const block_q8_K * y) {
    return _mm512_reduce_add_epi32(_mm512_zextsi256_si512(_mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i *) y->bsums))));
}

IQ_INLINE void iq_vec_dot_q2_K_q8_K_body(int64_t n, float * s, const void * vx, const void * vy, const bool vnni) {
    const block_q2_K * x = vx;
    const block_q8_K * y = vy;
    __m512 acc = _mm512_setzero_ps();
    float summ = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        const __m128i s8 = _mm_loadu_si128((const __m128i *) x[i].scales);
        const __m256i sc = _mm256_cvtepu8_epi16(_mm_and_si128(s8, _mm_set1_epi8(0x0F)));
        const __m256i m = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(s8, 4), _mm_set1_epi8(0x0F)));
        const __m512i sumi = iq_dot_k2(x[i].qs, NULL, _mm512_castsi256_si512(sc), y[i].qs, vnni);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(_cvtsh_ss(x[i].d) * y[i].d), _mm512_cvtepi32_ps(sumi), acc);
        summ += _cvtsh_ss(x[i].dmin) * y[i].d * (float) iq_bsums_dot(m, &y[i]);
    }
    *s = iq_hsum512(acc) - summ;
}

// q3_K: the codes are used as u = code + 4, and 4 sum_g sc_g bsums_g comes off.
IQ_INLINE void iq_vec_dot_q3_K_q8_K_body(int64_t n, float * s, const void * vx, const void * vy, const bool vnni) {
    const block_q3_K * x = vx;
    const block_q8_K * y = vy;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t sc8[16];
        iq_unpack_scales_q3_K(x[i].scales, sc8);
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) sc8));
        __m512i sumi = iq_dot_k2(x[i].qs, x[i].hmask, _mm512_castsi256_si512(sc), y[i].qs, vnni);
        sumi = _mm512_sub_epi32(sumi, _mm512_maskz_set1_epi32(1, 4 * iq_bsums_dot(sc, &y[i])));
        acc = _mm512_fmadd_ps(_mm512_set1_ps(_cvtsh_ss(x[i].d) * y[i].d), _mm512_cvtepi32_ps(sumi), acc);
    }
    *s = iq_hsum512(acc);
}

// iq4_xs: 64 elements (sub-blocks 2k, 2k + 1) per register, a signed scale per sub-block on the
// i16 pair sums of iq4_nl's values times the activations.
IQ_INLINE void iq_vec_dot_iq4_xs_q8_K_body(int64_t n, float * s, const void * vx, const void * vy, const bool vnni) {
    const block_iq4_xs * x = vx;
    const block_q8_K * y = vy;
    const __m512i table = iq_iq4nl_table();
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t sc[QK_K / 32];
        iq_unpack_scales_iq4_xs(x[i].scales_h, x[i].scales_l, sc);
        __m512i sumi = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const __m512i u = iq_unpack_nibbles_2x32(x[i].qs + 32 * k, x[i].qs + 32 * k + 16);
            const __m512i v = _mm512_shuffle_epi8(table, u);
            const __m512i p = _mm512_maddubs_epi16(_mm512_abs_epi8(v), iq_sign_of(_mm512_loadu_si512(y[i].qs + 64 * k), v));
            const __m512i scv = _mm512_inserti64x4(_mm512_set1_epi16(sc[2 * k]), _mm256_set1_epi16(sc[2 * k + 1]), 1);
            sumi = iq_dpwssd(sumi, p, scv, vnni);
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(_cvtsh_ss(x[i].d) * y[i].d), _mm512_cvtepi32_ps(sumi), acc);
    }
    *s = iq_hsum512(acc);
}

// ---- the two builds ----

#define IQ_AVX512_KERNEL(name)                                                                  \
    static void name##_avx512(int64_t n, float * s, const void * x, const void * y) {          \
        name##_body(n, s, x, y, false);                                                         \
    }                                                                                           \
    static void name##_avx512_vnni(int64_t n, float * s, const void * x, const void * y) {     \
        name##_body(n, s, x, y, true);                                                          \
    }

IQ_AVX512_KERNEL(iq_vec_dot_q4_0_q8_0)
IQ_AVX512_KERNEL(iq_vec_dot_q4_1_q8_1)
IQ_AVX512_KERNEL(iq_vec_dot_q5_0_q8_0)
IQ_AVX512_KERNEL(iq_vec_dot_q5_1_q8_1)
IQ_AVX512_KERNEL(iq_vec_dot_q8_0_q8_0)
IQ_AVX512_KERNEL(iq_vec_dot_q4_K_q8_K)
IQ_AVX512_KERNEL(iq_vec_dot_q5_K_q8_K)
IQ_AVX512_KERNEL(iq_vec_dot_q6_K_q8_K)
IQ_AVX512_KERNEL(iq_vec_dot_q2_K_q8_K)
IQ_AVX512_KERNEL(iq_vec_dot_q3_K_q8_K)
IQ_AVX512_KERNEL(iq_vec_dot_iq4_nl_q8_0)
IQ_AVX512_KERNEL(iq_vec_dot_iq4_xs_q8_K)

#define IQ_AVX512_TABLE(suffix)                                                      \
    {                                                                                \
        [IQ_TYPE_F32] = {.vec_dot = iq_vec_dot_f32_f32_avx512},                      \
        [IQ_TYPE_F16] = {.vec_dot = iq_vec_dot_f16_f32_avx512},                      \
        [IQ_TYPE_BF16] = {.vec_dot = iq_vec_dot_bf16_f32_avx512},                    \
        [IQ_TYPE_Q4_0] = {.vec_dot = iq_vec_dot_q4_0_q8_0_##suffix},                 \
        [IQ_TYPE_Q4_1] = {.vec_dot = iq_vec_dot_q4_1_q8_1_##suffix},                 \
        [IQ_TYPE_Q5_0] = {.vec_dot = iq_vec_dot_q5_0_q8_0_##suffix},                 \
        [IQ_TYPE_Q5_1] = {.vec_dot = iq_vec_dot_q5_1_q8_1_##suffix},                 \
        [IQ_TYPE_Q8_0] = {.vec_dot = iq_vec_dot_q8_0_q8_0_##suffix},                 \
        [IQ_TYPE_Q4_K] = {.vec_dot = iq_vec_dot_q4_K_q8_K_##suffix},                 \
        [IQ_TYPE_Q5_K] = {.vec_dot = iq_vec_dot_q5_K_q8_K_##suffix},                 \
        [IQ_TYPE_Q6_K] = {.vec_dot = iq_vec_dot_q6_K_q8_K_##suffix},                 \
        [IQ_TYPE_Q2_K] = {.vec_dot = iq_vec_dot_q2_K_q8_K_##suffix},                 \
        [IQ_TYPE_Q3_K] = {.vec_dot = iq_vec_dot_q3_K_q8_K_##suffix},                 \
        [IQ_TYPE_IQ4_NL] = {.vec_dot = iq_vec_dot_iq4_nl_q8_0_##suffix},             \
        [IQ_TYPE_IQ4_XS] = {.vec_dot = iq_vec_dot_iq4_xs_q8_K_##suffix},             \
    }

const struct iq_cpu_type_traits iq_cpu_quants_avx512[IQ_TYPE_GGUF_END] = IQ_AVX512_TABLE(avx512);
const struct iq_cpu_type_traits iq_cpu_quants_avx512_vnni[IQ_TYPE_GGUF_END] = IQ_AVX512_TABLE(avx512_vnni);
