// Launchers of the quantization kernels (device code and its invariants: quant_kernels.cuh).
// One kernel family per recipe shape: row blocks (1x128, MX rowwise), 128x128 blocks, MX colwise,
// and one dequantize kernel templated on the block shape. Each comes in a 16-byte vector variant
// (x / q / x_out base pointers 16-byte aligned, N a multiple of the vector: every vector is wholly
// inside a row) and an element-wise one for everything else; the bits are the same. Nothing here
// synchronizes the host or allocates: a call is a few checks, a cudaGetDevice and one launch.
#include "cuda/quant/quant.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "cuda/common/cuda_check.h"
#include "cuda/quant/quant_kernels.cuh"

namespace epx::cuda {
namespace {

using quant::kThreads;

// Tensors may live on any device: launch on theirs, restore the caller's current device after.
struct DeviceGuard {
  int previous = -1;
  explicit DeviceGuard(int device) {
    EPX_CUDA_CHECK(cudaGetDevice(&previous));
    if (previous != device) EPX_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && previous >= 0 && now != previous) cudaSetDevice(previous);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

bool debug_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("EPX_DEBUG");
    return v && *v && *v != '0';
  }();
  return on;
}

bool aligned_to(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The kernels access elements through typed pointers (fp32 scales, 2/4-byte elements in the
// element-wise variants): a pointer off its element size would fault, so it is refused up front.
void require_element_aligned(const char* fn, const char* name, const TensorRef& t) {
  const size_t es = dtype_size(t.dtype());
  require(t.nbytes() == 0 || aligned_to(t.data(), es), fn, name, " at address ", t.data(), " is not aligned to its ",
          es, "-byte elements, expected an element-aligned pointer");
}

dim3 make_grid(const char* fn, int64_t gx, int64_t tiles, const QuantTuning& tuning) {
  require_status(gx <= std::numeric_limits<int>::max(), Status::kNotSupported, fn, "a row needs ", gx,
                 " CTAs, more than a grid can hold");
  const int64_t cap = tuning.max_grid_y > 0 ? std::min<int64_t>(tuning.max_grid_y, 65535) : 65535;
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(tiles, 1), cap)), 1);
}

void debug_print(const char* fn, QuantRecipe recipe, const TensorRef& x, const char* kernel, bool vec, dim3 grid) {
  if (!debug_enabled()) return;
  std::fprintf(stderr, "[epx] %s: %s %s %s kernel=%s vec16=%d grid=(%u,%u) block=%d\n", fn, quant_recipe_name(recipe),
               dtype_name(x.dtype()), x.shape().str().c_str(), kernel, vec ? 1 : 0, grid.x, grid.y, kThreads);
}

