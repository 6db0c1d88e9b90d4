// GPU tests of the device-side prepare (src/cuda/layout) at the kernel level, for any number of
// ranks on one GPU: the send side of a multi-rank group (local = false) and the whole routing state
// of a one-rank group (local = true), against an oracle computed here on the host with the
// reference's sequential rules (src/ref/host_group.cpp: a pair's position is the count of earlier
// pairs to its expert, a token's slot the count of earlier tokens to its rank), and the fused
// one-launch kernel against the legacy three-launch path bit for bit.
//
// Every handle block is poisoned before a run (bytes 0x5A), so an output the kernel forgets to
// write, or look-back flags that a fresh block happens to hold, show up. Graph replays with new ids
// in the same input buffer check that the flags of one launch are never taken for those of the next.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/routing_draw.h"
#include "core/ep_state.h"
#include "cuda/layout/layout.h"
#include "epx/comm.h"
#include "epx/layout.h"
#include "epx/tensor.h"
#include "gpu/gpu_test_util.h"

namespace epx {
namespace {

using testing::draw_routing;
using testing::RoutingDraw;
using testing::to_gpu;
using testing::to_host;

struct LCase {
  int T = 256, max_tokens = 256, E = 64, K = 4, R = 1, align = 1;
  bool local = true;
  float cf = 0;
  DropPolicy drop = DropPolicy::kByPosition;
  double mask_p = 0.1, zipf = 0;
  int hot = -1;
  DType idx_dtype = DType::kI32;
  std::vector<std::pair<int64_t, int64_t>> bad;  // (pair index, id) written over the random ids
  uint32_t seed = 1;
};

std::string describe(const LCase& c) {
  std::ostringstream os;
  os << "T=" << c.T << " max_tokens=" << c.max_tokens << " E=" << c.E << " K=" << c.K << " R=" << c.R
     << " align=" << c.align << (c.local ? " local" : " send-side") << " cf=" << c.cf
     << (c.drop == DropPolicy::kByProbability ? " by-probability" : " by-position") << " mask_p=" << c.mask_p
     << " zipf=" << c.zipf << " hot=" << c.hot << " idx=" << dtype_name(c.idx_dtype) << " bad=" << c.bad.size()
     << " seed=" << c.seed;
  return os.str();
}

int capacity_of(const LCase& c) {
  return c.cf > 0 ? static_cast<int>(std::ceil(static_cast<double>(c.cf) * c.T * c.K / c.E)) : 0;
}

struct Inputs {
  std::vector<int64_t> ids;  // [T, K]
  std::vector<float> w;      // [T, K]
};

Inputs make_inputs(const LCase& c) {
  std::mt19937 rng(c.seed);
  std::uniform_real_distribution<double> u(0, 1);
  Inputs in;
  in.ids.assign(static_cast<size_t>(c.T) * c.K, -1);
  in.w.assign(in.ids.size(), 0.0f);
  draw_routing(rng, u, c.T, RoutingDraw{c.E, c.K, c.hot, c.mask_p, c.zipf}, [&](int t, int k, int64_t e) {
    in.ids[static_cast<size_t>(t) * c.K + k] = e;
    // Weights with ties (a few distinct values) and the odd NaN, for drop by probability.
    const int r = static_cast<int>(u(rng) * 40);
    in.w[static_cast<size_t>(t) * c.K + k] = r == 0 ? NAN : 0.125f * static_cast<float>(r % 9);
  });
  for (const auto& b : c.bad) in.ids[b.first] = b.second;
  return in;
}

// The routing state the reference rules give, for this rank (rank 0) of a group of R ranks.
struct Expected {
  std::vector<int32_t> routed, pair_pos, token_slot, send_tokens, counts;
  std::vector<int32_t> recv_pairs, recv_tokens, expert_rows, expert_offsets;
  std::vector<int32_t> status;  // [4]
};

Expected oracle(const LCase& c, const Inputs& in, int64_t recv_capacity) {
  const int T = c.T, K = c.K, E = c.E, R = c.R, Le = E / R;
  Expected x;
  x.routed.assign(static_cast<size_t>(T) * K, -1);
  x.status = {0, kNoBadPair, 0, 0};
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const int64_t q = static_cast<int64_t>(t) * K + k;
      const int64_t e = in.ids[q];
      if (e == -1) continue;
      bool bad = e < 0 || e >= E;
      int kind = 1;
      if (!bad)
        for (int k2 = 0; k2 < k; ++k2)
          if (in.ids[static_cast<int64_t>(t) * K + k2] == e) {
            bad = true;
            kind = 2;
          }
      if (bad) {
        if (x.status[1] == kNoBadPair) {
          x.status[1] = static_cast<int32_t>(q);
          x.status[2] = static_cast<int32_t>(e);
          x.status[3] = kind;
        }
        continue;
      }
      x.routed[q] = static_cast<int32_t>(e);
    }
  const int cap = capacity_of(c);
  if (cap > 0 && c.drop == DropPolicy::kByPosition) {
    std::vector<int> taken(E, 0);
    for (auto& e : x.routed)
      if (e >= 0 && taken[e]++ >= cap) e = -1;
  } else if (cap > 0) {
    std::vector<std::vector<int64_t>> pairs(E);
    for (int64_t q = 0; q < static_cast<int64_t>(x.routed.size()); ++q)
      if (x.routed[q] >= 0) pairs[x.routed[q]].push_back(q);
    auto key = [&](int64_t q) { return std::isnan(in.w[q]) ? -INFINITY : in.w[q]; };
    for (auto& v : pairs) {
      if (static_cast<int>(v.size()) <= cap) continue;
      std::stable_sort(v.begin(), v.end(), [&](int64_t a, int64_t b) { return key(a) > key(b); });
      for (size_t i = cap; i < v.size(); ++i) x.routed[v[i]] = -1;
    }
  }
  x.pair_pos.assign(x.routed.size(), -1);
  x.token_slot.assign(static_cast<size_t>(T) * R, -1);
  x.send_tokens.assign(R, 0);
  x.counts.assign(E, 0);
  for (int t = 0; t < T; ++t) {
    std::vector<char> to(R, 0);
    for (int k = 0; k < K; ++k) {
      const int e = x.routed[static_cast<size_t>(t) * K + k];
      if (e < 0) continue;
      x.pair_pos[static_cast<size_t>(t) * K + k] = x.counts[e]++;
      to[e / Le] = 1;
    }
    for (int d = 0; d < R; ++d)
      if (to[d]) x.token_slot[static_cast<size_t>(t) * R + d] = x.send_tokens[d]++;
  }
  if (c.local) {
    x.recv_pairs = x.counts;
    x.expert_rows = x.counts;
    x.recv_tokens = x.send_tokens;
    x.expert_offsets.assign(E + 1, 0);
    int64_t total = 0;
    for (int e = 0; e < E; ++e) {
      x.expert_offsets[e] = static_cast<int32_t>(total);
      total += round_up(x.counts[e], c.align);
    }
    x.expert_offsets[E] = static_cast<int32_t>(total);
    x.status[0] = total > recv_capacity ? static_cast<int32_t>(total - recv_capacity) : 0;
  }
  return x;
}

// A handle block of its own on the device, poisoned, and its state bound to it.
struct DeviceHandle {
  Tensor block;
  HandleState h;
};

GroupConfig config_of(const LCase& c) {
  GroupConfig g;
  g.num_experts = c.E;
  g.hidden = 64;
  g.max_tokens_per_rank = c.max_tokens;
  g.max_topk = c.K;
  g.align = c.align;
  return g;
}

std::unique_ptr<DeviceHandle> make_handle(const LCase& c) {
  auto d = std::make_unique<DeviceHandle>();
  const GroupConfig cfg = config_of(c);
  const size_t bytes = cuda::handle_block_bytes(cfg, c.R);
  d->block = Tensor::empty({static_cast<int64_t>(bytes)}, DType::kU8, Device::cuda(0));
  EXPECT_EQ(cudaMemset(d->block.data(), 0x5A, bytes), cudaSuccess);
  HandleState& h = d->h;
  h.num_tokens = c.T;
  h.topk = c.K;
  h.num_experts = c.E;
  h.num_ranks = c.R;
  h.local_experts = c.E / c.R;
  h.max_tokens = c.max_tokens;
  h.max_topk = c.K;
  h.capacity = capacity_of(c);
  Tensor keep = d->block;
  h.storage = std::shared_ptr<void>(keep.data(), [keep](void*) {});
  cuda::bind_handle(h, d->block.data(), cfg, c.R, 0, Device::cuda(0));
  return d;
}

std::vector<int32_t> i32(const TensorRef& t) {
  if (!t.defined() || t.numel() == 0) return {};
  Tensor h = to_host(t);
  return std::vector<int32_t>(h.ptr<int32_t>(), h.ptr<int32_t>() + h.numel());
}

struct Got {
  std::vector<int32_t> routed, pair_pos, token_slot, send_tokens, counts;
  std::vector<int32_t> recv_pairs, recv_tokens, expert_rows, expert_offsets, status, group_status;
};

Got read_back(const HandleState& h, bool local, const Tensor& group_status) {
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Got g;
  g.routed = i32(h.routed_experts.ref());
  g.pair_pos = i32(h.pair_pos.ref());
  g.token_slot = i32(h.token_slot.ref());
  g.send_tokens = i32(h.send_tokens.ref());
  g.counts = i32(h.routed_counts.ref());
  g.status = i32(h.status.ref());
  if (local) {
    g.recv_pairs = i32(h.recv_pairs.ref());
    g.recv_tokens = i32(h.recv_tokens.ref());
    g.expert_rows = i32(h.expert_rows.ref());
    g.expert_offsets = i32(h.expert_offsets.ref());
  }
  g.group_status = i32(group_status.ref());
  return g;
}

Tensor fresh_group_status() {
  Tensor s = Tensor::empty({5}, DType::kI32);
  const int32_t init[5] = {0, kNoBadPair, 0, 0, 0};
  std::copy(init, init + 5, s.ptr<int32_t>());
  return to_gpu(s);
}

// First differing elements of two int vectors, with their indices.
::testing::AssertionResult same(const std::vector<int32_t>& got, const std::vector<int32_t>& want, const char* what,
                                int row = 0) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " elements, want " << want.size();
  std::ostringstream os;
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) {
      if (bad < 8) {
        os << "\n  [" << i;
        if (row > 0) os << " = (" << i / row << ", " << i % row << ")";
        os << "] got " << got[i] << ", want " << want[i];
      }
      ++bad;
    }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size() << " differ:" << os.str();
}

