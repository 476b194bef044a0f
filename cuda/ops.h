// The CUDA ops: one launch function per op, called by the backend (cuda-backend.c) in graph
// order on one stream. Each reads its sources from the tensor structs (host memory; their
// data fields are device addresses) and queues its kernels; 0, or -1 + iq_error_set.
#pragma once

#include "iq.h"
#include "iq-kv.h"

#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

struct iq_cuda_ctx {
    cudaStream_t stream;
    int n_sm;
    float * work;              // scratch of the op (attention's partial states), work_size bytes
    size_t work_size;
    int * error;               // device flag an op raises on bad input (get_rows' ids), read after the graph
    block_q8_1 * xq;           // MUL_MAT's q8_1 copy of x (the matvec of the 32-element formats) ...
    bool xq_ready;             // ... already made by an earlier product of the same x
    bool xt_ready;             // ... and its tiles for many columns (iq_cuda_mul_mat_tiles) too
};

// Kernel choices that a rule of shapes makes, forced so that tests reach every kernel with the
// same cases (tests/test_cuda_fa.py, tests/test_cuda_qattn.py). All 0 in the shipped library:
// only iq_cuda_set_variant changes them, which libinnerq_test.so exports and libinnerq.so does
// not (src/innerq.map). Set before the graphs that should see them: a captured graph replays
// the kernels it was captured with.
struct iq_cuda_variants {
    bool fa_f32;     // "fa_f32" 1: prompt batches on the f32 attention kernel, not the tensor-core one
    int qattn;       // "qattn": IQ_QATTN_DP4A the CTA kernel, IQ_QATTN_MMA the warp kernel wherever it applies
    bool win_rows;   // "win_rows" 1: the fused kernels read window rows one per lane, not through tiles
    int qw_win;      // "qw_win" n > 0: the warp kernel's window CTAs per head (at most qw_n_win's bound)
    int mvq;         // "mvq" IQ_MVQ_WARP_SLOTS: products of 9-64 columns on iq_cu_mvq, not iq_cu_mvq_tile
    bool gemm_w16;   // "gemm_w16" 1: the GEMM of the 32-element formats on W's f16 copy, not iq_cu_gemm_wq
};
enum { IQ_MVQ_AUTO = 0, IQ_MVQ_WARP_SLOTS = 1 };
enum { IQ_QATTN_AUTO = 0, IQ_QATTN_DP4A = 1, IQ_QATTN_MMA = 2 };
extern struct iq_cuda_variants iq_cuda_variants;
// Sets the variant named (a field above) to value: 0, or -1 + iq_error_set for an unknown name.
int iq_cuda_set_variant(const char * name, int value);

// A value set on the error flag: which op raised it.
enum { IQ_CUDA_ERR_GET_ROWS = 1 };

// The layer of a KV cache op already checked (iq_cuda_supports). The ops' kernels read the
// step's sequences (their counters, token ranges and slots) and the page table from the op's
// sources in device memory (kv-seqs.cuh), so that a replayed CUDA graph reads the current ones;
// launch grids depend on shapes only.
static inline struct iq_kv_layer iq_cuda_layer(const struct iq_tensor * dst) {
    struct iq_kv_layer layer;
    iq_kv_layer_of_op(dst, &layer);
    return layer;
}
// The head dims the attention kernels are built for (plain and quantized caches).
static inline bool iq_cuda_head_dim(int32_t hd) { return hd == 64 || hd == 128 || hd == 256; }
// The layout of a quantized layer's pool, its regions at device addresses (every slot, every
// page; no sequence's view: the kernels take theirs from the step's rows).
void iq_cuda_qcache_of_op(const struct iq_kv_layer * layer, struct iq_qcache * qc);

// Whether the op can run on the GPU (false + iq_error_set saying why).
bool iq_cuda_supports(const struct iq_tensor * t);
// Bytes of scratch the op needs (iq_cuda_ctx.work).
size_t iq_cuda_work_size(const struct iq_tensor * t, int n_sm);

