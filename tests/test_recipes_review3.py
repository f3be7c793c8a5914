"""Third review of the pretraining recipe (recipes/pretrain.py, reshard.py, turbomoe/data): one-rank
runs on a small text corpus. A resume refuses a corpus whose contents changed since the checkpoint
(its config unchanged: the split and order are drawn from the tokens, so the run read other data),
and takes the learning rate of its first step from this run's schedule (train.steps grown), as
the other steps and a resume on another layout do."""
import json
import os
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
from launching import ROOT, one_rank_env

pytest.importorskip("deepspeed")
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import checkpointing  # noqa: E402
import pretrain  # noqa: E402
from recipe_config import ConfigError  # noqa: E402
from test_data import build_megatron  # noqa: E402
from turbomoe.data import ArrayStream, load_stream  # noqa: E402

TINY = os.path.join(ROOT, "recipes", "configs", "tiny-cpu.yaml")


def common(corpus, log_dir, steps=4):
    return ["--config", TINY, "--set", "data.source=text", "--set", f"data.paths=[{corpus}]",
            "--set", "data.valid_fraction=0.1", "--set", f"train.steps={steps}", "--set", "train.warmup_steps=1",
            "--set", "eval.batches=1", "--set", "checkpoint.every=2", "--set", "moe.ep_size=1",
            "--set", "log.wandb=false", "--set", f"log.dir={log_dir}"]


def run(*args):
    """python recipes/pretrain.py ARGS: one rank, no launcher."""
    env = one_rank_env()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "pretrain.py"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A 4-step run on a text corpus (about 100 samples) stopped after step 2, with its checkpoint."""
    tmp = tmp_path_factory.mktemp("stopped")
    corpus = tmp / "corpus.txt"
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "os.py"), "rb") as f:
        corpus.write_bytes(f.read()[:26000])
    run(*common(corpus, tmp / "run"), "--stop-at-step", "2")
    return tmp, corpus


def test_resume_refuses_a_corpus_changed_since_the_checkpoint(stopped, monkeypatch):
    """The corpus file appended to (and edited in place, same length) between the run and its resume:
    the same data config, other tokens, so another split and order (Samples draws them over the token
    count). Was taken silently; the marker now records the stream's digest."""
    tmp, corpus = stopped
    monkeypatch.setenv("WORLD_SIZE", "1")
    # as the run's CPU rank: on a GPU machine prepare would read its precision auto as bf16 and refuse it
    monkeypatch.setattr(pretrain, "uses_gpu", lambda: False)
    args = pretrain.parse_args([*common(corpus, tmp / "run"), "--resume"])
    assert pretrain.prepare(args)[1] == (str(tmp / "run" / "checkpoints"), "global_step2")
    whole = corpus.read_bytes()
    for changed in (whole + b"# one more line\n" * 400, whole[:-1] + b"!"):
        corpus.write_bytes(changed)
        with pytest.raises(ConfigError, match=r"data\.paths.*changed since the checkpoint"):
            pretrain.prepare(args)
    corpus.write_bytes(whole)


def test_first_resumed_step_follows_this_runs_schedule(stopped, tmp_path):
    """Resumed with train.steps grown from 4 to 8 (a run continued further): every step's learning
    rate is the 8-step schedule's, the first one too (it was the 4-step schedule's, read from the
    checkpoint's optimizer state, on the same layout only: reshard.py set this run's)."""
    tmp, corpus = stopped
    ckpt = tmp / "run" / "checkpoints" / "global_step2"
    run(*common(corpus, tmp_path / "run", steps=8), "--resume", str(ckpt),
        "--set", f"checkpoint.dir={tmp_path / 'ckpt'}")
    with open(tmp_path / "run" / "log.jsonl") as f:
        train = [r for r in map(json.loads, f) if r["type"] == "train"]
    assert [r["step"] for r in train] == list(range(3, 9))
    lr = pretrain.load_config(TINY).train.lr
    for r in train:
        assert r["lr"] == pytest.approx(lr * pretrain.lr_factor(r["step"] - 1, 1, 8, 0.1), rel=1e-12), r["step"]
    assert checkpointing.read_meta(str(tmp_path / "ckpt"), "global_step8")["step"] == 8


def test_stream_digest_follows_the_corpus(tmp_path):
    """What a checkpoint's marker records of its corpus: the same for the same tokens, other for an edit
    of the same length; a Megatron dataset's from its documents' lengths up to max_tokens (its tokens
    are not read whole)."""
    a = ArrayStream(np.arange(100, dtype=np.uint16))
    assert a.digest == ArrayStream(np.arange(100, dtype=np.uint16)).digest
    b = np.arange(100, dtype=np.uint16)
    b[50] = 7
    assert ArrayStream(b).digest != a.digest and ArrayStream(b).digest["tokens"] == 100
    build_megatron(tmp_path / "a_text_document", [[1, 2, 3], [4, 5], [6]])
    build_megatron(tmp_path / "b_text_document", [[1, 2], [3, 4, 5], [6]])
    a, b = (load_stream("megatron", [str(tmp_path / f"{n}_text_document")]) for n in "ab")
    assert a.digest["tokens"] == b.digest["tokens"] == 6 and a.digest != b.digest
    assert load_stream("megatron", [str(tmp_path / "a_text_document")], max_tokens=4).digest == \
        load_stream("megatron", [str(tmp_path / "a_text_document")], max_tokens=4).digest != a.digest
