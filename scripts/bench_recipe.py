"""A recipe end to end with each MoE layer, one after the other in the same call: tokens/s, MFU and
the loss curves of recipes/pretrain.py through the deepspeed launcher, same config, seed and steps.

    python scripts/bench_recipe.py --config recipes/configs/small-1gpu.yaml --num-gpus 1 --steps 100 \
        [--impls turbomoe deepspeed] [--out DIR] [--set train.compile=false ...]

Each run writes its log under OUT/<impl>; the script prints a markdown table (tokens/s and MFU over
the steady steps, as the run's summary reports them, and the ratio to the last impl) and the train
loss every tenth of the run, and writes OUT/bench_recipe.json and, with matplotlib, its plot
OUT/bench_recipe.png (scripts/plot_recipe.py).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(impl: str, a, out_dir: str) -> dict:
    log_dir = os.path.join(out_dir, impl)
    shutil.rmtree(log_dir, ignore_errors=True)
    sets = [f"train.steps={a.steps}", f"model.moe_impl={impl}", f"log.dir={log_dir}", "log.wandb=false",
            "checkpoint.every=0", f"eval.every={a.steps}", *a.set]
    if impl == "deepspeed":
        sets.append("train.cuda_graph=false")  # stock DeepSpeed MoE reads counts on the host: no capture
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(a.num_gpus),
           "--master_port", str(a.master_port), os.path.join(ROOT, "recipes", "pretrain.py"),
           "--config", a.config, *sum((["--set", s] for s in sets), [])]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout)
    with open(os.path.join(out_dir, f"{impl}.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"bench_recipe.py: the {impl} run exited {proc.returncode}; see {out_dir}/{impl}.log:\n"
                         + (proc.stdout + proc.stderr)[-3000:])
    with open(os.path.join(log_dir, "log.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    summary = next(r for r in reversed(recs) if r["type"] == "summary")
    return {"impl": impl, "wall_s": time.time() - t0, "summary": summary,
            "train_loss": {r["step"]: r["loss"] for r in recs if r["type"] == "train"},
            "valid_loss": {r["step"]: r["valid_loss"] for r in recs if r["type"] == "valid"}}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--num-gpus", type=int, default=1, help="ranks the launcher starts")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--impls", nargs="+", default=["turbomoe", "deepspeed"], choices=["turbomoe", "deepspeed"])
    p.add_argument("--set", action="append", default=[], help="pretrain.py override for every run")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/turbomoe_out"))
    p.add_argument("--master-port", type=int, default=29561)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    a = p.parse_args()
    out_dir = os.path.join(a.out, "bench_recipe")
    os.makedirs(out_dir, exist_ok=True)
    results = [run(impl, a, out_dir) for impl in a.impls]
    with open(os.path.join(out_dir, "bench_recipe.json"), "w") as f:
        json.dump({"config": a.config, "steps": a.steps, "sets": a.set, "time": time.strftime("%Y-%m-%d %H:%M UTC",
                   time.gmtime()), "runs": results}, f, indent=1)
    base = results[-1]["summary"]["tokens_per_s"]
    print(f"{os.path.basename(a.config)}, {a.steps} steps, {results[0]['summary']['device']} x {a.num_gpus}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, sets {a.set}")
    print(f"| moe_impl | tokens/s | MFU | vs {results[-1]['impl']} | train loss (last) | valid loss first -> last |")
    print("|---|---|---|---|---|---|")
    for r in results:
        s = r["summary"]
        mfu = f"{100 * s['mfu']:.1f}%" if s["mfu"] else "-"
        print(f"| {r['impl']} | {s['tokens_per_s']:,.0f} | {mfu} | {s['tokens_per_s'] / base:.2f}x | "
              f"{s['train_loss']:.4f} | {s['valid_loss_first']:.4f} -> {s['valid_loss_last']:.4f} |")
    marks = sorted({max(1, a.steps * i // 10) for i in range(1, 11)})
    print("train loss at step " + ", ".join(map(str, marks)))
    for r in results:
        print(f"  {r['impl']:9s} " + " ".join(f"{r['train_loss'][m]:.3f}" for m in marks))
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from plot_recipe import main as plot
        plot(os.path.join(out_dir, "bench_recipe.json"), os.path.join(out_dir, "bench_recipe.png"))
    except ImportError as e:
        print(f"no plot ({e}): pip install matplotlib, then scripts/plot_recipe.py")


if __name__ == "__main__":
    main()
