// MUL_MAT launches: the matvec for up to IQ_MVQ_COLS columns (decoding steps read the quantized
// weights once; above IQ_MV_COLS the 32-element formats' sums are made on tensor cores,
// iq_cu_mvq), the tensor-core GEMM above that (prompts): the 32-element formats' blocks are turned
// into f16 tiles inside the GEMM (iq_cu_gemm_wq: W is read as stored, a quarter of its f16
// copy's bytes; neighbouring products of one x, q, k, v and gate, up, in one launch as the
// matvec's: an 8B model's k and v alone were 32 blocks each, 137 us apiece of a 512-token
// prompt's layer on an H100, q, k and v together 138 us), the other types are dequantized to
// f16 once per product (a pass at memory speed) and multiplied by iq_cu_gemm_f16_async.
#include "ops.h"

#include "mul-mat-kernels.cuh"

static bool mv_q32(const struct iq_tensor * w) {
    return w->type == IQ_TYPE_Q4_0 || w->type == IQ_TYPE_Q4_1 || w->type == IQ_TYPE_Q5_0 || w->type == IQ_TYPE_Q5_1 ||
           w->type == IQ_TYPE_Q8_0;
}

// G of iq_cu_matvec_g for W: 4 or 2 blocks of a row per lane step (whole 8-byte / 4-byte
// words of its rows), 0 where the rows do not allow it.
static int mv_g(const struct iq_tensor * w) {
    const int64_t n_units = w->ne[0] / 32;
    const uintptr_t wd = (uintptr_t) w->data;
    return w->ne[0] % 32 != 0                                         ? 0
         : n_units % 4 == 0 && wd % 8 == 0 && w->nb[1] % 8 == 0 ? 4
         : n_units % 2 == 0 && wd % 4 == 0 && w->nb[1] % 4 == 0 ? 2
                                                                      : 0;
}

// Whether the matvec takes the product: up to IQ_MVQ_COLS columns of x (of a 32-element format:
// iq_cu_mvq above IQ_MV_COLS), the same sums for a column at any width, so that a decoding
// sequence gets the same bits in a step of any size up to IQ_MVQ_COLS tokens; the GEMM above.
static bool mv_takes(const struct iq_tensor * dst) {
    const int64_t m = iq_nrows(dst->src[1]);
    return m <= IQ_MV_COLS || (m <= IQ_MVQ_COLS && (!mv_q32(dst->src[0]) || mv_g(dst->src[0]) != 0));
}

// The q8_1 copy's bytes, then (products of more than IQ_MV_COLS columns) its tiles 16-byte aligned.
static size_t mv_xt_offset(int64_t n_units, int64_t m) {
    return ((size_t) n_units * (size_t) m * sizeof(block_q8_1) + 15) / 16 * 16;
}

size_t iq_cuda_xq_size(int64_t k, int64_t m) {
    const int64_t n_units = k / 32;
    return m > IQ_MVQ_COLS || k % 32 != 0 ? 0
         : m > IQ_MV_COLS                 ? mv_xt_offset(n_units, m) + iq_cu_xt_size(n_units, m)
                                          : (size_t) n_units * (size_t) m * sizeof(block_q8_1);
}

size_t iq_cuda_mul_mat_xq_size(const struct iq_tensor * dst) {
    const struct iq_tensor * w = dst->src[0];
    return mv_q32(w) && mv_takes(dst) ? iq_cuda_xq_size(w->ne[0], iq_nrows(dst->src[1])) : 0;
}

bool iq_cuda_has_kernels_for_device(void) {
    cudaFuncAttributes a;
    const bool ok = cudaFuncGetAttributes(&a, iq_cu_quantize_x8) == cudaSuccess;
    cudaGetLastError();  // (a device this build has no code for: no sticky error)
    return ok;
}

bool iq_cuda_mul_mat_tiles(const struct iq_tensor * dst) {
    const int64_t m = iq_nrows(dst->src[1]);
    return m > IQ_MV_COLS && m <= IQ_MVQ_COLS && mv_q32(dst->src[0]) && mv_g(dst->src[0]) != 0 &&
           !iq_cuda_mul_mat_small(dst);
}

