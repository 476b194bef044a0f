// MUL_MAT launches: the matvec for up to IQ_MV_COLS columns (decoding reads the quantized
// weights once per token), the tensor-core GEMM above that (prompts): W is dequantized to f16
// once per product (a pass at memory speed), so the GEMM's loop is copies and MMAs only,
// instead of dequantizing every tile again for each block of columns.
#include "ops.h"

#include "mul-mat-kernels.cuh"

size_t iq_cuda_xq_size(int64_t k, int64_t m) {
    return m <= IQ_MV_COLS && k % 32 == 0 ? (size_t) (k / 32) * (size_t) m * sizeof(block_q8_1) : 0;
}

size_t iq_cuda_mul_mat_xq_size(const struct iq_tensor * dst) {
    const struct iq_tensor * w = dst->src[0];
    const bool q8 = w->type == IQ_TYPE_Q4_0 || w->type == IQ_TYPE_Q4_1 || w->type == IQ_TYPE_Q5_0 ||
                    w->type == IQ_TYPE_Q5_1 || w->type == IQ_TYPE_Q8_0;
    return q8 ? iq_cuda_xq_size(w->ne[0], iq_nrows(dst->src[1])) : 0;
}

// Scratch of the GEMM: the f16 copies of W and x (none for the small f32 product, ops.cu).
size_t iq_cuda_mul_mat_work_size(const struct iq_tensor * dst) {
    const struct iq_tensor * w = dst->src[0];
    const int64_t m = iq_nrows(dst->src[1]);
    return m > IQ_MV_COLS && !iq_cuda_mul_mat_small(dst) ? (size_t) (w->ne[1] + m) * (size_t) w->ne[0] * sizeof(half)
                                                         : 0;
}

