/* The type-trait table, the portable scalar kernels, and the run-time choice of SIMD path.
 *
 * Every type is one row of the trait table: its facts in se_types (kernels.h), its scalar
 * functions in scalar_fns below. The scalar code is the definition of each
 * type; the AVX2 and AVX-512 files only replace `dot`, the activation quantizers, and add the
 * tiles (several rows x several tokens) that se_matmul uses, for the types they know. The tests
 * check every path against gguf and numpy.
 * Block layouts are ggml's (weights are read in place from GGUF files).
 */
#define _POSIX_C_SOURCE 200112L /* posix_memalign */
#define SE_KERNELS_INTERNAL
#include "kernels.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(se_blk_q4_0) == 18, "q4_0 block");
_Static_assert(sizeof(se_blk_q4_1) == 20, "q4_1 block");
_Static_assert(sizeof(se_blk_q5_0) == 22, "q5_0 block");
_Static_assert(sizeof(se_blk_q5_1) == 24, "q5_1 block");
_Static_assert(sizeof(se_blk_q8_0) == 34, "q8_0 block");
_Static_assert(sizeof(se_blk_q8_1) == 36, "q8_1 block");
_Static_assert(sizeof(se_blk_q2_K) == 84, "q2_K block");
_Static_assert(sizeof(se_blk_q3_K) == 110, "q3_K block");
_Static_assert(sizeof(se_blk_q4_K) == 144, "q4_K block");
_Static_assert(sizeof(se_blk_q5_K) == 176, "q5_K block");
_Static_assert(sizeof(se_blk_q6_K) == 210, "q6_K block");
_Static_assert(sizeof(se_blk_q8_K) == 292, "q8_K block");

/* ---------------------------------------------------------------- half and bfloat16 */

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float se_fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0) /* zero or subnormal: man * 2^-24, exact in float */
        return bits_f32(sign | f32_bits((float)man * 5.9604644775390625e-8f));
    if (exp == 31) /* inf or nan */
        return bits_f32(sign | 0x7f800000 | (man << 13));
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

/* Round to nearest even, like the F16C instruction and numpy's astype(float16). */
uint16_t se_fp32_to_fp16(float f) {
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffff;
    if (ax > 0x7f800000) return sign | 0x7e00;                   /* nan */
    if (ax >= 0x47800000) return sign | 0x7c00;                  /* >= 65536: inf */
    if (ax < 0x38800000) {                                       /* < 2^-14: subnormal half */
        /* Scale to units of 2^-24, then let a float add round to an integer (nearest even). */
        float v = bits_f32(ax) * 16777216.0f;
        uint32_t m = (uint32_t)((v + 8388608.0f) - 8388608.0f);
        return sign | (uint16_t)m;                               /* m == 0x400 is the smallest normal */
    }
    uint32_t h = ((ax >> 23) - 112) << 10 | ((ax >> 13) & 0x3ff);
    uint32_t rest = ax & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;      /* a carry may reach inf: right */
    return sign | (uint16_t)h;
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 64); /* quiet nan */
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

#define F16(h) se_fp16_to_fp32(h)

/* ---------------------------------------------------------------- float types */

static void f32_to_float(const void *src, float *dst, int64_t n) { memcpy(dst, src, (size_t)n * 4); }
static void f32_from_float(const float *src, void *dst, int64_t n) { memcpy(dst, src, (size_t)n * 4); }

static void f16_to_float(const void *src, float *dst, int64_t n) {
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++) dst[i] = F16(s[i]);
}
static void f16_from_float(const float *src, void *dst, int64_t n) {
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = se_fp32_to_fp16(src[i]);
}
static void bf16_to_float(const void *src, float *dst, int64_t n) {
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}
static void bf16_from_float(const float *src, void *dst, int64_t n) {
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
}

/* Float weights meet f32 activations; 4 partial sums keep the rounding error small. */
static float dot_f32(int64_t n, const void *w, const void *a) {
    const float *x = w, *y = a;
    float s[4] = {0};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) s[j] += x[i + j] * y[i + j];
    for (; i < n; i++) s[0] += x[i] * y[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}
static float dot_f16(int64_t n, const void *w, const void *a) {
    const uint16_t *x = w; const float *y = a;
    float s[4] = {0};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) s[j] += F16(x[i + j]) * y[i + j];
    for (; i < n; i++) s[0] += F16(x[i]) * y[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}
