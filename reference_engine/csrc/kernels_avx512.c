/* AVX-512 (F/BW/VL/DQ + VNNI) dot products. Only this file and kernels_avx512_batch.c are compiled
 * for these ISAs (by the pragma in kernels_avx512.h), so the library still builds with portable
 * flags; kernels.c chooses them at run time. The batch kernels (the small-batch kernel and the
 * GEMM) are in kernels_avx512_batch.c, what both files share in kernels_avx512.h.
 *
 * Integer products use vpdpbusd (u8 x s8 -> s32, no saturation). Weights go in the u8 operand:
 * unsigned ones (q4_1, q5_1, the K-quants' q) as they are, signed ones (q4_0, q5_0, q8_0) plus
 * an offset that is taken back through the activations' sums. Each kernel is a tile of weight
 * rows x activation rows: 4 x 1 for generation, 2 x 4 for short batches (a weight block is
 * unpacked once for 4 tokens). Batches of 2 to se_gemm_min_tokens() - 1 tokens (the steps of
 * batched decoding) take the small-batch kernel, blocks in lanes; larger ones the GEMM on int8
 * panels.
 *
 * The summation order. Every quantized kernel here (tiles, the dots made from them, the GEMM)
 * adds a row's products in one order, so that an output's bits depend on its weight row and
 * activation row alone: never on the tile, the batch, the thread's row range or the path.
 *   - A scale block b (32 quants; 16 for Q2_K, Q3_K, Q6_K) gives an exact integer isum_b (offset corrections
 *     included), its scale D_b = wd_b * ad_b (one float multiply of the weight's and the
 *     activation's scale) and, for the types with a min, M_b and S_b.
 *   - Block b goes to float lane p of 16, where LANE32[p] (LANE16[p] for those) == b % 16; a
 *     lane takes its blocks in increasing order: lane = fma(isum_b, D_b, lane), then
 *     lane = fma(M_b, S_b, lane).
 *   - The 16 lanes are added in hsum16's tree.
 * The tiles hold quants in vector lanes: per group of 16 blocks they reduce the integer sums to
 * one vector whose lane p is block LANE[p] (blocks16_*), then take one fma per group. The
 * small-batch kernel holds blocks in lanes: lane p of every vector is block LANE[p] from the
 * start, so the integer sums need no reduction. The GEMM holds rows in lanes: it runs the 16 lane
 * chains one after another and adds them in the tree. The AMX path (SE_ISA_AMX: this file's
 * kernels with another GEMM) takes the GEMM's integer block sums from int8 tiles instead of
 * vpdpbusd; they are the same exact integers, and every float operation is the GEMM's, so its
 * outputs are AVX-512's bit for bit.
 * Blocks past a row's end get zero scales: their fma adds an exact zero.
 */
#define _GNU_SOURCE /* syscall */
#include "kernels_avx512.h"

#if defined(__x86_64__) && defined(__GNUC__)

/* ---------------------------------------------------------------- tiles */

/* One group of cnt <= 16 blocks of nr weight rows x nc activation rows, added to acc[r * nc + c].
 * nv (a constant once inlined) vectors of two blocks are computed, nv >= cnt / 2: blocks at or
 * past cnt re-read the last one and get zero scales. The activations' quants are copied side by
 * side once for all rows, and for the signed types their offset correction -offset * sum(a) is
 * reduced once per token; each row's blocks are unpacked once for all tokens. */
