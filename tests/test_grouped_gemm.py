"""Grouped GEMM (turbomoe.autograd.grouped_gemm) against per-group matmuls in fp64."""
import importlib.util

import pytest
import torch

from turbomoe.autograd.grouped_gemm import grouped_mm

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def random_counts(R, G, gen, zero_groups=()):
    """G counts summing to at most R, with the given groups empty (every group empty: zeros, where
    w / w.sum() would be NaN, which int32 makes negative counts)."""
    w = torch.rand(G, generator=gen)
    w[list(zero_groups)] = 0
    if not w.any():
        return torch.zeros(G, dtype=torch.int32)
    counts = (w / w.sum() * R).floor().to(torch.int32)
    counts[int(torch.argmax(w))] += R - int(counts.sum())
    return counts


def per_group(x, w, counts):
    """y [R, N] by a loop of fp64 matmuls; rows past sum(counts) are zero."""
    y = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    start = 0
    for g, n in enumerate(counts.tolist()):
        y[start:start + n] = x[start:start + n].double().cpu() @ w[g].double().cpu()
        start += n
    return y


def rel_err(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm().clamp_min(1e-30)).item()


def check(R, K, N, G, dtype, device, backend, zero_groups=(), tail=0, tol=1e-12, transposed_w=False, gap=0):
    """gap: the groups stored that many rows apart beyond their own (as packed parameters are)."""
    gen = torch.Generator().manual_seed(R * 7 + K + N + G)
    counts = random_counts(R - tail, G, gen, zero_groups)
    x = torch.randn(R, K, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
    if transposed_w:  # w stored [G, N, K], used as [G, K, N]
        w = torch.randn(G, N + gap, K, generator=gen, dtype=torch.float64).to(device, dtype)[:, :N].transpose(1, 2)
    else:
        w = torch.randn(G, K + gap, N, generator=gen, dtype=torch.float64).to(device, dtype)[:, :K]
    w = w.detach().requires_grad_()
    made = []  # the gradient as the GEMM makes it, before AccumulateGrad copies it into w's layout
    w.register_hook(lambda g: made.append(g.stride()))
    dy = torch.randn(R, N, generator=gen, dtype=torch.float64).to(device, dtype)
    used = int(counts.sum())
    y = grouped_mm(x, w, counts.to(device), backend=backend)
    (y[:used] * dy[:used]).sum().backward()
    # stacked nn.Linear weights: no transposing copy (made in w's layout, its groups back to back)
    assert made == [(K * N, ) + w.stride()[1:]], (made, w.stride())

    xr = x.detach().double().cpu().requires_grad_()
    wr = w.detach().double().cpu().requires_grad_()
    yr = per_group(xr, wr, counts)
    ref_y = yr.detach()
    (yr[:used] * dy[:used].double().cpu()).sum().backward()
    assert rel_err(y[:used], ref_y[:used]) < tol
    assert rel_err(x.grad[:used], xr.grad[:used]) < tol
    assert rel_err(w.grad, wr.grad) < tol
    for g in zero_groups:  # empty experts get an exact zero weight gradient, no NaN
        assert torch.equal(w.grad[g].cpu(), torch.zeros_like(w.grad[g].cpu()))


def main_grad_buffer(G, K, N, gen, device, layout):
    """An fp32 [G, K, N] main_grad filled with noise: "plain" (contiguous), "transposed" (each group a
    row-major [N, K] block seen transposed, as stacked nn.Linear weights' buffers are) or "gap" (the
    groups 8 elements further apart than their size, as packed parameters' buffers lie)."""
    if layout == "transposed":
        return torch.randn(G, N, K, generator=gen, dtype=torch.float64).to(device, torch.float32).transpose(1, 2)
    if layout == "gap":
        return torch.randn(G, K * N + 8, generator=gen, dtype=torch.float64).to(device, torch.float32)[:, :K * N].view(G, K, N)
    return torch.randn(G, K, N, generator=gen, dtype=torch.float64).to(device, torch.float32)


def check_main_grad(R, K, N, G, dtype, device, backend, zero_groups=(), tail=0, tol=1e-12, transposed_w=False,
                    add=True, placeholder=True, layout="plain"):
    """Gradient-accumulation fusion: two micro-batches' weight gradients added into a pre-filled fp32
    main_grad inside the GEMM (add), or each written there (not add: the second micro-batch's alone);
    added, empty groups' slices untouched (bitwise), written, exact zeros; the input gradient as
    without fusion; w gets a placeholder gradient of its shape (placeholder), or none."""
    gen = torch.Generator().manual_seed(R * 5 + K + N + G)
    counts = random_counts(R - tail, G, gen, zero_groups)
    used = int(counts.sum())
    w = torch.randn(G, N, K, generator=gen, dtype=torch.float64).transpose(1, 2) if transposed_w else \
        torch.randn(G, K, N, generator=gen, dtype=torch.float64)
    w = w.to(device, dtype).requires_grad_()
    main = main_grad_buffer(G, K, N, gen, device, layout)
    want = main.double().cpu()
    before = main.clone()
    for _ in range(2):
        x = torch.randn(R, K, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
        dy = torch.randn(R, N, generator=gen, dtype=torch.float64).to(device, dtype)
        w.grad = None
        y = grouped_mm(x, w, counts.to(device), backend=backend, main_grad_GKN=main, main_grad_add=add,
                       main_grad_placeholder=placeholder)
        (y[:used] * dy[:used]).sum().backward()
        if placeholder:
            assert w.grad is not None and w.grad.shape == w.shape
        else:
            assert w.grad is None
        xr = x.detach().double().cpu().requires_grad_()
        wr = w.detach().double().cpu().requires_grad_()
        (per_group(xr, wr, counts)[:used] * dy[:used].double().cpu()).sum().backward()
        assert rel_err(x.grad[:used], xr.grad[:used]) < tol
        want = want + wr.grad if add else wr.grad
    assert main.dtype == torch.float32
    assert rel_err(main, want) < tol
    for g in zero_groups:
        if add:
            assert torch.equal(main[g], before[g]), "an empty group's main_grad changed"
        else:
            assert torch.equal(main[g].cpu(), torch.zeros(K, N)), "an empty group's written main_grad is not zero"


@pytest.mark.parametrize("zero_groups,tail", [((), 0), ((1,), 3)])
@pytest.mark.parametrize("add,placeholder,layout", [(True, True, "plain"), (False, False, "transposed"),
                                                    (False, True, "gap"), (True, False, "transposed")])
def test_reference_main_grad(zero_groups, tail, add, placeholder, layout):
    check_main_grad(37, 8, 12, 4, torch.float64, "cpu", "reference", zero_groups, tail, tol=1e-6, add=add,
                    placeholder=placeholder, layout=layout)


def test_main_grad_no_rows():
    """S = 0: main_grad keeps its value."""
    main = torch.randn(3, 4, 5)
    before = main.clone()
    x = torch.randn(0, 4, requires_grad=True)
    w = torch.randn(3, 4, 5, requires_grad=True)
    grouped_mm(x, w, torch.zeros(3, dtype=torch.int32), backend="reference", main_grad_GKN=main).sum().backward()
    assert torch.equal(main, before)


def test_main_grad_bad_input():
    x, w, counts = torch.randn(6, 4), torch.randn(2, 4, 3), torch.tensor([3, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="main_grad must be"):
        grouped_mm(x, w, counts, main_grad_GKN=torch.zeros(2, 3, 4))
    with pytest.raises(TypeError, match="main_grad must be a float"):
        grouped_mm(x, w, counts, main_grad_GKN=torch.zeros(2, 4, 3, dtype=torch.int32))


@pytest.mark.parametrize("zero_groups,tail", [((), 0), ((0, 2), 0), ((1,), 3)])
def test_reference_fp64(zero_groups, tail):
    check(37, 8, 12, 4, torch.float64, "cpu", "reference", zero_groups, tail)


def test_reference_gradcheck():
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 4], dtype=torch.int32)
    x = torch.randn(7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, counts, backend="reference"), (x, w))


