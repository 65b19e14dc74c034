/* AVX-512 (F/BW/VL/DQ + VNNI) kernels for batches: the small-batch kernel (2 to
 * se_gemm_min_tokens() - 1 tokens, the steps of batched decoding) and the prompt GEMM on int8
 * panels, with its AMX variant. The ISA, the summation order they keep and the helpers they share
 * with the tiles are in kernels_avx512.h and kernels_avx512.c. */
#define _GNU_SOURCE
#include "kernels_avx512.h"

#if defined(__x86_64__) && defined(__GNUC__)

/* ---------------------------------------------------------------- small batches (blocks in lanes)
 * A step of batched decoding multiplies every weight row by a few tokens (2 to 8). The tiles
 * reduce each (block, token) product vector to one integer per block with shuffles (blocks16_*),
 * and the GEMM transposes 16 rows into a panel: either costs about as much as the products. Here a
 * group of 16 blocks of a row (sub-blocks for the K-quants) is unpacked once and rearranged in
 * registers so that lane p of every vector holds 4 quants of block LANE[p], the block of the
 * summation order's lane p. The activations, rearranged the same way once per matmul, then give
 * each block's exact integer sum in its own lane with plain vpdpbusd accumulation, and the float
 * steps are the tiles' on the same lanes and values: every token's outputs are the tiles' (the
 * dot's) bits. */
#define SB_TOKENS 8 /* tokens per pass over a weight row: their accumulators stay in registers */

/* One token's group of 16 blocks, in lanes. q[v] lane p: quants 4v..4v+3 of block LANE[p] (8
 * vectors for blocks of 32, 4 for blocks of 16 and packed groups (sb_packed); zero for blocks
 * past the row's end); d: the
 * blocks' scale d_a (zero past the end); s: the partner of the weights' min (the types with a
 * min); bias: -offset * sum(quants) (the types stored with an offset), the start of the sum. */
typedef struct {
    __m512i q[8];
    __m512 d, s;
    __m512i bias;
} sb_act;

/* Per 128-bit lane, the 4x4 dwords of v[0..3] transposed: lane L of v[j] becomes dword j of
 * lane L of each input, in input order. */
INLINE void transpose4_lanes(__m512i v[4]) {
    const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
    v[0] = _mm512_unpacklo_epi64(t0, t2), v[1] = _mm512_unpackhi_epi64(t0, t2);
    v[2] = _mm512_unpacklo_epi64(t1, t3), v[3] = _mm512_unpackhi_epi64(t1, t3);
}
/* 16 blocks of 32 in element order (e[k]: block 2k in the lower half, 2k+1 in the upper, as
 * blocks16_32 takes them) -> e[v] lane p: quants 4v..4v+3 of block LANE32[p]. */
INLINE void lanes32(__m512i e[8]) {
    transpose4_lanes(e); /* lane L of e[i]: dword 4L+i of blocks 0,2,4,6 (L < 2) or 1,3,5,7 */
    transpose4_lanes(e + 4);
    for (int i = 0; i < 4; i++) {
        const __m512i a = e[i], b = e[4 + i];
        e[i] = _mm512_shuffle_i32x4(a, b, 0x88);     /* lanes 0, 2 of a, then of b */
        e[4 + i] = _mm512_shuffle_i32x4(a, b, 0xDD); /* lanes 1, 3 */
    }
}
/* 16 blocks of 16 in element order (v[k]: blocks 4k..4k+3, one per 128-bit lane) -> v[j] lane
 * p: quants 4j..4j+3 of block LANE16[p]. */
INLINE void lanes16(__m512i v[4]) { transpose4_lanes(v); }

/* Groups of a row of k elements: 16 legacy blocks, two Q4_K/Q5_K super-blocks, or one super-block
 * of 16 blocks of 16. */
INLINE int64_t sb_groups(int type, int64_t k) {
    const se_type_traits *t = &se_types[type];
    return t->blck == SE_QK ? (k / SE_QK + 15) / 16 : t->sub_blck == 32 ? (k / SE_QK_K + 1) / 2 : k / SE_QK_K;
}
/* The blocks of legacy group g (16 but in a row's last group). */
INLINE int sb_count(int64_t k, int64_t g) { return (int)(k / SE_QK - 16 * g < 16 ? k / SE_QK - 16 * g : 16); }
/* A legacy group of at most 8 blocks (SmolLM2's rows of 18 blocks end with 2, Gemma-3's of 20
 * with 4) is packed: its blocks sit in lanes 0-7 (LANE32), so vector v holds quants 4v..4v+3 in
 * lanes 0-7 and quants 16+4v.. in lanes 8-15, and 4 vectors carry the group; the two halves of
 * the integer sums are added before the float steps. Unpacked, its 8 blocks of padding would cost
 * as much as a whole group. */
INLINE int sb_packed(int type, int64_t k, int64_t g) { return se_types[type].blck == SE_QK && sb_count(k, g) <= 8; }
INLINE int sb_vectors(int type, int packed) { return packed || se_types[type].sub_blck == 16 ? 4 : 8; }
/* Element order (e[j]: blocks 2j, 2j+1, j < 4; blocks 0-7 only) -> packed (above). */
INLINE void lanes32_packed(__m512i e[4]) {
    transpose4_lanes(e); /* lane L of e[i]: dword 4L+i of blocks 0,2,4,6 (L < 2) or 1,3,5,7 */
    for (int i = 0; i < 4; i++) e[i] = _mm512_shuffle_i32x4(e[i], e[i], 0xD8); /* lanes 0, 2, 1, 3 */
}

/* Group g of one activation row (k elements of type's act_type) into lanes. */
INLINE void sb_act_group(int type, int64_t k, const uint8_t *a, int64_t g, sb_act *o) {
    const se_type_traits *t = &se_types[type], *at = &se_types[t->act_type];
    const __m512i zero = _mm512_setzero_si512();
    const int packed = sb_packed(type, k, g), nv = sb_vectors(type, packed);
    __m512i e[8];
    o->bias = zero;
    o->s = _mm512_setzero_ps();
    if (t->blck == SE_QK) {
        const int asz = at->size, cnt = sb_count(k, g);
        const uint8_t *y = a + 16 * g * asz + at->qs_offset;
        for (int j = 0; j < (packed ? 4 : 8); j++) /* zero past the row's end */
            e[j] = 2 * j >= cnt ? zero
                 : 2 * j + 1 >= cnt ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(y + 2 * j * asz)))
                                    : load2x32(y + 2 * j * asz, y + (2 * j + 1) * asz);
        if (packed) lanes32_packed(e);
        else lanes32(e);
        const __m512i h = heads16(a + 16 * g * asz, asz, cnt, packed ? 4 : 8);
        o->d = low_halves(h);
        if (t->has_min) o->s = high_halves(h);
        if (t->q_offset) {
            __m512i sum = zero;
            for (int j = 0; j < nv; j++) sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8((char)t->q_offset), e[j]);
            if (packed) sum = _mm512_add_epi32(sum, _mm512_shuffle_i32x4(sum, sum, 0x4E));
            o->bias = _mm512_sub_epi32(zero, sum);
        }
    } else if (t->sub_blck == 32) {
        const se_blk_q8_K *ya = (const se_blk_q8_K *)a + 2 * g;
        const int two = 2 * g + 1 < k / SE_QK_K;
        const se_blk_q8_K *yb = two ? ya + 1 : ya;
        for (int j = 0; j < 4; j++) {
            e[j] = _mm512_loadu_si512(ya->qs + 64 * j);
            e[4 + j] = two ? _mm512_loadu_si512(yb->qs + 64 * j) : zero;
        }
        lanes32(e);
        q45_act_scales(ya, yb, two, &o->d, &o->s);
    } else {
        const se_blk_q8_K *y = (const se_blk_q8_K *)a + g;
        for (int j = 0; j < 4; j++) e[j] = _mm512_loadu_si512(y->qs + 64 * j);
        lanes16(e);
        const __m512i bs = _mm512_permutexvar_epi32(_mm512_loadu_si512(LANE16),
                                                    _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)y->bsums)));
        o->d = _mm512_set1_ps(y->d);
        if (t->has_min) o->s = _mm512_mul_ps(o->d, _mm512_cvtepi32_ps(bs));
        if (t->q_offset) o->bias = _mm512_sub_epi32(zero, _mm512_slli_epi32(bs, __builtin_ctz((unsigned)t->q_offset)));
    }
    for (int j = 0; j < nv; j++) o->q[j] = e[j];
}

