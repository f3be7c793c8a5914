"""The functional front of turbomoe: validates inputs and picks a backend for each op.

Backends: "cuda" (CUDA C++ kernels in turbomoe/csrc, built on first use: the GPU default, for
E <= 1024), "triton" (the GPU default where cuda cannot serve: no nvcc, or more experts; on the
CPU only under TRITON_INTERPRET=1) and "reference" (plain PyTorch, the CPU default,
differentiable through autograd). Force one with the `backend=` argument or the TURBOMOE_BACKEND
environment variable.

The data flow of an MoE layer:
    g = topk_gating(logits_SE, k)                       # ids, scores, counts, aux, z
      or sample_second_expert(logits_SE, topk_gating(logits_SE, 1))  # DeepSpeed's sampled top-2
      or second_by_logits(logits_SE, topk_gating(logits_SE, 1))      # DeepSpeed's unsampled top-2
    s = assign_slots(g.expert_ids, g.scores, E, capacity=C)
    buf_RM = scatter_tokens(x_SM, s)                     # experts run on buf
    out_SM = gather_tokens(y_RM, s, g.scores)
"""
import math
import os
import sys
from typing import Optional

import torch

from . import csrc, custom_ops, reference
from .autograd import plain_call
from .autograd.gather import gather_tokens as _gather_fn
from .autograd.gating import topk_gating as _gating_fn
from .autograd.sampling import second_expert as _second_expert_fn
from .autograd.scatter import row_scores as _row_scores_fn
from .autograd.scatter import scatter_tokens as _scatter_fn
from .reference import DROP_POLICIES, SCORE_FUNCS, GatingOutput, Slots, debug_checks  # noqa: F401 (re-exported)

BACKENDS = ("cuda", "triton", "reference")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_K = 8
# The Triton gating ops' bound: assign_slots' one-hot tile (16 routes x E, a power of two) within
# Triton's 2**20 elements a tensor. Above it the reference runs (plain PyTorch, any device).
TRITON_MAX_EXPERTS = 1 << 16
_FLOAT_MAX = sys.float_info.max


def forced_backend(backend: Optional[str] = None) -> Optional[str]:
    """The backend a caller forces: the argument, else TURBOMOE_BACKEND; None: chosen per call."""
    return backend or os.environ.get("TURBOMOE_BACKEND")


def choose_backend(t: torch.Tensor, backend: Optional[str] = None, num_experts: int = 0) -> str:
    """CUDA C++ on CUDA tensors where it applies, else Triton, else the reference; the reference on CPU
    tensors; unless forced. num_experts: E of the op (the cuda backend serves E <= csrc.MAX_EXPERTS,
    Triton E <= TRITON_MAX_EXPERTS)."""
    forced = forced_backend(backend)
    if forced is None:
        if not t.is_cuda:
            return "reference"
        if num_experts <= csrc.MAX_EXPERTS and csrc.available():
            return "cuda"
        return "triton" if num_experts <= TRITON_MAX_EXPERTS else "reference"
    check_backend(forced)
    if forced == "triton" and num_experts > TRITON_MAX_EXPERTS:
        raise ValueError(f"the triton backend serves at most {TRITON_MAX_EXPERTS} experts, got {num_experts}; "
                         "use the reference backend")
    if forced == "triton" and not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the triton backend needs CUDA tensors, or TRITON_INTERPRET=1 set before "
                           "turbomoe is imported to run its kernels on the CPU")
    if forced == "cuda":
        if not t.is_cuda:
            raise RuntimeError("the cuda backend needs CUDA tensors")
        if num_experts > csrc.MAX_EXPERTS:
            raise ValueError(f"the cuda backend serves at most {csrc.MAX_EXPERTS} experts, got {num_experts}; "
                             "use the triton backend")
        if not csrc.available():
            raise RuntimeError("the cuda backend could not be built here (see the warning above)")
    return forced


