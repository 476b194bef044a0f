// Flash attention on tensor cores for prompt batches (attention.cu launches it): the f16 cache,
// and a quantized cache dequantized into f16 rows (qcache-store.cu) when the score correction
// is off. The specification is iq_cu_attention (attention-kernels.cuh): the same arguments,
// positions, causal mask, decode semantics, splits and partial states.
//
// Why it is built this way. A prompt batch at depth is arithmetic, not bytes: pp512 at depth
// 32768 on a Llama-3-8B shape is ~8.8 TFLOP of attention per batch, which the f32 CUDA-core
// kernel runs at a few percent of the tensor cores' rate. So Q K^T and P V run on
// mma.sync.m16n8k16 (f16 operands, f32 accumulators), flash-attention-2 style: a CTA of 4 warps
// holds 64 query vectors (with GQA the (token, query head) pairs of one KV head, as the old
// kernel orders them, so one K / V tile serves all r heads of the group), each warp 16 rows
// whose Q fragments, online-softmax state (m, l) and O accumulators stay in registers; K / V
// tiles of BN positions stream through two shared-memory stages (cp.async, the next tile in
// flight while the current one is multiplied) and reach the mma operands through ldmatrix
// (.trans for V, which is stored [position][channel]); P goes from the score accumulators to
// the A operand of P V without touching shared memory (an m16n8 C fragment pair is an m16k16 A
// fragment). A decode step over an f16 cache (a GQA group's r <= 16 rows) fills one warp's rows:
// the other warps load tiles and skip the products (decoding at depth 32768 1.04x-1.07x).
//
// Accuracy. The operands are f16, as llama.cpp's flash attention takes them: the scaled
// queries, the batch's own k / v rows (under decode semantics the f16 the cache will hold
// anyway), a quantized cache's dequantized values (rounded once more, 2^-11 relative, far
// below their quantization error) and the probabilities P; scores, the softmax state, sums and
// accumulators are f32, exponentials expf. Against the CPU's f32 attention that is below 1e-3
// of the values' scale (the GPU tests hold it to 2e-3: tests/cuda_lib.py FA_ATOL), and a KLD on
// real text measured in docs/ACCURACY.md. Until 2026-12 every f32 operand was split into f16 hi + lo parts (~22 bits,
// 2-3 mma per product) to match the CPU to 1e-4: measured on an H100 (docs/BENCHMARKS.md), the
// single f16 operand makes an 8K prompt 1.08x faster with the f16 cache and 1.09x with the
// innerq cache, and decoding at depth 32768 over the f16 cache (which takes this kernel) 1.16x;
// the GPU-vs-CPU KLD of SmolLM2 stayed at its floor (0.00335 against 0.00333).
// Limits: the f16 range. The scaled queries, the batch's k / v rows and a quantized cache's
// dequantized values must stay below 65504 in magnitude (an f16 cache and a quantized cache's
// windows hold f16 already).
//
// Decode semantics: the main loop masks a query's own position, and after the loop the CTA that
// holds it adds the own row from the batch's f32 k / v unrounded (the old kernel's last step),
// four lanes of a row sharing the dot product.
//
// Grid and splits as the old kernel: (work item, KV head), an item a tile of qt = 64 / r tokens of
// a sequence and a split of its positions (iq_cu_sched_find), splits from the shapes and the
// sequence's own length (attention.cu), counters and pages read from device memory; a CTA's
// positions [lo, hi) end at the last visible position of its last token, chunks a multiple of BN
// (a tile of BN positions lies in one page of the cache: pages are whole tiles). Shared memory
// per stage: K and V planes of BN rows of D + 8 halves (the 16-byte pad puts the 8 rows an
// ldmatrix phase reads on distinct banks). BN = 64 at D 64, 32 at D 128: ~37 / ~35 KB for the
// two stages; the registers (Q fragments and O: D / 2 + D / 2 per thread) decide the CTAs per
// SM. No D 256: head_dim 256 (Gemma 3) runs on the f32 kernel.
//
// A sliding window (iq_cu_attn_args.window): a row also masks the positions below its window,
// and a CTA's splits start at the tile of its first query's window.
#pragma once

#include "attention-kernels.cuh"

#include <cuda_fp16.h>

