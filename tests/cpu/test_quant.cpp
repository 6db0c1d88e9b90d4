// Tests of the quantization reference (include/epx/quant.h). Hand-computed blocks pin the exact
// bytes and scales the GPU kernels must reproduce; e4m3 codes are written out by hand as
// S.EEEE.MMM with bias 7 (448 = 1.75 * 2^8 = 0.1111.110 = 0x7E, 1 = 0.0111.000 = 0x38, subnormals
// m * 2^-9). Random tests compare with a second, deliberately naive formulation of each recipe
// (per element: find the block by division and scan it; the MX exponent by a search over powers
// of two) and
// check the round-trip error bound of e4m3: half a step, i.e. 2^-4 relative for normal codes and
// 2^-10 of the block scale in the subnormal range.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "epx/error.h"
#include "epx/quant.h"
#include "epx/tensor.h"

namespace epx {
namespace {

constexpr QuantRecipe kAllRecipes[] = {QuantRecipe::kFp8Block1x128, QuantRecipe::kFp8Block128x128,
                                       QuantRecipe::kMxfp8Rowwise, QuantRecipe::kMxfp8Colwise};

bool is_mx(QuantRecipe r) { return r == QuantRecipe::kMxfp8Rowwise || r == QuantRecipe::kMxfp8Colwise; }

Tensor matrix(int64_t M, int64_t N, const std::vector<float>& v, DType t = DType::kF32) {
  Tensor x = Tensor::zeros({M, N}, t);
  if (!v.empty()) store_row(x.data(), t, 0, M * N, v.data());
  return x;
}

struct Quantized {
  Tensor q, scales;
  uint8_t byte(int64_t i, int64_t j) const { return q.ptr<uint8_t>()[i * q.size(1) + j]; }
  float scale(int64_t i, int64_t j) const { return scales.ptr<float>()[i * scales.size(1) + j]; }
  uint8_t bits(int64_t i, int64_t j) const { return scales.ptr<uint8_t>()[i * scales.size(1) + j]; }
};

// Outputs start as 0xAB bytes, so an element or scale the op forgets to write shows up.
Quantized run_quantize(QuantRecipe r, const Tensor& x, E8M0Rounding mode = E8M0Rounding::kFloor) {
  Quantized out;
  out.q = Tensor::empty({x.size(0), x.size(1)}, DType::kF8E4M3);
  out.scales = Tensor::empty(quant_scale_shape(r, x.size(0), x.size(1)), quant_scale_dtype(r));
  if (out.q.nbytes()) std::memset(out.q.data(), 0xAB, out.q.nbytes());
  if (out.scales.nbytes()) std::memset(out.scales.data(), 0xAB, out.scales.nbytes());
  QuantOptions o;
  o.mx_rounding = mode;
  quantize(r, x, out.q, out.scales, o);
  return out;
}

Tensor run_dequantize(QuantRecipe r, const Quantized& qs, DType out_dtype = DType::kF32) {
  Tensor x = Tensor::zeros({qs.q.size(0), qs.q.size(1)}, out_dtype);
  dequantize(r, qs.q, qs.scales, x);
  return x;
}

// A 1 x n row quantized under recipe r (1x128 or rowwise), padded with zeros to n.
Quantized one_row(QuantRecipe r, std::vector<float> v, int64_t n, E8M0Rounding mode = E8M0Rounding::kFloor) {
  v.resize(static_cast<size_t>(n), 0.0f);
  return run_quantize(r, matrix(1, n, v), mode);
}

// ---- shapes and names ----------------------------------------------------------------------

TEST(QuantShape, ScaleShapesAndDtypes) {
  EXPECT_EQ(quant_scale_shape(QuantRecipe::kFp8Block1x128, 4096, 7168), (Shape{4096, 56}));
  EXPECT_EQ(quant_scale_shape(QuantRecipe::kFp8Block128x128, 4096, 7168), (Shape{32, 56}));
  EXPECT_EQ(quant_scale_shape(QuantRecipe::kMxfp8Rowwise, 4096, 7168), (Shape{4096, 224}));
  EXPECT_EQ(quant_scale_shape(QuantRecipe::kMxfp8Colwise, 4096, 7168), (Shape{128, 7168}));
  // Partial edge blocks round up.
  EXPECT_EQ(quant_scale_shape(QuantRecipe::kFp8Block1x128, 130, 129), (Shape{130, 2}));
  EXPECT_EQ(quant_scale_shape(QuantRecipe::kFp8Block128x128, 129, 130), (Shape{2, 2}));
  EXPECT_EQ(quant_scale_shape(QuantRecipe::kMxfp8Rowwise, 130, 33), (Shape{130, 2}));
  EXPECT_EQ(quant_scale_shape(QuantRecipe::kMxfp8Colwise, 33, 130), (Shape{2, 130}));
  // Empty matrices.
  EXPECT_EQ(quant_scale_shape(QuantRecipe::kFp8Block1x128, 0, 7), (Shape{0, 1}));
  EXPECT_EQ(quant_scale_shape(QuantRecipe::kFp8Block128x128, 3, 0), (Shape{1, 0}));
  EXPECT_EQ(quant_scale_shape(QuantRecipe::kMxfp8Rowwise, 0, 0), (Shape{0, 0}));
  EXPECT_EQ(quant_scale_shape(QuantRecipe::kMxfp8Colwise, 0, 5), (Shape{0, 5}));
  EXPECT_EQ(quant_scale_dtype(QuantRecipe::kFp8Block1x128), DType::kF32);
  EXPECT_EQ(quant_scale_dtype(QuantRecipe::kFp8Block128x128), DType::kF32);
  EXPECT_EQ(quant_scale_dtype(QuantRecipe::kMxfp8Rowwise), DType::kE8M0);
  EXPECT_EQ(quant_scale_dtype(QuantRecipe::kMxfp8Colwise), DType::kE8M0);
}

TEST(QuantShape, NamesAndBadArguments) {
  EXPECT_STREQ(quant_recipe_name(QuantRecipe::kFp8Block1x128), "fp8_block_1x128");
  EXPECT_STREQ(quant_recipe_name(QuantRecipe::kFp8Block128x128), "fp8_block_128x128");
  EXPECT_STREQ(quant_recipe_name(QuantRecipe::kMxfp8Rowwise), "mxfp8_rowwise");
  EXPECT_STREQ(quant_recipe_name(QuantRecipe::kMxfp8Colwise), "mxfp8_colwise");
  EXPECT_STREQ(quant_recipe_name(static_cast<QuantRecipe>(9)), "?");
  auto message_of = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.status() == Status::kInvalidArgument ? e.what() : "wrong status";
    }
    return "no error";
  };
  EXPECT_EQ(message_of([] { quant_scale_shape(QuantRecipe::kMxfp8Rowwise, -1, 4); }),
            "epx::quant_scale_shape: M is -1, expected >= 0");
  EXPECT_EQ(message_of([] { quant_scale_shape(QuantRecipe::kMxfp8Rowwise, 1, -4); }),
            "epx::quant_scale_shape: N is -4, expected >= 0");
  EXPECT_NE(message_of([] { quant_scale_shape(static_cast<QuantRecipe>(9), 1, 1); })
                .find("epx::quant_scale_shape: recipe has value 9"),
            std::string::npos);
  EXPECT_NE(message_of([] { quant_scale_dtype(static_cast<QuantRecipe>(4)); }).find("recipe has value 4"),
            std::string::npos);
}