def test_bad_input():
    x = torch.randn(6, 4)
    w = torch.randn(2, 4, 3)
    counts = torch.tensor([3, 3], dtype=torch.int32)
    with pytest.raises(TypeError, match="int32"):
        grouped_mm(x, w, counts.long())
    with pytest.raises(TypeError, match="int32"):
        grouped_mm(x, w, torch.tensor([6], dtype=torch.int32))
    with pytest.raises(TypeError, match="float dtype"):
        grouped_mm(x, w.double(), counts)
    with pytest.raises(ValueError, match="K = 5"):
        grouped_mm(torch.randn(6, 5), w, counts)
    with pytest.raises(ValueError, match=r"\[R, K\]"):
        grouped_mm(x[None], w, counts)
    with pytest.raises(ValueError, match="unknown grouped GEMM backend"):
        grouped_mm(x, w, counts, backend="cublas")
    with pytest.raises(ValueError, match="torch grouped GEMM backend"):
        grouped_mm(x, w, counts, backend="torch")
    with pytest.raises(ValueError, match="cutlass grouped GEMM backend"):
        grouped_mm(x, w, counts, backend="cutlass")


# "cutlass+wgrad": the cutlass backend with its own weight-gradient kernels for every group size (the
# default rules keep torch's below CUTLASS_WGRAD_MIN_ROWS rows a group, which most shapes here are,
# and accumulate into a main_grad in the Triton kernel up to FUSED_WGRAD_MAX_ROWS)
BACKENDS = ["cutlass", "cutlass+wgrad", "triton", "torch"]


