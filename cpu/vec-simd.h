// The vec.h kernels written once over a vector width. Included by x86/vec-avx2.c,
// x86/vec-avx512.c and arm/vec-neon.c after they define:
//   V, VL (lanes), VZERO, VLOAD, VSTORE, VLOADH / VSTOREH (VL f16 values <-> V), VSET1, VADD,
//   VSUB, VMUL, VDIV, VMIN, VMAX, VFMA(a, b, c) = a * b + c, VFNMA(a, b, c) = c - a * b,
//   VROUND (to nearest), VSCALE(p, n) = p * 2^n for integral n, VHSUM / VHMAX (over lanes),
//   VHSUM4(a, b, c, e) (a vector of the four lane sums, stored by VSTORE4(p, x), its first
//   lane read by VFIRST(x)), SCORES_J and ACCUM_J (query vectors
//   per register block, at most 4), ACCUM_W (vectors of d per register block), VEC_TABLE;
//   optionally VPART4 and VFOLD_ROWS, VHSUM4 split in two (the scores of VL rows at once).
// Head dims that are not a multiple of VL go to the scalar kernels.
#include "vec.h"

#include <math.h>

#define SIMD_INLINE static inline __attribute__((always_inline))

// exp(x) to ~1 ulp: x = n ln2 + r, |r| <= ln2 / 2, degree-6 Taylor polynomial in r.
// Inputs are clamped so that 2^n stays a normal number.
SIMD_INLINE V simd_exp(V x) {
    x = VMIN(VMAX(x, VSET1(-87.0f)), VSET1(88.3f));
    const V n = VROUND(VMUL(x, VSET1(1.44269504088896341f)));
    V r = VFNMA(n, VSET1(0.693145751953125f), x);
    r = VFNMA(n, VSET1(1.42860682030941723e-6f), r);
    V p = VSET1(1.0f / 720);
    p = VFMA(p, r, VSET1(1.0f / 120));
    p = VFMA(p, r, VSET1(1.0f / 24));
    p = VFMA(p, r, VSET1(1.0f / 6));
    p = VFMA(p, r, VSET1(0.5f));
    p = VFMA(p, r, VSET1(1.0f));
    p = VFMA(p, r, VSET1(1.0f));
    return VSCALE(p, n);
}

// VL elements from element i of a row of f32 or f16.
SIMD_INLINE V simd_load(const void * row, int64_t i, bool half) {
    return half ? VLOADH((const iq_fp16_t *) row + i) : VLOAD((const float *) row + i);
}

