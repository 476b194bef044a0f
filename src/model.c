// Loading a model (hyper-parameters, weights used in place) for any architecture of
// model-impl.h, and its forward graph, which the architecture builds.
#include "model-impl.h"

#include "device.h"
#include "kv-cache.h"
#include "status.h"
#include "vocab.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---- hyper-parameters ----

static const struct model_arch * const model_archs[] = { &model_arch_llama, &model_arch_qwen2, &model_arch_qwen3,
                                                          &model_arch_gemma3, &model_arch_phi3 };

// The value of ARCH.<name> (key_of) as a count in (0, 2^24].
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

// Keys are the architecture's name, then the parameter ("qwen2.block_count").
static const char * key_of(const char * arch, const char * name, char * buf, size_t size) {
    snprintf(buf, size, "%s.%s", arch, name);
    return buf;
}

// An optional count: *out keeps its default when the file does not have it.
static innerq_status hparams_opt_u32(const struct gguf_file * f, const char * key, int32_t * out) {
    return gguf_find_kv(f, key) ? hparams_need_u32(f, key, out) : INNERQ_OK;
}

static innerq_status hparams_arch(const struct gguf_file * f, const struct model_arch ** out) {
    innerq_status st = INNERQ_OK;
    struct gguf_str arch;
    if (!gguf_get_str(f, "general.architecture", &arch, &st)) {
        return st != INNERQ_OK ? st : innerq_fail(INNERQ_ERR_FORMAT, "missing 'general.architecture'");
    }
    for (size_t i = 0; i < sizeof(model_archs) / sizeof(model_archs[0]); i++) {
        if (arch.n == strlen(model_archs[i]->name) && memcmp(arch.data, model_archs[i]->name, arch.n) == 0) {
            *out = model_archs[i];
            return INNERQ_OK;
        }
    }
    return innerq_fail(INNERQ_ERR_UNSUPPORTED,
                       "architecture '%.*s' is not supported (supported: llama, qwen2, qwen3, gemma3, phi3)",
                       (int) (arch.n > 64 ? 64 : arch.n), arch.data);
}

// ARCH.rope.scaling.*, as llama.cpp reads them. YaRN also scales cos and sin by mscale, i.e. q
// and k by mscale each: with every channel rotated that is the attention's scale times mscale^2.
static innerq_status hparams_rope_scaling(const struct gguf_file * f, const char * a, struct llama_hparams * hp) {
    innerq_status st = INNERQ_OK;
    char k[96];
    struct gguf_str type = { 6, "linear" };
    float factor = 0.0f, attn_factor = 1.0f, log_mul = 0.0f;
    hp->n_ctx_orig = hp->n_ctx_train;
    hp->yarn_beta_fast = 32.0f;
    hp->yarn_beta_slow = 1.0f;
    gguf_get_str(f, key_of(a, "rope.scaling.type", k, sizeof(k)), &type, &st);
    gguf_get_f32(f, key_of(a, "rope.scaling.factor", k, sizeof(k)), &factor, &st);
    gguf_get_f32(f, key_of(a, "rope.scaling.attn_factor", k, sizeof(k)), &attn_factor, &st);
    gguf_get_f32(f, key_of(a, "rope.scaling.yarn_log_multiplier", k, sizeof(k)), &log_mul, &st);
    gguf_get_f32(f, key_of(a, "rope.scaling.yarn_beta_fast", k, sizeof(k)), &hp->yarn_beta_fast, &st);
    gguf_get_f32(f, key_of(a, "rope.scaling.yarn_beta_slow", k, sizeof(k)), &hp->yarn_beta_slow, &st);
    if (st != INNERQ_OK || (st = hparams_opt_u32(f, key_of(a, "rope.scaling.original_context_length", k, sizeof(k)),
                                                 &hp->n_ctx_orig))) {
        return st;
    }
    // longrope: the tensors rope_factors_short / _long hold the divisors (model.h)
    const bool none = (type.n == 4 && memcmp(type.data, "none", 4) == 0) ||
                      (type.n == 8 && memcmp(type.data, "longrope", 8) == 0);
    const bool linear = type.n == 6 && memcmp(type.data, "linear", 6) == 0;
    hp->rope_yarn = type.n == 4 && memcmp(type.data, "yarn", 4) == 0;
    if (!none && !linear && !hp->rope_yarn) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "RoPE scaling '%.*s' is not supported (none, linear, yarn, longrope)",
                           (int) (type.n > 32 ? 32 : type.n), type.data);
    }
    if (!isfinite(factor) || factor < 0.0f || !(attn_factor > 0.0f) || !isfinite(attn_factor) || !isfinite(log_mul) ||
        !(hp->yarn_beta_fast > 0.0f) || !(hp->yarn_beta_slow > 0.0f)) {
        return innerq_fail(INNERQ_ERR_FORMAT, "RoPE scaling: factor %g, attn_factor %g or YaRN parameters out of range",
                           factor, attn_factor);
    }
    hp->rope_factor = none || factor == 1.0f ? 0.0f : factor;
    float mscale = attn_factor;
    if (hp->rope_yarn && hp->rope_factor > 1.0f) {
        const float m = 1.0f + 0.1f * logf(hp->rope_factor);
        mscale *= log_mul != 0.0f ? m / (1.0f + 0.1f * log_mul * logf(hp->rope_factor)) : m;
    }
    if (mscale != 1.0f && hp->n_swa > 0) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "RoPE scaling with a magnitude factor (%g) on sliding-window "
                           "layers is not supported", mscale);
    }
    // partly rotated heads (Phi-4-mini): the channels from n_rot on are not scaled, so the RoPE
    // op scales the rotated ones (llama.cpp's attn_factor of ggml_rope_ext)
    hp->rope_mscale = 1.0f;
    if (hp->n_rot == hp->head_dim) {
        hp->kq_scale *= mscale * mscale;
    } else {
        hp->rope_mscale = mscale;
    }
    return INNERQ_OK;
}

