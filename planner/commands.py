"""The estimate, plan, whatif and run commands: argument handling and output (the work is in the cost model,
search, whatif and the runtime)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from rich.markup import escape

from planner.headroom import headroom_for
from specs.errors import ERROR_PREFIX, AutoparError

MAX_GLOBAL_BATCH = 1 << 20  # sequences per step: hundreds of times the largest published training batches


def load_inputs(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model and the (resized) cluster of an estimate / plan / whatif command, with the common options checked."""
    from specs.cluster import load_cluster
    from specs.model import size_problem
    from specs.model_loading import load_model

    model = load_model(args.model, args.seq)
    cluster = load_cluster(args.cluster, gpus=args.gpus, nodes=args.nodes)
    if args.allow_cross_node_tp:
        cluster = cluster.model_copy(update={"tp_across_nodes": True})
    b = args.global_batch
    problem = None if b is None else size_problem("--global-batch", b, MAX_GLOBAL_BATCH)
    if problem:
        raise AutoparError(problem)
    h = args.headroom
    if h is not None and not (h == h and 0 <= h < cluster.gpu.memory_GiB):  # h == h: not NaN
        raise AutoparError(f"--headroom must be between 0 and the GPU's {cluster.gpu.memory_GiB:g} GiB, got {h}")
    return model, cluster


def spec_files(args: argparse.Namespace) -> dict[str, str | None]:
    """The model spec and cluster profile a command reads, by what they are (for outputs not to overwrite)."""
    return {"model spec": args.model, "cluster profile": args.cluster}


def estimate_command(args: argparse.Namespace) -> int:
    """`autopar estimate`: one plan's step time, throughput, MFU and memory."""
    from cost_models.step import estimate
    from planner.calibrate import LOOSE_SPREAD, calibration_spread
    from planner.prediction import prediction_json
    from planner.uncertainty import band as uncertainty_band
    from planner.uncertainty import step_band
    from specs.parallel import config_from_keys, parse_plan_keys

    model, cluster = load_inputs(args)
    cfg = config_from_keys(parse_plan_keys(args.plan), cluster.num_gpus)
    est = estimate(model, cluster, cfg, args.global_batch,
                   headroom_GiB=headroom_for(args.headroom, cluster.gpu.memory_GiB))
    spread, loose = calibration_spread(model, cluster, cfg, args.global_batch)
    checked = None
    if args.verify:
        from planner.verify import memory_check
        from specs.planfile import make_plan

        checked = memory_check(make_plan(model, cluster, args.global_batch, cfg), est)
    if args.format == "json":
        out = prediction_json(est, cfg, spread, cluster.calibration is not None)
        if checked is not None:
            out["memory_replay"] = checked
        print(json.dumps(out))
        return 0
    from planner.report import console, estimate_tables, memory_check_table, print_inputs

    con = console()
    print_inputs(con, model, cluster)
    con.print(f"plan    {cfg.short()}  (global batch {args.global_batch}, "
              f"{cfg.microbatches(args.global_batch)} micro-batches per step)")
    band = step_band(cfg.pp, est.step_time_s, spread)
    unpinned = f"; mostly the calibration's unpinned {loose} scale" if spread > LOOSE_SPREAD else ""
    held = f"{uncertainty_band(cfg.pp > 1).coverage:.0%}"
    con.print(f"band    {band[0]:.4g} .. {band[1]:.4g} s a step (holds {held} of runs like the validation's, "
              f"docs/cost_model.md \"How sure it is\"{unpinned})")
    for tab in estimate_tables(est, "estimate"):
        con.print(tab)
    if checked is not None:
        con.print(memory_check_table(checked))
    return 0


def progress_line(done: int, total: int, elapsed_s: float) -> str:
    """``priced 1,200/17,709 candidates, about 14 s left`` (the rate so far carried to the end)."""
    line = f"priced {done:,}/{total:,} candidates"
    if 0 < done < total and elapsed_s > 0:
        left = elapsed_s / done * (total - done)
        line += f", about {left:.0f} s left" if left < 120 else f", about {left / 60:.0f} min left"
    return line


