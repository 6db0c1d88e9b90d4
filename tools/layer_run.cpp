#include "tools/layer_run.h"

#include "moe/elementwise.h"
#include "tools/launch.h"

namespace epx::tools {

Group make_gpu_group(const GroupConfig& config) {
  return started_by_launcher() ? Group::create_from_env(config) : Group::create_local(config, 0);
}

GroupConfig layer_group_config(const MoEConfig& c, int64_t tokens_per_rank) {
  GroupConfig gc;
  gc.num_experts = c.router.num_experts;
  gc.hidden = c.hidden;
  gc.max_tokens_per_rank = static_cast<int>(tokens_per_rank);
  gc.max_topk = c.router.topk;
  gc.max_dtype = c.dtype;
  gc.align = 16;
  return gc;
}

LayerRun::LayerRun(Group& group, const MoEConfig& config, int64_t tokens, uint64_t seed)
    : group_(group), layer_(group, config), tokens_(tokens) {
  const Device dev = group.device();
  const int64_t H = config.hidden;
  const uint64_t r = static_cast<uint64_t>(group.rank());
  layer_.init_params(seed, 0.02);
  x_ = Tensor::empty({tokens, H}, config.dtype, dev);
  target_ = Tensor::empty({tokens, H}, config.dtype, dev);
  detail::fill_normal(x_, seed, 10 + r, 1.0);
  detail::fill_normal(target_, seed, 100000 + r, 0.5);
  out_ = Tensor::zeros({tokens, H}, config.dtype, dev);
  d_out_ = Tensor::zeros({tokens, H}, config.dtype, dev);
  d_x_ = Tensor::zeros({tokens, H}, config.dtype, dev);
  loss_ = Tensor::zeros({1}, DType::kF32, dev);
}

void LayerRun::forward() { layer_.forward(x_, out_, ctx_); }

void LayerRun::forward_backward() {
  forward();
  const double scale = 1.0 / static_cast<double>(tokens_ * group_.size());
  detail::squared_error(out_, target_, scale, d_out_, loss_);
  layer_.backward(ctx_, d_out_, d_x_);
}

double LayerRun::train_step(double lr) {
  forward_backward();
  all_reduce_sum(group_, loss_);
  MoEParams& p = layer_.params();
  const MoEParams& g = layer_.grads();
  // Replicated parameters: every rank saw different tokens, so sum as data parallelism would.
  for (const Tensor* t : {&g.gate, &g.shared_w_in, &g.shared_w_out})
    if (t->defined()) all_reduce_sum(group_, t->ref().view({t->numel()}));
  const std::pair<const Tensor*, const Tensor*> pairs[] = {{&p.gate, &g.gate},         {&p.w_in, &g.w_in},
                                                           {&p.w_out, &g.w_out},       {&p.b_in, &g.b_in},
                                                           {&p.b_out, &g.b_out},       {&p.shared_w_in, &g.shared_w_in},
                                                           {&p.shared_w_out, &g.shared_w_out}};
  for (const auto& [param, grad] : pairs)
    if (param->defined()) detail::axpy(-lr, *grad, *param);
  const RouterConfig& rc = layer_.config().router;
  if (rc.use_expert_bias && rc.aux_loss == AuxLossType::kGlobalBatch)
    update_expert_bias(p.expert_bias, ctx_.router_stats().counts.view({rc.num_experts}), 1e-3f);
  return loss_.to(Device::cpu()).item(0);
}

std::pair<double, double> LayerRun::losses() const {
  const Tensor l = ctx_.losses().to(Device::cpu());
  return {l.item(0), l.item(1)};
}

double LayerRun::forward_gemm_flops() const {
  const MoEConfig& c = layer_.config();
  const double P = c.projections(), H = static_cast<double>(c.hidden);
  const double routed_rows = static_cast<double>(tokens_) * c.router.topk;
  const double routed = 2.0 * routed_rows * H * static_cast<double>(c.ffn_hidden) * (P + 1);
  const double shared = 2.0 * static_cast<double>(tokens_) * H * static_cast<double>(c.shared_ffn_hidden) * (P + 1);
  return routed + shared;
}

}  // namespace epx::tools
