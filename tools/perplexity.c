// innerq-perplexity: perplexity of a text, and KL divergence against saved base log-probabilities,
// with llama-perplexity's flags and output lines.
//
// The tokenized text is cut into chunks of n_ctx tokens. In each chunk (cache cleared, BOS as
// its first token if the model adds one) the first half is prefilled in batches, then the
// second half is scored with decode semantics (docs/DESIGN.md section 4): tokens first .. n_ctx-2
// get the logits decoding them one at a time gives, and the logits after token j score token
// j+1: the same n_ctx-1-first tokens llama-perplexity scores, but where it evaluates a chunk
// as one batch, the scored tokens here see the cache as a generation would (quantized,
// windowed). They are evaluated in batches with the context's decode_semantics on (innerq.h),
// which gives those logits at batch speed; tests/test_perplexity.py checks them against
// one-token decoding.
#define _POSIX_C_SOURCE 200809L

#include "innerq.h"

#include "args.h"
#include "clock.h"
#include "kld-base.h"
#include "safe-file.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

static const char * const PROG = "innerq-perplexity";

struct ppl_options {
    const char * model;
    const char * text;       // -f; not needed with --kl-divergence
    const char * base_path;  // --kl-divergence-base
    bool kld;                // compare with base_path instead of writing it
    bool kv_stats;           // print each layer's cache layout and symmetric groups
    int32_t n_ctx;           // -c: -1 not given (the default context size, or the base file's with
                             // --kl-divergence); 0: the model's training context
    int32_t n_chunks;        // -1: all
    innerq_model_params mparams;
    innerq_context_params cparams;
};

#define PPL_SCORE_BATCH 128  // scored tokens per innerq_decode call (its logits: 25 MB at 49K tokens)

// The chunks to evaluate are a struct kld_base: the same fields a base file holds.

// The model's prediction at one position, as log-probabilities in double.
struct ppl_pred {
    double * lp;   // n_vocab of them
    double nll;    // -lp[the next token]
    int32_t top;   // the most likely token
};

// Running sums of --kl-divergence (llama-perplexity's kl_divergence_result), and the per-token
// values its percentiles are taken from.
struct kld_stats {
    double sum_nll, sum_nll2, sum_nll_base, sum_nll_base2, sum_nll_nll_base;
    double sum_kld, sum_kld2, sum_p_diff, sum_p_diff2, sum_p_diff4;
    size_t n_same_top, count;
    double * kld;     // count of them
    double * p_diff;
};

#if defined(__GNUC__)
__attribute__((format(printf, 1, 2)))
#endif
static int ppl_fail(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: error: ", PROG);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 1;
}

static void ppl_print_usage(FILE * f) {
    const innerq_context_params c = innerq_context_default_params();
    fprintf(f,
            "usage: %s -m MODEL -f TEXT [options]\n"
            "       %s -m MODEL -f TEXT --kl-divergence-base FILE [options]   (also saves base log-probs)\n"
            "       %s -m MODEL --kl-divergence-base FILE --kl-divergence [options]\n"
            "\n"
            "  -h, --help                  show this help and exit\n"
            "  -m, --model FILE            GGUF model to load\n"
            "  -f, --file FILE             text to evaluate\n"
            "  -c, --ctx-size N            tokens per chunk (default %d; 0: the model's training context);\n"
            "                              the first half is the prompt, the second half is scored one\n"
            "                              decoded token at a time\n"
            "  -b, --batch-size N          most prompt tokens evaluated at once (default %d)\n"
            "  -t, --threads N             CPU threads (default %d: the CPUs this process may use, at most 8)\n"
            "  --chunks N                  evaluate at most N chunks (default -1: all)\n"
            "  -ngl, --n-gpu-layers N      0: CPU (default); N: the last N layers on the GPU; -1 or > the\n"
            "                              layer count: all on the GPU\n"
            "  --no-mmap                   read the model into memory instead of mapping it\n"
            "  --kl-divergence-base FILE   without --kl-divergence: save the log-probabilities of every\n"
            "                              scored token to FILE; with it: read the tokens and the base\n"
            "                              log-probabilities from FILE\n"
            "  --kl-divergence             compare with FILE: PPL ratio, KL divergence, token probabilities\n"
            "  --kv-stats                  print each layer's quantized cache after each chunk (the bits\n"
            "                              of keys and values; the share of groups on the symmetric grid)\n"
            "\n",
            PROG, PROG, PROG, c.n_ctx, c.n_batch, c.n_threads);
    args_print_kv_help(f, false);
}

