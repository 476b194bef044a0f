// Fused decode attention over the InnerQ cache (G = 32) on tensor cores, one warp per split:
// the default for up to 8 query vectors per KV head (one query token and r <= 8, or a few
// tokens of a smaller r). The specification is iq_qcache_attention_ref, the arithmetic that of
// the CTA kernel (qattention.cu), whose results it reproduces to float rounding: the query
// vectors and the probabilities as two 8-bit parts each (hi + lo / 254, hi + lo / 256), integer
// code dot products, every group's (d, m), sum q~ and score correction applied once per group.
//
// Why it is built this way. The CTA kernel does the products with __dp4a, 4 multiply-adds per
// instruction and per query part: with r = 4 query heads per KV head (Llama-3-8B), two parts
// each and a 3-bit code spread into bytes per 4 codes, it issued ~1,600 warp instructions per
// block of 32 tokens and head, 4x the HBM stream's time at 128K tokens, and its three block-wide
// barriers per block left the issue slots half idle. One mma.m16n8k32 (u8 codes x s8 query, or
// u8 codes x u8 probabilities) does 4,096 multiply-adds: 16 tokens (keys) or 16 channels
// (values) x 32 reduction elements against the 8 columns of the B operand, which hold the 4
// query vectors' two parts side by side (column 2j: vector j's hi part, 2j + 1: its lo part), so
// the second part costs nothing and a thread's two accumulator columns are one vector's hi and lo
// sums. The codes need no repacking: the A operand's register is four consecutive reduction
// elements of one row, which is what a tile word of the block format holds (iq-qcache.h), and
// rows g and g + 8 of a fragment (tokens or channels lane and lane + 8) share one tile word, so a
// 32-bit shared load gives two A registers (plus one 64-bit load of the third bit plane for
// 3-bit codes; the codes stay where the word has them, scaled by a power of two that the
// epilogue takes back: qw_codes2). What remains per group is the per-group epilogue the format
// requires ((d, m) of a key group scale a partial dot product), ~6 instructions per (token,
// group, vector). K3 V2, D 128, 4 vectors: 772 warp instructions per block of 32 tokens in the
// loop (SASS), issue-bound (ncu: 2.9 instructions per cycle per multiprocessor at 131072 tokens),
// so each instruction counts: the block's copies are a fixed count per lane at fixed offsets from
// two addresses (one instruction each; a strided loop with a select per copy took ~120), the
// codes are masked in place (no shift), and the CTA's warps make the query's parts once (a key
// group each) instead of each warp all of them.
// Each warp is its own split over a contiguous range of blocks with its own cp.async pipeline
// (3 stages of one block: K codes, K (d, m), V codes, V (d, m)), its own online softmax and
// state; no block-wide barrier in the loop (the warp's lanes meet at __syncwarp). The probabilities
// of a block go from the accumulator layout (lane: tokens lane/4 + 8k, vector lane % 4) to the B
// operand layout through 256 bytes of the warp's shared memory. The splits are the warps resident
// on the device (occupancy x SMs) over the KV heads (with several slots, a slot's share of them:
// qw_launch), from shapes only, so a decode step replays as a CUDA graph (the counters and page
// tables are read from device memory, per sequence: grid z); the window CTAs of
// qattention.cuh (sink, recent, the batch's rows; here with two tile buffers and the products on
// tensor cores) come first in the grid, as many as share the wave with the splits in proportion
// to their work (qw_win_ctas), and the merge (qattention.cu) takes every part.
#include "qattention.cuh"

#define IQ_QW_STAGES 3
#define IQ_QW_WIN_COST 4.0f  // a window row against a quantized token (qw_win_ctas; measured, docs/BENCHMARKS.md)

