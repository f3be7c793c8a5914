"""Helpers of scripts/gpu_megatron_deepspeed.sh (Megatron-DeepSpeed's own pretrain_gpt.py, stock and
on turbomoe). Subcommands:

  shims DIR SITE   what the GPU machine lacks for Megatron-DeepSpeed: apex (on CUDA it imports apex's
                   fused LayerNorm, FusedAdam and multi-tensor applier with amp_C unconditionally;
                   here F.layer_norm, torch's AdamW (apex's FusedAdam is AdamW by default) and
                   plain loops, the same math, in both runs),
                   python3-config (its dataset helpers' Makefile asks it for the module suffix),
                   a sitecustomize that, with MDS_PYTHON_SAMPLE_IDX=1, serves build_sample_idx from
                   Megatron-DeepSpeed's own Python version (its C++ helper crashed on a GPU machine), and
                   torchvision and PIL, which megatron/training.py imports through its vision models'
                   modules (names only: a GPT run never calls them). Only for packages that are
                   not installed. And, in the DeepSpeed installed under SITE,
                   deepspeed.compression.compress: DeepSpeed 0.19 dropped it, megatron/training.py
                   imports it at the top (used only with "compression_training" in the DeepSpeed config)
  data PREFIX      a tiny indexed dataset written with Megatron-DeepSpeed's own MMapIndexedDatasetBuilder:
                   token ids of an order-1 Markov chain (each token has 4 successors), so the loss
                   has somewhere to go (from ln V towards ln 4); no tokenizer (NullTokenizer)
  layer ARGS       the MoE layer alone with Megatron-DeepSpeed's ParallelMLP experts, stock
                   deepspeed.moe.layer.MoE vs turbomoe's, forward + backward, CUDA-event medians
  summary LOG...   loss per step side by side and the throughput lines Megatron-DeepSpeed printed
  trace DIR...     where the profiled steps' time goes (the torch.profiler traces its --profile pt-full
                   wrote): step time and the GPU's busy share, the host's time by package and by
                   Python function, and the CUDA calls (those that wait for the GPU among them)
"""
import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys

APEX_INIT = '''"""Not NVIDIA apex: the part Megatron-DeepSpeed imports on CUDA, in plain PyTorch
(written by turbomoe's scripts/megatron_deepspeed.py; apex is not installed on this machine)."""
# apex's own __init__ imports its optimizers. DeepSpeed relies on it: with bf16 or fp16 and ZeRO 0 it
# takes its flat-buffer FP16_Optimizer only for an optimizer that is apex.optimizers.FusedAdam, and
# otherwise its per-parameter FP16_UnfusedOptimizer (an overflow check and host sync a parameter).
from . import optimizers  # noqa: F401
'''
APEX_NORMALIZATION = '''import torch
import torch.nn.functional as F

from .fused_layer_norm import FusedLayerNormAffineFunction  # noqa: F401


class MixedFusedRMSNorm(torch.nn.Module):
    def __init__(self, normalized_shape, eps=1e-5, **kw):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(normalized_shape))

    def forward(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
'''
APEX_FUSED_LAYER_NORM = '''import torch.nn.functional as F


class FusedLayerNormAffineFunction:
    """apex's signature (without memory_efficient), F.layer_norm's math and autograd."""

    @staticmethod
    def forward(input, weight, bias, normalized_shape, eps):
        return F.layer_norm(input, normalized_shape, weight, bias, eps)

    apply = forward
'''
APEX_OPTIMIZERS = '''import torch


class FusedAdam(torch.optim.AdamW):
    """apex's FusedAdam in its default adam_w_mode (decoupled weight decay): torch's AdamW."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):
        if not (adam_w_mode and bias_correction):
            raise NotImplementedError("this FusedAdam stand-in is AdamW with bias correction only")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


class FusedSGD(torch.optim.SGD):
    pass
'''
APEX_MULTI_TENSOR_APPLY = '''def multi_tensor_applier(op, noop_flag_buffer, tensor_lists, *args):
    return op(None, noop_flag_buffer, tensor_lists, *args)
'''
AMP_C = '''"""apex's amp_C, the two ops Megatron-DeepSpeed calls, as plain loops (see apex/)."""
import torch


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor):
    norms = [t.float().norm() for t in tensor_lists[0]]
    total = torch.stack(norms).norm() if norms else torch.zeros((), device=noop_flag.device)
    return total.reshape(1), (torch.stack(norms) if per_tensor and norms else None)


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    with torch.no_grad():
        for src, dst in zip(*tensor_lists):
            dst.copy_(src * scale)
'''
PYTHON3_CONFIG = '''#!/bin/sh
# python3-config's --extension-suffix and --includes, for Megatron-DeepSpeed's dataset helpers' Makefile.
case "$1" in
  --extension-suffix) exec python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))" ;;
  --includes) exec python3 -c "import sysconfig; print('-I' + sysconfig.get_paths()['include'])" ;;
esac
exit 1
'''