// ATTENTION / KV_STORE (attention.cu): the cache types and shapes the kernels take, and the
// partial states of split positions.
bool iq_cuda_attention_supports(const struct iq_tensor * dst);
size_t iq_cuda_attention_work_size(const struct iq_tensor * dst, int n_sm);
// The query vectors (tokens x query heads per KV head) from which a sequence of the op takes
// the tensor-core kernel of prompt batches (attention-fa.cuh), or 0 where it takes none: head_dim
// 64 / 128 (256: the f32 kernel), an f16 cache (16-byte aligned rows) or a quantized one without
// the score correction, 16-byte aligned batch rows, the f32 kernel not forced
// (iq_cuda_variants.fa_f32).
int iq_cuda_attention_fa_vecs(const struct iq_tensor * dst);
// The partial states of split positions (the first bytes of the scratch) over the op's
// sequences of more than min_tokens tokens (one: over one of them), and the attention of the
// which-th of those over its tokens dequantized into scratch (a quantized cache, qcache-store.cu):
// f32 rows ck, cv [n_kv_head][n_ctx][head_dim] (tokens < n_past) read by the f32 kernel, minus the
// score correction of steps dk [n_kv_head][n_ctx][head_dim / group] with the key norms of its
// slot (norm: the region, [n_slots][n_kv_head][head_dim]; dk NULL: none), or, where the sequence
// takes the tensor-core kernel, the same values rounded to f16 rows at ck / cv (its operands
// are f16, attention-fa.cuh).
size_t iq_cuda_attention_part_size(const struct iq_tensor * dst, int n_sm, int min_tokens, bool one);
int iq_cuda_attention_scratch(const struct iq_cuda_ctx * c, struct iq_tensor * dst, int min_tokens, int which,
                              const void * ck, const void * cv, const float * dk, const float * norm, int group);

// The fused decode attention over an InnerQ cache with G = 32 (qattention.cu): K and V bits 2-5,
// head_dim 64, 128 or 256 (256: the CTA kernel only), at most 8 query heads per KV head,
// normalization and score correction on or off; it takes the sequences of at most IQ_QA_MAX_Q
// tokens (the others: the dequantized path). qc: the pool's layout (iq_cuda_qcache_of_op); the
// sequences' counters are read on the device, the grid depends on the shapes only. A
// sliding-window layer (a layer without blocks, cap_blocks 0) reads its sink and recent rows.
#define IQ_QA_MAX_Q 4
bool iq_cuda_qcache_attention_decode_supports(const struct iq_tensor * dst, const struct iq_qcache * qc);
size_t iq_cuda_qcache_attention_decode_work_size(const struct iq_tensor * dst, const struct iq_qcache * qc, int n_sm);
int iq_cuda_qcache_attention_decode(const struct iq_cuda_ctx * c, struct iq_tensor * dst, const struct iq_qcache * qc);

// A small f32 W (the cache's rotation) times f32 rows, in f32 (ops.cu), and a ROPE fused with
// such a product that reads it (the rotation of queries and keys): whether, and the launch.
bool iq_cuda_mul_mat_small(const struct iq_tensor * dst);
int iq_cuda_mul_mat_small_f32(const struct iq_cuda_ctx * c, struct iq_tensor * dst);
bool iq_cuda_rope_rot_fuses(const struct iq_tensor * rope, const struct iq_tensor * mm);
int iq_cuda_rope_rot(const struct iq_cuda_ctx * c, struct iq_tensor * rope, struct iq_tensor * mm);
// The same product where W is flagged IQ_FLAG_HADAMARD (D 64, 128, 256): a fast Walsh-Hadamard
// transform per row (ops-kernels.cuh), with the ROPE whose rows it reads fused (rope, or NULL);
// and whether the q8_1 copy of its result for the next product (next, a MUL_MAT of the same
// bytes) comes with it (xq: the copy, or NULL).
// Rotations of the same W (q, k, v) in one launch, n <= 3 parts: whether part b joins parts[0 ..
// n) (no part writes over another's bytes); xq only for one part.
struct iq_cuda_rot {
    struct iq_tensor * mm, * rope;  // the rotation, the ROPE it reads (or NULL)
    bool rope_out;                  // the rope's rows are read by another node too: written out
};
bool iq_cuda_hadamard_fits(const struct iq_tensor * mm, const struct iq_tensor * rope);
bool iq_cuda_hadamard_fuses_xq(const struct iq_tensor * mm, const struct iq_tensor * next);
bool iq_cuda_hadamard_joins(const struct iq_cuda_rot * parts, int n, const struct iq_cuda_rot * b);
int iq_cuda_hadamard(const struct iq_cuda_ctx * c, const struct iq_cuda_rot * parts, int n, block_q8_1 * xq);
// Products of one x in one launch (q, k, v; gate, up: the matvec of the 32-element formats,
// and the GEMM on their blocks): whether b joins a's launch, and the launch of dst[0 .. n), n <= 3.
bool iq_cuda_mul_mat_joins(const struct iq_cuda_ctx * c, const struct iq_tensor * a, const struct iq_tensor * b);
int iq_cuda_mul_mat_group(const struct iq_cuda_ctx * c, struct iq_tensor * const * dst, int n);
size_t iq_cuda_mul_mat_work_size(const struct iq_tensor * dst);
// Bytes of the q8_1 copy of x the product reads (0: it reads x as it is), and of one of m rows
// of k elements (0 where products of so many columns read x as it is).
size_t iq_cuda_mul_mat_xq_size(const struct iq_tensor * dst);
size_t iq_cuda_xq_size(int64_t k, int64_t m);
// Whether the product reads x as the q8_1 tiles of many columns (iq_cu_mvq), which it makes
// after the q8_1 copy unless iq_cuda_ctx.xt_ready.
bool iq_cuda_mul_mat_tiles(const struct iq_tensor * dst);
// Whether the product takes the GEMM on W's blocks (iq_cu_gemm_wq: x as f16 in the scratch, no
// q8_1 copy).
bool iq_cuda_mul_mat_gemm_wq(const struct iq_tensor * dst);
// Whether this build holds code the current device runs (its own architecture, or PTX that
// can be compiled for it).
bool iq_cuda_has_kernels_for_device(void);

