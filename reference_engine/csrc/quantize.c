/* Weight quantizers (quantize.h): least-squares searches for each ggml block format.
 *
 * Two fits do the work. sym_fit: x ≈ d·L with integers L in [qmin, qmax] (Q8_0, Q5_0, Q4_0, and
 * the 16-element sub-blocks of Q6_K and Q3_K). asym_fit: x ≈ d·L + m with L in [0, qmax] (Q5_1,
 * Q4_1, and the sub-blocks of Q5_K, Q4_K and Q2_K, whose offset must be <= 0 because the format
 * stores it as -dmin·mn with mn unsigned). Each tries a fan of candidate scales around the one that
 * maps the block's range onto the integer range, rounds, solves the weighted least-squares problem
 * for the scale (and offset) given those integers, keeps the best, and re-rounds with the solved
 * scale until the error stops falling.
 *
 * The K-quants then store the sub-block scales (and offsets) as small integers times one fp16
 * super-scale: kquant_fit picks the super-scale from the largest sub-scale, then for each sub-block
 * tries the nearest stored integers and their neighbours, re-rounding the elements for each, and
 * keeps the pair with the least error. So the error minimised is always that of the values the
 * file decodes to.
 */
#include "quantize.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* kernels.c's fp16 conversions (round to nearest even), shared rather than written twice. */
float se_fp16_to_fp32(uint16_t h);
uint16_t se_fp32_to_fp16(float f);

enum { QK = 32, QKK = 256 };

/* How many candidate scales a fit tries on each side: fewer where the integer grid is fine enough
 * that rounding costs little (8 bits: none; 5-6 bits: a few). */
static inline int n_steps(int qrange) { return qrange >= 100 ? 0 : qrange >= 31 ? 5 : 12; }

static inline float fp16_round(float f) { return se_fp16_to_fp32(se_fp32_to_fp16(f)); }
static inline void put_fp16(uint8_t *p, float f) {
    uint16_t h = se_fp32_to_fp16(f);
    memcpy(p, &h, 2);
}
static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }
static inline int round_clamp(float v, int lo, int hi) {
    if (!(v > (float)lo)) return lo; /* also NaN */
    if (v > (float)hi) return hi;
    /* round to nearest (even) by a float add: |v| < 2^22 here, and no libm call without SSE4.1 */
    return (int)((v + 12582912.0f) - 12582912.0f);
}

/* round_clamp as a float, without branches (so that loops of it vectorise): the same value,
 * NaN included (it fails both comparisons and lands on lo). */
static inline float round_clamp_f(float v, float lo, float hi) {
    float c = v > hi ? hi : v;
    c = c > lo ? c : lo;
    return (c + 12582912.0f) - 12582912.0f;
}

/* Importance of each of n elements. A weight error e_i changes a matmul's output by e_i·a_i, so
 * the output's mean squared error is sum_i e_i^2·E[a_i^2]: with an imatrix (E[a_i^2] per column)
 * that is the weight; without one every column counts the same (plain squared error, which also
 * gave the lowest KL divergence of the weightings tried: spec/quantize.md). Returns whether the
 * weights came from the imatrix. */
static int importance(int n, const float *im, float *w) {
    float sum = 0;
    for (int i = 0; i < n; i++) sum += (w[i] = im ? im[i] : 1.0f);
    if (im && sum > 0) return 1;
    for (int i = 0; i < n; i++) w[i] = 1.0f; /* also an imatrix that never saw these columns */
    return 0;
}

/* Speed without changing a bit of the result. A fit's candidates are independent: each one's
 * integers are rounded first, then the sums of every candidate are taken together, element by
 * element (the compiler vectorises across candidates; each candidate's sums still add the same
 * products in the same order), and the best is chosen in the candidates' order as before. w·x is
 * taken once per block (the same floats each candidate used to compute). The refinement stops
 * when re-rounding gives the integers it already has (the same error, which is never kept, as
 * only a strictly better fit is). Blocks and sub-blocks have at most 32 elements. */
enum { MAXC = 2 * (2 * 5 + 1) + 2 * 63 }; /* the most candidates of a fit: sym_fit's for a weighted q6_K sub-block */

