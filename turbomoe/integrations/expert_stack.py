"""Per-expert parameters seen as one stacked tensor, and the two row layouts of grouped GEMMs.

The local experts' parameters stay in their own modules (per-expert state dict and checkpoint
files); `pack_expert_params` moves them into one flat buffer in module order (as ZeRO packs them),
so that `stack_expert_tensors` sees expert e's weight as block e of an [E, N, K] view, not a copy
made every step. `EqualGroups` runs a GEMM per expert on the capacity buffer [.., E, C, K] (batched),
`RowGroups` on expert-contiguous rows [R, K] with the counts on the device (grouped);
`weight_grad_buffers` sends their weight gradients straight into given (fp32) buffers. When
micro-batches accumulate into the experts' .grad, a stack's gradient is added to them in one add
(`grads_in_place`), or with `fused_grad_accumulation` inside the weight-gradient GEMM.
"""
import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..autograd import BatchedGradients, Function, once_differentiable
from ..autograd.bias_act import bias_act
from ..autograd.grouped_gemm import accumulates, grouped_mm, row_groups, row_offsets


class _AliasStack(Function):
    """Per-expert blocks of tensors that lie at a fixed stride in one storage, seen as one
    [E, rows, *rest] tensor without a copy; the backward splits the gradient back per tensor, or,
    where the tensors' .grad are added into in place and can be seen as one such tensor too
    (grads_in_place), adds it to them at once (one add for all experts, where autograd would add
    each apart: a launch and its host time each). Not under torch.func (its tensors have no storage):
    stack_expert_tensors copies there."""

    @staticmethod
    def forward(shape, stride, block_rows, *tensors):
        first = tensors[0]
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape, stride)

    @staticmethod
    def setup_context(ctx, inputs, output):
        shape, stride, block_rows, *tensors = inputs
        ctx.block_rows, ctx.num_tensors, ctx.layout = block_rows, len(tensors), (shape, stride)
        ctx.tensors = tensors  # the leaves themselves, for their .grad (saved-tensor hooks could swap them)
        ctx.set_materialize_grads(False)  # no gradient (sent to weight_grad_buffers): no zeros made and split

    @staticmethod
    def backward(ctx, grad):
        nothing = (None, ) * (3 + ctx.num_tensors)
        if grad is None:  # the GEMM added it into the .grad itself (grads_in_place), or none flowed
            return nothing
        sums = grads_in_place(ctx)
        if sums is not None:
            sums.add_(grad)
            return nothing
        rows = ctx.block_rows
        if len(set(rows)) == 1:  # blocks of equal rows ([w1; w3], or one tensor): one unbind, not E splits
            pieces = grad.reshape(-1, rows[0], *grad.shape[2:]).unbind(0)
        else:
            pieces = [p for block in grad.unbind(0) for p in block.split(rows, 0)]
        return (None, None, None, *pieces)


