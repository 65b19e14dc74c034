/* The reference engine's exported API (loaded from Python with ctypes: reference_engine/core.py
 * mirrors every struct and enum here; change both together).
 *
 * A model is a set of tensors that live in memory the caller owns (the memory-mapped GGUF file):
 * the engine never copies weights. Python validates the file (offsets, sizes against the file
 * size), then describes the model: se_model_new(hparams), se_model_set_tensor() for each tensor,
 * se_model_set_layer() for per-layer settings, se_model_finalize(). The C side checks shapes and
 * types again, so a bad description is an error code, never a crash.
 *
 * A context owns everything a forward pass needs, allocated once at creation: the KV cache
 * (f32, per layer and kv head; attention.c has the layout), scratch buffers for n_ubatch tokens,
 * the thread pool and the sampler's state. se_decode evaluates any number of tokens in one call.
 */
#ifndef SE_ENGINE_H
#define SE_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#define SE_API __attribute__((visibility("default")))

/* Return codes (negative = error). */
enum se_status {
    SE_OK = 0,
    SE_ERR_CONTEXT_OVERFLOW = -1, /* n_past + tokens would exceed n_ctx; nothing was evaluated */
    SE_ERR_BAD_TOKEN = -2,        /* a token id outside [0, n_vocab) */
    SE_ERR_INVALID = -3,          /* a bad argument (shape, type, count, slot, ...) */
    SE_ERR_NOMEM = -4,
    SE_ERR_MISSING = -5,          /* finalize: a required tensor was not set */
    SE_ERR_DEVICE = -6,           /* a device backend failed: se_backend_error() says why */
};

/* The architectures (model.c's table: name, forward pass, the per-layer tensors it reads).
 * se_arch_count() / se_arch_name() / se_arch_id() / se_arch_layer_slot() read the table. */
enum se_arch { SE_ARCH_LLAMA = 1, SE_ARCH_GEMMA3 = 2, SE_ARCH_COUNT /* one past the last id */ };

/* How RoPE pairs the dimensions of a head (llama.cpp's rope modes). NORM rotates adjacent pairs
 * (2i, 2i+1): llama's GGUF Q/K weights are stored permuted by the converter so that this is
 * right. NEOX rotates (i, i + n_rot/2): gemma and most newer architectures. */
enum se_rope_type { SE_ROPE_NORM = 0, SE_ROPE_NEOX = 2 };

typedef struct {
    int32_t arch;        /* se_arch */
    int32_t n_vocab;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;    /* per head, for q and k and v */
    int32_t n_ff;
    int32_t n_rot;       /* rotated dimensions per head (<= head_dim, even) */
    int32_t rope_type;   /* se_rope_type */
    float norm_eps;      /* RMSNorm epsilon */
    float rope_base;     /* default base for every layer (se_model_set_layer overrides) */
    float rope_freq_scale; /* linear rope scaling: position * scale (1 = none) */
    float attn_scale;    /* scores = q.k * attn_scale (llama: 1/sqrt(head_dim)) */
    float embd_scale;    /* token embeddings are multiplied by this (gemma: sqrt(n_embd); else 1) */
} se_hparams;

/* Tensor slots. Global ones are set with layer = -1. Optional ones may be left unset. */
enum se_slot {
    SE_T_TOKEN_EMBD = 0,  /* [n_embd, n_vocab] any type with to_float */
    SE_T_OUTPUT_NORM,     /* [n_embd] f32 */
    SE_T_OUTPUT,          /* [n_embd, n_vocab] optional: tied to token_embd when unset */
    SE_T_ATTN_NORM,       /* per layer [n_embd] f32 */
    SE_T_ATTN_Q,          /* [n_embd, n_head*head_dim] */
    SE_T_ATTN_K,          /* [n_embd, n_head_kv*head_dim] */
    SE_T_ATTN_V,          /* [n_embd, n_head_kv*head_dim] */
    SE_T_ATTN_OUTPUT,     /* [n_head*head_dim, n_embd] */
    SE_T_ATTN_Q_NORM,     /* [head_dim] f32, optional (gemma3) */
    SE_T_ATTN_K_NORM,     /* [head_dim] f32, optional (gemma3) */
    SE_T_ATTN_POST_NORM,  /* [n_embd] f32, optional (gemma3) */
    SE_T_FFN_NORM,        /* [n_embd] f32 */
    SE_T_FFN_GATE,        /* [n_embd, n_ff] */
    SE_T_FFN_UP,          /* [n_embd, n_ff] */
    SE_T_FFN_DOWN,        /* [n_ff, n_embd] */
    SE_T_FFN_POST_NORM,   /* [n_embd] f32, optional (gemma3) */
    SE_T_COUNT
};

