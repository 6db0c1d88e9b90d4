// GPU tests of the quantization kernels (src/cuda/quant) against the CPU reference through the
// public API: q and scales must be BIT-identical to epx::ref on the same host input, for every
// recipe, input dtype and MX rounding, on shapes with partial edge blocks in both dimensions, on
// both kernel variants (16-byte vectors and element-wise) and with the grid-stride loops forced.
// Outputs are poisoned twice with different bytes and both runs must match, so an element the
// kernel forgets to write cannot pass by coinciding with the poison. Dequantize is compared bit for
// bit as well, except that two NaNs match whatever their payload (the contract only says NaN; the
// host multiply keeps the operand's payload, the GPU returns the canonical one).
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/device_memory.h"
#include "cuda/quant/quant.h"
#include "cuda/quant/quant_kernels.cuh"
#include "epx/error.h"
#include "epx/quant.h"
#include "epx/tensor.h"
#include "gpu/gpu_test_util.h"
#include "ref/quant.h"

namespace epx {
namespace {

using epx::testing::bit_equal;
using epx::testing::to_gpu;
using epx::testing::to_host;

constexpr QuantRecipe kAllRecipes[] = {QuantRecipe::kFp8Block1x128, QuantRecipe::kFp8Block128x128,
                                       QuantRecipe::kMxfp8Rowwise, QuantRecipe::kMxfp8Colwise};
constexpr DType kInputDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
constexpr int kPoisons[] = {0xAB, 0x54};

bool is_mx(QuantRecipe r) { return r == QuantRecipe::kMxfp8Rowwise || r == QuantRecipe::kMxfp8Colwise; }

// The (recipe, rounding) pairs that differ: the FP8 block recipes ignore mx_rounding.
std::vector<std::pair<QuantRecipe, E8M0Rounding>> recipe_modes() {
  std::vector<std::pair<QuantRecipe, E8M0Rounding>> v;
  for (QuantRecipe r : kAllRecipes) {
    v.emplace_back(r, E8M0Rounding::kFloor);
    if (is_mx(r)) v.emplace_back(r, E8M0Rounding::kCeil);
  }
  return v;
}

std::string label(QuantRecipe r, E8M0Rounding mode, DType t, int64_t M, int64_t N) {
  std::ostringstream os;
  os << quant_recipe_name(r);
  if (is_mx(r)) os << (mode == E8M0Rounding::kCeil ? "/ceil" : "/floor");
  os << " " << dtype_name(t) << " [" << M << ", " << N << "]";
  return os.str();
}

Tensor host_matrix(int64_t M, int64_t N, const std::vector<float>& v, DType t) {
  Tensor x = Tensor::empty({M, N}, t);
  if (M * N > 0) store_row(x.data(), t, 0, M * N, v.data());
  return x;
}

struct QOut {
  Tensor q, scales;
};

QOut cpu_quantize(QuantRecipe r, const Tensor& x, E8M0Rounding mode) {
  QOut o;
  o.q = Tensor::empty({x.size(0), x.size(1)}, DType::kF8E4M3);
  o.scales = Tensor::empty(quant_scale_shape(r, x.size(0), x.size(1)), quant_scale_dtype(r));
  QuantOptions opt;
  opt.mx_rounding = mode;
  quantize(r, x, o.q, o.scales, opt);
  return o;
}

// Quantizes the device tensor x into freshly poisoned device outputs; returns host copies.
// With `tuning` the launcher is called directly (forced kernel variants / grid loops).
QOut gpu_quantize(QuantRecipe r, const TensorRef& x, E8M0Rounding mode, int poison,
                  const cuda::QuantTuning* tuning = nullptr) {
  const Device dev = x.device();
  Tensor q = Tensor::empty({x.size(0), x.size(1)}, DType::kF8E4M3, dev);
  Tensor s = Tensor::empty(quant_scale_shape(r, x.size(0), x.size(1)), quant_scale_dtype(r), dev);
  detail::memset_bytes(q.data(), dev, poison, q.nbytes());
  detail::memset_bytes(s.data(), dev, poison, s.nbytes());
  if (tuning) {
    cuda::quantize(r, x, q, s, mode, Stream{}, *tuning);
  } else {
    QuantOptions opt;
    opt.mx_rounding = mode;
    quantize(r, x, q, s, opt);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {to_host(q), to_host(s)};
}

void expect_quantize_matches(QuantRecipe r, E8M0Rounding mode, const Tensor& x_host, const std::string& what,
                             const cuda::QuantTuning* tuning = nullptr) {
  const QOut want = cpu_quantize(r, x_host, mode);
  const Tensor xd = to_gpu(x_host);
  for (int poison : kPoisons) {
    const QOut got = gpu_quantize(r, xd, mode, poison, tuning);
    EXPECT_TRUE(bit_equal(got.q, want.q)) << what << ": q (poison 0x" << std::hex << poison << ")";
    EXPECT_TRUE(bit_equal(got.scales, want.scales)) << what << ": scales (poison 0x" << std::hex << poison << ")";
  }
}

// Blocks of very different magnitudes (regions of 5 rows x 40 columns share an exponent), with
// exact zeros, so that blocks straddle magnitudes and reach e4m3's subnormals and (MX floor)
// saturation. fp16 gets a range it can hold, with its own subnormals at the bottom.
std::vector<float> random_values(int64_t M, int64_t N, uint32_t seed, DType t) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int lo = t == DType::kF16 ? -22 : -30, hi = t == DType::kF16 ? 12 : 30;
  std::uniform_int_distribution<int> expo(lo, hi);
  std::vector<int> region_exp(64 * 64);
  for (int& e : region_exp) e = expo(rng);
  std::vector<float> v(static_cast<size_t>(M * N));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      const int e = region_exp[(i / 5 % 64) * 64 + (j / 40 % 64)];
      v[i * N + j] = (rng() % 17 == 0) ? 0.0f : std::ldexp(normal(rng), e);
    }
  return v;
}

// Values whose scaled form lands on, or one ulp beside, an e4m3 rounding midpoint (or on a code).
// Each block gets a chosen amax A at its first element; for the FP8 recipes the others are
// m / fl(448 / A) with m a midpoint between adjacent codes, so fl(x * r) sits on or next to m and
// the tie rule and the single fp32 multiply decide the code; for MX they are m * X exactly (the
// exact quotient is a tie). Codes stay below 224 (MX) / 448 (FP8) so A remains the block's amax.
std::vector<float> midpoint_values(QuantRecipe r, E8M0Rounding mode, int64_t M, int64_t N, uint32_t seed) {
  std::mt19937 rng(seed);
  const ref::QuantBlock blk = ref::quant_block(r);
  const int64_t SM = (M + blk.rows - 1) / blk.rows, SN = (N + blk.cols - 1) / blk.cols;
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  // FP8 amaxes stay above the 1e-4 clamp, so that A / 448 * m stays below A.
  std::uniform_int_distribution<int> expo(is_mx(r) ? -40 : -13, 40);
  std::vector<float> amax(static_cast<size_t>(SM * SN));
  for (float& a : amax) a = std::ldexp(mant(rng), expo(rng));
  const int max_code = is_mx(r) ? 0x75 : 0x7D;
  std::uniform_int_distribution<int> code(0, max_code);
  std::vector<float> v(static_cast<size_t>(M * N));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      const int64_t b = (i / blk.rows) * SN + j / blk.cols;
      const float A = amax[b];
      const bool first = i % blk.rows == 0 && j % blk.cols == 0;
      if (first) {
        v[i * N + j] = (rng() & 1) ? A : -A;
        continue;
      }
      const int c = code(rng);
      const float lo = e4m3_bits_to_float(static_cast<uint8_t>(c)), hi = e4m3_bits_to_float(static_cast<uint8_t>(c + 1));
      const int kind = static_cast<int>(rng() % 4);
      const float m = kind == 3 ? lo : 0.5f * (lo + hi);  // midpoints of adjacent codes are exact floats
      float x;
      if (is_mx(r)) {
        x = static_cast<float>(std::ldexp(static_cast<double>(m), static_cast<int>(ref::mx_scale_bits(A, mode)) - 127));
      } else {
        x = m / ref::fp8_block_multiplier(A);
      }
      if (kind == 1) x = std::nextafter(x, INFINITY);
      if (kind == 2) x = std::nextafter(x, 0.0f);
      v[i * N + j] = (rng() & 1) ? x : -x;
    }
  return v;
}

