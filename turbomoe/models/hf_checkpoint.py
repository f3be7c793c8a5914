"""Hugging Face Qwen3-MoE directories <-> turbomoe's ModelConfig and weights.

Reading: config.json -> ModelConfig, every field that changes the math honoured and any other field
an error that names it; safetensors weights, one file or shards listed in model.safetensors.index.json,
opened lazily (safe_open: a tensor is read when it is copied into the model); experts in either layout
transformers loads for qwen3_moe:
  per expert (what transformers 5.x writes)  mlp.experts.J.{gate,up,down}_proj.weight  [F, H], [F, H], [H, F]
  fused (transformers' in-memory layout)     mlp.experts.gate_up_proj [E, 2F, H], mlp.experts.down_proj [E, H, F]
An expert-parallel rank reads only its own experts' rows. FP8 block-quantized checkpoints
(quantization_config quant_method "fp8", e4m3 weights X.weight with per-block scales X.weight_scale_inv,
as Qwen3's -FP8 releases) are dequantized to the model's dtype as each tensor is read.

Writing: config.json, generation_config.json, the byte tokenizer, safetensors shards (+ index) in the
per-expert layout, built in a temporary directory that is renamed to the output at the end: a failed
write leaves nothing behind.
"""
import contextlib
import json
import math
import os
import re
import shutil
import socket
from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .hf_names import to_hf_name

MODEL_TYPE = "qwen3_moe"
CONFIG = "config.json"
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# transformers' router loss when it trains the model: no part of the forward pass, but a directory written
# from a model read from another keeps them (transformers' defaults would replace them).
ROUTER_LOSS = ("router_aux_loss_coef", "output_router_logits")
# What transformers' tokenizers save (any of them); a model read from a directory takes them along.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

# config.json fields with the same name and meaning in ModelConfig.
_SAME = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "num_experts_per_tok", "decoder_sparse_step",
         "mlp_only_layers", "norm_topk_prob", "rms_norm_eps", "max_position_embeddings", "initializer_range",
         "tie_word_embeddings", "attention_bias")
# Fields that do not change the model's forward pass (bookkeeping, generation, training-only loss terms);
# the others are read below or are errors.
_INERT = {"architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
          "output_router_logits", "router_aux_loss_coef", "bos_token_id", "eos_token_id", "pad_token_id",
          "max_window_layers", "_name_or_path", "output_attentions", "output_hidden_states", "return_dict"}
_HANDLED = {"num_experts", "num_local_experts", "head_dim", "hidden_act", "attention_dropout", "rope_parameters",
            "rope_theta", "rope_scaling", "use_sliding_window", "sliding_window", "quantization_config"}
FP8 = "F8_E4M3"  # safetensors' name of float8_e4m3fn
SCALE = "_scale_inv"  # X.weight's scales: X.weight_scale_inv (weight = stored e4m3 x scale, block by block)
# Qwen3MoeConfig's defaults (transformers 5.x): a field config.json leaves out has this value in
# transformers, so it has it here too.
_HF_DEFAULTS = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128,
                "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "initializer_range": 0.02,
                "tie_word_embeddings": False, "attention_bias": False, "sliding_window": 4096}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
_STORED = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}  # safetensors' names
WEIGHT_DTYPES = {*_STORED, FP8}  # safetensors' names of the dtypes a weight is read from
EMBED = "model.embed_tokens.weight"
_OUR_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(w1|w3|w2)\.weight$")
_OUR_TO_HF_LINEAR = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(?:(gate_up_proj|down_proj)$|\d+\.)")


class CheckpointError(ValueError):
    """A Hugging Face directory turbomoe cannot read as it is; the message names the file and field."""


# ---------------------------------------------------------------- config.json


def read_config(path: str) -> dict:
    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} does not exist: {path!r} is not a Hugging Face model directory")
    try:
        with open(file) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return raw


