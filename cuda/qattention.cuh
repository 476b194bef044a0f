// Shared pieces of the fused decode attention over the InnerQ cache (qattention.cu, the
// CTA-per-split kernel with dp4a; qattention-mma.cu, the warp-per-split kernel on tensor
// cores): the arguments, the shared-memory layout of a CTA, small device helpers and the
// window CTAs (sink, recent window and the batch's own rows, f32), which both kernels run.
// Both run the sequences of a step of up to IQ_QA_MAX_Q tokens in one launch: grid z is the
// sequence, whose view (qa_seq_view) a CTA takes from the step's rows in device memory.
#pragma once

#include "kv-seqs.cuh"
#include "launch.cuh"
#include "ops.h"

#include "iq-qcache.h"

#include <cuda_fp16.h>
#include <stdint.h>

#define IQ_QA_G 32
#define IQ_QA_STAGES 4
#define IQ_QA_MAX_SPLIT 256   // CTA kernel: splits per head
#define IQ_QA_MAX_WIN 4       // CTA kernel: window CTAs per head up to 128 window rows
#define IQ_QW_MAX_SPLIT 384   // warp kernel (qattention-mma.cu): warp splits per head
#define IQ_QW_MAX_WIN 64      // warp kernel: window CTAs per head
#define IQ_QW_WIN_ROWS 64     // warp kernel: one window CTA per this many window rows
#define IQ_QA_MAX_PARTS (IQ_QW_MAX_SPLIT + IQ_QW_MAX_WIN)  // states the merge takes
#define IQ_QA_SPLIT_BLOCKS 16 // several slots: a split holds this many blocks of a slot's length, or fewer
#define IQ_QA_MERGE_THREADS 512
#define IQ_QA_MERGE_FEW 64     // ... where no sequence has more than IQ_QA_FEW_PARTS parts
#ifndef IQ_QA_FEW_PARTS
#define IQ_QA_FEW_PARTS 64
#endif

// The arguments of a launch. A CTA's sequence is blockIdx.z; the fields marked "view" are that
// sequence's, set by qa_seq_view: offsets into the pointers, which stay the launch's (kernel
// parameters: no registers held for them).
struct iq_qa_args {
    const float * q;             // [D, n_head, n_tokens]
    size_t q_nb1, q_nb2;
    const float * k, * v;        // the batch's own rows, [D, n_kv, n_tokens]
    size_t k_nb1, k_nb2, v_nb1, v_nb2;
    const float * norm;          // [n_slots][n_kv][D]
    const uint16_t * sink_k, * sink_v, * recent_k, * recent_v;  // [n_slots][n_kv][rows][D]
    const uint8_t * quant_k, * quant_v;  // [n_kv][cap_blocks] blocks of the pool
    int s_cap, cap_recent, cap_blocks;
    float * part;                // states {max, sum, acc[D]} of (part, sequence s, its query i, head) at
                                 // ((part * part_rows + s * q_max + i) * n_head + head) * (D + 2)
    iq_cu_seqs seqs;             // the step's sequences and the page table
    int n_kv, q_max, part_rows;  // q_max: the most tokens of a sequence the launch takes; part_rows = n_seq * q_max
    bool mma_ok;                 // the warp kernel takes the sequences of up to 8 query vectors (qa_takes)
    int n_head, r, n_split, n_win;
    const int32_t * pages;       // view: the sequence's page table row (block j is quantized page pages[j]) ...
    int tok0, hs0, n_q, nvec;    // ... its first batch row, its slot's first head (slot * n_kv), tokens, query vectors
    int merge_warps;             // warp kernel: splits a CTA merges into one state (1: none)
    bool win_tiles;              // window chunks of stored rows through shared-memory tiles (qa_window)
    int window;                  // sliding window (iq_kv_layer.window): a layer without blocks, masked in qa_window
    float scale;
    bool decode, correction;
    // the blocks' format (the CTA kernel; the warp kernel takes fp16 parameters only): bytes of a
    // key / value block, 8-bit group parameters, value row scales, and 8-byte copies where a
    // block's bytes are not a multiple of 16
    int kb, vb;
    bool p8, rows, cp8;
};