/* The quants of a legacy group of Q4_0/Q4_1/Q5_0/Q5_1 in lanes, straight from the packed bytes:
 * z[m] lane L holds the 16 bytes of block LANE32[4L + m], so that after the transpose z[j] lane p
 * holds bytes 4j..4j+3 of block LANE32[p]: quants 4j.. (low nibbles) and 16+4j.. (high
 * nibbles). Packed (cnt <= 8), both halves of z[m] hold blocks LANE32[4L + m] for L < 2, and
 * vector j takes its low nibbles in lanes 0-7 and its high ones in lanes 8-15. */
INLINE void sb_nibbles(int type, const uint8_t *b, int cnt, int packed, __m512i q[8]) {
    const se_type_traits *t = &se_types[type];
    const int ws = t->size;
#define B(i) (const __m128i *)(b + ((i) < cnt ? (i) : cnt - 1) * ws + t->qs_offset) /* past the end: the last again */
    __m512i z[4];
    for (int m = 0; m < 4; m++) {
        const __m256i lo = _mm256_loadu2_m128i(B(2 * m + 1), B(2 * m));
        z[m] = packed ? _mm512_broadcast_i64x4(lo) : _mm512_inserti64x4(_mm512_castsi256_si512(lo), _mm256_loadu2_m128i(B(2 * m + 9), B(2 * m + 8)), 1);
    }
#undef B
    transpose4_lanes(z);
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i up = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1); /* packed: high nibbles up */
    for (int j = 0; j < 4; j++) {
        if (packed) {
            q[j] = _mm512_and_si512(_mm512_srlv_epi16(z[j], up), m4);
        } else {
            q[j] = _mm512_and_si512(z[j], m4);
            q[4 + j] = _mm512_and_si512(_mm512_srli_epi16(z[j], 4), m4);
        }
    }
    if (t->qh_offset) { /* the fifth bit of quant e is bit e of the block's qh */
        __m512i qh = packed ? heads16(b + t->qh_offset, ws, cnt, 4) : heads16(b + t->qh_offset, ws, cnt, 8);
        if (packed) qh = _mm512_shuffle_i32x4(qh, qh, 0x44); /* blocks of lanes 0-7 in both halves */
        for (int j = 0; j < (packed ? 4 : 8); j++) {
            /* byte n of each lane takes bit e = 4j+n (+16 in a packed upper half): bit e%8 of byte e/8 */
            const int e0 = 4 * j;
            __m512i byte = _mm512_set1_epi8((char)(e0 / 8));
            if (packed) byte = _mm512_add_epi8(byte, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi8(2), 1));
            const __m512i spread = _mm512_shuffle_epi8(qh, _mm512_add_epi8(_mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0), byte));
            const __mmask64 hi = _mm512_test_epi8_mask(spread, _mm512_set1_epi32((int)(0x08040201u << (e0 % 8))));
            q[j] = _mm512_mask_add_epi8(q[j], hi, q[j], _mm512_set1_epi8(16));
        }
    }
}

/* Group g of one weight row into lanes (packed: sb_packed's, a constant once inlined): its quants
 * q, scales wd and mins wm (the tiles' values: blocks past the row's end get zero scales). */
INLINE void sb_weight_group(int type, const int packed, int64_t k, const uint8_t *x, int64_t g, __m512i q[8], __m512 *wd,
                            __m512 *wm) {
    const se_type_traits *t = &se_types[type];
    if (t->blck == SE_QK) {
        const int ws = t->size, cnt = sb_count(k, g);
        const uint8_t *b = x + 16 * g * ws;
        if (type == SE_Q8_0) {
            for (int j = 0; j < (packed ? 4 : 8); j++)
                q[j] = unpack2(type, b + (2 * j < cnt ? 2 * j : cnt - 1) * ws, b + (2 * j + 1 < cnt ? 2 * j + 1 : cnt - 1) * ws);
            if (packed) lanes32_packed(q);
            else lanes32(q);
        } else {
            sb_nibbles(type, b, cnt, packed, q);
        }
        const __m512i h = packed ? heads16(b, ws, cnt, 4) : heads16(b, ws, cnt, 8); /* a constant nv: fewer loads */
        *wd = low_halves(h), *wm = high_halves(h);
    } else if (t->sub_blck == 32) {
        const int two = 2 * g + 1 < k / SE_QK_K;
        const uint8_t *xa = x + 2 * g * t->size, *xb = two ? xa + t->size : xa;
        unpack_q45_K(type, xa, q);
        unpack_q45_K(type, xb, q + 4);
        lanes32(q);
        q45_scales(xa, xb, two, wd, wm);
    } else {
        k16_block b;
        unpack_k16(type, x + g * t->size, &b);
        lanes16(b.q);
        for (int j = 0; j < 4; j++) q[j] = b.q[j];
        k16_scales(type, &b, wd, wm);
    }
}

/* Group g of one weight row x nt tokens, added to acc[c] (nt and packed: constants once inlined,
 * so that the loops unroll and the accumulators stay in registers). */
INLINE void sb_group(int type, const int nt, const int packed, int64_t k, const uint8_t *x, int64_t g,
                     const sb_act *side, int64_t ng, __m512 *acc) {
    const se_type_traits *t = &se_types[type];
    const int nv = sb_vectors(type, packed);
    __m512i q[8];
    __m512 wd, wm;
    sb_weight_group(type, packed, k, x, g, q, &wd, &wm);
#pragma GCC unroll 8
    for (int c = 0; c < nt; c++) {
        const sb_act *s = side + c * ng + g;
        /* two chains for the adds' latency: integer sums, exact in any order */
        __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < nv; j += 2) {
            i0 = _mm512_dpbusd_epi32(i0, q[j], s->q[j]);
            i1 = _mm512_dpbusd_epi32(i1, q[j + 1], s->q[j + 1]);
        }
        __m512i isum = _mm512_add_epi32(i0, i1);
        if (packed) isum = _mm512_add_epi32(isum, _mm512_shuffle_i32x4(isum, isum, 0x4E));
        if (t->q_offset) isum = _mm512_add_epi32(isum, s->bias);
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(wd, s->d), acc[c]);
        if (t->has_min) acc[c] = _mm512_fmadd_ps(wm, s->s, acc[c]);
    }
}

/* A short last group of at most 4 blocks (SmolLM2's rows of 18 blocks end with 2, Gemma-3's
 * legacy rows of 20 with 4), for the tokens of a pass at once. Packed per token (sb_group), it
 * costs 4 vpdpbusd and the float steps on whole vectors a token, for 1 to 4 useful lanes. Here T
 * tokens share one set of lanes: lane i*S + b is block b of the set's token i (S = 2 or 4 lanes a
 * token, T = 16/S tokens a set). 8 vpdpbusd give the set's block sums; the tokens' accumulator
 * lanes of those blocks (block b in LANE32's lane TAIL_LANE[b]) are gathered into one vector,
 * take a packed group's float steps there (the same operations on the same values: the same
 * bits) and go back. The other lanes, which a packed group adds +-0 to (their scales are zero;
 * a sum that starts at +0 is never -0, so that leaves it), are left as they are. In process, a
 * step of 8 SmolLM2 sequences ran about 4% faster (Zen 4; one thread in cache, 576-long Q4_1 rows
 * at 8 tokens: 65 -> 74 GMAC/s). */
#define TAIL_MAX 4
static const int TAIL_LANE[TAIL_MAX] = { 0, 4, 1, 5 };
/* [S == 4], lane l holding block l % S: TAIL_HOME, the set's lane to put back at a token's lane
 * of block b; TAIL_PAIR, where two tokens' lanes come from (the odd token's: 16 + ...); TAIL_BLOCK,
 * the block; TAIL_QUAD, its first dword among unpack2's (two blocks of 8 dwords a vector). */
static const int32_t TAIL_HOME[2][16] = { { 0, 0, 0, 0, 1 }, { 0, 2, 0, 0, 1, 3 } };
static const int32_t TAIL_PAIR[2][16] = { { 0, 4, 16, 20, 0, 4, 16, 20, 0, 4, 16, 20, 0, 4, 16, 20 },
                                          { 0, 4, 1, 5, 16, 20, 17, 21, 0, 4, 1, 5, 16, 20, 17, 21 } };
