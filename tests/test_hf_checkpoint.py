"""Hugging Face Qwen3-MoE directories: a random transformers model saved by transformers (per-expert,
sharded, and the fused expert layout) -> from_pretrained -> the same logits in fp32 -> save_pretrained
-> the same tensors bit for bit, loaded back by transformers' Auto classes with no custom code; the
byte tokenizer through AutoTokenizer; and bad input, each a clear error with nothing written."""
import json
import os
import shutil

import pytest
import torch

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from turbomoe.data import ByteTokenizer  # noqa: E402
from turbomoe.models import MoEArgs, Qwen3MoeForCausalLM  # noqa: E402
from turbomoe.models.hf_checkpoint import CheckpointError, CheckpointReader, load_weights, save_dir  # noqa: E402

# Odd sizes; the two configs cover mlp_only_layers, decoder_sparse_step, norm_topk_prob both ways, tied
# and untied embeddings, attention biases on and off, k = 2 and 3.
CONFIGS = {
    "untied_bias_mlp_only": dict(vocab_size=263, hidden_size=24, intermediate_size=40, moe_intermediate_size=12,
                                 num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, head_dim=8,
                                 num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True,
                                 tie_word_embeddings=False, attention_bias=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    "tied_sparse_step": dict(vocab_size=67, hidden_size=20, intermediate_size=36, moe_intermediate_size=10,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=6,
                             num_experts=7, num_experts_per_tok=3, decoder_sparse_step=2, norm_topk_prob=False,
                             tie_word_embeddings=True, attention_bias=False, rms_norm_eps=1e-5),
}


def hf_model(name, seed=0):
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIGS[name])).eval()
    model.set_experts_implementation("eager")  # its grouped_mm default needs 16-byte strides: no odd sizes
    with torch.no_grad():  # transformers initialises the router to zeros: random weights route for real
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def tensors_of(path):
    """Every tensor of a directory's safetensors file(s), by key."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_round_trip_through_transformers(tmp_path, name):
    ref = hf_model(name)
    src = tmp_path / "hf"
    ref.save_pretrained(src, max_shard_size="30KB")  # sharded, with an index
    assert (src / "model.safetensors.index.json").exists()
    ids = torch.randint(0, ref.config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits

    ours = Qwen3MoeForCausalLM.from_pretrained(str(src))
    assert ours.config.tie_word_embeddings == ref.config.tie_word_embeddings
    with torch.no_grad():
        assert rel_err(ours(ids).logits, expected) < 1e-5

    out = tmp_path / "ours"
    ours.save_pretrained(str(out), max_shard_size="20KB")
    theirs, mine = tensors_of(src), tensors_of(out)
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[k], theirs[k]) and mine[k].dtype == theirs[k].dtype for k in theirs)

    back = transformers.AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager").eval()
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        assert torch.equal(back(ids).logits, expected)
    # Read from a directory, the model keeps its token ids and generation_config.json; the source has no
    # tokenizer, so none is written (its vocabulary is not turbomoe's bytes).
    src_cfg, out_cfg = (json.loads((d / "config.json").read_text()) for d in (src, out))
    # transformers 4.x's fields beside 5.x's, the same values (4.x ignores rope_parameters)
    assert out_cfg["rope_theta"] == out_cfg["rope_parameters"]["rope_theta"] == ref.config.rope_parameters["rope_theta"]
    assert out_cfg["torch_dtype"] == out_cfg["dtype"]
    assert [out_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [
        src_cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    assert (out / "generation_config.json").read_text() == (src / "generation_config.json").read_text()
    assert not (out / "tokenizer.json").exists()
    # A model made here (not read from a directory) gets the byte tokenizer where the vocabulary holds it.
    made = Qwen3MoeForCausalLM(ours.config)
    made.load_state_dict(ours.state_dict())
    made.save_pretrained(str(tmp_path / "made"))
    has_tokenizer = ref.config.vocab_size >= ByteTokenizer.vocab_size  # else the byte tokenizer does not fit
    assert json.loads((tmp_path / "made" / "generation_config.json").read_text())["eos_token_id"] == (
        ByteTokenizer.eos_id if has_tokenizer else None)
    if has_tokenizer:
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "made")
        assert tok("héllo\n")["input_ids"] == ByteTokenizer().encode("héllo\n").tolist()
    else:
        assert not (tmp_path / "made" / "tokenizer.json").exists()


def test_fused_expert_layout_and_bf16(tmp_path):
    """transformers' in-memory layout (gate_up_proj [E, 2F, H], down_proj [E, H, F]) on disk, single file."""
    ref = hf_model("untied_bias_mlp_only")
    src = tmp_path / "fused"
    ref.save_pretrained(src)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(0, 263, (2, 9))
    ours = Qwen3MoeForCausalLM.from_pretrained(str(src))
    with torch.no_grad():
        assert rel_err(ours(ids).logits, ref(ids).logits) < 1e-5
    per_expert = tmp_path / "per_expert"
    ours.save_pretrained(str(per_expert), dtype=torch.bfloat16)
    bf16 = Qwen3MoeForCausalLM.from_pretrained(str(per_expert))  # dtype from config.json
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    for a, b in zip(ours.state_dict().values(), bf16.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16), b)


