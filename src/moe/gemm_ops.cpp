// Public entry points of the dense GEMM, the grouped GEMM and the expert FFN: validate every
// argument once, then run the CPU reference for host tensors (the CUDA kernels will plug in where
// CUDA tensors are refused).
//
// Dtype rules (include/epx/grouped_gemm.h): data in bf16, fp16, fp32 or fp64, one dtype per op;
// gemm's c, wgrad's dw and the FFN's weight and bias gradients may be fp32 instead (logits and
// optimizer-side gradients are fp32); `accumulate` needs a wide output (fp32, or fp64 for fp64
// data) because adding into a narrow one would round the running sum at every step; row weights
// and their gradient are fp32, fp64 for fp64 data. The group count G is taken from `rows`, so the
// weights are checked against a fully known shape. offsets [G+1] / rows [G] are int32 whose VALUES
// live on the device: only the reference (or a kernel) can check them, so they are checked there,
// before anything is written.
#include <initializer_list>
#include <utility>

#include "core/check.h"
#include "epx/error.h"
#include "epx/grouped_gemm.h"
#include "ref/expert_mlp.h"
#include "ref/grouped_gemm.h"
#ifdef EPX_HAVE_CUDA
#include "cuda/gemm/dense_gemm.h"
#include "cuda/gemm/expert_mlp_cuda.h"
#endif

namespace epx {

using detail::check_all_on;
using detail::check_device;
using detail::check_tensor;

const char* mlp_precision_name(MlpPrecision p) {
  switch (p) {
    case MlpPrecision::kHigh: return "high";
    case MlpPrecision::kFp8Block: return "fp8_block";
    case MlpPrecision::kMxfp8: return "mxfp8";
  }
  return "unknown";
}

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::kSwiGLU: return "swiglu";
    case Activation::kGeGLU: return "geglu";
    case Activation::kGelu: return "gelu";
    case Activation::kRelu2: return "relu2";
  }
  return "unknown";
}

