// Tokenizing, with llama.cpp's semantics (src/llama-vocab.cpp):
//  * special tokens first: the text is cut at every occurrence of a control, user-defined or
//    unknown token's text, longest token first; control and unknown tokens only when
//    parse_special is set, user-defined ones always (as llama.cpp and HF tokenizers do); a
//    token marked rstrip (Phi-3's) takes the ASCII whitespace that follows it;
//  * gpt2: each stretch of text is split into words by the pre-tokenizer regex, each word's
//    bytes become GPT-2 byte-level characters and are merged pair by pair, lowest merge rank
//    first (ties: leftmost);
//  * llama: spaces become U+2581 (plus one leading, after the start and after every special
//    token, when add_space_prefix), the characters are merged pair by pair into the vocabulary
//    token of highest score (ties: leftmost), and what is left unmerged and unknown falls back
//    to <0xXX> byte tokens.
// Invalid UTF-8 is never rejected: every invalid byte is a unit of its own that the regexes
// class as U+FFFD (as llama.cpp, which replaces it by U+FFFD), but it becomes its own byte
// token, so the text comes back byte for byte. Only a byte the vocabulary has no token for
// (SmolLM2 lacks 0xC0, 0xC1, 0xF5..0xFF) is read as U+FFFD, like llama.cpp does.
#include "vocab-tokenize.h"

#include "vocab-impl.h"

#include "status.h"

#include <stdlib.h>
#include <string.h>

// A run of bytes being merged: bytes of a word (gpt2) or characters of the text (llama).
struct symbol {
    int32_t prev, next;
    uint32_t off, len;  // len 0: merged into its left neighbour
    innerq_token id;    // the token it is, or -1
};

// A candidate merge of two neighbours.
struct bigram {
    double prio;       // higher first: minus the merge rank (gpt2), the merged token's score (llama)
    int32_t left, right;
    uint32_t len;      // left.len + right.len when found; different later if either has changed
    innerq_token id;   // the merged token
};

struct fragment {
    size_t off, len;     // text, if token < 0
    innerq_token token;  // a special token split out
};

// Buffers of one tokenize call.
struct session {
    const struct innerq_vocab * v;
    innerq_token * out;
    size_t n_out, cap_out;
    struct unicode_text text;
    size_t * ends;
    size_t cap_ends;
    struct symbol * sym;
    size_t cap_sym;
    struct bigram * heap;
    size_t n_heap, cap_heap;
    char * buf;  // llama: the escaped text; gpt2: a word's byte-level characters
    size_t cap_buf;
    struct fragment * frag[2];
    size_t n_frag[2], cap_frag[2];
    bool oom;
};

static void session_push(struct session * s, innerq_token id) {
    if (s->n_out == s->cap_out && !vocab_grow(&s->out, &s->cap_out, s->n_out + 1, sizeof(innerq_token))) {
        s->oom = true;
        return;
    }
    s->out[s->n_out++] = id;
}

static bool bigram_before(const struct bigram * a, const struct bigram * b) {
    return a->prio > b->prio || (a->prio == b->prio && a->left < b->left);
}