def grads_in_place(node) -> Optional[torch.Tensor]:
    """The .grad of the tensors that the _AliasStack node stacked, seen as one [E, rows, *rest] tensor,
    where the running backward will add into every one of them in place and they lie so: in one
    storage, each block's back to back, the blocks at one stride (as the first backward leaves them:
    autograd keeps the split's views of one gradient; or an optimizer's flat buffer in parameter
    order); else None.

    In place: backward() reaches each tensor's AccumulateGrad (not autograd.grad, nor inputs= without
    it), no create_graph (autograd then adds out of place), and no hook on the tensor itself (it
    must see, and may change, the gradient). Adding there, the gradient skips AccumulateGrad, whose
    post-accumulate hooks and node hooks still run after and read the sum."""
    if torch.is_grad_enabled():
        return None
    tensors = node.tensors
    first_grad = tensors[0].grad
    if first_grad is None:
        return None
    base, offsets = first_grad._base, []
    one_base = base is not None
    for t, (acc, _) in zip(tensors, node.next_functions):
        if acc is None or not t.is_leaf:  # (a non-leaf's .grad is not its gradient's home)
            return None
        g = t.grad
        if (g is None or t._backward_hooks or g.dtype != t.dtype or g.shape != t.shape or not g.is_contiguous()
                or not accumulates(acc)):  # (t is contiguous: the stack's condition)
            return None
        offsets.append(g.storage_offset())
        one_base = one_base and g._base is base
    # One storage (views of one base share it; else compare), each block's .grad back to back, the
    # blocks at one stride: _alias_stride's layout, read from the offsets (it reads every storage).
    if not one_base:
        storage = first_grad.untyped_storage().data_ptr()
        if any(t.grad.untyped_storage().data_ptr() != storage for t in tensors):
            return None
    per = len(node.block_rows)
    within = [0]
    for t in tensors[:per - 1]:
        within.append(within[-1] + t.numel())
    block_numel = within[-1] + tensors[per - 1].numel()
    step = offsets[per] - offsets[0] if len(offsets) > per else block_numel
    if step < block_numel or any(o != offsets[0] + (i // per) * step + within[i % per] for i, o in enumerate(offsets)):
        return None
    shape, stride = node.layout
    return first_grad.as_strided(shape, (step, ) + tuple(stride[1:]), offsets[0])


class GradsInPlace:
    """Callable for a weight-gradient GEMM's backward: the .grad that the stacked weight w's gradient
    can be added into there (grads_in_place), transposed to the GEMM's view of w, or None. Made only
    where w is the stack's own output (no cast between)."""

    def __init__(self, node, transpose: bool):
        self.node, self.transpose = node, transpose

    @staticmethod
    def of(w_ENK: torch.Tensor, transpose: bool = False) -> Optional["GradsInPlace"]:
        if torch.compiler.is_compiling():  # a copy there (stack_expert_tensors), not the stack
            return None
        node = w_ENK.grad_fn
        return GradsInPlace(node, transpose) if type(node) is _AliasStack._backward_cls else None

    def __call__(self) -> Optional[torch.Tensor]:
        g = grads_in_place(self.node)
        return g.transpose(1, 2) if g is not None and self.transpose else g


def _alias_stride(blocks: List[List[torch.Tensor]]) -> Optional[int]:
    """Element stride between expert blocks when the blocks can be aliased as one tensor, else None.

    Needs: one storage, dtype and trailing shape; each tensor contiguous; the tensors of a block
    back to back; blocks at a constant stride. Parameters packed by `pack_expert_params` and
    DeepSpeed ZeRO-1/2's flat buffers (parameters in module order) are laid out this way.
    """
    first = blocks[0][0]
    storage, rest = first.untyped_storage().data_ptr(), first.shape[1:]
    starts = []
    for block in blocks:
        offset = block[0].storage_offset()
        starts.append(offset)
        for t in block:
            if (t.dtype != first.dtype or t.shape[1:] != rest or not t.is_contiguous()
                    or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset):
                return None
            offset += t.numel()
    block_numel = offset - starts[-1]
    stride = starts[1] - starts[0] if len(starts) > 1 else block_numel
    if stride < block_numel or any(b - a != stride for a, b in zip(starts, starts[1:])):
        return None
    return stride


# (address, storage address, shape, dtype, contiguity) of every tensor -> _alias_stride's answer: the
# check reads each tensor's storage, ~0.1 ms of host time per call at 64 experts; the key costs half
# of that. The same key gives the same answer: live storages do not overlap, and the storage address
# tells tensors packed in one buffer from separate ones that reuse the freed buffer's addresses.
_ALIAS_STRIDES: Dict[tuple, Optional[int]] = {}


def _alias_stride_cached(blocks: List[List[torch.Tensor]]) -> Optional[int]:
    key = (len(blocks[0]), ) + tuple((t.data_ptr(), t.untyped_storage().data_ptr(), t.shape, t.dtype,
                                       t.is_contiguous()) for b in blocks for t in b)
    if key not in _ALIAS_STRIDES:
        if len(_ALIAS_STRIDES) >= 256:  # parameters moved many times: forget the old layouts
            _ALIAS_STRIDES.clear()
        _ALIAS_STRIDES[key] = _alias_stride(blocks)
    return _ALIAS_STRIDES[key]


def _stacked_shape(blocks: List[List[torch.Tensor]]) -> tuple:
    """[E, rows, *rest]: the shape of blocks seen as one tensor."""
    return (len(blocks), sum(t.shape[0] for t in blocks[0])) + tuple(blocks[0][0].shape[1:])


def _stacked_layout(blocks: List[List[torch.Tensor]], stride: int):
    """(shape, strides) of blocks seen as one [E, rows, *rest] tensor, expert blocks stride apart."""
    shape = _stacked_shape(blocks)
    return shape, (stride, ) + torch.empty(shape[1:], device="meta").stride()


def stack_expert_tensors(blocks: List[List[torch.Tensor]]) -> torch.Tensor:
    """[E, rows, *rest]: expert e's tensors concatenated along dim 0, stacked over experts.

    Aliases the parameters' storage when it can (no copy) eagerly; otherwise, and under torch.compile,
    copies them (torch.stack).
    """
    # While compiling, a copy: the alias check reads storage addresses, which the compiler cannot trace;
    # under torch.func too: its tensors have none.
    copy = torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
    stride = None if copy else _alias_stride_cached(blocks)
    if stride is None:  # the tensors of a block have equal rows ([w1; w3]), so stacking them all works
        return torch.stack([t for block in blocks for t in block]).view(_stacked_shape(blocks))
    shape, strides = _stacked_layout(blocks, stride)
    return _AliasStack.apply(shape, strides, [t.shape[0] for t in blocks[0]], *[t for block in blocks for t in block])


# (buffers by parameter, add) while weight_grad_buffers is active; None otherwise (the usual case).
_GRAD_BUFFERS: Optional[Tuple[Dict[torch.Tensor, torch.Tensor], bool]] = None


@contextlib.contextmanager
def weight_grad_buffers(buffers: Dict[nn.Parameter, torch.Tensor], add: bool) -> Iterator[None]:
    """Within, the GEMMs over stacked expert weights whose parameters all have a buffer here (a float
    tensor of the parameter's numel; the buffers of one stack at one stride, as an optimizer's flat
    fp32 gradients lie) write their weight gradient there from the forwards run now, or with add add
    it, and those parameters get no gradient. RowGroups' do it inside the weight-gradient GEMM
    (turbomoe's CUTLASS kernel for fp32 buffers: no 16-bit gradient and no cast or add after it);
    EqualGroups' on CUDA on a side stream, so that what the backward does next overlaps them: call
    join_weight_grads() after the backward. A CUDA graph's capture uses it (models/cuda_graph.py);
    not reentrant."""
    global _GRAD_BUFFERS
    if _GRAD_BUFFERS is not None:
        raise RuntimeError("weight_grad_buffers is already active")
    _GRAD_BUFFERS = (buffers, add)
    try:
        yield
    finally:
        _GRAD_BUFFERS = None


def stacked_grad_buffer(blocks: List[List[torch.Tensor]]) -> Optional[Tuple[torch.Tensor, bool]]:
    """(the buffers of blocks' tensors seen as one [E, rows, *rest] tensor, add) where
    weight_grad_buffers holds a buffer for each and they can be so seen; else None."""
    if _GRAD_BUFFERS is None:
        return None
    buffers, add = _GRAD_BUFFERS
    views = []
    for block in blocks:
        views.append([])
        for t in block:
            buf = buffers.get(t)
            if buf is None:
                return None
            views[-1].append(buf.view(t.shape))
    stride = _alias_stride(views)
    if stride is None:
        return None
    first = views[0][0]
    return first.as_strided(*_stacked_layout(views, stride), first.storage_offset()), add


def pack_expert_params(experts: nn.ModuleList) -> None:
    """Move the local experts' parameters into one flat buffer, in module order (as ZeRO does), so
    that `stack_expert_tensors` can alias them. Names, values and the state dict do not change."""
    params = [p for e in experts for p in e.parameters()]
    if not params or len({(p.dtype, p.device) for p in params}) != 1:
        return
    if _back_to_back(params):  # packed already: a new buffer would drop what holds this one (share_memory's)
        return
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    with torch.no_grad():
        for p in params:
            view = flat[offset:offset + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            offset += p.numel()


def _back_to_back(params: List[torch.Tensor]) -> bool:
    """Whether params lie contiguous and back to back in one storage, in order."""
    storage, offset = params[0].untyped_storage().data_ptr(), params[0].storage_offset()
    for p in params:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset:
            return False
        offset += p.numel()
    return True


# The side stream of each device that EqualGroups' weight gradients run on when they have a buffer, and
# what the one still queued there reads (its x and dy): released once the backward's stream has waited.
_ASIDE: Dict[torch.device, torch.cuda.Stream] = {}
_PENDING: List[Tuple[torch.device, tuple]] = []


def join_weight_grads() -> None:
    """The current stream waits for the weight gradients queued on the side stream (after a backward
    within weight_grad_buffers; a CUDA graph's capture must end joined)."""
    for device, _ in _PENDING:
        torch.cuda.current_stream(device).wait_stream(_ASIDE[device])
    _PENDING.clear()


def _weight_grad_aside(dy_BECN: torch.Tensor, x_BECK: torch.Tensor, sink: Tuple[torch.Tensor, bool]) -> None:
    """dw = sum over blocks dy^T x, added into (or written to) the sink's buffer. On CUDA on the side
    stream, after the caller queued dx: the all-to-all that takes dx back to the ranks (and the layer's
    backward before the next such GEMM, which joins it) runs beside it, not after it."""
    buf_ENK, add = sink

    def dw():
        g_ENK = _batched_dw(dy_BECN, x_BECK)
        buf_ENK.add_(g_ENK) if add else buf_ENK.copy_(g_ENK)
    if not dy_BECN.is_cuda:
        return dw()
    join_weight_grads()  # the one before (queued after this dx: the two overlap)
    device = dy_BECN.device
    side = _ASIDE.get(device)
    if side is None:
        side = _ASIDE[device] = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        dw()
    _PENDING.append((device, (dy_BECN, x_BECK)))  # freed only after the join: the side stream reads them


class _BatchedLinear(Function):
    """y [.., E, C, N] = x [.., E, C, K] @ w [E, N, K]^T: a batched GEMM each way per leading block
    of x. The blocks are the rows from each expert-parallel rank ([G, E, C, K], as the all-to-all
    leaves them): run where they lie, not copied into [E, G * C, K] and back.

    Its backward computes dw in w's own [E, N, K] layout: autograd's bmm would return it transposed,
    and every expert parameter's gradient would then be copied to make it contiguous. The blocks'
    products are summed in the GEMM's epilogue (baddbmm): rounded once a block, as micro-batches are.
    With a sink (weight_grad_buffers), dw goes there instead, on the side stream; with fused (gradient-
    accumulation fusion), where the experts' .grad can take it in place (GradsInPlace), it is added there
    in the epilogue (beta 1).
    """

    @staticmethod
    def forward(x, w_ENK, sink, fused):
        x_BECK = _blocks(x)
        y_BECN = x.new_empty(x_BECK.shape[:-1] + w_ENK.shape[1:2])
        for x_ECK, y_ECN in zip(x_BECK, y_BECN):
            torch.bmm(x_ECK, w_ENK.transpose(1, 2), out=y_ECN)
        return y_BECN.view(x.shape[:-1] + w_ENK.shape[1:2])

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w_ENK, sink, fused = inputs
        ctx.save_for_backward(x, w_ENK)
        ctx.sink = sink
        ctx.grads_in_place = GradsInPlace.of(w_ENK) if sink is None and fused else None

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled() and ctx.sink is None:  # create_graph: autograd's ops, differentiable again
            return _BatchedLinear._autograd_backward(ctx, dy)
        try:
            return _BatchedLinear._backward(ctx, dy)
        except BatchedGradients:  # autograd's batched gradients (vectorize=True), which out= refuses
            if ctx.sink is not None:  # (the weight gradient goes aside, one at a time)
                raise
            return _BatchedLinear._autograd_backward(ctx, dy)

    @staticmethod
    def _autograd_backward(ctx, dy):
        (x, w_ENK), dy_BECN = ctx.saved_tensors, _blocks(dy)
        dx = dy_BECN @ w_ENK if ctx.needs_input_grad[0] else None
        dw = (dy_BECN.transpose(-1, -2) @ _blocks(x)).sum(0) if ctx.needs_input_grad[1] else None
        return None if dx is None else dx.view(x.shape), dw, None, None

    @staticmethod
    @once_differentiable  # GEMMs into given memory (out=); under create_graph only with a sink (CUDA graphs)
    def _backward(ctx, dy):
        x, w_ENK = ctx.saved_tensors
        x_BECK, dy_BECN = _blocks(x), _blocks(dy)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx_BECK = x_BECK.new_empty(x_BECK.shape)  # contiguous, whatever x's strides: viewed as x below
            for dy_ECN, dx_ECK in zip(dy_BECN, dx_BECK):
                torch.bmm(dy_ECN, w_ENK, out=dx_ECK)
            dx = dx_BECK.view(x.shape)
        if ctx.sink is not None:
            _weight_grad_aside(dy_BECN, x_BECK, ctx.sink)
        elif ctx.needs_input_grad[1]:
            grads_ENK = ctx.grads_in_place() if ctx.grads_in_place is not None else None
            if grads_ENK is None:
                dw = _batched_dw(dy_BECN, x_BECK)
            else:
                _batched_dw(dy_BECN, x_BECK, grads_ENK)
        return dx, dw, None, None


def _batched_dw(dy_BECN: torch.Tensor, x_BECK: torch.Tensor, into_ENK: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dw [E, N, K] = sum over blocks b of dy[b]^T x[b], the sum in the GEMM's epilogue; with into_ENK
    (of the inputs' dtype) added to it there (beta 1: rounded once) and returned."""
    blocks = zip(dy_BECN, x_BECK)
    if into_ENK is None:
        dy_ECN, x_ECK = next(blocks)
        into_ENK = torch.bmm(dy_ECN.transpose(1, 2), x_ECK)
    for dy_ECN, x_ECK in blocks:
        into_ENK.baddbmm_(dy_ECN.transpose(1, 2), x_ECK)
    return into_ENK


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """[.., E, C, K] -> [B, E, C, K] (a view where it can be; not -1: C may be 0)."""
    return t.reshape(t.shape[:-3].numel(), *t.shape[-3:])


class EqualGroups:
    """Expert e owns x[.., e, :, :] of x [.., E, C, K] (the capacity buffer, with a leading dim of
    source ranks after the all-to-all): batched GEMMs. fused_grad_accumulation: as RowGroups'."""

    def __init__(self, fused_grad_accumulation: bool = False):
        self.fused_grad_accumulation = fused_grad_accumulation

    def matmul(self, x_ECK: torch.Tensor, w_ENK: torch.Tensor,
               blocks: Optional[List[List[torch.Tensor]]] = None) -> torch.Tensor:
        """blocks: the per-expert tensors that w_ENK stacks, for weight_grad_buffers."""
        return _BatchedLinear.apply(x_ECK, w_ENK, None if blocks is None else stacked_grad_buffer(blocks),
                                    self.fused_grad_accumulation)

    def add_bias(self, y_ECN: torch.Tensor, b_EN: torch.Tensor, act: str = "none") -> torch.Tensor:
        """act(y + b[e]) over expert e's rows (bias_act's activations), one pass each way."""
        return bias_act(y_ECN.reshape(-1, y_ECN.shape[-1]), b_EN, rows_per_group=y_ECN.shape[-2],
                        act=act).view(y_ECN.shape)


class RowGroups:
    """Expert e owns counts[e] consecutive rows of x [R, K] (the dropless layout): grouped GEMMs
    with the counts on the device, so no host sync.

    fused_grad_accumulation: where the stacked weights' experts already hold a .grad that the running
    backward adds into (micro-batches accumulating; grads_in_place), the weight-gradient GEMM adds
    into it in its epilogue: no gradient tensor and no add pass. The sums are rounded once, so their
    bits differ from autograd's gradient-then-add (which, without it, the stack still makes as one
    add for all experts)."""

    def __init__(self, counts_E: torch.Tensor, num_rows: int, fused_grad_accumulation: bool = False):
        self.counts_E = counts_E
        self.fused_grad_accumulation = fused_grad_accumulation
        self.num_rows = num_rows
        self.offs_E = row_offsets(counts_E)  # once for the layer's GEMMs and biases (a launch each fewer)
        self._groups_R = None

    def matmul(self, x_RK: torch.Tensor, w_ENK: torch.Tensor,
               blocks: Optional[List[List[torch.Tensor]]] = None) -> torch.Tensor:
        """blocks: the per-expert tensors that w_ENK stacks, for weight_grad_buffers."""
        sink = None if blocks is None else stacked_grad_buffer(blocks)
        if sink is None:
            into = GradsInPlace.of(w_ENK, transpose=True) if self.fused_grad_accumulation else None
            return grouped_mm(x_RK, w_ENK.transpose(1, 2), self.counts_E, offs_G=self.offs_E, grad_into_w=into or False)
        buf_ENK, add = sink
        return grouped_mm(x_RK, w_ENK.transpose(1, 2), self.counts_E, offs_G=self.offs_E,
                          main_grad_GKN=buf_ENK.transpose(1, 2), main_grad_add=add, main_grad_placeholder=False)

    def add_bias(self, y_RN: torch.Tensor, b_EN: torch.Tensor, act: str = "none") -> torch.Tensor:
        """act(y + b[e]) over expert e's rows (bias_act's activations); rows past sum(counts)
        (unrouted tokens) get no bias."""
        if self._groups_R is None:  # the second bias reuses the first's
            self._groups_R = row_groups(self.offs_E, self.num_rows)
        return bias_act(y_RN, b_EN, self._groups_R, act=act)
