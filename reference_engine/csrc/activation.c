/* The gated feed-forward's activation along a row: g[i] = act(g[i]) * u[i], SiLU or GELU's tanh
 * approximation (blocks.h gives both as x / (1 + e^z)), at the SIMD level the matmul kernels use
 * (se_isa_in_use()). The portable level calls libm's expf per element; the vector levels take e^z
 * from vexp.h (within 2 ulp of expf): libm's expf and the scalar loop around it were 5% of a step
 * of 8 SmolLM2 contexts, which now runs 4% faster (Gemma-3's 6%; Zen 4). A row's last partial
 * vector goes through the same code as the others (copied into a full one): every element gets
 * the same arithmetic wherever the threads' shares of the row start, so the bits depend on the
 * SIMD level only. */
#define SE_ENGINE_INTERNAL
#include "blocks.h"
#include "kernels.h"
#include <math.h>
#include <string.h>

#define SE_INLINE static inline __attribute__((always_inline))

static void glu_portable(se_ffn_act act, float *g, const float *u, int64_t n) {
    if (act == SE_FFN_SILU)
        for (int64_t i = 0; i < n; i++) g[i] = se_silu(g[i]) * u[i];
    else
        for (int64_t i = 0; i < n; i++) g[i] = se_gelu_tanh(g[i]) * u[i];
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#pragma GCC diagnostic ignored "-Wpsabi" /* wide vectors returned from inlined helpers */
#define ACT_CAT_(a, b) a##b
#define ACT_CAT(a, b) ACT_CAT_(a, b)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define ACT_VL 8
#define ACT_ISA _avx2
#define ACT_FMA(a, b, c) ((vf)_mm256_fmadd_ps((a), (b), (c)))
#include "activation_kernel.h"
#undef ACT_VL
#undef ACT_ISA
#undef ACT_FMA
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f")
#define ACT_VL 16
#define ACT_ISA _avx512
#define ACT_FMA(a, b, c) ((vf)_mm512_fmadd_ps((a), (b), (c)))
#include "activation_kernel.h"
#undef ACT_VL
#undef ACT_ISA
#undef ACT_FMA
#pragma GCC pop_options
#endif

void se_glu(se_ffn_act act, float *g, const float *u, int64_t n) {
    switch (se_isa_in_use()) {
#if defined(__x86_64__) && defined(__GNUC__)
    case SE_ISA_AVX2: glu_avx2(act, g, u, n); break;
    case SE_ISA_AVX512:
    case SE_ISA_AMX: glu_avx512(act, g, u, n); break;
#endif
    default: glu_portable(act, g, u, n); break;
    }
}
