#define _POSIX_C_SOURCE 200809L

#include "kld-base.h"

#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

static const char KLD_MAGIC[8] = {'I', 'Q', 'K', 'L', 'B', 'A', 'S', 'E'};
static const uint32_t KLD_VERSION = 1;
static const double KLD_RANGE = 32.0;
static const long KLD_HEADER_BYTES = 8 + 4 + 3 * 4 + 8;

int32_t kld_n_scored(int32_t n_ctx) {
    return n_ctx - 1 - n_ctx / 2;
}

size_t kld_record_bytes(int32_t n_vocab) {
    return 2 * sizeof(double) + sizeof(int32_t) + (size_t) n_vocab * sizeof(uint16_t);
}

bool kld_write_header(FILE * f, const struct kld_base * b) {
    const int32_t dims[3] = {b->n_ctx, b->n_vocab, b->n_chunks};
    const size_t n_tokens = (size_t) b->n_chunks * b->n_ctx;
    return fwrite(KLD_MAGIC, 1, 8, f) == 8 && fwrite(&KLD_VERSION, 4, 1, f) == 1 && fwrite(dims, 4, 3, f) == 3 &&
           fwrite(&KLD_RANGE, 8, 1, f) == 1 && fwrite(b->tokens, sizeof(innerq_token), n_tokens, f) == n_tokens;
}

bool kld_write_record(FILE * f, const double * lp, double nll, int32_t top, int32_t n_vocab, uint16_t * code) {
    const double lo = lp[top] - KLD_RANGE;
    const double per_step = 65535.0 / KLD_RANGE;
    for (int32_t i = 0; i < n_vocab; i++) {
        const double c = floor((lp[i] - lo) * per_step + 0.5);
        code[i] = (uint16_t) (c <= 0.0 ? 0.0 : c >= 65535.0 ? 65535.0 : c);
    }
    return fwrite(&nll, 8, 1, f) == 1 && fwrite(&lo, 8, 1, f) == 1 && fwrite(&top, 4, 1, f) == 1 &&
           fwrite(code, 2, (size_t) n_vocab, f) == (size_t) n_vocab;
}

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static bool kld_fail(char * err, size_t err_size, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_size, fmt, ap);
    va_end(ap);
    return false;
}

bool kld_read_header(FILE * f, struct kld_base * b, char * err, size_t err_size) {
    char magic[8];
    uint32_t version;
    int32_t dims[3];
    double range;
    b->tokens = NULL;
    if (fread(magic, 1, 8, f) != 8 || memcmp(magic, KLD_MAGIC, 8) != 0 || fread(&version, 4, 1, f) != 1) {
        return kld_fail(err, err_size, "is not a file of base log-probabilities (written by --kl-divergence-base)");
    }
    if (version != KLD_VERSION) {
        return kld_fail(err, err_size, "has format version %u; this build reads version %u", version, KLD_VERSION);
    }
    if (fread(dims, 4, 3, f) != 3 || fread(&range, 8, 1, f) != 1 || dims[0] < 4 || dims[1] < 1 || dims[2] < 1 ||
        range != KLD_RANGE) {
        return kld_fail(err, err_size, "has a damaged header");
    }
    b->n_ctx = dims[0];
    b->n_vocab = dims[1];
    b->n_chunks = dims[2];
    // in double: the dimensions are checked against the real size before anything is sized by them
    const double expected = (double) KLD_HEADER_BYTES + 4.0 * b->n_chunks * b->n_ctx +
                            (double) b->n_chunks * kld_n_scored(b->n_ctx) * (double) kld_record_bytes(b->n_vocab);
    if (fseeko(f, 0, SEEK_END) != 0) {
        return kld_fail(err, err_size, "cannot be read to its end");
    }
    const double actual = (double) ftello(f);
    if (actual != expected) {
        return kld_fail(err, err_size, "is truncated or damaged (%.0f bytes, its header says %.0f)", actual, expected);
    }
    const size_t n_tokens = (size_t) b->n_chunks * b->n_ctx;
    if (fseeko(f, KLD_HEADER_BYTES, SEEK_SET) != 0 || !(b->tokens = malloc(n_tokens * sizeof(innerq_token))) ||
        fread(b->tokens, sizeof(innerq_token), n_tokens, f) != n_tokens) {
        free(b->tokens);
        b->tokens = NULL;
        return kld_fail(err, err_size, "cannot be read (its tokens)");
    }
    for (size_t i = 0; i < n_tokens; i++) {
        if (b->tokens[i] < 0 || b->tokens[i] >= b->n_vocab) {
            kld_fail(err, err_size, "has a token id out of its vocabulary (%d at %zu)", b->tokens[i], i);
            free(b->tokens);
            b->tokens = NULL;
            return false;
        }
    }
    return true;
}

bool kld_read_record(FILE * f, int32_t n_vocab, struct kld_record * r, uint16_t * code) {
    if (fread(&r->nll, 8, 1, f) != 1 || fread(&r->lo, 8, 1, f) != 1 || fread(&r->top, 4, 1, f) != 1 ||
        fread(code, 2, (size_t) n_vocab, f) != (size_t) n_vocab) {
        return false;
    }
    // What the writer can produce: a finite nll >= 0, a token as top and lo = log p_top - range,
    // where the most likely token has log p_top in [-log n_vocab, 0]; so exp(lo) > 0 and
    // kld_token's sum is never 0.
    return isfinite(r->nll) && r->nll >= 0.0 && r->lo <= -KLD_RANGE + 1e-9 &&
           r->lo >= -KLD_RANGE - log((double) n_vocab) - 1e-9 && r->top >= 0 && r->top < n_vocab;
}

// The base distribution is decoded from its codes and renormalized: with
// e_i = exp(lo + code_i * step) and S = sum e_i,
// KL = sum (e_i / S) (log(e_i / S) - lp_i) = (sum e_i (log e_i - lp_i)) / S - log S.
double kld_token(const uint16_t * code, double lo, const double * lp, int32_t n_vocab) {
    const double step = KLD_RANGE / 65535.0;
    double sum = 0.0, acc = 0.0;
    for (int32_t i = 0; i < n_vocab; i++) {
        const double lb = lo + step * code[i];
        const double e = exp(lb);
        sum += e;
        acc += e * (lb - lp[i]);
    }
    return acc / sum - log(sum);
}
