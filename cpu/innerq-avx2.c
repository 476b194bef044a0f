// AVX2 InnerQ kernels (AVX2 + FMA + F16C): the AVX-512 ones at half width, 8 lanes = half
// a tile, with pmaddubsw + pmaddwd for the code dot products. The arithmetic is described in
// iq-innerq-cpu.h and specified by the scalar kernels in innerq.c.
#include "iq-innerq-cpu.h"

#include <immintrin.h>
#include <math.h>

IQ_INNERQ_INLINE __m256 iq_exp_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(IQ_EXP_MIN));
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(IQ_EXP_LOG2E), _mm256_set1_ps(IQ_EXP_ROUND)),
                                   _mm256_set1_ps(IQ_EXP_ROUND));
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-IQ_EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-IQ_EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(IQ_EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(IQ_EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(IQ_EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(IQ_EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(IQ_EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(IQ_EXP_P5));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
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

// The horizontal sums of four vectors, {sum a[0], .., sum a[3]}.
IQ_INNERQ_INLINE __m128 iq_hsum4_avx2(const __m256 * a) {
    const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
}

// Lanes lo + i (i = 0..7) that fall in [a, b), as an all-ones mask.
IQ_INNERQ_INLINE __m256 iq_lanes_in(int32_t lo, int32_t a, int32_t b) {
    const __m256i idx = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(lo));
    const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(a - 1)),
                                        _mm256_cmpgt_epi32(_mm256_set1_epi32(b), idx));
    return _mm256_castsi256_ps(in);
}

// ---- rows (f16 windows, f32 batch rows) ----

// Chunks of 8 rows: scores (one reduction per row and head), one max and exp per chunk,
// then acc += p v with the accumulators of 8 channels in a register across the chunk.
IQ_INNERQ_INLINE void iq_rows_avx2(const void * k, const void * v, size_t ld, int32_t n, bool f16,
                            const struct iq_innerq_query * q, float * st) {
    const int32_t dim = q->head_dim, nd = dim / 8;
    _Alignas(32) float kbuf[8 * IQ_QCACHE_MAX_HEAD_DIM], vbuf[8 * IQ_QCACHE_MAX_HEAD_DIM];
    _Alignas(32) float s[IQ_INNERQ_MAX_R][8];
    for (int32_t t0 = 0; t0 < n; t0 += 8) {
        const int32_t m = n - t0 < 8 ? n - t0 : 8;
        const float * kr = kbuf;
        const float * vr = vbuf;
        size_t lr = (size_t) dim;
        if (!f16) {
            kr = (const float *) k + t0 * ld;
            vr = (const float *) v + t0 * ld;
            lr = ld;
        } else {
            for (int32_t t = 0; t < m; t++) {
                const iq_fp16_t * ks = (const iq_fp16_t *) k + (t0 + t) * ld;
                const iq_fp16_t * vs = (const iq_fp16_t *) v + (t0 + t) * ld;
                for (int32_t c = 0; c < nd; c++) {
                    const __m128i kh = _mm_loadu_si128((const __m128i *) (ks + 8 * c));
                    _mm256_store_ps(kbuf + t * dim + 8 * c, _mm256_cvtph_ps(kh));
                    const __m128i vh = _mm_loadu_si128((const __m128i *) (vs + 8 * c));
                    _mm256_store_ps(vbuf + t * dim + 8 * c, _mm256_cvtph_ps(vh));
                }
            }
        }
        for (int32_t i = 0; i < q->r; i++) {
            for (int32_t t = 0; t < m; t += 4) {
                __m256 acc[4];
#pragma GCC unroll 4
                for (int u = 0; u < 4; u++) {
                    acc[u] = _mm256_setzero_ps();
                    for (int32_t c = 0; c < nd && t + u < m; c++) {
                        acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(q->qs[i] + 8 * c),
                                                 _mm256_loadu_ps(kr + (t + u) * lr + 8 * c), acc[u]);
                    }
                }
                _mm_storeu_ps(s[i] + t, iq_hsum4_avx2(acc));
            }
        }
        const __m256 valid = iq_lanes_in(0, 0, m);
        for (int32_t i = 0; i < q->r; i++) {
            float * sti = st + (size_t) i * IQ_ATTN_STATE(dim);
            const __m256 sv = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_load_ps(s[i]), valid);
            iq_innerq_state_raise(sti, dim, iq_hmax_avx2(sv));
            const __m256 p = _mm256_and_ps(valid, iq_exp_avx2(_mm256_sub_ps(sv, _mm256_set1_ps(sti[0]))));
            sti[1] += iq_hsum_avx2(p);
            _mm256_store_ps(s[i], p);
            for (int32_t c = 0; c < nd; c++) {
                __m256 acc = _mm256_loadu_ps(sti + 2 + 8 * c);
                for (int32_t t = 0; t < m; t++) {
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(s[i][t]), _mm256_loadu_ps(vr + t * lr + 8 * c), acc);
                }
                _mm256_storeu_ps(sti + 2 + 8 * c, acc);
            }
        }
    }
}

