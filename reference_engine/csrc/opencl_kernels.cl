/* The OpenCL backend's kernels (OpenCL C 1.2), compiled at run time by the device's own compiler
 * when a device is opened (backend_opencl.c; setup.py embeds this file in the library as a string).
 *
 * Kept simple and obviously right: one work-item computes whole results (a weight row for a few
 * tokens, a normalised row, one head's attention for a slice of its dimensions), looping in a fixed
 * order, so a row's result depends only on that row and never on n_tok, the work-group size or the
 * run (backend.h's determinism contract). Faster kernels for real GPUs (work-group reductions in a
 * fixed tree, local-memory tiles) can replace these one at a time; tests/test_opencl_kernels.py
 * states what each must compute.
 *
 * Float views arrive as (buffer, offset in floats); weights as (buffer, offset in bytes). Weights
 * are read as bytes (uchar loads and vload16), so no alignment is assumed, and half floats are decoded here (no cl_khr_fp16).
 * The build options define MM_TOK (tokens per matmul work-item) and ATT_CHUNK (head dimensions per
 * attention work-item); backend_opencl.c sizes its launches with the same numbers.
 *
 * Dequantization follows ggml's block layouts (kernels.h) with the CPU's and gguf.quants' operation
 * order, so a dequantized weight is bit-identical to gguf.quants.dequantize (the tests check it).
 * This file must stay ASCII (setup.py turns it into a C string).
 */

#ifdef cl_khr_fp64
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
typedef double acc_t; /* the rmsnorm's sum of squares: double, as the CPU's */
#else
typedef float acc_t; /* devices without doubles (some mobile GPUs) */
#endif

/* ------------------------------------------------------------------ bytes, half and bfloat16 */

uint rd16(__global const uchar *p) { return (uint)p[0] | (uint)p[1] << 8; }
uint rd32(__global const uchar *p) { return rd16(p) | rd16(p + 2) << 16; }

/* IEEE half bits to float, exactly (subnormal halves are normal floats). */
float half_bits(uint h) {
    uint sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) return as_float(sign | as_uint((float)m * 5.9604644775390625e-8f)); /* m * 2^-24 */
    if (e == 31) return as_float(sign | 0x7f800000u | (m << 13));                  /* inf, nan */
    return as_float(sign | ((e + 112) << 23) | (m << 13));
}
float f16_at(__global const uchar *p) { return half_bits(rd16(p)); }

/* ------------------------------------------------------------------ dequantization
 * deq_T(row, c, k, w): elements [32c, 32c + 32) of a weight row of k elements into w. The quantized
 * types' rows are whole blocks (k a multiple of 32 or 256); the float types' last chunk may be short
 * (the caller reads min(32, k - 32c) of w). */

void deq_f32(__global const uchar *row, int c, int k, float *w) {
    int n = min(32, k - 32 * c);
    for (int i = 0; i < n; i++) w[i] = as_float(rd32(row + 4 * (32 * c + i)));
}
void deq_f16(__global const uchar *row, int c, int k, float *w) {
    int n = min(32, k - 32 * c);
    for (int i = 0; i < n; i++) w[i] = f16_at(row + 2 * (32 * c + i));
}
void deq_bf16(__global const uchar *row, int c, int k, float *w) {
    int n = min(32, k - 32 * c);
    for (int i = 0; i < n; i++) w[i] = as_float(rd16(row + 2 * (32 * c + i)) << 16);
}

/* Legacy 32-blocks: low nibbles are elements 0..15, high nibbles 16..31; q5's fifth bit j is bit j
 * of qh. Q4_0: d, qs[16]; Q4_1: d, m, qs[16]; Q5_0: d, qh[4], qs[16]; Q5_1: d, m, qh[4], qs[16];
 * Q8_0: d, qs[32] (int8). deqv_T(row, c, k, w0, w1): elements [32c, 32c + 16) of the row into w0,
 * [32c + 16, 32c + 32) into w1, each element computed by the same float operations as the scalar
 * formula (and gguf.quants), only several at once. */
#define LANES16 ((uint16)(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))
#define U(n) ((uchar)(n))

