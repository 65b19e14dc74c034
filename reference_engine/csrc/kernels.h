/* The contract between the forward passes and the quantized kernels.
 *
 * Every tensor type is one row of the type-trait table (kernels.c). A matmul quantizes the
 * activations once into the weight type's `act_type` (Q8_0, Q8_1, Q8_K or F32), then takes
 * dot products row by row; the SIMD variant of each dot is chosen once at start-up from the
 * CPU's flags (kernels.c), so the forward passes never see an ISA.
 */
#ifndef SE_KERNELS_H
#define SE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* ggml's type ids, so GGUF tensor types map one to one. */
enum se_type {
    SE_F32 = 0, SE_F16 = 1, SE_Q4_0 = 2, SE_Q4_1 = 3, SE_Q5_0 = 6, SE_Q5_1 = 7,
    SE_Q8_0 = 8, SE_Q8_1 = 9, SE_Q2_K = 10, SE_Q3_K = 11, SE_Q4_K = 12, SE_Q5_K = 13, SE_Q6_K = 14, SE_Q8_K = 15,
    SE_BF16 = 30, SE_TYPE_COUNT = 31
};

typedef void (*se_to_float_fn)(const void *src, float *dst, int64_t n);
typedef void (*se_from_float_fn)(const float *src, void *dst, int64_t n);
/* dot of one weight row (n elements, type T) with one activation row (n elements, T's act_type) */
typedef float (*se_dot_fn)(int64_t n, const void *w, const void *a);

typedef struct {
    const char *name;          /* ggml name: "q4_1" */
    int blck;                  /* elements per block */
    int size;                  /* bytes per block */
    int act_type;              /* what activations become before the dot */
    se_to_float_fn to_float;   /* dequantize a row */
    se_from_float_fn from_float; /* quantize a row (activation types, and float types) */
    se_dot_fn dot;             /* filled by se_kernels_init with the best variant here */
    /* Appended fields (reference_engine/core.py mirrors the ones above): the block's layout. */
    int sub_blck;              /* elements per scale: a K-quant's sub-block, else the block */
    int has_min;               /* x = d*q + m (q4_1, q5_1) or d*sc*q - dmin*m (q4_K, q5_K) */
    int q_offset;              /* quants read as unsigned integers are q + q_offset (below) */
    int qs_offset;             /* byte offset of the quants (their low bits) in a block */
    int qh_offset;             /* byte offset of their high bits (q5_0, q5_1, q5_K, q6_K); 0: none
                                * (q3_K's high bits, hmask, lead its block: its unpackers read them) */
} se_type_traits;

/* The SIMD paths, slowest first. AMX is AVX-512 whose prompt GEMM takes its integer sums from
 * int8 tiles (kernels_avx512.c): every other kernel, and every result bit, is AVX-512's. */
typedef enum { SE_ISA_SCALAR, SE_ISA_AVX2, SE_ISA_AVX512, SE_ISA_AMX, SE_ISA_COUNT } se_isa;

/* Picks the SIMD path once, for the matmul kernels and the attention (which reads se_isa_in_use()).
 * Honours INFER_REF_ISA=scalar|avx2|avx512|amx (forces a lower path). */
void se_kernels_init(void);
const char *se_isa_name(void);                 /* the path in use: "scalar", "avx2", "avx512", "amx" */
se_isa se_isa_in_use(void);                    /* the same as an index (after se_kernels_init) */
/* The machine probe's AMX rate (probe.c): the MACs of iters rounds of tile products; 0 off x86. */
uint64_t se_amx_probe_macs(int64_t iters);
const se_type_traits *se_traits(int type);     /* NULL for a type the engine does not know */
size_t se_row_size(int type, int64_t n);       /* bytes of a row of n elements */

/* Quantize n_tok rows of k floats (row stride k) into act (row stride se_row_size(act_type, k)). */
void se_quantize_rows(int act_type, const float *x, int64_t k, int n_tok, void *act);

