// The CPU backend (iq-backend.h): host buffers, and graphs run node by node on a thread
// pool. All threads walk the graph together and meet at a barrier after each op, so an op
// costs one barrier, not a wake-up.
#include "iq-cpu.h"

#include "ops.h"
#include "threadpool.h"

#include <stdlib.h>
#include <sys/mman.h>

#define CPU_ALIGNMENT 64
// Buffers from this size on are anonymous mappings of their own: memory is committed page by
// page as it is first written, and clearing to zero gives the pages back instead of writing
// them, so a large KV cache costs only what its tokens use (docs/MEMORY.md).
#define CPU_MAP_MIN ((size_t) 1 << 24)

static char cpu_mapped;  // buf->context of a mapped buffer; of a malloc'ed one it is base

struct cpu_backend {
    struct iq_threadpool * tp;
    void * wdata;  // op scratch, grown to the largest need seen
    size_t wsize;
};

// ---- buffers ----

static size_t cpu_padded(size_t size) {
    return size > 0 ? (size + CPU_ALIGNMENT - 1) / CPU_ALIGNMENT * CPU_ALIGNMENT : CPU_ALIGNMENT;
}

static void cpu_buffer_free(iq_buffer * buf) {
    if (buf->context == &cpu_mapped) {
        munmap(buf->base, cpu_padded(buf->size));
    } else if (buf->context != NULL) {
        free(buf->base);  // owned memory; wrapped host memory has no context
    }
    free(buf);
}

static void cpu_buffer_set(iq_buffer * buf, struct iq_tensor * t, const void * data, size_t offset, size_t size) {
    memcpy((char *) t->data + offset, data, size);
}

static void cpu_buffer_get(iq_buffer * buf, const struct iq_tensor * t, void * data, size_t offset, size_t size) {
    memcpy(data, (const char *) t->data + offset, size);
}

static void cpu_buffer_clear(iq_buffer * buf, uint8_t value) {
    // a private anonymous mapping reads as zeros again after MADV_DONTNEED
    if (value != 0 || buf->context != &cpu_mapped || madvise(buf->base, cpu_padded(buf->size), MADV_DONTNEED) != 0) {
        memset(buf->base, value, buf->size);
    }
}

static bool cpu_buffer_copy_tensor(iq_buffer * buf, struct iq_tensor * dst, const struct iq_tensor * src) {
    const iq_buffer * from = src->buffer != NULL ? src->buffer : src->view_src->buffer;
    if (!from->is_host) {
        return false;
    }
    memcpy(dst->data, src->data, iq_nbytes(src));
    return true;
}

// owner: what cpu_buffer_free releases (base, &cpu_mapped, or NULL for wrapped memory).
static iq_buffer * cpu_buffer_new(iq_backend * be, void * base, size_t size, void * owner) {
    iq_buffer * buf = calloc(1, sizeof(*buf));
    if (buf == NULL) {
        iq_error_set("CPU buffer: out of memory");
        return NULL;
    }
    buf->iface = (struct iq_buffer_i) { cpu_buffer_free, cpu_buffer_set, cpu_buffer_get, cpu_buffer_clear,
                                        cpu_buffer_copy_tensor };
    buf->backend = be;
    buf->base = base;
    buf->size = size;
    buf->is_host = true;
    buf->context = owner;
    return buf;
}

static iq_buffer * cpu_alloc_buffer(iq_backend * be, size_t size) {
    const size_t padded = cpu_padded(size);
    const bool mapped = padded >= CPU_MAP_MIN;
    void * base = mapped ? mmap(NULL, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                         : aligned_alloc(CPU_ALIGNMENT, padded);
    if (base == NULL || base == MAP_FAILED) {
        iq_error_set("CPU buffer of %zu bytes: out of memory", size);
        return NULL;
    }
    iq_buffer * buf = cpu_buffer_new(be, base, size, mapped ? (void *) &cpu_mapped : base);
    if (buf == NULL) {
        mapped ? (void) munmap(base, padded) : free(base);
    }
    return buf;
}

static iq_buffer * cpu_buffer_from_host(iq_backend * be, void * ptr, size_t size) {
    return cpu_buffer_new(be, ptr, size, NULL);
}

// ---- graphs ----

struct cpu_graph_job {
    struct iq_cgraph * g;
    struct cpu_backend * cb;
    struct iq_cpu_status status;
};

static bool cpu_node_runs(const struct iq_tensor * t) { return t->op != IQ_OP_NONE && t->op != IQ_OP_VIEW; }

static void cpu_graph_run(void * arg, int ith, int nth) {
    struct cpu_graph_job * job = arg;
    const struct iq_cpu_params p = {
        .ith = ith, .nth = nth, .tp = job->cb->tp, .wdata = job->cb->wdata, .wsize = job->cb->wsize,
        .status = &job->status,
    };
    for (int i = 0; i < job->g->n_nodes; i++) {
        struct iq_tensor * t = job->g->nodes[i];
        if (cpu_node_runs(t)) {
            iq_cpu_op_get(t->op)->compute(&p, t);
            iq_threadpool_barrier(p.tp);
        }
    }
}

// Checks that every node can run and has its memory; returns the scratch it needs or -1.
static int64_t cpu_graph_check(struct iq_cgraph * g, int nth) {
    size_t work = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const struct iq_tensor * t = g->nodes[i];
        if (!cpu_node_runs(t)) {
            continue;
        }
        const struct iq_cpu_op * op = iq_cpu_op_get(t->op);
        if (op == NULL) {
            iq_error_set("CPU backend: op %s (tensor '%s') is not supported", iq_op_name(t->op), t->name);
            return -1;
        }
        if (t->data == NULL) {
            iq_error_set("CPU backend: tensor '%s' (%s) has no memory; allocate the graph first", t->name,
                         iq_op_name(t->op));
            return -1;
        }
        for (int j = 0; j < IQ_MAX_SRC; j++) {
            if (t->src[j] != NULL && t->src[j]->data == NULL) {
                iq_error_set("CPU backend: source '%s' of '%s' (%s) has no data", t->src[j]->name, t->name,
                             iq_op_name(t->op));
                return -1;
            }
        }
        if (op->supports != NULL && !op->supports(t)) {
            return -1;
        }
        if (op->work_size != NULL) {
            const size_t w = op->work_size(t, nth);
            work = w > work ? w : work;
        }
    }
    return (int64_t) work;
}

