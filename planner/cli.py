"""The ``autopar`` command line: estimate, plan, whatif, run, tune, profile, calibrate, diagnose, import-hf,
export-hf.

Every bad input ends in one line on stderr (``autopar: error: ...``) and exit status 2; ``--format json``
prints exactly one JSON object on stdout. ``estimate``, ``plan`` and ``whatif`` never import torch
(``--verify`` does: it replays the plan with the runtime).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from cost_models.headroom import DEFAULT_FRACTION
from runtime.options import add_run_arguments
from specs.errors import ERROR_PREFIX, INTERRUPTED, AutoparError
from specs.files import integer, path_argument
from specs.parallel import keys_help
from specs.planfile import TrainConfig

ONCE_HOW = {"plan": ", with comma-separated keys", "compare": ", with comma-separated keys",
            "vary": ": one key with comma-separated values (a sweep varies one thing)"}


class _Once(argparse.Action):
    """An option that takes a value, given at most once: argparse would keep the last of two silently."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        seen = namespace.__dict__.setdefault("_given", set())
        if self.dest in seen:
            names = " and ".join(self.option_strings)  # an option with another name: either counts (--trials, --top)
            alias = f" ({names} are one option)" if len(self.option_strings) > 1 else ""
            how = "" if self.type is path_argument else ONCE_HOW.get(self.dest, "")  # (a file: no keys to join)
            raise AutoparError(f"{option_string} is given twice{alias}; give it once{how}")
        seen.add(self.dest)
        setattr(namespace, self.dest, values)


