// A persistent pool of threads that run one function together: the caller is thread 0 and
// n_threads - 1 workers join it. Inside the function, threads meet at barriers and take work
// items from a shared counter. Between runs the workers spin briefly, then sleep. A pool may
// be used in a child made by fork() (with no run under way in the parent at the fork): its
// first run there starts the workers again.
#pragma once

#include <stdbool.h>

struct iq_threadpool;

// NULL (+ iq_error_set) if a thread could not be started.
struct iq_threadpool * iq_threadpool_new(int n_threads);
void iq_threadpool_free(struct iq_threadpool * tp);
int iq_threadpool_n_threads(const struct iq_threadpool * tp);

// Runs fn(arg, ith, nth) on every thread of the pool, ith = 0 on the caller, and returns 0
// when all have returned; -1 (+ iq_error_set), running nothing, if a forked child could not
// start the pool's workers.
int iq_threadpool_run(struct iq_threadpool * tp, void (*fn)(void * arg, int ith, int nth), void * arg);

// Inside fn: waits until every thread has arrived. The work counter restarts at 0 after it.
void iq_threadpool_barrier(struct iq_threadpool * tp);

// Inside fn: the next work item no thread has taken since the last barrier (0, 1, 2, ...).
int iq_threadpool_next(struct iq_threadpool * tp);
