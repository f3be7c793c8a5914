"""Review of the pretraining recipe's checkpoints, resume and resharding (recipes/checkpointing.py,
reshard.py, pretrain.py, turbomoe/checkpoint_tags.py), on CPU ranks (gloo), tiny-cpu shrunk to seconds.

What a resume restores is compared bit for bit: a checkpoint is resumed with pretrain's train_step
replaced by one that leaves every tensor alone, so the checkpoint that run writes after its one
no-op step must hold exactly the resumed one's fp32 masters, Adam moments, step count, schedule and
weights (the existing tests resume and train on, so they compare within tolerances). The other
tests: an exact same-layout resume in a configuration the existing ones do not run (bf16's
BF16_Optimizer, gradient accumulation, a capacity factor), and the bookkeeping around interrupted
saves and damaged tags, where this review found four faults (fixed): `latest` put back on another run's
tag when an overwrite began, a run killed between its save and the log's line that --resume refused, a
fresh run taking a checkpoint.dir whose only tags had no `latest`, and a marker cut short raising
json's error naming no file."""
import json
import os
import subprocess
import sys

import pytest
import torch
from launching import ROOT, deepspeed_launch, launcher_env, one_rank_env

pytest.importorskip("deepspeed")
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import checkpointing  # noqa: E402
from test_checkpointing import OneRank, OneRankEngine  # noqa: E402 (checkpointing.save on one fake rank)
import pretrain  # noqa: E402
from recipe_config import ConfigError, load_config  # noqa: E402

TINY = os.path.join(ROOT, "recipes", "configs", "tiny-cpu.yaml")
PRETRAIN = os.path.join(ROOT, "recipes", "pretrain.py")
# tiny-cpu's model and layout, 4 steps of 2 x 64-token sequences a rank, a checkpoint every 2 steps.
SMALL = ["--config", TINY, "--set", "train.steps=4", "--set", "train.warmup_steps=1", "--set", "eval.every=100",
         "--set", "eval.batches=1", "--set", "checkpoint.every=2", "--set", "log.wandb=false",
         "--set", "data.seq_len=64", "--set", "train.micro_batch_size=2", "--set", "data.max_tokens=200000"]
STATES = ("master", "exp_avg", "exp_avg_sq")

# pretrain.main with a train_step that runs no forward, backward or optimizer step: the run it starts
# saves, after its one step, the state its resume put in place.
NO_STEP_DRIVER = f"""
import sys
sys.path.insert(0, {os.path.join(ROOT, 'recipes')!r})
import torch
import pretrain

def no_step(engine, batches, aux_loss_coef, phase=None):
    cfg = engine.module.config
    return torch.zeros(2 + len(cfg.moe_layers()) * cfg.num_experts)

pretrain.train_step = no_step
pretrain.main()
"""

# pretrain.main killed (os._exit, as a preempted job) inside checkpointing.save at step KILL_AT: after every
# rank's files, the marker and `latest` are written, while older tags are being rotated out.
KILLED_IN_ROTATION_DRIVER = f"""
import os, sys
sys.path.insert(0, {os.path.join(ROOT, 'recipes')!r})
import checkpointing
import pretrain
prune = checkpointing.prune

def dying_prune(ckpt_dir, keep, current, *args):
    if current == int(os.environ["KILL_AT"]):
        os._exit(9)
    return prune(ckpt_dir, keep, current, *args)

checkpointing.prune = dying_prune
pretrain.main()
"""


def launch(script, ranks, *args):
    """deepspeed SCRIPT (SMALL config) ARGS on `ranks` CPU ranks."""
    return deepspeed_launch(script, *SMALL, *args, env=launcher_env(cpu=True), nproc=ranks, timeout=400)


def one_rank(script, *args, env=()):
    """python SCRIPT (SMALL config) ARGS: one rank, no launcher."""
    return subprocess.run([sys.executable, script, *SMALL, *args], cwd=ROOT, env=dict(one_rank_env(), **dict(env)),
                          capture_output=True, text=True, timeout=300)


