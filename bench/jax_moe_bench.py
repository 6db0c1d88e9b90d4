#!/usr/bin/env python3
"""epx.jax's MoE layer against a pure-JAX MoE (bench/jax_moe_baseline.py: sort +
ragged_all_to_all + ragged_dot), in one run, one process driving every local GPU through
jit + shard_map over a mesh axis "ep".

Times the forward and the forward + backward (value_and_grad of <out, d_out> + aux + z with respect
to x and every parameter) of epx.jax.moe_layer at the DeepSeek-V3-like and Mixtral-like shapes
(mean of --iters after a warm-up, block_until_ready at the ends), then runs the baseline for the
same shapes and prints the ratio. JSON lines on stdout.

Each side runs in a process of its own with JAX's default allocator (it preallocates 75% of each
GPU; epx's group buffers fit in the rest). Both are timed the same way, waiting for every step
(fwd_bwd_us); fwd_bwd_queued_us is epx's step queued back to back as a training loop queues it.
Measured on 2 x H200: with XLA_PYTHON_CLIENT_PREALLOCATE=false instead, queued DeepSeek-V3 steps
took 102 ms against 24 ms waited for one by one, and 23.6 ms with preallocation.

usage: jax_moe_bench.py [--presets deepseek-v3,mixtral] [--tokens 4096] [--iters 10] [--no-baseline]
       [--variants full,no_shared] [--timings queued] [--trace DIR]
"""
import argparse
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import epx.jax as epj

def timed(fn, iters, mode="each_step"):
    """Mean microseconds per call after a warm-up. each_step: wait for every step before the next
    call (as the pure-JAX baseline times itself); queued: calls queued back to back, each dropping
    the previous outputs, as a training loop does; queued_kept: queued, every output kept alive."""
    jax.block_until_ready(fn())
    kept = []
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn()
        if mode == "each_step":
            jax.block_until_ready(out)
        elif mode == "queued_kept":
            kept.append(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e6


def bench_preset(name, tokens, iters, devices, variant="full", trace_dir="", timings=(), weight_grads="ffn"):
    """variant (diagnostics of where the time goes): full; no_shared (drop the shared experts);
    no_losses (the aux and z losses left out of the differentiated loss); x_grad_only (gradient of
    x only, no parameter gradient). weight_grads: where the routing weights get their gradient, "ffn"
    (epj.expert_block, the default) or "combine" (grouped_mlp then combine)."""
    R = len(devices)
    spec = epj.LayerSpec.from_preset(name, weight_grads_in_ffn=weight_grads == "ffn")
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

    f = jax.jit(epj.shard_map(fwd, mesh, (pspec, P("ep")), P("ep")))
    fb = jax.jit(epj.shard_map(fwd_bwd, mesh, (pspec, P("ep"), P("ep")), (pspec, P("ep"))))
    t_f = timed(lambda: f(params, x), iters)
    t_fb = timed(lambda: fb(params, x, d), iters)
    queued = {m: timed(lambda: fb(params, x, d), iters, m) for m in timings}
    if trace_dir:  # five more steps under the profiler, queued as a training loop queues them
        with jax.profiler.trace(os.path.join(trace_dir, f"{name}-{variant}"), create_perfetto_trace=True):
            for _ in range(5):
                out = fb(params, x, d)
            jax.block_until_ready(out)
    group.check()
    stats = devices[0].memory_stats() or {}
    line = {"bench": "layer", "impl": "epx.jax", "preset": name, "ranks": R, "tokens": T, "hidden": spec.hidden,
            "ffn": spec.ffn_hidden, "experts": spec.num_experts, "topk": spec.topk, "transport": group.transport,
            "fwd_us": round(t_f, 1), "fwd_bwd_us": round(t_fb, 1), "weight_grads": weight_grads,
            "iters": iters}
    line.update({f"fwd_bwd_{m}_us": round(t, 1) for m, t in queued.items()})
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
    ap.add_argument("--timings", default="queued", help="comma list of extra fwd+bwd timings: queued, queued_kept "
                    "(see timed(); the main figure waits for each step, as the baseline does)")
    ap.add_argument("--trace", default="", help="folder for a jax.profiler trace of 5 queued fwd+bwd steps per run "
                    "(summarise it with bench/trace_summary.py)")
    ap.add_argument("--epx-only", action="store_true", help="measure epx.jax in this process (no baseline)")
    ap.add_argument("--weight-grads", default="ffn", choices=("ffn", "combine"),
                    help="the routing weights' gradient through FC2 (epj.expert_block) or in combine's backward")
    a = ap.parse_args()
    if a.epx_only:
        devices = jax.devices()
        for name in a.presets.split(","):
            for variant in a.variants.split(","):
                print(json.dumps(bench_preset(name, a.tokens, a.iters, devices, variant, a.trace,
                                              [t for t in a.timings.split(",") if t], a.weight_grads)), flush=True)
        return
    here = os.path.dirname(os.path.abspath(__file__))
    for name in a.presets.split(","):
        # One process per side: each gets JAX's allocator to itself and frees it for the next.
        cmd = [sys.executable, os.path.abspath(__file__), "--epx-only", "--presets", name, "--iters", str(a.iters),
               "--tokens", str(a.tokens), "--variants", a.variants, "--timings", a.timings, "--trace", a.trace,
               "--weight-grads", a.weight_grads]
        mine = {}
        for b in run_lines(cmd):
            if b.get("variant", "full") == "full":
                mine = b
        if a.no_baseline or not mine:
            continue
        cmd = [sys.executable, os.path.join(here, "jax_moe_baseline.py"), "--preset", name, "--iters", str(a.iters)]
        if a.tokens:
            cmd += ["--tokens", str(a.tokens)]
        for b in run_lines(cmd):
            if b.get("bench") == "layer" and b.get("fwd_bwd_us"):
                print(json.dumps({"bench": "layer_vs_jax", "preset": name, "ranks": mine["ranks"],
                                  "epx_jax_fwd_bwd_ms": round(mine["fwd_bwd_us"] / 1e3, 3),
                                  "jax_fwd_bwd_ms": round(b["fwd_bwd_us"] / 1e3, 3),
                                  "speedup": round(b["fwd_bwd_us"] / mine["fwd_bwd_us"], 3), "target": 2.0,
                                  "meets_target": b["fwd_bwd_us"] >= 2.0 * mine["fwd_bwd_us"]}), flush=True)


def run_lines(cmd):
    """Runs a measuring process; echoes and returns its JSON lines (its errors go to stderr)."""
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = []
    for raw in res.stdout.splitlines():
        if raw.startswith("{"):
            print(raw, flush=True)
            lines.append(json.loads(raw))
    if res.returncode != 0:
        print(f"{' '.join(cmd[1:3])}... exited with {res.returncode}:\n{res.stderr[-3000:]}", file=sys.stderr)
    return lines


if __name__ == "__main__":
    main()
