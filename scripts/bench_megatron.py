"""Benchmark megatron-core's MoE layer, stock vs turbomoe's spec, and turbomoe's own MoELayer (bf16, fwd + bwd).

    python scripts/bench_megatron.py [--configs 0,1,2,3,4,5] [--iters 20] [--no-gpt] [--out DIR]
                                     [--shape 512,512,256,8,1]     (one shape instead of the configs)
                                     [--profile "turbomoe,native"]   (kernels and host issue time instead)

Layers (one process, the same config):
  stock     megatron-core 0.16.1's MoELayer from its local spec: TopKRouter, allgather dispatcher,
            SequentialMLP (the legacy GroupedMLP needs the grouped_gemm package: not installable here)
  turbomoe  get_turbomoe_moe_spec: TurboTopKRouter, TurboTokenDispatcher, TurboGroupedMLP, the probs
            scaling the activation inside turbomoe's SwiGLU kernel (the default)
  before    the same with probs_before_fc2=True: the probs scale the activation before fc2 with
            Megatron's own rounding (an [R, F] multiply each way)
  native    turbomoe.nn.MoELayer at the same shape and router precision (fp32 logits, as the spec's
            moe_router_dtype="fp32"; the bar: turbomoe's Megatron layer within 1.2x)
  stock TE  where Transformer Engine is installed: stock's MoELayer from TE's spec with
            moe_grouped_gemm (TEGroupedMLP: TE's grouped GEMM over all local experts)
All dropless, SwiGLU experts, softmax top-k (renormalised over the k, as Megatron's default), fp32
router logits, aux loss 0.01. Times: CUDA-event medians after warm-up, the three layers interleaved in
the same rounds, steps queued back to back (scripts/timing.py). Then a small GPT training step
(forward, backward, SGD update) built from Megatron's local block spec, stock and turbomoe's: tokens/s;
with Transformer Engine also from TE's block spec (TE's linears, norms and attention on both sides).
Stock 0.16.1 without Transformer Engine stops in router_gating_linear (te_general_gemm is bound only
by TE's import); this script binds it to None, the value the code tests for.
"""
import argparse
import importlib.util
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "scripts"))
sys.path.insert(2, os.path.join(ROOT, "tests"))

from bench_layer import CONFIGS  # noqa: E402  (S, M, F, E, k): the layer benchmark's, real models' included
from timing import interleaved_medians_ms, profile_step, reset_grads  # noqa: E402

from megatron.core.transformer.moe import moe_utils  # noqa: E402

if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None  # see the module doc

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_common import model_parallel  # noqa: E402
from turbomoe.integrations.megatron import get_turbomoe_gpt_decoder_block_spec, get_turbomoe_moe_spec  # noqa: E402
from turbomoe.nn import MoELayer  # noqa: E402

DTYPE = torch.bfloat16
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def config(M, F_, E, k, **kw) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=M, num_attention_heads=16, ffn_hidden_size=4 * M, num_moe_experts=E,
                moe_router_topk=k, moe_ffn_hidden_size=F_, moe_router_pre_softmax=k == 1, gated_linear_unit=True,
                activation_func=F.silu, add_bias_linear=False, params_dtype=DTYPE, bf16=True,
                moe_router_dtype="fp32", moe_aux_loss_coeff=0.01, hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return TransformerConfig(**base)


def layer_step(layer, x, g):
    params = [p for p in layer.parameters() if p.requires_grad]

    def step():
        reset_grads(params + [x])
        out, extra = layer(x)  # Megatron's: (out, None), its aux losses ride on the graph; native: (out, aux)
        if extra is None:
            out.backward(g)
        else:
            torch.autograd.backward((out, extra), (g, torch.ones_like(extra)))
    return step


def bench_layers(shapes, iters, profile=()):
    """The layers' interleaved times at each (S, M, F, E, k); with profile (layer names), their
    kernels and host issue time instead (timing.profile_step)."""
    rows = []
    for shape in shapes:
        S, M, F_, E, k = shape
        cfg = config(M, F_, E, k)
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        layers = {
            "stock": build_module(get_moe_module_spec(use_te=False, num_experts=E), config=cfg).cuda(),
            "turbomoe": build_module(get_turbomoe_moe_spec(cfg), config=cfg).cuda(),
            "before": build_module(get_turbomoe_moe_spec(cfg, probs_before_fc2=True), config=cfg).cuda(),
            "native": MoELayer(M, F_, E, k, renormalize=k > 1, aux_loss_coef=0.01, device="cuda", dtype=DTYPE),
        }
        layers["native"].router.router_dtype = torch.float32  # cfg's moe_router_dtype: the same router work
        if HAVE_TE:
            layers["stock TE"] = build_module(get_moe_module_spec(use_te=True, num_experts=E, moe_grouped_gemm=True),
                                              config=config(M, F_, E, k, moe_grouped_gemm=True)).cuda()
        x3 = torch.randn(S, 1, M, device="cuda", dtype=DTYPE, requires_grad=True)
        g3 = torch.randn_like(x3)
        x2 = x3.detach().view(S, M).requires_grad_()
        steps = [layer_step(layers["stock"], x3, g3), layer_step(layers["turbomoe"], x3, g3),
                 layer_step(layers["before"], x3, g3), layer_step(layers["native"], x2, g3.view(S, M))]
        if HAVE_TE:
            steps.append(layer_step(layers["stock TE"], x3, g3))
        if profile:
            for name, step in zip(layers, steps):
                if name in profile:
                    profile_step(step, f"{shape} {name}")
        else:
            stock_ms, turbo_ms, before_ms, native_ms, *te_ms = interleaved_medians_ms(steps, warmup=3, iters=iters,
                                                                                      block=5)
            row = dict(S=S, M=M, F=F_, E=E, k=k, stock_ms=stock_ms, turbomoe_ms=turbo_ms, before_fc2_ms=before_ms,
                       native_ms=native_ms, speedup=stock_ms / turbo_ms, vs_native=turbo_ms / native_ms,
                       before_fc2_speedup=stock_ms / before_ms, before_fc2_vs_native=before_ms / native_ms)
            if te_ms:
                row.update(stock_te_ms=te_ms[0], speedup_vs_te=te_ms[0] / turbo_ms)
            print(f"[layer] {row}", flush=True)
            rows.append(row)
        del layers, steps, x2, x3, g3
        torch.cuda.empty_cache()
    return rows


