"""recipes/pretrain.py: bad input fails before any work, checkpoint bookkeeping, and real runs
through the deepspeed launcher with 2 CPU ranks (gloo) and ep_size=2, as tiny-cpu trains, on any
machine: the loss falls, checkpoints are written, and a run stopped and resumed logs exactly the
losses of an uninterrupted one."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from launching import ROOT, deepspeed_launch, free_port, launcher_env, one_rank_env

pytest.importorskip("deepspeed")
sys.path.insert(0, os.path.join(ROOT, "recipes"))
import checkpointing  # noqa: E402
import pretrain  # noqa: E402
from recipe_config import ConfigError, deepspeed_config, load_config, validate  # noqa: E402

TINY = os.path.join(ROOT, "recipes", "configs", "tiny-cpu.yaml")
STEPS = 8
# tiny-cpu, shortened: a few steps of the same model, data and parallel layout.
SHORT = ["--set", f"train.steps={STEPS}", "--set", "train.warmup_steps=2", "--set", "eval.every=4",
         "--set", "eval.batches=2", "--set", "checkpoint.every=4", "--set", "log.wandb=false"]


def run_launcher(script, *args, check=True, gpus=0, ranks=2):
    """deepspeed SCRIPT ARGS: on `ranks` CPU ranks, or on `gpus` GPUs."""
    return deepspeed_launch(script, *args, env=launcher_env(cpu=not gpus), nproc=gpus or ranks, timeout=600,
                            check=check)


def launch(tmp, *args, check=True, gpus=0, ranks=2):
    """deepspeed recipes/pretrain.py (tiny-cpu, shortened) ... with logs and checkpoints under tmp: on
    `ranks` CPU ranks, or on `gpus` GPUs."""
    return run_launcher(os.path.join(ROOT, "recipes", "pretrain.py"), "--config", TINY, *SHORT,
                        "--set", f"log.dir={tmp}", *args, check=check, gpus=gpus, ranks=ranks)


def records(log_dir, kind):
    with open(os.path.join(log_dir, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["type"] == kind]


# ---------------------------------------------------------------- bad input, before any work


def test_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {hidden_size: 64}\ntrian: {steps: 3}\n")
    with pytest.raises(ConfigError, match="unknown config section.*trian"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="unknown key.*stpes.*'train'"):
        load_config(TINY, ["train.stpes=3"])
    with pytest.raises(ConfigError, match="unknown key.*hidden.*'model'"):
        load_config(TINY, ["model.hidden=3"])
    with pytest.raises(ConfigError, match="ep_size 3 does not divide model.num_experts 8"):
        load_config(TINY, ["moe.ep_size=3"])
    with pytest.raises(ConfigError, match="does not divide the world size 2"):
        validate(load_config(TINY, ["moe.ep_size=4"]), world_size=2)
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(TINY, ["steps=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match=r"log.every must be in \[1, inf\], got 0"):
        load_config(TINY, ["log.every=0"])


@pytest.mark.parametrize("override,message", [
    ("moe.capacity_factor=abc", "moe.capacity_factor must be a number, got str 'abc'"),
    ("train.lr=abc", "train.lr must be a number"),
    ("data.seq_len=abc", "data.seq_len must be an int"),
    ("data.seq_len=2.5", "data.seq_len must be an int"),
    ("model.num_experts_per_tok=12", r"model.num_experts_per_tok must be in \[1, 8\]"),
    ("model.num_experts=16", r"model.num_experts_per_tok must be in \[1, 8\]"),  # with per_tok 9 below
    ("model.num_experts=4", r"num_experts_per_tok \(8\) exceeds num_experts \(4\)"),  # with per_tok 8
    ("moe.min_capacity=-1", r"moe.min_capacity must be in \[0, inf\]"),
    ("log.wandb=maybe", "log.wandb must be true or false"),
    ("model.norm_topk_prob=1", "model.norm_topk_prob must be true or false"),
    ("model.rope_theta=-1", r"model.rope_theta must be in \(0"),
    ("train.betas=[0.9, 1.5]", r"train.betas must be in \[0, 1\)"),
    ("train.eps=.inf", "train.eps must be finite"),
    ("data.paths=[1]", r"data.paths\[0\] must be a string"),
    ("checkpoint.keep=0", "checkpoint.keep must be in"),
    ("train.zero_stage=3", r"train.zero_stage must be one of \[0, 1, 2\]"),
    ("moe.recompute=maybe", "moe.recompute must be true or false"),
    ("model.moe_impl=deepspeed", "moe.recompute needs model.moe_impl: turbomoe"),  # with recompute on below
    ("train.compile_moe=maybe", "train.compile_moe must be true or false"),
    ("train.compile_moe=true", "train.compile_moe needs model.moe_impl: turbomoe, moe.ep_size: 1"),  # tiny-cpu: ep 2
    ("train.cuda_graph=maybe", "train.cuda_graph must be true or false"),
    ("train.cuda_graph=true", "train.cuda_graph needs model.moe_impl: turbomoe, moe.ep_size: 1 or a moe.capacity_factor"),  # tiny-cpu: ep 2, dropless
    # Rules between keys that used to fail only once the process group was up (in build_moe, the first forward).
    ("model.norm_topk_prob=false", "moe_impl 'deepspeed' with num_experts_per_tok 2 always uses norm_topk_prob true"),
    ("model.num_experts_per_tok=1", "moe_impl 'deepspeed' with num_experts_per_tok 1 always uses norm_topk_prob false"),
    ("moe.min_capacity=100000", "moe.min_capacity 100000 exceeds the .* tokens of a micro-batch"),
    # tiny-cpu is dropless (capacity_factor null), which evaluates dropless too: it was ignored.
    ("moe.eval_capacity_factor=0.5", "moe.eval_capacity_factor 0.5 needs a moe.capacity_factor, got null"),
    # A step's seed, train.seed x 1000003 + step, overflowed int64 in torch.manual_seed at the first step.
    ("train.seed=35184372088832", r"train.seed must be in \[0, 9223344366821\] so that a step's seed"),
])
def test_every_value_typed_and_range_checked(override, message):
    """Each key's type and range are checked when the config loads, before any work (failed before:
    the first three ended in a raw TypeError; per_tok above 8, min_capacity -1 and wandb 'maybe'
    passed validation and failed, or not, after the process group was up)."""
    extra = {"model.num_experts=16": ["model.num_experts_per_tok=9"],
             "model.num_experts=4": ["model.num_experts_per_tok=8"],
             "model.moe_impl=deepspeed": ["moe.recompute=true"],
             "model.norm_topk_prob=false": ["model.moe_impl=deepspeed"],
             "model.num_experts_per_tok=1": ["model.moe_impl=deepspeed"],
             "moe.min_capacity=100000": ["model.num_experts_per_tok=1", "model.norm_topk_prob=false"]}.get(override, [])
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [override, *extra])


def test_seed_capped_where_step_seeds_fit_int64():
    """The largest seed accepted seeds every step (torch.manual_seed takes an int64); one more is refused."""
    steps = load_config(TINY).train.steps
    high = (2**63 - 1 - steps) // pretrain.STEP_SEED_STRIDE
    torch.manual_seed(load_config(TINY, [f"train.seed={high}"]).train.seed * pretrain.STEP_SEED_STRIDE + steps)
    with pytest.raises(ConfigError, match=f"train.seed must be in \\[0, {high}\\] .* got {high + 1}"):
        load_config(TINY, [f"train.seed={high + 1}"])


def test_eval_capacity_factor_needs_a_capacity_factor():
    """Dropless layers drop nothing in evaluation either: the model refuses what the config does."""
    from turbomoe.models import MoEArgs, Qwen3MoeForCausalLM
    cfg = load_config(TINY, ["moe.capacity_factor=1.25", "moe.eval_capacity_factor=2"])
    assert (cfg.moe.capacity_factor, cfg.moe.eval_capacity_factor) == (1.25, 2.0)
    with pytest.raises(ValueError, match="eval_capacity_factor 2.0 needs a capacity_factor, got None"):
        Qwen3MoeForCausalLM(cfg.model, MoEArgs(eval_capacity_factor=2.0))


@pytest.mark.parametrize("override,key,source", [
    ("train_micro_batch_size_per_gpu=4", "train_micro_batch_size_per_gpu 4 differs from 8", "train.micro_batch_size"),
    ("gradient_accumulation_steps=2", "gradient_accumulation_steps 2 differs from 1", "train.grad_accum"),
    ("train_batch_size=32", "train_batch_size 32 differs from 16", "train.micro_batch_size and train.grad_accum"),
    ("gradient_clipping=0.5", "gradient_clipping 0.5 differs from 1.0", "train.grad_clip"),
    ("zero_optimization.stage=2", "zero_optimization.stage 2 differs from 1", "train.zero_stage"),
    ("zero_optimization=2", "zero_optimization.stage None differs from 1", "train.zero_stage"),
    ("bf16.enabled=true", "bf16.enabled True differs from False", "train.precision"),  # auto: either way
    ("fp16.enabled=true", "fp16.enabled True differs from False", "train.precision"),
])
def test_deepspeed_section_may_not_change_what_the_recipe_sets(override, key, source):
    """The deepspeed section merged over the generated config changed the batch (a step's samples, which
    a resume checks), clipping or dtypes the recipe relies on. train_batch_size waits for the ranks
    (prepare's validate); under train.precision auto (bf16 on GPUs, fp32 on the CPU) both must agree."""
    with pytest.raises(ConfigError, match=f"deepspeed.{key}, which the recipe sets from {source}; set {source} "):
        validate(load_config(TINY, [f"deepspeed.{override}"]), world_size=2)


def test_deepspeed_section_may_repeat_what_the_recipe_sets():
    same = ["deepspeed.train_micro_batch_size_per_gpu=8", "deepspeed.train_batch_size=16",
            "deepspeed.gradient_clipping=1", "train.precision=fp32", "deepspeed.bf16.enabled=false",
            "deepspeed.fp16.enabled=false"]
    validate(load_config(TINY, same), world_size=2)
    # Beside those, anything: DeepSpeed's own settings, the documented dtype overrides.
    validate(load_config(TINY, ["deepspeed.communication_data_type=bf16", "deepspeed.data_types.grad_accum_dtype=bf16",
                                "deepspeed.zero_optimization.overlap_comm=true"]), world_size=2)


def test_null_section_takes_overrides(tmp_path):
    """A section whose keys are all commented out reads as null: --set fills it (it was "not a section")."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(open(TINY).read().replace("log:\n  wandb: true", "log:\n  # wandb: true"))
    assert load_config(str(cfg)).log.wandb and not load_config(str(cfg), ["log.wandb=false"]).log.wandb


def test_home_expanded_in_paths(tmp_path, monkeypatch):
    """~ in a path key is the home directory (no shell expands it after `--set key=` or in YAML), not ./~."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(TINY, ["log.dir=~/run", "data.source=text", "data.paths=[~/a.txt]"])
    assert (cfg.log.dir, cfg.checkpoint.dir, cfg.data.paths) == (
        str(tmp_path / "run"), str(tmp_path / "run" / "checkpoints"), [str(tmp_path / "a.txt")])
    assert load_config(TINY, ["checkpoint.dir=~/ckpt"]).checkpoint.dir == str(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=f"{tmp_path / 'hf'}/config.json does not exist"):
        load_config(TINY, ["model.init_from=~/hf"])


def test_resume_appends_only_to_its_own_runs_log(tmp_path, monkeypatch):
    """A resume writes on in log.dir's log only where that log's last checkpoint (or, before any, the one its
    run resumed from) is the one resumed: it appended to any log there, another run's too. A new log.dir
    (or one without a log) takes any resume."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    tag = tmp_path / "checkpoints" / "global_step4"
    tag.mkdir(parents=True)
    meta = {"step": 4, "world_size": 2, "config": load_config(TINY).to_dict()}
    (tag / checkpointing.COMPLETE).write_text(json.dumps(meta))
    log_dir = tmp_path / "run"

    def prepare(*records):
        if records:
            log_dir.mkdir(exist_ok=True)
            (log_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"type": "tr')
        return pretrain.prepare(pretrain.parse_args(["--config", TINY, "--set", f"log.dir={log_dir}",
                                                     "--resume", str(tag)]))

    fresh, other = {"type": "start", "resumed_from": None}, str(tmp_path / "other" / "global_step8")
    for records in ([], [fresh, {"type": "checkpoint", "path": str(tag)}],  # its own run; the next check fails
                    [{"type": "start", "resumed_from": str(tag)}],  # a resume of it that saved nothing yet
                    [fresh, {"type": "checkpoint", "path": str(tag)}, {"type": "start", "resumed_from": str(tag)}]):
        with pytest.raises(ConfigError, match="mp_rank_00_model_states.pt is missing"):
            prepare(*records)
    with pytest.raises(ConfigError, match=f"log.dir {log_dir}, which belongs to the run whose last checkpoint is "
                                          f"{other}; resume that checkpoint, or set log.dir to a new directory"):
        prepare(fresh, {"type": "checkpoint", "path": str(tag)}, {"type": "checkpoint", "path": other})
    with pytest.raises(ConfigError, match=r"last checkpoint is none \(it saved none\)"):
        prepare(fresh)


def test_numbers_yaml_reads_as_strings_are_accepted():
    """YAML 1.1 reads 1e-3 (no dot) as a string; a float key takes it as the number it spells."""
    assert load_config(TINY, ["train.lr=1e-3"]).train.lr == 1e-3


def test_bad_data_and_resume_fail_in_prepare(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as the launcher sets it for tiny-cpu's 2 ranks

    def prepare(*args):
        return pretrain.prepare(pretrain.parse_args(["--config", TINY, "--set", f"log.dir={tmp_path / 'run'}", *args]))

    with pytest.raises(ConfigError, match="missing.txt' does not exist"):
        prepare("--set", "data.source=text", "--set", f"data.paths=[{tmp_path / 'missing.txt'}]")
    with pytest.raises(ConfigError, match="no checkpoint there"):
        prepare("--resume", str(tmp_path))
    with pytest.raises(ConfigError, match="257 tokens, more than model.vocab_size 200"):
        prepare("--set", "model.vocab_size=200")
    (tmp_path / "latest").write_text("global_step4")
    with pytest.raises(ConfigError, match="already holds a checkpoint; continue that run with --resume"):
        prepare("--set", f"checkpoint.dir={tmp_path}")
    # A checkpoint of another model, or of another parallel layout, is refused before any work.
    (tmp_path / "global_step4").mkdir()
    meta = {"step": 4, "world_size": 2, "config": load_config(TINY, ["model.hidden_size=64"]).to_dict()}
    (tmp_path / "global_step4" / checkpointing.COMPLETE).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="model differs.*'hidden_size': \\(64, 128\\)"):
        prepare("--resume", str(tmp_path))
    meta["config"] = load_config(TINY).to_dict()
    (tmp_path / "global_step4" / checkpointing.COMPLETE).write_text(json.dumps(meta))
    # Another number of ranks or ep_size: the same samples a step (micro_batch_size x grad_accum x ranks),
    # from ZeRO 1/2 partitions.
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"'samples a step \(micro_batch_size x grad_accum x ranks\)': \(16, 32\)"):
        prepare("--resume", str(tmp_path))
    # ... every old rank's files there (this tag has only its marker; test_resume_needs_every_file_whole)
    with pytest.raises(ConfigError, match="mp_rank_00_model_states.pt is missing"):
        prepare("--resume", str(tmp_path), "--set", "train.micro_batch_size=4", "--set", "moe.ep_size=4")
    monkeypatch.setenv("WORLD_SIZE", "1")
    meta["config"]["train"]["zero_stage"] = 0
    (tmp_path / "global_step4" / checkpointing.COMPLETE).write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="written by 2 ranks with ep_size 2, this run has 1 ranks and ep_size 1: "
                                          "resuming on another layout needs ZeRO 1 or 2"):
        prepare("--resume", str(tmp_path), "--set", "train.grad_accum=2", "--set", "moe.ep_size=1",
                "--set", "train.zero_stage=0")
    meta["config"] = load_config(TINY).to_dict()
    (tmp_path / "global_step4" / checkpointing.COMPLETE).write_text(json.dumps(meta))
    monkeypatch.setenv("WORLD_SIZE", "2")
    # The data stream and the optimizer files as the checkpoint's (ZeRO 1 <-> 2 may change).
    # And what DeepSpeed's load restores on the same layout, reshard.py not: the optimizer's settings and
    # the base learning rate (a changed train.lr was ignored on the same layout, honoured on another).
    for override, key in (("train.seed=7", "train.seed"), ("data.seq_len=64", "data.seq_len"),
                          ("train.micro_batch_size=2", "samples a step"), ("train.precision=bf16",
                          "train.precision"), ("train.zero_stage=0", "train.zero_stage"), ("train.lr=1e-4", "train.lr"),
                          ("train.betas=[0.9, 0.99]", "train.betas"), ("train.eps=1e-6", "train.eps"),
                          ("train.weight_decay=0", "train.weight_decay"), ("train.fused_adamw=false",
                          "train.fused_adamw")):
        with pytest.raises(ConfigError, match=f"a resume needs .*'{key}"):
            prepare("--resume", str(tmp_path), "--set", override)
    # Past those, the files (this tag has only its marker; with them, test_resume_needs_every_file_whole):
    for extra in (["--set", "train.zero_stage=2"], ["--set", "train.micro_batch_size=4", "--set", "train.grad_accum=2"]):
        with pytest.raises(ConfigError, match="mp_rank_00_model_states.pt is missing"):
            prepare("--resume", str(tmp_path), *extra)
    with pytest.raises(ConfigError, match="is at step 4: nothing to run up to step 4"):
        prepare("--resume", str(tmp_path), "--stop-at-step", "4")
    # It saves into checkpoint.dir: never over another run's checkpoints.
    (tmp_path / "other" / "global_step2").mkdir(parents=True)
    with pytest.raises(ConfigError, match="other, which holds another run's checkpoints"):
        prepare("--resume", str(tmp_path), "--set", f"checkpoint.dir={tmp_path / 'other'}")
    # A fresh run never appends to another run's log.
    (tmp_path / "logged").mkdir()
    (tmp_path / "logged" / "log.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="logged already holds another run's log"):
        prepare("--set", f"log.dir={tmp_path / 'logged'}")
    # Too little data for one validation batch on every rank: here, not after the process group is up.
    (tmp_path / "small.txt").write_text("x" * 5000)
    with pytest.raises(ConfigError, match="validation samples are fewer than one batch on every rank"):
        prepare("--set", "data.source=text", "--set", f"data.paths=[{tmp_path / 'small.txt'}]")


def test_generated_deepspeed_config():
    cfg = load_config(TINY, ["train.grad_accum=3", "train.zero_stage=2", "deepspeed.zero_optimization.overlap_comm=true"])
    ds = deepspeed_config(cfg, world_size=2, bf16=False)
    assert ds["train_batch_size"] == cfg.train.micro_batch_size * 3 * 2
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert ds["gradient_clipping"] == cfg.train.grad_clip and ds["bf16"] == {"enabled": False}
    assert "data_types" not in ds
    # bf16 with ZeRO 1 accumulates gradients in fp32: DeepSpeed's BF16_Optimizer (notes/recipe_profile.md).
    bf16 = deepspeed_config(load_config(TINY, ["train.zero_stage=1"]), world_size=2, bf16=True)
    assert bf16["data_types"] == {"grad_accum_dtype": "fp32"} and bf16["bf16"] == {"enabled": True}
    assert bf16["communication_data_type"] == "fp32"  # and reduced in fp32, not rounded to bf16 first
    zero2 = deepspeed_config(cfg, world_size=2, bf16=True)
    assert "data_types" not in zero2 and "communication_data_type" not in zero2  # ZeRO 2 keeps DeepSpeed's defaults
    assert ds["timers"] == {"throughput": {"enabled": False}}  # it would sync the device twice a step

def test_cuda_graph_needs_bf16_zero1_and_a_gpu():
    for other in ("train.zero_stage=2", "train.precision=fp32"):
        with pytest.raises(ConfigError, match="train.zero_stage: 1 and bf16"):
            load_config(TINY, ["moe.ep_size=1", "train.cuda_graph=true", other])
    graphed = load_config(TINY, ["moe.ep_size=1", "train.cuda_graph=true"])
    load_config(TINY, ["moe.capacity_factor=1.25", "train.cuda_graph=true"])  # ep_size 2: fixed-size all-to-all
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="train.cuda_graph needs a GPU"):
            pretrain.train(graphed, None, None, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphed", [False, True])
def test_deterministic_runs_repeat_their_bits_on_a_gpu(tmp_path, graphed):
    """train.deterministic: two GPU runs of the same config log the same losses, gradient norms and
    validation losses bit for bit (bf16; eager, and as small-1gpu runs: the dense blocks compiled,
    forward and backward from CUDA graphs). Attention at these shapes (16 x 512 tokens, 8 heads) sums
    its backward with atomics unless told otherwise."""
    on = str(graphed).lower()
    grow = ["--set", "moe.ep_size=1", "--set", "train.precision=bf16", "--set", "train.deterministic=true",
            "--set", f"train.compile={on}", "--set", f"train.cuda_graph={on}",
            "--set", "data.seq_len=512", "--set", "train.micro_batch_size=16", "--set", "model.num_attention_heads=8",
            "--set", "model.num_key_value_heads=2", "--set", "checkpoint.every=0"]
    for run in ("a", "b"):
        launch(tmp_path / run, *grow, gpus=1)
    for kind, keys in (("train", ("loss", "aux_loss", "grad_norm", "expert_load_per_layer")), ("valid", ("valid_loss",))):
        a, b = records(tmp_path / "a", kind), records(tmp_path / "b", kind)
        assert [r["step"] for r in a] == [r["step"] for r in b] and a
        for ra, rb in zip(a, b):
            assert all(ra[k] == rb[k] for k in keys), (ra, rb)


def test_deterministic_sets_torchs_mode(monkeypatch):
    """train.deterministic turns on torch's deterministic algorithms (and cuBLAS's fixed workspace)
    before the model is built; without it the mode is left as the process had it."""
    calls = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda on, **kw: calls.append(on))
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(pretrain, "Qwen3MoeForCausalLM", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("built")))
    cfg = load_config(TINY, ["moe.ep_size=1"])
    for on in (False, True):
        cfg.train.deterministic = on
        with pytest.raises(RuntimeError, match="built"):
            pretrain.build_engine(cfg, 0, {})
        assert calls == ([True] if on else [])
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.utils.deterministic.fill_uninitialized_memory is False


def test_device_follows_deepspeeds_accelerator(monkeypatch):
    """CPU ranks on a GPU machine (DS_ACCELERATOR=cpu): no CUDA device is picked, whatever torch sees."""
    class Accelerator:
        def __init__(self, name):
            self.name = name

        def device_name(self):
            return self.name

    monkeypatch.setattr(pretrain.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pretrain, "get_accelerator", lambda: Accelerator("cpu"))
    assert not pretrain.uses_gpu()
    monkeypatch.setattr(pretrain, "get_accelerator", lambda: Accelerator("cuda"))
    assert pretrain.uses_gpu()
    monkeypatch.setattr(pretrain.torch.cuda, "is_available", lambda: False)
    assert not pretrain.uses_gpu()


def test_more_gpu_ranks_than_gpus_fail_clearly(monkeypatch, tmp_path, capsys):
    """A rank past the machine's GPUs (--num_gpus too large) says so, before any CUDA call, and prints
    it itself (configuration errors are printed by rank 0 alone)."""
    monkeypatch.setattr(pretrain, "uses_gpu", lambda: True)
    monkeypatch.setattr(pretrain.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as e:
        pretrain.main(["--config", TINY, "--set", "moe.ep_size=1", "--set", f"log.dir={tmp_path / 'run'}"])
    assert e.value.code == 2
    assert "pretrain.py: error: local rank 1 needs GPU 1, but 1 are visible" in capsys.readouterr().err


def test_token_ids_checked_on_the_host_batch():
    import numpy as np
    pretrain.check_token_ids(np.array([[0, 319]]), 320)
    pretrain.check_token_ids(np.zeros((0, 5), dtype=np.int64), 320)
    with pytest.raises(ValueError, match="token id 320 in the data is >= model.vocab_size 320"):
        pretrain.check_token_ids(np.array([[5, 320]]), 320)


def check_step_without_host_sync(r, one_pass=False):
    assert r["optimizer"] == ["BF16_Optimizer", "BF16_Optimizer"] and r["patched"], r
    assert r["one_pass"] == one_pass, r  # pretrain.adamw_with_copies on a GPU, torch's fused AdamW on the CPU
    (ds_loss, own_loss), (ds_norm, own_norm) = r["losses"], r["norms"]
    if not one_pass:  # torch's fused AdamW both ways
        assert ds_loss[0] == own_loss[0], r
        # The first step's fp32 weights differ by rounding (the norm summed in fp32 on the device, DeepSpeed's
        # in float64 on the host), so a bf16 weight can round the other way: the device's torch 2.11 CPU
        # ranks gave second losses 2.5e-6 apart where torch 2.13's are equal (2026-12-07).
        assert abs(ds_loss[1] - own_loss[1]) <= 2e-5 * abs(ds_loss[1]), r
    for a, b in zip(ds_loss, own_loss):
        assert abs(a - b) <= 1e-4 * abs(a), r
    assert all(abs(a - b) <= 1e-3 * a for a, b in zip(ds_norm[:-1], own_norm[:-1])), r
    assert all(n > 0.05 for n in ds_norm[:-1]), r  # above train.grad_clip: every step clipped
    assert r["first_step_param_diff"] <= 1e-6 * r["max_param"], r
    assert r["max_param_diff"] <= 1e-2 * r["max_param"], r
    assert r["nan_step_kept_weights"] == [True, True] and r["grads_cleared"] == [True, True], r
    assert r["accumulated_equal"] and r["accumulated_nonzero"], r  # the fp32 sums over micro-batches, bit for bit
    gradients, adds = r["adds"]  # the experts' gradients of a layer and weight in one add
    assert adds < gradients - 10, r
    assert not math.isfinite(ds_norm[-1]) and not math.isfinite(own_norm[-1]), r


STEP_SCRIPT = os.path.join(os.path.dirname(__file__), "recipe_step_script.py")


@pytest.mark.parametrize("device,comm", [("cpu", []), ("cpu", ["bf16"]), pytest.param("cuda", [], marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")])])
def test_step_without_host_sync_matches_deepspeeds(tmp_path, device, comm):
    """pretrain.step_without_host_sync, reduce_flat_gradients and accumulate_with_coalesced_adds against
    DeepSpeed's BF16_Optimizer.step, all-reduce and accumulation on the same engine and batches (two
    micro-batches a step: the fp32 gradient sums equal bit for bit), clipping active: the same losses
    and norms (the norm summed on the device in fp32, DeepSpeed's on the host in float64; clipping as a
    division inside the AdamW kernel, DeepSpeed's as a multiplication; on a GPU the one-pass AdamW that
    also writes the bf16 weights and clears the gradients), the same weights after one step to rounding;
    a NaN gradient skips the update (fp32 weights and Adam's moments unchanged) and clears the
    gradients, as DeepSpeed's does. With bf16 communication both round the gradients to bf16."""
    env = dict(os.environ, MASTER_PORT=str(free_port()), DS_ACCELERATOR=device)
    proc = subprocess.run([sys.executable, STEP_SCRIPT, str(tmp_path), "1", *comm], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "step_rank0.json") as f:
        check_step_without_host_sync(json.load(f), one_pass=device == "cuda")


def test_step_without_host_sync_over_expert_parallel_ranks(tmp_path):
    """The same on 2 CPU ranks (gloo, the deepspeed launcher), experts split over them (ep_size 2):
    each rank's expert groups' squared norms are summed over the expert-parallel group on the
    device, as DeepSpeed sums them; the dense gradients all-reduced over both ranks and the expert
    ones (one rank a group) averaged over the data-parallel size, as DeepSpeed's reduction does."""
    run_launcher(STEP_SCRIPT, str(tmp_path), "2")
    ranks = []
    for rank in range(2):
        with open(tmp_path / f"step_rank{rank}.json") as f:
            ranks.append(json.load(f))
        check_step_without_host_sync(ranks[-1])
    assert ranks[0]["norms"][0][:-1] == ranks[1]["norms"][0][:-1]  # one global norm on both ranks
    assert ranks[0]["norms"][1][:-1] == ranks[1]["norms"][1][:-1]


def test_log_interval_ends_after_the_device_read():
    """A log interval's time ends when its steps have run, i.e. after the read that waits for the
    device (here a read that takes 0.2 s): with no sync in the step the host runs ahead of the GPU,
    and a clock read before the wait timed the steps' issue (throughput above the GPU's)."""
    import time

    class SlowRead:
        def read(self, grad_accum, world):
            time.sleep(0.2)
            return [{"step": 1}]

    records, seconds = pretrain.read_interval(SlowRead(), 1, 1, time.perf_counter())
    assert records == [{"step": 1}] and seconds >= 0.2


def test_lr_schedule():
    f = [pretrain.lr_factor(s, 10, 110, 0.1) for s in range(110)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[10] == pytest.approx(1.0)
    assert f[60] == pytest.approx(0.55) and f[-1] > 0.1 and all(a >= b for a, b in zip(f[10:], f[11:]))


def test_overwriting_a_tag_moves_latest_back_first(tmp_path, monkeypatch):
    """A run resumed from step 4 saves step 6 again over the run it left: until the new step 6 is
    whole, `latest` names step 4, so a crash inside the save leaves a resumable directory; not the left
    run's later step 8 (the newest other complete tag, which `latest` named before 2026-12-05)."""
    class OneRank:
        get_rank = staticmethod(lambda: 0)
        barrier = staticmethod(lambda: None)

    class Crashes:
        def save_checkpoint(self, *args, **kwargs):
            raise KeyboardInterrupt  # killed while writing

    monkeypatch.setattr(checkpointing, "dist", OneRank)
    for step in (2, 4, 6, 8):
        (tmp_path / checkpointing.tag_of(step)).mkdir()
        (tmp_path / checkpointing.tag_of(step) / checkpointing.COMPLETE).write_text(json.dumps({"step": step}))
    (tmp_path / "latest").write_text("global_step6")
    with pytest.raises(KeyboardInterrupt):
        checkpointing.save(Crashes(), str(tmp_path), 6, keep=2, meta={})
    assert checkpointing.resolve(str(tmp_path)) == (str(tmp_path), "global_step4")
    # The only complete tag overwritten: no `latest` until the save is whole.
    only = tmp_path / "only" / checkpointing.tag_of(6)
    only.mkdir(parents=True)
    (only / checkpointing.COMPLETE).write_text(json.dumps({"step": 6}))
    (only.parent / "latest").write_text("global_step6")
    with pytest.raises(KeyboardInterrupt):
        checkpointing.save(Crashes(), str(only.parent), 6, keep=2, meta={})
    with pytest.raises(FileNotFoundError, match="no checkpoint there"):
        checkpointing.resolve(str(only.parent))


def test_checkpoint_bookkeeping(tmp_path):
    def tag(step, complete=True):
        d = tmp_path / checkpointing.tag_of(step)
        d.mkdir()
        if complete:
            (d / checkpointing.COMPLETE).write_text(json.dumps({"step": step}))

    for s in (2, 4, 6):
        tag(s)
    tag(3, complete=False)  # an older save that crashed
    tag(8, complete=False)  # a save that crashed just now
    (tmp_path / "latest").write_text("global_step6")
    assert checkpointing.resolve(str(tmp_path)) == (str(tmp_path), "global_step6")
    assert checkpointing.resolve(str(tmp_path / "global_step4")) == (str(tmp_path), "global_step4")
    with pytest.raises(FileNotFoundError, match="global_step8: not a complete checkpoint"):
        checkpointing.resolve(str(tmp_path / "global_step8"))
    checkpointing.prune(str(tmp_path), keep=2, current=6)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["global_step4", "global_step6",
                                                                          "global_step8"]
    # A run resumed from step 4 has just saved step 5: step 6 is of the run it left, kept until overwritten.
    tag(5)
    checkpointing.prune(str(tmp_path), keep=1, current=5)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["global_step5", "global_step6",
                                                                          "global_step8"]
    (tmp_path / "latest").write_text("global_step8")
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        checkpointing.resolve(str(tmp_path))


def test_config_error_of_every_rank_printed_by_rank_0_first(monkeypatch, tmp_path, capsys):
    """A rank other than 0 waits before it fails on an error that every rank finds, so that a launcher
    (which kills every rank when one fails) cannot kill rank 0 before it prints; it prints too if it is
    still running after the wait. Rank 0 fails at once."""
    waits = []
    monkeypatch.setattr(pretrain.time, "sleep", waits.append)
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            pretrain.main(["--config", TINY, "--set", "moe.ep_size=3", "--set", f"log.dir={tmp_path / 'run'}"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        label = "error" if rank == "0" else "error (rank 1)"
        assert f"pretrain.py: {label}: moe.ep_size 3 does not divide model.num_experts 8" in err
    assert waits == [pretrain.CONFIG_ERROR_GRACE_S]


def test_launcher_rejects_bad_input_before_work(tmp_path):
    proc = launch(tmp_path / "run", "--set", "moe.ep_size=3", check=False)
    assert proc.returncode != 0
    assert "pretrain.py: error: moe.ep_size 3 does not divide model.num_experts 8" in proc.stderr
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- launcher runs


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    launch(tmp)
    return tmp


def test_launcher_run_trains_and_checkpoints(full_run):
    train, valid = records(full_run, "train"), records(full_run, "valid")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert [r["step"] for r in valid] == [0, 4, 8] and valid[-1]["valid_loss"] < valid[0]["valid_loss"] - 1.0
    assert all(r["expert_load"] >= 1.0 and r["tokens_per_s"] > 0 for r in train)
    ds = json.loads((full_run / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 2 * load_config(TINY).train.micro_batch_size and ds["bf16"] == {"enabled": False}
    ckpt = full_run / "checkpoints"
    assert (ckpt / "latest").read_text() == f"global_step{STEPS}"
    files = set(os.listdir(ckpt / f"global_step{STEPS}"))
    # Every expert of both MoE layers, from both expert-parallel ranks, and both ranks' ZeRO shards.
    cfg = load_config(TINY)
    assert {f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"
            for layer in range(len(cfg.model.moe_layers())) for e in range(cfg.model.num_experts)} <= files
    assert {"mp_rank_00_model_states.pt", checkpointing.COMPLETE, "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= files
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("global_step")) == ["global_step4", "global_step8"]


def test_runs_without_a_launcher(tmp_path):
    """python recipes/pretrain.py alone is one rank (DeepSpeed had looked for MPI and failed)."""
    env = one_rank_env()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "pretrain.py"), "--config", TINY, *SHORT,
                           "--set", "train.steps=2", "--set", "train.warmup_steps=1", "--set", "eval.every=2", "--set", "checkpoint.every=2",
                           "--set", "moe.ep_size=1", "--set", f"log.dir={tmp_path}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in records(tmp_path, "train")] == [1, 2] and records(tmp_path, "summary")[0]["world_size"] == 1


def test_stop_and_resume_reproduces_the_uninterrupted_run(full_run, tmp_path):
    launch(tmp_path, "--stop-at-step", "3")
    assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step3"
    launch(tmp_path, "--resume")
    ref = {r["step"]: r for r in records(full_run, "train")}
    got = records(tmp_path, "train")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for r in got:
        for key in ("loss", "aux_loss", "lr", "grad_norm", "expert_load_per_layer"):
            assert r[key] == ref[r["step"]][key], (r["step"], key)
    ref_valid = {r["step"]: r["valid_loss"] for r in records(full_run, "valid")}
    assert {r["step"]: r["valid_loss"] for r in records(tmp_path, "valid")} == ref_valid


@pytest.mark.parametrize("ranks, ep_size, batch", [(1, 1, "train.grad_accum=2"), (4, 4, "train.micro_batch_size=4")])
def test_resume_on_another_layout_continues_the_run(full_run, tmp_path, ranks, ep_size, batch):
    """The 2-rank, ep_size 2 run's step-4 checkpoint resumed on 1 rank (every expert) and on 4 (two
    experts each), a step's samples kept: the run goes on as the uninterrupted one, its weights, every
    expert and Adam's moments reassembled (step 5's loss, a function of the weights alone, is equal to
    fp32's rounding: an expert's rows are other GEMM shapes on another layout, and CPU BLAS need not
    give a row the same bits at another row count (MKL on an AMD EPYC did not for 1-3 rows, 2026-11-28);
    then the gradients' summation order differs too), and its step-8 checkpoint holds what the
    uninterrupted run's does."""
    launch(tmp_path, "--resume", str(full_run / "checkpoints" / "global_step4"), "--set", f"moe.ep_size={ep_size}",
           "--set", batch, ranks=ranks)
    ref = {r["step"]: r for r in records(full_run, "train")}
    got = records(tmp_path, "train")
    assert [r["step"] for r in got] == [5, 6, 7, 8]
    assert got[0]["loss"] == pytest.approx(ref[5]["loss"], rel=1e-6, abs=0)
    assert got[0]["expert_load_per_layer"] == ref[5]["expert_load_per_layer"]
    for r in got:
        assert r["lr"] == ref[r["step"]]["lr"]
        assert abs(r["loss"] - ref[r["step"]]["loss"]) < 2e-4, r["step"]
        assert r["grad_norm"] == pytest.approx(ref[r["step"]]["grad_norm"], rel=1e-3), r["step"]
    from turbomoe.export import RunCheckpoint  # noqa: E402 (after the launcher's CPU environment is set)
    keys = ("master", "exp_avg", "exp_avg_sq")
    start, want = (RunCheckpoint(str(full_run / "checkpoints" / f"global_step{s}")).zero_states(keys) for s in (4, 8))
    have_ckpt = RunCheckpoint(str(tmp_path / "checkpoints" / "global_step8"))
    have = have_ckpt.zero_states(keys)
    assert have_ckpt.world_size == ranks and have_ckpt.ep_size == ep_size and have_ckpt.optimizer_step() == 8
    # Tiny-cpu's learning rate makes Adam amplify the summation order's last bits in rarely used rows
    # (4 ranks: up to 2% of a tensor's change over the 4 steps); Adam's moments left at zero by the
    # resume give 25% to 430% (measured), so the bound sits between.
    for key in keys:
        for name, t in want[key].items():
            scale = (t - start[key][name]).norm() if key == "master" else t.norm()
            assert (have[key][name] - t).norm() <= 0.08 * scale, (key, name)


def test_resume_needs_every_file_whole(full_run, tmp_path, monkeypatch):
    """A resume reads files that other ranks wrote (another layout) or its own rank's (DeepSpeed's load,
    which fails inside torch's loader on one rank): one missing or cut short is an error naming it, on
    every rank, before any work. ZeRO 1 <-> 2 and another split of the same samples a step resume."""
    tag = tmp_path / "global_step4"
    shutil.copytree(full_run / "checkpoints" / "global_step4", tag)
    # The resume runs on CPU ranks as full_run did (its precision auto was fp32): on a GPU machine this
    # process's accelerator is CUDA, and prepare would read auto as bf16 and refuse the checkpoint.
    monkeypatch.setattr(pretrain, "uses_gpu", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    same = ["--config", TINY, *SHORT, "--set", f"log.dir={tmp_path / 'same'}", "--resume", str(tag)]
    for extra in (["--set", "train.zero_stage=2"], ["--set", "train.micro_batch_size=4", "--set", "train.grad_accum=2"]):
        assert pretrain.prepare(pretrain.parse_args(same + extra))[1] == (str(tmp_path), "global_step4")
    partition = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    whole = partition.read_bytes()
    partition.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ConfigError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt: not a complete torch.save file"):
        pretrain.prepare(pretrain.parse_args(same))
    partition.write_bytes(whole)
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = ["--config", TINY, *SHORT, "--set", f"log.dir={tmp_path / 'run'}", "--resume", str(tag),
            "--set", "train.grad_accum=2", "--set", "moe.ep_size=1"]
    assert pretrain.prepare(pretrain.parse_args(args))[1] == (str(tmp_path), "global_step4")
    expert = tag / "layer_0_expert_3_mp_rank_00_model_states.pt"
    whole = expert.read_bytes()
    expert.write_bytes(whole[:-1])
    with pytest.raises(ConfigError, match="layer_0_expert_3_mp_rank_00_model_states.pt: not a complete torch.save"):
        pretrain.prepare(pretrain.parse_args(args))
    expert.write_bytes(whole)
    (tag / "layer_1_expert_6_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(ConfigError, match="layer_1_expert_6_mp_rank_00_model_states.pt is missing: expert 6 of MoE "
                                          "layer 1, written by expert-parallel rank 1 of 2"):
        pretrain.prepare(pretrain.parse_args(args))
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    shutil.copy(full_run / "checkpoints" / "global_step4" / "layer_1_expert_6_mp_rank_00_model_states.pt", tag)
    with pytest.raises(ConfigError, match=r"optimizer partitions of ranks \[0\], expected one for each of the 2"):
        pretrain.prepare(pretrain.parse_args(args))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_resume_on_another_layout_on_gpus(tmp_path):
    """On GPUs, bf16 (DeepSpeed's bf16 optimizer, the recipe's fused AdamW without host sync, the
    one-pass update): a 2-GPU ep_size 2 run's step-4 checkpoint resumed on one GPU with every expert,
    its forward and backward replayed from CUDA graphs: the loss goes on as the 2-GPU run's (bf16:
    the summation order moves the last bits) and the learning rate is the same."""
    bf16 = ["--set", "train.precision=bf16"]
    launch(tmp_path / "two", *bf16, gpus=2)
    launch(tmp_path / "one", *bf16, "--resume", str(tmp_path / "two" / "checkpoints" / "global_step4"),
           "--set", "moe.ep_size=1", "--set", "train.grad_accum=2", "--set", "train.cuda_graph=true", gpus=1)
    ref = {r["step"]: r for r in records(tmp_path / "two", "train")}
    got = records(tmp_path / "one", "train")
    assert [r["step"] for r in got] == [5, 6, 7, 8]
    for r in got:
        assert r["lr"] == ref[r["step"]]["lr"]
        assert r["loss"] == pytest.approx(ref[r["step"]]["loss"], rel=5e-3), r["step"]


@pytest.mark.parametrize("name, world, billions", [("tiny-cpu", 2, (0.001, 0.003)), ("small-1gpu", 1, (0.3, 0.4)),
                                                   ("1b-4gpu", 4, (0.95, 1.1))])
def test_shipped_configs(name, world, billions):
    from turbomoe.models import Qwen3MoeForCausalLM
    cfg = load_config(os.path.join(ROOT, "recipes", "configs", f"{name}.yaml"))
    validate(cfg, world_size=world)
    assert billions[0] < cfg.model.num_parameters() / 1e9 < billions[1]
    with torch.device("meta"):  # the full model, no memory: its size is what the config says
        model = Qwen3MoeForCausalLM(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == cfg.model.num_parameters()


def test_wandb_online_only_with_a_key(tmp_path, monkeypatch):
    import run_log
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert not run_log.wandb_key_configured()
    netrc = tmp_path / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password 0123456789\n")
    netrc.chmod(0o600)
    assert run_log.wandb_key_configured()
    netrc.unlink()
    monkeypatch.setenv("WANDB_API_KEY", "0123456789")
    assert run_log.wandb_key_configured()
