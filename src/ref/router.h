// CPU reference of the router (the oracle the GPU kernels are tested against): one row of logits
// at a time, plain loops, fixed summation order, so every result is deterministic.
//
// Arithmetic: everything is computed in fp32 for fp32/bf16 logits and in fp64 for fp64 logits
// (the finite-difference checks); stats and losses follow the dtype of the stats tensors.
// The semantics are the ones written in include/epx/router.h. These functions assume the public
// entry points (src/moe/router_ops.cpp) validated shapes, dtypes, devices and the config; an
// undefined optional tensor is simply not read or written. The only checks made here are on
// DATA, which only a pass over it can see: expert ids outside [-1, E) or repeated within a row.
#pragma once

#include "epx/router.h"
#include "epx/tensor.h"

namespace epx::ref {

void route_forward(const RouterConfig& config, const TensorRef& logits, const TensorRef& expert_bias,
                   const TensorRef& topk_idx, const TensorRef& topk_weights, const RouterStats& stats);

void count_routed(const RouterConfig& config, const TensorRef& routed_experts, const RouterStats& stats);

void router_losses(const RouterConfig& config, const RouterStats& stats, const TensorRef& losses);

/// d_topk_weights may be undefined (no gradient through the weights).
void route_backward(const RouterConfig& config, const TensorRef& logits, const TensorRef& topk_idx,
                    const TensorRef& d_topk_weights, const RouterStats& stats, double d_aux, double d_z,
                    const TensorRef& d_logits);

void update_expert_bias(const TensorRef& expert_bias, const TensorRef& counts, float rate);

}  // namespace epx::ref
