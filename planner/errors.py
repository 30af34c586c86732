"""One exception type for every user-facing error: a single line saying what is wrong and how to fix it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class AutoparError(Exception):
    """A bad input or an impossible request. The CLI prints ``str(err)`` on one line and exits 2."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
