// AVX-512 InnerQ kernels (F/BW/VL/DQ; vpdpbusd where the CPU has VNNI). The arithmetic is
// described in qcache.h and specified by the scalar kernels in qcache.c.
#include "x86-kernels.h"
#include "qcache-block.h"
#include "vec.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

IQ_INNERQ_INLINE __m512 iq_exp_avx512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(IQ_EXP_MIN));
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(IQ_EXP_LOG2E), _mm512_set1_ps(IQ_ROUND_SHIFT)),
                                   _mm512_set1_ps(IQ_ROUND_SHIFT));
    const __m512 f = _mm512_fmsub_ps(x, _mm512_set1_ps(IQ_EXP_LOG2E), n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(IQ_EXP_C4), f, _mm512_set1_ps(IQ_EXP_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(IQ_EXP_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(IQ_EXP_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);  // p 2^n, exact as the other ISAs' exponent-field product
}

// ---- rows (f16 windows, f32 batch rows): the plain types' vector kernels ----

static void iq_rows_f16_avx512(const void * k, const void * v, size_t ld, int32_t n, const struct iq_innerq_query * q,
                               float * st) {
    iq_innerq_rows_vec(&iq_vec_fns_avx512, k, v, ld, n, true, q, st);
}

static void iq_rows_f32_avx512(const void * k, const void * v, size_t ld, int32_t n, const struct iq_innerq_query * q,
                               float * st) {
    iq_innerq_rows_vec(&iq_vec_fns_avx512, k, v, ld, n, false, q, st);
}

// ---- blocks: softmax ----

// The lanes of token tile tau (tokens 16 tau .. 16 tau + 15) that fall in [a, b).
IQ_INNERQ_INLINE __mmask16 iq_lanes_in(int32_t tau, int32_t a, int32_t b) {
    const int32_t lo = a - 16 * tau > 0 ? a - 16 * tau : 0, hi = b - 16 * tau < 16 ? b - 16 * tau : 16;
    return (__mmask16) (((1u << hi) - 1) & ~((1u << lo) - 1));
}

// One head's softmax over tokens [a, b) of the token tiles [tau0, tau1) of a block: e = exp(s -
// max s) there, 0 elsewhere in the tiles (e may be s). Raises the state's running max to max s,
// adds w * sum e to its l and returns w = exp(max s - running max); *e_sum = sum e.
IQ_INNERQ_INLINE float iq_softmax_avx512(const float * s, int32_t a, int32_t b, int32_t tau0, int32_t tau1, float * e,
                                         float * sti, int32_t dim, float * e_sum) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int32_t tau = tau0; tau < tau1; tau++) {
        mx = _mm512_mask_max_ps(mx, iq_lanes_in(tau, a, b), mx, _mm512_loadu_ps(s + 16 * tau));
    }
    const float smax = _mm512_reduce_max_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int32_t tau = tau0; tau < tau1; tau++) {
        const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s + 16 * tau), _mm512_set1_ps(smax));
        const __m512 ev = _mm512_maskz_mov_ps(iq_lanes_in(tau, a, b), iq_exp_avx512(x));
        sum = _mm512_add_ps(sum, ev);
        _mm512_storeu_ps(e + 16 * tau, ev);
    }
    *e_sum = _mm512_reduce_add_ps(sum);
    const float w = iq_softmax_raise(sti, dim, smax);
    sti[1] += w * *e_sum;
    return w;
}

