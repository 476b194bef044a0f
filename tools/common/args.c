#include "args.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

args args_init(const char * prog, int argc, char ** argv) {
    args a = {prog, argc, argv, 1};
    return a;
}

const char * args_next_flag(args * a) {
    return a->i < a->argc ? a->argv[a->i++] : NULL;
}

void args_usage_error(const args * a, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: error: ", a->prog);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (see %s --help)\n", a->prog);
    va_end(ap);
    exit(2);
}

bool args_is(const char * flag, const char * short_name, const char * long_name) {
    return (short_name && strcmp(flag, short_name) == 0) || strcmp(flag, long_name) == 0;
}

void args_unknown(const args * a, const char * flag) {
    if (flag[0] == '-') {
        args_usage_error(a, "unknown argument '%s'", flag);
    }
    args_usage_error(a, "unexpected argument '%s'", flag);
}

void args_require(const args * a, const void * value, const char * what) {
    if (!value) {
        args_usage_error(a, "no %s given", what);
    }
}

int args_fail_status(const char * prog, const char * what) {
    if (what) {
        fprintf(stderr, "%s: error: %s: %s\n", prog, what, innerq_last_error());
    } else {
        fprintf(stderr, "%s: error: %s\n", prog, innerq_last_error());
    }
    return 1;
}

const char * args_value(args * a) {
    const char * flag = a->argv[a->i - 1];
    if (a->i >= a->argc) {
        args_usage_error(a, "%s needs a value", flag);
    }
    return a->argv[a->i++];
}

bool args_parse_int(const char * s, int32_t * out) {
    char * end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end != '\0' || errno == ERANGE || v < INT32_MIN || v > INT32_MAX) {
        return false;
    }
    *out = (int32_t) v;
    return true;
}

bool args_parse_float(const char * s, float * out) {
    char * end;
    errno = 0;
    float v = strtof(s, &end);
    if (end == s || *end != '\0' || errno == ERANGE || !isfinite(v)) {
        return false;
    }
    *out = v;
    return true;
}

// The element of a list or a single value, checked; the flag is named in the message.
static int32_t args_check_int(const args * a, const char * flag, const char * s, int32_t lo, int32_t hi) {
    int32_t v;
    if (!args_parse_int(s, &v)) {
        args_usage_error(a, "%s expects an integer, got '%s'", flag, s);
    }
    if (v < lo || v > hi) {
        args_usage_error(a, "%s must be in [%d, %d], got %d", flag, lo, hi, v);
    }
    return v;
}

int32_t args_int(args * a, int32_t lo, int32_t hi) {
    const char * flag = a->argv[a->i - 1];
    return args_check_int(a, flag, args_value(a), lo, hi);
}

float args_float(args * a, float lo, float hi) {
    const char * flag = a->argv[a->i - 1];
    const char * s = args_value(a);
    float v;
    if (!args_parse_float(s, &v)) {
        args_usage_error(a, "%s expects a number, got '%s'", flag, s);
    }
    if (v < lo || v > hi) {
        args_usage_error(a, "%s must be in [%g, %g], got %g", flag, lo, hi, v);
    }
    return v;
}

uint64_t args_seed(args * a) {
    const char * flag = a->argv[a->i - 1];
    const char * s = args_value(a);
    if (strcmp(s, "-1") == 0) {
        return 0xFFFFFFFFu;
    }
    char * end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (s[0] < '0' || s[0] > '9' || *end != '\0' || errno == ERANGE) {
        args_usage_error(a, "%s expects a non-negative integer or -1, got '%s'", flag, s);
    }
    return (uint64_t) v;
}

int args_str_list(args * a, char *** out) {
    const char * flag = a->argv[a->i - 1];
    const char * s = args_value(a);
    size_t len = strlen(s);
    int n = 1;
    for (const char * c = s; *c; c++) {
        n += *c == ',';
    }
    char ** items = malloc(n * sizeof(char *) + len + 1);
    if (!items) {
        fprintf(stderr, "%s: error: out of memory\n", a->prog);
        exit(1);
    }
    char * copy = (char *) (items + n);
    memcpy(copy, s, len + 1);
    for (int k = 0; k < n; k++) {
        items[k] = copy;
        char * comma = strchr(copy, ',');
        if (comma) {
            *comma = '\0';
            copy = comma + 1;
        }
        if (items[k][0] == '\0') {
            free(items);
            args_usage_error(a, "%s has an empty element in '%s'", flag, s);
        }
    }
    *out = items;
    return n;
}