/* y[t*ldy + r] = dot(W row r, activation row t) for r in [r0, r1), t in [0, n_tok).
 * W has rows of k elements of wtype; act was made by se_quantize_rows(traits(wtype)->act_type).
 * A batch of se_gemm_min_tokens() or more takes the path's GEMM where it has one, a smaller one
 * of 2 or more its small-batch kernel where it has one (AVX-512; AVX2's legacy types have one
 * kernel for both), else the tiles; every
 * path adds a row's products in one order (kernels_avx512.c), so a token's results are the same
 * bit for bit whatever the other tokens of the batch, its place in it, the path and the row range. */
void se_matmul(int wtype, const void *W, int64_t k, const void *act, int n_tok,
               float *y, int64_t ldy, int64_t r0, int64_t r1);
int se_gemm_min_tokens(void);

/* Packed panels: a copy of a weight matrix that the ISA in use reads faster in batches of 2
 * tokens or more (the steps of batched decoding, and the prompts beside them; on AMX only those
 * below SE_AMX_PANELS_MAX_TOKENS: its GEMM keeps the rest), of the same size as the rows (rows
 * rounded up to 16); AVX-512 and AMX, types Q4_0, Q4_1 and Q8_0 (kernels_avx512_batch.c).
 * se_panels_size is 0 where the ISA in use has none for the type. se_matmul_panels is se_matmul
 * (the same bits), reading P (NULL: none) where it applies. */
size_t se_panels_size(int wtype, int64_t k, int64_t rows);
void se_pack_panels(int wtype, const void *W, int64_t k, int64_t rows, void *P);
const void *se_panels_for(int wtype, const void *P, int n_tok); /* P where a batch of n_tok reads it, else NULL */
void se_matmul_panels(int wtype, const void *W, const void *P, int64_t k, const void *act, int n_tok, float *y,
                      int64_t ldy, int64_t r0, int64_t r1);
/* Test and benchmark hook: batches of n or more tokens take the GEMM from now on (n < 1: the
 * default, SE_GEMM_MIN_TOKENS). Returns the previous value. Not thread-safe, like se_set_isa. */
int se_set_gemm_min_tokens(int n);

/* Test hook: use the named path ("scalar", "avx2", "avx512", "amx"; NULL or "" = the best one here).
 * Returns 0, or -1 (path unchanged) when this CPU cannot run it. Not thread-safe: call it
 * between matmuls, never while a pool is running. Tests use it to check every path in one
 * process; INFER_REF_ISA does the same at start-up. */
int se_set_isa(const char *isa);

/* IEEE half <-> float: widening is exact; narrowing rounds to nearest even (F16C's and numpy's). */
float se_fp16_to_fp32(uint16_t h);
uint16_t se_fp32_to_fp16(float f);

#ifdef SE_KERNELS_INTERNAL
#include <string.h>

/* Shared by kernels*.c only.
 *
 * Adding a type: its block struct and its row of se_types below (its layout and act_type), its
 * to_float and scalar dot in kernels.c and their row of scalar_fns; that is enough for se_matmul,
 * on every path.
 * SIMD is optional: a dot and a tile in kernels_avx2.c / kernels_avx512.c, one entry in their
 * table, and tests/test_kernels.py runs it against gguf on every path by adding the type there.
 * So is the prompt GEMM (kernels_avx512.c): the type's panel shape and how to unpack its rows.
 *
 * ggml's block layouts (little-endian, fp16 stored as raw bits): */
#define SE_QK 32    /* elements per block of the legacy types */
#define SE_QK_K 256 /* elements per super-block of the K-quants */

