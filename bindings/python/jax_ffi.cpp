// XLA FFI handlers of the epx ops, for JAX (epx.jax registers them with jax.ffi): route, prepare,
// dispatch, combine, the grouped expert FFN, and their backwards, on XLA's stream with no host
// synchronisation, for the CUDA platform and for the host (the CPU reference).
//
// State lives here, named by attributes: a group is (group id, device ordinal) — one process may
// drive several GPUs, one group view each — and a routing handle is (group id, ordinal, slot). The
// Python side registers groups and router configs once, outside any traced function. Optional
// arguments travel as zero-element buffers.
#include "jax_ffi.h"

#include <nanobind/stl/string.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "core/device_memory.h"
#include "epx/epx.h"
#include "moe/elementwise.h"
#include "shape_of.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace epx::jax {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::pair<int64_t, int64_t>, Group*> groups;  // (group id, device ordinal; -1 = host)
  std::map<std::tuple<int64_t, int64_t, int64_t>, Handle> handles;
  std::map<int64_t, RouterConfig> routers;
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: XLA may call a handler during teardown
  return *r;
}

Group& group_of(int64_t id, int64_t ordinal) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  auto it = r.groups.find({id, ordinal});
  require(it != r.groups.end(), "epx.jax", "no group with id ", id, " on device ordinal ", ordinal,
          " (make it with epx.jax.Group before tracing the function that uses it)");
  return *it->second;
}

Handle& handle_of(int64_t id, int64_t ordinal, int64_t slot) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  return r.handles[{id, ordinal, slot}];  // std::map: references stay valid as entries are added
}

const RouterConfig& router_of(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lk(r.mu);
  auto it = r.routers.find(id);
  require(it != r.routers.end(), "epx.jax", "no router with id ", id);
  return it->second;
}

DType dtype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kF16;
    case ffi::DataType::F64: return DType::kF64;
    case ffi::DataType::S32: return DType::kI32;
    case ffi::DataType::S64: return DType::kI64;
    case ffi::DataType::F8E4M3FN: return DType::kF8E4M3;
    case ffi::DataType::F8E5M2: return DType::kF8E5M2;
    case ffi::DataType::U8: return DType::kU8;
    default:
      throw Error(Status::kInvalidArgument,
                  detail::concat("epx.jax: XLA element type ", static_cast<int>(t), " is not supported"));
  }
}

// Where a call runs: the device (ordinal -1 = host) and the stream (null on the host).
struct Where {
  int64_t ordinal;
  void* stream;
};

TensorRef view(const Where& w, ffi::AnyBuffer b) {
  const auto dims = b.dimensions();
  if (b.element_count() == 0 && dims.size() == 1) return TensorRef();  // an absent optional argument
  return TensorRef(b.untyped_data(), dtype_of(b.element_type()), shape_of(dims, "epx.jax"),
                   w.ordinal < 0 ? Device::cpu() : Device::cuda(static_cast<int>(w.ordinal)));
}

TensorRef view(const Where& w, ffi::Result<ffi::AnyBuffer>& b) { return view(w, *b); }

