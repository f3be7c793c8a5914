"""The library's error paths that no other CPU test reached (coverage.py over the CPU suite, the
*_triton.py files under TRITON_INTERPRET=1 included): each `raise` (and CLI p.error) driven through the
API that users call, the exception type and a distinctive part of its message asserted, and where it
applies that nothing was left half-done (the object unchanged, no output directory, no cache).

Three faults found on the way were fixed (notes/robustness.md, 2026-12-06 22:40): an unreadable stored
dtype refused after earlier tensors were copied into the model, sample_second_expert's shape message
without the scores' shape, and data.valid_fraction of another type failing inside its comparison. Not
a _triton file: no Triton interpreter here; the kernel launchers are only called where their argument
checks fire before any launch. Lines that run only on a GPU (a CUDA tensor first, or a CUDA build) are
not tested here (notes/robustness.md lists them)."""
import json
import os
import re
import struct
import sys
import types

import numpy as np
import pytest
import torch

from turbomoe import ops

import tiny_qwen3
from tiny_qwen3 import fake_run, gen, hf_dir  # noqa: F401 (hf_dir: a fixture)

# ----------------------------------------------------------------------------- shared small things

TINY = {**tiny_qwen3.TINY, "max_position_embeddings": 16}


def tiny_model(seed=0, **over):
    return tiny_qwen3.tiny_model(seed, **{"max_position_embeddings": 16, **over})


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


def unchanged(module, before) -> bool:
    after = snapshot(module)
    return after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def hf_variant(hf_dir, tmp_path, config=None, files=None) -> str:
    """A copy of hf_dir with config.json updated by config (a dict) and files(path) run on it."""
    import shutil
    path = str(tmp_path / "variant")
    shutil.copytree(hf_dir, path)
    if config is not None:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        raw.update(config)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(raw, f)
    if files is not None:
        files(path)
    return path


# ----------------------------------------------------------------------------- turbomoe.ops


def test_forced_backends_on_cpu_tensors(monkeypatch):
    """ops.py:60 (triton without CUDA or the interpreter) and :64 (cuda on CPU tensors)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TURBOMOE_BACKEND", raising=False)
    logits = torch.randn(5, 4, generator=gen(1))
    with pytest.raises(RuntimeError, match="the triton backend needs CUDA tensors, or TRITON_INTERPRET=1"):
        ops.topk_gating(logits, 2, backend="triton")
    with pytest.raises(RuntimeError, match="the cuda backend needs CUDA tensors"):
        ops.topk_gating(logits, 2, backend="cuda")
    monkeypatch.setenv("TURBOMOE_BACKEND", "triton")  # forced by the environment: the same check
    with pytest.raises(RuntimeError, match="the triton backend needs CUDA tensors"):
        ops.topk_gating(logits, 2)


def test_cutlass_headers_missing_names_the_wheel(monkeypatch):
    """csrc/__init__.py:105: without the nvidia-cutlass wheel the grouped GEMM's build stops with the
    pip command, before any compiler runs."""
    import importlib.util
    from turbomoe import csrc
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "cutlass_library" else find_spec(name, *a))
    with pytest.raises(ImportError, match=r"CUTLASS's headers: pip install nvidia-cutlass"):
        csrc.cutlass_include_dirs()


def test_index_tables_must_be_tensors():
    """ops.py:104: a list of ids is a TypeError naming expert_ids, not an AttributeError."""
    with pytest.raises(TypeError, match="expert_ids must be a torch.Tensor, got list"):
        ops.assign_slots([[0, 1]], torch.rand(1, 2, generator=gen(2)), 4)


def test_check_index_shape_branch():
    """ops.py:108: no caller of _check_index passes shape (the branch is dead through the API); the
    helper's own check, for the record."""
    with pytest.raises(ValueError, match=r"slots must have shape \(3, 2\), got \(3, 1\)"):
        ops._check_index("slots", torch.zeros(3, 1, dtype=torch.int32), (3, 2))


def test_routing_needs_an_expert_column():
    """ops.py:165."""
    with pytest.raises(ValueError, match="logits must have at least one expert column"):
        ops.topk_gating(torch.empty(3, 0), 1)


