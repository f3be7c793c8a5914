"""Grouped GEMM over expert-contiguous rows, differentiable, counts on the device.

    y = grouped_mm(x_RK, w_GKN, counts_G)      # y[rows_g] = x[rows_g] @ w[g]

x_RK [R, K]: rows sorted by group; group g owns rows offset_g .. offset_g + counts[g] with
offset_g = sum(counts[:g]). w_GKN [G, K, N]. counts_G [G] int32 on x's device. Rows past
sum(counts) are unspecified in y and get no gradient (callers never read them). Counts that sum past
R cannot be checked without a host sync: every backend truncates the last groups at row R (offsets
computed here are clamped to R; offs_G passed in must be valid). Counts must be >= 0: checked eagerly where
that costs no host sync (CPU tensors, TURBOMOE_DEBUG=1: reference.debug_checks). No host sync on
CUDA: the launches do not depend on counts' values, so the call is CUDA-graph capturable.

Backends (one autograd.Function, hand-written backward: dx = dy @ w[g]^T, dw[g] = x_g^T @ dy_g):
  cutlass    turbomoe.csrc.grouped_mm (CUTLASS's sm90 kernel, 128 x 256 tiles, no cluster) for y
             and dx, and for dw turbomoe.csrc.grouped_mm_wgrad (the groups handed to the persistent
             kernel longest first) where groups average at least CUTLASS_WGRAD_MIN_ROWS rows, else
             torch._grouped_mm: bf16 on sm90, K and N multiples of 8, each w[g] contiguous (or its
             transpose), the groups 16-byte-aligned apart, the nvidia-cutlass headers. At 256 rows
             per expert y and dx took 11-26% less time than torch._grouped_mm; dw with unbalanced
             groups of thousands of rows (a recipe's early routing) up to 18% less (notes/bench_layer.md)
  torch      torch._grouped_mm (CUTLASS on Hopper): bf16 on sm90+, K and N multiples of 8
  triton     turbomoe.kernels.grouped_gemm: a persistent Triton grouped GEMM; fp16, bf16, fp32 (fp32
             accumulation; on the CPU under TRITON_INTERPRET=1, fp16 and fp32)
  reference  a loop over groups in plain PyTorch: the CPU path and the test oracle (host sync)
The default on CUDA is the first of cutlass, torch, triton that applies (float64: reference); on the
CPU, triton where it runs there (TRITON_INTERPRET=1) and takes the dtype, else reference.
Force one with backend= or TURBOMOE_GMM_BACKEND.
"""
import os
from typing import Callable, Optional, Union

import torch

from .. import csrc
from ..reference import as_contiguous, debug_checks
from . import Function, _plain, kernel_backward, under_func

GMM_BACKENDS = ("cutlass", "torch", "triton", "reference")
# Gradient-accumulation fusion into an fp32 buffer: the cutlass backend adds inside its own weight-
# gradient kernel (CUTLASS's epilogue reads the buffer as C: 1.19-1.52x dw + add, 1.23-1.33x the Triton
# kernel, at every shape measured; H100, 2026-11-25); other backends run the Triton kernel with the add
# in its epilogue where groups average at most this many rows (there the buffer's traffic dominates),
# beyond it torch's faster GEMM and a separate add (notes/bench_layer.md).
FUSED_WGRAD_MAX_ROWS = 1024
# The cutlass backend's weight gradient runs turbomoe's CUTLASS kernel where groups average at least
# this many rows (the same bits as torch's; against it 0.99-1.04x balanced, 1.04-1.22x with the
# recipes' unbalanced groups of 2048-4096 rows) and torch._grouped_mm below (level there: 0.96-1.07x
# at 256-768 rows; H100, 2026-11-25, notes/bench_layer.md).
CUTLASS_WGRAD_MIN_ROWS = 1536


@torch.compiler.assume_constant_result  # a constant to torch.compile (lru_cache is not, to dynamo)
def _sm(device_index: int) -> int:
    """The compute capability as one int (90: sm_90), an int so that traced comparisons are plain."""
    from ..kernels.launch import compute_capability  # lazily: kernels import triton (TRITON_INTERPRET)
    return compute_capability(device_index)


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks: recompute's, activation
    checkpointing's) are active here: the saved tensors may then come back as other tensors, made anew."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _torch_gmm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and _sm(_device_index(x)) >= 90 and x.shape[1] % 8 == 0 and w.shape[2] % 8 == 0)


