// Greedy continuation of a prompt with the C library: `generate MODEL.gguf "PROMPT" [N]`.
#include <innerq.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(void) { fprintf(stderr, "error: %s\n", innerq_last_error()); return 1; }

int main(int argc, char ** argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s MODEL.gguf PROMPT [N]\n", argv[0]); return 2; }
    innerq_model_params mp = innerq_model_default_params();
    innerq_context_params cp = innerq_context_default_params();
    innerq_model * model = NULL;
    innerq_context * ctx = NULL;
    if (innerq_model_load(argv[1], &mp, &model) != INNERQ_OK) return fail();
    if (innerq_context_init(model, &cp, &ctx) != INNERQ_OK) return fail();
    innerq_token tok[512];
    int32_t n = 0, n_vocab = innerq_model_n_vocab(model), n_gen = argc > 3 ? atoi(argv[3]) : 16;
    if (innerq_tokenize(model, argv[2], (int32_t) strlen(argv[2]), true, false, tok, 512, &n) != INNERQ_OK) return fail();
    for (int i = 0; i < n_gen; i++) {
        if (innerq_decode(ctx, tok, n) != INNERQ_OK) return fail();
        const float * logits = innerq_get_logits(ctx);  // the last token's
        innerq_token best = 0;
        for (innerq_token t = 1; t < n_vocab; t++) best = logits[t] > logits[best] ? t : best;
        if (innerq_token_is_eog(model, best)) break;
        char piece[64];
        int32_t len = 0;
        if (innerq_token_to_piece(model, best, false, piece, sizeof piece, &len) == INNERQ_OK) fwrite(piece, 1, (size_t) len, stdout);
        tok[0] = best, n = 1;
    }
    putchar('\n');
    innerq_context_free(ctx);
    innerq_model_free(model);
    return 0;
}
