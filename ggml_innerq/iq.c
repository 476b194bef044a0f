// Tensors, op constructors and graphs (iq.h).
#include "iq.h"

#include "iq-kv.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#define IQ_ARENA_ALIGN 16

static size_t iq_align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// ---- errors ----

static _Thread_local char iq_error_msg[512];

void iq_error_set(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(iq_error_msg, sizeof(iq_error_msg), fmt, ap);
    va_end(ap);
}

const char * iq_error_get(void) { return iq_error_msg; }

// ---- context ----

struct iq_context {
    char * mem;
    size_t size, used;
    int32_t backend_id;  // of the tensors made in it
};

struct iq_context * iq_context_init(size_t mem_size) {
    struct iq_context * ctx = malloc(sizeof(*ctx));
    char * mem = malloc(mem_size > 0 ? mem_size : 1);
    if (ctx == NULL || mem == NULL) {
        free(ctx);
        free(mem);
        iq_error_set("out of memory for a context of %zu bytes", mem_size);
        return NULL;
    }
    *ctx = (struct iq_context) { .mem = mem, .size = mem_size, .used = 0 };
    return ctx;
}

void iq_context_set_backend_id(struct iq_context * ctx, int32_t backend_id) {
    if (ctx != NULL) {
        ctx->backend_id = backend_id;
    }
}

void iq_context_free(struct iq_context * ctx) {
    if (ctx != NULL) {
        free(ctx->mem);
        free(ctx);
    }
}

static void * iq_context_alloc(struct iq_context * ctx, size_t n) {
    if (ctx == NULL) {
        return NULL;
    }
    n = iq_align_up(n, IQ_ARENA_ALIGN);
    if (ctx->size - ctx->used < n) {
        iq_error_set("context full: %zu of %zu bytes used, %zu more needed", ctx->used, ctx->size, n);
        return NULL;
    }
    void * p = ctx->mem + ctx->used;
    ctx->used += n;
    memset(p, 0, n);
    return p;
}

size_t iq_tensor_overhead(void) { return iq_align_up(sizeof(struct iq_tensor), IQ_ARENA_ALIGN); }

// A graph is the public struct followed by its node and leaf arrays and a pointer set that
// makes iq_graph_expand visit each tensor once.
struct iq_graph_full {
    struct iq_cgraph g;
    size_t hash_size;
    const struct iq_tensor ** hash;  // open addressing, NULL = empty
};

static size_t iq_graph_hash_size(int max_nodes) {
    size_t n = 16;
    while (n < 4 * (size_t) max_nodes) {
        n *= 2;
    }
    return n;
}

size_t iq_graph_overhead(int max_nodes) {
    return iq_align_up(sizeof(struct iq_graph_full), IQ_ARENA_ALIGN) +
           iq_align_up(2 * (size_t) max_nodes * sizeof(struct iq_tensor *), IQ_ARENA_ALIGN) +
           iq_align_up(iq_graph_hash_size(max_nodes) * sizeof(struct iq_tensor *), IQ_ARENA_ALIGN);
}

// ---- tensors ----

static bool iq_tensor_strides(struct iq_tensor * t) {
    const struct iq_type_traits * tt = iq_type_traits_get(t->type);
    if (tt == NULL) {
        iq_error_set("unknown tensor type %d", (int) t->type);
        return false;
    }
    if (t->ne[0] % tt->blck_size != 0) {
        iq_error_set("%s tensor: ne[0] = %lld is not a multiple of the block size %lld", tt->name,
                     (long long) t->ne[0], (long long) tt->blck_size);
        return false;
    }
    t->nb[0] = tt->type_size;
    t->nb[1] = tt->type_size * (size_t) (t->ne[0] / tt->blck_size);
    for (int i = 2; i < IQ_MAX_DIMS; i++) {
        t->nb[i] = t->nb[i - 1] * (size_t) t->ne[i - 1];
    }
    return true;
}