int iq_cuda_mul_mat(const struct iq_cuda_ctx * c, struct iq_tensor * dst) {
    const struct iq_tensor * w = dst->src[0], * x = dst->src[1];
    const int64_t n_rows = w->ne[1], n_units = w->ne[0] / 32, m = iq_nrows(x);
    const uint8_t * wd = (const uint8_t *) w->data;
    const float * xd = (const float *) x->data;
    float * yd = (float *) dst->data;
    if (iq_cuda_mul_mat_small(dst)) {
        return iq_cuda_mul_mat_small_f32(c, dst);
    }
    if (m <= IQ_MV_COLS) {
        const block_q8_1 * xq = c->xq;
        if (iq_cuda_mul_mat_xq_size(dst) > 0 && !c->xq_ready) {
            const int64_t n = n_units * m;
            if (!(c->opts & IQ_CUDA_OLD_NORM) && (uintptr_t) xd % 16 == 0 && x->nb[1] % 16 == 0) {
                iq_cu_launch(c, iq_cu_quantize_x8, (unsigned) ((8 * n + 255) / 256), 256, 0, xd, x->nb[1], n_units, m,
                             c->xq);
            } else {
                iq_cu_quantize_x<<<(unsigned) ((n + 127) / 128), 128, 0, c->stream>>>(xd, x->nb[1], n_units, m, c->xq);
            }
            if (iq_cuda_launched("mul_mat (x to q8)") != 0) {
                return -1;
            }
        }
        const unsigned blocks = (unsigned) ((n_rows + IQ_MV_ROWS - 1) / IQ_MV_ROWS);
        // G blocks of a row per lane step: whole 8-byte (G = 4) or 4-byte words of W
        const int g = c->opts & IQ_CUDA_OLD_MATVEC || iq_cuda_mul_mat_xq_size(dst) == 0 ? 0
                    : n_units % 4 == 0 && (uintptr_t) wd % 8 == 0 && w->nb[1] % 8 == 0 ? 4
                    : n_units % 2 == 0 && (uintptr_t) wd % 4 == 0 && w->nb[1] % 4 == 0 ? 2 : 0;
        static_assert(IQ_MVS_ROWS == IQ_MVG_ROWS, "one grid for both");
        const unsigned gblocks = (unsigned) ((n_rows + IQ_MVG_WARPS * IQ_MVG_ROWS - 1) / (IQ_MVG_WARPS * IQ_MVG_ROWS));
        iq_cu_with_type(w->type, [&](auto T) {
            constexpr int t = decltype(T)::value;
            if constexpr (iq_cu_is_q32<t>) {
                const size_t smem = iq_cu_matvec_s_smem(n_units, iq_cu_q32_bytes<t>);
                if (g == 4 && m == 1 && !(c->opts & IQ_CUDA_MATVEC_G) && smem <= 48 * 1024) {
                    iq_cu_launch(c, iq_cu_matvec_s<t>, gblocks, 32 * IQ_MVG_WARPS, smem, wd, w->nb[1], n_rows, n_units,
                                 xq, yd, iq_cuda_is_const(w));
                    return;
                }
                if (g != 0) {
                    auto launch = [&](auto kern) {
                        kern<<<gblocks, 32 * IQ_MVG_WARPS, 0, c->stream>>>(wd, w->nb[1], n_rows, n_units, xq, yd,
                                                                           dst->nb[1], (int) m);
                    };
                    if (m == 1) {
                        g == 4 ? launch(iq_cu_matvec_g<t, 1, 4>) : launch(iq_cu_matvec_g<t, 1, 2>);
                    } else {
                        g == 4 ? launch(iq_cu_matvec_g<t, IQ_MV_COLS, 4>) : launch(iq_cu_matvec_g<t, IQ_MV_COLS, 2>);
                    }
                    return;
                }
            }
            if (m == 1) {
                iq_cu_matvec<t, 1><<<blocks, IQ_MV_THREADS, 0, c->stream>>>(wd, w->nb[1], n_rows, n_units, xd,
                                                                           x->nb[1], xq, yd, dst->nb[1], 1);
            } else {
                iq_cu_matvec<t, IQ_MV_COLS><<<blocks, IQ_MV_THREADS, 0, c->stream>>>(
                    wd, w->nb[1], n_rows, n_units, xd, x->nb[1], xq, yd, dst->nb[1], (int) m);
            }
        });
        return iq_cuda_launched("mul_mat (matvec)");
    }
    // W and x to f16 in the scratch (W first), then the tensor-core GEMM
    half * wh = (half *) c->work;
    half * xh = wh + n_rows * n_units * 32;
    const int64_t nw = n_rows * n_units, nx = m * n_units;
    iq_cu_with_type(w->type, [&](auto T) {
        constexpr int t = decltype(T)::value;
        iq_cu_w_to_f16<t><<<(unsigned) ((nw + 127) / 128), 128, 0, c->stream>>>(wd, w->nb[1], n_rows, n_units, wh);
        iq_cu_x_to_f16<iq_cu_is_q32<t>><<<(unsigned) ((nx + 127) / 128), 128, 0, c->stream>>>(xd, x->nb[1], m,
                                                                                              n_units, xh);
    });
    // the column tiles of a tile of W next to each other in launch order: W is read from memory
    // about once, the other blocks find it in L2
    const dim3 grid((unsigned) ((m + IQ_GM_BM - 1) / IQ_GM_BM), (unsigned) ((n_rows + IQ_GM_BN - 1) / IQ_GM_BN));
    if (c->opts & IQ_CUDA_OLD_GEMM) {
        iq_cu_gemm_f16<<<grid, 256, 0, c->stream>>>(wh, xh, n_rows, m, n_units * 32, yd, dst->nb[1]);
    } else {
        // once per device, outside graph capture: the first run of a graph is never captured
        static bool smem_set[64];
        int dev = 0;
        cudaGetDevice(&dev);
        if (dev < 64 && !smem_set[dev]) {
            cudaFuncSetAttribute(iq_cu_gemm_f16_async, cudaFuncAttributeMaxDynamicSharedMemorySize, iq_cu_gemm_async_smem);
            smem_set[dev] = true;
        }
        iq_cu_gemm_f16_async<<<grid, 256, iq_cu_gemm_async_smem, c->stream>>>(wh, xh, n_rows, m, n_units * 32, yd,
                                                                              dst->nb[1]);
    }
    return iq_cuda_launched("mul_mat (gemm)");
}
