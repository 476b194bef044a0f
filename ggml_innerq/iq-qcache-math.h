// The InnerQ arithmetic every device must agree on, written once for the C compiler and for
// nvcc (docs/DESIGN.md section 6): fp16 conversion, the rounding constants and the exp of the
// kernels, the block format's accessors, the group quantizer (docs/DESIGN.md 3.1), query preparation
// and the online-softmax state. The scalar C path calls these functions, so a CUDA kernel
// built on them can be tested bit for bit (quantizer) or to float rounding (attention)
// against the scalar reference.
//
// Every function is static inline and IQ_HD (host and device under nvcc); nothing here calls
// a C library function that device code lacks: only the math functions CUDA provides for
// device code (fabsf, fmaf, expf, fabs), and bit casts written per compiler.
#pragma once

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#if !defined(__CUDA_ARCH__)
#include <string.h>
#endif

#if defined(__CUDACC__)
#define IQ_HD __host__ __device__
#else
#define IQ_HD
#endif

typedef uint16_t iq_fp16_t;

// ---- bit casts and fp16 (IEEE binary16, round to nearest even, as ggml's) ----

static inline IQ_HD uint32_t iq_f32_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
#endif
}

static inline IQ_HD float iq_f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
#endif
}

static inline IQ_HD float iq_half_to_float(iq_fp16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1f;
    const uint32_t mant = h & 0x3ff;
    if (exp == 0x1f) {
        return iq_f32_from_bits(sign | 0x7f800000 | (mant << 13));
    }
    if (exp == 0) {
        // Subnormal (or zero): mant * 2^-24 is exact in f32.
        const float v = (float) mant * 5.9604644775390625e-8f;
        return iq_f32_from_bits(sign | iq_f32_bits(v));
    }
    return iq_f32_from_bits(sign | ((exp + 112) << 23) | (mant << 13));
}

