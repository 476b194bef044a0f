// Evaluating tokens: batches of several sequences cut into steps (innerq_decode_batch), the one-
// sequence shorthand (innerq_decode), and their logits and embeddings.
//
// Each sequence's tokens are cut into chunks by the sequence alone: at most n_batch tokens, and
// where its cache's state says (with decode semantics at its flushes, with the automatic
// layout where the choice is made). A step takes whole chunks of different sequences, at most
// n_batch tokens together, so a sequence is evaluated in the same chunks whatever other
// sequences share its steps, and gets the same logits (a step's products treat every token
// alike; its attention is per sequence, docs/DESIGN.md 3.6).
#include "context-impl.h"

#include "status.h"

#include <stdlib.h>
#include <string.h>

// A sequence of a call: its slot, its tokens (indices into the call's), how many are evaluated.
struct dseq {
    int32_t slot;
    int32_t * toks;
    int32_t n, done;
};

// A call: its tokens, each one's sequence (slot), whether its logits are kept and where to.
struct dcall {
    const innerq_token * token;
    const int32_t * slot;
    int32_t n;
    int32_t * row;  // [n]: logits row, -1: none
    struct dseq * seqs;
    int32_t n_seqs;
};

// The next chunk of sequence d: at most n_batch tokens, cut where its cache flushes (decode
// semantics) and where the automatic layout is chosen.
static int32_t decode_chunk(const innerq_context * c, const struct dseq * d) {
    int32_t n = d->n - d->done < c->params.n_batch ? d->n - d->done : c->params.n_batch;
    if (c->params.decode_semantics) {
        const int32_t until = kv_cache_until_flush(c->cache, d->slot);
        n = n < until ? n : until;
    }
    const int32_t until_layout = kv_cache_until_layout(c->cache, d->slot);
    return until_layout > 0 && until_layout < n ? until_layout : n;
}

// The graph of a step of n tokens of n_seq sequences (their rows), its inputs tok, pos and the
// n_out rows out whose logits it computes, built in a new context *gctx (the caller frees it,
// after reading the outputs), allocated and computed.
static innerq_status decode_graph(innerq_context * c, struct iq_context ** gctx, struct llama_graph * lg, int32_t n,
                                  int32_t n_seq, int32_t n_out, bool decode_semantics, bool embeddings,
                                  const int32_t * tok, const int32_t * pos, const int32_t * out,
                                  const struct iq_kv_seq * rows) {
    const int32_t n_layer = c->model->hp.n_layer;
    *gctx = iq_context_init(iq_tensor_overhead() * (size_t) (MODEL_GRAPH_NODES_PER_LAYER * n_layer + 64) +
                            iq_graph_overhead(MODEL_GRAPH_NODES_PER_LAYER * n_layer + 32));
    if (*gctx == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory building the graph");
    }
    if (!model_build_graph(c->model, c->cache, *gctx, n, n_seq, n_out, decode_semantics, embeddings, lg)) {
        return innerq_fail(INNERQ_ERR_BACKEND, "building the graph failed: %s", iq_error_get());
    }
    if (!iq_sched_alloc_graph(c->sched, lg->graph)) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "allocating the graph failed: %s", iq_error_get());
    }
    iq_tensor_set(lg->tokens, tok, 0, sizeof(int32_t) * (size_t) n);
    iq_tensor_set(lg->pos, pos, 0, sizeof(int32_t) * (size_t) n);
    iq_tensor_set(lg->out_ids, out, 0, sizeof(int32_t) * (size_t) n_out);
    iq_tensor_set(lg->seqs, rows, 0, sizeof(*rows) * (size_t) n_seq);
    if (iq_sched_graph_compute(c->sched, lg->graph) != 0) {
        return innerq_fail(INNERQ_ERR_BACKEND, "compute failed: %s", iq_error_get());
    }
    return INNERQ_OK;
}

