/* The "host" backend: backend.h's operations in plain C on host memory, one thread, for testing
 * the device layer (device.c, device_forward.c: uploads, per-segment caches, partial offload,
 * the head on the device) on any machine, with or without OpenCL. It is not for speed.
 *
 * It has one device when the environment variable SE_HOST_BACKEND is 1 (read at each count()),
 * none otherwise, so nothing a user runs sees it unless asked. SE_HOST_BACKEND_MEM (bytes, read at
 * open) caps its memory, so that tests can run it out of memory. Its arithmetic is the CPU path's
 * (the same rmsnorm, rope angles and activations: blocks.h) except that the matmul dequantizes
 * the weights and takes the activations in f32, as a GPU backend does, instead of quantizing
 * them (kernels.h): its results differ from the CPU engine's by about what a GPU's do.
 */
#define SE_ENGINE_INTERNAL
#include "engine.h"
#include "kernels.h"
#include "blocks.h"
#include "backend.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct se_device {
    size_t limit, used; /* bytes: SE_HOST_BACKEND_MEM (0: no limit), allocated */
};

struct se_dbuf {
    se_device *d;
    size_t size;
    char *data;
};

static __thread char host_err[256];

static int fail(int rc, const char *what) {
    snprintf(host_err, sizeof host_err, "host backend: %s", what);
    return rc;
}

static int host_count(void) {
    const char *e = getenv("SE_HOST_BACKEND");
    if (e && !strcmp(e, "1")) return 1;
    fail(0, "disabled (set SE_HOST_BACKEND=1 to test the device layer on the CPU)");
    return 0;
}

static int host_describe(int i, char *name, size_t len, uint64_t *mem) {
    if (i != 0) return fail(SE_ERR_INVALID, "no such device");
    snprintf(name, len, "host / test device (plain C)");
    *mem = 0;
    return SE_OK;
}

static se_device *host_open(int i) {
    if (i != 0) { fail(0, "no such device"); return NULL; }
    se_device *d = calloc(1, sizeof *d);
    const char *lim = getenv("SE_HOST_BACKEND_MEM");
    if (d && lim) d->limit = strtoull(lim, NULL, 10);
    return d;
}

static void host_close(se_device *d) { free(d); }
static const char *host_last_error(void) { return host_err; }

static int host_supports_type(int32_t type) {
    const se_type_traits *tr = se_traits(type);
    return tr && tr->to_float != NULL;
}

static se_dbuf *host_alloc(se_device *d, size_t bytes) {
    if (d->limit && bytes > d->limit - d->used) {
        snprintf(host_err, sizeof host_err, "host backend: %zu bytes asked, %zu of %zu free", bytes,
                 d->limit - d->used, d->limit);
        return NULL;
    }
    se_dbuf *b = calloc(1, sizeof *b);
    if (b) b->data = calloc(1, bytes ? bytes : 1);
    if (!b || !b->data) {
        free(b);
        fail(0, "out of memory");
        return NULL;
    }
    b->d = d;
    b->size = bytes;
    d->used += bytes;
    return b;
}

static void host_release(se_dbuf *b) {
    if (!b) return;
    b->d->used -= b->size;
    free(b->data);
    free(b);
}

/* The view's bytes if [off, off + n) lies in its buffer, else NULL (an error: a device layer bug). */
static char *span(se_dview v, size_t n) {
    if (!v.buf || v.off > v.buf->size || n > v.buf->size - v.off) {
        fail(0, "a view runs past its buffer");
        return NULL;
    }
    return v.buf->data + v.off;
}
#define FLOATS(v, n) ((float *)span(v, (size_t)(n) * sizeof(float)))

static int host_write(se_dview dst, const void *src, size_t n) {
    char *p = span(dst, n);
    if (!p) return SE_ERR_INVALID;
    memcpy(p, src, n);
    return SE_OK;
}

static int host_read(se_dview src, void *dst, size_t n) {
    const char *p = span(src, n);
    if (!p) return SE_ERR_INVALID;
    memcpy(dst, p, n);
    return SE_OK;
}

static int host_matmul(se_device *d, int32_t wtype, se_dview W, size_t row_size, int64_t k, int64_t n_rows,
                       se_dview x, int32_t n_tok, se_dview y, int64_t ldy) {
    (void)d;
    const char *w = span(W, row_size * (size_t)n_rows);
    const float *xs = FLOATS(x, (int64_t)n_tok * k);
    float *ys = FLOATS(y, (int64_t)(n_tok - 1) * ldy + n_rows);
    float *row = malloc((size_t)k * sizeof(float));
    if (!w || !xs || !ys || !row) { free(row); return SE_ERR_INVALID; }
    se_to_float_fn to_float = se_traits(wtype)->to_float;
    for (int64_t r = 0; r < n_rows; r++) {
        to_float(w + (size_t)r * row_size, row, k);
        for (int32_t t = 0; t < n_tok; t++) {
            double s = 0; /* in order, in double: depends on the row and the token only */
            for (int64_t i = 0; i < k; i++) s += (double)row[i] * xs[t * k + i];
            ys[t * ldy + r] = (float)s;
        }
    }
    free(row);
    return SE_OK;
}

static int host_rmsnorm(se_device *d, se_dview y, se_dview x, se_dview w, int64_t n, int64_t rows, float eps) {
    (void)d;
    float *ys = FLOATS(y, n * rows);
    const float *xs = FLOATS(x, n * rows), *ws = FLOATS(w, n);
    if (!ys || !xs || !ws) return SE_ERR_INVALID;
    for (int64_t r = 0; r < rows; r++) se_rmsnorm(ys + r * n, xs + r * n, ws, n, eps);
    return SE_OK;
}

