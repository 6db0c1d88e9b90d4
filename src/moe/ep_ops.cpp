// Public entry points of the EP ops: validate every argument once, before any work is queued, then
// hand over to the group's backend. Nothing here touches data itself; the one composition is the
// quantize-on-the-way dispatch of a backend without a fused kernel: quantize (queued on the op's
// stream into a temporary) then the backend's quantized dispatch.
#include <cmath>
#include <memory>
#include <string>

#include "core/check.h"
#include "core/ep_state.h"
#include "epx/comm.h"
#include "epx/error.h"
#include "epx/layout.h"
#include "epx/quant.h"

#ifdef EPX_HAVE_CUDA
#include "cuda/quant/quant.h"
#endif

namespace epx {

using detail::check_all_on;
using detail::check_device;
using detail::check_min_rows;
using detail::check_tensor;

namespace {

constexpr std::initializer_list<DType> kPayloadTypes = {DType::kBF16, DType::kF16, DType::kF32, DType::kF64,
                                                        DType::kF8E4M3, DType::kF8E5M2};

// Weights (and their gradients) are fp32; an fp64 payload (reference gradient checks) carries fp64
// weights so that finite differences are not limited by fp32 rounding.
DType weight_dtype(DType payload) { return payload == DType::kF64 ? DType::kF64 : DType::kF32; }

void check_payload_width(const char* fn, const char* name, const TensorRef& t, const GroupConfig& c) {
  require(dtype_size(t.dtype()) <= dtype_size(c.max_dtype), fn, name, " has dtype ", dtype_name(t.dtype()), " (",
          dtype_size(t.dtype()), " bytes), wider than the group's max_dtype ", dtype_name(c.max_dtype), " (",
          dtype_size(c.max_dtype), " bytes); create the group with max_dtype = ", dtype_name(t.dtype()));
}

void check_handle(const char* fn, const GroupState& g, const HandleState& h, bool must_be_dispatched) {
  require(h.group_id == g.id, fn, "the handle was prepared on another group (a handle belongs to one group, "
          "one layer and one microbatch)");
  if (must_be_dispatched)
    require(h.dispatched, fn, "the handle has not been dispatched yet (call dispatch_forward first)");
}

// The quantize-on-the-way form of the quantized dispatch: x fp32/bf16/fp16, x_scales undefined,
// recv_x fp8 and recv_scales whose dtype picks the recipe. Returns the recipe.
QuantRecipe check_quantize_dispatch(const char* fn, const TensorRef& x, const TensorRef& recv_x,
                                    const TensorRef& recv_scales, const QuantOptions& options, int64_t H, int64_t cap) {
  require(x.dtype() == DType::kF32 || x.dtype() == DType::kBF16 || x.dtype() == DType::kF16, fn, "x has dtype ",
          dtype_name(x.dtype()), ", expected fp8_e4m3 with x_scales, or fp32, bf16 or fp16 to quantize on the way");
  check_tensor(fn, "recv_scales", recv_scales, {-1, -1}, {DType::kF32, DType::kE8M0});
  const QuantRecipe recipe =
      recv_scales.dtype() == DType::kF32 ? QuantRecipe::kFp8Block1x128 : QuantRecipe::kMxfp8Rowwise;
  const int64_t block = recipe == QuantRecipe::kFp8Block1x128 ? 128 : 32;
  require(H % block == 0, fn, "x has ", H, " columns (hidden), expected a multiple of ", block, " to quantize on the way ",
          "with the ", quant_recipe_name(recipe), " recipe that ", dtype_name(recv_scales.dtype()),
          " recv_scales select (whole ", block, "-element blocks)");
  require(recv_scales.size(1) == H / block, fn, "recv_scales has shape ", recv_scales.shape().str(), ", expected [>= ",
          cap, ", ", H / block, "] (one ", dtype_name(recv_scales.dtype()), " scale per ", block,
          " elements of a row of ", H, ": the ", quant_recipe_name(recipe), " recipe)");
  check_min_rows(fn, "recv_scales", recv_scales, cap);
  require(recv_x.defined() && recv_x.dtype() == DType::kF8E4M3, fn, "recv_x ",
          recv_x.defined() ? detail::concat("has dtype ", dtype_name(recv_x.dtype())) : std::string("is missing"),
          ", expected fp8_e4m3 (x is quantized on the way when recv_scales is given without x_scales)");
  require(options.mx_rounding == E8M0Rounding::kFloor || options.mx_rounding == E8M0Rounding::kCeil, fn,
          "quant_options.mx_rounding has value ", static_cast<int>(options.mx_rounding),
          ", expected kFloor (0) or kCeil (1)");
  return recipe;
}

}  // namespace

Handle prepare(Group& group, const TensorRef& topk_idx, const TensorRef& topk_weights, const PrepareOptions& options,
               Stream stream) {
  const char* fn = "epx::prepare";
  GroupState& g = group.state();
  const GroupConfig& c = g.config;
  check_tensor(fn, "topk_idx", topk_idx, {-1, -1}, {DType::kI32, DType::kI64});
  const int64_t T = topk_idx.size(0), K = topk_idx.size(1);
  require(K >= 1 && K <= c.max_topk, fn, "topk_idx has ", K, " columns (top-k), expected 1..", c.max_topk,
          " (the group's max_topk)");
  require(K <= c.num_experts, fn, "topk_idx has ", K, " columns (top-k), more than the ", c.num_experts, " experts");
  require_status(T <= c.max_tokens_per_rank, Status::kCapacityExceeded, fn, "topk_idx has ", T,
                 " rows (tokens), the group was sized for max_tokens_per_rank = ", c.max_tokens_per_rank);
  require(std::isfinite(options.capacity_factor) && options.capacity_factor >= 0, fn, "options.capacity_factor is ",
          options.capacity_factor, ", expected >= 0 (0 = dropless)");
  require(options.recv_capacity_rows >= 0 && options.recv_capacity_rows <= g.recv_capacity_rows, fn,
          "options.recv_capacity_rows is ", options.recv_capacity_rows, ", expected 0 (the group's) .. the group's ",
          g.recv_capacity_rows);
  const bool need_weights = options.capacity_factor > 0 && options.drop_policy == DropPolicy::kByProbability;
  if (need_weights || topk_weights.defined())
    check_tensor(fn, "topk_weights", topk_weights, {T, K}, {DType::kF32, DType::kF64});
  check_all_on(fn, g.device, {{"topk_idx", &topk_idx}, {"topk_weights", &topk_weights}});

  auto s = std::make_unique<HandleState>();
  s->group_id = g.id;
  s->num_tokens = static_cast<int>(T);
  s->topk = static_cast<int>(K);
  s->num_experts = c.num_experts;
  s->num_ranks = g.size;
  s->local_experts = g.local_experts;
  s->max_tokens = c.max_tokens_per_rank;
  s->max_topk = c.max_topk;
  s->capacity = options.capacity_factor > 0
                    ? static_cast<int>(std::ceil(static_cast<double>(options.capacity_factor) * T * K / c.num_experts))
                    : 0;
  s->recv_capacity = options.recv_capacity_rows > 0 ? options.recv_capacity_rows : g.recv_capacity_rows;
  if (s->recv_capacity < g.recv_capacity_rows) g.smaller_handle_capacity = true;
  g.prepare(*s, topk_idx, need_weights ? topk_weights : TensorRef(), options, stream);
  return Handle(std::move(s));
}

void dispatch_forward(Group& group, Handle& handle, const TensorRef& x, const TensorRef& topk_weights,
                      const TensorRef& recv_x, const TensorRef& recv_weights, Stream stream) {
  dispatch_forward(group, handle, x, TensorRef(), topk_weights, recv_x, TensorRef(), recv_weights, stream);
}

void dispatch_forward(Group& group, Handle& handle, const TensorRef& x, const TensorRef& x_scales,
                      const TensorRef& topk_weights, const TensorRef& recv_x, const TensorRef& recv_scales,
                      const TensorRef& recv_weights, Stream stream, const QuantOptions& quant_options) {
  const char* fn = "epx::dispatch_forward";
  GroupState& g = group.state();
  HandleState& h = handle.state();
  check_handle(fn, g, h, false);
  require(!h.dispatched, fn, "the handle was already dispatched; prepare a new handle for every layer and "
          "microbatch (its backward still needs this one's routing)");
  const int64_t T = h.num_tokens, K = h.topk, H = g.config.hidden, cap = h.recv_capacity;
  check_tensor(fn, "x", x, {T, H}, kPayloadTypes);
  const bool quantized = x_scales.defined() || recv_scales.defined();
  // Quantize on the way: a high-precision x without scales, fp8 rows and scales expected out.
  const bool quantize_here = quantized && !x_scales.defined() && x.dtype() != DType::kF8E4M3;
  QuantRecipe recipe = QuantRecipe::kFp8Block1x128;
  if (quantize_here) {
    recipe = check_quantize_dispatch(fn, x, recv_x, recv_scales, quant_options, H, cap);
  } else if (quantized) {
    require(x.dtype() == DType::kF8E4M3, fn, "x has dtype ", dtype_name(x.dtype()),
            ", expected fp8_e4m3 when scales travel with it (leave x_scales undefined to quantize an fp32, bf16 "
            "or fp16 x on the way)");
    check_tensor(fn, "x_scales", x_scales, {T, -1}, {DType::kF32, DType::kE8M0});
    const int64_t S = x_scales.size(1);
    const int64_t block = x_scales.dtype() == DType::kF32 ? 128 : 32;
    require(S == (H + block - 1) / block, fn, "x_scales has ", S, " columns, expected ", (H + block - 1) / block,
            " (one ", dtype_name(x_scales.dtype()), " scale per ", block, " elements of a row of ", H, ")");
    check_tensor(fn, "recv_scales", recv_scales, {-1, S}, {x_scales.dtype()});
    check_min_rows(fn, "recv_scales", recv_scales, cap);
  } else {
    check_payload_width(fn, "x", x, g.config);
  }
  if (quantized) {
    const DType sdt = recv_scales.dtype();
    const int64_t S = recv_scales.size(1);
    const size_t row_bytes = static_cast<size_t>(H) + static_cast<size_t>(S) * dtype_size(sdt);
    require(row_bytes <= static_cast<size_t>(H) * dtype_size(g.config.max_dtype), fn, "an fp8 row with its scales takes ",
            row_bytes, " bytes, more than the ", H * dtype_size(g.config.max_dtype),
            " bytes per row the group was sized for (max_dtype ", dtype_name(g.config.max_dtype), ")");
  }
  const DType wt = weight_dtype(x.dtype());
  if (topk_weights.defined()) check_tensor(fn, "topk_weights", topk_weights, {T, K}, {wt});
  check_tensor(fn, "recv_x", recv_x, {-1, H}, {quantize_here ? DType::kF8E4M3 : x.dtype()});
  check_min_rows(fn, "recv_x", recv_x, cap);
  if (recv_weights.defined()) {
    require(topk_weights.defined(), fn, "recv_weights is given but topk_weights is missing");
    check_tensor(fn, "recv_weights", recv_weights, {-1}, {wt});
    check_min_rows(fn, "recv_weights", recv_weights, cap);
  }
  check_all_on(fn, g.device,
               {{"x", &x}, {"x_scales", &x_scales}, {"topk_weights", &topk_weights}, {"recv_x", &recv_x},
                {"recv_scales", &recv_scales}, {"recv_weights", &recv_weights}});
  if (!quantize_here) {
    g.dispatch_forward(h, x, x_scales, topk_weights, recv_x, recv_scales, recv_weights, stream);
  } else if (g.fuses_quantize_dispatch()) {
    g.dispatch_forward_quantize(h, recipe, quant_options.mx_rounding, x, topk_weights, recv_x, recv_scales,
                                recv_weights, stream);
  } else {
    // Compose: quantize at the source into a temporary, then the quantized dispatch of it.
    auto send = [&](const TensorRef& q, const TensorRef& s) {
      g.dispatch_forward(h, q, s, topk_weights, recv_x, recv_scales, recv_weights, stream);
    };
    if (x.device().is_cuda()) {
#ifdef EPX_HAVE_CUDA
      cuda::with_quantized(recipe, x, quant_options.mx_rounding, stream, send);
#else
      throw Error(Status::kNotSupported, detail::concat(fn, ": x is on ", x.device().str(),
                                                        " but this build has no CUDA backend"));
#endif
    } else {
      Tensor q = Tensor::empty({T, H}, DType::kF8E4M3, x.device());
      Tensor s = Tensor::empty(quant_scale_shape(recipe, T, H), quant_scale_dtype(recipe), x.device());
      quantize(recipe, x, q, s, quant_options, stream);
      send(q, s);
    }
  }
  h.dispatched = true;
}

void combine_forward(Group& group, Handle& handle, const TensorRef& y, const TensorRef& row_weights,
                     const TensorRef& out, Stream stream) {
  const char* fn = "epx::combine_forward";
  GroupState& g = group.state();
  HandleState& h = handle.state();
  check_handle(fn, g, h, true);
  const int64_t T = h.num_tokens, H = g.config.hidden, cap = h.recv_capacity;
  check_tensor(fn, "y", y, {-1, H}, kPayloadTypes);
  check_min_rows(fn, "y", y, cap);
  check_payload_width(fn, "y", y, g.config);
  if (row_weights.defined()) {
    check_tensor(fn, "row_weights", row_weights, {-1}, {weight_dtype(y.dtype())});
    check_min_rows(fn, "row_weights", row_weights, cap);
  }
  check_tensor(fn, "out", out, {T, H}, {y.dtype()});
  check_all_on(fn, g.device, {{"y", &y}, {"row_weights", &row_weights}, {"out", &out}});
  g.combine_forward(h, y, row_weights, out, stream);
}

void combine_backward(Group& group, Handle& handle, const TensorRef& d_out, const TensorRef& y,
                      const TensorRef& row_weights, const TensorRef& d_y, const TensorRef& d_row_weights,
                      Stream stream) {
  const char* fn = "epx::combine_backward";
  GroupState& g = group.state();
  HandleState& h = handle.state();
  check_handle(fn, g, h, true);
  const int64_t T = h.num_tokens, H = g.config.hidden, cap = h.recv_capacity;
  check_tensor(fn, "d_out", d_out, {T, H}, kPayloadTypes);
  check_payload_width(fn, "d_out", d_out, g.config);
  check_tensor(fn, "d_y", d_y, {-1, H}, {d_out.dtype()});
  check_min_rows(fn, "d_y", d_y, cap);
  const DType wt = weight_dtype(d_out.dtype());
  if (row_weights.defined()) {
    check_tensor(fn, "row_weights", row_weights, {-1}, {wt});
    check_min_rows(fn, "row_weights", row_weights, cap);
  }
  if (d_row_weights.defined()) {
    check_tensor(fn, "d_row_weights", d_row_weights, {-1}, {wt});
    check_min_rows(fn, "d_row_weights", d_row_weights, cap);
    check_tensor(fn, "y", y, {-1, H}, kPayloadTypes);
    check_min_rows(fn, "y", y, cap);
  }
  check_all_on(fn, g.device,
               {{"d_out", &d_out}, {"y", &y}, {"row_weights", &row_weights}, {"d_y", &d_y},
                {"d_row_weights", &d_row_weights}});
  g.combine_backward(h, d_out, y, row_weights, d_y, d_row_weights, stream);
}

void dispatch_backward(Group& group, Handle& handle, const TensorRef& d_recv_x, const TensorRef& d_recv_weights,
                       const TensorRef& d_x, const TensorRef& d_topk_weights, Stream stream) {
  const char* fn = "epx::dispatch_backward";
  GroupState& g = group.state();
  HandleState& h = handle.state();
  check_handle(fn, g, h, true);
  const int64_t T = h.num_tokens, K = h.topk, H = g.config.hidden, cap = h.recv_capacity;
  check_tensor(fn, "d_recv_x", d_recv_x, {-1, H}, kPayloadTypes);
  check_min_rows(fn, "d_recv_x", d_recv_x, cap);
  check_payload_width(fn, "d_recv_x", d_recv_x, g.config);
  check_tensor(fn, "d_x", d_x, {T, H}, {d_recv_x.dtype()});
  if (d_recv_weights.defined() || d_topk_weights.defined()) {
    const DType wt = weight_dtype(d_recv_x.dtype());
    check_tensor(fn, "d_recv_weights", d_recv_weights, {-1}, {wt});
    check_min_rows(fn, "d_recv_weights", d_recv_weights, cap);
    check_tensor(fn, "d_topk_weights", d_topk_weights, {T, K}, {wt});
  }
  check_all_on(fn, g.device,
               {{"d_recv_x", &d_recv_x}, {"d_recv_weights", &d_recv_weights}, {"d_x", &d_x},
                {"d_topk_weights", &d_topk_weights}});
  g.dispatch_backward(h, d_recv_x, d_recv_weights, d_x, d_topk_weights, stream);
}

void all_reduce_sum(Group& group, const TensorRef& buffer, Stream stream) {
  const char* fn = "epx::all_reduce_sum";
  GroupState& g = group.state();
  require(buffer.defined() && (buffer.dtype() == DType::kF32 || buffer.dtype() == DType::kF64), fn,
          "buffer is ", buffer.defined() ? buffer.str() : std::string("missing"), ", expected an fp32 or fp64 tensor");
  check_device(fn, "buffer", buffer, g.device);
  g.all_reduce_sum(buffer, stream);
}

}  // namespace epx
