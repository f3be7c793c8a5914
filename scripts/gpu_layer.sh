#!/bin/bash
# The MoE layer's GPU session, in one call of the device machine (run from the repository root):
#   [TESTS=tests/test_nn_layer.py] bash scripts/gpu_layer.sh [bench args...]
# installs the carried wheels (.whl: DeepSpeed and its pure-Python deps from ../shared/gpu-wheels.sh;
# CUTLASS's headers from `pip download --no-deps nvidia-cutlass==4.2.0.0 -d .whl`), puts ScatterMoE's
# source (.peers, ignored) on the path, runs the GPU tests of the grouped GEMM, SwiGLU and the
# layer, then the benchmark; logs, JSON and the plot go to $OUT.
source scripts/gpu_env.sh
gpu_setup
export PYTHONPATH=$PYTHONPATH:$PWD/.peers  # ScatterMoE's source, the peer
python3 -c "import torch; print('_grouped_mm', hasattr(torch, '_grouped_mm'))"
gpu_build gmm
TESTS=${TESTS:-"tests/test_nn_layer.py tests/test_grouped_gemm.py tests/test_swiglu.py"}
timeout 300 python3 -m pytest -q -p no:cacheprovider -rfEs $TESTS \
  2>&1 | tee "$OUT/pytest.log" | grep -v "^SKIPPED.*torch._grouped_mm runs bf16" | tail -25
date -u
python3 scripts/bench_layer.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^\[" | tail -40
date -u
