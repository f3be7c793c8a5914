"""turbomoe.kernels.adamw's input checks, and the recipe's one-pass optimizer step
(recipes/pretrain.py: step_without_host_sync over adamw_with_copies), which otherwise runs on a GPU
only, on the CPU under the Triton interpreter: against torch's fused AdamW, a skipped step, and a
checkpointed run resumed bit for bit. Natively on a GPU, under the interpreter on the CPU:
    TRITON_INTERPRET=1 pytest tests/test_adamw_review_triton.py
This file is also the script that the recipe test runs in a process of its own (python FILE DIR).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs a GPU or TRITON_INTERPRET=1 set before triton kernels are defined")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes", "configs", "tiny-cpu.yaml")


def test_wrong_dtypes_are_errors():
    """16-bit masters failed inside the compiler, integer ones and an int8 copy ran and wrote integers."""
    from turbomoe.kernels.adamw import adamw_step

    def step(dtype=torch.float32, lp=None):
        p = torch.ones(10, dtype=dtype, device=DEVICE)
        adamw_step(p, torch.ones_like(p), torch.zeros_like(p), torch.zeros_like(p), torch.ones((), device=DEVICE),
                   lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, param_lp=lp)
    for dtype in (torch.bfloat16, torch.int32):
        with pytest.raises(TypeError, match=f"param must be float32 or float64, got {dtype}"):
            step(dtype)
    with pytest.raises(TypeError, match="param_lp must be float16 or bfloat16, got torch.int8"):
        step(lp=torch.zeros(10, dtype=torch.int8, device=DEVICE))


def test_resume_refuses_a_changed_grad_clip(monkeypatch, tmp_path):
    """DeepSpeed's load restores the checkpoint's clip_grad on the same layout (a changed grad_clip was
    ignored there) and reshard.py keeps the config's: as for lr, a resume refuses the change."""
    pytest.importorskip("deepspeed")
    monkeypatch.syspath_prepend(os.path.join(ROOT, "recipes"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    import pretrain
    from recipe_config import ConfigError, load_config
    meta = {"step": 4, "world_size": 1, "config": load_config(TINY, ["moe.ep_size=1"]).to_dict()}
    with pytest.raises(ConfigError, match=r"a resume needs .*'train.grad_clip': \(1.0, 0.5\)"):
        pretrain.check_resumable(load_config(TINY, ["moe.ep_size=1", "train.grad_clip=0.5"]), meta, str(tmp_path))


def test_recipe_one_pass_step_and_resume(tmp_path):
    """The recipe's bf16 engine (tiny-cpu, smaller; clipping active) with its one-pass step forced on
    the CPU: its first step as torch's fused AdamW's (the path the CPU takes) to rounding, its bf16
    weights its masters rounded (truncated by the interpreter: within a bf16 ulp); a NaN gradient
    skips the update (masters, bf16 weights, moments and Adam's step count kept, gradients cleared,
    the learning rate moves on); a run stopped at a checkpoint and resumed takes the uninterrupted
    run's steps bit for bit, the skipped one among them."""
    pytest.importorskip("deepspeed")
    from launching import free_port, launcher_env
    env = dict(launcher_env(cpu=True), TRITON_INTERPRET="1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["one_pass"] == [0, 5, 3], r  # steps taken by adamw_with_copies: none of torch's engine
    assert r["first_step_diff"] <= 1e-6 * r["first_step_max"] and r["first_moments_equal"], r
    assert r["lp_within_ulp"] and r["grads_cleared"], r
    assert r["skip_kept"] and r["steps"] == [4.0] * len(r["steps"]) and r["skip_lr"][0] > r["skip_lr"][1], r
    assert str(r["uninterrupted"]) == str(r["resumed"]) and r["resumed_state_equal"], r  # str: the NaN norm too


def run_recipe(out_dir: str):
    """test_recipe_one_pass_step_and_resume's process: one CPU rank (gloo), Triton interpreted."""
    from contextlib import nullcontext
    from unittest import mock
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    import checkpointing
    import deepspeed
    import pretrain

    small = [f"model.{k}={v}" for k, v in (("hidden_size", 32), ("intermediate_size", 64), ("moe_intermediate_size", 32),
                                            ("num_hidden_layers", 2), ("num_attention_heads", 2),
                                            ("num_key_value_heads", 1), ("head_dim", 16), ("num_experts", 4))]
    sets = [*small, "data.seq_len=32", "train.micro_batch_size=2", "moe.ep_size=1", "train.precision=bf16",
            "train.grad_clip=0.05", "train.steps=10", "train.warmup_steps=2", "log.wandb=false", f"log.dir={out_dir}"]
    cfg, _, samples = pretrain.prepare(pretrain.parse_args(["--config", TINY, *(a for s in sets for a in ("--set", s))]))
    deepspeed.init_distributed(dist_backend="gloo")
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    taken, adamw_with_copies = [], pretrain.adamw_with_copies  # taken: the optimizers whose steps took the one pass
    pretrain.adamw_with_copies = lambda opt, inner, clear=True: taken.append(opt) or adamw_with_copies(opt, inner, clear)

    def build(one_pass: bool, resuming=False):
        # no CUDA tensors here: the one-pass step forced (the Triton interpreter runs it)
        with mock.patch.object(pretrain, "fused_adamw_applies", lambda opt, inner: True) if one_pass else nullcontext():
            return pretrain.build_engine(cfg, 0, pretrain.deepspeed_config(cfg, 1, True), resuming)[0]

    def step(engine, i, nan=False):
        torch.manual_seed(cfg.train.seed * pretrain.STEP_SEED_STRIDE + i)
        batch = pretrain.to_device(samples.train_batch(i, 0, 1, 0, 1, cfg.train.micro_batch_size), torch.device("cpu"))
        out = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(out.loss + cfg.moe.aux_loss_coef * out.aux_loss)
        if nan:
            engine.optimizer.fp32_groups_gradients_flat[0][0] = float("nan")
        lr = engine.get_lr()[0]
        engine.step()
        return [out.loss.item(), float(engine.get_global_grad_norm()), lr]

    def state(engine):
        opt = engine.optimizer
        adam = [s[k] for s in opt.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq", "step")]
        return [t.clone() for t in (*opt.fp32_groups_flat_partition, *opt.bf16_groups_flat, *adam)]

    ref, run = build(False), build(True)
    for engine in (ref, run):
        step(engine, 0)
    masters = [e.optimizer.fp32_groups_flat_partition for e in (ref, run)]
    moments = [[s[k] for s in e.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")] for e in (ref, run)]
    r = {"first_step_diff": max((a - b).abs().max().item() for a, b in zip(*masters)),
         "first_step_max": max(a.abs().max().item() for a in masters[0]),
         "first_moments_equal": all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(*moments)),
         "lp_within_ulp": all(((lp[:hp.numel()].float() - hp).abs() <= hp.abs() * 2.0**-7).all().item()
                              for lp, hp in zip(run.optimizer.bf16_groups_flat, masters[1])),
         "grads_cleared": all(not g.any() for g in run.optimizer.fp32_groups_gradients_flat)}
    step(run, 1)
    checkpointing.save(run, ckpt_dir, 2, 1, {"world_size": 1, "config": cfg.to_dict()})
    uninterrupted = [step(run, 2)]
    before = state(run)
    uninterrupted.append(step(run, 3, nan=True))
    after = state(run)
    r.update(skip_kept=all(torch.equal(a, b) for a, b in zip(before, after)),
             skip_lr=[uninterrupted[-1][2], run.get_lr()[0]],
             grads_cleared=r["grads_cleared"] and all(not g.any() for g in run.optimizer.fp32_groups_gradients_flat))
    uninterrupted.append(step(run, 4))
    resumed_run = build(True, resuming=True)
    with torch.no_grad():  # as pretrain.train loads it
        resumed_run.load_checkpoint(ckpt_dir, tag=checkpointing.tag_of(2))
    resumed = [step(resumed_run, i, nan=i == 3) for i in (2, 3, 4)]
    r.update(uninterrupted=uninterrupted, resumed=resumed,
             resumed_state_equal=all(torch.equal(a, b) for a, b in zip(state(run), state(resumed_run))),
             steps=[s["step"].item() for s in resumed_run.optimizer.state.values()],
             one_pass=[sum(opt is e.optimizer for opt in taken) for e in (ref, run, resumed_run)])
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(r, f)


if __name__ == "__main__":
    run_recipe(sys.argv[1])
