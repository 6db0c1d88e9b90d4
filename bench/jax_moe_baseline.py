#!/usr/bin/env python3
"""Pure-JAX expert-parallel MoE layer: the baseline that epx's JAX binding is measured against.

It is the layer a JAX user writes without epx, in one process over all local devices (a 1-D mesh,
axis "ep", inside shard_map):

    router (x @ gate in fp32, softmax or sigmoid scores, top-k, weights renormalised over the k)
    -> sort the (token, slot) pairs by expert -> jax.lax.ragged_all_to_all to the experts' ranks
    -> group the received rows by local expert -> jax.lax.ragged_dot (SwiGLU) -> jax.lax.ragged_dot
    -> jax.lax.ragged_all_to_all back -> un-sort -> weighted sum over the k in fp32
    (+ a dense shared expert when the preset has one).

Parameters and activations are bf16; matmuls accumulate in fp32. x is sharded over tokens
([R*T, H] -> [T, H] per device), the gate and the shared expert are replicated, the routed experts
are sharded over experts (w_in [E, H, 2, F] -> [E/R, H, 2, F], w_out [E, F, H] -> [E/R, F, H]).

It prints one JSON line per run: the mean time of the jitted forward and of the jitted
forward+backward (gradients w.r.t. x and every parameter), and the peak device memory when the
backend reports it.

    python3 bench/jax_moe_baseline.py --preset deepseek-v3     # H=7168 F=2048 E=256 K=8 + shared
    python3 bench/jax_moe_baseline.py --preset mixtral         # H=4096 F=14336 E=8 K=2
    python3 bench/jax_moe_baseline.py --check                  # small-shape correctness check

--check compares the sharded layer (forward and gradients) against a dense single-device
reference and exits non-zero on a mismatch. The CPU backend cannot compile ragged_all_to_all, so
on CPU (or with --cpu-emulation) the transport is replaced by an emulation built from a plain
all_to_all of padded blocks; the real ragged_all_to_all path is then only traced and lowered.
Use XLA_FLAGS=--xla_force_host_platform_device_count=4 to check with several CPU devices.

On CUDA, XLA's own ragged_dot lowering expands to a dense dot masked per group (memory and time
proportional to groups x rows), which cannot hold the DeepSeek-V3 shape; JAX's Pallas-Triton
lowering of ragged_dot computes only the real rows and is used when the installed JAX has it
(--ragged-dot auto). The JSON line says which one ran.
"""
import argparse
import importlib.util
import json
import sys
import time
from functools import partial

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "ep"

PRESETS = {
    # DeepSeek-V3 routes with sigmoid scores (its grouped top-k is left out on purpose).
    "deepseek-v3": dict(hidden=7168, ffn=2048, experts=256, topk=8, shared_ffn=2048, score="sigmoid"),
    "mixtral": dict(hidden=4096, ffn=14336, experts=8, topk=2, shared_ffn=0, score="softmax"),
}


# ----------------------------------------------------------------------------------------------
# transport


def ragged_all_to_all_emulated(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
    """CPU-only stand-in for jax.lax.ragged_all_to_all with its documented semantics.

    Every slice is padded to the whole operand length and moved with a dense all_to_all, then
    scattered at the offsets the senders chose. Correct but wasteful: used for --check on
    backends that cannot compile ragged_all_to_all, never for timings that matter.
    """
    cap = operand.shape[0]
    j = jnp.arange(cap, dtype=jnp.int32)
    src = input_offsets[:, None] + j[None, :]
    sent = j[None, :] < send_sizes[:, None]
    blocks = jnp.take(operand, jnp.where(sent, src, 0), axis=0)
    blocks = jnp.where(sent.reshape(sent.shape + (1,) * (operand.ndim - 1)), blocks, 0)
    blocks = lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)
    # where this rank's received slices go: the offsets their senders were told
    dst_off = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dst = dst_off[:, None] + j[None, :]
    dst = jnp.where(j[None, :] < recv_sizes[:, None], dst, output.shape[0])  # out of range: dropped
    return output.at[dst.reshape(-1)].set(blocks.reshape((-1,) + operand.shape[1:]), mode="drop")


def ragged_all_to_all_native(*args, axis_name):
    return lax.ragged_all_to_all(*args, axis_name=axis_name)