static float dot_bf16(int64_t n, const void *w, const void *a) {
    const uint16_t *x = w; const float *y = a;
    float s[4] = {0};
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) s[j] += bf16_to_f32(x[i + j]) * y[i + j];
    for (; i < n; i++) s[0] += bf16_to_f32(x[i]) * y[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

/* ---------------------------------------------------------------- legacy 32-blocks
 * Each type unpacks a block to 32 small integers q; the value is d*q (+ m for the _1 types).
 * Low nibbles are elements 0..15, high nibbles 16..31; q5's fifth bit j comes from qh bit j. */

static inline uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void unpack_nibbles(const uint8_t *qs, int bias, int8_t q[32]) {
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)((qs[j] & 15) - bias);
        q[j + 16] = (int8_t)((qs[j] >> 4) - bias);
    }
}
static void unpack_q5(const uint8_t *qs, const uint8_t *qh, int bias, int8_t q[32]) {
    uint32_t h = le32(qh);
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(((qs[j] & 15) | ((h >> j) & 1) << 4) - bias);
        q[j + 16] = (int8_t)(((qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4) - bias);
    }
}

static inline int isum32(const int8_t q[32], const int8_t *a) {
    int s = 0;
    for (int j = 0; j < 32; j++) s += q[j] * a[j];
    return s;
}

static void q4_0_to_float(const void *src, float *y, int64_t n) {
    const se_blk_q4_0 *b = src;
    for (int64_t i = 0; i < n / SE_QK; i++, y += SE_QK) {
        int8_t q[32]; float d = F16(b[i].d);
        unpack_nibbles(b[i].qs, se_types[SE_Q4_0].q_offset, q);
        for (int j = 0; j < 32; j++) y[j] = q[j] * d;
    }
}
static void q4_1_to_float(const void *src, float *y, int64_t n) {
    const se_blk_q4_1 *b = src;
    for (int64_t i = 0; i < n / SE_QK; i++, y += SE_QK) {
        int8_t q[32]; float d = F16(b[i].d), m = F16(b[i].m);
        unpack_nibbles(b[i].qs, 0, q);
        for (int j = 0; j < 32; j++) y[j] = q[j] * d + m;
    }
}
static void q5_0_to_float(const void *src, float *y, int64_t n) {
    const se_blk_q5_0 *b = src;
    for (int64_t i = 0; i < n / SE_QK; i++, y += SE_QK) {
        int8_t q[32]; float d = F16(b[i].d);
        unpack_q5(b[i].qs, b[i].qh, se_types[SE_Q5_0].q_offset, q);
        for (int j = 0; j < 32; j++) y[j] = q[j] * d;
    }
}
static void q5_1_to_float(const void *src, float *y, int64_t n) {
    const se_blk_q5_1 *b = src;
    for (int64_t i = 0; i < n / SE_QK; i++, y += SE_QK) {
        int8_t q[32]; float d = F16(b[i].d), m = F16(b[i].m);
        unpack_q5(b[i].qs, b[i].qh, 0, q);
        for (int j = 0; j < 32; j++) y[j] = q[j] * d + m;
    }
}
static void q8_0_to_float(const void *src, float *y, int64_t n) {
    const se_blk_q8_0 *b = src;
    for (int64_t i = 0; i < n / SE_QK; i++, y += SE_QK) {
        float d = F16(b[i].d);
        for (int j = 0; j < 32; j++) y[j] = b[i].qs[j] * d;
    }
}
static void q8_1_to_float(const void *src, float *y, int64_t n) {
    const se_blk_q8_1 *b = src;
    for (int64_t i = 0; i < n / SE_QK; i++, y += SE_QK) {
        float d = F16(b[i].d);
        for (int j = 0; j < 32; j++) y[j] = b[i].qs[j] * d;
    }
}

/* roundf (halfway cases away from zero) for |v| < 2^31, written so that it vectorises: the
 * fraction v - trunc(v) is exact in float. */
static inline int round_away(float v) {
    int i = (int)v;
    float f = v - (float)i;
    return i + (f >= 0.5f) - (f <= -0.5f);
}