// A warp's shared memory (bytes): the cp.async stages, then the probabilities as the values' B
// operand (u8 [2 NV][32]: row 2j the hi bytes of vector j, 2j + 1 the lo bytes). The query's two
// int8 parts [2][NV][D] and its per-group terms float [3][NV][NG] (step, sum q~, q2) are made in
// the last stage, which no copy targets until the loop's first step (they are in registers then).
template <int D, int BK, int BV, int NT>
struct qw_smem {
    static constexpr int NV = 4 * NT, NG = D / 32;
    static constexpr int KB = D * IQ_QA_G * BK / 8 + 4 * D;
    static constexpr int VB = D * IQ_QA_G * BV / 8 + 4 * D;
    static constexpr int SB = KB + VB;
    static constexpr int pb = IQ_QW_STAGES * SB;
    static constexpr int qb = (IQ_QW_STAGES - 1) * SB;
    static constexpr int qf = qb + 2 * NV * D;
    static_assert(qf + 3 * NV * NG * 4 <= pb, "the query's scratch fits in the last stage");
    static constexpr int warp = qa_round16(pb + 2 * NV * 32);
    // a window CTA: two tile buffers where they fit in what the splits' CTAs take anyway
    static constexpr int window1 = qa_smem<D, 2, 2, NV, false>::u + NV * D * 4 + qa_wtile<D>::bytes;  // no row scales
    static constexpr int win_nb = window1 + qa_wtile<D>::bytes <= D / 32 * warp ? 2 : 1;
    static constexpr int window = window1 + (win_nb - 1) * qa_wtile<D>::bytes;
    static constexpr int total = qa_max(window, D / 32 * warp);
    static_assert(NV * (D + 2) * 4 <= pb, "a warp's state fits in its stages (the CTA's merge)");
};

// The A registers of rows lane/4 and lane/4 + 8 (gid = lane / 4) from one tile: four codes of
// the tile's quad each, one per byte (lanes l and l + 8 of a tile share word l % 4 (2, 3 bits)
// or l % 8 (4 bits), at different shifts; bit 2 of a 3-bit code is nibble l % 2 of byte
// 16 + l / 2, i.e. nibble gid of word 0 (row gid) and of word 1 (row gid + 8) of the bit plane).
// The codes are left where the word has them where a byte holds them so (row gid's 2-bit codes
// at bits sh, sh + 1 of their byte, row gid + 8's at sh + 4, sh + 5; 4-bit: row gid + 8's in the
// high nibble): a mask instead of a shift and a mask, and the A rows come out scaled by
// 2^qw_scale0 / 2^qw_scale1, a lane's constants, which the epilogues take back exactly (powers of
// two). 3-bit codes of row gid + 8 (up to 7 << 4 = 112) are shifted down to bits 4..6; 5-bit codes
// (4-bit plane, then bit 4 as a plane like 3-bit codes' bit 2) of both rows sit at bits 0..4, unscaled.
struct qw_lane {
    int sh, nib;                // 2 (gid / 4): the 2-bit field of the word; 4 gid: the bit plane's nibble
    uint32_t lo0, lo1, mag, hi0;  // masks of rows gid / gid + 8, the 3-bit plane's spread and mask
};
static __device__ __forceinline__ qw_lane qw_lane_of(int gid) {
    qw_lane l;
    l.sh = 2 * (gid >> 2);
    l.nib = 4 * gid;
    l.lo0 = 0x03030303u << l.sh;
    l.lo1 = 0x30303030u << l.sh;
    l.mag = 0x00810204u << l.sh;  // bit i of a nibble to bit 2 + sh of byte i
    l.hi0 = 0x04040404u << l.sh;
    return l;
}
template <int B> static __device__ __forceinline__ int qw_scale0(int gid) { return B >= 4 ? 0 : 2 * (gid >> 2); }
template <int B> static __device__ __forceinline__ int qw_scale1(int gid) {
    return B == 2 ? 2 * (gid >> 2) + 4 : B == 5 ? 0 : 4;
}
// 2^-e, exactly
static __device__ __forceinline__ float qw_pow2m(int e) { return __int_as_float((127 - e) << 23); }
template <int B>
static __device__ __forceinline__ void qw_codes2(const uint8_t * tile, int gid, const qw_lane & l, uint32_t & x0,
                                                 uint32_t & x1) {
    if (B == 4) {
        const uint32_t w = *(const uint32_t *) (tile + 4 * gid);
        x0 = w & 0x0F0F0F0Fu;
        x1 = w & 0xF0F0F0F0u;
        return;
    }
    if (B == 5) {  // row gid + 8's nibbles shifted down (a code to 31 x 16 would not fit a byte), bit 4 from
                   // nibble gid of the bit plane's word 0 (row gid) and word 1 (row gid + 8)
        const uint32_t w = *(const uint32_t *) (tile + 4 * gid);
        const uint2 hw = *(const uint2 *) (tile + 32);
        x0 = (w & 0x0F0F0F0Fu) | (((hw.x >> l.nib) & 15u) * 0x02040810u & 0x10101010u);
        x1 = ((w >> 4) & 0x0F0F0F0Fu) | (((hw.y >> l.nib) & 15u) * 0x02040810u & 0x10101010u);
        return;
    }
    const uint32_t w = *(const uint32_t *) (tile + 4 * (gid & 3));
    x0 = w & l.lo0;
    if (B == 2) {
        x1 = w & l.lo1;
        return;
    }
    x1 = (w >> l.sh) & 0x30303030u;
    // nibble bit i -> bit 2 + sh (row gid) or bit 6 (row gid + 8) of byte i
    const uint2 hw = *(const uint2 *) (tile + 16);
    x0 |= ((hw.x >> l.nib) & 15u) * l.mag & l.hi0;
    x1 |= ((hw.y >> l.nib) & 15u) * 0x08102040u & 0x40404040u;
}

