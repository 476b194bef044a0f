// Vocabularies from GGUF metadata (tokenizer.ggml.*), the bytes of each token, and
// detokenizing. Loading checks the metadata (array lengths, ids in range, merges made of
// tokens) so that tokenizing never meets an inconsistent vocabulary. Tokenizing itself is in
// vocab-tokenize.c.
#include "vocab-impl.h"

#include "status.h"

#include <stdlib.h>
#include <string.h>

// ---- hashing ----

static uint64_t hash_bytes(const char * s, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
    for (size_t i = 0; i < n; i++) {
        h = (h ^ (uint8_t) s[i]) * 0x100000001b3ull;
    }
    return h;
}

static size_t table_size(size_t n) {
    size_t size = 16;
    while (size < 2 * n) size *= 2;
    return size;
}

innerq_token vocab_text_find(const struct innerq_vocab * v, const char * s, size_t n) {
    for (size_t i = hash_bytes(s, n) & v->by_text.mask;; i = (i + 1) & v->by_text.mask) {
        const int32_t id = v->by_text.slots[i];
        if (id < 0) return -1;
        size_t len;
        const char * t = vocab_token_text(v, id, &len);
        if (len == n && memcmp(t, s, n) == 0) return id;
    }
}

static uint64_t merge_key(innerq_token left, innerq_token right) {
    return ((uint64_t) (uint32_t) left << 32) | (uint32_t) right;
}

static struct merge_entry * merge_slot(const struct merge_map * m, uint64_t key) {
    for (size_t i = (key * 0x9E3779B97F4A7C15ull >> 20) & m->mask;; i = (i + 1) & m->mask) {
        if (m->slots[i].key == key || m->slots[i].key == MERGE_EMPTY) return &m->slots[i];
    }
}

const struct merge_entry * vocab_merge_find(const struct innerq_vocab * v, innerq_token left, innerq_token right) {
    const struct merge_entry * e = merge_slot(&v->merges, merge_key(left, right));
    return e->key == MERGE_EMPTY ? NULL : e;
}

bool vocab_grow(void * ptr, size_t * cap, size_t need, size_t elem) {
    if (need <= *cap) return true;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void * p = realloc(*(void **) ptr, c * elem);
    if (!p) return false;
    *(void **) ptr = p;
    *cap = c;
    return true;
}

// ---- loading ----

uint32_t vocab_gpt2_byte_cpt(uint8_t b) {
    // the unprintable bytes in order: 0x00..0x20, 0x7F..0xA0, 0xAD
    if (b <= 0x20) return 0x100 + b;
    if (b >= 0x7F && b <= 0xA0) return 0x121 + (b - 0x7F);
    if (b == 0xAD) return 0x143;
    return b;
}

static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