typedef struct {
    int32_t n_ctx;           /* positions in the KV cache */
    int32_t n_batch;         /* tokens per logical batch (a decode of more is split) */
    int32_t n_ubatch;        /* tokens per forward pass (scratch buffers are sized for it) */
    int32_t n_threads;       /* threads for single-token decodes */
    int32_t n_threads_batch; /* threads for batches of more than one token */
    int32_t type_k, type_v;  /* the KV cache's element types: 0 f32 (exact), 1 f16 (ggml's ids) */
} se_context_params;

/* Sampling, applied in llama.cpp's order: penalties, top-k, top-p, min-p, temperature, draw. */
typedef struct {
    float temp;              /* <= 0: greedy (argmax after penalties) */
    int32_t top_k;           /* <= 0: off */
    float top_p;             /* >= 1: off */
    float min_p;             /* <= 0: off */
    float repeat_penalty;    /* 1: off */
    int32_t repeat_last_n;   /* tokens of history the penalties look at (0: off, -1: n_ctx) */
    float presence_penalty;  /* 0: off */
    float frequency_penalty; /* 0: off */
    int64_t seed;            /* the RNG is (re)seeded when this changes or after a reset; -1 = random */
} se_sampling_params;

typedef struct se_model se_model;
typedef struct se_context se_context;

SE_API const char *se_version(void);

/* The architecture table: ids 1..se_arch_count(). se_arch_name: GGUF's general.architecture for
 * an id (NULL for an unknown id); se_arch_id: the id of a name (SE_ERR_INVALID if unknown);
 * se_arch_layer_slot: 1 if every layer of the architecture needs tensor slot `slot`
 * (se_model_finalize requires it), 0 if its forward pass does not read it per layer (the global
 * slots included), SE_ERR_INVALID for an unknown id or slot. */
SE_API int32_t se_arch_count(void);
SE_API const char *se_arch_name(int32_t arch);
SE_API int32_t se_arch_id(const char *name);
SE_API int se_arch_layer_slot(int32_t arch, int32_t slot);

SE_API se_model *se_model_new(const se_hparams *hp); /* NULL: invalid hparams or no memory */
SE_API int se_model_set_tensor(se_model *m, int32_t layer, int32_t slot, const void *data,
                               int32_t type, int64_t ne0, int64_t ne1);
SE_API int se_model_set_layer(se_model *m, int32_t layer, float rope_base, int32_t sliding_window);
/* Checks that every required tensor is present. Returns SE_OK or SE_ERR_MISSING; then
 * *bad_layer / *bad_slot (if not NULL) name the first missing one. */
SE_API int se_model_finalize(se_model *m, int32_t *bad_layer, int32_t *bad_slot);
/* Says that the tensors' data lie in a read-only mapping of the model file, so that pages this
 * process no longer needs may leave its memory (they are read again from the file when needed):
 * the head's, once the screen's planes hold it (screen.c). Off by default. */
SE_API int se_model_set_file_mapped(se_model *m, int32_t on);
/* Packed panels (kernels.h): a second copy of the matmul weights whose type and ISA have them
 * (AVX-512: Q4_0, Q4_1, Q8_0), as large as those weights, that batches of tokens read faster.
 * Made at the first se_decode_batch of two contexts or more (a model that serves one sequence
 * keeps one copy), unless turned off (on = 0; before that call). */
SE_API int se_model_set_batch_panels(se_model *m, int32_t on);
SE_API size_t se_model_panels_bytes(const se_model *m); /* 0 until made (or none) */
SE_API void se_model_free(se_model *m);

