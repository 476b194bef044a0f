// The graph allocator (iq-alloc.h).
//
// Offsets are planned first over a virtual address range (best-fit free list), walking the
// nodes in execution order: a node gets memory before its sources may be released, so no
// op writes over its own inputs. The backend buffer is then sized to the plan's peak.
#include "iq-alloc.h"

#include <stdlib.h>

struct iq_gallocr {
    iq_backend * be;
    iq_buffer * buf;
};

// What the planner knows about one tensor of the graph.
struct galloc_info {
    const struct iq_tensor * t;
    int n_children;  // consumers that have not run yet
    int n_views;     // views of it whose consumers have not all run
    size_t offset;
    bool planned;    // it got an offset in this plan
    bool pinned;     // input, output or leaf: its memory is never reused
};

struct galloc_block {
    size_t offset, size;
};

struct galloc_plan {
    struct galloc_info * info;
    size_t hash_size;
    struct galloc_block * free;  // sorted by offset; the last block is the unbounded tail
    int n_free, cap_free;
    size_t peak, align;
};

static struct galloc_info * galloc_info(struct galloc_plan * p, const struct iq_tensor * t) {
    size_t i = ((uintptr_t) t >> 4) & (p->hash_size - 1);
    while (p->info[i].t != NULL && p->info[i].t != t) {
        i = (i + 1) & (p->hash_size - 1);
    }
    p->info[i].t = t;
    return &p->info[i];
}

// Best fit among the free blocks; the unbounded tail is the largest, so it is taken last.
static size_t galloc_reserve(struct galloc_plan * p, size_t size) {
    size = (size + p->align - 1) / p->align * p->align;
    int best = p->n_free - 1;
    for (int i = 0; i < p->n_free - 1; i++) {
        if (p->free[i].size >= size && p->free[i].size < p->free[best].size) {
            best = i;
        }
    }
    struct galloc_block * b = &p->free[best];
    const size_t offset = b->offset;
    b->offset += size;
    b->size -= size;
    if (b->size == 0) {
        memmove(b, b + 1, (size_t) (p->n_free - best - 1) * sizeof(*b));
        p->n_free--;
    }
    if (offset + size > p->peak) {
        p->peak = offset + size;
    }
    return offset;
}

static bool galloc_release(struct galloc_plan * p, size_t offset, size_t size) {
    size = (size + p->align - 1) / p->align * p->align;
    int i = 0;
    while (i < p->n_free && p->free[i].offset < offset) {
        i++;
    }
    // merge with the block before and/or after
    const bool prev = i > 0 && p->free[i - 1].offset + p->free[i - 1].size == offset;
    const bool next = i < p->n_free && offset + size == p->free[i].offset;
    if (prev && next) {
        p->free[i - 1].size += size + p->free[i].size;
        memmove(&p->free[i], &p->free[i + 1], (size_t) (p->n_free - i - 1) * sizeof(p->free[0]));
        p->n_free--;
    } else if (prev) {
        p->free[i - 1].size += size;
    } else if (next) {
        p->free[i].offset = offset;
        p->free[i].size += size;
    } else {
        if (p->n_free == p->cap_free) {
            int cap = 2 * p->cap_free;
            struct galloc_block * f = realloc(p->free, (size_t) cap * sizeof(*f));
            if (f == NULL) {
                iq_error_set("graph allocator: out of memory");
                return false;
            }
            p->free = f;
            p->cap_free = cap;
        }
        memmove(&p->free[i + 1], &p->free[i], (size_t) (p->n_free - i) * sizeof(p->free[0]));
        p->free[i] = (struct galloc_block) { offset, size };
        p->n_free++;
    }
    return true;
}

static bool galloc_needs_memory(const struct iq_tensor * t) { return t->data == NULL && t->view_src == NULL; }

static void galloc_plan_tensor(struct galloc_plan * p, struct iq_tensor * t, bool pinned) {
    struct galloc_info * in = galloc_info(p, t);
    if (galloc_needs_memory(t) && !in->planned) {
        in->offset = galloc_reserve(p, iq_nbytes(t));
        in->planned = true;
        in->pinned = pinned || (t->flags & (IQ_FLAG_INPUT | IQ_FLAG_OUTPUT)) != 0;
    }
}

