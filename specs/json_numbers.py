"""How predictions are written in JSON, CSV and plan files: 6 significant digits, the same everywhere, so one plan's
step time reads the same in `plan`, `estimate`, `whatif`, `tune`, `diagnose` and a run's metrics."""

from __future__ import annotations

from typing import Any


def sig6(x: float) -> float:
    """``x`` to 6 significant digits."""
    return float(f"{x:.6g}")


def rounded(obj: Any) -> Any:
    """``obj`` (JSON-like: dicts, lists, tuples, numbers) with every float to 6 significant digits."""
    if isinstance(obj, float):
        return sig6(obj)
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v) for v in obj]
    return obj
