"""epx.torch.Group: one expert-parallel group, made from a torch ProcessGroup (borrowing its NCCL
communicator), from torchrun's environment, for one GPU, or as the CPU reference."""
import itertools
import os
import threading

import torch

from .. import _C, _config
from ._tensors import epx_dtype

_registry = {}  # id -> Group: the custom ops name their group by id (ops take no Python objects)
_ids = itertools.count(1)
_lock = threading.Lock()
_env_groups = 0

def group_by_id(group_id):
    try:
        return _registry[group_id]
    except KeyError:
        raise ValueError(f"epx.torch: no live Group with id {group_id} (it was closed or never made)") from None


def group_config(num_experts, hidden, max_tokens_per_rank, *, dtype=torch.bfloat16, **options):
    """An epx GroupConfig from keyword arguments (dtype: the widest payload dispatch will carry)."""
    return _config.group_config(num_experts, hidden, max_tokens_per_rank, dtype=epx_dtype(dtype),
                                who="epx.torch.Group", **options)


class Group:
    """One rank's view of an EP group of `size` ranks, each holding num_experts / size experts.

    Make it with one of the class methods; every rank makes it at the same time (collective).
    Keyword arguments of every maker: num_experts, hidden, max_tokens_per_rank (required), max_topk,
    dtype (widest payload), align (expert segment padding), recv_capacity_rows (0 = worst case),
    num_sms (0: EP takes the whole GPU while it runs; N > 0: EP kernels occupy at most N SMs, for
    running beside other work), timeout_s, transport ("auto", "zerocopy", "staged"), staged_exact_sizes.
    """

    def __init__(self, cgroup, keepalive=None):
        self._g = cgroup
        self._keepalive = keepalive  # e.g. the ProcessGroup whose communicator this group borrows
        self._handles = {}
        with _lock:
            self.id = next(_ids)
            _registry[self.id] = self

    # ---- makers --------------------------------------------------------------------------------
    @classmethod
    def from_process_group(cls, pg=None, **config):
        """Borrows the NCCL communicator of a torch.distributed ProcessGroup (default: WORLD), so no
        second bootstrap happens; the ProcessGroup must outlive this group. Initialise the process
        group with device_id= (eager NCCL init) or run one collective on it first; otherwise this
        runs a one-element all_reduce to create the communicator."""
        import torch.distributed as dist
        if pg is None:
            pg = dist.group.WORLD
        if pg is None:
            raise ValueError("epx.torch.Group.from_process_group: torch.distributed is not initialised "
                             "(call torch.distributed.init_process_group(backend='nccl') first)")
        device = torch.device("cuda", torch.cuda.current_device())
        try:
            backend = pg._get_backend(device)
        except RuntimeError as e:
            raise ValueError(f"epx.torch.Group.from_process_group: the process group has no NCCL backend for "
                             f"{device} ({e})") from None
        if not hasattr(backend, "_comm_ptr"):
            raise ValueError(f"epx.torch.Group.from_process_group: backend {type(backend).__name__} is not "
                             "ProcessGroupNCCL, expected a process group with the 'nccl' backend")
        comm = backend._comm_ptr()
        if not comm:
            dist.all_reduce(torch.zeros(1, device=device), group=pg)
            torch.cuda.synchronize(device)
            comm = backend._comm_ptr()
        if not comm:
            raise RuntimeError("epx.torch.Group.from_process_group: the process group's NCCL communicator "
                               "could not be created")
        return cls(_C.Group.from_nccl(comm, group_config(**config)), keepalive=pg)

    @classmethod
    def from_env(cls, **config):
        """One process per GPU under torchrun (or any launcher setting RANK, WORLD_SIZE, LOCAL_RANK):
        rank 0 makes an NCCL id and shares it through torchrun's key-value store (MASTER_ADDR,
        MASTER_PORT), or through EPX_NCCL_ID / EPX_NCCL_ID_FILE when those are set."""
        cfg = group_config(**config)
        if "EPX_NCCL_ID" in os.environ or "EPX_NCCL_ID_FILE" in os.environ:
            return cls(_C.Group.create_from_env(cfg))
        who = "epx.torch.Group.from_env"
        try:
            rank, world = _config.launcher_int("RANK", who), _config.launcher_int("WORLD_SIZE", who)
            local = _config.launcher_int("LOCAL_RANK", who, default=0)
            host, port = os.environ["MASTER_ADDR"], _config.launcher_int("MASTER_PORT", who)
        except KeyError as e:
            raise ValueError(f"epx.torch.Group.from_env: {e.args[0]} is not set, expected a torchrun-style "
                             "environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or "
                             "EPX_NCCL_ID / EPX_NCCL_ID_FILE") from None
        import datetime
        import torch.distributed as dist
        timeout = datetime.timedelta(seconds=cfg.timeout_s if cfg.timeout_s > 0 else 300)
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
        # The k-th group made this way in every process (ranks make them in the same order).
        global _env_groups
        key = f"epx/nccl_id/{_env_groups}"
        _env_groups += 1
        if rank == 0:
            store.set(key, _C.nccl_unique_id())
        store.wait([key])
        nccl_id = store.get(key).decode()
        return cls(_C.Group.create_from_id(nccl_id, rank, world, local, cfg), keepalive=store)

    @classmethod
    def local(cls, device=None, **config):
        """A group of one rank on one GPU (every expert local), or the CPU reference with
        device="cpu"."""
        cfg = group_config(**config)
        if device is not None and torch.device(device).type == "cpu":
            return cls(_C.Group.create_simulated(1, cfg)[0])
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        return cls(_C.Group.create_local(cfg, dev.index if dev.index is not None else torch.cuda.current_device()))

    # ---- what it is ----------------------------------------------------------------------------
    rank = property(lambda self: self._g.rank)
    size = property(lambda self: self._g.size)
    local_experts = property(lambda self: self._g.local_experts)
    first_local_expert = property(lambda self: self._g.first_local_expert)
    recv_capacity_rows = property(lambda self: self._g.recv_capacity_rows)
    registered_bytes = property(lambda self: self._g.registered_bytes)
    config = property(lambda self: self._g.config)

    @property
    def device(self):
        d = self._g.device
        return torch.device("cpu") if d < 0 else torch.device("cuda", d)

    @property
    def transport(self):
        return _C.transport_name(self._g.transport)

    def check(self):
        """Synchronises and raises the first device-side error since the last check (a bad expert
        id, a recv-capacity overflow, a peer that never arrived)."""
        self._g.check()

    def handle(self, slot):
        """The routing handle of one (layer, microbatch) slot, made on first use."""
        h = self._handles.get(slot)
        if h is None:
            h = self._handles[slot] = _C.Handle()
        return h

    def close(self):
        """Releases the group's buffers now (collective: every rank closes together)."""
        _registry.pop(self.id, None)
        self._handles.clear()
        self._g = None

    def __repr__(self):
        if self._g is None:
            return "epx.torch.Group(closed)"
        return (f"epx.torch.Group(rank={self.rank}, size={self.size}, device={self.device}, "
                f"transport={self.transport}, local_experts={self.local_experts})")
