/* The screened output head (issue 22; screen.h has the plane and the bound, spec/reference-engine.md
 * "Screening the output head" the proof and the measurements).
 *
 * A context with the lazy head on (se_context_set_lazy_head) does not run the head in a decode
 * whose logits nobody asked for (one sequence's last token, no all_logits): it keeps the head's
 * input (head_x) and marks the logits pending. Then
 *   - se_sample, when the sampler needs only the top k (greedy: k = 1; top-k up to
 *     SE_SCREEN_MAX_K; penalties that only lower logits), screens: it bounds every row's logit
 *     from the 4-bit plane, computes exactly the k rows of largest lower bound (the least of
 *     their logits is the threshold), narrows the interval of every row whose upper bound
 *     reaches the threshold with its fifth bits, computes exactly the rows whose upper bound
 *     still reaches it (with the head's own kernel, so with the full head's bits), and samples
 *     from those: the same token the full head would give;
 *   - anything else (se_context_head: the logits themselves, any other sampler) runs the full
 *     head first.
 * The planes are built once per model, at the first screened sample (75% of a Q8_0 head's bytes,
 * of which a screen reads the 4-bit plane, 53%, and a few rows' fifth bits). Where the head is
 * read from the model's file mapping, and either the AVX-512 path computes the full head straight
 * from the planes (screen_avx512.c) or the head outweighs the layers (Gemma-3), they keep the low
 * bits too (108%) and stand for the head: exact rows, a screened sampler's fallback and a tied
 * model's embeddings come from them, and the head's pages leave memory. Models whose head is not
 * Q8_0, or is on a device, are never screened.
 */
#define _GNU_SOURCE
#define SE_ENGINE_INTERNAL
#include "engine.h"
#include "blocks.h"
#include "kernels.h"
#include "screen.h"
#include "backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ggml's Q8_0 block, the head's type (kernels.h has it as se_blk_q8_0, for the kernels' files only) */
#define SE_QK 32
typedef struct { uint16_t d; int8_t qs[SE_QK]; } se_blk_q8_0;
_Static_assert(sizeof(se_blk_q8_0) == 34, "a Q8_0 block is 34 bytes");
_Static_assert(SPLIT_ALIGN % SE_SCREEN_TILE == 0, "a thread's rows start on a tile");

/* ---------------------------------------------------------------------------------------------
 * The planes (built once per model)
 */

/* Whether the model's head could be screened at all (before the plane is built) */
int se_screen_possible(const se_model *m) {
    return m->screen_state >= 0 && m->output.type == SE_Q8_0 && m->output.ne0 % (2 * SE_QK) == 0 &&
           m->output.ne0 / SE_QK <= SE_SCREEN_MAX_NB && !(m->dev && m->dev->head);
}

typedef struct {
    se_screen *s;
    const se_tensor *w;
    int release; /* the head's pages leave memory as its rows are built (a file mapping) */
    int bad[64]; /* per thread: a scale that is negative or not finite (the bound assumes d >= 0) */
} build_job;

/* Element e's l from its block's three words */
static int low_of(const uint32_t w[3], int e) {
    return (int)(w[0] >> e & 1) | (int)(w[1] >> e & 1) << 1 | (int)(w[2] >> e & 1) << 2;
}

/* Block b's 32 quants q of row r into the planes (screen.h's layout; the bits are or-ed into bytes
 * the row's build cleared): h into slot r % 16 of the tile, f into the record, l where kept */
void se_screen_pack_scalar(const se_screen *s, const int8_t *q, int64_t r, int64_t b) {
    const int i = (int)(r % SE_SCREEN_TILE);
    uint8_t *blk = se_screen_tile(s, r / SE_SCREEN_TILE) + SE_SCREEN_TILE_BLOCK * b;
    uint8_t *group = se_screen_record(s, r) + 32 * (b / 8);
    for (int e = 0; e < SE_QK; e++) {
        uint8_t u = (uint8_t)(q[e] + 128);
        blk[32 + 64 * (e / 8) + 4 * i + e % 4] |= (uint8_t)((u >> 4) << (e % 8 / 4 * 4));
        group[e] |= (uint8_t)((u >> 3 & 1) << (b % 8));
    }
    if (!s->low) return;
    uint32_t l[3] = { 0, 0, 0 }; /* the low bits of q are u's: adding 128 leaves them */
    for (int e = 0; e < SE_QK; e++)
        for (int p = 0; p < 3; p++) l[p] |= (uint32_t)((uint8_t)q[e] >> p & 1) << e;
    memcpy(se_screen_low(s, r) + 3 * b, l, sizeof l);
}

static se_screen_pack_fn pack_kernel(void) {
    return se_isa_in_use() >= SE_ISA_AVX2 && se_screen_pack_avx2 ? se_screen_pack_avx2 : se_screen_pack_scalar;
}

/* Row r of the planes from its Q8_0 row, into slot r % 16 of its tile (the first row of a tile
 * clears it: a tile's rows are built in order, by one thread); 0 if a scale is negative or not
 * finite (the bound assumes d >= 0) */
static int build_row(const se_screen *s, const se_blk_q8_0 *src, int64_t r) {
    const int i = (int)(r % SE_SCREEN_TILE);
    uint8_t *tile = se_screen_tile(s, r / SE_SCREEN_TILE), *bits = se_screen_record(s, r);
    uint16_t *d = (uint16_t *)(bits + 4 * s->nbp);
    const se_screen_pack_fn pack = pack_kernel();
    int ok = 1;
    if (i == 0) memset(tile, 0, s->tile_size);
    memset(bits, 0, s->fifth_size);
    for (int64_t b = 0; b < s->nb; b++) {
        float df = se_fp16_to_fp32(src[b].d);
        ok &= df >= 0 && isfinite(df);
        memcpy(tile + SE_SCREEN_TILE_BLOCK * b + 2 * i, &src[b].d, 2);
        d[b] = src[b].d;
        pack(s, src[b].qs, r, b);
    }
    return ok;
}

#define RELEASE_ROWS 1024 /* rows of the head built between two releases of their pages */

/* The whole pages in [lo, hi) leave this process's memory (madvise; the file keeps them, and a
 * read brings them back). Rounded inwards: a page that rows still to be read share is kept. A
 * read of a page that left maps back its whole folio, which the page cache makes as large as
 * 1 MiB or more on newer kernels (Linux 6.18: ext4's large folios); so releasing a page that is
 * still to be read brought back up to a folio of rows already released, at every release. */
static uintptr_t release_pages(uintptr_t lo, uintptr_t hi) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (lo + page - 1) / page * page, b = hi / page * page;
    if (b <= a) return lo;
    madvise((void *)a, b - a, MADV_DONTNEED);
    return b; /* where the next release starts */
}

static void build_rows(void *arg, int ith, int nth) {
    build_job *j = arg;
    int64_t r0, r1;
    se_split(j->s->n_rows, ith, nth, SE_SCREEN_TILE, &r0, &r1);
    const char *data = (const char *)j->w->data;
    uintptr_t released = (uintptr_t)(data + (size_t)r0 * j->w->row_size); /* this thread's rows up to here */
    for (int64_t r = r0; r < r1; r += RELEASE_ROWS) {
        const int64_t n = r1 - r < RELEASE_ROWS ? r1 - r : RELEASE_ROWS;
        const char *rows = data + (size_t)r * j->w->row_size;
        for (int64_t i = 0; i < n; i++)
            if (!build_row(j->s, (const se_blk_q8_0 *)(rows + (size_t)i * j->w->row_size), r + i)) j->bad[ith] = 1;
        if (j->release) released = release_pages(released, (uintptr_t)(rows + (size_t)n * j->w->row_size));
    }
}