static const int32_t TAIL_BLOCK[2][16] = { { 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1 },
                                           { 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3 } };
static const int32_t TAIL_QUAD[2][16] = { { 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8 },
                                          { 0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24, 0, 8, 16, 24 } };
static const __mmask16 TAIL_LANES[2] = { 0x11, 0x33 }; /* a token's lanes of blocks 0..S-1 */
typedef struct {
    __m512i q[8];  /* q[v] lane i*S + b: quants 4v..4v+3 of block b of the set's token i (zero past the end) */
    __m512 d, s;   /* the tokens' sb_act d and s of those blocks, in the set's lanes */
    __m512i bias;  /* and bias */
} sb_tail;

/* The blocks in a legacy row's short last group, 0 if it has none (a K-quant, or more than 4). */
INLINE int sb_tail_count(int type, int64_t k) {
    if (se_types[type].blck != SE_QK) return 0;
    const int cnt = sb_count(k, sb_groups(type, k) - 1);
    return cnt <= TAIL_MAX ? cnt : 0;
}
INLINE int tail_stride(int cnt) { return cnt <= 2 ? 2 : 4; }

/* The activations' sets of the last group's cnt blocks, T tokens a set, from n_tok rows and
 * their groups side[c * ng + g]. */
static void sb_tail_sets(int type, int64_t k, int cnt, const uint8_t *act, size_t arow, int n_tok, const sb_act *side,
                         int64_t ng, sb_tail *o) {
    const se_type_traits *at = &se_types[se_types[type].act_type];
    const int S = tail_stride(cnt), T = 16 / S;
    const int64_t first = k / SE_QK - cnt;
    for (int set = 0; set * T < n_tok; set++) {
        int32_t q[8][16] = { { 0 } }, bias[16] = { 0 };
        float d[16] = { 0 }, sm[16] = { 0 };
        for (int i = 0; i < T && set * T + i < n_tok; i++) {
            const int c = set * T + i;
            const sb_act *a = side + c * ng + ng - 1;
            for (int b = 0; b < cnt; b++) {
                const int l = i * S + b, p = TAIL_LANE[b];
                const uint8_t *y = act + (size_t)c * arow + (first + b) * at->size + at->qs_offset;
                for (int v = 0; v < 8; v++) memcpy(&q[v][l], y + 4 * v, 4);
                d[l] = ((const float *)&a->d)[p], sm[l] = ((const float *)&a->s)[p];
                bias[l] = ((const int32_t *)&a->bias)[p];
            }
        }
        for (int v = 0; v < 8; v++) o[set].q[v] = _mm512_loadu_si512(q[v]);
        o[set].d = _mm512_loadu_ps(d), o[set].s = _mm512_loadu_ps(sm), o[set].bias = _mm512_loadu_si512(bias);
    }
}

/* The last group g (packed) of one weight row x nt tokens, S lanes a token (nt and S: constants
 * once inlined), added to acc[c] as sb_group adds a packed group. */
INLINE void sb_tail_group(int type, const int nt, const int S, int64_t k, const uint8_t *x, int64_t g,
                          const sb_tail *tails, __m512 *acc) {
    const se_type_traits *t = &se_types[type];
    const int T = 16 / S, ws = t->size, cnt = sb_count(k, g);
    /* the weights' blocks in every token's lanes: from their quants as bytes (unpack2: dword v of
     * block b at 8b + v), and their scales (past cnt: zero, as in a packed group) */
    const uint8_t *xb = x + 16 * g * ws;
#define BLK(b) (xb + ((b) < cnt ? (b) : cnt - 1) * ws)
    const __m512i u01 = unpack2(type, BLK(0), BLK(1)), u23 = S == 4 ? unpack2(type, BLK(2), BLK(3)) : u01;
    const __m512i quad = _mm512_loadu_si512(TAIL_QUAD[S == 4]);
    __m512i w[8];
    for (int v = 0; v < 8; v++) w[v] = _mm512_permutex2var_epi32(u01, _mm512_add_epi32(quad, _mm512_set1_epi32(v)), u23);
    const __m512i h = _mm512_zextsi128_si512(_mm_setr_epi32(cnt > 0 ? (int)ld32(BLK(0)) : 0, cnt > 1 ? (int)ld32(BLK(1)) : 0,
                                                            cnt > 2 ? (int)ld32(BLK(2)) : 0, cnt > 3 ? (int)ld32(BLK(3)) : 0));
#undef BLK
    const __m512i block = _mm512_loadu_si512(TAIL_BLOCK[S == 4]);
    const __m512i home = _mm512_loadu_si512(TAIL_HOME[S == 4]), pair = _mm512_loadu_si512(TAIL_PAIR[S == 4]);
    const __m512 wd_set = _mm512_permutexvar_ps(block, low_halves(h)), wm_set = _mm512_permutexvar_ps(block, high_halves(h));
#pragma GCC unroll 4
    for (int set = 0; set * T < nt; set++) {
        const sb_tail *a = tails + set;
        __m512i i0 = _mm512_setzero_si512(), i1 = _mm512_setzero_si512();
        for (int v = 0; v < 8; v += 2) {
            i0 = _mm512_dpbusd_epi32(i0, w[v], a->q[v]);
            i1 = _mm512_dpbusd_epi32(i1, w[v + 1], a->q[v + 1]);
        }
        __m512i isum = _mm512_add_epi32(i0, i1);
        if (t->q_offset) isum = _mm512_add_epi32(isum, a->bias);
        /* the tokens' lanes, two tokens (2S lanes) a permute */
        __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int i = 0; i < T; i += 2)
            if (set * T + i < nt) {
                const __m512 a0 = acc[set * T + i], a1 = set * T + i + 1 < nt ? acc[set * T + i + 1] : a0;
                sum = _mm512_mask_mov_ps(sum, (__mmask16)(((1u << 2 * S) - 1) << (i * S)), _mm512_permutex2var_ps(a0, pair, a1));
            }
        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(wd_set, a->d), sum);
        if (t->has_min) sum = _mm512_fmadd_ps(wm_set, a->s, sum);
#pragma GCC unroll 8
        for (int i = 0; i < T; i++)
            if (set * T + i < nt)
                acc[set * T + i] = _mm512_mask_permutexvar_ps(acc[set * T + i], TAIL_LANES[S == 4],
                                                              _mm512_add_epi32(home, _mm512_set1_epi32(i * S)), sum);
    }
}

/* One weight row x nt tokens: out[c * ldy], from the tokens' groups side[c * ng + g]. */
INLINE void sb_row(int type, const int nt, int64_t k, const uint8_t *x, const sb_act *side, int64_t ng, int tail,
                   const sb_tail *tails, float *out, int64_t ldy) {
    __m512 acc[SB_TOKENS];
#pragma GCC unroll 8
    for (int c = 0; c < nt; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t g = 0; g < (tail ? ng - 1 : ng); g++) {
        if (sb_packed(type, k, g)) sb_group(type, nt, 1, k, x, g, side, ng, acc);
        else sb_group(type, nt, 0, k, x, g, side, ng, acc);
    }
    if (tail) {
        if (tail_stride(tail) == 2) sb_tail_group(type, nt, 2, k, x, ng - 1, tails, acc);
        else sb_tail_group(type, nt, 4, k, x, ng - 1, tails, acc);
    }
    hsum_tiles_column(acc, nt, out, ldy);
}

/* se_matmul for a few tokens (se_gemm_fn's contract): the activations into lanes once, then each
 * weight row (the one-token path's prefetch ahead of it) against SB_TOKENS tokens at a time. */
