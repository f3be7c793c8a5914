"""Review: the config.json variants of published Qwen3-MoE checkpoints and users' fine-tunes, read by
turbomoe.inference.load / Qwen3MoeForCausalLM.from_pretrained. Each variant is a tiny random model made
and saved by transformers; turbomoe must either generate transformers' greedy tokens (fp32, CPU) with
close logits, or refuse the directory with an error naming the field, leaving nothing half-built.

Faults the review found (fixed 2026-12-06; these tests keep them fixed):
- test_load_names_a_broken_config_json: load() (and `python -m turbomoe.generate`) read config.json with a
  bare json.load: a truncated file raised json's message without the file's name, a JSON list an
  AttributeError ('list' object has no attribute 'get').
- test_more_than_eight_experts_a_token_refused_naming_the_field: num_experts_per_tok 9 (transformers runs
  it) failed while building the model with "norm_topk_prob, recompute and fused_grad_accumulation need
  k <= 8 (turbomoe's layer), got k = 9": no config.json, no num_experts_per_tok, and it blames options the
  user never set.
"""
import copy
import gc
import json
import os

import pytest
import torch

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

from turbomoe.inference import load  # noqa: E402
from turbomoe.models import Qwen3MoeForCausalLM  # noqa: E402
from turbomoe.models.hf_checkpoint import CheckpointError, config_from_hf  # noqa: E402

V = 97
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
            max_position_embeddings=64, norm_topk_prob=True, mlp_only_layers=[1])


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: conftest.one_thread


def hf_dir(path, seed, config_edit=None, drop=(), store_dtype=None, **over):
    """A random transformers Qwen3-MoE (every weight random: transformers zeroes the router and the
    biases, and sets the norms to 1) saved at path; config.json then edited as a fine-tune or an older
    transformers would have it (config_edit: keys set, drop: keys removed)."""
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**BASE, **over})).eval()
    model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3)
    if store_dtype is not None:
        model.to(store_dtype)
    model.save_pretrained(path)
    file = os.path.join(path, "config.json")
    with open(file) as f:
        raw = json.load(f)
    raw.update(config_edit or {})
    for key in drop:
        raw.pop(key, None)
    with open(file, "w") as f:
        json.dump(raw, f, indent=2)
    return raw


def transformers_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              experts_implementation="eager").eval()
    return model


def prompts(seed, padded=True):
    """Three left-padded prompts (pad 0) of lengths 9, 4 and 12 (12 each unpadded)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, V, (n if padded else 12, ), generator=g).tolist() for n in (9, 4, 12)]
    T = max(map(len, rows))
    ids = torch.tensor([[0] * (T - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def check_same_as_transformers(path, seed, new_tokens=10, padded=True):
    """Greedy tokens of load()'s Engine == transformers' generate; from_pretrained's logits close to
    transformers' over the whole generated sequences."""
    ref = transformers_model(path)
    ids, mask = prompts(seed, padded)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    engine = load(str(path), device="cpu", dtype=torch.float32, max_batch=4, max_seq_len=32)
    got = engine.generate(ids, new_tokens, attention_mask=mask, pad_token_id=0)
    assert torch.equal(got, want), (got, want)
    ours = Qwen3MoeForCausalLM.from_pretrained(str(path), dtype=torch.float32, device="cpu")
    with torch.no_grad():  # unpadded, every row: the whole sequences' logits
        full = want[:, mask.shape[1] - 4:]  # the last 4 prompt columns (real in every row) and the new tokens
        assert rel_err(ours(full).logits, ref(full).logits) < 1e-5
    return ours


# ---------------------------------------------------------------- variants read as transformers reads them

