"""Benchmark turbomoe's MoELayer against the dense floor and peer MoE layers (bf16, forward + backward).

    python scripts/bench_layer.py [--configs 0,1,2,3,4,5,6] [--iters 20] [--impls ...] [--out DIR]
    python scripts/bench_layer.py --configs 5,6 --impls "dense floor,turbomoe,turbomoe recompute,scattermoe"
        (issue #19's activation-memory comparison at the fine-grained shapes)

Every implementation runs the same step: forward of x [S, M], backward of a random grad_out
(+ the aux loss where there is one), parameter grads reset to None between steps (with --accumulate
kept, so that they accumulate as over micro-batches; "turbomoe fused-accum" then adds the experts'
inside their weight-gradient GEMMs). Times are
CUDA-event medians after warm-up, rotating over three input sets, queued (the table) and synced
(scripts/timing.py says how). Peak memory is the peak of allocated memory during one step minus
what was allocated before it (parameters, inputs); the step makes the parameters' gradients (reset
to None before it), so "activation" memory is also given: that peak less the gradients' bytes. "Held"
is what the forward keeps for backward (allocated after the forward, its outputs not counted): the
activation memory a layer costs in a model of many layers.
Peers: DeepSpeed's MoE with SwiGLU experts (drop_tokens, capacity factor 1), a plain-PyTorch
layer on torch._grouped_mm, ScatterMoE's GLUMLP (import path: its source under .peers/, never
committed), MegaBlocks' dMoE where installed. The dense floor is a SwiGLU FFN over S*k tokens:
the same GEMM FLOPs, no routing.
With --accumulate the parameters' gradients are allocated before the measured step too, so its peak
is what a micro-batch after the first adds (a weight gradient made apart and then added counts;
one added inside its GEMM does not).
Prints a table (ms, ratio to the dense floor, peak GiB) and writes bench_layer.json and
bench_layer.png to --out.
"""
import argparse
import itertools
import json
import os
import sys
import traceback

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, ".peers"))

from timing import profile_step, require_gpu, reset_grads, step_times_ms, synced_time_ms  # noqa: E402
from turbomoe.autograd.grouped_gemm import mm_forward, mm_wgrad  # noqa: E402
from turbomoe.nn import GroupedExperts, MoELayer  # noqa: E402

CONFIGS = [  # (S, M, F, E, k)
    (8192, 2048, 5632, 8, 1),
    (8192, 2048, 5632, 8, 2),
    (8192, 2048, 5632, 32, 2),
    (8192, 2048, 5632, 64, 2),
    (16384, 4096, 1408, 64, 4),
    (8192, 2048, 768, 128, 8),  # Qwen3-30B-A3B's layer (fine-grained)
    (8192, 2048, 1408, 64, 6),  # DeepSeek-V2-Lite's routed experts
]
DTYPE = torch.bfloat16
DEV = "cuda"


def init_(t, fan_in):
    return nn.init.uniform_(t, -fan_in ** -0.5, fan_in ** -0.5)


class DenseSwiGLU(nn.Module):
    """The floor: one SwiGLU FFN over S*k tokens."""

    def __init__(self, M, F_):
        super().__init__()
        self.w1 = nn.Parameter(init_(torch.empty(M, 2 * F_), M))
        self.w2 = nn.Parameter(init_(torch.empty(F_, M), F_))

    def forward(self, x):
        g, u = (x @ self.w1).chunk(2, -1)
        return (F.silu(g) * u) @ self.w2


class PlainTorchMoE(nn.Module):
    """softmax, top-k, stable argsort, bincount, index_select, torch._grouped_mm, index_add."""

    def __init__(self, M, F_, E, k):
        super().__init__()
        self.E, self.k = E, k
        self.wr = nn.Parameter(torch.randn(E, M) * M ** -0.5)
        self.w1 = nn.Parameter(init_(torch.empty(E, M, 2 * F_), M))
        self.w2 = nn.Parameter(init_(torch.empty(E, F_, M), F_))

    def forward(self, x):
        probs = torch.softmax(F.linear(x.float(), self.wr.float()), -1)
        scores, ids = torch.topk(probs, self.k, -1)
        flat = ids.view(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=self.E), 0).to(torch.int32)
        tok = order // self.k
        h = torch._grouped_mm(x.index_select(0, tok), self.w1, offs=offs)
        g, u = h.chunk(2, -1)
        y = torch._grouped_mm(F.silu(g) * u, self.w2, offs=offs)
        y = y * scores.view(-1)[order, None].to(y.dtype)
        out = torch.zeros_like(x).index_add(0, tok, y)
        ce = torch.bincount(ids[:, 0], minlength=self.E).float() / x.shape[0]
        return out, self.E * (probs.mean(0) * ce).sum()


