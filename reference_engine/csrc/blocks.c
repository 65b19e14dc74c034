/* The building blocks of the forward passes, shared by every architecture (blocks.h): norms,
 * activations for the matmuls, RoPE, the embedding prologue, the attention block (around the
 * attention itself, which is attention.c's), the gated feed-forward block and the output head.
 *
 * Every block runs on every thread of the pool at once; the threads split each step (by weight
 * rows for matmuls, by tokens or heads elsewhere) and meet at a barrier only where a step needs
 * the whole result of the previous one. Small batches (a generated token) normalize and quantize
 * the activations redundantly on every thread, which is cheaper than a barrier; large ones split
 * that work by tokens and add a barrier.
 *
 * The matmuls go through the kernels' contract (kernels.h): activations are quantized to the
 * weight type's act_type, then se_matmul computes a range of output rows for every token.
 */
#define SE_ENGINE_INTERNAL
#include "blocks.h"
#include "screen.h"

#include <math.h>
#include <string.h>

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* [*r0, *r1): this thread's share of n items, boundaries on multiples of align */
void se_split(int64_t n, int ith, int nth, int64_t align, int64_t *r0, int64_t *r1) {
    int64_t blocks = (n + align - 1) / align;
    *r0 = min64(n, blocks * ith / nth * align);
    *r1 = min64(n, blocks * (ith + 1) / nth * align);
}

/* ---- prefetching across the barriers
 *
 * A step's matmul streams its weights, and se_matmul asks for them SE_PREFETCH_BYTES ahead of the
 * rows it computes (kernels.c): so its first rows arrive late, after the barrier, while the thread
 * that waited at the barrier was idle. Each barrier is therefore told what the thread reads first
 * in the next step (its static share of the next matmul's rows), and asks for it while waiting. */

#define NEXT_BYTES 16384 /* per tensor: about what se_matmul keeps asked for ahead */

/* What a matmul of n_tok tokens reads of W: its packed panels where they serve (kernels.h), else
 * its rows; a row's bytes are at the same offset in both. */
static const void *weights_read(const se_tensor *W, int n_tok) {
    const void *p = se_panels_for(W->type, __atomic_load_n(&W->panels, __ATOMIC_ACQUIRE), n_tok);
    return p ? p : W->data;
}

/* This thread's first NEXT_BYTES of rows [r0, r1) of W, as this pass reads them */
static se_prefetch_span rows_span(const se_context *c, const se_tensor *W, int64_t r0, int64_t r1) {
    size_t n = r1 > r0 ? (size_t)(r1 - r0) * W->row_size : 0;
    return (se_prefetch_span){ (const char *)weights_read(W, c->ub_n) + (size_t)r0 * W->row_size, n < NEXT_BYTES ? n : NEXT_BYTES };
}

/* The start of this thread's share of a matmul step's rows of W (the split of forward_residual,
 * forward_gate and the head). */
static se_prefetch_span share_span(const se_context *c, const se_tensor *W, int ith, int nth) {
    int64_t r0, r1;
    se_split(W->ne1, ith, nth, SPLIT_ALIGN, &r0, &r1);
    return rows_span(c, W, r0, r1);
}

/* ---- rows shared at run time
 *
 * A matmul step's rows start split evenly (se_split), yet one thread often finishes first: on a VM
 * or behind a server a thread loses its core for a while, and the others then wait at the next
 * barrier. So a thread that has done its share takes rows from the end of another's. Each share's
 * rows not taken yet are one atomic word (the step's number, lo, hi): the owner takes from the
 * front, half of what is left at a time (each call of a batch kernel prepares its activations
 * again: few calls), a helper a quarter from the back, in multiples of SPLIT_ALIGN rows. Every
 * row is computed once, by one kernel call whatever its range, so the results are bit for bit
 * the same; only who computes which rows changes. Every thread of a pass runs the same steps in
 * the same order, with a barrier after each, so the step numbers agree; se_share_rows_reset
 * starts them again before each pass. A pass of one token keeps the static split: there the
 * sharing measured 3-7% slower (SmolLM2 in process, AVX2), where a batch of 8 sequences gained
 * 4-15%. */

