"""Plots bench_gating.py's JSON: time of the gating path (forward + backward) per config for
DeepSpeed, turbomoe eager on each kernel backend, turbomoe replayed from a CUDA graph, and turbomoe
issued behind a model's other GPU work.

    python scripts/plot_gating.py notes/bench_gating.json docs/bench_gating.png
"""
import json

from plotting import cli, plt, save


def main(src: str, dst: str):
    res = json.load(open(src))
    cfgs = res["configs"]
    labels = [f"S={c['S']}\nE={c['E']} k={c['k']}\nM={c['M']}" for c in cfgs]
    first = res["backends"][0]
    series = ([("DeepSpeed 0.19", "deepspeed_ms")] + [(f"turbomoe, {b}", f"{b}_ms") for b in res["backends"]]
              + [(f"turbomoe, {first}, CUDA graph", "graph_ms"), (f"turbomoe, {first}, in a model", "in_model_ms")])
    fig, ax = plt.subplots(figsize=(14, 4.5))
    width = 0.8 / len(series)
    for i, (name, key) in enumerate(series):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(cfgs))], [c[key] for c in cfgs], width,
               label=name)
    ax.set_xticks(range(len(cfgs)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("ms, forward + backward (lower is better)")
    ax.set_title(f"MoE gating path (softmax/top-k, capacity, scatter, gather), bf16, {res['device']}")
    ax.legend()
    save(fig, dst)


if __name__ == "__main__":
    cli(main, __doc__)
