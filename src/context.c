// A context: making it, its settings, its getters, and the shorthand of sequence 0 (innerq.h).
// Batches and steps are decode.c, sequences seq.c, states state.c.
#include "context-impl.h"

#include "device.h"
#include "iq-cpu.h"
#include "status.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

const char * innerq_version(void) { return "0.1.0"; }

const char * innerq_cpu_isa(void) { return iq_cpu_features_name(iq_cpu_features_active()); }

static int32_t default_threads(void) { return innerq_default_n_threads(); }

innerq_context_params innerq_context_default_params(void) {
    innerq_context_params p = {
        .n_ctx = 4096, .n_seq_max = 1, .n_batch = 512, .n_threads = 0, .kv_k = NULL, .kv_v = NULL,
        .kv_group = 0, .kv_sink = -1, .kv_recent = -1, .kv_hybrid = true, .kv_norm = true, .kv_debias = true,
        .kv_norm_pairs = true, .kv_rot = -1, .kv_search = true, .kv_value_scales = -1, .kv_params8 = -1,
        .kv_key_levels = -1,
        .kv_bits = 0.0f, .kv_layer_bits = NULL,
        .logits_all = false, .decode_semantics = false,
        .embeddings = false, .pooling = INNERQ_POOLING_UNSPECIFIED, .kv_rewind_exact = false,
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
    return INNERQ_OK;
}

// The smallest batch whose products of the CPU's weights a split runs on the GPU (llama.cpp's 32).
#define CONTEXT_OFFLOAD_MIN_BATCH 32

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
    for (int32_t d = 0; d < model->n_dev && st == INNERQ_OK; d++) {
        st = device_backend_init(model->devs[d].dev, p.n_threads, &c->backends[d]);
    }
    if (st != INNERQ_OK) {
        innerq_context_free(c);
        return st;
    }
    c->sched = iq_sched_new(c->backends, model->n_dev);
    if (c->sched == NULL) {
        innerq_context_free(c);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "could not create the compute backend: %s", iq_error_get());
    }
    if (model->n_dev > 1) {
        // a split: the products of a prompt's batch on the CPU's layers run on the GPU (iq-sched.h)
        iq_sched_set_offload(c->sched, 0, 1, CONTEXT_OFFLOAD_MIN_BATCH);
    }
    st = kv_cache_init(&model->hp, model->device.kind, c->backends, model->n_dev, model->layer_dev, &p, p.n_ctx,
                       p.n_seq_max, &c->cache);
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
    iq_sched_free(c->sched);
    for (int32_t d = 0; d < MODEL_MAX_DEVICES; d++) {
        if (c->backends[d]) {
            iq_backend_free(c->backends[d]);
        }
    }
    free(c->logits);
    free(c->out_row);
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
int32_t innerq_n_seq_max(const innerq_context * c) { return c ? c->params.n_seq_max : -1; }
int32_t innerq_n_past(const innerq_context * c) {
    if (c == NULL) {
        return -1;
    }
    innerq_context * m = context_locked(c);
    const int32_t n = m->cache->seqs[0].n_past;
    pthread_mutex_unlock(&m->lock);
    return n;
}
uint64_t innerq_cache_size(const innerq_context * c) { return c ? kv_cache_size(c->cache) : 0; }

innerq_status innerq_cache_layer_info(innerq_context * c, int32_t layer, innerq_kv_layer_info * out) {
    if (c == NULL || out == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_cache_layer_info: NULL argument");
    }
    pthread_mutex_lock(&c->lock);
    const innerq_status st = kv_cache_layer_info(c->cache, 0, layer, out);
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
    for (int32_t d = 0; d < MODEL_MAX_DEVICES; d++) {
        if (c->backends[d] != NULL && iq_backend_is_cpu(c->backends[d])) {
            iq_backend_cpu_set_n_threads(c->backends[d], n_threads);
        }
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
    c->n_logits = c->n_out = 0;
    pthread_mutex_unlock(&c->lock);
    return INNERQ_OK;
}

innerq_status innerq_cache_clear(innerq_context * c) {
    if (c == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_cache_clear: NULL context");
    }
    pthread_mutex_lock(&c->lock);
    context_outputs_drop(c);
    const innerq_status st = kv_cache_clear(c->cache);
    pthread_mutex_unlock(&c->lock);
    return st;
}

innerq_status context_rows_reserve(float ** buf, size_t * cap, int32_t rows, int32_t width, const char * what) {
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

void context_outputs_drop(innerq_context * c) { c->n_logits = c->n_out = c->n_embd_rows = 0; }

innerq_status context_seq_check(const innerq_context * c, int32_t seq, const char * fn) {
    if (seq < 0 || seq >= c->params.n_seq_max) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "%s: sequence %d is not one of the context's (0 .. %d)", fn, seq,
                           c->params.n_seq_max - 1);
    }
    return INNERQ_OK;
}

innerq_status innerq_kv_bytes_per_token(const innerq_model * model, const innerq_context_params * params, double * bytes) {
    if (model == NULL || bytes == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_kv_bytes_per_token: NULL argument");
    }
    const innerq_context_params p = params ? *params : innerq_context_default_params();
    struct kv_config cfg;
    innerq_status st = kv_config_make(&p, &model->hp, model->device.kind, 0, 0, &cfg);
    if (st == INNERQ_OK) {
        *bytes = kv_config_bytes_per_token(&cfg, &model->hp);
    }
    return st;
}

innerq_status innerq_kv_memory_of(const innerq_model * model, const innerq_context_params * params,
                                  enum innerq_device_type device, innerq_kv_memory * out) {
    if (model == NULL || out == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_kv_memory_of: NULL argument");
    }
    const struct device_kind * dev = device_kind_of(device);
    if (dev == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_kv_memory_of: device type %d is not an "
                           "innerq_device_type", (int) device);
    }
    innerq_context_params p = params ? *params : innerq_context_default_params();
    innerq_status st = params_check(model, &p);
    struct kv_config cfg;
    uint64_t bytes = 0;
    if (st == INNERQ_OK) {
        st = kv_cache_size_of(&model->hp, dev, &p, p.n_ctx, p.n_seq_max, &cfg, &bytes);
    }
    if (st == INNERQ_OK) {
        kv_config_memory(&cfg, &model->hp, bytes, out);
    }
    return st;
}

innerq_status innerq_context_kv_memory(innerq_context * c, innerq_kv_memory * out) {
    if (c == NULL || out == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_context_kv_memory: NULL argument");
    }
    pthread_mutex_lock(&c->lock);
    kv_config_memory(&c->cache->cfg, &c->model->hp, kv_cache_size(c->cache), out);
    pthread_mutex_unlock(&c->lock);
    return INNERQ_OK;
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

// ---- rewinding sequence 0 ----

innerq_status innerq_cache_truncate(innerq_context * c, int32_t n_keep, int32_t * n_kept) {
    if (c == NULL || n_kept == NULL || n_keep < 0) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_cache_truncate: needs a context, n_kept and n_keep >= 0");
    }
    pthread_mutex_lock(&c->lock);
    const int32_t before = c->cache->seqs[0].n_past;
    const innerq_status st = kv_cache_seq_keep(c->cache, 0, n_keep, c->params.kv_rewind_exact, c->params.n_batch,
                                               c->params.decode_semantics, n_kept);
    if (st == INNERQ_OK && *n_kept < before) {
        context_outputs_drop(c);  // they were the dropped tokens'
    }
    pthread_mutex_unlock(&c->lock);
    return st;
}