#define ROWS_BITS 24 /* lo and hi: rows below 2^24 (a vocabulary of 262144 needs 18 bits) */
#define ROWS_MASK ((UINT64_C(1) << ROWS_BITS) - 1)

static int skewed;                   /* se_set_share_rows_skew */
static _Atomic int64_t rows_taken;   /* se_rows_taken_from_others */

int se_set_share_rows_skew(int on) {
    const int was = skewed;
    skewed = on != 0;
    return was;
}

int64_t se_rows_taken_from_others(void) { return atomic_load_explicit(&rows_taken, memory_order_relaxed); }

static uint64_t rows_word(uint32_t step, int64_t lo, int64_t hi) {
    return (uint64_t)step << (2 * ROWS_BITS) | (uint64_t)lo << ROWS_BITS | (uint64_t)hi;
}

void se_share_rows_reset(se_context *c, int nth) {
    for (int i = 0; i < nth; i++) {
        atomic_store(&c->ts[i].rows_left, 0);
        c->ts[i].step = 0;
    }
}

/* Takes rows from thread j's share of step `step` into [*r0, *r1): from the front (the owner) or
 * the back (a helper); 0 when none are left. *end: where the share ends. The share is set up by
 * whoever comes first. */
static int take_rows(se_context *c, int j, int nth, int64_t n, uint32_t step, int front, int64_t *r0, int64_t *r1,
                     int64_t *end) {
    _Atomic uint64_t *word = &c->ts[j].rows_left;
    uint64_t w = atomic_load(word);
    for (;;) {
        if (w >> (2 * ROWS_BITS) != step) { /* not begun: j's static share */
            int64_t lo, hi;
            se_split(n, j, nth, SPLIT_ALIGN, &lo, &hi);
            if (skewed) { /* all rows the last thread's */
                lo = 0;
                hi = j == nth - 1 ? n : 0;
            }
            if (!atomic_compare_exchange_weak(word, &w, rows_word(step, lo, hi))) continue;
            w = rows_word(step, lo, hi);
        }
        int64_t lo = (int64_t)(w >> ROWS_BITS & ROWS_MASK), hi = (int64_t)(w & ROWS_MASK);
        if (lo >= hi) return 0;
        int64_t take = skewed && front ? SPLIT_ALIGN : (hi - lo) / (front ? 2 : 4);
        take = take < SPLIT_ALIGN ? SPLIT_ALIGN : take / SPLIT_ALIGN * SPLIT_ALIGN;
        if (take > hi - lo) take = hi - lo;
        uint64_t next = front ? rows_word(step, lo + take, hi) : rows_word(step, lo, hi - take);
        if (atomic_compare_exchange_weak(word, &w, next)) {
            *r0 = front ? lo : hi - take;
            *r1 = front ? lo + take : hi;
            *end = hi;
            return 1;
        }
    }
}

void se_share_rows(se_context *c, int ith, int nth, int64_t n, se_rows_fn fn, const void *arg,
                   const se_tensor *const *w, int nw) {
    if (nth == 1 || c->ub_n == 1 || n > (int64_t)ROWS_MASK) { /* one token: see above */
        int64_t r0, r1;
        se_split(n, ith, nth, SPLIT_ALIGN, &r0, &r1);
        if (r1 > r0) fn(c, arg, r0, r1);
        return;
    }
    uint32_t step = c->ts[ith].step = c->ts[ith].step % 0xFFFF + 1; /* 1..65535: 0 is "reset" */
    int64_t r0, r1, end;
    while (take_rows(c, ith, nth, n, step, 1, &r0, &r1, &end)) {
        /* the kernels ask for weight rows ahead only up to r1: the next rows of the share are
         * asked for here, so that the next call does not start on a cold stream */
        for (int i = 0; i < nw; i++) {
            const se_prefetch_span sp = rows_span(c, w[i], r1, end);
            for (size_t o = 0; o < sp.n; o += 64) __builtin_prefetch((const char *)sp.p + o, 0, 2);
        }
        fn(c, arg, r0, r1);
    }
    for (int k = 1; k < nth; k++)
        while (take_rows(c, (ith + k) % nth, nth, n, step, 0, &r0, &r1, &end)) {
            atomic_fetch_add_explicit(&rows_taken, r1 - r0, memory_order_relaxed);
            fn(c, arg, r0, r1);
        }
}

