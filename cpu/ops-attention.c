// ATTENTION and KV_STORE over any cache type (attention.h).
//
// Work items are (KV head, block of queries, stretch of positions). One item runs an online
// softmax over tiles of IQ_ATTN_TILE positions for the r query heads of its KV head times
// the queries of its block, so each K/V row is read once for all of them; positions below
// n_past come from the cache (per its type), the rest are the batch's own f32 k/v with the
// causal mask. An item leaves (max, sum, unnormalised output) per query vector; after a
// barrier the pieces of a query are merged exactly. Stretches are split only when there are
// too few (head, block) pairs to keep the threads busy, e.g. decoding one token.
#include "attention.h"

#include "ops.h"
#include "vec.h"

#include <math.h>

#define ATTN_QUERY_VECTORS 24  // query vectors (queries x heads of a group) per item
#define ATTN_MIN_STRETCH 256   // positions, when stretches are split

const struct iq_attn_cache_fns * iq_attn_cache_fns_get(enum iq_type type) {
    if (iq_kv_type_is_plain(type)) {
        return &iq_attn_plain_fns;
    }
    return NULL;
}

// The shape of the work, computed alike by the work-size query and by every thread.
struct attn_plan {
    int64_t hd, n_head, n_kv, r, n_tokens, n_past;
    int64_t qb;        // queries per block
    int64_t n_blocks;  // query blocks
    int64_t stretch;   // positions per stretch
    int64_t n_stretch; // stretches per (head, block)
    int64_t n_items;
    int64_t nq_max;    // query vectors per item
    size_t slot;       // floats of one item's result: nq_max * (hd + 2)
    size_t thread;     // floats of one thread's scratch
};

