"""Bad input gets a clear Python error on every backend, never a fault or silent garbage."""
import pytest
import torch

import turbomoe
from turbomoe import ops, reference


def test_k_out_of_range():
    logits = torch.randn(4, 3)
    for k in (0, -1, 4, 9):
        with pytest.raises(ValueError, match="k must be"):
            ops.topk_gating(logits, k)
    with pytest.raises(ValueError, match="k must be"):
        ops.topk_gating(torch.randn(4, 16), 9)  # k above the supported maximum of 8
    with pytest.raises(ValueError, match="k must be"):
        ops.topk_gating(logits, 1.5)


def test_logits_must_be_2d_float():
    with pytest.raises(ValueError, match="2-D"):
        ops.topk_gating(torch.randn(2, 3, 4), 1)
    with pytest.raises(ValueError, match="2-D"):
        ops.topk_gating(torch.randn(5), 1)
    with pytest.raises(TypeError, match="float"):
        ops.topk_gating(torch.randint(0, 5, (4, 3)), 1)
    with pytest.raises(TypeError, match="torch.Tensor"):
        ops.topk_gating([[1.0, 2.0]], 1)
    with pytest.raises(ValueError, match="score_func"):
        ops.topk_gating(torch.randn(4, 3), 1, score_func="relu")


def test_selection_bias_shape_and_device():
    with pytest.raises(ValueError, match="selection_bias"):
        ops.topk_gating(torch.randn(4, 3), 1, selection_bias_E=torch.zeros(4))
    with pytest.raises(ValueError, match="different devices"):
        ops.topk_gating(torch.randn(4, 3), 1, selection_bias_E=torch.zeros(3, device="meta"))


def test_token_count_mismatch():
    x = torch.randn(5, 8)
    slots = torch.zeros(4, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="slots must be"):
        ops.scatter_tokens(x, slots, 4)
    with pytest.raises(ValueError, match="slots must be"):
        ops.gather_tokens(torch.randn(4, 8), slots, torch.rand(5, 1))
    with pytest.raises(ValueError, match="differ"):
        ops.gather_tokens(torch.randn(4, 8), slots, torch.rand(4, 2))
    with pytest.raises(ValueError, match="differ"):
        ops.assign_slots(slots, torch.rand(5, 1), 2)


def test_slots_and_num_rows():
    x = torch.randn(4, 8)
    s = reference.assign_slots(torch.zeros(4, 1, dtype=torch.int32), torch.rand(4, 1), 2, capacity=3)
    with pytest.raises(ValueError, match="num_rows is required"):
        ops.scatter_tokens(x, s.slots)
    with pytest.raises(ValueError, match="disagrees"):
        ops.scatter_tokens(x, s, 5)
    with pytest.raises(ValueError, match="num_rows"):
        ops.scatter_tokens(x, s.slots, -2)


def test_wrong_dtypes():
    with pytest.raises(TypeError, match="int32 or int64"):
        ops.scatter_tokens(torch.randn(4, 8), torch.zeros(4, 1), 4)
    with pytest.raises(TypeError, match="float"):
        ops.scatter_tokens(torch.ones(4, 8, dtype=torch.int64), torch.zeros(4, 1, dtype=torch.int32), 4)
    with pytest.raises(TypeError, match="float"):
        ops.gather_tokens(torch.randn(4, 8), torch.zeros(4, 1, dtype=torch.int32), torch.ones(4, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="int32 or int64"):
        ops.assign_slots(torch.zeros(4, 1), torch.rand(4, 1), 2)


def test_tensors_on_different_devices():
    with pytest.raises(ValueError, match="different devices"):
        ops.scatter_tokens(torch.randn(4, 8), torch.zeros(4, 1, dtype=torch.int32, device="meta"), 4)
    with pytest.raises(ValueError, match="different devices"):
        ops.gather_tokens(torch.randn(4, 8), torch.zeros(4, 1, dtype=torch.int32), torch.rand(4, 1, device="meta"))


def test_bad_capacity_arguments():
    for cf in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="capacity_factor"):
            turbomoe.capacity(16, 4, 1, cf)
    with pytest.raises(ValueError, match="capacity"):
        ops.assign_slots(torch.zeros(4, 1, dtype=torch.int32), torch.rand(4, 1), 2, capacity=-1)
    with pytest.raises(ValueError, match="drop_policy"):
        ops.assign_slots(torch.zeros(4, 1, dtype=torch.int32), torch.rand(4, 1), 2, capacity=2, drop_policy="lifo")
    with pytest.raises(ValueError, match="num_experts"):
        ops.assign_slots(torch.zeros(4, 1, dtype=torch.int32), torch.rand(4, 1), 0)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        ops.topk_gating(torch.randn(4, 3), 1, backend="cuda-magic")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logits(bad):
    logits = torch.randn(6, 4)
    logits[2, 1] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        ops.topk_gating(logits, 2, check_finite=True)
    # Default, documented behaviour: the row routes nowhere and has no gradient; others are unharmed.
    logits.requires_grad_()
    g = ops.topk_gating(logits, 2)
    assert g.expert_ids[2].tolist() == [-1, -1] and g.scores[2].tolist() == [0.0, 0.0]
    assert torch.isfinite(g.aux_loss) and torch.isfinite(g.z_loss)
    (g.scores.sum() + g.aux_loss + g.z_loss).backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[2] == 0).all()
    s = ops.assign_slots(g.expert_ids, g.scores, 4, capacity=2)
    assert (s.slots[2] == -1).all()
    out = ops.gather_tokens(torch.randn(s.num_rows, 3), s.slots, g.scores)
    assert (out[2] == 0).all() and torch.isfinite(out).all()


def test_out_of_range_expert_ids_route_nowhere():
    ids = torch.tensor([[0], [7], [-3], [1]], dtype=torch.int32)
    s = reference.assign_slots(ids, torch.rand(4, 1), 2)
    assert s.slots[:, 0].tolist() == [0, -1, -1, 1]
