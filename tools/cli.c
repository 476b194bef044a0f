// innerq-cli: continues a prompt, streaming the text as it is generated. Flags are spelled as
// llama-cli's where the two overlap; speeds go to stderr at the end, as llama.cpp prints them.
#define _POSIX_C_SOURCE 200809L

#include "innerq.h"

#include "args.h"
#include "clock.h"
#include "progress.h"

#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char * const PROG = "innerq-cli";

struct cli_options {
    const char * model;
    const char * prompt;
    const char * prompt_file;
    int32_t n_predict;  // -1: until end of generation or a full context
    bool display_prompt;
    bool quiet;         // no progress and no speeds on stderr
    innerq_model_params mparams;
    innerq_context_params cparams;
    innerq_sampler_params sparams;
};

static void cli_print_usage(FILE * f) {
    const innerq_context_params c = innerq_context_default_params();
    const innerq_sampler_params sp = innerq_sampler_default_params();
    fprintf(f,
            "usage: %s -m MODEL [-p PROMPT | -f FILE] [options]\n"
            "\n"
            "  -h, --help              show this help and exit\n"
            "  --version               show the version and the CPU instruction set, and exit\n"
            "  -m, --model FILE        GGUF model to load\n"
            "  -p, --prompt TEXT       prompt to continue\n"
            "  -f, --file FILE         read the prompt from FILE\n"
            "  -n, --n-predict N       tokens to generate (default %d; -1: until end of text or a full context)\n"
            "  --no-display-prompt     don't print the prompt before the generated text\n"
            "  -q, --quiet             no progress and no speeds on stderr\n"
            "  -t, --threads N         CPU threads (default %d: the CPUs this process may use, at most 8)\n"
            "  -c, --ctx-size N        context size in tokens (default %d; 0: the model's training context)\n"
            "  -b, --batch-size N      most tokens evaluated at once (default %d)\n"
            "  -ngl, --n-gpu-layers N  0: CPU (default); N: the last N layers on the GPU; -1 or > the layer count:\n"
            "                          the whole model\n"
            "  --no-mmap               read the model into memory instead of mapping it\n"
            "\n"
            "Sampling (as llama.cpp's default chain: penalty, top-k, top-p, min-p, temperature):\n"
            "  --temp T                temperature (default %.2g; <= 0: greedy)\n"
            "  --top-k N               keep the N most likely tokens (default %d; 0: off)\n"
            "  --top-p P               keep the smallest set with probability >= P (default %.2g; 1: off)\n"
            "  --min-p P               drop tokens less likely than P times the best (default %.2g; 0: off)\n"
            "  --repeat-penalty X      penalize repeated tokens (default %.2g: off)\n"
            "  --repeat-last-n N       tokens of history the penalty looks at (default %d; -1: the context)\n"
            "  --seed N                random seed (default -1: from the clock)\n"
            "\n",
            PROG, innerq_default_n_predict(), c.n_threads, c.n_ctx, c.n_batch, sp.temperature, sp.top_k, sp.top_p,
            sp.min_p, sp.repeat_penalty, sp.repeat_last_n);
    args_print_kv_help(f, false);
}

static void cli_parse(int argc, char ** argv, struct cli_options * o) {
    o->model = NULL;
    o->prompt = NULL;
    o->prompt_file = NULL;
    o->n_predict = innerq_default_n_predict();
    o->display_prompt = true;
    o->quiet = false;
    o->mparams = innerq_model_default_params();
    o->cparams = innerq_context_default_params();
    o->sparams = innerq_sampler_default_params();

    args a = args_init(PROG, argc, argv);
    const char * flag;
    while ((flag = args_next_flag(&a)) != NULL) {
        if (args_is(flag, "-h", "--help")) {
            cli_print_usage(stdout);
            exit(0);
        } else if (args_is(flag, NULL, "--version")) {
            printf("%s %s (%s)\n", PROG, innerq_version(), innerq_cpu_isa());
            exit(0);
        } else if (args_is(flag, "-p", "--prompt")) {
            o->prompt = args_value(&a);
        } else if (args_is(flag, "-f", "--file")) {
            o->prompt_file = args_value(&a);
        } else if (args_is(flag, "-n", "--n-predict")) {
            o->n_predict = args_int(&a, -1, INT32_MAX);
        } else if (args_is(flag, NULL, "--no-display-prompt")) {
            o->display_prompt = false;
        } else if (args_is(flag, "-q", "--quiet")) {
            o->quiet = true;
        } else if (args_is(flag, NULL, "--temp")) {
            o->sparams.temperature = args_float(&a, -FLT_MAX, FLT_MAX);
        } else if (args_is(flag, NULL, "--top-k")) {
            o->sparams.top_k = args_int(&a, -1, INT32_MAX);
        } else if (args_is(flag, NULL, "--top-p")) {
            o->sparams.top_p = args_float(&a, -FLT_MAX, FLT_MAX);  // the ranges: innerq_sampler_params_check
        } else if (args_is(flag, NULL, "--min-p")) {
            o->sparams.min_p = args_float(&a, -FLT_MAX, FLT_MAX);
        } else if (args_is(flag, NULL, "--repeat-penalty")) {
            o->sparams.repeat_penalty = args_float(&a, -FLT_MAX, FLT_MAX);
        } else if (args_is(flag, NULL, "--repeat-last-n")) {
            o->sparams.repeat_last_n = args_int(&a, -1, INT32_MAX);
        } else if (args_is(flag, NULL, "--seed")) {
            o->sparams.seed = args_seed(&a);
        } else if (!args_model_flag(&a, flag, &o->model, &o->mparams) && !args_context_flag(&a, flag, &o->cparams) &&
                   !args_kv_flag(&a, flag, &o->cparams)) {
            args_unknown(&a, flag);
        }
    }
    args_require(&a, o->model, "model (-m MODEL)");
    if (o->prompt && o->prompt_file) {
        args_usage_error(&a, "give the prompt with -p or with -f, not both");
    }
    args_check_context(&a, &o->cparams);
    innerq_sampler_params sp = o->sparams;
    sp.repeat_last_n = sp.repeat_last_n == -1 ? 0 : sp.repeat_last_n;  // -1: n_ctx, known once the model is
    if (innerq_sampler_params_check(&sp) != INNERQ_OK) {
        args_usage_error(&a, "%s", innerq_last_error());
    }
}

