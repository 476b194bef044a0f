// A model: hyper-parameters and weights read from a GGUF file, and the graph of one forward
// pass over a batch of tokens. The architectures (model-impl.h) share these structs; a weight
// an architecture does not have is NULL.
#pragma once

#include "gguf.h"
#include "device.h"
#include "hparams.h"
#include "innerq.h"
#include "iq-backend.h"

struct innerq_vocab;
struct kv_cache;

struct model_arch;

struct llama_layer {
    struct iq_tensor * attn_norm;
    struct iq_tensor * wq, * wk, * wv, * wo;
    struct iq_tensor * bq, * bk, * bv;           // qwen2
    struct iq_tensor * q_norm, * k_norm;         // qwen3, gemma3: per head, before RoPE
    struct iq_tensor * attn_post_norm;           // gemma3
    struct iq_tensor * ffn_norm;
    struct iq_tensor * ffn_gate, * ffn_up, * ffn_down;
    struct iq_tensor * ffn_post_norm;            // gemma3
};

#define MODEL_MAX_DEVICES 2  // the CPU and a GPU

// A device the model runs on, and its weights there.
struct model_device {
    struct device dev;
    iq_backend * backend;           // the backend that owns the buffers below
    iq_buffer * weights;            // this device's weights copied (device memory)
    iq_buffer ** mapped;            // host memory: each file's data section, used in place ([n_parts])
    iq_buffer * own;                // what is not the file's bytes: reordered q/k rows, constants
    uint64_t n_bytes;               // the weights' bytes it holds
    int32_t n_layer;                // the layers that run on it
};

struct innerq_model {
    const struct model_arch * arch;
    struct llama_hparams hp;
    struct gguf_file * gguf;
    struct innerq_vocab * vocab;
    // Where the model runs: one device (devs[0]), or, with 0 < n_gpu_layers <= n_layer, the CPU
    // (devs[0]: the input and output layers and the first layers) and the GPU (devs[1]: the last
    // n_gpu_layers layers), as llama.cpp splits a model. `device` is the GPU where there is one
    // (the KV cache takes its defaults).
    struct device device;
    struct model_device devs[MODEL_MAX_DEVICES];
    int32_t n_dev;
    int32_t * layer_dev;            // [n_layer]: the index in devs of each layer's device
    int32_t dev_in, dev_out;        // the token embeddings' and the output head's
    struct iq_context * ctx;        // tensor structs of the weights
    struct iq_tensor * tok_embd;
    struct iq_tensor * output_norm;
    struct iq_tensor * output;      // == tok_embd when tied
    struct iq_tensor * rope_freqs;  // divisors of the RoPE angles (rope_freqs.weight and rope scaling), or NULL
    struct iq_tensor * rope_freqs_swa;  // those of the sliding-window layers: rope_freqs.weight only (llama.cpp)
    // LongRoPE (Phi-3.5, Phi-3 128K): divisors for contexts up to the original one and beyond it,
    // used where there is no rope_freqs (llama.cpp's choice), or NULL
    struct iq_tensor * rope_short, * rope_long;
    struct iq_tensor * embd_scale;  // f32 [n_embd] the token embeddings are multiplied by (gemma3), or NULL
    struct llama_layer * layers;
    uint64_t n_params;
    uint64_t n_bytes;
    bool vocab_only;                // hyper-parameters and tokenizer only: no weights, no backend
    uint64_t fingerprint;           // XXH64 of the model file (saved states name their model by it)
    int32_t pooling;                // the GGUF's llama.pooling_type, or INNERQ_POOLING_NONE
    char desc[128];
};

const struct innerq_vocab * model_vocab(const innerq_model * model);

// FNV-1a, 64 bits, continued from h (FNV1A64_INIT to start): the check of a saved state.
#define FNV1A64_INIT 0xcbf29ce484222325ull
uint64_t fnv1a64(uint64_t h, const void * data, size_t n);

// Inputs of one forward graph, set by the caller after allocation.
struct llama_graph {
    struct iq_cgraph * graph;
    struct iq_tensor * tokens;     // I32 [n_tokens]
    struct iq_tensor * pos;        // I32 [n_tokens]
    struct iq_tensor * out_ids;    // I32 [n_outputs]: rows of the batch whose logits are wanted
    struct iq_tensor * seqs;       // I32 [IQ_KV_S_COUNT, n_seq]: the step's sequences (ggml_innerq/iq-kv.h)
    struct iq_tensor * logits;     // f32 [n_vocab, n_outputs]
    struct iq_tensor * embd;       // f32 [n_embd, n_tokens]: every token's final hidden state, or NULL
    // the caller's array of n_layer, or NULL: each layer's queries as attention gets them, f32
    // [head_dim, n_head, n_tokens], kept as outputs (the KV cache's automatic layout measures with them)
    struct iq_tensor ** q;
    // the caller's arrays of n_layer, or NULL: a measuring step (the automatic layout's, decode.c),
    // whose graph stores nothing in the cache and keeps each layer's keys and values as the cache
    // would take them (rotated, f32 [head_dim, n_kv_head, n_tokens]) as outputs
    struct iq_tensor ** k, ** v;
};

// Nodes of a forward graph per layer at most (the graph's and its context's size).
#define MODEL_GRAPH_NODES_PER_LAYER 48

// Builds the forward graph of a step of n_tokens of n_seq sequences over the cache (their rows
// are the input seqs: kv_cache_step), its attention with decode semantics if asked
// (iq_attention_set_decode_semantics); with embeddings, every token's hidden state after the
// output norm is an output too. Returns false (+ error message) if ctx is too small.
bool model_build_graph(const innerq_model * model, struct kv_cache * cache, struct iq_context * ctx,
                       int32_t n_tokens, int32_t n_seq, int32_t n_outputs, bool decode_semantics, bool embeddings,
                       struct llama_graph * out);
// Builds the graph of a step that stores n_tokens of one sequence (its row: the input seqs) in
// every layer of the cache from given keys and values: those of a measuring step (decode.c),
// whose tensors out->k, out->v hold on entry (their shapes are read) and which get the graph's
// inputs in their place (f32 [head_dim, n_kv_head, n_tokens], rotated as the cache takes them).
// Returns false (+ error message) if ctx is too small.
bool model_build_store_graph(const innerq_model * model, struct kv_cache * cache, struct iq_context * ctx,
                             int32_t n_tokens, struct llama_graph * out);
