// KV_STORE and ATTENTION launches over the plain cache types (and the plain kernel over the
// f32 scratch a quantized cache's sequence is dequantized into: qcache-store.cu), and the
// tensor-core kernel of prompt batches (attention-fa.cuh) over an f16 cache or a quantized
// cache's f16 scratch, for any number of sequences of a step (kv-seqs.cuh).
//
// A launch's grid is (work item, KV head): an item is a tile of a sequence's queries and a split
// of its positions, found by each CTA from the step's rows in device memory. How many items a
// sequence has depends on its own token count and on shapes (the KV heads, the slots of the
// pool, the length a slot's sequence may reach), never on n_past or on the other sequences, so a
// decode step's launches are the same from token to token and replay as one CUDA graph while the
// counters move in device memory, and a sequence gets the same bits alone or batched with others.
// The grid and the scratch are bounds over every step of the shapes; items past the step's end.
//
// Which kernel: per sequence, the tensor-core one for sequences of at least IQ_FA_MIN_VECS query
// vectors (over an f16 cache IQ_FA_MIN_VECS_F16: any) where its shapes and types allow
// (iq_cuda_attention_fa_vecs), the f32 one otherwise; each launch takes its own sequences and
// skips the others'.
#include "ops.h"

#include "attention-fa.cuh"


#define IQ_AT_MAX_SPLIT 64
static_assert(IQ_AT_MAX_SPLIT <= IQ_MERGE_MAX_SPLIT, "the merge's shared memory");
#define IQ_AT_SPLIT_MIN 128  // positions per split at least (attn_sched)
#define IQ_FA_MIN_VECS IQ_FA_ROWS  // query vectors (tokens x r) from which a sequence takes iq_cu_fa
// The same over an f16 cache: 1, decode steps (r vectors: a GQA group) too, the tile's other
// rows padding: a step's time there is the cache's bytes, which the kernel's two stages of
// cp.async read faster than the f32 kernel's one tile at a time (H100, 8B shape: tg64 at depth
// 32768 1.07x, 8K prompts decoding together 1.26x at B = 32; docs/BENCHMARKS.md). A build with
// -DIQ_FA_MIN_VECS_F16=IQ_FA_MIN_VECS keeps them on the f32 kernel, for comparisons.
#ifndef IQ_FA_MIN_VECS_F16
#define IQ_FA_MIN_VECS_F16 1
#endif

static bool fa_aligned(const void * p, size_t nb1, size_t nb2) { return ((uintptr_t) p | nb1 | nb2) % 16 == 0; }

int iq_cuda_attention_fa_vecs(const struct iq_tensor * dst) {
    const struct iq_kv_layer lay = iq_cuda_layer(dst), * layer = &lay;
    const struct iq_tensor * k = dst->src[1], * v = dst->src[2];
    // head_dim 256 on the f32 kernel only (attention-fa.cuh: the fragments would not fit the registers)
    if (dst->op != IQ_OP_ATTENTION || iq_cuda_variants.fa_f32 || (layer->head_dim != 64 && layer->head_dim != 128)) {
        return 0;
    }
    if (iq_qcache_type_is_quantized(layer->type_k)) {
        if (iq_cuda_qcache_score_correction(layer)) {
            return 0;
        }
    } else if (layer->type_k != IQ_TYPE_F16 || layer->type_v != IQ_TYPE_F16 ||
               !fa_aligned(layer->k->data, layer->k->nb[1], layer->k->nb[2]) ||
               !fa_aligned(layer->v->data, layer->v->nb[1], layer->v->nb[2])) {
        return 0;
    }
    const int min_vecs = iq_qcache_type_is_quantized(layer->type_k) ? IQ_FA_MIN_VECS : IQ_FA_MIN_VECS_F16;
    return fa_aligned(k->data, k->nb[1], k->nb[2]) && fa_aligned(v->data, v->nb[1], v->nb[2]) ? min_vecs : 0;
}

