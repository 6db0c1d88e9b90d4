"""epx.jax with one process per GPU, as multi-host JAX runs: jax.distributed.initialize, the NCCL id
shared through JAX's distributed client (epx.jax.Group.from_distributed, made once outside any
traced function), and a training step of the MoE layer under jit + shard_map over the global mesh
against the CPU reference layer that holds every expert. Each rank is this file run as a script.
Skips (with the reason) without JAX, without the FFI handlers or with fewer than two GPUs."""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def gpu_count():
    """GPUs visible to a child process, counted without initialising a GPU runtime here."""
    if not shutil.which("nvidia-smi"):
        return 0
    res = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    n = sum(line.startswith("GPU ") for line in res.stdout.splitlines()) if res.returncode == 0 else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return min(n, len([v for v in visible.split(",") if v])) if visible is not None else n


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Module-level skips: the whole file reports "skipped" (pytest exit code 5) where it cannot run.
if __name__ != "__main__":
    pytest.importorskip("jax", reason="JAX is not installed: the epx.jax tests need it")
    import epx
    if not hasattr(epx._C, "jax_ffi"):
        pytest.skip("epx was built without the JAX FFI handlers (no jax in the building Python)",
                    allow_module_level=True)
    if not getattr(epx._C, "gpu_grouped_gemm", False):
        pytest.skip("epx was built without the CUTLASS grouped GEMMs", allow_module_level=True)
    WORLD = gpu_count()
    if WORLD < 2:
        pytest.skip(f"{WORLD} GPU(s) visible: the one-process-per-GPU epx.jax test needs 2", allow_module_level=True)


def test_moe_layer_one_process_per_gpu_matches_cpu_reference():
    world = WORLD
    port = free_port()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONPATH=os.pathsep.join(
        [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    logs = [tempfile.TemporaryFile("w+") for _ in range(world)]
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(world), str(port)], env=env, stdout=logs[r],
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline = time.monotonic() + 180
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):  # a rank failed: the others would wait for it
            time.sleep(10)
            break
        time.sleep(0.5)
    failures, outputs = [], []
    for r, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
            failures.append(f"rank {r} had not finished when the test stopped waiting")
        p.wait()
        logs[r].seek(0)
        outputs.append(logs[r].read())
        if p.returncode != 0:
            failures.append(f"rank {r} exited with {p.returncode}:\n{outputs[r][-4000:]}")
    assert not failures, "\n".join(failures)
    for r, out in enumerate(outputs):
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert lines and lines[-1]["rank"] == r and lines[-1]["world"] == world, out[-2000:]
        print(json.dumps(lines[-1]))


def rank_main(rank, world, port):
    import jax
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=world, process_id=rank, local_device_ids=[rank])
    import epx.jax as epj
    from jax_layer_check import EXPERTS, HIDDEN, SPEC, TOKENS, check_layer_step_against_reference
    spec = epj.LayerSpec.from_preset("small", **SPEC)
    g = epj.Group.from_distributed(num_experts=EXPERTS, hidden=HIDDEN, max_tokens_per_rank=TOKENS,
                                   max_topk=spec.topk, align=16)
    assert g.size == world and jax.process_count() == world
    errors = check_layer_step_against_reference(g, jax.make_mesh((world,), ("ep",)), spec)
    print(json.dumps({"rank": rank, "world": world, "transport": g.transport, "rel_err": errors}), flush=True)
    g.close()
    jax.distributed.shutdown()


if __name__ == "__main__":
    try:
        rank_main(*(int(a) for a in sys.argv[1:4]))
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # at once: a normal exit would wait in JAX's distributed shutdown for the other ranks
