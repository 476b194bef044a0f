// The llama architecture (Llama 2 / 3, SmolLM, Mistral): the transformer block top to bottom,
// as llama2.c's forward. qwen2, qwen3 and phi3 are this block with other weights (their files).
#include "model-impl.h"

#define LLAMA_ATTN_TENSORS                                                        \
    LAYER_TENSOR("attn_norm", attn_norm, LD_EMBD, LD_NONE, LT_F32),              \
    LAYER_TENSOR("attn_q", wq, LD_EMBD, LD_Q, LT_HEADS),                         \
    LAYER_TENSOR("attn_k", wk, LD_EMBD, LD_KV, LT_HEADS),                        \
    LAYER_TENSOR("attn_v", wv, LD_EMBD, LD_KV, 0),                               \
    LAYER_TENSOR("attn_output", wo, LD_Q, LD_EMBD, 0)
#define LLAMA_FFN_TENSORS                                                         \
    LAYER_TENSOR("ffn_norm", ffn_norm, LD_EMBD, LD_NONE, LT_F32),                \
    LAYER_TENSOR("ffn_gate", ffn_gate, LD_EMBD, LD_FF, 0),                       \
    LAYER_TENSOR("ffn_up", ffn_up, LD_EMBD, LD_FF, 0),                           \
    LAYER_TENSOR("ffn_down", ffn_down, LD_FF, LD_EMBD, 0)

static bool llama_build_graph(struct model_graph * b) {
    const innerq_model * m = b->model;
    struct iq_context * ctx = b->ctx;
    struct iq_tensor * x = graph_inputs(b);  // [n_embd, n_tokens]
    for (int32_t il = 0; il < m->hp.n_layer; il++) {
        const struct llama_layer * L = &m->layers[il];
        graph_layer(b, il);

        // self-attention
        struct iq_tensor * h = graph_norm(b, x, L->attn_norm);
        struct iq_tensor * q, * k, * v;
        graph_qkv(b, L, h, &q, &k, &v);
        if (L->q_norm != NULL) {
            // qwen3: each head RMS-normed before RoPE
            q = graph_norm(b, q, L->q_norm);
            k = graph_norm(b, k, L->k_norm);
        }
        struct iq_tensor * a = graph_attention(b, il, graph_rope(b, il, q), graph_rope(b, il, k), v);
        graph_keep_outputs(b, il, &a, &x);
        x = iq_add(ctx, x, iq_mul_mat(ctx, L->wo, a));

        // feed-forward (SwiGLU)
        h = graph_norm(b, x, L->ffn_norm);
        struct iq_tensor * ff = iq_swiglu(ctx, iq_mul_mat(ctx, L->ffn_gate, h), iq_mul_mat(ctx, L->ffn_up, h));
        x = iq_add(ctx, x, iq_mul_mat(ctx, L->ffn_down, ff));
    }
    return graph_output(b, x);
}

// An architecture of the llama block: its name, its RoPE pairs, its block's tensors.
#define LLAMA_FAMILY(arch, neox, table)                                                                      \
    { .name = arch, .rope_neox = neox, .layer = table, .n_layer_tensor = sizeof(table) / sizeof(table[0]), \
      .build = llama_build_graph }

static const struct layer_tensor llama_layer[] = { LLAMA_ATTN_TENSORS, LLAMA_FFN_TENSORS };
const struct model_arch model_arch_llama = LLAMA_FAMILY("llama", false, llama_layer);

// qwen2 (Qwen2, Qwen2.5): biases on q, k and v; RoPE on NEOX pairs.
static const struct layer_tensor qwen2_layer[] = {
    LLAMA_ATTN_TENSORS,
    { "attn_q.bias", offsetof(struct llama_layer, bq), LD_Q, { LD_NONE }, 0, LT_F32 | LT_HEADS },
    { "attn_k.bias", offsetof(struct llama_layer, bk), LD_KV, { LD_NONE }, 0, LT_F32 | LT_HEADS },
    { "attn_v.bias", offsetof(struct llama_layer, bv), LD_KV, { LD_NONE }, 0, LT_F32 },
    LLAMA_FFN_TENSORS,
};

const struct model_arch model_arch_qwen2 = LLAMA_FAMILY("qwen2", true, qwen2_layer);

// qwen3 (dense Qwen3): an RMS norm over each q and k head before RoPE; NEOX pairs.
static const struct layer_tensor qwen3_layer[] = {
    LLAMA_ATTN_TENSORS,
    LAYER_TENSOR("attn_q_norm", q_norm, LD_HEAD, LD_NONE, LT_F32 | LT_HEADS),
    LAYER_TENSOR("attn_k_norm", k_norm, LD_HEAD, LD_NONE, LT_F32 | LT_HEADS),
    LLAMA_FFN_TENSORS,
};

const struct model_arch model_arch_qwen3 = LLAMA_FAMILY("qwen3", true, qwen3_layer);

// phi3 (Phi-3, Phi-4-mini): q, k, v fused in one matrix, and gate and up in another (gate
// first); NEOX pairs. Each part is a weight of its own over the fused tensor's rows.
static const struct layer_tensor phi3_layer[] = {
    LAYER_TENSOR("attn_norm", attn_norm, LD_EMBD, LD_NONE, LT_F32),
    { "attn_qkv", offsetof(struct llama_layer, wq), LD_EMBD, { LD_Q, LD_KV, LD_KV }, 0, LT_HEADS },
    { "attn_qkv", offsetof(struct llama_layer, wk), LD_EMBD, { LD_Q, LD_KV, LD_KV }, 1, LT_HEADS },
    { "attn_qkv", offsetof(struct llama_layer, wv), LD_EMBD, { LD_Q, LD_KV, LD_KV }, 2, 0 },
    LAYER_TENSOR("attn_output", wo, LD_Q, LD_EMBD, 0),
    LAYER_TENSOR("ffn_norm", ffn_norm, LD_EMBD, LD_NONE, LT_F32),
    { "ffn_up", offsetof(struct llama_layer, ffn_gate), LD_EMBD, { LD_FF, LD_FF }, 0, 0 },
    { "ffn_up", offsetof(struct llama_layer, ffn_up), LD_EMBD, { LD_FF, LD_FF }, 1, 0 },
    LAYER_TENSOR("ffn_down", ffn_down, LD_FF, LD_EMBD, 0),
};

const struct model_arch model_arch_phi3 = LLAMA_FAMILY("phi3", true, phi3_layer);
