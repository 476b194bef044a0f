/* innerq: LLM inference with an InnerQ-quantized KV cache. The public C API.
 *
 * Handles are opaque; each *_init / *_load has a *_free. Every function that can fail
 * returns an innerq_status (or a value that can say "failed") and sets a message that
 * innerq_last_error() returns (thread-local, valid until the next failing call on that
 * thread). Nothing here aborts the process on bad input.
 *
 * This header is also read by the Python binding (cffi): keep it free of macros in
 * declarations, and keep each declaration on lines of its own.
 */
#ifndef INNERQ_H
#define INNERQ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t innerq_token;
typedef struct innerq_model innerq_model;
typedef struct innerq_context innerq_context;
typedef struct innerq_sampler innerq_sampler;
typedef struct innerq_detokenizer innerq_detokenizer;

typedef enum innerq_status {
    INNERQ_OK = 0,
    INNERQ_ERR_INVALID_ARGUMENT = 1, /* a NULL handle, a value out of range, an unknown name */
    INNERQ_ERR_IO = 2,               /* a file could not be opened or read */
    INNERQ_ERR_FORMAT = 3,           /* a malformed or inconsistent GGUF file */
    INNERQ_ERR_UNSUPPORTED = 4,      /* a valid file or request this build can't serve */
    INNERQ_ERR_OUT_OF_MEMORY = 5,
    INNERQ_ERR_CONTEXT_FULL = 6,     /* the tokens don't fit in n_ctx */
    INNERQ_ERR_BUFFER_TOO_SMALL = 7, /* the output array is too small; the needed size is returned */
    INNERQ_ERR_BACKEND = 8,          /* the compute backend failed */
    INNERQ_ERR_STATE_MISMATCH = 9,   /* a saved state of another model or cache configuration */
} innerq_status;

const char * innerq_last_error(void);
const char * innerq_status_name(innerq_status status);
const char * innerq_version(void);
/* The CPU instruction set the kernels use: "scalar", "avx2" or "avx512". */
const char * innerq_cpu_isa(void);
/* CUDA devices this build can use; -1 when it was built without the CUDA backend. */
int32_t innerq_cuda_device_count(void);

/* ---- devices ---- */

/* The kinds of device a model, its cache and its compute can live on. */
enum innerq_device_type {
    INNERQ_DEVICE_CPU = 0,
    INNERQ_DEVICE_GPU = 1, /* a CUDA device */
};
typedef struct innerq_device_info {
    enum innerq_device_type type;
    char name[16];                       /* "CPU", "CUDA0", "CUDA1", ... */
    char description[128];               /* the processor or the GPU as the system names it ("" unknown) */
    uint64_t memory_free, memory_total;  /* bytes (0: unknown) */
    int32_t kv_group;                    /* the quantized cache's group by default (kv_group 0) */
    int32_t kv_align;                    /* bytes the cache's regions are aligned to in its buffers */
} innerq_device_info;
/* The devices present: the CPU (always device 0), then each CUDA device this build can use. */
int32_t innerq_device_count(void);
/* Device i, 0 <= i < innerq_device_count(). */
innerq_status innerq_device_get(int32_t i, innerq_device_info * out);

/* ---- models ---- */

typedef struct innerq_model_params {
    bool use_mmap;          /* map the file (weights used in place); else read it into memory */
    int32_t n_gpu_layers;   /* 0: CPU only; -1 or > the layer count: the whole model on the GPU
                               (weights, KV cache, compute); 1 .. the layer count: the last
                               n_gpu_layers layers with their KV cache on the GPU, the rest of the
                               model (the input and output layers too) on the CPU, as llama.cpp's
                               -ngl N (innerq_model_get_offload says what went where). On a build
                               or machine without a GPU any value runs on the CPU with one
                               warning line on stderr (a GPU CUDA cannot use is an error). */
    /* Called while loading with a fraction in [0, 1]; return false to cancel. May be NULL. */
    bool (*progress)(float fraction, void * user_data);
    void * progress_user_data;
    /* Load the hyper-parameters and the tokenizer only: no tensor is looked up or read (a
     * vocabulary file such as llama.cpp's ggml-vocab-*.gguf has none). The tokenizer and
     * model query functions work; innerq_context_init fails with INNERQ_ERR_UNSUPPORTED. */
    bool vocab_only;
} innerq_model_params;

