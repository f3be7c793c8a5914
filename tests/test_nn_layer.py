"""MoELayer forward and backward against a per-expert loop reference; CUDA-graph capture on the GPU."""
import copy
import gc
import importlib.util
import weakref

import pytest
import torch
import torch.nn.functional as F

from conftest import PoisonPast, check_rows_past_unread, require_cuda_backend
from turbomoe import reference
from turbomoe.nn import GroupedExperts, MoELayer, TopKRouter

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TRITON_OPS = all(importlib.util.find_spec(m) for m in
                 ("turbomoe.autograd.gating", "turbomoe.kernels.slots", "turbomoe.autograd.scatter",
                  "turbomoe.autograd.gather"))


def expert_mlp(experts, e, x):
    h = x @ experts.w1[e]
    if experts.b1 is not None:
        h = h + experts.b1[e]
    a = F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1] if experts.activation == "swiglu" else F.gelu(h)
    y = a @ experts.w2[e]
    return y + experts.b2[e] if experts.b2 is not None else y


def loop_reference(layer, x, select_logits=None):
    """out, aux loss by a loop over experts, from the layer's own parameters (any dtype: fp64 math).

    select_logits: the logits the tested layer saw (bf16 rounding can flip near-tied choices);
    they pick the experts, the fp64 logits give the scores."""
    r = layer.router
    x_SM = x.reshape(-1, layer.hidden_size)
    S, E, k = x_SM.shape[0], layer.num_experts, layer.k
    logits = x_SM.to(torch.float64) @ r.weight.to(torch.float64).t()
    score = torch.softmax if r.score_func == "softmax" else (lambda t, dim: torch.sigmoid(t))
    probs = score(logits, -1)
    select = score(logits if select_logits is None else select_logits, -1)
    select = select if r.expert_bias is None else select + r.expert_bias.double()
    # Descending, ties to the lower expert id (exact ties are common among bf16 logits).
    ids = torch.sort(select.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    scores = probs.gather(1, ids)
    if r.renormalize:
        scores = scores / scores.sum(-1, keepdim=True)
    keep = torch.ones_like(ids, dtype=torch.bool)
    if layer.capacity_factor is not None:
        C = reference.capacity(S, E, k, layer.capacity_factor, layer.min_capacity)
        keep = reference.assign_slots(ids, scores, E, C, layer.drop_policy, layer.seed).slots >= 0
    out = torch.zeros(S, layer.hidden_size, dtype=torch.float64)
    ex = layer.experts
    for e in range(E):
        tok, j = ((ids == e) & keep).nonzero(as_tuple=True)
        y = expert_mlp(ex, e, x_SM[tok].double()) if x.dtype != torch.float64 else expert_mlp(ex, e, x_SM[tok])
        out = out.index_add(0, tok, y.double() * scores[tok, j, None])
    if layer.shared_expert is not None:
        out = out + expert_mlp(layer.shared_expert, 0, x_SM).double()
    first = F.one_hot(ids[:, 0] if k <= 2 else ids.reshape(-1), E).double().sum(0) / S
    aux = reference.aux_loss_coefficient(E, k) * (probs.mean(0) * first).sum()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    return out.view(x.shape), r.aux_loss_coef * aux + r.z_loss_coef * z


def params_to(layer, dtype):
    """A copy of the layer in dtype (for an fp64 reference of an fp32 or bf16 layer)."""
    return copy.deepcopy(layer).to(dtype)


def rel(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm().clamp_min(1e-30)).item()


def compare(layer, x, tol, grad_tol):
    """Forward + backward of layer vs the fp64 loop reference on a copy of its parameters."""
    ref_layer = params_to(layer, torch.float64).cpu()
    gen = torch.Generator().manual_seed(123)
    x = x.detach().requires_grad_()
    gy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    out, aux = layer(x)
    ((out.double().cpu() * gy).sum() + aux.double().cpu()).backward()
    xr = x.detach().double().cpu().requires_grad_()
    dt = layer.router.router_dtype or x.dtype
    x_SM = x.detach().reshape(-1, layer.hidden_size).to(dt)
    seen = F.linear(x_SM, layer.router.weight.detach().to(dt)).double().cpu()  # as the layer computes them
    out_r, aux_r = loop_reference(ref_layer, xr, seen)
    ((out_r * gy).sum() + aux_r).backward()
    assert torch.isfinite(out).all()
    assert rel(out, out_r) < tol
    assert abs(aux.item() - aux_r.item()) <= tol * abs(aux_r.item()) + 1e-12
    assert rel(x.grad, xr.grad) < grad_tol
    for (name, p), pr in zip(layer.named_parameters(), ref_layer.parameters()):
        assert rel(p.grad, pr.grad) < grad_tol, name


CPU_CASES = [
    dict(),
    dict(score_func="sigmoid", renormalize=True, z_loss_coef=1e-3),
    dict(activation="gelu", bias=True, shared_ffn_hidden_size=24),
    dict(capacity_factor=0.75, drop_policy="position"),
    dict(capacity_factor=0.75, drop_policy="probs", k=1),
    dict(expert_bias=True, k=3),
]


@pytest.mark.parametrize("kw", CPU_CASES)
def test_cpu_fp32_against_loop(kw):
    torch.manual_seed(0)
    kw = dict(kw)
    k = kw.pop("k", 2)
    layer = MoELayer(32, 40, 6, k, **kw)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.randn(6) * 0.1)
    compare(layer, torch.randn(3, 17, 32), 1e-5, 1e-4)


