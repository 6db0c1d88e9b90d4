// CPU reference of the expert FFN, forward and backward, one real row at a time per group.
//
// Forward, row r of group j (Acc = fp32, fp64 for fp64 data; every sum ascending):
//   acc_p  = sum_k x[r, k] w_in[j, k, p, :]  (+ b_in[j, p, :])      bias added to the finished sum
//   a[r,p] = round(acc_p)                                           saved for backward
//   act    = silu(acc_0) * acc_1 | gelu_tanh(acc_0) * acc_1 | gelu_tanh(acc_0) | relu(acc_0)^2
//            from the UNROUNDED accumulators, times row_weights[r] when early
//   h[r]   = round(act)                                             saved; FC2 reads this rounded h
//   y[r]   = round( sum_f h[r, f] w_out[j, f, :]  (+ b_out[j, :]) )
// Backward, from the saved a (rounded) and h:
//   d_h    = sum_n d_y[r, n] w_out[j, :, n]                         kept in Acc, not rounded
//   early or combine_weight_grads: d_row_weights[r] = sum_f d_h[f] act_u[f] (act_u = unweighted act),
//   d_act = d_h w_r; else d_act = d_h
//   d_a_0  = d_act * d act / d a_0,  d_a_1 = d_act * d act / d a_1  (gated)   kept in Acc
//   d_x[r] = round( sum over (p, f) ascending of d_a_p[f] w_in[j, :, p, f] )
//   d_w_out[j] = round(sum_r h[r]^T d_y[r]) (combine_weight_grads: round(w_r round(act(a[r]))) in place
//   of h[r], the activation recomputed from the saved a),
//   d_b_out[j] = round(sum_r d_y[r]),
//   d_w_in[j, :, p] = round(sum_r x[r]^T d_a_p[r]), d_b_in[j, p] = round(sum_r d_a_p[r]),
//   (with accumulate_weight_grads each of these is round(old + sum), an expert without rows untouched)
//   each sum over the group's real rows in ascending order (zeros for an empty group).
// Padding rows of a, h, y, d_x and d_row_weights are written as zeros; rows at or past
// offsets[G] are not touched.
// FP8 precisions (forward only): every GEMM operand is replaced by its quantize -> dequantize
// image (x and h rows with the activation recipe, each projection w_in[j, :, p] and w_out[j] with
// the weight recipe,
// blocks along the contraction dim); an fp8 x is dequantized with its scales. Backward uses the
// saved (unquantized) a and h, the unquantized weights, and x as the forward saw it.
#include "ref/expert_mlp.h"

#include <cstring>

#include <cmath>
#include <vector>

#include "ref/grouped_gemm.h"
#include "ref/quant.h"