def _rope_theta(raw: dict, file: str) -> float:
    """Default (unscaled) rotary embeddings only, read as transformers 5.x reads them: a non-empty rope_scaling
    (4.x's field, which model cards tell users to add for long contexts) replaces rope_parameters whole, and
    a rope_theta missing from the one used comes from the top level."""
    field = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(field)
    if not isinstance(params, (dict, type(None))):
        raise CheckpointError(f"{file}: {field} must be an object, got {params!r}")
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    extra = sorted(set(params) - {"rope_type", "type", "rope_theta"})
    if kind != "default" or extra:
        raise CheckpointError(f"{file}: {field} {params} is not supported (only rope_type 'default' with "
                              f"rope_theta)")
    return params.get("rope_theta", raw.get("rope_theta", 10000.0))  # ModelConfig.validate checks it


def fp8_blocks(raw: dict, file: str = CONFIG):
    """config.json's quantization_config: None where there is none, else the FP8 checkpoint's weight blocks
    ((rows, cols), or () for one scale a tensor). Only what dequantizing as read serves: quant_method fp8,
    e4m3 weights, dynamic activation scales (none stored); anything else a CheckpointError."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        raise CheckpointError(f"{file}: quantization_config {q!r} is not supported (only quant_method 'fp8', "
                              f"dequantized as it is read)")
    if q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{file}: quantization_config {q!r} is not supported (FP8 weights in e4m3 with a "
                              f"dynamic activation_scheme only)")
    block = q.get("weight_block_size", [128, 128])  # FineGrainedFP8Config's default where the field is left out
    if block is None:
        return ()
    if not (isinstance(block, list) and len(block) == 2 and
            all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{file}: quantization_config's weight_block_size must be two positive ints, got "
                              f"{block!r}")
    return tuple(block)


def dequantize_fp8(w_NK: torch.Tensor, scale: torch.Tensor, blocks) -> torch.Tensor:
    """fp32 weights of e4m3 w [N, K] and its scales: one ([] or [1]) or a block's each ([ceil(N / bn),
    ceil(K / bk)], the last row and column of blocks possibly partial)."""
    w = w_NK.float()
    if not blocks:
        return w * scale.float().reshape(())
    (N, K), (bn, bk) = w.shape, blocks
    return w * scale.float().repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]


def config_from_hf(raw: dict, file: str = CONFIG, moe_impl: str = "turbomoe") -> ModelConfig:
    """A Qwen3MoeConfig dict (config.json) -> ModelConfig; a field turbomoe cannot honour is an error."""
    if raw.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{file}: model_type is {raw.get('model_type')!r}; turbomoe reads {MODEL_TYPE!r}")
    unknown = sorted(set(raw) - set(_SAME) - _INERT - _HANDLED)
    if unknown:
        raise CheckpointError(f"{file}: fields {unknown} are not supported by turbomoe's Qwen3-MoE (they may change "
                              f"the model's math)")
    fp8_blocks(raw, file)  # math-neutral once dequantized; anything else refused
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{file}: hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    if raw.get("attention_dropout", 0.0):
        raise CheckpointError(f"{file}: attention_dropout {raw['attention_dropout']} is not supported (only 0)")
    window = raw.get("sliding_window", _HF_DEFAULTS["sliding_window"])  # left out: on, unless it says null
    if raw.get("use_sliding_window") and window is not None:
        raise CheckpointError(f"{file}: use_sliding_window with sliding_window {window} is not supported (full "
                              f"causal attention only)")
    d = {k: raw.get(k, _HF_DEFAULTS[k]) for k in _SAME}
    if "num_experts" in raw and "num_local_experts" in raw and raw["num_experts"] != raw["num_local_experts"]:
        # transformers reads num_local_experts (num_experts is its alias): which one is meant is not guessed
        raise CheckpointError(f"{file}: num_experts {raw['num_experts']!r} and num_local_experts "
                              f"{raw['num_local_experts']!r} differ; keep one of them")
    d["num_experts"] = raw.get("num_experts", raw.get("num_local_experts", _HF_DEFAULTS["num_experts"]))
    if not d["num_experts"]:
        raise CheckpointError(f"{file}: num_experts is {d['num_experts']!r}; a Qwen3-MoE model needs experts")
    d["mlp_only_layers"] = d["mlp_only_layers"] or []
    if not raw.get("head_dim"):  # derived from two sizes that ModelConfig.validate has not checked yet
        for name in ("hidden_size", "num_attention_heads"):
            if not (isinstance(d[name], int) and not isinstance(d[name], bool) and d[name] > 0):
                raise CheckpointError(f"{file}: {name} must be a positive int, got {d[name]!r}")
    d["head_dim"] = raw.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
    theta = _rope_theta(raw, file)
    d["rope_theta"] = float(theta) if isinstance(theta, int) and not isinstance(theta, bool) else theta
    d["moe_impl"] = moe_impl
    try:
        return ModelConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: {e}") from e


def config_to_hf(cfg: ModelConfig, dtype: torch.dtype, token_ids: dict) -> dict:
    """ModelConfig -> a config.json that transformers' Qwen3MoeConfig reads; token_ids: its TOKEN_IDS, and the
    ROUTER_LOSS fields where it has them (a source config.json's)."""
    names = {v: k for k, v in _DTYPES.items()}
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": MODEL_TYPE,
            **{k: getattr(cfg, k) for k in _SAME},
            "num_experts": cfg.num_experts, "head_dim": cfg.head_dim, "hidden_act": "silu", "attention_dropout": 0.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "use_sliding_window": False, "sliding_window": None, "dtype": names[dtype],
            # transformers 4.x's names (and serving stacks on it): without them it would run rope_theta
            # 10000 and guess the dtype; 5.x reads them as the same values
            "rope_theta": cfg.rope_theta, "torch_dtype": names[dtype],
            **{k: token_ids.get(k) for k in TOKEN_IDS}, **{k: token_ids[k] for k in ROUTER_LOSS if k in token_ids},
            "use_cache": True}


