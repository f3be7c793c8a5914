"""autograd.Function for fp32 router logits from 16-bit tokens, without fp32 copies of the tokens.

On CUDA with bf16 tokens every GEMM runs on bf16 tensor cores with fp32 sums, its fp32 operands (an
fp32 router weight, the logits' gradient) split into bf16 terms (`bf16_terms`): a product of two bf16
values is exact in fp32, so each product is at least as exact as in the fp32 GEMM that DeepSpeed's and
Megatron's routers run (not the same bits: the sums run in another order), without the passes that cast
the tokens to fp32 each way and the fp32 GEMMs on CUDA cores (at small-1gpu's shapes the backward's
casts and fp32 GEMMs took 0.24 ms a layer on an H100, notes/recipe_profile.md).
"""
import contextlib

import torch

from .. import reference
from ..reference import BF16_TERMS as TERMS


def bf16_terms(t32: torch.Tensor) -> torch.Tensor:
    """reference.bf16_terms; on CUDA one Triton kernel (the plain PyTorch form takes five launches)."""
    if t32.is_cuda:
        from ..kernels.router import bf16_terms as kernel
        return kernel(t32)
    return reference.bf16_terms(t32)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b of bf16 operands with fp32 sums, rounded once to out_dtype. On CUDA cuBLAS as they are;
    elsewhere (the tests of the split on the CPU) on fp32 copies: the same exact products."""
    if not a.is_cuda:
        return torch.mm(a.float(), b.float()).to(out_dtype)
    return torch.mm(a, b) if out_dtype == a.dtype else torch.mm(a, b, out_dtype=torch.float32).to(out_dtype)


def split_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """bf16 tokens on CUDA, a bf16 or fp32 router weight: the tensor-core path."""
    return x.is_cuda and x.dtype == torch.bfloat16 and w.dtype in (torch.bfloat16, torch.float32)


def weight_terms(w_EM: torch.Tensor) -> torch.Tensor:
    """w as the split's GEMMs read it: a bf16 w as it is, an fp32 w as its terms [E, TERMS, M] (made once
    in forward, kept for backward)."""
    return w_EM if w_EM.dtype == torch.bfloat16 else bf16_terms(w_EM)


def logits_split(x_SM: torch.Tensor, w_terms: torch.Tensor) -> torch.Tensor:
    """x @ w^T [S, E] fp32 from bf16 x and weight_terms(w): one GEMM, then each logit's three partial
    sums added where w was fp32."""
    if w_terms.dim() == 2:
        return _mm(x_SM, w_terms.t(), torch.float32)
    E, _, M = w_terms.shape
    return _mm(x_SM, w_terms.view(E * TERMS, M).t(), torch.float32).view(x_SM.shape[0], E, TERMS).sum(-1)


# Term i of g with term j of an fp32 w where i + j <= 2: the products left out (g1 w2, g2 w1, g2 w2)
# are below 2^-24 of the leading one, under fp32's own rounding of a product.
_G_TERMS, _W_TERMS = [0, 0, 1, 0, 1, 2], [0, 1, 0, 2, 1, 0]


def grads_split(g_SE: torch.Tensor, x_SM: torch.Tensor, w_terms: torch.Tensor, w_dtype: torch.dtype, need_x: bool,
                need_w: bool):
    """(g @ w in x's dtype, g^T @ x in w_dtype) of an fp32 g from its bf16 terms and weight_terms(w):
    bf16 GEMMs."""
    S, E = g_SE.shape
    g_STE = bf16_terms(g_SE)
    gx = gw = None
    if need_x:
        if w_terms.dim() == 2:
            a, b = g_STE.view(S, TERMS * E), w_terms.repeat(TERMS, 1)
        else:  # the pairs' terms side by side along K; slices, not a list index (a host-to-device copy and a sync)
            a = torch.cat([g_STE[:, i] for i in _G_TERMS], dim=1)  # [S, 6 E]
            b = torch.cat([w_terms[:, j] for j in _W_TERMS])  # [6 E, M]
        gx = _mm(a, b, x_SM.dtype)
    if need_w:
        gw = _mm(g_STE.view(S, TERMS * E).t(), x_SM, torch.float32).view(TERMS, E, x_SM.shape[1]).sum(0).to(w_dtype)
    return gx, gw


def _no_autocast(t: torch.Tensor):
    """A region where torch.autocast is off on t's device; no context at all where it is off already
    (the usual case: its enter and exit are host time on every call)."""
    device = t.device.type
    return torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()


class Fp32Logits(torch.autograd.Function):
    """logits [S, E] fp32 = x [S, M] @ w [E, M]^T: what F.linear(x.float(), w.float()) computes, as
    DeepSpeed's gate does, but saving x and w as they are rather than an fp32 copy of x (2x the
    activation per layer), and as one autograd node instead of three. fp32 under torch.autocast too
    (the router's choices are the precision-sensitive part; autocast would round them to 16 bits)."""

    @staticmethod
    def forward(ctx, x_SM, w_EM):
        with _no_autocast(x_SM):  # fp32 logits under torch.autocast too
            return Fp32Logits._forward(ctx, x_SM, w_EM)

    @staticmethod
    def _forward(ctx, x_SM, w_EM):
        if split_applies(x_SM, w_EM):
            w_terms = weight_terms(w_EM)
            ctx.save_for_backward(x_SM, w_EM, w_terms)
            return logits_split(x_SM, w_terms)
        ctx.save_for_backward(x_SM, w_EM, None)
        if x_SM.is_cuda and x_SM.dtype == w_EM.dtype == torch.float16:  # fp16 products are exact in fp32 too
            return torch.mm(x_SM, w_EM.t(), out_dtype=torch.float32)
        return torch.mm(x_SM.float(), w_EM.float().t())

    @staticmethod
    def backward(ctx, g_SE):
        x_SM, w_EM, w_terms = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        g_SE = g_SE.float()
        with _no_autocast(g_SE):  # a backward called inside autocast's region
            if w_terms is not None:
                return grads_split(g_SE, x_SM, w_terms, w_EM.dtype, need_x, need_w)
            gx = torch.mm(g_SE, w_EM.float()).to(x_SM.dtype) if need_x else None  # fp32, rounded once, as F.linear's
            gw = torch.mm(g_SE.t(), x_SM.float()).to(w_EM.dtype) if need_w else None
            return gx, gw


def fp32_logits(x_SM: torch.Tensor, w_EM: torch.Tensor) -> torch.Tensor:
    """logits [S, E] fp32 of x [S, M] and the router weight w [E, M], any float dtypes."""
    return Fp32Logits.apply(x_SM, w_EM)
