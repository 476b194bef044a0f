// The searched quantizer in AVX2 vectors (cpu/qsearch-lanes.h).
#include "x86-kernels.h"

#define IQ_QSEARCH_NAME iq_qsearch_avx2
#include "qsearch-lanes.h"
