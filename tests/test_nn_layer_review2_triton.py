"""Review of turbomoe.nn.MoELayer (second pass): edge inputs against an independent float64 PyTorch
layer (its own top-k, drop policies and losses, written from the README, not from turbomoe.reference),
double backward, random token selection under recomputation, state dict round trips, gradient
accumulation with hooks and checkpointing, and error messages. Its faults (fixed 2026-12-06; these tests
keep them fixed): second derivatives silently wrong (the fp32 router's and the fp64 biases' backward
were once-differentiable on their PyTorch paths; torch's once_differentiable let autograd.grad prune
its error on the kernel paths), a 1-D token refused, a malformed extra state and an oversized
min_capacity reported under other names.

The Triton case at the end runs only with TRITON_INTERPRET=1 set before turbomoe is imported:
    TRITON_INTERPRET=1 python -m pytest -q tests/test_nn_layer_review2_triton.py (scripts/test.sh runs it so)
"""
import copy
import io
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from turbomoe.nn import MoELayer

F64 = torch.float64


# ---------------------------------------------------------------------------------------------
# An independent plain-PyTorch MoE layer (float64 where given float64 parameters)
# ---------------------------------------------------------------------------------------------

def _expert(ex, e, x):
    h = x @ ex.w1[e]
    if ex.b1 is not None:
        h = h + ex.b1[e]
    if ex.activation == "swiglu":
        gate, up = h.chunk(2, -1)
        a = F.silu(gate) * up
    else:
        a = F.gelu(h)
    y = a @ ex.w2[e]
    return y + ex.b2[e] if ex.b2 is not None else y


def plain_moe(layer, x):
    """(out, router loss, kept routes per expert) of `layer` computed route by route in plain PyTorch:
    softmax/sigmoid scores, top-k by score (+ expert_bias) with ties to the lower id, optional
    renormalisation over the k, DeepSpeed's capacity ceil(S/E*cf*k) >= min_capacity with the
    "position" (first choices of all tokens first, then token order) or "probs" (highest score, ties
    to the earlier route) policy, the shared expert, DeepSpeed's aux loss (first choices for k <= 2,
    all choices and E/k for k >= 3) and the z-loss."""
    r = layer.router
    M, E, k = layer.hidden_size, layer.num_experts, layer.k
    x_SM = x.reshape(-1, M)
    S = x_SM.shape[0]
    logits = x_SM @ r.weight.t()
    probs = logits.softmax(-1) if r.score_func == "softmax" else logits.sigmoid()
    select = probs.detach() + (0 if r.expert_bias is None else r.expert_bias.to(probs.dtype))
    ids = torch.sort(select, dim=-1, descending=True, stable=True).indices[:, :k]
    scores = probs.gather(1, ids)
    if r.renormalize:
        scores = scores / scores.sum(-1, keepdim=True)
    keep = [[True] * k for _ in range(S)]
    if layer.capacity_factor is not None:
        C = max(math.ceil(S / E * layer.capacity_factor * k), layer.min_capacity)
        keep = [[False] * k for _ in range(S)]
        if layer.drop_policy == "position":
            used = [0] * E
            for j in range(k):
                for s in range(S):
                    e = int(ids[s, j])
                    if used[e] < C:
                        used[e] += 1
                        keep[s][j] = True
        elif layer.drop_policy == "probs":
            sc = scores.detach()
            for e in range(E):
                routes = [(s, j) for s in range(S) for j in range(k) if int(ids[s, j]) == e]
                routes.sort(key=lambda sj: (-float(sc[sj[0], sj[1]]), sj[0] * k + sj[1]))
                for s, j in routes[:C]:
                    keep[s][j] = True
        else:
            raise NotImplementedError(layer.drop_policy)
    rows = []
    for s in range(S):
        acc = x_SM.new_zeros(M)
        for j in range(k):
            if keep[s][j]:
                acc = acc + scores[s, j] * _expert(layer.experts, int(ids[s, j]), x_SM[s:s + 1])[0]
        rows.append(acc)
    out = torch.stack(rows) if S else x_SM.new_zeros(0, M)
    if layer.shared_expert is not None:
        out = out + _expert(layer.shared_expert, 0, x_SM)
    n = max(S, 1)
    counted = ids[:, :1] if k <= 2 else ids
    ce = torch.zeros(E, dtype=x.dtype).index_add_(0, counted.reshape(-1),
                                                  torch.ones(counted.numel(), dtype=x.dtype)) / n
    me = probs.sum(0) / n
    aux = E / (1 if k <= 2 else k) * (me * ce).sum()
    z = (torch.logsumexp(logits, -1) ** 2).sum() / n
    load = torch.zeros(E, dtype=torch.int32)
    for s in range(S):
        for j in range(k):
            if keep[s][j]:
                load[int(ids[s, j])] += 1
    return out.reshape(x.shape), r.aux_loss_coef * aux + r.z_loss_coef * z, load


