// innerq-bench: prompt-processing (pp) and generation (tg) speed, measured as llama-bench
// measures it, with its flags, its markdown table and its JSON field names.
//
// Every combination of the list-valued flags is a test. A pp test evaluates n_prompt tokens
// in batches, a tg test n_gen tokens one at a time; both start from `depth` tokens already in
// the cache (prefilled untimed; repetitions rewind to it, bench_run_once). One untimed warmup run, then -r timed ones.
#define _POSIX_C_SOURCE 200809L

#include "innerq.h"

#include "args.h"
#include "clock.h"
#include "progress.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char * const PROG = "innerq-bench";

struct bench_options {
    const char * model;
    int32_t * n_prompt, * n_gen, * depth, * threads, * batch, * ngl;
    int n_n_prompt, n_n_gen, n_depth, n_threads, n_batch, n_ngl;
    const char * (*kv)[2];  // (keys, values) cache names of each test; NULL: the default
    int n_kv;
    int32_t reps;
    bool batch_given;  // the md table shows n_batch only when it was chosen
    bool ngl_given;    // and n_gpu_layers
    bool json;
    bool quiet;
    innerq_model_params mparams;
    innerq_context_params cparams;  // the InnerQ knobs; the rest is set per test
};

// One row of the report.
struct bench_test {
    const char * type_k, * type_v;  // as reported
    const char * kv_k, * kv_v;      // as given (NULL: the default cache)
    int32_t n_batch, n_threads, n_depth, n_prompt, n_gen;
    int64_t * samples_ns;  // reps of them
    innerq_kv_memory kv;   // the test's cache at its context's size
};

static void bench_print_usage(FILE * f) {
    const innerq_context_params c = innerq_context_default_params();
    fprintf(f,
            "usage: %s -m MODEL [options]\n"
            "\n"
            "Lists are comma-separated; every combination is a test (as llama-bench).\n"
            "  -h, --help              show this help and exit\n"
            "  -m, --model FILE        GGUF model to load\n"
            "  -p, --n-prompt LIST     prompt tokens of the pp tests (default 512; 0: none)\n"
            "  -n, --n-gen LIST        generated tokens of the tg tests (default 128; 0: none)\n"
            "  -d, --n-depth LIST      tokens already in the cache, prefilled untimed (default 0)\n"
            "  -r, --repetitions N     timed runs per test (default 5)\n"
            "  -t, --threads LIST      CPU threads (default %d: the CPUs this process may use, at most 8)\n"
            "  -b, --batch-size LIST   most tokens evaluated at once (default %d)\n"
            "  -ngl, --n-gpu-layers LIST  0: CPU (default); N: the last N layers on the GPU; -1 or > the layer\n"
            "                          count: the whole model (the model is loaded once per value)\n"
            "  --no-mmap               read the model into memory instead of mapping it\n"
            "  -o, --output FORMAT     md or json (default md)\n"
            "  -q, --quiet             no progress on stderr (shown only on a terminal)\n"
            "\n"
            "Each test's context holds exactly its depth, prompt and generated tokens.\n"
            "\n",
            PROG, c.n_threads, c.n_batch);
    args_print_kv_help(f, true);
}

static int32_t bench_max(const int32_t * v, int n) {
    int32_t m = 0;
    for (int i = 0; i < n; i++) {
        m = v[i] > m ? v[i] : m;
    }
    return m;
}

