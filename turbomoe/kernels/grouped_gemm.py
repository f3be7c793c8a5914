"""Triton grouped GEMM over expert-contiguous rows, with the group sizes read on the device.

Rows of x are grouped: group g owns rows offset_g .. offset_g + counts[g], offset_g the exclusive
prefix sum of counts. Nothing here reads counts on the host, so the launches are CUDA-graph safe.
Rows past sum(counts) are neither read nor written; counts that sum past R truncate the last groups
(no row past R is touched).

  grouped_mm        y[rows_g] = x[rows_g] @ w[g]       x [R, K], w [G, K, N] (any strides) -> [R, N]
                    (the input gradient is the same kernel on w transposed: dx = dy @ w[g]^T)
  grouped_mm_wgrad  dw[g] = x[rows_g]^T @ dy[rows_g]   x [R, K], dy [R, N] -> [G, K, N]
                    (or out[g] += it: gradient-accumulation fusion into an fp32 main_grad)

grouped_mm is persistent (MetaShuffling's design): one program per SM walks the tiles of all
groups in order, each program taking every P-th tile, so zero-count groups cost a few scalar loads
and no launch depends on the routing. fp32 operands use IEEE fp32 products unless
torch.backends.cuda.matmul.allow_tf32 is set.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import sm_count

_MM_CONFIGS = [  # bf16 / fp16 tiles, then fp32 (IEEE products need smaller tiles to fit shared memory)
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, num_stages=3, num_warps=4),
]
_WGRAD_CONFIGS = [  # BLOCK_K x BLOCK_N: the output tile; BLOCK_M: rows summed a step
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 128}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 256, "BLOCK_K": 128}, num_stages=4, num_warps=8),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}, num_stages=3, num_warps=4),
]
_INTERPRET_CONFIG = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_stages=1, num_warps=1)]


def _prune_by_dtype(configs, named_args, **kwargs):
    """The last config serves fp32, the others 16-bit dtypes: fewer compilations per shape."""
    if len(configs) == 1:
        return configs
    return configs[-1:] if named_args["x_ptr"].element_size() == 4 else configs[:-1]


def _interpreting() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"


def _input_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


@triton.autotune(configs=_INTERPRET_CONFIG if _interpreting() else _MM_CONFIGS, key=["N", "K", "G"],
                 prune_configs_by={"early_config_prune": _prune_by_dtype})
@triton.jit
def _grouped_mm_kernel(x_ptr, w_ptr, y_ptr, counts_ptr, R, N, K, G,
                       stride_xr, stride_xk, stride_wg, stride_wk, stride_wn, stride_yr, stride_yn,
                       NUM_PROGRAMS: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tile_start = 0  # global index of the first tile of group g
    row_start = 0
    w_g_ptr = w_ptr  # advanced by a pointer step per group: 64-bit offsets
    for g in range(G):
        m = tl.load(counts_ptr + g)
        g_tiles = tl.cdiv(m, BLOCK_M) * n_tiles
        # The first tile t >= tile_start with t % NUM_PROGRAMS == pid.
        first = tile_start + (pid - tile_start % NUM_PROGRAMS + NUM_PROGRAMS) % NUM_PROGRAMS
        for t in range(first, tile_start + g_tiles, NUM_PROGRAMS):
            local = t - tile_start
            tile_m = local // n_tiles
            tile_n = local % n_tiles
            rows_in = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            # Rows are clamped (out-of-group rows are computed, never stored); the other dims are
            # masked, since a clamp on a contiguous dim would defeat vectorised loads.
            rows_ld = tl.minimum(row_start + rows_in, R - 1).to(tl.int64)
            col_ok = cols < N
            ks = tl.arange(0, BLOCK_K)
            a_ptrs = x_ptr + rows_ld[:, None] * stride_xr + ks[None, :] * stride_xk
            b_ptrs = w_g_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(0, tl.cdiv(K, BLOCK_K)):
                k_ok = ks < K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
                a_ptrs += BLOCK_K * stride_xk
                b_ptrs += BLOCK_K * stride_wk
            rows = (row_start + rows_in).to(tl.int64)
            y_ptrs = y_ptr + rows[:, None] * stride_yr + cols[None, :] * stride_yn
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=((rows_in < m) & (rows < R))[:, None] & col_ok[None, :])
        tile_start += g_tiles
        row_start += m
        w_g_ptr += stride_wg


@triton.autotune(configs=_INTERPRET_CONFIG if _interpreting() else _WGRAD_CONFIGS, key=["N", "K", "G"],
                 prune_configs_by={"early_config_prune": _prune_by_dtype},
                 restore_value=["dw_ptr"])  # tuning runs it once a config: an accumulated buffer is put back
@triton.jit
def _grouped_mm_wgrad_kernel(x_ptr, dy_ptr, dw_ptr, counts_ptr, R, N, K, G,
                             stride_xr, stride_xk, stride_dyr, stride_dyn, stride_wg, stride_wk, stride_wn,
                             PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tile_k = pid // n_tiles
    tile_n = pid % n_tiles
    # Offset of group g: a sum over the counts before it (G is small).
    row_start = 0
    for h in range(0, g):
        row_start += tl.load(counts_ptr + h)
    m = tl.load(counts_ptr + g)
    ks = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = ks < K
    col_ok = cols < N
    dw_ptrs = dw_ptr + g.to(tl.int64) * stride_wg + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    if ACCUMULATE:
        if m == 0:  # nothing to add: the tile is neither read nor written
            return
        # The sum starts from the buffer's value (no second fp32 tile held through the loop).
        acc = tl.load(dw_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r in range(0, m, BLOCK_M):
        rows_in = r + tl.arange(0, BLOCK_M)
        rows = (row_start + rows_in).to(tl.int64)
        ok = (rows_in < m) & (rows < R)  # rows of other groups must not leak into this sum; none past R
        a = tl.load(x_ptr + rows[None, :] * stride_xr + ks[:, None] * stride_xk, mask=k_ok[:, None] & ok[None, :],
                    other=0.0)
        b = tl.load(dy_ptr + rows[:, None] * stride_dyr + cols[None, :] * stride_dyn, mask=ok[:, None] & col_ok[None, :],
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


def grouped_mm(x_RK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor) -> torch.Tensor:
    """y [R, N]: rows of group g times w[g]. w may be a transposed view (w_GNK.transpose(1, 2))."""
    R, K = x_RK.shape
    G, _, N = w_GKN.shape
    y = torch.empty(R, N, device=x_RK.device, dtype=x_RK.dtype)
    if R == 0 or N == 0:
        return y
    P = sm_count(x_RK.device)
    _grouped_mm_kernel[(P,)](x_RK, w_GKN, y, counts_G, R, N, K, G,
                             x_RK.stride(0), x_RK.stride(1), *w_GKN.stride(), y.stride(0), y.stride(1),
                             NUM_PROGRAMS=P, PRECISION=_input_precision(x_RK.dtype))
    return y


def grouped_mm_wgrad(x_RK: torch.Tensor, dy_RN: torch.Tensor, counts_G: torch.Tensor,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dw [G, K, N] = per group x[rows_g]^T @ dy[rows_g]; zero for empty groups. With out [G, K, N]
    (any float dtype and strides, typically an fp32 main_grad): out[g] += x[rows_g]^T @ dy[rows_g]
    in place, summed in fp32 from out's value and rounded once to out's dtype (Megatron's
    gradient-accumulation fusion: no dw tensor, no separate add), and out returned; empty groups'
    tiles are not touched."""
    R, K = x_RK.shape
    N = dy_RN.shape[1]
    G = counts_G.shape[0]
    if out is not None and (tuple(out.shape) != (G, K, N) or out.device != x_RK.device
                            or not out.is_floating_point()):
        raise ValueError(f"out must be a float tensor [G, K, N] = [{G}, {K}, {N}] on {x_RK.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    dw = torch.empty(G, K, N, device=x_RK.device, dtype=x_RK.dtype) if out is None else out
    if G == 0 or K == 0 or N == 0:
        return dw

    def grid(meta):
        return (triton.cdiv(K, meta["BLOCK_K"]) * triton.cdiv(N, meta["BLOCK_N"]), G)

    _grouped_mm_wgrad_kernel[grid](x_RK, dy_RN, dw, counts_G, R, N, K, G,
                                   x_RK.stride(0), x_RK.stride(1), dy_RN.stride(0), dy_RN.stride(1), *dw.stride(),
                                   PRECISION=_input_precision(x_RK.dtype), ACCUMULATE=out is not None)
    return dw
