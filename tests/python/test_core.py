"""epx._C without any framework: the CPU reference layer through Python, argument errors as Python
exceptions with epx's messages. Runs everywhere the package builds."""
import ctypes
import math

import pytest

import epx
from epx import _C


def host(n, ctype=ctypes.c_float):
    return (ctype * max(n, 1))()


def ref_of(buf, dtype, shape):
    return _C.Ref(ctypes.addressof(buf), dtype, list(shape), -1)


def tiny_layer(dtype="fp32", storage=_C.ParamStorage.owned, tokens=8):
    p = epx.find_preset("tiny")
    cfg = epx.moe_config(p, getattr(epx.DType, dtype))
    gc = epx.GroupConfig()
    gc.num_experts, gc.hidden, gc.max_tokens_per_rank = p.experts, p.hidden, tokens
    gc.max_dtype = getattr(epx.DType, dtype)
    group = _C.Group.create_simulated(1, gc)[0]
    return p, cfg, group, _C.MoELayer(group, cfg, storage)


def test_build_info_and_presets():
    assert epx.__version__.count(".") == 2
    assert {"deepseek-v3", "mixtral", "tiny"} <= set(epx.preset_names())
    p = epx.find_preset("deepseek-v3")
    assert (p.hidden, p.ffn_hidden, p.experts, p.topk) == (7168, 2048, 256, 8)
    with pytest.raises(ValueError, match="unknown|known"):
        epx.find_preset("no-such-model")


def forward_backward(layer, T, H, x_freq, d_out_freq):
    """One forward and backward of an fp32 layer on x = sin(x_freq i), d_out = cos(d_out_freq i):
    the host buffers out, d_out and d_x, and the context."""
    x, out, d_out, d_x = host(T * H), host(T * H), host(T * H), host(T * H)
    for i in range(T * H):
        x[i] = math.sin(x_freq * i)
        d_out[i] = math.cos(d_out_freq * i)
    ctx = _C.MoEContext()
    layer.forward(ref_of(x, "fp32", [T, H]), ref_of(out, "fp32", [T, H]), ctx)
    layer.backward(ctx, ref_of(d_out, "fp32", [T, H]), ref_of(d_x, "fp32", [T, H]))
    return out, d_out, d_x, ctx


def test_layer_forward_backward_on_the_cpu_reference():
    p, cfg, group, layer = tiny_layer()
    assert (group.rank, group.size, group.local_experts) == (0, 1, p.experts)
    layer.init_params(3, 0.5)
    T, H = 8, p.hidden
    out, d_out, d_x, ctx = forward_backward(layer, T, H, 0.37, 0.11)
    assert all(math.isfinite(out[i]) for i in range(T * H))
    assert any(out[i] != 0 for i in range(T * H)), "the layer's output is all zeros"
    assert any(d_x[i] != 0 for i in range(T * H)), "d_x is all zeros"
    with pytest.raises(ValueError, match="backward was already called"):
        layer.backward(ctx, ref_of(d_out, "fp32", [T, H]), ref_of(d_x, "fp32", [T, H]))


def test_weight_grads_route_reaches_the_layer():
    """MoEConfig.weight_grads_in_ffn from Python (default True): both routes of the routing weights'
    gradient give the same d_x on the fp32 CPU reference, up to rounding, and not all zeros."""
    d_xs = []
    for in_ffn in (True, False):
        p, cfg, group, _ = tiny_layer()
        assert cfg.weight_grads_in_ffn is True
        cfg.weight_grads_in_ffn = in_ffn
        layer = _C.MoELayer(group, cfg)
        layer.init_params(7, 0.5)
        T, H = 8, p.hidden
        d_x = forward_backward(layer, T, H, 0.41, 0.13)[2]
        d_xs.append([d_x[i] for i in range(T * H)])
    scale = max(abs(v) for v in d_xs[1])
    assert scale > 0
    assert max(abs(a - b) for a, b in zip(*d_xs)) <= 1e-4 * scale


