// A context: one sequence, its KV cache, and the evaluation of token batches.
#include "innerq.h"

#include "iq-alloc.h"
#include "device.h"
#include "iq-cpu.h"
#include "kv-cache.h"
#include "model.h"
#include "status.h"

#include <errno.h>
#include <math.h>
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
    // embeddings (params.embeddings): every token's of the last decode call, and their pooling
    float * embd;            // [n_embd_rows, n_embd]
    size_t embd_cap;         // floats allocated
    int32_t n_embd_rows;
    float * pooled;          // [n_embd]
    int32_t pooling;         // params.pooling resolved against the model
    // Taken by every call that reads or changes the above (innerq.h, "Threads"); recursive so
    // that a caller holding it through innerq_context_lock can make those calls.
    pthread_mutex_t lock;
    bool lock_ready;
};

const char * innerq_version(void) { return "0.1.0"; }

const char * innerq_cpu_isa(void) { return iq_cpu_isa_name(iq_cpu_isa_active()); }

static int32_t default_threads(void) { return innerq_default_n_threads(); }

innerq_context_params innerq_context_default_params(void) {
    innerq_context_params p = {
        .n_ctx = 4096, .n_batch = 512, .n_threads = 0, .kv_k = NULL, .kv_v = NULL,
        .kv_group = 0, .kv_sink = -1, .kv_recent = -1, .kv_hybrid = true, .kv_norm = true, .kv_debias = true,
        .kv_norm_pairs = true, .kv_rot = -1, .kv_search = true, .kv_bits = 0.0f, .kv_layer_bits = NULL,
        .logits_all = false, .decode_semantics = false,
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
    if (model->vocab_only) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "innerq_context_init: the model was loaded with vocab_only "
                           "(no weights to evaluate with)");
    }
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
    c->params.kv_k = c->params.kv_v = c->params.kv_layer_bits = NULL;  // the caller's strings are not kept
    st = device_backend_init(model->gpu, p.n_threads, &c->backend);
    if (st != INNERQ_OK) {
        innerq_context_free(c);
        return st;
    }
    if (model->gpu && (p.kv_k == NULL || p.kv_k[0] == '\0') && (p.kv_v == NULL || p.kv_v[0] == '\0') &&
        p.kv_bits == 0.0f && (p.kv_layer_bits == NULL || p.kv_layer_bits[0] == '\0')) {
        // the quantized types run on the GPU when asked for (kv_bits and kv_layer_bits ask for
        // InnerQ); the GPU's default stays f16 until their fused decode kernel
        // (cuda/qcache-attention.cu) makes them the faster choice
        p.kv_k = "f16";
    }
    c->galloc = iq_gallocr_new(c->backend);
    if (c->galloc == NULL) {
        innerq_context_free(c);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "could not create the compute backend: %s", iq_error_get());
    }
    st = kv_cache_init(&model->hp, c->backend, &p, p.n_ctx, &c->cache);
    if (st != INNERQ_OK) {
        innerq_context_free(c);
        return st;
    }
    c->pooling = p.pooling == INNERQ_POOLING_UNSPECIFIED ? model->pooling : p.pooling;
    if (p.embeddings && (c->pooled = malloc(sizeof(float) * (size_t) model->hp.n_embd)) == NULL) {
        innerq_context_free(c);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
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
    free(c->embd);
    free(c->pooled);
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

innerq_status innerq_cache_layer_info(innerq_context * c, int32_t layer, innerq_kv_layer_info * out) {
    if (c == NULL || out == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_cache_layer_info: NULL argument");
    }
    pthread_mutex_lock(&c->lock);
    const innerq_status st = kv_cache_layer_info(c->cache, layer, out);
    pthread_mutex_unlock(&c->lock);
    return st;
}

innerq_status innerq_set_n_threads(innerq_context * c, int32_t n_threads) {
    if (c == NULL || n_threads < 1 || n_threads > 512) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_set_n_threads: n_threads = %d is out of range (1 .. 512)",
                           n_threads);
    }
    pthread_mutex_lock(&c->lock);
    c->params.n_threads = n_threads;
    if (iq_backend_is_cpu(c->backend)) {
        iq_backend_cpu_set_n_threads(c->backend, n_threads);
    }
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
    c->n_logits = c->n_embd_rows = 0;
    const innerq_status st = kv_cache_clear(c->cache);
    pthread_mutex_unlock(&c->lock);
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

// Grows *buf to rows x width floats (*cap: floats allocated).
static innerq_status rows_reserve(float ** buf, size_t * cap, int32_t rows, int32_t width, const char * what) {
    const size_t need = (size_t) rows * (size_t) width;
    if (need > *cap) {
        float * p = realloc(*buf, need * sizeof(float));
        if (p == NULL) {
            return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory for %d rows of %s", rows, what);
        }
        *buf = p;
        *cap = need;
    }
    return INNERQ_OK;
}