def _cutlass_gmm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The sm90a kernel: where torch's applies (its kernel takes the weight gradient), on Hopper
    only; w bf16, each w[g] a contiguous [K, N] or the transpose of a contiguous [N, K], the groups
    any 16-byte-aligned distance apart (the drop-in's experts stacked over packed parameters);
    16-byte aligned operands for TMA."""
    if not (_torch_gmm_applies(x, w) and w.dtype == torch.bfloat16):
        return False
    G, K, N = w.shape
    layout_ok = w.stride()[1:] in ((N, 1), (1, K)) and (G == 1 or w.stride(0) % 8 == 0)
    # Traced tensors have no addresses: mm_forward checks the alignment when the custom op runs.
    aligned = torch.compiler.is_compiling() or _aligned16(x, w)
    return layout_ok and aligned and _sm(_device_index(x)) == 90 and csrc.gmm_available()


def _aligned16(*tensors: torch.Tensor) -> bool:
    if torch._C._are_functorch_transforms_active():  # torch.func's wrappers have no memory: the tensors beneath
        tensors = [_plain(t, "grouped_mm") for t in tensors]
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _tma_operands(*tensors: torch.Tensor) -> bool:
    """Contiguous and 16-byte aligned: what turbomoe's CUTLASS weight-gradient kernels read."""
    return all(t.is_contiguous() for t in tensors) and _aligned16(*tensors)


def _tma_groups(d: torch.Tensor) -> bool:
    """Each d[g] a contiguous [M, N], the groups 16-byte-aligned apart: what turbomoe's CUTLASS
    weight-gradient kernels write into in place (grouped_mm_wgrad_into_)."""
    G, M, N = d.shape
    return (d.stride()[1:] == (N, 1) and (G == 1 or d.stride(0) * d.element_size() % 16 == 0)
            and _aligned16(d))


def check_gmm_backend(backend: Optional[str]):
    """backend is None (chosen per call) or one of GMM_BACKENDS: modules check it when built."""
    if backend is not None and backend not in GMM_BACKENDS:
        raise ValueError(f"unknown grouped GEMM backend {backend!r}: gmm_backend must be one of {GMM_BACKENDS}")


def forced_gmm_backend(backend: Optional[str] = None) -> Optional[str]:
    """The grouped GEMM backend a caller forces: the argument, else TURBOMOE_GMM_BACKEND; None: chosen per call."""
    return backend or os.environ.get("TURBOMOE_GMM_BACKEND")


def choose_gmm_backend(x: torch.Tensor, w: torch.Tensor, backend: Optional[str] = None) -> str:
    backend = forced_gmm_backend(backend)
    if backend is None:
        if not _triton_gmm_takes(x):
            return "reference"
        if _cutlass_gmm_applies(x, w):
            return "cutlass"
        return "torch" if _torch_gmm_applies(x, w) else "triton"
    check_gmm_backend(backend)
    if backend == "cutlass" and not _cutlass_gmm_applies(x, w):
        raise ValueError("the cutlass grouped GEMM backend needs torch._grouped_mm, bf16 CUDA tensors on sm90 "
                         "(Hopper), K and N multiples of 8, each w[g] contiguous or the transpose of a contiguous block (the groups "
                         "16-byte-aligned apart), 16-byte aligned "
                         "operands, and the nvidia-cutlass headers with nvcc to build it")
    if backend == "torch" and not _torch_gmm_applies(x, w):
        raise ValueError("the torch grouped GEMM backend needs torch._grouped_mm, bf16 CUDA tensors on "
                         "sm90+, and K, N multiples of 8")
    if backend == "triton" and not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the triton grouped GEMM backend needs CUDA tensors, or TRITON_INTERPRET=1 "
                           "set before turbomoe is imported")
    if backend == "triton" and not _triton_gmm_takes(x):
        raise TypeError(f"the triton grouped GEMM takes {_TRITON_GMM_DTYPES[x.is_cuda]} "
                        f"{'CUDA' if x.is_cuda else 'CPU (interpreted)'} tensors, got {x.dtype}: "
                        "use the reference backend")
    return backend


