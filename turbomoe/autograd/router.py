"""autograd.Function for fp32 router logits from 16-bit tokens, without fp32 copies of the tokens."""
import torch


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 products and sums. Same-dtype 16-bit CUDA operands go to cuBLAS as they are
    (a 16-bit product is exact in fp32, accumulated in fp32); others are cast to fp32 first."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class Fp32Logits(torch.autograd.Function):
    """logits [S, E] fp32 = x [S, M] @ w [E, M]^T: what F.linear(x.float(), w.float()) computes, as
    DeepSpeed's gate does, but saving x and w as they are rather than an fp32 copy of x (2x the
    activation per layer), and as one autograd node instead of three."""

    @staticmethod
    def forward(ctx, x_SM, w_EM):
        ctx.save_for_backward(x_SM, w_EM)
        return _mm_fp32(x_SM, w_EM.t())

    @staticmethod
    def backward(ctx, g_SE):
        x_SM, w_EM = ctx.saved_tensors
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = torch.mm(g_SE, w_EM.float()).to(x_SM.dtype)  # fp32, rounded once, as F.linear's
        if ctx.needs_input_grad[1]:
            gw = torch.mm(g_SE.t(), x_SM.float()).to(w_EM.dtype)
        return gx, gw


def fp32_logits(x_SM: torch.Tensor, w_EM: torch.Tensor) -> torch.Tensor:
    """logits [S, E] fp32 of x [S, M] and the router weight w [E, M], any float dtypes."""
    return Fp32Logits.apply(x_SM, w_EM)
