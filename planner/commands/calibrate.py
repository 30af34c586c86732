"""`autopar calibrate m1.jsonl [m2.jsonl ...] --out updated.yaml`: the profile fitted to measured runs
(planner/calibrate.py), each run's error before and after, the calibrated profile written."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from planner.calibrate import (
    PARAMS,
    bound_warning,
    calibrated_profile_text,
    ceiling_warning,
    fit_scales,
    fitted_text,
    hardware_mismatch,
    predict,
    refitted_problem,
    relative_errors,
    same_hardware,
    source_header,
    total_scales,
    worse_fit_warning,
)
from planner.measured_runs import check_warmup, load_runs, named_plan_files
from specs.cluster_loading import check_profile_out, load_cluster
from specs.errors import AutoparError
from specs.files import write_text_atomic


def calibrate_command(args: argparse.Namespace) -> int:
    """The CLI entry point (args: metrics, out; optional plan, cluster, warmup, fit)."""
    given = getattr(args, "fit", None)
    params = tuple(p.strip() for p in (",".join(PARAMS) if given is None else given).split(",") if p.strip())
    if not params:
        raise AutoparError(f"--fit is empty; name the scales to fit, from {', '.join(PARAMS)} (leave --fit out for "
                           "all)")
    bad = [p for p in params if p not in PARAMS]
    if bad:
        raise AutoparError(f"--fit: unknown parameter '{bad[0]}'; choose from {', '.join(PARAMS)}")
    twice = sorted({p for p in params if params.count(p) > 1})
    if twice:
        raise AutoparError(f"--fit: '{twice[0]}' given twice; name each parameter once")
    warmup = getattr(args, "warmup", None)
    check_warmup(warmup)
    plans = getattr(args, "plan", None) or []
    named = [*(plans if isinstance(plans, list) else [plans]), *named_plan_files(list(args.metrics))]
    check_profile_out(args.out, "calibrated profile", {**{f"metrics file {m}": m for m in args.metrics},
                                                       **{f"plan file {p}": p for p in named}})
    runs = load_runs(list(args.metrics), getattr(args, "plan", None), warmup)
    cluster_ref = getattr(args, "cluster", None)
    if cluster_ref:
        base = load_cluster(cluster_ref)
    else:  # the hardware the plans carry, without a one-command permission like --allow-cross-node-tp
        base = runs[0].plan.cluster.model_copy(update={"tp_across_nodes": False})
        other = {r.plan.cluster.gpu.name for r in runs} - {base.gpu.name}
        if other:
            raise AutoparError(f"the runs were planned on different GPUs ({base.gpu.name}, "
                               f"{', '.join(sorted(other))}); pass --cluster PROFILE to say which to calibrate")
        odd = next((r for r in runs if not same_hardware(r.plan.cluster, base)), None)
        if odd is not None:
            raise AutoparError(f"the runs were planned on different profiles of {base.gpu.name} ({runs[0].source}: "
                               f"{base.name}, {odd.source}: {odd.plan.cluster.name}, which differ in more than their "
                               "size); pass --cluster PROFILE to say which to calibrate")
    again = refitted_problem(base, runs, cluster_ref)
    if again:
        raise AutoparError(again)
    before = predict(runs, base, {})
    fit = fit_scales(runs, base, params)
    after = predict(runs, base, fit.scales)
    total = total_scales(base, fit)  # (on a profile calibrated before: with what earlier fits applied)
    mismatch = hardware_mismatch(total, runs, after, cluster_ref, base)
    if mismatch:
        raise AutoparError(mismatch)
    e0, e1 = relative_errors(before, runs), relative_errors(after, runs)
    for r, b, a, eb, ea in zip(runs, before, after, e0, e1):
        steps = f"{r.steps} step{'s' if r.steps != 1 else ''}"
        print(f"{r.source}: {r.plan.config.short()} on {r.plan.cluster.num_gpus} GPU(s): measured {r.measured_s:.4g} s "
              f"(median of {steps}), predicted {b:.4g} s ({100 * eb:+.1f}%) -> {a:.4g} s ({100 * ea:+.1f}%)")
    fitted = fitted_text(fit.model_copy(update={"scales": total}))
    mean0, mean1 = float(np.mean(np.abs(e0))), float(np.mean(np.abs(e1)))
    print(f"fitted scales (x/ their 95% spread): {fitted}")
    ceiling = ceiling_warning(fit, base)
    for warning in (bound_warning(total, runs=runs), ceiling):
        if warning:
            print(warning, file=sys.stderr)
    print(f"mean |error| {100 * mean0:.1f}% before, {100 * mean1:.1f}% after calibration ({len(runs)} run(s))")
    worse = worse_fit_warning(mean0, mean1)
    if worse:
        print(worse, file=sys.stderr)
    text = calibrated_profile_text(base, fit, "autopar calibrate", f"{len(runs)} run(s)",
                                   [f"Mean |predicted/measured - 1|: {100 * mean0:.1f}% before, "
                                    f"{100 * mean1:.1f}% after.", *(w for w in (ceiling, worse) if w),
                                    *source_header(cluster_ref)])
    try:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.out, text)
    except OSError as err:
        raise AutoparError(f"cannot write {args.out}: {err.strerror}") from None
    print(f"wrote {args.out}")
    return 0
