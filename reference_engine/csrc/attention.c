/* Attention: softmax(q.K * scale) V for every query head of a ubatch, over the KV cache; and the
 * KV cache's layout, which only this file knows (se_forward_qkv, or the attention step itself in
 * batched steps, stores through se_kv_*).
 *
 * The cache's elements are f32 (exact) or f16 (half the bytes, as llama.cpp's default cache), keys
 * and values each their own (cp.type_k, cp.type_v). Per layer and kv head:
 *   keys    in tiles of 16 positions, each tile transposed: [position / 16][head dim][16];
 *   values  a row per position: [position][head dim].
 * An f16 element is the f32 value rounded to nearest even (the F16 type's from_float: the same bits
 * on every SIMD path), widened back to f32 as the kernel loads it: attention is otherwise the same.
 * A key tile puts dimension d of 16 keys side by side, so the scores of one query against 16 keys
 * are one vector: the sum over d of q[d] * (row d of the tile), with no horizontal sum per score.
 * Values are used the other way round (out += p * v, along the head dim), so rows suit them.
 *
 * Queries are attended in blocks of up to 4 rows (query heads that share a kv head, of one token
 * or of a few), so that every key tile and value row loaded serves all the rows of the block.
 * The softmax is online (flash attention): per row a running max, a running sum and the output
 * row, rescaled when a tile raises the max; so no buffer of scores as long as the context.
 */
#define SE_ENGINE_INTERNAL
#include "blocks.h"
#include "kernels.h"

#include <math.h>
#include <string.h>

#define TILE 16 /* positions per key tile; one score vector */

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---------------------------------------------------------------------------------------------
 * The cache's layout
 */

int64_t se_kv_positions(int64_t n_ctx) { return (n_ctx + TILE - 1) / TILE * TILE; }

size_t se_kv_elem_size(int type) { return type == SE_F16 ? sizeof(uint16_t) : sizeof(float); }

/* n elements of the cache at kv (of the type given) set to x[0..n): elements i, i + stride, ...
 * An f16 row is converted by the path's F16 from_float (the same bits on every path), a chunk at a
 * time. */
static void put_row(void *kv, int type, int64_t i, int64_t stride, const float *x, int n) {
    if (type != SE_F16) {
        for (int d = 0; d < n; d++) ((float *)kv)[i + d * stride] = x[d];
        return;
    }
    const se_from_float_fn to_f16 = se_traits(SE_F16)->from_float;
    uint16_t h[64];
    for (int d0 = 0; d0 < n; d0 += 64) {
        const int m = n - d0 < 64 ? n - d0 : 64;
        to_f16(x + d0, h, m);
        for (int d = 0; d < m; d++) ((uint16_t *)kv)[i + (d0 + d) * stride] = h[d];
    }
}

/* The keys (or values: the cache and its type) of layer il, kv head h. */
static uint8_t *kv_head(const se_context *c, void *cache, int type, int il, int h) {
    const se_hparams *hp = &c->m->hp;
    size_t head = (size_t)il * hp->n_head_kv + (size_t)h;
    return (uint8_t *)cache + head * (size_t)se_kv_positions(c->cp.n_ctx) * (size_t)hp->head_dim * se_kv_elem_size(type);
}

const void *se_kv_value_rows(const se_context *c, int il, int h, int64_t p0, int n, size_t *bytes) {
    size_t row = (size_t)c->m->hp.head_dim * se_kv_elem_size(c->cp.type_v);
    *bytes = (size_t)n * row;
    return kv_head(c, c->v_cache, c->cp.type_v, il, h) + (size_t)p0 * row;
}

const void *se_kv_key_tiles(const se_context *c, int il, int h, int64_t p0, int n, size_t *bytes) {
    size_t tile = TILE * (size_t)c->m->hp.head_dim * se_kv_elem_size(c->cp.type_k);
    int64_t t0 = p0 / TILE, t1 = (p0 + n - 1) / TILE + 1;
    *bytes = (size_t)(t1 - t0) * tile;
    return kv_head(c, c->k_cache, c->cp.type_k, il, h) + (size_t)t0 * tile;
}

