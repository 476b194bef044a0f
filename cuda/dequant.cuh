// Device-side block formats: every weight and plain cache type read 32 elements at a time
// (a "unit": elements [32u, 32u + 32) of a row), and the q8_0 / q4_0 quantizers of the cache.
//
// A unit is the natural piece of every format: one block of the 32-element formats, one
// sub-block (one scale) of the 256-element K-quants, 32 values of f32 / f16 / bf16. Products
// and sums are rounded one at a time (__fmul_rn, __fadd_rn) where the reference rounds them,
// so a unit equals the C reference conversion (ggml_innerq/iq-quants.c) bit for bit.
#pragma once

#include <cuda_fp16.h>
#include <stdint.h>

#include "iq-types.h"
#include "launch.cuh"

static __device__ __forceinline__ float iq_cu_h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }

// Two bytes at p (the block formats are 2-byte aligned).
static __device__ __forceinline__ uint32_t iq_cu_u16(const uint8_t * p) { return *(const uint16_t *) p; }
static __device__ __forceinline__ uint32_t iq_cu_u32(const uint8_t * p) { return *(const uint32_t *) p; }
// Four bytes at a 2-byte aligned address.
static __device__ __forceinline__ uint32_t iq_cu_u32_a2(const uint8_t * p) { return iq_cu_u16(p) | iq_cu_u16(p + 2) << 16; }

// 16 bytes of 4-bit codes (element j < 16 low nibble of byte j, j + 16 its high nibble) with
// an optional 5th bit per element (bit j of qh), scaled: y = code * d + m (m = 0: no add).
template <bool ALIGNED4, bool HAS_M>
static __device__ __forceinline__ void iq_cu_nibbles(const uint8_t * qs, uint32_t qh, int offset, float d, float m,
                                                     float * y) {
#pragma unroll
    for (int w = 0; w < 4; w++) {
        const uint32_t q = ALIGNED4 ? iq_cu_u32(qs + 4 * w) : iq_cu_u32_a2(qs + 4 * w);
#pragma unroll
        for (int b = 0; b < 4; b++) {
            const int j = 4 * w + b;
            const int lo = (int) ((q >> (8 * b)) & 0xF) | (int) (((qh >> j) & 1) << 4);
            const int hi = (int) ((q >> (8 * b + 4)) & 0xF) | (int) (((qh >> (j + 16)) & 1) << 4);
            if (HAS_M) {
                y[j] = __fadd_rn(__fmul_rn((float) lo, d), m);
                y[j + 16] = __fadd_rn(__fmul_rn((float) hi, d), m);
            } else {
                y[j] = __fmul_rn((float) (lo - offset), d);
                y[j + 16] = __fmul_rn((float) (hi - offset), d);
            }
        }
    }
}

// The 6-bit scale and min of sub-block j of a q4_K / q5_K block (scales: 12 bytes).
static __device__ __forceinline__ void iq_cu_scale_min_k4(const uint8_t * scales, int j, int * sc, int * mn) {
    if (j < 4) {
        *sc = scales[j] & 63;
        *mn = scales[j + 4] & 63;
    } else {
        *sc = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4);
        *mn = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
    }
}

// The iq4_nl / iq4_xs code values (IQ4NL_VALUES).
static __constant__ int8_t iq_cu_iq4nl_values[16] = {IQ4NL_VALUES};

// 16 bytes of 4-bit codes (packed as q4_0's) at 2-byte aligned qs -> dl * their iq4_nl values.
static __device__ __forceinline__ void iq_cu_iq4_values(const uint8_t * qs, float dl, float * y) {
#pragma unroll
    for (int w = 0; w < 8; w++) {
        const uint32_t q = iq_cu_u16(qs + 2 * w);
#pragma unroll
        for (int b = 0; b < 2; b++) {
            const int j = 2 * w + b;
            y[j] = __fmul_rn(dl, (float) iq_cu_iq4nl_values[(q >> (8 * b)) & 0xF]);
            y[j + 16] = __fmul_rn(dl, (float) iq_cu_iq4nl_values[(q >> (8 * b + 4)) & 0xF]);
        }
    }
}

