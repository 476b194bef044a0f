// libFuzzer target: tokenize arbitrary bytes and detokenize them again, with the vocabulary
// of $INNERQ_FUZZ_MODEL. The first input byte picks add_special / parse_special.
// Checked (innerq.h, innerq_detokenize): without specials the text comes back exactly when
// each of its bytes alone does; the streaming detokenizer gives valid UTF-8, and the same
// bytes as innerq_detokenize whenever those are valid UTF-8.
#include "innerq.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static innerq_model * model;
static bool byte_ok[256];  // the byte alone comes back from a round trip

// Tokenizes text into *toks (*n tokens, malloc'ed) and detokenizes them into *out (malloc'ed,
// NUL-terminated); returns the bytes of *out.
static int32_t round_trip(const char * text, int32_t len, bool add, bool parse, innerq_token ** toks, int32_t * n,
                          char ** out) {
    int32_t n_bytes = 0;
    innerq_status st = innerq_tokenize(model, text, len, add, parse, NULL, 0, n);
    if (st != INNERQ_OK && st != INNERQ_ERR_BUFFER_TOO_SMALL) {
        fprintf(stderr, "tokenize failed: %s\n", innerq_last_error());
        abort();
    }
    *toks = malloc(sizeof(innerq_token) * (size_t) (*n + 1));
    if (innerq_tokenize(model, text, len, add, parse, *toks, *n, n) != INNERQ_OK) {
        abort();
    }
    st = innerq_detokenize(model, *toks, *n, parse, NULL, 0, &n_bytes);
    if (st != INNERQ_OK && st != INNERQ_ERR_BUFFER_TOO_SMALL) {
        abort();
    }
    *out = malloc((size_t) n_bytes + 1);
    if (innerq_detokenize(model, *toks, *n, parse, *out, n_bytes, &n_bytes) != INNERQ_OK) {
        abort();
    }
    (*out)[n_bytes] = '\0';
    return n_bytes;
}

static bool utf8_valid(const unsigned char * s, size_t n) {
    for (size_t i = 0; i < n;) {
        const unsigned c = s[i];
        size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (k == 0 || i + k > n || (k == 2 && c < 0xC2) || (k == 4 && c > 0xF4)) {
            return false;
        }
        uint32_t cp = k == 1 ? c : c & (0x7F >> k);
        for (size_t j = 1; j < k; j++) {
            if ((s[i + j] & 0xC0) != 0x80) {
                return false;
            }
            cp = cp << 6 | (s[i + j] & 0x3F);
        }
        if ((k == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (k == 4 && (cp < 0x10000 || cp > 0x10FFFF))) {
            return false;
        }
        i += k;
    }
    return true;
}

int LLVMFuzzerInitialize(int * argc, char *** argv) {
    const char * path = getenv("INNERQ_FUZZ_MODEL");
    if (path == NULL || innerq_model_load(path, NULL, &model) != INNERQ_OK) {
        fprintf(stderr, "fuzz-tokenizer: set INNERQ_FUZZ_MODEL to a GGUF model (%s)\n",
                path ? innerq_last_error() : "unset");
        exit(1);
    }
    for (int b = 0; b < 256; b++) {
        const char c = (char) b;
        innerq_token * toks;
        int32_t n_toks;
        char * out;
        const int32_t n = round_trip(&c, 1, false, false, &toks, &n_toks, &out);
        byte_ok[b] = n == 1 && out[0] == c;
        free(toks);
        free(out);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size < 1 || size > 4096) {
        return 0;
    }
    const bool add = data[0] & 1, parse = data[0] & 2;
    const char * text = (const char *) data + 1;
    const int32_t len = (int32_t) size - 1;
    innerq_token * toks;
    int32_t n_toks;
    char * out;
    const int32_t n_out = round_trip(text, len, add, parse, &toks, &n_toks, &out);
    bool representable = !parse;
    for (int32_t i = 0; i < len && representable; i++) {
        representable = byte_ok[(uint8_t) text[i]];
    }
    if (representable && (n_out != len || memcmp(out, text, (size_t) len) != 0)) {
        fprintf(stderr, "round trip changed the text (%d bytes -> %d)\n", len, n_out);
        abort();
    }
    // the streaming detokenizer over the same tokens
    innerq_detokenizer * dt;
    if (innerq_detokenizer_init(model, parse, &dt) != INNERQ_OK) {
        abort();
    }
    char * stream = malloc((size_t) 3 * (n_out + 4) + 16);
    size_t n_stream = 0;
    static char piece[1 << 16];  // more than any token's bytes
    int32_t n_piece;
    for (int32_t i = 0; i < n_toks; i++) {
        if (innerq_detokenizer_push(dt, toks[i], piece, sizeof(piece), &n_piece) != INNERQ_OK ||
            !utf8_valid((unsigned char *) piece, (size_t) n_piece)) {
            abort();
        }
        memcpy(stream + n_stream, piece, (size_t) n_piece);
        n_stream += (size_t) n_piece;
    }
    if (innerq_detokenizer_flush(dt, piece, sizeof(piece), &n_piece) != INNERQ_OK) {
        abort();
    }
    memcpy(stream + n_stream, piece, (size_t) n_piece);
    n_stream += (size_t) n_piece;
    if (utf8_valid((unsigned char *) out, (size_t) n_out) &&
        (n_stream != (size_t) n_out || memcmp(stream, out, n_stream) != 0)) {
        fprintf(stderr, "the stream differs from detokenize\n");
        abort();
    }
    innerq_detokenizer_free(dt);
    free(stream);
    free(toks);
    free(out);
    return 0;
}
