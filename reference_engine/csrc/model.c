/* The engine's lifecycle (engine.h): models (described by Python, checked here), the architecture
 * table, contexts (every buffer a forward pass needs, allocated once) and se_decode, which runs
 * the model's architecture's forward pass (llama.c, gemma3.c, over the blocks of blocks.c) on the
 * thread pool, one ubatch at a time.
 *
 * Read it like llama2.c's run.c: plain structs (engine.h), buffers allocated once when a context
 * is created, and one forward function per architecture that takes a ubatch of tokens through
 * every layer.
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
#include "backend.h"
#include "screen.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>


const char *se_version(void) { return "0.1.0"; }

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---------------------------------------------------------------------------------------------
 * The architecture table, indexed by se_arch (hparams.arch): ids 1..SE_ARCH_COUNT - 1
 */

static const se_arch_desc *const archs[SE_ARCH_COUNT] = {
    [SE_ARCH_LLAMA] = &se_arch_llama,
    [SE_ARCH_GEMMA3] = &se_arch_gemma3,
};

static const se_arch_desc *arch_of(int32_t arch) {
    return arch > 0 && arch < SE_ARCH_COUNT ? archs[arch] : NULL;
}

const se_arch_desc *se_arch_of(int32_t arch) { return arch_of(arch); }

int32_t se_arch_count(void) { return SE_ARCH_COUNT - 1; }

const char *se_arch_name(int32_t arch) {
    const se_arch_desc *a = arch_of(arch);
    return a ? a->name : NULL;
}

int32_t se_arch_id(const char *name) {
    for (int32_t i = 1; name && i < SE_ARCH_COUNT; i++)
        if (!strcmp(archs[i]->name, name)) return i;
    return SE_ERR_INVALID;
}