static int cpu_graph_compute(iq_backend * be, struct iq_cgraph * g) {
    struct cpu_backend * cb = be->context;
    const int64_t work = cpu_graph_check(g, iq_threadpool_n_threads(cb->tp));
    if (work < 0) {
        return -1;
    }
    if ((size_t) work > cb->wsize) {
        const size_t size = ((size_t) work + CPU_ALIGNMENT - 1) / CPU_ALIGNMENT * CPU_ALIGNMENT;
        void * w = aligned_alloc(CPU_ALIGNMENT, size);
        if (w == NULL) {
            iq_error_set("CPU backend: out of memory for %zu bytes of scratch", size);
            return -1;
        }
        free(cb->wdata);
        cb->wdata = w;
        cb->wsize = size;
    }
    struct cpu_graph_job job = { .g = g, .cb = cb };
    if (iq_threadpool_run(cb->tp, cpu_graph_run, &job) != 0) {
        return -1;
    }
    if (atomic_load(&job.status.failed)) {
        iq_error_set("%s", job.status.msg);
        return -1;
    }
    return 0;
}

// ---- the backend ----

static const char * cpu_name(iq_backend * be) { return "CPU"; }

static void cpu_free(iq_backend * be) {
    struct cpu_backend * cb = be->context;
    iq_threadpool_free(cb->tp);
    free(cb->wdata);
    free(cb);
    free(be);
}

static size_t cpu_alignment(iq_backend * be) { return CPU_ALIGNMENT; }

static bool cpu_supports_op(iq_backend * be, const struct iq_tensor * t) {
    if (!cpu_node_runs(t)) {
        return true;
    }
    const struct iq_cpu_op * op = iq_cpu_op_get(t->op);
    return op != NULL && (op->supports == NULL || op->supports(t));
}

// The pool's size for n_threads (0: iq_cpu_count()). Threads past the CPUs the process may
// use never run at once: every barrier would wait until each of them got a turn on a CPU
// (64 threads on 2 CPUs decoded 30 times slower than 1), so they are not started.
static int cpu_pool_threads(int n_threads) {
    const int cpus = iq_cpu_count();
    return n_threads > 0 && n_threads < cpus ? n_threads : cpus;
}

iq_backend * iq_backend_cpu_init(int n_threads) {
    iq_backend * be = calloc(1, sizeof(*be));
    struct cpu_backend * cb = calloc(1, sizeof(*cb));
    if (be == NULL || cb == NULL) {
        free(be);
        free(cb);
        iq_error_set("CPU backend: out of memory");
        return NULL;
    }
    cb->tp = iq_threadpool_new(cpu_pool_threads(n_threads));
    if (cb->tp == NULL) {
        free(be);
        free(cb);
        return NULL;
    }
    be->iface = (struct iq_backend_i) {
        .name = cpu_name,
        .free = cpu_free,
        .alignment = cpu_alignment,
        .alloc_buffer = cpu_alloc_buffer,
        .buffer_from_host = cpu_buffer_from_host,
        .supports_op = cpu_supports_op,
        .graph_compute = cpu_graph_compute,
    };
    be->context = cb;
    return be;
}

void iq_backend_cpu_set_n_threads(iq_backend * be, int n_threads) {
    struct cpu_backend * cb = be->context;
    n_threads = cpu_pool_threads(n_threads);
    if (n_threads == iq_threadpool_n_threads(cb->tp)) {
        return;
    }
    struct iq_threadpool * tp = iq_threadpool_new(n_threads);
    if (tp != NULL) {  // else the old pool stays, and iq_error_get says why
        iq_threadpool_free(cb->tp);
        cb->tp = tp;
    }
}

bool iq_backend_is_cpu(iq_backend * be) { return be != NULL && be->iface.name == cpu_name; }