# The Triton kernels accumulate in fp32 (an fp64 product would be rounded); Triton's CPU interpreter
# also gets bf16 tl.dot wrong (numpy has no bf16; triton 3.9), so on the CPU it takes fp16 and fp32.
_TRITON_GMM_DTYPES = {True: (torch.float16, torch.bfloat16, torch.float32), False: (torch.float16, torch.float32)}


def _triton_gmm_takes(x: torch.Tensor) -> bool:
    """Whether the Triton grouped GEMM computes x's dtype right where x lives (the default's choice:
    CPU tensors only under TRITON_INTERPRET=1)."""
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return x.dtype in _TRITON_GMM_DTYPES[x.is_cuda]


def row_offsets(counts_G: torch.Tensor, num_rows: Optional[int] = None) -> torch.Tensor:
    """Inclusive int32 row offsets [G] (torch._grouped_mm's `offs`): compute once, pass to every GEMM.
    With num_rows, clamped to it (one launch more), so no kernel reads or writes past row R however
    the counts sum."""
    offs_G = torch.cumsum(counts_G, 0, dtype=torch.int32)
    return offs_G if num_rows is None else offs_G.clamp_(max=num_rows)


def _offsets(counts_G: torch.Tensor, num_rows: int, offs_G: Optional[torch.Tensor]) -> torch.Tensor:
    """The caller's offsets (contiguous int32, as both kernels need: under torch.compile on the H100,
    inductor handed the capacity layer's offsets as int64), else row_offsets clamped to the rows there are."""
    return row_offsets(counts_G, num_rows) if offs_G is None else as_contiguous(offs_G, torch.int32)


def _reference_mm(x_RK, w_GKN, counts_G):
    y = x_RK.new_zeros(x_RK.shape[0], w_GKN.shape[2])
    start = 0
    for g, n in enumerate(counts_G.tolist()):
        y[start:start + n] = x_RK[start:start + n] @ w_GKN[g]
        start += n
    return y


def _reference_wgrad(x_RK, dy_RN, counts_G):
    """The groups' products stacked (an empty group's is zero), not written into a buffer: torch.func's
    jacrev batches dy, not x, and vmap refuses to write a batched product into an unbatched buffer."""
    dw, start = [], 0
    for n in counts_G.tolist():
        dw.append(x_RK[start:start + n].t() @ dy_RN[start:start + n])
        start += n
    return torch.stack(dw) if dw else x_RK.new_zeros(0, x_RK.shape[1], dy_RN.shape[1])


def mm_forward(x_RK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor, backend: str,
               offs_G: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [R, N], no autograd. w may be a transposed view: the input gradient calls this on w^T."""
    if backend in ("torch", "cutlass"):
        offs_G = _offsets(counts_G, x_RK.shape[0], offs_G)
        if backend == "cutlass" and _aligned16(x_RK, w_GKN):  # TMA; misaligned operands go to torch
            return csrc.grouped_mm(x_RK, w_GKN, offs_G)
        return torch._grouped_mm(x_RK, w_GKN, offs=offs_G)
    if backend == "triton":
        from ..kernels.grouped_gemm import grouped_mm as triton_mm
        return triton_mm(x_RK, w_GKN, counts_G)
    return _reference_mm(x_RK, w_GKN, counts_G)


def wgrad_transposed(w_GKN: torch.Tensor) -> bool:
    """Whether dw is made in w's transposed layout (each group's [N, K] block seen as [K, N], as
    nn.Linear weights stacked): then dw = (dy^T x) viewed transposed, with w's strides."""
    return w_GKN.stride(1) == 1 and w_GKN.stride(2) != 1


