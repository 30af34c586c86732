"""`autopar estimate`: one plan priced, with its band and (--verify) its memory replayed."""

from __future__ import annotations

import argparse
import json
from typing import Any

from planner.commands.inputs import load_inputs


def estimate_command(args: argparse.Namespace) -> int:
    """`autopar estimate`: one plan's step time, throughput, MFU and memory."""
    from cost_models.step import estimate
    from planner.calibrate import LOOSE_SPREAD, calibration_spread
    from planner.prediction import balanced_step_s, prediction_json
    from planner.space import unplaced
    from planner.uncertainty import band as uncertainty_band
    from planner.uncertainty import step_band
    from specs.errors import AutoparError
    from specs.parallel import config_from_keys, parse_plan_keys

    keys = parse_plan_keys(args.plan)
    if not keys:  # an unset shell variable, most likely: not "price the defaults" without a word
        raise AutoparError('--plan is empty; give the plan to price, e.g. --plan "tp=2,pp=2,mbs=1" (keys left out '
                           'take their defaults: --plan "mbs=1" prices pure data parallelism)')
    model, cluster = load_inputs(args)
    keys, flat = unplaced(keys, cluster, "--plan")  # (node groups priced as one homogeneous cluster at the slowest)
    cfg = config_from_keys(keys, cluster.num_gpus)
    est = estimate(model, cluster, cfg, args.global_batch,
                   headroom_GiB=args.headroom)
    spread, loose = calibration_spread(model, cluster, cfg, args.global_batch)
    balanced = balanced_step_s(model, cluster, cfg, args.global_batch)
    checked = None
    if args.verify:
        from planner.verify import memory_check
        from specs.planfile import make_plan

        checked = memory_check(make_plan(model, cluster, args.global_batch, cfg), est)
    if args.format == "json":
        out = prediction_json(est, cfg, spread, cluster.calibration is not None, balanced)
        if checked is not None:
            out["memory_replay"] = checked
        print(json.dumps(out))
        return 0
    from planner.report import console, estimate_tables, fmt_range, memory_check_table, print_inputs

    con = console()
    print_inputs(con, model, cluster)
    con.print(f"plan    {cfg.short()}  (global batch {args.global_batch}, "
              f"{cfg.microbatches(args.global_batch)} micro-batches per step)")
    if flat:
        con.print(f"note    placement=none: priced as if {cluster.name} were homogeneous at its slowest GPU and link")
    band = step_band(cfg.pp, est.step_time_s, spread, balanced)
    unpinned = f"; mostly the calibration's unpinned {loose} scale" if spread > LOOSE_SPREAD else ""
    if balanced is not None:
        unpinned += (f"; its low end from balanced routing, {balanced:.4g} s predicted: the experts' load imbalance "
                     f"is not known (moe.load_imbalance sets it)")
    if cluster.backend == "gloo" and cluster.calibration is None:  # the bands' runs are GPU runs
        unpinned += ("; measured on GPUs: CPU ranks, whose timings vary with what else the machine runs, fall "
                     "outside it more often (`autopar tune` measures them)")
    held = f"{uncertainty_band(cfg.pp > 1).coverage:.0%}"
    con.print(f"band    {fmt_range(*band)} a step (holds {held} of runs like the validation's, "
              f"docs/cost_model.md \"How sure it is\"{unpinned})")
    for tab in estimate_tables(est, "estimate"):
        con.print(tab)
    if not est.fits:
        con.print(f"fits    no: {_overflow(est, args.headroom, cfg.pp)}")
    if checked is not None:
        con.print(memory_check_table(checked))
    return 0



def _overflow(est: Any, headroom_GiB: float | None, pp: int) -> str:
    """Why a plan does not fit, in words: the fullest stage against what its GPU may hold (its memory less the
    headroom: --headroom, or the default share)."""
    from cost_models.headroom import headroom_for

    stage, need, gpu = est.fullest_stage
    keep = headroom_for(headroom_GiB, gpu)
    where = f" on pipeline stage {stage}" if pp > 1 else ""
    how = "--headroom" if headroom_GiB is not None else "the default headroom; --headroom sets another"
    return (f"{need:.1f} GiB per GPU{where}, above the {gpu - keep:.3g} GiB a plan may use ({gpu:g} GiB less "
            f"{keep:.3g} GiB kept free: {how}); add zero, recompute or pipeline stages, or plan with `autopar plan`")
