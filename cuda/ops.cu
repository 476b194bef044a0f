// Launches of the small ops (kernels in ops-kernels.cuh) and the checks every op shares.
#include "ops.h"

#include "ops-kernels.cuh"

#include <math.h>

int iq_cuda_launched(const char * what) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        iq_error_set("CUDA: %s: %s", what, cudaGetErrorString(e));
        return -1;
    }
    return 0;
}

bool iq_cuda_weight_type(enum iq_type type) {
    return iq_cu_with_type(type, [](auto) {});
}

static unsigned iq_cu_blocks(int64_t total, int threads) { return (unsigned) ((total + threads - 1) / threads); }

int iq_cuda_get_rows(const struct iq_cuda_ctx * c, struct iq_tensor * dst) {
    const struct iq_tensor * a = dst->src[0];
    const int64_t n_units = a->ne[0] / 32;
    iq_cu_with_type(a->type, [&](auto T) {
        iq_cu_get_rows<decltype(T)::value><<<(unsigned) dst->ne[1], 64, 0, c->stream>>>(
            (const uint8_t *) a->data, a->nb[1], a->ne[1], n_units, (const int32_t *) dst->src[1]->data,
            iq_cu_rows_of(dst), c->error);
    });
    return iq_cuda_launched("get_rows");
}

bool iq_cuda_rms_norm_fuses(const struct iq_tensor * norm, const struct iq_tensor * next) {
    if (next == NULL || next->op != IQ_OP_MUL || next->src[0] != norm) {
        return false;
    }
    const struct iq_tensor * w = next->src[1];
    return w->ne[0] == norm->ne[0] && iq_nrows(w) == 1;
}

int iq_cuda_norm_chain(const struct iq_cuda_ctx * c, const struct iq_cuda_chain * ch) {
    const struct iq_tensor * a = ch->add != NULL ? ch->add->src[0] : ch->norm->src[0];
    const struct iq_tensor * b = ch->add != NULL ? ch->add->src[1] : a;
    const struct iq_tensor * sum = ch->add != NULL ? ch->add : a;
    const struct iq_tensor * mul = ch->mul != NULL ? ch->mul : ch->norm;
    const int64_t n = a->ne[0], n4 = n / 4;
    const float * w = ch->mul != NULL ? (const float *) ch->mul->src[1]->data : nullptr;
    const int threads = (int) (n4 < 1024 ? (n4 + 31) / 32 * 32 : 1024);
    const int64_t nch = (n4 + threads - 1) / threads;
    bool vec = n % 4 == 0 && nch <= 4 && ((uintptr_t) w % 16) == 0;
    const struct iq_tensor * rows[] = { a, b, sum, ch->norm, mul };
    for (int i = 0; i < 5 && vec; i++) {
        vec = (uintptr_t) rows[i]->data % 16 == 0 && rows[i]->nb[1] % 16 == 0 && rows[i]->nb[2] % 16 == 0 &&
              rows[i]->nb[3] % 16 == 0;
    }
    if (vec) {
        const unsigned nr = (unsigned) iq_nrows(a);
        const float eps = iq_get_op_param_f32(ch->norm, 0);
        auto launch = [&](auto kern) {
            iq_cu_launch(c, kern, nr, threads, 0, iq_cu_rows_of(a), iq_cu_rows_of(b), iq_cu_rows_of(sum),
                         ch->add != NULL, iq_cu_rows_of(ch->norm), n, eps, w, iq_cu_rows_of(mul), ch->xq,
                         ch->mul != NULL && iq_cuda_is_const(ch->mul->src[1]));
        };
        if (nch == 1) {
            launch(iq_cu_norm_chain4<1>);
        } else if (nch == 2) {
            launch(iq_cu_norm_chain4<2>);
        } else {
            launch(iq_cu_norm_chain4<4>);
        }
        return iq_cuda_launched("rms_norm");
    }
    iq_cu_norm_chain<<<(unsigned) iq_nrows(a), 256, 0, c->stream>>>(
        iq_cu_rows_of(a), iq_cu_rows_of(b), iq_cu_rows_of(sum), ch->add != NULL, iq_cu_rows_of(ch->norm), a->ne[0],
        iq_get_op_param_f32(ch->norm, 0), ch->mul != NULL ? (const float *) ch->mul->src[1]->data : nullptr,
        iq_cu_rows_of(mul), ch->xq);
    return iq_cuda_launched("rms_norm");
}

