/* Persistent thread pool: spin, yield, then sleep: waits on 32-bit words (futex on Linux).
 *
 * Two words drive everything:
 *   job      = (sequence << 8) | nth. The caller publishes a job by storing a new word; a worker
 *              that sees a new word runs the job if its index is below nth. Packing nth into the
 *              word means a worker never reads a half-published job.
 *   bar_gen  = the barrier's generation; the last thread to arrive bumps it.
 * A waiter spins for a short while (the other threads are usually microseconds away), yields
 * its core for a while longer, and then sleeps in the kernel; wakers only make the wake system
 * call when someone is asleep.
 */
#define _GNU_SOURCE
#include "threadpool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <sched.h>

#define SE_MAX_THREADS 256

/* How long a waiter spins before it yields (then sleeps, below). On an idle machine a barrier is
 * a few microseconds away and the next job (the next token, after Python sampled) a few tens.
 * Spinning much longer is harmful when the machine is busy: if the thread we wait for was
 * preempted, our spinning keeps a core from it, and a ubatch has ~150 barriers. So: spin
 * briefly, then yield. */
#define SPIN_NS_BARRIER 50000L
#define SPIN_NS_JOB 100000L
/* After its spin, a waiter keeps polling with sched_yield for this long before it sleeps. The
 * thread a barrier waits for is then mostly one that another runnable thread preempted (the
 * server's event loop, a client on the same machine), back within a scheduler slice or two; and
 * the next job comes after Python has sampled and sent a token (a millisecond or so). Sleeping
 * costs a futex wake-up each time, which on a VM (a halted vCPU woken by an interrupt) costs more
 * than the wait itself: 8 sequences served over HTTP went 17-19% faster without it. Yielding
 * keeps the core out of the idle state but gives it to any other runnable thread, so an
 * oversubscribed machine loses nothing (-np 8 --no-batching: same speed). */
#define YIELD_NS 2000000L

struct se_pool {
    int size;                 /* threads a job may use, the caller included */
    pthread_t *threads;       /* size - 1 workers */
    _Atomic uint32_t job;     /* (sequence << 8) | nth */
    _Atomic uint32_t bar_gen;
    _Atomic int bar_count;
    _Atomic int n_running;    /* workers still inside the current job */
    _Atomic int n_sleepers;   /* threads asleep in wait_change (so wakers know to call futex) */
    _Atomic int stop;
    se_pool_fn fn;            /* written before the job word is published */
    void *arg;
    int nth;
};

typedef struct {
    se_pool *pool;
    int ith;
} worker_arg;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void futex_wait(_Atomic uint32_t *word, uint32_t val) {
#ifdef __linux__
    /* returns at once if *word != val, so a wake between our check and the call is not lost */
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
#else
    (void)word; (void)val;
    sched_yield();
#endif
}

static void futex_wake_all(_Atomic uint32_t *word) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, SE_MAX_THREADS, NULL, NULL, 0);
#else
    (void)word;
#endif
}

/* The cache lines still to prefetch: span s, byte offset off (se_pool_barrier_prefetch). */
typedef struct {
    const se_prefetch_span *spans;
    int n, s;
    size_t off;
} prefetch_cursor;

/* Asks for the cursor's next cache line (into L2: the step's kernel takes it on to L1 itself);
 * 0 when there is none left. */
static int prefetch_next(prefetch_cursor *pc) {
    while (pc && pc->s < pc->n) {
        const se_prefetch_span *sp = &pc->spans[pc->s];
        if (pc->off < sp->n) {
            __builtin_prefetch((const char *)sp->p + pc->off, 0, 2);
            pc->off += 64;
            return 1;
        }
        pc->s++;
        pc->off = 0;
    }
    return 0;
}

/* Waits until *word != old; returns the new value. Each turn of the spin prefetches the cursor's
 * next line (when pc is not NULL), or pauses once there is none left. */
