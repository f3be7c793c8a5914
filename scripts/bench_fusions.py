"""The model's element-wise work outside the MoE, fused three ways, at small-1gpu's shapes:
eager PyTorch (turbomoe.models.qwen3_moe as written), torch.compile of the same code, and
liger-kernel's Triton ops. Forward + backward, bf16, CUDA-event medians (scripts/timing.py).

    python scripts/bench_fusions.py [--batch 32 --seq 1024]

Ops: RMSNorm over the hidden size; the attention input path (q/k/v projections, per-head q/k
RMSNorm, rotary; GEMMs included, as they are the same in every variant); the dense SwiGLU's
activation; the loss (lm_head + cross entropy). Prints a table of ms and ratios to eager.

Then the attention core (causal, grouped-query: 12 query heads on 4 key/value heads) by how the
heads are matched (k and v repeated to 12 heads, or SDPA's enable_gqa) and by backend, each with
whether two backwards give the same bits.

Then the optimizer step over fp32 master weights of small-1gpu's size (--opt-numel): torch's fused
AdamW (clipping as its grad_scale), the bf16 copy of the weights and the gradient zeroed, as
DeepSpeed's BF16_Optimizer takes them, against turbomoe.kernels.adamw's one pass; ms and the bytes
each moves over its time.
"""
import argparse
import contextlib
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "recipes"))
from recipe_config import load_config  # noqa: E402
from scripts.timing import cuda_time_ms, require_gpu  # noqa: E402
from turbomoe.models.qwen3_moe import RMSNorm, apply_rotary, rotary_cos_sin  # noqa: E402


def fwd_bwd(fn, *inputs):
    """fn(*inputs) forward and backward with a fixed upstream gradient."""
    out = fn(*inputs)
    grad = torch.ones_like(out) if out.ndim else None
    def run():
        for x in inputs:
            x.grad = None
        fn(*inputs).backward(grad)
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--opt-numel", type=int, default=None, help="default: small-1gpu's parameter count")
    p.add_argument("--only", choices=("ops", "attention", "optimizer"), help="one section only")
    a = p.parse_args()
    require_gpu("bench_fusions.py")
    if a.opt_numel is None:  # what small-1gpu's optimizer steps over
        a.opt_numel = load_config(os.path.join(ROOT, "recipes", "configs", "small-1gpu.yaml")).model.num_parameters()
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    B, T, H, N, G, D, F_, V = a.batch, a.seq, 768, 12, 4, 64, 2048, 320
    S = B * T
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        liger = True
    except ImportError as e:
        print(f"liger-kernel not importable ({e}): its column stays empty")
        liger = False

    def param(*shape, scale=0.02):
        return (torch.randn(*shape, device=dev) * scale).to(bf16).requires_grad_()

    norm = RMSNorm(H, 1e-6).to(dev, bf16)
    qn, kn = RMSNorm(D, 1e-6).to(dev, bf16), RMSNorm(D, 1e-6).to(dev, bf16)
    wq, wk, wv = param(N * D, H), param(G * D, H), param(G * D, H)
    cos, sin = rotary_cos_sin(T, D, 10000.0, dev)
    w_head = param(V, H)
    labels = torch.randint(0, V, (S,), device=dev)

    def qkv_eager(x, rope=apply_rotary, qnorm=qn, knorm=kn):
        q = qnorm(F.linear(x, wq).view(B, T, N, D)).transpose(1, 2)
        k = knorm(F.linear(x, wk).view(B, T, G, D)).transpose(1, 2)
        v = F.linear(x, wv).view(B, T, G, D).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        return q.sum() + k.sum() + v.sum()

    def qkv_liger(x):
        q = LigerRMSNormFunction.apply(F.linear(x, wq).view(B, T, N, D), qn.weight, 1e-6, 0.0, "llama", False)
        k = LigerRMSNormFunction.apply(F.linear(x, wk).view(B, T, G, D), kn.weight, 1e-6, 0.0, "llama", False)
        v = F.linear(x, wv).view(B, T, G, D).transpose(1, 2)
        q, k = liger_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos[None].to(bf16), sin[None].to(bf16))
        return q.sum() + k.sum() + v.sum()

    def swiglu_eager(g, u):
        return F.silu(g) * u

    def loss_eager(h):
        return F.cross_entropy(F.linear(h, w_head).float(), labels)

    flce = LigerFusedLinearCrossEntropyLoss() if liger else None
    cases = [
        ("RMSNorm [S, 768]", norm, (lambda x: LigerRMSNormFunction.apply(x, norm.weight, 1e-6, 0.0, "llama", False)),
         lambda: (param(S, H, scale=1.0),)),
        ("q/k/v proj + q/k RMSNorm + rotary", qkv_eager, qkv_liger, lambda: (param(B, T, H, scale=1.0),)),
        ("SwiGLU act [S, 2048]", swiglu_eager, (lambda g, u: LigerSiLUMulFunction.apply(g, u)),
         lambda: (param(S, F_, scale=1.0), param(S, F_, scale=1.0))),
        ("lm_head + cross entropy (V 320)", loss_eager, (lambda h: flce(w_head, h, labels)),
         lambda: (param(S, H, scale=1.0),)),
    ]
    if a.only == "optimizer":
        return optimizer_step(a.opt_numel)
    if a.only == "attention":
        return attention_core(B, T, N, G, D)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, B {B} T {T}: fwd+bwd ms (ratio to eager)")
    print(f"| op | eager | torch.compile | liger-kernel |\n|---|---|---|---|")
    for name, eager, lig, make in cases:
        inputs = make()
        row = []
        for fn in (eager, torch.compile(eager), lig if liger else None):
            if fn is None:
                row.append(None)
                continue
            try:
                row.append(cuda_time_ms(fwd_bwd(fn, *inputs), warmup=5, iters=30))
            except Exception as e:  # noqa: BLE001 (a variant that fails is reported, the others still run)
                print(f"  {name}: {type(e).__name__}: {str(e)[:200]}")
                row.append(None)
        cells = [f"{t:.3f} ({t / row[0]:.2f}x)" if t is not None else "-" for t in row]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if a.only is None:
        attention_core(B, T, N, G, D)
        optimizer_step(a.opt_numel)


