/* The screen's bound kernels (screen.h) with AVX2, FMA and F16C. Only this file is compiled for
 * these ISAs (the pragma below); screen.c calls them when the CPU has them.
 *
 * Stage 1 holds a tile's rows in lanes, eight at a time: vpmaddubsw of the 4-bit plane's values
 * (unsigned, at most 15) by four activations broadcast, added in 16 bits (16 products of at most
 * 15 * 128 per lane: far below s16's limit), one vpmaddwd, then per block the two ends in integers
 * and one fma each. Stage 2 reads one row's fifth bits, eight blocks at a time, block p in lane p:
 * each block's integer sum, the eight sums gathered into one vector with horizontal adds, then the
 * two moves in integers and one fma each. Stage 3 the same with a row's low bits (three words a
 * block, spread to bytes).
 */
#define SE_ENGINE_INTERNAL
#include "screen.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c")
#include "screen_simd.h"

INLINE float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* sum u*x over 32 elements, in 8 lanes of 32 bits (u unsigned, small) */
INLINE __m256i dot32(__m256i u, const int8_t *x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)x)), _mm256_set1_epi16(1));
}

/* Stage 1 for the rows of tiles [t0, t1): per block, each half of the tile (8 rows) as above */
static void bounds_avx2(const se_screen *s, const se_screen_act *a, int64_t t0, int64_t t1, float *lo, float *hi) {
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *tile = se_screen_tile(s, t);
        __m256 l[2] = { _mm256_setzero_ps(), _mm256_setzero_ps() }, h[2] = { l[0], l[0] };
        for (int64_t b = 0; b < s->nb; b++) {
            const uint8_t *blk = tile + SE_SCREEN_TILE_BLOCK * b;
            for (int o = 0; o < SE_SCREEN_TILE_BLOCK; o += 64) _mm_prefetch((const char *)blk + SE_SCREEN_PREFETCH + o, _MM_HINT_T0);
            const int8_t *x = a->xq + 32 * b;
            __m256i xb[8]; /* elements 4p .. 4p+3 in every lane */
            for (int p = 0; p < 8; p++) xb[p] = _mm256_set1_epi32(ld32(x + 4 * p));
            const __m256 dx = _mm256_set1_ps(a->dx[b]);
            const __m256i lo_c = _mm256_set1_epi32(a->lo_c[b]), hi_c = _mm256_set1_epi32(a->hi_c[b]);
            for (int half = 0; half < 2; half++) {
                __m256i acc = _mm256_setzero_si256();
                for (int m = 0; m < 4; m++) {
                    const __m256i n = _mm256_loadu_si256((const __m256i *)(blk + 32 + 64 * m + 32 * half));
                    acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(_mm256_and_si256(n, low4), xb[2 * m]));
                    acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(n, 4), low4), xb[2 * m + 1]));
                }
                const __m256i s16 = _mm256_slli_epi32(_mm256_madd_epi16(acc, ones), 4);
                const __m256 dd = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * half))), dx);
                l[half] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(_mm256_add_epi32(s16, lo_c)), l[half]);
                h[half] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(_mm256_add_epi32(s16, hi_c)), h[half]);
            }
        }
        for (int half = 0; half < 2; half++) {
            _mm256_storeu_ps(lo + t * SE_SCREEN_TILE + 8 * half, l[half]);
            _mm256_storeu_ps(hi + t * SE_SCREEN_TILE + 8 * half, h[half]);
        }
    }
}

/* The products d*dx of blocks 8g .. 8g+cnt-1 (0 past cnt: the record stores only nb scales). Loads
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

/* A group's block sums (lane p: block p's) into the two moves: each one's integer, (sums << 3)
 * plus its per-block constant, times the blocks' scales d*dx, added to its accumulator */
INLINE void fold_moves(const se_screen_act *a, int64_t g, const uint16_t *d, const int cnt, const __m256i v[8],
                      const int shift, const int32_t *c_lo, const int32_t *c_hi, __m256 *lo, __m256 *hi) {
    const __m256i s = _mm256_slli_epi32(lane_sums(v), shift);
    const __m256i l = _mm256_add_epi32(s, _mm256_loadu_si256((const __m256i *)(c_lo + g * 8)));
    const __m256i h = _mm256_add_epi32(s, _mm256_loadu_si256((const __m256i *)(c_hi + g * 8)));
    const __m256 dd = scales(a, g, d, cnt);
    *lo = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(l), *lo);
    *hi = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(h), *hi);
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
    fold_moves(a, g, d, cnt, v, 3, a->neg8, a->pos8, up, down);
}