def _max_err(a, b):
    if a is None or b is None:
        t = a if b is None else b
        return 0.0 if t is None else float(t.detach().abs().max()) if t.numel() else 0.0
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


# (M, F, E, k, S, kwargs); onehot: every token's first choice is expert 1, second expert 2.
EDGE_CASES = {
    "S<E dropless": (6, 5, 8, 2, 3, {}),
    "one token, k=E": (6, 5, 4, 4, 1, {}),
    "k=E, capacity drops (position)": (6, 5, 4, 4, 9, dict(capacity_factor=0.5)),
    "k=E, capacity drops (probs)": (6, 5, 4, 4, 9, dict(capacity_factor=0.5, drop_policy="probs")),
    "probs policy, renormalize, k=2": (6, 5, 5, 2, 12, dict(capacity_factor=0.6, drop_policy="probs",
                                                           renormalize=True)),
    "sigmoid, expert_bias, k=3, probs": (6, 5, 5, 3, 12, dict(capacity_factor=0.6, score_func="sigmoid",
                                                             expert_bias=True, drop_policy="probs")),
    "min_capacity above the formula": (6, 5, 6, 2, 5, dict(capacity_factor=0.1, min_capacity=3)),
    "gelu, biases, shared, capacity": (6, 5, 4, 2, 10, dict(capacity_factor=1.0, activation="gelu", bias=True,
                                                            shared_ffn_hidden_size=3)),
    "k=1 swiglu bias, z-loss": (6, 5, 4, 1, 10, dict(capacity_factor=1.0, bias=True, z_loss_coef=0.1)),
    "one expert takes all, capacity": (6, 5, 3, 2, 7, dict(onehot=True, capacity_factor=1.0)),
    "one expert takes all, dropless": (6, 5, 3, 2, 7, dict(onehot=True)),
    "M=F=E=k=1": (1, 1, 1, 1, 5, {}),
    "E=1 with capacity": (3, 2, 1, 1, 5, dict(capacity_factor=0.5, activation="gelu", bias=True)),
    "E=k=8 (MAX_K), capacity": (3, 2, 8, 8, 6, dict(capacity_factor=0.3)),
    "sigmoid k=1 renormalize": (3, 2, 4, 1, 6, dict(score_func="sigmoid", renormalize=True)),
    "S=0 gelu, biases, capacity": (3, 2, 4, 2, 0, dict(capacity_factor=1.0, activation="gelu", bias=True,
                                                       shared_ffn_hidden_size=2)),
}


