// Kernels of KV_STORE and ATTENTION over the plain cache types (f32, f16, q8_0, q4_0), for the
// sequences of a step (kv-seqs.cuh): a sequence's positions are rows of the pool through its page
// table, row pages[p / page] * page + p % page (iq_kv_plain_row).
#pragma once

#include "dequant.cuh"
#include "kv-seqs.cuh"

#define IQ_AT_TILE 32    // positions per tile (one per lane when scoring)
#define IQ_AT_WARPS 4
#define IQ_AT_VECS 16    // query vectors per block, IQ_AT_VECS / IQ_AT_WARPS per warp
#define IQ_AT_GROUPS 8   // key groups per head of the score correction (IQ_QCACHE_MAX_GROUPS)

struct iq_cu_attn_args {
    const float * q;              // [hd, n_head, n_tokens]
    size_t q_nb1, q_nb2;
    const float * k, * v;         // the batch's own rows, [hd, n_kv, n_tokens]
    size_t k_nb1, k_nb2, v_nb1, v_nb2;
    const uint8_t * ck, * cv;     // the cache: row (head, row) at head * nb2 + row * nb1
    size_t ck_nb1, ck_nb2, cv_nb1, cv_nb2;
    float * dst;                  // [hd * n_head, n_tokens]
    size_t dst_nb1;
    float * part;                 // partial states {max, sum, acc[hd]} per (partial state, head)
    iq_cu_seqs seqs;              // the step's sequences and page table
    iq_cu_sched sched;            // which of them the launch takes, in which items
    int page;                     // tokens per page of the cache's rows; 0: position p is row p (the
                                  // scratch one sequence of a quantized cache is dequantized into)
    int n_head, r;
    int window;                   // sliding window: a query at position p sees p - window < p' <= p (0: all)
    float scale;
    bool decode;
    // The score correction of a dequantized InnerQ cache (iq_qcache_attend_ref), or dk NULL:
    // dk[(head * n_ctx + p) * ngk + gi] is the f32 step d of key group gi of stored token p
    // (0 outside the quantized region), norm[(slot * n_kv + head) * hd + c] the key normalization;
    // a score loses sum_gi dk^2 * q2_gi / 24, q2_gi = sum_{c in gi} (scale q_c n_c)^2.
    const float * dk, * norm;
    int ngk, group, n_ctx;
};

// A CTA's share of a step's attention: its work item (iq_cu_sched_find of blockIdx.x), its
// sequence's row and pages, its queries [i0, i1) (nvec query vectors) and its rows of the
// batch's q, k and v (the sequence's token i is the batch's row token0 + i). false: a CTA past
// the step's work.
struct iq_cu_attn_cta {
    iq_cu_item it;
    const int32_t * row, * pages;
    int n_past, i0, i1, nvec;
    const char * qb;
    const float * kb, * vb;
};

static __device__ __forceinline__ bool iq_cu_attn_cta_of(const iq_cu_attn_args & a, iq_cu_attn_cta * c) {
    c->it = iq_cu_sched_find(a.seqs, a.sched, (int) blockIdx.x, -1);
    if (c->it.s < 0) {
        return false;
    }
    c->row = iq_cu_seq_row(a.seqs, c->it.s);
    c->pages = iq_cu_seq_pages(a.seqs, c->row);
    c->n_past = c->row[IQ_KV_S_N_PAST];
    c->i0 = c->it.tile * a.sched.qt;
    c->i1 = c->i0 + a.sched.qt < c->it.n ? c->i0 + a.sched.qt : c->it.n;
    c->nvec = (c->i1 - c->i0) * a.r;
    c->qb = (const char *) a.q + (size_t) c->it.token0 * a.q_nb2;
    c->kb = (const float *) ((const char *) a.k + (size_t) c->it.token0 * a.k_nb2);
    c->vb = (const float *) ((const char *) a.v + (size_t) c->it.token0 * a.v_nb2);
    return true;
}