/* x ≈ d·L, L in [qmin, qmax]; returns d (0 for a zero block) and fills L. The candidate scales map
 * the largest |x| onto an end of the range or up to 1.2 inside it. With weighted (the weights come
 * from an imatrix, and imatrices are skewed: a column can count 1000x its neighbours) they also reach
 * 1.2 beyond the end, and put each of the block's two most important elements exactly on every
 * integer, so that a small value in a heavy column need not round to 0 because a large one in a
 * light column set the scale. Without an imatrix, clipping lowered the squared error but raised the
 * KL divergence (Gemma-3 Q4_0 0.309 -> 0.428), so there the largest value is kept whole. */
static float sym_fit(int n, const float *x, const float *w, int weighted, int qmin, int qmax, int8_t *L) {
    if (n <= 0 || n > QK) return 0;
    float amax = 0, m = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), m = x[i];
    memset(L, 0, (size_t)n);
    if (amax < 1e-30f) return 0;
    float wx[QK], lt[QK][MAXC], sxl[MAXC] = {0}, sll[MAXC] = {0};
    for (int i = 0; i < n; i++) wx[i] = w[i] * x[i];
    const int ns = n_steps(qmax - qmin), out = weighted ? ns : 0, side = ns + out + 1;
    float inv[MAXC];
    for (int k = 0; k < side; k++) {
        float step = 0.1f * (float)(k - out); /* negative: beyond the end */
        inv[k] = ((float)qmin + step) / m, inv[side + k] = ((float)qmax - step) / m;
    }
    int nc = 2 * side;
    /* weighted: the two most important elements are those of most weighted energy w·x² */
    if (weighted && ns > 0) {
        int top[2] = {-1, -1};
        for (int i = 0; i < n; i++) {
            float e = wx[i] * x[i];
            if (top[0] < 0 || e > wx[top[0]] * x[top[0]]) top[1] = top[0], top[0] = i;
            else if (top[1] < 0 || e > wx[top[1]] * x[top[1]]) top[1] = i;
        }
        for (int a = 0; a < 2; a++)
            if (top[a] >= 0 && x[top[a]] != 0)
                for (int l = qmin; l <= qmax; l++)
                    if (l != 0) inv[nc++] = (float)l / x[top[a]];
    }
    for (int i = 0; i < n; i++)
        for (int k = 0; k < nc; k++) lt[i][k] = round_clamp_f(x[i] * inv[k], (float)qmin, (float)qmax);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < nc; k++) sxl[k] += wx[i] * lt[i][k], sll[k] += w[i] * (lt[i][k] * lt[i][k]);
    /* for the least-squares d = sxl/sll, the error is sum w x^2 - sxl^2/sll */
    float best = 0, best_d = 0;
    int bk = -1;
    for (int k = 0; k < nc; k++)
        if (sll[k] > 0 && sxl[k] * sxl[k] / sll[k] > best) best = sxl[k] * sxl[k] / sll[k], best_d = sxl[k] / sll[k], bk = k;
    if (bk >= 0)
        for (int i = 0; i < n; i++) L[i] = (int8_t)lt[i][bk];
    int8_t t[QK];
    for (int it = 0; it < 4 && best_d != 0; it++) {
        float inv = 1.0f / best_d, s1 = 0, s2 = 0;
        for (int i = 0; i < n; i++) t[i] = (int8_t)round_clamp(x[i] * inv, qmin, qmax);
        if (memcmp(t, L, (size_t)n) == 0) break;
        for (int i = 0; i < n; i++) s1 += wx[i] * (float)t[i], s2 += w[i] * (float)(t[i] * t[i]);
        if (!(s2 > 0 && s1 * s1 / s2 > best * (1 + 1e-7f))) break;
        best = s1 * s1 / s2, best_d = s1 / s2, memcpy(L, t, (size_t)n);
    }
    return best_d;
}

/* The weighted least-squares d, m for x ≈ d·L + m from the sums sw = Σw, sx = Σw·x, sl = Σw·L,
 * sll = Σw·L², slx = Σw·L·x (m <= 0 when nonpos). */
