/* Models, contexts and the forward pass of the llama architecture (SmolLM2 and friends).
 *
 * Read it like llama2.c's run.c: plain structs (engine.h), buffers allocated once when a context
 * is created, and one function, llama_forward(), that takes a ubatch of tokens through every
 * layer. That function runs on every thread of the pool at once; the threads split each step
 * (by weight rows for matmuls, by (token, head) for attention) and meet at a barrier only where
 * a step needs the whole result of the previous one:
 *
 *   per layer:  [norm+quantize] QKV (+rope, +cache store) | attention | [quantize] O (+residual) |
 *               [norm+quantize] gate,up (+SwiGLU) | [quantize] down (+residual) |
 *
 * Small batches (a generated token) normalize and quantize the activations redundantly on every
 * thread, which is cheaper than a barrier; large ones split that work by tokens and add a barrier.
 * So a single-token decode costs 5 barriers per layer.
 *
 * The matmuls go through the kernels' contract (kernels.h): activations are quantized to the
 * weight type's act_type, then se_matmul computes a range of output rows for every token.
 *
 * KV cache: f32, per layer and kv head, so that the keys (and values) one head attends over are
 * contiguous; attention.c owns the layout (keys in transposed tiles of 16 positions, values in
 * rows) and the attention kernel. f32 keeps the attention exact and simple; f16 (half the bytes
 * per position) is a later option.
 */
#define _GNU_SOURCE
#define SE_ENGINE_INTERNAL
#include "engine.h"
#include "kernels.h"
#include "blocks.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>


const char *se_version(void) { return "0.1.0"; }

static pthread_once_t kernels_once = PTHREAD_ONCE_INIT;
static void kernels_init_once(void) { se_kernels_init(); }

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---------------------------------------------------------------------------------------------
 * Models
 */

se_model *se_model_new(const se_hparams *hp) {
    pthread_once(&kernels_once, kernels_init_once);
    if (!hp) return NULL;
    if (hp->arch != SE_ARCH_LLAMA && hp->arch != SE_ARCH_GEMMA3) return NULL;
    /* Sanity bounds: a hostile header must not make us allocate or index wildly. */
    if (hp->n_vocab < 1 || hp->n_vocab > (1 << 24)) return NULL;
    if (hp->n_embd < 1 || hp->n_embd > (1 << 16)) return NULL;
    if (hp->n_ff < 1 || hp->n_ff > (1 << 18)) return NULL;
    if (hp->n_layer < 1 || hp->n_layer > 1024) return NULL;
    if (hp->n_head < 1 || hp->n_head > 1024) return NULL;
    if (hp->n_head_kv < 1 || hp->n_head_kv > hp->n_head || hp->n_head % hp->n_head_kv) return NULL;
    if (hp->head_dim < 2 || hp->head_dim > 1024) return NULL;
    if (hp->n_rot < 2 || hp->n_rot > hp->head_dim || hp->n_rot % 2) return NULL;
    if (hp->rope_type != SE_ROPE_NORM && hp->rope_type != SE_ROPE_NEOX) return NULL;
    if (!(hp->norm_eps >= 0 && hp->norm_eps < 1)) return NULL;
    if (!(hp->rope_base > 0) || !(hp->rope_freq_scale > 0)) return NULL;
    if (!isfinite(hp->attn_scale) || !isfinite(hp->embd_scale)) return NULL;

    se_model *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->hp = *hp;
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (!m->layers) { free(m); return NULL; }
    for (int il = 0; il < hp->n_layer; il++) {
        m->layers[il].rope_base = hp->rope_base;
        m->layers[il].sliding_window = 0;
    }
    return m;
}

void se_model_free(se_model *m) {
    if (!m) return;
    free(m->layers);
    free(m);
}

static int is_norm_slot(int slot) {
    return slot == SE_T_OUTPUT_NORM || slot == SE_T_ATTN_NORM || slot == SE_T_ATTN_Q_NORM ||
           slot == SE_T_ATTN_K_NORM || slot == SE_T_ATTN_POST_NORM || slot == SE_T_FFN_NORM ||
           slot == SE_T_FFN_POST_NORM;
}

