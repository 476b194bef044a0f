#include "device.h"

#include <stdio.h>
#ifdef __linux__
#include <unistd.h>
#endif

#include "iq-cpu.h"
#include "status.h"
#ifdef INNERQ_HAVE_CUDA
#include "iq-cuda.h"
#endif

int32_t innerq_cuda_device_count(void) {
#ifdef INNERQ_HAVE_CUDA
    return iq_cuda_device_count();
#else
    return -1;
#endif
}

// Whether this machine has an NVIDIA GPU, whether or not CUDA can use it (its driver's nodes).
static bool device_gpu_present(void) {
#ifdef __linux__
    return access("/dev/nvidiactl", F_OK) == 0 || access("/proc/driver/nvidia/version", F_OK) == 0;
#else
    return false;
#endif
}

// n_gpu_layers on a build or a machine without a GPU: with cpu_fallback the CPU, with one
// warning line, as llama.cpp and llama-cpp-python do (scripts written for them pass
// n_gpu_layers=-1 anywhere), else an error. A GPU that is there but cannot be used stays an
// error that says why.
static innerq_status device_cpu_instead(int32_t n_gpu_layers, bool cpu_fallback, const char * why) {
    if (!cpu_fallback) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "n_gpu_layers = %d: %s", n_gpu_layers, why);
    }
    fprintf(stderr, "innerq: warning: n_gpu_layers = %d: %s; the model runs on the CPU\n", n_gpu_layers, why);
    return INNERQ_OK;
}

innerq_status device_choose(int32_t n_gpu_layers, int32_t n_layer, bool cpu_fallback, bool * gpu) {
    *gpu = false;
    if (n_gpu_layers == 0) {
        return INNERQ_OK;
    }
    if (n_gpu_layers < -1) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "n_gpu_layers = %d: use 0 (CPU) or -1 (every layer on the GPU)",
                           n_gpu_layers);
    }
    const int32_t n_dev = innerq_cuda_device_count();
    if (n_dev < 0) {
        return device_cpu_instead(n_gpu_layers, cpu_fallback,
                                  "this build of innerq has no CUDA backend (build with -DINNERQ_CUDA=ON)");
    }
    if (n_dev == 0 && !device_gpu_present()) {
        return device_cpu_instead(n_gpu_layers, cpu_fallback, "no CUDA device found");
    }
    if (n_gpu_layers != -1 && n_gpu_layers < n_layer) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED,
                           "n_gpu_layers = %d: splitting the model's %d layers between CPU and GPU is not supported; "
                           "use 0 (CPU) or -1 / >= %d (the whole model on the GPU)",
                           n_gpu_layers, n_layer, n_layer);
    }
    if (n_dev == 0) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "n_gpu_layers = %d: this machine has an NVIDIA GPU that CUDA cannot "
                           "use: %s", n_gpu_layers, iq_error_get());
    }
    *gpu = true;
    return INNERQ_OK;
}

bool device_backend_is_gpu(iq_backend * be) {
#ifdef INNERQ_HAVE_CUDA
    return iq_backend_is_cuda(be);
#else
    (void) be;
    return false;
#endif
}

int32_t device_kv_group_default(bool gpu) { return gpu ? 32 : 64; }

size_t device_kv_align(bool gpu) { return gpu ? 256 : 64; }

innerq_status device_kv_check(bool gpu, int32_t head_dim, enum iq_type type_k, enum iq_type type_v) {
    if (gpu && head_dim != 64 && head_dim != 128) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "a %s/%s KV cache on the GPU: its attention takes head_dim 64 or 128, "
                           "not %d (use the CPU: n_gpu_layers 0)", iq_type_name(type_k), iq_type_name(type_v), head_dim);
    }
    return INNERQ_OK;
}

innerq_status device_backend_init(bool gpu, int32_t n_threads, iq_backend ** out) {
#ifdef INNERQ_HAVE_CUDA
    *out = gpu ? iq_backend_cuda_init(0) : iq_backend_cpu_init(n_threads);
#else
    *out = gpu ? NULL : iq_backend_cpu_init(n_threads);
#endif
    if (*out == NULL) {
        return innerq_fail(gpu ? INNERQ_ERR_BACKEND : INNERQ_ERR_OUT_OF_MEMORY, "could not create the %s backend: %s",
                           gpu ? "CUDA" : "CPU", iq_error_get());
    }
    return INNERQ_OK;
}
