"""One check shared by the epx.jax GPU tests, in one process over its local GPUs and one process per
GPU: a training step of the MoE layer (forward, the aux and z losses, gradients of x and every
parameter) under jit + shard_map over a mesh axis "ep", against the CPU reference layer that holds
every expert and sees every rank's tokens."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

import epx.jax as epj
from compare import rel_err

EXPERTS, HIDDEN, TOKENS = 16, 128, 128
SPEC = dict(hidden=HIDDEN, ffn_hidden=64, shared_ffn_hidden=64, num_experts=EXPERTS)


def global_array(value, mesh, spec):
    """The same host value on every process, placed as one array over the whole mesh."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda i: value[i])


def check_layer_step_against_reference(group, mesh, spec, slot=1):
    # This process's own CPU device: with one process per GPU, jax.devices("cpu")[0] is process 0's.
    R, T, cpu = mesh.devices.size, TOKENS, jax.local_devices(backend="cpu")[0]
    with jax.default_device(cpu):  # host values, the same in every process
        full = {k: np.asarray(v) for k, v in epj.init_params(jax.random.key(5), spec, EXPERTS, jnp.bfloat16,
                                                             std=0.1).items()}
        x = np.asarray(jax.random.normal(jax.random.key(6), (R * T, HIDDEN), jnp.float32).astype(jnp.bfloat16))
        d = np.asarray((0.1 * jax.random.normal(jax.random.key(7), (R * T, HIDDEN))).astype(jnp.bfloat16))
    experts = {"w_in": P("ep"), "w_out": P("ep")}
    pspec = {k: experts.get(k, P()) for k in full}

    def step(params, x, d):
        def f(params, x):
            out, l = epj.moe_layer(params, x, group=group, spec=spec, slot=slot)
            return jnp.sum(out.astype(jnp.float32) * d.astype(jnp.float32)) + l["aux"] + l["z"], (out, l["aux"])

        (_, (out, aux)), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, x)
        # replicated parameters' gradients hold this rank's tokens: sum them over the group
        gp = {k: (gr if k in experts else jax.lax.psum(gr, "ep")) for k, gr in grads[0].items()}
        return out, aux, gp, grads[1]

    sharded = jax.jit(epj.shard_map(step, mesh, (pspec, P("ep"), P("ep")), (P("ep"), P(), pspec, P("ep"))))
    args = ({k: global_array(v, mesh, pspec[k]) for k, v in full.items()}, global_array(x, mesh, P("ep")),
            global_array(d, mesh, P("ep")))
    out, aux, gp, gx = multihost_utils.process_allgather(sharded(*args), tiled=True)
    group.check()

    ref_g = epj.Group.local([cpu], num_experts=EXPERTS, hidden=HIDDEN, max_tokens_per_rank=R * T,
                            max_topk=spec.topk, dtype=jnp.float32, align=16)
    on_cpu = lambda a: jax.device_put(jnp.asarray(np.asarray(a, np.float32)), cpu)  # noqa: E731
    f32 = {k: on_cpu(v) for k, v in full.items()}

    def ref_f(params, x):
        o, l = epj.moe_layer(params, x, group=ref_g, spec=spec, slot=slot)
        return jnp.sum(o * on_cpu(d)) + l["aux"] + l["z"], (o, l["aux"])

    with jax.default_device(cpu):
        (_, (out_r, aux_r)), (gp_r, gx_r) = jax.value_and_grad(ref_f, argnums=(0, 1), has_aux=True)(f32, on_cpu(x))
    ref_g.close()
    errors = {"out": rel_err(out, out_r), "d_x": rel_err(gx, gx_r)}
    errors.update({f"d_{k}": rel_err(gp[k], gp_r[k]) for k in gp_r if k != "expert_bias"})
    assert errors["out"] < 5e-2, errors
    assert all(e < 8e-2 for e in errors.values()), errors
    assert abs(float(aux) - float(aux_r)) <= 2e-2 * abs(float(aux_r)) + 1e-7, (float(aux), float(aux_r))
    return errors
