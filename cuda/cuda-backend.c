// The CUDA backend (iq-cuda.h): device buffers, and graphs run node by node on one stream.
//
// A graph whose nodes, shapes and addresses equal the previous call's (decoding: one token
// after another) is captured once into a CUDA graph and replayed, a few microseconds for the
// hundreds of launches of a token. What changes from token to token is data: the inputs
// (tokens, positions, and the step's rows of the cache ops: each sequence's slot, tokens, n_past,
// and for quantized caches n_sink, n_quant and the flush plan; iq-kv.h), set in device memory
// before the run, and the page tables, kept there. Kernels read them there (cuda/kv-seqs.cuh),
// the launches' grids depend on shapes only (the number of sequences is one), and a CTA with
// nothing to do exits, so the same launches run whether captured or not.
#include "iq-cuda.h"

#include "ops.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CUDA_ALIGNMENT 256

struct cuda_key {  // what must repeat for a captured graph to be replayed
    int32_t op, type;
    int64_t ne[4];
    size_t nb[4];
    const void * data;
    int32_t op_params[IQ_MAX_OP_PARAMS];
    const void * src_data[IQ_MAX_SRC];
    int64_t src_ne[IQ_MAX_SRC][4];
    size_t src_nb[IQ_MAX_SRC][4];
    int32_t src_type[IQ_MAX_SRC];
};

struct cuda_backend {
    int device;
    int n_sm;
    cudaStream_t stream;
    float * work;               // op scratch, grown to the largest need
    size_t work_size;
    block_q8_1 * xq;            // products' q8_1 copies of x (iq_cuda_ctx.xq)
    size_t xq_size;
    int * error;                // device flag (iq_cuda_ctx.error)
    struct cuda_key * key;      // the last graph's
    int key_nodes, key_cap;
    bool key_valid;
    cudaGraphExec_t exec;       // its capture, once it came twice
};

static bool cuda_ok(cudaError_t e, const char * what) {
    if (e != cudaSuccess) {
        cudaGetLastError();  // clear a sticky-free error so later calls don't see it
        iq_error_set("CUDA: %s: %s", what, cudaGetErrorString(e));
        return false;
    }
    return true;
}

int iq_cuda_device_count(void) {
    int n = 0;
    if (!cuda_ok(cudaGetDeviceCount(&n), "no usable device")) {
        return 0;
    }
    return n;
}

int iq_cuda_device_info(int device, char * desc, size_t n, size_t * free_bytes, size_t * total_bytes) {
    struct cudaDeviceProp prop;
    int current = 0;
    if (!cuda_ok(cudaGetDeviceProperties(&prop, device), "device properties") ||
        !cuda_ok(cudaGetDevice(&current), "current device") || !cuda_ok(cudaSetDevice(device), "set device")) {
        return -1;
    }
    snprintf(desc, n, "%s", prop.name);
    const bool ok = cuda_ok(cudaMemGetInfo(free_bytes, total_bytes), "memory info");
    cudaSetDevice(current);
    return ok ? 0 : -1;
}

struct iq_cuda_variants iq_cuda_variants;

int iq_cuda_set_variant(const char * name, int value) {
    if (strcmp(name, "fa_f32") == 0) {
        iq_cuda_variants.fa_f32 = value != 0;
    } else if (strcmp(name, "qattn") == 0 && value >= IQ_QATTN_AUTO && value <= IQ_QATTN_MMA) {
        iq_cuda_variants.qattn = value;
    } else if (strcmp(name, "win_rows") == 0) {
        iq_cuda_variants.win_rows = value != 0;
    } else if (strcmp(name, "qw_win") == 0 && value >= 0) {
        iq_cuda_variants.qw_win = value;
    } else if (strcmp(name, "mvq") == 0 && value >= IQ_MVQ_AUTO && value <= IQ_MVQ_WARP_SLOTS) {
        iq_cuda_variants.mvq = value;
    } else if (strcmp(name, "gemm_w16") == 0) {
        iq_cuda_variants.gemm_w16 = value != 0;
    } else {
        iq_error_set("CUDA: no kernel variant %s = %d", name, value);
        return -1;
    }
    return 0;
}

