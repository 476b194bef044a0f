// Fused decode attention over the InnerQ quantized KV cache (iq-qcache.h), G = 32: one query
// token or a small causal batch (n_q <= 4) against the sink, the quantized blocks, the recent
// window and the batch's own rows. The specification is iq_qcache_attention_ref.
//
// Why it is built this way. Decode attention at long context streams the cache once, so the
// time is the bytes (K3/V2 G32: 112 bytes per token and KV head) over the HBM bandwidth; the
// arithmetic (2 * D * r multiply-adds per token and KV head, r = query vectors sharing the head)
// is 9 multiply-adds per byte for a Llama-3-8B layer, more than the f32 FMA pipe keeps up with
// at 4 TB/s. So the dot products run on packed 8-bit codes with __dp4a (4 multiply-adds per
// instruction), with the query and the probabilities in two 8-bit parts each (hi + lo / 254,
// hi + lo / 256) so the result stays within ~2e-5 of f32 arithmetic, and everything per group
// ((d, m), sum q~, the score correction) applied once per group:
//   keys   (group = 32 channels of one token): s_t = sum_g d_tg * (sq_g / 254 * sum_c q8_c u_tc)
//          + m_tg * sum_g q~ - d_tg^2 * q2_g, with q~ = scale * q (.) n (key normalization in the query).
//   values (group = the 32 tokens of a block of one channel): acc_c = d_c * sum_t p_t u_tc + m_c * sum_t p_t,
//          p_t the block's softmax weights as 16-bit fixed point (sum_t p_t once per block).
// The block format needs no repacking: a 32-bit word of a tile, shifted and masked
// (0x03030303 / 0x0F0F0F0F, the 3-bit plane spread in with one multiply), is four 8-bit codes of
// four consecutive reduction elements (channels of a key token, tokens of a value channel), the
// operand __dp4a takes; query and probabilities are packed the same way in shared memory and
// read as warp-wide broadcasts.
//
// Grid: (KV head, split, sequence), one CTA of D threads per (head, split) of a sequence holding
// all n_q * r query vectors of the head, so each KV byte is read once for every query head of its
// group; a sequence's blocks are found through its page table. The quantized blocks (32 tokens)
// are split evenly over n_split CTAs; n_split depends on the shapes and the device only, never
// on the counters or the step's other sequences; the kernel reads the counters from device
// memory (the step's rows, kv-seqs.cuh), so the launches replay in a CUDA graph; splits past the
// live blocks write an empty state. With several slots (qa_schedule) each sequence takes its
// slot's share of the wave, below. The quantized splits fill exactly one wave: n_kv * n_split = the CTAs
// resident per SM (cudaOccupancyMaxActiveBlocksPerMultiprocessor of the instantiation) * SMs;
// the short window CTAs come first in the grid (y < n_win), and the few splits that do not fit
// start as they finish. Why: a CTA is a serial chain of blocks with three barriers each, so the
// stream runs at (warps resident) / (chain latency); with 4 CTAs of 4 warps per SM it reached
// ~1 TB/s. The launch bounds cap the registers so that 8 CTAs of 128 threads fit (64 registers,
// no spills, up to 4 query vectors per head): twice the warps and bytes in flight per SM, and
// half the blocks per chain; a partial second wave of long splits would double the time. A CTA
// streams its blocks whole (K block then V block) through a 4-stage cp.async pipeline of 16-byte
// copies into shared memory (3 blocks, ~10.5 KB at K3V2 D128, in flight per CTA; 8 CTAs use
// ~150 KB of the 228 KB). Keys: thread (group g = warp, token t = lane) decodes its 32 codes
// from the tile words; the group partials meet in shared memory; warp w runs the online softmax
// of vectors w, w + D/32, ...; values: thread c owns channel c of every vector's accumulator.
// n_win more CTAs per head (y = w < n_win) take the f16 windows (sink, recent) and the
// batch rows in f32 chunks of 32 rows, chunk w, w + n_win, ...: rows before a query's own rounded
// to f16 with decode semantics, its own row unrounded (cpu/ops-attention.c attn_item). n_win =
// one per 32 rows of the largest window (at most 4), so the window (serial, uncoalesced row
// reads) is never the long pole at short context. A second kernel merges the n_split + n_win
// states exactly ({max, sum, acc}), as iq_cu_attn_merge does, with 512 threads per (head, query,
// 32 channels) over parts (a serial loop over the parts took 30 us for 32 heads x 68 parts).
#include "qattention.cuh"


// Four codes of reduction elements 4*quad .. 4*quad + 3 of lane `ln` of a block's codes, one per
// byte (the layout comment of iq-qcache.h): tile (ln / 16) * quads + quad, code p = 4 (ln % 16) + sub % 4.
template <int B>
static __device__ __forceinline__ uint32_t qa_codes4(const uint8_t * tile, int ln) {
    const int l16 = ln & 15;
    if (B >= 4) {  // code p in byte p % 32, bits 4 (p / 32)
        const uint32_t w = *(const uint32_t *) (tile + 4 * (l16 & 7));
        uint32_t x = (w >> (4 * (l16 >> 3))) & 0x0F0F0F0Fu;
        if (B == 5) {  // bit 4 of code p: bit p % 8 of byte 32 + p / 8, i.e. nibble l16 % 2 of byte 32 + l16 / 2
            const uint32_t nib = (tile[32 + (l16 >> 1)] >> (4 * (l16 & 1))) & 15u;
            x |= ((nib * 0x00204081u) & 0x01010101u) << 4;
        }
        return x;
    }
    // code p in byte p % 16, bits 2 (p / 16)
    const uint32_t w = *(const uint32_t *) (tile + 4 * (l16 & 3));
    uint32_t x = (w >> (2 * (l16 >> 2))) & 0x03030303u;
    if (B == 3) {  // bit 2 of code p: bit p % 8 of byte 16 + p / 8, i.e. nibble l16 % 2 of byte 16 + l16 / 2
        const uint32_t nib = (tile[16 + (l16 >> 1)] >> (4 * (l16 & 1))) & 15u;
        x |= ((nib * 0x00204081u) & 0x01010101u) << 2;  // nibble bit i -> bit 0 of byte i
    }
    return x;
}