namespace {

constexpr std::initializer_list<DType> kDataTypes = {DType::kBF16, DType::kF16, DType::kF32, DType::kF64};

bool is_wide(DType t) { return t == DType::kF32 || t == DType::kF64; }

// An output that may be fp32 or the data dtype (listing fp32 once when they coincide).
void check_wide_or_same(const char* fn, const char* name, const TensorRef& t, std::initializer_list<int64_t> shape,
                        DType data) {
  if (data == DType::kF32)
    check_tensor(fn, name, t, shape, {DType::kF32});
  else
    check_tensor(fn, name, t, shape, {DType::kF32, data});
}

DType float_dtype_for(DType data) { return data == DType::kF64 ? DType::kF64 : DType::kF32; }

// G from `rows`: "w has shape [8, 512, 256], expected [8, 512, 128]" beats "expected [*, 512, *]".
int64_t check_layout(const char* fn, const TensorRef& offsets, const TensorRef& rows) {
  check_tensor(fn, "rows", rows, {-1}, {DType::kI32});
  const int64_t G = rows.size(0);
  check_tensor(fn, "offsets", offsets, {G + 1}, {DType::kI32});
  return G;
}

void require_host(const char* fn, Device dev) {
  require_status(dev.is_cpu(), Status::kNotSupported, fn, "CUDA tensors are not supported by this op yet");
}

void check_accumulate(const char* fn, const char* name, const TensorRef& out, bool accumulate) {
  require(!accumulate || is_wide(out.dtype()), fn, "accumulate needs an fp32 ", name, " (fp64 for fp64 inputs), ",
          name, " has dtype ", dtype_name(out.dtype()));
}

// ---- expert FFN ----------------------------------------------------------------------------------

struct MlpDims {
  int64_t R = 0, H = 0, G = 0, P = 0, F = 0;
  bool bias = false;
};

// The layout guarantee a caller gives the forward GEMMs (row_align), checked where the offsets are on
// the host; the GPU path relies on it unchecked.
void check_row_align(const char* fn, const TensorRef& offsets, int64_t G, int64_t row_align) {
  for (int64_t j = 0; j < G; ++j)
    require(offsets.ptr<int32_t>()[j] % row_align == 0, fn, "offsets[", j, "] is ", offsets.ptr<int32_t>()[j],
            ", not a multiple of row_align = ", row_align);
}

MlpDims check_mlp_tensors(const char* fn, const MlpConfig& c, const MlpTensors& t, bool backward) {
  const int act = static_cast<int>(c.activation);
  require(act >= 0 && act <= static_cast<int>(Activation::kRelu2), fn, "config.activation is ", act,
          ", expected swiglu, geglu, gelu or relu2");
  const int prec = static_cast<int>(c.precision);
  require(prec >= 0 && prec <= static_cast<int>(MlpPrecision::kMxfp8), fn, "config.precision is ", prec,
          ", expected high, fp8_block or mxfp8");
  MlpDims d;
  // An already quantized x (fp8 + scales from a quantized dispatch) leaves the data dtype to w_in.
  const bool x_fp8 = t.x.defined() && t.x.dtype() == DType::kF8E4M3;
  if (x_fp8) {
    require(c.precision != MlpPrecision::kHigh, fn,
            "x has dtype fp8_e4m3 but config.precision is high (an fp8 x needs precision fp8_block or mxfp8)");
    check_tensor(fn, "x", t.x, {-1, -1}, {DType::kF8E4M3});
  } else {
    check_tensor(fn, "x", t.x, {-1, -1}, kDataTypes);
    require(!t.x_scales.defined(), fn, "x_scales is given but x has dtype ", dtype_name(t.x.dtype()),
            " (scales go with an fp8_e4m3 x)");
  }
  d.R = t.x.size(0);
  d.H = t.x.size(1);
  if (x_fp8) {
    const bool block = c.precision == MlpPrecision::kFp8Block;
    const int64_t S = block ? (d.H + 127) / 128 : (d.H + 31) / 32;
    check_tensor(fn, "x_scales", t.x_scales, {d.R, S}, {block ? DType::kF32 : DType::kE8M0});
    check_tensor(fn, "w_in", t.w_in, {-1, d.H, -1, -1}, {DType::kBF16, DType::kF16, DType::kF32});
  }
  const DType dt = x_fp8 ? t.w_in.dtype() : t.x.dtype();
  require(c.precision == MlpPrecision::kHigh || dt != DType::kF64, fn,
          "config.precision is ", mlp_precision_name(c.precision), ", which needs bf16, fp16 or fp32 data, not fp64");
  d.P = is_gated(c.activation) ? 2 : 1;
  d.G = check_layout(fn, t.offsets, t.rows);
  require(t.row_align >= 1, fn, "row_align is ", t.row_align, ", expected >= 1");
  check_tensor(fn, "w_in", t.w_in, {d.G, d.H, -1, -1}, {dt});
  d.F = t.w_in.size(3);
  require(t.w_in.size(2) == d.P, fn, "w_in has shape ", t.w_in.shape().str(), ", expected [", d.G, ", ", d.H, ", ",
          d.P, ", ", d.F, "] for ", activation_name(c.activation),
          d.P == 2 ? " (a gated activation stacks its two input projections on axis 2)"
                   : " (one input projection on axis 2)");
  check_tensor(fn, "w_out", t.w_out, {d.G, d.F, d.H}, {dt});

  require(t.b_in.defined() == t.b_out.defined(), fn, "partial bias set: ",
          t.b_in.defined() ? "b_in is given but b_out is missing" : "b_out is given but b_in is missing",
          " (give both biases or neither)");
  d.bias = t.b_in.defined();
  if (d.bias) {
    check_tensor(fn, "b_in", t.b_in, {d.G, d.P, d.F}, {dt});
    check_tensor(fn, "b_out", t.b_out, {d.G, d.H}, {dt});
  }
  require(!(c.apply_weights_early && c.combine_weight_grads), fn,
          "config.apply_weights_early and config.combine_weight_grads are both set (the second is for weights applied "
          "in combine, after FC2)");
  if (c.apply_weights_early)
    require(t.row_weights.defined(), fn,
            "row_weights is missing (config.apply_weights_early multiplies h by each row's topk weight)");
  else if (backward && c.combine_weight_grads)
    require(t.row_weights.defined(), fn,
            "row_weights is missing (config.combine_weight_grads: backward weights d_y's rows and computes their "
            "gradient)");
  else
    require(!t.row_weights.defined(), fn,
            "row_weights is given but config.apply_weights_early is false (the weights are then applied in combine)");
  if (t.row_weights.defined()) check_tensor(fn, "row_weights", t.row_weights, {d.R}, {float_dtype_for(dt)});
  check_tensor(fn, "a", t.a, {d.R, d.P, d.F}, {dt});
  check_tensor(fn, "h", t.h, {d.R, d.F}, {dt});
  const int n_fp8_w = t.w_in_q.defined() + t.w_in_q_scales.defined() + t.w_out_q.defined() + t.w_out_q_scales.defined();
  if (n_fp8_w > 0) {
    require(n_fp8_w == 4 && c.precision == MlpPrecision::kFp8Block, fn, "pre-quantized weights (w_in_q, w_in_q_scales, ",
            "w_out_q, w_out_q_scales) go all four together and with precision fp8_block; ", n_fp8_w,
            " given with precision ", mlp_precision_name(c.precision));
    const Fp8ExpertWeightShapes s = fp8_expert_weight_shapes(d.G, d.H, d.P, d.F);
    auto check = [&](const char* name, const TensorRef& q, const Shape& shape, DType dtype) {
      check_tensor(fn, name, q, {shape[0], shape[1], shape[2]}, {dtype});
    };
    check("w_in_q", t.w_in_q, s.w_in_q, DType::kF8E4M3);
    check("w_in_q_scales", t.w_in_q_scales, s.w_in_q_scales, DType::kF32);
    check("w_out_q", t.w_out_q, s.w_out_q, DType::kF8E4M3);
    check("w_out_q_scales", t.w_out_q_scales, s.w_out_q_scales, DType::kF32);
    check_all_on(fn, t.w_in.device(), {{"w_in_q", &t.w_in_q}, {"w_in_q_scales", &t.w_in_q_scales},
                                       {"w_out_q", &t.w_out_q}, {"w_out_q_scales", &t.w_out_q_scales}});
  }
  return d;
}

void check_mlp_devices(const char* fn, const MlpTensors& t, const MlpGrads* g) {
  const Device dev = t.x.device();
  check_all_on(fn, dev,
               {{"x_scales", &t.x_scales}, {"offsets", &t.offsets}, {"rows", &t.rows}, {"row_weights", &t.row_weights}, {"w_in", &t.w_in},
                {"b_in", &t.b_in}, {"w_out", &t.w_out}, {"b_out", &t.b_out}, {"a", &t.a}, {"h", &t.h}, {"y", &t.y}});
  if (g)
    check_all_on(fn, dev,
                 {{"d_y", &g->d_y}, {"d_x", &g->d_x}, {"d_row_weights", &g->d_row_weights}, {"d_w_in", &g->d_w_in},
                  {"d_b_in", &g->d_b_in}, {"d_w_out", &g->d_w_out}, {"d_b_out", &g->d_b_out}});
}

}  // namespace

