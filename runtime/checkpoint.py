"""Checkpoints with torch.distributed.checkpoint (DCP): model, optimizer, RNG and data position; resume.

Layout under the checkpoint directory::

    step_00000010/      one DCP checkpoint (.metadata + per-rank .distcp files) and meta.json
    latest              the name of the newest complete checkpoint

The state is saved in a form no plan decides (:mod:`runtime.portable_state`): every parameter, its AdamW moments
and its fp32 master as full tensors by model name, to which each rank writes its pieces in parallel and DCP
reshards on load. So a checkpoint written under one plan (tp, pp, vpp, dp, cp, ZeRO stage, layer split, GPU
count) resumes under any other plan of the same model, sequence length, global batch, seed and state precisions;
a different one of those is refused with a one-line error. A checkpoint is written to ``step_N.partial`` and
renamed when complete, then ``latest`` is replaced atomically, so a rank killed mid-save leaves the previous
checkpoint intact (and its ``.partial`` folder, removed by the next save that completes). The data position is the
step count (the data order is a pure function of the step), kept
in ``meta.json`` with the plan that wrote it. Each rank's RNG state is saved too and restored when the same plan
resumes (dropout then continues exactly); another plan draws its dropout masks afresh. ``meta.json`` also holds a
CRC-32 of every file of the checkpoint, worked out after the save and checked before a load (each rank reads a
share of the files, so it costs one parallel read of the checkpoint each way): a file whose bytes changed on disk
is refused as corrupt instead of resuming from it. Only the newest few are kept (``--keep-checkpoints``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from runtime.checkpoint_folder import (
    META,
    STEP_NAME,
    checkpoint_files,
    checkpoint_step,
    instead_of,
    latest_checkpoint,
    newest_is_broken,
    no_checkpoint,
    set_aside,
    step_folders,
    step_name,
    write_latest,
)
from runtime.data import SAMPLE_TEXT
from runtime.options import CARRIED, KEEP_CHECKPOINTS, flag
from runtime.portable_state import (
    LoadPlanner,
    SavePlanner,
    empty_like_local,
    local_state,
    portable,
    restore,
    take_loaded,
)
from runtime.trainer import Trainer
from specs.errors import AutoparError, RunFailed
from specs.host import usable_cores
from specs.model import ModelSpec
from specs.planfile import PlanFile, TrainConfig
from specs.state import StateSpec

CHUNK = 1 << 24  # bytes read at a time for a checksum
FORMAT = 2  # 1: keys by plan (before resuming under other plans)
SAME = ("model", "seq", "global_batch", "seed", "state")  # what a resuming plan must share with the checkpoint


def fingerprint(plan: PlanFile, state: StateSpec) -> dict[str, Any]:
    """The run a checkpoint belongs to (its ``SAME`` keys) and the plan that wrote it (the rest)."""
    return {"model": plan.model.model_dump(mode="json"), "parallel": plan.config.to_dict(),
            "global_batch": plan.global_batch, "seq": plan.seq, "seed": plan.train.seed,
            "world_size": plan.world_size, "state": state.model_dump(mode="json")}


def _rng_state(tr: Trainer) -> dict[str, torch.Tensor]:
    out = {f"rng.cpu.rank{tr.g.rank}": torch.get_rng_state()}
    if tr.device.type == "cuda":
        out[f"rng.cuda.rank{tr.g.rank}"] = torch.cuda.get_rng_state(tr.device)
    return out


def state_dict(tr: Trainer) -> dict[str, object]:
    """What this rank saves: its pieces of the plan-independent state, and its RNG."""
    tr.dp.wait_param_gather()  # ZeRO-1/2: parameters must be complete before they are read
    pieces, infos = local_state(tr)
    return {**portable(pieces, infos), **_rng_state(tr)}


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def checksums(folder: Path, files: list[str], share: int = 0, shares: int = 1) -> dict[str, str] | str:
    """CRC-32 of share ``share`` of ``shares`` of ``files`` in ``folder``, by name; or why one could not be read (an
    error every rank raises after the gather, so none is left waiting)."""
    try:
        return {name: _crc32(folder / name) for i, name in enumerate(files) if i % shares == share}
    except OSError as err:
        return f"cannot read {err.filename}: {err.strerror or err}"


def corrupt_files(ck: Path, meta: dict[str, Any], share: int = 0, shares: int = 1, threads: int = 1) -> list[str]:
    """Of share ``share`` of the files ``meta`` has checksums of, those missing, unreadable or changed (none to check
    in a checkpoint written without them); ``threads`` files at once (CRC-32 releases the GIL; a parallel file system
    serves one stream a fraction of its bandwidth; one core here: 5 GB/s of cached files, benchmarks/RESULTS.md)."""
    mine = [(name, crc) for i, (name, crc) in enumerate(sorted((meta.get("checksums") or {}).items()))
            if i % shares == share]

    def changed(item: tuple[str, str]) -> bool:
        try:
            return _crc32(ck / item[0]) != item[1]
        except OSError:
            return True

    with ThreadPoolExecutor(max(1, min(threads, len(mine)))) as pool:
        return [name for (name, _), bad in zip(mine, pool.map(changed, mine)) if bad]


def hash_threads() -> int:
    """Files a whole checkpoint checked in one process reads at once: a thread per usable core, at most 8."""
    return max(1, min(8, usable_cores()))


def check_whole(ck: Path) -> None:
    """Refuse checkpoint ``ck`` (its meta.json unreadable, a file missing or changed since it was saved) in the
    error a worker would raise: before anything is moved for a resume from it."""
    bad = corrupt_files(ck, read_meta(ck), threads=hash_threads())
    if bad:
        raise corrupt_error(ck, bad)


def corrupt_error(ck: Path, bad: list[str], exporting: bool = False) -> AutoparError:
    """The error for a checkpoint whose files ``bad`` do not match their checksums."""
    more = f", and {len(bad) - 1} more files" if len(bad) > 1 else ""
    what = "does not match the checksum it was saved with" if (ck / bad[0]).exists() else "is missing"
    return AutoparError(f"checkpoint {ck} is corrupt ({bad[0]} {what}{more}); {instead_of(ck, exporting)}")


def _first_failure(err: BaseException) -> BaseException:
    """The exception behind a DCP failure (its first failing rank's), or ``err`` itself."""
    if isinstance(err, CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


def _cause(err: BaseException) -> str:
    """What went wrong, in a few words: a DCP failure's first rank's exception (a file system's error by its own
    words: "No space left on device"), or the error's first line."""
    err = _first_failure(err)
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


FULL_BELOW = 64 << 20  # free bytes under which a failed save is put down to a full disk


def _free_bytes(path: Path) -> int | None:
    """Bytes free to this user on the file system holding ``path`` (None where that cannot be read)."""
    try:
        return shutil.disk_usage(path if path.exists() else path.parent).free
    except OSError:
        return None


def save_checkpoint(tr: Trainer, root: Path, keep: int = KEEP_CHECKPOINTS,
                    options: dict[str, int | None] | None = None) -> Path:
    """Write the state after ``tr.step`` completed steps; returns the checkpoint's directory. ``options``: the
    checkpointing options the run was given (``options.CARRIED``), which a resume without them keeps."""
    name = step_name(tr.step)
    final, tmp = root / name, root / f"{name}.partial"
    rank0 = tr.g.rank == tr.g.ranks[0]
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=tr.g.world)
    try:
        dcp.save(state_dict(tr), checkpoint_id=str(tmp), process_group=tr.g.world, planner=SavePlanner())
    except (Exception, CheckpointException) as err:  # DCP raises on every rank when any rank fails
        free = _free_bytes(tmp)  # (before the partial files go: a full disk shows as one)
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)  # (space a full disk needs)
        before = latest_checkpoint(root)
        kept = f"; the checkpoint before it ({before.name}) is kept" if before is not None else ""
        full = free is not None and free < FULL_BELOW  # torch's writer may say only "unexpected pos" when it is
        if full or isinstance(_first_failure(err), OSError):  # the file system's: what to do about it
            cause = f"the disk holding it is full: {free / 2 ** 20:.0f} MiB free" if full else _cause(err)
            raise RunFailed(f"cannot write checkpoint {final} ({cause}){kept}: free space or give another "
                            "--checkpoint-dir") from None  # (`autopar run` adds how to go on from the one kept)
        raise RunFailed(f"checkpoint {final} was not written ({_cause(err)}){kept}") from None
    dist.barrier(group=tr.g.world)
    n = dist.get_world_size(tr.g.world)
    names: list[list[str] | None] = [checkpoint_files(tmp) if rank0 else None]  # one listing for all ranks
    dist.broadcast_object_list(names, src=tr.g.ranks[0], group=tr.g.world)
    every: list[dict[str, str] | str | None] = [None] * n
    dist.all_gather_object(every, checksums(tmp, names[0] or [], dist.get_rank(tr.g.world), n), group=tr.g.world)
    failed = next((part for part in every if isinstance(part, str)), None)
    if failed:
        raise RunFailed(f"checkpoint {tmp} could not be read back after saving ({failed}); the previous "
                        "checkpoint is kept: check the file system")
    if rank0:
        sums = {k: v for part in every if isinstance(part, dict) for k, v in part.items()}
        data = None if tr.data.path == SAMPLE_TEXT else str(tr.data.path.resolve())  # None: the bundled sample
        publish(root, tmp, {"step": tr.step, "samples": tr.step * tr.plan.global_batch, "data": data,
                            "data_file": data_stamp(data),
                            "total_steps": tr.steps, "plan": fingerprint(tr.plan, tr.state),
                            "options": {k: v for k, v in (options or {}).items() if k in CARRIED},
                            "plan_file": tr.plan.model_dump(mode="json", by_alias=True)}, keep, sums)
    dist.barrier(group=tr.g.world)
    return final