// {max a[0], .., max a[3]} (max) or {sum a[0], .., sum a[3]}: one transpose tree for four vectors.
IQ_INNERQ_INLINE __m128 iq_reduce4_avx512(const __m512 * a, const bool max) {
#define IQ_OP(w, x, y) (max ? _mm##w##_max_ps(x, y) : _mm##w##_add_ps(x, y))
    const __m512 x01 = IQ_OP(512, _mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const __m512 x23 = IQ_OP(512, _mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    const __m512 y = IQ_OP(512, _mm512_shuffle_ps(x01, x23, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(x01, x23, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = IQ_OP(256, _mm512_castps512_ps256(y), _mm512_extractf32x8_ps(y, 1));
    return IQ_OP(, _mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
#undef IQ_OP
}

// The p8 bytes of four token tiles of e in [0, 1]: floor(255 e + 0.5) packed with saturation
// (exact: the values are 0..255), then the dwords put back in token order.
IQ_INNERQ_INLINE void iq_p8_store4_avx512(const __m512 * e, uint8_t * p8) {
    __m512i p[4];
    #pragma GCC unroll 4
    for (int t = 0; t < 4; t++) {
        p[t] = _mm512_cvttps_epi32(_mm512_fmadd_ps(e[t], _mm512_set1_ps(IQ_P8_MAX), _mm512_set1_ps(0.5f)));
    }
    // per 128-bit lane L: bytes of tiles 0..3, four tokens 4L..4L+3 each
    const __m512i x = _mm512_packus_epi16(_mm512_packus_epi32(p[0], p[1]), _mm512_packus_epi32(p[2], p[3]));
    const __m512i idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    _mm512_storeu_si512(p8, _mm512_permutexvar_epi32(idx, x));
}

// The softmax of the r heads over tokens [a, b) of a block's token tiles [tau0, tau1), heads
// four at a time so that each reduction tree serves four: p8 = floor(255 e + 0.5) with
// e = exp(s - max s) (0 outside [a, b)); raises each state's running max, adds w E to its l
// and sets wd = w / 255, we = w E (w = exp(max s - running max), E = sum e). A whole 64-token
// block (full: tiles 0..3, every lane) needs no lane masks and packs its p8 four tiles at once.
IQ_INNERQ_INLINE void iq_block_softmax_avx512(const float (*s)[IQ_QGROUP_MAX], int32_t r, int32_t a, int32_t b,
                                              int32_t tau0, int32_t tau1, float * st, int32_t dim,
                                              uint8_t (*p8)[IQ_QGROUP_MAX], float * wd, float * we, const bool full) {
    for (int32_t h0 = 0; h0 < r; h0 += 4) {
        const int n = r - h0 < 4 ? r - h0 : 4;
        __m512 v[4];
        _Alignas(16) float mx[4], es[4];
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            v[i] = _mm512_set1_ps(-INFINITY);
            for (int32_t tau = tau0; i < n && tau < tau1; tau++) {
                const __mmask16 in = full ? (__mmask16) 0xffff : iq_lanes_in(tau, a, b);
                v[i] = _mm512_mask_max_ps(v[i], in, v[i], _mm512_loadu_ps(s[h0 + i] + 16 * tau));
            }
        }
        _mm_store_ps(mx, iq_reduce4_avx512(v, true));
        #pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            __m512 e[IQ_QGROUP_MAX / 16];
            v[i] = _mm512_setzero_ps();
            for (int32_t tau = tau0; i < n && tau < tau1; tau++) {
                const __mmask16 in = full ? (__mmask16) 0xffff : iq_lanes_in(tau, a, b);
                const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s[h0 + i] + 16 * tau), _mm512_set1_ps(mx[i]));
                e[tau] = _mm512_maskz_mov_ps(in, iq_exp_avx512(x));
                v[i] = _mm512_add_ps(v[i], e[tau]);
                if (!full) {
                    const __m512i p = _mm512_cvttps_epi32(
                        _mm512_fmadd_ps(e[tau], _mm512_set1_ps(IQ_P8_MAX), _mm512_set1_ps(0.5f)));
                    _mm_storeu_si128((__m128i *) (p8[h0 + i] + 16 * tau), _mm512_cvtepi32_epi8(p));
                }
            }
            if (full && i < n) {
                iq_p8_store4_avx512(e, p8[h0 + i]);
            }
        }
        _mm_store_ps(es, iq_reduce4_avx512(v, false));
        for (int i = 0; i < n; i++) {
            float * sti = st + (size_t) (h0 + i) * IQ_ATTN_STATE(dim);
            const float w = iq_softmax_raise(sti, dim, mx[i]);
            sti[1] += w * es[i];
            wd[h0 + i] = w / IQ_P8_MAX;
            we[h0 + i] = w * es[i];
        }
    }
}

// ---- InnerQ blocks ----

// The extensions a kernel instance may use (constants, so each instance is specialized).
#define IQ_AVX512_VNNI 1  // vpdpbusd
#define IQ_AVX512_GFNI 2  // vgf2p8affineqb

// The 2-bit plane of a tile: byte p = bits 2j, 2j+1 of byte p mod 16, j = p / 16 (the
// 128-bit lane). With GFNI one affine byte transform per 64-bit lane moves those two bits
// down (the matrix's byte 7 - i selects output bit i), in place of a shift and a mask. The
// instruction is written out in asm: the file is built without -mgfni, so that the compiler
// never emits GFNI on its own where the CPU may lack it.
IQ_INNERQ_INLINE __m512i iq_plane2_avx512(__m512i x, const int ext) {
    if (ext & IQ_AVX512_GFNI) {
        const __m512i a = _mm512_set_epi64(0x4080000000000000ll, 0x4080000000000000ll, 0x1020000000000000ll,
                                           0x1020000000000000ll, 0x0408000000000000ll, 0x0408000000000000ll,
                                           0x0102000000000000ll, 0x0102000000000000ll);
        __m512i u;
        __asm__("vgf2p8affineqb $0, %2, %1, %0" : "=v"(u) : "v"(x), "v"(a));
        return u;
    }
    const __m512i sh = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
    return _mm512_and_si512(_mm512_srlv_epi32(x, sh), _mm512_set1_epi8(3));
}

// The 64 codes of a tile (layout in iq-qcache.h), one per byte: byte p = code p.
IQ_INNERQ_INLINE __m512i iq_tile_avx512(const uint8_t * t, const int bits, const int ext) {
    if (bits >= 4) {
        const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) t));
        __m512i v = _mm512_and_si512(_mm512_srlv_epi64(x, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0)),
                                     _mm512_set1_epi8(15));
        if (bits == 5) {
            uint64_t hi;  // bit p: bit 4 of code p
            memcpy(&hi, t + 32, sizeof(hi));
            __asm__("vpaddb %2, %0, %0%{%1%}" : "+v"(v) : "Yk"(_cvtu64_mask64(hi)), "v"(_mm512_set1_epi8(16)));
        }
        return v;
    }
    const __m512i u = iq_plane2_avx512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) t)), ext);
    if (bits == 2) {
        return u;
    }
    uint64_t hi;  // bit p: bit 2 of code p
    memcpy(&hi, t + 16, sizeof(hi));
    __m512i v = u;  // v += 4 where the bit is set, in place (the intrinsic costs GCC a register copy)
    __asm__("vpaddb %2, %0, %0%{%1%}" : "+v"(v) : "Yk"(_cvtu64_mask64(hi)), "v"(_mm512_set1_epi8(4)));
    return v;
}