static void ppl_parse(int argc, char ** argv, struct ppl_options * o) {
    memset(o, 0, sizeof(*o));
    o->n_chunks = -1;
    o->mparams = innerq_model_default_params();
    o->cparams = innerq_context_default_params();
    o->cparams.n_ctx = -1;

    args a = args_init(PROG, argc, argv);
    const char * flag;
    while ((flag = args_next_flag(&a)) != NULL) {
        if (args_is(flag, "-h", "--help")) {
            ppl_print_usage(stdout);
            exit(0);
        } else if (args_is(flag, "-f", "--file")) {
            o->text = args_value(&a);
        } else if (args_is(flag, NULL, "--chunks")) {
            o->n_chunks = args_int(&a, -1, INT32_MAX);
            if (o->n_chunks == 0) {
                args_usage_error(&a, "--chunks must be -1 (all) or at least 1");
            }
        } else if (args_is(flag, NULL, "--kl-divergence-base")) {
            o->base_path = args_value(&a);
        } else if (args_is(flag, NULL, "--kl-divergence")) {
            o->kld = true;
        } else if (args_is(flag, NULL, "--kv-stats")) {
            o->kv_stats = true;
        } else if (!args_model_flag(&a, flag, &o->model, &o->mparams) && !args_context_flag(&a, flag, &o->cparams) &&
                   !args_kv_flag(&a, flag, &o->cparams)) {
            args_unknown(&a, flag);
        }
    }
    o->n_ctx = o->cparams.n_ctx;
    if (o->n_ctx > 0 && o->n_ctx < 4) {
        args_usage_error(&a, "-c must be at least 4 (a prompt half and a scored half), got %d", o->n_ctx);
    }
    args_require(&a, o->model, "model (-m MODEL)");
    if (o->kld) {
        if (!o->base_path) {
            args_usage_error(&a, "--kl-divergence needs --kl-divergence-base FILE");
        }
    } else {
        args_require(&a, o->text, "text (-f TEXT)");
    }
    o->cparams.n_ctx = 0;  // set per run from the chunk size
    args_check_context(&a, &o->cparams);
}

// ---- the chunks: from a text, or from a base file ----

// Tokenizes the text (BOS as the model says, no special tokens parsed) and cuts it into chunks.
static int ppl_load_text(const struct ppl_options * o, const innerq_model * model, const char * text, size_t len,
                         struct kld_base * d) {
    if (len > INT32_MAX / 2) {
        return ppl_fail("'%s' is too large (%zu bytes)", o->text, len);
    }
    int32_t cap = (int32_t) len + 2, n = 0;  // byte-level BPE never gives more tokens than bytes, plus BOS
    innerq_token * tokens = NULL;
    for (;;) {
        free(tokens);
        if (!(tokens = malloc((size_t) cap * sizeof(innerq_token)))) {
            return ppl_fail("out of memory for %d tokens", cap);
        }
        const innerq_status st = innerq_tokenize(model, text, (int32_t) len, true, false, tokens, cap, &n);
        if (st == INNERQ_OK) {
            break;
        }
        if (st != INNERQ_ERR_BUFFER_TOO_SMALL || n <= cap) {
            free(tokens);
            return args_fail_status(PROG, NULL);
        }
        cap = n;
    }
    d->n_ctx = o->n_ctx > 0    ? o->n_ctx
               : o->n_ctx == 0 ? innerq_model_n_ctx_train(model)
                               : innerq_context_default_params().n_ctx;
    if (n / 2 < d->n_ctx) {
        free(tokens);
        return ppl_fail("'%s' has %d tokens; -c %d needs at least %lld (two chunks)", o->text, n, d->n_ctx,
                        2LL * d->n_ctx);
    }
    d->n_chunks = n / d->n_ctx;
    if (o->n_chunks > 0 && o->n_chunks < d->n_chunks) {
        d->n_chunks = o->n_chunks;
    }
    const innerq_token bos = innerq_token_bos(model);
    if (innerq_vocab_add_bos(model) && bos >= 0) {
        for (int32_t c = 0; c < d->n_chunks; c++) {
            tokens[(size_t) c * d->n_ctx] = bos;
        }
    }
    d->tokens = tokens;
    return 0;
}

