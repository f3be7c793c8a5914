"""The serving MoE block, no autograd: router -> index_shuffling -> gather rows -> grouped GEMMs ->
combine (+ shared expert).

    x [T, M] -> logits = x @ router^T [T, E] (turbomoe.kernels.router: its GEMV for a few tokens,
                from 16 its split-K partial sums, which the shuffle adds as it loads)
             -> index_shuffling: ids, scores, counts, slots (+ the shared expert as route k, expert E)
             -> rows [T * k', M]: row slots[t, j] = x[t] (times its score with prescale: Llama 4)
             -> y = (silu(rows @ w1_gate) * rows @ w1_up) @ w2, grouped by expert, counts on the device
             -> out[t] = sum_j w[t, j] * y[slots[t, j]] in fp32 (w = scores, or 1 with prescale)

The shared expert is group E of the same GEMMs and column k of the same combine, so it costs no
launch of its own. Every path is deterministic (one writer per output, fixed summation order).
By token count T:
  few_rows  T * k <= few_rows_per_expert (24) * E: turbomoe.kernels.few_rows_gemm, three launches
            after the shuffle (the first GEMM gathers rows from x and, unless it splits K, applies
            SwiGLU; the second GEMM; the combine sums the second's K splits); only experts with tokens
            are read. H100: ahead of grouped up to 24 routes an expert, level at 32, behind from 48
            (notes/inference.md)
  grouped   beyond: the training path's row kernels (push_rows / pull_rows) around its grouped GEMM
            (CUTLASS or torch._grouped_mm) and SwiGLU kernel
  dense     T <= dense_max (off unless set) and T * k >= E: every expert on every token as batched GEMMs, combined
            with a dense [T, E] weight matrix (TensorRT-LLM's small-batch idea), no shuffling
On the CPU the reference ops run ("reference": the same math in plain PyTorch).
"""
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops, reference
from ..autograd.grouped_gemm import _reference_mm, check_gmm_backend, choose_gmm_backend, mm_forward, row_offsets
from ..autograd.swiglu import swiglu_reference
from ..kernels.launch import on_device
from ..ops import SCORE_FUNCS, check_routing
from .shuffling import index_shuffling, shuffle_backend
from .tiling import check_tile_table, check_token_counts, tune_few_rows

MODES = ("auto", "few_rows", "grouped", "dense", "reference")
# The router's GEMV kernel up to T * E * M products (a program a logit: each re-reads its token's
# row and its expert's row), F.linear beyond: H100, kernel / F.linear at Qwen3 T = 8 4.1 / 5.0 us
# (2.1M products), T = 16 6.8 / 5.1; Scout T = 32 5.6 / 6.4 (2.6M), T = 64 9.9 / 6.4 (notes/inference.md).
ROUTER_KERNEL_MAX_PRODUCTS = 3 * 2 ** 20
# The split router (kernels.router.router_logit_parts, summed by the shuffle) from this many tokens,
# while its fp32 partials stay within ROUTER_PARTS_MAX_BYTES: H100, router alone, parts / the GEMV
# kernel / F.linear: Scout T = 32 1.8 / 5.4 / 5.9 us, 64 2.1 / 9.3 / 6.3, 256 3.5 / 33 / 6.5; Qwen3
# T = 16 1.8 / 6.7 / 4.9, 64 2.9 / 19 / 5.1, 256 (2 MiB of partials) 6.9 / 71 / 5.1 (notes/inference.md).
ROUTER_PARTS_MIN_TOKENS = 16
ROUTER_PARTS_MAX_BYTES = 1 << 20
FEW_ROWS_PER_EXPERT = 24  # the few-rows kernels serve up to T * k = this times E (H100 crossover, notes/inference.md)


