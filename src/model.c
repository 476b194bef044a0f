// The llama architecture: loading (hyper-parameters, weights used in place) and the
// forward graph. model_build_graph reads top to bottom like the transformer block.
#include "model.h"

#include "device.h"
#include "kv-cache.h"
#include "status.h"
#include "vocab.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---- hyper-parameters ----

static innerq_status hparams_need_u32(const struct gguf_file * f, const char * key, int32_t * out) {
    innerq_status st = INNERQ_OK;
    uint32_t v;
    if (!gguf_get_u32(f, key, &v, &st)) {
        return st != INNERQ_OK ? st : innerq_fail(INNERQ_ERR_FORMAT, "missing model parameter '%s'", key);
    }
    if (v == 0 || v > (1u << 24)) {
        return innerq_fail(INNERQ_ERR_FORMAT, "model parameter '%s' = %u is out of range", key, v);
    }
    *out = (int32_t) v;
    return INNERQ_OK;
}

static innerq_status hparams_load(const struct gguf_file * f, struct llama_hparams * hp) {
    innerq_status st = INNERQ_OK;
    struct gguf_str arch;
    if (!gguf_get_str(f, "general.architecture", &arch, &st)) {
        return st != INNERQ_OK ? st : innerq_fail(INNERQ_ERR_FORMAT, "missing 'general.architecture'");
    }
    if (arch.n != 5 || memcmp(arch.data, "llama", 5) != 0) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "architecture '%.*s' is not supported (only 'llama')",
                           (int) (arch.n > 64 ? 64 : arch.n), arch.data);
    }
    if ((st = hparams_need_u32(f, "llama.block_count", &hp->n_layer)) ||
        (st = hparams_need_u32(f, "llama.embedding_length", &hp->n_embd)) ||
        (st = hparams_need_u32(f, "llama.feed_forward_length", &hp->n_ff)) ||
        (st = hparams_need_u32(f, "llama.attention.head_count", &hp->n_head)) ||
        (st = hparams_need_u32(f, "llama.context_length", &hp->n_ctx_train))) {
        return st;
    }
    hp->n_head_kv = hp->n_head;
    if (gguf_find_kv(f, "llama.attention.head_count_kv") &&
        (st = hparams_need_u32(f, "llama.attention.head_count_kv", &hp->n_head_kv))) {
        return st;
    }
    if (hp->n_embd % hp->n_head != 0 || hp->n_head % hp->n_head_kv != 0) {
        return innerq_fail(INNERQ_ERR_FORMAT, "inconsistent heads: n_embd %d, n_head %d, n_head_kv %d",
                           hp->n_embd, hp->n_head, hp->n_head_kv);
    }
    hp->head_dim = hp->n_embd / hp->n_head;
    hp->n_rot = hp->head_dim;
    if (gguf_find_kv(f, "llama.rope.dimension_count") &&
        (st = hparams_need_u32(f, "llama.rope.dimension_count", &hp->n_rot))) {
        return st;
    }
    if (hp->n_rot > hp->head_dim || hp->n_rot % 2 != 0 || hp->head_dim % 2 != 0) {
        return innerq_fail(INNERQ_ERR_FORMAT, "rope dimension %d does not fit head size %d", hp->n_rot, hp->head_dim);
    }
    hp->rope_freq_base = 10000.0f;
    hp->rms_eps = 1e-5f;
    gguf_get_f32(f, "llama.rope.freq_base", &hp->rope_freq_base, &st);
    gguf_get_f32(f, "llama.attention.layer_norm_rms_epsilon", &hp->rms_eps, &st);
    if (st != INNERQ_OK) {
        return st;
    }
    if (!(hp->rope_freq_base > 0.0f) || !isfinite(hp->rope_freq_base) || !(hp->rms_eps > 0.0f) || hp->rms_eps > 1.0f) {
        return innerq_fail(INNERQ_ERR_FORMAT, "rope freq_base %g or rms epsilon %g out of range",
                           hp->rope_freq_base, hp->rms_eps);
    }
    return INNERQ_OK;
}

// ---- weights ----