def check_backend(backend: Optional[str]):
    """backend is None (chosen per call) or one of BACKENDS: modules check it when built."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown turbomoe backend {backend!r}: backend must be one of {BACKENDS}")


def _impl(backend: str):
    """The module of launchers of a kernel backend."""
    if backend == "cuda":
        return csrc
    from . import kernels
    return kernels


def _check_float(name: str, t: torch.Tensor, ndim: int):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a float16, bfloat16, float32 or float64 tensor, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_dtype(name: str, dtype):
    """A module's parameter dtype: None (torch's default) or a float dtype the kernels take."""
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be None or torch.float16, bfloat16, float32 or float64, got {dtype!r}")


def _check_index(name: str, t: torch.Tensor, shape=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_int(name: str, value, low: int, high: Optional[int] = None):
    """value is a Python int (not a bool: True is not a count), or a symbolic one (torch.export's dynamic
    shapes), in [low, high]."""
    if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {'inf' if high is None else high}], got {value}")


def check_number(name: str, value, low: float, strict: bool = False):
    """value is a finite real number (int or float, not a bool) >= low (> low if strict)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if isinstance(value, int) and abs(value) > _FLOAT_MAX:  # past fp64: math.isfinite would overflow
        raise ValueError(f"{name} must be a finite number, got an int of {value.bit_length()} bits")
    # finite as value - value == 0 (NaN and inf give NaN): torch.compile(dynamic=True) traces a module's
    # float attribute as a symbol, which math.isfinite does not take
    if not value - value == 0 or value < low or (strict and value == low):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low}, got {value}")


