// Memory-bound elementwise kernels: each thread loads its elements through the dtype code (a
// uniform branch), computes in fp32 (fp64 when either input is fp64, matching the reference) and
// stores with round-to-nearest-even.
#include "cuda/elementwise/elementwise.h"

#include <algorithm>
#include <cstdint>

#include "cuda/common/cuda_check.h"
#include "cuda/common/dtype_cuda.cuh"
#include "core/random.h"

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

// out = a + b [+ c], summed left to right in fp32 (fp64 when wide); c may be null.
__global__ void add_kernel(const void* a, int ca, const void* b, int cb, const void* c, int cc, void* out, int co,
                           int64_t n, bool wide) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double x = load_any(a, ca, i), y = load_any(b, cb, i);
    double s = wide ? x + y : static_cast<double>(static_cast<float>(x) + static_cast<float>(y));
    if (c) {
      const double z = load_any(c, cc, i);
      s = wide ? s + z : static_cast<double>(static_cast<float>(s) + static_cast<float>(z));
    }
    store_any(out, co, i, s, wide);
  }
}

// The fast path of add and cast for fp32 and bf16 tensors: 8 elements per thread through one
// access per operand (32 or 16 bytes), the same fp32 arithmetic as the generic kernels, so the
// same bits. The generic kernels move 2 to 4 bytes per access and reach a third of HBM bandwidth.
template <typename T>
__device__ __forceinline__ void add_lanes(const void* p, int64_t i, float (&s)[8], bool first) {
  const Lanes<T, 8> x = static_cast<const Lanes<T, 8>*>(p)[i];
#pragma unroll
  for (int j = 0; j < 8; ++j) s[j] = first ? to_float(x.v[j]) : s[j] + to_float(x.v[j]);
}

// out = in0 [+ in1 [+ in2]] over n8 groups of 8 elements (N inputs).
template <int N, typename TO, typename T0, typename T1, typename T2>
__global__ void sum_lanes_kernel(const void* in0, const void* in1, const void* in2, void* out, int64_t n8) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s[8];
    add_lanes<T0>(in0, i, s, true);
    if constexpr (N > 1) add_lanes<T1>(in1, i, s, false);
    if constexpr (N > 2) add_lanes<T2>(in2, i, s, false);
    Lanes<TO, 8> o;
#pragma unroll
    for (int j = 0; j < 8; ++j) o.v[j] = from_float<TO>(s[j]);
    static_cast<Lanes<TO, 8>*>(out)[i] = o;
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

// Per-block partial sums of 0.5 * scale * d^2 with d = out - target; d_out = round(scale * d).
// The partials are summed by one block in block order, so the loss is the same bits every run.
__global__ void squared_error_kernel(const void* out, int co, const void* target, int ct, void* d_out, int cd,
                                     double scale, int64_t n, double* partials) {
  __shared__ double red[32];
  double acc = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double d = load_any(out, co, i) - load_any(target, ct, i);
    acc += d * d;
    store_any(d_out, cd, i, scale * d, true);
  }
  for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) s += red[w];
    partials[blockIdx.x] = 0.5 * scale * s;
  }
}

__global__ void sum_partials_kernel(const double* partials, int count, void* loss, int cl) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double s = 0;
  for (int i = 0; i < count; ++i) s += partials[i];
  store_any(loss, cl, 0, s, true);
}

__global__ void axpy_kernel(double alpha, const void* x, int cx, void* y, int cy, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store_any(y, cy, i, load_any(y, cy, i) + alpha * load_any(x, cx, i), true);
}

__global__ void fill_normal_kernel(void* t, int ct, uint64_t seed, uint64_t stream_id, double stddev,
                                   int64_t first_index, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store_any(t, ct, i, stddev * detail::counter_normal(seed, stream_id, static_cast<uint64_t>(first_index + i)), true);
}

