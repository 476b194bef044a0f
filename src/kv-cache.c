// The KV cache: making and freeing it, and steps (kv-cache.h).
#include "kv-cache.h"

#include "device.h"
#include "hparams.h"
#include "kv-cache-impl.h"
#include "status.h"

#include <stdlib.h>
#include <string.h>

static innerq_status kv_cache_make_of(const struct llama_hparams * hp, const struct device_kind * dev, size_t align,
                                      int32_t n_dev, const int32_t * layer_dev, const innerq_context_params * params,
                                      int32_t n_ctx, int32_t n_slots, struct kv_cache ** out);

// ---- the preset's layout (docs/INNERQ.md, "The preset's layout") ----

// The bits of each layer's keys and values for `units` code bits over the layers: from K2/V2,
// keys to 3 and 4 bits, then values to 3, keys to 5, values to 4 and 5, each step layer by
// layer; a step that the units cover for e of the n layers only takes layers spread evenly over
// the depth ((2i + 1) n / 2e, i < e), chosen without data so that any sequence and device make
// the same. The preset starts from K3/V2 (5 n units), which fits its budget.
static void kv_preset_bits(int32_t n_layer, int32_t units, int32_t (*bits)[2]) {
    static const int32_t steps[][2] = {{0, 3}, {0, 4}, {1, 3}, {0, 5}, {1, 4}, {1, 5}};  // (keys 0 / values 1, bits)
    for (int32_t il = 0; il < n_layer; il++) {
        bits[il][0] = 2;
        bits[il][1] = 2;
    }
    int32_t extra = units - 4 * n_layer;
    for (size_t r = 0; r < sizeof(steps) / sizeof(steps[0]) && extra > 0; r++) {
        const int32_t e = extra < n_layer ? extra : n_layer;
        for (int32_t i = 0; i < e; i++) {
            bits[(int64_t) (2 * i + 1) * n_layer / (2 * e)][steps[r][0]] = steps[r][1];
        }
        extra -= e;
    }
}

// The bytes of a cache of params (with the caller's devices and alignment).
static innerq_status kv_bytes_of(const struct llama_hparams * hp, const struct device_kind * dev, size_t align,
                                 int32_t n_dev, const int32_t * layer_dev, const innerq_context_params * params,
                                 int32_t n_ctx, int32_t n_slots, size_t * bytes) {
    struct kv_cache * c;
    const innerq_status st = kv_cache_make_of(hp, dev, align, n_dev, layer_dev, params, n_ctx, n_slots, &c);
    if (st == INNERQ_OK) {
        *bytes = c->size;
        kv_cache_free(c);
    }
    return st;
}

