// innerq-attn-bench: decode attention alone (docs/DESIGN.md section 5). One query token attends to
// N stored tokens of one layer through the real ATTENTION op on the CPU backend, or on the GPU
// (-ngl N / --device cuda), for a head configuration, a context length and a cache type; prints
// the median time of a call, the effective bandwidth (the bytes the cache type must read for N
// tokens, over that time) and the speedup over an f16 cache measured in the same run. On the
// GPU also the byte floor: those bytes over the device-to-device copy bandwidth measured at the
// start of the run, and the time over that floor.
//
// The cache is filled as the runtime fills it: plain types row by row with the type's
// conversion, quantized types in prompt-sized chunks through the runtime's flush plan
// (kv_qplan) and what the KV_STORE op does with it (iq_qcache_store_head), so windows, flushes
// and key normalization are real. On the GPU the cache is built so in host memory, then its
// bytes are copied to a device buffer (the block format is the same on both backends) and
// the op's counters are the ones the runtime's plan computed for the host build. Keys look post-RoPE: per-channel means and a few
// outlier channel pairs of 10x magnitude, rotated by their position.
#define _POSIX_C_SOURCE 200809L

#include "args.h"
#include "clock.h"
#include "iq-alloc.h"
#include "iq-backend.h"
#include "device.h"
#include "iq-qcache.h"
#include "iq-kv.h"
#include "kv-config.h"
#include "kv-plan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char * const PROG = "innerq-attn-bench";

#define AB_MIN_LOOP_NS 20000000LL  // each rep times a loop of calls lasting at least this
#define AB_FILL_CHUNK 512          // tokens per store while filling the cache (a prompt batch)
#define AB_OUTLIER_PAIRS 2         // key channel pairs of 10x magnitude per KV head
#define AB_COPY_LOOP 4             // copies per timed loop of the copy bandwidth
#define AB_GPU_CHAIN 9             // ATTENTION nodes of the GPU's second graph (see ab_run_sample)
#define AB_MAX_LAYERS 128          // --layers

struct ab_config {
    const char * name;
    int32_t n_head, n_kv_head, head_dim;
};

static const struct ab_config AB_PRESETS[] = {
    {"smollm", 9, 3, 64},      // SmolLM2-135M
    {"llama3-8b", 32, 8, 128}, // Llama 3 8B
    {"llama2-7b", 32, 32, 128}, // Llama 2 7B
};
#define AB_N_PRESETS ((int) (sizeof(AB_PRESETS) / sizeof(AB_PRESETS[0])))

// One cache type pair, resolved by the runtime's own parser.
struct ab_kv {
    enum iq_type type_k, type_v;
    struct iq_qcache_config qcfg;  // quantized types only
    bool norm_pairs;               // key normalization per RoPE pair: every channel pairs up here
};

struct ab_options {
    struct ab_config * configs;
    int n_configs;
    int32_t * n_tokens, * threads;
    int n_n_tokens, n_threads;
    struct ab_kv * kvs;
    int n_kvs;
    int32_t reps;
    bool json;
    bool gpu;          // -ngl N != 0 or --device cuda
    int32_t ngl;       // as given (-1 when only --device cuda was)
    int32_t copy_mib;  // size of the copy that measures the device's bandwidth
    int32_t layers;    // caches a timed loop cycles through (1: one layer's, hot in the CPU's caches)
};

// One measured case.
struct ab_result {
    double us;      // median µs per call
    double bytes;   // bytes the cache type must read for the N stored tokens
    double * samples_us;
    const char * kernel;  // which attention ran: "cpu", "plain", "fused" or "dequant" (GPU)
};

static void ab_print_usage(FILE * f) {
    fprintf(f,
            "usage: %s [options]\n"
            "\n"
            "Decode attention (one query token over N stored tokens of one layer) through the\n"
            "CPU backend's attention op, or the GPU's. Lists are comma-separated; every combination is run.\n"
            "  -h, --help              show this help and exit\n"
            "  --preset LIST           head configurations: smollm (9/3, D 64), llama3-8b (32/8, D 128),\n"
            "                          llama2-7b (32/32, D 128)\n"
            "  --heads Q/KV            query heads / KV heads (default 9/3; not with --preset)\n"
            "  -D, --head-dim N        head dimension, at most 256 (default 64; not with --preset)\n"
            "  -N, --n-tokens LIST     stored tokens (default 1024,4096,8192,32768)\n"
            "  -t, --threads LIST      CPU threads (default 2; not used on the GPU)\n"
            "  -ngl, --n-gpu-layers N  0: the CPU (default); any other value: the GPU (CUDA)\n"
            "  --device cpu|cuda       the same choice by name (default cpu)\n"
            "  --copy-mib N            GPU: MiB copied device to device to measure the bandwidth of the\n"
            "                          byte floor (default 1024)\n"
            "  -r, --repetitions N     timed loops per case, the median is reported (default 5)\n"
            "  --layers N              CPU: N copies of the layer's cache, one call on each in turn, as a\n"
            "                          model's decode step reads its layers (default 1: one cache, which\n"
            "                          stays in the CPU's caches); a call's time is the loop's over N\n"
            "  -o, --output FORMAT     md or json (default md)\n"
            "\n",
            PROG);
    args_print_kv_help(f, true);
    fprintf(f, "\n--kv defaults to f16,q8_0,q4_0,kivi2,innerq. The speedup column is against an f16\n"
               "cache of the same shape, measured in the same run: the cases of one N take turns, a\n"
               "loop each per repetition, and the column is the median of the per-repetition ratios.\n"
               "On the GPU (kv groups default to 32 there) a call is timed as the difference between\n"
               "loops of a graph of 9 such calls and of the one-call graph, over 8, which leaves out\n"
               "each graph's fixed cost (launch, counters, synchronize); floor µs is the bytes the type must read over the device-to-device copy\n"
               "bandwidth measured at the start (read + write bytes counted), x floor the time over it;\n"
               "kernel says which attention ran: plain (f32/f16/q8_0/q4_0), fused (the quantized decode\n"
               "kernel) or dequant (a quantized cache it doesn't take, e.g. KIVI: dequantized copy).\n");
}

static const struct ab_config * ab_preset_find(const char * name) {
    for (int i = 0; i < AB_N_PRESETS; i++) {
        if (strcmp(AB_PRESETS[i].name, name) == 0) {
            return &AB_PRESETS[i];
        }
    }
    return NULL;
}

