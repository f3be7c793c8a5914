"""torch.func.grad and vjp (functional_call under them: per-sample gradients, meta-learning) through
turbomoe's autograd.Functions: MoELayer, the ops of turbomoe.ops, the grouped GEMM and the experts'
fused ops, the DeepSpeed drop-in, the Megatron-core layer and a whole model, against
torch.autograd.grad on the same inputs; and what vmap, jacrev and forward mode give. Backs README
"Edge inputs and errors" (its torch.func sentence).

torch.func runs the backward with create_graph=True, so its gradients are held bit for bit to
torch.autograd.grad(create_graph=True), and closely to a plain torch.autograd.grad: with grad mode on
PyTorch takes another silu backward (the reference experts' SwiGLU), a rounding apart. This file runs
the reference backend (on a GPU also the CUDA backends and grouped GEMMs: the gpu tests);
tests/test_torch_func_triton.py runs the checks again on the Triton backend under TRITON_INTERPRET=1.
"""

import pytest
import torch
from torch.func import functional_call, grad, jacrev, jvp, vjp, vmap

from conftest import HAS_CUDA, rel_err, require_cuda_backend
from turbomoe import ops
from turbomoe.autograd.bias_act import bias_act
from turbomoe.autograd.grouped_gemm import grouped_mm, row_groups, row_offsets
from turbomoe.autograd.router import fp32_logits, fp32_logits_and_x
from turbomoe.autograd.swiglu import swiglu
from turbomoe.nn import MoELayer

M, F = 8, 6


def assert_same(got, want, exact: bool = True):
    """Tensors (or dicts / sequences of them) equal bit for bit, or close: fp32 elementwise, bf16 in norm
    (its roundings of sums that cancel near zero are large relative to them)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        got, want = [got[k] for k in want], list(want.values())
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if exact:
            assert torch.equal(a, b), (a - b).abs().max()
        elif b.dtype == torch.bfloat16:
            assert rel_err(a, b) < 1e-2
        else:
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)


def _weighted(t: torch.Tensor) -> torch.Tensor:
    """A scalar that weighs each entry of t differently (a cotangent with no structure)."""
    return (t * torch.arange(t.numel(), device=t.device).view(t.shape).cos().to(t.dtype)).sum()


def _loss(outs) -> torch.Tensor:
    return sum(_weighted(o) for o in outs)


# ------------------------------------------------------------------ modules through functional_call

def check_module(module, x, outputs, seed=None):
    """torch.func.grad and vjp of a loss of module(x) (outputs: its float outputs as a tuple) with respect
    to x and every parameter, through functional_call, against torch.autograd.grad: bits with
    create_graph=True through functional_call on the same tensors (leaves of their own: the drop-in's
    stacked experts are then a copy, as under torch.func, not a view of its packed parameters, which BLAS
    may sum in another order), close with a plain autograd.grad of the module's own parameters. seed:
    torch's generator before each call (random routing). The parameters' .grad (set here) is neither
    read nor written by the transforms."""
    named = dict(module.named_parameters())

    def run(p, x):
        if seed is not None:
            torch.manual_seed(seed)
        return outputs(functional_call(module, p, (x, )))

    for p in named.values():
        p.grad = torch.full_like(p, 3.0)  # what fused gradient accumulation would add into
    params = {n: p.detach() for n, p in named.items()}
    got = grad(lambda p, x: _loss(run(p, x)), argnums=(0, 1))(params, x)
    outs, vjp_fn = vjp(run, params, x)
    got_vjp = vjp_fn(tuple(torch.ones_like(o) if o.dim() == 0 else _cotangent(o) for o in outs))
    leaves = {n: p.clone().requires_grad_() for n, p in params.items()}
    for own, create_graph in ((leaves, True), (named, False)):
        xr = x.detach().clone().requires_grad_()
        want = torch.autograd.grad(_loss(run(own, xr)), [xr, *own.values()], create_graph=create_graph)
        want = (dict(zip(named, want[1:])), want[0])
        for g in (got, got_vjp):
            assert_same(g[0], want[0], exact=create_graph)
            assert_same([g[1]], [want[1]], exact=create_graph)
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in named.values())
    return got


def _cotangent(o):
    """The cotangent whose vjp is _weighted's gradient."""
    return torch.arange(o.numel(), device=o.device).view(o.shape).cos().to(o.dtype)