VISION_PLACEHOLDER = '''"""Placeholder (turbomoe's scripts/megatron_deepspeed.py): Megatron-DeepSpeed's training.py
imports its vision modules, which import this package; a GPT run never calls into it."""


class VisionDataset:
    pass


class Image:  # transformers checks PIL by importing PIL.Image.Image
    pass


def get_image_backend():
    raise RuntimeError("torchvision is not installed (placeholder module)")
'''


COMPRESS = '''"""Added by turbomoe's scripts/megatron_deepspeed.py: DeepSpeed 0.19 has no compression.compress,
which Megatron-DeepSpeed's training.py imports; it calls these only with compression_training."""


def init_compression(*args, **kwargs):
    raise NotImplementedError("DeepSpeed 0.19 dropped deepspeed.compression.compress")


redundancy_clean = init_compression
'''


SAMPLE_IDX = '''"""Written by turbomoe's scripts/megatron_deepspeed.py, active only with MDS_PYTHON_SAMPLE_IDX=1:
Megatron-DeepSpeed's compiled dataset helper crashed (SIGSEGV in build_sample_idx, H200 machine,
2026-11-23), so megatron.data.helpers is then a module whose build_sample_idx is Megatron-DeepSpeed's
own pure-Python _build_sample_idx (megatron/data/gpt_dataset.py): the same index maps, built slower."""
import os
import sys
import types

if os.environ.get("MDS_PYTHON_SAMPLE_IDX") == "1":
    def build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
        from megatron.data.gpt_dataset import _build_sample_idx
        return _build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)

    helpers = types.ModuleType("megatron.data.helpers")
    helpers.build_sample_idx = build_sample_idx
    sys.modules["megatron.data.helpers"] = helpers
'''


def write_shims(root, site):
    files = {"apex/__init__.py": APEX_INIT, "apex/normalization/__init__.py": APEX_NORMALIZATION,
             "apex/normalization/fused_layer_norm.py": APEX_FUSED_LAYER_NORM,
             "apex/multi_tensor_apply.py": APEX_MULTI_TENSOR_APPLY, "apex/optimizers.py": APEX_OPTIMIZERS, "amp_C.py": AMP_C,
             "fused_layer_norm_cuda.py": '"""Imported (not used) by MixedFusedLayerNorm; see apex/."""\n',
             "bin/python3-config": PYTHON3_CONFIG, "sitecustomize.py": SAMPLE_IDX}
    for rel in ("torchvision/__init__.py", "torchvision/transforms/__init__.py", "torchvision/datasets/__init__.py",
                "PIL/__init__.py"):
        files[rel] = VISION_PLACEHOLDER
    for name in ("Image", "ImageFilter", "ImageOps", "ImageEnhance"):
        files[f"PIL/{name}.py"] = VISION_PLACEHOLDER
    import importlib.util
    installed = {top for top in ("apex", "torchvision", "PIL") if importlib.util.find_spec(top) is not None}
    if "apex" in installed:
        installed |= {"fused_layer_norm_cuda", "amp_C"}  # apex's own extensions
    compress = os.path.join(site, "deepspeed", "compression", "compress.py")
    if os.path.isdir(os.path.dirname(compress)) and not os.path.exists(compress):
        with open(compress, "w") as f:
            f.write(COMPRESS)
    for rel, text in files.items():
        if rel.split("/")[0].removesuffix(".py") in installed:
            print(f"shims: {rel.split('/')[0]} is installed, not shimmed")
            continue
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    os.chmod(os.path.join(root, "bin/python3-config"), 0o755)


