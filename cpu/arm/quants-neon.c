// The weight types' dot products with NEON only (armv8-a): int8 products widened to i16
// (smull) and added pairwise into i32 (sadalp).
#include "arm-kernels.h"

#define IQ_ARM_DOT(acc, a, b) iq_arm_dot_neon(acc, a, b)
#define IQ_QUANTS_TABLE iq_cpu_quants_neon

#include "quants-arm.h"
