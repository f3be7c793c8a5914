"""autograd.Function for fp32 router logits from 16-bit tokens, without fp32 copies of the tokens.

On CUDA with bf16 tokens every GEMM runs on bf16 tensor cores with fp32 sums, its fp32 operands (an
fp32 router weight, the logits' gradient) split into bf16 terms (`reference.bf16_terms`; up to 16
experts in registers in the kernels of kernels.router, one launch forward and two backward): a
product of two bf16 values is exact in fp32, so each product is at least as exact as in the fp32
GEMM that DeepSpeed's and Megatron's routers run (not the same bits: the sums run in another order),
without the passes that cast the tokens to fp32 each way and the fp32 GEMMs on CUDA cores (at
small-1gpu's shapes the backward's casts and fp32 GEMMs took 0.24 ms a layer on an H100,
notes/recipe_profile.md).
"""
import contextlib

import torch

from .. import reference
from . import Function, Kept, kernel_backward


def split_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """bf16 tokens on CUDA, a bf16 or fp32 router weight: the tensor-core path."""
    return x.is_cuda and x.dtype == torch.bfloat16 and w.dtype in (torch.bfloat16, torch.float32)


def _split_impl(num_experts: int):
    """The split's kernels (kernels.router: one launch forward, two backward, the host's least) up to
    SPLIT_KERNEL_MAX_EXPERTS; beyond, the plain PyTorch form (reference: cuBLAS's GEMMs, faster on the
    GPU there, its fp32 operands split by the one-launch kernels.router.bf16_terms)."""
    from ..kernels import router
    return reference if num_experts > router.SPLIT_KERNEL_MAX_EXPERTS else router


def _no_autocast(t: torch.Tensor):
    """A region where torch.autocast is off on t's device; no context at all where it is off already
    (the usual case: its enter and exit are host time on every call)."""
    device = t.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


class Fp32Logits(Function):
    """logits [S, E] fp32 = x [S, M] @ w [E, M]^T: what F.linear(x.float(), w.float()) computes, as
    DeepSpeed's gate does, but saving x and w as they are rather than an fp32 copy of x (2x the
    activation per layer), and as one autograd node instead of three. fp32 under torch.autocast too
    (the router's choices are the precision-sensitive part; autocast would round them to 16 bits)."""

    @staticmethod
    def forward(x_SM, w_EM, pass_x: bool = False):
        """pass_x: also return x (a view: torch.func saves no input returned as it is), for x's other
        consumer: its gradient comes back to this node, which adds it inside the kernel of x's gradient
        (else autograd adds the two in a pass of its own). Kept(the split's terms of w, or None) for backward."""
        with _no_autocast(x_SM):  # fp32 logits under torch.autocast too
            logits_SE, w_terms = Fp32Logits._forward(x_SM, w_EM)
        if not pass_x:
            return logits_SE, Kept(w_terms)
        return logits_SE, Kept(w_terms), x_SM.view_as(x_SM)

    @staticmethod
    def _forward(x_SM, w_EM):
        if split_applies(x_SM, w_EM):
            impl = _split_impl(w_EM.shape[0])
            # the PyTorch form splits an fp32 w once here and keeps its terms for backward
            w_terms = _bf16_terms(w_EM) if impl is reference and w_EM.dtype == torch.float32 else None
            return impl.split_logits(x_SM, w_EM if w_terms is None else w_terms), w_terms
        if x_SM.is_cuda and x_SM.dtype == w_EM.dtype == torch.float16:  # fp16 products are exact in fp32 too
            return torch.mm(x_SM, w_EM.t(), out_dtype=torch.float32), None
        return torch.mm(x_SM.float(), w_EM.float().t()), None

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_SM, w_EM, pass_x = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x_SM, w_EM, *output[1].tensors)
        ctx.split = split_applies(x_SM, w_EM)
        if pass_x and not ctx.needs_input_grad[0]:  # x needs no gradient: its consumer's backward need not run for it
            ctx.mark_non_differentiable(output[2])

    @staticmethod
    def backward(ctx, g_SE, _g_kept, g_x_SM=None):  # the split's kernels (or their PyTorch form) once; torch.mm twice
        return kernel_backward(ctx.split, Fp32Logits._backward, ctx, g_SE, g_x_SM)

    @staticmethod
    def _backward(ctx, g_SE, g_x_SM):
        x_SM, w_EM, w_terms = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        if g_SE is None:  # the logits had no gradient (grads are not materialised)
            return g_x_SM, None, None
        g_SE = g_SE.float()
        with _no_autocast(g_SE):  # a backward called inside autocast's region
            if ctx.split:
                impl = _split_impl(w_EM.shape[0])
                if impl is reference:
                    gx, gw = reference.split_grads(g_SE, x_SM, w_EM if w_terms is None else w_terms, need_x, need_w,
                                                   _bf16_terms, g_x_SM)
                else:
                    gx, gw = impl.split_grads(g_SE, x_SM, w_EM, need_x, need_w, g_x_SM)
                return gx, gw, None
            gx = gw = None
            if need_x:  # fp32, rounded once, as F.linear's; x's other gradient added before that rounding, in
                # fp32 or in x's dtype where wider (an fp64 x's other gradient keeps its bits)
                gx = torch.mm(g_SE, w_EM.float())
                if g_x_SM is not None:
                    acc = torch.promote_types(torch.float32, x_SM.dtype)
                    gx = gx.to(acc) + g_x_SM.to(acc)
                gx = gx.to(x_SM.dtype)
            if need_w:
                gw = torch.mm(g_SE.t(), x_SM.float()).to(w_EM.dtype)
            return gx, gw, None


def _bf16_terms(t32: torch.Tensor) -> torch.Tensor:
    from ..kernels import router
    return router.bf16_terms(t32)


def _traced_logits(x_SM: torch.Tensor, w_EM: torch.Tensor) -> torch.Tensor:
    """The logits under torch.compile: plain ops, an fp32 GEMM of exact products as F.linear(x.float(),
    w.float()), differentiated by autograd and fused by the compiler (the split's kernels do not run
    there). torch 2.11's dynamo traced Fp32Logits with a bf16 w with zeros in place of the logits'
    gradient: x and w got zero gradients (aot_eager, an H100, 2026-12-07; not with an fp32 w, and not
    under torch 2.13 on the CPU)."""
    with _no_autocast(x_SM):
        return torch.mm(x_SM.float(), w_EM.float().t())


def fp32_logits(x_SM: torch.Tensor, w_EM: torch.Tensor) -> torch.Tensor:
    """logits [S, E] fp32 of x [S, M] and the router weight w [E, M], any float dtypes."""
    if torch.compiler.is_compiling():
        return _traced_logits(x_SM, w_EM)
    return Fp32Logits.apply(x_SM, w_EM, False)[0]


def fp32_logits_and_x(x_SM: torch.Tensor, w_EM: torch.Tensor):
    """(fp32_logits(x, w), x): the x to give x's other consumer (the layer's dispatch), whose gradient
    this node adds inside the kernel of x's gradient, saving autograd's add of the two ([S, M], a pass
    over three times x's bytes). Under torch.compile x as it is: the compiler fuses that add."""
    if torch.compiler.is_compiling():
        return _traced_logits(x_SM, w_EM), x_SM
    logits_SE, _, x_SM = Fp32Logits.apply(x_SM, w_EM, True)
    return logits_SE, x_SM