#define IQ_FA_WARPS 4
#define IQ_FA_ROWS (16 * IQ_FA_WARPS)  // query vectors per CTA
// K / V tiles in flight (cp.async stages): 3 or 4 measured no faster for decoding at depth
// (H100, docs/BENCHMARKS.md "Decode steps on fewer launches"), and twice the shared memory
#define IQ_FA_STAGES 2
// Decode steps (every CTA of the launch holds at most 16 query vectors: a GQA group of r <= 16
// rows) with more CTAs than the four-warp kernel keeps resident (H100: 2 a multiprocessor, by
// its registers; attention.cu fa_launch) run CTAs of one warp: the same rows and arithmetic as
// warp 0 of a four-warp CTA (whose other warps only loaded tiles), so that more CTAs are
// resident at once (H100: 6, by shared memory) and more tiles are in flight. A launch the
// four-warp kernel holds in one wave keeps it: the same busy warps, and four times the threads
// loading each tile (H100, 8B shape, f16 cache: tg64 at depth 32768 1.02x; at 4096, 264 CTAs,
// one warp was 0.93x; docs/BENCHMARKS.md "Decode CTAs of one warp"). -DIQ_FA_FEW_WARPS=4
// builds the four-warp kernel there too, for comparisons.
#ifndef IQ_FA_FEW_WARPS
#define IQ_FA_FEW_WARPS 1
#endif
#ifndef IQ_FA_FEW_STAGES
#define IQ_FA_FEW_STAGES 2
#endif

template <int D, int ST = IQ_FA_STAGES>
struct iq_fa_cfg {
    static constexpr int BN = D == 64 ? 64 : 32;  // positions per K / V tile
    static constexpr int LDS = D + 8;             // halves per shared row
    static constexpr int PLANE = BN * LDS;
    static constexpr int STAGE = 2 * PLANE;       // K, V
    static constexpr size_t SMEM = ST * STAGE * sizeof(__half);
};

static __device__ __forceinline__ uint32_t iq_fa_saddr(const void * p) {
    return (uint32_t) __cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void iq_fa_cp16(void * smem, const void * gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(iq_fa_saddr(smem)), "l"(gmem));
}

static __device__ __forceinline__ void iq_fa_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
static __device__ __forceinline__ void iq_fa_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 f16 matrices (rows of 16 bytes at the addresses lanes 8m .. 8m + 7 give); TRANS: each
// transposed (V: rows are positions, the B operand wants them as columns).
template <bool TRANS>
static __device__ __forceinline__ void iq_fa_ldsm4(uint32_t (&r)[4], const __half * p) {
    if constexpr (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(iq_fa_saddr(p)));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(iq_fa_saddr(p)));
    }
}

// c += a b: a 16x16 (row), b 16x8 (col), f16 operands, f32 accumulators.
static __device__ __forceinline__ void iq_fa_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t iq_fa_bits(__half2 h) {
    union {
        __half2 h;
        uint32_t u;
    } x;
    x.h = h;
    return x.u;
}

// (x, y) as an f16 pair (x first, the low half), rounded to nearest.
static __device__ __forceinline__ uint32_t iq_fa_h2(float x, float y) { return iq_fa_bits(__floats2half2_rn(x, y)); }

