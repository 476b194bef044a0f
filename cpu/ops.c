// The CPU op table and the small ops: get_rows, rms_norm, mul, add, swiglu / geglu, rope.
// Each splits its rows evenly over the threads (they are too cheap for a work counter).
#include "ops.h"

#include "vec.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>

void iq_cpu_fail(const struct iq_cpu_params * p, const char * fmt, ...) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&p->status->failed, &expected, 1)) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(p->status->msg, sizeof(p->status->msg), fmt, ap);
        va_end(ap);
    }
}

iq_to_float_fn iq_cpu_to_float(enum iq_type type) {
    const struct iq_cpu_type_traits * ct = iq_cpu_traits(type);
    if (ct != NULL && ct->to_float != NULL) {
        return ct->to_float;
    }
    const struct iq_type_traits * tt = iq_type_traits_get(type);
    return tt != NULL ? tt->to_float : NULL;
}

// dst[:, i] = f32(src0[:, ids[i]]): one output row per item.
static void cpu_get_rows(const struct iq_cpu_params * p, struct iq_tensor * dst) {
    const struct iq_tensor * a = dst->src[0];
    const int32_t * ids = dst->src[1]->data;
    const iq_to_float_fn to_float = iq_cpu_to_float(a->type);
    int64_t r0, r1;
    iq_cpu_split(dst->ne[1], p->ith, p->nth, &r0, &r1);
    for (int64_t i = r0; i < r1; i++) {
        float * y = (float *) iq_cpu_row(dst, i);
        if (ids[i] < 0 || ids[i] >= a->ne[1]) {
            iq_cpu_fail(p, "get_rows: row id %d outside [0, %lld) of '%s'", ids[i], (long long) a->ne[1], a->name);
            memset(y, 0, (size_t) dst->ne[0] * sizeof(float));
            continue;
        }
        to_float((const char *) a->data + ids[i] * a->nb[1], y, a->ne[0]);
    }
}

static bool cpu_get_rows_supports(const struct iq_tensor * dst) {
    if (iq_cpu_to_float(dst->src[0]->type) == NULL) {
        iq_error_set("get_rows: no f32 conversion of %s", iq_type_name(dst->src[0]->type));
        return false;
    }
    return true;
}

// Per row: y = x / sqrt(mean(x^2) + eps), the sum of squares taken in double as ggml does.
static void cpu_rms_norm(const struct iq_cpu_params * p, struct iq_tensor * dst) {
    const struct iq_tensor * a = dst->src[0];
    const float eps = iq_get_op_param_f32(dst, 0);
    const int64_t n = a->ne[0];
    int64_t r0, r1;
    iq_cpu_split(iq_nrows(a), p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const float * x = (const float *) iq_cpu_row(a, r);
        float * y = (float *) iq_cpu_row(dst, r);
        double sum = 0.0;
        for (int64_t i = 0; i < n; i++) {
            sum += (double) x[i] * x[i];
        }
        const float scale = 1.0f / sqrtf((float) (sum / n) + eps);
        for (int64_t i = 0; i < n; i++) {
            y[i] = x[i] * scale;
        }
    }
}

// dst = a (op) b, with b's rows repeating over a's.
static void cpu_binary(const struct iq_cpu_params * p, struct iq_tensor * dst) {
    const struct iq_tensor * a = dst->src[0];
    const struct iq_tensor * b = dst->src[1];
    const int64_t n = a->ne[0];
    const bool mul = dst->op == IQ_OP_MUL;
    int64_t r0, r1;
    iq_cpu_split(iq_nrows(a), p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        const int64_t i1 = r % a->ne[1], i2 = r / a->ne[1] % a->ne[2], i3 = r / (a->ne[1] * a->ne[2]);
        const float * x = (const float *) iq_cpu_row(a, r);
        const float * z = (const float *) ((const char *) b->data + (i1 % b->ne[1]) * b->nb[1] +
                                           (i2 % b->ne[2]) * b->nb[2] + (i3 % b->ne[3]) * b->nb[3]);
        float * y = (float *) iq_cpu_row(dst, r);
        if (mul) {
            for (int64_t i = 0; i < n; i++) {
                y[i] = x[i] * z[i];
            }
        } else {
            for (int64_t i = 0; i < n; i++) {
                y[i] = x[i] + z[i];
            }
        }
    }
}

// GELU in ggml's tanh form, in float (ggml's CPU backend reads it from a table of f16 inputs:
// within 1e-3 of this).
static void geglu_row(int64_t n, float * y, const float * g, const float * u) {
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i];
        y[i] = 0.5f * x * (1.0f + tanhf(0.7978845608028654f * x * (1.0f + 0.044715f * x * x))) * u[i];
    }
}

