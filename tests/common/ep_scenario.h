// One EP scenario, run on any backend: per-rank inputs drawn from (seed, rank), the four EP ops
// (prepare + dispatch, combine, combine_backward, dispatch_backward) on one rank's Group view, and
// the host-side copies of every output. The same function runs the reference (host group of R
// simulated ranks) and the GPU groups, so the tests compare like with like.
#pragma once

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/ep_state.h"
#include "epx/comm.h"
#include "epx/error.h"
#include "epx/layout.h"

namespace epx::testing {

struct EpCase {
  int ranks = 2, E = 16, K = 4, H = 96, align = 1, max_tokens = 64;
  std::vector<int> tokens;  // per rank; empty = max_tokens everywhere
  DType payload = DType::kBF16;
  DType idx_dtype = DType::kI32;
  float capacity = 0;
  DropPolicy drop = DropPolicy::kByPosition;
  int hot = -1;         // every token's first slot to this expert
  int only_rank = -1;   // every chosen expert on this rank
  double mask_p = 0.1;
  double zipf = 0;
  uint32_t seed = 1;

  int tokens_of(int r) const { return tokens.empty() ? max_tokens : tokens[r]; }
  std::string str() const {
    return detail::concat("R=", ranks, " E=", E, " K=", K, " H=", H, " align=", align, " payload=", dtype_name(payload),
                          " idx=", dtype_name(idx_dtype), " cf=", capacity, " drop=", static_cast<int>(drop), " hot=", hot,
                          " only_rank=", only_rank, " zipf=", zipf, " seed=", seed);
  }
  GroupConfig group_config() const {
    GroupConfig g;
    g.num_experts = E;
    g.hidden = H;
    g.max_tokens_per_rank = max_tokens;
    g.max_topk = K;
    g.max_dtype = DType::kF32;
    g.align = align;
    g.timeout_s = 20;
    return g;
  }
};

struct EpInputs {
  Tensor idx, w, x, y, d_out, d_recv, d_recv_w;
};

inline EpInputs ep_inputs(const EpCase& c, int rank, int64_t cap) {
  std::mt19937 rng(c.seed * 7919 + rank);
  std::uniform_real_distribution<double> u(0, 1);
  std::normal_distribution<float> n(0, 1);
  const int T = c.tokens_of(rank), Le = c.E / c.ranks;
  EpInputs in;
  in.idx = Tensor::empty({T, c.K}, c.idx_dtype);
  for (int t = 0; t < T; ++t) {
    std::vector<char> used(c.E, 0);
    for (int k = 0; k < c.K; ++k) {
      int64_t e = -1;
      if (k == 0 && c.hot >= 0) {
        e = c.hot;
      } else if (u(rng) >= c.mask_p) {
        for (int tries = 0; tries < 64 && e < 0; ++tries) {
          int cand;
          if (c.only_rank >= 0) cand = c.only_rank * Le + static_cast<int>(u(rng) * Le);
          else cand = c.zipf > 0 ? static_cast<int>(std::pow(u(rng), c.zipf) * c.E) : static_cast<int>(u(rng) * c.E);
          cand = std::min(cand, c.E - 1);
          if (!used[cand]) e = cand;
        }
      }
      if (e >= 0) used[e] = 1;
      store_from_double(in.idx.data(), c.idx_dtype, t * c.K + k, static_cast<double>(e));
    }
  }
  in.w = Tensor::empty({T, c.K}, DType::kF32);
  for (int64_t i = 0; i < in.w.numel(); ++i) in.w.ptr<float>()[i] = static_cast<float>(0.05 + u(rng));
  auto rows = [&](int64_t r) {
    Tensor t = Tensor::empty({r, c.H}, c.payload);
    for (int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), c.payload, i, n(rng));
    return t;
  };
  in.x = rows(T);
  in.y = rows(cap);
  in.d_out = rows(T);
  in.d_recv = rows(cap);
  in.d_recv_w = Tensor::empty({cap}, DType::kF32);
  for (int64_t i = 0; i < cap; ++i) in.d_recv_w.ptr<float>()[i] = n(rng);
  return in;
}

struct EpOutputs {
  std::vector<int32_t> offsets, routed;
  Tensor recv_x, recv_w, out, d_y, d_row_w, d_x, d_topk_w;  // host copies
  int64_t used_rows() const { return offsets.empty() ? 0 : offsets.back(); }
};

/// Runs the four ops on one rank's view (inputs copied to the group's device) and brings every
/// output back to the host; outputs are poisoned first so unwritten elements show. `sync` (if
/// given) is called once every buffer is allocated and once the collectives are done: ranks that
/// share a process must not allocate while a peer's collective is in flight.
inline EpOutputs ep_run(Group& g, const EpCase& c, const std::function<void()>& sync = {}) {
  const int64_t cap = g.recv_capacity_rows();
  const EpInputs in = ep_inputs(c, g.rank(), cap);
  const Device dev = g.device();
  auto put = [&](const Tensor& t) { return dev.is_cpu() ? t.clone() : t.to(dev); };
  auto poisoned = [&](Shape s, DType dt) { return put(Tensor::full(s, dt, 1234.5)); };
  const int T = c.tokens_of(g.rank());
  Tensor idx = put(in.idx), w = put(in.w), x = put(in.x), y = put(in.y), d_out = put(in.d_out),
         d_recv = put(in.d_recv), d_recv_w = put(in.d_recv_w);
  Tensor recv_x = poisoned({cap, c.H}, c.payload), recv_w = poisoned({cap}, DType::kF32),
         out = poisoned({T, c.H}, c.payload), d_y = poisoned({cap, c.H}, c.payload),
         d_row_w = poisoned({cap}, DType::kF32), d_x = poisoned({T, c.H}, c.payload),
         d_topk_w = poisoned({T, c.K}, DType::kF32);
  PrepareOptions opt;
  opt.capacity_factor = c.capacity;
  opt.drop_policy = c.drop;
  if (sync) sync();
  Handle h = prepare(g, idx, w, opt);
  dispatch_forward(g, h, x, w, recv_x, recv_w);
  combine_forward(g, h, y, recv_w, out);
  combine_backward(g, h, d_out, y, recv_w, d_y, d_row_w);
  dispatch_backward(g, h, d_recv, d_recv_w, d_x, d_topk_w);
  g.check();
  if (sync) sync();
  EpOutputs o;
  o.offsets = h.expert_offsets_host();
  Tensor r = h.routed_experts().device().is_cpu() ? Tensor::wrap(h.routed_experts(), nullptr).clone()
                                                 : Tensor::wrap(h.routed_experts(), nullptr).to(Device::cpu());
  o.routed.assign(r.ptr<int32_t>(), r.ptr<int32_t>() + r.numel());
  auto host = [](const Tensor& t) { return t.to(Device::cpu()); };
  o.recv_x = host(recv_x);
  o.recv_w = host(recv_w);
  o.out = host(out);
  o.d_y = host(d_y);
  o.d_row_w = host(d_row_w);
  o.d_x = host(d_x);
  o.d_topk_w = host(d_topk_w);
  return o;
}

/// The reference: every rank of the case on the host backend.
inline std::vector<EpOutputs> ep_reference(const EpCase& c) {
  std::vector<Group> groups = Group::create_simulated(c.ranks, c.group_config());
  std::vector<EpOutputs> outs(c.ranks);
  run_ranks(groups, [&](Group& g) { outs[g.rank()] = ep_run(g, c); });
  return outs;
}

}  // namespace epx::testing
