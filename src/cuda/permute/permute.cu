// Launchers of the one-GPU row movers (kernels: permute_kernels.cuh). Vector width: 16 bytes when
// rows and base pointers allow it, else the element size.
#include "cuda/permute/permute.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/cuda_check.h"
#include "cuda/permute/permute_kernels.cuh"

namespace epx::cuda {
namespace {

permute::Layout layout_of(const HandleState& h) {
  permute::Layout L;
  L.T = h.num_tokens;
  L.K = h.topk;
  L.Le = h.local_experts;
  L.routed = h.routed_experts.ptr<int32_t>();
  L.pair_pos = h.pair_pos.ptr<int32_t>();
  L.offsets = h.expert_offsets.ptr<int32_t>();
  L.expert_rows = h.expert_rows.ptr<int32_t>();
  L.recv_row = h.recv_row.ptr<int32_t>();
  return L;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

int grid_for(int64_t items) {
  const int64_t per_block = permute::kWarps;
  const int64_t want = (items + per_block - 1) / per_block;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, static_cast<int64_t>(sm_count()) * 16)));
}

template <class F>
void with_element(DType dt, F&& f) {
  switch (dt) {
    case DType::kF32: f(float{}); break;
    case DType::kBF16: f(__nv_bfloat16{}); break;
    case DType::kF16: f(__half{}); break;
    default:
      throw Error(Status::kNotSupported, detail::concat("epx: the CUDA combine supports fp32, bf16 and fp16 rows, not ",
                                                        dtype_name(dt)));
  }
}

void check_topk(const HandleState& h, const char* fn) {
  require_status(h.topk <= kPermuteMaxTopk, Status::kNotSupported, fn, "top-k is ", h.topk,
                 "; the CUDA kernels support up to ", kPermuteMaxTopk);
}

}  // namespace

void permute_forward(HandleState& h, const TensorRef& x, const TensorRef& x_scales, const TensorRef& topk_weights,
                     const TensorRef& recv_x, const TensorRef& recv_scales, const TensorRef& recv_weights,
                     int64_t recv_capacity_rows, Stream stream) {
  check_topk(h, "epx::dispatch_forward");
  permute::PermuteArgs a;
  a.L = layout_of(h);
  a.capacity = recv_capacity_rows;
  a.x = static_cast<const char*>(x.data());
  a.row_bytes = x.size(1) * static_cast<int64_t>(dtype_size(x.dtype()));
  a.x_scales = x_scales.defined() ? static_cast<const char*>(x_scales.data()) : nullptr;
  a.scale_bytes = x_scales.defined() ? x_scales.size(1) * static_cast<int64_t>(dtype_size(x_scales.dtype())) : 0;
  a.topk_weights = topk_weights.defined() ? topk_weights.ptr<float>() : nullptr;
  a.recv = static_cast<char*>(recv_x.data());
  a.recv_scales = recv_scales.defined() ? static_cast<char*>(recv_scales.data()) : nullptr;
  a.recv_weights = recv_weights.defined() ? recv_weights.ptr<float>() : nullptr;
  const int grid = grid_for(static_cast<int64_t>(h.num_tokens) + h.local_experts);
  cudaStream_t s = to_cuda(stream);
  if (a.row_bytes % 16 == 0 && aligned16(a.x) && aligned16(a.recv)) {
    permute::permute_kernel<uint4><<<grid, permute::kThreads, 0, s>>>(a);
  } else if (a.row_bytes % 4 == 0 && (reinterpret_cast<uintptr_t>(a.x) & 3) == 0 &&
             (reinterpret_cast<uintptr_t>(a.recv) & 3) == 0) {
    permute::permute_kernel<uint32_t><<<grid, permute::kThreads, 0, s>>>(a);
  } else {
    permute::permute_kernel<uint8_t><<<grid, permute::kThreads, 0, s>>>(a);
  }
  EPX_CHECK_LAUNCH("permute_kernel");
}