static void bench_parse(int argc, char ** argv, struct bench_options * o) {
    static int32_t def_prompt[] = {512}, def_gen[] = {128}, def_zero[1], def_threads[1], def_batch[1], def_ngl[1];
    memset(o, 0, sizeof(*o));
    o->cparams = innerq_context_default_params();
    o->mparams = innerq_model_default_params();
    def_batch[0] = o->cparams.n_batch;
    def_threads[0] = o->cparams.n_threads;
    o->n_prompt = def_prompt, o->n_n_prompt = 1;
    o->n_gen = def_gen, o->n_n_gen = 1;
    o->depth = def_zero, o->n_depth = 1;
    o->threads = def_threads, o->n_threads = 1;
    o->batch = def_batch, o->n_batch = 1;
    o->ngl = def_ngl, o->n_ngl = 1;
    o->reps = 5;
    args_kv_lists kv = {0};

    args a = args_init(PROG, argc, argv);
    const char * flag;
    while ((flag = args_next_flag(&a)) != NULL) {
        if (args_is(flag, "-h", "--help")) {
            bench_print_usage(stdout);
            exit(0);
        } else if (args_is(flag, "-p", "--n-prompt")) {
            o->n_n_prompt = args_int_list(&a, 0, INT32_MAX / 4, &o->n_prompt);
        } else if (args_is(flag, "-n", "--n-gen")) {
            o->n_n_gen = args_int_list(&a, 0, INT32_MAX / 4, &o->n_gen);
        } else if (args_is(flag, "-d", "--n-depth")) {
            o->n_depth = args_int_list(&a, 0, INT32_MAX / 4, &o->depth);
        } else if (args_is(flag, "-r", "--repetitions")) {
            o->reps = args_int(&a, 1, 100000);
        } else if (args_is(flag, "-t", "--threads")) {
            o->n_threads = args_int_list(&a, 0, 512, &o->threads);
        } else if (args_is(flag, "-b", "--batch-size")) {
            o->n_batch = args_int_list(&a, 1, 8192, &o->batch);  // innerq_context_params' range
            o->batch_given = true;
        } else if (args_is(flag, "-ngl", "--n-gpu-layers")) {
            o->n_ngl = args_int_list(&a, -1, INT32_MAX, &o->ngl);
            o->ngl_given = true;
        } else if (args_is(flag, "-q", "--quiet")) {
            o->quiet = true;
        } else if (!args_model_flag(&a, flag, &o->model, &o->mparams) && !args_output_flag(&a, flag, &o->json) &&
                   !args_kv_list_flag(&a, flag, &kv, &o->cparams)) {
            args_unknown(&a, flag);
        }
    }
    args_require(&a, o->model, "model (-m MODEL)");
    bool any = false;
    for (int i = 0; i < o->n_n_prompt; i++) {
        any |= o->n_prompt[i] > 0;
    }
    for (int i = 0; i < o->n_n_gen; i++) {
        any |= o->n_gen[i] > 0;
    }
    if (!any) {
        args_usage_error(&a, "nothing to run: every -p and -n value is 0");
    }
    o->n_kv = args_kv_pairs(&a, &kv, &o->cparams, &o->kv);
    // Values the library would refuse only once the model is loaded and the table begun.
    const int32_t max_d = bench_max(o->depth, o->n_depth);
    const int32_t max_pn = bench_max(o->n_prompt, o->n_n_prompt) > bench_max(o->n_gen, o->n_n_gen)
                               ? bench_max(o->n_prompt, o->n_n_prompt) : bench_max(o->n_gen, o->n_n_gen);
    if ((int64_t) max_d + max_pn > (1 << 22)) {
        args_usage_error(&a, "-d %d with -p/-n %d needs a context of %lld tokens; the largest is %d", max_d, max_pn,
                         (long long) max_d + max_pn, 1 << 22);
    }
}

