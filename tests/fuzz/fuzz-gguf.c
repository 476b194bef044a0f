// libFuzzer target: arbitrary bytes as a model file, through the public API. A file that
// loads is then used as a model is: metadata, tokenizing, a small context and one decode.
// Every outcome but a crash, a sanitizer report or a leak is fine.
#define _GNU_SOURCE
#include "innerq.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

static int fd = -1;
static char path[64];

static void use_model(innerq_model * m) {
    char buf[256];
    for (int32_t i = 0; i < innerq_model_meta_count(m); i++) {
        if (innerq_model_meta_key(m, i, buf, sizeof(buf)) >= 0) {
            innerq_model_meta_value(m, buf, buf, sizeof(buf));
        }
    }
    innerq_token toks[64];
    int32_t n = 0;
    static const char text[] = "Hello, <|im_start|>world \xff\xfe 42!";
    if (innerq_tokenize(m, text, (int32_t) sizeof(text) - 1, true, true, toks, 64, &n) != INNERQ_OK || n == 0) {
        return;
    }
    int32_t n_bytes;
    innerq_detokenize(m, toks, n, true, buf, sizeof(buf), &n_bytes);
    innerq_context_params cp = innerq_context_default_params();
    cp.n_ctx = 16;
    cp.n_threads = 1;
    innerq_context * ctx;
    if (innerq_context_init(m, &cp, &ctx) == INNERQ_OK) {
        if (innerq_decode(ctx, toks, n < 16 ? n : 16) == INNERQ_OK) {
            innerq_get_logits(ctx);
        }
        innerq_context_free(ctx);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (fd < 0) {
        // one in-memory file, rewritten for every input, named by its /proc path
        fd = memfd_create("fuzz.gguf", 0);
        if (fd < 0) {
            perror("memfd_create");
            abort();
        }
        snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    }
    if (ftruncate(fd, 0) != 0 || (size > 0 && pwrite(fd, data, size, 0) != (ssize_t) size)) {
        perror("writing the input");
        abort();
    }
    innerq_model_params mp = innerq_model_default_params();
    mp.use_mmap = size % 2 == 0;  // both ways of reading the file
    innerq_model * m = NULL;
    if (innerq_model_load(path, &mp, &m) == INNERQ_OK) {
        use_model(m);
        innerq_model_free(m);
    }
    return 0;
}
