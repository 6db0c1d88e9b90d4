#!/usr/bin/env python3
"""How often the lean router kernel's rows leave its fast path, from a host model of its key rules.

DeepSeek-V3's router on random rows (logits N(0, 2), bias U(-0.05, 0.05), sigmoid scores, 8 groups
keep 4, top-8), as the lean kernel ranks them (src/cuda/router/router_lean_kernels.cuh): 32-bit
composite keys whose low bits are replaced by the expert's rank, 9 rounds for K + 1 picks, 3 cached
keys per lane of 8 experts. Prints, per number of dropped key bits, the share of rows whose picks K-1
and K tie on the truncated key (the exact code decides them) and of rows with ties inside the top K
(re-sorted on the full keys since adad807), the share whose lane caches can run dry, and the group
boundary's collisions. A key relative to the row's best one keeps more bits where the top picks are.

  python3 bench/router_key_model.py [--tokens 100000] [--seed 5]
"""
import argparse

import numpy as np


def order_key(v):
    """The kernel's order_key2: float bits mapped so that unsigned order is float order."""
    b = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    flip = np.where(b >> np.uint64(31) == 1, np.uint64(0xFFFFFFFF), np.uint64(0x80000000))
    return b ^ flip


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100000)
    ap.add_argument("--seed", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    T, E, K, G, GK, V = a.tokens, 256, 8, 8, 4, 8
    x = rng.normal(0, 2, (T, E)).astype(np.float32)
    bias = rng.uniform(-0.05, 0.05, E).astype(np.float32)
    score = (1 / (1 + np.exp(-x.astype(np.float64)))).astype(np.float32)
    sel = (score + bias).astype(np.float32)
    top2 = np.sort(sel.reshape(T, G, E // G), axis=2)[:, :, -2:].sum(axis=2)
    kept = np.zeros((T, G), bool)
    np.put_along_axis(kept, np.argsort(-top2, axis=1, kind="stable")[:, :GK], True, axis=1)
    key = np.where(np.repeat(kept, E // G, axis=1), order_key(sel), 0)
    experts = np.broadcast_to(np.arange(E), (T, E))
    order = np.lexsort((experts, -key.astype(np.int64)), axis=1)[:, : K + 1]  # full key, then lower expert
    picks = np.take_along_axis(key, order, axis=1)
    for dropped in (8, 4, 2):
        tr = picks >> np.uint64(dropped)
        eq = tr[:, :-1] == tr[:, 1:]
        print(f"{dropped} key bits dropped: picks K-1 / K tied {100 * eq[:, K - 1].mean():.3f}% of rows, "
              f"ties inside the top K {100 * eq[:, : K - 1].any(axis=1).mean():.3f}%")
    rel = np.minimum(picks[:, :1] - picks, (1 << 24) - 1)  # 24 bits of distance below the best pick
    eq = rel[:, :-1] == rel[:, 1:]
    print(f"key relative to the best pick (24 bits): picks K-1 / K tied {100 * eq[:, K - 1].mean():.3f}%, "
          f"inside {100 * eq[:, : K - 1].any(axis=1).mean():.3f}%")
    lanes = order // V
    held = np.zeros((T, 32), int)
    for r in range(K + 1):
        np.add.at(held, (np.arange(T), lanes[:, r]), 1)
    dry = (held.max(axis=1) >= 4).mean()
    print(f"a lane holding >= 4 of the K + 1 picks (its 3-key cache can run dry): {100 * dry:.3f}%")
    gs = np.sort(top2, axis=1)[:, ::-1]
    g4, g5 = order_key(gs[:, GK - 1]) >> np.uint64(4), order_key(gs[:, GK]) >> np.uint64(4)
    print(f"kept / dropped group scores equal on the truncated key: {100 * (g4 == g5).mean():.4f}%")


if __name__ == "__main__":
    main()
