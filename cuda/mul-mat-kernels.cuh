// Kernels of MUL_MAT: dst[n, m] = sum_k W[k, n] x[k, m], W in any weight type, x and dst f32.
#pragma once

#include "dequant.cuh"

#include <mma.h>

#define IQ_MV_ROWS 2       // rows of W per block (matvec)
#define IQ_MV_THREADS 128
#define IQ_MV_COLS 8       // the most columns of x the matvec takes; more go to the GEMM
#define IQ_MVQ_COLS 64     // ... in tiles of columns (iq_cu_mvq for the 32-element formats)

// 32 floats as f16 at dst (16-byte aligned), in four 16-byte stores.
__device__ __forceinline__ void iq_cu_store_unit_f16(const float v[32], half * __restrict__ dst) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        half2 h[4];
#pragma unroll
        for (int j = 0; j < 4; j++) h[j] = __floats2half2_rn(v[8 * i + 2 * j], v[8 * i + 2 * j + 1]);
        ((uint4 *) dst)[i] = *(const uint4 *) h;
    }
}

// The unit (32 floats) of x this thread converts, one thread per unit of n_units per row and
// m rows: its index e (row c = e / n_units, unit e % n_units), loaded into v as 8 vector loads;
// false for a thread past the end.
__device__ __forceinline__ bool iq_cu_load_unit(const float * __restrict__ x, size_t x_nb1, int64_t n_units,
                                                int64_t m, int64_t * e_out, float v[32]) {
    const int64_t e = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n_units * m) {
        return false;
    }
    *e_out = e;
    const float4 * p = (const float4 *) ((const char *) x + e / n_units * x_nb1) + 8 * (e % n_units);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float4 t = p[i];
        v[4 * i] = t.x, v[4 * i + 1] = t.y, v[4 * i + 2] = t.z, v[4 * i + 3] = t.w;
    }
    return true;
}

// x (f32 rows of k) -> q8_1 blocks, one thread per unit: the CPU's activation quantizer
// (iq_quantize_row_q8_0 / _q8_1: the same codes and d, and s = d * sum of codes).
__global__ void iq_cu_quantize_x(const float * __restrict__ x, size_t x_nb1, int64_t n_units, int64_t m,
                                 block_q8_1 * __restrict__ y) {
    int64_t e;
    float v[32];
    if (iq_cu_load_unit(x, x_nb1, n_units, m, &e, v)) {
        iq_cu_quantize_q8_1(v, y + e);
    }
}

// The same with one float4 per thread, 8 lanes per unit (x's rows 16-byte aligned).
__global__ void iq_cu_quantize_x8(const float * __restrict__ x, size_t x_nb1, int64_t n_units, int64_t m,
                                  block_q8_1 * __restrict__ y) {
    iq_cu_pdl_trigger();
    iq_cu_pdl_wait();
    const int64_t t = (int64_t) blockIdx.x * blockDim.x + threadIdx.x, e = t / 8;
    const int part = (int) (t % 8);
    const bool in = e < n_units * m;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (in) {
        v = ((const float4 *) ((const char *) x + e / n_units * x_nb1))[8 * (e % n_units) + part];
    }
    iq_cu_quantize_q8_1_x8(v, part, in, y + (in ? e : 0));
}

// ---- the matvec of the 32-element formats, G blocks per lane step ----

// Bytes of one block of a 32-element format.
template <int T>
constexpr int iq_cu_q32_bytes = T == IQ_TYPE_Q4_0 ? (int) sizeof(block_q4_0) : T == IQ_TYPE_Q4_1 ? (int) sizeof(block_q4_1)
                              : T == IQ_TYPE_Q5_0 ? (int) sizeof(block_q5_0) : T == IQ_TYPE_Q5_1 ? (int) sizeof(block_q5_1)
                                                                                                 : (int) sizeof(block_q8_0);

// Four bytes / two bytes at byte offset off (a multiple of 2, known at compile time once the
// loops are unrolled) of words held in registers.
static __device__ __forceinline__ uint32_t iq_cu_w32(const uint32_t * w, int off) {
    return off % 4 == 0 ? w[off / 4] : __funnelshift_r(w[off / 4], w[off / 4 + 1], 16);
}
static __device__ __forceinline__ uint32_t iq_cu_w16(const uint32_t * w, int off) {
    return (w[off / 4] >> (8 * (off % 4))) & 0xFFFFu;
}

// iq_cu_codes_dot of the block at byte off of w (registers), y: its q8_1 block's 8 code words.
template <int T>
static __device__ __forceinline__ int iq_cu_codes_dot_w(const uint32_t * w, int off, const uint32_t * y, float * d,
                                                        float * m) {
    int sum = 0;
    *d = iq_cu_h2f((uint16_t) iq_cu_w16(w, off));
    if constexpr (T == IQ_TYPE_Q8_0) {
        *m = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) sum = __dp4a((int) iq_cu_w32(w, off + 2 + 4 * i), (int) y[i], sum);
    } else {
        constexpr bool asym = T == IQ_TYPE_Q4_1 || T == IQ_TYPE_Q5_1;
        constexpr bool five = T == IQ_TYPE_Q5_0 || T == IQ_TYPE_Q5_1;
        constexpr int offset = asym ? 0 : five ? 16 : 8;
        *m = asym ? iq_cu_h2f((uint16_t) iq_cu_w16(w, off + 2)) : 0.0f;
        const int qs = off + (asym ? 4 : 2) + (five ? 4 : 0);
        const uint32_t qh = five ? iq_cu_w32(w, off + (asym ? 4 : 2)) : 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t q = iq_cu_w32(w, qs + 4 * j);
            uint32_t lo = q & 0x0F0F0F0Fu, hi = (q >> 4) & 0x0F0F0F0Fu;
            if (five) {
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    lo |= ((qh >> (4 * j + k)) & 1u) << (8 * k + 4);
                    hi |= ((qh >> (4 * j + k + 16)) & 1u) << (8 * k + 4);
                }
            }
            sum = __dp4a((int) lo, (int) y[j], sum);
            sum = __dp4a((int) hi, (int) y[4 + j], sum);
        }
        if (offset != 0) {
            int ysum = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) ysum = __dp4a(0x01010101, (int) y[i], ysum);
            sum -= offset * ysum;
        }
    }
    return sum;
}

#define IQ_MVG_WARPS 4  // warps per block
#define IQ_MVG_ROWS 2   // rows of W per warp

// Products of the same x (q, k, v; gate, up) in one launch (iq_cu_matvec_g, iq_cu_matvec_s): part
// p takes blocks [first[p], first[p + 1]) of the grid (first[0] = 0).
#define IQ_MV_MAX_PARTS 3
struct iq_cu_mv_parts {
    const uint8_t * w[IQ_MV_MAX_PARTS];
    size_t w_nb1[IQ_MV_MAX_PARTS];
    int64_t n_rows[IQ_MV_MAX_PARTS];
    float * y[IQ_MV_MAX_PARTS];
    size_t y_nb1[IQ_MV_MAX_PARTS];  // (iq_cu_mvq: the columns of y)
    unsigned first[IQ_MV_MAX_PARTS + 1];
    int n;
};

// The part of the grid this block is in: its W, rows and y, and the block's index in the part.
struct iq_cu_mv_part {
    const uint8_t * w;
    size_t w_nb1;
    int64_t n_rows;
    float * y;
    size_t y_nb1;
    unsigned block;
};
static __device__ __forceinline__ iq_cu_mv_part iq_cu_mv_part_of(const iq_cu_mv_parts & parts) {
    // the part by selects, not an index: an indexed parameter array is copied to local memory
    static_assert(IQ_MV_MAX_PARTS == 3, "the selects");
    const bool p1 = parts.n > 1 && blockIdx.x >= parts.first[1], p2 = parts.n > 2 && blockIdx.x >= parts.first[2];
    return { p2 ? parts.w[2] : p1 ? parts.w[1] : parts.w[0], p2 ? parts.w_nb1[2] : p1 ? parts.w_nb1[1] : parts.w_nb1[0],
             p2 ? parts.n_rows[2] : p1 ? parts.n_rows[1] : parts.n_rows[0], p2 ? parts.y[2] : p1 ? parts.y[1] : parts.y[0],
             p2 ? parts.y_nb1[2] : p1 ? parts.y_nb1[1] : parts.y_nb1[0],
             blockIdx.x - (p2 ? parts.first[2] : p1 ? parts.first[1] : 0u) };
}

