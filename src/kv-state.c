// A sequence's state in a byte stream (kv-cache.h): its counters, the batches its tokens came
// in, the automatic layout, and the storage it uses in the format's order (kv_format.walk).
// One sequence of one slot over pages in order writes the bytes states of one-sequence
// contexts always had, so those load into any slot.
#include "kv-cache-impl.h"

#include "status.h"

#include <stdlib.h>
#include <string.h>

void kv_stream_put(struct kv_stream * s, const void * data, size_t n) {
    if (s->w != NULL && n > 0) {
        memcpy(s->w + s->pos, data, n);
    }
    s->pos += n;
}

bool kv_stream_get(struct kv_stream * s, void * data, size_t n) {
    if (n > s->size - s->pos) {
        return false;
    }
    memcpy(data, s->r + s->pos, n);
    s->pos += n;
    return true;
}

static void kv_chunk_save(struct iq_tensor * t, size_t offset, size_t size, void * arg) {
    struct kv_stream * s = arg;
    if (s->w != NULL) {
        iq_tensor_get(t, s->w + s->pos, offset, size);
    }
    s->pos += size;
}

static void kv_chunk_load(struct iq_tensor * t, size_t offset, size_t size, void * arg) {
    struct kv_stream * s = arg;
    iq_tensor_set(t, s->r + s->pos, offset, size);
    s->pos += size;
}

static void kv_chunk_count(struct iq_tensor * t, size_t offset, size_t size, void * arg) {
    (void) t, (void) offset;
    ((struct kv_stream *) arg)->pos += size;
}

void kv_cache_seq_write(const struct kv_cache * c, int32_t slot, struct kv_stream * s) {
    const struct kv_seq * q = &c->seqs[slot];
    const int32_t head[5] = { q->n_past, q->q.n_sink, q->q.n_quant, q->q.norms_ready, q->n_runs };
    kv_stream_put(s, head, sizeof(head));
    for (int32_t i = 0; i < q->n_runs; i++) {
        const int32_t r[3] = { q->runs[i].len, q->runs[i].count, q->runs[i].decode_semantics };
        kv_stream_put(s, r, sizeof(r));
    }
    if (c->cfg.fmt->quantized) {
        // the layout: whether the automatic one is chosen, each layer's bits, the pending choice's queries
        const int32_t ready = c->layout_ready;
        kv_stream_put(s, &ready, sizeof(ready));
        for (int32_t il = 0; il < c->n_layer; il++) {
            const int32_t b[2] = { c->layers[il].qcfg.bits_k, c->layers[il].qcfg.bits_v };
            kv_stream_put(s, b, sizeof(b));
        }
        const size_t kept = sizeof(float) * kv_probe_row(c) * (size_t) kv_probe_kept(c, q->n_past, c->layout_ready);
        for (int32_t il = 0; il < c->n_layer && kept > 0; il++) {
            kv_stream_put(s, kv_probe_at(c, il, kv_probe_first(c)), kept);
        }
    }
    c->cfg.fmt->walk(c, slot, q, kv_chunk_save, s);
}

// Reads a state's layout (kv_cache_seq_write) into ready, bits (n_layer pairs) and *probe (the
// kept queries, in the stream) and checks it against the cache: a fixed layout must be the
// cache's own, an automatic one within its budget. Without a layout in the stream (states
// before version 3), every layer has the configuration's bits.
static innerq_status kv_layout_read(const struct kv_cache * c, struct kv_stream * s, bool with_layout, int32_t n_past,
                                    const struct kv_qstate * q, int32_t * ready, int32_t (*bits)[2],
                                    const uint8_t ** probe) {
    *ready = 0;
    for (int32_t il = 0; il < c->n_layer; il++) {
        bits[il][0] = c->cfg.qcfg.bits_k;
        bits[il][1] = c->cfg.qcfg.bits_v;
    }
    if (with_layout && (!kv_stream_get(s, ready, sizeof(*ready)) ||
                        !kv_stream_get(s, bits, sizeof(*bits) * (size_t) c->n_layer))) {
        return innerq_fail(INNERQ_ERR_FORMAT, "state: the KV cache's layout is cut off");
    }
    const bool auto_bits = c->cfg.kv_bits > 0.0;
    int32_t units = 0;
    bool valid = *ready == 0 || (*ready == 1 && auto_bits), same = true;
    for (int32_t il = 0; il < c->n_layer; il++) {
        for (int32_t x = 0; x < 2; x++) {
            valid = valid && bits[il][x] >= KV_AUTO_BITS_MIN && bits[il][x] <= KV_AUTO_BITS_MAX &&
                    (*ready || !auto_bits || bits[il][x] == KV_AUTO_BITS_MIN);
            units += valid ? bits[il][x] : 0;  // the stream's values are untrusted: summed once checked
        }
        same = same && bits[il][0] == c->layers[il].qcfg.bits_k && bits[il][1] == c->layers[il].qcfg.bits_v;
    }
    if (!valid || (auto_bits && (units > c->cfg.units || (q->n_quant > 0 && !*ready)))) {
        return innerq_fail(INNERQ_ERR_FORMAT, "state: invalid KV cache layout (%d code bits over the layers, budget %d)",
                           units, c->cfg.units);
    }
    if (!auto_bits && !same) {
        return innerq_fail(INNERQ_ERR_STATE_MISMATCH, "the state's KV cache has other bits per layer than the context's");
    }
    const size_t kept = sizeof(float) * kv_probe_row(c) * (size_t) kv_probe_kept(c, n_past, *ready) * c->n_layer;
    if (kept > s->size - s->pos) {
        return innerq_fail(INNERQ_ERR_FORMAT, "state: the KV cache's layout is cut off");
    }
    *probe = s->r + s->pos;
    s->pos += kept;
    return INNERQ_OK;
}