INLINE void legacy_group(int type, const int nv, int cnt, const uint8_t *x, size_t wr, int nr, const uint8_t *y,
                         size_t as, int nc, __m512 *acc) {
    const se_type_traits *wt = &se_types[type], *at = &se_types[wt->act_type];
    const int is1 = wt->has_min; /* the _1 types: blocks add m * s */
    const int ws = wt->size, asz = at->size, aq = at->qs_offset, off = wt->q_offset;
    const __m512i zero = _mm512_setzero_si512();
    __m512i aq2[4][8], bias[4];
    __m512 ad[4], asum[4];
    for (int c = 0; c < nc; c++) {
        const uint8_t *yc = y + c * as + aq;
        for (int k = 0; k < nv; k++)
            aq2[c][k] = load2x32(yc + (2 * k < cnt ? 2 * k : cnt - 1) * asz, yc + (2 * k + 1 < cnt ? 2 * k + 1 : cnt - 1) * asz);
        const __m512i h = heads16(y + c * as, asz, cnt, nv);
        ad[c] = low_halves(h);
        asum[c] = is1 ? high_halves(h) : _mm512_setzero_ps();
        bias[c] = zero;
        if (off) {
            __m512i s[8];
            for (int k = 0; k < nv; k++) s[k] = _mm512_dpbusd_epi32(zero, _mm512_set1_epi8((char)off), aq2[c][k]);
            bias[c] = _mm512_sub_epi32(zero, blocks16_32(s, nv));
        }
    }
    for (int r = 0; r < nr; r++) {
        const uint8_t *xr = x + r * wr;
        __m512i q[8];
        for (int k = 0; k < nv; k++)
            q[k] = unpack2(type, xr + (2 * k < cnt ? 2 * k : cnt - 1) * ws, xr + (2 * k + 1 < cnt ? 2 * k + 1 : cnt - 1) * ws);
        const __m512i h = heads16(xr, ws, cnt, nv);
        const __m512 wd = low_halves(h), wm = high_halves(h);
        for (int c = 0; c < nc; c++) {
            __m512i p[8];
            for (int k = 0; k < nv; k++) p[k] = _mm512_dpbusd_epi32(zero, q[k], aq2[c][k]);
            const __m512i isum = _mm512_add_epi32(blocks16_32(p, nv), bias[c]);
            __m512 *o = &acc[r * nc + c];
            *o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(wd, ad[c]), *o);
            if (is1) *o = _mm512_fmadd_ps(wm, asum[c], *o);
        }
    }
}

/* nr weight rows (stride wr) x nc activation rows (stride as) -> out[r * nc + c]; nr * nc <= 8;
 * groups of 16 blocks, a short last group with fewer vectors. */
INLINE void legacy_tile(int type, int64_t n, const uint8_t *w, size_t wr, int nr, const uint8_t *a, size_t as,
                        int nc, float *out) {
    const int ws = se_types[type].size, asz = se_types[se_types[type].act_type].size;
    const int64_t nb = n / 32;
    __m512 acc[8];
    for (int k = 0; k < nr * nc; k++) acc[k] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nb; g += 16) {
        const int cnt = nb - g < 16 ? (int)(nb - g) : 16;
        const uint8_t *x = w + g * ws, *y = a + g * asz;
        if (cnt > 8) legacy_group(type, 8, cnt, x, wr, nr, y, as, nc, acc);
        else if (cnt > 4) legacy_group(type, 4, cnt, x, wr, nr, y, as, nc, acc);
        else if (cnt > 2) legacy_group(type, 2, cnt, x, wr, nr, y, as, nc, acc);
        else legacy_group(type, 1, cnt, x, wr, nr, y, as, nc, acc);
    }
    hsum_tiles(acc, nr * nc, out);
}

/* Q4_K and Q5_K, one row x nc tokens: per group of two super-blocks (16 sub-blocks of 32),
 * 8 vpdpbusd; the scales d*sc and mins -dmin*m are exact products, the mins' partner is
 * S = d_a * (the sub-block's sum of activations, from the bsums). The two types share the layout
 * of d, dmin and the scales (se_blk_q4_K). */
INLINE void q45_K_dotx(int type, int64_t n, const uint8_t *w, const uint8_t *a, size_t as, int nc, float *out) {
    const int ws = se_types[type].size;
    const int64_t nsb = n / 256;
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[4];
    for (int c = 0; c < nc; c++) acc[c] = _mm512_setzero_ps();

    for (int64_t g = 0; g < nsb; g += 2) {
        const int two = g + 1 < nsb; /* a lone last super-block: the second half gets zero scales */
        const uint8_t *xa = w + g * ws, *xb = two ? xa + ws : xa;
        __m512i q[8];
        unpack_q45_K(type, xa, q);
        unpack_q45_K(type, xb, q + 4);
        __m512 wd, wm;
        q45_scales(xa, xb, two, &wd, &wm);
        for (int c = 0; c < nc; c++) {
            const se_blk_q8_K *ya = (const se_blk_q8_K *)(a + c * as) + g, *yb = two ? ya + 1 : ya;
            __m512i p[8];
            for (int k = 0; k < 8; k++)
                p[k] = _mm512_dpbusd_epi32(zero, q[k], _mm512_loadu_si512((k < 4 ? ya : yb)->qs + 64 * (k % 4)));
            __m512 ad, sa;
            q45_act_scales(ya, yb, two, &ad, &sa);
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(blocks16_32(p, two ? 8 : 4)), _mm512_mul_ps(wd, ad), acc[c]);
            acc[c] = _mm512_fmadd_ps(wm, sa, acc[c]);
        }
    }
    hsum_tiles(acc, nc, out);
}