def use_backend(backend, monkeypatch):
    """The backend's name for grouped_mm; "cutlass+wgrad" lowers the weight-gradient rule to 0 rows."""
    if backend == "cutlass+wgrad":
        from turbomoe.autograd import grouped_gemm
        monkeypatch.setattr(grouped_gemm, "CUTLASS_WGRAD_MIN_ROWS", 0)
        monkeypatch.setattr(grouped_gemm, "FUSED_WGRAD_MAX_ROWS", 0)
        return "cutlass"
    return backend


def skip_unless_runs(backend, dtype=torch.bfloat16):
    """Skips where a backend does not apply. The cutlass backend is not skipped for a failed build:
    on an sm90 GPU with the headers installed, a build error fails the test."""
    backend = backend.split("+")[0]
    if backend == "torch" and (dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm")
                               or torch.cuda.get_device_capability() < (9, 0)):
        pytest.skip("torch._grouped_mm runs bf16 on sm90+ only")
    if backend == "cutlass" and (dtype != torch.bfloat16 or torch.cuda.get_device_capability() != (9, 0)
                                 or importlib.util.find_spec("cutlass_library") is None):
        pytest.skip("the CUTLASS grouped GEMM runs bf16 on sm90 and needs the nvidia-cutlass headers")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1000, 256, 384, 8, (3, 5), 0), (777, 136, 200, 5, (0,), 9),
                                   (64, 64, 64, 64, (), 0), (4099, 264, 520, 6, (2,), 3),
                                   (3307, 72, 136, 2, (1,), 7)])  # one group with every row: cutlass's own dw
