"""epx.torch.MoE: the whole MoE layer (gate -> router -> dispatch -> grouped expert FFN -> combine,
plus shared experts) as one nn.Module whose parameters are ordinary torch Parameters.

The C++ layer runs over views of those parameters (rebound on every call, so load_state_dict,
.data swaps and optimizers that replace storage all work) and writes gradients into fresh torch
tensors that autograd accumulates as usual.
"""
import itertools

import torch
from torch import nn

from .. import _C, _config
from ._group import Group
from ._ops import moe_forward, register_layer
from ._tensors import epx_dtype, ref, stream_of, torch_dtype

class _LayerState:
    """What the custom ops need of one module: the C++ layer, its per-microbatch contexts, and the
    parameter order of the op's `params` list."""

    def __init__(self, group, config):
        self.group = group
        self.layer = _C.MoELayer(group._g, config, _C.ParamStorage.external)
        self.specs = self.layer.param_specs()  # (name, shape, dtype, grad dtype, trained)
        self.trained_mask = [s[4] for s in self.specs]
        self.contexts = {}
        self.loss_grad_scale = 1.0

    def context(self, slot):
        c = self.contexts.get(slot)
        if c is None:
            c = self.contexts[slot] = _C.MoEContext()
        return c

    def bind_params(self, params):
        if len(params) != len(self.specs):
            raise ValueError(f"epx.MoE: {len(params)} parameters given, the layer has {len(self.specs)}: "
                             f"{', '.join(s[0] for s in self.specs)}")
        for (name, *_), p in zip(self.specs, params):
            self.layer.bind_param(name, ref(p, name, "epx.MoE"))

    def bind_new_grads(self, device):
        grads = []
        for name, shape, _, grad_dtype, trained in self.specs:
            if trained:
                g = torch.empty(shape, dtype=torch_dtype(grad_dtype), device=device)
                self.layer.bind_grad(name, ref(g))
                grads.append(g)
        return grads

    def trained(self, params):
        return [p for p, t in zip(params, self.trained_mask) if t]


def layer_config(preset=None, *, dtype=torch.bfloat16, **overrides):
    """An epx MoEConfig from a preset ("deepseek-v3", "mixtral", "small", "tiny") and overrides:
    hidden, ffn_hidden, shared_ffn_hidden, num_experts, topk, num_groups, group_topk, score
    ("softmax", "softmax_after_topk", "sigmoid"), normalize_weights, routed_scaling_factor,
    use_expert_bias, aux_loss_coeff, z_loss_coeff, capacity_factor, apply_weights_early,
    weight_grads_in_ffn (the routing weights' gradient through FC2; default True), expert_bias_terms,
    activation ("swiglu", "geglu", "gelu", "relu2"), precision ("high", "fp8_block", "mxfp8"),
    fp8_weight_cache (with fp8_block on a GPU: keep the FP8 expert weights between forwards; call
    MoE.refresh_fp8_weights() after every optimizer step), expert_grads_in_dtype,
    backward_keeps_saved (allow a second backward of one forward, e.g. retain_graph=True, at the
    cost of scratch buffers), pipeline_chunks (token chunks pipelined through dispatch, expert FFNs
    and combine),
    overlap_communication (the layer's collectives on a stream of their own, beside the FFNs)."""
    c = _C.moe_config(_C.find_preset(preset or "deepseek-v3"), getattr(_C.DType, epx_dtype(dtype)))
    c.expert_grads_in_dtype = True  # gradients in the parameters' dtype, as torch keeps them
    r = c.router
    router_fields = {"num_experts": "num_experts", "topk": "topk", "num_groups": "num_groups",
                     "group_topk": "group_topk", "normalize_weights": "normalize_weights",
                     "routed_scaling_factor": "routed_scaling_factor", "use_expert_bias": "use_expert_bias",
                     "aux_loss_coeff": "aux_loss_coeff", "z_loss_coeff": "z_loss_coeff"}
    for key, value in overrides.items():
        if key in router_fields:
            setattr(r, router_fields[key], value)
        elif key == "score":
            r.score_function = _config.score_function(value, "epx.MoE")
        elif key == "capacity_factor":
            c.capacity.capacity_factor = float(value)
        elif key == "activation":
            c.activation = getattr(_C.Activation, value)
        elif key == "precision":
            c.precision = getattr(_C.MlpPrecision, value)
        elif key in ("hidden", "ffn_hidden", "shared_ffn_hidden", "apply_weights_early", "weight_grads_in_ffn",
                     "expert_bias_terms", "expert_grads_in_dtype", "backward_keeps_saved", "fp8_weight_cache", "pipeline_chunks",
                     "overlap_communication"):
            setattr(c, key, value)
        else:
            raise ValueError(f"epx.MoE: unknown option '{key}'")
    c.router = r
    return c


