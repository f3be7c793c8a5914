"""The DeepSpeed drop-in against stock's MoE at edges the earlier reviews did not reach (float64
layers, stock's router in fp32 either way; single process)."""
import pytest
import torch

pytest.importorskip("deepspeed")
from test_deepspeed_fidelity import M, assert_same, make_pair, run  # noqa: E402

D = torch.float64


@pytest.mark.parametrize("expert", ["mlp", "swiglu", "custom"])
@pytest.mark.parametrize("sampling", [True, False])
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_top2_with_one_expert_runs_as_stock(expert, sampling, drop_tokens):
    """Stock's top-2 gating takes num_experts=1 (MoE's default): both routes go to the one expert,
    each weighing 1/2, and the sampled second expert's Gumbel noise is drawn all the same. The
    drop-in refused it in its constructor (ValueError: k must be in [1, num_experts 1])."""
    stock, turbo = make_pair(expert, dtype=D, num_experts=1, k=2, top2_2nd_expert_sampling=sampling,
                             drop_tokens=drop_tokens)
    x = torch.randn(2, 5, M, dtype=D)
    results, next_draws = [], []
    for layer in (stock, turbo):
        results.append(run(layer, x))
        next_draws.append(torch.rand(4))  # the generator left where stock leaves it
    assert_same(*results, 1e-6)
    assert results[1][2].tolist() == [20]
    assert torch.equal(*next_draws)
