// The gemma3 architecture (Gemma 3): the llama block with the embeddings scaled by
// sqrt(n_embd), per-head q/k norms, a norm after the attention and after the feed-forward
// (before each joins the residual stream), a GELU-gated feed-forward, and local layers of
// sliding-window attention (RoPE base 10000) between global ones. Its norms are RMS norms
// times the file's weights: llama.cpp's converter stores Gemma's (1 + w) as the weight.
#include "model-impl.h"

#include "status.h"

#include <stdio.h>

static bool gemma3_build_graph(struct model_graph * b) {
    const innerq_model * m = b->model;
    struct iq_context * ctx = b->ctx;
    struct iq_tensor * x = graph_inputs(b);  // [n_embd, n_tokens], times sqrt(n_embd)
    for (int32_t il = 0; il < m->hp.n_layer; il++) {
        const struct llama_layer * L = &m->layers[il];
        graph_layer(b, il);

        // self-attention (the query's 1/sqrt(key_length) is the attention's scale)
        struct iq_tensor * h = graph_norm(b, x, L->attn_norm);
        struct iq_tensor * q, * k, * v;
        graph_qkv(b, L, h, &q, &k, &v);
        q = graph_rope(b, il, graph_norm(b, q, L->q_norm));
        k = graph_rope(b, il, graph_norm(b, k, L->k_norm));
        struct iq_tensor * a = graph_attention(b, il, q, k, v);
        graph_keep_outputs(b, il, &a, &x);
        x = iq_add(ctx, x, graph_norm(b, iq_mul_mat(ctx, L->wo, a), L->attn_post_norm));

        // feed-forward (GELU-gated)
        h = graph_norm(b, x, L->ffn_norm);
        struct iq_tensor * ff = iq_geglu(ctx, iq_mul_mat(ctx, L->ffn_gate, h), iq_mul_mat(ctx, L->ffn_up, h));
        x = iq_add(ctx, x, graph_norm(b, iq_mul_mat(ctx, L->ffn_down, ff), L->ffn_post_norm));
    }
    return graph_output(b, x);
}

// As llama.cpp: a sliding window if the file gives one, every 6th layer global unless
// sliding_window_pattern says otherwise (a period, or a bool per layer), local layers with
// RoPE base freq_base_swa (10000).
static innerq_status gemma3_hparams(const struct gguf_file * f, const char * arch, struct llama_hparams * hp) {
    innerq_status st = INNERQ_OK;
    char key[96];
    uint32_t n_swa = 0, pattern = 6;
    snprintf(key, sizeof(key), "%s.attention.sliding_window", arch);
    gguf_get_u32(f, key, &n_swa, &st);
    snprintf(key, sizeof(key), "%s.attention.sliding_window_pattern", arch);
    const struct gguf_kv * kv = gguf_find_kv(f, key);
    if (kv != NULL && kv->type == GGUF_TYPE_ARRAY) {
        if (kv->arr_type != GGUF_TYPE_BOOL || kv->arr_n != (uint64_t) hp->n_layer) {
            return innerq_fail(INNERQ_ERR_FORMAT, "'%s' must be a period or %d bools, one per layer", key, hp->n_layer);
        }
        hp->swa_layers = kv->arr_data;
    } else {
        gguf_get_u32(f, key, &pattern, &st);
    }
    hp->rope_freq_base_swa = 10000.0f;
    snprintf(key, sizeof(key), "%s.rope.freq_base_swa", arch);
    gguf_get_f32(f, key, &hp->rope_freq_base_swa, &st);
    snprintf(key, sizeof(key), "%s.final_logit_softcapping", arch);
    float softcap = 0.0f;
    gguf_get_f32(f, key, &softcap, &st);
    if (st != INNERQ_OK) {
        return st;
    }
    if (softcap != 0.0f) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "gemma3: final_logit_softcapping (%g) is not supported", softcap);
    }
    if (n_swa > (1u << 24) || pattern > 1024 || !(hp->rope_freq_base_swa > 0.0f) || !isfinite(hp->rope_freq_base_swa)) {
        return innerq_fail(INNERQ_ERR_FORMAT, "gemma3: sliding window %u, pattern %u or freq_base_swa %g out of range",
                           n_swa, pattern, hp->rope_freq_base_swa);
    }
    hp->n_swa = (int32_t) n_swa;
    hp->swa_pattern = (int32_t) pattern;
    // llama.cpp: 27B (62 layers) scales the query by 1/sqrt(n_embd / n_head), the others by 1/sqrt(key_length)
    hp->kq_scale = 1.0f / sqrtf((float) (hp->n_layer == 62 ? hp->n_embd / hp->n_head : hp->head_dim));
    return INNERQ_OK;
}

static const struct layer_tensor gemma3_layer[] = {
    LAYER_TENSOR("attn_norm", attn_norm, LD_EMBD, LD_NONE, LT_F32),
    LAYER_TENSOR("attn_q", wq, LD_EMBD, LD_Q, LT_HEADS),
    LAYER_TENSOR("attn_k", wk, LD_EMBD, LD_KV, LT_HEADS),
    LAYER_TENSOR("attn_v", wv, LD_EMBD, LD_KV, 0),
    LAYER_TENSOR("attn_q_norm", q_norm, LD_HEAD, LD_NONE, LT_F32 | LT_HEADS),
    LAYER_TENSOR("attn_k_norm", k_norm, LD_HEAD, LD_NONE, LT_F32 | LT_HEADS),
    LAYER_TENSOR("attn_output", wo, LD_Q, LD_EMBD, 0),
    LAYER_TENSOR("post_attention_norm", attn_post_norm, LD_EMBD, LD_NONE, LT_F32),
    LAYER_TENSOR("ffn_norm", ffn_norm, LD_EMBD, LD_NONE, LT_F32),
    LAYER_TENSOR("ffn_gate", ffn_gate, LD_EMBD, LD_FF, 0),
    LAYER_TENSOR("ffn_up", ffn_up, LD_EMBD, LD_FF, 0),
    LAYER_TENSOR("ffn_down", ffn_down, LD_FF, LD_EMBD, 0),
    LAYER_TENSOR("post_ffw_norm", ffn_post_norm, LD_EMBD, LD_NONE, LT_F32),
};

const struct model_arch model_arch_gemma3 = {
    .name = "gemma3",
    .rope_neox = true,
    .embd_scale = true,
    .layer = gemma3_layer,
    .n_layer_tensor = sizeof(gemma3_layer) / sizeof(gemma3_layer[0]),
    .hparams = gemma3_hparams,
    .build = gemma3_build_graph,
};