// The byte of a "<0xXX>" token, or -1.
static int byte_token_value(const char * s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    const int hi = hex_digit(s[3]), lo = hex_digit(s[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

static const char * const EOG_TEXTS[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "<|eom_id|>",
};

struct pre_type {
    const char * name;
    enum unicode_split split;
    bool ignore_merges;
    bool add_bos;
};

// tokenizer.ggml.pre names, grouped as llama.cpp groups them (src/llama-vocab.cpp); only names
// whose whole rule is served here. A gpt2 vocabulary without the key (files converted before it
// existed) gets the GPT-2 regex.
static const struct pre_type PRE_TYPES[] = {
    {"gpt-2", UNICODE_SPLIT_GPT2, false, false},          {"phi-2", UNICODE_SPLIT_GPT2, false, false},
    {"mpt", UNICODE_SPLIT_GPT2, false, false},            {"olmo", UNICODE_SPLIT_GPT2, false, false},
    {"jais", UNICODE_SPLIT_GPT2, false, false},           {"trillion", UNICODE_SPLIT_GPT2, false, false},
    {"granite-docling", UNICODE_SPLIT_GPT2, false, false}, {"gigachat", UNICODE_SPLIT_GPT2, false, false},
    {"a.x-4.0", UNICODE_SPLIT_GPT2, false, false},        {"mellum", UNICODE_SPLIT_GPT2, false, false},
    {"exaone4", UNICODE_SPLIT_GPT2, false, false},        {"jina-es", UNICODE_SPLIT_GPT2, false, false},
    {"jina-de", UNICODE_SPLIT_GPT2, false, false},        {"jina-v2-es", UNICODE_SPLIT_GPT2, false, false},
    {"jina-v2-de", UNICODE_SPLIT_GPT2, false, false},
    {"llama3", UNICODE_SPLIT_LLAMA3, true, true},         {"llama-v3", UNICODE_SPLIT_LLAMA3, true, true},
    {"llama-bpe", UNICODE_SPLIT_LLAMA3, true, true},      {"falcon3", UNICODE_SPLIT_LLAMA3, true, true},
    {"falcon-h1", UNICODE_SPLIT_LLAMA3, true, true},      {"pixtral", UNICODE_SPLIT_LLAMA3, true, true},
    {"midm-2.0", UNICODE_SPLIT_LLAMA3, true, true},       {"lfm2", UNICODE_SPLIT_LLAMA3, true, true},
    {"dbrx", UNICODE_SPLIT_LLAMA3, false, false},         {"smaug-bpe", UNICODE_SPLIT_LLAMA3, false, false},
    {"smollm", UNICODE_SPLIT_DIGITS_GPT2, false, false},  {"starcoder", UNICODE_SPLIT_DIGITS_GPT2, false, false},
    {"refact", UNICODE_SPLIT_DIGITS_GPT2, false, false},  {"command-r", UNICODE_SPLIT_DIGITS_GPT2, false, false},
    {"codeshell", UNICODE_SPLIT_DIGITS_GPT2, false, false}, {"exaone", UNICODE_SPLIT_DIGITS_GPT2, false, false},
    {"minerva-7b", UNICODE_SPLIT_DIGITS_GPT2, false, false},
    {"qwen2", UNICODE_SPLIT_QWEN2, false, false},         {"deepseek-r1-qwen", UNICODE_SPLIT_QWEN2, false, false},
    {"megrez", UNICODE_SPLIT_QWEN2, false, false},        {"stablelm2", UNICODE_SPLIT_QWEN2, false, false},
    {"hunyuan", UNICODE_SPLIT_QWEN2, false, false},       {"kormo", UNICODE_SPLIT_QWEN2, false, false},
    {"f2llmv2", UNICODE_SPLIT_QWEN2, false, false},       {"solar-open", UNICODE_SPLIT_QWEN2, false, false},
    {"grok-2", UNICODE_SPLIT_QWEN2, false, false},
    {"tekken", UNICODE_SPLIT_TEKKEN, true, true},
    {"gpt-4o", UNICODE_SPLIT_GPT4O, false, false},        {"llama4", UNICODE_SPLIT_GPT4O, false, false},
    {"kanana2", UNICODE_SPLIT_GPT4O, false, false},       {"minimax-m2", UNICODE_SPLIT_GPT4O, false, false},
};

// The escape hatch for a pre-tokenizer innerq does not know: INNERQ_PRE_TOKENIZER names the
// one to use instead of the file's (docs/DESIGN.md section 2).
#define PRE_TOKENIZER_ENV "INNERQ_PRE_TOKENIZER"

static bool str_is(const struct gguf_str * s, const char * lit) {
    return s->n == strlen(lit) && memcmp(s->data, lit, s->n) == 0;
}

static const struct pre_type * pre_type_find(const char * name, size_t n) {
    for (size_t i = 0; i < sizeof(PRE_TYPES) / sizeof(PRE_TYPES[0]); i++) {
        if (strlen(PRE_TYPES[i].name) == n && memcmp(PRE_TYPES[i].name, name, n) == 0) return &PRE_TYPES[i];
    }
    return NULL;
}

// The pre-tokenizer of a gpt2 vocabulary: INNERQ_PRE_TOKENIZER's, else the file's, else GPT-2's.
static innerq_status pre_type_of(const struct gguf_file * f, struct pre_type * out) {
    static const struct pre_type GPT2 = {"gpt-2", UNICODE_SPLIT_GPT2, false, false};
    const char * env = getenv(PRE_TOKENIZER_ENV);
    if (env != NULL && env[0] != '\0') {
        const struct pre_type * pt = pre_type_find(env, strlen(env));
        if (pt == NULL) {
            return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "%s=%.64s names no pre-tokenizer innerq knows",
                               PRE_TOKENIZER_ENV, env);
        }
        *out = *pt;
        return INNERQ_OK;
    }
    innerq_status st = INNERQ_OK;
    struct gguf_str pre;
    if (!gguf_get_str(f, "tokenizer.ggml.pre", &pre, &st)) {
        *out = GPT2;
        return st;
    }
    const struct pre_type * pt = pre_type_find(pre.data, pre.n);
    if (pt == NULL) {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED,
                           "pre-tokenizer '%.*s' (tokenizer.ggml.pre) is not supported; %s=NAME tokenizes with a "
                           "known one's rule instead (e.g. gpt-2), which may split text unlike the model's own",
                           (int) (pre.n > 64 ? 64 : pre.n), pre.data, PRE_TOKENIZER_ENV);
    }
    *out = *pt;
    return INNERQ_OK;
}

static innerq_status load_model_kind(const struct gguf_file * f, struct innerq_vocab * v) {
    innerq_status st = INNERQ_OK;
    struct gguf_str model;
    if (!gguf_get_str(f, "tokenizer.ggml.model", &model, &st)) {
        if (st != INNERQ_OK) return st;
        return innerq_fail(INNERQ_ERR_FORMAT, "the file has no tokenizer (tokenizer.ggml.model)");
    }
    if (str_is(&model, "gpt2")) {
        struct pre_type pt;
        st = pre_type_of(f, &pt);
        if (st != INNERQ_OK) return st;
        v->kind = VOCAB_BPE;
        v->split = pt.split;
        v->ignore_merges = pt.ignore_merges;
        v->add_bos = pt.add_bos;
        v->bos = v->eos = v->unk = -1;
    } else if (str_is(&model, "llama")) {
        v->kind = VOCAB_SPM;
        v->add_bos = true;
        v->add_space_prefix = true;
        // SentencePiece's defaults
        v->unk = 0;
        v->bos = 1;
        v->eos = 2;
    } else {
        return innerq_fail(INNERQ_ERR_UNSUPPORTED, "tokenizer model '%.*s' is not supported (gpt2 and llama are)",
                           (int) (model.n > 64 ? 64 : model.n), model.data);
    }
    return INNERQ_OK;
}

static innerq_status load_tokens(const struct gguf_file * f, struct innerq_vocab * v) {
    innerq_status st = INNERQ_OK;
    const struct gguf_kv * tokens = gguf_get_arr(f, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, &st);
    if (!tokens) {
        if (st != INNERQ_OK) return st;
        return innerq_fail(INNERQ_ERR_FORMAT, "the tokenizer has no tokens (tokenizer.ggml.tokens)");
    }
    if (tokens->arr_n == 0 || tokens->arr_n > INT32_MAX) {
        return innerq_fail(INNERQ_ERR_FORMAT,
                           "tokenizer.ggml.tokens has %llu entries", (unsigned long long) tokens->arr_n);
    }
    const int32_t n = (int32_t) tokens->arr_n;
    uint64_t total = 0;
    for (int32_t i = 0; i < n; i++) total += tokens->arr_str[i].n;
    if (total > UINT32_MAX / 4) {
        return innerq_fail(INNERQ_ERR_FORMAT,
                           "tokenizer.ggml.tokens holds %llu bytes of text", (unsigned long long) total);
    }
    v->n_tokens = n;
    v->text = malloc(total + 1);
    v->text_off = malloc((n + 1) * sizeof(uint32_t));
    v->attr = malloc(n);
    v->score = calloc(n, sizeof(float));
    v->by_text.mask = table_size(n) - 1;
    v->by_text.slots = malloc((v->by_text.mask + 1) * sizeof(int32_t));
    if (!v->text || !v->text_off || !v->attr || !v->score || !v->by_text.slots) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory for a vocabulary of %d tokens", n);
    }
    memset(v->by_text.slots, 0xFF, (v->by_text.mask + 1) * sizeof(int32_t));
    uint32_t off = 0;
    for (int32_t i = 0; i < n; i++) {
        const struct gguf_str * s = &tokens->arr_str[i];
        v->text_off[i] = off;
        memcpy(v->text + off, s->data, s->n);
        off += (uint32_t) s->n;
        v->attr[i] = TOKEN_NORMAL;
        if (s->n == 0) continue;  // an empty token can't be matched; it detokenizes to nothing
        for (size_t j = hash_bytes(s->data, s->n) & v->by_text.mask;; j = (j + 1) & v->by_text.mask) {
            const int32_t other = v->by_text.slots[j];
            if (other < 0) {
                v->by_text.slots[j] = i;
                break;
            }
            size_t len;
            const char * t = vocab_token_text(v, other, &len);
            if (len == s->n && memcmp(t, s->data, len) == 0) {
                return innerq_fail(INNERQ_ERR_FORMAT, "token %d ('%.*s') repeats token %d", i,
                                   (int) (len > 64 ? 64 : len), t, other);
            }
        }
    }
    v->text_off[n] = off;
    return INNERQ_OK;
}

