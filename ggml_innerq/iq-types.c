// The type-traits table and the fp16 / bf16 conversions.
//
// One row per type; adding a type is adding a row. Rows left empty (no name) are ids that
// name no type yet, and every lookup treats them as invalid.
#include "iq-types.h"

#include "iq-qcache-math.h"
#include "iq-quants.h"

static const struct iq_type_traits iq_type_table[IQ_TYPE_COUNT] = {
    [IQ_TYPE_F32] = {"f32", 1, sizeof(float), false, iq_dequantize_row_f32, iq_quantize_row_f32},
    [IQ_TYPE_F16] = {"f16", 1, sizeof(iq_fp16_t), false, iq_dequantize_row_f16, iq_quantize_row_f16},
    [IQ_TYPE_BF16] = {"bf16", 1, sizeof(iq_bf16_t), false, iq_dequantize_row_bf16, iq_quantize_row_bf16},
    [IQ_TYPE_Q4_0] = {"q4_0", QK4_0, sizeof(block_q4_0), true, iq_dequantize_row_q4_0, iq_quantize_row_q4_0},
    [IQ_TYPE_Q4_1] = {"q4_1", QK4_1, sizeof(block_q4_1), true, iq_dequantize_row_q4_1, iq_quantize_row_q4_1},
    [IQ_TYPE_Q5_0] = {"q5_0", QK5_0, sizeof(block_q5_0), true, iq_dequantize_row_q5_0, iq_quantize_row_q5_0},
    [IQ_TYPE_Q5_1] = {"q5_1", QK5_1, sizeof(block_q5_1), true, iq_dequantize_row_q5_1, iq_quantize_row_q5_1},
    [IQ_TYPE_Q8_0] = {"q8_0", QK8_0, sizeof(block_q8_0), true, iq_dequantize_row_q8_0, iq_quantize_row_q8_0},
    [IQ_TYPE_Q8_1] = {"q8_1", QK8_1, sizeof(block_q8_1), true, iq_dequantize_row_q8_1, iq_quantize_row_q8_1},
    [IQ_TYPE_Q2_K] = {"q2_K", QK_K, sizeof(block_q2_K), true, iq_dequantize_row_q2_K, NULL},
    [IQ_TYPE_Q3_K] = {"q3_K", QK_K, sizeof(block_q3_K), true, iq_dequantize_row_q3_K, NULL},
    [IQ_TYPE_Q4_K] = {"q4_K", QK_K, sizeof(block_q4_K), true, iq_dequantize_row_q4_K, NULL},
    [IQ_TYPE_Q5_K] = {"q5_K", QK_K, sizeof(block_q5_K), true, iq_dequantize_row_q5_K, NULL},
    [IQ_TYPE_Q6_K] = {"q6_K", QK_K, sizeof(block_q6_K), true, iq_dequantize_row_q6_K, NULL},
    [IQ_TYPE_Q8_K] = {"q8_K", QK_K, sizeof(block_q8_K), true, iq_dequantize_row_q8_K, iq_quantize_row_q8_K},
    [IQ_TYPE_IQ4_NL] = {"iq4_nl", QK4_NL, sizeof(block_iq4_nl), true, iq_dequantize_row_iq4_nl, NULL},
    [IQ_TYPE_IQ4_XS] = {"iq4_xs", QK_K, sizeof(block_iq4_xs), true, iq_dequantize_row_iq4_xs, NULL},
    [IQ_TYPE_I8] = {"i8", 1, sizeof(int8_t), false, NULL, NULL},
    [IQ_TYPE_I16] = {"i16", 1, sizeof(int16_t), false, NULL, NULL},
    [IQ_TYPE_I32] = {"i32", 1, sizeof(int32_t), false, NULL, NULL},
    // KV-cache-only types: their layout lives in iq-qcache.h, not in rows of blocks.
    [IQ_TYPE_KIVI2] = {"kivi2", 1, 0, true, NULL, NULL},
    [IQ_TYPE_KIVI4] = {"kivi4", 1, 0, true, NULL, NULL},
    [IQ_TYPE_INNERQ2] = {"innerq2", 1, 0, true, NULL, NULL},
    [IQ_TYPE_INNERQ3] = {"innerq3", 1, 0, true, NULL, NULL},
    [IQ_TYPE_INNERQ4] = {"innerq4", 1, 0, true, NULL, NULL},
    [IQ_TYPE_INNERQ5] = {"innerq5", 1, 0, true, NULL, NULL},
};

const struct iq_type_traits * iq_type_traits_get(enum iq_type type) {
    if ((int) type < 0 || type >= IQ_TYPE_COUNT || iq_type_table[type].name == NULL) {
        return NULL;
    }
    return &iq_type_table[type];
}

bool iq_type_is_valid(int type) {
    return type >= 0 && type < IQ_TYPE_COUNT && iq_type_table[type].name != NULL;
}

const char * iq_type_name(enum iq_type type) {
    const struct iq_type_traits * tt = iq_type_traits_get(type);
    return tt ? tt->name : "invalid";
}

size_t iq_row_size(enum iq_type type, int64_t n) {
    const struct iq_type_traits * tt = iq_type_traits_get(type);
    if (tt == NULL || n < 0 || n % tt->blck_size != 0) {
        return 0;
    }
    return (size_t) (n / tt->blck_size) * tt->type_size;
}

// One definition for every device (iq-qcache-math.h).
float iq_fp16_to_fp32(iq_fp16_t h) { return iq_half_to_float(h); }

iq_fp16_t iq_fp32_to_fp16(float f) { return iq_float_to_half(f); }

float iq_bf16_to_fp32(iq_bf16_t h) { return iq_f32_from_bits((uint32_t) h << 16); }

iq_bf16_t iq_fp32_to_bf16(float f) {
    const uint32_t x = iq_f32_bits(f);
    if ((x & 0x7fffffff) > 0x7f800000) {
        return (iq_bf16_t) ((x >> 16) | 64);  // NaN: force quiet
    }
    return (iq_bf16_t) ((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}
