"""The MoE layer in JAX over the epx ops: gate -> route -> prepare -> dispatch -> grouped expert FFN
-> combine, plus shared experts, as a pure function of its parameters (moe_layer) and as a Flax
module (MoEBlock). Inside shard_map each device holds its local experts; the aux and z losses are
global over the expert-parallel group (their statistics are summed by epx in stream order)."""
import zlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from .. import _C, _config
from ._ops import combine, dispatch, expert_block, group_sum, grouped_mlp, prepare, register_router, route


@dataclass(frozen=True)
class LayerSpec:
    """The static description of a layer (hashable: it is a jit-static argument)."""
    hidden: int
    ffn_hidden: int
    shared_ffn_hidden: int
    num_experts: int
    topk: int
    router_id: int
    score: str
    aux_loss_coeff: float
    z_loss_coeff: float
    precision: str = "high"  # the expert GEMMs' forward: "high", "fp8_block" or "mxfp8" (see grouped_mlp)
    # the routing weights' gradient through FC2 (expert_block) rather than in combine's backward
    weight_grads_in_ffn: bool = True

    @staticmethod
    def from_preset(preset="deepseek-v3", **overrides):
        p = _C.find_preset(preset)
        c = _C.moe_config(p, _C.DType.bf16)
        r = c.router
        for k in ("num_experts", "topk", "num_groups", "group_topk", "normalize_weights", "routed_scaling_factor",
                  "use_expert_bias"):
            if k in overrides:
                setattr(r, k, overrides.pop(k))
        aux = float(overrides.pop("aux_loss_coeff", r.aux_loss_coeff))
        z = float(overrides.pop("z_loss_coeff", r.z_loss_coeff))
        hidden = int(overrides.pop("hidden", c.hidden))
        ffn = int(overrides.pop("ffn_hidden", c.ffn_hidden))
        shared = int(overrides.pop("shared_ffn_hidden", c.shared_ffn_hidden))
        precision = str(overrides.pop("precision", "high"))
        weight_grads_in_ffn = bool(overrides.pop("weight_grads_in_ffn", True))
        if precision not in ("high", "fp8_block", "mxfp8"):
            raise ValueError(f"epx.jax.LayerSpec: precision is '{precision}', expected 'high', 'fp8_block' or 'mxfp8'")
        if overrides:
            raise ValueError(f"epx.jax: unknown option(s) {', '.join(overrides)}")
        # The FFI router selects and weighs; the losses are computed here in JAX (differentiable).
        r.aux_loss = _C.AuxLossType.none
        r.aux_loss_coeff = 0.0
        r.z_loss_coeff = 0.0
        score = next(name for name, f in _config.SCORES.items() if f == r.score_function)
        return LayerSpec(hidden, ffn, shared, r.num_experts, r.topk, register_router(r), score, aux, z, precision,
                         weight_grads_in_ffn)

    @property
    def use_expert_bias(self):
        from ._ops import _routers
        return _routers[self.router_id].use_expert_bias


def router_losses(spec, logits, routed, group):
    """(aux, z, counts) on the routing actually used, global over the group: aux = coeff * E / (K T^2)
    * sum_e P_e n_e with P_e the summed probabilities (softmax, or normalised sigmoid scores) and n_e
    the routed pairs, z = coeff * sum_t logsumexp(logits_t)^2 / T, T every rank's tokens. The three
    statistics travel in one sum over the group, in stream order with the other epx ops."""
    if logits.dtype != jnp.float64:
        logits = logits.astype(jnp.float32)
    if spec.score == "sigmoid":
        s = jax.nn.sigmoid(logits)
        p = s / jnp.sum(s, -1, keepdims=True)
    else:
        p = jax.nn.softmax(logits, -1)
    E, K = spec.num_experts, spec.topk
    T = jnp.asarray(logits.shape[0] * group.size, logits.dtype)
    lse = jax.nn.logsumexp(logits, -1)
    n_local = jax.lax.stop_gradient(jnp.sum(jax.nn.one_hot(routed, E, dtype=logits.dtype), (0, 1)))
    stats = group_sum(group.id, jnp.concatenate([jnp.sum(p, 0), n_local, jnp.sum(lse * lse)[None]]))
    P, n, lse2 = stats[:E], jax.lax.stop_gradient(stats[E:2 * E]), stats[2 * E]
    aux = spec.aux_loss_coeff * E / (K * T * T) * jnp.sum(P * n)
    z = spec.z_loss_coeff * lse2 / T
    return aux, z, n


@jax.custom_vjp
def gate_logits(x, gate):
    """logits = x . gate with fp32 output (fp64 for fp64 inputs); the backward's two GEMMs take the
    gradient rounded to x's dtype, as tensor cores take it (an fp32 cotangent would make XLA run
    them in fp32)."""
    return jnp.dot(x, gate, preferred_element_type=jnp.float64 if x.dtype == jnp.float64 else jnp.float32)


def _gate_fwd(x, gate):
    return gate_logits(x, gate), (x, gate)


def _gate_bwd(res, d_logits):
    x, gate = res
    d = d_logits.astype(x.dtype)
    return jnp.dot(d, gate.T), jnp.dot(x.T, d)


gate_logits.defvjp(_gate_fwd, _gate_bwd)


