// The host EP backend (R ranks as threads) against the brute-force oracle: layouts, every byte of
// dispatch, bit-exact combine (the documented fp32 order and roundings), both backwards, capacity
// dropping, and every bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common/ep_oracle.h"
#include "core/ep_state.h"
#include "core/scoped_env.h"
#include "core/window_layout.h"
#include "epx/comm.h"
#include "epx/error.h"
#include "epx/layout.h"
#include "epx/quant.h"

namespace epx {
namespace {

using testing::ExpertMajorLayout;
using testing::RankRouting;

enum class Pattern { kUniform, kSkewed, kOneHotExpert, kAllToRankZero, kRankOneEmpty, kMaskedHeavy };

struct Scenario {
  int ranks = 2;
  int experts = 8;
  int topk = 2;
  int hidden = 24;
  int align = 1;
  int max_tokens = 16;
  std::vector<int> tokens;  // per rank; empty = max_tokens everywhere
  Pattern pattern = Pattern::kUniform;
  DType payload = DType::kBF16;
  DType idx_dtype = DType::kI32;
  float capacity_factor = 0;
  DropPolicy drop = DropPolicy::kByPosition;
  uint32_t seed = 1;
};

std::string describe(const Scenario& s) {
  return detail::concat("R=", s.ranks, " E=", s.experts, " K=", s.topk, " H=", s.hidden, " align=", s.align,
                        " pattern=", static_cast<int>(s.pattern), " payload=", dtype_name(s.payload),
                        " cf=", s.capacity_factor, " seed=", s.seed);
}

// Distinct experts per token drawn with the pattern's weights; some slots masked.
std::vector<int64_t> make_ids(const Scenario& sc, int rank, int T, std::mt19937& rng) {
  const int E = sc.experts, K = sc.topk, Le = E / sc.ranks;
  std::vector<double> weight(E, 1.0);
  switch (sc.pattern) {
    case Pattern::kSkewed:
      for (int e = 0; e < E; ++e) weight[e] = 1.0 / std::pow(e + 1.0, 1.5);
      break;
    case Pattern::kAllToRankZero:
      for (int e = Le; e < E; ++e) weight[e] = 0;
      break;
    case Pattern::kRankOneEmpty:
      if (sc.ranks > 1)
        for (int e = Le; e < 2 * Le; ++e) weight[e] = 0;
      break;
    default: break;
  }
  std::vector<int64_t> ids(static_cast<size_t>(T) * K, -1);
  std::uniform_real_distribution<double> u(0, 1);
  for (int t = 0; t < T; ++t) {
    if (sc.pattern == Pattern::kOneHotExpert) {
      ids[t * K] = E - 1;  // every token of every rank to one expert, other slots masked
      continue;
    }
    std::vector<double> wleft = weight;
    for (int k = 0; k < K; ++k) {
      const double mask_p = sc.pattern == Pattern::kMaskedHeavy ? 0.5 : 0.1;
      if (u(rng) < mask_p) continue;
      const double total = std::accumulate(wleft.begin(), wleft.end(), 0.0);
      if (total <= 0) continue;
      double pick = u(rng) * total;
      int e = 0;
      while (e < E - 1 && (pick -= wleft[e]) > 0) ++e;
      while (wleft[e] == 0) e = (e + 1) % E;  // guard against rounding at the end
      ids[t * K + k] = e;
      wleft[e] = 0;
    }
  }
  (void)rank;
  return ids;
}

Tensor random_rows(int64_t rows, int64_t cols, DType dt, std::mt19937& rng) {
  Tensor t = Tensor::empty({rows, cols}, dt);
  std::normal_distribution<float> n(0, 1);
  for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), dt, i, n(rng));
  return t;
}

// make_ids' uniform routing: R ranks, E experts, K slots a token.
std::vector<int64_t> uniform_ids(int R, int E, int K, int rank, int T, std::mt19937& rng) {
  Scenario sc;
  sc.ranks = R;
  sc.experts = E;
  sc.topk = K;
  return make_ids(sc, rank, T, rng);
}

// ids as the [T, K] int64 tensor prepare takes.
Tensor ids_tensor(const std::vector<int64_t>& ids, int T, int K) {
  Tensor idx = Tensor::empty({T, K}, DType::kI64);
  std::copy(ids.begin(), ids.end(), idx.ptr<int64_t>());
  return idx;
}

// A group of fp32-wide rows, T tokens a rank, experts padded to 16 rows.
GroupConfig padded_fp32_config(int E, int H, int T) {
  GroupConfig cfg;
  cfg.num_experts = E;
  cfg.hidden = H;
  cfg.max_tokens_per_rank = T;
  cfg.max_dtype = DType::kF32;
  cfg.align = 16;
  return cfg;
}

Tensor random_vec(int64_t n, std::mt19937& rng) {
  Tensor t = Tensor::empty({n}, DType::kF32);
  std::uniform_real_distribution<float> u(0.1f, 1.0f);
  for (int64_t i = 0; i < n; ++i) t.ptr<float>()[i] = u(rng);
  return t;
}

float f(const Tensor& t, int64_t i) { return static_cast<float>(load_as_double(t.data(), t.dtype(), i)); }

bool same_bytes(const Tensor& a, int64_t row_a, const Tensor& b, int64_t row_b, int64_t H) {
  const size_t rb = H * dtype_size(a.dtype());
  return std::memcmp(static_cast<const char*>(a.data()) + row_a * rb, static_cast<const char*>(b.data()) + row_b * rb,
                     rb) == 0;
}

struct RankIO {
  int T = 0;
  std::vector<int64_t> ids;
  Tensor idx, w, x;                       // inputs
  Tensor y, d_out, d_recv, d_recv_w;      // later-stage inputs
  Tensor recv_x, recv_w, out, d_y, d_row_w, d_x, d_topk_w;  // outputs
  std::vector<int32_t> routed, offsets;
};

