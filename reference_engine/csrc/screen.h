/* The screened output head (screen.c; issue 22, spec/reference-engine.md "Screening the output
 * head"). Internal: include after defining SE_ENGINE_INTERNAL.
 *
 * A Q8_0 weight q is u = q + 128 = 8*h + l with h in [0, 31] (the 5-bit high plane, the copy kept
 * here) and l in [0, 7] (the low plane, not kept: the bound covers every value of it). For one
 * token's int8 activations x (block scale dx) and a block of the head with scale d >= 0:
 *
 *     d*dx * sum q*x  =  d*dx * (8 * sum h*x - 128 * sum x + sum l*x),
 *     7 * sum(x < 0)  <=  sum l*x  <=  7 * sum(x > 0)
 *
 * so every row's logit lies in an interval that the plane alone gives. The kernels compute it per
 * row; screen.c picks the rows whose interval reaches the top k and computes them exactly.
 */
#ifndef SE_SCREEN_H
#define SE_SCREEN_H

#include "engine.h"

#define SE_SCREEN_MAX_K 128 /* the largest top-k a screen serves (beyond it: the full head) */
#define SE_SCREEN_PREFETCH 8192 /* bytes the bound kernels ask for ahead of the row they read */
#define SE_SCREEN_MAX_NB 1024 /* blocks per row: the rounding margin (screen.c) is proven up to this */

/* The plane. Row r (row_size bytes at rows + r * row_size), laid out for the kernels' groups of 8
 * blocks (nbp = nb rounded up to 8, nb even):
 *   nbp fp16 scales d (the head's own; 0 past nb),
 *   nb/2 x 32 bytes of h's low 4 bits, two blocks at a time (byte j: element j of the first block
 *     in the low nibble, of the second in the high one),
 *   nbp/8 x 32 bytes of h's fifth bits, eight blocks at a time (bit p of byte j: element j of the
 *     group's block p). */
typedef struct se_screen {
    int64_t nb, nbp, n_rows;
    size_t row_size;
    uint8_t *rows;
} se_screen;

/* One token's head activations as the kernels read them, nbp = nb rounded up to 8 blocks (the
 * extra blocks zero). */
typedef struct {
    const int8_t *xq;    /* [nbp * 32] the int8 activations, block after block */
    const float *dx;     /* [nbp] their block scales */
    const int32_t *lo_c; /* [nbp] -128 * sum x + 7 * (sum of the negative x) */
    const int32_t *hi_c; /* [nbp] -128 * sum x + 7 * (sum of the positive x) */
} se_screen_act;

/* lo[r], hi[r] for rows [r0, r1): sum over blocks of d*dx * (8 * sum h*x + lo_c / hi_c), each
 * computed in float (screen.c widens them by the rounding's bound). */
typedef void (*se_screen_bounds_fn)(const se_screen *s, const se_screen_act *a, int64_t r0, int64_t r1,
                                    float *lo, float *hi);
void se_screen_bounds_scalar(const se_screen *s, const se_screen_act *a, int64_t r0, int64_t r1, float *lo,
                             float *hi);
/* screen_avx2.c: the same with AVX2, FMA and F16C; NULL where not compiled (not x86) */
extern const se_screen_bounds_fn se_screen_bounds_avx2;

#endif