def _progress(fmt: str):
    """A progress callback printing to stderr for long work (never on stdout, so JSON stays clean)."""
    if not sys.stderr.isatty():
        return None
    start = time.perf_counter()

    def report(done: int, total: int) -> None:
        text = progress_line(done, total, time.perf_counter() - start)
        print(f"\r  {text:<60}", end="", file=sys.stderr, flush=True)

    return report


def plan_command(args: argparse.Namespace) -> int:
    from planner.calibrate import CALIBRATED_TIES, LOOSE_SPREAD, difference_spreads, spread_of, step_sensitivity
    from planner.explain import placement_reason, runner_up, why
    from planner.headroom import memory_warning
    from planner.prediction import prediction_json
    from planner.search import GROW_LIMIT, min_gpus_to_fit, search
    from planner.uncertainty import Z95, ranking_sigma, step_band, tie_margin, tied_with_best
    from specs.parallel import parse_plan_keys

    model, cluster = load_inputs(args)
    if args.out:
        from specs.files import check_output_file

        check_output_file(args.out, "plan file", spec_files(args))  # before the search, not after
    fixed = parse_plan_keys(args.fix, "--fix")
    if args.runnable:
        from specs.capabilities import model_problem, state_problem
        from specs.state import StateSpec

        problem = state_problem(StateSpec.default(cluster.precision))
        if problem:
            raise AutoparError(f"--runnable: cluster {cluster.name} computes in {cluster.precision}, and {problem}")
        problem = model_problem(model)
        if problem:
            raise AutoparError(f"--runnable: {problem}")
    if args.top < 1:
        raise AutoparError(f"--top must be at least 1, got {args.top}")
    if args.steps is not None and not 1 <= args.steps < 2**63:
        raise AutoparError(f"--steps must be at least 1 (and below 2^63), got {args.steps}")
    headroom = headroom_for(args.headroom, cluster.gpu.memory_GiB)
    res = search(model, cluster, args.global_batch, fixed=fixed, top=args.top, exhaustive=args.exhaustive,
                 headroom_GiB=headroom, progress=_progress(args.format))
    search_info = {"candidates": res.candidates, "seconds": round(res.seconds, 3), "exhaustive": res.exhaustive,
                   "headroom_GiB": headroom}
    if not res.plans:
        try:
            need, grow = min_gpus_to_fit(model, cluster, args.global_batch, fixed, headroom), ""
        except AutoparError as e:  # the cluster cannot grow: say why, not that no size fits
            need, grow = None, str(e)
        closest = res.closest
        msg = (f"no plan fits in {cluster.gpu.memory_GiB - headroom:g} GiB per GPU on {cluster.num_gpus} GPUs")
        if args.headroom is None:
            msg += f" (its {cluster.gpu.memory_GiB:g} GiB less the default headroom; --headroom 0 uses it all)"
        if closest is not None:
            msg += f"; the closest ({closest.config.short()}) needs {closest.estimate.memory_GiB:.1f} GiB per GPU"
        if need:
            msg += f"; try --gpus {need}"
        elif grow:
            msg += f"; a larger cluster is not tried ({grow}): use GPUs with more memory or a profile that grows"
        else:
            msg += f"; no cluster size up to {GROW_LIMIT} GPUs fits: use GPUs with more memory"
        if fixed:
            msg += " or relax --fix"
        if args.format == "json":
            print(json.dumps({"plans": [], "search": search_info, "error": msg, "min_gpus": need,
                              "closest": closest.row() if closest else None}))
        raise AutoparError(msg)
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
    tied, plain = tied_with_best(steps, extra), tied_with_best(steps)
    if tied:
        within = (f"within {tie_margin():.1%} of it, inside the model's ranking uncertainty" if tied == plain else
                  "close enough to it that the model's ranking uncertainty and what the calibration left unpinned "
                  "cannot order them")
        reason += (f" The next {tied} plan{'s are' if tied > 1 else ' is'} {within}: `autopar tune` with the same "
                   "--model, --cluster, --global-batch and --fix measures the best of them (--trials, default 3).")
    if spreads[0][0] > LOOSE_SPREAD:
        reason += (f" The calibrated profile's runs leave this plan's step time uncertain (x/"
                   f"{math.exp(Z95 * spreads[0][0]):.2f} at 95%, mostly its {spreads[0][1]} scale, which they "
                   "barely exercised): measure it (`autopar tune`) or calibrate with a run like it.")
    best = res.plans[0].estimate
    warning = memory_warning(best.stage_memory_GiB, best.stage_capacity_GiB)
    checked = None
    if args.verify:
        from planner.verify import memory_check
        from specs.planfile import make_plan

        checked = memory_check(make_plan(model, cluster, args.global_batch, res.plans[0].config),
                               res.plans[0].estimate)
    if args.out:
        from specs.planfile import TrainConfig, make_plan, save_plan

        best = res.plans[0]
        pred = prediction_json(best.estimate, best.config, spreads[0][0], fit is not None)
        train = TrainConfig(steps=args.steps) if args.steps else TrainConfig()
        save_plan(make_plan(model, cluster, args.global_batch, best.config, pred, train), args.out)
    if args.format == "json":
        rows = [prediction_json(p.estimate, p.config, spread, fit is not None)
                for p, (spread, _) in zip(res.plans, spreads)]
        baseline = {"homogeneous_baseline": res.homogeneous.row()} if res.homogeneous is not None else {}
        print(json.dumps({"plans": rows, "search": search_info, "why": reason, **baseline,
                          "uncertainty": {"ranking_sigma": ranking_sigma(), "tie_margin": tie_margin(),
                                          "tied_with_best": tied},
                          "warnings": [warning] if warning else [],
                          **({"memory_replay": checked} if checked is not None else {})}))
        return 0
    from planner.report import console, estimate_tables, memory_check_table, plans_table, print_inputs

    con = console()
    print_inputs(con, model, cluster)
    con.print(f"searched {res.candidates:,} configurations in {res.seconds:.2f} s "
              f"(global batch {args.global_batch}{', exhaustive' if res.exhaustive else ''})")
    con.print(plans_table([{**p.row(), "band": step_band(p.config.pp, p.estimate.step_time_s, spread)}
                           for p, (spread, _) in zip(res.plans, spreads)],
                          f"top {len(res.plans)} plans"))
    con.print(f"[bold]why:[/bold] {escape(reason)}")
    for tab in estimate_tables(res.plans[0].estimate, "best plan")[1:]:
        con.print(tab)
    if checked is not None:
        con.print(memory_check_table(checked))
    con.print(f"best plan keys: {res.plans[0].config.as_keys()}")
    if warning:
        con.print(f"[yellow]memory:[/yellow] {escape(warning)}")
    if args.out:
        from specs.capabilities import execution_problem
        from specs.state import StateSpec

        problem = execution_problem(model, StateSpec.default(cluster.precision))
        how = f"autopar run cannot execute it: {problem}" if problem else f"train it with: autopar run {args.out}"
        con.print(escape(f"wrote {args.out}  ({how})"))
    return 0