static innerq_status hparams_load(const struct gguf_file * f, const struct model_arch * arch, struct llama_hparams * hp) {
    innerq_status st = INNERQ_OK;
    const char * a = arch->name;
    char k[96];
    if ((st = hparams_need_u32(f, key_of(a, "block_count", k, sizeof(k)), &hp->n_layer)) ||
        (st = hparams_need_u32(f, key_of(a, "embedding_length", k, sizeof(k)), &hp->n_embd)) ||
        (st = hparams_need_u32(f, key_of(a, "feed_forward_length", k, sizeof(k)), &hp->n_ff)) ||
        (st = hparams_need_u32(f, key_of(a, "attention.head_count", k, sizeof(k)), &hp->n_head)) ||
        (st = hparams_need_u32(f, key_of(a, "context_length", k, sizeof(k)), &hp->n_ctx_train))) {
        return st;
    }
    hp->n_head_kv = hp->n_head;
    hp->head_dim = hp->n_embd % hp->n_head == 0 ? hp->n_embd / hp->n_head : 0;
    if ((st = hparams_opt_u32(f, key_of(a, "attention.head_count_kv", k, sizeof(k)), &hp->n_head_kv)) ||
        (st = hparams_opt_u32(f, key_of(a, "attention.key_length", k, sizeof(k)), &hp->head_dim))) {
        return st;
    }
    int32_t v_len = hp->head_dim;
    if ((st = hparams_opt_u32(f, key_of(a, "attention.value_length", k, sizeof(k)), &v_len))) {
        return st;
    }
    if (hp->head_dim == 0 || hp->n_head % hp->n_head_kv != 0 || v_len != hp->head_dim) {
        return innerq_fail(INNERQ_ERR_FORMAT, "inconsistent heads: n_embd %d, n_head %d, n_head_kv %d, key length %d, "
                           "value length %d", hp->n_embd, hp->n_head, hp->n_head_kv, hp->head_dim, v_len);
    }
    hp->n_rot = hp->head_dim;
    if ((st = hparams_opt_u32(f, key_of(a, "rope.dimension_count", k, sizeof(k)), &hp->n_rot))) {
        return st;
    }
    if (hp->n_rot > hp->head_dim || hp->n_rot % 2 != 0 || hp->head_dim % 2 != 0) {
        return innerq_fail(INNERQ_ERR_FORMAT, "rope dimension %d does not fit head size %d", hp->n_rot, hp->head_dim);
    }
    hp->rope_freq_base = 10000.0f;
    hp->rms_eps = 1e-5f;
    gguf_get_f32(f, key_of(a, "rope.freq_base", k, sizeof(k)), &hp->rope_freq_base, &st);
    gguf_get_f32(f, key_of(a, "attention.layer_norm_rms_epsilon", k, sizeof(k)), &hp->rms_eps, &st);
    if (st != INNERQ_OK) {
        return st;
    }
    if (!(hp->rope_freq_base > 0.0f) || !isfinite(hp->rope_freq_base) || !(hp->rms_eps > 0.0f) || hp->rms_eps > 1.0f) {
        return innerq_fail(INNERQ_ERR_FORMAT, "rope freq_base %g or rms epsilon %g out of range",
                           hp->rope_freq_base, hp->rms_eps);
    }
    hp->kq_scale = 1.0f / sqrtf((float) hp->head_dim);
    if ((st = arch->hparams != NULL ? arch->hparams(f, a, hp) : INNERQ_OK)) {
        return st;
    }
    return hparams_rope_scaling(f, a, hp);
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

// NEOX RoPE pairs (i, i + n_rot/2) of heads of hd rows moved to NORMAL's (2i, 2i+1)
// (model_arch.rope_neox); rows from n_rot on stay where they are.
static void rows_neox_to_normal(uint8_t * dst, const uint8_t * src, size_t row, int64_t n_rows, int64_t hd,
                                int64_t n_rot) {
    for (int64_t r = 0; r < n_rows; r++) {
        const int64_t j = r % hd, from = j >= n_rot ? j : j % 2 == 0 ? j / 2 : j / 2 + n_rot / 2;
        memcpy(dst + r * row, src + (r - j + from) * row, row);
    }
}

// What a weight is: the file's tensor `name` of shape [ne0, rows] ([ne0]: rows 0), of which
// the weight is the rows [row0, row0 + n) (a part of a fused tensor; n = rows for the whole).
struct weight_want {
    const char * name;
    int64_t ne0, rows, row0, n;
    unsigned flags;  // enum layer_tensor_flag
};

// Whether the loader makes its own copy of the weight (m->own) instead of using the file's bytes.
static bool weight_reordered(const innerq_model * m, unsigned flags) {
    return m->arch->rope_neox && (flags & LT_HEADS);
}

static size_t align64(size_t n) { return (n + 63) / 64 * 64; }

#define WEIGHTS_DEVICE_ALIGN 256  // of a weight copied to device memory

// The loader's two passes over the weights: the first (dry) checks them and counts the bytes
// each device's buffers take; the second makes the tensors and places them.
struct weights_pass {
    bool dry;
    size_t off[MODEL_MAX_DEVICES];      // in the device's copy of its weights (device memory)
    size_t own_off[MODEL_MAX_DEVICES];  // in its m->devs[d].own
};

// Finds a tensor, checks its shape and type, and makes an iq_tensor on device d over its data
// (the mapped file, or a copy in device memory) or over its rows reordered for NEOX RoPE (in
// the device's own buffer); a dry pass only counts the bytes.
static innerq_status weight_get(innerq_model * m, const struct weight_want * w, int32_t d, struct weights_pass * wp,
                                struct iq_tensor ** out) {
    const struct gguf_tensor_info * ti = gguf_find_tensor(m->gguf, w->name);
    *out = NULL;
    if (ti == NULL) {
        return (w->flags & LT_OPTIONAL) ? INNERQ_OK : innerq_fail(INNERQ_ERR_FORMAT, "missing tensor '%s'", w->name);
    }
    const int64_t want_ne1 = w->rows > 0 ? w->rows : 1;
    if (ti->ne[0] != w->ne0 || ti->ne[1] != want_ne1 || ti->ne[2] != 1 || ti->ne[3] != 1) {
        return innerq_fail(INNERQ_ERR_FORMAT, "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld]",
                           w->name, (long long) ti->ne[0], (long long) ti->ne[1], (long long) ti->ne[2],
                           (long long) ti->ne[3], (long long) w->ne0, (long long) want_ne1);
    }
    if (!weight_type_ok(ti->type)) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "tensor '%s' has type %s, which is not a supported weight format",
                           w->name, iq_type_name(ti->type));
    }
    if ((w->flags & LT_F32) && ti->type != IQ_TYPE_F32) {
        // norm vectors, biases and rope factors are read element-wise by the ops
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "tensor '%s' has type %s; only f32 is supported for it", w->name,
                           iq_type_name(ti->type));
    }
    // a vector's "rows" are its elements (f32), a matrix's its rows of ne0
    const size_t row = w->rows > 0 ? iq_row_size(ti->type, w->ne0) : sizeof(float);
    const int64_t n_rows = w->rows > 0 ? w->n : w->ne0;
    const uint8_t * src = (const uint8_t *) ti->data + (size_t) w->row0 * row;
    const size_t bytes = (size_t) n_rows * row;
    struct model_device * md = &m->devs[d];
    const bool host = md->dev.kind->host_memory;
    if (wp->dry) {
        wp->own_off[d] += weight_reordered(m, w->flags) ? align64(bytes) : 0;
        wp->off[d] += !weight_reordered(m, w->flags) && !host ? (bytes + WEIGHTS_DEVICE_ALIGN - 1) / WEIGHTS_DEVICE_ALIGN *
                                                                    WEIGHTS_DEVICE_ALIGN : 0;
        return INNERQ_OK;
    }
    iq_context_set_backend_id(m->ctx, d);
    struct iq_tensor * t = w->rows > 0 ? iq_new_tensor_2d(m->ctx, ti->type, w->ne0, w->n)
                                       : iq_new_tensor_1d(m->ctx, ti->type, w->ne0);
    if (t == NULL) {
        return innerq_fail(INNERQ_ERR_FORMAT, "tensor '%s': %s", w->name, iq_error_get());
    }
    iq_set_name(t, "%s", w->name);
    if (weight_reordered(m, w->flags)) {
        uint8_t * tmp = malloc(bytes);
        if (tmp == NULL) {
            return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory reordering '%s'", w->name);
        }
        rows_neox_to_normal(tmp, src, row, n_rows, m->hp.head_dim, m->hp.n_rot);
        iq_tensor_place(t, md->own, wp->own_off[d]);
        iq_tensor_set(t, tmp, 0, bytes);
        free(tmp);
        wp->own_off[d] += align64(bytes);
    } else if (host) {
        iq_tensor_place(t, md->mapped[ti->part], (size_t) ti->offset + (size_t) (src - (const uint8_t *) ti->data));
    } else {
        iq_tensor_place(t, md->weights, wp->off[d]);
        iq_tensor_set(t, src, 0, bytes);
        wp->off[d] += (bytes + WEIGHTS_DEVICE_ALIGN - 1) / WEIGHTS_DEVICE_ALIGN * WEIGHTS_DEVICE_ALIGN;
    }
    md->n_bytes += bytes;
    m->n_params += (uint64_t) iq_nelements(t);
    m->n_bytes += w->row0 == 0 ? ti->size : 0;  // a fused tensor counts once
    *out = t;
    return INNERQ_OK;
}

