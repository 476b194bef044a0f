// AVX2 InnerQ kernels (AVX2 + FMA + F16C): the AVX-512 ones at half width, 8 lanes = half
// a tile, with pmaddubsw + pmaddwd for the code dot products. The arithmetic is described in
// qcache.h and specified by the scalar kernels in qcache.c.
#include "x86-kernels.h"
#include "qcache-block.h"
#include "vec.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

IQ_INNERQ_INLINE __m256 iq_exp_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(IQ_EXP_MIN));
    const __m256 nr = _mm256_fmadd_ps(x, _mm256_set1_ps(IQ_EXP_LOG2E), _mm256_set1_ps(IQ_ROUND_SHIFT));
    const __m256 n = _mm256_sub_ps(nr, _mm256_set1_ps(IQ_ROUND_SHIFT));
    const __m256 f = _mm256_fmsub_ps(x, _mm256_set1_ps(IQ_EXP_LOG2E), n);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(IQ_EXP_C4), f, _mm256_set1_ps(IQ_EXP_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(IQ_EXP_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(IQ_EXP_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    // 2^n: n sits in the low bits of nr = n + 1.5 * 2^23, so (bits(nr) + 127) << 23 is its exponent field
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_castps_si256(nr), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

IQ_INNERQ_INLINE float iq_hsum_avx2(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

IQ_INNERQ_INLINE float iq_hmax_avx2(__m256 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// Lanes lo + i (i = 0..7) that fall in [a, b), as an all-ones mask.
IQ_INNERQ_INLINE __m256 iq_lanes_in(int32_t lo, int32_t a, int32_t b) {
    const __m256i idx = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(lo));
    const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(a - 1)),
                                        _mm256_cmpgt_epi32(_mm256_set1_epi32(b), idx));
    return _mm256_castsi256_ps(in);
}

// ---- rows (f16 windows, f32 batch rows): the plain types' vector kernels ----

static void iq_rows_f16_avx2(const void * k, const void * v, size_t ld, int32_t n, const struct iq_innerq_query * q,
                             float * st) {
    iq_innerq_rows_vec(&iq_vec_fns_avx2, k, v, ld, n, true, q, st);
}

static void iq_rows_f32_avx2(const void * k, const void * v, size_t ld, int32_t n, const struct iq_innerq_query * q,
                             float * st) {
    iq_innerq_rows_vec(&iq_vec_fns_avx2, k, v, ld, n, false, q, st);
}

// ---- blocks: softmax ----

// One head's softmax over tokens [a, b) of the token tiles [tau0, tau1) of a block: e = exp(s -
// max s) there, 0 elsewhere in the tiles (e may be s). Raises the state's running max to max s,
// adds w * sum e to its l and returns w = exp(max s - running max); *e_sum = sum e. With value
// row scales ns (NULL: none; 0 outside [a, b)), e holds e n instead, *n_sum = sum e n and
// *n_max = max e n (the values' weights, qcache.h).
IQ_INNERQ_INLINE float iq_softmax_avx2(const float * s, int32_t a, int32_t b, int32_t tau0, int32_t tau1, float * e,
                                       float * sti, int32_t dim, float * e_sum, const float * ns, float * n_sum,
                                       float * n_max) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int32_t t8 = 2 * tau0; t8 < 2 * tau1; t8++) {
        const __m256 sv = _mm256_loadu_ps(s + 8 * t8);
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sv, iq_lanes_in(8 * t8, a, b)));
    }
    const float smax = iq_hmax_avx2(mx);
    __m256 sum = _mm256_setzero_ps(), nsum = _mm256_setzero_ps(), nmax = _mm256_setzero_ps();
    for (int32_t t8 = 2 * tau0; t8 < 2 * tau1; t8++) {
        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + 8 * t8), _mm256_set1_ps(smax));
        const __m256 ev = _mm256_and_ps(iq_lanes_in(8 * t8, a, b), iq_exp_avx2(x));
        sum = _mm256_add_ps(sum, ev);
        if (ns != NULL) {
            const __m256 en = _mm256_mul_ps(ev, _mm256_load_ps(ns + 8 * t8));
            nsum = _mm256_add_ps(nsum, en);
            nmax = _mm256_max_ps(nmax, en);
            _mm256_storeu_ps(e + 8 * t8, en);
        } else {
            _mm256_storeu_ps(e + 8 * t8, ev);
        }
    }
    *e_sum = iq_hsum_avx2(sum);
    if (ns != NULL) {
        *n_sum = iq_hsum_avx2(nsum);
        *n_max = iq_hmax_avx2(nmax);
    }
    const float w = iq_softmax_raise(sti, dim, smax);
    sti[1] += w * *e_sum;
    return w;
}

