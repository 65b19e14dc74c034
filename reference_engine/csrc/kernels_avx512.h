/* The AVX-512 kernels' shared part: the instruction sets (the pragma), the helpers of the
 * summation order and the unpacking of every type, included by the two files that hold the
 * kernels. kernels_avx512.c has the tiles, the dots, the activation quantizers and the path's
 * table; kernels_avx512_batch.c the small-batch kernel and the GEMM (with its AMX variant). They
 * are two files so that the two halves compile in parallel: their always-inline instances of
 * every type and shape take most of the library's build time. */
#ifndef SE_KERNELS_AVX512_H
#define SE_KERNELS_AVX512_H
#define SE_KERNELS_INTERNAL
#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float h2f(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }
INLINE uint32_t ld32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

INLINE __m512i load2x32(const uint8_t *p0, const uint8_t *p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p0)),
                              _mm256_loadu_si256((const __m256i *)p1), 1);
}

/* 16 packed bytes of each of two blocks -> 64 nibbles in element order: block 0's low nibbles,
 * its high nibbles, then block 1's. */
INLINE __m512i nibbles2(const uint8_t *p0, const uint8_t *p1) {
    __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p0)),
                                        _mm_loadu_si128((const __m128i *)p1), 1);
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(x), _mm256_srli_epi16(x, 4), 1);
    z = _mm512_shuffle_i64x2(z, z, 0xD8); /* 128-bit lanes 0,2,1,3 */
    return _mm512_and_si512(z, _mm512_set1_epi8(15));
}

/* Sums of 16 lanes in one fixed order for every caller, so that results do not depend on the
 * tile: within each 128-bit lane (e0+e2)+(e1+e3), then across lanes (L0+L2)+(L1+L3). Four
 * vectors at once (hsum16x4) share the shuffles: a 4-row tile's 4 reductions cost about one. */
INLINE __m128 fold_lanes(__m512 v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
INLINE float hsum16(__m512 v) {
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
    return _mm_cvtss_f32(fold_lanes(v));
}
INLINE __m128 hsum16x4_ps(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    return fold_lanes(_mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE)));
}
INLINE void hsum16x4(__m512 a, __m512 b, __m512 c, __m512 d, float *out) { _mm_storeu_ps(out, hsum16x4_ps(a, b, c, d)); }

/* ---------------------------------------------------------------- legacy 32-blocks */

/* 64 quants of two legacy blocks as unsigned bytes; the weight's quant is the byte minus the
 * type's q_offset (se_types gives the layout). */
INLINE __m512i unpack2(int type, const uint8_t *b0, const uint8_t *b1) {
    const se_type_traits *t = &se_types[type];
    if (type == SE_Q8_0) /* int8 + 128: the top bit flipped */
        return _mm512_xor_si512(load2x32(b0 + t->qs_offset, b1 + t->qs_offset), _mm512_set1_epi8((char)0x80));
    __m512i q = nibbles2(b0 + t->qs_offset, b1 + t->qs_offset);
    if (t->qh_offset) { /* the fifth bits of both blocks make one 64-bit mask */
        __mmask64 hi = (__mmask64)ld32(b0 + t->qh_offset) | (__mmask64)ld32(b1 + t->qh_offset) << 32;
        q = _mm512_mask_add_epi8(q, hi, q, _mm512_set1_epi8(16));
    }
    return q;
}

/* ---------------------------------------------------------------- K-quants */

/* The 8 six-bit scales and mins of a Q4_K/Q5_K super-block, as bytes (ggml's get_scale_min_k4
 * done four at a time on 32-bit words). */
INLINE void scales_mins_k4(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    uint32_t a = ld32(s), b = ld32(s + 4), c = ld32(s + 8);
    uint32_t sc_lo = a & 0x3f3f3f3f, mn_lo = b & 0x3f3f3f3f;
    uint32_t sc_hi = (c & 0x0f0f0f0f) | ((a >> 6) & 0x03030303) << 4;
    uint32_t mn_hi = ((c >> 4) & 0x0f0f0f0f) | ((b >> 6) & 0x03030303) << 4;
    *sc = sc_lo | (uint64_t)sc_hi << 32;
    *mn = mn_lo | (uint64_t)mn_hi << 32;
}

