// A context's insides, for its files: context.c (making it, settings, the shorthand of one
// sequence), decode.c (batches and steps), state.c (states), seq.c (sequences).
#pragma once

#include "innerq.h"

#include "iq-sched.h"
#include "kv-cache.h"
#include "model.h"

#include <pthread.h>

struct innerq_context {
    innerq_model * model;
    innerq_context_params params;
    iq_backend * backends[MODEL_MAX_DEVICES];  // the compute backend of each of the model's devices
    iq_sched * sched;                          // a step's graph over them
    struct kv_cache * cache;
    // The logits of the last decode call: n_logits rows, and for each of its n_out tokens the
    // row of its logits (-1: none). innerq_decode indexes rows, innerq_decode_batch tokens
    // (by_token).
    float * logits;          // [n_logits, n_vocab]
    size_t logits_cap;       // floats allocated
    int32_t n_logits;
    int32_t * out_row;       // [n_out]
    int32_t n_out, out_cap;
    bool by_token;
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

// Grows *buf to rows x width floats (*cap: floats allocated).
innerq_status context_rows_reserve(float ** buf, size_t * cap, int32_t rows, int32_t width, const char * what);
// The logits and embeddings of the last call are gone (the tokens they were for are).
void context_outputs_drop(innerq_context * c);
// Whether seq is a sequence of the context (else innerq_fail with fn's name).
innerq_status context_seq_check(const innerq_context * c, int32_t seq, const char * fn);
