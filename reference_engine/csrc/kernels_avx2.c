/* AVX2 (+FMA, F16C) dot products, for x86 CPUs without AVX-512. Only this file is compiled for
 * these ISAs (by the pragma below); kernels.c chooses it at run time.
 *
 * Integer products use vpmaddubsw (u8 x s8 -> pairs summed to s16) then vpmaddwd to s32. Every
 * pair sum here stays below 2*128*127 = 32512, so the s16 saturation never triggers. Signed
 * weights (q4_0, q5_0, q8_0) go in as |w| with w's sign moved onto the activation.
 * Kernels are tiles of weight rows x activation rows (see se_tile_fn in kernels.h).
 */
#define SE_KERNELS_INTERNAL
#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float h2f(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }
INLINE uint32_t ld32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

INLINE float hsum8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* sum of u8 x s8 products over 32 bytes, as 8 s32 lanes (lane k covers bytes 4k..4k+3) */
INLINE __m256i dot_us8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

/* 16 packed bytes -> 32 nibbles in element order (low nibbles first) */
INLINE __m256i nibbles(const uint8_t *p) {
    __m128i x = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(x), _mm_srli_epi16(x, 4), 1),
                            _mm256_set1_epi8(15));
}

/* 32 bits -> 32 bytes, 0x10 where the bit is set (q5's fifth bit) */
INLINE __m256i fifth_bits(uint32_t h) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), spread);
    x = _mm256_cmpeq_epi8(_mm256_and_si256(x, bit), bit);
    return _mm256_and_si256(x, _mm256_set1_epi8(16));
}

/* ---------------------------------------------------------------- legacy 32-blocks
 * The summation order of every legacy-type kernel of this path (the tiles, the dots and the
 * batch kernel below), so that a token's outputs do not depend on the batch around it: a row's
 * blocks go in groups of 8, block 8g + p in lane p. Each block's sum of products is an exact
 * int32; then, group after group and lane by lane,
 *     acc = fma(float(isum), dw * da, acc)     (dw, da: the blocks' fp16 scales as floats)
 *     acc = fma(mw, sa, acc)                   (the _1 types: the min times the activations' s)
 * with zero sums and scales in the lanes past the row's end; the output is hsum8(acc). Integer
 * sums are exact in any order, so each kernel gets them its own way. */

/* The 32 quants of a legacy block b as stored: Q8_0's int8, the others' 4 or 5 unsigned bits. */
INLINE __m256i stored_quants(int type, const uint8_t *b) {
    const se_type_traits *t = &se_types[type];
    if (type == SE_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + t->qs_offset));
    const __m256i q = nibbles(b + t->qs_offset);
    return t->qh_offset ? _mm256_or_si256(q, fifth_bits(ld32(b + t->qh_offset))) : q;
}

/* The 32 quants of a legacy block b as signed bytes (se_types gives the layout). */
INLINE __m256i unpack1(int type, const uint8_t *b) {
    const __m256i q = stored_quants(type, b);
    const int offset = type == SE_Q8_0 ? 0 : se_types[type].q_offset; /* Q8_0's is the AVX-512 flip's */
    return offset ? _mm256_sub_epi8(q, _mm256_set1_epi8((char)offset)) : q;
}

/* [x0 x1 x4 x5 | x2 x3 x6 x7] -> x0..x7 */
INLINE __m256 deinterleave(__m256 v) { return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(v), 0xD8)); }

/* The first two fp16 fields of blocks b, b + size, ... (cnt of them, cnt <= 8) as floats in
 * lanes: d, and m (the _1 types' min; Q8_1's s; for the other types two quants, never used).
 * Zero in lanes cnt..7. */
INLINE void scales8(const uint8_t *b, int size, int cnt, __m256 *d, __m256 *m) {
    int32_t h[8];
    for (int p = 0; p < 8; p++) h[p] = p < cnt ? (int32_t)ld32(b + p * size) : 0;
    const __m256 x = _mm256_cvtph_ps(_mm_setr_epi32(h[0], h[1], h[2], h[3])); /* d0 m0 d1 m1 | d2 m2 d3 m3 */
    const __m256 y = _mm256_cvtph_ps(_mm_setr_epi32(h[4], h[5], h[6], h[7]));
    *d = deinterleave(_mm256_shuffle_ps(x, y, 0x88));
    *m = deinterleave(_mm256_shuffle_ps(x, y, 0xDD));
}

/* The float steps of one group (the order above). */
INLINE __m256 group_step(int type, __m256i isum, __m256 wd, __m256 wm, __m256 ad, __m256 as, __m256 acc) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(wd, ad), acc);
    return se_types[type].has_min ? _mm256_fmadd_ps(wm, as, acc) : acc;
}

/* 1 when 16 products of the type's quants (as the tiles take them: the _1 types unsigned, the
 * others signed with the sign moved onto the activations) fit in 16 bits: |q| <= 16, and the
 * activation quantizers give |a| <= 127, so 16 * 16 * 127 = 32512 at most. */
INLINE int sums16_fit(int type) { return type == SE_Q4_0 || type == SE_Q4_1 || type == SE_Q5_0; }

/* Legacy block b's 32 quants times activation block a's, as vpmaddubsw's 16 sums of 2 products. */
INLINE __m256i block_pairs(int type, const uint8_t *b, const uint8_t *a) {
    const se_type_traits *t = &se_types[type];
    const __m256i q = unpack1(type, b);
    const __m256i av = _mm256_loadu_si256((const __m256i *)(a + se_types[t->act_type].qs_offset));
    return t->has_min ? _mm256_maddubs_epi16(q, av) : _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(av, q));
}

/* The products of 8 blocks (v[p]: block p's pairs) summed into lane p, exactly. Where 16 products
 * fit in 16 bits, three rounds of 16-bit horizontal adds leave each half-block's sum in one word
 * (the lower 128 bits: the blocks' first 16 quants, the upper: the rest); else 32-bit ones. */
