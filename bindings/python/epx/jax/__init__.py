"""epx for JAX: the expert-parallel MoE ops as XLA FFI calls with custom_vjp rules, usable inside
jit and shard_map, and the MoE layer (moe_layer, and MoEBlock when Flax is installed).

    import jax, epx.jax as epj
    group = epj.Group.local(num_experts=256, hidden=7168, max_tokens_per_rank=4096)  # every local GPU
    spec = epj.LayerSpec.from_preset("deepseek-v3")
    # inside shard_map over the mesh axis "ep" (one device per rank):
    out, losses = epj.moe_layer(params, x, group=group, spec=spec, slot=0)

Groups are made once per process, outside traced functions; each layer x in-flight microbatch
uses its own routing slot. epx allocates its communication buffers itself (cudaMalloc, NCCL
windows), outside JAX's pool: JAX's default preallocation (75% of each GPU) leaves them room, and a
lower XLA_PYTHON_CLIENT_MEM_FRACTION leaves more. XLA_PYTHON_CLIENT_PREALLOCATE=false works too but
made queued training steps several times slower in our measurements.
"""
from ._group import Group
from ._layer import LayerSpec, MoEBlock, init_params, moe_layer, router_losses, slot_of, update_expert_bias
from ._ops import Routing, combine, dispatch, expert_block, grouped_mlp, prepare, register_router, route
from ._shard_map import shard_map

__all__ = ["Group", "LayerSpec", "MoEBlock", "init_params", "moe_layer", "router_losses", "slot_of",
           "update_expert_bias", "Routing", "combine", "dispatch", "expert_block", "grouped_mlp", "prepare",
           "register_router", "route", "Router", "shard_map"]


class Router:
    """router(logits [T, E], expert_bias [E] or None) -> (topk_idx int32, topk_weights): the
    scores, (grouped) top-k and weights; differentiable in the weights."""

    def __init__(self, num_experts, topk, **options):
        """options: score ("softmax", "softmax_after_topk", "sigmoid"), num_groups, group_topk,
        normalize_weights, routed_scaling_factor, use_expert_bias."""
        from .. import _config
        c = _config.router_config(num_experts, topk, who="epx.jax.Router", **options)
        self.topk = c.topk
        self.id = register_router(c)

    def __call__(self, logits, expert_bias=None):
        import jax.numpy as jnp
        return route(self.id, self.topk, logits, expert_bias if expert_bias is not None else jnp.zeros((0,), jnp.float32))
