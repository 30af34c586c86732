"""`autopar diagnose METRICS`: the run a metrics file holds (``--steps`` picks one), diagnosed (planner/diagnose.py):
the measured step against the prediction, the stragglers, the step without them."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planner.diagnose import diagnose, diagnosis_tables
from planner.measured_runs import (
    Segment,
    check_same_run,
    check_warmup,
    plan_ref_path,
    read_segments,
    resolve_plan,
    runs_text,
)
from planner.report import console
from specs.errors import AutoparError
from specs.parallel import whole_number
from specs.planfile import load_plan


def step_filter(text: str) -> Callable[[int], bool]:
    """``--steps``: comma-separated steps and ranges, ``A-B`` (both included) or ``A-`` (A on), e.g. ``3-10,12``."""
    spans = []
    for item in text.split(","):
        first, dash, last = item.strip().partition("-")
        try:
            lo, hi = whole_number(first), (whole_number(last) if last else None) if dash else whole_number(first)
        except ValueError:
            raise AutoparError(f"--steps: expected steps and ranges such as 3-10,12 or 11-, got {item!r}") from None
        if lo < 1 or (hi is not None and hi < lo):
            raise AutoparError(f"--steps {item}: steps count from 1 and a range must not end before it starts")
        spans.append((lo, hi))
    return lambda step: any(lo <= step and (hi is None or step <= hi) for lo, hi in spans)


def _same_file(ref: Any, plan: str | None, source: str) -> bool:
    """Whether the ``plan`` entry of metrics file ``source`` names the file ``plan``."""
    if plan is None or not isinstance(ref, str):
        return False
    try:
        return plan_ref_path(ref, Path(source)).resolve() == Path(plan).resolve()
    except (OSError, RuntimeError):
        return False


def pick_run(segments: list[Segment], steps: str | None, source: str, plan: str | None = None
             ) -> tuple[Segment, str | None]:
    """The run of a metrics file to diagnose (:func:`planner.measured_runs.read_segments`): the one ``--steps`` falls
    in (its steps in the range; a range over two runs is an error), else the last run of ``--plan`` (``plan``)
    or, without one, the last run, with a note naming the others when there are several."""
    if steps:
        wanted = step_filter(steps)
        picked = [Segment(s.plan, [r for r in s.rows if wanted(r["step"])]) for s in segments]
        picked = [s for s in picked if s.rows]
        if not picked:
            raise AutoparError(f"metrics file {source} has no steps in {steps}")
        if len(picked) > 1:
            raise AutoparError(f"--steps {steps} spans {len(picked)} runs of metrics file {source} under different "
                               f"plans ({runs_text(picked)}); give --steps within one run")
        return picked[0], None
    if len(segments) == 1:
        return segments[0], None
    mine = [s for s in segments if _same_file(s.plan, plan, source)]
    chosen, which = (mine[-1], "the last of --plan") if mine else (segments[-1], "the last")
    return chosen, (f"note: metrics file {source} holds {len(segments)} runs under different plans "
                    f"({runs_text(segments)}); diagnosing {which} ({chosen.span}); pick another with --steps")


def diagnose_command(args: argparse.Namespace) -> int:
    """``autopar diagnose METRICS [--plan P] [--steps A-B] [--warmup N] [--threshold X] [--format json]``."""
    if not 1 < args.threshold < math.inf:
        raise AutoparError(f"--threshold must be a number above 1 (a ratio to the other ranks), got {args.threshold}")
    if args.steps is not None and not args.steps.strip():
        raise AutoparError("--steps is empty; give steps and ranges such as 3-10,12 or 11-, or leave it out")
    check_warmup(args.warmup)
    segments = read_segments(args.metrics)
    seg, note = pick_run(segments, args.steps, str(args.metrics), args.plan and str(args.plan))
    rows, ref = seg.rows, seg.plan
    warmup = args.warmup
    if args.steps:
        warmup = warmup or 0  # the range says which steps count
    if args.plan:
        plan, name = load_plan(args.plan), str(args.plan)
        try:
            check_same_run(str(args.metrics), rows, ref, plan, str(args.plan))
        except AutoparError as err:
            if len(segments) == 1 or args.steps:
                raise
            raise AutoparError(f"{err} (it holds {len(segments)} runs and this is {seg.span}: pick the steps of the "
                               "run --plan ran with --steps)") from None
    elif ref is not None:
        plan, name = resolve_plan(ref, Path(args.metrics), rows), str(ref if not isinstance(ref, dict) else "embedded")
    else:
        raise AutoparError(f"metrics file {args.metrics} does not say which plan it ran; pass --plan PLAN.json")
    d = diagnose(plan, rows, warmup, args.threshold, str(args.metrics), name)
    from planner.prediction import tuned_note

    tuned = tuned_note(plan.prediction if plan.prediction_is_current else None, name)
    note = "\n".join(x for x in (note, tuned, shared_cores_note(plan)) if x) or None
    if note:
        print(note, file=sys.stderr)  # stdout holds the diagnosis (one JSON object with --format json)
    if args.format == "json":
        print(json.dumps(d.to_json()))
        return 0
    con = console()
    for part in diagnosis_tables(d, plan.config.short()):
        con.print(part)
    return 0


def shared_cores_note(plan) -> str | None:
    """A note where the run put more CPU ranks on a node than its profile says the node has cores: the ranks took
    turns on them, so waits in collectives and sends, and a rank named slow, are the sharing's as much as the
    plan's."""
    c = plan.used_cluster
    if c.compute_slowdown <= 1:
        return None
    return (f"note: this run put {c.gpus_per_node} ranks on nodes of {c.gpu.cores} cores (its profile): they took "
            "turns on them, so the waits in collectives and sends, and ranks named slow, are the sharing's as much "
            f"as the plan's; diagnose a run of at most {c.gpu.cores} ranks a node to see the plan's own")
