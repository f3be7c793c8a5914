"""Plots bench_inference.py's JSON: index shuffling per (T, E) for each implementation, the decode
MoE layer's time per token count for each layer shape against its read-bandwidth floor, and
generation's tokens/s per batch (the ~1B model's and, where run, Qwen3-30B-A3B's size) against
transformers and the floor.

    python scripts/plot_inference.py notes/bench_inference.json docs/bench_inference.png
"""
import json

from plotting import cli, plt, save


def lines(ax, rows, x, series, xlabel, ylabel, title):
    """A log-log panel: each (label, column) of series that every row has, against column x (floors dashed)."""
    for label, col in series:
        if all(col in r for r in rows):
            ax.plot([r[x] for r in rows], [r[col] for r in rows], marker="o", label=label,
                    linestyle="--" if "floor" in label else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)


def main(src: str, dst: str):
    res = json.load(open(src))
    layers = sorted({r["layer"] for r in res.get("layer", [])})
    gens = [(key, title) for key, title in (("generate", "generation, ~1B model"),
                                             ("generate_30b", "generation, Qwen3-30B-A3B's size"))
            if res.get(key)]
    sampling = res.get("sampling")
    panels = 1 + len(layers) + len(gens) + bool(sampling)
    cols = min(panels, 3)
    rows_ = -(-panels // cols)
    fig, grid = plt.subplots(rows_, cols, figsize=(6 * cols, 4.5 * rows_), squeeze=False)
    axes = grid.flatten()
    for ax in axes[panels:]:
        ax.set_visible(False)
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
        lines(ax, [r for r in res["layer"] if r["layer"] == name], "T",
              (("turbomoe (auto)", "auto_us"), ("few-rows GEMM", "few_rows_us"), ("grouped GEMM", "grouped_us"),
               ("dense", "dense_us"), ("plain PyTorch", "torch_us"), ("transformers", "transformers_us"),
               ("floor (weights / copy bandwidth)", "floor_us")),
              "tokens in the step", "us per layer (log)", f"decode MoE layer: {name}")
    for ax, (key, title) in zip(axes[1 + len(layers):], gens):
        lines(ax, res[key]["rows"] if isinstance(res[key], dict) else res[key], "batch",
              (("turbomoe", "turbomoe_tok_s"),
               ("transformers eager", "transformers_eager_tok_s"),
               ("transformers static cache + compile", "transformers_static_compiled_tok_s"),
               ("floor (bytes a step reads / copy bandwidth)", "floor_tok_s")),
              "batch", "tokens/s (log)", title + (f" ({res[key]['utc']} UTC)" if isinstance(res[key], dict) else ""))
    if sampling:  # a step's token choice at the largest batch: turbomoe against transformers' processors
        rows = sampling["rows"] if isinstance(sampling, dict) else sampling
        B = max(r["batch"] for r in rows)
        rows = [r for r in rows if r["batch"] == B]
        ax = axes[1 + len(layers) + len(gens)]
        for i, (label, col) in enumerate((("turbomoe", "turbomoe_us"), ("transformers' processors", "transformers_us"))):
            ax.bar([x + (i - 0.5) * 0.4 for x in range(len(rows))], [r[col] for r in rows], 0.4, label=label)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r["settings"].replace(" (", "\n(").replace(", penalty", ",\npenalty") for r in rows], fontsize=6)
        ax.set_yscale("log")
        ax.set_ylabel(f"us a step, {' / '.join(sorted({r['timing'] for r in rows}))} timing (log)")
        ax.set_title(f"a step's token choice, batch {B}, 151,936-token vocabulary")
        ax.legend(fontsize=7)
    fig.suptitle(f"{res['device']}, torch {res['torch']}; shuffle and layers {res['utc']} UTC "
                 f"(runs: the JSON's sources)", fontsize=9)
    save(fig, dst)


if __name__ == "__main__":
    cli(main, __doc__)