void run_scenario(const Scenario& sc) {
  SCOPED_TRACE(describe(sc));
  const int R = sc.ranks, E = sc.experts, K = sc.topk, H = sc.hidden, Le = E / R;
  GroupConfig cfg;
  cfg.num_experts = E;
  cfg.hidden = H;
  cfg.max_tokens_per_rank = sc.max_tokens;
  cfg.max_topk = std::max(K, 4);
  cfg.max_dtype = DType::kF32;
  cfg.align = sc.align;
  cfg.timeout_s = 20;
  std::vector<Group> groups = Group::create_simulated(R, cfg);
  const int64_t cap = groups[0].recv_capacity_rows();

  std::vector<RankIO> io(R);
  for (int r = 0; r < R; ++r) {
    std::mt19937 rng(sc.seed * 7919 + r);
    RankIO& d = io[r];
    d.T = sc.tokens.empty() ? sc.max_tokens : sc.tokens[r];
    d.ids = make_ids(sc, r, d.T, rng);
    d.idx = Tensor::empty({d.T, K}, sc.idx_dtype);
    for (int64_t i = 0; i < d.T * K; ++i) store_from_double(d.idx.data(), sc.idx_dtype, i, static_cast<double>(d.ids[i]));
    d.w = random_vec(static_cast<int64_t>(d.T) * K, rng);
    d.x = random_rows(d.T, H, sc.payload, rng);
    d.y = random_rows(cap, H, sc.payload, rng);
    d.d_out = random_rows(d.T, H, sc.payload, rng);
    d.d_recv = random_rows(cap, H, sc.payload, rng);
    d.d_recv_w = random_vec(cap, rng);
    d.recv_x = Tensor::full({cap, H}, sc.payload, 777.0);  // poison: every row in use must be written
    d.recv_w = Tensor::full({cap}, DType::kF32, 777.0);
    d.out = Tensor::full({d.T, H}, sc.payload, 777.0);
    d.d_y = Tensor::full({cap, H}, sc.payload, 777.0);
    d.d_row_w = Tensor::full({cap}, DType::kF32, 777.0);
    d.d_x = Tensor::full({d.T, H}, sc.payload, 777.0);
    d.d_topk_w = Tensor::full({d.T, K}, DType::kF32, 777.0);
  }

  run_ranks(groups, [&](Group& g) {
    RankIO& d = io[g.rank()];
    const TensorRef w2 = d.w.ref().view({d.T, K});
    PrepareOptions opt;
    opt.capacity_factor = sc.capacity_factor;
    opt.drop_policy = sc.drop;
    Handle h = prepare(g, d.idx, w2, opt);
    dispatch_forward(g, h, d.x, w2, d.recv_x, d.recv_w);
    combine_forward(g, h, d.y, d.recv_w, d.out);
    combine_backward(g, h, d.d_out, d.y, d.recv_w, d.d_y, d.d_row_w);
    dispatch_backward(g, h, d.d_recv, d.d_recv_w, d.d_x, d.d_topk_w);
    const Tensor& routed = h.state().routed_experts;
    d.routed.assign(routed.ptr<int32_t>(), routed.ptr<int32_t>() + routed.numel());
    d.offsets = h.expert_offsets_host();
  });

  // 1. kept routing
  std::vector<RankRouting> routing(R);
  for (int r = 0; r < R; ++r) {
    const int cap_e = sc.capacity_factor > 0 ? static_cast<int>(std::ceil(double(sc.capacity_factor) * io[r].T * K / E)) : 0;
    std::vector<float> w(io[r].w.ptr<float>(), io[r].w.ptr<float>() + io[r].w.numel());
    std::vector<int32_t> kept = testing::oracle_keep(io[r].ids, w, io[r].T, K, E, cap_e, sc.drop);
    ASSERT_EQ(io[r].routed, kept) << "rank " << r << ": kept routing differs from the oracle";
    routing[r] = RankRouting{io[r].T, K, kept};
  }

  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE(detail::concat("receiving rank ", r));
    const ExpertMajorLayout L = testing::oracle_layout(routing, E, r, sc.align);
    // 2. offsets
    ASSERT_EQ(io[r].offsets.size(), L.offsets.size());
    for (int j = 0; j <= Le; ++j) ASSERT_EQ(io[r].offsets[j], L.offsets[j]) << "expert_offsets[" << j << "]";
    // 3. dispatch: every row in use holds its token, padding rows are zero, weights travel exactly
    for (int64_t row = 0; row < L.offsets[Le]; ++row) {
      const int s = L.src_rank[row], t = L.src_token[row], k = L.src_slot[row];
      if (s < 0) {
        for (int i = 0; i < H; ++i) ASSERT_EQ(f(io[r].recv_x, row * H + i), 0.0f) << "padding row " << row;
        ASSERT_EQ(io[r].recv_w.ptr<float>()[row], 0.0f) << "padding weight " << row;
        ASSERT_EQ(f(io[r].d_y, row * H), 0.0f) << "d_y padding row " << row;
        ASSERT_EQ(io[r].d_row_w.ptr<float>()[row], 0.0f) << "d_row_weights padding row " << row;
        continue;
      }
      ASSERT_TRUE(same_bytes(io[r].recv_x, row, io[s].x, t, H)) << "row " << row << " should hold rank " << s
                                                                   << " token " << t;
      ASSERT_EQ(io[r].recv_w.ptr<float>()[row], io[s].w.ptr<float>()[t * K + k]) << "row weight " << row;
      // combine_backward of this row, by definition
      const float wr = io[s].w.ptr<float>()[t * K + k];
      float dot = 0;
      for (int i = 0; i < H; ++i) {
        const float g = f(io[s].d_out, int64_t(t) * H + i);
        const float expect = static_cast<float>(round_to_dtype(wr * g, sc.payload));
        ASSERT_EQ(f(io[r].d_y, row * H + i), expect) << "d_y row " << row << " col " << i;
        dot = std::fma(g, f(io[r].y, row * H + i), dot);
      }
      ASSERT_EQ(io[r].d_row_w.ptr<float>()[row], dot) << "d_row_weights row " << row;
    }
  }

  // 4. combine and dispatch_backward at every source, in the documented order of roundings
  std::vector<ExpertMajorLayout> layouts;
  for (int r = 0; r < R; ++r) layouts.push_back(testing::oracle_layout(routing, E, r, sc.align));
  for (int s = 0; s < R; ++s)
    for (int t = 0; t < io[s].T; ++t) {
      for (int i = 0; i < H; ++i) {
        float out = 0, dx = 0;
        for (int r = 0; r < R; ++r) {
          float part = 0, dpart = 0;
          bool any = false;
          for (int k = 0; k < K; ++k) {
            const int e = routing[s].routed[t * K + k];
            if (e < 0 || e / Le != r) continue;
            const int64_t row = testing::oracle_row(layouts[r], s, t, k);
            part = std::fma(io[s].w.ptr<float>()[t * K + k], f(io[r].y, row * H + i), part);
            dpart += f(io[r].d_recv, row * H + i);
            any = true;
          }
          if (!any) continue;
          out += static_cast<float>(round_to_dtype(part, sc.payload));
          dx += static_cast<float>(round_to_dtype(dpart, sc.payload));
        }
        ASSERT_EQ(f(io[s].out, int64_t(t) * H + i), static_cast<float>(round_to_dtype(out, sc.payload)))
            << "combine out rank " << s << " token " << t << " col " << i;
        ASSERT_EQ(f(io[s].d_x, int64_t(t) * H + i), static_cast<float>(round_to_dtype(dx, sc.payload)))
            << "dispatch_backward d_x rank " << s << " token " << t << " col " << i;
      }
      for (int k = 0; k < K; ++k) {
        const int e = routing[s].routed[t * K + k];
        const float expect = e < 0 ? 0.0f : io[e / Le].d_recv_w.ptr<float>()[testing::oracle_row(layouts[e / Le], s, t, k)];
        ASSERT_EQ(io[s].d_topk_w.ptr<float>()[t * K + k], expect) << "d_topk_weights rank " << s << " [" << t << ", " << k << "]";
      }
    }
}


// A case small enough to work out by hand (values in the comments), 2 ranks, 4 experts, align 2.
//   rank 0: token 0 -> experts {1, 2} w {0.5, 0.25}, x = 10;  token 1 -> {3, masked} w {1, 0}, x = 20
//   rank 1: token 0 -> experts {2, 0} w {0.75, 0.5}, x = 30
// rank 0 holds experts 0, 1: [30 (r1 t0), pad | 10 (r0 t0), pad]        offsets {0, 2, 4}
// rank 1 holds experts 2, 3: [10 (r0 t0), 30 (r1 t0) | 20 (r0 t1), pad]  offsets {0, 2, 4}
// experts double their input: out r0 = {0.5*20 + 0.25*20, 1*40} = {15, 40}; out r1 = {0.75*60 + 0.5*60} = {75}
TEST(EpHost, HandComputedTwoRanks) {
  GroupConfig cfg;
  cfg.num_experts = 4;
  cfg.hidden = 1;
  cfg.max_tokens_per_rank = 2;
  cfg.max_topk = 2;
  cfg.max_dtype = DType::kF32;
  cfg.align = 2;
  auto groups = Group::create_simulated(2, cfg);
  const std::vector<std::vector<int32_t>> ids = {{1, 2, 3, -1}, {2, 0}};
  const std::vector<std::vector<float>> w = {{0.5f, 0.25f, 1.0f, 0.0f}, {0.75f, 0.5f}}, x = {{10, 20}, {30}};
  const std::vector<std::vector<float>> want_recv = {{30, 0, 10, 0}, {10, 30, 20, 0}};
  const std::vector<std::vector<float>> want_w = {{0.5f, 0, 0.5f, 0}, {0.25f, 0.75f, 1.0f, 0}};
  const std::vector<std::vector<float>> want_out = {{15, 40}, {75}};
  run_ranks(groups, [&](Group& g) {
    const int r = g.rank(), T = static_cast<int>(x[r].size());
    Tensor idx = Tensor::empty({T, 2}, DType::kI32), tw = Tensor::empty({T, 2}, DType::kF32), xt = Tensor::empty({T, 1}, DType::kF32);
    std::copy(ids[r].begin(), ids[r].end(), idx.ptr<int32_t>());
    std::copy(w[r].begin(), w[r].end(), tw.ptr<float>());
    std::copy(x[r].begin(), x[r].end(), xt.ptr<float>());
    const int64_t cap = g.recv_capacity_rows();
    Tensor recv = Tensor::full({cap, 1}, DType::kF32, -1), rw = Tensor::full({cap}, DType::kF32, -1);
    Handle h = prepare(g, idx, tw);
    EXPECT_EQ(h.expert_offsets_host(), (std::vector<int32_t>{0, 2, 4})) << "rank " << r;
    dispatch_forward(g, h, xt, tw, recv, rw);
    Tensor y = Tensor::zeros({cap, 1}, DType::kF32), out = Tensor::zeros({T, 1}, DType::kF32);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(recv.ptr<float>()[i], want_recv[r][i]) << "rank " << r << " row " << i;
      EXPECT_EQ(rw.ptr<float>()[i], want_w[r][i]) << "rank " << r << " weight " << i;
      y.ptr<float>()[i] = 2 * recv.ptr<float>()[i];
    }
    combine_forward(g, h, y, rw, out);
    for (int t = 0; t < T; ++t) EXPECT_EQ(out.ptr<float>()[t], want_out[r][t]) << "rank " << r << " token " << t;
  });
}

