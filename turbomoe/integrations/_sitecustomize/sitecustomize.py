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

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_shadowed_sitecustomize() -> None:
    """Putting this folder on PYTHONPATH hides any other sitecustomize; run the next one found."""
    rest = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_run_shadowed_sitecustomize()
if os.environ.get("TURBOMOE_PATCH_DEEPSPEED") == "1":
    from turbomoe.integrations.deepspeed import patch

    patch()
