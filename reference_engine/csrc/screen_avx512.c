/* The screen's stage 1 (screen.h) with AVX-512 and VNNI: a tile's 16 rows in the 16 lanes. Only
 * this file is compiled for these ISAs (the pragma below); screen.c calls it on the AVX-512 and AMX
 * paths. Stage 2 reads scattered rows, eight blocks at a time, and keeps screen_avx2.c's kernel.
 *
 * Per block: vpdpbusd of the low nibbles (h of elements 8m .. 8m+3) and of the high ones kept in
 * place (16h of elements 8m+4 .. 8m+7) by four activations broadcast, so that (low << 4) + high is
 * 16 * sum h*x, exactly; then the two ends in integers and one fma each, as on the AVX2 path: the
 * same operations in the same order, so the same bits.
 */
#define SE_ENGINE_INTERNAL
#include "screen.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#include <immintrin.h>
#include <string.h>

static inline int32_t ld32(const void *p) { int32_t v; memcpy(&v, p, 4); return v; }

static void bounds_avx512(const se_screen *s, const se_screen_act *a, int64_t t0, int64_t t1, float *lo, float *hi) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8((char)0xF0);
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *tile = s->tiles + (size_t)t * s->tile_size;
        __m512 l = _mm512_setzero_ps(), h = _mm512_setzero_ps();
        for (int64_t b = 0; b < s->nb; b++) {
            const uint8_t *blk = tile + SE_SCREEN_TILE_BLOCK * b;
            for (int o = 0; o < SE_SCREEN_TILE_BLOCK; o += 64) _mm_prefetch((const char *)blk + SE_SCREEN_PREFETCH + o, _MM_HINT_T0);
            const int8_t *x = a->xq + 32 * b;
            __m512i lows = _mm512_setzero_si512(), highs = _mm512_setzero_si512();
            for (int m = 0; m < 4; m++) {
                const __m512i n = _mm512_loadu_si512(blk + 32 + 64 * m);
                lows = _mm512_dpbusd_epi32(lows, _mm512_and_si512(n, low4), _mm512_set1_epi32(ld32(x + 8 * m)));
                highs = _mm512_dpbusd_epi32(highs, _mm512_and_si512(n, high4), _mm512_set1_epi32(ld32(x + 8 * m + 4)));
            }
            const __m512i s16 = _mm512_add_epi32(_mm512_slli_epi32(lows, 4), highs);
            const __m512 dd = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk)), _mm512_set1_ps(a->dx[b]));
            l = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(_mm512_add_epi32(s16, _mm512_set1_epi32(a->lo_c[b]))), l);
            h = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(_mm512_add_epi32(s16, _mm512_set1_epi32(a->hi_c[b]))), h);
        }
        _mm512_storeu_ps(lo + t * SE_SCREEN_TILE, l);
        _mm512_storeu_ps(hi + t * SE_SCREEN_TILE, h);
    }
}

const se_screen_bounds_fn se_screen_bounds_avx512 = bounds_avx512;
#else
const se_screen_bounds_fn se_screen_bounds_avx512 = 0;
#endif