// Opens the base file and reads its header and tokens into d, checked against the run's
// -c and --chunks (d->n_chunks: the chunks this run evaluates, a prefix of the file's).
// Returns NULL after printing why.
static FILE * kld_open_base(const struct ppl_options * o, struct kld_base * d) {
    const char * path = o->base_path;
    FILE * f = fopen(path, "rb");
    if (!f) {
        ppl_fail("cannot open '%s': %s", path, strerror(errno));
        return NULL;
    }
    char err[256];
    if (!kld_read_header(f, d, err, sizeof(err))) {
        ppl_fail("'%s' %s", path, err);
    } else if (o->n_ctx > 0 && o->n_ctx != d->n_ctx) {
        ppl_fail("'%s' was computed with -c %d, this run asks for -c %d", path, d->n_ctx, o->n_ctx);
    } else if (o->n_chunks > d->n_chunks) {
        ppl_fail("'%s' holds %d chunks, --chunks asks for %d", path, d->n_chunks, o->n_chunks);
    } else {
        d->n_chunks = o->n_chunks > 0 ? o->n_chunks : d->n_chunks;  // a prefix of the file's
        return f;
    }
    fclose(f);
    free(d->tokens);
    d->tokens = NULL;
    return NULL;
}

// ---- scoring ----

// Log-softmax of one row of logits in double; nll and top for the token that comes next.
static void ppl_predict(const float * logits, int32_t n_vocab, innerq_token next, struct ppl_pred * p) {
    int32_t top = 0;
    for (int32_t i = 1; i < n_vocab; i++) {
        top = logits[i] > logits[top] ? i : top;
    }
    const double max = logits[top];
    double sum = 0.0;
    for (int32_t i = 0; i < n_vocab; i++) {
        sum += exp((double) logits[i] - max);
    }
    const double lse = max + log(sum);
    for (int32_t i = 0; i < n_vocab; i++) {
        p->lp[i] = (double) logits[i] - lse;
    }
    p->nll = -p->lp[next];
    p->top = top;
}

// Reads the base record of one scored token and adds the comparison to s.
static bool kld_compare(FILE * f, const struct ppl_pred * p, int32_t n_vocab, uint16_t * code, struct kld_stats * s) {
    struct kld_record r;
    if (!kld_read_record(f, n_vocab, &r, code)) {
        return false;
    }
    const double nll_base = r.nll;
    const int32_t top_base = r.top;
    const double kld = kld_token(code, r.lo, p->lp, n_vocab);
    const double p_diff = exp(-p->nll) - exp(-nll_base);
    s->sum_nll += p->nll;
    s->sum_nll2 += p->nll * p->nll;
    s->sum_nll_base += nll_base;
    s->sum_nll_base2 += nll_base * nll_base;
    s->sum_nll_nll_base += p->nll * nll_base;
    s->sum_kld += kld;
    s->sum_kld2 += kld * kld;
    s->sum_p_diff += p_diff;
    s->sum_p_diff2 += p_diff * p_diff;
    s->sum_p_diff4 += p_diff * p_diff * p_diff * p_diff;
    s->n_same_top += p->top == top_base;
    s->kld[s->count] = kld;
    s->p_diff[s->count] = p_diff;
    s->count++;
    return true;
}