/* This thread's heads of the QKV step: Q heads [h[0], h[1]), K heads [h[2], h[3]), V heads
 * [h[4], h[5]); the threads split the H + 2 HKV heads in that order. */
static void qkv_heads(const se_hparams *hp, int ith, int nth, int64_t h[6]) {
    int64_t H = hp->n_head, HKV = hp->n_head_kv, u0, u1;
    se_split(H + 2 * HKV, ith, nth, 1, &u0, &u1);
    h[0] = u0;
    h[1] = min64(u1, H);
    h[2] = min64(max64(u0 - H, 0), HKV);
    h[3] = min64(max64(u1 - H, 0), HKV);
    h[4] = max64(u0 - H - HKV, 0);
    h[5] = max64(u1 - H - HKV, 0);
}

#define QKV_CACHE_HEADS 8                       /* kv heads whose cache rows are prefetched, at most */
#define QKV_SPANS (3 + 2 * QKV_CACHE_HEADS)      /* spans of qkv_spans, at most */

/* What this thread reads and writes first in layer il's QKV step (se_forward_qkv): the first
 * weights of its Q heads, of its K heads and of its V heads; and, for a few tokens of one
 * context, the key tiles and value rows it will store them into (a generated token's key fills a
 * column of a 4 KiB tile: 64 cache lines, long evicted by the weights streamed since the last
 * token). Returns how many spans (up to QKV_SPANS). */
static int qkv_spans(const se_context *c, int il, int ith, int nth, se_prefetch_span *sp) {
    const se_hparams *hp = &c->m->hp;
    const se_layer *L = &c->m->layers[il];
    int64_t hd = hp->head_dim, n = 0, h6[6];
    qkv_heads(hp, ith, nth, h6);
    int64_t q0 = h6[0], q1 = h6[1], k0 = h6[2], k1 = h6[3], v0 = h6[4], v1 = h6[5];
    if (q1 > q0) sp[n++] = rows_span(c, &L->t[SE_T_ATTN_Q], q0 * hd, q1 * hd);
    if (k1 > k0) sp[n++] = rows_span(c, &L->t[SE_T_ATTN_K], k0 * hd, k1 * hd);
    if (v1 > v0) sp[n++] = rows_span(c, &L->t[SE_T_ATTN_V], v0 * hd, v1 * hd);
    if (c->ub_nseg != 1 || c->ub_n > SE_PRIVATE_TOKENS || hp->n_head_kv > QKV_CACHE_HEADS) return (int)n;
    const se_ub_seg *sg = &c->ub_seg[0];
    for (int64_t h = k0; h < k1; h++) {
        size_t bytes;
        const void *tiles = se_kv_key_tiles(sg->ctx, il, (int)h, sg->pos, sg->n, &bytes);
        sp[n++] = (se_prefetch_span){ tiles, bytes < NEXT_BYTES ? bytes : NEXT_BYTES };
    }
    for (int64_t h = v0; h < v1; h++) {
        size_t bytes;
        const void *rows = se_kv_value_rows(sg->ctx, il, (int)h, sg->pos, sg->n, &bytes);
        sp[n++] = (se_prefetch_span){ rows, bytes };
    }
    return (int)n;
}

/* y = x / rms(x) * w. The squares are summed in double (as llama.cpp does) in 8 partial sums,
 * element i in sum i % 8, then added in a fixed tree: one order on every path, which the compiler
 * turns into vector adds (one chain of n adds, as before, cost about 0.6 us a row on SmolLM2: 3% of
 * a step of 8 sequences, where every thread normalises every token). */
void se_rmsnorm(float *y, const float *x, const float *w, int64_t n, float eps) {
    double s[8] = { 0 };
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) s[j] += (double)(x[i + j] * x[i + j]);
    for (int j = 0; i < n; i++, j++) s[j] += (double)(x[i] * x[i]);
    const double ss = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    float scale = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (i = 0; i < n; i++) y[i] = x[i] * scale * w[i];
}