// A numeric array of exactly n_tokens entries, or NULL if absent (*st says if it was wrong).
static const struct gguf_kv * load_token_array(const struct gguf_file * f, const char * key, int32_t n_tokens,
                                               bool allow_float, innerq_status * st) {
    const struct gguf_kv * kv = gguf_find_kv(f, key);
    if (!kv) return NULL;
    const bool ok_type = kv->type == GGUF_TYPE_ARRAY &&
                         (kv->arr_type == GGUF_TYPE_INT32 || (allow_float && kv->arr_type == GGUF_TYPE_FLOAT32));
    if (!ok_type) {
        *st = innerq_fail(INNERQ_ERR_FORMAT, "%s is not an array of %s", key, allow_float ? "float32" : "int32");
        return NULL;
    }
    if (kv->arr_n != (uint64_t) n_tokens) {
        *st = innerq_fail(INNERQ_ERR_FORMAT, "%s has %llu entries but there are %d tokens", key,
                          (unsigned long long) kv->arr_n, n_tokens);
        return NULL;
    }
    return kv;
}

static innerq_status load_types_and_scores(const struct gguf_file * f, struct innerq_vocab * v) {
    static const uint8_t type_attr[7] = {0, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED,
                                         TOKEN_UNUSED, TOKEN_BYTE};
    innerq_status st = INNERQ_OK;
    const struct gguf_kv * types = load_token_array(f, "tokenizer.ggml.token_type", v->n_tokens, false, &st);
    if (st != INNERQ_OK) return st;
    const struct gguf_kv * scores = load_token_array(f, "tokenizer.ggml.scores", v->n_tokens, true, &st);
    if (st != INNERQ_OK) return st;
    for (int32_t i = 0; i < v->n_tokens; i++) {
        if (types) {
            int32_t t;
            memcpy(&t, (const char *) types->arr_data + 4 * (size_t) i, 4);
            v->attr[i] = t >= 0 && t <= 6 ? type_attr[t] : 0;  // undefined types render as nothing
        }
        if (scores) {
            const char * p = (const char *) scores->arr_data + 4 * (size_t) i;
            if (scores->arr_type == GGUF_TYPE_FLOAT32) {
                memcpy(&v->score[i], p, 4);
            } else {
                int32_t s;
                memcpy(&s, p, 4);
                v->score[i] = (float) s;
            }
        }
        if (v->attr[i] & TOKEN_BYTE) {
            size_t len;
            const char * t = vocab_token_text(v, i, &len);
            if (byte_token_value(t, len) < 0) {
                return innerq_fail(INNERQ_ERR_FORMAT, "token %d has type byte but its text '%.*s' is not <0xXX>", i,
                                   (int) (len > 64 ? 64 : len), t);
            }
        }
    }
    return INNERQ_OK;
}

