"""The performance accounting behind the README's numbers, checked against counts derived here by hand:
model FLOPs per token (MFU), the per-GPU peaks, the decode layers' weight-read floors, the published
MFU and floor values recomputed from their raw data, and the timing helpers' rules."""
import json
import os
import sys

import pytest
import torch
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from turbomoe.models.config import ModelConfig  # noqa: E402

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8)


def hand_flops_per_token(c: ModelConfig, seq_len: int) -> float:
    """Training FLOPs a token, from the matmuls one by one: 2 a multiply-add forward, x3 with backward."""
    h, d = c.hidden_size, c.head_dim
    fwd = 0
    for i in range(c.num_hidden_layers):
        fwd += 2 * h * c.num_attention_heads * d          # q
        fwd += 2 * 2 * h * c.num_key_value_heads * d      # k, v
        fwd += 2 * c.num_attention_heads * d * h          # o
        # q.k and p.v over the keys a causal query sees, (S + 1) / 2 on average, per query head
        fwd += 2 * 2 * c.num_attention_heads * d * seq_len / 2
        if c.is_moe_layer(i):
            fwd += 2 * h * c.num_experts                                     # router
            fwd += c.num_experts_per_tok * 2 * 3 * h * c.moe_intermediate_size  # k SwiGLU experts, 3 matrices
        else:
            fwd += 2 * 3 * h * c.intermediate_size
    fwd += 2 * h * c.vocab_size  # lm head (the embedding lookup is no matmul)
    return 3 * fwd


@pytest.mark.parametrize("name", ["tiny-cpu", "small-1gpu", "1b-4gpu"])
def test_flops_per_token_of_the_recipes(name):
    y = yaml.safe_load(open(os.path.join(ROOT, "recipes", "configs", f"{name}.yaml")))
    c, S = ModelConfig.from_dict(y["model"]), y["data"]["seq_len"]
    # the config counts the norms' weights as matmul parameters: a few parts in 10^4
    assert c.flops_per_token(S) == pytest.approx(hand_flops_per_token(c, S), rel=2e-3)


def test_qwen3_30b_a3b_counts():
    c = ModelConfig(**QWEN3_30B_A3B)
    assert c.num_parameters() == pytest.approx(30.53e9, rel=2e-3)
    assert c.num_parameters(active=True) == pytest.approx(3.35e9, rel=2e-3)
    for S in (1024, 4096):
        assert c.flops_per_token(S) == pytest.approx(hand_flops_per_token(c, S), rel=1e-4)


def test_published_recipe_mfu_reproduces():
    """notes/bench_recipe.json (README "Training speed"): MFU = tokens/s x FLOPs a token / (GPUs x 989 TFLOP/s)."""
    d = json.load(open(os.path.join(ROOT, "notes", "bench_recipe.json")))
    y = yaml.safe_load(open(os.path.join(ROOT, d["config"])))
    c, S = ModelConfig.from_dict(y["model"]), y["data"]["seq_len"]
    for run in d["runs"]:
        s = run["summary"]
        assert s["mfu"] == pytest.approx(s["tokens_per_s"] * c.flops_per_token(S) / (s["world_size"] * 989e12),
                                         rel=1e-4)
    assert d["runs"][0]["summary"]["mfu"] == pytest.approx(0.262, abs=5e-4)  # README: 26.2%


@pytest.mark.parametrize("device_name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("Some Unknown GPU", None)])
def test_peak_by_device_name(monkeypatch, device_name, tflops):
    import run_log
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: device_name)
    peak = run_log.peak_flops(None, on_gpu=True)
    assert peak == (None if tflops is None else tflops * 1e12)
    assert run_log.peak_flops(500.0, on_gpu=True) == 500e12  # configured wins
    assert run_log.peak_flops(None, on_gpu=False) is None


def test_profile_recipe_peak_of_all_ranks():
    import profile_recipe
    assert profile_recipe.all_ranks_peak(989e12, 2) == 2 * 989e12
    assert profile_recipe.all_ranks_peak(None, 2) is None  # an unknown GPU: no MFU, no TypeError


