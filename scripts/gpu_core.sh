#!/usr/bin/env bash
# On the GPU machine, from the repo root: the core ops' test suite and the gating benchmark.
# DeepSpeed comes from wheels carried in .whl (../shared/gpu-wheels.sh .whl makes them).
source scripts/gpu_env.sh
gpu_setup
gpu_build
# Processes in parallel: most of the time is Triton compiling each specialisation on the CPU.
python3 -m pytest -q -n 16 -rf --tb=short -p no:cacheprovider tests/test_ops_triton.py tests/test_reference.py \
  tests/test_errors.py 2>&1 | tee "$OUT/pytest_core.log" | tail -15
python3 scripts/bench_gating.py --json "$OUT/bench_gating.json" 2>&1 | tee "$OUT/bench_gating.log" | tail -32
python3 scripts/profile_host.py stages 2>&1 | grep -v Warn | tail -9
