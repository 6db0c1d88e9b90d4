// CPU reference of the FP8 grouped forward and of its weight preparation (semantics:
// include/epx/grouped_gemm.h). Each output element: for every 128-deep K block in ascending order,
// the fp32 sum of the exact products of the two operands' e4m3 values (k ascending), multiplied by
// the product of x's and w's block scales, added to an fp32 total; rounded once to y's dtype.
#include <algorithm>
#include <vector>

#include "ref/grouped_gemm.h"
#include "ref/quant.h"

namespace epx::ref {

namespace {
constexpr int64_t kBlock = 128;

std::vector<float> decode(const TensorRef& q, int64_t begin, int64_t count) {
  const auto* b = static_cast<const uint8_t*>(q.data()) + begin;
  std::vector<float> v(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) v[static_cast<size_t>(i)] = e4m3_bits_to_float(b[i]);
  return v;
}
}  // namespace

void quantize_grouped_weights_fp8(const TensorRef& w, const TensorRef& w_q, const TensorRef& w_scales) {
  const int64_t G = w.size(0), K = w.size(1), N = w.size(2);
  const int64_t es = dtype_size(w.dtype());
  std::vector<uint8_t> q(static_cast<size_t>(K * N));
  for (int64_t g = 0; g < G; ++g) {
    const TensorRef wg(static_cast<char*>(w.data()) + g * K * N * es, w.dtype(), {K, N}, w.device());
    const TensorRef qg(q.data(), DType::kF8E4M3, {K, N}, w.device());
    const TensorRef sg(w_scales.ptr<float>() + g * (K / kBlock) * (N / kBlock), DType::kF32, {K / kBlock, N / kBlock},
                       w.device());
    ref::quantize(QuantRecipe::kFp8Block128x128, wg, qg, sg, QuantOptions{});
    auto* out = static_cast<uint8_t*>(w_q.data()) + g * N * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) out[n * K + k] = q[static_cast<size_t>(k * N + n)];
  }
}

void grouped_gemm_forward_fp8(const TensorRef& x_q, const TensorRef& x_scales, const TensorRef& w_q,
                              const TensorRef& w_scales, const TensorRef& offsets, const TensorRef& rows,
                              const TensorRef& y) {
  const int64_t R = x_q.size(0), K = x_q.size(1), N = y.size(1), KB = K / kBlock, NB = N / kBlock;
  const auto groups = read_groups("epx::grouped_gemm_forward_fp8", offsets, rows, R);
  const float* xs = x_scales.ptr<float>();
  std::vector<float> out(static_cast<size_t>(N));
  for (size_t g = 0; g < groups.size(); ++g) {
    const GroupSpan& s = groups[g];
    const std::vector<float> w = decode(w_q, static_cast<int64_t>(g) * N * K, N * K);  // [N, K]
    const float* ws = w_scales.ptr<float>() + static_cast<int64_t>(g) * KB * NB;
    for (int64_t r = s.begin; r < s.end; ++r) {
      if (r >= s.begin + s.rows) {  // padding: zeros
        std::fill(out.begin(), out.end(), 0.0f);
      } else {
        const std::vector<float> x = decode(x_q, r * K, K);
        for (int64_t n = 0; n < N; ++n) {
          float total = 0.0f;
          for (int64_t kb = 0; kb < KB; ++kb) {
            float block = 0.0f;
            for (int64_t k = kb * kBlock; k < (kb + 1) * kBlock; ++k)
              block += x[static_cast<size_t>(k)] * w[static_cast<size_t>(n * K + k)];
            total += block * (xs[r * KB + kb] * ws[kb * NB + n / kBlock]);
          }
          out[static_cast<size_t>(n)] = total;
        }
      }
      store_row(y.data(), y.dtype(), r * N, N, out.data());
    }
  }
}

}  // namespace epx::ref
