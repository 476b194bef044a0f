#include "kv-cache.h"

#include "model.h"
#include "status.h"

#include <stdlib.h>
#include <string.h>

#define KV_DEFAULT_TYPE IQ_TYPE_F16

static innerq_status kv_type_parse(const char * name, enum iq_type * out) {
    if (name == NULL || name[0] == '\0') {
        *out = KV_DEFAULT_TYPE;
        return INNERQ_OK;
    }
    for (int t = 0; t < IQ_TYPE_COUNT; t++) {
        const struct iq_type_traits * tt = iq_type_traits_get((enum iq_type) t);
        if (tt != NULL && strcmp(tt->name, name) == 0) {
            if (!iq_kv_type_is_plain((enum iq_type) t)) {
                break;
            }
            *out = (enum iq_type) t;
            return INNERQ_OK;
        }
    }
    char names[256] = "";
    for (int32_t i = 0; i < innerq_kv_type_count(); i++) {
        strncat(names, i ? ", " : "", sizeof(names) - strlen(names) - 1);
        strncat(names, innerq_kv_type_name(i), sizeof(names) - strlen(names) - 1);
    }
    return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "unknown KV cache type '%s' (known: %s)", name, names);
}

innerq_status kv_cache_types(const innerq_context_params * params, enum iq_type * type_k, enum iq_type * type_v) {
    innerq_status st = kv_type_parse(params->kv_k, type_k);
    return st != INNERQ_OK ? st : kv_type_parse(params->kv_v, type_v);
}

int32_t innerq_kv_type_count(void) {
    int32_t n = 0;
    for (int t = 0; t < IQ_TYPE_COUNT; t++) {
        n += iq_kv_type_is_plain((enum iq_type) t);
    }
    return n;
}

const char * innerq_kv_type_name(int32_t i) {
    for (int t = 0; t < IQ_TYPE_COUNT; t++) {
        if (iq_kv_type_is_plain((enum iq_type) t) && i-- == 0) {
            return iq_type_name((enum iq_type) t);
        }
    }
    return NULL;
}

double kv_cache_bytes_per_token(const struct llama_hparams * hp, enum iq_type type_k, enum iq_type type_v) {
    return (double) hp->n_layer * hp->n_head_kv *
           (double) (iq_row_size(type_k, hp->head_dim) + iq_row_size(type_v, hp->head_dim));
}

innerq_status kv_cache_init(const struct llama_hparams * hp, iq_backend * be, const innerq_context_params * params,
                            int32_t n_ctx, struct kv_cache ** out) {
    *out = NULL;
    enum iq_type type_k, type_v;
    innerq_status st = kv_cache_types(params, &type_k, &type_v);
    if (st != INNERQ_OK) {
        return st;
    }
    if (iq_row_size(type_k, hp->head_dim) == 0 || iq_row_size(type_v, hp->head_dim) == 0) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "KV cache types %s/%s need head_dim (%d) to be a multiple of their block size",
                           iq_type_name(type_k), iq_type_name(type_v), hp->head_dim);
    }
    struct kv_cache * c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory allocating the KV cache");
    }
    c->n_layer = hp->n_layer;
    c->n_ctx = n_ctx;
    c->type_k = type_k;
    c->type_v = type_v;
    c->layers = calloc((size_t) hp->n_layer, sizeof(*c->layers));
    c->ctx = iq_context_init((size_t) (2 * hp->n_layer + 1) * iq_tensor_overhead());
    if (c->layers == NULL || c->ctx == NULL) {
        kv_cache_free(c);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory allocating the KV cache");
    }
    const size_t align = iq_backend_alignment(be);
    size_t total = 0;
    for (int32_t il = 0; il < hp->n_layer; il++) {
        struct iq_kv_layer * l = &c->layers[il];
        l->type_k = type_k;
        l->type_v = type_v;
        l->head_dim = hp->head_dim;
        l->n_kv_head = hp->n_head_kv;
        l->n_ctx = n_ctx;
        l->k = iq_new_tensor_3d(c->ctx, type_k, hp->head_dim, n_ctx, hp->n_head_kv);
        l->v = iq_new_tensor_3d(c->ctx, type_v, hp->head_dim, n_ctx, hp->n_head_kv);
        if (l->k == NULL || l->v == NULL) {
            kv_cache_free(c);
            return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "KV cache: %s", iq_error_get());
        }
        iq_set_name(l->k, "cache_k.%d", il);
        iq_set_name(l->v, "cache_v.%d", il);
        total += (iq_nbytes(l->k) + align - 1) / align * align;
        total += (iq_nbytes(l->v) + align - 1) / align * align;
    }
    c->buf = iq_backend_alloc_buffer(be, total);
    if (c->buf == NULL) {
        kv_cache_free(c);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "KV cache of %.1f MiB: %s", total / 1048576.0, iq_error_get());
    }
    size_t off = 0;
    for (int32_t il = 0; il < hp->n_layer; il++) {
        struct iq_kv_layer * l = &c->layers[il];
        iq_tensor_place(l->k, c->buf, off);
        off += (iq_nbytes(l->k) + align - 1) / align * align;
        iq_tensor_place(l->v, c->buf, off);
        off += (iq_nbytes(l->v) + align - 1) / align * align;
    }
    // Unwritten cells are never read, but start from zeros so a bug can't read garbage.
    iq_buffer_clear(c->buf, 0);
    *out = c;
    return INNERQ_OK;
}

void kv_cache_free(struct kv_cache * c) {
    if (c == NULL) {
        return;
    }
    if (c->buf) {
        iq_buffer_free(c->buf);
    }
    if (c->ctx) {
        iq_context_free(c->ctx);
    }
    free(c->layers);
    free(c);
}

void kv_cache_clear(struct kv_cache * c) { c->n_past = 0; }

uint64_t kv_cache_size(const struct kv_cache * c) { return c->buf ? c->buf->size : 0; }