// ---- llama-perplexity's statistics and lines ----

// The mean of count values and the uncertainty of that mean (0 for 10 values or fewer).
static double kld_mean(double sum, double sum2, size_t count, double * unc) {
    if (count < 1) {
        *unc = 0.0;
        return 0.0;
    }
    const double f = sum / count;
    const double var = sum2 / count - f * f;
    *unc = var > 0 && count > 10 ? sqrt(var / (count - 1)) : 0.0;
    return f;
}

// The covariance of the two means (0 for fewer than 10 values).
static double kld_covariance(double suma, double sumb, double sumab, size_t count) {
    if (count < 10) {
        return 0.0;
    }
    return (sumab / count - (suma / count) * (sumb / count)) / (count - 1);
}

// ln(PPL(Q)/PPL(base)) and its uncertainty; rounding can make the variance of a difference of
// identical runs slightly negative, hence the clamp.
static double kld_log_ratio(const struct kld_stats * s, double * unc) {
    double unc_q, unc_base;
    const double log_q = kld_mean(s->sum_nll, s->sum_nll2, s->count, &unc_q);
    const double log_base = kld_mean(s->sum_nll_base, s->sum_nll_base2, s->count, &unc_base);
    const double cov = kld_covariance(s->sum_nll, s->sum_nll_base, s->sum_nll_nll_base, s->count);
    const double var = unc_q * unc_q + unc_base * unc_base - 2.0 * cov;
    *unc = var > 0.0 ? sqrt(var) : 0.0;
    return log_q - log_base;
}

static double kld_same_top_unc(double same_top, size_t count) {
    return count > 1 ? sqrt(same_top * (1.0 - same_top) / (count - 1)) : 0.0;
}

static void kld_print_chunk(const struct kld_stats * s, int32_t chunk) {
    double unc, ratio_unc, kld_unc, mse_unc;
    const double ppl = exp(kld_mean(s->sum_nll, s->sum_nll2, s->count, &unc));
    const double ratio = kld_log_ratio(s, &ratio_unc);
    const double kld = kld_mean(s->sum_kld, s->sum_kld2, s->count, &kld_unc);
    const double rms = sqrt(kld_mean(s->sum_p_diff2, s->sum_p_diff4, s->count, &mse_unc));
    const double same_top = (double) s->n_same_top / s->count;
    printf("%4d", chunk + 1);
    printf("    %9.4lf ± %9.4lf", ppl, ppl * unc);
    printf("    %10.5lf ± %10.5lf", ratio, ratio_unc);
    printf("    %10.5lf ± %10.5lf", kld, kld_unc);
    printf("    %6.3lf ± %6.3lf %%", 100.0 * rms, rms > 0 ? 100.0 * 0.5 / rms * mse_unc : 0.0);
    printf("    %6.3lf ± %6.3lf %%\n", 100.0 * same_top, 100.0 * kld_same_top_unc(same_top, s->count));
    fflush(stdout);
}