def publish(root: Path, tmp: Path, meta: dict[str, Any], keep: int = KEEP_CHECKPOINTS,
            sums: dict[str, str] | None = None) -> Path:
    """Finish a checkpoint written to ``tmp`` (``step_N.partial``): its ``meta.json`` with the files' checksums
    (``sums``, or worked out here), the rename to ``step_N``, ``latest`` replaced atomically, all but the newest
    ``keep`` older ones removed."""
    final = tmp.with_name(tmp.name.removesuffix(".partial"))
    if sums is None:
        sums = checksums(tmp, checkpoint_files(tmp))
        if isinstance(sums, str):
            raise AutoparError(f"checkpoint {tmp} could not be read back after saving ({sums})")
    (tmp / META).write_text(json.dumps({"format": FORMAT, **meta, "checksums": sums}, indent=1) + "\n")
    if final.exists():  # a checkpoint of this step from before a roll back (by hand): kept aside, not overwritten
        set_aside(root, [final])
    # ``latest`` first: a crash before the rename leaves it naming no folder, and the newest complete checkpoint at or
    # below its step is resumed (latest_checkpoint); renamed first, a crash left a complete checkpoint newer than
    # ``latest``, which reads as one pointed back from by hand, and the next resume set the newest aside
    write_latest(root, f"{final.name}\n".encode())
    os.replace(tmp, final)
    # the run's own checkpoints: any newer one is from before a roll back (by hand), neither kept in place of the
    # run's nor pruned
    folders = [p for p in step_folders(root) if checkpoint_step(p) <= checkpoint_step(final)]
    complete = [p for p in folders if (p / META).is_file()]
    kept = complete[-keep:]  # complete ones only: a broken folder never counts as kept in place of a good one
    # what the save before this one kept: a folder older than that was tried then, and said then if it stayed
    before = [p for p in complete if p != final][-keep:]
    stuck = []
    for old in folders:  # older than every kept one: complete or broken (a removal cut short), it goes
        if checkpoint_step(old) < checkpoint_step(kept[0]):
            shutil.rmtree(old, ignore_errors=True)
            new = not before or checkpoint_step(old) >= checkpoint_step(before[0])
            stuck += [old.name] if old.exists() and new else []
    if stuck:  # (a training run goes on: its disk use grows by a checkpoint each time, so it is said, once)
        print(f"autopar: note: could not remove the old checkpoint{'s' if len(stuck) > 1 else ''} "
              f"{', '.join(stuck)} from {root} (permissions?); they take disk space until removed by hand",
              file=sys.stderr, flush=True)
    for cut in root.glob("step_*.partial"):  # saves a stopped run left half-written: a checkpoint's size each
        if cut.is_dir() and STEP_NAME.fullmatch(cut.name.removesuffix(".partial")):
            shutil.rmtree(cut, ignore_errors=True)
    return final