// Matvec of the 32-element formats with x in q8_1, G (2 or 4) blocks per lane step: a warp
// takes IQ_MVG_ROWS rows, lane l the groups l, l + 32, ... of G blocks of each (G blocks of a
// row are G * bytes contiguous bytes, loaded as whole 8-byte (G = 4) or 4-byte words into
// registers; the x blocks of the group likewise, once for the warp's rows). Each block is
// scaled and summed as iq_cu_matvec sums it. Rows 8-byte (G = 4) / 4-byte aligned, n_units a
// multiple of G. Products of the same x in one launch (parts); launched to overlap the kernel
// before it (iq_cu_launch): a constant W's first words are loaded before iq_cu_pdl_wait.
template <int T, int NC, int G>
__global__ void __launch_bounds__(32 * IQ_MVG_WARPS)
iq_cu_matvec_g(const iq_cu_mv_parts parts, int64_t n_units, const block_q8_1 * __restrict__ xq, int m, bool w_const) {
    iq_cu_pdl_trigger();
    const auto [w, w_nb1, n_rows, y, y_nb1, block] = iq_cu_mv_part_of(parts);
    constexpr int BS = iq_cu_q32_bytes<T>, NWW = G * BS / 4, NXW = G * 9;
    const int lane = threadIdx.x % 32;
    const int64_t row0 = ((int64_t) block * IQ_MVG_WARPS + threadIdx.x / 32) * IQ_MVG_ROWS;
    const int64_t n_groups = n_units / G;
    const uint8_t * wr[IQ_MVG_ROWS];
#pragma unroll
    for (int r = 0; r < IQ_MVG_ROWS; r++) {
        int64_t row = row0 + r < n_rows ? row0 + r : n_rows - 1;  // a repeated row, not written
        row = row > 0 ? row : 0;
        wr[r] = w + (size_t) row * w_nb1;
    }
    uint32_t wq[IQ_MVG_ROWS][NWW];
    auto load_w = [&](int64_t g) {
#pragma unroll
        for (int r = 0; r < IQ_MVG_ROWS; r++) {
            if constexpr (G == 4) {
                const uint2 * p = (const uint2 *) (wr[r] + g * (G * BS));
#pragma unroll
                for (int i = 0; i < NWW / 2; i++) {
                    const uint2 t = __ldg(p + i);
                    wq[r][2 * i] = t.x, wq[r][2 * i + 1] = t.y;
                }
            } else {
                const uint32_t * p = (const uint32_t *) (wr[r] + g * (G * BS));
#pragma unroll
                for (int i = 0; i < NWW; i++) wq[r][i] = __ldg(p + i);
            }
        }
    };
    const bool early = w_const && row0 < n_rows && lane < n_groups;
    if (early) {
        load_w(lane);  // the first group's words while the kernel before this one runs
    }
    iq_cu_pdl_wait();
    if (row0 >= n_rows) {
        return;
    }
    float acc[IQ_MVG_ROWS][NC];
#pragma unroll
    for (int r = 0; r < IQ_MVG_ROWS; r++) {
#pragma unroll
        for (int c = 0; c < NC; c++) acc[r][c] = 0.0f;
    }
    for (int64_t g = lane; g < n_groups; g += 32) {
        if (g != lane || !early) {
            load_w(g);
        }
#pragma unroll
        for (int c = 0; c < NC; c++) {
            if (c < m) {
                uint32_t xw[NXW];
                if constexpr (G == 4) {
                    const uint4 * p = (const uint4 *) (xq + c * n_units + g * G);
#pragma unroll
                    for (int i = 0; i < NXW / 4; i++) {
                        const uint4 t = p[i];
                        xw[4 * i] = t.x, xw[4 * i + 1] = t.y, xw[4 * i + 2] = t.z, xw[4 * i + 3] = t.w;
                    }
                } else {
                    const uint2 * p = (const uint2 *) (xq + c * n_units + g * G);
#pragma unroll
                    for (int i = 0; i < NXW / 2; i++) {
                        const uint2 t = p[i];
                        xw[2 * i] = t.x, xw[2 * i + 1] = t.y;
                    }
                }
#pragma unroll
                for (int b = 0; b < G; b++) {
                    const float xd = iq_cu_h2f((uint16_t) (xw[9 * b] & 0xFFFFu));
                    const float xs = iq_cu_h2f((uint16_t) (xw[9 * b] >> 16));
#pragma unroll
                    for (int r = 0; r < IQ_MVG_ROWS; r++) {
                        float d, mn;
                        const int sumi = iq_cu_codes_dot_w<T>(wq[r], b * BS, &xw[9 * b + 1], &d, &mn);
                        const float dd = d * xd;
                        acc[r][c] += mn != 0.0f ? __fadd_rn(__fmul_rn((float) sumi, dd), __fmul_rn(mn, xs))
                                                : __fmul_rn((float) sumi, dd);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < IQ_MVG_ROWS; r++) {
#pragma unroll
        for (int c = 0; c < NC; c++) {
            float v = acc[r][c];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0 && c < m && row0 + r < n_rows) {
                ((float *) ((char *) y + c * y_nb1))[row0 + r] = v;
            }
        }
    }
}

#define IQ_MVS_ROWS 2  // rows of W per warp (iq_cu_matvec_s)

// Shared memory of iq_cu_matvec_s: x's q8_1 blocks, and per warp IQ_MVS_ROWS segments of 128
// blocks of a row.
static inline size_t iq_cu_matvec_s_smem(int64_t n_units, int bytes) {
    return (size_t) n_units * sizeof(block_q8_1) + (size_t) IQ_MVG_WARPS * IQ_MVS_ROWS * 128 * bytes;
}

// Matvec of one column (decoding) of the 32-element formats with x in q8_1, the weights read
// as contiguous 8-byte words by the whole warp: x's blocks go to shared memory once per block;
// a warp takes IQ_MVS_ROWS rows, copies segments of 128 blocks of each (32 groups of 4 blocks,
// lane l loading words l, l + 32, ... of the segment) into its shared buffer, then lane l
// takes group l of the segment as iq_cu_matvec_g does (the same sums, scaled alike) while
// the next segment's loads are in flight (the first one's while x is copied).
// n_units a multiple of 4, rows 8-byte aligned.
template <int T>
__global__ void __launch_bounds__(32 * IQ_MVG_WARPS, 4)
iq_cu_matvec_s(const iq_cu_mv_parts parts, int64_t n_units, const block_q8_1 * __restrict__ xq, bool w_const) {
    iq_cu_pdl_trigger();
    const auto [w, w_nb1, n_rows, y, y_nb1, block] = iq_cu_mv_part_of(parts);
    constexpr int BS = iq_cu_q32_bytes<T>;
    constexpr int NWW = BS;          // words of a group of 4 blocks
    constexpr int SEGW = 32 * NWW;   // words of a segment
    constexpr int NLD = BS / 2;      // 8-byte words per lane of a whole segment
    extern __shared__ __align__(16) uint32_t iq_mvs_smem[];
    uint32_t * xs = iq_mvs_smem;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint32_t * ws = xs + n_units * 9 + warp * (IQ_MVS_ROWS * SEGW);
    const int64_t row0 = ((int64_t) block * IQ_MVG_WARPS + warp) * IQ_MVS_ROWS;
    const uint2 * wr[IQ_MVS_ROWS];
#pragma unroll
    for (int r = 0; r < IQ_MVS_ROWS; r++) {
        int64_t row = row0 + r < n_rows ? row0 + r : n_rows - 1;  // a repeated row, not written
        wr[r] = (const uint2 *) (w + (size_t) row * w_nb1);
    }
    const int64_t n_groups = n_units / 4;
    // the next segment's words, in flight while x is copied and the current segment is summed
    uint2 t[IQ_MVS_ROWS][NLD];
    auto load = [&](int64_t s0) {
        const int64_t n8 = (n_groups - s0 < 32 ? n_groups - s0 : 32) * NLD;  // 8-byte words of the segment
#pragma unroll
        for (int r = 0; r < IQ_MVS_ROWS; r++) {
            const uint2 * src = wr[r] + s0 * NLD;  // a group: 4 blocks, NLD 8-byte words
#pragma unroll
            for (int i = 0; i < NLD; i++) {
                if (lane + 32 * i < n8) t[r][i] = __ldg(src + lane + 32 * i);
            }
        }
    };
    // the first segment in flight while x is copied (a constant W: while the previous kernel runs)
    if (w_const) {
        load(0);
    }
    iq_cu_pdl_wait();
    if (!w_const) {
        load(0);
    }
    const int64_t nx4 = n_units * 9 / 4;
    for (int64_t i = threadIdx.x; i < nx4; i += blockDim.x) {
        ((uint4 *) xs)[i] = ((const uint4 *) xq)[i];
    }
    __syncthreads();
    if (row0 >= n_rows) {
        return;
    }
    float acc[IQ_MVS_ROWS];
#pragma unroll
    for (int r = 0; r < IQ_MVS_ROWS; r++) acc[r] = 0.0f;
    for (int64_t s0 = 0; s0 < n_groups; s0 += 32) {
        const int ng = n_groups - s0 < 32 ? (int) (n_groups - s0) : 32;
        const int n8 = ng * NLD;
        __syncwarp();  // the previous segment is read
#pragma unroll
        for (int r = 0; r < IQ_MVS_ROWS; r++) {
#pragma unroll
            for (int i = 0; i < NLD; i++) {
                if (lane + 32 * i < n8) ((uint2 *) (ws + r * SEGW))[lane + 32 * i] = t[r][i];
            }
        }
        __syncwarp();
        if (s0 + 32 < n_groups) {
            load(s0 + 32);
        }
        if (lane < ng) {
            uint32_t xw[36];
            const uint4 * xp = (const uint4 *) (xs + (s0 + lane) * 36);
#pragma unroll
            for (int i = 0; i < 9; i++) {
                const uint4 v = xp[i];
                xw[4 * i] = v.x, xw[4 * i + 1] = v.y, xw[4 * i + 2] = v.z, xw[4 * i + 3] = v.w;
            }
#pragma unroll
            for (int r = 0; r < IQ_MVS_ROWS; r++) {
                uint32_t wq[NWW];
                const uint2 * wp = (const uint2 *) (ws + r * SEGW + lane * NWW);
#pragma unroll
                for (int i = 0; i < NWW / 2; i++) {
                    const uint2 v = wp[i];
                    wq[2 * i] = v.x, wq[2 * i + 1] = v.y;
                }
#pragma unroll
                for (int b = 0; b < 4; b++) {
                    const float xd = iq_cu_h2f((uint16_t) (xw[9 * b] & 0xFFFFu));
                    const float xsum = iq_cu_h2f((uint16_t) (xw[9 * b] >> 16));
                    float d, mn;
                    const int sumi = iq_cu_codes_dot_w<T>(wq, b * BS, &xw[9 * b + 1], &d, &mn);
                    const float dd = d * xd;
                    acc[r] += mn != 0.0f ? __fadd_rn(__fmul_rn((float) sumi, dd), __fmul_rn(mn, xsum))
                                         : __fmul_rn((float) sumi, dd);
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < IQ_MVS_ROWS; r++) {
        float v = acc[r];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0 && row0 + r < n_rows) {
            y[row0 + r] = v;
        }
    }
}

// ---- the matvec's sums on tensor cores: 9 to IQ_MVQ_COLS columns of a 32-element format ----

// The codes of block blk (2-byte aligned) that lane tq (0..3) of an mma row holds, less the
// format's offset (signed bytes): k = 4 tq .. 4 tq + 3 (lo) and 16 + 4 tq .. (hi); its d and m.
// SH: the block is in shared memory (a stage of iq_cu_mvq), else in global memory.
template <int T, bool SH = false>
static __device__ __forceinline__ void iq_cu_mvq_codes(const uint8_t * blk, int tq, int * lo, int * hi, float * d,
                                                       float * mn) {
    const uint16_t * h = (const uint16_t *) blk;
    auto half_at = [&](int i) -> uint16_t {
        if constexpr (SH) {
            return h[i];
        } else {
            return __ldg(h + i);
        }
    };
    auto word = [&](int i) { return (uint32_t) half_at(i) | (uint32_t) half_at(i + 1) << 16; };
    *d = iq_cu_h2f(half_at(0));
    if constexpr (T == IQ_TYPE_Q8_0) {
        *mn = 0.0f;
        *lo = (int) word(1 + 2 * tq);
        *hi = (int) word(9 + 2 * tq);
    } else {
        constexpr bool asym = T == IQ_TYPE_Q4_1 || T == IQ_TYPE_Q5_1;
        constexpr bool five = T == IQ_TYPE_Q5_0 || T == IQ_TYPE_Q5_1;
        constexpr uint32_t offset = asym ? 0u : five ? 0x10101010u : 0x08080808u;
        *mn = asym ? iq_cu_h2f(half_at(1)) : 0.0f;
        const int qs = (asym ? 2 : 1) + (five ? 2 : 0);  // in halves
        const uint32_t q = word(qs + 2 * tq);
        uint32_t l = q & 0x0F0F0F0Fu, u = (q >> 4) & 0x0F0F0F0Fu;
        if constexpr (five) {
            const uint32_t qh = word(qs - 2);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                l |= ((qh >> (4 * tq + k)) & 1u) << (8 * k + 4);
                u |= ((qh >> (4 * tq + k + 16)) & 1u) << (8 * k + 4);
            }
        }
        *lo = (int) __vsub4(l, offset);
        *hi = (int) __vsub4(u, offset);
    }
}

// c = a b: a 16 x 32 (signed bytes, row-major fragment), b 32 x 8, exact int32 sums.
static __device__ __forceinline__ void iq_cu_mma_s8(int c[4], const int a[4], int b0, int b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%10, %11, %12, %13};\n"
                 : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0), "r"(0), "r"(0), "r"(0));
}

// The same, free to be scheduled among the loads (not volatile: a pure function of its operands).
static __device__ __forceinline__ void iq_cu_mma_s8_free(int c[4], const int a[4], int b0, int b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0), "r"(0), "r"(0), "r"(0));
}

