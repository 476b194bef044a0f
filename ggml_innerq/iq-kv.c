// Cache types, the layer of a cache op, and the checks and views of a step's sequences (iq-kv.h).
#include "iq-kv.h"

#include "iq-qcache.h"

bool iq_kv_type_is_plain(enum iq_type type) {
    const struct iq_type_traits * tr = iq_type_traits_get(type);
    return type < IQ_TYPE_GGUF_END && tr != NULL && tr->to_float != NULL && tr->from_float != NULL;
}

static struct iq_qcache_config iq_kv_config_of_params(const int32_t * p) {
    const int32_t flags = p[IQ_KV_P_FLAGS];
    return (struct iq_qcache_config) {
        .bits_k = p[IQ_KV_P_BITS_K],
        .bits_v = p[IQ_KV_P_BITS_V],
        .axis_k = flags & IQ_KV_F_AXIS_K_TOKENS ? IQ_QAXIS_TOKENS : IQ_QAXIS_CHANNELS,
        .axis_v = flags & IQ_KV_F_AXIS_V_TOKENS ? IQ_QAXIS_TOKENS : IQ_QAXIS_CHANNELS,
        .group = p[IQ_KV_P_GROUP],
        .n_sink = p[IQ_KV_P_SINK_CAP],
        .n_recent = p[IQ_KV_P_RECENT_CAP],
        .mode = (enum iq_quant_mode) (flags >> IQ_KV_F_MODE_SHIFT & 3),
        .key_norm = (flags & IQ_KV_F_KEY_NORM) != 0,
        .score_correction = (flags & IQ_KV_F_SCORE_CORRECTION) != 0,
        .rope_dims = p[IQ_KV_P_ROPE_DIMS],
        .value_scales = (flags & IQ_KV_F_VALUE_SCALES) != 0,
        .params8 = (flags & IQ_KV_F_PARAMS8) != 0,
        .key_levels = (flags & IQ_KV_F_KEY_LEVELS) != 0,
    };
}

bool iq_kv_layer_of_op(const struct iq_tensor * op, struct iq_kv_layer * layer) {
    const char * name = iq_op_name(op->op);
    if (op->op != IQ_OP_ATTENTION && op->op != IQ_OP_KV_STORE) {
        iq_error_set("%s: not a KV cache op", name);
        return false;
    }
    const int32_t * p = op->op_params;
    const struct iq_tensor * pages = op->src[IQ_KV_SRC_PAGES];
    const struct iq_tensor * first = op->src[IQ_KV_SRC_STORAGE];
    if (op->src[IQ_KV_SRC_SEQS] == NULL || pages == NULL || first == NULL) {
        iq_error_set("%s: the KV cache op has no sequences, page table or storage", name);
        return false;
    }
    *layer = (struct iq_kv_layer) {
        .head_dim = (int32_t) op->src[1]->ne[0], .n_kv_head = (int32_t) op->src[1]->ne[1],
        .n_ctx = p[IQ_KV_P_N_CTX], .page = p[IQ_KV_P_PAGE], .n_slots = (int32_t) pages->ne[1],
        .window = p[IQ_KV_P_WINDOW],
    };
    if (layer->window < 0) {
        iq_error_set("%s: sliding window %d", name, layer->window);
        return false;
    }
    if (!(p[IQ_KV_P_FLAGS] & IQ_KV_F_QUANTIZED)) {
        layer->k = op->src[IQ_KV_SRC_STORAGE];
        layer->v = op->src[IQ_KV_SRC_STORAGE + 1];
        if (layer->v == NULL || layer->page < 1 || layer->k->ne[1] % layer->page != 0 ||
            layer->v->ne[1] != layer->k->ne[1] || layer->k->ne[0] != layer->head_dim ||
            layer->v->ne[0] != layer->head_dim || layer->k->ne[2] != layer->n_kv_head ||
            layer->v->ne[2] != layer->n_kv_head) {
            iq_error_set("%s: the plain cache's storage does not match its pages or the batch's shape", name);
            return false;
        }
        layer->type_k = layer->k->type;
        layer->type_v = layer->v->type;
        layer->n_pages = (int32_t) (layer->k->ne[1] / layer->page);
        return true;
    }
    layer->qcfg = iq_kv_config_of_params(p);
    iq_qcache_types(&layer->qcfg, &layer->type_k, &layer->type_v);
    layer->n_pages = (int32_t) op->src[IQ_KV_SRC_STORAGE + IQ_QREGION_QUANT_K]->ne[1];
    struct iq_qcache c;
    if (!iq_qcache_pool_layout(&c, &layer->qcfg, layer->head_dim, layer->n_kv_head, layer->n_ctx, layer->n_slots,
                               layer->n_pages)) {
        return false;
    }
    for (int r = 0; r < IQ_QREGION_COUNT; r++) {
        const struct iq_tensor * t = op->src[IQ_KV_SRC_STORAGE + r];
        if (t == NULL || iq_nbytes(t) < c.bytes[r]) {
            iq_error_set("%s: region %d of the quantized cache is missing or too small", name, r);
            return false;
        }
        layer->region[r] = (struct iq_tensor *) t;
    }
    if (layer->page != layer->qcfg.group) {
        iq_error_set("%s: a quantized cache's page is one block (%d tokens), not %d", name, layer->qcfg.group,
                     layer->page);
        return false;
    }
    return true;
}

