"""tests/test_deepspeed_fidelity.py's single-process cases again with every op on the triton backend
(TURBOMOE_BACKEND=triton: the kernels under TRITON_INTERPRET=1 on the CPU, natively on a GPU), so the
drop-in's fused Triton paths are checked against stock end to end, not only kernel by kernel. The
interpreter's RuntimeWarnings (a division by zero in a kernel's index arithmetic, even masked) fail."""
import pytest

pytest.importorskip("deepspeed")
from test_deepspeed_fidelity import *  # noqa: E402,F401,F403 (collected here again, on triton)

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setenv("TURBOMOE_BACKEND", "triton")
