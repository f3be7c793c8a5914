"""The real deepspeed launcher, two ranks, expert parallelism (ep_size = 2), ZeRO-2 (and 1), save and resume.

Two launches of tests/ds_train_script.py, each reaching turbomoe without editing the script: the
first through the launcher's --module entry (turbomoe.integrations.run_with_turbomoe), the second
through the sitecustomize hook (PYTHONPATH + TURBOMOE_PATCH_DEEPSPEED=1). On the CPU the ranks talk
over gloo; with two or more GPUs, over NCCL.
"""
import json
import os

import pytest
import torch
from launching import ROOT, deepspeed_launch, launcher_env

pytest.importorskip("deepspeed")
import turbomoe.integrations as integrations  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "ds_train_script.py")
SAVE_AFTER = 3


def launch(workdir, phase, env, via_module):
    module = ["--module", "turbomoe.integrations.run_with_turbomoe"] if via_module else []
    deepspeed_launch(SCRIPT, "--phase", phase, "--workdir", workdir, env=env, launcher_args=module)
    results = []
    for rank in range(2):
        with open(os.path.join(workdir, f"result_{phase}_rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                     reason="needs 2 CUDA devices")]),
])
def test_expert_parallel_train_save_resume(tmp_path, device):
    env = launcher_env(cpu=device == "cpu")
    if device != "cpu":
        env.pop("DS_ACCELERATOR", None)
    trained = launch(tmp_path, "train", env, via_module=True)

    hook_env = dict(env, TURBOMOE_PATCH_DEEPSPEED="1",
                    PYTHONPATH=os.pathsep.join([integrations.SITECUSTOMIZE_DIR, env["PYTHONPATH"]]))
    resumed = launch(tmp_path, "resume", hook_env, via_module=False)

    for rank in range(2):
        for result in (trained[rank], resumed[rank]):
            assert result["patched"] and result["layer_types"] == ["turbomoe.integrations.deepspeed"]
            # ZeRO-2's flat buffers keep each rank's experts in module order: grouped GEMMs without a copy.
            assert result["expert_weights_are_views"]
            assert result["grouped_experts"]  # the engine adds no hooks that would turn the fast path off
        # turbomoe vs stock layers on the same weights over the expert-parallel group.
        for case, err in trained[rank]["ep_fidelity"].items():
            assert err < 1e-4, (rank, case, err)
        # ZeRO stage 1 trains the same model to the same losses as stage 2.
        assert trained[rank]["zero1_losses"] == pytest.approx(trained[rank]["losses"][:2], rel=1e-5, abs=1e-6)
        # Every parameter of every rank (its local experts included) survives the round trip,
        # and training continues with the losses of the uninterrupted run.
        assert resumed[rank]["resumed_param_diff"] == 0.0
        assert resumed[rank]["losses"] == pytest.approx(trained[rank]["losses"][SAVE_AFTER:], rel=1e-5, abs=1e-6)
        # Checkpoints cross over between stock DeepSpeed and turbomoe, both ways.
        assert resumed[rank]["turbomoe_into_stock_diff"] == 0.0
        assert resumed[rank]["stock_into_turbomoe_diff"] == 0.0
    for tag in ("turbomoe", "stock"):
        expert_files = sorted(f for f in os.listdir(tmp_path / "ckpt" / tag) if f.startswith("layer_"))
        assert expert_files == [f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"
                                for layer in range(2) for e in range(4)]
