"""transformers' MoE experts on the GPU: experts_implementation "turbomoe" vs transformers' default
"grouped_mm", one experts module (Qwen3MoeExperts / MixtralExperts) in bf16, forward and forward +
backward, CUDA-event medians after warm-up, both timed in the same interleaved rounds.

    python scripts/bench_transformers.py [--quick] [--json OUT.json]

Shapes: Qwen3-30B-A3B's layer (S 8192, H 2048, F 768, E 128, k 8) and Mixtral-8x7B's (H 4096,
F 14336, E 8, k 2, S 8192). Routes come from a softmax router on random tokens (top-k of random
logits: near-balanced). The GEMM FLOPs (2 per multiply-add, 3 GEMMs of S*k rows, x3 with backward)
give the TFLOP/s columns.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import interleaved_medians_ms, require_gpu  # noqa: E402

SHAPES = {
    "qwen3-30b-a3b": dict(family="qwen3_moe", S=8192, H=2048, F=768, E=128, k=8),
    "mixtral-8x7b": dict(family="mixtral", S=8192, H=4096, F=14336, E=8, k=2),
}
IMPLS = ("grouped_mm", "turbomoe")


def experts_module(family: str, H: int, F: int, E: int, k: int):
    import transformers
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=k)
        cls = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts
    else:
        cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=k)
        cls = transformers.models.mixtral.modeling_mixtral.MixtralExperts
    module = cls(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module


def bench(name: str, family: str, S: int, H: int, F: int, E: int, k: int, iters: int) -> dict:
    torch.manual_seed(0)
    experts = experts_module(family, H, F, E, k)
    x = torch.randn(S, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(S, E, device="cuda")
    weights, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
    grad = torch.randn(S, H, device="cuda", dtype=torch.bfloat16)
    xg, wg = x.clone().requires_grad_(), weights.clone().requires_grad_()

    def call(impl, backward):
        experts.config._experts_implementation = impl
        if not backward:
            with torch.no_grad():
                return experts(x, ids, weights)
        out = experts(xg, ids, wg)
        out.backward(grad)
        return out

    outs = {impl: call(impl, False).float() for impl in IMPLS}
    ref = outs["grouped_mm"]
    rel = ((outs["turbomoe"] - ref).norm() / ref.norm()).item()
    fns = [lambda i=impl, b=b: call(i, b) for b in (False, True) for impl in IMPLS]
    fwd_gm, fwd_tm, step_gm, step_tm = interleaved_medians_ms(fns, warmup=5, iters=iters, block=5)
    flops = 2 * S * k * 3 * H * F
    row = {"shape": name, "S": S, "H": H, "F": F, "E": E, "k": k, "rel_err_vs_grouped_mm": rel,
           "fwd_ms": {"grouped_mm": fwd_gm, "turbomoe": fwd_tm},
           "fwd_bwd_ms": {"grouped_mm": step_gm, "turbomoe": step_tm},
           "fwd_tflops": {"grouped_mm": flops / fwd_gm / 1e9, "turbomoe": flops / fwd_tm / 1e9},
           "fwd_bwd_tflops": {"grouped_mm": 3 * flops / step_gm / 1e9, "turbomoe": 3 * flops / step_tm / 1e9},
           "speedup_fwd": fwd_gm / fwd_tm, "speedup_fwd_bwd": step_gm / step_tm}
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer timed calls")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    require_gpu("bench_transformers.py")
    import transformers
    import turbomoe.integrations.transformers as tt
    tt.register()
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
           **{v: os.environ.get(v) for v in ("TURBOMOE_BACKEND", "TURBOMOE_GMM_BACKEND")}}
    print(json.dumps(env))
    rows = []
    for name, shape in SHAPES.items():
        rows.append(bench(name, iters=10 if args.quick else 30, **shape))
        torch.cuda.empty_cache()  # the previous shape's weights and activations are free now
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=2)
    print(f"{'shape':<15} {'impl':<11} {'fwd ms':>8} {'TF/s':>6} {'fwd+bwd ms':>11} {'TF/s':>6}")
    for r in rows:
        for impl in IMPLS:
            print(f"{r['shape']:<15} {impl:<11} {r['fwd_ms'][impl]:8.3f} {r['fwd_tflops'][impl]:6.0f} "
                  f"{r['fwd_bwd_ms'][impl]:11.3f} {r['fwd_bwd_tflops'][impl]:6.0f}")
        print(f"{'':<15} {'ratio':<11} {r['speedup_fwd']:7.2f}x {'':>6} {r['speedup_fwd_bwd']:10.2f}x   "
              f"(turbomoe vs grouped_mm rel err {r['rel_err_vs_grouped_mm']:.1e})")


if __name__ == "__main__":
    main()
