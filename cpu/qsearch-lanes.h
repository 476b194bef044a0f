// The searched quantizer (iq_quant_group_hd's mode 3, ggml_innerq/iq-qcache-math.h) of
// IQ_QSEARCH_LANES groups at once, an iq_qsearch_fn (iq-qcache.h): the scalar search's
// arithmetic operation for operation, on the groups side by side in vectors (GCC / Clang vector
// extensions: elementwise IEEE operations, which the file's target flags lower to its vector
// registers). Each lane's sums keep the scalar order and no product is fused into an fma (the
// files that include this are built with -ffp-contract=off, CMakeLists.txt), so every group gets
// the scalar search's bits (tests/test_innerq_quant.py), in a third to a quarter of its time on
// AVX2 / AVX-512 (docs/BENCHMARKS.md "The searched quantizer in vectors"): the search is most of
// a flush's work. Built for baseline x86-64 (SSE2) the same code was slower than the scalar one,
// so only the AVX2 and AVX-512 rows have it (cpu/x86/qsearch-*.c).
//
// Include once per ISA after defining IQ_QSEARCH_NAME, the function's name.
#pragma once

#include "iq-qcache.h"

#include <string.h>

typedef float iq_qs_f __attribute__((vector_size(4 * IQ_QSEARCH_LANES)));
typedef int32_t iq_qs_i __attribute__((vector_size(4 * IQ_QSEARCH_LANES)));
typedef double iq_qs_d __attribute__((vector_size(8 * IQ_QSEARCH_LANES)));
typedef int64_t iq_qs_l __attribute__((vector_size(8 * IQ_QSEARCH_LANES)));

// where mask (-1 / 0 per lane, a comparison's result) a, else b
static inline iq_qs_f iq_qs_self(iq_qs_i mask, iq_qs_f a, iq_qs_f b) {
    return (iq_qs_f) (((iq_qs_i) a & mask) | ((iq_qs_i) b & ~mask));
}
static inline iq_qs_i iq_qs_seli(iq_qs_i mask, iq_qs_i a, iq_qs_i b) { return (a & mask) | (b & ~mask); }
static inline iq_qs_d iq_qs_seld(iq_qs_l mask, iq_qs_d a, iq_qs_d b) {
    return (iq_qs_d) (((iq_qs_l) a & mask) | ((iq_qs_l) b & ~mask));
}
static inline iq_qs_f iq_qs_splat(float v) { return (iq_qs_f) { 0 } + v; }

// iq_quant_codes of the lanes on the grids (d[l], m[l]): codes u and their grid values L[u] (lev)
static void iq_qs_codes(const iq_qs_f * x, int32_t n, int32_t levels, bool lv, bool sym, const iq_fp16_t * d,
                        const iq_fp16_t * m, iq_qs_f * lev, iq_qs_i * u) {
    iq_qs_f df, mf;
    for (int l = 0; l < IQ_QSEARCH_LANES; l++) {
        df[l] = iq_half_to_float(d[l]);
        mf[l] = iq_half_to_float(m[l]);
    }
    const int32_t half = levels / 2, c0 = sym ? half : 0;  // c0: the code of a group of d = 0
    const float g0 = lv ? (float) iq_key_level((uint8_t) c0) : (float) c0;
    const iq_qs_i flat = df == 0.0f;
    if (lv) {
        // iq_key_level_code by its midpoints, and the level by the steps between levels
        const float mid[7] = { 4.0f, 11.0f, 16.5f, 21.5f, 26.5f, 32.0f, 39.0f };
        const int32_t step[7] = { 8, 6, 5, 5, 5, 6, 8 };
        for (int32_t i = 0; i < n; i++) {
            const iq_qs_f t = (x[i] - mf) / df;
            iq_qs_i c = { 0 }, g = { 0 };
            for (int k = 0; k < 7; k++) {
                const iq_qs_i ge = t >= mid[k];  // -1 where t >= mid
                c -= ge;
                g -= ge * step[k];
            }
            u[i] = iq_qs_seli(flat, (iq_qs_i) { 0 } + c0, c);
            lev[i] = iq_qs_self(flat, iq_qs_splat(g0), __builtin_convertvector(g, iq_qs_f));
        }
        return;
    }
    // iq_quant_code: clamped to [lo, hi] (NaN to lo), rounded half away from zero
    const float lo = (float) (sym ? -half : 0), hi = (float) (sym ? half - 1 : levels - 1);
    for (int32_t i = 0; i < n; i++) {
        iq_qs_f v = sym ? x[i] / df : (x[i] - mf) / df;
        v = iq_qs_self(v > hi, iq_qs_splat(hi), v);
        v = iq_qs_self(v >= lo, v, iq_qs_splat(lo));
        const iq_qs_i iv = __builtin_convertvector(v, iq_qs_i);
        const iq_qs_f f = v - __builtin_convertvector(iv, iq_qs_f);
        const iq_qs_i c = iv - (f >= 0.5f) + (f <= -0.5f) + c0;
        u[i] = iq_qs_seli(flat, (iq_qs_i) { 0 } + c0, c);
        lev[i] = __builtin_convertvector(u[i], iq_qs_f);
    }
}

