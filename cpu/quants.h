// Kernel tables of each instruction set, merged into the dispatch of iq-cpu.h.
//
// Each table is indexed by weight type. A NULL function means "use the next lower ISA's";
// vec_dot_type always comes from the scalar table, since every ISA reads the same activation
// format. The SIMD tables exist only on x86 (their files are compiled only there).
#pragma once

#include "iq-cpu.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__x86_64__) || defined(__i386__)
#define IQ_CPU_HAVE_X86_KERNELS 1
extern const struct iq_cpu_type_traits iq_cpu_quants_avx2[IQ_TYPE_GGUF_END];
extern const struct iq_cpu_type_traits iq_cpu_quants_avx512[IQ_TYPE_GGUF_END];       // without VNNI
extern const struct iq_cpu_type_traits iq_cpu_quants_avx512_vnni[IQ_TYPE_GGUF_END];  // with VNNI
#endif

#ifdef __cplusplus
}
#endif
