// KV_STORE and ATTENTION launches over the plain cache types (and the plain kernel over the
// f32 scratch a quantized cache is dequantized into: qcache-store.cu), and the tensor-core
// kernel of prompt batches (attention-fa.cuh) over an f16 cache or a quantized cache's f16
// hi / lo scratch.
//
// The number of splits of the positions depends on the shapes alone (the KV heads, the query
// tiles, the cache's capacity), never on n_past, so a decode step's launches are the same
// from token to token and replay as one CUDA graph while n_past moves in device memory.
//
// Which kernel: the tensor-core one where iq_cuda_attention_fa says so (shapes and types, and
// 16-byte aligned rows, checked at launch); the scratch holds the partial states of either, so
// a launch may still take the old kernel (a misaligned view) whatever the work size assumed.
#include "ops.h"

#include "attention-fa.cuh"

#include <stdlib.h>
#include <string.h>

#define IQ_AT_MAX_SPLIT 64
#define IQ_FA_MIN_VECS IQ_FA_ROWS  // query vectors (tokens x r) from which a batch takes iq_cu_fa

struct attn_shape {
    int hd, n_head, n_kv, r, n_tokens, qt, n_tiles, n_split;
};

// INNERQ_CUDA_FA=old: the f32 kernel for every batch, for side by side runs. Read once.
static bool fa_old_mode() {
    static int mode = -1;
    if (mode < 0) {
        const char * e = getenv("INNERQ_CUDA_FA");
        mode = e != NULL && strcmp(e, "old") == 0 ? 1 : 0;
    }
    return mode == 1;
}

// The shapes and types iq_cu_fa takes: a prompt batch of at least IQ_FA_MIN_VECS query vectors,
// head_dim 64 / 128, an f16 cache or a quantized one without the score correction, batch rows
// at 16-byte strides.
static bool fa_takes(const struct iq_tensor * dst) {
    const struct iq_kv_layer lay = iq_cuda_layer(dst), * layer = &lay;
    const struct iq_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2];
    if (dst->op != IQ_OP_ATTENTION || fa_old_mode() || (layer->head_dim != 64 && layer->head_dim != 128) ||
        q->ne[2] * (q->ne[1] / layer->n_kv_head) < IQ_FA_MIN_VECS) {
        return false;
    }
    if (iq_qcache_type_is_quantized(layer->type_k)) {
        if (iq_cuda_qcache_score_correction(layer)) {
            return false;
        }
    } else if (layer->type_k != IQ_TYPE_F16 || layer->type_v != IQ_TYPE_F16) {
        return false;
    }
    return (k->nb[1] | k->nb[2] | v->nb[1] | v->nb[2]) % 16 == 0;
}

static bool fa_aligned(const void * p, size_t nb1, size_t nb2) { return ((uintptr_t) p | nb1 | nb2) % 16 == 0; }

bool iq_cuda_attention_fa(const struct iq_tensor * dst) {
    const struct iq_tensor * k = dst->src[1], * v = dst->src[2];
    return fa_takes(dst) && fa_aligned(k->data, 0, 0) && fa_aligned(v->data, 0, 0);
}

// fa: the tiles of iq_cu_fa (IQ_FA_ROWS query vectors), else of iq_cu_attention (IQ_AT_VECS).
static struct attn_shape attn_shape_of(const struct iq_tensor * dst, int n_sm, bool fa) {
    const struct iq_tensor * q = dst->src[0];
    const struct iq_kv_layer lay = iq_cuda_layer(dst), * layer = &lay;
    struct attn_shape s;
    s.hd = (int) q->ne[0];
    s.n_head = (int) q->ne[1];
    s.n_tokens = (int) q->ne[2];
    s.n_kv = layer->n_kv_head;
    s.r = s.n_head / s.n_kv;
    const int vecs = fa ? IQ_FA_ROWS : IQ_AT_VECS;
    s.qt = s.r >= vecs ? 1 : vecs / s.r;
    s.n_tiles = (s.n_tokens + s.qt - 1) / s.qt;
    // enough blocks for 4 per multiprocessor, each split at least 256 positions of the cache
    const int pairs = s.n_kv * s.n_tiles;
    int n_split = (4 * n_sm + pairs - 1) / pairs;
    const int by_len = (layer->n_ctx + 255) / 256;
    n_split = n_split < by_len ? n_split : by_len;
    n_split = n_split < IQ_AT_MAX_SPLIT ? n_split : IQ_AT_MAX_SPLIT;
    s.n_split = n_split > 1 ? n_split : 1;
    return s;
}

