// The reference attention over a quantized KV cache: the specification the CPU and CUDA
// kernels are tested against (iq-qcache.h).
#include "iq-qcache.h"

#include "iq.h"

#include <stdlib.h>

// ---- reference attention ----

void iq_attn_state_init(float * st, int32_t n_head, int32_t head_dim) {
    for (int32_t i = 0; i < n_head; i++) {
        iq_softmax_init(st + (size_t) i * IQ_ATTN_STATE(head_dim), head_dim);
    }
}

void iq_attn_state_merge(float * dst, const float * src, int32_t n_head, int32_t head_dim) {
    for (int32_t i = 0; i < n_head; i++) {
        iq_softmax_merge(dst + (size_t) i * IQ_ATTN_STATE(head_dim), src + (size_t) i * IQ_ATTN_STATE(head_dim),
                         head_dim);
    }
}

void iq_attn_state_finish(const float * st, int32_t n_head, int32_t head_dim, float * out) {
    for (int32_t i = 0; i < n_head; i++) {
        iq_softmax_finish(st + (size_t) i * IQ_ATTN_STATE(head_dim), head_dim, out + (size_t) i * head_dim);
    }
}

// One key/value pair into the states of r query heads; bias[i] (or 0) is subtracted from
// head i's score.
static void iq_attend_token(const float * k, const float * v, const float * q, int32_t r, int32_t head_dim,
                            float scale, const float * bias, float * st) {
    for (int32_t i = 0; i < r; i++) {
        const float * qi = q + (size_t) i * head_dim;
        float * s = st + (size_t) i * IQ_ATTN_STATE(head_dim);
        float dot = 0.0f;
        for (int32_t c = 0; c < head_dim; c++) {
            dot += qi[c] * k[c];
        }
        iq_softmax_add(s, head_dim, dot * scale - (bias != NULL ? bias[i] : 0.0f), v);
    }
}

// The score correction of quantized token t for r query heads (iq_qcache_config.score_correction):
// var_t / 2 = sum_g d_tg^2 / 24 * sum_{c in g} (scale q_c n_c)^2; 0 outside the quantized region.
static void iq_qcache_score_bias(const struct iq_qcache * c, int32_t h, int32_t t, const float * q, int32_t r,
                                 float scale, float * bias) {
    const struct iq_qcache_config * cfg = &c->cfg;
    const int32_t dim = c->head_dim, g = cfg->group, j = (t - c->n_sink) / g, a = (t - c->n_sink) % g;
    const bool quantized = t >= c->n_sink && t < c->n_sink + c->n_quant;
    iq_fp16_t buf[2 * IQ_QCACHE_MAX_HEAD_DIM];
    const iq_fp16_t * d = iq_qblock_params_of(iq_qcache_block(c, false, h, quantized ? j : 0), cfg->bits_k, dim, g,
                                              iq_qcache_fmt(cfg, false), buf);
    const float * norm = iq_qcache_norm(c, h);
    for (int32_t i = 0; i < r; i++) {
        bias[i] = 0.0f;
        for (int32_t gi = 0; quantized && gi < dim / g; gi++) {
            float q2 = 0.0f;
            for (int32_t ch = gi * g; ch < (gi + 1) * g; ch++) {
                const float qn = scale * q[(size_t) i * dim + ch] * norm[ch];
                q2 += qn * qn;
            }
            const float dg = iq_fp16_to_fp32(d[gi * g + a]);
            bias[i] += dg * dg * q2 / 24.0f;
        }
    }
}

void iq_qcache_attend_ref(const struct iq_qcache * c, int32_t h, const float * q, int32_t r, float scale,
                          int32_t t0, int32_t t1, float * st) {
    enum { HEADS = 64 };  // query heads per pass (the biases of one token)
    float k[IQ_QCACHE_MAX_HEAD_DIM], v[IQ_QCACHE_MAX_HEAD_DIM], bias[HEADS];
    const bool correct = c->cfg.score_correction && c->cfg.axis_k == IQ_QAXIS_CHANNELS;
    const size_t dim = (size_t) c->head_dim;
    for (int32_t t = t0; t < t1; t++) {
        iq_qcache_read_token(c, h, t, k, v);
        for (int32_t i = 0; i < r; i += HEADS) {
            const int32_t n = r - i < HEADS ? r - i : HEADS;
            if (correct) {
                iq_qcache_score_bias(c, h, t, q + i * dim, n, scale, bias);
            }
            iq_attend_token(k, v, q + i * dim, n, c->head_dim, scale, correct ? bias : NULL,
                            st + (size_t) i * IQ_ATTN_STATE(dim));
        }
    }
}

void iq_attend_rows_ref(const float * k, const float * v, size_t ld, int32_t n, const float * q, int32_t r,
                        int32_t head_dim, float scale, float * st) {
    for (int32_t t = 0; t < n; t++) {
        iq_attend_token(k + t * ld, v + t * ld, q, r, head_dim, scale, NULL, st);
    }
}

bool iq_qcache_attention_ref(const struct iq_qcache * c, const float * q, int32_t n_head, const float * k,
                             const float * v, int32_t n_q, float scale, float * out) {
    const int32_t dim = c->head_dim, n_kv = c->n_kv_head;
    if (n_head <= 0 || n_head % n_kv != 0) {
        iq_error_set("attention: %d query heads is not a multiple of %d KV heads", n_head, n_kv);
        return false;
    }
    const int32_t r = n_head / n_kv;
    float * st = malloc((size_t) r * IQ_ATTN_STATE(dim) * sizeof(float));
    if (st == NULL) {
        iq_error_set("attention: out of memory");
        return false;
    }
    for (int32_t i = 0; i < n_q; i++) {
        for (int32_t h = 0; h < n_kv; h++) {
            const size_t head0 = ((size_t) i * n_head + (size_t) h * r) * dim;
            iq_attn_state_init(st, r, dim);
            iq_qcache_attend_ref(c, h, q + head0, r, scale, 0, c->n_tokens, st);
            if (k != NULL && v != NULL) {
                iq_attend_rows_ref(k + (size_t) h * dim, v + (size_t) h * dim, (size_t) n_kv * dim, i + 1, q + head0,
                                   r, dim, scale, st);
            }
            iq_attn_state_finish(st, r, dim, out + head0);
        }
    }
    free(st);
    return true;
}