// ---- buffers ----

static void cuda_buffer_free(iq_buffer * buf) {
    cudaFree(buf->base);
    free(buf);
}

static void cuda_buffer_set(iq_buffer * buf, struct iq_tensor * t, const void * data, size_t offset, size_t size) {
    cuda_ok(cudaMemcpy((char *) t->data + offset, data, size, cudaMemcpyHostToDevice), "set");
}

static void cuda_buffer_get(iq_buffer * buf, const struct iq_tensor * t, void * data, size_t offset, size_t size) {
    cuda_ok(cudaMemcpy(data, (const char *) t->data + offset, size, cudaMemcpyDeviceToHost), "get");
}

static void cuda_buffer_clear(iq_buffer * buf, uint8_t value) {
    cuda_ok(cudaMemset(buf->base, value, buf->size), "clear");
}

// Host and device memory alike: unified addressing tells the copy which it is.
static bool cuda_buffer_copy_tensor(iq_buffer * buf, struct iq_tensor * dst, const struct iq_tensor * src) {
    return cuda_ok(cudaMemcpy(dst->data, src->data, iq_nbytes(src), cudaMemcpyDefault), "copy");
}

static iq_buffer * cuda_alloc_buffer(iq_backend * be, size_t size) {
    struct cuda_backend * cb = be->context;
    iq_buffer * buf = calloc(1, sizeof(*buf));
    if (buf == NULL) {
        iq_error_set("CUDA buffer: out of host memory");
        return NULL;
    }
    void * base = NULL;
    if (!cuda_ok(cudaSetDevice(cb->device), "set device") ||
        !cuda_ok(cudaMalloc(&base, size > 0 ? size : CUDA_ALIGNMENT), "device memory")) {
        char msg[256];
        snprintf(msg, sizeof(msg), "%s", iq_error_get());
        iq_error_set("%s (a buffer of %.1f MiB on device %d)", msg, size / 1048576.0, cb->device);
        free(buf);
        return NULL;
    }
    buf->iface = (struct iq_buffer_i) { cuda_buffer_free, cuda_buffer_set, cuda_buffer_get, cuda_buffer_clear,
                                        cuda_buffer_copy_tensor };
    buf->backend = be;
    buf->base = base;
    buf->size = size;
    buf->is_host = false;
    return buf;
}

// ---- ops ----

static bool cuda_node_runs(const struct iq_tensor * t) { return t->op != IQ_OP_NONE && t->op != IQ_OP_VIEW; }

bool iq_cuda_supports(const struct iq_tensor * t) {
    switch (t->op) {
    case IQ_OP_GET_ROWS:
    case IQ_OP_MUL_MAT:
        if (!iq_cuda_weight_type(t->src[0]->type)) {
            iq_error_set("%s: the CUDA backend can't read %s", iq_op_name(t->op), iq_type_name(t->src[0]->type));
            return false;
        }
        if (t->src[0]->ne[0] % 32 != 0) {
            iq_error_set("%s: rows of %lld elements; the CUDA backend takes multiples of 32", iq_op_name(t->op),
                         (long long) t->src[0]->ne[0]);
            return false;
        }
        if (t->op == IQ_OP_MUL_MAT && t->src[1]->nb[2] != t->src[1]->nb[1] * (size_t) t->src[1]->ne[1]) {
            iq_error_set("mul_mat: the CUDA backend takes x as rows one after the other");
            return false;
        }
        return true;
    case IQ_OP_RMS_NORM:
    case IQ_OP_MUL:
    case IQ_OP_ADD:
    case IQ_OP_SWIGLU:
    case IQ_OP_GEGLU:
    case IQ_OP_ROPE:
        return true;
    case IQ_OP_ATTENTION:
    case IQ_OP_KV_STORE:
        return iq_cuda_attention_supports(t);
    default:
        iq_error_set("CUDA backend: op %s is not supported", iq_op_name(t->op));
        return false;
    }
}

