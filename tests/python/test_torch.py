"""epx.torch on one rank: the custom ops and the MoE module against plain-torch formulas and the CPU
reference, gradcheck in fp64 on the CPU reference, and on a GPU: CUDA graphs, torch.compile,
interleaved microbatches. Skips (with the reason) where torch or a GPU is missing."""
import math

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: the epx.torch tests need it")
import epx.torch as ept  # noqa: E402
from compare import rel_err  # noqa: E402

HAS_GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="no CUDA GPU visible: GPU tests of epx.torch skipped")
DEVICES = ["cpu"] + (["cuda"] if HAS_GPU else [])


def gpu_layers_built():
    import epx
    return epx._C.gpu_grouped_gemm


def small_group(device, experts=16, hidden=128, tokens=64, topk=4, dtype=torch.bfloat16):
    return ept.Group.local(device, num_experts=experts, hidden=hidden, max_tokens_per_rank=tokens, max_topk=topk,
                           dtype=dtype, align=16)


# ---- router ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_router_matches_softmax_topk(device):
    torch.manual_seed(0)
    T, E, K = 64, 32, 4
    logits = torch.randn(T, E, device=device)
    logits[5] = float("nan")  # an all-NaN row is fully masked
    r = ept.Router(E, K, score="softmax", normalize_weights=True)
    idx, w = r(logits)
    assert idx.dtype == torch.int32 and w.dtype == torch.float32 and idx.shape == (T, K)
    p = torch.softmax(logits.double(), -1)
    ref_w, ref_i = p.topk(K, -1)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    ok = torch.arange(T, device=device) != 5
    assert torch.equal(idx[ok].long(), ref_i[ok])
    torch.testing.assert_close(w[ok].double(), ref_w[ok], rtol=1e-5, atol=1e-6)
    assert (idx[5] == -1).all() and (w[5] == 0).all()


def test_router_gradcheck_fp64():
    torch.manual_seed(1)
    logits = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    for score in ("softmax", "sigmoid", "softmax_after_topk"):
        r = ept.Router(16, 3, score=score, normalize_weights=score == "sigmoid", num_groups=4 if score == "sigmoid" else 1,
                       group_topk=2 if score == "sigmoid" else 1)
        assert torch.autograd.gradcheck(lambda l: r(l)[1], (logits,)), score


# ---- prepare -> dispatch -> grouped_mlp -> combine ---------------------------------------------
def dense_moe(x, idx, w, w_in, w_out):
    """sum_k w[t,k] * swiglu FFN of expert idx[t,k], in fp64."""
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e < 0:
                continue
            a = x[t].double() @ w_in[e].double().reshape(x.shape[1], -1)
            a = a.reshape(2, -1)
            h = torch.nn.functional.silu(a[0]) * a[1]
            out[t] += w[t, k].double() * (h @ w_out[e].double())
    return out


def chain(group, x, logits, w_in, w_out, router, slot=0):
    idx, w = router(logits)
    routing = ept.prepare(group, idx, w, slot=slot)
    recv_x, recv_w = ept.dispatch(routing, x, w)
    y = ept.grouped_mlp(recv_x, routing.layout, routing.rows, w_in, w_out)
    return ept.combine(routing, y, recv_w), idx, w


@pytest.mark.parametrize("device", DEVICES)
def test_ops_chain_matches_dense_formula(device):
    if device == "cuda" and not gpu_layers_built():
        pytest.skip("built without the CUTLASS grouped GEMMs")
    torch.manual_seed(2)
    dt = torch.float64 if device == "cpu" else torch.bfloat16
    E, H, F, K, T = 16, 128, 64, 4, 48
    g = small_group(device, E, H, T, K, dtype=dt)
    x = torch.randn(T, H, device=device, dtype=dt)
    logits = torch.randn(T, E, device=device, dtype=torch.float64 if dt == torch.float64 else torch.float32)
    w_in = (torch.randn(E, H, 2, F, device=device) * 0.1).to(dt)
    w_out = (torch.randn(E, F, H, device=device) * 0.1).to(dt)
    out, idx, w = chain(g, x, logits, w_in, w_out, ept.Router(E, K))
    ref = dense_moe(x, idx, w, w_in, w_out)
    tol = dict(rtol=1e-10, atol=1e-10) if dt == torch.float64 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.double(), ref, **tol)