// t's shape ne[0 .. n_dims) (1 beyond) and its contiguous strides; false (+ iq_error_set), t
// unchanged, for a bad shape.
static bool iq_tensor_shape(struct iq_tensor * t, int n_dims, const int64_t * ne) {
    if (n_dims < 1 || n_dims > IQ_MAX_DIMS) {
        iq_error_set("a tensor has 1 to %d dimensions, not %d", IQ_MAX_DIMS, n_dims);
        return false;
    }
    for (int i = 0; i < n_dims; i++) {
        if (ne[i] < 0) {
            iq_error_set("negative tensor dimension ne[%d] = %lld", i, (long long) ne[i]);
            return false;
        }
    }
    struct iq_tensor tmp = *t;
    for (int i = 0; i < IQ_MAX_DIMS; i++) {
        tmp.ne[i] = i < n_dims ? ne[i] : 1;
    }
    if (!iq_tensor_strides(&tmp)) {
        return false;
    }
    *t = tmp;
    return true;
}

bool iq_tensor_set_shape(struct iq_tensor * t, int n_dims, const int64_t * ne) {
    if (t->op != IQ_OP_NONE || t->view_src != NULL) {
        iq_error_set("tensor '%s': only a leaf that is no view can change its shape", t->name);
        return false;
    }
    return iq_tensor_shape(t, n_dims, ne);
}

struct iq_tensor * iq_new_tensor(struct iq_context * ctx, enum iq_type type, int n_dims, const int64_t * ne) {
    struct iq_tensor tmp = { .type = type, .op = IQ_OP_NONE };
    if (!iq_tensor_shape(&tmp, n_dims, ne)) {
        return NULL;
    }
    struct iq_tensor * t = iq_context_alloc(ctx, sizeof(*t));
    if (t != NULL) {
        *t = tmp;
        t->backend_id = ctx->backend_id;
    }
    return t;
}

struct iq_tensor * iq_new_tensor_1d(struct iq_context * ctx, enum iq_type type, int64_t ne0) {
    return iq_new_tensor(ctx, type, 1, (int64_t[]) { ne0 });
}

struct iq_tensor * iq_new_tensor_2d(struct iq_context * ctx, enum iq_type type, int64_t ne0, int64_t ne1) {
    return iq_new_tensor(ctx, type, 2, (int64_t[]) { ne0, ne1 });
}

struct iq_tensor * iq_new_tensor_3d(struct iq_context * ctx, enum iq_type type, int64_t ne0, int64_t ne1,
                                    int64_t ne2) {
    return iq_new_tensor(ctx, type, 3, (int64_t[]) { ne0, ne1, ne2 });
}

int64_t iq_nelements(const struct iq_tensor * t) { return t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3]; }

int64_t iq_nrows(const struct iq_tensor * t) { return t->ne[1] * t->ne[2] * t->ne[3]; }

size_t iq_nbytes(const struct iq_tensor * t) {
    for (int i = 0; i < IQ_MAX_DIMS; i++) {
        if (t->ne[i] <= 0) {
            return 0;
        }
    }
    const struct iq_type_traits * tt = iq_type_traits_get(t->type);
    size_t n = (size_t) (t->ne[0] / tt->blck_size) * t->nb[0];
    for (int i = 1; i < IQ_MAX_DIMS; i++) {
        n += (size_t) (t->ne[i] - 1) * t->nb[i];
    }
    return n;
}

bool iq_is_contiguous(const struct iq_tensor * t) {
    struct iq_tensor c = *t;
    return iq_tensor_strides(&c) && memcmp(c.nb, t->nb, sizeof(c.nb)) == 0;
}

struct iq_tensor * iq_set_name(struct iq_tensor * t, const char * fmt, ...) {
    if (t != NULL) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(t->name, sizeof(t->name), fmt, ap);
        va_end(ap);
    }
    return t;
}

void iq_set_input(struct iq_tensor * t) {
    if (t != NULL) {
        t->flags |= IQ_FLAG_INPUT;
    }
}

void iq_set_output(struct iq_tensor * t) {
    if (t != NULL) {
        t->flags |= IQ_FLAG_OUTPUT;
    }
}

float iq_get_op_param_f32(const struct iq_tensor * t, int i) {
    float v;
    memcpy(&v, &t->op_params[i], sizeof(v));
    return v;
}

void iq_set_op_param_f32(struct iq_tensor * t, int i, float v) { memcpy(&t->op_params[i], &v, sizeof(v)); }

// ---- op constructors ----

