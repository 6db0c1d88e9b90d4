// CPU reference of the dense and grouped GEMMs (the oracle the GPU kernels are tested against).
//
// Every output element is one accumulation chain over the reduction index in ascending order, in
// Acc = fp32 (fp64 for fp64 inputs), rounded once to the output dtype. Operands are widened to Acc
// scratch matrices first (transposed where that makes the inner loop contiguous), so the hot loop
// is i-k-j over plain arrays: out[i, :] += A[i, k] * B[k, :] for k ascending, which keeps the
// per-element order of the textbook dot product while vectorising over j.
//
// These functions assume the public entry points (src/moe/gemm_ops.cpp) validated shapes, dtypes
// and devices. The only checks made here are on DATA, which only a pass over it can see: the
// int32 offsets / rows of the padded layout (they come from the device in real use). They are all
// checked before anything is written.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "epx/dtype.h"
#include "epx/tensor.h"

namespace epx::ref {

void gemm(const TensorRef& a, const TensorRef& b, const TensorRef& c, bool transpose_a, bool transpose_b,
          bool accumulate);

void grouped_gemm_forward(const TensorRef& x, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                          const TensorRef& y);
void grouped_gemm_dgrad(const TensorRef& dy, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dx);
void grouped_gemm_wgrad(const TensorRef& x, const TensorRef& dy, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dw, bool accumulate);

/// FP8 forward and its weight preparation (include/epx/grouped_gemm.h; src/ref/grouped_gemm_fp8.cpp).
void quantize_grouped_weights_fp8(const TensorRef& w, const TensorRef& w_q, const TensorRef& w_scales);
void grouped_gemm_forward_fp8(const TensorRef& x_q, const TensorRef& x_scales, const TensorRef& w_q,
                              const TensorRef& w_scales, const TensorRef& offsets, const TensorRef& rows,
                              const TensorRef& y);

/// One group of the padded layout: real rows [begin, begin + rows), padding up to end.
struct GroupSpan {
  int64_t begin = 0, rows = 0, end = 0;
};

/// Reads and checks offsets [G+1] / rows [G] (int32, host) against a tensor of `rows_total` rows;
/// a violation throws epx::Error naming `fn`, the group and the values.
std::vector<GroupSpan> read_groups(const char* fn, const TensorRef& offsets, const TensorRef& rows,
                                   int64_t rows_total);

// ---- helpers shared with the expert FFN reference ----------------------------------------------

/// The [rows, cols] row-major matrix that starts at element `offset` of t, widened to Acc; stored
/// [cols, rows] when `transpose`.
template <class Acc>
std::vector<Acc> load_matrix(const TensorRef& t, int64_t offset, int64_t rows, int64_t cols, bool transpose) {
  std::vector<Acc> m(static_cast<size_t>(rows * cols));
  if (!transpose) {
    load_row(t.data(), t.dtype(), offset, rows * cols, m.data());
    return m;
  }
  std::vector<Acc> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < rows; ++r) {
    load_row(t.data(), t.dtype(), offset + r * cols, cols, row.data());
    for (int64_t c = 0; c < cols; ++c) m[c * rows + r] = row[c];
  }
  return m;
}

/// out[0, N) = sum over k ascending of in[k] * B[k, 0, N) (B row-major [K, N]), from zero.
/// Zero inputs are not skipped: 0 * inf must still give NaN.
template <class Acc>
void row_times_matrix(const Acc* in, int64_t K, const Acc* B, int64_t N, Acc* out) {
  std::fill(out, out + N, Acc(0));
  for (int64_t k = 0; k < K; ++k) {
    const Acc ak = in[k];
    const Acc* b = B + k * N;
    for (int64_t n = 0; n < N; ++n) out[n] += ak * b[n];
  }
}

/// Writes zeros to `n` elements of t from element `offset` (padding rows).
void store_zeros(const TensorRef& t, int64_t offset, int64_t n);

}  // namespace epx::ref