static void solve_dm(float sw, float sx, float sl, float sll, float slx, int nonpos, float *d, float *m) {
    float det = sw * sll - sl * sl, dd = 0, mm = sx / sw;
    if (det > 0) dd = (sw * slx - sl * sx) / det, mm = (sll * sx - sl * slx) / det;
    if (nonpos && mm > 0) mm = 0, dd = sll > 0 ? slx / sll : 0;
    if (dd < 0) dd = 0, mm = nonpos && sx > 0 ? 0 : sx / sw;
    *d = dd, *m = mm;
}

/* x ≈ d·L + m, L in [0, qmax] (m <= 0 when nonpos); fills L, d, m. */
static void asym_fit(int n, const float *x, const float *w, int qmax, int nonpos, uint8_t *L, float *d, float *m) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < n; i++) lo = fminf(lo, x[i]), hi = fmaxf(hi, x[i]);
    if (nonpos && lo > 0) lo = 0;
    memset(L, 0, (size_t)n);
    if (!(hi - lo > 1e-30f) || n < 1 || n > QK) {
        *d = 0, *m = nonpos && lo > 0 ? 0 : lo;
        return;
    }
    float sw = 0, sx = 0;
    for (int i = 0; i < n; i++) sw += w[i], sx += w[i] * x[i];
    const int ns = n_steps(qmax), nc = 2 * ns + 1;
    float lt[QK][MAXC], sl[MAXC] = {0}, sll[MAXC] = {0}, slx[MAXC] = {0}, err[MAXC] = {0}, dd[MAXC], mm[MAXC];
    float is[MAXC];
    for (int k = 0; k < nc; k++) is[k] = ((float)qmax + 0.1f * (float)(k - ns)) / (hi - lo);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < nc; k++) lt[i][k] = round_clamp_f(is[k] * (x[i] - lo), 0, (float)qmax);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < nc; k++) {
            float wl = w[i] * lt[i][k];
            sl[k] += wl, sll[k] += wl * lt[i][k], slx[k] += wl * x[i];
        }
    for (int k = 0; k < nc; k++) solve_dm(sw, sx, sl[k], sll[k], slx[k], nonpos, &dd[k], &mm[k]);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < nc; k++) {
            float e = x[i] - dd[k] * lt[i][k] - mm[k];
            err[k] += w[i] * e * e;
        }
    float best = INFINITY;
    int bk = -1;
    *d = 0, *m = lo; /* kept if every candidate's error is NaN (non-finite input) */
    for (int k = 0; k < nc; k++)
        if (err[k] < best) best = err[k], *d = dd[k], *m = mm[k], bk = k;
    if (bk >= 0)
        for (int i = 0; i < n; i++) L[i] = (uint8_t)lt[i][bk];
    uint8_t t[QK];
    for (int it = 0; it < 4 && *d > 0; it++) {
        float inv = 1.0f / *d, s1 = 0, s2 = 0, s3 = 0, d1, m1, e1 = 0;
        for (int i = 0; i < n; i++) t[i] = (uint8_t)round_clamp((x[i] - *m) * inv, 0, qmax);
        if (memcmp(t, L, (size_t)n) == 0) break;
        for (int i = 0; i < n; i++) {
            float wl = w[i] * (float)t[i];
            s1 += wl, s2 += wl * (float)t[i], s3 += wl * x[i];
        }
        solve_dm(sw, sx, s1, s2, s3, nonpos, &d1, &m1);
        for (int i = 0; i < n; i++) {
            float e = x[i] - d1 * (float)t[i] - m1;
            e1 += w[i] * e * e;
        }
        if (!(e1 < best * (1 - 1e-7f))) break;
        best = e1, *d = d1, *m = m1, memcpy(L, t, (size_t)n);
    }
}

/* ---- 32-element blocks ---- */

/* Symmetric: d (fp16) then the quants; the integers re-rounded against the stored d. */
static float block_sym(const float *x, const float *w, int weighted, int qmin, int qmax, int8_t *L, float *y) {
    float d = fp16_round(sym_fit(QK, x, w, weighted, qmin, qmax, L));
    float inv = d != 0 ? 1.0f / d : 0;
    for (int i = 0; i < QK; i++) {
        L[i] = (int8_t)(d != 0 ? round_clamp(x[i] * inv, qmin, qmax) : 0);
        y[i] = d * (float)L[i];
    }
    return d;
}