int iq_cuda_binary(const struct iq_cuda_ctx * c, struct iq_tensor * dst) {
    const struct iq_tensor * a = dst->src[0], * b = dst->src[1];
    const int64_t total = iq_nelements(a);
    const unsigned blocks = iq_cu_blocks(total, 256);
    if (dst->op == IQ_OP_MUL) {
        iq_cu_binary<true><<<blocks, 256, 0, c->stream>>>(iq_cu_rows_of(a), iq_cu_rows_of(b), b->ne[3],
                                                          iq_cu_rows_of(dst), a->ne[0], total);
    } else {
        iq_cu_binary<false><<<blocks, 256, 0, c->stream>>>(iq_cu_rows_of(a), iq_cu_rows_of(b), b->ne[3],
                                                           iq_cu_rows_of(dst), a->ne[0], total);
    }
    return iq_cuda_launched(iq_op_name(dst->op));
}

int iq_cuda_swiglu(const struct iq_cuda_ctx * c, struct iq_tensor * dst) {
    const struct iq_tensor * g = dst->src[0];
    const int64_t total = iq_nelements(g);
    auto kern = dst->op == IQ_OP_GEGLU ? iq_cu_glu<true> : iq_cu_glu<false>;
    kern<<<iq_cu_blocks(total, 256), 256, 0, c->stream>>>(iq_cu_rows_of(g), iq_cu_rows_of(dst->src[1]),
                                                          iq_cu_rows_of(dst), g->ne[0], total);
    return iq_cuda_launched(iq_op_name(dst->op));
}

bool iq_cuda_swiglu_fuses_xq(const struct iq_cuda_ctx * c, const struct iq_tensor * dst) {
    const struct iq_tensor * t[] = { dst->src[0], dst->src[1], dst };
    if (dst->ne[0] % 32 != 0) {
        return false;
    }
    for (int i = 0; i < 3; i++) {
        if ((uintptr_t) t[i]->data % 16 != 0 || t[i]->nb[1] % 16 != 0 || t[i]->nb[2] % 16 != 0 || t[i]->nb[3] % 16 != 0) {
            return false;
        }
    }
    return true;
}

int iq_cuda_swiglu_xq(const struct iq_cuda_ctx * c, struct iq_tensor * dst, block_q8_1 * xq) {
    const struct iq_tensor * g = dst->src[0];
    const int64_t total4 = iq_nelements(g) / 4;
    iq_cu_launch(c, iq_cu_swiglu_q8, iq_cu_blocks(total4, 256), 256, 0, iq_cu_rows_of(g), iq_cu_rows_of(dst->src[1]),
                 iq_cu_rows_of(dst), g->ne[0], total4, xq);
    return iq_cuda_launched("swiglu");
}

// Rows of t start at 16-byte aligned addresses.
static bool iq_cuda_rows_aligned16(const struct iq_tensor * t) {
    return (uintptr_t) t->data % 16 == 0 && t->nb[1] % 16 == 0 && t->nb[2] % 16 == 0 && t->nb[3] % 16 == 0;
}

// Whether the product takes iq_cu_small_f32: an f32 W of at most IQ_SM_MAX_K x IQ_SM_MAX_K
// (the cache's rotation) with rows of 16-byte aligned float4s, x of f32 rows so aligned.
bool iq_cuda_mul_mat_small(const struct iq_tensor * dst) {
    const struct iq_tensor * w = dst->src[0], * x = dst->src[1];
    return w->type == IQ_TYPE_F32 && x->type == IQ_TYPE_F32 && dst->type == IQ_TYPE_F32 && w->ne[0] <= IQ_SM_MAX_K &&
           w->ne[0] % 4 == 0 && w->ne[1] <= IQ_SM_MAX_K && w->ne[2] == 1 && w->ne[3] == 1 &&
           w->nb[0] == sizeof(float) && w->nb[1] % 16 == 0 && ((uintptr_t) w->data & 15) == 0 &&
           x->nb[0] == sizeof(float) && dst->nb[0] == sizeof(float) && iq_cuda_rows_aligned16(x);
}