// Unit u of a row of type T into y[32].
template <int T>
static __device__ __forceinline__ void iq_cu_unit(const uint8_t * row, int64_t u, float * y) {
    if constexpr (T == IQ_TYPE_F32) {
        const float4 * p = (const float4 *) row + 8 * u;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float4 v = p[i];
            y[4 * i] = v.x, y[4 * i + 1] = v.y, y[4 * i + 2] = v.z, y[4 * i + 3] = v.w;
        }
    } else if constexpr (T == IQ_TYPE_F16 || T == IQ_TYPE_BF16) {
        const uint4 * p = (const uint4 *) row + 4 * u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint4 v = p[i];
            const uint32_t w[4] = { v.x, v.y, v.z, v.w };
#pragma unroll
            for (int k = 0; k < 4; k++) {
                if constexpr (T == IQ_TYPE_F16) {
                    y[8 * i + 2 * k] = iq_cu_h2f((uint16_t) w[k]);
                    y[8 * i + 2 * k + 1] = iq_cu_h2f((uint16_t) (w[k] >> 16));
                } else {
                    y[8 * i + 2 * k] = __uint_as_float(w[k] << 16);
                    y[8 * i + 2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
                }
            }
        }
    } else if constexpr (T == IQ_TYPE_Q4_0) {
        const uint8_t * b = row + u * sizeof(block_q4_0);
        iq_cu_nibbles<false, false>(b + 2, 0, 8, iq_cu_h2f(iq_cu_u16(b)), 0.0f, y);
    } else if constexpr (T == IQ_TYPE_Q4_1) {
        const uint8_t * b = row + u * sizeof(block_q4_1);
        const uint32_t dm = iq_cu_u32(b);
        iq_cu_nibbles<true, true>(b + 4, 0, 0, iq_cu_h2f((uint16_t) dm), iq_cu_h2f((uint16_t) (dm >> 16)), y);
    } else if constexpr (T == IQ_TYPE_Q5_0) {
        const uint8_t * b = row + u * sizeof(block_q5_0);
        iq_cu_nibbles<false, false>(b + 6, iq_cu_u32_a2(b + 2), 16, iq_cu_h2f(iq_cu_u16(b)), 0.0f, y);
    } else if constexpr (T == IQ_TYPE_Q5_1) {
        const uint8_t * b = row + u * sizeof(block_q5_1);
        const uint32_t dm = iq_cu_u32(b);
        iq_cu_nibbles<true, true>(b + 8, iq_cu_u32(b + 4), 0, iq_cu_h2f((uint16_t) dm), iq_cu_h2f((uint16_t) (dm >> 16)), y);
    } else if constexpr (T == IQ_TYPE_Q8_0) {
        const uint8_t * b = row + u * sizeof(block_q8_0);
        const float d = iq_cu_h2f(iq_cu_u16(b));
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const uint32_t q = iq_cu_u16(b + 2 + 2 * i);
            y[2 * i] = __fmul_rn((float) (int8_t) q, d);
            y[2 * i + 1] = __fmul_rn((float) (int8_t) (q >> 8), d);
        }
    } else if constexpr (T == IQ_TYPE_Q4_K || T == IQ_TYPE_Q5_K) {
        // sub-block j: bytes 32 (j / 2) .. of qs, low (even j) or high nibbles; q5_K's 5th bit
        // is bit j of qh[l]
        constexpr size_t bs = T == IQ_TYPE_Q4_K ? sizeof(block_q4_K) : sizeof(block_q5_K);
        const uint8_t * b = row + (u / 8) * bs;
        const int j = (int) (u % 8);
        const uint32_t dm = iq_cu_u32(b);
        int sc, mn;
        iq_cu_scale_min_k4(b + 4, j, &sc, &mn);
        const float dj = __fmul_rn(iq_cu_h2f((uint16_t) dm), (float) sc);
        const float mj = __fmul_rn(iq_cu_h2f((uint16_t) (dm >> 16)), (float) mn);
        const uint8_t * qh = b + 16;
        const uint8_t * qs = b + (T == IQ_TYPE_Q4_K ? 16 : 48) + 32 * (j / 2);
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int w = 0; w < 8; w++) {
            const uint32_t q = iq_cu_u32(qs + 4 * w);
            const uint32_t h = T == IQ_TYPE_Q5_K ? iq_cu_u32(qh + 4 * w) : 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int c = (int) ((q >> (8 * k + shift)) & 0xF);
                if constexpr (T == IQ_TYPE_Q5_K) {
                    c |= (int) (((h >> (8 * k + j)) & 1) << 4);
                }
                y[4 * w + k] = __fsub_rn(__fmul_rn(dj, (float) c), mj);
            }
        }
    } else if constexpr (T == IQ_TYPE_Q2_K || T == IQ_TYPE_Q3_K) {
        // sub-block j = 4 h + k of half h: bits 2k, 2k+1 of qs[32 h + l]; q3_K: minus 4 where bit
        // j of hmask[l] is clear; scale groups 2j (l < 16) and 2j + 1
        constexpr size_t bs = T == IQ_TYPE_Q2_K ? sizeof(block_q2_K) : sizeof(block_q3_K);
        const uint8_t * b = row + (u / 8) * bs;
        const int j = (int) (u % 8), shift = 2 * (j % 4);
        const uint8_t * qs = b + (T == IQ_TYPE_Q2_K ? 16 : 32) + 32 * (j / 4);
        float dl[2], ml[2] = {0.0f, 0.0f};
#pragma unroll
        for (int s = 0; s < 2; s++) {
            const int g = 2 * j + s;
            if constexpr (T == IQ_TYPE_Q2_K) {
                const int sc = b[g];
                dl[s] = __fmul_rn(iq_cu_h2f(iq_cu_u16(b + 80)), (float) (sc & 0xF));
                ml[s] = __fmul_rn(iq_cu_h2f(iq_cu_u16(b + 82)), (float) (sc >> 4));
            } else {
                const uint8_t * sc = b + 96;
                const int low = g < 8 ? sc[g] & 0xF : sc[g - 8] >> 4;
                const int high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
                dl[s] = __fmul_rn(iq_cu_h2f(iq_cu_u16(b + 108)), (float) ((low | high << 4) - 32));
            }
        }
#pragma unroll
        for (int w = 0; w < 16; w++) {
            const uint32_t q = iq_cu_u16(qs + 2 * w);
            const uint32_t hm = T == IQ_TYPE_Q3_K ? iq_cu_u16(b + 2 * w) : 0;
#pragma unroll
            for (int k = 0; k < 2; k++) {
                const int e = 2 * w + k;
                int c = (int) ((q >> (8 * k + shift)) & 3);
                if constexpr (T == IQ_TYPE_Q3_K) {
                    c -= ((hm >> (8 * k + j)) & 1) ? 0 : 4;
                }
                y[e] = __fsub_rn(__fmul_rn(dl[e / 16], (float) c), ml[e / 16]);
            }
        }
    } else if constexpr (T == IQ_TYPE_IQ4_NL) {
        const uint8_t * b = row + u * sizeof(block_iq4_nl);
        iq_cu_iq4_values(b + 2, iq_cu_h2f(iq_cu_u16(b)), y);
    } else if constexpr (T == IQ_TYPE_IQ4_XS) {
        // sub-block j: 16 bytes at qs + 16 j, scale bits 4 (j % 2) of scales_l[j / 2] and 2 j of scales_h
        const uint8_t * b = row + (u / 8) * sizeof(block_iq4_xs);
        const int j = (int) (u % 8);
        const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((iq_cu_u16(b + 2) >> (2 * j)) & 3) << 4);
        iq_cu_iq4_values(b + 8 + 16 * j, __fmul_rn(iq_cu_h2f(iq_cu_u16(b)), (float) (ls - 32)), y);
    } else if constexpr (T == IQ_TYPE_Q6_K) {
        // sub-block j = 4 h + s of half h: low (s < 2) or high nibbles of ql[64 h + 32 (s & 1) ..],
        // 2 more bits at 2 s of qh[32 h ..]; one scale per 16 elements
        const uint8_t * b = row + (u / 8) * sizeof(block_q6_K);
        const int j = (int) (u % 8), h = j / 4, s = j % 4;
        const uint8_t * ql = b + 64 * h + 32 * (s & 1);
        const uint8_t * qh = b + 128 + 32 * h;
        const float d = iq_cu_h2f(iq_cu_u16(b + 208));
        const float d0 = __fmul_rn(d, (float) (int8_t) b[192 + 2 * j]);
        const float d1 = __fmul_rn(d, (float) (int8_t) b[192 + 2 * j + 1]);
        const int lshift = s >= 2 ? 4 : 0;
#pragma unroll
        for (int w = 0; w < 16; w++) {
            const uint32_t l = iq_cu_u16(ql + 2 * w), hb = iq_cu_u16(qh + 2 * w);
#pragma unroll
            for (int k = 0; k < 2; k++) {
                const int c = (int) ((l >> (8 * k + lshift)) & 0xF) | (int) (((hb >> (8 * k + 2 * s)) & 3) << 4);
                const int e = 2 * w + k;
                y[e] = __fmul_rn(e < 16 ? d0 : d1, (float) (c - 32));
            }
        }
    }
}

