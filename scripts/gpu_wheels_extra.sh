#!/usr/bin/env bash
# The wheels the offline GPU machine needs beyond ../shared/gpu-wheels.sh (DeepSpeed, megatron-core):
# CUTLASS's headers (the grouped GEMM), transformers and its pure-Python dependencies (the inference
# engine's, the transformers integration's and the HF bridge's tests import it, and skip without it),
# kernels (transformers 5.25's from_pretrained turns hub kernels on by default and raises without the
# package), pytest-xdist (scripts/gpu_tests.sh runs 16 processes). Each at the version installed in this (CPU)
# environment, so that both machines test against the same packages.
#   bash scripts/gpu_wheels_extra.sh [DIR]      (default .whl; run inside the project's .venv)
set -euo pipefail
dir=${1:-.whl}
mkdir -p "$dir"
pkgs=(nvidia-cutlass==4.2.0.0 pytest-xdist==3.8.0 execnet==2.1.2)  # the last two: GPU machine only
for p in transformers kernels tomlkit huggingface_hub tokenizers safetensors regex hf-xet httpx2 httpcore2 truststore h11 anyio \
         idna sniffio certifi typer annotated-doc rich markdown-it-py mdurl pygments shellingham click pyyaml tqdm \
         packaging typing-extensions; do
  v=$(python3 -c "import importlib.metadata as m; print(m.version('$p'))" 2>/dev/null) \
    || { echo "gpu_wheels_extra.sh: $p is not installed in this environment (pip install -e '.[dev]' first)" >&2; exit 1; }
  pkgs+=("$p==$v")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dir" "${pkgs[@]}"
du -sh "$dir"
