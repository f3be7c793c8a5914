"""The spec itself: DeepSpeed's formulas, drop-policy semantics, dropless layout, RTS statistics."""
import pytest
import torch
import torch.nn.functional as F

from turbomoe import ops
from turbomoe import reference as ref

from conftest import assert_uniform, needs_cuda, rts_keep_frequencies


def deepspeed_moe():
    """DeepSpeed's sharded_moe, which the capacity and aux-loss formulas are checked against: only those
    tests skip without DeepSpeed (before, the whole spec's tests did, at import)."""
    return pytest.importorskip("deepspeed.moe.sharded_moe")


@pytest.mark.parametrize("S,E,k,cf,minc", [(128, 8, 1, 1.0, 4), (1000, 64, 2, 1.25, 0), (7, 128, 4, 2.0, 8),
                                           (33, 2, 2, 0.5, 1), (25, 2, 1, 1.2, 0), (20, 3, 1, 1.05, 0),
                                           (3000, 4, 1, 1.1, 0), (3000, 8, 2, 1.2, 0)])
def test_capacity_matches_deepspeed(S, E, k, cf, minc):
    """The drop-in's capacity is stock's _capacity, fp32 rounding included (the last four rows differ
    by one from the fp64 formula: the drop-in kept 15 tokens of 25 where stock keeps 16)."""
    ds_moe = deepspeed_moe()
    gates = torch.empty(S, E, device="meta")
    expected = int(ds_moe._capacity(gates, torch.tensor(cf * k), torch.tensor(minc)))
    assert ops.capacity(S, E, k, cf, minc, fp32=True) == ref.deepspeed_capacity(S, E, k, cf, minc) == expected
    assert abs(ref.capacity(S, E, k, cf, minc) - expected) <= 1


def test_deepspeed_capacity_random_configs():
    """Stock's capacity over seeded random configs, from a few tokens to 2^31, factors 0.01-4."""
    ds_moe = deepspeed_moe()
    g = torch.Generator().manual_seed(7)
    for _ in range(3000):
        S = int(torch.randint(0, [100, 10 ** 5, 2 ** 31][int(torch.randint(0, 3, (1, ), generator=g))], (1, ),
                              generator=g))
        E = [1, 2, 3, 7, 8, 60, 64, 128, 384][int(torch.randint(0, 9, (1, ), generator=g))]
        k = int(torch.randint(1, 9, (1, ), generator=g))
        cf = float(torch.rand((), generator=g, dtype=torch.float64)) * 4 + 0.01
        expected = int(ds_moe._capacity(torch.empty(S, E, device="meta"), torch.tensor(cf * k), torch.tensor(0)))
        assert ref.deepspeed_capacity(S, E, k, cf) == expected, (S, E, k, cf)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("S,E", [(256, 8), (100, 16), (9, 4)])
def test_aux_loss_matches_deepspeed(S, E, k):
    ds_moe = deepspeed_moe()
    logits = torch.randn(S, E)
    ours = ref.topk_gating(logits, k).aux_loss
    if k == 1:
        l_aux = ds_moe.top1gating(logits, 100.0, 0, use_rts=False)[0]
    elif k == 2:
        l_aux = ds_moe.top2gating(logits.clone(), 100.0, 0, top2_2nd_expert_sampling=False)[0]
    else:
        l_aux = ds_moe.topkgating(logits, k, 100.0, 0)[0]
    torch.testing.assert_close(ours, l_aux, rtol=1e-5, atol=1e-6)


def test_gating_outputs_and_z_loss():
    logits = torch.randn(50, 6, dtype=torch.float64)
    g = ref.topk_gating(logits, 3, renormalize=True)
    probs = torch.softmax(logits, 1)
    top = torch.topk(probs, 3, dim=1)
    assert torch.equal(g.expert_ids.long(), top.indices)
    torch.testing.assert_close(g.scores, top.values / top.values.sum(1, keepdim=True))
    assert torch.equal(g.counts.long(), torch.bincount(top.indices.flatten(), minlength=6))
    torch.testing.assert_close(g.z_loss, (torch.logsumexp(logits, 1)**2).mean())