innerq_model_params innerq_model_default_params(void);
innerq_status innerq_model_load(const char * path, const innerq_model_params * params, innerq_model ** out);
void innerq_model_free(innerq_model * model);

int32_t innerq_model_n_vocab(const innerq_model * model);
int32_t innerq_model_n_ctx_train(const innerq_model * model);
int32_t innerq_model_n_embd(const innerq_model * model);
int32_t innerq_model_n_layer(const innerq_model * model);
int32_t innerq_model_n_head(const innerq_model * model);
int32_t innerq_model_n_head_kv(const innerq_model * model);
int32_t innerq_model_head_dim(const innerq_model * model);
uint64_t innerq_model_n_params(const innerq_model * model);
uint64_t innerq_model_size(const innerq_model * model); /* bytes of weight data */
/* What names the model in saved states: XXH64 (seed 0) of every byte of its file, read once
 * at load (through read(), so a file cut short while it loads is INNERQ_ERR_FORMAT, not
 * SIGBUS); 0 for a vocab_only model. A mapped model file must not be cut short or rewritten
 * in place while a model uses it (replace it by rename, as `innerq pull` does). */
uint64_t innerq_model_fingerprint(const innerq_model * model);
/* A short description, e.g. "llama 135M Q4_1". */
const char * innerq_model_desc(const innerq_model * model);
/* The backend that runs the model: "CPU" or "CUDA" (a model split between them: "CUDA"). */
const char * innerq_model_backend(const innerq_model * model);
/* What of a model runs on the GPU (n_gpu_layers): its layers there, counted as llama.cpp does
 * (the repeating layers, and the output layer as one more when the whole model is there: of
 * n_layer + 1 in all), and the bytes of weights on the GPU and on the CPU. */
typedef struct innerq_model_offload {
    int32_t n_layer;        /* the model's repeating layers + 1 (the output layer) */
    int32_t n_gpu_layers;   /* of them on the GPU */
    uint64_t gpu_bytes;     /* weights in GPU memory */
    uint64_t cpu_bytes;     /* weights used by the CPU (in the mapped file) */
} innerq_model_offload;
innerq_status innerq_model_get_offload(const innerq_model * model, innerq_model_offload * out);

/* GGUF metadata as text (strings as they are, numbers printed, arrays summarised).
 * Returns the number of bytes the full value needs (excluding the NUL), or -1 if the key is
 * absent; writes at most buf_size bytes including a NUL. */
int32_t innerq_model_meta_count(const innerq_model * model);
int32_t innerq_model_meta_key(const innerq_model * model, int32_t i, char * buf, size_t buf_size);
int32_t innerq_model_meta_value(const innerq_model * model, const char * key, char * buf, size_t buf_size);

/* ---- vocabulary ---- */

innerq_token innerq_token_bos(const innerq_model * model); /* -1 if none */
innerq_token innerq_token_eos(const innerq_model * model);
bool innerq_token_is_eog(const innerq_model * model, innerq_token token); /* end of generation */
bool innerq_vocab_add_bos(const innerq_model * model);                  /* the GGUF's add_bos_token */

/* Tokenizes text_len bytes of text (any bytes; invalid UTF-8 is tokenized byte-wise).
 * add_special: prepend BOS if the model asks for it. parse_special: text like "<|im_start|>"
 * becomes its control token instead of plain text.
 * On INNERQ_ERR_BUFFER_TOO_SMALL, *n_tokens is the count needed. */
innerq_status innerq_tokenize(const innerq_model * model, const char * text, int32_t text_len,
                              bool add_special, bool parse_special,
                              innerq_token * tokens, int32_t n_tokens_max, int32_t * n_tokens);

/* The bytes of one token (may be a partial UTF-8 sequence). Control tokens give their text
 * only if render_special. On INNERQ_ERR_BUFFER_TOO_SMALL, *n_bytes is the size needed. */
innerq_status innerq_token_to_piece(const innerq_model * model, innerq_token token, bool render_special,
                                    char * buf, int32_t buf_size, int32_t * n_bytes);

