// ATTENTION and KV_STORE over any cache type (attention.h).
//
// Work items are (KV head, block of queries, stretch of positions). An item runs the online
// softmax of the r query heads of its KV head times the queries of its block, so each K/V
// row is read once for all of them: positions below n_past through the cache type's attend,
// the rest from the batch's own f32 k/v with the causal mask. It leaves one state per query
// vector; after a barrier the states of a query's stretches are merged exactly. Stretches
// are split only when there are too few (head, block) pairs to keep the threads busy, e.g.
// when decoding one token.
#include "attention.h"

#include "iq-qcache.h"
#include "ops.h"
#include "vec.h"

#include <math.h>

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
    for (int j = 0; j < nq; j++) {
        float * sj = s + j * IQ_ATTN_TILE;
        float * stj = st + j * ss;
        const int nv = visible != NULL ? visible[j] : n;
        if (nv > 0) {
            const float tile_max = vec->max(nv, sj);
            const float mx = tile_max > stj[0] ? tile_max : stj[0];
            const float alpha = expf(stj[0] - mx);
            stj[1] = stj[1] * alpha + vec->exp_sum(nv, sj, sj, mx);
            stj[0] = mx;
            if (alpha != 1.0f) {
                for (int c = 0; c < d; c++) {
                    stj[2 + c] *= alpha;
                }
            }
        }
        memset(sj + nv, 0, (size_t) (n - nv) * sizeof(float));
    }
    (v_half ? vec->accum_f16 : vec->accum)(d, n, v, vs, nq, s, IQ_ATTN_TILE, st + 2, ss);
}

// The shape of the work, computed alike by the work-size query and by every thread.
struct attn_plan {
    int64_t hd, n_head, n_kv, r, n_tokens, n_past;
    int64_t qb;         // queries per block
    int64_t n_blocks;   // query blocks
    int64_t stretch;    // positions per stretch
    int64_t n_stretch;  // stretches per (head, block)
    int64_t n_items;
    int64_t nq_max;     // query vectors per item
    size_t slot;        // floats of one item's states
    size_t thread;      // floats of one thread's scratch
};

static struct attn_plan attn_plan_make(const struct iq_tensor * dst, int nth) {
    const struct iq_tensor * q = dst->src[0];
    const struct iq_kv_layer * layer = dst->op_ptr;
    struct attn_plan pl = {
        .hd = q->ne[0], .n_head = q->ne[1], .n_kv = layer->n_kv_head, .n_tokens = q->ne[2],
        .n_past = dst->op_params[IQ_KV_P_N_PAST],
    };
    pl.r = pl.n_head / pl.n_kv;
    pl.qb = pl.r >= ATTN_QUERY_VECTORS ? 1 : ATTN_QUERY_VECTORS / pl.r;
    pl.qb = pl.qb < pl.n_tokens ? pl.qb : pl.n_tokens;
    pl.n_blocks = (pl.n_tokens + pl.qb - 1) / pl.qb;
    const int64_t positions = pl.n_past + pl.n_tokens;
    const int64_t pairs = pl.n_kv * pl.n_blocks;
    pl.stretch = positions;
    if (pairs < 4 * nth) {
        const int64_t want = (8 * nth + pairs - 1) / pairs;  // stretches per pair
        int64_t len = (positions + want - 1) / want;
        len = (len + IQ_ATTN_TILE - 1) / IQ_ATTN_TILE * IQ_ATTN_TILE;
        pl.stretch = len > ATTN_MIN_STRETCH ? len : ATTN_MIN_STRETCH;
    }
    pl.n_stretch = (positions + pl.stretch - 1) / pl.stretch;
    pl.n_items = pairs * pl.n_stretch;
    pl.nq_max = pl.qb * pl.r;
    pl.slot = (size_t) (pl.nq_max * iq_attn_state_size(pl.hd));
    // scaled queries, visible counts, the cache type's scratch
    pl.thread = (size_t) (pl.nq_max * pl.hd + pl.nq_max + iq_attn_scratch_size(pl.hd, pl.nq_max));
    return pl;
}

