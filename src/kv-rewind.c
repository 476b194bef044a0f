// Removing and copying a sequence's tokens (kv-cache.h; docs/DESIGN.md 3.6, docs/INNERQ.md
// "Rewinding the cache").
#include "kv-cache-impl.h"

#include "status.h"

#include <stdlib.h>
#include <string.h>

static int32_t * kv_table_row(const struct kv_cache * c, int32_t slot) {
    return c->table + (size_t) slot * c->cfg.n_table;
}

// The pages from n_pages on go back to the pool.
static void kv_pages_release(struct kv_cache * c, int32_t slot, int32_t n_pages) {
    struct kv_seq * s = &c->seqs[slot];
    const int32_t * row = kv_table_row(c, slot);
    for (int32_t j = n_pages; j < s->n_pages; j++) {
        kv_pool_drop(&c->pool, row[j]);
    }
    s->n_pages = n_pages < s->n_pages ? n_pages : s->n_pages;
}

// The automatic layout is the pool's: chosen again once no sequence holds a quantized token.
static void kv_layout_release(struct kv_cache * c) {
    if (c->cfg.kv_bits <= 0.0 || !c->layout_ready) {
        return;
    }
    for (int32_t i = 0; i < c->cfg.n_slots; i++) {
        if (c->seqs[i].q.n_quant > 0) {
            return;
        }
    }
    kv_layout_set(c, NULL);
}

// The record of batches of a sequence cut at n tokens (the last batch cut there; kv_cache_step
// keeps room for that one more run).
static void kv_runs_cut(struct kv_seq * s, int32_t n) {
    int32_t p = 0, i = 0;
    for (; i < s->n_runs && p + s->runs[i].len * s->runs[i].count <= n; i++) {
        p += s->runs[i].len * s->runs[i].count;
    }
    if (i < s->n_runs && p < n) {
        struct kv_run * r = &s->runs[i];
        const int32_t whole = (n - p) / r->len, rest = (n - p) % r->len;
        r->count = whole;
        i += whole > 0;
        if (rest > 0) {
            const bool ds = r->decode_semantics && rest > 1;
            s->runs[i++] = (struct kv_run) { .len = rest, .count = 1, .decode_semantics = ds };
        }
    }
    s->n_runs = i;
}

void kv_cache_seq_clear(struct kv_cache * c, int32_t slot) {
    struct kv_seq * s = &c->seqs[slot];
    kv_pages_release(c, slot, 0);
    const bool norms_set = s->q.norms_ready;
    s->n_past = 0;
    s->n_runs = 0;
    s->q = (struct kv_qstate) {0};
    if (norms_set) {
        kv_norms_reset(c, slot);  // ones; its only failure is memory, and the norms are unread until set again
    }
    kv_layout_release(c);
}

// The length of the batch a fresh evaluation in one call (without decode semantics) starts at
// position p, or 0 if none starts there: batches of n_batch from 0, and with the automatic
// layout one cut where it is chosen (the context stops a batch there) and n_batch from there.
static int32_t kv_fresh_batch(const struct kv_cache * c, int32_t p, int32_t n_batch) {
    const int32_t at = c->cfg.qcfg.n_sink + c->cfg.qcfg.n_recent + c->cfg.qcfg.group - 1;
    const int32_t cut = c->cfg.kv_bits > 0.0 && at < c->cfg.n_ctx ? at : INT32_MAX;
    if (p < cut) {
        return p % n_batch != 0 ? 0 : cut - p < n_batch ? cut - p : n_batch;
    }
    return (p - cut) % n_batch == 0 ? n_batch : 0;
}

