"""Review of the FP8 checkpoint reader, on tests/test_hf_fp8.py's directories: an expert-parallel rank
(from_pretrained and load_hf_weights, model.init_from's path) reads its own experts' FP8 matrices, the
other ranks' scales being no strays; and a quantization_config that leaves weight_block_size out means
transformers' default, 128 x 128 blocks, not one scale a tensor; FP8 experts stored fused (transformers'
FP8Experts: gate_up_proj with gate_up_proj_scale_inv) refused as such, not as tensors of another model."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

import test_hf_fp8  # noqa: E402
from test_engine import hf_model  # noqa: E402
from test_hf_fp8 import fp8_dirs  # noqa: E402
from turbomoe.models import MoEArgs, Qwen3MoeForCausalLM  # noqa: E402
from turbomoe.models.hf_checkpoint import CheckpointError  # noqa: E402


def assert_same(a, b):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_fp8_expert_parallel_rank_reads_its_experts(tmp_path, ep_rank):
    """ep_size 2: each rank's experts equal the dequantized directory's, read by from_pretrained and by
    load_hf_weights into a model built apart."""
    _, fp8, plain = fp8_dirs(tmp_path)
    args = MoEArgs(ep_size=2)
    want = Qwen3MoeForCausalLM.from_pretrained(plain, dtype=torch.float32, moe_args=args, ep_rank=ep_rank)
    assert_same(Qwen3MoeForCausalLM.from_pretrained(fp8, dtype=torch.float32, moe_args=args, ep_rank=ep_rank), want)
    model = Qwen3MoeForCausalLM.from_pretrained(plain, dtype=torch.float32, moe_args=args, ep_rank=1 - ep_rank)
    model.load_hf_weights(fp8, ep_rank)
    assert_same(model, want)


def test_fp8_weight_block_size_left_out_is_128_blocks(tmp_path, monkeypatch):
    """FineGrainedFP8Config's weight_block_size defaults to (128, 128): a config.json without the field
    holds 128 x 128 blocks (the dense MLP's 136 x 48 gate_proj: two of them), as transformers reads it."""
    monkeypatch.setattr(test_hf_fp8, "hf_model", lambda *a, **over: hf_model(*a, **{**over, "intermediate_size": 136}))
    _, fp8, plain = fp8_dirs(tmp_path, blocks=(128, 128))
    config_path = os.path.join(fp8, "config.json")
    config = json.load(open(config_path))
    del config["quantization_config"]["weight_block_size"]
    json.dump(config, open(config_path, "w"))
    from transformers.utils.quantization_config import FineGrainedFP8Config
    assert FineGrainedFP8Config.from_dict(config["quantization_config"]).weight_block_size == (128, 128)
    assert_same(Qwen3MoeForCausalLM.from_pretrained(fp8, dtype=torch.float32),
                Qwen3MoeForCausalLM.from_pretrained(plain, dtype=torch.float32))


def test_fp8_fused_experts_refused_by_name(tmp_path):
    """Layer 0's experts fused as FP8Experts holds them (e4m3 [E, 2F, H] and [E, H, F], scales a block
    each): the error says FP8 experts are read per expert, not that the scales belong to no Qwen3-MoE."""
    _, fp8, _ = fp8_dirs(tmp_path, blocks=(8, 16))
    weights = os.path.join(fp8, "model.safetensors")
    t = load_file(weights)
    prefix = "model.layers.0.mlp.experts"
    experts = sorted({int(k.split(".")[5]) for k in t if k.startswith(prefix + ".")})
    for suffix in ("weight", "weight_scale_inv"):
        pop = lambda j, p: t.pop(f"{prefix}.{j}.{p}.{suffix}")  # noqa: E731
        name = "" if suffix == "weight" else "_scale_inv"
        t[f"{prefix}.gate_up_proj{name}"] = torch.stack([torch.cat([pop(j, "gate_proj"), pop(j, "up_proj")])
                                                         for j in experts])
        t[f"{prefix}.down_proj{name}"] = torch.stack([pop(j, "down_proj") for j in experts])
    save_file(t, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts.gate_up_proj is an FP8 tensor .*experts per expert, not fused"):
        Qwen3MoeForCausalLM.from_pretrained(fp8, dtype=torch.float32)