// The quantized splits of a wave of `slots` CTAs per KV head (nw warps per CTA, splits counted in
// warps) once the n_win window CTAs have theirs; at least half the wave stays with the splits.
static inline int qa_splits_in_wave(int slots, int n_win, int nw) {
    const int free_ctas = slots - n_win;
    return (free_ctas >= slots / 2 ? free_ctas : slots / 2) * nw;
}

// The window rows a schedule counts: sink, recent window and one query's batch rows twice (a
// sequence of more tokens has a few rows more; its window CTAs stride over them alike), so that
// a sequence's schedule does not depend on the step.
static inline int qa_win_rows(int s_cap, int cap_recent) { return s_cap + cap_recent + 2; }

static constexpr int qa_round16(int x) { return (x + 15) / 16 * 16; }
static constexpr int qa_max(int a, int b) { return a > b ? a : b; }

// A window CTA's tiles: the K and V rows of a chunk of 32 stored window rows, f16, rows padded
// by 16 bytes (LD halves) so that the lanes of a key read (lane = row, 16 bytes each) meet
// distinct banks.
template <int D>
struct qa_wtile {
    static constexpr int LD = D + 8;
    static constexpr int bytes = 2 * 32 * LD * 2;
};

// Shared memory of a CTA (bytes): packed queries, per-group query terms, score partials,
// probabilities, then the cp.async stages (quantized splits) or the f32 query and the row
// tiles (window CTA). F: the CTA kernel of the block formats (8-bit parameters, value row
// scales), whose stages have room for the largest; without it a stage is a block pair of fp16
// parameters exactly.
template <int D, int BK, int BV, int NV, bool F = true>
struct qa_smem {
    static constexpr int NG = D / 32;
    static constexpr int KC = D * IQ_QA_G * BK / 8, VC = D * IQ_QA_G * BV / 8;  // bytes of a block's codes
    static constexpr int KB = KC + 4 * D;  // block bytes: codes, then d[D], m[D] (fp16; 8-bit ones take fewer)
    static constexpr int VB = VC + 4 * D + (F ? IQ_QA_G : 0);  // ... then a value block's row scales, if it has them
    static constexpr int SB = KB + VB;  // a stage's room: the most a block pair of its formats takes
    static constexpr int qh = 0;                         // int8 [NV][D] query hi parts
    static constexpr int ql = qh + NV * D;               // int8 [NV][D] lo parts
    static constexpr int qa = ql + NV * D;               // float [NV][NG] sq / 254
    static constexpr int qs = qa + NV * NG * 4;          // float [NV][NG] sum q~
    static constexpr int q2 = qs + NV * NG * 4;          // float [NV][NG] score correction term
    static constexpr int sp = qa_round16(q2 + NV * NG * 4);  // float [NG][NV][32] score partials
    static constexpr int e = sp + NG * NV * 32 * 4;      // float [NV][32] probabilities (windows)
    static constexpr int ph = e + NV * 32 * 4;           // u8 [NV][32] probabilities, hi byte
    static constexpr int pl = ph + NV * 32;              // u8 [NV][32] lo byte
    static constexpr int al = qa_round16(pl + NV * 32);  // float [NV] rescale of the accumulators
    static constexpr int ps = al + NV * 4;               // float [NV] sum of the block's weights (times row scales)
    static constexpr int wm = ps + NV * 4;               // float [NV] the weights' unit (row scales: F only)
    static constexpr int u = qa_round16(F ? wm + NV * 4 : wm);  // without F no wm slot: 12e9438's offsets
    static constexpr int total = u + qa_max(IQ_QA_STAGES * SB, NV * D * 4 + qa_wtile<D>::bytes);
};

static __device__ __forceinline__ float qa_h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }

static __device__ __forceinline__ float qa_warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
static __device__ __forceinline__ float qa_warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