// The rows of a step's tokens whose logits the call wants (call_tok[i]: step token i's index in
// the call) into out; one row not kept where none is (a graph computes at least one). Their count.
static int32_t decode_wanted(const struct dcall * call, const int32_t * call_tok, int32_t n, int32_t * out) {
    int32_t n_out = 0;
    for (int32_t i = 0; i < n; i++) {
        if (call->row[call_tok[i]] >= 0) {
            out[n_out++] = i;
        }
    }
    if (n_out == 0) {
        out[n_out++] = n - 1;
    }
    return n_out;
}

// A computed step's logits (its n_out rows out) and embeddings (if the graph has them) to the
// call's rows.
static void decode_outputs(innerq_context * c, const struct dcall * call, const struct llama_graph * lg,
                           const int32_t * call_tok, const int32_t * out, int32_t n_out, int32_t n) {
    const size_t vocab = (size_t) c->model->hp.n_vocab, embd = (size_t) c->model->hp.n_embd;
    for (int32_t o = 0; o < n_out; o++) {
        const int32_t row = call->row[call_tok[out[o]]];
        if (row >= 0) {
            iq_tensor_get(lg->logits, c->logits + (size_t) row * vocab, (size_t) o * lg->logits->nb[1],
                          sizeof(float) * vocab);
        }
    }
    for (int32_t i = 0; lg->embd != NULL && i < n; i++) {
        iq_tensor_get(lg->embd, c->embd + (size_t) call_tok[i] * embd, (size_t) i * lg->embd->nb[1],
                      sizeof(float) * embd);
    }
}

// One step of parts[0 .. n_parts) (whole chunks); the logits of its wanted tokens go to their rows.
static innerq_status decode_step(innerq_context * c, struct dcall * call, const struct kv_step_seq * parts,
                                 const int32_t * call_tok, int32_t n_parts, int32_t n) {
    const innerq_model * m = c->model;
    struct iq_kv_seq * rows = malloc(sizeof(*rows) * (size_t) n_parts);
    int32_t * buf = malloc(sizeof(int32_t) * (size_t) n * 3);
    if (rows == NULL || buf == NULL) {
        free(rows), free(buf);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
    }
    if (!kv_cache_step(c->cache, parts, n_parts, rows)) {
        free(rows), free(buf);
        return innerq_fail(INNERQ_ERR_CONTEXT_FULL, "%s", iq_error_get());
    }
    int32_t * tok = buf, * pos = buf + n, * out = buf + 2 * n;
    for (int32_t p = 0; p < n_parts; p++) {
        for (int32_t j = 0; j < parts[p].n_tokens; j++) {
            const int32_t i = parts[p].token0 + j;
            tok[i] = call->token[call_tok[i]];
            pos[i] = rows[p].n_past + j;
        }
    }
    const int32_t n_out = decode_wanted(call, call_tok, n, out);
    // the automatic layout's queries: the one sequence whose choice is pending (n_seq_max 1)
    const bool probing = kv_cache_probing(c->cache, parts[0].slot, parts[0].n_tokens);
    struct iq_context * gctx = NULL;
    struct llama_graph lg = {0};
    innerq_status st = INNERQ_OK;
    if (probing && (lg.q = calloc((size_t) m->hp.n_layer, sizeof(*lg.q))) == NULL) {
        st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory building the graph");
    } else {
        st = decode_graph(c, &gctx, &lg, n, n_parts, n_out, c->params.decode_semantics, c->params.embeddings, tok, pos,
                          out, rows);
    }
    if (st != INNERQ_OK) {
        kv_cache_step_abort(c->cache, rows, n_parts);
    } else {
        if (probing) {
            kv_cache_probe_save(c->cache, lg.q, parts[0].token0, rows[0].n_past, parts[0].n_tokens);
        }
        kv_cache_step_commit(c->cache, rows, n_parts, c->params.decode_semantics);
        decode_outputs(c, call, &lg, call_tok, out, n_out, n);
    }
    free(lg.q);
    if (gctx != NULL) {
        iq_context_free(gctx);
    }
    free(rows), free(buf);
    return st;
}