def test_ops_chain_gradcheck_fp64():
    torch.manual_seed(3)
    E, H, F, K, T = 4, 8, 4, 2, 5
    g = small_group("cpu", E, H, T, K, dtype=torch.float64)
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(T, E, dtype=torch.float64, requires_grad=True)
    w_in = (torch.randn(E, H, 2, F, dtype=torch.float64) * 0.5).requires_grad_()
    w_out = (torch.randn(E, F, H, dtype=torch.float64) * 0.5).requires_grad_()
    r = ept.Router(E, K)
    assert torch.autograd.gradcheck(lambda *a: chain(g, *a, r)[0], (x, logits, w_in, w_out))


def test_grouped_mlp_early_weights_and_biases_gradcheck_fp64():
    torch.manual_seed(4)
    G, H, F, rows = 3, 6, 4, 10
    offsets = torch.tensor([0, 4, 4, 8], dtype=torch.int32)  # expert 1 empty, padding rows 3 and 7
    nrows = torch.tensor([3, 0, 3], dtype=torch.int32)
    x = torch.randn(rows, H, dtype=torch.float64, requires_grad=True)
    rw = torch.rand(rows, dtype=torch.float64, requires_grad=True)
    w_in = torch.randn(G, H, 2, F, dtype=torch.float64, requires_grad=True)
    b_in = torch.randn(G, 2, F, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(G, F, H, dtype=torch.float64, requires_grad=True)
    b_out = torch.randn(G, H, dtype=torch.float64, requires_grad=True)

    def f(x, rw, w_in, b_in, w_out, b_out):
        return ept.grouped_mlp(x, offsets, nrows, w_in, w_out, b_in=b_in, b_out=b_out, row_weights=rw)[:8]

    assert torch.autograd.gradcheck(f, (x, rw, w_in, b_in, w_out, b_out))


# ---- the MoE module ----------------------------------------------------------------------------
def tiny_moe(dtype=torch.float64, **kw):
    g = ept.Group.local("cpu", num_experts=8, hidden=8, max_tokens_per_rank=16, max_topk=2, dtype=dtype, align=4)
    return ept.MoE(g, "tiny", dtype=dtype, seed=7, init_std=0.5, aux_loss_coeff=0.3, z_loss_coeff=0.2, **kw)


def test_moe_parameters_and_names():
    m = tiny_moe()
    names = dict(m.named_parameters())
    assert {"gate", "w_in", "w_out", "shared_w_in", "shared_w_out"} <= set(names)
    assert names["w_in"].shape == (8, 8, 2, 4)
    sd = m.state_dict()
    m2 = tiny_moe()
    with torch.no_grad():
        for p in m2.parameters():
            p.zero_()
    m2.load_state_dict(sd)
    x = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(m2(x), m(x), rtol=0, atol=0)


def test_moe_gradcheck_fp64():
    m = tiny_moe(backward_keeps_saved=True)  # gradcheck runs backward once per output element
    m.loss_grad_scale = 0.0  # gradcheck sees `out` only
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    params = {n: p.detach().clone().requires_grad_() for n, p in m.named_parameters()}

    def f(x, *ps):
        return torch.func.functional_call(m, dict(zip(params, ps)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params.values()))


def test_moe_loss_gradient_enters_with_loss_grad_scale():
    """d/dx of <c, out> + aux + z by central differences, against backward with loss_grad_scale=1."""
    m = tiny_moe()
    torch.manual_seed(5)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    c = torch.randn(6, 8, dtype=torch.float64)
    out, losses = m(x, return_losses=True)
    assert not losses.requires_grad and losses.shape == (2,) and (losses > 0).all()
    (out * c).sum().backward()
    analytic = x.grad.clone()

    def total(xv):
        with torch.no_grad():
            o, ls = m(xv, return_losses=True)
            return float((o * c).sum() + ls.sum())

    eps = 1e-6
    for i, j in [(0, 0), (2, 5), (5, 7)]:
        xp, xm = x.detach().clone(), x.detach().clone()
        xp[i, j] += eps
        xm[i, j] -= eps
        fd = (total(xp) - total(xm)) / (2 * eps)
        assert math.isclose(analytic[i, j].item(), fd, rel_tol=1e-5, abs_tol=1e-8), (i, j, analytic[i, j].item(), fd)


def test_compile_fullgraph_traces_the_ops_and_the_module_on_cpu():
    """torch.compile(fullgraph=True) traces every custom op (fake kernels, autograd) without a
    graph break; aot_eager runs the traced graphs, so the result must equal eager exactly."""
    torch._dynamo.reset()
    E, H, F, K, T = 4, 8, 4, 2, 5
    g = small_group("cpu", E, H, T, K, dtype=torch.float64)
    r = ept.Router(E, K)
    torch.manual_seed(10)
    args = [torch.randn(T, H, dtype=torch.float64), torch.randn(T, E, dtype=torch.float64),
            torch.randn(E, H, 2, F, dtype=torch.float64) * 0.5, torch.randn(E, F, H, dtype=torch.float64) * 0.5]

    def loss(x, logits, w_in, w_out):
        return chain(g, x, logits, w_in, w_out, r)[0].square().sum()

    eager = [a.clone().requires_grad_() for a in args]
    loss(*eager).backward()
    traced = [a.clone().requires_grad_() for a in args]
    torch.compile(loss, fullgraph=True, backend="aot_eager")(*traced).backward()
    for a, b in zip(eager, traced):
        assert torch.equal(a.grad, b.grad)

    m = tiny_moe()
    x = torch.randn(6, 8, dtype=torch.float64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    m(x1).square().sum().backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    torch.compile(lambda v: m(v).square().sum(), fullgraph=True, backend="aot_eager")(x2).backward()
    assert torch.equal(x1.grad, x2.grad)
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, want[n]), n


def test_moe_errors_are_value_errors():
    m = tiny_moe()
    out = m(torch.randn(4, 8, dtype=torch.float64, requires_grad=True))
    out.sum().backward(retain_graph=True)
    with pytest.raises(ValueError, match="backward was already called"):
        out.sum().backward()
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 8\]"):
        m(torch.randn(4, 7, dtype=torch.float64))
    with pytest.raises(ValueError, match="microbatch is 1"):
        m(torch.randn(4, 8, dtype=torch.float64), microbatch=1)
    with pytest.raises(ValueError, match="epx::MoELayer::forward: x has"):
        m(torch.randn(4, 8, dtype=torch.float32))
    with pytest.raises(ValueError, match="unknown option"):
        tiny_moe(bogus=1)
    with pytest.raises(ValueError, match="not contiguous"):
        ept.Router(8, 2)(torch.randn(8, 4).t())