// ---- FP8 blocks (DeepGEMM recipe) -------------------------------------------------------------

TEST(QuantFp8Block, UnitScaleBlock) {
  // amax 448: multiplier 448 / 448 = 1, scale 1.
  Quantized r = one_row(QuantRecipe::kFp8Block1x128, {448, 224, -1, 0, 0.5f, -448}, 128);
  EXPECT_EQ(r.byte(0, 0), 0x7E);  // 448 = 1.75 * 2^8
  EXPECT_EQ(r.byte(0, 1), 0x76);  // 224 = 1.75 * 2^7
  EXPECT_EQ(r.byte(0, 2), 0xB8);  // -1
  EXPECT_EQ(r.byte(0, 3), 0x00);
  EXPECT_EQ(r.byte(0, 4), 0x30);  // 0.5 = 2^-1
  EXPECT_EQ(r.byte(0, 5), 0xFE);
  for (int j = 6; j < 128; ++j) EXPECT_EQ(r.byte(0, j), 0x00) << j;
  EXPECT_EQ(r.scales.shape(), (Shape{1, 1}));
  EXPECT_EQ(r.scale(0, 0), 1.0f);
}

TEST(QuantFp8Block, AmaxAbove448GivesScale2) {
  // amax 896 (a negative element: the sign does not matter), multiplier 0.5, scale 2.
  Quantized r = one_row(QuantRecipe::kFp8Block1x128, {1, -896, -3, 100, 0.75f}, 128);
  EXPECT_EQ(r.byte(0, 0), 0x30);  // 0.5
  EXPECT_EQ(r.byte(0, 1), 0xFE);  // -448
  EXPECT_EQ(r.byte(0, 2), 0xBC);  // -1.5 = -(1 + 4/8)
  EXPECT_EQ(r.byte(0, 3), 0x64);  // 50: tie between 48 (m=4) and 52 (m=5) -> 48, the even one
  EXPECT_EQ(r.byte(0, 4), 0x2C);  // 0.375 = 1.5 * 2^-2
  EXPECT_EQ(r.scale(0, 0), 2.0f);
}

TEST(QuantFp8Block, TinyBlockHitsAmaxClamp) {
  // amax 2e-5 < 1e-4: the block is scaled as if its amax were 1e-4, so it does not fill the range.
  Quantized r = one_row(QuantRecipe::kFp8Block1x128, {1e-5f, -2e-5f}, 128);
  EXPECT_EQ(r.byte(0, 0), 0x63);  // 1e-5 * 4.48e6 = 44.8 -> 44 = 1.375 * 2^5
  EXPECT_EQ(r.byte(0, 1), 0xEB);  // -89.6 -> -88 = -1.375 * 2^6
  EXPECT_EQ(r.scale(0, 0), 1e-4f / 448.0f);
  EXPECT_NEAR(r.scale(0, 0), 2.2321428e-7, 1e-13);
}

TEST(QuantFp8Block, ZeroBlock) {
  Quantized r = one_row(QuantRecipe::kFp8Block1x128, {0, -0.0f}, 128);
  EXPECT_EQ(r.byte(0, 0), 0x00);
  EXPECT_EQ(r.byte(0, 1), 0x80);  // -0 * multiplier keeps its sign
  for (int j = 2; j < 128; ++j) EXPECT_EQ(r.byte(0, j), 0x00);
  EXPECT_EQ(r.scale(0, 0), 1e-4f / 448.0f);
  EXPECT_TRUE(std::isfinite(r.scale(0, 0)));
}

TEST(QuantFp8Block, NaNAndInfDoNotAffectAmax) {
  Quantized r = one_row(QuantRecipe::kFp8Block1x128, {NAN, INFINITY, -INFINITY, 2, -1, -NAN}, 128);
  EXPECT_EQ(r.byte(0, 0), 0x7F);  // NaN
  EXPECT_EQ(r.byte(0, 1), 0x7E);  // +inf saturates to 448
  EXPECT_EQ(r.byte(0, 2), 0xFE);  // -inf to -448
  EXPECT_EQ(r.byte(0, 3), 0x7E);  // 2 is the finite amax
  EXPECT_EQ(r.byte(0, 4), 0xF6);  // -224
  EXPECT_EQ(r.byte(0, 5), 0x7F);  // NaN of either sign is 0x7F
  EXPECT_EQ(r.scale(0, 0), 2.0f / 448.0f);
  // A block with no finite element falls back to the clamp.
  Quantized s = one_row(QuantRecipe::kFp8Block1x128, {NAN, INFINITY}, 3);
  EXPECT_EQ(s.byte(0, 0), 0x7F);
  EXPECT_EQ(s.byte(0, 1), 0x7E);
  EXPECT_EQ(s.scale(0, 0), 1e-4f / 448.0f);
}

TEST(QuantFp8Block, SubnormalResults) {
  Quantized r = one_row(QuantRecipe::kFp8Block1x128,
                        {448, 0x1p-9f, 0.01f, -0.005f, 3 * 0x1p-10f, 0x1p-10f, -0x1p-11f, 7.5f * 0x1p-9f}, 128);
  EXPECT_EQ(r.byte(0, 1), 0x01);  // smallest subnormal 2^-9
  EXPECT_EQ(r.byte(0, 2), 0x05);  // 5.12 steps
  EXPECT_EQ(r.byte(0, 3), 0x83);  // -2.56 steps
  EXPECT_EQ(r.byte(0, 4), 0x02);  // 1.5 steps: tie, to even
  EXPECT_EQ(r.byte(0, 5), 0x00);  // 0.5 steps: tie, to zero
  EXPECT_EQ(r.byte(0, 6), 0x80);  // underflow keeps the sign
  EXPECT_EQ(r.byte(0, 7), 0x08);  // 7.5 steps: tie, to the smallest normal 2^-6
}

