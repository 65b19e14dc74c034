/* The gemma3 architecture (Gemma 3: Gemma-3-270M and its larger siblings). The same blocks as
 * llama (llama.c, blocks.c); what differs:
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

static void gemma3_forward(void *arg, int ith, int nth) {
    se_context *c = arg;
    if (c->layer0 == 0) se_forward_prologue(c, ith, nth); /* else the device ran layers 0.. */
    for (int il = c->layer0; il < c->m->hp.n_layer; il++) {
        const se_layer *L = &c->m->layers[il];
        se_attention_block(c, il, L->t[SE_T_ATTN_POST_NORM].data, ith, nth);
        se_ffn_block(c, il, SE_FFN_GELU_TANH, L->t[SE_T_FFN_POST_NORM].data, ith, nth);
    }
    se_forward_output(c, ith, nth);
}

/* llama's, then the per-head q/k norms and the two post-norms */
static const int32_t gemma3_layer_slots[] = {
    SE_T_ATTN_NORM, SE_T_ATTN_Q, SE_T_ATTN_K, SE_T_ATTN_V, SE_T_ATTN_OUTPUT,
    SE_T_FFN_NORM, SE_T_FFN_GATE, SE_T_FFN_UP, SE_T_FFN_DOWN,
    SE_T_ATTN_Q_NORM, SE_T_ATTN_K_NORM, SE_T_ATTN_POST_NORM, SE_T_FFN_POST_NORM,
};

const se_arch_desc se_arch_gemma3 = {
    .name = "gemma3",
    .forward = gemma3_forward,
    .layer_slots = gemma3_layer_slots,
    .n_layer_slots = sizeof gemma3_layer_slots / sizeof gemma3_layer_slots[0],
    .ffn_act = SE_FFN_GELU_TANH,
};