// The (d, m) of group gi of a block whose parameters are at p: fp16 d[D], m[D], or (p8) 8-bit
// ones against the block's references, decoded as iq_p8_decode_group (centre: the symmetric
// grid's, 2^(b-1)).
template <int D>
static __device__ __forceinline__ void qa_params(const uint8_t * p, bool p8, float centre, int gi, float & d, float & m) {
    if (!p8) {
        d = qa_h2f(((const uint16_t *) p)[gi]);
        m = qa_h2f(((const uint16_t *) p)[D + gi]);
        return;
    }
    float ref[3];
    iq_p8_refs(p, ref);
    iq_fp16_t dh, mh;
    iq_p8_decode_one(ref, p[IQ_P8_REFS + gi], p[IQ_P8_REFS + D + gi], centre, &dh, &mh);
    d = iq_half_to_float(dh);
    m = iq_half_to_float(mh);
}

// CTAs per multiprocessor the register budget is capped for (launch bounds): 8 CTAs of 128
// threads (64 registers) for up to 4 query vectors per head, fewer for the wider variants.
template <int D, int NV>
static constexpr int qa_min_blocks() { return NV <= 4 ? 1024 / D : NV <= 8 ? 768 / D : 256 / D; }

// F: blocks of any format (8-bit parameters, value row scales, read from a); without it the
// blocks have fp16 parameters and no row scales, and the kernel is compiled for them alone. Why:
// with one kernel for both, the default cache's CTA kernel took 24.8 us against 12e9438's 15.9
// (ncu, cold L2, 8B heads, K4/V2, 4096 tokens, H100); this one, its shared memory at 12e9438's
// offsets, 1.00x 12e9438's time (docs/BENCHMARKS.md, "The CTA kernel at 12e9438's shared-memory
// offsets").
template <int D, int BK, int BV, int NV, bool F>
__global__ void __launch_bounds__(D, qa_min_blocks<D, NV>()) iq_cu_qattention(const iq_qa_args a0) {
    iq_cu_pdl_trigger();
    iq_cu_pdl_wait();
    iq_qa_args a = a0;
    if (!qa_seq_view(a, false)) {
        return;
    }
    using L = qa_smem<D, BK, BV, NV, F>;
    constexpr int NW = D / 32, NG = L::NG, NVW = (NV + NW - 1) / NW;
    const bool p8 = F && a.p8, rows = F && a.rows;
    extern __shared__ __align__(16) uint8_t sm[];
    int8_t * qh8 = (int8_t *) (sm + L::qh);
    int8_t * ql8 = (int8_t *) (sm + L::ql);
    float * qa = (float *) (sm + L::qa);
    float * qsum = (float *) (sm + L::qs);
    float * q2 = (float *) (sm + L::q2);
    float * sp = (float *) (sm + L::sp);
    uint8_t * ph = sm + L::ph;
    uint8_t * pl = sm + L::pl;
    float * al = (float *) (sm + L::al);
    float * ps = (float *) (sm + L::ps);
    float * wm = (float *) (sm + L::wm);
    uint8_t * un = sm + L::u;

    // y = 0 .. n_win - 1: the window CTAs, first, so that they are in the first wave (they are
    // short; quantized splits that do not fit start as they finish); then the quantized splits
    const int h = blockIdx.x, part = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int nvec = a.nvec;
    const int n_quant = qa_count(a, IQ_KV_S_N_QUANT);
    const bool window = part < a.n_win;
    const int split = part - a.n_win;  // the quantized split (not a window CTA); window CTA w = part

    float acc[NV];  // channel tid of every vector
    float mx[NVW], ls[NVW];  // states of the vectors warp w runs: w + NW k
#pragma unroll
    for (int j = 0; j < NV; j++) acc[j] = 0.0f;
#pragma unroll
    for (int k = 0; k < NVW; k++) {
        mx[k] = -INFINITY;
        ls[k] = 0.0f;
    }

    if (!window) {
        const int nb = a.cap_blocks > 0 ? n_quant / IQ_QA_G : 0;  // a layer without blocks: its windows only
        const int chunk = (nb + a.n_split - 1) / a.n_split;
        const int b0 = split * chunk;
        const int b1 = b0 + chunk < nb ? b0 + chunk : nb;
        if (b0 < b1) {
            // a block pair's bytes (<= L::SB)
            const int kbytes = F ? a.kb : L::KB, vbytes = F ? a.vb : L::VB, sb = kbytes + vbytes;
            const uint8_t * gk = a.quant_k + ((size_t) h * a.cap_blocks) * kbytes;
            const uint8_t * gv = a.quant_v + ((size_t) h * a.cap_blocks) * vbytes;
            auto issue = [&](int blk) {
                uint8_t * st = un + (blk - b0) % IQ_QA_STAGES * sb;
                if (blk < b1) {
                    const size_t pg = (size_t) a.pages[blk];
                    if (!F || !a.cp8) {
                        for (int i = tid; i < (sb >> 4); i += D) {
                            const int off = 16 * i;
                            qa_cp16(st + off, off < kbytes ? gk + pg * kbytes + off : gv + pg * vbytes + (off - kbytes));
                        }
                    } else {  // blocks of 8 bytes more than a multiple of 16 (8-bit parameters)
                        for (int i = tid; i < (sb >> 3); i += D) {
                            const int off = 8 * i;
                            qa_cp8(st + off, off < kbytes ? gk + pg * kbytes + off : gv + pg * vbytes + (off - kbytes));
                        }
                    }
                }
                qa_cp_commit();
            };
#pragma unroll
            for (int s = 0; s < IQ_QA_STAGES - 1; s++) issue(b0 + s);

            // the query: q~ = scale * q (.) n per key group as hi + lo / 254 int8 parts of step sq / 127
            const float * norm = a.norm + (size_t) (a.hs0 + h) * D;
            for (int pair = warp; pair < nvec * NG; pair += NW) {
                const int j = pair / NG, g = pair % NG, c = 32 * g + lane;
                const int i = j / a.r, head = h * a.r + j % a.r;
                const qa_qgroup qg =
                    qa_query_group(a.q[((a.tok0 + i) * a.q_nb2 + head * a.q_nb1) / sizeof(float) + c] * a.scale * norm[c],
                                   a.correction);
                qh8[j * D + c] = qg.hi;
                ql8[j * D + c] = qg.lo;
                if (lane == 0) {
                    qa[j * NG + g] = qg.step;
                    qsum[j * NG + g] = qg.sum;
                    q2[j * NG + g] = qg.q2;
                }
            }

            for (int blk = b0; blk < b1; blk++) {
                qa_cp_wait<IQ_QA_STAGES - 2>();
                __syncthreads();  // block blk is in; everyone is done with blk - 1 (and the query is ready)
                issue(blk + IQ_QA_STAGES - 1);
                const uint8_t * kb = un + (blk - b0) % IQ_QA_STAGES * sb;
                const uint8_t * vb = kb + kbytes;

                // keys: thread (group g = warp, token t = lane)
                {
                    const int g = warp, t = lane;
                    uint32_t cw[8];
#pragma unroll
                    for (int qd = 0; qd < 8; qd++) {
                        cw[qd] = qa_codes4<BK>(kb + ((t >> 4) * (D / 4) + 8 * g + qd) * (8 * BK), t);
                    }
                    float dk, mk;
                    qa_params<D>(kb + L::KC, p8, (float) (1 << (BK - 1)), 32 * g + t, dk, mk);
#pragma unroll
                    for (int j = 0; j < NV; j++) {
                        if (j < nvec) {
                            const int4 * hq = (const int4 *) (qh8 + j * D + 32 * g);
                            const int4 * lq = (const int4 *) (ql8 + j * D + 32 * g);
                            const int4 h0 = hq[0], h1 = hq[1], l0 = lq[0], l1 = lq[1];
                            int sh = 0, sl = 0;
                            sh = __dp4a((int) cw[0], h0.x, sh); sl = __dp4a((int) cw[0], l0.x, sl);
                            sh = __dp4a((int) cw[1], h0.y, sh); sl = __dp4a((int) cw[1], l0.y, sl);
                            sh = __dp4a((int) cw[2], h0.z, sh); sl = __dp4a((int) cw[2], l0.z, sl);
                            sh = __dp4a((int) cw[3], h0.w, sh); sl = __dp4a((int) cw[3], l0.w, sl);
                            sh = __dp4a((int) cw[4], h1.x, sh); sl = __dp4a((int) cw[4], l1.x, sl);
                            sh = __dp4a((int) cw[5], h1.y, sh); sl = __dp4a((int) cw[5], l1.y, sl);
                            sh = __dp4a((int) cw[6], h1.z, sh); sl = __dp4a((int) cw[6], l1.z, sl);
                            sh = __dp4a((int) cw[7], h1.w, sh); sl = __dp4a((int) cw[7], l1.w, sl);
                            const float dot = qa[j * NG + g] * (float) (sh * 254 + sl);
                            sp[(g * NV + j) * 32 + t] = dk * (dot - dk * q2[j * NG + g]) + mk * qsum[j * NG + g];
                        }
                    }
                }
                __syncthreads();
                // online softmax: warp w runs vectors w + NW k; lane t is token t of the block
#pragma unroll
                for (int k = 0; k < NVW; k++) {
                    const int j = warp + NW * k;
                    if (j < nvec) {
                        float s = 0.0f;
#pragma unroll
                        for (int g = 0; g < NG; g++) s += sp[(g * NV + j) * 32 + lane];
                        const float m_new = fmaxf(mx[k], qa_warp_max(s));
                        const float alpha = expf(mx[k] - m_new);
                        const float e = expf(s - m_new);
                        float unit = 1.0f, w = fminf(e, 1.0f);
                        if (rows) {  // the weight e n_t in 16 bits of the block's largest, which is their unit
                            const float en = e * iq_row_scale(vb[L::VC + (p8 ? IQ_P8_REFS + 2 * D : 4 * D) + lane]);
                            unit = qa_warp_max(en);
                            w = unit > 0.0f ? fminf(en / unit, 1.0f) : 0.0f;
                        }
                        const unsigned p16 = __float2uint_rn(w * 65535.0f);
                        ph[j * 32 + lane] = (uint8_t) (p16 >> 8);
                        pl[j * 32 + lane] = (uint8_t) (p16 & 255u);
                        const float wsum = qa_warp_sum((float) p16) * (1.0f / 65535.0f);
                        const float psum = rows ? qa_warp_sum(e) : wsum;
                        mx[k] = m_new;
                        ls[k] = ls[k] * alpha + psum;
                        if (lane == 0) {
                            al[j] = alpha;
                            ps[j] = F ? wsum * unit : wsum;
                            if (F) {
                                wm[j] = unit * (1.0f / 65535.0f);  // 1 / 65535 without row scales
                            }
                        }
                    }
                }
                __syncthreads();
                // values: thread c = channel c
                {
                    const int c = tid;
                    uint32_t vw[8];
#pragma unroll
                    for (int tq = 0; tq < 8; tq++) vw[tq] = qa_codes4<BV>(vb + ((c >> 4) * 8 + tq) * (8 * BV), c);
                    float dv, mv;
                    qa_params<D>(vb + L::VC, p8, (float) (1 << (BV - 1)), c, dv, mv);
#pragma unroll
                    for (int j = 0; j < NV; j++) {
                        if (j < nvec) {
                            const uint4 * h4 = (const uint4 *) (ph + j * 32);
                            const uint4 * l4 = (const uint4 *) (pl + j * 32);
                            const uint4 h0 = h4[0], h1 = h4[1], l0 = l4[0], l1 = l4[1];
                            unsigned sh = 0, sl = 0;
                            sh = __dp4a(vw[0], h0.x, sh); sl = __dp4a(vw[0], l0.x, sl);
                            sh = __dp4a(vw[1], h0.y, sh); sl = __dp4a(vw[1], l0.y, sl);
                            sh = __dp4a(vw[2], h0.z, sh); sl = __dp4a(vw[2], l0.z, sl);
                            sh = __dp4a(vw[3], h0.w, sh); sl = __dp4a(vw[3], l0.w, sl);
                            sh = __dp4a(vw[4], h1.x, sh); sl = __dp4a(vw[4], l1.x, sl);
                            sh = __dp4a(vw[5], h1.y, sh); sl = __dp4a(vw[5], l1.y, sl);
                            sh = __dp4a(vw[6], h1.z, sh); sl = __dp4a(vw[6], l1.z, sl);
                            sh = __dp4a(vw[7], h1.w, sh); sl = __dp4a(vw[7], l1.w, sl);
                            const float pu = __uint2float_rn(sh * 256u + sl) * (F ? wm[j] : 1.0f / 65535.0f);
                            acc[j] = fmaf(acc[j], al[j], fmaf(dv, pu, mv * ps[j]));
                        }
                    }
                }
            }
            qa_cp_wait<0>();
        }
    } else {
        qa_window<D, NV, 1, false, F>(a, h, part, sm, acc, mx, ls);
    }
    qa_write_state<D, NV>(a, h, part, acc, mx, ls);
}

