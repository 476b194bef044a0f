// Scalar dot products (the specification the SIMD kernels are tested against) and the
// dispatch of the CPU type traits by feature set.
//
// A dot product reads a weight row x in its own format and an activation row y already
// converted to the weight type's vec_dot_type; integer code products are summed exactly and
// each block's scales are applied once to the block's integer sum.
#include "kernel-rows.h"
#include "quants-rows.h"

#include "iq-quants.h"

#include <pthread.h>

static float iq_fp16(iq_fp16_t h) { return iq_fp16_to_fp32(h); }

static void iq_vec_dot_f32_f32(int64_t n, float * s, const void * vx, const void * vy) {
    const float * x = vx;
    const float * y = vy;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        sum += x[i] * y[i];
    }
    *s = sum;
}

static void iq_vec_dot_f16_f32(int64_t n, float * s, const void * vx, const void * vy) {
    const iq_fp16_t * x = vx;
    const float * y = vy;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        sum += iq_fp16_to_fp32(x[i]) * y[i];
    }
    *s = sum;
}

static void iq_vec_dot_bf16_f32(int64_t n, float * s, const void * vx, const void * vy) {
    const iq_bf16_t * x = vx;
    const float * y = vy;
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        sum += iq_bf16_to_fp32(x[i]) * y[i];
    }
    *s = sum;
}

// sum (q[j] - offset) * y[j]: unsigned weight codes with their zero point, signed activations.
static int iq_dot_codes(const uint8_t * q, const int8_t * y, int n, int offset) {
    int sum = 0;
    for (int j = 0; j < n; j++) {
        sum += (q[j] - offset) * y[j];
    }
    return sum;
}

// q4_0 / q5_0 . q8_0: symmetric codes (zero point 8 / 16), one fp16 scale per block each side.
static float iq_dot_block_sym(const uint8_t * qs, const uint8_t * qh, int offset, iq_fp16_t d,
                              const block_q8_0 * y) {
    uint8_t q[32];
    iq_unpack_codes_32(qs, qh, q);
    return (float) iq_dot_codes(q, y->qs, 32, offset) * (iq_fp16(d) * iq_fp16(y->d));
}

static void iq_vec_dot_q4_0_q8_0(int64_t n, float * s, const void * vx, const void * vy) {
    const block_q4_0 * x = vx;
    const block_q8_0 * y = vy;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK4_0; i++) {
        sum += iq_dot_block_sym(x[i].qs, NULL, 8, x[i].d, &y[i]);
    }
    *s = sum;
}

static void iq_vec_dot_q5_0_q8_0(int64_t n, float * s, const void * vx, const void * vy) {
    const block_q5_0 * x = vx;
    const block_q8_0 * y = vy;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK5_0; i++) {
        sum += iq_dot_block_sym(x[i].qs, x[i].qh, 16, x[i].d, &y[i]);
    }
    *s = sum;
}

// q4_1 / q5_1 . q8_1: x = d u + m, so x . y = d dy sum(u qy) + m (dy sum(qy)) = ... + m s.
static float iq_dot_block_asym(const uint8_t * qs, const uint8_t * qh, iq_fp16_t d, iq_fp16_t m,
                               const block_q8_1 * y) {
    uint8_t q[32];
    iq_unpack_codes_32(qs, qh, q);
    return (float) iq_dot_codes(q, y->qs, 32, 0) * (iq_fp16(d) * iq_fp16(y->d)) + iq_fp16(m) * iq_fp16(y->s);
}

static void iq_vec_dot_q4_1_q8_1(int64_t n, float * s, const void * vx, const void * vy) {
    const block_q4_1 * x = vx;
    const block_q8_1 * y = vy;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK4_1; i++) {
        sum += iq_dot_block_asym(x[i].qs, NULL, x[i].d, x[i].m, &y[i]);
    }
    *s = sum;
}

static void iq_vec_dot_q5_1_q8_1(int64_t n, float * s, const void * vx, const void * vy) {
    const block_q5_1 * x = vx;
    const block_q8_1 * y = vy;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK5_1; i++) {
        sum += iq_dot_block_asym(x[i].qs, x[i].qh, x[i].d, x[i].m, &y[i]);
    }
    *s = sum;
}