/* Memory for the 4-bit plane and the fifth bits, in 2 MiB pages where the system allows them
 * (transparent huge pages on madvise; refused, the pages stay small). Stage 1 streams the 4-bit
 * plane every token, and with fewer page walks ran about 1.1x as fast on the Intel Xeon (Gemma-3,
 * greedy); stage 2 reads records of the fifth bits scattered over 35 MB (Gemma-3 at top-k 40: about
 * 6300 a token), each a page walk of its own in 4 KiB pages. The first sample, which builds the
 * planes, can take a few hundred ms longer there (some runs the VM is slow to fault in 2 MiB pages;
 * the kernel does not compact for them), so the low bits, which stage 3 reads for a few rows only,
 * keep small pages. */
static void *huge_alloc(size_t n) {
    const size_t huge = (size_t)2 << 20;
    void *p;
    if (posix_memalign(&p, huge, n) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, n, MADV_HUGEPAGE);
#endif
    return p;
}

/* The planes' shape for rows of n weights, and their memory (0 if there is none) */
static int screen_alloc(se_screen *s, int64_t n, int64_t n_rows, int stand) {
    s->nb = n / SE_QK;
    s->nbp = (s->nb + 7) / 8 * 8;
    s->n_rows = n_rows;
    s->n_tiles = (n_rows + SE_SCREEN_TILE - 1) / SE_SCREEN_TILE;
    s->tile_size = (size_t)(SE_SCREEN_TILE_BLOCK * s->nb);
    s->fifth_size = (size_t)(4 * s->nbp + 2 * s->nb);
    s->tiles = huge_alloc(s->tile_size * (size_t)s->n_tiles);
    s->fifth = huge_alloc(s->fifth_size * (size_t)n_rows);
    s->low = stand ? malloc(se_screen_low_size(s) * (size_t)n_rows) : NULL;
    return s->tiles && s->fifth && (s->low || !stand);
}

static void free_planes(se_screen *s) { free(s->tiles); free(s->fifth); free(s->low); }

/* Whether the head has more bytes than the layers' weights (Gemma-3-270M: 178 MB against 68;
 * SmolLM2-135M: 30 against 66). A pass of several contexts reads the layers once for all of them;
 * screening their heads saves about half the head's bytes, and costs each context a pass over its
 * bounds and stage 2 of its own, which paid on Gemma-3 and not on SmolLM2 (README, "Screening
 * the output head"). */
static int head_outweighs_layers(const se_model *m) {
    int64_t layers = 0;
    for (int32_t l = 0; l < m->hp.n_layer; l++)
        for (int t = 0; t < SE_T_COUNT; t++) {
            const se_tensor *w = &m->layers[l].t[t];
            if (w->data) layers += w->ne1 * (int64_t)w->row_size;
        }
    return m->output.ne1 * (int64_t)m->output.row_size > layers;
}

/* Whether the full head from the planes comes straight from them (the AVX-512 path), as fast as
 * the head's own read; else its rows are rebuilt first */
static int planes_head_direct(void) { return se_isa_in_use() >= SE_ISA_AVX512 && se_screen_head_avx512; }

/* The model's plane, built on c's pool the first time (the contexts of a model may ask from
 * several threads at once: the lock). NULL when the head cannot be screened. */
static const se_screen *screen_of(se_context *c) {
    se_model *m = (se_model *)c->m; /* the plane is the model's, built once, then read only */
    pthread_mutex_lock(&m->screen_lock);
    if (m->screen_state == 0) {
        se_screen *s = se_screen_possible(m) ? calloc(1, sizeof *s) : NULL;
        m->screen_state = -1; /* until it is built */
        /* the planes stand for the head where its pages can leave memory (a file mapping), and
         * either the full head from the planes costs what the head's own does (the AVX-512 path)
         * or the head outweighs the layers. Elsewhere a head rebuilt from the planes costs twice
         * its own, and on SmolLM2 a sampler that backs off (top-k 40 without min-p) ran 0.82x as fast */
        const int batch = head_outweighs_layers(m), stand = m->file_mapped && (batch || planes_head_direct());
        if (s && screen_alloc(s, m->output.ne0, m->output.ne1, stand)) {
            s->batch = batch;
            build_job j = { .s = s, .w = &m->output, .release = stand };
            int nth = c->cp.n_threads_batch < 64 ? c->cp.n_threads_batch : 64;
            se_pool_run(c->pool, nth, build_rows, &j);
            int bad = 0;
            for (int i = 0; i < nth; i++) bad |= j.bad[i];
            if (!bad) {
                __atomic_store_n(&m->screen, s, __ATOMIC_RELEASE); /* se_screen_embedding_row reads it unlocked */
                m->screen_state = 1;
                s = NULL;
            }
        }
        se_screen_free(s);
    }
    pthread_mutex_unlock(&m->screen_lock);
    return m->screen_state == 1 ? m->screen : NULL;
}

void se_screen_free(se_screen *s) {
    if (s) { free_planes(s); free(s); }
}

size_t se_model_screen_bytes(const se_model *m) {
    const se_screen *s = m ? m->screen : NULL;
    if (!s) return 0;
    return s->tile_size * (size_t)s->n_tiles + (s->fifth_size + (s->low ? se_screen_low_size(s) : 0)) * (size_t)s->n_rows;
}

/* ---------------------------------------------------------------------------------------------
 * The bound kernels, portable
 */

void se_screen_bounds_scalar(const se_screen *s, const se_screen_act *a, int64_t t0, int64_t t1, float *lo,
                             float *hi) {
    for (int64_t t = t0; t < t1; t++)
        for (int i = 0; i < SE_SCREEN_TILE; i++) {
            const uint8_t *tile = se_screen_tile(s, t);
            float l = 0, h = 0;
            for (int64_t b = 0; b < s->nb; b++) {
                const uint8_t *blk = tile + SE_SCREEN_TILE_BLOCK * b, *nib = blk + 32 + 4 * i;
                const int8_t *x = a->xq + 32 * b;
                int32_t sum = 0;
                for (int m = 0; m < 4; m++)
                    for (int e = 0; e < 4; e++)
                        sum += (nib[64 * m + e] & 15) * x[8 * m + e] + (nib[64 * m + e] >> 4) * x[8 * m + 4 + e];
                uint16_t d;
                memcpy(&d, blk + 2 * i, 2);
                const float dd = se_fp16_to_fp32(d) * a->dx[b];
                l = fmaf(dd, (float)(16 * sum + a->lo_c[b]), l); /* the SIMD paths' operations, in their order */
                h = fmaf(dd, (float)(16 * sum + a->hi_c[b]), h);
            }
            lo[t * SE_SCREEN_TILE + i] = l;
            hi[t * SE_SCREEN_TILE + i] = h;
        }
}

void se_screen_refine_scalar(const se_screen *s, const se_screen_act *a, const int32_t *ids, int32_t n, float *up,
                             float *down) {
    for (int32_t i = 0; i < n; i++) {
        const uint8_t *bits = se_screen_record(s, ids[i]);
        const uint16_t *d = (const uint16_t *)(bits + 4 * s->nbp);
        float u = 0, w = 0;
        for (int64_t b = 0; b < s->nb; b++) {
            const uint8_t *group = bits + 32 * (b / 8);
            const int8_t *x = a->xq + 32 * b;
            int32_t sum = 0;
            for (int j = 0; j < SE_QK; j++) sum += (group[j] >> (b % 8) & 1) * x[j];
            float dd = se_fp16_to_fp32(d[b]) * a->dx[b];
            u += dd * (float)(8 * sum + a->neg8[b]);
            w += dd * (float)(8 * sum + a->pos8[b]);
        }
        up[i] = u;
        down[i] = w;
    }
}