def expert_output_kept(layer, x) -> bool:
    """Whether the layer's forward keeps its routed experts' output y [R, M] alive for backward."""
    seen = []
    hook = layer.experts.register_forward_hook(lambda module, inputs, y: seen.append(weakref.ref(y)))
    try:
        out, aux = layer(x)
    finally:
        hook.remove()
    gc.collect()
    return seen[0]() is not None


def check_no_expert_output_kept(backend, device, gmm_backend=None):
    """SwiGLU experts without a second bias take the scores in their activation, so the forward keeps
    no y for the scores' gradient (dropless and with capacity); with b2 the weighted gather keeps it
    (the kernel paths' GatherTokens; the reference path keeps a gathered copy instead)."""
    torch.manual_seed(3)
    x = torch.randn(20, 16, device=device, requires_grad=True)
    for kw in (dict(), dict(capacity_factor=0.75)):
        layer = MoELayer(16, 24, 4, 2, backend=backend, gmm_backend=gmm_backend, device=device, **kw)
        assert not expert_output_kept(layer, x)
        compare(layer, x, 1e-5, 1e-4)
    assert expert_output_kept(MoELayer(16, 24, 4, 2, bias=True, backend=backend, device=device), x)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_keeps_no_expert_output(backend):
    """On the interpreter: test_nn_layer_triton.py."""
    if backend == "cuda":
        require_cuda_backend()
    check_no_expert_output_kept(backend, "cuda")


def test_cpu_bf16_against_loop():
    torch.manual_seed(5)
    layer = MoELayer(64, 96, 8, 2, dtype=torch.bfloat16, bias=True)
    compare(layer, torch.randn(2, 150, 64, dtype=torch.bfloat16), 2e-2, 3e-2)


@pytest.mark.parametrize("kw", [dict(), dict(activation="gelu", bias=True, shared_ffn_hidden_size=40),
                                dict(capacity_factor=1.0, recompute=True)])
def test_cpu_trains_under_autocast(kw):
    """fp32 parameters under torch.autocast (bf16): a bf16 output, as nn.Linear experts would give; fp32
    gradients; the fp32 run's routes (fp32 router logits) and values to bf16's rounding."""
    torch.manual_seed(6)
    layer = MoELayer(32, 48, 6, 2, **kw)
    x = torch.randn(3, 40, 32)

    def step(autocast):
        xg = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, aux = layer(xg)
            load = layer.expert_load.clone()
        (out.float().square().sum() + aux).backward()
        grads = [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
        return out, aux, load, xg.grad, grads

    out32, aux32, load32, dx32, grads32 = step(False)
    out, aux, load, dx, grads = step(True)
    assert out.dtype == torch.bfloat16 and dx.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in grads)
    assert torch.equal(load, load32) and torch.equal(aux, aux32)
    assert rel(out.float(), out32) < 2e-2 and rel(dx, dx32) < 3e-2
    assert all(rel(g, g32) < 3e-2 for g, g32 in zip(grads, grads32))