// acc[lane] += sum of the 4 byte products a_u8 * b_s8 in that 32-bit lane.
IQ_INNERQ_INLINE __m512i iq_dot_avx512(__m512i acc, __m512i a, __m512i b, const int ext) {
    if (ext & IQ_AVX512_VNNI) {
        // in place: with the intrinsic GCC copies every accumulator in and out of each iteration
        __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
        return acc;
    }
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1)));
}

IQ_INNERQ_INLINE __m512i iq_bcast4(const void * p) {
    int32_t x;
    memcpy(&x, p, sizeof(x));
    return _mm512_set1_epi32(x);
}

// Scores of T token tiles tau .. tau+T-1 (lanes: 16 tokens; each code tile adds 4 channels)
// for heads h0 .. h0+R-1. Two tiles per pass share each q8 load and give 2R independent
// accumulator chains; a group's (d, m) for 16 tokens is one load each. lv: the codes are on the
// key levels, L[u] by a byte shuffle.
IQ_INNERQ_INLINE void iq_keys_pass_avx512(const uint8_t * kb, const iq_fp16_t * dk, const iq_fp16_t * mk,
                                          int32_t dim, int32_t g, int32_t tau, const struct iq_innerq_query * q,
                                          int32_t h0, float (*s)[IQ_QGROUP_MAX], const int bits, const int R,
                                          const int T, const bool lv, const int ext) {
    const size_t tb = 8 * bits, tile_row = (size_t) (dim / 4) * tb;  // one token tile's codes
    const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) iq_innerq_key_levels()));
    __m512 sc[2][4];
    #pragma GCC unroll 2
    for (int t = 0; t < T; t++) {
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            sc[t][i] = _mm512_setzero_ps();
        }
    }
    for (int32_t gi = 0; gi < dim / g; gi++) {
        __m512i is[2][4];
        #pragma GCC unroll 2
        for (int t = 0; t < T; t++) {
            #pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                is[t][i] = _mm512_setzero_si512();
            }
        }
        for (int32_t kq = gi * g / 4; kq < (gi + 1) * g / 4; kq++) {
            __m512i u[2];
            #pragma GCC unroll 2
            for (int t = 0; t < T; t++) {
                u[t] = iq_tile_avx512(kb + (tau + t) * tile_row + kq * tb, bits, ext);
                u[t] = lv ? _mm512_shuffle_epi8(levels, u[t]) : u[t];
            }
            #pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const __m512i qb = iq_bcast4(&q->q8[h0 + i][4 * kq]);
                #pragma GCC unroll 2
                for (int t = 0; t < T; t++) {
                    is[t][i] = iq_dot_avx512(is[t][i], u[t], qb, ext);
                }
            }
        }
        #pragma GCC unroll 2
        for (int t = 0; t < T; t++) {
            const size_t pi = (size_t) gi * g + 16 * (tau + t);
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (dk + pi)));
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (mk + pi)));
            #pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(is[t][i]), _mm512_set1_ps(q->sq[h0 + i][gi]));
                const __m512 dc = _mm512_fnmadd_ps(d, _mm512_set1_ps(q->q2[h0 + i][gi]), dot);  // score correction
                sc[t][i] = _mm512_fmadd_ps(d, dc, sc[t][i]);
                sc[t][i] = _mm512_fmadd_ps(m, _mm512_set1_ps(q->sumq[h0 + i][gi]), sc[t][i]);
            }
        }
    }
    #pragma GCC unroll 2
    for (int t = 0; t < T; t++) {
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            _mm512_storeu_ps(s[h0 + i] + 16 * (tau + t), sc[t][i]);
        }
    }
}