INLINE __m256i block_sums(int type, const __m256i v[8]) {
    if (sums16_fit(type)) {
        const __m256i a = _mm256_hadd_epi16(v[0], v[1]), b = _mm256_hadd_epi16(v[2], v[3]);
        const __m256i c = _mm256_hadd_epi16(v[4], v[5]), d = _mm256_hadd_epi16(v[6], v[7]);
        const __m256i r = _mm256_hadd_epi16(_mm256_hadd_epi16(a, b), _mm256_hadd_epi16(c, d));
        return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(r)),
                                _mm256_cvtepi16_epi32(_mm256_extracti128_si256(r, 1)));
    }
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i w[8];
    for (int p = 0; p < 8; p++) w[p] = _mm256_madd_epi16(v[p], ones);
    const __m256i a = _mm256_hadd_epi32(w[0], w[1]), b = _mm256_hadd_epi32(w[2], w[3]);
    const __m256i c = _mm256_hadd_epi32(w[4], w[5]), d = _mm256_hadd_epi32(w[6], w[7]);
    const __m256i ab = _mm256_hadd_epi32(a, b); /* blocks 0..3: their lower halves' sums | upper halves' */
    const __m256i cd = _mm256_hadd_epi32(c, d);
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

/* One group of cnt blocks (w, a: its first blocks) of nr rows x nc tokens, added to acc[r * nc + c]. */
INLINE void legacy_group(int type, const int cnt, const uint8_t *w, size_t wr, int nr, const uint8_t *a, size_t as,
                         int nc, __m256 *acc) {
    const int ws = se_types[type].size, asz = se_types[se_types[type].act_type].size;
    __m256 ad[4], asv[4], wd[4], wm[4];
    for (int c = 0; c < nc; c++) scales8(a + c * as, asz, cnt, &ad[c], &asv[c]);
    for (int r = 0; r < nr; r++) scales8(w + r * wr, ws, cnt, &wd[r], &wm[r]);
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
        for (int c = 0; c < nc; c++) {
            __m256i v[8];
#pragma GCC unroll 8
            for (int p = 0; p < 8; p++)
                v[p] = p < cnt ? block_pairs(type, w + r * wr + p * ws, a + c * as + p * asz) : _mm256_setzero_si256();
            acc[r * nc + c] = group_step(type, block_sums(type, v), wd[r], wm[r], ad[c], asv[c], acc[r * nc + c]);
        }
}

/* nr weight rows x nc activation rows -> out[r * nc + c], nr * nc <= 4. */
INLINE void legacy_tile(int type, int64_t n, const uint8_t *w, size_t wr, int nr, const uint8_t *a, size_t as,
                        int nc, float *out) {
    const int ws = se_types[type].size, asz = se_types[se_types[type].act_type].size;
    const int64_t nb = n / SE_QK;
    __m256 acc[4];
    for (int k = 0; k < nr * nc; k++) acc[k] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= nb; i += 8) legacy_group(type, 8, w + i * ws, wr, nr, a + i * asz, as, nc, acc);
    w += i * ws, a += i * asz;
    switch (nb - i) { /* the last group's block count as a constant: its loops unroll */
    case 1: legacy_group(type, 1, w, wr, nr, a, as, nc, acc); break;
    case 2: legacy_group(type, 2, w, wr, nr, a, as, nc, acc); break;
    case 3: legacy_group(type, 3, w, wr, nr, a, as, nc, acc); break;
    case 4: legacy_group(type, 4, w, wr, nr, a, as, nc, acc); break;
    case 5: legacy_group(type, 5, w, wr, nr, a, as, nc, acc); break;
    case 6: legacy_group(type, 6, w, wr, nr, a, as, nc, acc); break;
    case 7: legacy_group(type, 7, w, wr, nr, a, as, nc, acc); break;
    }
    for (int k = 0; k < nr * nc; k++) out[k] = hsum8(acc[k]);
}

/* ---------------------------------------------------------------- legacy batches (blocks in lanes)
 * Two tokens or more (the steps of batched decoding, prompts). The tiles reduce every (block,
 * token) product vector to one sum with horizontal adds. Here the activations are put into lanes
 * once per matmul, and each weight row once per pass over the tokens, so that lane p of vector j
 * holds quants 4j..4j+3 of block 8g + p (an 8 x 8 transpose of dwords): a block's products then
 * add up in its own lane with plain vertical adds, in 16 bits while they fit (4-bit quants: 8
 * products; 5-bit: 4), and the float steps are the tiles' on the same values: a token's outputs
 * are its one-token outputs bit for bit. Weights go in as stored (unsigned, the offset taken back
 * through the activations' sums), Q8_0's as |q| with q's sign moved onto the activations. */
#define BATCH_ROWS 8   /* rows put into lanes at a time: they stay in L1 while the tokens pass */
#define BATCH_TOKENS 4 /* tokens per pass over a row: their accumulators stay in registers */

typedef struct { __m256i q[8]; __m256 d, s; __m256i bias; } batch_act; /* one token's group */
typedef struct { __m256i q[8]; __m256 d, m; } batch_row;                 /* one row's group */

