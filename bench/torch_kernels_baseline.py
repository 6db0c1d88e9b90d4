#!/usr/bin/env python3
"""PyTorch baselines of the single-GPU kernels, timed in the same run as epx's benchmarks.

Each measurement prints one JSON line ({"impl": "torch", "op": ..., shape..., "time_us": ...}),
timed with CUDA events (median of 7 repetitions of 20 calls) after warm-up:
  router_softmax   softmax over E, top-k, normalise                    (logits fp32 [T, E])
  router_dsv3      DeepSeek-V3: sigmoid + bias, 8 groups keep 4 by top-2 sum, top-8, normalise, x2.5
  permute          index_select of x [T, H] bf16 into the K*T expert-sorted rows
  unpermute        weighted index_add of the K*T rows back into [T, H] (fp32 accumulate)
  quant_1x128      per-(row, 128) amax -> scale -> x / scale -> float8_e4m3fn
usage: torch_kernels_baseline.py [--ops router,permute,quant]
"""
import argparse
import json

import torch


def timed(fn, iters=20, reps=7, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) / iters * 1e3)
    out.sort()
    return out[len(out) // 2]


def emit(**kw):
    print(json.dumps({"impl": "torch", **kw}), flush=True)


def router(T=16384, E=256, K=8):
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(T, E, device="cuda", generator=g)

    def softmax_topk():
        p = logits.softmax(-1)
        w, i = torch.topk(p, K, dim=-1)
        return i, w / w.sum(-1, keepdim=True)

    bias = torch.randn(E, device="cuda", generator=g) * 0.01

    def dsv3(G=8, keep=4, scale=2.5):
        s = logits.sigmoid()
        sel = s + bias
        gs = sel.view(T, G, E // G).topk(2, dim=-1)[0].sum(-1)
        gi = gs.topk(keep, dim=-1)[1]
        mask = torch.zeros_like(gs).scatter_(1, gi, 1.0)
        smask = mask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
        i = sel.masked_fill(smask == 0, float("-inf")).topk(K, dim=-1)[1]
        w = s.gather(1, i)
        return i, w / w.sum(-1, keepdim=True) * scale

    emit(op="router_softmax", tokens=T, experts=E, topk=K, time_us=round(timed(softmax_topk), 2))
    emit(op="router_dsv3", tokens=T, experts=E, topk=K, time_us=round(timed(dsv3), 2))


def permute(T, H=7168, E=256, K=8):
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    idx = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=-1)[1]
    w = torch.rand(T, K, device="cuda", generator=g)
    order = idx.flatten().argsort(stable=True)
    src = order // K
    y = x.index_select(0, src)

    def unpermute():
        out = torch.zeros(T, H, device="cuda", dtype=torch.float32)
        out.index_add_(0, src, y.float() * w.flatten()[order].unsqueeze(1))
        return out.to(torch.bfloat16)

    emit(op="permute", tokens=T, hidden=H, experts=E, topk=K, time_us=round(timed(lambda: x.index_select(0, src)), 2))
    emit(op="unpermute", tokens=T, hidden=H, experts=E, topk=K, time_us=round(timed(unpermute), 2))


def quant(rows, H=7168):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, generator=g)

    def q1x128():
        b = x.view(rows, H // 128, 128).float()
        amax = b.abs().amax(-1, keepdim=True).clamp(min=1e-4)
        q = (b * (448.0 / amax)).to(torch.float8_e4m3fn)
        return q.view(rows, H), (amax / 448.0).squeeze(-1)

    emit(op="quant_1x128", rows=rows, hidden=H, time_us=round(timed(q1x128), 2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="router,permute,quant")
    a = ap.parse_args()
    ops = a.ops.split(",")
    if "router" in ops:
        router()
    if "permute" in ops:
        permute(4096)
        permute(16384)
    if "quant" in ops:
        quant(4096)
        quant(32768)
