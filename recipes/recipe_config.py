"""The pretraining recipe's YAML config: its sections, their checks, and the DeepSpeed JSON made from it.

A config file has the sections model (turbomoe.models.ModelConfig, Hugging Face Qwen3MoeConfig
names), moe, data, train, eval, checkpoint, log, and an optional deepspeed section merged over
the generated DeepSpeed config (without changing the keys the recipe sets: RECIPE_SETS). Unknown
sections or keys are errors. `--set section.key=value` on the command line overrides any key (the
value is parsed as YAML); ~ in a path is the home directory.
"""
import copy
import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional

import yaml

from turbomoe.data import SOURCES
from turbomoe.models import ModelConfig, moe_class
from turbomoe.models.qwen3_moe import renormalizes_topk


class ConfigError(ValueError):
    """A bad config, command line or input path, found before any work starts. Every rank finds the
    same ones and rank 0 prints them (the others wait for it to, then print too if still running), except
    an error of some ranks only (every_rank: each prints it at once)."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


@dataclass
class MoESection:
    ep_size: int = 1  # expert-parallel ranks; must divide num_experts and the world size
    capacity_factor: Optional[float] = None  # None (null): dropless
    eval_capacity_factor: Optional[float] = None  # None: same as capacity_factor (dropless evaluates dropless)
    min_capacity: int = 4
    aux_loss_coef: float = 0.001  # weight of DeepSpeed's l_aux (mean over MoE layers), not Qwen3-MoE's aux loss
    recompute: bool = False  # remake the expert rows and activation in backward (model.moe_impl turbomoe)


@dataclass
class DataSection:
    source: str = "stdlib"  # stdlib | text | jsonl | parquet | megatron
    paths: List[str] = field(default_factory=list)
    text_key: str = "text"  # jsonl field or Parquet column holding the document
    seq_len: int = 256
    valid_fraction: float = 0.01
    max_tokens: int = 0  # > 0: use only the first max_tokens of the corpus
    # text sources: "bytes", a Hugging Face tokenizer directory, or null: model.init_from's tokenizer where
    # that directory has one (a published model fine-tuned in its own vocabulary), else bytes
    tokenizer: Optional[str] = None
    # text sources: tokenized once into cache_dir (null: $TURBOMOE_CACHE/corpora, else
    # ~/.cache/turbomoe/corpora), then mapped by every rank and later start; false: every rank tokenizes
    # into memory
    cache: bool = True
    cache_dir: Optional[str] = None


@dataclass
class TrainSection:
    seed: int = 1234
    steps: int = 1000  # optimizer steps; the cosine schedule ends here
    micro_batch_size: int = 8  # sequences per rank per micro-step
    grad_accum: int = 1
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100  # linear warmup: step i (from 0) uses lr * (i + 1) / warmup_steps
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0
    zero_stage: int = 1  # 0, 1 or 2
    precision: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    peak_tflops: Optional[float] = None  # per-GPU dense bf16 peak for MFU; None: known from the GPU's name
    fused_adamw: bool = True  # torch's single-kernel AdamW (fused=True) over DeepSpeed's flat groups
    compile: bool = False  # torch.compile the model's dense blocks (attention, norms, dense MLPs)
    compile_moe: bool = False  # torch.compile the MoE layers too (moe_impl turbomoe, ep_size 1, no recompute)
    cuda_graph: bool = False  # replay the model's forward and backward from CUDA graphs (GPU, bf16, ZeRO 1, moe_impl turbomoe, ep_size 1 or a capacity)
    deterministic: bool = False  # the same bits run to run on a GPU too (deterministic attention backward, cuBLAS workspace): slower


@dataclass
class EvalSection:
    every: int = 100  # steps between validation runs (also at the start and the end)
    batches: int = 8  # micro-batches per rank per validation run


@dataclass
class CheckpointSection:
    dir: Optional[str] = None  # None: <log.dir>/checkpoints
    every: int = 0  # steps between checkpoints; 0: only at the end
    keep: int = 2  # complete checkpoints kept; older ones are deleted


@dataclass
class LogSection:
    dir: Optional[str] = None  # None: runs/<config name>
    wandb: bool = True
    wandb_project: str = "turbomoe"
    wandb_mode: Optional[str] = None  # None: online when WANDB_API_KEY is set, else offline
    every: int = 10  # steps between reads of the step statistics from the device (one host sync each)


@dataclass
class RecipeConfig:
    name: str
    model: ModelConfig
    moe: MoESection
    data: DataSection
    train: TrainSection
    eval: EvalSection
    checkpoint: CheckpointSection
    log: LogSection
    deepspeed: dict
    init_from: Optional[str] = None  # model.init_from: a Hugging Face directory the weights start from

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {"moe": MoESection, "data": DataSection, "train": TrainSection, "eval": EvalSection,
            "checkpoint": CheckpointSection, "log": LogSection}


# Step s of a run seeds its random draws with train.seed * STEP_SEED_STRIDE + s (pretrain.train), an int64.
STEP_SEED_STRIDE = 1_000_003
INT64_MAX = 2**63 - 1

# The DeepSpeed keys the recipe sets from its own keys (the ones to set instead), which its batches, clipping,
# optimizer files and dtypes rely on: the deepspeed section may repeat them, not change them.
RECIPE_SETS = {"train_micro_batch_size_per_gpu": "train.micro_batch_size",
               "gradient_accumulation_steps": "train.grad_accum",
               "train_batch_size": "train.micro_batch_size and train.grad_accum",  # times the ranks
               "gradient_clipping": "train.grad_clip", "zero_optimization.stage": "train.zero_stage",
               "bf16.enabled": "train.precision", "fp16.enabled": "train.precision",
               # The recipe hands DeepSpeed its own optimizer and schedule, which win over these silently.
               "optimizer": "train.lr, train.betas, train.eps, train.weight_decay and train.fused_adamw",
               "scheduler": "train.lr, train.warmup_steps and train.min_lr_ratio"}


class Rule(NamedTuple):
    """The values a key may take beyond its type: low <= v <= high, or low < v / v < high where
    open; or one of choices."""
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple = ()


# Every key's type comes from its dataclass annotation; its range or choices from here.
POSITIVE, NON_NEGATIVE, FRACTION = Rule(1), Rule(0), Rule(0, 1)
RULES = {
    "model": {name: POSITIVE for name in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "decoder_sparse_step",
        "max_position_embeddings")} | {
        # turbomoe's routing serves k <= 8 (ops.MAX_K)
        "num_experts_per_tok": Rule(1, 8),
        "rope_theta": Rule(0, low_open=True), "rms_norm_eps": Rule(0, low_open=True),
        "initializer_range": Rule(0, low_open=True)},
    "moe": {"ep_size": POSITIVE, "capacity_factor": Rule(0, low_open=True),
            "eval_capacity_factor": Rule(0, low_open=True), "min_capacity": NON_NEGATIVE,
            "aux_loss_coef": NON_NEGATIVE},
    "data": {"source": Rule(choices=SOURCES), "seq_len": POSITIVE, "valid_fraction": Rule(0, 1, True, True),
             "max_tokens": NON_NEGATIVE},
    "train": {"seed": Rule(0, INT64_MAX), "steps": POSITIVE, "micro_batch_size": POSITIVE, "grad_accum": POSITIVE,
              "lr": Rule(0, low_open=True), "min_lr_ratio": FRACTION, "warmup_steps": NON_NEGATIVE,
              "weight_decay": NON_NEGATIVE, "betas": Rule(0, 1, high_open=True), "eps": Rule(0, low_open=True),
              "grad_clip": NON_NEGATIVE, "zero_stage": Rule(choices=(0, 1, 2)),
              "precision": Rule(choices=("auto", "bf16", "fp32")), "peak_tflops": Rule(0, low_open=True)},
    "eval": {"every": POSITIVE, "batches": POSITIVE},
    "checkpoint": {"every": NON_NEGATIVE, "keep": POSITIVE},
    "log": {"wandb_mode": Rule(choices=("online", "offline", "disabled")), "every": POSITIVE},
}


def _type_name(tp) -> str:
    return {int: "an int", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _typed(key: str, value, tp):
    """value checked against the annotation tp (int, float, bool, str, Optional[...], List[...]);
    returns it, an int widened to float where a float is due. Raises ConfigError naming the key."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union and type(None) in args:  # Optional[X]: null allowed
        return None if value is None else _typed(key, value, next(a for a in args if a is not type(None)))
    if origin in (list, List):
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {type(value).__name__} {value!r}")
        return [_typed(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)] if args else value
    ok = {int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          bool: isinstance(value, bool), str: isinstance(value, str)}.get(tp, True)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
        try:
            value, ok = float(value), True
        except ValueError:
            pass
    if not ok:
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if tp is float and not math.isfinite(value):
        raise ConfigError(f"{key} must be finite, got {value!r}")
    return float(value) if tp is float else value