class MoE(nn.Module):
    """A Mixture-of-Experts block with expert parallelism over `group`.

    x [..., hidden] -> out [..., hidden]. Parameters (names are stable, for checkpoints): `gate`
    [hidden, experts], `w_in` [local experts, hidden, 2, ffn] (SwiGLU's two projections side by
    side), `w_out` [local experts, ffn, hidden], the optional `b_in` / `b_out`, `shared_w_in` /
    `shared_w_out` for the shared experts, and the buffer `expert_bias` [experts] (DeepSeek-V3's
    selection bias, updated by update_expert_bias, never trained). Rank r holds experts
    [r * E/R, (r+1) * E/R); the replicated parameters' gradients hold this rank's tokens only.

    The aux and z losses are computed on the routing actually used, global over the group;
    forward(..., return_losses=True) returns them as a detached [2] tensor. Their gradient enters
    backward with the factor `loss_grad_scale` (default 1: as if they were added to the loss),
    without a host synchronisation; set it to 1 / microbatches for gradient accumulation, or 0.

    `microbatches` sets how many forwards may be in flight before their backwards (pipeline
    schedules): pass microbatch=i to forward. Each slot keeps its buffers, so a warmed-up step
    allocates nothing and can be captured in a CUDA graph.
    """

    def __init__(self, group: Group, preset=None, *, config=None, dtype=torch.bfloat16, microbatches=1, seed=0,
                 init_std=0.02, **overrides):
        super().__init__()
        if config is None:
            config = layer_config(preset, dtype=dtype, **overrides)
        elif preset is not None or overrides:
            raise ValueError("epx.MoE: give either config= or a preset with overrides, not both")
        self.group = group
        self.config = config
        self.hidden = int(config.hidden)  # plain ints for forward: torch.compile traces no C++ objects
        self.microbatches = int(microbatches)
        if self.microbatches < 1:
            raise ValueError(f"epx.MoE: microbatches is {microbatches}, expected >= 1")
        self._state = _LayerState(group, config)
        self._id = register_layer(self._state)
        self._slots = [next(_slot_ids) for _ in range(self.microbatches)]
        self._names = []
        for name, shape, dt, _, trained in self._state.specs:
            t = torch.zeros(shape, dtype=torch_dtype(dt), device=group.device)
            if trained:
                self.register_parameter(name, nn.Parameter(t))
            else:
                self.register_buffer(name, t)
            self._names.append(name)
        self.reset_parameters(seed, init_std)

    @torch.no_grad()
    def reset_parameters(self, seed=0, std=0.02):
        """Normal(0, std) from a counter-based generator keyed by (seed, parameter, global expert):
        the same experts whatever the number of ranks."""
        self._state.bind_params(self._params())
        on_gpu = self.group.device.type == "cuda"
        if on_gpu:  # init_params runs on the default stream: order it with torch's work both ways
            torch.cuda.current_stream(self.group.device).synchronize()
        self._state.layer.init_params(seed, std)
        if on_gpu:
            torch.cuda.synchronize(self.group.device)

    def _params(self):
        return [getattr(self, n) for n in self._names]

    @property
    def loss_grad_scale(self):
        return self._state.loss_grad_scale

    @loss_grad_scale.setter
    def loss_grad_scale(self, value):
        self._state.loss_grad_scale = float(value)

    def forward(self, x, microbatch: int = 0, return_losses: bool = False):
        if not 0 <= microbatch < self.microbatches:
            raise ValueError(f"epx.MoE: microbatch is {microbatch}, expected 0 <= microbatch < {self.microbatches}")
        shape = x.shape
        if shape[-1] != self.hidden:
            raise ValueError(f"epx.MoE: x has shape {list(shape)}, expected [..., {self.hidden}]")
        out, losses = moe_forward(x.reshape(-1, shape[-1]).contiguous(), self._params(), self._id,
                                  self._slots[microbatch])
        out = out.view(shape)
        return (out, losses) if return_losses else out

    @torch.no_grad()
    def refresh_fp8_weights(self):
        """With precision="fp8_block" and fp8_weight_cache=True: re-quantize the kept FP8 copy of
        w_in / w_out from their current values. Call it after every optimizer step; until then the
        forward uses the copy made before the step."""
        self._state.bind_params(self._params())
        self._state.layer.refresh_fp8_weights(stream_of(self.w_in))

    @torch.no_grad()
    def update_expert_bias(self, rate=1e-3, microbatch: int = 0):
        """DeepSeek-V3's aux-loss-free balancing after a forward: bias[e] += rate * sign(mean(n) -
        n[e]) with n the routed counts of that forward, summed over the group."""
        if "expert_bias" not in self._names:
            raise ValueError("epx.MoE.update_expert_bias: this layer has no expert bias (use_expert_bias=False)")
        ctx = self._state.context(self._slots[microbatch])
        counts = ctx.counts
        ptr, dt, shape, dev = counts.describe()
        flat = _C.Ref(ptr, dt, [shape[-1]], dev)
        _C.update_expert_bias(ref(self.expert_bias), flat, float(rate), stream_of(self.expert_bias))

    def extra_repr(self):
        c, r = self.config, self.config.router
        return (f"hidden={c.hidden}, ffn_hidden={c.ffn_hidden}, experts={r.num_experts} "
                f"({self.group.local_experts} on this rank), topk={r.topk}, shared_ffn_hidden={c.shared_ffn_hidden}, "
                f"group={self.group}")


_slot_ids = itertools.count(1 << 20)  # slots of MoE modules, apart from the ones users pick for the ops


def refresh_fp8_weights_after_steps(optimizer, *modules):
    """Keeps the FP8 weight copies of `modules` (epx.torch.MoE with fp8_weight_cache=True) current:
    registers a hook that calls refresh_fp8_weights() on each after every optimizer.step(). Returns
    the hook's handle (handle.remove() undoes it)."""
    for m in modules:
        if not isinstance(m, MoE):
            raise ValueError(f"epx.torch.refresh_fp8_weights_after_steps: {type(m).__name__} is not an epx.torch.MoE")
        if not m.config.fp8_weight_cache:
            raise ValueError("epx.torch.refresh_fp8_weights_after_steps: a module was made without "
                             "fp8_weight_cache=True (it quantizes its weights on every forward already)")

    def hook(opt, args, kwargs):
        for m in modules:
            m.refresh_fp8_weights()

    return optimizer.register_step_post_hook(hook)

