"""tests/test_errors.py once more in the Triton interpreter's process, where its backend list also
holds "triton" (TRITON_INTERPRET=1 must be set before turbomoe's kernels are defined)."""
import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 (scripts/test.sh runs tests/*_triton.py so)", allow_module_level=True)

from test_errors import *  # noqa: E402,F401,F403  (the same tests, parametrized over this process's backends)
