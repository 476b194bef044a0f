// f32 kernels the ops share (attention tiles, softmax numerators, SwiGLU), one table per kernel
// row. The scalar table is the specification; the vector tables (x86/vec-avx2.c,
// x86/vec-avx512.c, arm/vec-neon.c, all built from vec-simd.h) must agree with it to float
// rounding.
#pragma once

#include "iq-cpu.h"
#include "iq-qcache.h"

#include <math.h>

// Attention tiles read rows of f32 or f16 (`half`) elements; row t of k starts at element
// t * ks. Queries q are rows of d floats; output row j starts at o + j * os.
typedef void (*iq_vec_scores_fn)(int d, int n, const void * k, int64_t ks, int nq, const float * q, float * s,
                                 int64_t ss);
typedef void (*iq_vec_accum_fn)(int d, int n, const void * v, int64_t vs, int nq, const float * p, int64_t ps,
                                float * o, int64_t os);

struct iq_vec_fns {
    // s[j * ss + t] = dot(q + j * d, row t of k) for j < nq, t < n
    iq_vec_scores_fn scores, scores_f16;
    // o + j * os += sum_t p[j * ps + t] * (row t of v) for j < nq
    iq_vec_accum_fn accum, accum_f16;
    // The online softmax of a tile of scores, query vector j's at s + j * ss (n of them, the
    // first visible[j] seen, all n where visible is NULL). State j at st + j * sts holds the
    // running max, the running sum and d accumulator floats: raised to the tile's max, the sum
    // and the accumulator rescaled by exp(old max - new max) (not touched where the max stays),
    // the tile's sum of exp(s - max) added. Leaves exp(s - max) in s, 0 past the seen scores.
    void (*softmax)(int d, int n, int nq, const int * visible, float * s, int64_t ss, float * st, int64_t sts);
    // y = silu(g) * u = g / (1 + exp(-g)) * u
    void (*swiglu)(int64_t n, float * y, const float * g, const float * u);
    // y = f16(x), rounded to nearest even
    void (*to_f16)(int64_t n, iq_fp16_t * y, const float * x);
    // the searched quantizer of IQ_QSEARCH_LANES groups (iq-qcache.h; cpu/qsearch-lanes.h), or
    // NULL: iq_qblock_quantize's scalar search
    iq_qsearch_fn qsearch;
};

// A softmax state (running max, running sum, d accumulator floats) raised to the max mx (at
// least its own) and a tile's sum of exp(s - mx) added; the sum and the accumulator are rescaled
// only where the max moved.
static inline void iq_vec_state_raise(float * st, int d, float mx, float tile_sum) {
    if (mx != st[0]) {
        const float alpha = expf(st[0] - mx);
        st[1] *= alpha;
        for (int c = 0; c < d; c++) {
            st[2 + c] *= alpha;
        }
        st[0] = mx;
    }
    st[1] += tile_sum;
}

extern const struct iq_vec_fns iq_vec_fns_scalar;

// The table of the best row (cpu/kernel-rows.h) the features f, lowered to the machine's,
// allow; and the one for the active features.
const struct iq_vec_fns * iq_vec_fns_for(iq_cpu_features f);
const struct iq_vec_fns * iq_vec(void);