// A new f32 result of `op` (every op computes f32) with the given shape and sources.
static struct iq_tensor * iq_new_op(struct iq_context * ctx, enum iq_op op, const int64_t * ne, struct iq_tensor * s0,
                                    struct iq_tensor * s1, struct iq_tensor * s2) {
    struct iq_tensor * t = iq_new_tensor(ctx, IQ_TYPE_F32, IQ_MAX_DIMS, ne);
    if (t != NULL) {
        t->op = op;
        t->src[0] = s0;
        t->src[1] = s1;
        t->src[2] = s2;
    }
    return t;
}

static bool iq_same_shape(const struct iq_tensor * a, const struct iq_tensor * b) {
    return memcmp(a->ne, b->ne, sizeof(a->ne)) == 0;
}

static bool iq_check_f32(const struct iq_tensor * t, const char * op, const char * what) {
    if (t->type != IQ_TYPE_F32) {
        iq_error_set("%s: %s must be f32, not %s", op, what, iq_type_name(t->type));
        return false;
    }
    return true;
}

// A tensor sharing a's data at byte offset offs, with shape ne and strides nb.
static struct iq_tensor * iq_new_view(struct iq_context * ctx, struct iq_tensor * a, const int64_t * ne,
                                      const size_t * nb, size_t offs) {
    struct iq_tensor * t = iq_context_alloc(ctx, sizeof(*t));
    if (t == NULL) {
        return NULL;
    }
    t->type = a->type;
    t->op = IQ_OP_VIEW;
    memcpy(t->ne, ne, sizeof(t->ne));
    memcpy(t->nb, nb, sizeof(t->nb));
    t->src[0] = a;
    t->view_src = a->view_src != NULL ? a->view_src : a;
    t->view_offs = a->view_offs + offs;
    t->buffer = a->buffer;
    t->data = a->data != NULL ? (char *) a->data + offs : NULL;
    return t;
}

static struct iq_tensor * iq_reshape(struct iq_context * ctx, struct iq_tensor * a, int n_dims, const int64_t * ne) {
    if (a == NULL) {
        return NULL;
    }
    struct iq_tensor shape = { .type = a->type };
    int64_t n = 1;
    for (int i = 0; i < IQ_MAX_DIMS; i++) {
        shape.ne[i] = i < n_dims ? ne[i] : 1;
        n *= shape.ne[i];
    }
    if (!iq_is_contiguous(a) || n != iq_nelements(a) || !iq_tensor_strides(&shape)) {
        iq_error_set("reshape of '%s' (%lld elements, %s) to %lld elements", a->name, (long long) iq_nelements(a),
                     iq_is_contiguous(a) ? "contiguous" : "not contiguous", (long long) n);
        return NULL;
    }
    return iq_new_view(ctx, a, shape.ne, shape.nb, 0);
}

struct iq_tensor * iq_reshape_2d(struct iq_context * ctx, struct iq_tensor * a, int64_t ne0, int64_t ne1) {
    return iq_reshape(ctx, a, 2, (int64_t[]) { ne0, ne1 });
}

struct iq_tensor * iq_reshape_3d(struct iq_context * ctx, struct iq_tensor * a, int64_t ne0, int64_t ne1,
                                 int64_t ne2) {
    return iq_reshape(ctx, a, 3, (int64_t[]) { ne0, ne1, ne2 });
}

struct iq_tensor * iq_view_rows(struct iq_context * ctx, struct iq_tensor * a, int64_t i0, int64_t n) {
    if (a == NULL) {
        return NULL;
    }
    if (a->ne[2] != 1 || a->ne[3] != 1 || i0 < 0 || n < 0 || i0 + n > a->ne[1]) {
        iq_error_set("view_rows [%lld, %lld) of '%s' with %lld rows (a 2-D tensor is needed)", (long long) i0,
                     (long long) (i0 + n), a->name, (long long) a->ne[1]);
        return NULL;
    }
    const int64_t ne[IQ_MAX_DIMS] = { a->ne[0], n, 1, 1 };
    size_t nb[IQ_MAX_DIMS] = { a->nb[0], a->nb[1], a->nb[1] * (size_t) n, a->nb[1] * (size_t) n };
    return iq_new_view(ctx, a, ne, nb, (size_t) i0 * a->nb[1]);
}

