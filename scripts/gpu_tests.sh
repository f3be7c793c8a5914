#!/usr/bin/env bash
# The GPU tests of the whole suite on the device machine (from the repository root; SHARD splits them over calls):
#   [TESTS="tests/test_a.py ..." | ALL=1] [SHARD=i/n] [TEST_TIMEOUT=s] [PROCS=16] bash scripts/gpu_tests.sh    logs under $OUT
# SHARD: every n-th test from the i-th (tests/conftest.py). The whole GPU suite (build ~105 s, tests ~490 s
# in 16 processes on one H200, 2026-11-28) no longer fits one 10-minute call: run SHARD=1/2, then 2/2.
# installs the carried wheels (.whl: DeepSpeed, megatron-core from ../shared/gpu-wheels.sh, CUTLASS's headers,
# transformers and pytest-xdist from scripts/gpu_wheels_extra.sh; .whl_fbgemm if
# carried), builds the CUDA backend and the CUTLASS grouped GEMM side by side (once, before the test
# processes start: they would wait on the build lock), then runs the test files that hold GPU tests,
# natively (Triton kernels too), in 16 processes. A failed CUDA build fails the cuda tests
# (tests/conftest.py require_cuda_backend).
source scripts/gpu_env.sh
gpu_setup
gpu_need transformers deepspeed megatron.core cutlass_library xdist
gpu_build gmm
# Every file with GPU tests except the launcher ones (CPU ranks over gloo; CI runs them). ALL=1: every
# file but those, the CPU-only ones too: they then run on this machine's torch, which CI's is not
# (2026-11-28: compiled CPU tests green on CI's torch 2.13 failed on the device's 2.11).
if [ -n "${ALL:-}" ]; then
  TESTS=${TESTS:-$(ls tests/test_*.py | grep -v launcher)}
else
  TESTS=${TESTS:-$(grep -l "needs_cuda\|mark.gpu\|cuda.is_available()\|HAS_CUDA" tests/test_*.py | grep -v launcher)}
fi
# -v: a line per test as it ends, so the names of failures are in the log even when the timeout cuts
# the run before pytest's summary (2026-11-23: a run cut at 370 s showed 9 failures by dots only).
# The tests end within the device call's 600 s whatever the build took (2026-11-29: a fresh machine's
# build took 146 s and the call's limit cut a TEST_TIMEOUT of 470 with no summary), by SIGINT, on
# which pytest still prints the failures' tracebacks and its summary.
limit=$(( 570 - SECONDS )); limit=$(( ${TEST_TIMEOUT:-600} < limit ? ${TEST_TIMEOUT:-600} : limit ))
TURBOMOE_TEST_SHARD=${SHARD:-} timeout -s INT -k 15 $limit \
  python3 -m pytest -v -n ${PROCS:-16} -p no:cacheprovider -rfE --tb=short $TESTS > "$OUT/pytest_gpu.log" 2>&1
echo "pytest exit status: $? (124: cut after $limit s)"
grep -E "^\[gw[0-9]+\].* (FAILED|ERROR) " "$OUT/pytest_gpu.log" | sed 's/^\[gw[0-9]*\] *\[ *[0-9]*%\] *//' | sort | head -40
echo "passed: $(grep -cE '^\[gw[0-9]+\].* PASSED ' "$OUT/pytest_gpu.log"), failed: $(grep -cE '^\[gw[0-9]+\].* FAILED ' \
  "$OUT/pytest_gpu.log"), skipped: $(grep -cE '^\[gw[0-9]+\].* SKIPPED ' "$OUT/pytest_gpu.log")"
tail -3 "$OUT/pytest_gpu.log"
cat "$OUT/missing.txt" 2>/dev/null  # skipped for a missing package, not passed
date -u