// Scores of token tiles [tau0, tau1), two at a time.
IQ_INNERQ_INLINE void iq_keys_avx512(const uint8_t * kb, const iq_fp16_t * dk, const iq_fp16_t * mk, int32_t dim,
                                     int32_t g, int32_t tau0, int32_t tau1, const struct iq_innerq_query * q,
                                     int32_t h0, float (*s)[IQ_QGROUP_MAX], const int bits, const int R,
                                     const bool lv, const int ext) {
    int32_t tau = tau0;
    for (; tau + 2 <= tau1; tau += 2) {
        iq_keys_pass_avx512(kb, dk, mk, dim, g, tau, q, h0, s, bits, R, 2, lv, ext);
    }
    if (tau < tau1) {
        iq_keys_pass_avx512(kb, dk, mk, dim, g, tau, q, h0, s, bits, R, 1, lv, ext);
    }
}

// acc += w (d/255 sum_t p8_t u_tc + m E) for T channel tiles sg .. sg+T-1 (lanes: 16 channels;
// each code tile adds 4 tokens) over token quads [kq0, kq1); two tiles per pass share each p8
// load. A channel's (d, m) is one load per block.
IQ_INNERQ_INLINE void iq_values_pass_avx512(const uint8_t * vb, const iq_fp16_t * dv, const iq_fp16_t * mv,
                                            int32_t dim, int32_t g, int32_t sg, int32_t kq0, int32_t kq1,
                                            const uint8_t (*p8)[IQ_QGROUP_MAX], const float * wd, const float * we,
                                            int32_t h0, float * st, const int bits, const int R, const int T,
                                            const int ext) {
    const size_t tb = 8 * bits, tile_row = (size_t) (g / 4) * tb;  // one channel tile's codes
    __m512i is[2][4];
    #pragma GCC unroll 2
    for (int t = 0; t < T; t++) {
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            is[t][i] = _mm512_setzero_si512();
        }
    }
    for (int32_t kq = kq0; kq < kq1; kq++) {
        __m512i u[2];
        #pragma GCC unroll 2
        for (int t = 0; t < T; t++) {
            u[t] = iq_tile_avx512(vb + (sg + t) * tile_row + kq * tb, bits, ext);
        }
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const __m512i pb = iq_bcast4(&p8[h0 + i][4 * kq]);
            #pragma GCC unroll 2
            for (int t = 0; t < T; t++) {
                is[t][i] = iq_dot_avx512(is[t][i], pb, u[t], ext);
            }
        }
    }
    #pragma GCC unroll 2
    for (int t = 0; t < T; t++) {
        const int32_t c0 = 16 * (sg + t);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (dv + c0)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (mv + c0)));
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            float * acc = st + (size_t) (h0 + i) * IQ_ATTN_STATE(dim) + 2 + c0;
            __m512 a = _mm512_fmadd_ps(m, _mm512_set1_ps(we[h0 + i]), _mm512_loadu_ps(acc));
            a = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(wd[h0 + i])), _mm512_cvtepi32_ps(is[t][i]), a);
            _mm512_storeu_ps(acc, a);
        }
    }
}

