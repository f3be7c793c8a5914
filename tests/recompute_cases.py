"""MoELayer(recompute=True) against recompute=False (shared by test_recompute.py and its Triton twin):
the same bits in every output and gradient, and the rows and the activation stored as recipes."""
import gc
import weakref

import torch

from turbomoe import ops
from turbomoe.nn import GroupedExperts, MoELayer
from turbomoe.nn import recompute as rc

# (S, M, F, E, k, capacity_factor, activation, bias, shared): dropless, capacity with drops, S < E,
# one token, gelu with biases, a shared expert.
CASES = [(37, 16, 24, 6, 2, None, "swiglu", False, 0), (40, 8, 12, 4, 3, 0.5, "swiglu", False, 8),
         (3, 8, 8, 8, 2, None, "gelu", True, 0), (1, 8, 16, 4, 1, 1.0, "swiglu", True, 16)]


def run(layer, x, g):
    """Outputs and gradients, and whether the expert rows were still alive between forward and backward."""
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    made = []  # weak references to the forward's expert rows and activations
    scatter, act = ops.scatter_tokens, GroupedExperts._act

    def noted(t):
        made.append(weakref.ref(t))
        return t

    def scatter_noted(*args, **kw):  # the token rows, not row_scores' one-column scatter of the scores
        out = scatter(*args, **kw)
        return noted(out) if out.shape[1] == x.shape[1] else out

    def act_noted(self, h, row_scale_R=None):
        return noted(act(self, h, row_scale_R))

    ops.scatter_tokens, GroupedExperts._act = scatter_noted, act_noted
    try:
        out, aux = layer(xi)
        gc.collect()
        alive = [r() is not None for r in made]
        (out * g).sum().add(aux).backward()
    finally:
        ops.scatter_tokens, GroupedExperts._act = scatter, act
    return [out.detach(), aux.detach(), xi.grad] + [p.grad for p in layer.parameters()], alive


def check_recompute(S, M, F, E, k, capacity_factor, activation, bias, shared, dtype, device="cpu", backend=None):
    torch.manual_seed(S * 31 + E)
    kw = dict(capacity_factor=capacity_factor, activation=activation, bias=bias, shared_ffn_hidden_size=shared,
              backend=backend, device=device, dtype=dtype)
    plain = MoELayer(M, F, E, k, **kw)
    again = MoELayer(M, F, E, k, recompute=True, **kw)
    again.load_state_dict(plain.state_dict())
    x = torch.randn(S, M, device=device, dtype=dtype)
    g = torch.randn(S, M, device=device, dtype=dtype)

    remade = []
    pack = rc.Remake._pack

    def counting_pack(self, t):
        packed = pack(self, t)
        if isinstance(packed, rc._Remade):
            remade.append(tuple(t.shape))
        return packed

    rc.Remake._pack = counting_pack
    try:
        got, alive_again = run(again, x, g)
    finally:
        rc.Remake._pack = pack
    want, alive_plain = run(plain, x, g)
    # Without recompute the backward keeps them; with it they are freed after the forward.
    assert len(alive_plain) == len(alive_again) == 2 + bool(shared)
    assert all(alive_plain) and not any(alive_again), (alive_plain, alive_again)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b), (a - b).abs().max()
    # Stored as recipes, once each: the expert rows [R, M], the activation [R, F], the shared expert's [S, F'].
    R = S * k if capacity_factor is None else E * ops.capacity(S, E, k, capacity_factor, 0)
    want_remade = [(R, M), (R, F)] + ([(S, shared)] if shared else [])
    assert sorted(remade) == sorted(want_remade), (remade, want_remade)
