// Public entry points of quantize / dequantize: validate every argument once (recipe, options,
// dtypes, 2-D shapes, the scale tensor's exact shape and dtype, one device, no overlapping
// buffers), then run the CPU reference for host tensors or the CUDA kernels (src/cuda/quant) for
// device tensors, stream-ordered on `stream`. Nothing here touches data. A build without the CUDA
// backend refuses device tensors with kNotSupported.
#include <cstdint>
#include <string>

#include "core/check.h"
#include "epx/error.h"
#include "epx/quant.h"
#include "ref/quant.h"

#ifdef EPX_HAVE_CUDA
#include "cuda/quant/quant.h"
#endif

namespace epx {

using detail::check_device;
using detail::check_tensor;

namespace {

bool valid_recipe(QuantRecipe r) {
  switch (r) {
    case QuantRecipe::kFp8Block1x128: case QuantRecipe::kFp8Block128x128:
    case QuantRecipe::kMxfp8Rowwise: case QuantRecipe::kMxfp8Colwise: return true;
  }
  return false;
}

void check_recipe(const char* fn, QuantRecipe r) {
  require(valid_recipe(r), fn, "recipe has value ", static_cast<int>(r),
          ", expected fp8_block_1x128 (0), fp8_block_128x128 (1), mxfp8_rowwise (2) or mxfp8_colwise (3)");
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_scales(const char* fn, QuantRecipe recipe, const TensorRef& scales, int64_t M, int64_t N) {
  const Shape s = quant_scale_shape(recipe, M, N);
  check_tensor(fn, "scales", scales, {s[0], s[1]}, {quant_scale_dtype(recipe)});
}

// The reference writes q and scales while reading x (and x_out while reading q and scales): an
// overlap would silently corrupt the result, so it is refused up front.
void check_disjoint(const char* fn, const char* a_name, const TensorRef& a, const char* b_name, const TensorRef& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0 || a.device() != b.device()) return;
  const auto a0 = reinterpret_cast<uintptr_t>(a.data()), b0 = reinterpret_cast<uintptr_t>(b.data());
  require(a0 + a.nbytes() <= b0 || b0 + b.nbytes() <= a0, fn, a_name, " overlaps ", b_name,
          " in memory, expected separate buffers");
}

#ifndef EPX_HAVE_CUDA
[[noreturn]] void refuse_cuda(const char* fn) {
  throw Error(Status::kNotSupported, std::string(fn) + ": CUDA tensors need the CUDA backend, which this build does not have");
}
#endif

}  // namespace

const char* quant_recipe_name(QuantRecipe recipe) {
  switch (recipe) {
    case QuantRecipe::kFp8Block1x128: return "fp8_block_1x128";
    case QuantRecipe::kFp8Block128x128: return "fp8_block_128x128";
    case QuantRecipe::kMxfp8Rowwise: return "mxfp8_rowwise";
    case QuantRecipe::kMxfp8Colwise: return "mxfp8_colwise";
  }
  return "?";
}

Shape quant_scale_shape(QuantRecipe recipe, int64_t M, int64_t N) {
  const char* fn = "epx::quant_scale_shape";
  check_recipe(fn, recipe);
  require(M >= 0, fn, "M is ", M, ", expected >= 0");
  require(N >= 0, fn, "N is ", N, ", expected >= 0");
  const ref::QuantBlock b = ref::quant_block(recipe);
  return Shape{ceil_div(M, b.rows), ceil_div(N, b.cols)};
}

DType quant_scale_dtype(QuantRecipe recipe) {
  check_recipe("epx::quant_scale_dtype", recipe);
  const bool mx = recipe == QuantRecipe::kMxfp8Rowwise || recipe == QuantRecipe::kMxfp8Colwise;
  return mx ? DType::kE8M0 : DType::kF32;
}

void quantize(QuantRecipe recipe, const TensorRef& x, const TensorRef& q, const TensorRef& scales,
              const QuantOptions& options, Stream stream) {
  const char* fn = "epx::quantize";
  check_recipe(fn, recipe);
  require(options.mx_rounding == E8M0Rounding::kFloor || options.mx_rounding == E8M0Rounding::kCeil, fn,
          "options.mx_rounding has value ", static_cast<int>(options.mx_rounding), ", expected kFloor (0) or kCeil (1)");
  check_tensor(fn, "x", x, {-1, -1}, {DType::kF32, DType::kBF16, DType::kF16});
  const int64_t M = x.size(0), N = x.size(1);
  check_tensor(fn, "q", q, {M, N}, {DType::kF8E4M3});
  check_scales(fn, recipe, scales, M, N);
  check_device(fn, "q", q, x.device());
  check_device(fn, "scales", scales, x.device());
  check_disjoint(fn, "q", q, "x", x);
  check_disjoint(fn, "scales", scales, "x", x);
  check_disjoint(fn, "scales", scales, "q", q);
  if (x.device().is_cuda()) {
#ifdef EPX_HAVE_CUDA
    cuda::quantize(recipe, x, q, scales, options.mx_rounding, stream);
    return;
#else
    refuse_cuda(fn);
#endif
  }
  ref::quantize(recipe, x, q, scales, options);
}

void dequantize(QuantRecipe recipe, const TensorRef& q, const TensorRef& scales, const TensorRef& x_out,
                Stream stream) {
  const char* fn = "epx::dequantize";
  check_recipe(fn, recipe);
  check_tensor(fn, "q", q, {-1, -1}, {DType::kF8E4M3});
  const int64_t M = q.size(0), N = q.size(1);
  check_scales(fn, recipe, scales, M, N);
  check_tensor(fn, "x_out", x_out, {M, N}, {DType::kF32, DType::kBF16, DType::kF16});
  check_device(fn, "scales", scales, q.device());
  check_device(fn, "x_out", x_out, q.device());
  check_disjoint(fn, "x_out", x_out, "q", q);
  check_disjoint(fn, "x_out", x_out, "scales", scales);
  if (q.device().is_cuda()) {
#ifdef EPX_HAVE_CUDA
    cuda::dequantize(recipe, q, scales, x_out, stream);
    return;
#else
    refuse_cuda(fn);
#endif
  }
  ref::dequantize(recipe, q, scales, x_out);
}

}  // namespace epx
