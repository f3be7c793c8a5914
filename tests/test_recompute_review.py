"""Review of determinism and recomputation (CPU, reference backend): activation checkpointing
(torch.utils.checkpoint, both kinds; DeepSpeed's own), the layer's recompute=True, and the DeepSpeed
drop-in's random gating (RSample, Jitter, top-2 sampling, use_rts) replayed by checkpointing, where
the existing tests do not reach: S = 0, one hot expert, S < E, autocast, double backward, fused
gradient accumulation over micro-batches with recompute under checkpointing, the DeepSpeed drop-in's
noisy policies and fused accumulation under checkpointing. The xfail(strict) tests record faults found."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from turbomoe.nn import MoELayer

F64 = torch.float64
MODES = ["eager", "reentrant", "non-reentrant"]


def call(mod, x, mode):
    if mode == "eager":
        return mod(x)
    return checkpoint(mod, x, use_reentrant=mode == "reentrant")


def layer_step(layer, x, mode, rng_seed=7):
    """Forward + backward from a fixed torch RNG state: outputs, dx, expert_load, every gradient, and
    the CPU RNG state after the step (a replay must leave it where the plain step does)."""
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    torch.manual_seed(rng_seed)
    out, aux = call(layer, xi, mode)
    (out.square().sum() + aux).backward()
    return ([out.detach(), aux.detach(), xi.grad, layer.expert_load.clone()] + [p.grad for p in layer.parameters()]
            + [torch.get_rng_state()])


def assert_same(want, got, what=""):
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        assert (a is None) == (b is None), (what, i)
        if a is not None:
            assert torch.equal(a, b), (what, i)


def hot_layer(k=2, E=4, **kw):
    """A layer whose router sends every token to expert 2 first (and 1 second): one hot expert."""
    torch.manual_seed(0)
    layer = MoELayer(8, 6, E, k, dtype=F64, **kw)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2] = 1.0
        layer.router.weight[1] = 0.5
    return layer


# ---------------------------------------------------------------------------------------------
# MoELayer: edge shapes under both checkpoints, with recompute and RTS
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["S0", "S0_rts_recompute_shared", "hot_rts", "hot_k1_rts_recompute",
                                  "hot_dropless_recompute", "S_below_E_rts_recompute"])
def test_edge_shapes_same_bits_under_checkpoints(case):
    """Eager, reentrant and non-reentrant checkpointing give the same bits (outputs, dx, expert_load,
    gradients) and leave torch's CPU RNG in the same state, at S = 0, one hot expert and S < E."""
    if case.startswith("S0"):
        kw = dict(capacity_factor=1.0, drop_policy="rts", recompute=True, shared_ffn_hidden_size=4) if "rts" in case \
            else {}
        torch.manual_seed(0)
        layer, x = MoELayer(8, 6, 4, 2, dtype=F64, **kw), torch.randn(0, 8, dtype=F64)
    elif case == "S_below_E_rts_recompute":
        torch.manual_seed(0)
        layer = MoELayer(8, 6, 8, 2, capacity_factor=0.5, drop_policy="rts", recompute=True, dtype=F64)
        x = torch.randn(3, 8, dtype=F64)
    else:
        kw = {"hot_rts": dict(capacity_factor=0.5, drop_policy="rts"),
              "hot_k1_rts_recompute": dict(k=1, capacity_factor=0.5, drop_policy="rts", recompute=True),
              "hot_dropless_recompute": dict(recompute=True)}[case]
        layer = hot_layer(**kw)
        x = torch.rand(10, 8, dtype=F64) + 0.5
    want = layer_step(layer, x, "eager")
    if case.startswith("hot"):
        assert int(want[3][2]) > 0 and int(want[3][0]) == int(want[3][3]) == 0  # one expert (two with k=2)
    for mode in MODES[1:]:
        assert_same(want, layer_step(layer, x, mode), mode)


@pytest.mark.parametrize("kw", [dict(), dict(activation="gelu", bias=True),
                                dict(capacity_factor=0.5, shared_ffn_hidden_size=4)])
