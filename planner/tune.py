"""``autopar tune``: plan, then measure the finalists on the cluster and keep the one that is fastest in fact.

The search's top distinct plans that the model cannot tell apart from the best (predicted within its ranking
uncertainty, planner/uncertainty.py; at most ``--trials``) each run a few steps through the same
launcher as ``autopar run`` (``--steps``, the first ``--warmup`` discarded, the median of the rest), each under
a time limit. A trial that fails (out of memory, an error, the time limit) is recorded and skipped. The profile is then
fitted to the measured steps (``autopar calibrate``'s fit), the trials re-predicted with it, and the plan with
the smallest measured median written out, with its measured and predicted step times; the calibrated profile goes
to the trials' folder. On a cluster of several nodes the trials cannot start from here: their plan files are
written and the commands to run them on every node printed, as `autopar run` prints them.
"""

from __future__ import annotations

import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from planner.calibrate import (
    calibrated_by,
    calibrated_profile_text,
    ceiling_warning,
    difference_spreads,
    fit_scales,
    predict,
    step_sensitivity,
    total_scales,
)
from planner.headroom import usable_text
from planner.measured_runs import Run, check_warmup, load_runs
from planner.prediction import plan_prediction
from planner.refine import PlanResult
from planner.search import search
from planner.uncertainty import tied_indices
from specs.cluster import ClusterSpec
from specs.errors import INTERRUPTED, AutoparError
from specs.files import file_content, write_text_atomic
from specs.json_numbers import sig6
from specs.model import ModelSpec
from specs.planfile import TrainConfig, is_plan_data, make_plan, save_plan


@dataclass
class Trial:
    """One finalist and what measuring it gave."""

    plan_path: str
    parallel: dict[str, Any]
    short: str
    predicted_step_s: float
    status: str = "not run"  # running, ok, failed, timeout, interrupted
    measured_step_s: float | None = None
    calibrated_step_s: float | None = None
    error: str | None = None

    def row(self) -> dict[str, Any]:
        return {"parallel": self.parallel, "plan": self.short, "predicted_step_s": sig6(self.predicted_step_s),
                "measured_step_s": self.measured_step_s,  # (as measured: docs/contract.md)
                "calibrated_step_s": None if self.calibrated_step_s is None else sig6(self.calibrated_step_s),
                "status": self.status, "error": self.error, "plan_file": self.plan_path}


@dataclass
class TuneResult:
    trials: list[Trial]
    chosen: Trial | None  # None when no trial ran to the end
    profile_path: str | None
    scales: dict[str, float]
    interrupted: bool = False  # Ctrl-C stopped a trial; the trials after it did not run
    runs: list[Run] = field(default_factory=list)  # the trials that ran, as measured runs (what the fit saw)
    ceiling: str | None = None  # a scale the fit stopped at the GPU's datasheet (calibrate.ceiling_warning)


def check_trial_options(trials: int, steps: int, warmup: int, time_limit_s: float) -> None:
    """One-line errors for trial settings that cannot give a measurement."""
    if trials < 1:
        raise AutoparError(f"--trials (--top) must be at least 1, got {trials}")
    check_warmup(warmup)
    if steps <= warmup:
        raise AutoparError(f"--steps ({steps}) must be more than --warmup ({warmup}): the median is over the steps "
                           "after the warm-up")
    if not time_limit_s > 0:
        raise AutoparError(f"--time-limit must be more than 0 seconds, got {time_limit_s:g}")


def prepare(model: ModelSpec, cluster: ClusterSpec, global_batch: int, out_dir: Path, fixed: dict[str, Any] | None,
            trials: int, steps: int, headroom_GiB: float | None) -> list[Trial]:
    """The finalists (:func:`finalists`, at most ``trials``), each written to ``out_dir`` as a plan file that trains
    ``steps`` steps."""
    res = search(model, cluster, global_batch, fixed=fixed, top=trials, headroom_GiB=headroom_GiB)
    if not res.plans:
        raise AutoparError(f"no plan fits in {usable_text(headroom_GiB, cluster)} on {cluster.num_gpus} GPUs: "
                           "nothing to tune (see `autopar plan`)")
    out_dir.mkdir(parents=True, exist_ok=True)
    check_earlier_files(out_dir)
    removed = earlier_files(out_dir)
    for p in removed:
        p.unlink()
    if removed:
        print(f"note: removed an earlier tune's files from {out_dir}: {', '.join(p.name for p in removed)}",
              file=sys.stderr)
    found: list[Trial] = []
    fit = cluster.calibration  # a calibrated profile: plans the fit cannot order are finalists too
    extra = None if fit is None else difference_spreads(
        [step_sensitivity(model, cluster, p.config, global_batch) for p in res.plans], fit)
    for i, p in enumerate(finalists(res.plans, trials, extra)):
        path = trial_plan_path(out_dir, i + 1)
        pred = plan_prediction(model, cluster, p.config, p.estimate, global_batch)
        plan = make_plan(model, cluster, global_batch, p.config, pred, TrainConfig(steps=steps))
        save_plan(plan, path)
        found.append(Trial(str(path), p.config.to_dict(), p.config.short(), p.estimate.step_time_s))
    return found


