"""turbomoe's CUDA C++ kernels, built on first use with torch.utils.cpp_extension.

The same five launchers as the Triton backend (turbomoe/kernels/__init__.py), with the same
signatures and results: gating_forward, gating_backward, assign_slots, push_rows, pull_rows; and
second_expert_forward / _backward (top-2's second expert, sampled or not: only this backend fuses
it). Each launcher is one C++ call that allocates and launches everything its op needs, so an op costs a
few microseconds of host time where a chain of Triton launches from Python costs tens to hundreds:
the gating path of a training step is host-bound at practical batch sizes.

The build (about a minute of nvcc, once per checkout, Python, torch and CUDA version; cached under
TORCH_EXTENSIONS_DIR, else torch's default folder: build_directory) needs nvcc and ninja. Limits:
E <= MAX_EXPERTS (the Triton backend serves larger E), k <= 8.

Also here, as a module of its own: grouped_mm and grouped_mm_wgrad, the experts' grouped GEMMs on
Hopper from CUTLASS's sm90 kernel templates (grouped_gemm.cuh; the headers come from the
nvidia-cutlass wheel).
"""
import functools
import hashlib
import importlib.util
import os
import sys
import time
import warnings

import torch

from .. import reference
from ..reference import Slots, as_contiguous, aux_loss_coefficient, compute_dtype, hash32_int

MAX_EXPERTS = 1024  # mirrors common.cuh, whose kernels check it too; read here without building them
_SOURCES = ("bindings.cpp", "gating.cu", "slots.cu", "rows.cu", "sampling.cu", "shuffling.cu")
_GMM_SOURCES = ("grouped_gemm_bindings.cpp", "grouped_gemm_nn.cu", "grouped_gemm_nt.cu", "grouped_gemm_tn.cu",
                "grouped_gemm_tn_fp32_into.cu", "grouped_gemm_tn_bf16_into.cu")
_POLICIES = {"position": 0, "rts": 1, "probs": 2}


def build_directory(name: str, here: str) -> str:
    """Where `name` builds: one folder per checkout, Python and torch/CUDA version. torch's default
    folder is keyed by the name alone, so two checkouts (an A/B of two commits, two virtual
    environments) would rebuild each other's module at every switch: ninja's commands name the
    sources' paths."""
    from torch.utils.cpp_extension import get_default_build_root
    key = f"{here}|{sys.version}|{torch.__version__}|{torch.version.cuda}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return os.path.join(root, f"{name}_{hashlib.sha1(key.encode()).hexdigest()[:10]}")


def _warn_if_locked(directory: str, what: str):
    """torch waits, silently and without end, for the lock of a build in progress; a build killed by
    a signal (a timeout's SIGTERM, SIGKILL) leaves its lock behind, and every later process hangs."""
    lock = os.path.join(directory, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return
    warnings.warn(f"turbomoe: waiting for another process's build of {what} (its lock {lock} was made "
                  f"{age:.0f} s ago). If no build is running (one killed by a signal leaves its lock), "
                  f"delete that file.")


def _load(name: str, sources, what: str, cuda_flags=(), include_dirs=()):
    from torch.utils.cpp_extension import load
    here = os.path.dirname(os.path.abspath(__file__))
    directory = build_directory(name, here)
    os.makedirs(directory, exist_ok=True)
    _warn_if_locked(directory, what)
    return load(name=name, sources=[os.path.join(here, s) for s in sources], extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-lineinfo", *cuda_flags], extra_include_paths=list(include_dirs),
                build_directory=directory, verbose=os.environ.get("TURBOMOE_BUILD_VERBOSE") == "1")


def _builds(build, what: str, fallback: str) -> bool:
    try:
        build()
        return True
    except Exception as e:  # noqa: BLE001 (no nvcc, ninja or headers: the fallback serves instead)
        warnings.warn(f"turbomoe: {what} could not be built, using {fallback} ({type(e).__name__}: {e})")
        return False


@functools.lru_cache(maxsize=None)
def extension():
    """The compiled module, built on the first call; raises if it cannot be built."""
    return _load("turbomoe_cuda", _SOURCES, "the CUDA backend")


# assume_constant_result: torch.compile calls these at trace time and keeps the answer (dynamo
# ignores lru_cache and cannot trace the build's file-system calls).
@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the CUDA backend can run here: a GPU, and the extension builds (once)."""
    return _available()


@functools.lru_cache(maxsize=None)
def _available() -> bool:
    return torch.cuda.is_available() and _builds(extension, "the CUDA backend", "Triton")


def cutlass_include_dirs():
    """CUTLASS's C++ headers, from the nvidia-cutlass wheel (found without importing its Python)."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the CUTLASS grouped GEMM needs CUTLASS's headers: pip install nvidia-cutlass "
                          "(turbomoe's [cuda] extra)")
    source = os.path.join(list(spec.submodule_search_locations)[0], "source")
    return [os.path.join(source, "include"), os.path.join(source, "tools", "util", "include")]


