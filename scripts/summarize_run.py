"""Print a recipe run's log (log.jsonl): every EVERY-th training step, the validation losses and the
summary line (tokens/s, MFU, peak GPU memory, losses); exit 1 when the run was cut off before its
summary. Used by the scripts/gpu_*.sh that run the recipes.

    python3 scripts/summarize_run.py RUN_DIR/log.jsonl [EVERY]
"""
import json
import sys


def main(path: str, every: int = 50):
    recs = [json.loads(line) for line in open(path)]
    train = [r for r in recs if r["type"] == "train"]
    for r in train[::every] + train[-1:]:
        print(f"step {r['step']:4d}  loss {r['loss']:.4f}  aux {r['aux_loss']:.3f}  load {r['expert_load']:.2f}  "
              f"tok/s {r['tokens_per_s']:,.0f}  mfu {100 * (r['mfu'] or 0):.1f}%")
    for r in recs:
        if r["type"] == "valid":
            print(f"valid step {r['step']:4d}: {r['valid_loss']:.4f}")
    summary = [r for r in recs if r["type"] == "summary"]
    if not summary:  # cut off before the end: the steps it logged
        steady = train[len(train) // 10:]
        if not steady:
            print("NO SUMMARY and no training step logged")
            sys.exit(1)
        tps = sum(r["tokens_per_s"] * r["step_time_s"] for r in steady) / sum(r["step_time_s"] for r in steady)
        print(f"NO SUMMARY (run cut off after {len(train)} steps): {tps:,.0f} tokens/s, "
              f"MFU {100 * (steady[-1]['mfu'] or 0):.1f}% (last step), train loss {train[-1]['loss']:.4f}")
        sys.exit(1)
    s = summary[-1]
    memory = f", peak memory {s['peak_memory_gib']:.1f} GiB a GPU" if s.get("peak_memory_gib") else ""
    valid = " -> ".join(f"{v:.4f}" for v in (s["valid_loss_first"], s["valid_loss_last"]) if v is not None) or "none"
    print(f"SUMMARY {s['device']} x {s['world_size']}: {s['steps_run']} steps, {s['tokens_per_s']:,.0f} tokens/s, "
          f"MFU {100 * (s['mfu'] or 0):.1f}%{memory}, train loss {s['train_loss']:.4f}, "
          f"valid loss {valid}, {s['wall_s']:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