// Which batch rows a merge of the fused kernels' states takes, and how many parts each has.
struct qa_merge_args {
    iq_cu_seqs seqs;
    int q_max, r, part_rows, n_head, hd;
    bool mma_ok;
    int parts_mma, parts_cta;  // states of a sequence of the warp kernel, of the CTA kernel
};

// The first state of batch row t and head among the parts' states (*first; the next part's is
// *stride floats further) and the row's number of parts: 0 where the fused kernels did not
// take its sequence (the dequantized path writes its rows).
static __device__ __forceinline__ int qa_merge_row(const qa_merge_args & m, const float * part, int t, int head,
                                                   const float ** first, size_t * stride) {
    const int s = iq_cu_seq_of_token(m.seqs, t);
    const int32_t * row = iq_cu_seq_row(m.seqs, s);
    const int n = row[IQ_KV_S_N_TOKENS];
    if (n > m.q_max) {
        return 0;
    }
    *first = part + (((size_t) s * m.q_max + (t - row[IQ_KV_S_TOKEN0])) * m.n_head + head) * (m.hd + 2);
    *stride = (size_t) m.part_rows * m.n_head * (m.hd + 2);
    return qa_takes(n, m.r, m.q_max, m.mma_ok, true) ? m.parts_mma : m.parts_cta;
}