// The arithmetic is pinned, not just the value: r = fl(448 / amax) once, then fl(x * r). With
// amax = 3 these two elements sit next to an e4m3 midpoint, where other formulations differ:
// dividing by the stored scale (x / fl(3 / 448)) lands exactly on the midpoint of the first one and
// rounds it up to 0x36; the exactly rounded real product 448 x / 3 lies just above the midpoint of
// the second one, i.e. 0x15. The recipe gives 0x35 and 0x14.
TEST(QuantFp8Block, MultiplierIsOneFp32DivisionThenOneFp32Multiply) {
  const float x1 = 0x1.724924p-8f, x2 = 0x1.56db6ep-12f;
  Quantized r = one_row(QuantRecipe::kFp8Block1x128, {3, x1, x2}, 128);
  EXPECT_EQ(r.byte(0, 0), 0x7E);
  EXPECT_EQ(r.byte(0, 1), 0x35);
  EXPECT_EQ(r.byte(0, 2), 0x14);
  EXPECT_EQ(r.scale(0, 0), 3.0f / 448.0f);
  // The premises of the two claims above, so that the test explains itself if it ever fails.
  const float mul = 448.0f / 3.0f;
  EXPECT_EQ(float_to_e4m3_bits(x1 / (3.0f / 448.0f)), 0x36);
  EXPECT_EQ(x2 * mul, 0x1.9p-5f);  // exactly the midpoint between codes 0x14 and 0x15
  EXPECT_GT(static_cast<double>(x2) * 448.0 / 3.0, 0x1.9p-5);
}

TEST(QuantFp8Block, PartialEdgeBlocks1x128) {
  std::vector<float> v(2 * 130, 0.0f);
  v[5] = 448;           // row 0, block 0
  v[128] = 3;           // row 0, block 1 (2 columns)
  v[129] = -1.5f;
  for (int j = 0; j < 128; ++j) v[130 + j] = 1;  // row 1, block 0; block 1 stays zero
  Quantized r = run_quantize(QuantRecipe::kFp8Block1x128, matrix(2, 130, v));
  ASSERT_EQ(r.scales.shape(), (Shape{2, 2}));
  EXPECT_EQ(r.scale(0, 0), 1.0f);
  EXPECT_EQ(r.scale(0, 1), 3.0f / 448.0f);  // amax over the 2 present columns only
  EXPECT_EQ(r.scale(1, 0), 1.0f / 448.0f);
  EXPECT_EQ(r.scale(1, 1), 1e-4f / 448.0f);
  EXPECT_EQ(r.byte(0, 5), 0x7E);
  EXPECT_EQ(r.byte(0, 128), 0x7E);
  EXPECT_EQ(r.byte(0, 129), 0xF6);  // -1.5 * (448 / 3) ~ -224
  EXPECT_EQ(r.byte(1, 0), 0x7E);
  EXPECT_EQ(r.byte(1, 127), 0x7E);
  EXPECT_EQ(r.byte(1, 129), 0x00);
}

TEST(QuantFp8Block, PartialEdgeBlocks128x128) {
  const int64_t M = 130, N = 130;
  std::vector<float> v(M * N, 0.5f);
  v[3 * N + 7] = 448;         // block (0, 0): scale 1
  v[100 * N + 129] = 896;     // block (0, 1), 128 x 2: scale 2
  v[129 * N + 0] = -224;      // block (1, 0), 2 x 128: scale 0.5
  v[128 * N + 128] = 56;      // block (1, 1), 2 x 2: scale 0.125
  Quantized r = run_quantize(QuantRecipe::kFp8Block128x128, matrix(M, N, v));
  ASSERT_EQ(r.scales.shape(), (Shape{2, 2}));
  EXPECT_EQ(r.scale(0, 0), 1.0f);
  EXPECT_EQ(r.scale(0, 1), 2.0f);
  EXPECT_EQ(r.scale(1, 0), 0.5f);
  EXPECT_EQ(r.scale(1, 1), 0.125f);
  EXPECT_EQ(r.byte(3, 7), 0x7E);
  EXPECT_EQ(r.byte(100, 129), 0x7E);
  EXPECT_EQ(r.byte(129, 0), 0xFE);
  EXPECT_EQ(r.byte(128, 128), 0x7E);
  // The 0.5 filler, scaled by each block's own multiplier 1, 0.5, 2, 8.
  EXPECT_EQ(r.byte(0, 0), 0x30);      // 0.5
  EXPECT_EQ(r.byte(127, 127), 0x30);
  EXPECT_EQ(r.byte(0, 128), 0x28);    // 0.25
  EXPECT_EQ(r.byte(127, 128), 0x28);
  EXPECT_EQ(r.byte(128, 0), 0x38);    // 1
  EXPECT_EQ(r.byte(129, 127), 0x38);
  EXPECT_EQ(r.byte(129, 129), 0x48);  // 4
}

// ---- MXFP8 ---------------------------------------------------------------------------------

// (E8M0 bits, first e4m3 byte) of a single element quantized as its own MX block.
std::pair<int, int> mx_single(float v, E8M0Rounding mode) {
  Quantized r = run_quantize(QuantRecipe::kMxfp8Rowwise, matrix(1, 1, {v}), mode);
  Quantized c = run_quantize(QuantRecipe::kMxfp8Colwise, matrix(1, 1, {v}), mode);
  EXPECT_EQ(r.bits(0, 0), c.bits(0, 0));
  EXPECT_EQ(r.byte(0, 0), c.byte(0, 0));
  return {r.bits(0, 0), r.byte(0, 0)};
}