static int64_t layer_dim(const struct llama_hparams * hp, enum layer_dim d) {
    switch (d) {
    case LD_EMBD: return hp->n_embd;
    case LD_Q: return (int64_t) hp->n_head * hp->head_dim;
    case LD_KV: return (int64_t) hp->n_head_kv * hp->head_dim;
    case LD_FF: return hp->n_ff;
    case LD_HEAD: return hp->head_dim;
    case LD_NONE: break;
    }
    return 0;
}

// Block il's weight lt, as weight_get takes it; name is its buffer.
static struct weight_want layer_want(const struct llama_hparams * hp, int32_t il, const struct layer_tensor * lt,
                                     char * name, size_t size) {
    snprintf(name, size, strchr(lt->suffix, '.') ? "blk.%d.%s" : "blk.%d.%s.weight", il, lt->suffix);
    struct weight_want w = { .name = name, .ne0 = layer_dim(hp, lt->ne0), .flags = lt->flags };
    for (int i = 0; i < 3; i++) {
        const int64_t n = layer_dim(hp, lt->rows[i]);
        w.row0 += i < lt->part ? n : 0;
        w.n = i == lt->part ? n : w.n;
        w.rows += n;
    }
    return w;
}

// block_count against the tensors, before anything is sized by it. Checking the count first
// keeps a damaged block_count from sizing allocations (layers, tensor structs) before the
// weights are looked up. A tensor of a block past block_count means the file has more layers
// than its metadata says: evaluating the first block_count of them would write wrong text
// without a word.
static innerq_status weights_count_check(const struct gguf_file * f, const struct model_arch * arch,
                                         const struct llama_hparams * hp) {
    int64_t per_block = 0;  // the block's tensors it cannot do without (a fused one once)
    for (int i = 0; i < arch->n_layer_tensor; i++) {
        per_block += arch->layer[i].part == 0 && !(arch->layer[i].flags & LT_OPTIONAL);
    }
    if ((int64_t) hp->n_layer * per_block + 2 > f->n_tensors) {
        return innerq_fail(INNERQ_ERR_FORMAT,
                           "%s.block_count = %d needs at least %lld tensors (%lld per block, the embedding and "
                           "the output norm); the file has %lld",
                           arch->name, hp->n_layer, (long long) hp->n_layer * per_block + 2, (long long) per_block,
                           (long long) f->n_tensors);
    }
    for (int64_t i = 0; i < f->n_tensors; i++) {
        long block;
        char * end;
        const char * name = f->tensors[i].name;
        if (strncmp(name, "blk.", 4) == 0 && (block = strtol(name + 4, &end, 10)) >= hp->n_layer && *end == '.') {
            return innerq_fail(INNERQ_ERR_FORMAT, "tensor '%s' is in block %ld, but %s.block_count = %d: the "
                               "metadata lists fewer layers than the file has", name, block, arch->name, hp->n_layer);
        }
    }
    return INNERQ_OK;
}

