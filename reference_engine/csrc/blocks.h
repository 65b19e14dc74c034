/* The building blocks of the forward passes, shared by the architectures (llama.c defines them,
 * next to the llama forward pass, and attention.c the attention; gemma3.c uses them). Internal:
 * include after defining SE_ENGINE_INTERNAL. Every block runs on every thread of the pool (ith of
 * nth) and says in its comment whether it ends with a barrier.
 */
#ifndef SE_BLOCKS_H
#define SE_BLOCKS_H

#include "engine.h"
#include "kernels.h"

#define SPLIT_ALIGN 16 /* matmul row ranges start on multiples of this (room for row-interleaved kernels) */

/* Activations for one matmul group: one buffer per distinct act type of its weights. */
typedef struct {
    int n;
    int type[3];
    const void *ptr[3];
} se_acts;

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
/* Token embeddings (times hp.embd_scale) and rope tables of the ubatch; barrier. */
void se_forward_prologue(se_context *c, int ith, int nth);
/* Q, K, V of layer il (q/k norms when the layer has them, rope, K and V into the cache); barrier. */
void se_forward_qkv(se_context *c, int il, const se_acts *a, int ith, int nth);
/* Attention of every (token, head), sliding window per layer, into c->att; barrier. */
void se_forward_attention(se_context *c, int il, int ith, int nth);
/* The KV cache (attention.c alone knows its layout): positions held per layer and kv head for a
 * context of n_ctx; the value row of layer il, kv head h, position p; n keys (rows of head_dim)
 * stored at positions p0.. of layer il, kv head h. */
int64_t se_kv_positions(int64_t n_ctx);
float *se_kv_value_row(const se_context *c, int il, int h, int64_t p);
void se_kv_store_keys(se_context *c, int il, int h, int64_t p0, int n, const float *k);
/* Final norm and output head for the tokens whose logits are wanted (no barrier: the last step). */
void se_forward_output(se_context *c, int ith, int nth);

/* The forward passes: one ubatch (c->ub_*), run on every thread of the pool. */
void se_gemma3_forward(void *arg, int ith, int nth);

#endif