// ---- InnerQ blocks ----

// The 64 codes of a tile (layout in iq-qcache.h) as two halves, one code per byte: byte q of
// u[h] is code 32 h + q.
IQ_INNERQ_INLINE void iq_tile_avx2(const uint8_t * t, const int bits, __m256i * u) {
    if (bits >= 4) {
        const __m256i x = _mm256_loadu_si256((const __m256i *) t);
        u[0] = _mm256_and_si256(x, _mm256_set1_epi8(15));
        u[1] = _mm256_and_si256(_mm256_srli_epi16(x, 4), _mm256_set1_epi8(15));
    } else {
        const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) t));
        u[0] = _mm256_and_si256(_mm256_srlv_epi32(x, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), _mm256_set1_epi8(3));
        u[1] = _mm256_and_si256(_mm256_srlv_epi32(x, _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6)), _mm256_set1_epi8(3));
    }
    if (bits == 2 || bits == 4) {
        return;
    }
    // The top bit (bit 2 of a 3-bit code, bit 4 of a 5-bit one) of code p is bit p % 8 of byte
    // p / 8 of the 8 bytes after the low plane: spread the bytes, test the bits.
    const int plane = bits == 3 ? 16 : 32;
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                            3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long) 0x8040201008040201ULL);
    for (int h = 0; h < 2; h++) {
        int32_t w;
        memcpy(&w, t + plane + 4 * h, sizeof(w));
        const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(w), spread);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
        u[h] = _mm256_or_si256(u[h], _mm256_and_si256(set, _mm256_set1_epi8((char) (1 << (bits - 1)))));
    }
}

// acc[lane] += sum of the 4 byte products a_u8 * b_s8 in that 32-bit lane (no overflow: codes <= 31, so a
// pair of products is at most 2 * 255 * 31 < 2^15; key levels <= 43 against |q8| <= 127: 2 * 43 * 127).
IQ_INNERQ_INLINE __m256i iq_dot_avx2(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}

IQ_INNERQ_INLINE __m256i iq_bcast4(const void * p) {
    int32_t x;
    memcpy(&x, p, sizeof(x));
    return _mm256_set1_epi32(x);
}

// Scores of token tiles [tau0, tau1) for heads h0 .. h0+R-1: lanes are 8 tokens, both halves of
// a tile in one pass (sharing each q8 load); each code tile adds 4 channels. lv: the codes are
// on the key levels, L[u] by a byte shuffle.
IQ_INNERQ_INLINE void iq_keys_avx2(const uint8_t * kb, const iq_fp16_t * dk, const iq_fp16_t * mk, int32_t dim,
                                   int32_t g, int32_t tau0, int32_t tau1, const struct iq_innerq_query * q,
                                   int32_t h0, float (*s)[IQ_QGROUP_MAX], const int bits, const int R,
                                   const bool lv) {
    const size_t tb = 8 * bits;
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) iq_innerq_key_levels()));
    for (int32_t tau = tau0; tau < tau1; tau++) {
        __m256 sc[2][4];
        for (int h = 0; h < 2; h++) {
            #pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                sc[h][i] = _mm256_setzero_ps();
            }
        }
        for (int32_t gi = 0; gi < dim / g; gi++) {
            __m256i is[2][4];
            for (int h = 0; h < 2; h++) {
                #pragma GCC unroll 4
                for (int i = 0; i < R; i++) {
                    is[h][i] = _mm256_setzero_si256();
                }
            }
            for (int32_t kq = gi * g / 4; kq < (gi + 1) * g / 4; kq++) {
                __m256i u[2];
                iq_tile_avx2(kb + ((size_t) tau * (dim / 4) + kq) * tb, bits, u);
                if (lv) {
                    u[0] = _mm256_shuffle_epi8(levels, u[0]);
                    u[1] = _mm256_shuffle_epi8(levels, u[1]);
                }
                #pragma GCC unroll 4
                for (int i = 0; i < R; i++) {
                    const __m256i qb = iq_bcast4(&q->q8[h0 + i][4 * kq]);
                    is[0][i] = iq_dot_avx2(is[0][i], u[0], qb);
                    is[1][i] = iq_dot_avx2(is[1][i], u[1], qb);
                }
            }
            for (int h = 0; h < 2; h++) {
                const size_t pi = (size_t) gi * g + 16 * tau + 8 * h;
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (dk + pi)));
                const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (mk + pi)));
                #pragma GCC unroll 4
                for (int i = 0; i < R; i++) {
                    const __m256 dot = _mm256_mul_ps(_mm256_cvtepi32_ps(is[h][i]), _mm256_set1_ps(q->sq[h0 + i][gi]));
                    const __m256 dc = _mm256_fnmadd_ps(d, _mm256_set1_ps(q->q2[h0 + i][gi]), dot);  // score correction
                    sc[h][i] = _mm256_fmadd_ps(d, dc, sc[h][i]);
                    sc[h][i] = _mm256_fmadd_ps(m, _mm256_set1_ps(q->sumq[h0 + i][gi]), sc[h][i]);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            #pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                _mm256_storeu_ps(s[h0 + i] + 16 * tau + 8 * h, sc[h][i]);
            }
        }
    }
}