def test_profile_recipe_gpu_time_by_line():
    """Kernels tied to their launch by correlation id (runtime or driver API), the launch to the aten ops
    and Python lines around it on its thread; an autograd node named; a kernel whose launch the trace
    lacks kept apart; copies and sets counted."""
    import profile_recipe

    def x(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}
    events = [
        x("python_function", "recipes/pretrain.py(10): step", 0, 100),
        x("python_function", "torch/nn/modules/module.py(1): _call_impl", 1, 98),
        x("python_function", "turbomoe/nn/layer.py(20): forward", 2, 90),
        x("cpu_op", "aten::copy_", 5, 10),
        x("cuda_runtime", "cudaLaunchKernel", 6, 2, correlation=1),
        x("cpu_op", "aten::mm", 20, 10),
        x("cuda_driver", "cuLaunchKernelEx", 21, 2, correlation=2),
        x("cuda_runtime", "cudaMemsetAsync", 40, 1, correlation=3),  # no op around it
        x("cpu_op", "autograd::engine::evaluate_function: MulBackward0", 200, 20, tid=2),
        x("cpu_op", "aten::mul", 201, 10, tid=2),
        x("cuda_runtime", "cudaLaunchKernel", 202, 2, tid=2, correlation=4),
        x("kernel", "copy_kernel", 10, 7.0, tid=7, correlation=1),
        x("kernel", "copy_kernel", 30, 3.0, tid=7, correlation=1),
        x("kernel", "nvjet_gemm", 25, 50.0, tid=7, correlation=2),
        x("gpu_memset", "Memset", 45, 1.0, tid=7, correlation=3),
        x("kernel", "mul_kernel", 210, 4.0, tid=7, correlation=4),
        x("kernel", "lost", 300, 2.0, tid=7, correlation=99),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0},
    ]
    here = "turbomoe/nn/layer.py(20): forward < recipes/pretrain.py(10): step"
    assert profile_recipe.gpu_time_by_line(events) == [
        (("aten::mm", here), (50.0, 1)),
        (("aten::copy_", here), (10.0, 2)),
        (("aten::mul @ MulBackward0", ""), (4.0, 1)),
        (("(launch not traced)", ""), (2.0, 1)),
        (("(no aten op)", here), (1.0, 1)),
    ]
    assert profile_recipe.gpu_time_by_line(events, lines=1)[0][0] == ("aten::mm", "turbomoe/nn/layer.py(20): forward")
    # a child that starts with its parent is still the inner one
    assert profile_recipe._enclosing([(0, 10, "inner"), (0, 100, "outer")], [5, 50]) == {5: ["inner", "outer"],
                                                                                        50: ["outer"]}


def test_decode_floor_bytes():
    import bench_inference
    q, scout = bench_inference.LAYERS["qwen3-30b-a3b"], bench_inference.LAYERS["scout-tp8"]
    # Qwen3-30B-A3B at T = 1: the 8 routed experts' w1 [2048, 1536] and w2 [768, 2048], and the router
    assert bench_inference.decode_weight_bytes(q, 8) == 8 * (2048 * 1536 + 768 * 2048) * 2 + 128 * 2048 * 2
    # Scout's shard: one routed expert and the shared one, F 1024, M 5120
    assert bench_inference.decode_weight_bytes(scout, 1) == 2 * 3 * 5120 * 1024 * 2 + 16 * 5120 * 2


def test_generation_floor_bytes_at_qwen3_30b():
    """generate-30b's floor, counted by hand for one row: per layer q/k/v [2048, 40 x 128] and o
    [32 x 128, 2048], the router, the 8 experts one token uses, the KV cache of 100 tokens (2 x 4 heads
    x 128); then the LM head; bf16. With 128 tokens nearly every expert is used."""
    import bench_inference
    q = bench_inference.QWEN3_30B
    per_layer = 2048 * 5120 + 4096 * 2048 + 128 * 2048 + 8 * 3 * 2048 * 768 + 100 * 2 * 4 * 128
    elements = 48 * per_layer + 151936 * 2048
    assert bench_inference.decode_floor_ms(q, 1, 100, copy_gbs=1.0) == pytest.approx(elements * 2 / 1e9 * 1e3, rel=1e-12)
    used = (bench_inference.decode_floor_ms(q, 128, 0, 1.0) * 1e6 / 2 - 151936 * 2048) / 48 - 2048 * 5120 - 4096 * 2048 \
        - 128 * 2048
    assert 127 < used / (3 * 2048 * 768) < 128