// The preset (cfg->preset_budget) or a pool's kv_bits (cfg->pool_bits) as explicit parameters.
// The preset's budget is what K3/V2 takes with the rule-of-thumb windows the configuration has
// (as before this layout), and with the windows at their floors the layers get the most code
// bits of kv_preset_bits within it (a bit more never shrinks the cache: a binary search); K3/V2
// still fits, the floors being at most the rule's windows. A pool's budget is kv_bits effective
// bits per element at n_ctx, with the configuration's windows, from K2/V2 (which must fit). *q
// is params with types "innerq", the group, the windows and kv_layer_bits set, kv_bits 0 (spec:
// its storage, n_layer * 16 bytes).
static innerq_status kv_preset_layout(const struct llama_hparams * hp, const struct device_kind * dev, size_t align,
                                      int32_t n_dev, const int32_t * layer_dev, const innerq_context_params * params,
                                      int32_t n_ctx, int32_t n_slots, const struct kv_config * cfg,
                                      innerq_context_params * q, char * spec) {
    const int32_t n_layer = hp->n_layer;
    *q = *params;
    q->kv_k = q->kv_v = "innerq";
    q->kv_group = cfg->qcfg.group;
    q->kv_bits = 0.0f;
    q->kv_sink = cfg->qcfg.n_sink;  // windows named: kv_config_make takes the types' K3/V2
    q->kv_recent = cfg->qcfg.n_recent;
    size_t budget = 0, bytes = 0;
    innerq_status st = INNERQ_OK;
    if (cfg->pool_bits > 0.0) {
        const double elements = 2.0 * n_ctx * n_layer * hp->n_head_kv * hp->head_dim;
        budget = (size_t) (cfg->pool_bits * elements / 8.0);
    } else {
        st = kv_bytes_of(hp, dev, align, n_dev, layer_dev, q, n_ctx, n_slots, &budget);
        q->kv_sink = cfg->preset_sink;
        q->kv_recent = cfg->preset_recent;
    }
    int32_t (*bits)[2] = malloc(sizeof(*bits) * (size_t) n_layer);
    if (bits == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory choosing the KV cache's layout");
    }
    q->kv_layer_bits = spec;
    int32_t lo = (cfg->pool_bits > 0.0 ? 4 : 5) * n_layer, hi = 10 * n_layer;  // lo fits; find the last that does
    if (st == INNERQ_OK && cfg->pool_bits > 0.0) {
        kv_preset_bits(n_layer, lo, bits);
        kv_layer_bits_format(n_layer, (const int32_t (*)[2]) bits, spec);
        st = kv_bytes_of(hp, dev, align, n_dev, layer_dev, q, n_ctx, n_slots, &bytes);
        if (st == INNERQ_OK && bytes > budget) {
            const double elements = 2.0 * n_ctx * n_layer * hp->n_head_kv * hp->head_dim;
            st = innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_bits %g cannot be met at n_ctx %d: the f16 windows (sink "
                             "%d, recent %d + %d tokens per sequence, %d sequences) with 2-bit keys and values already "
                             "take %.3f bits per element; ask for more bits, a longer context or smaller windows "
                             "(kv_sink, kv_recent)", cfg->pool_bits, n_ctx, q->kv_sink, q->kv_recent, cfg->qcfg.group,
                             n_slots, 8.0 * (double) bytes / elements);
        }
    }
    while (st == INNERQ_OK && lo < hi) {
        const int32_t units = lo + (hi - lo + 1) / 2;
        kv_preset_bits(n_layer, units, bits);
        kv_layer_bits_format(n_layer, (const int32_t (*)[2]) bits, spec);
        st = kv_bytes_of(hp, dev, align, n_dev, layer_dev, q, n_ctx, n_slots, &bytes);
        if (bytes <= budget) {
            lo = units;
        } else {
            hi = units - 1;
        }
    }
    kv_preset_bits(n_layer, lo, bits);
    kv_layer_bits_format(n_layer, (const int32_t (*)[2]) bits, spec);
    free(bits);
    return st;
}

// The cache of params as they are (kv_cache_make: the preset made explicit first).
static innerq_status kv_cache_make_of(const struct llama_hparams * hp, const struct device_kind * dev, size_t align,
                                      int32_t n_dev, const int32_t * layer_dev, const innerq_context_params * params,
                                      int32_t n_ctx, int32_t n_slots, struct kv_cache ** out) {
    *out = NULL;
    struct kv_config cfg;
    innerq_status st = kv_config_make(params, hp, dev, n_ctx, n_slots, &cfg);
    if (st == INNERQ_OK) {
        st = dev->kv_check(hp->head_dim, cfg.type_k, cfg.type_v);
    }
    if (st == INNERQ_OK && n_dev > 1 && cfg.kv_bits > 0.0) {
        st = innerq_fail(INNERQ_ERR_UNSUPPORTED, "kv_bits (the automatic layout) with the model's layers split between "
                         "the CPU and the GPU: not supported; name the cache's types (kv_type) or offload every layer");
    }
    if (st != INNERQ_OK) {
        return st;
    }
    struct kv_cache * c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory allocating the KV cache");
    }
    c->cfg = cfg;
    c->n_layer = hp->n_layer;
    c->n_head = hp->n_head;
    c->head_dim = hp->head_dim;
    c->n_kv_head = hp->n_head_kv;
    c->kq_scale = hp->kq_scale;
    c->align = align;
    c->n_dev = n_dev;
    c->layer_dev = calloc((size_t) hp->n_layer, sizeof(int32_t));
    for (int32_t il = 0; il < hp->n_layer && c->layer_dev != NULL && layer_dev != NULL; il++) {
        c->layer_dev[il] = layer_dev[il];
    }
    c->layers = calloc((size_t) hp->n_layer, sizeof(*c->layers));
    c->seqs = calloc((size_t) n_slots, sizeof(*c->seqs));
    c->table = calloc((size_t) n_slots * (size_t) (cfg.n_table > 0 ? cfg.n_table : 1), sizeof(int32_t));
    bool ok = c->layer_dev != NULL && c->layers != NULL && c->seqs != NULL && c->table != NULL && kv_pool_init(&c->pool, cfg.n_pages);
    if (ok && cfg.kv_bits > 0.0) {
        c->cfg.units = 2 * KV_AUTO_BITS_MIN * hp->n_layer;  // until kv_layout_budget: the smallest layout
        c->probe = malloc(sizeof(float) * (size_t) hp->n_layer * KV_AUTO_PROBE * hp->n_head * hp->head_dim);
        c->err = calloc((size_t) hp->n_layer, sizeof(*c->err));
        ok = c->probe != NULL && c->err != NULL;
    }
    // each layer's bits: the types' (the smallest with kv_bits until its choice), or kv_layer_bits'
    int32_t (*bits)[2] = ok ? malloc(sizeof(*bits) * (size_t) hp->n_layer) : NULL;
    if (bits == NULL) {
        kv_cache_free(c);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory allocating the KV cache");
    }
    for (int32_t il = 0; il < hp->n_layer; il++) {
        bits[il][0] = cfg.qcfg.bits_k;
        bits[il][1] = cfg.qcfg.bits_v;
    }
    st = kv_layer_bits_parse(params->kv_layer_bits, hp->n_layer, bits);
    for (int32_t il = 0; il < hp->n_layer && st == INNERQ_OK; il++) {
        struct iq_kv_layer * l = &c->layers[il];
        *l = (struct iq_kv_layer) { .type_k = cfg.type_k, .type_v = cfg.type_v, .head_dim = hp->head_dim,
                                    .n_kv_head = hp->n_head_kv, .n_ctx = n_ctx, .page = cfg.page,
                                    .n_pages = cfg.n_pages, .n_slots = n_slots, .qcfg = cfg.qcfg };
        // a window as long as the context masks nothing: the layer attends as a global one
        l->window = hparams_layer_is_swa(hp, il) && hp->n_swa < n_ctx ? hp->n_swa : 0;
        l->n_pages = kv_config_window_only(&cfg, hp, il) ? 0 : cfg.n_pages;
        if (cfg.fmt == &kv_format_innerq) {
            l->qcfg.bits_k = bits[il][0];
            l->qcfg.bits_v = bits[il][1];
            iq_qcache_types(&l->qcfg, &l->type_k, &l->type_v);
        }
    }
    free(bits);
    if (st == INNERQ_OK) {
        st = kv_storage_plan(c);
    }
    if (st == INNERQ_OK && cfg.kv_bits > 0.0) {
        st = kv_layout_budget(c);
    }
    if (st != INNERQ_OK) {
        kv_cache_free(c);
        return st;
    }
    *out = c;
    return INNERQ_OK;
}

