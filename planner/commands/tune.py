"""`autopar tune`: the finalists measured (or, on several nodes, their commands printed), the trials shown."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from pathlib import Path

from rich.markup import escape

from planner.commands.inputs import load_inputs, spec_files
from specs.errors import ERROR_PREFIX, INTERRUPTED, AutoparError
from specs.host import usable_cores


def tune_command(args: argparse.Namespace) -> int:
    from planner.calibrate import bound_warning, source_header
    from planner.tune import default_out_dir, tune
    from specs.parallel import parse_plan_keys
    from specs.planfile import TrainConfig, load_plan, save_plan

    model, cluster = load_inputs(args)
    _check_inputs(args, model, cluster)
    fixed = parse_plan_keys(args.fix, "--fix")
    if cluster.num_nodes > 1:
        if not args.dir:
            raise AutoparError("--dir: on several nodes every node reads the trials' plans and writes their metrics "
                               "there, so give a folder on a filesystem all nodes share (a temporary folder here "
                               "exists on this machine only)")
        if args.out:
            raise AutoparError("--out: on several nodes tune writes the trials' plans and prints their commands; "
                               "nothing is measured here to choose from, so leave --out out and keep the trial plan "
                               "whose median is the fastest")
        return _tune_commands(args, model, cluster, Path(args.dir), fixed, args.headroom)
    out_dir = Path(args.dir) if args.dir else default_out_dir()
    live = args.format != "json" and sys.stderr.isatty()

    def report(i: int, n: int, t) -> None:
        got = f"{t.measured_step_s:.4g} s" if t.measured_step_s else t.status
        text = f"  trial {i}/{n}: {t.short}: {got}"
        if args.format == "json":
            print(text, file=sys.stderr, flush=True)  # stdout holds the one JSON object
        else:
            print(text, file=sys.stderr if live else sys.stdout, flush=True)

    try:
        res = tune(model, cluster, args.global_batch, out_dir, fixed, args.trials, args.steps, args.warmup,
                   args.time_limit, args.data, args.headroom, report, provenance=source_header(args.cluster))
    except AutoparError:
        if not args.dir:  # refused before any trial: the temporary folder made for them goes too (if still empty)
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        raise
    chosen = res.chosen
    if args.out and chosen is not None:
        plan = load_plan(chosen.plan_path)
        pred = {**plan.prediction, "measured_step_time_s": chosen.measured_step_s,
                "calibrated_step_time_s": chosen.row()["calibrated_step_s"],
                **({"calibrated_profile": str(Path(res.profile_path).resolve())} if res.profile_path else {})}
        # the trials' short schedule stays with the trials: the plan written trains as `autopar plan --out` would
        save_plan(plan.model_copy(update={"prediction": pred, "train": TrainConfig()}), args.out)
    problem = None
    if res.interrupted:
        problem = f"interrupted by Ctrl-C; the trials' plans and metrics are in {out_dir}"
    elif chosen is None:
        first = next((t for t in res.trials if t.error), None)
        problem = (f"every trial failed (the first: {first.error if first else 'no error recorded'}); their plans and "
                   f"metrics are in {out_dir} (a failed trial's error names its log)")
        if all(t.status == "timeout" for t in res.trials):  # the limit counts each trial's start-up too
            problem += (f"; every one stopped at --time-limit {args.time_limit:g} s, which counts each trial's start "
                        "(processes, imports, groups) as well as its steps: give a longer one")
    warning = bound_warning(res.scales, "profile this machine (`autopar profile --out mine.yaml`) and tune on "
                                        "that profile (--cluster mine.yaml)", res.runs,
                            cores_here=usable_cores())  # the trials ran here
    warning = " ".join(w for w in (warning, res.ceiling) if w) or None
    if args.format == "json":
        print(json.dumps({"trials": [t.row() for t in res.trials], "chosen": chosen.row() if chosen else None,
                          "profile": res.profile_path, "plan_file": args.out if chosen else None, "dir": str(out_dir),
                          **({"error": problem} if problem else {}), **({"warning": warning} if warning else {})}))
    else:
        _print_trials(args, model, cluster, res, warning)
    if problem:
        print(f"{ERROR_PREFIX} {problem}", file=sys.stderr)
        return INTERRUPTED if res.interrupted else AutoparError.exit_code
    return 0


def _check_inputs(args: argparse.Namespace, model, cluster) -> None:
    """Refuse, before any trial, what would only fail later: the trial options, a model or cluster tune cannot
    measure, an output over an input or over another of tune's files, a bad token file."""
    from planner.tune import check_earlier_files, check_trial_options, check_tunable, written_files
    from specs.files import check_output_dir, check_output_file
    from specs.planfile import is_plan_data

    check_trial_options(args.trials, args.steps, args.warmup, args.time_limit)
    check_tunable(model, cluster, here=False)  # (here: on one node, below)
    if args.out:
        check_output_file(args.out, "plan file", {**spec_files(args), "--data file": args.data},
                          replaces=is_plan_data)
    if args.dir:
        check_output_dir(args.dir, "trial folder")
        for what, path in written_files(Path(args.dir), args.trials).items():  # never over one of the inputs
            check_output_file(path, f"tune's {what}", {**spec_files(args), "--data file": args.data},
                              "give another --dir")
            if args.out and path.resolve() == Path(args.out).resolve():  # the chosen plan over its own trial's file
                raise AutoparError(f"--out {args.out} would replace tune's {what} in --dir {args.dir}; give --out "
                                   "another name")
        check_earlier_files(Path(args.dir))
    if args.data:
        from runtime.data import TokenData

        TokenData(args.data, model.seq_length, model.vocab_size, 0)  # a bad token file: one line now, not per trial


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
        con.print(escape(f"wrote {args.out}  (train it with: autopar run {shlex.quote(args.out)})"), soft_wrap=True)


def _tune_commands(args: argparse.Namespace, model, cluster, out_dir, fixed, headroom: float | None) -> int:
    """A multi-node cluster: tune cannot start the trials from here, so it writes the finalists' plan files and
    prints what to run on the cluster, as `autopar run` does: each trial's per-node commands, then the fit."""
    import shlex

    from planner.tune import PROFILE, earlier_files, metrics_path, prepare
    from runtime.launch import worker_command

    kept = [p.name for p in earlier_files(out_dir) if p.suffix in (".jsonl", ".yaml")]
    if kept:  # measured on the cluster (and fitted there): hours of GPU time a new tune must not remove
        raise AutoparError(f"{out_dir} holds an earlier tune's measurements ({', '.join(kept)}): calibrate them with "
                           "the `autopar calibrate` line that tune printed, or move them, or give another --dir")
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
