/* The screened output head (screen.c; issue 22, spec/reference-engine.md "Screening the output
 * head"). Internal: include after defining SE_ENGINE_INTERNAL.
 *
 * A Q8_0 weight q is u = q + 128 = 16*h + 8*f + l with h in [0, 15] (the 4-bit high plane), f in
 * {0, 1} (the fifth bit) and l in [0, 7] (the low bits). For one token's int8 activations x (block
 * scale dx) and a block of the head with scale d >= 0:
 *
 *     d*dx * sum q*x  =  d*dx * (16 * sum h*x - 128 * sum x + sum (8f + l)*x),
 *     15 * sum(x < 0)  <=  sum (8f + l)*x  <=  15 * sum(x > 0)              (stage 1)
 *     sum (8f + l)*x  =  8 * sum f*x + sum l*x,  7 * sum(x < 0) <= sum l*x <= 7 * sum(x > 0)
 *
 * so stage 1 bounds every row's logit from the 4-bit plane alone, and stage 2 narrows the interval
 * of the rows stage 1 could not exclude with their fifth bits: it moves the lower end up by
 * d*dx * 8 * (sum f*x - sum(x < 0)) >= 0 and the upper end down by d*dx * 8 * (sum(x > 0) - sum f*x)
 * >= 0, per block. screen.c picks the rows whose interval reaches the top k and computes them
 * exactly. Where the head outweighs the layers, the planes keep l too and stand for the head: the
 * exact rows, a screened sampler's full head and a tied model's embeddings come from them, and the
 * head's own pages leave memory. There stage 3 first settles the candidates' intervals with their
 * low bits, row by row: the lower end rises by d*dx * (sum l*x - 7 * sum(x < 0)) >= 0 and the upper
 * end falls by d*dx * (7 * sum(x > 0) - sum l*x) >= 0, which leaves about the rounding margins, so
 * that only the rows a sample can take are rebuilt from their tiles (which costs eight times the
 * memory reads of a Q8_0 row).
 */
#ifndef SE_SCREEN_H
#define SE_SCREEN_H

#include "engine.h"
#include "blocks.h"

#define SE_SCREEN_BATCH 4 /* the most rows a pass screens (with more, the pass is bound by the multiply
                           * rate, and one read of the head for all of them costs less than the screens) */
#define SE_SCREEN_MAX_K 128 /* the largest top-k a screen serves (beyond it: the full head) */
#define SE_SCREEN_PREFETCH 8192 /* bytes the stage-1 kernels ask for ahead of the ones they read */
#define SE_SCREEN_MAX_NB 1024 /* blocks per row: the rounding margins (screen.c) are proven up to this */
#define SE_SCREEN_TILE 16 /* rows of the 4-bit plane side by side (one int32 lane each in AVX-512) */
#define SE_SCREEN_TILE_BLOCK 288 /* bytes of one block of a tile: 16 scales, 16 x 16 bytes of h */

/* The planes, nb blocks a row (nb even; nbp = nb rounded up to 8).
 * tiles: the 4-bit plane, rows 16 at a time so that a kernel keeps a row per lane and never adds
 * lanes across (rows past n_rows are zeros); tile t's block b at tiles + t * tile_size + 288 * b:
 *   16 fp16 scales d (row i's at i, the head's own),
 *   4 vectors of 64 bytes of h: in vector m, byte 4i + e holds row i's element 8m + e in its low
 *   nibble and element 8m + 4 + e in its high one (a lane's 4 bytes meet 4 activations).
 * fifth: row r at fifth + r * fifth_size (what stage 2 reads of a row, in one place):
 *   nbp/8 x 32 bytes of fifth bits, eight blocks at a time (bit p of byte j: element j of the
 *   group's block p; 0 past nb),
 *   the nb fp16 scales again.
 * low (where the planes stand for the head, else NULL): row r at low + 3 * nb * r, three words a block: bit e of word
 *   3b + p is bit p of l of block b's element e. */
typedef struct se_screen {
    int batch; /* the head outweighs the layers: a pass of several contexts screens (se_screen_defer), and
                * the top-k rule decides what min-p's route cannot (se_screen_candidates) */
    int64_t nb, nbp, n_rows, n_tiles;
    size_t tile_size, fifth_size;
    uint8_t *tiles, *fifth;
    uint32_t *low;
} se_screen;

/* Tile t of the 4-bit plane, row r's record in the fifth plane, and row r's low bits (where kept)
 * and their bytes: the layout above */