// The merge: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over the parts that saw any
// token. CTA (head, query, chunk) of IQ_QA_MERGE_THREADS threads makes channels 32 chunk ..
// 32 chunk + 31 of (head, query). Its threads first take the parts' {max, sum} (block-wide
// max, weights e^(m_s - M) into shared memory, block-wide sum), then thread
// (channel c = lane, slice = warp) sums its channel over parts slice, slice + 16, ... with 8
// independent loads in flight (a warp reads 128 contiguous bytes of a part), and the slices meet
// in shared memory. Why the channel chunks: with one CTA per (head, query) a decode step has 32
// CTAs on 132 multiprocessors, and the merge of 448 parts took 15 us on the H200 (ncu), a fifth
// of the whole step at 131072 tokens; D / 32 chunks give 4x the CTAs, each reading a quarter.
// NT threads: IQ_QA_MERGE_THREADS where a sequence may have many parts (one slot),
// IQ_QA_MERGE_FEW where none has more than IQ_QA_FEW_PARTS (a context of many slots, whose
// sequences take a few splits each): there the 512-thread CTAs, one per (head, query, chunk),
// were eight waves of nearly idle threads (36 us per layer for 32 sequences of 17 parts, ncu).
template <int NT>
__global__ void __launch_bounds__(NT)
    iq_cu_qattention_merge_par(const float * __restrict__ part, float * dst, size_t dst_nb1, const qa_merge_args m) {
    iq_cu_pdl_trigger();
    iq_cu_pdl_wait();
    constexpr int NW = NT / 32;
    __shared__ float w[IQ_QA_MAX_PARTS];
    __shared__ float red[NW];
    __shared__ float accs[NW][32];
    const int head = blockIdx.x, i = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32, hd = m.hd;
    const float * first;
    size_t stride;
    const int n_parts = qa_merge_row(m, part, i, head, &first, &stride);
    if (n_parts == 0) {
        return;
    }

    float mx = -INFINITY;
    for (int s = tid; s < n_parts; s += NT) {
        if (first[s * stride + 1] > 0.0f) mx = fmaxf(mx, first[s * stride]);
    }
    mx = qa_warp_max(mx);
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = red[0];
#pragma unroll
    for (int k = 1; k < NW; k++) mx = fmaxf(mx, red[k]);
    __syncthreads();  // red is reused
    float sum = 0.0f;
    for (int s = tid; s < n_parts; s += NT) {
        const float l = first[s * stride + 1];
        const float e = l > 0.0f ? expf(first[s * stride] - mx) : 0.0f;
        w[s] = e;
        sum += e * l;
    }
    sum = qa_warp_sum(sum);
    if (lane == 0) red[warp] = sum;
    __syncthreads();  // w and red written
    sum = 0.0f;
#pragma unroll
    for (int k = 0; k < NW; k++) sum += red[k];
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;

    const int c = 32 * (int) blockIdx.z + lane;
    const float * col = first + 2 + c;
    float acc = 0.0f;
    int s = warp;
#pragma unroll 1
    for (; s + 7 * NW < n_parts; s += 8 * NW) {  // 8 independent loads in flight
        float x[8], ws[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            ws[u] = w[s + u * NW];
            x[u] = ws[u] != 0.0f ? col[(size_t) (s + u * NW) * stride] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < 8; u++) acc = fmaf(ws[u], x[u], acc);
    }
    for (; s < n_parts; s += NW) {
        if (w[s] != 0.0f) acc += w[s] * col[(size_t) s * stride];
    }
    accs[warp][lane] = acc;
    __syncthreads();
    if (tid < 32) {
        float t = 0.0f;
#pragma unroll
        for (int k = 0; k < NW; k++) t += accs[k][tid];
        dst[(i * dst_nb1) / sizeof(float) + (size_t) head * hd + c] = t * inv;
    }
}