static void heap_push(struct session * s, const struct bigram * b) {
    if (!vocab_grow(&s->heap, &s->cap_heap, s->n_heap + 1, sizeof(struct bigram))) {
        s->oom = true;
        return;
    }
    size_t i = s->n_heap++;
    while (i > 0 && bigram_before(b, &s->heap[(i - 1) / 2])) {
        s->heap[i] = s->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    s->heap[i] = *b;
}

static struct bigram heap_pop(struct session * s) {
    const struct bigram top = s->heap[0];
    const struct bigram last = s->heap[--s->n_heap];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= s->n_heap) break;
        if (c + 1 < s->n_heap && bigram_before(&s->heap[c + 1], &s->heap[c])) c++;
        if (!bigram_before(&s->heap[c], &last)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (s->n_heap > 0) s->heap[i] = last;
    return top;
}

// Queues the merge of neighbours l and r if the vocabulary has one.
static void pair_try(struct session * s, const char * text, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const struct innerq_vocab * v = s->v;
    const struct symbol * L = &s->sym[l], * R = &s->sym[r];
    struct bigram b = {.left = l, .right = r, .len = L->len + R->len};
    if (v->kind == VOCAB_BPE) {
        if (L->id < 0 || R->id < 0) return;
        const struct merge_entry * e = vocab_merge_find(v, L->id, R->id);
        if (!e) return;
        b.prio = -(double) e->rank;
        b.id = e->result;
    } else {
        b.id = vocab_text_find(v, text + L->off, b.len);
        if (b.id < 0) return;
        b.prio = v->score[b.id];
    }
    heap_push(s, &b);
}

// Merges the n symbols of text (linked in order) best pair first until no pair merges.
static void symbols_merge(struct session * s, const char * text, int32_t n) {
    s->n_heap = 0;
    for (int32_t i = 1; i < n; i++) pair_try(s, text, i - 1, i);
    while (s->n_heap > 0) {
        const struct bigram b = heap_pop(s);
        struct symbol * L = &s->sym[b.left], * R = &s->sym[b.right];
        if (L->len == 0 || R->len == 0 || L->len + R->len != b.len) continue;  // stale
        L->len += R->len;
        L->id = b.id;
        R->len = 0;
        L->next = R->next;
        if (R->next >= 0) s->sym[R->next].prev = b.left;
        pair_try(s, text, L->prev, b.left);
        pair_try(s, text, b.left, L->next);
    }
}

// One word: units [ua, ub) of the decoded fragment text. An invalid byte is its own byte-level
// character; one the vocabulary has no token for (e.g. 0xFF) counts as U+FFFD, as llama.cpp
// reads every invalid byte.
static void bpe_word(struct session * s, const char * text, size_t ua, size_t ub) {
    const struct innerq_vocab * v = s->v;
    const size_t n_max = 3 * (s->text.off[ub] - s->text.off[ua]);  // every byte could become U+FFFD
    if (n_max > INT32_MAX || !vocab_grow(&s->buf, &s->cap_buf, 3 * n_max, 1) ||
        !vocab_grow(&s->sym, &s->cap_sym, n_max, sizeof(struct symbol))) {
        s->oom = true;
        return;
    }
    char * w = s->buf;  // the word's bytes, then (ignore_merges) their byte-level characters
    size_t n = 0;
    for (size_t u = ua; u < ub; u++) {
        const size_t off = s->text.off[u], len = s->text.off[u + 1] - off;
        const bool lost = len == 1 && s->text.cpt[u] == UNICODE_REPLACEMENT && v->byte_token[(uint8_t) text[off]] < 0;
        memcpy(w + n, lost ? "\xEF\xBF\xBD" : text + off, lost ? 3 : len);
        n += lost ? 3 : len;
    }
    if (v->ignore_merges) {
        char * chars = w + n;
        size_t len = 0;
        for (size_t i = 0; i < n; i++) len += unicode_utf8_encode(vocab_gpt2_byte_cpt((uint8_t) w[i]), chars + len);
        const innerq_token id = vocab_text_find(v, chars, len);
        if (id >= 0) {
            session_push(s, id);
            return;
        }
    }
    for (size_t i = 0; i < n; i++) {
        s->sym[i] = (struct symbol){(int32_t) i - 1, i + 1 < n ? (int32_t) i + 1 : -1, (uint32_t) i, 1,
                                    v->byte_token[(uint8_t) w[i]]};
    }
    symbols_merge(s, w, (int32_t) n);
    // a byte whose character is not in the vocabulary is dropped, as llama.cpp drops it
    for (int32_t i = 0; i >= 0; i = s->sym[i].next) {
        if (s->sym[i].id >= 0) session_push(s, s->sym[i].id);
    }
}

static void bpe_fragment(struct session * s, const char * text, size_t n) {
    if (!unicode_text_decode(&s->text, text, n) || !vocab_grow(&s->ends, &s->cap_ends, s->text.n, sizeof(size_t))) {
        s->oom = true;
        return;
    }
    const size_t n_words = unicode_split_words(s->v->split, &s->text, s->ends);
    size_t start = 0;
    for (size_t w = 0; w < n_words && !s->oom; w++) {
        bpe_word(s, text, start, s->ends[w]);
        start = s->ends[w];
    }
}

static void spm_fragment(struct session * s, const char * text, size_t n, bool space_prefix) {
    const struct innerq_vocab * v = s->v;
    static const char ESCAPED_SPACE[3] = {'\xE2', '\x96', '\x81'};  // U+2581
    size_t n_spaces = 0;
    for (size_t i = 0; i < n; i++) n_spaces += text[i] == ' ';
    const size_t len = 3 * space_prefix + n + 2 * n_spaces;
    if (len > INT32_MAX || !vocab_grow(&s->buf, &s->cap_buf, len, 1) ||
        !vocab_grow(&s->sym, &s->cap_sym, len, sizeof(struct symbol))) {
        s->oom = true;
        return;
    }
    char * e = s->buf;
    if (space_prefix) {
        memcpy(e, ESCAPED_SPACE, 3);
        e += 3;
    }
    for (size_t i = 0; i < n; i++) {
        if (text[i] == ' ') {
            memcpy(e, ESCAPED_SPACE, 3);
            e += 3;
        } else {
            *e++ = text[i];
        }
    }
    int32_t n_sym = 0;
    for (size_t off = 0; off < len; n_sym++) {
        uint32_t cpt;
        const size_t k = unicode_utf8_decode(s->buf + off, len - off, &cpt);
        s->sym[n_sym] = (struct symbol){n_sym - 1, off + k < len ? n_sym + 1 : -1, (uint32_t) off, (uint32_t) k,
                                        vocab_text_find(v, s->buf + off, k)};
        off += k;
    }
    if (n_sym == 0) return;
    symbols_merge(s, s->buf, n_sym);
    for (int32_t i = 0; i >= 0; i = s->sym[i].next) {
        const struct symbol * sym = &s->sym[i];
        if (sym->id >= 0) {
            session_push(s, sym->id);
            continue;
        }
        // a character the vocabulary lacks: its bytes
        for (uint32_t j = 0; j < sym->len; j++) {
            const innerq_token b = v->byte_token[(uint8_t) s->buf[sym->off + j]];
            if (b >= 0 || v->unk >= 0) session_push(s, b >= 0 ? b : v->unk);
        }
    }
}

static const char * find_bytes(const char * hay, size_t n, const char * needle, size_t m) {
    if (m > n) return NULL;
    const char * last = hay + (n - m);
    for (const char * p = hay; p <= last; p++) {
        p = memchr(p, needle[0], (size_t) (last - p) + 1);
        if (!p) return NULL;
        if (memcmp(p, needle, m) == 0) return p;
    }
    return NULL;
}

// C's isspace in the C locale, as llama.cpp strips around special tokens.
static bool ascii_space(char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

static void fragment_add(struct session * s, int k, size_t off, size_t len, innerq_token token) {
    if (!vocab_grow(&s->frag[k], &s->cap_frag[k], s->n_frag[k] + 1, sizeof(struct fragment))) {
        s->oom = true;
        return;
    }
    s->frag[k][s->n_frag[k]++] = (struct fragment){off, len, token};
}

// Cuts the text at the special tokens, longest token first (llama.cpp's order); returns the
// index of the fragment list that holds the result.
static int fragments_split(struct session * s, const char * text, size_t n, bool parse_special) {
    const struct innerq_vocab * v = s->v;
    int cur = 0;
    s->n_frag[0] = 0;
    if (n > 0) fragment_add(s, 0, 0, n, -1);
    for (int32_t k = 0; k < v->n_special && !s->oom; k++) {
        const innerq_token id = v->special[k];
        if (!parse_special && !(v->attr[id] & TOKEN_USER_DEFINED)) continue;
        size_t len;
        const char * t = vocab_token_text(v, id, &len);
        const int next = 1 - cur;
        s->n_frag[next] = 0;
        for (size_t i = 0; i < s->n_frag[cur]; i++) {
            const struct fragment f = s->frag[cur][i];
            size_t pos = f.off;
            const char * m;
            while (f.token < 0 && (m = find_bytes(text + pos, f.off + f.len - pos, t, len)) != NULL) {
                const size_t at = (size_t) (m - text);
                if (at > pos) fragment_add(s, next, pos, at - pos, -1);
                fragment_add(s, next, at, len, id);
                pos = at + len;
                while ((v->attr[id] & TOKEN_RSTRIP) && pos < f.off + f.len && ascii_space(text[pos])) pos++;
            }
            if (f.token >= 0) {
                fragment_add(s, next, f.off, f.len, f.token);
            } else if (pos < f.off + f.len) {
                fragment_add(s, next, pos, f.off + f.len - pos, -1);
            }
        }
        cur = next;
    }
    return cur;
}

innerq_status vocab_tokenize(const struct innerq_vocab * v, const char * text, int32_t text_len, bool add_special,
                             bool parse_special, innerq_token * tokens, int32_t n_tokens_max, int32_t * n_tokens) {
    if (!v || !n_tokens || text_len < 0 || (!text && text_len > 0) || n_tokens_max < 0 ||
        (!tokens && n_tokens_max > 0)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "tokenize: NULL argument or negative length");
    }
    struct session s = {.v = v};
    const int k = fragments_split(&s, text, (size_t) text_len, parse_special);
    if (add_special && v->add_bos) session_push(&s, v->bos);
    bool prev_special = true;
    for (size_t i = 0; i < s.n_frag[k] && !s.oom; i++) {
        const struct fragment * f = &s.frag[k][i];
        if (f->token >= 0) {
            session_push(&s, f->token);
        } else if (v->kind == VOCAB_SPM) {
            spm_fragment(&s, text + f->off, f->len, v->add_space_prefix && prev_special);
        } else {
            bpe_fragment(&s, text + f->off, f->len);
        }
        prev_special = f->token >= 0;
    }
    if (add_special && v->add_eos) session_push(&s, v->eos);

    innerq_status st = INNERQ_OK;
    if (s.oom) {
        st = innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory tokenizing %d bytes", text_len);
    } else if (s.n_out > INT32_MAX) {
        st = innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "the text makes more than %d tokens", INT32_MAX);
    } else {
        *n_tokens = (int32_t) s.n_out;
        if (s.n_out > (size_t) n_tokens_max) {
            st = innerq_fail(INNERQ_ERR_BUFFER_TOO_SMALL, "the text makes %zu tokens, the buffer holds %d", s.n_out,
                             n_tokens_max);
        } else if (s.n_out > 0) {
            memcpy(tokens, s.out, s.n_out * sizeof(innerq_token));
        }
    }
    free(s.out);
    unicode_text_free(&s.text);
    free(s.ends);
    free(s.sym);
    free(s.heap);
    free(s.buf);
    free(s.frag[0]);
    free(s.frag[1]);
    return st;
}

