"""The pretraining recipe's YAML config: its sections, their checks, and the DeepSpeed JSON made from it.

A config file has the sections model (turbomoe.models.ModelConfig, Hugging Face Qwen3MoeConfig
names), moe, data, train, eval, checkpoint, log, and an optional deepspeed section merged over
the generated DeepSpeed config. Unknown sections or keys are errors. `--set section.key=value`
on the command line overrides any key (the value is parsed as YAML).
"""
import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import List, Optional

import yaml

from turbomoe.data import SOURCES
from turbomoe.models import ModelConfig


class ConfigError(ValueError):
    """A bad config, command line or input path, found before any work starts."""


@dataclass
class MoESection:
    ep_size: int = 1  # expert-parallel ranks; must divide num_experts and the world size
    capacity_factor: Optional[float] = None  # None (null): dropless
    eval_capacity_factor: Optional[float] = None  # None: same as capacity_factor
    min_capacity: int = 4
    aux_loss_coef: float = 0.001  # Qwen3-MoE's router_aux_loss_coef


@dataclass
class DataSection:
    source: str = "stdlib"  # stdlib | text | jsonl | megatron
    paths: List[str] = field(default_factory=list)
    text_key: str = "text"  # jsonl field holding the document
    seq_len: int = 256
    valid_fraction: float = 0.01
    max_tokens: int = 0  # > 0: use only the first max_tokens of a text corpus


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


def _section(cls, name: str, values: dict):
    if not isinstance(values, dict):
        raise ConfigError(f"config section {name!r} must be a mapping, got {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in config section {name!r}; known keys: {sorted(known)}")
    return cls(**values)


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
            node = node.setdefault(part, {})
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
        model = ModelConfig.from_dict(raw.get("model") or {})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from e
    name = os.path.splitext(os.path.basename(path))[0]
    sections = {k: _section(cls, k, raw.get(k) or {}) for k, cls in SECTIONS.items()}
    cfg = RecipeConfig(name=name, model=model, deepspeed=raw.get("deepspeed") or {}, **sections)
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
    """Checks that need no data and no process group; world_size adds the parallel layout's checks."""
    m, moe, d, t = cfg.model, cfg.moe, cfg.data, cfg.train
    _require(isinstance(moe.ep_size, int) and moe.ep_size >= 1, f"moe.ep_size must be an int >= 1, got {moe.ep_size!r}")
    _require(m.num_experts % moe.ep_size == 0,
             f"moe.ep_size {moe.ep_size} does not divide model.num_experts {m.num_experts}")
    for name in ("capacity_factor", "eval_capacity_factor"):
        value = getattr(moe, name)
        _require(value is None or value > 0, f"moe.{name} must be > 0 or null (dropless), got {value!r}")
    _require(moe.aux_loss_coef >= 0, f"moe.aux_loss_coef must be >= 0, got {moe.aux_loss_coef}")
    _require(d.source in SOURCES, f"data.source must be one of {SOURCES}, got {d.source!r}")
    _require(isinstance(d.paths, list), f"data.paths must be a list, got {d.paths!r}")
    _require(d.source == "stdlib" or d.paths, f"data.source {d.source!r} needs data.paths")
    _require(1 <= d.seq_len <= m.max_position_embeddings,
             f"data.seq_len {d.seq_len} must be in [1, model.max_position_embeddings = {m.max_position_embeddings}]")
    _require(0 < d.valid_fraction < 1, f"data.valid_fraction must be in (0, 1), got {d.valid_fraction}")
    for name in ("steps", "micro_batch_size", "grad_accum"):
        _require(isinstance(getattr(t, name), int) and getattr(t, name) >= 1, f"train.{name} must be an int >= 1")
    _require(0 <= t.warmup_steps < t.steps, f"train.warmup_steps {t.warmup_steps} must be in [0, train.steps)")
    _require(t.lr > 0 and 0 <= t.min_lr_ratio <= 1, "train.lr must be > 0 and train.min_lr_ratio in [0, 1]")
    _require(len(t.betas) == 2, f"train.betas must be two numbers, got {t.betas!r}")
    _require(t.zero_stage in (0, 1, 2), f"train.zero_stage must be 0, 1 or 2, got {t.zero_stage!r}")
    _require(t.precision in ("auto", "bf16", "fp32"), f"train.precision must be auto, bf16 or fp32, got {t.precision!r}")
    _require(cfg.eval.every >= 1 and cfg.eval.batches >= 1, "eval.every and eval.batches must be >= 1")
    _require(cfg.checkpoint.every >= 0 and cfg.checkpoint.keep >= 1, "checkpoint.every must be >= 0, checkpoint.keep >= 1")
    _require(cfg.log.wandb_mode in (None, "online", "offline", "disabled"),
             f"log.wandb_mode must be online, offline, disabled or null, got {cfg.log.wandb_mode!r}")
    if world_size is not None:
        _require(world_size % moe.ep_size == 0,
                 f"moe.ep_size {moe.ep_size} does not divide the world size {world_size} (ranks started by the launcher)")


def deepspeed_config(cfg: RecipeConfig, world_size: int, bf16: bool) -> dict:
    """The DeepSpeed JSON config of a recipe; the recipe's deepspeed section is merged over it."""
    t = cfg.train
    ds = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": bf16},
        # The optimizer is torch's AdamW over DeepSpeed's MoE parameter groups (no op to compile).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,  # the recipe logs; DeepSpeed's own step prints stay off
    }
    return _merge(ds, cfg.deepspeed)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