void se_screen_settle_scalar(const se_screen *s, const se_screen_act *a, const int32_t *ids, int32_t n, float *up,
                             float *down) {
    for (int32_t i = 0; i < n; i++) {
        const uint16_t *d = (const uint16_t *)(se_screen_record(s, ids[i]) + 4 * s->nbp);
        const uint32_t *low = se_screen_low(s, ids[i]);
        float u = 0, w = 0;
        for (int64_t b = 0; b < s->nb; b++) {
            const int8_t *x = a->xq + 32 * b;
            int32_t sum = 0;
            for (int e = 0; e < SE_QK; e++) sum += low_of(low + 3 * b, e) * x[e];
            float dd = se_fp16_to_fp32(d[b]) * a->dx[b];
            u += dd * (float)(sum + a->neg7[b]);
            w += dd * (float)(sum + a->pos7[b]);
        }
        up[i] = u;
        down[i] = w;
    }
}

void se_screen_row_scalar(const se_screen *s, int64_t r, void *out) {
    const int i = (int)(r % SE_SCREEN_TILE);
    const uint8_t *tile = se_screen_tile(s, r / SE_SCREEN_TILE), *bits = se_screen_record(s, r);
    const uint32_t *low = se_screen_low(s, r);
    se_blk_q8_0 *q = out;
    for (int64_t b = 0; b < s->nb; b++) {
        const uint8_t *nib = tile + SE_SCREEN_TILE_BLOCK * b + 32 + 4 * i, *group = bits + 32 * (b / 8);
        memcpy(&q[b].d, bits + 4 * s->nbp + 2 * b, 2);
        for (int e = 0; e < SE_QK; e++) {
            const int h = nib[64 * (e / 8) + e % 4] >> (e % 8 / 4 * 4) & 15, f = group[e] >> (b % 8) & 1;
            q[b].qs[e] = (int8_t)(16 * h + 8 * f + low_of(low + 3 * b, e) - 128);
        }
    }
}

static se_screen_row_fn row_kernel(void) {
    return se_isa_in_use() >= SE_ISA_AVX2 && se_screen_row_avx2 ? se_screen_row_avx2 : se_screen_row_scalar;
}

/* ---------------------------------------------------------------------------------------------
 * The head, full or screened
 */

/* What the screen of one sample needs on every thread */
typedef struct {
    se_context *c;
    const se_screen *s;
    const se_sampling_params *sp;
    int k;
    float log_min_p;  /* logf(min_p), as sampling.c adds it to the best logit; -inf: no min-p's route */
    int route;        /* out: the screen took min-p's route (screen_rows) */
    const int32_t *pen; /* the penalized and the banned tokens, ascending, and how many */
    int32_t n_pen;
    int64_t n_left; /* out: the rows stage 1 left (stage 2 narrowed them) */
} screen_job;

/* This thread's activations of the head (the output norm, then the head's act type): the forward
 * pass would have made the same ones */
static void head_acts(se_context *c, int ith, int nth, se_acts *a) {
    const se_model *m = c->m;
    const se_tensor *w[1] = { &m->output };
    se_prep_acts(c, ith, nth, c->head_x, m->hp.n_embd, 1, m->output_norm.data, w, 1, a);
}

static void full_head(void *arg, int ith, int nth) {
    se_context *c = arg;
    se_acts a;
    head_acts(c, ith, nth, &a);
    int64_t r0, r1;
    se_split(c->m->hp.n_vocab, ith, nth, SPLIT_ALIGN, &r0, &r1);
    se_matmul_rows(&c->m->output, &a, 1, c->logits, c->m->hp.n_vocab, r0, r1);
}

static int screen_buffers(se_context *c);
static size_t act_bytes(int64_t nb);
static void make_act(const se_blk_q8_0 *x, int64_t nb, void *buf, se_screen_act *out);

#define PLANE_ROWS 32 /* rows the full head from the planes rebuilds at a time, into a thread's scratch */
#define PLANES_AHEAD 32 /* rows ahead whose planes it asks for (two tiles) */

/* The logits of rows [r0, r1) (r0 on a tile's first row) from planes that stand for the head, for
 * one token's Q8_0 activations x, the head's bits: on the AVX-512 path straight from the planes,
 * else from rows rebuilt a few at a time and the head's own kernel. buf: act_bytes(nb); scratch:
 * PLANE_ROWS rows of nb Q8_0 blocks */
static void planes_logits(const se_screen *s, const se_blk_q8_0 *x, void *buf, se_blk_q8_0 *scratch, int64_t r0,
                          int64_t r1, float *out) {
    if (planes_head_direct()) {
        se_screen_act xa;
        make_act(x, s->nb, buf, &xa);
        se_screen_head_avx512(s, &xa, r0 / SE_SCREEN_TILE, (r1 + SE_SCREEN_TILE - 1) / SE_SCREEN_TILE, (int32_t *)scratch, out);
        return;
    }
    const se_screen_row_fn rebuild = row_kernel();
    const size_t share = s->tile_size / SE_SCREEN_TILE; /* a row's part of its tile */
    for (int64_t r = r0; r < r1; r += PLANE_ROWS) {
        const int64_t n = r1 - r < PLANE_ROWS ? r1 - r : PLANE_ROWS;
        for (int64_t i = 0; i < n; i++) {
            /* the planes stream from memory: ask for a row's record, l and share of its tile two tiles ahead */
            const int64_t ahead = r + i + PLANES_AHEAD;
            if (ahead < r1) {
                const char *rec = (const char *)se_screen_record(s, ahead), *low = (const char *)se_screen_low(s, ahead);
                const char *tile = (const char *)se_screen_tile(s, ahead / SE_SCREEN_TILE) + share * (size_t)(ahead % SE_SCREEN_TILE);
                for (size_t o = 0; o < s->fifth_size; o += 64) __builtin_prefetch(rec + o);
                for (size_t o = 0; o < se_screen_low_size(s); o += 64) __builtin_prefetch(low + o);
                for (size_t o = 0; o < share; o += 64) __builtin_prefetch(tile + o);
            }
            rebuild(s, r + i, scratch + i * s->nb);
        }
        se_matmul(SE_Q8_0, scratch, 32 * s->nb, x, 1, out + r, 1, 0, n);
    }
}

/* The full head from the planes (the fallback of a screened sampler: its head's pages may have
 * left memory), the same bits */
static void planes_head(void *arg, int ith, int nth) {
    se_context *c = arg;
    se_acts a;
    head_acts(c, ith, nth, &a);
    int64_t r0, r1;
    se_split(c->m->hp.n_vocab, ith, nth, SPLIT_ALIGN, &r0, &r1);
    const se_screen *s = c->m->screen;
    planes_logits(s, (const se_blk_q8_0 *)a.ptr[0], (char *)c->scr_act + (size_t)ith * c->scr_act_bytes,
                  (se_blk_q8_0 *)c->scr_rows + (size_t)ith * PLANE_ROWS * (size_t)s->nb, r0, r1, c->logits);
}

int se_context_head_from_planes(se_context *c) {
    const se_screen *s = c ? c->m->screen : NULL;
    if (!s || !s->low || !c->head_pending || !screen_buffers(c)) return SE_ERR_INVALID;
    se_pool_run(c->pool, c->cp.n_threads, planes_head, c);
    c->head_pending = 0;
    c->scr_ready = 0;
    return SE_OK;
}

const void *se_screen_embedding_row(const se_model *m, int32_t t, void *row) {
    const se_screen *s = __atomic_load_n(&m->screen, __ATOMIC_ACQUIRE);
    if (!s || !s->low || m->output.data != m->token_embd.data) return NULL;
    row_kernel()(s, t, row);
    return row;
}

