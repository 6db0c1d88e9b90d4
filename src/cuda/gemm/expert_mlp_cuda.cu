// The expert FFN and the public grouped GEMMs on the GPU, composed from the CUTLASS grouped
// kernels (grouped_gemm_cuda.h) and small elementwise kernels.
//
// w_in is [G, H, P, F]: each expert's FC1 is one [H, P*F] matrix, so FC1, its dgrad and its
// wgrad are one grouped GEMM each whatever P is.
// Forward:  a = x . w_in [+ b_in] (bf16 [rows, P*F]) -> h = act(a) [* w_row] (bf16; padding rows
//           of a, h and y zeroed) -> y = h . w_out [+ b_out].
// Backward: d_h = d_y . w_out^T (bf16) -> d_a (bf16) and d_row_weights from the saved a ->
//           d_x = d_a . w_in^T (one GEMM over K = P*F, fp32 accumulation, rounded once) -> weight
//           gradients by grouped wgrad (fp32 or bf16 as d_w is, empty experts zero); bias
//           gradients as column sums of d_a and d_y over each expert's rows (expert_bias.h).
// Differences from the reference, within bf16 rounding: the activation reads the rounded a (the
// GEMM writes bf16; with b_in, the rounded a plus the bias), d_h and d_a are rounded where the
// reference keeps fp32, y is rounded before b_out joins it, and GEMM sums run in the tensor
// cores' order.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <mutex>

#include "core/device_memory.h"
#include "core/env_choice.h"
#include "cuda/common/cuda_check.h"
#include "cuda/common/dtype_cuda.cuh"
#include "cuda/common/stream_temp.h"
#include "cuda/gemm/expert_bias.h"
#include "cuda/gemm/expert_mlp_cuda.h"
#include "cuda/gemm/fp8_operands.h"
#include "cuda/gemm/grouped_gemm_cuda.h"
#include "cuda/quant/quant.h"
#include "epx/error.h"
#include "epx/quant.h"

