/* Backends: where layers of the forward pass run (issue 20). Internal: include after defining
 * SE_ENGINE_INTERNAL.
 *
 * The CPU is not a backend in this table: its forward pass is the fused, threaded blocks of
 * blocks.c (one pool job per ubatch, barriers between steps), which stay exactly as they are, so
 * CPU speed and the CPU's bit-exact results do not change. A device backend (OpenCL first; CUDA or
 * Vulkan next: a new backend_X.c and one entry in se_backends[]) implements the small set of
 * queued operations below on its own buffers; device_forward.c expresses both architectures'
 * layers over these operations once, so a new backend writes kernels, not forward passes.
 *
 * How a ubatch runs with n_gpu_layers = N (model.c's run_ubatch):
 *   the token embeddings and rope tables on the CPU (as llama.cpp keeps token_embd on the host);
 *   x uploaded; layers [0, min(N, n_layer)) on the device; x downloaded;
 *   layers [min(N, n_layer), n_layer) on the CPU pool;
 *   the output norm and head on the device when N > n_layer (x stays there; the wanted logits
 *   rows are downloaded), else on the CPU.
 * Each context that a device layer touches owns a device KV cache for those layers (f32; the
 * backend's layout). In se_decode_batch, ctxs[0]'s device scratch serves the pass and every
 * segment attends over its own context's device cache.
 *
 * Determinism contract (the same as the CPU's, spec/reference-engine.md): a row's result depends
 * on that row, its context's cache and its position only, never on the other rows of the ubatch,
 * on n_tok, on how a prompt was split into calls, or on the run: no float atomics, reductions in
 * a fixed order inside one work-item or a fixed-size work-group tree. Results need not be
 * bit-identical to the CPU's (different summation orders; the device does not quantize the
 * activations); they must agree within the tolerances the kernel tests state.
 *
 * Every operation returns SE_OK or an error code (SE_ERR_DEVICE, SE_ERR_NOMEM), and then the
 * backend's last_error() says what happened in words (the OpenCL call and its status, the kernel
 * compiler's log, the bytes asked for).
 */
#ifndef SE_BACKEND_H
#define SE_BACKEND_H

#include "engine.h"

typedef struct se_device se_device; /* an open device: the backend's own struct */
typedef struct se_dbuf se_dbuf;     /* a device buffer: the backend's own struct */

/* A view into a device buffer: byte offset into it. */
typedef struct {
    se_dbuf *buf;
    size_t off;
} se_dview;

typedef struct {
    const char *name; /* "opencl": what `model.loaded` and the bench records call it */

    /* ---- devices. count() is 0 when the runtime is missing (no libOpenCL.so.1: dlopen failed)
     * or no device exists; last_error() then says which. */
    int (*count)(void);
    /* "platform / device" as the user should see it, and its global memory in bytes */
    int (*describe)(int i, char *name, size_t name_len, uint64_t *mem_bytes);
    se_device *(*open)(int i); /* NULL: see last_error() */
    void (*close)(se_device *d);
    const char *(*last_error)(void);

    /* ---- memory */
    int (*supports_type)(int32_t se_type);                          /* 1 if matmul takes it */
    se_dbuf *(*alloc)(se_device *d, size_t bytes);                  /* NULL: out of memory */
    void (*release)(se_dbuf *b);
    int (*write)(se_dview dst, const void *src, size_t n);          /* host -> device */
    int (*read)(se_dview src, void *dst, size_t n);                 /* device -> host; waits */

    /* ---- operations, queued in order on the device's one queue. Rows are contiguous floats
     * unless a stride (in floats) is given. */

    /* y[t][r] = sum_i W[r][i] * x[t][i] for rows r in [0, n_rows), tokens t in [0, n_tok);
     * W: n_rows rows of k elements of se_type wtype, row_size bytes each (kernels.h layouts);
     * x: [n_tok][k] f32; y: row stride ldy floats. */
    int (*matmul)(se_device *d, int32_t wtype, se_dview W, size_t row_size, int64_t k, int64_t n_rows,
                  se_dview x, int32_t n_tok, se_dview y, int64_t ldy);
    /* rows of n floats: y = x / sqrt(mean(x^2) + eps) * w (the sum of squares in at least the
     * CPU's precision); y may be x; used for the layer norms (rows = tokens) and the per-head
     * q/k norms (rows = tokens x heads, n = head_dim) */
    int (*rmsnorm)(se_device *d, se_dview y, se_dview x, se_dview w, int64_t n, int64_t rows, float eps);
    /* RoPE in place on n_tok rows of n_head heads of head_dim floats, the first n_rot dims of
     * each head, row t at position pos0 + t; mode SE_ROPE_NORM or SE_ROPE_NEOX; angles as the
     * CPU computes them (blocks.c rope_table: theta stepped by repeated multiplication) */
    int (*rope)(se_device *d, se_dview x, int32_t n_tok, int32_t n_head, int32_t head_dim, int32_t n_rot,
                int32_t mode, int32_t pos0, float base, float freq_scale);
    /* One context's rows [t0, t0 + n_tok) at positions pos0..: stores k_new and v_new
     * ([n_tok][n_head_kv * head_dim]) into the context's cache (kc, vc: this layer's, the
     * backend's layout, n_ctx positions), then out[t] = softmax(q[t] . K * scale) V over the
     * positions the row sees (causal; with window > 0 only (p - window, p]), grouped-query heads
     * (query head h reads kv head h / (n_head / n_head_kv)); q and out: [n_tok][n_head * head_dim] */
    int (*attention)(se_device *d, se_dview q, se_dview k_new, se_dview v_new, se_dview kc, se_dview vc,
                     int32_t n_ctx, int32_t n_tok, int32_t pos0, int32_t n_head, int32_t n_head_kv,
                     int32_t head_dim, int32_t window, float scale, se_dview out);
    /* bytes of one layer's K (or V) cache for n_ctx positions, in the backend's layout */
    size_t (*kv_bytes)(int32_t n_ctx, int32_t n_head_kv, int32_t head_dim);
    /* g = act(g) * u over n floats; act is se_ffn_act (blocks.h: SILU or GELU_TANH, the CPU's formulas) */
    int (*ffn_act)(se_device *d, se_dview g, se_dview u, int64_t n, int32_t act);
    /* x += y over n floats */
    int (*add)(se_device *d, se_dview x, se_dview y, int64_t n);
    /* waits for everything queued */
    int (*finish)(se_device *d);
} se_backend;

