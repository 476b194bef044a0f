// Which backend runs a model: the one place that maps n_gpu_layers to the CPU or CUDA backend.
#pragma once

#include "innerq.h"
#include "iq-backend.h"

// *gpu for n_gpu_layers: 0 is the CPU; -1 or >= n_layer the whole model on the GPU; a value in
// between fails with a clear message. A build without CUDA or a machine without a GPU: the CPU
// with a warning line if cpu_fallback (loading a model, as llama.cpp), else a clear failure.
innerq_status device_choose(int32_t n_gpu_layers, int32_t n_layer, bool cpu_fallback, bool * gpu);
// The backend for the choice (n_threads is the CPU's).
innerq_status device_backend_init(bool gpu, int32_t n_threads, iq_backend ** out);
// Whether be is the GPU (CUDA) backend.
bool device_backend_is_gpu(iq_backend * be);
// The quantized cache's group size G where the context asks for the default (kv_group 0): 32 on
// the GPU (one group per warp: its kernels' unit), 64 on the CPU (docs/DEFAULTS.md).
int32_t device_kv_group_default(bool gpu);
// The alignment of the cache's regions in its buffer: the backend's (CUDA 256, the CPU 64
// bytes), known without starting it so that a cache's size can be computed for either device.
size_t device_kv_align(bool gpu);
// Whether the backend's attention takes the cache's shape, checked when the context is made
// (INNERQ_ERR_UNSUPPORTED with the reason, rather than a failing decode): the GPU's kernels
// take head_dim 64 or 128, for every cache type.
innerq_status device_kv_check(bool gpu, int32_t head_dim, enum iq_type type_k, enum iq_type type_v);
