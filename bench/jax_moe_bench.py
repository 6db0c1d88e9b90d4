#!/usr/bin/env python3
"""epx.jax's MoE layer against a pure-JAX MoE (bench/jax_moe_baseline.py: sort +
ragged_all_to_all + ragged_dot), in one run, one process driving every local GPU through
jit + shard_map over a mesh axis "ep".

Times the forward and the forward + backward (value_and_grad of <out, d_out> + aux + z with respect
to x and every parameter) of epx.jax.moe_layer at the DeepSeek-V3-like and Mixtral-like shapes
(mean of --iters after a warm-up, block_until_ready at the ends), then runs the baseline for the
same shapes and prints the ratio. JSON lines on stdout.

usage: jax_moe_bench.py [--presets deepseek-v3,mixtral] [--tokens 4096] [--iters 10] [--no-baseline]
"""
import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # epx allocates its group buffers itself
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import epx.jax as epj

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:
    from jax.experimental.shard_map import shard_map


def smap(f, mesh, in_specs, out_specs):
    if "check_vma" in shard_map.__code__.co_varnames:
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def timed(fn, iters):
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e6


def bench_preset(name, tokens, iters, devices, variant="full", trace_dir=""):
    """variant (diagnostics of where the time goes): full; no_shared (drop the shared experts);
    no_losses (the aux and z losses left out of the differentiated loss); x_grad_only (gradient of
    x only, no parameter gradient)."""
    R = len(devices)
    spec = epj.LayerSpec.from_preset(name)
    p = epx_preset(name)
    T = tokens or p.tokens
    group = epj.Group.local(devices, num_experts=spec.num_experts, hidden=spec.hidden, max_tokens_per_rank=T,
                            max_topk=spec.topk, align=16)
    mesh = Mesh(np.array(devices), ("ep",))
    experts = {"w_in", "w_out"}
    params = epj.init_params(jax.random.key(0), spec, spec.num_experts, jnp.bfloat16)
    if variant == "no_shared":
        params = {k: v for k, v in params.items() if not k.startswith("shared")}
    pspec = {k: (P("ep") if k in experts else P()) for k in params}
    params = jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in pspec.items()})
    x = jax.device_put(jax.random.normal(jax.random.key(1), (R * T, spec.hidden), jnp.bfloat16),
                       NamedSharding(mesh, P("ep")))
    d = jax.device_put((0.01 * jax.random.normal(jax.random.key(2), (R * T, spec.hidden))).astype(jnp.bfloat16),
                       NamedSharding(mesh, P("ep")))

    def fwd(params, x):
        return epj.moe_layer(params, x, group=group, spec=spec, slot=1)[0]

    def fwd_bwd(params, x, d):
        def loss(params, x):
            out, l = epj.moe_layer(params, x, group=group, spec=spec, slot=1)
            value = jnp.sum(out.astype(jnp.float32) * d.astype(jnp.float32))
            return value if variant == "no_losses" else value + l["aux"] + l["z"]
        if variant == "x_grad_only":
            return params, jax.grad(loss, argnums=1)(params, x)
        return jax.grad(loss, argnums=(0, 1))(params, x)

    f = jax.jit(smap(fwd, mesh, (pspec, P("ep")), P("ep")))
    fb = jax.jit(smap(fwd_bwd, mesh, (pspec, P("ep"), P("ep")), (pspec, P("ep"))))
    t_f = timed(lambda: f(params, x), iters)
    t_fb = timed(lambda: fb(params, x, d), iters)
    if trace_dir:  # three more steps under the profiler: a Perfetto trace of where the time goes
        with jax.profiler.trace(os.path.join(trace_dir, f"{name}-{variant}"), create_perfetto_trace=True):
            for _ in range(3):
                jax.block_until_ready(fb(params, x, d))
    group.check()
    stats = devices[0].memory_stats() or {}
    line = {"bench": "layer", "impl": "epx.jax", "preset": name, "ranks": R, "tokens": T, "hidden": spec.hidden,
            "ffn": spec.ffn_hidden, "experts": spec.num_experts, "topk": spec.topk, "transport": group.transport,
            "fwd_us": round(t_f, 1), "fwd_bwd_us": round(t_fb, 1), "iters": iters}
    if variant != "full":
        line["variant"] = variant
    if "peak_bytes_in_use" in stats:
        line["gpu_mem_peak_gb"] = round(stats["peak_bytes_in_use"] / 1e9, 2)
    group.close()
    return line


def epx_preset(name):
    from epx import find_preset
    return find_preset(name)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="deepseek-v3,mixtral")
    ap.add_argument("--tokens", type=int, default=0, help="tokens per device (0: the preset's)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--variants", default="full", help="comma list: full, no_shared, no_losses, x_grad_only")
    ap.add_argument("--trace", default="", help="folder for a jax.profiler trace of 3 fwd+bwd steps per run "
                    "(summarise it with bench/trace_summary.py)")
    a = ap.parse_args()
    devices = jax.devices()
    mine = {}
    for name in a.presets.split(","):
        for variant in a.variants.split(","):
            line = bench_preset(name, a.tokens, a.iters, devices, variant, a.trace)
            if variant == "full":
                mine[name] = line
            print(json.dumps(line), flush=True)
    if a.no_baseline:
        return
    base = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jax_moe_baseline.py")
    for name in a.presets.split(","):
        cmd = [sys.executable, base, "--preset", name, "--iters", str(a.iters)]
        if a.tokens:
            cmd += ["--tokens", str(a.tokens)]
        # This process still holds some memory: the baseline allocates as it goes instead of taking 75%.
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                             env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
        for raw in res.stdout.splitlines():
            if not raw.startswith("{"):
                continue
            b = json.loads(raw)
            print(json.dumps(b), flush=True)
            if b.get("bench") == "layer" and b.get("fwd_bwd_us"):
                m = mine[name]
                print(json.dumps({"bench": "layer_vs_jax", "preset": name, "ranks": m["ranks"],
                                  "epx_jax_fwd_bwd_ms": round(m["fwd_bwd_us"] / 1e3, 3),
                                  "jax_fwd_bwd_ms": round(b["fwd_bwd_us"] / 1e3, 3),
                                  "speedup": round(b["fwd_bwd_us"] / m["fwd_bwd_us"], 3), "target": 2.0,
                                  "meets_target": b["fwd_bwd_us"] >= 2.0 * m["fwd_bwd_us"]}), flush=True)
        if res.returncode != 0:
            print(res.stderr[-3000:], file=sys.stderr)


if __name__ == "__main__":
    main()