def mm_wgrad(x_RK: torch.Tensor, dy_RN: torch.Tensor, counts_G: torch.Tensor, backend: str,
             offs_G: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
             accumulate: bool = True) -> torch.Tensor:
    """dw [G, K, N] = x_g^T @ dy_g per group, no autograd; zero for empty groups. The cutlass backend
    takes torch's kernel where groups average fewer than CUTLASS_WGRAD_MIN_ROWS rows.
    out (a [G, K, N] float buffer, e.g. an fp32 main_grad or a bf16 .grad): out += dw in place
    (accumulate), or out = dw, returned. The cutlass backend's kernel does either in its epilogue where
    out is fp32 or bf16 with each out[g] contiguous and 16-byte aligned (no second pass); else out += dw
    runs inside the Triton kernel (torch's cannot accumulate) where groups average at most
    FUSED_WGRAD_MAX_ROWS rows, and otherwise the backend's dw is added or copied."""
    if out is not None:
        if (backend == "cutlass" and out.dtype in (torch.float32, torch.bfloat16) and _tma_operands(x_RK, dy_RN)
                and _tma_groups(out)):
            return csrc.grouped_mm_wgrad_into_(x_RK, dy_RN, _offsets(counts_G, x_RK.shape[0], offs_G), out, accumulate)
        if not accumulate:
            return out.copy_(mm_wgrad(x_RK, dy_RN, counts_G, backend, offs_G))
        few_rows = x_RK.shape[0] <= FUSED_WGRAD_MAX_ROWS * counts_G.shape[0]
        if backend == "triton" or (x_RK.is_cuda and few_rows and backend != "reference"):
            from ..kernels.grouped_gemm import grouped_mm_wgrad as triton_wgrad
            return triton_wgrad(x_RK, dy_RN, counts_G, out)
        if backend == "reference":  # its own loop on every device (fp64 on CUDA: no Triton kernel for it)
            return out.add_(_reference_wgrad(x_RK.to(out.dtype), dy_RN.to(out.dtype), counts_G))
        return out.add_(mm_wgrad(x_RK, dy_RN, counts_G, backend, offs_G))
    if backend in ("torch", "cutlass"):
        offs_G = _offsets(counts_G, x_RK.shape[0], offs_G)
        if (backend == "cutlass" and x_RK.shape[0] >= CUTLASS_WGRAD_MIN_ROWS * counts_G.shape[0]
                and _tma_operands(x_RK, dy_RN)):
            return csrc.grouped_mm_wgrad(x_RK, dy_RN, offs_G)
        return torch._grouped_mm(x_RK.t(), dy_RN, offs=offs_G)
    if backend == "triton":
        from ..kernels.grouped_gemm import grouped_mm_wgrad as triton_wgrad
        return triton_wgrad(x_RK, dy_RN, counts_G)
    return _reference_wgrad(x_RK, dy_RN, counts_G)