void deqv_q4_0(__global const uchar *row, int c, int k, float16 *w0, float16 *w1) {
    __global const uchar *b = row + 18 * c;
    float d = f16_at(b);
    uchar16 q = vload16(0, b + 2);
    *w0 = convert_float16(convert_int16(q & U(15)) - 8) * d;
    *w1 = convert_float16(convert_int16(q >> U(4)) - 8) * d;
}
void deqv_q4_1(__global const uchar *row, int c, int k, float16 *w0, float16 *w1) {
    __global const uchar *b = row + 20 * c;
    float d = f16_at(b), m = f16_at(b + 2);
    uchar16 q = vload16(0, b + 4);
    *w0 = convert_float16(q & U(15)) * d + m;
    *w1 = convert_float16(q >> U(4)) * d + m;
}
void deqv_q5_0(__global const uchar *row, int c, int k, float16 *w0, float16 *w1) {
    __global const uchar *b = row + 22 * c;
    float d = f16_at(b);
    uint16 h = (uint16)(rd32(b + 2));
    uchar16 q = vload16(0, b + 6);
    *w0 = convert_float16(convert_int16(convert_uint16(q & U(15)) | ((h >> LANES16) & 1u) << 4) - 16) * d;
    *w1 = convert_float16(convert_int16(convert_uint16(q >> U(4)) | ((h >> (LANES16 + 16u)) & 1u) << 4) - 16) * d;
}
void deqv_q5_1(__global const uchar *row, int c, int k, float16 *w0, float16 *w1) {
    __global const uchar *b = row + 24 * c;
    float d = f16_at(b), m = f16_at(b + 2);
    uint16 h = (uint16)(rd32(b + 4));
    uchar16 q = vload16(0, b + 8);
    *w0 = convert_float16(convert_uint16(q & U(15)) | ((h >> LANES16) & 1u) << 4) * d + m;
    *w1 = convert_float16(convert_uint16(q >> U(4)) | ((h >> (LANES16 + 16u)) & 1u) << 4) * d + m;
}
void deqv_q8_0(__global const uchar *row, int c, int k, float16 *w0, float16 *w1) {
    __global const uchar *b = row + 34 * c;
    float d = f16_at(b);
    *w0 = convert_float16(as_char16(vload16(0, b + 2))) * d;
    *w1 = convert_float16(as_char16(vload16(1, b + 2))) * d;
}

/* K-quants: super-blocks of 256, chunk c is sub-chunk s = c % 8 of super-block c / 8; element
 * e = 32s + l. Q2_K and Q3_K: the low 2 bits of e = 128h + 32j + l are bits 2j..2j+1 of
 * qs[32h + l]; Q3_K's high bit is bit 4h + j (= s) of hmask[l]. Q2_K, Q3_K and Q6_K have one scale
 * per 16 elements: w0's and w1's. */
void deqv_q2_K(__global const uchar *row, int c, int k, float16 *w0, float16 *w1) { /* scales[16], qs[64], d, dmin */
    __global const uchar *b = row + 84 * (c / 8);
    int s = c % 8, h = s / 4, j = s % 4;
    float d = f16_at(b + 80), dmin = f16_at(b + 82);
    uint sc0 = b[2 * s], sc1 = b[2 * s + 1];
    uchar16 q0 = (vload16(0, b + 16 + 32 * h) >> U(2 * j)) & U(3), q1 = (vload16(1, b + 16 + 32 * h) >> U(2 * j)) & U(3);
    *w0 = d * (float)(sc0 & 15) * convert_float16(q0) - dmin * (float)(sc0 >> 4);
    *w1 = d * (float)(sc1 & 15) * convert_float16(q1) - dmin * (float)(sc1 >> 4);
}
/* Q3_K's 16 six-bit scales (stored + 32): scale i takes its low 4 bits from byte i (i < 8) or the
 * high nibble of byte i - 8, its top 2 bits from bits 2(i/4)..2(i/4)+1 of byte 8 + i%4. */
int q3_K_scale(__global const uchar *s, int i) {
    uint lo = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
    uint hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (int)(lo | hi << 4) - 32;
}
void deqv_q3_K(__global const uchar *row, int c, int k, float16 *w0, float16 *w1) { /* hmask[32], qs[64], scales[12], d */
    __global const uchar *b = row + 110 * (c / 8);
    int s = c % 8, h = s / 4, j = s % 4;
    float d = f16_at(b + 108);
    for (int hf = 0; hf < 2; hf++) {
        uchar16 lo = (vload16(hf, b + 32 + 32 * h) >> U(2 * j)) & U(3), hi = (vload16(hf, b) >> U(s)) & U(1);
        float16 w = d * (float)q3_K_scale(b + 96, 2 * s + hf) * convert_float16(convert_int16(lo | hi << U(2)) - 4);
        if (hf) *w1 = w;
        else *w0 = w;
    }
}
/* Q4_K/Q5_K: 8 sub-blocks of 32 with a 6-bit scale and min packed in scales[12]; 64 elements per 32
 * bytes of qs (low nibbles: the even sub-block, high nibbles: the odd one); Q5_K's fifth bit of
 * sub-block s is bit s of qh[l]. The value is d*sc*q - dmin*m. */
