#include "unicode.h"

#include <stdlib.h>

uint32_t unicode_cpt_flags(uint32_t cpt) {
    if (cpt < 256) {
        return unicode_flags_latin1[cpt];
    }
    if (cpt > 0x10FFFF) {
        return UNICODE_OTHER;
    }
    // the last range whose start is <= cpt
    size_t lo = 0, hi = unicode_flag_ranges_n;
    while (hi - lo > 1) {
        const size_t mid = (lo + hi) / 2;
        if ((unicode_flag_ranges[mid] >> UNICODE_FLAG_BITS) <= cpt) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return unicode_flag_ranges[lo] & ((1u << UNICODE_FLAG_BITS) - 1);
}

// Length of the sequence a lead byte starts (0: not a lead byte) and the range its second
// byte must be in (Unicode table 3-7: this excludes overlongs, surrogates and > U+10FFFF).
static size_t utf8_lead(uint8_t b, uint8_t * lo, uint8_t * hi) {
    *lo = 0x80;
    *hi = 0xBF;
    if (b < 0x80) return 1;
    if (b < 0xC2) return 0;
    if (b < 0xE0) return 2;
    if (b < 0xF0) {
        if (b == 0xE0) *lo = 0xA0;
        if (b == 0xED) *hi = 0x9F;
        return 3;
    }
    if (b < 0xF5) {
        if (b == 0xF0) *lo = 0x90;
        if (b == 0xF4) *hi = 0x8F;
        return 4;
    }
    return 0;
}

// How many bytes of s[0..n) (at most len) fit the sequence a lead byte of length len starts.
static size_t utf8_valid_prefix(const uint8_t * s, size_t n, size_t len, uint8_t lo, uint8_t hi) {
    size_t k = 1;
    for (; k < len && k < n; ++k) {
        const uint8_t b = s[k];
        const bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
        if (!ok) break;
    }
    return k;
}

size_t unicode_utf8_decode(const char * str, size_t n, uint32_t * cpt) {
    const uint8_t * s = (const uint8_t *) str;
    uint8_t lo, hi;
    const size_t len = utf8_lead(s[0], &lo, &hi);
    if (len == 1) {
        *cpt = s[0];
        return 1;
    }
    if (len == 0 || utf8_valid_prefix(s, n, len, lo, hi) < len) {
        *cpt = UNICODE_REPLACEMENT;
        return 1;
    }
    uint32_t c = s[0] & (0x7F >> len);
    for (size_t k = 1; k < len; ++k) {
        c = (c << 6) | (s[k] & 0x3F);
    }
    *cpt = c;
    return len;
}

size_t unicode_utf8_encode(uint32_t cpt, char out[4]) {
    if (cpt < 0x80) {
        out[0] = (char) cpt;
        return 1;
    }
    if (cpt < 0x800) {
        out[0] = (char) (0xC0 | (cpt >> 6));
        out[1] = (char) (0x80 | (cpt & 0x3F));
        return 2;
    }
    if (cpt < 0x10000) {
        out[0] = (char) (0xE0 | (cpt >> 12));
        out[1] = (char) (0x80 | ((cpt >> 6) & 0x3F));
        out[2] = (char) (0x80 | (cpt & 0x3F));
        return 3;
    }
    out[0] = (char) (0xF0 | (cpt >> 18));
    out[1] = (char) (0x80 | ((cpt >> 12) & 0x3F));
    out[2] = (char) (0x80 | ((cpt >> 6) & 0x3F));
    out[3] = (char) (0x80 | (cpt & 0x3F));
    return 4;
}

size_t unicode_utf8_incomplete_tail(const char * str, size_t n) {
    const uint8_t * s = (const uint8_t *) str;
    // only the last lead byte among the final three can start a cut-short sequence
    for (size_t k = 1; k <= 3 && k <= n; ++k) {
        const uint8_t b = s[n - k];
        if (b >= 0x80 && b <= 0xBF) {
            continue;
        }
        uint8_t lo, hi;
        const size_t len = utf8_lead(b, &lo, &hi);
        const bool cut = len > k && utf8_valid_prefix(s + n - k, k, len, lo, hi) == k;
        return cut ? k : 0;
    }
    return 0;
}

size_t unicode_utf8_invalid_len(const char * str, size_t n) {
    const uint8_t * s = (const uint8_t *) str;
    uint8_t lo, hi;
    const size_t len = utf8_lead(s[0], &lo, &hi);
    return len > 1 ? utf8_valid_prefix(s, n, len, lo, hi) : 1;
}

bool unicode_text_decode(struct unicode_text * t, const char * s, size_t n) {
    if (n + 1 > t->cap) {
        uint32_t * cpt = realloc(t->cpt, (n + 1) * sizeof(uint32_t));
        if (cpt) t->cpt = cpt;
        uint32_t * flags = realloc(t->flags, (n + 1) * sizeof(uint32_t));
        if (flags) t->flags = flags;
        size_t * off = realloc(t->off, (n + 1) * sizeof(size_t));
        if (off) t->off = off;
        if (!cpt || !flags || !off) {
            return false;
        }
        t->cap = n + 1;
    }
    size_t i = 0;
    for (size_t pos = 0; pos < n; ++i) {
        t->off[i] = pos;
        pos += unicode_utf8_decode(s + pos, n - pos, &t->cpt[i]);
        t->flags[i] = unicode_cpt_flags(t->cpt[i]);
    }
    t->off[i] = n;
    t->n = i;
    return true;
}

void unicode_text_free(struct unicode_text * t) {
    free(t->cpt);
    free(t->flags);
    free(t->off);
    *t = (struct unicode_text){0};
}

// ---- pre-tokenizer splits ----
//
// Each splitter works on units [ini, end) and sees nothing beyond them: a lookahead past
// `end` finds no character (flags 0), as in llama.cpp, where a stretch split off by an
// earlier regex is matched on its own.

#define OUT_OF_RANGE 0xFFFFFFFFu

struct split {
    const struct unicode_text * t;
    size_t end;  // end of the stretch being split
    size_t * ends;
    size_t n_words;
};

static uint32_t split_flags(const struct split * sp, size_t pos) {
    return pos < sp->end ? sp->t->flags[pos] : 0;
}

static uint32_t split_cpt(const struct split * sp, size_t pos) {
    return pos < sp->end ? sp->t->cpt[pos] : OUT_OF_RANGE;
}

static void split_word(struct split * sp, size_t end) {
    sp->ends[sp->n_words++] = end;
}

static uint32_t ascii_lower(uint32_t c) {
    return c >= 'A' && c <= 'Z' ? c + 32 : c;
}

// Length of the contraction 's 't 're 've 'm 'll 'd starting at pos (an apostrophe), or 0.
// The llama3 regex matches them case-insensitively; only ASCII letters fold to these.
static size_t split_contraction(const struct split * sp, size_t pos, bool any_case) {
    uint32_t c1 = split_cpt(sp, pos + 1);
    uint32_t c2 = split_cpt(sp, pos + 2);
    if (any_case) {
        c1 = ascii_lower(c1);
        c2 = ascii_lower(c2);
    }
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
    if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return 3;
    return 0;
}

// The classes of ' ?\p{L}+', ' ?\p{N}+' and ' ?[^\s\p{L}\p{N}]+' (a unit's flags are never 0;
// 0 is "past the end", which is in none of them).
enum split_class { CLASS_NONE, CLASS_LETTER, CLASS_NUMBER, CLASS_OTHER };

static enum split_class split_class_of(uint32_t fl) {
    if (fl & UNICODE_LETTER) return CLASS_LETTER;
    if (fl & UNICODE_NUMBER) return CLASS_NUMBER;
    if (fl && !(fl & UNICODE_WHITESPACE)) return CLASS_OTHER;
    return CLASS_NONE;
}

static size_t split_run_end(const struct split * sp, size_t pos, enum split_class cls) {
    while (split_class_of(split_flags(sp, pos)) == cls) pos++;
    return pos;
}

// \s+(?!\S)|\s+ on the whitespace run starting at pos: a run followed by a character leaves
// its last space to that character's word.
static size_t split_whitespace_end(const struct split * sp, size_t pos) {
    size_t n = 1;
    while (split_flags(sp, pos + n) & UNICODE_WHITESPACE) {
        n++;
    }
    return pos + (n > 1 && pos + n < sp->end ? n - 1 : n);
}

static void split_gpt2(struct split * sp, size_t ini) {
    for (size_t pos = ini; pos < sp->end;) {
        const uint32_t cpt = sp->t->cpt[pos];
        if (cpt == '\'') {
            const size_t k = split_contraction(sp, pos, false);
            if (k) {
                pos += k;
                split_word(sp, pos);
                continue;
            }
        }
        // the class of the first character after an optional space picks the alternative
        const size_t first = pos + (cpt == ' ');
        const enum split_class cls = split_class_of(split_flags(sp, first));
        pos = cls != CLASS_NONE ? split_run_end(sp, first, cls) : split_whitespace_end(sp, pos);
        split_word(sp, pos);
    }
}

// The regexes of LLAMA3's family differ in a few places only.
struct split_rule {
    bool cased;         // letter words by case (TEKKEN, GPT4O) rather than [^\r\n\p{L}\p{N}]?\p{L}+
    bool contractions;  // (?i:'s|'t|'re|'ve|'m|'ll|'d): a word of its own, or (cased) a letter word's end
    size_t max_digits;  // \p{N}{1,max_digits}
    bool slash;         // punctuation runs take a trailing [\r\n/]* rather than [\r\n]*
};

static const struct split_rule RULE_LLAMA3 = {false, true, 3, false};
static const struct split_rule RULE_QWEN2 = {false, true, 1, false};
static const struct split_rule RULE_TEKKEN = {true, false, 1, true};
static const struct split_rule RULE_GPT4O = {true, true, 3, true};

// [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] and [\p{Ll}\p{Lm}\p{Lo}\p{M}]
static bool cased_upper(uint32_t fl) { return (fl & UNICODE_MARK) || ((fl & UNICODE_LETTER) && !(fl & UNICODE_LOWER)); }
static bool cased_lower(uint32_t fl) { return (fl & UNICODE_MARK) || ((fl & UNICODE_LETTER) && !(fl & UNICODE_UPPER)); }

static size_t split_lower_end(const struct split * sp, size_t pos) {
    while (cased_lower(split_flags(sp, pos))) pos++;
    return pos;
}

// upper*lower+ at s, as a backtracking engine matches it: the longest upper run, then lower
// letters; failing that, the run given back up to its last character that is also lower.
// Returns the end, or 0 for no match.
static size_t split_upper_lower(const struct split * sp, size_t s) {
    size_t e = s;
    while (cased_upper(split_flags(sp, e))) e++;
    if (cased_lower(split_flags(sp, e))) return split_lower_end(sp, e);
    for (size_t k = e; k > s; k--) {
        if (cased_lower(split_flags(sp, k - 1))) return k;
    }
    return 0;
}

// upper+lower* at s; 0 for no match.
static size_t split_upper_run(const struct split * sp, size_t s) {
    size_t e = s;
    while (cased_upper(split_flags(sp, e))) e++;
    return e > s ? split_lower_end(sp, e) : 0;
}

// The cased letter word at pos (both alternatives, each with and without the optional leading
// [^\r\n\p{L}\p{N}], in the order a backtracking engine tries them), or 0.
static size_t split_cased_word(const struct split * sp, size_t pos) {
    const uint32_t cpt = sp->t->cpt[pos], fl = sp->t->flags[pos];
    const bool lead = cpt != '\r' && cpt != '\n' && !(fl & (UNICODE_LETTER | UNICODE_NUMBER));
    size_t end = lead ? split_upper_lower(sp, pos + 1) : 0;
    if (!end) end = split_upper_lower(sp, pos);
    if (!end && lead) end = split_upper_run(sp, pos + 1);
    if (!end) end = split_upper_run(sp, pos);
    return end;
}

static void split_modern(struct split * sp, size_t ini, const struct split_rule * r) {
    for (size_t pos = ini; pos < sp->end;) {
        const uint32_t cpt = sp->t->cpt[pos];
        const uint32_t fl = sp->t->flags[pos];
        if (r->contractions && !r->cased && cpt == '\'') {
            const size_t k = split_contraction(sp, pos, true);
            if (k) {
                pos += k;
                split_word(sp, pos);
                continue;
            }
        }
        if (r->cased) {
            const size_t end = split_cased_word(sp, pos);
            if (end) {
                pos = end;
                if (r->contractions && split_cpt(sp, pos) == '\'') pos += split_contraction(sp, pos, true);
                split_word(sp, pos);
                continue;
            }
        } else {
            // [^\r\n\p{L}\p{N}]?\p{L}+
            const bool newline = cpt == '\r' || cpt == '\n';
            if (!newline && !(fl & UNICODE_NUMBER) &&
                ((fl & UNICODE_LETTER) || (split_flags(sp, pos + 1) & UNICODE_LETTER))) {
                pos++;
                while (split_flags(sp, pos) & UNICODE_LETTER) pos++;
                split_word(sp, pos);
                continue;
            }
        }
        // \p{N}{1,max_digits}
        if (fl & UNICODE_NUMBER) {
            const size_t ini_num = pos;
            while (pos - ini_num < r->max_digits && (split_flags(sp, pos) & UNICODE_NUMBER)) pos++;
            split_word(sp, pos);
            continue;
        }
        // ' ?[^\s\p{L}\p{N}]+[\r\n]*' (a lone space at the end of the stretch also lands here,
        // as in llama.cpp; \s+ would give the same word)
        const size_t first = pos + (cpt == ' ');
        const uint32_t fl2 = split_flags(sp, first);
        if (!(fl2 & (UNICODE_WHITESPACE | UNICODE_LETTER | UNICODE_NUMBER))) {
            pos = split_run_end(sp, first, CLASS_OTHER);
            for (uint32_t c = split_cpt(sp, pos); c == '\r' || c == '\n' || (r->slash && c == '/'); c = split_cpt(sp, pos)) {
                pos++;
            }
            split_word(sp, pos);
            continue;
        }
        // \s*[\r\n]+: the run up to its last newline
        size_t end_nl = 0;
        for (size_t p = pos; split_flags(sp, p) & UNICODE_WHITESPACE; ++p) {
            if (sp->t->cpt[p] == '\r' || sp->t->cpt[p] == '\n') end_nl = p + 1;
        }
        pos = end_nl ? end_nl : split_whitespace_end(sp, pos);
        split_word(sp, pos);
    }
}

size_t unicode_split_words(enum unicode_split kind, const struct unicode_text * t, size_t * ends) {
    struct split sp = {.t = t, .end = t->n, .ends = ends, .n_words = 0};
    switch (kind) {
        case UNICODE_SPLIT_GPT2:
            split_gpt2(&sp, 0);
            break;
        case UNICODE_SPLIT_LLAMA3:
            split_modern(&sp, 0, &RULE_LLAMA3);
            break;
        case UNICODE_SPLIT_QWEN2:
            split_modern(&sp, 0, &RULE_QWEN2);
            break;
        case UNICODE_SPLIT_TEKKEN:
            split_modern(&sp, 0, &RULE_TEKKEN);
            break;
        case UNICODE_SPLIT_GPT4O:
            split_modern(&sp, 0, &RULE_GPT4O);
            break;
        case UNICODE_SPLIT_DIGITS_GPT2: {
            size_t ini = 0;
            for (size_t pos = 0; pos < t->n; ++pos) {
                if (t->flags[pos] & UNICODE_NUMBER) {
                    sp.end = pos;
                    split_gpt2(&sp, ini);
                    split_word(&sp, pos + 1);
                    ini = pos + 1;
                }
            }
            sp.end = t->n;
            split_gpt2(&sp, ini);
            break;
        }
    }
    return sp.n_words;
}
