// epx._C: the C++ API for Python, framework-neutral. Tensors cross as Ref (pointer, dtype name,
// shape, device index; -1 = host memory) built by the framework layer (epx/torch), so this module
// needs no framework headers, works with any torch version, and never synchronises streams the way
// DLPack exchange may. Streams cross as integers (a cudaStream_t). Long calls release the GIL.
// epx::Error becomes ValueError (bad arguments), TimeoutError (a missing peer),
// NotImplementedError (not in this build) or RuntimeError, with epx's message unchanged.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "epx/epx.h"
#include "epx/presets.h"
#include "core/env_names.h"
#include "core/version.h"
#include "shape_of.h"
#ifdef EPX_WITH_JAX_FFI
#include "jax_ffi.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace epx {
namespace {

using Release = nb::call_guard<nb::gil_scoped_release>;

TensorRef make_ref(uintptr_t ptr, const std::string& dtype, const std::vector<int64_t>& shape, int device) {
  return TensorRef(reinterpret_cast<void*>(ptr), parse_dtype(dtype), shape_of(shape, "epx.Ref"),
                   device < 0 ? Device::cpu() : Device::cuda(device));
}

std::vector<int64_t> dims(const Shape& s) {
  std::vector<int64_t> d(s.ndim());
  for (int i = 0; i < s.ndim(); ++i) d[i] = s[i];
  return d;
}

Stream stream_of(uintptr_t s) { return Stream{reinterpret_cast<void*>(s)}; }

// A Ref's description for the framework layer: (pointer, dtype, shape, device index or -1).
std::tuple<uintptr_t, std::string, std::vector<int64_t>, int> describe(const TensorRef& t) {
  return {reinterpret_cast<uintptr_t>(t.data()), dtype_name(t.dtype()), dims(t.shape()),
          t.device().is_cpu() ? -1 : t.device().index};
}

const ParamSpec& spec_named(const MoELayer& layer, const std::string& name) {
  for (const ParamSpec& p : layer.param_specs())
    if (name == p.name) return p;
  std::string known;
  for (const ParamSpec& p : layer.param_specs()) known += std::string(known.empty() ? "" : ", ") + p.name;
  throw Error(Status::kInvalidArgument, "epx.MoELayer: no parameter named '" + name + "', this layer has " + known);
}

void bind_enums(nb::module_& m) {
  nb::enum_<DType>(m, "DType")
      .value("bf16", DType::kBF16).value("fp16", DType::kF16).value("fp32", DType::kF32).value("fp64", DType::kF64)
      .value("int32", DType::kI32).value("int64", DType::kI64).value("fp8_e4m3", DType::kF8E4M3)
      .value("fp8_e5m2", DType::kF8E5M2).value("e8m0", DType::kE8M0).value("uint8", DType::kU8);
  nb::enum_<ScoreFunction>(m, "ScoreFunction")
      .value("softmax", ScoreFunction::kSoftmax)
      .value("softmax_after_topk", ScoreFunction::kSoftmaxAfterTopk)
      .value("sigmoid", ScoreFunction::kSigmoid);
  nb::enum_<AuxLossType>(m, "AuxLossType")
      .value("none", AuxLossType::kNone).value("global_batch", AuxLossType::kGlobalBatch)
      .value("sequence", AuxLossType::kSequence);
  nb::enum_<Transport>(m, "Transport")
      .value("auto", Transport::kAuto).value("zerocopy", Transport::kZeroCopy).value("staged", Transport::kStaged)
      .value("host", Transport::kHost).value("local", Transport::kLocal);
  nb::enum_<Activation>(m, "Activation")
      .value("swiglu", Activation::kSwiGLU).value("geglu", Activation::kGeGLU).value("gelu", Activation::kGelu)
      .value("relu2", Activation::kRelu2);
  nb::enum_<MlpPrecision>(m, "MlpPrecision")
      .value("high", MlpPrecision::kHigh).value("fp8_block", MlpPrecision::kFp8Block).value("mxfp8", MlpPrecision::kMxfp8);
  nb::enum_<DropPolicy>(m, "DropPolicy")
      .value("by_position", DropPolicy::kByPosition).value("by_probability", DropPolicy::kByProbability);
  nb::enum_<ParamStorage>(m, "ParamStorage").value("owned", ParamStorage::kOwned).value("external", ParamStorage::kExternal);
}

void bind_configs(nb::module_& m) {
  nb::class_<GroupConfig>(m, "GroupConfig")
      .def(nb::init<>())
      .def_rw("num_experts", &GroupConfig::num_experts)
      .def_rw("hidden", &GroupConfig::hidden)
      .def_rw("max_tokens_per_rank", &GroupConfig::max_tokens_per_rank)
      .def_rw("max_topk", &GroupConfig::max_topk)
      .def_rw("max_dtype", &GroupConfig::max_dtype)
      .def_rw("align", &GroupConfig::align)
      .def_rw("recv_capacity_rows", &GroupConfig::recv_capacity_rows)
      .def_rw("num_sms", &GroupConfig::num_sms)
      .def_rw("timeout_s", &GroupConfig::timeout_s)
      .def_rw("transport", &GroupConfig::transport)
      .def_rw("staged_exact_sizes", &GroupConfig::staged_exact_sizes);
  nb::class_<RouterConfig>(m, "RouterConfig")
      .def(nb::init<>())
      .def_rw("num_experts", &RouterConfig::num_experts)
      .def_rw("topk", &RouterConfig::topk)
      .def_rw("score_function", &RouterConfig::score_function)
      .def_rw("num_groups", &RouterConfig::num_groups)
      .def_rw("group_topk", &RouterConfig::group_topk)
      .def_rw("normalize_weights", &RouterConfig::normalize_weights)
      .def_rw("routed_scaling_factor", &RouterConfig::routed_scaling_factor)
      .def_rw("use_expert_bias", &RouterConfig::use_expert_bias)
      .def_rw("aux_loss", &RouterConfig::aux_loss)
      .def_rw("aux_loss_coeff", &RouterConfig::aux_loss_coeff)
      .def_rw("seq_len", &RouterConfig::seq_len)
      .def_rw("z_loss_coeff", &RouterConfig::z_loss_coeff)
      .def("validate", [](const RouterConfig& c) { c.validate("epx.RouterConfig"); });
  nb::class_<PrepareOptions>(m, "PrepareOptions")
      .def(nb::init<>())
      .def_rw("capacity_factor", &PrepareOptions::capacity_factor)
      .def_rw("drop_policy", &PrepareOptions::drop_policy)
      .def_rw("recv_capacity_rows", &PrepareOptions::recv_capacity_rows);
  nb::class_<MlpConfig>(m, "MlpConfig")
      .def(nb::init<>())
      .def_rw("activation", &MlpConfig::activation)
      .def_rw("apply_weights_early", &MlpConfig::apply_weights_early)
      .def_rw("precision", &MlpConfig::precision)
      .def_rw("backward_consumes_saved", &MlpConfig::backward_consumes_saved)
      .def_rw("accumulate_weight_grads", &MlpConfig::accumulate_weight_grads)
      .def_rw("combine_weight_grads", &MlpConfig::combine_weight_grads);
  nb::class_<MoEConfig>(m, "MoEConfig")
      .def(nb::init<>())
      .def_rw("hidden", &MoEConfig::hidden)
      .def_rw("ffn_hidden", &MoEConfig::ffn_hidden)
      .def_rw("router", &MoEConfig::router)
      .def_rw("activation", &MoEConfig::activation)
      .def_rw("expert_bias_terms", &MoEConfig::expert_bias_terms)
      .def_rw("apply_weights_early", &MoEConfig::apply_weights_early)
      .def_rw("weight_grads_in_ffn", &MoEConfig::weight_grads_in_ffn)
      .def_rw("capacity", &MoEConfig::capacity)
      .def_rw("shared_ffn_hidden", &MoEConfig::shared_ffn_hidden)
      .def_rw("dtype", &MoEConfig::dtype)
      .def_rw("precision", &MoEConfig::precision)
      .def_rw("expert_grads_in_dtype", &MoEConfig::expert_grads_in_dtype)
      .def_rw("backward_keeps_saved", &MoEConfig::backward_keeps_saved)
      .def_rw("fp8_weight_cache", &MoEConfig::fp8_weight_cache)
      .def_rw("pipeline_chunks", &MoEConfig::pipeline_chunks)
      .def_rw("overlap_communication", &MoEConfig::overlap_communication);
  nb::class_<ShapePreset>(m, "ShapePreset")
      .def_ro("name", &ShapePreset::name)
      .def_ro("description", &ShapePreset::description)
      .def_ro("tokens", &ShapePreset::tokens)
      .def_ro("hidden", &ShapePreset::hidden)
      .def_ro("ffn_hidden", &ShapePreset::ffn_hidden)
      .def_ro("shared_ffn_hidden", &ShapePreset::shared_ffn_hidden)
      .def_ro("experts", &ShapePreset::experts)
      .def_ro("topk", &ShapePreset::topk);
  m.def("find_preset", &find_preset, nb::rv_policy::reference, "name"_a);
  m.def("preset_names", [] {
    std::vector<std::string> names;
    for (const ShapePreset& p : shape_presets()) names.push_back(p.name);
    return names;
  });
  m.def("moe_config", &moe_config, "preset"_a, "dtype"_a);
}

void bind_group(nb::module_& m) {
  nb::class_<TensorRef>(m, "Ref")
      .def("__init__",
           [](TensorRef* self, uintptr_t ptr, const std::string& dtype, const std::vector<int64_t>& shape, int device) {
             new (self) TensorRef(make_ref(ptr, dtype, shape, device));
           },
           "ptr"_a, "dtype"_a, "shape"_a, "device"_a)
      .def("describe", &describe)
      .def("__repr__", &TensorRef::str);

  nb::class_<Group>(m, "Group")
      .def_static("create_local", &Group::create_local, "config"_a, "device"_a = 0, Release())
      .def_static("create_simulated", &Group::create_simulated, "num_ranks"_a, "config"_a)
      .def_static("create_all_local", &Group::create_all_local, "config"_a, "devices"_a = std::vector<int>{}, Release())
      .def_static("from_nccl",
                  [](uintptr_t comm, const GroupConfig& c) { return Group::from_nccl(reinterpret_cast<void*>(comm), c); },
                  "nccl_comm"_a, "config"_a, Release())
      .def_static("create_from_env", &Group::create_from_env, "config"_a, Release())
      .def_static("create_from_id", &Group::create_from_id, "nccl_id"_a, "rank"_a, "world_size"_a, "device"_a,
                  "config"_a, Release())
      .def_prop_ro("rank", &Group::rank)
      .def_prop_ro("size", &Group::size)
      .def_prop_ro("local_experts", &Group::local_experts)
      .def_prop_ro("first_local_expert", &Group::first_local_expert)
      .def_prop_ro("config", &Group::config)
      .def_prop_ro("device", [](const Group& g) { return g.device().is_cpu() ? -1 : g.device().index; })
      .def_prop_ro("transport", &Group::transport)
      .def_prop_ro("recv_capacity_rows", &Group::recv_capacity_rows)
      .def_prop_ro("registered_bytes", &Group::registered_bytes)
      .def("check", &Group::check, Release());
  m.def("transport_name", &transport_name);
  m.def("nccl_unique_id", &nccl_unique_id);
  m.def("registered_bytes_per_rank", &registered_bytes_per_rank, "config"_a, "num_ranks"_a, "transport"_a);
  // The EPX_* variables epx reads, and those set in this process that it does not (misspellings).
  m.def("known_env_names", [] { return detail::known_env_names(); });
  m.def("unknown_env_names", [] { return detail::unknown_env_names(); });
  m.def("all_reduce_sum", [](Group& g, const TensorRef& b, uintptr_t s) { all_reduce_sum(g, b, stream_of(s)); },
        "group"_a, "buffer"_a, "stream"_a = 0, Release());

  nb::class_<Handle>(m, "Handle")
      .def(nb::init<>())
      .def_prop_ro("defined", &Handle::defined)
      .def_prop_ro("num_tokens", &Handle::num_tokens)
      .def_prop_ro("topk", &Handle::topk)
      .def_prop_ro("capacity", &Handle::capacity)
      .def_prop_ro("recv_capacity_rows", &Handle::recv_capacity_rows)
      .def_prop_ro("dispatched", &Handle::dispatched)
      .def_prop_ro("expert_offsets", &Handle::expert_offsets)
      .def_prop_ro("expert_rows", &Handle::expert_rows)
      .def_prop_ro("routed_counts", &Handle::routed_counts)
      .def_prop_ro("routed_experts", &Handle::routed_experts)
      .def("expert_offsets_host", &Handle::expert_offsets_host)
      .def("num_recv_rows_host", &Handle::num_recv_rows_host);
  // prepare into an existing Handle (a slot the framework layer keeps per microbatch): the old
  // routing block goes back to the group's pool first, so a slot reused step after step keeps
  // its addresses and a captured CUDA graph stays valid.
  m.def("prepare",
        [](Group& g, Handle& h, const TensorRef& idx, const TensorRef& w, const PrepareOptions& o, uintptr_t s) {
          h = Handle();
          h = prepare(g, idx, w, o, stream_of(s));
        },
        "group"_a, "handle"_a, "topk_idx"_a, "topk_weights"_a, "options"_a, "stream"_a = 0, Release());
}

void bind_ops(nb::module_& m) {
  m.def("route_forward",
        [](const RouterConfig& c, const TensorRef& logits, const TensorRef& bias, const TensorRef& idx,
           const TensorRef& w, const TensorRef& prob_sum, const TensorRef& counts, const TensorRef& scalars,
           uintptr_t s) { route_forward(c, logits, bias, idx, w, RouterStats{prob_sum, counts, scalars}, stream_of(s)); },
        "config"_a, "logits"_a, "expert_bias"_a, "topk_idx"_a, "topk_weights"_a, "prob_sum"_a, "counts"_a,
        "scalars"_a, "stream"_a = 0, Release());
  m.def("count_routed",
        [](const RouterConfig& c, const TensorRef& routed, const TensorRef& prob_sum, const TensorRef& counts,
           const TensorRef& scalars, uintptr_t s) { count_routed(c, routed, RouterStats{prob_sum, counts, scalars}, stream_of(s)); },
        "config"_a, "routed_experts"_a, "prob_sum"_a, "counts"_a, "scalars"_a, "stream"_a = 0, Release());
  m.def("router_losses",
        [](const RouterConfig& c, const TensorRef& prob_sum, const TensorRef& counts, const TensorRef& scalars,
           const TensorRef& losses, uintptr_t s) { router_losses(c, RouterStats{prob_sum, counts, scalars}, losses, stream_of(s)); },
        "config"_a, "prob_sum"_a, "counts"_a, "scalars"_a, "losses"_a, "stream"_a = 0, Release());
  m.def("route_backward",
        [](const RouterConfig& c, const TensorRef& logits, const TensorRef& bias, const TensorRef& idx,
           const TensorRef& d_w, const TensorRef& prob_sum, const TensorRef& counts, const TensorRef& scalars,
           double d_aux, double d_z, const TensorRef& d_logits, uintptr_t s) {
          route_backward(c, logits, bias, idx, d_w, RouterStats{prob_sum, counts, scalars}, d_aux, d_z, d_logits,
                         stream_of(s));
        },
        "config"_a, "logits"_a, "expert_bias"_a, "topk_idx"_a, "d_topk_weights"_a, "prob_sum"_a, "counts"_a,
        "scalars"_a, "d_aux"_a, "d_z"_a, "d_logits"_a, "stream"_a = 0, Release());
  m.def("dispatch_forward",
        [](Group& g, Handle& h, const TensorRef& x, const TensorRef& x_scales, const TensorRef& w, const TensorRef& recv_x,
           const TensorRef& recv_scales, const TensorRef& recv_w, uintptr_t s) {
          if (x_scales.defined() || recv_scales.defined())
            dispatch_forward(g, h, x, x_scales, w, recv_x, recv_scales, recv_w, stream_of(s));
          else
            dispatch_forward(g, h, x, w, recv_x, recv_w, stream_of(s));
        },
        "group"_a, "handle"_a, "x"_a, "x_scales"_a, "topk_weights"_a, "recv_x"_a, "recv_scales"_a, "recv_weights"_a,
        "stream"_a = 0, Release());
  m.def("combine_forward",
        [](Group& g, Handle& h, const TensorRef& y, const TensorRef& rw, const TensorRef& out, uintptr_t s) {
          combine_forward(g, h, y, rw, out, stream_of(s));
        },
        "group"_a, "handle"_a, "y"_a, "row_weights"_a, "out"_a, "stream"_a = 0, Release());
  m.def("combine_backward",
        [](Group& g, Handle& h, const TensorRef& d_out, const TensorRef& y, const TensorRef& rw, const TensorRef& d_y,
           const TensorRef& d_rw, uintptr_t s) { combine_backward(g, h, d_out, y, rw, d_y, d_rw, stream_of(s)); },
        "group"_a, "handle"_a, "d_out"_a, "y"_a, "row_weights"_a, "d_y"_a, "d_row_weights"_a, "stream"_a = 0, Release());
  m.def("dispatch_backward",
        [](Group& g, Handle& h, const TensorRef& d_recv_x, const TensorRef& d_recv_w, const TensorRef& d_x,
           const TensorRef& d_topk_w, uintptr_t s) { dispatch_backward(g, h, d_recv_x, d_recv_w, d_x, d_topk_w, stream_of(s)); },
        "group"_a, "handle"_a, "d_recv_x"_a, "d_recv_weights"_a, "d_x"_a, "d_topk_weights"_a, "stream"_a = 0, Release());
  m.def("grouped_gemm_forward",
        [](const TensorRef& x, const TensorRef& w, const TensorRef& offsets, const TensorRef& rows, const TensorRef& y,
           uintptr_t s, int64_t row_align) { grouped_gemm_forward(x, w, offsets, rows, y, stream_of(s), row_align); },
        "x"_a, "w"_a, "offsets"_a, "rows"_a, "y"_a, "stream"_a = 0, "row_align"_a = 1, Release());
  m.def("expert_mlp_forward",
        [](const MlpConfig& c, const TensorRef& x, const TensorRef& offsets, const TensorRef& rows, const TensorRef& rw,
           const TensorRef& w_in, const TensorRef& b_in, const TensorRef& w_out, const TensorRef& b_out, const TensorRef& a,
           const TensorRef& h, const TensorRef& y, uintptr_t s) {
          expert_mlp_forward(c, MlpTensors{x, offsets, rows, rw, w_in, b_in, w_out, b_out, a, h, y, {}}, stream_of(s));
        },
        "config"_a, "x"_a, "offsets"_a, "rows"_a, "row_weights"_a, "w_in"_a, "b_in"_a, "w_out"_a, "b_out"_a, "a"_a,
        "h"_a, "y"_a, "stream"_a = 0, Release());
  m.def("expert_mlp_backward",
        [](const MlpConfig& c, const TensorRef& x, const TensorRef& offsets, const TensorRef& rows, const TensorRef& rw,
           const TensorRef& w_in, const TensorRef& b_in, const TensorRef& w_out, const TensorRef& b_out, const TensorRef& a,
           const TensorRef& h, const TensorRef& d_y, const TensorRef& d_x, const TensorRef& d_rw, const TensorRef& d_w_in,
           const TensorRef& d_b_in, const TensorRef& d_w_out, const TensorRef& d_b_out, uintptr_t s,
           const TensorRef& workspace) {
          expert_mlp_backward(c, MlpTensors{x, offsets, rows, rw, w_in, b_in, w_out, b_out, a, h, {}, {}},
                              MlpGrads{d_y, d_x, d_rw, d_w_in, d_b_in, d_w_out, d_b_out, workspace}, stream_of(s));
        },
        "config"_a, "x"_a, "offsets"_a, "rows"_a, "row_weights"_a, "w_in"_a, "b_in"_a, "w_out"_a, "b_out"_a, "a"_a,
        "h"_a, "d_y"_a, "d_x"_a, "d_row_weights"_a, "d_w_in"_a, "d_b_in"_a, "d_w_out"_a, "d_b_out"_a, "stream"_a = 0,
        "workspace"_a = TensorRef(), Release());
}

void bind_layer(nb::module_& m) {
  nb::class_<MoEContext>(m, "MoEContext")
      .def(nb::init<>())
      .def_prop_ro("losses", [](const MoEContext& c) { return c.losses().ref(); })
      .def_prop_ro("topk_idx", [](const MoEContext& c) { return c.topk_idx().ref(); })
      .def_prop_ro("topk_weights", [](const MoEContext& c) { return c.topk_weights().ref(); })
      .def_prop_ro("counts", [](const MoEContext& c) { return c.router_stats().counts; });
  m.def("update_expert_bias",
        [](const TensorRef& bias, const TensorRef& counts, float rate, uintptr_t s) {
          update_expert_bias(bias, counts, rate, stream_of(s));
        },
        "expert_bias"_a, "counts"_a, "rate"_a, "stream"_a = 0, Release());

  // The layer keeps its Group alive through nb::keep_alive, and binds the framework's tensors
  // (kept alive by the framework layer, which owns them as parameters).
  nb::class_<MoELayer>(m, "MoELayer")
      .def(nb::init<Group&, const MoEConfig&, ParamStorage>(), "group"_a, "config"_a,
           "storage"_a = ParamStorage::kOwned, nb::keep_alive<1, 2>())
      .def_prop_ro("config", &MoELayer::config)
      .def("param_specs",
           [](const MoELayer& l) {
             std::vector<std::tuple<std::string, std::vector<int64_t>, std::string, std::string, bool>> out;
             for (const ParamSpec& p : l.param_specs())
               out.emplace_back(p.name, dims(p.shape), dtype_name(p.dtype), dtype_name(p.grad_dtype), p.trained);
             return out;
           })
      .def("bind_param",
           [](MoELayer& l, const std::string& name, const TensorRef& t) {
             l.params().*spec_named(l, name).field = Tensor::wrap(t, nullptr);
           },
           "name"_a, "tensor"_a)
      .def("bind_grad",
           [](MoELayer& l, const std::string& name, const TensorRef& t) {
             l.grads().*spec_named(l, name).field = Tensor::wrap(t, nullptr);
           },
           "name"_a, "tensor"_a)
      .def("param", [](MoELayer& l, const std::string& name) { return (l.params().*spec_named(l, name).field).ref(); })
      .def("grad", [](MoELayer& l, const std::string& name) { return (l.grads().*spec_named(l, name).field).ref(); })
      .def("init_params", &MoELayer::init_params, "seed"_a, "stddev"_a = 0.02, Release())
      .def("forward",
           [](MoELayer& l, const TensorRef& x, const TensorRef& out, MoEContext& ctx, uintptr_t s) {
             l.forward(x, out, ctx, stream_of(s));
           },
           "x"_a, "out"_a, "ctx"_a, "stream"_a = 0, Release())
      .def("backward",
           [](MoELayer& l, MoEContext& ctx, const TensorRef& d_out, const TensorRef& d_x, double d_aux, double d_z,
              uintptr_t s, bool accumulate_grads) {
             l.backward(ctx, d_out, d_x, d_aux, d_z, stream_of(s), accumulate_grads);
           },
           "ctx"_a, "d_out"_a, "d_x"_a, "d_aux"_a = 1.0, "d_z"_a = 1.0, "stream"_a = 0, "accumulate_grads"_a = false,
           Release())
      .def("refresh_fp8_weights", [](MoELayer& l, uintptr_t s) { l.refresh_fp8_weights(stream_of(s)); },
           "stream"_a = 0, Release());
}

}  // namespace
}  // namespace epx