const float kSpecials[] = {NAN,      -NAN,      INFINITY,    -INFINITY,  0.0f,       -0.0f,      FLT_MAX,
                           -FLT_MAX, 1e-40f,    -1e-40f,     0x1p-149f,  -0x1p-149f, 448.0f,     449.0f,
                           464.0f,   -465.0f,   500.0f,      -500.0f,    1e-5f,      -2e-5f,     0x1p-130f,
                           0x1p100f, 0x1p-100f, 0x1.cp8f,    0x1.c00002p0f, 1.75f,   65504.0f,   70000.0f};

// Random data with special values sprinkled in, and whole rows / columns of one special value
// (all-NaN, all-inf, all-zero, all -0, all tiny blocks), plus the pinned exact-arithmetic row.
std::vector<float> special_values(int64_t M, int64_t N, uint32_t seed) {
  std::vector<float> v = random_values(M, N, seed, DType::kF32);
  std::mt19937 rng(seed + 1);
  const int n_specials = sizeof(kSpecials) / sizeof(kSpecials[0]);
  for (int64_t k = 0; k < M * N / 7; ++k) v[rng() % (M * N)] = kSpecials[rng() % n_specials];
  const float whole_rows[] = {NAN, INFINITY, 0.0f, -0.0f, 1e-5f, -NAN, -INFINITY, 1e-40f};
  for (int k = 0; k < 8 && 2 + k < M; ++k)
    for (int64_t j = 0; j < N; ++j) v[(2 + k) * N + j] = whole_rows[k];
  for (int k = 0; k < 4 && 3 + 5 * k < N; ++k)
    for (int64_t i = 0; i < M; ++i) v[i * N + 3 + 5 * k] = whole_rows[k];
  if (M > 12 && N >= 3) {  // QuantFp8Block.MultiplierIsOneFp32DivisionThenOneFp32Multiply, in a row of its own
    for (int64_t j = 0; j < N; ++j) v[12 * N + j] = 0.0f;
    v[12 * N + 0] = 3.0f;
    v[12 * N + 1] = 0x1.724924p-8f;
    v[12 * N + 2] = 0x1.56db6ep-12f;
  }
  return v;
}

