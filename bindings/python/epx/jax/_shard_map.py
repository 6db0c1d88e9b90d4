"""shard_map for functions that call the epx ops, on the JAX versions epx supports."""
import jax


def shard_map(f, mesh, in_specs, out_specs):
    """jax.shard_map (jax.experimental.shard_map on older JAX) with JAX's replication checking off:
    the epx FFI calls carry no per-device typing, so the check cannot follow them."""
    sm = getattr(jax, "shard_map", None)
    if sm is None:
        from jax.experimental.shard_map import shard_map as sm
    if "check_vma" in sm.__code__.co_varnames:
        return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