#ifndef IQ_MVQ_WARPS
#define IQ_MVQ_WARPS 8  // warps of iq_cu_mvq: 8 make four lane sums each (two blocks per SM), 16 two
#endif
#ifndef IQ_MVQ_MINB
#define IQ_MVQ_MINB (16 / IQ_MVQ_WARPS)  // blocks of iq_cu_mvq per SM the registers are fit for
#endif
#ifndef IQ_MVQ_NT
#define IQ_MVQ_NT 4  // the most column tiles of 8 per block of iq_cu_mvq
#endif
#ifndef IQ_MVQ_RT
#define IQ_MVQ_RT 1  // row tiles of 16 per block of iq_cu_mvq (an x fragment serves them all)
#endif
#ifndef IQ_MVQ_STAGES
#define IQ_MVQ_STAGES 2  // groups of W a warp of iq_cu_mvq has in flight (cp.async); 0: read in place
// (H200, 8B shape, 32 sequences at 8K: 16 warps reading W in place 2032 t/s, 8 warps with two
// stages 2174-2255; docs/BENCHMARKS.md)
#endif

// dst (shared) = CH bytes at src (global, CH-aligned), asynchronously (CH: 4 or 8).
template <int CH>
static __device__ __forceinline__ void iq_cu_cp_async_small(void * dst, const void * src) {
    static_assert(CH == 4 || CH == 8, "cp.async.ca copies 4, 8 or 16 bytes");
    const unsigned s = (unsigned) __cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(src), "n"(CH) : "memory");
}

// x of iq_cu_mvq: the q8_1 blocks of 8 columns at a time laid out as the mma reads them. Tile
// (c, u) (columns 8 c .. 8 c + 7, block u; at (c * n_units + u) * IQ_XT_BYTES) holds the codes
// of both halves of the k dimension as 2 x 32 words, word 32 h + 4 gq + tq = codes 16 h + 4 tq
// .. + 3 of column gq (what lane 4 gq + tq passes to the mma: one coalesced load per half), then
// the columns' d and s as floats (d, s of column gq at 2 gq, 2 gq + 1: lane tq's two columns in
// one 16-byte load). Columns past m are zero.
#define IQ_XT_BYTES 320

// The tiles' bytes for m columns of n_units blocks.
static inline size_t iq_cu_xt_size(int64_t n_units, int64_t m) {
    return (size_t) ((m + 7) / 8) * (size_t) n_units * IQ_XT_BYTES;
}

// q8_1 blocks (m columns of n_units) -> tiles: a thread per word (8 per block), the columns
// rounded up to 8.
__global__ void iq_cu_xq_tiles(const block_q8_1 * __restrict__ xq, int64_t n_units, int64_t m,
                               uint8_t * __restrict__ xt) {
    const int64_t t = (int64_t) blockIdx.x * blockDim.x + threadIdx.x, e = t / 8;  // e: column c, block u
    const int64_t col = e / n_units, u = e % n_units;
    if (col >= (m + 7) / 8 * 8) {
        return;
    }
    const int word = (int) (t % 8), gq = (int) (col % 8), h = word / 4, tq = word % 4;
    uint8_t * tile = xt + ((col / 8) * n_units + u) * IQ_XT_BYTES;
    const bool in = col < m;
    const block_q8_1 * b = xq + (in ? col : 0) * n_units + u;
    ((int *) tile)[32 * h + 4 * gq + tq] = in ? ((const int *) b->qs)[word] : 0;
    if (word < 2) {
        const uint16_t v = word == 0 ? b->d : b->s;
        ((float *) (tile + 256))[2 * gq + word] = in ? iq_cu_h2f(v) : 0.0f;
    }
}