template <class T>
void quantize_typed(QuantRecipe recipe, const TensorRef& x, const TensorRef& q, const TensorRef& scales, bool ceil,
                    cudaStream_t stream, const QuantTuning& tuning) {
  const char* fn = "epx::cuda::quantize";
  constexpr int kElems = quant::Vec<T>::kElems;
  const int64_t M = x.size(0), N = x.size(1);
  const T* xp = x.ptr<const T>();
  uint8_t* qp = q.ptr<uint8_t>();
  // Vector path: 16-byte loads of x and kElems-byte stores of q at i * N + j0, j0 % kElems == 0.
  const bool vec = !tuning.force_scalar && N % kElems == 0 && aligned_to(xp, 16) && aligned_to(qp, kElems);
  const int64_t vec_per_row = ceil_div(N, kElems);

  switch (recipe) {
    case QuantRecipe::kFp8Block1x128:
    case QuantRecipe::kMxfp8Rowwise: {
      const bool mx = recipe == QuantRecipe::kMxfp8Rowwise;
      const int64_t bc = mx ? 32 : 128;
      const int64_t scale_cols = ceil_div(N, bc);
      // Lanes per row: whole groups for every block, the partial last one included.
      const int64_t lanes = scale_cols * (bc / kElems);
      const int64_t tiles = ceil_div(M, quant::kRowTile);
      const dim3 grid = make_grid(fn, ceil_div(lanes, quant::kRowLanesX), tiles, tuning);
      debug_print(fn, recipe, x, "quantize_rowwise_kernel", vec, grid);
      void* sp = scales.data();
      if (mx) {
        if (vec) quant::quantize_rowwise_kernel<T, true, true><<<grid, kThreads, 0, stream>>>(xp, qp, sp, M, N, scale_cols, tiles, ceil);
        else quant::quantize_rowwise_kernel<T, true, false><<<grid, kThreads, 0, stream>>>(xp, qp, sp, M, N, scale_cols, tiles, ceil);
      } else {
        if (vec) quant::quantize_rowwise_kernel<T, false, true><<<grid, kThreads, 0, stream>>>(xp, qp, sp, M, N, scale_cols, tiles, ceil);
        else quant::quantize_rowwise_kernel<T, false, false><<<grid, kThreads, 0, stream>>>(xp, qp, sp, M, N, scale_cols, tiles, ceil);
      }
      EPX_CHECK_LAUNCH("quantize_rowwise_kernel");
      return;
    }
    case QuantRecipe::kFp8Block128x128: {
      const int64_t scale_cols = ceil_div(N, 128), block_rows = ceil_div(M, 128);
      const dim3 grid = make_grid(fn, scale_cols, block_rows, tuning);
      debug_print(fn, recipe, x, "quantize_block128_kernel", vec, grid);
      float* sp = scales.ptr<float>();
      if (vec) quant::quantize_block128_kernel<T, true><<<grid, kThreads, 0, stream>>>(xp, qp, sp, M, N, scale_cols, block_rows);
      else quant::quantize_block128_kernel<T, false><<<grid, kThreads, 0, stream>>>(xp, qp, sp, M, N, scale_cols, block_rows);
      EPX_CHECK_LAUNCH("quantize_block128_kernel");
      return;
    }
    case QuantRecipe::kMxfp8Colwise: {
      const int64_t strips = ceil_div(M, 32);
      const dim3 grid = make_grid(fn, ceil_div(vec_per_row, quant::kColLanesX), strips, tuning);
      debug_print(fn, recipe, x, "quantize_mx_colwise_kernel", vec, grid);
      uint8_t* sp = scales.ptr<uint8_t>();
      if (vec) quant::quantize_mx_colwise_kernel<T, true><<<grid, kThreads, 0, stream>>>(xp, qp, sp, M, N, strips, ceil);
      else quant::quantize_mx_colwise_kernel<T, false><<<grid, kThreads, 0, stream>>>(xp, qp, sp, M, N, strips, ceil);
      EPX_CHECK_LAUNCH("quantize_mx_colwise_kernel");
      return;
    }
  }
  throw Error(Status::kInvalidArgument, detail::concat(fn, ": recipe has value ", static_cast<int>(recipe)));
}

template <class TOut, int kBr, int kBc>
void dequantize_shape(const TensorRef& q, const TensorRef& scales, const TensorRef& x_out, cudaStream_t stream,
                      const QuantTuning& tuning, QuantRecipe recipe) {
  const char* fn = "epx::cuda::dequantize";
  const int64_t M = q.size(0), N = q.size(1);
  const uint8_t* qp = q.ptr<const uint8_t>();
  TOut* op = x_out.ptr<TOut>();
  const void* sp = scales.data();
  // Vector path: 16-byte loads of codes (and of E8M0 rows for colwise), 16-byte stores of x_out.
  const bool vec = !tuning.force_scalar && N % quant::kDequantCodes == 0 && aligned_to(qp, 16) && aligned_to(op, 16) &&
                   (kBc != 1 || aligned_to(sp, 16));
  const int64_t tiles = ceil_div(M, quant::kRowTile);
  const dim3 grid = make_grid(fn, ceil_div(ceil_div(N, quant::kDequantCodes), quant::kRowLanesX), tiles, tuning);
  debug_print(fn, recipe, x_out, "dequantize_kernel", vec, grid);
  const int64_t scale_cols = scales.size(1);
  if (vec) quant::dequantize_kernel<TOut, kBr, kBc, true><<<grid, kThreads, 0, stream>>>(qp, sp, op, M, N, scale_cols, tiles);
  else quant::dequantize_kernel<TOut, kBr, kBc, false><<<grid, kThreads, 0, stream>>>(qp, sp, op, M, N, scale_cols, tiles);
  EPX_CHECK_LAUNCH("dequantize_kernel");
}

