/* A persistent pool of worker threads for the forward passes.
 *
 * One job = one function run on nth threads at once (the caller is thread 0), like an OpenMP
 * parallel region. Inside a job the threads meet at se_pool_barrier(). Waiting spins first
 * (a barrier inside a forward pass is a few microseconds away) and then sleeps on a futex,
 * so an idle pool costs no CPU while Python does something else.
 */
#ifndef SE_THREADPOOL_H
#define SE_THREADPOOL_H

#include <stddef.h>

typedef struct se_pool se_pool;
typedef void (*se_pool_fn)(void *arg, int ith, int nth);

/* A pool able to run jobs on up to n_threads threads (n_threads - 1 workers are started).
 * NULL if the threads cannot be created. */
se_pool *se_pool_new(int n_threads);
void se_pool_free(se_pool *p);
int se_pool_size(const se_pool *p);

/* Runs fn(arg, ith, nth) for ith = 0..nth-1 (nth is clamped to 1..size) and returns when all
 * have returned. The calling thread runs ith = 0. Not reentrant: one job at a time. */
void se_pool_run(se_pool *p, int nth, se_pool_fn fn, void *arg);

/* Every thread of the current job waits here until all nth have arrived. Writes made before
 * the barrier are visible to every thread after it. */
void se_pool_barrier(se_pool *p);

/* Memory that a thread reads first after a barrier: n bytes from p. */
typedef struct {
    const void *p;
    size_t n;
} se_prefetch_span;

/* se_pool_barrier, and the spans (n of them) asked for from memory meanwhile: a thread that waits
 * issues one cache line's prefetch per turn of its spin instead of idling, the last to arrive
 * after it has released the others. The step after a barrier starts by streaming weights; their
 * first rows would otherwise reach the core only after the wait. */
void se_pool_barrier_prefetch(se_pool *p, const se_prefetch_span *spans, int n);

#endif