// The weight formats matrices may have (docs/DESIGN.md section 2).
static bool weight_type_ok(enum iq_type t) {
    static const enum iq_type ok[] = { IQ_TYPE_F32,  IQ_TYPE_F16,  IQ_TYPE_BF16, IQ_TYPE_Q4_0,   IQ_TYPE_Q4_1,
                                       IQ_TYPE_Q5_0, IQ_TYPE_Q5_1, IQ_TYPE_Q8_0, IQ_TYPE_Q2_K,   IQ_TYPE_Q3_K,
                                       IQ_TYPE_Q4_K, IQ_TYPE_Q5_K, IQ_TYPE_Q6_K, IQ_TYPE_IQ4_NL, IQ_TYPE_IQ4_XS };
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        if (ok[i] == t) {
            return true;
        }
    }
    return false;
}

// Finds a tensor, checks its shape and type, and makes an iq_tensor over its data.
static innerq_status weight_get(innerq_model * m, const char * name, int64_t ne0, int64_t ne1,
                                bool required, struct iq_tensor ** out) {
    const struct gguf_tensor_info * ti = gguf_find_tensor(m->gguf, name);
    *out = NULL;
    if (ti == NULL) {
        return required ? innerq_fail(INNERQ_ERR_FORMAT, "missing tensor '%s'", name) : INNERQ_OK;
    }
    const int64_t want_ne1 = ne1 > 0 ? ne1 : 1;
    if (ti->ne[0] != ne0 || ti->ne[1] != want_ne1 || ti->ne[2] != 1 || ti->ne[3] != 1) {
        return innerq_fail(INNERQ_ERR_FORMAT, "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld]",
                           name, (long long) ti->ne[0], (long long) ti->ne[1], (long long) ti->ne[2],
                           (long long) ti->ne[3], (long long) ne0, (long long) want_ne1);
    }
    if (!weight_type_ok(ti->type)) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "tensor '%s' has type %s, which is not a supported weight format",
                           name, iq_type_name(ti->type));
    }
    struct iq_tensor * t = ne1 > 0 ? iq_new_tensor_2d(m->ctx, ti->type, ne0, ne1) : iq_new_tensor_1d(m->ctx, ti->type, ne0);
    if (t == NULL) {
        return innerq_fail(INNERQ_ERR_FORMAT, "tensor '%s': %s", name, iq_error_get());
    }
    iq_set_name(t, "%s", name);
    iq_tensor_place(t, m->weights, (size_t) ti->offset);  // the buffer is the data section
    if (!m->weights->is_host) {
        iq_tensor_set(t, ti->data, 0, ti->size);
    }
    m->n_params += (uint64_t) iq_nelements(t);
    m->n_bytes += ti->size;
    *out = t;
    return INNERQ_OK;
}

// Norm vectors and rope factors are read element-wise by the ops: they must be f32.
static innerq_status weight_need_f32(const struct iq_tensor * t) {
    if (t != NULL && t->type != IQ_TYPE_F32) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "tensor '%s' has type %s; only f32 is supported for it",
                           t->name, iq_type_name(t->type));
    }
    return INNERQ_OK;
}

// block_count against the tensors, before anything is sized by it. Each block has 9 weight
// tensors: checking the count first keeps a damaged block_count from sizing allocations
// (layers, tensor structs) before the weights are looked up. A tensor of a block past
// block_count means the file has more layers than its metadata says: evaluating the first
// block_count of them would write wrong text without a word.
static innerq_status weights_count_check(const struct gguf_file * f, const struct llama_hparams * hp) {
    if ((int64_t) hp->n_layer * 9 + 2 > f->n_tensors) {
        return innerq_fail(INNERQ_ERR_FORMAT,
                           "llama.block_count = %d needs at least %lld tensors (9 per block, the embedding and "
                           "the output norm); the file has %lld",
                           hp->n_layer, (long long) hp->n_layer * 9 + 2, (long long) f->n_tensors);
    }
    for (int64_t i = 0; i < f->n_tensors; i++) {
        long block;
        char * end;
        const char * name = f->tensors[i].name;
        if (strncmp(name, "blk.", 4) == 0 && (block = strtol(name + 4, &end, 10)) >= hp->n_layer && *end == '.') {
            return innerq_fail(INNERQ_ERR_FORMAT, "tensor '%s' is in block %ld, but llama.block_count = %d: the "
                               "metadata lists fewer layers than the file has", name, block, hp->n_layer);
        }
    }
    return INNERQ_OK;
}

