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
python3 scripts/summarize_run.py "$RUN/log.jsonl" 50
