// States (innerq.h): a context's (every sequence with tokens, and the last logits) and one
// sequence's.
//
// Layout (host byte order): magic, version, the model (state_model), the cache configuration
// (state_cache_config); a context's state then the rows of logits and the logits, the number
// of sequences and, for each, its id and its part (kv_cache_seq_write); a sequence's state its
// part alone. Last an FNV-1a hash of everything before it. Versions 2 and 3 (contexts of one
// sequence) hold the logits and one part, sequence 0's.
#include "context-impl.h"

#include "status.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define STATE_MAGIC "INNERQST"
#define STATE_SEQ_MAGIC "INNERQSQ"
// Version 4 holds several sequences; 3 added kv_bits to the configuration and each layer's bits
// to the cache's part; version 2 states (one configuration for all layers) still load.
#define STATE_VERSION 4u
#define STATE_N_MODEL 8
#define STATE_N_CACHE 15
#define STATE_N_CACHE_V2 14

static void state_model(const innerq_model * m, int32_t out[STATE_N_MODEL]) {
    const struct llama_hparams * hp = &m->hp;
    const int32_t v[STATE_N_MODEL] = { hp->n_vocab, hp->n_embd, hp->n_layer, hp->n_head, hp->n_head_kv, hp->head_dim,
                                       hp->n_ff, hp->n_rot };
    memcpy(out, v, sizeof(v));
}

static void state_cache_config(const struct kv_cache * kc, int32_t out[STATE_N_CACHE]) {
    memset(out, 0, sizeof(int32_t) * STATE_N_CACHE);
    out[0] = kc->cfg.type_k;
    out[1] = kc->cfg.type_v;
    if (kc->cfg.fmt->quantized) {
        const struct iq_qcache_config * q = &kc->cfg.qcfg;
        const int32_t v[STATE_N_CACHE - 2] = { q->bits_k, q->bits_v, q->axis_k, q->axis_v, q->group, q->n_sink,
                                               q->n_recent, q->mode, q->key_norm, q->score_correction, q->rope_dims,
                                               // 4: sliding-window layers without blocks (kv_config_window_only)
                                               (kc->cfg.rot_k ? 1 : 0) | (kc->cfg.rot_v ? 2 : 0) |
                                                   (kc->cfg.swa_rows > 0 ? 4 : 0) | (q->value_scales ? 8 : 0) |
                                                   (q->params8 ? 16 : 0) | (q->key_levels ? 32 : 0),
                                               (int32_t) lround(kc->cfg.kv_bits * 1000.0) };
        memcpy(out + 2, v, sizeof(v));
    }
}

static void state_header_write(const innerq_context * c, const char * magic, struct kv_stream * s) {
    const uint32_t version = STATE_VERSION;
    int32_t model[STATE_N_MODEL], cache[STATE_N_CACHE];
    state_model(c->model, model);
    state_cache_config(c->cache, cache);
    kv_stream_put(s, magic, 8);
    kv_stream_put(s, &version, sizeof(version));
    kv_stream_put(s, model, sizeof(model));
    kv_stream_put(s, &c->model->fingerprint, sizeof(uint64_t));
    kv_stream_put(s, cache, sizeof(cache));
}

// A context's state; seq >= 0: that sequence's alone.
static void state_write(const innerq_context * c, int32_t seq, struct kv_stream * s) {
    state_header_write(c, seq >= 0 ? STATE_SEQ_MAGIC : STATE_MAGIC, s);
    if (seq >= 0) {
        kv_cache_seq_write(c->cache, seq, s);
        return;
    }
    kv_stream_put(s, &c->n_logits, sizeof(int32_t));
    kv_stream_put(s, c->logits, sizeof(float) * (size_t) c->n_logits * (size_t) c->model->hp.n_vocab);
    int32_t n_seqs = 0;
    for (int32_t i = 0; i < c->params.n_seq_max; i++) {
        n_seqs += c->cache->seqs[i].n_past > 0;
    }
    kv_stream_put(s, &n_seqs, sizeof(n_seqs));
    for (int32_t i = 0; i < c->params.n_seq_max; i++) {
        if (c->cache->seqs[i].n_past > 0) {
            kv_stream_put(s, &i, sizeof(i));
            kv_cache_seq_write(c->cache, i, s);
        }
    }
}