// ---- host side ----

// Which kernel takes a sequence. By default (a rule of shapes only, so graphs replay): the warp
// kernel on tensor cores (qattention-mma.cu) for up to 8 query vectors per KV head where a slot's
// sequence may reach IQ_QW_MIN_BLOCKS blocks (4096 tokens), the CTA kernel otherwise. Measured on
// the H200 (docs/BENCHMARKS.md, "fifth round"), default windows, Llama-3-8B layer (4 vectors),
// warp vs CTA kernel: 14.7 vs 17.4 us at 4096 tokens, 15.0 vs 19.4 at 8192, 19.1 vs 24.5 at
// 16384, 24.7 vs 37.3 at 32768; below 4096 not measured (the warp kernel's fixed chain: query
// preparation, window CTAs, is what a short cache pays). Tests force either kernel
// (iq_cuda_variants.qattn: the warp kernel wherever it applies, up to 8 vectors, or the CTA kernel).
#define IQ_QW_MIN_BLOCKS 128
// Whether the warp kernel takes the pool's sequences of up to 8 query vectors. Not at head_dim
// 256: its warps' stages (8 warps of 3 blocks) pass the shared memory of a multiprocessor at 4
// bits and up, and its accumulators the registers its occupancy needs; the CTA kernel takes it.
static bool qa_mma_ok(const struct iq_qcache * qc) {
    if (qc->head_dim > 128 || qc->cfg.params8 || qc->cfg.value_scales) {
        return false;  // the warp kernel reads blocks of fp16 parameters without row scales
    }
    if (qc->cap_blocks == 0) {
        return false;  // a layer without blocks (a sliding window's): the warp kernel has no window mask
    }
    switch (iq_cuda_variants.qattn) {
        case IQ_QATTN_MMA: return true;
        case IQ_QATTN_DP4A: return false;
        default: return qc->cap_blocks / (qc->n_slots > 0 ? qc->n_slots : 1) >= IQ_QW_MIN_BLOCKS;
    }
}