// d = A (16 x 32, u8 codes, row-major) * B (32 x 8, s8 or u8, column-major), s32.
template <bool SIGNED_B>
static __device__ __forceinline__ void qw_mma(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if (SIGNED_B) {
        asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%10,%10,%10,%10};\n"
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
    } else {
        asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%10,%10,%10,%10};\n"
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
    }
}

// One vector's state {max, sum, acc[D]} at st from the accumulator layout of its lanes
// (channels 16 mc + gid and + 8; the lane of gid 0 writes max and sum).
template <int NMC>
static __device__ __forceinline__ void qw_put_state(float * st, const float (&acc)[NMC][2], float mx, float ls,
                                                    int gid) {
#pragma unroll
    for (int mc = 0; mc < NMC; mc++) {
        st[2 + 16 * mc + gid] = acc[mc][0];
        st[2 + 16 * mc + gid + 8] = acc[mc][1];
    }
    if (gid == 0) {
        st[0] = mx;
        st[1] = ls;
    }
}

// Grid (KV head, n_win + ceil(n_split / warps)), D threads: y < n_win a window CTA, else warp w
// of CTA y runs split (y - n_win) * D/32 + w, written as part n_win + split. NT: 8-column tiles
// of the B operand, 4 NT query vectors.
// CTAs per multiprocessor the registers are capped for: 5 of 128 threads (the splits' loop
// needs 96 registers; without the cap the window CTAs' paths in the same kernel raised it to 127,
// and 4 CTAs per multiprocessor), 4 with two B tiles.
template <int D, int NT>
static constexpr int qw_min_blocks() { return NT == 1 ? 640 / D : 512 / D; }

