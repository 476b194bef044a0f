// The tokenizer functions of innerq.h, on a model's vocabulary: the one place that knows both
// the model and the tokenizer, so that vocab.c and vocab-tokenize.c need not know the model.
#include "innerq.h"

#include "model.h"
#include "status.h"
#include "vocab-tokenize.h"
#include "vocab.h"

static const struct innerq_vocab * vocab_of(const innerq_model * model, const char * fn) {
    const struct innerq_vocab * v = model ? model_vocab(model) : NULL;
    if (!v) {
        innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "%s: %s", fn, model ? "the model has no vocabulary" : "model is NULL");
    }
    return v;
}

innerq_status innerq_tokenize(const innerq_model * model, const char * text, int32_t text_len, bool add_special,
                              bool parse_special, innerq_token * tokens, int32_t n_tokens_max, int32_t * n_tokens) {
    const struct innerq_vocab * v = vocab_of(model, "innerq_tokenize");
    if (!v) return INNERQ_ERR_INVALID_ARGUMENT;
    return vocab_tokenize(v, text, text_len, add_special, parse_special, tokens, n_tokens_max, n_tokens);
}

innerq_status innerq_token_to_piece(const innerq_model * model, innerq_token token, bool render_special, char * buf,
                                    int32_t buf_size, int32_t * n_bytes) {
    const struct innerq_vocab * v = vocab_of(model, "innerq_token_to_piece");
    if (!v) return INNERQ_ERR_INVALID_ARGUMENT;
    return vocab_token_to_piece(v, token, render_special, buf, buf_size, n_bytes);
}

innerq_status innerq_detokenize(const innerq_model * model, const innerq_token * tokens, int32_t n_tokens,
                                bool render_special, char * buf, int32_t buf_size, int32_t * n_bytes) {
    const struct innerq_vocab * v = vocab_of(model, "innerq_detokenize");
    if (!v) return INNERQ_ERR_INVALID_ARGUMENT;
    return vocab_detokenize(v, tokens, n_tokens, render_special, buf, buf_size, n_bytes);
}

innerq_status innerq_detokenizer_init(const innerq_model * model, bool render_special, innerq_detokenizer ** out) {
    const struct innerq_vocab * v = vocab_of(model, "innerq_detokenizer_init");
    if (!v) return INNERQ_ERR_INVALID_ARGUMENT;
    return vocab_detokenizer_init(v, render_special, out);
}