def test_ties_go_to_lower_expert():
    logits = torch.zeros(3, 5)
    assert ref.topk_gating(logits, 2).expert_ids.tolist() == [[0, 1]] * 3


def test_bias_steers_choice_not_score():
    logits = torch.randn(20, 4)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    g = ref.topk_gating(logits, 1, score_func="sigmoid", selection_bias_E=bias)
    assert (g.expert_ids == 3).all()
    torch.testing.assert_close(g.scores[:, 0], torch.sigmoid(logits[:, 3]))


def test_position_policy_first_choices_before_second():
    # Every token picks expert 0 first and expert 1 second, except token 3 which picks 1 first.
    ids = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]], dtype=torch.int32)
    s = ref.assign_slots(ids, torch.rand(4, 2), 2, capacity=2, drop_policy="position")
    # Expert 1: token 3's first choice comes before every second choice, then token 0's second.
    kept = s.slots >= 0
    assert kept.tolist() == [[True, True], [True, False], [False, False], [True, False]]
    assert s.kept_counts.tolist() == [2, 2]
    # Kept routes are placed in token order: expert 1 holds token 0 then token 3.
    assert s.slots.tolist() == [[0, 2], [1, -1], [-1, -1], [3, -1]]


def test_probs_policy_keeps_highest_scores():
    ids = torch.zeros(6, 1, dtype=torch.int32)
    scores = torch.tensor([[0.1], [0.9], [0.5], [0.7], [0.2], [0.8]])
    s = ref.assign_slots(ids, scores, 1, capacity=3, drop_policy="probs")
    assert (s.slots[:, 0] >= 0).tolist() == [False, True, False, True, False, True]
    assert s.slots[:, 0].tolist() == [-1, 0, -1, 1, -1, 2]


def test_dropless_is_expert_contiguous_in_token_order():
    ids = torch.randint(0, 5, (40, 3), dtype=torch.int32)
    s = ref.assign_slots(ids, torch.rand(40, 3), 5)
    flat = s.slots.flatten()
    assert sorted(flat.tolist()) == list(range(120))
    order = torch.argsort(flat)
    experts = ids.flatten()[order]
    assert torch.all(experts[1:] >= experts[:-1])  # expert-contiguous
    routes = order.view(-1)
    for e in range(5):
        r = routes[experts == e]
        assert torch.all(r[1:] > r[:-1])  # token order within an expert
    assert s.kept_counts.tolist() == torch.bincount(ids.flatten().long(), minlength=5).tolist()


def test_hash32_tensor_and_int_agree():
    xs = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF]
    assert ref.hash32(torch.tensor(xs, dtype=torch.int64)).tolist() == [ref.hash32_int(x) for x in xs]
    # A bijection on 32 bits: no collisions over a range.
    assert torch.unique(ref.hash32(torch.arange(1 << 16))).numel() == 1 << 16


def test_rts_seed_determines_choice():
    ids = torch.zeros(64, 1, dtype=torch.int32)
    a = ref.assign_slots(ids, torch.rand(64, 1), 1, 16, "rts", seed=1).slots
    b = ref.assign_slots(ids, torch.rand(64, 1), 1, 16, "rts", seed=1).slots
    c = ref.assign_slots(ids, torch.rand(64, 1), 1, 16, "rts", seed=2).slots
    assert torch.equal(a, b) and not torch.equal(a >= 0, c >= 0)


def test_rts_keeps_uniform_random_subsets():
    freq = rts_keep_frequencies(ref.assign_slots, 64, 16, 600)
    assert_uniform(freq, 16 / 64, 600)


