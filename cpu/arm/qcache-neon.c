// The InnerQ attention kernels with NEON only (armv8-a): the key products by smull / sadalp.
#include "arm-kernels.h"

#define IQ_ARM_DOT(acc, a, b) iq_arm_dot_neon(acc, a, b)
#define IQ_INNERQ_TABLE iq_innerq_kernels_neon
#define IQ_INNERQ_NAME "neon"

#include "qcache-arm.h"
