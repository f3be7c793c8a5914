#!/bin/bash
# recipes/configs/1b-4gpu.yaml on a 4-GPU machine, from the repository root (carry .whl):
#   bash scripts/gpu_1b_4gpu.sh [turbomoe] [resume] [stock] [scale1] [scale2]
# each part a launcher run, logs under $OUT/<part>, a summary line each (tokens/s, MFU, peak memory):
#   turbomoe  the config as shipped on 4 GPUs (ep_size 4), STEPS steps, a checkpoint every STEPS/2
#   resume    that run's middle checkpoint continued on 2 GPUs at ep_size 2 and grad_accum 8 (the
#             same samples a step; recipes/reshard.py) to STEPS: its losses beside the 4-GPU run's
#   stock     stock DeepSpeed MoE (moe_impl deepspeed; eager: it cannot be captured), STOCK_STEPS steps
#   scale1/2  the same per-GPU batch on 1 GPU (ep_size 1) and 2 GPUs (ep_size 2), SCALE_STEPS steps
#   export    the turbomoe run's last checkpoint -> python -m turbomoe.export -> a Hugging Face directory;
#             transformers' model from it against turbomoe's read straight from the DeepSpeed files:
#             the loss of a text the run never saw, fp32, on a GPU
# Triton gating and torch's grouped GEMM unless TURBOMOE_BACKEND / TURBOMOE_GMM_BACKEND say otherwise
# (no nvcc build in the call). The standard-library corpus: a timing run, not a training run.
# Everything printed also goes to $OUT/gpu_1b_4gpu.txt; the checkpoints (~13 GB and hundreds of files
# a run) are removed at the end unless KEEP_CHECKPOINTS=1.
source scripts/gpu_env.sh
exec > >(tee "$OUT/gpu_1b_4gpu.txt") 2>&1
export TURBOMOE_BACKEND=${TURBOMOE_BACKEND:-triton} TURBOMOE_GMM_BACKEND=${TURBOMOE_GMM_BACKEND:-torch}
STEPS=${STEPS:-60} STOCK_STEPS=${STOCK_STEPS:-30} SCALE_STEPS=${SCALE_STEPS:-20} RUN_TIMEOUT=${RUN_TIMEOUT:-240}
gpu_setup
CKPT=$((STEPS / 2))
COMMON=(--config recipes/configs/1b-4gpu.yaml --set train.warmup_steps=10 --set eval.every=1000
        --set eval.batches=4 --set log.wandb=false)

run() {  # run NAME GPUS ARGS...
  local name=$1 gpus=$2
  shift 2
  rm -rf "${OUT:?}/$name"
  echo "== $name: $gpus GPUs $* ($(date -u +%T))"
  timeout "$RUN_TIMEOUT" python3 -m deepspeed.launcher.runner --num_gpus "$gpus" --no_local_rank recipes/pretrain.py \
    "${COMMON[@]}" --set log.dir="$OUT/$name" "$@" 2>&1 | tr '\r' '\n' \
    | grep -v "^\[\|it/s\]$\|FutureWarning\|return func" > "$OUT/$name.log"
  echo "exit status: ${PIPESTATUS[0]}"
  grep -i "error\|Traceback" "$OUT/$name.log" | head -5
  python3 scripts/summarize_run.py "$OUT/$name/log.jsonl" 10
}

for part in "${@:-turbomoe}"; do
  case $part in
    turbomoe) run turbomoe 4 --set train.steps="$STEPS" --set checkpoint.every="$CKPT" ;;
    resume) run resume 2 --set train.steps="$STEPS" --set moe.ep_size=2 --set train.grad_accum=8 \
              --set checkpoint.every=0 --resume "$OUT/turbomoe/checkpoints/global_step$CKPT"
            python3 - "$OUT" "$CKPT" <<'PY'
import json, sys
out, ckpt = sys.argv[1], int(sys.argv[2])
def losses(name):
    return {r["step"]: r["loss"] for r in map(json.loads, open(f"{out}/{name}/log.jsonl")) if r["type"] == "train"}
four, two = losses("turbomoe"), losses("resume")
print("step  4 GPUs (uninterrupted)  2 GPUs (resumed at step %d)  difference" % ckpt)
for s in sorted(two):
    if s in four:
        print(f"{s:4d}  {four[s]:.5f}  {two[s]:.5f}  {two[s] - four[s]:+.5f}")
PY
            ;;
    stock) run stock 4 --set train.steps="$STOCK_STEPS" --set model.moe_impl=deepspeed --set train.cuda_graph=false \
             --set checkpoint.every=0 ;;
    scale1) run scale1 1 --set train.steps="$SCALE_STEPS" --set moe.ep_size=1 --set checkpoint.every=0 ;;
    scale2) run scale2 2 --set train.steps="$SCALE_STEPS" --set moe.ep_size=2 --set checkpoint.every=0 ;;
    export) python3 -m turbomoe.export "$OUT/turbomoe" "$OUT/hf" --force 2>&1 | tail -1
            # fp32: the Triton grouped GEMM (torch's takes bf16 only)
            TURBOMOE_GMM_BACKEND=triton python3 - "$OUT" <<'PY'
import sys
import torch
import transformers
from turbomoe.export import load_run_model
out = sys.argv[1]
text = ("The lighthouse keeper counted the ships each evening, writing their names in a worn ledger. "
        "When the fog rolled in, she lit the lamp early and listened for horns across the water. ") * 4
ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(f"{out}/hf")(text)["input_ids"][:257]], device="cuda")
hf = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/hf", dtype=torch.float32).cuda().eval()
ours = load_run_model(f"{out}/turbomoe").float().cuda()
with torch.no_grad():
    a, b = hf(ids, labels=ids).loss.item(), ours(ids[:, :-1], ids[:, 1:]).loss.item()
print(f"held-out loss: transformers on the export {a:.6f}, turbomoe from the DeepSpeed files {b:.6f}, "
      f"relative difference {abs(a - b) / b:.2e}")
PY
            du -sh "$OUT/hf" ;;
    *) echo "gpu_1b_4gpu.sh: unknown part $part"; exit 2 ;;
  esac
done
[ "${KEEP_CHECKPOINTS:-0}" = 1 ] || rm -rf "$OUT"/*/checkpoints "$OUT/hf"
date -u