static const void *act_for(const se_acts *a, int wtype) {
    int at = se_traits(wtype)->act_type;
    for (int j = 0; j < a->n; j++)
        if (a->type[j] == at) return a->ptr[j];
    return NULL; /* cannot happen: prep_acts saw every weight */
}

int se_context_set_act_stats(se_context *c, double *sum2, int64_t *count) {
    if (!c || (sum2 == NULL) != (count == NULL)) return SE_ERR_INVALID;
    c->stats_sum2 = sum2;
    c->stats_count = count;
    return SE_OK;
}

/* Adds n rows of k activations, the input of the matmul group led by weight w, to the context's
 * statistics (engine.h, se_context_set_act_stats). The group is known by w's place in the
 * model's layer array; anything else (the output head) is not counted. */
static void act_stats_add(se_context *c, const se_tensor *w, const float *rows, int64_t k, int n) {
    const se_model *m = c->m;
    const se_hparams *hp = &m->hp;
    uintptr_t p = (uintptr_t)w, base = (uintptr_t)m->layers;
    if (p < base || p >= base + (uintptr_t)hp->n_layer * sizeof(se_layer)) return;
    int il = (int)((p - base) / sizeof(se_layer));
    int64_t E = hp->n_embd, Dq = (int64_t)hp->n_head * hp->head_dim, F = hp->n_ff;
    int64_t off = il * (2 * E + Dq + F);
    int g;
    switch ((int)(w - m->layers[il].t)) {
    case SE_T_ATTN_Q: g = 0; break;
    case SE_T_ATTN_OUTPUT: g = 1; off += E; break;
    case SE_T_FFN_GATE: g = 2; off += E + Dq; break;
    case SE_T_FFN_DOWN: g = 3; off += 2 * E + Dq; break;
    default: return;
    }
    double *s = c->stats_sum2 + off;
    for (int t = 0; t < n; t++) {
        const float *r = rows + (int64_t)t * k;
        for (int64_t j = 0; j < k; j++) s[j] += (double)r[j] * (double)r[j];
    }
    c->stats_count[il * 4 + g] += n;
}

/* Prepares the activations that the weights w[0..nw) need from n_tok rows of k floats at src
 * (row stride k), RMS-normalised by norm_w first if it is not NULL. Small batches: every thread
 * does all of it into its own buffers (no barrier). Large batches: each thread does its share
 * of the tokens into the shared buffers, then a barrier. */
void se_prep_acts(se_context *c, int ith, int nth, const float *src, int64_t k, int n_tok,
                  const float *norm_w, const se_tensor *const *w, int nw, se_acts *out) {
    out->n = 0;
    for (int i = 0; i < nw; i++) {
        int at = se_traits(w[i]->type)->act_type;
        int seen = 0;
        for (int j = 0; j < out->n; j++) seen |= out->type[j] == at;
        if (!seen) out->type[out->n++] = at;
    }
    float eps = c->m->hp.norm_eps;
    int priv = n_tok <= SE_PRIVATE_TOKENS; /* (with one thread the barrier below is free) */
    se_thread_scratch *ts = &c->ts[ith];
    int64_t t0 = 0, t1 = n_tok;
    if (!priv) se_split(n_tok, ith, nth, 1, &t0, &t1);
    const float *rows = src;
    if (norm_w) {
        float *dst = priv ? ts->norm : c->xb;
        for (int64_t t = t0; t < t1; t++) se_rmsnorm(dst + t * k, src + t * k, norm_w, k, eps);
        rows = dst;
    }
    for (int j = 0; j < out->n; j++) {
        if (out->type[j] == SE_F32) { /* f32 weights take the float rows as they are */
            out->ptr[j] = rows;
            continue;
        }
        char *dst = priv ? ts->act[j] : c->act[j];
        size_t rs = se_row_size(out->type[j], k);
        if (t1 > t0)
            se_quantize_rows(out->type[j], rows + t0 * k, k, (int)(t1 - t0), dst + (size_t)t0 * rs);
        out->ptr[j] = dst;
    }
    if (!priv) se_pool_barrier(c->pool);
    /* one thread counts every row: by now its rows are all there (its own buffer for a small
     * batch, the shared one after the barrier for a large one) */
    if (c->stats_sum2 && ith == 0) act_stats_add(c, w[0], rows, k, n_tok);
}

