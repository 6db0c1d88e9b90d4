"""epx.jax: the FFI ops under jit against plain-JAX formulas and jax.test_util.check_grads on the CPU
reference (fp64), and on GPUs the layer inside jit + shard_map over every local GPU against the
CPU reference layer. Skips (with the reason) where JAX, the FFI handlers or GPUs are missing."""
import os

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # epx allocates its group buffers itself
jax = pytest.importorskip("jax", reason="JAX is not installed: the epx.jax tests need it")
import numpy as np  # noqa: E402  (JAX brings it; without JAX the module is skipped above)
import epx  # noqa: E402

if not hasattr(epx._C, "jax_ffi"):
    pytest.skip("epx was built without the JAX FFI handlers (no jax in the building Python)", allow_module_level=True)

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import epx.jax as epj  # noqa: E402
from compare import rel_err  # noqa: E402

CPU = jax.devices("cpu")[0]
try:
    GPUS = jax.devices("gpu")
except RuntimeError:
    GPUS = []
needs_gpu = pytest.mark.skipif(not GPUS, reason="no GPU visible to JAX: GPU tests of epx.jax skipped")


@pytest.fixture(autouse=True)
def cpu_by_default(request):
    """The CPU tests keep every array and eager op on the CPU (the reference backend), whatever the
    default device; the GPU tests place their own."""
    if request.node.name.startswith("test_gpu"):
        yield
    else:
        with jax.default_device(CPU):
            yield


def cpu_group(E, H, T, K, dtype=jnp.float64):
    return epj.Group.local([CPU], num_experts=E, hidden=H, max_tokens_per_rank=T, max_topk=K, dtype=dtype, align=4)


def on_cpu(*arrays):
    return [jax.device_put(a, CPU) for a in arrays]


def dense_moe(x, idx, w, w_in, w_out):
    """sum_k w[t,k] * SwiGLU FFN of expert idx[t,k] (masked slots skipped), in fp64."""
    x, w_in, w_out = (np.asarray(a, np.float64) for a in (x, w_in, w_out))
    idx, w = np.asarray(idx), np.asarray(w, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = idx[t, k]
            if e < 0:
                continue
            a = (x[t] @ w_in[e].reshape(x.shape[1], -1)).reshape(2, -1)
            h = a[0] / (1 + np.exp(-a[0])) * a[1]
            out[t] += w[t, k] * (h @ w_out[e])
    return out


def test_router_matches_softmax_topk_under_jit():
    T, E, K = 32, 16, 4
    logits = jax.device_put(jax.random.normal(jax.random.key(0), (T, E), jnp.float32), CPU)
    logits = logits.at[3].set(jnp.nan)  # an all-NaN row is fully masked
    r = epj.Router(E, K, normalize_weights=True)
    idx, w = jax.jit(r)(logits)
    p = np.asarray(jax.nn.softmax(logits.astype(jnp.float64), -1))
    ref_i = np.argsort(-p, -1, kind="stable")[:, :K]
    ref_w = np.take_along_axis(p, ref_i, -1)
    ref_w /= ref_w.sum(-1, keepdims=True)
    ok = np.arange(T) != 3
    np.testing.assert_array_equal(np.asarray(idx)[ok], ref_i[ok])
    np.testing.assert_allclose(np.asarray(w)[ok], ref_w[ok], rtol=1e-5, atol=1e-6)
    assert (np.asarray(idx)[3] == -1).all() and (np.asarray(w)[3] == 0).all()


def chain(group, x, logits, w_in, w_out, router, slot=0):
    idx, w = router(logits)
    r = epj.prepare(group, slot, idx, w)
    recv_x, recv_w = epj.dispatch(r, x, w)
    y = epj.grouped_mlp(recv_x, r.layout, r.rows, w_in, w_out)
    return epj.combine(r, y, recv_w), idx, w


def chain_inputs(seed, E=4, H=8, F=4, K=2, T=6):
    """A CPU group and fp64 x [T, H], logits [T, E], w_in, w_out and a cotangent [T, H] on the CPU."""
    k = jax.random.split(jax.random.key(seed), 5)
    x, logits = jax.random.normal(k[0], (T, H), jnp.float64), jax.random.normal(k[1], (T, E), jnp.float64)
    w_in = 0.5 * jax.random.normal(k[2], (E, H, 2, F), jnp.float64)
    w_out = 0.5 * jax.random.normal(k[3], (E, F, H), jnp.float64)
    cot = jax.random.normal(k[4], (T, H), jnp.float64)
    return (cpu_group(E, H, T, K), *on_cpu(x, logits, w_in, w_out, cot))


def test_ops_chain_matches_dense_formula_and_check_grads_fp64():
    E, K = 4, 2
    g, x, logits, w_in, w_out, _ = chain_inputs(1, E=E, K=K)
    r = epj.Router(E, K)
    out, idx, w = jax.jit(lambda *a: chain(g, *a, r))(x, logits, w_in, w_out)
    np.testing.assert_allclose(np.asarray(out), dense_moe(x, idx, w, w_in, w_out), rtol=1e-10, atol=1e-10)
    check_grads(lambda *a: chain(g, *a, r)[0], (x, logits, w_in, w_out), order=1, modes=["rev"])


def block_chain(group, x, logits, w_in, w_out, router, slot=0):
    idx, w = router(logits)
    r = epj.prepare(group, slot, idx, w)
    recv_x, recv_w = epj.dispatch(r, x, w)
    return epj.expert_block(r, recv_x, recv_w, w_in, w_out), idx, w


def test_expert_block_is_grouped_mlp_then_combine_with_the_weights_gradient_in_the_ffn_fp64():
    """expert_block's forward is combine(grouped_mlp(...)); its backward takes the routing weights'
    gradient through FC2: the same gradients as the two ops composed (fp64: to rounding), and
    check_grads against finite differences through router, dispatch and the block."""
    E, K = 4, 2
    g, x, logits, w_in, w_out, cot = chain_inputs(11, E=E, K=K)
    r = epj.Router(E, K)
    out, idx, w = jax.jit(lambda *a: block_chain(g, *a, r))(x, logits, w_in, w_out)
    np.testing.assert_allclose(np.asarray(out), dense_moe(x, idx, w, w_in, w_out), rtol=1e-10, atol=1e-10)

    def grads(route):
        return jax.jit(jax.grad(lambda *a: jnp.sum(route(g, *a, r)[0] * cot), argnums=(0, 1, 2, 3)))(
            x, logits, w_in, w_out)

    fused, composed = grads(block_chain), grads(chain)
    for name, a, b in zip(("x", "logits", "w_in", "w_out"), fused, composed):
        assert np.any(np.asarray(b) != 0), name
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12, err_msg=name)
    check_grads(lambda *a: block_chain(g, *a, r)[0], (x, logits, w_in, w_out), order=1, modes=["rev"])
    with pytest.raises(ValueError, match="row_weights is None"):
        rr = epj.prepare(g, 1, idx, w)
        epj.expert_block(rr, epj.dispatch(rr, x, w)[0], None, w_in, w_out)


