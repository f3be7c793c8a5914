#!/bin/bash
# The pretraining recipe on one GPU (run from the repository root, under 7 minutes on an H100):
#   bash scripts/gpu_recipes.sh [extra pretrain.py args, e.g. --set train.steps=200]
# installs the carried wheels (.whl: DeepSpeed and its deps), trains small-1gpu for STEPS steps
# (default 300) through the deepspeed launcher, and prints tokens/s, MFU and the losses last.
# Logs go to $OUT (default /tmp/turbomoe_out).
source scripts/gpu_env.sh
STEPS=${STEPS:-300}
RUN=$OUT/small-1gpu
gpu_setup
python3 -c "import yaml, tqdm, deepspeed" || { echo "gpu_recipes.sh: pretrain.py needs pyyaml, tqdm and deepspeed"; exit 1; }
rm -rf "$RUN"
# The launcher's own entry point (python -m), since --target installs leave no `deepspeed` on PATH.
timeout 330 python3 -m deepspeed.launcher.runner --num_gpus 1 recipes/pretrain.py \
  --config recipes/configs/small-1gpu.yaml --set train.steps="$STEPS" --set eval.every=100 \
  --set checkpoint.every=0 --set log.wandb=false --set log.dir="$RUN" "$@" 2>&1 \
  | tr '\r' '\n' | grep -v "^\[\|it/s\]$\|FutureWarning\|return func" | tee "$OUT/pretrain.log" | tail -25
echo "exit status: ${PIPESTATUS[0]}"
date -u
ls -la "$RUN/checkpoints"/global_step* 2>/dev/null | head -5
python3 - "$RUN/log.jsonl" <<'PY'
import json, sys
recs = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in recs if r["type"] == "train"]
for r in train[::50] + train[-1:]:
    print(f"step {r['step']:4d}  loss {r['loss']:.4f}  aux {r['aux_loss']:.3f}  load {r['expert_load']:.2f}  "
          f"tok/s {r['tokens_per_s']:,.0f}  mfu {100 * (r['mfu'] or 0):.1f}%")
for r in recs:
    if r["type"] == "valid":
        print(f"valid step {r['step']:4d}: {r['valid_loss']:.4f}")
summary = [r for r in recs if r["type"] == "summary"]
if not summary:  # cut off before the end: the steps it logged
    steady = train[len(train) // 10:]
    tps = sum(r["tokens_per_s"] * r["step_time_s"] for r in steady) / sum(r["step_time_s"] for r in steady)
    print(f"NO SUMMARY (run cut off after {len(train)} steps): {tps:,.0f} tokens/s, "
          f"MFU {100 * (steady[-1]['mfu'] or 0):.1f}% (last step), train loss {train[-1]['loss']:.4f}")
    sys.exit(1)
s = summary[-1]
print(f"SUMMARY {s['device']}: {s['steps_run']} steps, {s['tokens_per_s']:,.0f} tokens/s, "
      f"MFU {100 * (s['mfu'] or 0):.1f}%, train loss {s['train_loss']:.4f}, "
      f"valid loss {s['valid_loss_first']:.4f} -> {s['valid_loss_last']:.4f}, {s['wall_s']:.0f} s")
PY
