/* Weight quantizers: float rows -> ggml blocks, for `infer quantize` (spec/quantize.md).
 *
 * Each type's quantizer fits, block by block, the integers and scales (and mins) that minimise the
 * weighted squared error sum_i w_i (x_i - x̂_i)^2, where w_i is the imatrix entry of the element's
 * column (the mean squared activation it meets), or 1 without an imatrix. It also reports x̂, the values the written blocks decode to
 * (computed in the order gguf.quants dequantizes, so tests compare them bit for bit).
 *
 * Separate from the kernels' trait table (kernels.h): these are slow, careful searches run once per
 * model, not the activation quantizers of the forward pass.
 */
#ifndef SE_QUANTIZE_H
#define SE_QUANTIZE_H

#include <stdint.h>

#ifndef SE_API
#define SE_API __attribute__((visibility("default")))
#endif

/* 1 when se_quantize_weights can write this ggml type id, else 0. */
SE_API int se_quantize_supported(int type);

/* Quantize nrows rows of n_per_row floats (row stride n_per_row) into dst (rows of
 * se_row_size(type, n_per_row) bytes), on n_threads threads. imatrix: NULL, or n_per_row
 * importances (one per column, >= 0). decoded: NULL, or nrows*n_per_row floats that receive the
 * values the blocks decode to. Returns 0; -1 for an unsupported type or a row length that is not a
 * whole number of blocks; -2 when threads cannot be started. */
SE_API int se_quantize_weights(int type, const float *x, int64_t nrows, int64_t n_per_row,
                              const float *imatrix, void *dst, float *decoded, int n_threads);

#endif