static innerq_status load_merges(const struct gguf_file * f, struct innerq_vocab * v) {
    innerq_status st = INNERQ_OK;
    const struct gguf_kv * merges = gguf_get_arr(f, "tokenizer.ggml.merges", GGUF_TYPE_STRING, &st);
    if (!merges) {
        return st != INNERQ_OK ? st : innerq_fail(INNERQ_ERR_FORMAT, "a gpt2 tokenizer needs tokenizer.ggml.merges");
    }
    if (merges->arr_n > INT32_MAX) {
        return innerq_fail(INNERQ_ERR_FORMAT,
                           "tokenizer.ggml.merges has %llu entries", (unsigned long long) merges->arr_n);
    }
    v->merges.mask = table_size(merges->arr_n) - 1;
    v->merges.slots = malloc((v->merges.mask + 1) * sizeof(struct merge_entry));
    size_t max_len = 0;
    for (uint64_t i = 0; i < merges->arr_n; i++) {
        if (merges->arr_str[i].n > max_len) max_len = merges->arr_str[i].n;
    }
    char * joined = malloc(max_len + 1);
    if (!v->merges.slots || !joined) {
        free(joined);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY,
                           "out of memory for %llu merges", (unsigned long long) merges->arr_n);
    }
    for (size_t i = 0; i <= v->merges.mask; i++) v->merges.slots[i].key = MERGE_EMPTY;

    for (uint64_t i = 0; i < merges->arr_n && st == INNERQ_OK; i++) {
        const struct gguf_str * m = &merges->arr_str[i];
        const int shown = (int) (m->n > 64 ? 64 : m->n);
        // the first space after the first byte separates the two (a token may be " ")
        const char * sp = m->n > 1 ? memchr(m->data + 1, ' ', m->n - 1) : NULL;
        if (!sp) {
            st = innerq_fail(INNERQ_ERR_FORMAT, "merge %llu ('%.*s') is not two tokens separated by a space",
                             (unsigned long long) i, shown, m->data);
            break;
        }
        const size_t nl = (size_t) (sp - m->data), nr = m->n - nl - 1;
        const innerq_token left = vocab_text_find(v, m->data, nl);
        const innerq_token right = vocab_text_find(v, sp + 1, nr);
        memcpy(joined, m->data, nl);
        memcpy(joined + nl, sp + 1, nr);
        const innerq_token result = vocab_text_find(v, joined, nl + nr);
        if (left < 0 || right < 0 || result < 0) {
            const char * what = left < 0 ? "its left side is not a token"
                              : right < 0 ? "its right side is not a token" : "the merged text is not a token";
            st = innerq_fail(INNERQ_ERR_FORMAT,
                             "merge %llu ('%.*s'): %s", (unsigned long long) i, shown, m->data, what);
            break;
        }
        struct merge_entry * e = merge_slot(&v->merges, merge_key(left, right));
        if (e->key == MERGE_EMPTY) {  // a repeated pair keeps its first (best) rank
            *e = (struct merge_entry){merge_key(left, right), (int32_t) i, result};
        }
    }
    free(joined);
    return st;
}