static innerq_status logits_reserve(innerq_context * c, int32_t rows) {
    return rows_reserve(&c->logits, &c->logits_cap, rows, c->model->hp.n_vocab, "logits");
}

// Evaluates one batch of at most n_batch tokens at position n_past; its logits go to rows
// [row0, row0 + n_outputs) of c->logits. The cache's bookkeeping changes only once the graph
// has run: its ops get a snapshot of it.
static innerq_status decode_batch(innerq_context * c, const innerq_token * tokens, int32_t n, int32_t row0,
                                  int32_t n_outputs, int32_t embd_row0) {
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
    // the queries the automatic layout's choice is measured with, if the batch computes them
    struct llama_graph lg = {0};
    if (kv_cache_probing(c->cache, n_past, n) && (lg.q = calloc((size_t) m->hp.n_layer, sizeof(*lg.q))) == NULL) {
        iq_context_free(gctx);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
    }
    if (!model_build_graph(m, c->cache, gctx, n, &batch, n_outputs, c->params.decode_semantics, c->params.embeddings,
                           &lg)) {
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
    if (st == INNERQ_OK && lg.q != NULL) {
        kv_cache_probe_save(c->cache, lg.q, n_past, n);
    }
    if (st == INNERQ_OK && !kv_cache_commit(c->cache, &batch, n, c->params.decode_semantics)) {
        st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "%s", iq_error_get());
    }
    if (st == INNERQ_OK) {
        iq_tensor_get(lg.logits, c->logits + (size_t) row0 * m->hp.n_vocab, 0,
                      sizeof(float) * (size_t) n_outputs * m->hp.n_vocab);
        if (lg.embd != NULL) {
            iq_tensor_get(lg.embd, c->embd + (size_t) embd_row0 * m->hp.n_embd, 0,
                          sizeof(float) * (size_t) n * m->hp.n_embd);
        }
    }
    free(lg.q);
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
    if (st == INNERQ_OK && c->params.embeddings) {
        st = rows_reserve(&c->embd, &c->embd_cap, n_tokens, c->model->hp.n_embd, "embeddings");
    }
    if (st != INNERQ_OK) {
        return st;
    }
    c->n_logits = c->n_embd_rows = 0;
    for (int32_t i = 0, n; i < n_tokens; i += n) {
        n = n_tokens - i < c->params.n_batch ? n_tokens - i : c->params.n_batch;
        if (c->params.decode_semantics) {
            const int32_t until = kv_cache_until_flush(c->cache);
            n = n < until ? n : until;
        }
        // the automatic layout is chosen before the first flush, from the tokens stored until then
        const int32_t until_layout = kv_cache_until_layout(c->cache);
        if (until_layout == 0 && (st = kv_cache_layout_choose(c->cache, c->params.n_threads)) != INNERQ_OK) {
            return st;
        }
        n = until_layout > 0 && until_layout < n ? until_layout : n;
        // Without logits_all only the last token's row is kept (each batch writes row 0).
        st = decode_batch(c, tokens + i, n, all ? i : 0, all ? n : 1, i);
        if (st != INNERQ_OK) {
            return st;
        }
    }
    c->n_logits = all ? n_tokens : 1;
    if (c->params.embeddings) {
        c->n_embd_rows = n_tokens;
        embd_pool(c);
    }
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
    innerq_status st = kv_cache_config(&p, model->hp.head_dim, model->gpu, &tk, &tv, &qcfg);
    if (st == INNERQ_OK) {
        *bytes = kv_cache_bytes_per_token(&model->hp, tk, tv, &qcfg, p.kv_bits);
    }
    return st;
}

// ---- embeddings ----

int32_t innerq_pooling_type(const innerq_context * c) { return c ? c->pooling : INNERQ_POOLING_UNSPECIFIED; }

int32_t innerq_embeddings_rows(innerq_context * c) {
    if (c == NULL) {
        return 0;
    }
    pthread_mutex_lock(&c->lock);
    const int32_t n = c->n_embd_rows;
    pthread_mutex_unlock(&c->lock);
    return n;
}