static void iq_rows_f16_avx2(const void * k, const void * v, size_t ld, int32_t n, const struct iq_innerq_query * q,
                             float * st) {
    iq_rows_avx2(k, v, ld, n, true, q, st);
}

static void iq_rows_f32_avx2(const void * k, const void * v, size_t ld, int32_t n, const struct iq_innerq_query * q,
                             float * st) {
    iq_rows_avx2(k, v, ld, n, false, q, st);
}

// ---- InnerQ blocks ----

// The 64 codes of a tile (layout in iq-innerq.h) as two halves, one code per byte: byte q of
// u[h] is code 32 h + q.
IQ_INNERQ_INLINE void iq_tile_avx2(const uint8_t * t, const int bits, __m256i * u) {
    if (bits == 4) {
        const __m256i x = _mm256_loadu_si256((const __m256i *) t);
        u[0] = _mm256_and_si256(x, _mm256_set1_epi8(15));
        u[1] = _mm256_and_si256(_mm256_srli_epi16(x, 4), _mm256_set1_epi8(15));
        return;
    }
    const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) t));
    u[0] = _mm256_and_si256(_mm256_srlv_epi32(x, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), _mm256_set1_epi8(3));
    u[1] = _mm256_and_si256(_mm256_srlv_epi32(x, _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6)), _mm256_set1_epi8(3));
    if (bits == 2) {
        return;
    }
    // Bit 2 of code p is bit p % 8 of byte p / 8 of the next 8 bytes: spread the bytes, test the bits.
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                            3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long) 0x8040201008040201ULL);
    for (int h = 0; h < 2; h++) {
        int32_t w;
        memcpy(&w, t + 16 + 4 * h, sizeof(w));
        const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(w), spread);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
        u[h] = _mm256_or_si256(u[h], _mm256_and_si256(set, _mm256_set1_epi8(4)));
    }
}

// acc[lane] += sum of the 4 byte products a_u8 * b_s8 in that 32-bit lane (no overflow: codes <= 15).
IQ_INNERQ_INLINE __m256i iq_dot_avx2(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}

IQ_INNERQ_INLINE __m256i iq_bcast4(const void * p) {
    int32_t x;
    memcpy(&x, p, sizeof(x));
    return _mm256_set1_epi32(x);
}