def test_recompute_same_bits_under_cpu_autocast(kw):
    """recompute=True remakes the rows and activation in backward outside the forward's autocast
    region: under torch.autocast(cpu, bf16) the bits equal recompute=False's, and both checkpoint
    kinds (which replay under the recorded autocast state) equal eager."""
    torch.manual_seed(0)
    plain = MoELayer(16, 12, 4, 2, **kw)
    again = MoELayer(16, 12, 4, 2, recompute=True, **kw)
    again.load_state_dict(plain.state_dict())
    x = torch.randn(20, 16)

    def step(layer, mode):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16):
            out, aux = call(layer, xi, mode)
        (out.float().square().sum() + aux).backward()
        return [out.detach(), xi.grad] + [p.grad for p in layer.parameters()]

    want = step(plain, "eager")
    assert want[0].dtype == torch.bfloat16
    assert_same(want, step(again, "eager"), "recompute")
    for mode in MODES[1:]:
        assert_same(want, step(plain, mode), mode)


@pytest.mark.parametrize("kw", [dict(), dict(activation="gelu", bias=True),
                                dict(capacity_factor=0.5, shared_ffn_hidden_size=4)])
def test_recompute_double_backward_same_bits(kw):
    """The reference layer differentiates twice; with recompute=True the rows and activation are
    remade under no_grad, yet autograd re-links them to the forward's graph: first- and second-order
    gradients are the bits of recompute=False."""
    torch.manual_seed(0)
    kw = dict(kw, backend="reference", gmm_backend="reference", dtype=F64)
    plain = MoELayer(8, 6, 4, 2, **kw)
    again = MoELayer(8, 6, 4, 2, recompute=True, **kw)
    again.load_state_dict(plain.state_dict())
    x = torch.randn(10, 8, dtype=F64)
    res = []
    for layer in (plain, again):
        xi = x.clone().requires_grad_()
        out, aux = layer(xi)
        wrt = [xi] + list(layer.parameters())
        first = torch.autograd.grad(out.square().sum() + aux, wrt, create_graph=True)
        second = torch.autograd.grad(sum(g.square().sum() for g in first), wrt, allow_unused=True)
        res.append(list(first) + list(second))
    assert_same(res[0], res[1])


