// The scheduler (iq-sched.h).
#include "iq-sched.h"

#include <stdlib.h>

// A copy of src in backend `backend`'s memory, made at the start of split `split`.
struct sched_copy {
    struct iq_tensor * src, * dst;
};

// Nodes [i0, i1) of the graph, run by one backend after the copies [c0, c1).
struct sched_split {
    int backend, i0, i1, c0, c1;
};

struct iq_sched {
    iq_backend * be[IQ_SCHED_MAX_BACKENDS];
    iq_gallocr * ga[IQ_SCHED_MAX_BACKENDS];
    int n;
    struct iq_context * ctx;  // the last plan's copies and backend graphs
    struct sched_split * splits;
    int n_splits;
    struct sched_copy * copies;
    int n_copies;
    size_t copy_bytes;
    int off_from, off_to;  // the offload rule (iq_sched_set_offload); off_min 0: none
    int64_t off_min;
};

// What a hold's data points to: a hold needs no memory (sched_backend_graph).
static char sched_hold_data;

iq_sched * iq_sched_new(iq_backend * const * be, int n) {
    if (n < 1 || n > IQ_SCHED_MAX_BACKENDS) {
        iq_error_set("scheduler: %d backends (1 .. %d)", n, IQ_SCHED_MAX_BACKENDS);
        return NULL;
    }
    iq_sched * s = calloc(1, sizeof(*s));
    if (s == NULL) {
        iq_error_set("scheduler: out of memory");
        return NULL;
    }
    s->n = n;
    for (int i = 0; i < n; i++) {
        s->be[i] = be[i];
        if ((s->ga[i] = iq_gallocr_new(be[i])) == NULL) {
            iq_sched_free(s);
            return NULL;
        }
    }
    return s;
}

void iq_sched_free(iq_sched * s) {
    if (s == NULL) {
        return;
    }
    for (int i = 0; i < s->n; i++) {
        iq_gallocr_free(s->ga[i]);
    }
    iq_context_free(s->ctx);
    free(s->splits);
    free(s->copies);
    free(s);
}

void iq_sched_set_offload(iq_sched * s, int from, int to, int64_t min_batch) {
    const bool ok = from >= 0 && from < s->n && to >= 0 && to < s->n && from != to;
    s->off_from = ok ? from : 0, s->off_to = ok ? to : 0, s->off_min = ok ? min_batch : 0;
}

// Whether the offload rule moves node t: a product of a weight (a leaf with data; not the
// cache's rotation) by a batch of at least off_min columns, which the other backend takes.
static bool sched_offloads(const iq_sched * s, const struct iq_tensor * t) {
    const struct iq_tensor * w = t->src[0];
    iq_backend * to = s->be[s->off_to];
    return s->off_min > 0 && t->op == IQ_OP_MUL_MAT && t->view_src == NULL && t->backend_id == s->off_from &&
           w->op == IQ_OP_NONE && w->data != NULL && !(w->flags & IQ_FLAG_HADAMARD) && t->src[1]->ne[1] >= s->off_min &&
           (to->iface.supports_op == NULL || to->iface.supports_op(to, t));
}

int iq_sched_n_splits(const iq_sched * s) { return s->n_splits; }
size_t iq_sched_copy_bytes(const iq_sched * s) { return s->copy_bytes; }
size_t iq_sched_buffer_size(const iq_sched * s, int i) {
    return i >= 0 && i < s->n ? iq_gallocr_buffer_size(s->ga[i]) : 0;
}

// The copy of t in backend b, made for split `split` if there is none yet; NULL + iq_error_set.
static struct iq_tensor * sched_copy_of(iq_sched * s, struct iq_tensor * t, int b) {
    for (int i = 0; i < s->n_copies; i++) {
        if (s->copies[i].src == t && s->copies[i].dst->backend_id == b) {
            return s->copies[i].dst;
        }
    }
    if (!iq_is_contiguous(t)) {
        iq_error_set("scheduler: '%s' (%s) is read by another backend but is not contiguous", t->name, iq_op_name(t->op));
        return NULL;
    }
    iq_context_set_backend_id(s->ctx, b);
    struct iq_tensor * c = iq_new_tensor(s->ctx, t->type, IQ_MAX_DIMS, t->ne);
    if (c == NULL) {
        return NULL;
    }
    iq_set_name(c, "%s#%d", t->name, b);
    s->copies[s->n_copies++] = (struct sched_copy) { .src = t, .dst = c };
    s->copy_bytes += iq_nbytes(c);
    return c;
}