/* The text of a token sequence. It gives back exactly the bytes innerq_tokenize (without
 * specials) was given, except bytes the vocabulary has no token for at all:
 *  - gpt2 (byte-level BPE) vocabularies need the byte's GPT-2 character as a token. A byte
 *    without one that is part of a valid UTF-8 character is dropped; an invalid byte without
 *    one (not part of any valid character) comes back as U+FFFD. llama.cpp does the same with
 *    the same vocabulary, except that it turns every invalid byte into U+FFFD, where innerq
 *    keeps those that have a token. SmolLM2 has no token for 0x04 0x06 0x13 0x14 0x16 0x1D
 *    (dropped) nor 0xC0 0xC1 0xF1 0xF2 0xF5-0xFF (never valid UTF-8 alone: U+FFFD; inside a
 *    valid character such as U+40000, F1 80 80 80, dropped).
 *  - llama (SentencePiece) vocabularies fall back to <0xXX> tokens; a character that has
 *    neither a token nor byte tokens becomes the unknown token, which renders as nothing. */
innerq_status innerq_detokenize(const innerq_model * model, const innerq_token * tokens, int32_t n_tokens,
                                bool render_special, char * buf, int32_t buf_size, int32_t * n_bytes);

/* Streaming detokenization: push tokens one at a time; each push yields only complete UTF-8
 * characters (bytes of an unfinished character are held back). flush() returns what is held,
 * with any incomplete sequence replaced by U+FFFD. */
innerq_status innerq_detokenizer_init(const innerq_model * model, bool render_special, innerq_detokenizer ** out);
void innerq_detokenizer_free(innerq_detokenizer * dt);
innerq_status innerq_detokenizer_push(innerq_detokenizer * dt, innerq_token token,
                                      char * buf, int32_t buf_size, int32_t * n_bytes);
innerq_status innerq_detokenizer_flush(innerq_detokenizer * dt, char * buf, int32_t buf_size, int32_t * n_bytes);

/* ---- contexts (sequences and the KV cache they share) ----
 *
 * A context holds up to n_seq_max sequences, numbered 0 .. n_seq_max - 1, in one KV cache: a
 * pool of pages that the sequences take as they grow (a quantized cache's windows are each
 * sequence's own). innerq_decode_batch evaluates tokens of several sequences in one step;
 * innerq_decode, innerq_cache_truncate, innerq_n_past and the states without a sequence are
 * the shorthand for sequence 0. */

/* How innerq_get_embeddings pools a sequence's per-token embeddings; the values of llama.cpp's
 * enum llama_pooling_type. UNSPECIFIED: the GGUF's `llama.pooling_type`, or NONE where it has
 * none (every Llama-family LLM GGUF), as llama.cpp and llama-cpp-python do. */
typedef enum innerq_pooling {
    INNERQ_POOLING_UNSPECIFIED = -1,
    INNERQ_POOLING_NONE = 0, /* no pooled vector: per-token embeddings (innerq_get_embeddings_ith) */
    INNERQ_POOLING_MEAN = 1, /* the mean over the tokens of the last decode call */
    INNERQ_POOLING_CLS = 2,  /* the first token of the last decode call */
    INNERQ_POOLING_LAST = 3, /* the last token of the last decode call */
} innerq_pooling;

