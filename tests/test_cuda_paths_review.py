"""A review of where turbomoe's code takes another path on CUDA tensors than on CPU tensors (2026-12-06,
after the GPU run in which the reference layer's SwiGLU still ran its Triton kernel on CUDA).

Two gaps, each with GPU tests (marked `gpu`, skipped on the CPU with a reason) that compare the CUDA
result with the CPU's on the same numbers (made on the CPU by a seeded generator and moved), and a
CPU test of the path choice itself. Both gaps were fixed on the day (the GPU tests had not yet run):

1. The weight gradient that is added into a buffer (grouped_mm's grad_into_w: MoELayer's and the
   DeepSpeed drop-in's fused_grad_accumulation; main_grad: Megatron's gradient-accumulation fusion)
   runs the Triton kernel on every CUDA tensor of a micro-batch of few rows, whatever the grouped GEMM
   backend, the reference's included (turbomoe/autograd/grouped_gemm.py, mm_wgrad:
   `backend == "triton" or (x_RK.is_cuda and few_rows)`; on the CPU the reference loop runs). float64
   takes the reference backend by default (README: "float64 runs a loop of torch.mm per expert"), and
   the Triton weight-gradient kernel does not compile for it (its fp32 accumulator is loop-carried
   while tl.dot of fp64 operands returns fp64: "Loop-carried variable acc has initial type fp32 but is
   re-assigned to fp64", reproduced here by compiling the kernel for sm_90 without a GPU). So an fp64
   MoELayer with fused_grad_accumulation=True fails on a GPU at its second micro-batch, and works on
   the CPU; gmm_backend="reference" (or TURBOMOE_GMM_BACKEND=reference) runs Triton there too.
2. README: "Force one with `backend=` or `TURBOMOE_BACKEND=...`" and "`gmm_backend=...` or
   `TURBOMOE_GMM_BACKEND`"; "`MoELayer(backend="reference", gmm_backend="reference")` differentiates
   twice, on a GPU too". The layer decides the PyTorch SwiGLU / biases by its gmm_backend attribute
   (turbomoe/nn/experts.py GroupedExperts._kernels: `self.gmm_backend != "reference"`) and the plain
   fp32 router logits by its backend attribute (turbomoe/nn/router.py: `self.backend == "reference"`),
   so with the environment variables instead of the arguments the SwiGLU / bias kernels and the split
   router (bf16 tokens, router_dtype fp32) still run on CUDA and a double backward raises there, while
   on the CPU (no kernels) it works. Its GPU test is test_nn_layer.py's
   test_reference_layer_differentiates_twice[...-environment].
3. SparseMoE(backend="reference") (or TURBOMOE_BACKEND=reference) in auto mode picked the reference
   mode on CPU tensors only: on CUDA its few_rows / grouped modes ran the Triton kernels (the grouped
   mode's row kernels came from ops._impl("reference"), which is the Triton module).
"""
import copy

import pytest
import torch

from conftest import needs_cuda
from turbomoe.autograd.grouped_gemm import grouped_mm, mm_wgrad
from turbomoe.nn import MoELayer

F64 = torch.float64


# --- 1. the fused weight gradient: the reference backend's buffer adds run Triton on CUDA -------------------------

def _accumulated_wgrad(device, dtype, backend, mode):
    """Two micro-batches of grouped_mm whose weight gradient goes into a buffer: w's own .grad
    (grad_into_w: the first micro-batch through autograd, the second added inside the GEMM) or an fp32
    main_grad (Megatron's: both added inside). Groups [5, 0, 7] of 14 rows (two past the counts). The
    numbers come from a CPU generator, the same on every device."""
    gen = torch.Generator().manual_seed(11)
    G, K, N, R = 3, 8, 12, 14
    counts = torch.tensor([5, 0, 7], dtype=torch.int32, device=device)
    w = torch.randn(G, K, N, generator=gen, dtype=F64).to(device, dtype).requires_grad_()
    main = torch.randn(G, K, N, generator=gen, dtype=F64).to(device, torch.float32) if mode == "main_grad" else None
    for _ in range(2):
        x = torch.randn(R, K, generator=gen, dtype=F64).to(device, dtype)
        dy = torch.randn(R, N, generator=gen, dtype=F64).to(device, dtype)
        if mode == "main_grad":
            y = grouped_mm(x, w, counts, backend, main_grad_GKN=main, main_grad_placeholder=False)
        else:
            y = grouped_mm(x, w, counts, backend, grad_into_w=True)
        y.backward(dy)
    return (main if mode == "main_grad" else w.grad).cpu()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["grad_into_w", "main_grad"])
@pytest.mark.parametrize("dtype,backend", [(F64, None), (torch.float32, "reference")])
def test_gpu_reference_gmm_adds_into_buffers_as_on_the_cpu(dtype, backend, mode, monkeypatch):
    """The reference grouped GEMM (fp64's default; or asked for) adds its weight gradient into .grad or
    a main_grad on CUDA as on the CPU: with the reference's loop, not Triton's kernel (which does not
    compile for fp64), and to the CPU's numbers."""
    want = _accumulated_wgrad("cpu", dtype, backend, mode)
    from turbomoe.kernels import grouped_gemm as triton_gmm

    def refuse(*args, **kwargs):
        raise AssertionError(f"Triton's weight-gradient kernel ran for the reference grouped GEMM ({dtype})")
    monkeypatch.setattr(triton_gmm, "grouped_mm_wgrad", refuse)
    got = _accumulated_wgrad("cuda", dtype, backend, mode)
    tol = 1e-12 if got.dtype == F64 else 1e-5  # an fp32 buffer (main_grad, fp32 w): other summation orders
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kw", [dict(), dict(activation="gelu", bias=True, shared_ffn_hidden_size=8)])
def test_gpu_fp64_fused_grad_accumulation_matches_cpu(kw):
    """MoELayer in float64 with fused_grad_accumulation=True over three micro-batches: on the GPU the
    parameters' gradients are the CPU's (fp64 throughout). The second micro-batch is the first to add
    into .grad inside the weight-gradient GEMM, where the fp64 reference GEMM handed the add to Triton's
    kernel on CUDA (a CompilationError, expected while gap 1 is open)."""
    torch.manual_seed(7)
    cpu = MoELayer(16, 12, 4, 2, fused_grad_accumulation=True, dtype=F64, **kw)
    gpu = copy.deepcopy(cpu).cuda()
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        x = torch.randn(2, 9, 16, generator=gen, dtype=F64)
        gy = torch.randn(2, 9, 16, generator=gen, dtype=F64)
        for layer, device in ((cpu, "cpu"), (gpu, "cuda")):
            out, aux = layer(x.to(device))
            ((out * gy.to(device)).sum() + aux).backward()
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-9, atol=1e-12, msg=name)