/* ggml's reference rounding: d = amax/127 stored as fp16, q = roundf(x/d) with the f32 d. */
static float quantize_block_q8(const float *x, int8_t *qs, int *sum) {
    float amax = 0;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / 127, id = d ? 1 / d : 0;
    int s = 0;
    for (int j = 0; j < 32; j++) {
        qs[j] = (int8_t)round_away(x[j] * id);
        s += qs[j];
    }
    *sum = s;
    return d;
}
static void q8_0_from_float(const float *x, void *dst, int64_t n) {
    se_blk_q8_0 *b = dst;
    for (int64_t i = 0; i < n / SE_QK; i++, x += SE_QK) {
        int s;
        b[i].d = se_fp32_to_fp16(quantize_block_q8(x, b[i].qs, &s));
    }
}
static void q8_1_from_float(const float *x, void *dst, int64_t n) {
    se_blk_q8_1 *b = dst;
    for (int64_t i = 0; i < n / SE_QK; i++, x += SE_QK) {
        int s;
        float d = quantize_block_q8(x, b[i].qs, &s);
        b[i].d = se_fp32_to_fp16(d);
        b[i].s = se_fp32_to_fp16(d * (float)s);
    }
}

static float dot_q4_0(int64_t n, const void *w, const void *a) {
    const se_blk_q4_0 *x = w; const se_blk_q8_0 *y = a;
    float sum = 0;
    for (int64_t i = 0; i < n / SE_QK; i++) {
        int8_t q[32];
        unpack_nibbles(x[i].qs, se_types[SE_Q4_0].q_offset, q);
        sum += F16(x[i].d) * F16(y[i].d) * (float)isum32(q, y[i].qs);
    }
    return sum;
}
/* The _1 types: sum (d*q + m)*(da*a) = d*da*sum(q*a) + m*s, with s = da*sum(a) from Q8_1. */
static float dot_q4_1(int64_t n, const void *w, const void *a) {
    const se_blk_q4_1 *x = w; const se_blk_q8_1 *y = a;
    float sum = 0;
    for (int64_t i = 0; i < n / SE_QK; i++) {
        int8_t q[32];
        unpack_nibbles(x[i].qs, 0, q);
        sum += F16(x[i].d) * F16(y[i].d) * (float)isum32(q, y[i].qs) + F16(x[i].m) * F16(y[i].s);
    }
    return sum;
}
static float dot_q5_0(int64_t n, const void *w, const void *a) {
    const se_blk_q5_0 *x = w; const se_blk_q8_0 *y = a;
    float sum = 0;
    for (int64_t i = 0; i < n / SE_QK; i++) {
        int8_t q[32];
        unpack_q5(x[i].qs, x[i].qh, se_types[SE_Q5_0].q_offset, q);
        sum += F16(x[i].d) * F16(y[i].d) * (float)isum32(q, y[i].qs);
    }
    return sum;
}
static float dot_q5_1(int64_t n, const void *w, const void *a) {
    const se_blk_q5_1 *x = w; const se_blk_q8_1 *y = a;
    float sum = 0;
    for (int64_t i = 0; i < n / SE_QK; i++) {
        int8_t q[32];
        unpack_q5(x[i].qs, x[i].qh, 0, q);
        sum += F16(x[i].d) * F16(y[i].d) * (float)isum32(q, y[i].qs) + F16(x[i].m) * F16(y[i].s);
    }
    return sum;
}
static float dot_q8_0(int64_t n, const void *w, const void *a) {
    const se_blk_q8_0 *x = w; const se_blk_q8_0 *y = a;
    float sum = 0;
    for (int64_t i = 0; i < n / SE_QK; i++) {
        int s = 0;
        for (int j = 0; j < 32; j++) s += x[i].qs[j] * y[i].qs[j];
        sum += F16(x[i].d) * F16(y[i].d) * (float)s;
    }
    return sum;
}

/* ---------------------------------------------------------------- K-quants (256 super-blocks)
 * Q4_K/Q5_K: 8 sub-blocks of 32, each with a 6-bit scale and min packed in scales[12]; the
 * value is d*sc*q - dmin*m. Each 64 elements take 32 bytes of qs: low nibbles first. */

void se_get_scale_min_k4(int j, const uint8_t *s, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* q[256] in 0..15 (Q4_K) or 0..31 (Q5_K, when qh is given). */
static void unpack_q45_K(const uint8_t *qs, const uint8_t *qh, uint8_t q[256]) {
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            uint8_t lo = qs[32 * j + l] & 15, hi = qs[32 * j + l] >> 4;
            if (qh) {
                lo |= ((qh[l] >> (2 * j)) & 1) << 4;
                hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
            }
            q[64 * j + l] = lo;
            q[64 * j + 32 + l] = hi;
        }
}

