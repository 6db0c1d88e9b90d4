#!/usr/bin/env python3
"""Training steps of a Flax model built on epx.jax.MoEBlock, expert-parallel over every local GPU
(jit + shard_map over the mesh axis "ep", experts sharded, the rest replicated), or on the CPU
reference with --cpu.

    python3 examples/jax_train_step.py --preset deepseek-v3 --tokens 4096 --steps 5
    python3 examples/jax_train_step.py --preset mixtral --tokens 4096 --steps 5
    python3 examples/jax_train_step.py --cpu --preset tiny --tokens 32 --steps 5

A step: out = x + MoE(x); loss = mean((out - target)^2) over every rank's tokens + the router's aux
and z losses (global over the group); gradients; the replicated parameters' gradients summed over
the group; SGD; then DeepSeek-V3's aux-loss-free balancing moves the expert bias by the routed
counts. One JSON line per step: loss, aux, z, the step time (the first includes compilation).
"""
import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import epx.jax as epj

EXPERT_PARAMS = ("w_in", "w_out")


class Model:
    """x + MoEBlock(x): the smallest model with a residual path around the layer."""

    def __init__(self, group, spec, dtype):
        self.block = epj.MoEBlock(group=group, spec=spec, dtype=dtype)

    def apply(self, params, state, x):
        variables = {"params": params, **({"moe_state": state} if state else {})}
        y, cols = self.block.apply(variables, x, mutable=["losses", "moe_stats"])
        return x + y, cols["losses"]["aux"][0], cols["losses"]["z"][0], cols["moe_stats"]["counts"][0]


def make_step(model, mesh, ranks, lr, bias_rate, pspec, sspec):
    def step(params, state, x, target):
        def loss_fn(p):
            out, aux, z, counts = model.apply(p, state, x)
            mse = jnp.mean(jnp.square(out.astype(jnp.float32) - target.astype(jnp.float32)))
            # aux and z are global (their statistics are summed over the group) and every rank
            # adds them: dividing by the ranks gets each its gradient once.
            return (mse + aux + z) / ranks, (mse, aux, z, counts)

        (_, (mse, aux, z, counts)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        grads = {k: g if k in EXPERT_PARAMS else jax.lax.psum(g, "ep") for k, g in grads.items()}
        params = {k: (p.astype(jnp.float32) - lr * grads[k].astype(jnp.float32)).astype(p.dtype)
                  for k, p in params.items()}
        if state:
            state = {"expert_bias": epj.update_expert_bias(state["expert_bias"], counts, bias_rate)}
        return params, state, jax.lax.pmean(mse, "ep"), aux, z

    return jax.jit(epj.shard_map(step, mesh, (pspec, sspec, P("ep"), P("ep")), (pspec, sspec, P(), P(), P())),
                   donate_argnums=(0, 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3", help="deepseek-v3, mixtral, small, tiny")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--init-std", type=float, default=0.0, help="0: 1 / sqrt(hidden)")
    ap.add_argument("--cpu", action="store_true", help="the CPU reference (one rank, fp32)")
    a = ap.parse_args(argv)

    devices = jax.devices("cpu")[:1] if a.cpu else jax.local_devices()
    dtype = jnp.float32 if a.cpu else jnp.bfloat16
    spec = epj.LayerSpec.from_preset(a.preset)
    ranks = len(devices)
    group = epj.Group.local(devices, num_experts=spec.num_experts, hidden=spec.hidden, max_tokens_per_rank=a.tokens,
                            max_topk=spec.topk, dtype=dtype, align=16)
    mesh = Mesh(np.array(devices), ("ep",))
    params = epj.init_params(jax.random.key(0), spec, spec.num_experts, dtype,
                             std=a.init_std or 1.0 / np.sqrt(spec.hidden))
    state = {"expert_bias": params.pop("expert_bias")} if "expert_bias" in params else {}
    pspec = {k: P("ep") if k in EXPERT_PARAMS else P() for k in params}
    sspec = {k: P() for k in state}
    put = lambda tree, specs: {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}  # noqa: E731
    params, state = put(params, pspec), put(state, sspec)
    k = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k[0], (ranks * a.tokens, spec.hidden), jnp.float32)
    mix = jax.random.normal(k[1], (spec.hidden, spec.hidden), jnp.float32) / np.sqrt(spec.hidden)
    target = x + 0.5 * jnp.tanh(x @ mix)  # a synthetic regression target the layer can move towards
    rows = NamedSharding(mesh, P("ep"))
    x, target = jax.device_put(x.astype(dtype), rows), jax.device_put(target.astype(dtype), rows)

    step = make_step(Model(group, spec, dtype), mesh, ranks, a.lr, a.bias_rate, pspec, sspec)
    losses = []
    for i in range(a.steps):
        t0 = time.perf_counter()
        params, state, mse, aux, z = step(params, state, x, target)
        mse = float(mse)  # waits for the step
        ms = (time.perf_counter() - t0) * 1e3
        losses.append(mse)
        print(json.dumps({"example": "jax_train_step", "preset": a.preset, "ranks": ranks, "tokens": a.tokens,
                          "step": i, "loss": mse, "aux": float(aux), "z": float(z), "ms": round(ms, 2),
                          "transport": group.transport}), flush=True)
    group.check()
    group.close()
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
