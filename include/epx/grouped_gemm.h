// Grouped GEMM and the expert FFN over the expert-major padded layout that dispatch produces.
//
// Layout. Rows of local expert j are [offsets[j], offsets[j] + rows[j]); rows up to offsets[j+1]
// are padding. offsets [G+1] and rows [G] are int32 tensors on the device (Handle::expert_offsets()
// and Handle::expert_rows()): the host never reads them, so every op here is capturable in a CUDA
// graph. Padding rows are never read as data; outputs write zeros there; rows at or past
// offsets[G] are left untouched.
//
// Precision. Products accumulate in fp32 (fp64 for fp64 inputs). A GEMM output is rounded once to
// its tensor's dtype. The FFN's FC1 epilogue works on the fp32 accumulator: a = acc + bias is
// saved (rounded) for backward, h = act(a_fp32) [* row weight when apply_weights_early] is rounded
// once; backward recomputes act and act' from the saved a.
//
// Weights. w_in [G, P, H, F] with P = 2 stacked projections for gated activations (wi_0, wi_1 on
// their own axis) or P = 1; w_out [G, F, H]; optional biases b_in [G, P, F] and b_out [G, H] are
// all given or all absent.
#pragma once

#include <cstdint>

#include "epx/tensor.h"

namespace epx {

/// Dense GEMM: c [M, N] = op(a) . op(b) (+ c when accumulate), op = transpose when asked;
/// a, b in one dtype, c fp32 or that dtype. The gate projection and the shared experts use it.
void gemm(const TensorRef& a, const TensorRef& b, const TensorRef& c, bool transpose_a = false,
          bool transpose_b = false, bool accumulate = false, Stream stream = {});

/// y [rows, N] = x [rows, K] . w[j] [K, N] for the rows of each group j.
void grouped_gemm_forward(const TensorRef& x, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                          const TensorRef& y, Stream stream = {});
/// dx [rows, K] = dy [rows, N] . w[j]^T.
void grouped_gemm_dgrad(const TensorRef& dy, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dx, Stream stream = {});
/// dw [G, K, N] (fp32 or x's dtype) = x_j^T . dy_j; with accumulate, adds into dw (fp32 only).
void grouped_gemm_wgrad(const TensorRef& x, const TensorRef& dy, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dw, bool accumulate = false, Stream stream = {});

enum class Activation : uint8_t {
  kSwiGLU,  // silu(a0) * a1
  kGeGLU,   // gelu_tanh(a0) * a1
  kGelu,    // gelu_tanh(a0)
  kRelu2,   // relu(a0)^2
};
const char* activation_name(Activation a);
inline bool is_gated(Activation a) { return a == Activation::kSwiGLU || a == Activation::kGeGLU; }

struct MlpConfig {
  Activation activation = Activation::kSwiGLU;
  bool apply_weights_early = false;  // multiply h by the row's topk weight between FC1 and FC2
};

/// Tensors of the expert FFN. Forward reads x, offsets, rows, row_weights (early only), the
/// weights; writes a (saved pre-activations [rows, P, F]), h (saved activations [rows, F]) and y.
struct MlpTensors {
  TensorRef x;            // [rows, H]
  TensorRef offsets;      // [G+1] int32
  TensorRef rows;         // [G] int32
  TensorRef row_weights;  // [rows] fp32, apply_weights_early only
  TensorRef w_in;         // [G, P, H, F]
  TensorRef b_in;         // [G, P, F] optional
  TensorRef w_out;        // [G, F, H]
  TensorRef b_out;        // [G, H] optional
  TensorRef a;            // [rows, P, F] saved
  TensorRef h;            // [rows, F] saved
  TensorRef y;            // [rows, H]
};

/// Gradients of the expert FFN. d_w_* and d_b_* are fp32 (or the weights' dtype) and OVERWRITTEN.
struct MlpGrads {
  TensorRef d_y;            // [rows, H] in
  TensorRef d_x;            // [rows, H] out
  TensorRef d_row_weights;  // [rows] fp32 out, apply_weights_early only
  TensorRef d_w_in, d_b_in, d_w_out, d_b_out;
};

void expert_mlp_forward(const MlpConfig& config, const MlpTensors& t, Stream stream = {});
void expert_mlp_backward(const MlpConfig& config, const MlpTensors& t, const MlpGrads& g, Stream stream = {});

}  // namespace epx
