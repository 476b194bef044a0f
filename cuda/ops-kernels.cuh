// Kernels of the small ops: get_rows, rms_norm, mul / add, swiglu, rope. Rows are ne[0]
// contiguous elements; a block (or a thread) takes whole rows or units of them.
#pragma once

#include "dequant.cuh"

// One block per output row; threads take the row's 32-element units in turn.
template <int T>
__global__ void iq_cu_get_rows(const uint8_t * __restrict__ a, size_t a_nb1, int64_t a_rows, int64_t n_units,
                               const int32_t * __restrict__ ids, iq_cu_rows dst, int * error) {
    const int64_t i = blockIdx.x;
    const int32_t id = ids[i];
    float * y = (float *) iq_cu_row(dst, i);
    const bool bad = id < 0 || id >= a_rows;
    if (bad && threadIdx.x == 0) {
        atomicOr(error, 1 << 0);
    }
    for (int64_t u = threadIdx.x; u < n_units; u += blockDim.x) {
        float v[32];
        if (bad) {
            for (int j = 0; j < 32; j++) v[j] = 0.0f;
        } else {
            iq_cu_unit<T>(a + (size_t) id * a_nb1, u, v);
        }
#pragma unroll
        for (int j = 0; j < 32; j++) {
            y[32 * u + j] = v[j];
        }
    }
}

// A block's sum of one double per thread (blockDim.x a multiple of 32, at most 1024).
static __device__ double iq_cu_block_sum(double v) {
    __shared__ double part[32];
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    if (threadIdx.x % 32 == 0) {
        part[threadIdx.x / 32] = v;
    }
    __syncthreads();
    // every warp sums the warps' parts alike (a tree, not a chain of 32 dependent adds)
    const int lane = threadIdx.x % 32;
    double s = lane < (int) blockDim.x / 32 ? part[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, o);
    }
    __syncthreads();
    return s;
}

// A chain of ops in one launch, one block per row: [sum = a + b ->] norm = rms_norm(x)
// [-> mul = norm * w (one weight row)] [-> xq = q8_1 copy of the result]. x is a, or the sum
// (written out too: the residual stream). The sum of squares is taken in double, as the CPU
// takes it; each value is rounded as the separate ops round it.
__global__ void iq_cu_norm_chain(iq_cu_rows a, iq_cu_rows b, iq_cu_rows sum, bool add, iq_cu_rows norm, int64_t n,
                                 float eps, const float * __restrict__ w, iq_cu_rows mul, block_q8_1 * xq) {
    const float * x = (const float *) iq_cu_row(a, blockIdx.x);
    const float * z = add ? (const float *) iq_cu_row(b, blockIdx.x) : nullptr;
    float * xs = add ? (float *) iq_cu_row(sum, blockIdx.x) : nullptr;
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float v = x[i];
        if (add) {
            v = v + z[i];
            xs[i] = v;
        }
        s += (double) v * v;
    }
    s = iq_cu_block_sum(s);
    const float scale = 1.0f / sqrtf((float) (s / n) + eps);
    float * y = (float *) iq_cu_row(norm, blockIdx.x);
    float * y2 = w != nullptr ? (float *) iq_cu_row(mul, blockIdx.x) : nullptr;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = (add ? xs[i] : x[i]) * scale;  // a thread reads back only its own sums
        y[i] = v;
        if (w != nullptr) {
            y2[i] = v * w[i];
        }
    }
    if (xq != nullptr) {
        __syncthreads();
        const float * r = w != nullptr ? y2 : y;
        for (int64_t u = threadIdx.x; u < n / 32; u += blockDim.x) {
            float v[32];
#pragma unroll
            for (int j = 0; j < 32; j++) v[j] = r[32 * u + j];
            iq_cu_quantize_q8_1(v, xq + blockIdx.x * (n / 32) + u);
        }
    }
}

