// Grouped GEMM and the expert FFN over the expert-major padded layout that dispatch produces.
//
// Layout. Rows of local expert j are [offsets[j], offsets[j] + rows[j]); rows up to offsets[j+1]
// are padding. offsets [G+1] and rows [G] are int32 tensors on the device (Handle::expert_offsets()
// and Handle::expert_rows()): the host never reads them, so every op here is capturable in a CUDA
// graph. Their values must satisfy offsets[0] = 0, rows[j] >= 0, offsets[j] + rows[j] <=
// offsets[j+1] and offsets[G] <= the tensors' row count; a violation is an epx::Error naming the
// group and the values (raised before any output is written by the CPU reference). Padding rows
// are never read as data; outputs write zeros there; rows at or past offsets[G] are left untouched.
// Empty groups, G = 1 and a row count of 0 are all valid.
//
// Precision. Products accumulate in fp32 (fp64 when the inputs are fp64, for finite-difference
// checks), over the reduction index in ascending order in the CPU reference. A GEMM output is
// rounded once to its tensor's dtype; with `accumulate`, old + acc is formed in the accumulator
// precision and rounded once. The FFN's FC1 epilogue works on the fp32 accumulator: acc = x.w_in
// (+ b_in) is saved rounded as `a` for backward, h = act(acc) [* row weight when
// apply_weights_early] is computed from the UNROUNDED acc and rounded once, FC2 reads that rounded
// h; backward recomputes act and act' from the saved (rounded) a.
//
// Weights. w_in [G, H, P, F] with P = 2 stacked projections for gated activations (wi_0, wi_1
// side by side in each row, so FC1 is ONE GEMM of N = P*F per expert: [H, P*F]) or P = 1;
// w_out [G, F, H]; optional biases b_in [G, P, F] and b_out [G, H] are
// both given or both absent (one without the other is an error, never a silent zero).
//
// Dtypes. Data (x, weights, biases, a, h, y, d_y, d_x) in one of bf16, fp16, fp32, fp64.
// The dense GEMM's c, wgrad's dw and the FFN's weight and bias gradients are fp32 or the inputs'
// dtype. Row weights and their gradient are fp32, or fp64 when the data is fp64.
#pragma once

#include <cstdint>

#include "epx/tensor.h"