/* Q6_K: per 128 elements, 64 bytes of ql (low 4 bits) and 32 of qh (2 bits each); q in -32..31,
 * one int8 scale per 16 elements (scale index = element / 16). */
static void unpack_q6_K(const se_blk_q6_K *b, int8_t q[256]) {
    const int off = se_types[SE_Q6_K].q_offset;
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        int8_t *o = q + 128 * h;
        for (int l = 0; l < 32; l++) {
            o[l] = (int8_t)(((ql[l] & 15) | ((qh[l] >> 0) & 3) << 4) - off);
            o[l + 32] = (int8_t)(((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - off);
            o[l + 64] = (int8_t)(((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - off);
            o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - off);
        }
    }
}

/* Q2_K and Q3_K (kernels.h gives where each bit lies): q[256] in 0..3, and Q3_K's in -4..3. */
static void unpack_q2_K(const uint8_t *qs, uint8_t q[256]) {
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++) q[128 * h + 32 * j + l] = (qs[32 * h + l] >> (2 * j)) & 3;
}
static void unpack_q3_K(const se_blk_q3_K *b, int8_t q[256]) {
    uint8_t lo[256];
    unpack_q2_K(b->qs, lo);
    for (int e = 0; e < 256; e++) {
        const int hi = (b->hmask[e % 32] >> (e / 32)) & 1; /* bit 4h + j of hmask[l] */
        q[e] = (int8_t)((lo[e] | hi << 2) - se_types[SE_Q3_K].q_offset);
    }
}

static void q2_K_to_float(const void *src, float *y, int64_t n) {
    const se_blk_q2_K *b = src;
    for (int64_t i = 0; i < n / SE_QK_K; i++, y += SE_QK_K) {
        uint8_t q[256];
        const float d = F16(b[i].d), dmin = F16(b[i].dmin);
        unpack_q2_K(b[i].qs, q);
        for (int e = 0; e < 256; e++) {
            const uint8_t sc = b[i].scales[e / 16];
            y[e] = d * (float)(sc & 15) * q[e] - dmin * (float)(sc >> 4);
        }
    }
}
static void q3_K_to_float(const void *src, float *y, int64_t n) {
    const se_blk_q3_K *b = src;
    for (int64_t i = 0; i < n / SE_QK_K; i++, y += SE_QK_K) {
        int8_t q[256], sc[16];
        const float d = F16(b[i].d);
        unpack_q3_K(&b[i], q);
        se_q3_K_scales(b[i].scales, sc);
        for (int e = 0; e < 256; e++) y[e] = d * (float)sc[e / 16] * q[e];
    }
}

static void q45_K_to_float(const uint8_t *scales, uint16_t d16, uint16_t dmin16, const uint8_t q[256],
                           float *y) {
    float d = F16(d16), dmin = F16(dmin16);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        se_get_scale_min_k4(j, scales, &sc, &m);
        for (int l = 0; l < 32; l++) y[32 * j + l] = d * sc * q[32 * j + l] - dmin * m;
    }
}
static void q4_K_to_float(const void *src, float *y, int64_t n) {
    const se_blk_q4_K *b = src;
    for (int64_t i = 0; i < n / SE_QK_K; i++, y += SE_QK_K) {
        uint8_t q[256];
        unpack_q45_K(b[i].qs, NULL, q);
        q45_K_to_float(b[i].scales, b[i].d, b[i].dmin, q, y);
    }
}
static void q5_K_to_float(const void *src, float *y, int64_t n) {
    const se_blk_q5_K *b = src;
    for (int64_t i = 0; i < n / SE_QK_K; i++, y += SE_QK_K) {
        uint8_t q[256];
        unpack_q45_K(b[i].qs, b[i].qh, q);
        q45_K_to_float(b[i].scales, b[i].d, b[i].dmin, q, y);
    }
}
static void q6_K_to_float(const void *src, float *y, int64_t n) {
    const se_blk_q6_K *b = src;
    for (int64_t i = 0; i < n / SE_QK_K; i++, y += SE_QK_K) {
        int8_t q[256];
        float d = F16(b[i].d);
        unpack_q6_K(&b[i], q);
        for (int j = 0; j < 256; j++) y[j] = d * b[i].scales[j / 16] * q[j];
    }
}
static void q8_K_to_float(const void *src, float *y, int64_t n) {
    const se_blk_q8_K *b = src;
    for (int64_t i = 0; i < n / SE_QK_K; i++, y += SE_QK_K)
        for (int j = 0; j < 256; j++) y[j] = b[i].d * b[i].qs[j];
}

