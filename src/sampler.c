// Sampling: llama.cpp's default chain (repetition penalty, top-k, top-p, min-p, temperature,
// draw) over a private copy of the logits, so the caller's array is never touched.
//
// Candidates are (logit, id) pairs. Truncations keep a prefix of the array: top-k and top-p
// need only the best few in order, so the array is partially ordered on demand (quickselect,
// then a sort of the selected prefix) instead of sorting the whole vocabulary.
#include "innerq.h"
#include "status.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const uint64_t SAMPLER_SEED_FROM_CLOCK = 0xFFFFFFFFu;

struct sampler_cand {
    float logit;
    int32_t id;
};

struct innerq_sampler {
    innerq_sampler_params params;
    uint64_t rng[4];                // xoshiro256** state
    innerq_token * history;         // ring of the last repeat_last_n accepted tokens
    int32_t n_history;              // filled entries of the ring
    int32_t history_next;           // where the next accepted token goes
    innerq_token * history_sorted;  // scratch: the ring, sorted, to penalize each token once
    struct sampler_cand * cand;     // scratch: one candidate per vocabulary entry
    int32_t cand_cap;
};

innerq_sampler_params innerq_sampler_default_params(void) {
    innerq_sampler_params p = {
        .temperature = 0.8f,
        .top_k = 40,
        .top_p = 0.95f,
        .min_p = 0.05f,
        .repeat_penalty = 1.0f,
        .repeat_last_n = 64,
        .seed = SAMPLER_SEED_FROM_CLOCK,
    };
    return p;
}

// ---- random numbers: xoshiro256**, seeded through splitmix64 ----

static uint64_t sampler_splitmix64(uint64_t * x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t sampler_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t sampler_next_u64(innerq_sampler * s) {
    uint64_t * r = s->rng;
    const uint64_t result = sampler_rotl(r[1] * 5, 7) * 9;
    const uint64_t t = r[1] << 17;
    r[2] ^= r[0];
    r[3] ^= r[1];
    r[1] ^= r[2];
    r[0] ^= r[3];
    r[2] ^= t;
    r[3] = sampler_rotl(r[3], 45);
    return result;
}

// Uniform in [0, 1) with 53 random bits.
static double sampler_uniform(innerq_sampler * s) { return (double) (sampler_next_u64(s) >> 11) * 0x1.0p-53; }

static void sampler_seed_rng(innerq_sampler * s) {
    uint64_t x = s->params.seed;
    if (x == SAMPLER_SEED_FROM_CLOCK) {
        struct timespec ts;
        timespec_get(&ts, TIME_UTC);
        x = (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
        x ^= (uint64_t) (uintptr_t) s;  // two samplers made in the same nanosecond still differ
    }
    for (int i = 0; i < 4; i++) {
        s->rng[i] = sampler_splitmix64(&x);
    }
}

// ---- life cycle ----

innerq_status innerq_sampler_params_check(const innerq_sampler_params * p) {
    if (!p) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_sampler_params_check: params is NULL");
    }
    if (!isfinite(p->temperature)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "temperature = %g must be a finite number",
                           (double) p->temperature);
    }
    // !(a <= x <= b) is also true for NaN
    if (!(p->top_p >= 0.0f && p->top_p <= 1.0f)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "top_p = %g is out of range (0 .. 1; 1: off)",
                           (double) p->top_p);
    }
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f)) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "min_p = %g is out of range (0 .. 1; 0: off)",
                           (double) p->min_p);
    }
    if (!isfinite(p->repeat_penalty) || p->repeat_penalty <= 0.0f) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "repeat_penalty = %g must be > 0 (1: off)",
                           (double) p->repeat_penalty);
    }
    if (p->repeat_last_n < 0) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "repeat_last_n = %d must be >= 0", p->repeat_last_n);
    }
    return INNERQ_OK;
}

innerq_status innerq_sampler_init(const innerq_sampler_params * params, innerq_sampler ** out) {
    if (!params || !out) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_sampler_init: NULL argument");
    }
    *out = NULL;
    innerq_status st = innerq_sampler_params_check(params);
    if (st != INNERQ_OK) {
        return st;
    }
    innerq_sampler * s = calloc(1, sizeof(*s));
    if (!s) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "innerq_sampler_init: out of memory");
    }
    s->params = *params;
    if (params->repeat_last_n > 0) {
        s->history = malloc((size_t) params->repeat_last_n * sizeof(innerq_token));
        s->history_sorted = malloc((size_t) params->repeat_last_n * sizeof(innerq_token));
        if (!s->history || !s->history_sorted) {
            innerq_sampler_free(s);
            return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "innerq_sampler_init: no memory for %d tokens of history",
                               params->repeat_last_n);
        }
    }
    sampler_seed_rng(s);
    *out = s;
    return INNERQ_OK;
}