static void iq_vec_dot_q8_0_q8_0(int64_t n, float * s, const void * vx, const void * vy) {
    const block_q8_0 * x = vx;
    const block_q8_0 * y = vy;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK8_0; i++) {
        int sumi = 0;
        for (int j = 0; j < QK8_0; j++) {
            sumi += x[i].qs[j] * y[i].qs[j];
        }
        sum += (float) sumi * (iq_fp16(x[i].d) * iq_fp16(y[i].d));
    }
    *s = sum;
}

// q4_K / q5_K . q8_K: x = d sc_j u - dmin m_j per sub-block j of 32; the min term needs only
// the activation sums over each sub-block, which q8_K carries (bsums, per 16).
static float iq_dot_block_k4(const uint8_t * scales, const uint8_t * qs, const uint8_t * qh, iq_fp16_t d,
                             iq_fp16_t dmin, const block_q8_K * y) {
    uint8_t q[QK_K], sc[8], m[8];
    iq_unpack_scales_k4(scales, sc, m);
    iq_unpack_codes_k4(qs, qh, q);
    int sumi = 0, summ = 0;
    for (int j = 0; j < 8; j++) {
        sumi += sc[j] * iq_dot_codes(q + 32 * j, y->qs + 32 * j, 32, 0);
        summ += m[j] * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
    }
    return iq_fp16(d) * y->d * (float) sumi - iq_fp16(dmin) * y->d * (float) summ;
}

// sum v y over n signed values.
static int iq_dot_values(const int8_t * v, const int8_t * y, int n) {
    int sum = 0;
    for (int j = 0; j < n; j++) {
        sum += v[j] * y[j];
    }
    return sum;
}

// sum_g scale[g] sum (q y) over the 16 groups of 16 of a 256-element block.
static int32_t iq_dot_groups_16(const int8_t * q, const int8_t * scale, const int8_t * y) {
    int sum = 0;
    for (int g = 0; g < QK_K / 16; g++) {
        sum += scale[g] * iq_dot_values(q + 16 * g, y + 16 * g, 16);
    }
    return sum;
}

// q2_K / q3_K . q8_K: codes 0..3 (q2_K) or -4..3 (q3_K, hmask), one scale per 16 elements.
static float iq_dot_block_k2(const uint8_t * qs, const uint8_t * hmask, const int8_t * sc, iq_fp16_t d,
                             const block_q8_K * y) {
    int8_t q[QK_K];
    iq_unpack_codes_k2(qs, hmask, q);
    return iq_fp16(d) * y->d * (float) iq_dot_groups_16(q, sc, y->qs);
}

// iq4_xs: iq4_nl's values with a signed 6-bit scale per 32 elements.
static int32_t iq_dot_sums_iq4_xs(const uint8_t * qs, const int8_t * sc, const int8_t * y) {
    int sumi = 0;
    for (int b = 0; b < QK_K / 32; b++) {
        int8_t v[32];
        iq_unpack_values_iq4(qs + 16 * b, v);
        sumi += sc[b] * iq_dot_values(v, y + 32 * b, 32);
    }
    return sumi;
}

// q4_K, q5_K, q6_K, q2_K, q3_K, iq4_xs . q8_K: the row loops of quants-rows.h over the block
// functions above.
IQ_QUANTS_ROWS_K(iq, iq_dot_block_k4, iq_dot_groups_16, iq_dot_block_k2, iq_dot_sums_iq4_xs, iq_fp16)

// iq4_nl . q8_0: the codes' table values (-127..113) times the activation codes, per block.
static void iq_vec_dot_iq4_nl_q8_0(int64_t n, float * s, const void * vx, const void * vy) {
    const block_iq4_nl * x = vx;
    const block_q8_0 * y = vy;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK4_NL; i++) {
        int8_t v[32];
        iq_unpack_values_iq4(x[i].qs, v);
        sum += (float) iq_dot_values(v, y[i].qs, 32) * (iq_fp16(x[i].d) * iq_fp16(y[i].d));
    }
    *s = sum;
}

