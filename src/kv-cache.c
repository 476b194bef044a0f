#include "kv-cache.h"

#include "device.h"
#include "hparams.h"
#include "status.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define KV_DEFAULT_TYPE_K IQ_TYPE_INNERQ3  // the "innerq" preset is the default cache
#define KV_DEFAULT_TYPE_V IQ_TYPE_INNERQ2

static bool name_given(const char * name) { return name != NULL && name[0] != '\0'; }

static bool innerq_type(enum iq_type t) {
    return t == IQ_TYPE_INNERQ2 || t == IQ_TYPE_INNERQ3 || t == IQ_TYPE_INNERQ4 || t == IQ_TYPE_INNERQ5;
}

static enum iq_type innerq_type_of_bits(int32_t bits) {
    return bits == 2 ? IQ_TYPE_INNERQ2 : bits == 3 ? IQ_TYPE_INNERQ3 : bits == 4 ? IQ_TYPE_INNERQ4 : IQ_TYPE_INNERQ5;
}

// the bits kv_layer_bits may give a layer's keys or values (innerq2 .. innerq5)
#define KV_LAYER_BITS_MIN 2
#define KV_LAYER_BITS_MAX 5

// the floors of the default windows (kv_sink, kv_recent -1): the fixed windows of earlier releases
#define KV_SINK_MIN 32
#define KV_RECENT_MIN 96

// The InnerQ types' names before 0.2, which read like ggml's i-quant weight types (IQ2_XXS,
// IQ4_NL); accepted until 0.3 so that scripts keep working for one release.
static const char * const kv_type_aliases[][2] = {{"iq2", "innerq2"}, {"iq3", "innerq3"}, {"iq4", "innerq4"}};

static innerq_status kv_type_parse(const char * name, bool is_v, enum iq_type * out) {
    if (!name_given(name)) {
        *out = is_v ? KV_DEFAULT_TYPE_V : KV_DEFAULT_TYPE_K;
        return INNERQ_OK;
    }
    if (strcmp(name, "innerq") == 0) {  // the reference configuration (docs/DESIGN.md section 3)
        *out = is_v ? IQ_TYPE_INNERQ2 : IQ_TYPE_INNERQ3;
        return INNERQ_OK;
    }
    for (size_t i = 0; i < sizeof(kv_type_aliases) / sizeof(kv_type_aliases[0]); i++) {
        name = strcmp(name, kv_type_aliases[i][0]) == 0 ? kv_type_aliases[i][1] : name;
    }
    for (int t = 0; t < IQ_TYPE_COUNT; t++) {
        if (iq_kv_type_is_cache((enum iq_type) t) && strcmp(iq_type_name((enum iq_type) t), name) == 0) {
            *out = (enum iq_type) t;
            return INNERQ_OK;
        }
    }
    char names[256] = "";
    for (int32_t i = 0; i < innerq_kv_type_count(); i++) {
        strncat(names, i ? ", " : "", sizeof(names) - strlen(names) - 1);
        strncat(names, innerq_kv_type_name(i), sizeof(names) - strlen(names) - 1);
    }
    return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "unknown KV cache type '%s' (known: %s)", name, names);
}

innerq_status kv_cache_config(const innerq_context_params * p, int32_t head_dim, bool gpu, enum iq_type * type_k,
                              enum iq_type * type_v, struct iq_qcache_config * qcfg) {
    // one name given: it names both (a preset gives each its own type)
    const char * kv_k = name_given(p->kv_k) ? p->kv_k : p->kv_v;
    const char * kv_v = name_given(p->kv_v) ? p->kv_v : p->kv_k;
    innerq_status st = kv_type_parse(kv_k, false, type_k);
    if (st == INNERQ_OK) {
        st = kv_type_parse(kv_v, true, type_v);
    }
    if (st != INNERQ_OK) {
        return st;
    }
    // the automatic layout chooses each layer's InnerQ bits: a type that names bits contradicts it
    const bool auto_bits = p->kv_bits != 0.0f;
    if (auto_bits && ((name_given(kv_k) && strcmp(kv_k, "innerq") != 0) ||
                      (name_given(kv_v) && strcmp(kv_v, "innerq") != 0))) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_bits %g chooses the bits itself: it needs the InnerQ "
                           "cache (kv_k / kv_v unset or \"innerq\"), not %s/%s", p->kv_bits, kv_k, kv_v);
    }
    if (auto_bits && name_given(p->kv_layer_bits)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_bits and kv_layer_bits both set the layers' bits: give one");
    }
    const bool qk = iq_qcache_type_is_quantized(*type_k), qv = iq_qcache_type_is_quantized(*type_v);
    if (qk != qv) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "KV cache %s/%s: keys and values must both be quantized (InnerQ or KIVI) or both plain",
                           iq_type_name(*type_k), iq_type_name(*type_v));
    }
    if (!innerq_type(*type_k) && name_given(p->kv_layer_bits)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_layer_bits needs an InnerQ cache, not %s/%s",
                           iq_type_name(*type_k), iq_type_name(*type_v));
    }
    if (!qk) {
        return INNERQ_OK;
    }
    int32_t group = p->kv_group;
    if (!name_given(kv_k) && group == 0) {
        // the default cache fits itself to the model: the backend's group if it divides
        // head_dim, else the largest group that does
        const int32_t g = device_kv_group_default(gpu);
        group = head_dim % g == 0 ? g : head_dim % 64 == 0 ? 64 : head_dim % 32 == 0 ? 32 : 0;
        if (group == 0 && (auto_bits || name_given(p->kv_layer_bits))) {
            return innerq_fail(INNERQ_ERR_UNSUPPORTED, "kv_bits / kv_layer_bits: no InnerQ group divides head_dim %d",
                               head_dim);
        }
        if (group == 0) {
            *type_k = *type_v = IQ_TYPE_F16;
            return INNERQ_OK;
        }
    }
    group = group != 0 ? group : device_kv_group_default(gpu);
    if (!iq_qcache_config_default(*type_k, *type_v, group, qcfg)) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "%s", iq_error_get());
    }
    if (innerq_type(*type_k)) {
        // the InnerQ knobs (KIVI keeps its own definition: no sink, R = 128, asymmetric)
        qcfg->n_sink = p->kv_sink >= 0 ? p->kv_sink : qcfg->n_sink;
        qcfg->n_recent = p->kv_recent >= 0 ? p->kv_recent : qcfg->n_recent;
        qcfg->mode = !p->kv_hybrid ? IQ_QUANT_ASYM : p->kv_search ? IQ_QUANT_SEARCH : IQ_QUANT_HYBRID;
        qcfg->key_norm = p->kv_norm;
        qcfg->score_correction = p->kv_debias;
    }
    if (auto_bits) {
        const double lo = kv_auto_bits_min(group), hi = kv_auto_bits_max(group);
        if (!isfinite(p->kv_bits) || p->kv_bits < lo - 1e-6 || p->kv_bits > hi + 1e-6) {
            return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_bits %g is out of range: %.3g .. %.3g bits per element at "
                               "group %d (2- to 5-bit keys and values, (d, m) included)", p->kv_bits, lo, hi, group);
        }
        // until the layout is chosen every layer holds the smallest format
        *type_k = *type_v = IQ_TYPE_INNERQ2;
        qcfg->bits_k = qcfg->bits_v = KV_AUTO_BITS_MIN;
    }
    return kv_layer_bits_parse(p->kv_layer_bits, 0, NULL);
}