@pytest.mark.parametrize("transposed_w", [False, True])
@pytest.mark.parametrize("gap", [0, 8])  # 8: the groups 16-byte-aligned apart but not back to back
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu(backend, dtype, shape, transposed_w, gap, monkeypatch):
    R, K, N, G, zero_groups, tail = shape
    skip_unless_runs(backend, dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    check(R, K, N, G, dtype, "cuda", use_backend(backend, monkeypatch), zero_groups, tail, tol, transposed_w, gap)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("counts, M, N", [([0, 5, 0, 300, 1], 64, 128), ([0, 0, 0], 16, 8), ([1000], 8, 16),
                                          ([7, 0, 129, 64], 136, 264), ([1] * 70 + [3000, 0, 2], 24, 40)])
def test_gpu_cutlass_wgrad_kernel(counts, M, N):
    """turbomoe's CUTLASS weight-gradient kernel alone, fresh random data: against fp64 per group
    (empty groups exactly zero), bit for bit against torch._grouped_mm (the same tile and cluster: the
    longest-first order of the groups changes no sum), repeatable, rows past sum(counts) not read,
    offsets past R truncated; bad input is a clear error."""
    skip_unless_runs("cutlass")
    from turbomoe import csrc
    R = sum(counts)
    a = torch.randn(R + 5, M, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(R + 5, N, device="cuda", dtype=torch.bfloat16)
    a[R:] = b[R:] = float("nan")  # rows past the groups' are never read
    offs = torch.tensor(counts, device="cuda").cumsum(0).int()
    d = csrc.grouped_mm_wgrad(a, b, offs)
    start = 0
    for g, c in enumerate(counts):
        want = a[start:start + c].double().t() @ b[start:start + c].double()
        if c == 0:
            assert torch.equal(d[g], torch.zeros_like(d[g]))
        else:
            assert rel_err(d[g], want) < 1e-2
        start += c
    assert torch.equal(d, csrc.grouped_mm_wgrad(a, b, offs))
    if R:
        assert torch.equal(d, torch._grouped_mm(a[:R].t(), b[:R], offs=offs))
        short = offs.clamp(max=R - 1)  # offsets past R' = R - 1 rows: the last rows' groups truncated
        assert torch.equal(csrc.grouped_mm_wgrad(a[:R - 1], b[:R - 1], offs), csrc.grouped_mm_wgrad(a[:R - 1], b[:R - 1], short))
    # into fp32 or bf16 buffers: d = (or +=) a_g^T b_g; written, empty groups exactly zero and (fp32)
    # the bits of the fp32 sums the bf16 kernel rounds; added, empty groups' slices untouched
    # (bitwise). The groups contiguous, or 8 elements further apart (as an optimizer's flat buffer
    # holds packed experts).
    G = len(counts)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for gap in (0, 8):
            for add in (True, False):
                d0 = torch.randn(G, M * N + gap, device="cuda").to(dtype)[:, :M * N].view(G, M, N)
                d1 = csrc.grouped_mm_wgrad_into_(a, b, offs, d0.clone(), add)
                start = 0
                for g, c in enumerate(counts):
                    if c == 0:
                        assert torch.equal(d1[g], d0[g] if add else torch.zeros_like(d0[g]))
                    else:
                        want = a[start:start + c].double().t() @ b[start:start + c].double() + (d0[g].double() if add else 0)
                        assert rel_err(d1[g], want) < tol
                    start += c
                out = torch.full((G, M * N + gap), 7.0, device="cuda", dtype=dtype)
                d2 = csrc.grouped_mm_wgrad_into_(a, b, offs, out[:, :M * N].view(G, M, N), add)
                assert torch.equal(out[:, M * N:], torch.full_like(out[:, M * N:], 7.0)), "wrote between the groups"
                if add:
                    assert torch.equal(d1, csrc.grouped_mm_wgrad_into_(a, b, offs, d0.clone(), add))
                else:
                    assert torch.equal(d1, d2) and torch.equal(d1.bfloat16(), d)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        csrc.grouped_mm_wgrad_into_(a, b, offs, d0.half(), True)
    with pytest.raises(RuntimeError, match=r"\[G, M, N\]"):
        csrc.grouped_mm_wgrad_into_(a, b, offs, d0[:, :, :N - 8].contiguous(), True)
    with pytest.raises(RuntimeError, match="contiguous"):
        csrc.grouped_mm_wgrad_into_(a, b, offs, torch.zeros(G, N, M, device="cuda").transpose(1, 2), False)
    with pytest.raises(RuntimeError, match="bf16"):
        csrc.grouped_mm_wgrad(a.float(), b.float(), offs)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        csrc.grouped_mm_wgrad(a[:, :M - 1].contiguous(), b, offs)
    with pytest.raises(RuntimeError, match=r"\[R, M\]"):
        csrc.grouped_mm_wgrad(a, b[:R + 4], offs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_packed_experts_take_cutlass():
    """The drop-in's SwiGLU experts, packed into one buffer and stacked as views (their groups
    3 F M elements apart), run the CUTLASS kernel where it applies; groups whose distance is not
    16-byte aligned go to torch._grouped_mm."""
    skip_unless_runs("cutlass")
    from torch import nn
    from turbomoe.autograd.grouped_gemm import choose_gmm_backend
    from turbomoe.integrations.deepspeed_experts import SwiGLUExpert
    from turbomoe.integrations.expert_stack import pack_expert_params, stack_expert_tensors
    experts = nn.ModuleList([SwiGLUExpert(256, 384) for _ in range(4)]).cuda().bfloat16()
    pack_expert_params(experts)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    w1 = stack_expert_tensors([[e.w1.weight, e.w3.weight] for e in experts]).transpose(1, 2)
    assert w1.stride(0) == 3 * 256 * 384 and w1.data_ptr() == experts[0].w1.weight.data_ptr()  # views, no copy
    assert choose_gmm_backend(x, w1) == "cutlass"
    odd = torch.randn(4, 256 * 384 + 4, device="cuda", dtype=torch.bfloat16)[:, :256 * 384].view(4, 384, 256)
    assert choose_gmm_backend(x, odd.transpose(1, 2)) == "torch"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1000, 256, 384, 8, (3, 5), 0), (777, 136, 200, 5, (0,), 9),
                                   (4099, 264, 520, 6, (2,), 3), (4099, 72, 48, 2, (), 3), (4099, 72, 48, 3, (1,), 3)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("add,layout", [(True, "plain"), (False, "transposed"), (True, "gap"), (False, "plain")])
def test_gpu_main_grad(backend, dtype, shape, add, layout, monkeypatch):
    """Every backend's weight gradient accumulates into (add) or is written to main_grad on the GPU:
    inside the cutlass backend's kernel (fp32, each group contiguous: every layout here, the
    transposed one through dy^T x), else added inside the Triton kernel (groups of at most
    FUSED_WGRAD_MAX_ROWS rows), else as the backend's dw plus an add or a copy; an empty group's
    slice untouched where added, zero where written."""
    R, K, N, G, zero_groups, tail = shape
    skip_unless_runs(backend, dtype)
    check_main_grad(R, K, N, G, dtype, "cuda", use_backend(backend, monkeypatch), zero_groups, tail,
                    1e-2 if dtype == torch.bfloat16 else 1e-5, transposed_w=backend == "triton", add=add,
                    placeholder=add, layout=layout)


def check_no_rows(device, backend, dtype, tol):
    """R = 0 (an expert-parallel rank that received no tokens; S = 0): y [0, N] and x's gradient
    [0, K], w's gradient exact zeros in w's layout (stored or transposed); into a main_grad, added
    keeps its bits, written gives exact zeros. And rows but every group empty: the same zeros."""
    for transposed_w in (False, True):
        check(0, 64, 48, 3, dtype, device, backend, tol=tol, transposed_w=transposed_w)
        check(5, 64, 48, 3, dtype, device, backend, zero_groups=(0, 1, 2), tail=5, tol=tol,
              transposed_w=transposed_w)
    for add, layout in ((True, "plain"), (False, "transposed"), (False, "gap")):
        check_main_grad(0, 64, 48, 3, dtype, device, backend, tol=tol, add=add, placeholder=add, layout=layout)


def test_reference_no_rows():
    check_no_rows("cpu", "reference", torch.float64, 1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_no_rows(backend, dtype, monkeypatch):
    skip_unless_runs(backend, dtype)
    check_no_rows("cuda", use_backend(backend, monkeypatch), dtype, 1e-2 if dtype == torch.bfloat16 else 1e-5)


def check_counts_past_rows(device, backend, dtype, tol):
    """Counts summing past R (no host check is possible without a sync) truncate the last groups,
    as slicing does in the reference; nothing past row R is read or written."""
    gen = torch.Generator().manual_seed(5)
    R, K, N, G = 300, 64, 80, 4
    counts = torch.tensor([120, 0, 150, 90], dtype=torch.int32)  # sums to 360 > R
    x = torch.randn(R, K, generator=gen).to(device, dtype).requires_grad_()
    w = torch.randn(G, K, N, generator=gen).to(device, dtype).requires_grad_()
    dy = torch.randn(R, N, generator=gen).to(device, dtype)
    y = grouped_mm(x, w, counts.to(device), backend=backend)
    y.backward(dy)
    kept = torch.tensor([120, 0, 150, 30], dtype=torch.int32)
    xr = x.detach().double().cpu().requires_grad_()
    wr = w.detach().double().cpu().requires_grad_()
    yr = per_group(xr, wr, kept)
    yr.backward(dy.double().cpu())
    assert rel_err(y, yr.detach()) < tol
    assert rel_err(x.grad, xr.grad) < tol
    assert rel_err(w.grad, wr.grad) < tol


def test_counts_past_rows_reference():
    check_counts_past_rows("cpu", "reference", torch.float64, 1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_counts_past_rows(backend, monkeypatch):
    skip_unless_runs(backend)
    check_counts_past_rows("cuda", use_backend(backend, monkeypatch), torch.bfloat16, 1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_new_counts(backend, monkeypatch):
    """Forward + backward captured once, replayed with new counts: no host sync, counts read on device."""
    if backend != "triton":
        skip_unless_runs(backend)
    backend = use_backend(backend, monkeypatch)
    R, K, N, G = 512, 128, 256, 6
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(R, K, generator=gen).cuda().bfloat16().requires_grad_()
    w = torch.randn(G, K, N, generator=gen).cuda().bfloat16().requires_grad_()
    dy = torch.randn(R, N, generator=gen).cuda().bfloat16()
    counts = random_counts(R, G, gen).cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (autotuning) outside the capture
        for _ in range(2):
            x.grad = w.grad = None
            grouped_mm(x, w, counts, backend=backend).backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = grouped_mm(x, w, counts, backend=backend)
        y.backward(dy)
    for zero_groups in [(1, 4), ()]:
        counts.copy_(random_counts(R, G, gen, zero_groups))
        graph.replay()
        ref = per_group(x.detach(), w.detach(), counts.cpu())
        assert rel_err(y, ref) < 1e-2
        xr = x.detach().double().cpu().requires_grad_()
        wr = w.detach().double().cpu().requires_grad_()
        per_group(xr, wr, counts.cpu()).backward(dy.double().cpu())
        assert rel_err(x.grad, xr.grad) < 1e-2 and rel_err(w.grad, wr.grad) < 1e-2


def check_grad_into_w(R, K, N, G, dtype, device, backend, zero_groups=(), tol=1e-12):
    """grad_into_w: three micro-batches; the first hands w its gradient through autograd, the next
    two add into that same .grad tensor inside the GEMM, equal to the sum autograd makes (its
    post-accumulate-grad hooks run every time); autograd.grad and backward(inputs=[x]) leave .grad
    alone; a hook on w itself, or create_graph, take autograd's way (the hook sees the gradient)."""
    gen = torch.Generator().manual_seed(R + 3 * K + N + G)
    counts = random_counts(R, G, gen, zero_groups).to(device)
    w = torch.randn(G, K, N, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    after = []
    w.register_post_accumulate_grad_hook(lambda p: after.append(p.grad.clone()))
    batches = [(torch.randn(R, K, generator=gen, dtype=torch.float64).to(device, dtype),
                torch.randn(R, N, generator=gen, dtype=torch.float64).to(device, dtype)) for _ in range(3)]
    for i, (x, dy) in enumerate(batches):
        grouped_mm(x, w, counts, backend=backend, grad_into_w=True).backward(dy)
        grouped_mm(x, w_ref, counts, backend=backend).backward(dy)
        if i == 0:
            first = w.grad
    assert w.grad is first  # added in place after the first
    assert rel_err(w.grad, w_ref.grad) < tol and len(after) == 3 and torch.equal(after[-1], w.grad)
    before = w.grad.clone()
    x, dy = batches[0]
    x = x.clone().requires_grad_()
    (gw,) = torch.autograd.grad(grouped_mm(x, w, counts, backend=backend, grad_into_w=True), [w], dy)
    (gw_ref,) = torch.autograd.grad(grouped_mm(x, w_ref, counts, backend=backend), [w_ref], dy)
    assert torch.equal(gw, gw_ref) and torch.equal(w.grad, before)
    grouped_mm(x, w, counts, backend=backend, grad_into_w=True).backward(dy, inputs=[x])
    assert torch.equal(w.grad, before)
    hooks = []
    handle = w.register_hook(lambda g: hooks.append(g is not None))
    grouped_mm(x, w, counts, backend=backend, grad_into_w=True).backward(dy)
    grouped_mm(x, w_ref, counts, backend=backend).backward(dy)
    handle.remove()
    assert hooks == [True] and w.grad is first and rel_err(w.grad, w_ref.grad) < tol
    grouped_mm(x, w, counts, backend=backend, grad_into_w=True).backward(dy, create_graph=True)
    grouped_mm(x, w_ref, counts, backend=backend).backward(dy)
    assert w.grad is not first and rel_err(w.grad.detach(), w_ref.grad) < tol
    w.grad = w_ref.grad = None  # create_graph's reference cycle


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_reference_grad_into_w():
    check_grad_into_w(41, 8, 12, 4, torch.float64, "cpu", "reference", zero_groups=(2,))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1000, 256, 384, 8, (3, 5)), (4099, 72, 48, 2, ())])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_grad_into_w(backend, dtype, shape, monkeypatch):
    """grad_into_w on every backend: the cutlass backend adds into a bf16 .grad in its own kernel."""
    R, K, N, G, zero_groups = shape
    skip_unless_runs(backend, dtype)
    check_grad_into_w(R, K, N, G, dtype, "cuda", use_backend(backend, monkeypatch), zero_groups,
                      2e-2 if dtype == torch.bfloat16 else 1e-5)
