#include "device.h"

#include <stdio.h>
#include <string.h>
#ifdef __linux__
#include <unistd.h>
#endif

#include "iq-cpu.h"
#include "status.h"
#ifdef INNERQ_HAVE_CUDA
#include "iq-cuda.h"
#endif

// ---- the CPU ----

static innerq_status cpu_kv_check(int32_t head_dim, enum iq_type type_k, enum iq_type type_v) {
    (void) head_dim, (void) type_k, (void) type_v;
    return INNERQ_OK;
}

// The processor's name (/proc/cpuinfo) and the machine's memory.
static void cpu_describe(int32_t index, innerq_device_info * info) {
    (void) index;
#ifdef __linux__
    FILE * f = fopen("/proc/cpuinfo", "r");
    char line[256];
    while (f != NULL && fgets(line, sizeof(line), f) != NULL) {
        const char * colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) == 0 && colon != NULL) {
            snprintf(info->description, sizeof(info->description), "%s", colon + 1 + (colon[1] == ' '));
            info->description[strcspn(info->description, "\n")] = '\0';
            break;
        }
    }
    if (f != NULL) {
        fclose(f);
    }
    const long page = sysconf(_SC_PAGESIZE), total = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES);
    info->memory_total = page > 0 && total > 0 ? (uint64_t) page * (uint64_t) total : 0;
    info->memory_free = page > 0 && avail > 0 ? (uint64_t) page * (uint64_t) avail : 0;
#else
    (void) info;
#endif
}

static iq_backend * cpu_backend_init(int32_t index, int32_t n_threads) {
    (void) index;
    return iq_backend_cpu_init(n_threads);
}

// ---- the GPU: its kernels' shapes, known in every build (a cache's size for the GPU can be
// computed anywhere); its backend only in a build with CUDA ----

// The GPU's attention kernels take head_dim 64, 128 or 256, for every cache type.
static innerq_status gpu_kv_check(int32_t head_dim, enum iq_type type_k, enum iq_type type_v) {
    if (head_dim != 64 && head_dim != 128 && head_dim != 256) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "a %s/%s KV cache on the GPU: its attention takes head_dim 64, 128 "
                           "or 256, not %d (use the CPU: n_gpu_layers 0)", iq_type_name(type_k), iq_type_name(type_v),
                           head_dim);
    }
    return INNERQ_OK;
}

#ifdef INNERQ_HAVE_CUDA
static int32_t cuda_count(void) { return iq_cuda_device_count(); }

static void cuda_describe(int32_t index, innerq_device_info * info) {
    size_t free_b = 0, total_b = 0;
    if (iq_cuda_device_info(index, info->description, sizeof(info->description), &free_b, &total_b) == 0) {
        info->memory_free = free_b, info->memory_total = total_b;
    }
}

static iq_backend * cuda_backend_init(int32_t index, int32_t n_threads) {
    (void) n_threads;
    return iq_backend_cuda_init(index);
}
#define DEVICE_CUDA_ROW .count = cuda_count, .describe = cuda_describe, .backend_init = cuda_backend_init, \
                        .owns = iq_backend_is_cuda
#else
static int32_t cuda_count(void) { return -1; }
#define DEVICE_CUDA_ROW .count = cuda_count
#endif

// The registry: a row per kind, in the order their devices are numbered.
static const struct device_kind device_kinds[] = {
    { .type = INNERQ_DEVICE_CPU, .name = "CPU", .kv_default = NULL, .kv_group = 64, .kv_align = 64, .host_memory = true,
      .kv_check = cpu_kv_check, .count = NULL, .describe = cpu_describe,
      .kv_value_scales = true,
      .kv_params8 = true,
      .kv_key_levels = true,
      .kv_preset_budget = true,
      .kv_auto_ahead = true,
      .backend_init = cpu_backend_init, .owns = iq_backend_is_cpu },
    // f16 where no cache is named, until the quantized one is its faster choice for every shape
    // (docs/DEFAULTS.md); G 32: one group per warp, its kernels' unit
    { .type = INNERQ_DEVICE_GPU, .name = "CUDA", .kv_default = "f16", .kv_group = 32, .kv_align = 256,
      .host_memory = false, .kv_check = gpu_kv_check, .kv_preset_budget = true,
      .kv_value_scales = true, .kv_params8 = true, .kv_key_levels = true, DEVICE_CUDA_ROW },
};
#define N_KINDS ((int32_t) (sizeof(device_kinds) / sizeof(device_kinds[0])))