// Whether the GEMM reads W as it is stored (iq_cu_gemm_wq): a 32-element format whose rows are
// whole 4-byte words of pairs of blocks; the others multiply an f16 copy of W.
static bool gemm_wq_takes(const struct iq_tensor * w) {
    return mv_q32(w) && mv_g(w) != 0 && !iq_cuda_variants.gemm_w16;
}

// The parts of the products dst[0 .. n) of one x: each one's W, rows and y, and its first block
// of the grid, a block taking rows_per rows.
static iq_cu_mv_parts parts_of(struct iq_tensor * const * dst, int n, int64_t rows_per) {
    iq_cu_mv_parts parts = {};
    parts.n = n;
    for (int p = 0; p < n; p++) {
        const struct iq_tensor * wp = dst[p]->src[0];
        parts.w[p] = (const uint8_t *) wp->data;
        parts.w_nb1[p] = wp->nb[1];
        parts.n_rows[p] = wp->ne[1];
        parts.y[p] = (float *) dst[p]->data;
        parts.y_nb1[p] = dst[p]->nb[1];
        parts.first[p + 1] = parts.first[p] + (unsigned) ((wp->ne[1] + rows_per - 1) / rows_per);
    }
    return parts;
}

// The GEMM on W's blocks (gemm_wq_takes) of the products dst[0 .. n) of one x, in one launch:
// x to f16 in the scratch, then iq_cu_gemm_wq over the parts' row tiles.
static int gemm_wq_launch(const struct iq_cuda_ctx * c, struct iq_tensor * const * dst, int n) {
    const struct iq_tensor * w = dst[0]->src[0], * x = dst[0]->src[1];
    const int64_t n_units = w->ne[0] / 32, m = iq_nrows(x);
    using C = iq_cu_gemm_wq_shipped;
    const iq_cu_mv_parts parts = parts_of(dst, n, C::BN);
    int dev = 0;
    cudaGetDevice(&dev);
    half * xh = (half *) c->work;
    const int64_t nx = m * n_units;
    const dim3 grid((unsigned) ((m + C::BM - 1) / C::BM), parts.first[n]);
    iq_cu_with_type(w->type, [&](auto T) {
        constexpr int t = decltype(T)::value;
        if constexpr (iq_cu_is_q32<t>) {
            // once per device and kernel, outside graph capture: the first run of a graph is never captured
            static bool smem_set[64];
            if (dev < 64 && !smem_set[dev]) {
                cudaFuncSetAttribute(iq_cu_gemm_wq<t, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, iq_cu_gq_smem<t, C>);
                smem_set[dev] = true;
            }
            iq_cu_x_to_f16<true><<<(unsigned) ((nx + 127) / 128), 128, 0, c->stream>>>((const float *) x->data, x->nb[1],
                                                                                       m, n_units, xh);
            iq_cu_gemm_wq<t, C><<<grid, C::threads, iq_cu_gq_smem<t, C>, c->stream>>>(parts, xh, m, n_units * 32);
        }
    });
    return iq_cuda_launched(n > 1 ? "mul_mat (gemm, grouped)" : "mul_mat (gemm)");
}

bool iq_cuda_mul_mat_gemm_wq(const struct iq_tensor * dst) {
    return !iq_cuda_mul_mat_small(dst) && !mv_takes(dst) && gemm_wq_takes(dst->src[0]);
}

// Scratch of the GEMM: the f16 copies of W (where iq_cu_gemm_wq does not take it) and x (none
// for the small f32 product, ops.cu).
size_t iq_cuda_mul_mat_work_size(const struct iq_tensor * dst) {
    const struct iq_tensor * w = dst->src[0];
    const int64_t m = iq_nrows(dst->src[1]);
    const int64_t rows = (gemm_wq_takes(w) ? 0 : w->ne[1]) + m;
    return !mv_takes(dst) && !iq_cuda_mul_mat_small(dst) ? (size_t) rows * (size_t) w->ne[0] * sizeof(half) : 0;
}