PROFILE = "calibrated.yaml"  # the profile tune fits to its trials, in its folder
TUNED_BY = "autopar tune"  # the command its header names


def trial_plan_path(out_dir: Path, i: int) -> Path:
    """Where trial ``i`` (from 1)'s plan file goes."""
    return out_dir / f"trial{i}.json"


def written_files(out_dir: Path, trials: int) -> dict[str, Path]:
    """What tune may write or remove in ``out_dir`` for up to ``trials`` trials: each trial's plan and metrics
    file, an earlier tune's trial files there (:func:`earlier_files`) and the calibrated profile (what each is ->
    its path)."""
    out = {f"trial {i}'s plan file": trial_plan_path(out_dir, i) for i in range(1, trials + 1)}
    out.update({f"trial {i}'s metrics file": metrics_beside(trial_plan_path(out_dir, i)) for i in range(1, trials + 1)})
    out.update({f"an earlier tune's {p.name}": p for p in earlier_files(out_dir) if p not in out.values()})
    return {**out, "calibrated profile": out_dir / PROFILE}


def earlier_files(out_dir: Path) -> list[Path]:
    """What an earlier tune into ``out_dir`` left there (its trials' plan and metrics files, its profile): removed
    before a new tune writes its own, so the folder never mixes two tunes (:func:`check_earlier_files` first)."""
    named = re.compile(r"trial[1-9][0-9]*\.jsonl?")
    found = [p for p in out_dir.glob("trial*.json*") if named.fullmatch(p.name)] if out_dir.is_dir() else []
    return sorted(found) + [p for p in [out_dir / PROFILE] if p.is_file()]


def check_earlier_files(out_dir: Path) -> None:
    """Refuse a file of a tune's names in ``out_dir`` that no tune wrote (a profile of the user's own named
    calibrated.yaml, notes in trial1.json): a tune would remove or replace it."""
    for p in earlier_files(out_dir):
        what = _not_tunes(p)
        if what:
            raise AutoparError(f"{out_dir} holds {p.name}, which is not {what}: a tune there would replace it; move it "
                               "or give another --dir")


def _not_tunes(p: Path) -> str | None:
    """What a file of a tune's names should be where it is not what a tune writes there, else None (an empty file:
    a trial stopped before its first line)."""
    from runtime.metrics import is_metrics_data

    if not p.is_file() or not p.stat().st_size:
        return None
    if p.name == PROFILE:
        try:
            with open(p, encoding="utf-8") as f:
                first = f.readline()
        except (OSError, UnicodeDecodeError):
            first = ""
        return None if first.startswith(f"# {calibrated_by(TUNED_BY)}") else "the profile a tune fits"
    if p.suffix == ".jsonl":
        return None if is_metrics_data(file_content(p)) else "a trial's metrics file"
    return None if is_plan_data(file_content(p)) else "a trial's plan file"


def metrics_beside(plan_path: Path) -> Path:
    """Where the metrics of a trial with plan file ``plan_path`` go: beside it."""
    return plan_path.with_suffix(".jsonl")


def metrics_path(t: Trial) -> Path:
    """Where a trial's metrics go (:func:`metrics_beside`)."""
    return metrics_beside(Path(t.plan_path))


