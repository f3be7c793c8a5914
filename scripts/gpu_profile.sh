#!/bin/bash
# The recipe's step profile and the fusion micro-benchmark, in one call of the GPU machine (run from
# the repository root):
#   [CONFIG=recipes/configs/X.yaml] [NGPUS=N] [BUILD=gmm|none] [FUSIONS=1|0] [PROFILE_ARGS=--host-profile] bash scripts/gpu_profile.sh [variant ...]
# Each variant is a space-separated list of pretrain.py overrides (quoted), profiled in its own
# process by scripts/profile_recipe.py (NGPUS > 1: under the deepspeed launcher, one rank a GPU); the
# default: the recipe as before issue 19's changes (unfused AdamW, the log reading the device every
# step) and as configured now. BUILD=none builds nothing and runs turbomoe's Triton gating and torch's
# grouped GEMM (minutes of device time saved where the MoE kernels are not what is being looked at).
# Logs go to $OUT (default /tmp/turbomoe_out).
source scripts/gpu_env.sh
gpu_setup
CONFIG=${CONFIG:-recipes/configs/small-1gpu.yaml}
NGPUS=${NGPUS:-1}
BUILD_PID=
if [ "${BUILD:-gmm}" = none ]; then
  export TURBOMOE_BACKEND=triton TURBOMOE_GMM_BACKEND=torch
else
  # The CUDA backend and the CUTLASS grouped GEMM build (CPU) while the fusion benchmark runs (GPU).
  gpu_build "${BUILD:-gmm}" > "$OUT/build.log" 2>&1 &
  BUILD_PID=$!
fi
[ "${FUSIONS:-1}" = 1 ] && python3 scripts/bench_fusions.py 2>&1 | grep -v "^\[\|Warning" | tee "$OUT/bench_fusions.log" | tail -12
if [ -n "$BUILD_PID" ]; then
  wait $BUILD_PID
  tail -3 "$OUT/build.log"
fi
if [ "$NGPUS" -gt 1 ]; then
  run=(python3 -m deepspeed.launcher.runner --num_gpus "$NGPUS" --no_local_rank scripts/profile_recipe.py)
else
  run=(python3 scripts/profile_recipe.py)
fi
if [ $# -eq 0 ]; then
  set -- "train.fused_adamw=false log.every=1" ""
fi
for variant in "$@"; do
  args=()
  for s in $variant; do args+=(--set "$s"); done
  timeout ${RUN_TIMEOUT:-150} "${run[@]}" --config "$CONFIG" --label "${variant:-as configured}" \
    --warmup ${WARMUP:-4} --steps ${STEPS:-10} --profile-steps ${PROFILE_STEPS:-2} --top ${TOP:-25} ${PROFILE_ARGS:-} "${args[@]}" 2>&1 \
    | grep -v "^\[\|FutureWarning\|warnings.warn" | tee -a "$OUT/profile.log" | grep -A 4 "^## \|Error\|error:"
done
date -u
