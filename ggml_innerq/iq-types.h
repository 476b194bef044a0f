// Types of the tensor library: their ids, block layouts and traits.
//
// Weight type ids equal ggml's, so a GGUF tensor's type field is used as is. Cache-only
// types (KIVI, InnerQ) live above IQ_TYPE_GGUF_END and never appear in a file.
// Block structs are shared by the CPU and CUDA backends; their sizes are asserted.
#pragma once

#include <assert.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

enum iq_type {
    IQ_TYPE_F32  = 0,
    IQ_TYPE_F16  = 1,
    IQ_TYPE_Q4_0 = 2,
    IQ_TYPE_Q4_1 = 3,
    IQ_TYPE_Q5_0 = 6,
    IQ_TYPE_Q5_1 = 7,
    IQ_TYPE_Q8_0 = 8,
    IQ_TYPE_Q8_1 = 9,
    IQ_TYPE_Q2_K = 10,
    IQ_TYPE_Q3_K = 11,
    IQ_TYPE_Q4_K = 12,
    IQ_TYPE_Q5_K = 13,
    IQ_TYPE_Q6_K = 14,
    IQ_TYPE_Q8_K = 15,
    IQ_TYPE_IQ4_NL = 20,
    IQ_TYPE_IQ4_XS = 23,
    IQ_TYPE_I8   = 24,
    IQ_TYPE_I16  = 25,
    IQ_TYPE_I32  = 26,
    IQ_TYPE_BF16 = 30,
    IQ_TYPE_GGUF_END = 40,  // ids below this may appear in a GGUF file
    // KV-cache-only types (docs/DESIGN.md section 3): their layout is in iq-qcache.h.
    IQ_TYPE_KIVI2 = 64,
    IQ_TYPE_KIVI4,
    IQ_TYPE_INNERQ2,
    IQ_TYPE_INNERQ3,
    IQ_TYPE_INNERQ4,
    IQ_TYPE_INNERQ5,
    IQ_TYPE_COUNT,
};

typedef uint16_t iq_fp16_t;
typedef uint16_t iq_bf16_t;

#define QK4_0 32
#define QK4_1 32
#define QK5_0 32
#define QK5_1 32
#define QK8_0 32
#define QK8_1 32
#define QK_K 256
#define K_SCALE_SIZE 12
#define QK4_NL 32

// The 16 values of the non-linear 4-bit codes of iq4_nl / iq4_xs (ggml's kvalues_iq4nl), each
// device builds its own table from this list.
#define IQ4NL_VALUES -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113