typedef struct innerq_context_params {
    int32_t n_ctx;       /* tokens the cache holds, all sequences together (default 4096); one sequence
                            may take them all; 0: the model's training context */
    int32_t n_seq_max;   /* sequences the context holds (default 1) */
    int32_t n_batch;     /* most tokens one graph evaluates (prompts are split); default 512 */
    int32_t n_threads;   /* 0: innerq_default_n_threads(); past the CPUs this process may use
                            (innerq_default_n_threads without its cap of 8), that many run */
    /* Cache types of keys and values: "f32", "f16", "q8_0", "q4_0", "kivi2", "kivi4", "innerq2",
     * "innerq3", "innerq4", or the preset "innerq" (the default: innerq3 keys and innerq2 values
     * at least; the bytes of the rule-of-thumb windows go to more bits per layer with
     * the windows at S 32, R 96, docs/INNERQ.md "The preset's layout").
     * If only one is given it names both. "iq2", "iq3", "iq4" are accepted as the old names of
     * innerq2..4 until release 0.3. */
    const char * kv_k;
    const char * kv_v;
    int32_t kv_group;    /* InnerQ group size G (32, 64, 128); 0: backend default */
    int32_t kv_sink;     /* InnerQ sink window S; -1: default (L/64 within 32 .. 128, 32 .. 64 with value row
                            scales; L = n_ctx / n_seq_max; the preset's: 32); more
                            than n_ctx counts as n_ctx */
    int32_t kv_recent;   /* InnerQ recent window R; -1: default (L/16 within 96 .. 512, 96 .. 448 with value row scales; the preset's: 96; at least a model's sliding window + G); more than n_ctx counts as n_ctx */
    bool kv_hybrid;      /* InnerQ per-group symmetric/asymmetric choice */
    bool kv_norm;        /* InnerQ per-channel key normalization */
    bool kv_debias;      /* InnerQ score correction: subtract the softmax bias of key rounding noise */
    bool kv_norm_pairs;  /* key normalization: one factor per RoPE channel pair; false: per channel */
    /* InnerQ Hadamard rotation of each head along head_dim (docs/INNERQ.md): -1 the default
     * (keys and values), 0 none, 1 keys (and queries), 2 values (and the attention output), 3 both */
    int32_t kv_rot;
    /* InnerQ group scales by least squared error over a few shrunk ranges (IQ_QUANT_SEARCH)
     * instead of min-max; the block format is the same */
    bool kv_search;
    /* InnerQ value row scales (docs/INNERQ.md): each quantized token's value row divided by its
     * own scale (one byte per token and KV head) before its channels are quantized along the
     * block's tokens, so that a large row does not coarsen the others' steps. -1: the default
     * (off), 0 off, 1 on. */
    int32_t kv_value_scales;
    /* InnerQ 8-bit group parameters (docs/INNERQ.md): each quantized block keeps its groups'
     * (d, m) in a byte each against the block's fp16 references instead of two fp16: 0.23-0.25
     * bits less per element, which kv_bits spends on codes. -1: the default (off), 0 off, 1 on. */
    int32_t kv_params8;
    /* InnerQ keys on non-uniform levels (docs/INNERQ.md): 3-bit key codes stand for Max's
     * levels for a Gaussian instead of a uniform grid (rotated keys are close to Gaussian), at
     * the same bytes; needs kv_search. -1: the default (off), 0 off, 1 on. */
    int32_t kv_key_levels;
    /* InnerQ automatic layout (docs/INNERQ.md): a budget of kv_bits effective bits per element
     * of the whole cache at n_ctx tokens (innerq_kv_memory: f16 windows, (d, m) and norms
     * included); what the windows leave is spent per layer on keys and values (2 to 5 bits
     * each) where the prompt itself shows they lower the attention error most, chosen once per
     * sequence at the cache's first flush; the cache takes at most the budget's bytes. 0: off
     * (the types' bits). From 2 + 32/G to 16; a budget that the windows with 2-bit keys and
     * values exceed at n_ctx is an error (innerq_context_init), one past 5-bit keys and values
     * gets those. Needs an InnerQ cache (kv_k / kv_v unset or "innerq"). */
    float kv_bits;
    /* InnerQ bits of single layers, "IL:K:V" comma-separated (e.g. "0:4:3,29:4:2"), over the
     * types' (NULL or "": none; not with kv_bits) */
    const char * kv_layer_bits;
    bool logits_all;     /* keep logits of every token of a batch, not only the last */
    /* Evaluate every token of a batch exactly as if the tokens were decoded one at a time
     * (docs/DESIGN.md 3.4: earlier tokens of the batch are read as the cache stores them, and batches
     * are split where a quantized cache flushes). Scores a text at batch speed; prompts are
     * usually better served without it (they then attend to their own chunk at full precision). */
    bool decode_semantics;
    /* Keep embeddings (the final hidden state after the output norm, n_embd floats per token)
     * of every token of each innerq_decode call, pooled as `pooling` says (an innerq_pooling). */
    bool embeddings;
    int32_t pooling;
    /* How removing a sequence's last tokens treats the rest (innerq_seq_rm, innerq_cache_truncate).
     * false (the default): the kept tokens stay as they are stored (quantized rows stay
     * quantized; where the cut falls inside a quantized block of G tokens, that block's tokens
     * go too and the caller evaluates them again). true: the cache holds exactly what a fresh
     * evaluation of the kept tokens in one call would hold, rewinding further where it can't
     * (docs/INNERQ.md, "Rewinding the cache"): for tests and scoring. */
    bool kv_rewind_exact;
} innerq_context_params;