typedef struct { uint16_t d; uint8_t qs[16]; } se_blk_q4_0;              /* 18 B */
typedef struct { uint16_t d, m; uint8_t qs[16]; } se_blk_q4_1;           /* 20 B */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } se_blk_q5_0; /* 22 B */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } se_blk_q5_1; /* 24 B */
typedef struct { uint16_t d; int8_t qs[32]; } se_blk_q8_0;               /* 34 B */
typedef struct { uint16_t d, s; int8_t qs[32]; } se_blk_q8_1;            /* 36 B, s = d*sum(qs) */
/* Q2_K: 16 sub-blocks of 16, scales[i] = scale (low nibble) | min << 4; q = 2 bits. */
typedef struct { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; } se_blk_q2_K; /* 84 B */
/* Q3_K: 16 sub-blocks of 16 with 6-bit scales (stored + 32) packed in scales[12]; q = 2 low bits
 * in qs and a high bit in hmask, the weight's quant is (low | high << 2) - 4. */
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; } se_blk_q3_K; /* 110 B */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } se_blk_q4_K; /* 144 B */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } se_blk_q5_K;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } se_blk_q6_K; /* 210 B */
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } se_blk_q8_K; /* 292 B */

/* The facts of every type, the first part of the trait table (kernels.c adds the functions):
 * here, in a header, so that the ISA files read them as constants. q_offset: the stored quants
 * are unsigned and the weight's quant is q - q_offset (q4_0: 8, q5_0: 16, q6_K: 32); q8_0's are
 * int8, which read as unsigned bytes after flipping the top bit are q + 128; the types with a min
 * need no offset (the min does that job). */
static const se_type_traits se_types[SE_TYPE_COUNT] = {
    [SE_F32] = { .name = "f32", .blck = 1, .size = sizeof(float), .act_type = SE_F32, .sub_blck = 1 },
    [SE_F16] = { .name = "f16", .blck = 1, .size = sizeof(uint16_t), .act_type = SE_F32, .sub_blck = 1 },
    [SE_BF16] = { .name = "bf16", .blck = 1, .size = sizeof(uint16_t), .act_type = SE_F32, .sub_blck = 1 },
    [SE_Q4_0] = { .name = "q4_0", .blck = SE_QK, .size = sizeof(se_blk_q4_0), .act_type = SE_Q8_0,
                  .sub_blck = SE_QK, .q_offset = 8, .qs_offset = offsetof(se_blk_q4_0, qs) },
    [SE_Q4_1] = { .name = "q4_1", .blck = SE_QK, .size = sizeof(se_blk_q4_1), .act_type = SE_Q8_1,
                  .sub_blck = SE_QK, .has_min = 1, .qs_offset = offsetof(se_blk_q4_1, qs) },
    [SE_Q5_0] = { .name = "q5_0", .blck = SE_QK, .size = sizeof(se_blk_q5_0), .act_type = SE_Q8_0,
                  .sub_blck = SE_QK, .q_offset = 16, .qs_offset = offsetof(se_blk_q5_0, qs),
                  .qh_offset = offsetof(se_blk_q5_0, qh) },
    [SE_Q5_1] = { .name = "q5_1", .blck = SE_QK, .size = sizeof(se_blk_q5_1), .act_type = SE_Q8_1,
                  .sub_blck = SE_QK, .has_min = 1, .qs_offset = offsetof(se_blk_q5_1, qs),
                  .qh_offset = offsetof(se_blk_q5_1, qh) },
    [SE_Q8_0] = { .name = "q8_0", .blck = SE_QK, .size = sizeof(se_blk_q8_0), .act_type = SE_Q8_0,
                  .sub_blck = SE_QK, .q_offset = 128, .qs_offset = offsetof(se_blk_q8_0, qs) },
    [SE_Q8_1] = { .name = "q8_1", .blck = SE_QK, .size = sizeof(se_blk_q8_1), .act_type = SE_Q8_1,
                  .sub_blck = SE_QK, .qs_offset = offsetof(se_blk_q8_1, qs) },
    [SE_Q2_K] = { .name = "q2_K", .blck = SE_QK_K, .size = sizeof(se_blk_q2_K), .act_type = SE_Q8_K,
                  .sub_blck = 16, .has_min = 1, .qs_offset = offsetof(se_blk_q2_K, qs) },
    [SE_Q3_K] = { .name = "q3_K", .blck = SE_QK_K, .size = sizeof(se_blk_q3_K), .act_type = SE_Q8_K,
                  .sub_blck = 16, .q_offset = 4, .qs_offset = offsetof(se_blk_q3_K, qs) },
    [SE_Q4_K] = { .name = "q4_K", .blck = SE_QK_K, .size = sizeof(se_blk_q4_K), .act_type = SE_Q8_K,
                  .sub_blck = 32, .has_min = 1, .qs_offset = offsetof(se_blk_q4_K, qs) },
    [SE_Q5_K] = { .name = "q5_K", .blck = SE_QK_K, .size = sizeof(se_blk_q5_K), .act_type = SE_Q8_K,
                  .sub_blck = 32, .has_min = 1, .qs_offset = offsetof(se_blk_q5_K, qs),
                  .qh_offset = offsetof(se_blk_q5_K, qh) },
    [SE_Q6_K] = { .name = "q6_K", .blck = SE_QK_K, .size = sizeof(se_blk_q6_K), .act_type = SE_Q8_K,
                  .sub_blck = 16, .q_offset = 32, .qs_offset = offsetof(se_blk_q6_K, ql),
                  .qh_offset = offsetof(se_blk_q6_K, qh) },
    [SE_Q8_K] = { .name = "q8_K", .blck = SE_QK_K, .size = sizeof(se_blk_q8_K), .act_type = SE_Q8_K,
                  .sub_blck = SE_QK_K, .qs_offset = offsetof(se_blk_q8_K, qs) },
};

