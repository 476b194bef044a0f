// The quantized cache types (InnerQ innerq2/innerq3/innerq4, KIVI kivi2/kivi4) as a row of the attention
// table: the op hands a range of stored positions and the (scaled) query vectors of one KV
// head; the InnerQ kernels (qcache.h) walk the range's regions. Stores go head by head
// (iq_qcache_store_head) and carry out the runtime's flush plan (flushes happen per head); the
// counters are the runtime's, committed after the graph ran.
#include "attention.h"

#include "qcache.h"
#include "ops.h"

// The prepared query of the last range this thread attended. The op splits a long cache into
// stretches over the threads, so a thread often gets several stretches of one KV head with the
// same query, and preparing it (int8 per key group) costs as much as a few blocks. The key is
// everything the preparation reads, so a hit gives exactly what preparing again would.
struct innerq_prepared {
    int32_t r, head_dim, group;
    enum iq_qaxis axis_k;
    bool correction;
    float q[IQ_INNERQ_MAX_R * IQ_QCACHE_MAX_HEAD_DIM];
    float norm[IQ_QCACHE_MAX_HEAD_DIM];
    struct iq_innerq_query qp;
};
static _Thread_local struct innerq_prepared innerq_last;

static const struct iq_innerq_query * innerq_query(const struct iq_qcache * c, int head, const float * q, int r) {
    struct innerq_prepared * p = &innerq_last;
    const size_t q_bytes = sizeof(float) * (size_t) r * c->head_dim, norm_bytes = sizeof(float) * (size_t) c->head_dim;
    const float * norm = iq_qcache_norm(c, head);
    if (p->r != r || p->head_dim != c->head_dim || p->group != c->cfg.group || p->axis_k != c->cfg.axis_k ||
        p->correction != c->cfg.score_correction || memcmp(p->q, q, q_bytes) != 0 ||
        memcmp(p->norm, norm, norm_bytes) != 0) {
        p->r = iq_innerq_query_prep(c, head, q, r, 1.0f, &p->qp) ? r : 0;
        p->head_dim = c->head_dim;
        p->group = c->cfg.group;
        p->axis_k = c->cfg.axis_k;
        p->correction = c->cfg.score_correction;
        memcpy(p->q, q, q_bytes);
        memcpy(p->norm, norm, norm_bytes);
    }
    return &p->qp;
}

static void innerq_attend(const struct iq_attn_cache * cache, int head, int64_t t0, int64_t t1, int nq, int r,
                          const float * q, float * st, float * scratch) {
    (void) scratch;
    const struct iq_innerq_kernels * kt = iq_innerq_kernels_for(iq_cpu_features_active());
    const struct iq_qcache * qc = &cache->qc;
    const int64_t d = qc->head_dim, ss = iq_attn_state_size(d);
    // The kernels update the states after every block: they work on a copy on this thread's
    // stack, so threads attending neighbouring stretches never write to one cache line.
    float local[IQ_INNERQ_MAX_R * IQ_ATTN_STATE(IQ_QCACHE_MAX_HEAD_DIM)];
    // q holds nq / r queries of r heads each; heads go in passes of at most IQ_INNERQ_MAX_R
    for (int j = 0; j < nq; j += r) {
        for (int h0 = 0; h0 < r; h0 += IQ_INNERQ_MAX_R) {
            const int rr = r - h0 < IQ_INNERQ_MAX_R ? r - h0 : IQ_INNERQ_MAX_R;
            const struct iq_innerq_query * qp = innerq_query(qc, head, q + (j + h0) * d, rr);
            const size_t bytes = sizeof(float) * (size_t) (rr * ss);
            memcpy(local, st + (j + h0) * ss, bytes);
            iq_innerq_attend(kt, qc, head, qp, (int32_t) t0, (int32_t) t1, local);
            memcpy(st + (j + h0) * ss, local, bytes);
        }
    }
}

static void innerq_store_head(const struct iq_attn_cache * cache, int head, const float * k, const float * v,
                              int32_t n, int32_t n_past) {
    (void) n_past;  // the view's counters say where the tokens go
    iq_cpu_install_qsearch();  // what a flush searches with: INNERQ_ISA may have changed
    iq_qcache_store_head(&cache->qc, &cache->flush, head, k, v, n);
}

const struct iq_attn_cache_fns iq_attn_innerq_fns = {
    .attend = innerq_attend,
    .store_head = innerq_store_head,
};