// Row i of the last call's embeddings (i < 0 from the end), or every row with i == INT32_MIN;
// NULL (+ innerq_fail) if there are none.
static float * embd_row(innerq_context * c, const char * fn, int32_t i) {
    if (c == NULL) {
        innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "%s: NULL context", fn);
        return NULL;
    }
    pthread_mutex_lock(&c->lock);
    float * out = NULL;
    const int32_t row = i == INT32_MIN ? 0 : i < 0 ? i + c->n_embd_rows : i;
    if (!c->params.embeddings) {
        innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "%s: the context was made without embeddings", fn);
    } else if (c->n_embd_rows == 0) {
        innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "%s: no embeddings: nothing has been evaluated", fn);
    } else if (row < 0 || row >= c->n_embd_rows) {
        innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "%s: token %d is out of range (%d tokens)", fn, i, c->n_embd_rows);
    } else {
        out = c->embd + (size_t) row * c->model->hp.n_embd;
    }
    pthread_mutex_unlock(&c->lock);
    return out;
}

float * innerq_get_embeddings(innerq_context * c) {
    float * rows = embd_row(c, "innerq_get_embeddings", INT32_MIN);
    // pooling NONE: every token's vector, as llama_get_embeddings gives them
    return rows == NULL || c->pooling == INNERQ_POOLING_NONE ? rows : c->pooled;
}

float * innerq_get_embeddings_ith(innerq_context * c, int32_t i) {
    return embd_row(c, "innerq_get_embeddings_ith", i == INT32_MIN ? INT32_MIN + 1 : i);
}

// ---- rewinding ----

innerq_status innerq_cache_truncate(innerq_context * c, int32_t n_keep, int32_t * n_kept) {
    if (c == NULL || n_kept == NULL || n_keep < 0) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_cache_truncate: needs a context, n_kept and n_keep >= 0");
    }
    pthread_mutex_lock(&c->lock);
    const int32_t n = kv_cache_rewind_point(c->cache, n_keep, c->params.n_batch, c->params.decode_semantics);
    innerq_status st = INNERQ_OK;
    if (n < c->cache->n_past && (st = kv_cache_truncate(c->cache, n)) == INNERQ_OK) {
        c->n_logits = c->n_embd_rows = 0;  // they were the dropped tokens'
    }
    *n_kept = c->cache->n_past;
    pthread_mutex_unlock(&c->lock);
    return st;
}

// ---- states ----
//
// Layout (host byte order): magic, version, the model (state_model), the cache configuration
// (state_cache_config), the rows of logits and the logits, the cache (kv_cache_state_write),
// and an FNV-1a hash of everything before it.

#define STATE_MAGIC "INNERQST"
// Version 3 added kv_bits to the configuration and each layer's bits to the cache's part;
// version 2 states (one configuration for all layers) still load.
#define STATE_VERSION 3u
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
    out[0] = kc->type_k;
    out[1] = kc->type_v;
    if (kc->quantized) {
        const struct iq_qcache_config * q = &kc->qcfg;
        const int32_t v[STATE_N_CACHE - 2] = { q->bits_k, q->bits_v, q->axis_k, q->axis_v, q->group, q->n_sink,
                                               q->n_recent, q->mode, q->key_norm, q->score_correction, q->rope_dims,
                                               (kc->rot_k ? 1 : 0) | (kc->rot_v ? 2 : 0),
                                               (int32_t) lround(kc->kv_bits * 1000.0) };
        memcpy(out + 2, v, sizeof(v));
    }
}


static void state_write(innerq_context * c, struct kv_stream * s) {
    const uint32_t version = STATE_VERSION;
    int32_t model[STATE_N_MODEL], cache[STATE_N_CACHE];
    state_model(c->model, model);
    state_cache_config(c->cache, cache);
    kv_stream_put(s, STATE_MAGIC, 8);
    kv_stream_put(s, &version, sizeof(version));
    kv_stream_put(s, model, sizeof(model));
    kv_stream_put(s, &c->model->fingerprint, sizeof(uint64_t));
    kv_stream_put(s, cache, sizeof(cache));
    kv_stream_put(s, &c->n_logits, sizeof(int32_t));
    kv_stream_put(s, c->logits, sizeof(float) * (size_t) c->n_logits * (size_t) c->model->hp.n_vocab);
    kv_cache_state_write(c->cache, s);
}

size_t innerq_state_size(innerq_context * c) {
    if (c == NULL) {
        return 0;
    }
    pthread_mutex_lock(&c->lock);
    struct kv_stream s = {0};
    state_write(c, &s);
    pthread_mutex_unlock(&c->lock);
    return s.pos + sizeof(uint64_t);
}

