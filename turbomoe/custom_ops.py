"""turbomoe's ops as torch.library custom ops, so torch.compile(fullgraph=True) traces through
them: topk_gating -> assign_slots -> scatter_tokens -> grouped_mm / swiglu -> gather_tokens.
turbomoe.ops, the grouped GEMM and SwiGLU call these only while compiling
(torch.compiler.is_compiling()); eager calls keep their autograd.Functions (their host time was tuned).

Each op is opaque to the compiler (its kernels run as they do eagerly), has a fake implementation
(shapes and dtypes only, for tracing) and its autograd registered from the existing
autograd.Function's backward (turbomoe/autograd): the same launchers and the same backward code,
driven through torch.library instead of Function.apply. The functions below take the arguments of
turbomoe.ops (after its checks) and a kernel backend, "cuda" or "triton". The reference backend's
topk_gating and gather_tokens are plain PyTorch that the compiler traces itself; its assign_slots and
scatter_tokens have data-dependent shapes (nonzero), so they run as custom ops too (backend
"reference"). The grouped GEMM takes its own backends (cutlass, torch, triton, reference).

    from turbomoe import custom_ops
    g = custom_ops.topk_gating(logits_SE, k, "softmax", renormalize, None, "triton")
    s = custom_ops.assign_slots(g.expert_ids, g.scores, E, None, "position", 0, "triton")
    out_SM = custom_ops.gather_tokens(experts(custom_ops.scatter_tokens(x_SM, s, "triton")), s, g.scores, False, "triton")
"""
from typing import Optional, Tuple

import torch

from . import ops
from . import reference
from .autograd.gather import GatherTokens
from .autograd.gating import TopKGating
from .autograd.grouped_gemm import GroupedMM, mm_forward, wgrad_transposed
from .autograd.scatter import ScatterTokens
from .autograd.swiglu import SwiGLU
from .reference import GatingOutput, Slots, as_contiguous, compute_dtype


class _Saved:
    """The ctx an autograd.Function's backward reads (saved_tensors and attributes), rebuilt inside
    a backward custom op from its arguments."""

    def __init__(self, *saved_tensors, **attributes):
        self.saved_tensors = saved_tensors
        self.__dict__.update(attributes)


# ---------------------------------------------------------------- topk_gating

@torch.library.custom_op("turbomoe::topk_gating", mutates_args=())
def _topk_gating(logits_SE: torch.Tensor, k: int, score_func: str, renormalize: bool,
                 bias_E: Optional[torch.Tensor], backend: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      torch.Tensor]:
    """ids, scores, counts, aux, z, and for backward lse [S] and ce [E]."""
    ids, scores, counts, aux, z, kept = TopKGating.forward(logits_SE, k, score_func, renormalize, bias_E,
                                                           ops._impl(backend))
    lse_S, ce_E = kept.tensors
    # A custom op's outputs may not view one another: ce, aux and z are slices of one stats buffer
    # in the Triton launcher, so they are copied (E + 2 values).
    return ids, scores, counts, aux.clone(), z.clone(), lse_S, ce_E.clone()


@_topk_gating.register_fake
def _(logits_SE, k, score_func, renormalize, bias_E, backend):
    S, E = logits_SE.shape
    acc = compute_dtype(logits_SE.dtype)
    empty = logits_SE.new_empty
    return (empty(S, k, dtype=torch.int32), empty(S, k, dtype=acc), empty(E, dtype=torch.int32), empty((), dtype=acc),
            empty((), dtype=acc), empty(S, dtype=acc), empty(E, dtype=acc))


@torch.library.custom_op("turbomoe::topk_gating_backward", mutates_args=())
def _topk_gating_backward(logits_SE: torch.Tensor, ids_SK: torch.Tensor, lse_S: torch.Tensor, ce_E: torch.Tensor,
                          g_scores: Optional[torch.Tensor], g_aux: Optional[torch.Tensor], g_z: Optional[torch.Tensor],
                          score_func: str, renormalize: bool, backend: str) -> torch.Tensor:
    ctx = _Saved(logits_SE, ids_SK, lse_S, ce_E, config=(score_func == "sigmoid", renormalize, ops._impl(backend)))
    return TopKGating.backward(ctx, None, g_scores, None, g_aux, g_z, None)[0]


@_topk_gating_backward.register_fake
def _(logits_SE, ids_SK, lse_S, ce_E, g_scores, g_aux, g_z, score_func, renormalize, backend):
    return logits_SE.new_empty(logits_SE.shape)  # contiguous, as the kernels make it whatever logits' strides