// "Q/KV" with Q a multiple of KV.
static void ab_parse_heads(args * a, struct ab_config * c) {
    const char * s = args_value(a);
    char buf[64];
    const char * slash = strchr(s, '/');
    int32_t q = 0, kv = 0;
    bool ok = slash != NULL && (size_t) (slash - s) < sizeof(buf);
    if (ok) {
        memcpy(buf, s, (size_t) (slash - s));
        buf[slash - s] = '\0';
        ok = args_parse_int(buf, &q) && args_parse_int(slash + 1, &kv);
    }
    if (!ok || q < 1 || kv < 1 || q > 1024 || q % kv != 0) {
        args_usage_error(a, "--heads expects Q/KV with Q a multiple of KV (e.g. 9/3), got '%s'", s);
    }
    c->n_head = q;
    c->n_kv_head = kv;
}

// The pair (name_k, name_v) as the runtime reads it (a preset such as "innerq", or one name
// for both when the other is NULL), with the InnerQ knobs; a usage error if it is not one.
static void ab_resolve_kv(args * a, const char * name_k, const char * name_v, const innerq_context_params * knobs,
                          const struct device_kind * dev, struct ab_kv * kv) {
    innerq_context_params p = *knobs;
    p.kv_k = name_k;
    p.kv_v = name_v;
    // the names are always given here, so the model (which only the default needs) is not
    struct kv_config cfg;
    if (kv_config_make(&p, NULL, dev, 0, 0, &cfg) != INNERQ_OK) {
        args_usage_error(a, "%s", innerq_last_error());
    }
    kv->type_k = cfg.type_k;
    kv->type_v = cfg.type_v;
    kv->qcfg = cfg.qcfg;
    kv->norm_pairs = p.kv_norm_pairs;
}

static void ab_parse(int argc, char ** argv, struct ab_options * o) {
    static int32_t def_tokens[] = {1024, 4096, 8192, 32768}, def_threads[] = {2};
    static char * def_kv[] = {"f16", "q8_0", "q4_0", "kivi2", "innerq"};
    memset(o, 0, sizeof(*o));
    o->n_tokens = def_tokens, o->n_n_tokens = 4;
    o->threads = def_threads, o->n_threads = 1;
    o->reps = 5;
    o->copy_mib = 1024;
    o->layers = 1;
    const char * device = NULL;
    bool ngl_given = false;
    struct ab_config custom = {"custom", 9, 3, 64};
    bool custom_given = false;
    char ** presets = NULL;
    int n_presets = 0;
    args_kv_lists kv = {0};
    innerq_context_params knobs = innerq_context_default_params();

    args a = args_init(PROG, argc, argv);
    const char * flag;
    while ((flag = args_next_flag(&a)) != NULL) {
        if (args_is(flag, "-h", "--help")) {
            ab_print_usage(stdout);
            exit(0);
        } else if (args_is(flag, NULL, "--preset")) {
            n_presets = args_str_list(&a, &presets);
        } else if (args_is(flag, NULL, "--heads")) {
            ab_parse_heads(&a, &custom);
            custom_given = true;
        } else if (args_is(flag, "-D", "--head-dim")) {
            custom.head_dim = args_int(&a, 2, IQ_QCACHE_MAX_HEAD_DIM);
            custom_given = true;
        } else if (args_is(flag, "-N", "--n-tokens")) {
            o->n_n_tokens = args_int_list(&a, 1, 1 << 22, &o->n_tokens);
        } else if (args_is(flag, "-t", "--threads")) {
            o->n_threads = args_int_list(&a, 1, 512, &o->threads);
        } else if (args_is(flag, "-r", "--repetitions")) {
            o->reps = args_int(&a, 1, 100000);
        } else if (args_is(flag, "-ngl", "--n-gpu-layers")) {
            o->ngl = args_int(&a, -1, INT32_MAX);
            ngl_given = true;
        } else if (args_is(flag, NULL, "--device")) {
            device = args_value(&a);
            if (strcmp(device, "cpu") != 0 && strcmp(device, "cuda") != 0) {
                args_usage_error(&a, "--device expects cpu or cuda, got '%s'", device);
            }
        } else if (args_is(flag, NULL, "--copy-mib")) {
            o->copy_mib = args_int(&a, 1, 65536);
        } else if (args_is(flag, NULL, "--layers")) {
            o->layers = args_int(&a, 1, AB_MAX_LAYERS);
        } else if (!args_output_flag(&a, flag, &o->json) && !args_kv_list_flag(&a, flag, &kv, &knobs)) {
            args_unknown(&a, flag);
        }
    }
    if (presets && custom_given) {
        args_usage_error(&a, "--preset and --heads/-D are exclusive");
    }
    if (knobs.kv_bits != 0.0f || knobs.kv_layer_bits != NULL) {
        // one attention op over one layer's cache: its format is named with --kv-k / --kv-v
        args_usage_error(&a, "--kv-bits and --kv-layer-bits choose formats per layer of a model; this benchmark "
                         "times one layer's cache: name its types with --kv-k / --kv-v");
    }
    if (device != NULL && ngl_given && (strcmp(device, "cuda") == 0) != (o->ngl != 0)) {
        args_usage_error(&a, "--device %s and -ngl %d disagree", device, o->ngl);
    }
    o->gpu = (device != NULL && strcmp(device, "cuda") == 0) || o->ngl != 0;
    if (o->gpu && o->ngl == 0) {
        o->ngl = -1;
    }
    if (o->gpu && o->layers > 1) {
        args_usage_error(&a, "--layers is for the CPU (a GPU's timing already leaves its caches cold past its L2)");
    }

    o->n_configs = presets ? n_presets : 1;
    o->configs = calloc((size_t) o->n_configs, sizeof(*o->configs));
    if (o->configs == NULL) {
        fprintf(stderr, "%s: error: out of memory\n", PROG);
        exit(1);
    }
    for (int i = 0; i < n_presets; i++) {
        const struct ab_config * c = ab_preset_find(presets[i]);
        if (c == NULL) {
            args_usage_error(&a, "unknown preset '%s' (known: smollm, llama3-8b, llama2-7b)", presets[i]);
        }
        o->configs[i] = *c;
    }
    if (!presets) {
        o->configs[0] = custom;
    }

    // a comparison: without cache flags, the baselines and the InnerQ preset, each against f16
    const bool kv_given = kv.kv || kv.kv_k || kv.kv_v;
    if (!kv_given) {
        kv.kv = def_kv, kv.n_kv = 5;
    }
    const char * (*pairs)[2] = NULL;
    o->n_kvs = args_kv_pairs(&a, &kv, &knobs, &pairs);
    o->kvs = calloc((size_t) o->n_kvs, sizeof(*o->kvs));
    if (o->kvs == NULL) {
        fprintf(stderr, "%s: error: out of memory\n", PROG);
        exit(1);
    }
    const struct device_kind * kind = device_kind_of(o->gpu ? INNERQ_DEVICE_GPU : INNERQ_DEVICE_CPU);
    for (int i = 0; i < o->n_kvs; i++) {
        ab_resolve_kv(&a, pairs[i][0], pairs[i][1], &knobs, kind, &o->kvs[i]);
    }
    free(pairs);
    free(presets);
    free(kv.kv_k);
    free(kv.kv_v);
    if (kv_given) {
        free(kv.kv);
    }
}