struct iq_tensor * iq_get_rows(struct iq_context * ctx, struct iq_tensor * a, struct iq_tensor * ids) {
    if (a == NULL || ids == NULL) {
        return NULL;
    }
    if (ids->type != IQ_TYPE_I32 || iq_nelements(ids) != ids->ne[0] || a->ne[2] != 1 || a->ne[3] != 1) {
        iq_error_set("get_rows: needs a 2-D table and an i32 vector of ids (got %s ids)", iq_type_name(ids->type));
        return NULL;
    }
    return iq_new_op(ctx, IQ_OP_GET_ROWS, (int64_t[]) { a->ne[0], ids->ne[0], 1, 1 }, a, ids, NULL);
}

struct iq_tensor * iq_rms_norm(struct iq_context * ctx, struct iq_tensor * a, float eps) {
    if (a == NULL || !iq_check_f32(a, "rms_norm", "the input")) {
        return NULL;
    }
    struct iq_tensor * t = iq_new_op(ctx, IQ_OP_RMS_NORM, a->ne, a, NULL, NULL);
    if (t != NULL) {
        iq_set_op_param_f32(t, 0, eps);
    }
    return t;
}

// Elementwise a (op) b where b repeats over a's rows (b->ne[i] divides a->ne[i], ne[0] equal).
static struct iq_tensor * iq_binary(struct iq_context * ctx, enum iq_op op, struct iq_tensor * a,
                                    struct iq_tensor * b) {
    if (a == NULL || b == NULL) {
        return NULL;
    }
    const char * name = iq_op_name(op);
    if (!iq_check_f32(a, name, "src0") || !iq_check_f32(b, name, "src1")) {
        return NULL;
    }
    bool ok = a->ne[0] == b->ne[0];
    for (int i = 1; i < IQ_MAX_DIMS; i++) {
        ok = ok && b->ne[i] > 0 && a->ne[i] % b->ne[i] == 0;
    }
    if (!ok) {
        iq_error_set("%s: shapes [%lld, %lld, %lld] and [%lld, %lld, %lld] do not broadcast", name,
                     (long long) a->ne[0], (long long) a->ne[1], (long long) a->ne[2], (long long) b->ne[0],
                     (long long) b->ne[1], (long long) b->ne[2]);
        return NULL;
    }
    return iq_new_op(ctx, op, a->ne, a, b, NULL);
}

struct iq_tensor * iq_mul(struct iq_context * ctx, struct iq_tensor * a, struct iq_tensor * b) {
    return iq_binary(ctx, IQ_OP_MUL, a, b);
}

struct iq_tensor * iq_add(struct iq_context * ctx, struct iq_tensor * a, struct iq_tensor * b) {
    return iq_binary(ctx, IQ_OP_ADD, a, b);
}

struct iq_tensor * iq_mul_mat(struct iq_context * ctx, struct iq_tensor * w, struct iq_tensor * x) {
    if (w == NULL || x == NULL) {
        return NULL;
    }
    if (!iq_check_f32(x, "mul_mat", "src1")) {
        return NULL;
    }
    if (w->ne[0] != x->ne[0] || w->ne[2] != 1 || w->ne[3] != 1 || x->nb[0] != sizeof(float)) {
        iq_error_set("mul_mat: weight [%lld, %lld] and input [%lld, %lld] do not match", (long long) w->ne[0],
                     (long long) w->ne[1], (long long) x->ne[0], (long long) x->ne[1]);
        return NULL;
    }
    return iq_new_op(ctx, IQ_OP_MUL_MAT, (int64_t[]) { w->ne[1], x->ne[1], x->ne[2], x->ne[3] }, w, x,
                     NULL);
}

// A gated unit: act(gate) * up, elementwise.
static struct iq_tensor * iq_glu(struct iq_context * ctx, enum iq_op op, struct iq_tensor * gate,
                                 struct iq_tensor * up) {
    if (gate == NULL || up == NULL) {
        return NULL;
    }
    const char * name = iq_op_name(op);
    if (!iq_check_f32(gate, name, "gate") || !iq_check_f32(up, name, "up")) {
        return NULL;
    }
    if (!iq_same_shape(gate, up)) {
        iq_error_set("%s: gate and up of different shapes", name);
        return NULL;
    }
    return iq_new_op(ctx, op, gate->ne, gate, up, NULL);
}

