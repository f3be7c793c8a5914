"""A whole training forward and backward replayed from two CUDA graphs.

At small-1gpu's shapes the eager step is host-bound: the GPU waits for Python, autograd and ~13k
kernel launches a step (notes/recipe_profile.md). turbomoe's layer does no host sync at ep_size 1
(dropless or capacity) and keeps its counts on the device, so the model's whole forward and backward
can be captured once and replayed: one launch each instead of thousands. With expert parallelism
(ep_size > 1) and a capacity the all-to-all exchanges fixed-size buffers with no host read: NCCL's
collectives are captured with the rest (dropless all-to-all sizes its buffers on the host: eager).

`graph_training_forward(model, input_ids_BT, labels_BT)` captures them (as torch.cuda's
make_graphed_callables does: warm-up on a side stream, then forward, then backward into one memory
pool; on the inputs' device, made current for the capture) and routes the model's later calls:
training mode, gradients on, and inputs of the captured shape, dtype and device replay the graphs;
anything else (evaluation, no_grad, another shape, another autocast state, a torch.func transform) runs
the eager forward.
State dicts, DeepSpeed's module hooks and the optimizer's in-place updates are untouched: the graphs
read the parameters where they are, so capture after anything that moves them (deepspeed.initialize,
loading a checkpoint) or changes which of them train (requires_grad is read at capture only).
A replayed forward's outputs (clone what is kept past the next replay) and saved activations live in
the graphs' memory: each replay's backward runs before the next replay (as in a training step,
micro-batch by micro-batch), and a second replay while the first one's outputs still wait for their
backward is an error, not silently wrong gradients.

Gradients, two ways:
- `grad_buffers={param: buffer}` (a main-grad buffer of the parameter's numel, fp32 say): the
  backward graph adds the parameter's gradient into it and autograd sees none (.grad stays None;
  no AccumulateGrad node, no per-parameter hooks: with hundreds of parameters those cost more host
  time than the whole replay). DeepSpeed's BF16_Optimizer's fp32 gradients are such buffers. With
  `accumulate=False` it writes the gradient there instead (one micro-batch a step: no read of the
  old sum, and nothing need clear the buffers between steps); an eager training forward, whose
  backward would add to what the last replay left, is then an error. The grouped experts' weight
  gradients (the drop-in's experts stacked over packed parameters, whose buffers lie at one stride)
  are written or added by the weight-gradient GEMM itself (`expert_stack.weight_grad_buffers`; the
  capacity experts' on a side stream beside the all-to-all, joined before the capture ends); the
  other parameters' after the backward, in one add per run of buffers at one stride.
- any other parameter gets its gradient from the graph's own buffer, handed to .grad without a
  copy. So that a kept .grad (zeroed rather than set to None, or accumulated over micro-batches)
  is not overwritten by the next replay, the forward moves it out of the graph's buffer first (a
  copy only then).
"""
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..autograd import Function
from ..integrations.expert_stack import join_weight_grads, weight_grad_buffers
from ..kernels.launch import on_device
from .qwen3_moe import Qwen3MoeForCausalLM