void gemm(const TensorRef& a, const TensorRef& b, const TensorRef& c, bool transpose_a, bool transpose_b,
          bool accumulate, Stream stream) {
  const char* fn = "epx::gemm";
  check_tensor(fn, "a", a, {-1, -1}, kDataTypes);
  const int64_t M = transpose_a ? a.size(1) : a.size(0), K = transpose_a ? a.size(0) : a.size(1);
  if (transpose_b)
    check_tensor(fn, "b", b, {-1, K}, {a.dtype()});
  else
    check_tensor(fn, "b", b, {K, -1}, {a.dtype()});
  const int64_t N = transpose_b ? b.size(0) : b.size(1);
  check_wide_or_same(fn, "c", c, {M, N}, a.dtype());
  check_accumulate(fn, "c", c, accumulate);
  check_all_on(fn, a.device(), {{"b", &b}, {"c", &c}});
#ifdef EPX_HAVE_CUDA
  if (a.device().is_cuda()) return cuda::dense_gemm(a, b, c, transpose_a, transpose_b, accumulate, stream);
#endif
  require_host(fn, a.device());
  ref::gemm(a, b, c, transpose_a, transpose_b, accumulate);
}

void grouped_gemm_forward(const TensorRef& x, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                          const TensorRef& y, Stream stream, int64_t row_align) {
  const char* fn = "epx::grouped_gemm_forward";
  require(row_align >= 1, fn, "row_align is ", row_align, ", expected >= 1");
  check_tensor(fn, "x", x, {-1, -1}, kDataTypes);
  const int64_t R = x.size(0), K = x.size(1);
  const int64_t G = check_layout(fn, offsets, rows);
  check_tensor(fn, "y", y, {R, -1}, {x.dtype()});
  const int64_t N = y.size(1);
  check_tensor(fn, "w", w, {G, K, N}, {x.dtype()});
  check_all_on(fn, x.device(), {{"w", &w}, {"offsets", &offsets}, {"rows", &rows}, {"y", &y}});
#ifdef EPX_HAVE_CUDA
  if (offsets.device().is_cuda()) return cuda::grouped_forward_cuda(x, w, offsets, rows, y, stream, row_align);
#endif
  require_host(fn, x.device());
  check_row_align(fn, offsets, G, row_align);
  ref::grouped_gemm_forward(x, w, offsets, rows, y);
}