static __device__ __forceinline__ void qa_cp16(void * smem, const void * gmem) {
    const unsigned s = (unsigned) __cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
static __device__ __forceinline__ void qa_cp8(void * smem, const void * gmem) {
    const unsigned s = (unsigned) __cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem));
}
static __device__ __forceinline__ void qa_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
static __device__ __forceinline__ void qa_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// One key group of the query, warp-wide (lane = channel of the group): q~ = scale * q (.) n as
// two int8 parts hi + lo / 254 in steps of amax / 127, the step of the lo part (amax / 127 / 254),
// sum q~ and the score correction's sum q~^2 / 24 (0 when it is off). Both fused kernels.
struct qa_qgroup {
    int8_t hi, lo;
    float step, sum, q2;
};
static __device__ __forceinline__ qa_qgroup qa_query_group(float qn, bool correction) {
    qa_qgroup r;
    const float amax = qa_warp_max(fabsf(qn));
    r.sum = qa_warp_sum(qn);
    const float sum2 = qa_warp_sum(qn * qn);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    float x = qn * inv;
    x = fminf(fmaxf(x, -127.0f), 127.0f);  // also NaN -> -127 .. 127 (fmaxf drops NaN)
    const float hi = rintf(x);
    r.hi = (int8_t) (int) hi;
    r.lo = (int8_t) (int) fminf(fmaxf(rintf((x - hi) * 254.0f), -127.0f), 127.0f);
    r.step = amax / 127.0f / 254.0f;
    r.q2 = correction ? sum2 / 24.0f : 0.0f;
    return r;
}

// Whether a kernel takes a sequence of n tokens: up to q_max (IQ_QA_MAX_Q), the warp kernel
// (mma) those of up to 8 query vectors where it applies (mma_ok), the CTA kernel the others.
static __host__ __device__ inline bool qa_takes(int n, int r, int q_max, bool mma_ok, bool mma) {
    return n <= q_max && (mma_ok && n * r <= 8) == mma;
}

// A counter of the CTA's sequence (blockIdx.z): its row of the step (enum iq_kv_seq_field).
static __device__ __forceinline__ int qa_count(const iq_qa_args & a, int field) {
    return a.seqs.rows[(size_t) blockIdx.z * IQ_KV_S_COUNT + field];
}

// Sequence blockIdx.z of the step as the fused kernels see it (the view fields of a): its page
// table row, its first batch row, its slot's first head, its tokens and query vectors; false if
// the launch does not take it (qa_takes).
static __device__ __forceinline__ bool qa_seq_view(iq_qa_args & a, bool mma) {
    const int32_t * row = iq_cu_seq_row(a.seqs, (int) blockIdx.z);
    const int n = row[IQ_KV_S_N_TOKENS];
    if (!qa_takes(n, a.r, a.q_max, a.mma_ok, mma)) {
        return false;
    }
    a.pages = iq_cu_seq_pages(a.seqs, row);
    a.tok0 = row[IQ_KV_S_TOKEN0];
    a.hs0 = row[IQ_KV_S_SLOT] * a.n_kv;
    a.n_q = n;
    a.nvec = n * a.r;
    return true;
}

// The state of part `part`, the CTA's sequence's query i and query head `head` (a.part's layout).
template <int D>
static __device__ __forceinline__ float * qa_state(const iq_qa_args & a, int part, int i, int head) {
    return a.part + (((size_t) part * a.part_rows + (size_t) blockIdx.z * a.q_max + i) * a.n_head + head) * (D + 2);
}