def whatif_command(args: argparse.Namespace) -> int:
    from planner.whatif import parse_vary, sweep
    from specs.parallel import parse_plan_keys

    model, cluster = load_inputs(args)
    if args.plot:
        from planner.whatif_plot import plot_file

        plot_file(args.plot, spec_files(args))  # a bad path fails now, not after the sweep
    key, values = parse_vary(args.vary)
    given = "--nodes" if args.nodes else "--gpus" if args.gpus and key == "gpus" else None
    if key in ("gpus", "nodes") and given:  # (--gpus N with --vary nodes: nodes of N GPUs)
        raise AutoparError(f"--vary {key} sets the cluster's size at each point; leave out {given}")
    fixed = parse_plan_keys(args.fix, "--fix")
    more = parse_plan_keys(args.compare, "--compare") if args.compare else {}
    curves: dict[str, Any] = {"best": sweep(model, cluster, args.global_batch, key, values, fixed, args.headroom)}
    if args.compare:
        curves[args.compare] = sweep(model, cluster, args.global_batch, key, values, fixed, args.headroom, more)
    if not any(p.get("tokens_per_s") for p in curves["best"]):  # a --compare curve may be all errors
        first = curves["best"][0]
        raise AutoparError(f"no point of the sweep has a plan; at {key}={first['value']}: {first['error']}")
    from planner.whatif import normalize

    normalize(curves, key)
    plot_path = None
    if args.plot:
        from planner.whatif_plot import plot

        plot_path = plot(curves, key, model.name, cluster.name, args.plot)
    if args.format == "json":
        print(json.dumps({"vary": key, "values": values, "curves": curves}))
        return 0
    if args.format == "csv":
        import csv

        from planner.whatif import csv_header, csv_rows

        w = csv.writer(sys.stdout)
        w.writerow(csv_header(key))
        w.writerows(csv_rows(curves, key))
        return 0
    from planner.report import console, print_inputs, whatif_table

    con = console()
    print_inputs(con, model, cluster)
    for name, pts in curves.items():
        con.print(whatif_table(pts, key, "best plan per point" if name == "best" else f"{name}: best plan per point"))
    for note in dict.fromkeys(p["note"] for p in curves["best"] if p.get("note")):
        con.print(f"[yellow]note:[/yellow] {escape(note)}")
    if plot_path:
        con.print(escape(f"wrote {plot_path}"))
    return 0