/* The shape a slot must have: ne0 (row length) and ne1 (rows; 1 for vectors). */
static void expected_shape(const se_hparams *hp, int slot, int64_t *ne0, int64_t *ne1) {
    int64_t E = hp->n_embd, Dq = (int64_t)hp->n_head * hp->head_dim;
    int64_t Dkv = (int64_t)hp->n_head_kv * hp->head_dim;
    *ne1 = 1;
    switch (slot) {
    case SE_T_TOKEN_EMBD: case SE_T_OUTPUT: *ne0 = E; *ne1 = hp->n_vocab; break;
    case SE_T_OUTPUT_NORM: case SE_T_ATTN_NORM: case SE_T_ATTN_POST_NORM:
    case SE_T_FFN_NORM: case SE_T_FFN_POST_NORM: *ne0 = E; break;
    case SE_T_ATTN_Q: *ne0 = E; *ne1 = Dq; break;
    case SE_T_ATTN_K: case SE_T_ATTN_V: *ne0 = E; *ne1 = Dkv; break;
    case SE_T_ATTN_OUTPUT: *ne0 = Dq; *ne1 = E; break;
    case SE_T_ATTN_Q_NORM: case SE_T_ATTN_K_NORM: *ne0 = hp->head_dim; break;
    case SE_T_FFN_GATE: case SE_T_FFN_UP: *ne0 = E; *ne1 = hp->n_ff; break;
    case SE_T_FFN_DOWN: *ne0 = hp->n_ff; *ne1 = E; break;
    default: *ne0 = *ne1 = -1;
    }
}

static int is_global_slot(int slot) {
    return slot == SE_T_TOKEN_EMBD || slot == SE_T_OUTPUT_NORM || slot == SE_T_OUTPUT;
}

int se_model_set_tensor(se_model *m, int32_t layer, int32_t slot, const void *data, int32_t type,
                        int64_t ne0, int64_t ne1) {
    if (!m || m->finalized || !data || slot < 0 || slot >= SE_T_COUNT) return SE_ERR_INVALID;
    if (is_global_slot(slot) ? layer != -1 : (layer < 0 || layer >= m->hp.n_layer)) return SE_ERR_INVALID;
    int64_t want0, want1;
    expected_shape(&m->hp, slot, &want0, &want1);
    if (ne0 != want0 || ne1 != want1) return SE_ERR_INVALID;
    const se_type_traits *tr = se_traits(type);
    if (!tr || ne0 % tr->blck) return SE_ERR_INVALID;
    if (is_norm_slot(slot)) {
        if (type != SE_F32) return SE_ERR_INVALID; /* read directly as floats */
    } else if (slot == SE_T_TOKEN_EMBD) {
        if (!tr->to_float) return SE_ERR_INVALID; /* rows are dequantized one at a time */
    } else {
        /* a matmul weight: needs a dot and an activation type we can produce */
        const se_type_traits *at = se_traits(tr->act_type);
        if (!tr->dot || !at || !at->from_float) return SE_ERR_INVALID;
    }
    se_tensor t = { data, type, ne0, ne1, se_row_size(type, ne0) };
    if (is_global_slot(slot)) {
        if (slot == SE_T_TOKEN_EMBD) m->token_embd = t;
        else if (slot == SE_T_OUTPUT_NORM) m->output_norm = t;
        else m->output = t;
    } else {
        m->layers[layer].t[slot] = t;
    }
    return SE_OK;
}

int se_model_set_layer(se_model *m, int32_t layer, float rope_base, int32_t sliding_window) {
    if (!m || m->finalized || layer < 0 || layer >= m->hp.n_layer) return SE_ERR_INVALID;
    if (!(rope_base > 0) || sliding_window < 0) return SE_ERR_INVALID;
    m->layers[layer].rope_base = rope_base;
    m->layers[layer].sliding_window = sliding_window;
    return SE_OK;
}

