"""MoELayer(recompute=True) against recompute=False (shared by test_recompute.py and its Triton twin):
the same bits in every output and gradient, and the rows and the activation stored as recipes."""
import gc
import weakref

import torch

from turbomoe import ops
from turbomoe.autograd import grouped_gemm as gg
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

    def act_noted(self, h, row_scale_R=None, bias1=None):
        return noted(act(self, h, row_scale_R, bias1))

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

    R = S * k if capacity_factor is None else E * ops.capacity(S, E, k, capacity_factor, 0)
    remade, rows_back, rows_alive, rows_fwd, rows_freed = [], [], [], [], []
    pack, unpack, mm_forward = rc.Remake._pack, rc.Remake._unpack, gg.mm_forward

    def counting_pack(self, t):
        packed = pack(self, t)
        if isinstance(packed, rc._Remade):
            remade.append(tuple(t.shape))
            if tuple(t.shape) == (R, M):
                rows_fwd.append(weakref.ref(t))
        return packed

    def noting_unpack(packed):  # the storage of the rows remade in backward (autograd hands on an alias of t)
        t = unpack(packed)
        if isinstance(packed, rc._Remade) and tuple(t.shape) == (R, M):
            rows_back.append(weakref.ref(t.untyped_storage()))
        return t

    def noting_mm(x_RK, w_GKN, *args, **kw):
        # The forward's second GEMM (no rows remade yet): the rows' memory is already free.
        if not rows_back and tuple(x_RK.shape) == (R, F) and w_GKN.shape[-1] == M:
            rows_freed.extend(r() is None or r().untyped_storage().nbytes() == 0 for r in rows_fwd)
        # The first GEMM's input gradient [R, M] of the backward.
        if rows_back and w_GKN.shape[-1] == M and x_RK.shape[0] == R:
            gc.collect()  # the Triton interpreter's launches leave their arguments in reference cycles
            rows_alive.append(any(r() is not None for r in rows_back))
        return mm_forward(x_RK, w_GKN, *args, **kw)

    rc.Remake._pack, rc.Remake._unpack, gg.mm_forward = counting_pack, staticmethod(noting_unpack), noting_mm
    try:
        got, alive_again = run(again, x, g)
    finally:
        rc.Remake._pack, rc.Remake._unpack, gg.mm_forward = pack, staticmethod(unpack), mm_forward
    assert rows_freed and all(rows_freed), rows_freed
    # The remade rows are gone before the input gradient, their size, is made (w's gradient first).
    assert rows_back and rows_alive and not any(rows_alive), rows_alive
    want, alive_plain = run(plain, x, g)
    # Without recompute the backward keeps them; with it they are freed after the forward.
    assert len(alive_plain) == len(alive_again) == 2 + bool(shared)
    assert all(alive_plain) and not any(alive_again), (alive_plain, alive_again)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b), (a - b).abs().max()
    # Stored as recipes, once each: the expert rows [R, M], the activation [R, F], the shared expert's [S, F'].
    want_remade = [(R, M), (R, F)] + ([(S, shared)] if shared else [])
    assert sorted(remade) == sorted(want_remade), (remade, want_remade)
