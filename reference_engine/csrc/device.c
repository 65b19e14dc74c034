/* The device layer's bookkeeping (backend.h): the backend table, the devices across it, a model's
 * weights uploaded once (se_model_offload) and a context's device KV caches and scratch. The
 * layers themselves are device_forward.c's.
 *
 * Every buffer is its own device allocation (one per weight tensor, per layer cache, per scratch
 * role): a device may cap one allocation well below its memory (OpenCL's
 * CL_DEVICE_MAX_MEM_ALLOC_SIZE is often a quarter of it), and views at offset 0 keep the
 * backends simple.
 */
#define SE_ENGINE_INTERNAL
#include "engine.h"
#include "kernels.h"
#include "blocks.h"
#include "backend.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The backend table: a new backend is a new backend_X.c and one line here. The host backend
 * (backend_host.c) has a device only when SE_HOST_BACKEND=1 (tests). */
const se_backend *const se_backends[] = { &se_backend_opencl, &se_backend_host };
const int se_n_backends = sizeof se_backends / sizeof se_backends[0];

/* ---------------------------------------------------------------------------------------------
 * Errors: one message per thread (a model loaded on one thread does not see another's).
 */

static __thread char dev_err[4096];

int se_dev_fail(const se_backend *be, int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(dev_err, sizeof dev_err, fmt, ap);
    va_end(ap);
    if (be && n >= 0 && (size_t)n < sizeof dev_err) {
        const char *why = be->last_error();
        snprintf(dev_err + n, sizeof dev_err - (size_t)n, ": %s", why && *why ? why : "no reason given");
    }
    return rc;
}

const char *se_backend_error(void) { return dev_err; }

/* ---------------------------------------------------------------------------------------------
 * Devices, numbered across the table
 */

/* The backend of global device index i and the index within it; NULL for a bad index. */
static const se_backend *device_at(int32_t i, int *local) {
    if (i < 0) return NULL;
    for (int b = 0; b < se_n_backends; b++) {
        int n = se_backends[b]->count();
        if (i < n) { *local = i; return se_backends[b]; }
        i -= n;
    }
    return NULL;
}

int32_t se_device_count(void) {
    int32_t n = 0;
    dev_err[0] = 0;
    for (int b = 0; b < se_n_backends; b++) {
        int k = se_backends[b]->count();
        if (k > 0) n += k;
        else if (!dev_err[0]) /* the first backend without a device says why (its words name it) */
            snprintf(dev_err, sizeof dev_err, "%s", se_backends[b]->last_error());
    }
    if (n > 0) dev_err[0] = 0; /* the message says why there is none */
    return n;
}

const char *se_device_backend(int32_t i) {
    int local;
    const se_backend *be = device_at(i, &local);
    return be ? be->name : NULL;
}

int se_device_describe(int32_t i, char *name, size_t len, uint64_t *mem_bytes) {
    int local;
    const se_backend *be = device_at(i, &local);
    if (!be || !name || len == 0 || !mem_bytes) return SE_ERR_INVALID;
    if (be->describe(local, name, len, mem_bytes) != SE_OK)
        return se_dev_fail(be, SE_ERR_DEVICE, "device %d", i);
    return SE_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Buffers
 */

typedef struct {
    const se_backend *be;
    se_device *d;
    se_dbuf **bufs;
    int n, cap;
    size_t total; /* bytes allocated so far, for the out-of-memory message */
} buf_list;

/* A new buffer of `bytes` for `what`, recorded in l; SE_ERR_NOMEM names the bytes. */
static int list_alloc(buf_list *l, size_t bytes, se_dview *out, const char *what) {
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 64;
        se_dbuf **b = realloc(l->bufs, (size_t)cap * sizeof *b);
        if (!b) return se_dev_fail(NULL, SE_ERR_NOMEM, "out of host memory");
        l->bufs = b;
        l->cap = cap;
    }
    se_dbuf *b = l->be->alloc(l->d, bytes);
    if (!b)
        return se_dev_fail(l->be, SE_ERR_NOMEM,
                           "out of device memory: %zu bytes asked for %s (%zu bytes allocated before it)",
                           bytes, what, l->total);
    l->bufs[l->n++] = b;
    l->total += bytes;
    *out = (se_dview){ b, 0 };
    return SE_OK;
}

static void list_release(const se_backend *be, se_dbuf **bufs, int n) {
    for (int i = 0; i < n; i++) be->release(bufs[i]);
    free(bufs);
}

/* ---------------------------------------------------------------------------------------------
 * Models: upload once
 */

