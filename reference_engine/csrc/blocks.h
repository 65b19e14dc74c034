/* The building blocks of the forward passes (blocks.c; the attention itself and the KV cache in
 * attention.c) and the architecture table that model.c dispatches through. Internal: include after
 * defining SE_ENGINE_INTERNAL.
 *
 * A forward pass takes one ubatch (c->ub_*) through every layer and runs on every thread of the
 * pool at once (thread ith of nth). Each block says in its comment whether it ends with a
 * barrier; the blocks an architecture file calls all do, so that the next block may read
 * everything the previous one wrote.
 */
#ifndef SE_BLOCKS_H
#define SE_BLOCKS_H

#include "engine.h"
#include "kernels.h"

#include <math.h>

#define SPLIT_ALIGN 16 /* matmul row ranges start on multiples of this (room for row-interleaved kernels) */

/* Activations for one matmul group: one buffer per distinct act type of its weights. */
typedef struct {
    int n;
    int type[3];
    const void *ptr[3];
} se_acts;

/* The gate's activation in a gated feed-forward: down(act(gate x) * up x). */
typedef enum {
    SE_FFN_SILU,      /* SwiGLU (llama) */
    SE_FFN_GELU_TANH, /* GEGLU with GELU's tanh approximation (gemma) */
} se_ffn_act;

/* SiLU (llama's SwiGLU): x * sigmoid(x). */
static inline float se_silu(float x) { return x / (1.0f + expf(-x)); }

/* GELU, tanh approximation (Gemma's gelu_pytorch_tanh): 0.5 x (1 + tanh(u)) with
 * u = sqrt(2/pi) (x + 0.044715 x^3), written as x / (1 + exp(-2u)), the same function: expf is
 * several times cheaper than tanhf, which took 14% of a 512-token prompt. */
#define SE_GELU_C 1.59576912160573071176f /* 2 sqrt(2/pi) */
#define SE_GELU_A 0.044715f
static inline float se_gelu_tanh(float x) { return x / (1.0f + expf(-SE_GELU_C * x * (1.0f + SE_GELU_A * x * x))); }

/* g[i] = act(g[i]) * u[i] for i < n: the gated feed-forward's activation at the SIMD level in use
 * (activation.c; the bits depend on the level, not on where a thread's share of a row starts). */
void se_glu(se_ffn_act act, float *g, const float *u, int64_t n);

/* Rows [r0, r1) of a matmul step (blocks.c, se_share_rows). */
typedef void (*se_rows_fn)(se_context *c, const void *arg, int64_t r0, int64_t r1);

/* Runs fn over rows [0, n) of a matmul step on the nth threads of a pass: each thread first on
 * its se_split share, then on rows left in the others' (thread ith of nth calls it, every thread
 * the same steps in the same order). w[0..nw): the weights fn streams, whose next rows are asked
 * for ahead. Which rows a thread computes varies from run to run; the results do not. */
void se_share_rows(se_context *c, int ith, int nth, int64_t n, se_rows_fn fn, const void *arg,
                   const se_tensor *const *w, int nw);
/* Before a pass starts on nth threads (no thread of the pool running). */
void se_share_rows_reset(se_context *c, int nth);

