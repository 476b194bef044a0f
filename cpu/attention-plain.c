// The plain cache types (f32, f16, q8_0, q4_0) for attention: rows of head_dim elements,
// row (head, t) = head * n_ctx + t (iq-kv.h), so a tile of consecutive positions is
// contiguous. f32 and f16 rows are read in place by the vec.h kernels; q8_0 / q4_0 tiles are
// converted to f32 into the scratch first.
#include "attention.h"

#include "ops.h"
#include "vec.h"

// Rows [t0, t0 + n) of one head as the vec kernels read them; *half says f16.
static const void * plain_rows(const struct iq_tensor * c, int head, int64_t t0, int n, float * scratch,
                               bool * half) {
    const char * rows = (const char *) c->data + head * c->nb[2] + t0 * c->nb[1];
    *half = c->type == IQ_TYPE_F16;
    if (c->type == IQ_TYPE_F32 || c->type == IQ_TYPE_F16) {
        return rows;
    }
    iq_cpu_to_float(c->type)(rows, scratch, (int64_t) n * c->ne[0]);
    return scratch;
}

static void plain_scores(const struct iq_kv_layer * layer, int head, int64_t t0, int n, int nq, const float * q,
                         float * s, int64_t ss, float * scratch) {
    const struct iq_vec_fns * vec = iq_vec();
    bool half;
    const void * rows = plain_rows(layer->k, head, t0, n, scratch, &half);
    (half ? vec->scores_f16 : vec->scores)(layer->head_dim, n, rows, layer->head_dim, nq, q, s, ss);
}

static void plain_accum(const struct iq_kv_layer * layer, int head, int64_t t0, int n, int nq, const float * p,
                        int64_t ps, float * o, float * scratch) {
    const struct iq_vec_fns * vec = iq_vec();
    bool half;
    const void * rows = plain_rows(layer->v, head, t0, n, scratch, &half);
    (half ? vec->accum_f16 : vec->accum)(layer->head_dim, n, rows, layer->head_dim, nq, p, ps, o);
}

// f16 through the vector conversion (exact, as the reference), other types through the
// reference quantizer.
static void plain_store(struct iq_kv_layer * layer, bool is_v, int head, int64_t t0, int n, const float * x,
                        int64_t xs) {
    struct iq_tensor * c = is_v ? layer->v : layer->k;
    const struct iq_vec_fns * vec = iq_vec();
    const iq_from_float_fn from_float = iq_type_traits_get(c->type)->from_float;
    char * rows = (char *) c->data + head * c->nb[2];
    for (int i = 0; i < n; i++) {
        void * row = rows + (t0 + i) * c->nb[1];
        if (c->type == IQ_TYPE_F16) {
            vec->to_f16(c->ne[0], row, x + i * xs);
        } else {
            from_float(x + i * xs, row, c->ne[0]);
        }
    }
}

const struct iq_attn_cache_fns iq_attn_plain_fns = {
    .scores = plain_scores,
    .accum = plain_accum,
    .store = plain_store,
};
