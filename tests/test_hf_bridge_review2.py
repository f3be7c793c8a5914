"""Second review of the Hugging Face bridge (hf_checkpoint.py, export.py, integrations/transformers.py): each
test fails without its fix. transformers' Qwen3MoeForCausalLM is the oracle; fresh random weights (seed in
the messages). Also: force=True keeps a folder it did not write."""
import json
import os
import random
import shutil

import pytest
import torch

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from test_hf_bridge_review import hf_dir  # noqa: E402
from turbomoe.models import Qwen3MoeForCausalLM  # noqa: E402
from turbomoe.models.hf_checkpoint import CheckpointError  # noqa: E402


@pytest.fixture
def seed():
    return random.SystemRandom().randrange(2**31)


def hf_sharded(path, seed, **changes):
    """A random transformers Qwen3-MoE saved at path in shards with an index; its weight map."""
    hf_dir(path, seed, save_kw=dict(max_shard_size="10KB"), **changes)
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def add_to_shard(path, shard, **tensors):
    state = load_file(str(path / shard))
    save_file({**state, **tensors}, str(path / shard), metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["lm_head under a tie", "a second copy"])
def test_shard_tensor_the_index_leaves_out(tmp_path, seed, case):
    """transformers reads every tensor of the shards an index names, listed or not, in shard order. A tied
    model's shard holding an lm_head.weight the index leaves out is untied there (its own head); a tensor
    written again into a later shard is read from there. The reader went by the index alone (the tie held, the
    listed copy was read): other logits than transformers', no error. Refused now, naming the shard and tensor."""
    weight_map = hf_sharded(tmp_path, seed, tie_word_embeddings=case == "lm_head under a tie")
    last = sorted(set(weight_map.values()))[-1]
    if case == "lm_head under a tie":
        key, shard, like = "lm_head.weight", last, "model.embed_tokens.weight"
    else:
        key = like = sorted(k for k, v in weight_map.items() if v != last)[0]
        shard = last
    value = torch.randn(load_file(str(tmp_path / weight_map[like]))[like].shape,
                        generator=torch.Generator().manual_seed(seed))
    add_to_shard(tmp_path, shard, **{key: value})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    assert torch.equal(theirs.state_dict()[key], value), f"seed {seed}: transformers reads the shard's {key}"
    with pytest.raises(CheckpointError, match=rf"{shard}: holds {key} .* that model.safetensors.index.json does "
                                              rf"not place there"):
        Qwen3MoeForCausalLM.from_pretrained(str(tmp_path))


def test_force_keeps_a_folder_it_did_not_write(tmp_path, seed):
    """force=True replaces the whole output directory: saving into a cloned Hugging Face repository deleted
    its .git. A directory holding any folder is refused, naming it, and left as it was; files alone (an
    earlier save) are replaced as before."""
    hf_sharded(tmp_path / "hf", seed)
    model = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "hf"))
    out = tmp_path / "repo"
    (out / ".git" / "objects").mkdir(parents=True)
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (out / "README.md").write_text("mine")
    with pytest.raises(FileExistsError, match=r"holds folders \['.git'\] that no save writes"):
        model.save_pretrained(str(out), force=True)
    assert sorted(os.listdir(out)) == [".git", "README.md"] and (out / ".git" / "HEAD").exists()
    shutil.rmtree(out / ".git")
    model.save_pretrained(str(out), force=True)
    assert "README.md" not in os.listdir(out) and (out / "config.json").exists()
