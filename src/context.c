// A context: one sequence, its KV cache, and the evaluation of token batches.
#include "innerq.h"

#include "iq-alloc.h"
#include "iq-cpu.h"
#include "kv-cache.h"
#include "model.h"
#include "status.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct innerq_context {
    innerq_model * model;
    innerq_context_params params;
    iq_backend * backend;
    iq_gallocr * galloc;
    struct kv_cache * cache;
    float * logits;          // [n_logits, n_vocab]
    size_t logits_cap;       // floats allocated
    int32_t n_logits;        // rows of logits of the last decode call
    // Taken by every call that reads or changes the above (innerq.h, "Threads"); recursive so
    // that a caller holding it through innerq_context_lock can make those calls.
    pthread_mutex_t lock;
    bool lock_ready;
};

const char * innerq_version(void) { return "0.1.0"; }

const char * innerq_cpu_isa(void) { return iq_cpu_isa_name(iq_cpu_isa_active()); }

static int32_t default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 8 ? 8 : (int32_t) n;
}

innerq_context_params innerq_context_default_params(void) {
    innerq_context_params p = {
        .n_ctx = 4096, .n_batch = 512, .n_threads = 0, .kv_k = NULL, .kv_v = NULL,
        .kv_group = 0, .kv_sink = -1, .kv_recent = -1, .kv_hybrid = true, .kv_norm = true, .kv_debias = true,
        .kv_norm_pairs = true, .logits_all = false, .decode_semantics = false,
        .embeddings = false, .pooling = INNERQ_POOLING_UNSPECIFIED,
    };
    return p;
}

static innerq_status params_check(const innerq_model * model, innerq_context_params * p) {
    innerq_status st = innerq_context_params_check(p);
    if (st != INNERQ_OK) {
        return st;
    }
    if (p->n_ctx == 0) {
        p->n_ctx = model->hp.n_ctx_train;
    }
    if (p->n_ctx < 1 || p->n_ctx > (1 << 22)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "n_ctx = %d is out of range (1 .. %d)", p->n_ctx, 1 << 22);
    }
    if (p->n_threads == 0) {
        p->n_threads = default_threads();
    }
    // A window of n_ctx already keeps every token at full precision, so a larger one behaves
    // the same; the cache sizes its windows by them, so they must not exceed n_ctx.
    p->kv_sink = p->kv_sink > p->n_ctx ? p->n_ctx : p->kv_sink;
    p->kv_recent = p->kv_recent > p->n_ctx ? p->n_ctx : p->kv_recent;
    return INNERQ_OK;
}

innerq_status innerq_context_init(innerq_model * model, const innerq_context_params * params, innerq_context ** out) {
    if (model == NULL || out == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_context_init: model and out must not be NULL");
    }
    *out = NULL;
    innerq_context_params p = params ? *params : innerq_context_default_params();
    innerq_status st = params_check(model, &p);
    if (st != INNERQ_OK) {
        return st;
    }
    innerq_context * c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
    }
    c->model = model;
    c->params = p;
    pthread_mutexattr_t attr;
    c->lock_ready = pthread_mutexattr_init(&attr) == 0;
    if (c->lock_ready) {
        c->lock_ready = pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE) == 0 &&
                        pthread_mutex_init(&c->lock, &attr) == 0;
        pthread_mutexattr_destroy(&attr);
    }
    if (!c->lock_ready) {
        innerq_context_free(c);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "could not create the context's lock");
    }
    c->params.kv_k = c->params.kv_v = NULL;  // the caller's strings are not kept
    c->backend = iq_backend_cpu_init(p.n_threads);
    c->galloc = c->backend ? iq_gallocr_new(c->backend) : NULL;
    if (c->galloc == NULL) {
        innerq_context_free(c);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "could not create the compute backend: %s", iq_error_get());
    }
    st = kv_cache_init(&model->hp, c->backend, &p, p.n_ctx, &c->cache);
    if (st != INNERQ_OK) {
        innerq_context_free(c);
        return st;
    }
    *out = c;
    return INNERQ_OK;
}

void innerq_context_free(innerq_context * c) {
    if (c == NULL) {
        return;
    }
    kv_cache_free(c->cache);
    if (c->galloc) {
        iq_gallocr_free(c->galloc);
    }
    if (c->backend) {
        iq_backend_free(c->backend);
    }
    free(c->logits);
    if (c->lock_ready) {
        pthread_mutex_destroy(&c->lock);
    }
    free(c);
}