def test_moe_fp8_block_forward_on_the_cpu_reference():
    """precision="fp8_block": the forward's expert GEMMs see quantized operands (close to, not equal
    to, the high-precision result); the weight cache is a GPU matter, refresh is a no-op here."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    high = tiny_moe(torch.float32)
    fp8 = tiny_moe(torch.float32, precision="fp8_block", fp8_weight_cache=True)
    fp8.refresh_fp8_weights()
    a, b = high(x), fp8(x)
    err = float((a - b).norm() / a.norm())
    assert 1e-4 < err < 0.1, err
    b.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in fp8.parameters())
    with pytest.raises(ValueError, match="not fp8_block"):
        high.refresh_fp8_weights()
    # an optimizer hook keeps the copies current: one refresh per step
    calls = []
    fp8.refresh_fp8_weights = lambda: calls.append(1)
    opt = torch.optim.SGD(fp8.parameters(), lr=0.1)
    handle = ept.refresh_fp8_weights_after_steps(opt, fp8)
    opt.step()
    opt.step()
    assert len(calls) == 2
    handle.remove()
    opt.step()
    assert len(calls) == 2
    with pytest.raises(ValueError, match="without fp8_weight_cache=True"):
        ept.refresh_fp8_weights_after_steps(opt, tiny_moe(torch.float32, precision="fp8_block"))


def test_moe_mxfp8_forward_on_the_cpu_reference():
    """precision="mxfp8": the forward's expert GEMMs see MX-quantized operands (close to, not equal
    to, the high-precision result, and not the fp8_block result); gradients flow."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    high, mx, blk = (tiny_moe(torch.float32, precision=p) for p in ("high", "mxfp8", "fp8_block"))
    a, b, c = high(x), mx(x), blk(x)
    assert 1e-4 < float((a - b).norm() / a.norm()) < 0.1
    assert float((b - c).norm() / c.norm()) > 1e-6
    b.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mx.parameters())