def moe_layer(E, k, backend, gmm_backend, device="cpu", dtype=torch.float32, hidden=(M, F), **kw):
    layer = MoELayer(*hidden, E, k, backend=backend, gmm_backend=gmm_backend, device=device, dtype=dtype, **kw)
    with torch.no_grad():
        for p in layer.parameters():  # biases (zeros at init) too
            p.add_(torch.randn_like(p), alpha=0.3)
    return layer


LAYER_CASES = {
    "dropless-topk": dict(S=7, E=5, k=2),
    "capacity-topk": dict(S=7, E=5, k=2, capacity_factor=1.0),
    "dropless-top1": dict(S=9, E=4, k=1),
    "capacity-top1-probs": dict(S=9, E=4, k=1, capacity_factor=0.5, drop_policy="probs"),
    "S<E": dict(S=3, E=5, k=2),
    "S<E-capacity-rts": dict(S=3, E=5, k=2, capacity_factor=1.0, drop_policy="rts"),
    "bias-gelu-renormalize": dict(S=7, E=5, k=2, bias=True, activation="gelu", renormalize=True),
    "bias-swiglu-capacity": dict(S=7, E=5, k=3, bias=True, capacity_factor=1.25),
    "shared-sigmoid-zloss": dict(S=7, E=5, k=2, shared_ffn_hidden_size=4, score_func="sigmoid", z_loss_coef=1e-2),
    "recompute-fused-accumulation": dict(S=7, E=5, k=2, recompute=True, fused_grad_accumulation=True),
    "tokens-in-batches": dict(S=(2, 5), E=5, k=2),
}


def check_layer(case, backend, gmm_backend, device="cpu", dtype=torch.float32, hidden=(M, F), **extra):
    kw = dict(LAYER_CASES[case], **extra)
    S = kw.pop("S")
    torch.manual_seed(0)
    layer = moe_layer(kw.pop("E"), kw.pop("k"), backend, gmm_backend, device, dtype, hidden, **kw)
    x = torch.randn(*(S if isinstance(S, tuple) else (S, )), hidden[0], device=device, dtype=dtype)
    check_module(layer, x, lambda out: out, seed=1)
    layer.expert_load.zero_()  # a transform's forward writes the counts, as an eager one does
    torch.manual_seed(1)
    grad(lambda p: _weighted(functional_call(layer, p, (x, ))[0]))({n: p.detach() for n, p in layer.named_parameters()})
    func_load = layer.expert_load.clone()
    torch.manual_seed(1)
    layer(x)
    assert torch.equal(func_load, layer.expert_load) and func_load.sum() > 0


@pytest.mark.parametrize("gmm_backend", ["reference", None])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer(case, gmm_backend):
    check_layer(case, "reference", gmm_backend)


def check_idle_expert(backend, gmm_backend, device="cpu", hidden=(M, F)):
    """An expert no token reaches (its selection bias far down): zero gradients for its weights."""
    torch.manual_seed(3)
    layer = moe_layer(5, 2, backend, gmm_backend, device, hidden=hidden, expert_bias=True)
    layer.router.expert_bias[3] = -1e4
    got = check_module(layer, torch.randn(7, hidden[0], device=device), lambda out: out)
    assert int(layer.expert_load[3]) == 0 and int(layer.expert_load.sum()) == 14
    assert not got[0]["experts.w1"][3].any() and not got[0]["experts.w2"][3].any()


def test_layer_expert_with_no_tokens():
    check_idle_expert("reference", "reference")