TEST(EpHost, UniformAcrossGroupSizes) {
  for (int R : {1, 2, 3, 4, 8}) {
    Scenario sc;
    sc.ranks = R;
    sc.experts = 2 * R * 2;
    sc.topk = 3;
    sc.seed = 10 + R;
    run_scenario(sc);
  }
}

TEST(EpHost, AdversarialRouting) {
  for (Pattern p : {Pattern::kSkewed, Pattern::kOneHotExpert, Pattern::kAllToRankZero, Pattern::kRankOneEmpty,
                    Pattern::kMaskedHeavy}) {
    Scenario sc;
    sc.ranks = 4;
    sc.experts = 16;
    sc.topk = 4;
    sc.pattern = p;
    sc.seed = 100 + static_cast<int>(p);
    run_scenario(sc);
  }
}

TEST(EpHost, AlignmentPadsWithZeroRows) {
  for (int align : {1, 16, 32, 128}) {
    Scenario sc;
    sc.ranks = 2;
    sc.experts = 6;
    sc.align = align;
    sc.seed = 200 + align;
    run_scenario(sc);
  }
}

TEST(EpHost, PayloadAndIdDtypes) {
  for (DType p : {DType::kBF16, DType::kF16, DType::kF32})
    for (DType i : {DType::kI32, DType::kI64}) {
      Scenario sc;
      sc.payload = p;
      sc.idx_dtype = i;
      sc.ranks = 3;
      sc.experts = 9;
      sc.seed = 300 + static_cast<int>(p) * 3 + static_cast<int>(i);
      run_scenario(sc);
    }
}

TEST(EpHost, ZeroTokensOnSomeRanksAndMaxTokens) {
  Scenario sc;
  sc.ranks = 4;
  sc.experts = 8;
  sc.max_tokens = 12;
  sc.tokens = {0, 12, 5, 0};
  run_scenario(sc);
  sc.tokens = {0, 0, 0, 0};
  run_scenario(sc);
}

TEST(EpHost, CapacityDropping) {
  for (DropPolicy pol : {DropPolicy::kByPosition, DropPolicy::kByProbability})
    for (float cf : {0.5f, 1.0f, 1.25f}) {
      Scenario sc;
      sc.ranks = 2;
      sc.experts = 8;
      sc.topk = 2;
      sc.pattern = Pattern::kSkewed;
      sc.capacity_factor = cf;
      sc.drop = pol;
      sc.seed = 400 + static_cast<int>(cf * 8);
      run_scenario(sc);
    }
}

TEST(EpHost, RoundTripGivesTokenTimesWeightSum) {
  // dispatch -> identity expert -> weighted combine == x * (sum of kept weights), up to fp32 rounding.
  const int R = 4, E = 8, K = 3, H = 16, T = 10;
  std::vector<Group> groups = Group::create_simulated(R, padded_fp32_config(E, H, T));
  std::atomic<int> checked{0};
  run_ranks(groups, [&](Group& g) {
    std::mt19937 rng(g.rank() + 5);
    const std::vector<int64_t> ids = uniform_ids(R, E, K, g.rank(), T, rng);
    Tensor idx = ids_tensor(ids, T, K);
    Tensor w = random_vec(T * K, rng), x = random_rows(T, H, DType::kF32, rng);
    const int64_t cap = g.recv_capacity_rows();
    Tensor recv = Tensor::zeros({cap, H}, DType::kF32), rw = Tensor::zeros({cap}, DType::kF32);
    Tensor out = Tensor::zeros({T, H}, DType::kF32);
    Handle h = prepare(g, idx, w.ref().view({T, K}));
    dispatch_forward(g, h, x, w.ref().view({T, K}), recv, rw);
    combine_forward(g, h, recv, rw, out);
    for (int t = 0; t < T; ++t) {
      double wsum = 0;
      for (int k = 0; k < K; ++k) wsum += ids[t * K + k] >= 0 ? w.ptr<float>()[t * K + k] : 0.0;
      for (int i = 0; i < H; ++i) {
        const double expect = wsum * x.ptr<float>()[t * H + i];
        EXPECT_NEAR(out.ptr<float>()[t * H + i], expect, 1e-5 * (1 + std::fabs(expect)));
        ++checked;
      }
    }
  });
  EXPECT_EQ(checked.load(), R * T * H);
}

TEST(EpHost, UnweightedCombineBackwardIsTheDispatchOfDout) {
  // combine_backward without row weights copies d_out[t] to each of the token's expert rows (zero
  // padding), which is what dispatch does with x: the zero-copy transport runs it as a dispatch, so
  // the reference must give the same bits both ways. Masked slots, dropping by capacity, align 16.
  const int R = 3, E = 9, K = 3, H = 24, T = 12;
  std::vector<Group> groups = Group::create_simulated(R, padded_fp32_config(E, H, T));
  std::atomic<int> rows_compared{0};
  run_ranks(groups, [&](Group& g) {
    std::mt19937 rng(g.rank() + 11);
    std::vector<int64_t> ids = uniform_ids(R, E, K, g.rank(), T, rng);
    ids[0] = -1;  // a masked slot
    Tensor idx = ids_tensor(ids, T, K);
    Tensor w = random_vec(T * K, rng), d_out = random_rows(T, H, DType::kBF16, rng);
    const int64_t cap = g.recv_capacity_rows();
    for (float capacity : {0.0f, 0.7f}) {
      PrepareOptions opt;
      opt.capacity_factor = capacity;
      Handle h = prepare(g, idx, w.ref().view({T, K}), opt);
      Tensor via_dispatch = Tensor::full({cap, H}, DType::kBF16, 5.0), d_y = Tensor::full({cap, H}, DType::kBF16, 6.0);
      dispatch_forward(g, h, d_out, TensorRef(), via_dispatch, TensorRef());
      combine_backward(g, h, d_out, TensorRef(), TensorRef(), d_y, TensorRef());
      const int64_t used = h.expert_offsets_host().back();
      ASSERT_GT(used, 0);
      EXPECT_EQ(std::memcmp(via_dispatch.data(), d_y.data(), static_cast<size_t>(used * H) * sizeof(uint16_t)), 0)
          << "capacity " << capacity;
      rows_compared += static_cast<int>(used);
    }
  });
  EXPECT_GT(rows_compared.load(), 0);
}

// ---- bad input ---------------------------------------------------------------------------------

GroupConfig small_config() {
  GroupConfig cfg;
  cfg.num_experts = 4;
  cfg.hidden = 8;
  cfg.max_tokens_per_rank = 6;
  cfg.max_topk = 2;
  cfg.timeout_s = 5;
  return cfg;
}

