"""The options of a training run (``autopar run`` and its workers, ``python -m runtime.train``), without importing
torch: the command line arguments, and the checks that refuse bad ones before any worker starts."""

from __future__ import annotations

import argparse
from pathlib import Path

from runtime.checkpoint_folder import latest_checkpoint
from specs.errors import AutoparError
from specs.files import check_output_dir, check_output_file, integer, path_argument
from specs.planfile import PlanFile, steps_problem

COLLECTIVE_TIMEOUT_S = 1800.0  # --collective-timeout's default
KEEP_CHECKPOINTS = 2  # --keep-checkpoints' default: the newest and the one before it


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `autopar run` (also `python -m runtime.launch`): the workers' and the launcher's own."""
    p.add_argument("plan", nargs="?", type=path_argument,
                   help="plan file from `autopar plan --out` (default: a tiny CPU plan)")
    add_worker_arguments(p)
    p.add_argument("--max-restarts", type=integer, default=0, metavar="N",
                   help="when a worker dies, restart all workers up to N times, each resuming from the latest "
                        "checkpoint in --checkpoint-dir (torchrun's elastic restart; default 0)")
    p.add_argument("--resume-from", metavar="STEP",
                   help="resume from the checkpoint written after STEP (or its folder, step_00000010) in "
                        "--checkpoint-dir instead of the newest: the newer ones are moved into a rolled-back-<time> "
                        "folder there, not deleted (implies --resume)")
    p.add_argument("--replan", action="store_true",
                   help="with --resume and --gpus: plan the checkpoint's run again for the GPUs there are now (same "
                        "model and global batch), write that plan beside the checkpoints and continue under it")
    p.add_argument("--gpus", type=integer, help="with --replan: how many GPUs (ranks) to plan for")
    p.add_argument("--dry-run", action="store_true", help="print the launch command and exit")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments `autopar run` passes on to each training worker (``python -m runtime.train``)."""
    p.add_argument("--steps", type=integer,
                   help="stop after this many steps in all (default: the run's train.steps); the learning-rate "
                        "schedule stays the run's (the plan's; on --resume the checkpoint's, see --train-from-plan)")
    p.add_argument("--data", type=path_argument,
                   help="token file (.npy, .bin/.u16, .u32) or .txt (tokenised by byte, the tokens cached under "
                        "~/.cache/autopar or $AUTOPAR_CACHE); default: a bundled text sample")
    p.add_argument("--metrics-out", type=path_argument, help="write JSON lines of per-step metrics here")
    p.add_argument("--checkpoint-dir", type=path_argument, help="save checkpoints here")
    p.add_argument("--checkpoint-every", type=integer, help="steps between checkpoints (default: the plan's)")
    p.add_argument("--keep-checkpoints", type=integer, metavar="N",
                   help=f"keep the newest N checkpoints, removing older ones as new ones complete (default "
                        f"{KEEP_CHECKPOINTS})")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--train-from-plan", action="store_true",
                   help="with --resume: train with the plan's train section (learning rate, its schedule, AdamW) "
                        "instead of the one the checkpoint's run had (e.g. a lower train.lr after a divergence)")
    p.add_argument("--mtbf-hours", type=float, metavar="H",
                   help="the job's mean time between failures: after the first checkpoint, print the interval "
                        "Young-Daly's rule gives from its measured save time (sqrt(2 x save time x MTBF))")
    p.add_argument("--collective-timeout", type=float, default=COLLECTIVE_TIMEOUT_S, metavar="S",
                   help="end the run with one line naming the rank that stopped when no rank has made progress "
                        f"(a communication call or a step) for S seconds (default {COLLECTIVE_TIMEOUT_S:g})")
    p.add_argument("--quiet", action="store_true", help="no progress lines (errors and the metrics file stay)")