/* Q2_K, Q3_K and Q6_K, one row x nc tokens: per super-block (16 blocks of 16), 4 vpdpbusd; the
 * scales d*sc are exact products. Q3_K and Q6_K take their stored offset back through the bsums
 * (exact integers: isum = sum(q*a) - offset*bsum); Q2_K's mins -dmin*m meet S = d_a * bsum. */
INLINE void k16_dotx(int type, int64_t n, const uint8_t *w, const uint8_t *a, size_t as, int nc, float *out) {
    const se_type_traits *t = &se_types[type];
    const __m512i zero = _mm512_setzero_si512(), lane = _mm512_loadu_si512(LANE16);
    /* offset * bsum as a shift: the offsets are powers of two (Q3_K 4, Q6_K 32) */
    const __m512i off_shift = _mm512_set1_epi32(t->q_offset ? __builtin_ctz((unsigned)t->q_offset) : 0);
    __m512 acc[4];
    for (int c = 0; c < nc; c++) acc[c] = _mm512_setzero_ps();

    for (int64_t i = 0; i < n / 256; i++) {
        k16_block b;
        unpack_k16(type, w + i * t->size, &b);
        __m512 wd, wm;
        k16_scales(type, &b, &wd, &wm);
        for (int c = 0; c < nc; c++) {
            const se_blk_q8_K *y = (const se_blk_q8_K *)(a + c * as) + i;
            __m512i p[4];
            for (int k = 0; k < 4; k++) p[k] = _mm512_dpbusd_epi32(zero, b.q[k], _mm512_loadu_si512(y->qs + 64 * k));
            const __m512i bs = _mm512_permutexvar_epi32(lane, _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)y->bsums)));
            __m512i isum = blocks16_16(p);
            if (t->q_offset) isum = _mm512_add_epi32(isum, _mm512_sub_epi32(zero, _mm512_sllv_epi32(bs, off_shift)));
            const __m512 ad = _mm512_set1_ps(y->d);
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(wd, ad), acc[c]);
            if (t->has_min) acc[c] = _mm512_fmadd_ps(wm, _mm512_mul_ps(ad, _mm512_cvtepi32_ps(bs)), acc[c]);
        }
    }
    hsum_tiles(acc, nc, out);
}

/* ---------------------------------------------------------------- float weights x f32 */

INLINE __m512 load_w16(int type, const uint8_t *p, __mmask16 m) {
    switch (type) {
    case SE_F32: return _mm512_maskz_loadu_ps(m, p);
    case SE_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
    default: /* SE_BF16: the upper half of an f32 */
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    }
}

INLINE void float_tile(int type, int64_t n, const uint8_t *w, size_t wr, int nr, const uint8_t *a, size_t as,
                       int nc, float *out) {
    const int es = type == SE_F32 ? 4 : 2;
    __m512 acc[8];
    for (int k = 0; k < nr * nc; k++) acc[k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 x[4];
        for (int r = 0; r < nr; r++) x[r] = load_w16(type, w + r * wr + i * es, m);
        for (int c = 0; c < nc; c++) {
            const __m512 y = _mm512_maskz_loadu_ps(m, (const float *)(a + c * as) + i);
            for (int r = 0; r < nr; r++) acc[r * nc + c] = _mm512_fmadd_ps(x[r], y, acc[r * nc + c]);
        }
    }
    for (int k = 0; k < nr * nc; k++) out[k] = _mm512_reduce_add_ps(acc[k]);
}

/* ---------------------------------------------------------------- activation quantizers
 * Byte for byte the scalar code's results: the same float operations, and roundf's halfway
 * cases (away from zero) rebuilt from a truncation, since the vector rounding mode is to even. */

INLINE __m512 round_away16(__m512 v) {
    const __m512 t = _mm512_roundscale_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(v, t)), _mm512_set1_ps(0.5f), _CMP_GE_OQ);
    const __m512 one = _mm512_or_ps(_mm512_set1_ps(1.0f), _mm512_and_ps(v, _mm512_set1_ps(-0.0f)));
    return _mm512_mask_add_ps(t, up, t, one);
}