innerq_status kv_layer_bits_parse(const char * spec, int32_t n_layer, int32_t (*bits)[2]) {
    for (const char * s = spec; name_given(s);) {
        char * end;
        errno = 0;
        const long il = strtol(s, &end, 10);
        long b[2] = {0, 0};
        bool ok = end != s && *end == ':' && errno == 0 && il >= 0 && (n_layer == 0 || il < n_layer);
        for (int x = 0; x < 2 && ok; x++) {
            const char * at = end + 1;
            b[x] = strtol(at, &end, 10);
            ok = end != at && b[x] >= KV_LAYER_BITS_MIN && b[x] <= KV_LAYER_BITS_MAX && (x == 1 || *end == ':');
        }
        ok = ok && (*end == ',' || *end == '\0');
        if (!ok) {
            return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_layer_bits '%s': expected LAYER:K:V items separated by "
                               "commas, a layer of the model (0 .. n_layer - 1) and bits 2 to 5", spec);
        }
        if (bits != NULL) {
            bits[il][0] = (int32_t) b[0];
            bits[il][1] = (int32_t) b[1];
        }
        s = *end == ',' ? end + 1 : NULL;
    }
    return INNERQ_OK;
}

// The preset first: it is the default, and a name kv_k / kv_v accept like the types.
int32_t innerq_kv_type_count(void) {
    int32_t n = 1;
    for (int t = 0; t < IQ_TYPE_COUNT; t++) {
        n += iq_kv_type_is_cache((enum iq_type) t);
    }
    return n;
}

const char * innerq_kv_type_name(int32_t i) {
    if (i-- == 0) {
        return "innerq";
    }
    for (int t = 0; t < IQ_TYPE_COUNT; t++) {
        if (iq_kv_type_is_cache((enum iq_type) t) && i-- == 0) {
            return iq_type_name((enum iq_type) t);
        }
    }
    return NULL;
}

double kv_cache_bytes_per_token(const struct llama_hparams * hp, enum iq_type type_k, enum iq_type type_v,
                                const struct iq_qcache_config * qcfg, double kv_bits) {
    const double heads = (double) hp->n_layer * hp->n_head_kv;
    if (iq_qcache_type_is_quantized(type_k)) {
        const double per_group = 32.0 / qcfg->group;  // fp16 (d, m) per group
        const double codes = kv_bits > 0.0 ? (double) kv_auto_units(kv_bits, qcfg->group, hp->n_layer) / hp->n_layer
                                           : qcfg->bits_k + qcfg->bits_v;
        return heads * hp->head_dim * (codes + 2.0 * per_group) / 8.0;
    }
    return heads * (double) (iq_row_size(type_k, hp->head_dim) + iq_row_size(type_v, hp->head_dim));
}

static size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Plain storage: a k and a v tensor per layer; returns the bytes they need.
static innerq_status kv_plain_layout(struct kv_cache * c, const struct llama_hparams * hp, size_t * total) {
    if (iq_row_size(c->type_k, hp->head_dim) == 0 || iq_row_size(c->type_v, hp->head_dim) == 0) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "KV cache types %s/%s need head_dim (%d) to be a multiple of their block size",
                           iq_type_name(c->type_k), iq_type_name(c->type_v), hp->head_dim);
    }
    c->ctx = iq_context_init((size_t) (2 * hp->n_layer + 1) * iq_tensor_overhead());
    if (c->ctx == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory allocating the KV cache");
    }
    *total = 0;
    for (int32_t il = 0; il < hp->n_layer; il++) {
        struct iq_kv_layer * l = &c->layers[il];
        l->k = iq_new_tensor_3d(c->ctx, c->type_k, hp->head_dim, c->n_ctx, hp->n_head_kv);
        l->v = iq_new_tensor_3d(c->ctx, c->type_v, hp->head_dim, c->n_ctx, hp->n_head_kv);
        if (l->k == NULL || l->v == NULL) {
            return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "KV cache: %s", iq_error_get());
        }
        iq_set_name(l->k, "cache_k.%d", il);
        iq_set_name(l->v, "cache_v.%d", il);
        *total += align_up(iq_nbytes(l->k), c->align) + align_up(iq_nbytes(l->v), c->align);
    }
    return INNERQ_OK;
}

static bool kv_region_pooled(const struct kv_cache * c, int r) {
    return c->kv_bits > 0.0 && (r == IQ_QREGION_QUANT_K || r == IQ_QREGION_QUANT_V);
}

// Bytes of a layer's own block: every region, or with the automatic layout the windows and
// norms only (the regions before the quantized ones; their offsets do not depend on the bits).
static size_t kv_layer_bytes(const struct kv_cache * c, const struct iq_qcache * lay) {
    return c->kv_bits > 0.0 ? lay->off[IQ_QREGION_QUANT_K] : lay->size;
}

// The pool of the automatic layout: the quantized blocks of every layer at a total of `units`
// code bits (a block's bytes are linear in its bits: codes G*D*b/8, then (d, m)), each region
// aligned.
static size_t kv_pool_bytes(const struct kv_cache * c, const struct iq_qcache * lay) {
    const size_t d = (size_t) lay->head_dim, g = (size_t) c->qcfg.group;
    const size_t per_bit = iq_qblock_bytes(3, (int32_t) d, (int32_t) g) - iq_qblock_bytes(2, (int32_t) d, (int32_t) g);
    const size_t params = iq_qblock_bytes(2, (int32_t) d, (int32_t) g) - 2 * per_bit;
    const size_t per_head = per_bit * (size_t) c->units + params * 2 * (size_t) c->n_layer;
    return (size_t) lay->n_kv_head * lay->cap_blocks * per_head + 2 * (size_t) c->n_layer * c->align;
}

// Places the quantized regions of every layer in the pool, in order (automatic layout).
static void kv_pool_place(struct kv_cache * c) {
    size_t off = c->pool_off;
    for (int32_t il = 0; il < c->n_layer; il++) {
        for (int r = IQ_QREGION_QUANT_K; r <= IQ_QREGION_QUANT_V; r++) {
            iq_tensor_place(c->layers[il].region[r], c->buf, off);
            off += align_up(iq_nbytes(c->layers[il].region[r]), c->align);
        }
    }
}