/* With an offset: d and m (fp16), the integers re-rounded against the stored pair. */
static void block_asym(const float *x, const float *w, int qmax, uint8_t *L, float *d, float *m, float *y) {
    asym_fit(QK, x, w, qmax, 0, L, d, m);
    *d = fp16_round(*d), *m = fp16_round(*m);
    float inv = *d != 0 ? 1.0f / *d : 0;
    for (int i = 0; i < QK; i++) {
        L[i] = (uint8_t)(*d != 0 ? round_clamp((x[i] - *m) * inv, 0, qmax) : 0);
        y[i] = (*d * (float)L[i]) + *m;
    }
}

/* The low nibbles hold elements 0..15, the high ones 16..31 (q4_0, q4_1, q5_0, q5_1). */
static void pack_nibbles32(const int *q, uint8_t *qs) {
    for (int j = 0; j < QK / 2; j++) qs[j] = (uint8_t)((q[j] & 15) | (q[j + 16] & 15) << 4);
}
static void pack_qh32(const int *q, uint8_t *qh) {
    uint32_t h = 0;
    for (int j = 0; j < QK; j++) h |= (uint32_t)(q[j] >> 4 & 1) << j;
    memcpy(qh, &h, 4); /* little-endian u32 */
}

static void q8_0_block(const float *x, const float *w, int weighted, uint8_t *b, float *y) {
    int8_t L[QK];
    put_fp16(b, block_sym(x, w, weighted, -127, 127, L, y));
    memcpy(b + 2, L, QK);
}

/* A symmetric block's d, and its quants as unsigned integers L - qmin (q4_0, q5_0). */
static void sym_head(const float *x, const float *w, int weighted, int qmin, int qmax, uint8_t *b, int *q, float *y) {
    int8_t L[QK];
    put_fp16(b, block_sym(x, w, weighted, qmin, qmax, L, y));
    for (int i = 0; i < QK; i++) q[i] = L[i] - qmin;
}

/* A block with an offset: d and m, then its quants (q4_1, q5_1). */
static void asym_head(const float *x, const float *w, int qmax, uint8_t *b, int *q, float *y) {
    uint8_t L[QK];
    float d, m;
    block_asym(x, w, qmax, L, &d, &m, y);
    put_fp16(b, d), put_fp16(b + 2, m);
    for (int i = 0; i < QK; i++) q[i] = L[i];
}

static void q4_0_block(const float *x, const float *w, int weighted, uint8_t *b, float *y) {
    int q[QK];
    sym_head(x, w, weighted, -8, 7, b, q, y);
    pack_nibbles32(q, b + 2);
}

static void q5_0_block(const float *x, const float *w, int weighted, uint8_t *b, float *y) {
    int q[QK];
    sym_head(x, w, weighted, -16, 15, b, q, y);
    pack_qh32(q, b + 2);
    pack_nibbles32(q, b + 6);
}

static void q4_1_block(const float *x, const float *w, int weighted, uint8_t *b, float *y) {
    int q[QK];
    asym_head(x, w, 15, b, q, y);
    (void)weighted; /* asym_fit's candidates always reach beyond the range */
    pack_nibbles32(q, b + 4);
}

static void q5_1_block(const float *x, const float *w, int weighted, uint8_t *b, float *y) {
    int q[QK];
    asym_head(x, w, 31, b, q, y);
    (void)weighted;
    pack_qh32(q, b + 4);
    pack_nibbles32(q, b + 8);
}

/* ---- 256-element super-blocks (K-quants) ---- */

typedef struct {
    int sub;        /* elements per sub-block */
    int qmin, qmax; /* range of the integers L (0..qmax when has_min) */
    int smin, smax; /* range of the stored sub-scale integers */
    int has_min;    /* x = (D·sc)·L - (Dmin·mn), else (D·sc)·L */
} kspec;

typedef struct {
    float D, Dmin;
    int sc[16], mn[16], L[QKK];
} kfit;