INLINE int small_batch(int type, int64_t k, const void *W, size_t wrow, const void *act, size_t arow, int n_tok,
                       float *y, int64_t ldy, int64_t r0, int64_t r1) {
    const int64_t ng = sb_groups(type, k);
    const int tail = sb_tail_count(type, k), per_set = 16 / tail_stride(tail);
    const size_t n_side = (size_t)n_tok * (size_t)ng, n_sets = tail ? (size_t)(n_tok + per_set - 1) / per_set : 0;
    sb_act *side = se_thread_scratch(n_side * sizeof(sb_act) + n_sets * sizeof(sb_tail));
    if (!side) return -1;
    sb_tail *tails = (sb_tail *)(side + n_side);
    for (int c = 0; c < n_tok; c++)
        for (int64_t g = 0; g < ng; g++) sb_act_group(type, k, (const uint8_t *)act + (size_t)c * arow, g, side + c * ng + g);
    if (tail) sb_tail_sets(type, k, tail, act, arow, n_tok, side, ng, tails);
    const int64_t ahead = (int64_t)(SE_PREFETCH_BYTES / wrow) + 1;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *x = (const uint8_t *)W + (size_t)r * wrow;
        if (r + ahead < r1)
            for (size_t o = 0; o < wrow; o += 64) __builtin_prefetch(x + (size_t)ahead * wrow + o);
        for (int c0 = 0; c0 < n_tok; c0 += SB_TOKENS) {
            const int nt = n_tok - c0 < SB_TOKENS ? n_tok - c0 : SB_TOKENS;
            const sb_act *s = side + c0 * ng;
            const sb_tail *ts = tails + c0 / per_set;
            float *out = y + c0 * ldy + r;
            switch (nt) { /* a constant token count for each: the loops over tokens unroll */
            case 1: sb_row(type, 1, k, x, s, ng, tail, ts, out, ldy); break;
            case 2: sb_row(type, 2, k, x, s, ng, tail, ts, out, ldy); break;
            case 3: sb_row(type, 3, k, x, s, ng, tail, ts, out, ldy); break;
            case 4: sb_row(type, 4, k, x, s, ng, tail, ts, out, ldy); break;
            case 5: sb_row(type, 5, k, x, s, ng, tail, ts, out, ldy); break;
            case 6: sb_row(type, 6, k, x, s, ng, tail, ts, out, ldy); break;
            case 7: sb_row(type, 7, k, x, s, ng, tail, ts, out, ldy); break;
            default: sb_row(type, 8, k, x, s, ng, tail, ts, out, ldy); break;
            }
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- prompt GEMM on int8 panels
 * For a batch of tokens, every 16 weight rows are unpacked once into a panel: per block of BLK
 * quants (32; 16 for Q2_K, Q3_K and Q6_K, whose scales change every 16), BLK/4 vectors whose lane r holds 4
 * consecutive quants of row r as unsigned bytes, then the 16 rows' float scales d and mins m.
 * One vpdpbusd multiplies 4 quants of 16 rows by 4 activations of one token (broadcast), so a
 * block costs BLK/4 vpdpbusd and 3 or 4 float operations per token for 16 rows, and no
 * horizontal sums. The panel is reused by every token of the batch.
 *
 * Per token and block, the activation side gives its scale d and either the sum term s of a type
 * with a min (the block adds m*s) or, for a type stored with an offset (q - offset), the exact
 * integer correction -offset*sum(q) that starts the block's dot. Every output sums its blocks in
 * order with the same operations whatever the batch, so a token's results do not depend on the
 * other tokens (nor on the row range), and they are the tiles' bit for bit (the summation order
 * of kernels_avx512.c).
 */
#define PANEL_ROWS 16
#define GEMM_STREAM_TOKENS 32 /* batches below this size prefetch the weights (gemm) */
typedef struct { float d; union { float s; int32_t bias; }; } side_t;

/* How a weight type maps onto panels (from its row of se_types). */
typedef struct {
    int blk;    /* quants per panel block: the elements per scale, 32 or 16 */
    int group;  /* quants unpacked at once per row: two legacy blocks, or one super-block */
    int offset; /* stored quants are weight + offset (0 for the types with a min) */
    int min;    /* has a min: blocks add m*s */
    int act;    /* the activations' type */
} panel_shape;

INLINE panel_shape shape_of(int type) {
    const se_type_traits *t = &se_types[type];
    return (panel_shape){ .blk = t->sub_blck, .group = t->blck == SE_QK_K ? SE_QK_K : 2 * t->blck,
                          .offset = t->q_offset, .min = t->has_min, .act = t->act_type };
}

/* Super-block g of one K-quant row: its 256 quants as unsigned bytes in element order, and each
 * BLK-block's scale d and min m (exact products of the stored scales). Returns the number of
 * quants. (The legacy types' panels are build_panel_legacy's.) */
INLINE int unpack_group(int type, const uint8_t *row, int64_t g, uint8_t *q, float *d, float *m) {
    const se_type_traits *t = &se_types[type];
    if (type == SE_Q4_K || type == SE_Q5_K) {
        const uint8_t *x = row + g * t->size;
        __m512i v[4];
        unpack_q45_K(type, x, v);
        for (int j = 0; j < 4; j++) _mm512_storeu_si512(q + 64 * j, v[j]);
        uint64_t sc, mn;
        scales_mins_k4(x + offsetof(se_blk_q4_K, scales), &sc, &mn);
        for (int j = 0; j < 8; j++) {
            d[j] = h2f(x + offsetof(se_blk_q4_K, d)) * (float)(uint8_t)(sc >> 8 * j);
            m[j] = -h2f(x + offsetof(se_blk_q4_K, dmin)) * (float)(uint8_t)(mn >> 8 * j);
        }
        return 256;
    }
    k16_block b; /* Q2_K, Q3_K, Q6_K */
    unpack_k16(type, row + g * t->size, &b);
    for (int j = 0; j < 4; j++) _mm512_storeu_si512(q + 64 * j, b.q[j]);
    for (int j = 0; j < 16; j++) d[j] = b.d * (float)b.sc[j], m[j] = t->has_min ? -b.dmin * (float)b.mn[j] : 0;
    return 256;
}

/* The 16 x 16 dwords of v transposed in place: v[j] becomes dword j of every input vector. */
INLINE void transpose16(__m512i v[16]) {
    __m512i t[16];
    for (int k = 0; k < 8; k++) { /* per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3] */
        t[2 * k] = _mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) { /* u[4k + m], lane L: dword 4L + m of rows 4k..4k+3 */
        v[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        v[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        v[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        v[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int m = 0; m < 4; m++) { /* gather lane L of u[m], u[4+m], u[8+m], u[12+m] */
        const __m512i a = _mm512_shuffle_i32x4(v[m], v[4 + m], 0x88), b = _mm512_shuffle_i32x4(v[m], v[4 + m], 0xDD);
        const __m512i c = _mm512_shuffle_i32x4(v[8 + m], v[12 + m], 0x88);
        const __m512i d = _mm512_shuffle_i32x4(v[8 + m], v[12 + m], 0xDD);
        t[m] = _mm512_shuffle_i32x4(a, c, 0x88);
        t[8 + m] = _mm512_shuffle_i32x4(a, c, 0xDD);
        t[4 + m] = _mm512_shuffle_i32x4(b, d, 0x88);
        t[12 + m] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
    for (int j = 0; j < 16; j++) v[j] = t[j];
}

/* build_panel for the legacy types: a group (two blocks, 64 quants) of a row is one vector, so
 * the 16 rows' vectors are transposed in registers, and each block's 16 scales d (and mins m)
 * are one gather of the blocks' first 4 bytes. The panel is build_panel's, byte for byte. With a
 * few tokens (batched decoding) the panel costs as much as the products: this halves it. */
INLINE void build_panel_legacy(int type, const uint8_t *w, size_t wrow, int nr, int64_t n, uint8_t *panel) {
    const size_t bsz = (size_t)SE_QK * PANEL_ROWS + 2 * PANEL_ROWS * sizeof(float);
    const int ws = se_types[type].size, has_min = se_types[type].has_min;
    const int64_t nb = n / SE_QK;
    const __m512i rows_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32((int)wrow));
    const __mmask16 rows = (__mmask16)((1u << nr) - 1);
    for (int64_t g = 0; g < (nb + 1) / 2; g++) {
        const int two = 2 * g + 1 < nb; /* a short last group has one block */
        __m512i v[PANEL_ROWS];
        for (int r = 0; r < PANEL_ROWS; r++) {
            const uint8_t *b0 = w + r * wrow + 2 * g * ws;
            v[r] = r < nr ? unpack2(type, b0, two ? b0 + ws : b0) : _mm512_setzero_si512();
        }
        transpose16(v); /* v[j]: quants 4j..4j+3 of every row */
        uint8_t *first = panel + (size_t)(2 * g) * bsz;
        for (int j = 0; j < (two ? 16 : 8); j++) _mm512_store_si512(first + (size_t)(j / 8) * bsz + (size_t)(j % 8) * 64, v[j]);
        for (int b = 0; b <= two; b++) {
            const __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, rows_at, w + (2 * g + b) * ws, 1);
            float *d = (float *)(first + (size_t)b * bsz + SE_QK * PANEL_ROWS);
            _mm512_store_ps(d, low_halves(h));
            _mm512_store_ps(d + PANEL_ROWS, has_min ? high_halves(h) : _mm512_setzero_ps());
        }
    }
}

/* Rows [0, nr) of W (nr <= 16; the rest of the panel is zero) into panel blocks of sh.blk. */
INLINE void build_panel(int type, panel_shape sh, const uint8_t *w, size_t wrow, int nr, int64_t n, uint8_t *panel) {
    if (se_types[type].blck == SE_QK) {
        build_panel_legacy(type, w, wrow, nr, n, panel);
        return;
    }
    const size_t bsz = (size_t)sh.blk * PANEL_ROWS + 2 * PANEL_ROWS * sizeof(float);
    uint8_t q[PANEL_ROWS][256] __attribute__((aligned(64)));
    /* 16 scales a row (Q4_K and Q5_K fill 8), as vectors to transpose; the rest stays zero */
    float d[PANEL_ROWS][16] __attribute__((aligned(64))) = {{0}}, m[PANEL_ROWS][16] __attribute__((aligned(64))) = {{0}};
    for (int64_t g = 0; g < (n + sh.group - 1) / sh.group; g++) {
        int len = 0;
        for (int r = 0; r < PANEL_ROWS; r++) {
            if (r < nr) {
                len = unpack_group(type, w + r * wrow, g, q[r], d[r], m[r]);
            } else {
                memset(q[r], 0, sizeof q[r]);
                memset(d[r], 0, sizeof d[r]);
                memset(m[r], 0, sizeof m[r]);
            }
        }
        uint8_t *first = panel + (size_t)(g * (sh.group / sh.blk)) * bsz; /* this group's first block */
        for (int c = 0; c < len; c += 64) { /* 64 quants of the 16 rows at a time */
            __m512i v[PANEL_ROWS];
            for (int r = 0; r < PANEL_ROWS; r++) v[r] = _mm512_load_si512(q[r] + c);
            transpose16(v);
            for (int j = 0; j < 16 && c + 4 * j < len; j++) { /* v[j]: quants c+4j..c+4j+3 */
                const int e = c + 4 * j;
                _mm512_store_si512(first + (size_t)(e / sh.blk) * bsz + (size_t)(e % sh.blk / 4) * 64, v[j]);
            }
        }
        for (int k = 0; k < 2; k++) { /* the scales d, then the mins m: vector s = block s's of every row */
            __m512i v[PANEL_ROWS];
            for (int r = 0; r < PANEL_ROWS; r++) v[r] = _mm512_load_si512(k ? m[r] : d[r]);
            transpose16(v);
            for (int s = 0; s < len / sh.blk; s++)
                _mm512_store_si512(first + (size_t)s * bsz + sh.blk * PANEL_ROWS + k * PANEL_ROWS * sizeof(float), v[s]);
        }
    }
}

/* Each token's side (see above) and where each block's quants start in an activation row. The
 * loops walk activation blocks and the panel blocks in each (per of them), with no division: it
 * runs at every kernel call. */
static void build_side(panel_shape sh, int64_t nb, const uint8_t *a, size_t arow, int n_tok,
                       side_t *side, int32_t *qoff) {
    const se_type_traits *at = &se_types[sh.act];
    const int act = sh.act, asz = at->size;
    const int per = at->blck / sh.blk; /* panel blocks per activation block */
    const int64_t nab = nb / per;
    for (int64_t ab = 0, b = 0; ab < nab; ab++)
        for (int j = 0; j < per; j++, b++) qoff[b] = (int32_t)(ab * asz + at->qs_offset + j * sh.blk);
    for (int t = 0; t < n_tok; t++) {
        const uint8_t *blk = a + (size_t)t * arow;
        side_t *st = side + (size_t)t * nb;
        for (int64_t ab = 0; ab < nab; ab++, blk += asz) {
            if (act == SE_Q8_K) {
                const se_blk_q8_K *k8 = (const se_blk_q8_K *)blk;
                for (int j = 0; j < per; j++, st++) {
                    st->d = k8->d;
                    /* the activations' sum over the block: one bsum of 16, or two */
                    const int bsum = sh.blk == 16 ? k8->bsums[j] : k8->bsums[2 * j] + k8->bsums[2 * j + 1];
                    if (sh.min) st->s = k8->d * (float)bsum;
                    else st->bias = -sh.offset * bsum;
                }
                continue;
            }
            /* Q8_0 and Q8_1 (blocks of 32, per 1): d first, Q8_1 s after it */
            st->d = h2f(blk);
            if (sh.min) {
                st->s = h2f(blk + offsetof(se_blk_q8_1, s));
            } else {
                int sum = 0;
                for (int i = 0; i < SE_QK; i++) sum += (int8_t)blk[at->qs_offset + i];
                st->bias = -sh.offset * sum;
            }
            st++;
        }
    }
}

/* ---------------------------------------------------------------- AMX: the GEMM's integer sums
 * TDPBSUD (signed bytes x unsigned bytes -> int32, no saturation) computes every panel block's
 * integer dots for up to 16 tokens x 16 rows in one instruction: tile A = the tokens' quants of
 * the block (copied once per call into whole rows, amx_pack); tile B = the panel block
 * as it is (BLK/4 rows of 64 bytes, row j = quants 4j..4j+3 of the 16 weight rows: the layout
 * TDPBSUD wants); C[t][r] = the exact dot. The float part is the vpdpbusd path's (gemm_chain). */
#define AMX_TOKENS 16                           /* rows of a tile: tokens per TDPBSUD */
#define AMX_DOTS (AMX_TOKENS * PANEL_ROWS)       /* int32 sums per panel block (one C tile) */
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,amx-tile,amx-int8")
/* ldtilecfg's 64 bytes (palette 1) */
typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } amx_config;

/* Tiles 0 and 2: A (tokens x BLK bytes), 1 and 3: B (BLK/4 x 64 bytes), 4 to 7: C (tokens x 16
 * int32). The configuration is the calling thread's; each GEMM call sets
 * it (ldtilecfg), so that nothing depends on what the thread ran before, and at its end puts back
 * what the thread had (amx_restore). */
static __attribute__((noinline)) void amx_configure(int tokens, int blk) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 2; i++) { /* A and B, twice */
        c.rows[2 * i] = (uint8_t)tokens, c.colsb[2 * i] = (uint16_t)blk;
        c.rows[2 * i + 1] = (uint8_t)(blk / 4), c.colsb[2 * i + 1] = 64;
    }
    for (int i = 4; i < 8; i++) c.rows[i] = (uint8_t)tokens, c.colsb[i] = 64; /* C, four times */
    /* ldtilecfg written here: gcc 12's _tile_loadconfig tells the compiler that it reads 8 bytes,
     * and the stores of the other 56 are then dropped as dead (a #GP, SIGSEGV, at run time) */
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
}

/* Every block's sums for one group of tokens: dots + b * AMX_DOTS, row t (64 bytes) = token t's
 * sums for the panel's 16 rows. tok: the group's quants, block b's at tok + b * tokens * blk
 * (amx_pack). Not inlined: the call orders the tile instructions (whose asm tells the compiler
 * nothing of the memory they read) after the stores of the panel and before gemm_chain's loads. */
static __attribute__((noinline)) void amx_dots(int blk, int tokens, const uint8_t *panel, int64_t nb,
                                               const uint8_t *tok, int32_t *dots) {
    const size_t bsz = (size_t)blk * PANEL_ROWS + 2 * PANEL_ROWS * sizeof(float), asz = (size_t)tokens * blk;
    /* four blocks in flight: a C tile is zeroed, multiplied into and stored, one after the other;
     * with two, this loop took about 50 ns a block against 38 (one profile each, loaded machine) */
#define AMX_BLOCK(A, B, C, b)                                    \
    _tile_loadd(A, tok + (size_t)(b) * asz, blk);                \
    _tile_loadd(B, panel + (size_t)(b) * bsz, 64);               \
    _tile_zero(C);                                               \
    _tile_dpbsud(C, A, B)
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        AMX_BLOCK(0, 1, 4, b);
        AMX_BLOCK(2, 3, 5, b + 1);
        _tile_stored(4, dots + (size_t)b * AMX_DOTS, 64);
        AMX_BLOCK(0, 1, 6, b + 2);
        _tile_stored(5, dots + (size_t)(b + 1) * AMX_DOTS, 64);
        AMX_BLOCK(2, 3, 7, b + 3);
        _tile_stored(6, dots + (size_t)(b + 2) * AMX_DOTS, 64);
        _tile_stored(7, dots + (size_t)(b + 3) * AMX_DOTS, 64);
    }
    for (; b < nb; b++) {
        AMX_BLOCK(0, 1, 4, b);
        _tile_stored(4, dots + (size_t)b * AMX_DOTS, 64);
    }
#undef AMX_BLOCK
}