// Gives every layer the bits bits[il] (keys, values; NULL: the smallest format, as before the
// automatic layout's choice): its configuration, types and quantized regions' shapes, then
// places them in the pool (automatic layout; units bounds the total).
static void kv_layout_set(struct kv_cache * c, const int32_t (*bits)[2]) {
    for (int32_t il = 0; il < c->n_layer; il++) {
        struct iq_kv_layer * l = &c->layers[il];
        l->qcfg.bits_k = bits ? bits[il][0] : KV_AUTO_BITS_MIN;
        l->qcfg.bits_v = bits ? bits[il][1] : KV_AUTO_BITS_MIN;
        l->type_k = innerq_type_of_bits(l->qcfg.bits_k);
        l->type_v = innerq_type_of_bits(l->qcfg.bits_v);
        struct iq_qcache lay;
        iq_qcache_layout(&lay, &l->qcfg, l->head_dim, l->n_kv_head, l->n_ctx);  // checked at init
        for (int r = IQ_QREGION_QUANT_K; r <= IQ_QREGION_QUANT_V; r++) {
            enum iq_type type;
            int64_t ne[3];
            iq_qcache_region_shape(&lay, (enum iq_qregion) r, &type, ne);
            iq_tensor_set_shape(l->region[r], 3, ne);  // a leaf of type I8: cannot fail
        }
    }
    kv_pool_place(c);
    c->layout_ready = bits != NULL;
}

// Quantized storage: per layer one tensor per region, at the offsets of iq_qcache_layout of
// the layer's configuration (so the buffer is the same as one block per layer); with the
// automatic layout the quantized regions go to the pool after the layers' blocks. Returns the
// bytes they need.
static innerq_status kv_quant_layout(struct kv_cache * c, const struct llama_hparams * hp, size_t * total) {
    c->ctx = iq_context_init((size_t) (IQ_QREGION_COUNT * hp->n_layer + 2) * iq_tensor_overhead());
    if (c->ctx == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory allocating the KV cache");
    }
    *total = 0;
    struct iq_qcache lay;
    for (int32_t il = 0; il < hp->n_layer; il++) {
        struct iq_kv_layer * l = &c->layers[il];
        if (!iq_qcache_layout(&lay, &l->qcfg, hp->head_dim, hp->n_head_kv, c->n_ctx)) {
            return innerq_fail(INNERQ_ERR_UNSUPPORTED, "KV cache %s/%s: %s", iq_type_name(l->type_k),
                               iq_type_name(l->type_v), iq_error_get());
        }
        for (int r = 0; r < IQ_QREGION_COUNT; r++) {
            enum iq_type type;
            int64_t ne[3];
            iq_qcache_region_shape(&lay, (enum iq_qregion) r, &type, ne);
            l->region[r] = iq_new_tensor_3d(c->ctx, type, ne[0], ne[1], ne[2]);
            if (l->region[r] == NULL) {
                return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "KV cache: %s", iq_error_get());
            }
            iq_set_name(l->region[r], "cache_q%d.%d", r, il);
        }
        *total += align_up(kv_layer_bytes(c, &lay), c->align);
    }
    if (c->kv_bits > 0.0) {
        c->pool_off = *total;
        c->pool_size = kv_pool_bytes(c, &lay);
        *total += align_up(c->pool_size, c->align);
    }
    if (c->rot_k || c->rot_v) {
        c->rot = iq_new_tensor_2d(c->ctx, IQ_TYPE_F32, hp->head_dim, hp->head_dim);
        if (c->rot == NULL) {
            return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "KV cache: %s", iq_error_get());
        }
        iq_set_name(c->rot, "cache_rot");
        c->rot->flags |= IQ_FLAG_HADAMARD;  // kv_rotation's S H S is T H T with T = s_0 S
        *total += align_up(iq_nbytes(c->rot), c->align);
    }
    return INNERQ_OK;
}

// A fixed sign of channel i, +1 or -1 (bit 16 of Knuth's multiplicative hash of i).
static int kv_rot_sign(int32_t i) { return ((uint32_t) i * 2654435761u >> 16) & 1 ? -1 : 1; }

// The rotation of order n (a power of two): R = S H S, H the orthonormal Sylvester-Hadamard
// matrix (H_ij = (-1)^popcount(i & j) / sqrt(n)) and S = diag(kv_rot_sign). R is orthonormal
// and symmetric, so it is its own inverse as H is; the signs keep the rows of H (the first is
// all ones) from lining up with structure the keys have after RoPE (docs/INNERQ.md).
static void kv_rotation(float * r, int32_t n) {
    const float s = 1.0f / sqrtf((float) n);
    for (int32_t i = 0; i < n; i++) {
        for (int32_t j = 0; j < n; j++) {
            const int sign = (__builtin_popcount((unsigned) (i & j)) % 2 ? -1 : 1) * kv_rot_sign(i) * kv_rot_sign(j);
            r[(size_t) i * n + j] = sign < 0 ? -s : s;
        }
    }
}

bool kv_rot_supported(int32_t head_dim) { return head_dim >= 16 && head_dim <= 256 && (head_dim & (head_dim - 1)) == 0; }

// Places every layer's tensors in the buffer, in order, then the pool and the rotation.
static void kv_place(struct kv_cache * c) {
    size_t off = 0;
    for (int32_t il = 0; il < c->n_layer; il++) {
        struct iq_kv_layer * l = &c->layers[il];
        if (!c->quantized) {
            iq_tensor_place(l->k, c->buf, off);
            off += align_up(iq_nbytes(l->k), c->align);
            iq_tensor_place(l->v, c->buf, off);
            off += align_up(iq_nbytes(l->v), c->align);
            continue;
        }
        struct iq_qcache lay;
        iq_qcache_layout(&lay, &l->qcfg, l->head_dim, l->n_kv_head, l->n_ctx);  // checked by kv_quant_layout
        for (int r = 0; r < IQ_QREGION_COUNT; r++) {
            if (!kv_region_pooled(c, r)) {
                iq_tensor_place(l->region[r], c->buf, off + lay.off[r]);
            }
        }
        off += align_up(kv_layer_bytes(c, &lay), c->align);
    }
    if (c->kv_bits > 0.0) {
        kv_pool_place(c);
        off += align_up(c->pool_size, c->align);
    }
    if (c->rot != NULL) {
        iq_tensor_place(c->rot, c->buf, off);
    }
}

// Key normalization of 1 (no flush has set it): KIVI reads it as is, InnerQ until its first flush.
static innerq_status kv_norms_reset(struct kv_cache * c) {
    const struct iq_tensor * t = c->layers[0].region[IQ_QREGION_NORM];
    const size_t n = (size_t) iq_nelements(t);
    float * ones = malloc(n * sizeof(float));
    if (ones == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory clearing the KV cache");
    }
    for (size_t i = 0; i < n; i++) {
        ones[i] = 1.0f;
    }
    for (int32_t il = 0; il < c->n_layer; il++) {
        iq_tensor_set(c->layers[il].region[IQ_QREGION_NORM], ones, 0, n * sizeof(float));
    }
    free(ones);
    return INNERQ_OK;
}

