// The pieces of a forward graph that every architecture shares: the inputs, the attention over
// the KV cache (with the cache's rotation), the output head.
#include "model-impl.h"

struct iq_tensor * graph_inputs(struct model_graph * b) {
    struct iq_context * ctx = b->ctx;
    struct llama_graph * out = b->out;
    iq_context_set_backend_id(ctx, b->model->dev_in);
    out->tokens = iq_new_tensor_1d(ctx, IQ_TYPE_I32, b->n_tokens);
    out->pos = iq_new_tensor_1d(ctx, IQ_TYPE_I32, b->n_tokens);
    out->out_ids = iq_new_tensor_1d(ctx, IQ_TYPE_I32, b->n_outputs);
    out->seqs = iq_new_tensor_2d(ctx, IQ_TYPE_I32, IQ_KV_S_COUNT, b->n_seq);
    b->g = iq_new_graph(ctx, MODEL_GRAPH_NODES_PER_LAYER * b->model->hp.n_layer + 32);
    if (out->tokens == NULL || out->pos == NULL || out->out_ids == NULL || out->seqs == NULL || b->g == NULL) {
        return NULL;
    }
    iq_set_input(out->tokens);
    iq_set_input(out->pos);
    iq_set_input(out->out_ids);
    iq_set_input(out->seqs);
    struct iq_tensor * x = iq_get_rows(ctx, b->model->tok_embd, out->tokens);  // [n_embd, n_tokens]
    return b->model->embd_scale != NULL ? iq_mul(ctx, x, b->model->embd_scale) : x;
}

void graph_layer(struct model_graph * b, int32_t il) { iq_context_set_backend_id(b->ctx, b->model->layer_dev[il]); }

struct iq_tensor * graph_norm(const struct model_graph * b, struct iq_tensor * x, struct iq_tensor * w) {
    return iq_mul(b->ctx, iq_rms_norm(b->ctx, x, b->model->hp.rms_eps), w);
}

void graph_qkv(struct model_graph * b, const struct llama_layer * L, struct iq_tensor * h, struct iq_tensor ** q,
               struct iq_tensor ** k, struct iq_tensor ** v) {
    const struct llama_hparams * hp = &b->model->hp;
    struct iq_context * ctx = b->ctx;
    struct iq_tensor * qkv[3] = { iq_mul_mat(ctx, L->wq, h), iq_mul_mat(ctx, L->wk, h), iq_mul_mat(ctx, L->wv, h) };
    // the three products of h next to each other in the graph's order (a backend may run them
    // as one launch), before what the graph builds on them
    for (int i = 0; i < 3 && qkv[i] != NULL; i++) {
        iq_graph_expand(b->g, qkv[i]);
    }
    struct iq_tensor * bias[3] = { L->bq, L->bk, L->bv };
    for (int i = 0; i < 3; i++) {
        qkv[i] = bias[i] != NULL ? iq_add(ctx, qkv[i], bias[i]) : qkv[i];
    }
    *q = iq_reshape_3d(ctx, qkv[0], hp->head_dim, hp->n_head, b->n_tokens);
    *k = iq_reshape_3d(ctx, qkv[1], hp->head_dim, hp->n_head_kv, b->n_tokens);
    *v = iq_reshape_3d(ctx, qkv[2], hp->head_dim, hp->n_head_kv, b->n_tokens);
}

struct iq_tensor * graph_rope(const struct model_graph * b, int32_t il, struct iq_tensor * t) {
    const innerq_model * m = b->model;
    const struct llama_hparams * hp = &m->hp;
    const bool swa = hparams_layer_is_swa(hp, il);
    struct iq_tensor * freqs = swa ? m->rope_freqs_swa : m->rope_freqs;
    if (freqs == NULL && m->rope_long != NULL) {
        // LongRoPE: the long factors for a context longer than the original (llama.cpp's rule)
        freqs = b->cache->layers[il].n_ctx > hp->n_ctx_orig ? m->rope_long : m->rope_short;
    }
    return iq_rope(b->ctx, t, b->out->pos, freqs, hp->n_rot, swa ? hp->rope_freq_base_swa : hp->rope_freq_base,
                   swa ? 1.0f : hp->rope_mscale);
}

struct iq_tensor * graph_attention(struct model_graph * b, int32_t il, struct iq_tensor * q, struct iq_tensor * k,
                                   struct iq_tensor * v) {
    const struct llama_hparams * hp = &b->model->hp;
    struct iq_context * ctx = b->ctx;
    struct kv_cache * cache = b->cache;
    struct iq_kv_layer * kv = &cache->layers[il];
    const int32_t dev = cache->layer_dev[il];  // the layer's storage, page table and rotation
    if (cache->cfg.rot_k) {
        // q.k is unchanged by an orthonormal rotation of both; the keys' channels even out
        q = iq_mul_mat(ctx, cache->rot[dev], q);
        k = iq_mul_mat(ctx, cache->rot[dev], k);
    }
    if (cache->cfg.rot_v) {
        v = iq_mul_mat(ctx, cache->rot[dev], v);
    }
    if (b->out->q != NULL) {
        iq_set_output(q);
        b->out->q[il] = q;
    }
    if (b->out->k != NULL) {  // a measuring step: the rows as outputs, nothing stored
        iq_set_output(k);
        iq_set_output(v);
        b->out->k[il] = k;
        b->out->v[il] = v;
    }
    struct iq_tensor * a = iq_attention(ctx, q, k, v, kv, b->out->seqs, cache->pages[dev], hp->kq_scale);
    iq_attention_set_decode_semantics(a, b->decode_semantics);
    if (b->out->k == NULL) {
        a = iq_kv_store(ctx, a, k, v, kv, b->out->seqs, cache->pages[dev]);
    }
    if (cache->cfg.rot_v) {
        // the output is a mix of rotated values: rotate it back, per query head (H^-1 = H)
        const int64_t hd = hp->head_dim;
        a = iq_reshape_2d(ctx, iq_mul_mat(ctx, cache->rot[dev], iq_reshape_2d(ctx, a, hd, hp->n_head * (int64_t) b->n_tokens)),
                          hd * hp->n_head, b->n_tokens);
    }
    return a;
}

void graph_keep_outputs(const struct model_graph * b, int32_t il, struct iq_tensor ** a, struct iq_tensor ** x) {
    if (il == b->model->hp.n_layer - 1 && b->n_outputs < b->n_tokens && !b->embeddings) {
        *a = iq_get_rows(b->ctx, *a, b->out->out_ids);
        *x = iq_get_rows(b->ctx, *x, b->out->out_ids);
    }
}

bool graph_output(struct model_graph * b, struct iq_tensor * x) {
    struct iq_context * ctx = b->ctx;
    struct llama_graph * out = b->out;
    iq_context_set_backend_id(ctx, b->model->dev_out);
    x = graph_norm(b, x, b->model->output_norm);
    out->embd = NULL;
    if (b->embeddings) {
        // every token's row went on through the last layer; the logits take only theirs
        out->embd = x;
        iq_set_output(x);
        iq_set_name(x, "embd");
        x = b->n_outputs < b->n_tokens ? iq_get_rows(ctx, x, out->out_ids) : x;
    }
    out->logits = iq_mul_mat(ctx, b->model->output, x);  // [n_vocab, n_outputs]
    if (out->logits == NULL) {
        return false;
    }
    iq_set_output(out->logits);
    iq_set_name(out->logits, "logits");
    out->graph = b->g;
    return iq_graph_expand(b->g, out->logits);
}