// Shared memory of iq_cu_mvq: IQ_MVQ_WARPS partial sums of each of the tile's 16 RT x 8 NT
// outputs, rows of 8 NT + 8 floats (a warp's stores fall in different banks); then each warp's
// IQ_MVQ_STAGES stages of W, a group of G blocks of each of the 16 RT rows, rows
// iq_cu_mvq_stride bytes apart (8 more than a group: the 8 rows an mma fragment reads fall in
// different banks).
#define IQ_MVQ_PAD 8
template <int T, int G>
static constexpr int iq_cu_mvq_stride = G * iq_cu_q32_bytes<T> + 8;
template <int T, int G, int RT, int NT>
static constexpr size_t iq_cu_mvq_smem() {
    return (size_t) IQ_MVQ_WARPS * 16 * RT * (8 * NT + IQ_MVQ_PAD) * sizeof(float) +
           (size_t) IQ_MVQ_WARPS * IQ_MVQ_STAGES * 16 * RT * iq_cu_mvq_stride<T, G>;
}

// The product of 16 RT rows of W and NT tiles of 8 columns of x (q8_1 tiles, iq_cu_xq_tiles),
// each output the same float sum as iq_cu_matvec_g<T, *, G> makes it: there lane l of a warp
// sums, in order, the blocks of the groups of G blocks l, l + 32, ..., each block's exact integer
// sum scaled as the CPU scales it, and the 32 lanes' sums are added by xor shuffles. Here
// mma.sync makes each block's integer sums for 16 x 8 outputs at once (one x fragment for the RT
// row tiles, one W fragment for the NT column tiles). The lane sums ("slots") are made by the
// warps and added as the shuffles add them: with 16 warps warp w makes slots w and w + 16 (the
// first shuffle's w + (w + 16)), with 8 warps also w + 8 and w + 24 (the second shuffle's
// (w + (w + 16)) + ((w + 8) + (w + 24))); the shuffles' remaining tree is summed from shared
// memory. So a token's product has the same bits in a step of one column (the matvec) and of
// any width here. Products of the same x in one launch as iq_cu_matvec_s takes them (parts);
// block b of a part takes column tile b % n_ct of rows b / n_ct.
template <int T, int G, int RT, int NT>
__global__ void __launch_bounds__(32 * IQ_MVQ_WARPS, IQ_MVQ_MINB)
iq_cu_mvq(const iq_cu_mv_parts parts, int64_t n_units, const uint8_t * __restrict__ xt, int m, unsigned n_ct) {
    static_assert(IQ_MVQ_WARPS == 8 || IQ_MVQ_WARPS == 16, "a warp makes two or four of the 32 slots");
    const iq_cu_mv_part pt = iq_cu_mv_part_of(parts);  // (named: lambdas capture it)
    const uint8_t * const w = pt.w;
    const size_t w_nb1 = pt.w_nb1;
    const int64_t n_rows = pt.n_rows;
    float * const y = pt.y;
    const size_t y_nb1 = pt.y_nb1;
    const unsigned block = pt.block;
    constexpr int BS = iq_cu_q32_bytes<T>, NR = 16 * RT, NC = 8 * NT, NCP = NC + IQ_MVQ_PAD;
    extern __shared__ __align__(16) float iq_mvq_part[];  // [IQ_MVQ_WARPS sums][NR rows][NCP], then the stages
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, gq = lane / 4, tq = lane % 4;
    const int64_t row0 = (int64_t) (block / n_ct) * NR;
    const int c0 = (int) (block % n_ct) * NC;
    const int64_t last_tile = (m + 7) / 8 - 1;  // tiles past it (a block's NT past m) read it again, not written
    const int64_t n_groups = n_units / G;
    // the sums of group g's blocks into acc, in block order; blk(r, h, b): block b of the group
    // in row gq + 8 h of row tile r (read from shared memory where SH)
    auto group = [&](auto sh, int64_t g, auto blk, float (&acc)[RT][NT][4]) {
        constexpr bool SH = decltype(sh)::value;
#pragma unroll
        for (int b = 0; b < G; b++) {
            const int64_t u = g * G + b;
            int a[RT][4];
            float d[RT][2], mn[RT][2];
#pragma unroll
            for (int r = 0; r < RT; r++) {
                iq_cu_mvq_codes<T, SH>(blk(r, 0, b), tq, &a[r][0], &a[r][2], &d[r][0], &mn[r][0]);
                iq_cu_mvq_codes<T, SH>(blk(r, 1, b), tq, &a[r][1], &a[r][3], &d[r][1], &mn[r][1]);
            }
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const int64_t c = c0 / 8 + j < last_tile ? c0 / 8 + j : last_tile;
                const uint8_t * tile = xt + (size_t) (c * n_units + u) * IQ_XT_BYTES;
                const int b0 = __ldg((const int *) tile + lane), b1 = __ldg((const int *) tile + 32 + lane);
                const float4 ds = __ldg((const float4 *) (tile + 256) + tq);  // d, s of columns 2 tq, 2 tq + 1
                const float xd[2] = { ds.x, ds.z }, xs[2] = { ds.y, ds.w };
#pragma unroll
                for (int r = 0; r < RT; r++) {
                    int sumi[4];
                    iq_cu_mma_s8(sumi, a[r], b0, b1);
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int h = e / 2, k = e % 2;
                        const float dd = d[r][h] * xd[k];
                        acc[r][j][e] += mn[r][h] != 0.0f
                                            ? __fadd_rn(__fmul_rn((float) sumi[e], dd), __fmul_rn(mn[r][h], xs[k]))
                                            : __fmul_rn((float) sumi[e], dd);
                    }
                }
            }
        }
    };
    // f(r, j, e) for each of this thread's outputs
    auto each = [&](auto f) {
#pragma unroll
        for (int r = 0; r < RT; r++) {
#pragma unroll
            for (int j = 0; j < NT; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++) f(r, j, e);
            }
        }
    };
    // slots i and i + 16 (each slot's groups in order), added: the warp takes groups i, i + 16,
    // i + 32, ... in turn, into s and t alternately
    auto pair = [&](int i, float (&s)[RT][NT][4], float (&t)[RT][NT][4]) {
        each([&](int r, int j, int e) { s[r][j][e] = 0.0f, t[r][j][e] = 0.0f; });
        if constexpr (IQ_MVQ_STAGES == 0) {
            const uint8_t * wr[RT][2];  // rows gq and gq + 8 of each row tile (a repeated row past the end, not written)
#pragma unroll
            for (int r = 0; r < RT; r++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int64_t row = row0 + 16 * r + gq + 8 * h < n_rows ? row0 + 16 * r + gq + 8 * h : n_rows - 1;
                    wr[r][h] = w + (size_t) row * w_nb1;
                }
            }
            auto in_w = [&](int r, int h, int b) { return wr[r][h] + b * BS; };
            for (int64_t g = i; g < n_groups; g += 32) {
                group(std::false_type(), g, [&](int r, int h, int b) { return in_w(r, h, b) + g * G * BS; }, s);
                if (g + 16 < n_groups) {
                    group(std::false_type(), g + 16,
                          [&](int r, int h, int b) { return in_w(r, h, b) + (g + 16) * G * BS; }, t);
                }
            }
        } else {
            // group k of the warp's turn through stage k % IQ_MVQ_STAGES: its copies issued
            // IQ_MVQ_STAGES - 1 groups ahead, whole CH-byte words of the rows
            constexpr int SR = iq_cu_mvq_stride<T, G>, CH = G == 4 ? 8 : 4, CPR = G * BS / CH;
            constexpr int NS = IQ_MVQ_STAGES > 0 ? IQ_MVQ_STAGES : 1;
            uint8_t * stages = (uint8_t *) (iq_mvq_part + IQ_MVQ_WARPS * NR * NCP) +
                               (size_t) warp * NS * NR * SR;
            const int64_t nk = i < n_groups ? (n_groups - i + 15) / 16 : 0;
            auto issue = [&](int64_t k) {
                if (k < nk) {
                    uint8_t * st = stages + (k % NS) * NR * SR;
                    const size_t off = (size_t) (i + 16 * k) * G * BS;
                    for (int q = lane; q < NR * CPR; q += 32) {
                        const int row = q / CPR, ch = q % CPR;
                        const int64_t wrow = row0 + row < n_rows ? row0 + row : n_rows - 1;
                        iq_cu_cp_async_small<CH>(st + row * SR + ch * CH, w + (size_t) wrow * w_nb1 + off + ch * CH);
                    }
                }
                asm volatile("cp.async.commit_group;\n" ::: "memory");  // (empty past the end: the count holds)
            };
#pragma unroll
            for (int k = 0; k < NS - 1; k++) issue(k);
            for (int64_t k = 0; k < nk; k++) {
                issue(k + NS - 1);
                asm volatile("cp.async.wait_group %0;\n" ::"n"(NS - 1) : "memory");
                __syncwarp();
                const uint8_t * st = stages + (k % NS) * NR * SR;
                auto in_st = [&](int r, int h, int b) { return st + (16 * r + gq + 8 * h) * SR + b * BS; };
                if (k % 2 == 0) {
                    group(std::true_type(), i + 16 * k, in_st, s);
                } else {
                    group(std::true_type(), i + 16 * k, in_st, t);
                }
                __syncwarp();  // the stage is read before the next turn's copies overwrite it
            }
        }
        each([&](int r, int j, int e) { s[r][j][e] = s[r][j][e] + t[r][j][e]; });
    };
    // this thread's outputs in the warp's row of partial sums
    auto part = [&](int r, int j, int e) -> float & {
        return iq_mvq_part[(warp * NR + 16 * r + gq + 8 * (e / 2)) * NCP + 8 * j + 2 * tq + e % 2];
    };
    {
        float s[RT][NT][4], t[RT][NT][4];
        pair(warp, s, t);
        each([&](int r, int j, int e) { part(r, j, e) = s[r][j][e]; });
        if constexpr (IQ_MVQ_WARPS == 8) {
            pair(warp + 8, s, t);
            each([&](int r, int j, int e) { part(r, j, e) = part(r, j, e) + s[r][j][e]; });
        }
    }
    __syncthreads();
    for (int o = threadIdx.x; o < NR * NC; o += blockDim.x) {
        const int r = o / NC, c = o % NC;
        const float * p = iq_mvq_part + r * NCP + c;
        constexpr int SP = NR * NCP;  // from one warp's sums to the next's
        float s8[8], s4[4];
#pragma unroll
        for (int i = 0; i < 8; i++) s8[i] = IQ_MVQ_WARPS == 16 ? p[i * SP] + p[(i + 8) * SP] : p[i * SP];
#pragma unroll
        for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
        if (row0 + r < n_rows && c0 + c < m) {
            ((float *) ((char *) y + (size_t) (c0 + c) * y_nb1))[row0 + r] = (s4[0] + s4[2]) + (s4[1] + s4[3]);
        }
    }
}