// The same chain with float4 loads and stores (rows, w and the strides 16-byte aligned, n a
// multiple of 4, at most 4 float4 per thread: NCH): thread t takes the float4s t, t + blockDim,
// ... of the row and keeps them in registers; the q8_1 copy is made by 8 lanes per block of 32
// (iq_cu_quantize_q8_1_x8). The same roundings as iq_cu_norm_chain.
template <int NCH>
__global__ void __launch_bounds__(1024)
iq_cu_norm_chain4(iq_cu_rows a, iq_cu_rows b, iq_cu_rows sum, bool add, iq_cu_rows norm, int64_t n, float eps,
                  const float * __restrict__ w, iq_cu_rows mul, block_q8_1 * xq, bool w_const) {
    iq_cu_pdl_trigger();
    const int n4 = (int) (n / 4), tid = threadIdx.x;
    const float4 * x = (const float4 *) iq_cu_row(a, blockIdx.x);
    const float4 * z = add ? (const float4 *) iq_cu_row(b, blockIdx.x) : nullptr;
    float4 * xs = add ? (float4 *) iq_cu_row(sum, blockIdx.x) : nullptr;
    // the weight row is loaded with x (or before the previous kernel ends, a constant row): its
    // latency is not added after the sum
    float4 v[NCH], wv[NCH];
    auto load_w = [&]() {
#pragma unroll
        for (int k = 0; k < NCH; k++) {
            const int i = tid + k * (int) blockDim.x;
            wv[k] = w != nullptr && i < n4 ? ((const float4 *) w)[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    };
    if (w_const) {
        load_w();
    }
    iq_cu_pdl_wait();
    if (!w_const) {
        load_w();
    }
    double s = 0.0;
#pragma unroll
    for (int k = 0; k < NCH; k++) {
        const int i = tid + k * (int) blockDim.x;
        v[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < n4) {
            v[k] = x[i];
            if (add) {
                const float4 t = z[i];
                v[k].x = v[k].x + t.x, v[k].y = v[k].y + t.y, v[k].z = v[k].z + t.z, v[k].w = v[k].w + t.w;
                xs[i] = v[k];
            }
            s += (double) v[k].x * v[k].x;
            s += (double) v[k].y * v[k].y;
            s += (double) v[k].z * v[k].z;
            s += (double) v[k].w * v[k].w;
        }
    }
    s = iq_cu_block_sum(s);
    const float scale = 1.0f / sqrtf((float) (s / n) + eps);
    float4 * y = (float4 *) iq_cu_row(norm, blockIdx.x);
    float4 * y2 = w != nullptr ? (float4 *) iq_cu_row(mul, blockIdx.x) : nullptr;
#pragma unroll
    for (int k = 0; k < NCH; k++) {
        const int i = tid + k * (int) blockDim.x;
        float4 r = make_float4(v[k].x * scale, v[k].y * scale, v[k].z * scale, v[k].w * scale);
        if (i < n4) {
            y[i] = r;
            if (w != nullptr) {
                const float4 t = wv[k];
                r.x = r.x * t.x, r.y = r.y * t.y, r.z = r.z * t.z, r.w = r.w * t.w;
                y2[i] = r;
            }
        }
        if (xq != nullptr) {  // n a multiple of 32: a block's 8 lanes are all in the row or all past it
            iq_cu_quantize_q8_1_x8(r, i % 8, i < n4, xq + blockIdx.x * (n / 32) + i / 8);
        }
    }
}

// One thread per element of a; b's rows repeat over a's (index modulo b's extents).
template <bool MUL>
__global__ void iq_cu_binary(iq_cu_rows a, iq_cu_rows b, int64_t b_ne3, iq_cu_rows dst, int64_t n, int64_t total) {
    const int64_t e = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= total) {
        return;
    }
    int64_t r, i0;
    iq_cu_divmod(e, n, r, i0);
    const int64_t i1 = r % a.ne1, i2 = r / a.ne1 % a.ne2, i3 = r / (a.ne1 * a.ne2);
    const float x = ((const float *) iq_cu_row(a, r))[i0];
    const float z = ((const float *) (b.data + (i1 % b.ne1) * b.nb1 + (i2 % b.ne2) * b.nb2 + (i3 % b_ne3) * b.nb3))[i0];
    ((float *) iq_cu_row(dst, r))[i0] = MUL ? x * z : x + z;
}

// One thread per element: silu(g) * u, or gelu(g) * u in the CPU backend's tanh form.
template <bool GELU>
__global__ void iq_cu_glu(iq_cu_rows g, iq_cu_rows u, iq_cu_rows dst, int64_t n, int64_t total) {
    const int64_t e = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= total) {
        return;
    }
    int64_t r, i;
    iq_cu_divmod(e, n, r, i);
    const float x = ((const float *) iq_cu_row(g, r))[i];
    const float act = GELU ? 0.5f * x * (1.0f + tanhf(0.7978845608028654f * x * (1.0f + 0.044715f * x * x)))
                           : x / (1.0f + expf(-x));
    ((float *) iq_cu_row(dst, r))[i] = act * ((const float *) iq_cu_row(u, r))[i];
}