def run_command(args: argparse.Namespace) -> int:
    try:
        from runtime.data import cache_dir
        from runtime.launch import launch
        from runtime.options import launch_options
    except ImportError as err:
        raise AutoparError(f"`autopar run` needs PyTorch: pip install torch ({err.name} is missing)") from None
    plan_path = args.plan
    if args.replan:
        plan_path = _replan(args)
    elif args.gpus is not None:
        raise AutoparError("--gpus is for --replan (a plan file fixes its own GPU count)")
    if plan_path is None:
        plan_path = str(_plan_default(cache_dir() / "default-plan.json", "its command" if args.dry_run else None))
    fresh = _fresh_prediction(plan_path)
    return launch(plan_path=plan_path, predicted_step_s=fresh and fresh.step_time_s,
                  predicted_memory_GiB=fresh and fresh.memory_GiB, **launch_options(args))


def _full_size(cluster: Any) -> Any:
    """A plan's cluster as bundled, when it is a bundled one resized below a node (``plan --gpus 2`` keeps a node
    of 2): re-planning for more GPUs needs the node's real size. Any other cluster as the plan holds it."""
    from specs.cluster import list_clusters, load_cluster

    if cluster.name in list_clusters() and cluster.num_nodes == 1:
        bundled = load_cluster(cluster.name).model_copy(update={"tp_across_nodes": cluster.tp_across_nodes})
        if bundled.gpus_per_node > cluster.gpus_per_node and bundled.resized(gpus=cluster.num_gpus) == cluster:
            return bundled
    return cluster