namespace epx::cuda {
namespace {

// Group of an expert-major row by binary search over the padded offsets; -1 past offsets[G].
__device__ __forceinline__ int group_of(const int32_t* offsets, int G, int64_t r) {
  if (r >= offsets[G]) return -1;
  int lo = 0, hi = G - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

const __nv_bfloat16* bias_of(const TensorRef& b) {
  return b.defined() ? static_cast<const __nv_bfloat16*>(b.data()) : nullptr;
}

// The activation kernels are held by their instructions (bench/NOTES.md): the fast exponential and the
// hardware reciprocal (a few ulp of fp32 each, far under the bf16 rounding of the results; 1 / x is 0
// from x > 2^126 on, where the sigmoid is below 2^-126 anyway).
__device__ __forceinline__ float sigmoid(float z) { return __fdividef(1.0f, 1.0f + __expf(-z)); }
__device__ __forceinline__ float silu(float z) { return z * sigmoid(z); }
__device__ __forceinline__ float gelu_tanh(float z) {
  return 0.5f * z * (1.0f + tanhf(0.7978845608028654f * (z + 0.044715f * z * z * z)));
}

__device__ __forceinline__ float act_value(int f, float a0, float a1) {
  switch (f) {
    case 0: return silu(a0) * a1;
    case 1: return gelu_tanh(a0) * a1;
    case 2: return gelu_tanh(a0);
    default: {
      const float r = a0 > 0.0f ? a0 : 0.0f;
      return r * r;
    }
  }
}

// value and partial derivatives in a0, a1
__device__ __forceinline__ void act_grad(int f, float a0, float a1, float& v, float& d0, float& d1) {
  switch (f) {
    case 0: {
      const float s = sigmoid(a0);
      const float g = a0 * s;
      v = g * a1;
      d0 = a1 * s * (1.0f + a0 * (1.0f - s));
      d1 = g;
      return;
    }
    case 1:
    case 2: {
      const float c = 0.7978845608028654f, k = 0.044715f;
      const float t = tanhf(c * (a0 + k * a0 * a0 * a0));
      const float g = 0.5f * a0 * (1.0f + t);
      const float dg = 0.5f * (1.0f + t) + 0.5f * a0 * (1.0f - t * t) * c * (1.0f + 3.0f * k * a0 * a0);
      if (f == 2) {
        v = g;
        d0 = dg;
        d1 = 0.0f;
      } else {
        v = g * a1;
        d0 = dg * a1;
        d1 = g;
      }
      return;
    }
    default: {
      const float r = a0 > 0.0f ? a0 : 0.0f;
      v = r * r;
      d0 = 2.0f * r;
      d1 = 0.0f;
    }
  }
}

// The row kernels below are memory bound, and one 2-byte access per thread keeps too few bytes
// in flight to fill HBM (an H200 ran them at a quarter of its bandwidth that way): each thread
// moves kActLanes bf16 (16 bytes) at a time.
constexpr int kActLanes = 8;
using ActLanes = Lanes<__nv_bfloat16, kActLanes>;
__device__ __forceinline__ ActLanes load_act(const __nv_bfloat16* p) { return load_lanes<__nv_bfloat16, kActLanes>(p); }

__device__ __forceinline__ void zero_row(__nv_bfloat16* p, int64_t n) {
  ActLanes z;
#pragma unroll
  for (int j = 0; j < kActLanes; ++j) z.v[j] = __float2bfloat16_rn(0.0f);
  for (int64_t i = threadIdx.x * int64_t{kActLanes}; i < n; i += blockDim.x * int64_t{kActLanes})
    store_lanes(p + i, z);
}

// One block per row (grid-stride): activation, or zeros on padding rows. With b_in [G, P, F] the
// bias joins FC1's sums here: a = round(a + b_in) is what backward reads, the activation takes the
// unrounded sum. Each thread takes kActLanes consecutive columns (F and H multiples of it, rows
// 16-byte aligned: what the grouped GEMMs' TMA needs too). 256 threads, 4 blocks an SM (64 registers).
__global__ void __launch_bounds__(256, 4)
    act_forward_kernel(int f, int P, int64_t F, int64_t H, int64_t total_rows, const int32_t* offsets,
                       const int32_t* rows, int G, const float* row_weights, const __nv_bfloat16* b_in,
                       __nv_bfloat16* a, __nv_bfloat16* h, __nv_bfloat16* y) {
  const int64_t i0 = threadIdx.x * int64_t{kActLanes}, step = blockDim.x * int64_t{kActLanes};
  for (int64_t r = blockIdx.x; r < total_rows; r += gridDim.x) {
    __nv_bfloat16* ar = a + r * P * F;
    __nv_bfloat16* hr = h + r * F;
    // The row's first columns are requested before its group is looked up, so that the search's
    // dependent loads run under them (every row below total_rows lies inside a).
    ActLanes first0, first1;
    if (i0 < F) {
      first0 = load_act(ar + i0);
      first1 = P == 2 ? load_act(ar + F + i0) : first0;
    }
    const int g = group_of(offsets, G, r);
    if (g < 0) return;  // rows past offsets[G] are not ours (uniform per block)
    const bool real = r < offsets[g] + rows[g];
    if (!real) {
      zero_row(ar, P * F);
      zero_row(hr, F);
      zero_row(y + r * H, H);
      continue;
    }
    const float w = row_weights ? row_weights[r] : 1.0f;
    const __nv_bfloat16* br = b_in ? b_in + g * P * F : nullptr;
    for (int64_t i = i0; i < F; i += step) {
      ActLanes x0 = first0, x1 = first1, out;
      if (i != i0) {
        x0 = load_act(ar + i);
        x1 = P == 2 ? load_act(ar + F + i) : x0;
      }
      ActLanes b0, b1;
      if (br) {
        b0 = load_act(br + i);
        if (P == 2) b1 = load_act(br + F + i);
      }
#pragma unroll
      for (int j = 0; j < kActLanes; ++j) {
        float a0 = __bfloat162float(x0.v[j]);
        float a1 = P == 2 ? __bfloat162float(x1.v[j]) : 0.0f;
        if (br) {
          a0 += __bfloat162float(b0.v[j]);
          x0.v[j] = __float2bfloat16_rn(a0);
          if (P == 2) {
            a1 += __bfloat162float(b1.v[j]);
            x1.v[j] = __float2bfloat16_rn(a1);
          }
        }
        float v = act_value(f, a0, a1);
        if (row_weights) v *= w;
        out.v[j] = __float2bfloat16_rn(v);
      }
      if (br) {
        store_lanes(ar + i, x0);
        if (P == 2) store_lanes(ar + F + i, x1);
      }
      store_lanes(hr + i, out);
    }
  }
}

// One block per row: d_a from d_h and the saved a (d_a may alias a: each element is read before it
// is written, by the same thread); the row-weight gradient by a fixed block reduction; padding rows
// get d_row_weights 0 and d_a 0. kActLanes consecutive columns per thread, as in act_forward_kernel.
// weighted_h (combine_weight_grads): round(w * round(act)) for FC2's weight gradient, written over
// d_h (each lane reads its d_h elements before it writes them).
__global__ void act_backward_kernel(int f, int P, int64_t F, int64_t total_rows, const int32_t* offsets,
                                    const int32_t* rows, int G, const float* row_weights, const __nv_bfloat16* a,
                                    const __nv_bfloat16* d_h, __nv_bfloat16* d_a, float* d_row_weights,
                                    __nv_bfloat16* weighted_h) {
  __shared__ float red[32];
  const int64_t i0 = threadIdx.x * int64_t{kActLanes}, step = blockDim.x * int64_t{kActLanes};
  for (int64_t r = blockIdx.x; r < total_rows; r += gridDim.x) {
    const __nv_bfloat16* ar = a + r * P * F;
    __nv_bfloat16* dar = d_a + r * P * F;
    // As in act_forward_kernel: the first columns' loads before the group search.
    ActLanes first0, first1, first_dh;
    if (i0 < F) {
      first0 = load_act(ar + i0);
      first1 = P == 2 ? load_act(ar + F + i0) : first0;
      first_dh = load_act(d_h + r * F + i0);
    }
    const int g = group_of(offsets, G, r);
    if (g < 0) return;
    const bool real = r < offsets[g] + rows[g];
    const float w = row_weights && real ? row_weights[r] : 1.0f;
    float dw = 0.0f;
    for (int64_t i = i0; i < F; i += step) {
      ActLanes o0, o1, oh;
      if (real) {
        ActLanes x0 = first0, x1 = first1, dh = first_dh;
        if (i != i0) {
          x0 = load_act(ar + i);
          x1 = P == 2 ? load_act(ar + F + i) : x0;
          dh = load_act(d_h + r * F + i);
        }
#pragma unroll
        for (int j = 0; j < kActLanes; ++j) {
          const float a0 = __bfloat162float(x0.v[j]);
          const float a1 = P == 2 ? __bfloat162float(x1.v[j]) : 0.0f;
          float v, g0, g1;
          act_grad(f, a0, a1, v, g0, g1);
          float dact = __bfloat162float(dh.v[j]);
          if (row_weights) {
            dw = fmaf(dact, v, dw);
            dact *= w;
          }
          o0.v[j] = __float2bfloat16_rn(dact * g0);
          o1.v[j] = __float2bfloat16_rn(dact * g1);
          oh.v[j] = __float2bfloat16_rn(w * __bfloat162float(__float2bfloat16_rn(v)));
        }
      } else {
#pragma unroll
        for (int j = 0; j < kActLanes; ++j) o0.v[j] = o1.v[j] = oh.v[j] = __float2bfloat16_rn(0.0f);
      }
      store_lanes(dar + i, o0);
      if (P == 2) store_lanes(dar + F + i, o1);
      if (weighted_h) store_lanes(weighted_h + r * F + i, oh);
    }
    if (d_row_weights) {
      for (int m = 16; m > 0; m >>= 1) dw += __shfl_xor_sync(0xffffffffu, dw, m);
      if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = dw;
      __syncthreads();
      if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int i = 0; i < static_cast<int>(blockDim.x >> 5); ++i) s += red[i];
        d_row_weights[r] = real ? s : 0.0f;
      }
      __syncthreads();
    }
  }
}

// Zero on padding rows only (the grouped GEMMs write real rows).
__global__ void zero_padding_kernel(int64_t H, int64_t total_rows, const int32_t* offsets, const int32_t* rows, int G,
                                    __nv_bfloat16* out) {
  for (int64_t r = blockIdx.x; r < total_rows; r += gridDim.x) {
    const int g = group_of(offsets, G, r);
    if (g < 0) return;
    if (r < offsets[g] + rows[g]) continue;
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) out[r * H + i] = __float2bfloat16_rn(0.0f);
  }
}