/* Per 128 bits, the 4 x 4 dwords of v[0..3] transposed: dword p of v[j] <- dword j of v[p]. */
INLINE void transpose4x4(__m256i v[4]) {
    const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm256_unpacklo_epi64(t0, t2), v[1] = _mm256_unpackhi_epi64(t0, t2);
    v[2] = _mm256_unpacklo_epi64(t1, t3), v[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* v[j] lane p <- v[p] lane j (8 x 8 dwords): rows 0-3 and 4-7 per 128 bits, then their halves
 * swapped. */
INLINE void transpose8(__m256i v[8]) {
    transpose4x4(v); /* v[j]: dword j of rows 0-3 | dword j + 4 of rows 0-3 */
    transpose4x4(v + 4);
    for (int j = 0; j < 4; j++) {
        const __m256i lo = v[j], hi = v[4 + j];
        v[j] = _mm256_permute2x128_si256(lo, hi, 0x20);
        v[4 + j] = _mm256_permute2x128_si256(lo, hi, 0x31);
    }
}

/* 16 bytes of each of cnt blocks (b, b + stride, ...; zero past cnt, cnt <= 8) into lanes: v[j]
 * lane p holds bytes 4j..4j+3 of block p's 16 (blocks m and m + 4 share a vector, then one 4 x 4
 * transpose per 128 bits: fewer shuffles than transpose8). */
INLINE void halves_into_lanes(const uint8_t *b, int stride, int cnt, __m256i v[4]) {
    for (int m = 0; m < 4; m++) {
        const __m128i lo = m < cnt ? _mm_loadu_si128((const __m128i *)(b + m * stride)) : _mm_setzero_si128();
        const __m128i hi = m + 4 < cnt ? _mm_loadu_si128((const __m128i *)(b + (m + 4) * stride)) : _mm_setzero_si128();
        v[m] = _mm256_set_m128i(hi, lo);
    }
    transpose4x4(v);
}

/* The same for 32 bytes of each block: v[j] lane p holds bytes 4j..4j+3 of block p. */
INLINE void blocks_into_lanes(const uint8_t *b, int stride, int cnt, __m256i v[8]) {
    halves_into_lanes(b, stride, cnt, v);
    halves_into_lanes(b + 16, stride, cnt, v + 4);
}

INLINE int group_count(int64_t nb, int64_t g) { return nb - 8 * g < 8 ? (int)(nb - 8 * g) : 8; }

/* The vectors a group of cnt blocks needs once packed (pack_lanes): a row's last group is often
 * short (SmolLM2's 576 columns: groups of 8, 8 and 2 blocks), and its empty lanes would cost as
 * much as full ones. */
INLINE int group_vectors(int cnt) { return cnt > 4 ? 8 : cnt > 2 ? 4 : 2; }

/* Pack a group's vectors into group_vectors(cnt) = nv of them. With nv = 4, v[i] takes lanes
 * 0-3 of v[i] and of v[i + 4]; with nv = 2, lanes 0-1 of v[i], v[i + 2], v[i + 4], v[i + 6]: a
 * block's quants are then spread over lanes p, p + nv/2, ... (fold_lanes adds them up). */
INLINE void pack_lanes(const int nv, __m256i v[8]) {
    if (nv == 8) return;
    for (int i = 0; i < 4; i++) v[i] = _mm256_permute2x128_si256(v[i], v[i + 4], 0x20);
    if (nv == 2)
        for (int i = 0; i < 2; i++) v[i] = _mm256_unpacklo_epi64(v[i], v[i + 2]);
}

/* Sums of packed lanes back into lane p (block p), zero in the others. */
INLINE __m256i fold_lanes(const int nv, __m256i s) {
    if (nv == 8) return s;
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    if (nv == 2) h = _mm_move_epi64(_mm_add_epi32(h, _mm_unpackhi_epi64(h, h)));
    return _mm256_zextsi128_si256(h);
}

/* Group g of one token's activations (nb blocks) into lanes, with its scales and, for a type
 * stored with an offset, bias = -offset * sum(quants) per block. */
INLINE void batch_act_group(int type, int64_t nb, const uint8_t *a, int64_t g, batch_act *o) {
    const se_type_traits *t = &se_types[type], *at = &se_types[t->act_type];
    const int cnt = group_count(nb, g);
    const uint8_t *y = a + 8 * g * at->size;
    blocks_into_lanes(y + at->qs_offset, at->size, cnt, o->q);
    scales8(y, at->size, cnt, &o->d, &o->s);
    __m256i sum = _mm256_setzero_si256();
    if (t->q_offset && type != SE_Q8_0)
        for (int j = 0; j < 8; j++) sum = _mm256_add_epi32(sum, dot_us8(_mm256_set1_epi8((char)t->q_offset), o->q[j]));
    o->bias = _mm256_sub_epi32(_mm256_setzero_si256(), sum);
    pack_lanes(group_vectors(cnt), o->q);
}

/* Group g of one weight row (nb blocks) into lanes, with its scales. */
INLINE void batch_row_group(int type, int64_t nb, const uint8_t *x, int64_t g, batch_row *o) {
    const se_type_traits *t = &se_types[type];
    const int cnt = group_count(nb, g);
    const uint8_t *b = x + 8 * g * t->size;
    if (type == SE_Q8_0) {
        blocks_into_lanes(b + t->qs_offset, t->size, cnt, o->q);
    } else if (!t->qh_offset) { /* 4 bits: the packed bytes into lanes, then the nibbles split */
        __m256i z[4];
        halves_into_lanes(b + t->qs_offset, t->size, cnt, z); /* z[j] lane p: quants 4j.. and 16 + 4j.. of block p */
        for (int j = 0; j < 4; j++) {
            o->q[j] = _mm256_and_si256(z[j], _mm256_set1_epi8(15));
            o->q[4 + j] = _mm256_and_si256(_mm256_srli_epi16(z[j], 4), _mm256_set1_epi8(15));
        }
    } else { /* 5 bits: each block's quants in order, then into lanes */
        for (int p = 0; p < 8; p++) o->q[p] = p < cnt ? stored_quants(type, b + p * t->size) : _mm256_setzero_si256();
        transpose8(o->q);
    }
    scales8(b, t->size, cnt, &o->d, &o->m);
    pack_lanes(group_vectors(cnt), o->q);
}

/* The exact integer sums of one group of nr rows (w[r]) x nt tokens (a[c]), in lanes, into
 * isum[r][c]. Quant vector j of each row is loaded once for all the tokens and each token's once
 * for both rows (2 rows x 4 tokens: 6 loads per 8 vpmaddubsw). Pairs of products are summed in
 * 16 bits over `span` vectors, then widened: at most 2 * 15 * 128 per pair for 4-bit quants (8
 * vectors fit), 2 * 31 * 128 for 5-bit (4 fit); Q8_0's pairs reach 2 * 128 * 127 (1 fits). */
INLINE void batch_isums(int type, const int nv, const int nr, const int nt, const batch_row *const w[2],
                        const batch_act *const a[BATCH_TOKENS], __m256i isum[2][BATCH_TOKENS]) {
    const se_type_traits *t = &se_types[type];
    const int span = type == SE_Q8_0 ? 1 : t->qh_offset ? 4 : 8;
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nt; c++) isum[r][c] = _mm256_setzero_si256();
    for (int j0 = 0; j0 < nv; j0 += span) {
        __m256i p[2][BATCH_TOKENS];
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < nt; c++) p[r][c] = _mm256_setzero_si256();
        for (int j = j0; j < j0 + span && j < nv; j++) {
            __m256i q[2], qs[2]; /* the unsigned operand; Q8_0's signed quants (their sign goes onto x) */
            for (int r = 0; r < nr; r++) {
                qs[r] = w[r]->q[j];
                q[r] = type == SE_Q8_0 ? _mm256_sign_epi8(qs[r], qs[r]) : qs[r];
            }
            for (int c = 0; c < nt; c++) {
                __m256i x = a[c]->q[j];
                __asm__("" : "+x"(x)); /* one load for both rows: keeps the compiler from folding it into each */
                for (int r = 0; r < nr; r++) {
                    const __m256i y = type == SE_Q8_0 ? _mm256_sign_epi8(x, qs[r]) : x;
                    p[r][c] = _mm256_add_epi16(p[r][c], _mm256_maddubs_epi16(q[r], y));
                    __asm__("" : "+x"(p[r][c]));
                }
            }
        }
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < nt; c++) isum[r][c] = _mm256_add_epi32(isum[r][c], _mm256_madd_epi16(p[r][c], _mm256_set1_epi16(1)));
    }
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nt; c++) {
            isum[r][c] = fold_lanes(nv, isum[r][c]);
            if (t->q_offset && type != SE_Q8_0) isum[r][c] = _mm256_add_epi32(isum[r][c], a[c]->bias);
        }
}

