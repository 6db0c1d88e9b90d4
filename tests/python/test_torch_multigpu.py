"""epx.torch over several GPUs, one process per GPU (torch.multiprocessing), the group borrowed from a
torch ProcessGroup (NCCL) or bootstrapped from the launcher's environment: the MoE block against
the CPU reference layer that holds every expert, and the ops' dispatch/combine round trip.
Skips (with the reason) without torch or with fewer than two GPUs."""
import os
import socket
import traceback

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the epx.torch tests need it")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import epx  # noqa: E402
import epx.torch as ept  # noqa: E402
from compare import rel_err  # noqa: E402

WORLD = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(WORLD < 2, reason=f"{WORLD} CUDA GPU(s) visible: the multi-GPU epx.torch tests need 2")

T, H, E, K = 128, 128, 16, 8
LAYER = dict(hidden=H, ffn_hidden=64, shared_ffn_hidden=64, num_experts=E, seed=11, init_std=0.1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokens(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(T, H, generator=g).to(torch.bfloat16),
            (torch.randn(T, H, generator=g) * 0.1).to(torch.bfloat16))


def run(world, fn, *args):
    port = free_port()
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    for r, p in enumerate(procs):
        if p.exitcode is None:
            p.kill()
            failures.append(f"rank {r} did not finish in 300 s")
    assert not failures, "\n".join(failures)


def _worker(rank, world, port, fn, args, errors):
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        try:
            fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except Exception:  # reported by the parent with the rank's traceback
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")


def _moe_matches_reference(rank, world, transport, bootstrap):
    config = dict(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K, align=16, transport=transport)
    group = ept.Group.from_process_group(**config) if bootstrap == "process_group" else ept.Group.from_env(**config)
    assert (group.rank, group.size) == (rank, world)
    assert group.transport == {"auto": "zero-copy", "staged": "staged"}[transport], group.transport
    moe = ept.MoE(group, "small", **LAYER)
    x, d = tokens(rank)
    xg = x.cuda().requires_grad_()
    out, losses = moe(xg, return_losses=True)
    out.backward(d.cuda())
    group.check()

    # The reference: one CPU rank holding every expert, over every rank's tokens.
    ref_group = ept.Group.local("cpu", num_experts=E, hidden=H, max_tokens_per_rank=T * world, max_topk=K, align=16)
    ref = ept.MoE(ref_group, "small", **LAYER)
    xs, ds = zip(*(tokens(r) for r in range(world)))
    xr = torch.cat(xs).requires_grad_()
    out_r, losses_r = ref(xr, return_losses=True)
    out_r.backward(torch.cat(ds))
    mine = slice(rank * T, (rank + 1) * T)
    assert rel_err(out, out_r[mine]) < 5e-2
    assert rel_err(xg.grad, xr.grad[mine]) < 8e-2
    torch.testing.assert_close(losses.cpu().double(), losses_r.double(), rtol=2e-2, atol=1e-6)
    le = E // world
    experts = slice(rank * le, (rank + 1) * le)
    params = dict(moe.named_parameters())
    for name, p in ref.named_parameters():
        g = params[name].grad.float()
        if name in ("w_in", "w_out"):
            want = p.grad[experts]  # this rank's experts saw every rank's tokens
        else:
            dist.all_reduce(g)  # replicated: each rank holds its own tokens' share
            want = p.grad
        assert rel_err(g, want) < 8e-2, (rank, name)


@pytest.mark.parametrize("transport", ["auto", "staged"])
def test_moe_two_or_more_gpus_from_process_group(transport):
    if not epx._C.gpu_grouped_gemm:
        pytest.skip("built without the CUTLASS grouped GEMMs")
    run(WORLD, _moe_matches_reference, transport, "process_group")


def test_moe_from_launcher_environment():
    if not epx._C.gpu_grouped_gemm:
        pytest.skip("built without the CUTLASS grouped GEMMs")
    run(WORLD, _moe_matches_reference, "auto", "env")


def _dispatch_combine_round_trip(rank, world):
    group = ept.Group.from_process_group(num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K, align=16)
    g = torch.Generator(device="cuda").manual_seed(7 + rank)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    logits = torch.randn(T, E, device="cuda", generator=g).requires_grad_()
    idx, w = ept.Router(E, K, normalize_weights=True)(logits)
    idx = idx.clone()
    idx[::5, -1] = -1  # masked slots
    routing = ept.prepare(group, idx, w, slot=3)
    recv_x, recv_w = ept.dispatch(routing, x, w)
    out = ept.combine(routing, recv_x, recv_w)  # identity experts: out = x * (sum of kept weights)
    kept = torch.where(idx >= 0, w, torch.zeros_like(w)).sum(-1, keepdim=True)
    torch.testing.assert_close(out.float(), (x.float() * kept).detach(), rtol=1e-2, atol=1e-2)
    d = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    out.backward(d)
    torch.testing.assert_close(x.grad.float(), d.float() * kept, rtol=2e-2, atol=2e-2)
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    # Every kept (token, expert) pair lands as exactly one row on the expert's rank.
    received = routing.rows.sum().reshape(1).long()
    sent = (idx >= 0).sum().reshape(1).long()
    dist.all_reduce(received)
    dist.all_reduce(sent)
    assert received.item() == sent.item(), (received.item(), sent.item())
    group.check()


def test_dispatch_combine_ops_round_trip():
    run(WORLD, _dispatch_combine_round_trip)