innerq_context_params innerq_context_default_params(void);
/* Checks what needs no model: the ranges, the cache type names and whether they pair, the
 * InnerQ knobs. innerq_context_init checks the rest (a group dividing the head dimension). */
innerq_status innerq_context_params_check(const innerq_context_params * params);
innerq_status innerq_context_init(innerq_model * model, const innerq_context_params * params, innerq_context ** out);
void innerq_context_free(innerq_context * ctx);

/* Threads. A context may be shared between threads: every call that takes a context runs
 * under that context's lock, so concurrent calls wait for each other instead of corrupting
 * the cache (callers sharing one object, as Python threads sharing one Llama do, expect
 * waiting, not an error). Calls that form one unit (a generation: clear, decode the prompt,
 * then sample and decode token by token) are kept from interleaving with another thread's
 * by holding the lock across them: innerq_context_lock ... innerq_context_unlock. The lock
 * is recursive (the calls inside take it again) and must be released by the thread that took
 * it. The logits innerq_get_logits points to change with the next decode: read them while
 * holding the lock. Nothing may use a context while or after innerq_context_free runs.
 * A model is read-only once loaded: contexts on one model (e.g. one per thread) run in
 * parallel without waiting for each other, and the tokenizer functions may be called from
 * any thread. A sampler or a detokenizer is one thread's at a time.
 * fork(): a child may go on using the models and contexts its parent loaded and used on the
 * CPU (Python's multiprocessing on Linux, gunicorn --preload): a context's thread pool starts
 * its threads again in the child at its first decode there. The fork must happen while no
 * thread of the parent is inside a call to innerq (a lock held then stays held in the child);
 * a model on the GPU (CUDA) can not be used in a child. */
innerq_status innerq_context_lock(innerq_context * ctx);
innerq_status innerq_context_unlock(innerq_context * ctx);

int32_t innerq_n_ctx(const innerq_context * ctx);
int32_t innerq_n_seq_max(const innerq_context * ctx);
int32_t innerq_n_past(const innerq_context * ctx); /* tokens of sequence 0 */
innerq_status innerq_set_n_threads(innerq_context * ctx, int32_t n_threads);
/* Change logits_all and decode_semantics (innerq_context_params) between innerq_decode calls,
 * e.g. prefill a prompt, then score a continuation. The logits kept so far are dropped. */
innerq_status innerq_set_batch_mode(innerq_context * ctx, bool logits_all, bool decode_semantics);

/* Appends tokens to the sequence and evaluates them (in chunks of n_batch).
 * Fails with INNERQ_ERR_CONTEXT_FULL (nothing evaluated) if n_past + n_tokens > n_ctx and with
 * INNERQ_ERR_INVALID_ARGUMENT for a token id outside the vocabulary. */
innerq_status innerq_decode(innerq_context * ctx, const innerq_token * tokens, int32_t n_tokens);

/* A batch of tokens of several sequences, as llama.cpp's llama_batch: token i goes to sequence
 * seq_id[i][0] at position pos[i] (the sequence's next position: a sequence's tokens come in
 * order, each right after the last it holds; pos NULL: each sequence's next ones), and its
 * logits are kept if logits[i] (logits NULL: the batch's last token only). A token with several
 * sequence ids (n_seq_id[i] > 1) is evaluated once, in the first, and the others, which must be
 * empty and get only such tokens in this batch, become copies of it (innerq_seq_cp) after the
 * batch: the way to give several sequences one prompt. */