/* v[b] (b < 16): 16 lanes each; returns lane b = the max (is_max) or the sum of v[b]'s lanes. Four
 * rounds of pairwise folds instead of 16 reductions. A sum is exact here (small integers) and a
 * max is exact in any order, so the result is that of any reduction order. */
INLINE __m512 reduce16(__m512 *v, int is_max) {
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int h = 8, n = 16; h > 0; h /= 2, n /= 2) {
        /* v[2i] and v[2i+1] hold 16 / 2h groups of 2h lanes each, side by side: lanes [0, 32) of
         * the pair. Lane j of the folded vector is group j / h's lane j % h (lo) with its lane
         * j % h + h (hi), maxed or added: the groups halve, v[2i]'s then v[2i+1]'s. */
        const __m512i lo = _mm512_add_epi32(iota, _mm512_and_si512(iota, _mm512_set1_epi32(-h)));
        const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(h));
        for (int i = 0; i < n / 2; i++) {
            const __m512 a = _mm512_permutex2var_ps(v[2 * i], lo, v[2 * i + 1]);
            const __m512 b = _mm512_permutex2var_ps(v[2 * i], hi, v[2 * i + 1]);
            v[i] = is_max ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b);
        }
    }
    return v[0];
}

/* Up to 16 blocks of 32 (nb of them) at x: their quants into qs (32 bytes a block, block b at
 * qs + b * bs), their d (f32) into lane b of *d and their quants' sums (exact, as floats) into
 * lane b of *sum. The same float operations per block as the scalar code's; the horizontal max
 * and sum, the divisions and the f16 conversions done for 16 blocks at once instead of one by one
 * (Q8_1, 8 rows of 1536, Xeon: 17.7 -> 11.4 ns a block; a batched step quantizes every token's
 * activations on every thread, about 4% of its time before). */
INLINE void quant_blocks16(const float *x, int nb, int8_t *qs, size_t bs, __m512 *d, __m512 *sum) {
    __m512 r[16];
    for (int b = 0; b < 16; b++)
        r[b] = b < nb ? _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + 32 * b)), _mm512_abs_ps(_mm512_loadu_ps(x + 32 * b + 16)))
                      : _mm512_setzero_ps();
    *d = _mm512_div_ps(reduce16(r, 1), _mm512_set1_ps(127));
    const __mmask16 nz = _mm512_cmp_ps_mask(*d, _mm512_setzero_ps(), _CMP_NEQ_UQ); /* d ? 1 / d : 0 */
    float id[16];
    _mm512_storeu_ps(id, _mm512_maskz_div_ps(nz, _mm512_set1_ps(1), *d));
    for (int b = 0; b < 16; b++) {
        r[b] = _mm512_setzero_ps();
        if (b >= nb) continue;
        const __m512 vid = _mm512_set1_ps(id[b]);
        const __m512i q0 = _mm512_cvtps_epi32(round_away16(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * b), vid)));
        const __m512i q1 = _mm512_cvtps_epi32(round_away16(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * b + 16), vid)));
        _mm_storeu_si128((__m128i *)(qs + b * bs), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(qs + b * bs + 16), _mm512_cvtepi32_epi8(q1));
        r[b] = _mm512_cvtepi32_ps(_mm512_add_epi32(q0, q1));
    }
    *sum = reduce16(r, 0);
}

