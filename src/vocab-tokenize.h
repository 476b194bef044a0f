// Text to tokens with a loaded vocabulary (vocab-tokenize.c): the special-token split, the
// pre-tokenizer and BPE merges (gpt2), or SentencePiece BPE with byte fallback (llama).
#pragma once

#include "vocab.h"

innerq_status vocab_tokenize(const struct innerq_vocab * vocab, const char * text, int32_t text_len,
                             bool add_special, bool parse_special,
                             innerq_token * tokens, int32_t n_tokens_max, int32_t * n_tokens);