// The wgrad kernels write every element of a group with rows; an empty group gets no tiles, so
// only those are zeroed here (a memset of the whole gradient would write gigabytes at large E).
// Works in 32-bit words: every group of an fp32 or bf16 gradient is a whole number of them (N % 8 == 0).
__global__ void zero_empty_groups_kernel(uint32_t* out, int64_t group_words, const int32_t* rows) {
  if (rows[blockIdx.y] != 0) return;
  uint32_t* o = out + static_cast<int64_t>(blockIdx.y) * group_words;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < group_words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    o[i] = 0u;
}

void zero_empty_groups(const TensorRef& out, int64_t group_elems, const int32_t* rows, int G, cudaStream_t s) {
  const int64_t words = group_elems * static_cast<int64_t>(dtype_size(out.dtype())) / 4;
  if (G == 0 || words == 0) return;
  const int per_group = static_cast<int>(std::min<int64_t>((words + 1023) / 1024, 64));
  zero_empty_groups_kernel<<<dim3(per_group, G), 256, 0, s>>>(static_cast<uint32_t*>(out.data()), words, rows);
  EPX_CHECK_LAUNCH("zero_empty_groups_kernel");
}

// Weight gradient of one grouped operand pair into fp32 or bf16 (the dtype of dw); beta 1 adds it
// to dw (MlpConfig::accumulate_weight_grads). row_capacity: the rows of the expert-major operands
// (the schedule choice's only view of the group sizes, which stay on the device).
void wgrad(GroupedOperand a, GroupedOperand d, const TensorRef& dw, int64_t elem_offset, int64_t group_stride,
           int64_t K, int64_t N, const int32_t* offsets, const int32_t* rows, int G, int64_t row_capacity, float beta,
           Stream stream) {
  WgradSchedule sched = wgrad_schedule();
  const bool large_groups = row_capacity >= kPingpongWgradMinRowsPerGroup * int64_t{G};
  if (dw.dtype() == DType::kF32) {
    float* out = dw.ptr<float>() + elem_offset;
    if (sched == WgradSchedule::kAuto)
      sched = beta == 0.0f && large_groups ? WgradSchedule::kPingpongNoSource : WgradSchedule::kPingpong;
    if ((sched == WgradSchedule::kPingpongNoSource || sched == WgradSchedule::kCoopTma) && beta == 0.0f)
      grouped_wgrad_f32_pingpong_nosource(a, d, out, group_stride, K, N, offsets, rows, G, stream);
    else if (sched == WgradSchedule::kCooperative || sched == WgradSchedule::kNoSource)
      grouped_wgrad_bf16(a, d, out, group_stride, K, N, offsets, rows, G, stream, beta);
    else
      grouped_wgrad_bf16_pingpong(a, d, out, group_stride, K, N, offsets, rows, G, stream, beta);
    return;
  }
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(dw.data()) + elem_offset;
  const bool tma_ok = wgrad_coop_tma_supports(out, N, group_stride);
  const bool short_groups = row_capacity < kCoopTmaWgradMaxRowsPerGroup * int64_t{G};
  if (sched == WgradSchedule::kAuto)
    sched = beta != 0.0f                ? WgradSchedule::kPingpong
            : tma_ok && short_groups    ? WgradSchedule::kCoopTma
            : large_groups              ? WgradSchedule::kPingpongNoSource
                                        : WgradSchedule::kNoSource;
  if (sched == WgradSchedule::kCoopTma && !tma_ok) sched = WgradSchedule::kPingpongNoSource;
  const bool no_source = sched == WgradSchedule::kNoSource || sched == WgradSchedule::kPingpongNoSource ||
                         sched == WgradSchedule::kCoopTma;
  if (no_source && beta != 0.0f) sched = WgradSchedule::kCooperative;  // they cannot add
  switch (sched) {
    case WgradSchedule::kCoopTma:
      grouped_wgrad_bf16_out_coop_tma(a, d, out, group_stride, K, N, offsets, rows, G, stream);
      break;
    case WgradSchedule::kPingpongNoSource:
      grouped_wgrad_bf16_out_pingpong_nosource(a, d, out, group_stride, K, N, offsets, rows, G, stream);
      break;
    case WgradSchedule::kNoSource:
      grouped_wgrad_bf16_out_nosource(a, d, out, group_stride, K, N, offsets, rows, G, stream);
      break;
    case WgradSchedule::kPingpong:
      grouped_wgrad_bf16_out_pingpong(a, d, out, group_stride, K, N, offsets, rows, G, stream, beta);
      break;
    case WgradSchedule::kCluster:
      grouped_wgrad_bf16_out_cluster(a, d, out, group_stride, K, N, offsets, rows, G, stream, beta);
      break;
    default:
      grouped_wgrad_bf16_out(a, d, out, group_stride, K, N, offsets, rows, G, stream, beta);
  }
}