// The measuring step's rows into the cache: after the choice, a graph of KV_STORE ops stores
// the n tokens' keys and values (lg's, read back to the host first) in every layer, in the
// layout chosen. Evaluating those tokens again as one batch would give the same rows: a batch's
// attention reads the cache as it was before the batch (here: the windows' f16 rows, nothing
// flushed yet) and its own rows unrounded, and its store comes after (tests/test_kv_auto.py).
static innerq_status decode_store_ahead(innerq_context * c, int32_t slot, struct llama_graph * ahead, int32_t n,
                                        struct iq_context ** gctx) {
    const int32_t n_layer = c->model->hp.n_layer;
    size_t total = 0;
    for (int32_t il = 0; il < n_layer; il++) {
        total += iq_nbytes(ahead->k[il]) + iq_nbytes(ahead->v[il]);
    }
    char * host = malloc(total);
    if (host == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
    }
    for (size_t il = 0, at = 0; il < (size_t) n_layer; il++) {
        iq_tensor_get(ahead->k[il], host + at, 0, iq_nbytes(ahead->k[il]));
        at += iq_nbytes(ahead->k[il]);
        iq_tensor_get(ahead->v[il], host + at, 0, iq_nbytes(ahead->v[il]));
        at += iq_nbytes(ahead->v[il]);
    }
    iq_context_free(*gctx);
    *gctx = iq_context_init(iq_tensor_overhead() * (size_t) (MODEL_GRAPH_NODES_PER_LAYER * n_layer + 64) +
                            iq_graph_overhead(MODEL_GRAPH_NODES_PER_LAYER * n_layer + 32));
    const struct kv_step_seq part = { .slot = slot, .token0 = 0, .n_tokens = n };
    struct iq_kv_seq row;
    innerq_status st = INNERQ_OK;
    if (*gctx == NULL) {
        st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory building the graph");
    } else if (!model_build_store_graph(c->model, c->cache, *gctx, n, ahead)) {
        st = innerq_fail(INNERQ_ERR_BACKEND, "building the graph failed: %s", iq_error_get());
    } else if (!iq_sched_alloc_graph(c->sched, ahead->graph)) {
        st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "allocating the graph failed: %s", iq_error_get());
    } else if (!kv_cache_step(c->cache, &part, 1, &row)) {
        st = innerq_fail(INNERQ_ERR_CONTEXT_FULL, "%s", iq_error_get());
    } else {
        iq_tensor_set(ahead->seqs, &row, 0, sizeof(row));
        for (size_t il = 0, at = 0; il < (size_t) n_layer; il++) {
            iq_tensor_set(ahead->k[il], host + at, 0, iq_nbytes(ahead->k[il]));
            at += iq_nbytes(ahead->k[il]);
            iq_tensor_set(ahead->v[il], host + at, 0, iq_nbytes(ahead->v[il]));
            at += iq_nbytes(ahead->v[il]);
        }
        if (iq_sched_graph_compute(c->sched, ahead->graph) != 0) {
            kv_cache_step_abort(c->cache, &row, 1);
            st = innerq_fail(INNERQ_ERR_BACKEND, "compute failed: %s", iq_error_get());
        } else {
            kv_cache_step_commit(c->cache, &row, 1, false);
        }
    }
    free(host);
    return st;
}

