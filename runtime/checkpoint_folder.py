"""What a checkpoint folder holds, read without torch: its ``step_N`` folders, which are complete (a ``meta.json``),
the newest one, and the errors for a folder that holds none or a broken newest one (:mod:`runtime.checkpoint` writes
and loads them; the launcher and the run options only need to look)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from specs.errors import AutoparError
from specs.files import check_output_dir

META = "meta.json"
LATEST = "latest"
STEP_NAME = re.compile(r"step_[0-9]+")  # a checkpoint's folder: the step it was written after
LOCK = ".autopar-lock"  # held by the `autopar run` training into the folder (its process id written in it)
HELD_ENV = "AUTOPAR_CHECKPOINT_LOCK_HELD"  # the folder (resolved) whose lock the launcher of these workers holds
ROLLED_BACK = "rolled-back-"  # the folder (time stamp added) the checkpoints after a rolled-back-to one move into


def checkpoint_files(folder: Path) -> list[str]:
    """The files of a checkpoint folder a checksum covers: all but its meta.json, by name."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != META)


def no_checkpoint(root: Path) -> AutoparError:
    """The error of a resume from ``root`` where it holds no checkpoint: a checkpoint's own folder given in place of
    the checkpoint folder is named as such."""
    if STEP_NAME.fullmatch(root.name) and (root / META).is_file():
        return AutoparError(f"{root} is one checkpoint; give the folder holding it, --checkpoint-dir {root.parent} "
                            f"(its newest checkpoint is resumed; add --resume-from {checkpoint_step(root)} for this "
                            "one)")
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
    if good is not None and good == _named_by_latest(root):  # ``latest`` names it (pointed back by --resume-from
        return None  # or by hand): what is newer is abandoned, set aside by the resume (roll_back), not its newest
    newer = [p for p in step_folders(root)
             if not (p / META).exists() and (good is None or checkpoint_step(p) > checkpoint_step(good))]
    if not newer:
        return None
    return AutoparError(f"checkpoint {newer[-1]} is corrupt (it has no {META}); {instead_of(newer[-1])}")


def instead_of(ck: Path, exporting: bool = False) -> str:
    """What to do about checkpoint ``ck``, found corrupt: go on from (or export) the complete one before it, or the
    newest complete one where newer ones are there (``latest`` pointed back at ``ck``); ``--resume-from`` sets the
    checkpoints newer than the one it names aside rather than deleting them."""
    done = [p for p in step_folders(ck.parent) if (p / META).exists() and p != ck]
    before = [p for p in done if checkpoint_step(p) < checkpoint_step(ck)]
    later = [p for p in done if checkpoint_step(p) > checkpoint_step(ck)]
    if exporting:
        return f"export the one before it instead ({before[-1]})" if before else \
            "no earlier checkpoint is there to use instead"
    if later:  # (it was pointed back at: the newer ones are still there)
        back = (f", or from the one before it with --resume-from {checkpoint_step(before[-1])} (which sets the newer "
                "ones aside)") if before else ""
        return f"go on from the newest, {later[-1].name}, with --resume-from {checkpoint_step(later[-1])}{back}, or " \
               "delete it"
    aside = newest_set_aside(ck.parent)
    moved = (f"; a roll-back set newer checkpoints aside: to go on from the newest, move {aside} back into "
             f"{ck.parent} and resume with --resume-from {checkpoint_step(aside)}"
             ) if aside is not None and checkpoint_step(aside) > checkpoint_step(ck) else ""
    if not before:
        return f"delete it to start afresh{moved}"
    step = checkpoint_step(before[-1])
    return f"go on from the one before it with --resume-from {step} (which sets this one aside), or delete it{moved}"


def newest_set_aside(root: Path) -> Path | None:
    """The newest complete checkpoint a roll-back set aside in ``root`` (in a ``rolled-back-*`` folder), or None."""
    done = [p for rb in root.glob(f"{ROLLED_BACK}*") if rb.is_dir() for p in step_folders(rb) if (p / META).exists()]
    return max(done, key=checkpoint_step, default=None)


