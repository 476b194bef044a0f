// The hyper-parameters of a llama model, read from its GGUF metadata by model.c and used by
// the KV cache to size itself (a header of its own, so that the cache need not know the model).
#pragma once

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