/* hsum8 of acc[0..nt) into out[0..nt), with hsum8's operations. */
INLINE void hsum8_tokens(const __m256 *acc, const int nt, float *out) {
    if (nt < 4) {
        for (int c = 0; c < nt; c++) out[c] = hsum8(acc[c]);
        return;
    }
    __m128 m[4];
    for (int c = 0; c < 4; c++) m[c] = _mm_add_ps(_mm256_castps256_ps128(acc[c]), _mm256_extractf128_ps(acc[c], 1));
    _MM_TRANSPOSE4_PS(m[0], m[1], m[2], m[3]); /* m[i]: element i of each */
    _mm_storeu_ps(out, _mm_add_ps(_mm_add_ps(m[0], m[2]), _mm_add_ps(m[1], m[3])));
}

/* nr rows' groups (row r's at w + r * ng) x nt tokens (token c's at a + c * ng) -> out[r][c]. */
INLINE void batch_rows_tokens(int type, const int nr, const int nt, const batch_row *w, int64_t ng, int last_nv,
                              const batch_act *a, float out[2][BATCH_TOKENS]) {
    __m256 acc[2][BATCH_TOKENS];
    for (int r = 0; r < nr; r++)
        for (int c = 0; c < nt; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const batch_row *wg[2] = {w + g, w + ng + g};
        const batch_act *ag[BATCH_TOKENS];
        for (int c = 0; c < nt; c++) ag[c] = a + c * ng + g;
        __m256i isum[2][BATCH_TOKENS];
        switch (g < ng - 1 ? 8 : last_nv) { /* the vector count as a constant */
        case 2: batch_isums(type, 2, nr, nt, wg, ag, isum); break;
        case 4: batch_isums(type, 4, nr, nt, wg, ag, isum); break;
        default: batch_isums(type, 8, nr, nt, wg, ag, isum); break;
        }
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < nt; c++)
                acc[r][c] = group_step(type, isum[r][c], wg[r]->d, wg[r]->m, ag[c]->d, ag[c]->s, acc[r][c]);
    }
    for (int r = 0; r < nr; r++) hsum8_tokens(acc[r], nt, out[r]);
}

