// The KV cache's configuration and its defaults (kv-config.h).
#include "kv-config.h"

#include "device.h"
#include "hparams.h"
#include "kv-format.h"
#include "status.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KV_DEFAULT_TYPE_K IQ_TYPE_INNERQ3  // the "innerq" preset is the default cache
#define KV_DEFAULT_TYPE_V IQ_TYPE_INNERQ2

// the bits kv_layer_bits may give a layer's keys or values (innerq2 .. innerq5)
#define KV_LAYER_BITS_MIN 2
#define KV_LAYER_BITS_MAX 5

static bool name_given(const char * name) { return name != NULL && name[0] != '\0'; }

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
        if (kv_format_has_type((enum iq_type) t) && strcmp(iq_type_name((enum iq_type) t), name) == 0) {
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

// The group the default cache takes on head_dim: the device's if it divides head_dim, else the
// largest that does; 0 if none does (the default cache is then f16).
static int32_t kv_default_group(const struct device_kind * dev, int32_t head_dim) {
    const int32_t g = dev->kv_group;
    return head_dim % g == 0 ? g : head_dim % 64 == 0 ? 64 : head_dim % 32 == 0 ? 32 : 0;
}

// Whether cfg is the preset (no option of the caller's) at a context whose sequences its
// windows hold whole: one sequence's n_ctx / n_slots tokens fit in the sink and the recent
// window, so no block is ever flushed.
static bool kv_preset_holds_all(const struct kv_config * cfg) {
    if (!cfg->preset_budget || cfg->value_scales || cfg->params8 || cfg->key_levels || cfg->n_ctx <= 0 ||
        cfg->n_slots <= 0) {
        return false;
    }
    return cfg->n_ctx / cfg->n_slots <= (int64_t) cfg->preset_sink + cfg->preset_recent;
}

innerq_status kv_config_make(const innerq_context_params * p, const struct llama_hparams * hp,
                             const struct device_kind * dev, int32_t n_ctx, int32_t n_slots, struct kv_config * cfg) {
    memset(cfg, 0, sizeof(*cfg));
    const bool auto_bits = p->kv_bits != 0.0f;
    // one name given: it names both (a preset gives each its own type)
    const char * kv_k = name_given(p->kv_k) ? p->kv_k : p->kv_v;
    const char * kv_v = name_given(p->kv_v) ? p->kv_v : p->kv_k;
    // a device's own default cache (kv_bits and kv_layer_bits name InnerQ)
    if (!name_given(kv_k) && dev->kv_default != NULL && !auto_bits && !name_given(p->kv_layer_bits)) {
        kv_k = kv_v = dev->kv_default;
    }
    innerq_status st = kv_type_parse(kv_k, false, &cfg->type_k);
    if (st == INNERQ_OK) {
        st = kv_type_parse(kv_v, true, &cfg->type_v);
    }
    if (st != INNERQ_OK) {
        return st;
    }
    // the automatic layout chooses each layer's InnerQ bits: a type that names bits contradicts it
    if (auto_bits && ((name_given(kv_k) && strcmp(kv_k, "innerq") != 0) ||
                      (name_given(kv_v) && strcmp(kv_v, "innerq") != 0))) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_bits %g chooses the bits itself: it needs the InnerQ "
                           "cache (kv_k / kv_v unset or \"innerq\"), not %s/%s", p->kv_bits, kv_k, kv_v);
    }
    if (auto_bits && name_given(p->kv_layer_bits)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_bits and kv_layer_bits both set the layers' bits: give one");
    }
    const int32_t head_dim = hp != NULL ? hp->head_dim : 0;
    cfg->qcfg.group = p->kv_group;
    if (!name_given(kv_k) && p->kv_group == 0 && iq_qcache_type_is_quantized(cfg->type_k)) {
        // the default cache fits itself to the model
        cfg->qcfg.group = kv_default_group(dev, head_dim);
        if (cfg->qcfg.group == 0 && (auto_bits || name_given(p->kv_layer_bits))) {
            return innerq_fail(INNERQ_ERR_UNSUPPORTED, "kv_bits / kv_layer_bits: no InnerQ group divides head_dim %d",
                               head_dim);
        }
        if (cfg->qcfg.group == 0) {
            cfg->type_k = cfg->type_v = IQ_TYPE_F16;
        }
    }
    cfg->qcfg.group = cfg->qcfg.group != 0 ? cfg->qcfg.group : dev->kv_group;
    if ((cfg->fmt = kv_format_of(cfg->type_k, cfg->type_v)) == NULL) {
        return INNERQ_ERR_UNSUPPORTED;  // kv_format_of said why
    }
    if (cfg->fmt != &kv_format_innerq && name_given(p->kv_layer_bits)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_layer_bits needs an InnerQ cache, not %s/%s",
                           iq_type_name(cfg->type_k), iq_type_name(cfg->type_v));
    }
    cfg->n_ctx = n_ctx;
    cfg->n_slots = n_slots;
    // the preset (types unnamed or "innerq", no layout or windows of the caller's) with a context
    cfg->auto_ahead = dev->kv_auto_ahead;
    cfg->preset_budget = dev->kv_preset_budget && cfg->fmt == &kv_format_innerq && n_ctx > 0 && !auto_bits &&
                         (!name_given(kv_k) || strcmp(kv_k, "innerq") == 0) &&
                         (!name_given(kv_v) || strcmp(kv_v, "innerq") == 0) && !name_given(p->kv_layer_bits) &&
                         p->kv_sink < 0 && p->kv_recent < 0;
    if (cfg->fmt == &kv_format_innerq) {
        // value row scales: asked for (off by default: their AVX2 attention is 9-17% slower as yet,
        // docs/BENCHMARKS.md), where the device's attention reads them
        cfg->value_scales = p->kv_value_scales > 0;
        if (cfg->value_scales && !dev->kv_value_scales) {
            return innerq_fail(INNERQ_ERR_UNSUPPORTED, "kv_value_scales: the %s attention does not read value row "
                               "scales; leave kv_value_scales at -1 or 0 there", dev->name);
        }
        // 8-bit group parameters: asked for (off by default until measured), where the device reads them
        cfg->params8 = p->kv_params8 > 0;
        if (cfg->params8 && !dev->kv_params8) {
            return innerq_fail(INNERQ_ERR_UNSUPPORTED, "kv_params8: the %s attention does not read 8-bit group "
                               "parameters; leave kv_params8 at -1 or 0 there", dev->name);
        }
        // keys on the key levels: asked for (off by default), where the device reads them; the
        // levels are the searched quantizer's grid
        cfg->key_levels = p->kv_key_levels > 0;
        if (cfg->key_levels && !dev->kv_key_levels) {
            return innerq_fail(INNERQ_ERR_UNSUPPORTED, "kv_key_levels: the %s attention does not read keys on "
                               "levels; leave kv_key_levels at -1 or 0 there", dev->name);
        }
        if (cfg->key_levels && (!p->kv_search || !p->kv_hybrid)) {
            return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "kv_key_levels: the key levels are the searched "
                               "quantizer's grid; they need kv_search (and kv_hybrid)");
        }
    }
    if ((st = cfg->fmt->configure(p, hp, cfg)) != INNERQ_OK) {
        return st;
    }
    if (kv_preset_holds_all(cfg)) {
        // the preset at a context its windows hold whole: no token would ever be quantized, and
        // the f16 cache holds the same rows in fewer bytes (n_ctx rows, not S + R + G) and reads
        // them with the f16 kernels (docs/INNERQ.md, "The preset's layout")
        innerq_context_params f = *p;
        f.kv_k = f.kv_v = "f16";
        return kv_config_make(&f, hp, dev, n_ctx, n_slots, cfg);
    }
    if (n_ctx > 0) {
        cfg->fmt->shape(cfg);
    }
    for (int32_t il = 0; hp != NULL && il < hp->n_layer; il++) {
        if (kv_config_window_only(cfg, hp, il)) {
            cfg->swa_rows = hp->n_swa - 1;
        }
    }
    if (cfg->fmt == &kv_format_innerq && name_given(p->kv_layer_bits) && hp != NULL && hp->n_layer > 0) {
        // the layers' own bits: a token's bytes count them (kv_config_bytes_per_token)
        int32_t (*bits)[2] = malloc(sizeof(*bits) * (size_t) hp->n_layer);
        if (bits == NULL) {
            return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory reading kv_layer_bits");
        }
        for (int32_t il = 0; il < hp->n_layer; il++) {
            bits[il][0] = cfg->qcfg.bits_k;
            bits[il][1] = cfg->qcfg.bits_v;
        }
        st = kv_layer_bits_parse(p->kv_layer_bits, hp->n_layer, bits);
        for (int32_t il = 0; il < hp->n_layer && st == INNERQ_OK; il++) {
            cfg->units += bits[il][0] + bits[il][1];
        }
        free(bits);
        return st;
    }
    return kv_layer_bits_parse(p->kv_layer_bits, 0, NULL);
}