static innerq_status load_special_ids(const struct gguf_file * f, struct innerq_vocab * v) {
    const struct {
        const char * key;
        innerq_token * id;  // where it is kept, or NULL
        bool eog;           // it ends generation
    } keys[] = {
        {"tokenizer.ggml.bos_token_id", &v->bos, false},     {"tokenizer.ggml.eos_token_id", &v->eos, true},
        {"tokenizer.ggml.unknown_token_id", &v->unk, false}, {"tokenizer.ggml.padding_token_id", NULL, false},
        {"tokenizer.ggml.eot_token_id", NULL, true},         {"tokenizer.ggml.eom_token_id", NULL, true},
    };
    innerq_status st = INNERQ_OK;
    for (size_t k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
        if (keys[k].id && *keys[k].id >= v->n_tokens) *keys[k].id = -1;  // a default the vocabulary lacks
        uint32_t id;
        if (!gguf_get_u32(f, keys[k].key, &id, &st)) {
            if (st != INNERQ_OK) return st;
            continue;
        }
        if (id >= (uint32_t) v->n_tokens) {
            return innerq_fail(INNERQ_ERR_FORMAT, "%s = %u is outside the vocabulary (%d tokens)", keys[k].key, id,
                               v->n_tokens);
        }
        if (keys[k].id) *keys[k].id = (innerq_token) id;
        if (keys[k].eog) v->attr[id] |= TOKEN_EOG;
    }
    if (v->eos >= 0) v->attr[v->eos] |= TOKEN_EOG;  // also a default EOS
    // end-of-turn tokens known by their text, made control tokens (llama.cpp does the same)
    for (size_t k = 0; k < sizeof(EOG_TEXTS) / sizeof(EOG_TEXTS[0]); k++) {
        const innerq_token id = vocab_text_find(v, EOG_TEXTS[k], strlen(EOG_TEXTS[k]));
        if (id >= 0) v->attr[id] |= TOKEN_EOG | TOKEN_CONTROL;
    }
    const struct {
        const char * key;
        bool * flag;
    } flags[] = {
        {"tokenizer.ggml.add_bos_token", &v->add_bos},
        {"tokenizer.ggml.add_eos_token", &v->add_eos},
        {"tokenizer.ggml.add_space_prefix", &v->add_space_prefix},
    };
    for (size_t k = 0; k < sizeof(flags) / sizeof(flags[0]); k++) {
        if (!gguf_get_bool(f, flags[k].key, flags[k].flag, &st) && st != INNERQ_OK) return st;
    }
    if (v->kind == VOCAB_BPE) v->add_space_prefix = false;  // only SentencePiece adds one
    if (v->add_bos && v->bos < 0) {
        return innerq_fail(INNERQ_ERR_FORMAT, "add_bos_token is set but there is no BOS token");
    }
    if (v->add_eos && v->eos < 0) {
        return innerq_fail(INNERQ_ERR_FORMAT, "add_eos_token is set but there is no EOS token");
    }
    return INNERQ_OK;
}

static bool contains_ascii_ci(const struct gguf_str * s, const char * lit) {
    const size_t n = strlen(lit);
    for (size_t i = 0; i + n <= s->n; i++) {
        size_t k = 0;
        while (k < n && (s->data[i + k] | 0x20) == lit[k]) k++;
        if (k == n) return true;
    }
    return false;
}

static void set_attr(struct innerq_vocab * v, const char * text, uint8_t attr, bool on) {
    const innerq_token id = vocab_text_find(v, text, strlen(text));
    if (id >= 0) v->attr[id] = on ? v->attr[id] | attr : v->attr[id] & ~attr;
}

// Token attributes GGUF files don't carry, which llama.cpp sets by the model's name: Phi-3's
// special tokens (but <unk>, <s> and <|endoftext|>) take the whitespace after them, as the rstrip
// of its tokenizer.json's added tokens says.
static innerq_status load_strip_attrs(const struct gguf_file * f, struct innerq_vocab * v) {
    innerq_status st = INNERQ_OK;
    struct gguf_str name;
    if (!gguf_get_str(f, "general.name", &name, &st)) return st;
    if (!contains_ascii_ci(&name, "phi-3") && !contains_ascii_ci(&name, "phi3")) return INNERQ_OK;
    for (innerq_token id = 0; id < v->n_tokens; id++) {
        if (v->attr[id] & TOKEN_SPECIAL) v->attr[id] |= TOKEN_RSTRIP;
    }
    set_attr(v, "</s>", TOKEN_RSTRIP, true);
    set_attr(v, "<unk>", TOKEN_RSTRIP, false);
    set_attr(v, "<s>", TOKEN_RSTRIP, false);
    set_attr(v, "<|endoftext|>", TOKEN_RSTRIP, false);
    return INNERQ_OK;
}

