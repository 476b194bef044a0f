// How the CPU backend runs ops. Every thread of the pool calls an op's compute function
// with its index; the op splits its work by (ith, nth) or takes items from the pool's
// counter, and may meet the other threads at iq_threadpool_barrier between phases.
#pragma once

#include "iq-cpu.h"
#include "iq.h"
#include "threadpool.h"

#include <stdatomic.h>

// The first failure of a graph run (bad data such as an out-of-range row id); the caller
// turns it into iq_error_set after the run.
struct iq_cpu_status {
    atomic_int failed;
    char msg[256];
};

struct iq_cpu_params {
    int ith, nth;
    struct iq_threadpool * tp;
    void * wdata;  // scratch for this op, shared by all threads
    size_t wsize;
    struct iq_cpu_status * status;
};

struct iq_cpu_op {
    void (*compute)(const struct iq_cpu_params * p, struct iq_tensor * dst);
    // Scratch bytes the op needs with nth threads; NULL: none.
    size_t (*work_size)(const struct iq_tensor * dst, int nth);
    // Whether the op can run with these operand types; NULL: always. Sets iq_error_set if not.
    bool (*supports)(const struct iq_tensor * dst);
};

// The table entry of an op; NULL for ops without work (NONE, VIEW) or unknown ones.
const struct iq_cpu_op * iq_cpu_op_get(enum iq_op op);

void iq_cpu_fail(const struct iq_cpu_params * p, const char * fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

// The row conversion to f32 of a type: the CPU fast path where there is one, else the reference.
iq_to_float_fn iq_cpu_to_float(enum iq_type type);

// Address of row r of t (rows counted over dims 1..3).
static inline char * iq_cpu_row(const struct iq_tensor * t, int64_t r) {
    const int64_t i1 = r % t->ne[1], i2 = r / t->ne[1] % t->ne[2], i3 = r / (t->ne[1] * t->ne[2]);
    return (char *) t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
}

// [start, end) of n items for thread ith of nth, in contiguous runs.
static inline void iq_cpu_split(int64_t n, int ith, int nth, int64_t * start, int64_t * end) {
    *start = n * ith / nth;
    *end = n * (ith + 1) / nth;
}

// Ops with files of their own.
void iq_cpu_mul_mat(const struct iq_cpu_params * p, struct iq_tensor * dst);
size_t iq_cpu_mul_mat_work_size(const struct iq_tensor * dst, int nth);
bool iq_cpu_mul_mat_supports(const struct iq_tensor * dst);

void iq_cpu_attention(const struct iq_cpu_params * p, struct iq_tensor * dst);
size_t iq_cpu_attention_work_size(const struct iq_tensor * dst, int nth);
bool iq_cpu_attention_supports(const struct iq_tensor * dst);

void iq_cpu_kv_store(const struct iq_cpu_params * p, struct iq_tensor * dst);
bool iq_cpu_kv_store_supports(const struct iq_tensor * dst);
