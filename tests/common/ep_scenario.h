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

#include "common/routing_draw.h"
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
  bool weighted_combine_bwd = true;  // false: combine_backward without row weights (d_y = d_out[t], no dot)

  int tokens_of(int r) const { return tokens.empty() ? max_tokens : tokens[r]; }
  std::string str() const {
    return detail::concat("R=", ranks, " E=", E, " K=", K, " H=", H, " align=", align, " payload=", dtype_name(payload),
                          " idx=", dtype_name(idx_dtype), " cf=", capacity, " drop=", static_cast<int>(drop), " hot=", hot,
                          " only_rank=", only_rank, " zipf=", zipf, " seed=", seed,
                          weighted_combine_bwd ? "" : " unweighted_combine_bwd");
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
  RoutingDraw d{c.E, c.K, c.hot, c.mask_p, c.zipf};
  if (c.only_rank >= 0) {
    d.only_first = c.only_rank * Le;
    d.only_count = Le;
  }
  draw_routing(rng, u, T, d, [&](int t, int k, int64_t e) {
    store_from_double(in.idx.data(), c.idx_dtype, t * c.K + k, static_cast<double>(e));
  });
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

/// One microbatch of a case on one rank's view: its inputs copied to the group's device, its
/// outputs poisoned (so unwritten elements show), and its handle. Constructing it allocates and
/// makes no collective call; each op method is one collective call, so several microbatches can
/// be interleaved in any order the ranks agree on.
struct EpRun {
  EpCase c;
  Tensor idx, w, x, y, d_out, d_recv, d_recv_w;
  Tensor recv_x, recv_w, out, d_y, d_row_w, d_x, d_topk_w;
  Handle h;

  EpRun(Group& g, const EpCase& cs) : c(cs) {
    const int64_t cap = g.recv_capacity_rows();
    const EpInputs in = ep_inputs(c, g.rank(), cap);
    const Device dev = g.device();
    auto put = [&](const Tensor& t) { return dev.is_cpu() ? t.clone() : t.to(dev); };
    auto poisoned = [&](Shape s, DType dt) { return put(Tensor::full(s, dt, 1234.5)); };
    const int T = c.tokens_of(g.rank());
    idx = put(in.idx);
    w = put(in.w);
    x = put(in.x);
    y = put(in.y);
    d_out = put(in.d_out);
    d_recv = put(in.d_recv);
    d_recv_w = put(in.d_recv_w);
    recv_x = poisoned({cap, c.H}, c.payload);
    recv_w = poisoned({cap}, DType::kF32);
    out = poisoned({T, c.H}, c.payload);
    d_y = poisoned({cap, c.H}, c.payload);
    d_row_w = poisoned({cap}, DType::kF32);
    d_x = poisoned({T, c.H}, c.payload);
    d_topk_w = poisoned({T, c.K}, DType::kF32);
  }
  void prepare(Group& g, Stream s = {}) {
    PrepareOptions opt;
    opt.capacity_factor = c.capacity;
    opt.drop_policy = c.drop;
    h = epx::prepare(g, idx, w, opt, s);
  }
  void dispatch(Group& g, Stream s = {}) { dispatch_forward(g, h, x, w, recv_x, recv_w, s); }
  void combine(Group& g, Stream s = {}) { combine_forward(g, h, y, recv_w, out, s); }
  void combine_bwd(Group& g, Stream s = {}) {
    if (c.weighted_combine_bwd)
      combine_backward(g, h, d_out, y, recv_w, d_y, d_row_w, s);
    else
      combine_backward(g, h, d_out, TensorRef(), TensorRef(), d_y, TensorRef(), s);
  }
  void dispatch_bwd(Group& g, Stream s = {}) { dispatch_backward(g, h, d_recv, d_recv_w, d_x, d_topk_w, s); }
  void all_four(Group& g, Stream s = {}) {
    prepare(g, s);
    dispatch(g, s);
    combine(g, s);
    combine_bwd(g, s);
    dispatch_bwd(g, s);
  }
  /// Host copies of every output (synchronous; call once the ops are done).
  EpOutputs outputs() const {
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
};

/// Runs the four ops on one rank's view (inputs copied to the group's device) and brings every
/// output back to the host; outputs are poisoned first so unwritten elements show. `sync` (if
/// given) is called once every buffer is allocated and once the collectives are done: ranks that
/// share a process must not allocate while a peer's collective is in flight.
inline EpOutputs ep_run(Group& g, const EpCase& c, const std::function<void()>& sync = {}) {
  EpRun run(g, c);
  if (sync) sync();
  run.all_four(g);
  g.check();
  if (sync) sync();
  return run.outputs();
}

// ---- quantized dispatch -----------------------------------------------------------------------

/// fp8 (e4m3) rows and their block scales: fp32 per 128 elements (1x128) or e8m0 per 32 (MXFP8).
struct EpQuantOutputs {
  std::vector<int32_t> offsets;
  Tensor recv_q, recv_s, recv_w;  // host copies
  int64_t used_rows() const { return offsets.empty() ? 0 : offsets.back(); }
};

inline int64_t quant_scale_cols(const EpCase& c, DType scale_dtype) {
  const int64_t block = scale_dtype == DType::kF32 ? 128 : 32;
  return (c.H + block - 1) / block;
}

/// prepare + the quantized dispatch_forward of the case's routing, with fp8 bytes and scales drawn
/// from (seed, rank); every byte is moved, none interpreted, so any valid pattern does.
inline EpQuantOutputs ep_run_quantized(Group& g, const EpCase& c, DType scale_dtype,
                                       const std::function<void()>& sync = {}) {
  const int64_t cap = g.recv_capacity_rows(), S = quant_scale_cols(c, scale_dtype);
  const int T = c.tokens_of(g.rank()), r = g.rank();
  const EpInputs in = ep_inputs(c, r, cap);
  Tensor q = Tensor::empty({T, c.H}, DType::kF8E4M3), s = Tensor::empty({T, S}, scale_dtype);
  for (int64_t i = 0; i < q.numel(); ++i) static_cast<uint8_t*>(q.data())[i] = static_cast<uint8_t>((i * 37 + r * 11 + c.seed) % 126);
  for (int64_t i = 0; i < s.numel(); ++i) {
    if (scale_dtype == DType::kF32) s.ptr<float>()[i] = 0.5f + static_cast<float>(i) + 1000.0f * r;
    else static_cast<uint8_t*>(s.data())[i] = static_cast<uint8_t>(100 + (i + 7 * r + c.seed) % 50);
  }
  const Device dev = g.device();
  auto put = [&](const Tensor& t) { return dev.is_cpu() ? t.clone() : t.to(dev); };
  Tensor idx = put(in.idx), w = put(in.w), dq = put(q), ds = put(s);
  Tensor recv_q = put(Tensor::full({cap, c.H}, DType::kF8E4M3, 3.0));
  Tensor recv_s = put(Tensor::full({cap, S}, scale_dtype, 8.0));
  Tensor recv_w = put(Tensor::full({cap}, DType::kF32, 1234.5));
  if (sync) sync();
  Handle h = prepare(g, idx, w);
  dispatch_forward(g, h, dq, ds, w, recv_q, recv_s, recv_w);
  g.check();
  if (sync) sync();
  EpQuantOutputs o;
  o.offsets = h.expert_offsets_host();
  o.recv_q = recv_q.to(Device::cpu());
  o.recv_s = recv_s.to(Device::cpu());
  o.recv_w = recv_w.to(Device::cpu());
  return o;
}

inline std::vector<EpQuantOutputs> ep_reference_quantized(const EpCase& c, DType scale_dtype) {
  std::vector<Group> groups = Group::create_simulated(c.ranks, c.group_config());
  std::vector<EpQuantOutputs> outs(c.ranks);
  run_ranks(groups, [&](Group& g) { outs[g.rank()] = ep_run_quantized(g, c, scale_dtype); });
  return outs;
}

/// Cases with equal keys can share one group (same buffer sizes).
inline std::string group_key(const EpCase& c) {
  return detail::concat(c.ranks, "/", c.E, "/", c.K, "/", c.H, "/", c.align, "/", c.max_tokens);
}

// ---- the scenarios every multi-rank backend must pass -----------------------------------------

struct NamedCase {
  std::string name;
  EpCase c;
};

/// The routing and shape scenarios the multi-GPU suites run for every transport, for a group of
/// `ranks` ranks (E = 8 per rank).
inline std::vector<NamedCase> standard_cases(int ranks) {
  EpCase base;
  base.ranks = ranks;
  base.E = 8 * ranks;
  std::vector<NamedCase> v;
  auto add = [&](const std::string& name, EpCase c) { v.push_back({name, c}); };
  add("uniform", base);
  {
    EpCase c = base;
    c.seed = 2;
    add("uniform seed 2", c);
  }
  {
    EpCase c = base;
    c.zipf = 4;
    add("skewed (zipf 4)", c);
  }
  {
    EpCase c = base;
    c.hot = 3;
    c.mask_p = 1.0;
    add("every token to one expert", c);
  }
  {
    EpCase c = base;
    c.only_rank = 0;
    add("all to rank 0 (the others receive nothing)", c);
  }
  {
    EpCase c = base;
    c.only_rank = ranks - 1;
    c.zipf = 2;
    add("all to the last rank", c);
  }
  {
    EpCase c = base;
    c.mask_p = 0.8;
    add("mostly masked slots", c);
  }
  {
    EpCase c = base;
    c.mask_p = 1.0;
    add("every slot masked", c);
  }
  {
    EpCase c = base;
    c.tokens.assign(ranks, base.max_tokens);
    c.tokens[0] = 0;
    add("T = 0 on rank 0", c);
  }
  {
    EpCase c = base;
    c.tokens.assign(ranks, 0);
    add("T = 0 on every rank", c);
  }
  {
    EpCase c = base;
    c.tokens.clear();
    for (int r = 0; r < ranks; ++r) c.tokens.push_back((r * 37 + 5) % base.max_tokens);
    add("different T per rank", c);
  }
  EpCase wide = base;
  wide.align = 16;
  wide.max_tokens = 300;  // T = max on every rank
  for (DType p : {DType::kBF16, DType::kF32})
    for (DType i : {DType::kI32, DType::kI64}) {
      EpCase c = wide;
      c.payload = p;
      c.idx_dtype = i;
      add(detail::concat("max T, align 16, ", dtype_name(p), " rows, ", dtype_name(i), " ids"), c);
    }
  {
    EpCase c = base;
    c.H = 100;  // 200-byte bf16 rows: not a multiple of 16 (the byte-wise kernels)
    c.align = 32;
    add("H = 100 (rows not 16-byte multiples), align 32", c);
  }
  {
    EpCase c = wide;
    c.capacity = 0.75f;
    c.zipf = 2;
    add("capacity 0.75 by position", c);
    c.drop = DropPolicy::kByProbability;
    add("capacity 0.75 by probability", c);
  }
  return v;
}

/// The reference: every rank of the case on the host backend.
inline std::vector<EpOutputs> ep_reference(const EpCase& c) {
  std::vector<Group> groups = Group::create_simulated(c.ranks, c.group_config());
  std::vector<EpOutputs> outs(c.ranks);
  run_ranks(groups, [&](Group& g) { outs[g.rank()] = ep_run(g, c); });
  return outs;
}

}  // namespace epx::testing