int iq_cuda_get_rows(const struct iq_cuda_ctx * c, struct iq_tensor * dst);
// RMS_NORM as one launch with its neighbours in the graph: the ADD whose sum it normalizes
// (add, or NULL), the MUL by one weight row that follows it (mul, iq_cuda_rms_norm_fuses, or
// NULL), and the q8_1 copy of the result the next products read (xq, or NULL).
struct iq_cuda_chain {
    struct iq_tensor * add, * norm, * mul;
    block_q8_1 * xq;
};
bool iq_cuda_rms_norm_fuses(const struct iq_tensor * norm, const struct iq_tensor * next);
int iq_cuda_norm_chain(const struct iq_cuda_ctx * c, const struct iq_cuda_chain * ch);
int iq_cuda_binary(const struct iq_cuda_ctx * c, struct iq_tensor * dst);  // MUL, ADD
int iq_cuda_swiglu(const struct iq_cuda_ctx * c, struct iq_tensor * dst);
// SWIGLU that also writes the q8_1 copy of its result (xq, iq_cuda_xq_size of it) for the
// product that reads it next; where iq_cuda_swiglu_fuses_xq.
bool iq_cuda_swiglu_fuses_xq(const struct iq_cuda_ctx * c, const struct iq_tensor * dst);
int iq_cuda_swiglu_xq(const struct iq_cuda_ctx * c, struct iq_tensor * dst, block_q8_1 * xq);
int iq_cuda_rope(const struct iq_cuda_ctx * c, struct iq_tensor * dst);
int iq_cuda_mul_mat(const struct iq_cuda_ctx * c, struct iq_tensor * dst);
int iq_cuda_attention(const struct iq_cuda_ctx * c, struct iq_tensor * dst);
int iq_cuda_kv_store(const struct iq_cuda_ctx * c, struct iq_tensor * dst);

// The quantized (InnerQ / KIVI) caches (qcache-store.cu): KV_STORE (rows into the sink and the
// window, flushes quantized on the device, byte-identical to iq_qcache_store_head) and
// ATTENTION by dequantizing the stored tokens into f32 scratch read by the plain kernel (any
// number of queries); what the GPU takes (false + iq_error_set) and the scratch it needs.
bool iq_cuda_qcache_supports(const struct iq_tensor * dst);
// Whether the layer's quantized cache has the score correction on (keys grouped along channels).
bool iq_cuda_qcache_score_correction(const struct iq_kv_layer * layer);
size_t iq_cuda_qcache_attention_work_size(const struct iq_tensor * dst, int n_sm);
int iq_cuda_qcache_kv_store(const struct iq_cuda_ctx * c, struct iq_tensor * dst);
// KV_STORE's scratch (0: none): where the window's rows go while it moves after a flush.
size_t iq_cuda_qcache_kv_store_work_size(const struct iq_tensor * dst);
int iq_cuda_qcache_attention(const struct iq_cuda_ctx * c, struct iq_tensor * dst);
// The type switch of a kernel template over the weight types (mul-mat.cu, ops.cu).
bool iq_cuda_weight_type(enum iq_type type);
// -1 + iq_error_set if the last launch failed.
int iq_cuda_launched(const char * what);

#ifdef __cplusplus
}
#endif
