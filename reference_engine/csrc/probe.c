/* The machine probe: how fast this machine streams memory and multiplies int8, the two limits of
 * the benchmark's roofline (stdengine.bench.record.machine_probe, bench/roofline.py;
 * spec/bench-record.md, "The machine probe"). Not part of the engine's forward pass.
 *
 * Both measurements run on the engine's own thread pool (threadpool.c) with `threads` threads:
 * every thread starts at a barrier, thread 0 reads the clock after it and again after a barrier
 * at the end, so a figure is the slowest thread's, as in a forward pass. Each is the best of
 * `reps` runs: on a shared machine the best run is the least disturbed one.
 *
 *   se_probe_read_gbs(bytes, threads, passes, reps): GB/s (1e9 bytes per second) of the threads
 *     reading a buffer of `bytes` bytes, each its own contiguous share, `passes` times over, with
 *     256-bit loads (AVX2; 64-bit ones on a CPU without it), summed so that no load is dead.
 *     A buffer far larger than the last-level cache measures DRAM; one that fits, the cache.
 *   se_probe_int8_gmacs(threads, iters, reps): billions of int8 multiply-accumulates per second
 *     (all threads together) reached by independent dot-product instructions of the SIMD path
 *     the matmul kernels chose (kernels.c; INFER_REF_ISA): AVX-512 VNNI vpdpbusd (64 u8 x s8
 *     MACs per instruction, 12 accumulators, so the instruction's latency is hidden) or AVX2
 *     vpmaddubsw + vpmaddwd + vpaddd (32 MACs per three, the AVX2 kernels' sequence). `iters`
 *     loop trips per thread. 0 on the scalar path, which has no int8 dot product. On the amx
 *     path, its AVX-512 part: the vector figure.
 *   se_probe_amx_gmacs(threads, iters, reps): the same for AMX tiles: TDPBSUD into four C tiles
 *     from tiles loaded once (16384 MACs each); `iters` rounds of four per thread. 0 where the
 *     process cannot use AMX (the CPU lacks it, Linux refused, or INFER_REF_ISA chose a lower path).
 * Each returns a negative number when the buffer or the threads cannot be had.
 */
#include "engine.h"
#include "kernels.h"
#include "threadpool.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PROBE_X86 1
#endif

SE_API double se_probe_read_gbs(int64_t bytes, int32_t threads, int32_t passes, int32_t reps);
SE_API double se_probe_int8_gmacs(int32_t threads, int64_t iters, int32_t reps);
SE_API double se_probe_amx_gmacs(int32_t threads, int64_t iters, int32_t reps);

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define SE_PROBE_MAX_THREADS 256
#define CHUNK 128 /* bytes per loop trip of a reader; every share is a whole number of them */

/* ---------------------------------------------------------------------------------------------
 * Readers: the sum of 64-bit words of p[0, n), n a multiple of CHUNK (the sum only keeps the
 * loads alive).
 */

static uint64_t read_scalar(const uint8_t *p, size_t n) {
    const uint64_t *w = (const uint64_t *)p;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i < n / 8; i += 4) {
        s0 += w[i];
        s1 += w[i + 1];
        s2 += w[i + 2];
        s3 += w[i + 3];
    }
    return s0 + s1 + s2 + s3;
}

#ifdef PROBE_X86
__attribute__((target("avx2"))) static uint64_t read_avx2(const uint8_t *p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n; i += CHUNK) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, s);
    return out[0] + out[1] + out[2] + out[3];
}
#endif