def moe_layer(params, x, *, group, spec, slot):
    """x [T, H] -> (out [T, H], {"aux", "z", "counts"}). params: gate [H, E], w_in [E_local, H, 2, F],
    w_out [E_local, F, H], optional expert_bias [E] (selection only, never differentiated) and
    shared_w_in [1, H, 2, Fs] / shared_w_out [1, Fs, H]. `slot` names this layer x microbatch's routing
    handle (static). Collective over the group (inside shard_map: every device of the mesh axis
    the group spans); the losses are global over the group."""
    logits = gate_logits(x, params["gate"])
    bias = params.get("expert_bias")
    bias = jax.lax.stop_gradient(bias) if bias is not None else jnp.zeros((0,), jnp.float32)
    idx, w = route(spec.router_id, spec.topk, logits, bias)
    r = prepare(group, slot, idx, w)
    recv_x, recv_w = dispatch(r, x, w)
    if spec.weight_grads_in_ffn:
        out = expert_block(r, recv_x, recv_w, params["w_in"], params["w_out"], precision=spec.precision)
    else:
        y = grouped_mlp(recv_x, r.layout, r.rows, params["w_in"], params["w_out"], precision=spec.precision)
        out = combine(r, y, recv_w)
    if "shared_w_in" in params:
        # The shared experts: one dense FFN over every token, as a one-group grouped FFN (the same
        # kernels, fp32 accumulation, and a backward in the layer dtype).
        T = x.shape[0]
        shared = grouped_mlp(x, jnp.array([0, T], jnp.int32), jnp.array([T], jnp.int32), params["shared_w_in"],
                             params["shared_w_out"], precision=spec.precision)
        out = out + shared
    aux, z, counts = router_losses(spec, logits, r.routed, group)
    return out, {"aux": aux, "z": z, "counts": counts}


def update_expert_bias(bias, counts, rate=1e-3):
    """DeepSeek-V3's aux-loss-free balancing: bias[e] += rate * sign(mean(n) - n[e])."""
    return bias + rate * jnp.sign(jnp.mean(counts) - counts)


def init_params(key, spec, local_experts, dtype=jnp.bfloat16, std=0.02):
    """Normal(0, std) parameters of this rank's slice (local_experts of them)."""
    H, F, Fs, E = spec.hidden, spec.ffn_hidden, spec.shared_ffn_hidden, spec.num_experts
    k = jax.random.split(key, 5)
    n = lambda kk, shape: (std * jax.random.normal(kk, shape, jnp.float32)).astype(dtype)  # noqa: E731
    p = {"gate": n(k[0], (H, E)), "w_in": n(k[1], (local_experts, H, 2, F)), "w_out": n(k[2], (local_experts, F, H))}
    if spec.use_expert_bias:
        p["expert_bias"] = jnp.zeros((E,), jnp.float32)
    if Fs > 0:
        p["shared_w_in"] = n(k[3], (1, H, 2, Fs))
        p["shared_w_out"] = n(k[4], (1, Fs, H))
    return p


def slot_of(name, microbatch=0):
    """A routing slot from a stable name (e.g. a module path) and a microbatch index."""
    return (zlib.crc32(name.encode()) & 0xFFFFFF) * 64 + int(microbatch)


try:
    import flax.linen as nn

    class MoEBlock(nn.Module):
        """The MoE layer as a Flax module (inside shard_map over the group's devices for expert
        parallelism). Parameters: gate, w_in, w_out, shared_w_in,
        shared_w_out; the expert bias lives in the "moe_state" collection (mutable) and is
        updated with update_expert_bias from the "counts" the layer sows into "moe_stats".
        __call__(x, microbatch=0) -> out; the aux and z losses are sown into "losses"."""
        group: object
        spec: LayerSpec
        dtype: object = jnp.bfloat16

        @nn.compact
        def __call__(self, x, microbatch: int = 0):
            s, le = self.spec, self.group.local_experts
            init = nn.initializers.normal(0.02)
            p = {"gate": self.param("gate", init, (s.hidden, s.num_experts), self.dtype),
                 "w_in": self.param("w_in", init, (le, s.hidden, 2, s.ffn_hidden), self.dtype),
                 "w_out": self.param("w_out", init, (le, s.ffn_hidden, s.hidden), self.dtype)}
            if s.shared_ffn_hidden > 0:
                p["shared_w_in"] = self.param("shared_w_in", init, (1, s.hidden, 2, s.shared_ffn_hidden), self.dtype)
                p["shared_w_out"] = self.param("shared_w_out", init, (1, s.shared_ffn_hidden, s.hidden), self.dtype)
            if s.use_expert_bias:
                p["expert_bias"] = self.variable("moe_state", "expert_bias", jnp.zeros, (s.num_experts,),
                                                 jnp.float32).value
            slot = slot_of("/".join(self.scope.path), microbatch)
            out, aux = moe_layer(p, x, group=self.group, spec=s, slot=slot)
            self.sow("losses", "aux", aux["aux"])
            self.sow("losses", "z", aux["z"])
            self.sow("moe_stats", "counts", aux["counts"])
            return out
except ImportError:  # Flax is optional: the functional layer above needs only JAX
    MoEBlock = None