bool iq_cuda_kv_layer(const struct iq_tensor * dst, struct iq_kv_layer * layer) {
    if (!iq_kv_layer_of_op(dst, layer)) {
        return false;
    }
    if (layer->n_slots != 1 || dst->src[IQ_KV_SRC_SEQS]->ne[1] != 1) {
        iq_error_set("%s: the CUDA backend runs one sequence per context (%d slots, %lld in the step)",
                     iq_op_name(dst->op), layer->n_slots, (long long) dst->src[IQ_KV_SRC_SEQS]->ne[1]);
        return false;
    }
    return true;
}

// The plain cache types the kernels read.
static bool cuda_plain_type(enum iq_type type) {
    return type == IQ_TYPE_F32 || type == IQ_TYPE_F16 || type == IQ_TYPE_Q8_0 || type == IQ_TYPE_Q4_0;
}

bool iq_cuda_attention_supports(const struct iq_tensor * dst) {
    struct iq_kv_layer lay;
    if (!iq_cuda_kv_layer(dst, &lay)) {
        return false;
    }
    const struct iq_kv_layer * layer = &lay;
    const char * op = iq_op_name(dst->op);
    if (dst->op == IQ_OP_ATTENTION && dst->src[0]->ne[1] / layer->n_kv_head > IQ_AT_VECS) {
        iq_error_set("%s: more than %d query heads per KV head", op, IQ_AT_VECS);
        return false;
    }
    if (iq_qcache_type_is_quantized(layer->type_k)) {
        return iq_cuda_qcache_supports(dst);
    }
    if (!cuda_plain_type(layer->type_k) || !cuda_plain_type(layer->type_v)) {
        iq_error_set("%s: the CUDA backend has no kernels for a %s / %s cache (plain types only: f32, f16, q8_0, q4_0)",
                     op, iq_type_name(layer->type_k), iq_type_name(layer->type_v));
        return false;
    }
    if (layer->head_dim != 64 && layer->head_dim != 128) {
        iq_error_set("%s: the CUDA backend takes head_dim 64 or 128, not %d", op, layer->head_dim);
        return false;
    }
    if (dst->op == IQ_OP_ATTENTION && dst->src[0]->ne[1] / layer->n_kv_head > IQ_AT_VECS) {
        iq_error_set("%s: more than %d query heads per KV head", op, IQ_AT_VECS);
        return false;
    }
    return true;
}

size_t iq_cuda_attention_work_size(const struct iq_tensor * dst, int n_sm) {
    if (iq_qcache_type_is_quantized(iq_cuda_layer(dst).type_k)) {
        return dst->op == IQ_OP_ATTENTION ? iq_cuda_qcache_attention_work_size(dst, n_sm) : 0;
    }
    return iq_cuda_attention_part_size(dst, n_sm);
}

int iq_cuda_kv_store(const struct iq_cuda_ctx * c, struct iq_tensor * dst) {
    const struct iq_kv_layer lay = iq_cuda_layer(dst), * layer = &lay;
    if (iq_qcache_type_is_quantized(layer->type_k)) {
        return iq_cuda_qcache_kv_store(c, dst);
    }
    const struct iq_tensor * k = dst->src[1], * v = dst->src[2];
    const dim3 grid((unsigned) k->ne[2], (unsigned) layer->n_kv_head, 2);
    iq_cu_with_cache_type(layer->type_k, [&](auto TK) {
        iq_cu_with_cache_type(layer->type_v, [&](auto TV) {
            iq_cu_kv_store<decltype(TK)::value, decltype(TV)::value><<<grid, 32, 0, c->stream>>>(
                (const float *) k->data, k->nb[1], k->nb[2], (const float *) v->data, v->nb[1], v->nb[2],
                (uint8_t *) layer->k->data, layer->k->nb[1], layer->k->nb[2], (uint8_t *) layer->v->data,
                layer->v->nb[1], layer->v->nb[2], c->kvp + IQ_KV_S_N_PAST, layer->head_dim / 32);
        });
    });
    return iq_cuda_launched("kv_store");
}