size_t iq_cuda_work_size(const struct iq_tensor * t, int n_sm) {
    return t->op == IQ_OP_ATTENTION  ? iq_cuda_attention_work_size(t, n_sm)
           : t->op == IQ_OP_MUL_MAT  ? iq_cuda_mul_mat_work_size(t)
           : t->op == IQ_OP_KV_STORE ? iq_cuda_qcache_kv_store_work_size(t)
                                     : 0;
}

static int cuda_run_node(const struct iq_cuda_ctx * c, struct iq_tensor * t) {
    switch (t->op) {
    case IQ_OP_GET_ROWS: return iq_cuda_get_rows(c, t);
    case IQ_OP_RMS_NORM: {
        const struct iq_cuda_chain ch = { .norm = t };
        return iq_cuda_norm_chain(c, &ch);
    }
    case IQ_OP_MUL:
    case IQ_OP_ADD: return iq_cuda_binary(c, t);
    case IQ_OP_MUL_MAT: return iq_cuda_mul_mat(c, t);
    case IQ_OP_ROPE: return iq_cuda_rope(c, t);
    case IQ_OP_SWIGLU:
    case IQ_OP_GEGLU: return iq_cuda_swiglu(c, t);
    case IQ_OP_ATTENTION: return iq_cuda_attention(c, t);
    case IQ_OP_KV_STORE: return iq_cuda_kv_store(c, t);
    default: iq_error_set("CUDA backend: op %s is not supported", iq_op_name(t->op)); return -1;
    }
}

// ---- graphs ----

static void cuda_drop_exec(struct cuda_backend * cb) {
    if (cb->exec != NULL) {
        cudaGraphExecDestroy(cb->exec);
        cb->exec = NULL;
    }
}

// Checks the nodes and sizes the scratch; -1 + message if one can't run.
static int cuda_graph_prepare(struct cuda_backend * cb, struct iq_cgraph * g) {
    size_t work = 0, xq_size = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const struct iq_tensor * t = g->nodes[i];
        if (!cuda_node_runs(t)) {
            continue;
        }
        if (t->data == NULL) {
            iq_error_set("CUDA backend: tensor '%s' (%s) has no memory; allocate the graph first", t->name,
                         iq_op_name(t->op));
            return -1;
        }
        for (int j = 0; j < IQ_MAX_SRC; j++) {
            if (t->src[j] != NULL && t->src[j]->data == NULL) {
                iq_error_set("CUDA backend: source '%s' of '%s' has no data", t->src[j]->name, t->name);
                return -1;
            }
            const struct iq_tensor * s = t->src[j];
            while (s != NULL && s->buffer == NULL && s->view_src != NULL) {
                s = s->view_src;
            }
            if (s != NULL && s->buffer != NULL && s->buffer->is_host) {
                iq_error_set("CUDA backend: source '%s' of '%s' is in host memory", t->src[j]->name, t->name);
                return -1;
            }
        }
        if (!iq_cuda_supports(t)) {
            return -1;
        }
        const size_t w = iq_cuda_work_size(t, cb->n_sm);
        work = w > work ? w : work;
        const size_t xq = t->op == IQ_OP_MUL_MAT ? iq_cuda_mul_mat_xq_size(t) : 0;
        xq_size = xq > xq_size ? xq : xq_size;
    }
    if (work > cb->work_size) {
        cuda_drop_exec(cb);  // the captured launches point to the old scratch
        cudaFree(cb->work);
        cb->work = NULL;
        cb->work_size = 0;
        if (!cuda_ok(cudaMalloc((void **) &cb->work, work), "scratch memory")) {
            return -1;
        }
        cb->work_size = work;
    }
    if (xq_size > cb->xq_size) {
        cuda_drop_exec(cb);
        cudaFree(cb->xq);
        cb->xq = NULL;
        cb->xq_size = 0;
        if (!cuda_ok(cudaMalloc((void **) &cb->xq, xq_size), "scratch memory")) {
            return -1;
        }
        cb->xq_size = xq_size;
    }
    return 0;
}

