// The plain cache format (f32, f16, q8_0, q4_0): every token's key and value as a row of a ggml
// type along head_dim, in pages of KV_PLAIN_PAGE tokens. A sequence's token t is row t %
// page of page table[t / page]; a store writes its rows, a rewind keeps every row below it.
#include "hparams.h"
#include "kv-cache.h"
#include "status.h"

#include <limits.h>

static bool plain_has_type(enum iq_type type) {
    return type == IQ_TYPE_F32 || type == IQ_TYPE_F16 || type == IQ_TYPE_Q8_0 || type == IQ_TYPE_Q4_0;
}

static innerq_status plain_configure(const innerq_context_params * p, const struct llama_hparams * hp,
                                     struct kv_config * cfg) {
    (void) p;
    if (hp != NULL && (iq_row_size(cfg->type_k, hp->head_dim) == 0 || iq_row_size(cfg->type_v, hp->head_dim) == 0)) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "KV cache types %s/%s need head_dim (%d) to be a multiple of their "
                           "block size", iq_type_name(cfg->type_k), iq_type_name(cfg->type_v), hp->head_dim);
    }
    return INNERQ_OK;
}

// Pages of KV_PLAIN_PAGE tokens (a short context: one page of its tokens, in whole tiles of the
// CPU's attention). Each sequence may end inside a page: one more page per further sequence
// than n_ctx tokens fill.
static void plain_shape(struct kv_config * cfg) {
    const int32_t tiles = (cfg->n_ctx + 63) / 64 * 64;
    cfg->page = tiles < KV_PLAIN_PAGE ? tiles : KV_PLAIN_PAGE;
    cfg->n_table = (cfg->n_ctx + cfg->page - 1) / cfg->page;
    cfg->n_pages = cfg->n_table + cfg->n_slots - 1;
}

static double plain_bytes_per_token(const struct kv_config * cfg, const struct llama_hparams * hp) {
    const double heads = (double) hp->n_layer * hp->n_head_kv;
    return heads * (double) (iq_row_size(cfg->type_k, hp->head_dim) + iq_row_size(cfg->type_v, hp->head_dim));
}

static innerq_status plain_layer_init(struct kv_cache * c, int32_t il, size_t * bytes) {
    struct iq_kv_layer * l = &c->layers[il];
    const int64_t rows = (int64_t) c->cfg.page * c->cfg.n_pages;
    l->k = iq_new_tensor_3d(c->ctx, c->cfg.type_k, c->head_dim, rows, c->n_kv_head);
    l->v = iq_new_tensor_3d(c->ctx, c->cfg.type_v, c->head_dim, rows, c->n_kv_head);
    if (l->k == NULL || l->v == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "KV cache: %s", iq_error_get());
    }
    iq_set_name(l->k, "cache_k.%d", il);
    iq_set_name(l->v, "cache_v.%d", il);
    *bytes = (iq_nbytes(l->k) + c->align - 1) / c->align * c->align + iq_nbytes(l->v);
    return INNERQ_OK;
}

static void plain_layer_place(struct kv_cache * c, int32_t il, size_t off) {
    struct iq_kv_layer * l = &c->layers[il];
    iq_buffer * buf = c->buf[c->layer_dev[il]];
    iq_tensor_place(l->k, buf, off);
    iq_tensor_place(l->v, buf, off + (iq_nbytes(l->k) + c->align - 1) / c->align * c->align);
}

static void plain_plan(const struct kv_config * cfg, const struct kv_seq * s, int32_t n, struct iq_kv_seq * row) {
    (void) cfg, (void) n;
    row->n_past = s->n_past;
    row->n_sink = row->n_quant = 0;
    row->flush = (struct iq_qcache_flush) {0};
}

static int32_t plain_pages_after(const struct kv_config * cfg, const struct iq_kv_seq * row) {
    return (row->n_past + row->n_tokens + cfg->page - 1) / cfg->page;
}

static void plain_commit(const struct kv_config * cfg, const struct iq_kv_seq * row, struct kv_seq * s) {
    (void) cfg, (void) row, (void) s;
}

static int32_t plain_until_flush(const struct kv_config * cfg, const struct kv_seq * s) {
    (void) cfg, (void) s;
    return INT32_MAX;
}

static int32_t plain_keep(const struct kv_config * cfg, const struct kv_seq * s, int32_t n, struct kv_seq * out) {
    *out = *s;
    out->n_past = n < s->n_past ? n : s->n_past;
    out->n_pages = (out->n_past + cfg->page - 1) / cfg->page;
    return out->n_past;
}

static int32_t plain_exact_fit(const struct kv_config * cfg, const struct kv_seq * s, int32_t lo, int32_t hi) {
    (void) cfg, (void) s, (void) lo;
    return hi;
}

// Per layer the keys, then the values: per head the rows [0, n_past) page by page (pages that
// follow each other in the pool as one chunk).
static void plain_walk(const struct kv_cache * c, int32_t slot, const struct kv_seq * s, kv_chunk_fn fn, void * arg) {
    const int32_t page = c->cfg.page, * table = c->table + (size_t) slot * c->cfg.n_table;
    for (int32_t il = 0; il < c->n_layer; il++) {
        for (int x = 0; x < 2; x++) {
            struct iq_tensor * t = x ? c->layers[il].v : c->layers[il].k;
            for (int64_t h = 0; h < t->ne[2]; h++) {
                for (int32_t j = 0; j * page < s->n_past;) {
                    int32_t e = j + 1;
                    while (e * page < s->n_past && table[e] == table[e - 1] + 1) {
                        e++;
                    }
                    const int32_t rows = (e * page < s->n_past ? e * page : s->n_past) - j * page;
                    fn(t, (size_t) h * t->nb[2] + (size_t) table[j] * page * t->nb[1], (size_t) rows * t->nb[1], arg);
                    j = e;
                }
            }
        }
    }
}

const struct kv_format kv_format_plain = {
    .name = "plain",
    .quantized = false,
    .has_type = plain_has_type,
    .configure = plain_configure,
    .shape = plain_shape,
    .bytes_per_token = plain_bytes_per_token,
    .layer_init = plain_layer_init,
    .layer_place = plain_layer_place,
    .plan = plain_plan,
    .pages_after = plain_pages_after,
    .commit = plain_commit,
    .until_flush = plain_until_flush,
    .keep = plain_keep,
    .exact_fit = plain_exact_fit,
    .walk = plain_walk,
};
