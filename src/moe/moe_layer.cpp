// The MoE layer composes the public ops; it never touches data itself, so one implementation serves
// every backend (the host reference with simulated ranks, and the GPU one).
//
// Forward:  logits = x . gate (fp32 accumulate)   -> route_forward (topk_idx, topk_weights, stats)
//           per chunk: prepare (capacity) -> dispatch_forward; then count_routed on the KEPT
//           routing -> all-reduce the statistics -> router_losses; shared experts on x; per chunk:
//           expert_mlp_forward; per chunk: combine_forward; out += shared experts' output.
// Backward: per chunk combine_backward (without row weights where the FFN computes their gradient:
//           MoEConfig::weight_grads_in_ffn); shared experts backward; per chunk expert_mlp_backward
//           (the chunks' weight gradients add up); per chunk dispatch_backward; route_backward;
//           gate: d_logits is rounded to the layer dtype for the two gate GEMMs (operands in the
//           layer dtype, as a tensor-core GEMM takes them).
// The collectives (prepare, dispatch, combine, the all-reduce) and the few ops between them run on
// `comm`, the FFNs and GEMMs on the caller's stream: with overlap_communication `comm` is the
// layer's side stream, and events order it with the caller's stream (all collectives first, so a
// chunk's dispatch never waits behind an FFN); otherwise it is the caller's stream, and the same
// order runs one op after another. Every rank issues the collectives in the same order.
// Statistics are one contiguous buffer [scalars(2) | prob_sum(S*E) | counts(S*E)] so the global-
// batch loss needs a single all-reduce; the sequence loss reduces only the scalars.
#include "epx/moe.h"

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "core/device_memory.h"
#include "core/ep_state.h"
#include "core/gemm_sm_limit.h"
#include "core/stream_order.h"
#include "epx/error.h"
#include "epx/quant.h"
#include "moe/elementwise.h"

namespace epx {

using detail::check_device;
using detail::check_tensor;

struct MoEContext::State {
  // One pipeline chunk: a slice of the tokens with its own routing and expert-major buffers.
  struct Chunk {
    int64_t begin = 0, end = 0;  // token rows [begin, end)
    Handle handle;
    Tensor recv_x, recv_scales, recv_weights, a, h, y;
    Tensor d_y, d_recv_weights, d_recv_x;  // backward scratch
  };