// The cut of a launch of the f32 kernel (fa_kernel false) or the tensor-core one: which
// sequences it takes (fa 1: those of fa_vecs query vectors and more, 0: the others, -1: any; of
// more than min_tokens tokens, the which-th of them, or each for which < 0) and their splits: a
// tile's share of 4 CTAs per multiprocessor when every slot of the pool holds a sequence, each
// split at least IQ_AT_SPLIT_MIN positions of the length a slot's sequence may reach (n_ctx /
// n_slots), at most IQ_AT_MAX_SPLIT. One slot: the one sequence's tiles share the device, as
// before pools. IQ_AT_SPLIT_MIN 128, not 256: a decode step of SmolLM2's shape over 1,152
// positions (3 KV heads) ran 5 splits per head, 15 CTAs, each a chain of 4 tiles; with 9 splits
// 1.14x the tokens per second (H100, docs/BENCHMARKS.md "Shorter attention splits"); 64 (one
// tile per CTA) was slower than 128, and a context of 128 positions keeps one split (no merge).
static iq_cu_sched attn_sched(const struct iq_tensor * dst, int n_sm, bool fa_kernel, int fa, int fa_vecs,
                              int min_tokens, int which) {
    const struct iq_kv_layer layer = iq_cuda_layer(dst);
    const int r = (int) (dst->src[0]->ne[1] / layer.n_kv_head);
    const int vecs = fa_kernel ? IQ_FA_ROWS : IQ_AT_VECS;
    const int64_t n_slots = layer.n_slots > 0 ? layer.n_slots : 1;
    const int64_t per = (int64_t) layer.n_kv_head * n_slots;
    const int64_t by_len = (layer.n_ctx / n_slots + IQ_AT_SPLIT_MIN - 1) / IQ_AT_SPLIT_MIN;
    iq_cu_sched s;
    s.r = r;
    s.qt = r >= vecs ? 1 : vecs / r;
    s.min_tokens = min_tokens;
    s.which = which;
    s.fa = fa;
    s.fa_vecs = fa_vecs > 0 ? fa_vecs : 1;
    s.work = (int) ((4 * (int64_t) (n_sm > 0 ? n_sm : 1) + per - 1) / per);
    s.max_split = (int) (by_len < IQ_AT_MAX_SPLIT ? (by_len > 1 ? by_len : 1) : IQ_AT_MAX_SPLIT);
    return s;
}

// Sequences of at least m tokens that a step of n tokens in n_seq sequences can hold (each of
// the others holds one at least).
static int64_t seqs_with(int64_t m, int64_t n, int64_t n_seq) {
    if (m <= 1) {
        return n_seq;
    }
    const int64_t k = (n - n_seq) / (m - 1);
    return k < 0 ? 0 : k < n_seq ? k : n_seq;
}

// Bounds of a launch that takes at most seq_max sequences of tok_max tokens together: its work
// items (the grid) and partial states (a sequence of t tiles has t * n_split <= work + t - 1
// items, and n tokens <= qt t of them n * n_split <= qt (work + t - 1) states).
struct attn_bounds {
    int64_t items, parts;
};
static attn_bounds sched_bounds(const iq_cu_sched & sc, int64_t seq_max, int64_t tok_max) {
    attn_bounds b = { 0, 0 };
    if (seq_max <= 0 || tok_max <= 0) {
        return b;
    }
    const int64_t tiles = (tok_max + seq_max * (sc.qt - 1)) / sc.qt, w = sc.work - 1;
    const int64_t items = tiles + seq_max * w, parts = (int64_t) sc.qt * (tiles + seq_max * w);
    b.items = items < tiles * sc.max_split ? items : tiles * sc.max_split;
    b.parts = sc.max_split == 1 ? 0 : parts < tok_max * sc.max_split ? parts : tok_max * sc.max_split;
    return b;
}