// ---- integer codes of the 32-element formats (the q8 dot products) ----

// The weight types whose CPU dot product reads q8_0 / q8_1 activations with integer sums.
template <int T>
constexpr bool iq_cu_is_q32 = T == IQ_TYPE_Q4_0 || T == IQ_TYPE_Q4_1 || T == IQ_TYPE_Q5_0 || T == IQ_TYPE_Q5_1 ||
                              T == IQ_TYPE_Q8_0;

// sum_j (code_j - offset) * y_j of unit u (one block) with d and m (0 for the symmetric types).
template <int T>
static __device__ __forceinline__ int iq_cu_codes_dot(const uint8_t * row, int64_t u, const int8_t * y, float * d,
                                                      float * m) {
    int sum = 0;
    if constexpr (T == IQ_TYPE_Q8_0) {
        const uint8_t * b = row + u * sizeof(block_q8_0);
        *d = iq_cu_h2f(iq_cu_u16(b));
        *m = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            sum = __dp4a((int) iq_cu_u32_a2(b + 2 + 4 * i), *(const int *) (y + 4 * i), sum);
        }
    } else {
        constexpr size_t bs = T == IQ_TYPE_Q4_0 ? sizeof(block_q4_0) : T == IQ_TYPE_Q4_1 ? sizeof(block_q4_1)
                            : T == IQ_TYPE_Q5_0 ? sizeof(block_q5_0) : sizeof(block_q5_1);
        constexpr bool asym = T == IQ_TYPE_Q4_1 || T == IQ_TYPE_Q5_1;
        constexpr bool five = T == IQ_TYPE_Q5_0 || T == IQ_TYPE_Q5_1;
        constexpr int offset = asym ? 0 : five ? 16 : 8;
        const uint8_t * b = row + u * bs;
        *d = iq_cu_h2f(iq_cu_u16(b));
        *m = asym ? iq_cu_h2f(iq_cu_u16(b + 2)) : 0.0f;
        const uint8_t * qs = b + (asym ? 4 : 2) + (five ? 4 : 0);
        const uint32_t qh = five ? iq_cu_u32_a2(b + (asym ? 4 : 2)) : 0;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            const uint32_t q = asym ? iq_cu_u32(qs + 4 * w) : iq_cu_u32_a2(qs + 4 * w);
            uint32_t lo = q & 0x0F0F0F0Fu, hi = (q >> 4) & 0x0F0F0F0Fu;
            if (five) {
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    lo |= ((qh >> (4 * w + k)) & 1u) << (8 * k + 4);
                    hi |= ((qh >> (4 * w + k + 16)) & 1u) << (8 * k + 4);
                }
            }
            // codes are 0..31: as bytes they are non-negative int8; the offset comes off the sum
            sum = __dp4a((int) lo, *(const int *) (y + 4 * w), sum);
            sum = __dp4a((int) hi, *(const int *) (y + 16 + 4 * w), sum);
        }
        if (offset != 0) {
            int ysum = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) ysum = __dp4a(0x01010101, *(const int *) (y + 4 * i), ysum);
            sum -= offset * ysum;
        }
    }
    return sum;
}