// The constant vector sqrt(n_embd) in the input device's own buffer, which the token embeddings
// are multiplied by.
static innerq_status weights_embd_scale(innerq_model * m, struct weights_pass * wp) {
    const int64_t n = m->hp.n_embd;
    const int32_t d = m->dev_in;
    if (wp->dry) {
        wp->own_off[d] += align64(sizeof(float) * (size_t) n);
        return INNERQ_OK;
    }
    iq_context_set_backend_id(m->ctx, d);
    float * scale = malloc(sizeof(float) * (size_t) n);
    if (scale == NULL || (m->embd_scale = iq_new_tensor_1d(m->ctx, IQ_TYPE_F32, n)) == NULL) {
        free(scale);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
    }
    for (int64_t i = 0; i < n; i++) {
        scale[i] = sqrtf((float) n);
    }
    iq_set_name(m->embd_scale, "embd_scale");
    iq_tensor_place(m->embd_scale, m->devs[d].own, wp->own_off[d]);
    iq_tensor_set(m->embd_scale, scale, 0, sizeof(float) * (size_t) n);
    wp->own_off[d] += align64(sizeof(float) * (size_t) n);
    free(scale);
    return INNERQ_OK;
}

// YaRN's ramp between the correction dims (ggml's rope_yarn_ramp and ggml_rope_yarn_corr_dims).
static float yarn_corr_dim(int n_rot, int n_ctx_orig, float beta, float base) {
    return (float) n_rot * logf((float) n_ctx_orig / (beta * 2.0f * 3.14159265358979323846f)) / (2.0f * logf(base));
}