int se_model_finalize(se_model *m, int32_t *bad_layer, int32_t *bad_slot) {
    if (!m) return SE_ERR_INVALID;
    int32_t dummy_l, dummy_s;
    if (!bad_layer) bad_layer = &dummy_l;
    if (!bad_slot) bad_slot = &dummy_s;
    *bad_layer = -1;
    *bad_slot = -1;
    if (!m->token_embd.data) { *bad_slot = SE_T_TOKEN_EMBD; return SE_ERR_MISSING; }
    if (!m->output_norm.data) { *bad_slot = SE_T_OUTPUT_NORM; return SE_ERR_MISSING; }
    if (!m->output.data) {
        /* tied output head: the embedding matrix, which must then be usable as a matmul weight */
        const se_type_traits *tr = se_traits(m->token_embd.type);
        const se_type_traits *at = se_traits(tr->act_type);
        if (!tr->dot || !at || !at->from_float) { *bad_slot = SE_T_OUTPUT; return SE_ERR_MISSING; }
        m->output = m->token_embd;
    }
    static const int required[] = { SE_T_ATTN_NORM, SE_T_ATTN_Q, SE_T_ATTN_K, SE_T_ATTN_V,
                                    SE_T_ATTN_OUTPUT, SE_T_FFN_NORM, SE_T_FFN_GATE, SE_T_FFN_UP,
                                    SE_T_FFN_DOWN };
    /* gemma3 also normalises q and k per head and the output of each block (gemma3.c) */
    static const int required_gemma3[] = { SE_T_ATTN_Q_NORM, SE_T_ATTN_K_NORM, SE_T_ATTN_POST_NORM,
                                           SE_T_FFN_POST_NORM };
    for (int il = 0; il < m->hp.n_layer; il++) {
        for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
            if (!m->layers[il].t[required[i]].data) {
                *bad_layer = il;
                *bad_slot = required[i];
                return SE_ERR_MISSING;
            }
        }
        for (size_t i = 0; m->hp.arch == SE_ARCH_GEMMA3 && i < sizeof required_gemma3 / sizeof required_gemma3[0]; i++) {
            if (!m->layers[il].t[required_gemma3[i]].data) {
                *bad_layer = il;
                *bad_slot = required_gemma3[i];
                return SE_ERR_MISSING;
            }
        }
    }
    /* one rope table per distinct base, shared by the layers that use it */
    m->n_rope = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        se_layer *L = &m->layers[il];
        int k = 0;
        while (k < m->n_rope && m->rope_bases[k] != L->rope_base) k++;
        if (k == m->n_rope) {
            if (m->n_rope == SE_MAX_ROPE_TABLES) return SE_ERR_INVALID;
            m->rope_bases[m->n_rope++] = L->rope_base;
        }
        L->rope_idx = k;
    }
    m->finalized = 1;
    return SE_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Contexts
 */

static void *xalloc(size_t n, int *ok) {
    /* 64-byte aligned (cache lines, and SIMD loads in the kernels) */
    void *p = NULL;
    if (n == 0) n = 64;
    if (posix_memalign(&p, 64, (n + 63) / 64 * 64) != 0) { *ok = 0; return NULL; }
    return p;
}

/* Every activation type any matmul of the model needs, and the widest input row (k). */
static size_t max_act_row(const se_model *m, int64_t k) {
    size_t best = se_row_size(SE_F32, k);
    for (int il = 0; il < m->hp.n_layer; il++) {
        for (int s = 0; s < SE_T_COUNT; s++) {
            const se_tensor *t = &m->layers[il].t[s];
            if (!t->data || is_norm_slot(s)) continue;
            size_t r = se_row_size(se_traits(t->type)->act_type, k);
            if (r > best) best = r;
        }
    }
    size_t r = se_row_size(se_traits(m->output.type)->act_type, k);
    return r > best ? r : best;
}