/* y rows [r0, r1) = W x for every token, through the kernels */
void se_matmul_rows(const se_tensor *W, const se_acts *a, int n_tok, float *y, int64_t ldy,
                    int64_t r0, int64_t r1) {
    if (r1 <= r0) return;
    se_matmul_panels(W->type, W->data, __atomic_load_n(&W->panels, __ATOMIC_ACQUIRE), W->ne0, act_for(a, W->type), n_tok,
                     y, ldy, r0, r1);
}

static const float *rope_row(const se_context *c, int idx, int t) {
    const se_hparams *hp = &c->m->hp;
    return c->rope + ((size_t)idx * c->cp.n_ubatch + (size_t)t) * hp->n_rot;
}

/* Token embeddings and rope tables for this thread's share of the ubatch, then a barrier. */
void se_forward_prologue(se_context *c, int ith, int nth) {
    const se_model *m = c->m;
    const se_hparams *hp = &m->hp;
    int64_t t0, t1;
    se_split(c->ub_n, ith, nth, 1, &t0, &t1);
    se_to_float_fn to_float = se_traits(m->token_embd.type)->to_float;
    for (int64_t t = t0; t < t1; t++) {
        float *x = c->x + t * hp->n_embd;
        uint8_t rebuilt[SE_SCREEN_MAX_NB * 34]; /* a tied head's row from the screen's planes: its pages may have left memory */
        const void *row = se_screen_embedding_row(m, c->ub_tokens[t], rebuilt);
        if (!row) row = (const char *)m->token_embd.data + (size_t)c->ub_tokens[t] * m->token_embd.row_size;
        to_float(row, x, hp->n_embd);
        if (hp->embd_scale != 1.0f)
            for (int i = 0; i < hp->n_embd; i++) x[i] *= hp->embd_scale;
        for (int b = 0; b < m->n_rope; b++)
            se_rope_table((float *)rope_row(c, b, (int)t), se_row_pos(c, t), m->rope_bases[b],
                       hp->rope_freq_scale, hp->n_rot);
    }
    se_prefetch_span next[QKV_SPANS];
    se_pool_barrier_prefetch(c->pool, next, qkv_spans(c, 0, ith, nth, next));
}

/* Heads [h0, h1) of Q or K (weights in slot, per-head norm in norm_slot): one matmul call into dst
 * (a token's heads ld floats apart), then the norm (when the layer has it) and RoPE in place. */
static void qk_heads(se_context *c, const se_layer *L, const se_acts *a, int slot, int norm_slot, float *dst,
                     int64_t ld, int64_t h0, int64_t h1) {
    const se_hparams *hp = &c->m->hp;
    int64_t hd = hp->head_dim;
    se_matmul_rows(&L->t[slot], a, c->ub_n, dst, ld, h0 * hd, h1 * hd);
    const float *nw = L->t[norm_slot].data;
    for (int t = 0; t < c->ub_n; t++) {
        const float *cs = rope_row(c, L->rope_idx, t);
        for (int64_t h = h0; h < h1; h++) {
            float *v = dst + t * ld + h * hd;
            if (nw) se_rmsnorm(v, v, nw, hd, hp->norm_eps);
            se_rope_apply(v, cs, hp->n_rot, hp->rope_type);
        }
    }
}

/* Q, K and V projections of layer il, split across threads by whole heads, so that each thread
 * can finish its heads at once. Each of a thread's three runs of heads (Q, K, V) is one matmul
 * call, one stream of weights: a stream's first rows cost a memory latency. Q heads are roped in
 * place; K heads are roped in c->k_new, then stored into the cache's key tiles of each segment's
 * context; V heads land in c->v_new, then each segment's rows go into its context's cache. (k_new
 * and v_new hold a token's rows of every kv head side by side.) Then a barrier. */