// Runs an op and turns epx's exceptions into FFI errors carrying epx's message.
template <class F>
ffi::Error guarded(F&& f) {
  try {
    f();
    return ffi::Error::Success();
  } catch (const Error& e) {
    return ffi::Error(e.status() == Status::kInvalidArgument ? ffi::ErrorCode::kInvalidArgument
                                                              : ffi::ErrorCode::kInternal,
                      e.what());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
}

// ---- the ops ----------------------------------------------------------------------------------
ffi::Error route(Where w, int64_t router, ffi::AnyBuffer logits, ffi::AnyBuffer bias,
                 ffi::Result<ffi::AnyBuffer> idx, ffi::Result<ffi::AnyBuffer> weights) {
  return guarded([&] {
    route_forward(router_of(router), view(w, logits), view(w, bias), view(w, idx), view(w, weights), RouterStats{},
                  Stream{w.stream});
  });
}

ffi::Error route_bwd(Where w, int64_t router, ffi::AnyBuffer d_weights, ffi::AnyBuffer logits, ffi::AnyBuffer bias,
                     ffi::AnyBuffer idx, ffi::Result<ffi::AnyBuffer> d_logits) {
  return guarded([&] {
    route_backward(router_of(router), view(w, logits), view(w, bias), view(w, idx), view(w, d_weights), RouterStats{},
                   0.0, 0.0, view(w, d_logits), Stream{w.stream});
  });
}

ffi::Error prepare_op(Where w, int64_t group, int64_t slot, float capacity_factor, bool by_probability,
                      ffi::AnyBuffer idx, ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> layout,
                      ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::AnyBuffer> routed) {
  return guarded([&] {
    Group& g = group_of(group, w.ordinal);
    Handle& h = handle_of(group, w.ordinal, slot);
    PrepareOptions o;
    o.capacity_factor = capacity_factor;
    o.drop_policy = by_probability ? DropPolicy::kByProbability : DropPolicy::kByPosition;
    h = Handle();  // the slot's routing block goes back first: the same addresses step after step
    h = prepare(g, view(w, idx), view(w, weights), o, Stream{w.stream});
    // The handle's views are the group's; XLA gets copies it owns.
    detail::copy_async(h.expert_offsets(), view(w, layout), Stream{w.stream});
    detail::copy_async(h.expert_rows(), view(w, rows), Stream{w.stream});
    detail::copy_async(h.routed_experts(), view(w, routed), Stream{w.stream});
  });
}

ffi::Error dispatch_op(Where w, int64_t group, int64_t slot, ffi::AnyBuffer x, ffi::AnyBuffer weights,
                       ffi::AnyBuffer /*layout: orders the call after prepare*/, ffi::Result<ffi::AnyBuffer> recv_x,
                       ffi::Result<ffi::AnyBuffer> recv_w) {
  return guarded([&] {
    dispatch_forward(group_of(group, w.ordinal), handle_of(group, w.ordinal, slot), view(w, x), view(w, weights),
                     view(w, recv_x), view(w, recv_w), Stream{w.stream});
  });
}

ffi::Error dispatch_bwd(Where w, int64_t group, int64_t slot, ffi::AnyBuffer d_recv_x, ffi::AnyBuffer d_recv_w,
                        ffi::AnyBuffer /*layout*/, ffi::Result<ffi::AnyBuffer> d_x, ffi::Result<ffi::AnyBuffer> d_w) {
  return guarded([&] {
    dispatch_backward(group_of(group, w.ordinal), handle_of(group, w.ordinal, slot), view(w, d_recv_x),
                      view(w, d_recv_w), view(w, d_x), view(w, d_w), Stream{w.stream});
  });
}

ffi::Error combine_op(Where w, int64_t group, int64_t slot, ffi::AnyBuffer y, ffi::AnyBuffer row_weights,
                      ffi::AnyBuffer /*layout*/, ffi::Result<ffi::AnyBuffer> out) {
  return guarded([&] {
    combine_forward(group_of(group, w.ordinal), handle_of(group, w.ordinal, slot), view(w, y), view(w, row_weights),
                    view(w, out), Stream{w.stream});
  });
}

ffi::Error combine_bwd(Where w, int64_t group, int64_t slot, ffi::AnyBuffer d_out, ffi::AnyBuffer y,
                       ffi::AnyBuffer row_weights, ffi::AnyBuffer /*layout*/, ffi::Result<ffi::AnyBuffer> d_y,
                       ffi::Result<ffi::AnyBuffer> d_rw) {
  return guarded([&] {
    combine_backward(group_of(group, w.ordinal), handle_of(group, w.ordinal, slot), view(w, d_out), view(w, y),
                     view(w, row_weights), view(w, d_y), view(w, d_rw), Stream{w.stream});
  });
}

ffi::Error all_reduce_op(Where w, int64_t group, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  return guarded([&] {
    const TensorRef o = view(w, out);
    detail::copy_async(view(w, x), o, Stream{w.stream});
    all_reduce_sum(group_of(group, w.ordinal), o, Stream{w.stream});
  });
}

MlpConfig mlp_config(int64_t activation, const TensorRef& row_weights) {
  MlpConfig c;
  c.activation = static_cast<Activation>(activation);
  c.apply_weights_early = row_weights.defined();
  return c;
}

ffi::Error mlp_fwd(Where w, int64_t activation, int64_t precision, ffi::AnyBuffer x, ffi::AnyBuffer offsets, ffi::AnyBuffer rows,
                   ffi::AnyBuffer row_weights, ffi::AnyBuffer w_in, ffi::AnyBuffer b_in, ffi::AnyBuffer w_out,
                   ffi::AnyBuffer b_out, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> a,
                   ffi::Result<ffi::AnyBuffer> h) {
  return guarded([&] {
    const TensorRef rw = view(w, row_weights);
    MlpConfig c = mlp_config(activation, rw);
    c.precision = static_cast<MlpPrecision>(precision);  // the backward never needs it (bf16 operands)
    expert_mlp_forward(c,
                       MlpTensors{view(w, x), view(w, offsets), view(w, rows), rw, view(w, w_in), view(w, b_in),
                                  view(w, w_out), view(w, b_out), view(w, a), view(w, h), view(w, y), {}},
                       Stream{w.stream});
  });
}

// weight_grads: the row weights were applied in combine (after FC2), which handed d_out over unweighted
// (MlpConfig::combine_weight_grads); else row_weights are the early weights or empty.
ffi::Error mlp_bwd(Where w, int64_t activation, int64_t weight_grads, ffi::AnyBuffer d_y, ffi::AnyBuffer x,
                   ffi::AnyBuffer offsets, ffi::AnyBuffer rows, ffi::AnyBuffer row_weights, ffi::AnyBuffer w_in,
                   ffi::AnyBuffer b_in, ffi::AnyBuffer w_out, ffi::AnyBuffer b_out, ffi::AnyBuffer a, ffi::AnyBuffer h,
                   ffi::Result<ffi::AnyBuffer> d_x, ffi::Result<ffi::AnyBuffer> d_rw, ffi::Result<ffi::AnyBuffer> d_w_in,
                   ffi::Result<ffi::AnyBuffer> d_b_in, ffi::Result<ffi::AnyBuffer> d_w_out,
                   ffi::Result<ffi::AnyBuffer> d_b_out, ffi::Result<ffi::AnyBuffer> workspace) {
  return guarded([&] {
    const TensorRef rw = view(w, row_weights), dx = view(w, d_x), drw = view(w, d_rw);
    // Rows past offsets[G] belong to no expert: their gradient is zero and the kernels skip them.
    detail::fill_zero(dx, Stream{w.stream});
    if (drw.defined()) detail::fill_zero(drw, Stream{w.stream});
    MlpConfig c = mlp_config(activation, rw);
    if (weight_grads != 0) {
      c.apply_weights_early = false;
      c.combine_weight_grads = true;
    }
    expert_mlp_backward(c,
                        MlpTensors{view(w, x), view(w, offsets), view(w, rows), rw, view(w, w_in), view(w, b_in),
                                   view(w, w_out), view(w, b_out), view(w, a), view(w, h), {}, {}},
                        // d_h and d_a in an XLA buffer of this call's own (stream-ordered, no shared scratch)
                        MlpGrads{view(w, d_y), dx, drw, view(w, d_w_in), view(w, d_b_in), view(w, d_w_out),
                                 view(w, d_b_out), view(w, workspace)},
                        Stream{w.stream});
  });
}

// ---- binding: one GPU form (XLA's stream and device ordinal) and one host form per op ----------
// Each bind_* adds an op's attributes, arguments and results (in its implementation's order) to a
// binding that may already hold the GPU context.
using Buf = ffi::AnyBuffer;

template <class B>
auto bind_route(B&& b) {
  return std::move(b).template Attr<int64_t>("router").template Arg<Buf>().template Arg<Buf>().template Ret<Buf>()
      .template Ret<Buf>();
}
template <class B>
auto bind_route_bwd(B&& b) {
  return std::move(b).template Attr<int64_t>("router").template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
      .template Arg<Buf>().template Ret<Buf>();
}
template <class B>
auto bind_prepare(B&& b) {
  return std::move(b).template Attr<int64_t>("group").template Attr<int64_t>("slot")
      .template Attr<float>("capacity_factor").template Attr<bool>("by_probability").template Arg<Buf>()
      .template Arg<Buf>().template Ret<Buf>().template Ret<Buf>().template Ret<Buf>();
}
template <class B>
auto bind_dispatch(B&& b) {  // dispatch and its backward: 3 arguments, 2 results
  return std::move(b).template Attr<int64_t>("group").template Attr<int64_t>("slot").template Arg<Buf>()
      .template Arg<Buf>().template Arg<Buf>().template Ret<Buf>().template Ret<Buf>();
}
template <class B>
auto bind_combine(B&& b) {
  return std::move(b).template Attr<int64_t>("group").template Attr<int64_t>("slot").template Arg<Buf>()
      .template Arg<Buf>().template Arg<Buf>().template Ret<Buf>();
}
template <class B>
auto bind_combine_bwd(B&& b) {
  return std::move(b).template Attr<int64_t>("group").template Attr<int64_t>("slot").template Arg<Buf>()
      .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>().template Ret<Buf>().template Ret<Buf>();
}
template <class B>
auto bind_all_reduce(B&& b) {
  return std::move(b).template Attr<int64_t>("group").template Arg<Buf>().template Ret<Buf>();
}
template <class B>
auto bind_mlp_fwd(B&& b) {
  auto a = std::move(b).template Attr<int64_t>("activation").template Attr<int64_t>("precision").template Arg<Buf>()
               .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
               .template Arg<Buf>().template Arg<Buf>();
  return std::move(a).template Ret<Buf>().template Ret<Buf>().template Ret<Buf>();
}
template <class B>
auto bind_mlp_bwd(B&& b) {
  auto a = std::move(b).template Attr<int64_t>("activation").template Attr<int64_t>("weight_grads")
               .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
               .template Arg<Buf>().template Arg<Buf>().template Arg<Buf>().template Arg<Buf>().template Arg<Buf>()
               .template Arg<Buf>();
  return std::move(a).template Ret<Buf>().template Ret<Buf>().template Ret<Buf>().template Ret<Buf>()
      .template Ret<Buf>().template Ret<Buf>().template Ret<Buf>();
}

// NAME_gpu / NAME_cpu: XLA handlers (plain functions) that decode the call frame once bound and
// call IMPL with where the call runs.
#define EPX_FFI_PAIR(NAME, IMPL, BIND)                                                                    \
  XLA_FFI_Error* NAME##_gpu(XLA_FFI_CallFrame* frame) {                                                 \
    static auto* h = BIND(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>().Ctx<ffi::DeviceOrdinal>()) \
                         .To([](void* s, int32_t ord, auto... a) { return IMPL(Where{ord, s}, a...); })  \
                         .release();                                                                     \
    return h->Call(frame);                                                                               \
  }                                                                                                      \
  XLA_FFI_Error* NAME##_cpu(XLA_FFI_CallFrame* frame) {                                                 \
    static auto* h =                                                                                     \
        BIND(ffi::Ffi::Bind()).To([](auto... a) { return IMPL(Where{-1, nullptr}, a...); }).release();  \
    return h->Call(frame);                                                                               \
  }