// The automatic layout's measuring step (on a device with kv_auto_ahead: the CPU): before the
// choice, the next tokens of sequence d in this call are evaluated once with nothing stored, and
// the queries, keys and values of the first m of them (at most KV_AUTO_AHEAD and n_batch) join
// the windows' rows in the choice
// (kv_cache_layout_choose). The choice so sees the first S + R + G - 1 + KV_AUTO_AHEAD tokens of
// a prompt given in one call (docs/INNERQ.md "Automatic layout"), and the windows' rows alone
// where the sequence reaches its first flush a token at a time. Without decode semantics the
// step is the next batch's evaluation (n tokens: at most n_batch and KV_AUTO_KEEP): its logits
// are the call's and its rows are stored (decode_store_ahead), *n_done = n; with decode
// semantics (every token as one-token decoding reads the cache) the m tokens are evaluated
// again after the choice, *n_done = 0.
static innerq_status decode_choose(innerq_context * c, const struct dcall * call, const struct dseq * d,
                                   int32_t * n_done) {
    const int32_t ahead = c->cache->cfg.auto_ahead ? KV_AUTO_AHEAD : 0;  // the device's choice
    const int32_t left = d->n - d->done, cap = ahead < c->params.n_batch ? ahead : c->params.n_batch;
    const int32_t m = left < cap ? left : cap, n_layer = c->model->hp.n_layer;
    const bool keep = !c->params.decode_semantics;
    *n_done = 0;
    if (m <= 0) {
        return kv_cache_layout_choose(c->cache, d->slot, c->params.n_threads, NULL);
    }
    int32_t n = m;
    if (keep) {
        n = left < c->params.n_batch ? left : c->params.n_batch;
        n = n < KV_AUTO_KEEP ? n : KV_AUTO_KEEP;
        n = n > m ? n : m;
    }
    const struct kv_step_seq part = { .slot = d->slot, .token0 = 0, .n_tokens = n };
    struct iq_kv_seq row;
    int32_t * buf = malloc(sizeof(int32_t) * (size_t) n * 3);
    struct iq_tensor ** t = calloc((size_t) n_layer * 3, sizeof(*t));
    if (buf == NULL || t == NULL) {
        free(buf), free(t);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
    }
    if (!kv_cache_step(c->cache, &part, 1, &row)) {
        free(buf), free(t);
        return innerq_fail(INNERQ_ERR_CONTEXT_FULL, "%s", iq_error_get());
    }
    const int32_t * call_tok = d->toks + d->done;
    int32_t * tok = buf, * pos = buf + n, * out = buf + 2 * n;
    for (int32_t j = 0; j < n; j++) {
        tok[j] = call->token[call_tok[j]];
        pos[j] = row.n_past + j;
    }
    int32_t n_out = 1;
    out[0] = n - 1;  // a graph computes at least one row of logits; kept only if the step is kept
    if (keep) {
        n_out = decode_wanted(call, call_tok, n, out);
    }
    struct iq_context * gctx = NULL;
    struct llama_graph lg = { .q = t, .k = t + n_layer, .v = t + 2 * n_layer };
    innerq_status st = decode_graph(c, &gctx, &lg, n, 1, n_out, false, keep && c->params.embeddings, tok, pos, out,
                                    &row);
    kv_cache_step_abort(c->cache, &row, 1);  // nothing was stored: the pages it took go back
    if (st == INNERQ_OK) {
        const struct kv_ahead ahead = { .q = lg.q, .k = lg.k, .v = lg.v, .n = m };
        st = kv_cache_layout_choose(c->cache, d->slot, c->params.n_threads, &ahead);
    }
    if (st == INNERQ_OK && keep) {
        decode_outputs(c, call, &lg, call_tok, out, n_out, n);
        if ((st = decode_store_ahead(c, d->slot, &lg, n, &gctx)) == INNERQ_OK) {
            *n_done = n;
        }
    }
    if (gctx != NULL) {
        iq_context_free(gctx);
    }
    free(buf), free(t);
    return st;
}

// The pooled embedding of the n_embd_rows tokens of the last decode call (llama.cpp pools a
// sequence's tokens of the batch the same way; normalizing is the caller's, as there).
static void embd_pool(innerq_context * c) {
    const int32_t d = c->model->hp.n_embd, n = c->n_embd_rows;
    if (c->pooling == INNERQ_POOLING_MEAN) {
        for (int32_t j = 0; j < d; j++) {
            double sum = 0.0;
            for (int32_t i = 0; i < n; i++) {
                sum += c->embd[(size_t) i * d + j];
            }
            c->pooled[j] = (float) (sum / n);
        }
    } else if (c->pooling == INNERQ_POOLING_CLS || c->pooling == INNERQ_POOLING_LAST) {
        const int32_t row = c->pooling == INNERQ_POOLING_CLS ? 0 : n - 1;
        memcpy(c->pooled, c->embd + (size_t) row * d, sizeof(float) * (size_t) d);
    }
}

