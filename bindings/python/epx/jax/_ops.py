"""The epx ops for JAX: XLA FFI calls (registered once per process, for the CUDA and the host
platforms) wrapped in custom_vjp rules.

A routing handle lives in C++ under (group id, device, slot) and is named by static attributes; the
order of the calls that share it is data: prepare returns the expert offsets (`layout`) and
dispatch / combine and their backwards take them as an argument, and the calls that change the
handle (prepare, dispatch) are marked as having side effects so XLA neither drops nor merges them.
Everything runs on XLA's stream with no host synchronisation, so the ops compose with jit and
shard_map (each device of a mesh runs the call on its own group view).
"""
import weakref
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from .. import _C

try:
    _ffi = _C.jax_ffi
except AttributeError:  # built without JAX's FFI headers
    raise ImportError("epx was built without the JAX FFI handlers: install jax (with jaxlib) in the Python "
                      "that builds epx, then rebuild (pip install . or CMake)") from None

_registered = False


def register_targets():
    """Registers the handlers with XLA once per process (both platforms)."""
    global _registered
    if _registered:
        return
    for name, (gpu, cpu) in _ffi.targets().items():
        jax.ffi.register_ffi_target(name, gpu, platform="CUDA")
        jax.ffi.register_ffi_target(name, cpu, platform="cpu")
    _registered = True


register_targets()

_ACTIVATIONS = {"swiglu": 0, "geglu": 1, "gelu": 2, "relu2": 3}
_routers = {}


def _none(dtype=jnp.float32):
    return jnp.zeros((0,), dtype)  # an absent optional argument


def _i64(v):
    return np.int64(v)


# ---- router --------------------------------------------------------------------------------------
def register_router(config):
    rid = len(_routers) + 1
    _ffi.register_router(rid, config)
    _routers[rid] = config
    return rid


def _weights_dtype(logits):
    return jnp.float64 if logits.dtype == jnp.float64 else jnp.float32


def _route_call(router_id, topk, logits, bias):
    T = logits.shape[0]
    out = (jax.ShapeDtypeStruct((T, topk), jnp.int32), jax.ShapeDtypeStruct((T, topk), _weights_dtype(logits)))
    return jax.ffi.ffi_call("epx_route", out)(logits, bias, router=_i64(router_id))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def route(router_id, topk, logits, bias):
    """logits [T, E] -> (topk_idx [T, K] int32, topk_weights [T, K]); bias [E] fp32 or a [0] array."""
    return _route_call(router_id, topk, logits, bias)


def _route_fwd(router_id, topk, logits, bias):
    idx, w = _route_call(router_id, topk, logits, bias)
    return (idx, w), (logits, bias, idx)


def _route_bwd(router_id, topk, res, cts):
    logits, bias, idx = res
    _, d_w = cts
    d_logits = jax.ffi.ffi_call("epx_route_bwd", jax.ShapeDtypeStruct(logits.shape, logits.dtype))(
        d_w.astype(_weights_dtype(logits)), logits, bias, idx, router=_i64(router_id))
    return d_logits, jnp.zeros_like(bias)  # the selection bias gets no gradient


route.defvjp(_route_fwd, _route_bwd)


