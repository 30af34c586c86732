"""`autopar plan`: the search, its explanation, bands and ties, and the plan file."""

from __future__ import annotations

import argparse
import json
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.markup import escape

from cost_models.headroom import DEFAULT_FRACTION, headroom_for
from planner.commands.inputs import load_inputs, progress, spec_files
from planner.headroom import usable_text
from specs.errors import AutoparError
from specs.json_numbers import sig6
from specs.planfile import steps_problem


@dataclass
class Choice:
    """What `plan` says of the plans it found: why the best, each shown plan's calibration spread (log sd, the scale
    behind most of it), its step at balanced expert routing (None for a dense model or known routing), and how many
    plans are tied with the best."""

    reason: str
    spreads: list[tuple[float, str | None]]
    balanced: list[float | None]
    tied: int
    more_tied: bool  # every refined plan after the best is tied: ``tied`` is a lower bound
    calibrated: bool


def plan_command(args: argparse.Namespace) -> int:
    from planner.search import search
    from planner.space import NoPlan
    from specs.parallel import parse_plan_keys

    model, cluster = load_inputs(args)
    _check_options(args, model, cluster)
    fixed = parse_plan_keys(args.fix, "--fix")
    headroom = headroom_for(args.headroom, cluster.gpu.memory_GiB)  # (on node groups: on the smallest GPUs)
    try:
        res = search(model, cluster, args.global_batch, fixed=fixed, top=args.top, exhaustive=args.exhaustive,
                     headroom_GiB=args.headroom, progress=progress())
    except NoPlan as err:
        raise _too_many_gpus(err, args, model, cluster, fixed) from None
    search_info = {"candidates": res.candidates, "seconds": round(res.seconds, 3), "exhaustive": res.exhaustive,
                   "headroom_GiB": sig6(headroom)}
    if not res.plans:
        raise _no_plan(args, model, cluster, res, fixed, search_info)
    choice = _choose(args, model, cluster, res)
    fewer = _fewer_gpus(args, model, cluster, res, fixed)

    def verified() -> list[dict[str, Any]] | None:  # --verify's replay (the tables print the plan before it)
        if not args.verify:
            return None
        from planner.verify import memory_check
        from specs.planfile import make_plan

        return memory_check(make_plan(model, cluster, args.global_batch, res.plans[0].config), res.plans[0].estimate)

    if args.out:
        from planner.prediction import prediction_json
        from specs.planfile import TrainConfig, make_plan, save_plan

        best = res.plans[0]
        pred = prediction_json(best.estimate, best.config, choice.spreads[0][0], choice.calibrated,
                               choice.balanced[0])
        train = TrainConfig(steps=args.steps) if args.steps else TrainConfig()
        save_plan(make_plan(model, cluster, args.global_batch, best.config, pred, train), args.out)
    if args.format == "json":
        _print_json(res, choice, search_info, verified(), fewer)
    else:
        _print_tables(args, model, cluster, res, choice, verified, fewer)
    return 0


FEWER_GAIN = 0.02  # a subset of the GPUs is mentioned when its best plan is this much faster in tokens/s