se_context *se_context_new(const se_model *m, const se_context_params *cp_in) {
    if (!m || !m->finalized || !cp_in) return NULL;
    se_context_params cp = *cp_in;
    if (cp.n_ctx < 1 || cp.n_ctx > (1 << 22)) return NULL;
    if (cp.n_threads < 1) cp.n_threads = 1;
    if (cp.n_threads_batch < 1) cp.n_threads_batch = cp.n_threads;
    if (cp.n_threads > 255) cp.n_threads = 255;
    if (cp.n_threads_batch > 255) cp.n_threads_batch = 255;
    if (cp.n_batch < 1) cp.n_batch = cp.n_ctx;
    if (cp.n_ubatch < 1 || cp.n_ubatch > cp.n_batch) cp.n_ubatch = cp.n_batch;
    if (cp.n_ubatch > cp.n_ctx) cp.n_ubatch = cp.n_ctx;

    const se_hparams *hp = &m->hp;
    int64_t E = hp->n_embd, F = hp->n_ff, Dq = (int64_t)hp->n_head * hp->head_dim;
    int64_t kmax = max64(max64(E, F), Dq);
    int64_t U = cp.n_ubatch, V = hp->n_vocab;
    int n_thr = cp.n_threads > cp.n_threads_batch ? cp.n_threads : cp.n_threads_batch;

    se_context *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->m = m;
    c->cp = cp;
    int ok = 1;
    size_t kv = (size_t)hp->n_layer * hp->n_head_kv * (size_t)se_kv_positions(cp.n_ctx) * hp->head_dim;
    c->k_cache = xalloc(kv * sizeof(float), &ok);
    c->v_cache = xalloc(kv * sizeof(float), &ok);
    c->k_new = xalloc((size_t)(U * hp->n_head_kv * hp->head_dim) * sizeof(float), &ok);
    c->tokens = xalloc((size_t)cp.n_ctx * sizeof(int32_t), &ok);
    c->x = xalloc((size_t)(U * E) * sizeof(float), &ok);
    c->xb = xalloc((size_t)(U * kmax) * sizeof(float), &ok);
    c->q = xalloc((size_t)(U * Dq) * sizeof(float), &ok);
    c->att = xalloc((size_t)(U * Dq) * sizeof(float), &ok);
    c->tmp = xalloc((size_t)(U * E) * sizeof(float), &ok);
    c->hb = xalloc((size_t)(U * F) * sizeof(float), &ok);
    c->hb2 = xalloc((size_t)(U * F) * sizeof(float), &ok);
    c->rope = xalloc((size_t)m->n_rope * (size_t)U * (size_t)hp->n_rot * sizeof(float), &ok);
    size_t act_row = max_act_row(m, kmax);
    c->act_size = act_row * (size_t)U;
    for (int j = 0; j < 3; j++) c->act[j] = xalloc(c->act_size, &ok);
    c->logits = xalloc((size_t)V * sizeof(float), &ok);
    c->cand = xalloc((size_t)V * sizeof(se_cand), &ok);
    c->counts = calloc((size_t)V, sizeof(int32_t));
    if (!c->counts) ok = 0;
    c->ts = calloc((size_t)n_thr, sizeof *c->ts);
    if (!c->ts) ok = 0;
    for (int i = 0; ok && i < n_thr; i++) {
        c->ts[i].norm = xalloc((size_t)(SE_PRIVATE_TOKENS * kmax) * sizeof(float), &ok);
        for (int j = 0; j < 3; j++) c->ts[i].act[j] = xalloc(act_row * SE_PRIVATE_TOKENS, &ok);
    }
    if (ok) {
        c->pool = se_pool_new(n_thr);
        if (!c->pool) ok = 0;
    }
    if (!ok) { se_context_free(c); return NULL; }
    memset(c->logits, 0, (size_t)V * sizeof(float));
    c->n_past = 0;
    return c;
}

void se_context_free(se_context *c) {
    if (!c) return;
    if (c->pool) se_pool_free(c->pool);
    int n_thr = c->cp.n_threads > c->cp.n_threads_batch ? c->cp.n_threads : c->cp.n_threads_batch;
    if (c->ts) {
        for (int i = 0; i < n_thr; i++) {
            free(c->ts[i].norm);
            for (int j = 0; j < 3; j++) free(c->ts[i].act[j]);
        }
        free(c->ts);
    }
    free(c->k_cache); free(c->v_cache); free(c->k_new); free(c->tokens);
    free(c->x); free(c->xb); free(c->q); free(c->att); free(c->tmp); free(c->hb); free(c->hb2);
    free(c->rope);
    for (int j = 0; j < 3; j++) free(c->act[j]);
    free(c->logits); free(c->cand); free(c->counts);
    free(c);
}

float *se_context_logits(se_context *c) { return c->logits; }
int32_t se_context_n_past(const se_context *c) { return c->n_past; }
const int32_t *se_context_tokens(const se_context *c) { return c->tokens; }

void se_context_reset(se_context *c) {
    c->n_past = 0;
    c->rng_seeded = 0; /* the next sample reseeds: the same seed replays the same draws */
}