const struct device_kind * device_kind_of(enum innerq_device_type type) {
    for (int32_t k = 0; k < N_KINDS; k++) {
        if (device_kinds[k].type == type) {
            return &device_kinds[k];
        }
    }
    return NULL;
}

const struct device_kind * device_kind_of_backend(iq_backend * be) {
    for (int32_t k = 0; k < N_KINDS; k++) {
        if (device_kinds[k].owns != NULL && device_kinds[k].owns(be)) {
            return &device_kinds[k];
        }
    }
    return &device_kinds[0];
}

struct device device_cpu(void) { return (struct device) { .kind = &device_kinds[0], .index = 0 }; }

static int32_t kind_count(const struct device_kind * kind) {
    const int32_t n = kind->count != NULL ? kind->count() : 1;
    return n > 0 ? n : 0;
}

int32_t innerq_cuda_device_count(void) { return device_kind_of(INNERQ_DEVICE_GPU)->count(); }

int32_t innerq_device_count(void) {
    int32_t n = 0;
    for (int32_t k = 0; k < N_KINDS; k++) {
        n += kind_count(&device_kinds[k]);
    }
    return n;
}

innerq_status innerq_device_get(int32_t i, innerq_device_info * out) {
    if (out == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_device_get: NULL argument");
    }
    int32_t first = 0;
    for (int32_t k = 0; k < N_KINDS; k++) {
        const struct device_kind * kind = &device_kinds[k];
        const int32_t n = kind_count(kind);
        if (i >= first && i < first + n) {
            memset(out, 0, sizeof(*out));
            out->type = kind->type;
            if (kind->count != NULL) {
                snprintf(out->name, sizeof(out->name), "%s%d", kind->name, i - first);
            } else {
                snprintf(out->name, sizeof(out->name), "%s", kind->name);
            }
            out->kv_group = kind->kv_group;
            out->kv_align = (int32_t) kind->kv_align;
            if (kind->describe != NULL) {
                kind->describe(i - first, out);
            }
            return INNERQ_OK;
        }
        first += n;
    }
    return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_device_get: device %d of %d", i, first);
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

static bool device_split_cpu;

void device_test_split_on_cpu(bool on) { device_split_cpu = on; }

innerq_status device_choose(int32_t n_gpu_layers, int32_t n_layer, bool cpu_fallback, struct device * out,
                            int32_t * n_split) {
    *out = device_cpu();
    *n_split = 0;
    if (n_gpu_layers == 0) {
        return INNERQ_OK;
    }
    if (n_gpu_layers < -1) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "n_gpu_layers = %d: use 0 (CPU), 1 .. %d (the last layers on "
                           "the GPU) or -1 (the whole model on the GPU)", n_gpu_layers, n_layer);
    }
    const bool split = n_gpu_layers != -1 && n_gpu_layers <= n_layer;
    if (split && device_split_cpu) {
        *n_split = n_gpu_layers;
        return INNERQ_OK;
    }
    const struct device_kind * gpu = device_kind_of(INNERQ_DEVICE_GPU);
    const int32_t n_dev = gpu->count();
    if (n_dev < 0) {
        return device_cpu_instead(n_gpu_layers, cpu_fallback,
                                  "this build of innerq has no CUDA backend (build with -DINNERQ_CUDA=ON)");
    }
    if (n_dev == 0 && !device_gpu_present()) {
        return device_cpu_instead(n_gpu_layers, cpu_fallback, "no CUDA device found");
    }
    if (n_dev == 0) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "n_gpu_layers = %d: this machine has an NVIDIA GPU that CUDA cannot "
                           "use: %s", n_gpu_layers, iq_error_get());
    }
    *out = (struct device) { .kind = gpu, .index = 0 };
    *n_split = split ? n_gpu_layers : 0;
    return INNERQ_OK;
}

innerq_status device_backend_init(struct device dev, int32_t n_threads, iq_backend ** out) {
    *out = dev.kind->backend_init != NULL ? dev.kind->backend_init(dev.index, n_threads) : NULL;
    if (*out == NULL) {
        return innerq_fail(dev.kind->type == INNERQ_DEVICE_CPU ? INNERQ_ERR_OUT_OF_MEMORY : INNERQ_ERR_BACKEND,
                           "could not create the %s backend: %s", dev.kind->name, iq_error_get());
    }
    return INNERQ_OK;
}