/* ggml's Q8_K: the largest |x| maps to -127 (its sign flipped by iscale = -127/max), the rest
 * round to nearest even and clip at 127; bsums hold the sums of each 16 quants. */
static void q8_K_from_float(const float *x, void *dst, int64_t n) {
    se_blk_q8_K *b = dst;
    for (int64_t i = 0; i < n / SE_QK_K; i++, x += SE_QK_K) {
        float amax = 0, max = 0;
        for (int j = 0; j < 256; j++)
            if (fabsf(x[j]) > amax) { amax = fabsf(x[j]); max = x[j]; }
        memset(&b[i], 0, sizeof b[i]);
        if (amax == 0) continue;
        float iscale = -127.f / max;
        for (int j = 0; j < 256; j++) {
            long v = lrintf(iscale * x[j]);
            b[i].qs[j] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += b[i].qs[16 * j + l];
            b[i].bsums[j] = (int16_t)s;
        }
        b[i].d = 1 / iscale;
    }
}

/* sum over sub-blocks of 32: d*sc*sum(q*a) - dmin*m*sum(a); sum(a) comes from the bsums. */
static float dot_q45_K(const uint8_t *scales, uint16_t d16, uint16_t dmin16, const uint8_t q[256],
                       const se_blk_q8_K *y) {
    int sumi = 0, summ = 0;
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        se_get_scale_min_k4(j, scales, &sc, &m);
        int s = 0;
        for (int l = 0; l < 32; l++) s += q[32 * j + l] * y->qs[32 * j + l];
        sumi += sc * s;
        summ += m * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
    }
    return y->d * (F16(d16) * (float)sumi - F16(dmin16) * (float)summ);
}
static float dot_q4_K(int64_t n, const void *w, const void *a) {
    const se_blk_q4_K *x = w; const se_blk_q8_K *y = a;
    float sum = 0;
    for (int64_t i = 0; i < n / SE_QK_K; i++) {
        uint8_t q[256];
        unpack_q45_K(x[i].qs, NULL, q);
        sum += dot_q45_K(x[i].scales, x[i].d, x[i].dmin, q, &y[i]);
    }
    return sum;
}
static float dot_q5_K(int64_t n, const void *w, const void *a) {
    const se_blk_q5_K *x = w; const se_blk_q8_K *y = a;
    float sum = 0;
    for (int64_t i = 0; i < n / SE_QK_K; i++) {
        uint8_t q[256];
        unpack_q45_K(x[i].qs, x[i].qh, q);
        sum += dot_q45_K(x[i].scales, x[i].d, x[i].dmin, q, &y[i]);
    }
    return sum;
}
/* Q2_K: sum over sub-blocks of 16: d*sc*sum(q*a) - dmin*m*sum(a), sum(a) a bsum. */
static float dot_q2_K(int64_t n, const void *w, const void *a) {
    const se_blk_q2_K *x = w; const se_blk_q8_K *y = a;
    float sum = 0;
    for (int64_t i = 0; i < n / SE_QK_K; i++) {
        uint8_t q[256];
        unpack_q2_K(x[i].qs, q);
        int sumi = 0, summ = 0;
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += q[16 * j + l] * y[i].qs[16 * j + l];
            sumi += (x[i].scales[j] & 15) * s;
            summ += (x[i].scales[j] >> 4) * y[i].bsums[j];
        }
        sum += y[i].d * (F16(x[i].d) * (float)sumi - F16(x[i].dmin) * (float)summ);
    }
    return sum;
}
static float dot_q3_K(int64_t n, const void *w, const void *a) {
    const se_blk_q3_K *x = w; const se_blk_q8_K *y = a;
    float sum = 0;
    for (int64_t i = 0; i < n / SE_QK_K; i++) {
        int8_t q[256], sc[16];
        unpack_q3_K(&x[i], q);
        se_q3_K_scales(x[i].scales, sc);
        int sumi = 0;
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += q[16 * j + l] * y[i].qs[16 * j + l];
            sumi += sc[j] * s;
        }
        sum += F16(x[i].d) * y[i].d * (float)sumi;
    }
    return sum;
}
static float dot_q6_K(int64_t n, const void *w, const void *a) {
    const se_blk_q6_K *x = w; const se_blk_q8_K *y = a;
    float sum = 0;
    for (int64_t i = 0; i < n / SE_QK_K; i++) {
        int8_t q[256];
        unpack_q6_K(&x[i], q);
        int sumi = 0;
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += q[16 * j + l] * y[i].qs[16 * j + l];
            sumi += x[i].scales[j] * s;
        }
        sum += F16(x[i].d) * y[i].d * (float)sumi;
    }
    return sum;
}