void scale_min_k4(__global const uchar *s, int j, float *sc, float *m) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *m = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        *m = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}
void deqv_q4_K(__global const uchar *row, int c, int k, float16 *w0, float16 *w1) { /* d, dmin, scales[12], qs[128] */
    __global const uchar *b = row + 144 * (c / 8);
    int s = c % 8;
    float d = f16_at(b), dmin = f16_at(b + 2), sc, m;
    scale_min_k4(b + 4, s, &sc, &m);
    uchar16 q0 = vload16(0, b + 16 + 32 * (s / 2)), q1 = vload16(1, b + 16 + 32 * (s / 2));
    q0 = s & 1 ? q0 >> U(4) : q0 & U(15);
    q1 = s & 1 ? q1 >> U(4) : q1 & U(15);
    *w0 = d * sc * convert_float16(q0) - dmin * m;
    *w1 = d * sc * convert_float16(q1) - dmin * m;
}
void deqv_q5_K(__global const uchar *row, int c, int k, float16 *w0, float16 *w1) { /* d, dmin, scales[12], qh[32], qs[128] */
    __global const uchar *b = row + 176 * (c / 8);
    int s = c % 8;
    float d = f16_at(b), dmin = f16_at(b + 2), sc, m;
    scale_min_k4(b + 4, s, &sc, &m);
    uchar16 q0 = vload16(0, b + 48 + 32 * (s / 2)), q1 = vload16(1, b + 48 + 32 * (s / 2));
    q0 = (s & 1 ? q0 >> U(4) : q0 & U(15)) | ((vload16(0, b + 16) >> U(s)) & U(1)) << U(4);
    q1 = (s & 1 ? q1 >> U(4) : q1 & U(15)) | ((vload16(1, b + 16) >> U(s)) & U(1)) << U(4);
    *w0 = d * sc * convert_float16(q0) - dmin * m;
    *w1 = d * sc * convert_float16(q1) - dmin * m;
}
/* Q6_K: ql[128], qh[64], scales[16] (int8), d. Per 128 elements (h = s / 4), group g = s % 4 takes
 * the low (g < 2) or high nibble of ql[64h + 32(g & 1) + l] and bits 2g..2g+1 of qh[32h + l];
 * q = that - 32, one scale per 16 elements. */
void deqv_q6_K(__global const uchar *row, int c, int k, float16 *w0, float16 *w1) {
    __global const uchar *b = row + 210 * (c / 8);
    int s = c % 8, h = s / 4, g = s % 4;
    float d = f16_at(b + 208);
    for (int hf = 0; hf < 2; hf++) {
        uchar16 ql = vload16(hf, b + 64 * h + 32 * (g & 1)), qh = vload16(hf, b + 128 + 32 * h);
        uchar16 q = (g < 2 ? ql & U(15) : ql >> U(4)) | ((qh >> U(2 * g)) & U(3)) << U(4);
        float16 w = d * (float)as_char(b[192 + 2 * s + hf]) * convert_float16(convert_int16(q) - 32);
        if (hf) *w1 = w;
        else *w0 = w;
    }
}
/* The float types: the last chunk of a row may be short; its missing elements are zeros. */
#define DEQV_FLOAT(T)                                                                         \
    void deqv_##T(__global const uchar *row, int c, int k, float16 *w0, float16 *w1) {        \
        float w[32];                                                                          \
        for (int i = min(32, k - 32 * c); i < 32; i++) w[i] = 0.0f;                           \
        deq_##T(row, c, k, w);                                                                \
        *w0 = vload16(0, w);                                                                  \
        *w1 = vload16(1, w);                                                                  \
    }
DEQV_FLOAT(f32)
DEQV_FLOAT(f16)
DEQV_FLOAT(bf16)

/* ------------------------------------------------------------------ matmul
 * y[t][r] = sum_i W[r][i] x[t][i]. Work-item (r, tile): weight row r against the MM_TOK tokens of
 * its tile, so each chunk of 32 weights is dequantized once per tile. A token's sum is fixed: 16
 * lanes, lane l accumulating w0*x0 + w1*x1 of every chunk in order, then the lanes added pairwise
 * (hsum16). The same for every token whatever n_tok or the tile. */
float hsum16(float16 p) {
    float8 a = p.lo + p.hi;
    float4 b = a.lo + a.hi;
    float2 c = b.lo + b.hi;
    return c.x + c.y;
}