static void cuda_key_of(const struct iq_tensor * t, struct cuda_key * k) {
    memset(k, 0, sizeof(*k));
    k->op = t->op;
    k->type = t->type;
    memcpy(k->ne, t->ne, sizeof(k->ne));
    memcpy(k->nb, t->nb, sizeof(k->nb));
    k->data = t->data;
    memcpy(k->op_params, t->op_params, sizeof(k->op_params));
    for (int j = 0; j < IQ_MAX_SRC; j++) {
        const struct iq_tensor * s = t->src[j];
        if (s != NULL) {
            k->src_data[j] = s->data;
            k->src_type[j] = s->type;
            memcpy(k->src_ne[j], s->ne, sizeof(k->src_ne[j]));
            memcpy(k->src_nb[j], s->nb, sizeof(k->src_nb[j]));
        }
    }
}

// Whether g repeats the last graph; records g's key as the last one.
static bool cuda_graph_repeats(struct cuda_backend * cb, struct iq_cgraph * g) {
    if (g->n_nodes > cb->key_cap) {
        struct cuda_key * k = realloc(cb->key, (size_t) g->n_nodes * sizeof(*k));
        if (k == NULL) {
            cb->key_valid = false;
            return false;
        }
        cb->key = k;
        cb->key_cap = g->n_nodes;
    }
    bool same = cb->key_valid && cb->key_nodes == g->n_nodes;
    for (int i = 0; i < g->n_nodes; i++) {
        struct cuda_key k;
        cuda_key_of(g->nodes[i], &k);
        if (same && memcmp(&k, &cb->key[i], sizeof(k)) != 0) {
            same = false;
        }
        cb->key[i] = k;
    }
    cb->key_nodes = g->n_nodes;
    cb->key_valid = true;
    return same;
}

static bool cuda_overlaps(const struct iq_tensor * t, const void * p, size_t n) {
    const char * a = t->data, * b = p;
    return a < b + n && b < a + iq_nbytes(t);
}

// The runnable node after node i (g->n_nodes if none).
static int cuda_next_node(const struct iq_cgraph * g, int i) {
    for (i++; i < g->n_nodes && !cuda_node_runs(g->nodes[i]); i++) {
    }
    return i;
}

// Whether a node after node i reads t (or a view of it), or the host does.
static bool cuda_read_after(const struct iq_cgraph * g, int i, const struct iq_tensor * t) {
    if (t->flags & IQ_FLAG_OUTPUT) {
        return true;
    }
    for (i++; i < g->n_nodes; i++) {
        for (int j = 0; j < IQ_MAX_SRC; j++) {
            for (const struct iq_tensor * s = g->nodes[i]->src[j]; s != NULL; s = s->view_src) {
                if (s == t) {
                    return true;
                }
            }
        }
    }
    return false;
}

// The cache's rotation at node i (iq_cuda_hadamard_fits): a MUL_MAT, or a ROPE and the MUL_MAT
// that reads it (the rope's rows written out only where another node reads them). Fills *r; the
// index of the last node it takes (-1: none).
static int cuda_rotation_at(const struct iq_cgraph * g, int i, struct iq_cuda_rot * r) {
    struct iq_tensor * t = g->nodes[i];
    const int next = cuda_next_node(g, i);
    *r = (struct iq_cuda_rot) { 0 };
    if (t->op == IQ_OP_MUL_MAT && iq_cuda_hadamard_fits(t, NULL)) {
        r->mm = t;
        return i;
    }
    if (t->op == IQ_OP_ROPE && next < g->n_nodes && iq_cuda_hadamard_fits(g->nodes[next], t)) {
        r->mm = g->nodes[next], r->rope = t;
        r->rope_out = cuda_read_after(g, next, t);
        return next;
    }
    return -1;
}

// No byte of t's output is one of the outputs of group[0 .. n).
static bool cuda_group_apart(struct iq_tensor * const * group, int n, const struct iq_tensor * t) {
    for (int j = 0; j < n; j++) {
        if (cuda_overlaps(t, group[j]->data, iq_nbytes(group[j]))) {
            return false;
        }
    }
    return true;
}

