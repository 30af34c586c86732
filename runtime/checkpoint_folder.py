"""What a checkpoint folder holds, read without torch: its ``step_N`` folders, which are complete (a ``meta.json``),
the newest one, and the errors for a folder that holds none or a broken newest one (:mod:`runtime.checkpoint` writes
and loads them; the launcher and the run options only need to look)."""

from __future__ import annotations

import re
from pathlib import Path

from specs.errors import AutoparError

META = "meta.json"
LATEST = "latest"
STEP_NAME = re.compile(r"step_[0-9]+")  # a checkpoint's folder: the step it was written after


def checkpoint_files(folder: Path) -> list[str]:
    """The files of a checkpoint folder a checksum covers: all but its meta.json, by name."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != META)


def no_checkpoint(root: Path) -> AutoparError:
    """The error of a resume from ``root`` where it holds no checkpoint: a checkpoint's own folder given in place of
    the checkpoint folder is named as such."""
    if STEP_NAME.fullmatch(root.name) and (root / META).is_file():
        return AutoparError(f"{root} is one checkpoint; give the folder holding it, --checkpoint-dir {root.parent} "
                            "(its newest checkpoint is resumed)")
    return AutoparError(f"no checkpoint to resume from in {root}; run without --resume to start fresh")


def step_name(step: int) -> str:
    """The folder of the checkpoint written after ``step`` (``step_00000010``; while written, ``.partial`` added)."""
    return f"step_{step:08d}"


def checkpoint_step(ck: Path) -> int:
    """The step a checkpoint directory (``step_N``) was written after."""
    return int(ck.name.removeprefix("step_"))


def step_folders(root: Path) -> list[Path]:
    """The ``step_N`` folders under ``root`` (not ``.partial`` ones, not other names), oldest step first."""
    found = [p for p in root.glob("step_*") if STEP_NAME.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=checkpoint_step)


def newest_is_broken(root: Path) -> AutoparError | None:
    """The error for a checkpoint folder newer than the newest complete one that has no ``meta.json`` (a checkpoint
    is renamed into place with it, so one without it lost it since), or None. Resuming from the one before without a
    word would redo its steps and, as new checkpoints were kept, prune the good one."""
    good = latest_checkpoint(root)
    newer = [p for p in step_folders(root)
             if not (p / META).exists() and (good is None or checkpoint_step(p) > checkpoint_step(good))]
    if not newer:
        return None
    before = f"; delete it to resume from {good.name}" if good is not None else "; delete it to start afresh"
    return AutoparError(f"checkpoint {newer[-1]} is corrupt (it has no {META}){before}")


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under ``root`` (``latest`` if valid, else the highest step_N)."""
    try:
        named = root / (root / LATEST).read_text().strip()
        if (named / META).exists():
            return named
    except OSError:
        pass
    done = [p for p in step_folders(root) if (p / META).exists()]
    return done[-1] if done else None