template <class Fn>
std::string error_of(Fn&& fn, Status expected_status = Status::kInvalidArgument) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), expected_status) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected an epx::Error";
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(EpHostErrors, GroupConfig) {
  GroupConfig c = small_config();
  c.num_experts = 5;
  EXPECT_TRUE(has(error_of([&] { Group::create_simulated(2, c); }), "num_experts is 5, expected a multiple of the group size 2"));
  c = small_config();
  c.align = 24;
  EXPECT_TRUE(has(error_of([&] { Group::create_simulated(1, c); }), "config.align is 24"));
  c = small_config();
  c.max_dtype = DType::kI32;
  EXPECT_TRUE(has(error_of([&] { Group::create_simulated(1, c); }), "config.max_dtype is int32"));
  for (double bad : {-1.0, 1e6, HUGE_VAL, std::nan("")}) {
    c = small_config();
    c.timeout_s = bad;
    EXPECT_TRUE(has(error_of([&] { Group::create_simulated(2, c); }), "config.timeout_s is ")) << bad;
  }
}

// registered_bytes_per_rank against what Group::registered_bytes() returned on GPUs for the same
// configs (bench_ep's: max_tokens_per_rank = T, max_topk = K, bf16 rows; 2 and 4 x H200, the
// `registered_bytes` field of bench/results/2026-11-26_*_ep_*.jsonl), plus, for zero-copy, the second
// copy of the header region (ranks x (local experts + 2) int32) added on 2026-11-27.
TEST(EpHost, RegisteredBytesPerRankAreWhatGroupsRegister) {
  struct Known {
    int ranks, tokens;
    int64_t hidden;
    int experts;
    Transport transport;
    size_t bytes;
  };
  const Known known[] = {
      {2, 4096, 7168, 256, Transport::kZeroCopy, 118626048 + 1040},
      {2, 128, 7168, 256, Transport::kZeroCopy, 3835648 + 1040},
      {2, 4096, 4096, 64, Transport::kZeroCopy, 68293632 + 272},
      {4, 4096, 7168, 256, Transport::kZeroCopy, 237250304 + 1056},
      {2, 4096, 7168, 256, Transport::kStaged, 236980736},   {4, 4096, 7168, 256, Transport::kStaged, 473958912},
  };
  for (const Known& k : known) {
    GroupConfig c;
    c.num_experts = k.experts;
    c.hidden = k.hidden;
    c.max_tokens_per_rank = k.tokens;
    c.max_topk = 8;
    EXPECT_EQ(registered_bytes_per_rank(c, k.ranks, k.transport), k.bytes)
        << k.ranks << " ranks, T=" << k.tokens << ", H=" << k.hidden << ", " << transport_name(k.transport);
  }
  GroupConfig c = small_config();
  EXPECT_TRUE(has(error_of([&] { registered_bytes_per_rank(c, 2, Transport::kAuto); }), "transport is auto"));
  EXPECT_TRUE(has(error_of([&] { registered_bytes_per_rank(c, 0, Transport::kStaged); }), "num_ranks is 0"));
}

// The two header copies of a zero-copy window (prepares alternate between them): each holds every
// source's region, neither overlaps the other, the meta region or the signal area, and the second
// ends the window.
TEST(EpHost, HeaderCopiesAreDisjointAndInsideTheWindow) {
  for (int ranks : {1, 2, 4, 8}) {
    GroupConfig c;
    c.num_experts = 256;
    c.hidden = 7168;
    c.max_tokens_per_rank = 4096;
    c.max_topk = 8;
    const WindowLayout L = WindowLayout::make(c, ranks);
    const size_t region = L.header_region_bytes();
    EXPECT_EQ(region, static_cast<size_t>(ranks) * (256 / ranks + 2) * sizeof(int32_t));
    EXPECT_EQ(L.header_offset(ranks - 1, 0) + L.header_ints * sizeof(int32_t), L.header + region);
    EXPECT_LE(L.header + region, L.meta) << ranks << " ranks";
    const size_t signal_end = L.total + signal_area_bytes(ranks, c.max_tokens_per_rank);
    EXPECT_GE(L.header_offset(0, 1), signal_end) << ranks << " ranks";
    EXPECT_EQ(L.header_offset(0, 1) % 256, 0u);
    EXPECT_EQ(L.header_offset(ranks - 1, 1) + L.header_ints * sizeof(int32_t), L.window_bytes()) << ranks << " ranks";
  }
}

// Prepares alternate between two header copies with no barrier before their writes: consecutive
// prepares of one group, a different routing each time and every rank pausing a random while before
// each, must each give every rank the layout of that iteration's routing (a rank reading a copy that a
// faster peer had already overwritten with the next iteration's counts would get the wrong offsets).
TEST(EpHost, ConsecutivePreparesOfDriftingRanksSeeTheirOwnCounts) {
  constexpr int R = 3, E = 12, K = 3, T = 24, kIterations = 12;
  GroupConfig cfg;
  cfg.num_experts = E;
  cfg.hidden = 4;
  cfg.max_tokens_per_rank = T;
  cfg.max_topk = K;
  cfg.max_dtype = DType::kF32;
  auto groups = Group::create_simulated(R, cfg);
  // Rank r's routing at iteration i, drawn the same way wherever it is needed: distinct experts per
  // token, some slots masked, the number of tokens varying too.
  auto routing_of = [&](int r, int i) {
    std::mt19937 rng(static_cast<uint32_t>(1000 * i + r));
    testing::RankRouting rr;
    rr.num_tokens = 1 + static_cast<int>(rng() % T);
    rr.topk = K;
    std::vector<int32_t> experts(E);
    std::iota(experts.begin(), experts.end(), 0);
    for (int t = 0; t < rr.num_tokens; ++t) {
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int k = 0; k < K; ++k) rr.routed.push_back(rng() % 5 == 0 ? -1 : experts[k]);
    }
    return rr;
  };
  std::vector<std::vector<std::vector<int32_t>>> seen(R, std::vector<std::vector<int32_t>>(kIterations));
  run_ranks(groups, [&](Group& g) {
    std::mt19937 pause(static_cast<uint32_t>(77 + g.rank()));
    for (int i = 0; i < kIterations; ++i) {
      const testing::RankRouting rr = routing_of(g.rank(), i);
      Tensor idx = Tensor::empty({rr.num_tokens, K}, DType::kI32), w = Tensor::full({rr.num_tokens, K}, DType::kF32, 1);
      std::copy(rr.routed.begin(), rr.routed.end(), idx.ptr<int32_t>());
      std::this_thread::sleep_for(std::chrono::microseconds(pause() % 300));
      Handle h = prepare(g, idx, w);
      seen[g.rank()][i] = h.expert_offsets_host();
    }
  });
  for (int i = 0; i < kIterations; ++i) {
    std::vector<testing::RankRouting> all;
    for (int r = 0; r < R; ++r) all.push_back(routing_of(r, i));
    for (int r = 0; r < R; ++r) {
      const testing::ExpertMajorLayout L = testing::oracle_layout(all, E, r, cfg.align);
      ASSERT_EQ(seen[r][i], std::vector<int32_t>(L.offsets.begin(), L.offsets.end()))
          << "rank " << r << ", prepare " << i;
    }
  }
}

// The launcher's variables: one that is set but not a whole number is an error naming it (read as
// 0 it would make this process a second rank 0). Checked before any device or NCCL call, so it
// runs without a GPU; a build without the CUDA backend has no create_from_env (skipped).
TEST(EpHostErrors, LauncherVariablesMustBeWholeNumbers) {
  const GroupConfig c = small_config();
  for (const auto& [rank, world, named] :
       {std::tuple<const char*, const char*, const char*>{"abc", "2", "RANK is \"abc\""}, {"1x", "2", "RANK is \"1x\""},
        {"1", "2.0", "WORLD_SIZE is \"2.0\""}, {"1", "99999999999", "WORLD_SIZE is \"99999999999\""}}) {
    const detail::ScopedEnv r("RANK", rank), w("WORLD_SIZE", world);
    try {
      Group::create_from_env(c);
      ADD_FAILURE() << "RANK=" << rank << " WORLD_SIZE=" << world << " was accepted";
    } catch (const Error& e) {
      if (e.status() == Status::kNotSupported) GTEST_SKIP() << e.what();
      EXPECT_EQ(e.status(), Status::kInvalidArgument) << e.what();
      EXPECT_TRUE(has(e.what(), named)) << e.what();
      EXPECT_TRUE(has(e.what(), "expected a whole number")) << e.what();
    }
  }
}

