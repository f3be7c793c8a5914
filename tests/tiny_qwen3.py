"""A tiny Qwen3-MoE (turbomoe's model: one MoE layer of 4 experts), its Hugging Face directory and a
recipe run's checkpoint of it, for the coverage reviews' tests."""
import json
import os

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


def fake_run(root, model, step=4, data=None, module_edit=None, partitions=None, raw_states=None):
    """global_step<step> of a 1-rank, ep_size 1 run of model as the recipe lays it out (the tag's marker
    holding the run's config), under root/checkpoints/; returns the tag directory. module_edit(module)
    changes the non-expert tensors saved; partitions(params) -> a ZeRO partition's optimizer_state_dict;
    raw_states: bytes written as the model states file, or False for one without the 'module' key."""
    from turbomoe.checkpoint_tags import COMPLETE
    from turbomoe.export import _EXPERT, MODEL_STATES
    tag = os.path.join(root, "checkpoints", f"global_step{step}")
    os.makedirs(tag)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    module = {n: t for n, t in params.items() if not _EXPERT.match(n)}
    if module_edit is not None:
        module_edit(module)
    path = os.path.join(tag, MODEL_STATES)
    if isinstance(raw_states, bytes):  # not a torch.save file
        with open(path, "wb") as f:
            f.write(raw_states)
    elif raw_states is False:  # the tensors without the "module" key DeepSpeed writes
        torch.save(module, path)
    else:
        torch.save({"module": module}, path)
    for i, layer in enumerate(model.config.moe_layers()):
        for j in range(model.config.num_experts):
            prefix = f"model.layers.{layer}.mlp.deepspeed_moe.experts.deepspeed_experts.{j}."
            torch.save({n: t for n, t in params.items() if n.startswith(prefix)},
                       os.path.join(tag, f"layer_{i}_expert_{j}_{MODEL_STATES}"))
    if partitions is not None:
        torch.save({"optimizer_state_dict": partitions(params)},
                   os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    config = {"model": model.config.to_dict(), "moe": {"ep_size": 1}, "data": data or {"source": "stdlib"},
              "train": {"zero_stage": 1 if partitions else 0}}
    with open(os.path.join(tag, COMPLETE), "w") as f:
        json.dump({"step": step, "world_size": 1, "config": config}, f)
    return tag