// x (m columns of k = 32 n_units) -> its q8_1 copy c->xq.
static int mv_quantize_x(const struct iq_cuda_ctx * c, const struct iq_tensor * x) {
    const float * xd = (const float *) x->data;
    const int64_t n_units = x->ne[0] / 32, m = iq_nrows(x), n = n_units * m;
    if ((uintptr_t) xd % 16 == 0 && x->nb[1] % 16 == 0) {
        iq_cu_launch(c, iq_cu_quantize_x8, (unsigned) ((8 * n + 255) / 256), 256, 0, xd, x->nb[1], n_units, m, c->xq);
    } else {
        iq_cu_quantize_x<<<(unsigned) ((n + 127) / 128), 128, 0, c->stream>>>(xd, x->nb[1], n_units, m, c->xq);
    }
    return iq_cuda_launched("mul_mat (x to q8)");
}

// Whether the product takes iq_cu_matvec_s: one column of x, a 32-element format whose rows
// are whole 8-byte words of groups of 4 blocks, x's blocks and a segment per warp within 48 KiB.
static bool mv_s_takes(const struct iq_cuda_ctx * c, const struct iq_tensor * dst) {
    const struct iq_tensor * w = dst->src[0];
    const int64_t n_units = w->ne[0] / 32;
    if (iq_nrows(dst->src[1]) != 1 || iq_cuda_mul_mat_xq_size(dst) == 0 || n_units % 4 != 0 ||
        (uintptr_t) w->data % 8 != 0 || w->nb[1] % 8 != 0) {
        return false;
    }
    bool ok = false;
    iq_cu_with_type(w->type, [&](auto T) {
        constexpr int t = decltype(T)::value;
        if constexpr (iq_cu_is_q32<t>) {
            ok = iq_cu_matvec_s_smem(n_units, iq_cu_q32_bytes<t>) <= 48 * 1024;
        }
    });
    return ok;
}