def check_checkpoint_dir(root: Path) -> None:
    """Refuse a checkpoint folder ``root`` that cannot take a checkpoint whatever the run does (found before it
    trains rather than at its first save): one this process cannot write, or whose ``latest`` (or the ``latest.tmp``
    it is written through) is not a file."""
    check_output_dir(str(root), "checkpoint directory")
    for name in (LATEST, f"{LATEST}.tmp"):
        if (root / name).is_dir():
            raise AutoparError(f"checkpoint folder {root}: {name} is a folder; it must be the file naming the newest "
                               "checkpoint (written by the run): move or delete that folder")


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint a resume goes on from: the one ``latest`` names (a complete ``step_N`` folder of ``root``: the
    newest, or an older one it was pointed back to), else the highest complete step_N."""
    name = _latest_name(root)
    if name is not None and (root / name / META).exists():
        return root / name
    done = [p for p in step_folders(root) if (p / META).exists()]
    if name is not None and not (root / name).exists():  # a crash between it and the checkpoint's rename: at or
        done = [p for p in done if checkpoint_step(p) <= checkpoint_step(root / name)]  # below the step it names
    return done[-1] if done else None


def _latest_name(root: Path) -> str | None:
    """The step folder name the ``latest`` file holds (a step folder here, nothing elsewhere), or None."""
    try:
        name = (root / LATEST).read_text().strip()
    except (OSError, ValueError):  # absent, unreadable, not text
        return None
    return name if STEP_NAME.fullmatch(name) else None


def _named_by_latest(root: Path) -> Path | None:
    """The complete checkpoint the ``latest`` file names, or None."""
    name = _latest_name(root)
    return root / name if name is not None and (root / name / META).exists() else None


def resume_step(text: str, root: Path) -> int:
    """``--resume-from``'s value: a step (``10``) or a checkpoint's folder (``step_00000010``, a path to it, which
    must be in the checkpoint folder ``root``)."""
    path = Path(text)
    if STEP_NAME.fullmatch(path.name):
        if path.parent != Path() and path.parent.resolve() != root.resolve():
            raise AutoparError(f"--resume-from {text} is not in --checkpoint-dir {root}; give one of that folder's "
                               f"checkpoints, or --checkpoint-dir {path.parent} to go on from that folder's run")
        return checkpoint_step(path)
    try:
        step = int(text)
    except ValueError:
        step = -1
    if step < 0:
        raise AutoparError(f"--resume-from takes a checkpoint's step (10) or folder (step_00000010), got {text!r}")
    return step


def write_latest(root: Path, content: bytes) -> None:
    """Replace ``root``'s ``latest`` with ``content`` atomically (a crash leaves the old one or the new one)."""
    (root / f"{LATEST}.tmp").write_bytes(content)
    os.replace(root / f"{LATEST}.tmp", root / LATEST)


def point_latest(root: Path, step: int) -> Path:
    """Make the checkpoint written after ``step`` the one a resume goes on from (``latest``); returns it. Refused
    where it is not a complete checkpoint under ``root`` (:func:`resumable`)."""
    ck = resumable(root, step)
    write_latest(root, f"{ck.name}\n".encode())
    return ck


def resumable(root: Path, step: int) -> Path:
    """The complete checkpoint written after ``step`` under ``root``; refused, naming those there are, where it is
    missing or incomplete."""
    ck = root / step_name(step)
    if not (ck / META).is_file():
        held = [p.name for p in step_folders(root) if (p / META).is_file()]
        there = f"those in it: {', '.join(held)}" if held else "it holds none"
        what = "is not complete (it has no meta.json)" if ck.is_dir() else "does not exist"
        raise AutoparError(f"checkpoint {ck} {what}; --resume-from takes one of the complete checkpoints in {root} "
                           f"({there})")
    return ck