def check_options(device: torch.device, mode: str = "auto", backend: Optional[str] = None,
                  gmm_backend: Optional[str] = None, few_rows_per_expert: int = FEW_ROWS_PER_EXPERT,
                  dense_max: int = 0):
    """SparseMoE's options that do not depend on its weights' shapes, checked for experts on device:
    load() checks them before it reads a checkpoint."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    ops.check_backend(backend)
    check_gmm_backend(gmm_backend)
    for name, value in (("few_rows_per_expert", few_rows_per_expert), ("dense_max", dense_max)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    _check_triton(mode, device)


def _check_triton(mode: str, device: torch.device):
    if mode in ("few_rows", "grouped") and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"mode {mode!r} runs Triton kernels: it needs CUDA tensors, or TRITON_INTERPRET=1 set "
                           "before turbomoe is imported (the CPU's modes: 'reference', 'dense')")


def _check_weights(w1_EMN: torch.Tensor, **others):
    """The block's weights in w1's floating dtype and on its device: no path takes a mixture (an fp32
    router beside bf16 experts failed at the first call inside F.linear; a shared expert of another
    dtype turned the whole stack into its dtype at the torch.cat)."""
    if not w1_EMN.is_floating_point():
        raise ValueError(f"w1 must be floating point, got {w1_EMN.dtype}")
    for name, t in others.items():
        if t is not None and (t.dtype != w1_EMN.dtype or t.device != w1_EMN.device):
            raise ValueError(f"{name} is {t.dtype} on {t.device}, w1 {w1_EMN.dtype} on {w1_EMN.device}: the router "
                             f"and the experts must share one dtype and device (cast with .to(w1.dtype))")


class SparseMoE(nn.Module):
    """router [E, M]; w1 [E, M, 2F] = [gate | up]; w2 [E, F, M]; optional shared expert
    shared_w1 [M, 2F], shared_w2 [F, M] (same F); k experts per token; softmax or sigmoid scores,
    renormalised over the k when asked; prescale multiplies the expert input by the score instead
    of the output (Llama 4's top-1)."""

    def __init__(self, router_EM: torch.Tensor, w1_EMN: torch.Tensor, w2_EFM: torch.Tensor, k: int,
                 score_func: str = "softmax", renormalize: bool = False, shared_w1_MN: Optional[torch.Tensor] = None,
                 shared_w2_FM: Optional[torch.Tensor] = None, prescale: bool = False, mode: str = "auto",
                 backend: Optional[str] = None, gmm_backend: Optional[str] = None,
                 few_rows_per_expert: int = FEW_ROWS_PER_EXPERT, dense_max: int = 0,
                 few_rows_tiles: Optional[dict] = None):
        super().__init__()
        for name, t, ndim in (("router", router_EM, 2), ("w1", w1_EMN, 3), ("w2", w2_EFM, 3)):
            if not isinstance(t, torch.Tensor) or t.dim() != ndim:
                raise ValueError(f"{name} must be a {ndim}-D tensor, got {tuple(getattr(t, 'shape', ())) or type(t).__name__}")
        ops.check_bool("renormalize", renormalize)
        ops.check_bool("prescale", prescale)
        E, M, N2 = w1_EMN.shape
        if router_EM.shape != (E, M) or w2_EFM.shape != (E, N2 // 2, M) or N2 % 2:
            raise ValueError(f"router [E, M], w1 [E, M, 2F], w2 [E, F, M] expected, got {tuple(router_EM.shape)}, "
                             f"{tuple(w1_EMN.shape)}, {tuple(w2_EFM.shape)}")
        _check_weights(w1_EMN, router=router_EM, w2=w2_EFM, shared_w1=shared_w1_MN, shared_w2=shared_w2_FM)
        check_options(w1_EMN.device, mode, backend, gmm_backend, few_rows_per_expert, dense_max)
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= E:
            raise ValueError(f"k must be an int in [1, E = {E}], got {k!r}")
        if prescale and k != 1:
            raise ValueError("prescale (the score applied to the expert input) needs k = 1")
        if k + (shared_w1_MN is not None) > ops.MAX_K:  # the row kernels' bound, on every backend alike
            raise ValueError(f"k ({k}) plus the shared expert must be at most {ops.MAX_K} routes a token")
        if (shared_w1_MN is None) != (shared_w2_FM is None):
            raise ValueError("a shared expert needs both shared_w1 and shared_w2")
        self.few_rows_tiles = check_tile_table(few_rows_tiles)
        if shared_w1_MN is not None:
            if shared_w1_MN.shape != (M, N2) or shared_w2_FM.shape != (N2 // 2, M):
                raise ValueError(f"the shared expert must have the routed experts' shapes [M, 2F] = [{M}, {N2}] and "
                                 f"[F, M], got {tuple(shared_w1_MN.shape)} and {tuple(shared_w2_FM.shape)}")
            w1_EMN = torch.cat([w1_EMN, shared_w1_MN[None]])  # group E: the shared expert's rows come last
            w2_EFM = torch.cat([w2_EFM, shared_w2_FM[None]])
        self.num_experts, self.k, self.score_func, self.renormalize = E, k, score_func, renormalize
        self.shared, self.prescale, self.mode = shared_w1_MN is not None, prescale, mode
        self.backend, self.gmm_backend = backend, gmm_backend
        self.few_rows_per_expert, self.dense_max = few_rows_per_expert, dense_max
        self.register_buffer("router", router_EM.contiguous(), persistent=False)
        self.register_buffer("w1", w1_EMN.contiguous(), persistent=False)
        self.register_buffer("w2", w2_EFM.contiguous(), persistent=False)

    @classmethod
    def from_hf_state_dict(cls, sd: dict, prefix: str, num_experts: int, k: int, renormalize: bool, **kw):
        """A Qwen3-MoE block from Hugging Face names (prefix 'model.layers.N.mlp.': gate.weight,
        experts.J.{gate,up,down}_proj.weight); the expert tensors are stacked (copied)."""
        def w(name):
            key = prefix + name
            if key not in sd:
                raise KeyError(f"missing weight {key}")
            return sd[key]
        gate_up = [torch.cat([w(f"experts.{j}.gate_proj.weight"), w(f"experts.{j}.up_proj.weight")]).t()
                   for j in range(num_experts)]
        down = [w(f"experts.{j}.down_proj.weight").t() for j in range(num_experts)]
        return cls(w("gate.weight"), torch.stack(gate_up), torch.stack(down), k, renormalize=renormalize, **kw)

    def tune(self, token_counts, **kw) -> dict:
        """Measures the few-rows GEMMs' tilings at those of token_counts that run few_rows (on this
        GPU, this layer's weights: turbomoe.inference.tiling) and uses the fastest from then on.
        Returns the table (few_rows_tiles), which a later SparseMoE or load() can be given."""
        tokens = [T for T in check_token_counts(token_counts)
                  if self.choose_mode(self.w1.new_empty(T, self.w1.shape[1])) == "few_rows"]
        with on_device(self.w1.device):
            self.few_rows_tiles.update(tune_few_rows(self, tokens, **kw))
        return self.few_rows_tiles

    def choose_mode(self, x_TM: torch.Tensor) -> str:
        if self.mode != "auto":
            return self.mode
        T = x_TM.shape[0]
        if ops.choose_backend(x_TM, self.backend) == "reference":  # the CPU's, or forced (argument, TURBOMOE_BACKEND)
            return "reference"
        if T <= self.dense_max and T * self.k >= self.num_experts:
            return "dense"
        few = T * self.k <= self.few_rows_per_expert * self.num_experts
        return "few_rows" if few and x_TM.is_cuda else "grouped"

    @torch.no_grad()
    def forward(self, x_TM: torch.Tensor) -> torch.Tensor:
        if x_TM.dim() != 2 or x_TM.shape[1] != self.w1.shape[1]:
            raise ValueError(f"x must be [T, {self.w1.shape[1]}], got {tuple(x_TM.shape)}")
        if x_TM.device != self.w1.device:
            raise ValueError(f"x is on {x_TM.device}, the experts on {self.w1.device}")
        if x_TM.dtype != self.w1.dtype:
            raise ValueError(f"x is {x_TM.dtype}, the experts {self.w1.dtype}")
        x_TM = x_TM.contiguous()
        mode = self.choose_mode(x_TM)
        _check_triton(mode, x_TM.device)  # auto with a forced backend, or experts moved since construction
        with on_device(x_TM.device):
            return self._run(x_TM, mode)

    def _run(self, x_TM: torch.Tensor, mode: str) -> torch.Tensor:
        if mode == "dense":
            return self._dense(x_TM, self._logits(x_TM, mode))
        r = self._shuffle(*self._router(x_TM, mode), mode)
        T, M = x_TM.shape
        R = r.slots.numel()
        if mode == "reference":
            rows = reference.scatter_tokens(x_TM, r.slots, R)
            if self.prescale:
                routed = r.row_routes >= 0
                rows = rows * torch.where(routed, r.scores.reshape(-1)[r.row_routes.clamp_min(0).long()], 0)[:, None]
                rows = rows.to(x_TM.dtype)
            y = _reference_mm(swiglu_reference(_reference_mm(rows, self.w1, r.counts)), self.w2, r.counts)
            weights = torch.ones_like(r.scores) if self.prescale else r.scores
            return reference.gather_tokens(y, r.slots, weights)
        if mode == "few_rows":  # the gather, split sums and combine folded into three launches
            from ..kernels.few_rows_gemm import combine, few_rows_down, few_rows_up
            up_tiles, down_tiles = self.few_rows_tiles.get(T, (None, None))  # None: few_rows_tiles' rule
            h = few_rows_up(x_TM, r.row_routes, r.slots.shape[1], self.w1, r.counts, T,
                            r.scores if self.prescale else None, tiles=up_tiles)
            return combine(few_rows_down(h, self.w2, r.counts, T, tiles=down_tiles), r.slots,
                           None if self.prescale else r.scores, x_TM.dtype)
        impl = ops._impl(ops.choose_backend(x_TM, self.backend, self.num_experts + self.shared))
        rows = torch.empty(R, M, dtype=x_TM.dtype, device=x_TM.device)
        impl.push_rows(x_TM, r.slots, rows, r.counts, None, scores_SK=r.scores if self.prescale else None)
        from ..kernels.swiglu import swiglu_forward
        gmm = choose_gmm_backend(rows, self.w1, self.gmm_backend)
        offs = row_offsets(r.counts, R) if gmm in ("torch", "cutlass") else None
        y = mm_forward(swiglu_forward(mm_forward(rows, self.w1, r.counts, gmm, offs)), self.w2, r.counts, gmm, offs)
        out = torch.empty_like(x_TM)
        impl.pull_rows(y, r.slots, out, None if self.prescale else r.scores)
        return out

    def _router(self, x_TM: torch.Tensor, mode: str):
        """(logits [T, E], None), or from ROUTER_PARTS_MIN_TOKENS tokens on a GPU (16-bit, the Triton
        shuffle) the split router's fp32 partial sums [S, T, E] and the dtype their sum rounds to:
        the shuffle sums them as it loads, so the router is one launch (F.linear takes two, the GEMV
        kernel T x E programs)."""
        from ..kernels.router import PARTS_BLOCK_K, router_logit_parts
        T, E = x_TM.shape[0], self.num_experts
        parts_bytes = 4 * T * E * -(-x_TM.shape[1] // PARTS_BLOCK_K)
        if (mode != "reference" and x_TM.is_cuda and x_TM.dtype in (torch.bfloat16, torch.float16)
                and T >= ROUTER_PARTS_MIN_TOKENS and parts_bytes <= ROUTER_PARTS_MAX_BYTES
                and shuffle_backend(x_TM, T, E, self.k, self.shared, self.backend) == "triton"):
            return router_logit_parts(x_TM, self.router), x_TM.dtype
        return self._logits(x_TM, mode), None

    def _shuffle(self, logits: torch.Tensor, parts_dtype: Optional[torch.dtype], mode: str):
        if parts_dtype is None:
            return index_shuffling(logits, self.k, self.score_func, self.renormalize, self.shared,
                                   "reference" if mode == "reference" else self.backend)
        from ..kernels.shuffling import index_shuffling as triton_shuffling
        check_routing(logits[0], self.k, self.score_func)
        return triton_shuffling(logits, self.k, self.score_func, self.renormalize, self.shared,
                                parts_dtype=parts_dtype)

    def _logits(self, x_TM: torch.Tensor, mode: str) -> torch.Tensor:
        """The router's logits: its own GEMV kernel for a few tokens (one launch where BLAS takes two),
        F.linear beyond and on the reference path."""
        if (mode == "reference" or x_TM.numel() * self.num_experts > ROUTER_KERNEL_MAX_PRODUCTS
                or ops.choose_backend(x_TM, self.backend) == "reference"):
            return F.linear(x_TM, self.router)
        from ..kernels.router import router_logits
        return router_logits(x_TM, self.router)

    def _dense(self, x_TM: torch.Tensor, logits_TE: torch.Tensor) -> torch.Tensor:
        """Every expert on every token (batched GEMMs), combined by a dense [T, E'] weight matrix in fp32
        (fp64 for fp64, as the other modes)."""
        g = ops.topk_gating(logits_TE, self.k, self.score_func, self.renormalize, backend=self.backend)
        T, E = logits_TE.shape
        acc = reference.compute_dtype(x_TM.dtype)
        ids = g.expert_ids.long().clamp_min(0)
        routed = g.expert_ids >= 0
        w_TE = x_TM.new_zeros(T, E + self.shared, dtype=acc).scatter_(1, ids,
                                                                      torch.where(routed, g.scores.to(acc), 0.0))
        chosen_TE = torch.zeros_like(w_TE).scatter_(1, ids, routed.to(acc))
        if self.shared:
            w_TE[:, E] = chosen_TE[:, E] = 1.0
        xs = x_TM.expand(self.w1.shape[0], *x_TM.shape)
        if self.prescale:  # the score scales the input; the output is summed unweighted over the chosen
            xs = (xs * w_TE.t()[:, :, None]).to(x_TM.dtype)
            w_TE = chosen_TE
        y_ETM = torch.bmm(swiglu_reference(torch.bmm(xs, self.w1)), self.w2)
        # An expert a token did not choose adds nothing, whatever it computed there (its weight 0 times
        # an Inf or NaN output would be NaN: the other modes never run it).
        y_ETM = torch.where(chosen_TE.t()[:, :, None] > 0, y_ETM.to(acc), 0.0)
        return torch.einsum("te,etm->tm", w_TE, y_ETM).to(x_TM.dtype)