def check_per_sample(backend, gmm_backend):
    """Per-sample gradients as a loop of torch.func.grad (vmap does not batch the kernels)."""
    torch.manual_seed(4)
    layer = moe_layer(5, 2, backend, gmm_backend)
    xs = torch.randn(3, 6, M)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    per = [grad(lambda p, x: _weighted(functional_call(layer, p, (x, ))[0]))(params, x) for x in xs]
    for x, got in zip(xs, per):
        want = torch.autograd.grad(_weighted(layer(x)[0]), list(layer.parameters()), create_graph=True)
        assert_same(got, dict(zip(params, want)))


def test_per_sample_gradients():
    check_per_sample("reference", "reference")


def test_a_whole_model_through_functional_call():
    """A tiny Qwen3-MoE causal LM (attention, norms, turbomoe's MoE layers): its loss's gradient with
    respect to every parameter, the meta-learning pattern."""
    pytest.importorskip("deepspeed")
    from tests.test_models import build, tiny
    model = build(tiny())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    named = dict(model.named_parameters())

    def loss(p):
        out = functional_call(model, p, (ids[:, :-1], ids[:, 1:]))
        return out.loss + 0.01 * out.aux_loss
    got = grad(loss)({n: p.detach() for n, p in named.items()})
    want = torch.autograd.grad(loss(named), list(named.values()), create_graph=True)
    assert_same(got, dict(zip(named, want)))


# ------------------------------------------------------------------ ops

def check_op(fn, inputs):
    """torch.func.grad and vjp of fn's float outputs (a tensor or tuple) with respect to every input,
    against torch.autograd.grad: bits with create_graph=True, close without."""
    def outs(*a):
        o = fn(*a)
        return o if isinstance(o, tuple) else (o, )
    n = tuple(range(len(inputs)))
    got = grad(lambda *a: _loss(outs(*a)), argnums=n)(*inputs)
    out, vjp_fn = vjp(outs, *inputs)
    got_vjp = vjp_fn(tuple(torch.ones_like(o) if o.dim() == 0 else _cotangent(o) for o in out))
    for create_graph in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        want = torch.autograd.grad(_loss(outs(*leaves)), leaves, create_graph=create_graph)
        assert_same(got, want, exact=create_graph)
        assert_same(got_vjp, want, exact=create_graph)


