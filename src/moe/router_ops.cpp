// Public entry points of the router: validate the config and every argument once, then run the
// CPU reference for host tensors or the CUDA kernels (src/cuda/router) for device tensors; the
// CUDA launchers add only their own limits (E <= 512, K <= 16, G <= 16, no fp64 logits), raised as
// kNotSupported before any work is queued.
//
// Dtype rules: logits fp32, bf16 or fp64; the "float" dtype of an op (topk_weights,
// d_topk_weights and every stats tensor) is fp64 for fp64 logits and fp32 otherwise, so that one
// all-reduce sums the stats; ids int32 or int64; expert_bias fp32. Stats tensors are required
// exactly where the config's losses use them (see stats_needed), validated whenever given.
#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>

#include "core/check.h"
#include "epx/error.h"
#include "epx/router.h"
#include "ref/router.h"

#ifdef EPX_HAVE_CUDA
#include "cuda/router/router.h"
#endif

namespace epx {

using detail::check_all_on;
using detail::check_device;
using detail::check_tensor;

const char* score_function_name(ScoreFunction f) {
  switch (f) {
    case ScoreFunction::kSoftmax: return "softmax";
    case ScoreFunction::kSoftmaxAfterTopk: return "softmax_after_topk";
    case ScoreFunction::kSigmoid: return "sigmoid";
  }
  return "unknown";
}

namespace {

const char* aux_loss_name(AuxLossType t) {
  switch (t) {
    case AuxLossType::kNone: return "none";
    case AuxLossType::kGlobalBatch: return "global_batch";
    case AuxLossType::kSequence: return "sequence";
  }
  return "unknown";
}

bool finite_nonneg(float v) { return std::isfinite(v) && v >= 0; }

DType float_dtype_for(DType logits) { return logits == DType::kF64 ? DType::kF64 : DType::kF32; }

struct StatsNeed {
  bool prob_sum, counts, scalars;
};

// prob_sum and counts feed only the aux loss; scalars give T (global aux) and sum lse^2 (z).
StatsNeed stats_needed(const RouterConfig& c) {
  const bool aux = c.aux_loss != AuxLossType::kNone;
  return {aux, aux, c.aux_loss == AuxLossType::kGlobalBatch || c.z_loss_coeff > 0};
}

// Why a stats tensor is needed, for the "is missing" message.
const char* need_reason(const RouterConfig& c, const char* name) {
  if (std::string(name) == "stats.scalars" && c.aux_loss != AuxLossType::kGlobalBatch) return "z_loss_coeff > 0";
  return c.aux_loss == AuxLossType::kGlobalBatch ? "aux_loss = global_batch" : "aux_loss = sequence";
}

void check_stat(const char* fn, const RouterConfig& c, const char* name, const TensorRef& t, bool needed,
                std::initializer_list<int64_t> shape, std::initializer_list<DType> dtypes) {
  if (!needed && !t.defined()) return;
  require(t.defined(), fn, name, " is missing (", need_reason(c, name), " needs it)");
  check_tensor(fn, name, t, shape, dtypes);
}

// Sequences per batch of T tokens; in sequence mode T must split into whole sequences.
int64_t sequences(const char* fn, const RouterConfig& c, const char* name, int64_t T) {
  if (c.aux_loss != AuxLossType::kSequence) return 1;
  require(T % c.seq_len == 0, fn, name, " has ", T, " rows (tokens), expected a multiple of config.seq_len = ",
          c.seq_len, " (aux_loss = sequence)");
  return T / c.seq_len;
}

void check_bias(const char* fn, const RouterConfig& c, const TensorRef& expert_bias) {
  require(!(expert_bias.defined() && !c.use_expert_bias), fn,
          "expert_bias is given but config.use_expert_bias is false (partial bias set: enable use_expert_bias "
          "or pass no bias)");
  require(!(c.use_expert_bias && !expert_bias.defined()), fn,
          "expert_bias is missing but config.use_expert_bias is true (partial bias set: pass a bias of shape [",
          c.num_experts, "] or disable use_expert_bias)");
  if (expert_bias.defined()) check_tensor(fn, "expert_bias", expert_bias, {c.num_experts}, {DType::kF32});
}

// Device tensors reach here only in a build without the CUDA backend.
void require_host(const char* fn, Device dev) {
  require_status(dev.is_cpu(), Status::kNotSupported, fn,
                 "CUDA tensors need the CUDA backend, which this build of epx lacks");
}

}  // namespace

void RouterConfig::validate(const char* fn) const {
  require(num_experts >= 1, fn, "config.num_experts is ", num_experts, ", expected >= 1");
  require(topk >= 1 && topk <= num_experts, fn, "config.topk is ", topk, ", expected 1..", num_experts,
          " (config.num_experts)");
  require(score_function == ScoreFunction::kSoftmax || score_function == ScoreFunction::kSoftmaxAfterTopk ||
              score_function == ScoreFunction::kSigmoid,
          fn, "config.score_function is ", static_cast<int>(score_function),
          ", expected softmax, softmax_after_topk or sigmoid");
  require(num_groups >= 1 && num_experts % num_groups == 0, fn, "config.num_groups is ", num_groups,
          ", expected a divisor of config.num_experts = ", num_experts);
  require(group_topk >= 1 && group_topk <= num_groups, fn, "config.group_topk is ", group_topk, ", expected 1..",
          num_groups, " (config.num_groups)");
  require(topk <= static_cast<int64_t>(group_topk) * (num_experts / num_groups), fn, "config.topk is ", topk,
          ", more than the ", group_topk * (num_experts / num_groups), " experts in the config.group_topk = ",
          group_topk, " kept groups of ", num_experts / num_groups);
  require(std::isfinite(routed_scaling_factor) && routed_scaling_factor > 0, fn, "config.routed_scaling_factor is ",
          routed_scaling_factor, ", expected a finite value > 0");
  require(aux_loss == AuxLossType::kNone || aux_loss == AuxLossType::kGlobalBatch || aux_loss == AuxLossType::kSequence,
          fn, "config.aux_loss is ", static_cast<int>(aux_loss), ", expected none, global_batch or sequence");
  require(finite_nonneg(aux_loss_coeff), fn, "config.aux_loss_coeff is ", aux_loss_coeff,
          ", expected a finite value >= 0");
  require(finite_nonneg(z_loss_coeff), fn, "config.z_loss_coeff is ", z_loss_coeff, ", expected a finite value >= 0");
  require(seq_len >= 0, fn, "config.seq_len is ", seq_len, ", expected >= 0");
  require(aux_loss != AuxLossType::kSequence || seq_len >= 1, fn, "config.seq_len is ", seq_len,
          ", expected >= 1 (tokens per sequence) with aux_loss = ", aux_loss_name(aux_loss));
}

void route_forward(const RouterConfig& config, const TensorRef& logits, const TensorRef& expert_bias,
                   const TensorRef& topk_idx, const TensorRef& topk_weights, const RouterStats& stats,
                   Stream stream) {
  const char* fn = "epx::route_forward";
  config.validate(fn);
  const int64_t E = config.num_experts, K = config.topk;
  check_tensor(fn, "logits", logits, {-1, E}, {DType::kF32, DType::kBF16, DType::kF64});
  const int64_t T = logits.size(0);
  const DType fdt = float_dtype_for(logits.dtype());
  check_bias(fn, config, expert_bias);
  check_tensor(fn, "topk_idx", topk_idx, {T, K}, {DType::kI32, DType::kI64});
  check_tensor(fn, "topk_weights", topk_weights, {T, K}, {fdt});
  const StatsNeed need = stats_needed(config);
  const int64_t S = sequences(fn, config, "logits", T);
  check_stat(fn, config, "stats.prob_sum", stats.prob_sum, need.prob_sum, {S, E}, {fdt});
  check_stat(fn, config, "stats.scalars", stats.scalars, need.scalars, {2}, {fdt});
  check_all_on(fn, logits.device(),
               {{"expert_bias", &expert_bias}, {"topk_idx", &topk_idx}, {"topk_weights", &topk_weights},
                {"stats.prob_sum", &stats.prob_sum}, {"stats.scalars", &stats.scalars}});
#ifdef EPX_HAVE_CUDA
  if (logits.device().is_cuda())
    return cuda::route_forward(config, logits, expert_bias, topk_idx, topk_weights, stats, stream);
#endif
  require_host(fn, logits.device());
  ref::route_forward(config, logits, expert_bias, topk_idx, topk_weights, stats);
}

void count_routed(const RouterConfig& config, const TensorRef& routed_experts, const RouterStats& stats,
                  Stream stream) {
  const char* fn = "epx::count_routed";
  config.validate(fn);
  const int64_t E = config.num_experts;
  check_tensor(fn, "routed_experts", routed_experts, {-1, -1}, {DType::kI32, DType::kI64});
  const int64_t T = routed_experts.size(0);
  require(routed_experts.size(1) == config.topk, fn, "routed_experts has shape ", routed_experts.shape().str(),
          ", expected [", T, ", ", config.topk, "] (config.topk columns)");
  const int64_t S = sequences(fn, config, "routed_experts", T);
  check_tensor(fn, "stats.counts", stats.counts, {S, E}, {DType::kF32, DType::kF64});
  check_all_on(fn, routed_experts.device(), {{"stats.counts", &stats.counts}});
#ifdef EPX_HAVE_CUDA
  if (routed_experts.device().is_cuda()) return cuda::count_routed(config, routed_experts, stats, stream);
#endif
  require_host(fn, routed_experts.device());
  ref::count_routed(config, routed_experts, stats);
}

void router_losses(const RouterConfig& config, const RouterStats& stats, const TensorRef& losses, Stream stream) {
  const char* fn = "epx::router_losses";
  config.validate(fn);
  const int64_t E = config.num_experts;
  check_tensor(fn, "losses", losses, {2}, {DType::kF32, DType::kF64});
  const StatsNeed need = stats_needed(config);
  // One dtype for all stats (they are reduced together); the first given one sets it.
  DType fdt = DType::kF32;
  for (const TensorRef* t : {&stats.scalars, &stats.prob_sum, &stats.counts})
    if (t->defined()) {
      fdt = t->dtype();
      break;
    }
  const std::initializer_list<DType> fdts = {DType::kF32, DType::kF64};
  check_stat(fn, config, "stats.prob_sum", stats.prob_sum, need.prob_sum, {-1, E}, fdts);
  // Sequence mode takes S from prob_sum (sequences are rank-local); global mode has one row.
  const int64_t S = config.aux_loss == AuxLossType::kSequence ? stats.prob_sum.size(0) : 1;
  check_stat(fn, config, "stats.prob_sum", stats.prob_sum, need.prob_sum, {S, E}, {fdt});
  check_stat(fn, config, "stats.counts", stats.counts, need.counts, {S, E}, {fdt});
  check_stat(fn, config, "stats.scalars", stats.scalars, need.scalars, {2}, {fdt});
  check_all_on(fn, losses.device(),
               {{"stats.prob_sum", &stats.prob_sum}, {"stats.counts", &stats.counts}, {"stats.scalars", &stats.scalars}});
#ifdef EPX_HAVE_CUDA
  if (losses.device().is_cuda()) return cuda::router_losses(config, stats, losses, stream);
#endif
  require_host(fn, losses.device());
  ref::router_losses(config, stats, losses);
}

void route_backward(const RouterConfig& config, const TensorRef& logits, const TensorRef& expert_bias,
                    const TensorRef& topk_idx, const TensorRef& d_topk_weights, const RouterStats& stats,
                    double d_aux, double d_z, const TensorRef& d_logits, Stream stream) {
  const char* fn = "epx::route_backward";
  config.validate(fn);
  const int64_t E = config.num_experts, K = config.topk;
  check_tensor(fn, "logits", logits, {-1, E}, {DType::kF32, DType::kBF16, DType::kF64});
  const int64_t T = logits.size(0);
  const DType fdt = float_dtype_for(logits.dtype());
  // The selection is given (topk_idx), so the bias is not read; it is still checked so that a
  // partial bias set fails here exactly as in the forward.
  check_bias(fn, config, expert_bias);
  check_tensor(fn, "topk_idx", topk_idx, {T, K}, {DType::kI32, DType::kI64});
  if (d_topk_weights.defined()) check_tensor(fn, "d_topk_weights", d_topk_weights, {T, K}, {fdt});
  require(std::isfinite(d_aux), fn, "d_aux is ", d_aux, ", expected a finite number");
  require(std::isfinite(d_z), fn, "d_z is ", d_z, ", expected a finite number");
  const StatsNeed need = stats_needed(config);
  const int64_t S = sequences(fn, config, "logits", T);
  check_stat(fn, config, "stats.prob_sum", stats.prob_sum, false, {S, E}, {fdt});
  check_stat(fn, config, "stats.counts", stats.counts, need.counts, {S, E}, {fdt});
  check_stat(fn, config, "stats.scalars", stats.scalars, need.scalars, {2}, {fdt});
  check_tensor(fn, "d_logits", d_logits, {T, E}, {logits.dtype()});
  check_all_on(fn, logits.device(),
               {{"expert_bias", &expert_bias}, {"topk_idx", &topk_idx}, {"d_topk_weights", &d_topk_weights},
                {"stats.prob_sum", &stats.prob_sum}, {"stats.counts", &stats.counts},
                {"stats.scalars", &stats.scalars}, {"d_logits", &d_logits}});
#ifdef EPX_HAVE_CUDA
  if (logits.device().is_cuda())
    return cuda::route_backward(config, logits, topk_idx, d_topk_weights, stats, d_aux, d_z, d_logits, stream);
#endif
  require_host(fn, logits.device());
  ref::route_backward(config, logits, topk_idx, d_topk_weights, stats, d_aux, d_z, d_logits);
}

void update_expert_bias(const TensorRef& expert_bias, const TensorRef& counts, float rate, Stream stream) {
  const char* fn = "epx::update_expert_bias";
  check_tensor(fn, "expert_bias", expert_bias, {-1}, {DType::kF32});
  const int64_t E = expert_bias.size(0);
  require(E >= 1, fn, "expert_bias has shape ", expert_bias.shape().str(), ", expected at least one expert");
  check_tensor(fn, "counts", counts, {E}, {DType::kF32, DType::kF64});
  require(finite_nonneg(rate), fn, "rate is ", rate, ", expected a finite value >= 0");
  check_all_on(fn, expert_bias.device(), {{"counts", &counts}});
#ifdef EPX_HAVE_CUDA
  if (expert_bias.device().is_cuda()) return cuda::update_expert_bias(expert_bias, counts, rate, stream);
#endif
  require_host(fn, expert_bias.device());
  ref::update_expert_bias(expert_bias, counts, rate);
}

}  // namespace epx
