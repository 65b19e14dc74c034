/* The screen's stage 1 (screen.h) with AVX-512 and VNNI: a tile's 16 rows in the 16 lanes, and the
 * full head from planes that stand for it (below). Only this file is compiled for these ISAs (the
 * pragma below); screen.c calls it on the AVX-512 and AMX paths. Stage 2 reads scattered rows, eight
 * blocks at a time, and keeps screen_avx2.c's kernel.
 *
 * Per block: vpdpbusd of the low nibbles (h of elements 8m .. 8m+3) and of the high ones kept in
 * place (16h of elements 8m+4 .. 8m+7) by four activations broadcast, so that (low << 4) + high is
 * 16 * sum h*x, exactly; then the two ends in integers and one fma each, as on the AVX2 path: the
 * same operations in the same order, so the same bits. The plane is asked for into L2 (prefetcht2),
 * not L1: on the Intel Xeon the stage-1 loop then waited less on the core's fill buffers (Gemma-3,
 * greedy: 1.07x the tokens/s; the AVX2 path, measured on a Zen 3, keeps prefetcht0).
 */
#define SE_ENGINE_INTERNAL
#include "screen.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#include "screen_simd.h"

/* 16 * sum h*x of a tile's block (blk) for its 16 rows, one per lane, exactly */
static inline __m512i sum16h(const uint8_t *blk, const int8_t *x) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8((char)0xF0);
    __m512i lows = _mm512_setzero_si512(), highs = _mm512_setzero_si512();
    for (int m = 0; m < 4; m++) {
        const __m512i n = _mm512_loadu_si512(blk + 32 + 64 * m);
        lows = _mm512_dpbusd_epi32(lows, _mm512_and_si512(n, low4), _mm512_set1_epi32(ld32(x + 8 * m)));
        highs = _mm512_dpbusd_epi32(highs, _mm512_and_si512(n, high4), _mm512_set1_epi32(ld32(x + 8 * m + 4)));
    }
    return _mm512_add_epi32(_mm512_slli_epi32(lows, 4), highs);
}

static void bounds_avx512(const se_screen *s, const se_screen_act *a, int64_t t0, int64_t t1, float *lo, float *hi) {
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *tile = se_screen_tile(s, t);
        __m512 l = _mm512_setzero_ps(), h = _mm512_setzero_ps();
        for (int64_t b = 0; b < s->nb; b++) {
            const uint8_t *blk = tile + SE_SCREEN_TILE_BLOCK * b;
            for (int o = 0; o < SE_SCREEN_TILE_BLOCK; o += 64) _mm_prefetch((const char *)blk + SE_SCREEN_PREFETCH + o, _MM_HINT_T2);
            const __m512i s16 = sum16h(blk, a->xq + 32 * b);
            const __m512 dd = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk)), _mm512_set1_ps(a->dx[b]));
            l = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(_mm512_add_epi32(s16, _mm512_set1_epi32(a->lo_c[b]))), l);
            h = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(_mm512_add_epi32(s16, _mm512_set1_epi32(a->hi_c[b]))), h);
        }
        _mm512_storeu_ps(lo + t * SE_SCREEN_TILE, l);
        _mm512_storeu_ps(hi + t * SE_SCREEN_TILE, h);
    }
}

/* ---------------------------------------------------------------------------------------------
 * The full head from planes that stand for it, without rebuilding its rows: each block's exact
 * integer sum sum q*x = 16 * sum h*x + sum (8f + l)*x - 128 * sum x, then the head's own float
 * steps in its summation order (kernels_avx512.c), so the head's bits. */

/* Row r's sum (8f + l)*x per block, into lane r % 16 of isum[16 * b]: 8f + l as bytes from its
 * bits as masks, one vpdpbusd a block, eight blocks' sums gathered at a time */