struct MN {
  int64_t M, N;
};
// Partial blocks in both dimensions, N off the 16-byte vector for bf16 (and fp32), single
// elements, and one DeepSeek-V3 row width.
const MN kShapes[] = {{1, 1},     {2, 16},     {1, 31},   {3, 33},    {5, 127},   {7, 128},  {9, 129},
                      {33, 130},  {31, 257},   {130, 129}, {129, 384}, {40, 4100}, {257, 1000}, {64, 7168}};

// ---- quantize -----------------------------------------------------------------------------

TEST(QuantGpu, RandomDataMatchesReferenceBitForBit) {
  EPX_REQUIRE_GPU();
  uint32_t seed = 1;
  for (const MN& s : kShapes)
    for (DType t : kInputDtypes) {
      const Tensor x = host_matrix(s.M, s.N, random_values(s.M, s.N, seed++, t), t);
      for (auto [r, mode] : recipe_modes()) expect_quantize_matches(r, mode, x, label(r, mode, t, s.M, s.N));
    }
}

TEST(QuantGpu, MidpointsAndTiesMatchReference) {
  EPX_REQUIRE_GPU();
  uint32_t seed = 100;
  for (const MN& s : {MN{7, 128}, MN{130, 300}, MN{64, 256}, MN{257, 129}})
    for (auto [r, mode] : recipe_modes()) {
      const std::vector<float> v = midpoint_values(r, mode, s.M, s.N, seed++);
      // The construction is exact in fp32; bf16 / fp16 inputs round it but still hit many ties.
      for (DType t : kInputDtypes)
        expect_quantize_matches(r, mode, host_matrix(s.M, s.N, v, t), "midpoints " + label(r, mode, t, s.M, s.N));
    }
}

TEST(QuantGpu, SpecialValuesMatchReference) {
  EPX_REQUIRE_GPU();
  uint32_t seed = 200;
  for (const MN& s : {MN{67, 300}, MN{64, 256}, MN{33, 40}, MN{200, 1024}})
    for (DType t : kInputDtypes) {
      const Tensor x = host_matrix(s.M, s.N, special_values(s.M, s.N, seed++), t);
      for (auto [r, mode] : recipe_modes())
        expect_quantize_matches(r, mode, x, "specials " + label(r, mode, t, s.M, s.N));
    }
}

// The hand-pinned case of the CPU suite, checked on the GPU output itself: r = fl(448 / 3) once,
// then fl(x * r), gives 0x35 and 0x14 where a division by the scale or an exact product would not.
TEST(QuantGpu, MultiplierIsOneFp32DivisionThenOneFp32Multiply) {
  EPX_REQUIRE_GPU();
  std::vector<float> row(128, 0.0f);
  row[0] = 3.0f;
  row[1] = 0x1.724924p-8f;
  row[2] = 0x1.56db6ep-12f;
  for (QuantRecipe r : {QuantRecipe::kFp8Block1x128, QuantRecipe::kFp8Block128x128}) {
    const Tensor x = to_gpu(host_matrix(1, 128, row, DType::kF32));
    const QOut got = gpu_quantize(r, x, E8M0Rounding::kFloor, 0xAB);
    const uint8_t* q = got.q.ptr<uint8_t>();
    EXPECT_EQ(q[0], 0x7E) << quant_recipe_name(r);
    EXPECT_EQ(q[1], 0x35) << quant_recipe_name(r);
    EXPECT_EQ(q[2], 0x14) << quant_recipe_name(r);
    for (int j = 3; j < 128; ++j) EXPECT_EQ(q[j], 0x00) << quant_recipe_name(r) << " column " << j;
    EXPECT_EQ(got.scales.ptr<float>()[0], 3.0f / 448.0f) << quant_recipe_name(r);
  }
}