// iq_quant_group_hd's searched mode of IQ_QSEARCH_LANES groups of n elements (x[i][l]: element i of
// group l): codes u[i][l] and (d[l], m[l]).
static void iq_qs_search(const iq_qs_f * x, int32_t n, int32_t bits, bool lv, iq_qs_i * u, iq_fp16_t * d,
                         iq_fp16_t * m) {
    const int32_t levels = 1 << bits;
    lv = lv && bits == 3;
    const float centre = iq_grid_centre(levels, lv), top = lv ? (float) IQ_KEY_LEVELS_TOP : (float) (levels - 1);
    iq_qs_f lo = x[0], hi = x[0], a = x[0];
    iq_qs_i constant = (iq_qs_i) { 0 } - 1;  // -1: true
    const iq_qs_i absmask = (iq_qs_i) { 0 } + 0x7fffffff;
    for (int32_t i = 1; i < n; i++) {
        const iq_qs_f xi = x[i];
        lo = iq_qs_self(xi < lo, xi, lo);
        hi = iq_qs_self(xi > hi, xi, hi);
        a = iq_qs_self((iq_qs_f) ((iq_qs_i) xi & absmask) > (iq_qs_f) ((iq_qs_i) a & absmask), xi, a);
        constant &= xi == x[0];
    }
    iq_qs_d best = { 0 };
    best -= 1.0;
    for (int k = 0; k < 2 * IQ_QSEARCH_N; k++) {
        const bool sym = k % 2 == 1;
        const float f = iq_qsearch_factor(k / 2);
        iq_fp16_t dc[IQ_QSEARCH_LANES], mc[IQ_QSEARCH_LANES];
        for (int l = 0; l < IQ_QSEARCH_LANES; l++) {
            if (sym) {
                dc[l] = iq_float_to_half(-2.0f * a[l] * f / (2.0f * centre));
                mc[l] = iq_float_to_half(-centre * iq_half_to_float(dc[l]));
            } else {
                const float c = 0.5f * (lo[l] + hi[l]), r = iq_mulf(0.5f * (hi[l] - lo[l]), f);
                dc[l] = iq_float_to_half(2.0f * r / top);
                mc[l] = iq_float_to_half(c - r);
            }
        }
        iq_qs_i uc[IQ_QGROUP_MAX];
        iq_qs_f lev[IQ_QGROUP_MAX];
        iq_qs_codes(x, n, levels, lv, sym, dc, mc, lev, uc);
        // least squares: x ~ d*s + m0 with s = L[u] - (sym ? c : 0), m0 = 0 for the symmetric grid
        const double cs = sym ? (double) centre : 0.0;
        iq_qs_d ss = { 0 }, s1 = { 0 }, sx = { 0 }, x1 = { 0 };
        for (int32_t i = 0; i < n; i++) {
            const iq_qs_d si = __builtin_convertvector(lev[i], iq_qs_d) - cs, xd = __builtin_convertvector(x[i], iq_qs_d);
            ss += si * si;
            s1 += si;
            sx += si * xd;
            x1 += xd;
        }
        bool refit = false;
        for (int l = 0; l < IQ_QSEARCH_LANES; l++) {
            double dd, mm;
            if (sym) {
                dd = ss[l] > 0.0 ? sx[l] / ss[l] : 0.0;
                mm = -(double) centre * dd;
            } else {
                const double det = iq_muld((double) n, ss[l]) - iq_muld(s1[l], s1[l]);
                dd = det > 0.0 ? (iq_muld((double) n, sx[l]) - iq_muld(s1[l], x1[l])) / det : 0.0;
                mm = det > 0.0 ? (x1[l] - iq_muld(dd, s1[l])) / (double) n : 0.0;
            }
            if (sym ? dd * (double) iq_half_to_float(dc[l]) > 0.0 : dd > 0.0) {
                dc[l] = iq_float_to_half((float) dd);
                mc[l] = sym ? iq_float_to_half(-centre * iq_half_to_float(dc[l])) : iq_float_to_half((float) mm);
                refit = true;
            }
        }
        if (refit) {  // every lane again: a lane not refit gets the same codes
            iq_qs_codes(x, n, levels, lv, sym, dc, mc, lev, uc);
        }
        iq_qs_d df, mf, err = { 0 };
        for (int l = 0; l < IQ_QSEARCH_LANES; l++) {
            df[l] = iq_half_to_float(dc[l]);
            mf[l] = iq_half_to_float(mc[l]);
        }
        for (int32_t i = 0; i < n; i++) {
            const iq_qs_d e = __builtin_convertvector(x[i], iq_qs_d) - (df * __builtin_convertvector(lev[i], iq_qs_d) + mf);
            err += e * e;
        }
        const iq_qs_l take = (best < 0.0) | (err < best);  // the first candidate on a tie
        best = iq_qs_seld(take, err, best);
        const iq_qs_i take32 = __builtin_convertvector(take, iq_qs_i);
        for (int l = 0; l < IQ_QSEARCH_LANES; l++) {
            d[l] = take[l] ? dc[l] : d[l];
            m[l] = take[l] ? mc[l] : m[l];
        }
        for (int32_t i = 0; i < n; i++) {
            u[i] = iq_qs_seli(take32, uc[i], u[i]);
        }
    }
    for (int l = 0; l < IQ_QSEARCH_LANES; l++) {
        if (constant[l]) {  // iq_quant_group_hd's constant group
            d[l] = 0;
            m[l] = iq_float_to_half(x[0][l]);
        }
    }
    for (int32_t i = 0; i < n; i++) {
        u[i] &= ~constant;
    }
}

void IQ_QSEARCH_NAME(const float * x, int32_t n, int32_t bits, bool key_levels, uint8_t * u, iq_fp16_t * d,
                     iq_fp16_t * m) {
    iq_qs_f xv[IQ_QGROUP_MAX];
    iq_qs_i uv[IQ_QGROUP_MAX];
    memcpy(xv, x, sizeof(float) * (size_t) n * IQ_QSEARCH_LANES);
    iq_qs_search(xv, n, bits, key_levels, uv, d, m);
    for (int32_t i = 0; i < n; i++) {
        for (int l = 0; l < IQ_QSEARCH_LANES; l++) {
            u[i * IQ_QSEARCH_LANES + l] = (uint8_t) uv[i][l];
        }
    }
}