// Scratch per device and slot, grown on demand (the first call of a size allocates; later calls
// and graph captures after a warm-up do not). Slots: 0 d_h, 1 d_a (bf16), 2 grouped FP8 scales,
// 3-10 the FP8 forward's operands (fp8_block_forward), 11 a dequantized fp8 x for the backward.
template <class T>
T* scratch(int slot, size_t elems) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::pair<void*, size_t>> cache;
  int dev = 0;
  EPX_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lk(mu);
  auto& e = cache[{dev, slot}];
  const size_t bytes = std::max<size_t>(elems, 1) * sizeof(T);
  if (e.second < bytes) {
    if (e.first) EPX_CUDA_CHECK(cudaFree(e.first));
    EPX_CUDA_CHECK(cudaMalloc(&e.first, bytes));
    e.second = bytes;
  }
  return static_cast<T*>(e.first);
}

int row_grid(int64_t rows) { return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(rows, sm_count() * 16))); }

// The activation kernels' 16-byte accesses need every row to start on a 16-byte boundary.
void require_16_byte_rows(const char* what, const void* p) {
  require(reinterpret_cast<uintptr_t>(p) % 16 == 0, "epx::expert_mlp", what, " starts at ", p,
          ", expected a 16-byte aligned address on the GPU (16-byte rows for the vector accesses and TMA)");
}

void act_forward(const MlpConfig& c, const MlpTensors& t, int64_t R, int64_t P, int64_t F, int64_t H, int G,
                 cudaStream_t s) {
  const int32_t* off = t.offsets.ptr<int32_t>();
  const int32_t* rows = t.rows.ptr<int32_t>();
  const float* w = c.apply_weights_early ? t.row_weights.ptr<float>() : nullptr;
  const __nv_bfloat16* b_in = bias_of(t.b_in);
  auto* a = static_cast<__nv_bfloat16*>(t.a.data());
  auto* h = static_cast<__nv_bfloat16*>(t.h.data());
  auto* y = static_cast<__nv_bfloat16*>(t.y.data());
  const int f = static_cast<int>(c.activation), p = static_cast<int>(P);
  require_16_byte_rows("a", a);
  require_16_byte_rows("h", h);
  require_16_byte_rows("y", y);
  require_16_byte_rows("b_in", b_in);
  act_forward_kernel<<<row_grid(R), 256, 0, s>>>(f, p, F, H, R, off, rows, G, w, b_in, a, h, y);
  EPX_CHECK_LAUNCH("act_forward_kernel");
}

void act_backward(const MlpConfig& c, const MlpTensors& t, const MlpGrads& d, __nv_bfloat16* d_h,
                  __nv_bfloat16* d_a, int64_t R, int64_t P, int64_t F, int G, cudaStream_t s) {
  const int32_t* off = t.offsets.ptr<int32_t>();
  const int32_t* rows = t.rows.ptr<int32_t>();
  const bool weighted = c.apply_weights_early || c.combine_weight_grads;
  const float* w = weighted ? t.row_weights.ptr<float>() : nullptr;
  float* d_w = weighted ? d.d_row_weights.ptr<float>() : nullptr;
  const auto* a = static_cast<const __nv_bfloat16*>(t.a.data());
  const int f = static_cast<int>(c.activation), p = static_cast<int>(P);
  require_16_byte_rows("a", a);
  require_16_byte_rows("d_h", d_h);
  require_16_byte_rows("d_a", d_a);
  act_backward_kernel<<<row_grid(R), 256, 0, s>>>(f, p, F, R, off, rows, G, w, a, d_h, d_a, d_w,
                                                  c.combine_weight_grads ? d_h : nullptr);
  EPX_CHECK_LAUNCH("act_backward_kernel");
}

void require_grouped_gemm(const char* fn) {
  require_status(grouped_gemm_available(), Status::kNotSupported, fn,
                 "this build has no GPU grouped GEMM (CUTLASS headers were not found at configure time)");
}

void require_bf16_path(const char* fn, const TensorRef& x, int64_t H, int64_t F) {
  require_grouped_gemm(fn);
  require_status(x.dtype() == DType::kBF16, Status::kNotSupported, fn, "x has dtype ", dtype_name(x.dtype()),
                 "; the GPU grouped GEMMs take bf16");
  require_status(H % 8 == 0 && F % 8 == 0, Status::kNotSupported, fn, "hidden ", H, " and ffn ", F,
                 " must be multiples of 8 on the GPU (16-byte rows for TMA)");
}

}  // namespace