/* se_matmul for two tokens or more (se_gemm_fn's contract). */
INLINE int legacy_batch(int type, int64_t k, const void *W, size_t wrow, const void *act, size_t arow, int n_tok,
                        float *y, int64_t ldy, int64_t r0, int64_t r1) {
    const int64_t nb = k / SE_QK, ng = (nb + 7) / 8;
    const int last_nv = group_vectors(group_count(nb, ng - 1));
    const size_t side_bytes = (size_t)n_tok * (size_t)ng * sizeof(batch_act);
    uint8_t *scratch = se_thread_scratch(side_bytes + BATCH_ROWS * (size_t)ng * sizeof(batch_row));
    if (!scratch) return -1;
    batch_act *side = (batch_act *)scratch;
    batch_row *rows = (batch_row *)(scratch + side_bytes);
    for (int c = 0; c < n_tok; c++)
        for (int64_t g = 0; g < ng; g++) batch_act_group(type, nb, (const uint8_t *)act + (size_t)c * arow, g, side + c * ng + g);
    const int64_t ahead = (int64_t)(SE_PREFETCH_BYTES / wrow) + 1;
    for (int64_t rb = r0; rb < r1; rb += BATCH_ROWS) {
        const int nr = r1 - rb < BATCH_ROWS ? (int)(r1 - rb) : BATCH_ROWS;
        for (int i = 0; i < nr; i++) {
            const uint8_t *x = (const uint8_t *)W + (size_t)(rb + i) * wrow;
            if (rb + i + ahead < r1)
                for (size_t o = 0; o < wrow; o += 64) __builtin_prefetch(x + (size_t)ahead * wrow + o);
            for (int64_t g = 0; g < ng; g++) batch_row_group(type, nb, x, g, rows + i * ng + g);
        }
        for (int c0 = 0; c0 < n_tok; c0 += BATCH_TOKENS) {
            const int nt = n_tok - c0 < BATCH_TOKENS ? n_tok - c0 : BATCH_TOKENS;
            for (int i = 0; i < nr; i += 2) {
                float out[2][BATCH_TOKENS];
                const batch_row *w = rows + i * ng;
                const batch_act *s = side + (size_t)c0 * ng;
                const int n2 = nr - i < 2 ? 1 : 2;
                switch (4 * (n2 - 1) + nt) { /* constant counts for each: the loops unroll */
                case 1: batch_rows_tokens(type, 1, 1, w, ng, last_nv, s, out); break;
                case 2: batch_rows_tokens(type, 1, 2, w, ng, last_nv, s, out); break;
                case 3: batch_rows_tokens(type, 1, 3, w, ng, last_nv, s, out); break;
                case 4: batch_rows_tokens(type, 1, 4, w, ng, last_nv, s, out); break;
                case 5: batch_rows_tokens(type, 2, 1, w, ng, last_nv, s, out); break;
                case 6: batch_rows_tokens(type, 2, 2, w, ng, last_nv, s, out); break;
                case 7: batch_rows_tokens(type, 2, 3, w, ng, last_nv, s, out); break;
                default: batch_rows_tokens(type, 2, 4, w, ng, last_nv, s, out); break;
                }
                for (int r = 0; r < n2; r++)
                    for (int c = 0; c < nt; c++) y[(c0 + c) * ldy + rb + i + r] = out[r][c];
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- K-quants */

/* ggml's get_scale_min_k4 four at a time on 32-bit words: 8 scales and 8 mins as bytes. */
INLINE void scales_mins_k4(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t a = ld32(s), b = ld32(s + 4), c = ld32(s + 8);
    uint32_t sc_lo = a & 0x3f3f3f3f, mn_lo = b & 0x3f3f3f3f;
    uint32_t sc_hi = (c & 0x0f0f0f0f) | ((a >> 6) & 0x03030303) << 4;
    uint32_t mn_hi = ((c >> 4) & 0x0f0f0f0f) | ((b >> 6) & 0x03030303) << 4;
    *sc = sc_lo | (uint64_t)sc_hi << 32;
    *mn = mn_lo | (uint64_t)mn_hi << 32;
}

/* Q4_K and Q5_K: 8 sub-blocks of 32 quants, each one ymm; the scale multiplies the s16 pair
 * sums in vpmaddwd. Mins come from the activations' bsums. The two types share the layout up to
 * the scales (se_blk_q4_K); Q5_K's fifth bits sit between them and the quants. */
INLINE void q45_K_dotx(int type, int64_t n, const uint8_t *w, const uint8_t *a, size_t as, int nc,
                       float *out) {
    const se_type_traits *t = &se_types[type];
    const int q5 = t->qh_offset != 0, ws = t->size, qs_off = t->qs_offset;
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 acc[4], accm[4];
    for (int c = 0; c < nc; c++) { acc[c] = _mm256_setzero_ps(); accm[c] = _mm256_setzero_ps(); }

    for (int64_t i = 0; i < n / 256; i++) {
        const uint8_t *x = w + i * ws;
        uint64_t sc8, mn8;
        scales_mins_k4(x + offsetof(se_blk_q4_K, scales), &sc8, &mn8);
        const __m256i mn = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn8));
        const float d = h2f(x + offsetof(se_blk_q4_K, d)), dmin = h2f(x + offsetof(se_blk_q4_K, dmin));
        __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(x + t->qh_offset)) : _mm256_setzero_si256();
        __m256i q[8], sv[8];
        for (int j = 0; j < 4; j++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(x + qs_off + 32 * j));
            q[2 * j] = _mm256_and_si256(raw, m4);
            q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            if (q5) { /* bit 2j of qh[l] is the fifth bit of quant 64j+l; bit 2j+1 of 64j+32+l */
                const __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * j))), b1 = _mm256_set1_epi8((char)(2 << (2 * j)));
                q[2 * j] = _mm256_or_si256(q[2 * j], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0),
                                                                      _mm256_set1_epi8(16)));
                q[2 * j + 1] = _mm256_or_si256(q[2 * j + 1], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1),
                                                                              _mm256_set1_epi8(16)));
            }
        }
        for (int j = 0; j < 8; j++) sv[j] = _mm256_set1_epi16((short)((sc8 >> (8 * j)) & 0xff));
        for (int c = 0; c < nc; c++) {
            const se_blk_q8_K *y = (const se_blk_q8_K *)(a + c * as) + i;
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                __m256i p = _mm256_maddubs_epi16(q[j], _mm256_loadu_si256((const __m256i *)(y->qs + 32 * j)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sv[j]));
            }
            __m256i bs = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y->bsums), _mm256_set1_epi16(1));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d * y->d), acc[c]);
            accm[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(bs, mn)), _mm256_set1_ps(dmin * y->d),
                                      accm[c]);
        }
    }
    for (int c = 0; c < nc; c++) out[c] = hsum8(acc[c]) - hsum8(accm[c]);
}

/* The K-quants with 16 scales of 16 quants (Q2_K, Q3_K, Q6_K), one super-block: its quants as
 * unsigned bytes in element order (a ymm of 32 covers two scales: s16 lanes 0-7 take the first,
 * 8-15 the second), its 16 scales, and what is taken back through the activations' bsums: the
 * offset of the types stored as q + offset (Q3_K 4, Q6_K 32: offset * d * sum(sc * bsum)) or
 * Q2_K's mins (dmin * sum(m * bsum)). */
typedef struct {
    __m256i q[8];
    int8_t sc[16], cw[16]; /* the scales; the bsums' weights (the scales again, or the mins) */
    float d, dc;           /* the factor of the scaled sums; of the bsum term */
} k16_block;

