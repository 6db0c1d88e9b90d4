#!/usr/bin/env python3
"""Runs the PyTorch expert-parallel layer baseline (torch_ep_baseline.py, --modes layer) and adds
what it does not print: the GPU memory its layer step needs, measured the way `epx bench layer`
measures its own (device memory in use after the timed steps: total - free, context included), and
torch's own peak allocation.

usage: torch_layer_baseline.py --baseline PATH/torch_ep_baseline.py [its options...]
"""
import importlib.util
import os
import sys

import torch


def load_baseline(path):
    spec = importlib.util.spec_from_file_location("torch_ep_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["torch_ep_baseline"] = mod
    spec.loader.exec_module(mod)
    return mod


def _path_from_argv():
    if "--baseline" not in sys.argv:
        sys.exit("usage: torch_layer_baseline.py --baseline PATH/torch_ep_baseline.py [options]")
    i = sys.argv.index("--baseline")
    path = sys.argv[i + 1]
    return path, sys.argv[:i] + sys.argv[i + 2:]


# Runs at import in the spawned workers too (they re-import this file), so they see the wrapper.
_BASELINE_PATH = os.environ.get("EPX_TORCH_BASELINE") or _path_from_argv()[0]
os.environ["EPX_TORCH_BASELINE"] = _BASELINE_PATH
base = load_baseline(_BASELINE_PATH)
_bench_layer = base.bench_layer


def bench_layer_with_memory(a, rank, world):
    torch.cuda.reset_peak_memory_stats()
    r = _bench_layer(a, rank, world)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    r["gpu_mem_used_gb"] = round((total - free) / 1e9, 2)
    r["torch_peak_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    return r


base.bench_layer = bench_layer_with_memory

if __name__ == "__main__":
    _, sys.argv = _path_from_argv()
    import torch.multiprocessing as mp

    ap_args = sys.argv[1:]
    # re-run the baseline's own main with the wrapper in place
    sys.argv = [_BASELINE_PATH] + ap_args
    src = open(_BASELINE_PATH).read()
    main_part = src[src.index('if __name__ == "__main__":'):]
    glb = vars(base)
    exec(compile(main_part.replace('if __name__ == "__main__":', "if True:"), _BASELINE_PATH, "exec"), glb)