static void low_sums(const se_screen *s, const se_screen_act *a, int64_t r, int32_t *isum) {
    const int i = (int)(r % SE_SCREEN_TILE);
    const uint8_t *rec = se_screen_record(s, r);
    const uint32_t *low = se_screen_low(s, r);
    const __m256i eight = _mm256_set1_epi8(8), four = _mm256_set1_epi8(4), two = _mm256_set1_epi8(2);
    const __m256i one = _mm256_set1_epi8(1), zero = _mm256_setzero_si256();
    for (int64_t g = 0; g < s->nb; g += 8) {
        const __m256i group = _mm256_loadu_si256((const __m256i *)(rec + 4 * g));
        const int cnt = s->nb - g < 8 ? (int)(s->nb - g) : 8;
        __m256i v[8];
        for (int p = 0; p < 8; p++) {
            if (p >= cnt) { v[p] = zero; continue; }
            const uint32_t *w = low + 3 * (g + p);
            __m256i u = _mm256_maskz_mov_epi8(_mm256_test_epi8_mask(group, _mm256_set1_epi8((char)(1 << p))), eight);
            u = _mm256_mask_add_epi8(u, (__mmask32)w[2], u, four);
            u = _mm256_mask_add_epi8(u, (__mmask32)w[1], u, two);
            u = _mm256_mask_add_epi8(u, (__mmask32)w[0], u, one);
            v[p] = _mm256_dpbusd_epi32(zero, u, _mm256_loadu_si256((const __m256i *)(a->xq + 32 * (g + p))));
        }
        int32_t sums[8];
        _mm256_storeu_si256((__m256i *)sums, lane_sums(v));
        for (int p = 0; p < cnt; p++) isum[16 * (g + p) + i] = sums[p];
    }
}

/* One lane chain of the head's summation order for a tile's 16 rows: blocks b0, b0 + 16, ... */
static inline __m512 chain(const se_screen *s, const se_screen_act *a, const uint8_t *tile, const int32_t *isum, int b0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = b0; b < s->nb; b += 16) {
        const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + SE_SCREEN_TILE_BLOCK * b)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(isum + 16 * b)), _mm512_mul_ps(wd, _mm512_set1_ps(a->dx[b])), acc);
    }
    return acc;
}

static const int LANE32[16] = { 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15 }; /* kernels_avx512.h's */

/* The logits of the rows of tiles [t0, t1) into out (rows past n_rows left alone); isum: 16 * nb
 * int32 of scratch */
static void head_avx512(const se_screen *s, const se_screen_act *a, int64_t t0, int64_t t1, int32_t *isum, float *out) {
    for (int64_t t = t0; t < t1; t++) {
        const int64_t r0 = t * SE_SCREEN_TILE, n = s->n_rows - r0 < SE_SCREEN_TILE ? s->n_rows - r0 : SE_SCREEN_TILE;
        const uint8_t *tile = se_screen_tile(s, t);
        if (n < SE_SCREEN_TILE) memset(isum, 0, (size_t)(16 * s->nb) * sizeof(int32_t)); /* the empty rows' lanes */
        for (int64_t i = 0; i < n; i++) low_sums(s, a, r0 + i, isum);
        for (int64_t b = 0; b < s->nb; b++) { /* and 16 * sum h*x, as stage 1 has it */
            const __m512i s16 = sum16h(tile + SE_SCREEN_TILE_BLOCK * b, a->xq + 32 * b);
            const int32_t m128 = 16 * (a->neg8[b] + a->pos8[b]); /* -128 * sum x */
            _mm512_storeu_si512(isum + 16 * b, _mm512_add_epi32(_mm512_add_epi32(s16, _mm512_loadu_si512(isum + 16 * b)),
                                                                 _mm512_set1_epi32(m128)));
        }
        /* the chains added in hsum16's tree: (c0 + c2) + (c1 + c3) per quad, (q0 + q2) + (q1 + q3) */
        __m512 half[2];
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 2; j++) {
                const int qd = h + 2 * j;
                const __m512 quad = _mm512_add_ps(_mm512_add_ps(chain(s, a, tile, isum, LANE32[4 * qd]), chain(s, a, tile, isum, LANE32[4 * qd + 2])),
                                                  _mm512_add_ps(chain(s, a, tile, isum, LANE32[4 * qd + 1]), chain(s, a, tile, isum, LANE32[4 * qd + 3])));
                half[h] = j ? _mm512_add_ps(half[h], quad) : quad;
            }
        _mm512_mask_storeu_ps(out + r0, (__mmask16)((1u << n) - 1), _mm512_add_ps(half[0], half[1]));
    }
}

const se_screen_bounds_fn se_screen_bounds_avx512 = bounds_avx512;
const se_screen_head_fn se_screen_head_avx512 = head_avx512;
#else
const se_screen_bounds_fn se_screen_bounds_avx512 = 0;
const se_screen_head_fn se_screen_head_avx512 = 0;
#endif