# ----------------------------------------------------------------------------------------------
# the layer


def route(x, gate, k, score):
    """Top-k routing shared by the sharded layer and the dense reference."""
    logits = jnp.dot(x, gate, preferred_element_type=jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
    vals, idx = lax.top_k(scores, k)
    return vals / jnp.sum(vals, axis=-1, keepdims=True), idx


def swiglu(h, ffn, dtype):
    h = h.reshape(h.shape[:-1] + (2, ffn))
    return (jax.nn.silu(h[..., 0, :]) * h[..., 1, :]).astype(dtype)


def shared_expert(x, ws_in, ws_out, precision):
    h = jnp.dot(x, ws_in.reshape(ws_in.shape[0], -1), precision=precision,
                preferred_element_type=jnp.float32)
    a = swiglu(h, ws_out.shape[0], x.dtype)
    return jnp.dot(a, ws_out, precision=precision, preferred_element_type=jnp.float32)


def gather_rows(a, idx, unique=False):
    # Indices are in range by construction: skip the bounds handling of jnp.take, and let the
    # backward of a permutation be a plain scatter instead of a scatter-add.
    return a.at[idx].get(mode="promise_in_bounds", unique_indices=unique)


def recv_rows_bound(ranks, tokens, topk, local_experts):
    # A token's k experts are distinct, so it sends at most min(k, E/R) rows to any one rank; the
    # worst case (every source sends all of that to one rank) must fit without dropping rows.
    return ranks * tokens * min(topk, local_experts)


def moe_local(x, gate, w_in, w_out, *shared, topk, score, ranks, a2a, precision=None):
    """Per-device body of the expert-parallel layer (runs inside shard_map)."""
    T, H = x.shape
    E = gate.shape[1]
    El, _, _, F = w_in.shape
    R = ranks
    M = recv_rows_bound(R, T, topk, El)
    i32 = jnp.int32

    weights, experts = route(x, gate, topk, score)                    # [T, K] fp32, [T, K]

    # --- dispatch: (token, slot) pairs sorted by expert, hence by destination rank -------------
    flat_e = experts.reshape(-1).astype(i32)
    order = jnp.argsort(flat_e, stable=True)
    x_send = gather_rows(x, order // topk)                            # [T*K, H]
    counts = jnp.bincount(flat_e, length=E).astype(i32).reshape(R, El)  # rows per (dst rank, expert)
    send_sizes = counts.sum(1)
    input_offsets = jnp.cumsum(send_sizes) - send_sizes
    # recv_counts[s, e]: rows source s sends to my local expert e
    recv_counts = lax.all_to_all(counts, AXIS, 0, 0, tiled=True)
    recv_sizes = recv_counts.sum(1)
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes               # my buffer: grouped by source
    # ragged_all_to_all wants, on the sender, the offset in the receiver's buffer
    output_offsets = lax.all_to_all(recv_offsets, AXIS, 0, 0, tiled=True)

    x_recv = a2a(x_send, jnp.zeros((M, H), x.dtype), input_offsets, send_sizes, output_offsets,
                 recv_sizes, axis_name=AXIS)

    # --- group the received rows by local expert ---------------------------------------------
    # Rows arrive as blocks (source s, expert e) in s-major order; ragged_dot needs e-major. The
    # destination of every row follows from the [R, El] counts alone, so no sort is needed.
    seg_counts = recv_counts.reshape(-1)
    seg_start = jnp.cumsum(seg_counts) - seg_counts                   # in receive order
    group_sizes = recv_counts.sum(0)                                  # [El]
    group_start = jnp.cumsum(group_sizes) - group_sizes
    dst_start = (group_start[None, :] + jnp.cumsum(recv_counts, 0) - recv_counts).reshape(-1)
    rows = jnp.arange(M, dtype=i32)
    seg = jnp.searchsorted(jnp.cumsum(seg_counts), rows, side="right").astype(i32)
    real = seg < R * El
    seg = jnp.minimum(seg, R * El - 1)
    # receive row -> expert-sorted row; padding rows (past the real total) keep their place, so
    # they stay past sum(group_sizes) where ragged_dot assigns them to no group.
    pos = jnp.where(real, rows - seg_start[seg] + dst_start[seg], rows)
    perm = jnp.zeros((M,), i32).at[pos].set(rows, unique_indices=True)  # sorted row -> receive row

    xs = gather_rows(x_recv, perm, unique=True)
    h = lax.ragged_dot(xs, w_in.reshape(El, H, 2 * F), group_sizes, precision=precision,
                       preferred_element_type=jnp.float32)
    a = swiglu(h, F, x.dtype)
    y = lax.ragged_dot(a, w_out, group_sizes, precision=precision,
                       preferred_element_type=jnp.float32).astype(x.dtype)
    # Padding rows of y are never sent back (the return sizes cover real rows only) and get a
    # zero cotangent from the transport's transpose, so whatever they hold cannot leak.
    y_back = gather_rows(y, pos, unique=True)                         # back to receive order

    # --- combine: return trip is the dispatch with the roles swapped ------------------------
    y_sorted = a2a(y_back, jnp.zeros((T * topk, H), x.dtype), recv_offsets, recv_sizes,
                   lax.all_to_all(input_offsets, AXIS, 0, 0, tiled=True), send_sizes,
                   axis_name=AXIS)
    inv_order = jnp.zeros_like(order).at[order].set(jnp.arange(T * topk, dtype=order.dtype),
                                                    unique_indices=True)
    y_tk = gather_rows(y_sorted, inv_order, unique=True).reshape(T, topk, H)
    out = jnp.einsum("tk,tkh->th", weights, y_tk.astype(jnp.float32), precision=precision)
    if shared:
        out = out + shared_expert(x, *shared, precision)
    return out.astype(x.dtype)


def shard_map(f, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map as legacy_shard_map
    return legacy_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


PARAM_SPECS = {"gate": P(), "w_in": P(AXIS), "w_out": P(AXIS), "ws_in": P(), "ws_out": P()}


def make_layer(mesh, cfg, emulate=False, precision=None):
    """Returns layer(x, params) -> out on global arrays, x and out sharded over tokens."""
    body = partial(moe_local, topk=cfg["topk"], score=cfg["score"], ranks=mesh.shape[AXIS],
                   a2a=ragged_all_to_all_emulated if emulate else ragged_all_to_all_native,
                   precision=precision)
    names = ["gate", "w_in", "w_out"] + (["ws_in", "ws_out"] if cfg["shared_ffn"] else [])

    def layer(x, params):
        f = shard_map(body, mesh, (P(AXIS),) + tuple(PARAM_SPECS[n] for n in names), P(AXIS))
        return f(x, *(params[n] for n in names))

    return layer


def dense_reference(x, params, cfg, precision=None):
    """Single-device layer without dispatch: every expert on every token, combined by weights."""
    weights, experts = route(x, params["gate"], cfg["topk"], cfg["score"])
    E = params["gate"].shape[1]
    F = params["w_out"].shape[1]
    combine = jnp.zeros((x.shape[0], E), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
    h = jnp.einsum("nh,ehcf->necf", x, params["w_in"], precision=precision,
                   preferred_element_type=jnp.float32)
    a = swiglu(h.reshape(h.shape[:2] + (2 * F,)), F, x.dtype)
    y = jnp.einsum("nef,efh->neh", a, params["w_out"], precision=precision,
                   preferred_element_type=jnp.float32)
    out = jnp.einsum("ne,neh->nh", combine, y, precision=precision)
    if cfg["shared_ffn"]:
        out = out + shared_expert(x, params["ws_in"], params["ws_out"], precision)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# inputs


def init(mesh, cfg, tokens, dtype, seed):
    """x [R*T, H], d_out, and params, each generated directly in its sharding (the DeepSeek-V3
    expert weights are 23 GB in bf16: they must never exist whole on one device)."""
    R = mesh.shape[AXIS]
    H, F, E, Fs = cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["shared_ffn"]
    shapes = {"x": ((R * tokens, H), 1.0, P(AXIS)), "d_out": ((R * tokens, H), 1.0, P(AXIS)),
              "gate": ((H, E), H ** -0.5, P()),
              "w_in": ((E, H, 2, F), H ** -0.5, P(AXIS)), "w_out": ((E, F, H), F ** -0.5, P(AXIS))}
    if Fs:
        shapes["ws_in"] = ((H, 2, Fs), H ** -0.5, P())
        shapes["ws_out"] = ((Fs, H), Fs ** -0.5, P())
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    out = {}
    for key, (name, (shape, scale, spec)) in zip(keys, shapes.items()):
        gen = jax.jit(lambda k, shape=shape, scale=scale: (jax.random.normal(k, shape, jnp.float32)
                                                             * scale).astype(dtype),
                      out_shardings=NamedSharding(mesh, spec))
        out[name] = gen(key)
    x, d_out = out.pop("x"), out.pop("d_out")
    return x, d_out, out


def put(mesh, x, params):
    x = jax.device_put(x, NamedSharding(mesh, P(AXIS)))
    params = {n: jax.device_put(v, NamedSharding(mesh, PARAM_SPECS[n])) for n, v in params.items()}
    return x, params


def loss_fn(layer):
    def loss(x, params, d_out):
        return jnp.sum(layer(x, params).astype(jnp.float32) * d_out.astype(jnp.float32))
    return loss


def select_ragged_dot(choice):
    """Picks the ragged_dot lowering on GPU; returns its label for the JSON line."""
    if jax.default_backend() != "gpu":
        return "xla"
    try:
        have_pallas = importlib.util.find_spec("jax._src.lax.pallas_lowerings.gpu.ragged_dot") is not None
    except ModuleNotFoundError:
        have_pallas = False
    if choice == "auto":
        choice = "pallas" if have_pallas else "xla"
    if choice == "pallas":
        if not have_pallas:
            sys.exit("--ragged-dot pallas: this JAX has no Pallas-Triton ragged_dot lowering")
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
        return "pallas-triton"
    print("warning: ragged_dot uses XLA's CUDA lowering (a masked dense dot over all groups); "
          "large shapes may not fit", file=sys.stderr)
    return "xla"


# ----------------------------------------------------------------------------------------------
# --check


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def check(args, mesh, emulate):
    R = mesh.shape[AXIS]
    prec = lax.Precision.HIGHEST
    # fp32 throughout so that a wrong row or a wrong offset stands out from rounding; on GPU the
    # grouped matmul may still round through TF32, hence the looser bound there.
    tol = 1e-4 if jax.default_backend() == "cpu" else 5e-3
    T, H, F = 64, 128, 64
    cases = [
        dict(name="softmax", experts=16, topk=4, shared_ffn=0, score="softmax", skew=False),
        dict(name="sigmoid+shared", experts=16, topk=4, shared_ffn=64, score="sigmoid", skew=False),
        # every token prefers the first rank's experts: that rank's buffer fills to the bound
        dict(name="skewed", experts=max(8, R), topk=4, shared_ffn=0, score="softmax", skew=True),
    ]
    results, worst, ok = [], 0.0, True
    for i, case in enumerate(cases):
        cfg = dict(hidden=H, ffn=F, experts=case["experts"], topk=case["topk"],
                   shared_ffn=case["shared_ffn"], score=case["score"])
        if cfg["experts"] % R:
            continue
        x, d_out, params = init(mesh, cfg, T, jnp.float32, args.seed + i)
        x, d_out = np.array(x), np.array(d_out)
        params = {n: np.array(v) for n, v in params.items()}
        if case["skew"]:
            x[:, 0] = 2.0
            params["gate"][0, :2] += 4.0
        ref_loss = loss_fn(lambda x, p: dense_reference(x, p, cfg, prec))
        ref_out = jax.jit(lambda x, p: dense_reference(x, p, cfg, prec))(x, params)
        ref_grads = jax.jit(jax.grad(ref_loss, argnums=(0, 1)))(x, params, d_out)

        layer = make_layer(mesh, cfg, emulate=emulate, precision=prec)
        xs, ps = put(mesh, x, params)
        ds = jax.device_put(d_out, NamedSharding(mesh, P(AXIS)))
        out = jax.jit(layer)(xs, ps)
        grads = jax.jit(jax.grad(loss_fn(layer), argnums=(0, 1)))(xs, ps, ds)

        errs = {"out": rel_err(out, ref_out), "dx": rel_err(grads[0], ref_grads[0])}
        errs.update({"d" + n: rel_err(grads[1][n], ref_grads[1][n]) for n in params})
        case_max = max(errs.values())
        worst = max(worst, case_max)
        ok &= case_max <= tol and all(np.isfinite(v) for v in errs.values())
        results.append({"case": case["name"], "max_rel_err": case_max,
                        "worst": max(errs, key=errs.get)})

        if emulate:
            # the real transport cannot run here; at least make sure it traces, differentiates
            # and lowers with the same offsets
            real = make_layer(mesh, cfg, emulate=False, precision=prec)
            jax.jit(jax.grad(loss_fn(real), argnums=(0, 1))).lower(xs, ps, ds)

    line = {"check": "jax_moe_baseline", "ok": bool(ok), "max_rel_err": worst, "tol": tol,
            "ranks": R, "backend": jax.default_backend(),
            "transport": "emulated-all_to_all" if emulate else "ragged_all_to_all",
            "ragged_dot": args.ragged_dot_label, "cases": results}
    if emulate:
        line["ragged_all_to_all_path"] = "lowered, not run"
    print(json.dumps(line), flush=True)
    return ok


# ----------------------------------------------------------------------------------------------
# benchmark


def time_calls(fn, args, iters, warmup):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / iters * 1e6


def bench(args, mesh, emulate):
    cfg = dict(PRESETS[args.preset])
    for k in ("hidden", "ffn", "experts", "topk", "shared_ffn", "score"):
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    R = mesh.shape[AXIS]
    if cfg["experts"] % R:
        sys.exit(f"--experts {cfg['experts']} is not divisible by {R} devices")
    x, d_out, params = init(mesh, cfg, args.tokens, jnp.bfloat16, args.seed)
    layer = make_layer(mesh, cfg, emulate=emulate)
    fwd = jax.jit(layer)
    fwd_bwd = jax.jit(jax.value_and_grad(loss_fn(layer), argnums=(0, 1)))

    fwd_us = time_calls(fwd, (x, params), args.iters, args.warmup)
    fwd_bwd_us = time_calls(fwd_bwd, (x, params, d_out), args.iters, args.warmup)

    line = {"bench": "layer", "impl": "jax", "preset": args.preset, "ranks": R,
            "tokens": args.tokens, "hidden": cfg["hidden"], "ffn": cfg["ffn"],
            "experts": cfg["experts"], "topk": cfg["topk"], "shared_ffn": cfg["shared_ffn"],
            "score": cfg["score"], "fwd_us": round(fwd_us, 1), "fwd_bwd_us": round(fwd_bwd_us, 1),
            "iters": args.iters,
            "recv_rows": recv_rows_bound(R, args.tokens, cfg["topk"], cfg["experts"] // R),
            "transport": "emulated-all_to_all" if emulate else "ragged_all_to_all",
            "ragged_dot": args.ragged_dot_label, "device": jax.devices()[0].device_kind}
    stats = [d.memory_stats() for d in mesh.devices.flat]
    peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
    if peaks:
        line["gpu_mem_peak_gb"] = round(max(peaks) / 1e9, 2)
    print(json.dumps(line), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="deepseek-v3")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per device")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--ffn", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--topk", type=int)
    ap.add_argument("--shared-ffn", dest="shared_ffn", type=int, help="0: no shared expert")
    ap.add_argument("--score", choices=["softmax", "sigmoid"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ragged-dot", dest="ragged_dot", choices=["auto", "pallas", "xla"],
                    default="auto", help="GPU lowering of ragged_dot")
    ap.add_argument("--check", action="store_true", help="correctness check at a small shape")
    ap.add_argument("--cpu-emulation", dest="cpu_emulation", action="store_true",
                    help="replace ragged_all_to_all by a padded all_to_all (for CPU testing only)")
    args = ap.parse_args()

    args.ragged_dot_label = select_ragged_dot(args.ragged_dot)
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    emulate = args.cpu_emulation or (args.check and jax.default_backend() == "cpu")
    if jax.default_backend() == "cpu" and not emulate:
        sys.exit("XLA:CPU cannot compile ragged_all_to_all: add --cpu-emulation to try it on CPU")
    if args.check:
        sys.exit(0 if check(args, mesh, emulate) else 1)
    bench(args, mesh, emulate)


if __name__ == "__main__":
    main()
