"""The ``autopar`` command line: estimate, plan, whatif, run, profile, calibrate.

Every bad input ends in one line on stderr (``autopar: error: ...``) and exit status 2; ``--format json``
prints exactly one JSON object on stdout. ``estimate``, ``plan`` and ``whatif`` never import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from planner.errors import AutoparError

MAX_GLOBAL_BATCH = 1 << 20  # sequences per step: hundreds of times the largest published training batches


def _nonempty(text: str) -> str:
    """argparse type of path-like arguments: an empty one is an error, not a silently skipped output."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise AutoparError(f"{message} (see `{self.prog} --help`)")


def _add_common(p: argparse.ArgumentParser, batch_required: bool = True) -> None:
    p.add_argument("--model", required=True, type=_nonempty,
                   help="preset name, YAML/JSON spec, HF config.json, or pkg.module:factory")
    p.add_argument("--cluster", default="dgx-a100", type=_nonempty,
                   help="bundled cluster name or profile path (default dgx-a100)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--gpus", type=int, help="resize the cluster to N GPUs")
    size.add_argument("--nodes", type=int, help="resize the cluster to N nodes")
    p.add_argument("--global-batch", type=int, required=batch_required, help="sequences per step")
    p.add_argument("--seq", type=int, help="sequence length (default: the model's seq_length)")
    p.add_argument("--headroom", type=float, default=0.0, metavar="GiB",
                   help="memory to keep free per GPU when deciding whether a plan fits")
    p.add_argument("--allow-cross-node-tp", action="store_true",
                   help="let tensor parallelism span whole nodes (its collectives then cross the NICs)")