def test_cpu_expert_load_and_dropless_shapes():
    torch.manual_seed(1)
    layer = MoELayer(16, 24, 4, 2)
    layer(torch.randn(50, 16))
    assert layer.expert_load.dtype == torch.int32 and not layer.expert_load.requires_grad
    assert int(layer.expert_load.sum()) == 100
    capped = MoELayer(16, 24, 4, 2, capacity_factor=0.5)
    capped(torch.randn(50, 16))
    assert int(capped.expert_load.max()) <= reference.capacity(50, 4, 2, 0.5)


def test_cpu_expert_load_of_a_layer_made_under_inference_mode():
    """expert_load is written in place; a buffer made under inference_mode cannot be, outside it (a
    layer built there and then run under no_grad): the forward replaces it once, and in place after."""
    torch.manual_seed(3)
    with torch.inference_mode():
        layer = MoELayer(16, 24, 4, 2)
    x = torch.randn(9, 16)
    with torch.no_grad():
        layer(x)
    assert not layer.expert_load.is_inference() and int(layer.expert_load.sum()) == 18
    with torch.inference_mode():
        layer(x[:5])
    assert int(layer.expert_load.sum()) == 10
    with torch.no_grad():
        buf = layer.expert_load
        layer(x)
        assert layer.expert_load is buf and int(buf.sum()) == 18


@pytest.mark.parametrize("kw", [dict(), dict(activation="gelu", bias=True, expert_bias=True, shared_ffn_hidden_size=12,
                                           capacity_factor=1.0)], ids=["swiglu", "gelu-biases-shared"])
def test_cpu_meta_device_then_reset_parameters(kw):
    """Made on the meta device, materialized with to_empty (FSDP2's way for large models), then
    reset_parameters: every parameter and buffer has the bits of a layer made directly under the same
    seed (the layer had none: to_empty left uninitialized memory), and it trains alike."""
    torch.manual_seed(4)
    direct = MoELayer(16, 24, 5, 2, **kw)
    with torch.device("meta"):
        layer = MoELayer(16, 24, 5, 2, **kw)
    layer.to_empty(device="cpu")
    torch.manual_seed(4)
    layer.reset_parameters()
    want, got = direct.state_dict(), layer.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        if isinstance(want[name], torch.Tensor):
            assert torch.equal(got[name], want[name]), name
    assert torch.equal(layer.expert_load, direct.expert_load)
    x = torch.randn(11, 16)
    assert torch.equal(layer(x)[0], direct(x)[0])
    with torch.no_grad():  # and again from a trained state
        for p in layer.parameters():
            p.add_(1.0)
    torch.manual_seed(4)
    layer.reset_parameters()
    assert all(torch.equal(a, b) for a, b in zip(layer.parameters(), direct.parameters()))
    assert torch.equal(layer.expert_load, torch.zeros_like(layer.expert_load))


def test_cpu_nonfinite_token_routes_nowhere():
    torch.manual_seed(2)
    layer = MoELayer(16, 24, 4, 2)
    x = torch.randn(10, 16)
    x[3] = float("nan")
    out, aux = layer(x)
    assert torch.isfinite(out[torch.arange(10) != 3]).all() and torch.isfinite(aux)
    assert int(layer.expert_load.sum()) == 18


def test_update_expert_bias_moves_toward_balance():
    router = TopKRouter(8, 4, 1, expert_bias=True)
    router.update_expert_bias(torch.tensor([10, 0, 5, 5], dtype=torch.int32), rate=0.1)
    assert torch.allclose(router.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    with pytest.raises(RuntimeError, match="expert_bias=False"):
        TopKRouter(8, 4, 1).update_expert_bias(torch.zeros(4))


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double()])
def test_expert_bias_stays_fp32(cast):
    """.to(bf16) made the bias bf16, where a 1e-3 step is below the spacing from |bias| 0.25: balancing
    stopped (the bias stayed 0.5 over 100 updates). It stays fp32, as MoELayer(dtype=...) keeps it."""
    layer = cast(MoELayer(8, 6, 4, 2, expert_bias=True))
    bias = layer.router.expert_bias
    assert bias.dtype == torch.float32 and layer.router.weight.dtype != torch.float32
    bias.fill_(0.5)
    for _ in range(100):
        layer.router.update_expert_bias(torch.tensor([0, 4, 4, 4], dtype=torch.int32), rate=1e-3)
    assert abs(float(bias[0]) - 0.6) < 1e-4
    assert layer.state_dict()["router.expert_bias"].dtype == torch.float32


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(),
                                  lambda m: m.to("cpu", torch.float16)])