def write_data(prefix, vocab=1024, docs=1500, doc_len=700, seed=1234):
    import numpy as np
    import torch
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 4))
    t_DL = np.empty((docs, doc_len), dtype=np.int64)
    t_DL[:, 0] = rng.integers(0, vocab, size=docs)
    choices_DL = rng.integers(0, 4, size=(docs, doc_len))
    for i in range(1, doc_len):
        t_DL[:, i] = successors[t_DL[:, i - 1], choices_DL[:, i]]
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for t in t_DL:
        builder.add_item(torch.from_numpy(t))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    print(f"wrote {prefix}.bin/.idx: {docs} documents of {doc_len} tokens, vocab {vocab}")


def bench_layer(argv):
    """The MoE layer as Megatron-DeepSpeed builds it (transformer.py), stock vs turbomoe."""
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, nargs="+", default=[16, 32])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--json")
    p.add_argument("--profile", action="store_true", help="print each layer's kernels (torch.profiler)")
    # one process: the layers are built with ep_size 1, so another size would be timed as 1
    p.add_argument("--moe-expert-parallel-size", type=int, default=1)
    args, mds_argv = p.parse_known_args(argv)
    if args.moe_expert_parallel_size != 1:
        raise SystemExit(f"layer: one process, expert parallel size 1 (got --moe-expert-parallel-size "
                         f"{args.moe_expert_parallel_size}); time expert parallelism with pretrain_gpt.py runs")
    import torch
    sys.argv = ["bench"] + mds_argv
    from megatron.initialize import initialize_megatron
    initialize_megatron(args_defaults={"tokenizer_type": "NullTokenizer"})
    from megatron import get_args
    from megatron.arguments import core_transformer_config_from_args
    from megatron.model.transformer import ParallelMLP
    from deepspeed.moe.layer import MoE as StockMoE
    from turbomoe.integrations import deepspeed as tds
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from timing import interleaved_medians_ms, profile_step, reset_grads
    margs = get_args()
    config = core_transformer_config_from_args(margs)
    M = margs.hidden_size
    # bf16 on the GPU; a CPU run (float32) only checks that the script works
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    rows = []
    for E in args.experts:
        kw = dict(num_experts=E, ep_size=1, k=margs.topk, capacity_factor=margs.moe_train_capacity_factor,
                  eval_capacity_factor=margs.moe_eval_capacity_factor, min_capacity=margs.moe_min_capacity,
                  drop_tokens=margs.moe_token_dropping, use_residual=margs.mlp_type == "residual",
                  top2_2nd_expert_sampling=margs.moe_top2_2nd_expert_sampling)
        torch.manual_seed(0)
        stock = StockMoE(M, ParallelMLP(config, moe=True), **kw).to(device, dtype)
        turbo = tds.MoE(M, ParallelMLP(config, moe=True), **kw, fused_grad_accumulation=False).to(device, dtype)
        turbo.load_state_dict(stock.state_dict())
        # the same with the experts' weight gradients added into .grad inside their GEMMs when accumulating
        fused = tds.MoE(M, ParallelMLP(config, moe=True), **kw, fused_grad_accumulation=True).to(device, dtype)
        fused.load_state_dict(stock.state_dict())
        assert turbo.deepspeed_moe.expert_fast_path == "megatron", "the grouped path did not recognise ParallelMLP"
        x = torch.randn(args.tokens, 1, M, device=device, dtype=dtype)  # [s, b, h] as Megatron
        g = torch.randn_like(x)

        def step(layer, reset=False):
            params = list(layer.parameters())

            def run():
                if reset:  # each step's weight gradients new (else added to the last step's, as in accumulation)
                    reset_grads(params)
                xi = x.detach().requires_grad_()
                out, l_aux, _ = layer(xi)
                torch.autograd.backward([out, l_aux], [g, torch.ones_like(l_aux)])
            return run

        err = []
        for layer in (stock, turbo):  # same seed: same routing where nothing is sampled
            torch.manual_seed(1)
            err.append(layer(x)[0].float())
        rel = ((err[1] - err[0]).norm() / err[0].norm()).item()
        t_stock, t_turbo, t_fused, r_stock, r_turbo = interleaved_medians_ms(
            [step(stock), step(turbo), step(fused), step(stock, True), step(turbo, True)], warmup=5, iters=30, block=5)
        if args.profile and device == "cuda":
            for name, layer in (("stock", stock), ("turbomoe", turbo), ("turbomoe fused_grad_accumulation", fused)):
                profile_step(step(layer), f"E={E} {name}", top=20)
                host_phases(layer, x, g, step(layer), f"E={E} {name}")
        rows.append(dict(E=E, tokens=args.tokens, hidden=M, ffn=margs.ffn_hidden_size, k=margs.topk,
                         stock_ms=t_stock, turbo_ms=t_turbo, speedup=t_stock / t_turbo, fused_ms=t_fused,
                         speedup_fused=t_stock / t_fused, stock_reset_ms=r_stock,
                         turbo_reset_ms=r_turbo, speedup_reset=r_stock / r_turbo, out_rel_err=rel))
        print(json.dumps(rows[-1]), flush=True)
    print("weight gradients added to the last step's (accumulating; fused: turbomoe with fused_grad_accumulation) "
          "| made new each step (reset)")
    print(f"{'E':>4} {'tokens':>7} {'stock ms':>9} {'turbo ms':>9} {'speed-up':>9} {'fused ms':>9} {'speed-up':>9} | "
          f"{'stock ms':>9} {'turbo ms':>9} {'speed-up':>9} {'out rel err':>12}")
    for r in rows:
        print(f"{r['E']:>4} {r['tokens']:>7} {r['stock_ms']:>9.3f} {r['turbo_ms']:>9.3f} {r['speedup']:>8.2f}x "
              f"{r['fused_ms']:>9.3f} {r['speedup_fused']:>8.2f}x | "
              f"{r['stock_reset_ms']:>9.3f} {r['turbo_reset_ms']:>9.3f} {r['speedup_reset']:>8.2f}x {r['out_rel_err']:>12.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def host_phases(layer, x, g, run, label):
    """The host's time to issue the forward and the backward of one step onto an idle GPU (median
    of 5), where they wait for the GPU (torch's sync debug mode: each synchronizing call), and the
    host's op and Python tables of run (the step: forward and backward)."""
    import time
    import warnings
    import torch
    fwd, bwd = [], []
    for _ in range(5):
        xi = x.detach().requires_grad_()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, l_aux, _ = layer(xi)
        t1 = time.perf_counter()
        torch.autograd.backward([out, l_aux], [g, torch.ones_like(l_aux)])
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename.split('/')[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    print(f"{label}: host issue forward {statistics.median(fwd) * 1e3:.2f} ms, backward "
          f"{statistics.median(bwd) * 1e3:.2f} ms; {len(syncs)} synchronizing calls {syncs[:12]}")
    from profile_host import op_table, python_table
    op_table(run, 25)
    python_table(run, 25)


ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+).*?"
                  r"lm loss: ([\d.E+-]+)")
