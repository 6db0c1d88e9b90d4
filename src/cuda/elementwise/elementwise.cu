// Memory-bound elementwise kernels: each thread loads its elements through the dtype code (a
// uniform branch), computes in fp32 (fp64 when either input is fp64, matching the reference) and
// stores with round-to-nearest-even.
#include "cuda/elementwise/elementwise.h"

#include <algorithm>

#include "cuda/common/cuda_check.h"
#include "cuda/common/dtype_cuda.cuh"

namespace epx::cuda {
namespace {

__device__ __forceinline__ double load_any(const void* p, int code, int64_t i) {
  switch (code) {
    case 0: return static_cast<const float*>(p)[i];
    case 1: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case 2: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const double*>(p)[i];
  }
}

__device__ __forceinline__ void store_any(void* p, int code, int64_t i, double v, bool wide) {
  switch (code) {
    case 0: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case 1: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(static_cast<float>(v)); break;
    case 2: static_cast<__half*>(p)[i] = __float2half_rn(static_cast<float>(v)); break;
    default: static_cast<double*>(p)[i] = v; break;
  }
  (void)wide;
}

__global__ void add_kernel(const void* a, int ca, const void* b, int cb, void* out, int co, int64_t n, bool wide) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double x = load_any(a, ca, i), y = load_any(b, cb, i);
    const double s = wide ? x + y : static_cast<double>(static_cast<float>(x) + static_cast<float>(y));
    store_any(out, co, i, s, wide);
  }
}

__global__ void cast_kernel(const void* src, int cs, void* dst, int cd, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store_any(dst, cd, i, load_any(src, cs, i), true);
}

int code_of(DType t) {
  switch (t) {
    case DType::kF32: return 0;
    case DType::kBF16: return 1;
    case DType::kF16: return 2;
    case DType::kF64: return 3;
    default:
      throw Error(Status::kNotSupported, detail::concat("epx: elementwise ops take fp32, bf16, fp16 or fp64, not ",
                                                        dtype_name(t)));
  }
}

int grid_for(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, int64_t(sm_count()) * 8)));
}

}  // namespace

void add(const TensorRef& a, const TensorRef& b, const TensorRef& out, Stream stream) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const bool wide = a.dtype() == DType::kF64 || b.dtype() == DType::kF64 || out.dtype() == DType::kF64;
  add_kernel<<<grid_for(n), 256, 0, to_cuda(stream)>>>(a.data(), code_of(a.dtype()), b.data(), code_of(b.dtype()),
                                                       out.data(), code_of(out.dtype()), n, wide);
  EPX_CHECK_LAUNCH("add_kernel");
}

void cast(const TensorRef& src, const TensorRef& dst, Stream stream) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  cast_kernel<<<grid_for(n), 256, 0, to_cuda(stream)>>>(src.data(), code_of(src.dtype()), dst.data(),
                                                        code_of(dst.dtype()), n);
  EPX_CHECK_LAUNCH("cast_kernel");
}

}  // namespace epx::cuda