int se_context_head(se_context *c) {
    if (!c) return SE_ERR_INVALID;
    if (c->head_pending) {
        se_pool_run(c->pool, c->cp.n_threads, full_head, c);
        c->head_pending = 0;
        c->scr_ready = 0;
    }
    return SE_OK;
}

int se_context_head_pending(const se_context *c) { return c && c->head_pending; }

int se_context_set_lazy_head(se_context *c, int32_t on) {
    if (!c) return SE_ERR_INVALID;
    if (!on) se_context_head(c); /* nothing stays pending once it is off */
    c->lazy_head = on == 2 ? 2 : on != 0;
    c->screen_skip = 0;
    c->screen_backoff = 1;
    c->scr_heavy = -1;
    return SE_OK;
}

void se_context_screen_stats(const se_context *c, int64_t out[SE_SCREEN_STATS]) {
    for (int i = 0; i < SE_SCREEN_STATS; i++) out[i] = c->screen_stats[i];
}

/* The exact logit of row r with the head's own kernel, one row (the full head's bits: a row's sum
 * does not depend on the rows beside it), on the head's row or, where the planes stand for the
 * head, on its blocks rebuilt from them */
static float exact_row(const se_context *c, const se_acts *a, int64_t r) {
    const se_tensor *w = &c->m->output;
    se_blk_q8_0 rebuilt[SE_SCREEN_MAX_NB];
    const void *row = (const char *)w->data + (size_t)r * w->row_size;
    if (c->m->screen->low) {
        row_kernel()(c->m->screen, r, rebuilt);
        row = rebuilt;
    }
    float y;
    se_matmul(SE_Q8_0, row, w->ne0, a->ptr[0], 1, &y, 1, 0, 1);
    return y;
}

/* The sampler's penalty of a token seen n times in its window (sampling.c applies the same) */
float se_penalized(float l, int32_t n, const se_sampling_params *sp) {
    l = l <= 0 ? l * sp->repeat_penalty : l / sp->repeat_penalty;
    return l - ((float)n * sp->frequency_penalty + sp->presence_penalty);
}

/* A token's activations in the kernels' form (screen.h) in buf (act_bytes(nb) bytes), from its
 * Q8_0 activations x */
static size_t act_bytes(int64_t nb) { return (size_t)((nb + 7) / 8 * 8) * (32 + 7 * 4); }

static void make_act(const se_blk_q8_0 *x, int64_t nb, void *buf, se_screen_act *out) {
    const int64_t nbp = (nb + 7) / 8 * 8;
    int8_t *xq = buf;
    float *dx = (float *)(xq + nbp * 32);
    int32_t *lo_c = (int32_t *)(dx + nbp), *hi_c = lo_c + nbp, *neg8 = hi_c + nbp, *pos8 = neg8 + nbp;
    int32_t *neg7 = pos8 + nbp, *pos7 = neg7 + nbp;
    memset(buf, 0, act_bytes(nb));
    for (int64_t b = 0; b < nb; b++) {
        int32_t sum = 0, neg = 0, pos = 0;
        for (int i = 0; i < SE_QK; i++) {
            int32_t v = x[b].qs[i];
            xq[32 * b + i] = (int8_t)v;
            sum += v;
            if (v < 0) neg += v; else pos += v;
        }
        dx[b] = se_fp16_to_fp32(x[b].d);
        lo_c[b] = -128 * sum + 15 * neg;
        hi_c[b] = -128 * sum + 15 * pos;
        neg8[b] = -8 * neg;
        pos8[b] = -8 * pos;
        neg7[b] = -7 * neg;
        pos7[b] = -7 * pos;
    }
    *out = (se_screen_act){ xq, dx, lo_c, hi_c, neg8, pos8, neg7, pos7 };
}

static int avx2(void) { return se_isa_in_use() >= SE_ISA_AVX2 && se_screen_bounds_avx2 && se_screen_refine_avx2; }

static se_screen_refine_fn refine_kernel(void) { return avx2() ? se_screen_refine_avx2 : se_screen_refine_scalar; }

static se_screen_refine_fn settle_kernel(void) {
    return avx2() && se_screen_settle_avx2 ? se_screen_settle_avx2 : se_screen_settle_scalar;
}

static se_screen_bounds_fn bounds_kernel(void) {
    if (se_isa_in_use() >= SE_ISA_AVX512 && se_screen_bounds_avx512) return se_screen_bounds_avx512;
    return avx2() ? se_screen_bounds_avx2 : se_screen_bounds_scalar;
}

/* Stage 1: every row's interval for rows [r0, r1) (r0 on a tile's first row; lo and hi hold
 * whole tiles), the kernel's widened by a bound on float rounding. The kernel's sums and the head's own each err by under 2^-14 of 511 times the row's
 * sum over blocks of d*dx*sum|x|, and the interval's width is 15 times that sum
 * (spec/reference-engine.md): 2^-8 of the width covers both. (A NaN, which makes no interval,
 * is caught by my_top.) */
static void widen(int64_t r0, int64_t r1, float *lo, float *hi) {
    for (int64_t r = r0; r < r1; r++) {
        float m = (hi[r] - lo[r]) * 0x1p-8f;
        lo[r] -= m;
        hi[r] += m;
    }
}

static void bounds(const se_screen *s, const se_screen_act *xa, int64_t r0, int64_t r1, float *lo, float *hi) {
    if (r1 > r0) bounds_kernel()(s, xa, r0 / SE_SCREEN_TILE, (r1 + SE_SCREEN_TILE - 1) / SE_SCREEN_TILE, lo, hi);
    widen(r0, r1, lo, hi);
}

/* Stage 2 (kernel: refine), or stage 3 (settle): the intervals of rows ids[0..n) narrowed by their
 * fifth bits, or their low bits (up and down: n floats of scratch). The moves are sums of terms of
 * one sign, each within 8*d*dx*sum|x|: they err by under 2^-14 of up - down, and adding them to
 * the ends by far less, so widening by 2^-10 of up - down keeps the interval sound. */
static void narrow(se_screen_refine_fn kernel, const se_screen *s, const se_screen_act *xa, const int32_t *ids,
                   int32_t n, float *up, float *down, float *lo, float *hi) {
    if (n > 0) kernel(s, xa, ids, n, up, down);
    for (int32_t i = 0; i < n; i++) {
        float m = (up[i] - down[i]) * 0x1p-10f;
        lo[ids[i]] += up[i] - m;
        hi[ids[i]] += down[i] + m;
    }
}

/* Whether token t is in the ascending list of n tokens */
static int is_listed(const int32_t *pen, int32_t n, int32_t t) {
    int32_t a = 0, b = n;
    while (a < b) {
        int32_t m = (a + b) / 2;
        if (pen[m] < t) a = m + 1; else b = m;
    }
    return a < n && pen[a] == t;
}

#define SCREEN_BACKOFF_MAX 32 /* the most samples that take the full head after a screen that left too many rows */
#define SCREEN_AHEAD 8 /* candidates whose rows are asked for before they are computed */

/* A piece of work: entries [i0, i1) of the list that thread t made in its rows (from r0 on) */
typedef void (*piece_fn)(screen_job *j, const se_screen_act *xa, const se_acts *a, int64_t r0, int32_t i0,
                         int32_t i1);

/* Stage 2 for a piece of the rows stage 1 left (the lists at scr_ids) */
static void refine_piece(screen_job *j, const se_screen_act *xa, const se_acts *a, int64_t r0, int32_t i0,
                         int32_t i1) {
    se_context *c = j->c;
    (void)a;
    narrow(refine_kernel(), j->s, xa, c->scr_ids + r0 + i0, i1 - i0, c->scr_up + r0 + i0, c->scr_down + r0 + i0, c->scr_lo,
           c->scr_hi);
}