def driver(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def train_records(log_dir):
    with open(os.path.join(log_dir, "log.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if r["type"] == "train"}


def assert_same_state(want_tag, have_tag):
    """have_tag holds bit for bit what want_tag does: every parameter's fp32 master and Adam moments
    (reassembled from whatever ZeRO partitions each layout wrote), the optimizer's step count, the
    weights (non-expert and every expert by global id), the schedule and the engine's step counter."""
    from turbomoe.export import RunCheckpoint  # noqa: E402 (after the launcher's CPU environment is set)
    want, have = RunCheckpoint(str(want_tag)), RunCheckpoint(str(have_tag))
    ws, hs = want.zero_states(STATES), have.zero_states(STATES)
    assert ws is not None and hs is not None
    for key in STATES:
        assert ws[key].keys() == hs[key].keys()
        for name, t in ws[key].items():
            assert torch.equal(t, hs[key][name]), (key, name)
    assert torch.equal(want.optimizer_step(), have.optimizer_step())
    weights = dict(have.tensors())
    for name, t in want.tensors():
        assert torch.equal(t, weights[name]), name
    assert want.states["lr_scheduler"]["last_epoch"] == have.states["lr_scheduler"]["last_epoch"]
    assert want.states["lr_scheduler"]["_last_lr"] == have.states["lr_scheduler"]["_last_lr"]
    assert want.states["global_steps"] == have.states["global_steps"]


# ---------------------------------------------------------------- what a resume restores


def test_reshard_restores_masters_moments_and_schedule_bit_for_bit(tmp_path):
    """A 2-rank ep_size 1 run (every expert ZeRO-partitioned over both ranks) resumed at ep_size 2 on
    2 ranks (each rank whole experts of its own) and on 1 rank: the state put in place is exactly the
    checkpoint's. (Checked also, by hand: ep_size 2 -> 1 on 2 ranks and 1 -> 2, num_experts 1,
    decoder_sparse_step 2, ZeRO 1 -> 2; all exact.)"""
    no_step = driver(tmp_path, "no_step.py", NO_STEP_DRIVER)
    launch(PRETRAIN, 2, "--set", f"log.dir={tmp_path / 'src'}", "--set", "moe.ep_size=1", "--stop-at-step", "2")
    src = tmp_path / "src" / "checkpoints" / "global_step2"
    for name, ranks, extra in (("ep2", 2, ["--set", "moe.ep_size=2"]),
                               ("one", 1, ["--set", "moe.ep_size=1", "--set", "train.micro_batch_size=4"])):
        launch(no_step, ranks, "--set", f"log.dir={tmp_path / name}", "--resume", str(src), *extra,
               "--stop-at-step", "3")
        tag = tmp_path / name / "checkpoints" / "global_step3"
        assert checkpointing.read_meta(str(tag.parent), tag.name)["world_size"] == ranks
        assert_same_state(src, tag)


def test_bf16_resume_exact_on_the_same_layout_and_resharded_bit_for_bit(tmp_path):
    """bf16 on CPU ranks (DeepSpeed's BF16_Optimizer and the recipe's step without host sync), 2 micro-
    batches a step, a capacity factor (tokens dropped): its step-2 checkpoint resumed on the same layout
    logs exactly the uninterrupted run's steps 3 and 4 and saves exactly its step-4 state; resumed on
    1 rank (every expert, 4 micro-batches a step) it puts exactly the checkpoint's state in place."""
    common = ["--set", "train.precision=bf16", "--set", "train.grad_accum=2", "--set", "moe.capacity_factor=1.0"]
    launch(PRETRAIN, 2, "--set", f"log.dir={tmp_path / 'whole'}", *common)
    start = tmp_path / "whole" / "checkpoints" / "global_step2"
    launch(PRETRAIN, 2, "--set", f"log.dir={tmp_path / 'resumed'}", "--resume", str(start), *common)
    ref, got = train_records(tmp_path / "whole"), train_records(tmp_path / "resumed")
    assert sorted(got) == [3, 4]
    for step, r in got.items():
        for key in ("loss", "aux_loss", "lr", "grad_norm", "expert_load_per_layer"):
            assert r[key] == ref[step][key], (step, key)
    assert_same_state(tmp_path / "whole" / "checkpoints" / "global_step4",
                      tmp_path / "resumed" / "checkpoints" / "global_step4")
    no_step = driver(tmp_path, "no_step.py", NO_STEP_DRIVER)
    launch(no_step, 1, "--set", f"log.dir={tmp_path / 'one'}", "--resume", str(start), *common,
           "--set", "moe.ep_size=1", "--set", "train.grad_accum=4", "--stop-at-step", "3")
    assert_same_state(start, tmp_path / "one" / "checkpoints" / "global_step3")


# ---------------------------------------------------------------- interrupted saves and damaged tags




class KilledWhileWriting:
    def save_checkpoint(self, *args, **kwargs):
        raise KeyboardInterrupt


def test_interrupted_overwrite_leaves_latest_on_this_runs_line(tmp_path, monkeypatch):
    """Run A saved steps 2, 4, 6, 8 (latest 8) into the checkpoint dir. Run B resumed there from step 2
    (checkpoint.every changed, say) and saved step 5, which rotated out A's 4 (A's 6 and 8, past it,
    stay until overwritten: prune's rule); B then saves step 8 over A's and is killed while writing.
    `latest` must name B's step 5, the last checkpoint of the run that was killed: it names A's 6, a
    plain --resume then continues a line B had left, and B's steps 3-5 are silently dropped."""
    monkeypatch.setattr(checkpointing, "dist", OneRank)
    for step in (2, 4, 6, 8):
        (tmp_path / checkpointing.tag_of(step)).mkdir()
        (tmp_path / checkpointing.tag_of(step) / checkpointing.COMPLETE).write_text(
            json.dumps({"step": step, "launch": "A", "start_step": 0}))
    (tmp_path / "latest").write_text("global_step8")
    meta = {"launch": "B", "start_step": 2}
    checkpointing.save(OneRankEngine(), str(tmp_path), 5, keep=2, meta=meta)
    assert checkpointing.resolve(str(tmp_path)) == (str(tmp_path), "global_step5")
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "global_step2", "global_step5", "global_step6", "global_step8"]
    with pytest.raises(KeyboardInterrupt):
        checkpointing.save(KilledWhileWriting(), str(tmp_path), 8, keep=2, meta=meta)
    assert checkpointing.resolve(str(tmp_path)) == (str(tmp_path), "global_step5")


def test_run_killed_after_latest_moved_resumes(tmp_path, monkeypatch):
    """A 1-rank run (6 steps, a checkpoint every 2) killed inside step 4's save, after its marker and
    `latest` were written, while the rotation removed older tags: global_step4 is whole and `latest`
    names it, which checkpointing.py promises is always resumable. A plain --resume in the same log.dir
    is refused ('belongs to the run whose last checkpoint is .../global_step2'), since the log never got
    step 4's checkpoint line."""
    args = ["--set", "moe.ep_size=1", "--set", "train.steps=6", "--set", f"log.dir={tmp_path / 'run'}"]
    proc = one_rank(driver(tmp_path, "killed.py", KILLED_IN_ROTATION_DRIVER), *args, env={"KILL_AT": "4"})
    assert proc.returncode == 9, proc.stderr[-3000:]
    ckpt = tmp_path / "run" / "checkpoints"
    assert (ckpt / "latest").read_text() == "global_step4"
    assert checkpointing.read_meta(str(ckpt), "global_step4")["step"] == 4
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(pretrain, "uses_gpu", lambda: False)  # as the run's CPU rank
    _, resume, _ = pretrain.prepare(pretrain.parse_args([*SMALL, *args, "--resume"]))
    assert resume == (str(ckpt), "global_step4")


def test_fresh_run_refuses_a_checkpoint_dir_holding_complete_tags(tmp_path, monkeypatch):
    """checkpoint.dir holds another run's complete global_step2 (its marker written) but no `latest`:
    a fresh run into it (its own log.dir) must be refused as a --resume into it is ('holds another run's
    checkpoints'); it is accepted, and its step-2 save would rmtree that checkpoint."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    other = tmp_path / "other_ckpt"
    (other / "global_step2").mkdir(parents=True)
    (other / "global_step2" / checkpointing.COMPLETE).write_text(
        json.dumps({"step": 2, "world_size": 2, "config": load_config(TINY).to_dict()}))
    assert checkpointing.holds_tags(str(other))
    with pytest.raises(ConfigError, match="holds"):
        pretrain.prepare(pretrain.parse_args([*SMALL, "--set", f"log.dir={tmp_path / 'run'}",
                                              "--set", f"checkpoint.dir={other}"]))


def test_resume_names_a_marker_cut_short(tmp_path, monkeypatch):
    """The README: --resume with a file of the checkpoint missing or cut short is an error naming it,
    before any work. The tag's marker cut short (copied in part, say) raised json's 'Expecting ...' from
    inside prepare on every rank (a traceback, exit code 1, no file named)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    tag = tmp_path / "ckpt" / "global_step2"
    tag.mkdir(parents=True)
    whole = json.dumps({"step": 2, "world_size": 2, "config": load_config(TINY).to_dict()})
    (tag / checkpointing.COMPLETE).write_text(whole[: len(whole) // 2])
    with pytest.raises(ConfigError, match=checkpointing.COMPLETE):
        pretrain.prepare(pretrain.parse_args([*SMALL, "--set", f"log.dir={tmp_path / 'run'}", "--resume", str(tag)]))