static innerq_status weights_load(innerq_model * m) {
    const struct llama_hparams * hp = &m->hp;
    const int64_t n_embd = hp->n_embd, n_kv = (int64_t) hp->n_head_kv * hp->head_dim;
    innerq_status st;
    char name[96];

    if ((st = weight_get(m, "token_embd.weight", n_embd, hp->n_vocab, true, &m->tok_embd)) ||
        (st = weight_get(m, "output_norm.weight", n_embd, 0, true, &m->output_norm)) ||
        (st = weight_get(m, "output.weight", n_embd, hp->n_vocab, false, &m->output)) ||
        (st = weight_get(m, "rope_freqs.weight", hp->n_rot / 2, 0, false, &m->rope_freqs)) ||
        (st = weight_need_f32(m->output_norm)) || (st = weight_need_f32(m->rope_freqs))) {
        return st;
    }
    if (m->output == NULL) {
        m->output = m->tok_embd;  // tied embeddings
    }
    for (int32_t il = 0; il < hp->n_layer; il++) {
        struct llama_layer * l = &m->layers[il];
        struct { const char * suffix; int64_t ne0, ne1; struct iq_tensor ** dst; } w[] = {
            { "attn_norm", n_embd, 0, &l->attn_norm },
            { "attn_q", n_embd, n_embd, &l->wq },
            { "attn_k", n_embd, n_kv, &l->wk },
            { "attn_v", n_embd, n_kv, &l->wv },
            { "attn_output", n_embd, n_embd, &l->wo },
            { "ffn_norm", n_embd, 0, &l->ffn_norm },
            { "ffn_gate", n_embd, hp->n_ff, &l->ffn_gate },
            { "ffn_up", n_embd, hp->n_ff, &l->ffn_up },
            { "ffn_down", hp->n_ff, n_embd, &l->ffn_down },
        };
        for (size_t i = 0; i < sizeof(w) / sizeof(w[0]); i++) {
            snprintf(name, sizeof(name), "blk.%d.%s.weight", il, w[i].suffix);
            if ((st = weight_get(m, name, w[i].ne0, w[i].ne1, true, w[i].dst))) {
                return st;
            }
        }
        if ((st = weight_need_f32(l->attn_norm)) || (st = weight_need_f32(l->ffn_norm))) {
            return st;
        }
    }
    return INNERQ_OK;
}

uint64_t fnv1a64(uint64_t h, const void * data, size_t n) {
    const uint8_t * p = data;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ p[i]) * 0x100000001b3ull;
    }
    return h;
}

static void model_describe(innerq_model * m) {
    if (m->vocab_only) {
        snprintf(m->desc, sizeof(m->desc), "llama vocab only (%d tokens)", m->hp.n_vocab);
        return;
    }
    const struct iq_tensor * w = m->layers[0].ffn_up;
    double n = (double) m->n_params;
    const char * unit = n >= 1e9 ? "B" : "M";
    snprintf(m->desc, sizeof(m->desc), "llama %.*f%s %s", n >= 1e9 ? 1 : 0, n >= 1e9 ? n / 1e9 : n / 1e6, unit,
             iq_type_name(w->type));
}

innerq_model_params innerq_model_default_params(void) {
    innerq_model_params p = { .use_mmap = true, .n_gpu_layers = 0, .progress = NULL, .progress_user_data = NULL,
                               .vocab_only = false };
    return p;
}