// Window row x of KV head h as the two places it may come from, both always valid addresses:
// an f16 row (sink, then recent; clamped into them past the stored rows) and an f32 row of the
// batch (clamped likewise), with which one holds it. Element c is then two unconditional loads
// and a select (qa_win_at), so the 32 loads of a chunk are in flight together: a branch per
// element made them one after the other (about 13 us per chunk of 32 rows).
struct qa_win_row {
    const uint16_t * hp;  // f16 row
    const float * fp;     // f32 batch row
    bool stored, rounded, live;
};
static __device__ __forceinline__ qa_win_row qa_win_row_of(const iq_qa_args & a, bool is_v, int h, int x, int n_sink,
                                                           int n_stored, int n_rows, int D) {
    qa_win_row r;
    const int xs = x < n_stored ? x : (n_stored > 0 ? n_stored - 1 : 0);
    const size_t hs = (size_t) (a.hs0 + h);  // the sequence's slot's head h
    r.hp = xs < n_sink ? (is_v ? a.sink_v : a.sink_k) + (hs * a.s_cap + xs) * D
                       : (is_v ? a.recent_v : a.recent_k) + (hs * a.cap_recent + (xs - n_sink)) * D;
    const int bx = x - n_stored;
    r.rounded = bx < a.n_q;  // the batch rows rounded to f16 (as the window will hold them) come first
    int b = r.rounded ? bx : bx - a.n_q;
    b = (b < 0 ? 0 : b >= a.n_q ? a.n_q - 1 : b) + a.tok0;  // the batch's row
    r.fp = is_v ? a.v + (b * a.v_nb2 + h * a.v_nb1) / sizeof(float) : a.k + (b * a.k_nb2 + h * a.k_nb1) / sizeof(float);
    r.stored = x < n_stored;
    r.live = x < n_rows;
    return r;
}
static __device__ __forceinline__ float qa_win_at(const qa_win_row & r, int c) {
    const float hv = qa_h2f(r.hp[c]);
    const float fv = r.fp[c];
    const float y = r.stored ? hv : r.rounded ? __half2float(__float2half_rn(fv)) : fv;
    return r.live ? y : 0.0f;
}

// Tensor-core pieces of the window chunks (qa_window with TC): four 8x8 f16 matrices from shared
// memory (row addresses from lanes 8 i .. 8 i + 7 for matrix i), plain or transposed, and the
// m16n8k16 product with f16 operands and f32 accumulators (the PTX ISA's fragment layouts).
static __device__ __forceinline__ void qa_ldsm4(uint32_t (&r)[4], const void * p, bool trans) {
    const unsigned s = (unsigned) __cvta_generic_to_shared(p);
    if (trans) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(s)
                     : "memory");
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(s)
                     : "memory");
    }
}
static __device__ __forceinline__ void qa_mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// x0, x1 (f32) as f16 hi and lo parts, packed in pairs: x = hi + lo within ~2^-22 |x| (|x| up
// to 2^14 here, the parts normal for |x| >= 2^-3).
static __device__ __forceinline__ void qa_split_f16x2(float x0, float x1, uint32_t & hi, uint32_t & lo) {
    const __half h0 = __float2half_rn(x0), h1 = __float2half_rn(x1);
    const __half l0 = __float2half_rn(x0 - __half2float(h0)), l1 = __float2half_rn(x1 - __half2float(h1));
    hi = (uint32_t) __half_as_ushort(h0) | (uint32_t) __half_as_ushort(h1) << 16;
    lo = (uint32_t) __half_as_ushort(l0) | (uint32_t) __half_as_ushort(l1) << 16;
}