/* PARTIAL: the type's rows may end in a short chunk (float types), read as zeros past k. */
#define MATMUL(T, PARTIAL)                                                                               \
    __kernel void matmul_##T(__global const uchar *W, ulong woff, ulong row_size, int k, int n_rows,     \
                             __global const float *x, ulong xoff, int n_tok, __global float *y,          \
                             ulong yoff, long ldy) {                                                     \
        int r = get_global_id(0), t0 = get_global_id(1) * MM_TOK;                                        \
        if (r >= n_rows) return;                                                                         \
        int nt = min(MM_TOK, n_tok - t0);                                                                \
        __global const uchar *row = W + woff + (ulong)r * row_size;                                      \
        __global const float *xs = x + xoff + (ulong)t0 * k;                                             \
        float16 acc[MM_TOK];                                                                             \
        for (int t = 0; t < MM_TOK; t++) acc[t] = 0.0f;                                                  \
        for (int c = 0; 32 * c < k; c++) {                                                               \
            float16 w0, w1, x0, x1;                                                                      \
            deqv_##T(row, c, k, &w0, &w1);                                                               \
            int n = k - 32 * c;                                                                          \
            for (int t = 0; t < nt; t++) {                                                               \
                __global const float *xc = xs + (ulong)t * k + 32 * c;                                   \
                if (PARTIAL && n < 32) {                                                                 \
                    float xt[32];                                                                        \
                    for (int i = 0; i < 32; i++) xt[i] = i < n ? xc[i] : 0.0f;                           \
                    x0 = vload16(0, xt);                                                                 \
                    x1 = vload16(1, xt);                                                                 \
                } else {                                                                                 \
                    x0 = vload16(0, xc);                                                                 \
                    x1 = vload16(1, xc);                                                                 \
                }                                                                                        \
                acc[t] += w0 * x0 + w1 * x1;                                                             \
            }                                                                                            \
        }                                                                                                \
        for (int t = 0; t < nt; t++) y[yoff + (ulong)(t0 + t) * ldy + r] = hsum16(acc[t]);               \
    }

MATMUL(f32, 1)
MATMUL(f16, 1)
MATMUL(bf16, 1)
MATMUL(q4_0, 0)
MATMUL(q4_1, 0)
MATMUL(q5_0, 0)
MATMUL(q5_1, 0)
MATMUL(q8_0, 0)
MATMUL(q2_K, 0)
MATMUL(q3_K, 0)
MATMUL(q4_K, 0)
MATMUL(q5_K, 0)
MATMUL(q6_K, 0)

/* ------------------------------------------------------------------ norms, rope, activations */

/* Row r: y = x / sqrt(mean(x^2) + eps) * w, the squares summed in acc_t in one chain (blocks.c
 * se_rmsnorm adds them in 8 partial sums: the same value within rounding). */
__kernel void rmsnorm(__global float *y, ulong yoff, __global const float *x, ulong xoff,
                      __global const float *w, ulong woff, long n, int rows, float eps) {
    int r = get_global_id(0);
    if (r >= rows) return;
    __global const float *xr = x + xoff + (ulong)r * n;
    __global float *yr = y + yoff + (ulong)r * n;
    acc_t ss = 0;
    for (long i = 0; i < n; i++) {
        float v = xr[i] * xr[i];
        ss += (acc_t)v;
    }
    float scale = 1.0f / sqrt((float)(ss / (acc_t)n) + eps);
    for (long i = 0; i < n; i++) yr[i] = xr[i] * scale * w[woff + i];
}

/* Head row hr (token hr / n_head), pair i: the angle of blocks.c's rope_table, theta = pos
 * stepped i times by theta_scale (the host's powf(base, -2/n_rot)) in float, times freq_scale. NORM
 * rotates dims (2i, 2i+1), NEOX (i, i + n_rot/2). */
__kernel void rope(__global float *x, ulong xoff, int n_rows, int n_head, int head_dim, int n_rot,
                   int neox, int pos0, float theta_scale, float freq_scale) {
    int hr = get_global_id(0), i = get_global_id(1);
    if (hr >= n_rows) return;
    float theta = (float)(pos0 + hr / n_head);
    for (int j = 0; j < i; j++) theta *= theta_scale;
    float a = theta * freq_scale, cs = cos(a), sn = sin(a);
    __global float *h = x + xoff + (ulong)hr * head_dim;
    int i0 = neox ? i : 2 * i, i1 = neox ? i + n_rot / 2 : 2 * i + 1;
    float x0 = h[i0], x1 = h[i1];
    h[i0] = x0 * cs - x1 * sn;
    h[i1] = x0 * sn + x1 * cs;
}

/* g = act(g) * u; act 0: SiLU x / (1 + exp(-x)); 1: GELU's tanh form written as blocks.c writes
 * it, x / (1 + exp(-2 sqrt(2/pi) x (1 + 0.044715 x^2))). */
