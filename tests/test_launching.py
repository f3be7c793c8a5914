"""tests/launching.py's deepspeed_launch: a rank killed by a signal reruns the launch once (with a
warning), a crash that repeats fails, and a Python error fails without a rerun."""
import os

import pytest
from launching import deepspeed_launch, launcher_env

pytest.importorskip("deepspeed")

# Rank 1 aborts on the first `aborts` launches (a count kept in a file), then both ranks succeed.
SCRIPT = """
import os, sys
count_file, aborts, fail = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
aborts, fail = int(aborts), fail == "1"
if os.environ["RANK"] == "1":
    n = int(open(count_file).read()) if os.path.exists(count_file) else 0
    open(count_file, "w").write(str(n + 1))
    if fail:
        raise ValueError("a wrong result")
    if n < aborts:
        os.abort()
"""


def launch(tmp_path, aborts, fail=False):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    count = tmp_path / "launches"
    proc = deepspeed_launch(str(script), count, aborts, int(fail), env=launcher_env(cpu=True), timeout=120,
                            check=False)
    return proc.returncode, int(count.read_text())


def test_a_crash_once_reruns(tmp_path):
    with pytest.warns(UserWarning, match="died of a signal; running it once more"):
        assert launch(tmp_path, aborts=1) == (0, 2)


def test_a_repeated_crash_fails(tmp_path):
    with pytest.warns(UserWarning, match="died of a signal"):
        rc, launches = launch(tmp_path, aborts=2)
    assert rc != 0 and launches == 2


def test_a_python_error_is_not_rerun(tmp_path):
    rc, launches = launch(tmp_path, aborts=0, fail=True)
    assert rc != 0 and launches == 1