/* The thread's tile configuration before a GEMM (all zero when it had none), and back to it after:
 * another library in the process may have configured this thread's tiles once and rely on it
 * (llama.cpp's AMX matmul does, per thread: with the tiles released under it, its next tileloadd
 * raised SIGILL when both engines ran in one process). Its tile data is not kept, nor relied on:
 * a kernel loads its tiles each call. With no configuration to put back, the tiles are released
 * (the kernel then has no tile data to save on a context switch). */
static __attribute__((noinline)) void amx_save(amx_config *c) { __asm__ volatile("sttilecfg %0" : "=m"(*c)); }
static __attribute__((noinline)) void amx_restore(const amx_config *c) {
    if (c->palette) __asm__ volatile("ldtilecfg %0" ::"m"(*c));
    else _tile_release();
}

/* The machine probe's AMX figure (probe.c): iters rounds of four independent TDPBSUD, each 16 x 16
 * int32 sums of 64 byte products (16384 MACs), on tiles loaded once; the thread's tile
 * configuration is put back after. Returns the MACs done. Only where se_amx_usable(). */
uint64_t se_amx_probe_macs(int64_t iters) {
    static const uint8_t zero[16 * 64] __attribute__((aligned(64)));
    amx_config saved;
    amx_save(&saved);
    amx_configure(16, 64);
    _tile_loadd(0, zero, 64);
    _tile_loadd(1, zero, 64);
    _tile_loadd(2, zero, 64);
    _tile_loadd(3, zero, 64);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t i = 0; i < iters; i++) {
        _tile_dpbsud(4, 0, 1);
        _tile_dpbsud(5, 2, 3);
        _tile_dpbsud(6, 0, 3);
        _tile_dpbsud(7, 2, 1);
    }
    amx_restore(&saved);
    return (uint64_t)iters * 4 * 16 * 16 * 64;
}
#pragma GCC pop_options