def test_reference_scatter_gather_roundtrip():
    x = torch.randn(10, 4, dtype=torch.float64)
    ids = torch.randint(0, 3, (10, 2), dtype=torch.int32)
    ids[:, 1] = (ids[:, 0] + 1) % 3
    scores = torch.rand(10, 2, dtype=torch.float64)
    s = ref.assign_slots(ids, scores, 3)
    out = ref.gather_tokens(ref.scatter_tokens(x, s.slots, s.num_rows), s.slots, scores)
    torch.testing.assert_close(out, x * scores.sum(1, keepdim=True))
    # The one-hot einsum formulation gives the same combine.
    onehot = F.one_hot(s.slots.long(), s.num_rows).double()  # [S, k, R]
    buf = torch.einsum("skr,sm->rm", onehot, x)
    torch.testing.assert_close(ref.scatter_tokens(x, s.slots, s.num_rows), buf)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_gumbel_noise_is_torch_distributions_gumbel(device):
    """The same uniforms give the same noise, bit for bit, as Gumbel(0, 1).rsample (DeepSpeed's
    gumbel_rsample) draws after the same seed."""
    gumbel = torch.distributions.gumbel.Gumbel(torch.tensor(0.0, device=device), torch.tensor(1.0, device=device))
    for seed, shape in ((0, (257, 8)), (1, (33, 64)), (2, (5, 3))):
        torch.manual_seed(seed)
        expected = gumbel.rsample(shape)
        torch.manual_seed(seed)
        assert torch.equal(ref.gumbel_noise(torch.rand(shape, device=device)), expected)


def test_second_expert_is_noisy_argmax_without_first():
    torch.manual_seed(0)
    S, E = 300, 6
    logits = torch.randn(S, E, dtype=torch.float64)
    logits[3] = float("nan")  # routes nowhere: no second either
    first = ref.topk_gating(logits, 1)
    rand = torch.rand(S, E)
    ids, scores, counts = ref.second_expert(logits, first.expert_ids, first.scores, first.counts, rand)
    noisy = logits + ref.gumbel_noise(rand).double()
    for s in (0, 1, 299):
        others = [e for e in range(E) if e != int(ids[s, 0])]
        assert int(ids[s, 1]) == max(others, key=lambda e: (float(noisy[s, e]), -e))
    assert ids[3].tolist() == [-1, -1] and scores[3].tolist() == [0.0, 0.0]
    assert (ids[:, 0] != ids[:, 1])[torch.arange(S) != 3].all()
    probs = torch.softmax(logits, 1)
    ok = ids[:, 1] >= 0
    torch.testing.assert_close(scores[ok, 1], probs[ok].gather(1, ids[ok, 1:].long()).squeeze(1))
    assert torch.equal(counts, torch.bincount(ids[ids >= 0].long(), minlength=E).to(torch.int32))