innerq_status innerq_context_lock(innerq_context * c) {
    if (c == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_context_lock: NULL context");
    }
    const int err = pthread_mutex_lock(&c->lock);
    return err ? innerq_fail(INNERQ_ERR_BACKEND, "innerq_context_lock: %s", strerror(err)) : INNERQ_OK;
}

innerq_status innerq_context_unlock(innerq_context * c) {
    if (c == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_context_unlock: NULL context");
    }
    const int err = pthread_mutex_unlock(&c->lock);
    if (err == EPERM) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_context_unlock: this thread does not hold the lock");
    }
    return err ? innerq_fail(INNERQ_ERR_BACKEND, "innerq_context_unlock: %s", strerror(err)) : INNERQ_OK;
}

// The calls below that read state take the lock through a const pointer: the lock itself is
// the one member that changes under a const view.
static innerq_context * context_locked(const innerq_context * c) {
    innerq_context * m = (innerq_context *) c;
    pthread_mutex_lock(&m->lock);
    return m;
}

int32_t innerq_n_ctx(const innerq_context * c) { return c ? c->params.n_ctx : -1; }
int32_t innerq_n_past(const innerq_context * c) {
    if (c == NULL) {
        return -1;
    }
    innerq_context * m = context_locked(c);
    const int32_t n = m->cache->n_past;
    pthread_mutex_unlock(&m->lock);
    return n;
}
uint64_t innerq_cache_size(const innerq_context * c) { return c ? kv_cache_size(c->cache) : 0; }

innerq_status innerq_set_n_threads(innerq_context * c, int32_t n_threads) {
    if (c == NULL || n_threads < 1 || n_threads > 512) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_set_n_threads: n_threads = %d is out of range (1 .. 512)",
                           n_threads);
    }
    pthread_mutex_lock(&c->lock);
    c->params.n_threads = n_threads;
    iq_backend_cpu_set_n_threads(c->backend, n_threads);
    pthread_mutex_unlock(&c->lock);
    return INNERQ_OK;
}

innerq_status innerq_set_batch_mode(innerq_context * c, bool logits_all, bool decode_semantics) {
    if (c == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_set_batch_mode: NULL context");
    }
    pthread_mutex_lock(&c->lock);
    c->params.logits_all = logits_all;
    c->params.decode_semantics = decode_semantics;
    c->n_logits = 0;
    pthread_mutex_unlock(&c->lock);
    return INNERQ_OK;
}

innerq_status innerq_cache_clear(innerq_context * c) {
    if (c == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_cache_clear: NULL context");
    }
    pthread_mutex_lock(&c->lock);
    c->n_logits = 0;
    const innerq_status st = kv_cache_clear(c->cache);
    pthread_mutex_unlock(&c->lock);
    return st;
}

static innerq_status logits_reserve(innerq_context * c, int32_t rows) {
    const size_t need = (size_t) rows * (size_t) c->model->hp.n_vocab;
    if (need > c->logits_cap) {
        float * p = realloc(c->logits, need * sizeof(float));
        if (p == NULL) {
            return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory for %d rows of logits", rows);
        }
        c->logits = p;
        c->logits_cap = need;
    }
    return INNERQ_OK;
}

// Evaluates one batch of at most n_batch tokens at position n_past; its logits go to rows
// [row0, row0 + n_outputs) of c->logits. The cache's bookkeeping changes only once the graph
// has run: its ops get a snapshot of it.
static innerq_status decode_batch(innerq_context * c, const innerq_token * tokens, int32_t n, int32_t row0,
                                  int32_t n_outputs) {
    const innerq_model * m = c->model;
    struct iq_kv_batch batch;
    if (!kv_cache_batch(c->cache, n, &batch)) {
        return innerq_fail(INNERQ_ERR_CONTEXT_FULL, "%s", iq_error_get());
    }
    const int32_t n_past = batch.n_past;
    struct iq_context * gctx = iq_context_init(iq_tensor_overhead() * (size_t) (40 * m->hp.n_layer + 64) +
                                               iq_graph_overhead(32 * m->hp.n_layer + 32));
    if (gctx == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory building the graph");
    }
    innerq_status st = INNERQ_OK;
    struct llama_graph lg;
    if (!model_build_graph(m, c->cache, gctx, n, &batch, n_outputs, c->params.decode_semantics, &lg)) {
        st = innerq_fail(INNERQ_ERR_BACKEND, "building the graph failed: %s", iq_error_get());
    } else if (!iq_gallocr_alloc_graph(c->galloc, lg.graph)) {
        st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "allocating the graph failed: %s", iq_error_get());
    }
    if (st == INNERQ_OK) {
        int32_t * buf = malloc(sizeof(int32_t) * (size_t) n);
        if (buf == NULL) {
            st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
        } else {
            iq_tensor_set(lg.tokens, tokens, 0, sizeof(int32_t) * (size_t) n);
            for (int32_t i = 0; i < n; i++) {
                buf[i] = n_past + i;
            }
            iq_tensor_set(lg.pos, buf, 0, sizeof(int32_t) * (size_t) n);
            for (int32_t i = 0; i < n_outputs; i++) {
                buf[i] = n - n_outputs + i;  // the last n_outputs tokens
            }
            iq_tensor_set(lg.out_ids, buf, 0, sizeof(int32_t) * (size_t) n_outputs);
            free(buf);
            if (iq_backend_graph_compute(c->backend, lg.graph) != 0) {
                st = innerq_fail(INNERQ_ERR_BACKEND, "compute failed: %s", iq_error_get());
            }
        }
    }
    if (st == INNERQ_OK) {
        kv_cache_commit(c->cache, &batch, n);
        iq_tensor_get(lg.logits, c->logits + (size_t) row0 * m->hp.n_vocab, 0,
                      sizeof(float) * (size_t) n_outputs * m->hp.n_vocab);
    }
    iq_context_free(gctx);
    return st;
}