def _routes(S, E, k, capacity, device, seed):
    """Slots and fp32 scores of fresh random routing (the reference's, so the same on every backend)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(S, E, generator=g).to(device)
    r = ops.topk_gating(logits, k, backend="reference")
    return ops.assign_slots(r.expert_ids, r.scores, E, capacity, backend="reference"), r.scores.detach()


def op_case(name, backend, gmm_backend, device="cpu", dtype=torch.float32, hidden=(M, F)):
    """(fn, inputs) of op name on a backend; hidden: (M, F) of its tokens and experts."""
    M, F = hidden
    g = torch.Generator().manual_seed(sum(map(ord, name)))

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)
    logits = torch.randn(7, 5, generator=g).to(device)  # the router's: fp32
    if name.startswith("topk_gating"):
        kw = dict(score_func="sigmoid" if "sigmoid" in name else "softmax", renormalize="renormalize" in name,
                  selection_bias_E=torch.randn(5, generator=g).to(device) if "bias" in name else None)

        def gating(l):
            g = ops.topk_gating(l, 2, backend=backend, **kw)
            return g.scores, g.aux_loss, g.z_loss
        return gating, (logits, )
    if name in ("sample_second_expert", "second_by_logits"):
        rand = torch.rand(7, 5, generator=g).to(device)

        def second(l):
            first = ops.topk_gating(l, 1, backend=backend)
            if name == "sample_second_expert":
                return ops.sample_second_expert(l, first, rand, backend=backend).scores
            return ops.second_by_logits(l, first, backend=backend).scores
        return second, (logits, )
    s, scores = _routes(7, 5, 2, 2 if "capacity" in name else None, device, g.initial_seed())
    if name.startswith("scatter_tokens"):
        return (lambda x: ops.scatter_tokens(x, s, backend=backend)), (randn(7, M), )
    if name == "gather_tokens-unit":
        return (lambda y: ops.gather_tokens(y, s, None, backend=backend)), (randn(s.num_rows, M), )
    if name.startswith("gather_tokens"):
        renorm = "renormalize" in name
        return (lambda y, sc: ops.gather_tokens(y, s, sc, renorm, backend=backend)), (randn(s.num_rows, M), scores)
    if name.startswith("row_scores"):
        return (lambda sc: ops.row_scores(s, sc, backend, renormalize="renormalize" in name)), (scores, )
    counts = ops.buffer_counts(s)
    if name.startswith("grouped_mm"):
        w_GNK = randn(5, F, M)  # nn.Linear weights stacked: -transposed takes w as their view (w's gradient
        w = w_GNK.transpose(1, 2) if "transposed" in name else w_GNK.transpose(1, 2).contiguous()  # made so too)
        return (lambda x, w: grouped_mm(x, w, counts, gmm_backend)), (randn(s.num_rows, M), w)
    groups_R = row_groups(row_offsets(counts), s.num_rows)
    if name.startswith("bias_act"):
        act = name.split("-")[1]
        kernels = gmm_backend != "reference"
        return (lambda y, b: bias_act(y, b, groups_R, act=act, kernels=kernels)), (randn(s.num_rows, M), randn(5, M))
    if name.startswith("swiglu"):
        h, scale = randn(s.num_rows, 2 * F), torch.rand(s.num_rows, generator=g).to(device)
        return (lambda h, sc: swiglu(h, sc)), (h, scale)
    x, w = randn(7, M), randn(5, M)
    if name == "fp32_logits":
        return fp32_logits, (x, w)
    assert name == "fp32_logits_and_x", name
    # the router's x passed through it to the dispatch, whose gradient it adds
    return (lambda x, w: (lambda lx: (lx[0], lx[1] * 2))(fp32_logits_and_x(x, w))), (x, w)


OPS = ["topk_gating", "topk_gating-sigmoid-renormalize", "topk_gating-bias",
       "sample_second_expert", "second_by_logits", "scatter_tokens", "scatter_tokens-capacity", "gather_tokens",
       "gather_tokens-renormalize-capacity", "gather_tokens-unit", "row_scores-capacity",
       "row_scores-renormalize", "grouped_mm", "grouped_mm-transposed", "bias_act-none", "bias_act-gelu_tanh",
       "swiglu", "fp32_logits", "fp32_logits_and_x"]


# plain PyTorch on the reference backend (SwiGLU on the CPU), which ran under torch.func before too
PLAIN_ON_REFERENCE = [n for n in OPS if not n.startswith(("grouped_mm", "bias_act", "fp32_logits"))]


@pytest.mark.parametrize("name", [n for n in OPS if n not in PLAIN_ON_REFERENCE])
def test_op(name):
    """The grouped GEMM, bias_act and the fp32 router logits: Functions on every backend."""
    check_op(*op_case(name, "reference", "reference"))


@pytest.mark.parametrize("name", PLAIN_ON_REFERENCE)
def test_reference_op_unchanged(name):
    check_op(*op_case(name, "reference", "reference"))


def test_grouped_mm_returns_the_weight_gradient_meant_for_main_grad():
    """Megatron's gradient-accumulation fusion (main_grad, a placeholder for w) under torch.func: the
    gradient is returned and main_grad is left as it is."""
    s, _ = _routes(7, 5, 2, None, "cpu", 0)
    x, w, main_grad = torch.randn(s.num_rows, M), torch.randn(5, M, F), torch.zeros(5, M, F)
    counts = ops.buffer_counts(s)
    got = grad(lambda w: _weighted(grouped_mm(x, w, counts, "reference", main_grad_GKN=main_grad)))(w)
    wr = w.clone().requires_grad_()
    (want, ) = torch.autograd.grad(_weighted(grouped_mm(x, wr, counts, "reference")), wr)
    assert torch.equal(got, want) and not main_grad.any()


# ------------------------------------------------------------------ DeepSpeed and Megatron-core

DS_CASES = {  # expert, k, the drop-in's keywords
    "mlp-top1-capacity": ("mlp", 1, {}),  # RTS, the capacity buffer, batched GEMMs
    "swiglu-top2-dropless": ("swiglu", 2, dict(drop_tokens=False)),  # grouped GEMMs, scores in the SwiGLU
    "relu-top2-capacity": ("relu", 2, {}),  # sampled second expert
    "swiglu-top3-residual-fused": ("swiglu", 3, dict(use_residual=True, fused_grad_accumulation=True)),
    "mlp-top2-dropless-fused": ("mlp", 2, dict(drop_tokens=False, fused_grad_accumulation=True)),
}


def check_deepspeed(case, grads_in_place_taken, device="cpu"):
    pytest.importorskip("deepspeed")
    from torch import nn
    from turbomoe.integrations import deepspeed as tds
    expert, k, kw = DS_CASES[case]
    make = {"mlp": lambda: nn.Sequential(nn.Linear(M, F), nn.GELU(), nn.Linear(F, M)),
            "swiglu": lambda: tds.SwiGLUExpert(M, F),
            "relu": lambda: nn.Sequential(nn.Linear(M, F, bias=False), nn.ReLU(), nn.Linear(F, M, bias=False))}
    torch.manual_seed(0)
    layer = tds.MoE(hidden_size=M, expert=make[expert](), num_experts=5, k=k, min_capacity=0, **kw)
    with torch.no_grad():
        for p in layer.parameters():  # each expert its own weights
            p.add_(torch.randn_like(p), alpha=0.3)
    layer.to(device)
    check_module(layer, torch.randn(7, M, device=device), lambda out: out[:2], seed=5)  # (out, l_aux): counts: ints
    assert not grads_in_place_taken and not grads_in_place_taken.gemm  # no .grad added into under torch.func


@pytest.mark.parametrize("case", list(DS_CASES))
def test_deepspeed_drop_in(case, grads_in_place_taken, monkeypatch):
    monkeypatch.setenv("TURBOMOE_BACKEND", "reference")
    check_deepspeed(case, grads_in_place_taken)


MEGATRON_CASES = {  # config overrides: no aux or z loss (stock's MoEAuxLossAutoScaler), no shared expert
    "swiglu-top2": dict(),
    "capacity": dict(moe_expert_capacity_factor=1.0),
    "gelu-top1": dict(moe_router_topk=1, moe_router_pre_softmax=True, gated_linear_unit=False),
}


def check_megatron(case):
    pytest.importorskip("megatron.core")
    import torch.nn.functional as F_
    from megatron.core.transformer.spec_utils import build_module
    from megatron_common import model_parallel, moe_config
    from turbomoe.integrations import megatron as tm
    kw = dict(MEGATRON_CASES[case])
    if kw.get("gated_linear_unit") is False:
        kw["activation_func"] = F_.gelu
    with model_parallel("gloo"):
        cfg = moe_config(num_moe_experts=5, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None, **kw)
        torch.manual_seed(0)
        layer = build_module(tm.get_turbomoe_moe_spec(cfg), config=cfg)
        check_module(layer, torch.randn(7, 1, cfg.hidden_size), lambda out: out[:1])


@pytest.mark.parametrize("case", list(MEGATRON_CASES))
def test_megatron_layer(case, monkeypatch):
    monkeypatch.setenv("TURBOMOE_BACKEND", "reference")
    check_megatron(case)


# ------------------------------------------------------------------ beyond grad and vjp, and autograd as it was

def test_jacrev_through_the_reference_layer():
    """The reference backend and grouped GEMM are PyTorch ops both ways, so jacrev (a vmap over the
    backward) runs through the layer: the Jacobians in x and in every parameter are
    torch.autograd.functional.jacobian's (close: vmap batches the products)."""
    torch.manual_seed(5)
    layer = moe_layer(4, 2, "reference", "reference", bias=True, capacity_factor=1.0)
    x = torch.randn(5, M)
    params = {n: p.detach() for n, p in layer.named_parameters()}
    got = jacrev(lambda p, x: functional_call(layer, p, (x, ))[0], argnums=(0, 1))(params, x)
    want = torch.autograd.functional.jacobian(lambda *a: functional_call(layer, dict(zip(params, a[1:])), (a[0], ))[0],
                                              (x, *params.values()))
    assert_same(got[0], dict(zip(params, want[1:])), exact=False)
    assert_same([got[1]], [want[0]], exact=False)
    with pytest.raises(RuntimeError, match="vmap"):  # over the forward: routing's shapes depend on the values
        vmap(lambda x: layer(x)[0])(x[None].expand(2, -1, -1))


