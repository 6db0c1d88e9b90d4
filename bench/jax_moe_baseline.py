#!/usr/bin/env python3
"""Pure-JAX expert-parallel MoE layer: the baseline that epx's JAX binding is measured against.

It is the layer a JAX user writes without epx, in one process over all local devices (a 1-D mesh,
axis "ep", inside shard_map):

    router (x @ gate in fp32, softmax or sigmoid scores, top-k, weights renormalised over the k)
    -> sort the (token, slot) pairs by expert -> jax.lax.ragged_all_to_all to the experts' ranks
    -> group the received rows by local expert -> grouped SwiGLU FFN (see the modes below)
    -> jax.lax.ragged_all_to_all back -> un-sort -> weighted sum over the k in fp32
    (+ a dense shared expert when the preset has one).

Parameters and activations are bf16; matmuls accumulate in fp32. x is sharded over tokens
([R*T, H] -> [T, H] per device), the gate and the shared expert are replicated, the routed experts
are sharded over experts (w_in [E, H, 2, F] -> [E/R, H, 2, F], w_out [E, F, H] -> [E/R, F, H]).
Every device receives into a buffer of M = R*T*min(K, E/R) rows, the worst case of any routing;
the rows past the ones received ("padding rows") are zeroed explicitly, so nothing depends on
ragged_all_to_all leaving the rest of its output buffer untouched.

The output buffer handed to ragged_all_to_all is typed as varying over the devices (varying()).
ragged_all_to_all types its result like that buffer; the earlier version passed a plain
jnp.zeros, so JAX took the received rows for device-invariant, and autodiff turned the implicit
broadcast where they meet per-device data into a psum of their cotangents over the devices (in
the dispatch on the received rows, in the combine on the gathered [T, K, H] rows). That is why
--check failed on the GPUs (forward right, gradients off by O(1)) and passed on CPU, whose
emulated transport returns a varying result. Summing those two cotangents over the devices on CPU
reproduces the GPU numbers of the failed check (max rel. err 1.5825 / 1.0704 / 1.3068, worst
dw_out / dw_out / dx, against 1.5826 / 1.0704 / 1.3049 measured on 2 x H200); the fix itself is
not yet run on a GPU.

Exchange gradients (--exchange-vjp):
  custom (default)  each ragged_all_to_all is wrapped in a jax.custom_vjp whose backward is the
                    explicit reverse ragged_all_to_all: the cotangent rows go back along the same
                    slices with the roles swapped (my received slices become my sent slices, the
                    senders' input offsets become the output offsets), and operand rows that were
                    not sent get a zero cotangent. Gradients then use only the forward collective.
  jax               JAX's own transpose rule of ragged_all_to_all.

Grouped FFN modes (--ragged-dot; the JSON field "ragged_dot" says which ran):
  xla       jax.lax.ragged_dot over all local experts at once, with the backend's default lowering.
            On CUDA that is XLA's lowering, a dense dot masked per group (memory and time
            proportional to local experts x M rows: it asks for 112 GiB at DeepSeek-V3); on CPU it
            is JAX's own expansion of the same kind.
  pallas    the same call through JAX's Pallas-Triton lowering, which computes only the real rows,
            when the installed JAX has it.
  segment   exact for every routing, no ragged_dot: the expert-sorted rows are cut into tiles of
            B rows (--tile-rows) that never straddle two experts; a lax.scan over a static number
            of tiles, El + M // B (a bound for any routing), runs per tile a dense
            [B, H] x [H, 2F] and [B, F] x [F, H] with that tile's expert weights, on the real rows
            only (rows past an expert's count are masked). Its backward is a hand-written scan of
            the same tiles (jax.custom_vjp) that accumulates the expert weight gradients in fp32
            in place. Cost: up to El + M // B tiles of B rows, whether used or not.
  capacity  the layout many JAX MoE codebases use ("dropping", GShard/Switch style): the received
            rows are bucketed per local expert into a dense [El, C, H] buffer and the FFN is two
            batched einsums [El, C, H] x [El, H, 2F] and [El, C, F] x [El, F, H]. Rows past an
            expert's capacity C would be dropped (their expert output is zero). Here C is the
            largest per-expert count of the run's routing (measured on the benchmark's inputs
            before compiling) times --capacity-factor (1.25), so nothing is dropped and the
            result is exact; every call counts the rows it dropped and the JSON line reports
            "dropped_rows" (must be 0) and "capacity".
  auto      (default) pallas when available, otherwise the cheapest of xla / capacity / segment
            (matmul rows processed) whose estimated per-device memory fits the device; it prints
            its choice and the estimates on stderr. The estimates are rough (dominant buffers).

It prints one JSON line per run: the mean time of the jitted forward and of the jitted
forward+backward (gradients w.r.t. x and every parameter), and the peak device memory when the
backend reports it.

    python3 bench/jax_moe_baseline.py --preset deepseek-v3     # H=7168 F=2048 E=256 K=8 + shared
    python3 bench/jax_moe_baseline.py --preset mixtral         # H=4096 F=14336 E=8 K=2
    python3 bench/jax_moe_baseline.py --check                  # small-shape correctness check

--check runs in fp32 at small shapes, three routings (softmax, sigmoid + shared expert, skewed:
one rank's buffer fills to the bound), and reports per case, on one JSON line per (mode,
exchange-vjp) pair (every mode and both exchange variants unless --ragged-dot / --exchange-vjp
name one):
  out            (a) forward output of the sharded layer against a dense single-device reference
  grads          (b) gradient of every input (dx, dgate, dw_in, ...) against the reference
  exchange       (c) ragged_all_to_all alone, forward: the received buffer against the one built
                 on the host from the documented semantics (and, on a mismatch, whether it matches
                 the other reading of output_offsets), rows not received must keep the output
                 buffer's content, and rows sent to their owners and straight back must equal
                 the input (exact)
  exchange_grad  (d) the same under jax.grad with this line's exchange-vjp: one way (cotangent of
                 each sent row = the cotangent at its destination) and the round trip (exact)
  ragged_dot     (e) jax.lax.ragged_dot alone on this case's received group sizes (padding rows
                 past the groups zero, as in the layer) against a dense per-group reference,
                 forward and gradients; "info" says whether rows past the groups are ignored when
                 they are not zero (not required by the layer)
  exchange.result_varying, collectives
                 the type of the real transport's result (must be varying over the devices) and
                 the number of psums in the layer's gradient traced with the real transport
                 against the emulation (must be equal): both are traced only, so they hold on CPU
                 too, and they catch the typing fault above without a GPU
The last line is a summary; the exit status is 1 when any part fails, and "failed" names each
failing mode/exchange-vjp/case/part. The CPU backend cannot compile ragged_all_to_all, so on CPU
(or with --cpu-emulation) the transport is an emulation built from a plain all_to_all of padded
blocks; the real ragged_all_to_all path is then only traced, differentiated and lowered. Use
XLA_FLAGS=--xla_force_host_platform_device_count=4 to check with several CPU devices.
"""
import argparse
import importlib.util
import json
import math
import sys
import time
from functools import partial

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "ep"
MODES = ("xla", "pallas", "segment", "capacity")

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