namespace epx::ref {
namespace {

template <class Acc>
Acc silu(Acc z) {
  return z / (Acc(1) + std::exp(-z));
}

template <class Acc>
Acc gelu_tanh(Acc z) {
  const Acc c = static_cast<Acc>(0.7978845608028654);  // sqrt(2 / pi)
  return Acc(0.5) * z * (Acc(1) + std::tanh(c * (z + static_cast<Acc>(0.044715) * z * z * z)));
}

template <class Acc>
Acc act_value(Activation f, Acc a0, Acc a1) {
  switch (f) {
    case Activation::kSwiGLU: return silu(a0) * a1;
    case Activation::kGeGLU: return gelu_tanh(a0) * a1;
    case Activation::kGelu: return gelu_tanh(a0);
    case Activation::kRelu2: {
      const Acc r = a0 > Acc(0) ? a0 : Acc(0);
      return r * r;
    }
  }
  return Acc(0);
}

template <class Acc>
struct ActGrad {
  Acc act;     // unweighted activation
  Acc d0, d1;  // its partial derivatives in a_0 and a_1 (d1 = 0 when not gated)
};

template <class Acc>
ActGrad<Acc> act_grad(Activation f, Acc a0, Acc a1) {
  switch (f) {
    case Activation::kSwiGLU: {
      const Acc s = Acc(1) / (Acc(1) + std::exp(-a0));
      const Acc g = silu(a0);  // the forward's expression, so act_u matches it bit for bit
      return {g * a1, a1 * s * (Acc(1) + a0 * (Acc(1) - s)), g};
    }
    case Activation::kGeGLU:
    case Activation::kGelu: {
      const Acc c = static_cast<Acc>(0.7978845608028654), k = static_cast<Acc>(0.044715);
      const Acc t = std::tanh(c * (a0 + k * a0 * a0 * a0));
      const Acc g = Acc(0.5) * a0 * (Acc(1) + t);
      const Acc dg = Acc(0.5) * (Acc(1) + t) + Acc(0.5) * a0 * (Acc(1) - t * t) * c * (Acc(1) + 3 * k * a0 * a0);
      if (f == Activation::kGelu) return {g, dg, Acc(0)};
      return {g * a1, dg * a1, g};
    }
    case Activation::kRelu2: {
      const Acc r = a0 > Acc(0) ? a0 : Acc(0);
      return {r * r, 2 * r, Acc(0)};
    }
  }
  return {Acc(0), Acc(0), Acc(0)};
}

bool wide(DType t) { return t == DType::kF64; }

QuantRecipe row_recipe(MlpPrecision p) {
  return p == MlpPrecision::kFp8Block ? QuantRecipe::kFp8Block1x128 : QuantRecipe::kMxfp8Rowwise;
}
QuantRecipe weight_recipe(MlpPrecision p) {
  return p == MlpPrecision::kFp8Block ? QuantRecipe::kFp8Block128x128 : QuantRecipe::kMxfp8Colwise;
}

// MX scales round up (NVIDIA's recipe): the spec's floor saturates up to 1/8 of the largest
// elements of a block, which costs several percent of accuracy through two GEMMs.
QuantOptions mlp_quant_options() {
  QuantOptions o;
  o.mx_rounding = E8M0Rounding::kCeil;
  return o;
}

// What an FP8 GEMM sees of the [M, N] block of `src` starting at element `offset`.
template <class Acc>
std::vector<Acc> quantized_image(const TensorRef& src, int64_t offset, int64_t M, int64_t N, QuantRecipe r) {
  const TensorRef block(static_cast<char*>(src.data()) + offset * dtype_size(src.dtype()), src.dtype(), {M, N});
  Tensor q = Tensor::empty({M, N}, DType::kF8E4M3), out = Tensor::empty({M, N}, DType::kF32);
  Tensor sc = Tensor::empty(quant_scale_shape(r, M, N), quant_scale_dtype(r));
  ref::quantize(r, block, q, sc, mlp_quant_options());
  ref::dequantize(r, q, sc, out);
  return std::vector<Acc>(out.ptr<float>(), out.ptr<float>() + M * N);
}

// What an FP8 GEMM sees of expert j's stacked w_in [H, P*F]: each projection's [H, F] matrix is
// quantized on its own (its blocks never straddle two projections), the images stacked again.
template <class Acc>
std::vector<Acc> quantized_w_in(const TensorRef& w_in, int64_t j, int64_t H, int64_t P, int64_t F, QuantRecipe r) {
  const int64_t PF = P * F;
  std::vector<Acc> out(H * PF);
  Tensor proj = Tensor::empty({H, F}, w_in.dtype());
  const size_t es = dtype_size(w_in.dtype());
  for (int64_t p = 0; p < P; ++p) {
    for (int64_t k = 0; k < H; ++k)
      std::memcpy(static_cast<char*>(proj.data()) + k * F * es,
                  static_cast<const char*>(w_in.data()) + ((j * H + k) * PF + p * F) * es, F * es);
    const std::vector<Acc> img = quantized_image<Acc>(proj, 0, H, F, r);
    for (int64_t k = 0; k < H; ++k) std::copy(img.begin() + k * F, img.begin() + (k + 1) * F, out.begin() + k * PF + p * F);
  }
  return out;
}

// Row r of x as a GEMM consumes it: dequantized when x is fp8, quantized first under an FP8
// precision (forward only), as is otherwise.
template <class Acc>
void load_x_row(const MlpConfig& c, const MlpTensors& t, int64_t r, int64_t H, bool forward, Acc* out) {
  if (t.x.dtype() == DType::kF8E4M3) {
    const QuantRecipe rr = row_recipe(c.precision);
    const int64_t S = t.x_scales.size(1);
    const TensorRef q(static_cast<char*>(t.x.data()) + r * H, DType::kF8E4M3, {1, H});
    const TensorRef sc(static_cast<char*>(t.x_scales.data()) + r * S * dtype_size(t.x_scales.dtype()),
                       t.x_scales.dtype(), {1, S});
    Tensor tmp = Tensor::empty({1, H}, DType::kF32);
    ref::dequantize(rr, q, sc, tmp);
    for (int64_t i = 0; i < H; ++i) out[i] = tmp.ptr<float>()[i];
  } else if (forward && c.precision != MlpPrecision::kHigh) {
    const std::vector<Acc> v = quantized_image<Acc>(t.x, r * H, 1, H, row_recipe(c.precision));
    std::copy(v.begin(), v.end(), out);
  } else {
    load_row(t.x.data(), t.x.dtype(), r * H, H, out);
  }
}

// Zeros on the padding rows [begin + rows, end) of a tensor with `width` elements per row.
void zero_padding(const TensorRef& t, const GroupSpan& g, int64_t width) {
  if (t.defined()) store_zeros(t, (g.begin + g.rows) * width, (g.end - g.begin - g.rows) * width);
}

template <class Acc>
void forward_impl(const MlpConfig& c, const MlpTensors& t) {
  const int64_t H = t.x.size(1), P = t.w_in.size(2), F = t.w_in.size(3), PF = P * F;
  const bool bias = t.b_in.defined(), early = c.apply_weights_early, gated = P == 2;
  const bool fp8 = c.precision != MlpPrecision::kHigh;
  const std::vector<GroupSpan> groups = read_groups("epx::expert_mlp_forward", t.offsets, t.rows, t.x.size(0));
  std::vector<Acc> x(H), acc(PF), act(F), h(F), y(H), b_in(PF, Acc(0)), b_out(H, Acc(0));
  for (size_t jj = 0; jj < groups.size(); ++jj) {
    const GroupSpan& g = groups[jj];
    const int64_t j = static_cast<int64_t>(jj);
    if (g.rows > 0) {
      std::vector<Acc> w_in, w_out;  // w_in [H, P*F]: the projections side by side in each row
      if (fp8) {
        w_in = quantized_w_in<Acc>(t.w_in, j, H, P, F, weight_recipe(c.precision));
        w_out = quantized_image<Acc>(t.w_out, j * F * H, F, H, weight_recipe(c.precision));
      } else {
        w_in = load_matrix<Acc>(t.w_in, j * H * PF, H, PF, false);
        w_out = load_matrix<Acc>(t.w_out, j * F * H, F, H, false);
      }
      if (bias) {
        load_row(t.b_in.data(), t.b_in.dtype(), j * PF, PF, b_in.data());
        load_row(t.b_out.data(), t.b_out.dtype(), j * H, H, b_out.data());
      }
      for (int64_t r = g.begin; r < g.begin + g.rows; ++r) {
        load_x_row(c, t, r, H, true, x.data());
        row_times_matrix(x.data(), H, w_in.data(), PF, acc.data());
        if (bias)
          for (int64_t i = 0; i < PF; ++i) acc[i] += b_in[i];
        store_row(t.a.data(), t.a.dtype(), r * PF, PF, acc.data());
        const Acc w_r = early ? static_cast<Acc>(load_as_double(t.row_weights.data(), t.row_weights.dtype(), r)) : Acc(1);
        for (int64_t f = 0; f < F; ++f) {
          act[f] = act_value(c.activation, acc[f], gated ? acc[F + f] : Acc(0));
          if (early) act[f] *= w_r;
        }
        store_row(t.h.data(), t.h.dtype(), r * F, F, act.data());
        load_row(t.h.data(), t.h.dtype(), r * F, F, h.data());  // FC2 consumes the stored (rounded) h
        if (fp8) h = quantized_image<Acc>(t.h, r * F, 1, F, row_recipe(c.precision));
        row_times_matrix(h.data(), F, w_out.data(), H, y.data());
        if (bias)
          for (int64_t n = 0; n < H; ++n) y[n] += b_out[n];
        store_row(t.y.data(), t.y.dtype(), r * H, H, y.data());
      }
    }
    zero_padding(t.a, g, PF);
    zero_padding(t.h, g, F);
    zero_padding(t.y, g, H);
  }
}

// Stores a gradient row sum at `offset`, or adds it to what is there (old + sum, rounded once).
template <class Acc>
void store_grad(const TensorRef& dst, int64_t offset, int64_t n, std::vector<Acc>& sum, bool add) {
  if (add) {
    std::vector<Acc> old(static_cast<size_t>(n));
    load_row(dst.data(), dst.dtype(), offset, n, old.data());
    for (int64_t i = 0; i < n; ++i) sum[i] = old[i] + sum[i];
  }
  store_row(dst.data(), dst.dtype(), offset, n, sum.data());
}

template <class Acc>
void backward_impl(const MlpConfig& c, const MlpTensors& t, const MlpGrads& d) {
  const int64_t H = t.x.size(1), P = t.w_in.size(2), F = t.w_in.size(3), PF = P * F;
  const bool bias = t.b_in.defined(), early = c.apply_weights_early, gated = P == 2;
  // Row weights in backward: applied to h (early), or combine's, whose gradient comes through FC2.
  const bool late = c.combine_weight_grads, weighted = early || late;
  Tensor hw_rounded = late ? Tensor::empty({F}, t.h.dtype()) : Tensor();  // round(w_row * h), as d_w_out reads it
  const std::vector<GroupSpan> groups = read_groups("epx::expert_mlp_backward", t.offsets, t.rows, t.x.size(0));
  std::vector<Acc> x(H), a(PF), h(F), dy(H), dh(F), da(PF), dx(H);
  std::vector<Acc> dw_in(P * H * F), db_in(PF), dw_out(F * H), db_out(H);
  std::vector<Acc> w_in_t;  // [(p, f), k] = w_in[j, k, p, f]: d_x reduces over (p, f)
  for (size_t jj = 0; jj < groups.size(); ++jj) {
    const GroupSpan& g = groups[jj];
    const int64_t j = static_cast<int64_t>(jj);
    std::fill(dw_in.begin(), dw_in.end(), Acc(0));
    std::fill(db_in.begin(), db_in.end(), Acc(0));
    std::fill(dw_out.begin(), dw_out.end(), Acc(0));
    std::fill(db_out.begin(), db_out.end(), Acc(0));
    if (g.rows > 0) {
      w_in_t = load_matrix<Acc>(t.w_in, j * H * PF, H, PF, true);  // [P*F, H]
      const std::vector<Acc> w_out_t = load_matrix<Acc>(t.w_out, j * F * H, F, H, true);  // [H, F]
      for (int64_t r = g.begin; r < g.begin + g.rows; ++r) {
        load_x_row(c, t, r, H, false, x.data());
        load_row(t.a.data(), t.a.dtype(), r * PF, PF, a.data());
        if (!late) load_row(t.h.data(), t.h.dtype(), r * F, F, h.data());  // late: recomputed from a
        load_row(d.d_y.data(), d.d_y.dtype(), r * H, H, dy.data());
        row_times_matrix(dy.data(), H, w_out_t.data(), F, dh.data());
        const Acc w_r =
            weighted ? static_cast<Acc>(load_as_double(t.row_weights.data(), t.row_weights.dtype(), r)) : Acc(1);
        Acc d_w_r = 0;
        for (int64_t f = 0; f < F; ++f) {
          const ActGrad<Acc> q = act_grad(c.activation, a[f], gated ? a[F + f] : Acc(0));
          Acc d_act = dh[f];
          if (weighted) {
            d_w_r += dh[f] * q.act;
            d_act *= w_r;
          }
          if (late) h[f] = q.act;  // d_w_out's row, rounded below
          da[f] = d_act * q.d0;
          if (gated) da[F + f] = d_act * q.d1;
        }
        if (weighted) store_from_double(d.d_row_weights.data(), d.d_row_weights.dtype(), r, static_cast<double>(d_w_r));
        if (late) {  // d_w_out's rows: round(w_r * round(act)) from the saved a (the GPU's h is d_h's by now)
          store_row(hw_rounded.data(), hw_rounded.dtype(), 0, F, h.data());
          load_row(hw_rounded.data(), hw_rounded.dtype(), 0, F, h.data());
          for (int64_t f = 0; f < F; ++f) h[f] *= w_r;
          store_row(hw_rounded.data(), hw_rounded.dtype(), 0, F, h.data());
          load_row(hw_rounded.data(), hw_rounded.dtype(), 0, F, h.data());
        }
        row_times_matrix(da.data(), PF, w_in_t.data(), H, dx.data());
        store_row(d.d_x.data(), d.d_x.dtype(), r * H, H, dx.data());
        for (int64_t f = 0; f < F; ++f) {
          const Acc hf = h[f];
          Acc* out = dw_out.data() + f * H;
          for (int64_t n = 0; n < H; ++n) out[n] += hf * dy[n];
        }
        for (int64_t n = 0; n < H; ++n) db_out[n] += dy[n];
        for (int64_t k = 0; k < H; ++k) {
          const Acc xk = x[k];
          Acc* out = dw_in.data() + k * PF;
          for (int64_t i = 0; i < PF; ++i) out[i] += xk * da[i];
        }
        for (int64_t i = 0; i < PF; ++i) db_in[i] += da[i];
      }
    }
    // Accumulating: old + this backward's sum, one rounding (as the GPU epilogue's beta = 1); an
    // expert without rows is left exactly as it was.
    const bool add = c.accumulate_weight_grads;
    if (!add || g.rows > 0) {
      store_grad(d.d_w_in, j * H * PF, H * PF, dw_in, add);
      store_grad(d.d_w_out, j * F * H, F * H, dw_out, add);
      if (bias) {
        store_grad(d.d_b_in, j * PF, PF, db_in, add);
        store_grad(d.d_b_out, j * H, H, db_out, add);
      }
    }
    zero_padding(d.d_x, g, H);
    if (weighted) zero_padding(d.d_row_weights, g, 1);
  }
}

}  // namespace

ActivationGrad activation_grad(Activation f, double a0, double a1) {
  const ActGrad<double> g = act_grad(f, a0, a1);
  return {g.act, g.d0, g.d1};
}

void expert_mlp_forward(const MlpConfig& config, const MlpTensors& t) {
  if (wide(t.w_in.dtype()))
    forward_impl<double>(config, t);
  else
    forward_impl<float>(config, t);
}

void expert_mlp_backward(const MlpConfig& config, const MlpTensors& t, const MlpGrads& g) {
  if (wide(t.w_in.dtype()))
    backward_impl<double>(config, t, g);
  else
    backward_impl<float>(config, t, g);
}

}  // namespace epx::ref
