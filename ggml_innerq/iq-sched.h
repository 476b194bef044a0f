// The scheduler: one graph over several backends (a model split between the CPU and a GPU).
//
// Every tensor carries the backend_id of the backend that holds or runs it (iq.h: a builder
// sets its context's id per layer; weights and cache storage get their layer's). The nodes are
// cut into splits, maximal runs of one backend in execution order. A node that reads a tensor
// of another backend reads a copy made in its own backend's memory at the start of the first
// split that needs it (the hidden state at a boundary, an input such as the positions); a view
// runs where the tensor it views lives. Each backend's share of the graph is allocated by a
// graph allocator of its own, in execution order: a copy lives from the start of its split to
// its last reader, and the tensor it is made from until the copy is made. With one backend
// the graph is allocated and run as it is, without splits.
//
// The offload rule (as llama.cpp's op offload): a product of a weight held by backend `from` by
// a batch of at least min_batch columns runs on backend `to` (which must support it), the
// weight copied over for the step: a prompt's products of the CPU's layers run on the GPU,
// whose speed on a large batch pays for the copy; a decoding step's stay where they are.
#pragma once

#include "iq-alloc.h"

#ifdef __cplusplus
extern "C" {
#endif

#define IQ_SCHED_MAX_BACKENDS 4

typedef struct iq_sched iq_sched;

// A scheduler over be[0 .. n) (the caller keeps and frees the backends); NULL + iq_error_set.
iq_sched * iq_sched_new(iq_backend * const * be, int n);
void iq_sched_free(iq_sched * s);
// Cuts g into splits, gives the nodes that read another backend's tensors their copies
// (rewriting their sources) and allocates every backend's share; false + iq_error_set (a
// tensor with no backend of the scheduler, out of memory). g belongs to this call's plan
// until the next one.
bool iq_sched_alloc_graph(iq_sched * s, struct iq_cgraph * g);
// Runs the splits of the graph last allocated, each after its copies: 0, or -1 + iq_error_set.
int iq_sched_graph_compute(iq_sched * s, struct iq_cgraph * g);
// Products of weights of `from` by at least min_batch columns run on `to` (0: never).
void iq_sched_set_offload(iq_sched * s, int from, int to, int64_t min_batch);
// The splits of the last plan, and the bytes its copies moved per step.
int iq_sched_n_splits(const iq_sched * s);
size_t iq_sched_copy_bytes(const iq_sched * s);
// The bytes of backend i's compute buffer (its graph allocator's).
size_t iq_sched_buffer_size(const iq_sched * s, int i);

#ifdef __cplusplus
}
#endif