// axpy's fast path: y = round(y + alpha * x) in fp64 as axpy_kernel computes it (fp64 holds every
// fp32/bf16 value exactly), 8 elements per access.
template <typename TX, typename TY>
__global__ void axpy_lanes_kernel(double alpha, const void* x, void* y, int64_t n8) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Lanes<TX, 8> xv = static_cast<const Lanes<TX, 8>*>(x)[i];
    Lanes<TY, 8> yv = static_cast<Lanes<TY, 8>*>(y)[i];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const double v = static_cast<double>(to_float(yv.v[j])) + alpha * static_cast<double>(to_float(xv.v[j]));
      yv.v[j] = from_float<TY>(static_cast<float>(v));
    }
    static_cast<Lanes<TY, 8>*>(y)[i] = yv;
  }
}

// Where add, cast and axpy take their 8-wide path: fp32 or bf16, 32-byte aligned.
bool takes_lanes(const TensorRef& t) {
  return (t.dtype() == DType::kF32 || t.dtype() == DType::kBF16) && reinterpret_cast<uintptr_t>(t.data()) % 32 == 0;
}

// The fast path's launch: picks each operand's type from its dtype (fp32 or bf16), padding the
// unused inputs with float.
template <int N, typename TO, typename... Ts>
void launch_sum_lanes(const TensorRef* const in[3], const TensorRef& out, int64_t n8, cudaStream_t s) {
  if constexpr (sizeof...(Ts) == 3) {
    sum_lanes_kernel<N, TO, Ts...><<<grid_for(n8), 256, 0, s>>>(in[0]->data(), N > 1 ? in[1]->data() : nullptr,
                                                               N > 2 ? in[2]->data() : nullptr, out.data(), n8);
    EPX_CHECK_LAUNCH("sum_lanes_kernel");
  } else if constexpr (sizeof...(Ts) >= N) {
    launch_sum_lanes<N, TO, Ts..., float>(in, out, n8, s);
  } else if (in[sizeof...(Ts)]->dtype() == DType::kF32) {
    launch_sum_lanes<N, TO, Ts..., float>(in, out, n8, s);
  } else {
    launch_sum_lanes<N, TO, Ts..., __nv_bfloat16>(in, out, n8, s);
  }
}

template <int N>
void launch_sum_lanes_into(const TensorRef* const in[3], const TensorRef& out, int64_t n8, cudaStream_t s) {
  if (out.dtype() == DType::kF32) launch_sum_lanes<N, float>(in, out, n8, s);
  else launch_sum_lanes<N, __nv_bfloat16>(in, out, n8, s);
}

// out = in[0] + ... + in[count-1] (count 1..3) on the fast path, where every dtype is fp32 or bf16,
// the element count a multiple of 8 and every pointer 32-byte aligned; false where it does not apply.
bool sum_lanes(const TensorRef* const in[3], int count, const TensorRef& out, cudaStream_t s) {
  const int64_t n = out.numel();
  if (n % 8 != 0 || !takes_lanes(out)) return false;
  for (int k = 0; k < count; ++k)
    if (!takes_lanes(*in[k])) return false;
  if (count == 1) launch_sum_lanes_into<1>(in, out, n / 8, s);
  else if (count == 2) launch_sum_lanes_into<2>(in, out, n / 8, s);
  else launch_sum_lanes_into<3>(in, out, n / 8, s);
  return true;
}

}  // namespace

void fill_normal(const TensorRef& t, uint64_t seed, uint64_t stream_id, double stddev, int64_t first_index,
                 Stream stream) {
  const int64_t n = t.numel();
  if (n == 0) return;
  fill_normal_kernel<<<grid_for(n), 256, 0, to_cuda(stream)>>>(t.data(), code_of(t.dtype()), seed, stream_id, stddev,
                                                               first_index, n);
  EPX_CHECK_LAUNCH("fill_normal_kernel");
}

void fill_zero(const TensorRef& t, Stream stream) {
  if (t.nbytes() == 0) return;
  EPX_CUDA_CHECK(cudaMemsetAsync(t.data(), 0, t.nbytes(), to_cuda(stream)));
}

