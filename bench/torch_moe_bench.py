#!/usr/bin/env python3
"""epx.torch.MoE against the PyTorch expert-parallel layer, in one run, one process per GPU.

For each preset (DeepSeek-V3-like, Mixtral-like) it times, per rank, the forward and the
forward + backward of epx.torch.MoE exactly as a training loop calls it (x.requires_grad, grads
set to None between steps so autograd takes the returned gradients), with the same method as
`epx bench layer` (mean over --iters after a warm-up, synchronising at the ends). With --epx-cli
it runs `epx bench layer` for the same shapes in the same call, so the Python overhead is a ratio
of the same run; with --baseline it runs ../shared/bench/torch_ep_baseline.py --modes layer too.
JSON lines on stdout.

usage: torch_moe_bench.py [--presets deepseek-v3,mixtral] [--tokens 4096] [--iters 10]
                          [--epx-cli build/bin/epx] [--baseline path/torch_ep_baseline.py]
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import epx
import epx.torch as ept


def time_us(fn, iters, device):
    fn()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters * 1e6


def bench_rank(rank, world, port, a, out_q):
    os.environ.update(NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    for name in a.presets.split(","):
        p = epx.find_preset(name)
        T = a.tokens or p.tokens
        group = ept.Group.from_process_group(num_experts=p.experts, hidden=p.hidden, max_tokens_per_rank=T,
                                             max_topk=p.topk, align=16)
        torch.cuda.synchronize(device)
        mem_before = torch.cuda.mem_get_info(device)
        moe = ept.MoE(group, name, seed=1)
        g = torch.Generator(device=device).manual_seed(1 + rank)
        x = torch.randn(T, p.hidden, device=device, generator=g).to(torch.bfloat16).requires_grad_()
        d_out = (torch.randn(T, p.hidden, device=device, generator=g) * 0.01).to(torch.bfloat16)

        def forward():
            with torch.no_grad():
                moe(x)

        def forward_backward():
            moe.zero_grad(set_to_none=True)
            x.grad = None
            moe(x).backward(d_out)

        forward_backward()  # buffers, routing blocks, kernel caches
        fwd = time_us(forward, a.iters, device)
        fwd_bwd = time_us(forward_backward, a.iters, device)
        group.check()
        free, total = torch.cuda.mem_get_info(device)
        if rank == 0:
            out_q.put(json.dumps({
                "bench": "layer", "impl": "epx.torch", "preset": name, "ranks": world, "tokens": T, "hidden": p.hidden,
                "ffn": p.ffn_hidden, "experts": p.experts, "topk": p.topk, "transport": group.transport,
                "fwd_us": round(fwd, 1), "fwd_bwd_us": round(fwd_bwd, 1),
                "gpu_mem_used_gb": round((total - free) / 1e9, 2),
                "gpu_mem_layer_gb": round((mem_before[0] - free) / 1e9, 2),
                "torch_peak_allocated_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2),
                "registered_gb": round(group.registered_bytes / 1e9, 3), "iters": a.iters}))
        del moe, x, d_out  # the next preset's layer is measured without this one's memory
        group.close()
        torch.cuda.empty_cache()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="deepseek-v3,mixtral")
    ap.add_argument("--tokens", type=int, default=0, help="tokens per rank (0: the preset's)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=0, help="GPUs to use (0: every visible one)")
    ap.add_argument("--epx-cli", default="", help="path of the epx CLI: run `epx bench layer` for the same shapes")
    ap.add_argument("--baseline", default="", help="path of torch_ep_baseline.py: run its --modes layer too")
    a = ap.parse_args()
    world = a.ranks or torch.cuda.device_count()
    if world < 1:
        sys.exit("torch_moe_bench.py: no CUDA GPU visible")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    lines = []
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=bench_rank, args=(r, world, port, a, q)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        sys.exit(f"torch_moe_bench.py: a rank failed (exit codes {[p.exitcode for p in procs]})")
    while not q.empty():
        lines.append(json.loads(q.get()))
    mine = {l["preset"]: l for l in lines}
    for l in lines:
        print(json.dumps(l), flush=True)
    if a.epx_cli:
        cmd = [a.epx_cli, "bench", "layer", "--preset", a.presets, "--iters", str(a.iters)]
        if a.tokens:
            cmd += ["--tokens", str(a.tokens)]
        if world > 1:
            cmd = [os.path.join(os.path.dirname(__file__), "..", "scripts", "run_ranks.sh"), str(world)] + cmd
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        for raw in res.stdout.splitlines():
            if raw.startswith("[rank "):  # run_ranks.sh prefixes every line with its rank
                if not raw.startswith("[rank 0] "):
                    continue
                raw = raw[len("[rank 0] "):]
            if not raw.startswith("{"):
                continue
            c = json.loads(raw)
            print(json.dumps(c), flush=True)
            m = mine.get(c.get("preset"))
            if m:
                print(json.dumps({"bench": "layer_python_overhead", "preset": c["preset"], "ranks": world,
                                  "cpp_fwd_us": c["fwd_us"], "python_fwd_us": m["fwd_us"],
                                  "cpp_fwd_bwd_us": c["fwd_bwd_us"], "python_fwd_bwd_us": m["fwd_bwd_us"],
                                  "fwd_bwd_ratio": round(m["fwd_bwd_us"] / c["fwd_bwd_us"], 4),
                                  "fwd_ratio": round(m["fwd_us"] / c["fwd_us"], 4), "target_ratio": 1.05,
                                  "meets_target": m["fwd_bwd_us"] <= 1.05 * c["fwd_bwd_us"]}), flush=True)
        if res.returncode != 0:
            print(res.stderr[-2000:], file=sys.stderr)
    if a.baseline:
        shapes = {"deepseek-v3": "--hidden 7168 --experts 256 --topk 8 --ffn 2048",
                  "mixtral": "--hidden 4096 --experts 8 --topk 2 --ffn 14336"}
        for name in a.presets.split(","):
            if name not in shapes:
                continue
            T = a.tokens or epx.find_preset(name).tokens
            # torch_layer_baseline.py runs the baseline's layer and adds its memory use.
            wrapper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_layer_baseline.py")
            cmd = [sys.executable, wrapper, "--baseline", a.baseline, "--tokens", str(T), *shapes[name].split(),
                   "--modes", "layer", "--iters", str(a.iters)]
            res = subprocess.run(cmd, env=dict(env, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=900)
            for raw in res.stdout.splitlines():
                if raw.startswith("{"):
                    t = json.loads(raw)
                    t["preset"] = name
                    print(json.dumps(t), flush=True)
                    m = mine.get(name)
                    fb = t.get("fwd_bwd_us", 0) / 1e3
                    if m and fb:
                        print(json.dumps({"bench": "layer_vs_torch", "preset": name, "ranks": world,
                                          "epx_torch_fwd_bwd_ms": round(m["fwd_bwd_us"] / 1e3, 3),
                                          "torch_fwd_bwd_ms": round(fb, 3),
                                          "speedup": round(fb / (m["fwd_bwd_us"] / 1e3), 3)}),
                              flush=True)
            if res.returncode != 0:
                print(res.stderr[-2000:], file=sys.stderr)


if __name__ == "__main__":
    main()