// NaN of either sign is 0x7F, +-inf saturates, -0 keeps its sign, on the GPU output itself.
TEST(QuantGpu, NaNIsCanonicalAndInfSaturates) {
  EPX_REQUIRE_GPU();
  std::vector<float> row(128, 0.0f);
  row[0] = NAN;
  row[1] = -NAN;
  row[2] = INFINITY;
  row[3] = -INFINITY;
  row[4] = -0.0f;
  row[5] = 2.0f;
  for (auto [r, mode] : recipe_modes()) {
    if (r == QuantRecipe::kMxfp8Colwise) continue;  // a row holds 128 colwise blocks of one element
    for (DType t : kInputDtypes) {
      const Tensor x = to_gpu(host_matrix(1, 128, row, t));
      const QOut got = gpu_quantize(r, x, mode, 0xAB);
      const uint8_t* q = got.q.ptr<uint8_t>();
      const std::string what = label(r, mode, t, 1, 128);
      EXPECT_EQ(q[0], 0x7F) << what;
      EXPECT_EQ(q[1], 0x7F) << what;
      EXPECT_EQ(q[2], 0x7E) << what;
      EXPECT_EQ(q[3], 0xFE) << what;
      EXPECT_EQ(q[4], 0x80) << what;
    }
  }
  // Colwise: the same values down one column.
  const Tensor x = to_gpu(host_matrix(6, 1, {NAN, -NAN, INFINITY, -INFINITY, -0.0f, 2.0f}, DType::kF32));
  for (E8M0Rounding mode : {E8M0Rounding::kFloor, E8M0Rounding::kCeil}) {
    const QOut got = gpu_quantize(QuantRecipe::kMxfp8Colwise, x, mode, 0xAB);
    const uint8_t* q = got.q.ptr<uint8_t>();
    EXPECT_EQ(q[0], 0x7F);
    EXPECT_EQ(q[1], 0x7F);
    EXPECT_EQ(q[2], 0x7E);
    EXPECT_EQ(q[3], 0xFE);
    EXPECT_EQ(q[4], 0x80);
  }
}

// Both kernel variants and the loops over row tiles / block rows / strips, on the same data.
TEST(QuantGpu, ForcedElementwiseKernelsAndGridLoops) {
  EPX_REQUIRE_GPU();
  constexpr int kTunings = 5;
  cuda::QuantTuning tunings[kTunings];
  tunings[0].force_scalar = true;
  tunings[1].max_grid_y = 1;
  tunings[2].force_scalar = true;
  tunings[2].max_grid_y = 3;
  tunings[3].rows_per_thread = 8;
  tunings[4].rows_per_thread = 8;
  tunings[4].max_grid_y = 2;
  uint32_t seed = 300;
  for (const MN& s : {MN{300, 256}, MN{67, 300}, MN{1000, 64}, MN{129, 7168}})
    for (DType t : kInputDtypes) {
      const Tensor x = host_matrix(s.M, s.N, special_values(s.M, s.N, seed++), t);
      for (auto [r, mode] : recipe_modes())
        for (int k = 0; k < kTunings; ++k)
          expect_quantize_matches(r, mode, x, "tuning " + std::to_string(k) + " " + label(r, mode, t, s.M, s.N),
                                  &tunings[k]);
    }
}