namespace epx {

/// Dense GEMM: c [M, N] = op(a) . op(b) (+ c when accumulate), op = transpose when asked, so a is
/// [M, K] ([K, M] transposed) and b is [K, N] ([N, K] transposed); a, b in one dtype, c fp32 or that
/// dtype; accumulate needs a wide c (fp32, or fp64 for fp64 inputs). The gate projection and the
/// shared experts use it.
void gemm(const TensorRef& a, const TensorRef& b, const TensorRef& c, bool transpose_a = false,
          bool transpose_b = false, bool accumulate = false, Stream stream = {});

/// y [rows, N] = x [rows, K] . w[j] [K, N] for the rows of each group j; x, w, y in one dtype.
/// row_align: what the caller guarantees of the layout, every offsets[j] a multiple of it (checked on
/// the CPU); with a multiple of 128 the GPU runs one GEMM over all rows whose tiles each load their
/// group's weights (no per-group setup inside the kernel; the same results). A wrong guarantee gives
/// wrong rows, never a write outside y.
void grouped_gemm_forward(const TensorRef& x, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                          const TensorRef& y, Stream stream = {}, int64_t row_align = 1);
/// dx [rows, K] = dy [rows, N] . w[j]^T; dy, w, dx in one dtype; row_align as grouped_gemm_forward's.
void grouped_gemm_dgrad(const TensorRef& dy, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dx, Stream stream = {}, int64_t row_align = 1);
/// dw [G, K, N] (fp32 or x's dtype) = x_j^T . dy_j over the group's real rows (zeros for an empty
/// group); with accumulate, adds into dw (fp32, or fp64 for fp64 inputs), and an empty group leaves
/// dw[j] as it was.
void grouped_gemm_wgrad(const TensorRef& x, const TensorRef& dy, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dw, bool accumulate = false, Stream stream = {});

/// FP8 expert weights for grouped_gemm_forward_fp8: w [G, K, N] (bf16, fp16 or fp32) -> w_q
/// [G, N, K] fp8_e4m3, each w[j] TRANSPOSED (K contiguous: Hopper's FP8 tensor cores read both
/// operands K-major), and w_scales [G, K/128, N/128] fp32, epx/quant.h's 128x128 block recipe of
/// w[j] [K, N] bit for bit. K and N multiples of 128. Meant to run once per weight update.
void quantize_grouped_weights_fp8(const TensorRef& w, const TensorRef& w_q, const TensorRef& w_scales,
                                  Stream stream = {});
/// y [rows, N] bf16 (or fp32 on the CPU) = x . w[j] per group from FP8 operands: x_q [rows, K]
/// fp8_e4m3 with x_scales [rows, K/128] fp32 (quantize() with kFp8Block1x128), w_q / w_scales from
/// quantize_grouped_weights_fp8. DeepSeek-V3's recipe: per 128-deep K block, the products of the
/// e4m3 values are summed in fp32, the block sum is multiplied by the product of the two block
/// scales and added to an fp32 total, rounded once. The tensor cores' block sums keep fewer bits
/// than fp32 (Hopper's FP8 MMA), so GPU and reference agree to a relative ~1e-3, not bit for bit.
/// Padding rows of y are zeros. K and N multiples of 128. row_align as grouped_gemm_forward's.
void grouped_gemm_forward_fp8(const TensorRef& x_q, const TensorRef& x_scales, const TensorRef& w_q,
                              const TensorRef& w_scales, const TensorRef& offsets, const TensorRef& rows,
                              const TensorRef& y, Stream stream = {}, int64_t row_align = 1);

/// The FP8 copies of an expert FFN's weights that MlpTensors::w_in_q ... take (its FP8 block
/// forward's operands): w_in [G, H, P, F] as [G, H, P*F] and w_out [G, F, H], each through
/// quantize_grouped_weights_fp8. F must be a multiple of 128 (no block straddles two projections),
/// H too. fp8_expert_weight_shapes gives the four shapes.
struct Fp8ExpertWeightShapes {
  Shape w_in_q, w_in_q_scales, w_out_q, w_out_q_scales;
};
Fp8ExpertWeightShapes fp8_expert_weight_shapes(int64_t G, int64_t H, int64_t P, int64_t F);
void quantize_expert_weights_fp8(const TensorRef& w_in, const TensorRef& w_out, const TensorRef& w_in_q,
                                 const TensorRef& w_in_q_scales, const TensorRef& w_out_q,
                                 const TensorRef& w_out_q_scales, Stream stream = {});

enum class Activation : uint8_t {
  kSwiGLU,  // silu(a0) * a1,       silu(z) = z / (1 + exp(-z))
  kGeGLU,   // gelu_tanh(a0) * a1,  gelu_tanh(z) = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))
  kGelu,    // gelu_tanh(a0)
  kRelu2,   // relu(a0)^2
};
/// "swiglu", "geglu", "gelu", "relu2" (stable: used in messages and JSON).
const char* activation_name(Activation a);
inline bool is_gated(Activation a) { return a == Activation::kSwiGLU || a == Activation::kGeGLU; }

/// Forward precision of the two expert GEMMs. Backward always runs in high precision: from the
/// saved a and h (not quantized), the unquantized weights, and x as the forward saw it.
enum class MlpPrecision : uint8_t {
  kHigh,      // operands in the tensors' dtype
  kFp8Block,  // DeepSeek-V3 recipe: activations 1x128, weights 128x128 blocks, e4m3, fp32 scales
  kMxfp8,     // OCP MXFP8: 32-element blocks along the contraction dim, e8m0 scales rounded up (kCeil)
};
const char* mlp_precision_name(MlpPrecision p);

struct MlpConfig {
  Activation activation = Activation::kSwiGLU;
  bool apply_weights_early = false;  // multiply h by the row's topk weight between FC1 and FC2
  /// With kFp8Block / kMxfp8 each GEMM sees its inputs quantized (x rows and h rows with the
  /// activation recipe, w_in[j, p] and w_out[j] with the weight recipe, blocks along the
  /// contraction dim), i.e. an FP8 GEMM with fp32 accumulation. x may arrive already quantized
  /// (fp8_e4m3 with x_scales, as a quantized dispatch delivers it); otherwise it is quantized here.
  MlpPrecision precision = MlpPrecision::kHigh;
  /// Backward may use the saved a and h as its scratch (d_a over a, d_h over h), leaving them
  /// overwritten: no extra [rows, (P+1)*F] buffers. A layer whose context is backpropagated once
  /// sets it; the results are the same.
  bool backward_consumes_saved = false;
  /// Backward adds the weight (and bias) gradients to what d_w_in / d_w_out (d_b_in / d_b_out)
  /// hold instead of overwriting them: gradient accumulation over microbatches without a second
  /// gradient buffer or an extra pass (the GPU wgrad adds in its epilogue). Needs fp32 gradients
  /// (fp64 for fp64 weights); an expert without rows keeps its gradient as it was.
  bool accumulate_weight_grads = false;
  /// Lets accumulate_weight_grads add into gradients in the weights' own dtype (bf16, fp16):
  /// round(old + sum) with the sum in fp32, so one more rounding per call. For a bounded number of
  /// calls, such as a layer's pipeline chunks; many microbatches belong in fp32 gradients.
  bool accumulate_in_weight_dtype = false;
  /// Backward only, with apply_weights_early off: the combine weights each expert output row
  /// (out[t] += w_row * y[row]) and its backward handed over d_y UNWEIGHTED (combine_backward
  /// without row weights). Backward then reads row_weights and writes d_row_weights =
  /// <d_out[t], y[row]> computed through FC2 as <d_y . w_out^T, act(a)> (F wide instead of H wide,
  /// and y need not be kept), and applies the weight itself: d_h = w_row * (d_y . w_out^T), and
  /// d_w_out from the rows round(w_row * round(act(a))) (the activation recomputed from the saved a)
  /// with d_y. Mathematically the same gradients as weighting d_y in combine_backward; not for layers
  /// with biases (b_out would add <d_out[t], b_out> to the dot).
  bool combine_weight_grads = false;
};

/// Tensors of the expert FFN. Forward reads x, offsets, rows, row_weights (early only), the
/// weights; writes a (saved pre-activations [rows, P, F]), h (saved activations [rows, F]) and y.
/// Backward reads x, offsets, rows, row_weights (early or combine_weight_grads), w_in, w_out, a and
/// h; the biases only tell it whether bias gradients are expected; y is not read (it may be left
/// undefined). row_weights is given exactly when apply_weights_early (forward) or either of
/// apply_weights_early and combine_weight_grads (backward).
struct MlpTensors {
  TensorRef x;            // [rows, H] (fp8_e4m3 with x_scales under an FP8 precision)
  TensorRef offsets;      // [G+1] int32
  TensorRef rows;         // [G] int32
  TensorRef row_weights;  // [rows] fp32 (fp64 with fp64 data), apply_weights_early / combine_weight_grads
  TensorRef w_in;         // [G, H, P, F]
  TensorRef b_in;         // [G, P, F] optional
  TensorRef w_out;        // [G, F, H]
  TensorRef b_out;        // [G, H] optional
  TensorRef a;            // [rows, P, F] saved
  TensorRef h;            // [rows, F] saved
  TensorRef y;            // [rows, H]
  TensorRef x_scales;     // [rows, S] with an fp8 x: fp32 S = ceil(H/128) (kFp8Block), e8m0 S = ceil(H/32) (kMxfp8)
  /// kFp8Block only, all four or none: the weights as quantize_expert_weights_fp8 makes them
  /// (shapes: fp8_expert_weight_shapes). The GPU forward then skips quantizing the weights on every call
  /// (the CPU reference always quantizes w_in / w_out itself): they MUST be the current weights'.
  TensorRef w_in_q, w_in_q_scales, w_out_q, w_out_q_scales;
  /// What the caller guarantees of the layout: every offsets[j] is a multiple of it (dispatch's
  /// align). A multiple of 128 lets the GPU forward GEMMs run one GEMM over all rows
  /// (grouped_gemm_forward); the results are the same.
  int64_t row_align = 1;
};

/// Gradients of the expert FFN, all OVERWRITTEN. d_y and d_x have x's dtype; d_x and d_row_weights
/// are zero on padding rows. d_w_* and d_b_* are fp32 (or the weights' dtype); d_b_* are given
/// exactly when the layer has biases, d_row_weights exactly when apply_weights_early or
/// combine_weight_grads.
struct MlpGrads {
  TensorRef d_y;            // [rows, H] in
  TensorRef d_x;            // [rows, H] out; may be x itself (x is read only before d_x is written)
  TensorRef d_row_weights;  // [rows] fp32 (fp64 with fp64 data) out, apply_weights_early / combine_weight_grads
  TensorRef d_w_in, d_b_in, d_w_out, d_b_out;
  /// Optional [rows, (P+1)*F] in the data dtype: where the GPU backward keeps d_h and d_a when it
  /// may not overwrite a and h (MlpConfig::backward_consumes_saved off). Without it they live in a
  /// per-device scratch that every caller on the device shares (one stream at a time).
  TensorRef workspace;
};

void expert_mlp_forward(const MlpConfig& config, const MlpTensors& t, Stream stream = {});
void expert_mlp_backward(const MlpConfig& config, const MlpTensors& t, const MlpGrads& g, Stream stream = {});

}  // namespace epx