// ---- the cache's quantizers (ggml's reference rounding: iq_quantize_row_q8_0 / _q4_0) ----

// x[32] -> one q8_0 block's d (returned as fp16 bits; *df: before rounding) and codes.
static __device__ __forceinline__ uint16_t iq_cu_quantize_q8_0(const float * x, int8_t * q, float * df = nullptr) {
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        amax = fmaxf(amax, fabsf(x[j]));
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        q[j] = (int8_t) roundf(__fmul_rn(x[j], id));
    }
    if (df != nullptr) {
        *df = d;
    }
    return __half_as_ushort(__float2half_rn(d));
}

// x[32] -> one q4_0 block's d (fp16 bits) and codes 0..15.
static __device__ __forceinline__ uint16_t iq_cu_quantize_q4_0(const float * x, uint8_t * q) {
    float amax = 0.0f, max = 0.0f;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        const int v = (int8_t) __fadd_rn(__fmul_rn(x[j], id), 8.5f);
        q[j] = (uint8_t) (v < 15 ? v : 15);
    }
    return __half_as_ushort(__float2half_rn(d));
}

// x[32] -> one q8_1 block: the CPU's activation quantizer (q8_0's codes and d, s = d sum).
static __device__ __forceinline__ void iq_cu_quantize_q8_1(const float * x, block_q8_1 * b) {
    float d;
    int8_t q[32];
    b->d = iq_cu_quantize_q8_0(x, q, &d);
    int sum = 0;
#pragma unroll
    for (int j = 0; j < 32; j += 4) {
        sum += q[j] + q[j + 1] + q[j + 2] + q[j + 3];
        *(char4 *) &b->qs[j] = make_char4(q[j], q[j + 1], q[j + 2], q[j + 3]);
    }
    b->s = __half_as_ushort(__float2half_rn((float) sum * d));
}