// The most window CTAs per head of the warp kernel: one per IQ_QW_WIN_ROWS window rows, 1 to
// IQ_QW_MAX_WIN (qw_win_ctas, qattention-mma.cu, takes fewer: as many as share the wave).
static int qw_n_win(const struct iq_qcache * qc) {
    const int n = (qa_win_rows(qc->cfg.n_sink, qc->cap_recent) + IQ_QW_WIN_ROWS - 1) / IQ_QW_WIN_ROWS;
    return n < 1 ? 1 : n > IQ_QW_MAX_WIN ? IQ_QW_MAX_WIN : n;
}

// The CTA kernel's schedule, a.n_win and a.n_split, from the shapes and the CTAs resident per
// multiprocessor (cta_per_sm, from the occupancy of the kernel: a property of the device and the
// shapes only, so the launches replay in a CUDA graph). One slot: all n_kv * (n_split + n_win)
// CTAs in one wave; several slots: each slot's share of the wave, or more, each split holding
// IQ_QA_SPLIT_BLOCKS blocks of the length a slot's sequence may reach.
static void qa_schedule(iq_qa_args & a, const struct iq_qcache * qc, int n_sm, int cta_per_sm) {
    const int n_kv = qc->n_kv_head, n_slots = qc->n_slots > 0 ? qc->n_slots : 1;
    const int blocks = qc->cap_blocks / n_slots;  // the blocks a slot's sequence may reach
    n_sm = n_sm > 0 ? n_sm : 1;
    // window CTAs: one per 32 window rows up to 4, and past 128 rows one per 64 up to
    // IQ_QW_MAX_WIN: the default windows grow with the context (2,560 rows at 32768 tokens),
    // which 4 CTAs per head took as a serial chain of 20 chunks each, longer than the
    // quantized splits
    const int rows = qa_win_rows(qc->cfg.n_sink, qc->cap_recent);
    if (rows > 4 * 32) {
        a.n_win = (rows + 63) / 64;
        a.n_win = a.n_win < IQ_QW_MAX_WIN ? a.n_win : IQ_QW_MAX_WIN;
    } else {
        a.n_win = (rows + 31) / 32;
        a.n_win = a.n_win < IQ_QA_MAX_WIN ? (a.n_win > 1 ? a.n_win : 1) : IQ_QA_MAX_WIN;
    }
    cta_per_sm = cta_per_sm > 0 ? cta_per_sm : 4;
    const int slots = cta_per_sm * n_sm / n_kv / n_slots;
    int n_split = qa_splits_in_wave(slots > 1 ? slots : 1, a.n_win, 1);
    if (n_slots > 1) {
        const int by_blocks = (blocks + IQ_QA_SPLIT_BLOCKS - 1) / IQ_QA_SPLIT_BLOCKS;
        n_split = n_split > by_blocks ? n_split : by_blocks;
    }
    const int by_len = blocks / 2;  // at least 2 blocks per split at capacity
    n_split = n_split < by_len ? n_split : by_len;
    n_split = n_split < IQ_QA_MAX_SPLIT ? n_split : IQ_QA_MAX_SPLIT;
    a.n_split = n_split > 1 ? n_split : 1;
}

bool iq_cuda_qcache_attention_decode_supports(const struct iq_tensor * dst, const struct iq_qcache * qc) {
    const struct iq_qcache_config * cfg = &qc->cfg;
    const struct iq_tensor * q = dst->src[0];
    if (dst->op != IQ_OP_ATTENTION || cfg->axis_k != IQ_QAXIS_CHANNELS || cfg->axis_v != IQ_QAXIS_TOKENS ||
        cfg->group != IQ_QA_G || cfg->bits_k < 2 || cfg->bits_k > 5 || cfg->bits_v < 2 || cfg->bits_v > 5) {
        return false;
    }
    if (!iq_cuda_head_dim(qc->head_dim)) {
        return false;
    }
    if (cfg->key_levels) {
        return false;  // uniform key codes only; keys on the key levels are dequantized
    }
    if (q == NULL || q->ne[0] != qc->head_dim || q->ne[2] < 1 || qc->n_kv_head <= 0 ||
        q->ne[1] % qc->n_kv_head != 0 || q->ne[1] / qc->n_kv_head > 8) {
        return false;
    }
    return dst->src[1] != NULL && dst->src[2] != NULL;
}

// The most tokens of a sequence the fused kernels take in a step of the op's shape: up to
// IQ_QA_MAX_Q, and no more than one sequence can hold; 0 where no sequence can be theirs (one
// sequence of more tokens: a prompt chunk).
static int qa_q_max(const struct iq_tensor * dst) {
    const int64_t n = dst->src[0]->ne[2], n_seq = dst->src[IQ_KV_SRC_SEQS]->ne[1];
    if (n_seq == 1 && n > IQ_QA_MAX_Q) {
        return 0;
    }
    const int64_t most = n - n_seq + 1;
    return most < IQ_QA_MAX_Q ? (int) most : IQ_QA_MAX_Q;
}

size_t iq_cuda_qcache_attention_decode_work_size(const struct iq_tensor * dst, const struct iq_qcache * qc, int n_sm) {
    (void) qc, (void) n_sm;
    // every schedule writes at most IQ_QA_MAX_PARTS states per query vector (the merge's bound)
    const struct iq_tensor * q = dst->src[0];
    const size_t rows = (size_t) dst->src[IQ_KV_SRC_SEQS]->ne[1] * (size_t) qa_q_max(dst);
    return (size_t) IQ_QA_MAX_PARTS * rows * (size_t) q->ne[1] * (size_t) (q->ne[0] + 2) * sizeof(float);
}