// K / V tile t0 (positions t0 .. t0 + BN - 1) into a stage: stored rows by cp.async (position p
// in row p + rb), the sequence's batch rows kb / vb from f32 rounded to f16, rows past hi or
// below first (a sliding window's) zero (their probabilities are 0, and 0 * a stale NaN would
// not be).
template <int D, int W>
static __device__ __forceinline__ void iq_fa_load(const iq_cu_attn_args & a, __half * stage, int g, int t0, int n_past,
                                                  int first, int hi, int64_t rb, const float * kb, const float * vb) {
    using cfg = iq_fa_cfg<D>;
    constexpr int CH = D / 8;  // 16-byte chunks per row
    if (t0 >= first && t0 + cfg::BN <= n_past && t0 + cfg::BN <= hi) {
        // a tile of stored rows only (every tile but a CTA's last, and those of a batch's rows):
        // each thread's chunk column and first row fixed, its copies at address increments,
        // without the per-chunk divisions and bounds of the loop below (a CTA of one warp issues
        // 32 copies a thread per tile: 8B shape, f16 cache, tg64 at depth 32768 1.33x on an H200,
        // docs/BENCHMARKS.md "Whole-tile loads")
        constexpr int RS = 32 * W / CH;  // rows per pass
        static_assert(32 * W % CH == 0 && cfg::BN % RS == 0, "whole passes");
        const int ch = threadIdx.x % CH, r0 = threadIdx.x / CH;
        const uint8_t * kg = a.ck + (size_t) g * a.ck_nb2 + (size_t) (t0 + rb + r0) * a.ck_nb1 + 16 * ch;
        const uint8_t * vg = a.cv + (size_t) g * a.cv_nb2 + (size_t) (t0 + rb + r0) * a.cv_nb1 + 16 * ch;
        __half * dh = stage + r0 * cfg::LDS + 8 * ch;
#pragma unroll
        for (int i = 0; i < cfg::BN / RS; i++) {
            iq_fa_cp16(dh + i * RS * cfg::LDS, kg + (size_t) i * RS * a.ck_nb1);
            iq_fa_cp16(dh + cfg::PLANE + i * RS * cfg::LDS, vg + (size_t) i * RS * a.cv_nb1);
        }
        return;
    }
    for (int item = threadIdx.x; item < 2 * cfg::BN * CH; item += 32 * W) {
        const bool is_v = item >= cfg::BN * CH;
        const int row = item / CH % cfg::BN, ch = item % CH;
        const int p = t0 + row;
        __half * dh = stage + (is_v ? 1 : 0) * cfg::PLANE + row * cfg::LDS + 8 * ch;
        if (p >= first && p < n_past && p < hi) {
            const size_t off = (size_t) g * (is_v ? a.cv_nb2 : a.ck_nb2) + (size_t) (p + rb) * (is_v ? a.cv_nb1 : a.ck_nb1) + 16 * ch;
            iq_fa_cp16(dh, (is_v ? a.cv : a.ck) + off);
        } else if (p >= first && p < hi) {
            const float4 * src = (const float4 *) (is_v ? vb + ((size_t) (p - n_past) * a.v_nb2 + (size_t) g * a.v_nb1) / sizeof(float)
                                                        : kb + ((size_t) (p - n_past) * a.k_nb2 + (size_t) g * a.k_nb1) / sizeof(float)) +
                                 2 * ch;
            const float4 x0 = src[0], x1 = src[1];
            *(uint4 *) dh = make_uint4(iq_fa_h2(x0.x, x0.y), iq_fa_h2(x0.z, x0.w), iq_fa_h2(x1.x, x1.y), iq_fa_h2(x1.z, x1.w));
        } else {
            *(uint4 *) dh = make_uint4(0, 0, 0, 0);
        }
    }
}

// One CTA per (work item, KV head), W warps of 16 query vectors each, ST stages: see the top of
// the file.
template <int D, int W, int ST>
__global__ void __launch_bounds__(32 * W, W == 1 ? 8 : 2) iq_cu_fa(const iq_cu_attn_args a) {
    using cfg = iq_fa_cfg<D, ST>;
    constexpr int BN = cfg::BN, LDS = cfg::LDS, NT = BN / 8, ND = D / 8, KD = D / 16;
    extern __shared__ uint4 iq_fa_sm[];
    __half * smem = (__half *) iq_fa_sm;
    const int g = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int qr = lane / 4, qc = lane % 4;  // fragment row (and row + 8), column pair
    iq_cu_attn_cta cta;
    if (!iq_cu_attn_cta_of(a, &cta)) {
        return;
    }
    const auto [it, row, pages, n_past, i0, i1, nvec, qb, kb, vb] = cta;
    const int end = n_past + i1;  // the CTA's last query sees positions < end
    // a sliding window: the CTA's first query sees positions >= first, the others fewer
    const int first = (int) iq_cu_window_first(a.window, n_past + i0);
    const int begin = first / BN * BN;
    const int chunk = ((end - begin + it.n_split - 1) / it.n_split + BN - 1) / BN * BN;
    const int split = it.split;
    const int lo = begin + split * chunk;
    const int hi = lo + chunk < end ? lo + chunk : end;

    // this thread's rows e = 0, 1: vectors 16 warp + qr + 8 e, (token tok, query head head)
    int tok[2], head[2], bound[2], least[2];  // positions in [least, bound) visible (bound -1: no vector)
    bool valid[2];
    uint32_t qh[KD][4];  // scale * Q as A fragments
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int j = 16 * warp + qr + 8 * e;
        valid[e] = j < nvec;
        tok[e] = i0 + j / a.r;
        head[e] = g * a.r + j % a.r;
        const int vis = n_past + tok[e] + (a.decode ? 0 : 1);
        bound[e] = valid[e] ? (vis < hi ? vis : hi) : -1;
        least[e] = (int) iq_cu_window_first(a.window, n_past + tok[e]);
        const float * q = (const float *) (qb + (size_t) tok[e] * a.q_nb2 + (size_t) head[e] * a.q_nb1);
#pragma unroll
        for (int kk = 0; kk < KD; kk++) {
#pragma unroll
            for (int h8 = 0; h8 < 2; h8++) {
                const int c = 16 * kk + 8 * h8 + 2 * qc;
                const float x = valid[e] ? q[c] * a.scale : 0.0f, y = valid[e] ? q[c + 1] * a.scale : 0.0f;
                qh[kk][e + 2 * h8] = iq_fa_h2(x, y);
            }
        }
    }

    float o[ND][4];