ACCEPTED = {
    # routing: renormalised or raw top-k probabilities, k of 1 and all of the experts
    "norm_topk_false_k3": dict(norm_topk_prob=False, num_experts_per_tok=3),
    "norm_topk_true_k1": dict(norm_topk_prob=True, num_experts_per_tok=1),
    "k_equals_num_experts": dict(num_experts=4, num_experts_per_tok=4, norm_topk_prob=False),
    "norm_topk_prob_left_out": dict(norm_topk_prob=True, drop=("norm_topk_prob", )),  # transformers: False
    # which layers are MoE
    "decoder_sparse_step_2": dict(decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=4),
    "sparse_step_and_mlp_only": dict(decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=4),
    "mlp_only_layers_null": dict(mlp_only_layers=[], config_edit={"mlp_only_layers": None}),
    "first_layer_dense": dict(mlp_only_layers=[0]),
    # embeddings
    "tied": dict(tie_word_embeddings=True),
    # attention shapes
    "head_dim_not_hidden_over_heads": dict(head_dim=16),  # 32 / 4 = 8
    "head_dim_left_out": dict(num_attention_heads=2, head_dim=16, drop=("head_dim", )),  # 32 / 2
    "mha": dict(num_key_value_heads=4),
    "mqa": dict(num_key_value_heads=1),
    "gqa_ratio_4": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=4),
    "attention_bias_gqa": dict(attention_bias=True, num_key_value_heads=1, head_dim=12),
    "rms_norm_eps_large": dict(rms_norm_eps=0.25),
    # rotary: transformers 5's rope_parameters, 4.x's rope_theta (with rope_scaling null)
    "rope_parameters_theta_100": dict(rope_parameters={"rope_type": "default", "rope_theta": 100.0}),
    "rope_theta_4x_style": dict(drop=("rope_parameters", ), config_edit={"rope_theta": 50.0, "rope_scaling": None}),
    "rope_parameters_without_theta": dict(config_edit={"rope_parameters": {"rope_type": "default"},
                                                       "rope_theta": 300.0}),
    # sliding window off: a window set, smaller than the prompts, changes nothing in transformers
    "sliding_window_set_not_used": dict(config_edit={"use_sliding_window": False, "sliding_window": 3,
                                                     "max_window_layers": 1}),
    "use_sliding_window_null_window": dict(config_edit={"use_sliding_window": True, "sliding_window": None,
                                                        "max_window_layers": 28}),
    # training-only and bookkeeping fields (transformers' generate fails on its own aux loss with
    # output_router_logits and an attention mask: unpadded prompts there)
    "router_loss_fields": dict(padded=False, config_edit={"router_aux_loss_coef": 0.3, "output_router_logits": True}),
    "token_ids_and_use_cache": dict(config_edit={"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": 5,
                                                 "use_cache": False}),
    # transformers 5's name of the expert count alone, and 4.x's torch_dtype alone over bf16 weights
    "num_local_experts_only": dict(drop=("num_experts", ), config_edit={"num_local_experts": 6}),
    "bf16_weights_torch_dtype_4x": dict(store_dtype=torch.bfloat16, drop=("dtype", ),
                                        config_edit={"torch_dtype": "bfloat16"}),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_variant_generates_transformers_tokens(tmp_path, name):
    seed = sorted(ACCEPTED).index(name)
    over = copy.deepcopy(ACCEPTED[name])
    padded = over.pop("padded", True)
    hf_dir(tmp_path / "hf", seed, **over)
    ours = check_same_as_transformers(tmp_path / "hf", seed, padded=padded)
    # what turbomoe read is what transformers reads (a second look, not through the logits)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    cfg = ours.config
    assert cfg.norm_topk_prob == theirs.norm_topk_prob
    assert cfg.tie_word_embeddings == theirs.tie_word_embeddings
    assert cfg.rope_theta == theirs.rope_parameters["rope_theta"]
    assert cfg.moe_layers() == [i for i, layer in enumerate(transformers_model(tmp_path / "hf").model.layers)
                                if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock"]


def test_rope_theta_shows_at_far_positions(tmp_path):
    """rope_theta 1e6 and 10 read from rope_parameters agree with transformers past position 20, where a
    wrong theta would show (logits over a 30-token prompt, and greedy tokens after it)."""
    for theta in (10.0, 1e6):
        path = tmp_path / f"theta{theta}"
        hf_dir(path, 7, rope_parameters={"rope_type": "default", "rope_theta": theta})
        ref = transformers_model(path)
        ids = torch.randint(1, V, (1, 30), generator=torch.Generator().manual_seed(7))
        engine = load(str(path), device="cpu", dtype=torch.float32, max_batch=1, max_seq_len=40)
        assert torch.equal(engine.generate(ids, 6), ref.generate(ids, max_new_tokens=6, do_sample=False,
                                                                 pad_token_id=0))
        ours = Qwen3MoeForCausalLM.from_pretrained(str(path))
        with torch.no_grad():
            assert rel_err(ours(ids).logits, ref(ids).logits) < 1e-5


# ---------------------------------------------------------------- refused, naming the field

def open_into(path):
    """Descriptors and memory maps of this process into path (safetensors maps its files)."""
    path = os.path.realpath(path)
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")).startswith(path):
                fds.append(fd)
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = [line for line in f if path in line]
    return fds, maps


def listing(path):
    return sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path))


