// The graph allocator: places every tensor of a graph that has no data yet (intermediates
// and inputs) in one backend buffer, reusing the memory of a tensor once its last reader
// has run. Inputs and outputs are never reused. The buffer grows when a graph needs more.
#pragma once

#include "iq-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct iq_gallocr iq_gallocr;

iq_gallocr * iq_gallocr_new(iq_backend * be);
void iq_gallocr_free(iq_gallocr * ga);
// Returns false (+ iq_error_set) if the buffer could not be allocated.
bool iq_gallocr_alloc_graph(iq_gallocr * ga, struct iq_cgraph * g);
size_t iq_gallocr_buffer_size(const iq_gallocr * ga);

#ifdef __cplusplus
}
#endif