// One q8_1 block made by 32 / E neighbouring lanes (lane % (32 / E) == part), each holding E of
// the 32 floats (elements E part ..): the same codes, d and s as iq_cu_quantize_q8_1 (the max
// and the integer sum don't depend on the order). Every lane of the warp calls it (shuffles);
// only lanes with store write.
template <int E>
static __device__ __forceinline__ void iq_cu_quantize_q8_1_lanes(const float (&v)[E], int part, bool store,
                                                                  block_q8_1 * b) {
    static_assert(E == 2 || E == 4, "16 or 8 lanes per block");
    float amax = fabsf(v[0]);
#pragma unroll
    for (int e = 1; e < E; e++) amax = fmaxf(amax, fabsf(v[e]));
#pragma unroll
    for (int o = 1; o < 32 / E; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int8_t q[E];
    int sum = 0;
#pragma unroll
    for (int e = 0; e < E; e++) {
        q[e] = (int8_t) roundf(__fmul_rn(v[e], id));
        sum += q[e];
    }
#pragma unroll
    for (int o = 1; o < 32 / E; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (store) {
        if constexpr (E == 4) {
            *(char4 *) &b->qs[4 * part] = make_char4(q[0], q[1], q[2], q[3]);
        } else {
            *(char2 *) &b->qs[2 * part] = make_char2(q[0], q[1]);
        }
        if (part == 0) {
            b->d = __half_as_ushort(__float2half_rn(d));
            b->s = __half_as_ushort(__float2half_rn((float) sum * d));
        }
    }
}

// The same, 8 lanes of 4 floats.
static __device__ __forceinline__ void iq_cu_quantize_q8_1_x8(float4 v, int part, bool store, block_q8_1 * b) {
    const float a[4] = { v.x, v.y, v.z, v.w };
    iq_cu_quantize_q8_1_lanes<4>(a, part, store, b);
}

// x[32] as a plain cache type T stores and reads it back (decode semantics' rounding).
template <int T>
static __device__ __forceinline__ void iq_cu_round_unit(float * x) {
    if constexpr (T == IQ_TYPE_F16) {
#pragma unroll
        for (int j = 0; j < 32; j++) {
            x[j] = __half2float(__float2half_rn(x[j]));
        }
    } else if constexpr (T == IQ_TYPE_Q8_0) {
        int8_t q[32];
        const float d = iq_cu_h2f(iq_cu_quantize_q8_0(x, q));
#pragma unroll
        for (int j = 0; j < 32; j++) {
            x[j] = __fmul_rn((float) q[j], d);
        }
    } else if constexpr (T == IQ_TYPE_Q4_0) {
        uint8_t q[32];
        const float d = iq_cu_h2f(iq_cu_quantize_q4_0(x, q));
#pragma unroll
        for (int j = 0; j < 32; j++) {
            x[j] = __fmul_rn((float) (q[j] - 8), d);
        }
    }
}

// x[32] stored as unit u of a cache row of type T.
template <int T>
static __device__ __forceinline__ void iq_cu_store_unit(const float * x, uint8_t * row, int64_t u) {
    if constexpr (T == IQ_TYPE_F32) {
        float4 * p = (float4 *) row + 8 * u;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            p[i] = make_float4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
        }
    } else if constexpr (T == IQ_TYPE_F16) {
        __half2 * p = (__half2 *) row + 16 * u;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            p[i] = __halves2half2(__float2half_rn(x[2 * i]), __float2half_rn(x[2 * i + 1]));
        }
    } else if constexpr (T == IQ_TYPE_Q8_0) {
        uint8_t * b = row + u * sizeof(block_q8_0);
        int8_t q[32];
        *(uint16_t *) b = iq_cu_quantize_q8_0(x, q);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            *(uint16_t *) (b + 2 + 2 * i) = (uint16_t) ((uint8_t) q[2 * i] | (uint8_t) q[2 * i + 1] << 8);
        }
    } else if constexpr (T == IQ_TYPE_Q4_0) {
        uint8_t * b = row + u * sizeof(block_q4_0);
        uint8_t q[32];
        *(uint16_t *) b = iq_cu_quantize_q4_0(x, q);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int j = 2 * i;
            *(uint16_t *) (b + 2 + j) = (uint16_t) ((q[j] | q[j + 16] << 4) | (q[j + 1] | q[j + 17] << 4) << 8);
        }
    }
}