typedef struct innerq_batch {
    int32_t n_tokens;
    innerq_token * token;
    int32_t * pos;
    int32_t * n_seq_id;
    int32_t ** seq_id;
    int8_t * logits;
} innerq_batch;

/* Arrays for n_tokens_max tokens of up to n_seq_max sequence ids each (n_tokens 0). */
innerq_status innerq_batch_init(int32_t n_tokens_max, int32_t n_seq_max, innerq_batch * out);
void innerq_batch_free(innerq_batch * batch);

/* Evaluates a batch: each sequence's tokens are appended to it, and the sequences' tokens are
 * computed together, in steps of at most n_batch tokens (every weight read once per step). A
 * sequence gets the same logits whichever other sequences share its steps. Fails, with nothing
 * evaluated, with INNERQ_ERR_INVALID_ARGUMENT for a bad batch (a sequence id outside 0 ..
 * n_seq_max - 1, a position that is not the sequence's next, a token outside the vocabulary)
 * and INNERQ_ERR_CONTEXT_FULL if the cache has no room for the tokens. */
innerq_status innerq_decode_batch(innerq_context * ctx, const innerq_batch * batch);

/* Logits of the last evaluated token (n_vocab floats), or of token i of the last
 * innerq_decode call when logits_all is set, or of token i of the last innerq_decode_batch
 * (a token with logits; i < 0 counts from the end). NULL if none. */
float * innerq_get_logits(innerq_context * ctx);
float * innerq_get_logits_ith(innerq_context * ctx, int32_t i);

/* Embeddings of the last innerq_decode call (the context needs `embeddings`): the pooled
 * vector of its tokens (n_embd floats) or, with pooling NONE, every token's vector one after
 * the other ([n_tokens][n_embd], as llama_get_embeddings); _ith: the vector of its token i
 * (i < 0 counts from the end). Valid until the next decode. NULL (+ innerq_last_error) if none. */
float * innerq_get_embeddings(innerq_context * ctx);
float * innerq_get_embeddings_ith(innerq_context * ctx, int32_t i);
/* The pooling the context uses (UNSPECIFIED resolved against the model), and the number of
 * tokens of the last innerq_decode call whose embeddings are kept (0: none). */
int32_t innerq_pooling_type(const innerq_context * ctx);
int32_t innerq_embeddings_rows(innerq_context * ctx);

/* Forgets every sequence. */
innerq_status innerq_cache_clear(innerq_context * ctx);

/* ---- sequences (llama.cpp's llama_memory_seq_*) ----
 * seq: 0 .. n_seq_max - 1; -1 in innerq_seq_rm: every sequence. Positions p0, p1: p0 < 0 is 0,
 * p1 < 0 the end. */

/* Removes the tokens of seq at positions [p0, p1). Supported: a sequence's last tokens (p1 the
 * end) and all of them. The kept tokens are as kv_rewind_exact says: by default they stay as
 * stored, and the sequence may end before p0 (where p0 cuts a quantized block):
 * innerq_seq_pos_max tells where, and the caller evaluates the tokens from there again.
 * INNERQ_ERR_UNSUPPORTED for a range in the middle of a sequence. */
innerq_status innerq_seq_rm(innerq_context * ctx, int32_t seq, int32_t p0, int32_t p1);
/* Makes dst a copy of seq src's tokens [0, p1) (p0 must be 0 or < 0), kept as innerq_seq_rm
 * keeps a sequence's first tokens; dst's own tokens are dropped. The copy shares src's stored
 * tokens (quantized blocks, whole pages of a plain cache): a prefix copied to several sequences
 * is stored once. */
innerq_status innerq_seq_cp(innerq_context * ctx, int32_t src, int32_t dst, int32_t p0, int32_t p1);
/* Removes every sequence but seq. */
innerq_status innerq_seq_keep(innerq_context * ctx, int32_t seq);
/* The last position seq holds (-1: none), and the first (-1: none). */
int32_t innerq_seq_pos_max(innerq_context * ctx, int32_t seq);
int32_t innerq_seq_pos_min(innerq_context * ctx, int32_t seq);