void expect_matches(const Got& g, const Expected& x, const LCase& c) {
  EXPECT_TRUE(same(g.routed, x.routed, "routed_experts [T, K]", c.K));
  EXPECT_TRUE(same(g.pair_pos, x.pair_pos, "pair_pos [T, K]", c.K));
  EXPECT_TRUE(same(g.token_slot, x.token_slot, "token_slot [T, R]", c.R));
  EXPECT_TRUE(same(g.send_tokens, x.send_tokens, "send_tokens [R]"));
  EXPECT_TRUE(same(g.counts, x.counts, "routed_counts [E]"));
  EXPECT_TRUE(same(g.status, x.status, "status {overflow, bad pair, id, kind}"));
  if (c.local) {
    EXPECT_TRUE(same(g.recv_pairs, x.recv_pairs, "recv_pairs [E]"));
    EXPECT_TRUE(same(g.recv_tokens, x.recv_tokens, "recv_tokens [1]"));
    EXPECT_TRUE(same(g.expert_rows, x.expert_rows, "expert_rows [E]"));
    EXPECT_TRUE(same(g.expert_offsets, x.expert_offsets, "expert_offsets [E + 1]"));
  }
  std::vector<int32_t> gs = {std::max(0, x.status[0]), kNoBadPair, 0, 0, 0};
  if (x.status[1] != kNoBadPair) gs = {gs[0], x.status[1], x.status[2], x.status[3], c.K};
  EXPECT_TRUE(same(g.group_status, gs, "group status {overflow, bad pair, id, kind, K}"));
}

