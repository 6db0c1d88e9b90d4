// CPU reference of the FP8 block and MXFP8 quantization (semantics: include/epx/quant.h).
//
// One loop nest for all four recipes: the matrix is walked in strips of `br` rows (loaded once to
// fp32, exactly), each strip in blocks of `bc` columns; a block's amax is taken over its finite
// elements only, its scale is written once, and every element is converted by itself, so blocks
// are independent and the order of the walk cannot change a bit. Invariants the GPU kernels share:
// - FP8 blocks: r = 448 / max(amax, 1e-4) is ONE fp32 division per block and q = e4m3(x * r) ONE
//   fp32 multiply per element (no fma, no reciprocal approximation); the stored scale is
//   max(amax, 1e-4) / 448 in fp32, which is not 1/r: dequantize multiplies by it.
// - MXFP8: the exponent comes from frexp (exact), never from a float log2, and the element is
//   rounded once from the exact quotient x / 2^k.
#include "ref/quant.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace epx::ref {

namespace {

bool is_mx(QuantRecipe r) { return r == QuantRecipe::kMxfp8Rowwise || r == QuantRecipe::kMxfp8Colwise; }

// DeepGEMM clamps amax so that an all-zero (or all-NaN) block neither divides by zero nor
// produces an infinite multiplier.
constexpr float kAmaxFloor = 1e-4f;
constexpr float kE4M3Max = 448.0f;
constexpr int kE4M3Emax = 8;  // 448 = 1.75 * 2^8

}  // namespace

QuantBlock quant_block(QuantRecipe recipe) {
  switch (recipe) {
    case QuantRecipe::kFp8Block1x128: return {1, 128};
    case QuantRecipe::kFp8Block128x128: return {128, 128};
    case QuantRecipe::kMxfp8Rowwise: return {1, 32};
    case QuantRecipe::kMxfp8Colwise: return {32, 1};
  }
  return {1, 1};
}

float fp8_block_multiplier(float amax) { return kE4M3Max / std::max(amax, kAmaxFloor); }

float fp8_block_scale(float amax) { return std::max(amax, kAmaxFloor) / kE4M3Max; }

uint8_t mx_scale_bits(float amax, E8M0Rounding rounding) {
  if (!(amax > 0)) return 0;  // no finite non-zero element: the smallest scale, 2^-127
  int e2 = 0;
  const float m = std::frexp(amax, &e2);  // amax = m * 2^e2, m in [0.5, 1): exact, subnormals too
  const int p = e2 - 1;                   // amax = (2m) * 2^p, 2m in [1, 2)
  int k = p - kE4M3Emax;                  // floor(log2 amax) - 8
  // Ceil: the smallest k with amax <= 448 * 2^k = 1.75 * 2^(k + 8). k = p - 8 suffices iff
  // 2m <= 1.75, otherwise k = p - 7. 2m and 1.75 are exact floats: no rounding can flip the choice.
  if (rounding == E8M0Rounding::kCeil && 2.0f * m > 1.75f) k += 1;
  return static_cast<uint8_t>(std::clamp(k + 127, 0, 254));
}

uint8_t mx_quantize_element(float x, uint8_t scale_bits) {
  // The quotient is exact in double. Narrowing it to float is exact too unless it leaves fp32's
  // range, and there both roundings agree with the exact one: above 2^128 it saturates to +-448
  // either way, below 2^-126 it is far under e4m3's smallest half-step (2^-10) and gives +-0.
  const double quotient = std::ldexp(static_cast<double>(x), 127 - static_cast<int>(scale_bits));
  return float_to_e4m3_bits(static_cast<float>(quotient), Saturation::kSatFinite);
}

void quantize(QuantRecipe recipe, const TensorRef& x, const TensorRef& q, const TensorRef& scales,
              const QuantOptions& options) {
  const int64_t M = x.size(0), N = x.size(1);
  if (M == 0 || N == 0) return;
  const QuantBlock blk = quant_block(recipe);
  const bool mx = is_mx(recipe);
  const int64_t scale_cols = scales.size(1);
  uint8_t* qp = q.ptr<uint8_t>();
  std::vector<float> strip(static_cast<size_t>(std::min(blk.rows, M) * N));

  for (int64_t r0 = 0; r0 < M; r0 += blk.rows) {
    const int64_t nr = std::min(blk.rows, M - r0);
    load_row(x.data(), x.dtype(), r0 * N, nr * N, strip.data());  // rows are contiguous
    for (int64_t c0 = 0; c0 < N; c0 += blk.cols) {
      const int64_t nc = std::min(blk.cols, N - c0);
      float amax = 0.0f;
      for (int64_t i = 0; i < nr; ++i)
        for (int64_t j = 0; j < nc; ++j) {
          const float v = strip[i * N + c0 + j];
          if (std::isfinite(v)) amax = std::max(amax, std::fabs(v));
        }
      const int64_t s = (r0 / blk.rows) * scale_cols + c0 / blk.cols;
      if (mx) {
        const uint8_t bits = mx_scale_bits(amax, options.mx_rounding);
        scales.ptr<uint8_t>()[s] = bits;
        for (int64_t i = 0; i < nr; ++i)
          for (int64_t j = 0; j < nc; ++j) qp[(r0 + i) * N + c0 + j] = mx_quantize_element(strip[i * N + c0 + j], bits);
      } else {
        const float mul = fp8_block_multiplier(amax);
        scales.ptr<float>()[s] = fp8_block_scale(amax);
        for (int64_t i = 0; i < nr; ++i)
          for (int64_t j = 0; j < nc; ++j) {
            const float scaled = strip[i * N + c0 + j] * mul;  // fp32 product, then one conversion
            qp[(r0 + i) * N + c0 + j] = float_to_e4m3_bits(scaled, Saturation::kSatFinite);
          }
      }
    }
  }
}

void dequantize(QuantRecipe recipe, const TensorRef& q, const TensorRef& scales, const TensorRef& x_out) {
  const int64_t M = q.size(0), N = q.size(1);
  if (M == 0 || N == 0) return;
  const QuantBlock blk = quant_block(recipe);
  const int64_t scale_cols = scales.size(1);
  std::vector<float> qrow(static_cast<size_t>(N)), srow(static_cast<size_t>(scale_cols)), out(static_cast<size_t>(N));
  for (int64_t i = 0; i < M; ++i) {
    load_row(q.data(), DType::kF8E4M3, i * N, N, qrow.data());
    load_row(scales.data(), scales.dtype(), (i / blk.rows) * scale_cols, scale_cols, srow.data());
    for (int64_t j = 0; j < N; ++j) out[j] = qrow[j] * srow[j / blk.cols];  // one fp32 multiply
    store_row(x_out.data(), x_out.dtype(), i * N, N, out.data());
  }
}

}  // namespace epx::ref