static void load_byte_tokens(struct innerq_vocab * v) {
    for (int b = 0; b < 256; b++) {
        char s[8];
        if (v->kind == VOCAB_BPE) {
            v->byte_token[b] = vocab_text_find(v, s, unicode_utf8_encode(vocab_gpt2_byte_cpt((uint8_t) b), s));
        } else {
            static const char hex[] = "0123456789ABCDEF";
            const char name[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
            s[0] = (char) b;
            v->byte_token[b] = vocab_text_find(v, name, 6);
            if (v->byte_token[b] < 0) v->byte_token[b] = vocab_text_find(v, s, 1);
        }
    }
}

// The bytes a token stands for. gpt2: byte-level characters back to bytes (a character
// outside that alphabet stays as it is); llama: U+2581 back to a space.
static size_t piece_of(const struct innerq_vocab * v, innerq_token id, const int16_t * byte_of_cpt, char * out) {
    size_t len;
    const char * t = vocab_token_text(v, id, &len);
    const uint8_t a = v->attr[id];
    if (a & TOKEN_BYTE) {
        out[0] = (char) byte_token_value(t, len);
        return 1;
    }
    if (a & TOKEN_SPECIAL) {
        memcpy(out, t, len);
        return len;
    }
    if (!(a & TOKEN_NORMAL)) return 0;
    size_t n = 0;
    for (size_t i = 0; i < len;) {
        uint32_t cpt;
        const size_t k = unicode_utf8_decode(t + i, len - i, &cpt);
        if (v->kind == VOCAB_BPE && cpt < GPT2_ALPHABET_END && byte_of_cpt[cpt] >= 0) {
            out[n++] = (char) byte_of_cpt[cpt];
        } else if (v->kind == VOCAB_SPM && cpt == 0x2581) {
            out[n++] = ' ';
        } else {
            memcpy(out + n, t + i, k);
            n += k;
        }
        i += k;
    }
    return n;
}

static innerq_status load_pieces(struct innerq_vocab * v) {
    int16_t byte_of_cpt[GPT2_ALPHABET_END];
    memset(byte_of_cpt, 0xFF, sizeof(byte_of_cpt));
    for (int b = 0; b < 256; b++) byte_of_cpt[vocab_gpt2_byte_cpt((uint8_t) b)] = (int16_t) b;
    // a piece is never longer than its text
    v->piece = malloc(v->text_off[v->n_tokens] + 1);
    v->piece_off = malloc((v->n_tokens + 1) * sizeof(uint32_t));
    if (!v->piece || !v->piece_off) return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory for token pieces");
    uint32_t off = 0;
    for (innerq_token id = 0; id < v->n_tokens; id++) {
        v->piece_off[id] = off;
        off += (uint32_t) piece_of(v, id, byte_of_cpt, v->piece + off);
    }
    v->piece_off[v->n_tokens] = off;
    return INNERQ_OK;
}

struct special_order {
    uint32_t len;
    innerq_token id;
};

static int special_order_cmp(const void * a, const void * b) {
    const struct special_order * x = a, * y = b;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

static innerq_status load_special_list(struct innerq_vocab * v) {
    int32_t n = 0;
    for (innerq_token id = 0; id < v->n_tokens; id++) {
        n += (v->attr[id] & TOKEN_SPECIAL) && v->text_off[id + 1] > v->text_off[id];
    }
    struct special_order * order = malloc((n + 1) * sizeof(*order));
    v->special = malloc((n + 1) * sizeof(innerq_token));
    if (!order || !v->special) {
        free(order);
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory for %d special tokens", n);
    }
    n = 0;
    for (innerq_token id = 0; id < v->n_tokens; id++) {
        const uint32_t len = v->text_off[id + 1] - v->text_off[id];
        if ((v->attr[id] & TOKEN_SPECIAL) && len > 0) order[n++] = (struct special_order){len, id};
    }
    qsort(order, n, sizeof(*order), special_order_cmp);
    for (int32_t i = 0; i < n; i++) v->special[i] = order[i].id;
    v->n_special = n;
    free(order);
    return INNERQ_OK;
}

innerq_status vocab_load(const struct gguf_file * f, struct innerq_vocab ** out) {
    if (!f || !out) return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "vocab_load: NULL argument");
    *out = NULL;
    struct innerq_vocab * v = calloc(1, sizeof(*v));
    if (!v) return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory for the vocabulary");
    innerq_status st = load_model_kind(f, v);
    if (st == INNERQ_OK) st = load_tokens(f, v);
    if (st == INNERQ_OK) st = load_types_and_scores(f, v);
    if (st == INNERQ_OK && v->kind == VOCAB_BPE) st = load_merges(f, v);
    if (st == INNERQ_OK) st = load_special_ids(f, v);
    if (st == INNERQ_OK) st = load_strip_attrs(f, v);
    if (st == INNERQ_OK) {
        load_byte_tokens(v);
        st = load_pieces(v);
    }
    if (st == INNERQ_OK) st = load_special_list(v);
    if (st != INNERQ_OK) {
        vocab_free(v);
        return st;
    }
    *out = v;
    return INNERQ_OK;
}

void vocab_free(struct innerq_vocab * v) {
    if (!v) return;
    free(v->text);
    free(v->text_off);
    free(v->piece);
    free(v->piece_off);
    free(v->attr);
    free(v->score);
    free(v->by_text.slots);
    free(v->merges.slots);
    free(v->special);
    free(v);
}

int32_t vocab_n_tokens(const struct innerq_vocab * v) { return v->n_tokens; }
innerq_token vocab_bos(const struct innerq_vocab * v) { return v->bos; }
innerq_token vocab_eos(const struct innerq_vocab * v) { return v->eos; }
bool vocab_add_bos(const struct innerq_vocab * v) { return v->add_bos; }

bool vocab_is_eog(const struct innerq_vocab * v, innerq_token token) {
    return token >= 0 && token < v->n_tokens && (v->attr[token] & TOKEN_EOG);
}

// ---- pieces and detokenizing ----

// The bytes of a token; strip drops one leading space (the one add_space_prefix added).
static const char * vocab_piece(const struct innerq_vocab * v, innerq_token id, bool render_special, bool strip,
                                size_t * len) {
    const char * p = v->piece + v->piece_off[id];
    *len = v->piece_off[id + 1] - v->piece_off[id];
    if (!render_special && (v->attr[id] & (TOKEN_CONTROL | TOKEN_UNKNOWN))) *len = 0;
    if (strip && *len > 0 && p[0] == ' ') {
        p++;
        (*len)--;
    }
    return p;
}

// llama: tokenizing put a space before the text at the start and after each special token.
static bool strip_after(const struct innerq_vocab * v, innerq_token id) {
    return v->add_space_prefix && (v->attr[id] & TOKEN_SPECIAL);
}

static innerq_status check_token(const struct innerq_vocab * v, innerq_token id) {
    if (id < 0 || id >= v->n_tokens) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT,
                           "token %d is outside the vocabulary (%d tokens)", id, v->n_tokens);
    }
    return INNERQ_OK;
}