THROUGHPUT = re.compile(r"samples per second: ([\d.]+).*?TFLOPs: ([\d.]+)")


def parse_log(path):
    """{iteration: (loss, ms)} and [(samples/s, TFLOP/s)] from a Megatron-DeepSpeed log."""
    steps, tput = {}, []
    with open(path, errors="replace") as f:
        for line in f:
            m = ITER.search(line)
            if m:
                steps[int(m.group(1))] = (float(m.group(3)), float(m.group(2)))
            t = THROUGHPUT.search(line)
            if t:
                tput.append((float(t.group(1)), float(t.group(2))))
    return steps, tput


def summary(argv):
    """summary NAME STOCK_LOG TURBO_LOG [NAME STOCK_LOG TURBO_LOG ...]"""
    ratios = {}
    for i in range(0, len(argv), 3):
        name, stock_log, turbo_log = argv[i:i + 3]
        (s_steps, s_tp), (t_steps, t_tp) = parse_log(stock_log), parse_log(turbo_log)
        print(f"== {name}: lm loss per step (stock | turbomoe) and ms per iteration")
        for it in sorted(set(s_steps) | set(t_steps)):
            s, t = s_steps.get(it, (float("nan"), 0)), t_steps.get(it, (float("nan"), 0))
            print(f"  {it:4d}  {s[0]:.5f} | {t[0]:.5f}   diff {t[0] - s[0]:+.5f}   {s[1]:8.1f} | {t[1]:8.1f} ms")
        skip = 5  # warm-up iterations (allocations, Triton compiles)
        for label, steps, tp in (("stock", s_steps, s_tp), ("turbomoe", t_steps, t_tp)):
            ms = [v[1] for k, v in sorted(steps.items())][skip:]
            tp = tp[skip:]
            if ms and tp:
                print(f"  {label:9s} median after {skip} warm-up steps: {statistics.median(ms):.1f} ms/iter, "
                      f"{statistics.median(a for a, _ in tp):.2f} samples/s, {statistics.median(b for _, b in tp):.2f} TFLOP/s")
        s_ms = [v[1] for k, v in sorted(s_steps.items())][skip:]
        t_ms = [v[1] for k, v in sorted(t_steps.items())][skip:]
        if s_ms and t_ms:
            ratio = statistics.median(s_ms) / statistics.median(t_ms)
            print(f"  whole step speed-up: {ratio:.2f}x")
            ratios.setdefault(re.sub(r"_\d+$", "", name), []).append(ratio)
    for name, rs in ratios.items():  # a configuration run as repeated pairs (NAME_1, NAME_2, ...)
        if len(rs) > 1:
            print(f"== {name}: whole step speed-up of {len(rs)} pairs {', '.join(f'{r:.2f}x' for r in rs)}, "
                  f"median {statistics.median(rs):.2f}x")