SE_API se_context *se_context_new(const se_model *m, const se_context_params *cp);
SE_API void se_context_free(se_context *c);
SE_API float *se_context_logits(se_context *c); /* last token's logits, n_vocab floats */
SE_API int32_t se_context_n_past(const se_context *c);
SE_API const int32_t *se_context_tokens(const se_context *c); /* the n_past tokens in the cache */
SE_API void se_context_reset(se_context *c);
/* Forgets positions >= n_past (keeps the cached prefix) and re-arms the seed, so a continuation
 * sampled with the same seed replays. SE_ERR_INVALID if n_past is out of range. */
SE_API int se_context_truncate(se_context *c, int32_t n_past);

/* Evaluates n tokens at positions n_past..n_past+n-1. The last token's logits go to
 * se_context_logits(); if all_logits is not NULL it receives n rows of n_vocab floats, one per
 * token. Returns SE_OK, or an error before anything was evaluated. */
SE_API int se_decode(se_context *c, const int32_t *tokens, int32_t n, float *all_logits);

/* Evaluates tokens of n_seq distinct contexts of one model together: context ctxs[i] takes
 * n_tokens[i] >= 1 tokens (consecutive in `tokens`, context 0's first) at its positions
 * n_past..n_past+n_tokens[i]-1, and its last token's logits go to its se_context_logits().
 * The rows of every context go through each forward pass together (the weights are read once
 * per pass); ctxs[0]'s scratch buffers and thread pool serve the passes, n_ubatch rows at most
 * each (more rows take several passes). Each row attends over its own context's cache with its
 * own position, so every context's logits and cache are bit-identical to se_decode on that
 * context alone. Returns SE_OK, or an error before anything was evaluated in any context:
 * SE_ERR_INVALID (n_seq < 1, a NULL or repeated context, contexts of different models, a count
 * < 1), SE_ERR_CONTEXT_OVERFLOW (a context's tokens do not fit it), SE_ERR_BAD_TOKEN,
 * SE_ERR_NOMEM. The contexts must not be used by another thread during the call. */
SE_API int se_decode_batch(se_context *const *ctxs, int32_t n_seq, const int32_t *tokens,
                           const int32_t *n_tokens);

/* Samples the next token from the last logits (which it does not modify). Returns the token id,
 * or SE_ERR_INVALID if nothing was decoded yet. */
SE_API int32_t se_sample(se_context *c, const se_sampling_params *sp);
/* Tokens se_sample never picks (their logits count as -inf: ignore_eos, min_tokens) until the
 * next call; n = 0 clears them. SE_ERR_BAD_TOKEN for an id outside the vocabulary. */
SE_API int se_context_set_banned(se_context *c, const int32_t *ids, int32_t n);

/* The screened output head (issue 22; screen.c). With the lazy head on (off at creation), a
 * decode that gives one context's last-token logits (se_decode without all_logits, or
 * se_decode_batch of that one context) stops before the output head: the logits are pending.
 * se_sample then computes only the rows its sampler can choose where it needs just the top k
 * (greedy, or top_k <= 128, with penalties that only lower logits), and the token is the one the
 * full head would give; otherwise it runs the full head first. se_context_head runs the full
 * head if the logits are pending (call it before reading se_context_logits). Turning the lazy
 * head off runs a pending head. Models whose head is not Q8_0, or is on a device, never defer. */
SE_API int se_context_set_lazy_head(se_context *c, int32_t on); /* 2: as 1, and never fall back
                                                                  * to the full head for speed (tests) */
SE_API int se_context_head(se_context *c);
/* 1 when the last logits are pending (the next se_sample computes head rows: milliseconds), 0
 * when they are computed (a greedy or small top-k sample then takes microseconds). */
SE_API int se_context_head_pending(const se_context *c);
/* The pending head as a screened sampler's fallback computes it where the screen's planes stand for
 * the head (a head that outweighs the layers): from the planes, with the full head's bits, so that
 * the head's pages stay out of memory. SE_ERR_INVALID when nothing is pending or there are no such
 * planes (yet). */