// ---- synthetic keys, values and queries ----

struct ab_rng {
    uint64_t s;
};

static uint64_t ab_rng_next(struct ab_rng * r) {  // splitmix64
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Roughly standard normal (a centred sum of four uniforms): shape doesn't matter for speed.
static float ab_rng_normal(struct ab_rng * r) {
    const uint64_t x = ab_rng_next(r);
    const float u = (float) (x & 0xFFFF) + (float) ((x >> 16) & 0xFFFF) + (float) ((x >> 32) & 0xFFFF) +
                    (float) (x >> 48);
    return (u / 65536.0f - 2.0f) * 1.7320508f;  // variance of the sum of 4 U(0,1) is 1/3
}

// The distribution of a layer's keys: a mean and a spread per KV head and channel, and the
// RoPE frequency of each channel pair.
struct ab_keys {
    int32_t n_kv_head, head_dim;
    float * mean, * sigma;  // [n_kv_head][head_dim]
    float * freq;           // [head_dim / 2]
};

static bool ab_keys_init(struct ab_keys * ks, int32_t n_kv_head, int32_t head_dim, struct ab_rng * rng) {
    ks->n_kv_head = n_kv_head;
    ks->head_dim = head_dim;
    ks->mean = malloc(sizeof(float) * (2 * (size_t) n_kv_head * head_dim + (size_t) head_dim / 2));
    if (ks->mean == NULL) {
        return false;
    }
    ks->sigma = ks->mean + (size_t) n_kv_head * head_dim;
    ks->freq = ks->sigma + (size_t) n_kv_head * head_dim;
    for (int32_t i = 0; i < head_dim / 2; i++) {
        ks->freq[i] = powf(10000.0f, -2.0f * (float) i / (float) head_dim);
    }
    for (int32_t h = 0; h < n_kv_head; h++) {
        float * mu = ks->mean + (size_t) h * head_dim, * sd = ks->sigma + (size_t) h * head_dim;
        for (int32_t c = 0; c < head_dim; c++) {
            mu[c] = 0.5f * ab_rng_normal(rng);
            sd[c] = 1.0f;
        }
        // outliers come in RoPE pairs: the rotation mixes the two channels of a pair
        for (int i = 0; i < AB_OUTLIER_PAIRS && 2 * i < head_dim; i++) {
            const int32_t c = (int32_t) (ab_rng_next(rng) % (uint64_t) (head_dim / 2)) * 2;
            mu[c] *= 10.0f, mu[c + 1] *= 10.0f;
            sd[c] = sd[c + 1] = 10.0f;
        }
    }
    return true;
}

// Keys and values of tokens [t0, t0 + n), f32 [n][n_kv_head][head_dim] each (iq_attention's k, v).
static void ab_keys_fill(const struct ab_keys * ks, int32_t t0, int32_t n, struct ab_rng * rng, float * k, float * v) {
    const int32_t d = ks->head_dim;
    for (int32_t t = 0; t < n; t++) {
        float rot[IQ_QCACHE_MAX_HEAD_DIM];  // cos, sin of each pair at this position
        for (int32_t i = 0; i < d / 2; i++) {
            const float theta = (float) (t0 + t) * ks->freq[i];
            rot[2 * i] = cosf(theta), rot[2 * i + 1] = sinf(theta);
        }
        for (int32_t h = 0; h < ks->n_kv_head; h++) {
            const size_t row = ((size_t) t * ks->n_kv_head + h) * d;
            const float * mu = ks->mean + (size_t) h * d, * sd = ks->sigma + (size_t) h * d;
            for (int32_t c = 0; c + 1 < d; c += 2) {
                const float x = mu[c] + sd[c] * ab_rng_normal(rng), y = mu[c + 1] + sd[c + 1] * ab_rng_normal(rng);
                k[row + c] = x * rot[c] - y * rot[c + 1];
                k[row + c + 1] = x * rot[c + 1] + y * rot[c];
            }
            if (d % 2 != 0) {
                k[row + d - 1] = mu[d - 1] + sd[d - 1] * ab_rng_normal(rng);
            }
            for (int32_t c = 0; c < d; c++) {
                v[row + c] = ab_rng_normal(rng);
            }
        }
    }
}

// ---- one case: a filled layer and a one-op graph ----

struct ab_case {
    struct ab_config cfg;
    const struct ab_kv * kv;
    int32_t n_tokens;
};

// One sequence's cache of one layer, as the runtime lays it out for a context of one sequence:
// its pages in order (the page table is the identity, in the layer's buffer after the storage).
struct ab_layer {
    struct iq_kv_layer layer;
    bool quantized;
    struct iq_qcache qc;      // quantized: the regions over the buffer, and the counters ...
    struct kv_qstate qstate;  // ... as the runtime keeps them
    struct iq_tensor * pages;
    size_t pages_off;
    iq_buffer * buf;
};

#define AB_PLAIN_PAGE 64  // tokens per page of a plain cache (one tile of the CPU's attention)

static size_t ab_align(size_t n) { return (n + 63) / 64 * 64; }

// The identity page table of n_pages pages, placed at off of l->buf.
static bool ab_layer_pages(struct ab_layer * l, struct iq_context * ctx, int32_t n_pages, size_t off) {
    l->pages = iq_new_tensor_2d(ctx, IQ_TYPE_I32, n_pages > 0 ? n_pages : 1, 1);
    if (l->pages == NULL) {
        return false;
    }
    l->pages_off = off;
    iq_tensor_place(l->pages, l->buf, off);
    for (int32_t j = 0; j < n_pages; j++) {
        ((int32_t *) l->pages->data)[j] = j;
    }
    return true;
}

// Storage for n_ctx tokens, empty; false (+ iq_error_set) on an unsupported shape or no memory.
static bool ab_layer_init(struct ab_layer * l, iq_backend * be, struct iq_context * ctx, const struct ab_case * cs,
                          int32_t n_ctx) {
    const struct ab_kv * kv = cs->kv;
    const int32_t d = cs->cfg.head_dim, n_kv = cs->cfg.n_kv_head;
    memset(l, 0, sizeof(*l));
    l->layer = (struct iq_kv_layer) { .type_k = kv->type_k, .type_v = kv->type_v, .head_dim = d,
                                      .n_kv_head = n_kv, .n_ctx = n_ctx, .n_slots = 1 };
    if (iq_qcache_type_is_quantized(kv->type_k)) {
        struct iq_qcache_config qcfg = kv->qcfg;
        qcfg.rope_dims = kv->norm_pairs ? d : 0;  // as the runtime's cache of a model with n_rot = D
        if (!iq_qcache_layout(&l->qc, &qcfg, d, n_kv, n_ctx) ||
            (l->buf = iq_backend_alloc_buffer(be, l->qc.size + ab_align(sizeof(int32_t) * (size_t) (l->qc.cap_blocks + 1)))) ==
                NULL) {
            return false;
        }
        l->quantized = true;
        l->layer.qcfg = qcfg;
        l->layer.page = qcfg.group;
        l->layer.n_pages = l->qc.cap_blocks;
        iq_qcache_bind(&l->qc, l->buf->base);
        for (int r = 0; r < IQ_QREGION_COUNT; r++) {
            enum iq_type type;
            int64_t ne[4];
            iq_qcache_region_shape(&l->qc, (enum iq_qregion) r, &type, ne);
            if ((l->layer.region[r] = iq_new_tensor(ctx, type, 4, ne)) == NULL) {
                return false;
            }
            iq_tensor_place(l->layer.region[r], l->buf, l->qc.off[r]);
        }
        float * norm = (float *) l->qc.region[IQ_QREGION_NORM];
        for (int32_t i = 0; i < n_kv * d; i++) {
            norm[i] = 1.0f;
        }
        return ab_layer_pages(l, ctx, l->qc.cap_blocks, l->qc.size);
    }
    if (iq_row_size(kv->type_k, d) == 0 || iq_row_size(kv->type_v, d) == 0) {
        iq_error_set("cache types %s/%s need the head dimension (%d) to be a multiple of their block size",
                     iq_type_name(kv->type_k), iq_type_name(kv->type_v), d);
        return false;
    }
    l->layer.page = AB_PLAIN_PAGE;
    l->layer.n_pages = (n_ctx + AB_PLAIN_PAGE - 1) / AB_PLAIN_PAGE;
    const int64_t rows = (int64_t) l->layer.n_pages * AB_PLAIN_PAGE;
    l->layer.k = iq_new_tensor_3d(ctx, kv->type_k, d, rows, n_kv);
    l->layer.v = iq_new_tensor_3d(ctx, kv->type_v, d, rows, n_kv);
    if (l->layer.k == NULL || l->layer.v == NULL) {
        return false;
    }
    const size_t size_k = ab_align(iq_nbytes(l->layer.k)), size_v = ab_align(iq_nbytes(l->layer.v));
    if ((l->buf = iq_backend_alloc_buffer(be, size_k + size_v + sizeof(int32_t) * (size_t) l->layer.n_pages)) == NULL) {
        return false;
    }
    iq_tensor_place(l->layer.k, l->buf, 0);
    iq_tensor_place(l->layer.v, l->buf, size_k);
    return ab_layer_pages(l, ctx, l->layer.n_pages, size_k + size_v);
}

// Appends n tokens (f32 [n][n_kv_head][head_dim]) at position t0, as the KV_STORE op would.
static bool ab_layer_store(struct ab_layer * l, int32_t t0, const float * k, const float * v, int32_t n) {
    if (l->quantized) {
        struct iq_kv_seq b;
        if (!kv_qplan(&l->qc.cfg, l->qc.n_ctx, t0, &l->qstate, n, &b)) {
            return false;
        }
        for (int32_t h = 0; h < l->qc.n_kv_head; h++) {
            iq_qcache_store_head(&l->qc, &b.flush, h, k, v, n);
        }
        kv_qcommit(&l->qc.cfg, &b, &l->qstate);
        l->qc.n_tokens = t0 + n;
        l->qc.n_sink = l->qstate.n_sink;
        l->qc.n_quant = l->qstate.n_quant;
        l->qc.n_recent = l->qc.n_tokens - l->qc.n_sink - l->qc.n_quant;
        return true;
    }
    const int32_t d = l->layer.head_dim, n_kv = l->layer.n_kv_head;
    struct iq_tensor * dst[2] = { l->layer.k, l->layer.v };
    const float * src[2] = { k, v };
    for (int i = 0; i < 2; i++) {
        const iq_from_float_fn from_float = iq_type_traits_get(dst[i]->type)->from_float;
        for (int32_t t = 0; t < n; t++) {
            for (int32_t h = 0; h < n_kv; h++) {
                from_float(src[i] + ((size_t) t * n_kv + h) * d,
                           (char *) dst[i]->data + h * dst[i]->nb[2] + (t0 + t) * dst[i]->nb[1], d);
            }
        }
    }
    return true;
}

// Moves the filled layer to a buffer of dev (the GPU): the host buffer's bytes are copied as
// they are (the block format and the region offsets are the same on every backend) and the
// layer's tensors are placed at the same offsets there. The counters stay as the fill left them.
static bool ab_layer_upload(struct ab_layer * l, struct iq_context * ctx, iq_backend * dev) {
    const size_t size = l->buf->size;
    const size_t off_v = l->quantized ? 0 : (size_t) ((char *) l->layer.v->data - (char *) l->buf->base);
    iq_buffer * db = iq_backend_alloc_buffer(dev, size);
    struct iq_tensor * src = iq_new_tensor_1d(ctx, IQ_TYPE_I8, (int64_t) size);
    struct iq_tensor * dst = iq_new_tensor_1d(ctx, IQ_TYPE_I8, (int64_t) size);
    if (db == NULL || src == NULL || dst == NULL) {
        if (db != NULL) {
            iq_buffer_free(db);
        }
        return false;
    }
    iq_tensor_place(src, l->buf, 0);
    iq_tensor_place(dst, db, 0);
    if (!iq_tensor_copy(dst, src)) {
        iq_buffer_free(db);
        return false;
    }
    if (l->quantized) {
        for (int r = 0; r < IQ_QREGION_COUNT; r++) {
            iq_tensor_place(l->layer.region[r], db, l->qc.off[r]);
        }
        iq_qcache_bind(&l->qc, db->base);  // device addresses: the bench only reads the counters now
    } else {
        iq_tensor_place(l->layer.k, db, 0);
        iq_tensor_place(l->layer.v, db, off_v);
    }
    iq_tensor_place(l->pages, db, l->pages_off);
    iq_buffer_free(l->buf);
    l->buf = db;
    return true;
}

// Which attention the GPU runs for the layer (the dispatch of cuda/attention.cu and
// cuda/qattention.cu, restated): plain types have their own kernel; a quantized cache goes to
// the fused decode kernel when it has G 32, keys grouped along channels and values along
// tokens (InnerQ), 2..5 bits and at most 8 query heads per KV head, else to the dequantize path.
static const char * ab_gpu_kernel(const struct ab_case * cs) {
    const struct ab_kv * kv = cs->kv;
    if (!iq_qcache_type_is_quantized(kv->type_k)) {
        return "plain";
    }
    const struct iq_qcache_config * q = &kv->qcfg;
    const bool fused = q->axis_k == IQ_QAXIS_CHANNELS && q->axis_v == IQ_QAXIS_TOKENS && q->group == 32 &&
                       q->bits_k >= 2 && q->bits_k <= 5 && q->bits_v >= 2 && q->bits_v <= 5 &&
                       cs->cfg.n_head / cs->cfg.n_kv_head <= 8;
    return fused ? "fused" : "dequant";
}

// Bytes a decode call must read from the cache: every stored row of a plain type; the f16
// rows of the windows plus the quantized blocks (codes and (d, m)) of a quantized one.
static double ab_layer_read_bytes(const struct ab_layer * l, int32_t n_tokens) {
    const struct iq_kv_layer * y = &l->layer;
    if (!l->quantized) {
        return (double) n_tokens * y->n_kv_head *
               (double) (iq_row_size(y->type_k, y->head_dim) + iq_row_size(y->type_v, y->head_dim));
    }
    const struct iq_qcache * c = &l->qc;
    const double windows = (double) (c->n_sink + c->n_recent) * c->n_kv_head * c->head_dim * 2 * sizeof(iq_fp16_t);
    const double blocks = (double) (c->n_quant / c->cfg.group) * c->n_kv_head * (double) (c->block_bytes_k + c->block_bytes_v);
    return windows + blocks;
}

static int ab_cmp_double(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return x < y ? -1 : x > y;
}

// The median of x[0..n), sorted in scratch (n doubles).
static double ab_median(const double * x, int32_t n, double * scratch) {
    memcpy(scratch, x, sizeof(double) * (size_t) n);
    qsort(scratch, (size_t) n, sizeof(double), ab_cmp_double);
    return n % 2 ? scratch[n / 2] : 0.5 * (scratch[n / 2 - 1] + scratch[n / 2]);
}

// One case set up for timing: its layer filled with N tokens and the graph q, k, v (one
// token) -> ATTENTION, with the loop length that lasts AB_MIN_LOOP_NS.
struct ab_run {
    struct iq_context * ctx;
    iq_gallocr * ga;
    struct ab_layer l;
    struct iq_cgraph * g;
    // On a GPU also a graph of AB_GPU_CHAIN such nodes (NULL on the CPU; see ab_run_sample).
    struct iq_cgraph * chain;
    int64_t iters;
    // --layers: n_layers - 1 more copies of l, g then holds a node over each in turn
    struct ab_layer * more;
    int32_t n_layers;
};

static void ab_run_free(struct ab_run * run) {
    if (run->l.buf) {
        iq_buffer_free(run->l.buf);
    }
    for (int32_t i = 0; run->more != NULL && i < run->n_layers - 1; i++) {
        if (run->more[i].buf) {
            iq_buffer_free(run->more[i].buf);
        }
    }
    free(run->more);
    if (run->ga) {
        iq_gallocr_free(run->ga);
    }
    if (run->ctx) {
        iq_context_free(run->ctx);
    }
    *run = (struct ab_run) {0};
}

// µs per compute of g over one loop of run->iters computes (then one synchronize); -1 on failure.
static double ab_graph_loop(iq_backend * be, const struct ab_run * run, struct iq_cgraph * g) {
    const int64_t t0 = tool_time_ns();
    for (int64_t i = 0; i < run->iters; i++) {
        if (iq_backend_graph_compute(be, g) != 0) {
            return -1.0;
        }
    }
    if (iq_backend_synchronize(be) != 0) {  // a GPU queues the calls: the loop ends when they are done
        return -1.0;
    }
    return (double) (tool_time_ns() - t0) / 1e3 / (double) run->iters;
}

static double ab_run_loop(iq_backend * be, const struct ab_run * run) { return ab_graph_loop(be, run, run->g); }

// One timing sample of a case: µs per ATTENTION call. On the CPU, a loop of the one-node graph.
// On a GPU each graph compute also pays a fixed cost (the launch or graph replay, the counters'
// upload, the synchronize the backend ends a compute with), tens of µs against kernels of a few:
// the sample is the difference between loops of the AB_GPU_CHAIN-node graph and the one-node
// graph, over AB_GPU_CHAIN - 1 (the kernels' own time, as CUDA events around them would give).
static double ab_run_sample(iq_backend * be, const struct ab_run * run) {
    if (run->chain == NULL) {  // the CPU: a loop of the graph's n_layers calls
        const double us = ab_run_loop(be, run);
        return us >= 0 ? us / run->n_layers : us;
    }
    const double one = ab_run_loop(be, run);
    const double chain = one >= 0 ? ab_graph_loop(be, run, run->chain) : -1.0;
    if (chain < 0) {
        return -1.0;
    }
    const double us = (chain - one) / (AB_GPU_CHAIN - 1);
    return us > 0 ? us : 0.0;
}

// Sets run up for cs: fills the layer, builds the graph, and doubles the loop until it lasts
// AB_MIN_LOOP_NS (this also warms the caches up). *bytes: what the cache type must read. The
// layer is filled in host's memory; be runs the op (when it is not host, the GPU, the filled
// layer is copied there first).
static bool ab_run_setup(iq_backend * host, iq_backend * be, const struct ab_case * cs, int32_t n_layers,
                         struct ab_run * run, double * bytes) {
    const int32_t d = cs->cfg.head_dim, n_kv = cs->cfg.n_kv_head, n = cs->n_tokens;
    *run = (struct ab_run) {0};
    run->n_layers = n_layers;
    const size_t graph = 16 + (IQ_QREGION_COUNT + 3) * (size_t) n_layers;  // a layer: its regions, pages and node
    run->ctx = iq_context_init((20 + AB_GPU_CHAIN + (IQ_QREGION_COUNT + 4) * (size_t) n_layers) * iq_tensor_overhead() +
                               2 * iq_graph_overhead(graph));
    run->ga = iq_gallocr_new(be);
    float * kbuf = malloc(2 * sizeof(float) * (size_t) AB_FILL_CHUNK * n_kv * d);
    float * qbuf = malloc(sizeof(float) * (size_t) cs->cfg.n_head * d);
    struct ab_keys keys = {0};
    struct ab_rng rng = { 0x1234567u + (uint64_t) d * 131 + (uint64_t) n_kv };
    bool ok = run->ctx != NULL && run->ga != NULL && kbuf != NULL && qbuf != NULL && ab_keys_init(&keys, n_kv, d, &rng);
    if (!ok) {
        iq_error_set("out of memory");
    }
    ok = ok && ab_layer_init(&run->l, host, run->ctx, cs, n + 1);  // the query's own token is position n
    float * vbuf = kbuf + (size_t) AB_FILL_CHUNK * n_kv * d;
    for (int32_t t = 0; ok && t < n; t += AB_FILL_CHUNK) {
        const int32_t m = n - t < AB_FILL_CHUNK ? n - t : AB_FILL_CHUNK;
        ab_keys_fill(&keys, t, m, &rng, kbuf, vbuf);
        ok = ab_layer_store(&run->l, t, kbuf, vbuf, m);
    }
    if (ok && be != host) {
        ok = ab_layer_upload(&run->l, run->ctx, be);
    }
    if (ok && n_layers > 1) {  // copies of the filled layer: the same bytes, the same counters
        run->more = calloc((size_t) n_layers - 1, sizeof(*run->more));
        ok = run->more != NULL;
        for (int32_t i = 0; ok && i < n_layers - 1; i++) {
            struct ab_layer * m = &run->more[i];
            ok = ab_layer_init(m, host, run->ctx, cs, n + 1) && m->buf->size == run->l.buf->size;
            if (ok) {
                memcpy(m->buf->base, run->l.buf->base, run->l.buf->size);
                m->qstate = run->l.qstate;
                m->qc.n_tokens = run->l.qc.n_tokens, m->qc.n_sink = run->l.qc.n_sink;
                m->qc.n_quant = run->l.qc.n_quant, m->qc.n_recent = run->l.qc.n_recent;
            }
        }
        if (!ok) {
            iq_error_set("out of memory for %d copies of the layer", n_layers);
        }
    }

    struct iq_tensor * q = NULL, * k = NULL, * v = NULL, * seqs = NULL, * out = NULL;
    struct iq_kv_seq row = { .slot = 0, .token0 = 0, .n_tokens = 1, .n_past = n };
    if (ok) {
        q = iq_new_tensor_3d(run->ctx, IQ_TYPE_F32, d, cs->cfg.n_head, 1);
        k = iq_new_tensor_3d(run->ctx, IQ_TYPE_F32, d, n_kv, 1);
        v = iq_new_tensor_3d(run->ctx, IQ_TYPE_F32, d, n_kv, 1);
        seqs = iq_new_tensor_2d(run->ctx, IQ_TYPE_I32, IQ_KV_S_COUNT, 1);
        ok = !run->l.quantized || kv_qplan(&run->l.qc.cfg, n + 1, n, &run->l.qstate, 1, &row);
        row.slot = row.token0 = 0;
        row.n_tokens = 1;
        out = ok ? iq_attention(run->ctx, q, k, v, &run->l.layer, seqs, run->l.pages, 1.0f / sqrtf((float) d)) : NULL;
        run->g = out != NULL ? iq_new_graph(run->ctx, graph) : NULL;
        ok = run->g != NULL;
        for (int32_t i = 0; ok && i < n_layers - 1; i++) {  // the copies first, then the layer's own call
            struct iq_tensor * o = iq_attention(run->ctx, q, k, v, &run->more[i].layer, seqs, run->more[i].pages,
                                                1.0f / sqrtf((float) d));
            ok = o != NULL;
            if (ok) {
                iq_set_output(o);
                ok = iq_graph_expand(run->g, o);
            }
        }
        if (ok && be != host) {  // the chain: the same call AB_GPU_CHAIN times, every result kept
            run->chain = iq_new_graph(run->ctx, 16);
            ok = run->chain != NULL && iq_graph_expand(run->chain, out);
            for (int j = 1; ok && j < AB_GPU_CHAIN; j++) {
                struct iq_tensor * o = iq_attention(run->ctx, q, k, v, &run->l.layer, seqs, run->l.pages,
                                                    1.0f / sqrtf((float) d));
                ok = o != NULL;
                if (ok) {
                    iq_set_output(o);
                    ok = iq_graph_expand(run->chain, o);
                }
            }
        }
    }
    if (ok) {
        iq_set_input(q), iq_set_input(k), iq_set_input(v), iq_set_input(seqs);
        iq_set_output(out);
        // the chain holds every tensor of the one-node graph: one allocation places both
        ok = iq_graph_expand(run->g, out) && iq_gallocr_alloc_graph(run->ga, run->chain ? run->chain : run->g);
    }
    if (ok) {
        ab_keys_fill(&keys, n, 1, &rng, kbuf, vbuf);
        for (int32_t i = 0; i < cs->cfg.n_head * d; i++) {
            qbuf[i] = ab_rng_normal(&rng);
        }
        iq_tensor_set(q, qbuf, 0, iq_nbytes(q));
        iq_tensor_set(k, kbuf, 0, iq_nbytes(k));
        iq_tensor_set(v, vbuf, 0, iq_nbytes(v));
        iq_tensor_set(seqs, &row, 0, sizeof(row));
        *bytes = ab_layer_read_bytes(&run->l, n);
    }
    for (run->iters = 1; ok; run->iters *= 2) {
        const double us = ab_run_loop(be, run);
        ok = us >= 0;
        if (us * 1e3 * (double) run->iters >= AB_MIN_LOOP_NS) {
            break;
        }
    }
    free(keys.mean);
    free(kbuf);
    free(qbuf);
    if (!ok) {
        ab_run_free(run);
    }
    return ok;
}

// The device-to-device copy bandwidth of be in GB/s, read and written bytes counted (2x the
// size per copy): the median over reps loops of AB_COPY_LOOP copies of mib MiB, each loop
// closed by a synchronize and a one-byte read back; -1 (+ iq_error_set) on failure.
static double ab_copy_gbps(iq_backend * be, int32_t mib, int32_t reps) {
    const size_t size = (size_t) mib << 20;
    struct iq_context * ctx = iq_context_init(4 * iq_tensor_overhead());
    iq_buffer * a = ctx != NULL ? iq_backend_alloc_buffer(be, size) : NULL;
    iq_buffer * b = a != NULL ? iq_backend_alloc_buffer(be, size) : NULL;
    double * samples = malloc(sizeof(double) * 2 * (size_t) reps);
    double gbps = -1.0;
    struct iq_tensor * ta = b != NULL ? iq_new_tensor_1d(ctx, IQ_TYPE_I8, (int64_t) size) : NULL;
    struct iq_tensor * tb = ta != NULL ? iq_new_tensor_1d(ctx, IQ_TYPE_I8, (int64_t) size) : NULL;
    if (tb == NULL || samples == NULL) {
        iq_error_set("copy bandwidth: no memory for two %d MiB buffers%s%s", mib, ctx != NULL ? ": " : "",
                     ctx != NULL ? iq_error_get() : "");
    } else {
        iq_tensor_place(ta, a, 0);
        iq_tensor_place(tb, b, 0);
        iq_buffer_clear(a, 1);
        iq_buffer_clear(b, 2);
        bool ok = iq_tensor_copy(tb, ta) && iq_backend_synchronize(be) == 0;  // warm up
        for (int32_t r = 0; ok && r < reps; r++) {
            const int64_t t0 = tool_time_ns();
            for (int i = 0; ok && i < AB_COPY_LOOP; i++) {
                ok = i % 2 ? iq_tensor_copy(ta, tb) : iq_tensor_copy(tb, ta);
            }
            uint8_t byte;
            ok = ok && iq_backend_synchronize(be) == 0;
            if (ok) {
                iq_tensor_get(tb, &byte, size - 1, 1);
            }
            samples[r] = 2.0 * (double) size * AB_COPY_LOOP / (double) (tool_time_ns() - t0);
        }
        gbps = ok ? ab_median(samples, reps, samples + reps) : -1.0;
    }
    free(samples);
    if (b != NULL) {
        iq_buffer_free(b);
    }
    if (a != NULL) {
        iq_buffer_free(a);
    }
    if (ctx != NULL) {
        iq_context_free(ctx);
    }
    return gbps;
}

// ---- reports ----

// The floor columns (floor µs, x floor) are filled on the GPU only: copy_gbps <= 0 on the CPU.
static void ab_md_header(void) {
    printf("| %-9s | %5s | %4s | %7s | %6s | %6s | %6s | %10s | %7s | %7s | %9s | %7s | %-7s |\n", "config", "heads",
           "D", "threads", "N", "type_k", "type_v", "µs/call", "GB/s", "vs f16", "floor µs", "x floor", "kernel");
    printf("| --------- | ----: | ---: | ------: | -----: | ------ | ------ | ---------: | ------: | ------: | "
           "-------: | ------: | ------- |\n");
}

static void ab_md_row(const struct ab_case * cs, int32_t threads, const struct ab_result * r, double speedup,
                      double copy_gbps) {
    char heads[24], th[16], floor_us[24] = "-", x_floor[24] = "-";
    snprintf(heads, sizeof(heads), "%d/%d", cs->cfg.n_head, cs->cfg.n_kv_head);
    if (copy_gbps > 0) {
        const double f = r->bytes / (copy_gbps * 1e3);
        snprintf(th, sizeof(th), "gpu");
        snprintf(floor_us, sizeof(floor_us), "%.2f", f);
        snprintf(x_floor, sizeof(x_floor), "%.2fx", r->us / f);
    } else {
        snprintf(th, sizeof(th), "%d", threads);
    }
    // "µ" is two bytes but one column: the header pads it by one more
    printf("| %-9s | %5s | %4d | %7s | %6d | %-6s | %-6s | %10.2f | %7.2f | %6.2fx | %8s | %7s | %-7s |\n",
           cs->cfg.name, heads, cs->cfg.head_dim, th, cs->n_tokens, iq_type_name(cs->kv->type_k),
           iq_type_name(cs->kv->type_v), r->us, r->bytes / (r->us * 1e3), speedup, floor_us, x_floor, r->kernel);
    fflush(stdout);
}

static void ab_json_row(const struct ab_case * cs, int32_t threads, int32_t layers, const struct ab_result * r,
                        double speedup, int32_t reps, double copy_gbps, bool first) {
    const bool quantized = iq_qcache_type_is_quantized(cs->kv->type_k);
    printf("%s  {\n    \"config\": \"%s\",\n    \"n_head\": %d,\n    \"n_kv_head\": %d,\n    \"head_dim\": %d,\n",
           first ? "" : ",\n", cs->cfg.name, cs->cfg.n_head, cs->cfg.n_kv_head, cs->cfg.head_dim);
    printf("    \"device\": \"%s\",\n    \"kernel\": \"%s\",\n", copy_gbps > 0 ? "cuda" : "cpu", r->kernel);
    printf("    \"n_threads\": %d,\n    \"cpu_isa\": \"%s\",\n    \"n_tokens\": %d,\n    \"layers\": %d,\n",
           copy_gbps > 0 ? 0 : threads, innerq_cpu_isa(), cs->n_tokens, layers);
    printf("    \"type_k\": \"%s\",\n    \"type_v\": \"%s\",\n", iq_type_name(cs->kv->type_k),
           iq_type_name(cs->kv->type_v));
    if (quantized) {
        const struct iq_qcache_config * q = &cs->kv->qcfg;
        printf("    \"kv_group\": %d,\n    \"kv_sink\": %d,\n    \"kv_recent\": %d,\n", q->group, q->n_sink,
               q->n_recent);
    }
    printf("    \"us_median\": %.3f,\n    \"bytes\": %.0f,\n    \"gb_per_s\": %.6f,\n    \"speedup_vs_f16\": %.4f,\n",
           r->us, r->bytes, r->bytes / (r->us * 1e3), speedup);
    if (copy_gbps > 0) {
        const double f = r->bytes / (copy_gbps * 1e3);
        printf("    \"copy_gb_per_s\": %.3f,\n    \"floor_us\": %.6f,\n    \"x_floor\": %.4f,\n", copy_gbps, f,
               r->us / f);
    }
    printf("    \"samples_us\": [");
    for (int32_t i = 0; i < reps; i++) {
        printf("%s%.3f", i ? ", " : " ", r->samples_us[i]);
    }
    printf(" ]\n  }");
    fflush(stdout);
}

// Runs the cases of one (config, threads, N) into results[0..n_kvs), and the f16 baseline:
// the f16 pair of the list, or results[n_kvs], measured for the ratio only. The cases take
// turns, one loop each per repetition, so a slow spell of the machine hits them alike;
// speedup[i] is the median over repetitions of the baseline's loop time over case i's.
// Returns false (+ iq_error_set) on failure.
static bool ab_run_group(const struct ab_options * o, iq_backend * host, iq_backend * be, const struct ab_config * cfg,
                         int32_t n_tokens, struct ab_result * results, double * speedup, double * scratch) {
    static const struct ab_kv f16 = { IQ_TYPE_F16, IQ_TYPE_F16, {0}, false };
    int base = o->n_kvs;
    for (int i = 0; i < o->n_kvs; i++) {
        base = base == o->n_kvs && o->kvs[i].type_k == IQ_TYPE_F16 && o->kvs[i].type_v == IQ_TYPE_F16 ? i : base;
    }
    const int n_cases = base == o->n_kvs ? o->n_kvs + 1 : o->n_kvs;
    struct ab_run * runs = calloc((size_t) n_cases, sizeof(*runs));
    bool ok = runs != NULL;
    if (!ok) {
        iq_error_set("out of memory");
    }
    for (int i = 0; ok && i < n_cases; i++) {
        const struct ab_case cs = { *cfg, i < o->n_kvs ? &o->kvs[i] : &f16, n_tokens };
        ok = ab_run_setup(host, be, &cs, o->layers, &runs[i], &results[i].bytes);
        if (ok && i < o->n_kvs) {
            results[i].kernel = be != host ? ab_gpu_kernel(&cs) : "cpu";
        }
    }
    for (int32_t r = 0; ok && r < o->reps; r++) {
        for (int i = 0; ok && i < n_cases; i++) {
            results[i].samples_us[r] = ab_run_sample(be, &runs[i]);
            ok = results[i].samples_us[r] >= 0;
        }
    }
    for (int i = 0; ok && i < n_cases; i++) {
        results[i].us = ab_median(results[i].samples_us, o->reps, scratch);
    }
    for (int i = 0; ok && i < o->n_kvs; i++) {
        double * ratio = scratch + o->reps;
        for (int32_t r = 0; r < o->reps; r++) {
            ratio[r] = results[base].samples_us[r] / results[i].samples_us[r];
        }
        speedup[i] = ab_median(ratio, o->reps, scratch);
    }
    for (int i = 0; runs != NULL && i < n_cases; i++) {
        ab_run_free(&runs[i]);
    }
    free(runs);
    return ok;
}

// The GPU backend for o->ngl and the host one its layers are filled in; 0, or 1 with the
// message printed (no CUDA in this build, no device).
static int ab_gpu_init(const struct ab_options * o, iq_backend ** dev, iq_backend ** host) {
    struct device gpu;
    int32_t split;  // a model of no layers is never split
    if (device_choose(o->ngl, 0, false, &gpu, &split) != INNERQ_OK || device_backend_init(gpu, 0, dev) != INNERQ_OK) {
        return args_fail_status(PROG, "GPU");
    }
    for (int c = 0; c < o->n_configs; c++) {
        for (int k = 0; k < o->n_kvs; k++) {
            if (gpu.kind->kv_check(o->configs[c].head_dim, o->kvs[k].type_k, o->kvs[k].type_v) != INNERQ_OK) {
                iq_backend_free(*dev);
                return args_fail_status(PROG, NULL);
            }
        }
    }
    if (device_backend_init(device_cpu(), 1, host) != INNERQ_OK) {
        iq_backend_free(*dev);
        return args_fail_status(PROG, "CPU backend");
    }
    return 0;
}

int main(int argc, char ** argv) {
    struct ab_options o;
    ab_parse(argc, argv, &o);
    struct ab_result * results = calloc((size_t) o.n_kvs + 1, sizeof(*results));
    double * samples = malloc(sizeof(double) * (size_t) o.reps * (size_t) (o.n_kvs + 3));
    double * speedup = malloc(sizeof(double) * (size_t) o.n_kvs);
    if (results == NULL || samples == NULL || speedup == NULL) {
        fprintf(stderr, "%s: error: out of memory\n", PROG);
        return 1;
    }
    for (int i = 0; i <= o.n_kvs; i++) {
        results[i].samples_us = samples + (size_t) i * o.reps;
    }
    double * scratch = samples + (size_t) (o.n_kvs + 1) * o.reps;

    iq_backend * dev = NULL, * host = NULL;
    double copy_gbps = 0;  // the GPU's, measured once before the cases
    if (o.gpu) {
        const int rc = ab_gpu_init(&o, &dev, &host);
        if (rc != 0) {
            return rc;
        }
        copy_gbps = ab_copy_gbps(dev, o.copy_mib, o.reps > 3 ? o.reps : 3);
        if (copy_gbps <= 0) {
            iq_backend_free(dev);
            iq_backend_free(host);
            return args_fail_status(PROG, NULL);
        }
        if (!o.json) {
            printf("device: %s; device-to-device copy: %.1f GB/s (%d MiB, read + written bytes)\n\n",
                   iq_backend_name(dev), copy_gbps, o.copy_mib);
        }
    }

    if (o.json) {
        printf("[\n");
    } else {
        if (o.layers > 1) {
            printf("%d copies of each layer's cache, one call on each in turn (µs/call: the loop's over %d)\n\n",
                   o.layers, o.layers);
        }
        ab_md_header();
    }
    int rc = 0;
    bool first = true;
    const int n_passes = o.gpu ? 1 : o.n_threads;  // thread counts are the CPU's
    for (int th = 0; th < n_passes && rc == 0; th++) {
        iq_backend * be = dev;
        if (!o.gpu && device_backend_init(device_cpu(), o.threads[th], &be) != INNERQ_OK) {
            rc = args_fail_status(PROG, "CPU backend");
            break;
        }
        for (int c = 0; c < o.n_configs && rc == 0; c++) {
            for (int i = 0; i < o.n_n_tokens && rc == 0; i++) {
                if (!ab_run_group(&o, o.gpu ? host : be, be, &o.configs[c], o.n_tokens[i], results, speedup, scratch)) {
                    rc = args_fail_status(PROG, NULL);
                    break;
                }
                for (int k = 0; k < o.n_kvs; k++) {
                    const struct ab_case cs = { o.configs[c], &o.kvs[k], o.n_tokens[i] };
                    if (o.json) {
                        ab_json_row(&cs, o.threads[th], o.layers, &results[k], speedup[k], o.reps, copy_gbps, first);
                    } else {
                        ab_md_row(&cs, o.threads[th], &results[k], speedup[k], copy_gbps);
                    }
                    first = false;
                }
            }
        }
        if (!o.gpu) {
            iq_backend_free(be);
        }
    }
    if (dev != NULL) {
        iq_backend_free(dev);
        iq_backend_free(host);
    }
    if (o.json && rc == 0) {
        printf("\n]\n");
    }
    free(results);
    free(samples);
    free(speedup);
    return rc;
}