// How far the rows of the tile of positions [t0, t0 + tile) lie from their positions: row p + rb
// holds position p. A tile never straddles a page (pages are whole tiles, attention.cu checks);
// the batch's own positions (t0 >= n_past) are not cache rows.
static __device__ __forceinline__ int64_t iq_cu_rows_off(int page, const int32_t * pages, int64_t t0, int64_t n_past) {
    if (page <= 0 || t0 >= n_past) {
        return 0;
    }
    const int64_t j = t0 / page;
    return ((int64_t) pages[j] - j) * page;
}

// The first position a query at position pos sees (a sliding window of `window`, 0: none).
static __device__ __forceinline__ int64_t iq_cu_window_first(int window, int64_t pos) {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

// One thread per unit of a row of the batch's k or v, stored at its sequence's position n_past +
// (token - token0), in the row its page table gives.
template <int TK, int TV>
__global__ void iq_cu_kv_store(const float * __restrict__ k, size_t k_nb1, size_t k_nb2, const float * __restrict__ v,
                               size_t v_nb1, size_t v_nb2, uint8_t * ck, size_t ck_nb1, size_t ck_nb2, uint8_t * cv,
                               size_t cv_nb1, size_t cv_nb2, const iq_cu_seqs seqs, int page, int n_units) {
    const int i = blockIdx.x, h = blockIdx.y;
    const bool is_v = blockIdx.z == 1;
    const int32_t * row = iq_cu_seq_row(seqs, iq_cu_seq_of_token(seqs, i));
    const int64_t t = row[IQ_KV_S_N_PAST] + (i - row[IQ_KV_S_TOKEN0]);
    const int64_t at = (int64_t) iq_cu_seq_pages(seqs, row)[t / page] * page + t % page;
    for (int u = threadIdx.x; u < n_units; u += blockDim.x) {
        float x[32];
        const float * src = (const float *) ((const char *) (is_v ? v : k) + i * (is_v ? v_nb2 : k_nb2) +
                                             h * (is_v ? v_nb1 : k_nb1)) + 32 * u;
#pragma unroll
        for (int j = 0; j < 32; j++) x[j] = src[j];
        if (is_v) {
            iq_cu_store_unit<TV>(x, cv + h * cv_nb2 + at * cv_nb1, u);
        } else {
            iq_cu_store_unit<TK>(x, ck + h * ck_nb2 + at * ck_nb1, u);
        }
    }
}

// Shared memory of iq_cu_attention: queries, a K and a V tile, the score correction's sums.
static inline size_t iq_cu_attention_smem(int C) {
    return ((size_t) (IQ_AT_VECS + 2 * IQ_AT_TILE) * (32 * C + 1) + IQ_AT_VECS * IQ_AT_GROUPS) * sizeof(float);
}

// Online-softmax state of a warp's query vector: lane holds channels lane + 32 c.
template <int C>
struct iq_cu_attn_state {
    float m, l, acc[C];
};

// Adds one position's probability pr (this lane's) ... : state update with scores of the 32
// lanes' positions (score -inf: not visible) and their value rows vrow(jj).
template <int C>
static __device__ __forceinline__ void iq_cu_attn_add(iq_cu_attn_state<C> & st, float score, const float * vs,
                                                      int ld, int lane) {
    float mx = score;
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (mx == -INFINITY) {
        return;
    }
    const float m_new = fmaxf(st.m, mx);
    const float alpha = expf(st.m - m_new);
    const float pr = expf(score - m_new);
    float sum = pr;
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    st.l = st.l * alpha + sum;
    st.m = m_new;
#pragma unroll
    for (int c = 0; c < C; c++) st.acc[c] *= alpha;
    for (int jj = 0; jj < 32; jj++) {
        const float pj = __shfl_sync(0xffffffffu, pr, jj);
        if (pj != 0.0f) {
#pragma unroll
            for (int c = 0; c < C; c++) st.acc[c] += pj * vs[jj * ld + lane + 32 * c];
        }
    }
}

// Flash attention, one block per (work item, KV head): an item is a tile of qt queries of a
// sequence and a split of its positions (iq_cu_sched_find). The block's r * qt query vectors (the
// r query heads of a KV head times the queries) share every K / V tile, which the block
// dequantizes into shared memory (f32 rows of hd + 1, so that lane j reading row j hits its own
// bank). Warp w scores vectors w, w + 4, ...: lane j the tile's position j, then adds the tile's
// values to its state. With one split the block writes the output; with more, partial states
// that iq_cu_attn_merge combines exactly. The sequence's rows and counters are read from device
// memory, so the launch is the same for every token of a decode.
// The batch's rows before a query's own are rounded as type RK / RV stores them (decode
// semantics): the cache's types, or f16 for a quantized cache read from dequantized scratch.
template <int TK, int TV, int C, int RK = TK, int RV = TV>
__global__ void __launch_bounds__(32 * IQ_AT_WARPS) iq_cu_attention(const iq_cu_attn_args a) {
    constexpr int HD = 32 * C, LD = HD + 1;
    extern __shared__ float sm[];
    float * qs = sm;                   // IQ_AT_VECS x LD
    float * ks = qs + IQ_AT_VECS * LD;  // IQ_AT_TILE x LD
    float * vs = ks + IQ_AT_TILE * LD;
    float * q2s = vs + IQ_AT_TILE * LD;  // IQ_AT_VECS x IQ_AT_GROUPS (score correction)
    const int g = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    iq_cu_attn_cta cta;
    if (!iq_cu_attn_cta_of(a, &cta)) {
        return;
    }
    const auto [it, row, pages, n_past, i0, i1, nvec, qb, kb, vb] = cta;

    for (int e = tid; e < IQ_AT_VECS * HD; e += blockDim.x) {
        const int j = e / HD, c = e % HD;
        qs[j * LD + c] = j < nvec ? ((const float *) (qb + (i0 + j / a.r) * a.q_nb2 + (g * a.r + j % a.r) * a.q_nb1))[c] * a.scale
                                  : 0.0f;
    }
    if (a.dk != nullptr) {
        __syncthreads();  // qs written
        const float * nr = a.norm + ((int64_t) row[IQ_KV_S_SLOT] * gridDim.y + g) * HD;
        for (int item = tid; item < nvec * a.ngk; item += blockDim.x) {
            const int j = item / a.ngk, gi = item % a.ngk;
            float q2 = 0.0f;
            for (int c = gi * a.group; c < (gi + 1) * a.group; c++) {
                const float qn = qs[j * LD + c] * nr[c];
                q2 += qn * qn;
            }
            q2s[j * IQ_AT_GROUPS + gi] = q2;
        }
    }
    const int64_t end = n_past + i1;  // the block's last query sees positions < end
    // under a sliding window the block's first query sees positions >= first, the others fewer:
    // the splits cover [first's tile, end), and rows below first are never read (a quantized
    // cache's scratch holds no rows for blocks such a layer does not have)
    const int64_t first = iq_cu_window_first(a.window, n_past + i0);
    const int64_t begin = first / IQ_AT_TILE * IQ_AT_TILE;
    const int64_t chunk = ((end - begin + it.n_split - 1) / it.n_split + IQ_AT_TILE - 1) / IQ_AT_TILE * IQ_AT_TILE;
    const int64_t lo = begin + it.split * chunk;
    const int64_t hi = lo + chunk < end ? lo + chunk : end;

    constexpr int VPW = IQ_AT_VECS / IQ_AT_WARPS;
    iq_cu_attn_state<C> st[VPW];
#pragma unroll
    for (int w = 0; w < VPW; w++) {
        st[w].m = -INFINITY;
        st[w].l = 0.0f;
#pragma unroll
        for (int c = 0; c < C; c++) st[w].acc[c] = 0.0f;
    }
    for (int64_t t0 = lo; t0 < hi; t0 += IQ_AT_TILE) {
        __syncthreads();  // the previous tile is read (and qs written, the first time)
        const int64_t rb = iq_cu_rows_off(a.page, pages, t0, n_past);
        for (int item = tid; item < 2 * C * IQ_AT_TILE; item += blockDim.x) {
            const int rw = item % IQ_AT_TILE, u = item / IQ_AT_TILE % C;
            const bool is_v = item >= C * IQ_AT_TILE;
            const int64_t p = t0 + rw;
            float y[32];
            if (p >= hi || p < first) {
#pragma unroll
                for (int j = 0; j < 32; j++) y[j] = 0.0f;
            } else if (p < n_past) {
                if (is_v) {
                    iq_cu_unit<TV>(a.cv + g * a.cv_nb2 + (p + rb) * a.cv_nb1, u, y);
                } else {
                    iq_cu_unit<TK>(a.ck + g * a.ck_nb2 + (p + rb) * a.ck_nb1, u, y);
                }
            } else {
                const float * src = is_v ? vb + ((p - n_past) * a.v_nb2 + g * a.v_nb1) / sizeof(float)
                                         : kb + ((p - n_past) * a.k_nb2 + g * a.k_nb1) / sizeof(float);
#pragma unroll
                for (int j = 0; j < 32; j++) y[j] = src[32 * u + j];
                if (a.decode) {  // rows before a query's own, as the cache will hold them
                    if (is_v) {
                        iq_cu_round_unit<RV>(y);
                    } else {
                        iq_cu_round_unit<RK>(y);
                    }
                }
            }
            float * dst = (is_v ? vs : ks) + rw * LD + 32 * u;
#pragma unroll
            for (int j = 0; j < 32; j++) dst[j] = y[j];
        }
        __syncthreads();
#pragma unroll
        for (int w = 0; w < VPW; w++) {
            const int j = warp + IQ_AT_WARPS * w;
            if (j >= nvec) {
                break;
            }
            const int64_t pos = n_past + i0 + j / a.r;
            const int64_t visible = pos + (a.decode ? 0 : 1);  // positions < visible
            const int64_t p = t0 + lane;
            float score = -INFINITY;
            if (p < hi && p < visible && p >= iq_cu_window_first(a.window, pos)) {
                float s = 0.0f;
#pragma unroll 8
                for (int c = 0; c < HD; c++) s += qs[j * LD + c] * ks[lane * LD + c];
                if (a.dk != nullptr && p < n_past) {
                    const float * d = a.dk + ((int64_t) g * a.n_ctx + p) * a.ngk;
                    float bias = 0.0f;
                    for (int gi = 0; gi < a.ngk; gi++) {
                        bias += d[gi] * d[gi] * q2s[j * IQ_AT_GROUPS + gi] / 24.0f;
                    }
                    s -= bias;
                }
                score = s;
            }
            iq_cu_attn_add<C>(st[w], score, vs, LD, lane);
        }
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < VPW; w++) {
        const int j = warp + IQ_AT_WARPS * w;
        if (j >= nvec) {
            break;
        }
        const int i = i0 + j / a.r, head = g * a.r + j % a.r;
        const int64_t own = n_past + i;
        if (a.decode && own >= lo && own < hi) {
            // decode semantics: the query's own row, unrounded
            const float * kr = kb + (i * a.k_nb2 + g * a.k_nb1) / sizeof(float);
            const float * vr = vb + (i * a.v_nb2 + g * a.v_nb1) / sizeof(float);
            float s = 0.0f;
#pragma unroll
            for (int c = 0; c < C; c++) s += qs[j * LD + lane + 32 * c] * kr[lane + 32 * c];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            // the row goes through shared memory as lane 0's position of a one-row tile
            float * vrow = ks + warp * LD;  // free now: every warp is past the tile loop
            __syncwarp();
#pragma unroll
            for (int c = 0; c < C; c++) vrow[lane + 32 * c] = vr[lane + 32 * c];
            __syncwarp();
            iq_cu_attn_add<C>(st[w], lane == 0 ? s : -INFINITY, vrow, LD, lane);
            __syncwarp();
        }
        if (it.n_split == 1) {
            float * out = a.dst + ((it.token0 + i) * a.dst_nb1) / sizeof(float) + head * HD;
            const float inv = 1.0f / st[w].l;
#pragma unroll
            for (int c = 0; c < C; c++) out[lane + 32 * c] = st[w].acc[c] * inv;
        } else {
            float * part = a.part + (((int64_t) it.part0 + (int64_t) it.split * it.n + i) * a.n_head + head) * (HD + 2);
            if (lane == 0) {
                part[0] = st[w].m;
                part[1] = st[w].l;
            }
#pragma unroll
            for (int c = 0; c < C; c++) part[2 + lane + 32 * c] = st[w].acc[c];
        }
    }
}

// Each batch row t (blockIdx.y) and head: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s
// over the splits of t's sequence that saw any position (l_s > 0), the sums in the order of s;
// rows of sequences the launch did not take, or did not split, are not its to write. A block
// of 128 threads takes hpb heads (blockIdx.x: heads hpb x ..), 128 / hpb threads each: hpb = 4
// for batches, 1 for a few rows. The splits' (m, l) come to shared memory in one round of loads
// and their weights e^(m_s - M) are made once; a channel's acc_s are loaded 16 at a time: the
// same sums, in the same order, as a thread per channel walking the splits with each step's
// loads waiting on the one before, whose 64 splits of a decode step took 24.5 us a layer on an
// H100, 14% of an 8B model's step at depth 32768 (this one: the step 1.07x, docs/BENCHMARKS.md).
// A 512-token prompt's 3 splits take ~45 us a layer either way (16,384 blocks of one head, or
// 4,096 of four at 95 registers: five blocks per multiprocessor): what is left to win there.
#define IQ_MERGE_THREADS 128
#define IQ_MERGE_MAX_HEADS 4   // hpb at most
#define IQ_MERGE_MAX_SPLIT 128  // splits at most (attention.cu: IQ_AT_MAX_SPLIT)
__global__ void __launch_bounds__(IQ_MERGE_THREADS) iq_cu_attn_merge(const float * __restrict__ part, float * dst,
                                                                      size_t dst_nb1, const iq_cu_seqs seqs,
                                                                      const iq_cu_sched sc, int n_head, int hd, int hpb) {
    __shared__ float sm_m[IQ_MERGE_MAX_HEADS][IQ_MERGE_MAX_SPLIT], sm_l[IQ_MERGE_MAX_HEADS][IQ_MERGE_MAX_SPLIT];
    __shared__ float sm_w[IQ_MERGE_MAX_HEADS][IQ_MERGE_MAX_SPLIT];
    const int per = IQ_MERGE_THREADS / hpb, hb = threadIdx.x / per, lane = threadIdx.x % per;
    const int head = hpb * blockIdx.x + hb, t = blockIdx.y;
    const iq_cu_item it = iq_cu_sched_find(seqs, sc, 0, t);
    if (it.s < 0 || it.n_split == 1) {  // the block's row: the same for every thread
        return;
    }
    const bool on = head < n_head;
    const int n_split = it.n_split;
    const int64_t stride = (int64_t) it.n * n_head * (hd + 2);
    const float * first =
        part + ((int64_t) it.part0 + (t - it.token0)) * n_head * (hd + 2) + (int64_t) (on ? head : 0) * (hd + 2);
    float * ms = sm_m[hb], * ls = sm_l[hb], * ws = sm_w[hb];
    for (int s = lane; s < n_split; s += per) {
        ms[s] = on ? first[s * stride] : 0.0f;
        ls[s] = on ? first[s * stride + 1] : 0.0f;
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int s = 0; s < n_split; s++) {
        if (ls[s] > 0.0f) mx = fmaxf(mx, ms[s]);
    }
    for (int s = lane; s < n_split; s += per) {
        ws[s] = ls[s] > 0.0f ? expf(ms[s] - mx) : 0.0f;
    }
    __syncthreads();
    if (!on) {
        return;
    }
    float sum = 0.0f;
    for (int s = 0; s < n_split; s++) {
        if (ls[s] > 0.0f) sum += ws[s] * ls[s];
    }
    float * out = dst + (t * dst_nb1) / sizeof(float) + (int64_t) head * hd;
    for (int c = lane; c < hd; c += per) {
        float acc = 0.0f;
        for (int s0 = 0; s0 < n_split; s0 += 16) {
            float x[16];
#pragma unroll
            for (int i = 0; i < 16; i++) {
                x[i] = s0 + i < n_split ? first[(s0 + i) * stride + 2 + c] : 0.0f;
            }
#pragma unroll
            for (int i = 0; i < 16; i++) {
                if (s0 + i < n_split && ls[s0 + i] > 0.0f) acc += ws[s0 + i] * x[i];
            }
        }
        out[c] = acc / sum;
    }
}