def check_bool(name: str, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_seed(seed):
    """An RTS seed: a Python int (its low 32 bits mix the hash); 1.5, None and "7" are errors."""
    check_int("seed", seed, -(1 << 63), (1 << 64) - 1)


def rts_draw() -> torch.Tensor:
    """A draw from torch's CPU generator for assign_slots(seed_draw=): a fresh random token selection
    each training step that recomputation replays (activation checkpointing saves and restores that
    generator) and torch.compile traces (a tensor, not an int); on the host, so no device sync."""
    return torch.randint(0, 1 << 62, (1, ))


def _check_same_device(**tensors):
    device = None
    for t in tensors.values():
        if t is not None:
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError("tensors are on different devices: "
                                 f"{ {name: v.device for name, v in tensors.items() if v is not None} }")


def check_routing(logits: torch.Tensor, k: int, score_func: str) -> int:
    """The checks of a routing op's inputs (topk_gating, inference.index_shuffling): float logits
    [rows, E] with E >= 1, an int k in [1, min(E, MAX_K)], a known score_func. Returns E."""
    _check_float("logits", logits, 2)
    E = logits.shape[1]
    if E < 1:
        raise ValueError("logits must have at least one expert column")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= min(E, MAX_K):
        raise ValueError(f"k must be an int in [1, min(E, {MAX_K})] = [1, {min(E, MAX_K)}], got {k!r}")
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    return E


def topk_gating(logits_SE: torch.Tensor,
                k: int,
                score_func: str = "softmax",
                renormalize: bool = False,
                selection_bias_E: Optional[torch.Tensor] = None,
                check_finite: bool = False,
                backend: Optional[str] = None) -> GatingOutput:
    """logits [S, E] -> expert_ids [S, k] int32, scores [S, k] fp32, counts [E] int32, aux, z.

    Rows of logits that hold NaN or Inf route nowhere (ids -1, scores 0, no gradient) on every
    backend, with no host sync. check_finite=True raises ValueError instead (a host sync on GPU).
    A NaN in selection_bias ranks that expert as -inf; S = 0 gives aux = z = 0 (reference.topk_gating).
    """
    E = check_routing(logits_SE, k, score_func)
    check_bool("renormalize", renormalize)
    check_bool("check_finite", check_finite)
    if selection_bias_E is not None:
        _check_float("selection_bias", selection_bias_E, 1)
        if selection_bias_E.shape[0] != E:
            raise ValueError(f"selection_bias must have shape [{E}], got {tuple(selection_bias_E.shape)}")
        _check_same_device(logits=logits_SE, selection_bias=selection_bias_E)
    if check_finite and not bool(torch.isfinite(logits_SE).all()):
        raise ValueError("logits contain NaN or Inf")
    backend = choose_backend(logits_SE, backend, E)
    if backend == "reference":
        return reference.topk_gating(logits_SE, k, score_func, renormalize, selection_bias_E)
    if torch.compiler.is_compiling():  # custom ops: traced without a graph break (turbomoe.custom_ops)
        return custom_ops.topk_gating(logits_SE, k, score_func, renormalize, selection_bias_E, backend)
    return _gating_fn(logits_SE, k, score_func, renormalize, selection_bias_E, _impl(backend))


def sample_second_expert(logits_SE: torch.Tensor, first: GatingOutput, rand_SE: Optional[torch.Tensor] = None,
                         backend: Optional[str] = None) -> GatingOutput:
    """Top-2 gating with a sampled second expert (DeepSpeed's top2_2nd_expert_sampling).

    first: topk_gating(logits, 1). The second expert is the argmax of logits + Gumbel noise over the
    other experts; its score is its router probability. Returns first with expert_ids and scores
    [S, 2] and counts including the second choices; aux and z are first's (DeepSpeed's top-2 aux
    counts first choices only). rand [S, E] fp32 in [0, 1): the uniforms of the noise; None draws
    torch.rand(S, E) as DeepSpeed's gumbel_rsample does, so the same seed samples the same experts.
    The cuda and triton backends fuse the op into one kernel each way (eagerly; triton makes the noise
    in PyTorch first, kernels.sampling); reference and any backend under torch.compile run the reference.
    """
    S, E = _check_second(logits_SE, first)
    if E < 2:
        raise ValueError("a second expert needs at least two experts")
    if rand_SE is None:
        rand_SE = torch.rand(S, E, device=logits_SE.device)
    elif rand_SE.dtype != torch.float32 or tuple(rand_SE.shape) != (S, E):
        raise ValueError(f"rand must be float32 [{S}, {E}], got {rand_SE.dtype} {tuple(rand_SE.shape)}")
    _check_same_device(logits=logits_SE, expert_ids=first.expert_ids, rand=rand_SE)
    return _second_expert(logits_SE, first, rand_SE, backend)


def second_by_logits(logits_SE: torch.Tensor, first: GatingOutput, backend: Optional[str] = None) -> GatingOutput:
    """Top-2 gating as DeepSpeed's top2gating without sampling: first by probability (first:
    topk_gating(logits, 1)), the second the argmax of the logits over the other experts (ties to the
    lower id), its score its router probability. Not topk_gating(logits, 2), which ranks probabilities:
    where the router saturates (a logit gap past ~100) softmax rounds the others to 0, and its tie rule
    would send every such token's second route to the lowest id. Returns first with expert_ids and
    scores [S, 2] and counts including the second choices; aux and z are first's. With E = 1 the second
    route is the first's expert again, as stock's. The cuda and triton backends fuse it into one kernel
    each way (eagerly); reference and any backend under torch.compile run the reference.
    """
    _, E = _check_second(logits_SE, first)
    _check_same_device(logits=logits_SE, expert_ids=first.expert_ids)
    return _second_expert(logits_SE, first, None, backend if E >= 2 else "reference")


def _check_second(logits_SE: torch.Tensor, first: GatingOutput):
    """S, E of the logits of a second-expert op, whose first choices first are."""
    _check_float("logits", logits_SE, 2)
    if logits_SE.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"logits must be float32 or float64 (the router's dtype), got {logits_SE.dtype}")
    S, E = logits_SE.shape
    if not isinstance(first, GatingOutput):
        raise TypeError(f"first must be the GatingOutput of topk_gating(logits, 1), got {type(first).__name__}")
    if (tuple(first.expert_ids.shape) != (S, 1) or tuple(first.scores.shape) != (S, 1)
            or tuple(first.counts.shape) != (E, )):
        raise ValueError(f"first must be the top-1 gating of these logits, [S, 1] = [{S}, 1] with counts [E] = "
                         f"[{E}]; got expert_ids {tuple(first.expert_ids.shape)}, scores {tuple(first.scores.shape)}, "
                         f"counts {tuple(first.counts.shape)}")
    return S, E