def test_batched_gradients_through_the_reference_layer():
    """autograd's own vmap over the backward (jacobian(vectorize=True), autograd.grad(is_grads_batched=True))
    runs through the reference layer: the unvectorized Jacobian, to rounding."""
    torch.manual_seed(8)
    layer = moe_layer(4, 2, "reference", "reference", bias=True)
    x = torch.randn(5, M)
    want = torch.autograd.functional.jacobian(lambda x: layer(x)[0], x)
    got = torch.autograd.functional.jacobian(lambda x: layer(x)[0], x, vectorize=True)
    assert_same([got], [want], exact=False)


@pytest.mark.parametrize("drop_tokens", [True, False], ids=["capacity", "dropless"])
def test_batched_gradients_through_the_reference_drop_in(drop_tokens, monkeypatch):
    """The same through the DeepSpeed drop-in: its capacity experts' batched GEMMs (into given memory,
    which autograd's batching refuses) take autograd's ops for a batch of gradients."""
    pytest.importorskip("deepspeed")
    from torch import nn
    from turbomoe.integrations import deepspeed as tds
    monkeypatch.setenv("TURBOMOE_BACKEND", "reference")
    monkeypatch.setenv("TURBOMOE_GMM_BACKEND", "reference")
    torch.manual_seed(0)
    layer = tds.MoE(hidden_size=M, expert=nn.Sequential(nn.Linear(M, F), nn.GELU(), nn.Linear(F, M)), num_experts=5,
                    k=2, min_capacity=0, drop_tokens=drop_tokens)
    x = torch.randn(7, M)
    jacobians = []
    for vectorize in (False, True):
        torch.manual_seed(1)  # the same draw of the second expert
        jacobians.append(torch.autograd.functional.jacobian(lambda x: layer(x)[0], x, vectorize=vectorize))
    assert jacobians[0].abs().sum() > 0
    assert_same([jacobians[1]], [jacobians[0]], exact=False)


