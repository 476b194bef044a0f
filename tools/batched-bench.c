// innerq-batched-bench: many sequences decoded together, measured as llama.cpp's
// llama-batched-bench measures them, with its flags and its table, so the two read side by side.
//
// Every (PP, TG, B) is a test: B sequences each read a prompt of PP random tokens (one batch of
// B * PP tokens, given to innerq_decode_batch in pieces of -b; with -pps one prompt, given to
// all B sequences at once), then TG steps each decode one token of every sequence (with -tgs
// every sequence's TG tokens one after the other instead). The context holds max(B) sequences
// in one KV cache; it is cleared before each test.
#define _POSIX_C_SOURCE 200809L

#include "innerq.h"

#include "args.h"
#include "clock.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char * const PROG = "innerq-batched-bench";

struct bb_options {
    const char * model;
    int32_t * npp, * ntg, * npl;
    int n_npp, n_ntg, n_npl;
    int32_t n_batch;  // tokens per innerq_decode_batch call (llama.cpp's logical batch, -b)
    bool pp_shared, tg_separate, jsonl;
    innerq_model_params mparams;
    innerq_context_params cparams;  // -ub is its n_batch: the tokens of one step
};

static void bb_usage(FILE * f) {
    const innerq_context_params c = innerq_context_default_params();
    fprintf(f,
            "usage: %s -m MODEL [options]\n"
            "\n"
            "  -h, --help              show this help and exit\n"
            "  -m, --model FILE        GGUF model to load\n"
            "  -npp, --n-pp LIST       prompt tokens per sequence (default 128,256,512)\n"
            "  -ntg, --n-tg LIST       generated tokens per sequence (default 128,256)\n"
            "  -npl, --n-pl LIST       sequences decoded together (default 1,2,4,8,16,32)\n"
            "  -pps                    one prompt shared by the sequences (evaluated once)\n"
            "  -tgs                    decode each sequence's tokens in turn, not together\n"
            "  -c, --ctx-size N        tokens of the KV cache, all sequences together (default: what\n"
            "                          the largest test needs)\n"
            "  -b, --batch-size N      tokens per decode call (default 2048)\n"
            "  -ub, --ubatch-size N    tokens per step (default %d)\n"
            "  -t, --threads N         CPU threads (default %d: the physical cores, at most 8)\n"
            "  -ngl, --n-gpu-layers N  0: CPU (default); N: the last N layers on the GPU; -1 or > the layer count:\n"
            "                          the whole model\n"
            "  --no-mmap               read the model into memory instead of mapping it\n"
            "  --output-format FMT     md (default) or jsonl\n"
            "\n",
            PROG, c.n_batch, c.n_threads);
    args_print_kv_help(f, false);
}

static void bb_parse(int argc, char ** argv, struct bb_options * o) {
    static int32_t def_pp[] = {128, 256, 512}, def_tg[] = {128, 256}, def_pl[] = {1, 2, 4, 8, 16, 32};
    memset(o, 0, sizeof(*o));
    o->cparams = innerq_context_default_params();
    o->cparams.n_ctx = -1;  // not given
    o->mparams = innerq_model_default_params();
    o->npp = def_pp, o->n_npp = 3;
    o->ntg = def_tg, o->n_ntg = 2;
    o->npl = def_pl, o->n_npl = 6;
    o->n_batch = 2048;
    args a = args_init(PROG, argc, argv);
    const char * flag;
    while ((flag = args_next_flag(&a)) != NULL) {
        if (args_is(flag, "-h", "--help")) {
            bb_usage(stdout);
            exit(0);
        } else if (args_is(flag, "-npp", "--n-pp")) {
            o->n_npp = args_int_list(&a, 1, 1 << 22, &o->npp);
        } else if (args_is(flag, "-ntg", "--n-tg")) {
            o->n_ntg = args_int_list(&a, 0, 1 << 22, &o->ntg);
        } else if (args_is(flag, "-npl", "--n-pl")) {
            o->n_npl = args_int_list(&a, 1, 1024, &o->npl);
        } else if (args_is(flag, NULL, "-pps")) {
            o->pp_shared = true;
        } else if (args_is(flag, NULL, "-tgs")) {
            o->tg_separate = true;
        } else if (args_is(flag, "-b", "--batch-size")) {
            o->n_batch = args_int(&a, 1, 1 << 22);
        } else if (args_is(flag, "-ub", "--ubatch-size")) {
            o->cparams.n_batch = args_int(&a, 1, 8192);
        } else if (args_is(flag, "-c", "--ctx-size")) {
            o->cparams.n_ctx = args_int(&a, 1, 1 << 22);
        } else if (args_is(flag, "-t", "--threads")) {
            o->cparams.n_threads = args_int(&a, 0, 512);
        } else if (args_is(flag, NULL, "--output-format")) {
            const char * v = args_value(&a);
            if (strcmp(v, "md") != 0 && strcmp(v, "jsonl") != 0) {
                args_usage_error(&a, "--output-format takes md or jsonl, not '%s'", v);
            }
            o->jsonl = strcmp(v, "jsonl") == 0;
        } else if (!args_model_flag(&a, flag, &o->model, &o->mparams) && !args_kv_flag(&a, flag, &o->cparams)) {
            args_unknown(&a, flag);
        }
    }
    args_require(&a, o->model, "model (-m MODEL)");
}

