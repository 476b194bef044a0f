// Tokenizers read from GGUF metadata: `gpt2` (byte-level BPE; pre-tokenizer regex by
// tokenizer.ggml.pre: gpt-2, llama-bpe, qwen2, tekken, gpt-4o, smollm and the names llama.cpp
// groups with them; an unknown name is refused) and `llama` (SentencePiece BPE with scores and
// <0xXX> byte fallback): loading, pieces and detokenizing (vocab.c); tokenizing is
// vocab-tokenize.h's, the public functions on a model are model-vocab.c's.
#pragma once

#include "gguf.h"
#include "innerq.h"

struct innerq_vocab;

innerq_status vocab_load(const struct gguf_file * f, struct innerq_vocab ** out);
void vocab_free(struct innerq_vocab * vocab);

int32_t vocab_n_tokens(const struct innerq_vocab * vocab);
innerq_token vocab_bos(const struct innerq_vocab * vocab);
innerq_token vocab_eos(const struct innerq_vocab * vocab);
bool vocab_is_eog(const struct innerq_vocab * vocab, innerq_token token);
bool vocab_add_bos(const struct innerq_vocab * vocab);

innerq_status vocab_token_to_piece(const struct innerq_vocab * vocab, innerq_token token, bool render_special,
                                   char * buf, int32_t buf_size, int32_t * n_bytes);
// The vocabulary-level forms of innerq_detokenize and innerq_detokenizer_init.
innerq_status vocab_detokenize(const struct innerq_vocab * vocab, const innerq_token * tokens, int32_t n_tokens,
                               bool render_special, char * buf, int32_t buf_size, int32_t * n_bytes);
innerq_status vocab_detokenizer_init(const struct innerq_vocab * vocab, bool render_special, innerq_detokenizer ** out);