// acc += w (d/255 sum_t p8_t u_tc + m E) over token quads [kq0, kq1): lanes are 8 channels, both
// halves of a tile in one pass (sharing each p8 load); each code tile adds 4 tokens.
IQ_INNERQ_INLINE void iq_values_avx2(const uint8_t * vb, const iq_fp16_t * dv, const iq_fp16_t * mv, int32_t dim,
                                     int32_t g, int32_t kq0, int32_t kq1, const uint8_t (*p8)[IQ_QGROUP_MAX],
                                     const float * wd, const float * we, int32_t h0, float * st, const int bits,
                                     const int R) {
    const size_t tb = 8 * bits;
    for (int32_t sg = 0; sg < dim / 16; sg++) {
        __m256i is[2][4];
        for (int h = 0; h < 2; h++) {
            #pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                is[h][i] = _mm256_setzero_si256();
            }
        }
        for (int32_t kq = kq0; kq < kq1; kq++) {
            __m256i u[2];
            iq_tile_avx2(vb + ((size_t) sg * (g / 4) + kq) * tb, bits, u);
            #pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const __m256i pb = iq_bcast4(&p8[h0 + i][4 * kq]);
                is[0][i] = iq_dot_avx2(is[0][i], pb, u[0]);
                is[1][i] = iq_dot_avx2(is[1][i], pb, u[1]);
            }
        }
        for (int h = 0; h < 2; h++) {
            const int32_t c0 = 16 * sg + 8 * h;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (dv + c0)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (mv + c0)));
            #pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                float * acc = st + (size_t) (h0 + i) * IQ_ATTN_STATE(dim) + 2 + c0;
                __m256 x = _mm256_fmadd_ps(m, _mm256_set1_ps(we[h0 + i]), _mm256_loadu_ps(acc));
                x = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(wd[h0 + i])), _mm256_cvtepi32_ps(is[h][i]), x);
                _mm256_storeu_ps(acc, x);
            }
        }
    }
}