class _Merged(argparse.Action):
    """Plan keys given in several --fix options: one comma-separated list (a key given twice is then refused)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if not values.strip(", \t"):  # (an unset shell variable): not "no keys fixed" without a word
            raise AutoparError(f"{option_string} is empty; give the plan keys to hold, e.g. {option_string} "
                               '"tp=2,pp=2", or leave it out')
        before = getattr(namespace, self.dest)
        setattr(namespace, self.dest, f"{before},{values}" if before else values)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, value options refused when given twice, no abbreviated options (a prefix of
    ``--gpus`` is not it: a typo is refused, and an option added later cannot change what a prefix meant), and an
    unknown option named first, with the option it is closest to (argparse would first report a required one
    missing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self.register("action", None, _Once)
        self.register("action", "store", _Once)
        self._given: list[str] = []

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        unknown = [a.split("=", 1)[0] for a in self._given
                   if a.startswith("--") and a.split("=", 1)[0] not in self._option_string_actions]
        if unknown and "unrecognized" not in message:
            close = difflib.get_close_matches(unknown[0], list(self._option_string_actions), n=1)
            message = f"unknown option {unknown[0]}" + (f" (did you mean {close[0]}?)" if close else "")
        raise AutoparError(f"{message} (see `{self.prog} --help`)")


def _add_common(p: argparse.ArgumentParser, batch_required: bool = True) -> None:
    p.add_argument("--model", required=True, type=path_argument,
                   help="preset name, YAML/JSON spec, HF config.json, or pkg.module:factory")
    p.add_argument("--cluster", default="dgx-a100", type=path_argument,
                   help="bundled cluster name or profile path (default dgx-a100)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--gpus", type=integer, help="resize the cluster to N GPUs")
    size.add_argument("--nodes", type=integer, help="resize the cluster to N nodes")
    p.add_argument("--global-batch", type=integer, required=batch_required, help="sequences per step")
    p.add_argument("--seq", type=integer, help="sequence length (default: the model's seq_length)")
    p.add_argument("--headroom", type=float, default=None, metavar="GiB",
                   help=f"memory to keep free per GPU when deciding whether a plan fits (default: "
                        f"{DEFAULT_FRACTION:.0%}% of the GPU's memory, what measured peaks ran above the model's; 0 "
                        "uses it all)")
    p.add_argument("--allow-cross-node-tp", action="store_true",
                   help="let tensor parallelism span whole nodes (its collectives then cross the NICs)")


def _format(p: argparse.ArgumentParser, choices: tuple[str, ...] = ("table", "json")) -> None:
    p.add_argument("--format", choices=choices, default="table",
                   help="table for people, json for tools (docs/contract.md); default %(default)s")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="autopar", description="Auto-parallel planner and runtime for transformer training.")
    ap.add_argument("--version", action="store_true", help="print the version and exit")
    sub = ap.add_subparsers(dest="command", parser_class=_Parser)

    est = sub.add_parser("estimate", help="predict step time, throughput, MFU and memory of one plan",
                         epilog=keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(est)
    est.add_argument("--plan", required=True, help='plan keys, e.g. "tp=8,pp=2,mbs=1,sp=true,recompute=selective"')
    est.add_argument("--verify", action="store_true",
                     help="also replay each pipeline rank with the runtime on the meta device and compare the bytes "
                          "it keeps alive with the memory model (needs torch)")
    _format(est)

    pl = sub.add_parser("plan", help="search for the fastest plan that fits",
                        epilog=keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(pl)
    pl.add_argument("--fix", default="", action=_Merged, help='plan keys to hold fixed, e.g. "tp=8,recompute=full"')
    pl.add_argument("--top", type=integer, default=5, help="how many plans to list (default %(default)s)")
    pl.add_argument("--exhaustive", action="store_true", help="enumerate everything, no pruning (slow)")
    pl.add_argument("--runnable", action="store_true",
                    help="kept for compatibility: every plan is one autopar's runtime executes; this only checks "
                         "that the model and its precision can be trained (specs/capabilities.py)")
    pl.add_argument("--out", type=path_argument, help="write the best plan to this plan file (JSON)")
    pl.add_argument("--steps", type=integer, default=None,
                    help="training steps recorded in the plan file, the length of its learning-rate schedule "
                         f"(default: {TrainConfig.model_fields['steps'].default}; only with --out)")
    pl.add_argument("--verify", action="store_true",
                    help="also replay the best plan's pipeline ranks with the runtime on the meta device and compare "
                         "the bytes they keep alive with the memory model (needs torch)")
    _format(pl)

    wi = sub.add_parser("whatif", help="sweep bandwidth, GPU count or GPU type and re-plan at each point",
                        epilog=keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(wi)
    wi.add_argument("--vary", required=True,
                    help="one of inter_node_bw=Gb/s per NIC,..., intra_node_bw=GB/s,..., gpus=N,..., nodes=N,..., "
                         "nics_per_node=N,..., gpu=name,...; on a cluster of node groups also "
                         "group_bw:GROUP=Gb/s per NIC,..., group_nodes:GROUP=N,..., group_net:GROUP=group names,... "
                         "(docs/contract.md)")
    wi.add_argument("--fix", default="", action=_Merged, help="plan keys held fixed at every point")
    wi.add_argument("--compare", default=None, help='a second curve with these keys fixed, e.g. "dp_overlap=false"')
    wi.add_argument("--plot", type=path_argument, help="write a PNG plot of throughput and scaling efficiency")
    _format(wi, ("table", "json", "csv"))

    run = sub.add_parser("run", help="train with a plan file (default: plan and train the tiny model on CPU)")
    add_run_arguments(run)

    tu = sub.add_parser("tune", help="plan, then run the best few plans here and keep the fastest measured",
                        epilog=keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(tu)
    tu.add_argument("--fix", default="", action=_Merged, help="plan keys to hold fixed")
    tu.add_argument("--trials", "--top", type=integer, default=3, dest="trials",
                    help="most finalists to measure: the best and those tied with it (default %(default)s; --top is "
                         "the same)")
    tu.add_argument("--steps", type=integer, default=8, help="steps per trial (default %(default)s)")
    tu.add_argument("--warmup", type=integer, default=2,
                    help="steps of each trial left out of its median (default %(default)s)")
    tu.add_argument("--time-limit", type=float, default=600.0, metavar="S",
                    help="seconds a trial may run, its start-up included, before it is stopped and skipped "
                         "(default %(default)g)")
    tu.add_argument("--data", type=path_argument, help="token file the trials train on (default: a bundled sample)")
    tu.add_argument("--dir", type=path_argument, help="where the trials' plans and metrics go (default: a temp folder)")
    tu.add_argument("--out", type=path_argument, help="write the measured-best plan here")
    _format(tu)

    prof = sub.add_parser("profile", help="measure this machine and write a cluster profile")
    prof.add_argument("--out", default="my-cluster.yaml", type=path_argument,
                      help="the cluster profile to write (default my-cluster.yaml)")
    prof.add_argument("--quick", action="store_true", help="fewer shapes and sizes")
    prof.add_argument("--nproc", type=integer, default=None,
                      help="ranks to measure collectives with (default: all GPUs, or 2 on CPU)")
    prof.add_argument("--name", default=None, help="cluster name in the profile")
    prof.add_argument("--group", default=None, metavar="NAME",
                      help="under torchrun, on every node: this node's node group (nodes with one name form a group); "
                           "writes a profile with node_groups and the links between groups")
    prof.add_argument("--nic-kind", default=None, metavar="{ib,roce,ethernet}",
                      help="with --group: the kind of this group's NICs, recorded in the profile (default ib)")

    cal = sub.add_parser("calibrate", help="fit a profile's efficiency parameters to measured runs")
    cal.add_argument("metrics", nargs="+", type=path_argument,
                     help="metrics JSON lines written by `autopar run --metrics-out`")
    cal.add_argument("--out", required=True, type=path_argument, help="updated cluster profile to write")
    cal.add_argument("--plan", action="append", type=path_argument,
                     help="the plan file a metrics file ran (one per metrics file, or one for all; default: the "
                     "'plan' entry the metrics file carries)")
    cal.add_argument("--cluster", type=path_argument,
                     help="profile to calibrate (default: the cluster the plans embed)")
    cal.add_argument("--warmup", type=integer,
                     help="steps each run leaves out (default: the first 10%%, at least 1; one-step runs left out)")
    cal.add_argument("--fit", help="parameters to fit, from gemm,attention,memory,overhead,comm (default: all)")

    dg = sub.add_parser("diagnose", help="where a run's steps went per phase, which ranks were slow, and the step "
                                         "without them")
    dg.add_argument("metrics", type=path_argument, help="metrics JSON lines written by `autopar run --metrics-out`")
    dg.add_argument("--plan", type=path_argument, help="the plan file the run ran (default: the metrics file's)")
    dg.add_argument("--steps", help="only these steps: steps and ranges, e.g. 11-20 or 3-10,12 or 11-; a file holding "
                                    "several runs (a resume under another plan) is diagnosed at its last run unless "
                                    "--steps picks one")
    dg.add_argument("--warmup", type=integer,
                    help="steps to leave out (default: the first 10%%, at least 1; none with --steps)")
    dg.add_argument("--threshold", type=float, default=1.25,
                    help="name a rank whose compute or sends take this many times its peers' (default %(default)g)")
    _format(dg)

    imp = sub.add_parser("import-hf", help="a Hugging Face model's weights as a step-0 checkpoint of a plan")
    imp.add_argument("hf_dir", type=path_argument, help="directory with config.json and safetensors weights")
    imp.add_argument("--plan", required=True, type=path_argument, help="plan file of the same model")
    imp.add_argument("--out", required=True, type=path_argument,
                     help="checkpoint directory to write (then: autopar run PLAN --checkpoint-dir OUT --resume)")
    exp = sub.add_parser("export-hf", help="a checkpoint's weights as a Hugging Face model directory")
    exp.add_argument("checkpoint_dir", type=path_argument, help="a run's --checkpoint-dir (its newest checkpoint)")
    exp.add_argument("--out", required=True, type=path_argument, help="directory to write config.json and "
                     "model.safetensors into (new, or without a model or checkpoints in it)")
    return ap





def _command(where: str) -> Callable[[argparse.Namespace], int]:
    """The command function at ``module:function`` (its module imported only when that command runs)."""
    def call(args: argparse.Namespace) -> int:
        module, name = where.split(":")
        return getattr(importlib.import_module(module), name)(args)

    return call


COMMANDS = {name: _command(where) for name, where in {
    "estimate": "planner.commands.estimate:estimate_command", "plan": "planner.commands.plan:plan_command",
    "whatif": "planner.commands.whatif:whatif_command", "run": "planner.commands.run:run_command",
    "tune": "planner.commands.tune:tune_command", "profile": "planner.commands.profile:profile_command",
    "calibrate": "planner.commands.calibrate:calibrate_command",
    "diagnose": "planner.commands.diagnose:diagnose_command",
    "import-hf": "planner.commands.hf:import_hf_command", "export-hf": "planner.commands.hf:export_hf_command",
}.items()}


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra:  # named with the command they were given to, whose --help says what it takes
            sub = f"{parser.prog} {args.command}" if getattr(args, "command", None) else parser.prog
            raise AutoparError(f"unrecognized arguments: {' '.join(extra)} (see `{sub} --help`)")
        if args.version:
            from specs import __version__

            print(f"autopar {__version__}")
            return 0
        if not args.command:
            build_parser().print_help()
            return 2
        return COMMANDS[args.command](args)
    except AutoparError as err:
        _clear_progress()
        print(f"{ERROR_PREFIX} {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        _clear_progress()
        print("autopar: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        return 0
    except Exception as err:  # noqa: BLE001 - last resort: one line, no traceback unless asked
        if os.environ.get("AUTOPAR_DEBUG"):
            raise
        print(f"autopar: internal error: {type(err).__name__}: {err} (set AUTOPAR_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 1


def _clear_progress() -> None:
    """Blank a progress line a long search or replay left on the terminal, so that the line after starts clean."""
    if sys.stderr.isatty():
        import shutil

        print("\r" + " " * (shutil.get_terminal_size().columns - 1) + "\r", end="", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
