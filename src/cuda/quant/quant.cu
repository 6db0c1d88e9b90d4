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
#include "cuda/common/stream_temp.h"
#include "cuda/quant/quant_kernels.cuh"

namespace epx::cuda {
namespace {

using quant::kThreads;

using cuda::DeviceGuard;

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

// Requested rows per thread, 0 = auto.
int requested_rows(const char* fn, const QuantTuning& tuning) {
  require(tuning.rows_per_thread == 0 || tuning.rows_per_thread == 4 || tuning.rows_per_thread == 8, fn,
          "tuning.rows_per_thread is ", tuning.rows_per_thread, ", expected 0 (auto), 4 or 8");
  return tuning.rows_per_thread;
}

// Rows per thread of the row-recipe quantize kernel when not asked: 4 (5 CTAs/SM). Measured on
// H200, bf16 [M, 7168], % of copy bandwidth, 1x128 / MX rowwise: M = 4096: 4 rows 82.0 / 83.6,
// 8 rows 77.8 / 77.5; M = 32768: 4 rows 97.6 / 99.9, 8 rows 98.9 / 97.4. Eight rows only pay off
// while the per-row work is heavy; with the current kernel they lose at 4096 rows and tie at 32768.
constexpr int kAutoRows = 4;

void debug_print(const char* fn, QuantRecipe recipe, const TensorRef& x, const char* kernel, bool vec, dim3 grid) {
  if (!debug_enabled()) return;
  std::fprintf(stderr, "[epx] %s: %s %s %s kernel=%s vec16=%d grid=(%u,%u) block=%d\n", fn, quant_recipe_name(recipe),
               dtype_name(x.dtype()), x.shape().str().c_str(), kernel, vec ? 1 : 0, grid.x, grid.y, kThreads);
}

// Row recipes: kRows rows per thread in the vector kernel, 4 in the element-wise one.
template <class T, bool kMx, int kRows>
void launch_rowwise(const char* fn, QuantRecipe recipe, const TensorRef& x, uint8_t* qp, void* sp, bool vec, bool ceil,
                    cudaStream_t stream, const QuantTuning& tuning) {
  constexpr int kElems = quant::Vec<T>::kElems;
  constexpr int64_t kBc = kMx ? 32 : 128;
  const int64_t M = x.size(0), N = x.size(1);
  const T* xp = x.ptr<const T>();
  const int64_t scale_cols = ceil_div(N, kBc);
  // Lanes per row: whole groups for every block, the partial last one included.
  const int64_t lanes = scale_cols * (kBc / kElems);
  const int64_t gx = ceil_div(lanes, quant::kRowLanesX);
  if (vec) {
    const int64_t tiles = ceil_div(M, quant::row_tile<kRows>());
    const dim3 grid = make_grid(fn, gx, tiles, tuning);
    debug_print(fn, recipe, x, kRows == 8 ? "quantize_rowwise_kernel<rows=8>" : "quantize_rowwise_kernel<rows=4>", true, grid);
    quant::quantize_rowwise_kernel<T, kMx, true, kRows><<<grid, kThreads, 0, stream>>>(xp, qp, sp, M, N, scale_cols, tiles, ceil);
  } else {
    const int64_t tiles = ceil_div(M, quant::row_tile<4>());
    const dim3 grid = make_grid(fn, gx, tiles, tuning);
    debug_print(fn, recipe, x, "quantize_rowwise_kernel<rows=4>", false, grid);
    quant::quantize_rowwise_kernel<T, kMx, false, 4><<<grid, kThreads, 0, stream>>>(xp, qp, sp, M, N, scale_cols, tiles, ceil);
  }
  EPX_CHECK_LAUNCH("quantize_rowwise_kernel");
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
      const int requested = requested_rows(fn, tuning);
      const bool eight = (requested ? requested : kAutoRows) == 8;
      void* sp = scales.data();
      if (mx && eight) launch_rowwise<T, true, 8>(fn, recipe, x, qp, sp, vec, ceil, stream, tuning);
      else if (mx) launch_rowwise<T, true, 4>(fn, recipe, x, qp, sp, vec, ceil, stream, tuning);
      else if (eight) launch_rowwise<T, false, 8>(fn, recipe, x, qp, sp, vec, ceil, stream, tuning);
      else launch_rowwise<T, false, 4>(fn, recipe, x, qp, sp, vec, ceil, stream, tuning);
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
  // Vector path: 4/8-byte loads of codes (and of E8M0 rows for colwise), 16-byte stores of x_out;
  // with N % 16 == 0 every chunk (4 or 8 codes, starting at a multiple of its size) is aligned and
  // wholly inside its row.
  const bool vec = !tuning.force_scalar && N % quant::kDequantCodes == 0 && aligned_to(qp, 16) && aligned_to(op, 16) &&
                   (kBc != 1 || aligned_to(sp, 16));
  // 4 rows unless asked: 8 was slower for every recipe at both benchmark sizes (H200), most for
  // MX colwise (its E8M0 rows double the registers).
  const int requested = requested_rows(fn, tuning);
  const int rows = vec && requested == 8 ? 8 : 4;
  const int64_t tiles = ceil_div(M, quant::kRowLanesY * rows);
  const dim3 grid = make_grid(fn, ceil_div(N, quant::kDequantCtaCols), tiles, tuning);
  debug_print(fn, recipe, x_out, rows == 8 ? "dequantize_kernel<rows=8>" : "dequantize_kernel<rows=4>", vec, grid);
  const int64_t scale_cols = scales.size(1);
  if (!vec) quant::dequantize_kernel<TOut, kBr, kBc, false, 4><<<grid, kThreads, 0, stream>>>(qp, sp, op, M, N, scale_cols, tiles);
  else if (rows == 8) quant::dequantize_kernel<TOut, kBr, kBc, true, 8><<<grid, kThreads, 0, stream>>>(qp, sp, op, M, N, scale_cols, tiles);
  else quant::dequantize_kernel<TOut, kBr, kBc, true, 4><<<grid, kThreads, 0, stream>>>(qp, sp, op, M, N, scale_cols, tiles);
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

void with_quantized(QuantRecipe recipe, const TensorRef& x, E8M0Rounding mx_rounding, Stream stream,
                    const std::function<void(const TensorRef& q, const TensorRef& scales)>& use) {
  const int64_t M = x.size(0), N = x.size(1);
  const Shape ss = quant_scale_shape(recipe, M, N);
  const DType sdt = quant_scale_dtype(recipe);
  const size_t q_bytes = static_cast<size_t>(M) * static_cast<size_t>(N);
  const size_t s_off = (q_bytes + 255) / 256 * 256;  // scales 256-byte aligned after the codes
  const size_t bytes = s_off + static_cast<size_t>(ss.numel()) * dtype_size(sdt);
  DeviceGuard guard(x.device().index);
  const cudaStream_t s = to_cuda(stream);
  const StreamTemp temp(bytes, s);
  char* b = static_cast<char*>(temp.get());
  const TensorRef q(b, DType::kF8E4M3, Shape{M, N}, x.device());
  const TensorRef sc(b ? b + s_off : nullptr, sdt, ss, x.device());
  quantize(recipe, x, q, sc, mx_rounding, stream);
  use(q, sc);
}

void quantized_image(QuantRecipe recipe, const TensorRef& x, E8M0Rounding mx_rounding, const TensorRef& image,
                     Stream stream) {
  with_quantized(recipe, x, mx_rounding, stream,
                 [&](const TensorRef& q, const TensorRef& scales) { dequantize(recipe, q, scales, image, stream, QuantTuning{}); });
}

}  // namespace epx::cuda