def _second_expert(logits_SE, first: GatingOutput, rand_SE, backend) -> GatingOutput:
    backend = choose_backend(logits_SE, backend, logits_SE.shape[1])
    # While compiling, the reference (plain PyTorch, traced; the same draws): the fused kernels are no custom op.
    if backend != "reference" and not torch.compiler.is_compiling():
        ids, scores, counts = _second_expert_fn(logits_SE, first.expert_ids, first.scores, first.counts, rand_SE,
                                                _impl(backend))
    else:
        ids, scores, counts = reference.second_expert(logits_SE, first.expert_ids, first.scores, first.counts,
                                                      rand_SE)
    return first._replace(expert_ids=ids, scores=scores, counts=counts)


def capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int = 0,
             fp32: bool = False) -> int:
    """DeepSpeed's expert capacity formula, ceil(S / E * capacity_factor * k) at least min_capacity, in
    fp64 (reference.capacity: S may be symbolic under torch.compile), or with fp32 in DeepSpeed's own
    rounding (reference.deepspeed_capacity: the drop-in's, which keeps the tokens stock keeps; S is
    then made a concrete int)."""
    check_int("num_tokens", num_tokens, 0, (1 << 63) - 1)  # bounds: the products below stay floats
    check_int("num_experts", num_experts, 1, _INT32_MAX)
    check_int("k", k, 1, _INT32_MAX)
    check_number("capacity_factor", capacity_factor, 0, strict=True)
    check_bool("fp32", fp32)
    # assign_slots' bound, on min_capacity and on the formula (as rounded)
    bound = _INT32_MAX // num_experts
    check_int("min_capacity", min_capacity, 0, bound)
    if num_tokens / num_experts * capacity_factor * k > bound:
        raise ValueError(f"capacity of {num_tokens} tokens x capacity_factor {capacity_factor} x k {k} over "
                         f"{num_experts} experts exceeds int32 slots")
    if fp32:
        C = reference.deepspeed_capacity(int(num_tokens), num_experts, k, capacity_factor, min_capacity)
        if C > bound:  # fp32's rounding can step over the bound the fp64 product kept
            raise ValueError(f"capacity of {num_tokens} tokens x capacity_factor {capacity_factor} x k {k} over "
                             f"{num_experts} experts in fp32 rounds to {C}, past int32 slots")
        return C
    return reference.capacity(num_tokens, num_experts, k, capacity_factor, min_capacity)