// The two launches of an ATTENTION over the op's sequences of more than min_tokens tokens (the
// which-th of them, or each): [0] the f32 kernel's, [1] the tensor-core kernel's, each with its
// cut and bounds (items 0: no sequence of the step's shapes can be its).
struct attn_plan {
    iq_cu_sched sc[2];
    attn_bounds b[2];
    bool few_vecs;  // every CTA of the tensor-core launch holds at most 16 query vectors
};
static attn_plan attn_plan_of(const struct iq_tensor * dst, int n_sm, int min_tokens, int which) {
    const int64_t n = dst->src[0]->ne[2], n_seq = dst->src[IQ_KV_SRC_SEQS]->ne[1];
    const int fa_vecs = iq_cuda_attention_fa_vecs(dst);
    attn_plan p;
    p.few_vecs = false;
    p.sc[0] = attn_sched(dst, n_sm, false, fa_vecs > 0 ? 0 : -1, fa_vecs, min_tokens, which);
    p.sc[1] = attn_sched(dst, n_sm, true, 1, fa_vecs, min_tokens, which);
    int64_t seq_max = seqs_with(min_tokens + 1, n, n_seq);
    seq_max = which >= 0 && seq_max > 1 ? 1 : seq_max;
    if (fa_vecs == 0) {
        p.b[0] = sched_bounds(p.sc[0], seq_max, n);
        p.b[1] = sched_bounds(p.sc[1], 0, 0);
        return p;
    }
    const int64_t fa_tokens = (fa_vecs + p.sc[0].r - 1) / p.sc[0].r;  // the fewest tokens of a tensor-core sequence
    // sequences of fewer (none where the step is one sequence of at least fa_tokens tokens)
    const int64_t few = fa_tokens - 1 > min_tokens && (n_seq > 1 || n < fa_tokens) ? seq_max : 0;
    const int64_t few_tok = few * (fa_tokens - 1) < n ? few * (fa_tokens - 1) : n;
    const int64_t many = seqs_with(fa_tokens > min_tokens + 1 ? fa_tokens : min_tokens + 1, n, n_seq);
    p.b[0] = sched_bounds(p.sc[0], few, few_tok);
    p.b[1] = sched_bounds(p.sc[1], many < seq_max ? many : seq_max, n);
    if (n_seq == 1 && p.b[1].items > 0) {  // the one sequence holds the step's n tokens: its cut exactly
        const int64_t tiles = (n + p.sc[1].qt - 1) / p.sc[1].qt;
        const int64_t split = iq_cu_sched_splits(p.sc[1], (int) tiles);
        p.b[1].items = tiles * split;
        p.b[1].parts = split > 1 ? n * split : 0;  // no merge where the tiles do not split
    }
    // a sequence holds at most n - n_seq + 1 of the step's tokens: CTAs of at most 16 query
    // vectors, the one-warp kernel's if the launch is large enough (fa_launch)
    p.few_vecs = (n - n_seq + 1) * p.sc[1].r <= 16;
    return p;
}

// The plain cache types the kernels read.
static bool cuda_plain_type(enum iq_type type) {
    return type == IQ_TYPE_F32 || type == IQ_TYPE_F16 || type == IQ_TYPE_Q8_0 || type == IQ_TYPE_Q4_0;
}

bool iq_cuda_attention_supports(const struct iq_tensor * dst) {
    struct iq_kv_layer lay;
    if (!iq_kv_layer_of_op(dst, &lay)) {
        return false;
    }
    const struct iq_kv_layer * layer = &lay;
    const char * op = iq_op_name(dst->op);
    const struct iq_tensor * st = dst->src[IQ_KV_SRC_SEQS], * pt = dst->src[IQ_KV_SRC_PAGES];
    if (st->type != IQ_TYPE_I32 || st->ne[0] != IQ_KV_S_COUNT || !iq_is_contiguous(st) || st->ne[1] < 1 ||
        pt->type != IQ_TYPE_I32 || pt->nb[0] != sizeof(int32_t) || pt->nb[1] % sizeof(int32_t) != 0) {
        iq_error_set("%s: seqs must be I32 [%d, n_seq] and the page table I32 [n_table, n_slots]", op, IQ_KV_S_COUNT);
        return false;
    }
    if (layer->window > 0 && iq_qcache_type_is_quantized(layer->type_k) && layer->n_pages > 0) {
        // the fused kernels and the dequantized path read a window layer's sink and recent rows
        // only: its queries must never reach a quantized block
        iq_error_set("%s: the CUDA backend takes a sliding-window layer of a quantized cache only when its recent "
                     "window holds the whole sliding window (kv_recent >= %d)", op, layer->window);
        return false;
    }
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
    if (!iq_cuda_head_dim(layer->head_dim)) {
        iq_error_set("%s: the CUDA backend takes head_dim 64, 128 or 256, not %d", op, layer->head_dim);
        return false;
    }
    if (layer->page % 64 != 0) {  // a tile of either kernel (32 or 64 positions) lies in one page
        iq_error_set("%s: the CUDA backend takes pages of whole 64-token tiles, not %d tokens", op, layer->page);
        return false;
    }
    return true;
}

static size_t part_bytes(const struct iq_tensor * dst, int64_t parts) {
    const struct iq_tensor * q = dst->src[0];
    return (size_t) parts * (size_t) q->ne[1] * (size_t) (q->ne[0] + 2) * sizeof(float);
}