// The steps of a call: each takes the next whole chunk of every sequence that has tokens left,
// in order, while they fit in n_batch.
static innerq_status decode_steps(innerq_context * c, struct dcall * call) {
    struct kv_step_seq * parts = malloc(sizeof(*parts) * (size_t) call->n_seqs);
    int32_t * call_tok = malloc(sizeof(int32_t) * (size_t) c->params.n_batch);
    innerq_status st = parts == NULL || call_tok == NULL ? innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory")
                                                         : INNERQ_OK;
    for (int32_t left = call->n; st == INNERQ_OK && left > 0;) {
        int32_t n_parts = 0, n = 0;
        for (int32_t k = 0; k < call->n_seqs && st == INNERQ_OK; k++) {
            struct dseq * d = &call->seqs[k];
            if (d->done == d->n) {
                continue;
            }
            // the automatic layout is chosen before the first flush, from the tokens stored until then
            if (kv_cache_until_layout(c->cache, d->slot) == 0) {
                if (n_parts > 0) {
                    break;  // after the step that stores up to the choice
                }
                int32_t n_done = 0;
                st = decode_choose(c, call, d, &n_done);
                d->done += n_done;
                left -= n_done;
                if (st != INNERQ_OK || d->done == d->n) {
                    continue;
                }
            }
            const int32_t len = decode_chunk(c, d);
            if (st != INNERQ_OK || n + len > c->params.n_batch) {
                continue;
            }
            parts[n_parts++] = (struct kv_step_seq) { .slot = d->slot, .token0 = n, .n_tokens = len };
            memcpy(call_tok + n, d->toks + d->done, sizeof(int32_t) * (size_t) len);
            n += len;
        }
        if (st == INNERQ_OK && n_parts > 0 && (st = decode_step(c, call, parts, call_tok, n_parts, n)) == INNERQ_OK) {
            for (int32_t p = 0; p < n_parts; p++) {
                for (int32_t k = 0; k < call->n_seqs; k++) {
                    call->seqs[k].done += call->seqs[k].slot == parts[p].slot ? parts[p].n_tokens : 0;
                }
            }
            left -= n;
        }
    }
    free(parts), free(call_tok);
    return st;
}

// Evaluates n tokens, token i of sequence slot[i] (each sequence's in order, after those it
// holds); the logits of the tokens with want[i] are kept, in rows counted in token order.
static innerq_status decode_call(innerq_context * c, const innerq_token * token, const int32_t * slot,
                                 const int8_t * want, int32_t n, bool by_token) {
    const int32_t n_seq = c->params.n_seq_max;
    int32_t * count = calloc((size_t) n_seq, sizeof(int32_t));
    int32_t * order = malloc(sizeof(int32_t) * (size_t) n_seq);  // a slot's sequence of the call, -1: none
    struct dcall call = { .token = token, .slot = slot, .n = n };
    call.row = malloc(sizeof(int32_t) * (size_t) n);
    call.seqs = malloc(sizeof(*call.seqs) * (size_t) n_seq);
    int32_t * toks = malloc(sizeof(int32_t) * (size_t) n);
    innerq_status st = INNERQ_OK;
    if (count == NULL || order == NULL || call.row == NULL || call.seqs == NULL || toks == NULL) {
        st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
    }
    int32_t n_rows = 0;
    for (int32_t i = 0; st == INNERQ_OK && i < n; i++) {
        count[slot[i]]++;
        call.row[i] = want[i] ? n_rows++ : -1;
    }
    for (int32_t s = 0; st == INNERQ_OK && s < n_seq; s++) {
        order[s] = -1;
    }
    for (int32_t i = 0, at = 0; st == INNERQ_OK && i < n; i++) {
        if (order[slot[i]] < 0) {  // sequences in the order they first appear
            order[slot[i]] = call.n_seqs;
            call.seqs[call.n_seqs++] = (struct dseq) { .slot = slot[i], .toks = toks + at };
            at += count[slot[i]];
        }
        struct dseq * d = &call.seqs[order[slot[i]]];
        d->toks[d->n++] = i;
    }
    if (st == INNERQ_OK) {
        st = context_rows_reserve(&c->logits, &c->logits_cap, n_rows > 0 ? n_rows : 1, c->model->hp.n_vocab, "logits");
    }
    if (st == INNERQ_OK && c->params.embeddings) {
        st = context_rows_reserve(&c->embd, &c->embd_cap, n, c->model->hp.n_embd, "embeddings");
    }
    if (st == INNERQ_OK && n > c->out_cap) {
        int32_t * p = realloc(c->out_row, sizeof(int32_t) * (size_t) n);
        st = p == NULL ? innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory") : INNERQ_OK;
        c->out_row = p != NULL ? p : c->out_row;
        c->out_cap = p != NULL ? n : c->out_cap;
    }
    if (st == INNERQ_OK) {
        context_outputs_drop(c);
        st = decode_steps(c, &call);
    }
    if (st == INNERQ_OK) {
        memcpy(c->out_row, call.row, sizeof(int32_t) * (size_t) n);
        c->n_out = n;
        c->n_logits = n_rows;
        c->by_token = by_token;
        if (c->params.embeddings) {
            c->n_embd_rows = n;
            embd_pool(c);
        }
    }
    free(count), free(order), free(call.row), free(call.seqs), free(toks);
    return st;
}

