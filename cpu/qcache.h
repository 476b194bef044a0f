// CPU attention over an InnerQ / KIVI cache (ggml_innerq/iq-qcache.h), in the scale-reuse
// form of docs/DESIGN.md section 3, for the r query heads of one KV head and one query:
//   keys:   s_t = sum_g [ d_tg * (sq_g * sum_{c in g} q8_c u_tc - d_tg * q2_g) + m_tg * sum_{c in g} qn_c ]
//           (q2_g = sum_{c in g} qn_c^2 / 24: the score correction, iq-qcache.h; 0 when off)
//   values: o_c += w * [ d_jc / 255 * sum_{t in j} p8_t u_tc + m_jc * E_j ]
//           (with value row scales n_t: p8_t = floor(255 e_t n_t / W + 0.5) with W = max_t e_t n_t,
//           d_jc W / 255 in place of d_jc / 255, and E_j = sum e_t n_t; l still adds sum e_t)
// (u_tc a key's code, or its level L[u_tc] where the block's keys are on the key levels,
// iq_qcache_config.key_levels: (d, m) and the rest of the arithmetic are the same.)
// qn = scale * q (.) n is quantized once per query to int8 per key group (qn ~ sq_g * q8_c);
// in each block j the probabilities e_t = exp(s_t - max_j s) are quantized to u8
// (p8_t = floor(255 e_t + 0.5)), E_j = sum e_t and w = exp(max_j s - running max). So the code
// dot products are integer (vpdpbusd / pmaddubsw) and each (d, m) is read once per group.
// That is the only approximation next to iq_qcache_attend_ref: on random caches (K3 V2 G64)
// an rms error of 0.3-0.8% of the values' rms, a tenth of the cache's own quantization error.
// Every ISA computes the same q8 and p8 bit for bit, so ISAs agree to float rounding.
// Sink and recent windows (f16) and a batch's own rows (f32) are exact.
//
// KIVI blocks group the other way (keys per channel over the block's tokens, values per token
// over G channels), so a group's scale multiplies the query or the probability instead of
// factoring out of a code dot product. Per block and head, in f32 and exact to float rounding:
//   keys:   q'_c = qs_c n_c d_c, C = sum_c qs_c n_c m_c;  s_t = C + sum_c q'_c u_tc
//   values: W_tg = w e_t d_tg, M_g = w sum_t e_t m_tg;     o_c += M_g + sum_t W_tg u_tc
// with e_t = exp(s_t - max_j s) and w as above; g is the value group of channel c.
#pragma once

#include "iq-cpu.h"
#include "iq-qcache.h"