def test_pipeline_chunks_reach_the_layer_and_keep_its_output():
    """MoEConfig.pipeline_chunks / overlap_communication from Python: three chunks give the
    one-chunk output bit for bit; a bad chunk count is a ValueError with epx's message."""
    outs = []
    for chunks in (1, 3):
        p, cfg, group, _ = tiny_layer()
        cfg.pipeline_chunks, cfg.overlap_communication = chunks, chunks > 1
        layer = _C.MoELayer(group, cfg)
        layer.init_params(5, 0.5)
        T, H = 8, p.hidden
        x, out = host(T * H), host(T * H)
        for i in range(T * H):
            x[i] = math.sin(0.29 * i)
        layer.forward(ref_of(x, "fp32", [T, H]), ref_of(out, "fp32", [T, H]), _C.MoEContext())
        outs.append([out[i] for i in range(T * H)])
    assert outs[0] == outs[1]
    assert any(v != 0 for v in outs[0])
    p, cfg, group, _ = tiny_layer()
    cfg.pipeline_chunks = 0
    with pytest.raises(ValueError, match=r"config.pipeline_chunks is 0, expected 1..16"):
        _C.MoELayer(group, cfg)


def test_accumulated_gradients_add_to_the_previous_ones():
    """backward(..., accumulate_grads=True) adds this microbatch's gradients to grads(): after A
    (overwrite) then B (accumulate), each gradient is exactly the fp32 sum of the two alone."""
    p, cfg, group, layer = tiny_layer()
    layer.init_params(4, 0.5)
    T, H = 8, p.hidden
    names = [spec[0] for spec in layer.param_specs() if spec[4]]

    def grads():
        out = {}
        for name in names:
            ptr, _, shape, _ = layer.grad(name).describe()
            n = math.prod(shape)
            out[name] = list((ctypes.c_float * n).from_address(ptr))
        return out

    def step(phase, accumulate=False):
        x, out, d_out, d_x = host(T * H), host(T * H), host(T * H), host(T * H)
        for i in range(T * H):
            x[i] = math.sin(0.37 * i + phase)
            d_out[i] = math.cos(0.11 * i + 2 * phase)
        ctx = _C.MoEContext()
        layer.forward(ref_of(x, "fp32", [T, H]), ref_of(out, "fp32", [T, H]), ctx)
        layer.backward(ctx, ref_of(d_out, "fp32", [T, H]), ref_of(d_x, "fp32", [T, H]), accumulate_grads=accumulate)

    step(0.0)
    ga = grads()
    step(1.0)
    gb = grads()
    step(0.0)
    step(1.0, accumulate=True)
    acc = grads()
    for name in names:
        want = [ctypes.c_float(a + b).value for a, b in zip(ga[name], gb[name])]
        assert acc[name] == want, name
    assert ga != gb


def test_external_parameters_give_the_owned_layer_results():
    p, cfg, g_own, owned = tiny_layer()
    _, _, g_ext, ext = tiny_layer(storage=_C.ParamStorage.external)
    owned.init_params(5, 0.5)
    keep = []
    for name, shape, dtype, grad_dtype, trained in ext.param_specs():
        n = math.prod(shape)
        src = owned.param(name).describe()
        buf = host(n)
        ctypes.memmove(buf, src[0], 4 * n)
        keep.append(buf)
        ext.bind_param(name, ref_of(buf, dtype, shape))
    T, H = 8, p.hidden
    x = host(T * H)
    for i in range(T * H):
        x[i] = math.sin(0.5 * i + 1)
    outs = []
    for layer in (owned, ext):
        out = host(T * H)
        layer.forward(ref_of(x, "fp32", [T, H]), ref_of(out, "fp32", [T, H]), _C.MoEContext())
        outs.append(list(out))
    assert outs[0] == outs[1]


