// CPU reference of the expert FFN over the padded expert-major layout (the oracle the fused GPU
// kernels are tested against). The semantics, roundings and dtype rules are the ones written in
// include/epx/grouped_gemm.h; the arithmetic order is spelled out in expert_mlp.cpp.
//
// These functions assume the public entry points (src/moe/gemm_ops.cpp) validated the config,
// shapes, dtypes and devices; an undefined optional tensor (biases, row weights and their
// gradients) is simply not read or written. The only checks made here are on the offsets / rows
// DATA, all before anything is written.
#pragma once

#include "epx/grouped_gemm.h"

namespace epx::ref {

void expert_mlp_forward(const MlpConfig& config, const MlpTensors& t);

/// The activation f at (a0, a1) (a1 unused when f is not gated) and its partial derivatives in a0
/// and a1, in fp64: the reference FFN's own formulas, for tests that check GPU activations element
/// by element.
struct ActivationGrad {
  double value, d0, d1;
};
ActivationGrad activation_grad(Activation f, double a0, double a1);
void expert_mlp_backward(const MlpConfig& config, const MlpTensors& t, const MlpGrads& g);

}  // namespace epx::ref
