"""autograd.Functions of turbomoe's ops, each with a hand-written backward.

They are written as torch.func takes them (forward without ctx, setup_context; `Function`), so
torch.func.grad and vjp (functional_call under them too) run through them. Kernels read memory,
which torch.func's wrapped tensors have none of: a forward runs on the plain tensors beneath (torch
does that for an autograd.Function), a kernel backward too (once_differentiable, kernel_backward),
and kernels outside a Function run through `plain_call`. torch.vmap (so jacrev, jacfwd) does not run
through the kernels and forward mode (jvp) not through the Functions: they raise.
"""
import functools
import inspect

import torch
from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor, is_gradtrackingtensor
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch._functorch.utils import unwrap_dead_wrappers

NOT_TWICE = ("turbomoe's kernels cannot differentiate twice (a gradient of a create_graph=True gradient "
             "through them): use backend='reference' and gmm_backend='reference' for higher derivatives")


class Function(torch.autograd.Function):
    """torch.autograd.Function as turbomoe's are written: forward takes no ctx and setup_context saves
    (torch.func needs that). apply skips torch's binding of forward's signature at each call (its
    defaults, for setup_context: a call took 26 us of host time on the CPU where the old style took 6,
    2026-12-07; with the skip 6) where every argument is given and no torch.func transform runs."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # forward's named parameters (not *args), once (not in a cache: it would keep the class and its closure)
        cls._arity = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in inspect.signature(cls.forward).parameters.values())

    @classmethod
    def apply(cls, *args):
        if torch._C._are_functorch_transforms_active() or len(args) < cls._arity:
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))

    @classmethod
    def vmap(cls, info, in_dims, *args):
        raise no_vmap(cls.__name__)

    # No jvp: forward mode raises torch's "You must implement the jvp function" (dynamo refuses to trace a
    # Function that defines one, so a clearer refusal of its own would break torch.compile).


class Kept:
    """Tensors a forward hands its setup_context to save that are not its inputs or outputs (made in
    the forward: intermediates, inputs converted). Not tensors to autograd, so they get no gradient:
    as outputs marked non-differentiable they would be handed zeros made in every backward. The
    wrapper that calls apply drops it."""
    __slots__ = ("tensors", )

    def __init__(self, *tensors):
        self.tensors = tensors


def no_vmap(name: str) -> RuntimeError:
    return RuntimeError(f"torch.vmap (and jacrev, jacfwd, hessian, which use it) cannot batch turbomoe's {name}: its "
                        f"kernels take one sample's tensors. Loop over the samples with torch.func.grad or vjp instead")


def _plain(t, name: str):
    """t beneath torch.func's gradient-tracking wrappers (grad, vjp, jvp); a vmap's batched tensor is refused."""
    if not isinstance(t, torch.Tensor):
        return t
    while is_gradtrackingtensor(t):
        t = get_unwrapped(t)
    if is_functorch_wrapped_tensor(t):
        raise no_vmap(name)
    return t


def plain_call(name: str, fn, *args):
    """fn(*args) where it has no gradient (routing's integer tables; a record the module keeps, such as
    MoELayer.expert_load): under a torch.func transform on the values beneath its wrappers, with the
    transforms off (kernels read memory, which its tensors have none of; what it sees made would be
    wrapped, and it refuses writes to tensors it did not make)."""
    if not torch._C._are_functorch_transforms_active():
        return fn(*args)
    args = [_plain(a, name) for a in args]
    with temporarily_clear_interpreter_stack():
        return fn(*args)


def under_func(*tensors) -> bool:
    """Whether a torch.func transform runs and one of tensors is its wrapper."""
    return torch._C._are_functorch_transforms_active() and any(
        isinstance(t, torch.Tensor) and is_functorch_wrapped_tensor(t) for t in tensors)


class _NotTwice(Function):
    """A kernel backward's outputs, as they are, tied to what it read (the gradients, the saved tensors):
    differentiating them again raises. torch's once_differentiable ties its error node to detached copies instead, which
    autograd prunes when asked for some inputs' gradients only (torch.autograd.grad(g, x)): the second
    derivative then lacks the kernels' terms, silently."""

    @staticmethod
    def forward(n, *tensors):
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(NOT_TWICE)