IQ_INNERQ_INLINE void iq_block_run_avx2(const struct iq_qcache * c, const struct iq_innerq_block blk, int32_t a,
                                       int32_t b, const struct iq_innerq_query * q, float * st) {
    const struct iq_qcache_config * cfg = &c->cfg;
    const int32_t dim = c->head_dim, g = cfg->group;
    _Alignas(32) float s[IQ_INNERQ_MAX_R][IQ_QGROUP_MAX];
    _Alignas(32) uint8_t p8[IQ_INNERQ_MAX_R][IQ_QGROUP_MAX];
    float wd[IQ_INNERQ_MAX_R], we[IQ_INNERQ_MAX_R];
    const int32_t tau0 = a / 16, tau1 = (b + 15) / 16;
#define IQ_KEYS(bits, r) iq_keys_avx2(blk.k, blk.dk, blk.mk, dim, g, tau0, tau1, q, h0, s, bits, r, false)
#define IQ_KEYS_LV(bits, r) iq_keys_avx2(blk.k, blk.dk, blk.mk, dim, g, tau0, tau1, q, h0, s, bits, r, true)
    for (int32_t h0 = 0; h0 < q->r; h0 += 4) {
        IQ_INNERQ_DISPATCH_KEYS(IQ_KEYS, IQ_KEYS_LV, cfg->bits_k, blk.lk != NULL, q->r - h0);
    }
#undef IQ_KEYS_LV
#undef IQ_KEYS
    // value row scales (qcache.h): e_t n_t weighs the values, over the block's largest
    _Alignas(32) float ns[IQ_QGROUP_MAX];
    if (blk.vs != NULL) {  // 2^(j/8) from an 8-entry table by permute, times 2^(code/8 - 16) by its exponent bits
        const __m256 steps = _mm256_setr_ps(1.0f, 1.09050773f, 1.18920712f, 1.29683955f, 1.41421356f, 1.54221083f,
                                            1.68179283f, 1.83400808f);
        for (int32_t t8 = 2 * tau0; t8 < 2 * tau1; t8++) {
            const __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (blk.vs + 8 * t8)));
            const __m256i q = _mm256_add_epi32(_mm256_srli_epi32(code, 3), _mm256_set1_epi32(111));  // biased
            const __m256i pow2 = _mm256_slli_epi32(q, 23);
            const __m256 n = _mm256_mul_ps(_mm256_permutevar8x32_ps(steps, code), _mm256_castsi256_ps(pow2));
            _mm256_storeu_ps(ns + 8 * t8, _mm256_and_ps(iq_lanes_in(8 * t8, a, b), n));
        }
    }
    for (int32_t i = 0; i < q->r; i++) {
        float es, n_sum = 0.0f, n_max = 0.0f;
        float * sti = st + (size_t) i * IQ_ATTN_STATE(dim);
        // two calls, so that the inlined softmax without row scales has no test in its loop
        const float w = blk.vs != NULL ? iq_softmax_avx2(s[i], a, b, tau0, tau1, s[i], sti, dim, &es, ns, &n_sum, &n_max)
                                       : iq_softmax_avx2(s[i], a, b, tau0, tau1, s[i], sti, dim, &es, NULL, NULL, NULL);
        __m256 inv = _mm256_set1_ps(1.0f);
        wd[i] = w / IQ_P8_MAX;
        we[i] = w * es;
        if (blk.vs != NULL) {
            inv = _mm256_set1_ps(n_max > 0.0f ? 1.0f / n_max : 1.0f);
            wd[i] = w * n_max / IQ_P8_MAX;
            we[i] = w * n_sum;
        }
        for (int32_t t8 = 2 * tau0; t8 < 2 * tau1; t8++) {
            __m256 e = _mm256_loadu_ps(s[i] + 8 * t8);
            e = blk.vs != NULL ? _mm256_mul_ps(e, inv) : e;
            const __m256i p = _mm256_cvttps_epi32(_mm256_fmadd_ps(e, _mm256_set1_ps(IQ_P8_MAX), _mm256_set1_ps(0.5f)));
            const __m128i p16 = _mm_packus_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
            _mm_storel_epi64((__m128i *) (p8[i] + 8 * t8), _mm_packus_epi16(p16, p16));
        }
    }
    const int32_t kq0 = a / 4, kq1 = (b + 3) / 4;
#define IQ_VALUES(bits, r) iq_values_avx2(blk.v, blk.dv, blk.mv, dim, g, kq0, kq1, p8, wd, we, h0, st, bits, r)
    for (int32_t h0 = 0; h0 < q->r; h0 += 4) {
        IQ_INNERQ_DISPATCH(IQ_VALUES, cfg->bits_v, q->r - h0);
    }
#undef IQ_VALUES
}

// ---- KIVI blocks ----

// acc[i] += f * mul[i][m] for heads i < R.
IQ_INNERQ_INLINE void iq_kivi_fma_avx2(__m256 f, const float (*mul)[IQ_INNERQ_KIVI_MUL], size_t m, __m256 * acc,
                                       const int R) {
    #pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        acc[i] = _mm256_fmadd_ps(f, _mm256_loadu_ps(mul[i] + m), acc[i]);
    }
}

