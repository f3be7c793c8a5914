#!/bin/bash
# The Megatron-core integration's GPU session, in one call of the device machine (run from the tree's root):
#   bash scripts/gpu_megatron.sh [bench args...]          (one GPU: tests, then the benchmark)
#   EP=1 bash scripts/gpu_megatron.sh                     (two GPUs: the expert-parallel and training-step tests, then the
#                                                          one-GPU bf16 model tests, TESTS_AFTER_EP)
#   TE=1 ...                                              (either, with Transformer Engine from the carried .te:
#                                                          scripts/gpu_te_wheels.sh; its tests run too)
# Installs the carried wheels (WHL, default .whl: megatron-core 0.16.1 and the rest), builds turbomoe's
# CUDA kernels and CUTLASS GEMM in the background while the tests run on the Triton kernels (every
# dtype, fp32 included), runs the host-sync test again on the default backends, then the benchmark.
# Logs and JSON go to $OUT.
source scripts/gpu_env.sh
gpu_setup "${WHL:-.whl}"
python3 -c "import megatron.core as m; print('megatron-core', m.__version__)"
if [ -n "${TE:-}" ]; then gpu_te || exit 1; fi
if [ -n "${EP:-}" ]; then  # the two-GPU tests: expert parallelism, and Megatron's training step at tp 2 / dp 2
  TURBOMOE_BACKEND=triton TURBOMOE_GMM_BACKEND=triton timeout 330 python3 -m pytest -q -p no:cacheprovider -rfEs -s \
    tests/test_megatron_gpu.py -k two_gpus 2>&1 | tee "$OUT/pytest_ep.log" | grep -E "rank|PASS|LOSSES|passed|failed|Error" | tail -30
  date -u
  TURBOMOE_BACKEND=triton TURBOMOE_GMM_BACKEND=triton timeout 60 python3 -m pytest -q -p no:cacheprovider -rfEs \
    tests/test_megatron_gpu.py -k "${TESTS_AFTER_EP:-bf16 or checkpoints}" 2>&1 | tee "$OUT/pytest_after_ep.log" | tail -8
  date -u
  exit 0
fi
gpu_build gmm > "$OUT/build.log" 2>&1 &  # while the tests run on the Triton kernels
TURBOMOE_BACKEND=triton TURBOMOE_GMM_BACKEND=triton timeout 240 python3 -m pytest -q -p no:cacheprovider -rfEs \
  tests/test_megatron_gpu.py -k "not two_gpus" 2>&1 | tee "$OUT/pytest.log" | tail -30
wait
tail -4 "$OUT/build.log"
date -u
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_megatron_gpu.py -k host_sync 2>&1 \
  | tee "$OUT/pytest_default_backends.log" | tail -4
date -u
timeout 240 python3 scripts/bench_megatron.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^\[" | tail -20
date -u