def accumulates(node) -> bool:
    """Whether the running backward runs a leaf's AccumulateGrad node, so accumulates into its .grad
    (backward(), not autograd.grad or backward(inputs=...) without the leaf). torch raises for a leaf's
    node asked about inside autograd.grad: that backward does not touch .grad."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return False


def _accumulates_into_grad(w: torch.Tensor) -> bool:
    return accumulates(torch.autograd.graph.get_gradient_edge(w).node)


class GroupedMM(Function):

    @staticmethod
    def forward(x_RK, w_GKN, counts_G, offs_G, backend, main_grad_GKN=None, main_grad_add=True,
                main_grad_placeholder=True, grad_into_w=False):
        """offs_G: the torch and cutlass backends' offsets, made by grouped_mm where the caller has none."""
        return mm_forward(x_RK, w_GKN, counts_G, backend, offs_G)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x_RK, w_GKN, counts_G, offs_G, backend = inputs[:5]
        main_grad_GKN, main_grad_add, main_grad_placeholder, grad_into_w = inputs[5:]
        ctx.save_for_backward(x_RK, w_GKN, counts_G, offs_G)
        # torch.func returns w's gradient: nothing is added into a buffer or a .grad under it
        if under_func(w_GKN):
            main_grad_GKN, grad_into_w = None, False
        ctx.backend, ctx.main_grad = backend, main_grad_GKN  # written in backward, so not saved
        ctx.main_grad_add, ctx.main_grad_placeholder = main_grad_add, main_grad_placeholder
        # The leaf itself: under saved-tensor hooks (recompute's) the unpacked w is another tensor, not w
        # with its .grad. Or the caller's callable.
        ctx.grad_into_w = grad_into_w if callable(grad_into_w) else w_GKN if grad_into_w and w_GKN.is_leaf else None
        # Under saved-tensor hooks x may come back made anew (recompute's remade rows): the backward then
        # makes w's gradient first and frees x before x's gradient, its size, is made. Otherwise x's
        # gradient first, so that what consumes it (an all-to-all) can start while w's runs.
        ctx.w_grad_first = saved_tensor_hooks_active()

    @staticmethod
    def _sink(ctx):
        """(buffer, add, placeholder) that w's gradient goes to inside the GEMM, or None: the main_grad,
        else with grad_into_w the .grad a leaf w already holds, in w's layout (read when the backward
        runs, so a .grad cleared or replaced after the forward is honoured)."""
        if ctx.main_grad is not None:
            return ctx.main_grad, ctx.main_grad_add, ctx.main_grad_placeholder
        w = ctx.grad_into_w
        if w is None or ctx.create_graph:  # (create_graph: autograd adds out of place, a differentiable sum)
            return None
        if callable(w):
            buf = w()
            return None if buf is None else (buf, True, False)
        # (a hook on w could change its gradient)
        if not w._backward_hooks and _accumulates_into_grad(w):
            g = w.grad
            if g is not None and g.is_floating_point() and g.shape == w.shape and g.stride() == w.stride():
                return g, True, False
        return None

    @staticmethod
    def backward(ctx, dy_RN):
        ctx.create_graph = torch.is_grad_enabled()
        return kernel_backward(ctx.backend in ("cutlass", "triton"), GroupedMM._backward, ctx, dy_RN)

    @staticmethod
    def _backward(ctx, dy_RN):
        x_RK, w_GKN, counts_G, offs_G = ctx.saved_tensors
        dy_RN = dy_RN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0] and not ctx.w_grad_first:
            dx = mm_forward(dy_RN, w_GKN.transpose(1, 2), counts_G, ctx.backend, offs_G)
        if ctx.needs_input_grad[1]:
            # w (or main_grad) each group's [N, K] block seen transposed (nn.Linear weights stacked): dw
            # made in that layout, dy^T x, so it reaches the parameters without a transposing copy each.
            sink = GroupedMM._sink(ctx)
            like = w_GKN if sink is None else sink[0]
            transposed = wgrad_transposed(like)
            a_RK, b_RN = (dy_RN, x_RK) if transposed else (x_RK, dy_RN)
            if sink is not None:  # the sum in the buffer
                buf, add, placeholder = sink
                mm_wgrad(a_RK, b_RN, counts_G, ctx.backend, offs_G, out=buf.transpose(1, 2) if transposed else buf,
                         accumulate=add)
                # Megatron's protocol: w gets a gradient, unread, so that its hooks still fire
                dw = torch.empty_like(w_GKN) if placeholder else None
            else:
                dw = mm_wgrad(a_RK, b_RN, counts_G, ctx.backend, offs_G)
                dw = dw.transpose(1, 2) if transposed else dw
            del a_RK, b_RN
        del x_RK  # a remade x is freed here (a kept one stays with ctx)
        if ctx.needs_input_grad[0] and ctx.w_grad_first:
            dx = mm_forward(dy_RN, w_GKN.transpose(1, 2), counts_G, ctx.backend, offs_G)
        return dx, dw, None, None, None, None, None, None, None