// acc updates of all channel tiles, two at a time.
IQ_INNERQ_INLINE void iq_values_avx512(const uint8_t * vb, const iq_fp16_t * dv, const iq_fp16_t * mv, int32_t dim,
                                       int32_t g, int32_t kq0, int32_t kq1, const uint8_t (*p8)[IQ_QGROUP_MAX],
                                       const float * wd, const float * we, int32_t h0, float * st, const int bits,
                                       const int R, const int ext) {
    int32_t sg = 0;
    for (; sg + 2 <= dim / 16; sg += 2) {
        iq_values_pass_avx512(vb, dv, mv, dim, g, sg, kq0, kq1, p8, wd, we, h0, st, bits, R, 2, ext);
    }
    if (sg < dim / 16) {
        iq_values_pass_avx512(vb, dv, mv, dim, g, sg, kq0, kq1, p8, wd, we, h0, st, bits, R, 1, ext);
    }
}

IQ_INNERQ_INLINE void iq_block_avx512(const struct iq_qcache * c, const struct iq_innerq_block blk, int32_t a,
                                      int32_t b, const struct iq_innerq_query * q, float * st, const int ext) {
    const struct iq_qcache_config * cfg = &c->cfg;
    const int32_t dim = c->head_dim, g = cfg->group;
    _Alignas(64) float s[IQ_INNERQ_MAX_R][IQ_QGROUP_MAX];
    _Alignas(64) uint8_t p8[IQ_INNERQ_MAX_R][IQ_QGROUP_MAX];
    float wd[IQ_INNERQ_MAX_R], we[IQ_INNERQ_MAX_R];
    const int32_t tau0 = a / 16, tau1 = (b + 15) / 16;
#define IQ_KEYS(bits, r) iq_keys_avx512(blk.k, blk.dk, blk.mk, dim, g, tau0, tau1, q, h0, s, bits, r, false, ext)
#define IQ_KEYS_LV(bits, r) iq_keys_avx512(blk.k, blk.dk, blk.mk, dim, g, tau0, tau1, q, h0, s, bits, r, true, ext)
    for (int32_t h0 = 0; h0 < q->r; h0 += 4) {
        IQ_INNERQ_DISPATCH_KEYS(IQ_KEYS, IQ_KEYS_LV, cfg->bits_k, blk.lk != NULL, q->r - h0);
    }
#undef IQ_KEYS_LV
#undef IQ_KEYS
    const float (*sc)[IQ_QGROUP_MAX] = (const float (*)[IQ_QGROUP_MAX]) s;
    if (blk.vs != NULL) {  // value row scales: the portable weights (qcache-block.h)
        float ns[IQ_QGROUP_MAX];
        iq_innerq_row_scales(blk.vs, a, b, 0, ns);
        for (int32_t i = 0; i < q->r; i++) {
            memset(p8[i] + 16 * tau0, 0, (size_t) 16 * (tau1 - tau0));
            iq_innerq_block_weights(s[i], a, b, 0, ns, st + (size_t) i * IQ_ATTN_STATE(dim), dim, p8[i], &wd[i],
                                    &we[i]);
        }
    } else if (a == 0 && b == 64) {  // four whole tiles
        iq_block_softmax_avx512(sc, q->r, 0, 64, 0, 4, st, dim, p8, wd, we, true);
    } else {
        iq_block_softmax_avx512(sc, q->r, a, b, tau0, tau1, st, dim, p8, wd, we, false);
    }
    const int32_t kq0 = a / 4, kq1 = (b + 3) / 4;
#define IQ_VALUES(bits, r) iq_values_avx512(blk.v, blk.dv, blk.mv, dim, g, kq0, kq1, p8, wd, we, h0, st, bits, r, ext)
    for (int32_t h0 = 0; h0 < q->r; h0 += 4) {
        IQ_INNERQ_DISPATCH(IQ_VALUES, cfg->bits_v, q->r - h0);
    }
#undef IQ_VALUES
}