def test_expert_bias_keeps_its_bits_through_casts(cast):
    """The cast rounded the bias to 16 bits before _apply made it fp32 again: a trained bias of
    0.123456 came back 0.12353515625 (bf16), every balancing step below bf16's spacing lost."""
    torch.manual_seed(7)
    layer = MoELayer(8, 6, 4, 2, expert_bias=True)
    layer.router.expert_bias.copy_(torch.randn(4) * 0.3 + 1e-3)
    before_E = layer.router.expert_bias.clone()
    cast(layer)
    assert torch.equal(layer.router.expert_bias, before_E)


def test_update_expert_bias_rejects_bad_load_and_rate():
    """A load of shape [1] or a scalar broadcast into a no-op, a NaN rate made every bias NaN: both
    silently. They raise, and the bias is left as it was."""
    router = TopKRouter(8, 4, 1, expert_bias=True)
    router.expert_bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    before_E = router.expert_bias.clone()
    for load in (torch.tensor([7]), torch.tensor(7), torch.ones(2, 4), torch.ones(5)):
        with pytest.raises(ValueError, match=r"load must be a tensor of shape \[4\]"):
            router.update_expert_bias(load)
    for rate in (float("nan"), -1e-3, float("inf")):
        with pytest.raises(ValueError, match="rate must be a finite number >= 0"):
            router.update_expert_bias(torch.tensor([4, 0, 2, 2]), rate=rate)
    assert torch.equal(router.expert_bias, before_E)
    router.update_expert_bias(torch.tensor([4, 0, 2, 2]), rate=0.5)
    assert torch.equal(router.expert_bias, before_E + torch.tensor([-0.5, 0.5, 0.0, 0.0]))


def check_expert_load_modified_before_backward(backend, gmm_backend, kw):
    """expert_load was a detached alias of the kept counts the backward reads, sharing their version
    counter: an in-place all-reduce of it (summing the load over ranks for update_expert_bias) between
    forward and backward failed the backward. The gradients are those of a run without it."""
    torch.manual_seed(8)
    layer = MoELayer(16, 24, 4, 2, backend=backend, gmm_backend=gmm_backend, **kw)
    twin = copy.deepcopy(layer)
    x = torch.randn(2, 15, 16)
    grads = []
    for mod, all_reduce in ((layer, True), (twin, False)):
        out, aux = mod(x)
        load_E = mod.expert_load.clone()
        if all_reduce:
            mod.expert_load.mul_(2)  # what dist.all_reduce over two equal ranks does, in place
            assert torch.equal(mod.expert_load, 2 * load_E)
        (out.square().sum() + aux).backward()
        grads.append([p.grad for p in mod.parameters()])
    for g, g_twin in zip(*grads):
        assert torch.equal(g, g_twin)


@pytest.mark.parametrize("kw", [dict(), dict(activation="gelu", bias=True), dict(recompute=True)])
def test_cpu_expert_load_can_be_reduced_before_backward(kw):
    check_expert_load_modified_before_backward(None, None, kw)


def test_fp64_layer_under_autocast_stays_fp64():
    """autocast casts no fp64 tensor (an fp64 nn.Linear stays fp64 inside it), but the experts cast
    their fp64 rows and weights to bf16: a float64 check run inside an autocast region came out bf16.
    The same bits as outside autocast now, forward and backward."""
    torch.manual_seed(9)
    layer = MoELayer(16, 24, 4, 2, activation="gelu", bias=True, shared_ffn_hidden_size=8, dtype=torch.float64)
    x = torch.randn(20, 16, dtype=torch.float64)
    runs = []
    for autocast in (False, True):
        xg = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, aux = layer(xg)
        (out.square().sum() + aux).backward()
        runs.append([out, aux, xg.grad] + [p.grad.clone() for p in layer.parameters()])
        layer.zero_grad(set_to_none=True)
    assert runs[1][0].dtype == torch.float64
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_cpu_router_dtype_through_the_layer():
    """README's native-layer section offers router_dtype=torch.float32 for bf16 tokens, but MoELayer took
    no such argument (a TypeError; the benchmarks set layer.router.router_dtype after construction)."""
    torch.manual_seed(10)
    layer = MoELayer(32, 48, 6, 2, dtype=torch.bfloat16, router_dtype=torch.float32)
    assert layer.router.router_dtype == torch.float32
    x = torch.randn(2, 40, 32, dtype=torch.bfloat16)
    layer(x)
    logits = x.reshape(-1, 32).float() @ layer.router.weight.float().t()  # exact products, fp32 sums
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :2]
    assert torch.equal(layer.expert_load, torch.bincount(ids.reshape(-1), minlength=6).int())
    compare(layer, x, 2e-2, 3e-2)
    with pytest.raises(TypeError, match="router_dtype"):
        MoELayer(32, 48, 6, 2, router_dtype="fp32")


