// A context's sequences (innerq.h: innerq_seq_*, innerq_kv_pool): removing, copying and
// keeping their tokens, through the cache's rules (kv-rewind.c).
#include "context-impl.h"

#include "status.h"

// Removes seq's tokens from p0 on (the end of the sequence); every sequence's with seq -1.
static innerq_status seq_rm_from(innerq_context * c, int32_t seq, int32_t p0) {
    int32_t kept;
    const int32_t before = c->cache->seqs[seq].n_past;
    const innerq_status st = kv_cache_seq_keep(c->cache, seq, p0, c->params.kv_rewind_exact, c->params.n_batch,
                                               c->params.decode_semantics, &kept);
    if (st == INNERQ_OK && kept < before) {
        context_outputs_drop(c);
    }
    return st;
}

innerq_status innerq_seq_rm(innerq_context * c, int32_t seq, int32_t p0, int32_t p1) {
    if (c == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_seq_rm: NULL context");
    }
    innerq_status st = seq < 0 ? INNERQ_OK : context_seq_check(c, seq, "innerq_seq_rm");
    if (st != INNERQ_OK) {
        return st;
    }
    pthread_mutex_lock(&c->lock);
    p0 = p0 < 0 ? 0 : p0;
    for (int32_t s = seq < 0 ? 0 : seq; st == INNERQ_OK && s < (seq < 0 ? c->params.n_seq_max : seq + 1); s++) {
        const int32_t end = c->cache->seqs[s].n_past;
        if (p1 >= 0 && p1 < end && p0 < p1) {
            st = innerq_fail(INNERQ_ERR_UNSUPPORTED, "innerq_seq_rm: sequence %d holds positions 0 .. %d; removing "
                             "[%d, %d) from its middle is not supported (remove its last tokens, or all)", s, end - 1, p0,
                             p1);
        } else if (p0 < end && (p1 < 0 || p1 >= end)) {
            st = seq_rm_from(c, s, p0);
        }
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

innerq_status innerq_seq_cp(innerq_context * c, int32_t src, int32_t dst, int32_t p0, int32_t p1) {
    if (c == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_seq_cp: NULL context");
    }
    innerq_status st = context_seq_check(c, src, "innerq_seq_cp");
    if (st == INNERQ_OK) {
        st = context_seq_check(c, dst, "innerq_seq_cp");
    }
    if (st == INNERQ_OK && p0 > 0) {
        st = innerq_fail(INNERQ_ERR_UNSUPPORTED, "innerq_seq_cp: copies start at position 0, not %d", p0);
    }
    if (st != INNERQ_OK) {
        return st;
    }
    pthread_mutex_lock(&c->lock);
    int32_t copied;
    st = kv_cache_seq_copy(c->cache, src, dst, p1, &copied);
    pthread_mutex_unlock(&c->lock);
    return st;
}

innerq_status innerq_seq_keep(innerq_context * c, int32_t seq) {
    if (c == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_seq_keep: NULL context");
    }
    const innerq_status st = context_seq_check(c, seq, "innerq_seq_keep");
    if (st != INNERQ_OK) {
        return st;
    }
    pthread_mutex_lock(&c->lock);
    for (int32_t s = 0; s < c->params.n_seq_max; s++) {
        if (s != seq) {
            kv_cache_seq_clear(c->cache, s);
        }
    }
    pthread_mutex_unlock(&c->lock);
    return INNERQ_OK;
}

static int32_t seq_pos(innerq_context * c, int32_t seq, bool last, const char * fn) {
    if (c == NULL || context_seq_check(c, seq, fn) != INNERQ_OK) {
        return -1;
    }
    pthread_mutex_lock(&c->lock);
    const int32_t n = c->cache->seqs[seq].n_past;
    pthread_mutex_unlock(&c->lock);
    return n == 0 ? -1 : last ? n - 1 : 0;
}

int32_t innerq_seq_pos_max(innerq_context * c, int32_t seq) { return seq_pos(c, seq, true, "innerq_seq_pos_max"); }
int32_t innerq_seq_pos_min(innerq_context * c, int32_t seq) { return seq_pos(c, seq, false, "innerq_seq_pos_min"); }

innerq_status innerq_kv_pool(innerq_context * c, innerq_kv_pool_info * out) {
    if (c == NULL || out == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_kv_pool: NULL argument");
    }
    pthread_mutex_lock(&c->lock);
    const struct kv_cache * kc = c->cache;
    *out = (innerq_kv_pool_info) { .n_pages = kc->pool.n_pages, .page_tokens = kc->cfg.page,
                                   .n_pages_used = kv_pool_used(&kc->pool), .bytes = kv_cache_size(kc) };
    for (int32_t s = 0; s < kc->cfg.n_slots; s++) {
        out->n_seq += kc->seqs[s].n_past > 0;
        out->n_tokens += kc->seqs[s].n_past;
    }
    pthread_mutex_unlock(&c->lock);
    return INNERQ_OK;
}