def _edge_layer(M, F_, E, k, S, kw, seed):
    kw = dict(kw)
    onehot = kw.pop("onehot", False)
    torch.manual_seed(seed)
    layer = MoELayer(M, F_, E, k, dtype=F64, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(torch.randn(E, generator=gen, dtype=torch.float32) * 0.2)
        for ex in (layer.experts, layer.shared_expert):
            if ex is not None and ex.b1 is not None:  # biases of zero would hide their gradients' errors
                ex.b1.uniform_(-0.5, 0.5, generator=gen)
                ex.b2.uniform_(-0.5, 0.5, generator=gen)
    x = torch.randn(S, M, generator=gen, dtype=F64)
    if onehot:
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[1] = 5.0
            layer.router.weight[2] = 2.0
        x = x.abs() + 0.1
    return layer, x, torch.randn(S, M, generator=gen, dtype=F64)


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_inputs_match_a_plain_float64_layer(name):
    """Outputs, router loss, expert_load and every gradient (x, router, experts, biases, shared expert)
    of an fp64 layer equal a route-by-route PyTorch layer to rounding, at edge inputs: fewer tokens
    than experts (experts with no rows: zero gradients), k = E, one expert taking every token, each
    capacity policy dropping routes, min_capacity, E = 1, S = 0."""
    M, F_, E, k, S, kw = EDGE_CASES[name]
    layer, x, gy = _edge_layer(M, F_, E, k, S, kw, seed=sum(map(ord, name)))
    ref = copy.deepcopy(layer)
    xa = x.clone().requires_grad_()
    out, loss = layer(xa)
    ((out * gy).sum() + loss).backward()
    xb = x.clone().requires_grad_()
    out_r, loss_r, load_r = plain_moe(ref, xb)
    ((out_r * gy).sum() + loss_r).backward()
    assert out.shape == x.shape and out.dtype == F64
    assert torch.equal(layer.expert_load, load_r), (layer.expert_load, load_r)
    if kw.get("capacity_factor") is not None and S:
        assert "onehot" not in kw or int(load_r.sum()) < S * k  # the drops are exercised
    assert _max_err(out, out_r) < 1e-12
    assert abs(loss.item() - loss_r.item()) < 1e-12
    assert _max_err(xa.grad, xb.grad) < 1e-12
    for (pname, p), q in zip(layer.named_parameters(), ref.parameters()):
        assert _max_err(p.grad, q.grad) < 1e-12, pname


# ---------------------------------------------------------------------------------------------
# Double backward (create_graph=True, then a gradient of that gradient)
# ---------------------------------------------------------------------------------------------

def _second_order(layer, x, gy):
    """d/dx of |d(out . gy + loss)/dx|^2, through torch.autograd.grad (a gradient penalty's way)."""
    xi = x.clone().requires_grad_()
    out, loss = layer(xi)
    g, = torch.autograd.grad((out * gy).sum() + loss, xi, create_graph=True)
    return torch.autograd.grad(g.square().sum(), xi)[0]


def test_fp32_layer_second_derivative_is_right_or_raises():
    """README: "The kernels' backward passes are not differentiable: a double backward ... through them
    raises; the reference backend differentiates twice." The default fp32 layer on the CPU (reference
    backend) does neither: its router's Fp32Logits is @once_differentiable, whose error node autograd
    prunes when torch.autograd.grad asks for x only, so the second derivative silently lacks the
    router's terms (19% off here)."""
    torch.manual_seed(1)
    layer = MoELayer(6, 5, 4, 2, backend="reference", gmm_backend="reference")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 6, generator=gen)
    gy = torch.randn(7, 6, generator=gen)
    want = _second_order(copy.deepcopy(layer).double(), x.double(), gy.double())
    try:
        got = _second_order(layer, x, gy)
    except RuntimeError:
        return  # an error is what the README promises for a backward that is not differentiable
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < 1e-4, f"second derivative silently off by {err:.3g} (relative)"


@pytest.mark.parametrize("kw", [dict(bias=True), dict(activation="gelu", bias=True),
                                dict(activation="gelu", bias=True, capacity_factor=0.5)])
def test_fp64_layer_with_biases_differentiates_twice(kw):
    """The reference backend differentiates twice (README), and an fp64 layer without biases does
    (gradgradcheck passes). With biases, BiasAct's CPU path is @once_differentiable: its second-order
    terms are dropped without an error under torch.autograd.grad (and .backward() raises)."""
    M, F_, E, k, S = 6, 5, 4, 2, 7
    layer, x, gy = _edge_layer(M, F_, E, k, S, kw, seed=11)
    got = _second_order(layer, x, gy)
    ref = copy.deepcopy(layer)
    xb = x.clone().requires_grad_()
    out, loss, _ = plain_moe(ref, xb)
    g, = torch.autograd.grad((out * gy).sum() + loss, xb, create_graph=True)
    want = torch.autograd.grad(g.square().sum(), xb)[0]
    assert _max_err(got, want) < 1e-10, (got - want).abs().max()


def test_fp64_layer_without_biases_differentiates_twice_with_recompute():
    """The passing counterpart: no biases, dropless and with capacity, recompute on and off: the second
    derivative equals the plain layer's, and recompute changes no bit of it (its remade tensors keep
    their place in the graph)."""
    for kw in (dict(), dict(capacity_factor=0.5, shared_ffn_hidden_size=3, renormalize=True)):
        layer, x, gy = _edge_layer(6, 5, 4, 2, 9, kw, seed=12)
        again = MoELayer(6, 5, 4, 2, recompute=True, dtype=F64, **kw)
        again.load_state_dict(layer.state_dict())
        got = _second_order(layer, x, gy)
        assert torch.equal(got, _second_order(again, x, gy))
        xb = x.clone().requires_grad_()
        out, loss, _ = plain_moe(copy.deepcopy(layer), xb)
        g, = torch.autograd.grad((out * gy).sum() + loss, xb, create_graph=True)
        assert _max_err(got, torch.autograd.grad(g.square().sum(), xb)[0]) < 1e-10