/* ---------------------------------------------------------------- packed panels
 * A step of batched decoding spends about half of the GEMM's time building its panels, and the
 * small-batch kernel as long rearranging its blocks (one thread, 8 tokens, 576-long rows: the
 * GEMM on panels built once ran at 120 GMAC/s, against 73 for either). So where batches are
 * served, the legacy types whose quants are whole nibbles or bytes keep a copy of their
 * weights packed once (se_avx512_pack_panels), in the panels' order but no larger than the rows:
 * 16 rows a panel, the panel of rows r.. at byte r * row size, and per block
 *   Q4_0, Q4_1: 4 vectors, lane i of vector j holding bytes 4j..4j+3 of row i's quants (quants
 *               4j.. in the low nibbles, 16+4j.. in the high ones), then the 16 rows' fp16 d
 *               (and Q4_1's fp16 m);
 *   Q8_0: 8 vectors, lane i of vector j holding quants 4j..4j+3 of row i plus 128 (unsigned, as
 *         the panels keep them), then the 16 fp16 d.
 * Rows past a matrix's end are zeros. The kernel is the GEMM's with the block loaded from there:
 * the same integers, scales and float operations, so the same bits. From memory, 576-long rows
 * (one thread, Zen 4): Q4_1 at 8 tokens 75 -> 117 GMAC/s, Q8_0 69 -> 123; at 4 tokens about 2x;
 * at 16 (the GEMM's) 70 -> 122, at 64 99 -> 117, at 512 the same. */
/* The kernel reads a panel in the chains' order, which the hardware prefetcher does not follow:
 * each block read asks for the same block PACKED_AHEAD panels on, into L2 (prefetcht2). Measured
 * (Zen 4, one thread, 8 tokens, weights from DRAM): 117-123 GMAC/s; asking for a whole panel at
 * once, or into L1 (prefetcht0), 55-66. */
#define PACKED_AHEAD 2
INLINE int packed_quant_bytes(int type) { return type == SE_Q8_0 ? 512 : 256; }
INLINE size_t packed_block_size(int type) { return (size_t)PANEL_ROWS * se_types[type].size; }
INLINE void packed_block(int type, const uint8_t *p, __m512i w[8], __m512 *wd, __m512 *wm) {
    const int qb = packed_quant_bytes(type);
    if (type == SE_Q8_0) {
        for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512(p + 64 * j);
    } else {
        const __m512i m4 = _mm512_set1_epi8(15);
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_loadu_si512(p + 64 * j);
            w[j] = _mm512_and_si512(v, m4);
            w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        }
    }
    *wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + qb)));
    *wm = se_types[type].has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + qb + 32))) : _mm512_setzero_ps();
}

/* One lane chain of the summation order for nt tokens: blocks b0, b0 + 16, ... of the panel.
 * Block b's integer sums come from vpdpbusd on the panel, or (dots != NULL: the AMX path) from
 * dots + b * AMX_DOTS, where row t holds token t's 16 sums (the bias not yet added): the same
 * exact integers, so the float operations that follow, and their bits, are the same. */
INLINE void gemm_chain(int blk, int min, int packed, int nt, const uint8_t *panel, int64_t nb, int64_t b0,
                       const uint8_t *a, size_t arow, const int32_t *qoff, const side_t *side, const int32_t *dots,
                       __m512 *acc) {
    const size_t bsz = packed ? packed_block_size(packed) : (size_t)blk * PANEL_ROWS + 2 * PANEL_ROWS * sizeof(float);
    const size_t ahead = PACKED_AHEAD * (size_t)nb * bsz; /* packed: the same block PACKED_AHEAD panels on */
    for (int t = 0; t < nt; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = b0; b < nb; b += 16) {
        const uint8_t *p = panel + (size_t)b * bsz;
        __m512i w[8];
        __m512 wd, wm;
        if (packed) {
            for (size_t o = 0; o < bsz; o += 64) __builtin_prefetch(p + ahead + o, 0, 1);
            packed_block(packed, p, w, &wd, &wm);
        } else {
            if (!dots)
                for (int j = 0; j < blk / 4; j++) w[j] = _mm512_load_si512(p + 64 * j);
            wd = _mm512_load_ps(p + blk * PANEL_ROWS);
            wm = _mm512_load_ps(p + blk * PANEL_ROWS + 64);
        }
        for (int t = 0; t < nt; t++) {
            const side_t *st = side + (size_t)t * nb + b;
            __m512i sum = min ? _mm512_setzero_si512() : _mm512_set1_epi32(st->bias);
            if (dots) {
                sum = _mm512_add_epi32(sum, _mm512_load_si512(dots + (size_t)b * AMX_DOTS + 16 * t));
            } else {
                const uint8_t *q = a + (size_t)t * arow + qoff[b];
                for (int j = 0; j < blk / 4; j++) sum = _mm512_dpbusd_epi32(sum, w[j], _mm512_set1_epi32((int)ld32(q + 4 * j)));
            }
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(wd, _mm512_set1_ps(st->d)), acc[t]);
            if (min) acc[t] = _mm512_fmadd_ps(wm, _mm512_set1_ps(st->s), acc[t]);
        }
    }
}

/* nt tokens (<= 8) x one panel: y[t * ldy + r] for the panel's rows r < 16 in mask. The
 * summation order with rows in lanes: the 16 lane chains, added as they come in hsum16's tree
 * ((c0 + c2) + (c1 + c3) per quad of chains, then (q0 + q2) + (q1 + q3)). */