int args_int_list(args * a, int32_t lo, int32_t hi, int32_t ** out) {
    const char * flag = a->argv[a->i - 1];
    char ** items;
    int n = args_str_list(a, &items);
    int32_t * v = malloc(n * sizeof(int32_t));
    if (!v) {
        fprintf(stderr, "%s: error: out of memory\n", a->prog);
        exit(1);
    }
    for (int k = 0; k < n; k++) {
        v[k] = args_check_int(a, flag, items[k], lo, hi);
    }
    free(items);
    *out = v;
    return n;
}

bool args_model_flag(args * a, const char * flag, const char ** model, innerq_model_params * mp) {
    if (args_is(flag, "-m", "--model")) {
        *model = args_value(a);
    } else if (args_is(flag, "-ngl", "--n-gpu-layers")) {
        mp->n_gpu_layers = args_int(a, -1, INT32_MAX);
    } else if (args_is(flag, NULL, "--no-mmap")) {
        mp->use_mmap = false;
    } else {
        return false;
    }
    return true;
}

bool args_context_flag(args * a, const char * flag, innerq_context_params * p) {
    if (args_is(flag, "-t", "--threads")) {
        p->n_threads = args_int(a, 0, 512);
    } else if (args_is(flag, "-c", "--ctx-size")) {
        p->n_ctx = args_int(a, 0, 1 << 22);
    } else if (args_is(flag, "-b", "--batch-size")) {
        p->n_batch = args_int(a, 1, 8192);
    } else {
        return false;
    }
    return true;
}

bool args_output_flag(args * a, const char * flag, bool * json) {
    if (!args_is(flag, "-o", "--output")) {
        return false;
    }
    const char * fmt = args_value(a);
    if (strcmp(fmt, "md") != 0 && strcmp(fmt, "json") != 0) {
        args_usage_error(a, "-o expects md or json, got '%s'", fmt);
    }
    *json = strcmp(fmt, "json") == 0;
    return true;
}

bool args_innerq_flag(args * a, const char * flag, innerq_context_params * p) {
    if (args_is(flag, NULL, "--kv-group")) {
        p->kv_group = args_int(a, 0, 4096);
    } else if (args_is(flag, NULL, "--kv-sink")) {
        p->kv_sink = args_int(a, -1, INT32_MAX);
    } else if (args_is(flag, NULL, "--kv-recent")) {
        p->kv_recent = args_int(a, -1, INT32_MAX);
    } else if (args_is(flag, NULL, "--no-kv-hybrid")) {
        p->kv_hybrid = false;
    } else if (args_is(flag, NULL, "--no-kv-norm")) {
        p->kv_norm = false;
    } else if (args_is(flag, NULL, "--no-kv-debias")) {
        p->kv_debias = false;
    } else if (args_is(flag, NULL, "--no-kv-norm-pairs")) {
        p->kv_norm_pairs = false;
    } else if (args_is(flag, NULL, "--kv-rot")) {
        p->kv_rot = args_int(a, INT32_MIN, INT32_MAX);  // the range: innerq_context_params_check
    } else if (args_is(flag, NULL, "--no-kv-rot")) {
        p->kv_rot = 0;
    } else if (args_is(flag, NULL, "--no-kv-search")) {
        p->kv_search = false;
    } else if (args_is(flag, NULL, "--kv-value-scales")) {
        p->kv_value_scales = 1;
    } else if (args_is(flag, NULL, "--no-kv-value-scales")) {
        p->kv_value_scales = 0;
    } else if (args_is(flag, NULL, "--kv-params8")) {
        p->kv_params8 = 1;
    } else if (args_is(flag, NULL, "--no-kv-params8")) {
        p->kv_params8 = 0;
    } else if (args_is(flag, NULL, "--kv-key-levels")) {
        p->kv_key_levels = 1;
    } else if (args_is(flag, NULL, "--no-kv-key-levels")) {
        p->kv_key_levels = 0;
    } else if (args_is(flag, NULL, "--kv-bits")) {
        p->kv_bits = args_float(a, 0.0f, 64.0f);  // the library says which budgets fit
    } else if (args_is(flag, NULL, "--kv-layer-bits")) {
        p->kv_layer_bits = args_value(a);
    } else {
        return false;
    }
    return true;
}