// Row r of a at the address of row r of b, for every r (or no byte in common): with one CTA
// per column tile, each reads its columns of b whole before it writes the same rows of a.
static bool iq_cuda_rows_overlay(const struct iq_tensor * a, const struct iq_tensor * b) {
    if (iq_cuda_tensors_apart(a, b)) {
        return true;
    }
    return a->data == b->data && a->ne[0] == b->ne[0] && a->ne[1] == b->ne[1] && a->ne[2] == b->ne[2] &&
           a->ne[3] == b->ne[3] && a->nb[1] == b->nb[1] && a->nb[2] == b->nb[2] && a->nb[3] == b->nb[3];
}

static float iq_cuda_rope_theta_scale(const struct iq_tensor * dst) {
    // the same powf as the CPU backend's, on the host
    return powf(iq_get_op_param_f32(dst, 1), -2.0f / (float) dst->op_params[0]);
}

// rope: NULL, or the ROPE whose rows are x (fused).
static int iq_cuda_small_launch(const struct iq_cuda_ctx * c, struct iq_tensor * mm, struct iq_tensor * rope) {
    const struct iq_tensor * w = mm->src[0];
    const struct iq_tensor * x = rope != NULL ? rope->src[0] : mm->src[1];
    const int64_t m = iq_nrows(x), n_rows = w->ne[1];
    if (m <= 0) {
        return 0;
    }
    const iq_cu_rows none = { nullptr, 1, 1, 0, 0, 0, true };
    // the graph may have put the product's output (or the rope's) over x: then one CTA per column
    // tile reads its columns whole before it writes
    const bool alone = !iq_cuda_tensors_apart(mm, x) || (rope != NULL && !iq_cuda_tensors_apart(rope, x));
    const bool u1 = w->ne[0] <= 128;
    const int tile = IQ_SM_WARPS * IQ_SM_RW / (u1 ? 1 : 2);
    const int cols = m <= 64 ? 2 : IQ_SM_COLS;
    const dim3 grid((unsigned) ((m + cols - 1) / cols), alone ? 1u : (unsigned) ((n_rows + tile - 1) / tile));
    auto launch = [&](auto kern) {
        iq_cu_launch(c, kern, grid, 32 * IQ_SM_WARPS, 0, (const float *) w->data, w->nb[1], (int) n_rows,
                     (int) w->ne[0], iq_cu_rows_of(x), (int) m, iq_cu_rows_of(mm),
                     rope != NULL ? iq_cu_rows_of(rope) : none,
                     rope != NULL ? (const int32_t *) rope->src[1]->data : nullptr,
                     rope != NULL && rope->src[2] != NULL ? (const float *) rope->src[2]->data : nullptr,
                     rope != NULL ? rope->op_params[0] : 0, rope != NULL ? iq_cuda_rope_theta_scale(rope) : 0.0f,
                     rope != NULL ? iq_get_op_param_f32(rope, 2) : 1.0f, iq_cuda_is_const(w));
    };
    if (rope != NULL) {
        if (cols == 2) {
            u1 ? launch(iq_cu_small_f32<true, 1, 2>) : launch(iq_cu_small_f32<true, 2, 2>);
        } else {
            u1 ? launch(iq_cu_small_f32<true, 1, IQ_SM_COLS>) : launch(iq_cu_small_f32<true, 2, IQ_SM_COLS>);
        }
        return iq_cuda_launched("rope + rotation");
    }
    if (cols == 2) {
        u1 ? launch(iq_cu_small_f32<false, 1, 2>) : launch(iq_cu_small_f32<false, 2, 2>);
    } else {
        u1 ? launch(iq_cu_small_f32<false, 1, IQ_SM_COLS>) : launch(iq_cu_small_f32<false, 2, IQ_SM_COLS>);
    }
    return iq_cuda_launched("mul_mat (small f32)");
}