template <int D, int BK, int BV, int NT>
__global__ void __launch_bounds__(D, qw_min_blocks<D, NT>()) iq_cu_qattn_mma(const iq_qa_args a0) {
    iq_cu_pdl_trigger();
    iq_cu_pdl_wait();
    iq_qa_args a = a0;
    if (!qa_seq_view(a, true)) {
        return;
    }
    using W = qw_smem<D, BK, BV, NT>;
    constexpr int NV = W::NV, NG = W::NG, NW = D / 32, NMC = D / 16;
    extern __shared__ __align__(16) uint8_t sm[];
    const int h = blockIdx.x;
    if ((int) blockIdx.y < a.n_win) {
        constexpr int NVW = (NV + NW - 1) / NW;
        float acc[NV], mx[NVW], ls[NVW];
#pragma unroll
        for (int j = 0; j < NV; j++) acc[j] = 0.0f;
#pragma unroll
        for (int k = 0; k < NVW; k++) mx[k] = -INFINITY, ls[k] = 0.0f;
        qa_window<D, NV, W::win_nb, true, false, false>(a, h, blockIdx.y, sm, acc, mx, ls);
        qa_write_state<D, NV>(a, h, blockIdx.y, acc, mx, ls);
        return;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gid = lane >> 2, tig = lane & 3;
    const int split = ((int) blockIdx.y - a.n_win) * NW + warp;
    const bool cta_merge = a.merge_warps > 1;
    uint8_t * ws = sm + warp * W::warp;
    uint8_t * pb = ws + W::pb;

    float mx[NT], ls[NT];          // vector 4 nt + tig
    float acc[NT][NMC][2];         // channel 16 mc + gid + 8 rr of vector 4 nt + tig
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        mx[nt] = -INFINITY, ls[nt] = 0.0f;
#pragma unroll
        for (int mc = 0; mc < NMC; mc++) acc[nt][mc][0] = acc[nt][mc][1] = 0.0f;
    }

    const int nb = qa_count(a, IQ_KV_S_N_QUANT) / IQ_QA_G;  // a layer with blocks (qa_mma_ok)
    const int chunk = (nb + a.n_split - 1) / a.n_split;
    const int b0 = split * chunk;
    const int b1 = split >= a.n_split ? b0 : b0 + chunk < nb ? b0 + chunk : nb;
    const uint8_t * gk = a.quant_k + (size_t) h * a.cap_blocks * W::KB;
    const uint8_t * gv = a.quant_v + (size_t) h * a.cap_blocks * W::VB;
    // block blk's K and V bytes into stage st: a fixed number of 16-byte copies per lane at fixed
    // offsets from two base addresses (one instruction each)
    auto issue = [&](int blk, int st) {
        if (blk < b1) {
            uint8_t * dk = ws + st * W::SB;
            const size_t pg = (size_t) a.pages[blk];  // block blk of the sequence: page pg of the pool
            const uint8_t * sk = gk + pg * W::KB;
            const uint8_t * sv = gv + pg * W::VB;
#pragma unroll
            for (int i = 0; i < (W::KB / 16 + 31) / 32; i++) {
                const int off = 16 * (lane + 32 * i);
                if ((W::KB / 16) % 32 == 0 || off < W::KB) qa_cp16(dk + off, sk + off);
            }
#pragma unroll
            for (int i = 0; i < (W::VB / 16 + 31) / 32; i++) {
                const int off = 16 * (lane + 32 * i);
                if ((W::VB / 16) % 32 == 0 || off < W::VB) qa_cp16(dk + W::KB + off, sv + off);
            }
        }
        qa_cp_commit();
    };
#pragma unroll
    for (int s = 0; s < IQ_QW_STAGES - 1; s++) issue(b0 + s, s);

    // the query: q~ = scale * q (.) n per key group as hi + lo / 254 int8 parts of step sq / 127
    // (the CTA kernel's rule); vectors past nvec are zero. The CTA's warps make it together (warp w
    // key group w of every vector) in warp 0's last stage, which no copy targets until warp 0's
    // first step, after the second barrier
    static_assert(NG == NW, "a warp per key group");
    int8_t * qh = (int8_t *) (sm + W::qb);
    int8_t * ql = qh + NV * D;
    float * qt = (float *) (sm + W::qf);  // [3][NV][NG]
    {
        const int c = 32 * warp + lane;
        const float nc = a.norm[(size_t) (a.hs0 + h) * D + c];
        float qv[NV];  // every value the lane needs is loaded first: one memory latency
#pragma unroll
        for (int j = 0; j < NV; j++) {
            const int i = j / a.r, head = h * a.r + j % a.r;
            qv[j] = j < a.nvec ? a.q[((a.tok0 + i) * a.q_nb2 + head * a.q_nb1) / sizeof(float) + c] * a.scale * nc : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < NV; j++) {
            const qa_qgroup qg = qa_query_group(qv[j], a.correction);  // all zero past nvec
            qh[j * D + c] = qg.hi;
            ql[j * D + c] = qg.lo;
            if (lane == 0) {
                qt[j * NG + warp] = qg.step;
                qt[(NV + j) * NG + warp] = qg.sum;
                qt[(2 * NV + j) * NG + warp] = qg.q2;
            }
        }
    }
    __syncthreads();
    // B operand of group g: column n = 8 nt + gid is vector 4 nt + gid / 2, part gid % 2;
    // the epilogue's terms are those of vector 4 nt + tig (accumulator columns 2 tig, 2 tig + 1).
    // The A rows gid, gid + 8 come scaled by 2^s0, 2^s1 (qw_codes2): tq0, tq1 take it back.
    const qw_lane ln = qw_lane_of(gid);
    const float k0 = qw_pow2m(qw_scale0<BK>(gid)), k1 = qw_pow2m(qw_scale1<BK>(gid));
    const float u0 = qw_pow2m(qw_scale0<BV>(gid)) * (1.0f / 65535.0f);
    const float u1 = qw_pow2m(qw_scale1<BV>(gid)) * (1.0f / 65535.0f);
    uint32_t bq[NG][NT][2];
    float tq0[NG][NT], tq1[NG][NT], tsum[NG][NT], tq2[NG][NT];
#pragma unroll
    for (int g = 0; g < NG; g++) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int8_t * src = ((gid & 1) ? ql : qh) + (4 * nt + (gid >> 1)) * D + 32 * g;
            bq[g][nt][0] = *(const uint32_t *) (src + 4 * tig);
            bq[g][nt][1] = *(const uint32_t *) (src + 16 + 4 * tig);
            const int jt = 4 * nt + tig;
            const float tq = qt[jt * NG + g];
            tq0[g][nt] = tq * k0;
            tq1[g][nt] = tq * k1;
            tsum[g][nt] = qt[(NV + jt) * NG + g];
            tq2[g][nt] = qt[(2 * NV + jt) * NG + g];
        }
    }
    __syncthreads();  // warp 0's last stage is free again

    if (b0 < b1) {
        int cs = 0;  // the stage of block blk
        for (int blk = b0; blk < b1; blk++) {
            qa_cp_wait<IQ_QW_STAGES - 2>();
            __syncwarp();  // block blk is in for every lane; every lane is done with blk - 1
            const int is = cs == 0 ? IQ_QW_STAGES - 1 : cs - 1;  // (cs + STAGES - 1) % STAGES
            issue(blk + IQ_QW_STAGES - 1, is);
            const uint8_t * kb = ws + cs * W::SB;
            const uint8_t * vb = kb + W::KB;
            cs = cs == IQ_QW_STAGES - 1 ? 0 : cs + 1;

            // keys: tile rows = tokens 16 mt + gid (+ 8), columns = the 32 channels of group g
            const uint16_t * pk = (const uint16_t *) (kb + D * IQ_QA_G * BK / 8);
            float s[NT][2][2];  // token 16 mt + gid + 8 rr, vector 4 nt + tig
#pragma unroll
            for (int nt = 0; nt < NT; nt++) s[nt][0][0] = s[nt][0][1] = s[nt][1][0] = s[nt][1][1] = 0.0f;
#pragma unroll
            for (int g = 0; g < NG; g++) {
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    uint32_t af[4];
                    const uint8_t * t0 = kb + (mt * (D / 4) + 8 * g + tig) * (8 * BK);
                    qw_codes2<BK>(t0, gid, ln, af[0], af[1]);
                    qw_codes2<BK>(t0 + 4 * 8 * BK, gid, ln, af[2], af[3]);
                    const int t = 32 * g + 16 * mt + gid;
                    const float dk0 = qa_h2f(pk[t]), mk0 = qa_h2f(pk[D + t]);
                    const float dk1 = qa_h2f(pk[t + 8]), mk1 = qa_h2f(pk[D + t + 8]);
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        int cc[4];
                        qw_mma<true>(cc, af, bq[g][nt][0], bq[g][nt][1]);
                        const float dot0 = tq0[g][nt] * (float) (cc[0] * 254 + cc[1]);
                        const float dot1 = tq1[g][nt] * (float) (cc[2] * 254 + cc[3]);
                        s[nt][mt][0] += dk0 * (dot0 - dk0 * tq2[g][nt]) + mk0 * tsum[g][nt];
                        s[nt][mt][1] += dk1 * (dot1 - dk1 * tq2[g][nt]) + mk1 * tsum[g][nt];
                    }
                }
            }

            // online softmax of vector 4 nt + tig over the block's 32 tokens (lanes of one tig)
            float al[NT], ps[NT];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                float bm = fmaxf(fmaxf(s[nt][0][0], s[nt][0][1]), fmaxf(s[nt][1][0], s[nt][1][1]));
                bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 4));
                bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 8));
                bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, 16));
                const float m_new = fmaxf(mx[nt], bm);
                al[nt] = expf(mx[nt] - m_new);
                unsigned psum = 0;
                uint8_t * ph = pb + 2 * (4 * nt + tig) * 32;
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
#pragma unroll
                    for (int rr = 0; rr < 2; rr++) {
                        const float e = expf(s[nt][mt][rr] - m_new);
                        const unsigned p16 = __float2uint_rn(fminf(e, 1.0f) * 65535.0f);
                        const int t = 16 * mt + 8 * rr + gid;
                        ph[t] = (uint8_t) (p16 >> 8);
                        ph[32 + t] = (uint8_t) (p16 & 255u);
                        psum += p16;
                    }
                }
                psum += __shfl_xor_sync(0xffffffffu, psum, 4);
                psum += __shfl_xor_sync(0xffffffffu, psum, 8);
                psum += __shfl_xor_sync(0xffffffffu, psum, 16);
                ps[nt] = (float) psum * (1.0f / 65535.0f);  // exact: the sum is below 2^24
                mx[nt] = m_new;
                ls[nt] = ls[nt] * al[nt] + ps[nt];
            }
            __syncwarp();  // the probabilities are in pb

            // values: tile rows = channels 16 mc + gid (+ 8), columns = the block's 32 tokens
            uint32_t bp[NT][2];
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const uint8_t * src = pb + (8 * nt + gid) * 32;
                bp[nt][0] = *(const uint32_t *) (src + 4 * tig);
                bp[nt][1] = *(const uint32_t *) (src + 16 + 4 * tig);
            }
            const uint16_t * pv = (const uint16_t *) (vb + D * IQ_QA_G * BV / 8);