def _replan(args: argparse.Namespace) -> str:
    """``run --resume --replan --gpus N``: the fastest plan the runtime runs for the checkpoint's model and global
    batch on N GPUs of its cluster, written beside the checkpoints; returns its path."""
    from planner.prediction import plan_prediction
    from planner.search import search
    from planner.space import NoPlan
    from runtime.checkpoint import saved_plan
    from specs.planfile import make_plan, save_plan

    if args.gpus is not None and args.gpus < 1:
        raise AutoparError(f"--gpus must be at least 1, got {args.gpus}")
    if not (args.resume and args.checkpoint_dir and args.gpus):
        raise AutoparError("--replan needs --resume, --checkpoint-dir and --gpus N (the GPUs to plan for)")
    if args.plan is not None:
        raise AutoparError("--replan plans again from the checkpoint's own plan: leave out the plan file")
    old = saved_plan(Path(args.checkpoint_dir))
    cluster = _full_size(old.cluster).resized(gpus=args.gpus)
    try:
        res = search(old.model, cluster, old.global_batch, top=1,
                     headroom_GiB=headroom_for(None, cluster.gpu.memory_GiB), state=old.state)
    except NoPlan as err:  # its advice may be to change what a resumed run keeps (the global batch)
        raise AutoparError(f"no plan of {old.model.name} with the checkpoint's global batch {old.global_batch} (a "
                           f"resumed run keeps it) runs on {args.gpus} GPUs ({err.problem or err}); re-plan for "
                           "another number of GPUs") from None
    if not res.plans:
        raise AutoparError(f"no plan of {old.model.name} with global batch {old.global_batch} fits on {args.gpus} "
                           f"GPUs of {cluster.name}; re-plan for more GPUs")
    best = res.plans[0]
    path = Path(args.checkpoint_dir) / f"replanned-{args.gpus}gpus.json"
    pred = plan_prediction(old.model, cluster, best.config, best.estimate, old.global_batch, old.state)
    save_plan(make_plan(old.model, cluster, old.global_batch, best.config, pred, old.train, old.state), path)
    print(f"autopar: re-planned for {args.gpus} GPUs: {best.config.short()} (was {old.config.short()} on "
          f"{old.world_size}), {best.estimate.step_time_s:.4g} s a step predicted; wrote {path}", flush=True)
    return str(path)


def _hf_weights() -> Any:
    try:
        from runtime import hf_weights
    except ImportError as err:
        raise AutoparError(f"Hugging Face weights need PyTorch and safetensors: pip install torch safetensors "
                           f"({err.name} is missing)") from None
    return hf_weights


def import_hf_command(args: argparse.Namespace) -> int:
    from specs.planfile import load_plan

    hf = _hf_weights()
    plan = load_plan(args.plan)
    ck = hf.import_hf(Path(args.hf_dir), plan, Path(args.out))
    print(f"wrote {ck} (step 0 of {args.plan}); train from it: autopar run {args.plan} --checkpoint-dir "
          f"{args.out} --resume")
    return 0


def export_hf_command(args: argparse.Namespace) -> int:
    out = _hf_weights().export_hf(Path(args.checkpoint_dir), Path(args.out))
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    return 0


def _fresh_prediction(plan_path: str) -> Any:
    """The estimate of a plan file edited by hand since its prediction (its keys, batch or sequence changed),
    made again, with a note; None when the plan's own prediction holds."""
    from cost_models.step import estimate
    from specs.planfile import load_plan

    plan = load_plan(plan_path)
    if plan.prediction_is_current or not plan.prediction:
        return None
    est = estimate(plan.model, plan.cluster, plan.config, plan.global_batch, state=plan.state)
    print(f"autopar: {plan_path} was edited since its prediction ({plan.prediction.get('step_time_s', 0):.4g} s "
          f"a step); re-estimated for {plan.config.short()}: {est.step_time_s:.4g} s", flush=True)
    return est


