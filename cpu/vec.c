// Scalar kernels (the specification of vec.h) and the choice of table by features.
#include "vec.h"

#include "kernel-rows.h"

#include <math.h>

static inline float vec_elem(const void * row, int64_t i, bool half) {
    return half ? iq_fp16_to_fp32(((const iq_fp16_t *) row)[i]) : ((const float *) row)[i];
}

static inline void vec_scores_rows(bool half, int d, int n, const void * k, int64_t ks, int nq, const float * q,
                                   float * s, int64_t ss) {
    for (int j = 0; j < nq; j++) {
        for (int t = 0; t < n; t++) {
            float acc = 0.0f;
            for (int c = 0; c < d; c++) {
                acc += q[(int64_t) j * d + c] * vec_elem(k, t * ks + c, half);
            }
            s[j * ss + t] = acc;
        }
    }
}

static inline void vec_accum_rows(bool half, int d, int n, const void * v, int64_t vs, int nq, const float * p,
                                  int64_t ps, float * o, int64_t os) {
    for (int j = 0; j < nq; j++) {
        for (int t = 0; t < n; t++) {
            const float w = p[j * ps + t];
            for (int c = 0; c < d; c++) {
                o[j * os + c] += w * vec_elem(v, t * vs + c, half);
            }
        }
    }
}

static void vec_scores_scalar(int d, int n, const void * k, int64_t ks, int nq, const float * q, float * s,
                              int64_t ss) {
    vec_scores_rows(false, d, n, k, ks, nq, q, s, ss);
}

static void vec_scores_f16_scalar(int d, int n, const void * k, int64_t ks, int nq, const float * q, float * s,
                                  int64_t ss) {
    vec_scores_rows(true, d, n, k, ks, nq, q, s, ss);
}

static void vec_accum_scalar(int d, int n, const void * v, int64_t vs, int nq, const float * p, int64_t ps,
                             float * o, int64_t os) {
    vec_accum_rows(false, d, n, v, vs, nq, p, ps, o, os);
}

static void vec_accum_f16_scalar(int d, int n, const void * v, int64_t vs, int nq, const float * p, int64_t ps,
                                 float * o, int64_t os) {
    vec_accum_rows(true, d, n, v, vs, nq, p, ps, o, os);
}

static void vec_softmax_scalar(int d, int n, int nq, const int * visible, float * s, int64_t ss, float * st,
                               int64_t sts) {
    for (int j = 0; j < nq; j++) {
        float * sj = s + j * ss;
        float * stj = st + j * sts;
        const int nv = visible != NULL ? visible[j] : n;
        if (nv > 0) {
            float mx = stj[0];
            for (int i = 0; i < nv; i++) {
                mx = sj[i] > mx ? sj[i] : mx;
            }
            float sum = 0.0f;
            for (int i = 0; i < nv; i++) {
                sj[i] = expf(sj[i] - mx);
                sum += sj[i];
            }
            iq_vec_state_raise(stj, d, mx, sum);
        }
        for (int i = nv > 0 ? nv : 0; i < n; i++) {
            sj[i] = 0.0f;
        }
    }
}

static void vec_swiglu_scalar(int64_t n, float * y, const float * g, const float * u) {
    for (int64_t i = 0; i < n; i++) {
        y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static void vec_to_f16_scalar(int64_t n, iq_fp16_t * y, const float * x) {
    for (int64_t i = 0; i < n; i++) {
        y[i] = iq_fp32_to_fp16(x[i]);
    }
}

const struct iq_vec_fns iq_vec_fns_scalar = {
    .scores = vec_scores_scalar,
    .scores_f16 = vec_scores_f16_scalar,
    .accum = vec_accum_scalar,
    .accum_f16 = vec_accum_f16_scalar,
    .softmax = vec_softmax_scalar,
    .swiglu = vec_swiglu_scalar,
    .to_f16 = vec_to_f16_scalar,
};

static const void * vec_row_table(const struct iq_cpu_kernel_row * r) { return r->vec; }

const struct iq_vec_fns * iq_vec_fns_for(iq_cpu_features f) {
    return iq_cpu_kernel_rows_best(f, vec_row_table, &iq_vec_fns_scalar);
}

const struct iq_vec_fns * iq_vec(void) { return iq_vec_fns_for(iq_cpu_features_active()); }

void iq_cpu_install_qsearch(void) { iq_qblock_set_search(iq_vec()->qsearch); }

void iq_cpu_scores(int d, int n, const float * k, int nq, const float * q, float * s, int64_t ss) {
    iq_vec()->scores(d, n, k, d, nq, q, s, ss);
}

void iq_cpu_accum(int d, int n, const float * v, int nq, const float * p, int64_t ps, float * o) {
    iq_vec()->accum(d, n, v, d, nq, p, ps, o, d);
}

void iq_cpu_softmax(int n, int nq, float * s, int64_t ss) {
    const struct iq_vec_fns * vec = iq_vec();
    for (int j = 0; j < nq; j++) {
        float * sj = s + j * ss, st[2] = { -INFINITY, 0.0f };  // a state of no accumulator
        vec->softmax(0, n, 1, NULL, sj, ss, st, 2);
        const float inv = 1.0f / st[1];
        for (int t = 0; t < n; t++) {
            sj[t] *= inv;
        }
    }
}
