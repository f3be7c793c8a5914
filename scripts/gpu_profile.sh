#!/bin/bash
# The recipe's step profile and the fusion micro-benchmark, in one call of the GPU machine (run from
# the repository root):
#   bash scripts/gpu_profile.sh [variant ...]
# Each variant is a space-separated list of pretrain.py overrides (quoted), profiled in its own
# process by scripts/profile_recipe.py; the default: the recipe as before issue 19's changes
# (unfused AdamW, the log reading the device every step) and as configured now.
# Logs go to $OUT (default /tmp/turbomoe_out).
source scripts/gpu_env.sh
gpu_setup
# The CUDA backend and the CUTLASS grouped GEMM build (CPU) while the fusion benchmark runs (GPU).
gpu_build gmm > "$OUT/build.log" 2>&1 &
BUILD=$!
python3 scripts/bench_fusions.py 2>&1 | grep -v "^\[\|Warning" | tee "$OUT/bench_fusions.log" | tail -12
wait $BUILD
cat "$OUT/build.log" | tail -3
if [ $# -eq 0 ]; then
  set -- "train.fused_adamw=false log.every=1" ""
fi
for variant in "$@"; do
  args=()
  for s in $variant; do args+=(--set "$s"); done
  timeout 150 python3 scripts/profile_recipe.py --config recipes/configs/small-1gpu.yaml --label "${variant:-as configured}" \
    --warmup ${WARMUP:-4} --steps ${STEPS:-10} --profile-steps 2 "${args[@]}" 2>&1 \
    | grep -v "^\[\|FutureWarning\|warnings.warn" | tee -a "$OUT/profile.log" | grep -A 4 "^## "
done
date -u
