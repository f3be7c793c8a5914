"""A tiny Qwen3-MoE (turbomoe's model: one MoE layer of 4 experts) and its Hugging Face directory, for
the coverage reviews' tests."""
import pytest
import torch

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=32)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def tiny_model(seed=0, **over):
    """The model from TINY updated by over, initialised from seed, in eval mode."""
    pytest.importorskip("deepspeed")  # the model's MoE layers are DeepSpeed-compatible modules
    from turbomoe.models import ModelConfig, Qwen3MoeForCausalLM
    model = Qwen3MoeForCausalLM(ModelConfig(**{**TINY, **over}))
    model.init_weights(seed)
    return model.eval()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny model's Hugging Face directory (model.safetensors, config.json, generation_config.json)."""
    path = str(tmp_path_factory.mktemp("hf") / "model")
    tiny_model(3).save_pretrained(path)
    return path
