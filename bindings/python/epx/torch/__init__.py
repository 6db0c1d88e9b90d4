"""epx for PyTorch: expert-parallel MoE ops and the MoE block as torch ops.

    import torch, torch.distributed as dist, epx.torch as ept
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    group = ept.Group.from_process_group(num_experts=256, hidden=7168, max_tokens_per_rank=4096)
    moe = ept.MoE(group, "deepseek-v3")          # parameters: gate, w_in, w_out, shared_w_*, ...
    out = moe(x)                                 # x [tokens, 7168] bf16 on this rank's GPU
    out.float().pow(2).mean().backward()

The ops (torch.ops.epx.*: route, prepare, dispatch, combine, grouped_mlp, moe_forward and their
backwards) are torch.library custom ops with fake kernels and autograd, so they work under
torch.compile(fullgraph=True) and CUDA graphs. The functions below are their Python faces.
"""
from dataclasses import dataclass

import torch

from .. import _config
from . import _ops
from ._group import Group, group_config
from ._module import MoE, layer_config, refresh_fp8_weights_after_steps

__all__ = ["Group", "group_config", "MoE", "layer_config", "refresh_fp8_weights_after_steps", "Router", "Routing", "prepare", "dispatch", "combine",
           "grouped_mlp"]

def _tensor(fn, name, t, optional=False):
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fn}: {name} is a {type(t).__name__}, expected a torch.Tensor")


class Router:
    """Scores, (grouped) top-k selection and weights of every token: router(logits [T, E] fp32 /
    bf16, expert_bias [E] fp32 or None) -> (topk_idx [T, K] int32, topk_weights [T, K] fp32);
    -1 marks a slot with no eligible expert (NaN logits). Differentiable in the weights. The aux
    and z losses are the MoE block's (they need the routing actually kept, over the group)."""

    def __init__(self, num_experts, topk, **options):
        """options: score ("softmax", "softmax_after_topk", "sigmoid"), num_groups, group_topk,
        normalize_weights, routed_scaling_factor, use_expert_bias."""
        self.config = _config.router_config(num_experts, topk, who="epx.torch.Router", **options)
        self.id = _ops.register_router(self.config)

    def __call__(self, logits, expert_bias=None):
        _tensor("epx.torch.Router", "logits", logits)
        _tensor("epx.torch.Router", "expert_bias", expert_bias, optional=True)
        return _ops.route(logits, expert_bias, self.id)


@dataclass
class Routing:
    """prepare's result: where this rank's tokens go. `layout` [E_local + 1] int32 padded row
    offsets of the local experts (the last is the received row count) and `rows` [E_local] their
    real rows, both on the device; routed_experts [T, K] the kept expert of every slot (-1 =
    masked or dropped)."""
    group: Group
    slot: int
    num_tokens: int
    layout: torch.Tensor
    rows: torch.Tensor
    routed_experts: torch.Tensor


def prepare(group: Group, topk_idx, topk_weights=None, *, slot: int = 0, capacity_factor: float = 0.0,
            drop_policy: str = "by_position") -> Routing:
    """Counts, expert-major offsets and per-rank destinations of topk_idx [T, K] (int32 / int64; -1 =
    masked), kept in the group's handle `slot` (one slot per layer x in-flight microbatch). With
    capacity_factor > 0 each expert keeps ceil(cf * T * K / E) pairs, dropped by position or by
    probability (drop_policy="by_probability" needs topk_weights). Collective."""
    _tensor("epx.torch.prepare", "topk_idx", topk_idx)
    _tensor("epx.torch.prepare", "topk_weights", topk_weights, optional=True)
    if drop_policy not in ("by_position", "by_probability"):
        raise ValueError(f"epx.torch.prepare: drop_policy is '{drop_policy}', expected by_position or by_probability")
    layout, rows, routed = _ops.prepare(topk_idx, topk_weights, group.id, slot, float(capacity_factor),
                                        drop_policy == "by_probability")
    return Routing(group, slot, topk_idx.shape[0], layout, rows, routed)


def dispatch(routing: Routing, x, topk_weights=None):
    """x [T, H] -> (recv_x [recv_capacity_rows, H], recv_weights [recv_capacity_rows] fp32): every
    token once per destination rank, expanded there into the expert-major layout (rows of local
    expert j in [layout[j], layout[j] + rows[j]), zero padding up to layout[j+1]; rows past
    layout[-1] unspecified). Differentiable in x and topk_weights. Collective."""
    _tensor("epx.torch.dispatch", "x", x)
    _tensor("epx.torch.dispatch", "topk_weights", topk_weights, optional=True)
    return _ops.dispatch(x, topk_weights, routing.layout, routing.group.id, routing.slot)


def combine(routing: Routing, y, row_weights=None):
    """y [recv_capacity_rows, H] expert outputs -> out [T, H]: the weighted (row_weights from
    dispatch) or plain sum over each token's slots, in fp32, deterministic. Differentiable in y
    and row_weights. Collective."""
    _tensor("epx.torch.combine", "y", y)
    _tensor("epx.torch.combine", "row_weights", row_weights, optional=True)
    return _ops.combine(y, row_weights, routing.layout, routing.num_tokens, routing.group.id, routing.slot)


def grouped_mlp(x, layout, rows, w_in, w_out, *, b_in=None, b_out=None, row_weights=None, activation="swiglu"):
    """The experts' FFN over the expert-major layout: y = act(x . w_in[j] + b_in[j]) . w_out[j] +
    b_out[j] for the rows of each local expert j (w_in [G, H, P, F] with P = 2 for gated
    activations, w_out [G, F, H]); with row_weights the activation is scaled by each row's weight
    before FC2. Differentiable in x, the weights, biases and row_weights."""
    y, _, _ = _ops.grouped_mlp(x, layout, rows, row_weights, w_in, b_in, w_out, b_out, activation)
    return y
