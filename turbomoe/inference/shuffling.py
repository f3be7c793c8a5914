"""index_shuffling, serving's routing step: logits [T, E] -> ShuffledRoutes (ids, scores, counts,
slots, row_routes); the spec is turbomoe.reference.index_shuffling.

Backends as turbomoe.ops: "cuda" (turbomoe/csrc/shuffling.cu), "triton"
(turbomoe/kernels/shuffling.py), "reference" (the CPU path). The default on the GPU: the CUDA kernel's
one block up to csrc.ONE_BLOCK_MAX_TOKENS (8) tokens, the Triton kernels beyond (two launches, tiles
of 4 to 64 tokens); top-1 routing takes Triton's one program up to TOP1_TRITON_MAX_TOKENS. No host
sync, deterministic.
"""
from typing import Optional

import torch

from .. import csrc, reference
from ..ops import MAX_K, check_bool, check_routing, choose_backend
from ..reference import ShuffledRoutes

# H100, Scout's E 16 top-1 + shared, T = 1-4: Triton's one program 2.3-2.4 us, the CUDA block 3.4-3.5;
# level at T = 8 (notes/inference.md). With k > 1 (Qwen3's E 128, k 8) the CUDA block stays ahead.
TOP1_TRITON_MAX_TOKENS = 4


def shuffle_backend(t: torch.Tensor, T: int, E: int, k: int, shared_expert: bool,
                    backend: Optional[str] = None) -> str:
    """The backend index_shuffling runs for T tokens and E experts on t's device: "cuda", "triton"
    or "reference"."""
    backend = choose_backend(t, backend, E + shared_expert)
    if backend == "cuda" and (T > csrc.ONE_BLOCK_MAX_TOKENS or k + shared_expert > MAX_K
                              or (k == 1 and T <= TOP1_TRITON_MAX_TOKENS)):
        # Beyond one block's sizes, and for top-1 at a few tokens, the Triton kernels were faster on
        # the H100 (notes/inference.md).
        # The CUDA kernel holds at most MAX_K routes a token: k = MAX_K plus a shared expert goes to Triton.
        backend = "triton"
    return backend


def index_shuffling(logits_TE: torch.Tensor, k: int, score_func: str = "softmax", renormalize: bool = False,
                    shared_expert: bool = False, backend: Optional[str] = None) -> ShuffledRoutes:
    """Top-k routing (ties to the lower expert id; rows with NaN/Inf route nowhere), counts [E] and
    the expert-contiguous permutation of the T * k routes: slots [T, k] (row of each route, expert
    e's rows in token order after the rows of experts < e) and row_routes [T * k] (its inverse).
    shared_expert: every token also takes expert E with score 1 (its rows come last), so a shared
    expert runs in the same grouped GEMMs and combine as the routed ones."""
    E = check_routing(logits_TE, k, score_func)
    check_bool("renormalize", renormalize)
    check_bool("shared_expert", shared_expert)
    backend = shuffle_backend(logits_TE, logits_TE.shape[0], E, k, shared_expert, backend)
    if backend == "cuda":
        return csrc.index_shuffling(logits_TE, k, score_func, renormalize, shared_expert)
    if backend == "triton":
        from ..kernels.shuffling import index_shuffling as triton_shuffling
        return triton_shuffling(logits_TE, k, score_func, renormalize, shared_expert)
    return reference.index_shuffling(logits_TE, k, score_func, renormalize, shared_expert)
