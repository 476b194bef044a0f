// The plain cache types (f32, f16, q8_0, q4_0): rows of head_dim elements, row (head, t) =
// head * n_ctx + t (iq-kv.h), so a tile of consecutive positions is contiguous. f32 and f16
// rows are read in place; q8_0 / q4_0 tiles are converted to f32 in the scratch first.
#include "attention.h"

#include "ops.h"
#include "vec.h"

// Rows [t0, t0 + n) of one head as iq_attn_rows reads them; *half says f16.
static const void * plain_rows(const struct iq_tensor * c, int head, int64_t t0, int n, float * tile, bool * half) {
    const char * rows = (const char *) c->data + head * c->nb[2] + t0 * c->nb[1];
    *half = c->type == IQ_TYPE_F16;
    if (c->type == IQ_TYPE_F32 || c->type == IQ_TYPE_F16) {
        return rows;
    }
    iq_cpu_to_float(c->type)(rows, tile, (int64_t) n * c->ne[0]);
    return tile;
}

static void plain_attend(const struct iq_attn_cache * cache, int head, int64_t t0, int64_t t1, int nq, int r,
                         const float * q, float * st, float * scratch) {
    const struct iq_kv_layer * layer = cache->layer;
    const int d = layer->head_dim;
    float * s = scratch;
    float * ktile = s + nq * IQ_ATTN_TILE;
    float * vtile = ktile + IQ_ATTN_TILE * d;
    for (int64_t t = t0; t < t1; t += IQ_ATTN_TILE) {
        const int n = (int) (t1 - t < IQ_ATTN_TILE ? t1 - t : IQ_ATTN_TILE);
        bool k_half, v_half;
        const void * k = plain_rows(layer->k, head, t, n, ktile, &k_half);
        const void * v = plain_rows(layer->v, head, t, n, vtile, &v_half);
        iq_attn_rows(d, n, k, k_half, d, v, v_half, d, nq, q, NULL, st, s);
    }
}

// One item per (K or V, KV head). f16 goes through the vector conversion (exact, as the
// reference), other types through the reference quantizer.
static void plain_store(const struct iq_cpu_params * p, const struct iq_attn_cache * cache, const struct iq_tensor * k,
                        const struct iq_tensor * v, int32_t n_past) {
    const struct iq_kv_layer * layer = cache->layer;
    const struct iq_vec_fns * vec = iq_vec();
    const int n_kv = layer->n_kv_head;
    int64_t a, e;
    iq_cpu_split(2 * n_kv, p->ith, p->nth, &a, &e);
    for (int64_t it = a; it < e; it++) {
        const bool is_v = it >= n_kv;
        const int head = (int) (it % n_kv);
        const struct iq_tensor * x = is_v ? v : k;
        struct iq_tensor * c = is_v ? layer->v : layer->k;
        const iq_from_float_fn from_float = iq_type_traits_get(c->type)->from_float;
        for (int64_t i = 0; i < x->ne[2]; i++) {
            const float * src = (const float *) ((const char *) x->data + i * x->nb[2] + head * x->nb[1]);
            void * dst = (char *) c->data + head * c->nb[2] + (n_past + i) * c->nb[1];
            if (c->type == IQ_TYPE_F16) {
                vec->to_f16(c->ne[0], dst, src);
            } else {
                from_float(src, dst, c->ne[0]);
            }
        }
    }
}

const struct iq_attn_cache_fns iq_attn_plain_fns = {
    .attend = plain_attend,
    .store = plain_store,
};
