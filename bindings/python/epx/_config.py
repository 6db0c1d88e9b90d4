"""GroupConfig and RouterConfig from keyword arguments, shared by the framework layers (epx.torch,
epx.jax), and the launcher's variables."""
import os

from . import _C

TRANSPORTS = {"auto": _C.Transport.auto, "zerocopy": _C.Transport.zerocopy, "staged": _C.Transport.staged}


def group_config(num_experts, hidden, max_tokens_per_rank, *, max_topk=16, dtype="bf16", align=128,
                 recv_capacity_rows=0, num_sms=0, timeout_s=0.0, transport="auto", staged_exact_sizes=False,
                 who="epx.Group"):
    """dtype: the epx name of the widest payload dispatch will carry ("bf16", "fp32", ...).
    staged_exact_sizes: on the staged transport, prepare brings the per-peer counts to the host (one
    stream sync) so every exchange moves only what each peer needs; such a prepare cannot be
    captured in a CUDA graph."""
    c = _C.GroupConfig()
    c.num_experts = int(num_experts)
    c.hidden = int(hidden)
    c.max_tokens_per_rank = int(max_tokens_per_rank)
    c.max_topk = int(max_topk)
    c.max_dtype = getattr(_C.DType, dtype)
    c.align = int(align)
    c.recv_capacity_rows = int(recv_capacity_rows)
    c.num_sms = int(num_sms)
    c.timeout_s = float(timeout_s)
    if transport not in TRANSPORTS:
        raise ValueError(f"{who}: transport is '{transport}', expected one of {', '.join(TRANSPORTS)}")
    c.transport = TRANSPORTS[transport]
    c.staged_exact_sizes = bool(staged_exact_sizes)
    return c


SCORES = {"softmax": _C.ScoreFunction.softmax, "softmax_after_topk": _C.ScoreFunction.softmax_after_topk,
          "sigmoid": _C.ScoreFunction.sigmoid}


def score_function(score, who):
    if score not in SCORES:
        raise ValueError(f"{who}: score is '{score}', expected one of {', '.join(SCORES)}")
    return SCORES[score]


def router_config(num_experts, topk, *, score="softmax", num_groups=1, group_topk=1, normalize_weights=False,
                  routed_scaling_factor=1.0, use_expert_bias=False, who="epx.Router"):
    """A validated RouterConfig without losses (selection and weights only)."""
    c = _C.RouterConfig()
    c.num_experts, c.topk, c.score_function = int(num_experts), int(topk), score_function(score, who)
    c.num_groups, c.group_topk = int(num_groups), int(group_topk)
    c.normalize_weights, c.routed_scaling_factor = bool(normalize_weights), float(routed_scaling_factor)
    c.use_expert_bias = bool(use_expert_bias)
    c.validate()
    return c


def launcher_int(name, who, default=None):
    """Launcher variable `name` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT) as an int. Unset or empty:
    `default`, or KeyError(name) where there is none. Anything but a whole number is a ValueError
    naming the variable (read as 0 a bad RANK would make a second rank 0)."""
    text = os.environ.get(name, "")
    if text == "":
        if default is None:
            raise KeyError(name)
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{who}: {name} is '{text}', expected a whole number") from None
