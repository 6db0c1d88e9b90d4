"""The epx ops as torch.library custom ops (namespace `epx`): route, prepare, dispatch, combine,
grouped_mlp and the whole layer (moe_forward), each with a fake kernel (torch.compile traces them
without running) and an autograd rule whose backward is itself a custom op.

State that lives in C++ (a group's buffers, the routing handle of one (layer, microbatch) slot, a
layer's saved activations) is named by integers (group id, slot, layer id), never passed as a
Python object, so every op has a plain schema. The handle's order is carried by data: prepare
returns the expert offsets and dispatch / combine take them back as `layout`, so no compiler can
reorder or drop prepare while its routing is still to be used.

Every op runs on torch's current stream of its tensors' device and never synchronises the host,
so a step made of them can be captured in a CUDA graph.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .. import _C
from ._group import group_by_id
from ._tensors import NONE, alias, ref, stream_of

# ---- routers: configs named by id --------------------------------------------------------------
_routers = {}


def register_router(config):
    rid = len(_routers) + 1
    _routers[rid] = config
    return rid


def _router(rid):
    try:
        return _routers[rid]
    except KeyError:
        raise ValueError(f"epx.torch: no Router with id {rid}") from None


def _float_dtype_of(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


# ---- route -------------------------------------------------------------------------------------
@torch.library.custom_op("epx::route", mutates_args=())
def route(logits: Tensor, expert_bias: Optional[Tensor], router_id: int) -> Tuple[Tensor, Tensor]:
    c = _router(router_id)
    T = logits.shape[0]
    idx = torch.empty((T, c.topk), dtype=torch.int32, device=logits.device)
    w = torch.empty((T, c.topk), dtype=_float_dtype_of(logits), device=logits.device)
    _C.route_forward(c, ref(logits, "logits", "epx.route"), ref(expert_bias, "expert_bias", "epx.route"), ref(idx),
                     ref(w), NONE, NONE, NONE, stream_of(logits))
    return idx, w


@route.register_fake
def _(logits, expert_bias, router_id):
    k = _router(router_id).topk
    T = logits.shape[0]
    return (logits.new_empty((T, k), dtype=torch.int32), logits.new_empty((T, k), dtype=_float_dtype_of(logits)))


@torch.library.custom_op("epx::route_backward", mutates_args=())
def route_backward(d_topk_weights: Tensor, logits: Tensor, expert_bias: Optional[Tensor], topk_idx: Tensor,
                   router_id: int) -> Tensor:
    c = _router(router_id)
    d_logits = torch.empty_like(logits)
    _C.route_backward(c, ref(logits), ref(expert_bias), ref(topk_idx), ref(d_topk_weights.contiguous()), NONE, NONE,
                      NONE, 0.0, 0.0, ref(d_logits), stream_of(logits))
    return d_logits


@route_backward.register_fake
def _(d_topk_weights, logits, expert_bias, topk_idx, router_id):
    return torch.empty_like(logits)


def _route_setup(ctx, inputs, output):
    logits, expert_bias, router_id = inputs
    ctx.save_for_backward(logits, expert_bias, output[0])
    ctx.router_id = router_id
    ctx.mark_non_differentiable(output[0])


def _route_bwd(ctx, d_idx, d_w):
    logits, expert_bias, idx = ctx.saved_tensors
    return route_backward(d_w, logits, expert_bias, idx, ctx.router_id), None, None


route.register_autograd(_route_bwd, setup_context=_route_setup)


# ---- prepare -----------------------------------------------------------------------------------
@torch.library.custom_op("epx::prepare", mutates_args=())
def prepare(topk_idx: Tensor, topk_weights: Optional[Tensor], group_id: int, slot: int, capacity_factor: float,
            drop_by_probability: bool) -> Tuple[Tensor, Tensor, Tensor]:
    g = group_by_id(group_id)
    o = _C.PrepareOptions()
    o.capacity_factor = capacity_factor
    o.drop_policy = _C.DropPolicy.by_probability if drop_by_probability else _C.DropPolicy.by_position
    h = g.handle(slot)
    _C.prepare(g._g, h, ref(topk_idx, "topk_idx", "epx.prepare"), ref(topk_weights, "topk_weights", "epx.prepare"), o,
               stream_of(topk_idx))
    # Copies, not views: the outputs are torch's, whatever later happens to the slot.
    return alias(h.expert_offsets).clone(), alias(h.expert_rows).clone(), alias(h.routed_experts).clone()


@prepare.register_fake
def _(topk_idx, topk_weights, group_id, slot, capacity_factor, drop_by_probability):
    le = group_by_id(group_id).local_experts
    return (topk_idx.new_empty((le + 1,), dtype=torch.int32), topk_idx.new_empty((le,), dtype=torch.int32),
            topk_idx.new_empty(topk_idx.shape, dtype=torch.int32))


def _weight_dtype(w):
    return w.dtype if w is not None else torch.float32


# ---- dispatch ----------------------------------------------------------------------------------
def _payload_out(g, x, cols):
    return x.new_empty((g.recv_capacity_rows, cols))


@torch.library.custom_op("epx::dispatch", mutates_args=())
def dispatch(x: Tensor, topk_weights: Optional[Tensor], layout: Tensor, group_id: int, slot: int) -> Tuple[Tensor, Tensor]:
    g = group_by_id(group_id)
    recv_x = _payload_out(g, x, x.shape[1])
    recv_w = x.new_empty((g.recv_capacity_rows if topk_weights is not None else 0,), dtype=_weight_dtype(topk_weights))
    _C.dispatch_forward(g._g, g.handle(slot), ref(x, "x", "epx.dispatch"), NONE,
                        ref(topk_weights, "topk_weights", "epx.dispatch"), ref(recv_x), NONE,
                        ref(recv_w) if topk_weights is not None else NONE, stream_of(x))
    return recv_x, recv_w


@dispatch.register_fake
def _(x, topk_weights, layout, group_id, slot):
    g = group_by_id(group_id)
    n = g.recv_capacity_rows if topk_weights is not None else 0
    return _payload_out(g, x, x.shape[1]), x.new_empty((n,), dtype=_weight_dtype(topk_weights))


@torch.library.custom_op("epx::dispatch_backward", mutates_args=())
def dispatch_backward(d_recv_x: Tensor, d_recv_weights: Tensor, layout: Tensor, num_tokens: int, topk: int,
                      with_weights: bool, group_id: int, slot: int) -> Tuple[Tensor, Tensor]:
    g = group_by_id(group_id)
    d_x = d_recv_x.new_empty((num_tokens, d_recv_x.shape[1]))
    d_w = d_recv_x.new_empty((num_tokens if with_weights else 0, topk), dtype=d_recv_weights.dtype)
    _C.dispatch_backward(g._g, g.handle(slot), ref(d_recv_x.contiguous()),
                         ref(d_recv_weights.contiguous()) if with_weights else NONE, ref(d_x),
                         ref(d_w) if with_weights else NONE, stream_of(d_recv_x))
    return d_x, d_w


@dispatch_backward.register_fake
def _(d_recv_x, d_recv_weights, layout, num_tokens, topk, with_weights, group_id, slot):
    return (d_recv_x.new_empty((num_tokens, d_recv_x.shape[1])),
            d_recv_x.new_empty((num_tokens if with_weights else 0, topk), dtype=d_recv_weights.dtype))


def _dispatch_setup(ctx, inputs, output):
    x, topk_weights, layout, group_id, slot = inputs
    ctx.save_for_backward(layout)
    ctx.args = (x.shape[0], topk_weights.shape[1] if topk_weights is not None else 0, topk_weights is not None,
                group_id, slot)


def _dispatch_bwd(ctx, d_recv_x, d_recv_w):
    (layout,) = ctx.saved_tensors
    d_x, d_w = dispatch_backward(d_recv_x, d_recv_w, layout, *ctx.args)
    return d_x, (d_w if ctx.args[2] else None), None, None, None


dispatch.register_autograd(_dispatch_bwd, setup_context=_dispatch_setup)


# ---- combine -----------------------------------------------------------------------------------
@torch.library.custom_op("epx::combine", mutates_args=())
def combine(y: Tensor, row_weights: Optional[Tensor], layout: Tensor, num_tokens: int, group_id: int,
            slot: int) -> Tensor:
    g = group_by_id(group_id)
    out = y.new_empty((num_tokens, y.shape[1]))
    _C.combine_forward(g._g, g.handle(slot), ref(y, "y", "epx.combine"), ref(row_weights, "row_weights", "epx.combine"),
                       ref(out), stream_of(y))
    return out


@combine.register_fake
def _(y, row_weights, layout, num_tokens, group_id, slot):
    return y.new_empty((num_tokens, y.shape[1]))


@torch.library.custom_op("epx::combine_backward", mutates_args=())
def combine_backward(d_out: Tensor, y: Tensor, row_weights: Optional[Tensor], layout: Tensor, group_id: int,
                     slot: int) -> Tuple[Tensor, Tensor]:
    g = group_by_id(group_id)
    d_y = torch.empty_like(y)
    d_rw = y.new_empty((y.shape[0] if row_weights is not None else 0,), dtype=_weight_dtype(row_weights))
    _C.combine_backward(g._g, g.handle(slot), ref(d_out.contiguous()), ref(y), ref(row_weights), ref(d_y),
                        ref(d_rw) if row_weights is not None else NONE, stream_of(y))
    return d_y, d_rw


@combine_backward.register_fake
def _(d_out, y, row_weights, layout, group_id, slot):
    return torch.empty_like(y), y.new_empty((y.shape[0] if row_weights is not None else 0,),
                                            dtype=_weight_dtype(row_weights))


def _combine_setup(ctx, inputs, output):
    y, row_weights, layout, num_tokens, group_id, slot = inputs
    ctx.save_for_backward(y, row_weights, layout)
    ctx.args = (group_id, slot)


def _combine_bwd(ctx, d_out):
    y, row_weights, layout = ctx.saved_tensors
    d_y, d_rw = combine_backward(d_out, y, row_weights, layout, *ctx.args)
    return d_y, (d_rw if row_weights is not None else None), None, None, None, None


combine.register_autograd(_combine_bwd, setup_context=_combine_setup)


# ---- grouped expert FFN ------------------------------------------------------------------------
_ACTIVATIONS = {"swiglu": _C.Activation.swiglu, "geglu": _C.Activation.geglu, "gelu": _C.Activation.gelu,
                "relu2": _C.Activation.relu2}


def _mlp_config(activation, weights_early):
    c = _C.MlpConfig()
    try:
        c.activation = _ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(f"epx.grouped_mlp: activation is '{activation}', expected one of "
                         f"{', '.join(_ACTIVATIONS)}") from None
    c.apply_weights_early = weights_early
    return c


def _mlp_saved_shapes(x, w_in):
    rows, (_, _, P, F) = x.shape[0], w_in.shape
    return (rows, P, F), (rows, F)


@torch.library.custom_op("epx::grouped_mlp", mutates_args=())
def grouped_mlp(x: Tensor, offsets: Tensor, rows: Tensor, row_weights: Optional[Tensor], w_in: Tensor,
                b_in: Optional[Tensor], w_out: Tensor, b_out: Optional[Tensor], activation: str) -> Tuple[Tensor, Tensor, Tensor]:
    fn = "epx.grouped_mlp"
    if w_in.dim() != 4:
        raise ValueError(f"{fn}: w_in has shape {list(w_in.shape)}, expected [experts, hidden, projections, ffn]")
    a_shape, h_shape = _mlp_saved_shapes(x, w_in)
    a, h = x.new_empty(a_shape), x.new_empty(h_shape)
    y = x.new_empty((x.shape[0], w_out.shape[-1]))
    _C.expert_mlp_forward(_mlp_config(activation, row_weights is not None), ref(x, "x", fn), ref(offsets, "offsets", fn),
                          ref(rows, "rows", fn), ref(row_weights, "row_weights", fn), ref(w_in, "w_in", fn),
                          ref(b_in, "b_in", fn), ref(w_out, "w_out", fn), ref(b_out, "b_out", fn), ref(a), ref(h),
                          ref(y), stream_of(x))
    return y, a, h


@grouped_mlp.register_fake
def _(x, offsets, rows, row_weights, w_in, b_in, w_out, b_out, activation):
    a_shape, h_shape = _mlp_saved_shapes(x, w_in)
    return x.new_empty((x.shape[0], w_out.shape[-1])), x.new_empty(a_shape), x.new_empty(h_shape)


def _maybe_empty_like(t):
    return torch.empty_like(t) if t is not None else None


@torch.library.custom_op("epx::grouped_mlp_backward", mutates_args=())
def grouped_mlp_backward(d_y: Tensor, x: Tensor, offsets: Tensor, rows: Tensor, row_weights: Optional[Tensor],
                         w_in: Tensor, b_in: Optional[Tensor], w_out: Tensor, b_out: Optional[Tensor], a: Tensor,
                         h: Tensor, activation: str) -> List[Tensor]:
    # Rows past offsets[G] are no expert's: their gradient is zero, and the kernel leaves them alone.
    d_x = torch.zeros_like(x)
    d_rw = torch.zeros_like(row_weights) if row_weights is not None else None
    d_w_in, d_w_out = torch.empty_like(w_in), torch.empty_like(w_out)
    d_b_in, d_b_out = _maybe_empty_like(b_in), _maybe_empty_like(b_out)
    # a and h stay intact (backward_consumes_saved off): autograd may run this backward again. On
    # the GPU, d_h and d_a live in a workspace from torch's allocator (stream-ordered, this op's own).
    ws = x.new_empty((x.shape[0], (a.shape[1] + 1) * a.shape[2]), dtype=a.dtype) if x.is_cuda else None
    _C.expert_mlp_backward(_mlp_config(activation, row_weights is not None), ref(x), ref(offsets), ref(rows),
                           ref(row_weights), ref(w_in), ref(b_in), ref(w_out), ref(b_out), ref(a), ref(h),
                           ref(d_y.contiguous()), ref(d_x), ref(d_rw), ref(d_w_in), ref(d_b_in), ref(d_w_out),
                           ref(d_b_out), stream_of(x), ref(ws))
    # Custom-op outputs may not alias each other: a fresh empty tensor for each absent gradient.
    given = lambda g: g if g is not None else x.new_empty((0,))  # noqa: E731
    return [d_x, given(d_rw), d_w_in, given(d_b_in), d_w_out, given(d_b_out)]


@grouped_mlp_backward.register_fake
def _(d_y, x, offsets, rows, row_weights, w_in, b_in, w_out, b_out, a, h, activation):
    like = lambda t: torch.empty_like(t) if t is not None else x.new_empty((0,))  # noqa: E731
    return [torch.empty_like(x), like(row_weights), torch.empty_like(w_in), like(b_in), torch.empty_like(w_out),
            like(b_out)]


def _mlp_setup(ctx, inputs, output):
    x, offsets, rows, row_weights, w_in, b_in, w_out, b_out, activation = inputs
    ctx.save_for_backward(x, offsets, rows, row_weights, w_in, b_in, w_out, b_out, output[1], output[2])
    ctx.activation = activation
    ctx.mark_non_differentiable(output[1], output[2])


def _mlp_bwd(ctx, d_y, d_a, d_h):
    x, offsets, rows, row_weights, w_in, b_in, w_out, b_out, a, h = ctx.saved_tensors
    d_x, d_rw, d_w_in, d_b_in, d_w_out, d_b_out = grouped_mlp_backward(d_y, x, offsets, rows, row_weights, w_in, b_in,
                                                                       w_out, b_out, a, h, ctx.activation)
    opt = lambda g, t: g if t is not None else None  # noqa: E731
    return d_x, None, None, opt(d_rw, row_weights), d_w_in, opt(d_b_in, b_in), d_w_out, opt(d_b_out, b_out), None


grouped_mlp.register_autograd(_mlp_bwd, setup_context=_mlp_setup)


# ---- the whole layer ---------------------------------------------------------------------------
_layers = {}  # id -> epx.torch.MoE's C++ side (see _module.py)


def register_layer(layer):
    lid = len(_layers) + 1
    _layers[lid] = layer
    return lid


def layer_by_id(lid):
    try:
        return _layers[lid]
    except KeyError:
        raise ValueError(f"epx.torch: no MoE layer with id {lid}") from None


@torch.library.custom_op("epx::moe_forward", mutates_args=())
def moe_forward(x: Tensor, params: List[Tensor], layer_id: int, slot: int) -> Tuple[Tensor, Tensor]:
    L = layer_by_id(layer_id)
    L.bind_params(params)
    out = torch.empty_like(x)
    ctx = L.context(slot)
    L.layer.forward(ref(x, "x", "epx.MoE"), ref(out), ctx, stream_of(x))
    return out, alias(ctx.losses).clone()


@moe_forward.register_fake
def _(x, params, layer_id, slot):
    return torch.empty_like(x), x.new_empty((2,), dtype=torch.float64 if x.dtype == torch.float64 else torch.float32)


@torch.library.custom_op("epx::moe_backward", mutates_args=())
def moe_backward(d_out: Tensor, x: Tensor, params: List[Tensor], layer_id: int, slot: int,
                 loss_grad_scale: float) -> List[Tensor]:
    L = layer_by_id(layer_id)
    L.bind_params(params)
    grads = L.bind_new_grads(d_out.device)
    d_x = torch.empty_like(d_out)
    L.layer.backward(L.context(slot), ref(d_out.contiguous()), ref(d_x), loss_grad_scale, loss_grad_scale,
                     stream_of(d_out))
    return [d_x] + [g.to(p.dtype) for g, p in zip(grads, L.trained(params))]


@moe_backward.register_fake
def _(d_out, x, params, layer_id, slot, loss_grad_scale):
    L = layer_by_id(layer_id)
    return [torch.empty_like(d_out)] + [torch.empty_like(p) for p in L.trained(params)]


def _moe_setup(ctx, inputs, output):
    x, params, layer_id, slot = inputs
    ctx.save_for_backward(x, *params)
    ctx.args = (layer_id, slot)
    ctx.mark_non_differentiable(output[1])


def _moe_bwd(ctx, d_out, d_losses):
    x, *params = ctx.saved_tensors
    layer_id, slot = ctx.args
    L = layer_by_id(layer_id)
    d_x, *d_trained = moe_backward(d_out, x, params, layer_id, slot, L.loss_grad_scale)
    it = iter(d_trained)
    d_params = [next(it) if trained else None for trained in L.trained_mask]
    return d_x, d_params, None, None


moe_forward.register_autograd(_moe_bwd, setup_context=_moe_setup)
