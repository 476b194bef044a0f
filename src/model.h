// The llama architecture: hyper-parameters and weights read from a GGUF file, and the graph
// of one forward pass over a batch of tokens.
#pragma once

#include "gguf.h"
#include "hparams.h"
#include "innerq.h"
#include "iq-backend.h"

struct innerq_vocab;
struct kv_cache;

struct llama_layer {
    struct iq_tensor * attn_norm;
    struct iq_tensor * wq, * wk, * wv, * wo;
    struct iq_tensor * ffn_norm;
    struct iq_tensor * ffn_gate, * ffn_up, * ffn_down;
};

struct innerq_model {
    struct llama_hparams hp;
    struct gguf_file * gguf;
    struct innerq_vocab * vocab;
    bool gpu;                       // weights, cache and compute on the CUDA device
    iq_backend * backend;           // the backend that owns the weights
    iq_buffer * weights;            // wraps the mapped file, or a copy on the device
    struct iq_context * ctx;        // tensor structs of the weights
    struct iq_tensor * tok_embd;
    struct iq_tensor * output_norm;
    struct iq_tensor * output;      // == tok_embd when tied
    struct iq_tensor * rope_freqs;  // NULL unless the file has rope_freqs.weight
    struct llama_layer * layers;
    uint64_t n_params;
    uint64_t n_bytes;
    char desc[128];
};

const struct innerq_vocab * model_vocab(const innerq_model * model);

// Inputs of one forward graph, set by the caller after allocation.
struct llama_graph {
    struct iq_cgraph * graph;
    struct iq_tensor * tokens;     // I32 [n_tokens]
    struct iq_tensor * pos;        // I32 [n_tokens]
    struct iq_tensor * out_ids;    // I32 [n_outputs]: rows of the batch whose logits are wanted
    struct iq_tensor * logits;     // f32 [n_vocab, n_outputs]
};

// Builds the forward graph of a batch of n_tokens at position batch->n_past, over the cache as
// batch describes it (kv_cache_batch), its attention with decode semantics if asked
// (iq_attention_set_decode_semantics). Returns false (+ error message) if ctx is too small.
bool model_build_graph(const innerq_model * model, struct kv_cache * cache, struct iq_context * ctx,
                       int32_t n_tokens, const struct iq_kv_batch * batch, int32_t n_outputs,
                       bool decode_semantics, struct llama_graph * out);