INLINE void gemm_tile(int blk, int min, int packed, int nt, const uint8_t *panel, int64_t nb, const uint8_t *a,
                      size_t arow, const int32_t *qoff, const side_t *side, const int32_t *dots, float *y, int64_t ldy,
                      __mmask16 mask) {
    const int *lane = blk == 16 ? LANE16 : LANE32;
    __m512 half[2][8], quad[8], x[8], z[8];
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 2; j++) {
            const int qd = h + 2 * j; /* quads 0 and 2 make the first half, 1 and 3 the second */
            gemm_chain(blk, min, packed, nt, panel, nb, lane[4 * qd], a, arow, qoff, side, dots, x);
            gemm_chain(blk, min, packed, nt, panel, nb, lane[4 * qd + 2], a, arow, qoff, side, dots, z);
            for (int t = 0; t < nt; t++) quad[t] = _mm512_add_ps(x[t], z[t]);
            gemm_chain(blk, min, packed, nt, panel, nb, lane[4 * qd + 1], a, arow, qoff, side, dots, x);
            gemm_chain(blk, min, packed, nt, panel, nb, lane[4 * qd + 3], a, arow, qoff, side, dots, z);
            for (int t = 0; t < nt; t++) {
                quad[t] = _mm512_add_ps(quad[t], _mm512_add_ps(x[t], z[t]));
                half[h][t] = j ? _mm512_add_ps(half[h][t], quad[t]) : quad[t];
            }
        }
    for (int t = 0; t < nt; t++) _mm512_mask_storeu_ps(y + t * ldy, mask, _mm512_add_ps(half[0][t], half[1][t]));
}

/* Tokens [t, t_end) x one panel, 4 at a time, or 8 on packed panels: a packed block's nibbles
 * are unpacked once for the tokens of a tile, so 8 halve that work (Xeon Emerald Rapids, one
 * thread, 8 tokens, weights in cache: Q4_1 576 x 1536 137 -> 142 GMAC/s, Q8_0 49152 x 576 125 ->
 * 139; a batched step of 8 SmolLM2 sequences 3-7% faster). The GEMM's panels are unpacked
 * already. dots (AMX) holds the integer sums of the tokens from t_dots on (see gemm_chain). */
INLINE void gemm_tokens(panel_shape sh, int packed, const uint8_t *panel, int64_t nb, const uint8_t *a, size_t arow,
                        const int32_t *qoff, const side_t *side, const int32_t *dots, int t_dots, int t, int t_end,
                        float *y, int64_t ldy, __mmask16 mask) {
    const int most = packed ? 8 : 4;
    for (; t < t_end; t += most) {
        const int nt = t_end - t < most ? t_end - t : most;
        const uint8_t *at = a + (size_t)t * arow;
        const side_t *st = side + (size_t)t * nb;
        const int32_t *dt = dots ? dots + 16 * (t - t_dots) : NULL;
        float *yt = y + t * ldy;
        switch (nt) { /* a constant token count for each: the loops over tokens unroll */
        case 1: gemm_tile(sh.blk, sh.min, packed, 1, panel, nb, at, arow, qoff, st, dt, yt, ldy, mask); break;
        case 2: gemm_tile(sh.blk, sh.min, packed, 2, panel, nb, at, arow, qoff, st, dt, yt, ldy, mask); break;
        case 3: gemm_tile(sh.blk, sh.min, packed, 3, panel, nb, at, arow, qoff, st, dt, yt, ldy, mask); break;
        case 4: gemm_tile(sh.blk, sh.min, packed, 4, panel, nb, at, arow, qoff, st, dt, yt, ldy, mask); break;
        case 5: gemm_tile(sh.blk, sh.min, packed, 5, panel, nb, at, arow, qoff, st, dt, yt, ldy, mask); break;
        case 6: gemm_tile(sh.blk, sh.min, packed, 6, panel, nb, at, arow, qoff, st, dt, yt, ldy, mask); break;
        case 7: gemm_tile(sh.blk, sh.min, packed, 7, panel, nb, at, arow, qoff, st, dt, yt, ldy, mask); break;
        case 8: gemm_tile(sh.blk, sh.min, packed, 8, panel, nb, at, arow, qoff, st, dt, yt, ldy, mask); break;
        }
    }
}

/* The AMX path's tokens go in groups of mt (a tile's rows); the last group starts at n_tok - mt,
 * overlapping the one before, so that every tile has mt rows (the overlap's sums are computed
 * again, not used again). */
INLINE int amx_group_start(int g, int mt, int n_tok) { return g * mt + mt > n_tok ? n_tok - mt : g * mt; }

/* Each group's activation quants, block by block: block b of group g is mt rows of blk bytes at
 * tok + (g * nb + b) * mt * blk, so that a tile loads 8 or 16 whole cache lines (in place, a
 * block's rows lie an activation row apart and often across two lines). One copy per call; on the
 * loaded 2-core Xeon where it was written, no faster or slower than loading in place, within the
 * noise. */
static void amx_pack(int blk, int mt, int n_tok, int64_t nb, const uint8_t *a, size_t arow, const int32_t *qoff,
                     uint8_t *tok) {
    for (int g = 0; g * mt < n_tok; g++) {
        const uint8_t *at = a + (size_t)amx_group_start(g, mt, n_tok) * arow;
        for (int64_t b = 0; b < nb; b++, tok += (size_t)mt * blk)
            for (int t = 0; t < mt; t++) memcpy(tok + (size_t)t * blk, at + (size_t)t * arow + qoff[b], (size_t)blk);
    }
}

/* The whole GEMM (se_gemm_fn), its integer sums from vpdpbusd or (amx) from int8 tiles. */
INLINE int gemm(int type, int amx, int64_t k, const void *W, size_t wrow, const void *act, size_t arow, int n_tok,
                float *y, int64_t ldy, int64_t r0, int64_t r1) {
    const panel_shape sh = shape_of(type);
    const int64_t nb = k / sh.blk;
    const size_t bsz = (size_t)sh.blk * PANEL_ROWS + 2 * PANEL_ROWS * sizeof(float);
    const size_t panel_size = (size_t)nb * bsz, side_size = (size_t)n_tok * nb * sizeof(side_t);
    const int mt = n_tok < AMX_TOKENS ? n_tok : AMX_TOKENS, groups = (n_tok + mt - 1) / mt; /* amx */
    const size_t dots_size = amx ? (size_t)nb * AMX_DOTS * sizeof(int32_t) : 0;
    const size_t tok_size = amx ? ((size_t)groups * mt * k + 63) / 64 * 64 : 0;
    uint8_t *panel = se_thread_scratch(panel_size + dots_size + tok_size + side_size + (size_t)nb * sizeof(int32_t));
    if (!panel) return -1;
    int32_t *dots = amx ? (int32_t *)(panel + panel_size) : NULL; /* 64-byte aligned: bsz is 64k */
    uint8_t *tok = panel + panel_size + dots_size;
    side_t *side = (side_t *)(tok + tok_size);
    int32_t *qoff = (int32_t *)((uint8_t *)side + side_size);
    const uint8_t *a = act;
    build_side(sh, nb, a, arow, n_tok, side, qoff);
    amx_config saved;
    if (amx) {
        amx_pack(sh.blk, mt, n_tok, nb, a, arow, qoff, tok);
        amx_save(&saved);
        amx_configure(mt, sh.blk);
    }
    /* A few tokens (a step of batched decoding) are as memory-bound as one: ask for the weight
     * rows SE_PREFETCH_BYTES ahead, as se_matmul does for one token. A prompt's compute hides
     * the memory by itself. */
    const int64_t ahead = n_tok < GEMM_STREAM_TOKENS ? (int64_t)(SE_PREFETCH_BYTES / wrow) + 1 : 0;
    for (int64_t r = r0; r < r1; r += PANEL_ROWS) {
        const int nr = r1 - r < PANEL_ROWS ? (int)(r1 - r) : PANEL_ROWS;
        const __mmask16 mask = (__mmask16)((1u << nr) - 1);
        if (ahead && r + ahead < r1) {
            const int64_t n_ahead = r1 - (r + ahead) < PANEL_ROWS ? r1 - (r + ahead) : PANEL_ROWS;
            const uint8_t *p = (const uint8_t *)W + (size_t)(r + ahead) * wrow;
            for (size_t o = 0; o < (size_t)n_ahead * wrow; o += 64) __builtin_prefetch(p + o);
        }
        build_panel(type, sh, (const uint8_t *)W + (size_t)r * wrow, wrow, nr, k, panel);
        if (!amx) {
            gemm_tokens(sh, 0, panel, nb, a, arow, qoff, side, NULL, 0, 0, n_tok, y + r, ldy, mask);
            continue;
        }
        for (int g = 0, done = 0; g < groups; g++) {
            const int t0 = amx_group_start(g, mt, n_tok);
            amx_dots(sh.blk, mt, panel, nb, tok + (size_t)g * mt * k, dots);
            gemm_tokens(sh, 0, panel, nb, a, arow, qoff, side, dots, t0, done, t0 + mt, y + r, ldy, mask);
            done = t0 + mt;
        }
    }
    if (amx) {
        amx_restore(&saved);
        /* gcc 12 puts no vzeroupper before this function's return when it calls amx_restore: the
         * dirty upper halves then made the SSE code that follows (expf in the FFN) about 20x slower */
        _mm256_zeroupper();
    }
    return 0;
}