/* The 256 quants of a Q4_K or Q5_K super-block x as unsigned bytes in element order. */
INLINE void unpack_q45_K(int type, const uint8_t *x, __m512i q[4]) {
    const se_type_traits *t = &se_types[type];
    for (int j = 0; j < 4; j++) {
        __m256i raw = _mm256_loadu_si256((const __m256i *)(x + t->qs_offset + 32 * j));
        q[j] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1),
                                _mm512_set1_epi8(15));
        if (t->qh_offset) { /* Q5_K: element 64j+l takes bit 2j of qh[l]; element 64j+32+l takes bit 2j+1 */
            __m256i qh = _mm256_loadu_si256((const __m256i *)(x + t->qh_offset));
            __mmask64 hi = (__mmask64)_mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * j)))) |
                           (__mmask64)_mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(2 << (2 * j)))) << 32;
            q[j] = _mm512_mask_add_epi8(q[j], hi, q[j], _mm512_set1_epi8(16));
        }
    }
}

/* The 256 quants of a Q6_K super-block as unsigned bytes (0..63, the weight is q - 32) in
 * element order. */
INLINE void unpack_q6_K(const se_blk_q6_K *x, __m512i q[4]) {
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        __m512i ql = _mm512_loadu_si512(x->ql + 64 * h);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
        /* [qh, qh >> 2]: bits 4-5 of each byte then feed quants 64..127 of this half, and
         * the same bits shifted left by 4 feed quants 0..63 */
        __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
        q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_slli_epi16(qh2, 4), m30));
        q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), _mm512_and_si512(qh2, m30));
    }
}

/* The 256 quants of a Q2_K or Q3_K super-block as unsigned bytes in element order (Q3_K's are
 * 0..7, the weight is q - 4): vector 2h + k holds elements 128h + 64k.., whose low bits are bits
 * 4k..4k+1 (first 32) and 4k+2..4k+3 (last 32) of qs[32h + l]; Q3_K's high bit of element 32m + l
 * is bit m of hmask[l] (kernels.h). */
INLINE void unpack_q23_K(int type, const uint8_t *x, __m512i q[4]) {
    const uint8_t *qs = x + se_types[type].qs_offset;
    for (int h = 0; h < 2; h++) {
        const __m512i z = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * h)));
        for (int k = 0; k < 2; k++) {
            const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16((short)(4 * k)), _mm256_set1_epi16((short)(4 * k + 2)), 1);
            q[2 * h + k] = _mm512_and_si512(_mm512_srlv_epi16(z, shift), _mm512_set1_epi8(3));
        }
    }
    if (type == SE_Q3_K) {
        const __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)((const se_blk_q3_K *)x)->hmask));
        for (int k = 0; k < 4; k++) {
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * k))), _mm256_set1_epi8((char)(2 << (2 * k))), 1);
            q[k] = _mm512_mask_add_epi8(q[k], _mm512_test_epi8_mask(hm, bit), q[k], _mm512_set1_epi8(4));
        }
    }
}

/* A super-block of the K-quants with 16 scales of 16 quants (Q2_K, Q3_K, Q6_K): its quants as
 * unsigned bytes in element order, its scales (block order), Q2_K's mins, d and dmin. The types
 * without a min store q + se_types' q_offset, taken back through the activations' bsums. */
typedef struct {
    __m512i q[4];
    int8_t sc[16];
    uint8_t mn[16];
    float d, dmin;
} k16_block;

INLINE void unpack_k16(int type, const uint8_t *x, k16_block *b) {
    if (type == SE_Q6_K) {
        const se_blk_q6_K *y = (const se_blk_q6_K *)x;
        unpack_q6_K(y, b->q);
        memcpy(b->sc, y->scales, 16);
        b->d = h2f((const uint8_t *)&y->d), b->dmin = 0;
        return;
    }
    unpack_q23_K(type, x, b->q);
    if (type == SE_Q2_K) {
        const se_blk_q2_K *y = (const se_blk_q2_K *)x;
        for (int j = 0; j < 16; j++) b->sc[j] = (int8_t)(y->scales[j] & 15), b->mn[j] = y->scales[j] >> 4;
        b->d = h2f((const uint8_t *)&y->d), b->dmin = h2f((const uint8_t *)&y->dmin);
        return;
    }
    const se_blk_q3_K *y = (const se_blk_q3_K *)x;
    uint32_t w[4];
    se_q3_K_scale_words(y->scales, w);
    _mm_storeu_si128((__m128i *)b->sc, _mm_sub_epi8(_mm_setr_epi32((int)w[0], (int)w[1], (int)w[2], (int)w[3]),
                                                    _mm_set1_epi8(32)));
    b->d = h2f((const uint8_t *)&y->d), b->dmin = 0;
}

/* ---------------------------------------------------------------- the summation order's helpers */

