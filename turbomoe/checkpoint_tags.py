"""The layout of a recipe run's checkpoints: recipes/checkpointing.py writes it, `--resume` and
`python -m turbomoe.export` read it. <dir>/global_stepN holds one step's files from every rank; the
COMPLETE marker in it (JSON: step, world size, the run's config) says every rank finished; <dir>/latest
names the newest complete tag. Standard library only, so the recipe needs no export extra for it.
"""
import os
import re
from typing import List, Optional, Tuple

COMPLETE = "turbomoe_complete"
TAG = re.compile(r"^global_step(\d+)$")


def tag_of(step: int) -> str:
    return f"global_step{step}"


def find_tag(path: str, step: Optional[int] = None) -> Tuple[str, str]:
    """(checkpoint dir, tag) of a complete checkpoint. path: a global_stepN directory, a checkpoint
    directory (its `latest`, or global_step<step>; without `latest`, which a first save stopped between
    its marker and `latest` leaves, its newest complete tag) or a run directory holding checkpoints/.
    Raises FileNotFoundError saying what is missing."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such directory")
    name = os.path.basename(path)
    if TAG.match(name):
        if step is not None and int(TAG.match(name).group(1)) != step:
            raise FileNotFoundError(f"{path} is the checkpoint of another step than {step}")
        ckpt_dir, tag = os.path.dirname(path), name
    else:
        holds = os.path.isfile(os.path.join(path, "latest")) or any(TAG.match(n) for n in os.listdir(path))
        ckpt_dir = path if holds else os.path.join(path, "checkpoints")
        latest = os.path.join(ckpt_dir, "latest")
        if step is not None:
            tag = tag_of(step)
        elif os.path.isfile(latest):
            with open(latest) as f:
                tag = f.read().strip()
        elif os.path.isdir(ckpt_dir) and (complete := complete_tags(ckpt_dir)):
            tag = complete[-1][1]
        else:
            raise FileNotFoundError(f"{path}: no checkpoint there (no 'latest' file and no complete "
                                    f"global_stepN in it or in its checkpoints/ directory, and not a global_stepN "
                                    f"directory)")
    if not os.path.isdir(os.path.join(ckpt_dir, tag)):  # e.g. a step that rotation removed, or never saved
        raise FileNotFoundError(f"{os.path.join(ckpt_dir, tag)}: no such checkpoint; complete ones in {ckpt_dir}: "
                                f"{', '.join(n for _, n in complete_tags(ckpt_dir)) or 'none'}")
    if not os.path.isfile(os.path.join(ckpt_dir, tag, COMPLETE)):
        raise FileNotFoundError(f"{os.path.join(ckpt_dir, tag)}: not a complete checkpoint (no {COMPLETE} marker: "
                                f"missing, or a save that did not finish)")
    return ckpt_dir, tag


def tags(ckpt_dir: str) -> List[Tuple[int, str]]:
    """[(step, name)] of the global_stepN directories, by step."""
    return sorted((int(m.group(1)), name) for name in os.listdir(ckpt_dir) if (m := TAG.match(name)))


def complete_tags(ckpt_dir: str) -> List[Tuple[int, str]]:
    """tags of the checkpoints marked complete."""
    return [(s, n) for s, n in tags(ckpt_dir) if os.path.isfile(os.path.join(ckpt_dir, n, COMPLETE))]