/* GGUF's names of the tensor slots (blk.N.<name>.weight for the per-layer ones), for messages */
static const char *const slot_names[SE_T_COUNT] = {
    [SE_T_TOKEN_EMBD] = "token_embd",      [SE_T_OUTPUT_NORM] = "output_norm",
    [SE_T_OUTPUT] = "output",              [SE_T_ATTN_NORM] = "attn_norm",
    [SE_T_ATTN_Q] = "attn_q",              [SE_T_ATTN_K] = "attn_k",
    [SE_T_ATTN_V] = "attn_v",              [SE_T_ATTN_OUTPUT] = "attn_output",
    [SE_T_ATTN_Q_NORM] = "attn_q_norm",    [SE_T_ATTN_K_NORM] = "attn_k_norm",
    [SE_T_ATTN_POST_NORM] = "post_attention_norm", [SE_T_FFN_NORM] = "ffn_norm",
    [SE_T_FFN_GATE] = "ffn_gate",          [SE_T_FFN_UP] = "ffn_up",
    [SE_T_FFN_DOWN] = "ffn_down",          [SE_T_FFN_POST_NORM] = "post_ffw_norm",
};

static int is_vector(const se_tensor *t) { return t->ne1 == 1 && t->type == SE_F32; }

/* Uploads t (named `what`) into a new buffer: the raw bytes, as the kernels.h layouts lay them out. */
static int upload(buf_list *l, const se_tensor *t, se_dview *out, const char *what) {
    size_t bytes = t->row_size * (size_t)t->ne1;
    int rc = list_alloc(l, bytes, out, what);
    if (rc != SE_OK) return rc;
    if (l->be->write(*out, t->data, bytes) != SE_OK)
        return se_dev_fail(l->be, SE_ERR_DEVICE, "uploading %s (%zu bytes)", what, bytes);
    return SE_OK;
}

/* The name of layer il's slot (il < 0: a global tensor), into buf. */
static const char *tensor_name(char *buf, size_t len, const se_model *m, int il, int slot) {
    if (il >= 0) snprintf(buf, len, "blk.%d.%s.weight", il, slot_names[slot]);
    else if (slot == SE_T_OUTPUT && m->output.data == m->token_embd.data)
        snprintf(buf, len, "token_embd.weight (the tied output head)");
    else snprintf(buf, len, "%s.weight", slot_names[slot]);
    return buf;
}

/* A matmul weight the backend cannot take: SE_ERR_INVALID naming it. */
static int check_type(const se_backend *be, const se_model *m, const se_tensor *t, int il, int slot) {
    if (is_vector(t) || be->supports_type(t->type)) return SE_OK;
    char name[96];
    return se_dev_fail(NULL, SE_ERR_INVALID,
                       "tensor %s has type %s, which the %s backend cannot multiply: offload fewer "
                       "layers (-ngl), or use a model quantized to types it supports",
                       tensor_name(name, sizeof name, m, il, slot), se_traits(t->type)->name, be->name);
}

void se_dev_model_free(struct se_dev_model *dm) {
    if (!dm) return;
    list_release(dm->be, dm->bufs, dm->n_bufs);
    free(dm->w);
    if (dm->d) dm->be->close(dm->d);
    free(dm);
}

int se_model_offload(se_model *m, int32_t device, int32_t n_gpu_layers) {
    dev_err[0] = 0;
    if (!m || !m->finalized || m->dev) return SE_ERR_INVALID;
    if (n_gpu_layers == 0) return SE_OK;
    int local, n_dev = se_device_count();
    const se_backend *be = device_at(device, &local);
    if (!be) {
        if (n_dev == 0) { /* se_device_count left why in dev_err */
            char why[sizeof dev_err];
            snprintf(why, sizeof why, "%s", dev_err);
            return se_dev_fail(NULL, SE_ERR_DEVICE, "no device: %s", why);
        }
        return se_dev_fail(NULL, SE_ERR_INVALID, "no device %d (there are %d)", device, n_dev);
    }
    int32_t L = m->hp.n_layer;
    int32_t nl = n_gpu_layers < 0 || n_gpu_layers > L ? L : n_gpu_layers;
    int head = n_gpu_layers < 0 || n_gpu_layers > L;
    /* every type first, so that an unsupported one costs no device time */
    for (int il = 0; il < nl; il++)
        for (int s = 0; s < SE_T_COUNT; s++) {
            const se_tensor *t = &m->layers[il].t[s];
            if (t->data && check_type(be, m, t, il, s) != SE_OK) return SE_ERR_INVALID;
        }
    if (head && check_type(be, m, &m->output, -1, SE_T_OUTPUT) != SE_OK) return SE_ERR_INVALID;

    struct se_dev_model *dm = calloc(1, sizeof *dm);
    if (!dm) return SE_ERR_NOMEM;
    dm->be = be;
    dm->n_layers = nl;
    dm->head = head;
    dm->w = calloc((size_t)nl, sizeof *dm->w);
    if (!dm->w) { free(dm); return SE_ERR_NOMEM; }
    dm->d = be->open(local);
    if (!dm->d) {
        se_dev_model_free(dm);
        return se_dev_fail(be, SE_ERR_DEVICE, "cannot open %s device %d", be->name, local);
    }
    buf_list l = { be, dm->d, NULL, 0, 0, 0 };
    int rc = SE_OK;
    char name[96];
    for (int il = 0; il < nl && rc == SE_OK; il++)
        for (int s = 0; s < SE_T_COUNT && rc == SE_OK; s++) {
            const se_tensor *t = &m->layers[il].t[s];
            if (t->data) rc = upload(&l, t, &dm->w[il][s], tensor_name(name, sizeof name, m, il, s));
        }
    if (head && rc == SE_OK) rc = upload(&l, &m->output_norm, &dm->output_norm, "output_norm.weight");
    if (head && rc == SE_OK)
        rc = upload(&l, &m->output, &dm->output, tensor_name(name, sizeof name, m, -1, SE_T_OUTPUT));
    if (rc == SE_OK && be->finish(dm->d) != SE_OK)
        rc = se_dev_fail(be, SE_ERR_DEVICE, "uploading the weights");
    dm->bufs = l.bufs;
    dm->n_bufs = l.n;
    if (rc != SE_OK) {
        se_dev_model_free(dm);
        return rc;
    }
    m->dev = dm;
    return SE_OK;
}