#pragma unroll
            for (int mc = 0; mc < NMC; mc++) {
                uint32_t af[4];
                const uint8_t * t0 = vb + (mc * 8 + tig) * (8 * BV);
                qw_codes2<BV>(t0, gid, ln, af[0], af[1]);
                qw_codes2<BV>(t0 + 4 * 8 * BV, gid, ln, af[2], af[3]);
                const int c = 16 * mc + gid;
                const float dv0 = qa_h2f(pv[c]), mv0 = qa_h2f(pv[D + c]);
                const float dv1 = qa_h2f(pv[c + 8]), mv1 = qa_h2f(pv[D + c + 8]);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    int cc[4];
                    qw_mma<false>(cc, af, bp[nt][0], bp[nt][1]);
                    const float pu0 = __uint2float_rn((unsigned) cc[0] * 256u + (unsigned) cc[1]) * u0;
                    const float pu1 = __uint2float_rn((unsigned) cc[2] * 256u + (unsigned) cc[3]) * u1;
                    acc[nt][mc][0] = fmaf(acc[nt][mc][0], al[nt], fmaf(dv0, pu0, mv0 * ps[nt]));
                    acc[nt][mc][1] = fmaf(acc[nt][mc][1], al[nt], fmaf(dv1, pu1, mv1 * ps[nt]));
                }
            }
        }
        qa_cp_wait<0>();
    }

    if (cta_merge) {
        // the CTA's warps meet: each puts its state {max, sum, acc[D]} per vector in its own
        // shared memory (its stages, idle now), then thread c merges channel c of every vector
        // over the warps and writes part n_win + (CTA's split index): NW times fewer states for
        // the merge kernel to read (15 -> 7.7 us of merge at 131072 tokens came from spreading
        // it; this takes the rest of its reads away)
        float * own = (float *) ws;  // [NV][D + 2]
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            qw_put_state<NMC>(own + (4 * nt + tig) * (D + 2), acc[nt], mx[nt], ls[nt], gid);
        }
        __syncthreads();
        const int c = threadIdx.x;
        const int cpart = (int) blockIdx.y;  // after the n_win window parts
        for (int j = 0; j < NV && j < a.nvec; j++) {
            float m = -INFINITY;
#pragma unroll
            for (int w = 0; w < NW; w++) {
                const float * st = (const float *) (sm + w * W::warp) + j * (D + 2);
                if (st[1] > 0.0f) m = fmaxf(m, st[0]);
            }
            float l = 0.0f, o = 0.0f;
#pragma unroll
            for (int w = 0; w < NW; w++) {
                const float * st = (const float *) (sm + w * W::warp) + j * (D + 2);
                const float f = st[1] > 0.0f ? expf(st[0] - m) : 0.0f;
                l = fmaf(st[1], f, l);
                o = fmaf(st[2 + c], f, o);
            }
            const int i = j / a.r, head = h * a.r + j % a.r;
            float * st = qa_state<D>(a, cpart, i, head);
            st[2 + c] = o;
            if (c == 0) {
                st[0] = m;
                st[1] = l;
            }
        }
        return;
    }

    // the state of part n_win + split (empty splits too: {-inf, 0, 0}, which the merge skips)
    if (split >= a.n_split) {
        return;
    }
    const int part = a.n_win + split;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const int j = 4 * nt + tig;
        if (j < a.nvec) {
            const int i = j / a.r, head = h * a.r + j % a.r;
            qw_put_state<NMC>(qa_state<D>(a, part, i, head), acc[nt], mx[nt], ls[nt], gid);
        }
    }
}