static bool kv_window_blocks_kept;

void kv_test_window_blocks(bool keep) { kv_window_blocks_kept = keep; }

bool kv_config_window_only(const struct kv_config * cfg, const struct llama_hparams * hp, int32_t il) {
    return cfg->fmt->quantized && cfg->kv_bits == 0.0 && !kv_window_blocks_kept && cfg->n_ctx > 0 &&
           hparams_layer_is_swa(hp, il) && hp->n_swa < cfg->n_ctx && cfg->qcfg.n_recent >= hp->n_swa;
}

int32_t kv_config_block_layers(const struct kv_config * cfg, const struct llama_hparams * hp) {
    int32_t n = 0;
    for (int32_t il = 0; il < hp->n_layer; il++) {
        n += !kv_config_window_only(cfg, hp, il);
    }
    return n;
}

double kv_config_bytes_per_token(const struct kv_config * cfg, const struct llama_hparams * hp) {
    return cfg->fmt->bytes_per_token(cfg, hp);
}

void kv_config_memory(const struct kv_config * cfg, const struct llama_hparams * hp, uint64_t bytes,
                      innerq_kv_memory * out) {
    const double elements = 2.0 * cfg->n_ctx * hp->n_layer * hp->n_head_kv * hp->head_dim;
    // the quantized region's bits: over the layers that hold one (not the window-only ones)
    const double quant_elements = elements * kv_config_block_layers(cfg, hp) / (hp->n_layer > 0 ? hp->n_layer : 1);
    const bool quantized = cfg->fmt->quantized;
    *out = (innerq_kv_memory) {
        .bytes = bytes, .bits = elements > 0.0 ? 8.0 * (double) bytes / elements : 0.0,
        .quant_bits = quantized && quant_elements > 0.0
                          ? 8.0 * kv_config_bytes_per_token(cfg, hp) * cfg->n_ctx / quant_elements : 0.0,
        .n_ctx = cfg->n_ctx, .group = quantized ? cfg->qcfg.group : 0,
        .n_sink = quantized ? cfg->qcfg.n_sink : 0, .n_recent = quantized ? cfg->qcfg.n_recent : 0,
    };
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

void kv_layer_bits_format(int32_t n_layer, const int32_t (*bits)[2], char * spec) {
    spec[0] = '\0';
    for (int32_t il = 0, n = 0; il < n_layer; il++) {  // a layer below 10^8 and 1-digit bits: 14 bytes
        n += snprintf(spec + n, 16, "%s%d:%d:%d", il ? "," : "", il, bits[il][0], bits[il][1]);
    }
}

bool kv_rot_supported(int32_t head_dim) { return head_dim >= 16 && head_dim <= 256 && (head_dim & (head_dim - 1)) == 0; }

// The preset first: it is the default, and a name kv_k / kv_v accept like the types.
int32_t innerq_kv_type_count(void) {
    int32_t n = 1;
    for (int t = 0; t < IQ_TYPE_COUNT; t++) {
        n += kv_format_has_type((enum iq_type) t);
    }
    return n;
}

const char * innerq_kv_type_name(int32_t i) {
    if (i-- == 0) {
        return "innerq";
    }
    for (int t = 0; t < IQ_TYPE_COUNT; t++) {
        if (kv_format_has_type((enum iq_type) t) && i-- == 0) {
            return iq_type_name((enum iq_type) t);
        }
    }
    return NULL;
}