INLINE void unpack_k16(int type, const uint8_t *x, k16_block *b) {
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    if (type == SE_Q6_K) {
        const se_blk_q6_K *y = (const se_blk_q6_K *)x;
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(y->ql + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(y->ql + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(y->qh + 32 * h));
            b->q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
            b->q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
            b->q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
            b->q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
        }
        memcpy(b->sc, y->scales, 16);
        memcpy(b->cw, y->scales, 16);
        b->d = h2f((const uint8_t *)&y->d);
        b->dc = se_types[SE_Q6_K].q_offset * b->d;
        return;
    }
    /* Q2_K and Q3_K: element 128h + 32j + l takes bits 2j, 2j+1 of qs[32h + l] (kernels.h) */
    const uint8_t *qs = x + se_types[type].qs_offset;
    for (int h = 0; h < 2; h++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
        for (int j = 0; j < 4; j++) b->q[4 * h + j] = _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(2 * j)), m3);
    }
    if (type == SE_Q2_K) {
        const se_blk_q2_K *y = (const se_blk_q2_K *)x;
        for (int j = 0; j < 16; j++) b->sc[j] = (int8_t)(y->scales[j] & 15), b->cw[j] = (int8_t)(y->scales[j] >> 4);
        b->d = h2f((const uint8_t *)&y->d);
        b->dc = h2f((const uint8_t *)&y->dmin);
        return;
    }
    const se_blk_q3_K *y = (const se_blk_q3_K *)x; /* the high bit of element 32k + l: bit k of hmask[l] */
    const __m256i hm = _mm256_loadu_si256((const __m256i *)y->hmask);
    for (int k = 0; k < 8; k++) {
        const __m256i bit = _mm256_set1_epi8((char)(1 << k));
        b->q[k] = _mm256_or_si256(b->q[k], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit),
                                                            _mm256_set1_epi8(4)));
    }
    uint32_t w[4];
    se_q3_K_scale_words(y->scales, w);
    const __m128i sc = _mm_sub_epi8(_mm_setr_epi32((int)w[0], (int)w[1], (int)w[2], (int)w[3]), _mm_set1_epi8(32));
    _mm_storeu_si128((__m128i *)b->sc, sc);
    _mm_storeu_si128((__m128i *)b->cw, sc);
    b->d = h2f((const uint8_t *)&y->d);
    b->dc = se_types[SE_Q3_K].q_offset * b->d;
}

INLINE void k16_dotx(int type, int64_t n, const uint8_t *w, const uint8_t *a, size_t as, int nc, float *out) {
    const int ws = se_types[type].size;
    __m256 acc[4], acco[4];
    for (int c = 0; c < nc; c++) { acc[c] = _mm256_setzero_ps(); acco[c] = _mm256_setzero_ps(); }

    for (int64_t i = 0; i < n / 256; i++) {
        k16_block b;
        unpack_k16(type, w + i * ws, &b);
        const __m256i cw16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b.cw));
        __m256i sv[8];
        for (int j = 0; j < 8; j++) sv[j] = _mm256_set_m128i(_mm_set1_epi16(b.sc[2 * j + 1]), _mm_set1_epi16(b.sc[2 * j]));
        for (int c = 0; c < nc; c++) {
            const se_blk_q8_K *y = (const se_blk_q8_K *)(a + c * as) + i;
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                __m256i p = _mm256_maddubs_epi16(b.q[j], _mm256_loadu_si256((const __m256i *)(y->qs + 32 * j)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sv[j]));
            }
            __m256i corr = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y->bsums), cw16);
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(b.d * y->d), acc[c]);
            acco[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(corr), _mm256_set1_ps(b.dc * y->d), acco[c]);
        }
    }
    for (int c = 0; c < nc; c++) out[c] = hsum8(acc[c]) - hsum8(acco[c]);
}

/* ---------------------------------------------------------------- float weights x f32 */

INLINE __m256 load_w8(int type, const uint8_t *p) {
    switch (type) {
    case SE_F32: return _mm256_loadu_ps((const float *)p);
    case SE_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    default: /* SE_BF16: the upper half of an f32 */
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    }
}
INLINE float load_w1(int type, const uint8_t *p) {
    float f;
    uint32_t u;
    switch (type) {
    case SE_F32: memcpy(&f, p, 4); return f;
    case SE_F16: return h2f(p);
    default: u = (uint32_t)p[0] << 16 | (uint32_t)p[1] << 24; memcpy(&f, &u, 4); return f;
    }
}

INLINE void float_dotx(int type, int64_t n, const uint8_t *w, const uint8_t *a, size_t as, int nc, float *out) {
    const int es = se_types[type].size;
    __m256 acc[4];
    for (int c = 0; c < nc; c++) acc[c] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = load_w8(type, w + i * es);
        for (int c = 0; c < nc; c++)
            acc[c] = _mm256_fmadd_ps(x, _mm256_loadu_ps((const float *)(a + c * as) + i), acc[c]);
    }
    for (int c = 0; c < nc; c++) {
        out[c] = hsum8(acc[c]);
        for (int64_t j = i; j < n; j++) out[c] += load_w1(type, w + j * es) * ((const float *)(a + c * as))[j];
    }
}

/* One weight row x nc activation rows, for the types whose kernels take a single row. */
INLINE void one_row_tile(int type, int64_t n, const uint8_t *w, const uint8_t *a, size_t as, int nc, float *out) {
    if (type == SE_Q4_K || type == SE_Q5_K) q45_K_dotx(type, n, w, a, as, nc, out);
    else if (type == SE_Q2_K || type == SE_Q3_K || type == SE_Q6_K) k16_dotx(type, n, w, a, as, nc, out);
    else float_dotx(type, n, w, a, as, nc, out);
}

/* ---------------------------------------------------------------- activation quantizers
 * Byte for byte the scalar code's results: the same float operations, and roundf's halfway
 * cases (away from zero) rebuilt from a truncation, since the vector rounding mode is to even. */

INLINE __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

INLINE float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

INLINE int hsum8i(__m256i v) {
    __m128i m = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4e));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0xb1));
    return _mm_cvtsi128_si32(m);
}

INLINE __m256 roundf8(__m256 v) {
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 up = _mm256_cmp_ps(abs8(_mm256_sub_ps(v, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(v, _mm256_set1_ps(-0.0f)));
    return _mm256_add_ps(t, _mm256_and_ps(up, one));
}

/* 32 int32 (4 vectors, in order) -> 32 int8 in order; the values fit, so saturation is moot */
INLINE void store_i8x32(int8_t *dst, __m256i q0, __m256i q1, __m256i q2, __m256i q3) {
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)dst, p);
}

INLINE float quant_block32(const float *x, int8_t *qs, int *sum) {
    __m256 v[4];
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        m = _mm256_max_ps(m, abs8(v[j]));
    }
    const float amax = hmax8(m);
    const float d = amax / 127, id = d ? 1 / d : 0;
    __m256i q[4];
    for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(roundf8(_mm256_mul_ps(v[j], _mm256_set1_ps(id))));
    store_i8x32(qs, q[0], q[1], q[2], q[3]);
    *sum = hsum8i(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    return d;
}