/* The best L for sub-block elements x given the decoded scale ds and offset dm; returns the error
 * and writes the decoded values to y. */
static float sub_round(const kspec *s, const float *x, const float *w, float ds, float dm, int *L, float *y) {
    float err = 0, inv = ds != 0 ? 1.0f / ds : 0;
    for (int i = 0; i < s->sub; i++) {
        L[i] = ds != 0 ? round_clamp((x[i] + dm) * inv, s->qmin, s->qmax) : clampi(0, s->qmin, s->qmax);
        y[i] = s->has_min ? ds * (float)L[i] - dm : ds * (float)L[i];
        float e = x[i] - y[i];
        err += w[i] * e * e;
    }
    return err;
}

static void kquant_fit(const kspec *s, const float *x, const float *w, int weighted, kfit *f, float *y) {
    int nsub = QKK / s->sub;
    float scale[16], off[16]; /* per sub-block: x ≈ scale·L - off */
    for (int j = 0; j < nsub; j++) {
        const float *xj = x + j * s->sub, *wj = w + j * s->sub;
        if (s->has_min) {
            uint8_t L[32];
            float d, m;
            asym_fit(s->sub, xj, wj, s->qmax, 1, L, &d, &m);
            scale[j] = d, off[j] = -m;
        } else {
            int8_t L[32];
            scale[j] = sym_fit(s->sub, xj, wj, weighted, s->qmin, s->qmax, L), off[j] = 0;
        }
    }
    /* The super-scales: the largest sub-scale (by magnitude; for signed scales, with the sign that
     * puts it on the longer, negative end of the stored range) becomes an end of that range. */
    float big = 0, bigoff = 0;
    for (int j = 0; j < nsub; j++) {
        if (fabsf(scale[j]) > fabsf(big)) big = scale[j];
        bigoff = fmaxf(bigoff, off[j]);
    }
    f->D = fp16_round(s->smin < 0 ? big / (float)s->smin : big / (float)s->smax);
    f->Dmin = fp16_round(bigoff / (float)s->smax);
    for (int j = 0; j < nsub; j++) {
        const float *xj = x + j * s->sub, *wj = w + j * s->sub;
        int b_sc = f->D != 0 ? round_clamp(scale[j] / f->D, s->smin, s->smax) : 0;
        int b_mn = f->Dmin != 0 ? round_clamp(off[j] / f->Dmin, 0, s->smax) : 0;
        /* the candidate pairs, in the order they are compared; their errors summed together,
         * element by element (each candidate's own sum in sub_round's order) */
        int csc[9], cmn[9], nc = 0;
        float ds[9], dm[9], inv[9], err[9] = {0};
        for (int a = -1; a <= 1; a++) {
            int sc = b_sc + a;
            if (sc < s->smin || sc > s->smax || (a != 0 && f->D == 0)) continue;
            for (int b = s->has_min ? -1 : 0; b <= (s->has_min ? 1 : 0); b++) {
                int mn = b_mn + b;
                if (mn < 0 || mn > s->smax || (b != 0 && f->Dmin == 0)) continue;
                /* as gguf.quants and the kernels decode: (D·sc) and (Dmin·mn) in float */
                csc[nc] = sc, cmn[nc] = mn, ds[nc] = f->D * (float)sc, dm[nc] = f->Dmin * (float)mn;
                inv[nc] = ds[nc] != 0 ? 1.0f / ds[nc] : 0;
                nc++;
            }
        }
        const float lmin = (float)s->qmin, lmax = (float)s->qmax, l0 = (float)clampi(0, s->qmin, s->qmax);
        for (int i = 0; i < s->sub; i++)
            for (int c = 0; c < nc; c++) {
                float l = ds[c] != 0 ? round_clamp_f((xj[i] + dm[c]) * inv[c], lmin, lmax) : l0;
                float e = xj[i] - (s->has_min ? ds[c] * l - dm[c] : ds[c] * l);
                err[c] += wj[i] * e * e;
            }
        float best = INFINITY;
        int bc = -1;
        for (int c = 0; c < nc; c++)
            if (err[c] < best) best = err[c], bc = c;
        if (bc >= 0) {
            f->sc[j] = csc[bc], f->mn[j] = cmn[bc];
            sub_round(s, xj, wj, ds[bc], dm[bc], f->L + j * s->sub, y + j * s->sub);
        }
    }
}