template <class TOut>
void dequantize_typed(QuantRecipe recipe, const TensorRef& q, const TensorRef& scales, const TensorRef& x_out,
                      cudaStream_t stream, const QuantTuning& tuning) {
  switch (recipe) {
    case QuantRecipe::kFp8Block1x128: return dequantize_shape<TOut, 1, 128>(q, scales, x_out, stream, tuning, recipe);
    case QuantRecipe::kFp8Block128x128: return dequantize_shape<TOut, 128, 128>(q, scales, x_out, stream, tuning, recipe);
    case QuantRecipe::kMxfp8Rowwise: return dequantize_shape<TOut, 1, 32>(q, scales, x_out, stream, tuning, recipe);
    case QuantRecipe::kMxfp8Colwise: return dequantize_shape<TOut, 32, 1>(q, scales, x_out, stream, tuning, recipe);
  }
  throw Error(Status::kInvalidArgument,
              detail::concat("epx::cuda::dequantize: recipe has value ", static_cast<int>(recipe)));
}

}  // namespace

void quantize(QuantRecipe recipe, const TensorRef& x, const TensorRef& q, const TensorRef& scales,
              E8M0Rounding mx_rounding, Stream stream, const QuantTuning& tuning) {
  const char* fn = "epx::cuda::quantize";
  const int64_t M = x.size(0), N = x.size(1);
  if (M == 0 || N == 0) return;  // nothing to read or write (the scale tensor is empty too)
  require_element_aligned(fn, "x", x);
  require_element_aligned(fn, "scales", scales);
  DeviceGuard guard(x.device().index);
  const bool ceil = mx_rounding == E8M0Rounding::kCeil;
  const cudaStream_t s = to_cuda(stream);
  switch (x.dtype()) {
    case DType::kF32: return quantize_typed<float>(recipe, x, q, scales, ceil, s, tuning);
    case DType::kBF16: return quantize_typed<__nv_bfloat16>(recipe, x, q, scales, ceil, s, tuning);
    case DType::kF16: return quantize_typed<__half>(recipe, x, q, scales, ceil, s, tuning);
    default: break;
  }
  throw Error(Status::kInvalidArgument,
              detail::concat(fn, ": x has dtype ", dtype_name(x.dtype()), ", expected fp32, bf16 or fp16"));
}

void dequantize(QuantRecipe recipe, const TensorRef& q, const TensorRef& scales, const TensorRef& x_out,
                Stream stream, const QuantTuning& tuning) {
  const char* fn = "epx::cuda::dequantize";
  const int64_t M = q.size(0), N = q.size(1);
  if (M == 0 || N == 0) return;
  require_element_aligned(fn, "scales", scales);
  require_element_aligned(fn, "x_out", x_out);
  DeviceGuard guard(q.device().index);
  const cudaStream_t s = to_cuda(stream);
  switch (x_out.dtype()) {
    case DType::kF32: return dequantize_typed<float>(recipe, q, scales, x_out, s, tuning);
    case DType::kBF16: return dequantize_typed<__nv_bfloat16>(recipe, q, scales, x_out, s, tuning);
    case DType::kF16: return dequantize_typed<__half>(recipe, q, scales, x_out, s, tuning);
    default: break;
  }
  throw Error(Status::kInvalidArgument,
              detail::concat(fn, ": x_out has dtype ", dtype_name(x_out.dtype()), ", expected fp32, bf16 or fp16"));
}

}  // namespace epx::cuda