/* Asks for what row r's exact logit reads: the head's row, or its record and its lanes of each
 * block of its tile */
static void prefetch_row(const se_model *m, int64_t r) {
    const se_screen *s = m->screen;
    if (!s->low) {
        const char *row = (const char *)m->output.data + (size_t)r * m->output.row_size;
        for (size_t o = 0; o < m->output.row_size; o += 64) __builtin_prefetch(row + o);
        return;
    }
    const uint8_t *rec = se_screen_record(s, r);
    const uint8_t *nib = se_screen_tile(s, r / SE_SCREEN_TILE) + 32 + 4 * (r % SE_SCREEN_TILE);
    for (size_t o = 0; o < s->fifth_size; o += 64) __builtin_prefetch(rec + o);
    for (size_t o = 0; o < se_screen_low_size(s); o += 64) __builtin_prefetch((const char *)se_screen_low(s, r) + o);
    for (int64_t b = 0; b < s->nb; b++)
        for (int m = 0; m < 4; m++) __builtin_prefetch(nib + SE_SCREEN_TILE_BLOCK * b + 64 * m);
}

/* The exact logits of a piece of the candidates (the lists at cand; the penalized rows have
 * theirs), their rows asked for from memory a few candidates ahead: they lie anywhere */
static void exact_piece(screen_job *j, const se_screen_act *xa, const se_acts *a, int64_t r0, int32_t i0,
                        int32_t i1) {
    se_context *c = j->c;
    se_cand *cand = c->cand + r0;
    (void)xa;
    for (int32_t i = i0; i < i1; i++) {
        if (i + SCREEN_AHEAD < i1) prefetch_row(c->m, cand[i + SCREEN_AHEAD].id);
        if (!is_listed(j->pen, j->n_pen, cand[i].id)) cand[i].logit = exact_row(c, a, cand[i].id);
    }
}

/* fn over this thread's even share of the threads' lists (scr_n[t] entries each) laid end to end:
 * the rows left are uneven across the vocabulary (common tokens have low ids), so each thread
 * takes the same number whoever found them */
static void for_my_share(screen_job *j, const se_screen_act *xa, const se_acts *a, int ith, int nth, piece_fn fn) {
    se_context *c = j->c;
    int64_t total = 0, off = 0;
    for (int t = 0; t < nth; t++) total += c->scr_n[t];
    const int64_t g0 = total * ith / nth, g1 = total * (ith + 1) / nth;
    for (int t = 0; t < nth && off < g1; off += c->scr_n[t], t++) {
        const int64_t i0 = g0 > off ? g0 - off : 0, i1 = g1 < off + c->scr_n[t] ? g1 - off : c->scr_n[t];
        int64_t r0, r1;
        se_split(c->m->hp.n_vocab, t, nth, SPLIT_ALIGN, &r0, &r1);
        if (i0 < i1) fn(j, xa, a, r0, (int32_t)i0, (int32_t)i1);
    }
}

/* Row r offered to a heap of the k rows of largest lower bound: most rows fall below its least
 * one, and are turned away here without a call */
static inline void offer(se_cand *top, int k, int32_t *n, int32_t r, float lo) {
    if (*n < k || lo >= top[0].logit) se_cand_push(top, k, n, (se_cand){ r, lo });
}

/* This thread's k rows of largest lower bound, into its heap at scr_top and their count into
 * scr_n (-1 if not all bounds are numbers): of all its rows [r0, r1) (left = NULL), or of the
 * n_left rows at left whose upper bound still reaches thr */
static void my_top(screen_job *j, int ith, int64_t r0, int64_t r1, const se_cand *left, int32_t n_left, float thr) {
    se_context *c = j->c;
    const float *lo = c->scr_lo, *hi = c->scr_hi;
    se_cand *top = c->scr_top + (size_t)ith * SE_SCREEN_MAX_K;
    int32_t n = 0, numbers = 1;
    if (!left) {
        for (int64_t r = r0; r < r1; r++) numbers &= lo[r] <= hi[r]; /* false for a NaN */
        const int32_t k = j->k;
        float least = -INFINITY; /* the heap's least logit once it is full, in a register */
        for (int64_t r = r0; r < r1; r++)
            if (lo[r] >= least) {
                se_cand_push(top, k, &n, (se_cand){ (int32_t)r, lo[r] });
                if (n == k) least = top[0].logit;
            }
    } else {
        for (int32_t i = 0; i < n_left; i++)
            if (hi[left[i].id] >= thr) offer(top, j->k, &n, left[i].id, lo[left[i].id]);
    }
    c->scr_n[ith] = numbers ? n : -1;
}

/* A threshold that k rows reach: the threads' heaps merged (each thread finds the same k rows of
 * largest lower bound), those rows computed exactly (into scr_exact), the least of their logits,
 * and the largest into *best. A row whose upper bound is below it has a logit below k others: it
 * cannot be in the top k, whatever the ties. NAN when there is none (fewer than k rows, or bounds
 * that are not numbers). Call after a barrier that follows my_top on every thread; it ends with one. */
static float threshold(screen_job *j, const se_acts *a, int ith, int nth, float *best) {
    se_context *c = j->c;
    const int k = j->k;
    se_cand all[SE_SCREEN_MAX_K];
    int32_t na = 0;
    for (int t = 0; t < nth; t++)
        if (c->scr_n[t] < 0) na = -SE_SCREEN_MAX_K * nth;
    for (int t = 0; t < nth && na >= 0; t++)
        for (int i = 0; i < c->scr_n[t]; i++) se_cand_push(all, k, &na, c->scr_top[(size_t)t * SE_SCREEN_MAX_K + i]);
    for (int i = ith; i < na && na == k; i += nth)
        c->scr_exact[i] = is_listed(j->pen, j->n_pen, all[i].id) ? all[i].logit : exact_row(c, a, all[i].id);
    se_pool_barrier(c->pool); /* everyone has read scr_n and scr_top, and written its exact rows */
    float thr = na == k ? INFINITY : NAN;
    for (int i = 0; i < na && na == k; i++) {
        thr = c->scr_exact[i] < thr ? c->scr_exact[i] : thr;
        *best = c->scr_exact[i] > *best ? c->scr_exact[i] : *best;
    }
    return thr;
}

/* Stage 3, where the planes keep l: this thread's candidates cand[0..n) (its rows, from r0 on)
 * settled by their low bits, and those whose upper end falls below thr dropped; returns how many
 * are left (the rows a sample can take, give or take the rounding margins) */
static int32_t settle(screen_job *j, const se_screen_act *xa, int64_t r0, se_cand *cand, int32_t n, float thr) {
    se_context *c = j->c;
    int32_t *ids = c->scr_ids + r0, m = 0; /* stage 2 is done with this thread's part */
    for (int32_t i = 0; i < n; i++)
        if (!is_listed(j->pen, j->n_pen, cand[i].id)) ids[m++] = cand[i].id; /* (a penalized row's is a point) */
    narrow(settle_kernel(), j->s, xa, ids, m, c->scr_up + r0, c->scr_down + r0, c->scr_lo, c->scr_hi);
    int32_t kept = 0;
    for (int32_t i = 0; i < n; i++)
        if (c->scr_hi[cand[i].id] >= thr) cand[kept++] = (se_cand){ cand[i].id, c->scr_lo[cand[i].id] };
    return kept;
}

