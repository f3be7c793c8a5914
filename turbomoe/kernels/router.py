"""The router's GEMV at decode: logits [T, E] = x [T, M] @ w [E, M]^T for a few tokens, in one launch.

At decode the router is a read of w (E * M, 160-512 KB at the decode layers' shapes) that BLAS runs
as a split-K GEMV plus a reduction kernel: two launches, 4.8-6.5 us on the H100 for ~2 us of
reads (notes/inference.md). Here a program owns one logit (an expert, a token) and reads K in tiles
of up to 8192 elements (at the decode shapes all of a row's loads in flight at once: programs that
looped over K tiles for 8 tokens each took 5.3 us at Scout's T = 16, one-tile programs 2.3 at T = 1),
products in fp32 on the CUDA cores, reduced once at the end: one launch, a fixed summation order
(deterministic), rounded to x's dtype as F.linear rounds. The tokens' rows and w's rows are re-read
by E and T programs, from L2.
"""
import torch
import triton
import triton.language as tl

from .launch import acc_dtype, chain_launch, chain_wait, next_pow2, tl_dtype


@triton.jit(do_not_specialize=["K"])
def _router_kernel(x_ptr, w_ptr, out_ptr, K, stride_xt, stride_we, stride_ot, ACC: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    chain_wait(PDL)
    e = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    acc = tl.zeros((BLOCK_K, ), dtype=ACC)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + t * stride_xt + ks, mask=k_ok, other=0.0)
        w = tl.load(w_ptr + e * stride_we + ks, mask=k_ok, other=0.0)
        acc += x.to(ACC) * w.to(ACC)
    tl.store(out_ptr + t * stride_ot + e, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty))


def router_logits(x_TM: torch.Tensor, w_EM: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) [T, E] in x's dtype, summed in fp32 (fp64 for fp64 inputs)."""
    if x_TM.dim() != 2 or w_EM.dim() != 2 or x_TM.shape[1] != w_EM.shape[1]:
        raise ValueError(f"x [T, M] and w [E, M] expected, got {tuple(x_TM.shape)} and {tuple(w_EM.shape)}")
    if x_TM.dtype != w_EM.dtype or x_TM.device != w_EM.device:
        raise ValueError(f"x and w must share dtype and device, got {x_TM.dtype} on {x_TM.device} and "
                         f"{w_EM.dtype} on {w_EM.device}")
    x_TM, w_EM = x_TM.contiguous(), w_EM.contiguous()
    (T, K), E = x_TM.shape, w_EM.shape[0]
    out = torch.empty(T, E, device=x_TM.device, dtype=x_TM.dtype)
    if T == 0 or E == 0:
        return out
    if K == 0:
        return out.zero_()
    _router_kernel[(E, T)](x_TM, w_EM, out, K, x_TM.stride(0), w_EM.stride(0), out.stride(0),
                           ACC=tl_dtype(acc_dtype(x_TM.dtype)), BLOCK_K=max(16, min(next_pow2(K), 8192)), num_warps=4,
                           num_stages=2, **chain_launch(x_TM.device))
    return out
