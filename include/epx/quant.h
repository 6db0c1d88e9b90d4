// Quantization to FP8 e4m3 with block scales: DeepSeek-V3 / DeepGEMM style fp32 block scales and
// OCP MX v1.0 MXFP8 with E8M0 scales. These are the forward semantics the GPU kernels reproduce bit
// for bit; the CPU reference (epx::ref::quantize / dequantize) is their oracle.
//
// Layouts. x [M, N] fp32, bf16 or fp16 (row-major, N contiguous); q [M, N] fp8_e4m3; the scale of
// the block holding x[i, j] is scales[i / br, j / bc] for a block of br rows x bc columns:
//   kFp8Block1x128     br = 1,   bc = 128  scales [M, ceil(N/128)]             fp32  (activations)
//   kFp8Block128x128   br = 128, bc = 128  scales [ceil(M/128), ceil(N/128)]   fp32  (weights)
//   kMxfp8Rowwise      br = 1,   bc = 32   scales [M, ceil(N/32)]              e8m0  (blocks along N,
//                                                                   the contraction dim of x[M, K])
//   kMxfp8Colwise      br = 32,  bc = 1    scales [ceil(M/32), N]              e8m0  (blocks along M)
// Partial blocks at the bottom/right edge are allowed and cover only the elements present. M or N
// may be 0 (nothing is read or written).
//
// amax (both families) = max |x| over the block's FINITE elements; NaN and +-inf never affect it.
//
// FP8 blocks (DeepGEMM's recipe), all arithmetic in fp32:
//   a     = max(amax, 1e-4f)                 (a zero or tiny block does not divide by zero)
//   r     = 448.0f / a                       (one fp32 division, RNE)
//   q     = cvt_e4m3_satfinite(x * r)        (one fp32 multiply, then RNE saturating conversion)
//   scale = a / 448.0f                       (fp32, stored as is)
//   NaN -> 0x7F; +-inf -> +-448 (0x7E / 0xFE). Note scale * r is not exactly 1 in fp32: dequantize
//   multiplies by the stored scale, it does not divide by r.
//
// MXFP8 (OCP MX v1.0, element type E4M3 with emax = 8). With amax = m * 2^p, m in [1, 2):
//   kFloor (the spec):  X = 2^(p - 8), so amax / X lies in [256, 512) and may saturate to 448;
//   kCeil (NVIDIA):     X = 2^ceil(log2(amax / 448)), the smallest power of two with amax <= 448 X,
//                       decided exactly (p - 8 if m <= 1.75, else p - 7), no float log2;
//   the E8M0 bits 127 + log2(X) are clamped to [0, 254]; amax == 0 (or no finite element) gives
//   bits 0, X = 2^-127. q = cvt_e4m3_satfinite(x / X) rounded once from the exact quotient (the
//   division by a power of two is exact unless it leaves the fp32 range, and both ways out round
//   to the same e4m3: +-448 above, +-0 below). NaN -> 0x7F; +-inf -> +-448.
//   For fp32 inputs the bits never exceed 247, so 1/X = 2^(127 - bits) is a normal fp32 and a
//   kernel may multiply by it instead of dividing.
//
// dequantize: x_out = e4m3 value * scale, one fp32 multiply (subnormal results kept, not flushed),
// then stored to x_out's dtype (fp32, bf16, fp16) with RNE. NaN codes or a NaN (0xFF) E8M0 scale
// give NaN.
//
// Errors: every argument is validated once (dtypes, 2-D shapes, scales exactly quant_scale_shape
// with quant_scale_dtype, one device for all tensors) and a violation throws epx::Error naming the
// function, the argument, what it has and what was expected. CUDA tensors run the kernels of
// src/cuda/quant, bit for bit the same results.
#pragma once

#include <cstdint>

#include "epx/dtype.h"
#include "epx/tensor.h"

namespace epx {

enum class QuantRecipe : uint8_t { kFp8Block1x128, kFp8Block128x128, kMxfp8Rowwise, kMxfp8Colwise };

/// "fp8_block_1x128", "fp8_block_128x128", "mxfp8_rowwise", "mxfp8_colwise" (stable: JSON, errors).
const char* quant_recipe_name(QuantRecipe recipe);

/// Shape of the scale tensor for x [M, N] under a recipe (see the table above), and its dtype.
Shape quant_scale_shape(QuantRecipe recipe, int64_t M, int64_t N);
DType quant_scale_dtype(QuantRecipe recipe);

struct QuantOptions {
  /// How MXFP8 picks the shared exponent; ignored by the FP8 block recipes.
  E8M0Rounding mx_rounding = E8M0Rounding::kFloor;
};

/// x [M, N] fp32/bf16/fp16 -> q [M, N] fp8_e4m3 and scales (quant_scale_shape, quant_scale_dtype).
void quantize(QuantRecipe recipe, const TensorRef& x, const TensorRef& q, const TensorRef& scales,
              const QuantOptions& options = {}, Stream stream = {});

/// q [M, N] fp8_e4m3 and its scales -> x_out [M, N] fp32/bf16/fp16.
void dequantize(QuantRecipe recipe, const TensorRef& q, const TensorRef& scales, const TensorRef& x_out,
                Stream stream = {});

}  // namespace epx
