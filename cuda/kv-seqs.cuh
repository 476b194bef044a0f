// The step's sequences as the kernels of the cache ops read them (iq-kv.h): the rows of the
// op's `seqs` input and the page table, both in device memory, and how a launch over several
// sequences finds a CTA's sequence. The host passes shapes only (n_seq, the table's stride);
// counters, token ranges and pages are read here, so a step's launches replay as a CUDA graph.
// The rows are the runtime's (kv_cache_step), trusted as the counters always were on the GPU:
// the CPU backend checks them against the cache (iq_kv_seqs_check), which here would need a
// copy to the host before every step.
#pragma once

#include "iq-kv.h"

#include <stdint.h>

struct iq_cu_seqs {
    const int32_t * rows;   // [n_seq][IQ_KV_S_COUNT] (enum iq_kv_seq_field)
    const int32_t * pages;  // [n_slots][ld]: row `slot` is that slot's page table
    int n_seq, ld;
};

// The seqs and page table sources of a cache op (device addresses).
static inline iq_cu_seqs iq_cu_seqs_of_op(const struct iq_tensor * dst) {
    const struct iq_tensor * s = dst->src[IQ_KV_SRC_SEQS], * p = dst->src[IQ_KV_SRC_PAGES];
    iq_cu_seqs q;
    q.rows = (const int32_t *) s->data;
    q.pages = (const int32_t *) p->data;
    q.n_seq = (int) s->ne[1];
    q.ld = (int) (p->nb[1] / sizeof(int32_t));
    return q;
}

static __device__ __forceinline__ const int32_t * iq_cu_seq_row(const iq_cu_seqs & q, int s) {
    return q.rows + (size_t) s * IQ_KV_S_COUNT;
}

// The page table row of the sequence of step row `row`.
static __device__ __forceinline__ const int32_t * iq_cu_seq_pages(const iq_cu_seqs & q, const int32_t * row) {
    return q.pages + (size_t) row[IQ_KV_S_SLOT] * q.ld;
}

// The sequence whose tokens hold batch row t: the sequences' tokens are one after the other, in
// order (token0 rises), so a binary search.
static __device__ __forceinline__ int iq_cu_seq_of_token(const iq_cu_seqs & q, int t) {
    int lo = 0, hi = q.n_seq - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (q.rows[(size_t) mid * IQ_KV_S_COUNT + IQ_KV_S_TOKEN0] <= t) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// Which sequences one launch of the attention kernels takes, and how it cuts them into work
// items (attention.cu). A sequence of n tokens is taken when n > min_tokens, it is the which-th
// such sequence (which < 0: each one), and fa < 0 or fa == (n * r >= fa_vecs) (1: the sequences
// of the tensor-core kernel, 0: the others). Its tiles of qt tokens each run n_split splits of
// the positions, iq_cu_sched_splits: from the shapes (work, max_split) and the sequence's own
// tile count, so that a sequence is cut alike alone or batched with others and gets the same bits.
struct iq_cu_sched {
    int qt, r;
    int min_tokens, which, fa, fa_vecs;
    int work;       // the CTAs a sequence's (KV head, tile) pairs share: ceil(4 SMs / (KV heads * slots))
    int max_split;  // at most this many splits (by the length a sequence may reach, and the kernels' bound)
};

// A prompt on the tensor-core kernel whose tiles alone give every multiprocessor a CTA (tiles x
// KV heads x slots >= SMs, 4 tiles >= work) runs them unsplit: the merge of the splits cost more than their balance of the
// causal tiles bought (8B shape, pp512 on an H100: 32 tiles x 8 KV heads, 3 splits before;
// docs/BENCHMARKS.md "Prompts without splits"). Decode steps (one tile) split as before.
static __host__ __device__ inline int iq_cu_sched_splits(const iq_cu_sched & sc, int tiles) {
    if (sc.fa == 1 && tiles > 1 && 4 * tiles >= sc.work) {
        return 1;
    }
    const int n = (sc.work + tiles - 1) / tiles;
    return n < 1 ? 1 : n > sc.max_split ? sc.max_split : n;
}

// A CTA's work: tile `tile` (tokens [tile * qt, ...) of the sequence) and split `split` of the
// sequence s (-1: none, the CTA returns), whose batch rows are [token0, token0 + n); with
// n_split > 1 the state of its token i and split k is partial state part0 + k * n + i.
struct iq_cu_item {
    int s, token0, n;
    int tile, split, n_split;
    int part0;
};

// Inclusive prefix sum over the lanes of a warp.
static __device__ __forceinline__ int iq_cu_warp_scan(int x) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        x += lane >= o ? y : 0;
    }
    return x;
}

// Work item y of a launch (t < 0), or the item that holds batch row t (t >= 0, y unused: the
// merge). The sequences go 32 at a time over a warp's lanes, their items and partial states
// summed by warp scans. Every lane of a warp calls it (each warp of a CTA alike, no barrier) and
// gets the same answer.
static __device__ iq_cu_item iq_cu_sched_find(const iq_cu_seqs & q, const iq_cu_sched & sc, int y, int t) {
    const int lane = threadIdx.x % 32;
    iq_cu_item it;
    it.s = -1, it.token0 = it.n = it.tile = it.split = it.part0 = 0, it.n_split = 1;
    int items0 = 0, parts0 = 0, rank0 = 0;
    for (int base = 0; base < q.n_seq; base += 32) {
        const int s = base + lane;
        int n = 0, tok0 = 0;
        if (s < q.n_seq) {
            n = q.rows[(size_t) s * IQ_KV_S_COUNT + IQ_KV_S_N_TOKENS];
            tok0 = q.rows[(size_t) s * IQ_KV_S_COUNT + IQ_KV_S_TOKEN0];
        }
        const int big = s < q.n_seq && n > sc.min_tokens ? 1 : 0;
        const int bigs = iq_cu_warp_scan(big);
        const int rank = rank0 + bigs - big;
        const bool take = big && (sc.which < 0 || rank == sc.which) &&
                          (sc.fa < 0 || (n * sc.r >= sc.fa_vecs) == (sc.fa != 0));
        const int tiles = (n + sc.qt - 1) / sc.qt;
        const int ns = take ? iq_cu_sched_splits(sc, tiles) : 1;
        const int items = take ? tiles * ns : 0;
        const int parts = take && ns > 1 ? n * ns : 0;
        const int ie = items0 + iq_cu_warp_scan(items), pe = parts0 + iq_cu_warp_scan(parts);
        const bool hit = take && (t < 0 ? y >= ie - items && y < ie : t >= tok0 && t < tok0 + n);
        const unsigned m = __ballot_sync(0xffffffffu, hit);
        if (m != 0) {
            const int src = __ffs(m) - 1;
            it.s = base + src;
            it.token0 = __shfl_sync(0xffffffffu, tok0, src);
            it.n = __shfl_sync(0xffffffffu, n, src);
            it.n_split = __shfl_sync(0xffffffffu, ns, src);
            it.part0 = __shfl_sync(0xffffffffu, pe - parts, src);
            const int local = t < 0 ? y - __shfl_sync(0xffffffffu, ie - items, src) : 0;
            it.tile = local / it.n_split;
            it.split = local % it.n_split;
            return it;
        }
        items0 = __shfl_sync(0xffffffffu, ie, 31);
        parts0 = __shfl_sync(0xffffffffu, pe, 31);
        rank0 += __shfl_sync(0xffffffffu, bigs, 31);
    }
    return it;
}