static const kspec K2 = {16, 0, 3, 0, 15, 1}, K3 = {16, -4, 3, -32, 31, 0}, K4 = {32, 0, 15, 0, 63, 1},
                    K5 = {32, 0, 31, 0, 63, 1}, K6 = {16, -32, 31, -128, 127, 0};

/* Q4_K / Q5_K: eight 6-bit (scale, min) pairs in 12 bytes (gguf.quants' get_scale_min, inverted). */
static void pack_scales_k4(const kfit *f, uint8_t *s) {
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)(f->sc[j] | (f->sc[j + 4] >> 4) << 6);
        s[j + 4] = (uint8_t)(f->mn[j] | (f->mn[j + 4] >> 4) << 6);
        s[j + 8] = (uint8_t)((f->sc[j + 4] & 15) | (f->mn[j + 4] & 15) << 4);
    }
}

/* Two bits per element: byte h*32+l holds elements h*128 + g*32 + l at bits 2g (Q2_K, Q3_K). */
static void pack_2bit(const int *q, uint8_t *qs) {
    memset(qs, 0, QKK / 4);
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) qs[h * 32 + l] |= (uint8_t)((q[h * 128 + g * 32 + l] & 3) << (2 * g));
}

/* Four bits per element: byte c*32+l holds element c*64+l (low nibble) and c*64+32+l (Q4_K, Q5_K). */
static void pack_4bit(const int *q, uint8_t *qs) {
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++)
            qs[c * 32 + l] = (uint8_t)((q[c * 64 + l] & 15) | (q[c * 64 + 32 + l] & 15) << 4);
}

static void q2_k_block(const float *x, const float *w, int weighted, uint8_t *b, float *y) {
    kfit f;
    kquant_fit(&K2, x, w, weighted, &f, y);
    for (int j = 0; j < 16; j++) b[j] = (uint8_t)(f.sc[j] | f.mn[j] << 4);
    pack_2bit(f.L, b + 16);
    put_fp16(b + 80, f.D), put_fp16(b + 82, f.Dmin);
}

static void q3_k_block(const float *x, const float *w, int weighted, uint8_t *b, float *y) {
    kfit f;
    kquant_fit(&K3, x, w, weighted, &f, y);
    int q[QKK];
    uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    memset(hmask, 0, 32);
    for (int i = 0; i < QKK; i++) {
        q[i] = f.L[i] + 4; /* bit 2 set: the element decodes without the -4 */
        hmask[i % 32] |= (uint8_t)((q[i] >> 2 & 1) << (i / 32));
    }
    pack_2bit(q, qs);
    memset(sc, 0, 12);
    for (int j = 0; j < 16; j++) {
        int s6 = f.sc[j] + 32;
        sc[j % 8] |= (uint8_t)((s6 & 15) << (j < 8 ? 0 : 4));
        sc[8 + j % 4] |= (uint8_t)((s6 >> 4) << (2 * (j / 4)));
    }
    put_fp16(b + 108, f.D);
}

static void q4_k_block(const float *x, const float *w, int weighted, uint8_t *b, float *y) {
    kfit f;
    kquant_fit(&K4, x, w, weighted, &f, y);
    put_fp16(b, f.D), put_fp16(b + 2, f.Dmin);
    pack_scales_k4(&f, b + 4);
    pack_4bit(f.L, b + 16);
}

static void q5_k_block(const float *x, const float *w, int weighted, uint8_t *b, float *y) {
    kfit f;
    kquant_fit(&K5, x, w, weighted, &f, y);
    put_fp16(b, f.D), put_fp16(b + 2, f.Dmin);
    pack_scales_k4(&f, b + 4);
    uint8_t *qh = b + 16;
    memset(qh, 0, 32);
    for (int i = 0; i < QKK; i++) qh[i % 32] |= (uint8_t)((f.L[i] >> 4 & 1) << (i / 32));
    pack_4bit(f.L, b + 48);
}