void quantize_grouped_weights_fp8(const TensorRef& w, const TensorRef& w_q, const TensorRef& w_scales, Stream stream) {
  const char* fn = "epx::quantize_grouped_weights_fp8";
  check_tensor(fn, "w", w, {-1, -1, -1}, {DType::kBF16, DType::kF16, DType::kF32});
  const int64_t G = w.size(0), K = w.size(1), N = w.size(2);
  require(K % 128 == 0 && N % 128 == 0, fn, "w is [", G, ", ", K, ", ", N,
          "]: K and N must be multiples of 128 (whole 128x128 blocks)");
  check_tensor(fn, "w_q", w_q, {G, N, K}, {DType::kF8E4M3});
  check_tensor(fn, "w_scales", w_scales, {G, K / 128, N / 128}, {DType::kF32});
  check_all_on(fn, w.device(), {{"w_q", &w_q}, {"w_scales", &w_scales}});
#ifdef EPX_HAVE_CUDA
  if (w.device().is_cuda()) return cuda::quantize_grouped_weights_fp8_cuda(w, w_q, w_scales, stream);
#endif
  require_host(fn, w.device());
  ref::quantize_grouped_weights_fp8(w, w_q, w_scales);
}

Fp8ExpertWeightShapes fp8_expert_weight_shapes(int64_t G, int64_t H, int64_t P, int64_t F) {
  const int64_t PF = P * F;
  return {{G, PF, H}, {G, H / 128, PF / 128}, {G, H, F}, {G, F / 128, H / 128}};
}

void quantize_expert_weights_fp8(const TensorRef& w_in, const TensorRef& w_out, const TensorRef& w_in_q,
                                 const TensorRef& w_in_q_scales, const TensorRef& w_out_q,
                                 const TensorRef& w_out_q_scales, Stream stream) {
  const char* fn = "epx::quantize_expert_weights_fp8";
  check_tensor(fn, "w_in", w_in, {-1, -1, -1, -1}, {DType::kBF16, DType::kF16, DType::kF32});
  const int64_t G = w_in.size(0), H = w_in.size(1), P = w_in.size(2), F = w_in.size(3);
  check_tensor(fn, "w_out", w_out, {G, F, H}, {w_in.dtype()});
  require(F % 128 == 0, fn, "w_in has ffn ", F, ": a multiple of 128 is needed (a 128x128 block may not straddle ",
          "two projections)");
  // w_in [G, H, P, F] as [G, H, P*F]: the stacked projections side by side in each row.
  quantize_grouped_weights_fp8(TensorRef(w_in.data(), w_in.dtype(), {G, H, P * F}, w_in.device()), w_in_q,
                               w_in_q_scales, stream);
  quantize_grouped_weights_fp8(w_out, w_out_q, w_out_q_scales, stream);
}

