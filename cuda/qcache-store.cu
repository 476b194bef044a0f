// KV_STORE and ATTENTION over the quantized (InnerQ / KIVI) caches (qcache-kernels.cuh).
//
// The regions are device tensors laid out as iq-qcache.h says, shared by the sequences of the
// pool; each sequence's counters and flush plan come from its row of the step in device memory,
// its quantized blocks from its page table there (kv-seqs.cuh), so that a decode step replays as
// one CUDA graph.
// KV_STORE writes what iq_qcache_store_head writes, byte for byte: this file is built with
// --fmad=false (CMakeLists.txt), so that the quantizer's arithmetic (iq-qcache-math.h) is
// rounded operation by operation as the C compiler rounds it. ATTENTION: a sequence of up to
// IQ_QA_MAX_Q tokens at G 32 takes a fused kernel that reads the blocks directly (qattention.cu,
// all such sequences in one launch; blocks of fp16 parameters and uniform codes); the others, one after the other, have their stored tokens
// dequantized into f32 scratch (the values iq_qcache_read_token gives) read by the plain kernel,
// with the score correction, or rounded to f16 for the tensor-core kernel where the sequence is
// a prompt batch without it (iq_cuda_attention_fa_vecs).
#include "ops.h"

#include "qcache-kernels.cuh"

#define IQ_QC_ALIGN 256
#define IQ_QC_MOVE_CTAS 16  // CTAs per (KV head, keys / values) that move a window after a flush, over the sequences

static size_t qc_align(size_t n) { return (n + IQ_QC_ALIGN - 1) / IQ_QC_ALIGN * IQ_QC_ALIGN; }

void iq_cuda_qcache_of_op(const struct iq_kv_layer * layer, struct iq_qcache * qc) {
    iq_qcache_pool_layout(qc, &layer->qcfg, layer->head_dim, layer->n_kv_head, layer->n_ctx, layer->n_slots,
                          layer->n_pages);  // checked by iq_kv_layer_of_op
    for (int r = 0; r < IQ_QREGION_COUNT; r++) {
        qc->region[r] = (uint8_t *) layer->region[r]->data;
    }
}

bool iq_cuda_qcache_supports(const struct iq_tensor * dst) {
    const struct iq_kv_layer lay = iq_cuda_layer(dst), * layer = &lay;
    const char * op = iq_op_name(dst->op);
    if (!iq_qcache_type_is_quantized(layer->type_v)) {
        iq_error_set("%s: a %s / %s cache: keys and values must both be quantized", op, iq_type_name(layer->type_k),
                     iq_type_name(layer->type_v));
        return false;
    }
    if (!iq_cuda_head_dim(layer->head_dim)) {
        iq_error_set("%s: the CUDA backend takes head_dim 64, 128 or 256 for a %s / %s cache, not %d", op,
                     iq_type_name(layer->type_k), iq_type_name(layer->type_v), layer->head_dim);
        return false;
    }
    // a flush's rows and codes in shared memory (at most 48 KiB: G 128 with head_dim 128, G 64
    // with 256); the score correction's key groups per head at most 8 (head_dim <= 256, G >= 32)
    const int32_t g = layer->qcfg.group;
    if ((size_t) g * layer->head_dim * (sizeof(iq_fp16_t) + 1) > 49152) {
        iq_error_set("%s: the CUDA backend can't take group %d with head_dim %d", op, g, layer->head_dim);
        return false;
    }
    return true;
}

bool iq_cuda_qcache_score_correction(const struct iq_kv_layer * layer) {
    return layer->qcfg.score_correction && layer->qcfg.axis_k == IQ_QAXIS_CHANNELS;
}

// The sequences of a step that are dequantized (one after the other), the first min_tokens of
// them: those of more than min_tokens tokens (every one where the fused kernel does not apply).
static int qc_dequantized(const struct iq_tensor * dst, const struct iq_qcache * qc, int * min_tokens) {
    const int64_t n = dst->src[0]->ne[2], n_seq = dst->src[IQ_KV_SRC_SEQS]->ne[1];
    if (!iq_cuda_qcache_attention_decode_supports(dst, qc)) {
        *min_tokens = 0;
        return (int) n_seq;
    }
    *min_tokens = IQ_QA_MAX_Q;
    const int64_t k = (n - n_seq) / IQ_QA_MAX_Q;  // each holds IQ_QA_MAX_Q more tokens than one
    return (int) (k < n_seq ? k : n_seq);
}

// The scratch of ATTENTION: the partial states (of the fused kernel, or of one dequantized
// sequence's attention), then the keys and values of every position of a sequence (f32 for the
// plain kernel, or f16 rows, half of it, for the tensor-core kernel), then the
// steps of the score correction; no copy where no sequence is dequantized.
struct qc_scratch {
    size_t part, kv, dk;  // bytes of each
};