/* ---------------------------------------------------------------- the table */

/* The scalar functions of every type; the facts (block layout, act_type) are se_types in kernels.h. */
static const struct {
    se_to_float_fn to_float;
    se_from_float_fn from_float;
    se_dot_fn dot;
} scalar_fns[SE_TYPE_COUNT] = {
    [SE_F32] = { f32_to_float, f32_from_float, dot_f32 },
    [SE_F16] = { f16_to_float, f16_from_float, dot_f16 },
    [SE_BF16] = { bf16_to_float, bf16_from_float, dot_bf16 },
    [SE_Q4_0] = { q4_0_to_float, NULL, dot_q4_0 },
    [SE_Q4_1] = { q4_1_to_float, NULL, dot_q4_1 },
    [SE_Q5_0] = { q5_0_to_float, NULL, dot_q5_0 },
    [SE_Q5_1] = { q5_1_to_float, NULL, dot_q5_1 },
    [SE_Q8_0] = { q8_0_to_float, q8_0_from_float, dot_q8_0 },
    [SE_Q8_1] = { q8_1_to_float, q8_1_from_float, NULL },
    [SE_Q2_K] = { q2_K_to_float, NULL, dot_q2_K },
    [SE_Q3_K] = { q3_K_to_float, NULL, dot_q3_K },
    [SE_Q4_K] = { q4_K_to_float, NULL, dot_q4_K },
    [SE_Q5_K] = { q5_K_to_float, NULL, dot_q5_K },
    [SE_Q6_K] = { q6_K_to_float, NULL, dot_q6_K },
    [SE_Q8_K] = { q8_K_to_float, q8_K_from_float, NULL },
};

/* The live table: se_types with the scalar functions, `dot` and the activation quantizers
 * replaced by the chosen ISA's, plus that ISA's tiles. Every entry point initialises it on first
 * use. */
static se_type_traits traits[SE_TYPE_COUNT];
static se_isa_kernels tiles[SE_TYPE_COUNT]; /* the chosen ISA's tiles (tile NULL: none) */
static se_isa isa_in_use = SE_ISA_SCALAR;
static const char *const isa_names[SE_ISA_COUNT] = {
    [SE_ISA_SCALAR] = "scalar", [SE_ISA_AVX2] = "avx2", [SE_ISA_AVX512] = "avx512", [SE_ISA_AMX] = "amx",
};
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* ---------------------------------------------------------------- ISA choice */

static se_isa cpu_best_isa(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return se_amx_usable() ? SE_ISA_AMX : SE_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        return SE_ISA_AVX2;
#endif
    return SE_ISA_SCALAR;
}

/* Every kernel of path `isa`: the live trait table and tiles (read by se_matmul) and the path's
 * index (read by the attention), set together so that nothing compares names per call. */
static void install(se_isa isa) {
    for (int t = 0; t < SE_TYPE_COUNT; t++) {
        traits[t] = se_types[t];
        traits[t].to_float = scalar_fns[t].to_float;
        traits[t].from_float = scalar_fns[t].from_float;
        traits[t].dot = scalar_fns[t].dot;
    }
    memset(tiles, 0, sizeof tiles);
    /* Layer the paths: AVX-512 falls back to AVX2 for a type it does not cover, then scalar;
     * AMX replaces AVX-512's GEMMs only. */
    static const se_isa_kernels *const isa_kernels[SE_ISA_COUNT] = {
        [SE_ISA_AVX2] = se_kernels_avx2, [SE_ISA_AVX512] = se_kernels_avx512, [SE_ISA_AMX] = se_kernels_amx,
    };
    for (int level = SE_ISA_AVX2; level <= (int)isa; level++) {
        const se_isa_kernels *k = isa_kernels[level];
        for (int t = 0; t < SE_TYPE_COUNT; t++) {
            if (k[t].dot) traits[t].dot = k[t].dot;
            if (k[t].tile) tiles[t] = k[t];
            else if (k[t].gemm && tiles[t].tile) tiles[t].gemm = k[t].gemm;
            if (k[t].from_float) traits[t].from_float = k[t].from_float;
        }
    }
    isa_in_use = isa;
}