// Views that start off a 16-byte boundary (but on their element size) take the element-wise path.
TEST(QuantGpu, UnalignedViewsMatchReference) {
  EPX_REQUIRE_GPU();
  const int64_t M = 37, N = 256;
  uint32_t seed = 400;
  for (DType t : kInputDtypes) {
    const Tensor xh = host_matrix(M, N, random_values(M, N, seed++, t), t);
    const size_t es = dtype_size(t);
    Tensor xbuf = Tensor::empty({M * N + 8}, t, Device::cuda(0));
    const TensorRef xv(static_cast<char*>(xbuf.data()) + es, t, Shape{M, N}, Device::cuda(0));
    copy(xh, xv);
    for (auto [r, mode] : recipe_modes()) {
      const QOut want = cpu_quantize(r, xh, mode);
      const Shape ss = quant_scale_shape(r, M, N);
      const DType sd = quant_scale_dtype(r);
      Tensor qbuf = Tensor::empty({M * N + 16}, DType::kF8E4M3, Device::cuda(0));
      Tensor sbuf = Tensor::empty({ss.numel() + 8}, sd, Device::cuda(0));
      const TensorRef qv(static_cast<char*>(qbuf.data()) + 3, DType::kF8E4M3, Shape{M, N}, Device::cuda(0));
      const TensorRef sv(static_cast<char*>(sbuf.data()) + dtype_size(sd), sd, ss, Device::cuda(0));
      for (int poison : kPoisons) {
        detail::memset_bytes(qbuf.data(), Device::cuda(0), poison, qbuf.nbytes());
        detail::memset_bytes(sbuf.data(), Device::cuda(0), poison, sbuf.nbytes());
        QuantOptions opt;
        opt.mx_rounding = mode;
        quantize(r, xv, qv, sv, opt);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::string what = "unaligned " + label(r, mode, t, M, N);
        EXPECT_TRUE(bit_equal(to_host(qv), want.q)) << what << ": q";
        EXPECT_TRUE(bit_equal(to_host(sv), want.scales)) << what << ": scales";
        // Nothing outside the views was touched.
        const Tensor qall = to_host(qbuf);
        const uint8_t* qa = qall.ptr<uint8_t>();
        EXPECT_EQ(qa[0], poison);
        EXPECT_EQ(qa[1], poison);
        EXPECT_EQ(qa[2], poison);
        for (int64_t k = 3 + M * N; k < qall.numel(); ++k) EXPECT_EQ(qa[k], poison) << what << " byte " << k;
      }
    }
  }
}

TEST(QuantGpu, MisalignedScalePointerIsRefused) {
  EPX_REQUIRE_GPU();
  Tensor x = Tensor::zeros({4, 128}, DType::kBF16, Device::cuda(0));
  Tensor q = Tensor::zeros({4, 128}, DType::kF8E4M3, Device::cuda(0));
  Tensor sbuf = Tensor::zeros({16}, DType::kF32, Device::cuda(0));
  const TensorRef s(static_cast<char*>(sbuf.data()) + 2, DType::kF32, Shape{4, 1}, Device::cuda(0));
  try {
    quantize(QuantRecipe::kFp8Block1x128, x, q, s);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("scales"), std::string::npos) << e.what();
  }
}

TEST(QuantGpu, BadTuningIsRefused) {
  EPX_REQUIRE_GPU();
  Tensor x = Tensor::zeros({4, 128}, DType::kBF16, Device::cuda(0));
  Tensor q = Tensor::zeros({4, 128}, DType::kF8E4M3, Device::cuda(0));
  Tensor s = Tensor::zeros({4, 1}, DType::kF32, Device::cuda(0));
  cuda::QuantTuning bad;
  bad.rows_per_thread = 3;
  try {
    cuda::quantize(QuantRecipe::kFp8Block1x128, x, q, s, E8M0Rounding::kFloor, Stream{}, bad);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("rows_per_thread is 3"), std::string::npos) << e.what();
  }
}

