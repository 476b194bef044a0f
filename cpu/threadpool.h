// A persistent pool of threads that run one function together: the caller is thread 0 and
// n_threads - 1 workers join it. Inside the function, threads meet at barriers and take work
// items from a shared counter. Between runs the workers spin briefly, then sleep.
#pragma once

#include <stdbool.h>

struct iq_threadpool;

// NULL (+ iq_error_set) if a thread could not be started.
struct iq_threadpool * iq_threadpool_new(int n_threads);
void iq_threadpool_free(struct iq_threadpool * tp);
int iq_threadpool_n_threads(const struct iq_threadpool * tp);

// Runs fn(arg, ith, nth) on every thread of the pool, ith = 0 on the caller, and returns
// when all have returned.
void iq_threadpool_run(struct iq_threadpool * tp, void (*fn)(void * arg, int ith, int nth), void * arg);

// Inside fn: waits until every thread has arrived. The work counter restarts at 0 after it.
void iq_threadpool_barrier(struct iq_threadpool * tp);

// Inside fn: the next work item no thread has taken since the last barrier (0, 1, 2, ...).
int iq_threadpool_next(struct iq_threadpool * tp);