void se_forward_qkv(se_context *c, int il, const se_acts *a, int ith, int nth) {
    const se_hparams *hp = &c->m->hp;
    const se_layer *L = &c->m->layers[il];
    int H = hp->n_head, HKV = hp->n_head_kv, hd = hp->head_dim, n = c->ub_n;
    int64_t Dq = (int64_t)H * hd, Dkv = (int64_t)HKV * hd, h6[6];
    qkv_heads(hp, ith, nth, h6);
    int64_t q0 = h6[0], q1 = h6[1], k0 = h6[2], k1 = h6[3], v0 = h6[4], v1 = h6[5];
    if (q1 > q0) qk_heads(c, L, a, SE_T_ATTN_Q, SE_T_ATTN_Q_NORM, c->q, Dq, q0, q1);
    const int store = !se_attention_stores(c, nth); /* else each attention item stores its own */
    if (k1 > k0) {
        qk_heads(c, L, a, SE_T_ATTN_K, SE_T_ATTN_K_NORM, c->k_new, Dkv, k0, k1);
        for (int si = 0; si < c->ub_nseg && store; si++) {
            const se_ub_seg *sg = &c->ub_seg[si];
            for (int64_t h = k0; h < k1; h++)
                se_kv_store_keys(sg->ctx, il, (int)h, sg->pos, sg->n, c->k_new + sg->start * Dkv + h * hd, Dkv);
        }
    }
    if (v1 > v0) {
        se_matmul_rows(&L->t[SE_T_ATTN_V], a, n, c->v_new, Dkv, v0 * hd, v1 * hd);
        for (int si = 0; si < c->ub_nseg && store; si++) {
            const se_ub_seg *sg = &c->ub_seg[si];
            for (int64_t h = v0; h < v1; h++)
                se_kv_store_values(sg->ctx, il, (int)h, sg->pos, sg->n, c->v_new + sg->start * Dkv + h * hd, Dkv);
        }
    }
    se_prefetch_span next = share_span(c, &L->t[SE_T_ATTN_OUTPUT], ith, nth); /* after the attention */
    se_pool_barrier_prefetch(c->pool, &next, 1);
}

/* One thread's piece of forward_residual: rows [r0, r1) of W act (and x += them). */
typedef struct {
    const se_tensor *W;
    const se_acts *a;
    int add; /* x += the rows (no post-norm) */
} residual_rows;

static void residual_chunk(se_context *c, const void *arg, int64_t r0, int64_t r1) {
    const residual_rows *j = arg;
    int64_t E = c->m->hp.n_embd;
    se_matmul_rows(j->W, j->a, c->ub_n, c->tmp, E, r0, r1);
    if (!j->add) return;
    for (int t = 0; t < c->ub_n; t++) {
        float *x = c->x + t * E;
        const float *y = c->tmp + t * E;
        for (int64_t r = r0; r < r1; r++) x[r] += y[r];
    }
}

/* x += W act, or x += rmsnorm(W act) * post_w when post_w is not NULL (gemma3's post-norms).
 * Without a post-norm each thread adds the rows of W act it computed, then a barrier. With one, a
 * token's norm needs its whole row of W act, which the threads compute in pieces: each computes
 * rows into c->tmp, a barrier, then each normalises and adds its share of the tokens, then a
 * barrier. */
static void forward_residual(se_context *c, const se_tensor *W, const float *post_w, const se_acts *a,
                             const se_prefetch_span *next, int n_next, int ith, int nth) {
    const residual_rows job = { W, a, !post_w };
    se_share_rows(c, ith, nth, W->ne1, residual_chunk, &job, &W, 1);
    se_pool_barrier_prefetch(c->pool, next, n_next);
    if (!post_w) return;
    int64_t E = c->m->hp.n_embd, t0, t1;
    se_split(c->ub_n, ith, nth, 1, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        float *x = c->x + t * E, *y = c->tmp + t * E;
        se_rmsnorm(y, y, post_w, E, c->m->hp.norm_eps);
        for (int64_t i = 0; i < E; i++) x[i] += y[i];
    }
    se_pool_barrier_prefetch(c->pool, next, n_next);
}

