"""The options of a training run (``autopar run`` and its workers, ``python -m runtime.train``), without importing
torch: :class:`RunOptions` declares each once (its flag, type and help), the command lines are made from it, and its
checks refuse bad values before any worker starts."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from runtime.checkpoint_folder import check_checkpoint_dir, latest_checkpoint
from specs.errors import AutoparError
from specs.files import check_output_file, integer, path_argument
from specs.planfile import PlanFile, steps_problem

COLLECTIVE_TIMEOUT_S = 1800.0  # --collective-timeout's default
KEEP_CHECKPOINTS = 2  # --keep-checkpoints' default: the newest and the one before it
# The checkpointing options a resumed run keeps from the run that wrote its checkpoint unless given again (and their
# smallest values): a resume that forgot `--keep-checkpoints 4` would otherwise prune what that run kept
CARRIED = {"checkpoint_every": 0, "keep_checkpoints": 1}


def _option(default: Any, help: str, type: Any = None, metavar: str | None = None, launcher: bool = False) -> Any:
    """A :class:`RunOptions` field: its flag is ``--`` and its name with dashes; a bool is a switch. ``launcher``:
    an option of `autopar run`'s launcher only, not passed on to the workers."""
    return field(default=default, metadata={"help": help, "type": type, "metavar": metavar, "launcher": launcher})


@dataclass(frozen=True)
class RunOptions:
    """What a training run is asked to do besides its plan: `autopar run`'s options (``launch``), each worker's
    (``runtime.train``, all but the launcher's own), and `autopar tune`'s trials."""

    steps: int | None = _option(
        None, "stop after this many steps in all (default: the run's train.steps); the learning-rate schedule stays "
        "the run's (the plan's; on --resume the checkpoint's, see --train-from-plan)", integer)
    data: str | None = _option(
        None, "token file (.npy, .bin/.u16, .u32) or .txt (tokenised by byte, the tokens cached under ~/.cache/autopar "
        "or $AUTOPAR_CACHE); default: a bundled text sample", path_argument)
    metrics_out: str | None = _option(None, "write JSON lines of per-step metrics here", path_argument)
    checkpoint_dir: str | None = _option(None, "save checkpoints here", path_argument)
    checkpoint_every: int | None = _option(None, "steps between checkpoints (default: the plan's)", integer)
    keep_checkpoints: int | None = _option(
        None, f"keep the newest N checkpoints, removing older ones as new ones complete (default {KEEP_CHECKPOINTS})",
        integer, "N")
    resume: bool = _option(False, "resume from the latest checkpoint in --checkpoint-dir")
    train_from_plan: bool = _option(
        False, "with --resume: train with the plan's train section (learning rate, its schedule, AdamW) instead of "
        "the one the checkpoint's run had (e.g. a lower train.lr after a divergence)")
    mtbf_hours: float | None = _option(
        None, "the job's mean time between failures: after the first checkpoint, print the interval Young-Daly's rule "
        "gives from its measured save time (sqrt(2 x save time x MTBF))", float, "H")
    collective_timeout: float = _option(
        COLLECTIVE_TIMEOUT_S, "end the run with one line naming the rank that stopped when no rank has made progress "
        f"(a communication call or a step) for S seconds (default {COLLECTIVE_TIMEOUT_S:g})", float, "S")
    quiet: bool = _option(False, "no progress lines (errors and the metrics file stay)")
    max_restarts: int = _option(
        0, "when a worker dies, restart all workers up to N times, each resuming from the latest checkpoint in "
        "--checkpoint-dir (torchrun's elastic restart; default 0)", integer, "N", launcher=True)
    dry_run: bool = _option(False, "print the launch command and exit", launcher=True)

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> RunOptions:
        """The options parsed by :func:`add_run_arguments` or :func:`worker_parser` (a worker's launcher options
        take their defaults)."""
        return cls(**{f.name: getattr(a, f.name) for f in fields(cls) if hasattr(a, f.name)})

    def flags(self, *names: str) -> list[str]:
        """The command-line arguments that give the options ``names`` (default: every worker option) their values
        here; those at their default are left out (the process given them takes its default)."""
        out: list[str] = []
        for f in fields(self):
            if (f.name in names if names else not f.metadata["launcher"]):
                value = getattr(self, f.name)
                if value != f.default:
                    name = flag(f.name)
                    out += [name] if value is True else [name, str(value)]
        return out

    def carried(self) -> dict[str, int | None]:
        """The checkpointing options a checkpoint records, for a resume given none (:data:`CARRIED`)."""
        return {name: getattr(self, name) for name in CARRIED}


def flag(name: str) -> str:
    """The command-line flag of run option ``name`` (``max_restarts``: ``--max-restarts``)."""
    return "--" + name.replace("_", "-")