// Pairings as ggml's: activations of f32/f16/bf16 weights stay f32 (from_float is a copy).
static const struct iq_cpu_type_traits iq_cpu_quants_scalar[IQ_TYPE_GGUF_END] = {
    [IQ_TYPE_F32] = {IQ_TYPE_F32, iq_quantize_row_f32, iq_vec_dot_f32_f32, iq_dequantize_row_f32},
    [IQ_TYPE_F16] = {IQ_TYPE_F32, iq_quantize_row_f32, iq_vec_dot_f16_f32, iq_dequantize_row_f16},
    [IQ_TYPE_BF16] = {IQ_TYPE_F32, iq_quantize_row_f32, iq_vec_dot_bf16_f32, iq_dequantize_row_bf16},
    [IQ_TYPE_Q4_0] = {IQ_TYPE_Q8_0, iq_quantize_row_q8_0, iq_vec_dot_q4_0_q8_0, iq_dequantize_row_q4_0},
    [IQ_TYPE_Q4_1] = {IQ_TYPE_Q8_1, iq_quantize_row_q8_1, iq_vec_dot_q4_1_q8_1, iq_dequantize_row_q4_1},
    [IQ_TYPE_Q5_0] = {IQ_TYPE_Q8_0, iq_quantize_row_q8_0, iq_vec_dot_q5_0_q8_0, iq_dequantize_row_q5_0},
    [IQ_TYPE_Q5_1] = {IQ_TYPE_Q8_1, iq_quantize_row_q8_1, iq_vec_dot_q5_1_q8_1, iq_dequantize_row_q5_1},
    [IQ_TYPE_Q8_0] = {IQ_TYPE_Q8_0, iq_quantize_row_q8_0, iq_vec_dot_q8_0_q8_0, iq_dequantize_row_q8_0},
    [IQ_TYPE_Q2_K] = {IQ_TYPE_Q8_K, iq_quantize_row_q8_K, iq_vec_dot_q2_K_q8_K, iq_dequantize_row_q2_K},
    [IQ_TYPE_Q3_K] = {IQ_TYPE_Q8_K, iq_quantize_row_q8_K, iq_vec_dot_q3_K_q8_K, iq_dequantize_row_q3_K},
    [IQ_TYPE_Q4_K] = {IQ_TYPE_Q8_K, iq_quantize_row_q8_K, iq_vec_dot_q4_K_q8_K, iq_dequantize_row_q4_K},
    [IQ_TYPE_Q5_K] = {IQ_TYPE_Q8_K, iq_quantize_row_q8_K, iq_vec_dot_q5_K_q8_K, iq_dequantize_row_q5_K},
    [IQ_TYPE_Q6_K] = {IQ_TYPE_Q8_K, iq_quantize_row_q8_K, iq_vec_dot_q6_K_q8_K, iq_dequantize_row_q6_K},
    [IQ_TYPE_IQ4_NL] = {IQ_TYPE_Q8_0, iq_quantize_row_q8_0, iq_vec_dot_iq4_nl_q8_0, iq_dequantize_row_iq4_nl},
    [IQ_TYPE_IQ4_XS] = {IQ_TYPE_Q8_K, iq_quantize_row_q8_K, iq_vec_dot_iq4_xs_q8_K, iq_dequantize_row_iq4_xs},
};

static struct iq_cpu_type_traits iq_cpu_traits_table[IQ_CPU_FEATURE_SETS][IQ_TYPE_GGUF_END];
static pthread_once_t iq_cpu_traits_once = PTHREAD_ONCE_INIT;

