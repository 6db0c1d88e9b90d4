#include "cuda/gemm/expert_bias.h"

#include <cuda_bf16.h>

#include <algorithm>

#include "cuda/common/cuda_check.h"
#include "cuda/common/dtype_cuda.cuh"
#include "epx/error.h"

namespace epx::cuda {
namespace {

// Expert g = blockIdx.y; its real rows strided over blockIdx.x, columns over the threads.
__global__ void add_group_bias_kernel(int64_t cols, const int32_t* offsets, const int32_t* rows,
                                      const __nv_bfloat16* bias, __nv_bfloat16* y) {
  const int g = blockIdx.y;
  const int64_t begin = offsets[g], end = begin + rows[g];
  const __nv_bfloat16* b = bias + g * cols;
  for (int64_t r = begin + blockIdx.x; r < end; r += gridDim.x)
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      y[r * cols + c] = __float2bfloat16_rn(__bfloat162float(y[r * cols + c]) + __bfloat162float(b[c]));
}

// Expert g = blockIdx.y, column c = one thread; rows ascending (a warp reads 32 adjacent columns of
// a row: coalesced).
template <class Out>
__global__ void group_column_sums_kernel(const __nv_bfloat16* src, int64_t ld, int64_t cols, const int32_t* offsets,
                                         const int32_t* rows, bool accumulate, Out* out) {
  const int g = blockIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int n = rows[g];
  if (accumulate && n == 0) return;
  const int64_t begin = offsets[g];
  float s = 0.0f;
  for (int64_t r = begin; r < begin + n; ++r) s += __bfloat162float(src[r * ld + c]);
  Out* o = out + g * cols + c;
  *o = from_float<Out>(accumulate ? to_float(*o) + s : s);
}

}  // namespace

void add_group_bias(int64_t cols, int64_t total_rows, const int32_t* offsets, const int32_t* rows, int G,
                    const void* bias, void* y, cudaStream_t s) {
  if (G == 0 || total_rows == 0 || cols == 0) return;
  // About four rows a block on average (the group sizes stay on the device).
  const int per_group = static_cast<int>(std::clamp<int64_t>(total_rows / (4 * static_cast<int64_t>(G)), 1, 64));
  add_group_bias_kernel<<<dim3(per_group, G), 256, 0, s>>>(cols, offsets, rows, static_cast<const __nv_bfloat16*>(bias),
                                                           static_cast<__nv_bfloat16*>(y));
  EPX_CHECK_LAUNCH("add_group_bias_kernel");
}

void group_column_sums(const void* src, int64_t ld, int64_t cols, const int32_t* offsets, const int32_t* rows, int G,
                       bool accumulate, const TensorRef& out, cudaStream_t s) {
  if (G == 0 || cols == 0) return;
  const dim3 grid(static_cast<unsigned>((cols + 255) / 256), G);
  const auto* in = static_cast<const __nv_bfloat16*>(src);
  if (out.dtype() == DType::kF32)
    group_column_sums_kernel<<<grid, 256, 0, s>>>(in, ld, cols, offsets, rows, accumulate, out.ptr<float>());
  else if (out.dtype() == DType::kBF16)
    group_column_sums_kernel<<<grid, 256, 0, s>>>(in, ld, cols, offsets, rows, accumulate,
                                                  static_cast<__nv_bfloat16*>(out.data()));
  else
    throw Error(Status::kNotSupported, detail::concat("epx::group_column_sums: out has dtype ", dtype_name(out.dtype()),
                                                      ", expected fp32 or bf16"));
  EPX_CHECK_LAUNCH("group_column_sums_kernel");
}

}  // namespace epx::cuda