# ---- GPU ---------------------------------------------------------------------------------------
def gpu_moe(microbatches=1, tokens=256, **kw):
    if not gpu_layers_built():
        pytest.skip("built without the CUTLASS grouped GEMMs")
    g = ept.Group.local("cuda", num_experts=16, hidden=128, max_tokens_per_rank=tokens, max_topk=8, align=16)
    return ept.MoE(g, "small", hidden=128, ffn_hidden=64, shared_ffn_hidden=64, num_experts=16, seed=11, init_std=0.1,
                   microbatches=microbatches, **kw)


def step(m, x, d_out, microbatch=0):
    out = m(x, microbatch=microbatch)
    out.backward(d_out)
    return out


def grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@needs_gpu
def test_gpu_moe_matches_cpu_reference():
    m = gpu_moe()
    ref = ept.MoE(ept.Group.local("cpu", num_experts=16, hidden=128, max_tokens_per_rank=256, max_topk=8, align=16),
                  "small", hidden=128, ffn_hidden=64, shared_ffn_hidden=64, num_experts=16, seed=11, init_std=0.1)
    torch.manual_seed(6)
    x = torch.randn(256, 128, dtype=torch.bfloat16)
    d = torch.randn(256, 128, dtype=torch.bfloat16) * 0.1
    xg = x.cuda().requires_grad_()
    out_g = step(m, xg, d.cuda())
    xc = x.clone().requires_grad_()
    out_c = step(ref, xc, d)
    assert rel_err(out_g, out_c) < 5e-2
    assert rel_err(xg.grad, xc.grad) < 8e-2
    params = dict(m.named_parameters())
    for n, p in ref.named_parameters():
        assert rel_err(params[n].grad, p.grad) < 8e-2, n


@needs_gpu
@pytest.mark.parametrize("pipelined", [False, True])
def test_gpu_cuda_graph_replays_a_training_step_bit_identically(pipelined):
    m = gpu_moe(pipeline_chunks=3, overlap_communication=True) if pipelined else gpu_moe()
    torch.manual_seed(7)
    x = torch.randn(256, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    d = torch.randn(256, 128, dtype=torch.bfloat16, device="cuda") * 0.1
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm-up: the slot's buffers and routing block are made here
            m.zero_grad(set_to_none=False)
            x.grad = None
            out = step(m, x, d)
    torch.cuda.current_stream().wait_stream(s)
    eager_out, eager_dx, eager_g = out.clone(), x.grad.clone(), grads(m)

    graph = torch.cuda.CUDAGraph()
    m.zero_grad(set_to_none=False)
    x.grad.zero_()
    with torch.cuda.graph(graph):
        out = step(m, x, d)
    for _ in range(10):
        m.zero_grad(set_to_none=False)
        x.grad.zero_()
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out)
    assert torch.equal(x.grad, eager_dx)
    for n, gr in grads(m).items():
        assert torch.equal(gr, eager_g[n]), n
    m.group.check()


@needs_gpu
def test_gpu_pipelined_module_matches_the_plain_one():
    """pipeline_chunks + overlap_communication: the same output and input gradient bit for bit; the
    bf16 expert gradients add up the chunks' (one more rounding a chunk), the others are equal."""
    torch.manual_seed(9)
    x = torch.randn(250, 128, dtype=torch.bfloat16, device="cuda")
    d = torch.randn(250, 128, dtype=torch.bfloat16, device="cuda") * 0.1
    res = []
    for m in (gpu_moe(), gpu_moe(pipeline_chunks=3, overlap_communication=True)):
        xi = x.clone().requires_grad_()
        out = step(m, xi, d)
        res.append((out.detach(), xi.grad, grads(m)))
        m.group.check()
    assert torch.equal(res[0][0], res[1][0])
    assert torch.equal(res[0][1], res[1][1])
    for n, g in res[0][2].items():
        if n in ("w_in", "w_out"):
            assert rel_err(res[1][2][n], g) < 2e-2, n
        else:
            assert torch.equal(res[1][2][n], g), n


def test_moe_pipeline_chunks_match_one_chunk_on_cpu():
    torch.manual_seed(10)
    x = torch.randn(12, 8, dtype=torch.float64)
    d = torch.randn(12, 8, dtype=torch.float64)
    res = []
    for kw in ({}, {"pipeline_chunks": 3, "overlap_communication": True}):
        m = tiny_moe(**kw)
        xi = x.clone().requires_grad_()
        out = step(m, xi, d)
        res.append((out.detach(), xi.grad, grads(m)))
    assert torch.equal(res[0][0], res[1][0])
    assert torch.equal(res[0][1], res[1][1])
    for n, g in res[0][2].items():
        torch.testing.assert_close(res[1][2][n], g, rtol=1e-12, atol=1e-14, msg=n)