#ifdef __cplusplus
extern "C" {
#endif

#define IQ_INNERQ_MAX_R 8  // query heads per KV head in one call

// One query of the r heads of KV head h, prepared once (iq_innerq_query_prep).
struct iq_innerq_query {
    int32_t r, head_dim;
    float qs[IQ_INNERQ_MAX_R * IQ_QCACHE_MAX_HEAD_DIM];   // scale * q, head i at qs + i * head_dim: rows, KIVI
    int8_t q8[IQ_INNERQ_MAX_R][IQ_QCACHE_MAX_HEAD_DIM];   // scale * q (.) n, int8 per key group
    float sq[IQ_INNERQ_MAX_R][IQ_QCACHE_MAX_GROUPS];      // the group's step: qn ~ sq * q8
    float sumq[IQ_INNERQ_MAX_R][IQ_QCACHE_MAX_GROUPS];    // sum of qn over the group
    float q2[IQ_INNERQ_MAX_R][IQ_QCACHE_MAX_GROUPS];      // score correction: sum qn^2 / 24 (0 if off)
};

// Online-softmax updates of the r states st[r][IQ_ATTN_STATE(D)] (iq-qcache.h).
// rows: n rows of keys k[t*ld ..] and values v[t*ld ..] (f16 or f32 per the table entry).
typedef void (*iq_innerq_rows_fn)(const void * k, const void * v, size_t ld, int32_t n,
                                  const struct iq_innerq_query * q, float * st);
// block: tokens [a, b) of block j of KV head h: InnerQ (keys along channels, values along
// tokens) for block, the same with 8-bit group parameters (iq_qcache_config.params8) for
// block_p8, KIVI (keys along tokens, values along channels) for kivi_block. A format's blocks
// have a kernel of their own, so that none of them tests the format per block.
typedef void (*iq_innerq_block_fn)(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                                   const struct iq_innerq_query * q, float * st);
// The fp16 d[D], m[D] of a block's 8-bit group parameters, iq_p8_decode_block's bits.
typedef void (*iq_p8_decode_fn)(const uint8_t * params, int32_t head_dim, float centre, iq_fp16_t * dm);

struct iq_innerq_kernels {
    const char * name;
    iq_innerq_rows_fn rows_f16;
    iq_innerq_rows_fn rows_f32;
    iq_innerq_block_fn block;
    iq_innerq_block_fn block_p8;
    iq_innerq_block_fn kivi_block;
};

extern const struct iq_innerq_kernels iq_innerq_kernels_scalar;

// The kernels of the best row (cpu/kernel-rows.h) that the features f, lowered to the
// machine's, allow.
const struct iq_innerq_kernels * iq_innerq_kernels_for(iq_cpu_features f);

// Prepares q[r][head_dim] (query heads h*r .. h*r+r-1) against KV head h. false (+ iq_error_set)
// unless 1 <= r <= IQ_INNERQ_MAX_R (split larger groups of heads into several queries) and the
// cache has the InnerQ or the KIVI axes (the two layouts the kernels read).
bool iq_innerq_query_prep(const struct iq_qcache * c, int32_t h, const float * q, int32_t r, float scale,
                          struct iq_innerq_query * qp);

// Adds stored tokens [t0, t1) of KV head h to the states st[r], 0 <= t0 <= t1 <= n_tokens.
// Threads split the tokens on iq_qcache_split boundaries and merge with iq_attn_state_merge
// (any other split works too; one inside a block changes where that block's p8 are quantized).
void iq_innerq_attend(const struct iq_innerq_kernels * kt, const struct iq_qcache * c, int32_t h,
                      const struct iq_innerq_query * qp, int32_t t0, int32_t t1, float * st);

// The key levels (iq-qcache-math.h) as the kernels' byte shuffles read them: L[0..7], then 8
// zero bytes.
static inline const uint8_t * iq_innerq_key_levels(void) {
    static const uint8_t lv[16] = IQ_KEY_LEVELS;
    return lv;
}

// Block j of KV head h: the codes and (d, m) of its keys and values (iq-qcache.h layout).
struct iq_innerq_block {
    const uint8_t * k, * v;
    const iq_fp16_t * dk, * mk, * dv, * mv;
    const uint8_t * vs;  // the values' row scale codes (NULL: none, iq_qcache_config.value_scales)
    const uint8_t * lk;  // the key codes' levels (iq_innerq_key_levels; NULL: uniform, u itself)
};
// The key levels of a layer's blocks: its 3-bit keys with iq_qcache_config.key_levels, else NULL.
static inline const uint8_t * iq_innerq_block_levels(const struct iq_qcache_config * cfg) {
    return iq_qblock_levels(cfg->bits_k, iq_qcache_fmt(cfg, false)) ? iq_innerq_key_levels() : NULL;
}
static inline struct iq_innerq_block iq_innerq_block_get(const struct iq_qcache * c, int32_t h, int32_t j) {
    const struct iq_qcache_config * cfg = &c->cfg;
    const uint8_t * k = iq_qcache_block(c, false, h, j), * v = iq_qcache_block(c, true, h, j);
    const iq_fp16_t * dk = iq_qblock_params(k, cfg->bits_k, c->head_dim, cfg->group);
    const iq_fp16_t * dv = iq_qblock_params(v, cfg->bits_v, c->head_dim, cfg->group);
    const uint8_t * vs = cfg->value_scales ? v + iq_qblock_bytes(cfg->bits_v, c->head_dim, cfg->group) : NULL;
    return (struct iq_innerq_block) {k, v, dk, dk + c->head_dim, dv, dv + c->head_dim, vs, iq_innerq_block_levels(cfg)};
}
// The same for a block with 8-bit group parameters: its (d, m) decoded by decode into the
// calling thread's scratch, valid until its next call (a kernel reads one block at a time).
struct iq_innerq_block iq_innerq_block_get_p8(const struct iq_qcache * c, int32_t h, int32_t j,
                                              iq_p8_decode_fn decode);

// ---- shared by the ISA files ----
// Rows (f16 windows, f32 batch rows) through the plain cache types' vector kernels of one ISA
// (iq_attn_rows_vec, attention.h): the r heads share every key and value row, tile by tile.
struct iq_vec_fns;
void iq_innerq_rows_vec(const struct iq_vec_fns * vec, const void * k, const void * v, size_t ld, int32_t n, bool f16,
                        const struct iq_innerq_query * q, float * st);

// The scalar KIVI block kernel, for the vector tables that have none of their own.
void iq_innerq_kivi_block_scalar(const struct iq_qcache * c, int32_t h, int32_t j, int32_t a, int32_t b,
                                 const struct iq_innerq_query * q, float * st);

// The kernels' exp (iq_exp_poly) and the state update (iq_softmax_raise) of
// iq-qcache-math.h, as functions for the ISA files and the tests; the constants are there too
// (IQ_EXP_*, IQ_ROUND_SHIFT, IQ_P8_MAX), so every ISA and device computes the same p8.
float iq_innerq_exp(float x);
// Raises the running max of one head's state to at least mx (rescaling l and acc) and returns
// exp(mx - running max), the weight of a chunk whose scores are relative to mx.
float iq_innerq_state_raise(float * st, int32_t head_dim, float mx);

// The SIMD KIVI kernels read the codes of a tile (16 lanes x 4 subs, iq-qcache.h) as floats,
// lane by lane with its 4 subs, so each lane's multiplier (q'_c for keys, W_tg for values) is
// stored 4 times: x4[4 lane + sub]. A head's multipliers of one block take at most
// IQ_INNERQ_KIVI_MUL floats (keys: [D][4]; values: [D/G groups][G tokens][4]).
#define IQ_INNERQ_KIVI_MUL (4 * IQ_QCACHE_MAX_HEAD_DIM)

// The SIMD kernels specialize their inner loops on (bits, R), R = query heads in one pass
// (1..4, larger r goes in passes), so codes and accumulators stay in registers:
// IQ_INNERQ_DISPATCH(call, bits, n) runs call(b, r) with constants b = bits and r = min(n, 4).
#define IQ_INNERQ_INLINE static inline __attribute__((always_inline))
#define IQ_INNERQ_DISPATCH_R(call, bits, n) \
    switch (n) {                            \
        case 1: call(bits, 1); break;     \
        case 2: call(bits, 2); break;     \
        case 3: call(bits, 3); break;     \
        default: call(bits, 4); break;    \
    }
#define IQ_INNERQ_DISPATCH(call, bits, n)                \
    switch (bits) {                                   \
        case 2: IQ_INNERQ_DISPATCH_R(call, 2, n); break; \
        case 3: IQ_INNERQ_DISPATCH_R(call, 3, n); break; \
        case 4: IQ_INNERQ_DISPATCH_R(call, 4, n); break; \
        default: IQ_INNERQ_DISPATCH_R(call, 5, n); break; \
    }
// The InnerQ keys' call: call_lv(3, r) where the block's keys are on the key levels (levels:
// iq_innerq_block.lk != NULL, 3-bit keys), else call(bits, r).
#define IQ_INNERQ_DISPATCH_KEYS(call, call_lv, bits, levels, n) \
    if (levels) {                                              \
        IQ_INNERQ_DISPATCH_R(call_lv, 3, n);                   \
    } else {                                                   \
        IQ_INNERQ_DISPATCH(call, bits, n);                     \
    }
// The KIVI kernels' bits: 2 to 4.
#define IQ_KIVI_DISPATCH(call, bits, n)                  \
    switch (bits) {                                   \
        case 2: IQ_INNERQ_DISPATCH_R(call, 2, n); break; \
        case 3: IQ_INNERQ_DISPATCH_R(call, 3, n); break; \
        default: IQ_INNERQ_DISPATCH_R(call, 4, n); break; \
    }

#ifdef __cplusplus
}
#endif