template <int TK, int TV, int C, int RK = TK, int RV = TV>
static void attn_launch(const struct iq_cuda_ctx * c, const struct attn_shape & s, const iq_cu_attn_args & a) {
    const size_t smem = iq_cu_attention_smem(C);
    const dim3 grid((unsigned) s.n_kv, (unsigned) s.n_tiles, (unsigned) s.n_split);
    iq_cu_attention<TK, TV, C, RK, RV><<<grid, 32 * IQ_AT_WARPS, smem, c->stream>>>(a);
}

static iq_cu_attn_args attn_args(const struct iq_cuda_ctx * c, const struct iq_tensor * dst, const struct attn_shape & s) {
    const struct iq_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2];
    iq_cu_attn_args a;
    a.q = (const float *) q->data;
    a.q_nb1 = q->nb[1], a.q_nb2 = q->nb[2];
    a.k = (const float *) k->data, a.v = (const float *) v->data;
    a.k_nb1 = k->nb[1], a.k_nb2 = k->nb[2], a.v_nb1 = v->nb[1], a.v_nb2 = v->nb[2];
    a.ck = a.cv = a.ck_lo = a.cv_lo = nullptr;
    a.ck_nb1 = a.ck_nb2 = a.cv_nb1 = a.cv_nb2 = 0;
    a.dst = (float *) dst->data;
    a.dst_nb1 = dst->nb[1];
    a.part = c->work;
    a.n_past = c->kvp + IQ_KV_S_N_PAST;
    a.n_head = s.n_head, a.r = s.r, a.n_tokens = s.n_tokens, a.qt = s.qt, a.n_split = s.n_split;
    a.scale = iq_get_op_param_f32(dst, IQ_KV_P_SCALE);
    a.decode = dst->op_params[IQ_KV_P_DECODE] != 0;
    a.dk = a.norm = nullptr;
    a.ngk = a.group = a.n_ctx = 0;
    return a;
}

static int attn_merge(const struct iq_cuda_ctx * c, struct iq_tensor * dst, const struct attn_shape & s) {
    if (iq_cuda_launched("attention") != 0) {
        return -1;
    }
    if (s.n_split > 1) {
        iq_cu_attn_merge<<<dim3((unsigned) s.n_head, (unsigned) s.n_tokens), 128, 0, c->stream>>>(
            c->work, (float *) dst->data, dst->nb[1], s.n_split, s.n_tokens, s.n_head, s.hd);
        return iq_cuda_launched("attention (merge)");
    }
    return 0;
}

template <int D, bool LO>
static void fa_launch(const struct iq_cuda_ctx * c, const struct attn_shape & s, const iq_cu_attn_args & a) {
    constexpr size_t smem = iq_fa_cfg<D>::SMEM;
    static bool smem_set[64];  // per device; setting it twice is harmless
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev >= 64 || !smem_set[dev]) {
        cudaFuncSetAttribute(iq_cu_fa<D, LO>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem);
        if (cudaFuncSetAttribute(iq_cu_fa<D, LO>, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 (int) cudaSharedmemCarveoutMaxShared) != cudaSuccess) {
            (void) cudaGetLastError();  // a hint only
        }
        if (dev < 64) {
            smem_set[dev] = true;
        }
    }
    const dim3 grid((unsigned) s.n_kv, (unsigned) s.n_tiles, (unsigned) s.n_split);
    iq_cu_fa<D, LO><<<grid, 32 * IQ_FA_WARPS, smem, c->stream>>>(a);
}

// iq_cu_fa over f16 cache rows ck, cv (row (head, t) at head * nb2 + t * nb1) and their lo
// planes at the same strides (NULL: the rows are exact in f16).
static int fa_run(const struct iq_cuda_ctx * c, struct iq_tensor * dst, const void * ck, const void * cv,
                  const void * ck_lo, const void * cv_lo, size_t ck_nb1, size_t ck_nb2, size_t cv_nb1, size_t cv_nb2) {
    const struct attn_shape s = attn_shape_of(dst, c->n_sm, true);
    iq_cu_attn_args a = attn_args(c, dst, s);
    a.ck = (const uint8_t *) ck, a.cv = (const uint8_t *) cv;
    a.ck_lo = (const uint8_t *) ck_lo, a.cv_lo = (const uint8_t *) cv_lo;
    a.ck_nb1 = ck_nb1, a.ck_nb2 = ck_nb2, a.cv_nb1 = cv_nb1, a.cv_nb2 = cv_nb2;
    const bool lo = ck_lo != nullptr;
    if (s.hd == 64) {
        lo ? fa_launch<64, true>(c, s, a) : fa_launch<64, false>(c, s, a);
    } else {
        lo ? fa_launch<128, true>(c, s, a) : fa_launch<128, false>(c, s, a);
    }
    return attn_merge(c, dst, s);
}