innerq_status kv_cache_init(const struct llama_hparams * hp, iq_backend * be, const innerq_context_params * params,
                            int32_t n_ctx, struct kv_cache ** out) {
    *out = NULL;
    enum iq_type type_k, type_v;
    struct iq_qcache_config qcfg;
    const bool gpu = device_backend_is_gpu(be);
    innerq_status st = kv_cache_config(params, hp->head_dim, gpu, &type_k, &type_v, &qcfg);
    if (st == INNERQ_OK) {
        st = device_kv_check(gpu, hp->head_dim, type_k, type_v);
    }
    if (st != INNERQ_OK) {
        return st;
    }
    if (innerq_type(type_k)) {
        // default windows scale with the context (docs/INNERQ.md, "Windows"): the rule of thumb
        // w_sink = L/64, w_recent = L/16 for an expected length L = n_ctx, with this runtime's
        // earlier fixed windows (S 32, R 96) as the floors
        const int32_t s = n_ctx / 64 > KV_SINK_MIN ? n_ctx / 64 : KV_SINK_MIN;
        const int32_t r = n_ctx / 16 > KV_RECENT_MIN ? n_ctx / 16 : KV_RECENT_MIN;
        qcfg.n_sink = params->kv_sink >= 0 ? qcfg.n_sink : s;
        qcfg.n_recent = params->kv_recent >= 0 ? qcfg.n_recent : r;
    }
    // the rotation: InnerQ types (not KIVI, which keeps its published definition), head_dim a power of two
    const int32_t rot = !innerq_type(type_k) || !kv_rot_supported(hp->head_dim) ? 0 : params->kv_rot < 0 ? 3 : params->kv_rot;
    // the key channels RoPE rotates in pairs; after a rotation along head_dim there are no pairs
    qcfg.rope_dims = params->kv_norm_pairs && !(rot & 1) ? hp->n_rot / 2 * 2 : 0;
    if (rot & 1) {
        // Rotated keys have no outlier channels for the normalization to flatten, and with them
        // both the normalization and the score correction were measured to cost accuracy
        // (docs/ACCURACY.md): they apply to unrotated keys only.
        qcfg.key_norm = false;
        qcfg.score_correction = false;
    }
    struct kv_cache * c = calloc(1, sizeof(*c));
    if (c == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory allocating the KV cache");
    }
    c->n_layer = hp->n_layer;
    c->n_ctx = n_ctx;
    c->type_k = type_k;
    c->type_v = type_v;
    c->quantized = iq_qcache_type_is_quantized(type_k);
    c->qcfg = qcfg;
    c->rot_k = (rot & 1) != 0;
    c->rot_v = (rot & 2) != 0;
    c->layers = calloc((size_t) hp->n_layer, sizeof(*c->layers));
    if (c->layers == NULL) {
        kv_cache_free(c);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory allocating the KV cache");
    }
    c->align = iq_backend_alignment(be) > 64 ? iq_backend_alignment(be) : 64;
    c->n_head = hp->n_head;
    c->kq_scale = llama_kq_scale(hp);
    if (params->kv_bits != 0.0f) {
        c->kv_bits = params->kv_bits;
        c->units = kv_auto_units(c->kv_bits, qcfg.group, hp->n_layer);
        c->probe = malloc(sizeof(float) * (size_t) hp->n_layer * KV_AUTO_PROBE * hp->n_head * hp->head_dim);
        c->err = calloc((size_t) hp->n_layer, sizeof(*c->err));
    }
    // each layer's bits: the types' (the smallest with kv_bits until its choice), or kv_layer_bits'
    int32_t (*bits)[2] = malloc(sizeof(*bits) * (size_t) hp->n_layer);
    if (bits == NULL || (c->kv_bits > 0.0 && (c->probe == NULL || c->err == NULL))) {
        free(bits);
        kv_cache_free(c);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory allocating the KV cache");
    }
    for (int32_t il = 0; il < hp->n_layer; il++) {
        bits[il][0] = qcfg.bits_k;
        bits[il][1] = qcfg.bits_v;
    }
    st = kv_layer_bits_parse(params->kv_layer_bits, hp->n_layer, bits);
    for (int32_t il = 0; il < hp->n_layer && st == INNERQ_OK; il++) {
        struct iq_kv_layer * l = &c->layers[il];
        *l = (struct iq_kv_layer) { .type_k = type_k, .type_v = type_v, .head_dim = hp->head_dim,
                                    .n_kv_head = hp->n_head_kv, .n_ctx = n_ctx, .qcfg = qcfg };
        if (innerq_type(type_k)) {
            l->qcfg.bits_k = bits[il][0];
            l->qcfg.bits_v = bits[il][1];
            l->type_k = innerq_type_of_bits(bits[il][0]);
            l->type_v = innerq_type_of_bits(bits[il][1]);
        }
    }
    free(bits);
    size_t total = 0;
    if (st == INNERQ_OK) {
        st = c->quantized ? kv_quant_layout(c, hp, &total) : kv_plain_layout(c, hp, &total);
    }
    if (st != INNERQ_OK) {
        kv_cache_free(c);
        return st;
    }
    c->buf = iq_backend_alloc_buffer(be, total);
    if (c->buf == NULL) {
        kv_cache_free(c);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "KV cache of %.1f MiB: %s", total / 1048576.0, iq_error_get());
    }
    // the storage may be device memory: it is written and read through the buffer (iq_tensor_set
    // and _get: the norms here, states, rewinds), never through host pointers
    kv_place(c);
    if (!c->quantized) {
        // Unwritten cells are never read, but start from zeros so a bug can't read garbage.
        iq_buffer_clear(c->buf, 0);
    } else if ((st = kv_norms_reset(c)) != INNERQ_OK) {
        kv_cache_free(c);
        return st;
    }
    if (c->rot != NULL) {
        float * h = malloc(iq_nbytes(c->rot));
        if (h == NULL) {
            kv_cache_free(c);
            return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory allocating the KV cache");
        }
        kv_rotation(h, hp->head_dim);
        iq_tensor_set(c->rot, h, 0, iq_nbytes(c->rot));
        free(h);
    }
    *out = c;
    return INNERQ_OK;
}

void kv_cache_free(struct kv_cache * c) {
    if (c == NULL) {
        return;
    }
    if (c->buf) {
        iq_buffer_free(c->buf);
    }
    if (c->ctx) {
        iq_context_free(c->ctx);
    }
    free(c->layers);
    free(c->runs);
    free(c->probe);
    free(c->err);
    free(c);
}

innerq_status kv_cache_clear(struct kv_cache * c) {
    c->n_past = 0;
    c->n_runs = 0;
    c->qstate = (struct kv_qstate) {0};
    if (c->kv_bits > 0.0) {
        kv_layout_set(c, NULL);  // the next sequence chooses its own
    }
    return c->quantized ? kv_norms_reset(c) : INNERQ_OK;
}