def test_sample_second_expert_argument_errors():
    """ops.py:218, :221, :231."""
    g = gen(3)
    logits = torch.randn(6, 4, generator=g)
    first = ops.topk_gating(logits, 1)
    with pytest.raises(TypeError, match="logits must be float32 or float64 .*got torch.bfloat16"):
        ops.sample_second_expert(logits.bfloat16(), first)
    one = torch.randn(6, 1, generator=g)
    with pytest.raises(ValueError, match="a second expert needs at least two experts"):
        ops.sample_second_expert(one, ops.topk_gating(one, 1))
    with pytest.raises(ValueError, match=r"rand must be float32 \[6, 4\], got torch.float64 \(6, 4\)"):
        ops.sample_second_expert(logits, first, torch.rand(6, 4, generator=g, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"rand must be float32 \[6, 4\], got torch.float32 \(6, 3\)"):
        ops.sample_second_expert(logits, first, torch.rand(6, 3, generator=g))


def test_sample_second_expert_names_the_scores_shape():
    logits = torch.randn(6, 4, generator=gen(4))
    first = ops.topk_gating(logits, 1)
    bad = first._replace(scores=first.scores.reshape(-1))  # [6], not [6, 1]
    with pytest.raises(ValueError, match=r"scores \(6,\)"):
        ops.sample_second_expert(logits, bad)


def test_capacity_past_int32_slots():
    """ops.py:258 (the fp64 product past the bound), with :263 beside it (fp32's rounding past it)."""
    with pytest.raises(ValueError, match="capacity of 1099511627776 tokens .* exceeds int32 slots"):
        ops.capacity(1 << 40, 1, 8, 1.0)
    assert ops.capacity((1 << 31) - 1, 1, 1, 1.0) == (1 << 31) - 1
    with pytest.raises(ValueError, match="in fp32 rounds to 2147483648, past int32 slots"):
        ops.capacity((1 << 31) - 1, 1, 1, 1.0, fp32=True)


def test_assign_slots_needs_2d_ids():
    """ops.py:286."""
    g = gen(5)
    ids, scores = torch.randint(0, 4, (5, ), generator=g), torch.rand(5, generator=g)
    with pytest.raises(ValueError, match=r"expert_ids must be 2-D \[S, k\], got shape \(5,\)"):
        ops.assign_slots(ids, scores, 4)


def test_bare_slots_with_more_than_max_k_columns():
    """ops.py:351."""
    x = torch.randn(5, 3, generator=gen(6))
    slots = torch.full((5, ops.MAX_K + 1), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"slots may have at most {ops.MAX_K} columns \\(k\\), got {ops.MAX_K + 1}"):
        ops.scatter_tokens(x, slots, 10)


# ----------------------------------------------------------------------------- turbomoe.autograd


def test_bias_act_device_mismatch():
    """autograd/bias_act.py:132 (a second device: the meta device stands in for a GPU)."""
    from turbomoe.autograd.bias_act import bias_act
    g = gen(7)
    y, b = torch.randn(6, 3, generator=g), torch.randn(2, 3, generator=g)
    with pytest.raises(ValueError, match="b is on meta, y on cpu"):
        bias_act(y, b.to("meta"), rows_per_group=3)
    with pytest.raises(ValueError, match="groups_R is on meta, y on cpu"):
        bias_act(y, b, groups_R=torch.zeros(6, dtype=torch.long, device="meta"))


def test_grouped_mm_argument_errors(monkeypatch):
    """autograd/grouped_gemm.py:134 (triton without CUDA or the interpreter), :334 (not a tensor),
    :345 (devices)."""
    from turbomoe.autograd.grouped_gemm import grouped_mm
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = gen(8)
    x, w = torch.randn(5, 4, generator=g), torch.randn(2, 4, 3, generator=g)
    counts = torch.tensor([3, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="the triton grouped GEMM backend needs CUDA tensors"):
        grouped_mm(x, w, counts, backend="triton")
    with pytest.raises(TypeError, match="counts must be a torch.Tensor, got list"):
        grouped_mm(x, w, [3, 2])
    with pytest.raises(ValueError, match="x, w, counts are on different devices: cpu, meta, cpu"):
        grouped_mm(x, w.to("meta"), counts)


def test_grouped_mm_main_grad_under_compile():
    """autograd/grouped_gemm.py:386: gradient-accumulation fusion is refused while dynamo traces (the
    raise is traced, not run: fullgraph reports it; without fullgraph the call runs eager, and fused)."""
    from turbomoe.autograd.grouped_gemm import grouped_mm
    g = gen(9)
    x = torch.randn(5, 4, generator=g, requires_grad=True)
    w = torch.randn(2, 4, 3, generator=g, requires_grad=True)
    counts = torch.tensor([3, 2], dtype=torch.int32)

    def f(x, w, buf):
        return grouped_mm(x, w, counts, main_grad_GKN=buf)
    torch._dynamo.reset()
    buf = torch.zeros(2, 4, 3)
    with pytest.raises(RuntimeError, match=re.escape("gradient-accumulation fusion (main_grad) is not traced by "
                                                     "torch.compile")):
        torch.compile(f, backend="eager", fullgraph=True)(x, w, buf)
    assert not buf.any()
    y = torch.compile(f, backend="eager")(x, w, buf)
    y.sum().backward()
    expect = torch.stack([x[:3].detach().t() @ torch.ones(3, 3), x[3:].detach().t() @ torch.ones(2, 3)])
    torch.testing.assert_close(buf, expect)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- turbomoe.kernels launchers
# Their checks are reachable only by calling them (turbomoe's own callers pass consistent arguments);
# each fires before any kernel launch, so no GPU and no interpreter is needed.


def test_few_rows_launchers_check_their_arguments():
    """kernels/few_rows_gemm.py:324, :326, :339, :341, :356."""
    from turbomoe.kernels.few_rows_gemm import few_rows_down, few_rows_up
    g = gen(10)
    w1 = torch.randn(2, 4, 6, generator=g)
    counts = torch.tensor([1, 1], dtype=torch.int32)
    x, routes = torch.randn(2, 4, generator=g), torch.arange(2)
    with pytest.raises(ValueError, match="the weights' last dimension must be contiguous"):
        few_rows_up(x, routes, 1, w1.transpose(1, 2).contiguous().transpose(1, 2), counts, 2)
    with pytest.raises(ValueError, match=r"counts must be int32 \[2\], got torch.int64 \(2,\)"):
        few_rows_up(x, routes, 1, w1, counts.long(), 2)
    with pytest.raises(ValueError, match=r"x must be \[T, 4\] with contiguous rows, got \(2, 5\)"):
        few_rows_up(torch.randn(2, 5, generator=g), routes, 1, w1, counts, 2)
    with pytest.raises(ValueError, match=r"x must be \[T, 4\] with contiguous rows, got \(2, 4\)"):
        few_rows_up(torch.randn(4, 2, generator=g).t(), routes, 1, w1, counts, 2)  # column-major rows
    with pytest.raises(ValueError, match=re.escape("w's columns must be [gate | up], an even count, got 5")):
        few_rows_up(x, routes, 1, torch.randn(2, 4, 5, generator=g), counts, 2)
    w2 = torch.randn(2, 3, 4, generator=g)
    with pytest.raises(ValueError, match=r"h must be torch.float32 \[S, R, 6\] or torch.float32 \[R, 3\], got "
                                         r"torch.float64 \(2, 3\)"):
        few_rows_down(torch.randn(2, 3, generator=g, dtype=torch.float64), w2, counts, 2)


def test_wgrad_out_checked():
    """kernels/grouped_gemm.py:174: a wrong `out` is refused and left as it was."""
    from turbomoe.kernels.grouped_gemm import grouped_mm_wgrad
    g = gen(11)
    x, dy = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
    counts = torch.tensor([3, 2], dtype=torch.int32)
    out = torch.ones(2, 3, 4)
    with pytest.raises(ValueError, match=r"out must be a float tensor \[G, K, N\] = \[2, 4, 3\] on cpu, got "
                                         r"torch.float32 \(2, 3, 4\)"):
        grouped_mm_wgrad(x, dy, counts, out=out)
    assert torch.equal(out, torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="got torch.int32"):
        grouped_mm_wgrad(x, dy, counts, out=torch.zeros(2, 4, 3, dtype=torch.int32))


def test_router_parts_launcher_checks():
    """kernels/router.py:68, :70."""
    from turbomoe.kernels.router import router_logit_parts
    g = gen(12)
    with pytest.raises(ValueError, match=r"x \[T, M\] and w \[E, M\] expected, got \(3, 4\) and \(2, 5\)"):
        router_logit_parts(torch.randn(3, 4, generator=g).bfloat16(), torch.randn(2, 5, generator=g).bfloat16())
    with pytest.raises(ValueError, match="x and w must be bf16 or fp16 on one device, got torch.float32 on cpu"):
        router_logit_parts(torch.randn(3, 4, generator=g), torch.randn(2, 4, generator=g))


def test_row_launchers_renormalize_needs_its_inputs():
    """kernels/rows.py:200, :230: refused before out is touched."""
    from turbomoe.kernels.rows import pull_rows, push_rows
    src = torch.randn(2, 4, generator=gen(13))
    slots = torch.tensor([[0], [1]], dtype=torch.int32)
    out = torch.full((2, 4), 7.0)
    with pytest.raises(ValueError, match="push_rows: renormalize needs scores"):
        push_rows(src, slots, out, renormalize=True)
    with pytest.raises(ValueError, match="pull_rows: renormalize needs scores"):
        pull_rows(src, slots, out, renormalize=True)
    assert torch.equal(out, torch.full((2, 4), 7.0))


# ----------------------------------------------------------------------------- turbomoe.nn


def test_nn_errors():
    """nn/router.py:44, nn/experts.py:82, :84."""
    from turbomoe.nn import GroupedExperts, TopKRouter
    with pytest.raises(ValueError, match=r"score_func must be one of \('softmax', 'sigmoid'\), got 'relu'"):
        TopKRouter(4, 4, 2, score_func="relu")
    g = gen(14)
    x, counts = torch.randn(3, 4, generator=g), torch.tensor([2, 1], dtype=torch.int32)
    experts = GroupedExperts(2, 4, 6)
    with pytest.raises(TypeError, match="x is torch.float64 but the expert weights are torch.float32"):
        experts(x.double(), counts)
    for kw in (dict(activation="gelu"), dict(bias=True)):
        with pytest.raises(ValueError, match="a row scale needs swiglu experts without a second bias"):
            GroupedExperts(2, 4, 6, **kw)(x, counts, row_scale_R=torch.ones(3))


# ----------------------------------------------------------------------------- turbomoe.models


def test_model_config_positive_ints():
    """models/config.py:53."""
    from turbomoe.models import ModelConfig
    for name, value in (("vocab_size", 0), ("hidden_size", True), ("head_dim", 8.0)):
        with pytest.raises(ValueError, match=f"model.{name} must be a positive int, got {value!r}"):
            ModelConfig(**{**TINY, name: value}).validate()


def test_model_forward_too_long():
    """models/qwen3_moe.py:301."""
    model = tiny_model()
    ids = torch.randint(0, 64, (1, 17), generator=gen(15))
    with pytest.raises(ValueError, match="sequence length 17 exceeds max_position_embeddings 16"):
        model(ids)


def test_moe_class_import_failure(monkeypatch):
    """models/qwen3_moe.py:118: turbomoe's MoE that cannot be imported names the setting to change."""
    pytest.importorskip("deepspeed")
    from turbomoe.models import moe_class
    monkeypatch.setitem(sys.modules, "turbomoe.integrations.deepspeed", None)
    with pytest.raises(ImportError, match="model.moe_impl is 'turbomoe' but turbomoe.integrations.deepspeed.MoE "
                                          "cannot be imported .*set model.moe_impl: deepspeed"):
        moe_class("turbomoe")


@pytest.mark.parametrize("config,message", [
    (dict(rope_parameters=[1, 2]), "rope_parameters must be an object, got \\[1, 2\\]"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128]}),
     "quantization_config's weight_block_size must be two positive ints, got \\[128\\]"),
    (dict(num_experts=0), "num_experts is 0; a Qwen3-MoE model needs experts"),
])
def test_hf_config_errors(hf_dir, tmp_path, config, message):
    """models/hf_checkpoint.py:103, :131, :170."""
    from turbomoe.models import Qwen3MoeForCausalLM
    from turbomoe.models.hf_checkpoint import CheckpointError
    path = hf_variant(hf_dir, tmp_path, config=config)
    with pytest.raises(CheckpointError, match="config.json: " + message):
        Qwen3MoeForCausalLM.from_pretrained(path)