// ---- host side ----

// Warps of the instantiation resident per multiprocessor (from its occupancy; cached), with the
// shared-memory attributes set.
template <int D, int BK, int BV, int NT>
static int qw_warps_per_sm() {
    using W = qw_smem<D, BK, BV, NT>;
    static int warps = 0;
    if (warps == 0) {
        if (cudaFuncSetAttribute(iq_cu_qattn_mma<D, BK, BV, NT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 W::total) != cudaSuccess) {
            return -1;
        }
        if (cudaFuncSetAttribute(iq_cu_qattn_mma<D, BK, BV, NT>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 (int) cudaSharedmemCarveoutMaxShared) != cudaSuccess) {
            (void) cudaGetLastError();  // a hint only
        }
        int n = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, iq_cu_qattn_mma<D, BK, BV, NT>, D, W::total) !=
                cudaSuccess ||
            n < 1) {
            (void) cudaGetLastError();
            n = 2;
        }
        warps = n * (D / 32);
    }
    return warps;
}

// Window CTAs per head: the `slots` CTAs of a sequence's head shared between the window CTAs
// and the splits' CTAs in proportion to their work at capacity (window rows against the
// quantized tokens of `blocks` blocks), so that both end together; a window CTA takes at least
// 32 rows, and at most half the slots and the bound the work area was sized for (a.n_win on
// entry, qw_n_win) go to windows. Why: the default windows grow with the context (10,242 rows
// per KV head at 131072 tokens); at one CTA per 64 rows they took more than the wave, first in
// the grid, and the splits ran after them. A window row costs a window CTA IQ_QW_WIN_COST
// quantized tokens of a split's CTA (both D threads): measured on the H200 (docs/BENCHMARKS.md,
// "sixth round"), Llama-3-8B layer with the default windows' sizes, 0.75 to 12 swept: 3 and 4
// best at 131072 tokens (58.5 / 60.6 us), 4 at 32768 (25.1 us). Tests fix the count instead
// (iq_cuda_variants.qw_win, within the same bounds).
static int qw_win_ctas(const iq_qa_args & a, int slots, int blocks) {
    const int rows = qa_win_rows(a.s_cap, a.cap_recent);
    int hi = a.n_win < (rows + 31) / 32 ? a.n_win : (rows + 31) / 32;
    hi = hi < slots / 2 ? hi : slots / 2;
    hi = hi > 1 ? hi : 1;
    const double w = (double) rows * IQ_QW_WIN_COST, q = (double) blocks * IQ_QA_G;
    const int n = iq_cuda_variants.qw_win > 0 ? iq_cuda_variants.qw_win : (int) (slots * w / (w + q) + 0.5);
    return n < 1 ? 1 : n > hi ? hi : n;
}