// SWIGLU that also makes the q8_1 copy of its result for the product that reads it: one float4
// per thread, 8 lanes per block of 32 (rows 16-byte aligned, n a multiple of 32).
__global__ void iq_cu_swiglu_q8(iq_cu_rows g, iq_cu_rows u, iq_cu_rows dst, int64_t n, int64_t total4,
                                block_q8_1 * __restrict__ xq) {
    iq_cu_pdl_trigger();
    iq_cu_pdl_wait();
    const int64_t e = (int64_t) blockIdx.x * blockDim.x + threadIdx.x, n4 = n / 4;
    const bool in = e < total4;
    int64_t r, i;
    iq_cu_divmod(e, n4, r, i);
    r = in ? r : 0;
    float4 y = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (in) {
        const float4 x = ((const float4 *) iq_cu_row(g, r))[i], z = ((const float4 *) iq_cu_row(u, r))[i];
        y.x = x.x / (1.0f + expf(-x.x)) * z.x;
        y.y = x.y / (1.0f + expf(-x.y)) * z.y;
        y.z = x.z / (1.0f + expf(-x.z)) * z.z;
        y.w = x.w / (1.0f + expf(-x.w)) * z.w;
        ((float4 *) iq_cu_row(dst, r))[i] = y;
    }
    iq_cu_quantize_q8_1_x8(y, (int) (i % 8), in, xq + (in ? e / 8 : 0));
}

// The angle of pair i before the frequency factors: pos * theta_scale^i formed by repeated
// products in float, as the CPU forms it (pair i + 1's is pair i's times theta_scale).
static __device__ __forceinline__ float iq_cu_rope_theta(int pos, int i, float theta_scale) {
    float theta = (float) pos;
    for (int k = 0; k < i; k++) {
        theta *= theta_scale;
    }
    return theta;
}