// The longest prefix n <= n_keep of the sequence's tokens whose state a fresh evaluation of n
// tokens in one call (batches of n_batch, decode semantics as given) shares with this cache.
static int32_t kv_exact_point(const struct kv_cache * c, const struct kv_seq * s, int32_t n_keep, int32_t n_batch,
                              bool decode_semantics) {
    const struct kv_format * fmt = c->cfg.fmt;
    n_keep = n_keep < s->n_past ? n_keep : s->n_past;
    if (c->cfg.type_k == IQ_TYPE_F32 && c->cfg.type_v == IQ_TYPE_F32) {
        // an f32 cache stores keys and values as the batch computed them, so how the tokens
        // were cut into batches changes nothing beyond float rounding
        return fmt->exact_fit(&c->cfg, s, 0, n_keep);
    }
    // A batch reads its own tokens unrounded and earlier ones as stored (docs/DESIGN.md 3.4):
    // a token's keys and values depend on the batch it came in. A fresh evaluation of n tokens
    // cuts them into batches of n_batch from 0 (without decode semantics), or computes every
    // token as one-token decoding would (with them), so the kept tokens must have come in such
    // batches: [p, p + len) may be the last batch of the prefix, and the prefix may go on past
    // it only if it is a whole batch of the fresh cut.
    int32_t best = 0, p = 0;
    for (int32_t i = 0; i < s->n_runs && p < n_keep; i++) {
        const struct kv_run * r = &s->runs[i];
        for (int32_t j = 0; j < r->count && p < n_keep; j++) {
            const bool same = decode_semantics ? (r->decode_semantics || r->len == 1)
                                               : (!r->decode_semantics && kv_fresh_batch(c, p, n_batch) > 0);
            if (!same) {
                return best;
            }
            const int32_t end = p + r->len < n_keep ? p + r->len : n_keep;
            const int32_t fit = fmt->exact_fit(&c->cfg, s, p, end);
            best = fit > best ? fit : best;
            if (!decode_semantics && r->len != kv_fresh_batch(c, p, n_batch)) {
                return best;
            }
            p += r->len;
        }
    }
    return best;
}

innerq_status kv_cache_seq_keep(struct kv_cache * c, int32_t slot, int32_t n, bool exact, int32_t n_batch,
                                bool decode_semantics, int32_t * n_kept) {
    struct kv_seq * s = &c->seqs[slot];
    if (n < 0) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_cache_seq_keep: %d tokens", n);
    }
    if (exact) {
        n = kv_exact_point(c, s, n, n_batch, decode_semantics);
    }
    if (n >= s->n_past) {
        *n_kept = s->n_past;
        return INNERQ_OK;
    }
    struct kv_seq kept;
    c->cfg.fmt->keep(&c->cfg, s, n, &kept);
    const bool norms_reset = s->q.norms_ready && !kept.q.norms_ready;
    kv_pages_release(c, slot, kept.n_pages);
    kv_runs_cut(s, kept.n_past);
    s->n_past = kept.n_past;
    s->q = kept.q;
    innerq_status st = norms_reset ? kv_norms_reset(c, slot) : INNERQ_OK;
    kv_layout_release(c);
    *n_kept = s->n_past;
    return st;
}

innerq_status kv_cache_seq_copy(struct kv_cache * c, int32_t src, int32_t dst, int32_t n, int32_t * n_copied) {
    const struct kv_seq * s = &c->seqs[src];
    if (src == dst) {  // a sequence is a copy of itself already
        *n_copied = s->n_past;
        return INNERQ_OK;
    }
    *n_copied = 0;
    kv_cache_seq_clear(c, dst);
    struct kv_seq * d = &c->seqs[dst];
    while (d->cap_runs < s->n_runs + 2) {
        const int32_t cap = d->cap_runs ? 2 * d->cap_runs : 16;
        struct kv_run * p = realloc(d->runs, sizeof(*p) * (size_t) cap);
        if (p == NULL) {
            return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory copying a sequence");
        }
        d->runs = p;
        d->cap_runs = cap;
    }
    struct kv_seq kept;
    c->cfg.fmt->keep(&c->cfg, s, n < 0 ? s->n_past : n, &kept);
    if (c->cfg.fmt->quantized &&
        !kv_slot_copy(c, src, dst, kept.q.n_sink, kept.n_past - kept.q.n_sink - kept.q.n_quant)) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "%s", iq_error_get());
    }
    // the pages are shared: each holder counts (a plain sequence takes its last page for itself
    // before it stores into it: kv_cache_step)
    const int32_t * from = kv_table_row(c, src);
    int32_t * to = kv_table_row(c, dst);
    for (int32_t j = 0; j < kept.n_pages; j++) {
        to[j] = from[j];
        kv_pool_hold(&c->pool, from[j]);
    }
    if (kept.n_pages > 0) {
        kv_pages_set(c, to, (size_t) dst * c->pages[0]->nb[1], sizeof(int32_t) * (size_t) kept.n_pages);
    }
    memcpy(d->runs, s->runs, sizeof(*s->runs) * (size_t) s->n_runs);
    d->n_runs = s->n_runs;
    kv_runs_cut(d, kept.n_past);
    d->n_past = kept.n_past;
    d->q = kept.q;
    d->n_pages = kept.n_pages;
    *n_copied = d->n_past;
    // the copied norms are the source's; a copy without quantized tokens has none set yet
    return s->q.norms_ready && !kept.q.norms_ready ? kv_norms_reset(c, dst) : INNERQ_OK;
}
