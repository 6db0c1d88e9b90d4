#!/usr/bin/env python3
"""torch._grouped_mm on the grouped-GEMM benchmark shapes (bf16, B [G, K, N]) beside the dense torch.mm of the
same FLOPs, one JSON line each."""
import json
import random

import torch


def timed(fns, iters=5, rounds=7, warm_s=0.3):
    """Median per-call times in us of several ops timed as bench_grouped_gemm times its own
    (bench::time_interleaved): ~warm_s of the first op's calls, since an H200's clock falls within
    tens of milliseconds of GEMM load, then `rounds` rounds in which every op runs `iters` calls, in
    a fresh random order each round."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    warm = 0.0
    while warm < warm_s * 1e3:
        s.record()
        for _ in range(10):
            fns[0]()
        e.record()
        torch.cuda.synchronize()
        warm += max(s.elapsed_time(e), 0.01)
    t = [[] for _ in fns]
    order = list(range(len(fns)))
    rng = random.Random(12345)
    for _ in range(rounds):
        rng.shuffle(order)
        for v in order:
            fns[v]()
            s.record()
            for _ in range(iters):
                fns[v]()
            e.record()
            torch.cuda.synchronize()
            t[v].append(s.elapsed_time(e) / iters * 1e3)
    return [sorted(x)[len(x) // 2] for x in t]


def zipf(G, total, s):
    w = [1.0 / (g + 1) ** s for g in range(G)]
    out = [int(total * x / sum(w)) // 8 * 8 for x in w]
    out[0] += total - sum(out)
    return out


def run(name, sizes, K, N):
    """torch._grouped_mm and the dense torch.mm of the same FLOPs in one interleaved contest: their
    ratio (fraction_of_dense) is comparable with bench_grouped_gemm's, which divides by a dense
    cuBLASLt GEMM timed in its own contest, whatever clock each process ran at."""
    G = len(sizes)
    x = torch.randn(sum(sizes), K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, K, N, device="cuda", dtype=torch.bfloat16) * 0.02
    wd = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) * 0.02
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    t, td = timed([lambda: torch._grouped_mm(x, w, offs=offs), lambda: torch.mm(x, wd)])
    flops = 2.0 * sum(sizes) * K * N
    print(json.dumps({"impl": "torch", "op": "grouped_mm", "case": name, "time_us": round(t, 2),
                      "tflops": round(flops / t * 1e-6, 1), "dense_mm_us": round(td, 2),
                      "fraction_of_dense": round(td / t, 4)}), flush=True)


if __name__ == "__main__":
    run("32x1024_k7168_n2048", [1024] * 32, 7168, 2048)
    run("zipf_32_k7168_n2048", zipf(32, 32768, 1.2), 7168, 2048)
    run("32x1024_k2048_n7168", [1024] * 32, 2048, 7168)
    run("8x4096_k4096_n14336", [4096] * 8, 4096, 14336)
    run("decode_32x16_k7168_n2048", [16] * 32, 7168, 2048)