// Pair i (x0, x1) of a row in place at the angle theta of iq_cu_rope_theta (RoPE, the CPU
// backend's arithmetic): cos and sin times ms, the op's magnitude factor (YaRN's mscale,
// LongRoPE's attn_factor where only some channels are rotated; 1: exact).
static __device__ __forceinline__ void iq_cu_rope_at(float & x0, float & x1, float theta, const float * ff, int i,
                                                     int n_rot, float ms) {
    if (2 * i >= n_rot) {
        return;
    }
    const float th = ff != nullptr ? theta / ff[i] : theta;
    const float c = __fmul_rn(cosf(th), ms), s = __fmul_rn(sinf(th), ms), a = x0, b = x1;
    x0 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    x1 = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

// Pair i of row r of x: y[2i], y[2i + 1].
static __device__ __forceinline__ void iq_cu_rope_pair(const float * x, float * y, int pos, const float * ff, int64_t i,
                                                       int n_rot, float theta_scale, float ms) {
    float x0 = x[2 * i], x1 = x[2 * i + 1];
    if (2 * i < n_rot) {
        iq_cu_rope_at(x0, x1, iq_cu_rope_theta(pos, (int) i, theta_scale), ff, (int) i, n_rot, ms);
    }
    y[2 * i] = x0;
    y[2 * i + 1] = x1;
}

// One thread per pair (2i, 2i + 1) of a row (head, token); channels past n_rot are copied.
__global__ void iq_cu_rope(iq_cu_rows a, iq_cu_rows dst, const int32_t * __restrict__ pos,
                           const float * __restrict__ ff, int64_t hd, int n_rot, float theta_scale, float ms,
                           int64_t total) {
    const int64_t e = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t half = hd / 2;
    if (e >= total) {
        return;
    }
    int64_t r, i;  // row (head + n_head * token), pair
    iq_cu_divmod(e, half, r, i);
    iq_cu_rope_pair((const float *) iq_cu_row(a, r), (float *) iq_cu_row(dst, r), pos[r / a.ne1], ff, i, n_rot,
                    theta_scale, ms);
}

// A small f32 matrix W [n_rows][k] (the cache's rotation, D x D) times columns of x (rows of k
// elements) in f32: y_j[n] = sum_u W[n][u] x_j[u]. A CTA of 16 warps takes C columns (grid x; C 8,
// or 2 where there are few: the work of a decoded token over 4x more multiprocessors) and
// a row tile of 16 x IQ_SM_RW / U rows (grid y): the W rows' float4s are loaded first (lane l holds W[n][4 l + 128 u
// ..], coalesced along the row), warp j < C brings column j into shared memory meanwhile (one
// float4 per lane and 128 elements), then each warp sums its IQ_SM_RW rows against the C
// columns: C partial dots per lane, a halving butterfly over the low lane bits and a shuffle sum
// over the others leave lane l (l < C) column l's sum, which it writes. ROPE: the columns are
// RoPE of a's rows (iq_cu_rope_at) made in registers, and the CTAs of row tile 0 also write them
// to rope: a ROPE and the rotation product that reads it in one launch. Row tiles beyond the
// grid's are taken in turn (one row tile per column tile in the grid where y or the rope's output
// lies over x: every column is in shared memory before any write).
#define IQ_SM_MAX_K 256
#define IQ_SM_COLS 8   // columns per CTA (C), or 2 for a few columns (decoding: more CTAs)
#define IQ_SM_RW 8     // rows per warp and row tile, times U
#define IQ_SM_WARPS 16

// One step of the halving butterfly over a warp's C partial sums p (one per column): after the
// step of O, lane l holds in p[i], i < O, the sum over the lanes that agree with it from bit O
// up of column i + (l & O) + (the bits above O it took before); after O = C/2 .. 1, p[0] of
// lane l is column (l mod C)'s sum over the lanes that agree with it from bit log2 C up.
template <int O, int C>
static __device__ __forceinline__ void iq_cu_halve(float (&p)[C], int lane) {
    const bool up = (lane & O) != 0;
#pragma unroll
    for (int i = 0; i < O; i++) {
        const float send = up ? p[i] : p[i + O];
        const float keep = up ? p[i + O] : p[i];
        p[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
}
template <int C>
static __device__ __forceinline__ float iq_cu_column_sums(float (&p)[C], int lane) {
    if constexpr (C >= 16) iq_cu_halve<8, C>(p, lane);
    if constexpr (C >= 8) iq_cu_halve<4, C>(p, lane);
    if constexpr (C >= 4) iq_cu_halve<2, C>(p, lane);
    if constexpr (C >= 2) iq_cu_halve<1, C>(p, lane);
    float v = p[0];
#pragma unroll
    for (int o = C; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// U float4 per lane cover a row of k <= 128 U elements.
template <bool ROPE, int U, int C>
__global__ void __launch_bounds__(32 * IQ_SM_WARPS)
iq_cu_small_f32(const float * __restrict__ w, size_t w_nb1, int n_rows, int k, iq_cu_rows x, int m, iq_cu_rows y,
                iq_cu_rows rope, const int32_t * __restrict__ pos, const float * __restrict__ ff, int n_rot,
                float theta_scale, float ms, bool w_const) {
    iq_cu_pdl_trigger();
    constexpr int RW = IQ_SM_RW / U, TILE = IQ_SM_WARPS * RW;
    __shared__ __align__(16) float4 xs[IQ_SM_COLS][IQ_SM_MAX_K / 4];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, k4 = k / 4;
    const int j0 = blockIdx.x * C, nc = m - j0 < C ? m - j0 : C;
    float4 wr[RW][U];
    auto load_w = [&](int n0) {
#pragma unroll
        for (int r = 0; r < RW; r++) {
            const int n = n0 + r < n_rows ? n0 + r : n_rows - 1;  // a repeated row, not written
            const float4 * row = (const float4 *) ((const char *) w + (size_t) n * w_nb1);
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int i4 = lane + 32 * u;
                wr[r][u] = i4 < k4 ? __ldg(row + i4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
    };
    // in flight while the columns come in (a constant W: while the previous kernel runs)
    if (w_const) {
        load_w(blockIdx.y * TILE + warp * RW);
    }
    iq_cu_pdl_wait();
    if (!w_const) {
        load_w(blockIdx.y * TILE + warp * RW);
    }
    if (warp < C) {
        const int j = warp;
        const float4 * xr = j < nc ? (const float4 *) iq_cu_row(x, j0 + j) : nullptr;
        float4 * out = ROPE && j < nc && blockIdx.y == 0 && rope.data != nullptr ? (float4 *) iq_cu_row(rope, j0 + j)
                                                                                 : nullptr;
        const int p = ROPE && j < nc ? pos[(j0 + j) / (int) x.ne1] : 0;
        float4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i4 = lane + 32 * u;
            v[u] = xr != nullptr && i4 < k4 ? xr[i4] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int i4 = lane + 32 * u;
            if (ROPE && xr != nullptr && i4 < k4) {
                const float th = 4 * i4 < n_rot ? iq_cu_rope_theta(p, 2 * i4, theta_scale) : 0.0f;
                iq_cu_rope_at(v[u].x, v[u].y, th, ff, 2 * i4, n_rot, ms);
                iq_cu_rope_at(v[u].z, v[u].w, th * theta_scale, ff, 2 * i4 + 1, n_rot, ms);
                if (out != nullptr) {
                    out[i4] = v[u];
                }
            }
            if (i4 < IQ_SM_MAX_K / 4) {
                xs[j][i4] = v[u];
            }
        }
    }
    float * yl = lane < nc ? (float *) iq_cu_row(y, j0 + lane) : nullptr;  // lane l writes column l
    __syncthreads();
    float4 xv[C][U];  // the lane's part of every column, read from shared memory once
#pragma unroll
    for (int j = 0; j < C; j++) {
#pragma unroll
        for (int u = 0; u < U; u++) xv[j][u] = xs[j][lane + 32 * u];  // zeros past k, as W's
    }
    for (int n0 = blockIdx.y * TILE + warp * RW; n0 < n_rows; n0 += gridDim.y * TILE) {
        if (n0 != (int) (blockIdx.y * TILE + warp * RW)) {
            load_w(n0);
        }
#pragma unroll
        for (int r = 0; r < RW; r++) {
            float p[C];
#pragma unroll
            for (int j = 0; j < C; j++) {
                float t = 0.0f;
#pragma unroll
                for (int u = 0; u < U; u++) {
                    t = fmaf(wr[r][u].x, xv[j][u].x, t);
                    t = fmaf(wr[r][u].y, xv[j][u].y, t);
                    t = fmaf(wr[r][u].z, xv[j][u].z, t);
                    t = fmaf(wr[r][u].w, xv[j][u].w, t);
                }
                p[j] = t;
            }
            const float s = iq_cu_column_sums<C>(p, lane);
            if (yl != nullptr && n0 + r < n_rows) {
                yl[n0 + r] = s;
            }
        }
    }
}

// The cache's rotation R = T H T / sqrt(D) (a W flagged IQ_FLAG_HADAMARD: H the Sylvester-
// Hadamard matrix of order D = 32 E, T = diag(t), t_j the sign of R[0][j]) as a fast
// Walsh-Hadamard transform, one warp per row of x: lane l holds elements E l .. E l + E - 1,
// y = R[0] * FWHT(t * x) (R[0][j] = t_j / sqrt(D)): log2 E butterfly stages in registers, five
// over lanes (shuffles), where the product takes D^2 multiply-adds per row. A part with pos set:
// x's rows are RoPE of its a's (iq_cu_rope_at, the CPU's angles) made in registers, also
// written to rope where rope.data is set. Up to 3 parts (q, k, v) in one launch, part p on CTAs
// [first[p], first[p + 1]) of 4 warps. Q8 (E 2 or 4, one part): y's q8_1 copy for the product
// that reads y next, y's rows contiguous (block r D / 32 + l / (32 / E)).
#define IQ_HAD_MAX_PARTS 3
struct iq_cu_had_part {
    iq_cu_rows x, y, rope;
    int64_t m;
    const int32_t * pos;  // nullptr: no RoPE
    const float * ff;
    int n_rot;
    float theta_scale, mscale;
};
struct iq_cu_had_parts {
    iq_cu_had_part p[IQ_HAD_MAX_PARTS];
    unsigned first[IQ_HAD_MAX_PARTS + 1];
    int n;
};

template <int E, bool Q8>
__global__ void __launch_bounds__(128)
iq_cu_hadamard(const iq_cu_had_parts parts, const float * __restrict__ r0, block_q8_1 * __restrict__ xq) {
    static_assert(E == 2 || E == 4 || E == 8, "rows of 64, 128 or 256");
    static_assert(!Q8 || E == 2 || E == 4, "16 or 8 lanes per q8_1 block");
    iq_cu_pdl_trigger();
    const int lane = threadIdx.x % 32;
    // the part by selects, not an index: an indexed parameter array is copied to local memory
    static_assert(IQ_HAD_MAX_PARTS == 3, "the selects");
    const bool p1 = parts.n > 1 && blockIdx.x >= parts.first[1], p2 = parts.n > 2 && blockIdx.x >= parts.first[2];
    const iq_cu_had_part P = p2 ? parts.p[2] : p1 ? parts.p[1] : parts.p[0];
    const int64_t r = (int64_t) (blockIdx.x - (p2 ? parts.first[2] : p1 ? parts.first[1] : 0u)) * 4 + threadIdx.x / 32;
    float s[E], v[E];
#pragma unroll
    for (int e = 0; e < E; e++) s[e] = __ldg(r0 + E * lane + e);  // a leaf: before the wait
    iq_cu_pdl_wait();
    if (r >= P.m) {
        return;  // the whole warp
    }
    const float * xr = (const float *) iq_cu_row(P.x, r) + E * lane;
#pragma unroll
    for (int e = 0; e < E; e += 2) {
        const float2 q = *(const float2 *) (xr + e);
        v[e] = q.x, v[e + 1] = q.y;
    }
    if (P.pos != nullptr) {
        const int i0 = E / 2 * lane;  // the lane's first pair
        float th = 2 * i0 < P.n_rot ? iq_cu_rope_theta(P.pos[r / P.x.ne1], i0, P.theta_scale) : 0.0f;
#pragma unroll
        for (int e = 0; e < E; e += 2) {
            iq_cu_rope_at(v[e], v[e + 1], th, P.ff, i0 + e / 2, P.n_rot, P.mscale);
            th *= P.theta_scale;
        }
        if (P.rope.data != nullptr) {
            float * out = (float *) iq_cu_row(P.rope, r) + E * lane;
#pragma unroll
            for (int e = 0; e < E; e += 2) *(float2 *) (out + e) = make_float2(v[e], v[e + 1]);
        }
    }
#pragma unroll
    for (int e = 0; e < E; e++) v[e] = s[e] < 0.0f ? -v[e] : v[e];
#pragma unroll
    for (int h = 1; h < E; h <<= 1) {
#pragma unroll
        for (int e = 0; e < E; e++) {
            if ((e & h) == 0) {
                const float a = v[e], b = v[e + h];
                v[e] = a + b;
                v[e + h] = a - b;
            }
        }
    }
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const bool hi = (lane & o) != 0;
#pragma unroll
        for (int e = 0; e < E; e++) {
            const float w = __shfl_xor_sync(0xffffffffu, v[e], o);
            v[e] = hi ? w - v[e] : v[e] + w;
        }
    }
    float * yr = (float *) iq_cu_row(P.y, r) + E * lane;
#pragma unroll
    for (int e = 0; e < E; e += 2) {
        v[e] *= s[e], v[e + 1] *= s[e + 1];
        *(float2 *) (yr + e) = make_float2(v[e], v[e + 1]);
    }
    if constexpr (Q8) {
        iq_cu_quantize_q8_1_lanes<E>(v, lane % (32 / E), true, xq + r * E + lane / (32 / E));
    }
}