class ScatterMoEBlock(nn.Module):
    """ScatterMoE's GLUMLP behind the same softmax top-k router."""

    def __init__(self, M, F_, E, k):
        super().__init__()
        from scattermoe.mlp import GLUMLP
        self.k = k
        self.wr = nn.Parameter(torch.randn(E, M) * M ** -0.5)
        self.mlp = GLUMLP(M, F_, E, k)

    def forward(self, x):
        probs = torch.softmax(F.linear(x.float(), self.wr.float()), -1)
        scores, ids = torch.topk(probs, self.k, -1)
        return self.mlp(x, scores.to(x.dtype), ids)


class SwiGLUExpertModule(nn.Module):
    def __init__(self, M, F_):
        super().__init__()
        self.w1 = nn.Linear(M, 2 * F_, bias=False)
        self.w2 = nn.Linear(F_, M, bias=False)

    def forward(self, x):
        g, u = self.w1(x).chunk(2, -1)
        return self.w2(F.silu(g) * u)


def deepspeed_moe(M, F_, E, k):
    import deepspeed
    from deepspeed.moe.layer import MoE
    for key, val in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT="29533").items():
        os.environ.setdefault(key, val)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    moe = MoE(hidden_size=M, expert=SwiGLUExpertModule(M, F_), num_experts=E, ep_size=1, k=k)
    moe.set_deepspeed_parallelism()
    return moe


def megablocks_dmoe(M, F_, E, k):
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import dMoE
    args = Arguments(hidden_size=M, ffn_hidden_size=F_, moe_num_experts=E, moe_top_k=k, mlp_type="glu",
                     mlp_impl="grouped", bf16=True, fp16=False, device=torch.cuda.current_device())
    return dMoE(args)


def build(name, cfg):
    S, M, F_, E, k = cfg
    if name == "dense floor":
        return DenseSwiGLU(M, F_), S * k
    if name.startswith("turbomoe"):
        # variants: "turbomoe triton-gmm", "turbomoe torch-gmm", "turbomoe fp32-router", "turbomoe recompute",
        # "turbomoe weighted-gather" (and "turbomoe recompute weighted-gather"), "turbomoe fused-accum"
        gmm = next((b for b in ("triton", "torch") if f"{b}-gmm" in name), None)
        layer = MoELayer(M, F_, E, k, gmm_backend=gmm, recompute="recompute" in name,
                         fused_grad_accumulation="fused-accum" in name)
        if "fp32-router" in name:
            layer.router.router_dtype = torch.float32
        if "weighted-gather" in name:  # the scores in the gather, y kept for their gradient (before 2026-11-24)
            layer.experts.__class__ = type("WeightedGatherExperts", (GroupedExperts, ), {"scales_rows": False})
        return layer, S
    if name == "plain torch":
        return PlainTorchMoE(M, F_, E, k), S
    if name == "scattermoe":
        return ScatterMoEBlock(M, F_, E, k), S
    if name == "deepspeed":
        return deepspeed_moe(M, F_, E, k), S
    if name == "megablocks":
        return megablocks_dmoe(M, F_, E, k), S
    raise ValueError(name)


def layer_forward(mod, x):
    """(out, aux loss or None) of mod(x)."""
    out = mod(x)
    return (out[0], out[1]) if isinstance(out, tuple) else (out, None)


def layer_backward(out, aux, gy):
    """Backward from out (gradient gy) and the aux loss (gradient 1) where it has one."""
    tensors, grads = [out], [gy]
    if isinstance(aux, torch.Tensor) and aux.requires_grad:
        tensors.append(aux)
        grads.append(torch.ones_like(aux))
    torch.autograd.backward(tensors, grads)