static innerq_status decode_tokens_check(const innerq_context * c, const innerq_token * tokens, int32_t n_tokens) {
    const int32_t n_vocab = c->model->hp.n_vocab;
    for (int32_t i = 0; i < n_tokens; i++) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "token %d (at index %d) is not in the vocabulary (0 .. %d)",
                               tokens[i], i, n_vocab - 1);
        }
    }
    return INNERQ_OK;
}

innerq_status innerq_decode(innerq_context * c, const innerq_token * tokens, int32_t n_tokens) {
    if (c == NULL || tokens == NULL || n_tokens < 1) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_decode: needs a context and at least one token");
    }
    pthread_mutex_lock(&c->lock);
    innerq_status st = decode_tokens_check(c, tokens, n_tokens);
    const int32_t n_past = c->cache->seqs[0].n_past;
    if (st == INNERQ_OK && (int64_t) n_past + n_tokens > c->params.n_ctx) {
        st = innerq_fail(INNERQ_ERR_CONTEXT_FULL, "%d tokens do not fit: %d of the context's %d are used", n_tokens,
                         n_past, c->params.n_ctx);
    }
    int32_t * slot = st == INNERQ_OK ? calloc((size_t) n_tokens, sizeof(int32_t)) : NULL;
    int32_t * own = st == INNERQ_OK ? calloc((size_t) c->params.n_seq_max, sizeof(int32_t)) : NULL;
    if (own != NULL) {
        own[0] = n_tokens;
    }
    if (own != NULL && kv_cache_pages_needed(c->cache, own) > c->cache->pool.n_free) {
        st = innerq_fail(INNERQ_ERR_CONTEXT_FULL, "%d tokens do not fit: the other sequences hold the KV cache's pool",
                         n_tokens);
    }
    int8_t * want = st == INNERQ_OK ? calloc((size_t) n_tokens, 1) : NULL;
    if (st == INNERQ_OK && (slot == NULL || want == NULL || own == NULL)) {
        st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
    }
    if (st == INNERQ_OK) {
        for (int32_t i = c->params.logits_all ? 0 : n_tokens - 1; i < n_tokens; i++) {
            want[i] = 1;
        }
        st = decode_call(c, tokens, slot, want, n_tokens, false);
    }
    free(slot), free(want), free(own);
    pthread_mutex_unlock(&c->lock);
    return st;
}

// ---- batches ----

innerq_status innerq_batch_init(int32_t n_tokens_max, int32_t n_seq_max, innerq_batch * out) {
    if (out == NULL || n_tokens_max < 1 || n_seq_max < 1) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_batch_init: needs out and at least one token and sequence");
    }
    memset(out, 0, sizeof(*out));
    const size_t n = (size_t) n_tokens_max;
    out->token = malloc(sizeof(*out->token) * n);
    out->pos = malloc(sizeof(*out->pos) * n);
    out->n_seq_id = malloc(sizeof(*out->n_seq_id) * n);
    out->seq_id = calloc(n + 1, sizeof(*out->seq_id));  // NULL-terminated, as llama_batch_init's
    out->logits = calloc(n, sizeof(*out->logits));
    bool ok = out->token != NULL && out->pos != NULL && out->n_seq_id != NULL && out->seq_id != NULL &&
              out->logits != NULL;
    for (size_t i = 0; ok && i < n; i++) {
        ok = (out->seq_id[i] = calloc((size_t) n_seq_max, sizeof(int32_t))) != NULL;
    }
    if (!ok) {
        innerq_batch_free(out);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory for a batch of %d tokens", n_tokens_max);
    }
    return INNERQ_OK;
}