BATCHED_GRADS = "runs kernels, which take one gradient, not a batch of them"


def check_batched_gradients_raise(layer, x):
    """autograd's own vmap over a kernel backward names the Function (it raised torch's "Cannot access
    storage of BatchedTensorImpl" from inside the kernel's launch, 2026-12-07)."""
    with pytest.raises(RuntimeError, match=r"GatherTokens\.backward " + BATCHED_GRADS):
        torch.autograd.functional.jacobian(lambda x: layer(x)[0], x, vectorize=True)
    x = x.detach().requires_grad_()
    y = layer(x)[0]
    with pytest.raises(RuntimeError, match=BATCHED_GRADS):
        torch.autograd.grad(y, x, torch.randn(3, *y.shape, device=y.device, dtype=y.dtype), is_grads_batched=True)


def test_grad_of_grad_through_the_reference_layer():
    """backend='reference', gmm_backend='reference' differentiates twice under torch.func as under autograd."""
    torch.manual_seed(6)
    layer = moe_layer(5, 2, "reference", "reference", bias=True)
    x = torch.randn(7, M)
    w1 = layer.experts.w1.detach()

    def penalty(w, x):  # a gradient penalty: the squared norm of the input's gradient
        gx = grad(lambda x: _weighted(functional_call(layer, {"experts.w1": w}, (x, ))[0]))(x)
        return gx.square().sum()
    got = grad(penalty)(w1, x)
    w = layer.experts.w1
    (gx, ) = torch.autograd.grad(_weighted(layer(x.requires_grad_())[0]), x, create_graph=True)
    (want, ) = torch.autograd.grad(gx.square().sum(), w)
    assert_same([got], [want], exact=False)