void innerq_sampler_free(innerq_sampler * s) {
    if (!s) {
        return;
    }
    free(s->history);
    free(s->history_sorted);
    free(s->cand);
    free(s);
}

void innerq_sampler_accept(innerq_sampler * s, innerq_token token) {
    if (!s || s->params.repeat_last_n == 0) {
        return;
    }
    s->history[s->history_next] = token;
    s->history_next = (s->history_next + 1) % s->params.repeat_last_n;
    if (s->n_history < s->params.repeat_last_n) {
        s->n_history++;
    }
}

// Forgets the history and restarts the random sequence from the seed.
void innerq_sampler_reset(innerq_sampler * s) {
    if (!s) {
        return;
    }
    s->n_history = 0;
    s->history_next = 0;
    sampler_seed_rng(s);
}

// ---- the chain ----

static int sampler_cmp_token(const void * a, const void * b) {
    const innerq_token x = *(const innerq_token *) a, y = *(const innerq_token *) b;
    return (x > y) - (x < y);
}

// Each distinct token of the history, once: a positive logit is divided by the penalty,
// a negative one multiplied (both make the token less likely). cand is still indexed by id.
static void sampler_apply_penalty(innerq_sampler * s, struct sampler_cand * c, int32_t n_vocab) {
    const float p = s->params.repeat_penalty;
    if (p == 1.0f || s->n_history == 0) {
        return;
    }
    memcpy(s->history_sorted, s->history, (size_t) s->n_history * sizeof(innerq_token));
    qsort(s->history_sorted, (size_t) s->n_history, sizeof(innerq_token), sampler_cmp_token);
    for (int32_t i = 0; i < s->n_history; i++) {
        const innerq_token t = s->history_sorted[i];
        if (t < 0 || t >= n_vocab || (i > 0 && t == s->history_sorted[i - 1])) {
            continue;
        }
        c[t].logit = c[t].logit > 0.0f ? c[t].logit / p : c[t].logit * p;
    }
}