def _plan_default(path, then: str | None = None) -> str:
    """Plan the default job (tiny Llama, 4 CPU ranks), print the plan, write it to ``path``; ``then`` says what
    follows (default: training it)."""
    from planner.defaults import CLUSTER, GLOBAL_BATCH, MODEL, RANKS, default_plan
    from planner.explain import runner_up, why
    from planner.report import console, estimate_tables, plans_table

    out, res = default_plan(path)
    con = console()
    con.print(f"autopar: no plan given: planning the {MODEL} model for {RANKS} {CLUSTER} ranks "
              f"(global batch {GLOBAL_BATCH}); {res.candidates:,} configurations priced in {res.seconds:.2f} s")
    con.print(plans_table([p.row() for p in res.plans], "plans"))
    other = runner_up(res.ranked)
    if other:
        con.print(f"[bold]why:[/bold] {escape(why(res.plans[0], other))}")
    con.print(estimate_tables(res.plans[0].estimate, "")[1])
    if then is not None:
        con.print(f"autopar: wrote {escape(str(out))}; {then}:")
        return out
    con.print(f"autopar: wrote {escape(str(out))}; training it (CPU timings are noisy; the bundled cpu-gloo profile "
              "is rough, `autopar profile` measures this machine)")
    return out


def tune_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from planner.calibrate import bound_warning
    from planner.tune import check_trial_options, default_out_dir, tune, written_files
    from specs.files import check_output_dir, check_output_file
    from specs.parallel import parse_plan_keys
    from specs.planfile import TrainConfig, load_plan, save_plan

    model, cluster = load_inputs(args)
    check_trial_options(args.trials, args.steps, args.warmup, args.time_limit)
    if args.out:
        check_output_file(args.out, "plan file", {**spec_files(args), "--data file": args.data})
    if args.dir:
        check_output_dir(args.dir, "trial folder")
        for what, path in written_files(Path(args.dir), args.trials).items():  # never over one of the inputs
            check_output_file(path, f"tune's {what}", {**spec_files(args), "--data file": args.data},
                              "give another --dir")
    if args.data:
        from runtime.data import TokenData

        TokenData(args.data, model.seq_length, model.vocab_size, 0)  # a bad token file: one line now, not per trial
    out_dir = Path(args.dir) if args.dir else default_out_dir()
    fixed = parse_plan_keys(args.fix, "--fix")
    headroom = headroom_for(args.headroom, cluster.gpu.memory_GiB)
    if cluster.num_nodes > 1:
        return _tune_commands(args, model, cluster, out_dir, fixed, headroom)
    _check_tune_hardware(cluster)
    live = args.format != "json" and sys.stderr.isatty()

    def report(i: int, n: int, t) -> None:
        got = f"{t.measured_step_s:.4g} s" if t.measured_step_s else t.status
        text = f"  trial {i}/{n}: {t.short}: {got}"
        if args.format == "json":
            print(text, file=sys.stderr, flush=True)  # stdout holds the one JSON object
        else:
            print(text, file=sys.stderr if live else sys.stdout, flush=True)

    res = tune(model, cluster, args.global_batch, out_dir, fixed, args.trials, args.steps, args.warmup,
               args.time_limit, args.data, headroom, report)
    chosen = res.chosen
    if args.out and chosen is not None:
        plan = load_plan(chosen.plan_path)
        pred = {**plan.prediction, "measured_step_time_s": chosen.measured_step_s,
                "calibrated_step_time_s": chosen.calibrated_step_s}
        # the trials' short schedule stays with the trials: the plan written trains as `autopar plan --out` would
        save_plan(plan.model_copy(update={"prediction": pred, "train": TrainConfig()}), args.out)
    problem = None
    if res.interrupted:
        problem = f"interrupted by Ctrl-C; the trials' plans and metrics are in {out_dir}"
    elif chosen is None:
        first = next((t for t in res.trials if t.error), None)
        problem = (f"every trial failed (the first: {first.error if first else 'no error recorded'}); their plans and "
                   f"logs are in {out_dir}")
    warning = bound_warning(res.scales)
    if args.format == "json":
        print(json.dumps({"trials": [t.row() for t in res.trials], "chosen": chosen.row() if chosen else None,
                          "profile": res.profile_path, "plan_file": args.out if chosen else None, "dir": str(out_dir),
                          **({"error": problem} if problem else {}), **({"warning": warning} if warning else {})}))
    else:
        _print_trials(args, model, cluster, res, warning)
    if problem:
        print(f"{ERROR_PREFIX} {problem}", file=sys.stderr)
        return 130 if res.interrupted else 2
    return 0


