"""Review of the Hugging Face bridge (export.py, hf_checkpoint.py): each test fails without its fix.
transformers' Qwen3MoeForCausalLM is the oracle; every test draws fresh random weights (seed in the
messages)."""
import json
import os
import random

import pytest
import torch

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

from turbomoe.data import ByteTokenizer  # noqa: E402
from turbomoe.models import ModelConfig, Qwen3MoeForCausalLM  # noqa: E402
from turbomoe.models.hf_checkpoint import CheckpointError, config_from_hf, hf_tensors, save_dir  # noqa: E402

CONFIG = dict(vocab_size=261, hidden_size=20, intermediate_size=36, moe_intermediate_size=10, num_hidden_layers=3,
              num_attention_heads=2, num_key_value_heads=1, head_dim=10, num_experts=5, num_experts_per_tok=2,
              mlp_only_layers=[1], norm_topk_prob=False, rms_norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def hf_dir(path, seed, save_kw=None, **changes):
    """A random transformers Qwen3-MoE saved at path (its router random too: transformers zeroes it);
    save_kw go to save_pretrained."""
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**CONFIG, **changes})).eval()
    model.set_experts_implementation("eager")  # grouped_mm needs 16-byte strides: no odd sizes
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(path, **(save_kw or {}))
    return model


@pytest.fixture
def seed():
    return random.SystemRandom().randrange(2**31)


def test_load_hf_weights_refuses_a_model_of_another_config(tmp_path, seed):
    """load_hf_weights (the recipe's model.init_from) copied the weights into whatever model it was given:
    one with another rope_theta, norm_topk_prob or rms_norm_eps (no shape shows them) computed other
    logits than transformers, silently. Refused now, naming the fields; the same config loads exactly."""
    ref = hf_dir(tmp_path / "hf", seed)
    cfg = config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = ref(ids).logits
    # the same model, its MoE layers told another way and another context length: loads, same logits
    same = Qwen3MoeForCausalLM(ModelConfig(**{**cfg.to_dict(), "mlp_only_layers": (1,), "max_position_embeddings": 64}))
    same.load_hf_weights(str(tmp_path / "hf"))
    with torch.no_grad():
        err = ((same(ids).logits - expected).norm() / expected.norm()).item()
    assert err < 1e-5, f"seed {seed}: {err}"
    for field, value in (("rope_theta", 1e4), ("norm_topk_prob", True), ("rms_norm_eps", 1e-2)):
        other = Qwen3MoeForCausalLM(ModelConfig(**{**cfg.to_dict(), field: value}))
        before = {k: v.clone() for k, v in other.state_dict().items()}
        with pytest.raises(CheckpointError, match=rf"config.json: describes another model .*'{field}'"):
            other.load_hf_weights(str(tmp_path / "hf"))
        assert all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())  # nothing copied


def test_num_experts_and_num_local_experts_disagree(tmp_path):
    """transformers reads num_local_experts (num_experts is its alias); this reader read num_experts, so a
    config.json holding both, different, was another model here than in transformers."""
    raw = {"model_type": "qwen3_moe", **{k: v for k, v in CONFIG.items() if k != "num_experts"},
           "num_experts": 4, "num_local_experts": 5}
    assert transformers.Qwen3MoeConfig.from_dict(dict(raw)).num_experts == 5
    with pytest.raises(CheckpointError, match="num_experts 4 and num_local_experts 5 differ"):
        config_from_hf(raw)
    assert config_from_hf({**raw, "num_experts": 5}).num_experts == 5


def test_write_does_not_replace_an_output_that_appeared_meanwhile(tmp_path, seed):
    """Without force an existing output is an error; one that another writer finished while this one was
    writing (both saw none at the start) was moved aside and deleted at the end, silently."""
    model = Qwen3MoeForCausalLM(config_from_hf({"model_type": "qwen3_moe", **CONFIG}))
    model.init_weights(seed)
    out = tmp_path / "out"

    def tensors():
        for i, item in enumerate(hf_tensors(model)):
            if i == 2:  # the other writer's output arrives
                out.mkdir()
                (out / "theirs.txt").write_text("another writer's output")
            yield item

    with pytest.raises(FileExistsError, match="appeared while it was being written"):
        save_dir(str(out), model.config, tensors(), torch.float32)
    assert os.listdir(out) == ["theirs.txt"] and (out / "theirs.txt").read_text() == "another writer's output"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary directory left
    save_dir(str(out), model.config, hf_tensors(model), torch.float32, force=True)
    assert "theirs.txt" not in os.listdir(out) and (out / "model.safetensors").exists()