def test_moe_layer_weight_grads_in_ffn_or_in_combine_give_the_same_gradients_fp64():
    """The layer's default (the routing weights' gradient through FC2) against combine's backward."""
    g = None
    grads = {}
    for in_ffn in (True, False):
        spec = epj.LayerSpec.from_preset("tiny", aux_loss_coeff=0.3, z_loss_coeff=0.2, weight_grads_in_ffn=in_ffn)
        g = g or cpu_group(spec.num_experts, spec.hidden, 16, spec.topk)
        params = jax.device_put(epj.init_params(jax.random.key(3), spec, g.local_experts, jnp.float64, std=0.5), CPU)
        x = jax.device_put(jax.random.normal(jax.random.key(4), (16, spec.hidden), jnp.float64), CPU)

        def loss(params, x):
            out, l = epj.moe_layer(params, x, group=g, spec=spec, slot=9)
            return jnp.sum(out ** 2) + l["aux"] + l["z"]

        grads[in_ffn] = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    flat_ffn, flat_combine = (jax.tree_util.tree_leaves_with_path(grads[v]) for v in (True, False))
    for (path, a), (_, b) in zip(flat_ffn, flat_combine):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-10, atol=1e-12, err_msg=str(path))


def test_grouped_mlp_early_weights_and_biases_check_grads_fp64():
    G, H, F, rows = 3, 6, 4, 10
    layout = jnp.array([0, 4, 4, 8], jnp.int32)  # expert 1 empty; padding rows 3 and 7
    nrows = jnp.array([3, 0, 3], jnp.int32)
    k = jax.random.split(jax.random.key(2), 6)
    args = on_cpu(jax.random.normal(k[0], (rows, H)), jax.random.uniform(k[1], (rows,)),
                  jax.random.normal(k[2], (G, H, 2, F)), jax.random.normal(k[3], (G, 2, F)),
                  jax.random.normal(k[4], (G, F, H)), jax.random.normal(k[5], (G, H)))
    layout, nrows = on_cpu(layout, nrows)

    def f(x, rw, w_in, b_in, w_out, b_out):
        return epj.grouped_mlp(x, layout, nrows, w_in, w_out, b_in=b_in, b_out=b_out, row_weights=rw)[:8]

    check_grads(f, tuple(a.astype(jnp.float64) for a in args), order=1, modes=["rev"])


