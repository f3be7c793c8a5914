#!/bin/bash
# Issue 19's GPU checks in one call of the device machine (run from the repository root):
#   [STEPS=100] bash scripts/gpu_speed.sh [extra pretrain.py overrides for both runs, e.g. train.compile=false]
# installs the carried wheels, builds the CUDA backend and the CUTLASS grouped GEMM, runs the GPU
# tests of the compiled dense blocks and of the custom ops, then small-1gpu with turbomoe's and
# stock DeepSpeed's MoE layer, same steps, through the launcher (scripts/bench_recipe.py).
# Logs go to $OUT (default /tmp/turbomoe_out).
source scripts/gpu_env.sh
STEPS=${STEPS:-100}
gpu_setup
gpu_build gmm
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_compile.py tests/test_custom_ops_triton.py \
  2>&1 | tee "$OUT/pytest.log" | tail -8
date -u
sets=()
for s in "$@"; do sets+=(--set "$s"); done
python3 scripts/bench_recipe.py --config recipes/configs/small-1gpu.yaml --num-gpus 1 --steps "$STEPS" \
  --out "$OUT" "${sets[@]}" 2>&1 | tail -12
date -u