// A KIVI tile reduces along its 16 lanes (key channels, value tokens) and holds 4 outputs in
// each 32-bit word (key tokens, value channels), so its codes become floats, 8 at a time: chunk
// s, codes 8 s .. 8 s + 7, holds the 4 subs of lanes 2 s and 2 s + 1 and meets the multipliers
// mul[i][mo + 8 s ..]. Chunks go in the order they unpack, so few are live at once.
IQ_INNERQ_INLINE void iq_kivi_tile_avx2(const uint8_t * t, const float (*mul)[IQ_INNERQ_KIVI_MUL], size_t mo,
                                        __m256 * acc, const int bits, const int R) {
    if (bits == 4) {
        #pragma GCC unroll 4
        for (int h = 0; h < 4; h++) {  // byte 8 h + l: code 8 h + l (low nibble), 32 + 8 h + l (high)
            const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (t + 8 * h)));
            iq_kivi_fma_avx2(_mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15))), mul, mo + 8 * h, acc, R);
            iq_kivi_fma_avx2(_mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4)), mul, mo + 8 * h + 32, acc, R);
        }
        return;
    }
    #pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (t + 8 * h)));
        #pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {  // 2-bit plane p of these 8 bytes: chunk 2 p + h
            __m256i u = _mm256_srli_epi32(x, 2 * p);
            u = p < 3 ? _mm256_and_si256(u, _mm256_set1_epi32(3)) : u;  // x holds zero-extended bytes
            if (bits == 3) {  // bit 2 of code 8 s + l is bit l of byte 16 + s
                const __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32(t[16 + 2 * p + h] << 2),
                                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                u = _mm256_or_si256(u, _mm256_and_si256(hi, _mm256_set1_epi32(4)));
            }
            iq_kivi_fma_avx2(_mm256_cvtepi32_ps(u), mul, mo + 8 * (2 * p + h), acc, R);
        }
    }
}

// dst[4 l + k] = x[l] for the 8 lanes l of x and k = 0..3 (IQ_INNERQ_KIVI_MUL).
IQ_INNERQ_INLINE void iq_kivi_x4_avx2(__m256 x, float * dst) {
    #pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {
        const __m256i idx = _mm256_setr_epi32(2 * s, 2 * s, 2 * s, 2 * s, 2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1);
        _mm256_storeu_ps(dst + 8 * s, _mm256_permutevar8x32_ps(x, idx));
    }
}

// out[i][4 q + k] = sum over n rows and the 16 lanes l of tile q of the row (tiles q = 0, 1 at
// tiles + row * stride + q * 8 * bits) of mul[i][mo + 64 row + 4 l + k] * code(l, k), for heads
// i < R. The accumulator of a tile and head sums chunk by chunk: its 128-bit half j holds lanes
// l = j mod 2, so the 4 outputs are the sum of its halves.
IQ_INNERQ_INLINE void iq_kivi_pair_avx2(const uint8_t * tiles, size_t stride, int32_t n,
                                        const float (*mul)[IQ_INNERQ_KIVI_MUL], size_t mo, __m256 * out,
                                        const int bits, const int R) {
    const size_t tb = 8 * bits;
    __m256 acc[2][4];
    #pragma GCC unroll 2
    for (int q = 0; q < 2; q++) {
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            acc[q][i] = _mm256_setzero_ps();
        }
    }
    for (int32_t row = 0; row < n; row++) {
        #pragma GCC unroll 2
        for (int q = 0; q < 2; q++) {
            iq_kivi_tile_avx2(tiles + row * stride + q * tb, mul, mo + 64 * row, acc[q], bits, R);
        }
    }
    #pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        out[i] = _mm256_add_ps(_mm256_permute2f128_ps(acc[0][i], acc[1][i], 0x20),
                               _mm256_permute2f128_ps(acc[0][i], acc[1][i], 0x31));
    }
}

// Scores of token tiles [tau0, tau1) for heads h0 .. h0+R-1: q' (x4) and C per head, then per
// 8 tokens (2 tiles, consecutive in memory) the rows of 16 channels.
IQ_INNERQ_INLINE void iq_kivi_keys_avx2(const uint8_t * kb, const iq_fp16_t * dk, const iq_fp16_t * mk,
                                        const float * norm, int32_t dim, int32_t g, int32_t tau0, int32_t tau1,
                                        const struct iq_innerq_query * q, int32_t h0, float (*s)[IQ_QGROUP_MAX],
                                        const int bits, const int R) {
    _Alignas(32) float mul[4][IQ_INNERQ_KIVI_MUL];
    __m256 base[4];
    #pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        base[i] = _mm256_setzero_ps();
    }
    for (int32_t c8 = 0; c8 < dim / 8; c8++) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (dk + 8 * c8)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (mk + 8 * c8)));
        const __m256 n = _mm256_loadu_ps(norm + 8 * c8);
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const __m256 qn = _mm256_mul_ps(_mm256_loadu_ps(q->qs + (h0 + i) * dim + 8 * c8), n);
            iq_kivi_x4_avx2(_mm256_mul_ps(qn, d), mul[i] + 32 * c8);
            base[i] = _mm256_fmadd_ps(qn, m, base[i]);
        }
    }
    float cst[4];
    #pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        cst[i] = iq_hsum_avx2(base[i]);
    }
    const size_t tb = 8 * bits;
    for (int32_t t8 = 2 * tau0; t8 < 2 * tau1; t8++) {
        __m256 out[4];
        iq_kivi_pair_avx2(kb + 2 * t8 * tb, (size_t) (g / 4) * tb, dim / 16, mul, 0, out, bits, R);
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            _mm256_storeu_ps(s[h0 + i] + 8 * t8, _mm256_add_ps(out[i], _mm256_set1_ps(cst[i])));
        }
    }
}