innerq_status innerq_model_load(const char * path, const innerq_model_params * params, innerq_model ** out) {
    if (out == NULL || path == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_model_load: path and out must not be NULL");
    }
    *out = NULL;
    innerq_model_params p = params ? *params : innerq_model_default_params();
    if (p.progress && !p.progress(0.0f, p.progress_user_data)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "model loading cancelled");
    }
    innerq_model * m = calloc(1, sizeof(*m));
    if (m == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
    }
    innerq_status st = gguf_open(path, p.use_mmap, &m->gguf);
    // The fingerprint is the hash of every byte of the file (metadata and weights), so a state
    // names exactly the model it was saved with, wherever the file was copied. It is taken
    // first, through read() rather than the mapping: it is the one pass over the whole file at
    // load, and a file cut short since it was opened fails here instead of raising SIGBUS
    // later. Cost: 25 ms for SmolLM2's 98 MB from the page cache (docs/BENCHMARKS.md).
    if (st == INNERQ_OK && !p.vocab_only) {
        st = gguf_file_hash(m->gguf, p.progress, p.progress_user_data, &m->fingerprint);
    }
    if (st == INNERQ_OK) {
        st = hparams_load(m->gguf, &m->hp);
    }
    if (st == INNERQ_OK) {
        st = vocab_load(m->gguf, &m->vocab);
    }
    if (st == INNERQ_OK) {
        m->hp.n_vocab = vocab_n_tokens(m->vocab);
        m->vocab_only = p.vocab_only;
        // as llama.cpp: the file's pooling type, none where it names none (LLMs)
        uint32_t pooling = INNERQ_POOLING_NONE;
        gguf_get_u32(m->gguf, "llama.pooling_type", &pooling, &st);
        m->pooling = pooling <= INNERQ_POOLING_LAST ? (int32_t) pooling : INNERQ_POOLING_NONE;
    }
    if (st == INNERQ_OK && !p.vocab_only && (st = weights_count_check(m->gguf, &m->hp)) == INNERQ_OK) {
        m->layers = calloc((size_t) m->hp.n_layer, sizeof(*m->layers));
        m->ctx = iq_context_init((size_t) (m->hp.n_layer * 9 + 8) * iq_tensor_overhead());
        if (m->layers == NULL || m->ctx == NULL) {
            st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
        }
    }
    if (st == INNERQ_OK && !p.vocab_only && (st = device_choose(p.n_gpu_layers, m->hp.n_layer, true, &m->gpu)) == INNERQ_OK) {
        st = device_backend_init(m->gpu, 1, &m->backend);
    }
    if (st == INNERQ_OK && !p.vocab_only && m->gpu) {
        // a copy of the file's data section on the device (weight_get fills it)
        m->weights = iq_backend_alloc_buffer(m->backend, m->gguf->data_size);
        if (m->weights == NULL) {
            st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "the weights (%.1f MiB) on the GPU: %s",
                             m->gguf->data_size / 1048576.0, iq_error_get());
        }
    } else if (st == INNERQ_OK && !p.vocab_only) {
        // The CPU backend uses the file's data section in place.
        m->weights = iq_backend_buffer_from_host(m->backend, m->gguf->data, m->gguf->data_size);
        if (m->weights == NULL) {
            st = innerq_fail(INNERQ_ERR_BACKEND, "could not map the weights: %s", iq_error_get());
        }
    }
    if (st == INNERQ_OK && !p.vocab_only) {
        st = weights_load(m);
    }
    if (st != INNERQ_OK) {
        // keep the message of the first failure; prefix the path if it is not there yet
        if (strstr(innerq_last_error(), path) == NULL) {
            char msg[1024];
            snprintf(msg, sizeof(msg), "%s", innerq_last_error());
            innerq_fail(st, "%s: %s", path, msg);
        }
        innerq_model_free(m);
        return st;
    }
    model_describe(m);
    if (p.progress) {
        p.progress(1.0f, p.progress_user_data);
    }
    *out = m;
    return INNERQ_OK;
}

void innerq_model_free(innerq_model * m) {
    if (m == NULL) {
        return;
    }
    if (m->weights) {
        iq_buffer_free(m->weights);
    }
    if (m->backend) {
        iq_backend_free(m->backend);
    }
    if (m->ctx) {
        iq_context_free(m->ctx);
    }
    vocab_free(m->vocab);
    gguf_close(m->gguf);
    free(m->layers);
    free(m);
}

const struct innerq_vocab * model_vocab(const innerq_model * model) { return model ? model->vocab : NULL; }