/* The 16 lanes of v rounded to f16 (as _cvtss_sh does one) into h[] */
INLINE void to_f16_16(__m512 v, uint16_t *h) {
    _mm256_storeu_si256((__m256i *)h, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

static void q8_0_from_float(const float *x, void *dst, int64_t n) {
    se_blk_q8_0 *b = dst;
    for (int64_t i = 0; i < n / 32; i += 16, x += 512) {
        const int nb = n / 32 - i < 16 ? (int)(n / 32 - i) : 16;
        __m512 d, sum;
        uint16_t dh[16];
        quant_blocks16(x, nb, b[i].qs, sizeof *b, &d, &sum);
        to_f16_16(d, dh);
        for (int j = 0; j < nb; j++) b[i + j].d = dh[j];
    }
}

static void q8_1_from_float(const float *x, void *dst, int64_t n) {
    se_blk_q8_1 *b = dst;
    for (int64_t i = 0; i < n / 32; i += 16, x += 512) {
        const int nb = n / 32 - i < 16 ? (int)(n / 32 - i) : 16;
        __m512 d, sum;
        uint16_t dh[16], sh[16];
        quant_blocks16(x, nb, b[i].qs, sizeof *b, &d, &sum);
        to_f16_16(d, dh);
        to_f16_16(_mm512_mul_ps(d, sum), sh);
        for (int j = 0; j < nb; j++) {
            b[i + j].d = dh[j];
            b[i + j].s = sh[j];
        }
    }
}

/* Q8_K: the first element of largest |x| maps to -127; the rest round to nearest even (the
 * vector default, like lrintf) and clip at 127. Each 16 quants make one bsum. */
static void q8_K_from_float(const float *x, void *dst, int64_t n) {
    se_blk_q8_K *b = dst;
    for (int64_t i = 0; i < n / 256; i++, x += 256) {
        __m512 m = _mm512_setzero_ps();
        for (int j = 0; j < 256; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
        const float amax = _mm512_reduce_max_ps(m);
        memset(&b[i], 0, sizeof b[i]);
        if (amax == 0) continue;
        float max = 0;
        for (int j = 0; j < 256; j += 16) {
            __mmask16 hit = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + j)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
            if (hit) { max = x[j + __builtin_ctz(hit)]; break; }
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < 16; j++) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * j), _mm512_set1_ps(iscale)));
            q = _mm512_min_epi32(q, _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(b[i].qs + 16 * j), _mm512_cvtepi32_epi8(q));
            b[i].bsums[j] = (int16_t)_mm512_reduce_add_epi32(q);
        }
        b[i].d = 1 / iscale;
    }
}

/* ---------------------------------------------------------------- instances
 * The table's tiles and dots (its GEMMs and small-batch kernels: kernels_avx512_batch.c). Each
 * gives its family's kernel a constant type, and the family's shape switch gives it a constant
 * shape, so that the loops over rows and tokens unroll and the accumulators stay in registers. The
 * shapes listed are the ones se_matmul asks of the table's tg_rows and pp_rows (kernels.h); an
 * unlisted one stops the process (se_bad_tile_shape). */

/* Legacy and float types, whose kernels take several rows: tg_rows 4, pp_rows 2. */
INLINE void multi_row_tile(int type, int64_t n, const uint8_t *w, size_t wr, int nr, const uint8_t *a, size_t as,
                           int nc, float *out) {
    if (se_types[type].blck == 1) float_tile(type, n, w, wr, nr, a, as, nc, out);
    else legacy_tile(type, n, w, wr, nr, a, as, nc, out);
}
INLINE void multi_row_shapes(int type, int64_t n, const uint8_t *w, size_t wr, int nr, const uint8_t *a, size_t as,
                             int nc, float *out) {
    if (__builtin_expect(nr == 4 && nc == 1, 1)) { /* token generation: the hot shape */
        multi_row_tile(type, n, w, wr, 4, a, as, 1, out);
        return;
    }
    switch (SE_SHAPE(nr, nc)) {
    case SE_SHAPE(2, 1): multi_row_tile(type, n, w, wr, 2, a, as, 1, out); return;
    case SE_SHAPE(2, 2): multi_row_tile(type, n, w, wr, 2, a, as, 2, out); return;
    case SE_SHAPE(2, 3): multi_row_tile(type, n, w, wr, 2, a, as, 3, out); return;
    case SE_SHAPE(2, 4): multi_row_tile(type, n, w, wr, 2, a, as, 4, out); return;
    case SE_SHAPE(1, 1): multi_row_tile(type, n, w, wr, 1, a, as, 1, out); return;
    case SE_SHAPE(1, 2): multi_row_tile(type, n, w, wr, 1, a, as, 2, out); return;
    case SE_SHAPE(1, 3): multi_row_tile(type, n, w, wr, 1, a, as, 3, out); return;
    case SE_SHAPE(1, 4): multi_row_tile(type, n, w, wr, 1, a, as, 4, out); return;
    }
    se_bad_tile_shape("avx512", type, nr, nc);
}