def set_aside(root: Path, folders: list[Path]) -> Path:
    """Move checkpoint ``folders`` of ``root`` into a new ``rolled-back-<UTC time>`` folder beside them (out of the
    run's sight: it neither resumes from nor prunes them, and no new checkpoint of the same step overwrites them);
    returns that folder."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = root / f"{ROLLED_BACK}{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = root / f"{ROLLED_BACK}{stamp}-{n}"
    dest.mkdir()
    for f in folders:
        os.replace(f, dest / f.name)
    return dest


def abandoned(root: Path) -> list[Path]:
    """The ``step_N`` folders of ``root`` newer than the checkpoint a resume goes on from (``latest``, pointed at an
    older one by ``--resume-from`` or by hand), which that resume abandons."""
    ck = latest_checkpoint(root)
    return [] if ck is None else [p for p in step_folders(root) if checkpoint_step(p) > checkpoint_step(ck)]


def roll_back(root: Path) -> str | None:
    """Set aside (:func:`set_aside`) the checkpoints a resume abandons (:func:`abandoned`), so that they are neither
    deleted nor overwritten by the steps trained again. Returns what was done, in a line, or None."""
    newer = abandoned(root)
    if not newer:
        return None
    done = [p for p in newer if (p / META).exists()]  # (an incomplete one is no checkpoint to go back to)
    dest = set_aside(root, newer)
    names = ", ".join(p.name for p in newer)
    back = (f", or move {done[-1].name} back into {root} and resume with --resume-from {checkpoint_step(done[-1])} "
            "to go on from it") if done else ""
    return (f"resuming from {latest_checkpoint(root).name}: the newer checkpoint{'s' if len(newer) > 1 else ''} "
            f"{names} moved to {dest} (nothing is deleted: remove that folder when no longer wanted{back})")


_HELD: set[Path] = set()  # the checkpoint folders this process holds (:func:`in_use` within itself is a no-op)


@contextlib.contextmanager
def in_use(root: Path) -> Iterator[None]:
    """Hold ``root`` for one run while the block runs (an advisory lock on its ``.autopar-lock``, released when the
    process ends however it ends): a second run into the same folder (a scheduler's requeue while the first still
    trains) is refused in one line instead of both writing, renaming and pruning each other's checkpoints. On a file
    system without locks the block runs unlocked, with a note. A folder the block leaves holding nothing is removed."""
    key = root.resolve()
    if key in _HELD:
        yield
        return
    made = not root.exists()
    try:
        root.mkdir(parents=True, exist_ok=True)
        f = open(root / LOCK, "a+")  # noqa: SIM115 - closed below
    except OSError as err:  # not a folder this process can write: the run's own checks say so, in their words
        if made and root.is_dir():
            root.rmdir()
        elif root.is_dir() and os.access(root, os.W_OK):  # a folder it writes, but no lock file (a full disk, a
            # folder of that name)
            lock = root / LOCK
            fix = ": remove what is there by that name" if lock.exists() and not lock.is_file() else ""
            print(f"autopar: note: cannot open {lock} ({err.strerror}); nothing stops a second run from training "
                  f"into this folder at the same time{fix}", file=sys.stderr, flush=True)
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                print(f"autopar: note: the file system of {root} has no locks ({err.strerror}); nothing stops a "
                      "second run from training into it at the same time", file=sys.stderr, flush=True)
            else:
                f.seek(0)
                who = f.read().strip()
                by = f" (process {who})" if who.isdigit() else ""
                raise AutoparError(f"checkpoint folder {root} is in use by another run{by}; wait for it to end or "
                                   "give another --checkpoint-dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        _HELD.add(key)
        try:
            yield
        finally:
            _HELD.discard(key)
            if made and [p.name for p in root.iterdir()] == [LOCK]:  # a run refused before it wrote anything
                (root / LOCK).unlink()
                root.rmdir()
            fcntl.flock(f, fcntl.LOCK_UN)


def held_by_rank(root: Path | None, rank: int) -> contextlib.AbstractContextManager[None]:
    """A worker's hold on its checkpoint folder: rank 0 takes it (:func:`in_use`) unless the `autopar run` that
    started it holds it already (``HELD_ENV``), so that workers started by hand with torchrun, or on each node of
    a multi-node plan, are one run per folder too."""
    if root is None or rank != 0 or os.environ.get(HELD_ENV) == str(root.resolve()):
        return contextlib.nullcontext()
    return in_use(root)


@contextlib.contextmanager
def pointed_back(root: Path, step: int) -> Iterator[Path]:
    """``latest`` pointed at the checkpoint of ``step`` (:func:`point_latest`) while the block runs, which sets the
    newer ones aside (:func:`roll_back`) once the run's checks pass; a block that fails before that (a refused run)
    puts ``latest`` back as it was, so that a refused ``--resume-from`` changes nothing. A folder it cannot write
    is refused first, in one line."""
    check_checkpoint_dir(root)
    try:
        before: bytes | None = (root / LATEST).read_bytes()
    except OSError:
        before = None
    ck = point_latest(root, step)
    try:
        yield ck
    except BaseException:
        if abandoned(root):  # nothing was set aside: the folder as it was
            if before is None:
                (root / LATEST).unlink(missing_ok=True)
            else:
                write_latest(root, before)
        raise