def _format(p: argparse.ArgumentParser, choices: tuple[str, ...] = ("table", "json")) -> None:
    p.add_argument("--format", choices=choices, default="table")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `autopar run` (also `python -m runtime.launch`)."""
    p.add_argument("plan", nargs="?", type=_nonempty,
                   help="plan file from `autopar plan --out` (default: a tiny CPU plan)")
    p.add_argument("--steps", type=int)
    p.add_argument("--data", type=_nonempty,
                   help="token file (.npy, .bin/.u16, .u32) or .txt; default: a bundled text sample")
    p.add_argument("--metrics-out", type=_nonempty, help="write JSON lines of per-step metrics here")
    p.add_argument("--checkpoint-dir", type=_nonempty, help="save checkpoints here")
    p.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default: the plan's)")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--dry-run", action="store_true", help="print the launch command and exit")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="autopar", description="Auto-parallel planner and runtime for transformer training.")
    ap.add_argument("--version", action="store_true", help="print the version and exit")
    sub = ap.add_subparsers(dest="command", parser_class=_Parser)

    est = sub.add_parser("estimate", help="predict step time, throughput, MFU and memory of one plan")
    _add_common(est)
    est.add_argument("--plan", required=True, help='plan keys, e.g. "tp=8,pp=2,mbs=1,sp=true,recompute=selective"')
    _format(est)

    pl = sub.add_parser("plan", help="search for the fastest plan that fits")
    _add_common(pl)
    pl.add_argument("--fix", default="", help='plan keys to hold fixed, e.g. "tp=8,recompute=full"')
    pl.add_argument("--top", type=int, default=5, help="how many plans to list (default 5)")
    pl.add_argument("--exhaustive", action="store_true", help="enumerate everything, no pruning (slow)")
    pl.add_argument("--runnable", action="store_true",
                    help="only plans autopar's runtime executes (cp=1, ZeRO 0/1, no TP overlap)")
    pl.add_argument("--out", type=_nonempty, help="write the best plan to this plan file (JSON)")
    pl.add_argument("--steps", type=int, default=None, help="training steps recorded in the plan file")
    _format(pl)

    wi = sub.add_parser("whatif", help="sweep bandwidth, GPU count or GPU type and re-plan at each point")
    _add_common(wi)
    wi.add_argument("--vary", required=True,
                    help="one of inter_node_bw=Gb/s per NIC,..., intra_node_bw=GB/s,..., gpus=N,..., gpu=name,...")
    wi.add_argument("--fix", default="", help="plan keys held fixed at every point")
    wi.add_argument("--compare", default=None, help='a second curve with these keys fixed, e.g. "dp_overlap=false"')
    wi.add_argument("--plot", type=_nonempty, help="write a PNG plot of throughput and scaling efficiency")
    _format(wi, ("table", "json", "csv"))

    run = sub.add_parser("run", help="train with a plan file (default: plan and train the tiny model on CPU)")
    add_run_arguments(run)

    prof = sub.add_parser("profile", help="measure this machine and write a cluster profile")
    prof.add_argument("--out", default="my-cluster.yaml", type=_nonempty)
    prof.add_argument("--quick", action="store_true", help="fewer shapes and sizes")
    prof.add_argument("--nproc", type=int, default=None,
                      help="ranks to measure collectives with (default: all GPUs, or 2 on CPU)")
    prof.add_argument("--name", default=None, help="cluster name in the profile")

    cal = sub.add_parser("calibrate", help="fit a profile's efficiency parameters to measured runs")
    cal.add_argument("metrics", nargs="+", type=_nonempty,
                     help="metrics JSON lines written by `autopar run --metrics-out`")
    cal.add_argument("--out", required=True, type=_nonempty, help="updated cluster profile to write")
    cal.add_argument("--plan", action="append", type=_nonempty,
                     help="the plan file a metrics file ran (one per metrics file, or one for all; default: the "
                     "'plan' entry the metrics file carries)")
    cal.add_argument("--cluster", type=_nonempty, help="profile to calibrate (default: the cluster the plans embed)")
    cal.add_argument("--warmup", type=int, help="steps to leave out of each run (default: the first 10%%)")
    cal.add_argument("--fit", help="parameters to fit, from gemm,attention,memory,overhead,comm (default: all)")
    return ap


# ------------------------------------------------------------------------------------------------
def _load_inputs(args: argparse.Namespace) -> tuple[Any, Any]:
    from planner.cluster_spec import load_cluster
    from planner.model_spec import load_model, size_problem

    model = load_model(args.model, args.seq)
    cluster = load_cluster(args.cluster, gpus=args.gpus, nodes=args.nodes)
    if args.allow_cross_node_tp:
        cluster = cluster.model_copy(update={"tp_across_nodes": True})
    b = args.global_batch
    problem = None if b is None else size_problem("--global-batch", b, MAX_GLOBAL_BATCH)
    if problem:
        raise AutoparError(problem)
    h = args.headroom
    if not (h == h and 0 <= h < cluster.gpu.memory_GiB):  # h == h: not NaN
        raise AutoparError(f"--headroom must be between 0 and the GPU's {cluster.gpu.memory_GiB:g} GiB, got {h}")
    return model, cluster


def cmd_estimate(args: argparse.Namespace) -> int:
    from cost_models.step import estimate
    from planner.parallel import config_from_keys, parse_plan_keys

    model, cluster = _load_inputs(args)
    cfg = config_from_keys(parse_plan_keys(args.plan), cluster.num_gpus, model)
    est = estimate(model, cluster, cfg, args.global_batch, headroom_GiB=args.headroom)
    if args.format == "json":
        out = est.to_json()
        out["parallel"] = cfg.to_dict()
        print(json.dumps(out))
        return 0
    from planner.report import console, estimate_tables, print_inputs

    con = console()
    print_inputs(con, model, cluster)
    con.print(f"plan    {cfg.short()}  (global batch {args.global_batch}, "
              f"{cfg.microbatches(args.global_batch)} micro-batches per step)")
    for tab in estimate_tables(est, "estimate"):
        con.print(tab)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from planner.commands import plan_command

    return plan_command(args)


def cmd_whatif(args: argparse.Namespace) -> int:
    from planner.commands import whatif_command

    return whatif_command(args)


def cmd_run(args: argparse.Namespace) -> int:
    from planner.commands import run_command

    return run_command(args)


def cmd_profile(args: argparse.Namespace) -> int:
    from hardware_profiles.profiler import profile_command

    return profile_command(args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from planner.calibrate import calibrate_command

    return calibrate_command(args)


COMMANDS = {"estimate": cmd_estimate, "plan": cmd_plan, "whatif": cmd_whatif, "run": cmd_run,
            "profile": cmd_profile, "calibrate": cmd_calibrate}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.version:
            from planner import __version__

            print(f"autopar {__version__}")
            return 0
        if not args.command:
            build_parser().print_help()
            return 2
        return COMMANDS[args.command](args)
    except AutoparError as err:
        print(f"autopar: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as err:  # noqa: BLE001 - last resort: one line, no traceback unless asked
        if os.environ.get("AUTOPAR_DEBUG"):
            raise
        print(f"autopar: internal error: {type(err).__name__}: {err} (set AUTOPAR_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