WgradSchedule wgrad_schedule() {
  static const WgradSchedule chosen = [] {
    const WgradSchedule kinds[] = {WgradSchedule::kAuto, WgradSchedule::kCooperative,
                                   WgradSchedule::kPingpong, WgradSchedule::kCluster,
                                   WgradSchedule::kNoSource, WgradSchedule::kPingpongNoSource,
                                   WgradSchedule::kCoopTma};
    const int i = detail::env_choice("EPX_WGRAD_KERNEL", {"auto", "cooperative", "pingpong", "cluster", "nosource",
                                                          "pingpong_nosource", "coop_tma"});
    return i < 0 ? WgradSchedule::kAuto : kinds[i];
  }();
  return chosen;
}

// The FP8 block forward (DeepSeek-V3 recipe; semantics in epx/grouped_gemm.h, oracle
// ref::expert_mlp_forward): x quantized 1x128 here unless it arrives as fp8 with its scales, both
// weights quantized 128x128 and transposed (into per-device scratch, on every call, unless the
// caller passes its kept copy in MlpTensors::w_*_q), FC1 into the bf16 a, the activation, h
// quantized 1x128, FC2 into y.
static void fp8_block_forward(const MlpConfig& c, const MlpTensors& t, Stream stream) {
  const int64_t R = t.x.size(0), H = t.x.size(1), P = t.w_in.size(2), F = t.w_in.size(3), PF = P * F;
  const int64_t G = t.rows.size(0);
  const Device dev = t.x.device();
  auto ref_of = [&](void* p, DType dt, Shape s) { return TensorRef(p, dt, std::move(s), dev); };
  // fp8 codes or fp32 scales in scratch slot `slot`
  auto in_scratch = [&](int slot, DType dt, const Shape& s) {
    void* p = dt == DType::kF32 ? static_cast<void*>(scratch<float>(slot, static_cast<size_t>(s.numel())))
                                : static_cast<void*>(scratch<uint8_t>(slot, static_cast<size_t>(s.numel())));
    return ref_of(p, dt, s);
  };
  TensorRef x_q = t.x, x_s = t.x_scales;
  if (t.x.dtype() != DType::kF8E4M3) {
    x_q = in_scratch(3, DType::kF8E4M3, {R, H});
    x_s = in_scratch(4, DType::kF32, {R, H / 128});
    quantize(QuantRecipe::kFp8Block1x128, t.x, x_q, x_s, QuantOptions{}, stream);
  }
  TensorRef wi_q = t.w_in_q, wi_s = t.w_in_q_scales, wo_q = t.w_out_q, wo_s = t.w_out_q_scales;
  if (!wi_q.defined()) {  // no copy kept by the caller: quantize them now
    const Fp8ExpertWeightShapes ws = fp8_expert_weight_shapes(G, H, P, F);
    wi_q = in_scratch(5, DType::kF8E4M3, ws.w_in_q);
    wi_s = in_scratch(6, DType::kF32, ws.w_in_q_scales);
    wo_q = in_scratch(7, DType::kF8E4M3, ws.w_out_q);
    wo_s = in_scratch(8, DType::kF32, ws.w_out_q_scales);
    quantize_expert_weights_fp8(t.w_in, t.w_out, wi_q, wi_s, wo_q, wo_s, stream);
    detail::phase_mark(stream, "fp8_weights");
  }
  grouped_forward_fp8_cuda(x_q, x_s, wi_q, wi_s, t.offsets, t.rows, ref_of(t.a.data(), DType::kBF16, {R, PF}), stream,
                           t.row_align);
  detail::phase_mark(stream, "fc1");
  const int32_t* off = t.offsets.ptr<int32_t>();
  const int32_t* rows = t.rows.ptr<int32_t>();
  act_forward(c, t, R, P, F, H, static_cast<int>(G), to_cuda(stream));
  detail::phase_mark(stream, "act");
  const TensorRef h_q = in_scratch(9, DType::kF8E4M3, {R, F}), h_s = in_scratch(10, DType::kF32, {R, F / 128});
  quantize(QuantRecipe::kFp8Block1x128, ref_of(t.h.data(), DType::kBF16, {R, F}), h_q, h_s, QuantOptions{}, stream);
  grouped_forward_fp8_cuda(h_q, h_s, wo_q, wo_s, t.offsets, t.rows, t.y, stream, t.row_align);
  if (t.b_out.defined())
    add_group_bias(H, R, off, rows, static_cast<int>(G), t.b_out.data(), t.y.data(), to_cuda(stream));
  detail::phase_mark(stream, "fc2");
}

// The bf16 forward on the given operands: x [R, H], w_in [G, H, P*F], w_out [G, F, H] (the tensors'
// own, or their quantized images); fc2_input gives what FC2 reads once h is written (h, or its image).
static void bf16_forward(const MlpConfig& c, const MlpTensors& t, const void* x, const void* w_in, const void* w_out,
                         const std::function<const void*()>& fc2_input, Stream stream) {
  const int64_t R = t.x.size(0), H = t.x.size(1), P = t.w_in.size(2), F = t.w_in.size(3);
  const int G = static_cast<int>(t.rows.size(0));
  const int32_t* off = t.offsets.ptr<int32_t>();
  const int32_t* rows = t.rows.ptr<int32_t>();
  grouped_forward_bf16({x, H, 0}, {w_in, P * F, H * P * F}, t.a.data(), P * F, H, P * F, off, rows, G, R, stream,
                       t.row_align);
  detail::phase_mark(stream, "fc1");
  act_forward(c, t, R, P, F, H, G, to_cuda(stream));
  detail::phase_mark(stream, "act");
  grouped_forward_bf16({fc2_input(), F, 0}, {w_out, H, F * H}, t.y.data(), H, F, H, off, rows, G, R, stream,
                       t.row_align);
  if (t.b_out.defined()) add_group_bias(H, R, off, rows, G, t.b_out.data(), t.y.data(), to_cuda(stream));
  detail::phase_mark(stream, "fc2");
}