TEST(QuantMx, FloorVsCeilAt449) {
  const std::vector<float> v = {449, 1, -2};
  Quantized f = one_row(QuantRecipe::kMxfp8Rowwise, v, 32, E8M0Rounding::kFloor);
  EXPECT_EQ(f.bits(0, 0), 127);   // X = 2^floor(log2 449) / 2^8 = 2^0
  EXPECT_EQ(f.byte(0, 0), 0x7E);  // 449 saturates to 448
  EXPECT_EQ(f.byte(0, 1), 0x38);  // 1
  EXPECT_EQ(f.byte(0, 2), 0xC0);  // -2
  Quantized c = one_row(QuantRecipe::kMxfp8Rowwise, v, 32, E8M0Rounding::kCeil);
  EXPECT_EQ(c.bits(0, 0), 128);   // X = 2^ceil(log2(449 / 448)) = 2^1
  EXPECT_EQ(c.byte(0, 0), 0x76);  // 224.5 -> 224
  EXPECT_EQ(c.byte(0, 1), 0x30);  // 0.5
  EXPECT_EQ(c.byte(0, 2), 0xB8);  // -1
  // Real saturation: 500 / 2^0 is past 464, the tie above 448.
  EXPECT_EQ(mx_single(500, E8M0Rounding::kFloor), std::make_pair(127, 0x7E));
  EXPECT_EQ(mx_single(-500, E8M0Rounding::kFloor), std::make_pair(127, 0xFE));
  EXPECT_EQ(mx_single(500, E8M0Rounding::kCeil), std::make_pair(128, 0x78));  // 250 -> 256
}

TEST(QuantMx, ScaleExponentBoundaries) {
  using P = std::pair<int, int>;
  const E8M0Rounding F = E8M0Rounding::kFloor, C = E8M0Rounding::kCeil;
  EXPECT_EQ(mx_single(256, F), P(127, 0x78));
  EXPECT_EQ(mx_single(256, C), P(127, 0x78));
  EXPECT_EQ(mx_single(448, F), P(127, 0x7E));
  EXPECT_EQ(mx_single(448, C), P(127, 0x7E));                               // 448 <= 448 * 2^0
  EXPECT_EQ(mx_single(std::nextafter(448.0f, 1e9f), C).first, 128);        // just above: 2^1
  EXPECT_EQ(mx_single(std::nextafter(448.0f, 1e9f), F).first, 127);
  EXPECT_EQ(mx_single(std::nextafter(512.0f, 0.0f), F), P(127, 0x7E));     // floor's worst case
  EXPECT_EQ(mx_single(1, F), P(119, 0x78));                                // 1 / 2^-8 = 256
  EXPECT_EQ(mx_single(1, C), P(119, 0x78));
  EXPECT_EQ(mx_single(1.75f, C), P(119, 0x7E));                            // exactly 448 * 2^-8
  EXPECT_EQ(mx_single(std::nextafter(1.75f, 2.0f), C), P(120, 0x76));      // ~224 -> 224
  EXPECT_EQ(mx_single(std::nextafter(1.75f, 2.0f), F), P(119, 0x7E));
  EXPECT_EQ(mx_single(-0.75f, F), P(118, 0xFC));                           // -0.75 / 2^-9 = -384
  // The extremes of fp32: no clamping needed at the top (bits <= 247), clamping at the bottom.
  EXPECT_EQ(mx_single(FLT_MAX, F), P(246, 0x7E));                          // ~511.99 saturates
  EXPECT_EQ(mx_single(FLT_MAX, C), P(247, 0x78));                          // ~255.99 -> 256
  EXPECT_EQ(mx_single(0x1p-119f, F), P(0, 0x78));                          // 2^-127 exactly: 256
  EXPECT_EQ(mx_single(0x1p-118f, F), P(1, 0x78));
  EXPECT_EQ(mx_single(0x1p-130f, F), P(0, 0x20));                          // clamped: 2^-3
  EXPECT_EQ(mx_single(0x1p-130f, C), P(0, 0x20));
  EXPECT_EQ(mx_single(0x1p-149f, F), P(0, 0x00));                          // 2^-22 rounds to 0
}

TEST(QuantMx, ZeroNaNAndInfBlocks) {
  for (E8M0Rounding mode : {E8M0Rounding::kFloor, E8M0Rounding::kCeil}) {
    Quantized z = one_row(QuantRecipe::kMxfp8Rowwise, {0, -0.0f}, 32, mode);
    EXPECT_EQ(z.bits(0, 0), 0);  // amax 0: the smallest scale 2^-127
    EXPECT_EQ(z.byte(0, 0), 0x00);
    EXPECT_EQ(z.byte(0, 1), 0x80);
    Quantized n = one_row(QuantRecipe::kMxfp8Rowwise, {NAN, INFINITY, -INFINITY}, 32, mode);
    EXPECT_EQ(n.bits(0, 0), 0);  // no finite non-zero element
    EXPECT_EQ(n.byte(0, 0), 0x7F);
    EXPECT_EQ(n.byte(0, 1), 0x7E);
    EXPECT_EQ(n.byte(0, 2), 0xFE);
  }
  Quantized m = one_row(QuantRecipe::kMxfp8Rowwise, {NAN, 3, INFINITY}, 32, E8M0Rounding::kFloor);
  EXPECT_EQ(m.bits(0, 0), 120);   // amax 3: 2^(1 - 8)
  EXPECT_EQ(m.byte(0, 0), 0x7F);
  EXPECT_EQ(m.byte(0, 1), 0x7C);  // 384 = 1.5 * 2^8
  EXPECT_EQ(m.byte(0, 2), 0x7E);
}

TEST(QuantMx, SubnormalElementsUnderAHugeScale) {
  // amax 2^100: X = 2^92 (floor). Quotients 2^-9, 1.5 * 2^-10 and the tie 2^-10; computing x / X
  // in any way that rounds before the e4m3 conversion would be wrong here only if it lost bits.
  Quantized r = one_row(QuantRecipe::kMxfp8Rowwise, {0x1p100f, 0x1p83f, 1.5f * 0x1p82f, 0x1p82f, -0x1p81f, 0x1p91f},
                        32, E8M0Rounding::kFloor);
  EXPECT_EQ(r.bits(0, 0), 127 + 92);
  EXPECT_EQ(r.byte(0, 0), 0x78);  // 256
  EXPECT_EQ(r.byte(0, 1), 0x01);
  EXPECT_EQ(r.byte(0, 2), 0x01);  // 0.75 steps
  EXPECT_EQ(r.byte(0, 3), 0x00);  // 0.5 steps: tie to 0
  EXPECT_EQ(r.byte(0, 4), 0x80);
  EXPECT_EQ(r.byte(0, 5), 0x30);  // 0.5
}