struct iq_tensor * iq_swiglu(struct iq_context * ctx, struct iq_tensor * gate, struct iq_tensor * up) {
    return iq_glu(ctx, IQ_OP_SWIGLU, gate, up);
}

struct iq_tensor * iq_geglu(struct iq_context * ctx, struct iq_tensor * gate, struct iq_tensor * up) {
    return iq_glu(ctx, IQ_OP_GEGLU, gate, up);
}

struct iq_tensor * iq_rope(struct iq_context * ctx, struct iq_tensor * a, struct iq_tensor * pos,
                           struct iq_tensor * freq_factors, int n_rot, float freq_base, float mscale) {
    if (a == NULL || pos == NULL) {
        return NULL;
    }
    if (!iq_check_f32(a, "rope", "the input")) {
        return NULL;
    }
    if (pos->type != IQ_TYPE_I32 || iq_nelements(pos) != a->ne[2] || n_rot <= 0 || n_rot % 2 != 0 ||
        n_rot > a->ne[0] || a->ne[3] != 1 || !(mscale > 0.0f) || !isfinite(mscale)) {
        iq_error_set("rope: input [%lld, %lld, %lld], %lld positions, n_rot %d, mscale %g", (long long) a->ne[0],
                     (long long) a->ne[1], (long long) a->ne[2], (long long) iq_nelements(pos), n_rot, mscale);
        return NULL;
    }
    if (freq_factors != NULL &&
        (freq_factors->type != IQ_TYPE_F32 || iq_nelements(freq_factors) < n_rot / 2)) {
        iq_error_set("rope: freq_factors must be f32 with at least %d elements", n_rot / 2);
        return NULL;
    }
    struct iq_tensor * t = iq_new_op(ctx, IQ_OP_ROPE, a->ne, a, pos, freq_factors);
    if (t != NULL) {
        t->op_params[0] = n_rot;
        iq_set_op_param_f32(t, 1, freq_base);
        iq_set_op_param_f32(t, 2, mscale);
    }
    return t;
}

// The batch's k or v: f32 [head_dim, n_kv_head, n_tokens] matching the layer.
static bool iq_check_kv_batch(const struct iq_tensor * t, const struct iq_kv_layer * layer, int64_t n_tokens,
                              const char * op, const char * what) {
    if (t->type != IQ_TYPE_F32 || t->ne[0] != layer->head_dim || t->ne[1] != layer->n_kv_head ||
        t->ne[2] != n_tokens || t->ne[3] != 1 || t->nb[0] != sizeof(float)) {
        iq_error_set("%s: %s must be f32 [%d, %d, %lld], got %s [%lld, %lld, %lld]", op, what, layer->head_dim,
                     layer->n_kv_head, (long long) n_tokens, iq_type_name(t->type), (long long) t->ne[0],
                     (long long) t->ne[1], (long long) t->ne[2]);
        return false;
    }
    return true;
}