TEST(QuantGpu, EmptyMatricesLaunchNothing) {
  EPX_REQUIRE_GPU();
  for (QuantRecipe r : kAllRecipes)
    for (MN s : {MN{0, 130}, MN{5, 0}, MN{0, 0}}) {
      Tensor x = Tensor::empty({s.M, s.N}, DType::kBF16, Device::cuda(0));
      Tensor q = Tensor::empty({s.M, s.N}, DType::kF8E4M3, Device::cuda(0));
      Tensor sc = Tensor::empty(quant_scale_shape(r, s.M, s.N), quant_scale_dtype(r), Device::cuda(0));
      EXPECT_NO_THROW(quantize(r, x, q, sc)) << quant_recipe_name(r) << " " << s.M << "x" << s.N;
      EXPECT_NO_THROW(dequantize(r, q, sc, x)) << quant_recipe_name(r) << " " << s.M << "x" << s.N;
    }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Stream-ordered and free of host synchronization and allocation: the call can be captured into a
// CUDA graph (a cudaMemcpy, a sync or a cudaMalloc inside would break the capture).
TEST(QuantGpu, RunsOnAStreamAndUnderGraphCapture) {
  EPX_REQUIRE_GPU();
  const int64_t M = 96, N = 7168;
  const Tensor xh = host_matrix(M, N, random_values(M, N, 500, DType::kBF16), DType::kBF16);
  const Tensor xd = to_gpu(xh);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (auto [r, mode] : recipe_modes()) {
    const QOut want = cpu_quantize(r, xh, mode);
    Tensor q = Tensor::empty({M, N}, DType::kF8E4M3, Device::cuda(0));
    Tensor s = Tensor::empty(quant_scale_shape(r, M, N), quant_scale_dtype(r), Device::cuda(0));
    Tensor back = Tensor::empty({M, N}, DType::kF32, Device::cuda(0));
    detail::memset_bytes(q.data(), Device::cuda(0), 0xAB, q.nbytes());
    detail::memset_bytes(s.data(), Device::cuda(0), 0xAB, s.nbytes());
    QuantOptions opt;
    opt.mx_rounding = mode;
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    quantize(r, xd, q, s, opt, Stream{stream});
    dequantize(r, q, s, back, Stream{stream});
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::string what = "graph " + label(r, mode, DType::kBF16, M, N);
    EXPECT_TRUE(bit_equal(q, want.q)) << what;
    EXPECT_TRUE(bit_equal(s, want.scales)) << what;
    Tensor want_back = Tensor::empty({M, N}, DType::kF32);
    dequantize(r, want.q, want.scales, want_back);
    EXPECT_TRUE(bit_equal(back, want_back)) << what << ": dequantize";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
}

// cuda::with_quantized (the temporary of the composed quantize-then-dispatch): the callback sees
// exactly quantize()'s bits in stream-ordered memory, eagerly and under a graph capture (the
// cudaMallocAsync / cudaFreeAsync pair becomes graph memory nodes; a cudaMalloc would break it).
TEST(QuantGpu, StreamOrderedTemporaryMatchesQuantize) {
  EPX_REQUIRE_GPU();
  const int64_t M = 70, N = 1024;
  const Tensor xh = host_matrix(M, N, special_values(M, N, 321), DType::kBF16);
  const Tensor xd = to_gpu(xh);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (const auto& rm : recipe_modes()) {
    const QuantRecipe r = rm.first;
    const E8M0Rounding mode = rm.second;
    const QOut want = cpu_quantize(r, xh, mode);
    for (bool captured : {false, true}) {
      const std::string what = label(r, mode, DType::kBF16, M, N) + (captured ? " (graph)" : " (eager)");
      Tensor q = Tensor::empty({M, N}, DType::kF8E4M3, Device::cuda(0));
      Tensor s = Tensor::empty(quant_scale_shape(r, M, N), quant_scale_dtype(r), Device::cuda(0));
      detail::memset_bytes(q.data(), Device::cuda(0), 0xAB, q.nbytes());
      detail::memset_bytes(s.data(), Device::cuda(0), 0xAB, s.nbytes());
      auto run = [&] {
        cuda::with_quantized(r, xd, mode, Stream{stream}, [&](const TensorRef& tq, const TensorRef& ts) {
          ASSERT_EQ(tq.shape(), q.shape());
          ASSERT_EQ(ts.shape(), s.shape());
          ASSERT_EQ(ts.dtype(), s.dtype());
          ASSERT_EQ(cudaMemcpyAsync(q.data(), tq.data(), q.nbytes(), cudaMemcpyDeviceToDevice, stream), cudaSuccess);
          ASSERT_EQ(cudaMemcpyAsync(s.data(), ts.data(), s.nbytes(), cudaMemcpyDeviceToDevice, stream), cudaSuccess);
        });
      };
      if (captured) {
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
        run();
        ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
        ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
        for (int i = 0; i < 3; ++i) ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
      } else {
        run();
        ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      }
      EXPECT_TRUE(bit_equal(q, want.q)) << what;
      EXPECT_TRUE(bit_equal(s, want.scales)) << what;
    }
  }
  // An exception from the callback still gives the memory back (and propagates).
  EXPECT_THROW(cuda::with_quantized(QuantRecipe::kFp8Block1x128, xd, E8M0Rounding::kFloor, Stream{stream},
                                    [](const TensorRef&, const TensorRef&) { throw Error(Status::kInternal, "x"); }),
               Error);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaStreamDestroy(stream);
}

// ---- the fusable group helpers, used as a permute kernel would ------------------------------

// One warp per row of bf16, 128 columns per step, each lane 4 consecutive elements: for FP8 the
// whole warp is one 1x128 block (kGroup 32, kVec 4); for MX each 8 lanes are one 32-block
// (kGroup 8), 4 blocks per step. Out-of-range elements enter as +0, as the contract asks.
template <bool kMx>
__global__ void group_helper_rows_kernel(const __nv_bfloat16* x, uint8_t* q, void* scales, int64_t M, int64_t N,
                                         int64_t scale_cols, bool ceil_rounding) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= M) return;  // warp-uniform
  for (int64_t c0 = 0; c0 < N; c0 += 128) {
    const int64_t j0 = c0 + lane * 4;
    float v[4];
    for (int e = 0; e < 4; ++e) v[e] = j0 + e < N ? __bfloat162float(x[row * N + j0 + e]) : 0.0f;
    uint32_t codes[1];
    if constexpr (kMx) {
      const uint32_t bits = cuda::quant::quantize_mx_block_group<8, 4>(v, ceil_rounding, codes);
      const int64_t block = j0 / 32;
      if (lane % 8 == 0 && block < scale_cols) static_cast<uint8_t*>(scales)[row * scale_cols + block] = bits;
    } else {
      const float sc = cuda::quant::quantize_fp8_block_group<32, 4>(v, codes);
      if (lane == 0) static_cast<float*>(scales)[row * scale_cols + c0 / 128] = sc;
    }
    for (int e = 0; e < 4; ++e)
      if (j0 + e < N) q[row * N + j0 + e] = static_cast<uint8_t>(codes[0] >> (8 * e));
  }
}