// act(gate) * up per row: SiLU through the vector functions, GELU (a small share of a
// forward pass: the feed-forward's products dominate) in scalar code.
static void cpu_glu(const struct iq_cpu_params * p, struct iq_tensor * dst) {
    const struct iq_tensor * g = dst->src[0];
    const struct iq_tensor * u = dst->src[1];
    void (*row)(int64_t, float *, const float *, const float *) = dst->op == IQ_OP_SWIGLU ? iq_vec()->swiglu : geglu_row;
    int64_t r0, r1;
    iq_cpu_split(iq_nrows(g), p->ith, p->nth, &r0, &r1);
    for (int64_t r = r0; r < r1; r++) {
        row(g->ne[0], (float *) iq_cpu_row(dst, r), (const float *) iq_cpu_row(g, r), (const float *) iq_cpu_row(u, r));
    }
}

// RoPE NORMAL mode on rows (head, token) of [head_dim, n_head, n_tokens]. The angles of a
// token are computed once (as ggml does: theta_i = pos * theta_scale^i in float) into a
// per-thread cache of n_rot floats, cos and sin times mscale (times 1: exact), and shared by
// all its heads.
static void cpu_rope(const struct iq_cpu_params * p, struct iq_tensor * dst) {
    const struct iq_tensor * a = dst->src[0];
    const int32_t * pos = dst->src[1]->data;
    const float * ff = dst->src[2] != NULL ? dst->src[2]->data : NULL;
    const int n_rot = dst->op_params[0];
    const float theta_scale = powf(iq_get_op_param_f32(dst, 1), -2.0f / (float) n_rot);
    const float mscale = iq_get_op_param_f32(dst, 2);
    float * cache = (float *) p->wdata + (size_t) p->ith * (size_t) n_rot;
    const int64_t hd = a->ne[0], n_head = a->ne[1];
    int64_t r0, r1;
    iq_cpu_split(n_head * a->ne[2], p->ith, p->nth, &r0, &r1);
    int64_t cached = -1;
    for (int64_t r = r0; r < r1; r++) {
        const int64_t t = r / n_head;
        if (t != cached) {
            float theta = (float) pos[t];
            for (int i = 0; i < n_rot / 2; i++) {
                const float th = ff != NULL ? theta / ff[i] : theta;
                cache[2 * i] = cosf(th) * mscale;
                cache[2 * i + 1] = sinf(th) * mscale;
                theta *= theta_scale;
            }
            cached = t;
        }
        const float * x = (const float *) iq_cpu_row(a, r);
        float * y = (float *) iq_cpu_row(dst, r);
        for (int i = 0; i < n_rot; i += 2) {
            const float c = cache[i], s = cache[i + 1], x0 = x[i], x1 = x[i + 1];
            y[i] = x0 * c - x1 * s;
            y[i + 1] = x0 * s + x1 * c;
        }
        for (int64_t i = n_rot; i < hd; i++) {
            y[i] = x[i];
        }
    }
}

static size_t cpu_rope_work_size(const struct iq_tensor * dst, int nth) {
    return (size_t) nth * (size_t) dst->op_params[0] * sizeof(float);
}

static const struct iq_cpu_op iq_cpu_ops[IQ_OP_COUNT] = {
    [IQ_OP_GET_ROWS] = { cpu_get_rows, NULL, cpu_get_rows_supports },
    [IQ_OP_RMS_NORM] = { cpu_rms_norm, NULL, NULL },
    [IQ_OP_MUL] = { cpu_binary, NULL, NULL },
    [IQ_OP_ADD] = { cpu_binary, NULL, NULL },
    [IQ_OP_MUL_MAT] = { iq_cpu_mul_mat, iq_cpu_mul_mat_work_size, iq_cpu_mul_mat_supports },
    [IQ_OP_ROPE] = { cpu_rope, cpu_rope_work_size, NULL },
    [IQ_OP_SWIGLU] = { cpu_glu, NULL, NULL },
    [IQ_OP_GEGLU] = { cpu_glu, NULL, NULL },
    [IQ_OP_ATTENTION] = { iq_cpu_attention, iq_cpu_attention_work_size, iq_cpu_attention_supports },
    [IQ_OP_KV_STORE] = { iq_cpu_kv_store, NULL, iq_cpu_kv_store_supports },
};

const struct iq_cpu_op * iq_cpu_op_get(enum iq_op op) {
    if ((unsigned) op >= IQ_OP_COUNT || iq_cpu_ops[op].compute == NULL) {
        return NULL;
    }
    return &iq_cpu_ops[op];
}