def run_step(mod, x, gy):
    layer_backward(*layer_forward(mod, x), gy)


def train_step(mod, x, gy, accumulate=False):
    """One training step of mod on input x (requires grad) and output gradient gy, grads reset first
    (with accumulate, x's only: the parameters' gradients accumulate, as over micro-batches)."""
    tensors = [x] if accumulate else list(mod.parameters()) + [x]

    def step():
        reset_grads(tensors)
        run_step(mod, x, gy)
    return step


def time_impl(name, cfg, iters, warmup=3, accumulate=False):
    mod, rows = build(name, cfg)
    mod = mod.to(DEV, DTYPE).train()
    M = cfg[1]
    sets = [(torch.randn(rows, M, device=DEV, dtype=DTYPE).requires_grad_(),
             torch.randn(rows, M, device=DEV, dtype=DTYPE)) for _ in range(3)]

    steps, counter = [train_step(mod, x, gy, accumulate) for x, gy in sets], itertools.count()

    def step():
        steps[next(counter) % len(steps)]()

    queued, synced = step_times_ms(step, warmup, iters)
    x, gy = sets[0]
    if not accumulate:  # accumulating, the parameters' gradients stay allocated (a micro-batch after the first)
        reset_grads(mod.parameters())  # x.grad stays allocated from the timed steps, as the inputs are
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, aux = layer_forward(mod, x)
    torch.cuda.synchronize()
    # What the forward keeps for backward (its outputs not counted): the layer's activation memory.
    held = (torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
            - (aux.numel() * aux.element_size() if isinstance(aux, torch.Tensor) else 0)) / 2 ** 30
    layer_backward(out, aux, gy)
    del out, aux
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    grads = 0 if accumulate else sum(p.numel() * p.element_size() for p in mod.parameters()
                                     if p.requires_grad) / 2 ** 30
    del mod, sets, steps, step
    torch.cuda.empty_cache()
    return queued, synced, peak, peak - grads, held


def profile_layer(name, cfg, steps=3):
    """Top kernels of one forward + backward (us per step), and the step replayed as a CUDA graph."""
    mod, rows = build(name, cfg)
    mod = mod.to(DEV, DTYPE).train()
    x = torch.randn(rows, cfg[1], device=DEV, dtype=DTYPE, requires_grad=True)
    gy = torch.randn_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run_step(mod, x, gy)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    profile_step(train_step(mod, x, gy), f"{cfg} {name}", steps)
    reset_grads(list(mod.parameters()) + [x])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_step(mod, x, gy)
    print(f"{cfg} {name}: CUDA-graph replay {synced_time_ms(graph.replay, 20):.2f} ms (synced median of 20)")
    del graph, mod


def balanced_counts(R, E, gen):
    """Counts of a random softmax-top-k routing: near uniform with noise, sum R."""
    w = 1.0 + 0.2 * torch.rand(E, generator=gen)
    c = (w / w.sum() * R).floor().to(torch.int32)
    c[0] += R - int(c.sum())
    return c.to(DEV)