void grouped_gemm_forward_fp8(const TensorRef& x_q, const TensorRef& x_scales, const TensorRef& w_q,
                              const TensorRef& w_scales, const TensorRef& offsets, const TensorRef& rows,
                              const TensorRef& y, Stream stream, int64_t row_align) {
  const char* fn = "epx::grouped_gemm_forward_fp8";
  require(row_align >= 1, fn, "row_align is ", row_align, ", expected >= 1");
  check_tensor(fn, "x_q", x_q, {-1, -1}, {DType::kF8E4M3});
  const int64_t R = x_q.size(0), K = x_q.size(1);
  const int64_t G = check_layout(fn, offsets, rows);
  check_tensor(fn, "y", y, {R, -1}, {DType::kBF16, DType::kF32});
  const int64_t N = y.size(1);
  require(K % 128 == 0 && N % 128 == 0, fn, "x_q has K = ", K, " and y has N = ", N,
          " columns: both must be multiples of 128 (whole scale blocks)");
  check_tensor(fn, "x_scales", x_scales, {R, K / 128}, {DType::kF32});
  check_tensor(fn, "w_q", w_q, {G, N, K}, {DType::kF8E4M3});
  check_tensor(fn, "w_scales", w_scales, {G, K / 128, N / 128}, {DType::kF32});
  check_all_on(fn, x_q.device(), {{"x_scales", &x_scales}, {"w_q", &w_q}, {"w_scales", &w_scales},
                                  {"offsets", &offsets}, {"rows", &rows}, {"y", &y}});
#ifdef EPX_HAVE_CUDA
  if (x_q.device().is_cuda()) {
    require_status(y.dtype() == DType::kBF16, Status::kNotSupported, fn, "y has dtype ", dtype_name(y.dtype()),
                   "; the GPU FP8 grouped GEMM writes bf16");
    return cuda::grouped_forward_fp8_cuda(x_q, x_scales, w_q, w_scales, offsets, rows, y, stream, row_align);
  }
#endif
  require_host(fn, x_q.device());
  check_row_align(fn, offsets, G, row_align);
  ref::grouped_gemm_forward_fp8(x_q, x_scales, w_q, w_scales, offsets, rows, y);
}

void grouped_gemm_dgrad(const TensorRef& dy, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dx, Stream stream, int64_t row_align) {
  const char* fn = "epx::grouped_gemm_dgrad";
  require(row_align >= 1, fn, "row_align is ", row_align, ", expected >= 1");
  check_tensor(fn, "dy", dy, {-1, -1}, kDataTypes);
  const int64_t R = dy.size(0), N = dy.size(1);
  const int64_t G = check_layout(fn, offsets, rows);
  check_tensor(fn, "dx", dx, {R, -1}, {dy.dtype()});
  const int64_t K = dx.size(1);
  check_tensor(fn, "w", w, {G, K, N}, {dy.dtype()});
  check_all_on(fn, dy.device(), {{"w", &w}, {"offsets", &offsets}, {"rows", &rows}, {"dx", &dx}});
#ifdef EPX_HAVE_CUDA
  if (offsets.device().is_cuda()) return cuda::grouped_dgrad_cuda(dy, w, offsets, rows, dx, stream, row_align);
#endif
  require_host(fn, dy.device());
  check_row_align(fn, offsets, G, row_align);
  ref::grouped_gemm_dgrad(dy, w, offsets, rows, dx);
}

void grouped_gemm_wgrad(const TensorRef& x, const TensorRef& dy, const TensorRef& offsets, const TensorRef& rows,
                        const TensorRef& dw, bool accumulate, Stream stream) {
  const char* fn = "epx::grouped_gemm_wgrad";
  check_tensor(fn, "x", x, {-1, -1}, kDataTypes);
  const int64_t R = x.size(0), K = x.size(1);
  check_tensor(fn, "dy", dy, {R, -1}, {x.dtype()});
  const int64_t N = dy.size(1);
  const int64_t G = check_layout(fn, offsets, rows);
  check_wide_or_same(fn, "dw", dw, {G, K, N}, x.dtype());
  check_accumulate(fn, "dw", dw, accumulate);
  check_all_on(fn, x.device(), {{"dy", &dy}, {"offsets", &offsets}, {"rows", &rows}, {"dw", &dw}});
#ifdef EPX_HAVE_CUDA
  if (offsets.device().is_cuda()) return cuda::grouped_wgrad_cuda(x, dy, offsets, rows, dw, accumulate, stream);
#endif
  require_host(fn, x.device());
  ref::grouped_gemm_wgrad(x, dy, offsets, rows, dw, accumulate);
}