// Type by type: the row's own kernels where it has them, those below it elsewhere.
static void iq_cpu_traits_overlay(struct iq_cpu_type_traits * table, const struct iq_cpu_type_traits * own) {
    for (int t = 0; t < IQ_TYPE_GGUF_END; t++) {
        struct iq_cpu_type_traits * row = &table[t];
        if (row->vec_dot == NULL) {
            continue;
        }
        row->from_float = own[t].from_float ? own[t].from_float : row->from_float;
        // the columns' kernel of the row whose vec_dot the type has: both give the same bits
        row->vec_dot_cols = own[t].vec_dot ? own[t].vec_dot_cols : row->vec_dot_cols;
        row->vec_dot_lanes = own[t].vec_dot ? own[t].vec_dot_lanes : row->vec_dot_lanes;
        row->vec_dot = own[t].vec_dot ? own[t].vec_dot : row->vec_dot;
        row->to_float = own[t].to_float ? own[t].to_float : row->to_float;
    }
}

// The tables of every set of the machine's features (the others are never asked for).
static void iq_cpu_traits_init(void) {
    const iq_cpu_features have = iq_cpu_features_detect();
    for (iq_cpu_features f = 0; f < IQ_CPU_FEATURE_SETS; f++) {
        if ((f & ~have) != 0) {
            continue;
        }
        memcpy(iq_cpu_traits_table[f], iq_cpu_quants_scalar, sizeof(iq_cpu_quants_scalar));
        for (int i = 0; i < iq_cpu_kernel_rows_count; i++) {
            const struct iq_cpu_kernel_row * r = &iq_cpu_kernel_rows[i];
            if (r->quants != NULL && iq_cpu_row_fits(r, f)) {
                iq_cpu_traits_overlay(iq_cpu_traits_table[f], r->quants);
            }
        }
    }
}

const struct iq_cpu_type_traits * iq_cpu_traits_for(enum iq_type type, iq_cpu_features f) {
    if ((int) type < 0 || type >= IQ_TYPE_GGUF_END || f >= IQ_CPU_FEATURE_SETS) {
        return NULL;
    }
    pthread_once(&iq_cpu_traits_once, iq_cpu_traits_init);
    // Never hand out kernels this machine cannot run.
    const struct iq_cpu_type_traits * row = &iq_cpu_traits_table[f & iq_cpu_features_detect()][type];
    return row->vec_dot ? row : NULL;
}

const struct iq_cpu_type_traits * iq_cpu_traits(enum iq_type type) {
    return iq_cpu_traits_for(type, iq_cpu_features_active());
}

int64_t iq_cpu_act_scales_size(enum iq_type vec_dot_type, int64_t n) {
    return vec_dot_type == IQ_TYPE_Q8_0 || vec_dot_type == IQ_TYPE_Q8_1 ? 2 * (n / 32) : 0;
}

void iq_cpu_act_scales(enum iq_type vec_dot_type, const void * y, int64_t n, float * ys) {
    if (vec_dot_type == IQ_TYPE_Q8_0) {
        const block_q8_0 * b = y;
        for (int64_t i = 0; i < n / QK8_0; i++) {
            ys[2 * i] = iq_fp16_to_fp32(b[i].d);
            ys[2 * i + 1] = 0.0f;
        }
    } else if (vec_dot_type == IQ_TYPE_Q8_1) {
        const block_q8_1 * b = y;
        for (int64_t i = 0; i < n / QK8_1; i++) {
            ys[2 * i] = iq_fp16_to_fp32(b[i].d);
            ys[2 * i + 1] = iq_fp16_to_fp32(b[i].s);
        }
    }
}

void iq_cpu_act_lanes(const void * y, int64_t n, void * pack, int lanes, int lane) {
    const block_q8_1 * b = y;
    const int width = QK8_1 / lanes;  // bytes of one column in a load
    for (int64_t i = 0; i < n / QK8_1; i++) {
        char * p = (char *) pack + i * IQ_LANES_BLOCK;
        for (int j = 0; j < lanes; j++) {
            memcpy(p + 32 * j + width * lane, b[i].qs + width * j, (size_t) width);
        }
        for (int k = 0; k < 8 / lanes; k++) {
            ((float *) (p + IQ_LANES_D))[lane * 8 / lanes + k] = iq_fp16_to_fp32(b[i].d);
            ((float *) (p + IQ_LANES_S))[lane * 8 / lanes + k] = iq_fp16_to_fp32(b[i].s);
        }
    }
}
