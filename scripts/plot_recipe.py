"""Plots bench_recipe.py's JSON: each MoE layer's train loss per step (same config, seed and data)
and its throughput.

    python scripts/plot_recipe.py notes/bench_recipe.json docs/bench_recipe.png
"""
import json
import os

from plotting import cli, plt, save

NAMES = {"turbomoe": "turbomoe", "deepspeed": "DeepSpeed MoE (stock)"}


def main(src: str, dst: str):
    res = json.load(open(src))
    runs = res["runs"]
    device = runs[0]["summary"]["device"]
    fig, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for r in runs:  # JSON keys are strings
        steps = sorted(int(s) for s in r["train_loss"])
        loss_ax.plot(steps, [r["train_loss"][str(s)] for s in steps], label=NAMES.get(r["impl"], r["impl"]), lw=1)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("train loss")
    loss_ax.set_yscale("log")
    loss_ax.legend()
    loss_ax.set_title(f"{os.path.basename(res['config'])}: loss, same seed and data")
    names = [NAMES.get(r["impl"], r["impl"]) for r in runs]
    tokens = [r["summary"]["tokens_per_s"] for r in runs]
    bars = speed_ax.bar(names, tokens, color=[f"C{i}" for i in range(len(runs))])
    for bar, r in zip(bars, runs):
        mfu = r["summary"]["mfu"]
        speed_ax.annotate(f"{r['summary']['tokens_per_s']:,.0f}" + (f"\nMFU {100 * mfu:.1f}%" if mfu else ""),
                          (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    speed_ax.set_ylabel("tokens/s (higher is better)")
    speed_ax.set_ylim(0, max(tokens) * 1.2)
    speed_ax.set_title(f"{res['steps']} steps, {device}, {res['time']}", fontsize=9)
    save(fig, dst)


if __name__ == "__main__":
    cli(main, __doc__)