@pytest.mark.parametrize("path", ["bench_inference.json", "bench_inference_h200.json"])
def test_published_decode_floors_reproduce(path):
    import bench_inference
    d = json.load(open(os.path.join(ROOT, "notes", path)))
    for r in d["layer"]:
        us = bench_inference.decode_weight_bytes(bench_inference.LAYERS[r["layer"]], r["experts_used"]) \
            / (d["copy_GBs"] * 1e9) * 1e6
        assert r["floor_us"] == pytest.approx(us, rel=1e-6)
        assert r["floor_fraction"] == pytest.approx(r["floor_us"] / r["auto_us"], rel=1e-6)


def test_generate_timing_takes_the_fastest(monkeypatch):
    """bench_inference's generate section times every way (turbomoe and its peers) through fastest_wall:
    the fastest of the same number of calls, each between two syncs."""
    import bench_inference
    times, calls, syncs = iter([5.0, 2.0, 3.0]), [], []
    clock = iter([0.0, 5.0, 10.0, 12.0, 20.0, 23.0])
    monkeypatch.setattr(bench_inference.time, "perf_counter", lambda: next(clock))
    out, t = bench_inference.fastest_wall(lambda: calls.append(next(times)) or len(calls), lambda: syncs.append(1),
                                          repeats=3)
    assert len(calls) == 3 and len(syncs) == 6 and t == 2.0 and out == 2


def test_summarize_run_cut_off_rate(tmp_path, capsys):
    """A run cut off before its summary: tokens/s over the logged steps is all their tokens over all their time."""
    import summarize_run
    recs = [{"type": "train", "step": i, "loss": 1.0, "aux_loss": 0.0, "expert_load": 1.0, "mfu": None,
             "tokens_per_s": 1000 / dt, "step_time_s": dt} for i, dt in enumerate([1.0] * 10 + [0.5, 2.0, 0.5], 1)]
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(SystemExit):
        summarize_run.main(str(log))
    steady = [r for r in recs][1:]  # the first tenth dropped
    rate = 1000 * len(steady) / sum(r["step_time_s"] for r in steady)
    assert f"{rate:,.0f} tokens/s" in capsys.readouterr().out


def test_bench_deepspeed_identity_experts_runs_the_layer_without_experts(monkeypatch):
    """bench_deepspeed / profile_host's `--identity-experts`: the drop-in layer with its experts swapped
    for the identity runs forward and backward (the layer's check of reassigned experts must not look
    for experts in the identity), gives its routed tokens back as the combine's sum, and gets its experts
    and their fast path back after."""
    from bench_deepspeed import identity_experts
    from turbomoe.integrations import deepspeed as tds
    monkeypatch.delenv("TURBOMOE_BACKEND", raising=False)  # CPU tensors: the reference backend
    torch.manual_seed(0)
    layer = tds.MoE(16, tds.SwiGLUExpert(16, 24), 4, k=2, drop_tokens=False)
    inner = layer.deepspeed_moe
    experts, fast_path = inner.experts, inner.expert_fast_path
    x = torch.randn(10, 16, requires_grad=True)
    with identity_experts(layer):
        out = layer(x)[0]
        out.sum().backward()
    # k = 2 renormalised over kept routes, dropless: each token's weights sum to 1, identity rows give x
    torch.testing.assert_close(out, x.detach(), rtol=1e-5, atol=1e-5)
    assert inner.experts is experts and inner.expert_fast_path == fast_path
    layer(x)[0].sum().backward()  # the real experts again
