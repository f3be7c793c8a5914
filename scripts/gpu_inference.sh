#!/bin/bash
# The inference GPU session, in one call of the device machine (run from the repository root):
#   [TESTS="tests/test_inference.py ..."] bash scripts/gpu_inference.sh [bench args...]
# installs the carried wheels (.whl: CUTLASS's headers; .whl_fbgemm: FBGEMM's gen_ai kernels, the
# index-shuffling peer), builds the CUDA extension and the CUTLASS grouped GEMM once, runs the GPU
# tests of the inference ops, then scripts/bench_inference.py; logs and JSON go to $OUT.
source scripts/gpu_env.sh
gpu_setup "${WHL:-.whl}"
gpu_need transformers cutlass_library
gpu_build gmm
TESTS=${TESTS:-"tests/test_inference.py tests/test_inference_triton.py tests/test_engine.py"}
timeout 300 python3 -m pytest -q -p no:cacheprovider -rfEs $TESTS 2>&1 | tee "$OUT/pytest.log" | tail -25
date -u
python3 scripts/bench_inference.py --out "$OUT" "$@" 2>&1 | tail -80
date -u