int se_arch_layer_slot(int32_t arch, int32_t slot) {
    const se_arch_desc *a = arch_of(arch);
    if (!a || slot < 0 || slot >= SE_T_COUNT) return SE_ERR_INVALID;
    for (int i = 0; i < a->n_layer_slots; i++)
        if (a->layer_slots[i] == slot) return 1;
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Models
 */

se_model *se_model_new(const se_hparams *hp) {
    se_kernels_init(); /* the SIMD paths are chosen before the first model is described */
    if (!hp || !arch_of(hp->arch)) return NULL;
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
    pthread_mutex_init(&m->screen_lock, NULL);
    pthread_mutex_init(&m->panels_lock, NULL);
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (!m->layers) { free(m); return NULL; }
    for (int il = 0; il < hp->n_layer; il++) {
        m->layers[il].rope_base = hp->rope_base;
        m->layers[il].sliding_window = 0;
    }
    return m;
}

int se_model_set_batch_panels(se_model *m, int32_t on) {
    if (!m) return SE_ERR_INVALID;
    pthread_mutex_lock(&m->panels_lock);
    if (m->panels_state == 0 && !on) m->panels_state = -1;
    else if (m->panels_state == -1 && on && !m->panels) m->panels_state = 0;
    pthread_mutex_unlock(&m->panels_lock);
    return SE_OK;
}

size_t se_model_panels_bytes(const se_model *m) { return m ? m->panels_bytes : 0; }

/* The matmul weights that have panels: each layer's matrices and the head (the embedding's rows
 * are only looked up). */
static int panel_tensors(se_model *m, se_tensor **out) {
    int n = 0;
    for (int il = 0; il < m->hp.n_layer; il++)
        for (int slot = 0; slot < SE_T_COUNT; slot++) {
            se_tensor *t = &m->layers[il].t[slot];
            if (t->data && t->ne1 > 1 && se_panels_size(t->type, t->ne0, t->ne1)) out[n++] = t;
        }
    if (se_panels_size(m->output.type, m->output.ne0, m->output.ne1)) out[n++] = &m->output;
    return n;
}

/* Bytes of t's panels in the model's allocation (whole cache lines) */
static size_t panel_bytes(const se_tensor *t) { return (se_panels_size(t->type, t->ne0, t->ne1) + 63) / 64 * 64; }

/* Makes the panels once (se_model_set_batch_panels); without them (no memory, another ISA, a
 * device holding layers) the batches take se_matmul's kernels, with the same results. */
static void make_panels(se_model *m) {
    pthread_mutex_lock(&m->panels_lock);
    if (m->panels_state == 0) {
        m->panels_state = -1;
        se_tensor **ts = m->dev ? NULL : malloc(((size_t)m->hp.n_layer * SE_T_COUNT + 1) * sizeof *ts);
        const int n = ts ? panel_tensors(m, ts) : 0;
        size_t total = 0;
        for (int i = 0; i < n; i++) total += panel_bytes(ts[i]);
        char *mem = total ? aligned_alloc(64, total) : NULL;
        if (mem) {
            char *p = mem;
            for (int i = 0; i < n; p += panel_bytes(ts[i]), i++) se_pack_panels(ts[i]->type, ts[i]->data, ts[i]->ne0, ts[i]->ne1, p);
            p = mem; /* published once all are made: a pass of another context may be reading */
            for (int i = 0; i < n; p += panel_bytes(ts[i]), i++) __atomic_store_n(&ts[i]->panels, (const void *)p, __ATOMIC_RELEASE);
            m->panels = mem;
            m->panels_bytes = total;
            m->panels_state = 1;
        }
        free(ts);
    }
    pthread_mutex_unlock(&m->panels_lock);
}

int se_model_set_file_mapped(se_model *m, int32_t on) {
    if (!m) return SE_ERR_INVALID;
    m->file_mapped = on != 0;
    return SE_OK;
}

void se_model_free(se_model *m) {
    if (!m) return;
    if (m->dev) se_dev_model_free(m->dev); /* its contexts were freed first (engine.h) */
    se_screen_free(m->screen);
    pthread_mutex_destroy(&m->screen_lock);
    pthread_mutex_destroy(&m->panels_lock);
    free(m->panels);
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
    se_tensor t = { data, type, ne0, ne1, se_row_size(type, ne0), NULL };
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
    const se_arch_desc *arch = arch_of(m->hp.arch);
    for (int il = 0; il < m->hp.n_layer; il++) {
        for (int i = 0; i < arch->n_layer_slots; i++) {
            if (!m->layers[il].t[arch->layer_slots[i]].data) {
                *bad_layer = il;
                *bad_slot = arch->layer_slots[i];
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
    if ((cp.type_k != SE_F32 && cp.type_k != SE_F16) || (cp.type_v != SE_F32 && cp.type_v != SE_F16)) return NULL;

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
    c->k_cache = xalloc(kv * se_kv_elem_size(cp.type_k), &ok);
    c->v_cache = xalloc(kv * se_kv_elem_size(cp.type_v), &ok);
    c->k_new = xalloc((size_t)(U * hp->n_head_kv * hp->head_dim) * sizeof(float), &ok);
    c->v_new = xalloc((size_t)(U * hp->n_head_kv * hp->head_dim) * sizeof(float), &ok);
    c->ub_seg = xalloc((size_t)U * sizeof(se_ub_seg), &ok);
    c->ub_rseg = xalloc((size_t)U * sizeof(int32_t), &ok);
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
    c->head_x = xalloc((size_t)E * sizeof(float), &ok);
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
    if (ok && m->dev) { /* the device KV caches and scratch; se_backend_error() says why not */
        c->dev = se_dev_ctx_new(m, &cp);
        if (!c->dev) ok = 0;
    }
    if (!ok) { se_context_free(c); return NULL; }
    memset(c->logits, 0, (size_t)V * sizeof(float));
    c->n_past = 0;
    return c;
}

void se_context_free(se_context *c) {
    if (!c) return;
    if (c->pool) se_pool_free(c->pool);
    if (c->dev) se_dev_ctx_free(c->m, c->dev);
    int n_thr = c->cp.n_threads > c->cp.n_threads_batch ? c->cp.n_threads : c->cp.n_threads_batch;
    if (c->ts) {
        for (int i = 0; i < n_thr; i++) {
            free(c->ts[i].norm);
            for (int j = 0; j < 3; j++) free(c->ts[i].act[j]);
        }
        free(c->ts);
    }
    free(c->k_cache); free(c->v_cache); free(c->k_new); free(c->v_new); free(c->tokens);
    free(c->ub_seg); free(c->ub_rseg); free(c->ub_logits);
    free(c->x); free(c->xb); free(c->q); free(c->att); free(c->tmp); free(c->hb); free(c->hb2);
    free(c->rope);
    for (int j = 0; j < 3; j++) free(c->act[j]);
    free(c->logits); free(c->cand); free(c->cand_sorting); free(c->counts);
    free(c->head_x); free(c->ban);
    se_screen_context_free(c);
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
 * Decoding
 */

static void prologue_job(void *arg, int ith, int nth) { se_forward_prologue(arg, ith, nth); }

/* One forward pass of c->ub_n rows (c->ub_tokens) in c->ub_nseg segments (c->ub_seg, set by the
 * caller) on c's thread pool; then each segment's context holds its rows' tokens. An offloaded
 * model (backend.h): the embeddings on the pool, the device's layers (and head), then the
 * remaining layers (and head) on the pool. SE_ERR_DEVICE when the device failed: the rows'
 * contexts then do not count them (n_past unchanged). */
static int run_ubatch(se_context *c) {
    c->ub_nout = 0;
    se_context *out = NULL; /* the context of the one output row, if one */
    for (int32_t si = 0; si < c->ub_nseg; si++) {
        const se_ub_seg *sg = &c->ub_seg[si];
        for (int32_t t = sg->start; t < sg->start + sg->n; t++) c->ub_rseg[t] = si;
        c->ub_nout += sg->out;
        if (sg->out) out = sg->ctx;
    }
    /* one context's last row, its logits not asked for yet: the head can wait (screen.c); of
     * several, those whose sampler a screen serves, if few enough (stage 1 in the pass) */
    c->ub_defer = c->ub_nout == 1 && !c->ub_out && out->lazy_head && se_screen_possible(c->m) ? out : NULL;
    c->ub_ndefer = 0;
    int32_t n_cand = 0;
    for (int32_t si = 0; si < c->ub_nseg && c->ub_nout > 1; si++)
        n_cand += c->ub_seg[si].out && c->ub_seg[si].ctx->batch_screen;
    for (int32_t si = 0; si < c->ub_nseg; si++) {
        se_ub_seg *sg = &c->ub_seg[si];
        sg->defer = c->ub_nout > 1 && n_cand <= SE_SCREEN_BATCH && sg->out && se_screen_defer(c, sg->ctx);
        c->ub_ndefer += sg->defer;
    }
    int nth = c->ub_n == 1 ? c->cp.n_threads : c->cp.n_threads_batch;
    const struct se_dev_model *dm = c->m->dev;
    c->layer0 = 0;
    if (dm) {
        se_pool_run(c->pool, nth, prologue_job, c);
        int rc = se_dev_forward(c);
        if (rc != SE_OK) return rc;
        c->layer0 = dm->n_layers;
    }
    if (!dm || !dm->head) {
        se_share_rows_reset(c, nth);
        se_pool_run(c->pool, nth, arch_of(c->m->hp.arch)->forward, c);
    }
    for (int32_t si = 0; si < c->ub_nseg; si++) {
        se_ub_seg *sg = &c->ub_seg[si];
        if (sg->out) {
            sg->ctx->head_pending = sg->ctx == c->ub_defer || sg->defer;
            sg->ctx->scr_ready = sg->defer;
        }
        memcpy(sg->ctx->tokens + sg->ctx->n_past, c->ub_tokens + sg->start, (size_t)sg->n * sizeof(int32_t));
        sg->ctx->n_past += sg->n;
    }
    return SE_OK;
}

static int check_tokens(const se_context *c, const int32_t *tokens, int32_t n) {
    if ((int64_t)c->n_past + n > c->cp.n_ctx) return SE_ERR_CONTEXT_OVERFLOW;
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->m->hp.n_vocab) return SE_ERR_BAD_TOKEN;
    return SE_OK;
}

int se_decode(se_context *c, const int32_t *tokens, int32_t n, float *all_logits) {
    if (!c || !tokens || n < 1) return SE_ERR_INVALID;
    const se_hparams *hp = &c->m->hp;
    int rc = check_tokens(c, tokens, n);
    if (rc != SE_OK) return rc;
    int32_t done = 0;
    while (done < n) {
        /* a logical batch of n_batch tokens, evaluated in ubatches of n_ubatch */
        int32_t batch_end = (int32_t)min64(n, (int64_t)done + c->cp.n_batch);
        while (done < batch_end) {
            int32_t nu = (int32_t)min64(c->cp.n_ubatch, batch_end - done);
            c->ub_tokens = tokens + done;
            c->ub_n = nu;
            c->ub_out = all_logits ? all_logits + (size_t)done * hp->n_vocab : NULL;
            /* one segment; its last row's logits are wanted if it is the call's last token */
            c->ub_seg[0] = (se_ub_seg){ c, 0, nu, c->n_past, !all_logits && done + nu == n, 0 };
            c->ub_nseg = 1;
            rc = run_ubatch(c);
            if (rc != SE_OK) return rc;
            done += nu;
        }
    }
    if (all_logits) {
        c->head_pending = 0;
        memcpy(c->logits, all_logits + (size_t)(n - 1) * hp->n_vocab, (size_t)hp->n_vocab * sizeof(float));
    }
    return SE_OK;
}

int se_decode_batch(se_context *const *ctxs, int32_t n_seq, const int32_t *tokens, const int32_t *n_tokens) {
    if (!ctxs || n_seq < 1 || !tokens || !n_tokens) return SE_ERR_INVALID;
    for (int32_t i = 0; i < n_seq; i++) {
        if (!ctxs[i] || ctxs[i]->m != ctxs[0]->m || n_tokens[i] < 1) return SE_ERR_INVALID;
        for (int32_t j = 0; j < i; j++)
            if (ctxs[j] == ctxs[i]) return SE_ERR_INVALID;
    }
    int64_t total = 0;
    for (int32_t i = 0; i < n_seq; i++) {
        int rc = check_tokens(ctxs[i], tokens + total, n_tokens[i]);
        if (rc != SE_OK) return rc;
        total += n_tokens[i];
    }
    se_context *c = ctxs[0]; /* its scratch and thread pool serve every pass */
    if (n_seq > 1) make_panels((se_model *)c->m); /* the model's, made once, then read only */
    int64_t V = c->m->hp.n_vocab, U = c->cp.n_ubatch;
    /* room for the logits of every context that may end in one pass, before anything is changed */
    int32_t rows = (int32_t)min64(n_seq, U);
    if (rows > 1 && rows > c->ub_logits_rows) {
        int ok = 1;
        float *buf = xalloc((size_t)rows * (size_t)V * sizeof(float), &ok);
        if (!ok) return SE_ERR_NOMEM;
        free(c->ub_logits);
        c->ub_logits = buf;
        c->ub_logits_rows = rows;
    }
    c->ub_out = NULL;
    /* passes of up to U rows: the contexts in order, a context's tokens split where a pass is full */
    int64_t first = 0; /* the next row to evaluate, an index into tokens */
    int32_t i = 0, off = 0; /* its context, and its offset within that context's tokens */
    while (i < n_seq) {
        c->ub_tokens = tokens + first;
        c->ub_n = 0;
        c->ub_nseg = 0;
        while (i < n_seq && c->ub_n < U) {
            int32_t n = (int32_t)min64(n_tokens[i] - off, U - c->ub_n);
            c->ub_seg[c->ub_nseg++] = (se_ub_seg){ ctxs[i], c->ub_n, n, ctxs[i]->n_past, off + n == n_tokens[i], 0 };
            c->ub_n += n;
            off += n;
            if (off == n_tokens[i]) { i++; off = 0; }
        }
        int rc = run_ubatch(c);
        if (rc != SE_OK) return rc;
        first += c->ub_n;
    }
    return SE_OK;
}