static qc_scratch qc_scratch_of(const struct iq_tensor * dst, const struct iq_qcache * qc, int n_sm) {
    const struct iq_kv_layer lay = iq_cuda_layer(dst), * layer = &lay;
    const size_t rows = (size_t) layer->n_kv_head * layer->n_ctx;
    int min_tokens;
    const bool copy = qc_dequantized(dst, qc, &min_tokens) > 0;
    qc_scratch s;
    s.part = copy ? iq_cuda_attention_part_size(dst, n_sm, min_tokens, true) : 0;
    if (iq_cuda_qcache_attention_decode_supports(dst, qc)) {
        const size_t fused = iq_cuda_qcache_attention_decode_work_size(dst, qc, n_sm);
        s.part = fused > s.part ? fused : s.part;
    }
    s.part = qc_align(s.part);
    s.kv = copy ? qc_align(rows * layer->head_dim * sizeof(float)) : 0;
    s.dk = copy && iq_cuda_qcache_score_correction(layer)
               ? qc_align(rows * (layer->head_dim / layer->qcfg.group) * sizeof(float))
               : 0;
    return s;
}

size_t iq_cuda_qcache_attention_work_size(const struct iq_tensor * dst, int n_sm) {
    const struct iq_kv_layer layer = iq_cuda_layer(dst);
    struct iq_qcache qc;
    iq_cuda_qcache_of_op(&layer, &qc);
    const qc_scratch s = qc_scratch_of(dst, &qc, n_sm);
    return s.part + 2 * s.kv + s.dk;
}

static iq_cu_qcache_args qc_args(const struct iq_cuda_ctx * c, const struct iq_tensor * dst, const struct iq_qcache & qc) {
    const struct iq_tensor * k = dst->src[1], * v = dst->src[2];
    iq_cu_qcache_args a;
    a.k = (const float *) k->data, a.v = (const float *) v->data;
    a.k_nb1 = k->nb[1], a.k_nb2 = k->nb[2], a.v_nb1 = v->nb[1], a.v_nb2 = v->nb[2];
    a.norm = (float *) qc.region[IQ_QREGION_NORM];
    a.sink_k = (iq_fp16_t *) qc.region[IQ_QREGION_SINK_K];
    a.sink_v = (iq_fp16_t *) qc.region[IQ_QREGION_SINK_V];
    a.recent_k = (iq_fp16_t *) qc.region[IQ_QREGION_RECENT_K];
    a.recent_v = (iq_fp16_t *) qc.region[IQ_QREGION_RECENT_V];
    a.quant_k = qc.region[IQ_QREGION_QUANT_K];
    a.quant_v = qc.region[IQ_QREGION_QUANT_V];
    a.seqs = iq_cu_seqs_of_op(dst);
    a.kvp = a.pages = nullptr;
    a.n = 0;
    a.n_kv = qc.n_kv_head;
    a.D = qc.head_dim;
    a.G = qc.cfg.group;
    a.S = qc.cfg.n_sink;
    a.cap_recent = qc.cap_recent;
    a.cap_blocks = qc.cap_blocks;
    a.bits_k = qc.cfg.bits_k;
    a.bits_v = qc.cfg.bits_v;
    a.mode = (int) qc.cfg.mode;
    a.rope_dims = qc.cfg.rope_dims;
    a.fmt_k = iq_qcache_fmt(&qc.cfg, false);
    a.fmt_v = iq_qcache_fmt(&qc.cfg, true);
    a.k_by_channel = qc.cfg.axis_k == IQ_QAXIS_CHANNELS;
    a.v_by_channel = qc.cfg.axis_v == IQ_QAXIS_CHANNELS;
    a.block_bytes_k = qc.block_bytes_k;
    a.block_bytes_v = qc.block_bytes_v;
    // flushes of a sequence's n tokens: the window before it is below R + G rows, and the plan
    // (kv_qplan) flushes the blocks past R, so at most (G - 1 + n) / G (one in decoding); a
    // sequence of a step holds at most the step's tokens but one per other sequence
    const int64_t n_seq = a.seqs.n_seq, n_max = k->ne[2] - n_seq + 1;
    int max_flush = (int) ((a.G - 1 + n_max) / a.G);
    max_flush = max_flush < qc.cap_blocks ? max_flush : qc.cap_blocks;
    a.max_flush = max_flush > 1 ? max_flush : 1;
    a.n_copy = (int) ((IQ_QC_MOVE_CTAS + n_seq - 1) / n_seq);  // the windows that move share the CTAs
    a.moved = nullptr;
    return a;
}

size_t iq_cuda_qcache_kv_store_work_size(const struct iq_tensor * dst) {
    const struct iq_kv_layer layer = iq_cuda_layer(dst);
    if (!iq_qcache_type_is_quantized(layer.type_k)) {
        return 0;
    }
    struct iq_qcache qc;
    iq_cuda_qcache_of_op(&layer, &qc);
    return (size_t) dst->src[IQ_KV_SRC_SEQS]->ne[1] * 2 * (size_t) qc.n_kv_head * qc.cap_recent * qc.head_dim *
           sizeof(iq_fp16_t);
}