static int host_rope(se_device *d, se_dview x, int32_t n_tok, int32_t n_head, int32_t head_dim, int32_t n_rot,
                     int32_t mode, int32_t pos0, float base, float freq_scale) {
    (void)d;
    float *xs = FLOATS(x, (int64_t)n_tok * n_head * head_dim);
    float *cs = malloc((size_t)n_rot * sizeof(float));
    if (!xs || !cs) { free(cs); return SE_ERR_INVALID; }
    for (int32_t t = 0; t < n_tok; t++) {
        se_rope_table(cs, pos0 + t, base, freq_scale, n_rot);
        for (int32_t h = 0; h < n_head; h++) se_rope_apply(xs + ((int64_t)t * n_head + h) * head_dim, cs, n_rot, mode);
    }
    free(cs);
    return SE_OK;
}

/* cache layout: [n_head_kv][n_ctx][head_dim] f32 */
static size_t host_kv_bytes(int32_t n_ctx, int32_t n_head_kv, int32_t head_dim) {
    return (size_t)n_ctx * n_head_kv * head_dim * sizeof(float);
}

static int host_attention(se_device *d, se_dview q, se_dview k_new, se_dview v_new, se_dview kc, se_dview vc,
                          int32_t n_ctx, int32_t n_tok, int32_t pos0, int32_t n_head, int32_t n_head_kv,
                          int32_t head_dim, int32_t window, float scale, se_dview out) {
    (void)d;
    int64_t Dq = (int64_t)n_head * head_dim, Dkv = (int64_t)n_head_kv * head_dim;
    const float *qs = FLOATS(q, n_tok * Dq), *kn = FLOATS(k_new, n_tok * Dkv), *vn = FLOATS(v_new, n_tok * Dkv);
    float *K = FLOATS(kc, (int64_t)n_ctx * Dkv), *V = FLOATS(vc, (int64_t)n_ctx * Dkv), *o = FLOATS(out, n_tok * Dq);
    double *p = malloc((size_t)(pos0 + n_tok) * sizeof(double));
    if (!qs || !kn || !vn || !K || !V || !o || !p || pos0 + n_tok > n_ctx) { free(p); return SE_ERR_INVALID; }
    for (int32_t t = 0; t < n_tok; t++)
        for (int32_t h = 0; h < n_head_kv; h++) {
            memcpy(K + ((int64_t)h * n_ctx + pos0 + t) * head_dim, kn + t * Dkv + h * head_dim, (size_t)head_dim * sizeof(float));
            memcpy(V + ((int64_t)h * n_ctx + pos0 + t) * head_dim, vn + t * Dkv + h * head_dim, (size_t)head_dim * sizeof(float));
        }
    int group = n_head / n_head_kv;
    for (int32_t t = 0; t < n_tok; t++) {
        int32_t pos = pos0 + t, lo = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
        for (int32_t h = 0; h < n_head; h++) {
            const float *qh = qs + t * Dq + (int64_t)h * head_dim;
            const float *Kh = K + (int64_t)(h / group) * n_ctx * head_dim, *Vh = V + (int64_t)(h / group) * n_ctx * head_dim;
            double mx = -INFINITY, sum = 0;
            for (int32_t j = lo; j <= pos; j++) {
                double s = 0;
                for (int32_t i = 0; i < head_dim; i++) s += (double)qh[i] * Kh[(int64_t)j * head_dim + i];
                p[j] = s * scale;
                if (p[j] > mx) mx = p[j];
            }
            for (int32_t j = lo; j <= pos; j++) sum += p[j] = exp(p[j] - mx);
            float *oh = o + t * Dq + (int64_t)h * head_dim;
            for (int32_t i = 0; i < head_dim; i++) {
                double acc = 0;
                for (int32_t j = lo; j <= pos; j++) acc += p[j] * Vh[(int64_t)j * head_dim + i];
                oh[i] = (float)(acc / sum);
            }
        }
    }
    free(p);
    return SE_OK;
}

static int host_ffn_act(se_device *d, se_dview g, se_dview u, int64_t n, int32_t act) {
    (void)d;
    float *gs = FLOATS(g, n);
    const float *us = FLOATS(u, n);
    if (!gs || !us) return SE_ERR_INVALID;
    se_glu((se_ffn_act)act, gs, us, n);
    return SE_OK;
}

static int host_add(se_device *d, se_dview x, se_dview y, int64_t n) {
    (void)d;
    float *xs = FLOATS(x, n);
    const float *ys = FLOATS(y, n);
    if (!xs || !ys) return SE_ERR_INVALID;
    for (int64_t i = 0; i < n; i++) xs[i] += ys[i];
    return SE_OK;
}

static int host_finish(se_device *d) {
    (void)d;
    return SE_OK;
}

const se_backend se_backend_host = {
    .name = "host",
    .count = host_count,
    .describe = host_describe,
    .open = host_open,
    .close = host_close,
    .last_error = host_last_error,
    .supports_type = host_supports_type,
    .alloc = host_alloc,
    .release = host_release,
    .write = host_write,
    .read = host_read,
    .matmul = host_matmul,
    .rmsnorm = host_rmsnorm,
    .rope = host_rope,
    .attention = host_attention,
    .kv_bytes = host_kv_bytes,
    .ffn_act = host_ffn_act,
    .add = host_add,
    .finish = host_finish,
};