def assign_slots(expert_ids_SK: torch.Tensor,
                 scores_SK: torch.Tensor,
                 num_experts: int,
                 capacity: Optional[int] = None,
                 drop_policy: str = "position",
                 seed: int = 0,
                 backend: Optional[str] = None,
                 seed_draw: Optional[torch.Tensor] = None) -> Slots:
    """expert_ids [S, k] (+ scores for the probs policy) -> slots [S, k] int32, kept counts [E].

    capacity=None is dropless: rows [0, S*k), expert-contiguous. Otherwise expert e owns rows
    [e*C, (e+1)*C) and over-full experts drop routes by drop_policy (rts, position, probs).
    seed_draw: an optional one-element int64 CPU tensor (a draw from torch's generator) mixed into
    the rts seed, seed ^ draw: how torch.compiled code passes a fresh seed it cannot read as an int.
    """
    _check_index("expert_ids", expert_ids_SK)
    if expert_ids_SK.dim() != 2:
        raise ValueError(f"expert_ids must be 2-D [S, k], got shape {tuple(expert_ids_SK.shape)}")
    _check_float("scores", scores_SK, 2)
    if scores_SK.shape != expert_ids_SK.shape:
        raise ValueError(f"scores {tuple(scores_SK.shape)} and expert_ids {tuple(expert_ids_SK.shape)} differ")
    _check_same_device(expert_ids=expert_ids_SK, scores=scores_SK)
    check_int("num_experts", num_experts, 1, _INT32_MAX)
    if capacity is not None:
        check_int("capacity (None for dropless)", capacity, 0, _INT32_MAX // num_experts)
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    check_seed(seed)
    if seed_draw is not None:
        if not (isinstance(seed_draw, torch.Tensor) and seed_draw.dtype == torch.int64 and seed_draw.numel() == 1
                and seed_draw.device.type == "cpu"):
            raise TypeError(f"seed_draw must be a one-element int64 CPU tensor, got {seed_draw!r}")
    backend = choose_backend(expert_ids_SK, backend, num_experts)
    if expert_ids_SK.dtype == torch.int64:
        # The kernels index in int32: an id outside [0, E) routes nowhere, so map it to -1 here
        # rather than let the narrowing wrap 2**32 + 1 to expert 1 (one elementwise op, no sync).
        expert_ids_SK = _narrow_index(expert_ids_SK, num_experts)
    if torch.compiler.is_compiling():  # every backend: the reference's output shapes depend on values
        if torch._C._are_functorch_transforms_active():  # (a constant to dynamo)
            raise RuntimeError("torch.compile does not trace torch.func.grad or vjp through turbomoe's routing: "
                               "run the transform eagerly, or compile the layer inside it")
        return custom_ops.assign_slots(expert_ids_SK, scores_SK, num_experts, capacity, drop_policy, seed, backend,
                                       seed_draw)
    if seed_draw is not None:
        seed ^= int(seed_draw)  # a CPU tensor: no device sync
    if backend == "reference":
        return reference.assign_slots(expert_ids_SK, scores_SK, num_experts, capacity, drop_policy, seed)
    return plain_call("assign_slots", _impl(backend).assign_slots, expert_ids_SK, scores_SK, num_experts, capacity,
                      drop_policy, seed)


_INT32_MAX = (1 << 31) - 1


def _narrow_index(t: torch.Tensor, bound: int) -> torch.Tensor:
    """int32 copy of an index table: entries outside [0, bound) become -1 (route nowhere)."""
    return reference.routed_slots(t, bound).to(torch.int32)


def _check_distinct_rows(table: torch.Tensor, num_rows: int):
    """The bare-slots precondition: no two routes share a buffer row (entries outside [0, num_rows)
    route nowhere, so they share none). Checked where reading values costs no host sync (debug_checks)."""
    rows = table[(table >= 0) & (table < num_rows)]
    if rows.numel() != torch.unique(rows).numel():
        raise ValueError("slots: two routes name the same buffer row; a slots table must hold distinct rows "
                         "(or -1), as assign_slots makes them")


def _unpack_slots(slots, num_rows, S: Optional[int], like: torch.Tensor, rows_name: str = "num_rows",
                  like_name: str = "x"):
    """A Slots from assign_slots, or a bare [S, k] slots tensor with num_rows -> (tensor, rows,
    kept counts or None, capacity or None). S None: any token count (nothing else gives it).
    rows_name: what num_rows is to the caller (gather passes y's rows), like_name what like is, for the errors."""
    if isinstance(slots, Slots):
        if num_rows is not None and num_rows != slots.num_rows:
            raise ValueError(f"{rows_name} {num_rows} disagrees with the Slots' num_rows {slots.num_rows}")
        table, num_rows, kept, cap = slots.slots, slots.num_rows, slots.kept_counts, slots.capacity
    else:
        if num_rows is None:
            raise ValueError("num_rows is required with a bare slots tensor (or pass the Slots from assign_slots)")
        table, kept, cap = slots, None, None
    _check_index("slots", table)
    if table.dim() != 2 or S is not None and table.shape[0] != S:
        raise ValueError(f"slots must be [S, k]{'' if S is None else f' with S = {S} tokens'}, "
                         f"got {tuple(table.shape)}")
    if table.shape[1] > MAX_K:
        raise ValueError(f"slots may have at most {MAX_K} columns (k), got {table.shape[1]}")
    check_int("num_rows", num_rows, 0, _INT32_MAX)
    _check_same_device(**{like_name: like, "slots": table})
    return table, num_rows, kept, cap


def _bare_table(table: torch.Tensor, num_rows: int, kept: Optional[torch.Tensor]) -> torch.Tensor:
    """After the shape checks. A bare table (kept None): entries outside [0, num_rows) route
    nowhere on every backend (reference.routed_slots), int64 ones mapped before the kernels narrow
    them to int32; distinct rows checked where debug_checks. A Slots' table is assign_slots' own."""
    if kept is not None:
        return table
    if debug_checks(table):
        _check_distinct_rows(table, num_rows)
    return _narrow_index(table, num_rows) if table.dtype == torch.int64 else table


def scatter_tokens(x_SM: torch.Tensor, slots, num_rows: Optional[int] = None,
                   backend: Optional[str] = None) -> torch.Tensor:
    """x [S, M] -> expert buffer [num_rows, M]; rows no route reaches are zero.

    slots: the Slots from assign_slots (it carries num_rows and the kept counts, which locate the
    empty rows without another pass), or a bare [S, k] int tensor together with num_rows. In a bare
    table an entry outside [0, num_rows) routes nowhere; two routes may not name one row (checked
    on CPU tensors, and on a GPU with TURBOMOE_DEBUG=1).
    """
    _check_float("x", x_SM, 2)
    table, num_rows, kept, cap = _unpack_slots(slots, num_rows, x_SM.shape[0], x_SM)
    table = _bare_table(table, num_rows, kept)
    backend = choose_backend(x_SM, backend)
    if torch.compiler.is_compiling():  # every backend, as assign_slots
        return custom_ops.scatter_tokens(x_SM, Slots(table, kept, num_rows, cap), backend)
    if backend == "reference":
        return reference.scatter_tokens(x_SM, table, num_rows)
    return _scatter_fn(x_SM, table, num_rows, kept, cap, _impl(backend))


_Y_ROWS = "y's rows (the expert buffer's)"  # gather's num_rows is y's row count, not an argument


def gather_tokens(y_RM: torch.Tensor, slots, scores_SK: Optional[torch.Tensor], renormalize: bool = False,
                  backend: Optional[str] = None) -> torch.Tensor:
    """out [S, M] = sum over kept routes of w[s, j] * y[slots[s, j]], fp32 accumulation.

    slots: the Slots from assign_slots, or a bare [S, k] int tensor (y's rows are the buffer).
    w = scores; with renormalize, each token's kept scores over their sum (DeepSpeed's top-k
    combine after capacity, reference.renormalize_kept), formed inside the kernels, so the
    gradient reaches the raw scores with no extra ops. scores None: w = 1 (the rows were weighed
    already, see row_scores), and y is not kept for backward.
    """
    check_bool("renormalize", renormalize)
    _check_float("y", y_RM, 2)
    if scores_SK is None:
        if renormalize:
            raise ValueError("gather_tokens: renormalize needs scores")
        table, _, kept, cap = _unpack_slots(slots, y_RM.shape[0], None, y_RM, _Y_ROWS, "y")
    else:
        _check_float("scores", scores_SK, 2)
        table, _, kept, cap = _unpack_slots(slots, y_RM.shape[0], scores_SK.shape[0], y_RM, _Y_ROWS, "y")
        if table.shape != scores_SK.shape:
            raise ValueError(f"slots {tuple(table.shape)} and scores {tuple(scores_SK.shape)} differ")
        _check_same_device(y=y_RM, scores=scores_SK)  # slots were checked against y
    table = _bare_table(table, y_RM.shape[0], kept)
    backend = choose_backend(y_RM, backend)
    if backend == "reference":
        return reference.gather_tokens(y_RM, table, scores_SK, renormalize)
    if torch.compiler.is_compiling():
        return custom_ops.gather_tokens(y_RM, Slots(table, kept, y_RM.shape[0], cap), scores_SK, renormalize, backend)
    return _gather_fn(y_RM, table, scores_SK, kept, cap, _impl(backend), renormalize)


def buffer_counts(slots: Slots) -> torch.Tensor:
    """[E] int32: the expert buffer's rows per expert, the grouped GEMMs' counts: the kept counts, or
    with a capacity C for every expert (a block of C rows whose tail is zero and never gathered)."""
    if not isinstance(slots, Slots):
        raise TypeError(f"buffer_counts needs the Slots from assign_slots, got {type(slots).__name__}")
    if slots.capacity is None:
        return slots.kept_counts
    # Compiled not as full_like: inductor rewrites a cumsum of a full (the grouped GEMM's offsets) and
    # fails on a symbolic fill (C of a dynamic token count); eager keeps the one launch.
    if torch.compiler.is_compiling():
        return torch.zeros_like(slots.kept_counts) + slots.capacity
    return torch.full_like(slots.kept_counts, slots.capacity)


def row_scores(slots: Slots, scores_SK: torch.Tensor, backend: Optional[str] = None, *,
               renormalize: bool = False) -> torch.Tensor:
    """w [R] of the expert buffer's rows: row slots[s, j] gets scores[s, j], or with renormalize each
    token's kept scores over their sum (DeepSpeed's top-k combine weights after capacity,
    reference.renormalize_kept); rows no route fills (capacity's padding) 0. Differentiable (a
    dropped route's gradient is 0). With them the experts weigh their rows (GroupedExperts'
    row_scale) and gather_tokens sums with w = 1, so the experts' outputs need not be kept for the
    scores' gradient.

    The kernels form the weights per token in registers: one row push each way, where the plain
    PyTorch form (the reference: the renormalisation, then a scatter of the scores read route-major)
    takes a dozen launches each way (host time, in steps bound by it)."""
    if not isinstance(slots, Slots):
        raise TypeError(f"row_scores needs the Slots from assign_slots, got {type(slots).__name__}")
    check_bool("renormalize", renormalize)
    _check_float("scores", scores_SK, 2)
    if slots.slots.shape != scores_SK.shape:
        raise ValueError(f"slots {tuple(slots.slots.shape)} and scores {tuple(scores_SK.shape)} differ")
    _check_same_device(slots=slots.slots, scores=scores_SK)
    backend = choose_backend(scores_SK, backend)
    if backend == "reference" or torch.compiler.is_compiling():  # compiled: traced, the scatter a custom op
        # renormalised in the accumulation dtype, as the kernels and gather_tokens do (its eps clamps)
        w_SK = scores_SK
        if renormalize:
            w_SK = reference.renormalize_kept(scores_SK.to(reference.compute_dtype(scores_SK.dtype)), slots.slots)
            w_SK = w_SK.to(scores_SK.dtype)
        routes = Slots(slots.slots.reshape(-1, 1), slots.kept_counts, slots.num_rows, slots.capacity)
        return scatter_tokens(w_SK.reshape(-1, 1), routes, backend=backend).view(-1)
    return _row_scores_fn(scores_SK, slots.slots, slots.num_rows, slots.kept_counts, slots.capacity, _impl(backend),
                          renormalize)
