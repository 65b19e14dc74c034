/* The attention kernel, written once for any vector width: attention.c includes this file once per
 * SIMD level, with GCC vector extensions of that level's native width (a vector wider than the
 * target's registers lives in memory, which costs more than the arithmetic). Before including:
 *   ATT_VL     floats per vector (16 AVX-512, 8 AVX2, 4 portable), dividing TILE;
 *   ATT_IOTA   the lanes' indices {0, 1, ..., ATT_VL - 1};
 *   ATT_ROWS   query rows per block at most (what the registers hold);
 *   ATT_NAME   a suffix for this level's names: ATT_NAME(attend_rows) is what it defines;
 *   ATT_FMA    ATT_FMA(a, b, c) = a * b + c on vectors, fused where the level has FMA;
 *   ATT_KH, ATT_VH  1 where the cache's keys (values) are f16, 0 where f32;
 *   ATT_CVTPH  optional: ATT_CVTPH(p) widens ATT_VL halves at p to a vector (else one by one).
 * See attention.c for the layout (key tiles of TILE positions transposed, value rows) and the
 * algorithm (online softmax over a block of query rows).
 */
#define vf ATT_NAME(vf)
#define vi ATT_NAME(vi)
#define vfu ATT_NAME(vfu)
#define NV (TILE / ATT_VL) /* vectors per key tile */
#define ACC 8              /* independent sums in flight: hides the latency of each add */
#define W (ACC / (ATT_ROWS * NV) > 1 ? ACC / (ATT_ROWS * NV) : 1) /* partial sums per score */

typedef float vf __attribute__((vector_size(4 * ATT_VL)));
typedef int32_t vi __attribute__((vector_size(4 * ATT_VL)));
typedef float vfu __attribute__((vector_size(4 * ATT_VL), aligned(4), may_alias)); /* unaligned */

#define LOAD(p) (*(const vfu *)(p))
#if ATT_KH
#define KE uint16_t
#define LOADK(p) ATT_NAME(loadh)(p)
#else
#define KE float
#define LOADK(p) LOAD(p)
#endif
#if ATT_VH
#define VE uint16_t
#define LOADV(p) ATT_NAME(loadh)(p)
#define VALV(p) se_fp16_to_fp32(*(p))
#else
#define VE float
#define LOADV(p) LOAD(p)
#define VALV(p) (*(p))
#endif
#define STORE(p, x) (*(vfu *)(p) = (x))
#define SELECT(m, a, b) ((vf)(((vi)(a) & (m)) | ((vi)(b) & ~(m)))) /* m ? a : b */
#define SPLAT(x) ((x) - (vf){0}) /* a broadcast: x - 0 is x exactly, so no arithmetic (0 + x is not: -0) */
#define MAC(acc, x, v) ((acc) = ATT_FMA(SPLAT(x), (v), (acc))) /* acc += x * v: a scalar x, a vector v */

/* The helpers take vectors by address: GCC notes an ABI change for wide vector parameters,
 * although these are always inlined, and the note cannot be turned off. */

/* ATT_VL f16 elements at p, widened (exactly) */
SE_INLINE vf ATT_NAME(loadh)(const uint16_t *p) {
#ifdef ATT_CVTPH
    return (vf)ATT_CVTPH(p);
#else
    vf x;
    for (int i = 0; i < ATT_VL; i++) x[i] = se_fp16_to_fp32(p[i]);
    return x;
#endif
}

/* max over the lanes of n vectors */
SE_INLINE float ATT_NAME(hmax)(const vf *x, int n) {
    vf m = x[0], y;
    for (int v = 1; v < n; v++) m = SELECT(x[v] > m, x[v], m);
    const vi iota = ATT_IOTA;
    for (int h = ATT_VL / 2; h > 0; h /= 2) {
        y = __builtin_shuffle(m, iota ^ h);
        m = SELECT(y > m, y, m);
    }
    return m[0];
}

