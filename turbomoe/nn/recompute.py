"""Saved activations remade in backward instead of kept: the cheap ones of the MoE layer.

The layer's backward needs the gathered rows x_RM [R, M] (the first GEMM's weight gradient) and the
activation a [R, F] (the second's). Both are cheap to remake: x_RM is a copy of rows of x_SM, which
the router keeps anyway, and a is swiglu/gelu of the first GEMM's output h, which the activation's
own backward keeps anyway. So rather than hold R * (M + F) more elements, a saved-tensor hook stores
how to remake each and remakes it (no grad, bit-identical: a copy, and the same kernel on the same
input) when the backward asks. The GEMMs are not recomputed. Once the first GEMM has stored the rows
as their recipe, `Remake.release` frees their memory, so that the forward's peak (rows, h, the
activation and the second GEMM's output alive at once) loses the rows too: the callers still hold
references to them until the layer's forward returns. SonicMoE's observation (ICLR 2026)
for fine-grained MoEs, where R = k * S makes these the largest saved tensors.

Eager only: under torch.compile the partitioner decides what to save (it may remake cheap ops itself),
and saved-tensor hooks are not traced.
"""
from contextlib import contextmanager
from typing import Callable, List, Optional, Tuple

import torch

from ..autograd.grouped_gemm import saved_tensor_hooks_active


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _check_version(t: torch.Tensor, version: int):
    """Autograd's own check, which it skips for tensors packed by saved-tensor hooks: a tensor saved (or
    read by a recipe) must not have been modified in place between the forward and the backward."""
    if t._version != version:
        raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an "
                           f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
                           f"expected version {version} instead (turbomoe.nn.recompute)")


class _Kept:
    """A saved tensor kept as it is, with its version at the save."""
    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor):
        self.t, self.version = t, t._version


class _Remade:
    """What a packed tensor became: the recipe to make it again, and the versions of the tensors it reads."""
    __slots__ = ("make", "reads")

    def __init__(self, make: Callable[[], torch.Tensor], reads: Tuple[torch.Tensor, ...]):
        self.make = make
        self.reads = [(t, t._version) for t in reads]


class Remake:
    """Register (tensor, how to remake it) pairs, then run the forward inside `hooks()`: any saved
    tensor that is one of them (the same view of the same storage) is stored as its recipe."""

    def __init__(self):
        self.rules: List[Tuple[torch.Tensor, Callable[[], torch.Tensor], Tuple[torch.Tensor, ...]]] = []
        self.stored: List[torch.Tensor] = []  # the registered tensors stored as recipes so far

    def add(self, t: torch.Tensor, make: Callable[[], torch.Tensor], reads: Tuple[torch.Tensor, ...]):
        """reads: the tensors make() reads that the caller's code could modify in place (their versions
        are checked when the backward remakes t, as autograd checks a kept tensor's)."""
        self.rules.append((t, make, tuple(reads)))

    def _pack(self, t: torch.Tensor):
        for src, make, reads in self.rules:
            if _same_view(t, src):
                if not any(s is src for s in self.stored):
                    self.stored.append(src)
                return _Remade(make, reads)
        return _Kept(t)

    def release(self, t: torch.Tensor):
        """Frees t's memory now if t is registered here, was stored as its recipe (so the backward
        remakes it and reads nothing of t) and owns its whole storage (no other tensor's bytes go with
        it). Nothing may read t afterwards: its storage is empty, and a read of it is not checked (it
        may crash), so callers free only tensors that no hook or user code could have kept."""
        if not any(s is t for s in self.stored):
            return
        storage = t.untyped_storage()
        if storage.nbytes() != t.numel() * t.element_size():
            return
        self.rules = [rule for rule in self.rules if rule[0] is not t]  # nothing may match it again
        storage.resize_(0)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, _Kept):
            _check_version(packed.t, packed.version)
            return packed.t
        for t, version in packed.reads:
            _check_version(t, version)
        with torch.no_grad():
            return packed.make()

    @contextmanager
    def hooks(self):
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            # Autograd keeps the hooks (so this object) with every tensor saved under them: drop the
            # tensors named here, or they would live as long as the graph, the very thing to avoid.
            self.rules.clear()
            self.stored.clear()


def replaying() -> bool:
    """Whether this forward is activation checkpointing's replay: torch's two kinds (so DeepSpeed's and
    Megatron's too) rerun the forward inside the backward pass. What a forward writes besides its
    output (the layer's expert_load) is then left as the forward wrote it. Known limits (README "Edge
    inputs and errors"): a forward that a gradient hook runs is taken for a replay too (a reentrant
    checkpoint nested in a replay runs its forward under no_grad, as such a hook would, so grad mode
    cannot tell them apart); a compiled layer inside an eager checkpoint reruns its graph, expert_load's
    write included."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def remake_for(enabled: bool) -> Optional[Remake]:
    """A Remake for this forward where recompute applies: asked for, autograd on, eager, no torch.func
    transform (its tensors have no storage to free) and no other saved-tensor hooks active (an outer
    policy such as activation checkpointing decides then)."""
    if not (enabled and torch.is_grad_enabled()) or torch.compiler.is_compiling():
        return None
    if torch._C._are_functorch_transforms_active():
        return None
    if saved_tensor_hooks_active():
        return None
    return Remake()


@contextmanager
def remaking(enabled: bool, rows: torch.Tensor, make_rows: Callable[[], torch.Tensor],
             reads: Tuple[torch.Tensor, ...]):
    """The experts' forward runs inside: where recompute applies (remake_for), the expert rows are
    stored as make_rows and the Remake is yielded for the experts to add their activations to; else
    None and nothing changes."""
    remake = remake_for(enabled)
    if remake is None:
        yield None
        return
    remake.add(rows, make_rows, reads)
    with remake.hooks():
        yield remake
