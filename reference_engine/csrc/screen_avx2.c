/* The screen's bound kernels (screen.h) with AVX2, FMA and F16C. Only this file is compiled for
 * these ISAs (the pragma below); screen.c calls them when the CPU has them.
 *
 * Eight blocks of a row at a time, block p in lane p: each block's integer sum (vpmaddubsw: the
 * plane's values are unsigned and at most 15, so a pair stays far below s16's limit), the eight
 * sums gathered into one vector with horizontal adds, then the two ends in integers and one FMA
 * each.
 */
#define SE_ENGINE_INTERNAL
#include "screen.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* Lane p: the sum of v[p]'s eight 32-bit lanes */
INLINE __m256i lane_sums(const __m256i v[8]) {
    const __m256i a = _mm256_hadd_epi32(v[0], v[1]), c = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i e = _mm256_hadd_epi32(v[4], v[5]), g = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i ac = _mm256_hadd_epi32(a, c), eg = _mm256_hadd_epi32(e, g);
    return _mm256_add_epi32(_mm256_permute2x128_si256(ac, eg, 0x20), _mm256_permute2x128_si256(ac, eg, 0x31));
}

/* sum u*x over 32 elements, in 8 lanes of 32 bits (u unsigned, small) */
INLINE __m256i dot32(__m256i u, const int8_t *x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)x)), _mm256_set1_epi16(1));
}

/* The products d*dx of blocks 8g .. 8g+cnt-1 (0 past cnt: the row stores only nb scales). Loads
 * of the exact size: a copy through memory would stall on store forwarding. */
INLINE __m256 scales(const se_screen_act *a, int64_t g, const uint16_t *d, const int cnt) {
    int32_t w;
    __m128i h;
    if (cnt == 8) {
        h = _mm_loadu_si128((const __m128i *)d);
    } else if (cnt >= 4) {
        h = _mm_loadl_epi64((const __m128i *)d);
        if (cnt == 6) { memcpy(&w, d + 4, 4); h = _mm_insert_epi32(h, w, 2); }
    } else {
        memcpy(&w, d, 4);
        h = _mm_cvtsi32_si128(w);
    }
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(a->dx + g * 8));
}

/* A group's block sums (lane p: block p's) into the two ends: each end's integer, (sums << shift)
 * plus its per-block constant, times the blocks' scales d*dx, added to its accumulator */
INLINE void fold_ends(const se_screen_act *a, int64_t g, const uint16_t *d, const int cnt, const __m256i v[8],
                      int shift, const int32_t *c_lo, const int32_t *c_hi, __m256 *lo, __m256 *hi) {
    const __m256i s = _mm256_slli_epi32(lane_sums(v), shift);
    const __m256i l = _mm256_add_epi32(s, _mm256_loadu_si256((const __m256i *)(c_lo + g * 8)));
    const __m256i h = _mm256_add_epi32(s, _mm256_loadu_si256((const __m256i *)(c_hi + g * 8)));
    const __m256 dd = scales(a, g, d, cnt);
    *lo = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), *lo);
    *hi = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(h), *hi);
}

/* Stage 1, blocks 8g .. 8g+cnt-1 (nib: their nibbles, 128 bytes a group) into the two ends */
INLINE void group_step(const se_screen_act *a, int64_t g, const uint16_t *d, const uint8_t *nib, const int cnt,
                       __m256 *lo, __m256 *hi) {
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256i v[8];
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) { /* two blocks per 32 bytes of nibbles */
        if (2 * q >= cnt) { v[2 * q] = v[2 * q + 1] = _mm256_setzero_si256(); continue; }
        const __m256i n = _mm256_loadu_si256((const __m256i *)(nib + 32 * q));
        v[2 * q] = dot32(_mm256_and_si256(n, low4), a->xq + g * 256 + 64 * q);
        v[2 * q + 1] = dot32(_mm256_and_si256(_mm256_srli_epi16(n, 4), low4), a->xq + g * 256 + 64 * q + 32);
    }
    fold_ends(a, g, d, cnt, v, 4, a->lo_c, a->hi_c, lo, hi);
}