int iq_cuda_attention_split_cache(const struct iq_cuda_ctx * c, struct iq_tensor * dst, const uint16_t * ck,
                                  const uint16_t * cv, size_t plane) {
    const struct iq_kv_layer lay = iq_cuda_layer(dst), * layer = &lay;
    const size_t row = (size_t) layer->head_dim * sizeof(uint16_t);
    return fa_run(c, dst, ck, cv, ck + plane, cv + plane, row, row * layer->n_ctx, row, row * layer->n_ctx);
}

int iq_cuda_attention(const struct iq_cuda_ctx * c, struct iq_tensor * dst) {
    const struct iq_kv_layer lay = iq_cuda_layer(dst), * layer = &lay;
    if (iq_qcache_type_is_quantized(layer->type_k)) {
        return iq_cuda_qcache_attention(c, dst);
    }
    if (iq_cuda_attention_fa(dst) && fa_aligned(layer->k->data, layer->k->nb[1], layer->k->nb[2]) &&
        fa_aligned(layer->v->data, layer->v->nb[1], layer->v->nb[2])) {
        return fa_run(c, dst, layer->k->data, layer->v->data, nullptr, nullptr, layer->k->nb[1], layer->k->nb[2],
                      layer->v->nb[1], layer->v->nb[2]);
    }
    const struct attn_shape s = attn_shape_of(dst, c->n_sm, false);
    iq_cu_attn_args a = attn_args(c, dst, s);
    a.ck = (const uint8_t *) layer->k->data, a.cv = (const uint8_t *) layer->v->data;
    a.ck_nb1 = layer->k->nb[1], a.ck_nb2 = layer->k->nb[2], a.cv_nb1 = layer->v->nb[1], a.cv_nb2 = layer->v->nb[2];
    iq_cu_with_cache_type(layer->type_k, [&](auto TK) {
        iq_cu_with_cache_type(layer->type_v, [&](auto TV) {
            constexpr int tk = decltype(TK)::value, tv = decltype(TV)::value;
            if (s.hd == 64) {
                attn_launch<tk, tv, 2>(c, s, a);
            } else {
                attn_launch<tk, tv, 4>(c, s, a);
            }
        });
    });
    return attn_merge(c, dst, s);
}

static size_t part_bytes(const struct attn_shape & s) {
    return s.n_split > 1 ? (size_t) s.n_split * s.n_tokens * s.n_head * (s.hd + 2) * sizeof(float) : 0;
}

size_t iq_cuda_attention_part_size(const struct iq_tensor * dst, int n_sm) {
    const size_t old = part_bytes(attn_shape_of(dst, n_sm, false));
    if (!fa_takes(dst)) {
        return old;
    }
    const size_t fa = part_bytes(attn_shape_of(dst, n_sm, true));
    return fa > old ? fa : old;
}

int iq_cuda_attention_f32_cache(const struct iq_cuda_ctx * c, struct iq_tensor * dst, const float * ck,
                                const float * cv, const float * dk, const float * norm, int group) {
    const struct iq_kv_layer lay = iq_cuda_layer(dst), * layer = &lay;
    const struct attn_shape s = attn_shape_of(dst, c->n_sm, false);
    iq_cu_attn_args a = attn_args(c, dst, s);
    const size_t row = (size_t) s.hd * sizeof(float);
    a.ck = (const uint8_t *) ck, a.cv = (const uint8_t *) cv;
    a.ck_nb1 = a.cv_nb1 = row;
    a.ck_nb2 = a.cv_nb2 = row * (size_t) layer->n_ctx;
    a.dk = dk, a.norm = norm;
    a.ngk = dk != nullptr ? s.hd / group : 0;
    a.group = group;
    a.n_ctx = layer->n_ctx;
    if (s.hd == 64) {
        attn_launch<IQ_TYPE_F32, IQ_TYPE_F32, 2, IQ_TYPE_F16, IQ_TYPE_F16>(c, s, a);
    } else {
        attn_launch<IQ_TYPE_F32, IQ_TYPE_F32, 4, IQ_TYPE_F16, IQ_TYPE_F16>(c, s, a);
    }
    return attn_merge(c, dst, s);
}