class _FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the device test of mm_wgrad's path choice, run on the CPU."""

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_reference_mm_wgrad_into_buffer_takes_no_triton_on_cuda(monkeypatch):
    """mm_wgrad(..., backend="reference", out=buf) on a tensor that reports CUDA (the real mm_wgrad, a fake
    device flag): the reference's loop adds into buf, Triton's kernel is not called."""
    from turbomoe.kernels import grouped_gemm as triton_gmm
    called = []
    monkeypatch.setattr(triton_gmm, "grouped_mm_wgrad", lambda *args, **kwargs: called.append(args[3].shape))
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 0, 7], dtype=torch.int32)
    x, dy = torch.randn(14, 8, generator=gen, dtype=F64), torch.randn(14, 12, generator=gen, dtype=F64)
    buf = torch.randn(3, 8, 12, generator=gen, dtype=F64)
    want = buf.clone()
    for g, (a, b) in enumerate(((0, 5), (5, 5), (5, 12))):
        want[g] += x[a:b].t() @ dy[a:b]
    mm_wgrad(x.as_subclass(_FakeCuda), dy, counts, "reference", out=buf)
    assert not called, "Triton's weight-gradient kernel ran for the reference backend on a CUDA tensor"
    torch.testing.assert_close(buf, want, rtol=1e-12, atol=1e-12)


# --- 2. the environment's reference backends: the layer's second derivative on CUDA ---------------------------------

def _reference_env(monkeypatch):
    monkeypatch.setenv("TURBOMOE_BACKEND", "reference")
    monkeypatch.setenv("TURBOMOE_GMM_BACKEND", "reference")


@pytest.mark.parametrize("kw", [dict(bias=True), dict(activation="gelu", bias=True)])
def test_reference_env_runs_the_pytorch_activation_and_biases(kw, monkeypatch):
    """With TURBOMOE_GMM_BACKEND=reference (the gmm_backend argument left None) the experts call SwiGLU
    and bias_act with kernels=False, as with gmm_backend="reference": on CUDA tensors kernels=True would
    run the once-differentiable Triton kernels (on the CPU tensors here the flag changes nothing else)."""
    _reference_env(monkeypatch)
    from turbomoe.nn import experts
    flags, real_swiglu, real_bias_act = [], experts.swiglu, experts.bias_act

    def swiglu(h, scale=None, kernels=True):
        flags.append(("swiglu", kernels))
        return real_swiglu(h, scale, kernels)

    def bias_act(*args, kernels=True, **kwargs):
        flags.append(("bias_act", kernels))
        return real_bias_act(*args, kernels=kernels, **kwargs)
    monkeypatch.setattr(experts, "swiglu", swiglu)
    monkeypatch.setattr(experts, "bias_act", bias_act)
    torch.manual_seed(0)
    MoELayer(16, 12, 4, 2, **kw)(torch.randn(5, 16))
    assert flags and not any(kernels for _, kernels in flags), flags


# --- 3. SparseMoE(backend="reference") on CUDA: auto mode took the Triton paths ------------------------------------

def _sparse_moe(device, dtype, **kw):
    from turbomoe.inference import SparseMoE
    gen = torch.Generator().manual_seed(5)
    E, M, F = 6, 16, 8
    w = [torch.randn(*shape, generator=gen, dtype=F64) * 0.3 for shape in ((E, M), (E, M, 2 * F), (E, F, M))]
    return SparseMoE(*(t.to(device, dtype) for t in w), k=2, renormalize=True, **kw)


@pytest.mark.parametrize("via", ["argument", "environment"])
def test_sparse_moe_forced_reference_takes_the_reference_mode_on_cuda(via, monkeypatch):
    """auto mode with the reference backend forced picks the reference mode on a tensor that reports
    CUDA (the real choose_mode, a fake device flag), not few_rows / grouped (Triton)."""
    if via == "environment":
        monkeypatch.setenv("TURBOMOE_BACKEND", "reference")
    moe = _sparse_moe("cpu", F64, **({} if via == "environment" else dict(backend="reference")))
    for T in (1, 3, 40):
        assert moe.choose_mode(torch.zeros(T, 16, dtype=F64).as_subclass(_FakeCuda)) == "reference"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("T", [1, 5, 64])
def test_gpu_sparse_moe_forced_reference_matches_the_cpu(T):
    """SparseMoE(backend="reference") on CUDA runs the plain-PyTorch path: the CPU's numbers in fp64."""
    x = torch.randn(T, 16, generator=torch.Generator().manual_seed(T), dtype=F64)
    want = _sparse_moe("cpu", F64, backend="reference")(x)
    got = _sparse_moe("cuda", F64, backend="reference")(x.cuda())
    torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-12)