// The nodes in order. Neighbours share launches and data: an ADD, the RMS_NORM of its sum and
// the MUL by the norm's weight row run as one launch (iq_cuda_norm_chain), which also makes
// the q8_1 copy of its result that the next products read; products of the same x (q, k, v;
// gate, up) quantize it once, and neighbours among them (the model builds q, k, v next to each
// other) are one launch; a ROPE and the cache's rotation of its result are one launch, and so
// are neighbouring rotations (q, k, v); the rotation of the attention's output also makes the
// output projection's q8_1 copy. A copy of x holds until a node writes over x.
static int cuda_run_nodes(struct cuda_backend * cb, struct iq_cgraph * g) {
    struct iq_cuda_ctx c = { .stream = cb->stream, .n_sm = cb->n_sm, .work = cb->work, .work_size = cb->work_size,
                             .error = cb->error, .xq = cb->xq };
    const struct iq_tensor * xq_of = NULL;  // the x whose q8_1 copy is in cb->xq
    bool xt_of = false;                     // ... and whether its tiles are there too (a product of many columns)
    for (int i = 0; i < g->n_nodes; i++) {
        struct iq_tensor * t = g->nodes[i];
        if (!cuda_node_runs(t)) {
            continue;
        }
        const int first = i;
        const struct iq_tensor * made_xq = NULL;
        bool made_xt = false;
        int rc;
        int next = cuda_next_node(g, i);
        struct iq_cuda_chain ch = { 0 };
        struct iq_cuda_rot rot[3];
        int last;
        // (the fused kernel reads both operands whole: not for a bias broadcast over the rows)
        if (t->op == IQ_OP_ADD && next < g->n_nodes && g->nodes[next]->op == IQ_OP_RMS_NORM &&
            g->nodes[next]->src[0] == t && iq_nrows(t->src[1]) == iq_nrows(t)) {
            ch.add = t;
            i = next;
            next = cuda_next_node(g, i);
        }
        if (g->nodes[i]->op == IQ_OP_RMS_NORM) {
            ch.norm = g->nodes[i];
            if (next < g->n_nodes && iq_cuda_rms_norm_fuses(ch.norm, g->nodes[next])) {
                ch.mul = g->nodes[next];
                i = next;
            }
            const struct iq_tensor * out = ch.mul != NULL ? ch.mul : ch.norm;
            const size_t need = iq_cuda_xq_size(out->ne[0], iq_nrows(out));
            if (need > 0 && need <= cb->xq_size) {
                ch.xq = cb->xq;
                made_xq = out;
            }
            rc = iq_cuda_norm_chain(&c, &ch);
        } else if ((last = cuda_rotation_at(g, i, &rot[0])) >= 0) {
            // the cache's rotations: of q and k (with their ropes) and v in one launch; of the
            // attention's output with the q8_1 copy the output projection reads
            int n = 1;
            i = last;
            next = cuda_next_node(g, i);
            while (n < 3 && next < g->n_nodes && (last = cuda_rotation_at(g, next, &rot[n])) >= 0 &&
                   iq_cuda_hadamard_joins(rot, n, &rot[n])) {
                n++;
                i = last;
                next = cuda_next_node(g, i);
            }
            block_q8_1 * xq = NULL;
            if (n == 1 && rot[0].rope == NULL && next < g->n_nodes &&
                iq_cuda_hadamard_fuses_xq(rot[0].mm, g->nodes[next]) &&
                iq_cuda_mul_mat_xq_size(g->nodes[next]) <= cb->xq_size) {
                xq = cb->xq;
                made_xq = g->nodes[next]->src[1];
            }
            rc = iq_cuda_hadamard(&c, rot, n, xq);
        } else if (t->op == IQ_OP_MUL_MAT) {
            const struct iq_tensor * x = t->src[1];
            const size_t xq = iq_cuda_mul_mat_xq_size(t);
            c.xq_ready = xq > 0 && xq_of != NULL && xq_of->data == x->data && iq_nbytes(xq_of) == iq_nbytes(x) &&
                         xq_of->ne[0] == x->ne[0];
            c.xt_ready = c.xq_ready && xt_of;
            // the products of the same x that follow (k and v after q, up after gate) join its launch
            struct iq_tensor * group[3] = { t };
            int n = 1;
            const bool gemm = iq_cuda_mul_mat_gemm_wq(t);
            while (n < 3 && next < g->n_nodes && ((xq > 0 && xq <= cb->xq_size) || gemm) &&
                   iq_cuda_mul_mat_joins(&c, t, g->nodes[next]) && cuda_group_apart(group, n, g->nodes[next])) {
                group[n++] = g->nodes[next];
                i = next;
                next = cuda_next_node(g, i);
            }
            rc = n > 1 ? iq_cuda_mul_mat_group(&c, group, n) : iq_cuda_mul_mat(&c, t);
            made_xq = xq > 0 ? x : NULL;
            made_xt = xq > 0 && (c.xt_ready || iq_cuda_mul_mat_tiles(t));
        } else if (t->op == IQ_OP_ROPE && next < g->n_nodes && iq_cuda_rope_rot_fuses(t, g->nodes[next])) {
            rc = iq_cuda_rope_rot(&c, t, g->nodes[next]);  // the rope's rows rotated as they are made
            i = next;
        } else if (t->op == IQ_OP_SWIGLU && next < g->n_nodes && g->nodes[next]->op == IQ_OP_MUL_MAT &&
                   g->nodes[next]->src[1] == t && iq_cuda_mul_mat_xq_size(g->nodes[next]) > 0 &&
                   iq_cuda_mul_mat_xq_size(g->nodes[next]) <= cb->xq_size && iq_cuda_swiglu_fuses_xq(&c, t)) {
            rc = iq_cuda_swiglu_xq(&c, t, cb->xq);  // the down projection's x, quantized with it
            made_xq = t;
        } else {
            rc = cuda_run_node(&c, t);
        }
        if (rc != 0) {
            return -1;
        }
        for (int j = first; xq_of != NULL && j <= i; j++) {
            if (cuda_node_runs(g->nodes[j]) && cuda_overlaps(g->nodes[j], xq_of->data, iq_nbytes(xq_of))) {
                xq_of = NULL;  // its x was overwritten
            }
        }
        if (made_xq != NULL) {
            xq_of = made_xq;
            xt_of = made_xt;
        }
    }
    return 0;
}