# ---------------------------------------------------------------------------------------------
# Error messages
# ---------------------------------------------------------------------------------------------

def test_one_dimensional_input():
    """forward(x [..., M]): a 1-D x of M features is [..., M] (nn.Linear takes it). The layer raised
    "x must be [..., 8], got (8,)", a message that contradicts itself. Either the layer takes it as
    one token or the message must say that x needs two dimensions."""
    torch.manual_seed(0)
    layer = MoELayer(8, 6, 4, 2)
    x = torch.randn(8)
    try:
        out, aux = layer(x)
    except ValueError as e:
        msg = str(e)
        assert "2-D" in msg or "two dim" in msg or "at least" in msg or "dim" in msg, msg
        return
    out2, aux2 = layer(x[None])
    assert out.shape == (8, ) and torch.equal(out, out2[0]) and torch.equal(aux, aux2)


@pytest.mark.parametrize("bad", [7, None, [3], {"sede": 3}])
def test_malformed_extra_state_is_named(bad):
    """A state dict whose `_extra_state` is not {"seed": int} (a hand-edited or converted checkpoint)
    raised "'int' object is not subscriptable" / "'NoneType' object ..." / KeyError: 'seed' from
    set_extra_state; the README's rule is that bad input raises naming what is wrong."""
    layer = MoELayer(8, 6, 4, 2, capacity_factor=1.0, drop_policy="rts", seed=3)
    state = layer.state_dict()
    state["_extra_state"] = bad
    with pytest.raises((TypeError, ValueError)) as info:
        layer.load_state_dict(state)
    msg = str(info.value)
    assert "extra" in msg or "state" in msg, msg
    assert layer.seed == 3


def test_min_capacity_too_large_is_named():
    """MoELayer(min_capacity=-3) raises naming min_capacity at the call (README), but a min_capacity past
    what int32 slots hold (2**40) is accepted there and fails at the first forward as "capacity (None
    for dropless) must be in [0, 536870911]": an argument the caller never passed."""
    with pytest.raises(ValueError, match="min_capacity"):
        layer = MoELayer(8, 6, 4, 2, capacity_factor=1.0, min_capacity=2 ** 40)
        layer(torch.randn(3, 8))


# ---------------------------------------------------------------------------------------------
# Random token selection, determinism, recomputation
# ---------------------------------------------------------------------------------------------

def test_rts_keeps_a_uniform_subset_of_size_capacity():
    """E = 1, k = 1: every token goes to the one expert, which keeps C = ceil(S * cf) of them. In
    eval the selection depends on `seed` alone (and draws nothing from torch's generator); over
    seeds every token is kept with probability C / S, and pairs with C(C-1)/(S(S-1))."""
    S, cf, N = 8, 0.5, 400
    torch.manual_seed(0)
    layer = MoELayer(4, 3, 1, 1, capacity_factor=cf, drop_policy="rts", dtype=F64).eval()
    x = torch.randn(S, 4, dtype=F64)
    C = math.ceil(S * cf)
    freq = torch.zeros(S, dtype=F64)
    pair = torch.zeros(S, S, dtype=F64)
    rng = torch.get_rng_state()
    for seed in range(N):
        layer.seed = seed
        out, _ = layer(x)
        kept = (out.abs().sum(1) > 0).to(F64)
        assert int(kept.sum()) == C and int(layer.expert_load[0]) == C
        freq += kept
        pair += kept[:, None] * kept[None]
    assert torch.equal(torch.get_rng_state(), rng)  # eval draws nothing
    p = C / S
    assert (freq / N - p).abs().max() < 4 * math.sqrt(p * (1 - p) / N)
    q = C * (C - 1) / (S * (S - 1))
    off = ~torch.eye(S, dtype=torch.bool)
    assert ((pair / N)[off] - q).abs().max() < 4 * math.sqrt(q * (1 - q) / N)
    layer.seed = 5
    assert torch.equal(layer(x)[0], layer(x)[0])