class _Beneath(_NotTwice):
    """A kernel backward under torch.func: run(*tensors) on the plain tensors beneath its wrappers
    (apply takes them off, level by level, as for any Function's forward, or dead ones at once), its
    outputs tied at each level to all it read: differentiating them again raises."""

    @staticmethod
    def forward(run, *tensors):
        return run(*tensors)

    @classmethod
    def vmap(cls, info, in_dims, run, *tensors):  # jacrev: a vmap over the backward
        raise no_vmap(run.__qualname__)


class _SavedBeneath:
    """ctx as a backward reads it, its saved tensors given: the plain ones _Beneath hands over, or those unpacked
    once already."""

    def __init__(self, ctx, saved_tensors):
        self._ctx, self.saved_tensors = ctx, saved_tensors

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def _made_by_func(ctx) -> bool:
    """Whether ctx is the node torch.func made for one of turbomoe's Functions at a transform's level (not
    the Function's own): its tensors are the transform's wrappers, dead ones in a vjp's function, which
    runs after the transform returned."""
    return not issubclass(getattr(type(ctx), "_forward_cls", Function), Function)


def _beneath(backward, ctx, grads):
    saved = ctx.saved_tensors  # unpacked once: saved-tensor hooks may remake them on each read
    n = len(grads)

    def run(*tensors):
        return backward(_SavedBeneath(ctx, tensors[n:]), *tensors[:n])
    run.__qualname__ = backward.__qualname__  # (what a refusal names)
    return _Beneath.apply(run, *grads, *saved)


class BatchedGradients(RuntimeError):
    """A kernel backward was handed a batch of gradients, which its kernels cannot take."""


def _batched(t) -> bool:
    """Whether t is a batched gradient of autograd's own vmap (autograd.grad(is_grads_batched=True),
    autograd.functional's vectorize=True)."""
    if not isinstance(t, torch.Tensor) or is_functorch_wrapped_tensor(t):  # (torch.vmap's: no_vmap says so)
        return False
    return "Batched" in str(torch._C._dispatch_keys(t))


def _once(backward, ctx, grads):
    try:
        return _once_unbatched(backward, ctx, grads)
    except (RuntimeError, NotImplementedError) as e:  # checked only on failure: no host time in a backward
        if any(map(_batched, grads)):
            raise BatchedGradients(
                f"turbomoe's {backward.__qualname__} runs kernels, which take one gradient, not a batch of them "
                f"(torch.autograd.grad(is_grads_batched=True), autograd.functional's jacobian or hessian with "
                f"vectorize=True): pass vectorize=False, or one grad_outputs at a time, or use "
                f"backend='reference' and gmm_backend='reference'") from e
        raise


def _once_unbatched(backward, ctx, grads):
    if not torch.compiler.is_compiling() and _made_by_func(ctx):  # (dynamo cannot trace the check)
        return _beneath(backward, ctx, grads)
    if not torch.is_grad_enabled():  # a plain backward: no create_graph
        return backward(ctx, *grads)
    # unpacked once, handed to backward too: checkpoint's hooks (use_reentrant=False) refuse a second unpack,
    # and others (save_on_cpu, recompute) would copy or remake the tensors again
    saved = ctx.saved_tensors
    with torch.no_grad():
        outs = backward(_SavedBeneath(ctx, saved), *grads)
    # tied to the saved tensors too: with a linear loss the gradients read are constants, yet the
    # gradient still depends on the saved inputs (untied, their second-derivative terms went missing)
    read = [t for t in (*grads, *saved) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not read:
        return outs
    seq = outs if isinstance(outs, tuple) else (outs, )
    at = [i for i, o in enumerate(seq) if isinstance(o, torch.Tensor)]
    tied = dict(zip(at, _NotTwice.apply(len(at), *[seq[i] for i in at], *read)))
    seq = tuple(tied.get(i, o) for i, o in enumerate(seq))
    return seq if isinstance(outs, tuple) else seq[0]


def once_differentiable(backward):
    """A backward that runs kernels: its outputs may be used (create_graph=True gives the first gradient;
    torch.func.grad and vjp run it on the plain tensors) but not differentiated again."""
    @functools.wraps(backward)
    def run(ctx, *grads):
        return _once(backward, ctx, grads)
    return run


def kernel_backward(kernels: bool, backward, ctx, *grads):
    """backward(ctx, *grads) as it runs: where it calls kernels (no autograd of their own), once
    differentiable; where it is PyTorch ops, as they are, so that create_graph records them and a
    double backward is right (the reference backend; under torch.func too)."""
    return _once(backward, ctx, grads) if kernels else backward(ctx, *grads)
