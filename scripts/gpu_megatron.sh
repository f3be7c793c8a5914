#!/bin/bash
# The Megatron-core integration's GPU session, in one call of the device machine (run from the tree's root):
#   bash scripts/gpu_megatron.sh [bench args...]          (one GPU: tests, then the benchmark)
#   EP=1 bash scripts/gpu_megatron.sh                     (two GPUs: the expert-parallel test, then the
#                                                          one-GPU bf16 model tests, TESTS_AFTER_EP)
# Installs the carried wheels (WHL, default .whl: megatron-core 0.16.1 and the rest), builds turbomoe's
# CUDA kernels and CUTLASS GEMM in the background while the tests run on the Triton kernels (every
# dtype, fp32 included), runs the host-sync test again on the default backends, then the benchmark.
# Logs and JSON go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/turbomoe_out}
WHL=${WHL:-.whl}
mkdir -p "$OUT"
if ls "$WHL"/megatron_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHL"/*.whl 2>&1 | tail -3
fi
export PYTHONPATH=$PWD:/tmp/site:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__, torch.cuda.get_device_name())"
date -u
if [ -n "$EP" ]; then
  TURBOMOE_BACKEND=triton TURBOMOE_GMM_BACKEND=triton timeout 220 python3 -m pytest -q -p no:cacheprovider -rfEs -s \
    tests/test_megatron_gpu.py -k expert_parallel 2>&1 | tee "$OUT/pytest_ep.log" | grep -E "rank|PASS|passed|failed|Error" | tail -30
  date -u
  TURBOMOE_BACKEND=triton TURBOMOE_GMM_BACKEND=triton timeout 60 python3 -m pytest -q -p no:cacheprovider -rfEs \
    tests/test_megatron_gpu.py -k "${TESTS_AFTER_EP:-bf16 or checkpoints}" 2>&1 | tee "$OUT/pytest_after_ep.log" | tail -8
  date -u
  exit 0
fi
python3 -c "from turbomoe import csrc; print('CUDA backend built:', csrc.available())" >"$OUT/build_cuda.log" 2>&1 &
python3 -c "from turbomoe import csrc; print('CUTLASS grouped GEMM built:', csrc.gmm_available())" >"$OUT/build_gmm.log" 2>&1 &
TURBOMOE_BACKEND=triton TURBOMOE_GMM_BACKEND=triton timeout 240 python3 -m pytest -q -p no:cacheprovider -rfEs \
  tests/test_megatron_gpu.py -k "not expert_parallel" 2>&1 | tee "$OUT/pytest.log" | tail -30
wait
cat "$OUT"/build_*.log | tail -4
date -u
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_megatron_gpu.py -k host_sync 2>&1 \
  | tee "$OUT/pytest_default_backends.log" | tail -4
date -u
timeout 240 python3 scripts/bench_megatron.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^\[" | tail -20
date -u
