"""RunCheckpoint.check_files, which --resume runs before any work: every file DeepSpeed's load will read
is there and whole, on a tag laid out as a 2-rank, ep_size 2 tiny-cpu run writes it (the files' tensors
left out: only their presence and zip directories are read)."""
import json
import os
import sys

import pytest
import torch
from launching import ROOT

pytest.importorskip("deepspeed")
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import pretrain  # noqa: E402
from recipe_config import ConfigError, load_config  # noqa: E402

from turbomoe.export import COMPLETE, ExportError, RunCheckpoint  # noqa: E402

TINY = os.path.join(ROOT, "recipes", "configs", "tiny-cpu.yaml")


def fake_tag(tmp_path, zero_stage):
    """global_step4 of a 2-rank, ep_size 2 tiny-cpu run at zero_stage: the file names DeepSpeed writes."""
    cfg = load_config(TINY, [f"train.zero_stage={zero_stage}", "log.wandb=false"])
    tag = tmp_path / "checkpoints" / "global_step4"
    tag.mkdir(parents=True)
    torch.save({"module": {}}, tag / "mp_rank_00_model_states.pt")
    for layer in range(len(cfg.model.moe_layers())):
        for expert in range(cfg.model.num_experts):
            torch.save({}, tag / f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt")
    for rank in (0, 1):  # ZeRO 1/2: each rank's partition; stage 0: each expert-parallel rank's whole state
        name = "expp_rank" if zero_stage == 0 else "zero_pp_rank"
        torch.save({}, tag / f"{name}_{rank}_mp_rank_00_optim_states.pt")
    (tag / COMPLETE).write_text(json.dumps({"step": 4, "world_size": 2, "config": cfg.to_dict()}))
    return tag


def test_stage_0_optimizer_states_checked_before_a_resume(tmp_path, monkeypatch):
    """At ZeRO stage 0 DeepSpeed's load reads expp_rank_R_mp_rank_00_optim_states.pt on expert-parallel
    rank R: one cut short or missing is an error naming it before any work, as a ZeRO partition is
    (it was let through, to fail inside torch's loader in DeepSpeed's load on that one rank)."""
    tag = fake_tag(tmp_path, zero_stage=0)
    RunCheckpoint(str(tag)).check_files()
    state = tag / "expp_rank_1_mp_rank_00_optim_states.pt"
    whole = state.read_bytes()
    state.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ExportError, match="expp_rank_1_mp_rank_00_optim_states.pt: not a complete torch.save file"):
        RunCheckpoint(str(tag)).check_files()
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = ["--config", TINY, "--set", "train.zero_stage=0", "--set", "log.wandb=false",
            "--set", f"log.dir={tmp_path / 'run'}", "--resume", str(tag)]
    with pytest.raises(ConfigError, match="expp_rank_1_mp_rank_00_optim_states.pt: not a complete torch.save file"):
        pretrain.prepare(pretrain.parse_args(args))
    state.unlink()
    with pytest.raises(ExportError, match="expp_rank_1_mp_rank_00_optim_states.pt is missing: the optimizer state of "
                                          "expert-parallel rank 1 of 2"):
        RunCheckpoint(str(tag)).check_files()


def test_zero_partitions_need_no_stage_0_files(tmp_path):
    RunCheckpoint(str(fake_tag(tmp_path, zero_stage=1))).check_files()
