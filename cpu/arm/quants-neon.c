// The weight types' dot products with NEON only (armv8-a): int8 products widened to i16
// (smull) and added pairwise into i32 (sadalp).
#include <arm_neon.h>

static inline int32x4_t arm_dot_neon(int32x4_t acc, int8x16_t a, int8x16_t b) {
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
}
#define IQ_ARM_DOT(acc, a, b) arm_dot_neon(acc, a, b)
#define IQ_QUANTS_TABLE iq_cpu_quants_neon

#include "quants-arm.h"