// The view of sequence s before the checks of its counters (iq_kv_qcache_of_seq's).
static void iq_kv_qview(const struct iq_tensor * op, const struct iq_kv_layer * layer, const struct iq_kv_seq * s,
                        struct iq_qcache * c) {
    iq_qcache_pool_layout(c, &layer->qcfg, layer->head_dim, layer->n_kv_head, layer->n_ctx, layer->n_slots,
                          layer->n_pages);  // checked by iq_kv_layer_of_op
    for (int r = 0; r < IQ_QREGION_COUNT; r++) {
        c->region[r] = layer->region[r]->data;
    }
    iq_qcache_view(c, s->slot, iq_kv_pages_of_op(op, s->slot), iq_kv_n_table(op));
    c->n_tokens = s->n_past;
    c->n_sink = s->n_sink;
    c->n_quant = s->n_quant;
    c->n_recent = s->n_past - s->n_sink - s->n_quant;
}

bool iq_kv_seqs_check(const struct iq_tensor * op, const struct iq_kv_layer * layer) {
    const char * name = iq_op_name(op->op);
    const struct iq_tensor * st = op->src[IQ_KV_SRC_SEQS];
    const struct iq_tensor * pt = op->src[IQ_KV_SRC_PAGES];
    if (st->type != IQ_TYPE_I32 || st->ne[0] != IQ_KV_S_COUNT || !iq_is_contiguous(st) || pt->type != IQ_TYPE_I32 ||
        pt->nb[0] != sizeof(int32_t) || st->data == NULL || pt->data == NULL) {
        iq_error_set("%s: seqs must be I32 [%d, n_seq] and the page table I32 [n_table, n_slots]", name,
                     IQ_KV_S_COUNT);
        return false;
    }
    const int64_t n_tokens = op->src[1]->ne[2];
    const struct iq_kv_seq * seqs = iq_kv_seqs_of_op(op);
    int64_t next = 0;  // the sequences' tokens one after the other, in order, cover the batch
    for (int32_t i = 0; i < iq_kv_n_seq(op); i++) {
        const struct iq_kv_seq * s = &seqs[i];
        if (s->slot < 0 || s->slot >= layer->n_slots || s->token0 != next || s->n_tokens < 1 ||
            s->n_tokens > n_tokens - s->token0 || s->n_past < 0 || s->n_past > layer->n_ctx - s->n_tokens) {
            iq_error_set("%s: sequence %d (slot %d, tokens [%d, +%d) of %lld, %d stored) does not fit the batch or "
                         "the cache (%d slots of %d tokens)", name, i, s->slot, s->token0, s->n_tokens,
                         (long long) n_tokens, s->n_past, layer->n_slots, layer->n_ctx);
            return false;
        }
        next += s->n_tokens;
        for (int32_t j = 0; j < i; j++) {
            if (seqs[j].slot == s->slot) {
                iq_error_set("%s: slot %d appears twice in one step", name, s->slot);
                return false;
            }
        }
        if (layer->k != NULL) {
            const int32_t used = (s->n_past + s->n_tokens + layer->page - 1) / layer->page;
            const int32_t * pages = iq_kv_pages_of_op(op, s->slot);
            if (used > iq_kv_n_table(op)) {
                iq_error_set("%s: %d pages, the page table has %d entries", name, used, iq_kv_n_table(op));
                return false;
            }
            for (int32_t j = 0; j < used; j++) {
                if (pages[j] < 0 || pages[j] >= layer->n_pages) {
                    iq_error_set("%s: page %d of slot %d is %d, not one of the pool's %d", name, j, s->slot, pages[j],
                                 layer->n_pages);
                    return false;
                }
            }
            continue;
        }
        struct iq_qcache c;
        iq_kv_qview(op, layer, s, &c);
        if (!iq_qcache_store_check(&c, &s->flush, s->n_tokens)) {
            return false;
        }
        if (layer->n_pages == 0 && layer->window > 0 && c.n_quant > 0 && c.n_recent < layer->window - 1) {
            // a layer without blocks reads the sliding window from its f16 rows alone
            iq_error_set("%s: slot %d's window holds %d rows, fewer than the sliding window's %d before a query "
                         "(a layer without quantized blocks)", name, s->slot, c.n_recent, layer->window - 1);
            return false;
        }
    }
    if (next != n_tokens) {
        iq_error_set("%s: the sequences hold %lld of the batch's %lld tokens", name, (long long) next,
                     (long long) n_tokens);
        return false;
    }
    return true;
}

void iq_kv_qcache_of_seq(const struct iq_tensor * op, const struct iq_kv_layer * layer, int32_t s,
                         struct iq_qcache * c, struct iq_qcache_flush * flush) {
    const struct iq_kv_seq * seq = &iq_kv_seqs_of_op(op)[s];
    iq_kv_qview(op, layer, seq, c);
    *flush = seq->flush;
}