TEST(QuantGpu, GroupHelpersMatchReference) {
  EPX_REQUIRE_GPU();
  uint32_t seed = 900;
  for (const MN& s : {MN{37, 7168}, MN{13, 300}, MN{20, 33}}) {
    const Tensor xh = host_matrix(s.M, s.N, special_values(s.M, s.N, seed++), DType::kBF16);
    const Tensor xd = to_gpu(xh);
    for (auto [r, mode] : recipe_modes()) {
      if (r != QuantRecipe::kFp8Block1x128 && r != QuantRecipe::kMxfp8Rowwise) continue;
      const QOut want = cpu_quantize(r, xh, mode);
      Tensor q = Tensor::empty({s.M, s.N}, DType::kF8E4M3, Device::cuda(0));
      Tensor sc = Tensor::empty(quant_scale_shape(r, s.M, s.N), quant_scale_dtype(r), Device::cuda(0));
      detail::memset_bytes(q.data(), Device::cuda(0), 0xAB, q.nbytes());
      detail::memset_bytes(sc.data(), Device::cuda(0), 0xAB, sc.nbytes());
      const unsigned blocks = static_cast<unsigned>((s.M + 3) / 4);
      const bool ceil = mode == E8M0Rounding::kCeil;
      if (r == QuantRecipe::kMxfp8Rowwise)
        group_helper_rows_kernel<true><<<blocks, 128>>>(xd.ptr<__nv_bfloat16>(), q.ptr<uint8_t>(), sc.data(), s.M, s.N,
                                                        sc.size(1), ceil);
      else
        group_helper_rows_kernel<false><<<blocks, 128>>>(xd.ptr<__nv_bfloat16>(), q.ptr<uint8_t>(), sc.data(), s.M,
                                                         s.N, sc.size(1), ceil);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::string what = "group helpers " + label(r, mode, DType::kBF16, s.M, s.N);
      EXPECT_TRUE(bit_equal(q, want.q)) << what << ": q";
      EXPECT_TRUE(bit_equal(sc, want.scales)) << what << ": scales";
    }
  }
}

// ---- dequantize ---------------------------------------------------------------------------

// Bitwise equality, except that any two NaNs match.
::testing::AssertionResult same_bits_or_both_nan(const TensorRef& got_any, const TensorRef& want_any) {
  const Tensor got = to_host(got_any), want = to_host(want_any);
  if (got.dtype() != want.dtype() || got.numel() != want.numel())
    return ::testing::AssertionFailure() << "got " << got.ref().str() << ", want " << want.ref().str();
  const size_t es = dtype_size(got.dtype());
  std::ostringstream os;
  int64_t bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const char* g = static_cast<const char*>(got.data()) + i * es;
    const char* w = static_cast<const char*>(want.data()) + i * es;
    if (std::memcmp(g, w, es) == 0) continue;
    const double gv = got.item(i), wv = want.item(i);
    if (std::isnan(gv) && std::isnan(wv)) continue;
    if (bad < 8) os << "\n  [" << i << "] got " << gv << ", want " << wv;
    ++bad;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.numel() << " elements differ:" << os.str();
}