// The cache with its configuration, layers and storage planned (kv_storage_plan), no buffer yet.
static innerq_status kv_cache_make(const struct llama_hparams * hp, const struct device_kind * dev, size_t align,
                                   int32_t n_dev, const int32_t * layer_dev, const innerq_context_params * params,
                                   int32_t n_ctx, int32_t n_slots, struct kv_cache ** out) {
    *out = NULL;
    struct kv_config cfg;
    innerq_status st = kv_config_make(params, hp, dev, n_ctx, n_slots, &cfg);
    if (st != INNERQ_OK || (!cfg.preset_budget && cfg.pool_bits <= 0.0)) {
        return st != INNERQ_OK ? st : kv_cache_make_of(hp, dev, align, n_dev, layer_dev, params, n_ctx, n_slots, out);
    }
    // the preset's layers and windows, then the cache of those parameters
    innerq_context_params preset;
    char * spec = malloc((size_t) hp->n_layer * 16 + 1);
    st = spec == NULL ? innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory making the KV cache")
                      : kv_preset_layout(hp, dev, align, n_dev, layer_dev, params, n_ctx, n_slots, &cfg, &preset, spec);
    if (st == INNERQ_OK) {
        st = kv_cache_make_of(hp, dev, align, n_dev, layer_dev, &preset, n_ctx, n_slots, out);
    }
    free(spec);
    return st;
}

innerq_status kv_cache_init(const struct llama_hparams * hp, const struct device_kind * kind, iq_backend * const * be,
                            int32_t n_dev, const int32_t * layer_dev, const innerq_context_params * params,
                            int32_t n_ctx, int32_t n_slots, struct kv_cache ** out) {
    size_t align = kind->kv_align;
    for (int32_t d = 0; d < n_dev; d++) {
        align = iq_backend_alignment(be[d]) > align ? iq_backend_alignment(be[d]) : align;
    }
    innerq_status st = kv_cache_make(hp, kind, align, n_dev, layer_dev, params, n_ctx, n_slots, out);
    if (st == INNERQ_OK && (st = kv_storage_alloc(*out, be)) != INNERQ_OK) {
        kv_cache_free(*out);
        *out = NULL;
    }
    return st;
}

