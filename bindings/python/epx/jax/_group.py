"""epx.jax.Group: one expert-parallel group for JAX, made once per process outside any traced
function: over every local GPU of this process (one group view per device, as shard_map runs one
program per device), over one GPU per process with the NCCL id shared through JAX's distributed
client, or as the CPU reference."""
import itertools

import jax
import numpy as np

from .. import _C, _config
from ._ops import _ffi

_ids = itertools.count(1)

_DTYPES = {np.dtype("float32"): "fp32", np.dtype("float64"): "fp64", np.dtype("float16"): "fp16"}


def _dtype_name(dtype):
    if dtype is None:
        return "bf16"
    import jax.numpy as jnp
    d = jnp.dtype(dtype)
    if d == jnp.bfloat16:
        return "bf16"
    return _DTYPES[np.dtype(d)]


class Group:
    """Keyword arguments of every maker: num_experts, hidden, max_tokens_per_rank (required),
    max_topk, dtype (widest payload, a JAX dtype), align, recv_capacity_rows, num_sms (0: EP takes the
    whole GPU while it runs; N > 0: EP kernels occupy at most N SMs), timeout_s, transport ("auto",
    "zerocopy", "staged"), staged_exact_sizes. Collective: every rank makes it at the same time."""

    def __init__(self, views, size, keepalive=None):
        self.id = next(_ids)
        self._views = views  # {device ordinal (-1 = host): epx._C.Group}
        self._keepalive = keepalive
        for ordinal, g in views.items():
            _ffi.register_group(self.id, ordinal, g)
        v = next(iter(views.values()))
        self.size = size
        self.local_experts = v.local_experts
        self.recv_capacity_rows = v.recv_capacity_rows
        self.num_experts = v.config.num_experts
        self.registered_bytes = v.registered_bytes
        self.transport = _C.transport_name(v.transport)

    @staticmethod
    def _config(dtype=None, **config):
        return _config.group_config(dtype=_dtype_name(dtype), who="epx.jax.Group", **config)

    @classmethod
    def local(cls, devices=None, **config):
        """Every local device of this process (default: jax.local_devices()), one group view per
        device; with a CPU device, the CPU reference (one simulated rank)."""
        cfg = cls._config(**config)
        devices = list(devices) if devices is not None else jax.local_devices()
        if devices[0].platform == "cpu":
            if len(devices) != 1:
                raise ValueError(f"epx.jax.Group.local: {len(devices)} CPU devices given, the CPU reference runs one")
            return cls({-1: _C.Group.create_simulated(1, cfg)[0]}, 1)
        ordinals = [d.local_hardware_id for d in devices]
        if len(ordinals) == 1:
            return cls({ordinals[0]: _C.Group.create_local(cfg, ordinals[0])}, 1)
        views = _C.Group.create_all_local(cfg, ordinals)
        return cls(dict(zip(ordinals, views)), len(views))

    @classmethod
    def from_distributed(cls, timeout_s=300, **config):
        """One process per GPU after jax.distributed.initialize(): process 0 makes the NCCL id and
        shares it through JAX's distributed key-value store."""
        from jax._src import distributed
        client = distributed.global_state.client
        if client is None:
            raise ValueError("epx.jax.Group.from_distributed: call jax.distributed.initialize() first")
        cfg = cls._config(**config)
        rank, world = jax.process_index(), jax.process_count()
        key = f"epx/nccl_id/{next(_dist_groups)}"
        if rank == 0:
            client.key_value_set(key, _C.nccl_unique_id())
        nccl_id = client.blocking_key_value_get(key, int(timeout_s * 1000))
        device = jax.local_devices()[0].local_hardware_id
        return cls({device: _C.Group.create_from_id(nccl_id, rank, world, device, cfg)}, world)

    def check(self):
        """Synchronises and raises the first device-side error of any view (a bad expert id, a
        recv-capacity overflow, a peer that never arrived)."""
        for g in self._views.values():
            g.check()

    def close(self):
        _ffi.unregister_group(self.id)
        self._views = {}

    def __repr__(self):
        return (f"epx.jax.Group(size={self.size}, devices={sorted(self._views)}, transport={self.transport}, "
                f"local_experts={self.local_experts})")


_dist_groups = itertools.count()