/* Which block of a group of 16 each lane holds (the summation order: kernels_avx512.c's header comment). */
static const int LANE32[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};
static const int LANE16[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

/* Integer adds, so any order gives the same sums. pairsum: per 128-bit lane [x0+x2, y0+y2,
 * x1+x3, y1+y3]; quadsum of pairsum(v0, v1) and pairsum(v2, v3): per 128-bit lane the sums of
 * that lane's 4 elements of v0, v1, v2, v3. */
INLINE __m512i pairsum(__m512i x, __m512i y) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y));
}
INLINE __m512i quadsum(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
/* 16 blocks of 32: v[k] holds block 2k in its lower 8 lanes, block 2k+1 in its upper 8. Returns
 * the blocks' sums, lane p = block LANE32[p]. Only v[0..nv) are read (the rest count as zero). */
INLINE __m512i blocks16_32(const __m512i v[8], int nv) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i b0 = quadsum(pairsum(v[0], nv > 1 ? v[1] : zero), nv > 2 ? pairsum(v[2], nv > 3 ? v[3] : zero) : zero);
    const __m512i b1 = nv > 4 ? quadsum(pairsum(v[4], nv > 5 ? v[5] : zero), nv > 6 ? pairsum(v[6], nv > 7 ? v[7] : zero) : zero)
                              : zero;
    return _mm512_add_epi32(_mm512_shuffle_i32x4(b0, b1, 0x88), _mm512_shuffle_i32x4(b0, b1, 0xDD));
}
/* 16 blocks of 16: v[k] holds blocks 4k..4k+3, one per 128-bit lane; lane p = block LANE16[p]. */
INLINE __m512i blocks16_16(const __m512i v[4]) { return quadsum(pairsum(v[0], v[1]), pairsum(v[2], v[3])); }

/* The first 4 bytes of the legacy blocks of a group (block LANE32[p] in lane p, zero for the
 * blocks at or past cnt): the fp16 d in each lane's low half, the next fp16 (m or s for the
 * types with a min) in its high half. Lanes of blocks at or past 2 * nv (a constant once inlined)
 * are not read. */
INLINE __m512i heads16(const uint8_t *b, int size, int cnt, const int nv) {
#define H(p) (LANE32[p] < 2 * nv ? (int)ld32(b + (LANE32[p] < cnt ? LANE32[p] : cnt - 1) * size) : 0)
    const __m512i h = _mm512_setr_epi32(H(0), H(1), H(2), H(3), H(4), H(5), H(6), H(7), H(8), H(9), H(10), H(11),
                                        H(12), H(13), H(14), H(15));
#undef H
    return cnt == 16 ? h : _mm512_maskz_mov_epi32(_mm512_cmplt_epi32_mask(_mm512_loadu_si512(LANE32), _mm512_set1_epi32(cnt)), h);
}
INLINE __m512 low_halves(__m512i h) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)); }
INLINE __m512 high_halves(__m512i h) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16))); }

/* 16 bytes (block order) -> 16 int32 in lane order */
INLINE __m512i lanes_u8(__m128i v, const int *lane) {
    return _mm512_permutexvar_epi32(_mm512_loadu_si512(lane), _mm512_cvtepu8_epi32(v));
}

/* The 16 lanes of nk outputs added in the tree, 4 at a time where possible. */
INLINE void hsum_tiles(const __m512 *acc, int nk, float *out) {
    int k = 0;
    for (; k + 4 <= nk; k += 4) hsum16x4(acc[k], acc[k + 1], acc[k + 2], acc[k + 3], out + k);
    for (; k < nk; k++) out[k] = hsum16(acc[k]);
}
/* The same sums stored down a column: out[k * ld]. From registers, one float at a time: a store
 * of four floats read back as a vector stalls the load (no store forwarding across two stores),
 * and a compiler's scatter costs more than the sums. */
INLINE void hsum_tiles_column(const __m512 *acc, int nk, float *out, int64_t ld) {
    int k = 0;
    for (; k + 4 <= nk; k += 4) {
        const __m128 v = hsum16x4_ps(acc[k], acc[k + 1], acc[k + 2], acc[k + 3]);
        _mm_store_ss(out + k * ld, v);
        _mm_store_ss(out + (k + 1) * ld, _mm_movehdup_ps(v));
        _mm_store_ss(out + (k + 2) * ld, _mm_unpackhi_ps(v, v));
        _mm_store_ss(out + (k + 3) * ld, _mm_shuffle_ps(v, v, 3));
    }
    for (; k < nk; k++) out[k * ld] = hsum16(acc[k]);
}

/* The scales of two Q4_K/Q5_K super-blocks xa, xb (two == 0: xb == xa is a lone last one, whose
 * lanes get zero scales): lane p is sub-block LANE32[p] (lanes 0-7 xa's, 8-15 xb's), wd = d*sc and
 * wm = -dmin*m, exact products. The two types share the layout of d, dmin and the scales. */
