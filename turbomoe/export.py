"""Export a recipe run's DeepSpeed checkpoint as a Hugging Face Qwen3-MoE directory, on the CPU.

    python -m turbomoe.export RUN OUT [--step N] [--dtype bf16|fp32] [--force] [--max-shard-size 5GB]

RUN is a recipe run directory (its log.dir, holding checkpoints/), a checkpoint directory (holding
`latest`) or one global_stepN directory. No launcher and no process group: the files every rank
wrote are read directly, memory-mapped, one tensor at a time:
  mp_rank_00_model_states.pt                 the non-expert parameters (in the training dtype)
  layer_L_expert_J_mp_rank_00_model_states.pt  expert J (global id) of the L-th MoE layer, written by
                                              the expert-parallel rank that held it
  *zero_pp_rank_R_mp_rank_00_optim_states.pt  ZeRO 1/2 partitions; with --dtype fp32 their fp32 master
                                              weights are used when present (a bf16 run's exact weights)
Both moe_impl turbomoe and deepspeed runs have these names. The tag's completion marker (written by
recipes/checkpointing.py) holds the run's config. OUT is written atomically (a temporary directory
renamed at the end); peak memory is about one shard plus the pages of the tensors being copied, and
with --dtype fp32 from ZeRO partitions also the reassembled fp32 model.
"""
import argparse
import json
import os
import re
import sys
import zipfile
from collections import defaultdict
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from .checkpoint_tags import COMPLETE, find_tag  # noqa: F401 (COMPLETE: the marker this module reads)
from .models import ModelConfig, MoEArgs, Qwen3MoeForCausalLM
from .models.hf_checkpoint import check_force, save_dir
from .models.hf_names import to_hf_name

MODEL_STATES = "mp_rank_00_model_states.pt"
OPTIM_STATES = "mp_rank_00_optim_states.pt"
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.deepspeed_moe\.experts\.deepspeed_experts)\.(\d+)\.")
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def global_expert_name(name: str, ep_rank: int, num_local: int) -> str:
    """A parameter name of expert-parallel rank ep_rank (its experts numbered from 0 locally) as a
    model holding every expert names it; other names unchanged."""
    return _EXPERT.sub(lambda m: f"{m.group(1)}.{ep_rank * num_local + int(m.group(2))}.", name)


class ExportError(ValueError):
    """A run or checkpoint directory that cannot be exported; the message names the file."""


def resolve_tag(run: str, step: Optional[int] = None) -> str:
    """The global_stepN directory to export from a run, checkpoint or tag directory."""
    try:
        return os.path.join(*find_tag(run, step))
    except FileNotFoundError as e:
        raise ExportError(str(e)) from e


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        raise ExportError(f"{path} is missing")
    try:
        # The run's own files; DeepSpeed pickles config objects beside the tensors, so not weights_only.
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as e:  # a truncated or foreign file: name it
        raise ExportError(f"{path}: cannot be read as a DeepSpeed checkpoint file ({e})") from e


def _check_complete(path: str):
    """ExportError naming path unless it ends as a torch.save file does (its zip directory)."""
    try:
        with zipfile.ZipFile(path):
            pass
    except (zipfile.BadZipFile, OSError) as e:
        raise ExportError(f"{path}: not a complete torch.save file ({e}); cut short or not a checkpoint file") from e