uint64_t kv_cache_size(const struct kv_cache * c) { return c->buf ? c->buf->size : 0; }

int32_t kv_cache_until_flush(const struct kv_cache * c) {
    return c->quantized ? kv_quntil_flush(&c->qcfg, c->n_past, &c->qstate) : INT32_MAX;
}

bool kv_cache_batch(const struct kv_cache * c, int32_t n, struct iq_kv_batch * batch) {
    if (c->quantized) {
        return kv_qplan(&c->qcfg, c->n_ctx, c->n_past, &c->qstate, n, batch);
    }
    if (n < 1 || (int64_t) c->n_past + n > c->n_ctx) {
        iq_error_set("KV cache: %d tokens + %d new exceed the context of %d", c->n_past, n, c->n_ctx);
        return false;
    }
    *batch = (struct iq_kv_batch) { .n_past = c->n_past };
    return true;
}

// Appends a batch to the record of batches.
static bool kv_runs_push(struct kv_cache * c, int32_t n, bool decode_semantics) {
    decode_semantics = decode_semantics && n > 1;
    struct kv_run * last = c->n_runs ? &c->runs[c->n_runs - 1] : NULL;
    if (last && last->len == n && last->decode_semantics == decode_semantics) {
        last->count++;
        return true;
    }
    // one slot to spare: cutting a run in two (kv_cache_truncate) then needs no allocation
    if (c->n_runs + 1 >= c->cap_runs) {
        const int32_t cap = c->cap_runs ? 2 * c->cap_runs : 16;
        struct kv_run * p = realloc(c->runs, sizeof(*p) * (size_t) cap);
        if (p == NULL) {
            iq_error_set("out of memory recording a batch of the KV cache");
            return false;
        }
        c->runs = p;
        c->cap_runs = cap;
    }
    c->runs[c->n_runs++] = (struct kv_run) { .len = n, .count = 1, .decode_semantics = decode_semantics };
    return true;
}

bool kv_cache_commit(struct kv_cache * c, const struct iq_kv_batch * batch, int32_t n, bool decode_semantics) {
    if (!kv_runs_push(c, n, decode_semantics)) {
        return false;
    }
    if (c->quantized) {
        kv_qcommit(&c->qcfg, batch, &c->qstate);
    }
    c->n_past = batch->n_past + n;
    return true;
}

// ---- the automatic layout (kv-auto.h) ----

// Where the automatic layout is chosen: before the token that makes the first flush (the
// windows then hold S + R + G - 1 tokens).
static int32_t kv_layout_pos(const struct kv_cache * c) { return c->qcfg.n_sink + c->qcfg.n_recent + c->qcfg.group - 1; }

// The positions whose queries the choice is measured with: [kv_probe_first, kv_layout_pos).
static int32_t kv_probe_first(const struct kv_cache * c) {
    return kv_layout_pos(c) > KV_AUTO_PROBE ? kv_layout_pos(c) - KV_AUTO_PROBE : 0;
}

static size_t kv_probe_row(const struct kv_cache * c) { return (size_t) c->n_head * c->layers[0].head_dim; }

static float * kv_probe_at(const struct kv_cache * c, int32_t il, int32_t pos) {
    return c->probe + ((size_t) il * KV_AUTO_PROBE + (size_t) (pos - kv_probe_first(c))) * kv_probe_row(c);
}

int32_t kv_cache_until_layout(const struct kv_cache * c) {
    return c->kv_bits > 0.0 && !c->layout_ready ? kv_cache_until_flush(c) - 1 : INT32_MAX;
}

bool kv_cache_probing(const struct kv_cache * c, int32_t n_past, int32_t n) {
    return c->kv_bits > 0.0 && !c->layout_ready && n_past < kv_layout_pos(c) && n_past + n > kv_probe_first(c);
}

void kv_cache_probe_save(struct kv_cache * c, struct iq_tensor * const * q, int32_t n_past, int32_t n) {
    const int32_t lo = n_past > kv_probe_first(c) ? n_past : kv_probe_first(c);
    const int32_t hi = n_past + n < kv_layout_pos(c) ? n_past + n : kv_layout_pos(c);
    for (int32_t il = 0; il < c->n_layer && lo < hi; il++) {
        // q: f32 [head_dim, n_head, n] as attention gets it
        iq_tensor_get(q[il], kv_probe_at(c, il, lo), (size_t) (lo - n_past) * q[il]->nb[2],
                      sizeof(float) * kv_probe_row(c) * (size_t) (hi - lo));
    }
}

innerq_status kv_cache_layout_choose(struct kv_cache * c, int32_t n_threads) {
    const struct iq_kv_layer * l0 = &c->layers[0];
    struct iq_qcache lay;
    iq_qcache_layout(&lay, &c->qcfg, l0->head_dim, l0->n_kv_head, c->n_ctx);  // checked at init
    const struct kv_auto_shape shape = {
        .head_dim = l0->head_dim, .n_kv_head = l0->n_kv_head, .n_head = c->n_head, .n_sink = c->qstate.n_sink,
        .n_recent = c->n_past - c->qstate.n_sink - c->qstate.n_quant, .cap_recent = lay.cap_recent,
        .n_probe = c->n_past - kv_probe_first(c), .scale = c->kq_scale,
    };
    // every layer's windows on the host (read here, on one thread: they may be device memory)
    const size_t sink = lay.bytes[IQ_QREGION_SINK_K], recent = lay.bytes[IQ_QREGION_RECENT_K];
    const size_t per_layer = 2 * (sink + recent);
    uint8_t * host = malloc(per_layer * (size_t) c->n_layer);
    struct kv_auto_rows * rows = malloc(sizeof(*rows) * (size_t) c->n_layer);
    int32_t (*bits)[2] = malloc(sizeof(*bits) * (size_t) c->n_layer);
    if (host == NULL || rows == NULL || bits == NULL) {
        free(host), free(rows), free(bits);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory choosing the KV cache's layout");
    }
    for (int32_t il = 0; il < c->n_layer; il++) {
        const struct iq_kv_layer * l = &c->layers[il];
        uint8_t * at = host + per_layer * (size_t) il;
        iq_tensor_get(l->region[IQ_QREGION_SINK_K], at, 0, sink);
        iq_tensor_get(l->region[IQ_QREGION_SINK_V], at + sink, 0, sink);
        iq_tensor_get(l->region[IQ_QREGION_RECENT_K], at + 2 * sink, 0, recent);
        iq_tensor_get(l->region[IQ_QREGION_RECENT_V], at + 2 * sink + recent, 0, recent);
        rows[il] = (struct kv_auto_rows) {
            .sink_k = (const iq_fp16_t *) at, .sink_v = (const iq_fp16_t *) (at + sink),
            .recent_k = (const iq_fp16_t *) (at + 2 * sink), .recent_v = (const iq_fp16_t *) (at + 2 * sink + recent),
            .q = kv_probe_at(c, il, kv_probe_first(c)),
        };
    }
    kv_auto_measure_layers(&c->qcfg, &shape, rows, c->n_layer, n_threads, c->err);
    kv_auto_allocate(c->n_layer, (const double (*)[2][KV_AUTO_CANDIDATES]) c->err, c->units, bits);
    kv_layout_set(c, (const int32_t (*)[2]) bits);
    free(host), free(rows), free(bits);
    return INNERQ_OK;
}