INLINE void q45_scales(const uint8_t *xa, const uint8_t *xb, int two, __m512 *wd, __m512 *wm) {
    const size_t sc_at = offsetof(se_blk_q4_K, scales), d_at = offsetof(se_blk_q4_K, d);
    const size_t dmin_at = offsetof(se_blk_q4_K, dmin);
    uint64_t sca, mna, scb, mnb;
    scales_mins_k4(xa + sc_at, &sca, &mna);
    scales_mins_k4(xb + sc_at, &scb, &mnb);
    const __mmask16 half = two ? 0xffff : 0x00ff;
    const __m512 d = _mm512_maskz_mov_ps(half, _mm512_insertf32x8(_mm512_set1_ps(h2f(xa + d_at)), _mm256_set1_ps(h2f(xb + d_at)), 1));
    const __m512 dmin = _mm512_insertf32x8(_mm512_set1_ps(-h2f(xa + dmin_at)), _mm256_set1_ps(-h2f(xb + dmin_at)), 1);
    *wd = _mm512_mul_ps(_mm512_cvtepi32_ps(lanes_u8(_mm_set_epi64x((long long)scb, (long long)sca), LANE32)), d);
    *wm = _mm512_maskz_mul_ps(half, dmin, _mm512_cvtepi32_ps(lanes_u8(_mm_set_epi64x((long long)mnb, (long long)mna), LANE32)));
}
/* The activations' side of the same pair (Q8_K blocks ya, yb): ad = d_a, and the mins' partner
 * sa = d_a * (the sub-block's sum of activations: two bsums of 16). */
INLINE void q45_act_scales(const se_blk_q8_K *ya, const se_blk_q8_K *yb, int two, __m512 *ad, __m512 *sa) {
    const __mmask16 half = two ? 0xffff : 0x00ff;
    *ad = _mm512_maskz_mov_ps(half, _mm512_insertf32x8(_mm512_set1_ps(ya->d), _mm256_set1_ps(yb->d), 1));
    const __m512i bs = _mm512_madd_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)ya->bsums)),
                                                            _mm256_loadu_si256((const __m256i *)yb->bsums), 1),
                                         _mm512_set1_epi16(1));
    *sa = _mm512_mul_ps(*ad, _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(_mm512_loadu_si512(LANE32), bs)));
}

/* The scales of a Q2_K/Q3_K/Q6_K super-block, lane p = block LANE16[p]: wd = d*sc and (Q2_K)
 * wm = -dmin*m, exact products. */
INLINE void k16_scales(int type, const k16_block *b, __m512 *wd, __m512 *wm) {
    const __m512i lane = _mm512_loadu_si512(LANE16);
    const __m512i sc = _mm512_permutexvar_epi32(lane, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b->sc)));
    *wd = _mm512_mul_ps(_mm512_set1_ps(b->d), _mm512_cvtepi32_ps(sc));
    *wm = se_types[type].has_min ? _mm512_mul_ps(_mm512_set1_ps(-b->dmin), _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(
                                                     lane, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b->mn)))))
                                 : _mm512_setzero_ps();
}

/* The batch kernels of every quantized type (kernels_avx512_batch.c), for the table. */
typedef int se_batch_kernel(int64_t k, const void *W, size_t wrow, const void *act, size_t arow, int n_tok, float *y,
                            int64_t ldy, int64_t r0, int64_t r1);
se_batch_kernel se_avx512_gemm_q4_0, se_avx512_small_q4_0;
se_batch_kernel se_avx512_gemm_q4_1, se_avx512_small_q4_1;
se_batch_kernel se_avx512_gemm_q5_0, se_avx512_small_q5_0;
se_batch_kernel se_avx512_gemm_q5_1, se_avx512_small_q5_1;
se_batch_kernel se_avx512_gemm_q8_0, se_avx512_small_q8_0;
se_batch_kernel se_avx512_gemm_q2_K, se_avx512_small_q2_K;
se_batch_kernel se_avx512_gemm_q3_K, se_avx512_small_q3_K;
se_batch_kernel se_avx512_gemm_q4_K, se_avx512_small_q4_K;
se_batch_kernel se_avx512_gemm_q5_K, se_avx512_small_q5_K;
se_batch_kernel se_avx512_gemm_q6_K, se_avx512_small_q6_K;
/* The batch kernel on packed panels (P: the panels; "packed panels" there) and its packer. */
int se_avx512_packed_gemm(int type, int64_t k, const void *P, size_t wrow, const void *act, size_t arow, int n_tok,
                          float *y, int64_t ldy, int64_t r0, int64_t r1);
void se_avx512_pack_panels(int type, const void *W, int64_t k, int64_t rows, void *out);

#endif /* x86-64 GCC */
#endif
