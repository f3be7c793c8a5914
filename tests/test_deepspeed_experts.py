"""The DeepSpeed drop-in's local experts after the layer is built: moved, shared, hooked, swapped or
wrapped (turbomoe.integrations.deepspeed_experts, pack_expert_params), against stock in float64."""
import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")
import deepspeed.moe.layer as ds_layer  # noqa: E402

from conftest import rel_err  # noqa: E402
from turbomoe.integrations import deepspeed as tds  # noqa: E402
from turbomoe.integrations.deepspeed_experts import stack_expert_tensors  # noqa: E402

M, F, E = 16, 24, 4


def mlp():
    return nn.Sequential(nn.Linear(M, F), nn.GELU(), nn.Linear(F, M))


def make_pair(expert=mlp, **kw):
    """Stock and turbomoe layers on the same float64 weights, each expert its own."""
    kw = dict(dict(hidden_size=M, num_experts=E, k=2, min_capacity=0, capacity_factor=float(E)), **kw)
    stock = ds_layer.MoE(expert=expert(), **kw).double()
    with torch.no_grad():
        for p in stock.parameters():
            p.add_(torch.randn_like(p), alpha=0.3)
    turbo = tds.MoE(expert=expert(), **kw).double()
    turbo.load_state_dict(stock.state_dict())
    return stock, turbo


def run(layer, x, seed=5):
    """Forward + backward under a fixed seed: (out, x's gradient, every parameter's gradient)."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    out, l_aux, _ = layer(x)
    (out.square().sum() + l_aux).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def assert_same(a, b, tol=1e-6):
    # tol: the router's logits are fp32 in both layers (stock's gate runs in fp32)
    assert a[2].keys() == b[2].keys()
    for name, got, want in [("out", b[0], a[0]), ("dx", b[1], a[1])] + [(n, b[2][n], a[2][n]) for n in a[2]]:
        assert rel_err(got, want) < tol, (name, rel_err(got, want))


def local_experts(layer):
    return layer.deepspeed_moe.experts.deepspeed_experts


@pytest.mark.parametrize("expert", [mlp, lambda: tds.SwiGLUExpert(M, F)])
def test_share_memory_and_moves_that_change_nothing_keep_the_experts_storage(expert):
    """share_memory() puts the experts in shared memory as stock's (before: packed again into private
    memory, so another process's updates were not seen); a .to() that changes nothing keeps their
    storage; a real move packs them again (the stacked weight a view) with the same results."""
    stock, turbo = make_pair(expert)
    turbo.share_memory()
    assert all(p.is_shared() for p in local_experts(turbo).parameters())
    first = next(local_experts(turbo).parameters())
    ptr = first.data_ptr()
    turbo.to("cpu", torch.float64)
    assert first.data_ptr() == ptr
    stock.float(), turbo.float()
    blocks = [[next(e.parameters())] for e in local_experts(turbo)]
    assert stack_expert_tensors(blocks).untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    stock.double(), turbo.double()
    x = torch.randn(32, M, dtype=torch.float64)
    assert_same(run(stock, x), run(turbo, x))


def test_backward_pre_hooks_on_experts_run():
    """A full backward pre-hook on an expert, or on its Linear, sees the gradients stock's sees, up to
    the rows' order within the capacity (the grouped path skipped them: they never ran)."""
    stock, turbo = make_pair()
    x = torch.randn(32, M, dtype=torch.float64)
    seen = {}
    for name, layer in (("stock", stock), ("turbo", turbo)):
        seen[name] = hooked = {}
        local = local_experts(layer)
        for key, module in (("expert 1", local[1]), ("expert 2's fc2", local[2][2])):
            module.register_full_backward_pre_hook(lambda m, g, key=key, hooked=hooked: hooked.update({key: g[0]}))
    assert_same(run(stock, x), run(turbo, x))
    assert seen["turbo"].keys() == seen["stock"].keys() == {"expert 1", "expert 2's fc2"}

    def row_norms(g):
        return g.reshape(-1, g.shape[-1]).norm(dim=1).sort().values
    for key, want in seen["stock"].items():
        assert rel_err(row_norms(seen["turbo"][key]), row_norms(want)) < 1e-6


class LoRALinear(nn.Module):
    """A Linear wrapped as PEFT wraps it: the base layer's weight and bias still reachable as
    .weight and .bias, plus a trained low-rank term."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_experts_wrapped_or_swapped_after_a_forward_run_as_they_are_now():
    """After a first forward (the structure checked and the module tree walked), each expert's first
    Linear wrapped in a LoRA module (as PEFT does, by assignment): the results and every gradient,
    the LoRA weights' included, are stock's (the grouped path went on with the base weights alone: the
    output 100% off, no LoRA gradient). Then an expert swapped for a new one with a forward hook: the
    hook runs."""
    stock, turbo = make_pair()
    x = torch.randn(32, M, dtype=torch.float64)
    assert_same(run(stock, x), run(turbo, x))
    for layer in (stock, turbo):
        torch.manual_seed(7)
        for e in local_experts(layer):
            e[0] = LoRALinear(e[0])
    want, got = run(stock, x), run(turbo, x)
    assert any("lora_A" in n for n in want[2])
    assert_same(want, got)

    calls = []
    for layer in (stock, turbo):
        torch.manual_seed(8)
        local_experts(layer)[3] = mlp().double()
        local_experts(layer)[3].register_forward_hook(lambda m, i, o: calls.append(o.shape))
    assert_same(run(stock, x), run(turbo, x))
    assert len(calls) == 2


def test_assignment_count_makes_no_recompile():
    """The drop-in counts module assignments through torch's global registration hook. A compiled
    model that makes a module in its forward (transformers' decoder slices its ModuleList each call)
    recompiled on every call while the hook changed the global under dynamo, until the recompile
    limit (transformers' static-cache compiled generate fell to eager speed after importing turbomoe)."""
    from torch._dynamo.utils import counters

    class Sliced(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers[:2]:
                x = layer(x)
            return x

    torch._dynamo.reset()
    counters.clear()
    model = Sliced()
    compiled = torch.compile(model, backend="eager")
    for _ in range(4):
        x = torch.randn(2, 4)
        torch.testing.assert_close(compiled(x), model(x))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU(approximate="tanh"), nn.ReLU(), nn.Tanh()], ids=repr)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_mlp_experts_of_every_activation_match_stock(act, bias, drop_tokens):
    """The grouped mlp path: a first bias with nn.GELU (either form) runs in one bias_act pass, any other
    activation or no first bias as the bias's pass then the module's forward; all as stock's."""
    stock, turbo = make_pair(lambda: nn.Sequential(nn.Linear(M, F, bias=bias), act, nn.Linear(F, M)),
                             drop_tokens=drop_tokens, capacity_factor=1.0)
    assert turbo.deepspeed_moe.expert_fast_path == "mlp"
    x = torch.randn(23, M, dtype=torch.float64)
    assert_same(run(stock, x), run(turbo, x))