static void q6_k_block(const float *x, const float *w, int weighted, uint8_t *b, float *y) {
    kfit f;
    kquant_fit(&K6, x, w, weighted, &f, y);
    int q[QKK];
    for (int i = 0; i < QKK; i++) q[i] = f.L[i] + 32;
    uint8_t *ql = b, *qh = b + 128;
    memset(qh, 0, 64);
    for (int h = 0; h < 2; h++) {
        for (int l = 0; l < 64; l++)
            ql[h * 64 + l] = (uint8_t)((q[h * 128 + l] & 15) | (q[h * 128 + 64 + l] & 15) << 4);
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) qh[h * 32 + l] |= (uint8_t)((q[h * 128 + g * 32 + l] >> 4) << (2 * g));
    }
    for (int j = 0; j < 16; j++) b[192 + j] = (uint8_t)(int8_t)f.sc[j];
    put_fp16(b + 208, f.D);
}

/* ---- the table and the threaded driver ---- */

typedef void (*block_fn)(const float *x, const float *w, int weighted, uint8_t *b, float *y);

typedef struct {
    int type, blck, size; /* ggml id, elements and bytes per block */
    block_fn fn;
} qtype;

static const qtype QTYPES[] = {
    {SE_Q8_0, QK, 34, q8_0_block},     {SE_Q5_0, QK, 22, q5_0_block},    {SE_Q5_1, QK, 24, q5_1_block},
    {SE_Q4_0, QK, 18, q4_0_block},     {SE_Q4_1, QK, 20, q4_1_block},    {SE_Q6_K, QKK, 210, q6_k_block},
    {SE_Q5_K, QKK, 176, q5_k_block},   {SE_Q4_K, QKK, 144, q4_k_block},  {11 /* q3_K */, QKK, 110, q3_k_block},
    {10 /* q2_K */, QKK, 84, q2_k_block},
};

static const qtype *find(int type) {
    for (size_t i = 0; i < sizeof QTYPES / sizeof QTYPES[0]; i++)
        if (QTYPES[i].type == type) return &QTYPES[i];
    return NULL;
}

int se_quantize_supported(int type) { return find(type) != NULL; }

typedef struct {
    const qtype *t;
    const float *x, *im;
    int64_t r0, r1, n;
    uint8_t *dst;
    float *dec;
} job;

static void *run_rows(void *arg) {
    const job *j = arg;
    const int bl = j->t->blck;
    int64_t nb = j->n / bl;
    float w[QKK], ybuf[QKK];
    for (int64_t r = j->r0; r < j->r1; r++) {
        for (int64_t k = 0; k < nb; k++) {
            const float *x = j->x + r * j->n + k * bl;
            float *y = j->dec ? j->dec + r * j->n + k * bl : ybuf;
            int weighted = importance(bl, j->im ? j->im + k * bl : NULL, w);
            j->t->fn(x, w, weighted, j->dst + (r * nb + k) * j->t->size, y);
        }
    }
    return NULL;
}

int se_quantize_weights(int type, const float *x, int64_t nrows, int64_t n_per_row, const float *imatrix,
                        void *dst, float *decoded, int n_threads) {
    const qtype *t = find(type);
    if (!t || n_per_row <= 0 || n_per_row % t->blck || nrows < 0) return -1;
    if (n_threads < 1) n_threads = 1;
    if (n_threads > nrows) n_threads = nrows > 0 ? (int)nrows : 1;
    if (n_threads > 64) n_threads = 64;
    job jobs[64];
    pthread_t th[64];
    int started = 0, rc = 0;
    for (int i = 0; i < n_threads; i++) {
        jobs[i] = (job){t, x, imatrix, nrows * i / n_threads, nrows * (i + 1) / n_threads, n_per_row, dst, decoded};
        if (i > 0) {
            if (pthread_create(&th[i], NULL, run_rows, &jobs[i]) != 0) {
                rc = -2;
                break;
            }
            started = i;
        }
    }
    if (rc == 0) run_rows(&jobs[0]);
    for (int i = 1; i <= started; i++) pthread_join(th[i], NULL);
    return rc;
}
