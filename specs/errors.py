"""One exception type for every user-facing error: a single line saying what is wrong and how to fix it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

# The one line a command ends a bad input with (stderr, exit 2), and the line a training worker prints, which
# `autopar run` looks for in each worker's log to say why a run stopped (runtime/launch.py).
ERROR_PREFIX = "autopar: error:"
WORKER_ERROR_PREFIX = "autopar error:"


class AutoparError(Exception):
    """A bad input or an impossible request. The CLI prints ``str(err)`` on one line and exits 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def validation_message(err: ValidationError) -> str:
    """The first problem pydantic found, as one line (``field 'x': message``)."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        return f"unknown field '{loc}'"
    if first.get("type") == "missing":
        return f"missing required field '{loc}'"
    return f"field '{loc}': {msg}" if loc else msg


def number_only(v: Any) -> Any:
    """Refuse true/false and text where a number is expected (pydantic would read them as 1 and 0, or parse "4")."""
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got {str(v).lower()}")
    if isinstance(v, str):
        raise ValueError(f"expected a number, got the text {v!r}; write it without quotes")
    return v


def whole_only(v: Any) -> Any:
    """Refuse what :func:`number_only` refuses and numbers with a decimal point where a whole number is expected
    (pydantic would read 4.0 as 4): a plan or spec file's types are checked exactly."""
    number_only(v)
    if isinstance(v, float):
        raise ValueError(f"expected a whole number, got {v!r}" + (f"; write {int(v)}" if v.is_integer() else ""))
    return v


def bool_only(v: Any) -> Any:
    """Refuse anything but true/false where a switch is expected (pydantic would read "yes", "on", 1 as true)."""
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


def validated(cls: type[BaseModel], data: dict[str, Any], what: str) -> Any:
    """``cls(**data)``, or a one-line error starting with ``what``: an unknown field (with the closest one),
    or the first problem pydantic found."""
    unknown = [k for k in data if k not in cls.model_fields]
    if unknown:
        raise AutoparError(f"{what}: unknown field '{unknown[0]}'{did_you_mean(unknown[0], cls.model_fields)}; "
                           f"allowed fields: {', '.join(cls.model_fields)}")
    try:
        return cls(**data)
    except ValidationError as err:
        raise AutoparError(f"{what}: {validation_message(err)}") from None