def saved_plan(root: Path) -> PlanFile:
    """The plan that wrote the newest checkpoint under ``root`` (what ``autopar run --resume`` without a plan file
    resumes under, and ``--replan`` re-plans)."""
    from specs.planfile import plan_from_data

    ck = latest_checkpoint(root)
    if ck is None:
        raise no_checkpoint(root)
    try:
        data = read_meta(ck)["plan_file"]
    except (KeyError, TypeError):
        raise AutoparError(f"checkpoint {ck} does not hold the plan that wrote it (written by an older autopar); "
                           "give the plan file to resume under (and no --replan)") from None
    return plan_from_data(data, str(ck / META))


# What a resumed run takes from its plan whatever its checkpoint's run had: how often it saves, and the seed (a
# different seed is another run, refused by load_checkpoint)
OWN_TRAIN = ("checkpoint_every", "seed")


def resumed_train(plan: PlanFile, root: Path) -> tuple[PlanFile, str | None]:
    """The plan a run resumes under: ``plan`` with the training settings (learning-rate schedule, AdamW, clipping)
    of the run whose newest checkpoint is under ``root`` (but :data:`OWN_TRAIN`), so a run resumed under another plan
    continues its schedule; and a note saying what differed (None when nothing did). A step-0 checkpoint (written by
    ``import-hf``) has run no schedule: the plan's is kept. ``autopar run --train-from-plan`` keeps the plan's in all
    cases (a lower learning rate after a divergence)."""
    meta = _trained_meta(root)
    saved = (meta.get("plan_file") or {}).get("train")
    if not isinstance(saved, dict):
        return plan, None
    try:
        theirs = TrainConfig.model_validate({**saved, **{k: getattr(plan.train, k) for k in OWN_TRAIN}})
    except ValueError:
        ck = latest_checkpoint(root)
        raise AutoparError(f"checkpoint {ck} is corrupt (its {META} holds an invalid train section); "
                           f"{instead_of(ck)}") from None
    changed = [f"{k} {getattr(theirs, k)} (the plan has {getattr(plan.train, k)})" for k in TrainConfig.model_fields
               if getattr(theirs, k) != getattr(plan.train, k)]
    if not changed:
        return plan, None
    return plan.model_copy(update={"train": theirs}), ("resuming with the checkpoint's training settings, as its run "
                                                        "had them: " + ", ".join(changed) + " (--train-from-plan "
                                                        "takes the plan's)")