/* se_avx512_pack_panels: rows of k elements of type (Q4_0, Q4_1, Q8_0) at W, rows apart by
 * wrow, into out (rows rounded up to 16, times wrow bytes). Plain loops: it runs once. */
void se_avx512_pack_panels(int type, const void *W, int64_t k, int64_t rows, void *out) {
    const se_type_traits *t = &se_types[type];
    const size_t ws = (size_t)t->size, wrow = se_row_size(type, k), bsz = packed_block_size(type);
    const int qb = packed_quant_bytes(type), words = qb / 64; /* dwords of a block's quants a row */
    const int64_t nb = k / SE_QK;
    for (int64_t r0 = 0; r0 < rows; r0 += PANEL_ROWS) {
        uint8_t *panel = (uint8_t *)out + (size_t)r0 * wrow;
        memset(panel, 0, PANEL_ROWS * wrow);
        for (int i = 0; i < PANEL_ROWS && r0 + i < rows; i++) {
            const uint8_t *row = (const uint8_t *)W + (size_t)(r0 + i) * wrow;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *x = row + (size_t)b * ws;
                uint8_t *p = panel + (size_t)b * bsz;
                for (int j = 0; j < words; j++)
                    for (int n = 0; n < 4; n++)
                        p[64 * j + 4 * i + n] = (uint8_t)(x[t->qs_offset + 4 * j + n] ^ (type == SE_Q8_0 ? 0x80 : 0));
                memcpy(p + qb + 2 * i, x, 2); /* d: every type's first field */
                if (t->has_min) memcpy(p + qb + 32 + 2 * i, x + 2, 2); /* Q4_1's m follows it */
            }
        }
    }
}

/* se_gemm_fn's contract on packed panels P of wrow-byte rows; r0 a multiple of 16. */
INLINE int packed_gemm(int type, int64_t k, const void *P, size_t wrow, const void *act, size_t arow, int n_tok,
                        float *y, int64_t ldy, int64_t r0, int64_t r1) {
    const panel_shape sh = shape_of(type);
    const int64_t nb = k / sh.blk;
    side_t *side = se_thread_scratch((size_t)n_tok * nb * sizeof(side_t) + (size_t)nb * sizeof(int32_t));
    if (!side) return -1;
    int32_t *qoff = (int32_t *)(side + (size_t)n_tok * nb);
    build_side(sh, nb, act, arow, n_tok, side, qoff);
    for (int64_t r = r0; r < r1; r += PANEL_ROWS) {
        const int nr = r1 - r < PANEL_ROWS ? (int)(r1 - r) : PANEL_ROWS;
        const uint8_t *panel = (const uint8_t *)P + (size_t)r * wrow;
        gemm_tokens(sh, type, panel, nb, act, arow, qoff, side, NULL, 0, 0, n_tok, y + r, ldy, (__mmask16)((1u << nr) - 1));
    }
    return 0;
}
/* packed_gemm for the types se_avx512_pack_panels packs, each with its type a constant */
int se_avx512_packed_gemm(int type, int64_t k, const void *P, size_t wrow, const void *act, size_t arow, int n_tok,
                          float *y, int64_t ldy, int64_t r0, int64_t r1) {
    switch (type) {
    case SE_Q4_0: return packed_gemm(SE_Q4_0, k, P, wrow, act, arow, n_tok, y, ldy, r0, r1);
    case SE_Q4_1: return packed_gemm(SE_Q4_1, k, P, wrow, act, arow, n_tok, y, ldy, r0, r1);
    default: return packed_gemm(SE_Q8_0, k, P, wrow, act, arow, n_tok, y, ldy, r0, r1);
    }
}

/* ---------------------------------------------------------------- instances
 * The table's GEMMs and small-batch kernels (se_kernels_avx512 in kernels_avx512.c): each gives
 * its family's kernel a constant type. */
#define BATCH_KERNELS(T, t)                                                                                       \
    int se_avx512_gemm_##t(int64_t k, const void *W, size_t wrow, const void *act, size_t arow, int n_tok,       \
                           float *y, int64_t ldy, int64_t r0, int64_t r1) {                                       \
        return gemm(SE_##T, 0, k, W, wrow, act, arow, n_tok, y, ldy, r0, r1);                                     \
    }                                                                                                             \
    int se_avx512_small_##t(int64_t k, const void *W, size_t wrow, const void *act, size_t arow, int n_tok,      \
                            float *y, int64_t ldy, int64_t r0, int64_t r1) {                                      \
        return small_batch(SE_##T, k, W, wrow, act, arow, n_tok, y, ldy, r0, r1);                                 \
    }
BATCH_KERNELS(Q4_0, q4_0)
BATCH_KERNELS(Q4_1, q4_1)
BATCH_KERNELS(Q5_0, q5_0)
BATCH_KERNELS(Q5_1, q5_1)
BATCH_KERNELS(Q8_0, q8_0)
BATCH_KERNELS(Q2_K, q2_K)
BATCH_KERNELS(Q3_K, q3_K)
BATCH_KERNELS(Q4_K, q4_K)
BATCH_KERNELS(Q5_K, q5_K)
BATCH_KERNELS(Q6_K, q6_K)
#undef BATCH_KERNELS

/* The AMX path's GEMMs: the same code with its integer sums from tiles. */
#define AMX_GEMM(T)                                                                                              \
    static int amx_gemm_##T(int64_t k, const void *W, size_t wrow, const void *act, size_t arow, int n_tok,     \
                            float *y, int64_t ldy, int64_t r0, int64_t r1) {                                     \
        return gemm(SE_##T, 1, k, W, wrow, act, arow, n_tok, y, ldy, r0, r1);                                    \
    }
AMX_GEMM(Q4_0)
AMX_GEMM(Q4_1)
AMX_GEMM(Q5_0)
AMX_GEMM(Q5_1)
AMX_GEMM(Q8_0)
AMX_GEMM(Q4_K)
AMX_GEMM(Q5_K)
#undef AMX_GEMM

/* Only the GEMMs: kernels.c keeps AVX-512's tiles, dots, small-batch kernels and quantizers. The
 * types with blocks of 16 (Q2_K, Q3_K, Q6_K) keep AVX-512's GEMM too: there a tile does half the
 * products for the same C store and the same float work per block, and it measured slower than
 * vpdpbusd (Q6_K 0.66-0.87x, one thread, 512 tokens, Xeon Emerald Rapids; gemm() runs them right,
 * should a CPU make them pay). */
const se_isa_kernels se_kernels_amx[SE_TYPE_COUNT] = {
    [SE_Q4_0] = { .gemm = amx_gemm_Q4_0 }, [SE_Q4_1] = { .gemm = amx_gemm_Q4_1 },
    [SE_Q5_0] = { .gemm = amx_gemm_Q5_0 }, [SE_Q5_1] = { .gemm = amx_gemm_Q5_1 },
    [SE_Q8_0] = { .gemm = amx_gemm_Q8_0 }, [SE_Q4_K] = { .gemm = amx_gemm_Q4_K },
    [SE_Q5_K] = { .gemm = amx_gemm_Q5_K },
};

#else
const se_isa_kernels se_kernels_amx[SE_TYPE_COUNT] = {{0}};
uint64_t se_amx_probe_macs(int64_t iters) { return (void)iters, 0; }
#endif