def varying(z):
    """A fresh buffer typed as varying over the device axis (shard_map's type system).

    ragged_all_to_all types its result like its `output` argument: handed a plain jnp.zeros, which
    shard_map types as the same on every device, it returns rows that JAX then treats as
    device-invariant, and autodiff turns the implicit broadcast of those rows into a psum of their
    cotangents over the devices (wrong gradients; the CPU emulation's result is typed varying and
    hides it). Every output buffer handed to the transport goes through here.
    """
    for cast in (lambda: lax.pcast(z, AXIS, to="varying"), lambda: lax.pvary(z, AXIS)):
        try:
            return cast()
        except (AttributeError, TypeError, ValueError):
            pass
    return z    # no such type system here; --check's typing parts say so if it matters


def slices_mask(offsets, sizes, n):
    """[n] bool: rows covered by the slices [offsets[i], offsets[i] + sizes[i]) (disjoint)."""
    d = jnp.zeros((n + 1,), jnp.int32)
    d = d.at[offsets].add(1, mode="drop").at[offsets + sizes].add(-1, mode="drop")
    return jnp.cumsum(d)[:n] > 0


def make_exchange(transport, vjp):
    """exchange(operand, out_rows, input_offsets, send_sizes, output_offsets, recv_sizes) -> rows.

    The received rows land in a zero buffer of out_rows rows (ragged_all_to_all's semantics).
    vjp="jax": JAX differentiates ragged_all_to_all with its own transpose rule.
    vjp="custom": jax.custom_vjp whose backward is the explicit reverse ragged_all_to_all.
    """
    def forward(operand, out_rows, input_offsets, send_sizes, output_offsets, recv_sizes):
        out = varying(jnp.zeros((out_rows,) + operand.shape[1:], operand.dtype))
        return transport(operand, out, input_offsets, send_sizes, output_offsets, recv_sizes,
                         axis_name=AXIS)

    if vjp == "jax":
        return forward
    if vjp != "custom":
        raise ValueError(vjp)

    def exchange(operand, out_rows, input_offsets, send_sizes, output_offsets, recv_sizes):
        n_rows, row_shape, dtype = operand.shape[0], operand.shape[1:], operand.dtype

        @jax.custom_vjp
        def f(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
            return forward(operand, out_rows, input_offsets, send_sizes, output_offsets,
                           recv_sizes)

        def f_fwd(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
            out = forward(operand, out_rows, input_offsets, send_sizes, output_offsets, recv_sizes)
            return out, (input_offsets, send_sizes, output_offsets, recv_sizes)

        def f_bwd(res, ct):
            input_offsets, send_sizes, output_offsets, recv_sizes = res
            # where the slices I received sit in my buffer, and where the slices I sent came
            # from in their senders' operands (as seen by me, their receiver)
            my_recv_offsets = lax.all_to_all(output_offsets, AXIS, 0, 0, tiled=True)
            their_input_offsets = lax.all_to_all(input_offsets, AXIS, 0, 0, tiled=True)
            d_operand = transport(ct, varying(jnp.zeros((n_rows,) + row_shape, ct.dtype)),
                                  my_recv_offsets, recv_sizes, their_input_offsets, send_sizes,
                                  axis_name=AXIS)
            sent = slices_mask(input_offsets, send_sizes, n_rows)
            d_operand = jnp.where(sent.reshape((-1,) + (1,) * len(row_shape)), d_operand, 0)
            return (d_operand.astype(dtype), None, None, None, None)

        f.defvjp(f_fwd, f_bwd)
        return f(operand, input_offsets, send_sizes, output_offsets, recv_sizes)

    return exchange


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


def segment_tiles(rows, local_experts, tile_rows):
    """(B, NT): tile size and the static tile count that covers any routing of `rows` rows."""
    B = max(1, min(tile_rows, rows))
    # sum_e ceil(n_e / B) <= sum_e (n_e // B + 1) <= rows // B + El
    return B, local_experts + rows // B


def dispatch_plan(x, gate, topk, score, R, El):
    """Routing and the exchange's offsets on one device (inside shard_map)."""
    T = x.shape[0]
    E = gate.shape[1]
    i32 = jnp.int32
    weights, experts = route(x, gate, topk, score)                    # [T, K] fp32, [T, K]
    # (token, slot) pairs sorted by expert, hence by destination rank
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
    return dict(weights=weights, order=order, x_send=x_send, counts=counts, send_sizes=send_sizes,
                input_offsets=input_offsets, recv_counts=recv_counts, recv_sizes=recv_sizes,
                recv_offsets=recv_offsets, output_offsets=output_offsets)


def ffn_ragged(xs, w_in, w_out, group_sizes, precision):
    """Grouped SwiGLU FFN on expert-sorted rows with jax.lax.ragged_dot (modes xla, pallas)."""
    El, H, _, F = w_in.shape
    h = lax.ragged_dot(xs, w_in.reshape(El, H, 2 * F), group_sizes, precision=precision,
                       preferred_element_type=jnp.float32)
    a = swiglu(h, F, xs.dtype)
    return lax.ragged_dot(a, w_out, group_sizes, precision=precision,
                          preferred_element_type=jnp.float32).astype(xs.dtype)


def _segment_schedule(group_sizes, M, B, NT):
    """Per tile: its expert, first row (expert-sorted order) and number of real rows."""
    i32 = jnp.int32
    El = group_sizes.shape[0]
    tiles = (group_sizes + B - 1) // B
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    group_start = jnp.cumsum(group_sizes) - group_sizes
    i = jnp.arange(NT, dtype=i32)
    e = jnp.minimum(jnp.searchsorted(tile_end, i, side="right"), El - 1).astype(i32)
    k = i - tile_start[e]
    used = i < tile_end[-1]
    # unused tiles point past the real rows, into the B padding rows of the tile buffers
    row0 = jnp.where(used, group_start[e] + k * B, M).astype(i32)
    count = jnp.where(used, jnp.minimum(group_sizes[e] - k * B, B), 0).astype(i32)
    return e, row0, count


def _w(w, e):
    return lax.dynamic_index_in_dim(w, e, 0, keepdims=False)


def _segment_tile_fwd(xs_pad, w_in, w_out, tile, B, precision):
    e, row0, count = tile
    H, _, F = w_in.shape[1:]
    mask = (jnp.arange(B) < count)[:, None]
    xt = jnp.where(mask, lax.dynamic_slice_in_dim(xs_pad, row0, B, 0), 0)
    h = jnp.dot(xt, _w(w_in, e).reshape(H, 2 * F), precision=precision,
                preferred_element_type=jnp.float32)
    a = swiglu(h, F, xs_pad.dtype)
    y = jnp.dot(a, _w(w_out, e), precision=precision, preferred_element_type=jnp.float32)
    return jnp.where(mask, y.astype(xs_pad.dtype), 0), h


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def ffn_segment(xs, w_in, w_out, group_sizes, B, NT, precision):
    """Grouped SwiGLU FFN on expert-sorted rows, tile by tile (mode segment); see the docstring.

    Each tile writes its B rows at its first row, zeros past its real rows; tiles run in
    increasing row order, so the rows a partial tile zeroes belong to later tiles (or padding)
    and are written again afterwards. Rows past sum(group_sizes) come out zero.
    """
    return _segment_fwd(xs, w_in, w_out, group_sizes, B, NT, precision)[0]


def _segment_fwd(xs, w_in, w_out, group_sizes, B, NT, precision):
    M, H = xs.shape
    sched = _segment_schedule(group_sizes, M, B, NT)
    xs_pad = jnp.concatenate([xs, jnp.zeros((B, H), xs.dtype)])

    def body(y, tile):
        yt, h = _segment_tile_fwd(xs_pad, w_in, w_out, tile, B, precision)
        return lax.dynamic_update_slice_in_dim(y, yt, tile[1], 0), h

    y, hs = lax.scan(body, jnp.zeros_like(xs_pad), sched)
    return y[:M], (xs_pad, w_in, w_out, sched, hs)


def _segment_bwd(B, NT, precision, res, dy):
    xs_pad, w_in, w_out, sched, hs = res
    M = xs_pad.shape[0] - B
    El, H, _, F = w_in.shape
    dtype = xs_pad.dtype
    dy_pad = jnp.concatenate([dy.astype(dtype), jnp.zeros((B, H), dtype)])

    def body(carry, tile_h):
        dx, dwi, dwo = carry
        (e, row0, count), h = tile_h
        mask = (jnp.arange(B) < count)[:, None]
        xt = jnp.where(mask, lax.dynamic_slice_in_dim(xs_pad, row0, B, 0), 0)
        dyt = jnp.where(mask, lax.dynamic_slice_in_dim(dy_pad, row0, B, 0), 0)
        a, swiglu_vjp = jax.vjp(lambda h: swiglu(h, F, dtype), h)
        dwo = lax.dynamic_update_index_in_dim(
            dwo, _w(dwo, e) + jnp.dot(a.T, dyt, precision=precision,
                                      preferred_element_type=jnp.float32), e, 0)
        da = jnp.dot(dyt, _w(w_out, e).T, precision=precision, preferred_element_type=jnp.float32)
        (dh,) = swiglu_vjp(da.astype(dtype))
        dh = jnp.where(mask, dh, 0).astype(dtype)
        dwi = lax.dynamic_update_index_in_dim(
            dwi, _w(dwi, e) + jnp.dot(xt.T, dh, precision=precision,
                                      preferred_element_type=jnp.float32), e, 0)
        dxt = jnp.dot(dh, _w(w_in, e).reshape(H, 2 * F).T, precision=precision,
                      preferred_element_type=jnp.float32)
        dxt = jnp.where(mask, dxt.astype(dtype), 0)
        return (lax.dynamic_update_slice_in_dim(dx, dxt, row0, 0), dwi, dwo), None

    # zeros_like keeps the operands' varying-over-devices type (shard_map's scan carries)
    init = (jnp.zeros_like(xs_pad), jnp.zeros_like(w_in, jnp.float32).reshape(El, H, 2 * F),
            jnp.zeros_like(w_out, jnp.float32))
    (dx, dwi, dwo), _ = lax.scan(body, init, (sched, hs))
    return (dx[:M], dwi.reshape(w_in.shape).astype(w_in.dtype), dwo.astype(w_out.dtype), None)


ffn_segment.defvjp(_segment_fwd, _segment_bwd)


def moe_local(x, gate, w_in, w_out, *shared, topk, score, ranks, exchange, mode="xla",
              capacity=None, tile_rows=256, precision=None):
    """Per-device body of the expert-parallel layer (runs inside shard_map).

    Returns (out [T, H], dropped [1]): dropped counts the rows the capacity mode dropped (0 in the
    other modes).
    """
    T, H = x.shape
    El, _, _, F = w_in.shape
    R = ranks
    M = recv_rows_bound(R, T, topk, El)
    i32 = jnp.int32

    plan = dispatch_plan(x, gate, topk, score, R, El)
    recv_counts, recv_sizes = plan["recv_counts"], plan["recv_sizes"]
    x_recv = exchange(plan["x_send"], M, plan["input_offsets"], plan["send_sizes"],
                      plan["output_offsets"], recv_sizes)

    # --- group the received rows by local expert ---------------------------------------------
    # Rows arrive as blocks (source s, expert e) in s-major order; the FFN needs e-major. The
    # destination of every row follows from the [R, El] counts alone, so no sort is needed.
    seg_counts = recv_counts.reshape(-1)
    seg_start = jnp.cumsum(seg_counts) - seg_counts                   # in receive order
    group_sizes = recv_counts.sum(0)                                  # [El]
    group_start = jnp.cumsum(group_sizes) - group_sizes
    total = group_sizes.sum()
    dst_start = (group_start[None, :] + jnp.cumsum(recv_counts, 0) - recv_counts).reshape(-1)
    rows = jnp.arange(M, dtype=i32)
    seg = jnp.searchsorted(jnp.cumsum(seg_counts), rows, side="right").astype(i32)
    real = seg < R * El
    seg = jnp.minimum(seg, R * El - 1)
    # receive row -> expert-sorted row; padding rows (past the real total) keep their place, so
    # they stay past sum(group_sizes) where the FFN assigns them to no expert.
    pos = jnp.where(real, rows - seg_start[seg] + dst_start[seg], rows)
    perm = jnp.zeros((M,), i32).at[pos].set(rows, unique_indices=True)  # sorted -> receive row
    dropped = jnp.zeros((1,), i32)

    if mode == "capacity":
        C = capacity
        # slot (e, j) <- the j-th row of expert e; rows past the count or past C: none / dropped
        j = jnp.arange(C, dtype=i32)
        valid = j[None, :] < jnp.minimum(group_sizes, C)[:, None]                  # [El, C]
        src = perm[jnp.minimum(group_start[:, None] + j[None, :], M - 1)]
        xb = jnp.where(valid[..., None], gather_rows(x_recv, src.reshape(-1)).reshape(El, C, H), 0)
        h = jnp.einsum("ech,ehf->ecf", xb, w_in.reshape(El, H, 2 * F), precision=precision,
                       preferred_element_type=jnp.float32)
        a = swiglu(h, F, x.dtype)
        yb = jnp.einsum("ecf,efh->ech", a, w_out, precision=precision,
                        preferred_element_type=jnp.float32).astype(x.dtype)
        e_r = seg % El
        j_r = pos - group_start[e_r]
        keep = real & (j_r < C)
        y_back = gather_rows(yb.reshape(El * C, H), e_r * C + jnp.clip(j_r, 0, C - 1))
        y_back = jnp.where(keep[:, None], y_back, 0)
        dropped = jnp.maximum(group_sizes - C, 0).sum().reshape(1).astype(i32)
    else:
        xs = gather_rows(x_recv, perm, unique=True)
        xs = jnp.where((rows < total)[:, None], xs, 0)
        if mode == "segment":
            B, NT = segment_tiles(M, El, tile_rows)
            y = ffn_segment(xs, w_in, w_out, group_sizes, B, NT, precision)
        else:
            y = ffn_ragged(xs, w_in, w_out, group_sizes, precision)
        # Padding rows of y are never sent back (the return sizes cover real rows only).
        y_back = gather_rows(y, pos, unique=True)                     # back to receive order

    # --- combine: return trip is the dispatch with the roles swapped ------------------------
    y_sorted = exchange(y_back, T * topk, plan["recv_offsets"], recv_sizes,
                        lax.all_to_all(plan["input_offsets"], AXIS, 0, 0, tiled=True),
                        plan["send_sizes"])
    order = plan["order"]
    inv_order = jnp.zeros_like(order).at[order].set(jnp.arange(T * topk, dtype=order.dtype),
                                                    unique_indices=True)
    y_tk = gather_rows(y_sorted, inv_order, unique=True).reshape(T, topk, H)
    out = jnp.einsum("tk,tkh->th", plan["weights"], y_tk.astype(jnp.float32), precision=precision)
    if shared:
        out = out + shared_expert(x, *shared, precision)
    return out.astype(x.dtype), dropped


def shard_map(f, mesh, in_specs, out_specs):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    from jax.experimental.shard_map import shard_map as legacy_shard_map
    return legacy_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


PARAM_SPECS = {"gate": P(), "w_in": P(AXIS), "w_out": P(AXIS), "ws_in": P(), "ws_out": P()}


def transport_fn(emulate):
    return ragged_all_to_all_emulated if emulate else ragged_all_to_all_native


def make_layer(mesh, cfg, emulate=False, precision=None, exchange_vjp="custom", mode="xla",
               capacity=None, tile_rows=256):
    """Returns layer(x, params) -> (out, dropped) on global arrays, x and out sharded over tokens,
    dropped [R]: rows each device's capacity buckets dropped (always 0 outside mode capacity)."""
    if mode == "capacity" and not capacity:
        raise ValueError("mode capacity needs a capacity")
    body = partial(moe_local, topk=cfg["topk"], score=cfg["score"], ranks=mesh.shape[AXIS],
                   exchange=make_exchange(transport_fn(emulate), exchange_vjp),
                   mode="xla" if mode == "pallas" else mode, capacity=capacity,
                   tile_rows=tile_rows, precision=precision)
    names = ["gate", "w_in", "w_out"] + (["ws_in", "ws_out"] if cfg["shared_ffn"] else [])

    def layer(x, params):
        f = shard_map(body, mesh, (P(AXIS),) + tuple(PARAM_SPECS[n] for n in names),
                      (P(AXIS), P(AXIS)))
        return f(x, *(params[n] for n in names))

    return layer


def routing_counts(mesh, cfg, x, gate):
    """[R, El] numpy: rows each device receives per local expert, for the layer's routing of x."""
    R = mesh.shape[AXIS]
    El = cfg["experts"] // R

    def body(x, gate):
        plan = dispatch_plan(x, gate, cfg["topk"], cfg["score"], R, El)
        return plan["recv_counts"].sum(0)[None]

    f = jax.jit(shard_map(body, mesh, (P(AXIS), P()), P(AXIS)))
    return np.asarray(f(x, gate))


def pick_capacity(counts, ranks, tokens, factor):
    """Static per-expert capacity: the largest observed count times factor, rounded up to 8,
    never above ranks*tokens (a token sends at most one row to a given expert)."""
    c = int(math.ceil(max(int(np.max(counts)), 1) * factor))
    return int(min(-(-c // 8) * 8, ranks * tokens))


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
    """loss(x, params, d_out) -> (scalar, dropped): use with has_aux=True."""
    def loss(x, params, d_out):
        out, dropped = layer(x, params)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32)), dropped
    return loss


def have_pallas_ragged_dot():
    if jax.default_backend() != "gpu":
        return False
    try:
        return importlib.util.find_spec("jax._src.lax.pallas_lowerings.gpu.ragged_dot") is not None
    except ModuleNotFoundError:
        return False


def enable_mode(mode):
    """Global switches a mode needs; returns its label for the JSON line."""
    if mode == "pallas":
        if not have_pallas_ragged_dot():
            sys.exit("--ragged-dot pallas: this JAX has no Pallas-Triton ragged_dot lowering")
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
        return "pallas-triton"
    if mode == "xla" and jax.default_backend() == "gpu":
        print("warning: ragged_dot uses XLA's CUDA lowering (a masked dense dot over all groups); "
              "large shapes may not fit", file=sys.stderr)
    return mode


def estimate(mode, cfg, R, T, capacity, tile_rows, act_bytes=2):
    """Rough per-device (bytes, matmul rows) of a mode at a shape: dominant buffers only."""
    H, F, E, K = cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["topk"]
    El = E // R
    M = recv_rows_bound(R, T, K, El)
    weights = El * 3 * H * F * act_bytes * 3                      # params, grads, one temporary
    # dispatch/combine buffers (x_send, x_recv, sorted rows, y, y_back, y_sorted), fwd + bwd
    rows = 2 * (2 * T * K + 4 * M) * H * act_bytes
    if mode in ("xla",):
        # the masked lowering expands both operands of the weight gradient per group
        extra = El * M * (H * act_bytes + 2 * F * 4) + M * 3 * F * 4
        work = El * M
    elif mode == "pallas":
        extra = M * 3 * F * 4
        work = M
    elif mode == "capacity":
        extra = El * capacity * (3 * H * act_bytes + 2 * 2 * F * 4 + 2 * F * act_bytes)
        work = El * capacity
    elif mode == "segment":
        B, NT = segment_tiles(M, El, tile_rows)
        extra = NT * B * 2 * F * 4 + El * 3 * H * F * 4 + 2 * (M + B) * H * act_bytes
        work = NT * B
    else:
        raise ValueError(mode)
    return weights + rows + extra, work


def device_bytes(mesh):
    stats = mesh.devices.flat[0].memory_stats()
    return stats.get("bytes_limit") if stats else None


def choose_mode(args, cfg, mesh, T, capacity):
    """Resolves --ragged-dot auto: returns (mode, {mode: estimated GB})."""
    R = mesh.shape[AXIS]
    cands = ["xla", "capacity", "segment"] + (["pallas"] if have_pallas_ragged_dot() else [])
    est = {m: estimate(m, cfg, R, T, capacity, args.tile_rows) for m in cands}
    gb = {m: round(b / 1e9, 2) for m, (b, _) in est.items()}
    if args.ragged_dot != "auto":
        return args.ragged_dot, gb
    if "pallas" in cands:
        mode = "pallas"
    else:
        limit = device_bytes(mesh)
        fits = [m for m in cands if limit is None or est[m][0] <= 0.9 * limit]
        if not fits:
            fits = [min(cands, key=lambda m: est[m][0])]
        mode = min(fits, key=lambda m: est[m][1])
    print(f"--ragged-dot auto: {mode} (estimated GB per device: {gb}, device limit "
          f"{device_bytes(mesh)})", file=sys.stderr)
    return mode, gb


# ----------------------------------------------------------------------------------------------
# --check


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def abs_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


SENTINEL = -7.0


def host_exchange(x_send, counts, R, M, sentinel, semantics="documented"):
    """Expected receive buffers [R, M, H] of the layer's dispatch exchange, built on the host.

    x_send [R, T*K, H], counts [R(src), R(dst), El]. "documented": a slice from s lands on its
    receiver r at output_offsets_s[r] (the offset s was told, = r's recv offset of source s).
    "receiver-local": the other reading, r places it at output_offsets_r[s].
    """
    sizes = counts.sum(2)                                   # [src, dst]
    in_off = np.cumsum(sizes, 1) - sizes                    # [src, dst]: offsets in x_send
    recv_off = np.cumsum(sizes, 0) - sizes                  # [src, dst]: offsets in dst's buffer
    out = np.full((R, M) + x_send.shape[2:], sentinel, x_send.dtype)
    for r in range(R):
        for s in range(R):
            n = sizes[s, r]
            at = recv_off[s, r] if semantics == "documented" else recv_off[r, s]
            if at + n > M:
                return None
            out[r, at:at + n] = x_send[s, in_off[s, r]:in_off[s, r] + n]
    return out


def exchange_tests(mesh, cfg, x, gate, emulate, variants, seed):
    """Parts (c) and (d): ragged_all_to_all alone, forward and under jax.grad."""
    R = mesh.shape[AXIS]
    T = x.shape[0] // R
    El = cfg["experts"] // R
    K = cfg["topk"]
    M = recv_rows_bound(R, T, K, El)
    transport = transport_fn(emulate)

    def plan_body(x, gate):
        p = dispatch_plan(x, gate, K, cfg["score"], R, El)
        return (p["x_send"], p["counts"][None], p["input_offsets"], p["send_sizes"],
                p["output_offsets"], p["recv_sizes"], p["recv_offsets"],
                lax.all_to_all(p["input_offsets"], AXIS, 0, 0, tiled=True))

    plan = jax.jit(shard_map(plan_body, mesh, (P(AXIS), P()), (P(AXIS),) * 8))(x, gate)
    x_send, counts = plan[0], plan[1]
    offs = plan[2:]
    xs_np = np.asarray(x_send).reshape(R, T * K, -1)
    counts_np = np.asarray(counts)

    # (c) forward: raw ragged_all_to_all into a sentinel-filled buffer, and the round trip
    def fwd_body(xs, in_off, send, out_off, recv, recv_off, back_out_off):
        buf = varying(jnp.full((M, xs.shape[1]), SENTINEL, xs.dtype))
        got = transport(xs, buf, in_off, send, out_off, recv, axis_name=AXIS)
        ex = make_exchange(transport, "jax")
        there = ex(xs, M, in_off, send, out_off, recv)
        back = ex(there, T * K, recv_off, recv, back_out_off, send)
        return got, back

    got, back = jax.jit(shard_map(fwd_body, mesh, (P(AXIS),) * 7, (P(AXIS), P(AXIS))))(
        x_send, *offs)
    got = np.asarray(got).reshape(R, M, -1)
    expected = host_exchange(xs_np, counts_np, R, M, SENTINEL)
    total = counts_np.sum(axis=(0, 2))                       # rows each device receives
    untouched = all(np.all(got[r, total[r]:] == SENTINEL) for r in range(R))
    recv_err = abs_err(got, expected)
    rt_err = abs_err(np.asarray(back), np.asarray(x_send))
    exc = {"recv_err": recv_err, "untouched_rows_kept": bool(untouched), "roundtrip_err": rt_err,
           "ok": bool(recv_err == 0 and untouched and rt_err == 0)}
    if recv_err != 0:
        alt = host_exchange(xs_np, counts_np, R, M, SENTINEL, "receiver-local")
        exc["matches_receiver_local_offsets"] = bool(alt is not None and abs_err(got, alt) == 0)
        exc["real_rows_err"] = max(abs_err(got[r, :total[r]], expected[r, :total[r]])
                                   for r in range(R))

    # the type JAX gives the real transport's result (traced only, so it works on any backend):
    # it must be varying over the devices, or autodiff sums cotangents over them (see varying())
    seen = []

    def type_body(xs, in_off, send, out_off, recv, recv_off, back_out_off):
        y = make_exchange(ragged_all_to_all_native, "jax")(xs, M, in_off, send, out_off, recv)
        aval = jax.typeof(y) if hasattr(jax, "typeof") else None
        vma = getattr(aval, "vma", None)
        if vma is None:
            vma = getattr(getattr(aval, "mat", None), "varying", None)
        seen.append(vma)
        return y

    jax.make_jaxpr(shard_map(type_body, mesh, (P(AXIS),) * 7, P(AXIS)))(x_send, *offs)
    exc["result_varying"] = None if seen[0] is None else AXIS in seen[0]

    # (d) under jax.grad, per exchange-vjp variant
    rng = np.random.default_rng(seed)
    c_recv = rng.standard_normal((R * M, xs_np.shape[2])).astype(np.float32)
    c_send = rng.standard_normal(np.asarray(x_send).shape).astype(np.float32)
    # expected one-way gradient: each sent row gets the cotangent at its destination
    c_recv_r = c_recv.reshape(R, M, -1)
    sizes = counts_np.sum(2)
    in_off_np = np.cumsum(sizes, 1) - sizes
    recv_off_np = np.cumsum(sizes, 0) - sizes
    want = np.zeros_like(xs_np)
    for s in range(R):
        for r in range(R):
            n = sizes[s, r]
            want[s, in_off_np[s, r]:in_off_np[s, r] + n] = c_recv_r[r, recv_off_np[s, r]:
                                                                  recv_off_np[s, r] + n]
    grads = {}
    for vjp in variants:
        ex = make_exchange(transport, vjp)

        def oneway(xs, c, in_off, send, out_off, recv, recv_off, back_out_off):
            return jnp.sum(ex(xs, M, in_off, send, out_off, recv) * c)[None]

        def roundtrip(xs, c, in_off, send, out_off, recv, recv_off, back_out_off):
            there = ex(xs, M, in_off, send, out_off, recv)
            return jnp.sum(ex(there, T * K, recv_off, recv, back_out_off, send) * c)[None]

        def g(body):
            f = shard_map(body, mesh, (P(AXIS),) * 8, P(AXIS))
            return jax.jit(jax.grad(lambda xs, c, *o: jnp.sum(f(xs, c, *o))))

        g1 = np.asarray(g(oneway)(x_send, c_recv, *offs)).reshape(want.shape)
        g2 = np.asarray(g(roundtrip)(x_send, c_send, *offs))
        e1, e2 = abs_err(g1, want), abs_err(g2, c_send)
        grads[vjp] = {"oneway_err": e1, "roundtrip_err": e2, "ok": bool(e1 == 0 and e2 == 0)}
    group_sizes = counts_np.sum(0)                            # [dst, El]: received per expert
    return exc, grads, group_sizes, M


def ragged_dot_test(group_sizes, M, H, N, prec, tol, seed):
    """Part (e): jax.lax.ragged_dot alone against a dense per-group reference, forward and
    gradients, on one device, for each device's received group sizes of the case."""
    rng = np.random.default_rng(seed)
    El = group_sizes.shape[1]
    rhs = (rng.standard_normal((El, H, N)) * H ** -0.5).astype(np.float32)

    def reference(lhs, rhs, gs):
        ends = jnp.cumsum(gs)
        g = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")
        onehot = (g[:, None] == jnp.arange(El)[None, :]).astype(lhs.dtype)   # no group: zero row
        return jnp.einsum("mh,ghn,mg->mn", lhs, rhs, onehot, precision=prec)

    def ragged(lhs, rhs, gs):
        return lax.ragged_dot(lhs, rhs, gs, precision=prec, preferred_element_type=jnp.float32)

    def run(f, lhs, rhs, gs, ct):
        out = jax.jit(f)(lhs, rhs, gs)
        d = jax.jit(jax.grad(lambda l, r, g, c: jnp.sum(f(l, r, g) * c), argnums=(0, 1)))(
            lhs, rhs, gs, ct)
        return out, d

    res = {"fwd": 0.0, "d_lhs": 0.0, "d_rhs": 0.0}
    pad_ignored = True
    for gs in group_sizes:
        gs = jnp.asarray(gs, jnp.int32)
        total = int(gs.sum())
        lhs = rng.standard_normal((M, H)).astype(np.float32)
        ct = rng.standard_normal((M, N)).astype(np.float32)
        lhs0, ct0 = lhs.copy(), ct.copy()
        lhs0[total:] = 0
        ct0[total:] = 0
        out, (dl, dr) = run(ragged, lhs0, rhs, gs, ct0)
        rout, (rdl, rdr) = run(reference, lhs0, rhs, gs, ct0)
        res["fwd"] = max(res["fwd"], rel_err(out, rout))
        res["d_lhs"] = max(res["d_lhs"], rel_err(dl, rdl))
        res["d_rhs"] = max(res["d_rhs"], rel_err(dr, rdr))
        if total < M:
            # not needed by the layer: rows past the groups hold data and get a cotangent
            out, (dl, dr) = run(ragged, lhs, rhs, gs, ct)
            rout, (rdl, rdr) = run(reference, lhs, rhs, gs, ct)
            pad_ignored &= max(rel_err(out, rout), rel_err(dl, rdl), rel_err(dr, rdr)) <= tol
    res["ok"] = bool(max(res.values()) <= tol)
    res["info"] = {"rows_past_groups_ignored": bool(pad_ignored)}
    return res


def check(args, mesh, emulate):
    R = mesh.shape[AXIS]
    prec = lax.Precision.HIGHEST
    # fp32 throughout so that a wrong row or a wrong offset stands out from rounding; on GPU the
    # grouped matmul may still round through TF32, hence the looser bound there.
    tol = 1e-4 if jax.default_backend() == "cpu" else 5e-3
    T, H, F = 64, 128, 64
    tile_rows = 8                       # several tiles per expert, and partial ones
    cases = [
        dict(name="softmax", experts=16, topk=4, shared_ffn=0, score="softmax", skew=False),
        dict(name="sigmoid+shared", experts=16, topk=4, shared_ffn=64, score="sigmoid", skew=False),
        # every token prefers the first rank's experts: that rank's buffer fills to the bound
        dict(name="skewed", experts=max(8, R), topk=4, shared_ffn=0, score="softmax", skew=True),
    ]
    if args.ragged_dot == "auto":
        modes = ["xla", "segment", "capacity"]       # pallas only when named: a global switch
    else:
        modes = [args.ragged_dot]
    variants = [args.exchange_vjp] if args.exchange_vjp else ["custom", "jax"]
    transport = "emulated-all_to_all" if emulate else "ragged_all_to_all"

    lines = {(m, v): {"results": [], "worst": 0.0, "failed": []} for m in modes for v in variants}
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
        ref = jax.jit(lambda x, p: dense_reference(x, p, cfg, prec))
        ref_out = ref(x, params)
        ref_grads = jax.jit(jax.grad(lambda x, p, d: jnp.sum(ref(x, p) * d), argnums=(0, 1)))(
            x, params, d_out)

        xs, ps = put(mesh, x, params)
        ds = jax.device_put(d_out, NamedSharding(mesh, P(AXIS)))
        exc, exc_grads, group_sizes, M = exchange_tests(mesh, cfg, xs, ps["gate"], emulate,
                                                         variants, args.seed + i)
        rd = ragged_dot_test(group_sizes, M, H, F, prec, tol, args.seed + i)
        counts = routing_counts(mesh, cfg, xs, ps["gate"])
        capacity = pick_capacity(counts, R, T, args.capacity_factor)

        for mode in modes:
            for vjp in variants:
                entry = lines[(mode, vjp)]
                kw = dict(emulate=emulate, precision=prec, exchange_vjp=vjp, mode=mode,
                          capacity=capacity, tile_rows=tile_rows)
                layer = make_layer(mesh, cfg, **kw)
                out, dropped = jax.jit(layer)(xs, ps)
                grads, _ = jax.jit(jax.grad(loss_fn(layer), argnums=(0, 1), has_aux=True))(
                    xs, ps, ds)
                errs = {"dx": rel_err(grads[0], ref_grads[0])}
                errs.update({"d" + n: rel_err(grads[1][n], ref_grads[1][n]) for n in params})
                out_err = rel_err(out, ref_out)
                allerr = dict(errs, out=out_err)
                case_max = max(allerr.values())
                res = {"case": case["name"], "max_rel_err": case_max,
                       "worst": max(allerr, key=allerr.get),
                       "out": out_err, "grads": errs, "exchange": exc,
                       "exchange_grad": exc_grads[vjp], "ragged_dot": rd}
                failed = []
                if not (np.isfinite(out_err) and out_err <= tol):
                    failed.append("out")
                failed += ["grad:" + k for k, v in errs.items()
                           if not (np.isfinite(v) and v <= tol)]
                if not exc["ok"]:
                    failed.append("exchange")
                if exc["result_varying"] is False:
                    failed.append("exchange_typing")
                if not exc_grads[vjp]["ok"]:
                    failed.append("exchange_grad")
                if not rd["ok"]:
                    failed.append("ragged_dot")
                if mode == "capacity":
                    res["capacity"] = capacity
                    res["dropped_rows"] = int(np.sum(np.asarray(dropped)))
                    if res["dropped_rows"]:
                        failed.append("dropped_rows")
                    # the drop counter itself: one row under the largest count must be seen
                    small = max(int(counts.max()) - 1, 1)
                    _, d2 = jax.jit(make_layer(mesh, cfg, **dict(kw, capacity=small)))(xs, ps)
                    want = int(np.maximum(counts - small, 0).sum())
                    res["drop_counter_ok"] = int(np.sum(np.asarray(d2))) == want
                    if not res["drop_counter_ok"]:
                        failed.append("drop_counter")
                # The collectives of the gradient, traced with the real transport and with the
                # emulation: an implicit psum that only the real one has means JAX typed its
                # rows as identical on every device (see varying()).
                cols = {}
                for name, emu in (("native", False), ("emulated", True)):
                    g = jax.grad(loss_fn(make_layer(mesh, cfg, **dict(kw, emulate=emu))),
                                 argnums=(0, 1), has_aux=True)
                    cols[name + "_grad_psums"] = str(jax.make_jaxpr(g)(xs, ps, ds)).count("psum")
                cols["ok"] = cols["native_grad_psums"] == cols["emulated_grad_psums"]
                res["collectives"] = cols
                if not cols["ok"]:
                    failed.append("collectives")
                if emulate:
                    # the real transport cannot run here; at least make sure it traces,
                    # differentiates and lowers with the same offsets
                    real = make_layer(mesh, cfg, **dict(kw, emulate=False))
                    jax.jit(jax.grad(loss_fn(real), argnums=(0, 1), has_aux=True)).lower(xs, ps, ds)
                res["failed"] = failed
                entry["results"].append(res)
                entry["worst"] = max(entry["worst"], case_max)
                entry["failed"] += [f"{mode}/{vjp}/{case['name']}/{f}" for f in failed]

    all_failed = []
    for (mode, vjp), entry in lines.items():
        line = {"check": "jax_moe_baseline", "ok": not entry["failed"],
                "max_rel_err": entry["worst"], "tol": tol, "ranks": R,
                "backend": jax.default_backend(), "transport": transport,
                "ragged_dot": "pallas-triton" if mode == "pallas" else mode,
                "exchange_vjp": vjp, "tile_rows": tile_rows, "cases": entry["results"],
                "failed": entry["failed"]}
        if emulate:
            line["ragged_all_to_all_path"] = "lowered, not run"
        print(json.dumps(line), flush=True)
        all_failed += entry["failed"]
    print(json.dumps({"check": "jax_moe_baseline.summary", "ok": not all_failed, "ranks": R,
                      "backend": jax.default_backend(), "transport": transport,
                      "modes": modes, "exchange_vjp": variants, "failed": all_failed}), flush=True)
    if all_failed:
        print("jax_moe_baseline --check FAILED: " + ", ".join(all_failed), file=sys.stderr)
    return not all_failed


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
    counts = routing_counts(mesh, cfg, x, params["gate"])
    capacity = pick_capacity(counts, R, args.tokens, args.capacity_factor)
    mode, est_gb = choose_mode(args, cfg, mesh, args.tokens, capacity)
    label = enable_mode(mode)
    vjp = args.exchange_vjp or "custom"
    layer = make_layer(mesh, cfg, emulate=emulate, exchange_vjp=vjp, mode=mode,
                       capacity=capacity, tile_rows=args.tile_rows)
    fwd = jax.jit(layer)
    fwd_bwd = jax.jit(jax.value_and_grad(loss_fn(layer), argnums=(0, 1), has_aux=True))

    fwd_us = time_calls(fwd, (x, params), args.iters, args.warmup)
    fwd_bwd_us = time_calls(fwd_bwd, (x, params, d_out), args.iters, args.warmup)
    dropped = max(int(np.sum(np.asarray(fwd(x, params)[1]))),
                  int(np.sum(np.asarray(fwd_bwd(x, params, d_out)[0][1]))))

    line = {"bench": "layer", "impl": "jax", "preset": args.preset, "ranks": R,
            "tokens": args.tokens, "hidden": cfg["hidden"], "ffn": cfg["ffn"],
            "experts": cfg["experts"], "topk": cfg["topk"], "shared_ffn": cfg["shared_ffn"],
            "score": cfg["score"], "fwd_us": round(fwd_us, 1), "fwd_bwd_us": round(fwd_bwd_us, 1),
            "iters": args.iters,
            "recv_rows": recv_rows_bound(R, args.tokens, cfg["topk"], cfg["experts"] // R),
            "transport": "emulated-all_to_all" if emulate else "ragged_all_to_all",
            "ragged_dot": label, "device": jax.devices()[0].device_kind,
            "exchange_vjp": vjp, "ragged_dot_requested": args.ragged_dot,
            "mem_estimate_gb": est_gb, "max_rows_per_expert": int(counts.max()),
            "recv_rows_real_max": int(counts.sum(1).max())}
    if mode == "capacity":
        line.update(capacity=capacity, capacity_factor=args.capacity_factor,
                    dropped_rows=dropped, exact=dropped == 0)
    if mode == "segment":
        B, NT = segment_tiles(line["recv_rows"], cfg["experts"] // R, args.tile_rows)
        line.update(tile_rows=B, tiles=NT)
    stats = [d.memory_stats() for d in mesh.devices.flat]
    peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
    if peaks:
        line["gpu_mem_peak_gb"] = round(max(peaks) / 1e9, 2)
    print(json.dumps(line), flush=True)
    if dropped:
        print(f"capacity {capacity} dropped {dropped} rows: the timing is not of the exact layer",
              file=sys.stderr)
        sys.exit(1)


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
    ap.add_argument("--ragged-dot", dest="ragged_dot", choices=("auto",) + MODES, default="auto",
                    help="grouped FFN mode (see the module docstring); --check: auto = all modes")
    ap.add_argument("--exchange-vjp", dest="exchange_vjp", choices=["jax", "custom"],
                    help="gradient of the exchanges (default custom; --check: both unless named)")
    ap.add_argument("--capacity-factor", dest="capacity_factor", type=float, default=1.25,
                    help="mode capacity: C = largest observed per-expert count times this")
    ap.add_argument("--tile-rows", dest="tile_rows", type=int, default=256,
                    help="mode segment: rows per tile")
    ap.add_argument("--check", action="store_true", help="correctness check at a small shape")
    ap.add_argument("--cpu-emulation", dest="cpu_emulation", action="store_true",
                    help="replace ragged_all_to_all by a padded all_to_all (for CPU testing only)")
    args = ap.parse_args()

    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    emulate = args.cpu_emulation or (args.check and jax.default_backend() == "cpu")
    if jax.default_backend() == "cpu" and not emulate:
        sys.exit("XLA:CPU cannot compile ragged_all_to_all: add --cpu-emulation to try it on CPU")
    if args.check:
        if args.ragged_dot == "pallas":
            enable_mode("pallas")
        sys.exit(0 if check(args, mesh, emulate) else 1)
    bench(args, mesh, emulate)


if __name__ == "__main__":
    main()