TEST(QuantMx, RowwisePartialBlock) {
  std::vector<float> v(2 * 33, 1.0f);
  v[32] = 1000;   // row 0, the 1-element block: 2^(9 - 8) = 2, 500 saturates
  v[33 + 32] = 0; // row 1, the 1-element block is zero
  Quantized r = run_quantize(QuantRecipe::kMxfp8Rowwise, matrix(2, 33, v));
  ASSERT_EQ(r.scales.shape(), (Shape{2, 2}));
  EXPECT_EQ(r.bits(0, 0), 119);
  EXPECT_EQ(r.bits(0, 1), 128);
  EXPECT_EQ(r.bits(1, 0), 119);
  EXPECT_EQ(r.bits(1, 1), 0);
  EXPECT_EQ(r.byte(0, 31), 0x78);  // 1 / 2^-8
  EXPECT_EQ(r.byte(0, 32), 0x7E);
  EXPECT_EQ(r.byte(1, 32), 0x00);
}

TEST(QuantMx, ColwisePartialBlock) {
  const int64_t M = 33, N = 3;
  std::vector<float> v(M * N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) v[i * N + j] = static_cast<float>(j + 1);  // column j holds j + 1
  v[32 * N + 0] = 1000;  // row 32 of column 0, a block of its own
  v[10 * N + 2] = -12;   // column 2, block 0: amax 12
  Quantized r = run_quantize(QuantRecipe::kMxfp8Colwise, matrix(M, N, v));
  ASSERT_EQ(r.scales.shape(), (Shape{2, 3}));
  EXPECT_EQ(r.bits(0, 0), 119);  // amax 1 in rows 0..31: the 1000 below does not reach it
  EXPECT_EQ(r.bits(0, 1), 120);  // amax 2
  EXPECT_EQ(r.bits(0, 2), 122);  // amax 12 = 1.5 * 2^3
  EXPECT_EQ(r.bits(1, 0), 128);  // amax 1000 = 1.95 * 2^9
  EXPECT_EQ(r.bits(1, 1), 120);
  EXPECT_EQ(r.bits(1, 2), 120);  // amax 3 = 1.5 * 2^1
  EXPECT_EQ(r.byte(0, 0), 0x78);   // 1 / 2^-8 = 256
  EXPECT_EQ(r.byte(10, 2), 0xFC);  // -12 / 2^-5 = -384
  EXPECT_EQ(r.byte(0, 2), 0x6C);   // 3 / 2^-5 = 96 = 1.5 * 2^6 = 0.1101.100
}

// ---- dequantize ----------------------------------------------------------------------------

TEST(QuantDequant, HandComputed) {
  Quantized f;
  f.q = Tensor::zeros({1, 8}, DType::kF8E4M3);
  f.scales = Tensor::full({1, 1}, DType::kF32, 2.0);
  const uint8_t codes[8] = {0x7E, 0x30, 0xBC, 0x7F, 0x00, 0x80, 0x01, 0x76};
  std::memcpy(f.q.data(), codes, 8);
  Tensor x = run_dequantize(QuantRecipe::kFp8Block1x128, f);
  const float want[8] = {896, 1, -3, NAN, 0, -0.0f, 0x1p-8f, 448};
  for (int j = 0; j < 8; ++j) {
    const float got = x.ptr<float>()[j];
    if (std::isnan(want[j])) EXPECT_TRUE(std::isnan(got)) << j;
    else EXPECT_EQ(got, want[j]) << j;
    EXPECT_EQ(std::signbit(got), std::signbit(want[j])) << j;
  }

  Quantized m;
  m.q = Tensor::zeros({1, 96}, DType::kF8E4M3);
  m.scales = Tensor::zeros({1, 3}, DType::kE8M0);
  m.q.ptr<uint8_t>()[0] = 0x76;
  m.q.ptr<uint8_t>()[32] = 0x38;
  m.q.ptr<uint8_t>()[64] = 0x01;
  m.q.ptr<uint8_t>()[65] = 0x00;
  m.scales.ptr<uint8_t>()[0] = 128;   // 2
  m.scales.ptr<uint8_t>()[1] = 0xFF;  // NaN scale
  m.scales.ptr<uint8_t>()[2] = 0;     // 2^-127
  Tensor y = run_dequantize(QuantRecipe::kMxfp8Rowwise, m);
  EXPECT_EQ(y.ptr<float>()[0], 448.0f);
  EXPECT_TRUE(std::isnan(y.ptr<float>()[32]));
  EXPECT_EQ(y.ptr<float>()[64], 0x1p-136f);  // an fp32 subnormal, kept
  EXPECT_NE(y.ptr<float>()[64], 0.0f);
  EXPECT_EQ(y.ptr<float>()[65], 0.0f);
}

TEST(QuantDequant, NarrowOutputsRoundToNearestEven) {
  Quantized f;
  f.q = Tensor::zeros({1, 4}, DType::kF8E4M3);
  f.scales = Tensor::zeros({1, 1}, DType::kF32);
  auto run = [&](uint8_t code, float scale, DType t) {
    f.q.ptr<uint8_t>()[0] = code;
    f.scales.ptr<float>()[0] = scale;
    Tensor x = run_dequantize(QuantRecipe::kFp8Block1x128, f, t);
    return x.ptr<uint16_t>()[0];
  };
  EXPECT_EQ(run(0x38, 1 + 0x1p-8f, DType::kBF16), 0x3F80);       // bf16 tie -> 1
  EXPECT_EQ(run(0x38, 1 + 3 * 0x1p-8f, DType::kBF16), 0x3F82);   // bf16 tie -> 1 + 2^-6
  EXPECT_EQ(run(0x3F, 1 + 0x1p-10f, DType::kBF16), 0x3FF0);      // 1.87683 -> 1.875
  EXPECT_EQ(run(0x3F, 1 + 0x1p-10f, DType::kF16), 0x3F82);       // 1921.875 steps of 2^-10 -> 1922
  EXPECT_EQ(run(0x7E, 200.0f, DType::kF16), 0x7C00);             // 89600 overflows fp16
  EXPECT_EQ(run(0xFE, 146.25f, DType::kF16), 0xFC00);            // -65520: the tie goes to -inf
  EXPECT_EQ(run(0x7F, 1.0f, DType::kBF16), 0x7FFF);              // NaN stays NaN
}

// ---- random data ---------------------------------------------------------------------------

// Blocks of very different magnitudes (2^-30 .. 2^30), with exact zeros, so that every block has
// its own scale and the subnormal and saturated ranges are reached.
std::vector<float> random_matrix(int64_t M, int64_t N, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-30, 30);
  std::vector<int> block_exp(64 * 64);
  for (int& e : block_exp) e = expo(rng);
  std::vector<float> v(M * N);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      const int e = block_exp[(i / 5 % 64) * 64 + (j / 40 % 64)];
      v[i * N + j] = (rng() % 17 == 0) ? 0.0f : std::ldexp(normal(rng), e);
    }
  return v;
}

