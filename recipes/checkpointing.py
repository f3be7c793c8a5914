"""Checkpoints through engine.save_checkpoint that a crash mid-save cannot damage.

Every rank writes its part of <dir>/global_stepN (model, ZeRO optimizer shards and one file per
expert, including those of other expert-parallel ranks). Only after all ranks are done does rank 0
mark the tag complete and atomically point <dir>/latest at it, so `latest` only ever names a whole
checkpoint; then it deletes all but the newest `keep` complete ones, and any unfinished older tags.
The marker holds what the run was (step, world size, config), so that a resume can be checked
against it before any work starts.
"""
import json
import os
import re
import shutil

import deepspeed.comm as dist

from turbomoe.checkpoint_tags import COMPLETE, complete_tags, find_tag, tag_of, tags


def _atomic_write(path: str, text: str):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(engine, ckpt_dir: str, step: int, keep: int, meta: dict):
    """All ranks: save step's checkpoint; meta (JSON-able) goes into its completion marker."""
    tag = tag_of(step)
    marker = os.path.join(ckpt_dir, tag, COMPLETE)
    if dist.get_rank() == 0 and os.path.exists(marker):
        # Overwriting a tag of a run resumed from an earlier one: incomplete until done, so `latest`
        # first goes back to the newest complete tag of this run's line before it (a crash now must not
        # leave it naming this one, nor one of the run that this one left).
        others = line_tags(ckpt_dir, step - 1, meta.get("start_step", 0), meta.get("launch"))
        if others:
            _atomic_write(os.path.join(ckpt_dir, "latest"), others[-1][1])
        else:
            os.remove(os.path.join(ckpt_dir, "latest"))
        os.remove(marker)
    if dist.get_rank() == 0 and os.path.isdir(os.path.join(ckpt_dir, tag)):
        # The old tag's files go too: written by more ranks (a run resumed on fewer, or a save that
        # crashed), their extra optimizer partitions would stay in the new tag and make it unreadable.
        shutil.rmtree(os.path.join(ckpt_dir, tag))
    dist.barrier()  # cleared before any rank writes there
    engine.save_checkpoint(ckpt_dir, tag=tag, client_state={"step": step}, save_latest=False)
    dist.barrier()  # every rank's files are written
    if dist.get_rank() == 0:
        _atomic_write(marker, json.dumps({"step": step, **meta}))
        _atomic_write(os.path.join(ckpt_dir, "latest"), tag)
        prune(ckpt_dir, keep, step, meta.get("start_step", 0), meta.get("launch"))
    dist.barrier()


def line_tags(ckpt_dir: str, upto: int, start: int = 0, launch=None):
    """[(step, name)] of this run's line of complete tags up to step `upto`: those up to `start` (the step
    this launch resumed from) and those this launch wrote (their marker's `launch`); all where launch is
    None. A run that went further before this one resumed from an earlier checkpoint left tags after
    start: they are not of the line."""
    def of_this_run(s, name):
        return launch is None or s <= start or read_meta(ckpt_dir, name).get("launch") == launch
    return [(s, n) for s, n in complete_tags(ckpt_dir) if s <= upto and of_this_run(s, n)]


def prune(ckpt_dir: str, keep: int, current: int, start: int = 0, launch=None):
    """Keep the newest `keep` complete tags of this run's line (line_tags) up to step `current` (the one
    just saved); delete the other tags before current, complete or not. Another run's tags after
    start and after current stay until this run overwrites them."""
    kept = line_tags(ckpt_dir, current, start, launch)[-keep:]
    for s, name in tags(ckpt_dir):
        if s < current and (s, name) not in kept:
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)


def holds_tags(ckpt_dir: str) -> bool:
    """Whether ckpt_dir holds any checkpoint tag, complete or not."""
    return os.path.isdir(ckpt_dir) and bool(tags(ckpt_dir))


def read_meta(ckpt_dir: str, tag: str) -> dict:
    """The tag's completion marker; ValueError naming it where it is not the JSON object a save writes."""
    path = os.path.join(ckpt_dir, tag, COMPLETE)
    with open(path) as f:
        try:
            meta = json.load(f)
        except ValueError as e:  # json's errors, and bytes that are not UTF-8
            raise ValueError(f"{path}: not a checkpoint's completion marker ({e}): cut short or damaged") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise ValueError(f"{path}: not a checkpoint's completion marker (no step in it)")
    return meta


def resolve(path: str):
    """(checkpoint dir, tag) to resume from: a checkpoint dir (its `latest`), a run dir (its
    checkpoints/) or one tag directory. Raises FileNotFoundError when there is no complete checkpoint."""
    try:
        return find_tag(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--resume {path!r}: {e}") from e