def check_tunable(model: ModelSpec, cluster: ClusterSpec, here: bool = True) -> None:
    """Refuse what every trial would fail on after its launch: a model the runtime cannot train and, for trials
    run ``here``, a cluster of several nodes (`autopar tune --dir` prints their commands instead) or a GPU profile
    on a machine without CUDA (the trials would run on CPUs)."""
    from specs.capabilities import execution_problem
    from specs.state import StateSpec

    problem = execution_problem(model, StateSpec.default(cluster.precision))
    if problem:
        raise AutoparError(f"tune trains its finalists, and {problem}")
    if not here:
        return
    if cluster.num_nodes > 1:
        raise AutoparError(f"tune measures its trials on this machine, and the {cluster.num_gpus} GPUs span "
                           f"{cluster.num_nodes} nodes: `autopar tune ... --dir <shared folder>` writes the trials' "
                           "plans and prints the commands that run them on every node")
    if cluster.backend == "gloo":  # a CPU profile: the trials run where it describes
        return
    import torch

    if not torch.cuda.is_available():
        raise AutoparError(f"--cluster {cluster.name} describes {cluster.gpu.name} GPUs, but this machine has no CUDA "
                           "GPU: tune measures its trials here; run it on that cluster, or tune for this machine with "
                           "--cluster cpu-gloo")


def tune(model: ModelSpec, cluster: ClusterSpec, global_batch: int, out_dir: Path, fixed: dict[str, Any] | None,
         trials: int, steps: int, warmup: int, time_limit_s: float, data: str | None = None,
         headroom_GiB: float | None = None, progress: Callable[[int, int, Trial], None] | None = None,
         env: dict[str, str] | None = None, provenance: list[str] | None = None) -> TuneResult:
    """Measure the best plan and those tied with it (:func:`finalists`, at most ``trials``) for ``steps`` steps
    each (plan files and metrics in ``out_dir``) and return them with the measured-best chosen;
    ``progress(i, n, trial)`` as each trial starts (status "running") and after it; ``provenance``: header lines of
    the cluster's profile the calibrated one keeps (:func:`planner.calibrate.source_header`)."""
    from runtime.launch import launch  # the trials run through autopar run's launcher
    from runtime.options import RunOptions

    check_trial_options(trials, steps, warmup, time_limit_s)
    check_tunable(model, cluster)
    found = prepare(model, cluster, global_batch, out_dir, fixed, trials, steps, headroom_GiB)
    runs: list[Run] = []
    stopped = False
    for i, t in enumerate(found):
        metrics = metrics_path(t)
        metrics.unlink(missing_ok=True)
        if progress:
            t.status = "running"
            progress(i + 1, len(found), t)
        try:
            rc = launch(t.plan_path, RunOptions(steps=steps, data=data, metrics_out=str(metrics), quiet=True), env=env,
                        timeout_s=time_limit_s, resumable=False)
            if rc == INTERRUPTED:  # Ctrl-C: the trial is cut short, and the user wants the tuning to stop
                t.status, t.error, stopped = "interrupted", "stopped by Ctrl-C", True
            else:
                run, = load_runs([str(metrics)], [t.plan_path], warmup, more_steps="autopar tune --steps")
                runs.append(run)
                t.status, t.measured_step_s = "ok", run.measured_s
        except AutoparError as err:
            t.status = "timeout" if "time limit" in str(err) else "failed"
            t.error = str(err)
        if progress:
            progress(i + 1, len(found), t)
        if stopped:
            break
    done = [t for t in found if t.status == "ok"]
    if not done:
        return TuneResult(trials=found, chosen=None, profile_path=None, scales={}, interrupted=stopped)
    fit = fit_scales(runs, cluster)
    for t, pred in zip(done, predict(runs, cluster, fit.scales)):
        t.calibrated_step_s = float(pred)
    chosen = min(done, key=lambda t: t.measured_step_s or np.inf)
    profile = out_dir / PROFILE
    ceiling = ceiling_warning(fit, cluster)
    write_text_atomic(profile, calibrated_profile_text(cluster, fit, TUNED_BY, f"{len(runs)} trial(s)",
                                                       [*([ceiling] if ceiling else []), *(provenance or [])]))
    return TuneResult(trials=found, chosen=chosen, profile_path=str(profile), scales=total_scales(cluster, fit),
                      interrupted=stopped, runs=runs, ceiling=ceiling)


def finalists(plans: list[PlanResult], k: int, extra: list[float] | None = None) -> list[PlanResult]:
    """The best plan and those tied with it (planner/uncertainty.py; ``extra``: a calibrated profile's spreads of
    each plan's difference from the best), at most ``k``: a plan the model predicts clearly slower is not worth a
    trial."""
    steps = [p.estimate.step_time_s for p in plans]
    return [plans[0], *(plans[i] for i in tied_indices(steps, extra))][:k]


def default_out_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="autopar-tune-"))