def test_hf_reader_errors(hf_dir, tmp_path):
    """models/hf_checkpoint.py:237 (index without weight_map), :249 (no weights), :268 (a shard lacks
    what the index places there), :366 (a tensor no Qwen3-MoE has); the target model of load_hf_weights
    left unchanged by each."""
    from safetensors.torch import load_file, save_file

    from turbomoe.models import Qwen3MoeForCausalLM
    from turbomoe.models.hf_checkpoint import CheckpointError
    target = tiny_model(4)
    before = snapshot(target)

    def bad_index(p):
        os.remove(os.path.join(p, "model.safetensors"))
        with open(os.path.join(p, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}}, f)
    p = hf_variant(hf_dir, tmp_path / "a", files=bad_index)
    with pytest.raises(CheckpointError, match="safetensors.index.json: not a safetensors index with a weight_map"):
        target.load_hf_weights(p)

    p = hf_variant(hf_dir, tmp_path / "b", files=lambda p: os.remove(os.path.join(p, "model.safetensors")))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json is there"):
        Qwen3MoeForCausalLM.from_pretrained(p)

    def lacking(p):
        shard = "model-00001-of-00001.safetensors"
        os.rename(os.path.join(p, "model.safetensors"), os.path.join(p, shard))
        keys = list(load_file(os.path.join(p, shard)))
        with open(os.path.join(p, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": {**{k: shard for k in keys}, "model.norm.bias": shard}}, f)
    p = hf_variant(hf_dir, tmp_path / "c", files=lacking)
    with pytest.raises(CheckpointError, match=r"model-00001-of-00001.safetensors: lacks tensors \['model.norm.bias'\]"):
        target.load_hf_weights(p)

    def extra(p):
        sd = load_file(os.path.join(p, "model.safetensors"))
        save_file({**sd, "model.extra.weight": torch.zeros(2)}, os.path.join(p, "model.safetensors"))
    p = hf_variant(hf_dir, tmp_path / "d", files=extra)
    with pytest.raises(CheckpointError, match=r"tensors \['model.extra.weight'\] \(1 in all\) are not part of a "
                                              r"Qwen3-MoE model"):
        target.load_hf_weights(p)
    assert unchanged(target, before)


def _unreadable_head(p):
    """lm_head.weight moved to a second shard, stored as F6_E2M3 (a dtype safetensors names but cannot
    hand to torch): its header and shape read fine, the tensor does not."""
    from safetensors.torch import load_file, save_file
    sd = load_file(os.path.join(p, "model.safetensors"))
    head = sd.pop("lm_head.weight")
    os.remove(os.path.join(p, "model.safetensors"))
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file(sd, os.path.join(p, first))
    n = head.numel() * 6 // 8
    header = json.dumps({"lm_head.weight": {"dtype": "F6_E2M3", "shape": list(head.shape),
                                            "data_offsets": [0, n]}}).encode()
    with open(os.path.join(p, second), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"\0" * n)
    with open(os.path.join(p, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {**{k: first for k in sd}, "lm_head.weight": second}}, f)


def test_hf_unreadable_tensor_is_named(hf_dir, tmp_path):
    """models/hf_checkpoint.py:295: a tensor the reader cannot read is a CheckpointError naming its file
    and key."""
    from turbomoe.models import Qwen3MoeForCausalLM
    from turbomoe.models.hf_checkpoint import CheckpointError
    p = hf_variant(hf_dir, tmp_path, files=_unreadable_head)
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: cannot read lm_head.weight"):
        Qwen3MoeForCausalLM.from_pretrained(p)


def test_hf_unreadable_tensor_leaves_the_model_unchanged(hf_dir, tmp_path):
    from turbomoe.models.hf_checkpoint import CheckpointError
    p = hf_variant(hf_dir, tmp_path, files=_unreadable_head)
    target = tiny_model(5)
    before = snapshot(target)
    with pytest.raises(CheckpointError, match="cannot read lm_head.weight"):
        target.load_hf_weights(p)
    assert unchanged(target, before)


def test_expert_parallel_read_needs_a_rank(hf_dir):
    """models/hf_checkpoint.py:618."""
    import torch.distributed as dist

    from turbomoe.models import MoEArgs, Qwen3MoeForCausalLM
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is up in this process")
    with pytest.raises(ValueError, match="ep_size 2 > 1 needs an initialised process group \\(or pass ep_rank\\)"):
        Qwen3MoeForCausalLM.from_pretrained(hf_dir, moe_args=MoEArgs(ep_size=2))
    assert torch.get_default_dtype() == torch.float32


# ----------------------------------------------------------------------------- turbomoe.inference


def test_engine_tune_on_cpu_leaves_the_model_whole():
    """inference/engine.py:154."""
    from turbomoe.inference import Engine
    from turbomoe.models.qwen3_moe import ExpertsMoved
    model = tiny_model(6)
    before = snapshot(model)
    with pytest.raises(ValueError, match="tune measures the few-rows kernels on a GPU; the model is on cpu"):
        Engine(model, tune=True)
    assert not any(isinstance(layer.mlp, ExpertsMoved) for layer in model.model.layers)
    assert unchanged(model, before)
    model.check_whole()


@pytest.mark.parametrize("kw,message", [
    (dict(eos_token_id=torch.tensor([1.5])), "eos_token_id must be integer token ids, got a torch.float32 tensor"),
    (dict(eos_token_id=torch.tensor([[1]])), "eos_token_id must be integer token ids, got a torch.int64 tensor of "
                                             "shape \\(1, 1\\)"),
    (dict(eos_token_id=[3, -1]), "eos_token_id must hold non-negative integer token ids, got \\[3, -1\\]"),
    (dict(eos_token_id=[True]), "eos_token_id must hold non-negative integer token ids, got \\[True\\]"),
    (dict(pad_token_id=-3), "pad_token_id must hold non-negative integer token ids, got -3"),
])
def test_generate_token_id_errors_allocate_nothing(kw, message):
    """inference/engine.py:543, :551: refused before the KV cache is made."""
    from turbomoe.inference import Engine
    engine = Engine(tiny_model(7), max_batch=2)
    ids = torch.randint(0, 64, (1, 3), generator=gen(16))
    with pytest.raises(ValueError, match=message):
        engine.generate(ids, 2, **kw)
    assert engine.cache is None


def _moe_weights(E, M=16, F_=8, seed=17):
    g = gen(seed)
    return torch.randn(E, M, generator=g), torch.randn(E, M, 2 * F_, generator=g), torch.randn(E, F_, M, generator=g)


def test_sparse_moe_construction_errors():
    """inference/moe.py:118 (k plus the shared expert past MAX_K), :143 (a missing weight)."""
    from turbomoe.inference import SparseMoE
    router, w1, w2 = _moe_weights(8)
    g = gen(18)
    with pytest.raises(ValueError, match=f"k \\(8\\) plus the shared expert must be at most {ops.MAX_K} routes"):
        SparseMoE(router, w1, w2, 8, shared_w1_MN=torch.randn(16, 16, generator=g),
                  shared_w2_FM=torch.randn(8, 16, generator=g))
    sd = {"model.layers.0.mlp.gate.weight": router}
    with pytest.raises(KeyError, match="missing weight model.layers.0.mlp.experts.0.gate_proj.weight"):
        SparseMoE.from_hf_state_dict(sd, "model.layers.0.mlp.", 8, 2, True)


def test_tune_errors_leave_the_table():
    """inference/tiling.py:138 (no GPU), :160 (the rule's own tiling does not run), :203, :207 (token
    counts): the layer's tile table as it was."""
    from turbomoe.inference import SparseMoE
    from turbomoe.inference.tiling import tune_few_rows
    moe = SparseMoE(*_moe_weights(4), 2)
    with pytest.raises(ValueError, match="tuning times the few-rows kernels on a GPU; the experts are on cpu"):
        moe.tune([1, 2])
    with pytest.raises(TypeError, match="token counts must be a sequence of positive ints"):
        moe.tune(8)
    with pytest.raises(ValueError, match="token counts must be positive ints, got 0"):
        moe.tune([1, 0])
    with pytest.raises(RuntimeError, match="the rule's own tiling of the first GEMM does not run at T = 1: Tiles"):
        tune_few_rows(moe, [1], timer=lambda op, tiles, fn: None)  # every tiling out of resources
    assert moe.few_rows_tiles == {}


# ----------------------------------------------------------------------------- turbomoe.generate (CLI)


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory, hf_dir):
    """hf_dir with a word-level tokenizer whose pre-tokenizer drops blanks (a blank prompt: no tokens)."""
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    import shutil
    path = str(tmp_path_factory.mktemp("cli") / "model")
    shutil.copytree(hf_dir, path)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "<eos>": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>"}, f)
    return path


def _cli_error(args, capsys) -> str:
    from turbomoe.generate import main
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_generate_cli_errors(cli_dir, tmp_path, capsys):
    """generate.py:157 (generation_config.json not JSON), :178 (its eos_token_id), :189 (a prompt the
    tokenizer makes nothing of): argparse errors, before the model is loaded."""
    import shutil
    base = ["--device", "cpu", "--max-new-tokens", "2"]
    err = _cli_error([cli_dir, "--prompt", "   ", *base], capsys)
    assert "--prompt number 1 makes no tokens with" in err
    path = str(tmp_path / "m")
    shutil.copytree(cli_dir, path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": -1, "do_sample": False}, f)
    err = _cli_error([path, "--prompt", "a b", *base], capsys)
    assert "generation_config.json's eos_token_id must hold non-negative integer token ids, got -1" in err
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        f.write("{not json")
    err = _cli_error([path, "--prompt", "a b", *base], capsys)
    assert "generation_config.json is not JSON" in err


def test_generate_cli_device_index_past_the_count(cli_dir, monkeypatch, capsys):
    """generate.py:136: --device cuda:N on a machine with N or fewer GPUs is an argparse error naming the
    count, before the model is loaded (here a one-GPU machine, as torch reports it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = _cli_error([cli_dir, "--prompt", "a b", "--device", "cuda:1", "--max-new-tokens", "2"], capsys)
    assert "--device cuda:1: this machine has 1 CUDA devices" in err


# ----------------------------------------------------------------------------- turbomoe.export (+ checkpoint_tags)


def one_partition(params, skip=(), base=None):
    """A ZeRO 1/2 partition of every parameter (but skip) in one flat group, masters = the weights."""
    names = [n for n in params if n not in skip]
    flat = torch.cat([params[n].float().reshape(-1) for n in names])
    mapping, start = {}, 0
    for n in names:
        mapping[n] = types.SimpleNamespace(start=start, numel=params[n].numel())
        start += params[n].numel()
    base = {"state": {0: {"exp_avg": torch.zeros_like(flat), "step": torch.tensor(3.0)}}} if base is None else base
    return {"single_partition_of_fp32_groups": [flat], "param_slice_mappings": [mapping], "base_optimizer_state": base}


def _nothing_written(out) -> bool:
    parent = os.path.dirname(out)
    return not os.path.exists(out) and not [n for n in os.listdir(parent) if n.startswith(f".{os.path.basename(out)}.")]


def test_export_of_a_fake_run_works(tmp_path):
    """The fake run exports (so that the errors below are the ones meant), masters included."""
    from turbomoe.export import RunCheckpoint, export
    model = tiny_model(8)
    tag = fake_run(str(tmp_path / "run"), model, partitions=one_partition)
    export(str(tmp_path / "run"), str(tmp_path / "out"), dtype="fp32", progress=False)
    assert os.path.isfile(tmp_path / "out" / "model.safetensors")
    assert RunCheckpoint(tag).optimizer_step() == 3.0


def test_export_argument_and_tag_errors(tmp_path):
    """export.py:242 (dtype) and checkpoint_tags.py:25 (no directory), :29 (a tag of another step), as
    export reports them; nothing written."""
    from turbomoe.checkpoint_tags import find_tag
    from turbomoe.export import ExportError, export
    tag = fake_run(str(tmp_path / "run"), tiny_model(9))
    out = str(tmp_path / "out")
    with pytest.raises(ExportError, match=r"--dtype must be one of \['bf16', 'fp32'\], got 'fp16'"):
        export(tag, out, dtype="fp16", progress=False)
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ExportError, match="nowhere: no such directory"):
        export(missing, out, progress=False)
    with pytest.raises(FileNotFoundError, match="nowhere: no such directory"):
        find_tag(missing)
    with pytest.raises(ExportError, match="global_step4 is the checkpoint of another step than 5"):
        export(tag, out, step=5, progress=False)
    assert _nothing_written(out)


def test_export_model_states_errors(tmp_path):
    """export.py:66 (a file torch cannot load), :99 (no 'module' in it)."""
    from turbomoe.export import ExportError, export
    model = tiny_model(10)
    out = str(tmp_path / "out")
    tag = fake_run(str(tmp_path / "a"), model, raw_states=b"not a torch file")
    with pytest.raises(ExportError, match="mp_rank_00_model_states.pt: cannot be read as a DeepSpeed checkpoint file"):
        export(tag, out, progress=False)
    tag = fake_run(str(tmp_path / "b"), model, raw_states=False)
    with pytest.raises(ExportError, match="mp_rank_00_model_states.pt: no 'module' state dict in it"):
        export(tag, out, progress=False)
    assert _nothing_written(out)


def test_export_tensor_errors_write_nothing(tmp_path):
    """export.py:162 (a tensor missing), :164 (a tensor of another shape): found mid-write, and the
    output directory is not left behind (nor its temporary)."""
    from turbomoe.export import ExportError, export
    model = tiny_model(11)
    out = str(tmp_path / "out")
    tag = fake_run(str(tmp_path / "a"), model, module_edit=lambda m: m.pop("model.norm.weight"))
    with pytest.raises(ExportError, match="mp_rank_00_model_states.pt: tensor model.norm.weight is missing"):
        export(tag, out, progress=False)
    assert _nothing_written(out)

    def reshape(m):
        m["lm_head.weight"] = m["lm_head.weight"][:, :8]
    tag = fake_run(str(tmp_path / "b"), model, module_edit=reshape)
    with pytest.raises(ExportError, match=r"lm_head.weight has shape \(64, 8\), but the run's config implies "
                                          r"\(64, 16\)"):
        export(tag, out, progress=False)
    assert _nothing_written(out)


def test_export_zero_partition_errors(tmp_path):
    """export.py:184 (unknown names), :196 (a missing optimizer state), :210 (a parameter the partitions
    hold too little of; through export --dtype fp32, nothing written), :235 (no base optimizer state)."""
    from turbomoe.export import ExportError, RunCheckpoint, export
    model = tiny_model(12)
    ckpt = RunCheckpoint(fake_run(str(tmp_path / "a"), model, partitions=one_partition))
    with pytest.raises(ExportError, match=r"the run's model has no parameters \['model.nope'\]"):
        ckpt.zero_states(names=["model.nope"])
    with pytest.raises(ExportError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt: parameter group 0 has no "
                                          "optimizer state 'exp_avg_sq'"):
        ckpt.zero_states(("master", "exp_avg_sq"))
    assert set(ckpt.zero_states(("exp_avg", ))["exp_avg"]) == set(ckpt.shapes)

    tag = fake_run(str(tmp_path / "b"), model, partitions=lambda p: one_partition(p, skip=("model.norm.weight", )))
    with pytest.raises(ExportError, match="the optimizer partitions hold 0 elements of model.norm.weight's master, "
                                          "expected 16"):
        RunCheckpoint(tag).fp32_masters()
    out = str(tmp_path / "out")
    with pytest.raises(ExportError, match="model.norm.weight's master"):
        export(tag, out, dtype="fp32", progress=False)
    assert _nothing_written(out)

    tag = fake_run(str(tmp_path / "c"), model, partitions=lambda p: one_partition(p, base=[]))
    with pytest.raises(ExportError, match="optim_states.pt: no base optimizer state for parameter group 0"):
        RunCheckpoint(tag).optimizer_step()


def test_export_tokenizer_import_error(tmp_path, monkeypatch):
    """export.py:296: the run's tokenizer cannot be loaded for want of a package: an ExportError naming it."""
    import turbomoe.data
    from turbomoe.export import ExportError, export
    tok_dir = str(tmp_path / "tok")
    os.makedirs(tok_dir)
    tag = fake_run(str(tmp_path / "run"), tiny_model(13), data={"source": "stdlib", "tokenizer": tok_dir})

    def no_transformers(path):
        raise ImportError("No module named 'transformers'")
    monkeypatch.setattr(turbomoe.data, "HFTokenizer", no_transformers)
    out = str(tmp_path / "out")
    with pytest.raises(ExportError, match=f"the run read its corpus with the tokenizer in {tok_dir}, which export "
                                          f"writes beside the model: No module named 'transformers'"):
        export(tag, out, progress=False)
    assert _nothing_written(out)


# ----------------------------------------------------------------------------- turbomoe.data


def test_data_errors(monkeypatch):
    """data/samples.py:18, data/corpus.py:124 (no standard library sources), :317 (no Megatron prefixes)."""
    from turbomoe.data import ArrayStream, Samples, corpus
    stream = ArrayStream(np.arange(200, dtype=np.uint16))
    for bad in (0, 1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="data.valid_fraction must be in \\(0, 1\\)"):
            Samples(stream, 4, bad, 0)
    with pytest.raises(ValueError, match="data.paths is empty; name the Megatron dataset prefixes"):
        corpus.check_megatron_prefixes([])
    monkeypatch.setattr(corpus, "stdlib_files", lambda: [])
    with pytest.raises(FileNotFoundError, match="no Python standard library sources under"):
        corpus.corpus_files("stdlib", [])


@pytest.mark.parametrize("bad", [None, "0.1"])
def test_samples_valid_fraction_of_another_type(bad):
    from turbomoe.data import ArrayStream, Samples
    with pytest.raises(ValueError, match="data.valid_fraction"):
        Samples(ArrayStream(np.arange(200, dtype=np.uint16)), 4, bad, 0)


# ----------------------------------------------------------------------------- turbomoe.integrations


def test_transformers_experts_with_a_post_expert_norm():
    """integrations/transformers.py:68."""
    from turbomoe.integrations.transformers import turbomoe_experts_forward

    class NormedExperts:  # stands for a transformers experts module that norms each expert's output
        has_post_expert_norm = True
        num_experts = 4
    g = gen(19)
    with pytest.raises(NotImplementedError, match="NormedExperts normalises each expert's output"):
        turbomoe_experts_forward(NormedExperts(), torch.randn(3, 4, generator=g), torch.zeros(3, 2, dtype=torch.long),
                                 torch.rand(3, 2, generator=g))


def test_deepspeed_grouped_mlp_row_scale_needs_swiglu():
    """integrations/deepspeed_experts.py:140."""
    pytest.importorskip("deepspeed")
    from torch import nn

    from turbomoe.integrations.deepspeed_experts import grouped_mlp
    experts = nn.ModuleList(nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4)) for _ in range(2))
    with pytest.raises(ValueError, match="a row scale needs bias-free SwiGLU experts"):
        grouped_mlp("mlp", experts, torch.randn(3, 4, generator=gen(20)), None, row_scale_R=torch.ones(3))