SE_API int se_context_head_from_planes(se_context *c);
/* What the context's next sample will need, for a pass of several contexts (se_decode_batch): with
 * the lazy head on and sp a sampler that a screen serves, the pass leaves this context's head
 * pending too, with the screen's stage 1 done for it in the pass (the 4-bit plane read once for
 * all such contexts, at most SE_SCREEN_BATCH of them); sp NULL (the logits will be read, or the
 * sampler is not known): the pass computes its logits. Off at creation. */
SE_API int se_context_plan_sample(se_context *c, const se_sampling_params *sp);
/* out[0]: screened samples, out[1]: rows they computed exactly, out[2]: samples that found the
 * bounds unusable (not numbers) and ran the full head, out[3]: rows their stage 2 narrowed,
 * out[4]: screened samples whose stage 1 a pass of several contexts did, out[5]: screened samples
 * that took min-p's route (top-p and min-p applied by the screen), out[6]: samples on that route
 * that could not tell top-p's or top-k's cut without the rows left out and ran the full head */
#define SE_SCREEN_STATS 7
SE_API void se_context_screen_stats(const se_context *c, int64_t out[SE_SCREEN_STATS]);
/* Test hook (blocks.c, se_share_rows): with on, every matmul step of a pass of more than one
 * token starts with all its rows in the last thread's share, whose owner takes SPLIT_ALIGN rows at
 * a time, so the other threads compute only rows they take from it. Returns the previous
 * setting. Not thread-safe, like se_set_isa. */
SE_API int se_set_share_rows_skew(int on);
/* The rows threads have taken from another thread's share, in this process so far. */
SE_API int64_t se_rows_taken_from_others(void);
/* For tests: the screen of the pending head for a top-k sampler (no penalties): its candidates'
 * ids and exact logits (up to cap of them, in id order) and their count; -1 when it cannot
 * screen. The logits stay pending. Afterwards se_context_screen_bounds gives every row's interval
 * (upper 0: the lower ends, 1: the upper ends; n_vocab floats, NULL before any screen). */
SE_API int32_t se_context_screen(se_context *c, int32_t k, int32_t *ids, float *logits, int32_t cap);
SE_API const float *se_context_screen_bounds(const se_context *c, int32_t upper);
/* For tests: the intervals the screen gives rows (n_rows Q8_0 rows of n weights, n a multiple of
 * 64) for one token's Q8_0 activations, with the kernels of the ISA in use: stage 1's (stages 1),
 * stage 2's on every row (2), or stage 3's after it (3, planes that keep the low bits). SE_ERR_INVALID
 * for a bad shape or a negative scale. */
SE_API int se_screen_bounds_test(const void *rows, int64_t n_rows, int64_t n, const void *act, int32_t stages,
                                 float *lo, float *hi);
/* For tests: n_rows Q8_0 rows of n weights into the planes that stand for them (low bits kept),
 * then each row rebuilt from them into out (n_rows rows of the same bytes) by the ISA in use's
 * kernel. SE_ERR_INVALID for a bad shape or a negative scale. */
SE_API int se_screen_rows_test(const void *rows, int64_t n_rows, int64_t n, void *out);
/* For tests: the same planes, then the full head from them (the screened samplers' fallback) for
 * one token's Q8_0 activations act, the n_rows logits into out, by the ISA in use's path. */
SE_API int se_screen_head_test(const void *rows, int64_t n_rows, int64_t n, const void *act, float *out);
/* For tests: the planes' bytes (the tiles, the records, then the low bits where stand is set) of
 * n_rows Q8_0 rows of n weights, built by the ISA in use's packer, into out (cap bytes); their
 * count, or SE_ERR_INVALID (a bad shape, a negative scale, too small a cap). */
SE_API int64_t se_screen_planes_test(const void *rows, int64_t n_rows, int64_t n, int32_t stand, void *out,
                                     int64_t cap);
/* Bytes of the model's screen planes (0 until the first screened sample builds them) */
SE_API size_t se_model_screen_bytes(const se_model *m);

