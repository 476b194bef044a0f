// The backend interface's wrappers (iq-backend.h): every call goes through the vtables.
#include "iq-backend.h"

#include <stdlib.h>

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

int iq_backend_synchronize(iq_backend * be) { return be->iface.synchronize != NULL ? be->iface.synchronize(be) : 0; }

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

bool iq_tensor_copy(struct iq_tensor * dst, const struct iq_tensor * src) {
    const size_t size = iq_nbytes(src);
    if (size != iq_nbytes(dst)) {
        iq_error_set("copy of '%s' to '%s': %zu bytes into %zu", src->name, dst->name, size, iq_nbytes(dst));
        return false;
    }
    iq_buffer * to = iq_tensor_buffer(dst, 0, size, "copy");
    if (to == NULL || iq_tensor_buffer(src, 0, size, "copy") == NULL) {
        return false;
    }
    if (to->iface.copy_tensor != NULL && to->iface.copy_tensor(to, dst, src)) {
        return true;
    }
    // no direct path between the two buffers: through host memory
    void * tmp = malloc(size > 0 ? size : 1);
    if (tmp == NULL) {
        iq_error_set("copy of '%s': out of memory for %zu bytes", src->name, size);
        return false;
    }
    iq_tensor_get(src, tmp, 0, size);
    iq_tensor_set(dst, tmp, 0, size);
    free(tmp);
    return true;
}
