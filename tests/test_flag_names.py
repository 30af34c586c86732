"""Every command-line flag a message or help text names is one that exists: ``autopar``'s own (every
subcommand), the worker's (``python -m runtime.train``), torchrun's and srun's in the launch commands
autopar prints, or a benchmarks/ script's that a message tells how to run."""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from planner.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("planner", "runtime", "specs", "cost_models", "hardware_profiles")
OTHERS = {"--standalone", "--nproc-per-node", "--nnodes", "--rdzv-backend", "--rdzv-id", "--rdzv-endpoint",
          "--ntasks-per-node", "--node-rank", "--master-addr", "--master-port", "--log-dir"}  # torchrun's and srun's,
# in the multi-node commands autopar prints and the torchrun line it runs
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")


def _parser_flags(p: argparse.ArgumentParser) -> set[str]:
    out = set()
    for a in p._actions:
        out.update(o for o in a.option_strings if o.startswith("--"))
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out |= _parser_flags(sub)
    return out


def _named_flags() -> dict[str, set[str]]:
    """Each flag named in a string literal of the packages, with the files naming it."""
    found: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    for flag in FLAG.findall(node.value):
                        found.setdefault(flag, set()).add(str(path.relative_to(ROOT)))
    return found


def _script_flags() -> set[str]:
    """The flags the scripts in benchmarks/ define (a message may tell how to run one)."""
    out = set()
    for path in (ROOT / "benchmarks").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                out.update(a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--"))
    return out


def test_every_flag_a_message_names_exists(capsys):
    from runtime.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    worker = set(FLAG.findall(capsys.readouterr().out))
    known = _parser_flags(build_parser()) | worker | OTHERS | _script_flags()
    named = _named_flags()
    assert {"--fix", "--headroom", "--resume", "--checkpoint-dir"} <= set(named)  # the scan sees messages and help texts
    unknown = {flag: sorted(files) for flag, files in named.items() if flag not in known}
    assert not unknown, unknown


def _doc_commands() -> list[tuple[str, str, str]]:
    """Each ``autopar <command> ...`` the README and docs/ show (a code line or an inline code span), as
    (file, command, its text up to the end of the span or line)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for span in re.findall(r"`([^`\n]+)`|^(.+)$", path.read_text(), re.M):
            text = span[0] or span[1]
            for m in re.finditer(r"\bautopar ([a-z][a-z-]+)([^`#|]*)", text):
                found.append((path.name, m.group(1), m.group(2)))
    return found


def test_every_flag_the_docs_show_exists_for_its_command():
    """A flag the README or docs/ show after `autopar <command>` is one that command takes (the contract's
    commands are copied by other tools: a renamed flag there breaks them)."""
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    shown = _doc_commands()
    assert len(shown) > 50 and {c for _, c, _ in shown} >= {"plan", "estimate", "whatif", "run", "tune"}
    wrong = sorted({(f, c, flag) for f, c, rest in shown if c in subs
                    for flag in FLAG.findall(rest) if flag not in _parser_flags(subs[c])})
    assert not wrong, wrong