size_t iq_cpu_attention_work_size(const struct iq_tensor * dst, int nth) {
    const struct attn_plan pl = attn_plan_make(dst, nth);
    return ((size_t) pl.n_items * pl.slot + (size_t) nth * pl.thread) * sizeof(float) + 64;
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

// The cache of an ATTENTION or KV_STORE op; false (+ iq_error_set) if its parameters are bad.
static bool attn_cache_of_op(const struct iq_tensor * dst, struct iq_attn_cache * cache) {
    cache->layer = dst->op_ptr;
    return !iq_qcache_type_is_quantized(cache->layer->type_k) || iq_kv_qcache_of_op(dst, &cache->qc, &cache->flush);
}

bool iq_cpu_attention_supports(const struct iq_tensor * dst) {
    const struct iq_kv_layer * layer = dst->op_ptr;
    struct iq_attn_cache cache;
    if (attn_layer_fns(layer, "attention") == NULL || !attn_cache_of_op(dst, &cache)) {
        return false;
    }
    const enum iq_type types[2] = { layer->type_k, layer->type_v };
    for (int i = 0; i < 2; i++) {
        if (iq_kv_type_is_plain(types[i]) && iq_cpu_to_float(types[i]) == NULL) {
            iq_error_set("attention: no f32 conversion of %s", iq_type_name(types[i]));
            return false;
        }
    }
    return true;
}

// What one thread needs to run items.
struct attn_job {
    struct attn_plan pl;
    const struct iq_tensor * q, * k, * v;
    const struct iq_kv_layer * layer;
    struct iq_attn_cache cache;
    const struct iq_attn_cache_fns * fns;
    float scale;
    bool decode;  // decode semantics (iq_attention_set_decode_semantics)
    float * slots;
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

// Where stretch st starts: st * stretch, moved down to a block boundary of a quantized cache,
// so no stretch cuts a block (the kernels quantize softmax weights per block piece they are
// given: with whole blocks, how the positions are split does not change the result).
static int64_t attn_stretch_start(const struct attn_job * job, int64_t st) {
    const int64_t x = st * job->pl.stretch;
    const struct iq_qcache * c = &job->cache.qc;
    if (!iq_qcache_type_is_quantized(job->layer->type_k) || x <= c->n_sink || x >= c->n_sink + c->n_quant) {
        return x;
    }
    return c->n_sink + (x - c->n_sink) / c->cfg.group * c->cfg.group;
}

// The order in which the threads take the stretches of every (head, block) pair: the costliest
// first, so that the items that run last are cheap ones and no thread waits long at the barrier
// for another. In a quantized cache a window row (sink, recent window, the batch's rows: f16 or
// f32 rows through the row kernels) costs about ATTN_ROW_COST quantized tokens, so the stretch
// holding the recent window costs several times the others; taken in position order it came
// last. Only the order changes: each item writes its own slot and attn_merge merges the slots
// in position order, so the result is the same bit for bit. false: position order (a plain
// cache, whose stretches cost the same, one stretch, or more than ATTN_ORDER_MAX).
#define ATTN_ROW_COST 3
#define ATTN_ORDER_MAX 64
static bool attn_stretch_order(const struct attn_job * job, int64_t * order) {
    const struct attn_plan * pl = &job->pl;
    if (!iq_qcache_type_is_quantized(job->layer->type_k) || pl->n_stretch < 2 || pl->n_stretch > ATTN_ORDER_MAX) {
        return false;
    }
    const struct iq_qcache * c = &job->cache.qc;
    const int64_t positions = pl->n_past + pl->n_tokens, q0 = c->n_sink, q1 = c->n_sink + c->n_quant;
    int64_t cost[ATTN_ORDER_MAX];
    for (int64_t st = 0; st < pl->n_stretch; st++) {
        const int64_t lo = attn_stretch_start(job, st), e = attn_stretch_start(job, st + 1);
        const int64_t hi = e < positions ? e : positions;
        const int64_t a = lo > q0 ? lo : q0, b = hi < q1 ? hi : q1;  // the quantized tokens
        const int64_t quant = b > a ? b - a : 0;
        cost[st] = quant + ATTN_ROW_COST * (hi > lo ? hi - lo - quant : 0);
        // insertion by cost, descending; equal costs in position order
        int64_t i = st;
        for (; i > 0 && cost[order[i - 1]] < cost[st]; i--) {
            order[i] = order[i - 1];
        }
        order[i] = st;
    }
    return true;
}

// Stretch st of (KV head g, query block b): its states go to slot.
static void attn_item(const struct attn_job * job, int64_t g, int64_t b, int64_t st, float * slot, float * scratch) {
    const struct attn_plan * pl = &job->pl;
    const int64_t hd = pl->hd, r = pl->r, n_past = pl->n_past, ss = iq_attn_state_size(hd);
    const int64_t i0 = b * pl->qb;
    const int64_t i1 = i0 + pl->qb < pl->n_tokens ? i0 + pl->qb : pl->n_tokens;
    const int nq = (int) ((i1 - i0) * r);
    for (int j = 0; j < nq; j++) {
        slot[j * ss] = -INFINITY;
        memset(slot + j * ss + 1, 0, (size_t) (hd + 1) * sizeof(float));
    }
    const int64_t lo = attn_stretch_start(job, st), next = attn_stretch_start(job, st + 1);
    const int64_t end = n_past + i1;  // the last query of the block sees positions < end
    const int64_t hi = next < end ? next : end;
    if (lo >= hi) {
        return;
    }

    float * qs = scratch;  // nq x hd
    int * visible = (int *) (qs + pl->nq_max * hd);
    float * rest = (float *) (visible + pl->nq_max);
    // query vector j = (query i0 + j / r, head g * r + j % r)
    for (int j = 0; j < nq; j++) {
        const float * src = (const float *) ((const char *) job->q->data + (i0 + j / r) * job->q->nb[2] +
                                             (g * r + j % r) * job->q->nb[1]);
        for (int64_t c = 0; c < hd; c++) {
            qs[j * hd + c] = src[c] * job->scale;
        }
    }
    if (lo < n_past) {
        job->fns->attend(&job->cache, (int) g, lo, hi < n_past ? hi : n_past, nq, (int) r, qs, slot, rest);
    }
    const int64_t ks = (int64_t) (job->k->nb[2] / sizeof(float));
    const int64_t vs = (int64_t) (job->v->nb[2] / sizeof(float));
    const float * kb = (const float *) ((const char *) job->k->data + g * job->k->nb[1]);  // batch token 0
    const float * vb = (const float *) ((const char *) job->v->data + g * job->v->nb[1]);
    // with decode semantics, rows before a query's own come rounded as stored (tiles after the
    // scores in rest) and its own row alone, unrounded
    const int64_t own = job->decode ? 0 : 1;
    float * ktile = rest + pl->nq_max * IQ_ATTN_TILE;
    float * vtile = ktile + IQ_ATTN_TILE * hd;
    for (int64_t t0 = lo > n_past ? lo : n_past; t0 < hi; t0 += IQ_ATTN_TILE) {
        const int n = (int) (hi - t0 < IQ_ATTN_TILE ? hi - t0 : IQ_ATTN_TILE);
        for (int j = 0; j < nq; j++) {
            const int64_t seen = n_past + i0 + j / r + own - t0;  // positions before (or up to) the query's own
            visible[j] = (int) (seen <= 0 ? 0 : (seen < n ? seen : n));
        }
        const float * kt = kb + (t0 - n_past) * ks, * vt = vb + (t0 - n_past) * vs;
        if (!job->decode) {
            iq_attn_rows((int) hd, n, kt, false, ks, vt, false, vs, nq, qs, visible, slot, rest);
            continue;
        }
        for (int t = 0; t < n; t++) {
            attn_round_row(job->layer->type_k, (int) hd, kt + t * ks, ktile + t * hd);
            attn_round_row(job->layer->type_v, (int) hd, vt + t * vs, vtile + t * hd);
        }
        iq_attn_rows((int) hd, n, ktile, false, hd, vtile, false, hd, nq, qs, visible, slot, rest);
        for (int64_t i = i0; i < i1; i++) {
            const int64_t t = n_past + i - t0;  // the query's own row in this tile
            if (t >= 0 && t < n) {
                iq_attn_rows((int) hd, 1, kt + t * ks, false, ks, vt + t * vs, false, vs, (int) r,
                             qs + (i - i0) * r * hd, NULL, slot + (i - i0) * r * ss, rest);
            }
        }
    }
}

// Merges the stretches of (head g, block b) into dst: out = sum_k e^(m_k - M) acc_k / sum_k e^(m_k - M) l_k.
static void attn_merge(const struct attn_job * job, struct iq_tensor * dst, int64_t g, int64_t b) {
    const struct attn_plan * pl = &job->pl;
    const int64_t hd = pl->hd, r = pl->r, i0 = b * pl->qb, ss = iq_attn_state_size(hd);
    const int64_t i1 = i0 + pl->qb < pl->n_tokens ? i0 + pl->qb : pl->n_tokens;
    const float * first = job->slots + (size_t) ((g * pl->n_blocks + b) * pl->n_stretch) * pl->slot;
    for (int64_t j = 0; j < (i1 - i0) * r; j++) {
        float mx = -INFINITY;
        for (int64_t st = 0; st < pl->n_stretch; st++) {
            const float mk = first[st * pl->slot + j * ss];
            mx = mk > mx ? mk : mx;
        }
        float * out = (float *) ((char *) dst->data + (i0 + j / r) * dst->nb[1]) + (g * r + j % r) * hd;
        memset(out, 0, (size_t) hd * sizeof(float));
        float sum = 0.0f;
        for (int64_t st = 0; st < pl->n_stretch; st++) {
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

void iq_cpu_attention(const struct iq_cpu_params * p, struct iq_tensor * dst) {
    const struct iq_kv_layer * layer = dst->op_ptr;
    struct attn_job job = {
        .pl = attn_plan_make(dst, p->nth),
        .q = dst->src[0], .k = dst->src[1], .v = dst->src[2], .layer = layer,
        .fns = iq_attn_cache_fns_get(layer->type_k), .scale = iq_get_op_param_f32(dst, IQ_KV_P_SCALE),
        .decode = dst->op_params[IQ_KV_P_DECODE] != 0,
    };
    attn_cache_of_op(dst, &job.cache);  // checked by iq_cpu_attention_supports
    const struct attn_plan * pl = &job.pl;
    job.slots = (float *) (((uintptr_t) p->wdata + 63) & ~(uintptr_t) 63);
    float * scratch = job.slots + (size_t) pl->n_items * pl->slot + (size_t) p->ith * pl->thread;

    // the last query blocks see the most positions: they go first, so no long item comes last;
    // a pair's stretches go costliest first (one thread often takes several stretches of a pair
    // in a row and reuses its prepared query)
    int64_t order[ATTN_ORDER_MAX];
    const bool ordered = attn_stretch_order(&job, order);
    for (int64_t it = iq_threadpool_next(p->tp); it < pl->n_items; it = iq_threadpool_next(p->tp)) {
        const int64_t st = ordered ? order[it % pl->n_stretch] : it % pl->n_stretch, pair = it / pl->n_stretch;
        const int64_t g = pair % pl->n_kv, b = pl->n_blocks - 1 - pair / pl->n_kv;
        float * slot = job.slots + (size_t) ((g * pl->n_blocks + b) * pl->n_stretch + st) * pl->slot;
        attn_item(&job, g, b, st, slot, scratch);
    }
    iq_threadpool_barrier(p->tp);
    int64_t a, e;
    iq_cpu_split(pl->n_kv * pl->n_blocks, p->ith, p->nth, &a, &e);
    for (int64_t pair = a; pair < e; pair++) {
        attn_merge(&job, dst, pair / pl->n_blocks, pair % pl->n_blocks);
    }
}

bool iq_cpu_kv_store_supports(const struct iq_tensor * dst) {
    struct iq_attn_cache cache;
    return attn_layer_fns(dst->op_ptr, "kv_store") != NULL && attn_cache_of_op(dst, &cache);
}

void iq_cpu_kv_store(const struct iq_cpu_params * p, struct iq_tensor * dst) {
    struct iq_attn_cache cache;
    attn_cache_of_op(dst, &cache);  // checked by iq_cpu_kv_store_supports
    iq_attn_cache_fns_get(cache.layer->type_k)->store(p, &cache, dst->src[1], dst->src[2], dst->op_params[IQ_KV_P_N_PAST]);
}
