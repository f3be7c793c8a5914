#!/bin/bash
# Issue 19's GPU checks in one call of the device machine (run from the repository root):
#   [STEPS=100] bash scripts/gpu_speed.sh [extra pretrain.py overrides for both runs, e.g. train.compile=false]
# installs the carried wheels, builds the CUDA backend and the CUTLASS grouped GEMM, runs the GPU
# tests of the compiled dense blocks and of the custom ops, then small-1gpu with turbomoe's and
# stock DeepSpeed's MoE layer, same steps, through the launcher (scripts/bench_recipe.py).
# Logs go to $OUT (default /tmp/turbomoe_out).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/turbomoe_out}
STEPS=${STEPS:-100}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -3
export PYTHONPATH=$PWD:/tmp/site:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
date -u
python3 -c "from turbomoe import csrc; print('CUDA backend built:', csrc.available(), 'CUTLASS GEMM built:', csrc.gmm_available())"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_compile.py tests/test_custom_ops_triton.py \
  2>&1 | tee "$OUT/pytest.log" | tail -8
date -u
sets=()
for s in "$@"; do sets+=(--set "$s"); done
python3 scripts/bench_recipe.py --config recipes/configs/small-1gpu.yaml --num-gpus 1 --steps "$STEPS" \
  --out "$OUT" "${sets[@]}" 2>&1 | tail -12
date -u
