"""autograd.Functions of turbomoe's ops, each with a hand-written backward."""
import functools

import torch


class _NotTwice(torch.autograd.Function):
    """A kernel backward's outputs, as they are, tied to the gradients it read: differentiating them
    again raises. torch's once_differentiable ties its error node to detached copies instead, which
    autograd prunes when asked for some inputs' gradients only (torch.autograd.grad(g, x)): the second
    derivative then lacks the kernels' terms, silently."""

    @staticmethod
    def forward(ctx, n, *tensors):
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("turbomoe's kernels cannot differentiate twice (a gradient of a create_graph=True "
                           "gradient through them): use backend='reference' and gmm_backend='reference' for higher "
                           "derivatives")


def _once(backward, ctx, grads):
    with torch.no_grad():
        outs = backward(ctx, *grads)
    if not torch.is_grad_enabled():  # a plain backward: no create_graph
        return outs
    read = [g for g in grads if isinstance(g, torch.Tensor) and g.requires_grad]
    if not read:
        return outs
    seq = outs if isinstance(outs, tuple) else (outs, )
    at = [i for i, o in enumerate(seq) if isinstance(o, torch.Tensor)]
    tied = dict(zip(at, _NotTwice.apply(len(at), *[seq[i] for i in at], *read)))
    seq = tuple(tied.get(i, o) for i, o in enumerate(seq))
    return seq if isinstance(outs, tuple) else seq[0]


def once_differentiable(backward):
    """A backward that runs kernels: its outputs may be used (create_graph=True gives the first gradient)
    but not differentiated again."""
    @functools.wraps(backward)
    def run(ctx, *grads):
        return _once(backward, ctx, grads)
    return run


def kernel_backward(kernels: bool, backward, ctx, *grads):
    """backward(ctx, *grads) as it runs: where it calls kernels (no autograd of their own), once
    differentiable; where it is PyTorch ops, as they are, so that create_graph records them and a
    double backward is right (the reference backend)."""
    return _once(backward, ctx, grads) if kernels else backward(ctx, *grads)