# ---- prepare -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    """Where this device's tokens go: `layout` [E_local + 1] int32 padded row offsets of the local
    experts (the last is the received row count), `rows` [E_local] their real rows, `routed`
    [T, K] the expert each slot kept (-1: masked or dropped). group_id / slot / capacity /
    num_tokens are static."""
    layout: jax.Array
    rows: jax.Array
    routed: jax.Array
    group_id: int
    slot: int
    capacity: int
    num_tokens: int


jax.tree_util.register_dataclass(Routing, data_fields=["layout", "rows", "routed"],
                                 meta_fields=["group_id", "slot", "capacity", "num_tokens"])


# (group id, slot) pairs prepared by the function being traced, per trace: a second prepare of the
# same slot in one traced function would overwrite the routing the first one's dispatch, combine
# and backward still read.
_slots_in_trace = weakref.WeakKeyDictionary()


def _claim_slot(group_id, slot, tracer):
    trace = getattr(tracer, "_trace", None)
    if trace is None:  # eager without a transformation: each op completes before the next
        return
    try:
        used = _slots_in_trace.setdefault(trace, set())
    except TypeError:  # a trace type that cannot be weakly referenced: no check
        return
    if (group_id, slot) in used:
        raise ValueError(f"epx.jax.prepare: slot {slot} of group {group_id} is already prepared in this traced "
                         "function; each layer and each in-flight microbatch needs its own slot (the second "
                         "prepare would overwrite the routing the first one's dispatch, combine and backward read)")
    used.add((group_id, slot))


def prepare(group, slot, topk_idx, topk_weights=None, capacity_factor=0.0, by_probability=False):
    """Counts, expert-major offsets and per-rank destinations of topk_idx [T, K] (-1 = masked),
    kept in the group's handle `slot` (one per layer x in-flight microbatch; a slot prepared twice
    in one traced function is a ValueError). Collective."""
    _claim_slot(group.id, int(slot), topk_idx)
    T, K = topk_idx.shape
    le = group.local_experts
    out = (jax.ShapeDtypeStruct((le + 1,), jnp.int32), jax.ShapeDtypeStruct((le,), jnp.int32),
           jax.ShapeDtypeStruct((T, K), jnp.int32))
    w = topk_weights if topk_weights is not None else _none()
    layout, rows, routed = jax.ffi.ffi_call("epx_prepare", out, has_side_effect=True)(
        jax.lax.stop_gradient(topk_idx), jax.lax.stop_gradient(w), group=_i64(group.id), slot=_i64(slot),
        capacity_factor=np.float32(capacity_factor), by_probability=bool(by_probability))
    return Routing(layout, rows, routed, group.id, int(slot), group.recv_capacity_rows, T)


# ---- dispatch ------------------------------------------------------------------------------------
def _dispatch_call(r, x, w):
    out = (jax.ShapeDtypeStruct((r.capacity, x.shape[1]), x.dtype),
           jax.ShapeDtypeStruct((r.capacity if w.size else 0,), w.dtype))
    return jax.ffi.ffi_call("epx_dispatch", out, has_side_effect=True)(x, w, r.layout, group=_i64(r.group_id),
                                                                       slot=_i64(r.slot))


@jax.custom_vjp
def _dispatch(r, x, w):
    return _dispatch_call(r, x, w)


def _dispatch_fwd(r, x, w):
    return _dispatch_call(r, x, w), (r, w)  # w ([T, K]) only for its shape and dtype


def _dispatch_bwd(res, cts):
    r, w = res
    w_shape, w_dtype = w.shape, w.dtype
    d_recv_x, d_recv_w = cts
    out = (jax.ShapeDtypeStruct((r.num_tokens, d_recv_x.shape[1]), d_recv_x.dtype),
           jax.ShapeDtypeStruct(w_shape, w_dtype))
    d_x, d_w = jax.ffi.ffi_call("epx_dispatch_bwd", out)(d_recv_x, d_recv_w.astype(w_dtype), r.layout,
                                                         group=_i64(r.group_id), slot=_i64(r.slot))
    return _zero_routing(r), d_x, d_w


def _zero_routing(r):
    return jax.tree_util.tree_map(lambda a: np.zeros(a.shape, jax.dtypes.float0), r)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def dispatch(routing, x, topk_weights=None):
    """x [T, H] -> (recv_x [capacity, H], recv_weights [capacity]): every token once per
    destination rank, expanded there into the expert-major layout (rows of local expert j in
    [layout[j], layout[j] + rows[j]), zero padding up to layout[j+1]; rows past layout[-1]
    unspecified). Differentiable in x and topk_weights. Collective."""
    w = topk_weights if topk_weights is not None else _none()
    recv_x, recv_w = _dispatch(routing, x, w)
    return recv_x, (recv_w if topk_weights is not None else None)


# ---- combine -------------------------------------------------------------------------------------
def _combine_call(r, y, rw):
    out = jax.ShapeDtypeStruct((r.num_tokens, y.shape[1]), y.dtype)
    return jax.ffi.ffi_call("epx_combine", out)(y, rw, r.layout, group=_i64(r.group_id), slot=_i64(r.slot))


@jax.custom_vjp
def _combine(r, y, rw):
    return _combine_call(r, y, rw)


def _combine_fwd(r, y, rw):
    return _combine_call(r, y, rw), (r, y, rw)


def _combine_bwd(res, d_out):
    r, y, rw = res
    out = (jax.ShapeDtypeStruct(y.shape, y.dtype), jax.ShapeDtypeStruct(rw.shape, rw.dtype))
    d_y, d_rw = jax.ffi.ffi_call("epx_combine_bwd", out)(d_out, y, rw, r.layout, group=_i64(r.group_id),
                                                         slot=_i64(r.slot))
    return _zero_routing(r), d_y, d_rw


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(routing, y, row_weights=None):
    """y [capacity, H] expert outputs -> out [T, H]: the weighted (row_weights from dispatch) or
    plain sum over each token's slots, fp32, deterministic. Differentiable in y and row_weights."""
    return _combine(routing, y, row_weights if row_weights is not None else _none())