innerq_status innerq_state_save(innerq_context * c, void * dst, size_t dst_size, size_t * written) {
    if (c == NULL || dst == NULL || written == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_state_save: NULL argument");
    }
    pthread_mutex_lock(&c->lock);
    struct kv_stream s = {0};
    state_write(c, &s);
    const size_t need = s.pos + sizeof(uint64_t);
    innerq_status st = INNERQ_OK;
    if (dst_size < need) {
        st = innerq_fail(INNERQ_ERR_BUFFER_TOO_SMALL, "innerq_state_save: the state needs %zu bytes, the buffer has %zu",
                         need, dst_size);
    } else {
        s = (struct kv_stream) { .w = dst };
        state_write(c, &s);
        const uint64_t h = fnv1a64(FNV1A64_INIT, dst, s.pos);
        kv_stream_put(&s, &h, sizeof(h));
    }
    *written = st == INNERQ_OK ? need : 0;
    pthread_mutex_unlock(&c->lock);
    return st;
}

// Checks a state's header against the context; on success s is at the cache's part and
// *n_logits, *logits say where the logits are.
static innerq_status state_check_header(innerq_context * c, struct kv_stream * s, int32_t * n_logits,
                                        const uint8_t ** logits, bool * with_layout) {
    char magic[8];
    uint32_t version;
    int32_t model[STATE_N_MODEL], want_model[STATE_N_MODEL], cache[STATE_N_CACHE], want_cache[STATE_N_CACHE];
    uint64_t fingerprint;
    if (!kv_stream_get(s, magic, 8) || memcmp(magic, STATE_MAGIC, 8) != 0 || !kv_stream_get(s, &version, 4)) {
        return innerq_fail(INNERQ_ERR_FORMAT, "not an innerq state (no '" STATE_MAGIC "' header)");
    }
    if (version != STATE_VERSION && version != 2) {
        return innerq_fail(INNERQ_ERR_FORMAT, "innerq state version %u; this build reads versions 2 and %u", version,
                           STATE_VERSION);
    }
    *with_layout = version >= 3;
    memset(cache, 0, sizeof(cache));  // version 2: no kv_bits (0, one configuration)
    if (!kv_stream_get(s, model, sizeof(model)) || !kv_stream_get(s, &fingerprint, sizeof(fingerprint)) ||
        !kv_stream_get(s, cache, sizeof(int32_t) * (*with_layout ? STATE_N_CACHE : STATE_N_CACHE_V2)) ||
        !kv_stream_get(s, n_logits, sizeof(int32_t))) {
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
                           types ? "configuration (group, windows, quantizer options or kv_bits)" : "type",
                           cache[0] >= 0 && cache[0] < IQ_TYPE_COUNT ? iq_type_name(cache[0]) : "?",
                           cache[1] >= 0 && cache[1] < IQ_TYPE_COUNT ? iq_type_name(cache[1]) : "?",
                           cache[kv_bits] / 1000.0, iq_type_name(want_cache[0]), iq_type_name(want_cache[1]),
                           want_cache[kv_bits] / 1000.0);
    }
    const size_t row = sizeof(float) * (size_t) c->model->hp.n_vocab;
    if (*n_logits < 0 || *n_logits > c->params.n_ctx || (size_t) *n_logits * row > s->size - s->pos) {
        return innerq_fail(INNERQ_ERR_FORMAT, "innerq state: %d rows of logits do not fit", *n_logits);
    }
    *logits = s->r + s->pos;
    s->pos += (size_t) *n_logits * row;
    return INNERQ_OK;
}

innerq_status innerq_state_load(innerq_context * c, const void * src, size_t size) {
    if (c == NULL || src == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_state_load: NULL argument");
    }
    uint64_t h;
    if (size < sizeof(h) || (memcpy(&h, (const uint8_t *) src + size - sizeof(h), sizeof(h)),
                             h != fnv1a64(FNV1A64_INIT, src, size - sizeof(h)))) {
        return innerq_fail(INNERQ_ERR_FORMAT, "innerq state of %zu bytes is damaged or cut off (its hash does not match)",
                           size);
    }
    pthread_mutex_lock(&c->lock);
    struct kv_stream s = { .r = src, .size = size - sizeof(h) };
    int32_t n_logits = 0;
    const uint8_t * logits = NULL;
    bool with_layout = false;
    innerq_status st = state_check_header(c, &s, &n_logits, &logits, &with_layout);
    if (st == INNERQ_OK) {
        st = logits_reserve(c, n_logits);
    }
    if (st == INNERQ_OK) {
        st = kv_cache_state_read(c->cache, &s, with_layout);
    }
    if (st == INNERQ_OK) {
        if (n_logits > 0) {  // a context that never decoded has no logits buffer
            memcpy(c->logits, logits, sizeof(float) * (size_t) n_logits * (size_t) c->model->hp.n_vocab);
        }
        c->n_logits = n_logits;
        c->n_embd_rows = 0;  // not part of a state
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}