int32_t se_model_gpu_layers(const se_model *m, int32_t *head) {
    if (head) *head = m && m->dev ? m->dev->head : 0;
    return m && m->dev ? m->dev->n_layers : 0;
}

/* ---------------------------------------------------------------------------------------------
 * Contexts
 */

void se_dev_ctx_free(const se_model *m, struct se_dev_ctx *dc) {
    if (!dc) return;
    list_release(m->dev->be, dc->bufs, dc->n_bufs);
    free(dc->kc);
    free(dc->vc);
    free(dc);
}

struct se_dev_ctx *se_dev_ctx_new(const se_model *m, const se_context_params *cp) {
    const struct se_dev_model *dm = m->dev;
    const se_backend *be = dm->be;
    const se_hparams *hp = &m->hp;
    size_t U = (size_t)cp->n_ubatch, E = (size_t)hp->n_embd, F = (size_t)hp->n_ff;
    size_t Dq = (size_t)hp->n_head * hp->head_dim, Dkv = (size_t)hp->n_head_kv * hp->head_dim;
    struct se_dev_ctx *dc = calloc(1, sizeof *dc);
    if (!dc) return NULL;
    dc->kc = calloc((size_t)dm->n_layers, sizeof *dc->kc);
    dc->vc = calloc((size_t)dm->n_layers, sizeof *dc->vc);
    buf_list l = { be, dm->d, NULL, 0, 0, 0 };
    int rc = dc->kc && dc->vc ? SE_OK : SE_ERR_NOMEM;
    size_t kv = be->kv_bytes(cp->n_ctx, hp->n_head_kv, hp->head_dim);
    char what[96];
    for (int il = 0; il < dm->n_layers && rc == SE_OK; il++) {
        snprintf(what, sizeof what, "the K cache of layer %d (%d positions)", il, cp->n_ctx);
        rc = list_alloc(&l, kv, &dc->kc[il], what);
        snprintf(what, sizeof what, "the V cache of layer %d (%d positions)", il, cp->n_ctx);
        if (rc == SE_OK) rc = list_alloc(&l, kv, &dc->vc[il], what);
    }
    const struct { se_dview *v; size_t floats; const char *what; } scratch[] = {
        { &dc->x, U * E, "the residual stream" }, { &dc->xb, U * E, "normalised rows" },
        { &dc->q, U * Dq, "queries" },            { &dc->k, U * Dkv, "new keys" },
        { &dc->v, U * Dkv, "new values" },         { &dc->att, U * Dq, "attention outputs" },
        { &dc->tmp, U * E, "block outputs" },      { &dc->hb, U * F, "the ffn gate" },
        { &dc->hb2, U * F, "the ffn up" },
    };
    for (size_t i = 0; i < sizeof scratch / sizeof scratch[0] && rc == SE_OK; i++) {
        snprintf(what, sizeof what, "scratch (%s, %d tokens)", scratch[i].what, cp->n_ubatch);
        rc = list_alloc(&l, scratch[i].floats * sizeof(float), scratch[i].v, what);
    }
    if (dm->head && rc == SE_OK) {
        dc->logits_rows = cp->n_ubatch < SE_DEV_HEAD_ROWS ? cp->n_ubatch : SE_DEV_HEAD_ROWS;
        rc = list_alloc(&l, (size_t)dc->logits_rows * (size_t)hp->n_vocab * sizeof(float), &dc->logits,
                        "logits rows");
    }
    dc->bufs = l.bufs;
    dc->n_bufs = l.n;
    if (rc != SE_OK) {
        if (rc == SE_ERR_NOMEM && !dev_err[0]) se_dev_fail(NULL, rc, "out of host memory");
        se_dev_ctx_free(m, dc);
        return NULL;
    }
    return dc;
}