// EPX_TIMEOUT_S (read where config.timeout_s is 0): a number of seconds in (0, 86400], else an error
// at group creation naming the variable; a timeout in the config wins over it.
TEST(EpHostErrors, TimeoutFromTheEnvironment) {
  GroupConfig c = small_config();
  c.timeout_s = 0;
  {
    const detail::ScopedEnv v("EPX_TIMEOUT_S", "2.5");
    EXPECT_EQ(resolved_timeout_s(c), 2.5);
    c.timeout_s = 7;
    EXPECT_EQ(resolved_timeout_s(c), 7.0);
    c.timeout_s = 0;
  }
  {
    const detail::ScopedEnv v("EPX_TIMEOUT_S", nullptr);
    EXPECT_EQ(resolved_timeout_s(c), 10.0);
  }
  for (const char* bad : {"abc", "0", "-2", "5s", "inf", "nan", "1e300"}) {
    const detail::ScopedEnv v("EPX_TIMEOUT_S", bad);
    const std::string e = error_of([&] { Group::create_simulated(2, c); });
    EXPECT_TRUE(has(e, std::string("EPX_TIMEOUT_S is \"") + bad + "\", expected a positive number")) << e;
  }
}

TEST(EpHostErrors, IdsOutOfRangeAndRepeated) {
  auto groups = Group::create_simulated(1, small_config());
  Tensor idx = Tensor::zeros({2, 2}, DType::kI32);
  idx.ptr<int32_t>()[0] = 1;
  idx.ptr<int32_t>()[1] = 4;  // E = 4
  EXPECT_TRUE(has(error_of([&] { prepare(groups[0], idx, {}); }),
                  "epx::prepare: topk_idx[0, 1] is 4, expected -1 (masked) or an expert id in [0, 4)"));
  idx.ptr<int32_t>()[1] = -2;
  EXPECT_TRUE(has(error_of([&] { prepare(groups[0], idx, {}); }), "topk_idx[0, 1] is -2"));
  idx.ptr<int32_t>()[1] = 1;
  EXPECT_TRUE(has(error_of([&] { prepare(groups[0], idx, {}); }), "topk_idx row 0 names expert 1 twice"));
}

TEST(EpHostErrors, BadIdsOnOneRankDoNotHangTheOthers) {
  auto groups = Group::create_simulated(2, small_config());
  std::atomic<int> ok{0};
  std::string msg = error_of([&] {
    run_ranks(groups, [&](Group& g) {
      Tensor idx = Tensor::zeros({2, 2}, DType::kI32);
      idx.ptr<int32_t>()[1] = g.rank() == 1 ? 9 : 1;
      idx.ptr<int32_t>()[3] = 1;
      Handle h = prepare(g, idx, {});
      ++ok;
    });
  });
  EXPECT_TRUE(has(msg, "rank 1: epx::prepare: topk_idx[0, 1] is 9")) << msg;
  EXPECT_EQ(ok.load(), 1) << "rank 0 must complete its prepare";
}

TEST(EpHostErrors, ShapeMismatches) {
  auto groups = Group::create_simulated(1, small_config());
  Group& g = groups[0];
  Tensor idx = Tensor::zeros({4, 2}, DType::kI32);
  idx.ptr<int32_t>()[1] = 1;
  idx.ptr<int32_t>()[3] = 1;
  idx.ptr<int32_t>()[5] = 1;
  idx.ptr<int32_t>()[7] = 1;
  Tensor w_bad = Tensor::zeros({3, 2}, DType::kF32);
  EXPECT_TRUE(has(error_of([&] { prepare(g, idx, w_bad); }), "topk_weights has shape [3, 2], expected [4, 2]"));
  Tensor idx_f = Tensor::zeros({4, 2}, DType::kF32);
  EXPECT_TRUE(has(error_of([&] { prepare(g, idx_f, {}); }), "topk_idx has dtype fp32, expected int32 or int64"));
  Tensor idx_big = Tensor::zeros({7, 2}, DType::kI32);
  EXPECT_TRUE(has(error_of([&] { prepare(g, idx_big, {}); }, Status::kCapacityExceeded),
                  "topk_idx has 7 rows (tokens), the group was sized for max_tokens_per_rank = 6"));
  Tensor idx_k = Tensor::zeros({4, 3}, DType::kI32);
  EXPECT_TRUE(has(error_of([&] { prepare(g, idx_k, {}); }), "topk_idx has 3 columns (top-k), expected 1..2"));
  PrepareOptions byprob;
  byprob.capacity_factor = 1;
  byprob.drop_policy = DropPolicy::kByProbability;
  EXPECT_TRUE(has(error_of([&] { prepare(g, idx, {}, byprob); }), "topk_weights is missing"));

  Handle h = prepare(g, idx, {});
  const int64_t cap = g.recv_capacity_rows();
  Tensor x_rows = Tensor::zeros({5, 8}, DType::kBF16), recv = Tensor::zeros({cap, 8}, DType::kBF16);
  EXPECT_TRUE(has(error_of([&] { dispatch_forward(g, h, x_rows, {}, recv, {}); }), "x has shape [5, 8], expected [4, 8]"));
  Tensor x = Tensor::zeros({4, 8}, DType::kBF16), w = Tensor::zeros({4, 2}, DType::kF32);
  Tensor w_rows = Tensor::zeros({5, 2}, DType::kF32);
  EXPECT_TRUE(has(error_of([&] { dispatch_forward(g, h, x, w_rows, recv, {}); }),
                  "topk_weights has shape [5, 2], expected [4, 2]"));
  Tensor recv_small = Tensor::zeros({cap - 1, 8}, DType::kBF16);
  EXPECT_TRUE(has(error_of([&] { dispatch_forward(g, h, x, w, recv_small, {}); }),
                  "recv_x has " + std::to_string(cap - 1) + " rows, expected at least " + std::to_string(cap)));
  Tensor x32 = Tensor::zeros({4, 8}, DType::kF32), recv32 = Tensor::zeros({cap, 8}, DType::kF32);
  EXPECT_TRUE(has(error_of([&] { dispatch_forward(g, h, x32, w, recv32, {}); }),
                  "x has dtype fp32 (4 bytes), wider than the group's max_dtype bf16 (2 bytes)"));
  Tensor out = Tensor::zeros({4, 8}, DType::kBF16);
  EXPECT_TRUE(has(error_of([&] { combine_forward(g, h, recv, {}, out); }), "has not been dispatched yet"));
}

TEST(EpHostErrors, HandleIsSingleUseAndBoundToItsGroup) {
  auto a = Group::create_simulated(1, small_config());
  auto b = Group::create_simulated(1, small_config());
  Tensor idx = Tensor::zeros({2, 1}, DType::kI32);
  Handle h = prepare(a[0], idx, {});
  const int64_t cap = a[0].recv_capacity_rows();
  Tensor x = Tensor::zeros({2, 8}, DType::kBF16), recv = Tensor::zeros({cap, 8}, DType::kBF16);
  EXPECT_TRUE(has(error_of([&] { dispatch_forward(b[0], h, x, {}, recv, {}); }), "prepared on another group"));
  dispatch_forward(a[0], h, x, {}, recv, {});
  EXPECT_TRUE(has(error_of([&] { dispatch_forward(a[0], h, x, {}, recv, {}); }), "already dispatched"));
  Handle empty;
  EXPECT_TRUE(has(error_of([&] { dispatch_forward(a[0], empty, x, {}, recv, {}); }), "used before prepare()"));
}