def _check_tune_hardware(cluster) -> None:
    """Refuse to calibrate a GPU profile with trials that would run here on CPUs."""
    if cluster.backend == "gloo":  # a CPU profile: the trials run where it describes
        return
    import torch

    if not torch.cuda.is_available():
        raise AutoparError(f"--cluster {cluster.name} describes {cluster.gpu.name} GPUs, but this machine has no CUDA "
                           "GPU: tune measures its trials here; run it on that cluster, or tune for this machine with "
                           "--cluster cpu-gloo")


def _print_trials(args: argparse.Namespace, model, cluster, res, warning: str | None) -> None:
    from rich.table import Table

    from planner.report import console

    tab = Table(title=f"autopar tune: {model.name} on {cluster.num_gpus} x {cluster.gpu.name}, global batch "
                      f"{args.global_batch} ({args.steps} steps a trial, median after {args.warmup})")
    for col in ("plan", "predicted s", "measured s", "calibrated s", "status"):
        tab.add_column(col)
    for t in res.trials:
        fmt = lambda x: f"{x:.4g}" if x else "-"  # noqa: E731
        mark = " (chosen)" if t is res.chosen else ""
        tab.add_row(t.short + mark, fmt(t.predicted_step_s), fmt(t.measured_step_s), fmt(t.calibrated_step_s),
                    t.status if not t.error else f"{t.status}: {t.error}")
    con = console()
    con.print(tab)
    if res.chosen is None:
        return
    con.print(escape(f"chosen: {res.chosen.short} (measured {res.chosen.measured_step_s:.4g} s, predicted "
                     f"{res.chosen.predicted_step_s:.4g} s); calibrated profile: {res.profile_path}"))
    if warning:
        con.print(escape(warning))
    if args.out:
        con.print(escape(f"wrote {args.out}  (train it with: autopar run {args.out})"))


def _tune_commands(args: argparse.Namespace, model, cluster, out_dir, fixed, headroom: float) -> int:
    """A multi-node cluster: tune cannot start the trials from here, so it writes the finalists' plan files and
    prints what to run on the cluster, as `autopar run` does: each trial's per-node commands, then the fit."""
    import shlex

    from planner.tune import PROFILE, metrics_path, prepare
    from runtime.launch import worker_command

    found = prepare(model, cluster, args.global_batch, out_dir, fixed, args.trials, args.steps, headroom)
    q = shlex.quote
    fit = (f"autopar calibrate {' '.join(q(str(metrics_path(t))) for t in found)} --warmup {args.warmup} "
           f"--out {q(str(out_dir / PROFILE))}")
    trials = [{"plan_file": t.plan_path, "parallel": t.parallel, "predicted_step_s": t.predicted_step_s,
               "metrics": str(metrics_path(t)), "commands": worker_command(t.plan_path, args.steps,
                                                                             str(metrics_path(t)), args.data)}
              for t in found]
    if args.format == "json":
        print(json.dumps({"trials": trials, "chosen": None, "calibrate": fit, "dir": str(out_dir)}))
        return 0
    print(f"autopar tune: {cluster.num_gpus} GPUs span {cluster.num_nodes} nodes, so the {len(found)} trial(s) run "
          f"on the cluster, one after another; on every node:")
    for i, t in enumerate(trials, 1):
        print(f"trial {i}: {found[i - 1].short} (predicted {t['predicted_step_s']:.4g} s)")
        for line in t["commands"]:
            print(f"  {line}")
    print(f"then fit the profile to them and compare their medians (the fastest is the one to keep):\n  {fit}")
    return 0