void innerq_batch_free(innerq_batch * b) {
    if (b == NULL) {
        return;
    }
    for (int32_t i = 0; b->seq_id != NULL && b->seq_id[i] != NULL; i++) {
        free(b->seq_id[i]);
    }
    free(b->token), free(b->pos), free(b->n_seq_id), free(b->seq_id), free(b->logits);
    memset(b, 0, sizeof(*b));
}

// The sequence of token i (the first of its ids; sequence 0 where the batch names none).
static int32_t batch_seq(const innerq_batch * b, int32_t i) {
    return b->seq_id != NULL && b->n_seq_id != NULL && b->seq_id[i] != NULL ? b->seq_id[i][0] : 0;
}

static int32_t batch_n_ids(const innerq_batch * b, int32_t i) {
    return b->seq_id != NULL && b->n_seq_id != NULL && b->seq_id[i] != NULL ? b->n_seq_id[i] : 1;
}

// Checks a batch against the context (innerq.h); `copy_of[s]`: the sequence s becomes a copy
// of after the batch (-1: none). INNERQ_OK, or innerq_fail with the first problem.
static innerq_status batch_check(const innerq_context * c, const innerq_batch * b, int32_t * next, int32_t * copy_of,
                                 int32_t * own) {
    const int32_t n_seq = c->params.n_seq_max;
    innerq_status st = decode_tokens_check(c, b->token, b->n_tokens);
    for (int32_t s = 0; s < n_seq; s++) {
        next[s] = c->cache->seqs[s].n_past;
        copy_of[s] = -1;
        own[s] = 0;
    }
    for (int32_t i = 0; st == INNERQ_OK && i < b->n_tokens; i++) {
        const int32_t n_ids = batch_n_ids(b, i), seq = batch_seq(b, i);
        if (n_ids < 1) {
            return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_decode_batch: token %d has no sequence", i);
        }
        for (int32_t k = 0; k < n_ids; k++) {
            const int32_t s = b->seq_id != NULL && b->seq_id[i] != NULL ? b->seq_id[i][k] : 0;
            if ((st = context_seq_check(c, s, "innerq_decode_batch")) != INNERQ_OK) {
                return st;
            }
            if (k == 0) {
                continue;
            }
            // s takes a copy of seq: both start empty, and s gets nothing of its own
            if ((copy_of[s] >= 0 && copy_of[s] != seq) || s == seq || c->cache->seqs[s].n_past > 0 ||
                c->cache->seqs[seq].n_past > 0) {
                return innerq_fail(INNERQ_ERR_UNSUPPORTED, "innerq_decode_batch: token %d gives sequence %d the tokens of "
                                   "sequence %d: both must be empty before the batch, and the tokens the first of "
                                   "several sequence ids", i, s, seq);
            }
            copy_of[s] = seq;
        }
        own[seq]++;
        if (b->pos != NULL && b->pos[i] != next[seq]) {
            return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_decode_batch: token %d of sequence %d is at position "
                               "%d; the sequence's next is %d (each token comes right after those it holds)", i, seq,
                               b->pos[i], next[seq]);
        }
        if (++next[seq] > c->params.n_ctx) {
            return innerq_fail(INNERQ_ERR_CONTEXT_FULL, "innerq_decode_batch: sequence %d would hold %d tokens, the "
                               "context %d", seq, next[seq], c->params.n_ctx);
        }
    }
    // what the batch takes from the pool, all of it checked before any is evaluated
    const int64_t pages = st == INNERQ_OK ? kv_cache_pages_needed(c->cache, own) : 0;
    if (st == INNERQ_OK && pages > c->cache->pool.n_free) {
        return innerq_fail(INNERQ_ERR_CONTEXT_FULL, "innerq_decode_batch: the batch needs %lld pages of the KV cache's "
                           "pool, %d of its %d are free (remove sequences or their tokens: innerq_seq_rm)",
                           (long long) pages, c->cache->pool.n_free, c->cache->pool.n_pages);
    }
    for (int32_t s = 0; st == INNERQ_OK && s < n_seq; s++) {
        int32_t with_s = 0;  // tokens of copy_of[s] that carry s too
        for (int32_t i = 0; copy_of[s] >= 0 && i < b->n_tokens; i++) {
            for (int32_t k = 1; k < batch_n_ids(b, i); k++) {
                with_s += b->seq_id[i][k] == s;
            }
        }
        if (copy_of[s] >= 0 && (own[s] > 0 || with_s != own[copy_of[s]])) {
            return innerq_fail(INNERQ_ERR_UNSUPPORTED, "innerq_decode_batch: sequence %d shares %d of sequence %d's %d "
                               "tokens and has %d of its own: a sequence given another's tokens gets all of them and "
                               "nothing else", s, with_s, copy_of[s], own[copy_of[s]], own[s]);
        }
    }
    return st;
}

