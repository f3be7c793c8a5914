"""Plots bench_inference.py's JSON: index shuffling per (T, E) for each implementation, and the decode
MoE layer's time per token count for each layer shape against its read-bandwidth floor.

    python scripts/plot_inference.py notes/bench_inference.json docs/bench_inference.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str):
    res = json.load(open(src))
    layers = sorted({r["layer"] for r in res.get("layer", [])})
    fig, axes = plt.subplots(1, 1 + len(layers), figsize=(6 + 5 * len(layers), 4.5))
    ax = axes[0]
    shuffle = res.get("shuffle", [])
    series = [("turbomoe (default)", "default_us"), ("turbomoe cuda (one block, any T)", "cuda_us"), ("turbomoe triton", "triton_us"),
              ("FBGEMM", "fbgemm_us"), ("plain PyTorch", "torch_us")]
    series = [(n, k) for n, k in series if any(k in r for r in shuffle)]
    width = 0.8 / max(len(series), 1)
    for i, (name, key) in enumerate(series):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(shuffle))],
               [r.get(key, 0) for r in shuffle], width, label=name)
    ax.set_xticks(range(len(shuffle)))
    ax.set_xticklabels([f"T={r['T']}\nE={r['E']}" for r in shuffle], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("us per call, CUDA-graph replay (log)")
    ax.set_title("index shuffling, top-1")
    ax.legend(fontsize=7)
    for ax, name in zip(axes[1:], layers):
        rows = [r for r in res["layer"] if r["layer"] == name]
        T = [r["T"] for r in rows]
        for label, key in (("turbomoe (auto)", "auto_us"), ("few-rows GEMM", "few_rows_us"),
                           ("grouped GEMM", "grouped_us"), ("dense", "dense_us"), ("plain PyTorch", "torch_us"),
                           ("transformers", "transformers_us"), ("floor (weights / copy bandwidth)", "floor_us")):
            if all(key in r for r in rows):
                ax.plot(T, [r[key] for r in rows], marker="o", label=label, linestyle="--" if "floor" in label else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens in the step")
        ax.set_ylabel("us per layer (log)")
        ax.set_title(f"decode MoE layer: {name}")
        ax.legend(fontsize=7)
    fig.suptitle(f"{res['device']}, torch {res['torch']}, {res['utc']} UTC", fontsize=9)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