__kernel void ffn_act(__global float *g, ulong goff, __global const float *u, ulong uoff, long n, int act) {
    long i = get_global_id(0);
    if (i >= n) return;
    float v = g[goff + i];
    float a = act == 0 ? v / (1.0f + exp(-v))
                       : v / (1.0f + exp(-1.59576912160573071176f * v * (1.0f + 0.044715f * v * v)));
    g[goff + i] = a * u[uoff + i];
}

__kernel void add(__global float *x, ulong xoff, __global const float *y, ulong yoff, long n) {
    long i = get_global_id(0);
    if (i < n) x[xoff + i] += y[yoff + i];
}

/* ------------------------------------------------------------------ attention
 * The cache, per layer: [n_head_kv][n_ctx][head_dim] f32 for the keys (kc) and the values (vc). */

/* Element i of token t's new keys and values ([n_tok][n_head_kv * head_dim]) into position pos0 + t. */
__kernel void kv_store(__global float *kc, ulong kcoff, __global float *vc, ulong vcoff,
                       __global const float *kn, ulong knoff, __global const float *vn, ulong vnoff,
                       int n_ctx, int pos0, int n_kv, int head_dim) {
    int i = get_global_id(0), t = get_global_id(1);
    if (i >= n_kv) return;
    ulong dst = (ulong)(i / head_dim) * n_ctx * head_dim + (ulong)(pos0 + t) * head_dim + i % head_dim;
    kc[kcoff + dst] = kn[knoff + (ulong)t * n_kv + i];
    vc[vcoff + dst] = vn[vnoff + (ulong)t * n_kv + i];
}

/* q . k over n dimensions in a fixed order: 4 lanes over the multiple-of-4 part (vload4), the lanes
 * added pairwise, then the rest one by one. */
float dot_qk(__global const float *q, __global const float *k, int n) {
    float4 s4 = 0.0f;
    int n4 = n / 4;
    for (int i = 0; i < n4; i++) s4 += vload4(i, q) * vload4(i, k);
    float s = (s4.x + s4.y) + (s4.z + s4.w);
    for (int d = 4 * n4; d < n; d++) s += q[d] * k[d];
    return s;
}

/* Token t (at position p = pos0 + t), query head h, dimensions [d0, d0 + ATT_CHUNK) of the output:
 * softmax(q . K * scale) V over the positions [lo, p] it sees (lo = p - window + 1 with a sliding
 * window), online: a running max m, sum l and output, rescaled when a score raises the max. Every
 * chunk of a head computes the same scores in the same order. */
__kernel void attend(__global const float *q, ulong qoff, __global const float *kc, ulong kcoff,
                     __global const float *vc, ulong vcoff, __global float *out, ulong ooff, int n_ctx,
                     int pos0, int n_head, int n_head_kv, int head_dim, int window, float scale) {
    int n_chunk = (head_dim + ATT_CHUNK - 1) / ATT_CHUNK;
    int u = get_global_id(0), t = get_global_id(1);
    if (u >= n_head * n_chunk) return;
    int h = u / n_chunk, d0 = u % n_chunk * ATT_CHUNK, nd = min(ATT_CHUNK, head_dim - d0);
    int p = pos0 + t, lo = window > 0 ? max(0, p - window + 1) : 0;
    ulong kv_head = (ulong)(h / (n_head / n_head_kv)) * n_ctx * head_dim;
    __global const float *qr = q + qoff + ((ulong)t * n_head + h) * head_dim;
    __global const float *K = kc + kcoff + kv_head, *V = vc + vcoff + kv_head + d0;
    float m = -INFINITY, l = 0.0f, acc[ATT_CHUNK];
    for (int d = 0; d < ATT_CHUNK; d++) acc[d] = 0.0f;
    for (int j = lo; j <= p; j++) {
        __global const float *kj = K + (ulong)j * head_dim, *vj = V + (ulong)j * head_dim;
        float s = dot_qk(qr, kj, head_dim) * scale;
        if (s > m) { /* a new max: rescale what was summed (exp(-inf) = 0 the first time) */
            float corr = exp(m - s);
            l = l * corr + 1.0f;
            for (int d = 0; d < nd; d++) acc[d] = acc[d] * corr + vj[d];
            m = s;
        } else {
            float e = exp(s - m);
            l += e;
            for (int d = 0; d < nd; d++) acc[d] += e * vj[d];
        }
    }
    __global float *o = out + ooff + ((ulong)t * n_head + h) * head_dim + d0;
    for (int d = 0; d < nd; d++) o[d] = acc[d] / l;
}
