// The devices a model can run on, as a registry (the shape of ggml-backend's device registry):
// a kind of device (the CPU, a CUDA GPU) is a row of what its devices share, known without one
// present (the KV cache's defaults, which caches its attention takes, how to start its backend);
// a device is a kind and an index. The CPU is always device 0; the CUDA devices follow where
// the build has the backend and the machine a usable GPU. device.c is the one place that names
// a backend: a second GPU backend is one more row there, not a branch through src/.
#pragma once

#include "innerq.h"
#include "iq-backend.h"

struct device_kind {
    enum innerq_device_type type;
    const char * name;        // "CPU", "CUDA" (a GPU's device name adds its index)
    const char * kv_default;  // the cache type a context takes where it names none (NULL: innerq's default)
    int32_t kv_group;         // the quantized cache's group size for kv_group 0 (docs/DEFAULTS.md)
    size_t kv_align;          // alignment of the cache's regions in its buffers (bytes)
    bool host_memory;         // its buffers are host memory: weights are used in the mapped file
    // Whether its attention takes a cache of this shape (INNERQ_ERR_UNSUPPORTED with the reason).
    innerq_status (*kv_check)(int32_t head_dim, enum iq_type type_k, enum iq_type type_v);
    bool kv_value_scales;     // its attention reads InnerQ value row scales
    bool kv_params8;          // ... and 8-bit group parameters
    bool kv_key_levels;       // ... and keys on the key levels
    // The InnerQ preset spends the bytes of its rule-of-thumb windows on code bits, the windows at
    // their floors (docs/INNERQ.md, "The preset's layout"); without: K3/V2 with those windows.
    bool kv_preset_budget;
    // kv_bits measures its layout with a measuring step (the prompt's next tokens, docs/INNERQ.md
    // "Automatic layout"); without: the windows' rows alone. The measurement runs on the host, so
    // where the device evaluates a prompt far faster than the host measures it (the GPU) the
    // step's 527 rows would cost the prompt 2x-3x (docs/BENCHMARKS.md "The measuring step kept").
    bool kv_auto_ahead;
    // Devices present, or -1 where this build has no backend for the kind (NULL: one, always).
    int32_t (*count)(void);
    // The description and memory of device index of the kind (NULL: unknown).
    void (*describe)(int32_t index, innerq_device_info * info);
    // The backend of device index (n_threads: the CPU's), or NULL + iq_error_set.
    iq_backend * (*backend_init)(int32_t index, int32_t n_threads);
    bool (*owns)(iq_backend * be);
};

struct device {
    const struct device_kind * kind;
    int32_t index;  // among the devices of its kind
};

// The row of a kind; the one of the device that owns a backend.
const struct device_kind * device_kind_of(enum innerq_device_type type);
const struct device_kind * device_kind_of_backend(iq_backend * be);
// The CPU.
struct device device_cpu(void);
// The device for n_gpu_layers and the layers it takes, as llama.cpp counts them: 0 is the CPU;
// -1 or > n_layer the whole model on the first GPU (*n_split 0); 1 .. n_layer a split, the last
// n_gpu_layers layers on the GPU (*n_split = n_gpu_layers) and the rest of the model, the input
// and output layers among it, on the CPU. A build without CUDA or a machine without a GPU: the
// CPU with a warning line if cpu_fallback (loading a model, as llama.cpp), else a clear failure.
innerq_status device_choose(int32_t n_gpu_layers, int32_t n_layer, bool cpu_fallback, struct device * out,
                            int32_t * n_split);
// Tests: while on, a split puts its GPU layers on a second CPU device instead (a machine without a
// GPU runs the split's copies and second backend; results equal the CPU's bit for bit).
void device_test_split_on_cpu(bool on);
// The backend of the device (n_threads is the CPU's).
innerq_status device_backend_init(struct device dev, int32_t n_threads, iq_backend ** out);
