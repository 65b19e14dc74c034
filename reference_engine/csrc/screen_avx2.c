/* The screen's bound kernel (screen.h) with AVX2, FMA and F16C. Only this file is compiled for
 * these ISAs (the pragma below); screen.c calls it when the CPU has them.
 *
 * Eight blocks of a row at a time, block p in lane p: each block's sum h*x (vpmaddubsw: h is
 * unsigned and at most 31, so a pair stays far below s16's limit), the eight sums gathered into
 * one vector with horizontal adds, then the interval's two ends in integers and one FMA each.
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

/* Block p's fifth bits from its group's 32 bytes (bit p of byte j), as 16 where set: a 16-bit
 * shift brings bit p to bit 4 (what crosses from the neighbouring byte lands below bit 4) */
INLINE __m256i fifth_bits(__m256i bits, const int p) {
    const __m256i b4 = _mm256_set1_epi8(16);
    if (p < 4) return _mm256_and_si256(_mm256_slli_epi16(bits, 4 - p), b4);
    if (p > 4) return _mm256_and_si256(_mm256_srli_epi16(bits, p - 4), b4);
    return _mm256_and_si256(bits, b4);
}

/* Lane p: sum h*x over block p of a group of cnt <= 8 blocks (lanes past cnt: 0) */
INLINE __m256i group_sums(const uint8_t *nib, const uint8_t *bits, const int8_t *xq, const int cnt) {
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(15);
    const __m256i b = _mm256_loadu_si256((const __m256i *)bits);
    __m256i v[8];
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) { /* two blocks per 32 bytes of nibbles */
        if (2 * q >= cnt) { v[2 * q] = v[2 * q + 1] = _mm256_setzero_si256(); continue; }
        const __m256i n = _mm256_loadu_si256((const __m256i *)(nib + 32 * q));
        const __m256i h0 = _mm256_or_si256(_mm256_and_si256(n, low4), fifth_bits(b, 2 * q));
        const __m256i h1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n, 4), low4), fifth_bits(b, 2 * q + 1));
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 64 * q));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 64 * q + 32));
        v[2 * q] = _mm256_madd_epi16(_mm256_maddubs_epi16(h0, x0), ones);
        v[2 * q + 1] = _mm256_madd_epi16(_mm256_maddubs_epi16(h1, x1), ones);
    }
    const __m256i a = _mm256_hadd_epi32(v[0], v[1]), c = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i e = _mm256_hadd_epi32(v[4], v[5]), g = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i ac = _mm256_hadd_epi32(a, c), eg = _mm256_hadd_epi32(e, g);
    return _mm256_add_epi32(_mm256_permute2x128_si256(ac, eg, 0x20), _mm256_permute2x128_si256(ac, eg, 0x31));
}

/* Blocks 8g .. 8g+cnt-1 added to the two accumulators (d: their 8 scales, 0 past cnt) */
INLINE void group_step(const se_screen_act *a, int64_t g, const uint16_t *d, const uint8_t *nib, const uint8_t *bits,
                       const int cnt, __m256 *lo, __m256 *hi) {
    __m256i s8 = _mm256_slli_epi32(group_sums(nib, bits, a->xq + g * 256, cnt), 3);
    __m256i l = _mm256_add_epi32(s8, _mm256_loadu_si256((const __m256i *)(a->lo_c + g * 8)));
    __m256i h = _mm256_add_epi32(s8, _mm256_loadu_si256((const __m256i *)(a->hi_c + g * 8)));
    __m256 dd = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)d)), _mm256_loadu_ps(a->dx + g * 8));
    *lo = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), *lo);
    *hi = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(h), *hi);
}

static void bounds_avx2(const se_screen *s, const se_screen_act *a, int64_t r0, int64_t r1, float *lo, float *hi) {
    const int64_t nb = s->nb, full = nb / 8, rest = nb % 8;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = s->rows + (size_t)r * s->row_size;
        const uint16_t *d = (const uint16_t *)row;
        const uint8_t *nib = row + 2 * s->nbp, *bits = nib + 16 * nb;
        const uint8_t *ahead = row + SE_SCREEN_PREFETCH;
        for (size_t o = 0; o < s->row_size; o += 64) _mm_prefetch((const char *)ahead + o, _MM_HINT_T0);
        __m256 l = _mm256_setzero_ps(), h = _mm256_setzero_ps();
        for (int64_t g = 0; g < full; g++) group_step(a, g, d + 8 * g, nib + 128 * g, bits + 32 * g, 8, &l, &h);
        const uint16_t *dt = d + 8 * full;
        const uint8_t *nt = nib + 128 * full, *bt = bits + 32 * full;
        switch (rest) { /* the last group's block count as a constant (nb is even) */
        case 2: group_step(a, full, dt, nt, bt, 2, &l, &h); break;
        case 4: group_step(a, full, dt, nt, bt, 4, &l, &h); break;
        case 6: group_step(a, full, dt, nt, bt, 6, &l, &h); break;
        }
        lo[r] = hsum8(l);
        hi[r] = hsum8(h);
    }
}

const se_screen_bounds_fn se_screen_bounds_avx2 = bounds_avx2;
#else
const se_screen_bounds_fn se_screen_bounds_avx2 = 0;
#endif