void se_attention_block(se_context *c, int il, const float *post_w, int ith, int nth) {
    const se_hparams *hp = &c->m->hp;
    const se_layer *L = &c->m->layers[il];
    int64_t Dq = (int64_t)hp->n_head * hp->head_dim;
    se_acts a;
    const se_tensor *qkv[3] = { &L->t[SE_T_ATTN_Q], &L->t[SE_T_ATTN_K], &L->t[SE_T_ATTN_V] };
    se_prep_acts(c, ith, nth, c->x, hp->n_embd, c->ub_n, L->t[SE_T_ATTN_NORM].data, qkv, 3, &a);
    se_forward_qkv(c, il, &a, ith, nth);
    se_forward_attention(c, il, ith, nth);
    const se_tensor *wo[1] = { &L->t[SE_T_ATTN_OUTPUT] };
    se_prep_acts(c, ith, nth, c->att, Dq, c->ub_n, NULL, wo, 1, &a);
    se_prefetch_span next[2] = { share_span(c, &L->t[SE_T_FFN_GATE], ith, nth), share_span(c, &L->t[SE_T_FFN_UP], ith, nth) };
    forward_residual(c, wo[0], post_w, &a, next, 2, ith, nth);
}

/* One thread's piece of forward_gate: rows [r0, r1) of gate, up and their product. */
typedef struct {
    const se_layer *L;
    se_ffn_act act;
    const se_acts *a;
} gate_rows;

static void gate_chunk(se_context *c, const void *arg, int64_t r0, int64_t r1) {
    const gate_rows *j = arg;
    int64_t F = c->m->hp.n_ff;
    se_matmul_rows(&j->L->t[SE_T_FFN_GATE], j->a, c->ub_n, c->hb, F, r0, r1);
    se_matmul_rows(&j->L->t[SE_T_FFN_UP], j->a, c->ub_n, c->hb2, F, r0, r1);
    for (int t = 0; t < c->ub_n; t++) se_glu(j->act, c->hb + t * F + r0, c->hb2 + t * F + r0, r1 - r0);
}

/* hb = act(gate x) * (up x) for the rows of the ffn (shared by the threads), then a barrier. */
static void forward_gate(se_context *c, const se_layer *L, se_ffn_act act, const se_acts *a, int ith,
                         int nth) {
    const gate_rows job = { L, act, a };
    const se_tensor *w[2] = { &L->t[SE_T_FFN_GATE], &L->t[SE_T_FFN_UP] };
    se_share_rows(c, ith, nth, c->m->hp.n_ff, gate_chunk, &job, w, 2);
    se_prefetch_span next = share_span(c, &L->t[SE_T_FFN_DOWN], ith, nth);
    se_pool_barrier_prefetch(c->pool, &next, 1);
}

void se_ffn_block(se_context *c, int il, se_ffn_act act, const float *post_w, int ith, int nth) {
    const se_hparams *hp = &c->m->hp;
    const se_layer *L = &c->m->layers[il];
    se_acts a;
    const se_tensor *gu[2] = { &L->t[SE_T_FFN_GATE], &L->t[SE_T_FFN_UP] };
    se_prep_acts(c, ith, nth, c->x, hp->n_embd, c->ub_n, L->t[SE_T_FFN_NORM].data, gu, 2, &a);
    forward_gate(c, L, act, &a, ith, nth);
    const se_tensor *wd[1] = { &L->t[SE_T_FFN_DOWN] };
    se_prep_acts(c, ith, nth, c->hb, hp->n_ff, c->ub_n, NULL, wd, 1, &a);
    /* next: the next layer's QKV, or the output head after the last (when it runs) */
    se_prefetch_span next[QKV_SPANS];
    int n_next = 0;
    if (il + 1 < hp->n_layer) n_next = qkv_spans(c, il + 1, ith, nth, next);
    else if (c->ub_out || c->ub_nout) next[n_next++] = share_span(c, &c->m->output, ith, nth);
    forward_residual(c, wd[0], post_w, &a, next, n_next, ith, nth);
}