int iq_cuda_mul_mat_small_f32(const struct iq_cuda_ctx * c, struct iq_tensor * dst) {
    return iq_cuda_small_launch(c, dst, NULL);
}

// ROPE then the small product that reads it, in one launch: W square with the rope's row
// length, the product's x the rope's rows as they are.
bool iq_cuda_rope_rot_fuses(const struct iq_tensor * rope, const struct iq_tensor * mm) {
    const struct iq_tensor * w = mm->src[0];
    return rope->op == IQ_OP_ROPE && mm->op == IQ_OP_MUL_MAT && mm->src[1] == rope && iq_cuda_mul_mat_small(mm) &&
           w->ne[0] == rope->ne[0] && w->ne[1] == rope->ne[0] && rope->type == IQ_TYPE_F32 &&
           rope->src[0]->type == IQ_TYPE_F32 && iq_nrows(mm) == iq_nrows(rope) &&
           rope->src[0]->nb[0] == sizeof(float) && rope->nb[0] == sizeof(float) && iq_cuda_rows_aligned16(rope->src[0]) &&
           iq_cuda_rows_aligned16(rope) && iq_cuda_rows_overlay(mm, rope->src[0]) && iq_cuda_rows_overlay(rope, rope->src[0]);
}

int iq_cuda_rope_rot(const struct iq_cuda_ctx * c, struct iq_tensor * rope, struct iq_tensor * mm) {
    return iq_cuda_small_launch(c, mm, rope);
}

// f32 rows of n elements at 16-byte aligned addresses, none over another's bytes but its own row
// of b's (iq_cuda_rows_overlay): one warp reads row r whole before it writes row r.
static bool iq_cuda_f32_rows_of(const struct iq_tensor * t, int64_t n, const struct iq_tensor * b) {
    return t->type == IQ_TYPE_F32 && t->ne[0] == n && t->nb[0] == sizeof(float) && iq_cuda_rows_aligned16(t) &&
           iq_cuda_rows_overlay(t, b);
}

bool iq_cuda_hadamard_fits(const struct iq_tensor * mm, const struct iq_tensor * rope) {
    const struct iq_tensor * w = mm->src[0], * x = rope != NULL ? rope->src[0] : mm->src[1];
    const int64_t d = w->ne[0];
    if (mm->op != IQ_OP_MUL_MAT || !(w->flags & IQ_FLAG_HADAMARD) || w->type != IQ_TYPE_F32 || w->ne[1] != d ||
        (d != 64 && d != 128 && d != 256) || w->nb[0] != sizeof(float) || ((uintptr_t) w->data & 15) != 0 ||
        !iq_cuda_f32_rows_of(x, d, x) || !iq_cuda_f32_rows_of(mm, d, x) || iq_nrows(mm) != iq_nrows(x)) {
        return false;
    }
    return rope == NULL || (rope->op == IQ_OP_ROPE && mm->src[1] == rope && iq_cuda_f32_rows_of(rope, d, x) &&
                            iq_cuda_rows_overlay(mm, rope));
}

bool iq_cuda_hadamard_fuses_xq(const struct iq_tensor * mm, const struct iq_tensor * next) {
    const struct iq_tensor * x = next->src[1];
    return next->op == IQ_OP_MUL_MAT && (mm->ne[0] == 64 || mm->ne[0] == 128) && x->data == mm->data &&
           x->type == IQ_TYPE_F32 && iq_nbytes(x) == iq_nbytes(mm) && iq_is_contiguous(x) && iq_is_contiguous(mm) &&
           iq_cuda_mul_mat_xq_size(next) > 0;
}

// The tensors a rotation reads (x) and writes (its output, the rope's if written): their count.
static int iq_cuda_hadamard_io(const struct iq_cuda_rot * r, const struct iq_tensor ** t) {
    t[0] = r->rope != NULL ? r->rope->src[0] : r->mm->src[1];
    t[1] = r->mm;
    t[2] = r->rope;
    return r->rope != NULL && r->rope_out ? 3 : 2;
}