struct Naive {
  std::vector<uint8_t> q;
  std::vector<float> scale;      // fp32 scale, or the value of the E8M0 scale
  std::vector<uint8_t> bits;     // E8M0 bits (MX only)
};

// A second formulation of each recipe, as naive as possible: per element, find its block by
// division and scan it (cached), find the MX exponent by a search over powers of two.
Naive naive_quantize(QuantRecipe r, int64_t M, int64_t N, const std::vector<float>& x, E8M0Rounding mode) {
  const int64_t br = r == QuantRecipe::kFp8Block128x128 ? 128 : r == QuantRecipe::kMxfp8Colwise ? 32 : 1;
  const int64_t bc = r == QuantRecipe::kFp8Block1x128 || r == QuantRecipe::kFp8Block128x128 ? 128
                     : r == QuantRecipe::kMxfp8Rowwise                                       ? 32
                                                                                             : 1;
  Naive out;
  out.q.resize(M * N);
  const int64_t SM = (M + br - 1) / br, SN = (N + bc - 1) / bc;
  out.scale.resize(SM * SN);
  out.bits.resize(SM * SN);
  std::vector<double> block_amax(SM * SN, -1.0);  // a cache only: -1 = not scanned yet
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      const int64_t bi = i / br, bj = j / bc;
      double& amax = block_amax[bi * SN + bj];
      if (amax < 0) {
        amax = 0;
        for (int64_t a = bi * br; a < std::min(M, (bi + 1) * br); ++a)
          for (int64_t b = bj * bc; b < std::min(N, (bj + 1) * bc); ++b)
            if (std::isfinite(x[a * N + b])) amax = std::max(amax, std::fabs(static_cast<double>(x[a * N + b])));
      }
      const float xv = x[i * N + j];
      if (!is_mx(r)) {
        const float a = std::max(static_cast<float>(amax), 1e-4f);
        const float mul = 448.0f / a;
        out.q[i * N + j] = float_to_e4m3_bits(xv * mul);
        out.scale[bi * SN + bj] = a / 448.0f;
      } else {
        int k = -140;  // search for the exponent instead of computing it
        if (amax > 0) {
          if (mode == E8M0Rounding::kFloor)
            while (std::ldexp(1.0, k + 1 + 8) <= amax) ++k;       // largest k with 2^(k+8) <= amax
          else
            while (448.0 * std::ldexp(1.0, k) < amax) ++k;        // smallest k with amax <= 448 * 2^k
        }
        const int bits = std::min(254, std::max(0, k + 127));
        out.bits[bi * SN + bj] = static_cast<uint8_t>(bits);
        out.scale[bi * SN + bj] = static_cast<float>(std::ldexp(1.0, bits - 127));
        out.q[i * N + j] = float_to_e4m3_bits(static_cast<float>(std::ldexp(static_cast<double>(xv), 127 - bits)));
      }
    }
  return out;
}

TEST(QuantRandom, MatchesNaiveFormulation) {
  const int64_t M = 131, N = 300;
  std::vector<float> x = random_matrix(M, N, 7);
  x[5] = NAN;
  x[N + 3] = INFINITY;
  x[200 * 1 + 7] = -INFINITY;
  for (QuantRecipe r : kAllRecipes)
    for (E8M0Rounding mode : {E8M0Rounding::kFloor, E8M0Rounding::kCeil}) {
      if (!is_mx(r) && mode == E8M0Rounding::kCeil) continue;
      Quantized got = run_quantize(r, matrix(M, N, x), mode);
      Naive want = naive_quantize(r, M, N, x, mode);
      int bad = 0;
      for (int64_t i = 0; i < M * N; ++i)
        if (got.q.ptr<uint8_t>()[i] != want.q[i] && ++bad <= 5)
          ADD_FAILURE() << quant_recipe_name(r) << " q[" << i / N << ", " << i % N << "] = 0x" << std::hex
                        << int(got.q.ptr<uint8_t>()[i]) << ", expected 0x" << int(want.q[i]);
      ASSERT_EQ(got.scales.numel(), static_cast<int64_t>(want.scale.size()));
      for (int64_t s = 0; s < got.scales.numel(); ++s) {
        if (is_mx(r)) {
          if (got.scales.ptr<uint8_t>()[s] != want.bits[s] && ++bad <= 10)
            ADD_FAILURE() << quant_recipe_name(r) << " bits[" << s << "] = " << int(got.scales.ptr<uint8_t>()[s])
                          << ", expected " << int(want.bits[s]);
        } else if (got.scales.ptr<float>()[s] != want.scale[s] && ++bad <= 10) {
          ADD_FAILURE() << quant_recipe_name(r) << " scale[" << s << "] = " << got.scales.ptr<float>()[s]
                        << ", expected " << want.scale[s];
        }
      }
      EXPECT_EQ(bad, 0) << quant_recipe_name(r);
    }
}

TEST(QuantRandom, HalfPrecisionInputsMatchFp32) {
  const int64_t M = 70, N = 200;
  std::vector<float> x = random_matrix(M, N, 11);
  for (DType t : {DType::kBF16, DType::kF16}) {
    std::vector<float> xr(x.size());
    for (size_t i = 0; i < x.size(); ++i) xr[i] = static_cast<float>(round_to_dtype(x[i], t));
    for (QuantRecipe r : kAllRecipes) {
      Quantized a = run_quantize(r, matrix(M, N, xr, t)), b = run_quantize(r, matrix(M, N, xr));
      EXPECT_EQ(std::memcmp(a.q.data(), b.q.data(), a.q.nbytes()), 0) << dtype_name(t) << " " << quant_recipe_name(r);
      EXPECT_EQ(std::memcmp(a.scales.data(), b.scales.data(), a.scales.nbytes()), 0)
          << dtype_name(t) << " " << quant_recipe_name(r);
    }
  }
}

