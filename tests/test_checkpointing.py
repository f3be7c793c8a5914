"""recipes/checkpointing.py without a launcher: one rank, DeepSpeed's engine replaced by one that writes
files the way its save_checkpoint does."""
import json
import os
import sys

import pytest
from launching import ROOT

pytest.importorskip("deepspeed")
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import checkpointing  # noqa: E402


class OneRank:
    get_rank = staticmethod(lambda: 0)
    barrier = staticmethod(lambda: None)


class OneRankEngine:
    """save_checkpoint as one rank writes it: the model states and rank 0's optimizer partition."""

    def save_checkpoint(self, ckpt_dir, tag, client_state, save_latest):
        os.makedirs(os.path.join(ckpt_dir, tag), exist_ok=True)
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
            with open(os.path.join(ckpt_dir, tag, name), "w") as f:
                f.write("new")


@pytest.mark.parametrize("complete", [True, False])
def test_a_tag_saved_again_on_fewer_ranks_holds_only_the_new_files(tmp_path, monkeypatch, complete):
    """A 2-rank run's step-8 tag (complete, or a save that crashed) saved again by a 1-rank run resumed
    from step 4: rank 1's old optimizer partition may not stay in it (readers take every
    zero_pp_rank_R file as the new run's and refuse a tag with more partitions than ranks)."""
    monkeypatch.setattr(checkpointing, "dist", OneRank)
    for step in (4, 8):
        tag = tmp_path / checkpointing.tag_of(step)
        tag.mkdir()
        for rank in (0, 1):
            (tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_text("old")
        if step == 4 or complete:
            (tag / checkpointing.COMPLETE).write_text(json.dumps({"step": step}))
    (tmp_path / "latest").write_text("global_step8" if complete else "global_step4")
    checkpointing.save(OneRankEngine(), str(tmp_path), 8, keep=2, meta={"world_size": 1})
    tag = tmp_path / "global_step8"
    assert sorted(os.listdir(tag)) == sorted([checkpointing.COMPLETE, "mp_rank_00_model_states.pt",
                                              "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
    assert (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").read_text() == "new"
    assert json.loads((tag / checkpointing.COMPLETE).read_text()) == {"step": 8, "world_size": 1}
    assert checkpointing.resolve(str(tmp_path)) == (str(tmp_path), "global_step8")


def test_rotation_counts_only_this_runs_line(tmp_path, monkeypatch):
    """A run saved steps 50-300 every 50 (keep 2 kept 250, 300); another resumed from 200 (its
    checkpoint.dir the same) saves every 40. At 280 the old run's 250 counted among the newest two and
    pushed out this run's 240; now only tags up to 200 and this launch's count: 240 and 280 stay, 250
    goes, 300 (after 280) stays until this run overwrites it."""
    monkeypatch.setattr(checkpointing, "dist", OneRank)
    for step in (250, 300, 200):  # what the old run's rotation left, and the resume point
        (tmp_path / checkpointing.tag_of(step)).mkdir()
        (tmp_path / checkpointing.tag_of(step) / checkpointing.COMPLETE).write_text(
            json.dumps({"step": step, "launch": "old", "start_step": 0}))
    for step in (240, 280):
        checkpointing.save(OneRankEngine(), str(tmp_path), step, keep=2,
                           meta={"start_step": 200, "launch": "new"})
    tags = sorted(n for n in os.listdir(tmp_path) if n.startswith("global_step"))
    assert tags == ["global_step240", "global_step280", "global_step300"]
    assert checkpointing.resolve(str(tmp_path)) == (str(tmp_path), "global_step280")