def test_moe_layer_on_the_cpu_reference_under_jit():
    spec = epj.LayerSpec.from_preset("tiny", aux_loss_coeff=0.3, z_loss_coeff=0.2)
    g = cpu_group(spec.num_experts, spec.hidden, 16, spec.topk)
    params = jax.device_put(epj.init_params(jax.random.key(3), spec, g.local_experts, jnp.float64, std=0.5), CPU)
    x = jax.device_put(jax.random.normal(jax.random.key(4), (16, spec.hidden), jnp.float64), CPU)

    def loss(params, x):
        out, l = epj.moe_layer(params, x, group=g, spec=spec, slot=7)
        return jnp.sum(out ** 2) + l["aux"] + l["z"], l

    (value, l), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    assert np.isfinite(float(value)) and float(l["aux"]) > 0 and float(l["z"]) > 0
    assert float(jnp.sum(l["counts"])) == 16 * spec.topk
    for name, gp in grads[0].items():
        if name == "expert_bias":
            assert not np.any(np.asarray(gp)), "the selection bias must get no gradient"
        else:
            assert np.any(np.asarray(gp) != 0), name
    check_grads(lambda x: loss(params, x)[0], (x,), order=1, modes=["rev"])


def test_flax_moe_block_is_the_functional_layer():
    if epj.MoEBlock is None:
        pytest.skip("Flax is not installed: epx.jax.MoEBlock is not defined")
    spec = epj.LayerSpec.from_preset("tiny", aux_loss_coeff=0.3, z_loss_coeff=0.2)
    g = cpu_group(spec.num_experts, spec.hidden, 16, spec.topk)
    block = epj.MoEBlock(group=g, spec=spec, dtype=jnp.float64)
    x = jax.random.normal(jax.random.key(8), (16, spec.hidden), jnp.float64)
    variables = block.init(jax.random.key(9), x)
    assert set(variables["params"]) == {"gate", "w_in", "w_out", "shared_w_in", "shared_w_out"}
    assert variables["params"]["w_in"].shape == (g.local_experts, spec.hidden, 2, spec.ffn_hidden)
    out, state = block.apply(variables, x, mutable=["losses", "moe_stats"])
    params = dict(variables["params"], expert_bias=variables["moe_state"]["expert_bias"])
    ref, l = epj.moe_layer(params, x, group=g, spec=spec, slot=123)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert float(state["losses"]["aux"][0]) == float(l["aux"])
    bias = epj.update_expert_bias(variables["moe_state"]["expert_bias"], state["moe_stats"]["counts"][0])
    assert np.any(np.asarray(bias) != 0), "unbalanced counts must move the bias"

    def loss(p):
        o, st = block.apply(dict(variables, params=p), x, mutable=["losses", "moe_stats"])
        return jnp.sum(o ** 2) + st["losses"]["aux"][0] + st["losses"]["z"][0]

    grads = jax.grad(loss)(variables["params"])
    assert all(np.all(np.isfinite(np.asarray(v))) and np.any(np.asarray(v) != 0) for v in grads.values())


