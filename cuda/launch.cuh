// Launches that may overlap the previous kernel of the stream (programmatic dependent launch,
// sm_90): a kernel launched by iq_cu_launch may start while the kernel before it still runs
// (its CTAs are scheduled once every CTA of that one has called iq_cu_pdl_trigger or ended).
// Such a kernel reads only constants (weights) and writes nothing before iq_cu_pdl_wait(),
// which returns when the kernels before it have completed and their writes are visible; every
// CTA calls it before it ends, so that its completion implies theirs. Kernels launched
// otherwise wait for the whole stream as always.
#pragma once

#include "ops.h"

#include <cuda_runtime.h>

static __device__ __forceinline__ void iq_cu_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The next kernel (if launched by iq_cu_launch) may start: called first by the kernels whose
// successors are.
static __device__ __forceinline__ void iq_cu_pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

template <typename... P, typename... A>
static inline void iq_cu_launch(const struct iq_cuda_ctx * c, void (*kern)(P...), dim3 grid, dim3 block, size_t smem,
                                A... args) {
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = c->stream;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    cudaLaunchKernelEx(&cfg, kern, ((P) args)...);
}

// t's bytes are a leaf's (weights, inputs): the kernels of a graph write no leaf but the cache's
// storage (KV_STORE), which no product or norm takes as its weights; so a kernel may read t
// before iq_cu_pdl_wait().
static inline bool iq_cuda_is_const(const struct iq_tensor * t) {
    while (t->view_src != NULL) {
        t = t->view_src;
    }
    return t->op == IQ_OP_NONE;
}

// No byte of a's data is one of b's.
static inline bool iq_cuda_tensors_apart(const struct iq_tensor * a, const struct iq_tensor * b) {
    const char * pa = (const char *) a->data, * pb = (const char *) b->data;
    return pa >= pb + iq_nbytes(b) || pb >= pa + iq_nbytes(a);
}