// ---- KIVI blocks ----

// acc[i] += f * mul[i][m] for heads i < R.
IQ_INNERQ_INLINE void iq_kivi_fma_avx512(__m512 f, const float (*mul)[IQ_INNERQ_KIVI_MUL], size_t m, __m512 * acc,
                                         const int R) {
    #pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        acc[i] = _mm512_fmadd_ps(f, _mm512_loadu_ps(mul[i] + m), acc[i]);
    }
}

// A KIVI tile reduces along its 16 lanes (key channels, value tokens) and holds 4 outputs in
// each 32-bit word (key tokens, value channels), so its codes become floats, 16 at a time:
// chunk s, codes 16 s .. 16 s + 15, holds the 4 subs of lanes 4 s .. 4 s + 3 and meets the
// multipliers mul[i][mo + 16 s ..].
IQ_INNERQ_INLINE void iq_kivi_tile_avx512(const uint8_t * t, const float (*mul)[IQ_INNERQ_KIVI_MUL], size_t mo,
                                          __m512 * acc, const int bits, const int R) {
    if (bits == 4) {
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {  // byte 16 h + l: code 16 h + l (low nibble), 32 + 16 h + l (high)
            const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (t + 16 * h)));
            iq_kivi_fma_avx512(_mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(15))), mul, mo + 16 * h, acc,
                               R);
            iq_kivi_fma_avx512(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4)), mul, mo + 16 * h + 32, acc, R);
        }
        return;
    }
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) t));
    #pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {  // 2-bit plane s
        __m512i u = _mm512_srli_epi32(x, 2 * s);
        u = s < 3 ? _mm512_and_si512(u, _mm512_set1_epi32(3)) : u;  // x holds zero-extended bytes
        if (bits == 3) {
            uint16_t hi;  // bit 2 of these 16 codes
            memcpy(&hi, t + 16 + 2 * s, sizeof(hi));
            u = _mm512_mask_or_epi32(u, _cvtu32_mask16(hi), u, _mm512_set1_epi32(4));
        }
        iq_kivi_fma_avx512(_mm512_cvtepi32_ps(u), mul, mo + 16 * s, acc, R);
    }
}

// dst[4 l + k] = x[l] for the 16 lanes l of x and k = 0..3 (IQ_INNERQ_KIVI_MUL).
IQ_INNERQ_INLINE void iq_kivi_x4_avx512(__m512 x, float * dst) {
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    #pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {
        _mm512_storeu_ps(dst + 16 * s, _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(4 * s)), x));
    }
}