size_t iq_cuda_attention_part_size(const struct iq_tensor * dst, int n_sm, int min_tokens, bool one) {
    const attn_plan p = attn_plan_of(dst, n_sm, min_tokens, one ? 0 : -1);
    return part_bytes(dst, p.b[0].parts > p.b[1].parts ? p.b[0].parts : p.b[1].parts);
}

size_t iq_cuda_attention_work_size(const struct iq_tensor * dst, int n_sm) {
    if (iq_qcache_type_is_quantized(iq_cuda_layer(dst).type_k)) {
        return dst->op == IQ_OP_ATTENTION ? iq_cuda_qcache_attention_work_size(dst, n_sm) : 0;
    }
    return dst->op == IQ_OP_ATTENTION ? iq_cuda_attention_part_size(dst, n_sm, 0, false) : 0;
}

int iq_cuda_kv_store(const struct iq_cuda_ctx * c, struct iq_tensor * dst) {
    const struct iq_kv_layer lay = iq_cuda_layer(dst), * layer = &lay;
    if (iq_qcache_type_is_quantized(layer->type_k)) {
        return iq_cuda_qcache_kv_store(c, dst);
    }
    const struct iq_tensor * k = dst->src[1], * v = dst->src[2];
    const iq_cu_seqs seqs = iq_cu_seqs_of_op(dst);
    const dim3 grid((unsigned) k->ne[2], (unsigned) layer->n_kv_head, 2);
    iq_cu_with_cache_type(layer->type_k, [&](auto TK) {
        iq_cu_with_cache_type(layer->type_v, [&](auto TV) {
            iq_cu_kv_store<decltype(TK)::value, decltype(TV)::value><<<grid, 32, 0, c->stream>>>(
                (const float *) k->data, k->nb[1], k->nb[2], (const float *) v->data, v->nb[1], v->nb[2],
                (uint8_t *) layer->k->data, layer->k->nb[1], layer->k->nb[2], (uint8_t *) layer->v->data,
                layer->v->nb[1], layer->v->nb[2], seqs, layer->page, layer->head_dim / 32);
        });
    });
    return iq_cuda_launched("kv_store");
}

// Lets kernel fn take smem bytes of dynamic shared memory (past the default 48 KiB, with all of
// the unified L1 as shared memory), once per device of the process (set: the kernel's flags).
template <typename F>
static void smem_opt_in(F * fn, size_t smem, bool (&set)[64]) {
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev < 64 && set[dev]) {
        return;
    }
    cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem);
    const int carveout = (int) cudaSharedmemCarveoutMaxShared;
    if (cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, carveout) != cudaSuccess) {
        (void) cudaGetLastError();  // a hint only
    }
    if (dev < 64) {
        set[dev] = true;
    }
}

template <int TK, int TV, int C, int RK = TK, int RV = TV>
static void attn_launch(const struct iq_cuda_ctx * c, dim3 grid, const iq_cu_attn_args & a) {
    const size_t smem = iq_cu_attention_smem(C);
    if (smem > 48 * 1024) {  // head_dim 256: 82 KB of query and K / V rows
        static bool set[64];
        smem_opt_in(iq_cu_attention<TK, TV, C, RK, RV>, smem, set);
    }
    iq_cu_attention<TK, TV, C, RK, RV><<<grid, 32 * IQ_AT_WARPS, smem, c->stream>>>(a);
}

// f(std::integral_constant<int, C>) for the 32-element units per row of head_dim hd (64, 128, 256).
template <typename F>
static void with_units(int hd, F f) {
    switch (hd) {
    case 64: f(std::integral_constant<int, 2>{}); break;
    case 128: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
    }
}