def test_expert_parallel_rank_reads_its_experts(tmp_path):
    ref = hf_model("untied_bias_mlp_only")
    ref.save_pretrained(tmp_path / "hf")
    whole = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "hf"))
    part = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "hf"), moe_args=MoEArgs(ep_size=3), ep_rank=2)
    experts = lambda m, layer: m.model.layers[layer].mlp.deepspeed_moe.experts.deepspeed_experts  # noqa: E731
    for layer in (0, 2):
        assert len(experts(part, layer)) == 2
        for local, expert in enumerate(experts(part, layer)):
            for a, b in zip(expert.parameters(), experts(whole, layer)[4 + local].parameters()):
                assert torch.equal(a, b)
    with pytest.raises(ValueError, match="holds 1/3 of the experts"):
        part.save_pretrained(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["", "hello world", "  two  spaces\n\ttab\r\n", "héllo 日本語 🎉 ok",
                                  "\x00\x01\x7f", bytes(range(256)).decode("latin-1")])
def test_byte_tokenizer_through_auto_tokenizer(tmp_path, text):
    ByteTokenizer().save_pretrained(str(tmp_path), model_max_length=512)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = tok(text)["input_ids"]
    assert ids == ByteTokenizer().encode(text).tolist()
    assert tok.decode(ids) == text
    assert tok.eos_token_id == ByteTokenizer.eos_id and tok.convert_ids_to_tokens(256) == "<|endoftext|>"


def test_source_tokenizer_and_token_ids_come_along(tmp_path):
    """from_pretrained -> save_pretrained keeps the source's tokenizer files, token ids and
    generation_config.json (a published model's own, not turbomoe's byte tokenizer); a tokenizer passed
    to save_pretrained wins."""
    ref = hf_model("untied_bias_mlp_only")
    ref.config.bos_token_id, ref.config.eos_token_id, ref.config.pad_token_id = 3, 7, 1
    ref.generation_config.eos_token_id = [7, 9]
    src = tmp_path / "src"
    ref.save_pretrained(src)
    ByteTokenizer().save_pretrained(str(src), model_max_length=64)  # stands in for the model's own tokenizer
    (src / "tokenizer_config.json").write_text(
        json.dumps({**json.loads((src / "tokenizer_config.json").read_text()), "marker": "the source's"}))
    ours = Qwen3MoeForCausalLM.from_pretrained(str(src))
    ours.save_pretrained(str(tmp_path / "out"))
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (out_cfg["bos_token_id"], out_cfg["eos_token_id"], out_cfg["pad_token_id"]) == (3, 7, 1)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_text() == (src / name).read_text(), name
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == [7, 9]
    ours.save_pretrained(str(tmp_path / "bytes"), tokenizer=ByteTokenizer())
    assert json.loads((tmp_path / "bytes" / "config.json").read_text())["eos_token_id"] == ByteTokenizer.eos_id
    assert "marker" not in (tmp_path / "bytes" / "tokenizer_config.json").read_text()