// The tokens a test keeps in the cache: every sequence's prompt (or the shared one) and its generated tokens.
static int32_t bb_n_kv(const struct bb_options * o, int32_t pp, int32_t tg, int32_t pl) {
    return (o->pp_shared ? pp : pl * pp) + pl * tg;
}

static uint32_t bb_rng = 12345u;
static innerq_token bb_token(int32_t n_vocab) {
    bb_rng = bb_rng * 1664525u + 1013904223u;
    return (innerq_token) ((bb_rng >> 8) % (uint32_t) n_vocab);
}

// Decodes the first n tokens of batch in calls of at most n_batch tokens.
static innerq_status bb_decode(innerq_context * ctx, innerq_batch * batch, int32_t n, int32_t n_batch) {
    const innerq_batch all = *batch;
    innerq_status st = INNERQ_OK;
    for (int32_t i = 0; i < n && st == INNERQ_OK; i += n_batch) {
        innerq_batch part = {
            .n_tokens = n - i < n_batch ? n - i : n_batch, .token = all.token + i, .pos = NULL,
            .n_seq_id = all.n_seq_id + i, .seq_id = all.seq_id + i, .logits = all.logits + i,
        };
        st = innerq_decode_batch(ctx, &part);
    }
    return st;
}

static void bb_add(innerq_batch * b, int32_t * n, innerq_token token, int32_t seq, bool logits) {
    b->token[*n] = token;
    b->n_seq_id[*n] = 1;
    b->seq_id[*n][0] = seq;
    b->logits[*n] = logits;
    (*n)++;
}