// ---- host side: calls f(std::integral_constant<int, T>) for the type T of a weight ----

#include <type_traits>

template <typename F>
static bool iq_cu_with_type(int type, F f) {
    switch (type) {
    case IQ_TYPE_F32: f(std::integral_constant<int, IQ_TYPE_F32>{}); return true;
    case IQ_TYPE_F16: f(std::integral_constant<int, IQ_TYPE_F16>{}); return true;
    case IQ_TYPE_BF16: f(std::integral_constant<int, IQ_TYPE_BF16>{}); return true;
    case IQ_TYPE_Q4_0: f(std::integral_constant<int, IQ_TYPE_Q4_0>{}); return true;
    case IQ_TYPE_Q4_1: f(std::integral_constant<int, IQ_TYPE_Q4_1>{}); return true;
    case IQ_TYPE_Q5_0: f(std::integral_constant<int, IQ_TYPE_Q5_0>{}); return true;
    case IQ_TYPE_Q5_1: f(std::integral_constant<int, IQ_TYPE_Q5_1>{}); return true;
    case IQ_TYPE_Q8_0: f(std::integral_constant<int, IQ_TYPE_Q8_0>{}); return true;
    case IQ_TYPE_Q2_K: f(std::integral_constant<int, IQ_TYPE_Q2_K>{}); return true;
    case IQ_TYPE_Q3_K: f(std::integral_constant<int, IQ_TYPE_Q3_K>{}); return true;
    case IQ_TYPE_Q4_K: f(std::integral_constant<int, IQ_TYPE_Q4_K>{}); return true;
    case IQ_TYPE_Q5_K: f(std::integral_constant<int, IQ_TYPE_Q5_K>{}); return true;
    case IQ_TYPE_Q6_K: f(std::integral_constant<int, IQ_TYPE_Q6_K>{}); return true;
    case IQ_TYPE_IQ4_NL: f(std::integral_constant<int, IQ_TYPE_IQ4_NL>{}); return true;
    case IQ_TYPE_IQ4_XS: f(std::integral_constant<int, IQ_TYPE_IQ4_XS>{}); return true;
    default: return false;
    }
}

