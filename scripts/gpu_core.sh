#!/usr/bin/env bash
# On the GPU machine, from the repo root: the core ops' test suite and the gating benchmark.
# DeepSpeed comes from wheels carried in .whl (../shared/gpu-wheels.sh .whl makes them).
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# The CUDA backend builds once here, before the test processes start (they would wait on its lock).
( time python3 -c "from turbomoe import csrc; csrc.extension(); print('CUDA backend built')" ) 2>&1 | tail -4
# Processes in parallel: most of the time is Triton compiling each specialisation on the CPU.
python3 -m pytest -q -n 16 -rf --tb=short -p no:cacheprovider tests/test_ops_triton.py tests/test_reference.py \
  tests/test_errors.py 2>&1 | tee "$OUT/pytest_core.log" | tail -15
python3 scripts/bench_gating.py --json "$OUT/bench_gating.json" 2>&1 | tee "$OUT/bench_gating.log" | tail -32
python3 scripts/profile_host.py stages 2>&1 | grep -v Warn | tail -9