  int num_tokens = 0;
  TensorRef x;  // the caller's input, read again by backward (gate and shared-expert gradients)
  Tensor logits, topk_idx, topk_weights, stats_buffer, losses;
  RouterStats stats;
  std::vector<Chunk> chunks;
  Tensor x_q, x_scales;
  Tensor shared_offsets, shared_rows, shared_a, shared_h, shared_y;
  int64_t shared_tokens = -1;  // T that shared_offsets / shared_rows describe
  // Backward scratch, kept so that a reused context allocates nothing after its first step.
  Tensor d_x_routed, d_topk_weights, d_logits, d_logits_dt, d_x_acc, d_x_shared;
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
const Handle& MoEContext::handle(int chunk) const {
  const State& s = state();
  require(chunk >= 0 && chunk < static_cast<int>(s.chunks.size()), "epx::MoEContext::handle", "chunk is ", chunk,
          ", expected 0..", static_cast<int>(s.chunks.size()) - 1);
  return s.chunks[chunk].handle;
}
int MoEContext::num_chunks() const { return static_cast<int>(state().chunks.size()); }
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

// Chunk i holds token rows [i * ceil(T / n), (i + 1) * ceil(T / n)) clipped to T. The previous
// step's handles are given back first, so that prepare takes the same blocks again (addresses a
// captured graph keeps).
void split_into_chunks(MoEContext::State& s, int64_t T, int n) {
  s.chunks.resize(n);
  const int64_t per = (T + n - 1) / n;
  for (int i = 0; i < n; ++i) {
    s.chunks[i].handle = Handle();
    s.chunks[i].begin = std::min<int64_t>(T, i * per);
    s.chunks[i].end = std::min<int64_t>(T, (i + 1) * per);
  }
}

TensorRef rows_of(const TensorRef& t, const MoEContext::State::Chunk& k) { return t.slice_rows(k.begin, k.end); }

// The routed experts' FFN operands of one chunk, as forward writes them and backward reads them.
// The dispatch starts every expert's rows at a multiple of the group's align, which lets the
// GEMMs of both passes take the contiguous kernels.
MlpTensors routed_tensors(const MoEConfig& c, const MoEParams& p, const Group& group,
                          const MoEContext::State::Chunk& k) {
  MlpTensors t{k.recv_x, k.handle.expert_offsets(), k.handle.expert_rows(),
               c.apply_weights_early ? k.recv_weights.ref() : TensorRef(),
               p.w_in, p.b_in, p.w_out, p.b_out, k.a, k.h, k.y, k.recv_scales};
  t.row_align = group.config().align;
  return t;
}

// The shared experts' operands: one group of all T tokens of x.
MlpTensors shared_tensors(const TensorRef& x, const MoEParams& p, const MoEContext::State& s) {
  return MlpTensors{x, s.shared_offsets, s.shared_rows, {}, p.shared_w_in, {}, p.shared_w_out, {},
                    s.shared_a, s.shared_h, s.shared_y};
}

// Rows of a chunk's expert-major buffers: the worst case of ceil(max_tokens_per_rank / n) tokens on
// every rank (no rank's chunk is longer), and never more than the group's capacity. So n chunks
// hold about what one does, plus n - 1 more padding blocks per local expert.
int64_t chunk_capacity(const Group& group, int chunks) {
  if (chunks == 1) return group.recv_capacity_rows();
  GroupConfig c = group.config();
  c.max_tokens_per_rank = (c.max_tokens_per_rank + chunks - 1) / chunks;
  return std::min(group.recv_capacity_rows(), worst_case_recv_rows(c, group.size()));
}

// The caller's stream (`main`) runs the GEMMs and FFNs, `comm` the collectives: the layer's side
// stream with overlap_communication on a GPU, else the caller's, and then nothing needs ordering.
// Event slots: 0 fork, 1 join, 2 + 2i chunk i's collective done, 3 + 2i chunk i's FFN done.
struct Streams {
  detail::SideStream* side;
  Device dev;
  Stream main, comm;

