// Dense GEMM on the GPU through cuBLASLt (the gate projection, shared experts).
#pragma once

#include "epx/tensor.h"

namespace epx::cuda {

/// c [M, N] = op(a) . op(b) (+ c), row-major, fp32 accumulation; arguments validated by epx::gemm.
void dense_gemm(const TensorRef& a, const TensorRef& b, const TensorRef& c, bool transpose_a, bool transpose_b,
                bool accumulate, Stream stream);

}  // namespace epx::cuda
