/* The forward pass of the gemma3 architecture (Gemma 3: Gemma-3-270M and its larger siblings).
 *
 * The same shape as llama_forward (llama.c), over the same blocks (blocks.h); what differs:
 *   - token embeddings are scaled by sqrt(n_embd) (hp.embd_scale, done by the prologue);
 *   - q and k get a per-head RMSNorm before RoPE (attn_q_norm / attn_k_norm, [head_dim]), and
 *     RoPE is NEOX-style (hp.rope_type); both are done by se_forward_qkv when the slots are set;
 *   - attention is scaled by 1/sqrt(key_length) (hp.attn_scale); "local" layers attend over a
 *     sliding window and use their own RoPE base (se_model_set_layer), "global" layers see every
 *     earlier position: the loader (model.py) decides which layer is which;
 *   - the output of the attention block and of the feed-forward block is RMS-normalised
 *     (post_attention_norm, post_ffw_norm) before it is added to the residual stream;
 *   - the feed-forward is GELU-gated: down(gelu(gate x) * up x), GELU's tanh approximation.
 *
 * Norm weights are used as stored: the GGUF converter already added Gemma's "+1" to them.
 *
 *   per layer:  [norm+quantize] QKV (+q/k norm, +rope, +cache store) | attention |
 *               [quantize] O | post-norm (+residual) | [norm+quantize] gate,up (+GEGLU) |
 *               [quantize] down | post-norm (+residual) |
 *
 * So a single-token decode costs 7 barriers per layer, two more than llama: a post-norm needs the
 * whole output row of its matmul, which the threads compute in pieces.
 */
#define SE_ENGINE_INTERNAL
#include "blocks.h"

#include <math.h>

/* GELU, tanh approximation (Gemma's gelu_pytorch_tanh): 0.5 x (1 + tanh(u)) with
 * u = sqrt(2/pi) (x + 0.044715 x^3), written as x / (1 + exp(-2u)), the same function: expf is
 * several times cheaper than tanhf, which took 14% of a 512-token prompt. */
static float gelu_tanh(float x) {
    const float two_sqrt_2_over_pi = 1.59576912160573071176f;
    return x / (1.0f + expf(-two_sqrt_2_over_pi * x * (1.0f + 0.044715f * x * x)));
}

/* x += rmsnorm(W act) * post_w for every token: each thread computes its rows of W act into
 * c->tmp; after a barrier each normalises and adds its share of the tokens; then a barrier. */
static void residual_post_norm(se_context *c, const se_tensor *W, const float *post_w,
                               const se_acts *a, int ith, int nth) {
    int64_t E = c->m->hp.n_embd, r0, r1, t0, t1;
    se_split(W->ne1, ith, nth, SPLIT_ALIGN, &r0, &r1);
    se_matmul_rows(W, a, c->ub_n, c->tmp, E, r0, r1);
    se_pool_barrier(c->pool);
    se_split(c->ub_n, ith, nth, 1, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        float *x = c->x + t * E, *y = c->tmp + t * E;
        se_rmsnorm(y, y, post_w, E, c->m->hp.norm_eps);
        for (int64_t i = 0; i < E; i++) x[i] += y[i];
    }
    se_pool_barrier(c->pool);
}

/* hb = gelu(gate act) * (up act) for this thread's rows of the ffn, then a barrier. */
static void forward_geglu(se_context *c, const se_layer *L, const se_acts *a, int ith, int nth) {
    int64_t F = c->m->hp.n_ff, r0, r1;
    se_split(F, ith, nth, SPLIT_ALIGN, &r0, &r1);
    se_matmul_rows(&L->t[SE_T_FFN_GATE], a, c->ub_n, c->hb, F, r0, r1);
    se_matmul_rows(&L->t[SE_T_FFN_UP], a, c->ub_n, c->hb2, F, r0, r1);
    for (int t = 0; t < c->ub_n; t++) {
        float *g = c->hb + t * F;
        const float *u = c->hb2 + t * F;
        for (int64_t r = r0; r < r1; r++) g[r] = gelu_tanh(g[r]) * u[r];
    }
    se_pool_barrier(c->pool);
}

void se_gemma3_forward(void *arg, int ith, int nth) {
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
        residual_post_norm(c, wo[0], L->t[SE_T_ATTN_POST_NORM].data, &a, ith, nth);
        /* feed-forward block */
        const se_tensor *gu[2] = { &L->t[SE_T_FFN_GATE], &L->t[SE_T_FFN_UP] };
        se_prep_acts(c, ith, nth, c->x, E, n, L->t[SE_T_FFN_NORM].data, gu, 2, &a);
        forward_geglu(c, L, &a, ith, nth);
        const se_tensor *wd[1] = { &L->t[SE_T_FFN_DOWN] };
        se_prep_acts(c, ith, nth, c->hb, hp->n_ff, n, NULL, wd, 1, &a);
        residual_post_norm(c, wd[0], L->t[SE_T_FFN_POST_NORM].data, &a, ith, nth);
    }
    if (c->ub_out || c->ub_out_first >= 0) se_forward_output(c, ith, nth);
}