TEST(EpHostErrors, RecvCapacityOverflowIsReportedAndNothingWritten) {
  GroupConfig c = small_config();
  c.recv_capacity_rows = 5;
  auto groups = Group::create_simulated(2, c);
  std::vector<std::string> msgs(2);
  std::vector<Tensor> recv(2);
  try {
    run_ranks(groups, [&](Group& g) {
      Tensor idx = Tensor::zeros({6, 2}, DType::kI32);
      for (int t = 0; t < 6; ++t) idx.ptr<int32_t>()[t * 2 + 1] = 1;  // every token to experts 0 and 1 (rank 0)
      Handle h = prepare(g, idx, {});
      Tensor x = Tensor::full({6, 8}, DType::kBF16, 1.0);
      recv[g.rank()] = Tensor::full({5, 8}, DType::kBF16, 3.0);
      dispatch_forward(g, h, x, {}, recv[g.rank()], {});
    });
    FAIL() << "expected an overflow error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kCapacityExceeded);
    EXPECT_TRUE(has(e.what(), "rank 0: epx::dispatch_forward: rank 0 would receive 24 expert-major rows, more than "
                              "the group's recv capacity of 5")) << e.what();
  }
  for (int i = 0; i < 40; ++i) EXPECT_EQ(load_as_double(recv[0].data(), DType::kBF16, i), 3.0) << "overflowing rank wrote";
}