// acc += M + sum_t W u over token tiles [tau0, tau1) for heads h0 .. h0+R-1, from e and w: W
// (x4) and M per head and value group, then per 8 channels (2 tiles, consecutive in memory)
// the rows of 16 tokens.
IQ_INNERQ_INLINE void iq_kivi_values_avx2(const uint8_t * vb, const iq_fp16_t * dv, const iq_fp16_t * mv,
                                          int32_t dim, int32_t g, int32_t tau0, int32_t tau1,
                                          const float (*e)[IQ_QGROUP_MAX], const float * w, int32_t h0, float * st,
                                          const int bits, const int R) {
    _Alignas(32) float mul[4][IQ_INNERQ_KIVI_MUL];
    float mg[4][IQ_QCACHE_MAX_GROUPS];
    for (int32_t gi = 0; gi < dim / g; gi++) {
        __m256 msum[4];
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            msum[i] = _mm256_setzero_ps();
        }
        for (int32_t t8 = 2 * tau0; t8 < 2 * tau1; t8++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (dv + gi * g + 8 * t8)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (mv + gi * g + 8 * t8)));
            #pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const __m256 p = _mm256_mul_ps(_mm256_loadu_ps(e[h0 + i] + 8 * t8), _mm256_set1_ps(w[h0 + i]));
                iq_kivi_x4_avx2(_mm256_mul_ps(p, d), mul[i] + 4 * gi * g + 32 * t8);
                msum[i] = _mm256_fmadd_ps(p, m, msum[i]);
            }
        }
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            mg[i][gi] = iq_hsum_avx2(msum[i]);
        }
    }
    const size_t tb = 8 * bits, row = (size_t) (dim / 4) * tb;
    for (int32_t c8 = 0; c8 < dim / 8; c8++) {
        const int32_t gi = 8 * c8 / g;
        __m256 out[4];
        iq_kivi_pair_avx2(vb + tau0 * row + 2 * c8 * tb, row, tau1 - tau0, mul, (size_t) (4 * gi * g + 64 * tau0),
                          out, bits, R);
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            float * acc = st + (size_t) (h0 + i) * IQ_ATTN_STATE(dim) + 2 + 8 * c8;
            _mm256_storeu_ps(acc, _mm256_add_ps(_mm256_loadu_ps(acc), _mm256_add_ps(out[i], _mm256_set1_ps(mg[i][gi]))));
        }
    }
}

static void iq_kivi_block_avx2(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                               const struct iq_innerq_query * q, float * st) {
    const struct iq_qcache_config * cfg = &c->cfg;
    const int32_t dim = c->head_dim, g = cfg->group;
    const struct iq_innerq_block blk = iq_innerq_block_get(c, h, j);
    const float * norm = iq_qcache_norm(c, h);
    _Alignas(32) float s[IQ_INNERQ_MAX_R][IQ_QGROUP_MAX];
    float w[IQ_INNERQ_MAX_R];
    const int32_t tau0 = a / 16, tau1 = (b + 15) / 16;
#define IQ_KEYS(bits, r) iq_kivi_keys_avx2(blk.k, blk.dk, blk.mk, norm, dim, g, tau0, tau1, q, h0, s, bits, r)
    for (int32_t h0 = 0; h0 < q->r; h0 += 4) {
        IQ_KIVI_DISPATCH(IQ_KEYS, cfg->bits_k, q->r - h0);
    }
#undef IQ_KEYS
    for (int32_t i = 0; i < q->r; i++) {
        float es;
        w[i] = iq_softmax_avx2(s[i], a, b, tau0, tau1, s[i], st + (size_t) i * IQ_ATTN_STATE(dim), dim, &es, NULL, NULL, NULL);
    }
#define IQ_VALUES(bits, r) iq_kivi_values_avx2(blk.v, blk.dv, blk.mv, dim, g, tau0, tau1, s, w, h0, st, bits, r)
    for (int32_t h0 = 0; h0 < q->r; h0 += 4) {
        IQ_KIVI_DISPATCH(IQ_VALUES, cfg->bits_v, q->r - h0);
    }
#undef IQ_VALUES
}