/* nr weight rows (w, w + w_stride, ...) against nc activation rows (a, a + a_stride, ...):
 * out[r * nc + c]. se_matmul asks for nr = tg_rows (or 1) with nc == 1 (token generation: rows
 * share the activation loads) and nr = pp_rows (or 1) with nc <= 4 (prompts: each weight block
 * is unpacked once for 4 tokens); each ISA file lists exactly those shapes (SE_SHAPE). */
typedef void (*se_tile_fn)(int64_t n, const void *w, size_t w_stride, int nr, const void *a, size_t a_stride,
                           int nc, float *out);
/* The whole of se_matmul for a batch of at least se_gemm_min_tokens() tokens (see se_matmul);
 * returns 0, or -1 (nothing written) when out of memory for its scratch. */
typedef int (*se_gemm_fn)(int64_t k, const void *W, size_t wrow, const void *act, size_t arow, int n_tok,
                           float *y, int64_t ldy, int64_t r0, int64_t r1);
/* From this many tokens on the GEMM (its panel of 16 unpacked weight rows serves every token)
 * takes a batch; below, the small-batch path where the ISA has one, else the tiles.
 * Batched decoding (se_decode_batch) makes steps of one token per sequence, so 2 to 15 rows are
 * the common case of a busy server. Measured (AMD Zen 4, 2 threads, in-process batched decoding):
 * the small-batch path beats the GEMM by 1.3-1.4x on steps of 8 and breaks even at 16. */
#define SE_GEMM_MIN_TOKENS 16
/* AMX's GEMM rebuilds its int8 panels from the weights on every call; the packed panels (below)
 * are built once. Measured (Intel Xeon Emerald Rapids, 2 threads, SmolLM2's Q4_1 layers and Q8_0
 * head), the packed panels against the tiles: in-process batched decoding, steps of 16 / 24 /
 * 32 / 48 sequences 1.26x / 1.17x / 1.04x / 0.98x; one prompt of 16 / 24 / 31 tokens 1.29x /
 * 1.17x / 1.05x. So on AMX the packed panels take batches below this. */
#define SE_AMX_PANELS_MAX_TOKENS 32
/* How far ahead of the rows being computed the weights are asked for (se_matmul's one-token path,
 * the GEMM's batches of a few tokens): the hardware prefetcher alone leaves the core waiting. */
#define SE_PREFETCH_BYTES 16384

