// ATTENTION and KV_STORE over any cache type (attention.h), for the sequences of a step (iq-kv.h).
//
// Work items are (sequence, KV head, block of its queries, stretch of positions). An item runs
// the online softmax of the r query heads of its KV head times the queries of its block, so
// each K/V row is read once for all of them: positions below the sequence's n_past through the
// cache type's attend, the rest from the batch's own f32 k/v with the causal mask. It leaves
// one state per query vector; after a barrier the states of a query's stretches are merged
// exactly. Stretches are items of their own only when a sequence has too few (head, block)
// pairs to keep the threads busy, e.g. when it decodes one token; a quantized cache's stretches
// are the same either way (attn_qcut), so that a decode step gives what a batch gives. Every
// choice that shapes a sequence's arithmetic depends on that sequence alone (and the thread
// count), so a sequence gets the same bits alone or batched with others.
#include "attention.h"

#include "iq-qcache.h"
#include "ops.h"
#include "vec.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define ATTN_QUERY_VECTORS 24  // query vectors (queries x heads of a group) per item
#define ATTN_MIN_STRETCH 256   // positions, when stretches are split

const struct iq_attn_cache_fns * iq_attn_cache_fns_get(enum iq_type type) {
    if (iq_kv_type_is_plain(type)) {
        return &iq_attn_plain_fns;
    }
    if (iq_qcache_type_is_quantized(type)) {
        return &iq_attn_innerq_fns;
    }
    return NULL;
}

// Scores, then per query vector the running max and sum and the rescaled accumulator, then
// the weighted values.
void iq_attn_rows(int d, int n, const void * k, bool k_half, int64_t ks, const void * v, bool v_half, int64_t vs,
                  int nq, const float * q, const int * visible, float * st, float * s) {
    iq_attn_rows_vec(iq_vec(), d, n, k, k_half, ks, v, v_half, vs, nq, q, visible, st, s);
}

void iq_attn_rows_vec(const struct iq_vec_fns * vec, int d, int n, const void * k, bool k_half, int64_t ks,
                      const void * v, bool v_half, int64_t vs, int nq, const float * q, const int * visible, float * st,
                      float * s) {
    const int64_t ss = iq_attn_state_size(d);
    (k_half ? vec->scores_f16 : vec->scores)(d, n, k, ks, nq, q, s, IQ_ATTN_TILE);
    vec->softmax(d, n, nq, visible, s, IQ_ATTN_TILE, st, ss);
    (v_half ? vec->accum_f16 : vec->accum)(d, n, v, vs, nq, s, IQ_ATTN_TILE, st + 2, ss);
}

// The shape of one sequence's work, computed alike by the work-size query and by the op.
struct attn_plan {
    int64_t hd, n_head, n_kv, r, n_tokens, n_past;
    int64_t token0;     // the sequence's first row of the batch
    int64_t qb;         // queries per block
    int64_t n_blocks;   // query blocks
    bool qcut;          // a quantized cache: stretches cut by cost (attn_qcut)
    int64_t unit;       // its cost per stretch
    int64_t stretch;    // plain caches: positions per stretch
    int64_t n_stretch;  // stretches per (head, block)
    int64_t n_parts;    // items per (head, block): n_stretch (one stretch each) or 1 (all of them)
    int64_t n_items;
    int64_t nq_max;     // query vectors per item
    size_t slot;        // floats of one item's states
    size_t thread;      // floats of one thread's scratch
    int64_t item0;      // the sequence's first item and first pair of the op
    int64_t pair0;
    size_t slots0;      // where its items' states start, in floats
};

// Stretches of a quantized cache. A decode step and a batch must attend to a position the
// same way, so that a token decoded alone gets the logits it gets inside a batch (a rewound
// cache, speculative decoding): the stretches are cut where the cost from position 0 reaches
// k * unit, a row (sink, recent window, a batch's rows) counting ATTN_ROW_COST quantized
// tokens, inside the quantized region moved down to a block boundary. The cuts depend on the
// cache's layout (S, R, n_quant, G), the KV heads and the thread count only (attn_stretch_unit),
// never on the batch or n_past; a batch's item walks all of them in order and merges their
// states as a decode step's final merge does (attn_item_q, attn_merge_q), and the rows of a
// stretch go in tiles from the stretch's or the region's start whether they come from the
// cache or the batch (attn_qrows). Stretches cost alike, so the threads end together too.
#define ATTN_ROW_COST 3
#define ATTN_STRETCH_COST 8192  // over the threads, at least ATTN_STRETCH_COST_MIN per stretch
#define ATTN_STRETCH_COST_MIN 512
static int64_t attn_stretch_cost(int nth) {
    const int64_t u = ATTN_STRETCH_COST / (nth > 0 ? nth : 1);
    return u > ATTN_STRETCH_COST_MIN ? u : ATTN_STRETCH_COST_MIN;
}