def resumed_options(root: Path, given: dict[str, int | None]) -> tuple[dict[str, int | None], str | None]:
    """``given`` (the run's ``options.CARRIED``, None where not given) with those the newest checkpoint's run was
    given filled in, and a note naming them (None when none is carried)."""
    saved = _trained_meta(root).get("options")
    saved = saved if isinstance(saved, dict) else {}
    out, kept = dict(given), []
    for key, least in CARRIED.items():
        v = saved.get(key)
        if out.get(key) is None and isinstance(v, int) and not isinstance(v, bool) and v >= least:
            out[key] = v
            kept.append(f"{flag(key)} {v}")
    note = f"keeping the checkpoint's run's {' and '.join(kept)} (give them to change)" if kept else None
    return out, note


def data_stamp(path: str | None) -> dict[str, int] | None:
    """What a checkpoint records of the data file its run trained on, to notice a file changed before a resume: its
    size and modification time (None: the bundled sample, or a file that cannot be read)."""
    try:
        st = Path(path).stat() if path is not None else None
    except OSError:
        return None
    return None if st is None else {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def resumed_data(root: Path, given: str | None) -> tuple[str | None, str | None]:
    """The token file a run resumed from ``root``'s newest checkpoint trains on, and a note (or None): ``given``
    (--data) when given (noted when the checkpoint's run trained on another file, the bundled sample included), else
    the file that run trained on (None: the bundled sample, or a step-0 checkpoint of ``import-hf``, which trained on
    nothing); noted too when that file changed since (its windows, and so the samples after the resume, move)."""
    meta = _trained_meta(root)
    saved = meta.get("data")
    if isinstance(saved, str) and Path(saved).parts[-3:] == SAMPLE_TEXT.parts[-3:]:
        saved = None  # the bundled sample, as checkpoints written before it was recorded as None named it
    if not isinstance(saved, str):
        if meta and given is not None:  # (import-hf's step 0 trained on nothing: no meta, no note)
            return given, f"training on --data {given}; the checkpoint's run trained on the bundled sample"
        return given, None
    if given is not None and Path(given).resolve() != Path(saved).resolve():
        return given, f"training on --data {given}; the checkpoint's run trained on {saved}"
    if given is None and not Path(saved).is_file():
        where = "" if Path(saved).is_absolute() else " (a path relative to where that run started, not found from here)"
        raise AutoparError(f"the checkpoint's run trained on {saved}{where}, which is not there any more; give --data "
                           "FILE (that file where it is now, or another to go on with)")
    stamp, now = meta.get("data_file"), data_stamp(saved)
    if isinstance(stamp, dict) and now is not None and stamp != now:
        return given or saved, (f"{saved} changed since the checkpoint's run trained on it ({stamp.get('bytes')} -> "
                                f"{now['bytes']} bytes, modified since): the samples after the resume are drawn from "
                                "its windows as they are now, not as the run would have gone on")
    if given is not None:
        return given, None
    return saved, f"training on the checkpoint's data file {saved} (--data gives another)"


def _trained_meta(root: Path) -> dict[str, Any]:
    """The newest checkpoint's ``meta.json`` under ``root`` when it can be read and its run trained ({} when there is
    none, it is unreadable, which loading it says with the rest of what it checks, or it is ``import-hf``'s step 0,
    which trained on nothing and ran no schedule)."""
    ck = latest_checkpoint(root)
    try:
        meta = read_meta(ck) if ck is not None else {}
    except AutoparError:
        return {}
    return meta if meta.get("step") != 0 else {}


DIVERGED = "diverged.json"  # beside the checkpoints: the step a run's loss turned to nan after, and from which one


def mark_diverged(root: Path, step: int, rank: int) -> None:
    """Record in ``root`` that the run diverged at ``step``, after its newest checkpoint (every rank writes the same
    record, atomically: whichever rank torchrun stops last, one of them has)."""
    ck = latest_checkpoint(root)
    tmp = root / f"{DIVERGED}.{rank}"
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps({"step": step, "checkpoint": ck.name if ck is not None else None}))
        os.replace(tmp, root / DIVERGED)


