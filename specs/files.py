"""Files: reading YAML/JSON mappings with one-line errors, and output paths checked before long work starts
(so a bad one fails in a second and not after the work)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import yaml

from specs.errors import AutoparError


def check_output_file(path: str | Path, what: str) -> Path:
    """``path`` can be written as a file: not a directory, and its folder exists or can be created."""
    p = Path(path)
    if not str(path):
        raise AutoparError(f"the {what} path is empty; give a file name")
    if p.is_dir():
        raise AutoparError(f"{what} {p} is a directory; give a file name inside it")
    _check_creatable(p.parent if str(p.parent) else Path("."), p, what)
    if p.exists() and not os.access(p, os.W_OK):
        raise AutoparError(f"cannot write {what} {p}: permission denied")
    return p


def _check_creatable(folder: Path, target: Path, what: str) -> None:
    """``folder`` exists and is writable, or its nearest existing ancestor is a writable folder."""
    existing = next(a for a in (folder, *folder.absolute().parents) if a.exists())
    if not existing.is_dir():
        raise AutoparError(f"cannot write {what} {target}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise AutoparError(f"cannot write {what} {target}: permission denied on {existing}")


def check_output_dir(path: str | Path, what: str) -> Path:
    """``path`` is a writable directory, or can be created as one (nothing is created here)."""
    p = Path(path)
    if not str(path):
        raise AutoparError(f"the {what} path is empty; give a folder name")
    if p.exists() and not p.is_dir():
        raise AutoparError(f"{what} {p} exists and is not a folder; give a folder path")
    _check_creatable(p, p, what)
    return p


def read_mapping(path: Path, what: str) -> dict[str, Any]:
    """Read a YAML or JSON file into a mapping, with a one-line error for every way it can be wrong."""
    try:
        text = path.read_text()
    except OSError as err:
        raise AutoparError(f"cannot read {what} {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise AutoparError(f"{what} {path} is not a text file (not UTF-8); give a YAML or JSON file") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else (
            f" at line {err.lineno}" if isinstance(err, json.JSONDecodeError) else "")
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise AutoparError(f"{what} {path} is not valid {kind}{where}; fix the syntax") from None
    if not isinstance(data, dict):
        raise AutoparError(f"{what} {path} must hold a mapping of fields, not {type(data).__name__}")
    return data


def path_argument(text: str) -> str:
    """argparse type of path-like arguments: an empty one is an error, not a silently skipped output."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text
