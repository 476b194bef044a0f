// The aarch64 kernel tables (NEON, dotprod), referenced by this folder's kernel-rows.c only.
#pragma once

#include "kernel-rows.h"

extern const struct iq_cpu_type_traits iq_cpu_quants_neon[IQ_TYPE_GGUF_END];
extern const struct iq_cpu_type_traits iq_cpu_quants_dotprod[IQ_TYPE_GGUF_END];
extern const struct iq_vec_fns iq_vec_fns_neon;
extern const struct iq_innerq_kernels iq_innerq_kernels_neon;
extern const struct iq_innerq_kernels iq_innerq_kernels_dotprod;