// A strict total order, best first: higher logit, then lower id.
static bool sampler_better(const struct sampler_cand * a, const struct sampler_cand * b) {
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

static int sampler_cmp_cand(const void * a, const void * b) {
    const struct sampler_cand * x = a, * y = b;
    return sampler_better(x, y) ? -1 : sampler_better(y, x) ? 1 : 0;
}

static void sampler_swap(struct sampler_cand * a, struct sampler_cand * b) {
    struct sampler_cand t = *a;
    *a = *b;
    *b = t;
}

// Moves the m best of c[0..n) into c[0..m), in no particular order (quickselect, 0 < m < n).
static void sampler_select(struct sampler_cand * c, int32_t n, int32_t m) {
    int32_t lo = 0, hi = n - 1;
    const int32_t k = m - 1;  // the position whose element must end up in place
    while (lo < hi) {
        sampler_swap(&c[lo + (hi - lo) / 2], &c[hi]);
        int32_t store = lo;
        for (int32_t i = lo; i < hi; i++) {
            if (sampler_better(&c[i], &c[hi])) {
                sampler_swap(&c[i], &c[store++]);
            }
        }
        sampler_swap(&c[store], &c[hi]);
        if (store == k) {
            return;
        }
        if (store < k) {
            lo = store + 1;
        } else {
            hi = store - 1;
        }
    }
}

// Makes c[0..m) the m best of c[0..n), best first, given that c[0..sorted) already are.
// Returns the new length of the ordered prefix.
static int32_t sampler_order_prefix(struct sampler_cand * c, int32_t n, int32_t sorted, int32_t m) {
    if (m > n) {
        m = n;
    }
    if (m <= sorted) {
        return sorted;
    }
    if (m < n) {
        sampler_select(c + sorted, n - sorted, m - sorted);
    }
    qsort(c + sorted, (size_t) (m - sorted), sizeof(*c), sampler_cmp_cand);
    return m;
}

// The smallest prefix (best first) whose probability reaches top_p, at least one token.
// Probabilities are the softmax of the current logits (before temperature, as llama.cpp).
static int32_t sampler_top_p(struct sampler_cand * c, int32_t n, int32_t * sorted, float top_p) {
    *sorted = sampler_order_prefix(c, n, *sorted, 1);
    const double max = c[0].logit;
    double sum = 0.0;
    for (int32_t i = 0; i < n; i++) {
        sum += exp(c[i].logit - max);
    }
    const double target = (double) top_p * sum;
    double cum = 0.0;
    for (int32_t i = 0; i < n; i++) {
        if (i == *sorted) {
            *sorted = sampler_order_prefix(c, n, *sorted, *sorted < 32 ? 64 : 2 * *sorted);
        }
        cum += exp(c[i].logit - max);
        if (cum >= target) {
            return i + 1;
        }
    }
    return n;
}

// Keeps the tokens whose probability is at least min_p times the largest (the largest
// always stays), preserving their order.
static int32_t sampler_min_p(struct sampler_cand * c, int32_t n, float max, float min_p) {
    const float threshold = fminf(max + logf(min_p), max);
    int32_t kept = 0;
    for (int32_t i = 0; i < n; i++) {
        if (c[i].logit >= threshold) {
            c[kept++] = c[i];
        }
    }
    return kept;
}

// Draws from softmax(logit / temperature) over c[0..n).
static innerq_token sampler_draw(innerq_sampler * s, struct sampler_cand * c, int32_t n, float max) {
    const double inv_t = 1.0 / (double) s->params.temperature;
    double sum = 0.0;
    for (int32_t i = 0; i < n; i++) {
        c[i].logit = (float) exp(((double) c[i].logit - max) * inv_t);  // now an unnormalized weight
        sum += c[i].logit;
    }
    const double u = sampler_uniform(s) * sum;
    double cum = 0.0;
    int32_t last = 0;  // the last token with any weight, in case u rounded up to the sum
    for (int32_t i = 0; i < n; i++) {
        cum += c[i].logit;
        if (c[i].logit > 0.0f) {
            last = i;
        }
        if (u < cum) {
            return c[i].id;
        }
    }
    return c[last].id;
}

static bool sampler_reserve(innerq_sampler * s, int32_t n_vocab) {
    if (n_vocab <= s->cand_cap) {
        return true;
    }
    struct sampler_cand * c = realloc(s->cand, (size_t) n_vocab * sizeof(*c));
    if (!c) {
        return false;
    }
    s->cand = c;
    s->cand_cap = n_vocab;
    return true;
}

innerq_status innerq_sampler_sample(innerq_sampler * s, const float * logits, int32_t n_vocab, innerq_token * out) {
    if (!s || !logits || !out || n_vocab <= 0) {
        return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_sampler_sample: %s",
                           n_vocab <= 0 ? "n_vocab must be > 0" : "NULL argument");
    }
    if (!sampler_reserve(s, n_vocab)) {
        return innerq_fail(INNERQ_ERR_OUT_OF_MEMORY, "innerq_sampler_sample: no memory for %d candidates", n_vocab);
    }
    struct sampler_cand * c = s->cand;
    for (int32_t i = 0; i < n_vocab; i++) {
        if (isnan(logits[i]) || logits[i] == INFINITY) {
            return innerq_fail(INNERQ_ERR_INVALID_ARGUMENT, "innerq_sampler_sample: logit %d is %g", i,
                               (double) logits[i]);
        }
        c[i].logit = logits[i];
        c[i].id = i;
    }
    sampler_apply_penalty(s, c, n_vocab);

    int32_t best = 0;  // the first of the largest logits
    for (int32_t i = 1; i < n_vocab; i++) {
        if (c[i].logit > c[best].logit) {
            best = i;
        }
    }
    const float max = c[best].logit;  // every truncation below keeps it
    const innerq_sampler_params * p = &s->params;
    if (p->temperature <= 0.0f || max == -INFINITY) {  // greedy, or every token masked
        *out = best;
        return INNERQ_OK;
    }
    int32_t n = n_vocab;
    int32_t sorted = 0;
    if (p->top_k > 0 && p->top_k < n) {
        sorted = sampler_order_prefix(c, n, sorted, p->top_k);
        n = p->top_k;
    }
    if (p->top_p < 1.0f) {
        n = sampler_top_p(c, n, &sorted, p->top_p);
    }
    if (p->min_p > 0.0f) {
        n = sampler_min_p(c, n, max, p->min_p);
    }
    *out = sampler_draw(s, c, n, max);
    return INNERQ_OK;
}