// Launches the instantiation over grid (KV head, n_win + split CTAs, sequence) with the
// schedule of the one-tile kernel's occupancy (NT 1) whichever variant runs, so that a sequence's
// splits do not depend on the other sequences' tokens. One slot: the sequence's CTAs fill one wave
// (window CTAs by qw_win_ctas). Several: a sequence's head takes its slot's share of the wave, or
// more CTAs as long as a split holds IQ_QA_SPLIT_BLOCKS blocks of a slot's length, its window CTAs
// again in proportion to the work.
template <int D, int BK, int BV, int NT>
static int qw_launch(const struct iq_cuda_ctx * c, iq_qa_args & a, int n_kv, int cap_blocks, int n_slots) {
    const int warps = qw_warps_per_sm<D, BK, BV, 1>();
    if (warps < 0 || qw_warps_per_sm<D, BK, BV, NT>() < 0) {
        return iq_cuda_launched("quantized attention (shared memory)");
    }
    constexpr int NW = D / 32;
    const int slots = warps / NW * (c->n_sm > 0 ? c->n_sm : 1) / n_kv;
    n_slots = n_slots > 1 ? n_slots : 1;
    const int blocks = cap_blocks / n_slots > 1 ? cap_blocks / n_slots : 1;  // the blocks a slot's sequence may reach
    int n_split;
    if (n_slots == 1) {
        a.n_win = qw_win_ctas(a, slots, blocks);
        n_split = qa_splits_in_wave(slots, a.n_win, NW);
    } else {
        const double work = (double) blocks * IQ_QA_G + (double) qa_win_rows(a.s_cap, a.cap_recent) * IQ_QW_WIN_COST;
        int per = (int) ((work + NW * IQ_QA_SPLIT_BLOCKS * IQ_QA_G - 1) / (NW * IQ_QA_SPLIT_BLOCKS * IQ_QA_G));
        per = per > slots / n_slots ? per : slots / n_slots;
        per = per > 2 ? per : 2;
        a.n_win = qw_win_ctas(a, per, blocks);
        n_split = (per - a.n_win) * NW;
    }
    n_split = n_split < blocks ? n_split : blocks;
    n_split = n_split < IQ_QW_MAX_SPLIT ? n_split : IQ_QW_MAX_SPLIT;
    a.n_split = n_split > 1 ? n_split : 1;
    a.merge_warps = NW;
    const dim3 grid((unsigned) n_kv, (unsigned) (a.n_win + (a.n_split + NW - 1) / NW), (unsigned) a.seqs.n_seq);
    iq_cu_launch(c, iq_cu_qattn_mma<D, BK, BV, NT>, grid, D, qw_smem<D, BK, BV, NT>::total, a);
    return iq_cuda_launched("quantized attention");
}