def test_round_trip_keeps_the_config_transformers_reads(tmp_path, seed):
    """from_pretrained -> save_pretrained dropped router_aux_loss_coef and output_router_logits: transformers
    read its defaults (0.001, False) from the copy, so fine-tuning it there weighed the router loss otherwise.
    Now the copy's config is the source's, as transformers reads both."""
    coef = random.Random(seed).uniform(0.01, 0.1)
    hf_dir(tmp_path / "src", seed, router_aux_loss_coef=coef, output_router_logits=True)
    model = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "src"))
    model.save_pretrained(str(tmp_path / "out"))
    src, out = (transformers.AutoConfig.from_pretrained(tmp_path / d).to_dict() for d in ("src", "out"))
    diff = {k: (src.get(k), out.get(k)) for k in set(src) | set(out)
            if k != "_name_or_path" and src.get(k) != out.get(k)}
    assert not diff, f"seed {seed}: {diff}"
    assert out["router_aux_loss_coef"] == coef and out["output_router_logits"] is True
    # another tokenizer brings its token ids, not another router loss
    model.save_pretrained(str(tmp_path / "bytes"), tokenizer=ByteTokenizer())
    out = transformers.AutoConfig.from_pretrained(tmp_path / "bytes")
    assert (out.router_aux_loss_coef, out.output_router_logits, out.eos_token_id) == (coef, True, ByteTokenizer.eos_id)


def test_experts_stored_in_both_layouts(tmp_path, seed):
    """A directory holding a layer's experts twice, fused (gate_up_proj, down_proj) and per expert, loaded the
    per-expert copy and ignored the other silently (transformers fails on it); an error now. Either layout
    alone still loads, to the same bits."""
    from safetensors.torch import load_file, save_file
    ref = hf_dir(tmp_path, seed)
    file = str(tmp_path / "model.safetensors")
    per_expert = load_file(file)
    fused = {k: v.contiguous() for k, v in ref.state_dict().items()}  # transformers' in-memory layout
    assert "model.layers.2.mlp.experts.gate_up_proj" in fused
    assert "model.layers.2.mlp.experts.0.up_proj.weight" in per_expert
    other = {k: torch.randn_like(v) for k, v in fused.items() if k.startswith("model.layers.2.mlp.experts.")}
    loaded = []
    for state in (fused, per_expert):
        save_file(state, file, metadata={"format": "pt"})
        loaded.append(Qwen3MoeForCausalLM.from_pretrained(str(tmp_path)).state_dict())
    assert loaded[0].keys() == loaded[1].keys()
    assert all(torch.equal(loaded[0][k], loaded[1][k]) for k in loaded[0]), f"seed {seed}"
    save_file({**per_expert, **other}, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"the experts of layers \[2\] are stored both fused"):
        Qwen3MoeForCausalLM.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_from_the_stored_weights_where_config_names_none(tmp_path, seed, dtype):
    """A config.json without dtype / torch_dtype: transformers takes the stored weights' dtype; from_pretrained
    built float32 (and saved the copy as float32). Now both read the stored dtype, bits unchanged."""
    hf_dir(tmp_path, seed).to(dtype).save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({k: v for k, v in raw.items() if k not in ("dtype", "torch_dtype")}, f)
    theirs = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    ours = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path))
    assert theirs.dtype == dtype and ours.lm_head.weight.dtype == dtype, f"seed {seed}: {ours.lm_head.weight.dtype}"
    assert torch.equal(ours.model.embed_tokens.weight, theirs.model.embed_tokens.weight), f"seed {seed}"
