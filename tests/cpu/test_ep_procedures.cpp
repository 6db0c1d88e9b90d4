// The multi-rank procedures and scenarios of the GPU suites (tests/common/ep_procedures.h,
// ep_scenario.h), run here on the host backend (R simulated ranks as threads) against the same
// reference. The GPU suites only run where GPUs are; this runs them everywhere, so the procedures
// themselves (their call sequences, inputs, comparisons) are known to work before a GPU sees them,
// and the host backend is checked under interleaved microbatches.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "common/ep_procedures.h"
#include "core/host_barrier.h"

namespace epx {
namespace {

using testing::EpCase;
using testing::EpOutputs;

TEST(EpProcedures, StandardScenariosOnHostBackend) {
  for (int R : {2, 3}) {
    for (const auto& nc : testing::standard_cases(R)) {
      SCOPED_TRACE(detail::concat("R=", R, " ", nc.name));
      const std::vector<EpOutputs> want = testing::ep_reference(nc.c);
      std::vector<Group> groups = Group::create_simulated(R, nc.c.group_config());
      std::vector<EpOutputs> got(R);
      detail::HostBarrier bar(R);
      run_ranks(groups, [&](Group& g) { got[g.rank()] = testing::ep_run(g, nc.c, [&] { bar.wait(); }); });
      for (int r = 0; r < R; ++r) testing::expect_identical_ep_outputs(got[r], want[r], detail::concat("rank ", r));
      // The scenario is what its name says: something was kept unless every slot is masked or empty.
      int64_t rows = 0;
      for (const EpOutputs& o : want) rows += o.used_rows();
      const bool nothing = nc.name.find("masked") != std::string::npos && nc.c.mask_p >= 1.0;
      const bool empty = nc.name.find("every rank") != std::string::npos;
      if (nothing || empty) EXPECT_EQ(rows, 0) << nc.name;
      else EXPECT_GT(rows, 0) << nc.name;
    }
  }
}

TEST(EpProcedures, QuantizedHelperOnHostBackend) {
  EpCase c;
  c.ranks = 2;
  c.E = 16;
  c.H = 256;
  c.align = 32;
  for (DType sdt : {DType::kF32, DType::kE8M0}) {
    SCOPED_TRACE(dtype_name(sdt));
    const auto want = testing::ep_reference_quantized(c, sdt);
    std::vector<Group> groups = Group::create_simulated(c.ranks, c.group_config());
    std::vector<testing::EpQuantOutputs> got(c.ranks);
    detail::HostBarrier bar(c.ranks);
    run_ranks(groups, [&](Group& g) { got[g.rank()] = testing::ep_run_quantized(g, c, sdt, [&] { bar.wait(); }); });
    for (int r = 0; r < c.ranks; ++r) {
      testing::expect_same_quant_outputs(got[r], want[r], r);
      ASSERT_GT(want[r].used_rows(), 0);
      // Row 0 holds a real token (align 32 pads only at the end of a segment): its scales were written.
      const Tensor& s = want[r].recv_s;
      const size_t row_bytes = static_cast<size_t>(s.size(1)) * dtype_size(sdt);
      const Tensor fill = Tensor::full({1, s.size(1)}, sdt, 8.0);
      EXPECT_NE(std::memcmp(s.data(), fill.data(), row_bytes), 0) << "row 0 still holds the initial scales";
    }
  }
}

TEST(EpProcedures, InterleavedMicrobatchesOnHostBackend) {
  for (int R : {2, 3}) {
    SCOPED_TRACE(detail::concat("R=", R));
    const std::vector<EpCase> mbs = testing::microbatch_cases(R);
    std::vector<std::vector<EpOutputs>> want;
    for (const EpCase& c : mbs) want.push_back(testing::ep_reference(c));
    std::vector<Group> groups = Group::create_simulated(R, mbs[0].group_config());
    detail::HostBarrier bar(R);
    run_ranks(groups, [&](Group& g) { testing::check_interleaved_microbatches(g, mbs, want, [&] { bar.wait(); }); });
  }
}

// The drift procedure (random host pauses, no meeting between ops) on 2 and 3 simulated ranks.
TEST(EpProcedures, DriftingRanksOnHostBackend) {
  for (int R : {2, 3}) {
    SCOPED_TRACE(detail::concat("R=", R));
    const EpCase c = testing::drift_case(R);
    const std::vector<EpOutputs> want = testing::ep_reference(c);
    std::vector<Group> groups = Group::create_simulated(R, c.group_config());
    detail::HostBarrier bar(R);
    run_ranks(groups, [&](Group& g) {
      testing::check_drifting_op_sequences(g, c, want[g.rank()], 3, 3, [&] { bar.wait(); });
    });
  }
}

TEST(EpProcedures, AllReduceOnHostBackend) {
  EpCase c;
  c.ranks = 3;
  c.E = 24;
  std::vector<Group> groups = Group::create_simulated(c.ranks, c.group_config());
  detail::HostBarrier bar(c.ranks);
  for (int64_t n : {int64_t{40000}, int64_t{1}, int64_t{0}}) {
    SCOPED_TRACE(detail::concat("n = ", n));
    run_ranks(groups, [&](Group& g) { testing::check_all_reduce(g, n, [&] { bar.wait(); }); });
  }
}

}  // namespace
}  // namespace epx