def bench_gemms(cfg, iters):
    """The layer's three GEMMs (forward, input grad, weight grad) of both expert matrices, per backend."""
    import triton.testing
    from turbomoe.kernels.grouped_gemm import grouped_mm_wgrad as triton_wgrad
    S, M, F_, E, k = cfg
    R = S * k
    counts = balanced_counts(R, E, torch.Generator().manual_seed(0))
    x = torch.randn(R, M, device=DEV, dtype=DTYPE)
    a = torch.randn(R, F_, device=DEV, dtype=DTYPE)
    dh = torch.randn(R, 2 * F_, device=DEV, dtype=DTYPE)
    dy = torch.randn(R, M, device=DEV, dtype=DTYPE)
    w1 = torch.randn(E, M, 2 * F_, device=DEV, dtype=DTYPE)
    w2 = torch.randn(E, F_, M, device=DEV, dtype=DTYPE)
    flops = 2 * R * M * 3 * F_  # one pass over both matrices
    res = {}
    for backend in ("cutlass", "torch", "triton"):
        try:
            t_fwd = triton.testing.do_bench(lambda: (mm_forward(x, w1, counts, backend),
                                                     mm_forward(a, w2, counts, backend)), return_mode="median")
            t_dx = triton.testing.do_bench(lambda: (mm_forward(dh, w1.transpose(1, 2), counts, backend),
                                                    mm_forward(dy, w2.transpose(1, 2), counts, backend)),
                                           return_mode="median")
            t_dw = triton.testing.do_bench(lambda: (mm_wgrad(x, dh, counts, backend),
                                                    mm_wgrad(a, dy, counts, backend)), return_mode="median")
            res[backend] = dict(fwd=t_fwd, dx=t_dx, dw=t_dw, tflops=[flops / t / 1e9 for t in (t_fwd, t_dx, t_dw)])
        except Exception as e:  # noqa: BLE001 -- reported, the other backend still runs
            res[backend] = dict(error=f"{type(e).__name__}: {e}"[:300])
    dense = triton.testing.do_bench(lambda: (x @ w1[0], a @ w2[0]), return_mode="median")
    res["dense"] = dict(fwd=dense, tflops=flops / dense / 1e9)
    # Gradient accumulation into fp32 main_grad buffers (Megatron's DDP): the fastest bf16 weight
    # gradient then DDP's hook add, against the add inside the Triton weight-gradient GEMM.
    best = next(b for b in ("cutlass", "torch", "triton") if "dw" in res[b])
    m1 = torch.zeros(E, M, 2 * F_, device=DEV, dtype=torch.float32)
    m2 = torch.zeros(E, F_, M, device=DEV, dtype=torch.float32)
    unfused = triton.testing.do_bench(lambda: (m1.add_(mm_wgrad(x, dh, counts, best)),
                                               m2.add_(mm_wgrad(a, dy, counts, best))), return_mode="median")
    fused = triton.testing.do_bench(lambda: (triton_wgrad(x, dh, counts, m1), triton_wgrad(a, dy, counts, m2)),
                                    return_mode="median")
    chosen = triton.testing.do_bench(lambda: (mm_wgrad(x, dh, counts, best, out=m1),
                                              mm_wgrad(a, dy, counts, best, out=m2)), return_mode="median")
    res["accumulate"] = dict(backend=best, unfused=unfused, fused=fused, chosen=chosen, rows_per_group=R / E,
                             main_grad_rw_gb=8 * (m1.numel() + m2.numel()) / 1e9)
    return res