@pytest.mark.parametrize("recompute", [False, True])
def test_rts_same_bits_under_both_checkpoints_with_recompute_and_shared_expert(recompute):
    """RTS layer with a shared expert, recompute on or off: eager, reentrant and non-reentrant
    torch.utils.checkpoint give the same bits (outputs, loss, dx, every parameter's gradient) from the
    same torch seed; a different torch seed gives another selection."""
    torch.manual_seed(0)
    kw = dict(capacity_factor=0.5, drop_policy="rts", shared_ffn_hidden_size=4, dtype=F64)
    base = MoELayer(8, 6, 4, 2, **kw)
    layer = MoELayer(8, 6, 4, 2, recompute=recompute, **kw)
    layer.load_state_dict(base.state_dict())
    x = torch.randn(2, 9, 8, dtype=F64)

    def step(mod, mode, rng_seed=7):
        mod.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        torch.manual_seed(rng_seed)
        out, aux = mod(xi) if mode == "eager" else checkpoint(mod, xi, use_reentrant=mode == "reentrant")
        (out.square().sum() + aux).backward()
        return [out.detach(), aux.detach(), xi.grad, mod.expert_load.clone()] + [p.grad for p in mod.parameters()]

    want = step(base, "eager")
    assert int(want[3].sum()) < 2 * 18  # routes were dropped
    for mode in ("eager", "reentrant", "non-reentrant"):
        got = step(layer, mode)
        for a, b in zip(want, got):
            assert torch.equal(a, b), mode
    other = step(base, "eager", rng_seed=8)
    assert not torch.equal(other[0], want[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_seed_same_bits(dtype):
    """Two layers built from one torch seed, trained one step on the same data from the same torch
    RNG state (RTS drawing from it), give the same bits in every output and gradient."""
    runs = []
    for _ in range(2):
        torch.manual_seed(42)
        layer = MoELayer(16, 12, 4, 2, capacity_factor=0.75, drop_policy="rts", shared_ffn_hidden_size=8,
                         dtype=dtype)
        x = torch.randn(3, 11, 16, dtype=dtype, requires_grad=True)
        out, aux = layer(x)
        (out.float().square().sum() + aux).backward()
        runs.append([out, aux, x.grad, layer.expert_load] + [p.grad for p in layer.parameters()])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_full_backward_hook_on_experts_with_recompute():
    """A full backward hook on the experts wraps their input (an alias of the expert rows that
    recompute stores as a recipe): the gradients and what the hook sees are the bits of recompute=False."""
    torch.manual_seed(0)
    a = MoELayer(8, 6, 4, 2, dtype=F64)
    b = MoELayer(8, 6, 4, 2, dtype=F64, recompute=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(9, 8, dtype=F64)
    res = []
    for layer in (a, b):
        seen = []
        h = layer.experts.register_full_backward_hook(
            lambda m, gi, go: seen.extend(t.clone() for t in gi + go if t is not None))
        xi = x.clone().requires_grad_()
        out, aux = layer(xi)
        (out.square().sum() + aux).backward()
        h.remove()
        res.append([xi.grad] + [p.grad for p in layer.parameters()] + seen)
    assert len(res[0]) == len(res[1]) > 4
    for p, q in zip(*res):
        assert torch.equal(p, q)


def test_noncontiguous_and_expanded_inputs():
    """A transposed, a strided, an expanded and a batch-transposed x route as their contiguous copies
    and give their outputs to rounding (a transposed x changes BLAS's summation order in the router's
    logits, as it does for F.linear: not the same bits)."""
    torch.manual_seed(0)
    layer = MoELayer(8, 6, 4, 2)
    base = torch.randn(8, 10)
    for x in (base.t(), torch.randn(10, 16)[:, ::2], torch.randn(1, 8).expand(5, 8),
              torch.randn(3, 4, 8).transpose(0, 1)):
        o1, a1 = layer(x)
        load = layer.expert_load.clone()
        o2, a2 = layer(x.contiguous())
        assert o1.shape == x.shape and torch.equal(load, layer.expert_load)
        assert torch.allclose(o1, o2, rtol=1e-5, atol=1e-6) and torch.allclose(a1, a2, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# State dict
# ---------------------------------------------------------------------------------------------

def test_state_dict_through_torch_save_weights_only_resumes_rts_and_bias():
    """The state dict survives torch.save / torch.load(weights_only=True): the RTS seed (extra state),
    the fp32 expert_bias (exact bits, also into a bf16-cast layer) and the parameters; with torch's RNG
    state restored, the next training step's selection is the original's."""
    torch.manual_seed(1)
    layer = MoELayer(8, 6, 4, 2, capacity_factor=0.5, drop_policy="rts", seed=1234567, expert_bias=True,
                     dtype=F64)
    layer.router.expert_bias.copy_(torch.tensor([0.123456, -0.0311, 0.2, 1e-3]))
    x = torch.randn(12, 8, dtype=F64)
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    rng = torch.get_rng_state()
    want, _ = layer(x)
    fresh = MoELayer(8, 6, 4, 2, capacity_factor=0.5, drop_policy="rts", seed=0, expert_bias=True, dtype=F64)
    fresh.load_state_dict(state)
    assert fresh.seed == 1234567
    torch.set_rng_state(rng)
    got, _ = fresh(x)
    assert torch.equal(got, want)
    cast = MoELayer(8, 6, 4, 2, capacity_factor=0.5, drop_policy="rts", expert_bias=True).to(torch.bfloat16)
    cast.load_state_dict(state)
    assert cast.router.expert_bias.dtype == torch.float32
    assert torch.equal(cast.router.expert_bias, layer.router.expert_bias)


# ---------------------------------------------------------------------------------------------
# Gradient accumulation
# ---------------------------------------------------------------------------------------------

def test_fused_grad_accumulation_with_hooks_checkpointing_and_autograd_grad():
    """fused_grad_accumulation=True against the unfused layer (fp64: equal bits) over micro-batches:
    under both torch.utils.checkpoint kinds, with a Tensor.register_hook that rescales w2's gradient,
    post-accumulate hooks reading the running sum, retain_graph double backward, a torch.autograd.grad
    call in between (returns the gradient and leaves .grad alone) and backward(inputs=[w1])."""
    torch.manual_seed(0)
    fused = MoELayer(8, 6, 4, 2, fused_grad_accumulation=True, shared_ffn_hidden_size=4, dtype=F64)
    plain = copy.deepcopy(fused)
    for e in (plain.experts, plain.shared_expert):
        e.fused_grad_accumulation = False
    seen = {id(fused): [], id(plain): []}
    for layer in (fused, plain):
        layer.experts.w2.register_hook(lambda g: g * 0.5)
        layer.experts.w1.register_post_accumulate_grad_hook(lambda p, k=id(layer): seen[k].append(p.grad.clone()))
    gen = torch.Generator().manual_seed(3)
    for mode in ("eager", "reentrant", "non-reentrant", "retain"):
        for _ in range(3):
            x = torch.randn(11, 8, generator=gen, dtype=F64)
            for layer in (fused, plain):
                xi = x.clone().requires_grad_()
                if mode == "eager" or mode == "retain":
                    out, aux = layer(xi)
                else:
                    out, aux = checkpoint(layer, xi, use_reentrant=mode == "reentrant")
                loss = out.square().sum() + aux
                if mode == "retain":
                    loss.backward(retain_graph=True)
                loss.backward()
        for p, q in zip(fused.parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad), mode
    assert len(seen[id(fused)]) == len(seen[id(plain)]) > 0
    for a, b in zip(seen[id(fused)], seen[id(plain)]):
        assert torch.equal(a, b)
    before = [p.grad.clone() for p in fused.parameters()]
    x = torch.randn(11, 8, generator=gen, dtype=F64)
    grads = []
    for layer in (fused, plain):
        out, aux = layer(x)
        grads.append(torch.autograd.grad(out.square().sum() + aux, list(layer.parameters())))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, fused.parameters()))
    for layer in (fused, plain):
        out, aux = layer(x)
        (out.square().sum() + aux).backward(inputs=[layer.experts.w1])
    for p, q in zip(fused.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


# ---------------------------------------------------------------------------------------------
# Dtypes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(), dict(activation="gelu", bias=True, capacity_factor=1.0),
                                dict(capacity_factor=0.75, drop_policy="probs")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_layers_on_the_cpu_against_fp64(kw, dtype):
    """fp16 (untested before) and bf16 (only with biases before) layers on the CPU: output, loss and
    every gradient within 16-bit rounding of the fp64 loop on the same parameters."""
    from test_nn_layer import compare
    torch.manual_seed(5)
    layer = MoELayer(32, 48, 6, 2, dtype=dtype, **kw)
    compare(layer, torch.randn(2, 60, 32, dtype=dtype), 2e-2, 3e-2)


def test_fp16_autocast_on_the_cpu():
    """Under torch.autocast(cpu, float16) with fp32 parameters: an fp16 output, fp32 loss, input and
    parameter gradients, the fp32 run's routes."""
    torch.manual_seed(0)
    layer = MoELayer(16, 12, 4, 2, bias=True, activation="gelu", shared_ffn_hidden_size=4, capacity_factor=1.0)
    x = torch.randn(10, 16)
    out32, _ = layer(x)
    load32 = layer.expert_load.clone()
    xi = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        out, aux = layer(xi)
    (out.float().square().sum() + aux).backward()
    assert out.dtype == torch.float16 and aux.dtype == torch.float32 and xi.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in layer.parameters())
    assert torch.equal(layer.expert_load, load32)
    assert ((out.float() - out32).norm() / out32.norm()).item() < 1e-2


# ---------------------------------------------------------------------------------------------
# The Triton path (TRITON_INTERPRET=1 only)
# ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", [(3, 5, 8, 8, 3, dict(capacity_factor=0.3)),
                                  (5, 7, 3, 2, 11, dict(onehot=True, capacity_factor=1.0, drop_policy="probs")),
                                  (5, 7, 3, 3, 11, dict(activation="gelu", bias=True, capacity_factor=0.7,
                                                        min_capacity=6, shared_ffn_hidden_size=3)),
                                  (6, 4, 4, 1, 6, dict(drop_policy="rts", capacity_factor=0.5, recompute=True))])