// |dequantize(quantize(x)) - x| is at most half an e4m3 step: 2^-4 |x| for normal codes, 2^-10 of
// the block scale for subnormal ones (plus a few fp32 roundings in the FP8 block recipe, whose
// multiplier and scale are not exact reciprocals). Elements that saturate (MX kFloor only, when
// |x| / X > 464) come back as exactly +-448 X.
TEST(QuantRandom, RoundTripErrorBound) {
  const int64_t M = 131, N = 300;
  const std::vector<float> x = random_matrix(M, N, 3);
  const double slack = 1 + 0x1p-18;
  for (QuantRecipe r : kAllRecipes)
    for (E8M0Rounding mode : {E8M0Rounding::kFloor, E8M0Rounding::kCeil}) {
      Quantized qs = run_quantize(r, matrix(M, N, x), mode);
      Tensor back = run_dequantize(r, qs);
      const int64_t br = r == QuantRecipe::kFp8Block128x128 ? 128 : r == QuantRecipe::kMxfp8Colwise ? 32 : 1;
      const int64_t bc = r == QuantRecipe::kMxfp8Colwise ? 1 : r == QuantRecipe::kMxfp8Rowwise ? 32 : 128;
      int bad = 0, saturated = 0, subnormal = 0;
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          const double xv = x[i * N + j], got = back.ptr<float>()[i * N + j];
          const int64_t s = (i / br) * qs.scales.size(1) + j / bc;
          const double scale = is_mx(r) ? e8m0_bits_to_float(qs.scales.ptr<uint8_t>()[s]) : qs.scales.ptr<float>()[s];
          const double scaled = std::fabs(xv) / scale;
          if (is_mx(r) && scaled > 464) {
            ++saturated;
            if (got != std::copysign(448 * scale, xv) && ++bad <= 5)
              ADD_FAILURE() << "saturated x = " << xv << " came back as " << got;
            continue;
          }
          subnormal += scaled < 0x1p-6 && xv != 0;
          const double bound = (0x1p-4 * std::fabs(xv) + 0x1p-10 * scale) * slack;
          if (!(std::fabs(got - xv) <= bound) && ++bad <= 5)
            ADD_FAILURE() << quant_recipe_name(r) << " x[" << i << ", " << j << "] = " << xv << " came back as " << got
                          << ", error " << std::fabs(got - xv) << " > " << bound;
        }
      EXPECT_EQ(bad, 0) << quant_recipe_name(r);
      EXPECT_GT(subnormal, 0) << quant_recipe_name(r) << ": the data should reach e4m3's subnormals";
      if (is_mx(r) && mode == E8M0Rounding::kCeil) {
        EXPECT_EQ(saturated, 0) << "kCeil never saturates";
      }
      if (!is_mx(r)) break;  // mx_rounding does not apply
    }
}

TEST(QuantRandom, NarrowOutputIsTheRoundedFp32Output) {
  const int64_t M = 40, N = 256;
  const std::vector<float> x = random_matrix(M, N, 5);
  for (QuantRecipe r : kAllRecipes) {
    Quantized qs = run_quantize(r, matrix(M, N, x));
    Tensor f32 = run_dequantize(r, qs);
    for (DType t : {DType::kBF16, DType::kF16}) {
      Tensor narrow = run_dequantize(r, qs, t);
      int bad = 0;
      for (int64_t i = 0; i < M * N; ++i) {
        const float v = f32.ptr<float>()[i];
        const uint16_t want = t == DType::kBF16 ? float_to_bf16_bits(v) : float_to_f16_bits(v);
        bad += narrow.ptr<uint16_t>()[i] != want;
      }
      EXPECT_EQ(bad, 0) << quant_recipe_name(r) << " -> " << dtype_name(t);
    }
  }
}

// ---- validation ----------------------------------------------------------------------------

// The message of the epx::Error `f` throws with kInvalidArgument ("no error" / "wrong status").
std::string invalid_argument(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    if (e.status() != Status::kInvalidArgument) return std::string("wrong status: ") + e.what();
    return e.what();
  }
  return "no error";
}

TEST(QuantValidation, ScaleShapeMessage) {
  Tensor x = Tensor::zeros({4, 7168}, DType::kBF16), q = Tensor::zeros({4, 7168}, DType::kF8E4M3);
  Tensor s = Tensor::zeros({4, 55}, DType::kF32);
  EXPECT_EQ(invalid_argument([&] { quantize(QuantRecipe::kFp8Block1x128, x, q, s); }),
            "epx::quantize: scales has shape [4, 55], expected [4, 56]");
  EXPECT_EQ(invalid_argument([&] { dequantize(QuantRecipe::kFp8Block1x128, q, s, x); }),
            "epx::dequantize: scales has shape [4, 55], expected [4, 56]");
}