def bench_gpt(iters, te: bool = False, seq=2048, batch=4):
    """One training step of a small MoE GPT (fwd + bwd + SGD), stock vs turbomoe's spec: tokens/s. te: both
    on Transformer Engine's block spec (stock's experts TEGroupedMLP)."""
    cfg = config(1024, 1408, 32, 2, num_layers=4, moe_router_pre_softmax=False, moe_grouped_gemm=te)
    vocab = 32768
    tokens = torch.randint(0, vocab, (batch, seq), device="cuda")
    pos = torch.arange(seq, device="cuda").expand(batch, seq)
    mask = torch.ones(batch, 1, seq, seq, dtype=torch.bool, device="cuda").triu(1)
    steps, models = [], []
    for spec in (get_gpt_decoder_block_spec(cfg, use_transformer_engine=te),
                 get_turbomoe_gpt_decoder_block_spec(cfg, use_transformer_engine=te)):
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq)
        model = model.cuda().to(DTYPE)  # as Float16Module casts it (its embeddings start in fp32)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, foreach=True)
        models.append(model)

        def step(model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            model(tokens, pos, mask, labels=tokens).float().mean().backward()
            opt.step()
        steps.append(step)
    stock_ms, turbo_ms = interleaved_medians_ms(steps, warmup=3, iters=iters, block=5)
    n = batch * seq
    row = dict(spec="te" if te else "local", layers=4, hidden=1024, E=32, k=2, F=1408, seq=seq, batch=batch,
               stock_ms=stock_ms, turbomoe_ms=turbo_ms,
               stock_tokens_s=n / stock_ms * 1e3, turbomoe_tokens_s=n / turbo_ms * 1e3, speedup=stock_ms / turbo_ms)
    print(f"[gpt] {row}", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(str(i) for i in range(len(CONFIGS))))
    ap.add_argument("--shape", default=None, help="S,M,F,E,k instead of --configs: e.g. 512,512,256,8,1, where "
                    "the GPU idles and the times are the host's (a step's host time, layer against layer)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-gpt", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default="", help="comma-separated layers (stock, turbomoe, before, native, "
                    "stock TE) whose kernels and host issue time to print instead of timing")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_megatron.py needs a CUDA GPU (megatron-core's MoE layer does)")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    profile = [p.strip() for p in args.profile.split(",") if p.strip()]
    with model_parallel("nccl"):
        shapes = ([tuple(int(v) for v in args.shape.split(","))] if args.shape
                  else [CONFIGS[int(c)] for c in args.configs.split(",")])
        rows = bench_layers(shapes, args.iters, profile)
        gpts = [] if args.no_gpt or profile else [bench_gpt(max(args.iters // 2, 5), te)
                                                  for te in (False, True)[:1 + HAVE_TE]]
    if profile:
        return
    te_head, te_rule = (" stock TE (TEGroupedMLP) ms | speedup |", "---|---|") if HAVE_TE else ("", "")
    print("\n| (S, M, F, E, k) | stock local (SequentialMLP) ms | turbomoe spec ms | speedup | turbomoe MoELayer ms "
          f"| spec / MoELayer | spec, probs before fc2 ms | speedup | / MoELayer |{te_head}")
    print(f"|---|---|---|---|---|---|---|---|---|{te_rule}")
    for r in rows:
        te_cols = f" {r['stock_te_ms']:.2f} | {r['speedup_vs_te']:.1f}x |" if HAVE_TE else ""
        print(f"| {r['S']}, {r['M']}, {r['F']}, {r['E']}, {r['k']} | {r['stock_ms']:.2f} | {r['turbomoe_ms']:.2f} | "
              f"{r['speedup']:.1f}x | {r['native_ms']:.2f} | {r['vs_native']:.2f} | {r['before_fc2_ms']:.2f} | "
              f"{r['before_fc2_speedup']:.1f}x | {r['before_fc2_vs_native']:.2f} |{te_cols}")
    for gpt in gpts:
        print(f"\nGPT step, {gpt['spec']} spec ({gpt['layers']} MoE layers, hidden {gpt['hidden']}, E {gpt['E']}, "
              f"k {gpt['k']}, F {gpt['F']}, {gpt['batch']} x {gpt['seq']} tokens): stock {gpt['stock_ms']:.1f} ms "
              f"({gpt['stock_tokens_s']:,.0f} tokens/s), turbomoe {gpt['turbomoe_ms']:.1f} ms "
              f"({gpt['turbomoe_tokens_s']:,.0f} tokens/s), {gpt['speedup']:.2f}x")
    if args.out:
        with open(os.path.join(args.out, "bench_megatron.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), layers=rows, gpt=gpts), f, indent=1)


if __name__ == "__main__":
    main()
