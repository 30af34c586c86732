"""Measured runs: the metrics files ``autopar run --metrics-out`` writes, read into runs of their plans.

A metrics file holds one JSON object per step (``step``, ``step_time_s``, ...) and event lines. Each run is
paired with the plan it ran: from ``--plan`` (one per metrics file, or one for all), else from a ``plan`` key in
the metrics file (a path, or the embedded plan object). A file that a run and its resume under another plan both
appended to holds several runs: consecutive step lines under one ``plan`` entry and one stamp of what that plan
was (``plan_made_for``) are one run (a line without them continues the run before it). A run's measured step time
is the median over its steps after the warm-up (``--warmup``, default the first 10% and at least one step: a run
of one step is refused unless ``--warmup 0``). Used by ``calibrate``, ``diagnose`` and ``tune``. Never imports
torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specs.errors import AutoparError
from specs.files import text_content
from specs.phases import COMPUTE, is_step_line
from specs.planfile import PlanFile, is_plan_data, load_plan, made_for_difference, plan_from_data

COMPUTE_TERMS = ("forward_compute", "backward_compute", "recompute")  # the estimate's parts COMPUTE phases time


FINGERPRINT_STEPS = 3  # the first steps whose times tell one measured run from another


@dataclass
class Run:
    """One measured run: where it came from, its plan, and its median step time after warm-up."""

    source: str
    plan: PlanFile
    measured_s: float
    steps: int
    logged_prediction_s: float | None
    # each pipeline stage's compute (forward + backward, the median rank of the stage over the steps after the
    # warm-up), where the lines carry every rank's phases: what the fit sets beside the estimate's compute, so that a
    # slow collective is not read as slow GEMMs
    stage_compute_s: tuple[float, ...] | None = None
    first_steps_s: tuple[float, ...] = ()  # the times of its first steps, warm-up included (:attr:`fingerprint`)

    @property
    def fingerprint(self) -> str:
        """What tells this run from another: its plan, model and hardware and the times its first steps measured (the
        same whatever the warm-up, and as more steps are appended by a resume), not where its file is or its median.
        A calibrated profile records those fitted into it."""
        what = [self.plan.config.short(), self.plan.model.name, self.plan.cluster.name, self.plan.world_size,
                self.plan.global_batch, self.plan.seq, [repr(t) for t in self.first_steps_s] or repr(self.measured_s)]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


@dataclass
class Segment:
    """The step lines of a metrics file written under one plan: one run (a resume under the same plan continues
    it; one under another plan, or under the same file re-planned into, starts the next segment)."""

    plan: Any  # the ``plan`` entry its lines carry (a path or an embedded plan); None when no line has one
    rows: list[dict[str, Any]]

    @property
    def span(self) -> str:
        """Its steps, as ``steps A-B``."""
        steps = [r["step"] for r in self.rows]
        return f"steps {min(steps)}-{max(steps)}"

    def describe(self) -> str:
        """Its steps and the plan it names, for messages."""
        name = "an embedded plan" if isinstance(self.plan, dict) else str(self.plan)
        return f"{self.span}: {name}"


def runs_text(segments: list[Segment], most: int = 3) -> str:
    """The runs of a metrics file in a few words (the first ``most``, then how many more)."""
    shown = "; ".join(s.describe() for s in segments[:most])
    return shown + (f"; {len(segments) - most} more" if len(segments) > most else "")


def read_segments(path: str | Path, notes: bool = True) -> list[Segment]:
    """The runs of a metrics file in file order (:class:`Segment`): consecutive step lines under one ``plan``
    entry and one stamp of what that plan was (``plan_made_for``: a plan file re-planned into between a run and
    its resume makes two runs). A line without the keys continues the run before it; step lines before the first
    ``plan`` entry belong to the run it names. Steps redone after a restart (or a resume from an earlier
    checkpoint) replace the lines first written for them, so each step counts once. ``notes``: say on stderr when a
    last line cut off mid-write is skipped."""
    segments: list[Segment] = []
    plan: Any = None
    for obj in _metrics_lines(path, notes):
        if "plan" in obj:
            plan = obj["plan"]
        if not is_step_line(obj):
            continue
        if segments and segments[-1].plan is None:
            segments[-1].plan = plan  # the lines before any plan entry are the first plan's
        stamp = obj.get("plan_made_for")
        if (not segments or (plan is not None and plan != segments[-1].plan)
                or (stamp is not None and segments[-1].rows[-1].get("plan_made_for") not in (None, stamp))):
            segments.append(Segment(plan, []))
        rows = segments[-1].rows
        if rows and obj["step"] <= rows[-1]["step"]:  # a restart or resume redoing steps: the redone lines are
            rows[:] = [r for r in rows if r["step"] < obj["step"]]  # the run's history, the first ones lost
        rows.append(obj)
    if segments[-1].plan is None:
        segments[-1].plan = plan  # named only after the step lines
    return segments


def _metrics_lines(path: str | Path, notes: bool = True) -> list[dict[str, Any]]:
    """The JSON objects of a metrics file, its step lines checked (one-line errors for a bad file)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise AutoparError(f"metrics file {p} does not exist; write one with `autopar run PLAN --metrics-out {p}`"
                           ) from None
    except UnicodeDecodeError:
        raise AutoparError(f"metrics file {p} is not text (not UTF-8): give the JSON-lines file `autopar run PLAN "
                           "--metrics-out FILE` wrote") from None
    except OSError as err:
        raise AutoparError(f"cannot read metrics file {p}: {err.strerror or err}") from None
    objs: list[dict[str, Any]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) and not text.endswith("\n"):  # a write cut off by a crash: the steps before count
                if notes:
                    print(f"note: metrics file {p}: skipped its last line {i}, cut off mid-write", file=sys.stderr)
                continue
            whole = text_content(text)
            if is_plan_data(whole):
                raise AutoparError(f"{p} is a plan file, not a metrics file: give the metrics file `autopar run "
                                   f"{p} --metrics-out FILE` wrote (and this plan with --plan)") from None
            if isinstance(whole, dict):  # YAML: a model spec or a cluster profile
                raise AutoparError(f"{p} is YAML (a model spec or cluster profile?), not a metrics file: give the "
                                   "JSON-lines file `autopar run PLAN --metrics-out FILE` wrote") from None
            raise AutoparError(f"metrics file {p} line {i} is not valid JSON (truncated or corrupt?)") from None
        if not isinstance(obj, dict):
            raise AutoparError(f"metrics file {p} line {i} is not a JSON object")
        if "step" in obj and "event" not in obj and not is_step_line(obj):  # not a line autopar run writes
            raise AutoparError(f"metrics file {p} line {i} has a step but no step_time_s: give the file `autopar run "
                               "--metrics-out` wrote, or remove that line")
        if is_step_line(obj):
            t, step = obj["step_time_s"], obj["step"]
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
                raise AutoparError(f"metrics file {p} line {i}: step_time_s must be a positive number, got {t!r}")
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise AutoparError(f"metrics file {p} line {i}: step must be a non-negative integer, got {step!r}")
        objs.append(obj)
    if not text.strip():
        raise AutoparError(f"metrics file {p} is empty")
    if not any(is_step_line(o) for o in objs):
        raise AutoparError(f"metrics file {p} has no step lines (objects with 'step' and 'step_time_s')")
    return objs


