// Kernels of the quantized (InnerQ / KIVI) caches: KV_STORE's two launches (key normalization
// and flushes, then rows into the sink and the window) and the dequantization ATTENTION reads.
//
// Every kernel runs over the sequences of a step (kv-seqs.cuh): a CTA takes one sequence, whose
// view (iq_cu_qseq_view) is its slot's windows and norms, its page table row (block j of the
// sequence is page pages[j] of the quantized regions), its rows of the batch and its counters.
// A store of a sequence's n batch rows after its counters (n_past, n_sink, n_quant, and the
// flush plan n_sink_new, n_flush, set_norms) does what iq_qcache_store_head does, in an order that
// suits a GPU: think of the window as the sequence W = its n_recent stored rows, then the
// batch's rows after the first n_sink_new (f16). The flushes quantize W's chunks of G rows
// [jG, jG + G), j < n_flush, into blocks n_quant / G + j (keys divided by the norms, which
// set_norms first computes from those n_flush * G rows), and the window keeps the rest of W.
// That is the C code's result (it flushes a block as soon as the window fills, which takes the
// same oldest G rows), so the kernels below, run in this order, write the same bytes:
// they share the arithmetic of iq-qcache-math.h with it. Their grids depend on shapes only;
// a block with nothing to do (no set_norms, a flush past n_flush) returns.
#pragma once

#include "iq-kv.h"
#include "kv-seqs.cuh"
#include "launch.cuh"
#include "iq-qcache-math.h"

#include <cuda_fp16.h>

struct iq_cu_qcache_args {
    const float * k, * v;        // the batch's rows [n][n_kv][D] (bytes: nb1 per head, nb2 per token)
    size_t k_nb1, k_nb2, v_nb1, v_nb2;
    float * norm;                // the regions (iq-qcache.h), device addresses (a view: its slot's)
    iq_fp16_t * sink_k, * sink_v, * recent_k, * recent_v;
    uint8_t * quant_k, * quant_v;
    iq_cu_seqs seqs;             // the step's sequences and the page table
    const int32_t * kvp;         // a view: its sequence's row of the step (enum iq_kv_seq_field) ...
    const int32_t * pages;       // ... its page table row
    int n;                       // ... and its tokens of the batch (from k, v on)
    int n_kv, D, G, S, cap_recent, cap_blocks, bits_k, bits_v, mode, rope_dims;
    unsigned fmt_k, fmt_v;       // the blocks' options (IQ_QBLOCK_*: row scales, 8-bit parameters, key levels)
    bool k_by_channel, v_by_channel;
    size_t block_bytes_k, block_bytes_v;
    int max_flush;               // the flush CTAs of the grid: y < max_flush
    int n_copy;                  // CTAs per (KV head, keys / values, sequence) that move the window after a flush
    iq_fp16_t * moved;           // scratch [n_seq][2][n_kv][cap_recent][D]: the windows' rows after a flush
};

// a as sequence s sees it: its rows of the batch, its slot's norms and windows, its page
// table row, its counters, its part of the scratch.
static __device__ __forceinline__ void iq_cu_qseq_view(iq_cu_qcache_args & a, int s) {
    const int32_t * row = iq_cu_seq_row(a.seqs, s);
    const size_t t0 = (size_t) row[IQ_KV_S_TOKEN0], heads = (size_t) row[IQ_KV_S_SLOT] * a.n_kv;
    a.kvp = row;
    a.pages = iq_cu_seq_pages(a.seqs, row);
    a.n = row[IQ_KV_S_N_TOKENS];
    a.k = (const float *) ((const char *) a.k + t0 * a.k_nb2);
    a.v = (const float *) ((const char *) a.v + t0 * a.v_nb2);
    a.norm += heads * a.D;
    a.sink_k += heads * a.S * a.D;
    a.sink_v += heads * a.S * a.D;
    a.recent_k += heads * a.cap_recent * a.D;
    a.recent_v += heads * a.cap_recent * a.D;
    if (a.moved != nullptr) {
        a.moved += (size_t) s * 2 * a.n_kv * a.cap_recent * a.D;
    }
}