// What backend b's allocator plans, in execution order: its inputs (leafs, kept), and per split
// either the copies made into b at its start then its nodes (split on b), or holds (split
// elsewhere): nodes that need no memory and read the tensors of b the split's copies are made
// from, so that b keeps them until then and no longer. A copy is released after its last reader.
static bool sched_backend_graph(iq_sched * s, const struct iq_cgraph * g, int b, struct iq_cgraph ** out) {
    const int max = g->n_nodes + g->n_leafs + 2 * s->n_copies + 1;
    struct iq_cgraph * sub = iq_new_graph(s->ctx, max);
    if (sub == NULL) {
        return false;
    }
    for (int i = 0; i < g->n_leafs; i++) {
        if (g->leafs[i]->backend_id == b) {
            sub->leafs[sub->n_leafs++] = g->leafs[i];
        }
    }
    for (int k = 0; k < s->n_splits; k++) {
        const struct sched_split * sp = &s->splits[k];
        struct iq_tensor * hold = NULL;
        int n_held = 0;
        for (int c = sp->c0; c < sp->c1; c++) {
            if (sp->backend == b) {
                sub->nodes[sub->n_nodes++] = s->copies[c].dst;
            } else if (s->copies[c].src->backend_id == b) {
                if (hold == NULL || n_held == IQ_MAX_SRC) {
                    if ((hold = iq_new_tensor_1d(s->ctx, IQ_TYPE_I32, 1)) == NULL) {
                        return false;
                    }
                    hold->data = &sched_hold_data;
                    iq_set_name(hold, "hold");
                    sub->nodes[sub->n_nodes++] = hold;
                    n_held = 0;
                }
                hold->src[n_held++] = s->copies[c].src;
            }
        }
        for (int i = sp->i0; i < sp->i1 && sp->backend == b; i++) {
            sub->nodes[sub->n_nodes++] = g->nodes[i];
        }
    }
    *out = sub;
    return true;
}

bool iq_sched_alloc_graph(iq_sched * s, struct iq_cgraph * g) {
    s->n_splits = 0, s->n_copies = 0, s->copy_bytes = 0;
    if (s->n == 1) {
        s->n_splits = g->n_nodes > 0;
        return iq_gallocr_alloc_graph(s->ga[0], g);
    }
    const int n_src = g->n_nodes * IQ_MAX_SRC + 1;  // copies at most (and holds at most as many)
    iq_context_free(s->ctx);
    s->ctx = iq_context_init(2 * iq_tensor_overhead() * (size_t) n_src +
                             (size_t) s->n * iq_graph_overhead(g->n_nodes + g->n_leafs + 2 * n_src + 1));
    struct sched_split * splits = realloc(s->splits, sizeof(*splits) * (size_t) (g->n_nodes + 1));
    struct sched_copy * copies = realloc(s->copies, sizeof(*copies) * (size_t) n_src);
    s->splits = splits != NULL ? splits : s->splits;
    s->copies = copies != NULL ? copies : s->copies;
    if (s->ctx == NULL || splits == NULL || copies == NULL) {
        iq_error_set("scheduler: out of memory");
        return false;
    }
    for (int i = 0; i < g->n_leafs; i++) {
        if (g->leafs[i]->backend_id < 0 || g->leafs[i]->backend_id >= s->n) {
            iq_error_set("scheduler: '%s' is on backend %d of %d", g->leafs[i]->name, g->leafs[i]->backend_id, s->n);
            return false;
        }
    }
    for (int i = 0; i < g->n_nodes; i++) {
        struct iq_tensor * t = g->nodes[i];
        if (t->view_src != NULL) {
            t->backend_id = t->view_src->backend_id;  // a view (and KV_STORE, one) is where its data is
        } else if (sched_offloads(s, t)) {
            t->backend_id = s->off_to;
        }
        const int b = t->backend_id;
        if (b < 0 || b >= s->n) {
            iq_error_set("scheduler: '%s' (%s) is on backend %d of %d", t->name, iq_op_name(t->op), b, s->n);
            return false;
        }
        if (s->n_splits == 0 || s->splits[s->n_splits - 1].backend != b) {
            s->splits[s->n_splits++] = (struct sched_split) { .backend = b, .i0 = i, .c0 = s->n_copies };
        }
        struct sched_split * sp = &s->splits[s->n_splits - 1];
        for (int j = 0; j < IQ_MAX_SRC; j++) {
            struct iq_tensor * src = t->src[j];
            if (src != NULL && src != t->view_src && src->backend_id != b && (t->src[j] = sched_copy_of(s, src, b)) == NULL) {
                return false;
            }
        }
        sp->i1 = i + 1;
        sp->c1 = s->n_copies;
    }
    for (int b = 0; b < s->n; b++) {
        struct iq_cgraph * sub;
        if (!sched_backend_graph(s, g, b, &sub) ||
            ((sub->n_nodes > 0 || sub->n_leafs > 0) && !iq_gallocr_alloc_graph(s->ga[b], sub))) {
            return false;
        }
    }
    return true;
}

int iq_sched_graph_compute(iq_sched * s, struct iq_cgraph * g) {
    if (s->n == 1) {
        return iq_backend_graph_compute(s->be[0], g);
    }
    for (int k = 0; k < s->n_splits; k++) {
        const struct sched_split * sp = &s->splits[k];
        for (int c = sp->c0; c < sp->c1; c++) {
            if (!iq_tensor_copy(s->copies[c].dst, s->copies[c].src)) {
                return -1;
            }
        }
        struct iq_cgraph part = { .n_nodes = sp->i1 - sp->i0, .max_nodes = sp->i1 - sp->i0, .nodes = g->nodes + sp->i0 };
        if (iq_backend_graph_compute(s->be[sp->backend], &part) != 0) {
            return -1;
        }
    }
    return 0;
}