// The products parts (of one x, m columns, a 32-element format T, G blocks per lane step) on
// tensor cores (iq_cu_mvq): x's tiles made first unless c->xt_ready (its q8_1 copy is made).
template <int T>
static void mv_mvq(const struct iq_cuda_ctx * c, iq_cu_mv_parts & parts, int64_t n_units, int64_t m, int g) {
    uint8_t * xt = (uint8_t *) c->xq + mv_xt_offset(n_units, m);
    if (!c->xt_ready) {
        const int64_t words = (m + 7) / 8 * 8 * n_units * 8;
        iq_cu_xq_tiles<<<(unsigned) ((words + 255) / 256), 256, 0, c->stream>>>(c->xq, n_units, m, xt);
    }
    auto launch = [&](auto G, auto NT) {
        constexpr int gv = decltype(G)::value, nt = decltype(NT)::value, rt = IQ_MVQ_RT;
        const unsigned n_ct = (unsigned) ((m + 8 * nt - 1) / (8 * nt));
        for (int p = 0; p < parts.n; p++) {
            parts.first[p + 1] = parts.first[p] + (unsigned) ((parts.n_rows[p] + 16 * rt - 1) / (16 * rt)) * n_ct;
        }
        constexpr size_t smem = iq_cu_mvq_smem<T, gv, rt, nt>();
        if constexpr (smem > 48 * 1024) {  // once per device, outside graph capture
            static bool smem_set[64];
            int dev = 0;
            cudaGetDevice(&dev);
            if (dev < 64 && !smem_set[dev]) {
                cudaFuncSetAttribute(iq_cu_mvq<T, gv, rt, nt>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem);
                smem_set[dev] = true;
            }
        }
        iq_cu_mvq<T, gv, rt, nt><<<parts.first[parts.n], 32 * IQ_MVQ_WARPS, smem, c->stream>>>(parts, n_units, xt,
                                                                                            (int) m, n_ct);
    };
    // x shared by the row tiles of a block (iq_cu_mvq_tile), unless a test asks for iq_cu_mvq
    auto launch_tile = [&](auto G, auto NT) {
        constexpr int gv = decltype(G)::value, nt = decltype(NT)::value, wr = IQ_MVT_WR, ws = IQ_MVT_WS;
        using L = iq_cu_mvt_smem<T, gv, nt, wr, ws>;
        const unsigned n_ct = (unsigned) ((m + L::NC - 1) / L::NC);
        for (int p = 0; p < parts.n; p++) {
            parts.first[p + 1] = parts.first[p] + (unsigned) ((parts.n_rows[p] + L::NR - 1) / L::NR) * n_ct;
        }
        if constexpr (L::total > 48 * 1024) {  // once per device, outside graph capture
            static bool smem_set[64];
            int dev = 0;
            cudaGetDevice(&dev);
            if (dev < 64 && !smem_set[dev]) {
                cudaFuncSetAttribute(iq_cu_mvq_tile<T, gv, nt, wr, ws>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     L::total);
                smem_set[dev] = true;
            }
        }
        iq_cu_mvq_tile<T, gv, nt, wr, ws><<<parts.first[parts.n], 32 * wr * ws, L::total, c->stream>>>(
            parts, n_units, xt, (int) m, n_ct);
    };
    using g2 = std::integral_constant<int, 2>;
    using g4 = std::integral_constant<int, 4>;
    using ntmax = std::integral_constant<int, IQ_MVQ_NT>;
#ifdef IQ_MVQ_WARP_SLOTS_DEFAULT  // (a build for comparisons)
    const bool warp_slots = true;
#else
    const bool warp_slots = iq_cuda_variants.mvq == IQ_MVQ_WARP_SLOTS;
#endif
    if (warp_slots) {
        if (m <= 16) {
            g == 4 ? launch(g4(), g2()) : launch(g2(), g2());
        } else {
            g == 4 ? launch(g4(), ntmax()) : launch(g2(), ntmax());
        }
    } else if (m <= 16) {
        g == 4 ? launch_tile(g4(), g2()) : launch_tile(g2(), g2());
    } else {
        using nt = std::integral_constant<int, IQ_MVT_NT>;
        g == 4 ? launch_tile(g4(), nt()) : launch_tile(g2(), nt());
    }
}

// Whether the product takes iq_cu_matvec_g: up to IQ_MV_COLS columns of x in q8_1, a 32-element
// format whose rows are whole words of G blocks (G = mv_g), and not iq_cu_matvec_s.
static bool mv_g_takes(const struct iq_cuda_ctx * c, const struct iq_tensor * dst) {
    return iq_nrows(dst->src[1]) <= IQ_MV_COLS && iq_cuda_mul_mat_xq_size(dst) > 0 && mv_g(dst->src[0]) != 0 &&
           !mv_s_takes(c, dst);
}

// The products parts (of one x in q8_1 at c->xq, m <= IQ_MV_COLS columns, a 32-element format T,
// G blocks per lane step) on iq_cu_matvec_g.
template <int T>
static void mv_g_launch(const struct iq_cuda_ctx * c, const iq_cu_mv_parts & parts, int64_t n_units, int64_t m, int g,
                        bool w_const) {
    const block_q8_1 * xq = c->xq;
    auto launch = [&](auto kern) {
        iq_cu_launch(c, kern, parts.first[parts.n], 32 * IQ_MVG_WARPS, 0, parts, n_units, xq, (int) m, w_const);
    };
    if (m == 1) {
        g == 4 ? launch(iq_cu_matvec_g<T, 1, 4>) : launch(iq_cu_matvec_g<T, 1, 2>);
    } else {
        g == 4 ? launch(iq_cu_matvec_g<T, IQ_MV_COLS, 4>) : launch(iq_cu_matvec_g<T, IQ_MV_COLS, 2>);
    }
}

