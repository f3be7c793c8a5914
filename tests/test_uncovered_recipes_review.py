"""Review: recipes/ code paths that no CPU test ran (coverage.py over tests/test_recipes.py,
test_checkpointing.py, test_checkpoint_review.py, test_recipe_loop_review.py, test_recipes_review3.py and
test_launching.py, launched ranks included), the CPU-reachable ones driven through the recipe's entry
points: the config, the command line (pretrain.parse_args/prepare/main) and, for a config option's
effect on the log, two short one-rank runs without the launcher."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from launching import ROOT, one_rank_env

pytest.importorskip("deepspeed")
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import checkpointing  # noqa: E402
import pretrain  # noqa: E402
import run_log  # noqa: E402
from recipe_config import ConfigError, load_config  # noqa: E402

TINY = os.path.join(ROOT, "recipes", "configs", "tiny-cpu.yaml")
SHORT = ["--set", "train.steps=8", "--set", "train.warmup_steps=2", "--set", "log.wandb=false"]


def prepare(*args):
    return pretrain.prepare(pretrain.parse_args(["--config", TINY, *SHORT, *args]))


def write_meta(tag, **changes):
    """A tag holding only its completion marker, of tiny-cpu's config with `changes` to its data section."""
    tag.mkdir(parents=True)
    meta = {"step": 4, "world_size": 2, "precision": "fp32", "config": load_config(TINY).to_dict()}
    meta["config"]["data"].update(changes)
    for key in [k for k, v in changes.items() if v is KeyError]:
        del meta["config"]["data"][key]
    (tag / checkpointing.COMPLETE).write_text(json.dumps(meta))


# ---------------------------------------------------------------- the command line and prepare


@pytest.mark.parametrize("stop", ["0", "9"])
def test_stop_at_step_outside_the_run_is_refused(tmp_path, monkeypatch, stop):
    """pretrain.py:67-68: --stop-at-step outside [1, train.steps] is an error before any work."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=rf"--stop-at-step must be in \[1, train.steps = 8\], got {stop}$"):
        prepare("--set", f"log.dir={tmp_path / 'run'}", "--stop-at-step", stop)


def test_fresh_run_refuses_a_checkpoint_dir_of_unfinished_tags(tmp_path, monkeypatch):
    """pretrain.py:80-81: a checkpoint.dir holding only tags without their marker (saves that did not
    finish) is refused for a fresh run, which would prune them, with its own message."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "ckpt" / "global_step2").mkdir(parents=True)
    with pytest.raises(ConfigError, match=f"{tmp_path / 'ckpt'} already holds only unfinished checkpoint tags "
                                          r"\(saves that did not finish\); start afresh elsewhere"):
        prepare("--set", f"log.dir={tmp_path / 'run'}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}")


def test_a_tokenizer_that_cannot_be_read_is_a_config_error(tmp_path, monkeypatch):
    """pretrain.py:115-116: data.tokenizer naming no tokenizer stops as a config error naming the key."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=f"data.tokenizer: {tmp_path / 'tok'}: no Hugging Face tokenizer files"):
        prepare("--set", f"log.dir={tmp_path / 'run'}", "--set", f"data.tokenizer={tmp_path / 'tok'}")


def test_resume_compares_the_tokenizer_as_recorded(tmp_path, monkeypatch):
    """pretrain.py:111-112 and 191-194: a checkpoint from before data.tokenizer (no key in its data
    section) read bytes and resumes with bytes; one that recorded another tokenizer is refused, naming
    it. (The tag holds only its marker, so an accepted resume stops at the file check after these.)"""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(pretrain, "uses_gpu", lambda: False)  # the checkpoint's precision: fp32 CPU ranks
    old, other = tmp_path / "old" / "global_step4", tmp_path / "other" / "global_step4"
    write_meta(old, tokenizer=KeyError)
    write_meta(other, tokenizer=str(tmp_path / "bpe"))
    with pytest.raises(ConfigError, match="mp_rank_00_model_states.pt is missing"):
        prepare("--set", f"log.dir={tmp_path / 'run1'}", "--resume", str(old))
    with pytest.raises(ConfigError, match=rf"a resume needs .*'data.tokenizer': \('{tmp_path / 'bpe'}', 'bytes'\)"):
        prepare("--set", f"log.dir={tmp_path / 'run2'}", "--resume", str(other))


def test_marker_without_a_corpus_digest_is_not_checked():
    """pretrain.py:141-143: a marker from before the recipe wrote the corpus digest resumes on any
    corpus; one with a digest that differs is refused."""
    cfg = load_config(TINY)

    class Stream:
        digest = {"tokens": 10, "sha256": "a"}

    assert pretrain.check_same_corpus(cfg, {"step": 4}, Stream(), "ckpt/global_step4") is None
    with pytest.raises(ConfigError, match=r"the corpus .* changed since the checkpoint \(9 tokens then, 10 now"):
        pretrain.check_same_corpus(cfg, {"corpus": {"tokens": 9, "sha256": "b"}}, Stream(), "ckpt/global_step4")


@pytest.mark.parametrize("marker", ["{}", "[4]", '{"step": "4"}'])
def test_resume_names_a_marker_without_a_step(tmp_path, monkeypatch, marker):
    """checkpointing.py:90-91 through pretrain.py:99-102: a marker that is JSON but not a save's (no int
    step) is a config error naming it, not a KeyError or TypeError."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    tag = tmp_path / "ckpt" / "global_step4"
    tag.mkdir(parents=True)
    (tag / checkpointing.COMPLETE).write_text(marker)
    with pytest.raises(ConfigError, match=rf"--resume: {tag / checkpointing.COMPLETE}: not a checkpoint's completion "
                                          r"marker \(no step in it\)"):
        prepare("--set", f"log.dir={tmp_path / 'run'}", "--resume", str(tag))


