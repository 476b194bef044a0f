// The InnerQ attention kernels with the dotprod extension: the key products by sdot. Called
// only where HWCAP_ASIMDDP is set.
#include <arm_neon.h>

#define IQ_ARM_DOT(acc, a, b) vdotq_s32(acc, a, b)
#define IQ_INNERQ_TABLE iq_innerq_kernels_dotprod
#define IQ_INNERQ_NAME "dotprod"

#include "qcache-arm.h"