Tensor ids_tensor(const LCase& c, const Inputs& in) {
  Tensor t = Tensor::empty({c.T, c.K}, c.idx_dtype);
  for (size_t i = 0; i < in.ids.size(); ++i) store_from_double(t.data(), c.idx_dtype, static_cast<int64_t>(i),
                                                               static_cast<double>(in.ids[i]));
  return to_gpu(t);
}

Tensor weights_tensor(const LCase& c, const Inputs& in) {
  Tensor t = Tensor::empty({c.T, c.K}, DType::kF32);
  std::copy(in.w.begin(), in.w.end(), t.ptr<float>());
  return to_gpu(t);
}

int64_t recv_capacity_of(const LCase& c) { return worst_case_recv_rows(config_of(c), c.R); }

Got run_kernel(const LCase& c, cuda::LayoutKernel which, const Tensor& ids, const Tensor& w, int64_t recv_cap) {
  cuda::set_layout_kernel(which);
  auto d = make_handle(c);
  Tensor gs = fresh_group_status();
  PrepareOptions opt;
  opt.capacity_factor = c.cf;
  opt.drop_policy = c.drop;
  cuda::prepare_send_side(d->h, ids, w, opt, c.local, c.align, recv_cap, gs.ptr<int32_t>(), Stream{});
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  return read_back(d->h, c.local, gs);
}

