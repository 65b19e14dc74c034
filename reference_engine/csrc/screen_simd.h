/* What the screen's SIMD files (screen_avx2.c, screen_avx512.c) share: included after each file's
 * target pragma, so that every helper compiles for that file's instruction sets. */
#ifndef SE_SCREEN_SIMD_H
#define SE_SCREEN_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE int32_t ld32(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* Asks for every cache line that bytes [p, p + n) touch */
INLINE void prefetch_span(const void *p, size_t n) {
    const uintptr_t end = (uintptr_t)p + n;
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < end; a += 64) _mm_prefetch((const char *)a, _MM_HINT_T0);
}

/* Lane p: the sum of v[p]'s eight 32-bit lanes */
INLINE __m256i lane_sums(const __m256i v[8]) {
    const __m256i a = _mm256_hadd_epi32(v[0], v[1]), c = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i e = _mm256_hadd_epi32(v[4], v[5]), g = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i ac = _mm256_hadd_epi32(a, c), eg = _mm256_hadd_epi32(e, g);
    return _mm256_add_epi32(_mm256_permute2x128_si256(ac, eg, 0x20), _mm256_permute2x128_si256(ac, eg, 0x31));
}

#endif