  static int events(int chunks) { return 2 + 2 * chunks; }
  Streams(detail::SideStream* side_stream, Device device, Stream caller)
      : side(side_stream), dev(device), main(caller), comm(side ? side->stream() : caller) {}
  void fork() {
    if (!side) return;
    side->record(main, 0);
    side->wait(comm, 0);
    mark_comm("");
  }
  void join() {
    if (!side) return;
    side->record(comm, 1);
    side->wait(main, 1);
  }
  void comm_done(int i) {
    if (side) side->record(comm, 2 + 2 * i);
  }
  void main_waits(int i) {
    if (!side) return;
    side->wait(main, 2 + 2 * i);
    mark_main("");
  }
  void main_done(int i) {
    if (side) side->record(main, 3 + 2 * i);
  }
  // A start mark after the wait: the time spent waiting for the FFN counts in no phase.
  void comm_waits(int i) {
    if (!side) return;
    side->wait(comm, 3 + 2 * i);
    mark_comm("");
  }
  void mark_main(const char* name) { mark_phase(dev, main, name); }
  void mark_comm(const char* name) { mark_phase(dev, comm, name); }
};

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
  require(pipeline_chunks >= 1 && pipeline_chunks <= kMaxPipelineChunks, fn, "config.pipeline_chunks is ",
          pipeline_chunks, ", expected 1..", kMaxPipelineChunks);
  if (pipeline_chunks > 1) {
    require(capacity.capacity_factor == 0, fn, "config.pipeline_chunks is ", pipeline_chunks,
            ", which needs dropless routing (capacity.capacity_factor 0, not ", capacity.capacity_factor,
            "): the capacity is decided over the whole batch, not per chunk");
  }
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
  // Two contexts in flight, each holding a handle per chunk.
  if (config.pipeline_chunks > 1) group.state().reserve_handles(2 * static_cast<size_t>(config.pipeline_chunks) + 2);
  // Made here, not at the first forward, which may be under a CUDA graph capture.
  if (config.overlap_communication && group.device().is_cuda()) {
    comm_stream_ = std::make_unique<detail::SideStream>(group.device(), Streams::events(config.pipeline_chunks));
    const int ep_sms = group.config().num_sms;
    if (ep_sms > 0) overlap_gemm_sms_ = std::max(1, detail::device_sm_count(group.device().index) - ep_sms);
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
  split_into_chunks(s, T, c.pipeline_chunks);
  Streams st(comm_stream_.get(), dev, stream);
  const int C = c.pipeline_chunks;

  // Every buffer first: no allocation between two collectives (one process driving several GPUs
  // must not allocate while a peer's collective waits for this rank).
  const int64_t cap = chunk_capacity(group_, C), F = c.ffn_hidden, P = c.projections();
  const bool fp8 = c.precision != MlpPrecision::kHigh;
  const QuantRecipe rr =
      c.precision == MlpPrecision::kFp8Block ? QuantRecipe::kFp8Block1x128 : QuantRecipe::kMxfp8Rowwise;
  ensure(s.logits, {T, E}, gt, dev);
  ensure(s.topk_idx, {T, K}, DType::kI32, dev);
  ensure(s.topk_weights, {T, K}, gt, dev);
  ensure(s.losses, {2}, gt, dev);
  if (fp8) {
    ensure(s.x_q, {T, H}, DType::kF8E4M3, dev);
    ensure(s.x_scales, quant_scale_shape(rr, T, H), quant_scale_dtype(rr), dev);
  }
  for (MoEContext::State::Chunk& k : s.chunks) {
    ensure(k.recv_weights, {cap}, gt, dev);
    ensure(k.recv_x, {cap, H}, fp8 ? DType::kF8E4M3 : c.dtype, dev);
    if (fp8) ensure(k.recv_scales, quant_scale_shape(rr, cap, H), quant_scale_dtype(rr), dev);
    ensure(k.a, {cap, P, F}, c.dtype, dev);
    ensure(k.h, {cap, F}, c.dtype, dev);
    ensure(k.y, {cap, H}, c.dtype, dev);
  }
  const bool shared = c.shared_ffn_hidden > 0;
  if (shared) {
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
  }
  const bool cached_fp8_weights = c.precision == MlpPrecision::kFp8Block && c.fp8_weight_cache && dev.is_cuda();
  if (cached_fp8_weights && !fp8_w_in_q_.defined()) refresh_fp8_weights(stream);
  st.mark_main("");

  // Router, on every token at once.
  gemm(x, params_.gate, s.logits, false, false, false, stream);
  ensure_zeros(s.stats_buffer, {2 + 2 * S * E}, gt, dev, stream);
  s.stats.scalars = sub(s.stats_buffer, 0, {2});
  s.stats.prob_sum = sub(s.stats_buffer, 2, {S, E});
  s.stats.counts = sub(s.stats_buffer, 2 + S * E, {S, E});
  route_forward(c.router, s.logits, params_.expert_bias, s.topk_idx, s.topk_weights, s.stats, stream);
  if (fp8) {
    // Quantize once at the source; fp8 rows and their scales travel and feed the FP8 GEMM directly.
    QuantOptions qo;
    qo.mx_rounding = E8M0Rounding::kCeil;  // as the expert FFN quantizes (see MlpPrecision)
    quantize(rr, x, s.x_q, s.x_scales, qo, stream);
  }
  st.mark_main("fwd.gate_route");
  st.fork();

  // Collectives: every chunk's routing and dispatch, then the statistics (the losses are read
  // after the layer only).
  for (int i = 0; i < C; ++i) {
    MoEContext::State::Chunk& k = s.chunks[i];
    PrepareOptions po = c.capacity;
    po.recv_capacity_rows = C > 1 ? cap : 0;
    k.handle = prepare(group_, rows_of(s.topk_idx, k), rows_of(s.topk_weights, k), po, st.comm);
    st.mark_comm("fwd.prepare");
    if (fp8)
      dispatch_forward(group_, k.handle, rows_of(s.x_q, k), rows_of(s.x_scales, k), rows_of(s.topk_weights, k),
                       k.recv_x, k.recv_scales, k.recv_weights, st.comm);
    else
      dispatch_forward(group_, k.handle, rows_of(x, k), rows_of(s.topk_weights, k), k.recv_x, k.recv_weights, st.comm);
    st.mark_comm("fwd.dispatch");
    st.comm_done(i);
  }
  // Dropless chunks keep every routed pair, so the counts come from the router's own output.
  count_routed(c.router, C == 1 ? s.chunks[0].handle.routed_experts() : s.topk_idx.ref(), s.stats, st.comm);
  all_reduce_sum(group_, c.router.aux_loss == AuxLossType::kSequence ? s.stats.scalars : s.stats_buffer.ref(), st.comm);
  router_losses(c.router, s.stats, s.losses, st.comm);
  st.mark_comm("fwd.stats_losses");

  // Shared experts: one dense FFN over all tokens (a one-group grouped FFN), while the tokens travel.
  if (shared) {
    {
      detail::PhasePrefix in_shared("fwd.shared.");
      const detail::GemmSmLimit beside_dispatch(overlap_gemm_sms_);
      expert_mlp_forward(MlpConfig{c.activation, false, c.precision}, shared_tensors(x, params_, s), stream);
    }
    st.mark_main("fwd.shared");
  }

  // Routed experts, chunk by chunk as their tokens arrive. Only with other chunks is there
  // communication beside them to leave SMs to.
  const int beside_other_chunks = C > 1 ? overlap_gemm_sms_ : 0;
  for (int i = 0; i < C; ++i) {
    MoEContext::State::Chunk& k = s.chunks[i];
    st.main_waits(i);
    MlpTensors mt = routed_tensors(c, params_, group_, k);
    if (cached_fp8_weights) {
      mt.w_in_q = fp8_w_in_q_;
      mt.w_in_q_scales = fp8_w_in_scales_;
      mt.w_out_q = fp8_w_out_q_;
      mt.w_out_q_scales = fp8_w_out_scales_;
    }
    {
      detail::PhasePrefix in_ffn("fwd.ffn.");
      const detail::GemmSmLimit beside_collectives(beside_other_chunks);
      expert_mlp_forward(MlpConfig{c.activation, c.apply_weights_early, c.precision}, mt, stream);
    }
    st.mark_main("fwd.ffn");
    st.main_done(i);
  }
  for (int i = 0; i < C; ++i) {
    MoEContext::State::Chunk& k = s.chunks[i];
    st.comm_waits(i);
    combine_forward(group_, k.handle, k.y, c.apply_weights_early ? TensorRef() : k.recv_weights.ref(), rows_of(out, k),
                    st.comm);
    st.mark_comm("fwd.combine");
  }
  st.join();
  if (shared) {
    detail::add(out, s.shared_y, out, stream);
    st.mark_main("fwd.shared_add");
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
  const int C = static_cast<int>(s.chunks.size());
  const int64_t cap = chunk_capacity(group_, C);
  Streams st(comm_stream_.get(), dev, stream);

  // The row weights' gradient through FC2 (see MoEConfig::weight_grads_in_ffn): y is not read again,
  // so d_y takes its buffer.
  const bool early = c.apply_weights_early;
  const bool in_ffn = !early && c.weight_grads_in_ffn && !c.expert_bias_terms;
  auto d_y_of = [&](const MoEContext::State::Chunk& k) { return in_ffn ? k.y.ref() : k.d_y.ref(); };
  // A backward that consumes the saved tensors lets d_recv_x take recv_x's place where both have the
  // layer dtype (the FFN reads x before it writes d_x; an FP8 forward's recv_x is fp8).
  const bool d_x_over_x = consume && c.precision == MlpPrecision::kHigh;
  auto d_recv_x_of = [&](const MoEContext::State::Chunk& k) { return d_x_over_x ? k.recv_x.ref() : k.d_recv_x.ref(); };
  // Every buffer first (see forward).
  for (MoEContext::State::Chunk& k : s.chunks) {
    if (in_ffn) k.d_y = Tensor();
    else ensure(k.d_y, {cap, H}, c.dtype, dev);
    ensure(k.d_recv_weights, {cap}, gt, dev);
    if (d_x_over_x) k.d_recv_x = Tensor();
    else ensure(k.d_recv_x, {cap, H}, c.dtype, dev);
  }
  const Tensor& d_x_routed = ensure(s.d_x_routed, {T, H}, c.dtype, dev);
  const Tensor& d_topk_weights = ensure(s.d_topk_weights, {T, K}, gt, dev);
  const Tensor& d_logits = ensure(s.d_logits, {T, E}, gt, dev);
  const Tensor& d_logits_dt = c.dtype == gt ? d_logits : ensure(s.d_logits_dt, {T, E}, c.dtype, dev);
  const Tensor& d_x_acc = ensure(s.d_x_acc, {T, H}, gt, dev);
  const bool shared = c.shared_ffn_hidden > 0;
  if (shared) ensure(s.d_x_shared, {T, H}, c.dtype, dev);
  st.mark_main("");
  st.fork();

  // Every chunk's output gradient to its experts.
  for (int i = 0; i < C; ++i) {
    MoEContext::State::Chunk& k = s.chunks[i];
    const bool weighted = !early && !in_ffn;
    combine_backward(group_, k.handle, rows_of(d_out, k), weighted ? k.y.ref() : TensorRef(),
                     weighted ? k.recv_weights.ref() : TensorRef(), d_y_of(k),
                     weighted ? k.d_recv_weights.ref() : TensorRef(), st.comm);
    st.mark_comm("bwd.combine");
    st.comm_done(i);
  }

  // Shared experts, while the gradients travel.
  if (shared) {
    MlpGrads sg{d_out, s.d_x_shared, {}, grads_.shared_w_in, {}, grads_.shared_w_out, {}};
    {
      detail::PhasePrefix in_shared("bwd.shared.");
      const detail::GemmSmLimit beside_combine(overlap_gemm_sms_);
      expert_mlp_backward(MlpConfig{c.activation, false, c.precision, consume, acc}, shared_tensors(s.x, params_, s),
                          sg, stream);
    }
    st.mark_main("bwd.shared");
  }

  // Routed experts chunk by chunk; the weight gradients of the chunks after the first add to the first's.
  const int beside_other_chunks = C > 1 ? overlap_gemm_sms_ : 0;
  for (int i = 0; i < C; ++i) {
    MoEContext::State::Chunk& k = s.chunks[i];
    st.main_waits(i);
    MlpTensors mt = routed_tensors(c, params_, group_, k);
    if (in_ffn) mt.row_weights = k.recv_weights;
    MlpGrads mg{d_y_of(k), d_recv_x_of(k), early || in_ffn ? k.d_recv_weights.ref() : TensorRef(),
                grads_.w_in, grads_.b_in, grads_.w_out, grads_.b_out};
    {
      detail::PhasePrefix in_ffn_phase("bwd.ffn.");
      MlpConfig mc{c.activation, c.apply_weights_early, c.precision, consume, acc || i > 0};
      mc.accumulate_in_weight_dtype = i > 0;  // bf16 expert gradients: one rounding per chunk
      mc.combine_weight_grads = in_ffn;
      const detail::GemmSmLimit beside_collectives(beside_other_chunks);
      expert_mlp_backward(mc, mt, mg, stream);
    }
    st.mark_main("bwd.ffn");
    st.main_done(i);
  }
  for (int i = 0; i < C; ++i) {
    MoEContext::State::Chunk& k = s.chunks[i];
    st.comm_waits(i);
    dispatch_backward(group_, k.handle, d_recv_x_of(k), k.d_recv_weights, rows_of(d_x_routed, k),
                      rows_of(d_topk_weights, k), st.comm);
    st.mark_comm("bwd.dispatch");
  }
  st.join();

  // Router and gate.
  route_backward(c.router, s.logits, params_.expert_bias, s.topk_idx, d_topk_weights, s.stats, d_aux, d_z, d_logits,
                 stream);
  if (c.dtype != gt) detail::cast(d_logits, d_logits_dt, stream);
  gemm(s.x, d_logits_dt, grads_.gate, true, false, acc, stream);
  gemm(d_logits_dt, params_.gate, d_x_acc, false, true, false, stream);
  // d_x = round((gate's + routed) + shared) in one pass (no fp32 partial sums written back).
  if (shared) detail::add(d_x_acc, d_x_routed, s.d_x_shared, d_x, stream);
  else detail::add(d_x_acc, d_x_routed, d_x, stream);
  st.mark_main("bwd.route_gate");
  s.used_by_backward = true;
}

}  // namespace epx