def stages(plan: PlanFile) -> np.ndarray:
    """Each rank's pipeline stage."""
    return np.array([plan.config.rank_coords(r)["pp"] for r in range(plan.config.world)])


def stage_compute(rows: list[dict[str, Any]], kept: int, plan: PlanFile) -> tuple[float, ...] | None:
    """Each pipeline stage's compute seconds (:attr:`Run.stage_compute_s`) over the last ``kept`` steps of ``rows``,
    or None where a line lacks every rank's forward and backward times."""
    world, cfg = plan.world_size, plan.config
    per_rank = []
    for r in sorted(rows, key=lambda r: r["step"])[len(rows) - kept:]:
        ph = r.get("phases_s")
        f, b = (ph.get(p) for p in COMPUTE) if isinstance(ph, dict) else (None, None)
        if not (isinstance(f, list) and isinstance(b, list) and len(f) == len(b) == world):
            return None
        try:
            per_rank.append([float(x) + float(y) for x, y in zip(f, b)])
        except (TypeError, ValueError):
            return None
    if not per_rank:
        return None
    median, stage = np.median(np.array(per_rank), axis=0), stages(plan)
    out = tuple(float(np.median(median[stage == s])) for s in range(cfg.pp))
    return out if all(math.isfinite(x) and x > 0 for x in out) else None


def check_warmup(warmup: int | None) -> None:
    """A one-line error for a negative ``--warmup`` (None: the default)."""
    if warmup is not None and warmup < 0:
        raise AutoparError(f"--warmup must be 0 or more, got {warmup}")


