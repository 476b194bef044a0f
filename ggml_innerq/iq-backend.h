// The backend interface: a small vtable through which a backend owns the memory of its
// tensors and runs graphs. The runtime (src/) never touches tensor data directly; it goes
// through iq_tensor_set / iq_tensor_get so that the data may live on a GPU.
#pragma once

#include "iq.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct iq_backend iq_backend;
typedef struct iq_buffer iq_buffer;

struct iq_buffer_i {
    void (*free)(iq_buffer * buf);
    void (*set)(iq_buffer * buf, struct iq_tensor * t, const void * data, size_t offset, size_t size);
    void (*get)(iq_buffer * buf, const struct iq_tensor * t, void * data, size_t offset, size_t size);
    void (*clear)(iq_buffer * buf, uint8_t value);
    // dst (in buf) = src's bytes, src in any buffer this one can read directly (a host buffer,
    // or one of its own device); false if it can't, and the caller goes through host memory.
    bool (*copy_tensor)(iq_buffer * buf, struct iq_tensor * dst, const struct iq_tensor * src);
};

struct iq_buffer {
    struct iq_buffer_i iface;
    iq_backend * backend;
    void * base;      // address of byte 0 (device address on a GPU)
    size_t size;
    bool is_host;     // base is ordinary host memory
    void * context;
};

struct iq_backend_i {
    const char * (*name)(iq_backend * be);
    void (*free)(iq_backend * be);
    size_t (*alignment)(iq_backend * be);
    iq_buffer * (*alloc_buffer)(iq_backend * be, size_t size);  // NULL + iq_error_set on failure
    // Wraps host memory (an mmapped weight file) without copying; NULL if the backend can't.
    iq_buffer * (*buffer_from_host)(iq_backend * be, void * ptr, size_t size);
    bool (*supports_op)(iq_backend * be, const struct iq_tensor * t);
    int (*graph_compute)(iq_backend * be, struct iq_cgraph * g);  // 0, or -1 + iq_error_set
    // Waits until the work queued by graph_compute is done: 0, or -1 + iq_error_set for a
    // failure that surfaced late. NULL where graph_compute returns only when it is done.
    int (*synchronize)(iq_backend * be);
};

struct iq_backend {
    struct iq_backend_i iface;
    void * context;
};

const char * iq_backend_name(iq_backend * be);
void iq_backend_free(iq_backend * be);
iq_buffer * iq_backend_alloc_buffer(iq_backend * be, size_t size);
iq_buffer * iq_backend_buffer_from_host(iq_backend * be, void * ptr, size_t size);
size_t iq_backend_alignment(iq_backend * be);
int iq_backend_graph_compute(iq_backend * be, struct iq_cgraph * g);
int iq_backend_synchronize(iq_backend * be);
void iq_buffer_free(iq_buffer * buf);
void iq_buffer_clear(iq_buffer * buf, uint8_t value);

// Places t at `offset` bytes into buf (sets t->buffer and t->data).
void iq_tensor_place(struct iq_tensor * t, iq_buffer * buf, size_t offset);
void iq_tensor_set(struct iq_tensor * t, const void * data, size_t offset, size_t size);
void iq_tensor_get(const struct iq_tensor * t, void * data, size_t offset, size_t size);
// dst = src (same size), between any two buffers (host and device alike); false + iq_error_set.
bool iq_tensor_copy(struct iq_tensor * dst, const struct iq_tensor * src);

#ifdef __cplusplus
}
#endif
