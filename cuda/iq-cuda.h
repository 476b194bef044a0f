// The CUDA backend (cuda/): device buffers, and graphs run on one stream of one device,
// replayed as a CUDA graph when the same graph shape comes again (a decoded token).
#pragma once

#include "iq-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// CUDA devices present (0 when there is no device or no driver).
int iq_cuda_device_count(void);
// The device's name (into desc, n bytes) and its free and total memory; 0, or -1 + iq_error_set.
int iq_cuda_device_info(int device, char * desc, size_t n, size_t * free_bytes, size_t * total_bytes);
// A backend on device `device`; NULL + iq_error_set (no device, no memory).
iq_backend * iq_backend_cuda_init(int device);
bool iq_backend_is_cuda(iq_backend * be);

#ifdef __cplusplus
}
#endif