@pytest.fixture
def megatron():
    pytest.importorskip("megatron.core")
    from megatron_common import model_parallel, moe_config
    return model_parallel, moe_config


def test_megatron_routing_function_errors(megatron):
    """integrations/megatron_router.py:73, :86."""
    from turbomoe.integrations.megatron_router import drop_slots, topk_routing
    g = gen(21)
    with pytest.raises(ValueError, match="moe_router_score_function must be 'softmax' or 'sigmoid', got 'relu'"):
        topk_routing(torch.randn(4, 6, generator=g), 2, "relu")
    with pytest.raises(ValueError, match=r"drop policy must be one of \('probs', 'position', 'rts'\), got 'first'"):
        drop_slots(torch.zeros(4, 2, dtype=torch.int32), torch.rand(4, 2, generator=g), 6, 2, "first")


def test_megatron_experts_need_expert_tp_1(megatron):
    """integrations/megatron_experts.py:52 (a process-group collection whose expert TP group has 2 ranks)."""
    from turbomoe.integrations.megatron_experts import TurboGroupedMLP
    _, moe_config = megatron
    groups = types.SimpleNamespace(expt_tp=types.SimpleNamespace(size=lambda: 2))
    with pytest.raises(ValueError, match="turbomoe's Megatron experts need expert_tensor_parallel_size = 1, got 2"):
        TurboGroupedMLP(3, moe_config(), pg_collection=groups)


