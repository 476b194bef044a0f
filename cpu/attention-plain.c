// The plain cache types (f32, f16, q8_0, q4_0): rows of head_dim elements in pages of the
// pool (iq-kv.h); a page is a multiple of IQ_ATTN_TILE positions and a tile stops at the end
// of its page (the op's stretches start on tiles, but a sliding window anywhere), so a tile of
// consecutive positions is contiguous. f32 and f16 rows are read in
// place; q8_0 / q4_0 tiles are converted to f32 in the scratch first.
#include "attention.h"

#include "ops.h"
#include "vec.h"

// Rows [t0, t0 + n) of one head as iq_attn_rows reads them (inside one page); *half says f16.
static const void * plain_rows(const struct iq_attn_cache * cache, const struct iq_tensor * c, int head, int64_t t0,
                               int n, float * tile, bool * half) {
    const char * rows = iq_kv_plain_row(cache->layer, c, cache->pages, head, t0);
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
    for (int64_t t = t0, n; t < t1; t += n) {
        n = t1 - t < IQ_ATTN_TILE ? t1 - t : IQ_ATTN_TILE;
        n = n < layer->page - t % layer->page ? n : layer->page - t % layer->page;
        bool k_half, v_half;
        const void * k = plain_rows(cache, layer->k, head, t, (int) n, ktile, &k_half);
        const void * v = plain_rows(cache, layer->v, head, t, (int) n, vtile, &v_half);
        iq_attn_rows(d, (int) n, k, k_half, d, v, v_half, d, nq, q, NULL, st, s);
    }
}

// f16 goes through the vector conversion (exact, as the reference), other types through the
// reference quantizer.
static void plain_store_head(const struct iq_attn_cache * cache, int head, const float * k, const float * v,
                             int32_t n, int32_t n_past) {
    const struct iq_kv_layer * layer = cache->layer;
    const struct iq_vec_fns * vec = iq_vec();
    const int64_t d = layer->head_dim, ld = (int64_t) layer->n_kv_head * d;
    for (int x = 0; x < 2; x++) {
        struct iq_tensor * c = x ? layer->v : layer->k;
        const float * src = (x ? v : k) + head * d;
        const iq_from_float_fn from_float = iq_type_traits_get(c->type)->from_float;
        for (int32_t i = 0; i < n; i++) {
            void * dst = iq_kv_plain_row(layer, c, cache->pages, head, n_past + i);
            if (c->type == IQ_TYPE_F16) {
                vec->to_f16(d, dst, src + i * ld);
            } else {
                from_float(src + i * ld, dst, d);
            }
        }
    }
}

const struct iq_attn_cache_fns iq_attn_plain_fns = {
    .attend = plain_attend,
    .store_head = plain_store_head,
};