// PrepareOptions::recv_capacity_rows: a handle whose buffers hold fewer rows than the group's takes
// smaller recv_x / y (the same rows as with the group's capacity), refuses a capacity above the
// group's, and reports an overflow of its own capacity with that capacity, writing nothing.
TEST(EpHost, HandleRecvCapacityBelowTheGroups) {
  GroupConfig c = small_config();
  c.max_dtype = DType::kF32;
  auto groups = Group::create_simulated(2, c);
  const int64_t group_cap = groups[0].recv_capacity_rows();
  std::vector<std::string> msgs(2);
  std::vector<Tensor> small_out(2), full_out(2), recv(2);
  run_ranks(groups, [&](Group& g) {
    const int r = g.rank();
    Tensor idx = Tensor::empty({3, 2}, DType::kI32);
    for (int t = 0; t < 3; ++t) {  // token t to experts t % 4 and (t + 1 + r) % 4
      idx.ptr<int32_t>()[t * 2] = t % 4;
      idx.ptr<int32_t>()[t * 2 + 1] = (t + 1 + r) % 4;
    }
    Tensor x = Tensor::empty({3, 8}, DType::kF32);
    for (int64_t i = 0; i < x.numel(); ++i) x.ptr<float>()[i] = static_cast<float>(100 * r + i);
    for (int64_t cap : {int64_t{0}, int64_t{6}}) {
      PrepareOptions po;
      po.recv_capacity_rows = cap;
      Handle h = prepare(g, idx, {}, po);
      EXPECT_EQ(h.recv_capacity_rows(), cap ? cap : group_cap);
      const int64_t rows = h.recv_capacity_rows();
      Tensor rx = Tensor::zeros({rows, 8}, DType::kF32), out = Tensor::zeros({3, 8}, DType::kF32);
      if (cap) {
        const Tensor short_recv = Tensor::zeros({rows - 1, 8}, DType::kF32);
        const std::string e = error_of([&] { dispatch_forward(g, h, x, {}, short_recv, {}); });
        EXPECT_TRUE(has(e, "recv_x")) << e;
      }
      dispatch_forward(g, h, x, {}, rx, {});
      combine_forward(g, h, rx, {}, out);
      (cap ? small_out : full_out)[r] = out;
    }
    PrepareOptions too_big;
    too_big.recv_capacity_rows = group_cap + 1;
    EXPECT_TRUE(has(error_of([&] { prepare(g, idx, {}, too_big); }),
                    "options.recv_capacity_rows is " + std::to_string(group_cap + 1) + ", expected 0 (the group's) .. "
                    "the group's " + std::to_string(group_cap)));
    PrepareOptions tiny;
    tiny.recv_capacity_rows = 2;
    Handle h = prepare(g, idx, {}, tiny);
    recv[r] = Tensor::full({2, 8}, DType::kF32, 3.0);
    try {
      dispatch_forward(g, h, x, {}, recv[r], {});
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kCapacityExceeded);
      msgs[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(small_out[r].numel(), full_out[r].numel());
    for (int64_t i = 0; i < full_out[r].numel(); ++i)
      ASSERT_EQ(small_out[r].ptr<float>()[i], full_out[r].ptr<float>()[i]) << "rank " << r;
    EXPECT_TRUE(has(msgs[r], "more than its handle's recv capacity of 2 (PrepareOptions::recv_capacity_rows; the "
                             "group's is " + std::to_string(group_cap) + "); nothing was written")) << msgs[r];
    for (int64_t i = 0; i < recv[r].numel(); ++i) ASSERT_EQ(recv[r].ptr<float>()[i], 3.0f) << "overflowing rank wrote";
  }
}

TEST(EpHostErrors, MissingPeerTimesOutNamingIt) {
  GroupConfig c = small_config();
  c.timeout_s = 0.2;
  c.num_experts = 6;
  auto groups = Group::create_simulated(3, c);
  try {
    run_ranks(groups, [&](Group& g) {
      if (g.rank() == 2) return;  // never joins the collective
      Tensor idx = Tensor::zeros({1, 1}, DType::kI32);
      prepare(g, idx, {});
    });
    FAIL() << "expected a timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kTimeout);
    EXPECT_TRUE(has(e.what(), "never arrived")) << e.what();
    EXPECT_TRUE(has(e.what(), "rank(s) 2 never arrived")) << e.what();
  }
}


// Quantized dispatch: the fp8 payload and its scales travel together and land in the same expert-
// major rows as a plain dispatch of the same tokens; padding rows carry zero payload and scales.
TEST(EpHost, QuantizedDispatchCarriesScales) {
  for (QuantRecipe recipe : {QuantRecipe::kFp8Block1x128, QuantRecipe::kMxfp8Rowwise}) {
    SCOPED_TRACE(quant_recipe_name(recipe));
    const int R = 2, E = 4, K = 2, H = 256, T = 9;
    GroupConfig cfg;
    cfg.num_experts = E;
    cfg.hidden = H;
    cfg.max_tokens_per_rank = T;
    cfg.max_topk = K;
    cfg.align = 32;
    auto groups = Group::create_simulated(R, cfg);
    const int64_t cap = groups[0].recv_capacity_rows();
    const Shape ss = quant_scale_shape(recipe, T, H), rs = quant_scale_shape(recipe, cap, H);
    const DType sdt = quant_scale_dtype(recipe);
    std::vector<Tensor> q(R), sc(R), recv_plain(R), recv_q(R), recv_s(R);
    std::vector<std::vector<int32_t>> ids_of(R);
    run_ranks(groups, [&](Group& g) {
      const int r = g.rank();
      std::mt19937 rng(40 + r);
      const std::vector<int64_t> ids = uniform_ids(R, E, K, r, T, rng);
      ids_of[r].assign(ids.begin(), ids.end());
      Tensor idx = ids_tensor(ids, T, K);
      Tensor x = random_rows(T, H, DType::kBF16, rng);
      q[r] = Tensor::empty({T, H}, DType::kF8E4M3);
      sc[r] = Tensor::empty(ss, sdt);
      quantize(recipe, x, q[r], sc[r]);
      recv_plain[r] = Tensor::full({cap, H}, DType::kF8E4M3, 1.0);
      recv_q[r] = Tensor::full({cap, H}, DType::kF8E4M3, 3.0);
      recv_s[r] = Tensor::full(rs, sdt, 8.0);
      Handle plain = prepare(g, idx, {});
      dispatch_forward(g, plain, q[r], {}, recv_plain[r], {});
      Handle quant = prepare(g, idx, {});
      dispatch_forward(g, quant, q[r], sc[r], {}, recv_q[r], recv_s[r], {});
      const int64_t rows = quant.num_recv_rows_host();
      const std::vector<int32_t> off = quant.expert_offsets_host();
      std::vector<char> is_pad(rows, 1);
      const Tensor& er = quant.state().expert_rows;
      for (int j = 0; j < g.local_experts(); ++j)
        for (int64_t i = off[j]; i < off[j] + er.ptr<int32_t>()[j]; ++i) is_pad[i] = 0;
      const int64_t S = ss[1];
      for (int64_t row = 0; row < rows; ++row) {
        ASSERT_TRUE(same_bytes(recv_q[r], row, recv_plain[r], row, H)) << "payload row " << row;
        for (int64_t j = 0; j < S; ++j) {
          const double v = load_as_double(recv_s[r].data(), sdt, row * S + j);
          if (is_pad[row]) ASSERT_EQ(static_cast<const uint8_t*>(recv_s[r].data())[row * S * dtype_size(sdt) + j * dtype_size(sdt)], 0) << "padding scale";
          else ASSERT_TRUE(v > 0 && std::isfinite(v)) << "row " << row << " scale " << j;
        }
      }
    });
    // The scales of every received row are the scales of the token it holds: dequantizing a
    // received row gives exactly the dequantized source token the oracle layout puts there.
    std::vector<RankRouting> routing(R);
    std::vector<Tensor> src(R);
    for (int s = 0; s < R; ++s) {
      routing[s] = RankRouting{T, K, ids_of[s]};
      src[s] = Tensor::empty({T, H}, DType::kF32);
      dequantize(recipe, q[s], sc[s], src[s]);
    }
    for (int r = 0; r < R; ++r) {
      Tensor deq = Tensor::empty({cap, H}, DType::kF32);
      dequantize(recipe, recv_q[r], recv_s[r], deq);
      const ExpertMajorLayout L = testing::oracle_layout(routing, E, r, cfg.align);
      for (int64_t row = 0; row < L.offsets.back(); ++row) {
        const int s = L.src_rank[row], t = L.src_token[row];
        for (int64_t i = 0; i < H; ++i)
          ASSERT_EQ(deq.ptr<float>()[row * H + i], s < 0 ? 0.0f : src[s].ptr<float>()[t * H + i])
              << "rank " << r << " row " << row << " col " << i;
      }
    }
  }
}

TEST(EpHostErrors, QuantizedDispatchArguments) {
  GroupConfig cfg = small_config();
  cfg.hidden = 256;
  auto groups = Group::create_simulated(1, cfg);
  Group& g = groups[0];
  Tensor idx = Tensor::zeros({2, 1}, DType::kI32);
  const int64_t cap = g.recv_capacity_rows();
  Tensor q = Tensor::zeros({2, 256}, DType::kF8E4M3), rq = Tensor::zeros({cap, 256}, DType::kF8E4M3);
  Tensor s_bad = Tensor::zeros({2, 3}, DType::kF32), rs = Tensor::zeros({cap, 2}, DType::kF32);
  Handle h = prepare(g, idx, {});
  EXPECT_TRUE(has(error_of([&] { dispatch_forward(g, h, q, s_bad, {}, rq, rs, {}); }),
                  "x_scales has 3 columns, expected 2 (one fp32 scale per 128 elements of a row of 256)"));
  Tensor xb = Tensor::zeros({2, 256}, DType::kBF16), rb = Tensor::zeros({cap, 256}, DType::kBF16);
  Tensor s2 = Tensor::zeros({2, 2}, DType::kF32);
  EXPECT_TRUE(has(error_of([&] { dispatch_forward(g, h, xb, s2, {}, rb, rs, {}); }),
                  "x has dtype bf16, expected fp8_e4m3 when scales travel with it"));
  GroupConfig narrow = cfg;
  narrow.max_dtype = DType::kF8E4M3;
  auto ng = Group::create_simulated(1, narrow);
  Handle h2 = prepare(ng[0], idx, {});
  Tensor rq2 = Tensor::zeros({ng[0].recv_capacity_rows(), 256}, DType::kF8E4M3);
  Tensor rs2 = Tensor::zeros({ng[0].recv_capacity_rows(), 2}, DType::kF32);
  EXPECT_TRUE(has(error_of([&] { dispatch_forward(ng[0], h2, q, s2, {}, rq2, rs2, {}); }),
                  "an fp8 row with its scales takes 264 bytes, more than the 256 bytes per row"));
}

// Quantize on the way: a high-precision x with fp8 recv_x and recv_scales (whose dtype picks the
// recipe) gives exactly quantize() followed by the quantized dispatch, on every rank, for both
// recipes, both MX roundings, every input dtype and alignment, with zero / huge / NaN / inf rows in
// x. Every output starts from a different poison, so an unwritten byte cannot pass.
TEST(EpHost, QuantizeOnTheWayEqualsQuantizeThenDispatch) {
  struct Variant {
    QuantRecipe recipe;
    E8M0Rounding rounding;
  };
  const Variant variants[] = {{QuantRecipe::kFp8Block1x128, E8M0Rounding::kFloor},
                              {QuantRecipe::kMxfp8Rowwise, E8M0Rounding::kFloor},
                              {QuantRecipe::kMxfp8Rowwise, E8M0Rounding::kCeil}};
  for (const Variant& v : variants)
    for (DType dt : {DType::kBF16, DType::kF16, DType::kF32})
      for (int align : {1, 32, 128}) {
        SCOPED_TRACE(detail::concat(quant_recipe_name(v.recipe), v.rounding == E8M0Rounding::kCeil ? "/ceil" : "", " ",
                                    dtype_name(dt), " align=", align));
        const int R = 2, E = 8, K = 3, H = 256, T = 11;
        GroupConfig cfg;
        cfg.num_experts = E;
        cfg.hidden = H;
        cfg.max_tokens_per_rank = T;
        cfg.max_topk = K;
        cfg.align = align;
        auto groups = Group::create_simulated(R, cfg);
        const int64_t cap = groups[0].recv_capacity_rows();
        const Shape rs = quant_scale_shape(v.recipe, cap, H);
        const DType sdt = quant_scale_dtype(v.recipe);
        QuantOptions opt;
        opt.mx_rounding = v.rounding;
        run_ranks(groups, [&](Group& g) {
          const int r = g.rank();
          std::mt19937 rng(70 + r);
          Scenario sc_ids;
          sc_ids.ranks = R;
          sc_ids.experts = E;
          sc_ids.topk = K;
          sc_ids.pattern = r == 0 ? Pattern::kSkewed : Pattern::kMaskedHeavy;
          std::vector<int64_t> ids = make_ids(sc_ids, r, T, rng);
          Tensor idx = ids_tensor(ids, T, K);
          Tensor w = random_vec(T * K, rng);
          Tensor tw = Tensor::empty({T, K}, DType::kF32);
          std::copy(w.ptr<float>(), w.ptr<float>() + T * K, tw.ptr<float>());
          Tensor x = random_rows(T, H, dt, rng);
          for (int64_t j = 0; j < H; ++j) {  // row 1 zeros, row 2 huge, row 3 NaN / inf sprinkled
            store_from_double(x.data(), dt, 1 * H + j, 0.0);
            store_from_double(x.data(), dt, 2 * H + j, (j % 2 ? -1.0 : 1.0) * (dt == DType::kF16 ? 60000.0 : 3e38));
            if (j % 9 == 0) store_from_double(x.data(), dt, 3 * H + j, j % 2 ? NAN : INFINITY);
          }
          Tensor fused_q = Tensor::full({cap, H}, DType::kF8E4M3, 3.0), fused_s = Tensor::full(rs, sdt, 8.0);
          Tensor fused_w = Tensor::full({cap}, DType::kF32, 5.0);
          Handle a = prepare(g, idx, tw);
          dispatch_forward(g, a, x, {}, tw, fused_q, fused_s, fused_w, {}, opt);

          Tensor q = Tensor::empty({T, H}, DType::kF8E4M3), s = Tensor::empty(quant_scale_shape(v.recipe, T, H), sdt);
          quantize(v.recipe, x, q, s, opt);
          Tensor want_q = Tensor::full({cap, H}, DType::kF8E4M3, -2.0), want_s = Tensor::full(rs, sdt, 0.5);
          Tensor want_w = Tensor::full({cap}, DType::kF32, -7.0);
          Handle b = prepare(g, idx, tw);
          dispatch_forward(g, b, q, s, tw, want_q, want_s, want_w);

          const int64_t rows = b.num_recv_rows_host();
          ASSERT_EQ(a.expert_offsets_host(), b.expert_offsets_host());
          const int64_t S = rs[1], sbytes = S * static_cast<int64_t>(dtype_size(sdt));
          for (int64_t row = 0; row < rows; ++row) {
            ASSERT_TRUE(same_bytes(fused_q, row, want_q, row, H)) << "rank " << r << " codes of row " << row;
            ASSERT_EQ(std::memcmp(static_cast<const char*>(fused_s.data()) + row * sbytes,
                                  static_cast<const char*>(want_s.data()) + row * sbytes, sbytes),
                      0)
                << "rank " << r << " scales of row " << row;
            ASSERT_EQ(fused_w.ptr<float>()[row], want_w.ptr<float>()[row]) << "rank " << r << " weight of row " << row;
          }
        });
      }
}

TEST(EpHostErrors, QuantizeOnTheWayArguments) {
  GroupConfig cfg = small_config();
  cfg.hidden = 256;
  auto groups = Group::create_simulated(1, cfg);
  Group& g = groups[0];
  const int64_t cap = g.recv_capacity_rows();
  Tensor idx = Tensor::zeros({2, 1}, DType::kI32);
  Tensor x = Tensor::zeros({2, 256}, DType::kBF16), rq = Tensor::zeros({cap, 256}, DType::kF8E4M3);
  auto err = [&](const TensorRef& xx, const TensorRef& recv_x, const TensorRef& recv_s) {
    Handle h = prepare(g, idx, {});
    return error_of([&] { dispatch_forward(g, h, xx, {}, {}, recv_x, recv_s, {}); });
  };
  std::string e = err(x, rq, Tensor::zeros({cap, 3}, DType::kF32));
  EXPECT_TRUE(has(e, detail::concat("epx::dispatch_forward: recv_scales has shape [", cap, ", 3], expected [>= ", cap,
                                    ", 2] (one fp32 scale per 128 elements of a row of 256: the fp8_block_1x128 recipe)")))
      << e;
  e = err(x, rq, Tensor::zeros({cap, 2}, DType::kE8M0));
  EXPECT_TRUE(has(e, detail::concat("recv_scales has shape [", cap, ", 2], expected [>= ", cap,
                                    ", 8] (one e8m0 scale per 32 elements of a row of 256: the mxfp8_rowwise recipe)")))
      << e;
  e = err(x, rq, Tensor::zeros({cap, 2}, DType::kBF16));
  EXPECT_TRUE(has(e, "recv_scales has dtype bf16, expected fp32 or e8m0")) << e;
  e = err(x, rq, Tensor::zeros({cap - 1, 2}, DType::kF32));
  EXPECT_TRUE(has(e, detail::concat("recv_scales has ", cap - 1, " rows, expected at least ", cap))) << e;
  e = err(x, Tensor::zeros({cap, 256}, DType::kBF16), Tensor::zeros({cap, 2}, DType::kF32));
  EXPECT_TRUE(has(e, "recv_x has dtype bf16, expected fp8_e4m3 (x is quantized on the way")) << e;
  e = err(x, Tensor::zeros({cap - 1, 256}, DType::kF8E4M3), Tensor::zeros({cap, 2}, DType::kF32));
  EXPECT_TRUE(has(e, detail::concat("recv_x has ", cap - 1, " rows, expected at least ", cap))) << e;
  e = err(Tensor::zeros({2, 256}, DType::kF64), rq, Tensor::zeros({cap, 2}, DType::kF32));
  EXPECT_TRUE(has(e, "x has dtype fp64, expected fp8_e4m3 with x_scales, or fp32, bf16 or fp16 to quantize on the way"))
      << e;
  {
    Handle h = prepare(g, idx, {});
    Tensor rs = Tensor::zeros({cap, 8}, DType::kE8M0);
    QuantOptions bad;
    bad.mx_rounding = static_cast<E8M0Rounding>(7);
    e = error_of([&] { dispatch_forward(g, h, x, {}, {}, rq, rs, {}, {}, bad); });
    EXPECT_TRUE(has(e, "quant_options.mx_rounding has value 7, expected kFloor (0) or kCeil (1)")) << e;
  }
  // H not a whole number of blocks: 96 columns are 3 MX blocks but not one 1x128 block.
  GroupConfig c96 = small_config();
  c96.hidden = 96;
  auto g96 = Group::create_simulated(1, c96);
  const int64_t cap96 = g96[0].recv_capacity_rows();
  Tensor x96 = Tensor::zeros({2, 96}, DType::kBF16), rq96 = Tensor::zeros({cap96, 96}, DType::kF8E4M3);
  {
    Handle h = prepare(g96[0], idx, {});
    e = error_of([&] { dispatch_forward(g96[0], h, x96, {}, {}, rq96, Tensor::zeros({cap96, 1}, DType::kF32), {}); });
    EXPECT_TRUE(has(e, "x has 96 columns (hidden), expected a multiple of 128 to quantize on the way with the "
                       "fp8_block_1x128 recipe that fp32 recv_scales select")) << e;
  }
  GroupConfig c48 = small_config();
  c48.hidden = 48;
  auto g48 = Group::create_simulated(1, c48);
  const int64_t cap48 = g48[0].recv_capacity_rows();
  {
    Handle h = prepare(g48[0], idx, {});
    e = error_of([&] {
      dispatch_forward(g48[0], h, Tensor::zeros({2, 48}, DType::kF32), {}, {}, Tensor::zeros({cap48, 48}, DType::kF8E4M3),
                       Tensor::zeros({cap48, 2}, DType::kE8M0), {});
    });
    EXPECT_TRUE(has(e, "x has 48 columns (hidden), expected a multiple of 32 to quantize on the way with the "
                       "mxfp8_rowwise recipe that e8m0 recv_scales select")) << e;
  }
  // An fp8 x needs its scales; a high-precision x with scales is refused.
  {
    Handle h = prepare(g, idx, {});
    e = error_of([&] { dispatch_forward(g, h, Tensor::zeros({2, 256}, DType::kF8E4M3), {}, {}, rq,
                                        Tensor::zeros({cap, 2}, DType::kF32), {}); });
    EXPECT_TRUE(has(e, "x_scales is missing")) << e;
  }
  // A failed call leaves the handle usable.
  Handle h = prepare(g, idx, {});
  error_of([&] { dispatch_forward(g, h, x, {}, {}, rq, Tensor::zeros({cap, 3}, DType::kF32), {}); });
  Tensor rs = Tensor::zeros({cap, 2}, DType::kF32);
  EXPECT_NO_THROW(dispatch_forward(g, h, x, {}, {}, rq, rs, {}));
}

TEST(EpHost, AllReduceSumsInRankOrder) {
  GroupConfig c = small_config();
  c.num_experts = 6;
  auto groups = Group::create_simulated(3, c);
  std::vector<Tensor> bufs(3);
  const int64_t n = 20000;  // more than one reduce chunk
  run_ranks(groups, [&](Group& g) {
    bufs[g.rank()] = Tensor::empty({n}, DType::kF32);
    for (int64_t i = 0; i < n; ++i) bufs[g.rank()].ptr<float>()[i] = static_cast<float>(i % 97) + g.rank() * 0.5f;
    all_reduce_sum(g, bufs[g.rank()]);
  });
  for (int r = 0; r < 3; ++r)
    for (int64_t i = 0; i < n; i += 997) EXPECT_EQ(bufs[r].ptr<float>()[i], 3.0f * (i % 97) + 1.5f);
}

}  // namespace
}  // namespace epx