static iq_cu_attn_args attn_args(const struct iq_cuda_ctx * c, const struct iq_tensor * dst) {
    const struct iq_tensor * q = dst->src[0], * k = dst->src[1], * v = dst->src[2];
    const struct iq_kv_layer layer = iq_cuda_layer(dst);
    iq_cu_attn_args a;
    a.q = (const float *) q->data;
    a.q_nb1 = q->nb[1], a.q_nb2 = q->nb[2];
    a.k = (const float *) k->data, a.v = (const float *) v->data;
    a.k_nb1 = k->nb[1], a.k_nb2 = k->nb[2], a.v_nb1 = v->nb[1], a.v_nb2 = v->nb[2];
    a.ck = a.cv = nullptr;
    a.ck_nb1 = a.ck_nb2 = a.cv_nb1 = a.cv_nb2 = 0;
    a.dst = (float *) dst->data;
    a.dst_nb1 = dst->nb[1];
    a.part = c->work;
    a.seqs = iq_cu_seqs_of_op(dst);
    a.page = 0;
    a.n_head = (int) q->ne[1];
    a.r = (int) (q->ne[1] / layer.n_kv_head);
    a.window = layer.window;
    a.scale = iq_get_op_param_f32(dst, IQ_KV_P_SCALE);
    a.decode = dst->op_params[IQ_KV_P_DECODE] != 0;
    a.dk = a.norm = nullptr;
    a.ngk = a.group = a.n_ctx = 0;
    return a;
}

// The merge of a launch's partial states, for the rows of its sequences that split.
static int attn_merge(const struct iq_cuda_ctx * c, struct iq_tensor * dst, const iq_cu_attn_args & a,
                      const attn_bounds & b) {
    if (iq_cuda_launched("attention") != 0) {
        return -1;
    }
    if (b.parts > 0) {
        const struct iq_tensor * q = dst->src[0];
        const int hpb = q->ne[2] >= 32 ? 4 : 1;  // heads per block (iq_cu_attn_merge)
        iq_cu_attn_merge<<<dim3((unsigned) ((q->ne[1] + hpb - 1) / hpb), (unsigned) q->ne[2]), IQ_MERGE_THREADS, 0,
                           c->stream>>>(a.part, (float *) dst->data, dst->nb[1], a.seqs, a.sched, a.n_head,
                                        (int) q->ne[0], hpb);
        return iq_cuda_launched("attention (merge)");
    }
    return 0;
}

// iq_cu_fa<D, W, ST> with its shared memory opted in once per device; launch false: only that,
// and how many of its CTAs a multiprocessor of the device holds (0 if the runtime cannot say).
template <int D, int W, int ST>
static int fa_launch(const struct iq_cuda_ctx * c, dim3 grid, const iq_cu_attn_args & a, bool launch) {
    constexpr size_t smem = iq_fa_cfg<D, ST>::SMEM;
    static bool set[64], asked[64];
    static int resident[64];
    smem_opt_in(iq_cu_fa<D, W, ST>, smem, set);
    if (!launch) {
        // asked once per device, by the first step of a graph, which runs before the graph is
        // captured (cuda-backend.c: a step is captured when it repeats the last one)
        int dev = 0;
        cudaGetDevice(&dev);
        if (dev >= 64) {
            return 0;
        }
        if (!asked[dev] &&
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident[dev], iq_cu_fa<D, W, ST>, 32 * W, smem) != cudaSuccess) {
            (void) cudaGetLastError();
            resident[dev] = 0;
        }
        asked[dev] = true;
        return resident[dev];
    }
    iq_cu_fa<D, W, ST><<<grid, 32 * W, smem, c->stream>>>(a);
    return 0;
}

// Which iq_cu_fa: CTAs of one warp (attention-fa.cuh, IQ_FA_FEW_WARPS) where each holds at most
// 16 query vectors and the launch has more CTAs than the four-warp kernel keeps resident on the
// device, where the one-warp kernel keeps more; the grid is shapes only, so a decode step's
// choice is the same from token to token (a CUDA graph).
template <int D>
static void fa_launch(const struct iq_cuda_ctx * c, dim3 grid, const iq_cu_attn_args & a, bool few_vecs) {
    if (few_vecs) {
        const int wide = fa_launch<D, IQ_FA_WARPS, IQ_FA_STAGES>(c, grid, a, false);
        const int one = fa_launch<D, IQ_FA_FEW_WARPS, IQ_FA_FEW_STAGES>(c, grid, a, false);
        if (one > wide && (int64_t) grid.x * grid.y > (int64_t) wide * c->n_sm) {
            fa_launch<D, IQ_FA_FEW_WARPS, IQ_FA_FEW_STAGES>(c, grid, a, true);
            return;
        }
    }
    fa_launch<D, IQ_FA_WARPS, IQ_FA_STAGES>(c, grid, a, true);
}

