// Reference conversions between f32 and every weight format, byte-exact with ggml's.
//
// These are the specification: the CPU backend's SIMD versions and the CUDA kernels are
// tested against them, and gguf.quants (numpy) is the oracle they are tested against.
// n is the number of elements, a multiple of the type's block size.
#pragma once

#include "iq-types.h"

#ifdef __cplusplus
extern "C" {
#endif

// f32 "conversions" are copies, so that callers read rows of every type alike.
void iq_dequantize_row_f32(const void * x, float * y, int64_t n);
void iq_dequantize_row_f16(const void * x, float * y, int64_t n);
void iq_dequantize_row_bf16(const void * x, float * y, int64_t n);
void iq_dequantize_row_q4_0(const void * x, float * y, int64_t n);
void iq_dequantize_row_q4_1(const void * x, float * y, int64_t n);
void iq_dequantize_row_q5_0(const void * x, float * y, int64_t n);
void iq_dequantize_row_q5_1(const void * x, float * y, int64_t n);
void iq_dequantize_row_q8_0(const void * x, float * y, int64_t n);
void iq_dequantize_row_q8_1(const void * x, float * y, int64_t n);
void iq_dequantize_row_q2_K(const void * x, float * y, int64_t n);
void iq_dequantize_row_q3_K(const void * x, float * y, int64_t n);
void iq_dequantize_row_q4_K(const void * x, float * y, int64_t n);
void iq_dequantize_row_q5_K(const void * x, float * y, int64_t n);
void iq_dequantize_row_q6_K(const void * x, float * y, int64_t n);
void iq_dequantize_row_q8_K(const void * x, float * y, int64_t n);
void iq_dequantize_row_iq4_nl(const void * x, float * y, int64_t n);
void iq_dequantize_row_iq4_xs(const void * x, float * y, int64_t n);

void iq_quantize_row_f32(const float * x, void * y, int64_t n);
void iq_quantize_row_f16(const float * x, void * y, int64_t n);
void iq_quantize_row_bf16(const float * x, void * y, int64_t n);
void iq_quantize_row_q4_0(const float * x, void * y, int64_t n);
void iq_quantize_row_q4_1(const float * x, void * y, int64_t n);
void iq_quantize_row_q5_0(const float * x, void * y, int64_t n);
void iq_quantize_row_q5_1(const float * x, void * y, int64_t n);
void iq_quantize_row_q8_0(const float * x, void * y, int64_t n);
void iq_quantize_row_q8_1(const float * x, void * y, int64_t n);
void iq_quantize_row_q8_K(const float * x, void * y, int64_t n);

// Codes of the block formats, unpacked one per byte in element order (shared by the reference
// conversions and the scalar dot products).
// 32-element blocks: element j < 16 is the low nibble of qs[j], j + 16 its high nibble; for
// 5-bit formats bit j of qh (little-endian u32) is bit 4 of element j. qh may be NULL.
void iq_unpack_codes_32(const uint8_t * qs, const uint8_t * qh, uint8_t * q);
// q4_K / q5_K: 64 elements per 32 bytes of qs (low nibbles first); bits 2k, 2k + 1 of qh[l]
// are bit 4 of elements 64k + l and 64k + 32 + l. qh may be NULL.
void iq_unpack_codes_k4(const uint8_t * qs, const uint8_t * qh, uint8_t * q);
// The 6-bit scales and mins of the 8 sub-blocks of a q4_K / q5_K block, one per byte.
void iq_unpack_scales_k4(const uint8_t * scales, uint8_t * sc, uint8_t * m);

// The same as two little-endian u64 (byte j = sub-block j), for SIMD code. Sub-blocks 0..3 keep
// their 6 bits in the low bits of bytes 0..3 (scales) and 4..7 (mins); sub-blocks 4..7 have
// their low 4 bits in bytes 8..11 and their top 2 bits in the spare top bits of bytes 0..7.
static inline void iq_unpack_scales_k4_u64(const uint8_t * scales, uint64_t * sc, uint64_t * m) {
    uint32_t a, b, c;
    memcpy(&a, scales, 4);
    memcpy(&b, scales + 4, 4);
    memcpy(&c, scales + 8, 4);
    *sc = (a & 0x3f3f3f3fu) | ((uint64_t) ((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32);
    *m = (b & 0x3f3f3f3fu) | ((uint64_t) (((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32);
}
// q6_K: signed codes (offset 32 removed) of the 256 elements.
void iq_unpack_codes_q6_K(const uint8_t * ql, const uint8_t * qh, int8_t * q);
// q2_K / q3_K: the 256 codes in element order, 0..3 (hmask NULL, q2_K) or -4..3 (q3_K).
void iq_unpack_codes_k2(const uint8_t * qs, const uint8_t * hmask, int8_t * q);
// q3_K: the 16 signed 6-bit scales (offset 32 removed) of a block.
void iq_unpack_scales_q3_K(const uint8_t * scales, int8_t * sc);
// iq4_xs: the 8 signed sub-block scales (offset 32 removed) of a block.
void iq_unpack_scales_iq4_xs(uint16_t scales_h, const uint8_t * scales_l, int8_t * sc);
// iq4_nl / iq4_xs: 16 bytes of packed codes -> the 32 values of IQ4NL_VALUES they select.
void iq_unpack_values_iq4(const uint8_t * qs, int8_t * v);

#ifdef __cplusplus
}
#endif