static void q8_0_from_float(const float *x, void *dst, int64_t n) {
    se_blk_q8_0 *b = dst;
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        int s;
        b[i].d = _cvtss_sh(quant_block32(x, b[i].qs, &s), _MM_FROUND_TO_NEAREST_INT);
    }
}

static void q8_1_from_float(const float *x, void *dst, int64_t n) {
    se_blk_q8_1 *b = dst;
    for (int64_t i = 0; i < n / 32; i++, x += 32) {
        int s;
        const float d = quant_block32(x, b[i].qs, &s);
        b[i].d = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
        b[i].s = _cvtss_sh(d * (float)s, _MM_FROUND_TO_NEAREST_INT);
    }
}

/* F16 (the KV cache's f16 elements): F16C rounds to nearest even, as se_fp32_to_fp16 does; only a
 * NaN differs there (F16C keeps part of its payload), so 8 values with a NaN among them take the
 * scalar function: the same bits on every path. */
static void f16_from_float(const float *x, void *dst, int64_t n) {
    uint16_t *h = dst;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
            for (int j = 0; j < 8; j++) h[i + j] = se_fp32_to_fp16(x[i + j]);
            continue;
        }
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (; i < n; i++) h[i] = se_fp32_to_fp16(x[i]);
}

/* Q8_K: the first element of largest |x| maps to -127; the rest round to nearest even (the
 * vector default, like lrintf) and clip at 127. Each 16 quants make one bsum. */
static void q8_K_from_float(const float *x, void *dst, int64_t n) {
    se_blk_q8_K *b = dst;
    for (int64_t i = 0; i < n / 256; i++, x += 256) {
        __m256 m = _mm256_setzero_ps();
        for (int j = 0; j < 256; j += 8) m = _mm256_max_ps(m, abs8(_mm256_loadu_ps(x + j)));
        const float amax = hmax8(m);
        memset(&b[i], 0, sizeof b[i]);
        if (amax == 0) continue;
        float max = 0;
        for (int j = 0; j < 256; j += 8) {
            int hit = _mm256_movemask_ps(_mm256_cmp_ps(abs8(_mm256_loadu_ps(x + j)), _mm256_set1_ps(amax), _CMP_EQ_OQ));
            if (hit) { max = x[j + __builtin_ctz((unsigned)hit)]; break; }
        }
        const __m256 vis = _mm256_set1_ps(-127.f / max);
        const __m256i lim = _mm256_set1_epi32(127);
        for (int j = 0; j < 256; j += 32) {
            __m256i q[4];
            for (int l = 0; l < 4; l++)
                q[l] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * l), vis)), lim);
            store_i8x32(b[i].qs + j, q[0], q[1], q[2], q[3]);
            b[i].bsums[j / 16] = (int16_t)hsum8i(_mm256_add_epi32(q[0], q[1]));
            b[i].bsums[j / 16 + 1] = (int16_t)hsum8i(_mm256_add_epi32(q[2], q[3]));
        }
        b[i].d = 1 / (-127.f / max);
    }
}

/* ---------------------------------------------------------------- instances
 * The table's tiles and dots. Each gives its family's kernel a constant type, and the family's
 * shape switch gives it a constant shape, so that the loops over rows and tokens unroll and the
 * accumulators stay in registers. The shapes listed are the ones se_matmul asks of the table's
 * tg_rows and pp_rows (kernels.h); an unlisted one stops the process (se_bad_tile_shape). */

/* Legacy types: tg_rows 4, pp_rows 1. */
INLINE void legacy_shapes(int type, int64_t n, const uint8_t *w, size_t wr, int nr, const uint8_t *a, size_t as,
                          int nc, float *out) {
    switch (SE_SHAPE(nr, nc)) {
    case SE_SHAPE(4, 1): legacy_tile(type, n, w, wr, 4, a, as, 1, out); return;
    case SE_SHAPE(1, 1): legacy_tile(type, n, w, wr, 1, a, as, 1, out); return;
    case SE_SHAPE(1, 2): legacy_tile(type, n, w, wr, 1, a, as, 2, out); return;
    case SE_SHAPE(1, 3): legacy_tile(type, n, w, wr, 1, a, as, 3, out); return;
    case SE_SHAPE(1, 4): legacy_tile(type, n, w, wr, 1, a, as, 4, out); return;
    }
    se_bad_tile_shape("avx2", type, nr, nc);
}

/* Float types and the K-quants: one row (tg_rows 1, pp_rows 1). */
INLINE void one_row_shapes(int type, int64_t n, const uint8_t *w, int nr, const uint8_t *a, size_t as, int nc,
                           float *out) {
    switch (SE_SHAPE(nr, nc)) {
    case SE_SHAPE(1, 1): one_row_tile(type, n, w, a, as, 1, out); return;
    case SE_SHAPE(1, 2): one_row_tile(type, n, w, a, as, 2, out); return;
    case SE_SHAPE(1, 3): one_row_tile(type, n, w, a, as, 3, out); return;
    case SE_SHAPE(1, 4): one_row_tile(type, n, w, a, as, 4, out); return;
    }
    se_bad_tile_shape("avx2", type, nr, nc);
}

static void tile_q4_0(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    legacy_shapes(SE_Q4_0, n, w, wr, nr, a, as, nc, out);
}
static void tile_q4_1(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    legacy_shapes(SE_Q4_1, n, w, wr, nr, a, as, nc, out);
}
static void tile_q5_0(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    legacy_shapes(SE_Q5_0, n, w, wr, nr, a, as, nc, out);
}
static void tile_q5_1(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    legacy_shapes(SE_Q5_1, n, w, wr, nr, a, as, nc, out);
}
static void tile_q8_0(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    legacy_shapes(SE_Q8_0, n, w, wr, nr, a, as, nc, out);
}
/* The one-row tiles have no row stride: they take a single row. */
static void tile_f32(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    (void)wr, one_row_shapes(SE_F32, n, w, nr, a, as, nc, out);
}
static void tile_f16(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    (void)wr, one_row_shapes(SE_F16, n, w, nr, a, as, nc, out);
}
static void tile_bf16(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    (void)wr, one_row_shapes(SE_BF16, n, w, nr, a, as, nc, out);
}
static void tile_q2_K(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    (void)wr, one_row_shapes(SE_Q2_K, n, w, nr, a, as, nc, out);
}
static void tile_q3_K(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    (void)wr, one_row_shapes(SE_Q3_K, n, w, nr, a, as, nc, out);
}
static void tile_q4_K(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    (void)wr, one_row_shapes(SE_Q4_K, n, w, nr, a, as, nc, out);
}
static void tile_q5_K(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    (void)wr, one_row_shapes(SE_Q5_K, n, w, nr, a, as, nc, out);
}
static void tile_q6_K(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    (void)wr, one_row_shapes(SE_Q6_K, n, w, nr, a, as, nc, out);
}

