// The x86 kernel rows, lowest first (cpu/kernel-rows.h says how they combine).
#include "x86-kernels.h"

#define IQ_AVX512_BASE (IQ_CPU_AVX2 | IQ_CPU_AVX512)

const struct iq_cpu_kernel_row iq_cpu_kernel_rows[] = {
    {IQ_CPU_AVX2, iq_cpu_quants_avx2, &iq_vec_fns_avx2, &iq_innerq_kernels_avx2},
    {IQ_AVX512_BASE, iq_cpu_quants_avx512, &iq_vec_fns_avx512, &iq_innerq_kernels_avx512},
    {IQ_AVX512_BASE | IQ_CPU_AVX512_VNNI, iq_cpu_quants_avx512_vnni, NULL, &iq_innerq_kernels_avx512_vnni},
    {IQ_AVX512_BASE | IQ_CPU_AVX512_VNNI | IQ_CPU_GFNI, NULL, NULL, &iq_innerq_kernels_avx512_vnni_gfni},
};
const int iq_cpu_kernel_rows_count = sizeof(iq_cpu_kernel_rows) / sizeof(iq_cpu_kernel_rows[0]);
