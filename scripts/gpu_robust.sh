#!/usr/bin/env bash
# Issue #20 on the GPU machine, from the repository root: builds the CUDA backend (a failed build
# fails the cuda tests, see tests/conftest.py require_cuda_backend), then runs the tests the
# robustness fixes touch with the cuda and triton backends, and the random sweep at GPU size.
#   [SWEEP_CASES=400] [TEST_TIMEOUT=60] bash scripts/gpu_robust.sh     logs under $OUT
set -o pipefail
OUT=${OUT:-/tmp/turbomoe_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
date -u
# Built once here, before the test processes start (they would wait on its lock).
( time python3 -c "from turbomoe import csrc; csrc.extension(); print('CUDA backend built')" ) 2>&1 | tail -4
# In parallel (Triton compiles on the CPU): the edge rules, argument errors and bare-slots rule on
# every backend, the kernels' gating (its backward changed) and edge cases against the reference;
# and the sweep at GPU size on both kernel backends (-s prints how many cases ran).
timeout ${TEST_TIMEOUT:-60} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -n 10 \
  tests/test_robustness_triton.py tests/test_errors.py "tests/test_ops_triton.py::test_edge_cases_finite" \
  "tests/test_ops_triton.py::test_gradcheck_autograd_functions" "tests/test_ops_triton.py::test_arbitrary_logit_bits" \
  > "$OUT/pytest_robust.log" 2>&1 &
TURBOMOE_SWEEP_CASES=${SWEEP_CASES:-400} TURBOMOE_SWEEP_SECONDS=$((${TEST_TIMEOUT:-60} - 12)) TURBOMOE_SWEEP_SIZE=gpu timeout ${TEST_TIMEOUT:-60} python3 -m pytest -q -s \
  -p no:cacheprovider -rfE --tb=short tests/test_sweep_triton.py > "$OUT/pytest_sweep.log" 2>&1
wait
tail -12 "$OUT/pytest_robust.log"
grep -E "sweep:|passed|failed|FAILED|Error" "$OUT/pytest_sweep.log" | tail -12
date -u
