// The file of base log-probabilities of innerq-perplexity (--kl-divergence-base): writing it,
// and reading it back with every field checked, so that a damaged or hostile file ends in a
// message (tests/fuzz/fuzz-kld-base.c feeds the reader arbitrary bytes).
//
// Layout, native byte order (little-endian on every target):
//   char magic[8] "IQKLBASE"; uint32 version (1); int32 n_ctx, n_vocab, n_chunks; double range;
//   int32 tokens[n_chunks * n_ctx], as evaluated (BOS already in place);
//   then per chunk, per scored token (n_ctx - 1 - n_ctx/2 of them), a record:
//   double nll (-log p of the next token, exact); double lo; int32 top (the most likely token);
//   uint16 code[n_vocab]: log p_i = lo + code_i * range / 65535, lo = log p_top - range
//   (tokens less likely than that get code 0).
// 16 bits over 32 nats is a step of 4.9e-4 nats, an error of at most 2.4e-4 everywhere in the
// range, and the base distribution is renormalized after decoding, which cancels the
// first-order term. On SmolLM2-135M (q8_0 and q4_0 caches against f16) the mean KLD is within
// 5e-5 of the exact one relatively and every token's within 1e-4 absolutely; fp16 log-probs
// are 1.5 to 4 times further off, and a 16-nat range makes the q8_0 KLD 3.5 times too large
// (its clamped tail carries real mass). nll and top are kept exactly, so PPL(base) and
// "same top p" are exact. 8 chunks of 4096 with a 49152-token vocabulary: 1.6 GB.
#pragma once

#include "innerq.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

struct kld_base {
    int32_t n_ctx, n_vocab, n_chunks;
    innerq_token * tokens;  // n_chunks * n_ctx, malloc'ed
};

// One scored token's base prediction (its codes are read into a caller's array).
struct kld_record {
    double nll, lo;
    int32_t top;
};

// Tokens scored per chunk, and bytes of one record.
int32_t kld_n_scored(int32_t n_ctx);
size_t kld_record_bytes(int32_t n_vocab);

bool kld_write_header(FILE * f, const struct kld_base * b);
// lp: n_vocab log-probabilities; code: room for n_vocab codes.
bool kld_write_record(FILE * f, const double * lp, double nll, int32_t top, int32_t n_vocab, uint16_t * code);

// Reads and checks the header and the tokens (the file's size must match them), leaving f at
// the first record. On failure b->tokens is NULL and err says why (to follow the file's name).
bool kld_read_header(FILE * f, struct kld_base * b, char * err, size_t err_size);
// Reads the next record; false at the end of the file or on a damaged record.
bool kld_read_record(FILE * f, int32_t n_vocab, struct kld_record * r, uint16_t * code);

// KL(base || current) of one token, current given as n_vocab log-probabilities lp.
double kld_token(const uint16_t * code, double lo, const double * lp, int32_t n_vocab);
