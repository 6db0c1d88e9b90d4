// Launchers of the quantization kernels (FP8 1x128 / 128x128 blocks, MXFP8 rowwise / colwise):
// host-only declarations, no CUDA types, called by the public entry points in
// src/moe/quant_ops.cpp after they have validated every argument (recipe, dtypes, shapes, one CUDA
// device, no overlap). What is checked here is only what the kernels add: every pointer aligned to
// its element size. The launchers pick 16-byte vector kernels when the base pointers are 16-byte
// aligned and N is a multiple of the vector, element-wise kernels otherwise; both give the same bits
// (those of epx::ref::quantize / dequantize). They are stream-ordered and never synchronize the
// host; M == 0 or N == 0 launches nothing. CUDA errors throw epx::Error (kCudaError).
#pragma once

#include <functional>

#include "epx/quant.h"
#include "epx/tensor.h"

namespace epx::cuda {

/// Launch tuning, separate from the problem. 0 / false = automatic.
struct QuantTuning {
  /// Cap on grid.y (row tiles / block rows / strips run in a loop beyond it); 0 = the hardware
  /// limit 65535. Tests set it low to exercise the loops.
  int max_grid_y = 0;
  /// Run the element-wise kernels even where the 16-byte ones apply (tests, debugging).
  bool force_scalar = false;
  /// Rows each thread keeps in flight in the row-recipe (1x128, MX rowwise) and dequantize vector
  /// kernels: 4 or 8; 0 = auto (4: measured best or tied on H200 for every recipe).
  /// The element-wise kernels always use 4.
  int rows_per_thread = 0;
};

/// x [M, N] fp32/bf16/fp16 -> q [M, N] e4m3 and scales (quant_scale_shape / quant_scale_dtype).
void quantize(QuantRecipe recipe, const TensorRef& x, const TensorRef& q, const TensorRef& scales,
              E8M0Rounding mx_rounding, Stream stream, const QuantTuning& tuning = {});

/// q [M, N] e4m3 and its scales -> x_out [M, N] fp32/bf16/fp16.
void dequantize(QuantRecipe recipe, const TensorRef& q, const TensorRef& scales, const TensorRef& x_out,
                Stream stream, const QuantTuning& tuning = {});

/// Quantizes x [M, N] (a row recipe or any other) into a temporary taken from the device's
/// stream-ordered pool (cudaMallocAsync on `stream`), calls use(q, scales), which must queue every
/// reader of the temporary on `stream`, and gives the memory back in stream order (cudaFreeAsync),
/// also when use throws. No host synchronisation and no device-wide allocation: safe inside a CUDA
/// graph capture and while peers' collectives are in flight.
void with_quantized(QuantRecipe recipe, const TensorRef& x, E8M0Rounding mx_rounding, Stream stream,
                    const std::function<void(const TensorRef& q, const TensorRef& scales)>& use);

/// What a GEMM with this recipe's quantization sees of x [M, N]: x quantized (through a stream-ordered
/// temporary, as with_quantized) and dequantized into `image` (x's shape; bf16, fp16 or fp32). With
/// e4m3 codes and power-of-two (MX) scales the image is exact in bf16.
void quantized_image(QuantRecipe recipe, const TensorRef& x, E8M0Rounding mx_rounding, const TensorRef& image,
                     Stream stream);

}  // namespace epx::cuda
