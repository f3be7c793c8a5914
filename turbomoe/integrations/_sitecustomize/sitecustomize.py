"""Patch DeepSpeed's MoE into turbomoe's at interpreter start, for scripts one cannot edit.

    export PYTHONPATH=$(python -c "import turbomoe.integrations as i; print(i.SITECUSTOMIZE_DIR)"):$PYTHONPATH
    export TURBOMOE_PATCH_DEEPSPEED=1

Every Python process that inherits this environment (the deepspeed launcher's ranks included)
runs turbomoe.integrations.deepspeed.patch() before the user's code. Without the variable it only
hands over to the sitecustomize it shadows.
"""
import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))


def _run_shadowed_sitecustomize() -> None:
    """Putting this folder on PYTHONPATH hides any other sitecustomize; run the next one found (this
    folder skipped under every name: a link to it would run this file again, and again)."""
    rest = [p for p in sys.path if os.path.realpath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_run_shadowed_sitecustomize()
_FLAG = os.environ.get("TURBOMOE_PATCH_DEEPSPEED", "")
if _FLAG == "1":
    from turbomoe.integrations.deepspeed import patch

    patch()
elif _FLAG not in ("", "0"):  # said, not ignored: the run would train on stock DeepSpeed unawares
    print(f"turbomoe: TURBOMOE_PATCH_DEEPSPEED must be 1 or 0, got {_FLAG!r}: DeepSpeed's MoE is not patched",
          file=sys.stderr)