// Every e4m3 code (NaN codes included) and scales over the whole range: fp32 scales from
// subnormal to huge (products that overflow bf16 / fp16 and fp32, subnormal products kept),
// E8M0 bits 0..255 (0 = 2^-127, 0xFF = NaN).
QOut random_codes(QuantRecipe r, int64_t M, int64_t N, uint32_t seed) {
  std::mt19937 rng(seed);
  QOut o;
  o.q = Tensor::empty({M, N}, DType::kF8E4M3);
  for (int64_t i = 0; i < M * N; ++i) o.q.ptr<uint8_t>()[i] = static_cast<uint8_t>(rng());
  o.scales = Tensor::empty(quant_scale_shape(r, M, N), quant_scale_dtype(r));
  if (is_mx(r)) {
    for (int64_t i = 0; i < o.scales.numel(); ++i) o.scales.ptr<uint8_t>()[i] = static_cast<uint8_t>(rng());
  } else {
    std::uniform_real_distribution<float> mant(0.5f, 1.0f);
    std::uniform_int_distribution<int> expo(-140, 128);
    for (int64_t i = 0; i < o.scales.numel(); ++i) o.scales.ptr<float>()[i] = std::ldexp(mant(rng), expo(rng));
  }
  return o;
}

void expect_dequantize_matches(QuantRecipe r, const QOut& in, DType out_dtype, const std::string& what,
                               const cuda::QuantTuning* tuning = nullptr) {
  const int64_t M = in.q.size(0), N = in.q.size(1);
  Tensor want = Tensor::empty({M, N}, out_dtype);
  dequantize(r, in.q, in.scales, want);
  const Tensor qd = to_gpu(in.q), sd = to_gpu(in.scales);
  for (int poison : kPoisons) {
    Tensor out = Tensor::empty({M, N}, out_dtype, Device::cuda(0));
    detail::memset_bytes(out.data(), Device::cuda(0), poison, out.nbytes());
    if (tuning) cuda::dequantize(r, qd, sd, out, Stream{}, *tuning);
    else dequantize(r, qd, sd, out);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(same_bits_or_both_nan(out, want)) << what << " (poison 0x" << std::hex << poison << ")";
  }
}

TEST(QuantGpuDequant, EveryCodeAndScaleToEveryDtype) {
  EPX_REQUIRE_GPU();
  uint32_t seed = 600;
  for (const MN& s : kShapes)
    for (QuantRecipe r : kAllRecipes) {
      const QOut in = random_codes(r, s.M, s.N, seed++);
      for (DType t : kInputDtypes)
        expect_dequantize_matches(r, in, t, std::string("dequantize ") + quant_recipe_name(r) + " -> " +
                                                dtype_name(t) + " [" + std::to_string(s.M) + ", " +
                                                std::to_string(s.N) + "]");
    }
}

TEST(QuantGpuDequant, ForcedElementwiseKernelsAndGridLoops) {
  EPX_REQUIRE_GPU();
  constexpr int kTunings = 4;
  cuda::QuantTuning tunings[kTunings];
  tunings[0].force_scalar = true;
  tunings[1].max_grid_y = 2;
  tunings[2].rows_per_thread = 8;
  tunings[3].rows_per_thread = 8;
  tunings[3].max_grid_y = 1;
  uint32_t seed = 700;
  for (const MN& s : {MN{300, 256}, MN{67, 300}, MN{37, 4096}})
    for (QuantRecipe r : kAllRecipes) {
      const QOut in = random_codes(r, s.M, s.N, seed++);
      for (DType t : kInputDtypes)
        for (int k = 0; k < kTunings; ++k)
          expect_dequantize_matches(r, in, t, "tuning " + std::to_string(k) + " " + quant_recipe_name(r), &tunings[k]);
    }
}

TEST(QuantGpuDequant, RoundTripOfGpuQuantizeMatchesReference) {
  EPX_REQUIRE_GPU();
  const int64_t M = 130, N = 384;
  for (DType t : kInputDtypes) {
    const Tensor xh = host_matrix(M, N, special_values(M, N, 800), t);
    const Tensor xd = to_gpu(xh);
    for (auto [r, mode] : recipe_modes()) {
      const QOut want = cpu_quantize(r, xh, mode);
      Tensor q = Tensor::empty({M, N}, DType::kF8E4M3, Device::cuda(0));
      Tensor s = Tensor::empty(quant_scale_shape(r, M, N), quant_scale_dtype(r), Device::cuda(0));
      QuantOptions opt;
      opt.mx_rounding = mode;
      quantize(r, xd, q, s, opt);
      Tensor back = Tensor::empty({M, N}, t, Device::cuda(0));
      dequantize(r, q, s, back);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      Tensor want_back = Tensor::empty({M, N}, t);
      dequantize(r, want.q, want.scales, want_back);
      EXPECT_TRUE(same_bits_or_both_nan(back, want_back)) << "round trip " << label(r, mode, t, M, N);
    }
  }
}

}  // namespace
}  // namespace epx
