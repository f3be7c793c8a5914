"""Review of the pretraining recipe's loop and bookkeeping (recipes/pretrain.py, checkpointing.py,
recipe_config.py, run_log.py): a resume compares the precision a run trained in, not its spelling;
the deepspeed section may not set an optimizer or schedule that the recipe's own silently replace;
wandb honours WANDB_MODE (a tag saved again: tests/test_recipes.py::test_overwriting_a_tag_moves_latest_back_first)."""
import json
import os
import subprocess
import sys
import types

import pytest
from launching import ROOT, one_rank_env

pytest.importorskip("deepspeed")
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import checkpointing  # noqa: E402
import pretrain  # noqa: E402
import run_log  # noqa: E402
from recipe_config import ConfigError, load_config, validate  # noqa: E402

TINY = os.path.join(ROOT, "recipes", "configs", "tiny-cpu.yaml")


def write_marker(tag_dir, **meta):
    tag_dir.mkdir(parents=True, exist_ok=True)
    (tag_dir / checkpointing.COMPLETE).write_text(json.dumps({"step": 4, "world_size": 2, **meta}))


def prepare(tmp_path, tag_dir, *extra):
    return pretrain.prepare(pretrain.parse_args(["--config", TINY, "--set", f"log.dir={tmp_path / 'run'}",
                                                 "--resume", str(tag_dir), *extra]))


def test_resume_compares_the_precision_trained_in(tmp_path, monkeypatch):
    """train.precision auto is fp32 on CPU ranks and bf16 on GPUs. A CPU run under auto resumed with
    train.precision=fp32 (the same run) was refused, and a GPU run's bf16 checkpoint (auto) resumed on
    CPU ranks in fp32 (auto again) was taken: the spellings were compared."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(pretrain, "uses_gpu", lambda: False)
    auto = load_config(TINY).to_dict()
    assert auto["train"]["precision"] == "auto"
    cpu_run, gpu_run = tmp_path / "cpu" / "global_step4", tmp_path / "gpu" / "global_step4"
    write_marker(cpu_run, precision="fp32", config=auto)
    write_marker(gpu_run, precision="bf16", config=auto)
    # Past the config checks, to the files (this tag has only its marker).
    for extra in ([], ["--set", "train.precision=fp32"]):
        with pytest.raises(ConfigError, match="mp_rank_00_model_states.pt is missing"):
            prepare(tmp_path, cpu_run, *extra)
    with pytest.raises(ConfigError, match=r"'train.precision': \('fp32', 'bf16'\)"):
        prepare(tmp_path, cpu_run, "--set", "train.precision=bf16")
    with pytest.raises(ConfigError, match=r"'train.precision': \('bf16', 'fp32'\)"):
        prepare(tmp_path, gpu_run)
    monkeypatch.setattr(pretrain, "uses_gpu", lambda: True)  # the same checkpoint on GPUs: auto is bf16 there
    with pytest.raises(ConfigError, match="mp_rank_00_model_states.pt is missing"):
        prepare(tmp_path, gpu_run)


def test_one_rank_run_records_its_precision_and_resumes_with_it_spelled_out(tmp_path, monkeypatch):
    """End to end: a one-rank CPU run under auto writes fp32 into its checkpoint's marker, and that
    checkpoint, every file there, resumes with train.precision=fp32 (refused before)."""
    env = one_rank_env()
    common = ["--config", TINY, "--set", "train.steps=2", "--set", "train.warmup_steps=1", "--set", "eval.batches=1",
              "--set", "moe.ep_size=1", "--set", "log.wandb=false"]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "pretrain.py"), *common,
                           "--set", f"log.dir={tmp_path / 'run'}", "--stop-at-step", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tag = tmp_path / "run" / "checkpoints" / "global_step1"
    assert checkpointing.read_meta(str(tag.parent), tag.name)["precision"] == "fp32"
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = pretrain.parse_args([*common, "--set", f"log.dir={tmp_path / 'run'}", "--set", "train.precision=fp32",
                                "--resume"])
    assert pretrain.prepare(args)[1] == (str(tag.parent), tag.name)


@pytest.mark.parametrize("override", ["deepspeed.optimizer={type: SGD, params: {lr: 0.0}}",
                                      "deepspeed.scheduler={type: WarmupLR, params: {warmup_max_lr: 0.0}}"])
def test_deepspeed_section_may_not_set_an_optimizer_or_schedule(override):
    """DeepSpeed takes the recipe's own AdamW and schedule over the config's: an optimizer or scheduler
    in the deepspeed section was accepted and silently ignored (a run with SGD at lr 0 trained with
    AdamW at train.lr)."""
    with pytest.raises(ConfigError, match=f"deepspeed.{override.split('.')[1].split('=')[0]} .* differs from None, "
                                          f"which the recipe sets from train.lr"):
        validate(load_config(TINY, [override]), world_size=2)


def test_wandb_honours_wandb_mode(tmp_path, monkeypatch):
    """WANDB_MODE=offline (or disabled) keeps the run off the network where a key is configured: the
    recipe passed mode="online", which wins over the environment in wandb.init. log.wandb_mode still
    wins over both."""
    modes = []

    class Run:
        def log(self, *args, **kwargs):
            pass

        def finish(self):
            pass

    def init(**kwargs):
        modes.append(kwargs["mode"])
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    monkeypatch.setenv("WANDB_API_KEY", "0123456789")

    def mode(env_mode, *overrides):
        if env_mode is None:
            monkeypatch.delenv("WANDB_MODE", raising=False)
        else:
            monkeypatch.setenv("WANDB_MODE", env_mode)
        log_dir = tmp_path / f"run{len(modes)}"
        run_log.RunLog(load_config(TINY, [f"log.dir={log_dir}", *overrides]), 0, True, None).close()
        return modes[-1]

    assert mode(None) == "online"  # the key's default
    assert mode("offline") == "offline" and mode("disabled") == "disabled"
    assert mode("offline", "log.wandb_mode=online") == "online"