static innerq_status copy_out(const char * p, size_t len, char * buf, int32_t buf_size, int32_t * n_bytes) {
    if (len > INT32_MAX) return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "the text is longer than %d bytes", INT32_MAX);
    *n_bytes = (int32_t) len;
    if (len > (size_t) buf_size) {
        return innerq_fail(INNERQ_ERR_BUFFER_TOO_SMALL, "the text has %zu bytes, the buffer holds %d", len, buf_size);
    }
    if (len > 0) memcpy(buf, p, len);
    return INNERQ_OK;
}

innerq_status vocab_token_to_piece(const struct innerq_vocab * v, innerq_token token, bool render_special, char * buf,
                                   int32_t buf_size, int32_t * n_bytes) {
    if (!v || !n_bytes || buf_size < 0 || (!buf && buf_size > 0)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "token_to_piece: NULL argument or negative size");
    }
    innerq_status st = check_token(v, token);
    if (st != INNERQ_OK) return st;
    size_t len;
    const char * p = vocab_piece(v, token, render_special, false, &len);
    return copy_out(p, len, buf, buf_size, n_bytes);
}

innerq_status vocab_detokenize(const struct innerq_vocab * v, const innerq_token * tokens, int32_t n_tokens,
                               bool render_special, char * buf, int32_t buf_size, int32_t * n_bytes) {
    if (!v || n_tokens < 0 || (!tokens && n_tokens > 0) || !n_bytes || buf_size < 0 || (!buf && buf_size > 0)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "detokenize: NULL argument or negative size");
    }
    size_t total = 0;
    bool strip = v->add_space_prefix;
    for (int32_t i = 0; i < n_tokens; i++) {
        innerq_status st = check_token(v, tokens[i]);
        if (st != INNERQ_OK) return st;
        size_t len;
        const char * p = vocab_piece(v, tokens[i], render_special, strip, &len);
        // len > 0: buf may be NULL (a size query), and memcpy must not get NULL even for 0 bytes
        if (len > 0 && total + len <= (size_t) buf_size) memcpy(buf + total, p, len);
        total += len;
        strip = strip_after(v, tokens[i]);
    }
    if (total > INT32_MAX) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "the text is longer than %d bytes", INT32_MAX);
    }
    *n_bytes = (int32_t) total;
    if (total > (size_t) buf_size) {
        return innerq_fail(INNERQ_ERR_BUFFER_TOO_SMALL, "the text has %zu bytes, the buffer holds %d", total, buf_size);
    }
    return INNERQ_OK;
}