int se_context_truncate(se_context *c, int32_t n_past) {
    if (n_past < 0 || n_past > c->n_past) return SE_ERR_INVALID;
    c->n_past = n_past; /* positions past n_past are simply overwritten by later decodes */
    c->rng_seeded = 0;  /* a truncated context starts a new continuation: the seed replays too */
    return SE_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Building blocks of the forward pass (shared by the architectures)
 */

/* [*r0, *r1): this thread's share of n items, boundaries on multiples of align */
void se_split(int64_t n, int ith, int nth, int64_t align, int64_t *r0, int64_t *r1) {
    int64_t blocks = (n + align - 1) / align;
    *r0 = min64(n, blocks * ith / nth * align);
    *r1 = min64(n, blocks * (ith + 1) / nth * align);
}

/* y = x / rms(x) * w (llama.cpp accumulates the sum of squares in double; so do we) */
void se_rmsnorm(float *y, const float *x, const float *w, int64_t n, float eps) {
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)(x[i] * x[i]);
    float scale = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * scale * w[i];
}

static const void *act_for(const se_acts *a, int wtype) {
    int at = se_traits(wtype)->act_type;
    for (int j = 0; j < a->n; j++)
        if (a->type[j] == at) return a->ptr[j];
    return NULL; /* cannot happen: prep_acts saw every weight */
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
}

/* y rows [r0, r1) = W x for every token, through the kernels */
void se_matmul_rows(const se_tensor *W, const se_acts *a, int n_tok, float *y, int64_t ldy,
                    int64_t r0, int64_t r1) {
    if (r1 <= r0) return;
    se_matmul(W->type, W->data, W->ne0, act_for(a, W->type), n_tok, y, ldy, r0, r1);
}

/* Rotates one head's first n_rot dims by the angles in cs ((cos, sin) pairs, n_rot/2 of them). */
static void rope_apply(float *x, const float *cs, int n_rot, int mode) {
    int half = n_rot / 2;
    if (mode == SE_ROPE_NORM) {
        for (int i = 0; i < half; i++) {
            float c = cs[2 * i], s = cs[2 * i + 1];
            float x0 = x[2 * i], x1 = x[2 * i + 1];
            x[2 * i] = x0 * c - x1 * s;
            x[2 * i + 1] = x0 * s + x1 * c;
        }
    } else {
        for (int i = 0; i < half; i++) {
            float c = cs[2 * i], s = cs[2 * i + 1];
            float x0 = x[i], x1 = x[i + half];
            x[i] = x0 * c - x1 * s;
            x[i + half] = x0 * s + x1 * c;
        }
    }
}

/* (cos, sin) of pos * freq_scale * base^(-2i/n_rot) for i < n_rot/2. The angle is stepped by
 * repeated multiplication in float, as llama.cpp does, so positions far out agree closely. */
static void rope_table(float *cs, int64_t pos, float base, float freq_scale, int n_rot) {
    float theta_scale = powf(base, -2.0f / (float)n_rot);
    float theta = (float)pos;
    for (int i = 0; i < n_rot / 2; i++) {
        float a = theta * freq_scale;
        cs[2 * i] = cosf(a);
        cs[2 * i + 1] = sinf(a);
        theta *= theta_scale;
    }
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
        const char *row = (const char *)m->token_embd.data + (size_t)c->ub_tokens[t] * m->token_embd.row_size;
        to_float(row, x, hp->n_embd);
        if (hp->embd_scale != 1.0f)
            for (int i = 0; i < hp->n_embd; i++) x[i] *= hp->embd_scale;
        for (int b = 0; b < m->n_rope; b++)
            rope_table((float *)rope_row(c, b, (int)t), c->ub_pos + t, m->rope_bases[b],
                       hp->rope_freq_scale, hp->n_rot);
    }
    se_pool_barrier(c->pool);
}

/* Q, K and V projections of layer il, split across threads by whole heads, so that each thread
 * can finish its heads at once: Q heads are roped in place; K heads are roped in c->k_new, then
 * stored into the cache's key tiles; V heads go straight into the cache. Then a barrier. */
