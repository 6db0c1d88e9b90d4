"""epx for JAX: the expert-parallel MoE ops as XLA FFI calls with custom_vjp rules, usable inside
jit and shard_map, and the MoE layer (moe_layer, and MoEBlock when Flax is installed).

    import jax, epx.jax as epj
    group = epj.Group.local(num_experts=256, hidden=7168, max_tokens_per_rank=4096)  # every local GPU
    spec = epj.LayerSpec.from_preset("deepseek-v3")
    # inside shard_map over the mesh axis "ep" (one device per rank):
    out, losses = epj.moe_layer(params, x, group=group, spec=spec, slot=0)

Groups are made once per process, outside traced functions; each layer x in-flight microbatch
uses its own routing slot. epx allocates its communication buffers itself (cudaMalloc, NCCL
windows): leave it room with XLA_PYTHON_CLIENT_PREALLOCATE=false or XLA_PYTHON_CLIENT_MEM_FRACTION.
"""
from ._group import Group
from ._layer import LayerSpec, MoEBlock, init_params, moe_layer, router_losses, slot_of, update_expert_bias
from ._ops import Routing, combine, dispatch, grouped_mlp, prepare, register_router, route

__all__ = ["Group", "LayerSpec", "MoEBlock", "init_params", "moe_layer", "router_losses", "slot_of",
           "update_expert_bias", "Routing", "combine", "dispatch", "grouped_mlp", "prepare", "register_router",
           "route", "Router"]


class Router:
    """router(logits [T, E], expert_bias [E] or None) -> (topk_idx int32, topk_weights): the
    scores, (grouped) top-k and weights; differentiable in the weights."""

    def __init__(self, num_experts, topk, *, score="softmax", num_groups=1, group_topk=1, normalize_weights=False,
                 routed_scaling_factor=1.0, use_expert_bias=False):
        from .. import _C
        scores = {"softmax": _C.ScoreFunction.softmax, "softmax_after_topk": _C.ScoreFunction.softmax_after_topk,
                  "sigmoid": _C.ScoreFunction.sigmoid}
        if score not in scores:
            raise ValueError(f"epx.jax.Router: score is '{score}', expected one of {', '.join(scores)}")
        c = _C.RouterConfig()
        c.num_experts, c.topk, c.score_function = int(num_experts), int(topk), scores[score]
        c.num_groups, c.group_topk = int(num_groups), int(group_topk)
        c.normalize_weights, c.routed_scaling_factor = bool(normalize_weights), float(routed_scaling_factor)
        c.use_expert_bias = bool(use_expert_bias)
        self.topk = c.topk
        self.id = register_router(c)

    def __call__(self, logits, expert_bias=None):
        import jax.numpy as jnp
        return route(self.id, self.topk, logits, expert_bias if expert_bias is not None else jnp.zeros((0,), jnp.float32))