// The MXFP8 forward (semantics in epx/grouped_gemm.h, oracle ref::expert_mlp_forward). Hopper has no
// MX tensor cores, so each GEMM runs in bf16 on the exact images of its quantized operands (e4m3
// codes times power-of-two scales fit bf16): x rowwise (or x's own fp8 codes and e8m0 scales), w_in
// and w_out colwise (32-row blocks down the contraction dim, never straddling two experts since H
// and F are multiples of 32), h rowwise before FC2, scales rounded up as the reference does. The
// images live in stream-ordered temporaries for the call: this path has bf16's speed plus the
// quantization passes, and twice the expert weights' memory while it runs.
static void mxfp8_forward(const MlpConfig& c, const MlpTensors& t, Stream stream) {
  const int64_t R = t.x.size(0), H = t.x.size(1), P = t.w_in.size(2), F = t.w_in.size(3), PF = P * F;
  const int64_t G = t.rows.size(0);
  const Device dev = t.x.device();
  const cudaStream_t s = to_cuda(stream);
  const size_t bf = sizeof(__nv_bfloat16);
  StreamTemp x_img(static_cast<size_t>(R * H) * bf, s), wi_img(static_cast<size_t>(G * H * PF) * bf, s);
  StreamTemp wo_img(static_cast<size_t>(G * F * H) * bf, s), h_img(static_cast<size_t>(R * F) * bf, s);
  auto bf16_ref = [&](void* p, Shape sh) { return TensorRef(p, DType::kBF16, std::move(sh), dev); };
  const E8M0Rounding up = E8M0Rounding::kCeil;
  if (t.x.dtype() == DType::kF8E4M3) epx::dequantize(QuantRecipe::kMxfp8Rowwise, t.x, t.x_scales, bf16_ref(x_img.get(), {R, H}), stream);
  else quantized_image(QuantRecipe::kMxfp8Rowwise, t.x, up, bf16_ref(x_img.get(), {R, H}), stream);
  quantized_image(QuantRecipe::kMxfp8Colwise, bf16_ref(t.w_in.data(), {G * H, PF}), up, bf16_ref(wi_img.get(), {G * H, PF}),
                  stream);
  quantized_image(QuantRecipe::kMxfp8Colwise, bf16_ref(t.w_out.data(), {G * F, H}), up, bf16_ref(wo_img.get(), {G * F, H}),
                  stream);
  detail::phase_mark(stream, "mxfp8_operands");
  bf16_forward(c, t, x_img.get(), wi_img.get(), wo_img.get(), [&]() -> const void* {
    quantized_image(QuantRecipe::kMxfp8Rowwise, bf16_ref(t.h.data(), {R, F}), up, bf16_ref(h_img.get(), {R, F}), stream);
    return h_img.get();
  }, stream);
}

void expert_mlp_forward_cuda(const MlpConfig& c, const MlpTensors& t, Stream stream) {
  const char* fn = "epx::expert_mlp_forward";
  const int64_t H = t.x.size(1), F = t.w_in.size(3);
  if (c.precision == MlpPrecision::kFp8Block) {
    require_grouped_gemm(fn);
    require_status(t.a.dtype() == DType::kBF16, Status::kNotSupported, fn, "a has dtype ", dtype_name(t.a.dtype()),
                   "; the GPU FP8 path takes bf16 data (x bf16 or fp8_e4m3 with scales; a, h, y, weights bf16)");
    require_status(H % 128 == 0 && F % 128 == 0, Status::kNotSupported, fn, "hidden ", H, " and ffn ", F,
                   " must be multiples of 128 for the GPU FP8 block path (whole scale blocks)");
    return fp8_block_forward(c, t, stream);
  }
  if (c.precision == MlpPrecision::kMxfp8) {
    require_grouped_gemm(fn);
    require_status(t.a.dtype() == DType::kBF16 && t.w_in.dtype() == DType::kBF16, Status::kNotSupported, fn,
                   "a has dtype ", dtype_name(t.a.dtype()), " and w_in ", dtype_name(t.w_in.dtype()),
                   "; the GPU MXFP8 path takes bf16 data (x bf16 or fp8_e4m3 with e8m0 scales; a, h, y, weights bf16)");
    require_status(H % 32 == 0 && F % 32 == 0, Status::kNotSupported, fn, "hidden ", H, " and ffn ", F,
                   " must be multiples of 32 for the GPU MXFP8 path (whole scale blocks)");
    return mxfp8_forward(c, t, stream);
  }
  require_bf16_path(fn, t.x, H, F);
  bf16_forward(c, t, t.x.data(), t.w_in.data(), t.w_out.data(), [&]() -> const void* { return t.h.data(); }, stream);
}