def test_triton_path_edge_inputs_match_the_reference(case):
    """Gating, slots, scatter/gather and grouped GEMM kernels (interpreted) against the reference
    backend at k = E, one expert taking every token, min_capacity, odd sizes, RTS with recompute."""
    M, F_, E, k, S, kw = case
    kw = dict(kw)
    onehot = kw.pop("onehot", False)
    torch.manual_seed(M + F_ + E + k + S)
    tri = MoELayer(M, F_, E, k, backend="triton", gmm_backend="triton", **kw)
    with torch.no_grad():
        for ex in (tri.experts, tri.shared_expert):
            if ex is not None and ex.b1 is not None:
                ex.b1.uniform_(-1, 1)
                ex.b2.uniform_(-1, 1)
        if onehot:
            tri.router.weight.zero_()
            tri.router.weight[1] = 3.0
    ref = MoELayer(M, F_, E, k, backend="reference", gmm_backend="reference", **kw)
    ref.load_state_dict(tri.state_dict())
    x = torch.randn(S, M)
    if onehot:
        x = x.abs() + 0.1
    res = []
    for layer in (tri, ref):
        xi = x.clone().requires_grad_()
        torch.manual_seed(3)
        out, aux = layer(xi)
        (out.square().sum() + aux).backward()
        res.append([out, aux, xi.grad] + [p.grad for p in layer.parameters()])
        res[-1].append(layer.expert_load.clone())
    assert torch.equal(res[0][-1], res[1][-1])
    for a, b in zip(res[0][:-1], res[1][:-1]):
        assert _max_err(a, b) <= 1e-5 * max(1.0, float(b.abs().max()))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_triton_kernels_second_derivative_raises():
    """README: "The kernels' backward passes are not differentiable: a double backward (create_graph=True,
    then a gradient of that gradient) through them raises". With the kernels' ops (backend="triton") and
    a differentiable path from x besides them (GELU experts and a shared expert on a GEMM that autograd
    differentiates: here the reference GEMM, on an H100 torch._grouped_mm), torch.autograd.grad returned
    a second derivative 90% off without an error: torch's @once_differentiable hangs its error node off
    detached copies, which autograd prunes when only x's gradient is asked for. It must raise."""
    torch.manual_seed(1)
    layer = MoELayer(6, 5, 4, 2, activation="gelu", shared_ffn_hidden_size=4, backend="triton",
                     gmm_backend="reference")
    ref = MoELayer(6, 5, 4, 2, activation="gelu", shared_ffn_hidden_size=4, backend="reference",
                   gmm_backend="reference", dtype=F64)
    ref.load_state_dict(layer.state_dict())
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 6, generator=gen)
    gy = torch.randn(7, 6, generator=gen)
    _second_order(ref, x.double(), gy.double())  # the reference backend differentiates twice
    with pytest.raises(RuntimeError, match="differentiate twice"):
        _second_order(layer, x, gy)