static size_t state_size(innerq_context * c, int32_t seq) {
    pthread_mutex_lock(&c->lock);
    struct kv_stream s = {0};
    state_write(c, seq, &s);
    pthread_mutex_unlock(&c->lock);
    return s.pos + sizeof(uint64_t);
}

static innerq_status state_save(innerq_context * c, int32_t seq, void * dst, size_t dst_size, size_t * written,
                                const char * fn) {
    pthread_mutex_lock(&c->lock);
    struct kv_stream s = {0};
    state_write(c, seq, &s);
    const size_t need = s.pos + sizeof(uint64_t);
    innerq_status st = INNERQ_OK;
    if (dst_size < need) {
        st = innerq_fail(INNERQ_ERR_BUFFER_TOO_SMALL, "%s: the state needs %zu bytes, the buffer has %zu", fn, need,
                         dst_size);
    } else {
        s = (struct kv_stream) { .w = dst };
        state_write(c, seq, &s);
        const uint64_t h = fnv1a64(FNV1A64_INIT, dst, s.pos);
        kv_stream_put(&s, &h, sizeof(h));
    }
    *written = st == INNERQ_OK ? need : 0;
    pthread_mutex_unlock(&c->lock);
    return st;
}

size_t innerq_state_size(innerq_context * c) { return c == NULL ? 0 : state_size(c, -1); }

size_t innerq_state_seq_size(innerq_context * c, int32_t seq) {
    return c == NULL || context_seq_check(c, seq, "innerq_state_seq_size") != INNERQ_OK ? 0 : state_size(c, seq);
}

innerq_status innerq_state_save(innerq_context * c, void * dst, size_t dst_size, size_t * written) {
    if (c == NULL || dst == NULL || written == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_state_save: NULL argument");
    }
    return state_save(c, -1, dst, dst_size, written, "innerq_state_save");
}

innerq_status innerq_state_seq_save(innerq_context * c, int32_t seq, void * dst, size_t dst_size, size_t * written) {
    if (c == NULL || dst == NULL || written == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_state_seq_save: NULL argument");
    }
    const innerq_status st = context_seq_check(c, seq, "innerq_state_seq_save");
    return st != INNERQ_OK ? st : state_save(c, seq, dst, dst_size, written, "innerq_state_seq_save");
}

