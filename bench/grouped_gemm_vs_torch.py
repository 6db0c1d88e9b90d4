"""epx's bf16 grouped forward and torch._grouped_mm in ONE process and one interleaved contest per
shape (same clock, same inputs), on bench_grouped_gemm's shapes: the ratio that does not cross two
processes. epx runs through its Python module (PYTHONPATH=<build>/python) on the expert-major
layout: offsets [G+1] (each group padded to `align` rows) and rows [G]; torch on the packed rows.
Prints one JSON line per shape: both times, torch / epx, the bits compared on the real rows."""
import argparse
import json

import torch
from torch_grouped_mm_baseline import timed, zipf  # the same protocol and layouts as the two-process runs

from epx import _C
from epx.torch._tensors import ref


def run(name, sizes, K, N, align):
    G = len(sizes)
    padded = [(n + align - 1) // align * align for n in sizes]
    starts = [0]
    for n in padded:
        starts.append(starts[-1] + n)
    R = starts[-1]
    x = torch.randn(sum(sizes), K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(G, K, N, device="cuda", dtype=torch.bfloat16) * 0.02
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    # epx's layout: each group's rows at its padded offset, zero rows between
    xe = torch.zeros(R, K, device="cuda", dtype=torch.bfloat16)
    real = torch.cat([torch.arange(starts[g], starts[g] + sizes[g], device="cuda") for g in range(G)])
    xe[real] = x
    offsets = torch.tensor(starts, device="cuda", dtype=torch.int32)
    rows = torch.tensor(sizes, device="cuda", dtype=torch.int32)
    ye = torch.empty(R, N, device="cuda", dtype=torch.bfloat16)
    row_align = 128 if all(o % 128 == 0 for o in starts) else 1
    refs = [ref(t) for t in (xe, w, offsets, rows, ye)]
    stream = torch.cuda.current_stream().cuda_stream

    def epx_forward():
        _C.grouped_gemm_forward(*refs, stream=stream, row_align=row_align)

    def torch_forward():
        return torch._grouped_mm(x, w, offs=offs)

    t_epx, t_torch = timed([epx_forward, torch_forward])
    yt = torch_forward()
    epx_forward()
    torch.cuda.synchronize()
    differ = int((ye[real] != yt).sum().item())
    flops = 2.0 * sum(sizes) * K * N
    print(json.dumps({"op": "grouped_gemm_forward_vs_torch", "case": name, "align": align, "row_align": row_align,
                      "epx_us": round(t_epx, 2), "torch_us": round(t_torch, 2),
                      "epx_tflops": round(flops / t_epx * 1e-6, 1), "torch_tflops": round(flops / t_torch * 1e-6, 1),
                      "torch_over_epx": round(t_torch / t_epx, 4), "elements_differing": differ}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--align", type=int, default=16, help="epx's group padding (rows); 128 runs its contiguous kernel")
    a = p.parse_args()
    shapes = [("32x1024_k7168_n2048", [1024] * 32, 7168, 2048),
              ("zipf_32_k7168_n2048", zipf(32, 32768, 1.2), 7168, 2048),
              ("32x1024_k2048_n7168", [1024] * 32, 2048, 7168),
              ("8x4096_k4096_n14336", [4096] * 8, 4096, 14336),
              ("decode_32x16_k7168_n2048", [16] * 32, 7168, 2048)]
    for name, sizes, K, N in shapes:
        run(name, sizes, K, N, a.align)


if __name__ == "__main__":
    main()