NB_MODULE(_C, m) {
  m.doc() = "epx: Mixture-of-Experts layers with expert parallelism (C++ core)";
  // The framework layers keep groups, layers and configs in registries that live until exit.
  nb::set_leak_warnings(false);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const epx::Error& e) {
      switch (e.status()) {
        case epx::Status::kInvalidArgument: PyErr_SetString(PyExc_ValueError, e.what()); break;
        case epx::Status::kTimeout: PyErr_SetString(PyExc_TimeoutError, e.what()); break;
        case epx::Status::kNotSupported: PyErr_SetString(PyExc_NotImplementedError, e.what()); break;
        default: PyErr_SetString(PyExc_RuntimeError, e.what()); break;
      }
    }
  });
  const epx::BuildInfo info = epx::build_info();
  m.attr("__version__") = info.version;
  m.attr("cuda_backend") = info.cuda_backend;
  m.attr("gpu_grouped_gemm") = info.gpu_grouped_gemm;
  m.attr("nccl_version") = info.nccl;
  epx::bind_enums(m);
  epx::bind_configs(m);
  epx::bind_group(m);
  epx::bind_ops(m);
  epx::bind_layer(m);
#ifdef EPX_WITH_JAX_FFI
  epx::jax::bind_jax_ffi(m);
#endif
}