def optimizer_step(n: int):
    """AdamW over n fp32 weights with the bf16 copy and the gradient cleared: torch's fused AdamW +
    copy_ + zero_ (DeepSpeed's BF16_Optimizer) against the one-pass kernel, same state and inputs."""
    from turbomoe.kernels.adamw import adamw_step
    p = torch.randn(n, device="cuda")
    g, lp = torch.randn_like(p), p.to(torch.bfloat16)
    scale, found_inf, step = (torch.tensor(v, device="cuda") for v in (1.5, 0.0, 10.0))
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, fused=True)
    opt.grad_scale, opt.found_inf = scale, found_inf
    p.grad = g
    opt.step()  # the state made once; the timed steps never clear g for real (refilled below)
    m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]

    def torch_step():
        opt.step()
        lp.copy_(p)
        g.zero_()

    def one_pass():
        adamw_step(p, g, m, v, step, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                   grad_scale=scale, found_inf=found_inf, param_lp=lp, zero_grad=True)

    print(f"\noptimizer step, {n:,} fp32 weights (AdamW, clip as grad_scale, bf16 copy, gradient cleared): ms, GB/s")
    print("| way | ms | bytes / element | GB/s |\n|---|---|---|---|")
    for name, fn, bytes_per in (("torch fused AdamW + copy_ + zero_", torch_step, 32 + 6 + 4),
                                ("turbomoe one pass", one_pass, 16 + 12 + 2 + 4)):
        ms = cuda_time_ms(fn, warmup=5, iters=30)
        print(f"| {name} | {ms:.3f} | {bytes_per} | {bytes_per * n / ms / 1e6:.0f} |")


def attention_core(B, T, N, G, D):
    """Causal GQA attention fwd+bwd by head matching and backend: ms, ratio to the first row, and
    whether the gradients of two identical backwards are bitwise equal."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(B, N, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, G, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, G, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(B, N, T, D, device="cuda", dtype=torch.bfloat16)

    def repeated(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(N // G, 1), v.repeat_interleave(N // G, 1),
                                              is_causal=True)

    def native(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    print(f"\nattention core, B {B} N {N} G {G} T {T} D {D}, causal, fwd+bwd ms (ratio to the first row), "
          f"backward bitwise repeatable")
    print("| heads | backend | ms | repeatable |\n|---|---|---|---|")
    first = None
    for heads, fn in (("repeat_interleave", repeated), ("enable_gqa", native)):
        for backend in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            label = "default" if backend is None else backend.name
            def step():
                q.grad = k.grad = v.grad = None
                fn(q, k, v).backward(grad)
            try:
                with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                    step()
                    grads = [t.grad.clone() for t in (q, k, v)]
                    step()
                    same = all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))
                    ms = cuda_time_ms(step, warmup=5, iters=30)
            except Exception as e:  # noqa: BLE001 (a backend that refuses these inputs is reported)
                print(f"| {heads} | {label} | {type(e).__name__}: {str(e)[:120]} | |")
                continue
            first = first or ms
            print(f"| {heads} | {label} | {ms:.3f} ({ms / first:.2f}x) | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