def test_moe_layer_that_cannot_be_imported_is_a_config_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "turbomoe.integrations.deepspeed", None)  # its import fails
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        pretrain.main(["--config", TINY, "--set", f"log.dir={tmp_path / 'run'}"])
    assert e.value.code == 2
    assert "pretrain.py: error: model.moe_impl is 'turbomoe' but turbomoe.integrations.deepspeed.MoE cannot be " \
           "imported" in capsys.readouterr().err


# ---------------------------------------------------------------- the config file


@pytest.mark.parametrize("text,message", [
    ("- model\n- train\n", "the config must be a mapping of sections"),
    ("train: 5\n", "config section 'train' must be a mapping, got int"),
    ("deepspeed: [1]\n", "config section 'deepspeed' must be a mapping, got list"),
])
def test_config_file_shapes_are_errors(tmp_path, text, message):
    """recipe_config.py:227-228, 297-298, 314-315."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path))


def test_set_through_a_key_that_is_not_a_section():
    """recipe_config.py:260-261."""
    with pytest.raises(ConfigError, match=r"--set 'train.lr.x=1': 'lr' is not a section"):
        load_config(TINY, ["train.lr.x=1"])


def test_home_expanded_in_tokenizer_and_cache_dir(tmp_path, monkeypatch):
    """recipe_config.py:319-321: ~ in data.tokenizer and data.cache_dir is the home directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(TINY, ["data.tokenizer=~/tok", "data.cache_dir=~/cache"])
    assert (cfg.data.tokenizer, cfg.data.cache_dir) == (str(tmp_path / "tok"), str(tmp_path / "cache"))


def test_init_from_takes_the_model_from_config_json(tmp_path):
    """recipe_config.py:282-289: model.init_from's config.json is the model; the config's other model keys
    must agree with it (moe_impl excepted), unknown ones are errors."""
    from turbomoe.models import hf_checkpoint as hf
    tiny = load_config(TINY)
    (tmp_path / hf.CONFIG).write_text(json.dumps(hf.config_to_hf(tiny.model, torch.float32, {})))
    cfg = load_config(TINY, [f"model.init_from={tmp_path}", "model.moe_impl=deepspeed"])
    assert cfg.init_from == str(tmp_path)
    assert cfg.model.to_dict() == dict(tiny.model.to_dict(), moe_impl="deepspeed")
    with pytest.raises(ConfigError, match=rf"model keys differ from model.init_from {tmp_path}'s config.json "
                                          r"\(key: \(config, checkpoint\)\): \{'hidden_size': \(64, 128\)\}"):
        load_config(TINY, [f"model.init_from={tmp_path}", "model.hidden_size=64"])
    with pytest.raises(ConfigError, match=r"unknown model config keys \['hiden_size'\]"):
        load_config(TINY, [f"model.init_from={tmp_path}", "model.hiden_size=64"])


# ---------------------------------------------------------------- run_log


def test_configured_peak_gives_mfu_in_the_log_and_progress_bar(tmp_path):
    """run_log.py:23 and 66-67: train.peak_tflops (TFLOP/s) is the peak on any device, and a record's
    MFU shows in the bar; without it the CPU has none."""
    assert run_log.peak_flops(2.5, on_gpu=False) == 2.5e12
    assert run_log.peak_flops(None, on_gpu=False) is None
    cfg = load_config(TINY, [f"log.dir={tmp_path}", "log.wandb=false"])
    log = run_log.RunLog(cfg, 0, True, None, "abc")
    record = {"type": "train", "step": 1, "loss": 5.0, "lr": 1e-3, "aux_loss": 1.0, "expert_load": 1.5,
              "tokens_per_s": 100.0, "mfu": 0.125}
    log.train_step(record)
    assert "mfu=12.5%" in log.bar.postfix
    log.close()
    lines = [json.loads(line) for line in open(tmp_path / run_log.LOG_FILE)]
    assert lines[0]["type"] == "start" and lines[0]["launch"] == "abc" and lines[1] == record