void se_forward_qkv(se_context *c, int il, const se_acts *a, int ith, int nth) {
    const se_hparams *hp = &c->m->hp;
    const se_layer *L = &c->m->layers[il];
    int H = hp->n_head, HKV = hp->n_head_kv, hd = hp->head_dim, n = c->ub_n;
    int64_t Dq = (int64_t)H * hd;
    int64_t u0, u1;
    se_split(H + 2 * HKV, ith, nth, 1, &u0, &u1);
    /* Q heads [u0, min(u1, H)) in one call */
    int64_t q0 = u0, q1 = min64(u1, H);
    if (q1 > q0) {
        se_matmul_rows(&L->t[SE_T_ATTN_Q], a, n, c->q, Dq, q0 * hd, q1 * hd);
        const float *qn = L->t[SE_T_ATTN_Q_NORM].data;
        for (int t = 0; t < n; t++) {
            const float *cs = rope_row(c, L->rope_idx, t);
            for (int64_t h = q0; h < q1; h++) {
                float *q = c->q + t * Dq + h * hd;
                if (qn) se_rmsnorm(q, q, qn, hd, hp->norm_eps);
                rope_apply(q, cs, hp->n_rot, hp->rope_type);
            }
        }
    }
    /* K and V heads: one call per head, the output rows (row stride hd) landing in c->k_new for K,
     * in the cache for V */
    for (int64_t u = max64(u0, H); u < u1; u++) {
        int is_k = u < H + HKV;
        int h = (int)(is_k ? u - H : u - H - HKV);
        const se_tensor *W = &L->t[is_k ? SE_T_ATTN_K : SE_T_ATTN_V];
        float *dst = is_k ? c->k_new + (size_t)h * c->cp.n_ubatch * hd : se_kv_value_row(c, il, h, c->ub_pos);
        /* rows [h*hd, (h+1)*hd) of W, addressed as rows [0, hd) of the sub-matrix */
        se_tensor sub = *W;
        sub.data = (const char *)W->data + (size_t)h * hd * W->row_size;
        se_matmul_rows(&sub, a, n, dst, hd, 0, hd);
        if (is_k) {
            const float *kn = L->t[SE_T_ATTN_K_NORM].data;
            for (int t = 0; t < n; t++) {
                float *k = dst + (size_t)t * hd;
                if (kn) se_rmsnorm(k, k, kn, hd, hp->norm_eps);
                rope_apply(k, rope_row(c, L->rope_idx, t), hp->n_rot, hp->rope_type);
            }
            se_kv_store_keys(c, il, h, c->ub_pos, n, dst);
        }
    }
    se_pool_barrier(c->pool);
}

/* x += W act for this thread's rows of W (all tokens), then a barrier. */
static void forward_residual_matmul(se_context *c, const se_tensor *W, const se_acts *a, int ith,
                                    int nth) {
    int64_t E = c->m->hp.n_embd, r0, r1;
    se_split(W->ne1, ith, nth, SPLIT_ALIGN, &r0, &r1);
    se_matmul_rows(W, a, c->ub_n, c->tmp, E, r0, r1);
    for (int t = 0; t < c->ub_n; t++) {
        float *x = c->x + t * E;
        const float *y = c->tmp + t * E;
        for (int64_t r = r0; r < r1; r++) x[r] += y[r];
    }
    se_pool_barrier(c->pool);
}

static float silu(float x) { return x / (1.0f + expf(-x)); }

/* hb = silu(gate act) * (up act) for this thread's rows of the ffn, then a barrier. */
static void forward_swiglu(se_context *c, const se_layer *L, const se_acts *a, int ith, int nth) {
    int64_t F = c->m->hp.n_ff, r0, r1;
    se_split(F, ith, nth, SPLIT_ALIGN, &r0, &r1);
    se_matmul_rows(&L->t[SE_T_FFN_GATE], a, c->ub_n, c->hb, F, r0, r1);
    se_matmul_rows(&L->t[SE_T_FFN_UP], a, c->ub_n, c->hb2, F, r0, r1);
    for (int t = 0; t < c->ub_n; t++) {
        float *g = c->hb + t * F;
        const float *u = c->hb2 + t * F;
        for (int64_t r = r0; r < r1; r++) g[r] = silu(g[r]) * u[r];
    }
    se_pool_barrier(c->pool);
}