// The divisors of the RoPE angles with the file's scaling, in m->own (after the file's
// rope_freqs.weight, which they include): linear divides every angle by the factor; YaRN
// mixes the interpolated angle theta / factor and theta itself by a ramp over the pairs, i.e.
// divides by 1 / (mix + (1 - mix) / factor).
static innerq_status weights_rope_scaling(innerq_model * m, struct weights_pass * wp) {
    const struct llama_hparams * hp = &m->hp;
    const int n = hp->n_rot / 2;
    const int32_t d = m->dev_in;  // the layers on other devices read copies (iq-sched.h)
    if (wp->dry) {
        wp->own_off[d] += align64(sizeof(float) * (size_t) n);
        return INNERQ_OK;
    }
    iq_context_set_backend_id(m->ctx, d);
    float * ff = malloc(sizeof(float) * (size_t) n);
    if (ff == NULL || (m->rope_freqs = iq_new_tensor_1d(m->ctx, IQ_TYPE_F32, n)) == NULL) {
        free(ff);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
    }
    if (m->rope_freqs_swa != NULL) {
        iq_tensor_get(m->rope_freqs_swa, ff, 0, sizeof(float) * (size_t) n);
    }
    const float lo = fmaxf(0.0f, floorf(yarn_corr_dim(hp->n_rot, hp->n_ctx_orig, hp->yarn_beta_fast, hp->rope_freq_base)));
    const float hi = fminf((float) hp->n_rot - 1.0f,
                           ceilf(yarn_corr_dim(hp->n_rot, hp->n_ctx_orig, hp->yarn_beta_slow, hp->rope_freq_base)));
    for (int i = 0; i < n; i++) {
        const float file = m->rope_freqs_swa != NULL ? ff[i] : 1.0f;
        const float mix = hp->rope_yarn ? 1.0f - fminf(1.0f, fmaxf(0.0f, ((float) i - lo) / fmaxf(0.001f, hi - lo))) : 0.0f;
        ff[i] = file / (mix + (1.0f - mix) / hp->rope_factor);
    }
    iq_set_name(m->rope_freqs, "rope_freqs_scaled");
    iq_tensor_place(m->rope_freqs, m->devs[d].own, wp->own_off[d]);
    iq_tensor_set(m->rope_freqs, ff, 0, sizeof(float) * (size_t) n);
    wp->own_off[d] += align64(sizeof(float) * (size_t) n);
    free(ff);
    return INNERQ_OK;
}