// CTAs of the instantiation resident per multiprocessor (its occupancy, cached; at most 2048
// threads' worth), with its shared-memory attributes set; -1 if they can't be.
template <int D, int BK, int BV, int NV, bool F>
static int qa_ctas_per_sm() {
    using L = qa_smem<D, BK, BV, NV, F>;
    static int occ = 0;  // per instantiation; setting the attributes twice is harmless
    if (occ == 0) {
        if (cudaFuncSetAttribute(iq_cu_qattention<D, BK, BV, NV, F>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 L::total) != cudaSuccess) {
            return -1;
        }
        // all of the unified L1 / shared memory as shared memory (the copies bypass L1): the
        // occupancy below assumes it
        if (cudaFuncSetAttribute(iq_cu_qattention<D, BK, BV, NV, F>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 (int) cudaSharedmemCarveoutMaxShared) != cudaSuccess) {
            (void) cudaGetLastError();  // a hint only
        }
        int n = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, iq_cu_qattention<D, BK, BV, NV, F>, D, L::total) !=
                cudaSuccess ||
            n < 1) {
            (void) cudaGetLastError();
            n = 4;
        }
        occ = n < 2048 / D ? n : 2048 / D;
    }
    return occ;
}

// Launches the instantiation over grid (KV head, n_split + n_win, sequence), with the schedule of
// the 4-vector kernel's occupancy whichever variant runs: a sequence's splits do not depend on
// the other sequences' tokens (a.n_split, a.n_win are set here).
template <int D, int BK, int BV, int NV, bool F>
static int qa_launch(const struct iq_cuda_ctx * c, iq_qa_args & a, const struct iq_qcache * qc) {
    const int occ = qa_ctas_per_sm<D, BK, BV, 4, F>();
    if (occ < 0 || qa_ctas_per_sm<D, BK, BV, NV, F>() < 0) {
        return iq_cuda_launched("quantized attention (shared memory)");
    }
    qa_schedule(a, qc, c->n_sm, occ);
    const dim3 grid((unsigned) qc->n_kv_head, (unsigned) (a.n_split + a.n_win), (unsigned) a.seqs.n_seq);
    iq_cu_launch(c, iq_cu_qattention<D, BK, BV, NV, F>, grid, D, qa_smem<D, BK, BV, NV, F>::total, a);
    return iq_cuda_launched("quantized attention");
}

template <int D, int BK, int BV, bool F>
static int qa_launch_f(const struct iq_cuda_ctx * c, iq_qa_args & a, int nvec, const struct iq_qcache * qc) {
    if (nvec <= 4) return qa_launch<D, BK, BV, 4, F>(c, a, qc);
    if (nvec <= 8) return qa_launch<D, BK, BV, 8, F>(c, a, qc);
    return qa_launch<D, BK, BV, 32, F>(c, a, qc);
}

// Blocks of fp16 parameters without row scales (the default cache) take the kernel compiled for
// them alone, any other format the general one.
template <int D, int BK, int BV>
static int qa_launch_nv(const struct iq_cuda_ctx * c, iq_qa_args & a, int nvec, const struct iq_qcache * qc) {
    using L = qa_smem<D, BK, BV, 4, false>;
    if (!a.p8 && !a.rows && a.kb == L::KB && a.vb == L::VB) {
        return qa_launch_f<D, BK, BV, false>(c, a, nvec, qc);
    }
    return qa_launch_f<D, BK, BV, true>(c, a, nvec, qc);
}

template <int D, int BK>
static int qa_launch_bv(const struct iq_cuda_ctx * c, iq_qa_args & a, int nvec, int bv, const struct iq_qcache * qc) {
    switch (bv) {
        case 2: return qa_launch_nv<D, BK, 2>(c, a, nvec, qc);
        case 3: return qa_launch_nv<D, BK, 3>(c, a, nvec, qc);
        case 4: return qa_launch_nv<D, BK, 4>(c, a, nvec, qc);
        default: return qa_launch_nv<D, BK, 5>(c, a, nvec, qc);
    }
}

template <int D>
static int qa_launch_bk(const struct iq_cuda_ctx * c, iq_qa_args & a, int nvec, const struct iq_qcache * qc) {
    switch (qc->cfg.bits_k) {
        case 2: return qa_launch_bv<D, 2>(c, a, nvec, qc->cfg.bits_v, qc);
        case 3: return qa_launch_bv<D, 3>(c, a, nvec, qc->cfg.bits_v, qc);
        case 4: return qa_launch_bv<D, 4>(c, a, nvec, qc->cfg.bits_v, qc);
        default: return qa_launch_bv<D, 5>(c, a, nvec, qc->cfg.bits_v, qc);
    }
}