/* Stage 2, blocks 8g .. 8g+cnt-1 (bits: their fifth bits, 32 bytes a group) into up and down */
INLINE void refine_step(const se_screen_act *a, int64_t g, const uint16_t *d, const uint8_t *bits, const int cnt,
                        __m256 *up, __m256 *down) {
    const __m256i one = _mm256_set1_epi8(1), b = _mm256_loadu_si256((const __m256i *)bits);
    __m256i v[8];
#pragma GCC unroll 8
    for (int p = 0; p < 8; p++) /* bit p of each byte, as 0 or 1 (a 16-bit shift: the mask drops what crosses) */
        v[p] = p < cnt ? dot32(_mm256_and_si256(_mm256_srli_epi16(b, p), one), a->xq + g * 256 + 32 * p)
                       : _mm256_setzero_si256();
    fold_ends(a, g, d, cnt, v, 3, a->neg8, a->pos8, up, down);
}

typedef void step_fn(const se_screen_act *a, int64_t g, const uint16_t *d, const uint8_t *q, const int cnt,
                     __m256 *x, __m256 *y);

/* One row through a step, eight blocks at a time (q: its plane, group_bytes a group; d: its
 * scales), the last group's block count as a constant (nb is even); the two sums into x and y */
INLINE void walk_row(step_fn *step, const se_screen_act *a, int64_t nb, const uint16_t *d, const uint8_t *q,
                     size_t group_bytes, float *x, float *y) {
    const int64_t full = nb / 8;
    __m256 u = _mm256_setzero_ps(), w = _mm256_setzero_ps();
    for (int64_t g = 0; g < full; g++) step(a, g, d + 8 * g, q + group_bytes * g, 8, &u, &w);
    d += 8 * full, q += group_bytes * full;
    switch (nb % 8) {
    case 2: step(a, full, d, q, 2, &u, &w); break;
    case 4: step(a, full, d, q, 4, &u, &w); break;
    case 6: step(a, full, d, q, 6, &u, &w); break;
    }
    *x = hsum8(u);
    *y = hsum8(w);
}

static void bounds_avx2(const se_screen *s, const se_screen_act *a, int64_t r0, int64_t r1, float *lo, float *hi) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = s->rows + (size_t)r * s->row_size;
        const uint8_t *ahead = row + SE_SCREEN_PREFETCH;
        for (size_t o = 0; o < s->row_size; o += 64) _mm_prefetch((const char *)ahead + o, _MM_HINT_T0);
        walk_row(group_step, a, s->nb, (const uint16_t *)row, row + 2 * s->nb, 128, &lo[r], &hi[r]);
    }
}

#define REFINE_AHEAD 4 /* rows whose scales and fifth bits are asked for before they are read */

static void refine_avx2(const se_screen *s, const se_screen_act *a, const int32_t *ids, int32_t n, float *up,
                        float *down) {
    for (int32_t i = 0; i < n; i++) {
        if (i + REFINE_AHEAD < n) {
            const uint8_t *next = s->fifth + (size_t)ids[i + REFINE_AHEAD] * s->fifth_size;
            for (size_t o = 0; o < s->fifth_size; o += 64) _mm_prefetch((const char *)next + o, _MM_HINT_T0);
        }
        const uint8_t *bits = s->fifth + (size_t)ids[i] * s->fifth_size;
        walk_row(refine_step, a, s->nb, (const uint16_t *)(bits + 4 * s->nbp), bits, 32, &up[i], &down[i]);
    }
}

const se_screen_bounds_fn se_screen_bounds_avx2 = bounds_avx2;
const se_screen_refine_fn se_screen_refine_avx2 = refine_avx2;
#else
const se_screen_bounds_fn se_screen_bounds_avx2 = 0;
const se_screen_refine_fn se_screen_refine_avx2 = 0;
#endif