int32_t innerq_model_n_vocab(const innerq_model * m) { return m ? m->hp.n_vocab : -1; }
int32_t innerq_model_n_ctx_train(const innerq_model * m) { return m ? m->hp.n_ctx_train : -1; }
int32_t innerq_model_n_embd(const innerq_model * m) { return m ? m->hp.n_embd : -1; }
int32_t innerq_model_n_layer(const innerq_model * m) { return m ? m->hp.n_layer : -1; }
int32_t innerq_model_n_head(const innerq_model * m) { return m ? m->hp.n_head : -1; }
int32_t innerq_model_n_head_kv(const innerq_model * m) { return m ? m->hp.n_head_kv : -1; }
int32_t innerq_model_head_dim(const innerq_model * m) { return m ? m->hp.head_dim : -1; }
uint64_t innerq_model_n_params(const innerq_model * m) { return m ? m->n_params : 0; }
uint64_t innerq_model_size(const innerq_model * m) { return m ? m->n_bytes : 0; }
uint64_t innerq_model_fingerprint(const innerq_model * m) { return m ? m->fingerprint : 0; }
const char * innerq_model_desc(const innerq_model * m) { return m ? m->desc : ""; }
const char * innerq_model_backend(const innerq_model * m) { return m ? iq_backend_name(m->backend) : ""; }

int32_t innerq_model_meta_count(const innerq_model * m) { return m ? (int32_t) m->gguf->n_kv : -1; }

int32_t innerq_model_meta_key(const innerq_model * m, int32_t i, char * buf, size_t buf_size) {
    if (m == NULL || i < 0 || i >= m->gguf->n_kv) {
        return -1;
    }
    return snprintf(buf, buf_size, "%s", m->gguf->kv[i].key);
}

int32_t innerq_model_meta_value(const innerq_model * m, const char * key, char * buf, size_t buf_size) {
    const struct gguf_kv * kv = (m && key) ? gguf_find_kv(m->gguf, key) : NULL;
    return kv ? gguf_kv_to_text(kv, buf, buf_size) : -1;
}

innerq_token innerq_token_bos(const innerq_model * m) { return m ? vocab_bos(m->vocab) : -1; }
innerq_token innerq_token_eos(const innerq_model * m) { return m ? vocab_eos(m->vocab) : -1; }
bool innerq_token_is_eog(const innerq_model * m, innerq_token t) { return m && vocab_is_eog(m->vocab, t); }
bool innerq_vocab_add_bos(const innerq_model * m) { return m && vocab_add_bos(m->vocab); }

// ---- the forward graph ----

