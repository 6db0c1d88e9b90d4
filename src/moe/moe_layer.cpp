// The MoE layer composes the public ops; it never touches data itself, so one implementation serves
// every backend (the host reference with simulated ranks, and the GPU one).
//
// Forward:  logits = x . gate (fp32 accumulate)   -> route_forward (topk_idx, topk_weights, stats)
//           prepare (capacity)  -> count_routed on the KEPT routing -> all-reduce the statistics
//           -> router_losses    -> dispatch_forward -> expert_mlp_forward -> combine_forward
//           (+ shared experts on x, added after the routed sum).
// Backward: shared experts backward; combine_backward; expert_mlp_backward; dispatch_backward;
//           route_backward; gate: d_logits is rounded to the layer dtype for the two gate GEMMs
//           (operands in the layer dtype, as a tensor-core GEMM takes them).
// Statistics are one contiguous buffer [scalars(2) | prob_sum(S*E) | counts(S*E)] so the global-
// batch loss needs a single all-reduce; the sequence loss reduces only the scalars.
#include "epx/moe.h"

#include <vector>

#include "core/check.h"
#include "core/device_memory.h"
#include "epx/error.h"
#include "epx/quant.h"
#include "moe/elementwise.h"

namespace epx {

using detail::check_device;
using detail::check_tensor;

struct MoEContext::State {
  int num_tokens = 0;
  TensorRef x;  // the caller's input, read again by backward (gate and shared-expert gradients)
  Tensor logits, topk_idx, topk_weights, stats_buffer, losses;
  RouterStats stats;
  Handle handle;
  Tensor x_q, x_scales, recv_x, recv_scales, recv_weights, a, h, y;
  Tensor shared_offsets, shared_rows, shared_a, shared_h, shared_y;
  int64_t shared_tokens = -1;  // T that shared_offsets / shared_rows describe
  // Backward scratch, kept so that a reused context allocates nothing after its first step.
  Tensor d_y, d_recv_weights, d_recv_x, d_x_routed, d_topk_weights, d_logits, d_logits_dt, d_x_acc, d_x_shared;
  bool used_by_backward = false;
};

MoEContext::MoEContext() = default;
MoEContext::~MoEContext() = default;
MoEContext::MoEContext(MoEContext&&) noexcept = default;
MoEContext& MoEContext::operator=(MoEContext&&) noexcept = default;
MoEContext::State& MoEContext::state() const {
  if (!state_) throw Error(Status::kInvalidArgument, "epx::MoEContext: used before MoELayer::forward() or after move");
  return *state_;
}
const Tensor& MoEContext::losses() const { return state().losses; }
const Handle& MoEContext::handle() const { return state().handle; }
const Tensor& MoEContext::topk_idx() const { return state().topk_idx; }
const Tensor& MoEContext::topk_weights() const { return state().topk_weights; }
const RouterStats& MoEContext::router_stats() const { return state().stats; }

namespace {

DType accum_dtype(DType dt) { return dt == DType::kF64 ? DType::kF64 : DType::kF32; }

TensorRef sub(const Tensor& base, int64_t offset, Shape shape) {
  char* p = static_cast<char*>(base.data()) + offset * dtype_size(base.dtype());
  return TensorRef(p, base.dtype(), shape, base.device());
}

Tensor device_ints(std::vector<int32_t> v, Device dev) {
  Tensor h = Tensor::empty({static_cast<int64_t>(v.size())}, DType::kI32);
  std::copy(v.begin(), v.end(), h.ptr<int32_t>());
  return dev.is_cpu() ? h : h.to(dev);
}

// Keeps t when it already has this shape, dtype and device: a context reused step after step
// allocates only on its first step, so later steps can be captured in a CUDA graph.
const Tensor& ensure(Tensor& t, Shape shape, DType dt, Device dev) {
  if (!t.defined() || t.dtype() != dt || !(t.device() == dev) || t.shape() != shape) t = Tensor::empty(shape, dt, dev);
  return t;
}

const Tensor& ensure_zeros(Tensor& t, Shape shape, DType dt, Device dev, Stream stream) {
  ensure(t, shape, dt, dev);
  detail::fill_zero(t, stream);
  return t;
}

void fill_normal(const Tensor& t, uint64_t seed, uint64_t stream, double stddev, int64_t offset = 0, int64_t count = -1) {
  if (!t.defined()) return;
  if (count < 0) count = t.numel();
  detail::fill_normal(sub(t, offset, {count}), seed, stream, stddev);
}

// EPX_PROFILE phase boundaries; a host layer has no stream to mark.
void mark_phase(Device dev, Stream stream, const char* name) {
  if (dev.is_cuda()) detail::phase_mark(stream, name);
}

}  // namespace

void MoEConfig::validate(const char* fn, const Group& group) const {
  const GroupConfig& g = group.config();
  router.validate(fn);
  require(hidden >= 1 && hidden == g.hidden, fn, "config.hidden is ", hidden, ", the group was created for hidden = ",
          g.hidden);
  require(ffn_hidden >= 1, fn, "config.ffn_hidden is ", ffn_hidden, ", expected >= 1");
  require(router.num_experts == g.num_experts, fn, "config.router.num_experts is ", router.num_experts,
          ", the group was created for ", g.num_experts, " experts");
  require(router.topk <= g.max_topk, fn, "config.router.topk is ", router.topk, ", the group's max_topk is ", g.max_topk);
  require(dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF32 || dtype == DType::kF64, fn,
          "config.dtype is ", dtype_name(dtype), ", expected bf16, fp16, fp32 or fp64");
  require(dtype_size(dtype) <= dtype_size(g.max_dtype), fn, "config.dtype is ", dtype_name(dtype),
          ", wider than the group's max_dtype ", dtype_name(g.max_dtype));
  require(shared_ffn_hidden >= 0, fn, "config.shared_ffn_hidden is ", shared_ffn_hidden, ", expected >= 0");
  require(precision == MlpPrecision::kHigh || dtype != DType::kF64, fn, "config.precision is ",
          mlp_precision_name(precision), ", which needs a bf16, fp16 or fp32 layer, not fp64");
}

MoELayer::MoELayer(Group& group, const MoEConfig& config, ParamStorage storage) : group_(group), config_(config) {
  const char* fn = "epx::MoELayer";
  config_.validate(fn, group);
  const int64_t H = config.hidden, F = config.ffn_hidden, Fs = config.shared_ffn_hidden, E = config.router.num_experts;
  const int64_t Le = group.local_experts(), P = config.projections();
  const DType dt = config.dtype, gt = accum_dtype(dt), expert_gt = config.expert_grads_in_dtype ? dt : gt;
  specs_.push_back({"gate", &MoEParams::gate, {H, E}, dt, gt, true});
  if (config.router.use_expert_bias)
    specs_.push_back({"expert_bias", &MoEParams::expert_bias, {E}, DType::kF32, DType::kF32, false});
  specs_.push_back({"w_in", &MoEParams::w_in, {Le, H, P, F}, dt, expert_gt, true});
  if (config.expert_bias_terms) specs_.push_back({"b_in", &MoEParams::b_in, {Le, P, F}, dt, expert_gt, true});
  specs_.push_back({"w_out", &MoEParams::w_out, {Le, F, H}, dt, expert_gt, true});
  if (config.expert_bias_terms) specs_.push_back({"b_out", &MoEParams::b_out, {Le, H}, dt, expert_gt, true});
  if (Fs > 0) {
    specs_.push_back({"shared_w_in", &MoEParams::shared_w_in, {1, H, P, Fs}, dt, gt, true});
    specs_.push_back({"shared_w_out", &MoEParams::shared_w_out, {1, Fs, H}, dt, gt, true});
  }
  if (storage == ParamStorage::kExternal) return;
  const Device dev = group.device();
  for (const ParamSpec& p : specs_) {
    params_.*p.field = Tensor::zeros(p.shape, p.dtype, dev);
    if (p.trained) grads_.*p.field = Tensor::zeros(p.shape, p.grad_dtype, dev);
  }
}

void MoELayer::check_bound(const char* fn, const MoEParams& bound, bool grads) const {
  const Device dev = group_.device();
  for (const ParamSpec& p : specs_) {
    if (grads && !p.trained) continue;
    const TensorRef& t = (bound.*p.field).ref();
    const std::string name = std::string(grads ? "grads()." : "params().") + p.name;
    const DType want = grads ? p.grad_dtype : p.dtype;
    require(t.defined(), fn, name, " is not bound, expected ", dtype_name(want), p.shape.str());
    require(t.shape() == p.shape && t.dtype() == want, fn, name, " is ", t.str(), ", expected ", dtype_name(want),
            p.shape.str());
    check_device(fn, name.c_str(), t, dev);
  }
}

MoELayer::~MoELayer() = default;

void MoELayer::init_params(uint64_t seed, double stddev) {
  const int64_t Le = group_.local_experts();
  fill_normal(params_.gate, seed, 1, stddev);
  fill_normal(params_.shared_w_in, seed, 2, stddev);
  fill_normal(params_.shared_w_out, seed, 3, stddev);
  auto per_expert = [&](const Tensor& t, uint64_t which) {
    if (!t.defined()) return;
    const int64_t n = t.numel() / Le;
    for (int64_t j = 0; j < Le; ++j) {
      const uint64_t e = static_cast<uint64_t>(group_.first_local_expert() + j);
      fill_normal(t, seed, 1000 + 4 * e + which, stddev, j * n, n);
    }
  };
  per_expert(params_.w_in, 0);
  per_expert(params_.b_in, 1);
  per_expert(params_.w_out, 2);
  per_expert(params_.b_out, 3);
}

MoEContext MoELayer::forward(const TensorRef& x, const TensorRef& out, Stream stream) {
  MoEContext ctx;
  forward(x, out, ctx, stream);
  return ctx;
}

void MoELayer::forward(const TensorRef& x, const TensorRef& out, MoEContext& ctx, Stream stream) {
  const char* fn = "epx::MoELayer::forward";
  const MoEConfig& c = config_;
  const Device dev = group_.device();
  const int64_t H = c.hidden, E = c.router.num_experts, K = c.router.topk;
  check_tensor(fn, "x", x, {-1, H}, {c.dtype});
  const int64_t T = x.size(0);
  check_tensor(fn, "out", out, {T, H}, {c.dtype});
  check_device(fn, "x", x, dev);
  check_device(fn, "out", out, dev);
  check_bound(fn, params_, false);
  require(T <= group_.config().max_tokens_per_rank, fn, "x has ", T,
          " tokens, the group was created for at most max_tokens_per_rank = ", group_.config().max_tokens_per_rank);
  if (c.router.aux_loss == AuxLossType::kSequence)
    require(T % c.router.seq_len == 0, fn, "x has ", T, " tokens, expected a multiple of router.seq_len = ",
            c.router.seq_len, " for the sequence-level aux loss");
  const DType gt = accum_dtype(c.dtype);
  const int64_t S = c.router.aux_loss == AuxLossType::kSequence ? T / c.router.seq_len : 1;

  if (!ctx.state_) ctx.state_ = std::make_unique<MoEContext::State>();
  MoEContext::State& s = *ctx.state_;
  s.num_tokens = static_cast<int>(T);
  s.x = x;
  s.used_by_backward = false;
  s.handle = Handle();  // gives the routing block back before prepare takes one (same addresses)
  auto mark = [&](const char* name) { mark_phase(dev, stream, name); };
  mark("");

  // Router.
  ensure(s.logits, {T, E}, gt, dev);
  gemm(x, params_.gate, s.logits, false, false, false, stream);
  ensure(s.topk_idx, {T, K}, DType::kI32, dev);
  ensure(s.topk_weights, {T, K}, gt, dev);
  ensure_zeros(s.stats_buffer, {2 + 2 * S * E}, gt, dev, stream);
  s.stats.scalars = sub(s.stats_buffer, 0, {2});
  s.stats.prob_sum = sub(s.stats_buffer, 2, {S, E});
  s.stats.counts = sub(s.stats_buffer, 2 + S * E, {S, E});
  route_forward(c.router, s.logits, params_.expert_bias, s.topk_idx, s.topk_weights, s.stats, stream);
  mark("fwd.gate_route");
  s.handle = prepare(group_, s.topk_idx, s.topk_weights, c.capacity, stream);
  mark("fwd.prepare");
  count_routed(c.router, s.handle.routed_experts(), s.stats, stream);
  all_reduce_sum(group_, c.router.aux_loss == AuxLossType::kSequence ? s.stats.scalars : s.stats_buffer.ref(), stream);
  ensure(s.losses, {2}, gt, dev);
  router_losses(c.router, s.stats, s.losses, stream);
  mark("fwd.stats_losses");

  // Routed experts.
  const int64_t cap = group_.recv_capacity_rows(), F = c.ffn_hidden, P = c.projections();
  ensure(s.recv_weights, {cap}, gt, dev);
  if (c.precision == MlpPrecision::kHigh) {
    ensure(s.recv_x, {cap, H}, c.dtype, dev);
    dispatch_forward(group_, s.handle, x, s.topk_weights, s.recv_x, s.recv_weights, stream);
  } else {
    // Quantize once at the source; fp8 rows and their scales travel and feed the FP8 GEMM directly.
    const QuantRecipe rr = c.precision == MlpPrecision::kFp8Block ? QuantRecipe::kFp8Block1x128 : QuantRecipe::kMxfp8Rowwise;
    ensure(s.x_q, {T, H}, DType::kF8E4M3, dev);
    ensure(s.x_scales, quant_scale_shape(rr, T, H), quant_scale_dtype(rr), dev);
    QuantOptions qo;
    qo.mx_rounding = E8M0Rounding::kCeil;  // as the expert FFN quantizes (see MlpPrecision)
    quantize(rr, x, s.x_q, s.x_scales, qo, stream);
    ensure(s.recv_x, {cap, H}, DType::kF8E4M3, dev);
    ensure(s.recv_scales, quant_scale_shape(rr, cap, H), quant_scale_dtype(rr), dev);
    dispatch_forward(group_, s.handle, s.x_q, s.x_scales, s.topk_weights, s.recv_x, s.recv_scales, s.recv_weights,
                     stream);
  }
  mark("fwd.dispatch");
  ensure(s.a, {cap, P, F}, c.dtype, dev);
  ensure(s.h, {cap, F}, c.dtype, dev);
  ensure(s.y, {cap, H}, c.dtype, dev);
  MlpConfig mc{c.activation, c.apply_weights_early, c.precision};
  MlpTensors mt{s.recv_x, s.handle.expert_offsets(), s.handle.expert_rows(),
                c.apply_weights_early ? s.recv_weights.ref() : TensorRef(),
                params_.w_in, params_.b_in, params_.w_out, params_.b_out, s.a, s.h, s.y, s.recv_scales};
  mt.row_align = group_.config().align;
  if (c.precision == MlpPrecision::kFp8Block && c.fp8_weight_cache && dev.is_cuda()) {
    if (!fp8_w_in_q_.defined()) refresh_fp8_weights(stream);
    mt.w_in_q = fp8_w_in_q_;
    mt.w_in_q_scales = fp8_w_in_scales_;
    mt.w_out_q = fp8_w_out_q_;
    mt.w_out_q_scales = fp8_w_out_scales_;
  }
  {
    detail::PhasePrefix in_ffn("fwd.ffn.");
    expert_mlp_forward(mc, mt, stream);
  }
  mark("fwd.ffn");
  combine_forward(group_, s.handle, s.y, c.apply_weights_early ? TensorRef() : s.recv_weights.ref(), out, stream);
  mark("fwd.combine");

  // Shared experts: one dense FFN over all tokens, as a one-group grouped FFN.
  if (c.shared_ffn_hidden > 0) {
    const int64_t Fs = c.shared_ffn_hidden;
    // One group of T rows; a synchronous copy, so only when T changes.
    if (s.shared_tokens != T || !(s.shared_rows.device() == dev)) {
      s.shared_offsets = device_ints({0, static_cast<int32_t>(T)}, dev);
      s.shared_rows = device_ints({static_cast<int32_t>(T)}, dev);
      s.shared_tokens = T;
    }
    ensure(s.shared_a, {T, P, Fs}, c.dtype, dev);
    ensure(s.shared_h, {T, Fs}, c.dtype, dev);
    ensure(s.shared_y, {T, H}, c.dtype, dev);
    MlpTensors st{x, s.shared_offsets, s.shared_rows, {}, params_.shared_w_in, {}, params_.shared_w_out, {},
                  s.shared_a, s.shared_h, s.shared_y};
    {
      detail::PhasePrefix in_shared("fwd.shared.");
      expert_mlp_forward(MlpConfig{c.activation, false, c.precision}, st, stream);
    }
    detail::add(out, s.shared_y, out, stream);
    mark("fwd.shared");
  }
}

void MoELayer::refresh_fp8_weights(Stream stream) {
  const char* fn = "epx::MoELayer::refresh_fp8_weights";
  require(config_.precision == MlpPrecision::kFp8Block, fn, "the layer's precision is ",
          mlp_precision_name(config_.precision), ", not fp8_block: it keeps no FP8 weights");
  check_bound(fn, params_, false);
  const Device dev = group_.device();
  if (!dev.is_cuda()) return;  // the CPU reference quantizes from the weights on every forward
  const TensorRef& w_in = params_.w_in;
  const Fp8ExpertWeightShapes s = fp8_expert_weight_shapes(w_in.size(0), w_in.size(1), w_in.size(2), w_in.size(3));
  ensure(fp8_w_in_q_, s.w_in_q, DType::kF8E4M3, dev);
  ensure(fp8_w_in_scales_, s.w_in_q_scales, DType::kF32, dev);
  ensure(fp8_w_out_q_, s.w_out_q, DType::kF8E4M3, dev);
  ensure(fp8_w_out_scales_, s.w_out_q_scales, DType::kF32, dev);
  quantize_expert_weights_fp8(w_in, params_.w_out, fp8_w_in_q_, fp8_w_in_scales_, fp8_w_out_q_, fp8_w_out_scales_,
                              stream);
}

void MoELayer::backward(MoEContext& ctx, const TensorRef& d_out, const TensorRef& d_x, double d_aux, double d_z,
                        Stream stream, bool accumulate_grads) {
  const char* fn = "epx::MoELayer::backward";
  const MoEConfig& c = config_;
  const bool acc = accumulate_grads;
  MoEContext::State& s = ctx.state();
  // Unless the config keeps them, the expert FFNs use the saved activations as their backward
  // scratch (see MlpConfig::backward_consumes_saved), so a context is backpropagated once per forward.
  const bool consume = !c.backward_keeps_saved;
  require(!(consume && s.used_by_backward), fn, "backward was already called on this context; run forward again first (backward ",
          "consumes the saved activations)");
  const Device dev = group_.device();
  const int64_t T = s.num_tokens, H = c.hidden, E = c.router.num_experts, K = c.router.topk;
  check_tensor(fn, "d_out", d_out, {T, H}, {c.dtype});
  check_tensor(fn, "d_x", d_x, {T, H}, {c.dtype});
  check_device(fn, "d_out", d_out, dev);
  check_device(fn, "d_x", d_x, dev);
  check_bound(fn, params_, false);
  check_bound(fn, grads_, true);
  // Before any work: a refusal halfway would leave some gradients accumulated and others not. The
  // other gradients are always in the accumulation dtype; the expert ones unless expert_grads_in_dtype.
  require(!acc || grads_.w_in.dtype() == accum_dtype(c.dtype), fn,
          "accumulate_grads needs fp32 expert gradients; they are ", dtype_name(grads_.w_in.dtype()),
          " (MoEConfig::expert_grads_in_dtype)");
  const DType gt = accum_dtype(c.dtype);
  const int64_t cap = group_.recv_capacity_rows();
  auto mark = [&](const char* name) { mark_phase(dev, stream, name); };
  mark("");

  // Routed experts, from the output back to the tokens.
  const Tensor& d_y = ensure(s.d_y, {cap, H}, c.dtype, dev);
  const Tensor& d_recv_weights = ensure(s.d_recv_weights, {cap}, gt, dev);
  const TensorRef combine_weights = c.apply_weights_early ? TensorRef() : s.recv_weights.ref();
  combine_backward(group_, s.handle, d_out, s.y, combine_weights, d_y,
                   c.apply_weights_early ? TensorRef() : d_recv_weights.ref(), stream);
  mark("bwd.combine");
  const Tensor& d_recv_x = ensure(s.d_recv_x, {cap, H}, c.dtype, dev);
  MlpTensors mt{s.recv_x, s.handle.expert_offsets(), s.handle.expert_rows(),
                c.apply_weights_early ? s.recv_weights.ref() : TensorRef(),
                params_.w_in, params_.b_in, params_.w_out, params_.b_out, s.a, s.h, s.y, s.recv_scales};
  MlpGrads mg{d_y, d_recv_x, c.apply_weights_early ? d_recv_weights.ref() : TensorRef(),
              grads_.w_in, grads_.b_in, grads_.w_out, grads_.b_out};
  {
    detail::PhasePrefix in_ffn("bwd.ffn.");
    expert_mlp_backward(MlpConfig{c.activation, c.apply_weights_early, c.precision, consume, acc}, mt, mg, stream);
  }
  mark("bwd.ffn");
  const Tensor& d_x_routed = ensure(s.d_x_routed, {T, H}, c.dtype, dev);
  const Tensor& d_topk_weights = ensure(s.d_topk_weights, {T, K}, gt, dev);
  dispatch_backward(group_, s.handle, d_recv_x, d_recv_weights, d_x_routed, d_topk_weights, stream);
  mark("bwd.dispatch");

  // Router and gate.
  const Tensor& d_logits = ensure(s.d_logits, {T, E}, gt, dev);
  route_backward(c.router, s.logits, params_.expert_bias, s.topk_idx, d_topk_weights, s.stats, d_aux, d_z, d_logits,
                 stream);
  const Tensor& d_logits_dt = c.dtype == gt ? d_logits : ensure(s.d_logits_dt, {T, E}, c.dtype, dev);
  if (c.dtype != gt) detail::cast(d_logits, d_logits_dt, stream);
  gemm(s.x, d_logits_dt, grads_.gate, true, false, acc, stream);
  const Tensor& d_x_acc = ensure(s.d_x_acc, {T, H}, gt, dev);
  gemm(d_logits_dt, params_.gate, d_x_acc, false, true, false, stream);
  detail::add(d_x_acc, d_x_routed, d_x_acc, stream);
  mark("bwd.route_gate");

  if (c.shared_ffn_hidden > 0) {
    const Tensor& d_x_shared = ensure(s.d_x_shared, {T, H}, c.dtype, dev);
    MlpTensors st{s.x, s.shared_offsets, s.shared_rows, {}, params_.shared_w_in, {}, params_.shared_w_out, {},
                  s.shared_a, s.shared_h, s.shared_y};
    MlpGrads sg{d_out, d_x_shared, {}, grads_.shared_w_in, {}, grads_.shared_w_out, {}};
    {
      detail::PhasePrefix in_shared("bwd.shared.");
      expert_mlp_backward(MlpConfig{c.activation, false, c.precision, consume, acc}, st, sg, stream);
    }
    detail::add(d_x_acc, d_x_shared, d_x_acc, stream);
    mark("bwd.shared");
  }
  detail::cast(d_x_acc, d_x, stream);
  mark("bwd.finish");
  s.used_by_backward = true;
}

}  // namespace epx
