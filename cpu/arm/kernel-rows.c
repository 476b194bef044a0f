// The aarch64 kernel rows, lowest first (cpu/kernel-rows.h says how they combine). NEON is part
// of armv8-a; dotprod adds sdot to the integer products. The f32 tiles have no dotprod row.
#include "arm-kernels.h"

const struct iq_cpu_kernel_row iq_cpu_kernel_rows[] = {
    {IQ_CPU_NEON, iq_cpu_quants_neon, &iq_vec_fns_neon, &iq_innerq_kernels_neon},
    {IQ_CPU_NEON | IQ_CPU_DOTPROD, iq_cpu_quants_dotprod, NULL, &iq_innerq_kernels_dotprod},
};
const int iq_cpu_kernel_rows_count = sizeof(iq_cpu_kernel_rows) / sizeof(iq_cpu_kernel_rows[0]);
