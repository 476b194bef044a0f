// InnerQ / KIVI attention on the CPU: query preparation, the walk over a token range's
// regions, and the portable scalar kernels, which are the specification of the vector ones in
// cpu/x86/ and cpu/arm/ (qcache.h describes the arithmetic).
#include "qcache.h"
#include "qcache-block.h"

#include "attention.h"
#include "kernel-rows.h"
#include "iq.h"
#include "vec.h"

#include <math.h>

void iq_innerq_rows_vec(const struct iq_vec_fns * vec, const void * k, const void * v, size_t ld, int32_t n, bool f16,
                        const struct iq_innerq_query * q, float * st) {
    float s[IQ_INNERQ_MAX_R * IQ_ATTN_TILE];
    const size_t es = f16 ? sizeof(iq_fp16_t) : sizeof(float);
    for (int32_t t = 0; t < n; t += IQ_ATTN_TILE) {
        const int m = n - t < IQ_ATTN_TILE ? n - t : IQ_ATTN_TILE;
        const size_t off = (size_t) t * ld * es;
        iq_attn_rows_vec(vec, q->head_dim, m, (const char *) k + off, f16, (int64_t) ld, (const char *) v + off, f16,
                         (int64_t) ld, q->r, q->qs, NULL, st, s);
    }
}

float iq_innerq_exp(float x) { return iq_exp_poly(x); }

float iq_innerq_state_raise(float * st, int32_t head_dim, float mx) { return iq_softmax_raise(st, head_dim, mx); }

bool iq_innerq_query_prep(const struct iq_qcache * c, int32_t h, const float * q, int32_t r, float scale,
                          struct iq_innerq_query * qp) {
    if (r < 1 || r > IQ_INNERQ_MAX_R || h < 0 || h >= c->n_kv_head) {
        iq_error_set("attention: %d query heads against KV head %d (at most %d heads of one of %d KV heads)", r, h,
                     IQ_INNERQ_MAX_R, c->n_kv_head);
        return false;
    }
    if (c->cfg.axis_k == c->cfg.axis_v) {
        iq_error_set("attention: keys and values grouped along the same axis (the kernels read InnerQ and KIVI "
                     "caches only)");
        return false;
    }
    const int32_t dim = c->head_dim, g = c->cfg.group;
    const float * norm = iq_qcache_norm(c, h);
    qp->r = r;
    qp->head_dim = dim;
    for (int32_t i = 0; i < r; i++) {
        for (int32_t ch = 0; ch < dim; ch++) {
            qp->qs[i * dim + ch] = scale * q[(size_t) i * dim + ch];
        }
        if (c->cfg.axis_k != IQ_QAXIS_CHANNELS) {
            continue;  // KIVI blocks read qs
        }
        for (int32_t gi = 0; gi < dim / g; gi++) {
            iq_query_prep_group(qp->qs + i * dim + gi * g, norm + gi * g, g, c->cfg.score_correction,
                                qp->q8[i] + gi * g, &qp->sq[i][gi], &qp->sumq[i][gi], &qp->q2[i][gi]);
        }
    }
    return true;
}

// Asks for block j of KV head h's keys ahead of its kernel. A long context's blocks stream from
// memory, block after block, and the hardware's prefetchers did not keep up with them: on
// SmolLM2 at 16K tokens a decode step's blocks took 1.5x (3-bit keys) and 2.7x (4-bit) their
// time with the cache hot (docs/BENCHMARKS.md "The next block prefetched"). The keys only: asking
// for the values too took the op, cold, 1.00x-1.07x the time with 3-bit keys and 0.97x-1.03x with
// 4-bit (same file, "The keys' prefetch only").
// Inlined: GCC takes a function of prefetches alone for a pure one and drops its calls.
IQ_INNERQ_INLINE void iq_innerq_prefetch(const struct iq_qcache * c, int32_t h, int32_t j) {
    const uint8_t * k = iq_qcache_block(c, false, h, j);
    for (size_t o = 0; o < c->block_bytes_k; o += 64) {
        __builtin_prefetch(k + o);
    }
}