/* Activation statistics, for importance matrices (`infer quantize --imatrix-from`). While set,
 * every forward pass on c adds, for each layer's four matmul inputs, the square of each input
 * activation to sum2 (per input column, in double) and the number of input rows to count. Per
 * layer il the columns are, in order: [n_embd] the attention input (attn_q, attn_k, attn_v),
 * [n_head*head_dim] attn_output's input, [n_embd] the feed-forward input (ffn_gate, ffn_up),
 * [n_ff] ffn_down's input: sum2 holds n_layer * (2*n_embd + n_head*head_dim + n_ff) doubles and
 * count n_layer * 4 (count[il*4 + g] for those four groups g). The output head is not counted.
 * The caller owns both arrays (zeroed to start) and keeps them until it sets NULL again; NULL
 * (the default) turns it off, at the cost of one pointer test per matmul group. A batch across
 * contexts (se_decode_batch) is counted by its first context's setting. */
SE_API int se_context_set_act_stats(se_context *c, double *sum2, int64_t *count);
/* ---- devices (issue 20; backend.h has the design). Devices are numbered across every backend
 * of the table (backend.h se_backends), in its order; none when no runtime or device exists. */
SE_API int32_t se_device_count(void);
/* The backend's name ("opencl") of device i, NULL for a bad index. */
SE_API const char *se_device_backend(int32_t i);
/* "platform / device" into name (len bytes, NUL-terminated) and its memory in bytes. */
SE_API int se_device_describe(int32_t i, char *name, size_t len, uint64_t *mem_bytes);
/* What the last device call of this thread that failed said (the backend's words, with what was
 * being done: the tensor, the bytes asked for, the kernel compiler's log); "" when none did. Also
 * why se_device_count() is 0. */
SE_API const char *se_backend_error(void);
/* After finalize and before any context: opens device `device` and uploads layers
 * [0, min(n_gpu_layers, n_layer)) once, and the output norm and head too when n_gpu_layers >
 * n_layer (n_gpu_layers < 0: everything). Contexts created afterwards hold the device KV caches of
 * those layers and device scratch; their decodes run those layers on the device. n_gpu_layers = 0
 * does nothing. Returns SE_OK; SE_ERR_INVALID (bad index, not finalized, already offloaded, or a
 * tensor of a type the backend cannot multiply: se_backend_error() names it); SE_ERR_DEVICE (the
 * device would not open or its kernels would not build); SE_ERR_NOMEM (out of device memory). On
 * an error the model is unchanged (CPU only). */
SE_API int se_model_offload(se_model *m, int32_t device, int32_t n_gpu_layers);
/* Layers on the device (0: none), and 1 if the output head is there too. */
SE_API int32_t se_model_gpu_layers(const se_model *m, int32_t *head);


#ifdef SE_ENGINE_INTERNAL
/* Shared by the engine's C files only. */
#include "threadpool.h"

#include <pthread.h>
#include <stdatomic.h>

typedef struct {
    const void *data;  /* NULL: absent */
    int32_t type;      /* se_type */
    int64_t ne0, ne1;  /* ne0 = row length (elements), ne1 = rows */
    size_t row_size;   /* bytes per row */
    const void *panels; /* its packed panels, or NULL (se_model_set_batch_panels; atomic: set once) */
} se_tensor;

typedef struct {
    se_tensor t[SE_T_COUNT]; /* indexed by se_slot (the global slots are unused here) */
    float rope_base;
    int32_t sliding_window;  /* 0: full attention; else a query at p sees keys (p - w, p] */
    int32_t rope_idx;        /* which of the context's rope tables this layer uses */
} se_layer;

#define SE_MAX_ROPE_TABLES 4

struct se_model {
    se_hparams hp;
    se_tensor token_embd, output_norm, output; /* output.data == token_embd.data when tied */
    se_layer *layers;
    int n_rope;                         /* distinct rope bases */
    float rope_bases[SE_MAX_ROPE_TABLES];
    int finalized;
    struct se_dev_model *dev;           /* the device part (backend.h); NULL: CPU only */
    struct se_screen *screen;           /* the head's screen plane (screen.c), built at first use */
    int screen_state;                   /* 0: not tried yet, 1: built, -1: the head cannot be screened */
    pthread_mutex_t screen_lock;
    int file_mapped;                    /* se_model_set_file_mapped */
    int panels_state;                   /* 0: not made yet, 1: made, -1: none or turned off */
    void *panels;                       /* every tensor's panels, one allocation */
    size_t panels_bytes;
    pthread_mutex_t panels_lock;
};