// Scores of token tiles [tau0, tau1) for heads h0 .. h0+R-1: lanes are 8 tokens, both halves of
// a tile in one pass (sharing each q8 load); each code tile adds 4 channels.
IQ_INNERQ_INLINE void iq_keys_avx2(const uint8_t * kb, const iq_fp16_t * dk, const iq_fp16_t * mk, int32_t dim,
                                   int32_t g, int32_t tau0, int32_t tau1, const struct iq_innerq_query * q,
                                   int32_t h0, float (*s)[IQ_QGROUP_MAX], const int bits, const int R) {
    const size_t tb = 8 * bits;
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
                    sc[h][i] = _mm256_fmadd_ps(d, dot, sc[h][i]);
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

static void iq_block_avx2(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                          const struct iq_innerq_query * q, float * st) {
    const struct iq_qcache_config * cfg = &c->cfg;
    const int32_t dim = c->head_dim, g = cfg->group;
    const uint8_t * kb = iq_qcache_block(c, false, h, j);
    const uint8_t * vb = iq_qcache_block(c, true, h, j);
    const iq_fp16_t * dk = iq_qblock_params(kb, cfg->bits_k, dim, g);
    const iq_fp16_t * dv = iq_qblock_params(vb, cfg->bits_v, dim, g);
    _Alignas(32) float s[IQ_INNERQ_MAX_R][IQ_QGROUP_MAX];
    _Alignas(32) uint8_t p8[IQ_INNERQ_MAX_R][IQ_QGROUP_MAX];
    float wd[IQ_INNERQ_MAX_R], we[IQ_INNERQ_MAX_R];
    const int32_t tau0 = a / 16, tau1 = (b + 15) / 16;
#define IQ_KEYS(bits, r) iq_keys_avx2(kb, dk, dk + dim, dim, g, tau0, tau1, q, h0, s, bits, r)
    for (int32_t h0 = 0; h0 < q->r; h0 += 4) {
        IQ_INNERQ_DISPATCH(IQ_KEYS, cfg->bits_k, q->r - h0);
    }
#undef IQ_KEYS
    for (int32_t i = 0; i < q->r; i++) {
        __m256 mx = _mm256_set1_ps(-INFINITY);
        for (int32_t t8 = 2 * tau0; t8 < 2 * tau1; t8++) {
            const __m256 sv = _mm256_loadu_ps(s[i] + 8 * t8);
            mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sv, iq_lanes_in(8 * t8, a, b)));
        }
        const float smax = iq_hmax_avx2(mx);
        __m256 e_sum = _mm256_setzero_ps();
        for (int32_t t8 = 2 * tau0; t8 < 2 * tau1; t8++) {
            const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s[i] + 8 * t8), _mm256_set1_ps(smax));
            const __m256 e = _mm256_and_ps(iq_lanes_in(8 * t8, a, b), iq_exp_avx2(x));
            e_sum = _mm256_add_ps(e_sum, e);
            const __m256i p = _mm256_cvttps_epi32(_mm256_fmadd_ps(e, _mm256_set1_ps(255.0f), _mm256_set1_ps(0.5f)));
            const __m128i p16 = _mm_packus_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
            _mm_storel_epi64((__m128i *) (p8[i] + 8 * t8), _mm_packus_epi16(p16, p16));
        }
        const float es = iq_hsum_avx2(e_sum);
        float * sti = st + (size_t) i * IQ_ATTN_STATE(dim);
        const float w = iq_innerq_state_raise(sti, dim, smax);
        sti[1] += w * es;
        wd[i] = w / 255.0f;
        we[i] = w * es;
    }
    const int32_t kq0 = a / 4, kq1 = (b + 3) / 4;
#define IQ_VALUES(bits, r) iq_values_avx2(vb, dv, dv + dim, dim, g, kq0, kq1, p8, wd, we, h0, st, bits, r)
    for (int32_t h0 = 0; h0 < q->r; h0 += 4) {
        IQ_INNERQ_DISPATCH(IQ_VALUES, cfg->bits_v, q->r - h0);
    }
#undef IQ_VALUES
}

const struct iq_innerq_kernels iq_innerq_kernels_avx2 = {
    "avx2", iq_rows_f16_avx2, iq_rows_f32_avx2, iq_block_avx2,
};