// The tests of every combination, in llama-bench's order (pp tests, then tg tests, innermost).
static struct bench_test * bench_make_tests(const struct bench_options * o, int * n_tests) {
    const int n_kv = o->n_kv;
    const size_t max = (size_t) n_kv * o->n_batch * o->n_threads * o->n_depth * (o->n_n_prompt + o->n_n_gen);
    struct bench_test * tests = calloc(max, sizeof(*tests));
    if (!tests) {
        return NULL;
    }
    int n = 0;
    for (int kv = 0; kv < n_kv; kv++) {
        struct bench_test t = {0};
        t.kv_k = o->kv[kv][0];
        t.kv_v = o->kv[kv][1];
        // the automatic layout's types are per layer (the kv_bits field says its budget)
        t.type_k = o->cparams.kv_bits > 0.0f ? "auto" : args_kv_name(o->kv[kv][0], o->kv[kv][1]);
        t.type_v = o->cparams.kv_bits > 0.0f ? "auto" : args_kv_name(o->kv[kv][1], o->kv[kv][0]);
        for (int b = 0; b < o->n_batch; b++) {
            t.n_batch = o->batch[b];
            for (int th = 0; th < o->n_threads; th++) {
                t.n_threads = o->threads[th];
                for (int d = 0; d < o->n_depth; d++) {
                    t.n_depth = o->depth[d];
                    for (int i = 0; i < o->n_n_prompt + o->n_n_gen; i++) {
                        const bool pp = i < o->n_n_prompt;
                        t.n_prompt = pp ? o->n_prompt[i] : 0;
                        t.n_gen = pp ? 0 : o->n_gen[i - o->n_n_prompt];
                        if (t.n_prompt + t.n_gen > 0) {
                            tests[n++] = t;
                        }
                    }
                }
            }
        }
    }
    *n_tests = n;
    return tests;
}

// Valid random tokens (any id of the vocabulary, BOS first if the model wants one), from a
// fixed-seed LCG: the content doesn't matter for speed, only that it's reproducible.
static void bench_fill_tokens(const innerq_model * model, innerq_token * tokens, int32_t n) {
    const uint64_t n_vocab = (uint64_t) innerq_model_n_vocab(model);
    uint64_t x = 0x2545F4914F6CDD1Dull;
    for (int32_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        tokens[i] = (innerq_token) ((x >> 33) % n_vocab);
    }
    if (n > 0 && innerq_vocab_add_bos(model) && innerq_token_bos(model) >= 0) {
        tokens[0] = innerq_token_bos(model);
    }
}

static void bench_test_name(const struct bench_test * t, char * buf, size_t size) {
    int n = t->n_prompt > 0 ? snprintf(buf, size, "pp%d", t->n_prompt) : snprintf(buf, size, "tg%d", t->n_gen);
    if (t->n_depth > 0) {
        snprintf(buf + n, size - (size_t) n, " @ d%d", t->n_depth);
    }
}

// One run: the depth prefilled untimed, then the pp or tg part timed. The first run clears and
// prefills; later runs rewind the previous run's tokens (innerq_cache_truncate to the depth, which
// leaves the state of a fresh prefill of the first n_kept tokens) and prefill what the rewind could
// not keep, so a deep test prefills its depth once rather than once per repetition.
static bool bench_run_once(innerq_context * ctx, const struct bench_test * t, const innerq_token * tokens,
                           bool first, int64_t * ns) {
    int32_t kept = 0;
    if (first || t->n_depth == 0) {
        if (innerq_cache_clear(ctx) != INNERQ_OK) {
            return false;
        }
    } else if (innerq_cache_truncate(ctx, t->n_depth, &kept) != INNERQ_OK) {
        return false;
    }
    if (kept < t->n_depth && innerq_decode(ctx, tokens + kept, t->n_depth - kept) != INNERQ_OK) {
        return false;
    }
    const int64_t t0 = tool_time_ns();
    if (t->n_prompt > 0 && innerq_decode(ctx, tokens, t->n_prompt) != INNERQ_OK) {
        return false;
    }
    for (int32_t i = 0; i < t->n_gen; i++) {
        if (innerq_decode(ctx, &tokens[i], 1) != INNERQ_OK) {
            return false;
        }
    }
    *ns = tool_time_ns() - t0;
    return true;
}