static inline uint8_t *se_screen_tile(const se_screen *s, int64_t t) { return s->tiles + (size_t)t * s->tile_size; }
static inline uint8_t *se_screen_record(const se_screen *s, int64_t r) { return s->fifth + (size_t)r * s->fifth_size; }
static inline uint32_t *se_screen_low(const se_screen *s, int64_t r) { return s->low + 3 * s->nb * r; }
static inline size_t se_screen_low_size(const se_screen *s) { return (size_t)(3 * s->nb) * sizeof(uint32_t); }

/* One token's head activations as the kernels read them (nbp blocks, those past nb zero) */
typedef struct {
    const int8_t *xq;    /* [nbp * 32] the int8 activations, block after block */
    const float *dx;     /* [nbp] their block scales */
    const int32_t *lo_c; /* [nbp] -128 * sum x + 15 * (sum of the negative x) */
    const int32_t *hi_c; /* [nbp] -128 * sum x + 15 * (sum of the positive x) */
    const int32_t *neg8; /* [nbp] -8 * (sum of the negative x) */
    const int32_t *pos8; /* [nbp] -8 * (sum of the positive x) */
    const int32_t *neg7; /* [nbp] -7 * (sum of the negative x) */
    const int32_t *pos7; /* [nbp] -7 * (sum of the positive x) */
} se_screen_act;

/* Stage 1: lo[r], hi[r] for the rows of tiles [t0, t1) (r from 16 * t0 to 16 * t1: the arrays
 * hold whole tiles): the sum over blocks of d*dx * (16 * sum h*x + lo_c / hi_c), block after block
 * in float with one fma each, in the same order on every path (so their results are the same bits;
 * screen.c widens them by the rounding's bound). */
typedef void (*se_screen_bounds_fn)(const se_screen *s, const se_screen_act *a, int64_t t0, int64_t t1, float *lo,
                                    float *hi);
/* Stage 2 for the rows ids[0..n): up[i] = sum over blocks of d*dx * (8 * sum f*x + neg8) >= 0 (the
 * lower end's rise), down[i] = the same with pos8 <= 0 (the upper end's move). Stage 3 (settle)
 * the same from l: sum l*x + neg7 and + pos7. */
typedef void (*se_screen_refine_fn)(const se_screen *s, const se_screen_act *a, const int32_t *ids, int32_t n,
                                    float *up, float *down);
void se_screen_bounds_scalar(const se_screen *s, const se_screen_act *a, int64_t t0, int64_t t1, float *lo,
                             float *hi);
void se_screen_refine_scalar(const se_screen *s, const se_screen_act *a, const int32_t *ids, int32_t n, float *up,
                             float *down);
void se_screen_settle_scalar(const se_screen *s, const se_screen_act *a, const int32_t *ids, int32_t n, float *up,
                             float *down);
/* screen_avx2.c: the same with AVX2, FMA and F16C; screen_avx512.c: stage 1 with AVX-512 VNNI.
 * NULL where not compiled (not x86). */
extern const se_screen_bounds_fn se_screen_bounds_avx2;
extern const se_screen_refine_fn se_screen_refine_avx2;
extern const se_screen_refine_fn se_screen_settle_avx2;
extern const se_screen_bounds_fn se_screen_bounds_avx512;
/* Block b's 32 int8 quants q of row r into the planes: h, f and (where kept) l; the build clears
 * the row's bytes first (screen.c's build_row; screen_avx2.c the same with AVX2) */
typedef void (*se_screen_pack_fn)(const se_screen *s, const int8_t *q, int64_t r, int64_t b);
void se_screen_pack_scalar(const se_screen *s, const int8_t *q, int64_t r, int64_t b);
extern const se_screen_pack_fn se_screen_pack_avx2;
/* Row r of the head from planes that stand for it, as the head stores it: nb Q8_0 blocks (34 bytes each) at out */
typedef void (*se_screen_row_fn)(const se_screen *s, int64_t r, void *out);
void se_screen_row_scalar(const se_screen *s, int64_t r, void *out);
extern const se_screen_row_fn se_screen_row_avx2;
/* The full head from planes that stand for it, the head's bits: the logits of the rows of tiles
 * [t0, t1) into out (rows past n_rows left alone), with 16 * nb int32 of scratch (screen_avx512.c) */
typedef void (*se_screen_head_fn)(const se_screen *s, const se_screen_act *a, int64_t t0, int64_t t1, int32_t *scratch,
                                  float *out);
extern const se_screen_head_fn se_screen_head_avx512;

/* Stage 1 of the ubatch's deferred rows (se_ub_seg.defer), their activations a in segment order,
 * into their contexts' bounds, each tile read from memory once for all of them: every thread its
 * own tiles (no barrier: the bounds are read after the pass) */
void se_screen_stage1_batch(se_context *c, int ith, int nth, const se_acts *a);

#endif
