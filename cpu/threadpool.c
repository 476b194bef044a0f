// The thread pool (threadpool.h).
//
// A run is announced by bumping `generation`, a barrier is passed by bumping `phase`. A
// waiting thread spins on the counter for a while, then sleeps on it (a futex):
// back-to-back ops and runs go on without a system call, while a thread that waits long (an
// idle worker between tokens, or a partner thread the OS has taken off its core on a busy
// machine) gives its core away.
//
// How long to spin adapts per thread (struct tp_spin): on a machine with more runnable
// threads than cores, the thread a spinner waits for is often off its core, possibly the
// spinner's own, and every spin then burns the time that thread needs (a fixed 100 us spin
// at barriers decoded 7x slower with 2 threads than with 1 beside one busy process on 2
// cores). A spin that ends in sleep halves the next one, down to a few pauses; one that is met
// doubles it; one wait in TP_PROBE spins the whole limit and, met, restores it, so the spins
// come back once the machine is quiet again.
//
// A pool belongs to the process that made it: a child made by fork() has none of its
// workers, so the first run in the child starts them again (tp_start), and freeing the
// pool there joins nothing.
#include "threadpool.h"

#include "iq.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define TP_IDLE_SPIN_NS 1000000    // an idle worker spins at most this long before it sleeps
#define TP_BARRIER_SPIN_NS 100000  // a thread at a barrier likewise
#define TP_SPIN_STEP_NS 1000       // a spin that is met grows by twice itself plus this
#define TP_PROBE 128               // one wait in this many spins its whole limit

struct iq_threadpool {
    int n_threads;
    pid_t pid;  // the process whose threads `threads` are
    pthread_t * threads;
    void (*fn)(void * arg, int ith, int nth);
    void * arg;
    bool stop;

    alignas(64) atomic_int generation;  // bumped once per run
    atomic_int n_sleeping;

    alignas(64) atomic_int n_arrived;  // barrier
    atomic_int phase;
    alignas(64) atomic_int next_item;
};

struct tp_worker_arg {
    struct iq_threadpool * tp;
    int ith;
};

// One thread's spin length for one kind of wait, and its count of waits.
struct tp_spin {
    int64_t ns;
    unsigned n;
};

static _Thread_local struct tp_spin tp_spin_idle = { TP_IDLE_SPIN_NS, 0 };
static _Thread_local struct tp_spin tp_spin_barrier = { TP_BARRIER_SPIN_NS, 0 };

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

// Waits until *x differs from `old`; returns the new value. It spins at most spin->ns (max_ns
// on a probe), then sleeps. The sleeper raises n_sleeping before it reads *x again, and a
// waker changes *x before it reads n_sleeping (both sequentially consistent): one of the two
// sees the other, so no wake-up is lost.
static int tp_wait_change(struct iq_threadpool * tp, atomic_int * x, int old, struct tp_spin * spin, int64_t max_ns) {
    const bool probe = ++spin->n % TP_PROBE == 0;
    const int64_t limit = probe ? max_ns : spin->ns;
    int64_t t0 = 0;
    for (int spins = 1;; spins++) {
        const int v = atomic_load_explicit(x, memory_order_acquire);
        if (v != old) {
            const int64_t grown = probe ? max_ns : 2 * spin->ns + TP_SPIN_STEP_NS;
            spin->ns = grown < max_ns ? grown : max_ns;
            return v;
        }
        tp_pause();
        if (spins % 16 == 0) {
            const int64_t now = tp_now_ns();
            t0 = t0 != 0 ? t0 : now;
            if (now - t0 > limit) {
                break;
            }
        }
    }
    spin->ns /= 2;
    atomic_fetch_add(&tp->n_sleeping, 1);
    int v;
    while ((v = atomic_load(x)) == old) {
        // returns at once if *x is no longer `old`, so a change before the call is not missed
        syscall(SYS_futex, x, FUTEX_WAIT_PRIVATE, old, NULL, NULL, 0);
    }
    atomic_fetch_sub(&tp->n_sleeping, 1);
    return v;
}

// Called after changing *x, a counter that threads may sleep on.
static void tp_wake(struct iq_threadpool * tp, atomic_int * x) {
    if (atomic_load(&tp->n_sleeping) > 0) {
        syscall(SYS_futex, x, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
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
        tp_wake(tp, &tp->phase);
        return;
    }
    tp_wait_change(tp, &tp->phase, phase, &tp_spin_barrier, TP_BARRIER_SPIN_NS);
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
        seen = tp_wait_change(tp, &tp->generation, seen, &tp_spin_idle, TP_IDLE_SPIN_NS);
        if (tp->stop) {
            return NULL;
        }
        tp->fn(tp->arg, ith, tp->n_threads);
        iq_threadpool_barrier(tp);
    }
}

static void tp_announce(struct iq_threadpool * tp) {
    atomic_fetch_add(&tp->generation, 1);
    tp_wake(tp, &tp->generation);
}

// Stops and joins the first n_started workers.
static void tp_stop(struct iq_threadpool * tp, int n_started) {
    tp->stop = true;
    tp_announce(tp);
    for (int i = 0; i < n_started; i++) {
        pthread_join(tp->threads[i], NULL);
    }
}

// Sets the counters to their first state and starts the workers of this process; false
// (+ iq_error_set) if one could not start (those started are stopped again).
static bool tp_start(struct iq_threadpool * tp) {
    tp->pid = getpid();
    tp->stop = false;
    atomic_init(&tp->generation, 0);
    atomic_init(&tp->n_sleeping, 0);
    atomic_init(&tp->n_arrived, 0);
    atomic_init(&tp->phase, 0);
    atomic_init(&tp->next_item, 0);
    // Workers start with every signal blocked, so signals meant for the program (Ctrl-C) reach
    // its own threads: a blocking read there (Python's input()) must wake up.
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (int i = 1; i < tp->n_threads; i++) {
        struct tp_worker_arg * wa = malloc(sizeof(*wa));
        if (wa != NULL) {
            *wa = (struct tp_worker_arg) { tp, i };
        }
        if (wa == NULL || pthread_create(&tp->threads[i - 1], NULL, tp_worker, wa) != 0) {
            free(wa);
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            tp_stop(tp, i - 1);
            tp->pid = 0;  // no workers in any process: the next run tries again
            iq_error_set("thread pool: could not start thread %d of %d", i, tp->n_threads);
            return false;
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return true;
}

int iq_threadpool_run(struct iq_threadpool * tp, void (*fn)(void * arg, int ith, int nth), void * arg) {
    if (tp->pid != getpid() && !tp_start(tp)) {
        return -1;
    }
    tp->fn = fn;
    tp->arg = arg;
    atomic_store(&tp->next_item, 0);
    if (tp->n_threads > 1) {
        tp_announce(tp);
    }
    fn(arg, 0, tp->n_threads);
    iq_threadpool_barrier(tp);
    return 0;
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
    if (!tp_start(tp)) {
        iq_threadpool_free(tp);
        return NULL;
    }
    return tp;
}

void iq_threadpool_free(struct iq_threadpool * tp) {
    if (tp == NULL) {
        return;
    }
    if (tp->pid == getpid()) {  // else the workers are another process's
        tp_stop(tp, tp->n_threads - 1);
    }
    free(tp->threads);
    free(tp);
}

int iq_threadpool_n_threads(const struct iq_threadpool * tp) { return tp->n_threads; }
