#!/usr/bin/env bash
# The DeepSpeed drop-in's GPU session, run from the repository root:
#   bash scripts/gpu_deepspeed.sh [bench_deepspeed.py args...]
# Installs the carried wheels (.whl: DeepSpeed and its pure-Python deps), runs the fidelity tests
# (CPU and CUDA) and the expert-parallel launcher test over NCCL (skipped below 2 GPUs), then the
# stock-vs-turbomoe benchmark. Logs and JSON go to $OUT; the short table is printed last.
source scripts/gpu_env.sh
gpu_setup  # /tmp/site/bin on PATH: the deepspeed launcher, for tests/test_deepspeed_launcher.py
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)"
gpu_build
# Every fidelity test (CPU and CUDA); of the launcher tests only the NCCL one (CI runs the gloo one).
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_deepspeed_fidelity.py \
  "tests/test_deepspeed_launcher.py::test_expert_parallel_train_save_resume[cuda]" \
  2>&1 | tee "$OUT/pytest_deepspeed.log" | tail -25
date -u
timeout 420 python3 scripts/bench_deepspeed.py --json "$OUT/bench_deepspeed.json" "$@" 2>&1 \
  | tee "$OUT/bench_deepspeed.log" | grep -v "^\[\|^{" | tail -3
date -u
echo "== summary =="
grep -E "passed|failed|error" "$OUT/pytest_deepspeed.log" | tail -1
grep -B1 -A6 "^  E  k" "$OUT/bench_deepspeed.log"