// A context sized for the test, a warmup run, then reps timed runs into t->samples_ns.
static bool bench_run_test(const struct bench_options * o, innerq_model * model, struct bench_test * t,
                           progress * bar, int i_test, int n_tests) {
    innerq_context_params cp = o->cparams;
    cp.n_ctx = t->n_depth + t->n_prompt + t->n_gen;
    cp.n_batch = t->n_batch;
    cp.n_threads = t->n_threads;
    cp.kv_k = t->kv_k;
    cp.kv_v = t->kv_v;
    int32_t n_tokens = t->n_depth > t->n_prompt ? t->n_depth : t->n_prompt;
    n_tokens = n_tokens > t->n_gen ? n_tokens : t->n_gen;
    innerq_token * tokens = malloc((size_t) n_tokens * sizeof(innerq_token));
    t->samples_ns = malloc((size_t) o->reps * sizeof(int64_t));
    if (!tokens || !t->samples_ns) {
        free(tokens);
        fprintf(stderr, "%s: error: out of memory\n", PROG);
        return false;
    }
    bench_fill_tokens(model, tokens, n_tokens);
    innerq_context * ctx = NULL;
    int64_t warmup;
    char name[48];
    bench_test_name(t, name, sizeof(name));
    progress_show(bar, "test %d/%d (%s, %s/%s): warmup", i_test + 1, n_tests, name, t->type_k, t->type_v);
    bool ok = innerq_context_init(model, &cp, &ctx) == INNERQ_OK && innerq_context_kv_memory(ctx, &t->kv) == INNERQ_OK &&
              bench_run_once(ctx, t, tokens, true, &warmup);
    for (int r = 0; ok && r < o->reps; r++) {
        progress_show(bar, "test %d/%d (%s, %s/%s): run %d/%d", i_test + 1, n_tests, name, t->type_k, t->type_v,
                      r + 1, o->reps);
        ok = bench_run_once(ctx, t, tokens, false, &t->samples_ns[r]);
    }
    progress_clear(bar);
    if (!ok) {
        args_fail_status(PROG, NULL);
    }
    innerq_context_free(ctx);
    free(tokens);
    return ok;
}

// ---- statistics and reports ----

struct bench_stats {
    double avg_ns, stddev_ns, avg_ts, stddev_ts;
};

// Mean and sample standard deviation (n - 1; 0 for one sample), as llama-bench reports them.
static void bench_mean_stddev(const double * x, int n, double * mean, double * stddev) {
    double sum = 0.0, sq = 0.0;
    for (int i = 0; i < n; i++) {
        sum += x[i];
    }
    *mean = sum / n;
    for (int i = 0; i < n; i++) {
        sq += (x[i] - *mean) * (x[i] - *mean);
    }
    *stddev = n > 1 ? sqrt(sq / (n - 1)) : 0.0;
}

static double bench_sample_ts(const struct bench_test * t, int64_t ns) {
    return (double) (t->n_prompt + t->n_gen) * 1e9 / (double) (ns > 0 ? ns : 1);
}

static struct bench_stats bench_stats_of(const struct bench_test * t, int reps, double * scratch) {
    struct bench_stats s;
    for (int r = 0; r < reps; r++) {
        scratch[r] = (double) t->samples_ns[r];
    }
    bench_mean_stddev(scratch, reps, &s.avg_ns, &s.stddev_ns);
    for (int r = 0; r < reps; r++) {
        scratch[r] = bench_sample_ts(t, t->samples_ns[r]);
    }
    bench_mean_stddev(scratch, reps, &s.avg_ts, &s.stddev_ts);
    return s;
}

struct bench_model_info {
    const char * filename;
    const char * desc;
    uint64_t size, n_params;
    const char * backend;
};