def row_groups(offs_G: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Group of every row [R] (int64) from the inclusive offsets, on the device; G past sum(counts)."""
    rows = torch.arange(num_rows, device=offs_G.device, dtype=offs_G.dtype)
    return torch.searchsorted(offs_G, rows, right=True)


def check_grouped_mm_args(x_RK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor):
    for name, t in (("x", x_RK), ("w", w_GKN), ("counts", counts_G)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x_RK.dim() != 2 or w_GKN.dim() != 3:
        raise ValueError(f"x must be [R, K] and w [G, K, N], got {tuple(x_RK.shape)} and {tuple(w_GKN.shape)}")
    if not x_RK.is_floating_point() or x_RK.dtype != w_GKN.dtype:
        raise TypeError(f"x and w must share one float dtype, got {x_RK.dtype} and {w_GKN.dtype}")
    if counts_G.dtype != torch.int32 or tuple(counts_G.shape) != (w_GKN.shape[0],):
        raise TypeError(f"counts must be an int32 tensor of shape [G] = [{w_GKN.shape[0]}], "
                        f"got {counts_G.dtype} {tuple(counts_G.shape)}")
    if x_RK.shape[1] != w_GKN.shape[1]:
        raise ValueError(f"x has K = {x_RK.shape[1]} columns but w expects K = {w_GKN.shape[1]}")
    if not (x_RK.device == w_GKN.device == counts_G.device):
        raise ValueError(f"x, w, counts are on different devices: {x_RK.device}, {w_GKN.device}, {counts_G.device}")
    # The kernels' precondition (counts past the rows truncate; a negative one moved the next groups'
    # rows before the output: the Triton kernel wrote out of bounds). Eager: layers compile without a break.
    if not torch.compiler.is_compiling() and debug_checks(counts_G) and counts_G.numel() and int(counts_G.min()) < 0:
        raise ValueError(f"counts must be >= 0, got {counts_G.tolist()[:16]}{' ...' if counts_G.numel() > 16 else ''}")


def grouped_mm(x_RK: torch.Tensor, w_GKN: torch.Tensor, counts_G: torch.Tensor,
               backend: Optional[str] = None, offs_G: Optional[torch.Tensor] = None,
               main_grad_GKN: Optional[torch.Tensor] = None, main_grad_add: bool = True,
               main_grad_placeholder: bool = True,
               grad_into_w: Union[bool, Callable[[], Optional[torch.Tensor]]] = False) -> torch.Tensor:
    """y [R, N] with y[rows_g] = x[rows_g] @ w[g]; differentiable in x and w; see the module doc.

    offs_G: row_offsets(counts_G), if the caller already has it (one launch fewer per GEMM).
    main_grad_GKN: gradient-accumulation fusion (Megatron's): the backward adds w's gradient to this
    [G, K, N] buffer (fp32 in Megatron; any strides), inside the weight-gradient GEMM where that is the
    faster way (mm_wgrad's out), or with main_grad_add=False writes it there. With
    main_grad_placeholder it hands w an uninitialised gradient, as Megatron's linears do, so that w's
    gradient hooks still run: the caller marks w as Megatron marks it (grad_added_to_main_grad) so
    that nothing reads that tensor; without, w gets no gradient.
    grad_into_w: where w is a leaf that already holds a .grad of its layout when a backward that
    accumulates into it runs (micro-batches accumulating; not autograd.grad), w's gradient is added
    into that .grad inside the weight-gradient GEMM (no separate gradient and no add after it:
    autograd's AccumulateGrad reads and writes .grad and reads the new gradient), and autograd gets
    none for w; hooks that run after accumulation (register_post_accumulate_grad_hook) run as usual and
    read the sum in .grad. Without a .grad (the first micro-batch), with a hook on w itself
    (Tensor.register_hook: it sees the gradient) or under create_graph (autograd then adds out of place),
    w's gradient goes through autograd as usual.
    grad_into_w may instead be a callable that the backward asks for the [G, K, N] tensor to add w's
    gradient into (w's own layout), or None for autograd's way; w then gets no gradient where it
    answers one (expert_stack.GradsInPlace: the .grad of per-expert parameters stacked as w).
    """
    check_grouped_mm_args(x_RK, w_GKN, counts_G)
    if main_grad_GKN is not None:
        if tuple(main_grad_GKN.shape) != tuple(w_GKN.shape) or main_grad_GKN.device != w_GKN.device:
            raise ValueError(f"main_grad must be [G, K, N] = {list(w_GKN.shape)} on {w_GKN.device}, got "
                             f"{list(main_grad_GKN.shape)} on {main_grad_GKN.device}")
        if not main_grad_GKN.is_floating_point():
            raise TypeError(f"main_grad must be a float tensor, got {main_grad_GKN.dtype}")
        if torch.compiler.is_compiling():
            raise NotImplementedError("gradient-accumulation fusion (main_grad) is not traced by torch.compile")
    backend = choose_gmm_backend(x_RK, w_GKN, backend)
    if backend == "cutlass" or (backend == "torch" and x_RK.stride(1) != 1):  # cutlass: row-major x
        x_RK = x_RK.contiguous()
    if backend in ("torch", "cutlass"):  # their offsets, made once for the GEMMs both ways
        offs_G = _offsets(counts_G, x_RK.shape[0], offs_G)
    if torch.compiler.is_compiling():  # a custom op: traced without a graph break (turbomoe.custom_ops)
        from .. import custom_ops
        return custom_ops.grouped_mm(x_RK, w_GKN, counts_G, offs_G, backend)
    return GroupedMM.apply(x_RK, w_GKN, counts_G, offs_G, backend, main_grad_GKN, main_grad_add, main_grad_placeholder,
                           grad_into_w)