// Records the layer's static configuration and its storage, the step's sequences and the page
// table in op t (iq-kv.h); what the step does per sequence is checked when the op runs
// (iq_kv_seqs_check): the rows are data, set after the graph is built.
static bool iq_kv_attach(struct iq_tensor * t, const struct iq_kv_layer * layer, struct iq_tensor * seqs,
                         struct iq_tensor * pages, const char * op) {
    if (seqs == NULL || pages == NULL || seqs->type != IQ_TYPE_I32 || seqs->ne[0] != IQ_KV_S_COUNT ||
        pages->type != IQ_TYPE_I32 || pages->ne[1] != layer->n_slots) {
        iq_error_set("%s: seqs must be I32 [%d, n_seq], the page table I32 [n_table, %d]", op, IQ_KV_S_COUNT,
                     layer->n_slots);
        return false;
    }
    t->src[IQ_KV_SRC_SEQS] = seqs;
    t->src[IQ_KV_SRC_PAGES] = pages;
    int32_t * p = t->op_params;
    p[IQ_KV_P_N_CTX] = layer->n_ctx;
    p[IQ_KV_P_PAGE] = layer->page;
    p[IQ_KV_P_WINDOW] = layer->window;
    if (!iq_qcache_type_is_quantized(layer->type_k)) {
        if (layer->k == NULL || layer->v == NULL) {
            iq_error_set("%s: the plain cache has no storage", op);
            return false;
        }
        t->src[IQ_KV_SRC_STORAGE] = layer->k;
        t->src[IQ_KV_SRC_STORAGE + 1] = layer->v;
        return true;
    }
    const struct iq_qcache_config * cfg = &layer->qcfg;
    for (int r = 0; r < IQ_QREGION_COUNT; r++) {
        if (layer->region[r] == NULL) {
            iq_error_set("%s: the quantized cache has no storage for region %d", op, r);
            return false;
        }
        t->src[IQ_KV_SRC_STORAGE + r] = layer->region[r];
    }
    p[IQ_KV_P_BITS_K] = cfg->bits_k;
    p[IQ_KV_P_BITS_V] = cfg->bits_v;
    p[IQ_KV_P_GROUP] = cfg->group;
    p[IQ_KV_P_SINK_CAP] = cfg->n_sink;
    p[IQ_KV_P_RECENT_CAP] = cfg->n_recent;
    p[IQ_KV_P_ROPE_DIMS] = cfg->rope_dims;
    p[IQ_KV_P_FLAGS] = IQ_KV_F_QUANTIZED | (cfg->axis_k == IQ_QAXIS_TOKENS ? IQ_KV_F_AXIS_K_TOKENS : 0) |
                       (cfg->axis_v == IQ_QAXIS_TOKENS ? IQ_KV_F_AXIS_V_TOKENS : 0) |
                       (int32_t) cfg->mode << IQ_KV_F_MODE_SHIFT | (cfg->key_norm ? IQ_KV_F_KEY_NORM : 0) |
                       (cfg->score_correction ? IQ_KV_F_SCORE_CORRECTION : 0) |
                       (cfg->value_scales ? IQ_KV_F_VALUE_SCALES : 0) | (cfg->params8 ? IQ_KV_F_PARAMS8 : 0) |
                       (cfg->key_levels ? IQ_KV_F_KEY_LEVELS : 0);
    struct iq_kv_layer check;
    return iq_kv_layer_of_op(t, &check);
}

struct iq_tensor * iq_attention(struct iq_context * ctx, struct iq_tensor * q, struct iq_tensor * k,
                                struct iq_tensor * v, const struct iq_kv_layer * layer, struct iq_tensor * seqs,
                                struct iq_tensor * pages, float scale) {
    if (q == NULL || k == NULL || v == NULL || layer == NULL) {
        return NULL;
    }
    const int64_t n_tokens = q->ne[2];
    if (q->type != IQ_TYPE_F32 || q->ne[0] != layer->head_dim || q->ne[3] != 1 || q->nb[0] != sizeof(float) ||
        layer->n_kv_head <= 0 || q->ne[1] % layer->n_kv_head != 0) {
        iq_error_set("attention: q must be f32 [%d, a multiple of %d, n_tokens]", layer->head_dim, layer->n_kv_head);
        return NULL;
    }
    if (!iq_check_kv_batch(k, layer, n_tokens, "attention", "k") ||
        !iq_check_kv_batch(v, layer, n_tokens, "attention", "v")) {
        return NULL;
    }
    struct iq_tensor * t =
        iq_new_op(ctx, IQ_OP_ATTENTION, (int64_t[]) { q->ne[0] * q->ne[1], n_tokens, 1, 1 }, q, k, v);
    if (t == NULL || !iq_kv_attach(t, layer, seqs, pages, "attention")) {
        return NULL;
    }
    iq_set_op_param_f32(t, IQ_KV_P_SCALE, scale);
    t->op_params[IQ_KV_P_DECODE] = 0;
    return t;
}

void iq_attention_set_decode_semantics(struct iq_tensor * attention, bool on) {
    if (attention != NULL && attention->op == IQ_OP_ATTENTION) {
        attention->op_params[IQ_KV_P_DECODE] = on;
    }
}