static innerq_status decode_tokens(innerq_context * c, const innerq_token * tokens, int32_t n_tokens) {
    const int32_t n_vocab = c->model->hp.n_vocab;
    for (int32_t i = 0; i < n_tokens; i++) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "token %d (at index %d) is not in the vocabulary (0 .. %d)",
                               tokens[i], i, n_vocab - 1);
        }
    }
    if ((int64_t) c->cache->n_past + n_tokens > c->params.n_ctx) {
        return innerq_fail(INNERQ_ERR_CONTEXT_FULL, "%d tokens do not fit: %d of the context's %d are used",
                           n_tokens, c->cache->n_past, c->params.n_ctx);
    }
    const bool all = c->params.logits_all;
    innerq_status st = logits_reserve(c, all ? n_tokens : 1);
    if (st != INNERQ_OK) {
        return st;
    }
    c->n_logits = 0;
    for (int32_t i = 0, n; i < n_tokens; i += n) {
        n = n_tokens - i < c->params.n_batch ? n_tokens - i : c->params.n_batch;
        if (c->params.decode_semantics) {
            const int32_t until = kv_cache_until_flush(c->cache);
            n = n < until ? n : until;
        }
        // Without logits_all only the last token's row is kept (each batch writes row 0).
        st = decode_batch(c, tokens + i, n, all ? i : 0, all ? n : 1);
        if (st != INNERQ_OK) {
            return st;
        }
    }
    c->n_logits = all ? n_tokens : 1;
    return INNERQ_OK;
}

innerq_status innerq_decode(innerq_context * c, const innerq_token * tokens, int32_t n_tokens) {
    if (c == NULL || tokens == NULL || n_tokens < 1) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_decode: needs a context and at least one token");
    }
    pthread_mutex_lock(&c->lock);
    const innerq_status st = decode_tokens(c, tokens, n_tokens);
    pthread_mutex_unlock(&c->lock);
    return st;
}

float * innerq_get_logits(innerq_context * c) {
    return innerq_get_logits_ith(c, -1);
}

float * innerq_get_logits_ith(innerq_context * c, int32_t i) {
    if (c == NULL) {
        innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_get_logits_ith: NULL context");
        return NULL;
    }
    pthread_mutex_lock(&c->lock);
    const int32_t row = i < 0 ? i + c->n_logits : i;
    float * out = NULL;
    if (c->n_logits == 0) {
        innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "no logits: nothing has been evaluated");
    } else if (row < 0 || row >= c->n_logits) {
        innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "logits row %d is out of range (%d rows; set logits_all for every token)",
                    row, c->n_logits);
    } else {
        out = c->logits + (size_t) row * c->model->hp.n_vocab;
    }
    pthread_mutex_unlock(&c->lock);
    return out;
}

innerq_status innerq_kv_bytes_per_token(const innerq_model * model, const innerq_context_params * params, double * bytes) {
    if (model == NULL || bytes == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_kv_bytes_per_token: NULL argument");
    }
    innerq_context_params p = params ? *params : innerq_context_default_params();
    enum iq_type tk, tv;
    struct iq_qcache_config qcfg;
    innerq_status st = kv_cache_config(&p, model->hp.head_dim, &tk, &tv, &qcfg);
    if (st == INNERQ_OK) {
        *bytes = kv_cache_bytes_per_token(&model->hp, tk, tv, &qcfg);
    }
    return st;
}