def _fewer_gpus(args: argparse.Namespace, model: Any, cluster: Any, res: Any, fixed: dict[str, Any]
                ) -> dict[str, Any] | None:
    """Where the cluster's node count is no power of two, the best plan on fewer of its nodes when that is faster
    outright (fewer GPUs, more tokens/s: a count whose factors fit no good split, such as 560 nodes' 35, forces a deep
    or uneven pipeline or a poor data-parallel size), on the largest count below it of the two kinds that split
    well, 2^k and 3 x 2^k nodes (125 nodes: 64 or 96), whichever trains faster; else None."""
    from planner.search import search

    nodes = cluster.num_nodes
    whole_nodes = cluster.num_gpus == nodes * cluster.gpus_per_node
    if cluster.node_groups or nodes < 3 or nodes & (nodes - 1) == 0 or not whole_nodes:
        return None
    power = 1 << (nodes.bit_length() - 1)
    counts = [power, *([3 * power // 2] if 3 * power // 2 < nodes else [])]
    found = []
    for fewer in counts:
        try:
            sub = search(model, cluster.resized(nodes=fewer), args.global_batch, fixed=fixed, top=1,
                         headroom_GiB=args.headroom, refine_count=4)
        except AutoparError:  # (fixed keys that do not fit the smaller cluster)
            continue
        if sub.plans:
            found.append((sub.plans[0].estimate.tokens_per_s, fewer, sub.plans[0]))
    if not found:
        return None
    rate, fewer, best = max(found, key=lambda x: (x[0], -x[1]))
    if rate < (1 + FEWER_GAIN) * res.plans[0].estimate.tokens_per_s:
        return None
    return {"gpus": fewer * cluster.gpus_per_node, "nodes": fewer, "plan": best.config.short(),
            "parallel": best.config.to_dict(), "tokens_per_s": rate,
            "gain": rate / res.plans[0].estimate.tokens_per_s - 1}


def _fewer_text(fewer: dict[str, Any], cluster: Any) -> str:
    plan = fewer["plan"].split(" layers=")[0]  # (its layer split is in the plan it writes)
    return (f"on {fewer['gpus']:,} of the {cluster.num_gpus:,} GPUs ({fewer['nodes']} nodes) the best plan, {plan}, "
            f"gives {fewer['gain']:.0%} more tokens/s than the best on all {cluster.num_nodes} nodes, whose count "
            f"allows no better split: plan with --gpus {fewer['gpus']}")


def _check_options(args: argparse.Namespace, model: Any, cluster: Any) -> None:
    """One-line errors for options that cannot work, before the search."""
    if args.out:
        from specs.files import check_output_file
        from specs.planfile import is_plan_data

        check_output_file(args.out, "plan file", spec_files(args), replaces=is_plan_data)  # before the search
    if args.runnable:
        from specs.capabilities import model_problem, state_problem
        from specs.state import StateSpec

        problem = state_problem(StateSpec.default(cluster.precision))
        if problem:
            raise AutoparError(f"--runnable: cluster {cluster.name} computes in {cluster.precision}, and {problem}")
        problem = model_problem(model)
        if problem:
            raise AutoparError(f"--runnable: {problem}")
    if args.verify:
        from planner.verify import check_verifiable

        check_verifiable(model)
    if args.top < 1:
        raise AutoparError(f"--top must be at least 1, got {args.top}")
    if args.steps is not None and not args.out:
        raise AutoparError("--steps sets the training steps written into the plan file: give --out FILE with it")
    if args.steps is not None and steps_problem("--steps", args.steps):
        raise AutoparError(steps_problem("--steps", args.steps))


def _too_many_gpus(err: AutoparError, args: argparse.Namespace, model: Any, cluster: Any, fixed: dict[str, Any]
                   ) -> AutoparError:
    """``err`` (no configuration at all), with a GPU count to plan instead where one has plans: a cluster of a GPU
    count the batch and model do not split over (more than they can use, or of a factor such as 35) fails on a rule
    about the batch, whose advice alone misleads."""
    from planner.search import max_gpus_with_plans

    fewer = None if fixed else max_gpus_with_plans(model, cluster, args.global_batch, fixed)  # (fixed keys: the
    # error is about them)
    if fewer is None:
        return err
    return AutoparError(f"{err}; or plan another number of GPUs (with this batch a plan of {model.name} exists on "
                        f"{fewer:,}: --gpus {fewer})")


def _no_plan(args: argparse.Namespace, model: Any, cluster: Any, res: Any, fixed: dict[str, Any],
             search_info: dict[str, Any]) -> AutoparError:
    """The error when no plan fits: the usable memory, what the closest plan needs, and how many GPUs would do (the
    JSON output first, with ``--format json``)."""
    from planner.search import GROW_LIMIT, min_gpus_to_fit

    try:
        need, grow = min_gpus_to_fit(model, cluster, args.global_batch, fixed, args.headroom), ""
    except AutoparError as e:  # the cluster cannot grow: say why, not that no size fits
        need, grow = None, str(e)
    closest = res.closest
    msg = f"no plan fits in {usable_text(args.headroom, cluster)} on {cluster.num_gpus} GPUs"
    if args.headroom is None:
        msg += f" (less the default headroom, {DEFAULT_FRACTION:.0%} of each GPU; --headroom 0 uses it all)"
    if closest is not None:
        msg += f"; the closest ({closest.config.short()}) needs {closest.estimate.memory_GiB:.1f} GiB per GPU"
    odd = _seq_rules_out_cp(args, model, cluster, fixed)
    if odd:
        msg += f"; {odd}"
    if need:
        msg += f"; {'or ' if odd else ''}try --gpus {need}"
    elif grow:
        msg += f"; a larger cluster is not tried ({grow}): use GPUs with more memory or a profile that grows"
    else:
        msg += f"; no cluster size up to {GROW_LIMIT} GPUs fits: use GPUs with more memory"
    if fixed:
        msg += " or relax --fix"
    if args.format == "json":
        print(json.dumps({"plans": [], "search": search_info, "error": msg, "min_gpus": need,
                          "closest": closest.row() if closest else None}))
    return AutoparError(msg)


def _seq_rules_out_cp(args: argparse.Namespace, model: Any, cluster: Any, fixed: dict[str, Any]) -> str:
    """When the sequence length splits over no context-parallel size of the cluster (an odd ``--seq``), and a
    length a multiple of 256 near it plans: say so, as it is the length, not the memory, that rules the plans out."""
    from planner.search import search
    from specs.rules import cp_split_problem

    seq, n = model.seq_length, cluster.num_gpus
    sizes = [c for c in range(2, n + 1) if n % c == 0]
    if "cp" in fixed or seq < 256 or not sizes or not all(cp_split_problem(seq, c) for c in sizes):
        return ""
    near = -(-seq // 256) * 256
    if near == seq:
        return ""
    try:
        res = search(model.with_seq(near), cluster, args.global_batch, fixed=fixed, top=1,
                     headroom_GiB=args.headroom, refine_count=4)
    except AutoparError:  # (a length the model cannot take, say beyond its learned positions)
        return ""
    if not res.plans:
        return ""
    sp = " and, an odd length, sequence parallelism" if seq % 2 else ""
    return (f"sequence length {seq} rules out context parallelism ({cp_split_problem(seq, 2)}){sp}, which split a "
            f"long sequence's activations over GPUs: --seq {near} fits ({res.plans[0].config.short()})")


def _choose(args: argparse.Namespace, model: Any, cluster: Any, res: Any) -> Choice:
    """Why the best plan, the bands' spreads and balanced-routing steps, and the plans tied with the best (with the
    advice each calls for)."""
    from planner.calibrate import CALIBRATED_TIES, LOOSE_SPREAD, difference_spreads, spread_of, step_sensitivity
    from planner.explain import placement_reason, runner_up, why
    from planner.prediction import balanced_step_s
    from planner.uncertainty import Z95, sharded_rows, tie_margin, tied_with_best
    from specs.moe import DEFAULT_LOAD_IMBALANCE

    other = runner_up(res.ranked)
    reason = why(res.plans[0], other) if other else "It is the only plan that fits."
    if res.plans[0].config.placement is not None:
        reason = f"{placement_reason(res.plans[0], res.homogeneous, model.num_layers, res.ranked)} {reason}"
    steps = [p.estimate.step_time_s for p in res.ranked]  # all refined plans, not only the top shown
    fit = cluster.calibration  # a calibrated profile: each plan's sensitivity to its scales, worked out once
    grads = [step_sensitivity(model, cluster, p.config, args.global_batch)
             for p in res.ranked[:max(len(res.plans), CALIBRATED_TIES)]] if fit is not None else []
    spreads = [spread_of(g, fit) for g in grads[:len(res.plans)]] if fit is not None else [(0.0, None)] * len(
        res.plans)
    extra = difference_spreads(grads[:CALIBRATED_TIES], fit) if fit is not None else None
    balanced = [balanced_step_s(model, cluster, p.config, args.global_batch) for p in res.plans]
    tied, plain = tied_with_best(steps, extra), tied_with_best(steps)
    more_tied = tied > 0 and tied == len(steps) - 1  # the plans priced exactly ran out before the ties did
    if tied:
        within = (f"within {tie_margin():.1%} of it, inside the model's ranking uncertainty" if tied == plain else
                  "close enough to it that the model's ranking uncertainty and what the calibration left unpinned "
                  "cannot order them")
        count = f"{tied} or more plans are" if more_tied else f"{tied} plan{'s are' if tied > 1 else ' is'}"
        reason += f" The next {count} {within}: `{_tune_line(args, cluster.num_nodes > 1)}` measures the best of them."
    best = res.plans[0].config
    if best.zero >= 2 and best.dp * best.cp > 1 and fit is None and not sharded_rows():
        reason += (f" No run behind the bands sharded gradients or parameters as ZeRO-{best.zero} does: this plan's "
                   "band is that of plans that did not, and its data-parallel traffic hides under its compute only "
                   "if overlapped as priced; `autopar tune` measures it.")
    if spreads[0][0] > LOOSE_SPREAD:
        reason += (f" The calibrated profile's runs leave this plan's step time uncertain (x/"
                   f"{math.exp(Z95 * spreads[0][0]):.2f} at 95%, mostly its {spreads[0][1]} scale, which they "
                   "barely exercised): measure it (`autopar tune`) or calibrate with a run like it.")
    if balanced[0] is not None:
        reason += (f" The experts' load imbalance is not known, so the plans are priced with the busiest rank at "
                   f"{DEFAULT_LOAD_IMBALANCE:g}x the mean (memory too) and their bands reach down to balanced "
                   f"routing ({balanced[0]:.4g} s for this one); set moe.load_imbalance if you know it.")
    return Choice(reason, spreads, balanced, tied, more_tied, fit is not None)


def _tune_line(args: argparse.Namespace, nodes: bool) -> str:
    """The `autopar tune` command that measures what this `autopar plan` command planned (on several ``nodes``, with
    the folder every node shares, which tune needs there)."""
    import shlex

    line = ["autopar", "tune", "--model", args.model]
    for flag, value in (("--cluster", args.cluster), ("--gpus", args.gpus), ("--nodes", args.nodes),
                        ("--seq", args.seq), ("--global-batch", args.global_batch), ("--fix", args.fix or None),
                        ("--headroom", args.headroom)):
        line += [flag, f"{value:g}" if isinstance(value, float) else str(value)] if value is not None else []
    line += ["--allow-cross-node-tp"] if args.allow_cross_node_tp else []
    return " ".join(shlex.quote(x) for x in line) + (" --dir SHARED_FOLDER" if nodes else "")


def _warning(res: Any) -> str | None:
    from planner.headroom import memory_warning

    best = res.plans[0].estimate
    return memory_warning(best.stage_memory_GiB, best.stage_capacity_GiB)


def _print_json(res: Any, choice: Choice, search_info: dict[str, Any], checked: Any,
                fewer: dict[str, Any] | None) -> None:
    from planner.prediction import prediction_json
    from planner.uncertainty import ranking_sigma, tie_margin
    from specs.json_numbers import rounded

    rows = [prediction_json(p.estimate, p.config, spread, choice.calibrated, low)
            for p, (spread, _), low in zip(res.plans, choice.spreads, choice.balanced)]
    baseline = {"homogeneous_baseline": res.homogeneous.row()} if res.homogeneous is not None else {}
    warning = _warning(res)
    print(json.dumps({"plans": rows, "search": search_info, "why": choice.reason, **baseline,
                      "uncertainty": rounded({"ranking_sigma": ranking_sigma(), "tie_margin": tie_margin(),
                                              "tied_with_best": choice.tied, "tied_more": choice.more_tied}),
                      "warnings": [warning] if warning else [],
                      **({"fewer_gpus": rounded(fewer)} if fewer is not None else {}),
                      **({"memory_replay": checked} if checked is not None else {})}))


def _print_tables(args: argparse.Namespace, model: Any, cluster: Any, res: Any, choice: Choice,
                  verified: Callable[[], Any], fewer: dict[str, Any] | None) -> None:
    from planner.report import console, estimate_tables, memory_check_table, plans_table, print_inputs
    from planner.uncertainty import step_band

    con = console()
    print_inputs(con, model, cluster)
    con.print(f"searched {res.candidates:,} configurations in {res.seconds:.2f} s "
              f"(global batch {args.global_batch}{', exhaustive' if res.exhaustive else ''})")
    con.print(plans_table([{**p.row(), "band": step_band(p.config.pp, p.estimate.step_time_s, spread, low)}
                           for p, (spread, _), low in zip(res.plans, choice.spreads, choice.balanced)],
                          f"top {len(res.plans)} plans" if len(res.plans) > 1 else "the best plan"))
    con.print(f"[bold]why:[/bold] {escape(choice.reason)}")
    if fewer is not None:
        con.print(f"[bold]fewer GPUs:[/bold] {escape(_fewer_text(fewer, cluster))}")
    for tab in estimate_tables(res.plans[0].estimate, "best plan")[1:]:
        con.print(tab)
    checked = verified()  # (its replay may take minutes on a large model: the plan is on the screen by then)
    if checked is not None:
        con.print(memory_check_table(checked))
    con.print(escape(f"best plan keys: {res.plans[0].config.as_keys()}"), soft_wrap=True)  # copied whole into --fix
    warning = _warning(res)
    if warning:
        con.print(f"[yellow]memory:[/yellow] {escape(warning)}")
    if args.out:
        from specs.capabilities import execution_problem
        from specs.state import StateSpec

        problem = execution_problem(model, StateSpec.default(cluster.precision))
        how = (f"autopar run cannot execute it: {problem}" if problem
               else f"train it with: autopar run {shlex.quote(args.out)}")
        con.print(escape(f"wrote {args.out}  ({how})"), soft_wrap=True)