/* One row's stage 2, eight blocks at a time (bits: its record), the last group's block count as a
 * constant (nb is even) */
INLINE void refine_row(const se_screen_act *a, int64_t nb, const uint16_t *d, const uint8_t *bits, float *up,
                       float *down) {
    const int64_t full = nb / 8;
    __m256 u = _mm256_setzero_ps(), w = _mm256_setzero_ps();
    for (int64_t g = 0; g < full; g++) refine_step(a, g, d + 8 * g, bits + 32 * g, 8, &u, &w);
    d += 8 * full, bits += 32 * full;
    switch (nb % 8) {
    case 2: refine_step(a, full, d, bits, 2, &u, &w); break;
    case 4: refine_step(a, full, d, bits, 4, &u, &w); break;
    case 6: refine_step(a, full, d, bits, 6, &u, &w); break;
    }
    *up = hsum8(u);
    *down = hsum8(w);
}

#define REFINE_AHEAD 4 /* rows whose bits and scales stages 2 and 3 ask for before they read them */

static void refine_avx2(const se_screen *s, const se_screen_act *a, const int32_t *ids, int32_t n, float *up,
                        float *down) {
    for (int32_t i = 0; i < n; i++) {
        if (i + REFINE_AHEAD < n) prefetch_span(se_screen_record(s, ids[i + REFINE_AHEAD]), s->fifth_size);
        const uint8_t *bits = se_screen_record(s, ids[i]);
        refine_row(a, s->nb, (const uint16_t *)(bits + 4 * s->nbp), bits, &up[i], &down[i]);
    }
}

/* 32 bits -> 32 bytes, 0xFF where the bit is set (bit e: byte e) */
INLINE __m256i bit_bytes(uint32_t m) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(x, bit), bit);
}

/* A block's l (three words, bit e of word p: bit p of element e) as 32 bytes */
INLINE __m256i low_bytes(const uint32_t w[3]) {
    return _mm256_or_si256(_mm256_and_si256(bit_bytes(w[0]), _mm256_set1_epi8(1)),
                           _mm256_or_si256(_mm256_and_si256(bit_bytes(w[1]), _mm256_set1_epi8(2)),
                                           _mm256_and_si256(bit_bytes(w[2]), _mm256_set1_epi8(4))));
}

/* Stage 3, blocks 8g .. 8g+cnt-1 of a row (low: their l, three words a block), as stage 2 */
INLINE void settle_step(const se_screen_act *a, int64_t g, const uint16_t *d, const uint32_t *low, const int cnt,
                        __m256 *up, __m256 *down) {
    __m256i v[8];
#pragma GCC unroll 8
    for (int p = 0; p < 8; p++)
        v[p] = p < cnt ? dot32(low_bytes(low + 3 * p), a->xq + g * 256 + 32 * p) : _mm256_setzero_si256();
    fold_moves(a, g, d, cnt, v, 0, a->neg7, a->pos7, up, down);
}

/* Stage 3 for the rows ids[0..n): each row's record (its scales) and its l, eight blocks at a time */
static void settle_avx2(const se_screen *s, const se_screen_act *a, const int32_t *ids, int32_t n, float *up,
                        float *down) {
    const int64_t nb = s->nb, full = nb / 8;
    for (int32_t i = 0; i < n; i++) {
        if (i + REFINE_AHEAD < n) { /* the scales of its record and its l */
            prefetch_span(se_screen_record(s, ids[i + REFINE_AHEAD]) + 4 * s->nbp, 2 * (size_t)nb);
            prefetch_span(se_screen_low(s, ids[i + REFINE_AHEAD]), se_screen_low_size(s));
        }
        const uint16_t *d = (const uint16_t *)(se_screen_record(s, ids[i]) + 4 * s->nbp);
        const uint32_t *low = se_screen_low(s, ids[i]);
        __m256 u = _mm256_setzero_ps(), w = _mm256_setzero_ps();
        for (int64_t g = 0; g < full; g++) settle_step(a, g, d + 8 * g, low + 24 * g, 8, &u, &w);
        switch (nb % 8) {
        case 2: settle_step(a, full, d + 8 * full, low + 24 * full, 2, &u, &w); break;
        case 4: settle_step(a, full, d + 8 * full, low + 24 * full, 4, &u, &w); break;
        case 6: settle_step(a, full, d + 8 * full, low + 24 * full, 6, &u, &w); break;
        }
        up[i] = hsum8(u);
        down[i] = hsum8(w);
    }
}

