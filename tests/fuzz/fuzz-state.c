// libFuzzer target: arbitrary bytes as a saved state (innerq_state_load) into a context on
// $INNERQ_FUZZ_MODEL. The first input byte picks the context's cache type; the rest is the
// state. A state ends in a hash of what precedes it, which random bytes almost never match, so
// each input is loaded twice: as it is, and with its last 8 bytes replaced by the right hash,
// which takes the parser past the check to the header, counters and data.
// Checked: a load either fails, leaving the context as it was (the same state saves again), or
// succeeds, and then saving gives back exactly the bytes loaded (for a state of an older version:
// bytes that load and save back the same) and the context decodes,
// rewinds and saves again.
#include "innerq.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STATE_VERSION 3u  // src/context.c
#define N_KINDS 4
static const char * const kinds[N_KINDS] = {"innerq", "kivi2", "f16", "q4_0"};
static innerq_model * model;
static innerq_context * ctx[N_KINDS];

static uint64_t fnv1a64(const uint8_t * p, size_t n) {  // the state's hash (src/model.h)
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h = (h ^ p[i]) * 0x100000001b3ull;
    }
    return h;
}

static uint8_t * save(innerq_context * c, size_t * n) {
    *n = innerq_state_size(c);
    uint8_t * buf = malloc(*n);
    size_t written = 0;
    if (buf == NULL || innerq_state_save(c, buf, *n, &written) != INNERQ_OK || written != *n) {
        fprintf(stderr, "innerq_state_save failed: %s\n", innerq_last_error());
        abort();
    }
    return buf;
}

static void try_load(innerq_context * c, const uint8_t * data, size_t size) {
    size_t n_before;
    uint8_t * before = save(c, &n_before);
    if (innerq_state_load(c, data, size) != INNERQ_OK) {
        size_t n_after;
        uint8_t * after = save(c, &n_after);
        if (n_after != n_before || memcmp(after, before, n_before) != 0) {
            fprintf(stderr, "a failed load changed the context\n");
            abort();
        }
        free(after);
        free(before);
        return;
    }
    free(before);
    size_t n;
    uint8_t * again = save(c, &n);
    if (n != size || memcmp(again, data, size) != 0) {
        // A state of an older version (its u32 after the magic) loads and saves in the current
        // version, so bytes differ; what is saved then must load and save back the same.
        uint32_t version = 0;
        memcpy(&version, data + 8, 4);  // a successful load has read the whole header
        size_t n2 = 0;
        uint8_t * twice = NULL;
        if (version != STATE_VERSION && innerq_state_load(c, again, n) == INNERQ_OK) {
            twice = save(c, &n2);
        }
        if (twice == NULL || n2 != n || memcmp(twice, again, n) != 0) {
            fprintf(stderr, "a loaded state does not save back the same (%zu vs %zu bytes)\n", n, size);
            abort();
        }
        free(twice);
    }
    free(again);
    const int32_t n_past = innerq_n_past(c);
    innerq_token t = 1;
    int32_t kept = 0;
    if (n_past < innerq_n_ctx(c) && innerq_decode(c, &t, 1) != INNERQ_OK) {
        fprintf(stderr, "decode after a load failed: %s\n", innerq_last_error());
        abort();
    }
    if (innerq_cache_truncate(c, n_past / 2, &kept) != INNERQ_OK || kept > n_past / 2) {
        abort();
    }
    free(save(c, &n));
}

int LLVMFuzzerInitialize(int * argc, char *** argv) {
    (void) argc, (void) argv;
    const char * path = getenv("INNERQ_FUZZ_MODEL");
    if (path == NULL || innerq_model_load(path, NULL, &model) != INNERQ_OK) {
        fprintf(stderr, "fuzz-state needs INNERQ_FUZZ_MODEL (tests/fuzz/make_corpus.py writes OUT/state.gguf): %s\n",
                path ? innerq_last_error() : "not set");
        exit(77);
    }
    for (int i = 0; i < N_KINDS; i++) {
        innerq_context_params p = innerq_context_default_params();
        p.n_ctx = 256;
        p.n_batch = 16;
        p.n_threads = 1;
        p.kv_k = kinds[i];
        p.kv_group = 32;
        p.kv_sink = 8;
        p.kv_recent = 16;
        if (innerq_context_init(model, &p, &ctx[i]) != INNERQ_OK) {
            fprintf(stderr, "fuzz-state: context %s: %s\n", kinds[i], innerq_last_error());
            exit(77);
        }
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size < 1) {
        return 0;
    }
    innerq_context * c = ctx[data[0] % N_KINDS];
    data++, size--;
    try_load(c, data, size);
    if (size >= 8) {
        uint8_t * fixed = malloc(size);
        memcpy(fixed, data, size);
        const uint64_t h = fnv1a64(fixed, size - 8);
        memcpy(fixed + size - 8, &h, 8);
        try_load(c, fixed, size);
        free(fixed);
    }
    return 0;
}