def config_dtype(raw: dict, reader: Optional["CheckpointReader"] = None) -> torch.dtype:
    """The dtype config.json says the weights are stored in; where it names none we know, the embedding's
    stored dtype (transformers' dtype="auto" takes the first floating weight's), else float32."""
    named = _DTYPES.get(raw.get("dtype") or raw.get("torch_dtype"))
    if named is None and reader is not None and EMBED in reader.weight_map:
        named = _STORED.get(reader.stored_dtype(EMBED))
    return named or torch.float32


# ---------------------------------------------------------------- safetensors, read lazily


class CheckpointReader:
    """name -> tensor over a directory's safetensors file(s); use as a context manager."""

    def __init__(self, path: str):
        self.path = path
        index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
        self._stack = contextlib.ExitStack()
        try:
            self.weight_map = self._open(path, index, single)
        except BaseException:
            self._stack.close()
            raise

    def _open(self, path: str, index: str, single: str) -> dict:
        """Open every file (checking each is there and readable); returns the key -> file map."""
        if os.path.isfile(index) and os.path.isfile(single):  # transformers reads the single file, others the index
            raise CheckpointError(f"{path}: holds both {SINGLE} and {INDEX}; expected one of them (remove the stale "
                                  f"one)")
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index with a weight_map ({e!r})") from e
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: weight_map is a {type(weight_map).__name__}; expected an object "
                                      f"mapping tensor names to file names")
            bad = [k for k, v in weight_map.items() if not isinstance(v, str)]
            if bad:
                raise CheckpointError(f"{index}: weight_map maps {bad[0]} to {weight_map[bad[0]]!r}; expected a "
                                      f"file name (a string)")
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            weight_map, files = None, [SINGLE]
        else:
            raise FileNotFoundError(f"{path}: neither {SINGLE} nor {INDEX} is there")
        self._handles = {}
        for name in files:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{file}: shard listed in {index} does not exist")
            try:
                self._handles[name] = self._stack.enter_context(safe_open(file, framework="pt"))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file}: not a readable safetensors file, truncated or damaged? ({e})") from e
        if weight_map is None:
            weight_map = {k: SINGLE for k in self._handles[SINGLE].keys()}
        # transformers reads every tensor of every shard the index names, listed or not: a shard's tensor that
        # the index leaves out (or places in another shard) is part of the model there (load_weights refuses it).
        self.unlisted = {}
        for name, handle in self._handles.items():
            keys = set(handle.keys())
            missing = sorted(k for k, v in weight_map.items() if v == name and k not in keys)
            if missing:
                raise CheckpointError(f"{os.path.join(path, name)}: lacks tensors {missing[:5]} that {INDEX} "
                                      f"places there")
            self.unlisted.update((k, name) for k in keys if weight_map.get(k) != name)
        return weight_map

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def file_of(self, key: str) -> str:
        return os.path.join(self.path, self.weight_map[key])

    def shape(self, key: str) -> List[int]:
        return list(self._handles[self.weight_map[key]].get_slice(key).get_shape())

    def stored_dtype(self, key: str) -> str:
        """safetensors' name of key's dtype ("BF16", "F32", ...), no tensor read."""
        return self._handles[self.weight_map[key]].get_slice(key).get_dtype()

    def get(self, key: str, index: Optional[int] = None) -> torch.Tensor:
        """The tensor, or only its row `index` of the first dimension (one expert of a fused tensor)."""
        handle = self._handles[self.weight_map[key]]
        try:
            return handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
        except SafetensorError as e:
            raise CheckpointError(f"{self.file_of(key)}: cannot read {key} ({e})") from e