static int have_avx2(void) {
#ifdef PROBE_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * MAC loops: `iters` trips of independent dot-product instructions; the MACs they did.
 */

#ifdef PROBE_X86
/* The loops are written in assembly: compiled from intrinsics, GCC added register copies (and
 * spills on AVX2) between the dot products, which measured the compiler, not the machine. */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static uint64_t macs_avx512(int64_t iters,
                                                                                  uint64_t *sink) {
    __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
    __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
    __m512i c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
    for (int64_t i = 0; i < iters; i++)
        __asm__ volatile("vpdpbusd %[b], %[a], %[c0]\n\tvpdpbusd %[b], %[a], %[c1]\n\t"
                         "vpdpbusd %[b], %[a], %[c2]\n\tvpdpbusd %[b], %[a], %[c3]\n\t"
                         "vpdpbusd %[b], %[a], %[c4]\n\tvpdpbusd %[b], %[a], %[c5]\n\t"
                         "vpdpbusd %[b], %[a], %[c6]\n\tvpdpbusd %[b], %[a], %[c7]\n\t"
                         "vpdpbusd %[b], %[a], %[c8]\n\tvpdpbusd %[b], %[a], %[c9]\n\t"
                         "vpdpbusd %[b], %[a], %[c10]\n\tvpdpbusd %[b], %[a], %[c11]"
                         : [c0] "+v"(c0), [c1] "+v"(c1), [c2] "+v"(c2), [c3] "+v"(c3), [c4] "+v"(c4),
                           [c5] "+v"(c5), [c6] "+v"(c6), [c7] "+v"(c7), [c8] "+v"(c8), [c9] "+v"(c9),
                           [c10] "+v"(c10), [c11] "+v"(c11)
                         : [a] "v"(a), [b] "v"(b));
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(c0, c1), _mm512_add_epi32(c2, c3)),
                                 _mm512_add_epi32(_mm512_add_epi32(c4, c5), _mm512_add_epi32(c6, c7)));
    s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(c8, c9), _mm512_add_epi32(c10, c11)));
    *sink += (uint64_t)(uint32_t)_mm512_reduce_add_epi32(s);
    return (uint64_t)iters * 12 * 64;
}

/* The AVX2 kernels' sequence, 6 chains: t = maddubs(x, b); t = madd(t, 1); c += t. */
#define AVX2_CHAIN(k)                                                                              \
    "vpmaddubsw %[b], %[x], %[t" #k "]\n\tvpmaddwd %[ones], %[t" #k "], %[t" #k "]\n\t"             \
    "vpaddd %[t" #k "], %[c" #k "], %[c" #k "]\n\t"
