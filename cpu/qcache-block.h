// The InnerQ block kernel (iq_innerq_block_fn, qcache.h) written once over its two integer dot
// products, for the scalar kernel (qcache.c) and the aarch64 ones (arm/qcache-arm.h). The integer
// sums are exact whichever function computes them, and every float step is here, so each
// version's results are the scalar kernel's bit for bit.
#pragma once

#include "qcache.h"

#include <math.h>

// sum_{c < n} q8[c] u[c]: the int8 query against one key group's codes (n = G).
typedef int32_t (*iq_innerq_codes_dot_fn)(const int8_t * q8, const uint8_t * u, int32_t n);
// isum[c] = sum_{t < n} p8[t] u[t * dim + c] for the 16 channels c from u on (head_dim is a
// multiple of 16, iq-qcache.h).
typedef void (*iq_innerq_probs_dot_fn)(const uint8_t * p8, const uint8_t * u, int32_t dim, int32_t n,
                                       uint32_t * isum);
// u[i] = lv[u[i]] for i < n (n a multiple of 16, lv 16 bytes): key codes onto their levels.
typedef void (*iq_innerq_levels_fn)(const uint8_t * lv, uint8_t * u, size_t n);

// The row scales n_t of tokens [a, b) of a block as floats, ns[t - off], from their codes vs[t].
IQ_INNERQ_INLINE void iq_innerq_row_scales(const uint8_t * vs, int32_t a, int32_t b, int32_t off, float * ns) {
    for (int32_t t = a; t < b; t++) {
        ns[t - off] = iq_row_scale(vs[t]);
    }
}

// One head's softmax over the scores s[t - off] of tokens [a, b) of a block: raises the state's
// running max, adds w sum e to its l, and gives the values' weights: p8[t - off] = the u8 of e_t
// (times the row scale ns[t - off] over the block's largest e_t n_t where ns is not NULL), *wd
// the factor of d / 255 (w, times that largest), *we the factor of m (w sum e_t [n_t]). e_t =
// exp(s_t - max s), w = exp(max s - running max). The scalar and aarch64 kernels take every
// block here, the AVX-512 ones the blocks with row scales (AVX2 has its own vector form).
IQ_INNERQ_INLINE void iq_innerq_block_weights(const float * s, int32_t a, int32_t b, int32_t off, const float * ns,
                                              float * sti, int32_t dim, uint8_t * p8, float * wd, float * we) {
    float smax = -INFINITY;
    for (int32_t t = a; t < b; t++) {
        smax = s[t - off] > smax ? s[t - off] : smax;
    }
    float e[IQ_QGROUP_MAX];
    float e_sum = 0.0f, n_sum = 0.0f, n_max = 0.0f;
    for (int32_t t = a; t < b; t++) {
        const float x = iq_exp_poly(s[t - off] - smax);
        e_sum += x;
        e[t - a] = ns != NULL ? x * ns[t - off] : x;
        n_sum += e[t - a];
        n_max = e[t - a] > n_max ? e[t - a] : n_max;
    }
    const float w = iq_softmax_raise(sti, dim, smax);
    sti[1] += w * e_sum;
    const float inv = ns != NULL && n_max > 0.0f ? 1.0f / n_max : 1.0f;
    for (int32_t t = a; t < b; t++) {
        p8[t - off] = iq_p8(ns != NULL ? e[t - a] * inv : e[t - a]);
    }
    *wd = ns != NULL ? w * n_max / IQ_P8_MAX : w / IQ_P8_MAX;
    *we = ns != NULL ? w * n_sum : w * e_sum;
}

// Block of G tokens: key codes (lanes = tokens) and value codes (lanes = channels) are
// unpacked token-major first (keys on levels then mapped to them); the x86 kernels read the
// tiles in place instead.
IQ_INNERQ_INLINE void iq_innerq_block_run(const struct iq_qcache * c, const struct iq_innerq_block blk, int32_t a,
                                          int32_t b, const struct iq_innerq_query * q, float * st,
                                          iq_innerq_codes_dot_fn codes_dot, iq_innerq_probs_dot_fn probs_dot,
                                          iq_innerq_levels_fn levels) {
    const struct iq_qcache_config * cfg = &c->cfg;
    const int32_t dim = c->head_dim, g = cfg->group;
    uint8_t uk[IQ_QGROUP_MAX * IQ_QCACHE_MAX_HEAD_DIM], uv[IQ_QGROUP_MAX * IQ_QCACHE_MAX_HEAD_DIM];
    iq_qblock_codes(blk.k, IQ_QAXIS_CHANNELS, cfg->bits_k, dim, g, a, b, uk);
    if (blk.lk != NULL) {
        levels(blk.lk, uk, (size_t) (b - a) * dim);
    }
    iq_qblock_codes(blk.v, IQ_QAXIS_TOKENS, cfg->bits_v, dim, g, a, b, uv);
    float ns[IQ_QGROUP_MAX];  // the row scales, once for the r heads
    if (blk.vs != NULL) {
        iq_innerq_row_scales(blk.vs, a, b, a, ns);
    }
    for (int32_t i = 0; i < q->r; i++) {
        float s[IQ_QGROUP_MAX];
        for (int32_t t = a; t < b; t++) {
            const uint8_t * u = uk + (size_t) (t - a) * dim;
            float acc = 0.0f;
            for (int32_t gi = 0; gi < dim / g; gi++) {
                const int32_t isum = codes_dot(q->q8[i] + gi * g, u + gi * g, g);
                // d (sq isum - d q2): the product and the score correction -d^2 q2
                const float d = iq_fp16_to_fp32(blk.dk[gi * g + t]);
                acc = fmaf(d, fmaf(-d, q->q2[i][gi], (float) isum * q->sq[i][gi]), acc);
                acc = fmaf(iq_fp16_to_fp32(blk.mk[gi * g + t]), q->sumq[i][gi], acc);
            }
            s[t - a] = acc;
        }
        uint8_t p8[IQ_QGROUP_MAX];
        float * sti = st + (size_t) i * IQ_ATTN_STATE(dim);
        float wd, we;
        iq_innerq_block_weights(s, a, b, a, blk.vs != NULL ? ns : NULL, sti, dim, p8, &wd, &we);
        for (int32_t c0 = 0; c0 < dim; c0 += 16) {
            uint32_t isum[16];
            probs_dot(p8, uv + c0, dim, b - a, isum);
            for (int32_t ch = c0; ch < c0 + 16; ch++) {
                const float acc = fmaf(iq_fp16_to_fp32(blk.mv[ch]), we, sti[2 + ch]);
                sti[2 + ch] = fmaf(iq_fp16_to_fp32(blk.dv[ch]) * wd, (float) isum[ch - c0], acc);
            }
        }
    }
}
