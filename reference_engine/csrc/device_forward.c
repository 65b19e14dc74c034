/* The layers on a device (backend.h): both architectures' layers over the backend's queued
 * operations, once. What differs between architectures is read from the model, as the CPU's
 * blocks read it: the optional per-layer tensors (gemma3's q/k norms and post-norms) and the
 * architecture table's ffn_act (SiLU or GELU-tanh); RoPE's mode, base and sliding window are the
 * model's and layer's settings.
 *
 *   per layer:  h = norm(x); q, k, v = Q h, K h, V h; [q/k norms]; per segment (a context's
 *               rows): rope q and k at its positions, store k and v in its context's cache and
 *               attend; x += [post-norm] O att;
 *               h = norm(x); g = act(gate h) * up h; x += [post-norm] down g
 *
 * Every step is one queued operation over all rows of the ubatch, except rope and attention,
 * which run per segment (each with its context's positions and cache). The device scratch is
 * c->dev's (in se_decode_batch, ctxs[0]'s); the caches are each segment's context's.
 */
#define SE_ENGINE_INTERNAL
#include "engine.h"
#include "blocks.h"
#include "backend.h"

/* v moved on by `floats` floats */
static se_dview at(se_dview v, int64_t floats) {
    v.off += (size_t)floats * sizeof(float);
    return v;
}

/* Runs one backend operation; on a failure, names it (and the layer) in se_backend_error(). */
#define OP(what, call)                                                                            \
    do {                                                                                          \
        int rc_ = (call);                                                                         \
        if (rc_ != SE_OK)                                                                         \
            return se_dev_fail(be, rc_ == SE_ERR_NOMEM ? rc_ : SE_ERR_DEVICE, "layer %d: %s", il, what); \
    } while (0)

/* y[t] = W x[t] for the n rows of the ubatch, W a host tensor's device copy */
static int matmul(const se_backend *be, se_device *d, const se_tensor *t, se_dview w, se_dview x, int n,
                  se_dview y) {
    return be->matmul(d, t->type, w, t->row_size, t->ne0, t->ne1, x, n, y, t->ne1);
}

/* x += post(tmp): tmp RMS-normalised by post first when the layer has that norm */
static int residual(const se_context *c, int il, se_dview post) {
    const struct se_dev_model *dm = c->m->dev;
    const se_backend *be = dm->be;
    const struct se_dev_ctx *dc = c->dev;
    int64_t E = c->m->hp.n_embd;
    if (post.buf) OP("post-norm", be->rmsnorm(dm->d, dc->tmp, dc->tmp, post, E, c->ub_n, c->m->hp.norm_eps));
    OP("residual add", be->add(dm->d, dc->x, dc->tmp, c->ub_n * E));
    return SE_OK;
}

static int attention_block(const se_context *c, int il) {
    const se_model *m = c->m;
    const se_hparams *hp = &m->hp;
    const se_layer *L = &m->layers[il];
    const struct se_dev_model *dm = m->dev;
    const se_backend *be = dm->be;
    se_device *d = dm->d;
    const struct se_dev_ctx *dc = c->dev;
    const se_dview *w = dm->w[il];
    int n = c->ub_n, H = hp->n_head, HKV = hp->n_head_kv, hd = hp->head_dim;
    int64_t E = hp->n_embd, Dq = (int64_t)H * hd, Dkv = (int64_t)HKV * hd;
    float eps = hp->norm_eps;
    OP("attn_norm", be->rmsnorm(d, dc->xb, dc->x, w[SE_T_ATTN_NORM], E, n, eps));
    OP("attn_q", matmul(be, d, &L->t[SE_T_ATTN_Q], w[SE_T_ATTN_Q], dc->xb, n, dc->q));
    OP("attn_k", matmul(be, d, &L->t[SE_T_ATTN_K], w[SE_T_ATTN_K], dc->xb, n, dc->k));
    OP("attn_v", matmul(be, d, &L->t[SE_T_ATTN_V], w[SE_T_ATTN_V], dc->xb, n, dc->v));
    if (w[SE_T_ATTN_Q_NORM].buf)
        OP("attn_q_norm", be->rmsnorm(d, dc->q, dc->q, w[SE_T_ATTN_Q_NORM], hd, (int64_t)n * H, eps));
    if (w[SE_T_ATTN_K_NORM].buf)
        OP("attn_k_norm", be->rmsnorm(d, dc->k, dc->k, w[SE_T_ATTN_K_NORM], hd, (int64_t)n * HKV, eps));
    for (int si = 0; si < c->ub_nseg; si++) {
        const se_ub_seg *sg = &c->ub_seg[si];
        const struct se_dev_ctx *sc = sg->ctx->dev; /* whose cache the rows use */
        se_dview q = at(dc->q, sg->start * Dq), k = at(dc->k, sg->start * Dkv);
        OP("rope q", be->rope(d, q, sg->n, H, hd, hp->n_rot, hp->rope_type, sg->pos, L->rope_base,
                              hp->rope_freq_scale));
        OP("rope k", be->rope(d, k, sg->n, HKV, hd, hp->n_rot, hp->rope_type, sg->pos, L->rope_base,
                              hp->rope_freq_scale));
        OP("attention", be->attention(d, q, k, at(dc->v, sg->start * Dkv), sc->kc[il], sc->vc[il],
                                      sg->ctx->cp.n_ctx, sg->n, sg->pos, H, HKV, hd, L->sliding_window,
                                      hp->attn_scale, at(dc->att, sg->start * Dq)));
    }
    OP("attn_output", matmul(be, d, &L->t[SE_T_ATTN_OUTPUT], w[SE_T_ATTN_OUTPUT], dc->att, n, dc->tmp));
    return residual(c, il, w[SE_T_ATTN_POST_NORM]);
}

