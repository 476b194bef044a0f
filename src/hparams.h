// The hyper-parameters of a model, read from its GGUF metadata by model.c and used by the KV
// cache to size itself (a header of its own, so that the cache need not know the model).
#pragma once

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct llama_hparams {
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t n_embd;
    int32_t n_ff;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;   // ARCH.attention.key_length, default n_embd / n_head
    int32_t n_rot;      // ARCH.rope.dimension_count, default head_dim
    float rope_freq_base;
    float rms_eps;
    float kq_scale;     // the attention's scale of q.k (the graph's, and the cache's when it measures)
    // RoPE scaling (ARCH.rope.scaling.*) of the global layers, as llama.cpp's: the angle of pair i
    // divided by `factor` (linear) or, YaRN, by a factor ramped from 1 (fast pairs) to `factor`
    // (slow pairs) between the correction dims of n_ctx_orig and yarn_beta_fast / slow. factor 0: none.
    float rope_factor;
    bool rope_yarn;
    // The scale of cos and sin (YaRN's mscale times attn_factor) the global layers' RoPE applies
    // itself: 1 where it is folded into kq_scale instead (every channel rotated).
    float rope_mscale;
    int32_t n_ctx_orig;
    float yarn_beta_fast, yarn_beta_slow;
    // Sliding-window attention: a local layer's query at position p sees keys p - n_swa < p' <= p.
    // n_swa 0: none; else layer il is local iff il % swa_pattern < swa_pattern - 1 (llama.cpp's
    // convention: every swa_pattern-th layer is global; swa_pattern 0: every layer is local), local layers with rope base rope_freq_base_swa.
    int32_t n_swa;
    int32_t swa_pattern;
    const uint8_t * swa_layers;  // or, where the file lists them, 1 for each local layer (n_layer bools)
    float rope_freq_base_swa;
};

static inline bool hparams_layer_is_swa(const struct llama_hparams * hp, int32_t il) {
    if (hp->n_swa <= 0) {
        return false;
    }
    return hp->swa_layers != NULL ? hp->swa_layers[il] != 0
                                  : hp->swa_pattern == 0 || il % hp->swa_pattern < hp->swa_pattern - 1;
}