/* The pool: pages and tokens per page, pages in use, and bytes of the whole cache. */
typedef struct innerq_kv_pool_info {
    int32_t n_pages, page_tokens, n_pages_used;
    int32_t n_seq;          /* sequences holding tokens */
    int64_t n_tokens;       /* tokens the sequences hold, together */
    uint64_t bytes;
} innerq_kv_pool_info;
innerq_status innerq_kv_pool(innerq_context * ctx, innerq_kv_pool_info * out);

/* Rewinds sequence 0: drops the tokens at positions >= n_keep; *n_kept <= n_keep tokens remain
 * and the caller evaluates tokens [*n_kept, n_keep) again. By default the kept tokens stay as
 * they are stored (innerq_seq_rm): *n_kept is n_keep, or where n_keep cuts a quantized block
 * that block's start (fewer than G tokens to evaluate again). With kv_rewind_exact, the cache
 * afterwards holds exactly what a fresh context holds after innerq_decode of the first *n_kept
 * tokens in one call; where no such state can be rebuilt from this cache (a quantized cache has
 * since flushed tokens that the fresh run's recent window holds in f16; tokens were evaluated
 * in batches cut otherwise than one call cuts them), it rewinds further, to the longest prefix
 * whose state it can rebuild (docs/INNERQ.md, "Rewinding the cache"; with decode_semantics,
 * tokens decoded one at a time do not hold a rewind back). When tokens are dropped, so are the
 * logits and embeddings of the last call. An n_keep past n_past counts as n_past (with
 * kv_rewind_exact the rule applies there too). */
innerq_status innerq_cache_truncate(innerq_context * ctx, int32_t n_keep, int32_t * n_kept);

/* States: the sequence as it is (the cache in its stored form: the quantized regions packed,
 * only the parts in use; plain caches their n_past rows), the counters, the batches the
 * tokens were evaluated in (for innerq_cache_truncate) and the logits of the last call, with
 * a header that names the model and the cache configuration. innerq_state_size is an upper
 * bound of what innerq_state_save writes now (*written: the bytes written). innerq_state_load
 * fails with INNERQ_ERR_STATE_MISMATCH for a state of another model or cache configuration,
 * INNERQ_ERR_FORMAT for a damaged or truncated one, INNERQ_ERR_CONTEXT_FULL for one longer than
 * n_ctx; the context is then left as it was. */
size_t innerq_state_size(innerq_context * ctx);
innerq_status innerq_state_save(innerq_context * ctx, void * dst, size_t dst_size, size_t * written);
innerq_status innerq_state_load(innerq_context * ctx, const void * src, size_t size);
/* One sequence's state (llama_state_seq_*): its tokens as stored, without logits; it loads into
 * any sequence of a context of the same model and cache configuration (the sequence's tokens
 * are replaced). The whole context's state (above) holds every sequence that has tokens. */
size_t innerq_state_seq_size(innerq_context * ctx, int32_t seq);
innerq_status innerq_state_seq_save(innerq_context * ctx, int32_t seq, void * dst, size_t dst_size, size_t * written);
innerq_status innerq_state_seq_load(innerq_context * ctx, int32_t seq, const void * src, size_t size);

/* The names kv_k / kv_v accept (the preset "innerq" first, then the cache types; not the old
 * aliases), and bytes of cache per token per layer-and-head
 * set (all layers), for a model, a pair of types and the window/group parameters of params. */
int32_t innerq_kv_type_count(void);
const char * innerq_kv_type_name(int32_t i);
innerq_status innerq_kv_bytes_per_token(const innerq_model * model, const innerq_context_params * params,
                                        double * bytes);
/* Bytes the context's cache buffers hold. */
uint64_t innerq_cache_size(const innerq_context * ctx);
/* The cache's memory at its full size, n_ctx tokens: the bytes of its buffer, everything
 * included (f16 sink and recent windows, quantized blocks with their (d, m), key norms, the
 * page table, the rotation), and the effective bits per element, bytes * 8 over the n_ctx x
 * n_layer x n_head_kv x head_dim x 2 keys and values it holds. */