class RunCheckpoint:
    """One complete tag of a recipe run: its config and its tensors under the model's parameter names."""

    def __init__(self, tag_dir: str):
        self.tag_dir = tag_dir
        marker = os.path.join(tag_dir, COMPLETE)
        try:
            with open(marker) as f:
                meta = json.load(f)
            self.meta = meta
            self.step, self.world_size = meta["step"], meta["world_size"]
            self.recipe = meta["config"]
            self.config = ModelConfig.from_dict(self.recipe["model"])
            self.ep_size = self.recipe["moe"]["ep_size"]
        except (ValueError, KeyError, TypeError) as e:  # json's errors are ValueErrors
            raise ExportError(f"{marker}: not a complete checkpoint's marker ({type(e).__name__}: {e})") from e
        with torch.device("meta"):  # names and shapes only, no memory
            skeleton = Qwen3MoeForCausalLM(self.config)
        self.shapes = {k: tuple(v.shape) for k, v in skeleton.named_parameters()}  # tied weights once
        self.states = _load(os.path.join(tag_dir, MODEL_STATES))
        if "module" not in self.states:
            raise ExportError(f"{os.path.join(tag_dir, MODEL_STATES)}: no 'module' state dict in it")
        self.moe_layers = self.config.moe_layers()

    def check_files(self):
        """Raise ExportError naming the first file missing or cut short: every expert's of every MoE
        layer, and every rank's optimizer partition where the run kept them, or at ZeRO stage 0 each
        expert-parallel rank's optimizer state (the model states file was read already). Each file's
        zip directory is read, not its tensors: a copy cut short has lost the end where torch.save
        writes it."""
        for i in range(len(self.moe_layers)):
            for j in range(self.config.num_experts):
                _check_complete(self._existing_expert_file(i, j))
        for _, path in self._partition_files():
            _check_complete(path)
        if self.moe_layers and self.recipe.get("train", {}).get("zero_stage") == 0:  # DeepSpeed's load reads these
            for r in range(self.ep_size):
                path = os.path.join(self.tag_dir, f"expp_rank_{r}_{OPTIM_STATES}")
                if not os.path.isfile(path):
                    raise ExportError(f"{path} is missing: the optimizer state of expert-parallel rank {r} of "
                                      f"{self.ep_size}")
                _check_complete(path)

    def expert_file(self, moe_layer: int, expert: int) -> str:
        return os.path.join(self.tag_dir, f"layer_{moe_layer}_expert_{expert}_{MODEL_STATES}")

    def _existing_expert_file(self, moe_layer: int, expert: int) -> str:
        path = self.expert_file(moe_layer, expert)
        if not os.path.isfile(path):
            raise ExportError(f"{path} is missing: expert {expert} of MoE layer {moe_layer}, written by expert-parallel "
                              f"rank {expert // (self.config.num_experts // self.ep_size)} of {self.ep_size}")
        return path

    def _expert_tensors(self, moe_layer: int) -> Dict[str, torch.Tensor]:
        out = {}
        for j in range(self.config.num_experts):
            out.update(_load(self._existing_expert_file(moe_layer, j)))
        return out

    def _partition_files(self) -> List[Tuple[int, str]]:
        """[(rank, path)] of the ZeRO 1/2 optimizer partitions, one a rank, or [] where the run kept none."""
        files = sorted((int(m.group(1)), os.path.join(self.tag_dir, f)) for f in os.listdir(self.tag_dir)
                       if (m := _OPTIM.match(f)))
        if files and [r for r, _ in files] != list(range(self.world_size)):
            raise ExportError(f"{self.tag_dir}: optimizer partitions of ranks {[r for r, _ in files]}, expected one "
                              f"for each of the {self.world_size} ranks")
        return files

    def tensors(self, masters: Optional[Dict[str, torch.Tensor]] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        """(parameter name, tensor) in the model's order; masters (fp32) replace the module's copies."""
        module = self.states["module"]
        layer_of = {f"model.layers.{layer}.": i for i, layer in enumerate(self.moe_layers)}
        experts, experts_layer = {}, None
        for name, shape in self.shapes.items():
            m = _EXPERT.match(name)
            if m:
                prefix = name.split(".mlp.")[0] + "."
                if experts_layer != prefix:  # the next MoE layer: its E files, then free the previous
                    experts, experts_layer = self._expert_tensors(layer_of[prefix]), prefix
                source, where = experts, self.expert_file(layer_of[prefix], int(m.group(2)))
            else:
                source, where = module, os.path.join(self.tag_dir, MODEL_STATES)
            t = masters[name] if masters is not None and name in masters else source.get(name)
            if t is None:
                raise ExportError(f"{where}: tensor {name} is missing")
            if tuple(t.shape) != shape:
                raise ExportError(f"{where}: {name} has shape {tuple(t.shape)}, but the run's config implies {shape}")
            yield name, t

    def fp32_masters(self) -> Optional[Dict[str, torch.Tensor]]:
        """The ZeRO 1/2 fp32 master weights of every parameter, or None when the run kept none."""
        states = self.zero_states(("master",))
        return None if states is None else states["master"]

    def zero_states(self, keys=("master",), names=None) -> Optional[Dict[str, Dict[str, torch.Tensor]]]:
        """{key: {parameter name: full tensor}} reassembled from every rank's ZeRO 1/2 (or bf16
        optimizer) partition: key "master" the fp32 weights, any other key the optimizer state of that
        name (Adam's "exp_avg", "exp_avg_sq"); names (default all) limits which parameters are made.
        None when the run kept no such partitions (ZeRO stage 0). A rank's fragments name its experts
        by local id; experts are partitioned over the ranks holding the same experts, the rest over
        all ranks, in rank order."""
        files = self._partition_files()
        if not files:
            return None
        wanted = set(self.shapes) if names is None else set(names)
        if wanted - set(self.shapes):
            raise ExportError(f"{self.tag_dir}: the run's model has no parameters {sorted(wanted - set(self.shapes))}")
        num_local = self.config.num_experts // self.ep_size
        pieces: Dict[str, Dict[str, List[torch.Tensor]]] = {key: defaultdict(list) for key in keys}
        for rank, path in files:
            state = _load(path).get("optimizer_state_dict", {})
            if "single_partition_of_fp32_groups" not in state or "param_slice_mappings" not in state:
                return None  # not a ZeRO 1/2 optimizer (no masters kept apart from the module)
            for i, (master, mapping) in enumerate(zip(state["single_partition_of_fp32_groups"],
                                                      state["param_slice_mappings"])):
                flats = {key: master if key == "master" else _group_state(state, i, path).get(key) for key in keys}
                for key, flat in flats.items():
                    if flat is None:
                        raise ExportError(f"{path}: parameter group {i} has no optimizer state {key!r}")
                for local_name, frag in mapping.items():
                    name = global_expert_name(local_name, rank % self.ep_size, num_local)
                    if name in wanted:
                        for key, flat in flats.items():
                            pieces[key][name].append(flat.narrow(0, frag.start, frag.numel))
        out = {key: {} for key in keys}
        for name, shape in self.shapes.items():
            if name not in wanted:
                continue
            for key in keys:
                parts = pieces[key].get(name)
                numel = sum(p.numel() for p in parts) if parts else 0
                if numel != torch.Size(shape).numel():
                    raise ExportError(f"{self.tag_dir}: the optimizer partitions hold {numel} elements of {name}'s "
                                      f"{key}, expected {torch.Size(shape).numel()}")
                out[key][name] = torch.cat(parts).view(shape)
        return out

    def optimizer_step(self) -> Optional[torch.Tensor]:
        """The optimizer's step count (Adam's bias correction) as rank 0's first group saved it."""
        files = self._partition_files()
        if not files:
            return None
        path = files[0][1]
        state = _load(path).get("optimizer_state_dict", {})
        if "base_optimizer_state_step" in state:  # ZeRO's elastic format keeps it apart
            return torch.tensor(float(state["base_optimizer_state_step"]))
        return _group_state(state, 0, path).get("step")


def _group_state(state: dict, i: int, path: str) -> dict:
    """The base optimizer's state of flat group i: a torch state dict (bf16 optimizer, ZeRO's default)
    or ZeRO's elastic list of per-group states."""
    base = state.get("base_optimizer_state")
    if isinstance(base, dict) and "state" in base:
        return base["state"].get(i, {})
    if isinstance(base, (list, tuple)) and i < len(base):
        return base[i]
    raise ExportError(f"{path}: no base optimizer state for parameter group {i}")


def export(run: str, out: str, step: Optional[int] = None, dtype: str = "bf16", force: bool = False,
           max_shard_size="5GB", progress: bool = True) -> str:
    """Consolidate RUN's checkpoint into the Hugging Face directory OUT; returns the tag exported."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_force(force)
    tag_dir = resolve_tag(run, step)
    if _within(tag_dir, out):
        raise ExportError(f"OUT {out} holds the checkpoint {tag_dir}: writing there would replace it; "
                          "choose another OUT")
    if _within(out, os.path.dirname(tag_dir)):  # another tag of the run (its `latest`, say) could be replaced
        raise ExportError(f"OUT {out} lies in the run's checkpoint directory {os.path.dirname(tag_dir)}; "
                          "choose another OUT")
    if os.path.lexists(out) and not force:  # a dangling link too
        raise FileExistsError(f"{out} already exists; pass --force to replace it")
    ckpt = RunCheckpoint(tag_dir)
    masters = ckpt.fp32_masters() if dtype == "fp32" else None
    tokenizer = run_tokenizer(ckpt.recipe["data"])
    if tokenizer and tokenizer.vocab_size > ckpt.config.vocab_size:  # that directory now holds another tokenizer
        raise ExportError(f"the run read its corpus with the tokenizer in {tokenizer.path}, which now has "
                          f"{tokenizer.vocab_size} tokens, more than the model's {ckpt.config.vocab_size}: not "
                          f"that tokenizer any more; put the run's back there to export")
    from .data.tokenizer import tokenizer_digest
    saved = ckpt.meta.get("tokenizer_sha256")  # None: bytes, or a run from before it was recorded
    if tokenizer and saved is not None and tokenizer_digest(tokenizer.path) != saved:
        raise ExportError(f"the tokenizer files in {tokenizer.path} changed since the run read its corpus with "
                          f"them; put the run's back there to export")
    # The tokenizer of a model's directory (model.init_from's, say): its token ids and generation_config.json
    # (a chat model's EOS ids, sampling defaults) come along, as for a model read from there.
    source = tokenizer.path if tokenizer and os.path.isfile(os.path.join(tokenizer.path, "config.json")) else None
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(ckpt.shapes), desc=f"export {os.path.basename(ckpt.tag_dir)}", unit="tensor")
    try:
        tensors = ((to_hf_name(name), t) for name, t in ckpt.tensors(masters))
        save_dir(out, ckpt.config, tensors, DTYPES[dtype], max_shard_size, force, None if source else tokenizer,
                 bar.update if bar is not None else None, source)
    finally:
        if bar is not None:
            bar.close()
    return ckpt.tag_dir


def run_tokenizer(data: dict):
    """The tokenizer export writes for a run's data section: False for pre-tokenized (megatron) data,
    not ours to write; the Hugging Face tokenizer its corpus was read with (data.tokenizer, a directory);
    else None, the byte tokenizer."""
    if data["source"] == "megatron":
        return False
    path = data.get("tokenizer")  # absent from runs before data.tokenizer: the byte tokenizer
    if path in (None, "bytes"):
        return None
    from .data import HFTokenizer
    what = f"the run read its corpus with the tokenizer in {path}, which export writes beside the model"
    try:
        return HFTokenizer(path)
    except ImportError as e:
        raise ExportError(f"{what}: {e}") from e
    except (OSError, ValueError) as e:
        raise ExportError(f"{what}: {e}; put that tokenizer back there to export") from e


def _within(path: str, directory: str) -> bool:
    """path is directory or lies below it (links resolved)."""
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


def load_run_model(run: str, step: Optional[int] = None) -> Qwen3MoeForCausalLM:
    """The run's model (all experts, ep_size 1) straight from its DeepSpeed files, in the training dtype."""
    ckpt = RunCheckpoint(resolve_tag(run, step))
    model = Qwen3MoeForCausalLM(ckpt.config, MoEArgs())
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in ckpt.tensors():
            params[name].copy_(t)
    return model.eval()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m turbomoe.export", description=__doc__.split("\n")[0])
    p.add_argument("run", help="recipe run directory, checkpoint directory or global_stepN directory")
    p.add_argument("out", help="output Hugging Face model directory")
    p.add_argument("--step", type=int, default=None, help="export global_stepN instead of the latest checkpoint")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="output dtype (fp32 uses ZeRO's fp32 "
                   "master weights when the run kept them)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB or 500MB")
    args = p.parse_args(argv)
    try:
        tag = export(args.run, args.out, args.step, args.dtype, args.force, args.max_shard_size)
    except (ExportError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"turbomoe.export: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"exported {tag} -> {os.path.abspath(args.out)} ({args.dtype})")


if __name__ == "__main__":
    main()