static int cuda_capture(struct cuda_backend * cb, struct iq_cgraph * g) {
    cudaGraph_t graph = NULL;
    if (!cuda_ok(cudaStreamBeginCapture(cb->stream, cudaStreamCaptureModeThreadLocal), "graph capture")) {
        return -1;
    }
    const int rc = cuda_run_nodes(cb, g);
    const cudaError_t e = cudaStreamEndCapture(cb->stream, &graph);
    if (rc != 0 || !cuda_ok(e, "graph capture") || !cuda_ok(cudaGraphInstantiate(&cb->exec, graph, 0), "graph instantiate")) {
        cb->exec = NULL;
        if (graph != NULL) {
            cudaGraphDestroy(graph);
        }
        return -1;
    }
    cudaGraphDestroy(graph);
    return 0;
}

static int cuda_synchronize(iq_backend * be) {
    struct cuda_backend * cb = be->context;
    int flag = 0;
    if (!cuda_ok(cudaStreamSynchronize(cb->stream), "compute") ||
        !cuda_ok(cudaMemcpy(&flag, cb->error, sizeof(flag), cudaMemcpyDeviceToHost), "error flag")) {
        return -1;
    }
    if (flag != 0) {
        cudaMemset(cb->error, 0, sizeof(int));
        if (flag & IQ_CUDA_ERR_GET_ROWS) {
            iq_error_set("get_rows: a row id outside its table");
        }
        return -1;
    }
    return 0;
}

