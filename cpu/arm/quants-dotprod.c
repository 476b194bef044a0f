// The weight types' dot products with the dotprod extension (armv8.2-a+dotprod): sdot adds
// four int8 products into each i32 lane. Called only where HWCAP_ASIMDDP is set.
#include <arm_neon.h>

#define IQ_ARM_DOT(acc, a, b) vdotq_s32(acc, a, b)
#define IQ_QUANTS_TABLE iq_cpu_quants_dotprod

#include "quants-arm.h"