void squared_error(const TensorRef& out, const TensorRef& target, double scale, const TensorRef& d_out,
                   const TensorRef& loss, Stream stream) {
  const int64_t n = out.numel();
  // A fixed grid (not one sized by the SM count) keeps the summation order, hence the bits, the
  // same on every GPU.
  constexpr int kBlocks = 264;
  static thread_local double* partials = nullptr;
  static thread_local int partials_device = -1;
  int dev = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  if (partials == nullptr || partials_device != dev) {
    EPX_CUDA_CHECK(cudaMalloc(&partials, kBlocks * sizeof(double)));
    partials_device = dev;
  }
  cudaStream_t s = to_cuda(stream);
  squared_error_kernel<<<kBlocks, 256, 0, s>>>(out.data(), code_of(out.dtype()), target.data(),
                                               code_of(target.dtype()), d_out.data(), code_of(d_out.dtype()), scale,
                                               n, partials);
  EPX_CHECK_LAUNCH("squared_error_kernel");
  sum_partials_kernel<<<1, 32, 0, s>>>(partials, kBlocks, loss.data(), code_of(loss.dtype()));
  EPX_CHECK_LAUNCH("sum_partials_kernel");
}

void axpy(double alpha, const TensorRef& x, const TensorRef& y, Stream stream) {
  const int64_t n = y.numel();
  if (n == 0) return;
  cudaStream_t s = to_cuda(stream);
  if (n % 8 == 0 && takes_lanes(x) && takes_lanes(y)) {
    const bool xf = x.dtype() == DType::kF32, yf = y.dtype() == DType::kF32;
    const int grid = grid_for(n / 8);
    if (xf && yf) axpy_lanes_kernel<float, float><<<grid, 256, 0, s>>>(alpha, x.data(), y.data(), n / 8);
    else if (xf) axpy_lanes_kernel<float, __nv_bfloat16><<<grid, 256, 0, s>>>(alpha, x.data(), y.data(), n / 8);
    else if (yf) axpy_lanes_kernel<__nv_bfloat16, float><<<grid, 256, 0, s>>>(alpha, x.data(), y.data(), n / 8);
    else axpy_lanes_kernel<__nv_bfloat16, __nv_bfloat16><<<grid, 256, 0, s>>>(alpha, x.data(), y.data(), n / 8);
    EPX_CHECK_LAUNCH("axpy_lanes_kernel");
    return;
  }
  axpy_kernel<<<grid_for(n), 256, 0, s>>>(alpha, x.data(), code_of(x.dtype()), y.data(), code_of(y.dtype()), n);
  EPX_CHECK_LAUNCH("axpy_kernel");
}

// add with an optional third operand (the two public overloads).
static void add_optional(const TensorRef& a, const TensorRef& b, const TensorRef* c, const TensorRef& out,
                         Stream stream) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const TensorRef* in[3] = {&a, &b, c};
  if (sum_lanes(in, c ? 3 : 2, out, to_cuda(stream))) return;
  const bool wide = a.dtype() == DType::kF64 || b.dtype() == DType::kF64 || out.dtype() == DType::kF64 ||
                    (c && c->dtype() == DType::kF64);
  add_kernel<<<grid_for(n), 256, 0, to_cuda(stream)>>>(a.data(), code_of(a.dtype()), b.data(), code_of(b.dtype()),
                                                       c ? c->data() : nullptr, c ? code_of(c->dtype()) : 0,
                                                       out.data(), code_of(out.dtype()), n, wide);
  EPX_CHECK_LAUNCH("add_kernel");
}

void add(const TensorRef& a, const TensorRef& b, const TensorRef& out, Stream stream) {
  add_optional(a, b, nullptr, out, stream);
}

void add(const TensorRef& a, const TensorRef& b, const TensorRef& c, const TensorRef& out, Stream stream) {
  add_optional(a, b, &c, out, stream);
}

void cast(const TensorRef& src, const TensorRef& dst, Stream stream) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  const TensorRef* in[3] = {&src, nullptr, nullptr};
  if (sum_lanes(in, 1, dst, to_cuda(stream))) return;
  cast_kernel<<<grid_for(n), 256, 0, to_cuda(stream)>>>(src.data(), code_of(src.dtype()), dst.data(),
                                                        code_of(dst.dtype()), n);
  EPX_CHECK_LAUNCH("cast_kernel");
}

}  // namespace epx::cuda