def test_errors_are_python_exceptions_with_epx_messages():
    p, cfg, group, layer = tiny_layer()
    x = host(8 * p.hidden)
    out = host(8 * p.hidden)
    with pytest.raises(ValueError, match=r"epx::MoELayer::forward: x has shape \[8, 3\]"):
        layer.forward(ref_of(x, "fp32", [8, 3]), ref_of(out, "fp32", [8, p.hidden]), _C.MoEContext())
    with pytest.raises(ValueError, match="no parameter named 'bogus'"):
        layer.bind_param("bogus", ref_of(x, "fp32", [1]))
    with pytest.raises(ValueError, match="unknown dtype 'fp7'"):
        _C.Ref(0, "fp7", [1], -1)
    _, _, _, bare = tiny_layer(storage=_C.ParamStorage.external)
    with pytest.raises(ValueError, match=r"params\(\).gate is not bound"):
        bare.forward(ref_of(x, "fp32", [8, p.hidden]), ref_of(out, "fp32", [8, p.hidden]), _C.MoEContext())
    gc = epx.GroupConfig()
    with pytest.raises(ValueError, match="num_experts is 0"):
        _C.Group.create_simulated(1, gc)


def test_group_config_keywords_reach_the_config():
    from epx import _config
    c = _config.group_config(8, 16, 4, max_topk=2, transport="staged", staged_exact_sizes=True, num_sms=24)
    assert (c.num_experts, c.hidden, c.max_tokens_per_rank, c.max_topk, c.num_sms) == (8, 16, 4, 2, 24)
    assert c.transport == _C.Transport.staged and c.staged_exact_sizes
    assert not _config.group_config(8, 16, 4).staged_exact_sizes
    with pytest.raises(ValueError, match="transport is 'fast'"):
        _config.group_config(8, 16, 4, transport="fast")


def test_launcher_variables_are_whole_numbers(monkeypatch):
    from epx._config import launcher_int
    monkeypatch.setenv("RANK", "3")
    assert launcher_int("RANK", "who") == 3
    for bad in ("abc", "1x", "2.0"):
        monkeypatch.setenv("RANK", bad)
        with pytest.raises(ValueError, match=f"who: RANK is '{bad}', expected a whole number"):
            launcher_int("RANK", "who")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert launcher_int("LOCAL_RANK", "who", default=0) == 0
    monkeypatch.setenv("LOCAL_RANK", "")
    assert launcher_int("LOCAL_RANK", "who", default=0) == 0
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(KeyError):
        launcher_int("WORLD_SIZE", "who")


def test_registered_bytes_per_rank_of_the_deepseek_v3_layer():
    # The bytes the group registered on 2 x H200 (what `epx info --preset deepseek-v3 --ranks 2` prints).
    p = epx.find_preset("deepseek-v3")
    gc = epx.GroupConfig()
    gc.num_experts, gc.hidden, gc.max_tokens_per_rank, gc.max_topk = p.experts, p.hidden, p.tokens, p.topk
    assert epx.registered_bytes_per_rank(gc, 2, epx.Transport.zerocopy) == 118627088
    assert epx.registered_bytes_per_rank(gc, 2, epx.Transport.staged) == 236980736
    with pytest.raises(ValueError, match="transport is auto"):
        epx.registered_bytes_per_rank(gc, 2, epx.Transport.auto)


def test_misspelt_variables_are_named(monkeypatch):
    # os.environ reaches the C environment, where the library looks for EPX_* names it does not read.
    monkeypatch.setenv("EPX_TRANSPROT", "staged")
    monkeypatch.setenv("EPX_PDL", "1")
    assert "EPX_TRANSPROT" in epx.unknown_env_names()
    assert "EPX_PDL" not in epx.unknown_env_names()
    assert "EPX_PDL" in epx.known_env_names() and "EPX_TRANSPORT" in epx.known_env_names()
    monkeypatch.delenv("EPX_TRANSPROT")
    assert "EPX_TRANSPROT" not in epx.unknown_env_names()