static int64_t attn_gcd(int64_t a, int64_t b) {
    while (b != 0) {
        const int64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

// The cost per stretch: about attn_stretch_cost(nth) (at 8K tokens and 2 threads 2 or 3
// stretches per KV head; more, smaller ones measured slower for the work each stretch adds),
// set so that the layout of a decode step (sink, quantized region, recent window half a block
// past R) falls into k equal stretches per KV head with k * n_kv items a multiple of the
// threads. With 3 stretches of 4096 of a cost of 9472 per KV head (the default windows at 8K),
// 3 KV heads and 2 threads, the 9 items, the last of each head a third of the others, left one
// thread 4% behind; 2 stretches of 4800 each give each thread 3. At least half
// attn_stretch_cost(nth), the unit of the work size's bound.
static int64_t attn_stretch_unit(const struct iq_qcache * c, int nth, int64_t n_kv) {
    const int64_t base = attn_stretch_cost(nth), w = ATTN_ROW_COST;
    const int64_t t = w * c->cfg.n_sink + c->n_quant + w * (c->cfg.n_recent + c->cfg.group / 2);
    const int64_t threads = nth > 0 ? nth : 1;
    const int64_t m = threads / attn_gcd(n_kv > 0 ? n_kv : 1, threads);  // k * n_kv % threads == 0
    const int64_t k0 = (t + base - 1) / base;
    int64_t k = k0 / m * m;
    if (k == 0 && 2 * t >= m * base) {
        k = m;
    }
    return k0 <= 1 || k == 0 ? base : (t + k - 1) / k;
}

static int64_t attn_qcut(const struct iq_qcache * c, int64_t unit, int64_t k) {
    const int64_t w = ATTN_ROW_COST, s = c->cfg.n_sink, q = c->n_quant, g = c->cfg.group;
    const int64_t x = k * unit;
    if (x <= w * s) {
        return x / w;
    }
    if (x <= w * s + q) {
        return s + (x - w * s) / g * g;
    }
    return s + q + (x - w * s - q) / w;
}

// The stretches that cover [0, positions): exactly for the cache c, or a bound (c NULL).
static int64_t attn_qstretches(const struct iq_qcache * c, int64_t unit, int64_t positions) {
    int64_t k = (ATTN_ROW_COST * positions + unit - 1) / unit;
    if (c == NULL) {
        return k + 2;  // the cost of [0, positions) is at most ATTN_ROW_COST * positions
    }
    const int64_t s = c->cfg.n_sink, q = c->n_quant;
    const int64_t rows = positions - (positions < s + q ? (positions > s ? positions - s : 0) : q);
    k = ((positions - rows) + ATTN_ROW_COST * rows + unit - 1) / unit;
    while (k > 1 && attn_qcut(c, unit, k - 1) >= positions) {
        k--;
    }
    while (attn_qcut(c, unit, k) < positions) {
        k++;
    }
    return k > 0 ? k : 1;
}

// The plan of a sequence of n_tokens after n_past (qc: its quantized cache, or NULL: a plain
// cache or, with quantized set, the bound the work size takes).
static struct attn_plan attn_plan_make(const struct iq_tensor * dst, int nth, int64_t n_tokens, int64_t n_past,
                                       bool quantized, const struct iq_qcache * qc) {
    const struct iq_tensor * q = dst->src[0];
    struct attn_plan pl = {
        .hd = q->ne[0], .n_head = q->ne[1], .n_kv = dst->src[1]->ne[1], .n_tokens = n_tokens, .n_past = n_past,
        .qcut = quantized,
    };
    const int32_t window = dst->op_params[IQ_KV_P_WINDOW];
    pl.r = pl.n_head / pl.n_kv;
    // a sliding window: each query its own block, whose item starts its stretches at the window
    pl.qb = pl.r >= ATTN_QUERY_VECTORS || window > 0 ? 1 : ATTN_QUERY_VECTORS / pl.r;
    pl.qb = pl.qb < pl.n_tokens ? pl.qb : pl.n_tokens;
    pl.n_blocks = (pl.n_tokens + pl.qb - 1) / pl.qb;
    const int64_t positions = pl.n_past + pl.n_tokens;
    const int64_t pairs = pl.n_kv * pl.n_blocks;
    const bool split = pairs < 4 * nth;  // too few (head, block) pairs to keep the threads busy
    pl.stretch = positions;
    if (pl.qcut) {
        pl.unit = qc != NULL ? attn_stretch_unit(qc, nth, pl.n_kv) : attn_stretch_cost(nth) / 2;
        pl.n_stretch = attn_qstretches(qc, pl.unit, positions);
        pl.n_parts = split ? pl.n_stretch : 1;
    } else {
        if (split) {
            const int64_t want = (8 * nth + pairs - 1) / pairs;  // stretches per pair
            int64_t len = (positions + want - 1) / want;
            len = (len + IQ_ATTN_TILE - 1) / IQ_ATTN_TILE * IQ_ATTN_TILE;
            pl.stretch = len > ATTN_MIN_STRETCH ? len : ATTN_MIN_STRETCH;
        }
        pl.n_stretch = (positions + pl.stretch - 1) / pl.stretch;
        pl.n_parts = pl.n_stretch;
    }
    pl.n_items = pairs * pl.n_parts;
    pl.nq_max = pl.qb * pl.r;
    pl.slot = (size_t) (pl.nq_max * iq_attn_state_size(pl.hd));
    // scaled queries, visible counts, the cache type's scratch, one stretch's states
    pl.thread = (size_t) (pl.nq_max * pl.hd + pl.nq_max + iq_attn_scratch_size(pl.hd, pl.nq_max)) + pl.slot;
    return pl;
}

// Both types known and sharing a row of the table.
static const struct iq_attn_cache_fns * attn_layer_fns(const struct iq_kv_layer * layer, const char * op) {
    const struct iq_attn_cache_fns * fk = iq_attn_cache_fns_get(layer->type_k);
    if (fk == NULL || fk != iq_attn_cache_fns_get(layer->type_v)) {
        iq_error_set("%s: the CPU backend can't use a %s / %s cache", op, iq_type_name(layer->type_k),
                     iq_type_name(layer->type_v));
        return NULL;
    }
    return fk;
}

// Sequence s's cache as the op reads and writes it.
static void attn_cache_of_seq(const struct iq_tensor * dst, const struct iq_kv_layer * layer, int32_t s,
                              struct iq_attn_cache * cache) {
    const struct iq_kv_seq * seq = &iq_kv_seqs_of_op(dst)[s];
    cache->layer = layer;
    cache->pages = iq_kv_pages_of_op(dst, seq->slot);
    if (iq_qcache_type_is_quantized(layer->type_k)) {
        iq_kv_qcache_of_seq(dst, layer, s, &cache->qc, &cache->flush);
    }
}

// The plans of every sequence of the op, placed one after the other (items, pairs, states);
// returns the floats of one thread's scratch and sets the totals.
static size_t attn_plans_make(const struct iq_tensor * dst, const struct iq_kv_layer * layer, int nth,
                              struct attn_plan * plans, int64_t * n_items, int64_t * n_pairs, size_t * n_slots) {
    const struct iq_kv_seq * seqs = iq_kv_seqs_of_op(dst);
    const bool quantized = iq_qcache_type_is_quantized(layer->type_k);
    size_t thread = 0;
    *n_items = *n_pairs = 0;
    *n_slots = 0;
    for (int32_t s = 0; s < iq_kv_n_seq(dst); s++) {
        struct iq_attn_cache cache;
        attn_cache_of_seq(dst, layer, s, &cache);
        struct attn_plan pl = attn_plan_make(dst, nth, seqs[s].n_tokens, seqs[s].n_past, quantized,
                                             quantized ? &cache.qc : NULL);
        pl.token0 = seqs[s].token0;
        pl.item0 = *n_items;
        pl.pair0 = *n_pairs;
        pl.slots0 = *n_slots;
        *n_items += pl.n_items;
        *n_pairs += pl.n_kv * pl.n_blocks;
        *n_slots += (size_t) pl.n_items * pl.slot;
        thread = pl.thread > thread ? pl.thread : thread;
        plans[s] = pl;
    }
    return thread;
}

// Scratch: the plans, every item's states, then each thread's own.
static size_t attn_plans_bytes(const struct iq_tensor * dst) {
    return ((size_t) iq_kv_n_seq(dst) * sizeof(struct attn_plan) + 63) / 64 * 64;
}

size_t iq_cpu_attention_work_size(const struct iq_tensor * dst, int nth) {
    struct iq_kv_layer layer;
    if (!iq_kv_layer_of_op(dst, &layer)) {
        return 0;  // iq_cpu_attention_supports says why
    }
    struct attn_plan * plans = malloc(attn_plans_bytes(dst));
    if (plans == NULL) {
        return SIZE_MAX / 2;  // the backend's allocation then fails with a message
    }
    int64_t n_items, n_pairs;
    size_t n_slots;
    const size_t thread = attn_plans_make(dst, &layer, nth, plans, &n_items, &n_pairs, &n_slots);
    free(plans);
    return attn_plans_bytes(dst) + (n_slots + (size_t) nth * thread) * sizeof(float) + 64;
}

bool iq_cpu_attention_supports(const struct iq_tensor * dst) {
    struct iq_kv_layer layer;
    if (!iq_kv_layer_of_op(dst, &layer) || attn_layer_fns(&layer, "attention") == NULL ||
        !iq_kv_seqs_check(dst, &layer)) {
        return false;
    }
    const enum iq_type types[2] = { layer.type_k, layer.type_v };
    for (int i = 0; i < 2; i++) {
        if (iq_kv_type_is_plain(types[i]) && iq_cpu_to_float(types[i]) == NULL) {
            iq_error_set("attention: no f32 conversion of %s", iq_type_name(types[i]));
            return false;
        }
    }
    if (!iq_qcache_type_is_quantized(layer.type_k) && layer.page % IQ_ATTN_TILE != 0) {
        iq_error_set("attention: a plain cache's pages of %d tokens are not whole tiles of %d", layer.page,
                     IQ_ATTN_TILE);
        return false;
    }
    return true;
}

// What one thread needs to run one sequence's items.
struct attn_job {
    struct attn_plan pl;
    const struct iq_tensor * q, * k, * v;
    const struct iq_kv_layer * layer;
    struct iq_attn_cache cache;
    const struct iq_attn_cache_fns * fns;
    float scale;
    bool decode;  // decode semantics (iq_attention_set_decode_semantics)
    float * slots;  // the sequence's states
};

// A row of a batch's k or v as the cache stores it: through the type's quantizer for the plain
// types, f16 for the quantized ones (their windows hold f16; iq_qcache_store_head).
static void attn_round_row(enum iq_type type, int d, const float * x, float * y) {
    if (type == IQ_TYPE_F32) {
        memcpy(y, x, (size_t) d * sizeof(float));
        return;
    }
    if (type == IQ_TYPE_F16 || !iq_kv_type_is_plain(type)) {
        for (int c = 0; c < d; c++) {
            y[c] = iq_fp16_to_fp32(iq_fp32_to_fp16(x[c]));
        }
        return;
    }
    _Alignas(64) uint8_t row[IQ_QCACHE_MAX_HEAD_DIM * sizeof(float)];
    iq_type_traits_get(type)->from_float(x, row, d);
    iq_cpu_to_float(type)(row, y, d);
}

// Where stretch st starts: attn_qcut for a quantized cache, st * stretch for a plain one.
static int64_t attn_stretch_start(const struct attn_job * job, int64_t st) {
    return job->pl.qcut ? attn_qcut(&job->cache.qc, job->pl.unit, st) : st * job->pl.stretch;
}

// What one item works with: its queries [i0, i1), the query vectors scaled (qs: nq x hd, vector
// j = (query i0 + j / r, head g * r + j % r)), and the thread's scratch.
struct attn_ctx {
    int64_t g, i0, i1;
    int nq;
    float * qs;
    int * visible;
    float * rest;  // the cache type's scratch: scores, then two f32 tiles
};

static void attn_states_init(float * st, int nq, int64_t hd) {
    const int64_t ss = iq_attn_state_size(hd);
    for (int j = 0; j < nq; j++) {
        st[j * ss] = -INFINITY;
        memset(st + j * ss + 1, 0, (size_t) (hd + 1) * sizeof(float));
    }
}

// The batch's keys and values of KV head x->g: row i (the sequence's token i) at kb + i * ks, vb + i * vs.
struct attn_batch_kv {
    int64_t ks, vs;
    const float * kb, * vb;
};

static struct attn_batch_kv attn_batch_kv_of(const struct attn_job * job, int64_t g) {
    const int64_t t0 = job->pl.token0;  // the sequence's token i is the batch's row t0 + i
    return (struct attn_batch_kv) {
        .ks = (int64_t) (job->k->nb[2] / sizeof(float)), .vs = (int64_t) (job->v->nb[2] / sizeof(float)),
        .kb = (const float *) ((const char *) job->k->data + g * job->k->nb[1] + t0 * job->k->nb[2]),
        .vb = (const float *) ((const char *) job->v->data + g * job->v->nb[1] + t0 * job->v->nb[2]),
    };
}

// Decode semantics: the own rows (unrounded, alone) of the block's queries whose position is in
// [a, a + n), after the tile that ends there.
static void attn_own_rows(const struct attn_job * job, const struct attn_ctx * x, const struct attn_batch_kv * b,
                          int64_t a, int n, float * st) {
    const struct attn_plan * pl = &job->pl;
    const int64_t hd = pl->hd, r = pl->r, ss = iq_attn_state_size(hd);
    for (int64_t i = x->i0; i < x->i1; i++) {
        const int64_t t = pl->n_past + i - a;  // the query's own row in this tile
        if (t >= 0 && t < n) {
            iq_attn_rows((int) hd, 1, b->kb + i * b->ks, false, b->ks, b->vb + i * b->vs, false, b->vs, (int) r,
                         x->qs + (i - x->i0) * r * hd, NULL, st + (i - x->i0) * r * ss, x->rest);
        }
    }
}

// The batch's rows [max(lo, n_past), hi) as f32 tiles from their first (plain caches, and
// quantized caches without decode semantics).
static void attn_batch_rows(const struct attn_job * job, const struct attn_ctx * x, int64_t lo, int64_t hi,
                            float * st) {
    const struct attn_plan * pl = &job->pl;
    const int64_t hd = pl->hd, r = pl->r, n_past = pl->n_past;
    const struct attn_batch_kv b = attn_batch_kv_of(job, x->g);
    const int64_t ks = b.ks, vs = b.vs;
    const float * kb = b.kb, * vb = b.vb;
    // with decode semantics, rows before a query's own come rounded as stored (tiles after the
    // scores in rest) and its own row alone, unrounded
    const int64_t own = job->decode ? 0 : 1;
    float * ktile = x->rest + pl->nq_max * IQ_ATTN_TILE;
    float * vtile = ktile + IQ_ATTN_TILE * hd;
    for (int64_t t0 = lo > n_past ? lo : n_past; t0 < hi; t0 += IQ_ATTN_TILE) {
        const int n = (int) (hi - t0 < IQ_ATTN_TILE ? hi - t0 : IQ_ATTN_TILE);
        for (int j = 0; j < x->nq; j++) {
            const int64_t seen = n_past + x->i0 + j / r + own - t0;  // positions before (or up to) the query's own
            x->visible[j] = (int) (seen <= 0 ? 0 : (seen < n ? seen : n));
        }
        const float * kt = kb + (t0 - n_past) * ks, * vt = vb + (t0 - n_past) * vs;
        if (!job->decode) {
            iq_attn_rows((int) hd, n, kt, false, ks, vt, false, vs, x->nq, x->qs, x->visible, st, x->rest);
            continue;
        }
        for (int t = 0; t < n; t++) {
            attn_round_row(job->layer->type_k, (int) hd, kt + t * ks, ktile + t * hd);
            attn_round_row(job->layer->type_v, (int) hd, vt + t * vs, vtile + t * hd);
        }
        iq_attn_rows((int) hd, n, ktile, false, hd, vtile, false, hd, x->nq, x->qs, x->visible, st, x->rest);
        attn_own_rows(job, x, &b, t0, n, st);
    }
}

// Rows [t0, t1) of one f16 row region of a quantized cache under decode semantics: the sink
// (origin 0) or the recent window (origin its first position), positions below n_past from
// the cache's buffers bk / bv (row t at (t - origin) * hd), the rest from the batch rounded to
// f16 as the cache will hold them. Tiles from t0 whatever the source, so a decode step and a
// batch see the same tiles; a query's own row comes alone after its tile, unrounded.
static void attn_qrows(const struct attn_job * job, const struct attn_ctx * x, int64_t t0, int64_t t1,
                       const iq_fp16_t * bk, const iq_fp16_t * bv, int64_t origin, float * st) {
    const struct attn_plan * pl = &job->pl;
    const int64_t hd = pl->hd, r = pl->r, n_past = pl->n_past;
    const struct attn_batch_kv b = attn_batch_kv_of(job, x->g);
    const int64_t ks = b.ks, vs = b.vs;
    const float * kb = b.kb, * vb = b.vb;
    iq_fp16_t * ktile = (iq_fp16_t *) (x->rest + pl->nq_max * IQ_ATTN_TILE);  // in the f32 tiles' room
    iq_fp16_t * vtile = ktile + IQ_ATTN_TILE * hd;
    // no query of the block sees a row from the last one's own on: a tile stops there (rows no
    // query sees would add exact zeros), so a decode step reads its tiles in place
    const int64_t seen_max = n_past + x->i1 - 1;
    for (int64_t a = t0; a < t1; a += IQ_ATTN_TILE) {
        const int n = (int) (t1 - a < IQ_ATTN_TILE ? t1 - a : IQ_ATTN_TILE);
        const int m = (int) (seen_max - a < n ? (seen_max > a ? seen_max - a : 0) : n);  // rows read
        for (int j = 0; j < x->nq && m > 0; j++) {
            const int64_t seen = n_past + x->i0 + j / r - a;  // positions before the query's own
            x->visible[j] = (int) (seen <= 0 ? 0 : (seen < m ? seen : m));
        }
        const iq_fp16_t * kt = bk + (a - origin) * hd, * vt = bv + (a - origin) * hd;
        if (m > 0 && a + m > n_past) {
            const int c0 = (int) (n_past > a ? n_past - a : 0);  // rows from the cache
            memcpy(ktile, kt, (size_t) c0 * hd * sizeof(iq_fp16_t));
            memcpy(vtile, vt, (size_t) c0 * hd * sizeof(iq_fp16_t));
            for (int t = c0; t < m; t++) {
                const float * kr = kb + (a + t - n_past) * ks, * vr = vb + (a + t - n_past) * vs;
                for (int64_t c = 0; c < hd; c++) {
                    ktile[t * hd + c] = iq_fp32_to_fp16(kr[c]);
                    vtile[t * hd + c] = iq_fp32_to_fp16(vr[c]);
                }
            }
            kt = ktile;
            vt = vtile;
        }
        if (m > 0) {
            iq_attn_rows((int) hd, m, kt, true, hd, vt, true, hd, x->nq, x->qs, x->visible, st, x->rest);
        }
        attn_own_rows(job, x, &b, a, n, st);
    }
}

// One stretch [lo, hi) into the states st (fresh).
static void attn_stretch(const struct attn_job * job, const struct attn_ctx * x, int64_t lo, int64_t hi, float * st) {
    const struct attn_plan * pl = &job->pl;
    const int64_t n_past = pl->n_past;
    const int nq = x->nq, r = (int) pl->r;
    // one token: no batch rows come before its own, so decode semantics change nothing but
    // where the own row goes; it goes alone here too, as in a batch with them
    if (!pl->qcut || (!job->decode && pl->n_tokens > 1)) {
        if (lo < n_past) {
            job->fns->attend(&job->cache, (int) x->g, lo, hi < n_past ? hi : n_past, nq, r, x->qs, st, x->rest);
        }
        attn_batch_rows(job, x, lo, hi, st);
        return;
    }
    // a quantized cache under decode semantics or one token: the sink's rows, the quantized
    // blocks, the recent window's rows, in position order (as its attend takes them)
    const struct iq_qcache * c = &job->cache.qc;
    const int64_t s = c->cfg.n_sink, q1 = s + c->n_quant;
    const int32_t h = (int32_t) x->g;
    if (lo < s) {
        attn_qrows(job, x, lo, hi < s ? hi : s, iq_qcache_sink(c, false, h), iq_qcache_sink(c, true, h), 0, st);
    }
    const int64_t a = lo > s ? lo : s, e = hi < q1 ? hi : q1;
    if (a < e && c->cap_blocks > 0) {  // a window-only layer's queries never reach its (absent) blocks
        job->fns->attend(&job->cache, h, a, e, nq, r, x->qs, st, x->rest);
    }
    if (hi > q1) {
        attn_qrows(job, x, lo > q1 ? lo : q1, hi, iq_qcache_recent(c, false, h), iq_qcache_recent(c, true, h), q1, st);
    }
}

// Stretches [s0, s1) of (KV head g, query block b): one stretch's states straight into slot,
// several merged into slot in position order (attn_merge merges slots the same way).
static void attn_item(const struct attn_job * job, int64_t g, int64_t b, int64_t s0, int64_t s1, float * slot,
                      float * scratch) {
    const struct attn_plan * pl = &job->pl;
    const int64_t hd = pl->hd, r = pl->r, ss = iq_attn_state_size(hd);
    struct attn_ctx x = {.g = g, .i0 = b * pl->qb};
    x.i1 = x.i0 + pl->qb < pl->n_tokens ? x.i0 + pl->qb : pl->n_tokens;
    x.nq = (int) ((x.i1 - x.i0) * r);
    x.qs = scratch;
    x.visible = (int *) (x.qs + pl->nq_max * hd);
    x.rest = (float *) (x.visible + pl->nq_max);
    float * tmp = x.rest + iq_attn_scratch_size(hd, pl->nq_max);
    attn_states_init(slot, x.nq, hd);
    const int64_t end = pl->n_past + x.i1;  // the last query of the block sees positions < end
    // under a sliding window the block is one query, at end - 1: it sees positions >= begin
    const int64_t begin = job->layer->window > 0 && end > job->layer->window ? end - job->layer->window : 0;
    bool prepared = false;
    for (int64_t st = s0; st < s1; st++) {
        const int64_t start = attn_stretch_start(job, st), next = attn_stretch_start(job, st + 1);
        const int64_t lo = start > begin ? start : begin;
        const int64_t hi = next < end ? next : end;
        if (lo >= hi) {
            continue;
        }
        if (!prepared) {
            for (int j = 0; j < x.nq; j++) {
                const float * src = (const float *) ((const char *) job->q->data +
                                                     (pl->token0 + x.i0 + j / r) * job->q->nb[2] +
                                                     (g * r + j % r) * job->q->nb[1]);
                for (int64_t c = 0; c < hd; c++) {
                    x.qs[j * hd + c] = src[c] * job->scale;
                }
            }
            prepared = true;
        }
        if (s1 - s0 == 1) {
            attn_stretch(job, &x, lo, hi, slot);
            continue;
        }
        attn_states_init(tmp, x.nq, hd);
        attn_stretch(job, &x, lo, hi, tmp);
        for (int j = 0; j < x.nq; j++) {
            iq_softmax_merge(slot + j * ss, tmp + j * ss, (int32_t) hd);
        }
    }
}

// Merges the parts of (head g, block b) into dst. Plain caches: out = sum_k e^(m_k - M) acc_k /
// sum_k e^(m_k - M) l_k. Quantized caches: one after the other into an empty state, as
// attn_item merges the stretches of one part, so that one part holding every stretch and one
// part per stretch give the same states.
static void attn_merge(const struct attn_job * job, struct iq_tensor * dst, int64_t g, int64_t b) {
    const struct attn_plan * pl = &job->pl;
    const int64_t hd = pl->hd, r = pl->r, i0 = b * pl->qb, ss = iq_attn_state_size(hd);
    const int64_t i1 = i0 + pl->qb < pl->n_tokens ? i0 + pl->qb : pl->n_tokens;
    const float * first = job->slots + (size_t) ((g * pl->n_blocks + b) * pl->n_parts) * pl->slot;
    for (int64_t j = 0; j < (i1 - i0) * r; j++) {
        float * out = (float *) ((char *) dst->data + (pl->token0 + i0 + j / r) * dst->nb[1]) + (g * r + j % r) * hd;
        if (pl->qcut) {
            float run[IQ_ATTN_STATE(IQ_QCACHE_MAX_HEAD_DIM)];
            attn_states_init(run, 1, hd);
            for (int64_t k = 0; k < pl->n_parts; k++) {
                iq_softmax_merge(run, first + k * pl->slot + j * ss, (int32_t) hd);
            }
            const float inv = 1.0f / run[1];
            for (int64_t c = 0; c < hd; c++) {
                out[c] = run[2 + c] * inv;
            }
            continue;
        }
        float mx = -INFINITY;
        for (int64_t st = 0; st < pl->n_parts; st++) {
            const float mk = first[st * pl->slot + j * ss];
            mx = mk > mx ? mk : mx;
        }
        memset(out, 0, (size_t) hd * sizeof(float));
        float sum = 0.0f;
        for (int64_t st = 0; st < pl->n_parts; st++) {
            const float * state = first + st * pl->slot + j * ss;
            if (state[1] == 0.0f) {
                continue;  // a stretch this query does not reach
            }
            const float w = expf(state[0] - mx);
            sum += w * state[1];
            for (int64_t c = 0; c < hd; c++) {
                out[c] += w * state[2 + c];
            }
        }
        const float inv = 1.0f / sum;
        for (int64_t c = 0; c < hd; c++) {
            out[c] *= inv;
        }
    }
}

// The plan whose [first, first + count) holds index i (first: item0 or pair0).
static int32_t attn_plan_find(const struct attn_plan * plans, int32_t n, int64_t i, bool pairs) {
    int32_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int32_t mid = (lo + hi + 1) / 2;
        if ((pairs ? plans[mid].pair0 : plans[mid].item0) <= i) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

void iq_cpu_attention(const struct iq_cpu_params * p, struct iq_tensor * dst) {
    struct iq_kv_layer layer;
    iq_kv_layer_of_op(dst, &layer);  // checked by iq_cpu_attention_supports
    struct attn_plan * plans = (struct attn_plan *) (((uintptr_t) p->wdata + 63) & ~(uintptr_t) 63);
    float * slots = (float *) ((char *) plans + attn_plans_bytes(dst));
    const int32_t n_seq = iq_kv_n_seq(dst);
    int64_t n_items, n_pairs;
    size_t n_slots;
    if (p->ith == 0) {
        attn_plans_make(dst, &layer, p->nth, plans, &n_items, &n_pairs, &n_slots);
    }
    iq_threadpool_barrier(p->tp);
    const struct attn_plan * last = &plans[n_seq - 1];
    n_items = last->item0 + last->n_items;
    n_pairs = last->pair0 + last->n_kv * last->n_blocks;
    size_t thread = 0;
    for (int32_t s = 0; s < n_seq; s++) {
        thread = plans[s].thread > thread ? plans[s].thread : thread;
    }
    n_slots = last->slots0 + (size_t) last->n_items * last->slot;
    float * scratch = slots + n_slots + (size_t) p->ith * thread;

    struct attn_job job = {
        .q = dst->src[0], .k = dst->src[1], .v = dst->src[2], .layer = &layer,
        .fns = iq_attn_cache_fns_get(layer.type_k), .scale = iq_get_op_param_f32(dst, IQ_KV_P_SCALE),
        .decode = dst->op_params[IQ_KV_P_DECODE] != 0,
    };
    int32_t seq = -1;
    // within a sequence the last query blocks see the most positions: they go first, so no long item comes last
    for (int64_t it = iq_threadpool_next(p->tp); it < n_items; it = iq_threadpool_next(p->tp)) {
        const int32_t s = attn_plan_find(plans, n_seq, it, false);
        if (s != seq) {
            seq = s;
            job.pl = plans[s];
            job.slots = slots + job.pl.slots0;
            attn_cache_of_seq(dst, &layer, s, &job.cache);
        }
        const struct attn_plan * pl = &job.pl;
        const int64_t part = (it - pl->item0) % pl->n_parts, pair = (it - pl->item0) / pl->n_parts;
        const int64_t g = pair % pl->n_kv, b = pl->n_blocks - 1 - pair / pl->n_kv;
        float * slot = job.slots + (size_t) ((g * pl->n_blocks + b) * pl->n_parts + part) * pl->slot;
        if (pl->n_parts == pl->n_stretch) {
            attn_item(&job, g, b, part, part + 1, slot, scratch);
        } else {
            attn_item(&job, g, b, 0, pl->n_stretch, slot, scratch);
        }
    }
    iq_threadpool_barrier(p->tp);
    int64_t a, e;
    iq_cpu_split(n_pairs, p->ith, p->nth, &a, &e);
    seq = -1;
    for (int64_t pair = a; pair < e; pair++) {
        const int32_t s = attn_plan_find(plans, n_seq, pair, true);
        if (s != seq) {
            seq = s;
            job.pl = plans[s];
            job.slots = slots + job.pl.slots0;
        }
        const int64_t local = pair - job.pl.pair0;
        attn_merge(&job, dst, local / job.pl.n_blocks, local % job.pl.n_blocks);
    }
}

bool iq_cpu_kv_store_supports(const struct iq_tensor * dst) {
    struct iq_kv_layer layer;
    const struct iq_tensor * k = dst->src[1];
    if (!iq_kv_layer_of_op(dst, &layer) || attn_layer_fns(&layer, "kv_store") == NULL ||
        !iq_kv_seqs_check(dst, &layer)) {
        return false;
    }
    if (k->nb[1] != (size_t) k->ne[0] * sizeof(float) || k->nb[2] != k->nb[1] * (size_t) k->ne[1] ||
        dst->src[2]->nb[1] != k->nb[1] || dst->src[2]->nb[2] != k->nb[2]) {
        iq_error_set("kv_store: the batch's k and v must be contiguous rows");
        return false;
    }
    return true;
}

// Items (sequence, KV head) over the threads: each writes its own rows and blocks.
void iq_cpu_kv_store(const struct iq_cpu_params * p, struct iq_tensor * dst) {
    struct iq_kv_layer layer;
    iq_kv_layer_of_op(dst, &layer);  // checked by iq_cpu_kv_store_supports
    const struct iq_attn_cache_fns * fns = iq_attn_cache_fns_get(layer.type_k);
    const struct iq_kv_seq * seqs = iq_kv_seqs_of_op(dst);
    const struct iq_tensor * k = dst->src[1], * v = dst->src[2];
    const int64_t n_kv = layer.n_kv_head;
    int64_t a, e;
    iq_cpu_split(iq_kv_n_seq(dst) * n_kv, p->ith, p->nth, &a, &e);
    struct iq_attn_cache cache;
    int32_t seq = -1;
    for (int64_t it = a; it < e; it++) {
        const int32_t s = (int32_t) (it / n_kv);
        if (s != seq) {
            seq = s;
            attn_cache_of_seq(dst, &layer, s, &cache);
        }
        const float * kr = (const float *) ((const char *) k->data + (size_t) seqs[s].token0 * k->nb[2]);
        const float * vr = (const float *) ((const char *) v->data + (size_t) seqs[s].token0 * v->nb[2]);
        fns->store_head(&cache, (int) (it % n_kv), kr, vr, seqs[s].n_tokens, seqs[s].n_past);
    }
}
