"""FP8 block-quantized Hugging Face checkpoints (quantization_config quant_method "fp8", as Qwen3's -FP8
releases: e4m3 matrices X.weight with fp32 scales X.weight_scale_inv, one a weight_block_size block):
read by Qwen3MoeForCausalLM.from_pretrained and turbomoe.inference.load, dequantized as read, equal to
the same weights stored dequantized, and generating transformers' tokens on them; and the errors."""
import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from test_engine import hf_model, random_prompts  # noqa: E402
from turbomoe.inference import load  # noqa: E402
from turbomoe.models import Qwen3MoeForCausalLM  # noqa: E402
from turbomoe.models.hf_checkpoint import CheckpointError  # noqa: E402

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # not the router, norms, head


def quantize(w_NK: torch.Tensor, blocks):
    """(e4m3 weights, fp32 scales) of w, a scale a block (the last row and column of blocks partial)."""
    N, K = w_NK.shape
    bn, bk = blocks
    scale = torch.empty(-(-N // bn), -(-K // bk))
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w_NK[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            scale[i, j] = block.abs().amax().clamp_min(1e-12) / 448.0  # e4m3's largest finite value
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (block / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def fp8_dirs(tmp_path, blocks=(16, 16), seed=0):
    """(transformers' model on the dequantized weights, the FP8 directory, the dequantized directory)."""
    _, path = hf_model(tmp_path, seed, head_dim=12, hidden_size=48, moe_intermediate_size=24, intermediate_size=40)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    fp8, plain = {}, {}
    for k, v in tensors.items():
        if k.endswith(".weight") and k.split(".")[-2] in QUANTIZED:
            q, s = quantize(v, blocks)
            fp8[k], fp8[k[:-len(".weight")] + ".weight_scale_inv"] = q, s
            v = q.float() * s.repeat_interleave(blocks[0], 0)[:v.shape[0]].repeat_interleave(blocks[1], 1)[:, :v.shape[1]]
        else:
            fp8[k] = v
        plain[k] = v.float().contiguous()
    config = json.load(open(os.path.join(path, "config.json")))
    out = {}
    for name, weights, extra in (("fp8", fp8, {"quantization_config": {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(blocks)}}),
                                 ("plain", plain, {})):
        d = os.path.join(tmp_path, name)
        os.makedirs(d)
        save_file(weights, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        json.dump({**config, **extra, "dtype": "float32"}, open(os.path.join(d, "config.json"), "w"))
        out[name] = d
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(out["plain"], dtype=torch.float32).eval(), out["fp8"], out["plain"]


@pytest.mark.parametrize("blocks", [(16, 16), (8, 32)])
def test_fp8_checkpoint_reads_as_its_dequantized_weights(tmp_path, blocks):
    """Every parameter equals the dequantized checkpoint's, bit for bit (partial last blocks included:
    24 x 48 experts with 16-row blocks); greedy generation on it equals transformers' on those weights."""
    hf, fp8, plain = fp8_dirs(tmp_path, blocks)
    a = Qwen3MoeForCausalLM.from_pretrained(fp8, dtype=torch.float32)
    b = Qwen3MoeForCausalLM.from_pretrained(plain, dtype=torch.float32)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    engine = load(fp8, device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=48)
    ids, mask = random_prompts((7, 3, 11), torch.Generator().manual_seed(random.randrange(1 << 30)))
    want = hf.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(engine.generate(ids, 10, attention_mask=mask, pad_token_id=0), want)


def test_fp8_per_tensor_scale(tmp_path):
    """weight_block_size null: one scale a matrix."""
    _, fp8, plain = fp8_dirs(tmp_path, blocks=(1000, 1000))  # one block covers every matrix
    config = json.load(open(os.path.join(fp8, "config.json")))
    config["quantization_config"]["weight_block_size"] = None
    json.dump(config, open(os.path.join(fp8, "config.json"), "w"))
    tensors = load_file(os.path.join(fp8, "model.safetensors"))
    tensors = {k: v.reshape(1) if k.endswith("_scale_inv") else v for k, v in tensors.items()}
    save_file(tensors, os.path.join(fp8, "model.safetensors"), metadata={"format": "pt"})
    a = Qwen3MoeForCausalLM.from_pretrained(fp8, dtype=torch.float32)
    b = Qwen3MoeForCausalLM.from_pretrained(plain, dtype=torch.float32)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_fp8_checkpoint_errors(tmp_path):
    """Scales missing, of the wrong shape, or beside a weight not in FP8; FP8 weights without a
    quantization_config: each a CheckpointError naming the tensor."""
    _, fp8, _ = fp8_dirs(tmp_path)
    weights = os.path.join(fp8, "model.safetensors")
    config_path = os.path.join(fp8, "config.json")
    tensors, config = load_file(weights), json.load(open(config_path))
    key = "model.layers.0.self_attn.q_proj.weight"

    def broken(change, message, cfg=config):
        t = dict(tensors)
        change(t)
        save_file(t, weights, metadata={"format": "pt"})
        json.dump(cfg, open(config_path, "w"))
        with pytest.raises(CheckpointError, match=message):
            Qwen3MoeForCausalLM.from_pretrained(fp8, dtype=torch.float32)

    broken(lambda t: t.pop(key + "_scale_inv"), "q_proj.weight is stored in FP8 but its scales .* are missing")
    broken(lambda t: t.update({key + "_scale_inv": torch.ones(2, 2)}),
           r"q_proj.weight_scale_inv has shape \[2, 2\]; config.json's weight_block_size \[16, 16\] implies \[3, 3\]")
    broken(lambda t: t.update({key + "_scale_inv": torch.full((3, 3), 127, dtype=torch.uint8)}),
           r"q_proj.weight_scale_inv is stored as U8; FP8 scales are read as floating-point numbers")
    broken(lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1)}),
           "model.norm.weight_scale_inv scales a tensor that is not stored in FP8")
    plain_config = {k: v for k, v in config.items() if k != "quantization_config"}
    broken(lambda t: None, r"holds FP8 scales \(.*, 51 in all\) but config.json has no quantization_config",
           cfg=plain_config)
    broken(lambda t: [t.pop(k) for k in list(t) if k.endswith("_scale_inv")],
           r"q_proj.weight is stored in FP8 \(F8_E4M3\) but config.json has no quantization_config", cfg=plain_config)