# ---------------------------------------------------------------- weights into a model


def _source_of(name: str, reader: CheckpointReader, global_expert: Callable[[int], int], F: int):
    """Where the checkpoint holds our parameter `name`: (key, expert row of a fused tensor or None, rows of
    that expert's [2F, H] gate_up block or None)."""
    m = _OUR_EXPERT.match(name)
    if not m:
        return to_hf_name(name), None, None
    prefix, j, ours = m.group(1), global_expert(int(m.group(2))), m.group(3)
    per_expert = f"{prefix}.experts.{j}.{_OUR_TO_HF_LINEAR[ours]}.weight"
    fused = f"{prefix}.experts.{'down_proj' if ours == 'w2' else 'gate_up_proj'}"
    if per_expert in reader.weight_map or fused not in reader.weight_map:
        return per_expert, None, None
    # gate_up_proj [E, 2F, H]: rows [0, F) are the gate, [F, 2F) the up projection (chunk(2) in transformers).
    return fused, j, None if ours == "w2" else slice(0, F) if ours == "w1" else slice(F, 2 * F)


def _expected_keys(cfg: ModelConfig, our_names: Iterable[str], fp8: bool = False) -> set:
    """Every checkpoint key a whole model reads (all experts, any rank), for the unexpected-key check; with
    fp8, each tensor's scales too."""
    keys = {to_hf_name(n) for n in our_names if not _OUR_EXPERT.match(n)}
    for layer in cfg.moe_layers():
        prefix = f"model.layers.{layer}.mlp.experts"
        keys |= {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"}
        keys |= {f"{prefix}.{j}.{p}.weight" for j in range(cfg.num_experts) for p in _OUR_TO_HF_LINEAR.values()}
    if cfg.tie_word_embeddings:
        keys.add("lm_head.weight")  # written by some tools though tied: read only to check it is the embedding
    if fp8:  # the fused experts' too (FP8Experts' gate_up_proj_scale_inv): _fp8_scale refuses those by name
        keys |= {k + SCALE for k in keys}
    return keys


def _math_of(cfg: ModelConfig) -> dict:
    """The fields of cfg that change the model's output; the MoE layers as a list of indices ([1] and (1,),
    or the same layers by two rules, are one model)."""
    skip = {"decoder_sparse_step", "mlp_only_layers", "max_position_embeddings", "initializer_range", "moe_impl"}
    return {**{k: v for k, v in cfg.to_dict().items() if k not in skip}, "moe_layers": cfg.moe_layers()}


def check_config(cfg: ModelConfig, path: str):
    """CheckpointError unless path's config.json describes the model cfg builds: weights copied into a model
    with another rope_theta, norm_topk_prob or rms_norm_eps (no shape shows them) compute another model."""
    file = os.path.join(path, CONFIG)
    theirs, ours = _math_of(config_from_hf(read_config(path), file, cfg.moe_impl)), _math_of(cfg)
    diff = {k: (v, ours[k]) for k, v in theirs.items() if v != ours[k]}
    if diff:
        raise CheckpointError(f"{file}: describes another model than the one its weights would go into "
                              f"(field: (config.json, model)): {diff}")


@torch.no_grad()
def load_weights(model: torch.nn.Module, reader: CheckpointReader, ep_rank: int = 0):
    """Copy the checkpoint into the model's parameters in place (expert packing is kept), casting to
    their dtype; this rank's experts only. The directory's config.json must describe the model (check_config),
    and every shape is checked before any tensor is read."""
    check_ep_rank(ep_rank, model.moe_args.ep_size)
    cfg = model.config
    check_config(cfg, reader.path)
    num_local = cfg.num_experts // model.moe_args.ep_size
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    blocks = fp8_blocks(read_config(reader.path), os.path.join(reader.path, CONFIG))
    scaled = sorted(k for k in reader.weight_map if k.endswith(SCALE))
    if blocks is None and scaled:  # an FP8 checkpoint whose config.json lost its quantization_config
        raise CheckpointError(f"{reader.file_of(scaled[0])}: holds FP8 scales ({scaled[0]}, {len(scaled)} in all) but "
                              f"{CONFIG} has no quantization_config (quant_method 'fp8')")
    unexpected = sorted(set(reader.weight_map) - _expected_keys(cfg, params, blocks is not None))
    if unexpected:
        raise CheckpointError(f"{reader.path}: tensors {unexpected[:5]} ({len(unexpected)} in all) are not part of "
                              f"a Qwen3-MoE model with this config.json")
    layouts = {}  # layer -> how its experts are stored: two copies would leave which one is the model a guess
    for m in filter(None, map(_HF_EXPERT.match, reader.weight_map)):
        layouts.setdefault(int(m.group(1)), set()).add("fused" if m.group(2) else "per expert")
    both = sorted(layer for layer, kinds in layouts.items() if len(kinds) == 2)
    if both:
        raise CheckpointError(f"{reader.path}: the experts of layers {both} are stored both fused (gate_up_proj, "
                              f"down_proj) and per expert (experts.J.gate_proj.weight, ...); keep one layout")
    plan = []
    for name, p in params.items():
        key, row, rows = _source_of(name, reader, lambda j: ep_rank * num_local + j, cfg.moe_intermediate_size)
        if key not in reader.weight_map:
            raise CheckpointError(f"{reader.path}: tensor {key} is missing")
        shape = reader.shape(key)
        expected = list(p.shape)
        if row is not None:  # fused experts: [E, ...] with the gate and up halves stacked in dim 1
            expected = [cfg.num_experts, *([2 * expected[0]] if rows is not None else [expected[0]]), *expected[1:]]
        if shape != expected:
            raise CheckpointError(f"{reader.file_of(key)}: {key} has shape {shape}, but {CONFIG} implies {expected}")
        stored = reader.stored_dtype(key)
        if stored not in WEIGHT_DTYPES:  # before any copy: a failed read leaves the model whole
            raise CheckpointError(f"{reader.file_of(key)}: cannot read {key}: stored as {stored}; "
                                  f"weights are read from {', '.join(sorted(_STORED))} and {FP8} "
                                  f"(with its scales)")
        plan.append((p, key, row, rows, _fp8_scale(reader, key, row, shape, blocks)))
    # judged by the scaled tensor as stored, not by this plan: other ranks' experts' scales are no strays
    stray = [k for k in scaled if k[:-len(SCALE)] not in reader.weight_map or
             reader.stored_dtype(k[:-len(SCALE)]) != FP8]
    if stray:
        raise CheckpointError(f"{reader.file_of(stray[0])}: {stray[0]} scales a tensor that is not stored in FP8 "
                              f"({len(stray)} such in all)")
    if reader.unlisted:
        key, name = sorted(reader.unlisted.items())[0]
        raise CheckpointError(f"{os.path.join(reader.path, name)}: holds {key} ({len(reader.unlisted)} tensors in all "
                              f"in the shards) that {INDEX} does not place there; transformers loads them too, so "
                              f"the index does not describe the model: write it again from the shards")
    if cfg.tie_word_embeddings and "lm_head.weight" in reader.weight_map:
        head, embedding = reader.get("lm_head.weight"), reader.get(EMBED)
        if head.shape != embedding.shape or not torch.equal(head, embedding):
            raise CheckpointError(f"{reader.path}: {CONFIG} ties the embeddings (tie_word_embeddings true) but the "
                                  f"stored lm_head.weight differs from model.embed_tokens.weight; set "
                                  f"tie_word_embeddings to false to load them apart")
        del head, embedding
    for p, key, row, rows, scale in plan:
        t = reader.get(key, row)
        if scale is not None:
            t = dequantize_fp8(t, reader.get(scale), blocks)
        p.copy_(t if rows is None else t[rows])


def _fp8_scale(reader: CheckpointReader, key: str, row, shape: List[int], blocks) -> Optional[str]:
    """The key of key's scales where key is stored in FP8 (checked: config.json says so, the scales are
    there in the shape the blocks give), else None."""
    if reader.stored_dtype(key) != FP8:
        return None
    file = reader.file_of(key)
    if blocks is None:
        raise CheckpointError(f"{file}: {key} is stored in FP8 ({FP8}) but {CONFIG} has no quantization_config")
    if row is not None or len(shape) != 2:
        raise CheckpointError(f"{file}: {key} is an FP8 tensor of shape {shape}; only FP8 matrices stored one a "
                              f"tensor are read (experts per expert, not fused)")
    scale = key + SCALE
    if scale not in reader.weight_map:
        raise CheckpointError(f"{file}: {key} is stored in FP8 but its scales {scale} are missing")
    if reader.stored_dtype(scale) not in ("F32", "BF16", "F16"):  # E8M0 exponents (MXFP8) are another format
        raise CheckpointError(f"{reader.file_of(scale)}: {scale} is stored as {reader.stored_dtype(scale)}; FP8 "
                              f"scales are read as floating-point numbers (F32, BF16, F16) only")
    want = [-(-shape[0] // blocks[0]), -(-shape[1] // blocks[1])] if blocks else None
    got = reader.shape(scale)
    if (got != want) if blocks else (math.prod(got) != 1):
        raise CheckpointError(f"{reader.file_of(scale)}: {scale} has shape {got}; {CONFIG}'s weight_block_size "
                              f"{list(blocks) or None} implies {want or [1]} for {key} {shape}")
    return scale


# ---------------------------------------------------------------- writing a directory


def parse_size(size) -> int:
    """5GB, 500MB, 2GiB, 1000 (bytes) -> bytes; decimal units as transformers' max_shard_size."""
    m = None if isinstance(size, (int, bool)) else re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*",
                                                                   str(size), re.IGNORECASE)
    if m:
        unit = (m.group(2) or "B").upper()
        scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
        size = int(float(m.group(1)) * scale)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"max_shard_size {size!r}: expected a positive number of bytes or a size such as '5GB' "
                         f"or '500MiB'")
    return size


def hf_tensors(model: torch.nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """A whole (not expert-parallel) model's tensors under Hugging Face's per-expert keys, tied ones once."""
    if model.moe_args.ep_size != 1:
        raise ValueError(f"this model holds 1/{model.moe_args.ep_size} of the experts; save a consolidated model "
                         f"(python -m turbomoe.export consolidates a run's checkpoint)")
    params = dict(model.named_parameters())
    head = params.get("lm_head.weight")  # there when the tie was broken (load_state_dict(assign=True), say)
    if model.config.tie_word_embeddings and head is not None:
        if not torch.equal(head, params[EMBED]):
            raise ValueError("config ties the embeddings (tie_word_embeddings true) but lm_head.weight is another "
                             "tensor and differs from model.embed_tokens.weight; tie them again or build the model "
                             "with tie_word_embeddings false")
        del params["lm_head.weight"]
    for name, p in params.items():
        yield to_hf_name(name), p.detach()


def _remove_dead_writers(parent: str, stem: str):
    """Temporary directories of earlier writes to the same output, from this host, whose process is gone
    (killed mid-write: an exception removes its own): they would hold a shard or more each, forever."""
    for name in os.listdir(parent):
        pid = name[len(stem):]
        if not (name.startswith(stem) and pid.isdigit()) or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def check_force(force):
    """force replaces a directory: only a bool says so (the string "no" is truthy)."""
    if not isinstance(force, bool):
        raise TypeError(f"force must be a bool, got {type(force).__name__} {force!r}")


@contextlib.contextmanager
def atomic_dir(out_dir: str, force: bool):
    """Yields a temporary directory beside out_dir that becomes out_dir when the block succeeds."""
    out_dir = os.path.abspath(out_dir)
    check_force(force)
    if os.path.lexists(out_dir) and not force:  # a dangling link too
        raise FileExistsError(f"{out_dir} already exists; pass force=True (--force) to replace it")
    if os.path.isdir(out_dir) and not os.path.islink(out_dir):
        # a save writes files only: a folder there (a clone's .git, say) is someone's, and would go with the rest
        folders = sorted(e.name for e in os.scandir(out_dir) if e.is_dir(follow_symlinks=False))
        if folders:
            raise FileExistsError(f"{out_dir} holds folders {folders[:5]} that no save writes; replacing it would "
                                  f"delete them: remove them or choose another directory")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    stem = f".{os.path.basename(out_dir)}.tmp-{socket.gethostname()}-"
    _remove_dead_writers(parent, stem)
    tmp = os.path.join(parent, f"{stem}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    old = None
    try:
        yield tmp
        if os.path.lexists(out_dir):  # force: the old output steps aside until the new one is in place
            if not force:  # made by another writer while this one wrote: not ours to replace
                raise FileExistsError(f"{out_dir} appeared while it was being written; pass force=True (--force) "
                                      f"to replace it")
            old = os.path.join(parent, f".{os.path.basename(out_dir)}.old{os.getpid()}")
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not os.path.lexists(out_dir):
            os.replace(old, out_dir)  # the new output never arrived: put the old one back
        raise
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.remove(old)


def write_weights(out_dir: str, tensors: Iterable[Tuple[str, torch.Tensor]], dtype: torch.dtype,
                  max_shard_size="5GB", progress: Optional[Callable] = None):
    """Stream (key, tensor) pairs into safetensors shards of at most max_shard_size bytes (a tensor larger
    than that gets a shard of its own); only one shard is held in memory. One shard is model.safetensors,
    several are model-0000i-of-0000n.safetensors with model.safetensors.index.json, as transformers writes."""
    limit = parse_size(max_shard_size)
    shards, shard, shard_bytes, total = [], {}, 0, 0

    def flush():
        name = f"shard{len(shards)}.part"
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
        os.chmod(os.path.join(out_dir, name), 0o644)  # safetensors creates it private (0600), unlike the rest
        shards.append((name, list(shard)))

    for key, t in tensors:
        t = t.to("cpu", dtype).contiguous().clone()  # own storage: safetensors refuses shared tensors
        size = t.numel() * t.element_size()
        if shard and shard_bytes + size > limit:
            flush()
            shard, shard_bytes = {}, 0
        shard[key] = t
        shard_bytes += size
        total += size
        if progress is not None:
            progress(1)
    flush()
    if len(shards) == 1:
        os.replace(os.path.join(out_dir, shards[0][0]), os.path.join(out_dir, SINGLE))
        return
    weight_map = {}
    for i, (part, keys) in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(os.path.join(out_dir, part), os.path.join(out_dir, name))
        weight_map.update({k: name for k in keys})
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


def write_metadata(out_dir: str, cfg: ModelConfig, dtype: torch.dtype, tokenizer=None, source: Optional[str] = None):
    """config.json, generation_config.json and the tokenizer: None is the byte tokenizer when the
    vocabulary holds it, False none (a run on pre-tokenized data). source: the Hugging Face directory the
    model was read from; with tokenizer None its token ids, generation_config.json and tokenizer files
    come along instead (a vocabulary turbomoe did not make is not given the byte tokenizer)."""
    from ..data import ByteTokenizer
    # source's config.json (moved since: its ids are unknown)
    raw = read_config(source) if source is not None and os.path.isfile(os.path.join(source, CONFIG)) else {}
    if source is not None and tokenizer is None:
        with open(os.path.join(out_dir, CONFIG), "w") as f:
            json.dump(config_to_hf(cfg, dtype, raw), f, indent=2)
        for name in ("generation_config.json", *TOKENIZER_FILES):
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
        return
    if tokenizer is None and cfg.vocab_size >= ByteTokenizer.vocab_size:
        tokenizer = ByteTokenizer()
    eos = getattr(tokenizer, "eos_id", getattr(tokenizer, "eos_token_id", None))
    with open(os.path.join(out_dir, CONFIG), "w") as f:
        # the tokenizer's token ids; the source's router loss, which no tokenizer changes
        json.dump(config_to_hf(cfg, dtype, {**{k: raw[k] for k in ROUTER_LOSS if k in raw}, "eos_token_id": eos}), f,
                  indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": None, "eos_token_id": eos, "pad_token_id": eos, "do_sample": False}, f, indent=2)
    if tokenizer:
        tokenizer.save_pretrained(out_dir, model_max_length=cfg.max_position_embeddings)


def save_dir(out_dir: str, cfg: ModelConfig, tensors: Iterable[Tuple[str, torch.Tensor]], dtype: torch.dtype,
             max_shard_size="5GB", force: bool = False, tokenizer=None, progress: Optional[Callable] = None,
             source: Optional[str] = None):
    """A complete Hugging Face directory, written atomically (source: see write_metadata)."""
    if dtype not in _DTYPES.values():
        raise ValueError(f"dtype {dtype} cannot be saved; choose one of {list(_DTYPES.values())}")
    parse_size(max_shard_size)  # before the directory is made
    with atomic_dir(out_dir, force) as tmp:
        write_weights(tmp, tensors, dtype, max_shard_size, progress)
        write_metadata(tmp, cfg, dtype, tokenizer, source)


def default_ep_rank(ep_size: int) -> int:
    """This process's expert-parallel rank as the recipe places it (runs of ep_size consecutive ranks)."""
    if ep_size == 1:
        return 0
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError(f"ep_size {ep_size} > 1 needs an initialised process group (or pass ep_rank) to know "
                         f"which experts this rank reads")
    return torch.distributed.get_rank() % ep_size


def check_ep_rank(ep_rank, ep_size: int):
    """Another rank's experts, or an IndexError mid-load, unless 0 <= ep_rank < ep_size."""
    if not (isinstance(ep_rank, int) and not isinstance(ep_rank, bool) and 0 <= ep_rank < ep_size):
        raise ValueError(f"ep_rank {ep_rank!r}: expected an int in [0, {ep_size}) (ep_size {ep_size})")


__all__ = ["CheckpointError", "CheckpointReader", "config_from_hf", "config_to_hf", "config_dtype", "read_config",
           "check_config", "load_weights", "hf_tensors", "save_dir", "write_weights", "write_metadata", "atomic_dir",
           "parse_size", "default_ep_rank", "check_ep_rank"]
