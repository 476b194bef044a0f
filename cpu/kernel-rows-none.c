// An architecture without vector kernels here: every family runs its scalar table.
#include "kernel-rows.h"

const struct iq_cpu_kernel_row iq_cpu_kernel_rows[1] = {{0, NULL, NULL, NULL}};
const int iq_cpu_kernel_rows_count = 0;
