"""Triton grouped GEMM for few rows per expert (decode), counts read on the device.

    y[rows_g] = act(x[rows_g] @ w[g])      x [R, K], w [G, K, N'] -> y [R, N]

act: none (N = N'), or SwiGLU over w = [gate | up] (N' = 2N: y = silu(x w_gate) * x w_up, fp32 math),
which saves the first GEMM's [R, 2F] output a round trip. Rows are grouped as in
turbomoe.kernels.grouped_gemm (group g owns rows offset_g .. offset_g + counts[g]).

Why a kernel beside the persistent one: at decode a group holds 1 to 64 rows, so the step is a read
of the selected experts' weights. The grid is (N tiles, G, row tiles up to max_rows): a program
whose group has no rows there returns at once, so only the weights of experts with tokens are read
(selective loading), and a split of K gives enough programs to pull the weights at the memory's
speed when few experts are used. The split of K is deterministic: fp32 partials
[SPLIT_K, R, N'] summed in a fixed order by a second kernel (which also applies the activation).
No launch depends on the counts' values: CUDA-graph capturable. Rows past sum(counts) are
unspecified.
"""
import torch
import triton
import triton.language as tl

from .launch import next_pow2


@triton.jit(do_not_specialize=["R", "K", "N", "G", "k_per_split"])
def _few_rows_mm_kernel(x_ptr, w_ptr, out_ptr, counts_ptr, R, K, N, G, k_per_split,
                        stride_xr, stride_wg, stride_wk, stride_wn, stride_or, stride_os,
                        SWIGLU: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_G: tl.constexpr):
    pid_n = tl.program_id(0)
    g = tl.program_id(1)
    pid_m = tl.program_id(2) // SPLIT
    split = tl.program_id(2) % SPLIT
    m = tl.load(counts_ptr + g)
    if pid_m * BLOCK_M >= m:
        return
    gs = tl.arange(0, BLOCK_G)
    row_start = tl.sum(tl.load(counts_ptr + gs, mask=gs < g, other=0), axis=0)
    rows_in = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.minimum(row_start + rows_in, R - 1).to(tl.int64)  # clamped: computed, never stored
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_g = w_ptr + g.to(tl.int64) * stride_wg
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        a = tl.load(x_ptr + rows[:, None] * stride_xr + ks[None, :], mask=k_ok[None, :], other=0.0)
        b_ptrs = w_g + ks[:, None].to(tl.int64) * stride_wk + cols[None, :] * stride_wn
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if SWIGLU:
            b_up = tl.load(b_ptrs + N * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
    store_ok = ((rows_in < m) & (row_start + rows_in < R))[:, None] & col_ok[None, :]
    if SPLIT == 1:
        if SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc_up
        tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=store_ok)
    else:  # fp32 partials [SPLIT, R, N'] (N' = 2N with SwiGLU: gate then up)
        p = out_ptr + split.to(tl.int64) * stride_os + rows[:, None] * stride_or + cols[None, :]
        tl.store(p, acc, mask=store_ok)
        if SWIGLU:
            tl.store(p + N, acc_up, mask=store_ok)


@triton.jit(do_not_specialize=["R", "N"])
def _sum_splits_kernel(part_ptr, y_ptr, R, N, stride_pr, stride_ps, stride_yr, SWIGLU: tl.constexpr,
                       SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    up = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):  # a fixed order: deterministic
        p = part_ptr + s * stride_ps + row * stride_pr + cols
        acc += tl.load(p, mask=ok, other=0.0)
        if SWIGLU:
            up += tl.load(p + N, mask=ok, other=0.0)
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * up
    tl.store(y_ptr + row * stride_yr + cols, acc.to(y_ptr.dtype.element_ty), mask=ok)


# Shared memory the pipeline may take: Hopper's 227 KiB per block, less a margin for the compiler.
SMEM_BUDGET = 200 * 1024


def few_rows_tiles(max_rows: int, N: int, K: int, device: torch.device, elem_size: int = 2, swiglu: bool = False):
    """(BLOCK_M, BLOCK_N, SPLIT, BLOCK_K, num_warps, num_stages): row tiles of 16 up to 64 rows, N
    tiles of 64 (128-byte rows of bf16 weights) and K split in up to 8 parts of at least 256: the
    rule that was best or within 15% of the best of 12 tilings swept at the decode layers' shapes
    with up to 8 routes (notes/inference.md). Wider elements (fp32) get fewer pipeline stages, then
    shorter K tiles, until the stages' buffers fit in shared memory (4 stages of fp32 SwiGLU tiles
    asked 240 KiB on the H100)."""
    block_m = min(64, max(16, next_pow2(max_rows)))
    block_n = 64
    split = 1
    while split < 8 and K // (2 * split) >= 256:
        split *= 2
    block_k = 128 if device.type == "cuda" else 16  # the interpreter: small tiles, several splits
    if device.type != "cuda":
        split = max(1, min(4, K // 32))
    stages = 4

    def smem():  # Triton's software pipeline holds stages - 1 buffers of each operand tile
        return (stages - 1) * elem_size * block_k * (block_m + block_n * (2 if swiglu else 1))

    while smem() > SMEM_BUDGET and stages > 2:
        stages -= 1
    while smem() > SMEM_BUDGET and block_k > 16:
        block_k //= 2
    return block_m, block_n, split, block_k, 4, stages


def few_rows_mm(x_RK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor, max_rows: int,
                swiglu: bool = False, tiles=None) -> torch.Tensor:
    """y [R, N] (N = w's last dim, or half of it with swiglu). max_rows: a bound on any group's
    count (at decode: the token count), fixed per shape so the launch is the same every step;
    tiles: few_rows_tiles' tuple, to override its choice (the benchmark's sweep)."""
    R, K = x_RK.shape
    G, _, NW = w_GKN.shape
    N = NW // 2 if swiglu else NW
    y = torch.empty(R, N, device=x_RK.device, dtype=x_RK.dtype)
    if R == 0 or N == 0 or G == 0:
        return y
    if K == 0:  # empty sums: zero (and silu(0) * 0 = 0 with swiglu)
        return y.zero_()
    if x_RK.stride(1) != 1:
        x_RK = x_RK.contiguous()
    block_m, block_n, split, block_k, warps, stages = tiles or few_rows_tiles(
        max_rows, N, K, x_RK.device, x_RK.element_size(), swiglu)
    k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    split = triton.cdiv(K, k_per_split)
    grid = (triton.cdiv(N, block_n), G, triton.cdiv(max(max_rows, 1), block_m) * split)
    precision = "ieee" if x_RK.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
    out = y if split == 1 else torch.empty(split, R, NW, device=x_RK.device, dtype=torch.float32)
    _few_rows_mm_kernel[grid](x_RK, w_GKN, out, counts_G, R, K, N, G, k_per_split,
                              x_RK.stride(0), *w_GKN.stride(), out.stride(-2), out.stride(0) if split > 1 else 0,
                              SWIGLU=swiglu, SPLIT=split, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n,
                              BLOCK_K=block_k, BLOCK_G=next_pow2(G), num_warps=warps, num_stages=stages)
    if split > 1:
        block = min(1024, next_pow2(N))
        _sum_splits_kernel[(R, triton.cdiv(N, block))](out, y, R, N, out.stride(1), out.stride(0), y.stride(0),
                                                       SWIGLU=swiglu, SPLIT=split, BLOCK=block)
    return y
