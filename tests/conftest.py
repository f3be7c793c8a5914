import atexit
import glob
import math
import os
import shutil
import tempfile
import time

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# The recipes' corpus cache (turbomoe/data/cache.py) in a directory of the test session's, not the
# home of whoever runs the tests (xdist's workers inherit it).
if "TURBOMOE_CACHE" not in os.environ:
    os.environ["TURBOMOE_CACHE"] = tempfile.mkdtemp(prefix="turbomoe-tests-")
    atexit.register(shutil.rmtree, os.environ["TURBOMOE_CACHE"], True)


def pytest_collection_modifyitems(config, items):
    """TURBOMOE_TEST_SHARD=i/n keeps every n-th collected test from the i-th (1-based), so that
    scripts/gpu_tests.sh can split the GPU suite over calls of the device machine (ten minutes each:
    the whole suite took more on 2026-11-28). Deterministic, as xdist's workers need."""
    shard = os.environ.get("TURBOMOE_TEST_SHARD")
    if not shard:
        return
    try:
        i, n = (int(v) for v in shard.split("/"))
    except ValueError:
        raise pytest.UsageError(f"TURBOMOE_TEST_SHARD must be i/n, got {shard!r}") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"TURBOMOE_TEST_SHARD must be i/n with 1 <= i <= n, got {shard!r}")
    config.hook.pytest_deselected(items=[t for j, t in enumerate(items) if j % n != i - 1])
    items[:] = [t for j, t in enumerate(items) if j % n == i - 1]


def require_cuda_backend():
    """For a test of the cuda backend: skip where the machine cannot build it (no nvcc), but fail
    where it has nvcc and the build failed: a broken kernel must not pass as a skipped test."""
    from turbomoe import csrc
    if csrc.available():
        return
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    if shutil.which("nvcc") or os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        pytest.fail("nvcc is here but the turbomoe CUDA extension did not build (see the warning)")
    pytest.skip("no nvcc: the CUDA extension cannot be built here")


def kernel_backends():
    """The op backends this process can run: the reference always; triton on a GPU or under
    TRITON_INTERPRET=1 (tests/*_triton.py); cuda on a GPU."""
    names = ["reference"]
    if HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1":
        names.append("triton")
    if HAS_CUDA:
        names.append(pytest.param("cuda", marks=pytest.mark.gpu))
    return names


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """||a - b|| / max(||b||, floor) in float64; NaN anywhere fails every tolerance. floor: the
    scale of b where b may be zero up to rounding (an analytically zero gradient)."""
    a, b = a.double(), b.double()
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    denom = max(b.norm().item(), floor)
    return (a - b).norm().item() / (denom if denom > 0 else 1.0)


class PoisonPast(torch.autograd.Function):
    """apply(t, n): rows n.. of t, and of its gradient, set to NaN: what a grouped GEMM may leave past
    the counts (unspecified: it does not write them) and may be handed there."""

    @staticmethod
    def forward(ctx, t, n):
        ctx.n = n
        t = t.clone()
        t[n:] = float("nan")
        return t

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[ctx.n:] = float("nan")
        return g, None


def check_rows_past_unread(monkeypatch, make, poison, hidden, device, dtype, routed=37, rows=40):
    """make() -> (module, forward(x [rows, hidden]) -> y), its grouped GEMMs over `routed` rows; poison
    (monkeypatch) makes them PoisonPast's. Two micro-batches accumulating, without and with the poison:
    the routed rows' outputs and input gradients and the parameters' gradients the same bits, finite."""
    runs = []
    for poisoned in (False, True):
        module, forward = make()
        if poisoned:
            poison(monkeypatch)
        outs = []
        for seed in (21, 22):
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(rows, hidden, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
            y = forward(x)
            y.backward(torch.randn(y.shape, generator=gen, dtype=torch.float64).to(device, dtype))
            outs += [y.detach()[:routed], x.grad[:routed]]
        runs.append(outs + [p.grad for p in module.parameters()])
        monkeypatch.undo()
    for a, b in zip(*runs):
        assert torch.isfinite(b).all() and torch.equal(a, b)


class _Taken(list):
    gemm: list


@pytest.fixture
def grads_in_place_taken(monkeypatch):
    """A list that gets the shape of each stack of expert .grad tensors that
    expert_stack.grads_in_place hands back to add a stacked gradient into (the path taken); its .gemm
    those handed to a weight-gradient GEMM (fused_grad_accumulation)."""
    from turbomoe.integrations import expert_stack
    taken, real, real_call = _Taken(), expert_stack.grads_in_place, expert_stack.GradsInPlace.__call__
    taken.gemm = []

    def spy(node):
        g = real(node)
        if g is not None:
            taken.append(g.shape)
        return g

    def spy_call(self):
        g = real_call(self)
        if g is not None:
            taken.gemm.append(g.shape)
        return g
    monkeypatch.setattr(expert_stack, "grads_in_place", spy)
    monkeypatch.setattr(expert_stack.GradsInPlace, "__call__", spy_call)
    return taken


def rts_keep_frequencies(assign, S, C, seeds, **kw):
    """Fraction of seeds in which each of S routes to one over-full expert is kept; checks that
    exactly C are kept every time."""
    ids = torch.zeros(S, 1, dtype=torch.int32, **kw)
    kept = torch.zeros(S, dtype=torch.float64)
    for seed in range(seeds):
        s = assign(ids, torch.rand(S, 1, **kw), 1, C, "rts", seed)
        k = (s.slots[:, 0] >= 0).cpu()
        assert int(k.sum()) == C and int(s.kept_counts[0]) == C
        kept += k
    return kept / seeds


def assert_uniform(freq, p, seeds):
    """Each route is kept with probability p = C / count: within 5 standard deviations for every
    route (false-alarm rate below 1e-4 over 64 routes)."""
    sd = math.sqrt(p * (1 - p) / seeds)
    assert (freq - p).abs().max() < 5 * sd, (freq - p).abs().max()


@pytest.fixture(scope="session", autouse=True)
def remove_deepspeed_shm_buffers():
    """DeepSpeed's CPU all-reduce leaves a 66 MB buffer per rank in /dev/shm when a launched run
    exits; remove the ones this session's launcher tests made, so repeated runs do not fill memory."""
    start = time.time()
    yield
    for path in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
        try:
            if os.stat(path).st_mtime >= start:
                os.remove(path)
        except OSError:  # gone already, or not ours to remove
            pass


@pytest.fixture
def one_thread():
    """Tiny matrices: on a loaded machine torch's spinning threads, not the work, set the time
    (test_engine.py: 115 s on two busy cores, 13 s on one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