def repeated_divergence(root: Path) -> str | None:
    """Why restarting from ``root``'s newest checkpoint would only diverge again (the run diverged after it with
    the same settings), or None."""
    try:
        mark = json.loads((root / DIVERGED).read_text())
    except (OSError, ValueError):
        return None
    ck = latest_checkpoint(root)
    if not isinstance(mark, dict) or mark.get("checkpoint") != (ck.name if ck is not None else None):
        return None
    return (f"the run's loss turned to nan at step {mark.get('step')} after checkpoint {ck}, and a restart from it "
            "would repeat that, so this restart stops: lower train.lr in the plan and resume with --train-from-plan, "
            "or resume from an earlier checkpoint")


def forget_divergence(root: Path) -> None:
    """A run started by hand (not torchrun's restart) tries again whatever diverged before."""
    with contextlib.suppress(OSError):
        (root / DIVERGED).unlink()


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Seconds of training between checkpoints that lose the least time to saving and to redoing work after a
    failure (Young 1974; Daly 2006's first-order form): sqrt(2 x save time x mean time between failures)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def _normal(fp: dict[str, Any]) -> dict[str, Any]:
    """A fingerprint with its model and state as the specs resolve them: fields added since a checkpoint was written
    take their defaults, a default left out equals the same value written out, and what only plans the model
    (``ModelSpec.trained``) is left out (a corrupt entry stays as it is and compares unequal)."""
    out = dict(fp)
    with contextlib.suppress(KeyError, TypeError, ValueError):
        out["model"] = ModelSpec.model_validate(fp["model"]).resolved().trained()
    with contextlib.suppress(KeyError, TypeError, ValueError):
        out["state"] = StateSpec.model_validate(fp["state"]).model_dump(mode="json")
    return out


def _run_of(fp: dict[str, Any]) -> dict[str, Any]:
    """The ``SAME`` part of a (normalised) fingerprint: the state's precisions, not its gradient bucket size (a
    plan's choice)."""
    out = {k: fp.get(k) for k in SAME}
    if isinstance(out["state"], dict):
        out["state"] = {k: v for k, v in out["state"].items() if k != "bucket_params"}
    return out


def _first_difference(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> str:
    """The first field (``model.moe.experts_per_token``) whose value differs between ``a`` and ``b``, both values."""
    for key in dict.fromkeys([*a, *b]):
        x, y = a.get(key), b.get(key)
        if x != y:
            if isinstance(x, dict) and isinstance(y, dict):
                return _first_difference(x, y, f"{prefix}{key}.")
            shown = [f"a section of {len(v)} fields" if isinstance(v, dict) else "none" if v is None else repr(v)
                     for v in (x, y)]
            return f"{prefix}{key}: checkpoint has {shown[0]}, this run {shown[1]}"  # (a whole section: not spelt out)
    return "?"


def read_meta(ck: Path, exporting: bool = False) -> dict[str, Any]:
    """Checkpoint ``ck``'s meta.json, checked: a step count, the plan fingerprint, this autopar's format
    (``exporting``: the error's advice is to export another checkpoint, not to train on from one)."""
    try:
        meta = json.loads((ck / META).read_text())
        step, saved, sums = meta["step"], meta["plan"], meta.get("checksums", {})
        if not isinstance(step, int) or isinstance(step, bool) or step < 0 or not isinstance(saved, dict):
            raise ValueError("bad step or plan")
        if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
            raise ValueError("bad checksums")
    except (OSError, ValueError, KeyError, TypeError):
        raise AutoparError(f"checkpoint {ck} is corrupt (unreadable {META}); {instead_of(ck, exporting)}") from None
    if STEP_NAME.fullmatch(ck.name) and checkpoint_step(ck) != meta["step"]:  # a folder renamed, meta.json edited
        raise AutoparError(f"checkpoint {ck} is corrupt (its {META} says step {meta['step']}, its folder step "
                           f"{checkpoint_step(ck)}); {instead_of(ck, exporting)}")
    if meta.get("format") != FORMAT:
        raise AutoparError(f"checkpoint {ck} has format {meta.get('format', 1)}, this autopar reads format {FORMAT}; "
                           "use the autopar that wrote it (or start without --resume)")
    return meta


def same_run(ck: Path, meta: dict[str, Any], plan: PlanFile, state: StateSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """Refuse to resume checkpoint ``ck`` (its ``meta``) under ``plan`` keeping ``state`` when it is of another run
    (a ``SAME`` key differs); returns both normalised fingerprints (the checkpoint's, this run's)."""
    saved, mine = _normal(meta["plan"]), _normal(fingerprint(plan, state))
    shared, ours = _run_of(saved), _run_of(mine)
    if shared != ours:
        raise AutoparError(f"checkpoint {ck} is of another run ({_first_difference(shared, ours)}); a checkpoint "
                           "resumes under any plan of the same model, sequence, global batch, seed and precisions")
    return saved, mine


def load_checkpoint(tr: Trainer, root: Path) -> int:
    """Restore the newest checkpoint under ``root`` into ``tr``; returns the step it resumes after."""
    broken = newest_is_broken(root)
    if broken:
        raise broken
    ck = latest_checkpoint(root)
    if ck is None:
        raise no_checkpoint(root)
    meta = read_meta(ck)
    step = meta["step"]
    saved, mine = same_run(ck, meta, tr.plan, tr.state)
    if not meta.get("checksums") and tr.g.rank == tr.g.ranks[0]:
        print(f"autopar: note: checkpoint {ck} records no checksums (saved by an autopar before they were added, or "
              f"its {META} edited): its files are loaded unverified", file=sys.stderr, flush=True)
    n = dist.get_world_size(tr.g.world)
    every: list[list[str] | None] = [None] * n
    dist.all_gather_object(every, corrupt_files(ck, meta, dist.get_rank(tr.g.world), n), group=tr.g.world)
    bad = sorted(name for part in every for name in (part or []))
    if bad:
        raise corrupt_error(ck, bad)
    pieces, infos = empty_like_local(tr)
    state = portable(pieces, infos)
    rng = _rng_state(tr)
    same_plan = saved == mine and meta.get("rng", True)  # an imported checkpoint (import-hf) holds no RNG
    if same_plan:
        state.update(rng)
    try:
        dcp.load(state, checkpoint_id=str(ck), process_group=tr.g.world, planner=LoadPlanner())
    except (Exception, CheckpointException) as err:  # DCP raises on every rank when any rank fails
        raise AutoparError(f"checkpoint {ck} is corrupt or incomplete ({_cause(err)}); {instead_of(ck)}") from None
    take_loaded(state, pieces, infos)
    restore(tr, pieces)
    if same_plan:
        torch.set_rng_state(state[f"rng.cpu.rank{tr.g.rank}"])
        if tr.device.type == "cuda":
            torch.cuda.set_rng_state(state[f"rng.cuda.rank{tr.g.rank}"], tr.device)
    tr.step = tr.opt.step_count = step
    return step