/* Row r from the planes (screen.h): per block, its h from its lanes of the tile's four vectors
 * (low nibbles: elements 8m..8m+3, high: 8m+4..8m+7), f from its fifth bits, l from its three
 * words; then q = 16h + 8f + l - 128 (bytes: no shift carries across, h < 16 and f < 2) */
static void row_avx2(const se_screen *s, int64_t r, void *out) {
    const int i = (int)(r % SE_SCREEN_TILE);
    const uint8_t *tile = se_screen_tile(s, r / SE_SCREEN_TILE), *rec = se_screen_record(s, r);
    const uint8_t *scales = rec + 4 * s->nbp;
    const uint32_t *low = se_screen_low(s, r);
    const __m128i low4 = _mm_set1_epi8(15);
    const __m256i one = _mm256_set1_epi8(1);
    uint8_t *o = out;
    for (int64_t b = 0; b < s->nb; b++, o += 34) {
        const uint8_t *nib = tile + SE_SCREEN_TILE_BLOCK * b + 32 + 4 * i;
        const __m128i v = _mm_setr_epi32(ld32(nib), ld32(nib + 64), ld32(nib + 128), ld32(nib + 192));
        const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        const __m256i h = _mm256_set_m128i(_mm_unpackhi_epi32(lo, hi), _mm_unpacklo_epi32(lo, hi));
        const __m256i group = _mm256_loadu_si256((const __m256i *)(rec + 32 * (b / 8)));
        const __m256i f = _mm256_and_si256(_mm256_srl_epi16(group, _mm_cvtsi32_si128((int)(b % 8))), one);
        const __m256i l = low_bytes(low + 3 * b);
        const __m256i u = _mm256_or_si256(_mm256_or_si256(_mm256_slli_epi16(h, 4), _mm256_slli_epi16(f, 3)), l);
        memcpy(o, scales + 2 * b, 2);
        _mm256_storeu_si256((__m256i *)(o + 2), _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80)));
    }
}

/* se_screen_pack_scalar with AVX2: u = q + 128 as bytes; h paired as the tile holds it (byte j of
 * a group of 8: h of element j in the low nibble, of j + 4 in the high one), f and each bit of l
 * gathered with movemask-like steps */
static void pack_avx2(const se_screen *s, const int8_t *q, int64_t r, int64_t b) {
    const int i = (int)(r % SE_SCREEN_TILE);
    uint8_t *blk = se_screen_tile(s, r / SE_SCREEN_TILE) + SE_SCREEN_TILE_BLOCK * b;
    uint8_t *group = se_screen_record(s, r) + 32 * (b / 8);
    const __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)q), _mm256_set1_epi8((char)0x80));
    const __m256i h = _mm256_and_si256(_mm256_srli_epi16(u, 4), _mm256_set1_epi8(15));
    const __m256i pair = _mm256_or_si256(h, _mm256_srli_si256(_mm256_slli_epi16(h, 4), 4)); /* h < 16: no carry */
    uint32_t w[8];
    _mm256_storeu_si256((__m256i *)w, pair);
    for (int m = 0; m < 4; m++) memcpy(blk + 32 + 64 * m + 4 * i, &w[2 * m], 4); /* the tile's bytes of row i: only this block's */
    const __m256i eight = _mm256_set1_epi8(8);
    const __m256i f = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(u, eight), eight), _mm256_set1_epi8((char)(1 << (b % 8))));
    _mm256_storeu_si256((__m256i *)group, _mm256_or_si256(_mm256_loadu_si256((const __m256i *)group), f));
    if (!s->low) return;
    uint32_t l[3]; /* bit p of each byte to bit 7, then one bit a byte */
    for (int p = 0; p < 3; p++) l[p] = (uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(u, 7 - p));
    memcpy(se_screen_low(s, r) + 3 * b, l, sizeof l);
}

const se_screen_bounds_fn se_screen_bounds_avx2 = bounds_avx2;
const se_screen_pack_fn se_screen_pack_avx2 = pack_avx2;
const se_screen_refine_fn se_screen_refine_avx2 = refine_avx2;
const se_screen_refine_fn se_screen_settle_avx2 = settle_avx2;
const se_screen_row_fn se_screen_row_avx2 = row_avx2;
#else
const se_screen_bounds_fn se_screen_bounds_avx2 = 0;
const se_screen_pack_fn se_screen_pack_avx2 = 0;
const se_screen_refine_fn se_screen_refine_avx2 = 0;
const se_screen_refine_fn se_screen_settle_avx2 = 0;
const se_screen_row_fn se_screen_row_avx2 = 0;
#endif
