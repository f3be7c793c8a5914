"""MoELayer(recompute=True): the same bits as without, the rows and activation remade (reference
backend on the CPU, float64 and float32), inactive under an outer saved-tensor policy (checkpointing),
and on a GPU the memory it saves."""
import pytest
import torch
import torch.utils.checkpoint

from conftest import needs_cuda
from recompute_cases import CASES, check_recompute
from turbomoe.nn import MoELayer
from turbomoe.nn import recompute as rc
from turbomoe.nn.recompute import remake_for


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_recompute_same_bits(case, dtype):
    check_recompute(*case, dtype)


def test_recompute_steps_aside_for_checkpointing():
    """Under torch.utils.checkpoint the outer policy saves nothing of the layer and recomputes it
    whole; recompute=True then installs no hooks of its own, and the gradients are those without."""
    torch.manual_seed(0)
    plain = MoELayer(8, 12, 4, 2, dtype=torch.float64)
    again = MoELayer(8, 12, 4, 2, recompute=True, dtype=torch.float64)
    again.load_state_dict(plain.state_dict())
    x = torch.randn(10, 8, dtype=torch.float64)
    made = []
    remake_for = rc.remake_for
    rc.remake_for = lambda enabled: made.append(remake_for(enabled)) or made[-1]
    grads = []
    try:
        for layer in (plain, again):
            xi = x.clone().requires_grad_()
            out, aux = torch.utils.checkpoint.checkpoint(layer, xi, use_reentrant=False)
            (out.square().sum() + aux).backward()
            grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    finally:
        rc.remake_for = remake_for
    # plain: asked for nothing; again: its forward and the recomputation, under checkpoint's hooks
    assert made == [None, None, None, None]
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_recompute_only_where_asked_with_autograd():
    with torch.no_grad():
        assert remake_for(True) is None
    assert remake_for(False) is None
    assert remake_for(True) is not None


@pytest.mark.parametrize("scope", ["module", "global"])
def test_recompute_keeps_rows_a_hook_sees(scope):
    """A forward hook that keeps the experts' input can read it after the step: the rows are then not
    freed after the first GEMM (freed, a read of them is unchecked), and the results are the same bits."""
    torch.manual_seed(3)
    plain = MoELayer(16, 24, 4, 2)
    again = MoELayer(16, 24, 4, 2, recompute=True)
    again.load_state_dict(plain.state_dict())
    x = torch.randn(10, 16)
    kept = []

    def keep(module, args, out):
        if module is again.experts:
            kept.append(args[0])

    handle = (again.experts.register_forward_hook(keep) if scope == "module"
              else torch.nn.modules.module.register_module_forward_hook(keep))
    try:
        results = []
        for layer in (plain, again):
            xi = x.clone().requires_grad_()
            out, aux = layer(xi)
            (out.square().sum() + aux).backward()
            results.append([out, xi.grad] + [p.grad for p in layer.parameters()])
    finally:
        handle.remove()
    for a, b in zip(*results):
        assert torch.equal(a, b)
    rows = kept[0]
    assert rows.untyped_storage().nbytes() == rows.numel() * rows.element_size() > 0
    assert torch.isfinite(rows).all()


def test_recompute_type_checked():
    with pytest.raises(TypeError, match="recompute"):
        MoELayer(8, 12, 4, 2, recompute="yes")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(8192, 2048, 768, 128, 8), (8192, 2048, 1408, 64, 6)])
def test_recompute_saves_memory_on_the_gpu(shape):
    """Qwen3-30B-A3B's and DeepSeek-V2-Lite's layer shapes, bf16: the peak of forward + backward drops
    by at least 90% of the rows and activation, R * (M + F) * 2 bytes, and the bits are the same."""
    S, M, F, E, k = shape
    peaks, grads = [], []
    for recompute in (False, True):
        torch.manual_seed(0)
        layer = MoELayer(M, F, E, k, recompute=recompute, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(S, M, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out, aux = layer(x)
        (out.float().square().mean() + aux).backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        grads.append([x.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    R = S * k
    assert peaks[0] - peaks[1] >= 0.9 * R * (M + F) * 2, (peaks, R * (M + F) * 2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(8192, 2048, 768, 128, 8), (8192, 2048, 1408, 64, 6)])
@pytest.mark.parametrize("recompute", [False, True])
def test_what_the_forward_keeps_on_the_gpu(shape, recompute):
    """What the forward keeps for backward at Qwen3-30B-A3B's and DeepSeek-V2-Lite's layer shapes,
    bf16 (allocated after the forward, its outputs not counted): the first GEMM's output h [R, 2F],
    and without recompute the expert rows [R, M] and the activation [R, F]; no expert output y
    [R, M] (the scores are taken in the activation); 32 MiB left for the router and the tables."""
    S, M, F, E, k = shape
    torch.manual_seed(0)
    layer = MoELayer(M, F, E, k, recompute=recompute, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(S, M, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sum(layer(x)).sum().backward()  # a step first: cuBLAS's and the GEMMs' workspaces are allocated once, kept
    x.grad = None
    layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out, aux = layer(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base - out.numel() * out.element_size() - aux.element_size()
    R = S * k
    want = R * 2 * F * 2 + (0 if recompute else R * (M + F) * 2)
    assert want <= held <= want + 32 * 2 ** 20, (held / 2 ** 20, want / 2 ** 20)