REFUSED = {
    # transformers applies these: YaRN / linear / dynamic scaling change every rotary frequency
    "rope_scaling_yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 32}}, "rope_scaling"),
    "rope_scaling_linear_4x_type": ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    "rope_parameters_dynamic": ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
                                "rope_parameters"),
    "rope_default_with_extra_key": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                         "partial_rotary_factor": 0.5}}, "rope_parameters"),
    "partial_rotary_factor_top_level": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    "sliding_window_on": ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
                          "use_sliding_window"),
    "unknown_key": ({"my_finetune_flag": 3, "layer_types": ["full_attention"] * 3}, "layer_types', 'my_finetune_flag"),
    "hidden_act_gelu": ({"hidden_act": "gelu"}, "hidden_act"),
    "mlp_only_layers_negative": ({"mlp_only_layers": [-1]}, "mlp_only_layers"),
    "every_layer_dense": ({"mlp_only_layers": [0, 1, 2]}, "decoder_sparse_step and mlp_only_layers"),
    "odd_head_dim": ({"head_dim": 7}, "head_dim"),
    "gqa_not_a_divisor": ({"num_key_value_heads": 3}, "num_key_value_heads"),
    "num_experts_disagree": ({"num_experts": 5}, "num_experts"),  # num_local_experts 6 beside it
    "quantization_bnb": ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
                         "quantization_config"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_naming_the_field_and_nothing_left(tmp_path, name):
    edit, field = REFUSED[name]
    hf_dir(tmp_path / "hf", 3, config_edit=edit)
    before = listing(tmp_path / "hf")
    default_dtype = torch.get_default_dtype()
    for read in (lambda: load(str(tmp_path / "hf"), device="cpu", dtype=torch.bfloat16),
                 lambda: Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float64)):
        with pytest.raises(CheckpointError, match="config.json: .*" + field):
            read()
        assert torch.get_default_dtype() == default_dtype
        assert open_into(tmp_path / "hf") == ([], [])
        assert listing(tmp_path / "hf") == before


def test_refused_directory_leaves_a_live_model_untouched(tmp_path):
    """load_hf_weights (the recipe's init_from) from a directory refused for a field no shape shows
    (YaRN beside a model of default rotary): no parameter, buffer or hf_source changes."""
    raw = hf_dir(tmp_path / "good", 1)
    model = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "good"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    source = model.hf_source
    hf_dir(tmp_path / "yarn", 2, config_edit={"rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(CheckpointError, match="config.json: rope_scaling"):
        model.load_hf_weights(str(tmp_path / "yarn"))
    assert model.hf_source == source
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert open_into(tmp_path / "yarn") == ([], [])
    # the same weights under a config.json of another rms_norm_eps: refused too (no shape shows it)
    hf_dir(tmp_path / "eps", 2, rms_norm_eps=1e-3)
    with pytest.raises(CheckpointError, match="rms_norm_eps"):
        model.load_hf_weights(str(tmp_path / "eps"))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert config_from_hf(raw).rms_norm_eps == model.config.rms_norm_eps == 1e-6


def test_tied_config_over_a_stored_head_that_differs_leaves_nothing_open(tmp_path):
    """The tie check runs with the model built and the files open: after the refusal the default dtype
    is back and no file of the directory is open or mapped."""
    hf_dir(tmp_path / "hf", 4, config_edit={"tie_word_embeddings": True})  # saved untied: lm_head stored
    default_dtype = torch.get_default_dtype()
    with pytest.raises(CheckpointError, match="tie_word_embeddings"):
        load(str(tmp_path / "hf"), device="cpu", dtype=torch.bfloat16)
    assert torch.get_default_dtype() == default_dtype
    assert open_into(tmp_path / "hf") == ([], [])


# ---------------------------------------------------------------- faults

def test_load_names_a_broken_config_json(tmp_path):
    """from_pretrained says "<dir>/config.json: not valid JSON" / "expected a JSON object"; load(), which
    reads the file first (check_model_dir, also the CLI's check), raised json's own message without the
    file, and an AttributeError for a JSON list."""
    hf_dir(tmp_path / "hf", 5)
    file = tmp_path / "hf" / "config.json"
    text = file.read_text()
    for broken in (text[:-20], "[1, 2]"):
        file.write_text(broken)
        with pytest.raises(CheckpointError, match="config.json: .*JSON"):
            Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "hf"))
        with pytest.raises(ValueError, match="config.json"):
            load(str(tmp_path / "hf"), device="cpu", dtype=torch.float32)


def test_more_than_eight_experts_a_token_refused_naming_the_field(tmp_path):
    """num_experts_per_tok 9 of 12: transformers runs it; turbomoe's layers take at most 8 routes a token.
    The refusal must name config.json's field, not blame norm_topk_prob / recompute (which the user never
    set), and leave the default dtype and the files as they were."""
    hf_dir(tmp_path / "hf", 6, num_experts=12, num_experts_per_tok=9)
    ref = transformers_model(tmp_path / "hf")
    ids = torch.randint(1, V, (1, 5), generator=torch.Generator().manual_seed(6))
    assert ref.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0).shape == (1, 7)
    del ref  # transformers' model maps the weights file
    gc.collect()
    default_dtype = torch.get_default_dtype()
    with pytest.raises(ValueError, match=r"config\.json.*num_experts_per_tok|num_experts_per_tok.*config\.json"):
        load(str(tmp_path / "hf"), device="cpu", dtype=torch.bfloat16)
    assert torch.get_default_dtype() == default_dtype
    assert open_into(tmp_path / "hf") == ([], [])