def _gating_setup(ctx, inputs, output):
    logits_SE, k, score_func, renormalize, bias_E, backend = inputs
    ids, _, _, _, _, lse_S, ce_E = output
    ctx.mark_non_differentiable(lse_S, ce_E)  # backward's inputs: a gradient through them would be dropped
    ctx.save_for_backward(logits_SE, ids, lse_S, ce_E)
    ctx.config = (score_func, renormalize, backend)


def _gating_backward(ctx, g_ids, g_scores, g_counts, g_aux, g_z, _g_lse, _g_ce):  # lse and ce only serve backward
    grad = _topk_gating_backward(*ctx.saved_tensors, g_scores, g_aux, g_z, *ctx.config)
    return grad, None, None, None, None, None


_topk_gating.register_autograd(_gating_backward, setup_context=_gating_setup)


def topk_gating(logits_SE, k: int, score_func: str, renormalize: bool, selection_bias_E, backend: str) -> GatingOutput:
    return GatingOutput(*_topk_gating(logits_SE, k, score_func, renormalize, selection_bias_E, backend)[:5])


# ---------------------------------------------------------------- assign_slots (integer: no autograd)

@torch.library.custom_op("turbomoe::assign_slots", mutates_args=())
def _assign_slots(expert_ids_SK: torch.Tensor, scores_SK: torch.Tensor, num_experts: int, capacity: Optional[int],
                  drop_policy: str, seed: int, backend: str,
                  seed_draw: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """seed_draw: ops.assign_slots' (a CPU tensor; reading it here is no device sync)."""
    impl = reference if backend == "reference" else ops._impl(backend)
    seed = seed if seed_draw is None else seed ^ int(seed_draw)
    s = impl.assign_slots(expert_ids_SK, scores_SK, num_experts, capacity, drop_policy, seed)
    kept_E = s.kept_counts
    # The Triton launcher's kept counts are the last row of its [blocks, E] running sums: past one block of
    # routes a view at an offset, which the fake (a tensor of its own) does not have; inductor then asserts
    # them 16-byte aligned, which they are not where E is no multiple of 4 (E = 5, two blocks: 20 bytes in).
    return s.slots.contiguous(), kept_E.clone() if kept_E.storage_offset() else kept_E


@_assign_slots.register_fake
def _(expert_ids_SK, scores_SK, num_experts, capacity, drop_policy, seed, backend, seed_draw=None):
    return (expert_ids_SK.new_empty(expert_ids_SK.shape, dtype=torch.int32),
            expert_ids_SK.new_empty(num_experts, dtype=torch.int32))


def assign_slots(expert_ids_SK, scores_SK, num_experts: int, capacity: Optional[int], drop_policy: str, seed: int,
                 backend: str, seed_draw: Optional[torch.Tensor] = None) -> Slots:
    # The kernels hash the seed's low 32 bits (reference.hash32_int): so masked, any seed fits the op's int64.
    slots_SK, kept_E = _assign_slots(expert_ids_SK, scores_SK, num_experts, capacity, drop_policy, seed & 0xFFFFFFFF,
                                     backend, seed_draw)
    S, k = expert_ids_SK.shape
    return Slots(slots_SK, kept_E, S * k if capacity is None else num_experts * capacity, capacity)


# ---------------------------------------------------------------- scatter_tokens

@torch.library.custom_op("turbomoe::scatter_tokens", mutates_args=())
def _scatter_tokens(x_SM: torch.Tensor, slots_SK: torch.Tensor, num_rows: int, kept_counts_E: Optional[torch.Tensor],
                    capacity: Optional[int], backend: str) -> torch.Tensor:
    if backend == "reference":
        return reference.scatter_tokens(x_SM, slots_SK, num_rows)
    return ScatterTokens.forward(x_SM, slots_SK, num_rows, kept_counts_E, capacity, ops._impl(backend))[0]


@_scatter_tokens.register_fake
def _(x_SM, slots_SK, num_rows, kept_counts_E, capacity, backend):
    return x_SM.new_empty(num_rows, x_SM.shape[1])


@torch.library.custom_op("turbomoe::scatter_tokens_backward", mutates_args=())
def _scatter_tokens_backward(grad_buf_RM: torch.Tensor, slots_SK: torch.Tensor, backend: str) -> torch.Tensor:
    if backend == "reference":  # each token sums its kept rows' gradients: a gather with unit weights
        return reference.gather_tokens(grad_buf_RM, slots_SK, grad_buf_RM.new_ones(slots_SK.shape))
    return ScatterTokens.backward(_Saved(slots_SK, impl=ops._impl(backend)), grad_buf_RM, None)[0]


@_scatter_tokens_backward.register_fake
def _(grad_buf_RM, slots_SK, backend):
    return grad_buf_RM.new_empty(slots_SK.shape[0], grad_buf_RM.shape[1])


def _scatter_setup(ctx, inputs, output):
    _, slots_SK, _, _, _, backend = inputs
    ctx.save_for_backward(as_contiguous(slots_SK, torch.int32))
    ctx.backend = backend


def _scatter_backward(ctx, grad_buf_RM):
    return _scatter_tokens_backward(grad_buf_RM, *ctx.saved_tensors, ctx.backend), None, None, None, None, None


_scatter_tokens.register_autograd(_scatter_backward, setup_context=_scatter_setup)


def scatter_tokens(x_SM, slots: Slots, backend: str):
    return _scatter_tokens(x_SM, slots.slots, slots.num_rows, slots.kept_counts, slots.capacity, backend)


# ---------------------------------------------------------------- gather_tokens

@torch.library.custom_op("turbomoe::gather_tokens", mutates_args=())
def _gather_tokens(y_RM: torch.Tensor, slots_SK: torch.Tensor, scores_SK: Optional[torch.Tensor],
                   kept_counts_E: Optional[torch.Tensor], capacity: Optional[int], renormalize: bool,
                   backend: str) -> torch.Tensor:
    return GatherTokens.forward(y_RM, slots_SK, scores_SK, kept_counts_E, capacity, ops._impl(backend), renormalize)[0]


@_gather_tokens.register_fake
def _(y_RM, slots_SK, scores_SK, kept_counts_E, capacity, renormalize, backend):
    return y_RM.new_empty(slots_SK.shape[0], y_RM.shape[1])


@torch.library.custom_op("turbomoe::gather_tokens_backward", mutates_args=())
def _gather_tokens_backward(grad_out_SM: torch.Tensor, y_RM: torch.Tensor, slots_SK: torch.Tensor,
                            scores_SK: torch.Tensor, kept_counts_E: Optional[torch.Tensor], capacity: Optional[int],
                            renormalize: bool, backend: str) -> Tuple[torch.Tensor, torch.Tensor]:
    ctx = _Saved(y_RM, slots_SK, scores_SK, kept_counts_E, capacity=capacity, impl=ops._impl(backend),
                 renormalize=renormalize, num_rows=y_RM.shape[0])
    grad_y_RM, _, grad_scores_SK, *_ = GatherTokens.backward(ctx, grad_out_SM, None)
    return grad_y_RM, grad_scores_SK


@_gather_tokens_backward.register_fake
def _(grad_out_SM, y_RM, slots_SK, scores_SK, kept_counts_E, capacity, renormalize, backend):
    return torch.empty_like(y_RM), torch.empty_like(scores_SK)


def _gather_setup(ctx, inputs, output):
    y_RM, slots_SK, scores_SK, kept_counts_E, capacity, renormalize, backend = inputs
    slots_SK = as_contiguous(slots_SK, torch.int32)
    if scores_SK is None:  # unit weights: the backward is a scatter, and y is not kept
        ctx.save_for_backward(slots_SK, kept_counts_E)
    else:
        ctx.save_for_backward(y_RM.contiguous(), slots_SK, scores_SK.contiguous(), kept_counts_E)
    ctx.config, ctx.num_rows, ctx.unit_weights = (capacity, renormalize, backend), y_RM.shape[0], scores_SK is None


def _gather_backward(ctx, grad_out_SM):
    if ctx.unit_weights:
        slots_SK, kept_counts_E = ctx.saved_tensors
        capacity, _, backend = ctx.config
        grad_y_RM = _scatter_tokens(grad_out_SM.contiguous(), slots_SK, ctx.num_rows, kept_counts_E, capacity,
                                    backend)
        return grad_y_RM, None, None, None, None, None, None
    grad_y_RM, grad_scores_SK = _gather_tokens_backward(grad_out_SM, *ctx.saved_tensors, *ctx.config)
    return grad_y_RM, None, grad_scores_SK, None, None, None, None


_gather_tokens.register_autograd(_gather_backward, setup_context=_gather_setup)


def gather_tokens(y_RM, slots: Slots, scores_SK, renormalize: bool, backend: str):
    return _gather_tokens(y_RM, slots.slots, scores_SK, slots.kept_counts, slots.capacity, renormalize, backend)


# ---------------------------------------------------------------- grouped_mm (turbomoe.autograd.grouped_gemm)

@torch.library.custom_op("turbomoe::grouped_mm", mutates_args=())
def _grouped_mm(x_RK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor, offs_G: Optional[torch.Tensor],
                backend: str) -> torch.Tensor:
    return mm_forward(x_RK, w_GKN, counts_G, backend, offs_G)


@_grouped_mm.register_fake
def _(x_RK, w_GKN, counts_G, offs_G, backend):
    return x_RK.new_empty(x_RK.shape[0], w_GKN.shape[2])


@torch.library.custom_op("turbomoe::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(dy_RN: torch.Tensor, x_RK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor,
                         offs_G: Optional[torch.Tensor], backend: str, need_dx: bool,
                         need_dw: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw); a gradient not needed is an empty tensor (a custom op returns no None)."""
    ctx = _Saved(x_RK, w_GKN, counts_G, offs_G, backend=backend, main_grad=None, grad_into_w=None,
                 w_grad_first=False, needs_input_grad=(need_dx, need_dw))
    dx, dw = GroupedMM.backward(ctx, dy_RN)[:2]
    return (x_RK.new_empty(0) if dx is None else dx), (w_GKN.new_empty(0) if dw is None else dw)


@_grouped_mm_backward.register_fake
def _(dy_RN, x_RK, w_GKN, counts_G, offs_G, backend, need_dx, need_dw):
    G, K, N = w_GKN.shape
    # dw's layout as GroupedMM.backward makes it: w's transposed view where w is one (nn.Linear weights)
    dw = w_GKN.new_empty(G, N, K).transpose(1, 2) if wgrad_transposed(w_GKN) else w_GKN.new_empty(G, K, N)
    # dx contiguous, as the GEMM makes it whatever x's strides
    return (x_RK.new_empty(x_RK.shape) if need_dx else x_RK.new_empty(0)), (dw if need_dw else w_GKN.new_empty(0))


def _gmm_setup(ctx, inputs, output):
    x_RK, w_GKN, counts_G, offs_G, backend = inputs
    ctx.save_for_backward(x_RK, w_GKN, counts_G, offs_G)
    ctx.backend = backend


def _gmm_backward(ctx, dy_RN):
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = _grouped_mm_backward(dy_RN, *ctx.saved_tensors, ctx.backend, need_dx, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None, None


_grouped_mm.register_autograd(_gmm_backward, setup_context=_gmm_setup)


def grouped_mm(x_RK, w_GKN, counts_G, offs_G, backend: str):
    """GroupedMM.apply's arguments (after grouped_gemm.grouped_mm's checks and backend choice)."""
    return _grouped_mm(x_RK, w_GKN, counts_G, offs_G, backend)


# ---------------------------------------------------------------- swiglu (turbomoe.autograd.swiglu, Triton)

@torch.library.custom_op("turbomoe::swiglu", mutates_args=())
def _swiglu(h_R2F: torch.Tensor, scale_R: Optional[torch.Tensor] = None) -> torch.Tensor:
    return SwiGLU.forward(h_R2F, scale_R)


@_swiglu.register_fake
def _(h_R2F, scale_R=None):
    return h_R2F.new_empty(h_R2F.shape[0], h_R2F.shape[1] // 2)


@torch.library.custom_op("turbomoe::swiglu_backward", mutates_args=())
def _swiglu_backward(da_RF: torch.Tensor, h_R2F: torch.Tensor,
                     scale_R: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    dh, ds = SwiGLU.backward(_Saved(h_R2F, scale_R), da_RF)
    return dh, h_R2F.new_empty(0) if ds is None else ds  # an op returns tensors: no scale, an empty one


@_swiglu_backward.register_fake
def _(da_RF, h_R2F, scale_R):
    return torch.empty_like(h_R2F), h_R2F.new_empty(0) if scale_R is None else torch.empty_like(scale_R)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grads(ctx, da_RF):
    h_R2F, scale_R = ctx.saved_tensors
    dh, ds = _swiglu_backward(da_RF, h_R2F, scale_R)
    return dh, None if scale_R is None else ds


_swiglu.register_autograd(_swiglu_grads, setup_context=_swiglu_setup)


def swiglu(h_R2F, scale_R=None):
    """SwiGLU.apply's arguments: h [R, 2F] with unit column stride, on the device Triton runs on; an
    optional contiguous row scale [R]."""
    return _swiglu(h_R2F, scale_R)