typedef struct innerq_kv_memory {
    uint64_t bytes;
    double bits;             /* effective bits per element, windows included */
    double quant_bits;       /* bits per element of the quantized region, (d, m) included (0: plain) */
    int32_t n_ctx;
    int32_t group, n_sink, n_recent; /* the quantized cache's group and windows (0 for plain caches) */
} innerq_kv_memory;
/* The memory a context of params (n_ctx 0: the model's training context) would take for its
 * cache on a device of this type (its default cache, group and alignment), computed without
 * allocating it or needing such a device. */
innerq_status innerq_kv_memory_of(const innerq_model * model, const innerq_context_params * params,
                                  enum innerq_device_type device, innerq_kv_memory * out);
/* The memory of the context's cache. */
innerq_status innerq_context_kv_memory(innerq_context * ctx, innerq_kv_memory * out);
/* One layer's cache as it is now (sequence 0's tokens): its code bits (the automatic layout's
 * choice once made) and how the quantizer chose the groups stored so far. */
typedef struct innerq_kv_layer_info {
    int32_t bits_k, bits_v;  /* code bits of quantized keys and values; 0 for a plain cache */
    int32_t n_quant;         /* tokens in the quantized region (0 on a sliding-window layer that keeps none) */
    float sym_k, sym_v;      /* share of the stored groups on the symmetric grid (-1: none stored) */
    /* kv_bits: the relative attention-output error this context measured for the layer's keys
     * and values at 2, 3, 4 and 5 bits when it chose the layout (0: not measured) */
    float err_k[4], err_v[4];
} innerq_kv_layer_info;
innerq_status innerq_cache_layer_info(innerq_context * ctx, int32_t layer, innerq_kv_layer_info * out);

/* ---- sampling ---- */

typedef struct innerq_sampler_params {
    float temperature;     /* <= 0: greedy; finite */
    int32_t top_k;         /* <= 0: off */
    float top_p;           /* 0 .. 1; 1: off */
    float min_p;           /* 0 .. 1; 0: off */
    float repeat_penalty;  /* > 0; 1: off */
    int32_t repeat_last_n; /* tokens of history the penalty looks at, >= 0 */
    uint64_t seed;         /* INNERQ_DEFAULT_SEED (0xFFFFFFFF): from the clock */
} innerq_sampler_params;

innerq_sampler_params innerq_sampler_default_params(void);
/* Checks the ranges above; innerq_sampler_init does too. Every face of innerq (innerq-cli,
 * `innerq run`, Python) validates sampling arguments with it, before any model is loaded. */
innerq_status innerq_sampler_params_check(const innerq_sampler_params * params);

/* Tokens a generation makes when the caller sets no limit: innerq-cli's and `innerq run`'s -n
 * and Python's max_tokens. With the three *_default_params functions and the two below these
 * are the defaults every face of innerq shares (docs/DEFAULTS.md). */
int32_t innerq_default_n_predict(void);
/* The threads of a context whose n_threads is 0: the CPUs this process may use (its affinity
 * mask; its cgroup's CPU quota, cgroup v2 cpu.max or v1 cpu.cfs_quota_us / cpu.cfs_period_us,
 * rounded up, where that allows fewer), at most 8. Read anew on each call. */
int32_t innerq_default_n_threads(void);
/* The most bytes innerq's faces read as one text: innerq-cli's and innerq-perplexity's -f, the
 * prompt `innerq run` reads from stdin, a line `innerq chat` reads from a pipe (64 MiB). Past
 * it they stop with an error instead of reading on (/dev/zero, a pipe that never ends). */
int64_t innerq_max_text_bytes(void);
innerq_status innerq_sampler_init(const innerq_sampler_params * params, innerq_sampler ** out);
void innerq_sampler_free(innerq_sampler * smpl);
/* Samples from n_vocab logits (not modified). Order as llama.cpp's default chain:
 * repetition penalty, top-k, top-p, min-p, temperature, then draw (or argmax if greedy). */
innerq_status innerq_sampler_sample(innerq_sampler * smpl, const float * logits, int32_t n_vocab, innerq_token * out);
/* Records a token in the penalty history (prompt tokens and generated ones). */
void innerq_sampler_accept(innerq_sampler * smpl, innerq_token token);
void innerq_sampler_reset(innerq_sampler * smpl);

#ifdef __cplusplus
}
#endif

#endif /* INNERQ_H */
