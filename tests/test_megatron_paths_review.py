"""Review of the Megatron paths: turbomoe's Megatron-core dispatcher over expert-parallel ranks that route
different token counts (tests/megatron_ep_review_script.py, two gloo ranks), its experts under
Megatron's moe_act recompute, and scripts/megatron_deepspeed.py's layer timing refusing what it would not
apply."""
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from megatron.core.transformer.spec_utils import build_module  # noqa: E402

from launching import ROOT, deepspeed_launch, launcher_env  # noqa: E402
from megatron_common import experts_as_stock, model_parallel  # noqa: E402
from megatron_review_script import config, stock_on_cpu  # noqa: E402
from turbomoe.integrations import megatron as tm  # noqa: E402


@pytest.fixture(scope="module")
def parallel_state():
    with model_parallel("gloo"):
        yield


def _script_module():
    spec = importlib.util.spec_from_file_location("megatron_deepspeed", os.path.join(ROOT, "scripts",
                                                                                     "megatron_deepspeed.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layer_timing_refuses_expert_parallelism():
    """The layer timing builds both layers with ep_size 1 in one process: --moe-expert-parallel-size 2 was
    accepted and the table then timed ep 1. Refused before Megatron-DeepSpeed is imported."""
    with pytest.raises(SystemExit, match="--moe-expert-parallel-size 2"):
        _script_module().bench_layer(["--experts", "4", "--moe-expert-parallel-size", "2", "--hidden-size", "32"])


def test_expert_parallel_ranks_with_different_token_counts():
    """Capacity: unequal capacities refused on both ranks with the counts (before: gloo aborted a rank in
    the equal-split all-to-all); dropless with a NaN token: equal to the reference (before: all_to_all_single
    "Split sizes doesn't match total dim 0 size")."""
    proc = deepspeed_launch(os.path.join(ROOT, "tests", "megatron_ep_review_script.py"),
                            env=launcher_env(cpu=True), timeout=240)
    for rank in range(2):
        assert f"DS REVIEW PASS {rank}" in proc.stdout, proc.stdout[-4000:]


def _step(cfg, x_SBH, w_SBH):
    """Forward and backward of turbomoe's layer (seeded weights) -> output, gradients, and the shapes of
    the tensors saved for backward whose memory was freed by the end of the forward."""
    torch.manual_seed(0)
    layer = build_module(tm.get_turbomoe_moe_spec(cfg), config=cfg)
    saved = []
    x = x_SBH.clone().requires_grad_()
    with stock_on_cpu(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, _ = layer(x)
    freed = [tuple(t.shape) for t in saved if t.numel() and t.untyped_storage().size() == 0]
    with stock_on_cpu():  # Megatron's recompute restores the CUDA generator
        (out * w_SBH).sum().backward()
    return out.detach(), x.grad, layer.router.weight.grad, experts_as_stock(layer, grads=True), freed


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_moe_act_recompute_frees_the_activation(parallel_state, activation):
    """recompute_modules ["moe_act"] (GroupedMLP: the activation's output freed after fc2, recomputed in
    backward) was accepted and ignored: the [R, F] activation stayed in memory. Now freed, with the same
    output and gradients (fp64, bitwise)."""
    extra = {} if activation == "swiglu" else dict(gated_linear_unit=False, activation_func=F.gelu)
    x = torch.randn(9, 4, 32, dtype=torch.float64)
    w = torch.randn_like(x)
    plain = _step(config(**extra), x, w)
    recomputed = _step(config(moe_grouped_gemm=True, recompute_granularity="selective",
                              recompute_modules=["moe_act"], **extra), x, w)
    R, F_ = 9 * 4 * 2, 24  # T * k dropless rows, moe_ffn_hidden_size
    assert plain[4] == [] and recomputed[4] == [(R, F_)]
    for a, b in zip(plain[:3], recomputed[:3]):
        assert torch.equal(a, b)
    for name, g in plain[3].items():
        assert torch.equal(g, recomputed[3][name]), name