def plot(results, path, device_name):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in results[0]["impls"]]
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        vals = [r["impls"].get(n, {}).get("ms", 0) or 0 for r in results]
        ax.bar([i + j * width for i in range(len(results))], vals, width, label=n)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))])
    ax.set_xticklabels(["S=%d M=%d F=%d\nE=%d k=%d" % tuple(r["cfg"]) for r in results], fontsize=8)
    ax.set_ylabel("ms, forward + backward (median)")
    ax.set_title(f"MoE layer, bf16, {device_name}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default=",".join(str(i) for i in range(len(CONFIGS))))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--impls", default="dense floor,turbomoe,turbomoe triton-gmm,plain torch,deepspeed,scattermoe,megablocks")
    ap.add_argument("--gemms", action="store_true", help="also time the grouped GEMM backends alone, and the weight "
                    "gradient accumulated into fp32 main_grad buffers (fused in the GEMM, or an add after it)")
    ap.add_argument("--profile", default="", help="comma-separated impls to profile (kernels, CUDA graph)")
    ap.add_argument("--out", default=".")
    ap.add_argument("--accumulate", action="store_true", help="parameter gradients kept between steps (accumulating, "
                    "as over micro-batches), not reset to None")
    args = ap.parse_args()
    require_gpu("bench_layer.py")
    torch.manual_seed(0)
    impls = args.impls.split(",")
    os.makedirs(args.out, exist_ok=True)
    results = []

    def save():  # after every config: a run cut short keeps what it measured
        with open(os.path.join(args.out, "bench_layer.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, accumulate=args.accumulate,
                           results=results), f, indent=1)
    for ci in [int(c) for c in args.configs.split(",")]:
        cfg = CONFIGS[ci]
        row = dict(cfg=cfg, impls={})
        for name in impls:
            try:
                ms, synced, peak, act, held = time_impl(name, cfg, args.iters, accumulate=args.accumulate)
                row["impls"][name] = dict(ms=ms, synced_ms=synced, peak_gib=peak, activation_gib=act, held_gib=held)
            except Exception as e:  # noqa: BLE001 -- a peer that cannot run is reported, not fatal
                row["impls"][name] = dict(error=f"{type(e).__name__}: {e}"[:300])
                traceback.print_exc(limit=2)
                torch.cuda.empty_cache()
            print(cfg, name, row["impls"][name], flush=True)
        for name in filter(None, args.profile.split(",")):
            try:
                profile_layer(name, cfg)
            except Exception as e:  # noqa: BLE001
                print(cfg, name, "profile failed:", type(e).__name__, str(e)[:200])
        if args.gemms:
            row["gemms"] = bench_gemms(cfg, args.iters)
            print(cfg, "gemms", row["gemms"], flush=True)
        results.append(row)
        save()
    try:
        plot(results, os.path.join(args.out, "bench_layer.png"), torch.cuda.get_device_name())
    except Exception as e:  # noqa: BLE001
        print("plot failed:", e)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, fwd+bwd, ms (x dense floor) "
          "[peak GiB / GiB held from forward to backward]")
    print("config (S,M,F,E,k)".ljust(30) + "".join(n[:22].rjust(24) for n in impls))
    for r in results:
        floor = r["impls"].get("dense floor", {}).get("ms")
        cells = []
        for n in impls:
            v = r["impls"][n]
            if "ms" not in v:
                cells.append("n/a".rjust(24))
            else:
                ratio = f" x{v['ms'] / floor:.2f}" if floor else ""
                cells.append(f"{v['ms']:.2f}{ratio} [{v['peak_gib']:.2f}/{v['held_gib']:.2f}]".rjust(24))
        print(str(tuple(r["cfg"])).ljust(30) + "".join(cells))
    print("\nsynced (each step from an idle GPU), ms (x dense floor synced)")
    for r in results:
        floor = r["impls"].get("dense floor", {}).get("synced_ms")
        print(str(tuple(r["cfg"])).ljust(30) + "".join(
            (f"{r['impls'][n]['synced_ms']:.2f}" + (f" x{r['impls'][n]['synced_ms'] / floor:.2f}" if floor else ""))
            .rjust(24) if "synced_ms" in r["impls"][n] else "n/a".rjust(24) for n in impls))
    if args.gemms:
        print("\ngrouped GEMMs, fwd / dx / dw ms (both expert matrices), TFLOP/s; dense fwd")
        for r in results:
            g = r["gemms"]
            line = str(tuple(r["cfg"])).ljust(30)
            for b in ("cutlass", "torch", "triton"):
                v = g[b]
                line += (f" {b}: {v['fwd']:.2f}/{v['dx']:.2f}/{v['dw']:.2f} ({'/'.join('%.0f' % t for t in v['tflops'])})"
                         if "fwd" in v else f" {b}: n/a")
            line += f" dense {g['dense']['fwd']:.2f} ({g['dense']['tflops']:.0f})"
            print(line)
        print("\nweight gradients accumulated into fp32 main_grad, ms: the fastest backend's dw + an add "
              "(Megatron DDP's hook) vs the add inside the Triton GEMM, and what mm_wgrad(out=) runs; "
              "GB of main_grad read + written")
        for r in results:
            acc = r["gemms"]["accumulate"]
            print(str(tuple(r["cfg"])).ljust(30) + f" {acc['rows_per_group']:.0f} rows a group: {acc['backend']} + "
                  f"add {acc['unfused']:.2f}, fused {acc['fused']:.2f} ({acc['unfused'] / acc['fused']:.2f}x), "
                  f"mm_wgrad's choice {acc['chosen']:.2f}; {acc['main_grad_rw_gb']:.1f} GB")


if __name__ == "__main__":
    main()