static void iq_block_avx2(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                          const struct iq_innerq_query * q, float * st) {
    iq_block_run_avx2(c, iq_innerq_block_get(c, h, j), a, b, q, st);
}

// iq_p8_decode_block, 8 groups at a time: 2^(-c / 16) as its table times the exponent's bits,
// F16C's conversions (to nearest even, as iq_float_to_half), and the asymmetric m's product
// rounded before its sum, as there.
void iq_p8_decode_avx2(const uint8_t * params, int32_t head_dim, float centre, iq_fp16_t * dm) {
    float ref[3];
    for (int i = 0; i < 3; i++) {
        ref[i] = iq_half_to_float((iq_fp16_t) (params[2 * i] | params[2 * i + 1] << 8));
    }
    const float step = (ref[2] - ref[1]) / (float) IQ_P8_ASYM_MAX;
    const uint8_t * dc = params + IQ_P8_REFS, * mc = dc + head_dim;
    const __m256 t_lo = _mm256_setr_ps(1.0f, 0.957603276f, 0.917004049f, 0.878126085f, 0.840896428f, 0.805245161f,
                                       0.771105409f, 0.738413095f);
    const __m256 t_hi = _mm256_setr_ps(0.707106769f, 0.677127779f, 0.648419797f, 0.620928884f, 0.594603539f,
                                       0.56939429f, 0.545253873f, 0.522136867f);
    const __m256 dref = _mm256_set1_ps(ref[0]), mlo = _mm256_set1_ps(ref[1]), stepv = _mm256_set1_ps(step);
    const __m256 sym = _mm256_set1_ps(-centre), sign = _mm256_set1_ps(-0.0f);
    int32_t gi = 0;
    for (; gi + 8 <= head_dim; gi += 8) {
        const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (dc + gi)));
        const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (mc + gi)));
        const __m256 t = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t_lo, c), _mm256_permutevar8x32_ps(t_hi, c),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));  // bit 3: the upper half
        const __m256 p2 = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(127), _mm256_srli_epi32(c, 4)), 23));
        __m256 a = _mm256_mul_ps(dref, _mm256_mul_ps(t, p2));
        a = _mm256_or_ps(a, _mm256_and_ps(sign, _mm256_castsi256_ps(
                                                   _mm256_cmpeq_epi32(m, _mm256_set1_epi32(IQ_P8_SYM_NEG)))));
        const __m128i d16 = _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT);
        __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(m), stepv);
        __asm__("" : "+x"(prod));  // no fused multiply-add: the product is rounded first
        const __m256 m_asym = _mm256_add_ps(mlo, prod);
        const __m256 m_sym = _mm256_mul_ps(sym, _mm256_cvtph_ps(d16));
        const __m256 mv = _mm256_blendv_ps(
            m_asym, m_sym, _mm256_castsi256_ps(_mm256_cmpgt_epi32(m, _mm256_set1_epi32(IQ_P8_ASYM_MAX))));
        _mm_storeu_si128((__m128i *) (dm + gi), d16);
        _mm_storeu_si128((__m128i *) (dm + head_dim + gi), _mm256_cvtps_ph(mv, _MM_FROUND_TO_NEAREST_INT));
    }
    if (gi < head_dim) {  // (head_dim is a multiple of 16: never)
        iq_p8_decode_block(params, head_dim, centre, dm);
    }
}

static void iq_block_p8_avx2(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                             const struct iq_innerq_query * q, float * st) {
    iq_block_run_avx2(c, iq_innerq_block_get_p8(c, h, j, iq_p8_decode_avx2), a, b, q, st);
}

const struct iq_innerq_kernels iq_innerq_kernels_avx2 = {
    "avx2", iq_rows_f16_avx2, iq_rows_f32_avx2, iq_block_avx2, iq_block_p8_avx2, iq_kivi_block_avx2,
};