MIN_STEPS = 5  # measured steps after warm-up below which a run's median says little (a warning)


def only_warm_up(rows: list[dict[str, Any]], warmup: int | None) -> bool:
    """Whether a run is nothing but its warm-up under the default ``--warmup`` (one step, which allocates and
    compiles)."""
    return warmup is None and len(rows) == 1


def warm_up_only(source: str) -> AutoparError:
    """The error for a run that is only its warm-up (:func:`only_warm_up`)."""
    return AutoparError(f"metrics file {source}: its one step is the warm-up (the first step of a run allocates and "
                        "compiles: not a measurement); run more steps, or give --warmup 0 to use it anyway")


def measured_median(rows: list[dict[str, Any]], warmup: int | None, source: str,
                    more_steps: str = "autopar run --steps") -> tuple[float, int]:
    """Median step time after the warm-up steps, and how many steps it is over (a note below MIN_STEPS, naming
    ``more_steps``, the option that measures longer runs)."""
    if only_warm_up(rows, warmup):
        raise warm_up_only(source)
    rows = sorted(rows, key=lambda r: r["step"])
    skip = warmup if warmup is not None else max(1, len(rows) // 10)
    kept = [r["step_time_s"] for r in rows[skip:]]
    if not kept:
        raise AutoparError(f"metrics file {source}: all {len(rows)} step(s) are warm-up (--warmup {skip}); "
                           "run more steps or lower --warmup")
    if len(kept) < MIN_STEPS:
        print(f"warning: metrics file {source}: only {len(kept)} step(s) after the warm-up; a median of fewer than "
              f"{MIN_STEPS} says little; measure longer runs ({more_steps})", file=sys.stderr)
    return float(np.median(kept)), len(kept)


def resolve_plan(ref: Any, metrics: Path, rows: list[dict[str, Any]] | None = None) -> PlanFile:
    """The plan a metrics file names: an embedded plan object, or a path (:func:`plan_ref_path`); a plan file
    changed since the run wrote ``rows`` (their ``plan_made_for`` stamp) is refused."""
    if isinstance(ref, dict):
        return plan_from_data(ref, f"metrics file {metrics}: embedded plan")
    path = plan_ref_path(str(ref), metrics)
    if not Path(path).exists():  # moved or deleted since the run: a new plan of the same name would not be it
        raise AutoparError(f"plan file {path}, which metrics file {metrics} ran, is not there any more; pass the "
                           "plan file the run used with --plan")
    plan = load_plan(path)
    changed = _changed_since(rows or [], plan)
    if changed:
        raise PlanChanged(f"plan file {path} has changed since metrics file {metrics} was written ({changed} "
                          "differ); pass the plan the run ran with --plan")
    return plan


class PlanChanged(AutoparError):
    """The plan file a run's metrics name is no longer the plan that run ran (its stamp says so)."""


def _changed_since(rows: list[dict[str, Any]], plan: PlanFile, parts: tuple[str, ...] | None = None) -> str | None:
    """What of ``plan`` differs from the plan the run that wrote ``rows`` ran (the stamp its lines carry; only
    ``parts`` of it when given), in words; None when nothing does or the lines carry no stamp (older files)."""
    stamp = next((r["plan_made_for"] for r in rows if isinstance(r.get("plan_made_for"), dict)), None)
    if stamp is None:
        return None
    return made_for_difference({k: v for k, v in stamp.items() if parts is None or k in parts}, plan)


def plan_ref_path(ref: str, metrics: Path) -> Path:
    """The path a metrics file's ``plan`` entry names: as written, or relative to the metrics file when it is a
    relative path not found from here."""
    path = Path(ref)
    return path if path.is_absolute() or path.exists() else metrics.parent / path


def named_plan_files(metrics: list[str]) -> list[Path]:
    """The plan files the runs of these metrics files name (what a command reading them must not write over; an
    unreadable metrics file names none here: reading its runs says what is wrong with it)."""
    named = []
    for m in metrics:
        with contextlib.suppress(AutoparError):
            named += [plan_ref_path(s.plan, Path(m)) for s in read_segments(m, notes=False) if isinstance(s.plan, str)]
    return named


def load_runs(metrics: list[str], plans: list[str] | None, warmup: int | None,
              more_steps: str = "autopar run --steps") -> list[Run]:
    """Every metrics file with its plan (see the module docstring for how they are paired); ``more_steps``: the
    option a too-short run's warning names."""
    plans = plans or []
    if plans and len(plans) not in (1, len(metrics)):
        raise AutoparError(f"give one --plan for all metrics files or one per file ({len(metrics)}), "
                           f"not {len(plans)}")
    seen: dict[Path, str] = {}
    for m in metrics:  # one run counted twice would weigh twice in a fit and narrow its spreads
        key = Path(m).resolve()
        if key in seen:
            also = f" (also as {seen[key]})" if seen[key] != m else ""
            raise AutoparError(f"metrics file {m} is given twice{also}; give each run once")
        seen[key] = m
    runs, warm_only, changed = [], [], []
    for i, m in enumerate(metrics):
        segments = read_segments(m)
        if plans and len(segments) > 1:
            raise AutoparError(f"metrics file {m} holds {len(segments)} runs of different plans "
                               f"({runs_text(segments)}); leave --plan out: each run's lines name its plan")
        for seg in segments:
            source = m if len(segments) == 1 else f"{m} ({seg.span})"
            if plans:
                path = plans[i if len(plans) > 1 else 0]
                plan = load_plan(path)
                check_same_run(m, seg.rows, seg.plan, plan, path)
            elif seg.plan is not None:
                try:
                    plan = resolve_plan(seg.plan, Path(m), seg.rows)
                except PlanChanged:
                    if len(segments) == 1:
                        raise
                    changed.append(source)  # one of several runs: the others are still measurements
                    continue
            else:
                raise AutoparError(f"metrics file {m} does not say which plan it ran; pass --plan PLAN.json "
                                   "(one per metrics file, in the same order)")
            if only_warm_up(seg.rows, warmup):  # not a measurement: left out, with a note below
                warm_only.append(source)
                continue
            med, n = measured_median(seg.rows, warmup, source, more_steps)
            logged = next((r.get("predicted_step_time_s") for r in seg.rows if r.get("predicted_step_time_s")), None)
            first = tuple(float(r.get("step_time_s", 0.0)) for r in seg.rows[:FINGERPRINT_STEPS])
            runs.append(Run(source, plan, med, n, logged, stage_compute(seg.rows, n, plan), first))
    if changed:
        print(f"note: left out {len(changed)} run(s) whose plan file has changed since ({', '.join(changed)}): "
              "the file no longer says what they ran", file=sys.stderr)
    if changed and not runs and not warm_only:
        raise AutoparError(f"every run's plan file has changed since it ran ({', '.join(changed)}); nothing to fit")
    if warm_only and not runs:
        raise warm_up_only(warm_only[0])
    if warm_only:
        print(f"note: left out {len(warm_only)} run(s) of one step, which is warm-up ({', '.join(warm_only)}); "
              "--warmup 0 fits them too", file=sys.stderr)
    return runs


def check_same_run(metrics: str, rows: list[dict[str, Any]], embedded: Any, plan: PlanFile, plan_path: str
                   ) -> None:
    """Refuse a --plan the metrics file was not written by: its ranks (per-rank phases), the parallel keys, batch
    and sequence its lines were stamped with, or, where the file names its plan and that plan can still be read
    as it was, its model and parallel layout. (The --plan may differ in its cluster: a profile to price it on.)"""
    ranks = next((len(v) for r in rows for v in (r.get("phases_s") or {}).values() if isinstance(v, list)), None)
    if ranks is not None and ranks != plan.world_size:
        raise AutoparError(f"metrics file {metrics} has {ranks} ranks' phases, but --plan {plan_path} runs "
                           f"{plan.world_size}; pass the plan that run used")
    changed = _changed_since(rows, plan, ("parallel", "global_batch", "seq"))
    if changed:
        raise AutoparError(f"metrics file {metrics} was written by a run of another plan than --plan {plan_path} "
                           f"({changed} differ); pass the plan that run used")
    if embedded is None:
        return
    try:
        ran = resolve_plan(embedded, Path(metrics), rows)
    except AutoparError:
        return  # the plan it names was moved, removed or changed: what is checked above is all there is
    if ran.config != plan.config or ran.model.resolved() != plan.model.resolved():
        raise AutoparError(f"metrics file {metrics} was written by a run of {ran.model.name} "
                           f"{ran.config.short()}, but --plan {plan_path} is {plan.model.name} {plan.config.short()}; "
                           "pass the plan that run used, or leave --plan out (the file names it)")