void se_kv_store_keys(se_context *c, int il, int h, int64_t p0, int n, const float *k, int64_t ldk) {
    int hd = c->m->hp.head_dim, type = c->cp.type_k;
    void *kc = kv_head(c, c->k_cache, type, il, h);
    for (int t = 0; t < n; t++) {
        int64_t p = p0 + t;
        put_row(kc, type, p / TILE * TILE * hd + p % TILE, TILE, k + (int64_t)t * ldk, hd);
    }
}

void se_kv_store_values(se_context *c, int il, int h, int64_t p0, int n, const float *v, int64_t ldv) {
    int hd = c->m->hp.head_dim, type = c->cp.type_v;
    void *vc = kv_head(c, c->v_cache, type, il, h);
    for (int t = 0; t < n; t++) put_row(vc, type, (p0 + t) * hd, 1, v + (int64_t)t * ldv, hd);
}

/* ---------------------------------------------------------------------------------------------
 * The kernel (attention_kernel.h), once per SIMD level: the level the matmul kernels use
 * (kernels.c chooses it from the CPU, or INFER_REF_ISA), so the portable path is tested the same
 * way. Only these functions are compiled for AVX2 or AVX-512 (by the pragmas): the library is
 * built with portable flags. A multiply and an add fuse (FMA) only where the kernel says so
 * (ATT_FMA): left to the compiler (-ffp-contract=fast), the fusing differed between the kernel's
 * instances for 1 to 4 rows once the optimiser saw the loops differently (built without -fwrapv,
 * SmolLM2's logits differed by up to 0.97 between one token at a time and a batch).
 */

/* The cache comes from memory: between two reads of a context's keys a step streams the weights,
 * and a batched step's 8 caches outgrow the L2. So the kernel asks for the key tiles and value
 * rows about ATT_AHEAD_BYTES ahead of those it attends, instead of waiting on the hardware
 * prefetcher at the start of every head (8 SmolLM2 sequences to 160 positions, Xeon: the
 * attention 9-13% of a step's time; the step -4% to +14% faster in 16 pairs of builds, 10 of
 * them +4% or more, near 0 in the hour when the attention took 9%). */
#define ATT_AHEAD_BYTES 16384

/* Positions (whole tiles, at least one) whose keys and values (ke, ve bytes an element) make
 * about ATT_AHEAD_BYTES */
static inline int64_t att_ahead(int hd, size_t kve) {
    int64_t n = ATT_AHEAD_BYTES / ((int64_t)hd * (int64_t)kve) / TILE * TILE;
    return n > TILE ? n : TILE;
}

/* Asks for the key tiles and value rows of positions [p0, p1), p0 a tile's first */
static inline void att_prefetch(const void *kc, const void *vc, int64_t p0, int64_t p1, int hd, size_t ke, size_t ve) {
    if (p1 <= p0) return;
    const char *k = (const char *)kc + (size_t)p0 * hd * ke, *v = (const char *)vc + (size_t)p0 * hd * ve;
    for (size_t o = 0; o < (size_t)((p1 - p0 + TILE - 1) / TILE * TILE) * hd * ke; o += 64) __builtin_prefetch(k + o, 0, 3);
    for (size_t o = 0; o < (size_t)(p1 - p0) * hd * ve; o += 64) __builtin_prefetch(v + o, 0, 3);
}

/* One query row: what it reads and writes, and the key positions [lo, hi) it sees. */
typedef struct {
    const float *q;
    float *out;
    int64_t lo, hi;
} att_row;

typedef void (*attend_fn)(const att_row *rows, int n, const void *kc, const void *vc, int hd, float scale);

#define SE_INLINE static inline __attribute__((always_inline))
#define ATT_CAT_(a, b) a##b
#define ATT_CAT(a, b) ATT_CAT_(a, b)

#pragma GCC diagnostic ignored "-Wpsabi" /* wide vectors returned from inlined helpers: see the kernel */