static void screen_rows(void *arg, int ith, int nth) {
    screen_job *j = arg;
    se_context *c = j->c;
    se_acts a;
    head_acts(c, ith, nth, &a);
    se_screen_act xa;
    make_act(a.ptr[0], j->s->nb, (char *)c->scr_act + (size_t)ith * c->scr_act_bytes, &xa);
    int64_t r0, r1;
    se_split(c->m->hp.n_vocab, ith, nth, SPLIT_ALIGN, &r0, &r1);
    float *lo = c->scr_lo, *hi = c->scr_hi;
    /* stage 1 (unless the pass that left the head pending did it) */
    if (!c->scr_ready) bounds(j->s, &xa, r0, r1, lo, hi);
    /* the penalized rows: exact, penalized, an interval of one point; the banned ones at -inf */
    int32_t p0 = 0;
    while (p0 < j->n_pen && j->pen[p0] < r0) p0++;
    for (int32_t p = p0; p < j->n_pen && j->pen[p] < r1; p++) {
        int32_t t = j->pen[p];
        lo[t] = hi[t] = is_listed(c->ban, c->n_ban, t) ? -INFINITY
                                                        : se_penalized(exact_row(c, &a, t), c->counts[t], j->sp);
    }
    my_top(j, ith, r0, r1, NULL, 0, -INFINITY);
    se_pool_barrier(c->pool);
    /* the rows a sample can take have logits at or above the top-k threshold and, with min-p, at or
     * above best + logf(min_p): best is a logit some row has, so at most the largest one, and the
     * float sum rounds the same way. Min-p's route, where that cut is the higher one, keeps the
     * rows that reach it; else the top-k rule as without min-p (everything here is the same on
     * every thread) */
    float best = -INFINITY;
    const float thr1 = threshold(j, &a, ith, nth, &best);
    const int route = best + j->log_min_p > thr1; /* false for a NaN thr1 */
    const float cut1 = route ? best + j->log_min_p : thr1;
    /* the rows stage 1 left, in order, to this thread's part of cand (the rest of the screen looks
     * at them only); stage 2 for those not penalized (a penalized row's interval is its exact value) */
    se_cand *left = c->cand + r0;
    int32_t n_left = 0, n_kept = 0;
    for (int64_t r = r0; r < r1 && cut1 == cut1; r++)
        if (hi[r] >= cut1) {
            left[n_kept++].id = (int32_t)r;
            if (!is_listed(j->pen, j->n_pen, (int32_t)r)) c->scr_ids[r0 + n_left++] = (int32_t)r;
        }
    c->scr_n[ith] = n_left;
    se_pool_barrier(c->pool);
    if (ith == 0)
        for (int t = 0; t < nth; t++) j->n_left += c->scr_n[t];
    for_my_share(j, &xa, &a, ith, nth, refine_piece);
    se_pool_barrier(c->pool); /* every interval is final */
    /* a second threshold from the narrower intervals: about half the exact rows where stage 1
     * leaves many */
    my_top(j, ith, r0, r1, left, n_kept, cut1);
    se_pool_barrier(c->pool);
    const float thr2 = thr1 == thr1 ? threshold(j, &a, ith, nth, &best) : NAN, thr_k = thr2 > thr1 ? thr2 : thr1;
    /* the route ends when the top-k threshold has passed min-p's cut: its candidates then hold the
     * top k, as without min-p (a row that stage 1 left out is below min-p's cut, so below it) */
    const float t = best + j->log_min_p, thr = route && t > thr_k ? t : thr_k;
    if (ith == 0) j->route = route && t > thr_k;
    int32_t n_cand = 0; /* the candidates, in place of the rows left (n_cand <= i) */
    for (int32_t i = 0; i < n_kept && thr == thr; i++)
        if (hi[left[i].id] >= thr) left[n_cand++] = (se_cand){ left[i].id, lo[left[i].id] };
    if (j->s->low) n_cand = settle(j, &xa, r0, left, n_cand, thr);
    c->scr_n[ith] = n_cand;
    se_pool_barrier(c->pool);
    for_my_share(j, &xa, &a, ith, nth, exact_piece);
}

/* The k a screen serves for these sampling parameters, 0 when the sampler needs more than the top
 * of the distribution (no top-k at temperature > 0) or its penalties could raise a logit */
static int screen_k(const se_sampling_params *sp) {
    if (!(sp->repeat_penalty >= 1) || !(sp->frequency_penalty >= 0) || !(sp->presence_penalty >= 0)) return 0;
    if (sp->temp <= 0) return 1;
    return sp->top_k >= 1 && sp->top_k <= SE_SCREEN_MAX_K ? sp->top_k : 0;
}

int se_context_plan_sample(se_context *c, const se_sampling_params *sp) {
    if (!c) return SE_ERR_INVALID;
    c->batch_screen = sp && screen_k(sp) > 0;
    return SE_OK;
}

static int screen_buffers(se_context *c) {
    if (c->scr_lo) return 1;
    const int64_t V = c->m->hp.n_vocab, nbp = (c->m->output.ne0 / SE_QK + 7) / 8 * 8;
    const size_t tiled = (size_t)(V + SE_SCREEN_TILE - 1) / SE_SCREEN_TILE * SE_SCREEN_TILE; /* stage 1 writes whole tiles */
    int n_thr = se_pool_size(c->pool);
    c->scr_act_bytes = act_bytes(nbp);
    c->scr_lo = malloc(tiled * sizeof(float));
    c->scr_hi = malloc(tiled * sizeof(float));
    c->scr_top = malloc((size_t)n_thr * SE_SCREEN_MAX_K * sizeof(se_cand));
    c->scr_exact = malloc(SE_SCREEN_MAX_K * sizeof(float));
    c->scr_n = malloc((size_t)n_thr * sizeof(int32_t));
    c->scr_act = malloc((size_t)n_thr * c->scr_act_bytes);
    c->scr_pen = malloc((size_t)(c->cp.n_ctx + V) * sizeof(int32_t)); /* the window's and the banned tokens */
    c->scr_ids = malloc((size_t)V * sizeof(int32_t));
    c->scr_up = malloc((size_t)V * sizeof(float));
    c->scr_down = malloc((size_t)V * sizeof(float));
    c->scr_rows = malloc((size_t)n_thr * PLANE_ROWS * (size_t)(c->m->output.ne0 / SE_QK) * sizeof(se_blk_q8_0));
    if (c->scr_lo && c->scr_hi && c->scr_top && c->scr_exact && c->scr_n && c->scr_act && c->scr_pen && c->scr_ids &&
        c->scr_up && c->scr_down && c->scr_rows)
        return 1;
    se_screen_context_free(c);
    return 0;
}

void se_screen_context_free(se_context *c) {
    free(c->scr_lo); free(c->scr_hi); free(c->scr_top); free(c->scr_exact); free(c->scr_n); free(c->scr_act);
    free(c->scr_pen); free(c->scr_ids); free(c->scr_up); free(c->scr_down); free(c->scrb_act); free(c->scr_rows);
    c->scrb_act = c->scr_rows = NULL;
    c->scr_ready = 0;
    c->scr_lo = c->scr_hi = c->scr_exact = c->scr_up = c->scr_down = NULL;
    c->scr_top = NULL;
    c->scr_n = c->scr_pen = c->scr_ids = NULL;
    c->scr_act = NULL;
}


/* ---------------------------------------------------------------------------------------------
 * Stage 1 in a pass of several contexts (se_context_plan_sample): a few contexts' rows bounded
 * together, each tile of the plane read from memory once for all of them (then from cache), by
 * the kernel of one token, so the bounds are those of each one alone
 */

/* Whether this sample takes the full head instead of a screen, counting it: the last screen left
 * too many rows (se_screen_candidates), so the full head for a while; never in the tests' mode */
static int backing_off(se_context *c) {
    if (c->screen_skip <= 0 || c->lazy_head == 2) return 0;
    c->screen_skip--;
    return 1;
}