@pytest.mark.parametrize("S,E", [(0, 4), (1, 2), (9, 1), (300, 6), (40, 64)])
def test_second_by_logits_is_the_best_other_logit(S, E):
    """ops.second_by_logits (the reference: rand None): the argmax of the logits over the experts other
    than the first choice, ties to the lower id, also where the router saturates (softmax rounds the
    others to 0: ranked by probability, the lowest id would win); its score softmax(l)[second] with
    that gradient (gradcheck); a row with a NaN routes nowhere; E = 1 routes to the one expert twice,
    as stock's top-2; S = 0."""
    gen = torch.Generator().manual_seed(S + E)
    logits = torch.randn(S, E, generator=gen, dtype=torch.float64)
    if S >= 9:
        logits[1] = torch.arange(E, dtype=torch.float64) * -300.0  # saturated: e = 1 is second by logits
        logits[2, :] = 0.5  # all equal: first 0, second 1
        logits[3, 0] = float("nan")
        logits[4, :] = torch.round(logits[4] * 2) / 2  # a coarse grid: ties among the others
    first = ops.topk_gating(logits, 1, backend="reference")
    g = ops.second_by_logits(logits, first, backend="reference")
    assert g.expert_ids.shape == (S, 2) and g.aux_loss is first.aux_loss and g.z_loss is first.z_loss
    for s in range(S):
        row = logits[s].tolist()
        if any(v != v for v in row):
            assert g.expert_ids[s].tolist() == [-1, -1] and g.scores[s].tolist() == [0.0, 0.0]
            continue
        f = int(g.expert_ids[s, 0])
        others = [e for e in range(E) if e != f] or [f]
        assert int(g.expert_ids[s, 1]) == max(others, key=lambda e: (row[e], -e)), (s, row)
        assert g.scores[s, 1].item() == pytest.approx(torch.softmax(logits[s], 0)[g.expert_ids[s, 1]].item(),
                                                       rel=1e-12, abs=1e-300)
    if S >= 9 and E >= 2:
        assert g.expert_ids[1].tolist() == [0, 1] and g.expert_ids[2].tolist() == [0, 1]
    routed = g.expert_ids[g.expert_ids >= 0].long()
    assert torch.equal(g.counts, torch.bincount(routed, minlength=E).to(torch.int32))
    if S:  # fresh logits without ties: a tie's choice flips under gradcheck's steps
        fresh = torch.randn(min(S, 12), E, generator=gen, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(
            lambda l: ops.second_by_logits(l, ops.topk_gating(l, 1, backend="reference"), backend="reference").scores,
            (fresh, ))


@pytest.mark.parametrize("score_func", ref.SCORE_FUNCS)
@pytest.mark.parametrize("renormalize", [False, True])
def test_gating_gradients_by_gradcheck(score_func, renormalize):
    """The spec's backward, which the kernels' is held to: the scores, aux and z losses of topk_gating
    by gradcheck in fp64 (renormalised, the gradient is written by hand: reference.renormalize_chosen),
    fresh data with a selection bias and a row of NaN logits (no gradient), S < E, one hot expert with
    empty ones, and S = 0 (losses 0, an empty gradient)."""
    gen = torch.Generator().manual_seed(len(score_func) + renormalize)
    for S, E, k, kind in ((9, 5, 3, "bias"), (3, 8, 2, "random"), (6, 4, 2, "hot"), (0, 4, 2, "random")):
        logits = torch.randn(S, E, generator=gen, dtype=torch.float64)
        bias = torch.rand(E, generator=gen, dtype=torch.float64) * 0.2 if kind == "bias" else None
        if kind == "bias":
            logits[4, 1] = float("nan")
        if kind == "hot":
            logits[:, 0] = logits.max(1).values + 1.0  # every token's first choice
        logits.requires_grad_()

        def gating(l):
            g = ref.topk_gating(l, k, score_func, renormalize, bias)
            return g.scores, g.aux_loss, g.z_loss
        assert torch.autograd.gradcheck(gating, (logits, ))
        if kind == "hot":
            assert (ref.topk_gating(logits, k).expert_ids[:, 0] == 0).all()
        scores, aux, z = gating(logits)
        (scores.sum() + aux + z).backward()
        if kind == "bias":
            assert (logits.grad[4] == 0).all() and (scores[4] == 0).all() and torch.isfinite(logits.grad).all()
        if S == 0:
            assert aux.item() == 0 and z.item() == 0 and logits.grad.shape == (0, E)


def test_second_expert_gradients_by_gradcheck():
    """The sampled second expert's score p2 = p1 exp(l2 - l1) by gradcheck in the logits and p1 (the
    cuda kernel's backward is held to it: test_ops_triton.py), with a row that routes nowhere; and
    chained from top-1 gating (p1 = softmax(l)[first]) its gradient is that of softmax(l)[second]."""
    gen = torch.Generator().manual_seed(11)
    S, E = 7, 5
    logits = torch.randn(S, E, generator=gen, dtype=torch.float64)
    logits[2, 3] = float("inf")  # routes nowhere: no second choice, no gradient
    rand = torch.rand(S, E, generator=gen)
    first = ref.topk_gating(logits, 1)
    p1 = first.scores.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda l, p: ref.second_expert(l, first.expert_ids, p, first.counts, rand)[1],
        (logits.clone().requires_grad_(), p1))
    la = logits.clone().requires_grad_()
    g = ops.sample_second_expert(la, ops.topk_gating(la, 1, backend="reference"), rand, backend="reference")
    w = torch.randn(S, 2, generator=gen, dtype=torch.float64)
    (g.scores * w).sum().backward()
    lb = logits.clone().requires_grad_()
    finite = torch.isfinite(logits).all(1, keepdim=True)
    probs = torch.softmax(torch.where(finite, lb, 0.0), 1)
    want = torch.where(finite, probs.gather(1, g.expert_ids.long().clamp_min(0)), 0.0)
    (want * w).sum().backward()
    assert g.expert_ids[2].tolist() == [-1, -1] and (g.expert_ids[:, 0] != g.expert_ids[:, 1])[finite[:, 0]].all()
    torch.testing.assert_close(g.scores, want.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(la.grad, lb.grad, rtol=1e-12, atol=1e-15)
    assert (la.grad[2] == 0).all()