// The prompt's tokens (BOS as the model asks, special tokens parsed); prints why on failure.
static bool cli_tokenize(const innerq_model * model, const char * text, int32_t len, innerq_token ** out,
                         int32_t * n) {
    int32_t cap = len + 4;  // BPE never gives more tokens than bytes, plus the specials
    for (;;) {
        innerq_token * tokens = malloc((size_t) cap * sizeof(innerq_token));
        if (!tokens) {
            fprintf(stderr, "%s: error: out of memory for %d tokens\n", PROG, cap);
            return false;
        }
        innerq_status st = innerq_tokenize(model, text, len, innerq_vocab_add_bos(model), true, tokens, cap, n);
        if (st == INNERQ_OK) {
            *out = tokens;
            return true;
        }
        free(tokens);
        if (st != INNERQ_ERR_BUFFER_TOO_SMALL || *n <= cap) {
            args_fail_status(PROG, NULL);
            return false;
        }
        cap = *n;
    }
}

// Text pieces of the detokenizer, into a buffer that grows when a piece doesn't fit.
struct cli_text {
    innerq_detokenizer * dt;
    char * buf;
    int32_t cap;
};

// The text of token (or, for token < 0, what the detokenizer still holds) into t->buf.
static innerq_status cli_text_next(struct cli_text * t, innerq_token token, int32_t * n) {
    for (;;) {
        innerq_status st = token < 0 ? innerq_detokenizer_flush(t->dt, t->buf, t->cap, n)
                                     : innerq_detokenizer_push(t->dt, token, t->buf, t->cap, n);
        if (st != INNERQ_ERR_BUFFER_TOO_SMALL || *n <= t->cap) {
            return st;
        }
        char * grown = realloc(t->buf, (size_t) *n);
        if (!grown) {
            return st;
        }
        t->buf = grown;
        t->cap = *n;
    }
}

static innerq_status cli_print_token(struct cli_text * t, innerq_token token) {
    int32_t n = 0;
    innerq_status st = cli_text_next(t, token, &n);
    if (st == INNERQ_OK) {
        fwrite(t->buf, 1, (size_t) n, stdout);
        fflush(stdout);
    }
    return st;
}

static void cli_print_speed(const char * what, int32_t n_tokens, int64_t ns) {
    const double ms = (double) ns / 1e6;
    fprintf(stderr, "%s: %d tokens, %.2f ms, %.2f t/s\n", what, n_tokens, ms, ms > 0 ? n_tokens * 1e3 / ms : 0.0);
}

