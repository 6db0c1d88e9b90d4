// The NCCL group with one process per GPU, bootstrapped from launcher variables (RANK, WORLD_SIZE,
// LOCAL_RANK, EPX_NCCL_ID_FILE) as torchrun / mpirun / srun would set them. Each process computes
// the host reference of every rank and checks its own. Run through scripts/run_ranks.sh; alone
// (no RANK) every test skips with a message.
#include <gtest/gtest.h>

#include <cstdlib>

#include "gpu/ep_compare.h"

namespace epx {
namespace {

using testing::EpCase;

bool launched() { return std::getenv("RANK") && std::getenv("WORLD_SIZE"); }

#define EPX_REQUIRE_LAUNCHER()                                                                          \
  do {                                                                                                  \
    if (!launched()) GTEST_SKIP() << "not started by a launcher (RANK/WORLD_SIZE unset): use scripts/run_ranks.sh"; \
  } while (0)

TEST(EpMultiProcess, ZeroCopyMatchesReference) {
  EPX_REQUIRE_LAUNCHER();
  EpCase c;
  c.ranks = std::atoi(std::getenv("WORLD_SIZE"));
  c.E = 8 * c.ranks;
  c.max_tokens = 200;
  Group g = Group::create_from_env(c.group_config());
  ASSERT_EQ(g.size(), c.ranks);
  for (uint32_t seed : {3u, 4u}) {
    c.seed = seed;
    c.zipf = seed == 4 ? 3 : 0;
    const auto want = testing::ep_reference(c);
    const testing::EpOutputs got = testing::ep_run(g, c);
    testing::expect_same_ep_outputs(got, want[g.rank()], g.rank());
  }
}

}  // namespace
}  // namespace epx