namespace {

template <class T>
void launch_reduce(const permute::ReduceArgs& a, cudaStream_t s) {
  const int grid = grid_for(a.L.T);
  constexpr int N = 16 / sizeof(T);
  if (a.H % N == 0 && aligned16(a.rows_in) && aligned16(a.out))
    permute::reduce_rows_kernel<T, N><<<grid, permute::kThreads, 0, s>>>(a);
  else
    permute::reduce_rows_kernel<T, 1><<<grid, permute::kThreads, 0, s>>>(a);
  EPX_CHECK_LAUNCH("reduce_rows_kernel");
}

template <class T, int KMAX>
void launch_spread_k(const permute::SpreadArgs& a, int grid, bool vec, cudaStream_t s) {
  constexpr int N = 16 / sizeof(T);
  if (vec)
    permute::spread_rows_kernel<T, N, KMAX><<<grid, permute::kThreads, 0, s>>>(a);
  else
    permute::spread_rows_kernel<T, 1, KMAX><<<grid, permute::kThreads, 0, s>>>(a);
  EPX_CHECK_LAUNCH("spread_rows_kernel");
}

template <class T>
void launch_spread(const permute::SpreadArgs& a, cudaStream_t s) {
  const int grid = grid_for(static_cast<int64_t>(a.L.T) + a.L.Le);
  constexpr int N = 16 / sizeof(T);
  const bool vec = a.H % N == 0 && aligned16(a.d_out) && aligned16(a.d_y) && (!a.y || aligned16(a.y));
  if (a.L.K <= 8) launch_spread_k<T, 8>(a, grid, vec, s);
  else if (a.L.K <= 16) launch_spread_k<T, 16>(a, grid, vec, s);
  else launch_spread_k<T, 32>(a, grid, vec, s);
}

}  // namespace

void unpermute_forward(const HandleState& h, const TensorRef& y, const TensorRef& row_weights, const TensorRef& out,
                       Stream stream) {
  check_topk(h, "epx::combine_forward");
  permute::ReduceArgs a{};
  a.L = layout_of(h);
  a.H = y.size(1);
  a.rows_in = y.data();
  a.row_weights = row_weights.defined() ? row_weights.ptr<float>() : nullptr;
  a.out = out.data();
  with_element(y.dtype(), [&](auto tag) { launch_reduce<decltype(tag)>(a, to_cuda(stream)); });
}

void unpermute_backward(const HandleState& h, const TensorRef& d_recv_x, const TensorRef& d_recv_weights,
                        const TensorRef& d_x, const TensorRef& d_topk_weights, Stream stream) {
  check_topk(h, "epx::dispatch_backward");
  permute::ReduceArgs a{};
  a.L = layout_of(h);
  a.H = d_recv_x.size(1);
  a.rows_in = d_recv_x.data();
  a.out = d_x.data();
  a.d_row_in = d_recv_weights.defined() ? d_recv_weights.ptr<float>() : nullptr;
  a.d_topk_weights = d_topk_weights.defined() ? d_topk_weights.ptr<float>() : nullptr;
  with_element(d_recv_x.dtype(), [&](auto tag) { launch_reduce<decltype(tag)>(a, to_cuda(stream)); });
}

void permute_backward(const HandleState& h, const TensorRef& d_out, const TensorRef& y, const TensorRef& row_weights,
                      const TensorRef& d_y, const TensorRef& d_row_weights, Stream stream) {
  check_topk(h, "epx::combine_backward");
  permute::SpreadArgs a{};
  a.L = layout_of(h);
  a.H = d_out.size(1);
  a.d_out = d_out.data();
  a.y = d_row_weights.defined() ? y.data() : nullptr;
  a.row_weights = row_weights.defined() ? row_weights.ptr<float>() : nullptr;
  a.d_y = d_y.data();
  a.d_row_weights = d_row_weights.defined() ? d_row_weights.ptr<float>() : nullptr;
  with_element(d_out.dtype(), [&](auto tag) { launch_spread<decltype(tag)>(a, to_cuda(stream)); });
}

}  // namespace epx::cuda
