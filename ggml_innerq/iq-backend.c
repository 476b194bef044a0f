// The backend interface's wrappers (iq-backend.h): every call goes through the vtables.
#include "iq-backend.h"

const char * iq_backend_name(iq_backend * be) { return be != NULL ? be->iface.name(be) : "none"; }

void iq_backend_free(iq_backend * be) {
    if (be != NULL) {
        be->iface.free(be);
    }
}

iq_buffer * iq_backend_alloc_buffer(iq_backend * be, size_t size) { return be->iface.alloc_buffer(be, size); }

iq_buffer * iq_backend_buffer_from_host(iq_backend * be, void * ptr, size_t size) {
    if (be->iface.buffer_from_host == NULL) {
        iq_error_set("backend %s can't use host memory in place", iq_backend_name(be));
        return NULL;
    }
    return be->iface.buffer_from_host(be, ptr, size);
}

size_t iq_backend_alignment(iq_backend * be) { return be->iface.alignment(be); }

int iq_backend_graph_compute(iq_backend * be, struct iq_cgraph * g) { return be->iface.graph_compute(be, g); }

void iq_buffer_free(iq_buffer * buf) {
    if (buf != NULL) {
        buf->iface.free(buf);
    }
}

void iq_buffer_clear(iq_buffer * buf, uint8_t value) { buf->iface.clear(buf, value); }

void iq_tensor_place(struct iq_tensor * t, iq_buffer * buf, size_t offset) {
    t->buffer = buf;
    t->data = (char *) buf->base + offset;
}

// The buffer holding t's data: a view's buffer is its source's.
static iq_buffer * iq_tensor_buffer(const struct iq_tensor * t, size_t offset, size_t size, const char * what) {
    iq_buffer * buf = t->buffer != NULL ? t->buffer : (t->view_src != NULL ? t->view_src->buffer : NULL);
    if (buf == NULL || t->data == NULL) {
        iq_error_set("%s of tensor '%s': it has no data", what, t->name);
        return NULL;
    }
    if (offset + size > iq_nbytes(t)) {
        iq_error_set("%s of tensor '%s': bytes [%zu, %zu) outside its %zu bytes", what, t->name, offset,
                     offset + size, iq_nbytes(t));
        return NULL;
    }
    return buf;
}

void iq_tensor_set(struct iq_tensor * t, const void * data, size_t offset, size_t size) {
    iq_buffer * buf = iq_tensor_buffer(t, offset, size, "set");
    if (buf != NULL) {
        buf->iface.set(buf, t, data, offset, size);
    }
}

void iq_tensor_get(const struct iq_tensor * t, void * data, size_t offset, size_t size) {
    iq_buffer * buf = iq_tensor_buffer(t, offset, size, "get");
    if (buf != NULL) {
        buf->iface.get(buf, t, data, offset, size);
    }
}