/* The batch kernels (legacy_batch), for se_matmul's small batches and its GEMM alike. */
#define BATCH_FN(name, type)                                                                                      \
    static int batch_##name(int64_t k, const void *W, size_t wrow, const void *act, size_t arow, int n_tok,     \
                            float *y, int64_t ldy, int64_t r0, int64_t r1) {                                 \
        return legacy_batch(type, k, W, wrow, act, arow, n_tok, y, ldy, r0, r1);                              \
    }
BATCH_FN(q4_0, SE_Q4_0)
BATCH_FN(q4_1, SE_Q4_1)
BATCH_FN(q5_0, SE_Q5_0)
BATCH_FN(q5_1, SE_Q5_1)
BATCH_FN(q8_0, SE_Q8_0)

/* The dots: the 1 x 1 tile of each type. */
static float dot_q4_0(int64_t n, const void *w, const void *a) { float o; legacy_tile(SE_Q4_0, n, w, 0, 1, a, 0, 1, &o); return o; }
static float dot_q4_1(int64_t n, const void *w, const void *a) { float o; legacy_tile(SE_Q4_1, n, w, 0, 1, a, 0, 1, &o); return o; }
static float dot_q5_0(int64_t n, const void *w, const void *a) { float o; legacy_tile(SE_Q5_0, n, w, 0, 1, a, 0, 1, &o); return o; }
static float dot_q5_1(int64_t n, const void *w, const void *a) { float o; legacy_tile(SE_Q5_1, n, w, 0, 1, a, 0, 1, &o); return o; }
static float dot_q8_0(int64_t n, const void *w, const void *a) { float o; legacy_tile(SE_Q8_0, n, w, 0, 1, a, 0, 1, &o); return o; }
static float dot_f32(int64_t n, const void *w, const void *a) { float o; one_row_tile(SE_F32, n, w, a, 0, 1, &o); return o; }
static float dot_f16(int64_t n, const void *w, const void *a) { float o; one_row_tile(SE_F16, n, w, a, 0, 1, &o); return o; }
static float dot_bf16(int64_t n, const void *w, const void *a) { float o; one_row_tile(SE_BF16, n, w, a, 0, 1, &o); return o; }
static float dot_q2_K(int64_t n, const void *w, const void *a) { float o; one_row_tile(SE_Q2_K, n, w, a, 0, 1, &o); return o; }
static float dot_q3_K(int64_t n, const void *w, const void *a) { float o; one_row_tile(SE_Q3_K, n, w, a, 0, 1, &o); return o; }
static float dot_q4_K(int64_t n, const void *w, const void *a) { float o; one_row_tile(SE_Q4_K, n, w, a, 0, 1, &o); return o; }
static float dot_q5_K(int64_t n, const void *w, const void *a) { float o; one_row_tile(SE_Q5_K, n, w, a, 0, 1, &o); return o; }
static float dot_q6_K(int64_t n, const void *w, const void *a) { float o; one_row_tile(SE_Q6_K, n, w, a, 0, 1, &o); return o; }

const se_isa_kernels se_kernels_avx2[SE_TYPE_COUNT] = {
    [SE_Q4_0] = { .dot = dot_q4_0, .tile = tile_q4_0, .tg_rows = 4, .pp_rows = 1, .small = batch_q4_0, .gemm = batch_q4_0 },
    [SE_Q4_1] = { .dot = dot_q4_1, .tile = tile_q4_1, .tg_rows = 4, .pp_rows = 1, .small = batch_q4_1, .gemm = batch_q4_1 },
    [SE_Q5_0] = { .dot = dot_q5_0, .tile = tile_q5_0, .tg_rows = 4, .pp_rows = 1, .small = batch_q5_0, .gemm = batch_q5_0 },
    [SE_Q5_1] = { .dot = dot_q5_1, .tile = tile_q5_1, .tg_rows = 4, .pp_rows = 1, .small = batch_q5_1, .gemm = batch_q5_1 },
    [SE_Q8_0] = { .dot = dot_q8_0, .tile = tile_q8_0, .tg_rows = 4, .pp_rows = 1, .small = batch_q8_0, .gemm = batch_q8_0, .from_float = q8_0_from_float },
    [SE_Q2_K] = { .dot = dot_q2_K, .tile = tile_q2_K, .tg_rows = 1, .pp_rows = 1 },
    [SE_Q3_K] = { .dot = dot_q3_K, .tile = tile_q3_K, .tg_rows = 1, .pp_rows = 1 },
    [SE_Q4_K] = { .dot = dot_q4_K, .tile = tile_q4_K, .tg_rows = 1, .pp_rows = 1 },
    [SE_Q5_K] = { .dot = dot_q5_K, .tile = tile_q5_K, .tg_rows = 1, .pp_rows = 1 },
    [SE_Q6_K] = { .dot = dot_q6_K, .tile = tile_q6_K, .tg_rows = 1, .pp_rows = 1 },
    [SE_F32] = { .dot = dot_f32, .tile = tile_f32, .tg_rows = 1, .pp_rows = 1 },
    [SE_F16] = { .dot = dot_f16, .tile = tile_f16, .tg_rows = 1, .pp_rows = 1, .from_float = f16_from_float },
    [SE_BF16] = { .dot = dot_bf16, .tile = tile_bf16, .tg_rows = 1, .pp_rows = 1 },
    [SE_Q8_1] = { .from_float = q8_1_from_float },
    [SE_Q8_K] = { .from_float = q8_K_from_float },
};

#else
const se_isa_kernels se_kernels_avx2[SE_TYPE_COUNT] = {{0}};
#endif