def test_megatron_router_policy_and_parallel_mlp_group(megatron):
    """integrations/megatron_router.py:119 (an unknown drop_policy) and megatron_mlp.py:123 (ParallelMLP
    experts sliced 2 ways whose tensor-parallel group has 1 rank)."""
    from megatron.core import parallel_state
    from megatron_parallel_mlp import ParallelMLP

    from turbomoe.integrations.expert_stack import RowGroups
    from turbomoe.integrations.megatron_mlp import grouped_parallel_mlp, parallel_mlp_signature
    from turbomoe.integrations.megatron_router import TurboTopKRouter
    model_parallel, moe_config = megatron
    with model_parallel("gloo"):
        with pytest.raises(ValueError, match="drop_policy \\(or config.moe_token_drop_policy\\) must be one of "
                                             "\\('probs', 'position', 'rts'\\), got 'first'"):
            TurboTopKRouter(moe_config(), drop_policy="first")
        group = parallel_state.get_tensor_model_parallel_group()
        experts = [ParallelMLP(8, 6, act="gelu", tp_group=group, dtype=torch.float32) for _ in range(2)]
        for e in experts:  # each rank's half, as a 2-way tensor-parallel run holds it
            fc1, fc2 = e.dense_h_to_4h, e.dense_4h_to_h
            fc1.weight = torch.nn.Parameter(fc1.weight.detach()[:3].clone())
            fc1.bias = torch.nn.Parameter(fc1.bias.detach()[:3].clone())
            fc2.weight = torch.nn.Parameter(fc2.weight.detach()[:, :3].clone())
        assert parallel_mlp_signature(experts[0])[2][4] == 2
        x = torch.randn(4, 8, generator=gen(22))
        with pytest.raises(RuntimeError, match="ParallelMLP expert linears split 2 ways, but their tensor-parallel "
                                               "group is 1"):
            grouped_parallel_mlp(experts, x, RowGroups(torch.tensor([2, 2], dtype=torch.int32), 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuda backend's checks run on CUDA tensors")
def test_forced_cuda_backend_bounds(monkeypatch):
    """ops.py's forced cuda backend: past csrc.MAX_EXPERTS it names the bound and the triton backend;
    where it could not be built it says so; either way before any launch. The triton backend still
    serves those experts."""
    from turbomoe import csrc
    E = csrc.MAX_EXPERTS + 1
    logits = torch.randn(5, E, generator=gen(31)).cuda()
    with pytest.raises(ValueError, match=f"the cuda backend serves at most {csrc.MAX_EXPERTS} experts, got {E}; "
                                         "use the triton backend"):
        ops.topk_gating(logits, 2, backend="cuda")
    triton_out = ops.topk_gating(logits, 2, backend="triton")
    ref = ops.topk_gating(logits, 2, backend="reference")
    assert torch.equal(triton_out.expert_ids, ref.expert_ids)
    monkeypatch.setattr(csrc, "available", lambda: False)
    with pytest.raises(RuntimeError, match="the cuda backend could not be built here"):
        ops.topk_gating(logits[:, :8], 2, backend="cuda")
    assert ops.choose_backend(logits[:, :8], None, 8) == "triton"  # unforced: falls back
