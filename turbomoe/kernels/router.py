"""The router's GEMV at decode: logits [T, E] = x [T, M] @ w [E, M]^T for a few tokens, in one launch.

At decode the router is a read of w (E * M, 160-512 KB at the decode layers' shapes) that BLAS runs
as a split-K GEMV plus a reduction kernel: two launches, 4.8-6.5 us on the H100 for ~2 us of
reads (notes/inference.md). Here a program owns one logit (an expert, a token) and reads K in tiles
of up to 8192 elements (at the decode shapes all of a row's loads in flight at once: programs that
looped over K tiles for 8 tokens each took 5.3 us at Scout's T = 16, one-tile programs 2.3 at T = 1),
products in fp32 on the CUDA cores, reduced once at the end: one launch, a fixed summation order
(deterministic), rounded to x's dtype as F.linear rounds. The tokens' rows and w's rows are re-read
by E and T programs, from L2, so from tens of tokens router_logit_parts takes over: a program a
16-token tile, up to 32 experts and one 128-wide K slice through the tensor cores, its fp32 partial
sums left for the Triton index_shuffling to add in order as it loads them (one launch, and no
reduction kernel: 1.8-3.5 us at Scout's T = 32-256 and Qwen3's T = 16-64, H100).
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


@triton.jit(do_not_specialize=["T", "E", "K"])
def _router_parts_kernel(x_ptr, w_ptr, out_ptr, T, E, K, stride_xt, stride_we, stride_os, stride_ot,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    chain_wait(PDL)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    exps = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    ks = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    t_ok = toks < T
    e_ok = exps < E
    k_ok = ks < K
    x = tl.load(x_ptr + toks[:, None].to(tl.int64) * stride_xt + ks[None, :], mask=t_ok[:, None] & k_ok[None, :],
                other=0.0)
    w = tl.load(w_ptr + exps[:, None].to(tl.int64) * stride_we + ks[None, :], mask=e_ok[:, None] & k_ok[None, :],
                other=0.0)
    tl.store(out_ptr + tl.program_id(2).to(tl.int64) * stride_os + toks[:, None].to(tl.int64) * stride_ot
             + exps[None, :], tl.dot(x, tl.trans(w)), mask=t_ok[:, None] & e_ok[None, :])


PARTS_BLOCK_K = 128  # H100, bf16 (notes/inference.md): 128-K slices beat 256 and 512 at both decode layers


def router_logit_parts(x_TM: torch.Tensor, w_EM: torch.Tensor) -> torch.Tensor:
    """fp32 [S, T, E] partial sums of x @ w^T over S slices of K (PARTS_BLOCK_K each), every slice a
    program of 16 tokens x up to 32 experts through the tensor cores, all loads in flight at once:
    the router in one launch for tens to hundreds of tokens (F.linear takes two: a split-K GEMV and
    its reduction). The Triton index_shuffling sums them in order (parts_dtype), so nothing else
    runs between. 16-bit x and w (fp32 would go through TF32)."""
    if x_TM.dim() != 2 or w_EM.dim() != 2 or x_TM.shape[1] != w_EM.shape[1]:
        raise ValueError(f"x [T, M] and w [E, M] expected, got {tuple(x_TM.shape)} and {tuple(w_EM.shape)}")
    if x_TM.dtype != w_EM.dtype or x_TM.dtype not in (torch.bfloat16, torch.float16) or x_TM.device != w_EM.device:
        raise ValueError(f"x and w must be bf16 or fp16 on one device, got {x_TM.dtype} on {x_TM.device} and "
                         f"{w_EM.dtype} on {w_EM.device}")
    x_TM, w_EM = x_TM.contiguous(), w_EM.contiguous()
    (T, K), E = x_TM.shape, w_EM.shape[0]
    S = max(1, triton.cdiv(K, PARTS_BLOCK_K))
    out = torch.empty(S, T, E, device=x_TM.device, dtype=torch.float32)
    if T == 0 or E == 0:
        return out
    if K == 0:
        return out.zero_()
    block_e = min(32, max(16, next_pow2(E)))
    _router_parts_kernel[(triton.cdiv(T, 16), triton.cdiv(E, block_e), S)](
        x_TM, w_EM, out, T, E, K, x_TM.stride(0), w_EM.stride(0), out.stride(0), out.stride(1), BLOCK_T=16,
        BLOCK_E=block_e, BLOCK_K=PARTS_BLOCK_K, num_warps=4, num_stages=1, **chain_launch(x_TM.device))
    return out


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


@triton.jit
def _bf16_terms_kernel(t_ptr, out_ptr, rows, N, TERMS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    r_idx = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (r_idx < rows)[:, None] & (cols < N)[None, :]
    rest = tl.load(t_ptr + r_idx[:, None] * N + cols[None, :], mask=ok, other=0.0)
    base = out_ptr + r_idx[:, None] * (TERMS * N) + cols[None, :]
    for i in tl.static_range(TERMS):
        # Round to nearest even on the bits, as torch's cast (the interpreter's own cast truncates);
        # NaN stays NaN (its payload may differ), inf stays inf.
        bits = rest.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        bits = tl.where(rest != rest, 0x7FC00000, bits)
        term = bits.to(tl.float32, bitcast=True)
        tl.store(base + i * N, term.to(tl.bfloat16), mask=ok)  # exact: the low half is zero
        rest = rest - term  # exact: a value minus its own rounding


def bf16_terms(t32: torch.Tensor) -> torch.Tensor:
    """reference.bf16_terms of an fp32 [..., N] in one launch: [..., TERMS, N] bf16, the same bits
    (NaN's payload aside) where |t| >= 2^-102 or t is 0 or not finite; below, a remainder under
    fp32's smallest normal may flush to zero where the device flushes subnormals."""
    from ..reference import BF16_TERMS
    if t32.dtype != torch.float32:
        raise ValueError(f"bf16_terms takes fp32, got {t32.dtype}")
    t32 = t32.contiguous()
    N = t32.shape[-1]
    rows = t32.numel() // N if N else 0
    out = torch.empty((*t32.shape[:-1], BF16_TERMS, N), dtype=torch.bfloat16, device=t32.device)
    if rows == 0:
        return out
    block_n = min(1024, max(16, next_pow2(N)))
    block_r = 2048 // block_n  # 2048 values a program: a few tokens' logit gradients, or part of a weight row
    _bf16_terms_kernel[(triton.cdiv(rows, block_r), triton.cdiv(N, block_n))](
        t32, out, rows, N, TERMS=BF16_TERMS, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=4)
    return out