// Evaluates the prompt, then samples, prints and evaluates one token at a time.
static int cli_generate(const struct cli_options * o, innerq_model * model, innerq_context * ctx,
                        const innerq_token * prompt, int32_t n_prompt, const char * prompt_text, size_t prompt_len) {
    innerq_sampler_params sp = o->sparams;
    if (sp.repeat_last_n < 0) {
        sp.repeat_last_n = innerq_n_ctx(ctx);
    }
    innerq_sampler * smpl = NULL;
    struct cli_text text = {NULL, NULL, 256};
    int rc = 1;
    if (innerq_sampler_init(&sp, &smpl) != INNERQ_OK ||
        innerq_detokenizer_init(model, false, &text.dt) != INNERQ_OK) {
        rc = args_fail_status(PROG, NULL);
        goto done;
    }
    if (!(text.buf = malloc((size_t) text.cap))) {
        fprintf(stderr, "%s: error: out of memory\n", PROG);
        goto done;
    }
    // The detokenizer sees the prompt too, so the first generated piece is rendered as a
    // continuation (not as the start of a text); its output is the prompt, shown as given.
    for (int32_t i = 0; i < n_prompt; i++) {
        int32_t n = 0;
        if (cli_text_next(&text, prompt[i], &n) != INNERQ_OK) {
            rc = args_fail_status(PROG, NULL);
            goto done;
        }
    }

    int64_t t0 = tool_time_ns();
    progress bar = progress_init(PROG, o->quiet);
    if (progress_decode(&bar, ctx, prompt, n_prompt, o->cparams.n_batch) != INNERQ_OK) {
        rc = args_fail_status(PROG, NULL);
        goto done;
    }
    const int64_t t_prompt = tool_time_ns() - t0;
    if (o->display_prompt) {  // once it is known to fit
        fwrite(prompt_text, 1, prompt_len, stdout);
        fflush(stdout);
    }
    for (int32_t i = 0; i < n_prompt; i++) {
        innerq_sampler_accept(smpl, prompt[i]);
    }

    const int32_t n_vocab = innerq_model_n_vocab(model);
    int32_t n_generated = 0, n_eval = 0;
    int64_t t_eval = 0;
    while (o->n_predict < 0 || n_generated < o->n_predict) {
        const float * logits = innerq_get_logits(ctx);
        innerq_token token;
        if (!logits || innerq_sampler_sample(smpl, logits, n_vocab, &token) != INNERQ_OK) {
            rc = args_fail_status(PROG, NULL);
            goto done;
        }
        innerq_sampler_accept(smpl, token);
        if (innerq_token_is_eog(model, token)) {
            break;
        }
        if (cli_print_token(&text, token) != INNERQ_OK) {
            rc = args_fail_status(PROG, NULL);
            goto done;
        }
        n_generated++;
        if ((o->n_predict >= 0 && n_generated >= o->n_predict) || innerq_n_past(ctx) >= innerq_n_ctx(ctx)) {
            break;
        }
        t0 = tool_time_ns();
        if (innerq_decode(ctx, &token, 1) != INNERQ_OK) {
            rc = args_fail_status(PROG, NULL);
            goto done;
        }
        t_eval += tool_time_ns() - t0;
        n_eval++;
    }
    if (cli_print_token(&text, -1) != INNERQ_OK) {
        rc = args_fail_status(PROG, NULL);
        goto done;
    }
    printf("\n");
    fflush(stdout);
    if (o->n_predict >= 0 && n_generated >= o->n_predict) {
        fprintf(stderr, "(stopped after %d tokens; -n to change)\n", n_generated);
    }
    if (!o->quiet) {
        cli_print_speed("prompt eval", n_prompt, t_prompt);
        cli_print_speed("eval", n_eval, t_eval);
        char memory[160];
        args_kv_memory(ctx, memory, sizeof(memory));
        fprintf(stderr, "%s\n", memory);
        if (o->mparams.n_gpu_layers != 0) {
            args_offload(model, memory, sizeof(memory));
            fprintf(stderr, "%s\n", memory);
        }
    }
    rc = 0;
done:
    free(text.buf);
    innerq_detokenizer_free(text.dt);
    innerq_sampler_free(smpl);
    return rc;
}

int main(int argc, char ** argv) {
    struct cli_options o;
    cli_parse(argc, argv, &o);

    const char * prompt_text = o.prompt ? o.prompt : "";
    size_t prompt_len = strlen(prompt_text);
    char * file_text = NULL;
    if (o.prompt_file) {
        file_text = args_read_file(PROG, o.prompt_file, &prompt_len);
        if (!file_text) {
            return 1;
        }
        prompt_text = file_text;
    }
    if (prompt_len > INT32_MAX / 2) {
        fprintf(stderr, "%s: error: the prompt is too long (%zu bytes)\n", PROG, prompt_len);
        free(file_text);
        return 1;
    }

    innerq_model * model = NULL;
    innerq_context * ctx = NULL;
    innerq_token * tokens = NULL;
    int32_t n_tokens = 0;
    int rc = 1;
    if (innerq_model_load(o.model, &o.mparams, &model) != INNERQ_OK ||
        innerq_context_init(model, &o.cparams, &ctx) != INNERQ_OK) {
        rc = args_fail_status(PROG, NULL);
    } else if (!cli_tokenize(model, prompt_text, (int32_t) prompt_len, &tokens, &n_tokens)) {
        rc = 1;
    } else if (n_tokens == 0) {
        fprintf(stderr, "%s: error: the prompt is empty and the model adds no BOS token\n", PROG);
    } else {
        rc = cli_generate(&o, model, ctx, tokens, n_tokens, prompt_text, prompt_len);
    }
    free(tokens);
    innerq_context_free(ctx);
    innerq_model_free(model);
    free(file_text);
    return rc;
}
