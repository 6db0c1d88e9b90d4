// CPU reference of the FP8 block and MXFP8 quantization (semantics in include/epx/quant.h): the
// oracle the GPU kernels are tested against. Arguments are assumed validated by the public entry
// points in src/moe/quant_ops.cpp.
#pragma once

#include <cstdint>

#include "epx/quant.h"

namespace epx::ref {

/// Block extent of a recipe: br rows x bc columns.
struct QuantBlock {
  int64_t rows, cols;
};
QuantBlock quant_block(QuantRecipe recipe);

/// The FP8 block recipe's per-block numbers from the block's finite amax: the fp32 multiplier
/// 448 / max(amax, 1e-4) applied to the elements, and the stored scale max(amax, 1e-4) / 448.
float fp8_block_multiplier(float amax);
float fp8_block_scale(float amax);

/// MXFP8's E8M0 scale bits from the block's finite amax (>= 0).
uint8_t mx_scale_bits(float amax, E8M0Rounding rounding);

/// e4m3 code of x / 2^(bits - 127), rounded once from the exact quotient, saturating.
uint8_t mx_quantize_element(float x, uint8_t scale_bits);

void quantize(QuantRecipe recipe, const TensorRef& x, const TensorRef& q, const TensorRef& scales,
              const QuantOptions& options);
void dequantize(QuantRecipe recipe, const TensorRef& q, const TensorRef& scales, const TensorRef& x_out);

}  // namespace epx::ref