bool iq_cuda_hadamard_joins(const struct iq_cuda_rot * parts, int n, const struct iq_cuda_rot * b) {
    if (n >= IQ_HAD_MAX_PARTS || b->mm->src[0] != parts[0].mm->src[0] || !iq_cuda_hadamard_fits(b->mm, b->rope)) {
        return false;
    }
    const struct iq_tensor * tb[3];
    const int nb = iq_cuda_hadamard_io(b, tb);
    for (int p = 0; p < n; p++) {
        const struct iq_tensor * ta[3];
        const int na = iq_cuda_hadamard_io(&parts[p], ta);
        for (int i = 0; i < na; i++) {
            for (int j = 0; j < nb; j++) {
                if ((i > 0 || j > 0) && !iq_cuda_tensors_apart(ta[i], tb[j])) {  // a write over the other's bytes
                    return false;
                }
            }
        }
    }
    return true;
}

int iq_cuda_hadamard(const struct iq_cuda_ctx * c, const struct iq_cuda_rot * parts, int n, block_q8_1 * xq) {
    const struct iq_tensor * w = parts[0].mm->src[0];
    const iq_cu_rows none = { nullptr, 1, 1, 0, 0, 0, true };
    iq_cu_had_parts hp = {};
    hp.n = n;
    for (int p = 0; p < n; p++) {
        const struct iq_tensor * r = parts[p].rope, * x = r != NULL ? r->src[0] : parts[p].mm->src[1];
        iq_cu_had_part & P = hp.p[p];
        P.x = iq_cu_rows_of(x), P.y = iq_cu_rows_of(parts[p].mm);
        P.rope = r != NULL && parts[p].rope_out ? iq_cu_rows_of(r) : none;
        P.m = iq_nrows(x);
        P.pos = r != NULL ? (const int32_t *) r->src[1]->data : nullptr;
        P.ff = r != NULL && r->src[2] != NULL ? (const float *) r->src[2]->data : nullptr;
        P.n_rot = r != NULL ? r->op_params[0] : 0;
        P.theta_scale = r != NULL ? iq_cuda_rope_theta_scale(r) : 0.0f;
        P.mscale = r != NULL ? iq_get_op_param_f32(r, 2) : 1.0f;
        hp.first[p + 1] = hp.first[p] + (unsigned) ((P.m + 3) / 4);
    }
    if (hp.first[n] == 0) {
        return 0;
    }
    auto launch = [&](auto kern) { iq_cu_launch(c, kern, hp.first[n], 128, 0, hp, (const float *) w->data, xq); };
    switch (w->ne[0]) {
    case 64: xq != NULL && n == 1 ? launch(iq_cu_hadamard<2, true>) : launch(iq_cu_hadamard<2, false>); break;
    case 256: launch(iq_cu_hadamard<8, false>); break;
    default: xq != NULL && n == 1 ? launch(iq_cu_hadamard<4, true>) : launch(iq_cu_hadamard<4, false>);
    }
    return iq_cuda_launched(parts[0].rope != NULL ? "rope + rotation (Hadamard)" : "rotation (Hadamard)");
}

int iq_cuda_rope(const struct iq_cuda_ctx * c, struct iq_tensor * dst) {
    const struct iq_tensor * a = dst->src[0];
    const int n_rot = dst->op_params[0];
    const float theta_scale = iq_cuda_rope_theta_scale(dst);
    const int64_t total = iq_nelements(a) / 2;
    iq_cu_rope<<<iq_cu_blocks(total, 256), 256, 0, c->stream>>>(
        iq_cu_rows_of(a), iq_cu_rows_of(dst), (const int32_t *) dst->src[1]->data,
        dst->src[2] != NULL ? (const float *) dst->src[2]->data : nullptr, a->ne[0], n_rot, theta_scale,
        iq_get_op_param_f32(dst, 2), total);
    return iq_cuda_launched("rope");
}