# ---- sum over the group ------------------------------------------------------------------------
def _group_sum_call(group_id, x):
    return jax.ffi.ffi_call("epx_all_reduce", jax.ShapeDtypeStruct(x.shape, x.dtype))(x, group=_i64(group_id))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def group_sum(group_id, x):
    """The sum of a float vector over the group, on the same stream and in the same order as the
    other epx ops (an XLA collective beside epx's device-waiting kernels could wait on them). Its
    transpose is the same sum of the cotangents, as for lax.psum: a loss that every rank adds and
    that is then averaged over the ranks (lax.pmean) gets its gradient once."""
    return _group_sum_call(group_id, x)


group_sum.defvjp(lambda gid, x: (_group_sum_call(gid, x), None), lambda gid, _, d: (_group_sum_call(gid, d),))


# ---- grouped expert FFN --------------------------------------------------------------------------
_PRECISIONS = {"high": 0, "fp8_block": 1, "mxfp8": 2}


def _check_choices(op, activation, precision):
    if activation not in _ACTIVATIONS:
        raise ValueError(f"epx.jax.{op}: activation is '{activation}', expected one of {', '.join(_ACTIVATIONS)}")
    if precision not in _PRECISIONS:
        raise ValueError(f"epx.jax.{op}: precision is '{precision}', expected one of {', '.join(_PRECISIONS)}")


def _mlp_call(act, prec, x, layout, rows, rw, w_in, b_in, w_out, b_out):
    n, P, F = x.shape[0], w_in.shape[2], w_in.shape[3]
    out = (jax.ShapeDtypeStruct((n, w_out.shape[-1]), x.dtype), jax.ShapeDtypeStruct((n, P, F), x.dtype),
           jax.ShapeDtypeStruct((n, F), x.dtype))
    return jax.ffi.ffi_call("epx_mlp_fwd", out)(x, layout, rows, rw, w_in, b_in, w_out, b_out, activation=_i64(act),
                                                precision=_i64(prec))


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _mlp(act, prec, x, layout, rows, rw, w_in, b_in, w_out, b_out):
    return _mlp_call(act, prec, x, layout, rows, rw, w_in, b_in, w_out, b_out)[0]


def _mlp_fwd(act, prec, x, layout, rows, rw, w_in, b_in, w_out, b_out):
    y, a, h = _mlp_call(act, prec, x, layout, rows, rw, w_in, b_in, w_out, b_out)
    return y, (x, layout, rows, rw, w_in, b_in, w_out, b_out, a, h)


def _mlp_bwd_call(act, weight_grads, d_y, x, layout, rows, rw, w_in, b_in, w_out, b_out, a, h):
    """(d_x, d_rw, d_w_in, d_b_in, d_w_out, d_b_out); weight_grads: rw were applied in combine, whose
    backward handed d_y over unweighted (the FFN's backward weights it and gives rw's gradient)."""
    like = lambda t: jax.ShapeDtypeStruct(t.shape, t.dtype)  # noqa: E731
    # the last output is the backward's workspace for d_h and d_a (dropped after the call)
    workspace = jax.ShapeDtypeStruct((x.shape[0], (a.shape[1] + 1) * a.shape[2]), a.dtype)
    out = (like(x), like(rw), like(w_in), like(b_in), like(w_out), like(b_out), workspace)
    return jax.ffi.ffi_call("epx_mlp_bwd", out)(d_y, x, layout, rows, rw, w_in, b_in, w_out, b_out, a, h,
                                                activation=_i64(act), weight_grads=_i64(weight_grads))[:6]