#pragma unroll
    for (int nd = 0; nd < ND; nd++) {
#pragma unroll
        for (int x = 0; x < 4; x++) o[nd][x] = 0.0f;
    }
    float m[2] = { -INFINITY, -INFINITY }, l[2] = { 0.0f, 0.0f };  // l: this thread's columns

    // ldmatrix addresses: lane gives row r8 of matrix mi
    const int mi = lane / 8, r8 = lane % 8;
    // the first ST - 1 tiles in flight, a copy group each (empty past hi)
#pragma unroll
    for (int s0 = 0; s0 < ST - 1; s0++) {
        const int t1 = lo + s0 * BN;
        if (t1 < hi) {
            iq_fa_load<D, W>(a, smem + s0 * cfg::STAGE, g, t1, n_past, first, hi, iq_cu_rows_off(a.page, pages, t1, n_past),
                          kb, vb);
        }
        iq_fa_commit();
    }
    // a warp whose rows are all past the CTA's vectors (a decode step's GQA group fills one
    // warp's 16 rows) loads tiles and computes nothing
    const bool busy = 16 * warp < nvec;
    int stage = 0;
    for (int t0 = lo; t0 < hi; t0 += BN, stage = stage + 1 < ST ? stage + 1 : 0) {
        iq_fa_wait<ST - 2>();  // this tile's copies
        __syncthreads();       // ... every thread's stores, and the stage read last iteration is free
        {
            const int t1 = t0 + (ST - 1) * BN;
            if (t1 < hi) {
                const int s1 = stage + ST - 1 < ST ? stage + ST - 1 : stage - 1;
                iq_fa_load<D, W>(a, smem + s1 * cfg::STAGE, g, t1, n_past, first, hi,
                              iq_cu_rows_off(a.page, pages, t1, n_past), kb, vb);
            }
            iq_fa_commit();
        }
        if (!busy) {
            continue;
        }
        const __half * kh = smem + stage * cfg::STAGE, * vh = kh + cfg::PLANE;

        // S = Q K^T: matrices (n-tile nn, k lo), (nn, k hi), (nn + 1, k lo), (nn + 1, k hi)
        float s[NT][4];
#pragma unroll
        for (int nn = 0; nn < NT; nn++) {
#pragma unroll
            for (int x = 0; x < 4; x++) s[nn][x] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < KD; kk++) {
#pragma unroll
            for (int nn = 0; nn < NT; nn += 2) {
                const int at = (8 * nn + 8 * (mi / 2) + r8) * LDS + 16 * kk + 8 * (mi % 2);
                uint32_t b[4];
                iq_fa_ldsm4<false>(b, kh + at);
                iq_fa_mma(s[nn], qh[kk], b[0], b[1]);
                iq_fa_mma(s[nn + 1], qh[kk], b[2], b[3]);
            }
        }

        // the causal mask and the window's, the online softmax of rows qr, qr + 8 (a quad of lanes per row)
        float mx[2] = { -INFINITY, -INFINITY };
#pragma unroll
        for (int nn = 0; nn < NT; nn++) {
#pragma unroll
            for (int x = 0; x < 4; x++) {
                const int p = t0 + 8 * nn + 2 * qc + (x & 1);
                if (p >= bound[x / 2] || p < least[x / 2]) {
                    s[nn][x] = -INFINITY;
                }
                mx[x / 2] = fmaxf(mx[x / 2], s[nn][x]);
            }
        }
        float ms[2], alpha[2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
            mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
            const float mn = fmaxf(m[e], mx[e]);
            ms[e] = mn == -INFINITY ? 0.0f : mn;  // a row with nothing visible yet: p = 0, no NaN
            alpha[e] = expf(m[e] - ms[e]);
            m[e] = mn;
        }
        float rs[2] = { 0.0f, 0.0f };
#pragma unroll
        for (int nn = 0; nn < NT; nn++) {
#pragma unroll
            for (int x = 0; x < 4; x++) {
                s[nn][x] = expf(s[nn][x] - ms[x / 2]);
                rs[x / 2] += s[nn][x];
            }
        }
#pragma unroll
        for (int e = 0; e < 2; e++) l[e] = l[e] * alpha[e] + rs[e];
#pragma unroll
        for (int nd = 0; nd < ND; nd++) {
#pragma unroll
            for (int x = 0; x < 4; x++) o[nd][x] *= alpha[x / 2];
        }

        // O += P V: P's A fragment from score tiles 2 kk, 2 kk + 1; V matrices (k lo, n-tile nd),
        // (k hi, nd), (k lo, nd + 1), (k hi, nd + 1), transposed
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            const uint32_t ph[4] = { iq_fa_h2(s[2 * kk][0], s[2 * kk][1]), iq_fa_h2(s[2 * kk][2], s[2 * kk][3]),
                                     iq_fa_h2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                     iq_fa_h2(s[2 * kk + 1][2], s[2 * kk + 1][3]) };
#pragma unroll
            for (int nd = 0; nd < ND; nd += 2) {
                const int at = (16 * kk + 8 * (mi % 2) + r8) * LDS + 8 * nd + 8 * (mi / 2);
                uint32_t b[4];
                iq_fa_ldsm4<true>(b, vh + at);
                iq_fa_mma(o[nd], ph, b[0], b[1]);
                iq_fa_mma(o[nd + 1], ph, b[2], b[3]);
            }
        }
    }
    iq_fa_wait<0>();