void expert_mlp_backward_cuda(const MlpConfig& c, const MlpTensors& t, const MlpGrads& d, Stream stream) {
  const char* fn = "epx::expert_mlp_backward";
  const int64_t R = t.x.size(0), H = t.x.size(1), P = t.w_in.size(2), F = t.w_in.size(3), PF = P * F;
  const int G = static_cast<int>(t.rows.size(0));
  // x dispatched in fp8 (an FP8 forward): the weight gradient uses the values the forward saw.
  TensorRef x = t.x;
  if (x.dtype() == DType::kF8E4M3) {
    const QuantRecipe rr = c.precision == MlpPrecision::kMxfp8 ? QuantRecipe::kMxfp8Rowwise : QuantRecipe::kFp8Block1x128;
    x = TensorRef(scratch<__nv_bfloat16>(11, static_cast<size_t>(R * H)), DType::kBF16, {R, H}, t.x.device());
    epx::dequantize(rr, t.x, t.x_scales, x, stream);
  }
  require_bf16_path(fn, x, H, F);
  // The backward never reads quantized operands (saved a and h, the bf16 weights and x), so an
  // FP8 forward's backward is this bf16 path.
  auto grad_dtype_ok = [](DType t) { return t == DType::kF32 || t == DType::kBF16; };
  require_status(grad_dtype_ok(d.d_w_in.dtype()) && grad_dtype_ok(d.d_w_out.dtype()), Status::kNotSupported, fn,
                 "d_w_in is ", dtype_name(d.d_w_in.dtype()), " and d_w_out is ", dtype_name(d.d_w_out.dtype()),
                 "; the GPU weight gradients are fp32 or bf16");
  cudaStream_t s = to_cuda(stream);
  const int32_t* off = t.offsets.ptr<int32_t>();
  const int32_t* rows = t.rows.ptr<int32_t>();
  // Overwriting: groups without rows get zero gradients (the GEMM skips them); accumulating: they
  // keep what they hold.
  const float beta = c.accumulate_weight_grads ? 1.0f : 0.0f;
  if (!c.accumulate_weight_grads) {
    zero_empty_groups(d.d_w_out, F * H, rows, G, s);
    zero_empty_groups(d.d_w_in, H * PF, rows, G, s);
  }
  if (t.b_out.defined())
    group_column_sums(d.d_y.data(), H, H, off, rows, G, c.accumulate_weight_grads, d.d_b_out, s);
  // Weights applied in combine with d_y unweighted (combine_weight_grads): FC2's wgrad needs the
  // weighted activations the act pass writes, so it comes after that pass; h is never read (the pass
  // recomputes the activation from a), so d_h may take h's place all the same. Otherwise wgrad of FC2
  // first: it is h's last reader.
  const bool late = c.combine_weight_grads;
  if (!late) {
    wgrad({t.h.data(), F, 0}, {d.d_y.data(), H, 0}, d.d_w_out, 0, F * H, F, H, off, rows, G, R, beta, stream);
    detail::phase_mark(stream, "wgrad_fc2");
  }
  const bool in_place = c.backward_consumes_saved;
  // d_h and d_a: over h and a, or in the caller's workspace [R, (P+1)*F], or in the device scratch.
  auto* ws = static_cast<__nv_bfloat16*>(d.workspace.data());
  __nv_bfloat16* d_h = in_place ? static_cast<__nv_bfloat16*>(t.h.data())
                       : ws   ? ws
                              : scratch<__nv_bfloat16>(0, static_cast<size_t>(R) * F);
  // act_backward reads a[r] before it writes d_a[r] at the same elements, so d_a may take a's place.
  __nv_bfloat16* d_a = in_place ? static_cast<__nv_bfloat16*>(t.a.data())
                       : ws   ? ws + R * F
                              : scratch<__nv_bfloat16>(1, static_cast<size_t>(R) * PF);
  grouped_dgrad_bf16({d.d_y.data(), H, 0}, {t.w_out.data(), H, F * H}, d_h, F, H, F, off, rows, G, R, stream,
                     t.row_align);
  detail::phase_mark(stream, "dgrad_fc2");
  act_backward(c, t, d, d_h, d_a, R, P, F, G, s);
  if (t.b_in.defined()) group_column_sums(d_a, PF, PF, off, rows, G, c.accumulate_weight_grads, d.d_b_in, s);
  detail::phase_mark(stream, "act");
  if (late) {  // d_h's buffer now holds round(w * act)
    wgrad({d_h, F, 0}, {d.d_y.data(), H, 0}, d.d_w_out, 0, F * H, F, H, off, rows, G, R, beta, stream);
    detail::phase_mark(stream, "wgrad_fc2");
  }
  // FC1's wgrad before its dgrad: x's last reader, so d_x may take x's place (MlpGrads::d_x).
  wgrad({x.data(), H, 0}, {d_a, PF, 0}, d.d_w_in, 0, H * PF, H, PF, off, rows, G, R, beta, stream);
  detail::phase_mark(stream, "wgrad_fc1");
  // d_x [rows, H] = d_a [rows, P*F] . w_in_g^T, w_in_g [H, P*F] row-major.
  grouped_dgrad_bf16({d_a, PF, 0}, {t.w_in.data(), PF, H * PF}, d.d_x.data(), H, PF, H, off, rows, G, R, stream,
                     t.row_align);
  zero_padding_kernel<<<row_grid(R), 256, 0, s>>>(H, R, off, rows, G, static_cast<__nv_bfloat16*>(d.d_x.data()));
  EPX_CHECK_LAUNCH("zero_padding_kernel");
  detail::phase_mark(stream, "dgrad_fc1");
}