#define ATT_VL 4
#define ATT_IOTA {0, 1, 2, 3}
#define ATT_ROWS 2
#define ATT_ISA _portable
#define ATT_FMA(a, b, c) ((a) * (b) + (c)) /* not fused: the portable path has no FMA to count on */
#include "attention_types.h"
#undef ATT_VL
#undef ATT_IOTA
#undef ATT_ROWS
#undef ATT_ISA
#undef ATT_FMA

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define ATT_VL 8
#define ATT_IOTA {0, 1, 2, 3, 4, 5, 6, 7}
#define ATT_ROWS 4
#define ATT_ISA _avx2
#define ATT_FMA(a, b, c) ((vf)_mm256_fmadd_ps((a), (b), (c)))
#define ATT_CVTPH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#include "attention_types.h"
#undef ATT_VL
#undef ATT_IOTA
#undef ATT_ROWS
#undef ATT_ISA
#undef ATT_FMA
#undef ATT_CVTPH
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f")
#define ATT_VL 16
#define ATT_IOTA {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#define ATT_ROWS 4
#define ATT_ISA _avx512
#define ATT_FMA(a, b, c) ((vf)_mm512_fmadd_ps((a), (b), (c)))
#define ATT_CVTPH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#include "attention_types.h"
#undef ATT_VL
#undef ATT_IOTA
#undef ATT_ROWS
#undef ATT_ISA
#undef ATT_FMA
#undef ATT_CVTPH
#pragma GCC pop_options
#endif

/* The kernels of each SIMD path for the cache's key and value types (f32 0, f16 1), indexed by the
 * path kernels.c chose once: se_isa_in_use(). attention_types.h defines attend_rows_<isa>_<k><v>
 * (f: f32, h: f16) for each level above. */
#define ATT_KERNELS(isa)                                                                                    \
    {                                                                                                       \
        {ATT_CAT(attend_rows, ATT_CAT(isa, _ff)), ATT_CAT(attend_rows, ATT_CAT(isa, _fh))},                 \
        {ATT_CAT(attend_rows, ATT_CAT(isa, _hf)), ATT_CAT(attend_rows, ATT_CAT(isa, _hh))},                 \
    }
static const attend_fn attend_kernels[SE_ISA_COUNT][2][2] = {
    [SE_ISA_SCALAR] = ATT_KERNELS(_portable),
#if defined(__x86_64__) && defined(__GNUC__)
    [SE_ISA_AVX2] = ATT_KERNELS(_avx2),
    [SE_ISA_AVX512] = ATT_KERNELS(_avx512),
    [SE_ISA_AMX] = ATT_KERNELS(_avx512), /* AMX is AVX-512 with another prompt GEMM */
#else
    [SE_ISA_AVX2] = ATT_KERNELS(_portable), /* never chosen off x86 */
    [SE_ISA_AVX512] = ATT_KERNELS(_portable),
    [SE_ISA_AMX] = ATT_KERNELS(_portable),
#endif
};

/* ---------------------------------------------------------------------------------------------
 * The block
 */

#define ATT_TOKENS 4     /* tokens per work item in a batch */
#define ATT_MAX_GROUP 16 /* query heads per work item at most */

/* How the (token, query head) rows are dealt out: as work items of T tokens x g query heads of one
 * kv head. Batches: 4 tokens x all the heads of a kv head (4 rows a block even for SmolLM's 3).
 * A few tokens: one token, and g the largest divisor of the group that gives every thread the
 * same number of items (Gemma's 4 heads: 2 + 2 on 2 threads), else single heads (SmolLM's 9 heads:
 * 5 + 4, better than its kv groups of 3 as 2 + 1). */
static void attention_split(const se_context *c, int nth, int *T, int *g) {
    const se_hparams *hp = &c->m->hp;
    int group = hp->n_head / hp->n_head_kv;
    *T = 1;
    *g = 1;
    if (group > ATT_MAX_GROUP) return;
    if (c->ub_n >= 4 * nth) {
        *T = ATT_TOKENS;
        *g = group;
        return;
    }
    for (int d = group; d > 1; d--)
        if (group % d == 0 && (int64_t)c->ub_n * (hp->n_head / d) % nth == 0) {
            *g = d;
            return;
        }
}

