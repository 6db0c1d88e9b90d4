// Operand preparation for grouped_forward_fp8_blockwise (layouts in grouped_gemm_cuda.h).
#pragma once

#include <cstdint>

#include "epx/dtype.h"
#include "epx/tensor.h"

namespace epx::cuda {

/// w [G, K, N] (fp32, bf16 or fp16; K and N multiples of 128) -> w_q [G, N, K] e4m3 (transposed)
/// and w_scales [G, K/128, N/128] fp32: epx/quant.h's 128x128 FP8 block recipe of each w[g],
/// bit for bit, written K-major.
void quantize_transpose_weights_fp8(const void* w, DType dtype, int64_t G, int64_t K, int64_t N, void* w_q,
                                    float* w_scales, Stream stream);

/// quantize()'s 1x128 scales [total_rows, k_blocks] -> one M-major block per group: group g's real
/// row r, block j at grouped[offsets[g] * k_blocks + j * rows[g] + (r - offsets[g])]. Rows outside
/// every group's real rows (padding, past offsets[groups]) are not read.
void group_activation_scales(const float* rowwise, float* grouped, int64_t total_rows, int64_t k_blocks,
                             const int32_t* offsets, const int32_t* rows, int groups, Stream stream);

/// quantize()'s 1x128 scales [total_rows, k_blocks] -> M-major over every row: row r, block j at
/// mmajor[j * padded_rows + r]; rows from total_rows to padded_rows (>= total_rows) get 0.
void transpose_activation_scales(const float* rowwise, float* mmajor, int64_t total_rows, int64_t padded_rows,
                                 int64_t k_blocks, Stream stream);

}  // namespace epx::cuda
