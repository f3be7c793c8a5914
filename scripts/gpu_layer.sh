#!/bin/bash
# The MoE layer's GPU session, in one call of the device machine (run from the repository root):
#   [TESTS=tests/test_nn_layer.py] bash scripts/gpu_layer.sh [bench args...]
# installs the carried wheels (.whl: DeepSpeed and its pure-Python deps from ../shared/gpu-wheels.sh;
# CUTLASS's headers from `pip download --no-deps nvidia-cutlass==4.2.0.0 -d .whl`), puts ScatterMoE's
# source (.peers, ignored) on the path, runs the GPU tests of the grouped GEMM, SwiGLU and the
# layer, then the benchmark; logs, JSON and the plot go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/turbomoe_out}
mkdir -p "$OUT"
if ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl/deepspeed-*.whl .whl/hjson-*.whl .whl/pydantic-*.whl .whl/pydantic_core-*.whl \
    .whl/annotated_types-*.whl .whl/typing_inspection-*.whl .whl/nvidia_cutlass-*.whl 2>&1 | tail -3
fi
export PYTHONPATH=$PWD:/tmp/site:$PWD/.peers:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'_grouped_mm', hasattr(torch, '_grouped_mm'), torch.cuda.get_device_name())"
date -u
# The CUDA backend of the gating ops and the CUTLASS grouped GEMM build once, side by side, before
# anything times them.
python3 -c "from turbomoe import csrc; print('CUDA backend built:', csrc.available())" &
python3 -c "from turbomoe import csrc; print('CUTLASS grouped GEMM built:', csrc.gmm_available())"
wait
TESTS=${TESTS:-"tests/test_nn_layer.py tests/test_grouped_gemm.py tests/test_swiglu.py"}
timeout 300 python3 -m pytest -q -p no:cacheprovider -rfEs $TESTS \
  2>&1 | tee "$OUT/pytest.log" | grep -v "^SKIPPED.*torch._grouped_mm runs bf16" | tail -25
date -u
python3 scripts/bench_layer.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^\[" | tail -40
date -u