// The plain cache types (iq-kv.h).
template <typename F>
static bool iq_cu_with_cache_type(int type, F f) {
    switch (type) {
    case IQ_TYPE_F32: f(std::integral_constant<int, IQ_TYPE_F32>{}); return true;
    case IQ_TYPE_F16: f(std::integral_constant<int, IQ_TYPE_F16>{}); return true;
    case IQ_TYPE_Q8_0: f(std::integral_constant<int, IQ_TYPE_Q8_0>{}); return true;
    case IQ_TYPE_Q4_0: f(std::integral_constant<int, IQ_TYPE_Q4_0>{}); return true;
    default: return false;
    }
}

// Row r of a tensor of up to 4 dimensions (rows are ne[0] elements).
struct iq_cu_rows {
    char * data;
    int64_t ne1, ne2;
    size_t nb1, nb2, nb3;
    bool even;  // nb2 = ne1 nb1 and nb3 = ne2 nb2: row r at r nb1
};

static inline iq_cu_rows iq_cu_rows_of(const struct iq_tensor * t) {
    const bool even = t->nb[2] == (size_t) t->ne[1] * t->nb[1] && t->nb[3] == (size_t) t->ne[2] * t->nb[2];
    return iq_cu_rows { (char *) t->data, t->ne[1], t->ne[2], t->nb[1], t->nb[2], t->nb[3], even };
}

// q = e / n, rem = e % n (e >= 0, n > 0) in 32 bits where both fit.
static __device__ __forceinline__ void iq_cu_divmod(int64_t e, int64_t n, int64_t & q, int64_t & rem) {
    if ((uint64_t) e <= 0xFFFFFFFFu && (uint64_t) n <= 0xFFFFFFFFu) {
        const uint32_t q32 = (uint32_t) e / (uint32_t) n;
        q = q32;
        rem = (uint32_t) e - q32 * (uint32_t) n;
    } else {
        q = e / n;
        rem = e % n;
    }
}

// Row r (r = i1 + ne1 (i2 + ne2 i3)). Evenly spaced rows need no division, and the others a
// 32-bit one where the indices fit (a 64-bit division is a long software sequence: several of
// them made a one-row kernel ~100 instructions per thread longer).
static __device__ __forceinline__ char * iq_cu_row(const iq_cu_rows & t, int64_t r) {
    if (t.even) {
        return t.data + (size_t) r * t.nb1;
    }
    if ((uint64_t) r <= 0xFFFFFFFFu && (uint64_t) (t.ne1 * t.ne2) <= 0xFFFFFFFFu) {
        const uint32_t n1 = (uint32_t) t.ne1, n2 = (uint32_t) t.ne2, q = (uint32_t) r / n1;
        return t.data + ((uint32_t) r - q * n1) * t.nb1 + (q % n2) * t.nb2 + (q / n2) * t.nb3;
    }
    return t.data + (r % t.ne1) * t.nb1 + (r / t.ne1 % t.ne2) * t.nb2 + (r / (t.ne1 * t.ne2)) * t.nb3;
}
