"""MoELayer under PyTorch's own data parallelism (FSDP2's fully_shard, with activation recomputation
and with low-precision parameters; DDP) on 2 CPU ranks: tests/fsdp_script.py under torchrun, on the
reference backend and on the Triton kernels under the interpreter. Backs README "The native layer"
(its data-parallel sentence)."""
import subprocess
import sys

import pytest

from launching import RANK_VARS, ROOT, free_port, launcher_env


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fsdp2_and_ddp_match_one_unsharded_model(backend):
    env = {k: v for k, v in launcher_env(cpu=True, BACKEND=backend).items() if k not in RANK_VARS}
    if backend == "triton":
        env["TRITON_INTERPRET"] = "1"  # in the ranks, before turbomoe's kernels are defined
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "tests/fsdp_script.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("FSDP PASS") == 2, proc.stdout[-3000:]