int se_screen_defer(se_context *c, se_context *ctx) {
    if (!ctx->lazy_head || !ctx->batch_screen || !se_screen_possible(ctx->m)) return 0;
    const int always = ctx->lazy_head == 2; /* the tests' mode: whenever it can */
    const se_screen *s = screen_of(ctx);
    if (!s || !(s->batch || always)) return 0;
    if (backing_off(ctx)) return 0;
    /* a screen that narrows many rows costs about what this context's share of the pass's head
     * does: after one, the pass computes its logits, and tries again now and then */
    if (ctx->scr_heavy >= 0 && !always && ++ctx->scr_heavy < SCREEN_BACKOFF_MAX) return 0;
    if (!screen_buffers(ctx)) return 0;
    if (!c->scrb_act)
        c->scrb_act = malloc((size_t)se_pool_size(c->pool) * SE_SCREEN_BATCH * act_bytes(c->m->output.ne0 / SE_QK));
    return c->scrb_act != NULL;
}

void se_screen_stage1_batch(se_context *c, int ith, int nth, const se_acts *a) {
    const se_screen *s = c->m->screen;
    const size_t ab = act_bytes(s->nb), row = se_row_size(a->type[0], c->m->output.ne0);
    se_screen_act xa[SE_SCREEN_BATCH];
    float *lo[SE_SCREEN_BATCH], *hi[SE_SCREEN_BATCH];
    int n = 0;
    for (int si = 0; si < c->ub_nseg; si++) {
        se_context *ctx = c->ub_seg[si].ctx;
        if (!c->ub_seg[si].defer) continue;
        make_act((const se_blk_q8_0 *)((const char *)a->ptr[0] + (size_t)n * row), s->nb,
                 (char *)c->scrb_act + ((size_t)ith * SE_SCREEN_BATCH + (size_t)n) * ab, &xa[n]);
        lo[n] = ctx->scr_lo;
        hi[n] = ctx->scr_hi;
        n++;
    }
    int64_t r0, r1;
    se_split(c->m->hp.n_vocab, ith, nth, SPLIT_ALIGN, &r0, &r1);
    const se_screen_bounds_fn kernel = bounds_kernel();
    for (int64_t t = r0 / SE_SCREEN_TILE; t < (r1 + SE_SCREEN_TILE - 1) / SE_SCREEN_TILE; t++)
        for (int i = 0; i < n; i++) kernel(s, &xa[i], t, t + 1, lo[i], hi[i]);
    for (int i = 0; i < n; i++) widen(r0, r1, lo[i], hi[i]);
}

static int desc_float(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* The min-p route's end (screen_rows): from the candidates cand[0..n), exact, which hold every
 * row at or above min-p's threshold, the tokens that top-k, top-p and min-p leave (sampling.c's
 * truncate), in its order, into cand[0..m); returns m, or -1 when the rows the screen did not
 * compute could change them.
 *
 * min-p keeps the rows of the top k at or above thr = max + logf(min_p). If at most k rows reach
 * thr, they are all in the top k, and every other row of the top k is below thr. top-p, before
 * min-p, keeps the shortest prefix of the sorted top k whose share of the top k's sum reaches
 * top_p, so only its cut among those rows matters: the sum is the rows at or above thr plus a
 * tail of k - m rows below it, each less than exp(thr - max), and at least the largest k - m
 * logits below thr of the k rows the threshold computed exactly (scr_exact). A cut that the two
 * ends of that interval (widened by far more than the double sums' rounding) place the same is
 * the sampler's; otherwise the full head decides. */
static int32_t screened_survivors(se_context *c, const se_sampling_params *sp, int k, int32_t n) {
    se_cand *cand = c->cand;
    float mx = -INFINITY;
    for (int32_t i = 0; i < n; i++) mx = cand[i].logit > mx ? cand[i].logit : mx;
    if (!(mx > -INFINITY && mx < INFINITY)) return -1; /* NaNs or nothing but banned rows */
    const float thr = mx + logf(sp->min_p);
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++)
        if (cand[i].logit >= thr) cand[m++] = cand[i];
    if (m > k) return -1;
    qsort(cand, (size_t)m, sizeof *cand, se_cand_desc);
    if (!(sp->top_p < 1.0f) || m == 1) return m;
    float below[SE_SCREEN_MAX_K];
    int nb = 0;
    for (int i = 0; i < k; i++)
        if (c->scr_exact[i] < thr) below[nb++] = c->scr_exact[i];
    qsort(below, (size_t)nb, sizeof *below, desc_float);
    double head = 0, tail_lo = 0, cum = 0;
    const double tail_hi = (k - m) * exp((double)(thr - mx)), tol = 1e-9;
    for (int32_t i = 0; i < m; i++) head += exp((double)(cand[i].logit - mx));
    for (int i = 0; i < nb && i < k - m; i++) tail_lo += exp((double)(below[i] - mx));
    for (int32_t i = 0; i + 1 < m; i++) {
        cum += exp((double)(cand[i].logit - mx));
        if (cum >= sp->top_p * (1 + tol) * (head + tail_hi)) return i + 1; /* top-p's cut, for any tail */
        if (!(cum < sp->top_p * (1 - tol) * (head + tail_lo))) return -1;  /* too close to call */
    }
    return m;
}

#define ROUTE_UNDECIDED (-2) /* screen_candidates: min-p's route could not tell its cut from the rows it computed */

/* se_screen_candidates's screen, by min-p's route where route allows it and the sampler has one */
static int32_t screen_candidates(se_context *c, const se_sampling_params *sp, int k, int route, int32_t window,
                                 int *final) {
    if (backing_off(c)) return -1;
    const se_screen *s = screen_of(c);
    if (!s || !screen_buffers(c)) return -1;
    /* the penalized and the banned tokens, ascending, once each (counts holds the penalized ones'
     * occurrences meanwhile) */
    int32_t *pen = c->scr_pen, n_pen = 0;
    const int32_t *hist = c->tokens + (c->n_past - window);
    for (int32_t i = 0; i < window; i++)
        if (c->counts[hist[i]]++ == 0) pen[n_pen++] = hist[i];
    for (int32_t i = 0; i < c->n_ban; i++)
        if (c->counts[c->ban[i]]++ == 0) pen[n_pen++] = c->ban[i];
    qsort(pen, (size_t)n_pen, sizeof *pen, se_cmp_i32);
    /* min-p's route where the sampler applies min-p after the top k at temperature > 0 */
    const int min_p = route && k > 1 && sp->min_p > 0.0f && sp->min_p <= 1.0f;
    screen_job j = { c, s, sp, k, min_p ? logf(sp->min_p) : -INFINITY, 0, pen, n_pen, 0 };
    int nth = c->cp.n_threads;
    const int from_pass = c->scr_ready;
    se_pool_run(c->pool, nth, screen_rows, &j);
    c->scr_ready = 0; /* its bounds are spent: the penalized rows' were overwritten */
    for (int32_t i = 0; i < n_pen; i++) c->counts[pen[i]] = 0;
    /* the threads' candidates, in row order, to the front of cand */
    int32_t n = 0;
    for (int t = 0; t < nth; t++) {
        int64_t r0, r1;
        se_split(c->m->hp.n_vocab, t, nth, SPLIT_ALIGN, &r0, &r1);
        memmove(c->cand + n, c->cand + r0, (size_t)c->scr_n[t] * sizeof(se_cand));
        n += c->scr_n[t];
    }
    if (n < (j.route ? 1 : k)) { /* a bound that is not a number (the input was not): the full head decides */
        c->screen_stats[2]++;
        return -1;
    }
    const int32_t n_exact = n;
    if (j.route && (n = screened_survivors(c, sp, k, n)) < 0) {
        c->screen_stats[6]++;
        return ROUTE_UNDECIDED;
    }
    *final = j.route;
    c->screen_stats[5] += j.route;
    c->screen_stats[0]++;
    c->screen_stats[1] += n_exact;
    c->screen_stats[3] += j.n_left;
    c->screen_stats[4] += from_pass;
    c->scr_heavy = j.n_left > c->m->hp.n_vocab / 4 ? 0 : -1;
    /* Past an eighth of the rows computed exactly (read one by one), or three quarters narrowed by
     * stage 2 (a row of stage 1 or 2 costs about half a row of the full head), a screen costs about
     * what the full head does: the next samples take the full head, then it tries again. One such
     * sample among good ones is common (SmolLM2 at greedy), a run of them too (SmolLM2 at top-k 40):
     * each one in a row doubles the samples skipped, from 1 up to SCREEN_BACKOFF_MAX */
    if (c->lazy_head == 2) return n;
    const int64_t V = c->m->hp.n_vocab;
    if (n_exact > V / 8 || j.n_left > V / 4 * 3) {
        c->screen_skip = c->screen_backoff;
        c->screen_backoff = c->screen_backoff < SCREEN_BACKOFF_MAX ? 2 * c->screen_backoff : SCREEN_BACKOFF_MAX;
    } else {
        c->screen_backoff = 1;
    }
    return n;
}

