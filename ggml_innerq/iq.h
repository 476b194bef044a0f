// The tensor library: tensors, op constructors that record a graph, graphs.
//
// Op constructors only record (op, src[], params); a backend (iq-backend.h) runs them.
// Memory for tensor structs comes from an iq_context arena; tensor data lives in backend
// buffers (weights, KV cache) or is placed by the graph allocator (iq-alloc.h).
// Every constructor returns NULL when a source is NULL or the arena is full, so a graph
// builder checks only its final result.
#pragma once

#include "iq-types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define IQ_MAX_DIMS 4
#define IQ_MAX_SRC 12  // ATTENTION / KV_STORE over a quantized cache: 5 + its 7 regions (iq-kv.h)
#define IQ_MAX_OP_PARAMS 16
#define IQ_MAX_NAME 64

enum iq_op {
    IQ_OP_NONE = 0,   // a leaf: weights, inputs, cache storage
    IQ_OP_VIEW,       // shares src[0]'s data (reshape / view); no work
    IQ_OP_GET_ROWS,   // dst[:, i] = f32(src0[:, src1[i]]); src1 is I32
    IQ_OP_RMS_NORM,   // dst = src0 / sqrt(mean(src0^2) + eps), per row; eps = param f32[0]
    IQ_OP_MUL,        // dst = src0 * src1, src1 broadcast over rows (src1->ne[0] == src0->ne[0])
    IQ_OP_ADD,        // dst = src0 + src1, src1 broadcast over rows as MUL's (a bias)
    IQ_OP_MUL_MAT,    // dst[n, m] = sum_k src0[k, n] * src1[k, m]; src0 any weight type, src1 f32
    IQ_OP_ROPE,       // see iq_rope
    IQ_OP_SWIGLU,     // dst = silu(src0) * src1
    IQ_OP_GEGLU,      // dst = gelu(src0) * src1, GELU in its tanh form (as ggml's gelu)
    IQ_OP_ATTENTION,  // see iq_attention
    IQ_OP_KV_STORE,   // see iq_kv_store
    IQ_OP_COUNT,
};

enum iq_tensor_flag {
    IQ_FLAG_INPUT = 1,   // set by the host after allocation, before compute
    IQ_FLAG_OUTPUT = 2,  // read by the host after compute: never reused by the allocator
    // a leaf D x D f32 matrix R = T H T / sqrt(D), H the Sylvester-Hadamard matrix (H_ij =
    // (-1)^popcount(i & j)) and T = diag(the signs of R's first row) (the KV cache's rotation):
    // a backend may apply it as a fast Walsh-Hadamard transform instead of a product
    IQ_FLAG_HADAMARD = 4,
};

struct iq_buffer;
struct iq_kv_layer;

struct iq_tensor {
    enum iq_type type;
    enum iq_op op;
    int64_t ne[IQ_MAX_DIMS];  // elements per dimension, ne[0] innermost
    size_t nb[IQ_MAX_DIMS];   // strides in bytes; nb[0] = block bytes, nb[1] = row bytes
    struct iq_tensor * src[IQ_MAX_SRC];
    int32_t op_params[IQ_MAX_OP_PARAMS];
    struct iq_tensor * view_src;
    size_t view_offs;
    void * data;              // address in its buffer (a device address for a GPU buffer)
    struct iq_buffer * buffer;
    int32_t flags;
    // which of a scheduler's backends holds or runs it (iq-sched.h): its context's at creation
    int32_t backend_id;
    char name[IQ_MAX_NAME];
};

// ---- context: an arena for tensor structs and graphs ----
struct iq_context;
struct iq_context * iq_context_init(size_t mem_size);
void iq_context_free(struct iq_context * ctx);
size_t iq_tensor_overhead(void);         // arena bytes one tensor takes
// The backend_id the tensors made in ctx from now on get (0 at first): a graph builder sets
// it per layer to split a graph over a scheduler's backends (iq-sched.h).
void iq_context_set_backend_id(struct iq_context * ctx, int32_t backend_id);
size_t iq_graph_overhead(int max_nodes); // arena bytes one graph takes

// ---- tensors ----
struct iq_tensor * iq_new_tensor(struct iq_context * ctx, enum iq_type type, int n_dims, const int64_t * ne);
// Gives a leaf tensor (no op, no view) a new shape of the same type with contiguous strides,
// e.g. storage re-laid out inside its buffer (the caller places it again); false (+
// iq_error_set), t unchanged, for a bad shape.
bool iq_tensor_set_shape(struct iq_tensor * t, int n_dims, const int64_t * ne);
struct iq_tensor * iq_new_tensor_1d(struct iq_context * ctx, enum iq_type type, int64_t ne0);
struct iq_tensor * iq_new_tensor_2d(struct iq_context * ctx, enum iq_type type, int64_t ne0, int64_t ne1);
struct iq_tensor * iq_new_tensor_3d(struct iq_context * ctx, enum iq_type type, int64_t ne0, int64_t ne1, int64_t ne2);
int64_t iq_nelements(const struct iq_tensor * t);
int64_t iq_nrows(const struct iq_tensor * t);
size_t iq_nbytes(const struct iq_tensor * t);
bool iq_is_contiguous(const struct iq_tensor * t);
struct iq_tensor * iq_set_name(struct iq_tensor * t, const char * fmt, ...);
void iq_set_input(struct iq_tensor * t);
void iq_set_output(struct iq_tensor * t);
float iq_get_op_param_f32(const struct iq_tensor * t, int i);
void iq_set_op_param_f32(struct iq_tensor * t, int i, float v);