#define VEXP_NAME ATT_NAME
#define VEXP_FMA ATT_FMA
#include "vexp.h"
#undef VEXP_NAME
#undef VEXP_FMA

/* out[r][c0, c0 + cw * ATT_VL) = out[r] * corr[r] + sum over k < nk of p[r][k] * v[k]: the value
 * rows' columns loaded once for the nr rows (nr, cw constants once inlined). */
SE_INLINE void ATT_NAME(pv)(float *const *out, const int nr, const int cw, int c0, const VE *v,
                            int hd, int nk, float (*p)[TILE], const float *corr) {
    vf o[ACC];
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < cw; j++) o[r * cw + j] = LOAD(out[r] + c0 + j * ATT_VL) * corr[r];
    for (int k = 0; k < nk; k++)
        for (int j = 0; j < cw; j++) {
            vf vk = LOADV(v + (int64_t)k * hd + c0 + j * ATT_VL);
            for (int r = 0; r < nr; r++) MAC(o[r * cw + j], p[r][k], vk);
        }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < cw; j++) STORE(out[r] + c0 + j * ATT_VL, o[r * cw + j]);
}

/* Attends nr rows (a constant 1..ATT_ROWS once inlined) over one kv head: key tiles kc, value
 * rows vc. Each score is W sums, each over every W-th dimension, added in order: W is one number
 * per SIMD level, whatever nr, so that a row's scores (and so its output) do not depend on the
 * rows beside it in the block, which depend on the batch and the thread count. */