bool args_kv_flag(args * a, const char * flag, innerq_context_params * p) {
    if (args_is(flag, NULL, "--kv-k")) {
        p->kv_k = args_value(a);
    } else if (args_is(flag, NULL, "--kv-v")) {
        p->kv_v = args_value(a);
    } else if (args_is(flag, NULL, "--kv")) {
        p->kv_k = p->kv_v = args_value(a);  // the preset "innerq" gives keys and values their own types
    } else {
        return args_innerq_flag(a, flag, p);
    }
    return true;
}

bool args_kv_list_flag(args * a, const char * flag, args_kv_lists * l, innerq_context_params * p) {
    if (args_is(flag, NULL, "--kv-k")) {
        l->n_kv_k = args_str_list(a, &l->kv_k);
    } else if (args_is(flag, NULL, "--kv-v")) {
        l->n_kv_v = args_str_list(a, &l->kv_v);
    } else if (args_is(flag, NULL, "--kv")) {
        l->n_kv = args_str_list(a, &l->kv);
    } else {
        return args_innerq_flag(a, flag, p);
    }
    return true;
}

const char * args_kv_name(const char * side, const char * other) {
    return side ? side : other ? other : "innerq";
}

void args_check_context(const args * a, const innerq_context_params * p) {
    if (innerq_context_params_check(p) != INNERQ_OK) {
        args_usage_error(a, "%s", innerq_last_error());
    }
}

int args_kv_pairs(const args * a, const args_kv_lists * l, const innerq_context_params * p, const char * (**out)[2]) {
    if (l->kv && (l->kv_k || l->kv_v)) {
        args_usage_error(a, "--kv and --kv-k/--kv-v are exclusive");
    }
    const int nk = l->kv ? l->n_kv : l->kv_k ? l->n_kv_k : 1;
    const int nv = l->kv || !l->kv_v ? 1 : l->n_kv_v;
    const char * (*pairs)[2] = malloc((size_t) nk * nv * sizeof(*pairs));
    if (!pairs) {
        fprintf(stderr, "%s: error: out of memory\n", a->prog);
        exit(1);
    }
    for (int i = 0; i < nk * nv; i++) {
        pairs[i][0] = l->kv ? l->kv[i] : l->kv_k ? l->kv_k[i / nv] : NULL;
        pairs[i][1] = l->kv ? l->kv[i] : l->kv_v ? l->kv_v[i % nv] : NULL;
        innerq_context_params q = *p;
        q.kv_k = pairs[i][0];
        q.kv_v = pairs[i][1];
        args_check_context(a, &q);
    }
    *out = pairs;
    return nk * nv;
}