/* One thread's piece of the output head: rows [r0, r1) of the logits (and, for several contexts,
 * of each context's). */
typedef struct {
    const se_acts *a;
    int n_out;
    float *out;
} head_rows;

static void head_chunk(se_context *c, const void *arg, int64_t r0, int64_t r1) {
    const head_rows *j = arg;
    int64_t V = c->m->hp.n_vocab;
    se_matmul_rows(&c->m->output, j->a, j->n_out, j->out, V, r0, r1);
    if (j->out != c->ub_logits) return;
    for (int si = 0, i = 0; si < c->ub_nseg; si++) {
        const se_ub_seg *sg = &c->ub_seg[si];
        if (!sg->out || sg->defer) continue;
        memcpy(sg->ctx->logits + r0, j->out + i * V + r0, (size_t)(r1 - r0) * sizeof(float));
        i++;
    }
}

/* Final norm and the output head for the tokens whose logits are wanted: every token of the
 * ubatch when the caller asked for all logits (one segment), else the last row of each segment
 * that ends its context's tokens of the call (ub_nout of them), else none. One such row goes
 * straight into its context's logits. Several go through the head together (its weights read
 * once): their rows of x are gathered (unless they are every row already), the head writes
 * c->ub_logits, and each thread copies its share of the vocabulary to each context. */
void se_forward_output(se_context *c, int ith, int nth) {
    const se_model *m = c->m;
    int64_t E = m->hp.n_embd, V = m->hp.n_vocab;
    int n_out = c->ub_out ? c->ub_n : c->ub_nout;
    if (n_out == 0) return;
    const float *src = c->x;
    float *out = c->ub_out;
    if (!out && n_out == 1) {
        for (int si = 0; si < c->ub_nseg; si++) {
            const se_ub_seg *sg = &c->ub_seg[si];
            if (sg->out) { src = c->x + (sg->start + sg->n - 1) * E; out = sg->ctx->logits; }
        }
        if (c->ub_defer) { /* the head waits for the sampler (screen.c): keep its input */
            if (ith == 0) memcpy(c->ub_defer->head_x, src, (size_t)E * sizeof(float));
            return;
        }
    } else if (!out) {
        out = c->ub_logits;
        n_out -= c->ub_ndefer;
        if (c->ub_nout < c->ub_n || c->ub_ndefer) {
            /* gather the last rows into c->tmp, free by now: the head's, then the deferred ones */
            int64_t s0, s1;
            se_split(c->ub_nseg, ith, nth, 1, &s0, &s1);
            for (int si = 0, j = 0, jd = n_out; si < c->ub_nseg; si++) {
                const se_ub_seg *sg = &c->ub_seg[si];
                if (!sg->out) continue;
                int *to = sg->defer ? &jd : &j;
                if (si >= s0 && si < s1)
                    memcpy(c->tmp + *to * E, c->x + (sg->start + sg->n - 1) * E, (size_t)E * sizeof(float));
                (*to)++;
            }
            se_pool_barrier(c->pool);
            src = c->tmp;
        }
    }
    const se_tensor *w[1] = { &m->output };
    se_acts a;
    if (c->ub_ndefer) { /* the deferred rows: their input kept, stage 1 of their screens (screen.c) */
        const float *d = src + n_out * E;
        for (int si = 0, i = 0; si < c->ub_nseg && ith == 0; si++)
            if (c->ub_seg[si].defer) memcpy(c->ub_seg[si].ctx->head_x, d + i++ * E, (size_t)E * sizeof(float));
        se_prep_acts(c, ith, nth, d, E, c->ub_ndefer, m->output_norm.data, w, 1, &a);
        se_screen_stage1_batch(c, ith, nth, &a);
        if (n_out == 0) return;
    }
    se_prep_acts(c, ith, nth, src, E, n_out, m->output_norm.data, w, 1, &a);
    const head_rows job = { &a, n_out, out };
    se_share_rows(c, ith, nth, V, head_chunk, &job, w, 1);
}