/* Final norm and the output head for the tokens whose logits are wanted. */
void se_forward_output(se_context *c, int ith, int nth) {
    const se_model *m = c->m;
    int64_t E = m->hp.n_embd, V = m->hp.n_vocab;
    int first, n_out;
    float *out;
    if (c->ub_out) { first = 0; n_out = c->ub_n; out = c->ub_out; }
    else { first = c->ub_n - 1; n_out = 1; out = c->logits; }
    const se_tensor *w[1] = { &m->output };
    se_acts a;
    se_prep_acts(c, ith, nth, c->x + first * E, E, n_out, m->output_norm.data, w, 1, &a);
    int64_t r0, r1;
    se_split(V, ith, nth, SPLIT_ALIGN, &r0, &r1);
    se_matmul_rows(&m->output, &a, n_out, out, V, r0, r1);
}

/* ---------------------------------------------------------------------------------------------
 * The llama forward pass: one ubatch (c->ub_*), on every thread of the pool.
 */
static void llama_forward(void *arg, int ith, int nth) {
    se_context *c = arg;
    const se_model *m = c->m;
    const se_hparams *hp = &m->hp;
    int n = c->ub_n;
    int64_t E = hp->n_embd, Dq = (int64_t)hp->n_head * hp->head_dim;
    se_acts a;

    se_forward_prologue(c, ith, nth);
    for (int il = 0; il < hp->n_layer; il++) {
        const se_layer *L = &m->layers[il];
        /* attention block */
        const se_tensor *qkv[3] = { &L->t[SE_T_ATTN_Q], &L->t[SE_T_ATTN_K], &L->t[SE_T_ATTN_V] };
        se_prep_acts(c, ith, nth, c->x, E, n, L->t[SE_T_ATTN_NORM].data, qkv, 3, &a);
        se_forward_qkv(c, il, &a, ith, nth);
        se_forward_attention(c, il, ith, nth);
        const se_tensor *wo[1] = { &L->t[SE_T_ATTN_OUTPUT] };
        se_prep_acts(c, ith, nth, c->att, Dq, n, NULL, wo, 1, &a);
        forward_residual_matmul(c, wo[0], &a, ith, nth);
        /* feed-forward block */
        const se_tensor *gu[2] = { &L->t[SE_T_FFN_GATE], &L->t[SE_T_FFN_UP] };
        se_prep_acts(c, ith, nth, c->x, E, n, L->t[SE_T_FFN_NORM].data, gu, 2, &a);
        forward_swiglu(c, L, &a, ith, nth);
        const se_tensor *wd[1] = { &L->t[SE_T_FFN_DOWN] };
        se_prep_acts(c, ith, nth, c->hb, hp->n_ff, n, NULL, wd, 1, &a);
        forward_residual_matmul(c, wd[0], &a, ith, nth);
    }
    if (c->ub_out || c->ub_out_first >= 0) se_forward_output(c, ith, nth);
}

/* ---------------------------------------------------------------------------------------------
 * Decoding
 */

int se_decode(se_context *c, const int32_t *tokens, int32_t n, float *all_logits) {
    if (!c || !tokens || n < 1) return SE_ERR_INVALID;
    const se_hparams *hp = &c->m->hp;
    if ((int64_t)c->n_past + n > c->cp.n_ctx) return SE_ERR_CONTEXT_OVERFLOW;
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab) return SE_ERR_BAD_TOKEN;
    se_pool_fn forward = hp->arch == SE_ARCH_GEMMA3 ? se_gemma3_forward : llama_forward;
    int32_t done = 0;
    while (done < n) {
        /* a logical batch of n_batch tokens, evaluated in ubatches of n_ubatch */
        int32_t batch_end = (int32_t)min64(n, (int64_t)done + c->cp.n_batch);
        while (done < batch_end) {
            int32_t nu = (int32_t)min64(c->cp.n_ubatch, batch_end - done);
            memcpy(c->tokens + c->n_past, tokens + done, (size_t)nu * sizeof(int32_t));
            c->ub_tokens = tokens + done;
            c->ub_n = nu;
            c->ub_pos = c->n_past;
            c->ub_out = all_logits ? all_logits + (size_t)done * hp->n_vocab : NULL;
            c->ub_out_first = (done + nu == n) ? nu - 1 : -1; /* last token of the call */
            int nth = nu == 1 ? c->cp.n_threads : c->cp.n_threads_batch;
            se_pool_run(c->pool, nth, forward, c);
            c->n_past += nu;
            done += nu;
        }
    }
    if (all_logits)
        memcpy(c->logits, all_logits + (size_t)(n - 1) * hp->n_vocab, (size_t)hp->n_vocab * sizeof(float));
    return SE_OK;
}