// ---- the same sums with x shared by the row tiles of a block (iq_cu_mvq_tile) ----
//
// iq_cu_mvq's warps each take lane sums ("slots") of the same 16 rows, so a fragment of x that
// a warp reads serves 16 rows: x's tiles (1280 bytes per block and 32 columns, W's 288) were
// the stream, read from L2 in chains of dependent loads. Here a block is WR x WS warps: WR row
// tiles of 16 rows that read the same stages of x, and WS subtrees of the tree of the slots.
// That tree (the shuffles': slot i + slot i + 16 first, then + the pair 8 further, ...) has the
// slots in bit-reversed order k -> rev5(k) as its leaves from left to right, so a warp that
// takes the slots rev5(k) of a range of 32 / WS values of k, aligned to its size, makes a whole
// subtree: slot after slot (each slot's groups in order, each block scaled as the matvec scales
// it), the sums combined as a binary counter does (a level's sum held until its right
// neighbour is made). The WS subtrees meet in shared memory. So the bits are iq_cu_mvq's, and
// the matvec's. The WR warps of a subtree stream its steps (a group of G blocks of their 16 WR
// rows, and the NT tiles of x of those blocks) through IQ_MVT_STAGES stages of cp.async copies.
#ifndef IQ_MVT_WR
#define IQ_MVT_WR 2  // row tiles of 16 per block of iq_cu_mvq_tile (they share x)
#endif
#ifndef IQ_MVT_WS
#define IQ_MVT_WS 4  // subtrees of the slots per block (warps per row tile)
#endif
#ifndef IQ_MVT_NT
#define IQ_MVT_NT IQ_MVQ_NT  // column tiles of 8 per block of iq_cu_mvq_tile (above 16 columns)
#endif
#ifndef IQ_MVT_STAGES
#define IQ_MVT_STAGES 3
#endif
#ifndef IQ_MVT_MINB
#define IQ_MVT_MINB (16 / (IQ_MVT_WR * IQ_MVT_WS))
#endif

static __device__ __forceinline__ int iq_cu_rev5(int k) { return (int) (__brev((unsigned) k) >> 27); }

template <int T, int G, int NT, int WR, int WS>
struct iq_cu_mvt_smem {
    static constexpr int BS = iq_cu_q32_bytes<T>, NR = 16 * WR, NC = 8 * NT, SR = iq_cu_mvq_stride<T, G>;
    static constexpr int WB = NR * SR, XB = NT * G * IQ_XT_BYTES, SB = WB + XB;
    static constexpr int stages = WS * IQ_MVT_STAGES * SB;
    static constexpr int sums = WS > 1 ? WS * NR * (NC + IQ_MVQ_PAD) * 4 : 0;
    static constexpr int total = stages > sums ? stages : sums;
};

template <int T, int G, int NT, int WR, int WS>
__global__ void __launch_bounds__(32 * WR * WS, IQ_MVT_MINB)
iq_cu_mvq_tile(const iq_cu_mv_parts parts, int64_t n_units, const uint8_t * __restrict__ xt, int m, unsigned n_ct) {
    using L = iq_cu_mvt_smem<T, G, NT, WR, WS>;
    constexpr int BS = L::BS, NR = L::NR, NC = L::NC, SR = L::SR, NS = IQ_MVT_STAGES;
    constexpr int CH = G == 4 ? 8 : 4, CPR = G * BS / CH, XCP = G * IQ_XT_BYTES / 16;
    constexpr int KS = 32 / WS, NQ = KS / 4, LV = NQ >= 8 ? 3 : NQ >= 4 ? 2 : NQ >= 2 ? 1 : 0;
    static_assert(WS == 1 || WS == 2 || WS == 4 || WS == 8, "subtrees of the 32 slots");
    const iq_cu_mv_part pt = iq_cu_mv_part_of(parts);
    const uint8_t * const w = pt.w;
    const int64_t n_rows = pt.n_rows;
    extern __shared__ __align__(16) uint8_t iq_mvt_sm[];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, gq = lane / 4, tq = lane % 4;
    const int wr = warp % WR, ws = warp / WR, gt = tid % (32 * WR);  // gt: the thread in its subtree's warps
    const int64_t row0 = (int64_t) (pt.block / n_ct) * NR;
    const int c0 = (int) (pt.block % n_ct) * NC;
    const int64_t last_tile = (m + 7) / 8 - 1;  // tiles past it read it again, not written
    const int64_t n_groups = n_units / G;
    uint8_t * const stages = iq_mvt_sm + (size_t) ws * NS * L::SB;
    const int k0 = ws * KS, k1 = k0 + KS;

    // the subtree's steps in order: k = k0 .. k1 - 1, the groups rev5(k), rev5(k) + 32, ... of each
    int ik = k0;
    int64_t ig = iq_cu_rev5(k0);
    auto skip = [&]() {
        while (ik < k1 && ig >= n_groups) {
            ik++;
            ig = ik < k1 ? iq_cu_rev5(ik) : 0;
        }
    };
    skip();
    int issued = 0;
    auto issue = [&]() {
        if (ik < k1) {
            uint8_t * st = stages + (issued % NS) * L::SB;
            const size_t off = (size_t) ig * G * BS;
            for (int q = gt; q < NR * CPR; q += 32 * WR) {
                const int row = q / CPR, ch = q % CPR;
                const int64_t wrow = row0 + row < n_rows ? row0 + row : n_rows - 1;  // repeated, not written
                iq_cu_cp_async_small<CH>(st + row * SR + ch * CH, w + (size_t) wrow * pt.w_nb1 + off + ch * CH);
            }
            for (int q = gt; q < NT * XCP; q += 32 * WR) {
                const int j = q / XCP, ch = q % XCP;
                const int64_t c = c0 / 8 + j < last_tile ? c0 / 8 + j : last_tile;
                const unsigned d = (unsigned) __cvta_generic_to_shared(st + L::WB + j * G * IQ_XT_BYTES + 16 * ch);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d),
                             "l"(xt + (size_t) (c * n_units + ig * G) * IQ_XT_BYTES + 16 * ch)
                             : "memory");
            }
            ig += 32;
            skip();
        }
        issued++;
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    };
    auto sync = [&]() {
        if constexpr (WR == 1) {
            __syncwarp();
        } else {
            asm volatile("bar.sync %0, %1;\n" ::"r"(1 + ws), "n"(32 * WR) : "memory");
        }
    };
#pragma unroll
    for (int s = 0; s < NS - 1; s++) issue();

    float chain[NT][4], A[NT][4], P[NT][4], L1[NT][4], L2[NT][4], L3[NT][4], res[NT][4];
    auto each = [&](auto f) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