/* 1 when every work item of this ubatch's attention is a whole (segment, kv head): all the
 * segment's tokens and all the kv head's query heads (steps of batched decoding: a token or a few
 * per context). Then no other item reads what it stores, so each item stores its keys and values
 * into its context's cache itself, just before it reads them (se_forward_qkv leaves them): the
 * stores, a cache line per few dimensions of a key tile long evicted by the weights, are then dealt
 * out with the items instead of falling on the threads that computed the K and V heads (one of
 * two threads on SmolLM2: its QKV step took about twice the other's), and the attention finds the
 * tile's lines in cache. */
int se_attention_stores(const se_context *c, int nth) {
    int T, g;
    attention_split(c, nth, &T, &g);
    if (g != c->m->hp.n_head / c->m->hp.n_head_kv) return 0;
    for (int si = 0; si < c->ub_nseg; si++)
        if (c->ub_seg[si].n > T) return 0;
    return 1;
}

/* Attention of every (token, query head) of the ubatch, in work items dealt to the threads: in
 * batches round-robin (later tokens see more keys, so contiguous shares would be unequal); for a
 * few tokens in contiguous shares, which put a thread's heads on fewer kv heads, so that it reads
 * less of the cache. A work item's tokens are of one segment (one context: se_decode_batch puts
 * several in a ubatch), and attend over that context's cache from their positions in it. Then a
 * barrier. */
void se_forward_attention(se_context *c, int il, int ith, int nth) {
    const se_hparams *hp = &c->m->hp;
    const se_layer *L = &c->m->layers[il];
    int H = hp->n_head, hd = hp->head_dim, group = H / hp->n_head_kv, T, g;
    attention_split(c, nth, &T, &g);
    int64_t Dq = (int64_t)H * hd, per_chunk = H / g, n_items = 0;
    for (int si = 0; si < c->ub_nseg; si++) n_items += (c->ub_seg[si].n + T - 1) / T * per_chunk;
    att_row rows[ATT_TOKENS * ATT_MAX_GROUP];
    const attend_fn(*kernels)[2] = attend_kernels[se_isa_in_use()];
    const int store = se_attention_stores(c, nth);
    int64_t Dkv = (int64_t)hp->n_head_kv * hd, i0 = 0, i1 = n_items, i = 0;
    if (T == 1) se_split(n_items, ith, nth, 1, &i0, &i1);
    for (int si = 0; si < c->ub_nseg && i < i1; si++) {
        const se_ub_seg *sg = &c->ub_seg[si];
        const se_context *sc = sg->ctx; /* its cache: its own element types */
        attend_fn attend = kernels[sc->cp.type_k == SE_F16][sc->cp.type_v == SE_F16];
        for (int t0 = sg->start; t0 < sg->start + sg->n; t0 += T)
            for (int64_t hc = 0; hc < per_chunk; hc++, i++) {
                if (T == 1 ? i < i0 || i >= i1 : i % nth != ith) continue;
                int h0 = (int)hc * g, kvh = h0 / group, n = 0;
                if (store) {
                    se_kv_store_keys(sg->ctx, il, kvh, sg->pos, sg->n, c->k_new + sg->start * Dkv + kvh * hd, Dkv);
                    se_kv_store_values(sg->ctx, il, kvh, sg->pos, sg->n, c->v_new + sg->start * Dkv + kvh * hd, Dkv);
                }
                for (int t = t0; t < t0 + T && t < sg->start + sg->n; t++) {
                    int64_t pos = sg->pos + (t - sg->start);
                    for (int h = h0; h < h0 + g; h++) {
                        rows[n].q = c->q + t * Dq + (int64_t)h * hd;
                        rows[n].out = c->att + t * Dq + (int64_t)h * hd;
                        rows[n].lo = L->sliding_window > 0 ? max64(0, pos - L->sliding_window + 1) : 0;
                        rows[n].hi = pos + 1;
                        n++;
                    }
                }
                attend(rows, n, kv_head(sc, sc->k_cache, sc->cp.type_k, il, kvh),
                       kv_head(sc, sc->v_cache, sc->cp.type_v, il, kvh), hd, hp->attn_scale);
            }
    }
    se_pool_barrier(c->pool);
}