// Checks a state's header against the context (a sequence's state if seq_magic); on success s
// is past it and *version says which.
static innerq_status state_check_header(const innerq_context * c, struct kv_stream * s, bool seq_magic,
                                        uint32_t * version) {
    char magic[8];
    int32_t model[STATE_N_MODEL], want_model[STATE_N_MODEL], cache[STATE_N_CACHE], want_cache[STATE_N_CACHE];
    uint64_t fingerprint;
    const char * want = seq_magic ? STATE_SEQ_MAGIC : STATE_MAGIC;
    if (!kv_stream_get(s, magic, 8) || memcmp(magic, want, 8) != 0 || !kv_stream_get(s, version, 4)) {
        return innerq_fail(INNERQ_ERR_FORMAT, "not an innerq %sstate (no '%s' header)", seq_magic ? "sequence " : "",
                           want);
    }
    if (*version != STATE_VERSION && (seq_magic || (*version != 2 && *version != 3))) {
        return innerq_fail(INNERQ_ERR_FORMAT, "innerq state version %u; this build reads versions 2 to %u", *version,
                           STATE_VERSION);
    }
    memset(cache, 0, sizeof(cache));  // version 2: no kv_bits (0, one configuration)
    if (!kv_stream_get(s, model, sizeof(model)) || !kv_stream_get(s, &fingerprint, sizeof(fingerprint)) ||
        !kv_stream_get(s, cache, sizeof(int32_t) * (*version >= 3 ? STATE_N_CACHE : STATE_N_CACHE_V2))) {
        return innerq_fail(INNERQ_ERR_FORMAT, "innerq state: the header is cut off");
    }
    state_model(c->model, want_model);
    state_cache_config(c->cache, want_cache);
    if (memcmp(model, want_model, sizeof(model)) != 0 || fingerprint != c->model->fingerprint) {
        return innerq_fail(INNERQ_ERR_STATE_MISMATCH, "the state is of another model (n_vocab %d, n_embd %d, n_layer %d, "
                           "fingerprint %016llx; the context's model: %d, %d, %d, %016llx)", model[0], model[1],
                           model[2], (unsigned long long) fingerprint, want_model[0], want_model[1], want_model[2],
                           (unsigned long long) c->model->fingerprint);
    }
    if (memcmp(cache, want_cache, sizeof(cache)) != 0) {
        const bool types = cache[0] == want_cache[0] && cache[1] == want_cache[1];
        const int32_t kv_bits = STATE_N_CACHE - 1;  // in thousandths
        return innerq_fail(INNERQ_ERR_STATE_MISMATCH, "the state is of another KV cache %s (%s/%s, kv_bits %g; the "
                           "context's: %s/%s, kv_bits %g)",
                           types ? "configuration (group, windows, quantizer options, kv_bits, sequences or blocks of the "
                                   "sliding-window layers)" : "type",
                           cache[0] >= 0 && cache[0] < IQ_TYPE_COUNT ? iq_type_name(cache[0]) : "?",
                           cache[1] >= 0 && cache[1] < IQ_TYPE_COUNT ? iq_type_name(cache[1]) : "?",
                           cache[kv_bits] / 1000.0, iq_type_name(want_cache[0]), iq_type_name(want_cache[1]),
                           want_cache[kv_bits] / 1000.0);
    }
    return INNERQ_OK;
}

// The hash at the end of a state; s covers what it hashes.
static innerq_status state_open(const void * src, size_t size, struct kv_stream * s) {
    uint64_t h;
    if (size < sizeof(h)) {
        return innerq_fail(INNERQ_ERR_FORMAT, "innerq state of %zu bytes is cut off", size);
    }
    memcpy(&h, (const uint8_t *) src + size - sizeof(h), sizeof(h));
    if (h != fnv1a64(FNV1A64_INIT, src, size - sizeof(h))) {
        return innerq_fail(INNERQ_ERR_FORMAT, "innerq state of %zu bytes is damaged or cut off (its hash does not match)",
                           size);
    }
    *s = (struct kv_stream) { .r = src, .size = size - sizeof(h) };
    return INNERQ_OK;
}

