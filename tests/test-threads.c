// Threads sharing one context, and contexts on one model in parallel (innerq.h, "Threads").
//
//   test-threads [MODEL [ROUNDS [THREADS]]]   (MODEL: $INNERQ_TEST_MODEL or the pulled SmolLM2;
//                                              THREADS: pool threads per context, default 2)
//
// 1. Two threads generate on one context, each holding the context's lock for its whole
//    generation: every output equals the sequential one, ROUNDS (20) rounds each.
// 2. Two threads make single calls on one context without holding the lock across them
//    (decode, logits, clear): the outputs are unspecified, but each call must be whole; the
//    sanitizer builds (ASan, TSan) see any memory or data race.
// 3. One context per thread on one model: in parallel, the same outputs as sequentially.
// Exit 0: passed; 1: failed; 77: no model (skipped).
#include "innerq.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_GEN 8
#define N_PROMPTS 2

static const char * const PROMPTS[N_PROMPTS] = {"The capital of France is", "Once upon a time, a small fox"};

static innerq_model * model;
static innerq_token expected[N_PROMPTS][N_GEN];
static int rounds = 20;
static int n_pool = 2;  // the thread pool runs too: its threads touch the same cache

static int fail(const char * what) {
    fprintf(stderr, "test-threads: %s: %s\n", what, innerq_last_error());
    return 1;
}

// Greedy generation of N_GEN tokens after prompt p; the caller holds ctx (or owns it).
static int generate(innerq_context * ctx, int p, innerq_token * out) {
    innerq_token prompt[64];
    int32_t n;
    if (innerq_tokenize(model, PROMPTS[p], (int32_t) strlen(PROMPTS[p]), true, false, prompt, 64, &n) ||
        innerq_cache_clear(ctx) || innerq_decode(ctx, prompt, n)) {
        return fail("prompt");
    }
    innerq_sampler_params sp = innerq_sampler_default_params();
    sp.temperature = 0.0f;
    innerq_sampler * smpl;
    if (innerq_sampler_init(&sp, &smpl)) {
        return fail("sampler");
    }
    int rc = 0;
    for (int i = 0; i < N_GEN && rc == 0; i++) {
        const float * logits = innerq_get_logits(ctx);
        if (logits == NULL || innerq_sampler_sample(smpl, logits, innerq_model_n_vocab(model), &out[i]) ||
            innerq_decode(ctx, &out[i], 1)) {
            rc = fail("generation step");
        }
    }
    innerq_sampler_free(smpl);
    return rc;
}

static innerq_context * context_new(void) {
    innerq_context_params cp = innerq_context_default_params();
    cp.n_ctx = 128;
    cp.n_threads = n_pool;
    innerq_context * ctx = NULL;
    if (innerq_context_init(model, &cp, &ctx)) {
        fail("context");
    }
    return ctx;
}

struct job {
    innerq_context * ctx;  // shared, or NULL: the thread makes its own
    int prompt;
    int failures;
};

static void * generate_rounds(void * arg) {
    struct job * j = arg;
    innerq_context * ctx = j->ctx ? j->ctx : context_new();
    if (ctx == NULL) {
        j->failures = rounds;
        return NULL;
    }
    for (int r = 0; r < rounds; r++) {
        innerq_token out[N_GEN];
        const bool shared = j->ctx != NULL;
        if (shared && innerq_context_lock(ctx)) {
            j->failures++;
            continue;
        }
        const int rc = generate(ctx, j->prompt, out);
        if (shared && innerq_context_unlock(ctx)) {
            j->failures++;
        }
        j->failures += rc != 0 || memcmp(out, expected[j->prompt], sizeof(out)) != 0;
    }
    if (j->ctx == NULL) {
        innerq_context_free(ctx);
    }
    return NULL;
}

static void * single_calls(void * arg) {
    struct job * j = arg;
    const innerq_token t = innerq_token_bos(model) >= 0 ? innerq_token_bos(model) : 0;
    for (int r = 0; r < 4 * rounds; r++) {
        const innerq_status st = innerq_decode(j->ctx, &t, 1);
        if (st == INNERQ_ERR_CONTEXT_FULL) {
            j->failures += innerq_cache_clear(j->ctx) != INNERQ_OK;
        } else if (st != INNERQ_OK) {
            j->failures++;
        }
        innerq_get_logits(j->ctx);  // may be NULL right after the other thread's clear
        j->failures += innerq_n_past(j->ctx) < 0 || innerq_n_past(j->ctx) > innerq_n_ctx(j->ctx);
    }
    return NULL;
}

// Runs fn on two threads (prompts 0 and 1) with ctx; returns the failures.
static int run_pair(void * (*fn)(void *), innerq_context * ctx, const char * what) {
    struct job jobs[N_PROMPTS];
    pthread_t th[N_PROMPTS];
    for (int i = 0; i < N_PROMPTS; i++) {
        jobs[i] = (struct job) {ctx, i, 0};
        if (pthread_create(&th[i], NULL, fn, &jobs[i]) != 0) {
            fprintf(stderr, "test-threads: pthread_create failed\n");
            return 1;
        }
    }
    int failures = 0;
    for (int i = 0; i < N_PROMPTS; i++) {
        pthread_join(th[i], NULL);
        failures += jobs[i].failures;
    }
    printf("%-44s %d rounds x %d threads: %d failures\n", what, fn == single_calls ? 4 * rounds : rounds,
           N_PROMPTS, failures);
    return failures;
}

int main(int argc, char ** argv) {
    char fallback[1024];
    const char * path = argc > 1 ? argv[1] : getenv("INNERQ_TEST_MODEL");
    if (path == NULL) {
        snprintf(fallback, sizeof(fallback), "%s/.cache/innerq/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                 getenv("HOME") ? getenv("HOME") : ".");
        path = fallback;
    }
    if (argc > 2) {
        rounds = atoi(argv[2]);
    }
    if (argc > 3) {
        n_pool = atoi(argv[3]);
    }
    setvbuf(stdout, NULL, _IOLBF, 0);  // each line as it is done, also into a file
    if (innerq_model_load(path, NULL, &model)) {
        fprintf(stderr, "test-threads: skipped: %s\n", innerq_last_error());
        return 77;
    }
    innerq_context * ctx = context_new();
    if (ctx == NULL) {
        return 1;
    }
    for (int p = 0; p < N_PROMPTS; p++) {
        if (generate(ctx, p, expected[p])) {
            return 1;
        }
    }
    int failures = run_pair(generate_rounds, ctx, "one context, lock held per generation:");
    failures += run_pair(single_calls, ctx, "one context, single calls:");
    failures += run_pair(generate_rounds, NULL, "a context per thread, one model:");
    innerq_context_free(ctx);
    innerq_model_free(model);
    printf("%s\n", failures ? "FAILED" : "passed");
    return failures != 0;
}