def graph_training_forward(model: Qwen3MoeForCausalLM, input_ids_BT: torch.Tensor, labels_BT: torch.Tensor,
                           grad_buffers: Optional[Dict[nn.Parameter, torch.Tensor]] = None,
                           before_replay: Optional[Callable[[], None]] = None,
                           warmup: int = 3, accumulate: bool = True) -> Qwen3MoeForCausalLM:
    """Capture model's training forward and backward at these inputs' shapes; returns model, whose
    matching calls now replay. The inputs are a real batch or any tokens of that shape (copied: the
    caller's tensors are not the graph's). The warm-up runs forward and autograd.grad, so no
    gradient is accumulated and no parameter changes. before_replay() runs on the host before each
    replayed forward (e.g. to mark the buffers' gradients present). accumulate: whether the backward
    adds into grad_buffers (True) or writes them (False)."""
    _check(model, input_ids_BT, labels_BT)
    params = [p for p in model.parameters() if p.requires_grad]
    grad_buffers = grad_buffers or {}
    trainable = {id(p) for p in params}
    for p, buf in grad_buffers.items():
        if id(p) not in trainable:
            raise ValueError("grad_buffers has a tensor that is not a trainable parameter of the model")
        if buf.numel() != p.numel() or buf.device != p.device or not buf.is_floating_point():
            raise ValueError(f"a grad buffer must be a float tensor of its parameter's numel on its device: "
                             f"parameter {tuple(p.shape)} on {p.device}, buffer {tuple(buf.shape)} {buf.dtype} on {buf.device}")
    sunk = [p in grad_buffers for p in params]
    key = _key(input_ids_BT, labels_BT)
    inputs = (input_ids_BT.clone(), labels_BT.clone())  # the graphs' static inputs
    run = lambda: type(model).forward(model, *inputs)  # noqa: E731 (around DeepSpeed's module hooks)

    # Warm-up and capture on the inputs' device, made current (Triton launches on the current device),
    # and on a stream of that device: torch's default capture stream is made once per process, on
    # the device current at its first capture. Replays launch on the graphs' device from anywhere.
    with on_device(input_ids_BT.device):
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # Lazy initialisation (autotuning, compiles) outside the capture, which forbids loading a kernel:
        # with the weight gradients sent to buffers of the same layout, so that the kernels that write or
        # add them (the Triton weight-gradient GEMM's fused add, say) are compiled too, and the real
        # buffers stay untouched.
        with torch.cuda.stream(side), weight_grad_buffers(_scratch_like(grad_buffers), accumulate):
            for _ in range(warmup):
                outs = [o for o in run() if o is not None and o.requires_grad]
                torch.autograd.grad(outs, params, [torch.empty_like(o) for o in outs], allow_unused=True)
                join_weight_grads()
                del outs
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

        pool = torch.cuda.graph_pool_handle()
        fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(fwd, pool=pool, stream=side), weight_grad_buffers(grad_buffers, accumulate):
                static_out = run()
            flat = [o for o in static_out if o is not None]
            with_grad = [o for o in flat if o.requires_grad]
            grad_outs = [torch.empty_like(o) for o in with_grad]
            with torch.cuda.graph(bwd, pool=pool, stream=side):
                grads = torch.autograd.grad(with_grad, params, grad_outs, allow_unused=True)
                join_weight_grads()  # the capacity experts' weight gradients, queued on a side stream
                # Gradients already in their buffers (the grouped experts') are None here. Others that lie at
                # one stride, as do their buffers (experts not grouped): one add per run, not one per tensor.
                for dst, src in coalesce_adds([(grad_buffers[p].view(-1), g.reshape(-1))
                                               for p, g in zip(params, grads) if g is not None and p in grad_buffers]):
                    dst.add_(src) if accumulate else dst.copy_(src)
        except RuntimeError as e:
            raise RuntimeError(f"capturing the model's forward and backward failed: {e}. Something in the step "
                               f"syncs with the host, or an autograd graph made before over the parameters is still "
                               f"alive (an optimizer that flattened them with gradients on: build it under "
                               f"torch.no_grad())") from e
    # What the backward hands autograd: the graph's buffer for parameters without a grad buffer. The
    # replay takes only those parameters as inputs: one AccumulateGrad node each a backward, and none
    # for the rest (a node each, though it gets no gradient: 915 a micro-batch at 1b-4gpu). With none,
    # a leaf of its own keeps the outputs differentiable, so that the backward runs.
    live = [(p, g) for s, p, g in zip(sunk, params, grads) if not s and g is not None]
    param_grads = [g for _, g in live]
    replay_inputs = [p for p, _ in live] or [torch.zeros((), device=input_ids_BT.device, requires_grad=True)]
    kept: List[tuple] = [(p, g.data_ptr()) for p, g in live]
    pending: List[Optional[weakref.ref]] = [None]  # the last replay's autograd node until its backward ran

    class Replay(Function):
        @staticmethod
        def forward(*params_):
            fwd.replay()
            return tuple(o.detach() for o in flat)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pending[0] = weakref.ref(ctx)  # dies with the outputs when they are dropped without a backward
            ctx.mark_non_differentiable(*(r for r, o in zip(output, flat) if not o.requires_grad))  # expert counts

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads_):
            pending[0] = None
            i = 0
            for o, g in zip(flat, grads_):
                if o.requires_grad:
                    if g is None:
                        grad_outs[i].zero_()
                    elif g.data_ptr() != grad_outs[i].data_ptr():
                        grad_outs[i].copy_(g)
                    i += 1
            bwd.replay()
            return tuple(g.detach() for g in param_grads) or (None, )

    def forward_(input_ids_BT, labels_BT=None):
        # A torch.func transform's call runs eager: its parameters (functional_call's) are not those the graphs
        # read, and it returns the gradients rather than adding them anywhere.
        if torch._C._are_functorch_transforms_active():
            return type(model).forward(model, input_ids_BT, labels_BT)
        if labels_BT is None or not model.training or not torch.is_grad_enabled() or _key(input_ids_BT, labels_BT) != key:
            if not accumulate and grad_buffers and model.training and torch.is_grad_enabled():
                raise RuntimeError(f"the graphs write the gradient buffers (accumulate=False), so a training forward "
                                   f"that does not match the capture cannot run eager: its backward would add to the "
                                   f"last replay's gradients; captured {key}, got {_key(input_ids_BT, labels_BT)}")
            return type(model).forward(model, input_ids_BT, labels_BT)
        if pending[0] is not None and pending[0]() is not None:
            raise RuntimeError("the last replayed forward's backward has not run: this replay would overwrite the "
                               "activations it saved (the graphs' memory). Run its backward first, or drop its "
                               "outputs (del loss) to discard it")
        for p, ptr in kept:
            if p.grad is not None and p.grad.data_ptr() == ptr:
                p.grad = p.grad.clone()
        inputs[0].copy_(input_ids_BT)
        inputs[1].copy_(labels_BT)
        if before_replay is not None:
            before_replay()
        out = iter(Replay.apply(*replay_inputs))
        return type(static_out)(*(None if o is None else next(out) for o in static_out))

    model.cuda_graphed = True
    model.forward = forward_  # an instance attribute: nn.Module.__call__ (and DeepSpeed's hooks around it) calls it
    return model