void expert_mlp_forward(const MlpConfig& config, const MlpTensors& t, Stream stream) {
  const char* fn = "epx::expert_mlp_forward";
  const MlpDims d = check_mlp_tensors(fn, config, t, false);
  check_tensor(fn, "y", t.y, {d.R, d.H}, {t.w_out.dtype()});
  check_mlp_devices(fn, t, nullptr);
#ifdef EPX_HAVE_CUDA
  if (t.x.device().is_cuda()) return cuda::expert_mlp_forward_cuda(config, t, stream);
#endif
  require_host(fn, t.x.device());
  ref::expert_mlp_forward(config, t);
}

void expert_mlp_backward(const MlpConfig& config, const MlpTensors& t, const MlpGrads& g, Stream stream) {
  const char* fn = "epx::expert_mlp_backward";
  const MlpDims d = check_mlp_tensors(fn, config, t, true);
  const DType dt = t.w_out.dtype(), wdt = t.w_in.dtype();
  if (t.y.defined()) check_tensor(fn, "y", t.y, {d.R, d.H}, {dt});  // not read; a mix-up is still worth a message
  check_tensor(fn, "d_y", g.d_y, {d.R, d.H}, {dt});
  check_tensor(fn, "d_x", g.d_x, {d.R, d.H}, {dt});
  if (config.apply_weights_early || config.combine_weight_grads)
    check_tensor(fn, "d_row_weights", g.d_row_weights, {d.R}, {float_dtype_for(dt)});
  else
    require(!g.d_row_weights.defined(), fn,
            "d_row_weights is given but config.apply_weights_early and config.combine_weight_grads are false (the "
            "weights get their gradient in combine_backward)");
  require(!(config.combine_weight_grads && d.bias), fn,
          "config.combine_weight_grads needs a layer without biases (the row weights' gradient would also need "
          "<d_y, b_out>); weight d_y in combine_backward instead");
  check_wide_or_same(fn, "d_w_in", g.d_w_in, {d.G, d.H, d.P, d.F}, wdt);
  check_wide_or_same(fn, "d_w_out", g.d_w_out, {d.G, d.F, d.H}, wdt);
  // accumulate_in_weight_dtype: check_wide_or_same above already holds them to fp32 or the weights' dtype.
  const bool acc_wide = config.accumulate_weight_grads && !config.accumulate_in_weight_dtype;
  check_accumulate(fn, "d_w_in", g.d_w_in, acc_wide);
  check_accumulate(fn, "d_w_out", g.d_w_out, acc_wide);
  if (d.bias) {
    require(g.d_b_in.defined(), fn, "d_b_in is missing (the layer has biases: b_in and b_out are given)");
    require(g.d_b_out.defined(), fn, "d_b_out is missing (the layer has biases: b_in and b_out are given)");
    check_wide_or_same(fn, "d_b_in", g.d_b_in, {d.G, d.P, d.F}, wdt);
    check_wide_or_same(fn, "d_b_out", g.d_b_out, {d.G, d.H}, wdt);
    check_accumulate(fn, "d_b_in", g.d_b_in, acc_wide);
    check_accumulate(fn, "d_b_out", g.d_b_out, acc_wide);
  } else {
    require(!g.d_b_in.defined() && !g.d_b_out.defined(), fn, g.d_b_in.defined() ? "d_b_in" : "d_b_out",
            " is given but the layer has no biases (b_in and b_out are absent)");
  }
  if (g.workspace.defined()) {
    check_tensor(fn, "workspace", g.workspace, {d.R, (d.P + 1) * d.F}, {dt});
    check_device(fn, "workspace", g.workspace, t.x.device());
  }
  check_mlp_devices(fn, t, &g);
#ifdef EPX_HAVE_CUDA
  if (t.x.device().is_cuda()) return cuda::expert_mlp_backward_cuda(config, t, g, stream);
#endif
  require_host(fn, t.x.device());
  ref::expert_mlp_backward(config, t, g);
}

}  // namespace epx
