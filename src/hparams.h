// The hyper-parameters of a llama model, read from its GGUF metadata by model.c and used by
// the KV cache to size itself (a header of its own, so that the cache need not know the model).
#pragma once

#include <math.h>
#include <stdint.h>

struct llama_hparams {
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t n_embd;
    int32_t n_ff;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;   // n_embd / n_head
    int32_t n_rot;      // llama.rope.dimension_count, default head_dim
    float rope_freq_base;
    float rms_eps;
};

// The attention's scale of q.k (the graph's, and the cache's when it measures attention itself).
static inline float llama_kq_scale(const struct llama_hparams * hp) { return 1.0f / sqrtf((float) hp->head_dim); }