bool iq_cuda_mul_mat_joins(const struct iq_cuda_ctx * c, const struct iq_tensor * a, const struct iq_tensor * b) {
    const struct iq_tensor * x = a->src[1], * y = b->src[1];
    return a->op == IQ_OP_MUL_MAT && b->op == IQ_OP_MUL_MAT && !iq_cuda_mul_mat_small(a) && !iq_cuda_mul_mat_small(b) &&
           ((mv_s_takes(c, a) && mv_s_takes(c, b)) || (iq_cuda_mul_mat_gemm_wq(a) && iq_cuda_mul_mat_gemm_wq(b)) ||
            (mv_g_takes(c, a) && mv_g_takes(c, b) && mv_g(a->src[0]) == mv_g(b->src[0])) ||
            (iq_cuda_mul_mat_tiles(a) && iq_cuda_mul_mat_tiles(b) && mv_g(a->src[0]) == mv_g(b->src[0]))) &&
           a->src[0]->type == b->src[0]->type &&
           a->src[0]->ne[0] == b->src[0]->ne[0] && x->data == y->data && x->ne[0] == y->ne[0] &&
           iq_nrows(x) == iq_nrows(y) && iq_cuda_tensors_apart(a, b) && iq_cuda_tensors_apart(a, x) &&
           iq_cuda_tensors_apart(b, x);
}