// Four rows of k against J queries: one accumulator per pair, lanes summed four at a time.
SIMD_INLINE void simd_scores_block(int J, bool half, int d, const void * k, int64_t ks, const float * q, float * s,
                                   int64_t ss) {
    V acc[4][4];
#pragma GCC unroll 4
    for (int j = 0; j < J; j++) {
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            acc[j][t] = VZERO();
        }
    }
    for (int c = 0; c < d; c += VL) {
        const V k0 = simd_load(k, c, half), k1 = simd_load(k, ks + c, half);
        const V k2 = simd_load(k, 2 * ks + c, half), k3 = simd_load(k, 3 * ks + c, half);
#pragma GCC unroll 4
        for (int j = 0; j < J; j++) {
            const V qv = VLOAD(q + (int64_t) j * d + c);
            acc[j][0] = VFMA(qv, k0, acc[j][0]);
            acc[j][1] = VFMA(qv, k1, acc[j][1]);
            acc[j][2] = VFMA(qv, k2, acc[j][2]);
            acc[j][3] = VFMA(qv, k3, acc[j][3]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < J; j++) {
        VSTORE4(s + j * ss, VHSUM4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
    }
}

#ifdef VPART4
// VL rows against J queries, four at a time as simd_scores_block, the lane sums of each block
// left half done (VPART4) and the VL / 4 blocks' folded at once into one vector of VL scores
// (VFOLD_ROWS): VHSUM4's additions, so a row's score is the same in a group or a block.
SIMD_INLINE void simd_scores_group(int J, bool half, int d, const void * k, int64_t ks, const float * q, float * s,
                                   int64_t ss) {
    const size_t es = half ? sizeof(iq_fp16_t) : sizeof(float);
    V y[4][VL / 4];
#pragma GCC unroll 4
    for (int b = 0; b < VL / 4; b++) {
        const void * kb = (const char *) k + (size_t) (4 * b * ks) * es;
        V acc[4][4];
#pragma GCC unroll 4
        for (int j = 0; j < J; j++) {
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                acc[j][t] = VZERO();
            }
        }
        for (int c = 0; c < d; c += VL) {
            const V k0 = simd_load(kb, c, half), k1 = simd_load(kb, ks + c, half);
            const V k2 = simd_load(kb, 2 * ks + c, half), k3 = simd_load(kb, 3 * ks + c, half);
#pragma GCC unroll 4
            for (int j = 0; j < J; j++) {
                const V qv = VLOAD(q + (int64_t) j * d + c);
                acc[j][0] = VFMA(qv, k0, acc[j][0]);
                acc[j][1] = VFMA(qv, k1, acc[j][1]);
                acc[j][2] = VFMA(qv, k2, acc[j][2]);
                acc[j][3] = VFMA(qv, k3, acc[j][3]);
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < J; j++) {
            y[j][b] = VPART4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < J; j++) {
        VSTORE(s + j * ss, VFOLD_ROWS(y[j]));
    }
}
#endif

SIMD_INLINE void simd_scores_rows(bool half, int d, int n, const void * k, int64_t ks, int nq, const float * q,
                                  float * s, int64_t ss) {
    const size_t es = half ? sizeof(iq_fp16_t) : sizeof(float);
    int t = 0;
#ifdef VPART4
    for (; t + VL <= n; t += VL) {
        const void * kt = (const char *) k + (size_t) (t * ks) * es;
        int j = 0;
        for (; j + 3 <= nq; j += 3) {
            simd_scores_group(3, half, d, kt, ks, q + (int64_t) j * d, s + j * ss + t, ss);
        }
        if (nq - j == 2) {
            simd_scores_group(2, half, d, kt, ks, q + (int64_t) j * d, s + j * ss + t, ss);
        } else if (nq - j == 1) {
            simd_scores_group(1, half, d, kt, ks, q + (int64_t) j * d, s + j * ss + t, ss);
        }
    }
#endif
    for (; t + 4 <= n; t += 4) {
        const void * kt = (const char *) k + (size_t) (t * ks) * es;
        int j = 0;
        for (; j + SCORES_J <= nq; j += SCORES_J) {
            simd_scores_block(SCORES_J, half, d, kt, ks, q + (int64_t) j * d, s + j * ss + t, ss);
        }
#if SCORES_J > 3
        if (nq - j == 3) {
            simd_scores_block(3, half, d, kt, ks, q + (int64_t) j * d, s + j * ss + t, ss);
            j += 3;
        }
#endif
#if SCORES_J > 2
        if (nq - j == 2) {
            simd_scores_block(2, half, d, kt, ks, q + (int64_t) j * d, s + j * ss + t, ss);
            j += 2;
        }
#endif
        if (nq - j == 1) {
            simd_scores_block(1, half, d, kt, ks, q + (int64_t) j * d, s + j * ss + t, ss);
        }
    }
    for (; t < n; t++) {
        for (int j = 0; j < nq; j++) {
            V acc = VZERO();
            for (int c = 0; c < d; c += VL) {
                acc = VFMA(VLOAD(q + (int64_t) j * d + c), simd_load(k, t * ks + c, half), acc);
            }
            // summed as the four-row blocks sum each row, so a row's score does not depend on
            // where a tile boundary puts it
            s[j * ss + t] = VFIRST(VHSUM4(acc, VZERO(), VZERO(), VZERO()));
        }
    }
}

static void simd_scores(int d, int n, const void * k, int64_t ks, int nq, const float * q, float * s, int64_t ss) {
    if (d % VL != 0) {
        iq_vec_fns_scalar.scores(d, n, k, ks, nq, q, s, ss);
        return;
    }
    simd_scores_rows(false, d, n, k, ks, nq, q, s, ss);
}

static void simd_scores_f16(int d, int n, const void * k, int64_t ks, int nq, const float * q, float * s,
                            int64_t ss) {
    if (d % VL != 0) {
        iq_vec_fns_scalar.scores_f16(d, n, k, ks, nq, q, s, ss);
        return;
    }
    simd_scores_rows(true, d, n, k, ks, nq, q, s, ss);
}

// J queries x W vectors of d held in registers while n value rows stream past.
SIMD_INLINE void simd_accum_block(int J, int W, bool half, int n, const void * v, int64_t vs, const float * p,
                                  int64_t ps, float * o, int64_t os) {
    V acc[4][ACCUM_W];
#pragma GCC unroll 4
    for (int j = 0; j < J; j++) {
#pragma GCC unroll 8
        for (int w = 0; w < W; w++) {
            acc[j][w] = VLOAD(o + j * os + w * VL);
        }
    }
    for (int t = 0; t < n; t++) {
        V vv[ACCUM_W];
#pragma GCC unroll 8
        for (int w = 0; w < W; w++) {
            vv[w] = simd_load(v, t * vs + w * VL, half);
        }
#pragma GCC unroll 4
        for (int j = 0; j < J; j++) {
            const V pj = VSET1(p[j * ps + t]);
#pragma GCC unroll 8
            for (int w = 0; w < W; w++) {
                acc[j][w] = VFMA(pj, vv[w], acc[j][w]);
            }
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < J; j++) {
#pragma GCC unroll 8
        for (int w = 0; w < W; w++) {
            VSTORE(o + j * os + w * VL, acc[j][w]);
        }
    }
}

// Channels [c, c + W * VL) of the J queries from j on; W is ACCUM_W or 1.
SIMD_INLINE void simd_accum_cols(int J, bool half, int d, int c, int n, const void * v, int64_t vs, const float * p,
                                 int64_t ps, float * o, int64_t os) {
    const size_t es = half ? sizeof(iq_fp16_t) : sizeof(float);
    if (c + ACCUM_W * VL <= d) {
        simd_accum_block(J, ACCUM_W, half, n, (const char *) v + c * es, vs, p, ps, o + c, os);
        return;
    }
    for (; c < d; c += VL) {
        simd_accum_block(J, 1, half, n, (const char *) v + c * es, vs, p, ps, o + c, os);
    }
}

SIMD_INLINE void simd_accum_rows(bool half, int d, int n, const void * v, int64_t vs, int nq, const float * p,
                                 int64_t ps, float * o, int64_t os) {
    for (int c = 0; c < d; c += ACCUM_W * VL) {
        int j = 0;
        for (; j + ACCUM_J <= nq; j += ACCUM_J) {
            simd_accum_cols(ACCUM_J, half, d, c, n, v, vs, p + j * ps, ps, o + j * os, os);
        }
#if ACCUM_J > 3
        if (nq - j == 3) {
            simd_accum_cols(3, half, d, c, n, v, vs, p + j * ps, ps, o + j * os, os);
            j += 3;
        }
#endif
#if ACCUM_J > 2
        if (nq - j == 2) {
            simd_accum_cols(2, half, d, c, n, v, vs, p + j * ps, ps, o + j * os, os);
            j += 2;
        }
#endif
        if (nq - j == 1) {
            simd_accum_cols(1, half, d, c, n, v, vs, p + j * ps, ps, o + j * os, os);
        }
    }
}

static void simd_accum(int d, int n, const void * v, int64_t vs, int nq, const float * p, int64_t ps, float * o,
                       int64_t os) {
    if (d % VL != 0) {
        iq_vec_fns_scalar.accum(d, n, v, vs, nq, p, ps, o, os);
        return;
    }
    simd_accum_rows(false, d, n, v, vs, nq, p, ps, o, os);
}

static void simd_accum_f16(int d, int n, const void * v, int64_t vs, int nq, const float * p, int64_t ps,
                           float * o, int64_t os) {
    if (d % VL != 0) {
        iq_vec_fns_scalar.accum_f16(d, n, v, vs, nq, p, ps, o, os);
        return;
    }
    simd_accum_rows(true, d, n, v, vs, nq, p, ps, o, os);
}

// One pass over the seen scores for the max, one for exp and its sum, per query vector; the
// scalar table's softmax with the vector exp.
static void simd_softmax(int d, int n, int nq, const int * visible, float * s, int64_t ss, float * st, int64_t sts) {
    for (int j = 0; j < nq; j++) {
        float * sj = s + j * ss;
        float * stj = st + j * sts;
        const int nv = visible != NULL ? (visible[j] > 0 ? visible[j] : 0) : n;
        if (nv > 0) {
            V m = VSET1(stj[0]);
            int i = 0;
            for (; i + VL <= nv; i += VL) {
                m = VMAX(m, VLOAD(sj + i));
            }
            float mx = VHMAX(m);
            for (int t = i; t < nv; t++) {
                mx = sj[t] > mx ? sj[t] : mx;
            }
            const V vm = VSET1(mx);
            V acc = VZERO();
            for (i = 0; i + VL <= nv; i += VL) {
                const V e = simd_exp(VSUB(VLOAD(sj + i), vm));
                VSTORE(sj + i, e);
                acc = VADD(acc, e);
            }
            float sum = VHSUM(acc);
            for (; i < nv; i++) {
                sj[i] = expf(sj[i] - mx);
                sum += sj[i];
            }
            iq_vec_state_raise(stj, d, mx, sum);
        }
        for (int i = nv; i < n; i++) {
            sj[i] = 0.0f;
        }
    }
}

static void simd_swiglu(int64_t n, float * y, const float * g, const float * u) {
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        const V gv = VLOAD(g + i);
        const V e = simd_exp(VSUB(VZERO(), gv));
        VSTORE(y + i, VMUL(VDIV(gv, VADD(VSET1(1.0f), e)), VLOAD(u + i)));
    }
    iq_vec_fns_scalar.swiglu(n - i, y + i, g + i, u + i);
}

static void simd_to_f16(int64_t n, iq_fp16_t * y, const float * x) {
    int64_t i = 0;
    for (; i + VL <= n; i += VL) {
        VSTOREH(y + i, VLOAD(x + i));
    }
    iq_vec_fns_scalar.to_f16(n - i, y + i, x + i);
}

#ifdef VEC_QSEARCH
void VEC_QSEARCH(const float * x, int32_t n, int32_t bits, bool key_levels, uint8_t * u, iq_fp16_t * d, iq_fp16_t * m);
#endif

const struct iq_vec_fns VEC_TABLE = {
    .scores = simd_scores,
    .scores_f16 = simd_scores_f16,
    .accum = simd_accum,
    .accum_f16 = simd_accum_f16,
    .softmax = simd_softmax,
    .swiglu = simd_swiglu,
    .to_f16 = simd_to_f16,
#ifdef VEC_QSEARCH
    .qsearch = VEC_QSEARCH,
#endif
};