#pragma unroll
            for (int e = 0; e < 4; e++) f(j, e);
        }
    };
    int step = 0;
    // the sums of one slot's groups into chain (the slot rev5(k))
    auto slot = [&](int k) {
        each([&](int j, int e) { chain[j][e] = 0.0f; });
        const int s = iq_cu_rev5(k);
        const int64_t cnt = s < n_groups ? (n_groups - 1 - s) / 32 + 1 : 0;
        for (int64_t g = 0; g < cnt; g++, step++) {
            asm volatile("cp.async.wait_group %0;\n" ::"n"(NS - 2) : "memory");
            sync();  // the step's stage is in; every warp of the subtree is done with the last one
            issue();
            const uint8_t * st = stages + (step % NS) * L::SB;
            const uint8_t * x0 = st + L::WB;
#pragma unroll
            for (int b = 0; b < G; b++) {
                int a[4];
                float d[2], mn[2];
                iq_cu_mvq_codes<T, true>(st + (16 * wr + gq) * SR + b * BS, tq, &a[0], &a[2], &d[0], &mn[0]);
                iq_cu_mvq_codes<T, true>(st + (16 * wr + gq + 8) * SR + b * BS, tq, &a[1], &a[3], &d[1], &mn[1]);
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    const uint8_t * tile = x0 + (j * G + b) * IQ_XT_BYTES;
                    const int b0 = ((const int *) tile)[lane], b1 = ((const int *) tile)[32 + lane];
                    const float4 ds = ((const float4 *) (tile + 256))[tq];  // d, s of columns 2 tq, 2 tq + 1
                    const float xd[2] = { ds.x, ds.z }, xs[2] = { ds.y, ds.w };
                    int sumi[4];
                    iq_cu_mma_s8_free(sumi, a, b0, b1);
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int h = e / 2, kk = e % 2;
                        const float dd = d[h] * xd[kk];
                        chain[j][e] += mn[h] != 0.0f ? __fadd_rn(__fmul_rn((float) sumi[e], dd), __fmul_rn(mn[h], xs[kk]))
                                                     : __fmul_rn((float) sumi[e], dd);
                    }
                }
            }
        }
    };
    for (int qi = 0; qi < NQ; qi++) {
        const int k = k0 + 4 * qi;
        slot(k);  // S_i (i = rev5(k))
        each([&](int j, int e) { A[j][e] = chain[j][e]; });
        slot(k + 1);  // S_i+16
        each([&](int j, int e) { P[j][e] = A[j][e] + chain[j][e]; });
        slot(k + 2);  // S_i+8
        each([&](int j, int e) { A[j][e] = chain[j][e]; });
        slot(k + 3);  // S_i+24: B_i = (S_i + S_i+16) + (S_i+8 + S_i+24)
        each([&](int j, int e) { res[j][e] = P[j][e] + (A[j][e] + chain[j][e]); });
        if constexpr (LV >= 1) {
            if ((qi & 1) == 0) {
                each([&](int j, int e) { L1[j][e] = res[j][e]; });
                continue;
            }
            each([&](int j, int e) { res[j][e] = L1[j][e] + res[j][e]; });
        }
        if constexpr (LV >= 2) {
            if ((qi & 2) == 0) {
                each([&](int j, int e) { L2[j][e] = res[j][e]; });
                continue;
            }
            each([&](int j, int e) { res[j][e] = L2[j][e] + res[j][e]; });
        }
        if constexpr (LV >= 3) {
            if ((qi & 4) == 0) {
                each([&](int j, int e) { L3[j][e] = res[j][e]; });
                continue;
            }
            each([&](int j, int e) { res[j][e] = L3[j][e] + res[j][e]; });
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    auto out = [&](int64_t row, int c, float v) {
        if (row < n_rows && c < m) {
            ((float *) ((char *) pt.y + (size_t) c * pt.y_nb1))[row] = v;
        }
    };
    if constexpr (WS == 1) {
        each([&](int j, int e) { out(row0 + 16 * wr + gq + 8 * (e / 2), c0 + 8 * j + 2 * tq + e % 2, res[j][e]); });
    } else {
        constexpr int NCP = NC + IQ_MVQ_PAD, SP = NR * NCP;
        float * sums = (float *) iq_mvt_sm;  // [WS][NR][NCP], over the stages
        __syncthreads();  // every subtree is done with its stages
        each([&](int j, int e) { sums[ws * SP + (16 * wr + gq + 8 * (e / 2)) * NCP + 8 * j + 2 * tq + e % 2] = res[j][e]; });
        __syncthreads();
        for (int o = tid; o < NR * NC; o += 32 * WR * WS) {
            const int r = o / NC, c = o % NC;
            const float * p = sums + r * NCP + c;
            float v;
            if constexpr (WS == 2) {
                v = p[0] + p[SP];
            } else if constexpr (WS == 4) {
                v = (p[0] + p[SP]) + (p[2 * SP] + p[3 * SP]);
            } else {
                v = ((p[0] + p[SP]) + (p[2 * SP] + p[3 * SP])) + ((p[4 * SP] + p[5 * SP]) + (p[6 * SP] + p[7 * SP]));
            }
            out(row0 + r, c0 + c, v);
        }
    }
}

// Matvec for a few columns (decoding): a block of 4 warps takes IQ_MV_ROWS rows of W, its
// threads the 32-element units of those rows in turn, reading the quantized blocks directly
// (many blocks in flight: the weights stream at memory speed). For the 32-element quantized
// types x comes as q8_1 blocks (xq) and a unit is an integer dot product scaled as the CPU
// scales it; the other types read x in f32. NC: columns the kernel is built for; more in n_ct
// tiles of NC: block b takes tile b % n_ct of the rows of b / n_ct (the tiles of a row next to
// each other in launch order, so W is read from memory once and found in L2 by the others).
template <int T, int NC>
__global__ void __launch_bounds__(IQ_MV_THREADS)
iq_cu_matvec(const uint8_t * __restrict__ w, size_t w_nb1, int64_t n_rows, int64_t n_units,
             const float * __restrict__ x, size_t x_nb1, const block_q8_1 * __restrict__ xq,
             float * __restrict__ y, size_t y_nb1, int m, unsigned n_ct) {
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const unsigned ct = blockIdx.x % n_ct;
    const int64_t row0 = (int64_t) (blockIdx.x / n_ct) * IQ_MV_ROWS;
    x = (const float *) ((const char *) x + (size_t) ct * NC * x_nb1);
    xq += xq != nullptr ? (size_t) ct * NC * n_units : 0;
    y = (float *) ((char *) y + (size_t) ct * NC * y_nb1);
    m -= (int) ct * NC;
    float acc[IQ_MV_ROWS][NC];
#pragma unroll
    for (int r = 0; r < IQ_MV_ROWS; r++) {
#pragma unroll
        for (int c = 0; c < NC; c++) acc[r][c] = 0.0f;
    }
    for (int64_t u = tid; u < n_units; u += IQ_MV_THREADS) {
#pragma unroll
        for (int r = 0; r < IQ_MV_ROWS; r++) {
            const int64_t row = row0 + r < n_rows ? row0 + r : n_rows - 1;  // a repeated row, not written
            const uint8_t * wr = w + (size_t) row * w_nb1;
            if constexpr (iq_cu_is_q32<T>) {
#pragma unroll
                for (int c = 0; c < NC; c++) {
                    if (c < m) {
                        const block_q8_1 * b = xq + c * n_units + u;
                        float d, mn;
                        const int sumi = iq_cu_codes_dot<T>(wr, u, b->qs, &d, &mn);
                        const float dd = d * iq_cu_h2f(b->d);
                        acc[r][c] += mn != 0.0f ? __fadd_rn(__fmul_rn((float) sumi, dd), __fmul_rn(mn, iq_cu_h2f(b->s)))
                                                : __fmul_rn((float) sumi, dd);
                    }
                }
            } else {
                float wv[32];
                iq_cu_unit<T>(wr, u, wv);
#pragma unroll
                for (int c = 0; c < NC; c++) {
                    if (c < m) {
                        const float4 * xp = (const float4 *) ((const char *) x + c * x_nb1) + 8 * u;
#pragma unroll
                        for (int i = 0; i < 8; i++) {
                            const float4 xv = xp[i];
                            acc[r][c] += wv[4 * i] * xv.x + wv[4 * i + 1] * xv.y + wv[4 * i + 2] * xv.z + wv[4 * i + 3] * xv.w;
                        }
                    }
                }
            }
        }
    }
    __shared__ float part[IQ_MV_THREADS / 32][IQ_MV_ROWS][NC];
#pragma unroll
    for (int r = 0; r < IQ_MV_ROWS; r++) {
#pragma unroll
        for (int c = 0; c < NC; c++) {
            float v = acc[r][c];
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) part[warp][r][c] = v;
        }
    }
    __syncthreads();
    if (tid < IQ_MV_ROWS * NC) {
        const int r = tid / NC, c = tid % NC;
        if (c < m && row0 + r < n_rows) {
            float v = 0.0f;
#pragma unroll
            for (int k = 0; k < IQ_MV_THREADS / 32; k++) v += part[k][r][c];
            ((float *) ((char *) y + c * y_nb1))[row0 + r] = v;
        }
    }
}