static innerq_status weights_load(innerq_model * m, struct weights_pass * wp);

// The devices of the model for n_gpu_layers (device_choose), their backends and buffers, and
// the weights in them.
static innerq_status model_devices(innerq_model * m, int32_t n_gpu_layers) {
    const int32_t n_layer = m->hp.n_layer;
    int32_t n_split;
    innerq_status st = device_choose(n_gpu_layers, n_layer, true, &m->device, &n_split);
    if (st != INNERQ_OK) {
        return st;
    }
    m->n_dev = n_split > 0 ? 2 : 1;
    m->devs[0].dev = n_split > 0 ? device_cpu() : m->device;
    m->devs[1].dev = m->device;
    m->dev_in = m->dev_out = 0;
    if ((m->layer_dev = calloc((size_t) n_layer, sizeof(int32_t))) == NULL) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
    }
    for (int32_t il = 0; il < n_layer; il++) {
        m->layer_dev[il] = n_split > 0 && il >= n_layer - n_split;
        m->devs[m->layer_dev[il]].n_layer++;
    }
    struct weights_pass wp = { .dry = true };
    for (int32_t d = 0; d < m->n_dev && st == INNERQ_OK; d++) {
        st = device_backend_init(m->devs[d].dev, 1, &m->devs[d].backend);
    }
    if (st == INNERQ_OK) {
        st = weights_load(m, &wp);
    }
    for (int32_t d = 0; d < m->n_dev && st == INNERQ_OK; d++) {
        struct model_device * md = &m->devs[d];
        if (md->dev.kind->host_memory) {
            // the CPU uses each file's data section in place
            const int32_t n_parts = m->gguf->n_parts;
            if ((md->mapped = calloc((size_t) n_parts, sizeof(*md->mapped))) == NULL) {
                st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
            }
            for (int32_t i = 0; st == INNERQ_OK && i < n_parts; i++) {
                const struct gguf_file * f = n_parts > 1 ? m->gguf->part[i] : m->gguf;
                if ((md->mapped[i] = iq_backend_buffer_from_host(md->backend, f->data, f->data_size)) == NULL) {
                    st = innerq_fail(INNERQ_ERR_BACKEND, "could not map the weights: %s", iq_error_get());
                }
            }
        } else if (wp.off[d] > 0 && (md->weights = iq_backend_alloc_buffer(md->backend, wp.off[d])) == NULL) {
            st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "the weights (%.1f MiB) on the GPU: %s", wp.off[d] / 1048576.0,
                             iq_error_get());
        }
        if (st == INNERQ_OK && wp.own_off[d] > 0 && (md->own = iq_backend_alloc_buffer(md->backend, wp.own_off[d])) == NULL) {
            st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "reordered weights (%.1f MiB): %s", wp.own_off[d] / 1048576.0,
                             iq_error_get());
        }
    }
    if (st == INNERQ_OK) {
        wp = (struct weights_pass) { .dry = false };
        st = weights_load(m, &wp);
    }
    return st;
}