static int kld_cmp_double(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

// The fraction-quantile of sorted values, interpolated linearly between neighbours.
static double kld_percentile(const double * v, size_t n, double fraction) {
    if (fraction <= 0.0) {
        return v[0];
    }
    if (fraction >= 1.0) {
        return v[n - 1];
    }
    double p = fraction * (double) (n - 1);
    const size_t ip = (size_t) p;
    p -= (double) ip;
    return (1.0 - p) * v[ip] + p * v[ip + 1 < n ? ip + 1 : n - 1];
}

static void kld_print_summary(struct kld_stats * s) {
    const size_t n = s->count;
    qsort(s->kld, n, sizeof(double), kld_cmp_double);
    qsort(s->p_diff, n, sizeof(double), kld_cmp_double);

    double unc_q, unc_base, ratio_unc;
    const double ppl = exp(kld_mean(s->sum_nll, s->sum_nll2, n, &unc_q));
    const double ppl_base = exp(kld_mean(s->sum_nll_base, s->sum_nll_base2, n, &unc_base));
    const double cov = kld_covariance(s->sum_nll, s->sum_nll_base, s->sum_nll_nll_base, n);
    const double ratio = kld_log_ratio(s, &ratio_unc);
    const double ppl_unc = ppl * unc_q, ppl_base_unc = ppl_base * unc_base;
    const double ppl_diff_var = ppl_unc * ppl_unc + ppl_base_unc * ppl_base_unc - 2.0 * ppl * ppl_base * cov;
    printf("====== Perplexity statistics ======\n");
    printf("Mean PPL(Q)                   : %10.6lf ± %10.6lf\n", ppl, ppl_unc);
    printf("Mean PPL(base)                : %10.6lf ± %10.6lf\n", ppl_base, ppl_base_unc);
    printf("Cor(ln(PPL(Q)), ln(PPL(base))): %6.2lf%%\n", unc_q * unc_base > 0 ? 100.0 * cov / (unc_q * unc_base) : 0.0);
    printf("Mean ln(PPL(Q)/PPL(base))     : %10.6lf ± %10.6lf\n", ratio, ratio_unc);
    printf("Mean PPL(Q)/PPL(base)         : %10.6lf ± %10.6lf\n", exp(ratio), exp(ratio) * ratio_unc);
    printf("Mean PPL(Q)-PPL(base)         : %10.6lf ± %10.6lf\n", ppl - ppl_base,
           ppl_diff_var > 0 ? sqrt(ppl_diff_var) : 0.0);
    printf("\n");

    double kld_unc;
    const double kld = kld_mean(s->sum_kld, s->sum_kld2, n, &kld_unc);
    printf("====== KL divergence statistics ======\n");
    printf("Mean    KLD: %10.6lf ± %10.6lf\n", kld, kld_unc);
    printf("Maximum KLD: %10.6f\n", s->kld[n - 1]);
    printf("99.9%%   KLD: %10.6f\n", kld_percentile(s->kld, n, 0.999));
    printf("99.0%%   KLD: %10.6f\n", kld_percentile(s->kld, n, 0.990));
    printf("95.0%%   KLD: %10.6f\n", kld_percentile(s->kld, n, 0.950));
    printf("90.0%%   KLD: %10.6f\n", kld_percentile(s->kld, n, 0.900));
    printf("Median  KLD: %10.6f\n", kld_percentile(s->kld, n, 0.5));
    printf("10.0%%   KLD: %10.6f\n", kld_percentile(s->kld, n, 0.100));
    printf(" 5.0%%   KLD: %10.6f\n", kld_percentile(s->kld, n, 0.050));
    printf(" 1.0%%   KLD: %10.6f\n", kld_percentile(s->kld, n, 0.010));
    printf(" 0.1%%   KLD: %10.6f\n", kld_percentile(s->kld, n, 0.001));
    printf("Minimum KLD: %10.6f\n", s->kld[0]);
    printf("\n");

    double p_diff_unc, mse_unc;
    const double p_diff = kld_mean(s->sum_p_diff, s->sum_p_diff2, n, &p_diff_unc);
    const double rms = sqrt(kld_mean(s->sum_p_diff2, s->sum_p_diff4, n, &mse_unc));
    const double same_top = (double) s->n_same_top / n;
    static const struct {
        const char * label;
        double fraction;
    } rows[] = {
        {"Maximum", 1.0}, {"99.9%  ", 0.999}, {"99.0%  ", 0.990}, {"95.0%  ", 0.950}, {"90.0%  ", 0.900},
        {"75.0%  ", 0.750}, {"Median ", 0.5},   {"25.0%  ", 0.250}, {"10.0%  ", 0.100}, {" 5.0%  ", 0.050},
        {" 1.0%  ", 0.010}, {" 0.1%  ", 0.001}, {"Minimum", 0.0},
    };
    printf("====== Token probability statistics ======\n");
    printf("Mean    Δp: %6.3lf ± %5.3lf %%\n", 100.0 * p_diff, 100.0 * p_diff_unc);
    for (size_t r = 0; r < sizeof(rows) / sizeof(rows[0]); r++) {
        printf("%s Δp: %6.3lf%%\n", rows[r].label, 100.0 * kld_percentile(s->p_diff, n, rows[r].fraction));
    }
    printf("RMS Δp    : %6.3lf ± %5.3lf %%\n", 100.0 * rms, rms > 0 ? 100.0 * 0.5 / rms * mse_unc : 0.0);
    printf("Same top p: %6.3lf ± %5.3lf %%\n", 100.0 * same_top, 100.0 * kld_same_top_unc(same_top, n));
}

// ---- the cache per layer (--kv-stats) ----

// Per layer and chunk: bits of keys and values, shares of symmetric groups (-1: none stored).
struct kv_layer_sums {
    double bits[2], sym[2], err[2][4];
    int32_t n_sym[2];
};

// One line per chunk: each layer's bits of keys, then of values; sums for the summary.
static bool kv_stats_chunk(innerq_context * ctx, int32_t chunk, int32_t n_layer, struct kv_layer_sums * sums) {
    char line[2][256];
    for (int32_t il = 0; il < n_layer; il++) {
        innerq_kv_layer_info info;
        if (innerq_cache_layer_info(ctx, il, &info) != INNERQ_OK) {
            return false;
        }
        const int32_t bits[2] = {info.bits_k, info.bits_v};
        const float sym[2] = {info.sym_k, info.sym_v};
        const float * err[2] = {info.err_k, info.err_v};
        for (int x = 0; x < 2; x++) {
            for (int b = 0; b < 4; b++) {
                sums[il].err[x][b] += err[x][b];
            }
            if (il < (int32_t) sizeof(line[x]) - 1) {
                line[x][il] = (char) ('0' + bits[x] % 10);
                line[x][il + 1] = '\0';
            }
            sums[il].bits[x] += bits[x];
            sums[il].sym[x] += sym[x] >= 0 ? sym[x] : 0.0;
            sums[il].n_sym[x] += sym[x] >= 0;
        }
    }
    fprintf(stderr, "%s: chunk %d: bits per layer: keys %s, values %s\n", PROG, chunk + 1, line[0], line[1]);
    return true;
}

static void kv_stats_print(const struct kv_layer_sums * sums, int32_t n_layer, int32_t n_chunks) {
    printf("\n====== KV cache per layer (mean over %d chunks) ======\n", n_chunks);
    printf("(measured error: the relative attention-output error kv_bits measured at 2 to 5 bits; 0 without it)\n");
    printf("layer  bits K  bits V  symmetric groups K  symmetric groups V    measured error: K2       K3       K4"
           "       K5       V2       V3       V4       V5\n");
    double all[2] = {0, 0};
    for (int32_t il = 0; il < n_layer; il++) {
        const struct kv_layer_sums * l = &sums[il];
        printf("%5d  %6.2f  %6.2f", il, l->bits[0] / n_chunks, l->bits[1] / n_chunks);
        for (int x = 0; x < 2; x++) {
            if (l->n_sym[x] > 0) {
                printf("  %17.1f%%", 100.0 * l->sym[x] / l->n_sym[x]);
            } else {
                printf("  %18s", "-");
            }
            all[x] += l->bits[x] / n_chunks;
        }
        printf("                ");
        for (int x = 0; x < 2; x++) {
            for (int b = 0; b < 4; b++) {
                printf(" %8.5f", l->err[x][b] / n_chunks);
            }
        }
        printf("\n");
    }
    printf("mean   %6.3f  %6.3f\n", all[0] / n_layer, all[1] / n_layer);
}

// ---- the run ----

// Evaluates every chunk; writes base records to `save`, or compares with those of `compare`.
static int ppl_run(innerq_context * ctx, const struct kld_base * d, FILE * save, FILE * compare, int32_t n_layer) {
    const int32_t n_ctx = d->n_ctx, n_vocab = d->n_vocab, first = n_ctx / 2, n_scored = kld_n_scored(n_ctx);
    const size_t total = (size_t) d->n_chunks * n_scored;
    struct ppl_pred pred = {malloc((size_t) n_vocab * sizeof(double)), 0.0, 0};
    uint16_t * code = malloc((size_t) n_vocab * sizeof(uint16_t));
    struct kld_stats s = {0};
    if (compare) {
        s.kld = malloc(total * sizeof(double));
        s.p_diff = malloc(total * sizeof(double));
    }
    struct kv_layer_sums * layers = n_layer > 0 ? calloc((size_t) n_layer, sizeof(*layers)) : NULL;
    int rc = 1;
    if (!pred.lp || !code || (compare && (!s.kld || !s.p_diff)) || (n_layer > 0 && !layers)) {
        rc = ppl_fail("out of memory");
        goto done;
    }
    if (compare) {
        printf("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS"
               "            Same top p\n");
    }
    double nll = 0.0, nll2 = 0.0;
    size_t count = 0;
    const int64_t t_start = tool_time_ns();
    for (int32_t c = 0; c < d->n_chunks; c++) {
        const innerq_token * t = d->tokens + (size_t) c * n_ctx;
        if (innerq_cache_clear(ctx) != INNERQ_OK || innerq_set_batch_mode(ctx, false, false) != INNERQ_OK ||
            innerq_decode(ctx, t, first) != INNERQ_OK || innerq_set_batch_mode(ctx, true, true) != INNERQ_OK) {
            rc = args_fail_status(PROG, NULL);
            goto done;
        }
        // the scored tokens in batches with decode semantics: the logits of one-token decoding
        for (int32_t j = first, j0 = first, n = 0; j < n_ctx - 1; j++) {
            const float * logits;
            if (j == j0 + n) {
                j0 = j;
                n = n_ctx - 1 - j < PPL_SCORE_BATCH ? n_ctx - 1 - j : PPL_SCORE_BATCH;
                if (innerq_decode(ctx, &t[j], n) != INNERQ_OK) {
                    rc = args_fail_status(PROG, NULL);
                    goto done;
                }
            }
            if (!(logits = innerq_get_logits_ith(ctx, j - j0))) {
                rc = args_fail_status(PROG, NULL);
                goto done;
            }
            ppl_predict(logits, n_vocab, t[j + 1], &pred);
            nll += pred.nll;
            nll2 += pred.nll * pred.nll;
            count++;
            if (save && !kld_write_record(save, pred.lp, pred.nll, pred.top, n_vocab, code)) {
                rc = ppl_fail("cannot write the base log-probabilities: %s", strerror(errno));
                goto done;
            }
            if (compare && !kld_compare(compare, &pred, n_vocab, code, &s)) {
                rc = ppl_fail("cannot read the base log-probabilities of chunk %d", c + 1);
                goto done;
            }
        }
        if (c == 0) {
            const double seconds = (double) (tool_time_ns() - t_start) / 1e9;
            fprintf(stderr, "%s: %.2f seconds per pass - ETA %.2f minutes\n", PROG, seconds,
                    seconds * d->n_chunks / 60.0);
        }
        if (layers && !kv_stats_chunk(ctx, c, n_layer, layers)) {
            rc = args_fail_status(PROG, NULL);
            goto done;
        }
        if (compare) {
            kld_print_chunk(&s, c);
        } else {
            printf("[%d]%.4lf,", c + 1, exp(nll / count));
            fflush(stdout);
        }
    }
    const double seconds = (double) (tool_time_ns() - t_start) / 1e9;
    if (compare) {
        printf("\n");
        kld_print_summary(&s);
    } else {
        const double mean = nll / count, var = nll2 / count - mean * mean;
        const double ppl = exp(mean), unc = var > 0 && count > 1 ? sqrt(var / (count - 1)) * ppl : 0.0;
        printf("\nFinal estimate: PPL = %.4lf +/- %.5lf\n", ppl, unc);
    }
    if (layers) {
        kv_stats_print(layers, n_layer, d->n_chunks);
    }
    fflush(stdout);
    fprintf(stderr, "%s: %zu tokens scored in %.2f s (%.2f ms per token)\n", PROG, count, seconds,
            1e3 * seconds / (double) count);
    rc = 0;
done:
    free(pred.lp);
    free(code);
    free(s.kld);
    free(s.p_diff);
    free(layers);
    return rc;
}

int main(int argc, char ** argv) {
    struct ppl_options o;
    ppl_parse(argc, argv, &o);

    // The inputs are read before the model is loaded, so that a wrong path fails at once.
    struct kld_base d = {0};
    FILE * base = NULL;
    struct safe_file save = {0};  // --kl-divergence-base FILE, written whole or not at all
    char * text = NULL;
    size_t text_len = 0;
    if (o.kld) {
        if (!(base = kld_open_base(&o, &d))) {
            return 1;
        }
    } else if (!(text = args_read_file(PROG, o.text, &text_len))) {
        return 1;
    }

    innerq_model * model = NULL;
    innerq_context * ctx = NULL;
    int rc = 1;
    if (innerq_model_load(o.model, &o.mparams, &model) != INNERQ_OK) {
        rc = args_fail_status(PROG, NULL);
        goto done;
    }
    if (o.kld && d.n_vocab != innerq_model_n_vocab(model)) {
        rc = ppl_fail("'%s' was computed with a vocabulary of %d tokens, the model has %d", o.base_path, d.n_vocab,
                      innerq_model_n_vocab(model));
        goto done;
    }
    d.n_vocab = innerq_model_n_vocab(model);
    if (!o.kld && (rc = ppl_load_text(&o, model, text, text_len, &d)) != 0) {
        goto done;
    }
    free(text);
    text = NULL;

    innerq_context_params cp = o.cparams;
    cp.n_ctx = d.n_ctx;
    cp.n_batch = cp.n_batch < d.n_ctx ? cp.n_batch : d.n_ctx;
    if (innerq_context_init(model, &cp, &ctx) != INNERQ_OK) {
        rc = args_fail_status(PROG, NULL);
        goto done;
    }
    // The base file is replaced only when the run completes: an earlier one survives a run
    // that fails, is interrupted or killed (which leaves FILE.tmp-XXXXXX behind).
    if (!o.kld && o.base_path) {
        if (!safe_file_open(&save, o.base_path) || !kld_write_header(save.f, &d)) {
            rc = ppl_fail("cannot write '%s': %s", o.base_path, strerror(errno));
            goto done;
        }
    }
    char layout[64] = "";
    if (cp.kv_bits > 0.0f) {
        snprintf(layout, sizeof(layout), ", kv_bits %g", cp.kv_bits);
    }
    fprintf(stderr, "%s: %d chunks of %d tokens (%d scored each), n_batch = %d, cache %s/%s%s, %s\n", PROG,
            d.n_chunks, d.n_ctx, kld_n_scored(d.n_ctx), cp.n_batch, args_kv_name(cp.kv_k, cp.kv_v),
            args_kv_name(cp.kv_v, cp.kv_k), layout, innerq_cpu_isa());
    char memory[160];
    args_kv_memory(ctx, memory, sizeof(memory));
    fprintf(stderr, "%s: %s\n", PROG, memory);
    rc = ppl_run(ctx, &d, save.f, base, o.kv_stats ? innerq_model_n_layer(model) : 0);
    if (save.f && rc == 0 && !safe_file_commit(&save)) {
        rc = ppl_fail("cannot write '%s': %s", o.base_path, strerror(errno));
    }
done:
    safe_file_discard(&save);
    if (base) {
        fclose(base);
    }
    free(text);
    free(d.tokens);
    innerq_context_free(ctx);
    innerq_model_free(model);
    return rc;
}