// Window CTA `part` (< a.n_win) of KV head h: the sink and recent rows (f16) and the batch's
// own rows (f32) in chunks of 32 rows, chunk part, part + n_win, ...; rows before a query's own
// rounded to f16 with decode semantics, its own row unrounded (cpu/ops-attention.c attn_item).
// A sliding window (a.window > 0) masks a query's rows at positions below its window's; SW =
// false compiles the mask out (the warp kernel, whose layers have blocks and so no sliding window).
// D threads; thread c holds channel c of every vector's accumulator, warp w the states of
// vectors w, w + D/32, ...
// NB = 2 (the warp kernel, whose shared memory has room): two tile buffers, the next chunk's
// copies in flight while this one is computed, so a window CTA waits one memory latency per
// CTA rather than one per chunk (a window CTA of the default windows at 131072 tokens takes
// some 20 chunks). TC (the warp kernel): the tiled chunks' products on tensor cores, f16
// m16n8k16 with f32 accumulation; the rows are f16 as stored, the query (scaled per vector by a
// power of two into f16's range) and the probabilities (times 2^10) go in as f16 hi + lo parts,
// two products each, so the scores and sums carry ~2^-22 of the operands' rounding: some 150
// instructions per warp and chunk where the f32 loops take ~550. Why: the default windows
// (10,242 rows per KV head at 131072 tokens) are 28% of the bytes, and the decode step is
// issue-bound. The accumulators live in the mma's layout (thread: channels 16 mt + gid, + 8, of
// vectors 2 tig, 2 tig + 1) until the first chunk that is not tiled (the batch's rows, with
// its own row unrounded), then in thread c's as the f32 path keeps them.
template <int D, int NV, int NB = 1, bool TC = false, bool F = true, bool SW = true>
static __device__ void qa_window(const iq_qa_args & a, int h, int part, uint8_t * sm, float (&acc)[NV], float * mx,
                                 float * ls) {
    static_assert(NB == 1 || NB == 2, "one or two tile buffers");
    static_assert(!TC || (NV <= 8 && D / 16 == 2 * (D / 32)), "an 8-column B tile; two 16-channel tiles per warp");
    using L = qa_smem<D, 2, 2, NV, F>;  // the offsets used here depend on F, not on the bits
    constexpr int NW = D / 32, NG = L::NG, NVW = (NV + NW - 1) / NW;
    float * sp = (float *) (sm + L::sp);
    float * es = (float *) (sm + L::e);
    float * al = (float *) (sm + L::al);
    uint8_t * un = sm + L::u;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, nvec = a.nvec;
    const int n_past = qa_count(a, IQ_KV_S_N_PAST), n_sink = qa_count(a, IQ_KV_S_N_SINK);
    const int n_quant = qa_count(a, IQ_KV_S_N_QUANT);
    // the windows and the batch rows, f32, in chunks of 32 rows
    const int n_recent = n_past - n_sink - n_quant;
    const int n_stored = n_sink + n_recent;
    const int n_rows = n_stored + 2 * a.n_q;
    float * qf = (float *) un;  // [NV][D] scale * q
    for (int e = tid; e < nvec * D; e += D) {
        const int j = e / D, c = e % D, i = j / a.r, head = h * a.r + j % a.r;
        qf[e] = a.q[((a.tok0 + i) * a.q_nb2 + head * a.q_nb1) / sizeof(float) + c] * a.scale;
    }
    constexpr int LD = qa_wtile<D>::LD;
    uint16_t * const tiles0 = (uint16_t *) (un + NV * D * 4);  // per buffer: [32][LD] keys, then values
    const int gid = lane >> 2, tig = lane & 3, l8 = lane & 7, mi = lane >> 3;
    uint32_t qb[2][2][2];     // TC: B fragments of the query, k-step, hi / lo, register (vector gid)
    float qinv0 = 1.0f, qinv1 = 1.0f;  // TC: the power of two vectors 2 tig, 2 tig + 1 were scaled by, undone
    float accf[2][4];         // TC: accumulators, channel tiles 2 warp + mt2 (see above)
    bool frag = TC;           // TC: the accumulators are in accf
    if (TC) {
        __syncthreads();  // qf written
        float sgid = 0.0f;
#pragma unroll
        for (int j = 0; j < NV; j++) {
            float m = 0.0f;
            for (int c = lane; c < D && j < nvec; c += 32) m = fmaxf(m, fabsf(qf[j * D + c]));
            m = qa_warp_max(m);
            int e = 0;
            (void) frexpf(m, &e);  // m < 2^e
            const float sc = m > 0.0f && m < INFINITY ? ldexpf(1.0f, 14 - e) : 1.0f;
            sgid = j == gid ? sc : sgid;
            qinv0 = j == 2 * tig ? 1.0f / sc : qinv0;
            qinv1 = j == 2 * tig + 1 ? 1.0f / sc : qinv1;
        }
#pragma unroll
        for (int ks = 0; ks < 2; ks++) {
            const float * qr = qf + gid * D + 32 * warp + 16 * ks + 2 * tig;
            const bool on = gid < nvec;
            qa_split_f16x2(on ? qr[0] * sgid : 0.0f, on ? qr[1] * sgid : 0.0f, qb[ks][0][0], qb[ks][1][0]);
            qa_split_f16x2(on ? qr[8] * sgid : 0.0f, on ? qr[9] * sgid : 0.0f, qb[ks][0][1], qb[ks][1][1]);
        }
#pragma unroll
        for (int mt = 0; mt < 2; mt++) {
#pragma unroll
            for (int r = 0; r < 4; r++) accf[mt][r] = 0.0f;
        }
    }
    // TC: the accumulators from accf into thread c's acc[], through sp (free between chunks)
    auto unfrag = [&]() {
        __syncthreads();  // sp is read
#pragma unroll
        for (int mt2 = 0; mt2 < 2; mt2++) {
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int j = 2 * tig + (r & 1), c = 16 * (2 * warp + mt2) + gid + 8 * (r >> 1);
                if (j < NV) sp[j * D + c] = accf[mt2][r];
            }
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < NV; j++) acc[j] = sp[j * D + tid];
        frag = false;
    };
    // a chunk of 32 stored rows: its K and V rows into buffer b's tiles at once (16-byte copies,
    // coalesced along each row), one memory latency for the chunk; other chunks (the batch's
    // rows, the end) element by element
    const int stride = 32 * a.n_win;
    auto is_tiled = [&](int x0) { return a.win_tiles && x0 + 32 <= n_stored; };
    auto load = [&](int x0, int b) {
        uint16_t * k_t = tiles0 + b * 64 * LD, * v_t = k_t + 32 * LD;
        for (int e = tid; e < 32 * (D / 8); e += D) {
            const int t = e / (D / 8), p = e % (D / 8), x = x0 + t;
            const size_t hs = (size_t) (a.hs0 + h);
            const size_t row = x < n_sink ? (hs * a.s_cap + x) * D : (hs * a.cap_recent + (x - n_sink)) * D;
            qa_cp16(k_t + t * LD + 8 * p, (x < n_sink ? a.sink_k : a.recent_k) + row + 8 * p);
            qa_cp16(v_t + t * LD + 8 * p, (x < n_sink ? a.sink_v : a.recent_v) + row + 8 * p);
        }
        qa_cp_commit();
    };
    if (NB == 2 && 32 * part < n_rows && is_tiled(32 * part)) {
        load(32 * part, 0);
    }
    int buf = 0;
    for (int x0 = 32 * part; x0 < n_rows; x0 += stride, buf ^= NB - 1) {
        __syncthreads();  // qf written; the previous chunk's probabilities and tiles are read
        uint16_t * tk = tiles0 + buf * 64 * LD;
        uint16_t * tv = tk + 32 * LD;
        const bool tiles = is_tiled(x0);
        if (TC && frag && !tiles) {
            unfrag();
            __syncthreads();  // sp is written by this chunk's scores next
        }
        if (NB == 2) {
            // this chunk's copies were issued a chunk ago; the next one's go out now
            if (x0 + stride < n_rows && is_tiled(x0 + stride)) {
                load(x0 + stride, buf ^ 1);
                qa_cp_wait<1>();
            } else {
                qa_cp_wait<0>();
            }
            if (tiles) {
                __syncthreads();
            }
        } else if (tiles) {
            load(x0, 0);
            qa_cp_wait<0>();
            __syncthreads();
        }
        if (TC && tiles) {
            // scores of the 32 rows against the vectors, channels 32 warp .. 32 warp + 31
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                float c[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
#pragma unroll
                for (int ks = 0; ks < 2; ks++) {
                    uint32_t af[4];
                    qa_ldsm4(af, tk + (16 * mt + l8 + 8 * (mi & 1)) * LD + 32 * warp + 16 * ks + 8 * (mi >> 1), false);
                    qa_mma_f16(c, af, qb[ks][0][0], qb[ks][0][1]);
                    qa_mma_f16(c, af, qb[ks][1][0], qb[ks][1][1]);
                }
                const int j0 = 2 * tig, row = 16 * mt + gid;
                if (j0 < NV) {
                    sp[(warp * NV + j0) * 32 + row] = c[0] * qinv0;
                    sp[(warp * NV + j0) * 32 + row + 8] = c[2] * qinv0;
                }
                if (j0 + 1 < NV) {
                    sp[(warp * NV + j0 + 1) * 32 + row] = c[1] * qinv1;
                    sp[(warp * NV + j0 + 1) * 32 + row + 8] = c[3] * qinv1;
                }
            }
        } else {
            const int g = warp;
            float kr[32];
            if (tiles) {
                const uint4 * src = (const uint4 *) (tk + lane * LD + 32 * g);
#pragma unroll
                for (int q4 = 0; q4 < 4; q4++) {
                    const uint4 w = src[q4];
                    const uint32_t ws[4] = { w.x, w.y, w.z, w.w };
#pragma unroll
                    for (int hh = 0; hh < 4; hh++) {
                        kr[8 * q4 + 2 * hh] = qa_h2f((uint16_t) (ws[hh] & 0xFFFFu));
                        kr[8 * q4 + 2 * hh + 1] = qa_h2f((uint16_t) (ws[hh] >> 16));
                    }
                }
            } else {
                const qa_win_row kr_row = qa_win_row_of(a, false, h, x0 + lane, n_sink, n_stored, n_rows, D);
#pragma unroll
                for (int cc = 0; cc < 32; cc++) kr[cc] = qa_win_at(kr_row, 32 * g + cc);
            }
#pragma unroll
            for (int j = 0; j < NV; j++) {
                if (j < nvec) {
                    float s = 0.0f;
#pragma unroll
                    for (int cc = 0; cc < 32; cc++) s = fmaf(qf[j * D + 32 * g + cc], kr[cc], s);
                    sp[(g * NV + j) * 32 + lane] = s;
                }
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < NVW; k++) {
            const int j = warp + NW * k;
            if (j < nvec) {
                const int i = j / a.r, x = x0 + lane;
                bool vis = x < n_stored;
                int pos = x < n_sink ? x : x + n_quant;  // the row's position
                if (!vis && x < n_rows) {
                    const int bx = x - n_stored;
                    const bool own = bx >= a.n_q;  // unrounded rows
                    const int b = own ? bx - a.n_q : bx;
                    vis = own ? (a.decode ? b == i : b <= i) : (a.decode && b < i);
                    pos = n_past + b;
                }
                vis = vis && (!SW || a.window <= 0 || pos > n_past + i - a.window);
                float s = 0.0f;
#pragma unroll
                for (int g = 0; g < NG; g++) s += sp[(g * NV + j) * 32 + lane];
                s = vis ? s : -INFINITY;
                const float bm = qa_warp_max(s);
                float alpha = 1.0f, e = 0.0f;
                if (bm != -INFINITY) {
                    const float m_new = fmaxf(mx[k], bm);
                    alpha = expf(mx[k] - m_new);
                    e = vis ? expf(s - m_new) : 0.0f;
                    mx[k] = m_new;
                }
                const float esum = qa_warp_sum(e);
                ls[k] = ls[k] * alpha + esum;
                es[j * 32 + lane] = e;
                if (lane == 0) al[j] = alpha;
            }
        }
        __syncthreads();
        if (TC && tiles) {
            // acc += V^T p: channel tiles 2 warp, 2 warp + 1, the 32 rows in two k-steps
            uint32_t pb[2][2][2];  // k-step, hi / lo, register (vector gid)
#pragma unroll
            for (int ks = 0; ks < 2; ks++) {
                const float * e = es + gid * 32 + 16 * ks + 2 * tig;
                const bool on = gid < nvec;
                qa_split_f16x2(on ? e[0] * 1024.0f : 0.0f, on ? e[1] * 1024.0f : 0.0f, pb[ks][0][0], pb[ks][1][0]);
                qa_split_f16x2(on ? e[8] * 1024.0f : 0.0f, on ? e[9] * 1024.0f : 0.0f, pb[ks][0][1], pb[ks][1][1]);
            }
            const float al0 = 2 * tig < nvec ? al[2 * tig] : 1.0f, al1 = 2 * tig + 1 < nvec ? al[2 * tig + 1] : 1.0f;
#pragma unroll
            for (int mt2 = 0; mt2 < 2; mt2++) {
                const int m0 = 16 * (2 * warp + mt2);
                float c[4] = { 0.0f, 0.0f, 0.0f, 0.0f };
#pragma unroll
                for (int ks = 0; ks < 2; ks++) {
                    uint32_t af[4];
                    qa_ldsm4(af, tv + (16 * ks + l8 + 8 * (mi >> 1)) * LD + m0 + 8 * (mi & 1), true);
                    qa_mma_f16(c, af, pb[ks][0][0], pb[ks][0][1]);
                    qa_mma_f16(c, af, pb[ks][1][0], pb[ks][1][1]);
                }
                accf[mt2][0] = fmaf(accf[mt2][0], al0, c[0] * (1.0f / 1024.0f));
                accf[mt2][1] = fmaf(accf[mt2][1], al1, c[1] * (1.0f / 1024.0f));
                accf[mt2][2] = fmaf(accf[mt2][2], al0, c[2] * (1.0f / 1024.0f));
                accf[mt2][3] = fmaf(accf[mt2][3], al1, c[3] * (1.0f / 1024.0f));
            }
        } else {
            const int c = tid;
            const int n = n_rows - x0 < 32 ? n_rows - x0 : 32;
            float vr[32];
            if (tiles) {
#pragma unroll
                for (int t = 0; t < 32; t++) vr[t] = qa_h2f(tv[t * LD + c]);
            } else {
#pragma unroll
                for (int t = 0; t < 32; t++) {
                    vr[t] = qa_win_at(qa_win_row_of(a, true, h, x0 + t, n_sink, n_stored, x0 + n, D), c);
                }
            }
#pragma unroll
            for (int j = 0; j < NV; j++) {
                if (j < nvec) {
                    float s = 0.0f;
#pragma unroll
                    for (int t = 0; t < 32; t++) s = fmaf(es[j * 32 + t], vr[t], s);
                    acc[j] = fmaf(acc[j], al[j], s);
                }
            }
        }
    }
    if (TC && frag) {
        unfrag();
    }
}