#define IQ_GM_BK 32  // k per step
#define IQ_GM_LD 40  // halves per shared row: 32 of k and 8 of padding (ldm a multiple of 8)

// W (any type) -> f16 rows, one thread per unit: the GEMM's operand, made once per product.
template <int T>
__global__ void iq_cu_w_to_f16(const uint8_t * __restrict__ w, size_t w_nb1, int64_t n_rows, int64_t n_units,
                               half * __restrict__ out) {
    const int64_t e = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n_rows * n_units) {
        return;
    }
    const int64_t row = e / n_units, u = e % n_units;
    float v[32];
    iq_cu_unit<T>(w + (size_t) row * w_nb1, u, v);
    iq_cu_store_unit_f16(v, out + e * 32);
}

// x (f32) -> f16 rows, one thread per unit; with Q8, through the CPU's q8 rounding first
// (codes times the fp16 d of the unit), as the CPU's dot products of those weight types read x.
template <bool Q8>
__global__ void iq_cu_x_to_f16(const float * __restrict__ x, size_t x_nb1, int64_t m, int64_t n_units,
                               half * __restrict__ out) {
    int64_t e;
    float v[32];
    if (!iq_cu_load_unit(x, x_nb1, n_units, m, &e, v)) {
        return;
    }
    if (Q8) {
        int8_t q[32];
        const float d = iq_cu_h2f(iq_cu_quantize_q8_0(v, q));
#pragma unroll
        for (int j = 0; j < 32; j++) v[j] = __fmul_rn((float) q[j], d);
    }
    iq_cu_store_unit_f16(v, out + e * 32);
}

// f16 GEMM on the tensor cores: y[n, m] = sum_k a[n, k] b[m, k] (a: n rows of k, b: m rows of
// k, f32 sums). A block of WN x WM warps makes a BN x BM tile of y, each warp (BN / WN) x
// (BM / WM) of it in WMMA 16x16x16 fragments. Asynchronous copies (cp.async, 16 bytes,
// zero-filled past the edges) into STAGES shared buffers: the copies of the next STAGES - 1
// steps of k = 32 are in flight while a step is multiplied, without passing through registers.
// Dynamic shared memory: iq_cu_gemm_cfg::smem bytes; the epilogue reuses it. Every
// configuration adds each output's products in the same order (k in steps of 16, as the
// fragments take them), so they give the same bits.
template <int BN_, int BM_, int WN_, int WM_, int STAGES_, int MINB_>
struct iq_cu_gemm_cfg {
    static constexpr int BN = BN_, BM = BM_, WN = WN_, WM = WM_, STAGES = STAGES_, MINB = MINB_;
    static constexpr int threads = 32 * WN * WM;
    static constexpr int FI = BN / WN / 16, FJ = BM / WM / 16;  // a warp's fragments
    static constexpr int smem = STAGES * (BN + BM) * IQ_GM_LD * (int) sizeof(half);
    static_assert(FI >= 1 && FJ >= 1 && BN % (16 * WN) == 0 && BM % (16 * WM) == 0, "whole fragments per warp");
    static_assert((4 * BN) % threads == 0 && (4 * BM) % threads == 0, "whole 16-byte copies per thread");
};
// The shipped configuration: 128 x 128 tiles, 4 warps of 64 x 64 (4 x 4 fragments: eight
// fragment loads per sixteen products), 4 stages (80 KiB, two blocks per multiprocessor). Measured
// against 8 warps of 64 x 32 (the earlier one), 128 x 256 and 256 x 128 with warps of 64 x 64 and
// 3 stages, on an H100 (docs/BENCHMARKS.md, "The prompt GEMM's tiles"): pp512 1.12x the earlier
// one's tokens/s, an 8192-token prompt 1.17x (f16 cache) / 1.15x (innerq); the wider tiles lost.
using iq_cu_gemm_shipped = iq_cu_gemm_cfg<128, 128, 2, 2, 4, 2>;
// The same tiles for iq_cu_gemm_wq: 3 stages of k = 64 (85-98 KiB by the type, two blocks per
// multiprocessor where 228 KiB are).
using iq_cu_gemm_wq_shipped = iq_cu_gemm_cfg<128, 128, 2, 2, 3, 2>;

static __device__ __forceinline__ void iq_cu_cp_async16(void * smem, const void * src, bool ok) {
    const unsigned s = (unsigned) __cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(ok ? 16 : 0));
}

