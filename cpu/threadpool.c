// The thread pool (threadpool.h).
//
// A run is announced by bumping `generation`, a barrier is passed by bumping `phase`. A
// waiting thread spins on the counter for a while, then sleeps on a condition variable:
// back-to-back ops and runs go on without a system call, while a thread that waits long (an
// idle worker between tokens, or a partner thread the OS has taken off its core on a busy
// machine) gives its core away.
#include "threadpool.h"

#include "iq.h"

#include <pthread.h>
#include <signal.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#define TP_IDLE_SPIN_NS 1000000    // an idle worker spins this long before it sleeps
#define TP_BARRIER_SPIN_NS 100000  // a thread at a barrier likewise

struct iq_threadpool {
    int n_threads;
    pthread_t * threads;
    void (*fn)(void * arg, int ith, int nth);
    void * arg;
    bool stop;

    alignas(64) atomic_int generation;  // bumped once per run
    atomic_int n_sleeping;
    pthread_mutex_t mutex;
    pthread_cond_t wake;

    alignas(64) atomic_int n_arrived;  // barrier
    atomic_int phase;
    alignas(64) atomic_int next_item;
};

struct tp_worker_arg {
    struct iq_threadpool * tp;
    int ith;
};

static inline void tp_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t tp_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t) ts.tv_sec * 1000000000 + ts.tv_nsec;
}

// Waits until *x differs from `old`; returns the new value. The sleeper raises n_sleeping
// before it reads *x again, and a waker changes *x before it reads n_sleeping (both
// sequentially consistent): one of the two sees the other, so no wake-up is lost.
static int tp_wait_change(struct iq_threadpool * tp, atomic_int * x, int old, int64_t spin_ns) {
    int64_t t0 = 0;
    for (int spins = 1;; spins++) {
        const int v = atomic_load_explicit(x, memory_order_acquire);
        if (v != old) {
            return v;
        }
        tp_pause();
        if (spins % 64 == 0) {
            const int64_t now = tp_now_ns();
            t0 = t0 != 0 ? t0 : now;
            if (now - t0 > spin_ns) {
                break;
            }
        }
    }
    pthread_mutex_lock(&tp->mutex);
    atomic_fetch_add(&tp->n_sleeping, 1);
    int v;
    while ((v = atomic_load(x)) == old) {
        pthread_cond_wait(&tp->wake, &tp->mutex);
    }
    atomic_fetch_sub(&tp->n_sleeping, 1);
    pthread_mutex_unlock(&tp->mutex);
    return v;
}

// Called after changing a counter that threads may sleep on.
static void tp_wake(struct iq_threadpool * tp) {
    if (atomic_load(&tp->n_sleeping) > 0) {
        pthread_mutex_lock(&tp->mutex);
        pthread_cond_broadcast(&tp->wake);
        pthread_mutex_unlock(&tp->mutex);
    }
}

void iq_threadpool_barrier(struct iq_threadpool * tp) {
    if (tp->n_threads == 1) {
        atomic_store_explicit(&tp->next_item, 0, memory_order_relaxed);
        return;
    }
    const int phase = atomic_load(&tp->phase);
    if (atomic_fetch_add(&tp->n_arrived, 1) == tp->n_threads - 1) {
        // the last to arrive: everyone else is waiting, so the counters are free to reset
        atomic_store_explicit(&tp->next_item, 0, memory_order_relaxed);
        atomic_store_explicit(&tp->n_arrived, 0, memory_order_relaxed);
        atomic_fetch_add(&tp->phase, 1);
        tp_wake(tp);
        return;
    }
    tp_wait_change(tp, &tp->phase, phase, TP_BARRIER_SPIN_NS);
}

int iq_threadpool_next(struct iq_threadpool * tp) {
    return atomic_fetch_add_explicit(&tp->next_item, 1, memory_order_relaxed);
}

static void * tp_worker(void * p) {
    struct tp_worker_arg * wa = p;
    struct iq_threadpool * tp = wa->tp;
    const int ith = wa->ith;
    free(wa);
    int seen = 0;
    for (;;) {
        seen = tp_wait_change(tp, &tp->generation, seen, TP_IDLE_SPIN_NS);
        if (tp->stop) {
            return NULL;
        }
        tp->fn(tp->arg, ith, tp->n_threads);
        iq_threadpool_barrier(tp);
    }
}

static void tp_announce(struct iq_threadpool * tp) {
    atomic_fetch_add(&tp->generation, 1);
    tp_wake(tp);
}

void iq_threadpool_run(struct iq_threadpool * tp, void (*fn)(void * arg, int ith, int nth), void * arg) {
    tp->fn = fn;
    tp->arg = arg;
    atomic_store(&tp->next_item, 0);
    if (tp->n_threads > 1) {
        tp_announce(tp);
    }
    fn(arg, 0, tp->n_threads);
    iq_threadpool_barrier(tp);
}

// Stops and joins the first n_started workers, then frees the pool.
static void tp_destroy(struct iq_threadpool * tp, int n_started) {
    tp->stop = true;
    tp_announce(tp);
    for (int i = 0; i < n_started; i++) {
        pthread_join(tp->threads[i], NULL);
    }
    pthread_mutex_destroy(&tp->mutex);
    pthread_cond_destroy(&tp->wake);
    free(tp->threads);
    free(tp);
}

struct iq_threadpool * iq_threadpool_new(int n_threads) {
    if (n_threads < 1) {
        n_threads = 1;
    }
    struct iq_threadpool * tp = calloc(1, sizeof(*tp));
    pthread_t * threads = calloc((size_t) n_threads, sizeof(*threads));
    if (tp == NULL || threads == NULL) {
        free(tp);
        free(threads);
        iq_error_set("thread pool: out of memory");
        return NULL;
    }
    tp->n_threads = n_threads;
    tp->threads = threads;
    pthread_mutex_init(&tp->mutex, NULL);
    pthread_cond_init(&tp->wake, NULL);
    // Workers start with every signal blocked, so signals meant for the program (Ctrl-C) reach
    // its own threads: a blocking read there (Python's input()) must wake up.
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (int i = 1; i < n_threads; i++) {
        struct tp_worker_arg * wa = malloc(sizeof(*wa));
        if (wa != NULL) {
            *wa = (struct tp_worker_arg) { tp, i };
        }
        if (wa == NULL || pthread_create(&threads[i - 1], NULL, tp_worker, wa) != 0) {
            free(wa);
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            tp_destroy(tp, i - 1);
            iq_error_set("thread pool: could not start thread %d of %d", i, n_threads);
            return NULL;
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return tp;
}

void iq_threadpool_free(struct iq_threadpool * tp) {
    if (tp != NULL) {
        tp_destroy(tp, tp->n_threads - 1);
    }
}

int iq_threadpool_n_threads(const struct iq_threadpool * tp) { return tp->n_threads; }