// The products dst[0 .. n) of one x in one launch (iq_cuda_mul_mat_joins of each pair).
int iq_cuda_mul_mat_group(const struct iq_cuda_ctx * c, struct iq_tensor * const * dst, int n) {
    const struct iq_tensor * w = dst[0]->src[0], * x = dst[0]->src[1];
    const int64_t n_units = w->ne[0] / 32;
    if (n < 1 || n > IQ_MV_MAX_PARTS) {
        iq_error_set("mul_mat: %d products in one launch", n);
        return -1;
    }
    if (iq_cuda_mul_mat_gemm_wq(dst[0])) {  // iq_cuda_mul_mat_joins: each of them
        return gemm_wq_launch(c, dst, n);
    }
    if (!c->xq_ready && mv_quantize_x(c, x) != 0) {
        return -1;
    }
    iq_cu_mv_parts parts = parts_of(dst, n, IQ_MVG_WARPS * IQ_MVS_ROWS);
    bool w_const = true;
    for (int p = 0; p < n; p++) {
        w_const = w_const && iq_cuda_is_const(dst[p]->src[0]);
    }
    const int64_t m = iq_nrows(x);
    iq_cu_with_type(w->type, [&](auto T) {
        constexpr int t = decltype(T)::value;
        if constexpr (iq_cu_is_q32<t>) {
            if (m > IQ_MV_COLS) {  // iq_cuda_mul_mat_tiles of each (the joins)
                mv_mvq<t>(c, parts, n_units, m, mv_g(w));
                return;
            }
            if (!mv_s_takes(c, dst[0])) {  // mv_g_takes of each
                mv_g_launch<t>(c, parts, n_units, m, mv_g(w), w_const);
                return;
            }
            iq_cu_launch(c, iq_cu_matvec_s<t>, parts.first[n], 32 * IQ_MVG_WARPS,
                         iq_cu_matvec_s_smem(n_units, iq_cu_q32_bytes<t>), parts, n_units, (const block_q8_1 *) c->xq,
                         w_const);
        }
    });
    return iq_cuda_launched(n > 1 ? "mul_mat (matvec, grouped)" : "mul_mat (matvec)");
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
    if (mv_takes(dst)) {
        const block_q8_1 * xq = c->xq;
        if (iq_cuda_mul_mat_xq_size(dst) > 0 && !c->xq_ready && mv_quantize_x(c, x) != 0) {
            return -1;
        }
        const unsigned blocks = (unsigned) ((n_rows + IQ_MV_ROWS - 1) / IQ_MV_ROWS);
        // G blocks of a row per lane step: whole 8-byte (G = 4) or 4-byte words of W
        const int g = m > IQ_MV_COLS || iq_cuda_mul_mat_xq_size(dst) > 0 ? mv_g(w) : 0;
        static_assert(IQ_MVS_ROWS == IQ_MVG_ROWS, "one grid for both");
        const unsigned gblocks = (unsigned) ((n_rows + IQ_MVG_WARPS * IQ_MVG_ROWS - 1) / (IQ_MVG_WARPS * IQ_MVG_ROWS));
        iq_cu_with_type(w->type, [&](auto T) {
            constexpr int t = decltype(T)::value;
            if constexpr (iq_cu_is_q32<t>) {
                if (mv_s_takes(c, dst)) {
                    iq_cu_mv_parts parts = {};
                    parts.n = 1;
                    parts.w[0] = wd, parts.w_nb1[0] = w->nb[1], parts.n_rows[0] = n_rows, parts.y[0] = yd;
                    parts.first[1] = gblocks;
                    iq_cu_launch(c, iq_cu_matvec_s<t>, gblocks, 32 * IQ_MVG_WARPS,
                                 iq_cu_matvec_s_smem(n_units, iq_cu_q32_bytes<t>), parts, n_units, xq,
                                 iq_cuda_is_const(w));
                    return;
                }
                if (g != 0 && m > IQ_MV_COLS) {
                    iq_cu_mv_parts parts = {};
                    parts.n = 1;
                    parts.w[0] = wd, parts.w_nb1[0] = w->nb[1], parts.n_rows[0] = n_rows, parts.y[0] = yd;
                    parts.y_nb1[0] = dst->nb[1];
                    mv_mvq<t>(c, parts, n_units, m, g);
                    return;
                }
                if (g != 0) {
                    iq_cu_mv_parts parts = {};
                    parts.n = 1;
                    parts.w[0] = wd, parts.w_nb1[0] = w->nb[1], parts.n_rows[0] = n_rows, parts.y[0] = yd;
                    parts.y_nb1[0] = dst->nb[1];
                    parts.first[1] = gblocks;
                    mv_g_launch<t>(c, parts, n_units, m, g, iq_cuda_is_const(w));
                    return;
                }
            }
            const block_q8_1 * xq8 = iq_cu_is_q32<t> ? xq : nullptr;
            if (m == 1) {
                iq_cu_matvec<t, 1><<<blocks, IQ_MV_THREADS, 0, c->stream>>>(wd, w->nb[1], n_rows, n_units, xd,
                                                                           x->nb[1], xq8, yd, dst->nb[1], 1, 1);
            } else {
                const unsigned n_ct = (unsigned) ((m + IQ_MV_COLS - 1) / IQ_MV_COLS);
                iq_cu_matvec<t, IQ_MV_COLS><<<blocks * n_ct, IQ_MV_THREADS, 0, c->stream>>>(
                    wd, w->nb[1], n_rows, n_units, xd, x->nb[1], xq8, yd, dst->nb[1], (int) m, n_ct);
            }
        });
        return iq_cuda_launched("mul_mat (matvec)");
    }
    // once per device and kernel, outside graph capture: the first run of a graph is never captured
    int dev = 0;
    cudaGetDevice(&dev);
    const bool wq = gemm_wq_takes(w);
    if (wq) {
        struct iq_tensor * one[1] = { dst };
        return gemm_wq_launch(c, one, 1);
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
    using C = iq_cu_gemm_shipped;
    const dim3 grid((unsigned) ((m + C::BM - 1) / C::BM), (unsigned) ((n_rows + C::BN - 1) / C::BN));
    static bool smem_set[64];
    if (dev < 64 && !smem_set[dev]) {
        cudaFuncSetAttribute(iq_cu_gemm_f16_async<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::smem);
        smem_set[dev] = true;
    }
    iq_cu_gemm_f16_async<C><<<grid, C::threads, C::smem, c->stream>>>(wh, xh, n_rows, m, n_units * 32, yd, dst->nb[1]);
    return iq_cuda_launched("mul_mat (gemm)");
}