# ---------------------------------------------------------------- bad input


@pytest.fixture
def sharded(tmp_path):
    hf_model("untied_bias_mlp_only").save_pretrained(tmp_path / "hf", max_shard_size="30KB")
    return tmp_path / "hf"


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_and_truncated_shard(sharded):
    shards = sorted(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(shards) > 2
    shard = sharded / shards[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shards[1]}: not a readable safetensors"):
        Qwen3MoeForCausalLM.from_pretrained(str(sharded))
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"{shards[1]}: shard listed in .*index.json"):
        Qwen3MoeForCausalLM.from_pretrained(str(sharded))


@pytest.mark.parametrize("changes, match", [
    (dict(model_type="mixtral"), "config.json: model_type is 'mixtral'"),
    (dict(moe_intermediate_size=14),
     r"experts.0.gate_proj.weight has shape \[12, 24\], but config.json implies \[14, 24\]"),
    (dict(vocab_size=300), r"model.embed_tokens.weight has shape \[263, 24\], but config.json implies \[300, 24\]"),
    (dict(hidden_act="gelu"), "config.json: hidden_act 'gelu'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "config.json: rope_parameters"),
    # beside rope_parameters too: transformers applies it (model cards tell users to add it for long contexts)
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
     "config.json: rope_scaling"),
    (dict(use_sliding_window=True, sliding_window=16), "config.json: use_sliding_window"),
    (dict(attention_dropout=0.1), "config.json: attention_dropout"),
    (dict(quantization_config={"quant_method": "awq", "bits": 4}), r"config.json: quantization_config \{'quant_method': "
     r"'awq', 'bits': 4\} is not supported \(only quant_method 'fp8'"),
    (dict(quantization_config={"quant_method": "fp8", "activation_scheme": "static"}), r"dynamic activation_scheme only"),
    (dict(mlp_only_layers=[7]), r"config.json: model.mlp_only_layers \[7\]"),
    (dict(mlp_only_layers=1), r"config.json: model.mlp_only_layers must be a list of layer indices, got 1"),
    (dict(rms_norm_eps="1e-6"), r"config.json: model.rms_norm_eps must be a positive finite number, got '1e-6'"),
    (dict(rms_norm_eps=-1e-6), r"config.json: model.rms_norm_eps must be a positive finite number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "abc"}), r"config.json: model.rope_theta must be"),
    (dict(norm_topk_prob="false"), r"config.json: model.norm_topk_prob must be true or false, got 'false'"),
    # without head_dim it is hidden_size // num_attention_heads, computed before ModelConfig checks either
    (dict(head_dim=None, hidden_size="24"), r"config.json: hidden_size must be a positive int, got '24'"),
])
def test_config_errors(sharded, changes, match):
    edit_config(sharded, **changes)
    with pytest.raises(CheckpointError, match=match):
        Qwen3MoeForCausalLM.from_pretrained(str(sharded))


def test_sliding_window_left_out_is_transformers_default(sharded):
    """use_sliding_window true with no sliding_window key: transformers' default window (4096) applies, so
    attention past 4096 tokens is windowed there; refused, not read as full attention. An explicit null
    window is full attention in transformers too, and is read."""
    cfg = json.loads((sharded / "config.json").read_text())
    cfg.pop("sliding_window", None)
    (sharded / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
    assert transformers.AutoConfig.from_pretrained(sharded).sliding_window == 4096
    with pytest.raises(CheckpointError, match="config.json: use_sliding_window with sliding_window 4096"):
        Qwen3MoeForCausalLM.from_pretrained(str(sharded))
    edit_config(sharded, sliding_window=None)
    assert transformers.AutoConfig.from_pretrained(sharded).sliding_window is None
    Qwen3MoeForCausalLM.from_pretrained(str(sharded))


@pytest.mark.parametrize("changes, theta", [
    # rope_scaling replaces rope_parameters whole (theta 5000 there): the top-level default 10000 applies
    (dict(rope_scaling={"rope_type": "default"}), 10000.0),
    (dict(rope_parameters=None, rope_scaling={"rope_type": "default", "rope_theta": 1e6}), 1e6),
])
def test_rope_scaling_read_as_transformers_reads_it(sharded, changes, theta):
    edit_config(sharded, **changes)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(sharded, experts_implementation="eager").eval()
    ours = Qwen3MoeForCausalLM.from_pretrained(str(sharded))
    assert ours.config.rope_theta == theirs.config.rope_parameters["rope_theta"] == theta
    ids = torch.randint(0, 263, (1, 64), generator=torch.Generator().manual_seed(0))  # far positions: theta shows
    with torch.no_grad():
        assert rel_err(ours(ids).logits, theirs(ids).logits) < 1e-5


def test_single_file_beside_an_index(tmp_path, sharded):
    """transformers reads model.safetensors, an index names other files: which is the model is not guessed."""
    hf_model("untied_bias_mlp_only", seed=1).save_pretrained(tmp_path / "single")
    shutil.copy(tmp_path / "single" / "model.safetensors", sharded)
    with pytest.raises(CheckpointError, match="holds both model.safetensors and model.safetensors.index.json"):
        Qwen3MoeForCausalLM.from_pretrained(str(sharded))


@pytest.mark.parametrize("weight_map, match", [
    (["model.norm.weight"], "index.json: weight_map is a list; expected an object"),
    ({"model.norm.weight": 3}, "index.json: weight_map maps model.norm.weight to 3; expected a file name"),
])
def test_malformed_index(sharded, weight_map, match):
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=match):
        Qwen3MoeForCausalLM.from_pretrained(str(sharded))


@pytest.mark.parametrize("ep_rank", [-1, 3, True, 1.0])
def test_ep_rank_outside_ep_size(tmp_path, sharded, ep_rank):
    """-1 read another rank's experts (fused layout), 3 failed mid-load: refused, before any file is read."""
    match = rf"ep_rank {ep_rank!r}: expected an int in \[0, 3\)"
    ep3 = MoEArgs(ep_size=3)
    with pytest.raises(ValueError, match=match):
        Qwen3MoeForCausalLM.from_pretrained(str(sharded), moe_args=ep3, ep_rank=ep_rank)
    part = Qwen3MoeForCausalLM.from_pretrained(str(sharded), moe_args=ep3, ep_rank=0)
    with pytest.raises(ValueError, match=match):
        part.load_hf_weights(str(tmp_path / "nowhere"), ep_rank=ep_rank)
    with CheckpointReader(str(sharded)) as reader, pytest.raises(ValueError, match=match):
        load_weights(part, reader, ep_rank)


def test_tied_config_with_another_lm_head(tmp_path):
    """tie_word_embeddings true with a stored lm_head.weight: read if it is the embedding, else an error
    (transformers would use the stored head untied; tying would drop it silently)."""
    ref = hf_model("tied_sparse_step")
    src = tmp_path / "tied"
    ref.save_pretrained(src)
    state = tensors_of(src)
    file = next(f for f in os.listdir(src) if f.endswith(".safetensors"))
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}, str(src / file),
              metadata={"format": "pt"})
    Qwen3MoeForCausalLM.from_pretrained(str(src))
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"] + 1}, str(src / file),
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="stored lm_head.weight differs from model.embed_tokens.weight"):
        Qwen3MoeForCausalLM.from_pretrained(str(src))


