/* The gated activation (activation.c) at one vector level: activation.c includes this file once
 * per level, with the level's target pragma. Before including: ACT_VL (floats per vector),
 * ACT_ISA (the suffix of this level's names: it defines glu<ACT_ISA>), ACT_FMA(a, b, c) = a * b + c
 * fused, and ACT_CAT. */
#define vf ACT_CAT(vf, ACT_ISA)
#define vi ACT_CAT(vi, ACT_ISA)
typedef float vf __attribute__((vector_size(4 * ACT_VL)));
typedef int32_t vi __attribute__((vector_size(4 * ACT_VL)));
#define SELECT(m, a, b) ((vf)(((vi)(a) & (m)) | ((vi)(b) & ~(m)))) /* m ? a : b */
#define SPLAT(x) ((x) - (vf){0}) /* a broadcast: x - 0 is x exactly */
#define VEXP_NAME(x) ACT_CAT(x, ACT_ISA)
#define VEXP_FMA ACT_FMA
#include "vexp.h"

/* act(x) * y on one vector: x / (1 + e^z) * y, z = -x (SiLU) or -2 sqrt(2/pi) x (1 + 0.044715 x^2)
 * (GELU; 1 + 0.044715 x^2 by a fused multiply-add that the code asks for, so that a compiler free
 * to fuse (-ffp-contract=fast) has nothing left to fuse, in the loop's instance or the tail's), z
 * clamped to 88 (e^z's range: the quotient is then below 1e-36 in magnitude where libm's is -0) */
SE_INLINE vf ACT_CAT(glu_vec, ACT_ISA)(se_ffn_act act, vf x, vf y) {
    vf z = act == SE_FFN_SILU ? -x : SPLAT(-SE_GELU_C) * x * ACT_FMA(SPLAT(SE_GELU_A) * x, x, SPLAT(1.0f));
    z = SELECT(z > SPLAT(88.0f), SPLAT(88.0f), z);
    return x / (SPLAT(1.0f) + ACT_CAT(exp, ACT_ISA)(&z)) * y;
}

static void ACT_CAT(glu, ACT_ISA)(se_ffn_act act, float *g, const float *u, int64_t n) {
    int64_t i = 0;
    for (; i + ACT_VL <= n; i += ACT_VL) {
        vf x, y;
        memcpy(&x, g + i, sizeof x);
        memcpy(&y, u + i, sizeof y);
        x = ACT_CAT(glu_vec, ACT_ISA)(act, x, y);
        memcpy(g + i, &x, sizeof x);
    }
    if (i < n) { /* the rest, zero-padded to a vector */
        vf x = SPLAT(0), y = SPLAT(0);
        size_t rest = (size_t)(n - i) * sizeof(float);
        memcpy(&x, g + i, rest);
        memcpy(&y, u + i, rest);
        x = ACT_CAT(glu_vec, ACT_ISA)(act, x, y);
        memcpy(g + i, &x, rest);
    }
}

#undef vf
#undef vi
#undef SELECT
#undef SPLAT
#undef VEXP_NAME
#undef VEXP_FMA