// The partial state of part `part`: (part, query i, head) -> {max, sum, acc[D]}; thread c
// writes channel c, warp w the {max, sum} of vectors w, w + D/32, ...
template <int D, int NV>
static __device__ void qa_write_state(const iq_qa_args & a, int h, int part, const float (&acc)[NV], const float * mx,
                                      const float * ls) {
    constexpr int NW = D / 32, NVW = (NV + NW - 1) / NW;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, nvec = a.nvec;
#pragma unroll
    for (int j = 0; j < NV; j++) {
        if (j < nvec) {
            const int i = j / a.r, head = h * a.r + j % a.r;
            qa_state<D>(a, part, i, head)[2 + tid] = acc[j];
        }
    }
#pragma unroll
    for (int k = 0; k < NVW; k++) {
        const int j = warp + NW * k;
        if (j < nvec && lane == 0) {
            const int i = j / a.r, head = h * a.r + j % a.r;
            float * st = qa_state<D>(a, part, i, head);
            st[0] = mx[k];
            st[1] = ls[k];
        }
    }
}

// The warp-per-split kernel (qattention-mma.cu) over the step's sequences of up to 8 query
// vectors per KV head (nvec: the most of them), with at most a.n_win window CTAs: sets a.n_win,
// a.n_split (from its occupancy and the pool's n_slots slots of cap_blocks blocks; at most
// IQ_QW_MAX_SPLIT and a slot's blocks) and launches; 0 or -1 (+ iq_error_set).
int iq_cuda_qattn_mma(const struct iq_cuda_ctx * c, iq_qa_args & a, int hd, int bits_k, int bits_v, int n_kv,
                      int cap_blocks, int n_slots, int nvec);