void iq_innerq_attend(const struct iq_innerq_kernels * kt, const struct iq_qcache * c, int32_t h,
                      const struct iq_innerq_query * qp, int32_t t0, int32_t t1, float * st) {
    const int32_t dim = c->head_dim, g = c->cfg.group;
    const int32_t q0 = c->n_sink, q1 = c->n_sink + c->n_quant;
    const iq_innerq_block_fn block = c->cfg.axis_k != IQ_QAXIS_CHANNELS ? kt->kivi_block
                                     : c->cfg.params8                   ? kt->block_p8
                                                                        : kt->block;
    if (t0 < q0) {
        const int32_t e = t1 < q0 ? t1 : q0;
        kt->rows_f16(iq_qcache_sink(c, false, h) + (size_t) t0 * dim, iq_qcache_sink(c, true, h) + (size_t) t0 * dim,
                     (size_t) dim, e - t0, qp, st);
    }
    const int32_t qe = t1 < q1 ? t1 : q1;
    for (int32_t t = t0 > q0 ? t0 : q0; t < qe;) {
        const int32_t j = (t - q0) / g, a = (t - q0) % g;
        const int32_t b = qe - q0 - j * g < g ? qe - q0 - j * g : g;
        if (q0 + (j + 1) * g < qe) {
            iq_innerq_prefetch(c, h, j + 1);  // the next block is read next
        }
        block(c, h, j, a, b, qp, st);
        t += b - a;
    }
    const int32_t r0 = t0 > q1 ? t0 : q1;
    if (r0 < t1) {
        const size_t off = (size_t) (r0 - q1) * dim;
        kt->rows_f16(iq_qcache_recent(c, false, h) + off, iq_qcache_recent(c, true, h) + off, (size_t) dim, t1 - r0,
                     qp, st);
    }
}

// ---- scalar kernels ----

// One token at a time: score, raise the running max, accumulate.
static void iq_innerq_rows_scalar(const void * k, const void * v, size_t ld, int32_t n, bool f16,
                                  const struct iq_innerq_query * q, float * st) {
    const int32_t dim = q->head_dim;
    float kr[IQ_QCACHE_MAX_HEAD_DIM], vr[IQ_QCACHE_MAX_HEAD_DIM];
    for (int32_t t = 0; t < n; t++) {
        for (int32_t c = 0; c < dim; c++) {
            const size_t i = (size_t) t * ld + c;
            kr[c] = f16 ? iq_fp16_to_fp32(((const iq_fp16_t *) k)[i]) : ((const float *) k)[i];
            vr[c] = f16 ? iq_fp16_to_fp32(((const iq_fp16_t *) v)[i]) : ((const float *) v)[i];
        }
        for (int32_t i = 0; i < q->r; i++) {
            float * s = st + (size_t) i * IQ_ATTN_STATE(dim);
            float dot = 0.0f;
            for (int32_t c = 0; c < dim; c++) {
                dot += q->qs[i * dim + c] * kr[c];
            }
            const float p = iq_softmax_raise(s, dim, dot);
            s[1] += p;
            for (int32_t c = 0; c < dim; c++) {
                s[2 + c] += p * vr[c];
            }
        }
    }
}

static void iq_innerq_rows_f16_scalar(const void * k, const void * v, size_t ld, int32_t n,
                                      const struct iq_innerq_query * q, float * st) {
    iq_innerq_rows_scalar(k, v, ld, n, true, q, st);
}

static void iq_innerq_rows_f32_scalar(const void * k, const void * v, size_t ld, int32_t n,
                                      const struct iq_innerq_query * q, float * st) {
    iq_innerq_rows_scalar(k, v, ld, n, false, q, st);
}

// sum_{c < n} q8[c] u[c].
static int32_t iq_innerq_codes_dot_scalar(const int8_t * q8, const uint8_t * u, int32_t n) {
    int32_t isum = 0;
    for (int32_t c = 0; c < n; c++) {
        isum += q8[c] * u[c];
    }
    return isum;
}

// isum[c] = sum_{t < n} p8[t] u[t * dim + c] for the 16 channels c from u on.
static void iq_innerq_probs_dot_scalar(const uint8_t * p8, const uint8_t * u, int32_t dim, int32_t n,
                                       uint32_t * isum) {
    for (int32_t c = 0; c < 16; c++) {
        uint32_t sum = 0;
        for (int32_t t = 0; t < n; t++) {
            sum += p8[t] * u[(size_t) t * dim + c];
        }
        isum[c] = sum;
    }
}

// u[i] = lv[u[i]] for i < n.
static void iq_innerq_levels_scalar(const uint8_t * lv, uint8_t * u, size_t n) {
    for (size_t i = 0; i < n; i++) {
        u[i] = lv[u[i]];
    }
}

// Block of G tokens: iq_innerq_block_run (qcache-block.h) with its integer sums in plain loops.
static void iq_innerq_block_scalar(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                                   const struct iq_innerq_query * q, float * st) {
    iq_innerq_block_run(c, iq_innerq_block_get(c, h, j), a, b, q, st, iq_innerq_codes_dot_scalar,
                        iq_innerq_probs_dot_scalar, iq_innerq_levels_scalar);
}

static void iq_innerq_block_p8_scalar(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                                      const struct iq_innerq_query * q, float * st) {
    iq_innerq_block_run(c, iq_innerq_block_get_p8(c, h, j, iq_p8_decode_block), a, b, q, st,
                        iq_innerq_codes_dot_scalar, iq_innerq_probs_dot_scalar, iq_innerq_levels_scalar);
}

