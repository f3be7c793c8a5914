#!/usr/bin/env bash
# The test suite, as CI runs it. Triton kernels run natively on a GPU; on the CPU the files named
# tests/*_triton.py run in a second process under TRITON_INTERPRET=1 (read when kernels are
# decorated, so it cannot be switched on inside one pytest process).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q tests --ignore-glob='tests/*_triton.py' "$@"
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  python -m pytest -q tests/*_triton.py "$@"
else
  TRITON_INTERPRET=1 python -m pytest -q tests/*_triton.py "$@"
fi