/* One thread's private scratch. */
typedef struct {
    float *norm;       /* normalised rows for small batches, SE_PRIVATE_TOKENS x max width */
    void *act[3];      /* quantized activations for small batches, one per act type */
    _Atomic uint64_t rows_left; /* the rows of its share of a matmul step not taken yet (blocks.c, se_share_rows) */
    uint32_t step;              /* the matmul steps this thread has begun in the pass (ditto) */
} se_thread_scratch;

typedef struct {
    int32_t id;
    float logit;
} se_cand;

#define SE_PRIVATE_TOKENS 8 /* batches up to this size quantize activations on every thread */

/* A run of consecutive rows of a ubatch that belong to one context (se_decode: one segment;
 * se_decode_batch: one per context in the pass). */
typedef struct {
    se_context *ctx;   /* whose KV cache the rows write and attend over, whose logits they give */
    int32_t start, n;  /* rows [start, start + n) of the ubatch */
    int32_t pos;       /* the position of row start in ctx */
    int32_t out;       /* 1: the last row's logits go to ctx->logits */
    int32_t defer;     /* 1 (with out): they wait for ctx's screened sample, stage 1 done (screen.c) */
} se_ub_seg;

struct se_context {
    const se_model *m;
    se_context_params cp;
    int32_t n_past;
    int32_t *tokens;         /* the n_past tokens in the cache, for the penalties */
    void *k_cache, *v_cache; /* per layer and kv head, of cp.type_k / type_v (attention.c: se_kv_*) */
    float *k_new;            /* the ubatch's keys on their way to the cache [n_ubatch][n_head_kv][head_dim] */
    float *v_new;            /* its values (same shape) */
    /* activations for one ubatch */
    float *x;                /* residual stream [n_ubatch][n_embd] */
    float *xb;               /* normalised rows [n_ubatch][max(n_embd, n_ff)] */
    float *q;                /* [n_ubatch][n_head*head_dim] */
    float *att;              /* attention output [n_ubatch][n_head*head_dim] */
    float *tmp;              /* matmul output before the residual add [n_ubatch][n_embd] */
    float *hb, *hb2;         /* ffn gate/up [n_ubatch][n_ff] */
    float *rope;             /* [n_rope][n_ubatch][n_rot/2][2] (cos, sin) */
    void *act[3];            /* shared quantized activations [n_ubatch] rows of the widest type */
    size_t act_size;         /* bytes of each act buffer */
    se_thread_scratch *ts;   /* one per pool thread */
    float *logits;           /* last token [n_vocab] */
    se_pool *pool;
    /* the ubatch being evaluated (read by every pool thread) */
    const int32_t *ub_tokens;
    int32_t ub_n;
    float *ub_out;           /* logits rows of every token to write (one segment only), or NULL */
    se_ub_seg *ub_seg;       /* its segments [n_ubatch] (the rows of each context), in row order */
    int32_t ub_nseg;
    int32_t ub_nout;         /* segments whose last row's logits are wanted */
    int32_t *ub_rseg;        /* the segment of each row [n_ubatch] */
    float *ub_logits;        /* several segments' logits before they go to their contexts */
    int32_t ub_logits_rows;  /* [ub_logits_rows][n_vocab] allocated */
    /* sampler */
    se_cand *cand;           /* [n_vocab] */
    se_cand *cand_sorting;   /* [n_vocab] the sort's other half (sampling.c), made at its first use */
    int32_t *counts;         /* [n_vocab] occurrences in the penalty window, kept all zero */
    uint64_t rng[2];         /* xoroshiro128** state (sampling.c) */
    int64_t rng_seed;
    int rng_seeded;
    /* activation statistics (se_context_set_act_stats), NULL: off */
    double *stats_sum2;
    int64_t *stats_count;
    /* devices (backend.h) */
    struct se_dev_ctx *dev;  /* this context's device KV caches and scratch; NULL: CPU only */
    int32_t layer0;          /* the first layer the CPU forward pass runs; it runs the prologue
                              * only from 0 (else the device ran the layers before) */
    /* the lazy head (screen.c) */
    int lazy_head;           /* se_context_set_lazy_head */
    int head_pending;        /* 1: logits are stale; head_x holds the head's input (before its norm) */
    se_context *ub_defer;    /* the context whose head this ubatch leaves pending (its one output
                              * row's logits not asked for yet), or NULL */
    float *head_x;           /* [n_embd] */
    int32_t ub_ndefer;       /* segments of this ubatch whose head waits with stage 1 done (se_ub_seg.defer) */
    int batch_screen;        /* se_context_plan_sample: a pass of several contexts may defer this one's head */
    int scr_ready;           /* 1: scr_lo, scr_hi hold stage 1 of the pending head (a pass computed it) */
    int32_t scr_heavy;       /* passes since this context's last screen narrowed over a quarter of the
                              * rows (-1: it did not): such a context's head is not deferred (screen.c) */
    void *scrb_act;          /* [pool threads][SE_SCREEN_BATCH] a pass's deferred rows' activations as the
                              * bound kernels read them (each thread its own copy) */
    float *scr_lo, *scr_hi;  /* [n_vocab] the screen's bounds (allocated at the first screen) */
    se_cand *scr_top;        /* [pool threads][SE_SCREEN_MAX_K] each thread's rows of largest lower bound */
    float *scr_exact;        /* [SE_SCREEN_MAX_K] the exact logits of the k rows of largest lower bound */
    int32_t *scr_n;          /* [pool threads] how many, then each thread's candidates */
    int32_t *scr_pen;        /* [n_ctx + n_vocab] the penalized and the banned tokens */
    int32_t *scr_ids;        /* [n_vocab] the rows stage 1 left, each thread's in its own range */
    float *scr_up, *scr_down; /* [n_vocab] their stage-2 moves */
    void *scr_act;           /* [pool threads] the token's activations as the bound kernels read them */
    void *scr_rows;          /* [pool threads] rows of the head rebuilt from the planes (screen.c) */
    size_t scr_act_bytes;
    int64_t screen_stats[SE_SCREEN_STATS]; /* se_context_screen_stats */
    int32_t screen_skip;     /* samples left that take the full head instead of a screen */
    int32_t screen_backoff;  /* the samples the next screen that leaves too many rows skips (screen.c) */
    int32_t *ban, n_ban;     /* tokens the sampler never picks (se_context_set_banned), ascending */
};