void args_print_kv_help(FILE * f, bool lists) {
    const innerq_context_params d = innerq_context_default_params();
    const char * arg = lists ? "LIST" : "TYPE";
    fprintf(f, "KV cache%s:\n", lists ? " (LIST: comma-separated, every combination is run)" : "");
    fprintf(f, "  --kv %-15s keys and values (default innerq):", lists ? "LIST" : "TYPE");
    for (int32_t i = 0; i < innerq_kv_type_count(); i++) {
        fprintf(f, " %s", innerq_kv_type_name(i));
    }
    fprintf(f, "\n                       (innerq: innerq3 keys and innerq2 values at least; the bytes of\n"
               "                       its windows go to more bits, docs/INNERQ.md; iq2, iq3, iq4:\n"
               "                       old names of innerq2, innerq3, innerq4, accepted until 0.3)\n");
    fprintf(f, "  --kv-k %-13s cache type of keys\n", arg);
    fprintf(f, "  --kv-v %-13s cache type of values\n", arg);
    fprintf(f,
            "  --kv-group N         InnerQ group size (32, 64, 128; default %d: the backend's, 64 on the CPU)\n"
            "  --kv-sink N          InnerQ sink window (default %d: n_ctx/64 within 32 .. 128;\n"
            "                       64 with value row scales; the preset's: 32)\n"
            "  --kv-recent N        InnerQ recent window (default %d: n_ctx/16 within 96 .. 512,\n"
            "                       448 with value row scales; the preset's: 96; at least a\n"
            "                       model's sliding window + G)\n"
            "  --no-kv-hybrid       asymmetric groups only (no symmetric/asymmetric choice)\n"
            "  --no-kv-norm         no per-channel key normalization\n"
            "  --no-kv-debias       no score correction of quantized keys (docs/INNERQ.md)\n"
            "  --no-kv-norm-pairs   key normalization per channel, not per RoPE channel pair\n"
            "  --kv-rot N           InnerQ Hadamard rotation along head_dim: 0 none, 1 keys, 2 values,\n"
            "                       3 both (default %d: both)\n"
            "  --no-kv-rot          no rotation (--kv-rot 0)\n"
            "  --no-kv-search       min-max group scales instead of the least-squares search\n"
            "  --[no-]kv-value-scales  InnerQ value row scales on / off (default off; on: the CPU only)\n"
            "  --[no-]kv-params8      InnerQ group parameters in 8 bits on / off (default off; on: the CPU only)\n"
            "  --[no-]kv-key-levels   InnerQ 3-bit keys on non-uniform (Lloyd-Max) levels on / off (default off;\n"
            "                       on: the CPU only)\n"
            "  --kv-bits B          InnerQ automatic layout: B effective bits per element of the whole\n"
            "                       cache at n_ctx (f16 windows, (d, m) and norms included); what the\n"
            "                       windows leave goes to 2- to 5-bit keys and values per layer where\n"
            "                       the prompt shows they help most (default %g: off)\n"
            "  --kv-layer-bits LIST InnerQ bits of single layers over the types', LAYER:K:V,...\n",
            d.kv_group, d.kv_sink, d.kv_recent, d.kv_rot, d.kv_bits);
}

char * args_read_file(const char * prog, const char * path, size_t * len) {
    const size_t limit = (size_t) innerq_max_text_bytes();
    FILE * f = fopen(path, "rb");
    size_t cap = 4096, n = 0;
    char * buf = f != NULL ? malloc(cap) : NULL;
    int err = f == NULL ? errno : buf == NULL ? ENOMEM : 0;
    // reads up to one byte past the limit: a file of exactly `limit` bytes is allowed
    while (err == 0) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap || n > limit) {
            err = ferror(f) ? (errno ? errno : EIO) : n > limit ? EFBIG : 0;  // EISDIR, EIO, ...
            break;
        }
        const size_t grown_cap = cap * 2 < limit + 1 ? cap * 2 : limit + 1;
        char * grown = realloc(buf, grown_cap);
        if (grown == NULL) {
            err = ENOMEM;
            break;
        }
        buf = grown;
        cap = grown_cap;
    }
    if (f != NULL) {
        fclose(f);
    }
    if (err == EFBIG) {
        fprintf(stderr, "%s: error: cannot read '%s': it is larger than %zu MiB, the most innerq reads as one text\n",
                prog, path, limit >> 20);
    } else if (err != 0) {
        fprintf(stderr, "%s: error: cannot read '%s': %s\n", prog, path, strerror(err));
    }
    if (err != 0) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

void args_offload(const innerq_model * model, char * buf, size_t size) {
    innerq_model_offload o;
    if (innerq_model_get_offload(model, &o) != INNERQ_OK) {
        snprintf(buf, size, "offload: %s", innerq_last_error());
        return;
    }
    snprintf(buf, size, "offloaded %d/%d layers to the GPU: weights %.2f MiB on the GPU, %.2f MiB on the CPU",
             o.n_gpu_layers, o.n_layer, o.gpu_bytes / 1048576.0, o.cpu_bytes / 1048576.0);
}

void args_kv_memory(innerq_context * ctx, char * buf, size_t size) {
    innerq_kv_memory m;
    if (innerq_context_kv_memory(ctx, &m) != INNERQ_OK) {
        snprintf(buf, size, "KV cache: %s", innerq_last_error());
        return;
    }
    int n = snprintf(buf, size, "KV cache %.2f MiB, %.3f bits per element at n_ctx %d", m.bytes / 1048576.0, m.bits,
                     m.n_ctx);
    if (m.group > 0 && n > 0 && (size_t) n < size) {
        snprintf(buf + n, size - (size_t) n, " (quantized region %.3g, G %d, windows S %d R %d in f16)", m.quant_bits,
                 m.group, m.n_sink, m.n_recent);
    }
}