// t's last consumer has run: its memory (or its hold on the tensor it views) goes back.
static bool galloc_drop(struct galloc_plan * p, const struct iq_tensor * t) {
    struct galloc_info * in = galloc_info(p, t);
    if (in->n_children > 0 || in->n_views > 0) {
        return true;
    }
    if (t->view_src != NULL) {
        struct galloc_info * src = galloc_info(p, t->view_src);
        src->n_views--;
        return galloc_drop(p, t->view_src);
    }
    if (in->planned && !in->pinned) {
        in->pinned = true;  // released once
        return galloc_release(p, in->offset, iq_nbytes(t));
    }
    return true;
}

static bool galloc_plan_graph(struct galloc_plan * p, struct iq_cgraph * g) {
    for (int i = 0; i < g->n_nodes; i++) {
        struct iq_tensor * t = g->nodes[i];
        for (int j = 0; j < IQ_MAX_SRC; j++) {
            if (t->src[j] != NULL) {
                galloc_info(p, t->src[j])->n_children++;
            }
        }
        if (t->view_src != NULL) {
            galloc_info(p, t->view_src)->n_views++;
        }
    }
    for (int i = 0; i < g->n_leafs; i++) {
        galloc_plan_tensor(p, g->leafs[i], true);
    }
    for (int i = 0; i < g->n_nodes; i++) {
        struct iq_tensor * t = g->nodes[i];
        galloc_plan_tensor(p, t, false);
        if (t->view_src != NULL && (t->flags & IQ_FLAG_OUTPUT)) {
            galloc_info(p, t->view_src)->pinned = true;  // the host reads it through the view
        }
        for (int j = 0; j < IQ_MAX_SRC; j++) {
            if (t->src[j] != NULL) {
                galloc_info(p, t->src[j])->n_children--;
                if (!galloc_drop(p, t->src[j])) {
                    return false;
                }
            }
        }
    }
    return true;
}

iq_gallocr * iq_gallocr_new(iq_backend * be) {
    iq_gallocr * ga = calloc(1, sizeof(*ga));
    if (ga == NULL) {
        iq_error_set("graph allocator: out of memory");
        return NULL;
    }
    ga->be = be;
    return ga;
}

void iq_gallocr_free(iq_gallocr * ga) {
    if (ga != NULL) {
        iq_buffer_free(ga->buf);
        free(ga);
    }
}

size_t iq_gallocr_buffer_size(const iq_gallocr * ga) { return ga->buf != NULL ? ga->buf->size : 0; }

// Gives every planned tensor its address, then every view its source's address + offset.
static void galloc_place(struct galloc_plan * p, iq_buffer * buf, struct iq_cgraph * g) {
    for (size_t i = 0; i < p->hash_size; i++) {
        if (p->info[i].t != NULL && p->info[i].planned) {
            iq_tensor_place((struct iq_tensor *) p->info[i].t, buf, p->info[i].offset);
        }
    }
    for (int i = 0; i < g->n_nodes; i++) {
        struct iq_tensor * t = g->nodes[i];
        if (t->view_src != NULL && t->view_src->data != NULL) {
            t->data = (char *) t->view_src->data + t->view_offs;
            t->buffer = t->view_src->buffer;
        }
    }
}

bool iq_gallocr_alloc_graph(iq_gallocr * ga, struct iq_cgraph * g) {
    struct galloc_plan p = { .align = iq_backend_alignment(ga->be), .cap_free = 16 };
    p.hash_size = 16;
    while (p.hash_size < 2 * (size_t) (g->n_nodes + g->n_leafs)) {
        p.hash_size *= 2;
    }
    p.info = calloc(p.hash_size, sizeof(*p.info));
    p.free = malloc((size_t) p.cap_free * sizeof(*p.free));
    bool ok = p.info != NULL && p.free != NULL;
    if (!ok) {
        iq_error_set("graph allocator: out of memory");
    } else {
        p.free[0] = (struct galloc_block) { 0, SIZE_MAX };
        p.n_free = 1;
        ok = galloc_plan_graph(&p, g);
    }
    if (ok && (ga->buf == NULL || ga->buf->size < p.peak)) {
        iq_buffer_free(ga->buf);
        ga->buf = iq_backend_alloc_buffer(ga->be, p.peak > 0 ? p.peak : p.align);
        ok = ga->buf != NULL;
    }
    if (ok) {
        galloc_place(&p, ga->buf, g);
    }
    free(p.info);
    free(p.free);
    return ok;
}
