"""Output paths checked before long work starts, so a bad one fails in a second and not after the work."""

from __future__ import annotations

import os
from pathlib import Path

from planner.errors import AutoparError


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