@functools.lru_cache(maxsize=None)
def gmm_extension():
    """The CUTLASS grouped GEMM (grouped_gemm.cuh), a module of its own: about 90 s of nvcc on 16
    cores, and it needs CUTLASS's headers. sm_90a only: wgmma and TMA have no portable target."""
    return _load("turbomoe_gmm", _GMM_SOURCES, "the CUTLASS grouped GEMM", include_dirs=cutlass_include_dirs(),
                 cuda_flags=["-gencode=arch=compute_90a,code=sm_90a", "-DNDEBUG", "--expt-relaxed-constexpr"])


@torch.compiler.assume_constant_result
def gmm_available() -> bool:
    """Whether the CUTLASS grouped GEMM builds here (once); the caller checks for an sm90 device."""
    return _gmm_available()


@functools.lru_cache(maxsize=None)
def _gmm_available() -> bool:
    return torch.cuda.is_available() and _builds(gmm_extension, "the CUTLASS grouped GEMM", "torch._grouped_mm")


def grouped_mm(x_RK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """y [R, N], y[rows_g] = x[rows_g] @ w[g]: bf16, x contiguous, w contiguous or a transposed
    view of a contiguous [G, N, K], offs_G the inclusive int32 row offsets."""
    return gmm_extension().grouped_mm(x_RK, w_GKN, offs_G)


def grouped_mm_wgrad(a_RM: torch.Tensor, b_RN: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """d [G, M, N], d[g] = a[rows_g]^T @ b[rows_g] (zero for empty groups): bf16, a and b contiguous
    and 16-byte aligned, M and N multiples of 8, offs_G the inclusive int32 row offsets."""
    return gmm_extension().grouped_mm_wgrad(a_RM, b_RN, offs_G)


def grouped_mm_wgrad_into_(a_RM: torch.Tensor, b_RN: torch.Tensor, offs_G: torch.Tensor, d_GMN: torch.Tensor,
                           accumulate: bool) -> torch.Tensor:
    """d [G, M, N] fp32 or bf16, each d[g] a contiguous [M, N] (the groups any 16-byte-aligned distance
    apart): d[g] = a[rows_g]^T @ b[rows_g] in place (zero for empty groups), or with accumulate d[g] +=
    it (empty groups untouched); d returned."""
    return gmm_extension().grouped_mm_wgrad_into_(a_RM, b_RN, offs_G, d_GMN, accumulate)


def gating_forward(logits_SE: torch.Tensor, k: int, sigmoid: bool, renormalize: bool, bias_E=None):
    """ids [S,k] int32, scores [S,k], counts [E] int32, ce [E], lse [S], aux and z (0-d)."""
    ids, scores, counts, ce, aux, z, lse = extension().gating_forward(
        logits_SE.contiguous(), k, sigmoid, renormalize, as_contiguous(bias_E, compute_dtype(logits_SE.dtype)),
        aux_loss_coefficient(logits_SE.shape[1], k))
    return ids, scores, counts, ce, lse, aux, z


def gating_backward(logits_SE, ids, grad_scores, lse, ce_E, g_aux, g_z, sigmoid: bool, renormalize: bool):
    """grad_logits [S, E]; grad_scores, g_aux and g_z may be None. lse is recomputed, not read."""
    acc = compute_dtype(logits_SE.dtype)
    return extension().gating_backward(logits_SE.contiguous(), ids, as_contiguous(grad_scores, acc), ce_E,
                                       as_contiguous(g_aux, acc), as_contiguous(g_z, acc), sigmoid, renormalize,
                                       aux_loss_coefficient(logits_SE.shape[1], ids.shape[1]))


def assign_slots(expert_ids_SK: torch.Tensor, scores_SK: torch.Tensor, num_experts: int,
                 capacity=None, drop_policy: str = "position", seed: int = 0) -> Slots:
    S, k = expert_ids_SK.shape
    by_score = capacity is not None and drop_policy == "probs"
    slots, kept = extension().assign_slots(
        expert_ids_SK.contiguous(), as_contiguous(scores_SK, torch.float32) if by_score else None, num_experts,
        -1 if capacity is None else capacity, _POLICIES[drop_policy], hash32_int(seed))
    return Slots(slots, kept, S * k if capacity is None else num_experts * capacity, capacity)


def push_rows(src_SM, slots_SK, out_RM, kept_counts_E=None, capacity=None, scores_SK=None, y_RM=None,
              dscores_SK=None, renormalize=False):
    """out[slots[s, j]] = (w[s, j] *) src[s], rows no route reaches zeroed; with y given,
    dscores[s, j] = dL/dscores[s, j] from <src[s], y[slots[s, j]]> in fp32 (see turbomoe/kernels/rows.py)."""
    acc = compute_dtype(src_SM.dtype)
    extension().push_rows(src_SM, slots_SK, out_RM, as_contiguous(kept_counts_E, torch.int32), capacity or 0,
                          as_contiguous(scores_SK, acc), None if y_RM is None else y_RM.contiguous(), dscores_SK,
                          renormalize)


def pull_rows(y_RM, slots_SK, out_SM, scores_SK=None, renormalize=False):
    """out[s] = sum_j (w[s, j] *) y[slots[s, j]], accumulated in fp32 (fp64 for fp64)."""
    extension().pull_rows(y_RM, slots_SK, out_SM, as_contiguous(scores_SK, compute_dtype(y_RM.dtype)), renormalize)


def second_expert_forward(logits_SE, first_ids_S1, first_scores_S1, counts_E, rand_SE):
    """ids [S, 2] int32 (first, second: sampled, or the best other logit where rand_SE is None),
    scores [S, 2], counts [E] int32 with the second choices added (see turbomoe.reference.second_expert)."""
    return extension().second_expert_forward(logits_SE.contiguous(), as_contiguous(first_ids_S1, torch.int32),
                                             as_contiguous(first_scores_S1, logits_SE.dtype), counts_E,
                                             None if rand_SE is None else rand_SE.contiguous())


def second_expert_backward(logits_SE, ids_S2, first_scores_S1, grad_scores_S2):
    """grad of logits [S, E] and of the first scores [S]."""
    return extension().second_expert_backward(logits_SE.contiguous(), ids_S2, first_scores_S1.contiguous(),
                                              as_contiguous(grad_scores_S2, logits_SE.dtype))


# index_shuffling's one block (a warp a token) wins up to this many tokens, the Triton kernels beyond
# (H100, E 16 to 128, k 1 to 8: notes/inference.md)
ONE_BLOCK_MAX_TOKENS = 8


def index_shuffling(logits_TE: torch.Tensor, k: int, score_func: str = "softmax", renormalize: bool = False,
                    shared_expert: bool = False):
    """reference.index_shuffling on the GPU in one block (any T; turbomoe.inference.index_shuffling
    goes to Triton beyond ONE_BLOCK_MAX_TOKENS)."""
    return reference.ShuffledRoutes(*extension().index_shuffling(logits_TE.contiguous(), k, shared_expert,
                                                                 score_func == "sigmoid", renormalize))