innerq_status innerq_decode_batch(innerq_context * c, const innerq_batch * b) {
    if (c == NULL || b == NULL || b->token == NULL || b->n_tokens < 1) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_decode_batch: needs a context and a batch of at least one "
                           "token");
    }
    pthread_mutex_lock(&c->lock);
    const int32_t n = b->n_tokens, n_seq = c->params.n_seq_max;
    int32_t * work = malloc(sizeof(int32_t) * (size_t) (3 * n_seq + n));
    int8_t * want = malloc((size_t) n);
    innerq_status st = work == NULL || want == NULL ? innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory") : INNERQ_OK;
    int32_t * copy_of = work + n_seq, * slot = work + 3 * n_seq;
    if (st == INNERQ_OK) {
        st = batch_check(c, b, work, copy_of, work + 2 * n_seq);
    }
    for (int32_t i = 0; st == INNERQ_OK && i < n; i++) {
        slot[i] = batch_seq(b, i);
        want[i] = b->logits != NULL ? b->logits[i] != 0 : i == n - 1;
    }
    if (st == INNERQ_OK) {
        st = decode_call(c, b->token, slot, want, n, true);
    }
    for (int32_t s = 0; st == INNERQ_OK && s < n_seq; s++) {
        int32_t copied;
        st = copy_of[s] >= 0 ? kv_cache_seq_copy(c->cache, copy_of[s], s, -1, &copied) : INNERQ_OK;
    }
    free(work), free(want);
    pthread_mutex_unlock(&c->lock);
    return st;
}

// ---- logits and embeddings ----

float * innerq_get_logits(innerq_context * c) {
    return innerq_get_logits_ith(c, -1);
}

float * innerq_get_logits_ith(innerq_context * c, int32_t i) {
    if (c == NULL) {
        innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_get_logits_ith: NULL context");
        return NULL;
    }
    pthread_mutex_lock(&c->lock);
    float * out = NULL;
    if (c->n_logits == 0) {
        innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "no logits: nothing has been evaluated");
    } else if (c->by_token) {
        const int32_t t = i < 0 ? i + c->n_out : i;
        if (t < 0 || t >= c->n_out) {
            innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "token %d is out of range (the last batch had %d)", i, c->n_out);
        } else if (c->out_row[t] < 0) {
            innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "token %d of the last batch has no logits (its logits flag was "
                        "not set)", t);
        } else {
            out = c->logits + (size_t) c->out_row[t] * c->model->hp.n_vocab;
        }
    } else {
        const int32_t row = i < 0 ? i + c->n_logits : i;
        if (row < 0 || row >= c->n_logits) {
            innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "logits row %d is out of range (%d rows; set logits_all for every "
                        "token)", row, c->n_logits);
        } else {
            out = c->logits + (size_t) row * c->model->hp.n_vocab;
        }
    }
    pthread_mutex_unlock(&c->lock);
    return out;
}