struct iq_cu_qcounters {
    int n_past, n_sink, n_quant, n_recent, n_sink_new, n_flush, set_norms;
};

static __device__ __forceinline__ iq_cu_qcounters iq_cu_qcounters_of(const int32_t * kvp) {
    iq_cu_qcounters q;
    q.n_past = kvp[IQ_KV_S_N_PAST];
    q.n_sink = kvp[IQ_KV_S_N_SINK];
    q.n_quant = kvp[IQ_KV_S_N_QUANT];
    q.n_recent = q.n_past - q.n_sink - q.n_quant;
    q.n_sink_new = kvp[IQ_KV_S_N_SINK_NEW];
    q.n_flush = kvp[IQ_KV_S_N_FLUSH];
    q.set_norms = kvp[IQ_KV_S_SET_NORMS];
    return q;
}

// Batch row i of KV head h, channel c, rounded to f16 as the cache stores it.
static __device__ __forceinline__ iq_fp16_t iq_cu_qbatch(const iq_cu_qcache_args & a, bool is_v, int h, int i, int c) {
    const float * x = (const float *) ((const char *) (is_v ? a.v : a.k) + (size_t) i * (is_v ? a.v_nb2 : a.k_nb2) +
                                       (size_t) h * (is_v ? a.v_nb1 : a.k_nb1));
    return iq_float_to_half(x[c]);
}

// Row t of W (above) of KV head h, channel c.
static __device__ __forceinline__ iq_fp16_t iq_cu_qwindow(const iq_cu_qcache_args & a, const iq_cu_qcounters & q,
                                                          bool is_v, int h, int t, int c) {
    if (t < q.n_recent) {
        const iq_fp16_t * r = is_v ? a.recent_v : a.recent_k;
        return r[((size_t) h * a.cap_recent + t) * a.D + c];
    }
    return iq_cu_qbatch(a, is_v, h, q.n_sink_new + t - q.n_recent, c);
}

// Key normalization (iq_qcache_norms_compute) of KV head h into nrm[D]: one thread per channel
// (blockDim.x == D); the block's threads all call it. The largest |x| over the n_flush * G rows
// (the window's stored f16 rows, then the batch's rounded to f16), eight rows' loads in flight
// at a time: a prompt's first flush reads all its rows here, and every key flush CTA of the
// batch does (a load a row, each waiting for the one before, was the loop's time). A maximum:
// the same bits in any order.
static __device__ void iq_cu_qstore_norms(const iq_cu_qcache_args & a, const iq_cu_qcounters & q, int h, float * nrm) {
    __shared__ float mx[IQ_QCACHE_MAX_HEAD_DIM];
    const int ch = threadIdx.x, rows = q.n_flush * a.G;
    const int in_window = rows < q.n_recent ? rows : q.n_recent;
    float m[8] = { 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f };
    const iq_fp16_t * r = a.recent_k + (size_t) h * a.cap_recent * a.D + ch;
    for (int t0 = 0; t0 < in_window; t0 += 8) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            if (t0 + i < in_window) {
                m[i] = fmaxf(m[i], fabsf(iq_half_to_float(r[(size_t) (t0 + i) * a.D])));
            }
        }
    }
    const float * x = (const float *) ((const char *) a.k + (size_t) h * a.k_nb1) + ch;
    const int i0 = q.n_sink_new - q.n_recent;  // batch row of window row t: i0 + t
    for (int t0 = in_window; t0 < rows; t0 += 8) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            if (t0 + i < rows) {
                const float v = *(const float *) ((const char *) x + (size_t) (i0 + t0 + i) * a.k_nb2);
                m[i] = fmaxf(m[i], fabsf(iq_half_to_float(iq_float_to_half(v))));
            }
        }
    }
#pragma unroll
    for (int i = 1; i < 8; i++) {
        m[0] = fmaxf(m[0], m[i]);
    }
    mx[ch] = m[0];
    __syncthreads();
    nrm[ch] = iq_qcache_norm_of(mx, a.rope_dims, ch);
    __syncthreads();
}