TEST(QuantValidation, EveryBadArgumentIsNamed) {
  const int64_t M = 4, N = 128;
  Tensor x = Tensor::zeros({M, N}, DType::kF32), q = Tensor::zeros({M, N}, DType::kF8E4M3);
  Tensor s = Tensor::zeros({M, 1}, DType::kF32), sm = Tensor::zeros({M, 4}, DType::kE8M0);
  Tensor xi = Tensor::zeros({M, N}, DType::kI32), x1 = Tensor::zeros({M * N}, DType::kF32);
  Tensor q5 = Tensor::zeros({M, N}, DType::kF8E5M2), qn = Tensor::zeros({M, N - 1}, DType::kF8E4M3);
  Tensor qb = Tensor::zeros({M, N}, DType::kBF16), x3 = Tensor::zeros({1, M, N}, DType::kF32);
  Tensor xo8 = Tensor::zeros({M, N}, DType::kF8E4M3), xon = Tensor::zeros({M + 1, N}, DType::kF16);
  const TensorRef q_gpu(q.data(), DType::kF8E4M3, Shape{M, N}, Device::cuda(0));
  const TensorRef s_gpu(s.data(), DType::kF32, Shape{M, 1}, Device::cuda(0));
  const TensorRef xo_gpu(x.data(), DType::kF32, Shape{M, N}, Device::cuda(0));
  const TensorRef q_over_x(x.data(), DType::kF8E4M3, Shape{M, N});  // aliases x's bytes
  const TensorRef s_over_q(q.data(), DType::kF32, Shape{M, 1});
  const TensorRef xo_over_q(q.data(), DType::kBF16, Shape{M, N});
  const auto F = QuantRecipe::kFp8Block1x128, R = QuantRecipe::kMxfp8Rowwise;
  QuantOptions bad_rounding;
  bad_rounding.mx_rounding = static_cast<E8M0Rounding>(7);

  struct Case {
    std::function<void()> call;
    std::string expect;
  };
  const Case cases[] = {
      {[&] { quantize(static_cast<QuantRecipe>(7), x, q, s); }, "epx::quantize: recipe has value 7, expected"},
      {[&] { quantize(R, x, q, sm, bad_rounding); }, "epx::quantize: options.mx_rounding has value 7"},
      {[&] { quantize(F, TensorRef(), q, s); }, "epx::quantize: x is missing"},
      {[&] { quantize(F, xi, q, s); }, "epx::quantize: x has dtype int32, expected fp32, bf16 or fp16"},
      {[&] { quantize(F, x1, q, s); }, "epx::quantize: x has shape [512], expected [*, *]"},
      {[&] { quantize(F, x3, q, s); }, "epx::quantize: x has shape [1, 4, 128], expected [*, *]"},
      {[&] { quantize(F, x, TensorRef(), s); }, "epx::quantize: q is missing"},
      {[&] { quantize(F, x, q5, s); }, "epx::quantize: q has dtype fp8_e5m2, expected fp8_e4m3"},
      {[&] { quantize(F, x, qn, s); }, "epx::quantize: q has shape [4, 127], expected [4, 128]"},
      {[&] { quantize(F, x, q, TensorRef()); }, "epx::quantize: scales is missing"},
      {[&] { quantize(F, x, q, sm); }, "epx::quantize: scales has dtype e8m0, expected fp32"},
      {[&] { quantize(R, x, q, s); }, "epx::quantize: scales has dtype fp32, expected e8m0"},
      {[&] { quantize(QuantRecipe::kFp8Block128x128, x, q, s); },
       "epx::quantize: scales has shape [4, 1], expected [1, 1]"},
      {[&] { quantize(QuantRecipe::kMxfp8Colwise, x, q, sm); },
       "epx::quantize: scales has shape [4, 4], expected [1, 128]"},
      {[&] { quantize(F, x, q_gpu, s); }, "epx::quantize: q is on cuda:0, expected cpu"},
      {[&] { quantize(F, x, q, s_gpu); }, "epx::quantize: scales is on cuda:0, expected cpu"},
      {[&] { quantize(F, x, q_over_x, s); }, "epx::quantize: q overlaps x in memory"},
      {[&] { quantize(F, x, q, s_over_q); }, "epx::quantize: scales overlaps q in memory"},
      {[&] { dequantize(static_cast<QuantRecipe>(5), q, s, x); }, "epx::dequantize: recipe has value 5"},
      {[&] { dequantize(F, qb, s, x); }, "epx::dequantize: q has dtype bf16, expected fp8_e4m3"},
      {[&] { dequantize(F, TensorRef(), s, x); }, "epx::dequantize: q is missing"},
      {[&] { dequantize(R, q, s, x); }, "epx::dequantize: scales has dtype fp32, expected e8m0"},
      {[&] { dequantize(F, q, s, TensorRef()); }, "epx::dequantize: x_out is missing"},
      {[&] { dequantize(F, q, s, xi); }, "epx::dequantize: x_out has dtype int32, expected fp32, bf16 or fp16"},
      {[&] { dequantize(F, q, s, xo8); }, "epx::dequantize: x_out has dtype fp8_e4m3, expected fp32, bf16 or fp16"},
      {[&] { dequantize(F, q, s, xon); }, "epx::dequantize: x_out has shape [5, 128], expected [4, 128]"},
      {[&] { dequantize(F, q, s_gpu, x); }, "epx::dequantize: scales is on cuda:0, expected cpu"},
      {[&] { dequantize(F, q, s, xo_gpu); }, "epx::dequantize: x_out is on cuda:0, expected cpu"},
      {[&] { dequantize(F, q, s, xo_over_q); }, "epx::dequantize: x_out overlaps q in memory"},
  };
  for (const Case& c : cases) {
    const std::string msg = invalid_argument(c.call);
    EXPECT_EQ(msg.rfind(c.expect, 0), 0u) << "got:      " << msg << "\nexpected: " << c.expect << "...";
  }
}

TEST(QuantValidation, NothingIsWrittenWhenValidationFails) {
  Tensor x = Tensor::full({2, 64}, DType::kF32, 3.0);
  Tensor q = Tensor::full({2, 64}, DType::kU8, 0xAB);
  const TensorRef q8(q.data(), DType::kF8E4M3, Shape{2, 64});
  Tensor bad_scales = Tensor::zeros({2, 3}, DType::kE8M0);  // rowwise needs [2, 2]
  EXPECT_THROW(quantize(QuantRecipe::kMxfp8Rowwise, x, q8, bad_scales), Error);
  int untouched = 0;
  for (int64_t i = 0; i < q.numel(); ++i) untouched += q.ptr<uint8_t>()[i] == 0xAB;
  EXPECT_EQ(untouched, 128);
}

TEST(QuantValidation, TensorsOnTwoDevicesAreRefusedBeforeAnyWork) {
  std::vector<float> xb(4 * 128);
  std::vector<uint8_t> qb(4 * 128);
  std::vector<float> sb(4);
  const TensorRef x(xb.data(), DType::kBF16, Shape{4, 128});
  const TensorRef q(qb.data(), DType::kF8E4M3, Shape{4, 128}, Device::cuda(0));  // never dereferenced
  const TensorRef s(sb.data(), DType::kF32, Shape{4, 1});
  try {
    quantize(QuantRecipe::kFp8Block1x128, x, q, s);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("q is on cuda:0, expected cpu"), std::string::npos) << e.what();
  }
}

TEST(QuantValidation, EmptyMatricesAreValid) {
  for (QuantRecipe r : kAllRecipes)
    for (auto [M, N] : {std::pair<int64_t, int64_t>{0, 130}, {5, 0}, {0, 0}}) {
      Tensor x = Tensor::zeros({M, N}, DType::kBF16), q = Tensor::zeros({M, N}, DType::kF8E4M3);
      Tensor s = Tensor::full(quant_scale_shape(r, M, N), quant_scale_dtype(r), 1.0);
      EXPECT_NO_THROW(quantize(r, x, q, s)) << quant_recipe_name(r) << " " << M << "x" << N;
      EXPECT_NO_THROW(dequantize(r, q, s, x)) << quant_recipe_name(r) << " " << M << "x" << N;
      // M = 0 with N > 0 still has a (0-row) scale tensor; a wrong one is still an error.
      if (M == 0 && N == 130) {
        Tensor wrong = Tensor::zeros({0, 7}, quant_scale_dtype(r));
        EXPECT_NE(invalid_argument([&] { quantize(r, x, q, wrong); }).find("scales has shape [0, 7]"), std::string::npos)
            << quant_recipe_name(r);
      }
    }
}

}  // namespace
}  // namespace epx