static uint32_t wait_change(se_pool *p, _Atomic uint32_t *word, uint32_t old, long spin_ns,
                            prefetch_cursor *pc) {
    uint32_t v = atomic_load_explicit(word, memory_order_acquire);
    if (v != old) return v;
    int64_t deadline = 0;
    for (int i = 1;; i++) {
        if (!prefetch_next(pc)) cpu_relax();
        v = atomic_load_explicit(word, memory_order_acquire);
        if (v != old) return v;
        if ((i & 255) == 0) {  /* look at the clock only now and then: it costs ~20 ns */
            int64_t t = now_ns();
            if (deadline == 0) deadline = t + spin_ns;
            else if (t > deadline) break;
        }
    }
    for (int64_t end = now_ns() + YIELD_NS; now_ns() < end;) {
        sched_yield();
        v = atomic_load_explicit(word, memory_order_acquire);
        if (v != old) return v;
    }
    /* Sleep. The sleeper count is raised before the last check (both sequentially consistent),
     * and the waker changes the word before reading the count: either the waker sees us and
     * wakes us, or we see the new value. */
    atomic_fetch_add(&p->n_sleepers, 1);
    while ((v = atomic_load(word)) == old) futex_wait(word, old);
    atomic_fetch_sub(&p->n_sleepers, 1);
    return v;
}

static void wake(se_pool *p, _Atomic uint32_t *word) {
    if (atomic_load(&p->n_sleepers) > 0) futex_wake_all(word);
}

void se_pool_barrier_prefetch(se_pool *p, const se_prefetch_span *spans, int n) {
    prefetch_cursor pc = { spans, n, 0, 0 };
    int nth = p->nth;
    if (nth > 1) {
        uint32_t gen = atomic_load(&p->bar_gen);
        if (atomic_fetch_add(&p->bar_count, 1) == nth - 1) {
            /* last to arrive: reset the count before releasing the others, who may re-enter at once */
            atomic_store(&p->bar_count, 0);
            atomic_fetch_add(&p->bar_gen, 1);
            wake(p, &p->bar_gen);
        } else {
            wait_change(p, &p->bar_gen, gen, SPIN_NS_BARRIER, &pc);
        }
    }
    while (prefetch_next(&pc)) {} /* what the wait left (all of it for the last to arrive) */
}

void se_pool_barrier(se_pool *p) { se_pool_barrier_prefetch(p, NULL, 0); }

static void *worker_main(void *varg) {
    worker_arg *wa = varg;
    se_pool *p = wa->pool;
    int ith = wa->ith;
    free(wa);
    uint32_t seen = 0;  /* the job word's initial value: a job published before we got here still counts */
    for (;;) {
        seen = wait_change(p, &p->job, seen, SPIN_NS_JOB, NULL);
        if (atomic_load(&p->stop)) break;
        int nth = (int)(seen & 0xff);
        if (ith >= nth) continue;  /* not needed for this job */
        p->fn(p->arg, ith, nth);
        atomic_fetch_sub_explicit(&p->n_running, 1, memory_order_release);
    }
    return NULL;
}

se_pool *se_pool_new(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > 255) n_threads = 255;  /* nth must fit in the job word's low byte */
    se_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->size = n_threads;
    p->nth = 1;
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof *p->threads);
        if (!p->threads) { free(p); return NULL; }
    }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (wa) {
            wa->pool = p;
            wa->ith = i;
        }
        if (!wa || pthread_create(&p->threads[i - 1], NULL, worker_main, wa) != 0) {
            free(wa);
            p->size = i;  /* stop the ones already started */
            se_pool_free(p);
            return NULL;
        }
    }
    return p;
}

void se_pool_free(se_pool *p) {
    if (!p) return;
    atomic_store(&p->stop, 1);
    uint32_t seq = (atomic_load(&p->job) >> 8) + 1;
    atomic_store(&p->job, seq << 8);
    futex_wake_all(&p->job);
    for (int i = 1; i < p->size; i++) pthread_join(p->threads[i - 1], NULL);
    free(p->threads);
    free(p);
}

int se_pool_size(const se_pool *p) { return p->size; }

void se_pool_run(se_pool *p, int nth, se_pool_fn fn, void *arg) {
    if (nth > p->size) nth = p->size;
    if (nth < 1) nth = 1;
    p->fn = fn;
    p->arg = arg;
    p->nth = nth;
    if (nth == 1) {  /* nothing to hand out: the workers stay asleep (or keep spinning) */
        fn(arg, 0, 1);
        return;
    }
    atomic_store(&p->bar_count, 0);
    atomic_store(&p->n_running, nth - 1);
    uint32_t seq = (atomic_load(&p->job) >> 8) + 1;
    atomic_store(&p->job, (seq << 8) | (uint32_t)nth);  /* publishes fn, arg, nth */
    wake(p, &p->job);
    fn(arg, 0, nth);
    /* the workers finish within a barrier's distance of us: spin, yielding if one was preempted */
    for (long i = 1; atomic_load_explicit(&p->n_running, memory_order_acquire) > 0; i++) {
        cpu_relax();
        if (i > (1L << 16)) sched_yield();
    }
}