static void bench_md_header(bool show_batch, bool show_ngl) {
    printf("| %-30s | %10s | %10s | %-10s | %7s |%s%s %6s | %6s | %7s | %15s | %20s |\n", "model", "size", "params",
           "backend", "threads", show_ngl ? "  ngl |" : "", show_batch ? " n_batch |" : "", "type_k", "type_v",
           "kv bits", "test", "t/s");
    printf("| ------------------------------ | ---------: | ---------: | ---------- | ------: |%s%s -----: | "
           "-----: | ------: | --------------: | -------------------: |\n",
           show_ngl ? " ---: |" : "", show_batch ? " ------: |" : "");
}

static void bench_md_row(const struct bench_model_info * m, const struct bench_test * t, const struct bench_stats * s,
                         bool show_batch, const int32_t * ngl) {
    char size[32], params[32], threads[16], batch[24] = "", ngl_col[24] = "", test[48], ts[48];
    const double mib = (double) m->size / (1024.0 * 1024.0);
    if (mib < 1024.0) {
        snprintf(size, sizeof(size), "%.2f MiB", mib);
    } else {
        snprintf(size, sizeof(size), "%.2f GiB", mib / 1024.0);
    }
    if (m->n_params < 1000000000ull) {
        snprintf(params, sizeof(params), "%.2f M", (double) m->n_params / 1e6);
    } else {
        snprintf(params, sizeof(params), "%.2f B", (double) m->n_params / 1e9);
    }
    if (t->n_threads > 0) {
        snprintf(threads, sizeof(threads), "%d", t->n_threads);
    } else {
        snprintf(threads, sizeof(threads), "auto");
    }
    if (show_batch) {
        snprintf(batch, sizeof(batch), " %7d |", t->n_batch);
    }
    if (ngl != NULL) {
        snprintf(ngl_col, sizeof(ngl_col), " %4d |", *ngl);
    }
    bench_test_name(t, test, sizeof(test));
    snprintf(ts, sizeof(ts), "%.2f ± %.2f", s->avg_ts, s->stddev_ts);
    // "±" is two bytes but one column: pad by one more so the table stays aligned.
    printf("| %-30s | %10s | %10s | %-10s | %7s |%s%s %6s | %6s | %7.3f | %15s | %21s |\n", m->desc, size, params,
           m->backend, threads, ngl_col, batch, t->type_k, t->type_v, t->kv.bits, test, ts);
    fflush(stdout);
}

static void bench_json_string(const char * s) {
    putchar('"');
    for (const unsigned char * c = (const unsigned char *) s; *c; c++) {
        if (*c == '"' || *c == '\\') {
            printf("\\%c", *c);
        } else if (*c < 0x20) {
            printf("\\u%04x", *c);
        } else {
            putchar(*c);
        }
    }
    putchar('"');
}