// ---- ops ----
// Views share data with their source; ne/offset in elements of a contiguous source.
struct iq_tensor * iq_reshape_2d(struct iq_context * ctx, struct iq_tensor * a, int64_t ne0, int64_t ne1);
struct iq_tensor * iq_reshape_3d(struct iq_context * ctx, struct iq_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2);
// The columns [i0, i0 + n) of a 2-D tensor, i.e. rows of ne[0] elements.
struct iq_tensor * iq_view_rows(struct iq_context * ctx, struct iq_tensor * a, int64_t i0, int64_t n);

struct iq_tensor * iq_get_rows(struct iq_context * ctx, struct iq_tensor * a, struct iq_tensor * ids);
struct iq_tensor * iq_rms_norm(struct iq_context * ctx, struct iq_tensor * a, float eps);
struct iq_tensor * iq_mul(struct iq_context * ctx, struct iq_tensor * a, struct iq_tensor * b);
struct iq_tensor * iq_add(struct iq_context * ctx, struct iq_tensor * a, struct iq_tensor * b);
struct iq_tensor * iq_mul_mat(struct iq_context * ctx, struct iq_tensor * w, struct iq_tensor * x);
struct iq_tensor * iq_swiglu(struct iq_context * ctx, struct iq_tensor * gate, struct iq_tensor * up);
struct iq_tensor * iq_geglu(struct iq_context * ctx, struct iq_tensor * gate, struct iq_tensor * up);

// RoPE, NORMAL mode (rotates adjacent pairs 2i, 2i+1 of the first n_rot channels of each head;
// the channels from n_rot on are copied): a: f32 [head_dim, n_head, n_tokens]; pos: I32
// [n_tokens]; freq_factors: f32 [n_rot/2] or NULL (Llama 3 rope_freqs: theta_i is divided by
// freq_factors[i]). theta_i = pos * freq_base^(-2i/n_rot); cos and sin times mscale (YaRN's
// and LongRoPE's magnitude factor, ggml_rope_ext's attn_factor; 1: none).
struct iq_tensor * iq_rope(struct iq_context * ctx, struct iq_tensor * a, struct iq_tensor * pos,
                           struct iq_tensor * freq_factors, int n_rot, float freq_base, float mscale);

// Attention of a batch of queries over one layer's KV cache plus the batch itself, for the
// sequences of a step (iq-kv.h). q: f32 [head_dim, n_head, n_tokens]; k, v: f32 [head_dim,
// n_kv_head, n_tokens] (the batch's own keys/values, unquantized); seqs: the step's I32 rows
// (struct iq_kv_seq: a sequence's tokens are the batch's rows [token0, token0 + n_tokens), one
// sequence after the other); pages: the page table, I32 [n_table, layer->n_slots].
// Token i of sequence s (at position s.n_past + i - s.token0) attends to the s.n_past tokens the
// sequence holds (read as stored, per its cache type) and to its own batch tokens up to i.
// n_head is a multiple of n_kv_head (GQA: query head h reads KV head h / (n_head / n_kv_head)).
// Returns f32 [head_dim * n_head, n_tokens]. scale is applied to q.k. op_params take the
// layer's static configuration; its storage, seqs and pages are sources.
struct iq_tensor * iq_attention(struct iq_context * ctx, struct iq_tensor * q, struct iq_tensor * k,
                                struct iq_tensor * v, const struct iq_kv_layer * layer, struct iq_tensor * seqs,
                                struct iq_tensor * pages, float scale);
// Decode semantics for an attention op (docs/DESIGN.md 3.4): query i reads batch tokens 0..i-1 of
// its sequence as the cache would store them (rounded through the cache type; the windows'
// f16 for the quantized types) and only its own token unquantized, so each query gets what
// decoding the batch one token at a time gives, as long as the cache does not flush inside the
// batch (the caller splits batches at flushes).
void iq_attention_set_decode_semantics(struct iq_tensor * attention, bool on);

// Stores the batch's k, v (as passed to iq_attention) of each sequence of seqs after the tokens
// it holds and, for a quantized cache, carries out its flush plan. Returns a view of `after` so
// that whatever consumes `after` runs after the store (pass the attention output).
struct iq_tensor * iq_kv_store(struct iq_context * ctx, struct iq_tensor * after, struct iq_tensor * k,
                               struct iq_tensor * v, const struct iq_kv_layer * layer, struct iq_tensor * seqs,
                               struct iq_tensor * pages);

// ---- graphs ----
struct iq_cgraph {
    int n_nodes, max_nodes;
    struct iq_tensor ** nodes;  // ops in execution order (topological)
    int n_leafs;
    struct iq_tensor ** leafs;  // tensors with op NONE that the nodes read
};
struct iq_cgraph * iq_new_graph(struct iq_context * ctx, int max_nodes);
// Adds t and everything it depends on; returns false if the graph is full or t is NULL.
bool iq_graph_expand(struct iq_cgraph * g, struct iq_tensor * t);

const char * iq_op_name(enum iq_op op);

// ---- errors: one thread-local message shared by the whole library ----
void iq_error_set(const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
const char * iq_error_get(void);

#ifdef __cplusplus
}
#endif
