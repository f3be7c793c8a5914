"""MoELayer under PyTorch's own data parallelism (FSDP2's fully_shard, with activation recomputation
and with low-precision parameters, its sharded state through torch.distributed.checkpoint; DDP) on 2 CPU
ranks: tests/fsdp_script.py under the deepspeed launcher (which reruns a rank killed by a signal: torch
2.13's gloo aborts at exit at times), on the reference backend and on the Triton kernels under the
interpreter. Backs README "Native layer" (its data-parallel sentence)."""
import os

import pytest

from launching import deepspeed_launch, launcher_env


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fsdp2_and_ddp_match_one_unsharded_model(backend, tmp_path):
    extra = dict(BACKEND=backend, TRITON_INTERPRET="1") if backend == "triton" else dict(BACKEND=backend)
    proc = deepspeed_launch(os.path.join("tests", "fsdp_script.py"), tmp_path / "checkpoint",
                            env=launcher_env(cpu=True, **extra), timeout=600)
    assert proc.stdout.count("FSDP PASS") == 2, proc.stdout[-3000:]