static inline IQ_HD iq_fp16_t iq_float_to_half(float f) {
    const uint32_t x = iq_f32_bits(f);
    const uint16_t sign = (uint16_t) ((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffff;
    if (ax > 0x7f800000) {  // NaN: keep it quiet and keep the top payload bits
        return (iq_fp16_t) (sign | 0x7e00 | (uint16_t) ((ax >> 13) & 0x3ff));
    }
    if (ax >= 0x477ff000) {  // >= 65520 rounds (to even) past the largest finite fp16
        return (iq_fp16_t) (sign | 0x7c00);
    }
    if (ax < 0x38800000) {
        // Below the smallest normal: adding 0.5 puts the fp16 subnormal step (2^-24) at the
        // last mantissa bit, so the FPU rounds to nearest even for us.
        const float t = iq_f32_from_bits(ax) + 0.5f;
        return (iq_fp16_t) (sign | (uint16_t) (iq_f32_bits(t) - iq_f32_bits(0.5f)));
    }
    // Normal: rebias the exponent and round the 13 dropped bits to nearest even; a carry out
    // of the mantissa correctly bumps the exponent.
    const uint32_t odd = (ax >> 13) & 1;
    return (iq_fp16_t) (sign | (uint16_t) ((ax - 0x38000000 + 0xfff + odd) >> 13));
}

// ---- rounding constants and the kernels' exp ----

// exp(x) for x <= 0 (below -87 it gives exp(-87) ~ 1.6e-38), the same operations on every
// device and ISA so that the u8 probabilities agree bit for bit: n = round(x log2 e),
// f = x log2 e - n (one fma each), 2^f by a degree-4 polynomial on [-1/2, 1/2] (a near-minimax
// fit, relative error 3e-6: p8 has 8 bits, E and l far more than enough), times 2^n (exact).
#define IQ_EXP_MIN (-87.0f)
#define IQ_EXP_LOG2E 1.44269504088896341f
#define IQ_ROUND_SHIFT 12582912.0f  // 1.5 * 2^23: x + it - it rounds x to the nearest integer (|x| < 2^22)
#define IQ_EXP_C1 0.69312418f
#define IQ_EXP_C2 0.24024099f
#define IQ_EXP_C3 0.055906434f
#define IQ_EXP_C4 0.0095828483f
// The largest int8 of a prepared query, and the u8 scale of the probabilities of a block.
#define IQ_Q8_MAX 127.0f
#define IQ_P8_MAX 255.0f

static inline IQ_HD float iq_exp_poly(float x) {
    x = x > IQ_EXP_MIN ? x : IQ_EXP_MIN;
    const float nr = fmaf(x, IQ_EXP_LOG2E, IQ_ROUND_SHIFT);
    const float n = nr - IQ_ROUND_SHIFT;
    const float f = fmaf(x, IQ_EXP_LOG2E, -n);
    const float p = fmaf(fmaf(fmaf(fmaf(IQ_EXP_C4, f, IQ_EXP_C3), f, IQ_EXP_C2), f, IQ_EXP_C1), f, 1.0f);
    // 2^n: n sits in the low bits of nr = n + 1.5 * 2^23
    return p * iq_f32_from_bits((iq_f32_bits(nr) + 127u) << 23);
}

// x to the nearest integer, ties to even, without a libm call (|x| < 2^22).
static inline IQ_HD float iq_round_even(float x) { return (x + IQ_ROUND_SHIFT) - IQ_ROUND_SHIFT; }

// The u8 weight of a probability e in [0, 1] (floor(255 e + 1/2)); NaN (from a cache holding
// inf or NaN) weighs 0, since converting it to an integer is undefined.
static inline IQ_HD uint8_t iq_p8(float e) {
    return (uint8_t) (int32_t) fmaf(e >= 0.0f ? e : 0.0f, IQ_P8_MAX, 0.5f);
}

// ---- block format (the layout comment of iq-qcache.h) ----

#define IQ_QTILE 64  // codes per tile

// Bytes of a block of G tokens x D channels: the codes, then d[D] and m[D] (fp16).
static inline IQ_HD size_t iq_qblock_bytes(int32_t bits, int32_t head_dim, int32_t group) {
    return (size_t) head_dim * group * bits / 8 + 2 * sizeof(iq_fp16_t) * (size_t) head_dim;
}

// Byte offset of a block's d[D] (m[D] follows): after its codes.
static inline IQ_HD size_t iq_qblock_params_offset(int32_t bits, int32_t head_dim, int32_t group) {
    return (size_t) head_dim * group * bits / 8;
}

// ---- value row scales (iq_qcache_config.value_scales) ----
// A block of InnerQ values may carry, after its d[D] and m[D], one byte per token: the row's
// scale n_t = 2^((s_t - 128) / 8), s_t its RMS to the nearest eighth of an octave (codes 0 .. 255:
// 2^-16 .. 2^15.875; 0 also for a row of zeros). The row is divided by n_t before its channels are
// quantized along the block's tokens, so that one large row does not set the step of the other
// G - 1; attention weighs token t's probability by n_t (o = sum_t p_t n_t (d u_t + m), exact).

// Bytes of a block with its row scales (values of a cache with value_scales) or without.
static inline IQ_HD size_t iq_qblock_bytes_with(int32_t bits, int32_t head_dim, int32_t group, bool row_scales) {
    return iq_qblock_bytes(bits, head_dim, group) + (row_scales ? (size_t) group : 0);
}

// A block's options (iq_qblock_quantize's fmt): its value row scales, its group parameters in 8
// bits (below, "8-bit group parameters"), its codes on the key levels (below, "key levels").
#define IQ_QBLOCK_ROW_SCALES 1u
#define IQ_QBLOCK_P8 2u
#define IQ_QBLOCK_LEVELS 4u  // 3-bit codes on the key levels (below, "key levels")
#define IQ_P8_REFS 8  // bytes of a block's fp16 references with 8-bit parameters (dref, mlo, mhi, pad)

// Bytes of a block's group parameters: d[D] and m[D] in fp16, or the references and dc[D], mc[D].
static inline IQ_HD size_t iq_qblock_params_bytes(int32_t head_dim, unsigned fmt) {
    return (fmt & IQ_QBLOCK_P8) ? IQ_P8_REFS + 2 * (size_t) head_dim : 2 * sizeof(iq_fp16_t) * (size_t) head_dim;
}
// Byte offset of a block's row scale codes: after its codes and parameters.
static inline IQ_HD size_t iq_qblock_scales_offset(int32_t bits, int32_t head_dim, int32_t group, unsigned fmt) {
    return iq_qblock_params_offset(bits, head_dim, group) + iq_qblock_params_bytes(head_dim, fmt);
}
// Bytes of a block of format fmt.
static inline IQ_HD size_t iq_qblock_bytes_fmt(int32_t bits, int32_t head_dim, int32_t group, unsigned fmt) {
    return iq_qblock_scales_offset(bits, head_dim, group, fmt) + ((fmt & IQ_QBLOCK_ROW_SCALES) ? (size_t) group : 0);
}

// Code p (0..63) of a packed tile of b-bit codes.
static inline IQ_HD uint8_t iq_qtile_code(const uint8_t * tile, int32_t bits, int p) {
    if (bits >= 4) {
        const uint8_t u = (tile[p % 32] >> (4 * (p / 32))) & 15;
        return bits == 4 ? u : (uint8_t) (u | ((tile[32 + p / 8] >> (p % 8)) & 1) << 4);
    }
    uint8_t u = (tile[p % 16] >> (2 * (p / 16))) & 3;
    if (bits == 3) {
        u |= (uint8_t) (((tile[16 + p / 8] >> (p % 8)) & 1) << 2);
    }
    return u;
}

// Packs 64 codes (tile order p = 0..63) into 8*bits bytes.
static inline IQ_HD void iq_qtile_pack_codes(const uint8_t * u, int32_t bits, uint8_t * dst) {
    // the low plane (4 bits for b >= 4, else 2), then b = 3, 5: the top bit's plane
    const int lo = bits >= 4 ? 4 : 2;
    if (lo == 4) {
        for (int p = 0; p < 32; p++) {
            dst[p] = (uint8_t) ((u[p] & 15) | (u[p + 32] & 15) << 4);
        }
    } else {
        for (int p = 0; p < 16; p++) {
            dst[p] = (uint8_t) ((u[p] & 3) | (u[p + 16] & 3) << 2 | (u[p + 32] & 3) << 4 | (u[p + 48] & 3) << 6);
        }
    }
    if (bits == 3 || bits == 5) {
        for (int j = 0; j < 8; j++) {
            uint8_t b = 0;
            for (int k = 0; k < 8; k++) {
                b |= (uint8_t) (((u[8 * j + k] >> lo) & 1) << k);
            }
            dst[8 * lo + j] = b;
        }
    }
}

// Token t and channel c of code p of tile ti of a block whose groups run along `by_channel`
// (true: InnerQ keys / KIVI values) or tokens: lane = ti / quads * 16 + p / 4,
// sub = ti % quads * 4 + p % 4.
static inline IQ_HD void iq_qtile_coords(bool by_channel, int32_t head_dim, int32_t group, int32_t ti, int p,
                                         int32_t * t, int32_t * c) {
    const int32_t quads = (by_channel ? head_dim : group) / 4;
    const int32_t lane = ti / quads * 16 + p / 4, sub = ti % quads * 4 + p % 4;
    *t = by_channel ? lane : sub;
    *c = by_channel ? sub : lane;
}

// The group holding token t, channel c of a block, i.e. the index of its d and m.
static inline IQ_HD int32_t iq_qblock_group_of(bool by_channel, int32_t group, int32_t t, int32_t c) {
    return by_channel ? c / group * group + t : c;
}

// ---- key levels (iq_qcache_config.key_levels) ----
// Rotated keys are close to Gaussian, and on Gaussian data Max's non-uniform levels leave less
// squared error than a uniform grid (at 3 bits 0.91x on groups of 64, both searched). A 3-bit
// block of format IQ_QBLOCK_LEVELS reads code u as d L[u] + m, L the levels below: Max's levels
// for N(0, 1) (+-0.2451, +-0.7560, +-1.3440, +-2.1520) times 10, to the nearest half, centred on
// 21.5. They are unsigned bytes, so the kernels' integer products take L[u] where they take u
// (43 x 127 per product: a pair of them stays within int16), and (d, m) keep their meaning and
// bytes. Other widths stay uniform (at 4 bits the levels measured no gain; docs/ACCURACY.md).
#define IQ_KEY_LEVELS { 0, 8, 14, 19, 24, 29, 35, 43 }
#define IQ_KEY_LEVELS_TOP 43  // L[7]

// Whether b-bit codes of a block of format fmt are on the key levels.
static inline IQ_HD bool iq_qblock_levels(int32_t bits, unsigned fmt) {
    return (fmt & IQ_QBLOCK_LEVELS) != 0 && bits == 3;
}

// L[u] of the key levels.
static inline IQ_HD uint8_t iq_key_level(uint8_t u) {
    const uint8_t lv[8] = IQ_KEY_LEVELS;
    return lv[u & 7];
}

// The value of code u on a grid: u (uniform) or L[u] (lv, the key levels).
static inline IQ_HD float iq_grid_level(bool lv, uint8_t u) { return lv ? (float) iq_key_level(u) : (float) u; }

// The symmetric grid's centre c (m = -c d): L/2 on the uniform grid (two's complement, so that
// zero is a level), the middle of the key levels (their table is symmetric about it).
static inline IQ_HD float iq_grid_centre(int32_t levels, bool lv) { return lv ? 21.5f : (float) (levels / 2); }

// The code of the key level nearest t (a tie: the upper), by the 7 midpoints (exact in float);
// NaN gives 0.
static inline IQ_HD uint8_t iq_key_level_code(float t) {
    const float mid[7] = { 4.0f, 11.0f, 16.5f, 21.5f, 26.5f, 32.0f, 39.0f };
    int32_t u = 0;
    for (int k = 0; k < 7; k++) {
        u += t >= mid[k];
    }
    return (uint8_t) u;
}

// ---- group quantizer (docs/DESIGN.md 3.1) ----

// v clamped to the integers [lo, hi] and rounded half away from zero (as C roundf), plus
// offset; NaN (from inputs beyond fp16 range) gives lo. After the clamp v - trunc(v) is exact.
static inline IQ_HD uint8_t iq_quant_code(float v, int32_t lo, int32_t hi, int32_t offset) {
    v = v > (float) hi ? (float) hi : v;
    v = v >= (float) lo ? v : (float) lo;
    const int32_t i = (int32_t) v;
    const float f = v - (float) i;
    return (uint8_t) (i + (f >= 0.5f) - (f <= -0.5f) + offset);
}

static inline IQ_HD void iq_quant_asym_group(const float * x, int32_t n, int32_t levels, uint8_t * u, iq_fp16_t * d,
                                             iq_fp16_t * m) {
    float lo = x[0], hi = x[0];
    for (int32_t i = 1; i < n; i++) {
        const float xi = x[i];
        lo = xi < lo ? xi : lo;
        hi = xi > hi ? xi : hi;
    }
    *d = iq_float_to_half((hi - lo) / (float) (levels - 1));
    *m = iq_float_to_half(lo);
    const float df = iq_half_to_float(*d), mf = iq_half_to_float(*m);
    for (int32_t i = 0; i < n; i++) {
        u[i] = df == 0.0f ? 0 : iq_quant_code((x[i] - mf) / df, 0, levels - 1, 0);
    }
}

// Two's complement grid: the element of largest magnitude a lands exactly on code 0 (s = -L/2).
static inline IQ_HD void iq_quant_sym_group(const float * x, int32_t n, int32_t levels, uint8_t * u, iq_fp16_t * d,
                                            iq_fp16_t * m) {
    float a = x[0];
    for (int32_t i = 1; i < n; i++) {
        const float xi = x[i];
        a = fabsf(xi) > fabsf(a) ? xi : a;
    }
    const int32_t half = levels / 2;
    *d = iq_float_to_half(-2.0f * a / (float) levels);
    const float df = iq_half_to_float(*d);
    *m = iq_float_to_half(-(float) half * df);  // exact: a power of two times an fp16
    for (int32_t i = 0; i < n; i++) {
        u[i] = df == 0.0f ? (uint8_t) half : iq_quant_code(x[i] / df, -half, half - 1, half);
    }
}

// The L1 reconstruction error sum |x - (d*u + m)|, in double, sequentially (the hybrid choice
// must not depend on how a device sums).
static inline IQ_HD double iq_quant_l1_error(const float * x, int32_t n, const uint8_t * u, iq_fp16_t d, iq_fp16_t m) {
    const double df = iq_half_to_float(d), mf = iq_half_to_float(m);
    double err = 0.0;
    for (int32_t i = 0; i < n; i++) {
        err += fabs((double) x[i] - (df * u[i] + mf));
    }
    return err;
}

// ---- the searched grid (mode 3, IQ_QUANT_SEARCH) ----
// Min-max puts the outermost levels on the group's extremes; at 2 and 3 bits that spends most
// of the range on a few values. The search tries IQ_QSEARCH_N ranges shrunk by the factors
// below, both grids (asymmetric and symmetric) for each, refits (d, m) to the chosen codes by
// least squares, requantizes, and keeps the candidate of least squared error (in double,
// sequentially, first candidate on a tie). The block format does not change: x ~ d*u + m.
// Products that are never fused into an fma with a following add (nvcc fuses by default; the
// host reference is built without FMA), so that every device rounds the search the same way.
static inline IQ_HD float iq_mulf(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
static inline IQ_HD double iq_muld(double a, double b) {
#if defined(__CUDA_ARCH__)
    return __dmul_rn(a, b);
#else
    return a * b;
#endif
}

#define IQ_QSEARCH_N 6
static inline IQ_HD float iq_qsearch_factor(int i) { return 1.0f - 0.08f * (float) i; }  // 1 .. 0.6

// Squared reconstruction error sum (x - (d*L[u] + m))^2 in double, sequentially (L: the grid's
// levels, iq_grid_level).
static inline IQ_HD double iq_quant_l2_error(const float * x, int32_t n, const uint8_t * u, bool lv, iq_fp16_t d,
                                             iq_fp16_t m) {
    const double df = iq_half_to_float(d), mf = iq_half_to_float(m);
    double err = 0.0;
    for (int32_t i = 0; i < n; i++) {
        const double e = (double) x[i] - (iq_muld(df, (double) iq_grid_level(lv, u[i])) + mf);
        err += iq_muld(e, e);
    }
    return err;
}

// Codes of x on the grid (d, m) (fp16 already): asymmetric u = round((x - m)/d) in [0, L-1],
// symmetric u = round(x/d) + L/2 in [0, L-1] (m = -(L/2) d); on the key levels (lv) the level
// nearest (x - m)/d, either grid.
static inline IQ_HD void iq_quant_codes(const float * x, int32_t n, int32_t levels, bool lv, bool sym, iq_fp16_t d,
                                        iq_fp16_t m, uint8_t * u) {
    const float df = iq_half_to_float(d), mf = iq_half_to_float(m);
    const int32_t half = levels / 2;
    for (int32_t i = 0; i < n; i++) {
        u[i] = df == 0.0f ? (uint8_t) (sym ? half : 0)
               : lv       ? iq_key_level_code((x[i] - mf) / df)
               : sym      ? iq_quant_code(x[i] / df, -half, half - 1, half)
                          : iq_quant_code((x[i] - mf) / df, 0, levels - 1, 0);
    }
}

// One candidate: the range shrunk by f, codes, a least-squares refit of (d, m) to them (d only
// for the symmetric grid, whose m is tied to d), codes again. Returns its squared error. The
// grid's levels run from 0 to top (L - 1, or the key levels' 43); the symmetric one puts the
// element of largest magnitude a on level 0 at f = 1, c below its centre c (m = -c d).
static inline IQ_HD double iq_quant_search_one(const float * x, int32_t n, int32_t levels, bool lv, bool sym,
                                               float lo, float hi, float a, float f, uint8_t * u, iq_fp16_t * d,
                                               iq_fp16_t * m) {
    const float centre = iq_grid_centre(levels, lv), top = lv ? (float) IQ_KEY_LEVELS_TOP : (float) (levels - 1);
    if (sym) {
        *d = iq_float_to_half(-2.0f * a * f / (2.0f * centre));
        *m = iq_float_to_half(-centre * iq_half_to_float(*d));
    } else {
        const float c = 0.5f * (lo + hi), r = iq_mulf(0.5f * (hi - lo), f);
        *d = iq_float_to_half(2.0f * r / top);
        *m = iq_float_to_half(c - r);
    }
    iq_quant_codes(x, n, levels, lv, sym, *d, *m, u);
    // least squares: x ~ d*s + m0 with s = L[u] - (sym ? c : 0), m0 = 0 for the symmetric grid
    double ss = 0.0, s1 = 0.0, sx = 0.0, x1 = 0.0;
    for (int32_t i = 0; i < n; i++) {
        const double si = (double) iq_grid_level(lv, u[i]) - (sym ? (double) centre : 0.0);
        ss += iq_muld(si, si);
        s1 += si;
        sx += iq_muld(si, (double) x[i]);
        x1 += x[i];
    }
    double dd, mm;
    if (sym) {
        dd = ss > 0.0 ? sx / ss : 0.0;
        mm = -(double) centre * dd;
    } else {
        const double det = iq_muld((double) n, ss) - iq_muld(s1, s1);
        dd = det > 0.0 ? (iq_muld((double) n, sx) - iq_muld(s1, x1)) / det : 0.0;
        mm = det > 0.0 ? (x1 - iq_muld(dd, s1)) / (double) n : 0.0;
    }
    const bool ok = sym ? dd * (double) iq_half_to_float(*d) > 0.0 : dd > 0.0;
    if (ok) {
        *d = iq_float_to_half((float) dd);
        *m = sym ? iq_float_to_half(-centre * iq_half_to_float(*d)) : iq_float_to_half((float) mm);
        iq_quant_codes(x, n, levels, lv, sym, *d, *m, u);
    }
    return iq_quant_l2_error(x, n, u, lv, *d, *m);
}

static inline IQ_HD void iq_quant_search_group(const float * x, int32_t n, int32_t levels, bool lv, uint8_t * u,
                                               iq_fp16_t * d, iq_fp16_t * m) {
    float lo = x[0], hi = x[0], a = x[0];
    for (int32_t i = 1; i < n; i++) {
        const float xi = x[i];
        lo = xi < lo ? xi : lo;
        hi = xi > hi ? xi : hi;
        a = fabsf(xi) > fabsf(a) ? xi : a;
    }
    double best = -1.0;
    for (int k = 0; k < 2 * IQ_QSEARCH_N; k++) {
        uint8_t uc[128];
        iq_fp16_t dc, mc;
        const double e =
            iq_quant_search_one(x, n, levels, lv, k % 2 == 1, lo, hi, a, iq_qsearch_factor(k / 2), uc, &dc, &mc);
        if (best < 0.0 || e < best) {
            best = e;
            *d = dc;
            *m = mc;
            for (int32_t i = 0; i < n; i++) {
                u[i] = uc[i];
            }
        }
    }
}

// The quantizer of iq_quant_group (iq-qcache.h: modes, rounding, ties); mode is an
// enum iq_quant_mode (0 hybrid, 1 asymmetric, 2 symmetric, 3 searched); n <= 128. lv: 3-bit
// codes on the key levels (the searched mode; the others, and other widths, stay uniform).
static inline IQ_HD void iq_quant_group_hd(const float * x, int32_t n, int32_t bits, int mode, bool lv, uint8_t * u,
                                           iq_fp16_t * d, iq_fp16_t * m) {
    const int32_t levels = 1 << bits;
    bool constant = true;
    for (int32_t i = 1; i < n && constant; i++) {
        constant = x[i] == x[0];
    }
    if (constant) {
        *d = 0;
        *m = iq_float_to_half(x[0]);
        for (int32_t i = 0; i < n; i++) {
            u[i] = 0;
        }
        return;
    }
    if (mode == 2) {
        iq_quant_sym_group(x, n, levels, u, d, m);
        return;
    }
    if (mode == 3) {
        iq_quant_search_group(x, n, levels, lv && bits == 3, u, d, m);
        return;
    }
    iq_quant_asym_group(x, n, levels, u, d, m);
    if (mode == 0) {
        uint8_t us[128];
        iq_fp16_t ds, ms;
        iq_quant_sym_group(x, n, levels, us, &ds, &ms);
        if (iq_quant_l1_error(x, n, us, ds, ms) < iq_quant_l1_error(x, n, u, *d, *m)) {
            for (int32_t i = 0; i < n; i++) {
                u[i] = us[i];
            }
            *d = ds;
            *m = ms;
        }
    }
}

// ---- value row scales: the codes (the format is described above, iq_qblock_bytes_with) ----

// The scale code of a row x[0..n): round(8 log2 rms) + 128, clamped to 0 .. 255. 8 log2 rms =
// 4 log2 ms with ms = M 2^E (M in [1, 2)): 4E plus the quarter octaves of M, found by comparing M
// with 2^(1/8), 2^(3/8), 2^(5/8), 2^(7/8); no libm call, the same code on every device.
static inline IQ_HD uint8_t iq_row_scale_code_ms(float ms) {
    const uint32_t b = iq_f32_bits(ms);
    const int32_t be = (int32_t) (b >> 23);  // ms >= 0 or NaN: the sign bit is clear unless NaN
    if (!(ms > 0.0f) || be == 0) {
        return 0;  // zero, subnormal (far below code 0) or NaN
    }
    if (be >= 255) {
        return 255;
    }
    const float mant = iq_f32_from_bits((b & 0x7fffffu) | 0x3f800000u);
    const int32_t k = (mant >= 1.09050773f) + (mant >= 1.29683955f) + (mant >= 1.54221083f) + (mant >= 1.83400808f);
    const int32_t code = 4 * (be - 127) + k + 128;
    return (uint8_t) (code < 0 ? 0 : code > 255 ? 255 : code);
}
static inline IQ_HD uint8_t iq_row_scale_code(const float * x, int32_t n) {
    float ss = 0.0f;
    for (int32_t i = 0; i < n; i++) {
        ss += iq_mulf(x[i], x[i]);
    }
    return iq_row_scale_code_ms(ss / (float) n);
}
// The same of an f16 row.
static inline IQ_HD uint8_t iq_row_scale_code_h(const iq_fp16_t * x, int32_t n) {
    float ss = 0.0f;
    for (int32_t i = 0; i < n; i++) {
        const float xi = iq_half_to_float(x[i]);
        ss += iq_mulf(xi, xi);
    }
    return iq_row_scale_code_ms(ss / (float) n);
}

// The scale 2^((code - 128) / 8) of a code, exactly as every device computes it.
#define IQ_ROW_SCALE_STEPS \
    { 1.0f, 1.09050773f, 1.18920712f, 1.29683955f, 1.41421356f, 1.54221083f, 1.68179283f, 1.83400808f }
#if defined(__CUDACC__)
// the device's copies of the tables below: constant memory, not a per-call array in local memory
static __constant__ float iq_row_scale_steps_dev[8] = IQ_ROW_SCALE_STEPS;
#endif
static inline IQ_HD float iq_row_scale(uint8_t code) {
#if defined(__CUDA_ARCH__)
    const float * step = iq_row_scale_steps_dev;
#else
    static const float step[8] = IQ_ROW_SCALE_STEPS;  // 2^(j/8)
#endif
    const int32_t j = code % 8, q = code / 8 - 16;  // 2^(j/8) * 2^q, q in [-16, 15]
    return step[j] * iq_f32_from_bits((uint32_t) (q + 127) << 23);
}

// ---- 8-bit group parameters (iq_qcache_config.params8) ----
// A block may keep its D groups' (d, m) in a byte each instead of two fp16: after its codes, the
// block's references dref, mlo, mhi (fp16) and 2 bytes of padding, then dc[D] and mc[D]. |d| =
// dref 2^(-dc / 16) (16ths of an octave below the block's largest |d|); mc 0 .. 253: an
// asymmetric group, m = mlo + mc (mhi - mlo) / 253; mc 254 / 255: a symmetric group with d
// negative / positive, m = -(L / 2) d. 2 D + 8 bytes instead of 4 D: 0.23-0.25 bits less per
// element of a block at G 64 (tools/kv_sim.py's `P` screened the idea: no measurable cost).
#define IQ_P8_ASYM_MAX 253
#define IQ_P8_SYM_NEG 254
#define IQ_P8_SYM_POS 255

// The code of |d| under dref (both > 0): round(16 log2(dref / |d|)), clamped to 0 .. 255, by
// the float's exponent and 16 thresholds of its mantissa (2^((2k + 1) / 32)); no libm call.
static inline IQ_HD uint8_t iq_p8_d_code(float dref, float d) {
    const float r = dref / fabsf(d);
    if (!(r > 1.0f)) {
        return 0;
    }
    const uint32_t b = iq_f32_bits(r);
    const int32_t e = (int32_t) (b >> 23) - 127;
    if (e >= 16) {
        return 255;
    }
    const float mant = iq_f32_from_bits((b & 0x7fffffu) | 0x3f800000u);
    const float th[16] = { 1.0218972f, 1.06714046f, 1.1143868f, 1.1637249f, 1.21524739f, 1.26905096f,
                           1.32523668f, 1.38390994f, 1.44518077f, 1.50916445f, 1.5759809f, 1.64575553f,
                           1.71861935f, 1.79470909f, 1.87416768f, 1.95714414f };  // 2^((2k + 1) / 32)
    int32_t k = 0;
    for (int i = 0; i < 16; i++) {
        k += mant >= th[i];
    }
    const int32_t c = 16 * e + k;
    return (uint8_t) (c > 255 ? 255 : c);
}

// 2^(-c / 16) exactly as every device computes it: a table of 2^(-j / 16) times 2^(-q).
#define IQ_P8_FACTORS                                                                                 \
    { 1.0f, 0.957603276f, 0.917004049f, 0.878126085f, 0.840896428f, 0.805245161f, 0.771105409f, 0.738413095f, \
      0.707106769f, 0.677127779f, 0.648419797f, 0.620928884f, 0.594603539f, 0.56939429f, 0.545253873f, 0.522136867f }
#if defined(__CUDACC__)
static __constant__ float iq_p8_factors_dev[16] = IQ_P8_FACTORS;
#endif
static inline IQ_HD float iq_p8_d_factor(uint8_t c) {
#if defined(__CUDA_ARCH__)
    const float * t = iq_p8_factors_dev;
#else
    static const float t[16] = IQ_P8_FACTORS;  // 2^(-j / 16)
#endif
    return t[c % 16] * iq_f32_from_bits((uint32_t) (127 - c / 16) << 23);
}

// x as computed: a compiler that fuses multiply-adds (aarch64, or x86 with FMA) keeps the
// product's rounding, so every device decodes the same bits.
static inline IQ_HD float iq_p8_rounded(float x) {
#if defined(__CUDA_ARCH__)
    return x;  // (iq_mulf's __fmul_rn is never fused)
#else
    volatile float v = x;
    return v;
#endif
}

// The references dref, mlo, mhi of a block with 8-bit parameters (at params, little-endian fp16).
static inline IQ_HD void iq_p8_refs(const uint8_t * params, float * ref) {
    for (int i = 0; i < 3; i++) {
        ref[i] = iq_half_to_float((iq_fp16_t) (params[2 * i] | params[2 * i + 1] << 8));
    }
}

// The fp16 (d, m) of a group with bytes dc, mc of a block with references ref (iq_p8_refs) whose
// symmetric grid has the centre c (iq_grid_centre): |d| = dref 2^(-dc/16), m = mlo + mc (mhi -
// mlo) / 253 (asymmetric) or -c d (symmetric), each rounded to fp16: what its codes were chosen
// on, and what the kernels read, as a block with fp16 parameters.
static inline IQ_HD void iq_p8_decode_one(const float * ref, uint8_t dc, uint8_t mc, float centre, iq_fp16_t * d,
                                          iq_fp16_t * m) {
    const float step = (ref[2] - ref[1]) / (float) IQ_P8_ASYM_MAX;
    const float a = iq_mulf(ref[0], iq_p8_d_factor(dc));
    *d = iq_float_to_half(mc == IQ_P8_SYM_NEG ? -a : a);
    *m = mc >= IQ_P8_SYM_NEG ? iq_float_to_half(-centre * iq_half_to_float(*d))
                             : iq_float_to_half(ref[1] + iq_p8_rounded(iq_mulf((float) mc, step)));
}

// The same for group gi of the block at params (the references, dc[D], mc[D]).
static inline IQ_HD void iq_p8_decode_group(const uint8_t * params, int32_t head_dim, float centre, int32_t gi,
                                            iq_fp16_t * d, iq_fp16_t * m) {
    float ref[3];
    iq_p8_refs(params, ref);
    iq_p8_decode_one(ref, params[IQ_P8_REFS + gi], params[IQ_P8_REFS + head_dim + gi], centre, d, m);
}

// The same for every group of the block: d[D] then m[D] into dm.
static inline IQ_HD void iq_p8_decode_block(const uint8_t * params, int32_t head_dim, float centre, iq_fp16_t * dm) {
    float ref[3];
    iq_p8_refs(params, ref);
    const uint8_t * dc = params + IQ_P8_REFS, * mc = dc + head_dim;
    for (int32_t gi = 0; gi < head_dim; gi++) {
        iq_p8_decode_one(ref, dc[gi], mc[gi], centre, &dm[gi], &dm[head_dim + gi]);
    }
}

// Whether a group's fp16 (d, m) is a symmetric grid's (m tied to d; an asymmetric group that
// happens to match reads the same).
static inline IQ_HD bool iq_p8_is_sym(iq_fp16_t d, iq_fp16_t m, float centre) {
    const float df = iq_half_to_float(d);
    return df != 0.0f && m == iq_float_to_half(-centre * df);
}

// The smallest fp16 >= x (x >= 0, finite).
static inline IQ_HD iq_fp16_t iq_half_up(float x) {
    const iq_fp16_t h = iq_float_to_half(x);
    return iq_half_to_float(h) < x ? (iq_fp16_t) (h + 1) : h;
}

// The references of a block's 8-bit parameters from its groups' fp16 d[D], m[D], into params
// (8 bytes, little-endian): dref the smallest fp16 >= the largest |d|, mlo and mhi the least and
// largest m of the asymmetric groups (0 where there is none), then 2 bytes of padding.
static inline IQ_HD void iq_p8_write_refs(const iq_fp16_t * d, const iq_fp16_t * m, int32_t head_dim, float centre,
                                          uint8_t * params) {
    float dmax = 0.0f, mlo = 0.0f, mhi = 0.0f;
    bool any_asym = false;
    for (int32_t gi = 0; gi < head_dim; gi++) {
        const float df = iq_half_to_float(d[gi]), mf = iq_half_to_float(m[gi]);
        dmax = fabsf(df) > dmax ? fabsf(df) : dmax;
        if (!iq_p8_is_sym(d[gi], m[gi], centre)) {
            mlo = !any_asym || mf < mlo ? mf : mlo;
            mhi = !any_asym || mf > mhi ? mf : mhi;
            any_asym = true;
        }
    }
    const iq_fp16_t refs[4] = { iq_half_up(dmax), iq_float_to_half(mlo), iq_float_to_half(mhi), 0 };
    for (int i = 0; i < 4; i++) {
        params[2 * i] = (uint8_t) (refs[i] & 0xff);
        params[2 * i + 1] = (uint8_t) (refs[i] >> 8);
    }
}

// Group gi's bytes dc[gi], mc[gi] of a block whose references params already holds, from its
// fp16 (d, m): dc the 16ths of an octave of |d| under dref (255 for d = 0), mc its symmetric
// grid's sign or m's place between mlo and mhi in 253 steps.
static inline IQ_HD void iq_p8_code_group(uint8_t * params, int32_t head_dim, float centre, int32_t gi, iq_fp16_t d,
                                          iq_fp16_t m) {
    float ref[3];
    iq_p8_refs(params, ref);
    const float dref = ref[0], lo = ref[1], hi = ref[2], df = iq_half_to_float(d), mf = iq_half_to_float(m);
    params[IQ_P8_REFS + gi] = dref > 0.0f && df != 0.0f ? iq_p8_d_code(dref, df) : 255;
    uint8_t mc;
    if (iq_p8_is_sym(d, m, centre)) {
        mc = df < 0.0f ? IQ_P8_SYM_NEG : IQ_P8_SYM_POS;
    } else {
        const float r = hi > lo ? roundf((mf - lo) / (hi - lo) * (float) IQ_P8_ASYM_MAX) : 0.0f;
        mc = (uint8_t) (r < 0.0f ? 0.0f : r > (float) IQ_P8_ASYM_MAX ? (float) IQ_P8_ASYM_MAX : r);
    }
    params[IQ_P8_REFS + head_dim + gi] = mc;
}

// ---- blocks: quantizing G token-major f16 rows, reading one code (iq_qblock_quantize) ----

// Group gi (0 .. head_dim - 1) of a block: channels [c0, c0 + G) of token gi % G (groups along
// channels) or tokens [0, G) of channel gi (along tokens); its element s is row element
// first + s * step of the token-major rows, channel c0 + s (along channels) or c0.
static inline IQ_HD void iq_qblock_group_span(bool along_c, int32_t head_dim, int32_t group, int32_t gi,
                                              size_t * first, size_t * step, int32_t * c0) {
    const int32_t t0 = along_c ? gi % group : 0;
    *c0 = along_c ? gi / group * group : gi;
    *first = (size_t) t0 * head_dim + *c0;
    *step = along_c ? 1 : (size_t) head_dim;
}

// The G values x[] of group gi of token-major f16 rows [G][head_dim], divided by norm[c] unless
// NULL and by the row scale rscale[t] of token t unless NULL.
static inline IQ_HD void iq_qblock_group_values(const iq_fp16_t * rows, bool along_c, int32_t head_dim, int32_t group,
                                                const float * norm, const float * rscale, int32_t gi, float * x) {
    size_t first, step;
    int32_t c0;
    iq_qblock_group_span(along_c, head_dim, group, gi, &first, &step, &c0);
    for (int32_t s = 0; s < group; s++) {
        const int32_t c = along_c ? c0 + s : c0;
        x[s] = iq_half_to_float(rows[first + s * step]);
        x[s] = norm ? x[s] / norm[c] : x[s];
        x[s] = rscale ? x[s] / rscale[along_c ? gi % group : s] : x[s];
    }
}

// Quantizes group gi of G token-major f16 rows [G][head_dim] (divided by norm[c], unless
// NULL, and by the row scale rscale[t] of token t, unless NULL; lv: on the key levels, as
// iq_quant_group_hd): its codes into codes[]
// (token-major, as the rows), its (d, m) into d[gi], m[gi].
static inline IQ_HD void iq_qblock_quantize_group(const iq_fp16_t * rows, bool along_c, int32_t bits,
                                                  int32_t head_dim, int32_t group, int mode, bool lv,
                                                  const float * norm, const float * rscale, int32_t gi,
                                                  uint8_t * codes, iq_fp16_t * d, iq_fp16_t * m) {
    size_t first, step;
    int32_t c0;
    iq_qblock_group_span(along_c, head_dim, group, gi, &first, &step, &c0);
    float x[128];
    uint8_t u[128];
    iq_qblock_group_values(rows, along_c, head_dim, group, norm, rscale, gi, x);
    iq_quant_group_hd(x, group, bits, mode, lv, u, &d[gi], &m[gi]);
    for (int32_t s = 0; s < group; s++) {
        codes[first + s * step] = u[s];
    }
}

// Group gi's codes again on the fp16 (d, m) its 8-bit parameters decode to (sym: whether the
// group was quantized on the symmetric grid), from the rows as iq_qblock_quantize_group reads them.
static inline IQ_HD void iq_qblock_recode_group(const iq_fp16_t * rows, bool along_c, int32_t bits, bool lv,
                                                int32_t head_dim, int32_t group, const float * norm,
                                                const float * rscale, int32_t gi, bool sym, iq_fp16_t d, iq_fp16_t m,
                                                uint8_t * codes) {
    float x[128];
    uint8_t u[128];
    size_t first, step;
    int32_t c0;
    iq_qblock_group_values(rows, along_c, head_dim, group, norm, rscale, gi, x);
    iq_quant_codes(x, group, 1 << bits, lv, sym, d, m, u);
    iq_qblock_group_span(along_c, head_dim, group, gi, &first, &step, &c0);
    for (int32_t s = 0; s < group; s++) {
        codes[first + s * step] = u[s];
    }
}

// Packs tile ti of a block from its token-major codes [G][head_dim] (8*bits bytes at dst).
static inline IQ_HD void iq_qblock_pack_tile(const uint8_t * codes, bool by_channel, int32_t bits, int32_t head_dim,
                                             int32_t group, int32_t ti, uint8_t * dst) {
    uint8_t tile[IQ_QTILE];
    for (int p = 0; p < IQ_QTILE; p++) {
        int32_t t, c;
        iq_qtile_coords(by_channel, head_dim, group, ti, p, &t, &c);
        tile[p] = codes[(size_t) t * head_dim + c];
    }
    iq_qtile_pack_codes(tile, bits, dst);
}

// The code of token t, channel c of a block (the inverse of iq_qtile_coords).
static inline IQ_HD uint8_t iq_qblock_code_at(const uint8_t * block, bool by_channel, int32_t bits, int32_t head_dim,
                                              int32_t group, int32_t t, int32_t c) {
    const int32_t quads = (by_channel ? head_dim : group) / 4;
    const int32_t lane = by_channel ? t : c, sub = by_channel ? c : t;
    const int32_t ti = lane / 16 * quads + sub / 4;
    return iq_qtile_code(block + (size_t) ti * 8 * bits, bits, 4 * (lane % 16) + sub % 4);
}

// ---- key normalization (docs/DESIGN.md 3.3) ----

// The normalization of channel ch from the max |K| of each channel (mx[head_dim]): the two
// channels of a RoPE pair (2i, 2i+1 below rope_dims) share the max of both; n = sqrt(max), or
// 1 for a channel that is all zeros.
static inline IQ_HD float iq_qcache_norm_of(const float * mx, int32_t rope_dims, int32_t ch) {
    float x = mx[ch];
    if (ch < rope_dims) {
        const int32_t a = ch / 2 * 2;
        x = mx[a] > mx[a + 1] ? mx[a] : mx[a + 1];
    }
    return x > 0.0f ? sqrtf(x) : 1.0f;
}

// ---- query preparation (keys grouped along channels: InnerQ) ----

// One key group of G channels of one query head: qn_c = qs_c n_c (the scaled query times the
// key normalization) as int8 q8 with step sq (qn ~ sq q8, round to nearest even), sum qn, and
// the score correction sum qn^2 / 24 (iq_qcache_config.score_correction; 0 when off).
static inline IQ_HD void iq_query_prep_group(const float * qs, const float * norm, int32_t g, bool correction,
                                             int8_t * q8, float * sq, float * sumq, float * q2) {
    float amax = 0.0f, sum = 0.0f, sum2 = 0.0f;
    for (int32_t ch = 0; ch < g; ch++) {
        const float qn = qs[ch] * norm[ch];
        sum += qn;
        sum2 += qn * qn;
        amax = fabsf(qn) > amax ? fabsf(qn) : amax;
    }
    *q2 = correction ? sum2 / 24.0f : 0.0f;
    const float inv = amax > 0.0f ? IQ_Q8_MAX / amax : 0.0f;
    for (int32_t ch = 0; ch < g; ch++) {
        // |v| <= IQ_Q8_MAX by the choice of inv; the clamps only keep NaN (a non-finite query or
        // norm) from an undefined conversion
        float v = qs[ch] * norm[ch] * inv;
        v = v <= IQ_Q8_MAX ? v : IQ_Q8_MAX;
        v = v >= -IQ_Q8_MAX ? v : -IQ_Q8_MAX;
        q8[ch] = (int8_t) iq_round_even(v);
    }
    *sq = amax / IQ_Q8_MAX;
    *sumq = sum;
}

// ---- online-softmax state of one query head: {mx, l, acc[D]} (IQ_ATTN_STATE floats) ----
// acc = sum_t exp(s_t - mx) v_t and l = sum_t exp(s_t - mx); mx = -inf, l = 0: empty. States of
// disjoint token ranges merge exactly, so threads and thread blocks may split tokens any way.

static inline IQ_HD void iq_softmax_init(float * st, int32_t head_dim) {
    st[0] = -INFINITY;
    for (int32_t c = 1; c < head_dim + 2; c++) {
        st[c] = 0.0f;
    }
}

// Adds one token of score s and value row v (libm exp: the reference path).
static inline IQ_HD void iq_softmax_add(float * st, int32_t head_dim, float s, const float * v) {
    if (s > st[0]) {
        const float f = expf(st[0] - s);
        for (int32_t c = 1; c < head_dim + 2; c++) {
            st[c] *= f;
        }
        st[0] = s;
    }
    const float p = expf(s - st[0]);
    st[1] += p;
    for (int32_t c = 0; c < head_dim; c++) {
        st[2 + c] += p * v[c];
    }
}

// Raises the running max to at least mx (rescaling l and acc, with the kernels' exp) and
// returns exp(mx - running max), the weight of a chunk whose scores are relative to mx.
static inline IQ_HD float iq_softmax_raise(float * st, int32_t head_dim, float mx) {
    if (mx <= st[0]) {
        return iq_exp_poly(mx - st[0]);
    }
    // st[0] = -inf (an empty state): the factor is exp(-87), and l and acc are 0
    const float f = iq_exp_poly(st[0] - mx);
    for (int32_t c = 1; c < head_dim + 2; c++) {
        st[c] *= f;
    }
    st[0] = mx;
    return 1.0f;
}

// dst = the state of both token ranges.
static inline IQ_HD void iq_softmax_merge(float * dst, const float * src, int32_t head_dim) {
    const float mx = dst[0] > src[0] ? dst[0] : src[0];
    if (mx == -INFINITY) {
        return;
    }
    const float fa = expf(dst[0] - mx), fb = expf(src[0] - mx);
    dst[0] = mx;
    for (int32_t c = 1; c < head_dim + 2; c++) {
        dst[c] = dst[c] * fa + src[c] * fb;
    }
}

// out[D] = acc / l (zeros where no token was seen).
static inline IQ_HD void iq_softmax_finish(const float * st, int32_t head_dim, float * out) {
    const float inv = st[1] > 0.0f ? 1.0f / st[1] : 0.0f;
    for (int32_t c = 0; c < head_dim; c++) {
        out[c] = st[2 + c] * inv;
    }
}
