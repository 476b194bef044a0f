// The x86 kernel tables (AVX2, AVX-512), referenced by this folder's kernel-rows.c only.
#pragma once

#include "kernel-rows.h"

extern const struct iq_cpu_type_traits iq_cpu_quants_avx2[IQ_TYPE_GGUF_END];
extern const struct iq_cpu_type_traits iq_cpu_quants_avx512[IQ_TYPE_GGUF_END];       // without VNNI
extern const struct iq_cpu_type_traits iq_cpu_quants_avx512_vnni[IQ_TYPE_GGUF_END];  // with VNNI
extern const struct iq_vec_fns iq_vec_fns_avx2;
extern const struct iq_vec_fns iq_vec_fns_avx512;
void iq_qsearch_avx2(const float * x, int32_t n, int32_t bits, bool key_levels, uint8_t * u, iq_fp16_t * d,
                     iq_fp16_t * m);
void iq_qsearch_avx512(const float * x, int32_t n, int32_t bits, bool key_levels, uint8_t * u, iq_fp16_t * d,
                       iq_fp16_t * m);
extern const struct iq_innerq_kernels iq_innerq_kernels_avx2;
extern const struct iq_innerq_kernels iq_innerq_kernels_avx512;            // pmaddubsw
extern const struct iq_innerq_kernels iq_innerq_kernels_avx512_vnni;       // vpdpbusd
extern const struct iq_innerq_kernels iq_innerq_kernels_avx512_vnni_gfni;  // vpdpbusd, vgf2p8affineqb

// 8-bit group parameters decoded with AVX2 and F16C (qcache-avx2.c), for the AVX-512 tables too.
void iq_p8_decode_avx2(const uint8_t * params, int32_t head_dim, float centre, iq_fp16_t * dm);
