"""The one line a training worker ends with when it fails (the launcher reads it from the workers' shared stderr).

Every rank may fail at once with the same message, and their stderr is one pipe: a line written in pieces (a print's
text, then its newline, as an unbuffered stderr does) can interleave with another rank's into one doubled line.
So the whole line goes out in a single write, which a pipe keeps whole up to PIPE_BUF (4 KiB) bytes.
"""

from __future__ import annotations

import os

from specs.errors import WORKER_BROKE_PREFIX, WORKER_ERROR_PREFIX

MAX_BYTES = 4000  # under PIPE_BUF, the size a pipe writes atomically


def report(text: str, broke: bool = False) -> None:
    """Write ``WORKER_ERROR_PREFIX text`` to stderr as one line in one write (its text cut to fit a pipe's atomic
    write); ``broke``: the run broke on its way (a RunFailed), not on a bad input: ``WORKER_BROKE_PREFIX``, so that
    the launcher exits 1 for it whatever torchrun makes of the worker's end (an abort on its way out)."""
    prefix = WORKER_BROKE_PREFIX if broke else WORKER_ERROR_PREFIX
    line = " ".join(f"{prefix} {text}".split()).encode()[:MAX_BYTES].decode(errors="ignore")
    os.write(2, (line + "\n").encode())