bool model_build_graph(const innerq_model * model, struct kv_cache * cache, struct iq_context * ctx,
                       int32_t n_tokens, int32_t n_seq, int32_t n_outputs, bool decode_semantics, bool embeddings,
                       struct llama_graph * out) {
    const struct llama_hparams * hp = &model->hp;
    const int64_t hd = hp->head_dim;
    const float kq_scale = llama_kq_scale(hp);

    struct iq_tensor * tokens = iq_new_tensor_1d(ctx, IQ_TYPE_I32, n_tokens);
    struct iq_tensor * pos = iq_new_tensor_1d(ctx, IQ_TYPE_I32, n_tokens);
    struct iq_tensor * out_ids = iq_new_tensor_1d(ctx, IQ_TYPE_I32, n_outputs);
    struct iq_tensor * seqs = iq_new_tensor_2d(ctx, IQ_TYPE_I32, IQ_KV_S_COUNT, n_seq);
    if (tokens == NULL || pos == NULL || out_ids == NULL || seqs == NULL) {
        return false;
    }
    iq_set_input(tokens);
    iq_set_input(pos);
    iq_set_input(out_ids);
    iq_set_input(seqs);

    struct iq_cgraph * g = iq_new_graph(ctx, 32 * hp->n_layer + 32);
    if (g == NULL) {
        return false;
    }
    struct iq_tensor * x = iq_get_rows(ctx, model->tok_embd, tokens);  // [n_embd, n_tokens]
    for (int32_t il = 0; il < hp->n_layer; il++) {
        const struct llama_layer * L = &model->layers[il];
        struct iq_kv_layer * kv = &cache->layers[il];

        // self-attention
        struct iq_tensor * h = iq_mul(ctx, iq_rms_norm(ctx, x, hp->rms_eps), L->attn_norm);
        struct iq_tensor * qkv[3] = { iq_mul_mat(ctx, L->wq, h), iq_mul_mat(ctx, L->wk, h), iq_mul_mat(ctx, L->wv, h) };
        // the three products of h next to each other in the graph's order (a backend may run
        // them as one launch), before what the graph builds on q
        for (int i = 0; i < 3 && qkv[i] != NULL; i++) {
            iq_graph_expand(g, qkv[i]);
        }
        struct iq_tensor * q = iq_reshape_3d(ctx, qkv[0], hd, hp->n_head, n_tokens);
        struct iq_tensor * k = iq_reshape_3d(ctx, qkv[1], hd, hp->n_head_kv, n_tokens);
        struct iq_tensor * v = iq_reshape_3d(ctx, qkv[2], hd, hp->n_head_kv, n_tokens);
        q = iq_rope(ctx, q, pos, model->rope_freqs, hp->n_rot, hp->rope_freq_base);
        k = iq_rope(ctx, k, pos, model->rope_freqs, hp->n_rot, hp->rope_freq_base);
        if (cache->cfg.rot_k) {
            // q.k is unchanged by an orthonormal rotation of both; the keys' channels even out
            q = iq_mul_mat(ctx, cache->rot, q);
            k = iq_mul_mat(ctx, cache->rot, k);
        }
        if (cache->cfg.rot_v) {
            v = iq_mul_mat(ctx, cache->rot, v);
        }
        if (out->q != NULL) {
            iq_set_output(q);
            out->q[il] = q;
        }
        struct iq_tensor * a = iq_attention(ctx, q, k, v, kv, seqs, cache->pages, kq_scale);
        iq_attention_set_decode_semantics(a, decode_semantics);
        a = iq_kv_store(ctx, a, k, v, kv, seqs, cache->pages);
        if (cache->cfg.rot_v) {
            // the output is a mix of rotated values: rotate it back, per query head (H^-1 = H)
            a = iq_reshape_2d(ctx, iq_mul_mat(ctx, cache->rot, iq_reshape_2d(ctx, a, hd, hp->n_head * (int64_t) n_tokens)),
                              hd * hp->n_head, n_tokens);
        }
        if (il == hp->n_layer - 1 && n_outputs < n_tokens && !embeddings) {
            // only the rows whose logits are wanted go on
            a = iq_get_rows(ctx, a, out_ids);
            x = iq_get_rows(ctx, x, out_ids);
        }
        x = iq_add(ctx, x, iq_mul_mat(ctx, L->wo, a));

        // feed-forward (SwiGLU)
        h = iq_mul(ctx, iq_rms_norm(ctx, x, hp->rms_eps), L->ffn_norm);
        struct iq_tensor * ff = iq_swiglu(ctx, iq_mul_mat(ctx, L->ffn_gate, h), iq_mul_mat(ctx, L->ffn_up, h));
        x = iq_add(ctx, x, iq_mul_mat(ctx, L->ffn_down, ff));
    }
    x = iq_mul(ctx, iq_rms_norm(ctx, x, hp->rms_eps), model->output_norm);
    struct iq_tensor * embd = NULL;
    if (embeddings) {
        // every token's row went on through the last layer; the logits take only theirs
        embd = x;
        iq_set_output(embd);
        iq_set_name(embd, "embd");
        x = n_outputs < n_tokens ? iq_get_rows(ctx, x, out_ids) : x;
    }
    struct iq_tensor * logits = iq_mul_mat(ctx, model->output, x);  // [n_vocab, n_outputs]
    if (logits == NULL) {
        return false;
    }
    iq_set_output(logits);
    iq_set_name(logits, "logits");

    if (!iq_graph_expand(g, logits)) {
        return false;
    }
    out->graph = g;
    out->tokens = tokens;
    out->pos = pos;
    out->out_ids = out_ids;
    out->seqs = seqs;
    out->logits = logits;
    out->embd = embd;
    return true;
}