EPX_FFI_PAIR(epx_route, route, bind_route)
EPX_FFI_PAIR(epx_route_bwd, route_bwd, bind_route_bwd)
EPX_FFI_PAIR(epx_prepare, prepare_op, bind_prepare)
EPX_FFI_PAIR(epx_dispatch, dispatch_op, bind_dispatch)
EPX_FFI_PAIR(epx_dispatch_bwd, dispatch_bwd, bind_dispatch)
EPX_FFI_PAIR(epx_combine, combine_op, bind_combine)
EPX_FFI_PAIR(epx_combine_bwd, combine_bwd, bind_combine_bwd)
EPX_FFI_PAIR(epx_all_reduce, all_reduce_op, bind_all_reduce)
EPX_FFI_PAIR(epx_mlp_fwd, mlp_fwd, bind_mlp_fwd)
EPX_FFI_PAIR(epx_mlp_bwd, mlp_bwd, bind_mlp_bwd)
#undef EPX_FFI_PAIR

nb::capsule capsule(XLA_FFI_Error* (*h)(XLA_FFI_CallFrame*)) { return nb::capsule(reinterpret_cast<void*>(h)); }

}  // namespace

void bind_jax_ffi(nb::module_& m) {
  nb::module_ j = m.def_submodule("jax_ffi", "XLA FFI handlers of the epx ops (registered by epx.jax)");
  j.def("targets", [] {
    nb::dict d;
#define EPX_TARGET(NAME) d[#NAME] = nb::make_tuple(capsule(NAME##_gpu), capsule(NAME##_cpu))
    EPX_TARGET(epx_route);
    EPX_TARGET(epx_route_bwd);
    EPX_TARGET(epx_prepare);
    EPX_TARGET(epx_dispatch);
    EPX_TARGET(epx_dispatch_bwd);
    EPX_TARGET(epx_combine);
    EPX_TARGET(epx_combine_bwd);
    EPX_TARGET(epx_all_reduce);
    EPX_TARGET(epx_mlp_fwd);
    EPX_TARGET(epx_mlp_bwd);
#undef EPX_TARGET
    return d;
  });
  // A group view for the handlers: (id, device ordinal; -1 = host). The caller keeps it alive.
  j.def("register_group", [](int64_t id, int64_t ordinal, Group& g) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lk(r.mu);
    r.groups[{id, ordinal}] = &g;
  });
  j.def("unregister_group", [](int64_t id) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lk(r.mu);
    for (auto it = r.handles.begin(); it != r.handles.end();) it = std::get<0>(it->first) == id ? r.handles.erase(it) : std::next(it);
    for (auto it = r.groups.begin(); it != r.groups.end();) it = it->first.first == id ? r.groups.erase(it) : std::next(it);
  });
  j.def("register_router", [](int64_t id, const RouterConfig& c) {
    c.validate("epx.jax.Router");
    Registry& r = registry();
    std::lock_guard<std::mutex> lk(r.mu);
    r.routers[id] = c;
  });
}

}  // namespace epx::jax