typedef struct { iq_fp16_t d; uint8_t qs[QK4_0 / 2]; } block_q4_0;
typedef struct { iq_fp16_t d, m; uint8_t qs[QK4_1 / 2]; } block_q4_1;
typedef struct { iq_fp16_t d; uint8_t qh[4]; uint8_t qs[QK5_0 / 2]; } block_q5_0;
typedef struct { iq_fp16_t d, m; uint8_t qh[4]; uint8_t qs[QK5_1 / 2]; } block_q5_1;
typedef struct { iq_fp16_t d; int8_t qs[QK8_0]; } block_q8_0;
typedef struct { iq_fp16_t d, s; int8_t qs[QK8_1]; } block_q8_1;  // s = d * sum(qs)
typedef struct {
    uint8_t scales[QK_K / 16];  // 16 x (4-bit scale, 4-bit min above it), one per 16 elements
    uint8_t qs[QK_K / 4];       // 2-bit codes: element 128 h + 32 j + l is bits 2j, 2j+1 of qs[32 h + l]
    iq_fp16_t d, dmin;          // x = d scale code - dmin min
} block_q2_K;
typedef struct {
    uint8_t hmask[QK_K / 8];      // bit 4 h + j of hmask[l] for element 128 h + 32 j + l
    uint8_t qs[QK_K / 4];         // low 2 bits, as q2_K's; code = low - 4 where the hmask bit is clear
    uint8_t scales[K_SCALE_SIZE]; // 16 x 6-bit scale + 32 (low 4 bits in bytes 0..7, top 2 in 8..11)
    iq_fp16_t d;                  // x = d (scale - 32) code
} block_q3_K;
typedef struct {
    iq_fp16_t d, dmin;
    uint8_t scales[K_SCALE_SIZE];  // 8 x (6-bit scale, 6-bit min)
    uint8_t qs[QK_K / 2];
} block_q4_K;
typedef struct {
    iq_fp16_t d, dmin;
    uint8_t scales[K_SCALE_SIZE];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
} block_q5_K;
typedef struct {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    iq_fp16_t d;
} block_q6_K;
typedef struct {  // x = d IQ4NL_VALUES[code]; codes packed as q4_0's
    iq_fp16_t d;
    uint8_t qs[QK4_NL / 2];
} block_iq4_nl;
typedef struct {
    iq_fp16_t d;
    uint16_t scales_h;              // top 2 bits of the 8 sub-block scales, 2 bits each
    uint8_t scales_l[QK_K / 64];    // low 4 bits, sub-block 2i in the low nibble of byte i
    uint8_t qs[QK_K / 2];           // sub-block b (32 elements): bytes 16 b.., packed as q4_0's
} block_iq4_xs;                     // x = d (scale - 32) IQ4NL_VALUES[code]
typedef struct {  // activations for the K-quant dot products
    float d;
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];
} block_q8_K;

static_assert(sizeof(block_q4_0) == 18, "block_q4_0 size");
static_assert(sizeof(block_q4_1) == 20, "block_q4_1 size");
static_assert(sizeof(block_q5_0) == 22, "block_q5_0 size");
static_assert(sizeof(block_q5_1) == 24, "block_q5_1 size");
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 size");
static_assert(sizeof(block_q8_1) == 36, "block_q8_1 size");
static_assert(sizeof(block_q2_K) == 84, "block_q2_K size");
static_assert(sizeof(block_q3_K) == 110, "block_q3_K size");
static_assert(sizeof(block_q4_K) == 144, "block_q4_K size");
static_assert(sizeof(block_q5_K) == 176, "block_q5_K size");
static_assert(sizeof(block_q6_K) == 210, "block_q6_K size");
static_assert(sizeof(block_q8_K) == 292, "block_q8_K size");
static_assert(sizeof(block_iq4_nl) == 18, "block_iq4_nl size");
static_assert(sizeof(block_iq4_xs) == 136, "block_iq4_xs size");

// Reference (portable, scalar) conversions of n elements; n is a multiple of the block size.
typedef void (*iq_to_float_fn)(const void * x, float * y, int64_t n);
typedef void (*iq_from_float_fn)(const float * x, void * y, int64_t n);

struct iq_type_traits {
    const char * name;         // as ggml spells it: "f32", "q4_K", ...
    int64_t blck_size;         // elements per block (1 for plain types)
    size_t type_size;          // bytes per block
    bool is_quantized;
    iq_to_float_fn to_float;   // NULL for types that are not dequantized row-wise
    iq_from_float_fn from_float;  // reference quantizer, NULL where none is provided
};

// Traits of a type; NULL for an id that names no type (e.g. an id read from a bad file).
const struct iq_type_traits * iq_type_traits_get(enum iq_type type);
bool iq_type_is_valid(int type);
const char * iq_type_name(enum iq_type type);
// Bytes of a row of n elements; 0 if n is not a multiple of the block size.
size_t iq_row_size(enum iq_type type, int64_t n);

// fp16 / bf16 <-> f32, exact as IEEE (round to nearest even), as ggml's.
float iq_fp16_to_fp32(iq_fp16_t h);
iq_fp16_t iq_fp32_to_fp16(float f);
float iq_bf16_to_fp32(iq_bf16_t h);
iq_bf16_t iq_fp32_to_bf16(float f);

#ifdef __cplusplus
}
#endif
