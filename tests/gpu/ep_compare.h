// Comparison of EP outputs with the reference. Bit-exact: layout, dispatched bytes and weights,
// combine and dispatch_backward (same fp32 order per element), d_y (one multiply, one rounding),
// d_topk_weights (copied). Tolerance: d_row_weights (a warp reduction, not a sequential sum).
#pragma once

#include <gtest/gtest.h>

#include <ostream>
#include <string>

#include "common/ep_scenario.h"
#include "gpu/gpu_test_util.h"

namespace epx {
/// gtest prints a parameter of type Transport by its name ("zero-copy", "staged").
inline void PrintTo(const Transport& t, std::ostream* os) { *os << transport_name(t); }
}  // namespace epx

namespace epx::testing {

inline void expect_same_ep_outputs(const EpOutputs& got, const EpOutputs& want, int rank) {
  SCOPED_TRACE(detail::concat("rank ", rank));
  ASSERT_EQ(got.routed, want.routed) << "kept routing";
  ASSERT_EQ(got.offsets, want.offsets) << "expert offsets";
  const int64_t used = want.used_rows();
  auto rows = [used](const Tensor& t) { return t.ref().slice_rows(0, used); };
  EXPECT_TRUE(bit_equal(rows(got.recv_x), rows(want.recv_x))) << "recv_x";
  EXPECT_TRUE(bit_equal(rows(got.recv_w), rows(want.recv_w))) << "recv_weights";
  EXPECT_TRUE(bit_equal(got.out, want.out)) << "combine out";
  EXPECT_TRUE(bit_equal(rows(got.d_y), rows(want.d_y))) << "combine_backward d_y";
  EXPECT_TRUE(all_close(rows(got.d_row_w), rows(want.d_row_w), 1e-4, 1e-4)) << "d_row_weights";
  EXPECT_TRUE(bit_equal(got.d_x, want.d_x)) << "dispatch_backward d_x";
  EXPECT_TRUE(bit_equal(got.d_topk_w, want.d_topk_w)) << "dispatch_backward d_topk_weights";
}

/// Two runs of the same GPU code on the same inputs (eager vs graph replay, one transport vs the
/// other): every output bit for bit, d_row_weights included.
inline void expect_identical_ep_outputs(const EpOutputs& got, const EpOutputs& want, const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(got.routed, want.routed) << "kept routing";
  ASSERT_EQ(got.offsets, want.offsets) << "expert offsets";
  const int64_t used = want.used_rows();
  auto rows = [used](const Tensor& t) { return t.ref().slice_rows(0, used); };
  EXPECT_TRUE(bit_equal(rows(got.recv_x), rows(want.recv_x))) << "recv_x";
  EXPECT_TRUE(bit_equal(rows(got.recv_w), rows(want.recv_w))) << "recv_weights";
  EXPECT_TRUE(bit_equal(got.out, want.out)) << "combine out";
  EXPECT_TRUE(bit_equal(rows(got.d_y), rows(want.d_y))) << "combine_backward d_y";
  EXPECT_TRUE(bit_equal(rows(got.d_row_w), rows(want.d_row_w))) << "combine_backward d_row_weights";
  EXPECT_TRUE(bit_equal(got.d_x, want.d_x)) << "dispatch_backward d_x";
  EXPECT_TRUE(bit_equal(got.d_topk_w, want.d_topk_w)) << "dispatch_backward d_topk_weights";
}

/// Quantized dispatch: payload bytes, scales and weights of every row in use, bit for bit.
inline void expect_same_quant_outputs(const EpQuantOutputs& got, const EpQuantOutputs& want, int rank) {
  SCOPED_TRACE(detail::concat("rank ", rank));
  ASSERT_EQ(got.offsets, want.offsets) << "expert offsets";
  const int64_t used = want.used_rows();
  auto rows = [used](const Tensor& t) { return t.ref().slice_rows(0, used); };
  EXPECT_TRUE(bit_equal(rows(got.recv_q), rows(want.recv_q))) << "recv_x (fp8 payload)";
  EXPECT_TRUE(bit_equal(rows(got.recv_s), rows(want.recv_s))) << "recv_scales";
  EXPECT_TRUE(bit_equal(rows(got.recv_w), rows(want.recv_w))) << "recv_weights";
}

}  // namespace epx::testing