// {the sum of the four 128-bit lanes of a[0], .., of a[3]}.
IQ_INNERQ_INLINE __m512 iq_kivi_sum4_avx512(const __m512 * a) {
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(a[0], a[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(a[2], a[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// out[i][4 q + k] = sum over n rows and the 16 lanes l of tile q of the row (tiles q = 0..3 at
// tiles + row * stride + q * 8 * bits) of mul[i][mo + 64 row + 4 l + k] * code(l, k), for heads
// i < R. The accumulator of a tile and head sums chunk by chunk: its 128-bit lane j holds lanes
// l = j mod 4, so the 4 outputs are the sum of its 128-bit lanes.
IQ_INNERQ_INLINE void iq_kivi_quad_avx512(const uint8_t * tiles, size_t stride, int32_t n,
                                          const float (*mul)[IQ_INNERQ_KIVI_MUL], size_t mo, __m512 * out,
                                          const int bits, const int R) {
    const size_t tb = 8 * bits;
    __m512 acc[4][4];
    #pragma GCC unroll 4
    for (int q = 0; q < 4; q++) {
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            acc[q][i] = _mm512_setzero_ps();
        }
    }
    for (int32_t row = 0; row < n; row++) {
        #pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            iq_kivi_tile_avx512(tiles + row * stride + q * tb, mul, mo + 64 * row, acc[q], bits, R);
        }
    }
    #pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        const __m512 a[4] = {acc[0][i], acc[1][i], acc[2][i], acc[3][i]};
        out[i] = iq_kivi_sum4_avx512(a);
    }
}

// Scores of token tiles [tau0, tau1) for heads h0 .. h0+R-1: q' (x4) and C per head, then per
// 16 tokens (4 tiles, consecutive in memory) the rows of 16 channels.
IQ_INNERQ_INLINE void iq_kivi_keys_avx512(const uint8_t * kb, const iq_fp16_t * dk, const iq_fp16_t * mk,
                                          const float * norm, int32_t dim, int32_t g, int32_t tau0, int32_t tau1,
                                          const struct iq_innerq_query * q, int32_t h0, float (*s)[IQ_QGROUP_MAX],
                                          const int bits, const int R) {
    _Alignas(64) float mul[4][IQ_INNERQ_KIVI_MUL];
    __m512 base[4];
    #pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        base[i] = _mm512_setzero_ps();
    }
    for (int32_t c16 = 0; c16 < dim / 16; c16++) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (dk + 16 * c16)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (mk + 16 * c16)));
        const __m512 n = _mm512_loadu_ps(norm + 16 * c16);
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            const __m512 qn = _mm512_mul_ps(_mm512_loadu_ps(q->qs + (h0 + i) * dim + 16 * c16), n);
            iq_kivi_x4_avx512(_mm512_mul_ps(qn, d), mul[i] + 64 * c16);
            base[i] = _mm512_fmadd_ps(qn, m, base[i]);
        }
    }
    float cst[4];
    #pragma GCC unroll 4
    for (int i = 0; i < R; i++) {
        cst[i] = _mm512_reduce_add_ps(base[i]);
    }
    const size_t tb = 8 * bits;
    for (int32_t tau = tau0; tau < tau1; tau++) {
        __m512 out[4];
        iq_kivi_quad_avx512(kb + 4 * tau * tb, (size_t) (g / 4) * tb, dim / 16, mul, 0, out, bits, R);
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            _mm512_storeu_ps(s[h0 + i] + 16 * tau, _mm512_add_ps(out[i], _mm512_set1_ps(cst[i])));
        }
    }
}

// acc += M + sum_t W u over token tiles [tau0, tau1) for heads h0 .. h0+R-1, from e and w: W
// (x4) and M per head and value group, then per 16 channels (4 tiles, consecutive in memory)
// the rows of 16 tokens.
IQ_INNERQ_INLINE void iq_kivi_values_avx512(const uint8_t * vb, const iq_fp16_t * dv, const iq_fp16_t * mv,
                                            int32_t dim, int32_t g, int32_t tau0, int32_t tau1,
                                            const float (*e)[IQ_QGROUP_MAX], const float * w, int32_t h0, float * st,
                                            const int bits, const int R) {
    _Alignas(64) float mul[4][IQ_INNERQ_KIVI_MUL];
    float mg[4][IQ_QCACHE_MAX_GROUPS];
    for (int32_t gi = 0; gi < dim / g; gi++) {
        __m512 msum[4];
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            msum[i] = _mm512_setzero_ps();
        }
        for (int32_t tau = tau0; tau < tau1; tau++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (dv + gi * g + 16 * tau)));
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (mv + gi * g + 16 * tau)));
            #pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(e[h0 + i] + 16 * tau), _mm512_set1_ps(w[h0 + i]));
                iq_kivi_x4_avx512(_mm512_mul_ps(p, d), mul[i] + 4 * gi * g + 64 * tau);
                msum[i] = _mm512_fmadd_ps(p, m, msum[i]);
            }
        }
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            mg[i][gi] = _mm512_reduce_add_ps(msum[i]);
        }
    }
    const size_t tb = 8 * bits, row = (size_t) (dim / 4) * tb;
    for (int32_t c16 = 0; c16 < dim / 16; c16++) {
        const int32_t gi = 16 * c16 / g;
        __m512 out[4];
        iq_kivi_quad_avx512(vb + tau0 * row + 4 * c16 * tb, row, tau1 - tau0, mul, (size_t) (4 * gi * g + 64 * tau0),
                            out, bits, R);
        #pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            float * acc = st + (size_t) (h0 + i) * IQ_ATTN_STATE(dim) + 2 + 16 * c16;
            _mm512_storeu_ps(acc, _mm512_add_ps(_mm512_loadu_ps(acc), _mm512_add_ps(out[i], _mm512_set1_ps(mg[i][gi]))));
        }
    }
}