def test_forward_mode_raises_clearly():
    """jvp (and jacfwd) have no rule through turbomoe's Functions: the grouped GEMM's on every backend."""
    layer = moe_layer(5, 2, "reference", "reference")
    x = torch.randn(7, M)
    with pytest.raises(RuntimeError, match="must implement the jvp function"):
        jvp(lambda x: layer(x)[0], (x, ), (torch.ones_like(x), ))


def test_equal_groups_differentiate_twice():
    """The capacity experts' batched GEMMs (EqualGroups: the DeepSpeed drop-in's) under create_graph=True,
    which torch.func always runs: the first gradient and a second one, as einsum's. Their backward
    wrote into given memory (out=), which failed under create_graph; then it raised for a second."""
    from turbomoe.integrations.expert_stack import EqualGroups
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 6, 5, dtype=torch.float64, requires_grad=True)
    grads = []
    for y in (EqualGroups().matmul(x, w), torch.einsum("becm,enm->becn", x, w)):
        g = torch.autograd.grad(_weighted(y.square()), (x, w), create_graph=True)
        grads.append((*g, *torch.autograd.grad(g[0].square().sum(), (x, w))))
    assert_same(*grads, exact=False)


def test_reference_gating_ops_batch_and_push_forward():
    """Unchanged: the reference backend's gating ops are PyTorch ops, which vmap and jvp run."""
    logits = torch.randn(3, 7, 5)
    scores = vmap(lambda l: ops.topk_gating(l, 2, backend="reference").scores)(logits)
    assert torch.equal(scores, torch.stack([ops.topk_gating(l, 2, backend="reference").scores for l in logits]))
    _, tangent = jvp(lambda l: ops.topk_gating(l, 2, backend="reference").scores, (logits[0], ), (logits[1], ))
    want = torch.autograd.functional.jvp(lambda l: ops.topk_gating(l, 2, backend="reference").scores, logits[0],
                                         logits[1])[1]
    assert_same([tangent], [want], exact=False)


def test_alignment_check_looks_beneath_the_wrappers():
    """Choosing the CUTLASS grouped GEMM reads the operands' addresses, which torch.func's wrappers lack
    (2026-12-07, H100: every bf16 grouped GEMM under torch.func.grad raised "Cannot access data pointer")."""
    from turbomoe.autograd.grouped_gemm import _aligned16
    x = torch.randn(4, 8)
    seen = []
    grad(lambda t: seen.append(_aligned16(t, x)) or t.sum())(x)
    assert seen == [x.data_ptr() % 16 == 0]


# ------------------------------------------------------------------ the GPU's kernels and grouped GEMMs

gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
GPU_BACKENDS = [("triton", "triton"), ("cuda", "triton"), ("cuda", "torch"), ("cuda", "cutlass"),
                ("reference", "torch"), ("cuda", None)]  # None: chosen per call, as by default
GPU_SIZES = (16, 8)  # torch's and CUTLASS's grouped GEMMs: K and N multiples of 8