// Fused and legacy against the oracle, and against each other.
void check(const LCase& c, int64_t recv_cap = -1) {
  SCOPED_TRACE(describe(c));
  const Inputs in = make_inputs(c);
  if (recv_cap < 0) recv_cap = recv_capacity_of(c);
  const Expected want = oracle(c, in, recv_cap);
  const Tensor ids = ids_tensor(c, in), w = weights_tensor(c, in);
  const Got fused = run_kernel(c, cuda::LayoutKernel::kFused, ids, w, recv_cap);
  {
    SCOPED_TRACE("fused kernel against the reference rules");
    expect_matches(fused, want, c);
  }
  const Got legacy = run_kernel(c, cuda::LayoutKernel::kLegacy, ids, w, recv_cap);
  {
    SCOPED_TRACE("legacy kernels against the reference rules");
    expect_matches(legacy, want, c);
  }
  cuda::set_layout_kernel(cuda::LayoutKernel::kFused);
}

TEST(LayoutGpu, BenchmarkShapesOneAndTwoRanks) {
  EPX_REQUIRE_GPU();
  for (int R : {1, 2})
    for (int align : {1, 128}) {
      LCase c;
      c.T = c.max_tokens = 4096;
      c.E = 256;
      c.K = 8;
      c.R = R;
      c.local = R == 1;
      c.align = align;
      c.mask_p = 0;
      c.seed = 7 + R + align;
      check(c);
    }
}

TEST(LayoutGpu, ManyRanksSendSide) {
  EPX_REQUIRE_GPU();
  for (int R : {4, 8, 64}) {
    LCase c;
    c.T = c.max_tokens = 1000;
    c.E = 256;
    c.K = 8;
    c.R = R;
    c.local = false;
    c.seed = 100 + R;
    check(c);
  }
  LCase big;  // the largest expert count, many ranks, int64 ids
  big.T = big.max_tokens = 777;
  big.E = 1024;
  big.K = 16;
  big.R = 64;
  big.local = false;
  big.idx_dtype = DType::kI64;
  check(big);
}

TEST(LayoutGpu, TokenCountsAndBlockBoundaries) {
  EPX_REQUIRE_GPU();
  // T = 0, one token, fewer tokens than max (fewer blocks), a partial last block, exactly 64 blocks,
  // and many rounds per block.
  for (int T : {0, 1, 31, 100, 4095, 4096}) {
    LCase c;
    c.max_tokens = 4096;
    c.T = T;
    c.E = 64;
    c.K = 6;
    c.seed = 200 + T;
    check(c);
  }
  LCase big;
  big.T = big.max_tokens = 16384;
  big.E = 256;
  big.K = 8;
  big.R = 2;
  big.local = false;
  check(big);
  LCase big_local = big;
  big_local.R = 1;
  big_local.local = true;
  big_local.align = 16;
  check(big_local);
}

TEST(LayoutGpu, TopkShapes) {
  EPX_REQUIRE_GPU();
  for (int K : {1, 3, 16}) {
    LCase c;
    c.K = K;
    c.E = 48;
    c.T = c.max_tokens = 333;
    c.seed = 300 + K;
    check(c);
  }
}

TEST(LayoutGpu, AdversarialRouting) {
  EPX_REQUIRE_GPU();
  LCase hot;
  hot.hot = 5;
  hot.mask_p = 1.0;
  hot.T = hot.max_tokens = 3000;
  check(hot);
  LCase skew;
  skew.zipf = 4;
  skew.R = 4;
  skew.local = false;
  check(skew);
  LCase masked;
  masked.mask_p = 1.0;
  check(masked);
}