static struct attn_plan attn_plan_make(const struct iq_tensor * dst, int nth) {
    const struct iq_tensor * q = dst->src[0];
    const struct iq_kv_layer * layer = dst->op_ptr;
    struct attn_plan pl = {
        .hd = q->ne[0], .n_head = q->ne[1], .n_kv = layer->n_kv_head, .n_tokens = q->ne[2],
        .n_past = dst->op_params[0],
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
    pl.slot = (size_t) (pl.nq_max * (pl.hd + 2));
    pl.thread = (size_t) (pl.nq_max * pl.hd + pl.nq_max * IQ_ATTN_TILE + IQ_ATTN_TILE * pl.hd);
    return pl;
}

size_t iq_cpu_attention_work_size(const struct iq_tensor * dst, int nth) {
    const struct attn_plan pl = attn_plan_make(dst, nth);
    return ((size_t) pl.n_items * pl.slot + (size_t) nth * pl.thread) * sizeof(float) + 64;
}

bool iq_cpu_attention_supports(const struct iq_tensor * dst) {
    const struct iq_kv_layer * layer = dst->op_ptr;
    const struct iq_attn_cache_fns * fk = iq_attn_cache_fns_get(layer->type_k);
    const struct iq_attn_cache_fns * fv = iq_attn_cache_fns_get(layer->type_v);
    if (fk == NULL || fv == NULL || fk->scores == NULL || fv->accum == NULL) {
        iq_error_set("attention: the CPU backend can't read a %s / %s cache", iq_type_name(layer->type_k),
                     iq_type_name(layer->type_v));
        return false;
    }
    if (iq_kv_type_is_plain(layer->type_k) && iq_cpu_to_float(layer->type_k) == NULL) {
        iq_error_set("attention: no f32 conversion of %s", iq_type_name(layer->type_k));
        return false;
    }
    if (iq_kv_type_is_plain(layer->type_v) && iq_cpu_to_float(layer->type_v) == NULL) {
        iq_error_set("attention: no f32 conversion of %s", iq_type_name(layer->type_v));
        return false;
    }
    return true;
}

// What one thread needs to run items.
struct attn_job {
    struct attn_plan pl;
    const struct iq_tensor * q, * k, * v;
    const struct iq_kv_layer * layer;
    const struct iq_attn_cache_fns * fk, * fv;
    const struct iq_vec_fns * vec;
    float scale;
    float * slots;
};

// The item's stretch [lo, hi) for query block b, against every position a query of the
// block can see. Leaves m, l, o (unnormalised) in slot.
static void attn_item(const struct attn_job * job, int64_t g, int64_t b, int64_t st, float * slot, float * scratch) {
    const struct attn_plan * pl = &job->pl;
    const int64_t hd = pl->hd, r = pl->r, n_past = pl->n_past;
    const int64_t i0 = b * pl->qb;
    const int64_t i1 = i0 + pl->qb < pl->n_tokens ? i0 + pl->qb : pl->n_tokens;
    const int nq = (int) ((i1 - i0) * r);
    float * m = slot, * l = slot + pl->nq_max, * o = slot + 2 * pl->nq_max;
    for (int j = 0; j < nq; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    memset(o, 0, (size_t) nq * (size_t) hd * sizeof(float));
    const int64_t lo = st * pl->stretch;
    const int64_t end = n_past + i1;  // the last query of the block sees positions < end
    const int64_t hi = lo + pl->stretch < end ? lo + pl->stretch : end;
    if (lo >= hi) {
        return;
    }

    float * qs = scratch;                  // nq x hd, scaled queries
    float * s = qs + pl->nq_max * hd;      // nq x IQ_ATTN_TILE, scores then weights
    float * tile = s + pl->nq_max * IQ_ATTN_TILE;
    // query vector j = (query i0 + j / r, head g * r + j % r)
    for (int j = 0; j < nq; j++) {
        const float * src = (const float *) ((const char *) job->q->data + (i0 + j / r) * job->q->nb[2] +
                                             (g * r + j % r) * job->q->nb[1]);
        for (int64_t c = 0; c < hd; c++) {
            qs[j * hd + c] = src[c] * job->scale;
        }
    }
    const int64_t ks = (int64_t) (job->k->nb[2] / sizeof(float));
    const int64_t vs = (int64_t) (job->v->nb[2] / sizeof(float));
    const float * kb = (const float *) ((const char *) job->k->data + g * job->k->nb[1]);  // batch token 0
    const float * vb = (const float *) ((const char *) job->v->data + g * job->v->nb[1]);

    for (int64_t t0 = lo; t0 < hi; t0 += IQ_ATTN_TILE) {
        const int n = (int) (hi - t0 < IQ_ATTN_TILE ? hi - t0 : IQ_ATTN_TILE);
        // positions [t0, t0 + nc) from the cache, [t0 + nc, t0 + n) from the batch
        const int nc = (int) (n_past - t0 <= 0 ? 0 : (n_past - t0 < n ? n_past - t0 : n));
        if (nc > 0) {
            job->fk->scores(job->layer, (int) g, t0, nc, nq, qs, s, IQ_ATTN_TILE, tile);
        }
        if (nc < n) {
            job->vec->scores((int) hd, n - nc, kb + (t0 + nc - n_past) * ks, ks, nq, qs, s + nc, IQ_ATTN_TILE);
        }
        for (int j = 0; j < nq; j++) {
            float * sj = s + j * IQ_ATTN_TILE;
            const int64_t seen = n_past + i0 + j / r + 1 - t0;  // positions of the tile this query sees
            const int nv = (int) (seen <= 0 ? 0 : (seen < n ? seen : n));
            if (nv > 0) {
                const float tile_max = job->vec->max(nv, sj);
                const float mx = tile_max > m[j] ? tile_max : m[j];
                const float alpha = expf(m[j] - mx);
                l[j] = l[j] * alpha + job->vec->exp_sum(nv, sj, sj, mx);
                m[j] = mx;
                if (alpha != 1.0f) {
                    for (int64_t c = 0; c < hd; c++) {
                        o[j * hd + c] *= alpha;
                    }
                }
            }
            memset(sj + nv, 0, (size_t) (n - nv) * sizeof(float));
        }
        if (nc > 0) {
            job->fv->accum(job->layer, (int) g, t0, nc, nq, s, IQ_ATTN_TILE, o, tile);
        }
        if (nc < n) {
            job->vec->accum((int) hd, n - nc, vb + (t0 + nc - n_past) * vs, vs, nq, s + nc, IQ_ATTN_TILE, o);
        }
    }
}

// Merges the stretches of (head g, block b) into dst: out = sum_k e^(m_k - M) o_k / sum_k e^(m_k - M) l_k.
static void attn_merge(const struct attn_job * job, struct iq_tensor * dst, int64_t g, int64_t b) {
    const struct attn_plan * pl = &job->pl;
    const int64_t hd = pl->hd, r = pl->r, i0 = b * pl->qb;
    const int64_t i1 = i0 + pl->qb < pl->n_tokens ? i0 + pl->qb : pl->n_tokens;
    const float * first = job->slots + (size_t) ((g * pl->n_blocks + b) * pl->n_stretch) * pl->slot;
    for (int j = 0; j < (int) ((i1 - i0) * r); j++) {
        float mx = -INFINITY;
        for (int64_t st = 0; st < pl->n_stretch; st++) {
            const float mk = first[st * pl->slot + j];
            mx = mk > mx ? mk : mx;
        }
        float * out = (float *) ((char *) dst->data + (i0 + j / r) * dst->nb[1]) + (g * r + j % r) * hd;
        memset(out, 0, (size_t) hd * sizeof(float));
        float sum = 0.0f;
        for (int64_t st = 0; st < pl->n_stretch; st++) {
            const float * sl = first + st * pl->slot;
            if (sl[pl->nq_max + j] == 0.0f) {
                continue;  // a stretch this query does not reach
            }
            const float w = expf(sl[j] - mx);
            sum += w * sl[pl->nq_max + j];
            const float * o = sl + 2 * pl->nq_max + j * hd;
            for (int64_t c = 0; c < hd; c++) {
                out[c] += w * o[c];
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
        .fk = iq_attn_cache_fns_get(layer->type_k), .fv = iq_attn_cache_fns_get(layer->type_v),
        .vec = iq_vec(), .scale = iq_get_op_param_f32(dst, 1),
    };
    const struct attn_plan * pl = &job.pl;
    job.slots = (float *) (((uintptr_t) p->wdata + 63) & ~(uintptr_t) 63);
    float * scratch = job.slots + (size_t) pl->n_items * pl->slot + (size_t) p->ith * pl->thread;

    for (int64_t it = iq_threadpool_next(p->tp); it < pl->n_items; it = iq_threadpool_next(p->tp)) {
        const int64_t st = it % pl->n_stretch, pair = it / pl->n_stretch;
        attn_item(&job, pair / pl->n_blocks, pair % pl->n_blocks, st, job.slots + (size_t) it * pl->slot, scratch);
    }
    iq_threadpool_barrier(p->tp);
    int64_t a, e;
    iq_cpu_split(pl->n_kv * pl->n_blocks, p->ith, p->nth, &a, &e);
    for (int64_t pair = a; pair < e; pair++) {
        attn_merge(&job, dst, pair / pl->n_blocks, pair % pl->n_blocks);
    }
}

bool iq_cpu_kv_store_supports(const struct iq_tensor * dst) {
    const struct iq_kv_layer * layer = dst->op_ptr;
    const struct iq_attn_cache_fns * fk = iq_attn_cache_fns_get(layer->type_k);
    const struct iq_attn_cache_fns * fv = iq_attn_cache_fns_get(layer->type_v);
    if (fk == NULL || fv == NULL || fk->store == NULL || fv->store == NULL) {
        iq_error_set("kv_store: the CPU backend can't write a %s / %s cache", iq_type_name(layer->type_k),
                     iq_type_name(layer->type_v));
        return false;
    }
    return true;
}

// One item per (K or V, KV head): all of the batch's rows of that head.
void iq_cpu_kv_store(const struct iq_cpu_params * p, struct iq_tensor * dst) {
    struct iq_kv_layer * layer = dst->op_ptr;
    const int32_t n_past = dst->op_params[0];
    const int n_kv = layer->n_kv_head;
    int64_t a, e;
    iq_cpu_split(2 * n_kv, p->ith, p->nth, &a, &e);
    for (int64_t it = a; it < e; it++) {
        const bool is_v = it >= n_kv;
        const int head = (int) (it % n_kv);
        const struct iq_tensor * x = dst->src[is_v ? 2 : 1];
        const struct iq_attn_cache_fns * f = iq_attn_cache_fns_get(is_v ? layer->type_v : layer->type_k);
        f->store(layer, is_v, head, n_past, (int) x->ne[2], (const float *) ((const char *) x->data + head * x->nb[1]),
                 (int64_t) (x->nb[2] / sizeof(float)));
    }
}