innerq_status kv_cache_size_of(const struct llama_hparams * hp, const struct device_kind * dev,
                               const innerq_context_params * params, int32_t n_ctx, int32_t n_slots,
                               struct kv_config * cfg, uint64_t * bytes) {
    struct kv_cache * c;
    const innerq_status st = kv_cache_make(hp, dev, dev->kv_align, 1, NULL, params, n_ctx, n_slots, &c);
    if (st == INNERQ_OK) {
        *cfg = c->cfg;
        *bytes = c->size;
        kv_cache_free(c);
    }
    return st;
}

void kv_cache_free(struct kv_cache * c) {
    if (c == NULL) {
        return;
    }
    for (int32_t d = 0; d < KV_MAX_DEVICES; d++) {
        iq_buffer_free(c->buf[d]);
    }
    if (c->ctx) {
        iq_context_free(c->ctx);
    }
    for (int32_t i = 0; c->seqs != NULL && i < c->cfg.n_slots; i++) {
        free(c->seqs[i].runs);
    }
    kv_pool_free(&c->pool);
    free(c->layers);
    free(c->seqs);
    free(c->table);
    free(c->layer_off);
    free(c->layer_dev);
    free(c->probe);
    free(c->err);
    free(c);
}

uint64_t kv_cache_size(const struct kv_cache * c) {
    uint64_t n = 0;
    for (int32_t d = 0; d < c->n_dev; d++) {
        n += c->buf[d] != NULL ? c->buf[d]->size : 0;
    }
    return n;
}

void kv_pages_set(struct kv_cache * c, const int32_t * data, size_t offset, size_t size) {
    for (int32_t d = 0; d < c->n_dev; d++) {
        iq_tensor_set(c->pages[d], data, offset, size);
    }
}

innerq_status kv_cache_clear(struct kv_cache * c) {
    for (int32_t i = 0; i < c->cfg.n_slots; i++) {
        kv_cache_seq_clear(c, i);
    }
    return INNERQ_OK;
}

// ---- steps ----

int32_t kv_cache_until_flush(const struct kv_cache * c, int32_t slot) {
    return c->cfg.fmt->until_flush(&c->cfg, &c->seqs[slot]);
}

static int32_t * kv_table_row(const struct kv_cache * c, int32_t slot) {
    return c->table + (size_t) slot * c->cfg.n_table;
}

// Writes entries [j0, j1) of a sequence's table to the ops' page table.
static void kv_table_upload(struct kv_cache * c, int32_t slot, int32_t j0, int32_t j1) {
    if (j1 > j0) {
        kv_pages_set(c, kv_table_row(c, slot) + j0, (size_t) slot * c->pages[0]->nb[1] + (size_t) j0 * sizeof(int32_t),
                     sizeof(int32_t) * (size_t) (j1 - j0));
    }
}

// Room to record one more batch (and to cut a run in two on a rewind) without allocating later.
static bool kv_runs_reserve(struct kv_seq * s) {
    if (s->n_runs + 2 <= s->cap_runs) {
        return true;
    }
    const int32_t cap = s->cap_runs ? 2 * s->cap_runs : 16;
    struct kv_run * p = realloc(s->runs, sizeof(*p) * (size_t) cap);
    if (p == NULL) {
        return false;
    }
    s->runs = p;
    s->cap_runs = cap;
    return true;
}

static void kv_runs_push(struct kv_seq * s, int32_t n, bool decode_semantics) {
    decode_semantics = decode_semantics && n > 1;
    struct kv_run * last = s->n_runs ? &s->runs[s->n_runs - 1] : NULL;
    if (last && last->len == n && last->decode_semantics == decode_semantics) {
        last->count++;
        return;
    }
    s->runs[s->n_runs++] = (struct kv_run) { .len = n, .count = 1, .decode_semantics = decode_semantics };
}

// A plain sequence that stores into its last page while another sequence holds that page too
// (a copied prefix) first takes a page of its own with the same rows.
static bool kv_page_own(struct kv_cache * c, int32_t slot) {
    struct kv_seq * s = &c->seqs[slot];
    int32_t * row = kv_table_row(c, slot);
    const int32_t page = c->cfg.page, last = s->n_pages - 1;
    if (c->cfg.fmt->quantized || s->n_past % page == 0 || last < 0 || c->pool.refs[row[last]] == 1) {
        return true;
    }
    const int32_t own = kv_pool_take(&c->pool);
    if (own < 0 || !kv_page_copy(c, row[last], own, s->n_past % page)) {
        if (own >= 0) {
            kv_pool_drop(&c->pool, own);
        }
        return false;
    }
    kv_pool_drop(&c->pool, row[last]);
    row[last] = own;
    kv_table_upload(c, slot, last, last + 1);
    return true;
}