// ---- streaming detokenizer ----

struct innerq_detokenizer {
    const struct innerq_vocab * v;
    bool render_special;
    bool strip;        // the next piece loses its leading space
    char held[4];      // the start of a character the next piece completes
    size_t n_held;
    char * scratch;    // held bytes + the piece
    size_t cap_scratch;
};

innerq_status vocab_detokenizer_init(const struct innerq_vocab * v, bool render_special, innerq_detokenizer ** out) {
    if (!v || !out) return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "detokenizer_init: NULL argument");
    innerq_detokenizer * dt = calloc(1, sizeof(*dt));
    if (!dt) return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory for a detokenizer");
    dt->v = v;
    dt->render_special = render_special;
    dt->strip = v->add_space_prefix;
    *out = dt;
    return INNERQ_OK;
}

void innerq_detokenizer_free(innerq_detokenizer * dt) {
    if (!dt) return;
    free(dt->scratch);
    free(dt);
}

// Copies s[0..n) as valid UTF-8, each maximal ill-formed subpart becoming one U+FFFD (as
// Python's errors="replace"); returns the bytes written (out may be NULL to count them).
static size_t utf8_sanitize(const char * s, size_t n, char * out) {
    size_t w = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cpt;
        size_t k = unicode_utf8_decode(s + i, n - i, &cpt);
        const bool bad = cpt == UNICODE_REPLACEMENT && k == 1;
        const size_t m = bad ? 3 : k;
        if (out) memcpy(out + w, bad ? "\xEF\xBF\xBD" : s + i, m);
        if (bad) k = unicode_utf8_invalid_len(s + i, n - i);
        w += m;
        i += k;
    }
    return w;
}

innerq_status innerq_detokenizer_push(innerq_detokenizer * dt, innerq_token token, char * buf, int32_t buf_size,
                                      int32_t * n_bytes) {
    if (!dt || !n_bytes || buf_size < 0 || (!buf && buf_size > 0)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_detokenizer_push: NULL argument or negative size");
    }
    innerq_status st = check_token(dt->v, token);
    if (st != INNERQ_OK) return st;
    size_t len;
    const char * p = vocab_piece(dt->v, token, dt->render_special, dt->strip, &len);
    // at least one byte, so that scratch is never NULL: memcpy must not get NULL even for 0 bytes
    if (!vocab_grow(&dt->scratch, &dt->cap_scratch, dt->n_held + len + 1, 1)) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "out of memory in the detokenizer");
    }
    memcpy(dt->scratch, dt->held, dt->n_held);
    memcpy(dt->scratch + dt->n_held, p, len);
    const size_t total = dt->n_held + len;
    const size_t keep = unicode_utf8_incomplete_tail(dt->scratch, total);
    const size_t need = utf8_sanitize(dt->scratch, total - keep, NULL);
    if (need > INT32_MAX) return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "a piece longer than %d bytes", INT32_MAX);
    *n_bytes = (int32_t) need;
    if (need > (size_t) buf_size) {
        return innerq_fail(INNERQ_ERR_BUFFER_TOO_SMALL, "the piece has %zu bytes, the buffer holds %d", need, buf_size);
    }
    utf8_sanitize(dt->scratch, total - keep, buf);
    memcpy(dt->held, dt->scratch + total - keep, keep);
    dt->n_held = keep;
    dt->strip = strip_after(dt->v, token);
    return INNERQ_OK;
}

innerq_status innerq_detokenizer_flush(innerq_detokenizer * dt, char * buf, int32_t buf_size, int32_t * n_bytes) {
    if (!dt || !n_bytes || buf_size < 0 || (!buf && buf_size > 0)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_detokenizer_flush: NULL argument or negative size");
    }
    const size_t need = dt->n_held > 0 ? 3 : 0;  // what is held is one cut-short character
    innerq_status st = copy_out("\xEF\xBF\xBD", need, buf, buf_size, n_bytes);
    if (st == INNERQ_OK) dt->n_held = 0;
    return st;
}