/* The path a name asks for (NULL or "": the best here); -1 for an unknown name. */
static int isa_from_name(const char *s) {
    if (!s || !*s) return cpu_best_isa();
    for (int i = 0; i < SE_ISA_COUNT; i++)
        if (!strcmp(s, isa_names[i])) return i;
    return -1;
}

int se_set_isa(const char *isa) {
    se_kernels_init(); /* so that a later first use does not undo this choice */
    int want = isa_from_name(isa);
    if (want < 0 || want > (int)cpu_best_isa()) return -1;
    install((se_isa)want);
    return 0;
}

static void init_from_env(void) {
    /* An unknown or unsupported INFER_REF_ISA falls back to the best path here. */
    int want = isa_from_name(getenv("INFER_REF_ISA"));
    se_isa best = cpu_best_isa();
    install(want < 0 || want > (int)best ? best : (se_isa)want);
}

/* Safe to call from several threads; the first call decides (later ones return at once). */
void se_kernels_init(void) { pthread_once(&init_once, init_from_env); }

const char *se_isa_name(void) {
    se_kernels_init();
    return isa_names[isa_in_use];
}

se_isa se_isa_in_use(void) { return isa_in_use; }

void se_bad_tile_shape(const char *isa, int type, int nr, int nc) {
    fprintf(stderr, "reference engine: the %s tile of %s has no %d x %d shape (a bug in its kernel table)\n",
            isa, se_types[type].name, nr, nc);
    abort();
}

const se_type_traits *se_traits(int type) {
    se_kernels_init();
    if (type < 0 || type >= SE_TYPE_COUNT || !traits[type].name) return NULL;
    return &traits[type];
}

size_t se_row_size(int type, int64_t n) {
    const se_type_traits *t = se_traits(type);
    return t ? (size_t)(n / t->blck) * (size_t)t->size : 0;
}

/* ---------------------------------------------------------------- quantize and matmul */

void se_quantize_rows(int act_type, const float *x, int64_t k, int n_tok, void *act) {
    const se_type_traits *t = se_traits(act_type);
    size_t row = se_row_size(act_type, k);
    for (int i = 0; i < n_tok; i++) t->from_float(x + (int64_t)i * k, (char *)act + row * (size_t)i, k);
}

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
typedef struct { void *p; size_t n; } scratch_buf;
static void scratch_free(void *v) { scratch_buf *b = v; free(b->p); free(b); }
static void scratch_key_init(void) { pthread_key_create(&scratch_key, scratch_free); }

void *se_thread_scratch(size_t n) {
    pthread_once(&scratch_once, scratch_key_init);
    scratch_buf *b = pthread_getspecific(scratch_key);
    if (!b) {
        if (!(b = calloc(1, sizeof *b))) return NULL;
        pthread_setspecific(scratch_key, b);
    }
    if (b->n < n) {
        void *p = NULL;
        if (posix_memalign(&p, 64, n) != 0) return NULL;
        free(b->p);
        b->p = p;
        b->n = n;
    }
    return b->p;
}

/* For prompts, rows are taken in groups of ROW_BLOCK so that the group's weights stay in L1
 * while every group of 4 tokens passes over them. */
#define ROW_BLOCK 16

static int gemm_min_tokens = SE_GEMM_MIN_TOKENS;
int se_gemm_min_tokens(void) { return gemm_min_tokens; }
int se_set_gemm_min_tokens(int n) {
    const int was = gemm_min_tokens;
    gemm_min_tokens = n > 0 ? n : SE_GEMM_MIN_TOKENS;
    return was;
}

size_t se_panels_size(int wtype, int64_t k, int64_t rows) {
    se_kernels_init();
    return tiles[wtype].panels ? (size_t)((rows + 15) / 16 * 16) * se_row_size(wtype, k) : 0;
}

void se_pack_panels(int wtype, const void *W, int64_t k, int64_t rows, void *P) {
    if (tiles[wtype].pack) tiles[wtype].pack(wtype, W, k, rows, P);
}