// The share of the groups of a quantized region's first n_blocks blocks per head whose (d, m)
// is the symmetric grid's (m = -(L/2) d, d != 0; iq_quant_sym_group), or -1 if none.
static float kv_sym_share(const struct iq_tensor * t, int32_t bits, int32_t head_dim, int32_t group, int32_t n_blocks) {
    const size_t bytes = (size_t) n_blocks * t->nb[1];
    uint8_t * blocks = n_blocks > 0 ? malloc(bytes) : NULL;
    if (blocks == NULL) {
        return -1.0f;
    }
    int64_t sym = 0, all = 0;
    for (int64_t h = 0; h < t->ne[2]; h++) {
        iq_tensor_get(t, blocks, (size_t) h * t->nb[2], bytes);
        for (int32_t j = 0; j < n_blocks; j++) {
            const iq_fp16_t * d = iq_qblock_params(blocks + (size_t) j * t->nb[1], bits, head_dim, group);
            for (int32_t gi = 0; gi < head_dim; gi++, all++) {
                const float df = iq_fp16_to_fp32(d[gi]), mf = iq_fp16_to_fp32(d[head_dim + gi]);
                sym += df != 0.0f && mf == -(float) (1 << (bits - 1)) * df;
            }
        }
    }
    free(blocks);
    return (float) ((double) sym / (double) all);
}

innerq_status kv_cache_layer_info(const struct kv_cache * c, int32_t il, innerq_kv_layer_info * out) {
    if (il < 0 || il >= c->n_layer) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "layer %d is not in 0 .. %d", il, c->n_layer - 1);
    }
    *out = (innerq_kv_layer_info) { .sym_k = -1.0f, .sym_v = -1.0f };
    if (!c->quantized) {
        return INNERQ_OK;
    }
    const struct iq_kv_layer * l = &c->layers[il];
    const int32_t g = l->qcfg.group, n_blocks = c->qstate.n_quant / g;
    out->bits_k = l->qcfg.bits_k;
    out->bits_v = l->qcfg.bits_v;
    out->n_quant = c->qstate.n_quant;
    out->sym_k = kv_sym_share(l->region[IQ_QREGION_QUANT_K], l->qcfg.bits_k, l->head_dim, g, n_blocks);
    out->sym_v = kv_sym_share(l->region[IQ_QREGION_QUANT_V], l->qcfg.bits_v, l->head_dim, g, n_blocks);
    _Static_assert(KV_AUTO_CANDIDATES == sizeof(out->err_k) / sizeof(out->err_k[0]), "one error per candidate");
    for (int32_t b = 0; b < KV_AUTO_CANDIDATES && c->err != NULL && c->layout_ready; b++) {
        out->err_k[b] = (float) c->err[il][0][b];
        out->err_v[b] = (float) c->err[il][1][b];
    }
    return INNERQ_OK;
}

// ---- rewinding (docs/INNERQ.md, "Rewinding the cache") ----

// The cache's own condition on a rewind point n: a quantized cache can give back the state of
// n tokens only while it still holds that state's recent window in f16, that is while n needs
// the same quantized blocks it stores (n >= S + R + n_quant; tokens flushed since are lost),
// or n needs none and no window (n <= S: the sink alone). Returns the largest such n in
// (lo, hi], or 0 (always a rewind point) if none.
static int32_t kv_rewind_fit(const struct kv_cache * c, int32_t lo, int32_t hi) {
    if (!c->quantized || c->qstate.n_quant == 0) {
        return hi;
    }
    const int32_t min_window = c->qcfg.n_sink + c->qcfg.n_recent + c->qstate.n_quant;
    if (hi >= min_window) {
        return hi;
    }
    const int32_t sink = hi < c->qcfg.n_sink ? hi : c->qcfg.n_sink;
    return sink > lo ? sink : 0;
}

// The length of the batch a fresh evaluation in one call (without decode semantics) starts at
// position p, or 0 if none starts there: batches of n_batch from 0, and with the automatic
// layout one cut where it is chosen (innerq_decode stops a batch there) and n_batch from there.
static int32_t kv_fresh_batch(const struct kv_cache * c, int32_t p, int32_t n_batch) {
    const int32_t cut = c->kv_bits > 0.0 && kv_layout_pos(c) < c->n_ctx ? kv_layout_pos(c) : INT32_MAX;
    if (p < cut) {
        return p % n_batch != 0 ? 0 : cut - p < n_batch ? cut - p : n_batch;
    }
    return (p - cut) % n_batch == 0 ? n_batch : 0;
}

int32_t kv_cache_rewind_point(const struct kv_cache * c, int32_t n_keep, int32_t n_batch, bool decode_semantics) {
    n_keep = n_keep < c->n_past ? n_keep : c->n_past;
    if (c->type_k == IQ_TYPE_F32 && c->type_v == IQ_TYPE_F32) {
        // an f32 cache stores keys and values as the batch computed them, so how the tokens
        // were cut into batches changes nothing beyond float rounding
        return kv_rewind_fit(c, 0, n_keep);
    }
    // A batch reads its own tokens unrounded and earlier ones as stored (docs/DESIGN.md 3.4):
    // a token's keys and values depend on the batch it came in. A fresh evaluation of n tokens
    // cuts them into batches of n_batch from 0 (without decode semantics), or computes every
    // token as one-token decoding would (with them), so the kept tokens must have come in such
    // batches: [p, p + len) may be the last batch of the prefix, and the prefix may go on past
    // it only if it is a whole batch of the fresh cut.
    int32_t best = 0, p = 0;
    for (int32_t i = 0; i < c->n_runs && p < n_keep; i++) {
        const struct kv_run * r = &c->runs[i];
        for (int32_t j = 0; j < r->count && p < n_keep; j++) {
            const bool same = decode_semantics ? (r->decode_semantics || r->len == 1)
                                               : (!r->decode_semantics && kv_fresh_batch(c, p, n_batch) > 0);
            if (!same) {
                return best;
            }
            const int32_t end = p + r->len < n_keep ? p + r->len : n_keep;
            const int32_t fit = kv_rewind_fit(c, p, end);
            best = fit > best ? fit : best;
            if (!decode_semantics && r->len != kv_fresh_batch(c, p, n_batch)) {
                return best;
            }
            p += r->len;
        }
    }
    return best;
}