def _in_rule(key: str, value, rule: Rule):
    for v in (value if isinstance(value, list) else [value]):
        if v is None:
            continue
        if rule.choices and v not in rule.choices:
            raise ConfigError(f"{key} must be one of {list(rule.choices)}, got {v!r}")
        low_bad = rule.low is not None and (v <= rule.low if rule.low_open else v < rule.low)
        high_bad = rule.high is not None and (v >= rule.high if rule.high_open else v > rule.high)
        if low_bad or high_bad:
            lo = "-inf" if rule.low is None else rule.low
            hi = "inf" if rule.high is None else rule.high
            bounds = f"{'(' if rule.low_open else '['}{lo}, {hi}{')' if rule.high_open else ']'}"
            raise ConfigError(f"{key} must be in {bounds}, got {v!r}")


def check_values(cls, name: str, values: dict) -> dict:
    """Every key of a section: known, of its annotated type, in its RULES range; before any work."""
    if not isinstance(values, dict):
        raise ConfigError(f"config section {name!r} must be a mapping, got {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in config section {name!r}; known keys: {sorted(known)}")
    hints = typing.get_type_hints(cls)
    rules = RULES.get(name, {})
    out = {}
    for key, value in values.items():
        out[key] = _typed(f"{name}.{key}", value, hints[key])
        if key in rules:
            _in_rule(f"{name}.{key}", out[key], rules[key])
    return out