// The counters and batches of a stream, checked against what a sequence can hold (a rewind
// may leave a window shorter than R, so the counters of n_past tokens are not one set).
static innerq_status kv_seq_head_read(const struct kv_cache * c, struct kv_stream * s, struct kv_seq * q) {
    int32_t head[5];
    if (!kv_stream_get(s, head, sizeof(head))) {
        return innerq_fail(INNERQ_ERR_FORMAT, "state: the KV cache's counters are cut off");
    }
    const int32_t n_past = head[0], n_runs = head[4];
    *q = (struct kv_seq) { .n_past = n_past, .q = { .n_sink = head[1], .n_quant = head[2], .norms_ready = head[3] != 0 } };
    if (n_past < 0 || n_past > c->cfg.n_ctx) {
        return innerq_fail(n_past < 0 ? INNERQ_ERR_FORMAT : INNERQ_ERR_CONTEXT_FULL,
                           "state: %d tokens do not fit the context of %d", n_past, c->cfg.n_ctx);
    }
    const struct iq_qcache_config * cfg = &c->cfg.qcfg;
    // counters from a file may be anything: the window is computed wide, never overflowing
    const int64_t n_recent = (int64_t) n_past - q->q.n_sink - q->q.n_quant;
    const bool quantized = c->cfg.fmt->quantized;
    // what a sequence may hold: the sink fills first, blocks of G, a window below R + G (once
    // there are blocks, at least the rows a window-only layer reads), the norms set with the first block
    const bool counters = quantized ? q->q.n_sink >= 0 && q->q.n_sink <= cfg->n_sink && q->q.n_quant >= 0 &&
                                          q->q.n_quant % cfg->group == 0 && n_recent >= 0 &&
                                          n_recent < cfg->n_recent + cfg->group &&
                                          (q->q.n_quant == 0 || n_recent >= c->cfg.swa_rows) &&
                                          (n_recent == 0 || q->q.n_sink == cfg->n_sink) &&
                                          (q->q.n_quant == 0 || q->q.n_sink == cfg->n_sink) &&
                                          q->q.norms_ready == (cfg->key_norm && q->q.n_quant > 0)
                                    : q->q.n_sink == 0 && q->q.n_quant == 0 && !q->q.norms_ready;
    if (!counters || head[3] < 0 || head[3] > 1 || n_runs < 0 || n_runs > n_past ||
        (size_t) n_runs * 12 > s->size - s->pos) {
        return innerq_fail(INNERQ_ERR_FORMAT, "state: inconsistent KV cache counters (%d tokens, sink %d, quantized %d, "
                           "%d runs of batches)", n_past, q->q.n_sink, q->q.n_quant, n_runs);
    }
    q->n_runs = q->cap_runs = n_runs;
    q->cap_runs = n_runs + 16;
    q->runs = malloc(sizeof(*q->runs) * (size_t) q->cap_runs);
    if (q->runs == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory loading a state");
    }
    int64_t sum = 0;
    for (int32_t i = 0; i < n_runs; i++) {
        int32_t r[3];
        kv_stream_get(s, r, sizeof(r));  // the size was checked above
        q->runs[i] = (struct kv_run) { .len = r[0], .count = r[1], .decode_semantics = r[2] != 0 };
        sum += (int64_t) r[0] * (r[0] > 0 && r[1] > 0 ? r[1] : 0);
        if (r[0] < 1 || r[1] < 1 || r[2] < 0 || r[2] > 1 || sum > n_past) {
            free(q->runs);
            return innerq_fail(INNERQ_ERR_FORMAT, "state: invalid record of batches");
        }
    }
    if (sum != n_past) {
        free(q->runs);
        return innerq_fail(INNERQ_ERR_FORMAT, "state: the record of batches holds %lld of %d tokens", (long long) sum,
                           n_past);
    }
    q->n_pages = quantized ? q->q.n_quant / cfg->group : (n_past + c->cfg.page - 1) / c->cfg.page;
    return INNERQ_OK;
}