def test_router_and_experts_bad_arguments():
    """router_dtype="float32" was accepted and failed at the first forward as an invalid device string;
    a router given [B, T, M] or the wrong M raised torch.mm's messages; a non-bool expert_bias / bias
    was taken by its truth value."""
    with pytest.raises(TypeError, match="router_dtype must be None or a floating-point torch.dtype"):
        TopKRouter(8, 4, 2, router_dtype="float32")
    with pytest.raises(TypeError, match="router_dtype"):
        TopKRouter(8, 4, 2, router_dtype=torch.int32)
    with pytest.raises(TypeError, match="expert_bias must be a bool"):
        TopKRouter(8, 4, 2, expert_bias="no")
    with pytest.raises(TypeError, match="bias must be a bool"):
        GroupedExperts(4, 8, 12, bias=1)
    router = TopKRouter(8, 4, 2, router_dtype=torch.float64)
    for x in (torch.randn(2, 3, 8), torch.randn(3, 7)):
        with pytest.raises(ValueError, match=r"x must be \[S, 8\]"):
            router(x)
    g, loss = router(torch.randn(3, 8))
    assert g.scores.dtype == torch.float64 and loss.dtype == torch.float64


def test_bad_input():
    with pytest.raises(ValueError, match="k must be"):
        MoELayer(16, 24, 4, 5)
    with pytest.raises(ValueError, match="unknown turbomoe backend 'bogus'"):
        MoELayer(16, 24, 4, 2, backend="bogus")
    with pytest.raises(ValueError, match="unknown grouped GEMM backend 'bogus'"):
        MoELayer(16, 24, 4, 2, gmm_backend="bogus")
    with pytest.raises(ValueError, match="activation"):
        MoELayer(16, 24, 4, 2, activation="relu")
    for cf in (0.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="capacity_factor must be a finite number > 0"):
            MoELayer(16, 24, 4, 2, capacity_factor=cf)
    for name, bad, error in (("aux_loss_coef", "0.01", TypeError), ("z_loss_coef", None, TypeError),
                             ("aux_loss_coef", float("nan"), ValueError), ("z_loss_coef", -1.0, ValueError)):
        with pytest.raises(error, match=f"{name} must be a"):
            MoELayer(16, 24, 4, 2, **{name: bad})
    with pytest.raises(ValueError, match="drop_policy"):
        MoELayer(16, 24, 4, 2, capacity_factor=1.0, drop_policy="random")
    layer = MoELayer(16, 24, 4, 2)
    with pytest.raises(ValueError, match=r"\[\.\.\., 16\]"):
        layer(torch.randn(5, 15))
    with pytest.raises(TypeError, match="float64"):
        layer(torch.randn(5, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(5, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[R, 16\]"):
        GroupedExperts(4, 16, 24)(torch.randn(5, 8), torch.tensor([5, 0, 0, 0], dtype=torch.int32))


def gpu_backend():
    return None if TRITON_OPS else "reference"


@pytest.mark.parametrize("kw", [dict(), dict(activation="gelu", bias=True, shared_ffn_hidden_size=64),
                                dict(capacity_factor=1.0, drop_policy="position", k=1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@gpu
def test_gpu_against_loop(kw, dtype):
    torch.manual_seed(3)
    kw = dict(kw)
    k = kw.pop("k", 2)
    layer = MoELayer(256, 384, 8, k, backend=gpu_backend(), device="cuda", dtype=dtype, **kw)
    x = torch.randn(4, 300, 256, device="cuda", dtype=dtype)
    if dtype == torch.float32:
        compare(layer, x, 1e-4, 1e-3)
    else:
        compare(layer, x, 2e-2, 3e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.skipif(not TRITON_OPS, reason="needs the Triton gating ops (reference scatter syncs the host)")
def test_gpu_cuda_graph_capture_replays_new_routing():
    torch.manual_seed(4)
    S, M, E = 1024, 256, 8
    layer = MoELayer(M, 384, E, 2, device="cuda", dtype=torch.bfloat16)
    eager = copy.deepcopy(layer)
    x = torch.randn(S, M, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(S, M, device="cuda", dtype=torch.bfloat16)

    def step(mod, inp):
        out, aux = mod(inp)
        ((out.float() * gy.float()).sum() + aux).backward()
        return out

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: autotuning and lazy init happen outside the capture
        for _ in range(3):
            step(layer, x)
    torch.cuda.current_stream().wait_stream(s)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(layer, x)
    loads = []
    for trial in range(2):
        with torch.no_grad():
            x.copy_(torch.randn(S, M, device="cuda") * (trial + 1))
        graph.replay()
        loads.append(layer.expert_load.clone())
        eager.zero_grad(set_to_none=True)
        xe = x.detach().clone().requires_grad_()
        ref = step(eager, xe)
        assert rel(out, ref) < 1e-3
        assert rel(x.grad, xe.grad) < 1e-3
        for (name, p), pe in zip(layer.named_parameters(), eager.parameters()):
            assert rel(p.grad, pe.grad) < 1e-3, name
        assert torch.equal(layer.expert_load, eager.expert_load)
    assert not torch.equal(loads[0], loads[1])  # the replay really routed anew


def check_fused_grad_accumulation(device, dtype, tol, **kw):
    """fused_grad_accumulation: over three micro-batches every parameter's .grad equals the unfused
    layer's, shared expert too, and the experts' and the shared expert's weights are added into
    inside their GEMMs after the first, with recompute's saved-tensor hooks as well."""
    from turbomoe.autograd.grouped_gemm import GroupedMM
    torch.manual_seed(5)
    fused = MoELayer(64, 96, 6, 2, shared_ffn_hidden_size=32, fused_grad_accumulation=True, device=device, dtype=dtype,
                     backend=None if device == "cpu" else gpu_backend(), **kw)
    plain = copy.deepcopy(fused)
    for e in (plain.experts, plain.shared_expert):
        e.fused_grad_accumulation = False
    sinks, real = [], GroupedMM._sink

    def spy(ctx):  # the buffer each weight-gradient GEMM adds into, if any
        sink = real(ctx)
        sinks.append(None if sink is None else sink[0].shape)
        return sink
    GroupedMM._sink = staticmethod(spy)
    try:
        for m in range(3):
            x = torch.randn(3, 41, 64, device=device, dtype=dtype)
            for layer in (fused, plain):
                out, aux = layer(x)
                (out.float().square().mean() + aux).backward()
    finally:
        GroupedMM._sink = staticmethod(real)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        assert rel(p.grad, q.grad) < tol, name
    weights = [w.shape for e in (fused.experts, fused.shared_expert) for w in (e.w1, e.w2)]
    assert sorted(s for s in sinks if s is not None) == sorted(weights * 2), sinks  # micro-batches 2 and 3


@pytest.mark.parametrize("recompute", [False, True])
def test_cpu_fused_grad_accumulation(recompute):
    check_fused_grad_accumulation("cpu", torch.float64, 1e-12, recompute=recompute)
    with pytest.raises(TypeError, match="fused_grad_accumulation"):
        MoELayer(8, 8, 2, 1, fused_grad_accumulation=1)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recompute", [False, True])
def test_gpu_fused_grad_accumulation(dtype, recompute):
    check_fused_grad_accumulation("cuda", dtype, 1e-5 if dtype == torch.float32 else 2e-2, recompute=recompute)


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float64),
                                          pytest.param("cuda", torch.bfloat16, marks=[pytest.mark.gpu, gpu])])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("fused", [False, True])
def test_grouped_experts_rows_past_the_counts_never_reach_the_results(monkeypatch, fused, activation, device, dtype):
    """GroupedExperts with biases, each grouped GEMM's input, output and their gradients NaN past the
    counts (3 rows no route fills), two micro-batches accumulating: the routed rows' outputs and input
    gradients and the parameters' gradients the bits of the run without, finite (2026-11-29: the
    biases' gradients took NaN from there, bias_act)."""
    import turbomoe.nn.experts as experts_module
    counts = torch.tensor([9, 0, 20, 8], dtype=torch.int32, device=device)

    def make():
        torch.manual_seed(3)
        experts = GroupedExperts(4, 16, 24, activation, bias=True, device=device, dtype=dtype,
                                 fused_grad_accumulation=fused)
        with torch.no_grad():
            for b in (experts.b1, experts.b2):
                b.uniform_(-1, 1)
        return experts, lambda x: experts(x, counts)

    def poison(monkeypatch):
        gmm = experts_module.grouped_mm

        def poisoned(x_RK, w, counts_E, *args, **kw):
            n = int(counts_E.sum())
            return PoisonPast.apply(gmm(PoisonPast.apply(x_RK, n), w, counts_E, *args, **kw), n)
        monkeypatch.setattr(experts_module, "grouped_mm", poisoned)
    check_rows_past_unread(monkeypatch, make, poison, 16, device, dtype)


@pytest.mark.parametrize("modify", ["w1", "w2", "b1", "x"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_cpu_recompute_keeps_autograds_inplace_check(modify, activation):
    """A tensor the backward needs, modified in place after the forward, is an error, as without
    recompute: autograd skips its version check for tensors packed by saved-tensor hooks, so with
    recompute=True the experts' weight gradients were silently those of the modified weights, and rows
    remade from a modified input (a frozen router, an input without grad: nothing else kept it) gave
    w1 a gradient twice the true one."""
    torch.manual_seed(0)
    layer = MoELayer(16, 24, 4, 2, activation=activation, bias=True, recompute=True)
    layer.router.requires_grad_(False)
    x = torch.randn(30, 16)
    out, _ = layer(x)
    with torch.no_grad():
        (x if modify == "x" else getattr(layer.experts, modify)).mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.square().sum().backward()


@pytest.mark.parametrize("kw", [dict(), dict(activation="gelu", bias=True), dict(bias=True, shared_ffn_hidden_size=8),
                                dict(router_dtype=torch.float32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])])
@pytest.mark.parametrize("via", ["arguments", "environment"])
def test_reference_layer_differentiates_twice(kw, dtype, device, via, monkeypatch):
    """backend='reference' and gmm_backend='reference' (or TURBOMOE_BACKEND and TURBOMOE_GMM_BACKEND):
    the whole layer is plain PyTorch on CUDA too (SwiGLU, the biases and an fp32 router's logits not on
    kernels), so a gradient of a create_graph gradient has every term: the same as a float64 copy's,
    and nonzero in every parameter that has second-order terms. On the GPU the SwiGLU kernel had made
    it raise (2026-12-06)."""
    if via == "environment":
        monkeypatch.setenv("TURBOMOE_BACKEND", "reference")
        monkeypatch.setenv("TURBOMOE_GMM_BACKEND", "reference")
    else:
        kw = dict(kw, backend="reference", gmm_backend="reference")
    torch.manual_seed(3)  # made on the CPU and moved: the same numbers on both devices
    layer = MoELayer(16, 12, 4, 2, capacity_factor=2.0, renormalize=True, **kw).to(device=device, dtype=dtype)
    x = torch.randn(9, 16).to(device=device, dtype=dtype).requires_grad_()
    twin = copy.deepcopy(layer).double()
    x64 = x.detach().double().requires_grad_()
    grads = []
    for lay, xx in ((layer, x), (twin, x64)):
        out, loss = lay(xx)
        (g, ) = torch.autograd.grad(out.float().square().sum() + loss, xx, create_graph=True)
        g.float().square().sum().backward()
        grads.append([xx.grad] + [p.grad for p in lay.parameters() if p.requires_grad])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for got, want in zip(*grads):
        assert got is not None and want is not None
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    assert (layer.experts.w1.grad != 0).any() and (layer.router.weight.grad != 0).any()
