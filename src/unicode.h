// Unicode for the tokenizers: strict UTF-8 decoding where every invalid byte is a unit of its
// own, the character classes of the pre-tokenizer regexes, and hand-written matchers for
// those regexes (no regex engine), with the semantics of llama.cpp's custom splitters.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// Flags of a code point: its major general category, and \s (the White_Space property).
enum unicode_flag {
    UNICODE_LETTER = 0x01,      // \p{L}
    UNICODE_NUMBER = 0x02,      // \p{N}
    UNICODE_MARK = 0x04,        // \p{M}
    UNICODE_PUNCT = 0x08,       // \p{P}
    UNICODE_SYMBOL = 0x10,      // \p{S}
    UNICODE_SEPARATOR = 0x20,   // \p{Z}
    UNICODE_OTHER = 0x40,       // \p{C}, unassigned included
    UNICODE_WHITESPACE = 0x80,  // \s
    UNICODE_LOWER = 0x100,      // \p{Ll}
    UNICODE_UPPER = 0x200,      // \p{Lu} or \p{Lt}
};
#define UNICODE_FLAG_BITS 10  // unicode_flag_ranges: (first code point << UNICODE_FLAG_BITS) | flags

#define UNICODE_REPLACEMENT 0xFFFDu

uint32_t unicode_cpt_flags(uint32_t cpt);

// Decodes the character at s[0..n), n >= 1: returns its length in bytes and sets *cpt. A byte
// that does not start a well-formed sequence (stray continuation, truncated or overlong
// sequence, surrogate, > U+10FFFF) is a unit of length 1 with *cpt = U+FFFD, so it is classed
// like llama.cpp classes it, while its own byte is kept for byte-level BPE.
size_t unicode_utf8_decode(const char * s, size_t n, uint32_t * cpt);
// Writes the UTF-8 of cpt (<= U+10FFFF) to out; returns its length (1-4).
size_t unicode_utf8_encode(uint32_t cpt, char out[4]);
// How many bytes at the end of s[0..n) are a well-formed sequence cut short (0-3).
size_t unicode_utf8_incomplete_tail(const char * s, size_t n);
// Where s[0..n) starts with an invalid byte: the length of the maximal ill-formed subpart
// there (1-3), the stretch that Unicode's recommended practice (and Python's
// errors="replace") replaces by one U+FFFD.
size_t unicode_utf8_invalid_len(const char * s, size_t n);

// Text decoded into units: unit i is bytes [off[i], off[i+1]) with code point cpt[i].
struct unicode_text {
    uint32_t * cpt;
    uint32_t * flags;
    size_t * off;   // n + 1 entries
    size_t n;
    size_t cap;
};

bool unicode_text_decode(struct unicode_text * t, const char * s, size_t n);  // false: out of memory
void unicode_text_free(struct unicode_text * t);

// The pre-tokenizer regexes.
enum unicode_split {
    // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    UNICODE_SPLIT_GPT2,
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
    // \s*[\r\n]+|\s+(?!\S)|\s+
    UNICODE_SPLIT_LLAMA3,
    // \p{N} (every digit a word of its own), then GPT2 on each stretch between digits
    UNICODE_SPLIT_DIGITS_GPT2,
    // LLAMA3 with \p{N} for \p{N}{1,3} (Qwen2, Qwen2.5, Qwen3)
    UNICODE_SPLIT_QWEN2,
    // [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|
    // [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|
    // ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+   (Mistral's tekken)
    UNICODE_SPLIT_TEKKEN,
    // TEKKEN with (?i:'s|'t|'re|'ve|'m|'ll|'d)? after each letter alternative and \p{N}{1,3}
    UNICODE_SPLIT_GPT4O,
};

// Splits the units of t into words: word i ends at unit ends[i] (ends needs t->n entries).
// Returns the number of words.
size_t unicode_split_words(enum unicode_split kind, const struct unicode_text * t, size_t * ends);

// Data (unicode-data.c, written by tools/gen_unicode_data.py).
extern const char unicode_data_version[];
extern const uint32_t unicode_flag_ranges[];
extern const size_t unicode_flag_ranges_n;
extern const uint16_t unicode_flags_latin1[256];
