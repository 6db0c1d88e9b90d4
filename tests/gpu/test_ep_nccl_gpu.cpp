// The NCCL group, one process driving every local GPU (one thread per rank), against the host
// reference of the same R ranks on the same inputs, for BOTH transports: zero-copy (LSA pointers
// into symmetric windows) and staged (ncclSend/ncclRecv). Every test is instantiated twice,
// .../ZeroCopy and .../Staged; the transport is named in GroupConfig, so EPX_TRANSPORT does not
// change what these tests run. Skips without two GPUs.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "core/host_barrier.h"
#include "core/scoped_env.h"
#include "core/window_layout.h"
#include "gpu/ep_compare.h"
#include "common/ep_procedures.h"

namespace epx {
namespace {

using testing::EpCase;
using testing::EpOutputs;

int gpus() { return detail::cuda_device_count(); }

#define EPX_REQUIRE_GPUS(n)                                                                          \
  do {                                                                                               \
    if (gpus() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs, " << gpus() << " visible: skipped"; \
  } while (0)

// Every visible GPU a rank, 8 experts per rank.
EpCase base_case() {
  EpCase c;
  c.ranks = gpus();
  c.E = 8 * c.ranks;
  return c;
}

// The transport comparisons' case: skewed routing over short rows, small enough to run many groups.
EpCase small_skewed_case() {
  EpCase c = base_case();
  c.H = 256;
  c.align = 16;
  c.zipf = 2;
  c.max_tokens = 200;
  return c;
}

void compare_all(const EpCase& c, std::vector<Group>& groups) {
  SCOPED_TRACE(c.str());
  const std::vector<EpOutputs> want = testing::ep_reference(c);
  std::vector<EpOutputs> got(c.ranks);
  detail::HostBarrier bar(c.ranks);
  run_ranks(groups, [&](Group& g) { got[g.rank()] = testing::ep_run(g, c, [&] { bar.wait(); }); });
  for (int r = 0; r < c.ranks; ++r) testing::expect_same_ep_outputs(got[r], want[r], r);
}

std::string transport_param_name(const ::testing::TestParamInfo<Transport>& info) {
  return info.param == Transport::kZeroCopy ? "ZeroCopy" : "Staged";
}

class EpNcclGpu : public ::testing::TestWithParam<Transport> {
 protected:
  GroupConfig config_of(const EpCase& c) const {
    GroupConfig cfg = c.group_config();
    cfg.transport = GetParam();
    return cfg;
  }
  std::vector<Group> make(const EpCase& c) {
    std::vector<Group> groups = Group::create_all_local(config_of(c));
    for (Group& g : groups) EXPECT_EQ(g.transport(), GetParam()) << "rank " << g.rank();
    return groups;
  }
};

TEST_P(EpNcclGpu, MatchesReference) {
  EPX_REQUIRE_GPUS(2);
  EpCase c = base_case();
  auto groups = make(c);
  for (uint32_t seed : {1u, 2u}) {
    c.seed = seed;
    compare_all(c, groups);  // one group, several layers' worth of calls: epochs keep counting
  }
}

// Every scenario of testing::standard_cases (uniform, skewed, one hot expert, all to one rank,
// ranks that receive nothing, masked slots, T = 0 on one / every rank, max T, int32 / int64 ids,
// bf16 / fp32 rows, rows that are not 16-byte multiples, capacity by position / probability), each
// on a group sized for it, all ranks against the reference.
TEST_P(EpNcclGpu, StandardScenarios) {
  EPX_REQUIRE_GPUS(2);
  std::map<std::string, std::vector<Group>> groups;  // one group per buffer configuration
  for (const auto& nc : testing::standard_cases(gpus())) {
    SCOPED_TRACE(nc.name);
    const std::string key = testing::group_key(nc.c);
    if (!groups.count(key)) groups[key] = make(nc.c);
    compare_all(nc.c, groups[key]);
  }
}

// The scenarios share one group where their sizes allow: several layers' worth of different
// routings through the same buffers.
TEST_P(EpNcclGpu, AdversarialRoutingOnOneGroup) {
  EPX_REQUIRE_GPUS(2);
  const EpCase b = base_case();
  auto groups = make(b);
  EpCase skew = b;
  skew.zipf = 4;
  compare_all(skew, groups);
  EpCase hot = b;
  hot.hot = 3;
  hot.mask_p = 1.0;
  compare_all(hot, groups);
  EpCase to_zero = b;
  to_zero.only_rank = 0;  // every other rank receives nothing
  compare_all(to_zero, groups);
  EpCase masked = b;
  masked.mask_p = 0.8;
  compare_all(masked, groups);
  EpCase empty_rank = b;
  empty_rank.tokens.assign(b.ranks, b.max_tokens);
  empty_rank.tokens[0] = 0;  // T = 0 on one rank
  compare_all(empty_rank, groups);
}

// Decode-sized batches of model-sized rows: with fewer rows than warps the zero-copy combine (and
// dispatch_backward) splits each partial and each sum over up to 8 warps by ranges of the row's
// vectors. H = 7168 (bf16: 896 vectors, 8 pieces of 112; fp32: 1792), H = 7000 (875 vectors: the
// last piece is empty but still counts its share of the arrival), H = 7001 (odd: element-wise
// rows), skewed and masked routing, T = 0 on one rank; every output against the reference.
TEST_P(EpNcclGpu, DecodeBatchesOfModelSizedRowsMatchReference) {
  EPX_REQUIRE_GPUS(2);
  EpCase b = base_case();
  b.K = 8;
  b.max_tokens = 32;
  b.align = 16;
  for (int64_t H : {int64_t{7168}, int64_t{7000}, int64_t{7001}}) {
    EpCase c = b;
    c.H = H;
    auto groups = make(c);
    for (DType payload : {DType::kBF16, DType::kF32}) {
      c.payload = payload;
      c.tokens.assign(c.ranks, 24);
      c.zipf = 0;
      c.seed = 11;
      compare_all(c, groups);
      c.zipf = 2;
      c.mask_p = 0.3;
      c.tokens[0] = 1;
      c.tokens[c.ranks - 1] = 0;
      c.seed = 12;
      compare_all(c, groups);
      c.mask_p = 0.1;
    }
  }
}

// The zero-copy dispatch has two expand kernels: small batches (this rank's tokens x ranks at most
// half the expand warps: 2 blocks of 8 warps per SM) split each row over several warps, larger ones
// give a row to one warp. The other tests' batches are small; these span both sides of that line
// with short rows, uniform and skewed routing, fp32 and bf16 rows that are not 16-byte multiples.
TEST_P(EpNcclGpu, BatchesOnBothSidesOfTheDecodeKernelMatchReference) {
  EPX_REQUIRE_GPUS(2);
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  EpCase b = base_case();
  b.K = 8;
  b.H = 64;
  b.align = 16;
  const int line = 2 * sms * 8 / (2 * b.ranks);  // tokens per rank at the line
  b.max_tokens = line + 64;
  auto groups = make(b);
  for (int T : {line / 2, line + 64}) {
    EpCase c = b;
    c.tokens.assign(c.ranks, T);
    c.zipf = 0;
    c.seed = 21;
    compare_all(c, groups);
    c.zipf = 2;
    c.tokens[0] = T - 3;
    c.seed = 22;
    compare_all(c, groups);
    c.payload = DType::kF32;
    c.seed = 23;
    compare_all(c, groups);
  }
  EpCase odd = b;
  odd.H = 61;  // rows of element-wise copies
  auto odd_groups = make(odd);
  odd.tokens.assign(odd.ranks, line + 64);
  compare_all(odd, odd_groups);
}

// combine_backward without row weights (the layer's backward when the expert FFN computes the row
// weights' gradients) copies d_out rows: on zero-copy it runs the dispatch's launch. Uniform, skewed,
// one-rank and masked routings, a row length off the 16-byte vectors, align 1 and 128.
TEST_P(EpNcclGpu, UnweightedCombineBackwardMatchesReference) {
  EPX_REQUIRE_GPUS(2);
  EpCase c = base_case();
  c.weighted_combine_bwd = false;
  auto groups = make(c);
  for (uint32_t seed : {3u, 4u}) {
    c.seed = seed;
    c.zipf = seed == 4 ? 2 : 0;
    compare_all(c, groups);
  }
  EpCase one = c;
  one.only_rank = c.ranks - 1;
  one.mask_p = 0.3;
  compare_all(one, groups);
  EpCase odd = base_case();
  odd.weighted_combine_bwd = false;
  odd.H = 61;
  odd.align = 128;
  auto odd_groups = make(odd);
  compare_all(odd, odd_groups);
}

// fp8 rows with fp32 1x128 scales and with e8m0 MX scales travel together; every received byte
// equals the reference's. (The staged transport sends only H + scale bytes per row.)
TEST_P(EpNcclGpu, QuantizedDispatchMatchesReference) {
  EPX_REQUIRE_GPUS(2);
  EpCase c = base_case();
  c.H = 256;
  c.align = 32;
  auto groups = make(c);
  for (DType sdt : {DType::kF32, DType::kE8M0})
    for (uint32_t seed : {5u, 6u}) {
      c.seed = seed;
      c.zipf = seed == 6 ? 3 : 0;
      SCOPED_TRACE(detail::concat(c.str(), " scales=", dtype_name(sdt)));
      const auto want = testing::ep_reference_quantized(c, sdt);
      std::vector<testing::EpQuantOutputs> got(c.ranks);
      detail::HostBarrier bar(c.ranks);
      run_ranks(groups, [&](Group& g) { got[g.rank()] = testing::ep_run_quantized(g, c, sdt, [&] { bar.wait(); }); });
      for (int r = 0; r < c.ranks; ++r) testing::expect_same_quant_outputs(got[r], want[r], r);
    }
}

TEST_P(EpNcclGpu, AllReduceSumsInRankOrder) {
  EPX_REQUIRE_GPUS(2);
  EpCase c = base_case();
  auto groups = make(c);
  detail::HostBarrier bar(c.ranks);
  // 40000 floats: more than the zero-copy reduce region; 2^20 + 3: several rows-region chunks,
  // the last one short; 1 and 0 elements: edge cases.
  for (int64_t n : {int64_t{40000}, int64_t{1 << 20} + 3, int64_t{1}, int64_t{0}}) {
    SCOPED_TRACE(detail::concat("n = ", n));
    run_ranks(groups, [&](Group& g) { testing::check_all_reduce(g, n, [&] { bar.wait(); }); });
  }
}

// dispatch + combine forward and both backwards (prepare included) captured in a CUDA graph on
// every rank's own stream, replayed 10 times: bit-identical to the eager run each time.
TEST_P(EpNcclGpu, GraphReplayIsBitIdenticalToEager) {
  EPX_REQUIRE_GPUS(2);
  const EpCase c = testing::graph_replay_case(gpus());
  auto groups = make(c);
  if (groups[0].config().staged_exact_sizes)  // its prepare syncs to read the counts (refused under capture)
    GTEST_SKIP() << "exact staged sizes (EPX_STAGED_SIZES=exact): prepare cannot be captured, by design";
  const std::vector<EpOutputs> want = testing::ep_reference(c);
  detail::HostBarrier bar(c.ranks);
  run_ranks(groups, [&](Group& g) { testing::check_graph_replay(g, c, want[g.rank()], 10, [&] { bar.wait(); }); });
}

// Three microbatches with different routings in flight on one group, forwards and backwards
// interleaved in different orders; each equals its own reference.
TEST_P(EpNcclGpu, InterleavedMicrobatchesMatchReference) {
  EPX_REQUIRE_GPUS(2);
  const std::vector<EpCase> mbs = testing::microbatch_cases(gpus());
  std::vector<std::vector<EpOutputs>> want;
  for (const EpCase& c : mbs) want.push_back(testing::ep_reference(c));
  auto groups = make(mbs[0]);
  detail::HostBarrier bar(mbs[0].ranks);
  run_ranks(groups, [&](Group& g) { testing::check_interleaved_microbatches(g, mbs, want, [&] { bar.wait(); }); });
}

// Ranks drifting apart over six iterations of every op with random host pauses and no meeting in
// between (testing::check_drifting_op_sequences): every iteration equals the reference.
TEST_P(EpNcclGpu, DriftingRanksMatchReferenceEveryIteration) {
  EPX_REQUIRE_GPUS(2);
  const EpCase c = testing::drift_case(gpus());
  auto groups = make(c);
  const std::vector<EpOutputs> want = testing::ep_reference(c);
  detail::HostBarrier bar(c.ranks);
  run_ranks(groups, [&](Group& g) {
    testing::check_drifting_op_sequences(g, c, want[g.rank()], 6, 1, [&] { bar.wait(); });
  });
}

// Communication buffers are allocated once at creation, sized rank-major from the config:
// zero-copy one window (layout + inboxes), staged a send and a receive buffer (header, meta and
// rows regions each).
TEST_P(EpNcclGpu, RegisteredBytesAreTheRankMajorBuffers) {
  EPX_REQUIRE_GPUS(2);
  const EpCase c = base_case();
  auto groups = make(c);
  const WindowLayout L = WindowLayout::make(config_of(c), c.ranks);
  for (Group& g : groups) {
    if (GetParam() == Transport::kStaged) EXPECT_EQ(g.registered_bytes(), 2 * L.reduce) << "rank " << g.rank();
    else EXPECT_GE(g.registered_bytes(), L.total) << "rank " << g.rank();
    // What `epx info` reports before any group exists.
    EXPECT_EQ(g.registered_bytes(), registered_bytes_per_rank(config_of(c), c.ranks, GetParam())) << "rank " << g.rank();
  }
}

// A group's creation and teardown switch devices internally; the caller's current device must be
// what it was (later launches on the "current" device would otherwise hit another GPU's memory).
TEST_P(EpNcclGpu, CreatingAndDestroyingKeepsTheCallersDevice) {
  EPX_REQUIRE_GPUS(2);
  const EpCase c = base_case();
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

INSTANTIATE_TEST_SUITE_P(Transports, EpNcclGpu, ::testing::Values(Transport::kZeroCopy, Transport::kStaged),
                         transport_param_name);

// testing::ep_run on every rank of a fresh all-local group made with `cfg`: each rank's outputs.
// created (optional) sees the groups first.
std::vector<EpOutputs> run_every_rank(const EpCase& c, const GroupConfig& cfg,
                                      const std::function<void(const std::vector<Group>&)>& created = {}) {
  auto groups = Group::create_all_local(cfg);
  if (created) created(groups);
  std::vector<EpOutputs> got(c.ranks);
  detail::HostBarrier bar(c.ranks);
  run_ranks(groups, [&](Group& g) { got[g.rank()] = testing::ep_run(g, c, [&] { bar.wait(); }); });
  return got;
}

// The two transports run the same kernels with the same arithmetic: their outputs are equal bit
// for bit (d_row_weights included, which the reference only matches within a tolerance).
TEST(EpNcclGpuTransports, ZeroCopyAndStagedAreBitIdentical) {
  EPX_REQUIRE_GPUS(2);
  EpCase c = small_skewed_case();
  c.K = 6;
  std::vector<std::vector<EpOutputs>> got(2);
  for (int t = 0; t < 2; ++t) {
    GroupConfig cfg = c.group_config();
    cfg.transport = t == 0 ? Transport::kZeroCopy : Transport::kStaged;
    got[t] = run_every_rank(c, cfg);
  }
  for (int r = 0; r < c.ranks; ++r)
    testing::expect_identical_ep_outputs(got[1][r], got[0][r], detail::concat("rank ", r, ": staged vs zero-copy"));
}

// GroupConfig::num_sms caps every EP launch's blocks; the kernels share out whatever grid they get,
// so the results do not depend on it, down to two blocks (one sender / summer and one expander /
// reducer in the overlapped kernels).
TEST(EpNcclGpuTransports, SmBudgetDoesNotChangeResults) {
  EPX_REQUIRE_GPUS(2);
  EpCase c = small_skewed_case();
  for (Transport t : {Transport::kZeroCopy, Transport::kStaged}) {
    GroupConfig cfg = c.group_config();
    cfg.transport = t;
    const std::vector<EpOutputs> all = run_every_rank(c, cfg);
    for (int budget : {2, 5}) {
      cfg.num_sms = budget;
      const std::vector<EpOutputs> got = run_every_rank(c, cfg);
      for (int r = 0; r < c.ranks; ++r)
        testing::expect_identical_ep_outputs(got[r], all[r], detail::concat(transport_name(t), ", rank ", r,
                                                                            ": num_sms = ", budget, " vs auto"));
    }
  }
}

// GroupConfig::staged_exact_sizes: each staged exchange moves only the slots a peer needs (counts
// copied to the host by prepare); the results are the fixed-size exchanges' bit for bit, and a
// prepare under CUDA graph capture is refused before anything is queued.
TEST(EpNcclGpuTransports, StagedExactSizesMatchFixedSizes) {
  EPX_REQUIRE_GPUS(2);
  EpCase c = small_skewed_case();
  std::vector<std::vector<EpOutputs>> got(2);
  for (int t = 0; t < 2; ++t) {
    GroupConfig cfg = c.group_config();
    cfg.transport = Transport::kStaged;
    cfg.staged_exact_sizes = t == 1;
    got[t] = run_every_rank(c, cfg, [&](const std::vector<Group>& groups) {
      EXPECT_EQ(groups[0].config().staged_exact_sizes, t == 1);
    });
  }
  for (int r = 0; r < c.ranks; ++r)
    testing::expect_identical_ep_outputs(got[1][r], got[0][r], detail::concat("rank ", r, ": exact vs fixed sizes"));

  GroupConfig cfg = c.group_config();
  cfg.transport = Transport::kStaged;
  cfg.staged_exact_sizes = true;
  auto groups = Group::create_all_local(cfg);
  std::vector<std::string> msgs(c.ranks);
  detail::HostBarrier bar(c.ranks);
  run_ranks(groups, [&](Group& g) {
    const testing::EpInputs in = testing::ep_inputs(c, g.rank(), g.recv_capacity_rows());
    const Tensor idx = in.idx.to(g.device());
    cudaStream_t s = nullptr;
    EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    try {
      Handle h = prepare(g, idx, {}, {}, Stream{s});
    } catch (const Error& e) {
      msgs[g.rank()] = e.what();
    }
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(s, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
    bar.wait();  // every rank's capture is over before a peer's exchange is in flight
    {
      Handle h = prepare(g, idx, {});  // the group still works outside a capture
      g.check();
      bar.wait();  // and every exchange is over before a rank frees its handle and inputs
    }
  });
  for (int r = 0; r < c.ranks; ++r)
    EXPECT_NE(msgs[r].find("cannot be captured in a CUDA graph"), std::string::npos) << "rank " << r << ": " << msgs[r];
}

// EPX_TRANSPORT decides for GroupConfig::transport = kAuto (and only then); without it, auto picks
// zero-copy when every rank is in one LSA team (GPUs of one NVLink domain).
TEST(EpNcclGpuTransports, AutoFollowsEnvironmentThenTopology) {
  EPX_REQUIRE_GPUS(2);
  EpCase c = base_case();
  {
    const detail::ScopedEnv transport("EPX_TRANSPORT", "staged");
    auto groups = Group::create_all_local(c.group_config());
    EXPECT_EQ(groups[0].transport(), Transport::kStaged) << "EPX_TRANSPORT=staged with config.transport = auto";
    GroupConfig explicit_zc = c.group_config();
    explicit_zc.transport = Transport::kZeroCopy;
    auto zc = Group::create_all_local(explicit_zc);
    EXPECT_EQ(zc[0].transport(), Transport::kZeroCopy) << "config.transport names the transport: it wins";
  }
  {
    const detail::ScopedEnv transport("EPX_TRANSPORT", nullptr);
    auto groups = Group::create_all_local(c.group_config());
    EXPECT_EQ(groups[0].transport(), Transport::kZeroCopy)
        << "auto on GPUs that reach each other by load/store (if this machine's GPUs are not one LSA team, "
           "staged is right and this expectation is the thing to revisit)";
  }
}

TEST(EpNcclGpuTransports, ZeroCopyMissingRankTimesOutWithItsName) {
  EPX_REQUIRE_GPUS(2);
  EpCase c = base_case();
  GroupConfig cfg = c.group_config();
  cfg.timeout_s = 0.5;
  cfg.transport = Transport::kZeroCopy;
  {
    // Every device first runs prepare in a group with the default timeout: the first launch on a
    // device loads epx's kernels, and with four or more devices loading at once a rank can start
    // more than the 0.5 s below after the others (seen on 4 x H200).
    GroupConfig warm = cfg;
    warm.timeout_s = 0;
    // The host barriers: no rank allocates or frees device memory while a peer's collective is in
    // flight (see Group::create_all_local).
    auto warm_groups = Group::create_all_local(warm);
    detail::HostBarrier bar(c.ranks);
    run_ranks(warm_groups, [&](Group& g) {
      const testing::EpInputs in = testing::ep_inputs(c, g.rank(), g.recv_capacity_rows());
      const Tensor idx = in.idx.to(g.device());
      bar.wait();
      {
        Handle h = prepare(g, idx, {});
        g.check();
        bar.wait();
      }
    });
  }
  auto groups = Group::create_all_local(cfg);
  std::vector<std::string> msgs(c.ranks);
  // The joining ranks make their inputs first and start prepare together: the random inputs take
  // host time that grows with the ranks (a receive buffer's worth of rows), and on 4 devices a joining
  // rank that started late was reported missing beside the one that never joins.
  detail::HostBarrier joined(c.ranks - 1);
  run_ranks(groups, [&](Group& g) {
    if (g.rank() == c.ranks - 1) return;  // this rank never joins
    const testing::EpInputs in = testing::ep_inputs(c, g.rank(), g.recv_capacity_rows());
    const Tensor idx = in.idx.to(g.device());
    joined.wait();
    Handle h = prepare(g, idx, {});
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

// Staged: NCCL's send/receive has no timeout of its own, so check() waits for the last exchange
// with the group's timeout and reports a late peer instead of blocking; the exchange stays queued
// and completes when the peer arrives, after which the group works as before. (The late rank waits
// at most 20 s for the others to see the timeout, so a regression fails instead of hanging.)
TEST(EpNcclGpuTransports, StagedLateRankIsReportedByCheckThenCompletes) {
  EPX_REQUIRE_GPUS(2);
  EpCase c = base_case();
  GroupConfig cfg = c.group_config();
  cfg.timeout_s = 0.5;
  cfg.transport = Transport::kStaged;
  auto groups = Group::create_all_local(cfg);
  std::vector<std::string> msgs(c.ranks);
  std::atomic<int> early_done{0};
  detail::HostBarrier bar(c.ranks);
  run_ranks(groups, [&](Group& g) {
    const testing::EpInputs in = testing::ep_inputs(c, g.rank(), g.recv_capacity_rows());
    Tensor idx = in.idx.to(g.device());
    Handle h;
    bar.wait();
    const bool late = g.rank() == c.ranks - 1;
    if (!late) {
      h = prepare(g, idx, {});
      try {
        g.check();
        msgs[g.rank()] = "(check() returned without an error)";
      } catch (const Error& e) {
        msgs[g.rank()] = e.what();
      }
      ++early_done;
    } else {
      const auto start = std::chrono::steady_clock::now();
      while (early_done.load() < c.ranks - 1 &&
             std::chrono::steady_clock::now() - start < std::chrono::seconds(20))
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      h = prepare(g, idx, {});  // the late rank joins
    }
    EXPECT_NO_THROW(g.check()) << "rank " << g.rank() << ": the exchange completes once every rank joined";
    bar.wait();
  });
  for (int r = 0; r + 1 < c.ranks; ++r) {
    EXPECT_NE(msgs[r].find("epx::prepare: rank " + std::to_string(r) + " waited 0.5 s for the staged exchange"),
              std::string::npos)
        << msgs[r];
  }
}

}  // namespace
}  // namespace epx