/* sampling.c, for screen.c: the candidates' min-heap h[0..*n) of at most k entries, in the
 * sampler's order (higher logit first, lower id first among equal ones; the root is the last
 * kept): after pushing every candidate it holds the first k; and qsort's order of int32_t */
void se_cand_push(se_cand *h, int32_t k, int32_t *n, se_cand v);
int se_cand_desc(const void *a, const void *b); /* qsort's comparison for that order */
int se_cmp_i32(const void *x, const void *y);

/* screen.c, for model.c, blocks.c and sampling.c */
struct se_screen;
int se_screen_possible(const se_model *m);
void se_screen_free(struct se_screen *s);
void se_screen_context_free(se_context *c); /* its screen buffers */
/* The candidates of a screened sample in c->cand (exact and penalized logits, in id order) and
 * their count; -1 when it cannot screen (then the full head decides). window: the penalties'
 * window (0: no penalties). *final = 1: the screen took min-p's route and applied top-k, top-p
 * and min-p itself: cand holds the tokens the draw chooses from, in the candidates' order. */
int32_t se_screen_candidates(se_context *c, const se_sampling_params *sp, int32_t window, int *final);
/* Whether a pass of several contexts (run by c) can leave ctx's head pending with stage 1 done,
 * readying the plane and ctx's buffers (on ctx's idle pool) */
int se_screen_defer(se_context *c, se_context *ctx);
/* Token t's embedding row from the screen's planes when they hold the (tied) embedding, into row
 * (the bytes the model stores); NULL when they do not: read the tensor */
const void *se_screen_embedding_row(const se_model *m, int32_t t, void *row);
/* A logit after the penalties of a token seen n times in the window */
float se_penalized(float l, int32_t n, const se_sampling_params *sp);
#endif

#endif