innerq_status kv_cache_seq_read(struct kv_cache * c, int32_t slot, struct kv_stream * s, bool with_layout, bool apply,
                                int32_t * n_pages) {
    struct kv_seq q;
    innerq_status st = kv_seq_head_read(c, s, &q);
    if (st != INNERQ_OK) {
        return st;
    }
    int32_t (*bits)[2] = malloc(sizeof(*bits) * (size_t) c->n_layer * 2);  // the state's, then the cache's
    if (bits == NULL) {
        free(q.runs);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory loading a state");
    }
    int32_t ready = 0;
    const uint8_t * probe = NULL;
    int32_t (*had)[2] = bits + c->n_layer;
    const bool was_ready = c->layout_ready;
    if (c->cfg.fmt->quantized) {
        st = kv_layout_read(c, s, with_layout, q.n_past, &q.q, &ready, bits, &probe);
        for (int32_t il = 0; il < c->n_layer; il++) {
            had[il][0] = c->layers[il].qcfg.bits_k;
            had[il][1] = c->layers[il].qcfg.bits_v;
        }
    }
    // the pages the state's tokens need: the free ones and those the slot alone holds now
    const int32_t * row = c->table + (size_t) slot * c->cfg.n_table;
    int32_t n_free = c->pool.n_free;
    for (int32_t j = 0; j < c->seqs[slot].n_pages; j++) {
        n_free += c->pool.refs[row[j]] == 1;
    }
    if (st == INNERQ_OK && apply && q.n_pages > n_free) {
        st = innerq_fail(INNERQ_ERR_CONTEXT_FULL, "state: %d pages of the KV cache's pool needed, %d free", q.n_pages,
                         n_free);
    }
    if (st == INNERQ_OK && c->cfg.kv_bits > 0.0) {
        kv_layout_set(c, ready ? (const int32_t (*)[2]) bits : NULL);  // the data's sizes follow it
    }
    // the bytes the state's storage needs (pages in order: any pages take as many)
    struct kv_stream count = { .pos = s->pos };
    if (st == INNERQ_OK) {
        c->cfg.fmt->walk(c, slot, &q, kv_chunk_count, &count);
        if (count.pos > s->size) {
            st = innerq_fail(INNERQ_ERR_FORMAT, "state: %zu bytes of KV cache data where %d tokens need %zu",
                             s->size - s->pos, q.n_past, count.pos - s->pos);
        }
    }
    *n_pages = q.n_pages;
    if (st != INNERQ_OK || !apply) {
        if (c->cfg.kv_bits > 0.0) {  // as it was
            kv_layout_set(c, was_ready ? (const int32_t (*)[2]) had : NULL);
        }
        s->pos = count.pos;
        free(q.runs), free(bits);
        return st;
    }
    // checked: from here on nothing fails
    const size_t kept = sizeof(float) * kv_probe_row(c) * (size_t) kv_probe_kept(c, q.n_past, ready);
    for (int32_t il = 0; il < c->n_layer && kept > 0; il++) {
        memcpy(kv_probe_at(c, il, kv_probe_first(c)), probe + il * kept, kept);
    }
    struct kv_seq * d = &c->seqs[slot];
    int32_t * table = c->table + (size_t) slot * c->cfg.n_table;
    for (int32_t j = 0; j < d->n_pages; j++) {
        kv_pool_drop(&c->pool, table[j]);
    }
    for (int32_t j = 0; j < q.n_pages; j++) {
        table[j] = kv_pool_take(&c->pool);  // counted above
    }
    if (q.n_pages > 0) {
        kv_pages_set(c, table, (size_t) slot * c->pages[0]->nb[1], sizeof(int32_t) * (size_t) q.n_pages);
    }
    free(d->runs);
    *d = q;  // the norms come with the storage
    c->cfg.fmt->walk(c, slot, d, kv_chunk_load, s);
    free(bits);
    return INNERQ_OK;
}