static int cuda_graph_compute(iq_backend * be, struct iq_cgraph * g) {
    struct cuda_backend * cb = be->context;
    if (!cuda_ok(cudaSetDevice(cb->device), "set device") || cuda_graph_prepare(cb, g) != 0) {
        return -1;
    }
    int rc;
    if (cuda_graph_repeats(cb, g)) {
        rc = cb->exec != NULL || cuda_capture(cb, g) == 0 ? 0 : -1;
        if (rc == 0 && !cuda_ok(cudaGraphLaunch(cb->exec, cb->stream), "graph launch")) {
            rc = -1;
        }
    } else {
        cuda_drop_exec(cb);
        rc = cuda_run_nodes(cb, g);
    }
    if (rc != 0) {
        cb->key_valid = false;
        cuda_drop_exec(cb);
        cudaStreamSynchronize(cb->stream);
        return -1;
    }
    return cuda_synchronize(be);
}

// ---- the backend ----

static const char * cuda_name(iq_backend * be) { return "CUDA"; }

static void cuda_free(iq_backend * be) {
    struct cuda_backend * cb = be->context;
    cuda_drop_exec(cb);
    cudaStreamDestroy(cb->stream);
    cudaFree(cb->work);
    cudaFree(cb->xq);
    cudaFree(cb->error);
    free(cb->key);
    free(cb);
    free(be);
}

static size_t cuda_alignment(iq_backend * be) { return CUDA_ALIGNMENT; }

static bool cuda_supports_op(iq_backend * be, const struct iq_tensor * t) {
    return !cuda_node_runs(t) || iq_cuda_supports(t);
}

iq_backend * iq_backend_cuda_init(int device) {
    const int n = iq_cuda_device_count();
    if (device < 0 || device >= n) {
        if (n > 0) {
            iq_error_set("CUDA: no device %d (%d present)", device, n);
        }
        return NULL;
    }
    iq_backend * be = calloc(1, sizeof(*be));
    struct cuda_backend * cb = calloc(1, sizeof(*cb));
    if (be == NULL || cb == NULL) {
        free(be);
        free(cb);
        iq_error_set("CUDA backend: out of host memory");
        return NULL;
    }
    cb->device = device;
    if (!cuda_ok(cudaSetDevice(device), "set device") ||
        !cuda_ok(cudaDeviceGetAttribute(&cb->n_sm, cudaDevAttrMultiProcessorCount, device), "device attributes") ||
        !cuda_ok(cudaStreamCreate(&cb->stream), "stream") ||
        !cuda_ok(cudaMalloc((void **) &cb->error, sizeof(int)), "device memory") ||
        !cuda_ok(cudaMemset(cb->error, 0, sizeof(int)), "device memory")) {
        if (cb->stream != NULL) {
            cudaStreamDestroy(cb->stream);
        }
        cudaFree(cb->error);
        free(cb);
        free(be);
        return NULL;
    }
    // tensor-core kernels need Ampere (8.0) or newer; and this build must hold code for the device
    int cc_major = 0, cc_minor = 0;
    cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, device);
    if (cc_major < 8 || !iq_cuda_has_kernels_for_device()) {
        if (cc_major < 8) {
            iq_error_set("CUDA device %d has compute capability %d.%d: innerq's kernels need 8.0 (Ampere) or newer",
                         device, cc_major, cc_minor);
        } else {
            iq_error_set("CUDA device %d (compute capability %d.%d): this build of innerq has no code for it "
                         "(rebuild with CMAKE_CUDA_ARCHITECTURES including %d%d or an older -virtual)",
                         device, cc_major, cc_minor, cc_major, cc_minor);
        }
        cudaStreamDestroy(cb->stream);
        cudaFree(cb->error);
        free(cb);
        free(be);
        return NULL;
    }
    be->iface = (struct iq_backend_i) {
        .name = cuda_name,
        .free = cuda_free,
        .alignment = cuda_alignment,
        .alloc_buffer = cuda_alloc_buffer,
        .buffer_from_host = NULL,
        .supports_op = cuda_supports_op,
        .graph_compute = cuda_graph_compute,
        .synchronize = cuda_synchronize,
    };
    be->context = cb;
    return be;
}

bool iq_backend_is_cuda(iq_backend * be) { return be != NULL && be->iface.name == cuda_name; }