TEST(LayoutGpu, BadIdsAreMaskedAndTheFirstIsReported) {
  EPX_REQUIRE_GPU();
  for (DType dt : {DType::kI32, DType::kI64}) {
    LCase c;
    c.T = c.max_tokens = 600;
    c.idx_dtype = dt;
    c.mask_p = 0;
    // Out of range in a late block, a repeat in an earlier one (the first bad pair wins), a negative
    // id other than -1 and, for int64, an id that int32 would wrap into range.
    c.bad = {{590 * 4 + 1, 64}, {300 * 4 + 3, -7}, {123 * 4 + 2, -1}};
    const Inputs in = make_inputs(c);
    c.bad.push_back({250 * 4 + 2, in.ids[250 * 4 + 0]});
    if (dt == DType::kI64) c.bad.push_back({10 * 4 + 1, (int64_t(1) << 32) + 3});
    check(c);
  }
}

TEST(LayoutGpu, CapacityByPositionAndByProbability) {
  EPX_REQUIRE_GPU();
  for (DropPolicy d : {DropPolicy::kByPosition, DropPolicy::kByProbability})
    for (float cf : {0.25f, 1.0f})
      for (int R : {1, 2}) {
        LCase c;
        c.T = c.max_tokens = 1500;
        c.E = 32;
        c.K = 4;
        c.R = R;
        c.local = R == 1;
        c.zipf = 2;
        c.cf = cf;
        c.drop = d;
        c.align = 16;
        c.seed = 400 + R;
        // A bad id too: the status of the first (dropless) pass must survive the second.
        c.bad = {{77 * 4 + 1, 999}};
        check(c);
      }
}

TEST(LayoutGpu, RecvOverflowIsReported) {
  EPX_REQUIRE_GPU();
  LCase c;
  c.hot = 3;
  c.mask_p = 1.0;
  c.T = c.max_tokens = 64;
  check(c, /*recv_cap=*/10);
}

// The same handle block, launch after launch with new ids (eager and as graph replays): flags left
// by one launch must never pass for the next one's.
TEST(LayoutGpu, RepeatedLaunchesAndGraphReplaysOnOneBlock) {
  EPX_REQUIRE_GPU();
  LCase c;
  c.T = c.max_tokens = 4096;
  c.E = 256;
  c.K = 8;
  c.R = 2;
  c.local = false;
  cuda::set_layout_kernel(cuda::LayoutKernel::kFused);
  auto d = make_handle(c);
  Tensor gs = fresh_group_status();
  const int64_t cap = recv_capacity_of(c);
  Tensor ids = Tensor::empty({c.T, c.K}, DType::kI32, Device::cuda(0));
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto upload = [&](uint32_t seed) {
    LCase v = c;
    v.seed = seed;
    const Inputs in = make_inputs(v);
    Tensor h = Tensor::empty({c.T, c.K}, DType::kI32);
    for (size_t i = 0; i < in.ids.size(); ++i) h.ptr<int32_t>()[i] = static_cast<int32_t>(in.ids[i]);
    EXPECT_EQ(cudaMemcpyAsync(ids.data(), h.data(), h.nbytes(), cudaMemcpyHostToDevice, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return oracle(v, in, cap);
  };
  auto launch = [&] {
    cuda::prepare_send_side(d->h, ids, TensorRef(), PrepareOptions{}, c.local, c.align, cap, gs.ptr<int32_t>(),
                            Stream{stream});
  };
  for (uint32_t seed = 1; seed <= 3; ++seed) {
    const Expected want = upload(seed);
    launch();
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    SCOPED_TRACE("eager launch " + std::to_string(seed));
    expect_matches(read_back(d->h, c.local, gs), want, c);
  }
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  launch();
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (uint32_t seed = 10; seed < 16; ++seed) {
    const Expected want = upload(seed);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    if (seed % 2) launch();  // an eager launch between replays on the same block
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    SCOPED_TRACE("graph replay with seed " + std::to_string(seed));
    expect_matches(read_back(d->h, c.local, gs), want, c);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace epx