SE_INLINE void ATT_NAME(block)(const att_row *rw, const int nr, const void *kc, const void *vc,
                               int hd, float scale) {
    const int w = W, cw = nr >= ACC ? 1 : ACC / nr;
    const float *q[ATT_ROWS];
    float *out[ATT_ROWS], m[ATT_ROWS], corr[ATT_ROWS], p[ATT_ROWS][TILE];
    vf l[ATT_ROWS];
    int64_t lo = rw[0].lo, hi = rw[0].hi, lo_all = lo, hi_all = hi; /* union, intersection */
    for (int r = 0; r < nr; r++) {
        q[r] = rw[r].q;
        out[r] = rw[r].out;
        m[r] = -INFINITY;
        l[r] = SPLAT(0);
        memset(out[r], 0, (size_t)hd * sizeof(float));
        lo = min64(lo, rw[r].lo), lo_all = max64(lo_all, rw[r].lo);
        hi = max64(hi, rw[r].hi), hi_all = min64(hi_all, rw[r].hi);
    }
    const vi iota = ATT_IOTA;
    const int64_t ahead = att_ahead(hd, sizeof(KE) + sizeof(VE));
    att_prefetch(kc, vc, lo / TILE * TILE, min64(hi, lo / TILE * TILE + ahead), hd, sizeof(KE), sizeof(VE));
    for (int64_t p0 = lo / TILE * TILE; p0 < hi; p0 += TILE) {
        att_prefetch(kc, vc, p0 + ahead, min64(hi, p0 + ahead + TILE), hd, sizeof(KE), sizeof(VE));
        /* scores: s[r] = sum over d of q[r][d] * (row d of the key tile), in w partial sums */
        const KE *kt = (const KE *)kc + p0 * hd;
        vf s[ACC > ATT_ROWS * NV ? ACC : ATT_ROWS * NV];
        for (int i = 0; i < nr * w * NV; i++) s[i] = SPLAT(0);
        int d = 0;
        for (; d + w <= hd; d += w)
            for (int j = 0; j < w; j++)
                for (int v = 0; v < NV; v++) {
                    vf k = LOADK(kt + (d + j) * TILE + v * ATT_VL);
                    for (int r = 0; r < nr; r++) MAC(s[(r * w + j) * NV + v], q[r][d + j], k);
                }
        for (; d < hd; d++)
            for (int v = 0; v < NV; v++)
                for (int r = 0; r < nr; r++) MAC(s[r * w * NV + v], q[r][d], LOADK(kt + d * TILE + v * ATT_VL));
        /* online softmax: p = exp(s - max so far); the earlier sum and output scale by corr */
        int masked = p0 < lo_all || p0 + TILE > hi_all;
        for (int r = 0; r < nr; r++) {
            vf x[NV];
            for (int v = 0; v < NV; v++) {
                x[v] = s[r * w * NV + v];
                for (int j = 1; j < w; j++) x[v] += s[(r * w + j) * NV + v];
                x[v] *= scale;
                if (masked) {
                    vi pos = iota + (int32_t)(p0 + v * ATT_VL);
                    vi seen = (pos >= (int32_t)rw[r].lo) & (pos < (int32_t)rw[r].hi);
                    x[v] = SELECT(seen, x[v], SPLAT(-INFINITY));
                }
            }
            float mx = ATT_NAME(hmax)(x, NV);
            corr[r] = 1;
            if (mx == -INFINITY) { /* no key of this tile (exp(-inf - -inf) would be NaN) */
                for (int v = 0; v < NV; v++) STORE(p[r] + v * ATT_VL, SPLAT(0));
                continue;
            }
            if (mx > m[r]) {
                corr[r] = expf(m[r] - mx);
                m[r] = mx;
                l[r] *= corr[r];
            }
            for (int v = 0; v < NV; v++) {
                x[v] -= m[r];
                vf e = ATT_NAME(exp)(&x[v]);
                l[r] += e;
                STORE(p[r] + v * ATT_VL, e);
            }
        }
        /* out = out * corr + p v, over the tile's keys below hi only: the value rows past it may
         * never have been written (0 * NaN is NaN) */
        const VE *v = (const VE *)vc + p0 * hd;
        int nk = (int)min64(TILE, hi - p0), c = 0;
        for (; c + cw * ATT_VL <= hd; c += cw * ATT_VL) ATT_NAME(pv)(out, nr, cw, c, v, hd, nk, p, corr);
        for (; c + ATT_VL <= hd; c += ATT_VL) ATT_NAME(pv)(out, nr, 1, c, v, hd, nk, p, corr);
        for (; c < hd; c++) /* a head dim that is not a multiple of the vector */
            for (int r = 0; r < nr; r++) {
                float a = out[r][c] * corr[r];
                for (int k = 0; k < nk; k++) a += p[r][k] * VALV(v + (int64_t)k * hd + c);
                out[r][c] = a;
            }
    }
    for (int r = 0; r < nr; r++) {
        float sum = 0;
        for (int i = 0; i < ATT_VL; i++) sum += l[r][i];
        for (int c = 0; c < hd; c++) out[r][c] /= sum;
    }
}

/* n rows over one kv head, in blocks of ATT_ROWS (and the rest). */
static void ATT_NAME(attend_rows)(const att_row *rows, int n, const void *kc, const void *vc, int hd,
                                  float scale) {
    for (int i = 0; i < n; i += ATT_ROWS) {
        switch (n - i < ATT_ROWS ? n - i : ATT_ROWS) {
        case 1: ATT_NAME(block)(rows + i, 1, kc, vc, hd, scale); break;
#if ATT_ROWS >= 2
        case 2: ATT_NAME(block)(rows + i, 2, kc, vc, hd, scale); break;
#endif
#if ATT_ROWS >= 4
        case 3: ATT_NAME(block)(rows + i, 3, kc, vc, hd, scale); break;
        case 4: ATT_NAME(block)(rows + i, 4, kc, vc, hd, scale); break;
#endif
        }
    }
}

#undef vf
#undef vi
#undef vfu
#undef NV
#undef ACC
#undef W
#undef LOAD
#undef KE
#undef LOADK
#undef VE
#undef LOADV
#undef VALV
#undef STORE
#undef SELECT
#undef SPLAT
#undef MAC