// KIVI block: codes unpacked token-major first, as in iq_innerq_block_scalar. Keys have their
// (d, m) per channel, values per (channel group gi, token t) at gi * G + t.
void iq_innerq_kivi_block_scalar(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                                        const struct iq_innerq_query * q, float * st) {
    const struct iq_qcache_config * cfg = &c->cfg;
    const int32_t dim = c->head_dim, g = cfg->group, n = b - a;
    const struct iq_innerq_block blk = iq_innerq_block_get(c, h, j);
    const float * norm = iq_qcache_norm(c, h);
    uint8_t uk[IQ_QGROUP_MAX * IQ_QCACHE_MAX_HEAD_DIM], uv[IQ_QGROUP_MAX * IQ_QCACHE_MAX_HEAD_DIM];
    iq_qblock_codes(blk.k, IQ_QAXIS_TOKENS, cfg->bits_k, dim, g, a, b, uk);
    iq_qblock_codes(blk.v, IQ_QAXIS_CHANNELS, cfg->bits_v, dim, g, a, b, uv);
    for (int32_t i = 0; i < q->r; i++) {
        float qk[IQ_QCACHE_MAX_HEAD_DIM], base = 0.0f;
        for (int32_t ch = 0; ch < dim; ch++) {
            const float qn = q->qs[i * dim + ch] * norm[ch];
            qk[ch] = qn * iq_fp16_to_fp32(blk.dk[ch]);
            base += qn * iq_fp16_to_fp32(blk.mk[ch]);
        }
        float s[IQ_QGROUP_MAX];
        float smax = -INFINITY;
        for (int32_t t = 0; t < n; t++) {
            float acc = base;
            for (int32_t ch = 0; ch < dim; ch++) {
                acc += qk[ch] * (float) uk[(size_t) t * dim + ch];
            }
            s[t] = acc;
            smax = acc > smax ? acc : smax;
        }
        float * sti = st + (size_t) i * IQ_ATTN_STATE(dim);
        const float w = iq_softmax_raise(sti, dim, smax);
        float e_sum = 0.0f;
        for (int32_t t = 0; t < n; t++) {
            s[t] = iq_exp_poly(s[t] - smax);
            e_sum += s[t];
        }
        sti[1] += w * e_sum;
        for (int32_t gi = 0; gi < dim / g; gi++) {
            float mg = 0.0f;
            for (int32_t t = 0; t < n; t++) {
                const float we = w * s[t];
                const float wd = we * iq_fp16_to_fp32(blk.dv[gi * g + a + t]);
                mg += we * iq_fp16_to_fp32(blk.mv[gi * g + a + t]);
                for (int32_t ch = gi * g; ch < (gi + 1) * g; ch++) {
                    sti[2 + ch] += wd * (float) uv[(size_t) t * dim + ch];
                }
            }
            for (int32_t ch = gi * g; ch < (gi + 1) * g; ch++) {
                sti[2 + ch] += mg;
            }
        }
    }
}

const struct iq_innerq_kernels iq_innerq_kernels_scalar = {
    "scalar", iq_innerq_rows_f16_scalar, iq_innerq_rows_f32_scalar, iq_innerq_block_scalar,
    iq_innerq_block_p8_scalar, iq_innerq_kivi_block_scalar,
};

static const void * iq_innerq_row_table(const struct iq_cpu_kernel_row * r) { return r->innerq; }

const struct iq_innerq_kernels * iq_innerq_kernels_for(iq_cpu_features f) {
    return iq_cpu_kernel_rows_best(f, iq_innerq_row_table, &iq_innerq_kernels_scalar);
}

struct iq_innerq_block iq_innerq_block_get_p8(const struct iq_qcache * c, int32_t h, int32_t j,
                                              iq_p8_decode_fn decode) {
    static _Thread_local iq_fp16_t buf[4 * IQ_QCACHE_MAX_HEAD_DIM];
    const struct iq_qcache_config * cfg = &c->cfg;
    const int32_t dim = c->head_dim, g = cfg->group;
    const unsigned fv = iq_qcache_fmt(cfg, true);
    const uint8_t * k = iq_qcache_block(c, false, h, j), * v = iq_qcache_block(c, true, h, j);
    const uint8_t * lk = iq_innerq_block_levels(cfg);
    decode(k + iq_qblock_params_offset(cfg->bits_k, dim, g), dim, iq_grid_centre(1 << cfg->bits_k, lk != NULL), buf);
    decode(v + iq_qblock_params_offset(cfg->bits_v, dim, g), dim, iq_grid_centre(1 << cfg->bits_v, false),
           buf + 2 * dim);
    const uint8_t * vs = (fv & IQ_QBLOCK_ROW_SCALES) ? v + iq_qblock_scales_offset(cfg->bits_v, dim, g, fv) : NULL;
    return (struct iq_innerq_block) {k, v, buf, buf + dim, buf + 2 * dim, buf + 3 * dim, vs, lk};
}
