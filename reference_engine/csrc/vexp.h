/* e^x on a vector, for the kernels written with GCC vector extensions (attention_kernel.h,
 * activation.c), once per SIMD level and name. Before including: the vector types vf (floats)
 * and vi (int32) of one width, SELECT(m, a, b) and SPLAT(x) on them, VEXP_NAME(x) (this
 * instance's name: it defines VEXP_NAME(exp)) and VEXP_FMA(a, b, c) = a * b + c, fused where the
 * level has FMA. The same operations on every lane: a lane's result does not depend on its
 * neighbours.
 *
 * e^x for x <= 88, within 2 ulp of expf; 0 below -87.3 (where expf is subnormal: nothing next to
 * the 1 that a softmax's max or a sigmoid adds), for -inf and for NaN. Above 88 the exponent bits
 * overflow: callers clamp.
 * x = k ln2 + r with |r| <= ln2/2; e^r by its Taylor series to r^7 (truncation error < 1e-8
 * relative); 2^k goes straight into the exponent bits. */
SE_INLINE vf VEXP_NAME(exp)(const vf *xp) {
    const float magic = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, kept in the low bits */
    vi ok = *xp >= -87.3f;
    vf x = SELECT(ok, *xp, SPLAT(0));
    vf t = VEXP_FMA(x, SPLAT(1.44269502f), SPLAT(magic));
    vf k = t - magic;
    /* ln2 in two parts: k * hi is exact */
    vf r = VEXP_FMA(k, SPLAT(-1.42860677e-6f), VEXP_FMA(k, SPLAT(-0.693145751953125f), x));
    vf p = SPLAT(1.0f / 5040);
    p = VEXP_FMA(p, r, SPLAT(1.0f / 720));
    p = VEXP_FMA(p, r, SPLAT(1.0f / 120));
    p = VEXP_FMA(p, r, SPLAT(1.0f / 24));
    p = VEXP_FMA(p, r, SPLAT(1.0f / 6));
    p = VEXP_FMA(p, r, SPLAT(0.5f));
    p = VEXP_FMA(p, r, SPLAT(1.0f));
    p = VEXP_FMA(p, r, SPLAT(1.0f));
    vi scale = ((vi)t - (vi)SPLAT(magic) + 127) << 23;
    return (vf)((vi)(p * (vf)scale) & ok);
}
