// libFuzzer target: arbitrary bytes as innerq-perplexity's --kl-divergence-base file, read with
// tools/common/kld-base.c as the tool reads it: the header and tokens, then every record, each
// compared with a uniform distribution.
#define _GNU_SOURCE
#include "kld-base.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size == 0) {
        return 0;  // fmemopen wants at least one byte
    }
    FILE * f = fmemopen((void *) data, size, "rb");
    if (f == NULL) {
        return 0;
    }
    struct kld_base b;
    char err[256];
    if (kld_read_header(f, &b, err, sizeof(err))) {
        // the header was checked against the file's size: these allocations are bounded by it
        uint16_t * code = malloc(sizeof(uint16_t) * (size_t) b.n_vocab);
        double * lp = malloc(sizeof(double) * (size_t) b.n_vocab);
        for (int32_t i = 0; i < b.n_vocab; i++) {
            lp[i] = -log((double) b.n_vocab);
        }
        struct kld_record r;
        const int64_t n_records = (int64_t) b.n_chunks * kld_n_scored(b.n_ctx);
        for (int64_t i = 0; i < n_records && kld_read_record(f, b.n_vocab, &r, code); i++) {
            if (!(kld_token(code, r.lo, lp, b.n_vocab) > -1e-6)) {  // a KL divergence is >= 0
                abort();
            }
        }
        free(code);
        free(lp);
        free(b.tokens);
    }
    fclose(f);
    return 0;
}