def worker_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The command line of one training worker (``python -m runtime.train``, torchrun starts one per rank): the plan,
    :func:`add_worker_arguments`, and the predictions the launcher re-estimated for a plan edited since."""
    ap = argparse.ArgumentParser(prog="python -m runtime.train", description=description)
    ap.add_argument("plan", help="plan file (autopar plan --out)")
    add_worker_arguments(ap)
    ap.add_argument("--predicted-step-time", type=float, metavar="S",
                    help="the step time metrics carry as predicted (default: the plan's prediction)")
    ap.add_argument("--predicted-memory", type=float, metavar="GIB",
                    help="the peak memory per GPU metrics carry as predicted (default: the plan's prediction)")
    return ap


def worker_argv(plan_path: str, **values: object) -> list[str]:
    """A worker's arguments (:func:`worker_parser`) for ``values`` by destination (``metrics_out="m.jsonl"``,
    ``resume=True``); those None or False are left out, so the worker takes its default."""
    actions = {a.dest: a for a in worker_parser()._actions if a.option_strings}
    unknown = sorted(set(values) - set(actions))
    if unknown:
        raise TypeError(f"no worker argument for {', '.join(unknown)}")
    out = [plan_path]
    for dest, value in values.items():
        if value is not None and value is not False:
            flag = actions[dest].option_strings[0]
            out += [flag] if value is True else [flag, str(value)]
    return out


def launch_options(a: argparse.Namespace) -> dict[str, object]:
    """The keyword arguments of ``runtime.launch.launch`` that the run arguments give (all but the plan)."""
    return dict(steps=a.steps, data=a.data, metrics_out=a.metrics_out, checkpoint_dir=a.checkpoint_dir,
                resume=a.resume, dry_run=a.dry_run, checkpoint_every=a.checkpoint_every, quiet=a.quiet,
                max_restarts=a.max_restarts, mtbf_hours=a.mtbf_hours, collective_timeout=a.collective_timeout,
                keep_checkpoints=a.keep_checkpoints, train_from_plan=a.train_from_plan)

def check_run_values(steps: int | None, checkpoint_every: int | None = None, max_restarts: int = 0,
                     collective_timeout: float = COLLECTIVE_TIMEOUT_S, mtbf_hours: float | None = None,
                     keep_checkpoints: int | None = None) -> None:
    """Refuse option values no run takes, whatever its plan (before a plan is made or read)."""
    if steps is not None and steps_problem("--steps", steps):
        raise AutoparError(steps_problem("--steps", steps))
    if checkpoint_every is not None and checkpoint_every < 0:
        raise AutoparError(f"--checkpoint-every must be 0 (only at the end) or a positive step count, "
                           f"got {checkpoint_every}")
    if max_restarts < 0:
        raise AutoparError(f"--max-restarts must be 0 or more, got {max_restarts}")
    if not 0 < collective_timeout < float("inf"):
        raise AutoparError(f"--collective-timeout must be a positive number of seconds, got {collective_timeout}")
    if mtbf_hours is not None and not 0 < mtbf_hours < float("inf"):
        raise AutoparError(f"--mtbf-hours must be a positive number of hours, got {mtbf_hours}")
    if keep_checkpoints is not None and keep_checkpoints < 1:
        raise AutoparError(f"--keep-checkpoints must be at least 1 (the one a resume needs), got {keep_checkpoints}")


def check_run_options(plan: PlanFile, steps: int | None, checkpoint_dir: str | None, checkpoint_every: int | None,
                      metrics_out: str | None, resume: bool, max_restarts: int = 0,
                      mtbf_hours: float | None = None, collective_timeout: float = COLLECTIVE_TIMEOUT_S,
                      inputs: dict[str, str | None] | None = None, keep_checkpoints: int | None = None,
                      train_from_plan: bool = False, attempt: int = 0) -> int:
    """Refuse options that would only fail later (after training, at the first checkpoint or metrics write), a
    metrics file that is one of the run's ``inputs`` (what each is -> its path), and one holding an earlier run's
    steps that a run from scratch (not ``resume``, the first ``attempt``) would overwrite; returns the number of
    steps to run."""
    total = steps if steps is not None else plan.train.steps
    check_run_values(total, checkpoint_every, max_restarts, collective_timeout, mtbf_hours, keep_checkpoints)
    if resume and not checkpoint_dir:
        raise AutoparError("--resume needs --checkpoint-dir (where the checkpoints are)")
    if train_from_plan and not resume:
        raise AutoparError("--train-from-plan says which schedule a resumed run takes (the plan's, not the "
                           "checkpoint's); a run from scratch takes the plan's anyway: add --resume or drop it")
    for flag, value in (("--checkpoint-every", checkpoint_every), ("--mtbf-hours", mtbf_hours),
                        ("--keep-checkpoints", keep_checkpoints)):
        if value is not None and not checkpoint_dir:
            raise AutoparError(f"{flag} needs --checkpoint-dir (where the checkpoints go)")
    if max_restarts and not checkpoint_dir:
        raise AutoparError("--max-restarts needs --checkpoint-dir: a restarted run resumes from its checkpoints")
    if checkpoint_dir is not None:
        check_output_dir(checkpoint_dir, "checkpoint directory")
    if metrics_out is not None:
        from runtime.metrics import is_metrics_data

        check_output_file(metrics_out, "metrics file", inputs, replaces=is_metrics_data)  # not a profile, say
        if not resume and attempt == 0:
            _check_not_overwriting(metrics_out, checkpoint_dir)
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
