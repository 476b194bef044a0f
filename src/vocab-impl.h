// The inside of struct innerq_vocab, shared by vocab.c (loading, pieces, detokenizing) and
// vocab-tokenize.c (tokenizing). Nothing outside these two includes it.
#pragma once

#include "unicode.h"
#include "vocab.h"

// Token attributes, from tokenizer.ggml.token_type (1..6 in GGUF).
enum token_attr {
    TOKEN_NORMAL = 0x01,
    TOKEN_UNKNOWN = 0x02,
    TOKEN_CONTROL = 0x04,
    TOKEN_USER_DEFINED = 0x08,
    TOKEN_UNUSED = 0x10,
    TOKEN_BYTE = 0x20,
    TOKEN_RSTRIP = 0x40,  // takes the ASCII whitespace after it (not a GGUF type: Phi-3's, by name)
    TOKEN_EOG = 0x80,     // ends generation (not a GGUF type)
};
#define TOKEN_SPECIAL (TOKEN_CONTROL | TOKEN_USER_DEFINED | TOKEN_UNKNOWN)

enum vocab_kind { VOCAB_BPE, VOCAB_SPM };

// Text -> token id, open addressing.
struct text_map {
    int32_t * slots;  // -1: empty
    size_t mask;
};

// (left id, right id) -> merge rank and the token the merge makes, open addressing.
struct merge_entry {
    uint64_t key;  // MERGE_EMPTY: empty
    int32_t rank;
    int32_t result;
};
#define MERGE_EMPTY UINT64_MAX

struct merge_map {
    struct merge_entry * slots;
    size_t mask;
};

struct innerq_vocab {
    enum vocab_kind kind;
    enum unicode_split split;  // gpt2
    bool ignore_merges;        // gpt2: a word that is a token is that token (llama3)
    bool add_bos, add_eos;
    bool add_space_prefix;     // llama
    innerq_token bos, eos, unk;

    int32_t n_tokens;
    char * text;          // every token's text, back to back
    uint32_t * text_off;  // n_tokens + 1
    char * piece;         // every token's bytes as detokenized (control tokens: their text)
    uint32_t * piece_off;
    uint8_t * attr;
    float * score;        // llama

    struct text_map by_text;
    struct merge_map merges;
    innerq_token byte_token[256];  // gpt2: the token of the byte's character; llama: <0xXX>
    innerq_token * special;        // tokens split out before tokenizing, longest text first
    int32_t n_special;
};

static inline const char * vocab_token_text(const struct innerq_vocab * v, innerq_token id, size_t * len) {
    *len = v->text_off[id + 1] - v->text_off[id];
    return v->text + v->text_off[id];
}

// The token whose text is s[0..n), or -1.
innerq_token vocab_text_find(const struct innerq_vocab * v, const char * s, size_t n);
// The merge of two tokens, or NULL.
const struct merge_entry * vocab_merge_find(const struct innerq_vocab * v, innerq_token left, innerq_token right);

// The GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68
// bytes for U+0100..U+0143 in byte order, so that every byte is a visible character.
#define GPT2_ALPHABET_END 0x144
uint32_t vocab_gpt2_byte_cpt(uint8_t b);

// Makes room for `need` elements of `elem` bytes in *(T **) ptr, doubling; false: out of memory.
bool vocab_grow(void * ptr, size_t * cap, size_t need, size_t elem);