typedef struct {
    se_dot_fn dot;
    se_tile_fn tile;
    int tg_rows, pp_rows;
    se_from_float_fn from_float; /* activation types: must give the scalar code's bytes exactly */
    se_gemm_fn gemm;             /* optional: batches of se_gemm_min_tokens() or more */
    se_gemm_fn small;            /* optional: batches of 2 to se_gemm_min_tokens() - 1 tokens (the
                                  * steps of batched decoding): each weight block unpacked once for
                                  * up to 8 tokens, the one-token path's prefetch; same contract */
    /* optional: batches of 2 or more on the weights' packed panels P, made by pack (se_gemm_fn's
     * contract with the type first; r0 a multiple of 16) */
    int (*panels)(int type, int64_t k, const void *P, size_t wrow, const void *act, size_t arow, int n_tok, float *y,
                  int64_t ldy, int64_t r0, int64_t r1);
    void (*pack)(int type, const void *W, int64_t k, int64_t rows, void *P);
} se_isa_kernels;

/* A buffer of at least n bytes (64-byte aligned) owned by the calling thread, reused by its next
 * call and freed when the thread ends; NULL if out of memory. */
void *se_thread_scratch(size_t n);

/* Indexed by weight type; NULL entries fall back to the scalar code. AMX's table has only GEMMs:
 * the rest of each entry is AVX-512's (kernels.c layers the tables). */
extern const se_isa_kernels se_kernels_avx2[SE_TYPE_COUNT];
extern const se_isa_kernels se_kernels_avx512[SE_TYPE_COUNT];
extern const se_isa_kernels se_kernels_amx[SE_TYPE_COUNT];
/* 1 when this CPU has AMX-TILE and AMX-INT8 and Linux let the process use the tile data (asked
 * once, on the first call: arch_prctl(ARCH_REQ_XCOMP_PERM)); 0 otherwise, and off x86. */
int se_amx_usable(void);

void se_get_scale_min_k4(int j, const uint8_t *s, uint8_t *sc, uint8_t *m);

/* Q2_K and Q3_K quants, shared by every path: element e = 128h + 32j + l (h < 2, j < 4, l < 32)
 * has its low 2 bits at bits 2j..2j+1 of qs[32h + l] and (Q3_K) its high bit at bit 4h + j of
 * hmask[l]. The 16 six-bit scales of Q3_K, as the signed scale (stored - 32): scale i takes its
 * low 4 bits from byte i (i < 8) or the high nibble of byte i - 8, and its top 2 bits from bits
 * 2(i/4)..2(i/4)+1 of byte 8 + i%4; done here on 32-bit words, four scales at a time. */
static inline void se_q3_K_scale_words(const uint8_t *s, uint32_t w[4]) { /* the stored scales (0..63) */
    uint32_t a, b, c;
    memcpy(&a, s, 4), memcpy(&b, s + 4, 4), memcpy(&c, s + 8, 4);
    const uint32_t lo4 = 0x0f0f0f0f, lo2 = 0x03030303;
    w[0] = (a & lo4) | (c & lo2) << 4;
    w[1] = (b & lo4) | (c >> 2 & lo2) << 4;
    w[2] = (a >> 4 & lo4) | (c >> 4 & lo2) << 4;
    w[3] = (b >> 4 & lo4) | (c >> 6 & lo2) << 4;
}
static inline void se_q3_K_scales(const uint8_t *s, int8_t out[16]) {
    uint32_t w[4];
    uint8_t u[16];
    se_q3_K_scale_words(s, w);
    memcpy(u, w, 16);
    for (int i = 0; i < 16; i++) out[i] = (int8_t)(u[i] - 32);
}

/* A tile shape (nr rows x nc tokens) as one number, for the ISA files' shape switches. Each ISA
 * family lists the shapes se_matmul asks of its table entries (tg_rows x 1, pp_rows x 1..4 and
 * 1 x 1..4); an unlisted one is a bug in the table, which se_bad_tile_shape reports before it
 * aborts. */
#define SE_SHAPE(nr, nc) ((nr) * 8 + (nc))
__attribute__((noreturn, cold)) void se_bad_tile_shape(const char *isa, int type, int nr, int nc);
#endif

#endif