def _self_times(events):
    """(event, self time, owner) for each CPU-side event: its duration less its children's, and the
    nearest Python caller outside torch (whose code asked for it), nesting per thread."""
    out = []
    by_tid = collections.defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, children's time, owner]
        for e in evs:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                out.append(_close(stack.pop()))
            owner = stack[-1][2] if stack else ""
            if stack:
                stack[-1][1] += e["dur"]
                parent = stack[-1][0]["name"]
                if ".py(" in parent and "torch/" not in parent:  # a Python source line outside torch
                    owner = parent
            stack.append([e, 0.0, owner])
        out.extend(_close(f) for f in reversed(stack))
    return out


def _close(frame):
    e, children, owner = frame
    return e, e["dur"] - children, owner


PACKAGES = ("turbomoe", "deepspeed", "megatron", "torch")


def _package(name):
    for p in PACKAGES:
        if f"{p}/" in name:
            return p
    return "other" if name else "(no Python caller)"


def _busy(intervals):
    total, end = 0.0, -1.0
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def trace(argv):
    """trace DIR [DIR ...]: one summary per directory of torch.profiler traces (*.json[.gz])."""
    for d in argv:
        files = sorted(glob.glob(os.path.join(d, "*.json*")))
        if not files:
            print(f"== {d}: no trace")
            continue
        with (gzip.open if files[-1].endswith(".gz") else open)(files[-1], "rt") as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
        steps = [e for e in events if e["name"].startswith("ProfilerStep#") and e.get("cat") == "user_annotation"]
        span = (min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)) if steps else (0, 0)
        n = max(len(steps), 1)
        gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        gpu = [(max(a, span[0]), min(b, span[1])) for a, b in gpu if b > span[0] and a < span[1]]
        wall, busy = span[1] - span[0], _busy(gpu)
        print(f"== {d}: {len(steps)} profiled steps, {wall / 1e3 / n:.1f} ms a step (profiler on), GPU busy "
              f"{busy / 1e3 / n:.1f} ms a step ({100 * busy / max(wall, 1):.0f}%), "
              f"{len(gpu) / n:.0f} GPU ops a step")
        main = {e["tid"] for e in steps}  # the training thread (not the data loader's or the profiler's)
        cpu = [e for e in events if e.get("cat") in ("python_function", "cpu_op", "cuda_runtime", "cuda_driver")
               and e["tid"] in main and span[0] <= e["ts"] < span[1]]
        by_pkg, runtime, runtime_calls = collections.Counter(), collections.Counter(), collections.Counter()
        by_fn, fn_calls = collections.Counter(), collections.Counter()
        for e, self_us, owner in _self_times(cpu):
            where = _package(e["name"] if ".py(" in e["name"] else owner)
            kind = {"python_function": "Python", "cpu_op": "ATen ops", "cuda_runtime": "CUDA calls",
                    "cuda_driver": "CUDA calls"}[e["cat"]]
            by_pkg[(where, kind)] += self_us
            if e["cat"] in ("cuda_runtime", "cuda_driver"):
                runtime[e["name"]] += e["dur"]
                runtime_calls[e["name"]] += 1
        # Inclusive time of each Python function, its outermost call only (recursion counted once).
        open_until = collections.defaultdict(dict)
        for e in sorted((e for e in cpu if e["cat"] == "python_function"), key=lambda e: (e["ts"], -e["dur"])):
            until = open_until[e["tid"]]
            if until.get(e["name"], -1) > e["ts"]:
                continue
            until[e["name"]] = e["ts"] + e["dur"]
            by_fn[e["name"]] += e["dur"]
            fn_calls[e["name"]] += 1
        print("  host time a step (self time, ms) by package: a Python line's own, or for ATen ops and CUDA calls "
              "the nearest caller's outside torch:")
        for (pkg, kind), us in sorted(by_pkg.items(), key=lambda kv: -kv[1])[:14]:
            print(f"    {pkg:20s} {kind:10s} {us / 1e3 / n:8.2f}")
        print("  CUDA calls (ms a step, calls a step):")
        for name, us in runtime.most_common(8):
            print(f"    {name:40s} {us / 1e3 / n:8.2f} {runtime_calls[name] / n:8.1f}")
        print("  Python functions by inclusive time (ms a step, calls a step):")
        for name, us in by_fn.most_common(45):
            print(f"    {us / 1e3 / n:8.2f} {fn_calls[name] / n:6.1f}  {name[-110:]}")


def main():
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "shims":
        write_shims(rest[0], rest[1])
    elif cmd == "data":
        write_data(rest[0])
    elif cmd == "layer":
        bench_layer(rest)
    elif cmd == "summary":
        summary(rest)
    elif cmd == "trace":
        trace(rest)
    else:
        raise SystemExit(f"unknown subcommand {cmd!r}; see the module docstring")


if __name__ == "__main__":
    main()