def test_save_with_a_broken_tie(tmp_path):
    """A tied model whose lm_head became a tensor of its own (load_state_dict(assign=True)): the same values
    are written once, as tied; other values are an error, not a tied config.json beside an lm_head.weight
    (that transformers unties, this reader refuses and a reader that trusts the config drops)."""
    ref = hf_model("tied_sparse_step")
    ref.save_pretrained(tmp_path / "src")
    ours = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "src"))
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    ours.load_state_dict(state, assign=True)
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    ours.save_pretrained(str(tmp_path / "same"))
    assert sorted(tensors_of(tmp_path / "same")) == sorted(tensors_of(tmp_path / "src"))
    Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "same"))
    with torch.no_grad():
        ours.lm_head.weight.add_(1)
    with pytest.raises(ValueError, match="lm_head.weight is another tensor and differs"):
        ours.save_pretrained(str(tmp_path / "differs"))
    assert not (tmp_path / "differs").exists()


def test_missing_tensor_and_directory(tmp_path, sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.mlp.experts.5.down_proj.weight"]
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="tensor model.layers.2.mlp.experts.5.down_proj.weight is missing"):
        Qwen3MoeForCausalLM.from_pretrained(str(sharded))
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "nowhere"))
    for dtype in (torch.int32, "bfloat16"):
        with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
            Qwen3MoeForCausalLM.from_pretrained(str(sharded), dtype=dtype)