// Eight channels c0 .. c0 + 7 of row t of W (above) of KV head h, as f16.
static __device__ __forceinline__ uint4 iq_cu_qwindow8(const iq_cu_qcache_args & a, const iq_cu_qcounters & q,
                                                       bool is_v, int h, int t, int c0) {
    if (t < q.n_recent) {
        const iq_fp16_t * r = is_v ? a.recent_v : a.recent_k;
        return *(const uint4 *) (r + ((size_t) h * a.cap_recent + t) * a.D + c0);
    }
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int i0 = q.n_sink_new + t - q.n_recent;
        w[i] = (uint32_t) iq_cu_qbatch(a, is_v, h, i0, c0 + 2 * i) |
               (uint32_t) iq_cu_qbatch(a, is_v, h, i0, c0 + 2 * i + 1) << 16;
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// The rows the window keeps after a flush, W's rows [shift, shift + n_keep), moved 16 bytes (8
// channels) at a time: load(u) gives unit u, store(u, x) puts it; the units are spread over the
// n_copy CTAs (this one is part p), and each thread issues the loads of 4 units before their stores.
template <typename LOAD, typename STORE>
static __device__ __forceinline__ void iq_cu_qmove(int units, int p, int n_copy, LOAD load, STORE store) {
    const int step = n_copy * blockDim.x;
    for (int u0 = p * blockDim.x + threadIdx.x; u0 < units; u0 += 4 * step) {
        uint4 x[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (u0 + k * step < units) x[k] = load(u0 + k * step);
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (u0 + k * step < units) store(u0 + k * step, x[k]);
        }
    }
}

// Flush j = blockIdx.y < a.max_flush of KV head blockIdx.x, keys (blockIdx.z even) or values
// (odd), of sequence blockIdx.z / 2:
// W's rows [jG, jG + G) into block n_quant / G + j (iq_qblock_quantize), keys divided by the
// norms, which a key flush computes first when the plan sets them (every key flush of the batch
// the same values; flush 0 writes them). One thread per group (a block has D groups whichever way
// they run), then per tile. Shared: the rows f16 [G][D], their codes u8 [G][D]. The block's
// options as iq_qblock_quantize: row scales first, 8-bit parameters coded once every group has its
// (d, m), the codes chosen again on the decoded grid, keys on the key levels.
// blockIdx.y >= a.max_flush: part y - max_flush of a.n_copy that copy the rows the window keeps,
// W's rows [n_flush G, ...), to a.moved (read here, before iq_cu_qstore_rows writes the window).
// A layer without blocks (cap_blocks 0: a sliding window within the recent window) computes and
// writes neither blocks nor norms, as iq_qcache_store_head; its window moves all the same.
__global__ void iq_cu_qstore_flush(const iq_cu_qcache_args a0) {
    iq_cu_pdl_trigger();
    iq_cu_pdl_wait();
    extern __shared__ uint8_t qsm[];
    __shared__ float nrm[IQ_QCACHE_MAX_HEAD_DIM];
    __shared__ float rs[IQ_QGROUP_MAX];                     // row scales (values with them)
    __shared__ iq_fp16_t dm[2 * IQ_QCACHE_MAX_HEAD_DIM];    // (d, m) before their 8 bits (8-bit parameters)
    iq_cu_qcache_args a = a0;
    iq_cu_qseq_view(a, (int) blockIdx.z / 2);
    const iq_cu_qcounters q = iq_cu_qcounters_of(a.kvp);
    const int h = blockIdx.x, j = blockIdx.y, tid = threadIdx.x;
    const bool is_v = (blockIdx.z & 1) != 0;
    const int D = a.D, G = a.G;
    if (j >= a.max_flush) {
        const int shift = q.n_flush * G;
        const int keep = q.n_recent + a.n - q.n_sink_new - shift;
        if (shift == 0 || keep <= 0 || a.moved == nullptr) {
            return;
        }
        uint4 * dst = (uint4 *) (a.moved + (((size_t) is_v * a.n_kv + h) * a.cap_recent) * D);
        const int upr = D / 8;
        iq_cu_qmove(keep * upr, j - a.max_flush, a.n_copy,
                    [&](int u) { return iq_cu_qwindow8(a, q, is_v, h, shift + u / upr, 8 * (u % upr)); },
                    [&](int u, uint4 x) { dst[u] = x; });
        return;
    }
    if (j >= q.n_flush || a.cap_blocks == 0) {
        return;
    }
    const float * norm = nullptr;
    if (!is_v) {
        if (q.set_norms) {
            iq_cu_qstore_norms(a, q, h, nrm);
            if (j == 0) {
                a.norm[(size_t) h * D + tid] = nrm[tid];
            }
            norm = nrm;
        } else {
            norm = a.norm + (size_t) h * D;
        }
    }
    iq_fp16_t * rows = (iq_fp16_t *) qsm;
    uint8_t * codes = qsm + (size_t) G * D * sizeof(iq_fp16_t);
    for (int e = tid; e < G * D; e += blockDim.x) {
        rows[e] = iq_cu_qwindow(a, q, is_v, h, j * G + e / D, e % D);
    }
    __syncthreads();
    const int bits = is_v ? a.bits_v : a.bits_k;
    const unsigned fmt = is_v ? a.fmt_v : a.fmt_k;
    const bool by_channel = is_v ? a.v_by_channel : a.k_by_channel, lv = iq_qblock_levels(bits, fmt);
    uint8_t * block = (is_v ? a.quant_v : a.quant_k) +
                      ((size_t) h * a.cap_blocks + a.pages[q.n_quant / G + j]) * (is_v ? a.block_bytes_v : a.block_bytes_k);
    uint8_t * params = block + iq_qblock_params_offset(bits, D, G);
    const float * rscale = nullptr;
    if (fmt & IQ_QBLOCK_ROW_SCALES) {  // each row's scale first: its groups are quantized divided by it
        uint8_t * sc = block + iq_qblock_scales_offset(bits, D, G, fmt);
        for (int t = tid; t < G; t += blockDim.x) {
            sc[t] = iq_row_scale_code_h(rows + (size_t) t * D, D);
            rs[t] = iq_row_scale(sc[t]);
        }
        __syncthreads();
        rscale = rs;
    }
    // the groups' fp16 (d, m): into the block, or (8-bit parameters) into shared memory first
    iq_fp16_t * d = (fmt & IQ_QBLOCK_P8) ? dm : (iq_fp16_t *) params;
    for (int gi = tid; gi < D; gi += blockDim.x) {
        iq_qblock_quantize_group(rows, by_channel, bits, D, G, a.mode, lv, norm, rscale, gi, codes, d, d + D);
    }
    if (fmt & IQ_QBLOCK_P8) {  // the block's references, each group's bytes, its codes again on the decoded grid
        const float centre = iq_grid_centre(1 << bits, lv);
        __syncthreads();
        if (tid == 0) {
            iq_p8_write_refs(d, d + D, D, centre, params);
        }
        __syncthreads();
        for (int gi = tid; gi < D; gi += blockDim.x) {
            iq_fp16_t dd, mm;
            iq_p8_code_group(params, D, centre, gi, d[gi], d[D + gi]);
            iq_p8_decode_group(params, D, centre, gi, &dd, &mm);
            iq_qblock_recode_group(rows, by_channel, bits, lv, D, G, norm, rscale, gi,
                                   iq_p8_is_sym(d[gi], d[D + gi], centre), dd, mm, codes);
        }
    }
    __syncthreads();
    for (int ti = tid; ti < D * G / IQ_QTILE; ti += blockDim.x) {
        iq_qblock_pack_tile(codes, by_channel, bits, D, G, ti, block + (size_t) ti * 8 * bits);
    }
}

// The batch's first n_sink_new rows into the sink, and the window as W without its flushed
// rows: grid (KV head, keys / values (y even / odd) of sequence y / 2, a.n_copy). After a flush
// the window moves down: from
// a.moved, where the flush kernel put the rows it keeps, every CTA of the head a share (without
// a.moved, CTA 0 alone, read before written chunk by chunk: a row's source lies after it; that
// serial copy of one CTA per head took ~1 ms per layer at a window of 2,048 rows, once every G
// tokens).
__global__ void iq_cu_qstore_rows(const iq_cu_qcache_args a0) {
    iq_cu_pdl_trigger();
    iq_cu_pdl_wait();
    iq_cu_qcache_args a = a0;
    iq_cu_qseq_view(a, (int) blockIdx.y / 2);
    const iq_cu_qcounters q = iq_cu_qcounters_of(a.kvp);
    const int h = blockIdx.x, tid = threadIdx.x, D = a.D;
    const bool is_v = (blockIdx.y & 1) != 0;
    if (q.n_flush > 0 && a.moved != nullptr) {
        const int keep = q.n_recent + a.n - q.n_sink_new - q.n_flush * a.G;
        uint4 * recent = (uint4 *) ((is_v ? a.recent_v : a.recent_k) + (size_t) h * a.cap_recent * D);
        const uint4 * src = (const uint4 *) (a.moved + (((size_t) is_v * a.n_kv + h) * a.cap_recent) * D);
        if (keep > 0) {
            iq_cu_qmove(keep * (D / 8), blockIdx.z, a.n_copy, [&](int u) { return src[u]; },
                        [&](int u, uint4 x) { recent[u] = x; });
        }
    }
    if (blockIdx.z != 0) {
        return;
    }
    iq_fp16_t * sink = (is_v ? a.sink_v : a.sink_k) + (size_t) h * a.S * D;
    for (int e = tid; e < q.n_sink_new * D; e += blockDim.x) {
        sink[(size_t) (q.n_sink + e / D) * D + e % D] = iq_cu_qbatch(a, is_v, h, e / D, e % D);
    }
    iq_fp16_t * recent = (is_v ? a.recent_v : a.recent_k) + (size_t) h * a.cap_recent * D;
    const int shift = q.n_flush * a.G;
    const int total = (q.n_recent + a.n - q.n_sink_new - shift) * D;
    if (shift > 0 && a.moved != nullptr) {
        return;  // above
    }
    if (shift == 0) {
        for (int e = q.n_recent * D + tid; e < total; e += blockDim.x) {
            recent[e] = iq_cu_qbatch(a, is_v, h, q.n_sink_new + e / D - q.n_recent, e % D);
        }
        return;
    }
    for (int base = 0; base < total; base += blockDim.x) {
        const int e = base + tid;
        const iq_fp16_t x = e < total ? iq_cu_qwindow(a, q, is_v, h, shift + e / D, e % D) : (iq_fp16_t) 0;
        __syncthreads();
        if (e < total) {
            recent[e] = x;
        }
        __syncthreads();
    }
}

// Value x of element at of a dequantized cache: f32, or rounded to f16 (h: the operands of the
// tensor-core attention).
static __device__ __forceinline__ void iq_cu_qput(void * dst, size_t at, float x, bool h) {
    if (h) {
        ((__half *) dst)[at] = __float2half_rn(x);
    } else {
        ((float *) dst)[at] = x;
    }
}

// The (d, m) of group gi of a block of format fmt (fp16, or its 8-bit parameters decoded), as f32.
static __device__ __forceinline__ void iq_cu_qparams(const uint8_t * block, int bits, int D, int G, unsigned fmt, int gi,
                                                     float * d, float * m) {
    const uint8_t * p = block + iq_qblock_params_offset(bits, D, G);
    iq_fp16_t dh, mh;
    if (fmt & IQ_QBLOCK_P8) {
        iq_p8_decode_group(p, D, iq_grid_centre(1 << bits, iq_qblock_levels(bits, fmt)), gi, &dh, &mh);
    } else {
        dh = ((const iq_fp16_t *) p)[gi];
        mh = ((const iq_fp16_t *) p)[D + gi];
    }
    *d = iq_half_to_float(dh);
    *m = iq_half_to_float(mh);
}

// The stored tokens [0, n_past) of KV head blockIdx.y of the sequence sc takes (its first work
// item: sc names one sequence, attention.cu) as f32 rows sk, sv [n_kv][n_ctx][D]
// (iq_qcache_read_token: the same operations, unfused), or where it has fa_vecs query vectors or
// more (fa_vecs > 0; the tensor-core attention's) the same values rounded to f16 rows
// (iq_cu_qput); with dk != NULL the f32 step d of each key group gi < ngk of every token, dk
// [n_kv][n_ctx][ngk] (0 outside the quantized region). A layer without blocks (cap_blocks 0: a
// sliding window within the recent window) leaves the rows of the quantized region unwritten;
// the attention's window never reaches them.
__global__ void iq_cu_qcache_dequant(const iq_cu_qcache_args a0, const iq_cu_sched sc, int fa_vecs, int n_ctx, void * sk,
                                     void * sv, float * dk, int ngk) {
    const iq_cu_item it = iq_cu_sched_find(a0.seqs, sc, 0, -1);
    if (it.s < 0) {
        return;
    }
    iq_cu_qcache_args a = a0;
    iq_cu_qseq_view(a, it.s);
    const iq_cu_qcounters q = iq_cu_qcounters_of(a.kvp);
    const bool h16 = fa_vecs > 0 && it.n * sc.r >= fa_vecs;
    const int h = blockIdx.y, D = a.D, G = a.G;
    const int64_t n = (int64_t) q.n_past * D;
    for (int64_t e = (int64_t) blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t) gridDim.x * blockDim.x) {
        const int t = (int) (e / D), c = (int) (e % D);
        if (a.cap_blocks == 0 && t >= q.n_sink && t < q.n_sink + q.n_quant) {
            continue;
        }
        float k, v, dg = 0.0f;
        if (t < q.n_sink || t >= q.n_sink + q.n_quant) {
            const bool sink = t < q.n_sink;
            const size_t row = sink ? ((size_t) h * a.S + t) * D
                                    : ((size_t) h * a.cap_recent + (t - q.n_sink - q.n_quant)) * D;
            k = iq_half_to_float((sink ? a.sink_k : a.recent_k)[row + c]);
            v = iq_half_to_float((sink ? a.sink_v : a.recent_v)[row + c]);
        } else {
            const int j = (t - q.n_sink) / G, s = (t - q.n_sink) % G;
            const size_t page = (size_t) h * a.cap_blocks + a.pages[j];
            const uint8_t * bk = a.quant_k + page * a.block_bytes_k;
            const uint8_t * bv = a.quant_v + page * a.block_bytes_v;
            const int gk = iq_qblock_group_of(a.k_by_channel, G, s, c), gv = iq_qblock_group_of(a.v_by_channel, G, s, c);
            float dk, mk, dv, mv;
            iq_cu_qparams(bk, a.bits_k, D, G, a.fmt_k, gk, &dk, &mk);
            iq_cu_qparams(bv, a.bits_v, D, G, a.fmt_v, gv, &dv, &mv);
            const float uk = iq_grid_level(iq_qblock_levels(a.bits_k, a.fmt_k),
                                           iq_qblock_code_at(bk, a.k_by_channel, a.bits_k, D, G, s, c));
            const float uv = iq_qblock_code_at(bv, a.v_by_channel, a.bits_v, D, G, s, c);
            k = __fmul_rn(__fadd_rn(__fmul_rn(dk, uk), mk), a.norm[(size_t) h * D + c]);
            v = __fadd_rn(__fmul_rn(dv, uv), mv);
            if (a.fmt_v & IQ_QBLOCK_ROW_SCALES) {
                v = __fmul_rn(v, iq_row_scale(bv[iq_qblock_scales_offset(a.bits_v, D, G, a.fmt_v) + s]));
            }
            if (c < ngk) {
                float mg;
                iq_cu_qparams(bk, a.bits_k, D, G, a.fmt_k, c * G + s, &dg, &mg);  // key group c of token s (along channels)
            }
        }
        const size_t at = ((size_t) h * n_ctx + t) * D + c;
        iq_cu_qput(sk, at, k, h16);
        iq_cu_qput(sv, at, v, h16);
        if (dk != nullptr && c < ngk) {
            dk[((size_t) h * n_ctx + t) * ngk + c] = dg;
        }
    }
}