// One pass over the weights (struct weights_pass).
static innerq_status weights_load(innerq_model * m, struct weights_pass * wp) {
    const struct llama_hparams * hp = &m->hp;
    const int64_t n_embd = hp->n_embd;
    const struct weight_want global[] = {
        { "token_embd.weight", n_embd, hp->n_vocab, 0, hp->n_vocab, 0 },
        { "output_norm.weight", n_embd, 0, 0, 0, LT_F32 },
        { "output.weight", n_embd, hp->n_vocab, 0, hp->n_vocab, LT_OPTIONAL },
        { "rope_freqs.weight", hp->n_rot / 2, 0, 0, 0, LT_OPTIONAL | LT_F32 },
        { "rope_factors_short.weight", hp->n_rot / 2, 0, 0, 0, LT_OPTIONAL | LT_F32 },
        { "rope_factors_long.weight", hp->n_rot / 2, 0, 0, 0, LT_OPTIONAL | LT_F32 },
    };
    struct iq_tensor ** dst[] = { &m->tok_embd, &m->output_norm, &m->output, &m->rope_freqs, &m->rope_short,
                                  &m->rope_long };
    const int32_t dev[] = { m->dev_in, m->dev_out, m->dev_out, m->dev_in, m->dev_in, m->dev_in };
    innerq_status st;
    for (size_t i = 0; i < sizeof(global) / sizeof(global[0]); i++) {
        if ((st = weight_get(m, &global[i], dev[i], wp, dst[i]))) {
            return st;
        }
    }
    if (!wp->dry && m->output == NULL) {
        m->output = m->tok_embd;  // tied embeddings (the input and output layers share a device)
    }
    m->rope_freqs_swa = m->rope_freqs;
    if ((m->rope_short == NULL) != (m->rope_long == NULL)) {
        return innerq_fail(INNERQ_ERR_FORMAT, "rope_factors_short.weight and rope_factors_long.weight come together");
    }
    if ((m->arch->embd_scale && (st = weights_embd_scale(m, wp))) ||
        (hp->rope_factor > 0.0f && (st = weights_rope_scaling(m, wp)))) {
        return st;
    }
    char name[96];
    for (int32_t il = 0; il < hp->n_layer; il++) {
        for (int i = 0; i < m->arch->n_layer_tensor; i++) {
            const struct layer_tensor * lt = &m->arch->layer[i];
            const struct weight_want w = layer_want(hp, il, lt, name, sizeof(name));
            if ((st = weight_get(m, &w, m->layer_dev[il], wp, (struct iq_tensor **) ((char *) &m->layers[il] + lt->field)))) {
                return st;
            }
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
        snprintf(m->desc, sizeof(m->desc), "%s vocab only (%d tokens)", m->arch->name, m->hp.n_vocab);
        return;
    }
    const struct iq_tensor * w = m->layers[0].ffn_up;
    double n = (double) m->n_params;
    const char * unit = n >= 1e9 ? "B" : "M";
    snprintf(m->desc, sizeof(m->desc), "%s %.*f%s %s", m->arch->name, n >= 1e9 ? 1 : 0, n >= 1e9 ? n / 1e9 : n / 1e6, unit,
             iq_type_name(w->type));
}

// The XXH64 of the model's file; of a split model's files, their hashes in order (FNV-1a).
static innerq_status model_fingerprint(const struct gguf_file * f, bool (*progress)(float, void *), void * user,
                                       uint64_t * out) {
    innerq_status st = gguf_file_hash(f, progress, user, out);
    uint64_t h = FNV1A64_INIT;
    for (int32_t i = 0; st == INNERQ_OK && f->n_parts > 1 && i < f->n_parts; i++) {
        uint64_t part = *out;
        if (i > 0) {
            st = gguf_file_hash(f->part[i], progress, user, &part);
        }
        h = fnv1a64(h, &part, sizeof(part));
    }
    *out = st == INNERQ_OK && f->n_parts > 1 ? h : *out;
    return st;
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
    m->device = device_cpu();  // until the weights' device is chosen (a vocabulary alone stays there)
    innerq_status st = gguf_open_split(path, p.use_mmap, &m->gguf);
    // The fingerprint is the hash of every byte of the file (metadata and weights), so a state
    // names exactly the model it was saved with, wherever the file was copied. It is taken
    // first, through read() rather than the mapping: it is the one pass over the whole file at
    // load, and a file cut short since it was opened fails here instead of raising SIGBUS
    // later. Cost: 25 ms for SmolLM2's 98 MB from the page cache (docs/BENCHMARKS.md).
    if (st == INNERQ_OK && !p.vocab_only) {
        st = model_fingerprint(m->gguf, p.progress, p.progress_user_data, &m->fingerprint);
    }
    if (st == INNERQ_OK) {
        st = hparams_arch(m->gguf, &m->arch);
    }
    if (st == INNERQ_OK) {
        st = hparams_load(m->gguf, m->arch, &m->hp);
    }
    if (st == INNERQ_OK) {
        st = vocab_load(m->gguf, &m->vocab);
    }
    if (st == INNERQ_OK) {
        m->hp.n_vocab = vocab_n_tokens(m->vocab);
        m->vocab_only = p.vocab_only;
        // as llama.cpp: the file's pooling type, none where it names none (LLMs)
        uint32_t pooling = INNERQ_POOLING_NONE;
        char key[96];
        gguf_get_u32(m->gguf, key_of(m->arch->name, "pooling_type", key, sizeof(key)), &pooling, &st);
        m->pooling = pooling <= INNERQ_POOLING_LAST ? (int32_t) pooling : INNERQ_POOLING_NONE;
    }
    if (st == INNERQ_OK && !p.vocab_only && (st = weights_count_check(m->gguf, m->arch, &m->hp)) == INNERQ_OK) {
        m->layers = calloc((size_t) m->hp.n_layer, sizeof(*m->layers));
        m->ctx = iq_context_init((size_t) (m->hp.n_layer * m->arch->n_layer_tensor + 8) * iq_tensor_overhead());
        if (m->layers == NULL || m->ctx == NULL) {
            st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory");
        }
    }
    if (st == INNERQ_OK && !p.vocab_only) {
        st = model_devices(m, p.n_gpu_layers);
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
    for (int32_t d = 0; d < MODEL_MAX_DEVICES; d++) {
        iq_buffer_free(m->devs[d].weights);
        for (int32_t i = 0; m->devs[d].mapped != NULL && i < m->gguf->n_parts; i++) {
            iq_buffer_free(m->devs[d].mapped[i]);
        }
        free(m->devs[d].mapped);
        iq_buffer_free(m->devs[d].own);
        if (m->devs[d].backend) {
            iq_backend_free(m->devs[d].backend);
        }
    }
    free(m->layer_dev);
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
innerq_status innerq_model_get_offload(const innerq_model * m, innerq_model_offload * out) {
    if (m == NULL || out == NULL) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_model_get_offload: NULL argument");
    }
    *out = (innerq_model_offload) { .n_layer = m->hp.n_layer + 1 };
    for (int32_t d = 0; d < m->n_dev; d++) {
        // the CPU holds the split's first device; a GPU (or a split's second device) the rest
        const bool offloaded = m->devs[d].dev.kind->type != INNERQ_DEVICE_CPU || d > 0;
        out->n_gpu_layers += offloaded ? m->devs[d].n_layer + (m->n_dev == 1) : 0;
        *(offloaded ? &out->gpu_bytes : &out->cpu_bytes) += m->devs[d].n_bytes;
    }
    return INNERQ_OK;
}

const char * innerq_model_backend(const innerq_model * m) {
    return m ? iq_backend_name(m->n_dev > 0 ? m->devs[m->n_dev - 1].backend : NULL) : "";
}

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
    struct model_graph b = { .model = model, .cache = cache, .ctx = ctx, .n_tokens = n_tokens, .n_seq = n_seq,
                             .n_outputs = n_outputs, .decode_semantics = decode_semantics, .embeddings = embeddings,
                             .out = out };
    return model->arch->build(&b);
}

bool model_build_store_graph(const innerq_model * model, struct kv_cache * cache, struct iq_context * ctx,
                             int32_t n_tokens, struct llama_graph * out) {
    const int32_t n_layer = model->hp.n_layer;
    iq_context_set_backend_id(ctx, model->dev_in);
    out->seqs = iq_new_tensor_2d(ctx, IQ_TYPE_I32, IQ_KV_S_COUNT, 1);
    out->graph = iq_new_graph(ctx, MODEL_GRAPH_NODES_PER_LAYER * n_layer + 32);
    if (out->seqs == NULL || out->graph == NULL) {
        return false;
    }
    iq_set_input(out->seqs);
    for (int32_t il = 0; il < n_layer; il++) {
        const struct iq_tensor * k = out->k[il], * v = out->v[il];  // the measuring step's, for their shapes
        const int32_t dev = cache->layer_dev[il];
        iq_context_set_backend_id(ctx, model->layer_dev[il]);
        out->k[il] = iq_new_tensor_3d(ctx, IQ_TYPE_F32, k->ne[0], k->ne[1], n_tokens);
        out->v[il] = iq_new_tensor_3d(ctx, IQ_TYPE_F32, v->ne[0], v->ne[1], n_tokens);
        if (out->k[il] == NULL || out->v[il] == NULL) {
            return false;
        }
        iq_set_input(out->k[il]);
        iq_set_input(out->v[il]);
        struct iq_tensor * s = iq_kv_store(ctx, out->k[il], out->k[il], out->v[il], &cache->layers[il], out->seqs,
                                           cache->pages[dev]);
        if (!iq_graph_expand(out->graph, s)) {
            return false;
        }
    }
    return true;
}