__attribute__((target("avx2"))) static uint64_t macs_avx2(int64_t iters, uint64_t *sink) {
    const __m256i ones = _mm256_set1_epi16(1), x = _mm256_set1_epi8(1), b = _mm256_set1_epi8(2);
    __m256i c0 = _mm256_setzero_si256(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
    __m256i t0, t1, t2, t3, t4, t5;
    for (int64_t i = 0; i < iters; i++)
        __asm__ volatile(AVX2_CHAIN(0) AVX2_CHAIN(1) AVX2_CHAIN(2) AVX2_CHAIN(3) AVX2_CHAIN(4) AVX2_CHAIN(5)
                         : [c0] "+x"(c0), [c1] "+x"(c1), [c2] "+x"(c2), [c3] "+x"(c3), [c4] "+x"(c4),
                           [c5] "+x"(c5), [t0] "=&x"(t0), [t1] "=&x"(t1), [t2] "=&x"(t2), [t3] "=&x"(t3),
                           [t4] "=&x"(t4), [t5] "=&x"(t5)
                         : [x] "x"(x), [b] "x"(b), [ones] "x"(ones));
    __m256i s = _mm256_add_epi32(_mm256_add_epi32(c0, c1), _mm256_add_epi32(c2, c3));
    s = _mm256_add_epi32(s, _mm256_add_epi32(c4, c5));
    int32_t out[8];
    _mm256_storeu_si256((__m256i *)out, s);
    for (int i = 0; i < 8; i++) *sink += (uint64_t)(uint32_t)out[i];
    return (uint64_t)iters * 6 * 32;
}
#endif

/* ---------------------------------------------------------------------------------------------
 * The timed job
 */

typedef struct {
    se_pool *pool;
    /* read */
    const uint8_t *buf;
    size_t share; /* bytes per thread */
    int passes, avx2;
    /* macs */
    int64_t iters;
    se_isa isa;
    int amx; /* tiles rather than vectors */
    /* out */
    double seconds;
    uint64_t work[SE_PROBE_MAX_THREADS]; /* per thread: bytes read or MACs done */
    uint64_t sink[SE_PROBE_MAX_THREADS];
} probe_job;

static void probe_thread(void *arg, int ith, int nth) {
    (void)nth;
    probe_job *j = arg;
    uint64_t work = 0, sink = 0;
    se_pool_barrier(j->pool);
    double t0 = ith == 0 ? now_s() : 0.0;
    if (j->buf) {
        const uint8_t *p = j->buf + (size_t)ith * j->share;
        for (int k = 0; k < j->passes; k++) {
#ifdef PROBE_X86
            sink += j->avx2 ? read_avx2(p, j->share) : read_scalar(p, j->share);
#else
            sink += read_scalar(p, j->share);
#endif
            work += j->share;
        }
    } else {
#ifdef PROBE_X86
        if (j->amx) work = se_amx_probe_macs(j->iters);
        else if (j->isa >= SE_ISA_AVX512) work = macs_avx512(j->iters, &sink); /* AMX: its vector part */
        else if (j->isa == SE_ISA_AVX2) work = macs_avx2(j->iters, &sink);
#endif
    }
    se_pool_barrier(j->pool);
    if (ith == 0) j->seconds = now_s() - t0;
    j->work[ith] = work;
    j->sink[ith] = sink;
}

/* Best of reps: the work of all threads over the shortest time, in units of 1e9 per second. */
static double run_best(probe_job *j, int threads, int reps) {
    double best = 0.0;
    for (int r = 0; r < reps; r++) {
        se_pool_run(j->pool, threads, probe_thread, j);
        uint64_t work = 0;
        for (int i = 0; i < threads; i++) work += j->work[i];
        double rate = j->seconds > 0 ? (double)work / j->seconds * 1e-9 : 0.0;
        if (rate > best) best = rate;
    }
    return best;
}

static int bad_threads(int32_t threads) { return threads < 1 || threads > SE_PROBE_MAX_THREADS; }

double se_probe_read_gbs(int64_t bytes, int32_t threads, int32_t passes, int32_t reps) {
    if (bad_threads(threads) || bytes < CHUNK * (int64_t)threads || passes < 1 || reps < 1) return -1.0;
    size_t share = (size_t)bytes / (size_t)threads / CHUNK * CHUNK;
    uint8_t *buf = aligned_alloc(64, share * (size_t)threads);
    se_pool *pool = se_pool_new(threads);
    if (!buf || !pool) {
        free(buf);
        if (pool) se_pool_free(pool);
        return -1.0;
    }
    memset(buf, 1, share * (size_t)threads); /* the pages exist before the clock starts */
    static probe_job zero;
    probe_job *j = malloc(sizeof *j);
    double gbs = -1.0;
    if (j) {
        *j = zero;
        j->pool = pool;
        j->buf = buf;
        j->share = share;
        j->passes = passes;
        j->avx2 = have_avx2();
        gbs = run_best(j, threads, reps);
        free(j);
    }
    se_pool_free(pool);
    free(buf);
    return gbs;
}

static double probe_macs(int32_t threads, int64_t iters, int32_t reps, int amx) {
    if (bad_threads(threads) || iters < 1 || reps < 1) return -1.0;
    se_kernels_init();
    se_isa isa = se_isa_in_use();
    if (isa == SE_ISA_SCALAR || (amx && isa != SE_ISA_AMX)) return 0.0;
    se_pool *pool = se_pool_new(threads);
    probe_job *j = malloc(sizeof *j);
    double gmacs = -1.0;
    if (pool && j) {
        static probe_job zero;
        *j = zero;
        j->pool = pool;
        j->iters = iters;
        j->isa = isa;
        j->amx = amx;
        gmacs = run_best(j, threads, reps);
    }
    free(j);
    if (pool) se_pool_free(pool);
    return gmacs;
}

double se_probe_int8_gmacs(int32_t threads, int64_t iters, int32_t reps) { return probe_macs(threads, iters, reps, 0); }
double se_probe_amx_gmacs(int32_t threads, int64_t iters, int32_t reps) { return probe_macs(threads, iters, reps, 1); }