/* The K-quants, whose kernels take a single row: tg_rows 1, pp_rows 1. */
INLINE void k_quant_tile(int type, int64_t n, const uint8_t *w, const uint8_t *a, size_t as, int nc, float *out) {
    if (type == SE_Q4_K || type == SE_Q5_K) q45_K_dotx(type, n, w, a, as, nc, out);
    else k16_dotx(type, n, w, a, as, nc, out);
}
INLINE void k_quant_shapes(int type, int64_t n, const uint8_t *w, int nr, const uint8_t *a, size_t as, int nc,
                           float *out) {
    switch (SE_SHAPE(nr, nc)) {
    case SE_SHAPE(1, 1): k_quant_tile(type, n, w, a, as, 1, out); return;
    case SE_SHAPE(1, 2): k_quant_tile(type, n, w, a, as, 2, out); return;
    case SE_SHAPE(1, 3): k_quant_tile(type, n, w, a, as, 3, out); return;
    case SE_SHAPE(1, 4): k_quant_tile(type, n, w, a, as, 4, out); return;
    }
    se_bad_tile_shape("avx512", type, nr, nc);
}

static void tile_q4_0(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    multi_row_shapes(SE_Q4_0, n, w, wr, nr, a, as, nc, out);
}
static void tile_q4_1(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    multi_row_shapes(SE_Q4_1, n, w, wr, nr, a, as, nc, out);
}
static void tile_q5_0(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    multi_row_shapes(SE_Q5_0, n, w, wr, nr, a, as, nc, out);
}
static void tile_q5_1(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    multi_row_shapes(SE_Q5_1, n, w, wr, nr, a, as, nc, out);
}
static void tile_q8_0(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    multi_row_shapes(SE_Q8_0, n, w, wr, nr, a, as, nc, out);
}
static void tile_f32(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    multi_row_shapes(SE_F32, n, w, wr, nr, a, as, nc, out);
}
static void tile_f16(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    multi_row_shapes(SE_F16, n, w, wr, nr, a, as, nc, out);
}
static void tile_bf16(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    multi_row_shapes(SE_BF16, n, w, wr, nr, a, as, nc, out);
}
/* The one-row tiles have no row stride: they take a single row. */
static void tile_q2_K(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    (void)wr, k_quant_shapes(SE_Q2_K, n, w, nr, a, as, nc, out);
}
static void tile_q3_K(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    (void)wr, k_quant_shapes(SE_Q3_K, n, w, nr, a, as, nc, out);
}
static void tile_q4_K(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    (void)wr, k_quant_shapes(SE_Q4_K, n, w, nr, a, as, nc, out);
}
static void tile_q5_K(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    (void)wr, k_quant_shapes(SE_Q5_K, n, w, nr, a, as, nc, out);
}
static void tile_q6_K(int64_t n, const void *w, size_t wr, int nr, const void *a, size_t as, int nc, float *out) {
    (void)wr, k_quant_shapes(SE_Q6_K, n, w, nr, a, as, nc, out);
}

/* The dots: the 1 x 1 tile of each type. */
static float dot_q4_0(int64_t n, const void *w, const void *a) { float o; multi_row_tile(SE_Q4_0, n, w, 0, 1, a, 0, 1, &o); return o; }
static float dot_q4_1(int64_t n, const void *w, const void *a) { float o; multi_row_tile(SE_Q4_1, n, w, 0, 1, a, 0, 1, &o); return o; }
static float dot_q5_0(int64_t n, const void *w, const void *a) { float o; multi_row_tile(SE_Q5_0, n, w, 0, 1, a, 0, 1, &o); return o; }
static float dot_q5_1(int64_t n, const void *w, const void *a) { float o; multi_row_tile(SE_Q5_1, n, w, 0, 1, a, 0, 1, &o); return o; }
static float dot_q8_0(int64_t n, const void *w, const void *a) { float o; multi_row_tile(SE_Q8_0, n, w, 0, 1, a, 0, 1, &o); return o; }
static float dot_f32(int64_t n, const void *w, const void *a) { float o; multi_row_tile(SE_F32, n, w, 0, 1, a, 0, 1, &o); return o; }
static float dot_f16(int64_t n, const void *w, const void *a) { float o; multi_row_tile(SE_F16, n, w, 0, 1, a, 0, 1, &o); return o; }
static float dot_bf16(int64_t n, const void *w, const void *a) { float o; multi_row_tile(SE_BF16, n, w, 0, 1, a, 0, 1, &o); return o; }
static float dot_q2_K(int64_t n, const void *w, const void *a) { float o; k_quant_tile(SE_Q2_K, n, w, a, 0, 1, &o); return o; }
static float dot_q3_K(int64_t n, const void *w, const void *a) { float o; k_quant_tile(SE_Q3_K, n, w, a, 0, 1, &o); return o; }
static float dot_q4_K(int64_t n, const void *w, const void *a) { float o; k_quant_tile(SE_Q4_K, n, w, a, 0, 1, &o); return o; }
static float dot_q5_K(int64_t n, const void *w, const void *a) { float o; k_quant_tile(SE_Q5_K, n, w, a, 0, 1, &o); return o; }
static float dot_q6_K(int64_t n, const void *w, const void *a) { float o; k_quant_tile(SE_Q6_K, n, w, a, 0, 1, &o); return o; }