@needs_gpu
def test_gpu_torch_compile_fullgraph_matches_eager():
    m = gpu_moe()
    torch.manual_seed(8)
    x = torch.randn(256, 128, dtype=torch.bfloat16, device="cuda")
    d = torch.randn(256, 128, dtype=torch.bfloat16, device="cuda") * 0.1

    def train_step(x):
        out = m(x)
        return (out.float() * d.float()).sum()

    x1 = x.clone().requires_grad_()
    train_step(x1).backward()
    eager_dx, eager_g = x1.grad.clone(), grads(m)
    m.zero_grad()
    compiled = torch.compile(train_step, fullgraph=True)
    x2 = x.clone().requires_grad_()
    compiled(x2).backward()
    assert torch.equal(x2.grad, eager_dx)
    for n, gr in grads(m).items():
        assert torch.equal(gr, eager_g[n]), n


@needs_gpu
def test_gpu_three_interleaved_microbatches():
    m = gpu_moe(microbatches=3)
    torch.manual_seed(9)
    xs = [torch.randn(256, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    ds = [torch.randn(256, 128, dtype=torch.bfloat16, device="cuda") * 0.1 for _ in range(3)]
    alone = []
    for x, d in zip(xs, ds):  # each microbatch by itself
        m.zero_grad()
        xi = x.clone().requires_grad_()
        out = step(m, xi, d)
        alone.append((out.detach().clone(), xi.grad.clone(), grads(m)))
    m.zero_grad()
    ins = [x.clone().requires_grad_() for x in xs]
    outs = [m(xi, microbatch=i) for i, xi in enumerate(ins)]  # three forwards in flight
    for i in (1, 0, 2):
        outs[i].backward(ds[i])
    total = {n: sum(a[2][n].float() for a in alone) for n in alone[0][2]}
    for i in range(3):
        assert torch.equal(outs[i].detach(), alone[i][0]), i
        assert torch.equal(ins[i].grad, alone[i][1]), i
    for n, gr in grads(m).items():  # bf16 gradients accumulated by autograd in another order
        assert rel_err(gr, total[n]) < 1e-2, n


@needs_gpu
def test_gpu_fp8_block_module_matches_cpu_reference_and_refreshes():
    if not gpu_layers_built():
        pytest.skip("built without the CUTLASS grouped GEMMs")
    kw = dict(hidden=128, ffn_hidden=128, shared_ffn_hidden=128, num_experts=16, seed=11, init_std=0.1,
              precision="fp8_block")
    m = ept.MoE(ept.Group.local("cuda", num_experts=16, hidden=128, max_tokens_per_rank=256, max_topk=8, align=16),
                "small", fp8_weight_cache=True, **kw)
    ref = ept.MoE(ept.Group.local("cpu", num_experts=16, hidden=128, max_tokens_per_rank=256, max_topk=8, align=16),
                  "small", **kw)
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    out = m(x.cuda())
    assert rel_err(out, ref(x)) < 8e-2
    with torch.no_grad():
        m.w_in.mul_(1.5)
        ref.w_in.mul_(1.5)
    stale = m(x.cuda())
    m.refresh_fp8_weights()
    fresh = m(x.cuda())
    assert rel_err(fresh, ref(x)) < 8e-2
    assert rel_err(stale, ref(x)) > rel_err(fresh, ref(x)), "the kept FP8 weights should have been stale"


@needs_gpu
def test_gpu_errors_are_value_errors():
    m = gpu_moe()
    with pytest.raises(ValueError, match="epx::MoELayer::forward: x has 300 tokens, .* max_tokens_per_rank = 256"):
        m(torch.randn(300, 128, dtype=torch.bfloat16, device="cuda"))  # more tokens than the group holds
    with pytest.raises(ValueError, match="epx::MoELayer::forward: x has dtype fp32"):
        m(torch.randn(16, 128, dtype=torch.float32, device="cuda"))
    with pytest.raises(ValueError, match="expected a torch.Tensor"):
        ept.Router(16, 4)([[1.0]])