// A warp's products of one step: its FI x FJ fragments of y += at[rows, kk..] bt[cols, kk..]
// for kk in 0, 16, .. BK - 16 (shared tiles of ld halves a row). Every kernel below adds k in
// this order, 16 at a time.
template <class C, int BK, int LD, class Acc>
static __device__ __forceinline__ void iq_cu_gemm_step(Acc (&acc)[C::FI][C::FJ], const half * at, const half * bt,
                                                      int wn, int wm) {
    using namespace nvcuda;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> fa[C::FI];
        wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> fb[C::FJ];
#pragma unroll
        for (int i = 0; i < C::FI; i++) {
            wmma::load_matrix_sync(fa[i], &at[(16 * C::FI * wn + 16 * i) * LD + kk], LD);
        }
#pragma unroll
        for (int j = 0; j < C::FJ; j++) {
            wmma::load_matrix_sync(fb[j], &bt[(16 * C::FJ * wm + 16 * j) * LD + kk], LD);
        }
#pragma unroll
        for (int i = 0; i < C::FI; i++) {
#pragma unroll
            for (int j = 0; j < C::FJ; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
    }
}

// The tile's sums to y through a warp's 16 x 16 floats of shared memory at cs (the caller has
// waited for every copy and synchronised: cs reuses the buffers).
template <class C, class Acc>
static __device__ __forceinline__ void iq_cu_gemm_epilogue(Acc (&acc)[C::FI][C::FJ], float * cs, int64_t n0, int64_t m0,
                                                          int64_t n, int64_t m, float * __restrict__ y, size_t y_nb1) {
    using namespace nvcuda;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wn = warp % C::WN, wm = warp / C::WN;
    float * c = cs + warp * 256;
#pragma unroll
    for (int i = 0; i < C::FI; i++) {
#pragma unroll
        for (int j = 0; j < C::FJ; j++) {
            wmma::store_matrix_sync(c, acc[i][j], 16, wmma::mem_col_major);
            __syncwarp();
            for (int e = lane; e < 256; e += 32) {
                const int64_t nn = n0 + 16 * C::FI * wn + 16 * i + e % 16, mm = m0 + 16 * C::FJ * wm + 16 * j + e / 16;
                if (nn < n && mm < m) {
                    ((float *) ((char *) y + (size_t) mm * y_nb1))[nn] = c[e];
                }
            }
            __syncwarp();
        }
    }
}

template <class C>
__global__ void __launch_bounds__(C::threads, C::MINB)
iq_cu_gemm_f16_async(const half * __restrict__ a, const half * __restrict__ b, int64_t n, int64_t m, int64_t k,
                     float * __restrict__ y, size_t y_nb1) {
    using namespace nvcuda;
    constexpr int BN = C::BN, BM = C::BM, ST = C::STAGES, FI = C::FI, FJ = C::FJ;
    extern __shared__ __align__(128) unsigned char iq_gm_smem[];
    half * as = (half *) iq_gm_smem;         // [ST][BN * IQ_GM_LD]
    half * bs = as + ST * BN * IQ_GM_LD;     // [ST][BM * IQ_GM_LD]
    const int tid = threadIdx.x, warp = tid / 32;
    const int wn = warp % C::WN, wm = warp / C::WN;  // rows 16 FI wn.., columns 16 FJ wm..
    const int64_t n0 = (int64_t) blockIdx.y * BN, m0 = (int64_t) blockIdx.x * BM;
    // a thread's copies: row pr + i rows_per of the tile, 8 halves from pc
    constexpr int rows_per = C::threads / 4;
    const int pr = tid / 4, pc = 8 * (tid % 4);
    const int64_t steps = k / IQ_GM_BK;
    auto load = [&](int64_t s) {
        if (s < steps) {
            const int buf = (int) (s % ST);
            const int64_t k0 = s * IQ_GM_BK;
#pragma unroll
            for (int i = 0; i < BN / rows_per; i++) {
                const int64_t row = n0 + pr + rows_per * i;
                iq_cu_cp_async16(&as[(buf * BN + pr + rows_per * i) * IQ_GM_LD + pc], a + (row < n ? row : 0) * k + k0 + pc,
                                 row < n);
            }
#pragma unroll
            for (int i = 0; i < BM / rows_per; i++) {
                const int64_t col = m0 + pr + rows_per * i;
                iq_cu_cp_async16(&bs[(buf * BM + pr + rows_per * i) * IQ_GM_LD + pc], b + (col < m ? col : 0) * k + k0 + pc,
                                 col < m);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FI][FJ];
#pragma unroll
    for (int i = 0; i < FI; i++) {
#pragma unroll
        for (int j = 0; j < FJ; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    }
#pragma unroll
    for (int s = 0; s < ST - 1; s++) load(s);
    for (int64_t s = 0; s < steps; s++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 2));
        __syncthreads();  // step s in every thread's view; step s - 1's buffer free
        load(s + ST - 1);
        iq_cu_gemm_step<C, IQ_GM_BK, IQ_GM_LD>(acc, as + (s % ST) * BN * IQ_GM_LD, bs + (s % ST) * BM * IQ_GM_LD, wn, wm);
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
    iq_cu_gemm_epilogue<C>(acc, (float *) iq_gm_smem, n0, m0, n, m, y, y_nb1);
}

// ---- the GEMM of the 32-element formats, W read as it is stored ----
//
// The same tiles and the same sums as iq_cu_gemm_f16_async on W's f16 copy, without the copy:
// a step of k = 64 (two blocks of each row) brings W's block bytes into shared memory with
// 4-byte asynchronous copies (a row's two blocks are 36-68 bytes, whole words when its blocks
// per row are even), and the block's threads turn them into the step's f16 tile, each thread one
// row, with the rounding iq_cu_w_to_f16 makes (the products then see the same operands). x
// comes as f16 rows (iq_cu_x_to_f16) through 16-byte copies as before.

#define IQ_GQ_BK 64  // k per step: two blocks
#define IQ_GQ_LD 72  // halves per shared row of an f16 tile: 64 of k and 8 of padding

// Words of shared memory per row of a step's block bytes: the two blocks' words, made odd so
// that the threads converting rows t, t + 1, .. read different banks.
template <int T>
constexpr int iq_cu_gq_words = (2 * iq_cu_q32_bytes<T> / 4) | 1;

template <int T, class C>
constexpr int iq_cu_gq_smem = C::STAGES * (C::BN * iq_cu_gq_words<T> * 4 + C::BM * IQ_GQ_LD * (int) sizeof(half)) +
                              C::BN * IQ_GQ_LD * (int) sizeof(half);

static __device__ __forceinline__ void iq_cu_cp_async4(void * smem, const void * src, bool ok) {
    const unsigned s = (unsigned) __cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(ok ? 4 : 0));
}

// Block u (0 or 1) of a row's step bytes at r (shared memory) -> 32 halves at dst, the values
// iq_cu_unit<T> gives rounded to f16. q4_0 in half2 arithmetic: 1024 + code is exact in f16,
// so (1024 + c - 1032) d is (c - 8) d rounded once, as the f32 product (exact) rounded to f16.
template <int T>
static __device__ __forceinline__ void iq_cu_gq_unit_f16(const uint8_t * r, int u, half * __restrict__ dst) {
    if constexpr (T == IQ_TYPE_Q4_0) {
        const uint8_t * b = r + u * (int) sizeof(block_q4_0);
        const half2 d2 = __half2half2(__ushort_as_half((unsigned short) iq_cu_u16(b)));
        const half2 off = __half2half2(__ushort_as_half((unsigned short) 0x6408));  // 1032
        uint32_t lo[8], hi[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const uint32_t q = iq_cu_u16(b + 2 + 2 * j);  // elements 2j, 2j + 1 (low), 2j + 16, 2j + 17 (high)
            const uint32_t l = (q & 0xFu) | ((q << 8) & 0xF0000u) | 0x64006400u;
            const uint32_t h = ((q >> 4) & 0xFu) | ((q << 4) & 0xF0000u) | 0x64006400u;
            const half2 vl = __hmul2(__hsub2(*(const half2 *) &l, off), d2);
            const half2 vh = __hmul2(__hsub2(*(const half2 *) &h, off), d2);
            lo[j] = *(const uint32_t *) &vl;
            hi[j] = *(const uint32_t *) &vh;
        }
        uint4 * o = (uint4 *) dst;
        o[0] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        o[1] = make_uint4(lo[4], lo[5], lo[6], lo[7]);
        o[2] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        o[3] = make_uint4(hi[4], hi[5], hi[6], hi[7]);
    } else {
        float v[32];
        iq_cu_unit<T>(r, u, v);
        iq_cu_store_unit_f16(v, dst);
    }
}

// Products of the same x in one launch (parts, first[] in tiles of BN rows: q, k and v, whose k
// and v alone were 32 blocks of an 8B model's prompt each, a quarter of the multiprocessors).
template <int T, class C>
__global__ void __launch_bounds__(C::threads, C::MINB)
iq_cu_gemm_wq(const iq_cu_mv_parts parts, const half * __restrict__ b, int64_t m, int64_t k) {
    using namespace nvcuda;
    const bool p1 = parts.n > 1 && blockIdx.y >= parts.first[1], p2 = parts.n > 2 && blockIdx.y >= parts.first[2];
    const uint8_t * __restrict__ w = p2 ? parts.w[2] : p1 ? parts.w[1] : parts.w[0];
    const size_t w_nb1 = p2 ? parts.w_nb1[2] : p1 ? parts.w_nb1[1] : parts.w_nb1[0];
    const int64_t n = p2 ? parts.n_rows[2] : p1 ? parts.n_rows[1] : parts.n_rows[0];
    float * __restrict__ y = p2 ? parts.y[2] : p1 ? parts.y[1] : parts.y[0];
    const size_t y_nb1 = p2 ? parts.y_nb1[2] : p1 ? parts.y_nb1[1] : parts.y_nb1[0];
    const unsigned tile = blockIdx.y - (p2 ? parts.first[2] : p1 ? parts.first[1] : 0u);
    constexpr int BN = C::BN, BM = C::BM, ST = C::STAGES, FI = C::FI, FJ = C::FJ;
    constexpr int BS = iq_cu_q32_bytes<T>, NW = 2 * BS / 4, SW = iq_cu_gq_words<T>;
    static_assert(BN == C::threads, "a thread converts one row of W");
    static_assert((8 * BM) % C::threads == 0, "whole 16-byte copies of x per thread");
    extern __shared__ __align__(128) unsigned char iq_gm_smem[];
    half * bs = (half *) iq_gm_smem;                                      // [ST][BM * IQ_GQ_LD]
    half * wt = bs + ST * BM * IQ_GQ_LD;                                  // [BN * IQ_GQ_LD], the step's W
    uint32_t * ws = (uint32_t *) (wt + BN * IQ_GQ_LD);                    // [ST][BN * SW], block bytes
    const int tid = threadIdx.x, warp = tid / 32;
    const int wn = warp % C::WN, wm = warp / C::WN;
    const int64_t n0 = (int64_t) tile * BN, m0 = (int64_t) blockIdx.x * BM;
    const int64_t steps = k / IQ_GQ_BK;
    auto load = [&](int64_t s) {
        if (s < steps) {
            const int buf = (int) (s % ST);
#pragma unroll
            for (int t = 0; t < NW; t++) {
                const int i = tid + t * C::threads, r = i / NW, q = i % NW;
                const int64_t row = n0 + r;
                iq_cu_cp_async4(&ws[(buf * BN + r) * SW + q], w + (size_t) (row < n ? row : 0) * w_nb1 + s * 2 * BS + 4 * q,
                                row < n);
            }
#pragma unroll
            for (int t = 0; t < BM * 8 / C::threads; t++) {
                const int i = tid + t * C::threads, r = i / 8, pc = 8 * (i % 8);
                const int64_t col = m0 + r;
                iq_cu_cp_async16(&bs[(buf * BM + r) * IQ_GQ_LD + pc], b + (col < m ? col : 0) * k + s * IQ_GQ_BK + pc,
                                 col < m);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[FI][FJ];
#pragma unroll
    for (int i = 0; i < FI; i++) {
#pragma unroll
        for (int j = 0; j < FJ; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    }
#pragma unroll
    for (int s = 0; s < ST - 1; s++) load(s);
    for (int64_t s = 0; s < steps; s++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(ST - 2));
        __syncthreads();  // step s in every thread's view; step s - 1's buffers and wt free
        load(s + ST - 1);
        const uint8_t * r = (const uint8_t *) &ws[((s % ST) * BN + tid) * SW];
        iq_cu_gq_unit_f16<T>(r, 0, wt + tid * IQ_GQ_LD);
        iq_cu_gq_unit_f16<T>(r, 1, wt + tid * IQ_GQ_LD + 32);
        __syncthreads();  // the step's W tile made
        iq_cu_gemm_step<C, IQ_GQ_BK, IQ_GQ_LD>(acc, wt, bs + (s % ST) * BM * IQ_GQ_LD, wn, wm);
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();
    iq_cu_gemm_epilogue<C>(acc, (float *) iq_gm_smem, n0, m0, n, m, y, y_nb1);
}