int main(int argc, char ** argv) {
    struct bb_options o;
    bb_parse(argc, argv, &o);
    int32_t n_pl_max = 1, n_kv_max = 16, n_tokens_max = 16;
    for (int i = 0; i < o.n_npp; i++) {
        for (int j = 0; j < o.n_ntg; j++) {
            for (int k = 0; k < o.n_npl; k++) {
                const int32_t n_kv = bb_n_kv(&o, o.npp[i], o.ntg[j], o.npl[k]);
                n_kv_max = n_kv > n_kv_max ? n_kv : n_kv_max;
                n_pl_max = o.npl[k] > n_pl_max ? o.npl[k] : n_pl_max;
                const int32_t prompt = o.pp_shared ? o.npp[i] : o.npl[k] * o.npp[i];
                n_tokens_max = prompt > n_tokens_max ? prompt : n_tokens_max;
                n_tokens_max = o.npl[k] > n_tokens_max ? o.npl[k] : n_tokens_max;
            }
        }
    }
    o.cparams.n_seq_max = n_pl_max;
    o.cparams.n_ctx = o.cparams.n_ctx > 0 ? o.cparams.n_ctx : n_kv_max;
    args a = args_init(PROG, argc, argv);
    args_check_context(&a, &o.cparams);
    innerq_model * model = NULL;
    innerq_context * ctx = NULL;
    innerq_batch batch = {0};
    if (innerq_model_load(o.model, &o.mparams, &model) != INNERQ_OK) {
        return args_fail_status(PROG, "loading the model");
    }
    if (innerq_context_init(model, &o.cparams, &ctx) != INNERQ_OK ||
        innerq_batch_init(n_tokens_max, 1, &batch) != INNERQ_OK) {
        innerq_model_free(model);
        return args_fail_status(PROG, ctx == NULL ? "creating the context" : "allocating a batch");
    }
    const int32_t n_vocab = innerq_model_n_vocab(model);
    int status = 0;
    int32_t n = 0;
    for (int32_t i = 0; i < 16; i++) {  // warm up
        bb_add(&batch, &n, bb_token(n_vocab), 0, i == 15);
    }
    if (bb_decode(ctx, &batch, n, o.n_batch) != INNERQ_OK) {
        status = args_fail_status(PROG, "warming up");
    }
    const innerq_context_params * p = &o.cparams;
    if (status == 0 && !o.jsonl) {
        printf("\n%s: n_kv_max = %d, n_batch = %d, n_ubatch = %d, is_pp_shared = %d, is_tg_separate = %d, "
               "n_gpu_layers = %d, n_threads = %d, kv = %s/%s\n\n", PROG, innerq_n_ctx(ctx), o.n_batch, p->n_batch,
               o.pp_shared, o.tg_separate, o.mparams.n_gpu_layers, p->n_threads, args_kv_name(p->kv_k, p->kv_v),
               args_kv_name(p->kv_v, p->kv_k));
        printf("|%6s | %6s | %4s | %6s | %8s | %8s | %8s | %8s | %8s | %8s |\n", "PP", "TG", "B", "N_KV", "T_PP s",
               "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s");
        printf("|%6s-|-%6s-|-%4s-|-%6s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|-%8s-|\n", "------", "------", "----", "------",
               "--------", "--------", "--------", "--------", "--------", "--------");
    }
    for (int i_pp = 0; i_pp < o.n_npp && status == 0; i_pp++) {
        for (int i_tg = 0; i_tg < o.n_ntg && status == 0; i_tg++) {
            for (int i_pl = 0; i_pl < o.n_npl && status == 0; i_pl++) {
                const int32_t pp = o.npp[i_pp], tg = o.ntg[i_tg], pl = o.npl[i_pl];
                const int32_t n_kv = bb_n_kv(&o, pp, tg, pl);
                if (n_kv > innerq_n_ctx(ctx)) {
                    continue;
                }
                innerq_status st = innerq_cache_clear(ctx);
                n = 0;
                for (int32_t j = 0; j < (o.pp_shared ? 1 : pl); j++) {
                    for (int32_t t = 0; t < pp; t++) {
                        bb_add(&batch, &n, bb_token(n_vocab), j, t == pp - 1);
                    }
                }
                const int64_t t_pp_start = tool_time_ns();
                st = st == INNERQ_OK ? bb_decode(ctx, &batch, n, o.n_batch) : st;
                const int64_t t_pp_end = tool_time_ns();
                for (int32_t j = 1; j < pl && o.pp_shared && st == INNERQ_OK; j++) {
                    st = innerq_seq_cp(ctx, 0, j, -1, -1);
                }
                const int64_t t_tg_start = tool_time_ns();
                for (int32_t x = 0; x < (o.tg_separate ? pl : tg) && st == INNERQ_OK; x++) {
                    for (int32_t y = 0; y < (o.tg_separate ? tg : 1) && st == INNERQ_OK; y++) {
                        n = 0;
                        for (int32_t j = 0; j < (o.tg_separate ? 1 : pl); j++) {
                            bb_add(&batch, &n, bb_token(n_vocab), o.tg_separate ? x : j, true);
                        }
                        st = bb_decode(ctx, &batch, n, o.n_batch);
                    }
                }
                const int64_t t_tg_end = tool_time_ns();
                if (st != INNERQ_OK) {
                    status = args_fail_status(PROG, "decoding");
                    break;
                }
                const double t_pp = (double) (t_pp_end - t_pp_start) / 1e9, t_tg = (double) (t_tg_end - t_tg_start) / 1e9;
                const double s_pp = (o.pp_shared ? pp : (double) pl * pp) / t_pp;
                const double s_tg = tg > 0 ? (double) pl * tg / t_tg : 0.0;
                const double s = ((o.pp_shared ? pp : (double) pl * pp) + (double) pl * tg) / (t_pp + t_tg);
                if (o.jsonl) {
                    printf("{\"n_kv_max\": %d, \"n_batch\": %d, \"n_ubatch\": %d, \"is_pp_shared\": %d, \"n_gpu_layers\": "
                           "%d, \"n_threads\": %d, \"type_k\": \"%s\", \"type_v\": \"%s\", \"pp\": %d, \"tg\": %d, \"pl\": "
                           "%d, \"n_kv\": %d, \"t_pp\": %f, \"speed_pp\": %f, \"t_tg\": %f, \"speed_tg\": %f, \"t\": %f, "
                           "\"speed\": %f}\n", innerq_n_ctx(ctx), o.n_batch, p->n_batch, o.pp_shared,
                           o.mparams.n_gpu_layers, p->n_threads, args_kv_name(p->kv_k, p->kv_v),
                           args_kv_name(p->kv_v, p->kv_k), pp, tg, pl, n_kv, t_pp, s_pp, t_tg, s_tg, t_pp + t_tg, s);
                } else {
                    printf("|%6d | %6d | %4d | %6d | %8.3f | %8.2f | %8.3f | %8.2f | %8.3f | %8.2f |\n", pp, tg, pl, n_kv,
                           t_pp, s_pp, t_tg, s_tg, t_pp + t_tg, s);
                }
                fflush(stdout);
            }
        }
    }
    innerq_batch_free(&batch);
    innerq_context_free(ctx);
    innerq_model_free(model);
    return status;
}
