// One MoE layer set up for a training step on this process's GPU, shared by `epx demo` and
// `epx bench layer`: the group (one process per GPU through the launcher variables, or a one-GPU
// group), parameters initialised on the device, inputs and a regression target, and buffers kept
// across steps so that a step allocates nothing after the first.
#pragma once

#include <cstdint>
#include <memory>

#include "epx/comm.h"
#include "epx/moe.h"
#include "epx/presets.h"

namespace epx::tools {

/// The group of this process: create_from_env when a launcher started us, else one local GPU.
Group make_gpu_group(const GroupConfig& config);
GroupConfig layer_group_config(const MoEConfig& config, int64_t tokens_per_rank);

class LayerRun {
 public:
  /// x ~ N(0, 1) and target ~ N(0, 0.5) keyed by (seed, rank): independent of how ranks are laid out.
  LayerRun(Group& group, const MoEConfig& config, int64_t tokens, uint64_t seed);

  void forward();
  /// forward, loss = 0.5 * mean over the group's tokens of |out - target|^2, backward.
  void forward_backward();
  /// forward_backward, the replicated parameters' gradients summed over the group, SGD on every
  /// parameter; returns the loss summed over ranks (synchronises: once per step).
  double train_step(double lr);
  /// {aux_loss, z_loss} of the last forward (synchronises).
  std::pair<double, double> losses() const;

  MoELayer& layer() { return layer_; }
  Group& group() { return group_; }
  int64_t tokens() const { return tokens_; }
  const Tensor& x() const { return x_; }
  const Tensor& out() const { return out_; }
  const Tensor& d_x() const { return d_x_; }
  const MoEContext& context() const { return ctx_; }
  /// FLOPs of the expert GEMMs (routed + shared) of one forward on this rank, at T*K routed rows.
  double forward_gemm_flops() const;

 private:
  Group& group_;
  MoELayer layer_;
  int64_t tokens_;
  Tensor x_, target_, out_, d_out_, d_x_, loss_;
  MoEContext ctx_;
};

}  // namespace epx::tools