const void *se_panels_for(int wtype, const void *P, int n_tok) {
    /* from memory they beat the AVX-512 GEMM at every batch size measured (8 to 512 tokens);
     * AMX's GEMM, which rebuilds its int8 panels on every call, from SE_AMX_PANELS_MAX_TOKENS on */
    const int gemm_ok = n_tok < SE_AMX_PANELS_MAX_TOKENS || isa_in_use != SE_ISA_AMX;
    return P && tiles[wtype].panels && n_tok > 1 && gemm_ok ? P : NULL;
}

void se_matmul_panels(int wtype, const void *W, const void *P, int64_t k, const void *act, int n_tok, float *y,
                      int64_t ldy, int64_t r0, int64_t r1) {
    const se_isa_kernels *kt = &tiles[wtype];
    if (se_panels_for(wtype, P, n_tok)) {
        const int64_t next = (r0 + 15) / 16 * 16, a = next < r1 ? next : r1; /* panels start at multiples of 16 */
        const size_t wrow = se_row_size(wtype, k), arow = se_row_size(se_traits(wtype)->act_type, k);
        if (a == r1 || kt->panels(wtype, k, P, wrow, act, arow, n_tok, y, ldy, a, r1) == 0) {
            if (a > r0) se_matmul(wtype, W, k, act, n_tok, y, ldy, r0, a);
            return;
        }
    }
    se_matmul(wtype, W, k, act, n_tok, y, ldy, r0, r1);
}

void se_matmul(int wtype, const void *W, int64_t k, const void *act, int n_tok,
               float *y, int64_t ldy, int64_t r0, int64_t r1) {
    const se_type_traits *t = se_traits(wtype);
    const size_t wrow = se_row_size(wtype, k), arow = se_row_size(t->act_type, k);
    const char *w = W, *a = act;
    const se_isa_kernels *kt = &tiles[wtype];

    if (!kt->tile) { /* scalar: one dot per output */
        for (int64_t r = r0; r < r1; r++)
            for (int i = 0; i < n_tok; i++)
                y[i * ldy + r] = t->dot(k, w + wrow * (size_t)r, a + arow * (size_t)i);
        return;
    }
    if (kt->gemm && n_tok >= gemm_min_tokens && kt->gemm(k, W, wrow, act, arow, n_tok, y, ldy, r0, r1) == 0)
        return;
    if (kt->small && n_tok > 1 && n_tok < gemm_min_tokens && kt->small(k, W, wrow, act, arow, n_tok, y, ldy, r0, r1) == 0)
        return;
    if (n_tok == 1) {
        /* Weights stream from DRAM once per token: ask for the rows SE_PREFETCH_BYTES ahead, since
         * the hardware prefetcher alone leaves the core waiting on memory half of the time. Into
         * L2 (prefetcht2), as the packed panels and the barrier do: asked into L1, each line holds
         * one of the core's few fill buffers for the whole trip from memory (Intel Xeon, Gemma-3's
         * head: 67.6 -> 72.4 tokens/s). */
        const int64_t ahead = (int64_t)(SE_PREFETCH_BYTES / wrow) + 1;
        int64_t r = r0;
        for (; r + kt->tg_rows <= r1; r += kt->tg_rows) {
            if (r + ahead + kt->tg_rows <= r1) {
                const char *p = w + wrow * (size_t)(r + ahead);
                for (size_t o = 0; o < wrow * (size_t)kt->tg_rows; o += 64) __builtin_prefetch(p + o, 0, 1);
            }
            kt->tile(k, w + wrow * (size_t)r, wrow, kt->tg_rows, a, arow, 1, y + r);
        }
        for (; r < r1; r++) y[r] = kt->dot(k, w + wrow * (size_t)r, a);
        return;
    }
    for (int64_t rb = r0; rb < r1; rb += ROW_BLOCK) {
        const int64_t re = rb + ROW_BLOCK < r1 ? rb + ROW_BLOCK : r1;
        for (int i = 0; i < n_tok; i += 4) {
            const int nc = n_tok - i < 4 ? n_tok - i : 4;
            for (int64_t r = rb; r < re;) {
                const int nr = re - r >= kt->pp_rows ? kt->pp_rows : 1;
                float out[16];
                kt->tile(k, w + wrow * (size_t)r, wrow, nr, a + arow * (size_t)i, arow, nc, out);
                for (int j = 0; j < nr; j++)
                    for (int c = 0; c < nc; c++) y[(i + c) * ldy + r + j] = out[j * nc + c];
                r += nr;
            }
        }
    }
}