struct iq_tensor * iq_kv_store(struct iq_context * ctx, struct iq_tensor * after, struct iq_tensor * k,
                               struct iq_tensor * v, const struct iq_kv_layer * layer, struct iq_tensor * seqs,
                               struct iq_tensor * pages) {
    if (after == NULL || k == NULL || v == NULL || layer == NULL) {
        return NULL;
    }
    const int64_t n_tokens = k->ne[2];
    if (!iq_check_kv_batch(k, layer, n_tokens, "kv_store", "k") ||
        !iq_check_kv_batch(v, layer, n_tokens, "kv_store", "v")) {
        return NULL;
    }
    struct iq_tensor * t = iq_new_view(ctx, after, after->ne, after->nb, 0);
    if (t == NULL) {
        return NULL;
    }
    t->op = IQ_OP_KV_STORE;
    t->src[1] = k;
    t->src[2] = v;
    return iq_kv_attach(t, layer, seqs, pages, "kv_store") ? t : NULL;
}

// ---- graphs ----

struct iq_cgraph * iq_new_graph(struct iq_context * ctx, int max_nodes) {
    if (max_nodes <= 0) {
        iq_error_set("a graph needs room for at least one node");
        return NULL;
    }
    struct iq_graph_full * gf = iq_context_alloc(ctx, iq_graph_overhead(max_nodes));
    if (gf == NULL) {
        return NULL;
    }
    char * p = (char *) gf + iq_align_up(sizeof(*gf), IQ_ARENA_ALIGN);
    gf->g.max_nodes = max_nodes;
    gf->g.nodes = (struct iq_tensor **) p;
    gf->g.leafs = gf->g.nodes + max_nodes;
    gf->hash_size = iq_graph_hash_size(max_nodes);
    gf->hash = (const struct iq_tensor **) (p + iq_align_up(2 * (size_t) max_nodes * sizeof(struct iq_tensor *),
                                                            IQ_ARENA_ALIGN));
    return &gf->g;
}

// Inserts t into the visited set; false if it was there already.
static bool iq_graph_visit(struct iq_graph_full * gf, const struct iq_tensor * t) {
    size_t i = ((uintptr_t) t >> 4) & (gf->hash_size - 1);
    while (gf->hash[i] != NULL) {
        if (gf->hash[i] == t) {
            return false;
        }
        i = (i + 1) & (gf->hash_size - 1);
    }
    gf->hash[i] = t;
    return true;
}

static bool iq_graph_visit_parents(struct iq_graph_full * gf, struct iq_tensor * t) {
    if (!iq_graph_visit(gf, t)) {
        return true;
    }
    for (int i = 0; i < IQ_MAX_SRC; i++) {
        if (t->src[i] != NULL && !iq_graph_visit_parents(gf, t->src[i])) {
            return false;
        }
    }
    struct iq_cgraph * g = &gf->g;
    const bool leaf = t->op == IQ_OP_NONE;
    int * n = leaf ? &g->n_leafs : &g->n_nodes;
    if (*n >= g->max_nodes) {
        iq_error_set("graph full: more than %d %s", g->max_nodes, leaf ? "leafs" : "nodes");
        return false;
    }
    (leaf ? g->leafs : g->nodes)[(*n)++] = t;
    return true;
}

bool iq_graph_expand(struct iq_cgraph * g, struct iq_tensor * t) {
    if (g == NULL || t == NULL) {
        return false;
    }
    return iq_graph_visit_parents((struct iq_graph_full *) g, t);
}

const char * iq_op_name(enum iq_op op) {
    static const char * const names[IQ_OP_COUNT] = {
        [IQ_OP_NONE] = "none",         [IQ_OP_VIEW] = "view",       [IQ_OP_GET_ROWS] = "get_rows",
        [IQ_OP_RMS_NORM] = "rms_norm", [IQ_OP_MUL] = "mul",         [IQ_OP_ADD] = "add",
        [IQ_OP_MUL_MAT] = "mul_mat",   [IQ_OP_ROPE] = "rope",       [IQ_OP_SWIGLU] = "swiglu", [IQ_OP_GEGLU] = "geglu",
        [IQ_OP_ATTENTION] = "attention", [IQ_OP_KV_STORE] = "kv_store",
    };
    return (unsigned) op < IQ_OP_COUNT ? names[op] : "unknown";
}