int64_t kv_cache_pages_needed(const struct kv_cache * c, const int32_t * n) {
    int64_t pages = 0;
    for (int32_t slot = 0; slot < c->cfg.n_slots; slot++) {
        const struct kv_seq * s = &c->seqs[slot];
        if (n[slot] == 0) {
            continue;
        }
        struct iq_kv_seq row = { .slot = slot, .n_tokens = n[slot] };
        c->cfg.fmt->plan(&c->cfg, s, n[slot], &row);  // stored at once or in pieces: the same pages in the end
        pages += c->cfg.fmt->pages_after(&c->cfg, &row) - s->n_pages;
        // a plain sequence storing into a last page that others hold takes a copy of it
        // (kv_page_own); of k holders that do, the last finds itself alone and takes none
        const int32_t last = s->n_pages - 1;
        if (c->cfg.fmt->quantized || s->n_past % c->cfg.page == 0 || last < 0) {
            continue;
        }
        const int32_t page = kv_table_row(c, slot)[last];
        int32_t holders = 0, first = slot;  // holders of that page that store now, the first of them
        for (int32_t o = 0; o < c->cfg.n_slots; o++) {
            const struct kv_seq * t = &c->seqs[o];
            if (n[o] > 0 && t->n_pages == s->n_pages && t->n_past % c->cfg.page != 0 &&
                kv_table_row(c, o)[t->n_pages - 1] == page) {
                first = holders++ == 0 ? o : first;
            }
        }
        pages += c->pool.refs[page] > 1 && (holders < c->pool.refs[page] || slot != first);
    }
    return pages;
}

void kv_cache_step_abort(struct kv_cache * c, const struct iq_kv_seq * rows, int32_t n) {
    for (int32_t i = 0; i < n; i++) {
        const struct kv_seq * s = &c->seqs[rows[i].slot];
        const int32_t * row = kv_table_row(c, rows[i].slot);
        for (int32_t j = s->n_pages; j < c->cfg.fmt->pages_after(&c->cfg, &rows[i]); j++) {
            kv_pool_drop(&c->pool, row[j]);
        }
    }
}

bool kv_cache_step(struct kv_cache * c, const struct kv_step_seq * in, int32_t n, struct iq_kv_seq * rows) {
    const struct kv_format * fmt = c->cfg.fmt;
    for (int32_t i = 0; i < n; i++) {
        const int32_t slot = in[i].slot;
        struct kv_seq * s = &c->seqs[slot];
        if (in[i].n_tokens < 1 || (int64_t) s->n_past + in[i].n_tokens > c->cfg.n_ctx) {
            kv_cache_step_abort(c, rows, i);
            iq_error_set("KV cache: sequence %d holds %d tokens; %d more exceed the context of %d", slot, s->n_past,
                         in[i].n_tokens, c->cfg.n_ctx);
            return false;
        }
        rows[i] = (struct iq_kv_seq) { .slot = slot, .token0 = in[i].token0, .n_tokens = in[i].n_tokens };
        fmt->plan(&c->cfg, s, in[i].n_tokens, &rows[i]);
        const int32_t need = fmt->pages_after(&c->cfg, &rows[i]);
        int32_t * row = kv_table_row(c, slot);
        int32_t got = s->n_pages;
        bool ok = kv_runs_reserve(s) && kv_page_own(c, slot) && need <= c->cfg.n_table;
        while (ok && got < need) {
            const int32_t page = kv_pool_take(&c->pool);
            if (page < 0) {
                ok = false;
                break;
            }
            row[got++] = page;
        }
        if (!ok) {
            for (int32_t k = s->n_pages; k < got; k++) {
                kv_pool_drop(&c->pool, row[k]);
            }
            kv_cache_step_abort(c, rows, i);
            iq_error_set("KV cache: the pool's %d pages of %d tokens are taken (%d in use); sequence %d needs %d more",
                         c->pool.n_pages, c->cfg.page, kv_pool_used(&c->pool), slot, need - s->n_pages);
            return false;
        }
        kv_table_upload(c, slot, s->n_pages, need);
    }
    return true;
}

void kv_cache_step_commit(struct kv_cache * c, const struct iq_kv_seq * rows, int32_t n, bool decode_semantics) {
    for (int32_t i = 0; i < n; i++) {
        struct kv_seq * s = &c->seqs[rows[i].slot];
        c->cfg.fmt->commit(&c->cfg, &rows[i], s);
        s->n_pages = c->cfg.fmt->pages_after(&c->cfg, &rows[i]);
        s->n_past = rows[i].n_past + rows[i].n_tokens;
        kv_runs_push(s, rows[i].n_tokens, decode_semantics);  // room reserved by kv_cache_step
    }
}