#pragma unroll
    for (int e = 0; e < 2; e++) {
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 1);
        l[e] += __shfl_xor_sync(0xffffffffu, l[e], 2);
    }
    if (a.decode) {
        // decode semantics: the query's own row, unrounded, in the split that holds its position
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const int own = n_past + tok[e];
            const bool here = valid[e] && own >= lo && own < hi;
            const float * q = (const float *) (qb + (size_t) tok[e] * a.q_nb2 + (size_t) head[e] * a.q_nb1);
            const float * kr = kb + ((size_t) tok[e] * a.k_nb2 + (size_t) g * a.k_nb1) / sizeof(float);
            const float * vr = vb + ((size_t) tok[e] * a.v_nb2 + (size_t) g * a.v_nb1) / sizeof(float);
            float sd = 0.0f;
            if (here) {
#pragma unroll
                for (int nd = 0; nd < ND; nd++) {
                    const int c = 8 * nd + 2 * qc;
                    sd += q[c] * a.scale * kr[c] + q[c + 1] * a.scale * kr[c + 1];
                }
            }
            sd += __shfl_xor_sync(0xffffffffu, sd, 1);
            sd += __shfl_xor_sync(0xffffffffu, sd, 2);
            if (here) {
                const float mn = fmaxf(m[e], sd);
                const float al = expf(m[e] - mn), pr = expf(sd - mn);
                l[e] = l[e] * al + pr;
                m[e] = mn;
#pragma unroll
                for (int nd = 0; nd < ND; nd++) {
                    const int c = 8 * nd + 2 * qc;
                    o[nd][2 * e] = o[nd][2 * e] * al + pr * vr[c];
                    o[nd][2 * e + 1] = o[nd][2 * e + 1] * al + pr * vr[c + 1];
                }
            }
        }
    }
#pragma unroll
    for (int e = 0; e < 2; e++) {
        if (!valid[e]) {
            continue;
        }
        if (it.n_split == 1) {
            float * out = a.dst + ((size_t) (it.token0 + tok[e]) * a.dst_nb1) / sizeof(float) + (size_t) head[e] * D;
            const float inv = 1.0f / l[e];
#pragma unroll
            for (int nd = 0; nd < ND; nd++) {
                out[8 * nd + 2 * qc] = o[nd][2 * e] * inv;
                out[8 * nd + 2 * qc + 1] = o[nd][2 * e + 1] * inv;
            }
        } else {
            float * part = a.part + (((size_t) it.part0 + (size_t) split * it.n + tok[e]) * a.n_head + head[e]) * (D + 2);
            if (qc == 0) {
                part[0] = m[e];
                part[1] = l[e];
            }
#pragma unroll
            for (int nd = 0; nd < ND; nd++) {
                part[2 + 8 * nd + 2 * qc] = o[nd][2 * e];
                part[3 + 8 * nd + 2 * qc] = o[nd][2 * e + 1];
            }
        }
    }
}