def test_output_dir_exists_and_failed_write_leaves_nothing(tmp_path, sharded):
    model = Qwen3MoeForCausalLM.from_pretrained(str(sharded))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists; pass force=True"):
        model.save_pretrained(str(out))
    assert os.listdir(out) == ["keep.txt"]
    model.save_pretrained(str(out), force=True)
    assert "keep.txt" not in os.listdir(out) and (out / "config.json").exists()

    for bad, match in ((dict(dtype=torch.int8), "dtype torch.int8 cannot be saved"),
                       (dict(max_shard_size=-1), "max_shard_size -1: expected a positive number of bytes"),
                       (dict(max_shard_size="5 parsecs"), "max_shard_size '5 parsecs'")):
        with pytest.raises(ValueError, match=match):
            model.save_pretrained(str(tmp_path / "bad"), **bad)
    model.save_pretrained(str(tmp_path / "f64"), dtype=torch.float64)  # float64 round-trips, as the config says
    back = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "f64"))
    assert next(back.parameters()).dtype == torch.float64
    assert all(torch.equal(a.double(), b) for a, b in zip(model.parameters(), back.parameters()))
    shutil.rmtree(tmp_path / "f64")

    def failing():
        yield "model.norm.weight", torch.ones(3)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_dir(str(tmp_path / "half"), model.config, failing(), torch.float32)
    assert sorted(os.listdir(tmp_path)) == ["hf", "out"]  # neither the output nor its temporary directory

    # A write killed mid-way (no exception to clean up after it) leaves its temporary directory; the next
    # write of the same output from this host removes it once its process is gone, not while it runs.
    import socket
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stem = f".out.tmp-{socket.gethostname()}-"
    for pid in (dead, str(os.getppid())):
        os.makedirs(tmp_path / f"{stem}{pid}")
        (tmp_path / f"{stem}{pid}" / "shard0.part").write_bytes(b"x")
    model.save_pretrained(str(out), force=True)
    assert sorted(os.listdir(tmp_path)) == sorted(["hf", "out", f"{stem}{os.getppid()}"])


def test_published_qwen3_30b_a3b_config():
    """Qwen3-30B-A3B's config.json as published (transformers 4.51 fields: rope_theta, rope_scaling null,
    torch_dtype, max_window_layers): read as written: 30.5B parameters, 3.35B active (published: 30.5B, 3.3B)."""
    from turbomoe.models.hf_checkpoint import config_dtype, config_from_hf
    raw = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
           "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
           "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
           "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
           "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
           "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
           "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
    cfg = config_from_hf(raw)
    assert (cfg.rope_theta, cfg.head_dim, cfg.num_experts, cfg.norm_topk_prob) == (1e6, 128, 128, True)
    assert config_dtype(raw) == torch.bfloat16
    assert round(cfg.num_parameters() / 1e9, 1) == 30.5 and round(cfg.num_parameters(active=True) / 1e9, 2) == 3.35
    with pytest.raises(CheckpointError, match="rope_scaling"):
        config_from_hf({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
