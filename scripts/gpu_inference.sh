#!/bin/bash
# The inference GPU session, in one call of the device machine (run from the repository root):
#   [TESTS="tests/test_inference.py ..."] bash scripts/gpu_inference.sh [bench args...]
# installs the carried wheels (.whl: CUTLASS's headers; .whl_fbgemm: FBGEMM's gen_ai kernels, the
# index-shuffling peer), builds the CUDA extension and the CUTLASS grouped GEMM once, runs the GPU
# tests of the inference ops, then scripts/bench_inference.py; logs and JSON go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/turbomoe_out}
mkdir -p "$OUT"
WHL=${WHL:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $WHL/nvidia_cutlass-*.whl \
  $WHL/deepspeed-*.whl $WHL/hjson-*.whl $WHL/pydantic-*.whl $WHL/pydantic_core-*.whl $WHL/annotated_types-*.whl \
  $WHL/typing_inspection-*.whl $(ls ${WHL}_fbgemm/*.whl 2>/dev/null) 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=$PWD:$PWD/tests:/tmp/site:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())"
date -u
python3 -c "from turbomoe import csrc; print('CUDA backend built:', csrc.available())" &
python3 -c "from turbomoe import csrc; print('CUTLASS grouped GEMM built:', csrc.gmm_available())"
wait
TESTS=${TESTS:-"tests/test_inference.py tests/test_inference_triton.py tests/test_engine.py"}
timeout 300 python3 -m pytest -q -p no:cacheprovider -rfEs $TESTS 2>&1 | tee "$OUT/pytest.log" | tail -25
date -u
python3 scripts/bench_inference.py --out "$OUT" "$@" 2>&1 | tail -80
date -u