static void bench_json_row(const struct bench_options * o, const struct bench_model_info * m, const struct bench_test * t,
                           const struct bench_stats * s, int32_t ngl, bool first) {
    printf("%s  {\n    \"model_filename\": ", first ? "" : ",\n");
    bench_json_string(m->filename);
    printf(",\n    \"model_type\": ");
    bench_json_string(m->desc);
    printf(",\n    \"model_size\": %llu,\n    \"model_n_params\": %llu,\n", (unsigned long long) m->size,
           (unsigned long long) m->n_params);
    printf("    \"backend\": \"%s\",\n    \"cpu_isa\": ", m->backend);
    bench_json_string(innerq_cpu_isa());
    printf(",\n    \"n_gpu_layers\": %d,\n    \"n_batch\": %d,\n    \"n_threads\": %d,\n    \"type_k\": ", ngl,
           t->n_batch, t->n_threads);
    bench_json_string(t->type_k);
    printf(",\n    \"type_v\": ");
    bench_json_string(t->type_v);
    printf(",\n    \"kv_group\": %d,\n    \"kv_sink\": %d,\n    \"kv_recent\": %d,\n    \"kv_bits\": %g,\n",
           o->cparams.kv_group, o->cparams.kv_sink, o->cparams.kv_recent, o->cparams.kv_bits);
    printf("    \"kv_hybrid\": %s,\n    \"kv_norm\": %s,\n    \"kv_debias\": %s,\n    \"kv_norm_pairs\": %s,\n",
           o->cparams.kv_hybrid ? "true" : "false", o->cparams.kv_norm ? "true" : "false",
           o->cparams.kv_debias ? "true" : "false", o->cparams.kv_norm_pairs ? "true" : "false");
    printf("    \"n_prompt\": %d,\n    \"n_gen\": %d,\n    \"n_depth\": %d,\n", t->n_prompt, t->n_gen, t->n_depth);
    printf("    \"kv_n_ctx\": %d,\n    \"kv_bytes\": %llu,\n    \"kv_effective_bits\": %.6f,\n", t->kv.n_ctx,
           (unsigned long long) t->kv.bytes, t->kv.bits);
    printf("    \"avg_ns\": %.0f,\n    \"stddev_ns\": %.0f,\n    \"avg_ts\": %.6f,\n    \"stddev_ts\": %.6f,\n",
           s->avg_ns, s->stddev_ns, s->avg_ts, s->stddev_ts);
    printf("    \"samples_ns\": [");
    for (int r = 0; r < o->reps; r++) {
        printf("%s%lld", r ? ", " : " ", (long long) t->samples_ns[r]);
    }
    printf(" ],\n    \"samples_ts\": [");
    for (int r = 0; r < o->reps; r++) {
        printf("%s%.6f", r ? ", " : " ", bench_sample_ts(t, t->samples_ns[r]));
    }
    printf(" ]\n  }");
    fflush(stdout);
}

int main(int argc, char ** argv) {
    struct bench_options o;
    bench_parse(argc, argv, &o);
    int n_tests = 0;
    struct bench_test * tests = bench_make_tests(&o, &n_tests);
    double * scratch = malloc((size_t) o.reps * sizeof(double));
    if (!tests || !scratch) {
        fprintf(stderr, "%s: error: out of memory\n", PROG);
        return 1;
    }

    int rc = 0;
    progress bar = progress_init(PROG, o.quiet);
    if (o.json) {
        printf("[\n");
    } else {
        bench_md_header(o.batch_given, o.ngl_given);
    }
    // the model once per -ngl value (where its layers go is fixed at load), its tests in order
    for (int g = 0; g < o.n_ngl && rc == 0; g++) {
        innerq_model * model = NULL;
        innerq_model_params mp = o.mparams;
        mp.n_gpu_layers = o.ngl[g];
        if (innerq_model_load(o.model, &mp, &model) != INNERQ_OK) {
            rc = args_fail_status(PROG, NULL);
            break;
        }
        const struct bench_model_info info = {
            .filename = o.model,
            .desc = innerq_model_desc(model),
            .size = innerq_model_size(model),
            .n_params = innerq_model_n_params(model),
            .backend = innerq_model_backend(model),
        };
        for (int i = 0; i < n_tests && rc == 0; i++) {
            struct bench_test * t = &tests[i];
            free(t->samples_ns);
            t->samples_ns = NULL;
            if (!bench_run_test(&o, model, t, &bar, g * n_tests + i, o.n_ngl * n_tests)) {
                rc = 1;
                break;
            }
            const struct bench_stats s = bench_stats_of(t, o.reps, scratch);
            if (o.json) {
                bench_json_row(&o, &info, t, &s, mp.n_gpu_layers, g == 0 && i == 0);
            } else {
                bench_md_row(&info, t, &s, o.batch_given, o.ngl_given ? &mp.n_gpu_layers : NULL);
            }
        }
        innerq_model_free(model);
    }
    if (o.json) {
        printf("\n]\n");
    }
    for (int i = 0; i < n_tests; i++) {
        free(tests[i].samples_ns);
    }
    free(tests);
    free(scratch);
    return rc;
}