def _add(p: argparse.ArgumentParser, launcher: bool) -> None:
    for f in fields(RunOptions):
        if f.metadata["launcher"] == launcher:
            m = f.metadata
            if f.type == "bool":
                p.add_argument(flag(f.name), action="store_true", help=m["help"])
            else:
                p.add_argument(flag(f.name), type=m["type"], default=f.default, metavar=m["metavar"], help=m["help"])


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `autopar run` (also `python -m runtime.launch`): the plan, :class:`RunOptions` (the workers'
    and the launcher's) and those of `autopar run` alone."""
    p.add_argument("plan", nargs="?", type=path_argument,
                   help="plan file from `autopar plan --out` (default: a tiny CPU plan)")
    _add(p, launcher=False)
    _add(p, launcher=True)
    p.add_argument("--resume-from", metavar="STEP",
                   help="resume from the checkpoint written after STEP (or its folder, step_00000010) in "
                        "--checkpoint-dir instead of the newest: the newer ones are moved into a rolled-back-<time> "
                        "folder there, not deleted (implies --resume)")
    p.add_argument("--replan", action="store_true",
                   help="with --resume and --gpus: plan the checkpoint's run again for the GPUs there are now (same "
                        "model and global batch), write that plan beside the checkpoints and continue under it")
    p.add_argument("--gpus", type=integer, help="with --replan: how many GPUs (ranks) to plan for")


def worker_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The command line of one training worker (``python -m runtime.train``, torchrun starts one per rank): the plan,
    the workers' :class:`RunOptions`, and the predictions the launcher re-estimated for a plan edited since."""
    ap = argparse.ArgumentParser(prog="python -m runtime.train", description=description)
    ap.add_argument("plan", help="plan file (autopar plan --out)")
    _add(ap, launcher=False)
    ap.add_argument("--predicted-step-time", type=float, metavar="S",
                    help="the step time metrics carry as predicted (default: the plan's prediction)")
    ap.add_argument("--predicted-memory", type=float, metavar="GIB",
                    help="the peak memory per GPU metrics carry as predicted (default: the plan's prediction)")
    return ap


def worker_argv(plan_path: str, options: RunOptions, predicted_step_s: float | None = None,
                predicted_memory_GiB: float | None = None) -> list[str]:
    """A worker's arguments (:func:`worker_parser`): the plan, ``options`` (the launcher's own left out) and the
    predictions the metrics carry (None: the plan's)."""
    out = [plan_path, *options.flags()]
    for flag, value in (("--predicted-step-time", predicted_step_s), ("--predicted-memory", predicted_memory_GiB)):
        if value is not None:
            out += [flag, str(value)]
    return out


def check_run_values(o: RunOptions, steps: int | None = None) -> None:
    """Refuse option values no run takes, whatever its plan (before a plan is made or read); ``steps``: the steps the
    run stops at where the options give none (the plan's)."""
    total = o.steps if o.steps is not None else steps
    if total is not None and steps_problem("--steps", total):
        raise AutoparError(steps_problem("--steps", total))
    if o.checkpoint_every is not None and o.checkpoint_every < 0:
        raise AutoparError(f"--checkpoint-every must be 0 (only at the end) or a positive step count, "
                           f"got {o.checkpoint_every}")
    if o.max_restarts < 0:
        raise AutoparError(f"--max-restarts must be 0 or more, got {o.max_restarts}")
    if not 0 < o.collective_timeout < float("inf"):
        raise AutoparError(f"--collective-timeout must be a positive number of seconds, got {o.collective_timeout}")
    if o.mtbf_hours is not None and not 0 < o.mtbf_hours < float("inf"):
        raise AutoparError(f"--mtbf-hours must be a positive number of hours, got {o.mtbf_hours}")
    if o.keep_checkpoints is not None and o.keep_checkpoints < 1:
        raise AutoparError(f"--keep-checkpoints must be at least 1 (the one a resume needs), got {o.keep_checkpoints}")


def check_run_options(plan: PlanFile, o: RunOptions, inputs: dict[str, str | None] | None = None,
                      attempt: int = 0, metrics: bool = True) -> int:
    """Refuse options that would only fail later (after training, at the first checkpoint or metrics write), a
    metrics file that is one of the run's ``inputs`` (what each is -> its path), and one holding an earlier run's
    steps that a run from scratch (not ``resume``, the first ``attempt``) would overwrite (``metrics``: whether this
    process writes it); returns the number of steps to run."""
    total = o.steps if o.steps is not None else plan.train.steps
    check_run_values(o, total)
    if o.resume and not o.checkpoint_dir:
        raise AutoparError("--resume needs --checkpoint-dir (where the checkpoints are)")
    if o.train_from_plan and not o.resume:
        raise AutoparError("--train-from-plan says which schedule a resumed run takes (the plan's, not the "
                           "checkpoint's); a run from scratch takes the plan's anyway: add --resume or drop it")
    for name in ("checkpoint_every", "mtbf_hours", "keep_checkpoints"):
        if getattr(o, name) is not None and not o.checkpoint_dir:
            raise AutoparError(f"{flag(name)} needs --checkpoint-dir (where the checkpoints go)")
    if o.max_restarts and not o.checkpoint_dir:
        raise AutoparError("--max-restarts needs --checkpoint-dir: a restarted run resumes from its checkpoints")
    if o.checkpoint_dir is not None:
        check_checkpoint_dir(Path(o.checkpoint_dir))
    if o.metrics_out is not None and metrics:
        from runtime.metrics import is_metrics_data

        check_output_file(o.metrics_out, "metrics file", inputs, replaces=is_metrics_data)  # not a profile, say
        if not o.resume and attempt == 0:
            _check_not_overwriting(o.metrics_out, o.checkpoint_dir)
    return total


def _check_not_overwriting(metrics_out: str, checkpoint_dir: str | None) -> None:
    """A run from scratch writes its metrics file anew: refused where that file records an earlier run's steps
    (its measurements would be lost, as a checkpoint folder holding a run's checkpoints is refused)."""
    from runtime.metrics import last_step

    reached = last_step(metrics_out)
    if reached is not None:
        held = checkpoint_dir is not None and latest_checkpoint(Path(checkpoint_dir)) is not None
        go_on = " (--resume continues that run and appends to it)" if held else ""
        raise AutoparError(f"metrics file {metrics_out} holds an earlier run's metrics (to step {reached}); a run "
                           f"from scratch would overwrite them: give another --metrics-out or delete it{go_on}")