// The sequences of a context's state, from s (past its logits): checked all first (they must
// fit the pool together), then loaded in place of every sequence.
static innerq_status state_seqs_load(innerq_context * c, struct kv_stream * s, uint32_t version) {
    int32_t n_seqs = 1, seq = 0, pages, total = 0;
    if (version >= 4 && (!kv_stream_get(s, &n_seqs, sizeof(n_seqs)) || n_seqs < 0 || n_seqs > c->params.n_seq_max)) {
        return innerq_fail(INNERQ_ERR_FORMAT, "innerq state: %d sequences, the context holds %d", n_seqs,
                           c->params.n_seq_max);
    }
    const size_t start = s->pos;
    innerq_status st = INNERQ_OK;
    for (int32_t i = 0; i < n_seqs && st == INNERQ_OK; i++) {
        if (version >= 4 && (!kv_stream_get(s, &seq, sizeof(seq)) || seq < 0 || seq >= c->params.n_seq_max)) {
            return innerq_fail(INNERQ_ERR_FORMAT, "innerq state: a sequence id outside the context's");
        }
        st = kv_cache_seq_read(c->cache, seq, s, version >= 3, false, &pages);
        total += pages;
    }
    if (st == INNERQ_OK && s->pos != s->size) {
        st = innerq_fail(INNERQ_ERR_FORMAT, "innerq state: %zu bytes after its sequences", s->size - s->pos);
    }
    if (st == INNERQ_OK && total > c->cache->pool.n_pages) {
        st = innerq_fail(INNERQ_ERR_CONTEXT_FULL, "innerq state: %d pages of the KV cache's pool needed, it has %d", total,
                         c->cache->pool.n_pages);
    }
    if (st != INNERQ_OK) {
        return st;
    }
    kv_cache_clear(c->cache);
    s->pos = start;
    for (int32_t i = 0; i < n_seqs && st == INNERQ_OK; i++) {
        if (version >= 4) {
            kv_stream_get(s, &seq, sizeof(seq));
        }
        st = kv_cache_seq_read(c->cache, seq, s, version >= 3, true, &pages);  // checked above
    }
    return st;
}

innerq_status innerq_state_load(innerq_context * c, const void * src, size_t size) {
    if (c == NULL || src == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_state_load: NULL argument");
    }
    struct kv_stream s;
    innerq_status st = state_open(src, size, &s);
    if (st != INNERQ_OK) {
        return st;
    }
    pthread_mutex_lock(&c->lock);
    uint32_t version = 0;
    int32_t n_logits = 0;
    const uint8_t * logits = NULL;
    st = state_check_header(c, &s, false, &version);
    const size_t row = sizeof(float) * (size_t) c->model->hp.n_vocab;
    if (st == INNERQ_OK && (!kv_stream_get(&s, &n_logits, sizeof(n_logits)) || n_logits < 0 ||
                            n_logits > c->params.n_ctx || (size_t) n_logits * row > s.size - s.pos)) {
        st = innerq_fail(INNERQ_ERR_FORMAT, "innerq state: %d rows of logits do not fit", n_logits);
    }
    if (st == INNERQ_OK) {
        logits = s.r + s.pos;
        s.pos += (size_t) n_logits * row;
        st = context_rows_reserve(&c->logits, &c->logits_cap, n_logits > 0 ? n_logits : 1, c->model->hp.n_vocab,
                                  "logits");
    }
    if (st == INNERQ_OK) {
        st = state_seqs_load(c, &s, version);
    }
    if (st == INNERQ_OK) {
        context_outputs_drop(c);  // embeddings are not part of a state
        if (n_logits > 0) {
            memcpy(c->logits, logits, (size_t) n_logits * row);
        }
        c->n_logits = n_logits;
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}

innerq_status innerq_state_seq_load(innerq_context * c, int32_t seq, const void * src, size_t size) {
    if (c == NULL || src == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_state_seq_load: NULL argument");
    }
    struct kv_stream s;
    innerq_status st = context_seq_check(c, seq, "innerq_state_seq_load");
    if (st == INNERQ_OK) {
        st = state_open(src, size, &s);
    }
    if (st != INNERQ_OK) {
        return st;
    }
    pthread_mutex_lock(&c->lock);
    uint32_t version;
    int32_t pages;
    st = state_check_header(c, &s, true, &version);
    if (st == INNERQ_OK) {
        struct kv_stream check = s;
        st = kv_cache_seq_read(c->cache, seq, &check, true, false, &pages);
        if (st == INNERQ_OK && check.pos != check.size) {
            st = innerq_fail(INNERQ_ERR_FORMAT, "innerq state: %zu bytes after its sequence", check.size - check.pos);
        }
    }
    if (st == INNERQ_OK) {
        st = kv_cache_seq_read(c->cache, seq, &s, true, true, &pages);
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}
