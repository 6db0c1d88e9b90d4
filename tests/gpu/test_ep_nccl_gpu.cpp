// The zero-copy NCCL group, one process driving every local GPU (one thread per rank), against
// the host reference of the same R ranks on the same inputs. Skips without two GPUs.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>
#include <vector>

#include "core/host_barrier.h"
#include "gpu/ep_compare.h"

namespace epx {
namespace {

using testing::EpCase;
using testing::EpOutputs;

int gpus() { return detail::cuda_device_count(); }

#define EPX_REQUIRE_GPUS(n)                                                                          \
  do {                                                                                               \
    if (gpus() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs, " << gpus() << " visible: skipped"; \
  } while (0)

void compare_all(const EpCase& c, std::vector<Group>& groups) {
  SCOPED_TRACE(c.str());
  const std::vector<EpOutputs> want = testing::ep_reference(c);
  std::vector<EpOutputs> got(c.ranks);
  detail::HostBarrier bar(c.ranks);
  run_ranks(groups, [&](Group& g) { got[g.rank()] = testing::ep_run(g, c, [&] { bar.wait(); }); });
  for (int r = 0; r < c.ranks; ++r) testing::expect_same_ep_outputs(got[r], want[r], r);
}

class EpNcclGpu : public ::testing::Test {
 protected:
  std::vector<Group> make(const EpCase& c) { return Group::create_all_local(c.group_config()); }
};

TEST_F(EpNcclGpu, MatchesReference) {
  EPX_REQUIRE_GPUS(2);
  EpCase c;
  c.ranks = gpus();
  c.E = 8 * c.ranks;
  auto groups = make(c);
  for (uint32_t seed : {1u, 2u}) {
    c.seed = seed;
    compare_all(c, groups);  // one group, several layers' worth of calls: epochs keep counting
  }
}

TEST_F(EpNcclGpu, AdversarialRouting) {
  EPX_REQUIRE_GPUS(2);
  EpCase base;
  base.ranks = gpus();
  base.E = 8 * base.ranks;
  auto groups = make(base);
  EpCase skew = base;
  skew.zipf = 4;
  compare_all(skew, groups);
  EpCase hot = base;
  hot.hot = 3;
  hot.mask_p = 1.0;
  compare_all(hot, groups);
  EpCase to_zero = base;
  to_zero.only_rank = 0;  // every other rank receives nothing
  compare_all(to_zero, groups);
  EpCase masked = base;
  masked.mask_p = 0.8;
  compare_all(masked, groups);
  EpCase empty_rank = base;
  empty_rank.tokens.assign(base.ranks, base.max_tokens);
  empty_rank.tokens[0] = 0;  // T = 0 on one rank
  compare_all(empty_rank, groups);
}

TEST_F(EpNcclGpu, DtypesAlignmentCapacityAndMaxTokens) {
  EPX_REQUIRE_GPUS(2);
  EpCase base;
  base.ranks = gpus();
  base.E = 8 * base.ranks;
  base.align = 16;
  base.max_tokens = 300;
  auto groups = make(base);
  for (DType p : {DType::kBF16, DType::kF32})
    for (DType i : {DType::kI32, DType::kI64}) {
      EpCase c = base;
      c.payload = p;
      c.idx_dtype = i;
      compare_all(c, groups);  // T = max on every rank
    }
  EpCase cap = base;
  cap.capacity = 0.75f;
  cap.zipf = 2;
  compare_all(cap, groups);
  cap.drop = DropPolicy::kByProbability;
  compare_all(cap, groups);
}

TEST_F(EpNcclGpu, AllReduceSumsInRankOrder) {
  EPX_REQUIRE_GPUS(2);
  EpCase c;
  c.ranks = gpus();
  c.E = 8 * c.ranks;
  auto groups = make(c);
  std::vector<Tensor> back(c.ranks);
  const int64_t n = 40000;  // several reduce chunks
  detail::HostBarrier bar(c.ranks);
  run_ranks(groups, [&](Group& g) {
    Tensor h = Tensor::empty({n}, DType::kF32);
    for (int64_t i = 0; i < n; ++i) h.ptr<float>()[i] = static_cast<float>(i % 97) + 0.5f * g.rank();
    Tensor d = h.to(g.device());
    bar.wait();
    all_reduce_sum(g, d);
    g.check();
    bar.wait();
    back[g.rank()] = d.to(Device::cpu());
  });
  const int R = c.ranks;
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < n; i += 991) {
      float want = 0;
      for (int s = 0; s < R; ++s) want += static_cast<float>(i % 97) + 0.5f * s;
      ASSERT_EQ(back[r].ptr<float>()[i], want) << "rank " << r << " element " << i;
    }
}

// A group's creation and teardown switch devices internally; the caller's current device must be
// what it was (later launches on the "current" device would otherwise hit another GPU's memory).
TEST_F(EpNcclGpu, CreatingAndDestroyingKeepsTheCallersDevice) {
  EPX_REQUIRE_GPUS(2);
  EpCase c;
  c.ranks = gpus();
  c.E = 8 * c.ranks;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  {
    auto groups = make(c);
    int now = -1;
    ASSERT_EQ(cudaGetDevice(&now), cudaSuccess);
    EXPECT_EQ(now, 0) << "after creation";
  }
  int now = -1;
  ASSERT_EQ(cudaGetDevice(&now), cudaSuccess);
  EXPECT_EQ(now, 0) << "after teardown";
}

TEST_F(EpNcclGpu, MissingRankTimesOutWithItsName) {
  EPX_REQUIRE_GPUS(2);
  EpCase c;
  c.ranks = gpus();
  c.E = 8 * c.ranks;
  GroupConfig cfg = c.group_config();
  cfg.timeout_s = 0.5;
  auto groups = Group::create_all_local(cfg);
  std::vector<std::string> msgs(c.ranks);
  run_ranks(groups, [&](Group& g) {
    if (g.rank() == c.ranks - 1) return;  // this rank never joins
    const testing::EpInputs in = testing::ep_inputs(c, g.rank(), g.recv_capacity_rows());
    Handle h = prepare(g, in.idx.to(g.device()), {});
    try {
      g.check();
    } catch (const Error& e) {
      msgs[g.rank()] = e.what();
    }
  });
  for (int r = 0; r + 1 < c.ranks; ++r) {
    EXPECT_NE(msgs[r].find("epx::prepare: rank " + std::to_string(r)), std::string::npos) << msgs[r];
    EXPECT_NE(msgs[r].find("rank(s) " + std::to_string(c.ranks - 1) + " never arrived"), std::string::npos) << msgs[r];
  }
}

}  // namespace
}  // namespace epx