innerq_status kv_cache_truncate(struct kv_cache * c, int32_t n) {
    if (n < 0 || n > c->n_past) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_cache_truncate: %d is not in 0 .. %d", n, c->n_past);
    }
    if (c->quantized) {
        const struct kv_qstate q = kv_qcounters(&c->qcfg, n);
        if (q.n_quant != c->qstate.n_quant && !(q.n_quant == 0 && n <= c->qcfg.n_sink)) {
            return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_cache_truncate: the state of %d tokens is lost", n);
        }
        // Before the first flush the normalization is not set yet (1 everywhere).
        innerq_status st = q.n_quant == 0 && c->qstate.norms_ready ? kv_norms_reset(c) : INNERQ_OK;
        if (st != INNERQ_OK) {
            return st;
        }
        c->qstate = q;
        if (c->kv_bits > 0.0 && q.n_quant == 0 && c->layout_ready) {
            kv_layout_set(c, NULL);  // a fresh evaluation chooses it again at the first flush
        }
    }
    // keep the batches of the first n tokens, the last one cut at n
    int32_t p = 0, i = 0;
    for (; i < c->n_runs && p + c->runs[i].len * c->runs[i].count <= n; i++) {
        p += c->runs[i].len * c->runs[i].count;
    }
    if (i < c->n_runs && p < n) {
        struct kv_run * r = &c->runs[i];
        const int32_t whole = (n - p) / r->len, rest = (n - p) % r->len;
        r->count = whole;
        i += whole > 0;
        if (rest > 0) {  // the cut batch; kv_runs_push keeps a slot to spare for it
            const bool ds = r->decode_semantics && rest > 1;
            c->runs[i++] = (struct kv_run) { .len = rest, .count = 1, .decode_semantics = ds };
        }
    }
    c->n_runs = i;
    c->n_past = n;
    return INNERQ_OK;
}

// ---- states ----

void kv_stream_put(struct kv_stream * s, const void * data, size_t n) {
    if (s->w != NULL && n > 0) {
        memcpy(s->w + s->pos, data, n);
    }
    s->pos += n;
}

bool kv_stream_get(struct kv_stream * s, void * data, size_t n) {
    if (n > s->size - s->pos) {
        return false;
    }
    memcpy(data, s->r + s->pos, n);
    s->pos += n;
    return true;
}

// The storage in use with n_past tokens and counters q, as chunks (tensor, offset, bytes): per
// head the first rows of each tensor. The same walk writes, reads and sizes a state.
typedef void (*kv_chunk_fn)(struct iq_tensor * t, size_t offset, size_t size, struct kv_stream * s);

static void kv_rows(struct iq_tensor * t, int64_t rows, kv_chunk_fn fn, struct kv_stream * s) {
    for (int64_t h = 0; rows > 0 && h < t->ne[2]; h++) {
        fn(t, (size_t) h * t->nb[2], (size_t) rows * t->nb[1], s);
    }
}

static void kv_used_walk(const struct kv_cache * c, int32_t n_past, const struct kv_qstate * q, kv_chunk_fn fn,
                         struct kv_stream * s) {
    for (int32_t il = 0; il < c->n_layer; il++) {
        struct iq_kv_layer * l = &c->layers[il];
        if (!c->quantized) {
            kv_rows(l->k, n_past, fn, s);
            kv_rows(l->v, n_past, fn, s);
            continue;
        }
        const int32_t n_recent = n_past - q->n_sink - q->n_quant, n_blocks = q->n_quant / c->qcfg.group;
        const int32_t rows[IQ_QREGION_COUNT] = {
            [IQ_QREGION_NORM] = (int32_t) l->region[IQ_QREGION_NORM]->ne[1],  // [D, H]: all heads
            [IQ_QREGION_SINK_K] = q->n_sink, [IQ_QREGION_SINK_V] = q->n_sink,
            [IQ_QREGION_RECENT_K] = n_recent, [IQ_QREGION_RECENT_V] = n_recent,
            [IQ_QREGION_QUANT_K] = n_blocks, [IQ_QREGION_QUANT_V] = n_blocks,
        };
        for (int r = 0; r < IQ_QREGION_COUNT; r++) {
            kv_rows(l->region[r], rows[r], fn, s);
        }
    }
}

static void kv_chunk_save(struct iq_tensor * t, size_t offset, size_t size, struct kv_stream * s) {
    if (s->w != NULL) {
        iq_tensor_get(t, s->w + s->pos, offset, size);
    }
    s->pos += size;
}

static void kv_chunk_load(struct iq_tensor * t, size_t offset, size_t size, struct kv_stream * s) {
    iq_tensor_set(t, s->r + s->pos, offset, size);
    s->pos += size;
}

static void kv_chunk_count(struct iq_tensor * t, size_t offset, size_t size, struct kv_stream * s) {
    (void) t, (void) offset;
    s->pos += size;
}

// The queries a state keeps for the automatic layout's pending choice (per layer, rows of
// kv_probe_row floats from kv_probe_first): those of the n_past tokens stored.
static int32_t kv_probe_kept(const struct kv_cache * c, int32_t n_past, bool ready) {
    if (c->kv_bits <= 0.0 || ready) {
        return 0;
    }
    const int32_t hi = n_past < kv_layout_pos(c) ? n_past : kv_layout_pos(c);
    return hi > kv_probe_first(c) ? hi - kv_probe_first(c) : 0;
}

void kv_cache_state_write(const struct kv_cache * c, struct kv_stream * s) {
    const int32_t head[5] = { c->n_past, c->qstate.n_sink, c->qstate.n_quant, c->qstate.norms_ready, c->n_runs };
    kv_stream_put(s, head, sizeof(head));
    for (int32_t i = 0; i < c->n_runs; i++) {
        const int32_t r[3] = { c->runs[i].len, c->runs[i].count, c->runs[i].decode_semantics };
        kv_stream_put(s, r, sizeof(r));
    }
    if (c->quantized) {
        // the layout: whether the automatic one is chosen, each layer's bits, the pending choice's queries
        const int32_t ready = c->layout_ready;
        kv_stream_put(s, &ready, sizeof(ready));
        for (int32_t il = 0; il < c->n_layer; il++) {
            const int32_t b[2] = { c->layers[il].qcfg.bits_k, c->layers[il].qcfg.bits_v };
            kv_stream_put(s, b, sizeof(b));
        }
        const size_t kept = sizeof(float) * kv_probe_row(c) * (size_t) kv_probe_kept(c, c->n_past, c->layout_ready);
        for (int32_t il = 0; il < c->n_layer && kept > 0; il++) {
            kv_stream_put(s, kv_probe_at(c, il, kv_probe_first(c)), kept);
        }
    }
    kv_used_walk(c, c->n_past, &c->qstate, kv_chunk_save, s);
}