const se_isa_kernels se_kernels_avx512[SE_TYPE_COUNT] = {
    [SE_Q4_0] = { .dot = dot_q4_0, .tile = tile_q4_0, .tg_rows = 4, .pp_rows = 2, .gemm = se_avx512_gemm_q4_0, .small = se_avx512_small_q4_0,
                  .panels = se_avx512_packed_gemm, .pack = se_avx512_pack_panels },
    [SE_Q4_1] = { .dot = dot_q4_1, .tile = tile_q4_1, .tg_rows = 4, .pp_rows = 2, .gemm = se_avx512_gemm_q4_1, .small = se_avx512_small_q4_1,
                  .panels = se_avx512_packed_gemm, .pack = se_avx512_pack_panels },
    [SE_Q5_0] = { .dot = dot_q5_0, .tile = tile_q5_0, .tg_rows = 4, .pp_rows = 2, .gemm = se_avx512_gemm_q5_0, .small = se_avx512_small_q5_0 },
    [SE_Q5_1] = { .dot = dot_q5_1, .tile = tile_q5_1, .tg_rows = 4, .pp_rows = 2, .gemm = se_avx512_gemm_q5_1, .small = se_avx512_small_q5_1 },
    [SE_Q8_0] = { .dot = dot_q8_0, .tile = tile_q8_0, .tg_rows = 4, .pp_rows = 2, .gemm = se_avx512_gemm_q8_0, .small = se_avx512_small_q8_0,
                  .panels = se_avx512_packed_gemm, .pack = se_avx512_pack_panels,
                  .from_float = q8_0_from_float },
    [SE_Q2_K] = { .dot = dot_q2_K, .tile = tile_q2_K, .tg_rows = 1, .pp_rows = 1, .gemm = se_avx512_gemm_q2_K, .small = se_avx512_small_q2_K },
    [SE_Q3_K] = { .dot = dot_q3_K, .tile = tile_q3_K, .tg_rows = 1, .pp_rows = 1, .gemm = se_avx512_gemm_q3_K, .small = se_avx512_small_q3_K },
    [SE_Q4_K] = { .dot = dot_q4_K, .tile = tile_q4_K, .tg_rows = 1, .pp_rows = 1, .gemm = se_avx512_gemm_q4_K, .small = se_avx512_small_q4_K },
    [SE_Q5_K] = { .dot = dot_q5_K, .tile = tile_q5_K, .tg_rows = 1, .pp_rows = 1, .gemm = se_avx512_gemm_q5_K, .small = se_avx512_small_q5_K },
    [SE_Q6_K] = { .dot = dot_q6_K, .tile = tile_q6_K, .tg_rows = 1, .pp_rows = 1, .gemm = se_avx512_gemm_q6_K, .small = se_avx512_small_q6_K },
    [SE_F32] = { .dot = dot_f32, .tile = tile_f32, .tg_rows = 4, .pp_rows = 2 },
    [SE_F16] = { .dot = dot_f16, .tile = tile_f16, .tg_rows = 4, .pp_rows = 2 },
    [SE_BF16] = { .dot = dot_bf16, .tile = tile_bf16, .tg_rows = 4, .pp_rows = 2 },
    [SE_Q8_1] = { .from_float = q8_1_from_float },
    [SE_Q8_K] = { .from_float = q8_K_from_float },
};

/* AMX needs the CPU's AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25) and Linux's
 * permission: it keeps the 8 KiB of tile data out of a process's saved state until the process
 * asks (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a tile instruction before that
 * is SIGILL. The permission is the whole process's, so one request serves every thread. */
static int amx_ok;
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static void amx_ask(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) return;
    const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    amx_ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
int se_amx_usable(void) {
    pthread_once(&amx_once, amx_ask);
    return amx_ok;
}

#else
const se_isa_kernels se_kernels_avx512[SE_TYPE_COUNT] = {{0}};
int se_amx_usable(void) { return 0; }
#endif