int32_t se_screen_candidates(se_context *c, const se_sampling_params *sp, int32_t window, int *final) {
    *final = 0;
    const int k = c->head_pending ? screen_k(sp) : 0;
    int32_t n = k ? screen_candidates(c, sp, k, 1, window, final) : -1;
    /* where the planes stand for the head, the top-k rule's screen decides what min-p's route could
     * not (its stage 1 again and more exact rows cost less than the head rebuilt from the planes) */
    if (n == ROUTE_UNDECIDED && c->m->screen->batch) n = screen_candidates(c, sp, k, 0, window, final);
    if (n >= 0) return n;
    /* the full head decides: from the planes where they stand for it (its pages may have left
     * memory), else the caller runs the head */
    if (k) se_context_head_from_planes(c);
    return -1;
}

int32_t se_context_screen(se_context *c, int32_t k, int32_t *ids, float *logits, int32_t cap) {
    if (!c || k < 1 || k > SE_SCREEN_MAX_K || (cap > 0 && (!ids || !logits))) return SE_ERR_INVALID;
    se_sampling_params sp = { .temp = 1, .top_k = k, .top_p = 1, .repeat_penalty = 1 };
    int final;
    int32_t n = se_screen_candidates(c, &sp, 0, &final);
    for (int32_t i = 0; i < n && i < cap; i++) {
        ids[i] = c->cand[i].id;
        logits[i] = c->cand[i].logit;
    }
    return n;
}

const float *se_context_screen_bounds(const se_context *c, int32_t upper) {
    return upper ? c->scr_hi : c->scr_lo;
}

/* The planes of n_rows rows of n weights (standing for the rows or not) from rows, for the test hooks; SE_OK, or
 * SE_ERR_INVALID for a bad shape or a negative scale, SE_ERR_NOMEM (s's memory then NULL or freed
 * by the caller) */
static int test_planes(se_screen *s, const void *rows, int64_t n_rows, int64_t n, int stand) {
    if (!rows || n_rows < 1 || n_rows > INT32_MAX || n % (2 * SE_QK) || n / SE_QK > SE_SCREEN_MAX_NB)
        return SE_ERR_INVALID;
    if (!screen_alloc(s, n, n_rows, stand)) return SE_ERR_NOMEM;
    for (int64_t r = 0; r < n_rows; r++)
        if (!build_row(s, (const se_blk_q8_0 *)rows + r * s->nb, r)) return SE_ERR_INVALID;
    return SE_OK;
}

int se_screen_rows_test(const void *rows, int64_t n_rows, int64_t n, void *out) {
    se_screen s = { 0 };
    int rc = out ? test_planes(&s, rows, n_rows, n, 1) : SE_ERR_INVALID;
    for (int64_t r = 0; rc == SE_OK && r < n_rows; r++) row_kernel()(&s, r, (se_blk_q8_0 *)out + r * s.nb);
    free_planes(&s);
    return rc;
}

int64_t se_screen_planes_test(const void *rows, int64_t n_rows, int64_t n, int32_t stand, void *out, int64_t cap) {
    se_screen s = { 0 };
    int64_t rc = test_planes(&s, rows, n_rows, n, stand != 0);
    const size_t tiles = s.tile_size * (size_t)s.n_tiles, fifth = s.fifth_size * (size_t)n_rows;
    const size_t low = s.low ? se_screen_low_size(&s) * (size_t)n_rows : 0;
    if (rc == SE_OK && (!out || cap < (int64_t)(tiles + fifth + low))) rc = SE_ERR_INVALID;
    if (rc == SE_OK) {
        memcpy(out, s.tiles, tiles);
        memcpy((char *)out + tiles, s.fifth, fifth);
        if (low) memcpy((char *)out + tiles + fifth, s.low, low);
        rc = (int64_t)(tiles + fifth + low);
    }
    free_planes(&s);
    return rc;
}

int se_screen_head_test(const void *rows, int64_t n_rows, int64_t n, const void *act, float *out) {
    se_screen s = { 0 };
    int rc = act && out ? test_planes(&s, rows, n_rows, n, 1) : SE_ERR_INVALID;
    void *buf = rc == SE_OK ? malloc(act_bytes(s.nb)) : NULL;
    se_blk_q8_0 *scratch = rc == SE_OK ? malloc((size_t)(PLANE_ROWS * s.nb) * sizeof(se_blk_q8_0)) : NULL;
    if (rc == SE_OK && !(buf && scratch)) rc = SE_ERR_NOMEM;
    if (rc == SE_OK) planes_logits(&s, act, buf, scratch, 0, n_rows, out);
    free_planes(&s); free(buf); free(scratch);
    return rc;
}

int se_screen_bounds_test(const void *rows, int64_t n_rows, int64_t n, const void *act, int32_t stages, float *lo,
                          float *hi) {
    if (!act || !lo || !hi || stages < 1 || stages > 3) return SE_ERR_INVALID;
    se_screen s = { 0 };
    int rc = test_planes(&s, rows, n_rows, n, stages == 3);
    const size_t tiled = (size_t)(n_rows + SE_SCREEN_TILE - 1) / SE_SCREEN_TILE * SE_SCREEN_TILE;
    void *buf = rc == SE_OK ? malloc(act_bytes(n / SE_QK)) : NULL;
    int32_t *ids = rc == SE_OK ? malloc((size_t)n_rows * sizeof(int32_t)) : NULL;
    float *moves = rc == SE_OK ? malloc(2 * (size_t)n_rows * sizeof(float)) : NULL;
    float *ends = rc == SE_OK ? malloc(2 * tiled * sizeof(float)) : NULL;
    if (rc == SE_OK && !(buf && ids && moves && ends)) rc = SE_ERR_NOMEM;
    if (rc == SE_OK) {
        se_screen_act xa;
        make_act(act, s.nb, buf, &xa);
        bounds(&s, &xa, 0, n_rows, ends, ends + tiled);
        for (int64_t r = 0; r < n_rows; r++) ids[r] = (int32_t)r;
        if (stages >= 2) narrow(refine_kernel(), &s, &xa, ids, (int32_t)n_rows, moves, moves + n_rows, ends, ends + tiled);
        if (stages == 3) narrow(settle_kernel(), &s, &xa, ids, (int32_t)n_rows, moves, moves + n_rows, ends, ends + tiled);
        memcpy(lo, ends, (size_t)n_rows * sizeof(float));
        memcpy(hi, ends + tiled, (size_t)n_rows * sizeof(float));
    }
    free_planes(&s); free(buf); free(ids); free(moves); free(ends);
    return rc;
}
