// The architectures: what each reads from a GGUF file beyond the common hyper-parameters, the
// weights of its blocks, and its forward graph (one file each, model-<arch>.c, as llama.cpp's
// src/models/). The graph pieces every architecture shares (inputs, attention over the KV
// cache, the output head) are model-graph.c's.
#pragma once

#include "kv-cache.h"
#include "model.h"

#include <stddef.h>

// The sizes a block's tensor is given in (model_layer_dim turns them into numbers).
enum layer_dim {
    LD_NONE = 0,  // no second dimension: a vector
    LD_EMBD,      // n_embd
    LD_Q,         // n_head * head_dim
    LD_KV,        // n_head_kv * head_dim
    LD_FF,        // n_ff
    LD_HEAD,      // head_dim
};

enum layer_tensor_flag {
    LT_OPTIONAL = 1,  // NULL when the file does not have it
    LT_F32 = 2,       // read element-wise by the ops (norms, biases): must be f32
    LT_HEADS = 4,     // rows (or elements) of q or k heads: reordered when the RoPE pairs are NEOX's
};

// One weight of a block: the file's blk.N.<suffix>.weight (or .bias), of ne0 columns and the
// rows rows[0] + rows[1] + rows[2] (a fused tensor: this weight is its part `part`).
struct layer_tensor {
    const char * suffix;
    size_t field;  // offsetof(struct llama_layer, the weight)
    enum layer_dim ne0;
    enum layer_dim rows[3];
    int part;
    unsigned flags;
};
#define LAYER_TENSOR(suffix, field, ne0, rows, flags) { suffix, offsetof(struct llama_layer, field), ne0, { rows }, 0, flags }

// A forward graph being built (model_build_graph's arguments and the graph's inputs).
struct model_graph {
    const innerq_model * model;
    struct kv_cache * cache;
    struct iq_context * ctx;
    struct iq_cgraph * g;
    int32_t n_tokens, n_seq, n_outputs;
    bool decode_semantics, embeddings;
    struct llama_graph * out;
};

struct model_arch {
    const char * name;  // general.architecture
    // RoPE on the pairs (i, i + n_rot/2) (llama.cpp's NEOX mode): the loader reorders the rows of
    // q and k heads (LT_HEADS) so that pair i sits at (2i, 2i+1), where NORMAL mode rotates it.
    // q.k is the same for any order of the channels taken alike in both, so the graph, the
    // kernels and the cache see one RoPE convention.
    bool rope_neox;
    bool embd_scale;  // the token embeddings times sqrt(n_embd) (gemma)
    const struct layer_tensor * layer;  // the weights of a block
    int n_layer_tensor;
    // what the architecture reads besides the common hyper-parameters (NULL: nothing)
    innerq_status (*hparams)(const struct gguf_file * f, const char * arch, struct llama_hparams * hp);
    // the forward graph: false (+ message) if the context is too small
    bool (*build)(struct model_graph * b);
};

extern const struct model_arch model_arch_llama;
extern const struct model_arch model_arch_qwen2;
extern const struct model_arch model_arch_qwen3;
extern const struct model_arch model_arch_gemma3;
extern const struct model_arch model_arch_phi3;

// ---- graph pieces (model-graph.c) ----

// The graph and its inputs; returns the batch's token embeddings f32 [n_embd, n_tokens] (times
// the model's embd_scale if it has one).
struct iq_tensor * graph_inputs(struct model_graph * b);
// What follows is layer il's: its nodes run on the layer's device (iq-sched.h).
void graph_layer(struct model_graph * b, int32_t il);
// rms_norm(x) * w, per row of x.
struct iq_tensor * graph_norm(const struct model_graph * b, struct iq_tensor * x, struct iq_tensor * w);
// The q, k, v products of h (plus their biases where the layer has them), as heads f32
// [head_dim, n_heads, n_tokens].
void graph_qkv(struct model_graph * b, const struct llama_layer * L, struct iq_tensor * h, struct iq_tensor ** q,
               struct iq_tensor ** k, struct iq_tensor ** v);
// RoPE of heads t at the batch's positions with layer il's base.
struct iq_tensor * graph_rope(const struct model_graph * b, int32_t il, struct iq_tensor * t);
// Attention of layer il over its KV cache, storing k and v: f32 [n_head * head_dim, n_tokens].
struct iq_tensor * graph_attention(struct model_graph * b, int32_t il, struct iq_tensor * q, struct iq_tensor * k,
                                   struct iq_tensor * v);
// In the last layer, the rows whose logits are wanted go on alone (a: the attention's output,
// x: the residual stream).
void graph_keep_outputs(const struct model_graph * b, int32_t il, struct iq_tensor ** a, struct iq_tensor ** x);
// The output norm and head: the logits (and the embeddings if asked); fills b->out.
bool graph_output(struct model_graph * b, struct iq_tensor * x);
