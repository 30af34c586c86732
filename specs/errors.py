"""One exception type for every user-facing error: a single line saying what is wrong and how to fix it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

# The one line a command ends a bad input with (stderr, exit 2), and the line a training worker prints, which
# `autopar run` looks for in each worker's log to say why a run stopped (runtime/launch.py).
ERROR_PREFIX = "autopar: error:"
WORKER_ERROR_PREFIX = "autopar error:"
WORKER_BROKE_PREFIX = "autopar error (the run broke):"  # ... a worker's RunFailed: exit 1, not 2
INTERRUPTED = 130  # the exit status of a command or worker stopped by Ctrl-C (128 + SIGINT, as shells report it)


class AutoparError(Exception):
    """A bad input or an impossible request. The CLI prints ``str(err)`` on one line and exits 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


class RunFailed(AutoparError):
    """A run that failed on its way rather than on a bad input: a worker killed (the OOM killer, a lost node), a
    worker's internal error, a hang, a time limit. The CLI prints it on one line too and exits 1, so that a job
    script can tell "fix the input" (2) from "the run broke" (1)."""

    exit_code = 1


def needs_torch(what: str, err: ImportError) -> AutoparError:
    """The one-line error for ``what`` (a command or option) on an install without the `run` extra's PyTorch."""
    return AutoparError(f"{what} needs PyTorch ({err.name or 'torch'} is missing): pip install 'autopar[run]' "
                        "(on a machine without a GPU, `pip install torch==2.13.0` first takes the CPU build)")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, else the choices that begin with ``word`` (a short
    name of several: 'h100' -> 'h100-pcie-80gb' or 'h100-sxm5-80gb'), or an empty string."""
    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{close[0]}'?)"
    longer = [c for c in choices if word and c.lower().startswith(word.lower())]
    return f" (did you mean {' or '.join(repr(c) for c in longer)}?)" if 0 < len(longer) <= 4 else ""


def _fields_at(cls: type[BaseModel] | None, path: tuple[Any, ...]) -> list[str]:
    """The field names of the section at ``path`` inside model ``cls`` (a nested model, optional or not), or []."""
    for part in path:
        field = cls.model_fields.get(part) if cls is not None and isinstance(part, str) else None
        if field is None:
            return []
        kinds = [field.annotation, *get_args(field.annotation)]
        cls = next((k for k in kinds if _is_model(k)), None)
    return list(cls.model_fields) if cls is not None else []


def _is_model(kind: Any) -> bool:
    """Whether a field's type (or one of its arguments) is a pydantic model; a generic alias such as dict[str, X]
    is not (Python 3.10 calls it a type, and issubclass would raise)."""
    try:
        return isinstance(kind, type) and issubclass(kind, BaseModel)
    except TypeError:
        return False


def validation_message(err: ValidationError, cls: type[BaseModel] | None = None) -> str:
    """The most telling problem pydantic found, as one line (``field 'x': message``): an unknown field first, with
    the closest name of its section (a misspelt required field is also reported missing: the unknown name is the
    one to fix), else the first problem."""
    errors = err.errors()
    first = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0])
    path = tuple(first.get("loc", ()))
    loc = ".".join(str(p) for p in path)
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        missing = [str(e["loc"][-1]) for e in errors
                   if e.get("type") == "missing" and tuple(e["loc"][:-1]) == path[:-1]]
        return f"unknown field '{loc}'{did_you_mean(str(path[-1]), missing or _fields_at(cls, path[:-1]))}"
    kind = first.get("type")
    if kind == "missing" and len(path) > 1 and isinstance(path[-1], int):  # a list one item short (betas: [0.9])
        return f"field '{'.'.join(str(p) for p in path[:-1])}' has too few items ({path[-1]})"
    if kind == "missing":
        return f"missing required field '{loc}'"
    if kind in ("model_type", "model_attributes_type", "dict_type"):  # a section given as a number or text
        msg = f"expected a section of fields (a mapping), got {_shown(first.get('input'))}"
    msg = _in_words(str(kind), first.get("ctx") or {}, first.get("input")) or msg
    return f"field '{loc}': {msg}" if loc else msg


def _in_words(kind: str, ctx: dict[str, Any], value: Any) -> str | None:
    """Pydantic's message for a bound, a choice, a length or a type said in plain words with the value given (its
    own: "Input should be greater than or equal to 1"), or None where its own is kept."""
    got = f"{value:g}" if isinstance(value, float) else _shown(value)
    bounds = {"greater_than_equal": ("ge", "at least"), "greater_than": ("gt", "above"),
              "less_than_equal": ("le", "at most"), "less_than": ("lt", "below")}
    if kind in bounds and bounds[kind][0] in ctx:
        key, words = bounds[kind]
        return f"must be {words} {ctx[key]:g}, got {got}"
    if kind in ("literal_error", "enum") and "expected" in ctx:
        return f"got {got}; use {ctx['expected']}"
    if kind in ("too_long", "too_short") and "actual_length" in ctx:
        limit = f"at most {ctx['max_length']}" if kind == "too_long" else f"at least {ctx['min_length']}"
        return f"has {ctx['actual_length']} items; give {limit}"
    if kind == "string_type":
        return f"expected text, got {got}"
    if kind == "string_pattern_mismatch":
        return f"got {got}, which does not match the pattern {ctx.get('pattern', '')}"
    return None


def _shown(value: Any) -> str:
    """A value as a spec file writes it, for an error line."""
    return "nothing" if value is None else repr(value) if isinstance(value, str) else str(value).lower() \
        if isinstance(value, bool) else str(value)


def number_only(v: Any) -> Any:
    """Refuse true/false and text where a number is expected (pydantic would read them as 1 and 0, or parse "4")."""
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got {str(v).lower()}")
    if isinstance(v, str):
        try:
            float(v)
        except ValueError:  # '400Gbps', '2k': a unit or a suffix the field's name already fixes
            raise ValueError(f"expected a number, got the text {v!r}; write the number alone, in the unit the "
                             "field's name gives, without units, suffixes or quotes") from None
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


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and its noun, singular for one: ``1 rank``, ``3 ranks`` (``plural`` where it is not noun + s)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


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
        raise AutoparError(f"{what}: {validation_message(err, cls)}") from None
