/* The llama architecture (SmolLM2 and friends): pre-norm blocks with RMSNorm, RoPE on adjacent
 * pairs (hp.rope_type NORM: llama's GGUF Q/K weights are stored permuted for it), grouped-query
 * attention scaled by 1/sqrt(head_dim), and a SwiGLU feed-forward: down(silu(gate x) * up x).
 *
 *   per layer:  [norm+quantize] QKV (+rope, +cache store) | attention | [quantize] O (+residual) |
 *               [norm+quantize] gate,up (+SwiGLU) | [quantize] down (+residual) |
 *
 * ("|" is a barrier: a single-token decode costs 5 per layer; the blocks are in blocks.c.)
 */
#define SE_ENGINE_INTERNAL
#include "blocks.h"

static void llama_forward(void *arg, int ith, int nth) {
    se_context *c = arg;
    if (c->layer0 == 0) se_forward_prologue(c, ith, nth); /* else the device ran layers 0.. */
    for (int il = c->layer0; il < c->m->hp.n_layer; il++) {
        se_attention_block(c, il, NULL, ith, nth);
        se_ffn_block(c, il, SE_FFN_SILU, NULL, ith, nth);
    }
    se_forward_output(c, ith, nth);
}

static const int32_t llama_layer_slots[] = {
    SE_T_ATTN_NORM, SE_T_ATTN_Q, SE_T_ATTN_K, SE_T_ATTN_V, SE_T_ATTN_OUTPUT,
    SE_T_FFN_NORM, SE_T_FFN_GATE, SE_T_FFN_UP, SE_T_FFN_DOWN,
};

const se_arch_desc se_arch_llama = {
    .name = "llama",
    .forward = llama_forward,
    .layer_slots = llama_layer_slots,
    .n_layer_slots = sizeof llama_layer_slots / sizeof llama_layer_slots[0],
    .ffn_act = SE_FFN_SILU,
};