template <int D, int BK, int BV>
static int qw_launch_nt(const struct iq_cuda_ctx * c, iq_qa_args & a, int nvec, int n_kv, int cap_blocks, int n_slots) {
    return nvec <= 4 ? qw_launch<D, BK, BV, 1>(c, a, n_kv, cap_blocks, n_slots)
                     : qw_launch<D, BK, BV, 2>(c, a, n_kv, cap_blocks, n_slots);
}

template <int D, int BK>
static int qw_launch_bv(const struct iq_cuda_ctx * c, iq_qa_args & a, int nvec, int bv, int n_kv, int cap_blocks,
                        int n_slots) {
    switch (bv) {
        case 2: return qw_launch_nt<D, BK, 2>(c, a, nvec, n_kv, cap_blocks, n_slots);
        case 3: return qw_launch_nt<D, BK, 3>(c, a, nvec, n_kv, cap_blocks, n_slots);
        case 4: return qw_launch_nt<D, BK, 4>(c, a, nvec, n_kv, cap_blocks, n_slots);
        default: return qw_launch_nt<D, BK, 5>(c, a, nvec, n_kv, cap_blocks, n_slots);
    }
}

template <int D>
static int qw_launch_bk(const struct iq_cuda_ctx * c, iq_qa_args & a, int nvec, int bk, int bv, int n_kv,
                        int cap_blocks, int n_slots) {
    switch (bk) {
        case 2: return qw_launch_bv<D, 2>(c, a, nvec, bv, n_kv, cap_blocks, n_slots);
        case 3: return qw_launch_bv<D, 3>(c, a, nvec, bv, n_kv, cap_blocks, n_slots);
        case 4: return qw_launch_bv<D, 4>(c, a, nvec, bv, n_kv, cap_blocks, n_slots);
        default: return qw_launch_bv<D, 5>(c, a, nvec, bv, n_kv, cap_blocks, n_slots);
    }
}

// head_dim 64 or 128: qa_mma_ok sends 256 to the CTA kernel.
int iq_cuda_qattn_mma(const struct iq_cuda_ctx * c, iq_qa_args & a, int hd, int bits_k, int bits_v, int n_kv,
                      int cap_blocks, int n_slots, int nvec) {
    return hd == 64 ? qw_launch_bk<64>(c, a, nvec, bits_k, bits_v, n_kv, cap_blocks, n_slots)
                    : qw_launch_bk<128>(c, a, nvec, bits_k, bits_v, n_kv, cap_blocks, n_slots);
}