static int ffn_block(const se_context *c, int il) {
    const se_model *m = c->m;
    const se_layer *L = &m->layers[il];
    const struct se_dev_model *dm = m->dev;
    const se_backend *be = dm->be;
    se_device *d = dm->d;
    const struct se_dev_ctx *dc = c->dev;
    const se_dview *w = dm->w[il];
    int n = c->ub_n;
    OP("ffn_norm", be->rmsnorm(d, dc->xb, dc->x, w[SE_T_FFN_NORM], m->hp.n_embd, n, m->hp.norm_eps));
    OP("ffn_gate", matmul(be, d, &L->t[SE_T_FFN_GATE], w[SE_T_FFN_GATE], dc->xb, n, dc->hb));
    OP("ffn_up", matmul(be, d, &L->t[SE_T_FFN_UP], w[SE_T_FFN_UP], dc->xb, n, dc->hb2));
    OP("ffn activation", be->ffn_act(d, dc->hb, dc->hb2, (int64_t)n * m->hp.n_ff, se_arch_of(m->hp.arch)->ffn_act));
    OP("ffn_down", matmul(be, d, &L->t[SE_T_FFN_DOWN], w[SE_T_FFN_DOWN], dc->hb, n, dc->tmp));
    return residual(c, il, w[SE_T_FFN_POST_NORM]);
}

/* The output norm and head for the rows whose logits are wanted (se_forward_output's rows: every
 * row into ub_out, else each segment's last row when it ends its context's tokens, into that
 * context's logits), up to logits_rows of them per pass: each wanted row is normalised into the
 * next row of xb, the head multiplies them together, and each logits row is downloaded. */
static int output_head(const se_context *c) {
    const se_model *m = c->m;
    const struct se_dev_model *dm = m->dev;
    const se_backend *be = dm->be;
    se_device *d = dm->d;
    const struct se_dev_ctx *dc = c->dev;
    int64_t E = m->hp.n_embd, V = m->hp.n_vocab;
    int il = m->hp.n_layer; /* for OP's messages: the head comes after the last layer */
    float *dst[SE_DEV_HEAD_ROWS];
    int j = 0;
    for (int t = 0; t < c->ub_n; t++) {
        const se_ub_seg *sg = se_row_seg(c, t);
        float *out = c->ub_out ? c->ub_out + (size_t)t * V
                     : sg->out && t == sg->start + sg->n - 1 ? sg->ctx->logits : NULL;
        if (out) {
            OP("output_norm", be->rmsnorm(d, at(dc->xb, j * E), at(dc->x, t * E), dm->output_norm, E, 1,
                                          m->hp.norm_eps));
            dst[j++] = out;
        }
        if (j == 0 || (j < dc->logits_rows && t < c->ub_n - 1)) continue;
        OP("output", matmul(be, d, &m->output, dm->output, dc->xb, j, dc->logits));
        for (int r = 0; r < j; r++)
            OP("reading the logits", be->read(at(dc->logits, r * V), dst[r], (size_t)V * sizeof(float)));
        j = 0;
    }
    return SE_OK;
}

int se_dev_forward(se_context *c) {
    const se_model *m = c->m;
    const struct se_dev_model *dm = m->dev;
    const se_backend *be = dm->be;
    const struct se_dev_ctx *dc = c->dev;
    size_t x_bytes = (size_t)c->ub_n * (size_t)m->hp.n_embd * sizeof(float);
    for (int si = 0; si < c->ub_nseg; si++)
        if (!c->ub_seg[si].ctx->dev)
            return se_dev_fail(NULL, SE_ERR_INVALID, "a context created before the model was offloaded");
    int il = -1; /* for OP's messages: before the first layer */
    OP("uploading the embeddings", be->write(dc->x, c->x, x_bytes));
    for (il = 0; il < dm->n_layers; il++) {
        int rc = attention_block(c, il);
        if (rc == SE_OK) rc = ffn_block(c, il);
        if (rc != SE_OK) return rc;
    }
    if (dm->head) return output_head(c);
    OP("downloading the residual stream", be->read(dc->x, c->x, x_bytes));
    return SE_OK;
}