def test_example_training_step_lowers_the_loss_on_the_cpu_reference():
    """examples/jax_train_step.py: the Flax MoEBlock under jit + shard_map, SGD and the expert-bias
    update, on the CPU reference."""
    if epj.MoEBlock is None:
        pytest.skip("Flax is not installed: the example uses epx.jax.MoEBlock")
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "jax_train_step.py")
    spec = importlib.util.spec_from_file_location("jax_train_step", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(["--cpu", "--preset", "small", "--tokens", "32", "--steps", "4"])
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


@pytest.mark.parametrize("precision", ["fp8_block", "mxfp8"])
def test_fp8_forward_on_the_cpu_reference(precision):
    """precision "fp8_block" / "mxfp8": the forward's GEMMs see quantized operands (close to, not
    equal to, the high-precision layer); the gradients are the high-precision backward's."""
    hi = epj.LayerSpec.from_preset("tiny")
    lo = epj.LayerSpec.from_preset("tiny", precision=precision)
    g = cpu_group(hi.num_experts, hi.hidden, 16, hi.topk, dtype=jnp.float32)
    params = jax.device_put(epj.init_params(jax.random.key(3), hi, g.local_experts, jnp.float32, std=0.5), CPU)
    x = jax.device_put(jax.random.normal(jax.random.key(4), (16, hi.hidden), jnp.float32), CPU)

    def loss(spec, slot):
        return jax.jit(jax.value_and_grad(
            lambda p, x: jnp.sum(epj.moe_layer(p, x, group=g, spec=spec, slot=slot)[0] ** 2), argnums=1))(params, x)

    (v_hi, d_hi), (v_lo, d_lo) = loss(hi, 31), loss(lo, 32)
    assert 1e-4 < abs(float(v_lo) - float(v_hi)) / abs(float(v_hi)) < 0.1
    assert 1e-4 < rel_err(d_lo, d_hi) < 0.2
    with pytest.raises(ValueError, match="precision is 'fp4'"):
        epj.LayerSpec.from_preset("tiny", precision="fp4")


def test_a_slot_prepared_twice_in_one_traced_function_is_an_error():
    spec = epj.LayerSpec.from_preset("tiny")
    g = cpu_group(spec.num_experts, spec.hidden, 16, spec.topk)
    params = jax.device_put(epj.init_params(jax.random.key(3), spec, g.local_experts, jnp.float64), CPU)
    x = jax.device_put(jax.random.normal(jax.random.key(4), (16, spec.hidden), jnp.float64), CPU)

    def two_layers(params, x, slots):
        h = epj.moe_layer(params, x, group=g, spec=spec, slot=slots[0])[0]
        return jnp.sum(epj.moe_layer(params, h, group=g, spec=spec, slot=slots[1])[0] ** 2)

    with pytest.raises(ValueError, match="slot 5 of group .* is already prepared"):
        jax.jit(lambda p, x: two_layers(p, x, (5, 5)))(params, x)
    with pytest.raises(ValueError, match="already prepared"):
        jax.grad(lambda p, x: two_layers(p, x, (6, 6)))(params, x)
    jax.block_until_ready(jax.jit(jax.grad(lambda p, x: two_layers(p, x, (7, 8))))(params, x))
    two_layers(params, x, (9, 9))  # eager forward: each layer completes before the next prepares


def test_errors_surface_as_exceptions_with_epx_messages():
    g = cpu_group(4, 8, 6, 2)
    idx = jax.device_put(jnp.array([[0, 9]] * 6, jnp.int32), CPU)  # expert 9 of 4
    with pytest.raises(Exception, match=r"epx::prepare: topk_idx\[0, 1\] is 9, expected -1 \(masked\) or an expert id in \[0, 4\)"):
        jax.block_until_ready(epj.prepare(g, 0, idx).layout)
    with pytest.raises(ValueError, match="score is 'bogus'"):
        epj.Router(4, 2, score="bogus")
    with pytest.raises(ValueError, match="activation is 'tanh'"):
        epj.grouped_mlp(jnp.zeros((4, 8)), jnp.zeros(2, jnp.int32), jnp.zeros(1, jnp.int32), jnp.zeros((1, 8, 2, 4)),
                        jnp.zeros((1, 4, 8)), activation="tanh")


# ---- GPU -----------------------------------------------------------------------------------------
@needs_gpu
@pytest.mark.parametrize("ranks", ["one", "all"])
def test_gpu_moe_layer_jit_shard_map_matches_cpu_reference(ranks):
    """One process over one GPU and over every local GPU (one group view per device)."""
    from jax.sharding import Mesh
    from jax_layer_check import EXPERTS, HIDDEN, SPEC, TOKENS, check_layer_step_against_reference
    if not epx._C.gpu_grouped_gemm:
        pytest.skip("built without the CUTLASS grouped GEMMs")
    devices = GPUS[:1] if ranks == "one" else GPUS
    spec = epj.LayerSpec.from_preset("small", **SPEC)
    g = epj.Group.local(devices, num_experts=EXPERTS, hidden=HIDDEN, max_tokens_per_rank=TOKENS,
                        max_topk=spec.topk, align=16)
    try:
        check_layer_step_against_reference(g, Mesh(np.array(devices), ("ep",)), spec)
    finally:
        g.close()