// The launches of a plan, each with its merge: the tensor-core kernel (over f16 cache rows),
// then the f32 kernel by plain(grid, args).
template <typename PLAIN>
static int attn_run(const struct iq_cuda_ctx * c, struct iq_tensor * dst, iq_cu_attn_args a, const attn_plan & p,
                    PLAIN plain) {
    const unsigned n_kv = (unsigned) iq_cuda_layer(dst).n_kv_head;
    const int hd = (int) dst->src[0]->ne[0];
    if (p.b[1].items > 0) {
        const dim3 grid((unsigned) p.b[1].items, n_kv);
        a.sched = p.sc[1];
        if (hd == 64) {
            fa_launch<64>(c, grid, a, p.few_vecs);
        } else {
            fa_launch<128>(c, grid, a, p.few_vecs);
        }
        if (attn_merge(c, dst, a, p.b[1]) != 0) {
            return -1;
        }
    }
    if (p.b[0].items > 0) {
        a.sched = p.sc[0];
        plain(dim3((unsigned) p.b[0].items, n_kv), a);
        return attn_merge(c, dst, a, p.b[0]);
    }
    return 0;
}

int iq_cuda_attention(const struct iq_cuda_ctx * c, struct iq_tensor * dst) {
    const struct iq_kv_layer lay = iq_cuda_layer(dst), * layer = &lay;
    if (iq_qcache_type_is_quantized(layer->type_k)) {
        return iq_cuda_qcache_attention(c, dst);
    }
    iq_cu_attn_args a = attn_args(c, dst);
    a.ck = (const uint8_t *) layer->k->data, a.cv = (const uint8_t *) layer->v->data;
    a.ck_nb1 = layer->k->nb[1], a.ck_nb2 = layer->k->nb[2], a.cv_nb1 = layer->v->nb[1], a.cv_nb2 = layer->v->nb[2];
    a.page = layer->page;
    const int hd = layer->head_dim;
    return attn_run(c, dst, a, attn_plan_of(dst, c->n_sm, 0, -1), [&](dim3 grid, const iq_cu_attn_args & b) {
        iq_cu_with_cache_type(layer->type_k, [&](auto TK) {
            iq_cu_with_cache_type(layer->type_v, [&](auto TV) {
                with_units(hd, [&](auto C) {
                    attn_launch<decltype(TK)::value, decltype(TV)::value, decltype(C)::value>(c, grid, b);
                });
            });
        });
    });
}

int iq_cuda_attention_scratch(const struct iq_cuda_ctx * c, struct iq_tensor * dst, int min_tokens, int which,
                              const void * ck, const void * cv, const float * dk, const float * norm, int group) {
    const struct iq_kv_layer layer = iq_cuda_layer(dst);
    const int hd = layer.head_dim;
    iq_cu_attn_args a = attn_args(c, dst);
    const attn_plan p = attn_plan_of(dst, c->n_sm, min_tokens, which);
    a.n_ctx = layer.n_ctx;
    if (p.b[1].items > 0) {  // the tensor-core kernel's sequence: f16 rows, no score correction
        const size_t row = (size_t) hd * sizeof(uint16_t);
        a.ck = (const uint8_t *) ck, a.cv = (const uint8_t *) cv;
        a.ck_nb1 = a.cv_nb1 = row;
        a.ck_nb2 = a.cv_nb2 = row * (size_t) layer.n_ctx;
        attn_plan fa = p;
        fa.b[0].items = 0;
        if (attn_run(c, dst, a, fa, [](dim3, const iq_cu_attn_args &) {}) != 0) {
            return -1;
        }
    }
    if (p.b[0].items == 0) {
        return 0;
    }
    const size_t row = (size_t) hd * sizeof(float);
    a.ck = (const uint8_t *) ck, a.cv = (const uint8_t *) cv;
    a.ck_nb1 = a.cv_nb1 = row;
    a.ck_nb2 = a.cv_nb2 = row * (size_t) layer.n_ctx;
    a.dk = dk, a.norm = norm;
    a.ngk = dk != nullptr ? hd / group : 0;
    a.group = group;
    attn_plan f32 = p;
    f32.b[1].items = 0;
    return attn_run(c, dst, a, f32, [&](dim3 grid, const iq_cu_attn_args & b) {
        with_units(hd, [&](auto C) {
            attn_launch<IQ_TYPE_F32, IQ_TYPE_F32, decltype(C)::value, IQ_TYPE_F16, IQ_TYPE_F16>(c, grid, b);
        });
    });
}
