# Sourced by the scripts/gpu_*.sh on the device machine, from the repository root: what they share.
#   gpu_setup [WHEEL_DIR]  the carried wheels (WHEEL_DIR, default .whl, and .whl_fbgemm when carried)
#                          into /tmp/site; the tree, tests/ and /tmp/site on PYTHONPATH, /tmp/site/bin on
#                          PATH (the deepspeed launcher); prints the GPU, torch and triton, and the time
#   gpu_te [DIR]           Transformer Engine from the carried DIR (default .te, made here by
#                          scripts/gpu_te_wheels.sh): its wheels into /tmp/site, then transformer-engine-torch
#                          built against this machine's torch (no wheel is published); log in $OUT/te_build.log
#   gpu_need MODULE...     says loudly (and into $OUT/missing.txt) which modules do not import: the tests
#                          that need them skip rather than fail (scripts/gpu_wheels_extra.sh fetches them)
#   gpu_build [gmm]        turbomoe's CUDA backend (and with gmm the CUTLASS grouped GEMM, side by side)
#                          built once, before test processes or timings start (they would wait on the
#                          build's lock, or time it). A failed build fails the cuda tests (tests/conftest.py).
# OUT (default /tmp/turbomoe_out) is made; logs go there.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/turbomoe_out}
mkdir -p "$OUT"

gpu_setup() {
  local whl=${1:-.whl}
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$whl"/*.whl \
    $(ls "${whl}_fbgemm"/*.whl 2>/dev/null) 2>&1 | grep -v "already exists" | tail -3
  export PYTHONPATH=$PWD:$PWD/tests:/tmp/site:${PYTHONPATH:-}
  export PATH=/tmp/site/bin:$PATH
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'gpus', torch.cuda.device_count(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
  date -u
}

gpu_build() {
  python3 -c "from turbomoe import csrc; print('CUDA backend built:', csrc.available())" &
  if [ "${1:-}" = gmm ]; then
    python3 -c "from turbomoe import csrc; print('CUTLASS grouped GEMM built:', csrc.gmm_available())"
  fi
  wait
  date -u
}

gpu_te() {
  local te=${1:-.te} inc=/tmp/cudnn_frontend cudnn
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$te"/*.whl 2>&1 \
    | grep -v "already exists" | tail -3
  mkdir -p $inc && tar xzf "$te"/cudnn_frontend_include.tar.gz -C $inc
  cudnn=$(python3 -c "import nvidia, pathlib; print(next(p.parent for d in nvidia.__path__ for p in pathlib.Path(d).rglob('cudnn.h')))")
  # FORCE_BUILD: no download of a prebuilt extension (this machine is offline); sm_90 only, 16 jobs
  CPLUS_INCLUDE_PATH=$inc/include:$cudnn NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=90 MAX_JOBS=16 \
    python3 -m pip install --no-index --no-deps --no-build-isolation --no-compile --target /tmp/te_torch \
    "$te"/transformer_engine_torch-*.tar.gz > "$OUT/te_build.log" 2>&1 || { tail -30 "$OUT/te_build.log"; return 1; }
  cp -r /tmp/te_torch/. /tmp/site/  # merged: its .so goes into the transformer_engine/ the wheels made
  python3 -c "import transformer_engine as te, transformer_engine.pytorch; print('transformer-engine', te.__version__)"
  date -u
}

gpu_need() {
  local missing="" m
  for m in "$@"; do python3 -c "import $m" > /dev/null 2>&1 || missing="$missing $m"; done
  if [ -n "$missing" ]; then
    echo "WARNING: does not import here:$missing; the tests that need it SKIP (carry the wheels of scripts/gpu_wheels_extra.sh)" \
      | tee -a "$OUT/missing.txt"
  fi
}