// Reads a state's layout (kv_cache_state_write) into ready, bits (n_layer pairs) and *probe (the
// kept queries, in the stream) and checks it against the cache: a fixed layout must be the
// cache's own, an automatic one within its budget. Without a layout in the stream (states
// before version 3), every layer has the configuration's bits.
static innerq_status kv_layout_read(const struct kv_cache * c, struct kv_stream * s, bool with_layout, int32_t n_past,
                                    const struct kv_qstate * q, int32_t * ready, int32_t (*bits)[2],
                                    const uint8_t ** probe) {
    *ready = 0;
    for (int32_t il = 0; il < c->n_layer; il++) {
        bits[il][0] = c->qcfg.bits_k;
        bits[il][1] = c->qcfg.bits_v;
    }
    if (with_layout && (!kv_stream_get(s, ready, sizeof(*ready)) ||
                        !kv_stream_get(s, bits, sizeof(*bits) * (size_t) c->n_layer))) {
        return innerq_fail(INNERQ_ERR_FORMAT, "state: the KV cache's layout is cut off");
    }
    int32_t units = 0;
    bool valid = *ready == 0 || (*ready == 1 && c->kv_bits > 0.0), same = true;
    for (int32_t il = 0; il < c->n_layer; il++) {
        for (int32_t x = 0; x < 2; x++) {
            valid = valid && bits[il][x] >= KV_AUTO_BITS_MIN && bits[il][x] <= KV_AUTO_BITS_MAX &&
                    (*ready || c->kv_bits <= 0.0 || bits[il][x] == KV_AUTO_BITS_MIN);
            units += valid ? bits[il][x] : 0;  // the stream's values are untrusted: summed once checked
        }
        same = same && bits[il][0] == c->layers[il].qcfg.bits_k && bits[il][1] == c->layers[il].qcfg.bits_v;
    }
    if (!valid || (c->kv_bits > 0.0 && (units > c->units || (q->n_quant > 0 && !*ready)))) {
        return innerq_fail(INNERQ_ERR_FORMAT, "state: invalid KV cache layout (%d code bits over the layers, budget %d)",
                           units, c->units);
    }
    if (c->kv_bits <= 0.0 && !same) {
        return innerq_fail(INNERQ_ERR_STATE_MISMATCH, "the state's KV cache has other bits per layer than the context's");
    }
    const size_t kept = sizeof(float) * kv_probe_row(c) * (size_t) kv_probe_kept(c, n_past, *ready) * c->n_layer;
    if (kept > s->size - s->pos) {
        return innerq_fail(INNERQ_ERR_FORMAT, "state: the KV cache's layout is cut off");
    }
    *probe = s->r + s->pos;
    s->pos += kept;
    return INNERQ_OK;
}

innerq_status kv_cache_state_read(struct kv_cache * c, struct kv_stream * s, bool with_layout) {
    int32_t head[5];
    if (!kv_stream_get(s, head, sizeof(head))) {
        return innerq_fail(INNERQ_ERR_FORMAT, "state: the KV cache's counters are cut off");
    }
    const int32_t n_past = head[0], n_runs = head[4];
    const struct kv_qstate q = { .n_sink = head[1], .n_quant = head[2], .norms_ready = head[3] != 0 };
    if (n_past < 0 || n_past > c->n_ctx) {
        return innerq_fail(n_past < 0 ? INNERQ_ERR_FORMAT : INNERQ_ERR_CONTEXT_FULL,
                           "state: %d tokens do not fit the context of %d", n_past, c->n_ctx);
    }
    // The counters must be those of n_past tokens (kv_qcounters): nothing else can be stored.
    const struct kv_qstate want = c->quantized ? kv_qcounters(&c->qcfg, n_past) : (struct kv_qstate) {0};
    if (q.n_sink != want.n_sink || q.n_quant != want.n_quant || q.norms_ready != want.norms_ready || head[3] < 0 ||
        head[3] > 1 || n_runs < 0 || n_runs > n_past || (size_t) n_runs * 12 > s->size - s->pos) {
        return innerq_fail(INNERQ_ERR_FORMAT, "state: inconsistent KV cache counters (%d tokens, sink %d, quantized %d, "
                           "%d runs of batches)", n_past, q.n_sink, q.n_quant, n_runs);
    }
    struct kv_run * runs = malloc(sizeof(*runs) * (size_t) (n_runs + 16));
    int32_t (*bits)[2] = malloc(sizeof(*bits) * (size_t) c->n_layer * 2);  // the state's, then the cache's
    if (runs == NULL || bits == NULL) {
        free(runs), free(bits);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory loading a state");
    }
    int64_t sum = 0;
    for (int32_t i = 0; i < n_runs; i++) {
        int32_t r[3];
        kv_stream_get(s, r, sizeof(r));  // the size was checked above
        runs[i] = (struct kv_run) { .len = r[0], .count = r[1], .decode_semantics = r[2] != 0 };
        sum += (int64_t) r[0] * (r[0] > 0 && r[1] > 0 ? r[1] : 0);
        if (r[0] < 1 || r[1] < 1 || r[2] < 0 || r[2] > 1 || sum > n_past) {
            free(runs), free(bits);
            return innerq_fail(INNERQ_ERR_FORMAT, "state: invalid record of batches");
        }
    }
    int32_t ready = 0;
    const uint8_t * probe = NULL;
    int32_t (*had)[2] = bits + c->n_layer;
    const bool was_ready = c->layout_ready;
    innerq_status st = INNERQ_OK;
    if (c->quantized) {
        st = kv_layout_read(c, s, with_layout, n_past, &q, &ready, bits, &probe);
        for (int32_t il = 0; il < c->n_layer; il++) {
            had[il][0] = c->layers[il].qcfg.bits_k;
            had[il][1] = c->layers[il].qcfg.bits_v;
        }
    }
    if (st == INNERQ_OK && c->kv_bits > 0.0) {
        kv_layout_set(c, ready ? (const int32_t (*)[2]) bits : NULL);  // the data's sizes follow it
    }
    struct kv_stream count = { .pos = s->pos };
    kv_used_walk(c, n_past, &q, kv_chunk_count, &count);
    if (st == INNERQ_OK && (sum != n_past || count.pos != s->size)) {
        st = innerq_fail(INNERQ_ERR_FORMAT, "state: %zu bytes of KV cache data where %d tokens need %zu",
                         s->size - s->pos, n_past, count.pos - s->pos);
    }
    if (st != INNERQ_OK) {
        if (c->kv_bits > 0.0) {  // as it was
            kv_layout_set(c, was_ready ? (const int32_t (*)[2]) had : NULL);
        }
        free(runs), free(bits);
        return st;
    }
    // checked: from here on nothing fails
    const size_t kept = sizeof(float) * kv_probe_row(c) * (size_t) kv_probe_kept(c, n_past, ready);
    for (int32_t il = 0; il < c->n_layer && kept > 0; il++) {
        memcpy(kv_probe_at(c, il, kv_probe_first(c)), probe + il * kept, kept);
    }
    kv_used_walk(c, n_past, &q, kv_chunk_load, s);
    free(c->runs);
    free(bits);
    c->runs = runs;
    c->n_runs = n_runs;
    c->cap_runs = n_runs + 16;
    c->n_past = n_past;
    c->qstate = q;
    return INNERQ_OK;
}
