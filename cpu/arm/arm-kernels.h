// The aarch64 kernel tables (NEON, dotprod), referenced by this folder's kernel-rows.c only.
#pragma once

#include "kernel-rows.h"

#include <arm_neon.h>

extern const struct iq_cpu_type_traits iq_cpu_quants_neon[IQ_TYPE_GGUF_END];
extern const struct iq_cpu_type_traits iq_cpu_quants_dotprod[IQ_TYPE_GGUF_END];
extern const struct iq_vec_fns iq_vec_fns_neon;
extern const struct iq_innerq_kernels iq_innerq_kernels_neon;
extern const struct iq_innerq_kernels iq_innerq_kernels_dotprod;

// The int8 dot product of 16 lanes without dotprod: products widened to i16 (smull), added
// pairwise into the i32 lanes of acc (sadalp). The dotprod files use sdot (vdotq_s32) instead.
static inline int32x4_t iq_arm_dot_neon(int32x4_t acc, int8x16_t a, int8x16_t b) {
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
}