def test_wandb_gets_the_numeric_fields_of_train_and_valid_records(tmp_path, monkeypatch):
    """run_log.py:66-68: with log.wandb a train or valid record goes to wandb as <type>/<key> for its
    numbers, at its step; other records (start, checkpoint, summary) only to log.jsonl."""
    logged = []

    class Run:
        def log(self, values, step):
            logged.append((values, step))

        def finish(self):
            logged.append("finished")

    class Wandb:
        @staticmethod
        def init(**kwargs):
            return Run()

    monkeypatch.setitem(sys.modules, "wandb", Wandb)
    cfg = load_config(TINY, [f"log.dir={tmp_path}", "log.wandb_mode=disabled"])
    log = run_log.RunLog(cfg, 0, True, None)
    log.write({"type": "valid", "step": 0, "valid_loss": 5.5})
    log.train_step({"type": "train", "step": 1, "loss": 5.0, "lr": 1e-3, "aux_loss": 1.0, "expert_load": 1.5,
                    "expert_load_per_layer": [1.5, 1.2], "tokens_per_s": 100.0, "mfu": None})
    log.write({"type": "checkpoint", "step": 1, "path": "x"})
    log.close()
    assert logged == [({"valid/valid_loss": 5.5}, 0),
                      ({"train/loss": 5.0, "train/lr": 1e-3, "train/aux_loss": 1.0, "train/expert_load": 1.5,
                        "train/tokens_per_s": 100.0}, 1), "finished"]


# ---------------------------------------------------------------- one-rank runs


def one_rank(*args, omp=True):
    """python recipes/pretrain.py ARGS: one CPU rank, no launcher; without OMP_NUM_THREADS unless omp."""
    env = one_rank_env(drop=() if omp else ("OMP_NUM_THREADS", ))
    return subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "pretrain.py"), "--config", TINY, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


SMALL_RUN = ["--set", "train.steps=2", "--set", "train.warmup_steps=1", "--set", "eval.every=2",
             "--set", "eval.batches=1", "--set", "moe.ep_size=1", "--set", "log.wandb=false",
             "--set", "data.seq_len=64", "--set", "train.micro_batch_size=2"]


def test_peak_tflops_gives_mfu_on_the_cpu(tmp_path):
    """pretrain.py:671-674 (no OMP_NUM_THREADS: the ranks share the cores) and run_log.py:23, 66-67:
    with train.peak_tflops set a CPU run logs each step's MFU and the summary's, as README's
    'Logging' defines it: tokens/s x FLOPs a token over the devices' peak."""
    peak = 0.5
    proc = one_rank(*SMALL_RUN, "--set", f"train.peak_tflops={peak}", "--set", f"log.dir={tmp_path}", omp=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    flops = load_config(TINY).model.flops_per_token(64)
    train = [r for r in records if r["type"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / (peak * 1e12), rel=1e-9)
    summary = [r for r in records if r["type"] == "summary"][0]
    assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * flops / (peak * 1e12), rel=1e-9)
    assert summary["device"] == "cpu" and summary["world_size"] == 1


def test_megatron_run_checks_every_batch_and_trains(tmp_path):
    """pretrain.py:712, 749-751: megatron data (already tokenized, no tokenizer to bound it) within the
    vocabulary trains: its batches are checked on the host every step, and the run logs its steps."""
    from test_data import build_megatron
    rng = np.random.default_rng(0)
    build_megatron(tmp_path / "corpus_text_document", [rng.integers(0, 320, 500).tolist() for _ in range(8)])
    proc = one_rank(*SMALL_RUN, "--set", "data.source=megatron",
                    "--set", f"data.paths=[{tmp_path / 'corpus_text_document'}]", "--set", "data.valid_fraction=0.2",
                    "--set", f"log.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl")]
    assert [r["step"] for r in log if r["type"] == "train"] == [1, 2]
    assert [r["step"] for r in log if r["type"] == "valid"] == [0, 2]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "global_step2"


def test_megatron_token_ids_past_the_vocabulary_stop_the_run(tmp_path):
    """pretrain.py:715-717: pre-tokenized (megatron) data whose ids exceed model.vocab_size stops before
    the first step with the message naming the id, and no step is logged."""
    from test_data import build_megatron
    rng = np.random.default_rng(0)
    build_megatron(tmp_path / "corpus_text_document", [rng.integers(0, 400, 500).tolist() for _ in range(8)])
    proc = one_rank(*SMALL_RUN, "--set", "data.source=megatron",
                    "--set", f"data.paths=[{tmp_path / 'corpus_text_document'}]", "--set", "data.valid_fraction=0.2",
                    "--set", f"log.dir={tmp_path / 'run'}")
    assert proc.returncode != 0
    assert "in the data is >= model.vocab_size 320; set model.vocab_size to the tokenizer's" in proc.stderr
    log = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl")]
    assert not [r for r in log if r["type"] in ("train", "valid")]