int iq_cuda_qcache_attention_decode(const struct iq_cuda_ctx * c, struct iq_tensor * dst, const struct iq_qcache * qc) {
    if (!iq_cuda_qcache_attention_decode_supports(dst, qc)) {
        iq_error_set("attention: the fused CUDA kernel does not take this quantized cache");
        return -1;
    }
    const int q_max = qa_q_max(dst);
    if (q_max == 0) {
        return 0;  // no sequence of the step is the fused kernels'
    }
    const struct iq_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2];
    const size_t need = iq_cuda_qcache_attention_decode_work_size(dst, qc, c->n_sm);
    if (c->work == NULL || c->work_size < need) {
        iq_error_set("attention: %zu bytes of scratch for the quantized cache, %zu given", need, c->work_size);
        return -1;
    }
    for (int r = IQ_QREGION_QUANT_K; r <= IQ_QREGION_QUANT_V && qc->cap_blocks > 0; r++) {
        if (((uintptr_t) qc->region[r] & 15) != 0) {
            iq_error_set("attention: the quantized region is not 16-byte aligned");
            return -1;
        }
    }
    const int hd = (int) q->ne[0], n_head = (int) q->ne[1], n_kv = qc->n_kv_head, r = n_head / n_kv;
    iq_qa_args a;
    a.q = (const float *) q->data;
    a.q_nb1 = q->nb[1], a.q_nb2 = q->nb[2];
    a.k = (const float *) k->data, a.v = (const float *) v->data;
    a.k_nb1 = k->nb[1], a.k_nb2 = k->nb[2], a.v_nb1 = v->nb[1], a.v_nb2 = v->nb[2];
    a.norm = (const float *) qc->region[IQ_QREGION_NORM];
    a.sink_k = (const uint16_t *) qc->region[IQ_QREGION_SINK_K];
    a.sink_v = (const uint16_t *) qc->region[IQ_QREGION_SINK_V];
    a.recent_k = (const uint16_t *) qc->region[IQ_QREGION_RECENT_K];
    a.recent_v = (const uint16_t *) qc->region[IQ_QREGION_RECENT_V];
    a.quant_k = qc->region[IQ_QREGION_QUANT_K];
    a.quant_v = qc->region[IQ_QREGION_QUANT_V];
    a.s_cap = qc->cfg.n_sink, a.cap_recent = qc->cap_recent, a.cap_blocks = qc->cap_blocks;
    a.part = c->work;
    a.seqs = iq_cu_seqs_of_op(dst);
    a.n_kv = n_kv, a.q_max = q_max, a.part_rows = a.seqs.n_seq * q_max;
    a.mma_ok = qa_mma_ok(qc);
    a.n_head = n_head, a.r = r, a.n_split = a.n_win = 1;
    a.pages = nullptr;
    a.tok0 = a.hs0 = a.n_q = a.nvec = 0;
    a.scale = iq_get_op_param_f32(dst, IQ_KV_P_SCALE);
    a.decode = dst->op_params[IQ_KV_P_DECODE] != 0;
    a.correction = qc->cfg.score_correction;
    a.kb = (int) qc->block_bytes_k, a.vb = (int) qc->block_bytes_v;
    a.p8 = qc->cfg.params8, a.rows = qc->cfg.value_scales;
    a.cp8 = a.kb % 16 != 0 || a.vb % 16 != 0;
    a.merge_warps = 1;
    a.win_tiles = !iq_cuda_variants.win_rows;
    a.window = iq_cuda_layer(dst).window;  // > 0: a layer without blocks (iq_cuda_attention_supports)
    for (int x = IQ_QREGION_SINK_K; x <= IQ_QREGION_RECENT_V; x++) {
        a.win_tiles = a.win_tiles && ((uintptr_t) qc->region[x] & 15) == 0;  // the tiles' 16-byte copies
    }
    qa_merge_args m;
    m.seqs = a.seqs;
    m.q_max = q_max, m.r = r, m.part_rows = a.part_rows, m.n_head = n_head, m.hd = hd;
    m.mma_ok = a.mma_ok;
    m.parts_mma = m.parts_cta = 0;
    if (a.mma_ok) {  // the sequences of up to 8 query vectors
        iq_qa_args w = a;
        w.n_win = qw_n_win(qc);
        const int most = 8 / r < q_max ? 8 / r : q_max;
        if (iq_cuda_qattn_mma(c, w, hd, qc->cfg.bits_k, qc->cfg.bits_v, n_kv, qc->cap_blocks, qc->n_slots, most * r) != 0) {
            return -1;
        }
        m.parts_mma = w.n_win + (w.n_split + w.merge_warps - 1) / w.merge_warps;  // the states written
    }
    if (!a.mma_ok || q_max * r > 8) {  // the others
        iq_qa_args t = a;
        const int st = hd == 64 ? qa_launch_bk<64>(c, t, q_max * r, qc)
                       : hd == 128 ? qa_launch_bk<128>(c, t, q_max * r, qc) : qa_launch_bk<256>(c, t, q_max * r, qc);
        if (st != 0) {
            return -1;
        }
        m.parts_cta = t.n_split + t.n_win;
    }
    const unsigned n_tok = (unsigned) q->ne[2];
    const dim3 cgrid((unsigned) n_head, n_tok, (unsigned) (hd / 32));
    if ((m.parts_mma > m.parts_cta ? m.parts_mma : m.parts_cta) <= IQ_QA_FEW_PARTS) {
        iq_cu_launch(c, iq_cu_qattention_merge_par<IQ_QA_MERGE_FEW>, cgrid, IQ_QA_MERGE_FEW, 0,
                     (const float *) c->work, (float *) dst->data, dst->nb[1], m);
    } else {
        iq_cu_launch(c, iq_cu_qattention_merge_par<IQ_QA_MERGE_THREADS>, cgrid, IQ_QA_MERGE_THREADS, 0,
                     (const float *) c->work, (float *) dst->data, dst->nb[1], m);
    }
    return iq_cuda_launched("quantized attention (merge)");
}