static bool iq_cuda_ok_attr(cudaError_t e) {
    if (e != cudaSuccess) {
        (void) cudaGetLastError();
        iq_error_set("kv_store: shared memory of the flush kernel: %s", cudaGetErrorString(e));
        return false;
    }
    return true;
}

int iq_cuda_qcache_kv_store(const struct iq_cuda_ctx * c, struct iq_tensor * dst) {
    const struct iq_kv_layer layer = iq_cuda_layer(dst);
    struct iq_qcache qc;
    iq_cuda_qcache_of_op(&layer, &qc);
    // the kernels carry out at most max_flush of the plan's flushes: the runtime's plan flushes
    // the blocks past R of the window, never more (kv_qplan)
    iq_cu_qcache_args a = qc_args(c, dst, qc);
    if (c->work != NULL && c->work_size >= iq_cuda_qcache_kv_store_work_size(dst)) {
        a.moved = (iq_fp16_t *) c->work;
    }
    const int n_kv = qc.n_kv_head;
    const size_t smem = (size_t) a.G * a.D * (sizeof(iq_fp16_t) + 1);
    // beside the static norms, their maxima, the row scales and the (d, m) of 8-bit parameters
    static size_t smem_set = 48 * 1024 - 2 * IQ_QCACHE_MAX_HEAD_DIM * sizeof(float) - IQ_QGROUP_MAX * sizeof(float) -
                             2 * IQ_QCACHE_MAX_HEAD_DIM * sizeof(iq_fp16_t);
    if (smem > smem_set) {  // G 128 at head_dim 128: 48 KiB of rows and codes
        if (!iq_cuda_ok_attr(cudaFuncSetAttribute(iq_cu_qstore_flush, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem))) {
            return -1;
        }
        smem_set = smem;
    }
    const unsigned n_copy = a.moved != nullptr ? (unsigned) a.n_copy : 0u, seqs = 2 * (unsigned) a.seqs.n_seq;
    iq_cu_launch(c, iq_cu_qstore_flush, dim3((unsigned) n_kv, (unsigned) a.max_flush + n_copy, seqs), a.D, smem, a);
    if (iq_cuda_launched("kv_store (flush)") != 0) {
        return -1;
    }
    iq_cu_launch(c, iq_cu_qstore_rows, dim3((unsigned) n_kv, seqs, n_copy > 0 ? n_copy : 1u), 256, 0, a);
    return iq_cuda_launched("kv_store (rows)");
}

int iq_cuda_qcache_attention(const struct iq_cuda_ctx * c, struct iq_tensor * dst) {
    const struct iq_kv_layer layer = iq_cuda_layer(dst);
    struct iq_qcache qc;
    iq_cuda_qcache_of_op(&layer, &qc);
    if (iq_cuda_qcache_attention_decode_supports(dst, &qc) && iq_cuda_qcache_attention_decode(c, dst, &qc) != 0) {
        return -1;
    }
    int min_tokens;
    const int n_copy = qc_dequantized(dst, &qc, &min_tokens);
    if (n_copy == 0) {
        return 0;
    }
    const qc_scratch s = qc_scratch_of(dst, &qc, c->n_sm);
    if (c->work_size < s.part + 2 * s.kv + s.dk) {
        iq_error_set("attention: the quantized cache's scratch is too small");
        return -1;
    }
    float * sk = (float *) ((char *) c->work + s.part);
    float * sv = (float *) ((char *) sk + s.kv);
    float * dk = s.dk > 0 ? (float *) ((char *) sv + s.kv) : nullptr;
    const int ngk = dk != nullptr ? qc.head_dim / qc.cfg.group : 0;
    const iq_cu_qcache_args a = qc_args(c, dst, qc);
    const int fa_vecs = iq_cuda_attention_fa_vecs(dst);
    // enough blocks to stream a sequence; each loops over its share of [0, n_past) * D
    const int64_t elems = (int64_t) qc.n_ctx * qc.head_dim;
    int64_t nb = (elems + 255) / 256;
    nb = nb < 1024 ? nb : 1024;
    const dim3 grid((unsigned) nb, (unsigned) qc.n_kv_head);
    iq_cu_sched sc = {};
    sc.qt = 1, sc.r = (int) (dst->src[0]->ne[1] / qc.n_kv_head);
    sc.min_tokens = min_tokens, sc.fa = -1, sc.fa_vecs = 1, sc.work = 1, sc.max_split = 1;
    for (int which = 0; which < n_copy; which++) {
        sc.which = which;
        iq_cu_qcache_dequant<<<grid, 256, 0, c->stream>>>(a, sc, fa_vecs, qc.n_ctx, sk, sv, dk, ngk);
        if (iq_cuda_launched("attention (dequantize)") != 0 ||
            iq_cuda_attention_scratch(c, dst, min_tokens, which, sk, sv, dk, a.norm, qc.cfg.group) != 0) {
            return -1;
        }
    }
    return 0;
}
