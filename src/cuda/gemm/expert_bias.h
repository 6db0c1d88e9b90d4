// Expert biases on the expert-major rows of the GPU FFN: b_out added to FC2's real rows, and the
// bias gradients as per-expert column sums over the real rows (b_in is added inside the activation
// kernel, to the finished FC1 sums). Each sum runs over the expert's rows in ascending order in
// fp32, one thread per (expert, column): deterministic, and the reference's order.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "epx/tensor.h"

namespace epx::cuda {

/// y[r, :] = round(y[r, :] + bias[g, :]) on the real rows of each expert g (bf16 y [rows, cols],
/// bias [G, cols]); padding rows are not touched.
void add_group_bias(int64_t cols, int64_t total_rows, const int32_t* offsets, const int32_t* rows, int G,
                    const void* bias, void* y, cudaStream_t s);

/// out [G, cols] (fp32 or bf16) = round(sum over the real rows r of expert g of src[r * ld + c])
/// with src bf16; with accumulate round(out + that sum), an expert without rows keeping out[g, :].
void group_column_sums(const void* src, int64_t ld, int64_t cols, const int32_t* offsets, const int32_t* rows, int G,
                       bool accumulate, const TensorRef& out, cudaStream_t s);

}  // namespace epx::cuda