/* Rotates one head's first n_rot dims by the angles in cs ((cos, sin) pairs, n_rot/2 of them). */
static inline void se_rope_apply(float *x, const float *cs, int n_rot, int mode) {
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
static inline void se_rope_table(float *cs, int64_t pos, float base, float freq_scale, int n_rot) {
    float theta_scale = powf(base, -2.0f / (float)n_rot);
    float theta = (float)pos;
    for (int i = 0; i < n_rot / 2; i++) {
        float a = theta * freq_scale;
        cs[2 * i] = cosf(a);
        cs[2 * i + 1] = sinf(a);
        theta *= theta_scale;
    }
}

/* The segment (se_ub_seg: a context's rows) of row t of the ubatch, and the row's position in
 * that context. */
static inline const se_ub_seg *se_row_seg(const se_context *c, int64_t t) { return &c->ub_seg[c->ub_rseg[t]]; }
static inline int64_t se_row_pos(const se_context *c, int64_t t) {
    const se_ub_seg *s = se_row_seg(c, t);
    return s->pos + (t - s->start);
}

/* ---- the blocks an architecture's forward pass is made of (every one ends with a barrier) */

/* Token embeddings (times hp.embd_scale) and the rope tables of the ubatch. */
void se_forward_prologue(se_context *c, int ith, int nth);
/* x += O(attention(Q, K, V of norm(x))) for layer il; with post_w (not NULL) the block's output is
 * RMS-normalised by post_w before it is added. */
void se_attention_block(se_context *c, int il, const float *post_w, int ith, int nth);
/* x += down(act(gate h) * up h), h = norm(x), for layer il; post_w as for the attention block. */
void se_ffn_block(se_context *c, int il, se_ffn_act act, const float *post_w, int ith, int nth);
/* Final norm and output head for the tokens whose logits are wanted (none: it returns at once).
 * No barrier: it is the last step. */
void se_forward_output(se_context *c, int ith, int nth);

/* ---- the steps inside the blocks */

/* [*r0, *r1): this thread's share of n items, boundaries on multiples of align */
void se_split(int64_t n, int ith, int nth, int64_t align, int64_t *r0, int64_t *r1);
/* y = x / rms(x) * w */
void se_rmsnorm(float *y, const float *x, const float *w, int64_t n, float eps);
/* The activations that weights w[0..nw) need from n_tok rows of k floats, RMS-normalised by
 * norm_w first when it is not NULL. Ends with a barrier for large batches only. */
void se_prep_acts(se_context *c, int ith, int nth, const float *src, int64_t k, int n_tok,
                  const float *norm_w, const se_tensor *const *w, int nw, se_acts *out);
/* y rows [r0, r1) = W x for every token (no barrier) */
void se_matmul_rows(const se_tensor *W, const se_acts *a, int n_tok, float *y, int64_t ldy,
                    int64_t r0, int64_t r1);
/* Q, K, V of layer il (q/k norms when the layer has them, rope, K and V into the cache); barrier. */
void se_forward_qkv(se_context *c, int il, const se_acts *a, int ith, int nth);
/* 1 when se_forward_attention stores the ubatch's keys and values (from c->k_new, c->v_new) into
 * the cache itself, so se_forward_qkv does not: each of its work items a whole (segment, kv head) */
int se_attention_stores(const se_context *c, int nth);
/* Attention of every (token, head) over its own context's cache, sliding window per layer, into
 * c->att; barrier. */
void se_forward_attention(se_context *c, int il, int ith, int nth);
/* The KV cache (attention.c alone knows its layout and element types): positions held per layer
 * and kv head for a context of n_ctx; n keys or values (rows of head_dim, ldk floats apart) stored
 * at positions p0.. of layer il, kv head h. */
int64_t se_kv_positions(int64_t n_ctx);
/* Bytes of one cache element of a context's type_k or type_v (f32 or f16) */
size_t se_kv_elem_size(int type);
void se_kv_store_keys(se_context *c, int il, int h, int64_t p0, int n, const float *k, int64_t ldk);
void se_kv_store_values(se_context *c, int il, int h, int64_t p0, int n, const float *v, int64_t ldv);
/* Where the keys (the key tiles) and the values of positions [p0, p0 + n) of layer il, kv head h
 * lie (contiguous), and their bytes: what a thread prefetches before it stores them */
const void *se_kv_key_tiles(const se_context *c, int il, int h, int64_t p0, int n, size_t *bytes);
const void *se_kv_value_rows(const se_context *c, int il, int h, int64_t p0, int n, size_t *bytes);

/* ---- the architecture table (model.c lists the entries; each architecture's file defines one) */

typedef struct {
    const char *name;           /* GGUF's general.architecture */
    se_pool_fn forward;         /* one ubatch (c->ub_*), on every thread of the pool */
    const int32_t *layer_slots; /* the per-layer tensors its forward pass reads, in the order
                                 * se_model_finalize checks them (all required) */
    int n_layer_slots;
    se_ffn_act ffn_act;         /* the feed-forward's gate activation (the device forward reads it;
                                 * the optional slots say the rest: q/k norms, post-norms) */
} se_arch_desc;

/* The table's entry for an se_arch id, NULL for an unknown one (model.c). */
const se_arch_desc *se_arch_of(int32_t arch);

extern const se_arch_desc se_arch_llama;  /* llama.c */
extern const se_arch_desc se_arch_gemma3; /* gemma3.c */

#endif