def _scratch_like(buffers: Dict[nn.Parameter, torch.Tensor]) -> Dict[nn.Parameter, torch.Tensor]:
    """Zeroed buffers laid out as buffers (same shapes, strides and offsets) in storages of their own,
    one for each storage of buffers: views of one flat buffer stay views of one."""
    storages: Dict[int, torch.Tensor] = {}
    out = {}
    for p, buf in buffers.items():
        key = buf.untyped_storage().data_ptr()
        if key not in storages:
            storages[key] = buf.new_zeros(buf.untyped_storage().nbytes() // buf.element_size())
        out[p] = storages[key].as_strided(buf.shape, buf.stride(), buf.storage_offset())
    return out


def coalesce_adds(pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """[(dst, src)] of 1-D tensors, each pair to be added dst += src -> the same additions in fewer
    pairs: pairs whose dsts lie at one constant stride in one storage, and whose srcs at another in
    theirs, become one pair of strided [L, n] views. Runs are found greedily, in src order, each
    from the stride that extends it furthest; a pair that joins none is kept as it is."""
    buckets: Dict[tuple, list] = {}
    out = []
    for dst, src in pairs:
        if dst.shape != src.shape or dst.stride() != (1,) or src.stride() != (1,) or src.numel() == 0:
            out.append((dst, src))
            continue
        key = (dst.untyped_storage().data_ptr(), src.untyped_storage().data_ptr(), dst.numel(), dst.dtype, src.dtype)
        buckets.setdefault(key, []).append((src.storage_offset(), dst.storage_offset(), dst, src))
    for items in buckets.values():
        items.sort(key=lambda t: (t[0], t[1]))
        n = items[0][2].numel()
        free, unique = set(), []  # free: (src, dst) offsets not yet in a run
        for item in items:
            if (item[0], item[1]) in free:  # the same pair again: its own add
                out.append(item[2:])
            else:
                free.add((item[0], item[1]))
                unique.append(item)
        for i, (s0, d0, dst, src) in enumerate(unique):
            if (s0, d0) not in free:
                continue
            best = (1, 0, 0)
            for s1, d1, _, _ in unique[i + 1:]:
                ds, dd = s1 - s0, d1 - d0
                if ds < n or dd < n or (s1, d1) not in free:  # overlapping or backwards: not one strided view
                    continue
                length = 2
                while (s0 + length * ds, d0 + length * dd) in free:
                    length += 1
                best = max(best, (length, ds, dd))
            length, ds, dd = best
            free.difference_update((s0 + j * ds, d0 + j * dd) for j in range(length))
            if length == 1:
                out.append((dst, src))
            else:
                out.append((dst.as_strided((length, n), (dd, 1)), src.as_strided((length, n), (ds, 1))))
    return out


def _check(model, input_ids_BT, labels_BT):
    if not input_ids_BT.is_cuda or not labels_BT.is_cuda:
        raise ValueError(f"CUDA graphs need CUDA tensors, got input_ids on {input_ids_BT.device}, "
                         f"labels on {labels_BT.device}")
    if input_ids_BT.shape != labels_BT.shape:
        raise ValueError(f"input_ids {tuple(input_ids_BT.shape)} and labels {tuple(labels_BT.shape)} differ in shape")
    if any(p.device != input_ids_BT.device for p in model.parameters()):
        raise ValueError(f"the model's parameters must be on the inputs' device {input_ids_BT.device}")
    args = model.moe_args
    if model.moe_impl != "turbomoe" or (args.ep_size != 1 and args.capacity_factor is None) or args.recompute:
        # Stock DeepSpeed MoE and the dropless all-to-all read counts on the host, which capture forbids
        # (with a capacity the all-to-all's buffers have a fixed size); recompute's saved-tensor hooks are
        # not verified under capture.
        raise ValueError(f"CUDA graphs need moe_impl 'turbomoe', ep_size 1 or a capacity factor, and no recompute, "
                         f"got {model.moe_impl!r}, ep_size {args.ep_size}, capacity_factor {args.capacity_factor}, "
                         f"recompute {args.recompute}")
    if getattr(model, "cuda_graphed", False):
        raise ValueError("this model is already captured")
    if not model.training:
        raise ValueError("capture the training forward: call model.train() first")


def _key(input_ids_BT, labels_BT):
    """What a replay must match: the inputs' shapes, dtypes and device, and autocast's state there
    (the graphs ran without the casts it would add, or with the ones it added at capture)."""
    kind = input_ids_BT.device.type
    amp = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    return tuple((t.shape, t.dtype, t.device) for t in (input_ids_BT, labels_BT)) + (amp, )