def _gpu(backend, gmm_backend, dtype):
    """Skips what this GPU cannot run."""
    if backend == "cuda":
        require_cuda_backend()
    if gmm_backend in ("torch", "cutlass") and dtype != torch.bfloat16:
        pytest.skip("torch's and CUTLASS's grouped GEMMs take bf16")
    if gmm_backend == "cutlass":
        from turbomoe import csrc
        if torch.cuda.get_device_capability() != (9, 0) or not csrc.gmm_available():
            pytest.skip("the CUTLASS grouped GEMM needs sm90 and its build")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend,gmm_backend", GPU_BACKENDS)
@pytest.mark.parametrize("case", ["dropless-topk", "capacity-top1-probs", "bias-swiglu-capacity",
                                  "recompute-fused-accumulation", "S<E-capacity-rts"])
@gpu[0]
@gpu[1]
def test_gpu_layer(case, backend, gmm_backend, dtype):
    """The kernels (SwiGLU's, the biases', the fp32 router logits' split GEMMs for bf16 tokens too) and
    every grouped GEMM under torch.func.grad and vjp, bits against autograd with create_graph=True."""
    _gpu(backend, gmm_backend, dtype)
    check_layer(case, backend, gmm_backend, "cuda", dtype, GPU_SIZES, router_dtype=torch.float32)
    if dtype == torch.float32:
        check_idle_expert(backend, gmm_backend, "cuda", GPU_SIZES)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("backend,gmm_backend,dtype", [("triton", "triton", torch.float32),
                                                       ("cuda", "triton", torch.float32),
                                                       ("cuda", "torch", torch.bfloat16),
                                                       ("cuda", "cutlass", torch.bfloat16),
                                                       ("cuda", None, torch.bfloat16)])
@gpu[0]
@gpu[1]
def test_gpu_op(name, backend, gmm_backend, dtype):
    _gpu(backend, gmm_backend, dtype)
    check_op(*op_case(name, backend, gmm_backend, "cuda", dtype, GPU_SIZES))


@pytest.mark.parametrize("backend,gmm_backend", [("triton", "triton"), ("cuda", None)])
@gpu[0]
@gpu[1]
def test_gpu_batched_gradients_raise(backend, gmm_backend):
    _gpu(backend, gmm_backend, torch.bfloat16)
    torch.manual_seed(9)
    layer = moe_layer(5, 2, backend, gmm_backend, device="cuda", dtype=torch.bfloat16, hidden=GPU_SIZES)
    check_batched_gradients_raise(layer, torch.randn(7, GPU_SIZES[0], device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("case", list(DS_CASES))
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@gpu[0]
@gpu[1]
def test_gpu_deepspeed_drop_in(case, backend, grads_in_place_taken, monkeypatch):
    _gpu(backend, None, torch.float32)
    monkeypatch.setenv("TURBOMOE_BACKEND", backend)
    check_deepspeed(case, grads_in_place_taken, "cuda")


@gpu[0]
@gpu[1]
def test_gpu_cuda_graphed_model_runs_eager_under_torch_func():
    """A model whose training step replays CUDA graphs: a torch.func call runs its eager forward (the
    graphs read the captured parameters, not functional_call's), with autograd's gradients."""
    pytest.importorskip("deepspeed")
    from tests.test_models import build, tiny
    from turbomoe.models.cuda_graph import graph_training_forward
    model = build(tiny(num_experts=8)).cuda()
    ids = torch.randint(0, 64, (4, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    graph_training_forward(model, ids[:, :-1], ids[:, 1:])
    named = dict(model.named_parameters())

    def loss(p):
        out = functional_call(model, p, (ids[:, :-1], ids[:, 1:]))
        return out.loss + 0.01 * out.aux_loss
    got = grad(loss)({n: p.detach().clone() for n, p in named.items()})
    out = type(model).forward(model, ids[:, :-1], ids[:, 1:])
    want = torch.autograd.grad(out.loss + 0.01 * out.aux_loss, list(named.values()), create_graph=True)
    assert_same(got, dict(zip(named, want)), exact=False)  # (other tensors than the model's: cuBLAS may differ)