def _mlp_bwd(act, prec, res, d_y):  # the backward is the same whatever the forward's precision
    x, layout, rows, rw, w_in, b_in, w_out, b_out, a, h = res
    d_x, d_rw, d_w_in, d_b_in, d_w_out, d_b_out = _mlp_bwd_call(act, 0, d_y, *res)
    int0 = lambda t: np.zeros(t.shape, jax.dtypes.float0)  # noqa: E731
    return d_x, int0(layout), int0(rows), d_rw, d_w_in, d_b_in, d_w_out, d_b_out


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def grouped_mlp(x, layout, rows, w_in, w_out, *, b_in=None, b_out=None, row_weights=None, activation="swiglu",
                precision="high"):
    """The experts' FFN over the expert-major layout: y = act(x . w_in[j] + b_in[j]) . w_out[j] +
    b_out[j] for the rows of each local expert j (w_in [G, H, P, F], P = 2 for gated activations;
    w_out [G, F, H]); with row_weights the activation is scaled by each row's weight before FC2.
    precision "fp8_block" runs the forward's GEMMs on FP8 operands (DeepSeek-V3 block scales; on a
    GPU H and F multiples of 128); the backward is the same in every precision."""
    _check_choices("grouped_mlp", activation, precision)
    none = _none(x.dtype)
    return _mlp(_ACTIVATIONS[activation], _PRECISIONS[precision], x, layout, rows,
                row_weights if row_weights is not None else _none(jnp.float64 if x.dtype == jnp.float64 else jnp.float32),
                w_in, b_in if b_in is not None else none, w_out, b_out if b_out is not None else none)


# ---- expert FFN and combine in one op --------------------------------------------------------------
def _expert_block_fwd_call(act, prec, r, x, rw, w_in, w_out):
    none = _none(x.dtype)
    y, a, h = _mlp_call(act, prec, x, r.layout, r.rows, _none(rw.dtype), w_in, none, w_out, none)
    return _combine_call(r, y, rw), a, h


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _expert_block(act, prec, r, x, rw, w_in, w_out):
    return _expert_block_fwd_call(act, prec, r, x, rw, w_in, w_out)[0]


def _expert_block_fwd(act, prec, r, x, rw, w_in, w_out):
    out, a, h = _expert_block_fwd_call(act, prec, r, x, rw, w_in, w_out)
    return out, (r, x, rw, w_in, w_out, a, h)  # not the expert outputs y: the backward does not read them


def _expert_block_bwd(act, prec, res, d_out):
    r, x, rw, w_in, w_out, a, h = res
    # combine's backward without weights: d_out copied to every slot's row, as a dispatch moves x
    y_like = jax.ShapeDtypeStruct((x.shape[0], w_out.shape[-1]), x.dtype)
    none_w = _none(rw.dtype)
    d_y, _ = jax.ffi.ffi_call("epx_combine_bwd", (y_like, jax.ShapeDtypeStruct(none_w.shape, none_w.dtype)))(
        d_out, _none(x.dtype), none_w, r.layout, group=_i64(r.group_id), slot=_i64(r.slot))
    # the FFN's backward weights d_y's rows and gives the weights' gradient <d_y W_out^T, act(a)>
    none = _none(x.dtype)
    d_x, d_rw, d_w_in, _, d_w_out, _ = _mlp_bwd_call(act, 1, d_y, x, r.layout, r.rows, rw, w_in, none, w_out, none,
                                                     a, h)
    return _zero_routing(r), d_x, d_rw, d_w_in, d_w_out


_expert_block.defvjp(_expert_block_fwd, _expert_block_bwd)


def expert_block(routing, x, row_weights, w_in, w_out, *, activation="swiglu", precision="high"):
    """combine(routing, grouped_mlp(x, ...), row_weights) as one differentiable op, for experts without
    biases: out [T, H] from the dispatched rows x [capacity, H] and their weights [capacity]. Its
    backward takes the weights' gradient inside the FFN's, <d_y W_out^T, act(a)> over F columns, instead
    of <d_out, y> over H in combine's, so the forward keeps no expert outputs y for it and combine's
    backward is a plain copy of d_out to the rows (the C++ layer's MoEConfig::weight_grads_in_ffn).
    The same gradients as the two ops composed, up to rounding."""
    _check_choices("expert_block", activation, precision)
    if row_weights is None:
        raise ValueError("epx.jax.expert_block: row_weights is None (dispatch the topk weights; without weights "
                         "compose grouped_mlp and combine)")
    return _expert_block(_ACTIVATIONS[activation], _PRECISIONS[precision], routing, x, row_weights, w_in, w_out)