/* The backend table (device.c). Devices are numbered across it in its order (engine.h). */
extern const se_backend *const se_backends[];
extern const int se_n_backends;

extern const se_backend se_backend_opencl; /* backend_opencl.c */
extern const se_backend se_backend_host;   /* backend_host.c: plain C, for tests (SE_HOST_BACKEND=1) */

/* ---- the device layer over the table (device.c: devices, uploads, device contexts;
 * device_forward.c: the layers over the operations) */

/* A model's device part (se_model.dev): its weights uploaded once, raw (the GGUF bytes). */
struct se_dev_model {
    const se_backend *be;
    se_device *d;
    int32_t n_layers;          /* layers [0, n_layers) run on the device */
    int head;                  /* the output norm and head run there too */
    se_dview (*w)[SE_T_COUNT]; /* [n_layers][slot]; .buf NULL for an absent tensor */
    se_dview output_norm, output;
    se_dbuf **bufs;            /* every buffer, released with the model */
    int n_bufs;
};

/* Rows of the head computed per pass on the device (a context's logits buffer holds this many rows
 * of n_vocab: 32 MiB for a 262k vocabulary; more rows go through the head in several passes). */
#define SE_DEV_HEAD_ROWS 32

/* A context's device part (se_context.dev): the KV caches of the offloaded layers and the scratch
 * of one ubatch (the same roles as the context's host buffers, engine.h). */
struct se_dev_ctx {
    se_dview *kc, *vc;         /* [n_layers], kv_bytes(n_ctx) each */
    se_dview x, xb, q, k, v, att, tmp, hb, hb2;
    se_dview logits;           /* [logits_rows][n_vocab], when the head is on the device */
    int32_t logits_rows;
    se_dbuf **bufs;
    int n_bufs;
};

/* Sets this thread's se_backend_error(): the printf-style text, then ": " and what the backend
 * said when be is not NULL. Returns rc. */
int se_dev_fail(const se_backend *be, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* The device part of a new context of m (m->dev set), or NULL (se_backend_error() says why). */
struct se_dev_ctx *se_dev_ctx_new(const se_model *m, const se_context_params *cp);
void se_dev_ctx_free(const se_model *m, struct se_dev_ctx *dc);
void se_dev_model_free(struct se_dev_model *dm);
/* The device's share of one ubatch of c (ubatch fields set, c->x holding the embeddings): the
 * offloaded layers, then either x back into c->x (the CPU runs the rest) or, with the head on the
 * device, the wanted logits rows downloaded where se_forward_output would write them. */
int se_dev_forward(se_context *c);

#endif