@pytest.mark.parametrize("mode", MODES)
def test_fused_accumulation_with_recompute_and_rts_under_checkpoints(mode):
    """fused_grad_accumulation + recompute + RTS + a shared expert, micro-batches of S = 5, 0, 3, 0, 1
    tokens (S < E = 8), each under checkpointing: the summed gradients are the bits of the plain layer
    run eagerly on the same micro-batches and RNG states."""
    torch.manual_seed(0)
    kw = dict(capacity_factor=0.5, drop_policy="rts", shared_ffn_hidden_size=4, dtype=F64)
    fused = MoELayer(8, 6, 8, 2, fused_grad_accumulation=True, recompute=True, **kw)
    plain = MoELayer(8, 6, 8, 2, **kw)
    plain.load_state_dict(fused.state_dict())
    gen = torch.Generator().manual_seed(3)
    for S in (5, 0, 3, 0, 1):
        x = torch.randn(S, 8, generator=gen, dtype=F64)
        for layer, m in ((fused, mode), (plain, "eager")):
            xi = x.clone().requires_grad_()
            torch.manual_seed(100 + S)
            out, aux = call(layer, xi, m)
            (out.square().sum() + aux).backward()
    for p, q in zip(fused.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("kind", ["reentrant", "non-reentrant"])
def test_rts_under_deepspeeds_activation_checkpointing(kind):
    """README: DeepSpeed's recomputation saves and restores torch's CPU generator, from which
    MoELayer's RTS draws: deepspeed.checkpointing's checkpoint and non_reentrant_checkpoint give the
    plain step's bits and leave the generator where it does. DeepSpeed moves the inputs to the GPU
    where there is one: the layer lives there too."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.activation_checkpointing import checkpointing as dsck
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(3)
    layer = MoELayer(16, 24, 4, 2, capacity_factor=0.5, drop_policy="rts", shared_ffn_hidden_size=8, dtype=F64,
                     device=dev)
    x = torch.randn(26, 16, dtype=F64).to(dev)
    want = layer_step(layer, x, "eager")
    assert int(want[3].sum()) < 2 * 26  # routes were dropped: the selection matters
    fn = dsck.checkpoint if kind == "reentrant" else dsck.non_reentrant_checkpoint
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    torch.manual_seed(7)
    out, aux = fn(layer, xi)
    (out.square().sum() + aux).backward()
    got = ([out.detach(), aux.detach(), xi.grad, layer.expert_load.clone()] + [p.grad for p in layer.parameters()]
           + [torch.get_rng_state()])
    assert_same(want, got)


# ---------------------------------------------------------------------------------------------
# The DeepSpeed drop-in: random gating replayed by checkpointing
# ---------------------------------------------------------------------------------------------

M, FF, E = 16, 24, 8
DS_CASES = {
    "top1_rsample_capacity": ("mlp", dict(k=1, capacity_factor=0.5, noisy_gate_policy="RSample", use_rts=False)),
    "top1_jitter_rts_capacity": ("mlp", dict(k=1, capacity_factor=0.5, noisy_gate_policy="Jitter")),
    "top1_rsample_rts_swiglu": ("swiglu", dict(k=1, capacity_factor=0.5, noisy_gate_policy="RSample")),
    "top1_jitter_dropless_recompute": ("swiglu", dict(k=1, drop_tokens=False, noisy_gate_policy="Jitter",
                                                      recompute=True)),
    "top2_sampling_capacity": ("swiglu", dict(k=2, capacity_factor=0.5)),
    "top2_sampling_dropless_recompute_jitter": ("mlp", dict(k=2, drop_tokens=False, recompute=True,
                                                            noisy_gate_policy="Jitter")),
    "top4_jitter_capacity": ("mlp", dict(k=4, capacity_factor=0.5, noisy_gate_policy="Jitter")),
}


def ds_layer(expert, **kw):
    pytest.importorskip("deepspeed")
    from turbomoe.integrations import deepspeed as tds
    torch.manual_seed(1)
    make = {"mlp": lambda: nn.Sequential(nn.Linear(M, FF), nn.GELU(), nn.Linear(FF, M)),
            "swiglu": lambda: tds.SwiGLUExpert(M, FF)}[expert]
    layer = tds.MoE(expert=make(), hidden_size=M, num_experts=E, min_capacity=0, **kw)
    with torch.no_grad():  # experts unlike each other
        for p in layer.deepspeed_moe.experts.parameters():
            p.add_(torch.randn_like(p), alpha=0.3)
    return layer.train()


class Checkpointed(nn.Module):
    def __init__(self, inner, mode):
        super().__init__()
        self.inner, self.mode = inner, mode

    def forward(self, x):
        return self.inner(x) if self.mode == "eager" else checkpoint(self.inner, x, use_reentrant=self.mode == "reentrant")


def ds_step(layer, x, mode, seed=5):
    xi = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out, l_aux, counts = Checkpointed(layer, mode)(xi)
    (out.square().sum() + l_aux).backward()
    got = [out.detach(), l_aux.detach(), counts, xi.grad] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return got + [torch.get_rng_state()]


@pytest.mark.parametrize("case", sorted(DS_CASES))
def test_deepspeed_random_gating_same_bits_under_checkpoints(case):
    """The drop-in's draws (RSample's Gumbel noise, Jitter's uniforms, top-2's sampled second expert,
    RTS's uniforms) come from torch's generator, restored by checkpointing: both kinds give the eager
    step's bits and leave the generator where it does; two eager steps from one seed repeat."""
    expert, kw = DS_CASES[case]
    layer = ds_layer(expert, **kw)
    x = torch.randn(40, M) + 1.0  # skewed router: over-full experts where there is a capacity
    want = ds_step(layer, x, "eager")
    assert_same(want, ds_step(layer, x, "eager"), "repeat")
    assert not torch.equal(want[0], ds_step(layer, x, "eager", seed=6)[0])  # the draws matter
    for mode in MODES[1:]:
        assert_same(want, ds_step(layer, x, mode), mode)


@pytest.mark.parametrize("case", ["swiglu_dropless_recompute", "mlp_capacity", "swiglu_rts"])
def test_deepspeed_fused_accumulation_under_checkpoints(case):
    """The drop-in's fused_grad_accumulation (gradients added into the per-expert .grad inside the
    weight-gradient GEMM) over three micro-batches under each checkpoint kind: the plain layer's bits."""
    expert, kw = {"swiglu_dropless_recompute": ("swiglu", dict(k=2, drop_tokens=False, recompute=True)),
                  "mlp_capacity": ("mlp", dict(k=2, capacity_factor=1.0)),
                  "swiglu_rts": ("swiglu", dict(k=1, capacity_factor=0.5, use_rts=True))}[case]
    fused = ds_layer(expert, fused_grad_accumulation=True, **kw)
    plain = ds_layer(expert, **kw)
    for mode in MODES:
        for layer in (fused, plain):
            layer.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(3)
        for mb in range(3):
            x = torch.randn(20, M, generator=gen)
            for layer, m in ((fused, mode), (plain, "eager")):
                xi = x.clone().requires_grad_()
                torch.manual_seed(mb)
                out, aux, _ = Checkpointed(layer, m)(xi)
                (out.square().sum() + aux).backward()
        for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
            assert torch.equal(p.grad, q.grad), (mode, name)


# ---------------------------------------------------------------------------------------------
# Faults this review found (fixed): state a replay must not touch
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant-no-early-stop"])
def test_expert_load_after_backward_is_the_last_forwards(mode):
    """A checkpoint's replay of micro-batch 1 in backward left its counts in expert_load, not those of
    the last forward (micro-batch 2's) as without checkpointing."""
    torch.manual_seed(0)
    layer = MoELayer(8, 6, 4, 2, dtype=F64)
    x1, x2 = torch.randn(10, 8, dtype=F64), torch.randn(10, 8, dtype=F64) * 3 + 1

    def two_forwards_one_backward(m):
        outs = [call(layer, x.clone().requires_grad_(), m) for x in (x1, x2)]
        after_forwards = layer.expert_load.clone()
        sum(out.square().sum() + aux for out, aux in outs).backward()
        return after_forwards, layer.expert_load.clone()

    layer(x1)
    first = layer.expert_load.clone()
    want_fwd, want = two_forwards_one_backward("eager")
    assert torch.equal(want_fwd, want) and not torch.equal(first, want)  # mb1 and mb2 load the experts differently
    with set_checkpoint_early_stop(mode == "reentrant"):
        got_fwd, got = two_forwards_one_backward("reentrant" if mode == "reentrant" else "non-reentrant")
    assert torch.equal(got_fwd, want)
    assert torch.equal(got, want), (got.tolist(), want.tolist(), first.tolist())


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_expert_bias_update_between_forward_and_backward(mode):
    """The replay routes with the bias as it is at backward: updated since the forward, it would give
    another step's gradients silently. The router refuses, naming the order; after the backward the
    update is what it was, and the next step is eager's."""
    torch.manual_seed(0)
    layer = MoELayer(8, 6, 4, 2, expert_bias=True, score_func="sigmoid", dtype=F64)
    x = torch.randn(40, 8, dtype=F64)

    def step(m):
        layer.zero_grad(set_to_none=True)
        with torch.no_grad():
            layer.router.expert_bias.zero_()
        xi = x.clone().requires_grad_()
        out, aux = call(layer, xi, m)
        if update_before_backward:
            layer.router.update_expert_bias(layer.expert_load, 1e-3)
        (out.square().sum() + aux).backward()
        if not update_before_backward:
            layer.router.update_expert_bias(layer.expert_load, 1e-3)
        return [out.detach(), xi.grad, layer.router.expert_bias.clone()] + [p.grad for p in layer.parameters()]

    update_before_backward = False
    want = step("eager")
    assert want[2].abs().sum() > 0  # the update moved the bias
    assert_same(want, step(mode), mode)
    update_before_backward = True
    assert_same(want, step("eager"))  # eager keeps no replay: the order does not matter there
    with pytest.raises(RuntimeError, match="update_expert_bias after the backward"):
        step(mode)


def test_deepspeed_recompute_does_not_rerun_global_forward_hooks():
    """The remade activation called the experts' nn.GELU module in backward, so global module hooks
    (ModuleTracker's, loggers') ran again there; the grouped path runs its forward, as its Linears skip
    global hooks too."""
    from torch.nn.modules import module as nn_module
    counts = {}
    for recompute in (False, True):
        layer = ds_layer("mlp", k=2, drop_tokens=False, recompute=recompute)
        assert layer.deepspeed_moe.expert_fast_path == "mlp"
        calls = []
        handle = nn_module.register_module_forward_hook(
            lambda mod, args, out: calls.append(torch.is_grad_enabled()) if isinstance(mod, nn.GELU) else None)
        try:
            x = torch.randn(10, M, requires_grad=True)
            out, aux, _ = layer(x)
            (out.square().sum() + aux).backward()
        finally:
            handle.remove()
        counts[recompute] = calls
    assert counts[True] == counts[False] == [], counts