def _section(cls, name: str, values: dict):
    return cls(**check_values(cls, name, values))


def apply_overrides(raw: dict, overrides: List[str]) -> dict:
    """section.key=value pairs over the raw YAML mapping; values are parsed as YAML."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        key, sep, value = item.partition("=")
        parts = key.split(".")
        if not sep or len(parts) < 2 or not all(parts):
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        node = raw
        for part in parts[:-1]:
            if node.get(part) is None:  # absent, or a section whose keys are all commented out (YAML null)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
        node[parts[-1]] = yaml.safe_load(value)
    return raw


def resolve_init_from(raw: dict, path: str):
    """(raw, init_from): with model.init_from: HF_DIR, the model section becomes that checkpoint's
    config.json (as ModelConfig keys); any other model key given must agree with it, except moe_impl,
    which stays the recipe's choice."""
    values = raw.get("model")
    if not isinstance(values, dict) or "init_from" not in values:
        return raw, None
    values = dict(values)
    init_from = values.pop("init_from")
    try:
        from turbomoe.models import hf_checkpoint as hf
        init_from = os.path.expanduser(init_from)
        model = hf.config_from_hf(hf.read_config(init_from), os.path.join(init_from, hf.CONFIG),
                                  values.pop("moe_impl", "turbomoe"))
    except (TypeError, ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{path}: model.init_from: {e}") from e
    unknown = sorted(set(values) - set(model.to_dict()))
    if unknown:
        raise ConfigError(f"{path}: unknown model config keys {unknown}")
    diff = {k: (v, getattr(model, k)) for k, v in values.items() if getattr(model, k) != v}
    if diff:
        raise ConfigError(f"{path}: model keys differ from model.init_from {init_from}'s config.json "
                          f"(key: (config, checkpoint)): {diff}; drop them or make them agree")
    return {**raw, "model": model.to_dict()}, init_from


def load_config(path: str, overrides: List[str] = ()) -> RecipeConfig:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a mapping of sections")
    raw = apply_overrides(raw, list(overrides))
    raw, init_from = resolve_init_from(raw, path)
    unknown = sorted(set(raw) - set(SECTIONS) - {"model", "deepspeed"})
    if unknown:
        raise ConfigError(f"{path}: unknown config section(s) {unknown}; known: "
                          f"{sorted(list(SECTIONS) + ['model', 'deepspeed'])}")
    try:
        model = ModelConfig.from_dict(check_values(ModelConfig, "model", raw.get("model") or {}))
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from e
    name = os.path.splitext(os.path.basename(path))[0]
    sections = {k: _section(cls, k, raw.get(k) or {}) for k, cls in SECTIONS.items()}
    ds = raw.get("deepspeed") or {}
    if not isinstance(ds, dict):
        raise ConfigError(f"config section 'deepspeed' must be a mapping, got {type(ds).__name__}")
    cfg = RecipeConfig(name=name, model=model, deepspeed=ds, **sections)
    # No shell expands ~ in YAML or after `--set key=`.
    cfg.data.paths = [os.path.expanduser(p) for p in cfg.data.paths]
    for key in ("tokenizer", "cache_dir"):
        if getattr(cfg.data, key) is not None:
            setattr(cfg.data, key, os.path.expanduser(getattr(cfg.data, key)))
    for section in (cfg.log, cfg.checkpoint):
        if section.dir is not None:
            section.dir = os.path.expanduser(section.dir)
    if cfg.log.dir is None:
        cfg.log.dir = os.path.join("runs", name)
    if cfg.checkpoint.dir is None:
        cfg.checkpoint.dir = os.path.join(cfg.log.dir, "checkpoints")
    cfg.init_from = init_from
    validate(cfg)
    return cfg


def _require(ok: bool, message: str):
    if not ok:
        raise ConfigError(message)


def validate(cfg: RecipeConfig, world_size: Optional[int] = None):
    """Checks that need no data and no process group: every key's type and range (check_values,
    again here for configs built in code), then the rules between keys; world_size adds the
    parallel layout's checks."""
    for name, cls in dict(SECTIONS, model=ModelConfig).items():
        section = getattr(cfg, name)
        check_values(cls, name, {f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})
    m, moe, d, t = cfg.model, cfg.moe, cfg.data, cfg.train
    _require(m.num_experts % moe.ep_size == 0,
             f"moe.ep_size {moe.ep_size} does not divide model.num_experts {m.num_experts}")
    _require(not moe.recompute or m.moe_impl == "turbomoe",
             f"moe.recompute needs model.moe_impl: turbomoe, got {m.moe_impl!r}")
    k = m.num_experts_per_tok
    try:
        layer = moe_class(m.moe_impl)[0]
    except ImportError as e:  # a config error to the user: the message names the setting to change
        raise ConfigError(str(e)) from e
    fixed = renormalizes_topk(layer, k)  # DeepSpeed's own gates have no switch for it
    _require(fixed is None or fixed == m.norm_topk_prob,
             f"model.moe_impl {m.moe_impl!r} with num_experts_per_tok {k} always uses norm_topk_prob "
             f"{str(fixed).lower()}; set model.norm_topk_prob: {str(fixed).lower()} or model.moe_impl: turbomoe")
    tokens = t.micro_batch_size * d.seq_len
    _require(k > 1 or moe.min_capacity <= tokens,  # top-1 gating (stock's and the drop-in's) asserts it per forward
             f"moe.min_capacity {moe.min_capacity} exceeds the {tokens} tokens of a micro-batch "
             f"(train.micro_batch_size x data.seq_len), which top-1 gating requires")
    # The drop-in traces in one graph at ep_size 1 (notes/compile.md); its all-to-all and a compiled
    # layer's recompute are not verified, stock DeepSpeed's MoE breaks graphs on host syncs.
    _require(not t.compile_moe or (m.moe_impl == "turbomoe" and moe.ep_size == 1 and not moe.recompute),
             f"train.compile_moe needs model.moe_impl: turbomoe, moe.ep_size: 1 and moe.recompute: false, got "
             f"{m.moe_impl!r}, {moe.ep_size}, {moe.recompute}")
    # Capture forbids host syncs (stock DeepSpeed's MoE, the dropless all-to-all's buffer size); recompute's
    # hooks, compiled MoE layers and optimizers other than BF16_Optimizer (bf16, ZeRO 1) under capture are
    # not verified.
    _require(not t.cuda_graph or (m.moe_impl == "turbomoe" and (moe.ep_size == 1 or moe.capacity_factor is not None)
                                  and not moe.recompute and not t.compile_moe and t.zero_stage == 1
                                  and t.precision != "fp32"),
             f"train.cuda_graph needs model.moe_impl: turbomoe, moe.ep_size: 1 or a moe.capacity_factor, "
             f"moe.recompute: false, train.compile_moe: false, train.zero_stage: 1 and bf16, got {m.moe_impl!r}, "
             f"{moe.ep_size}, {moe.capacity_factor}, {moe.recompute}, {t.compile_moe}, {t.zero_stage}, {t.precision}")
    # Dropless layers (drop_tokens off) drop nothing in evaluation either.
    _require(moe.eval_capacity_factor is None or moe.capacity_factor is not None,
             f"moe.eval_capacity_factor {moe.eval_capacity_factor} needs a moe.capacity_factor, got null (dropless, "
             f"which evaluates dropless too); set moe.capacity_factor or drop moe.eval_capacity_factor")
    _require(d.source == "stdlib" or d.paths, f"data.source {d.source!r} needs data.paths")
    _require(d.source != "megatron" or d.tokenizer is None,
             f"data.tokenizer {d.tokenizer!r}: megatron data is already tokenized (leave data.tokenizer unset)")
    _require(d.seq_len <= m.max_position_embeddings,
             f"data.seq_len {d.seq_len} must be in [1, model.max_position_embeddings = {m.max_position_embeddings}]")
    _require(t.warmup_steps < t.steps, f"train.warmup_steps {t.warmup_steps} must be in [0, train.steps)")
    _require(len(t.betas) == 2, f"train.betas must be two numbers, got {t.betas!r}")
    seed_max = (INT64_MAX - t.steps) // STEP_SEED_STRIDE
    _require(t.seed <= seed_max, f"train.seed must be in [0, {seed_max}] so that a step's seed (train.seed x "
                                 f"{STEP_SEED_STRIDE} + step, up to train.steps {t.steps}) fits in int64, got {t.seed}")
    check_deepspeed_section(cfg, world_size)
    if world_size is not None:
        _require(world_size % moe.ep_size == 0,
                 f"moe.ep_size {moe.ep_size} does not divide the world size {world_size} (ranks started by the launcher)")


def check_deepspeed_section(cfg: RecipeConfig, world_size: Optional[int] = None):
    """The deepspeed section may not change a key in RECIPE_SETS. train_batch_size is checked once the
    world size is known; under train.precision auto (bf16 on a GPU, fp32 on the CPU) both dtypes must agree."""
    t = cfg.train
    for bf16 in ((True, False) if t.precision == "auto" else (t.precision == "bf16",)):
        generated = _generated(cfg, world_size or 1, bf16)
        merged = _merge(generated, cfg.deepspeed)
        for key, source in RECIPE_SETS.items():
            want, have = _lookup(generated, key), _lookup(merged, key)
            _require(have == want or (key == "train_batch_size" and world_size is None),
                     f"deepspeed.{key} {have!r} differs from {want!r}, which the recipe sets from {source}; "
                     f"set {source} instead")


def _lookup(d, dotted: str):
    """A dotted key's value in nested dicts; None where it is missing."""
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def deepspeed_config(cfg: RecipeConfig, world_size: int, bf16: bool) -> dict:
    """The DeepSpeed JSON config of a recipe; the recipe's deepspeed section is merged over it."""
    return _merge(_generated(cfg, world_size, bf16), cfg.deepspeed)


def _generated(cfg: RecipeConfig, world_size: int, bf16: bool) -> dict:
    t = cfg.train
    ds = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},  # train.precision is bf16 or fp32
        # The optimizer is torch's AdamW over DeepSpeed's MoE parameter groups (no op to compile).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,  # the recipe logs; DeepSpeed's own step prints stay off
        # The recipe times its own steps. DeepSpeed's throughput timer synchronizes the device at
        # every forward and step, which keeps the host from queueing the next step.
        "timers": {"throughput": {"enabled": False}},
    }
    if bf16 and t.zero_stage == 1:
        # bf16 weights with fp32 gradient accumulation select DeepSpeed's BF16_Optimizer, whose step
        # is 3x cheaper than the ZeRO optimizer's (notes/recipe_profile.md: 37 vs 118 ms on small-1gpu)
        # and whose gradients sum in fp32 (the ZeRO optimizer sums them in bf16).
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
        # And reduced over data-parallel ranks in fp32: DeepSpeed's default for bf16 rounds the fp32 sums
        # to bf16 for the all-reduce, on one rank too (where the recipe then skips it: pretrain.reduce_flat_gradients).
        ds["communication_data_type"] = "fp32"
    return ds


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