static void iq_kivi_block_avx512(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                                 const struct iq_innerq_query * q, float * st) {
    const struct iq_qcache_config * cfg = &c->cfg;
    const int32_t dim = c->head_dim, g = cfg->group;
    const struct iq_innerq_block blk = iq_innerq_block_get(c, h, j);
    const float * norm = iq_qcache_norm(c, h);
    _Alignas(64) float s[IQ_INNERQ_MAX_R][IQ_QGROUP_MAX];
    float w[IQ_INNERQ_MAX_R];
    const int32_t tau0 = a / 16, tau1 = (b + 15) / 16;
#define IQ_KEYS(bits, r) iq_kivi_keys_avx512(blk.k, blk.dk, blk.mk, norm, dim, g, tau0, tau1, q, h0, s, bits, r)
    for (int32_t h0 = 0; h0 < q->r; h0 += 4) {
        IQ_KIVI_DISPATCH(IQ_KEYS, cfg->bits_k, q->r - h0);
    }
#undef IQ_KEYS
    for (int32_t i = 0; i < q->r; i++) {
        float es;
        w[i] = iq_softmax_avx512(s[i], a, b, tau0, tau1, s[i], st + (size_t) i * IQ_ATTN_STATE(dim), dim, &es);
    }
#define IQ_VALUES(bits, r) iq_kivi_values_avx512(blk.v, blk.dv, blk.mv, dim, g, tau0, tau1, s, w, h0, st, bits, r)
    for (int32_t h0 = 0; h0 < q->r; h0 += 4) {
        IQ_KIVI_DISPATCH(IQ_VALUES, cfg->bits_v, q->r - h0);
    }
#undef IQ_VALUES
}

static void iq_block_avx512_bw(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                               const struct iq_innerq_query * q, float * st) {
    iq_block_avx512(c, iq_innerq_block_get(c, h, j), a, b, q, st, 0);
}

static void iq_block_p8_avx512_bw(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                                  const struct iq_innerq_query * q, float * st) {
    iq_block_avx512(c, iq_innerq_block_get_p8(c, h, j, iq_p8_decode_avx2), a, b, q, st, 0);
}

static void iq_block_avx512_vnni(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                                 const struct iq_innerq_query * q, float * st) {
    iq_block_avx512(c, iq_innerq_block_get(c, h, j), a, b, q, st, IQ_AVX512_VNNI);
}

static void iq_block_p8_avx512_vnni(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                                    const struct iq_innerq_query * q, float * st) {
    iq_block_avx512(c, iq_innerq_block_get_p8(c, h, j, iq_p8_decode_avx2), a, b, q, st, IQ_AVX512_VNNI);
}

static void iq_block_avx512_vnni_gfni(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                                      const struct iq_innerq_query * q, float * st) {
    iq_block_avx512(c, iq_innerq_block_get(c, h, j), a, b, q, st, IQ_AVX512_VNNI | IQ_AVX512_GFNI);
}

static void iq_block_p8_avx512_vnni_gfni(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                                         const struct iq_innerq_query * q, float * st) {
    iq_block_avx512(c, iq_innerq_block_get_p8(c, h, j, iq_p8_decode_avx2), a, b, q, st,
                    IQ_AVX512_VNNI | IQ_AVX512_GFNI);
}

const struct iq_innerq_kernels iq_innerq_kernels_avx512 = {
    "avx512", iq_rows_f16_avx512, iq_rows_f32_avx512, iq_block_avx512_bw, iq_block_p8_avx512_bw,
    iq_kivi_block_avx512,
};

const struct iq_innerq_kernels iq_innerq_kernels_avx512_vnni = {
    "avx512_vnni", iq_rows_f16_avx512, iq_rows_f32_avx512, iq_block_avx512_vnni, iq_block_p8_avx512_vnni,
    iq_kivi_block_avx512,
};

const struct iq_innerq_kernels iq_innerq_kernels_avx512_vnni_gfni = {
    "avx512_vnni_gfni", iq_rows_f16_avx512, iq_rows_f32_avx512, iq_block_avx512_vnni_gfni,
    iq_block_p8_avx512_vnni_gfni, iq_kivi_block_avx512,
};
