// The searched quantizer in AVX-512 vectors (cpu/qsearch-lanes.h).
#include "x86-kernels.h"

#define IQ_QSEARCH_NAME iq_qsearch_avx512
#include "qsearch-lanes.h"