void grouped_forward_cuda(const TensorRef& x, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                          const TensorRef& y, Stream stream, int64_t row_align) {
  const int64_t R = x.size(0), K = x.size(1), N = w.size(2);
  const int G = static_cast<int>(rows.size(0));
  require_bf16_path("epx::grouped_gemm_forward", x, K, N);
  grouped_forward_bf16({x.data(), K, 0}, {w.data(), N, K * N}, y.data(), N, K, N, offsets.ptr<int32_t>(),
                       rows.ptr<int32_t>(), G, R, stream, row_align);
  zero_padding_kernel<<<row_grid(R), 256, 0, to_cuda(stream)>>>(N, R, offsets.ptr<int32_t>(), rows.ptr<int32_t>(), G,
                                                                static_cast<__nv_bfloat16*>(y.data()));
  EPX_CHECK_LAUNCH("zero_padding_kernel");
}

void quantize_grouped_weights_fp8_cuda(const TensorRef& w, const TensorRef& w_q, const TensorRef& w_scales,
                                       Stream stream) {
  quantize_transpose_weights_fp8(w.data(), w.dtype(), w.size(0), w.size(1), w.size(2), w_q.data(),
                                 w_scales.ptr<float>(), stream);
}

void grouped_forward_fp8_cuda(const TensorRef& x_q, const TensorRef& x_scales, const TensorRef& w_q,
                              const TensorRef& w_scales, const TensorRef& offsets, const TensorRef& rows,
                              const TensorRef& y, Stream stream, int64_t row_align) {
  require_grouped_gemm("epx::grouped_gemm_forward_fp8");
  const int64_t R = x_q.size(0), K = x_q.size(1), N = y.size(1);
  const int G = static_cast<int>(rows.size(0));
  for (const auto& [name, p] : {std::pair<const char*, const void*>{"x_q", x_q.data()}, {"w_q", w_q.data()},
                                {"y", y.data()}})
    require(reinterpret_cast<uintptr_t>(p) % 16 == 0, "epx::grouped_gemm_forward_fp8", name, " is at ", p,
            ", not 16-byte aligned (the tensor memory accelerator loads and stores 16-byte rows)");
  const int32_t* off = offsets.ptr<int32_t>();
  const int32_t* nrows = rows.ptr<int32_t>();
  if (G > 0 && fp8_gemm_schedule(R, G, row_align) == Fp8GemmSchedule::kContiguous) {
    // One GEMM over all rows: the scales M-major over every row (128-row blocks).
    const int64_t padded = (R + 127) / 128 * 128;
    float* mmajor = scratch<float>(2, static_cast<size_t>(padded) * (K / 128));
    transpose_activation_scales(x_scales.ptr<float>(), mmajor, R, padded, K / 128, stream);
    grouped_forward_fp8_contiguous(x_q.data(), mmajor, w_q.data(), w_scales.ptr<float>(), y.data(), N, K, N, off, nrows,
                                   G, R, stream);
  } else {
    // The pointer-array kernels read each group's scales M-major from a block of its own.
    float* grouped = scratch<float>(2, static_cast<size_t>(R) * (K / 128));
    group_activation_scales(x_scales.ptr<float>(), grouped, R, K / 128, off, nrows, G, stream);
    grouped_forward_fp8_blockwise(x_q.data(), grouped, w_q.data(), w_scales.ptr<float>(), y.data(), N, K, N, off,
                                  nrows, G, R, stream);
  }
  zero_padding_kernel<<<row_grid(R), 256, 0, to_cuda(stream)>>>(N, R, off, nrows, G,
                                                                static_cast<__nv_bfloat16*>(y.data()));
  EPX_CHECK_LAUNCH("zero_padding_kernel");
}

void grouped_dgrad_cuda(const TensorRef& dy, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dx, Stream stream, int64_t row_align) {
  const int64_t R = dy.size(0), N = dy.size(1), K = dx.size(1);
  const int G = static_cast<int>(rows.size(0));
  require_bf16_path("epx::grouped_gemm_dgrad", dy, K, N);
  // dx = dy . w^T with w_g [K, N] row-major: as the dgrad kernel's b_g [Nout = K, Kc = N].
  grouped_dgrad_bf16({dy.data(), N, 0}, {w.data(), N, K * N}, dx.data(), K, N, K, offsets.ptr<int32_t>(),
                     rows.ptr<int32_t>(), G, R, stream, row_align);
  zero_padding_kernel<<<row_grid(R), 256, 0, to_cuda(stream)>>>(K, R, offsets.ptr<int32_t>(), rows.ptr<int32_t>(), G,
                                                                static_cast<__nv_bfloat16*>(dx.data()));
  EPX_CHECK_LAUNCH("zero_padding_kernel");
}

void grouped_wgrad_cuda(const TensorRef& x, const TensorRef& dy, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dw, bool accumulate, Stream stream) {
  const int64_t K = x.size(1), N = dy.size(1);
  const int G = static_cast<int>(rows.size(0));
  require_bf16_path("epx::grouped_gemm_wgrad", x, K, N);
  require_status(dw.dtype() == DType::kF32 || dw.dtype() == DType::kBF16, Status::kNotSupported,
                 "epx::grouped_gemm_wgrad", "dw is ", dtype_name(dw.dtype()), "; the GPU wgrad writes fp32 or bf16 dw");
  if (!accumulate) zero_empty_groups(dw, K * N, rows.ptr<int32_t>(), G, to_cuda(stream));
  wgrad({x.data(), K, 0}, {dy.data(), N, 0}, dw, 0, K * N, K, N, offsets.ptr<int32_t>(), rows.ptr<int32_t>(), G,
        x.size(0), accumulate ? 1.0f : 0.0f, stream);
}

}  // namespace epx::cuda
