"""Where a plan's pipeline ranks run on a cluster of node groups: the ``placement`` key's entries (a group per
pipeline rank, or ``a+b``: its data-parallel replicas split in equal shares over groups), written and read."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from specs.errors import AutoparError
from specs.topology import GROUP_NAME


def groups_text(names: Iterable[str]) -> str:
    """Group names per pipeline rank, runs written ``name*count``: ``ib*4/roce*4``."""
    runs: list[list[Any]] = []
    for n in names:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return "/".join(n if k == 1 else f"{n}*{k}" for n, k in runs)


def entry_groups(entry: str) -> tuple[str, ...]:
    """The node groups of one pipeline rank's placement entry: ``ib`` or, its dp replicas split in equal shares, one
    per name, ``ib+roce`` (``ib+ib+roce``: two shares on ib)."""
    return tuple(entry.split("+"))


def splits_replicas(placement: tuple[str, ...] | None) -> bool:
    """Whether a placement splits some pipeline rank's dp replicas over node groups (an ``a+b`` entry)."""
    return any(len(entry_groups(e)) > 1 for e in placement or ())


def replica_group(entry: str, dp_rank: int, dp: int) -> str:
    """The node group holding data-parallel replica ``dp_rank`` (of ``dp``) of a pipeline rank placed on ``entry``:
    the replicas in order, an equal run of them per group."""
    names = entry_groups(entry)
    return names[dp_rank * len(names) // dp]


MAX_PLACEMENT_RUN = 65536  # pipeline ranks a placement may name (runs name*count included): more than any cluster


def _name_ok(name: str) -> bool:
    return re.fullmatch(GROUP_NAME, name) is not None


def parse_groups(raw: str) -> tuple[str, ...]:
    out: list[str] = []
    for part in raw.strip().split("/"):
        name, _, count = part.partition("*")
        names = entry_groups(name)
        if not all(_name_ok(n) for n in names) or (len(names) > 1 and len(set(names)) < 2) \
                or not (count == "" or count.isascii() and count.isdigit() and len(count) <= 6
                        and 0 < int(count) <= MAX_PLACEMENT_RUN - len(out)):
            raise AutoparError(f"placement takes a node group per pipeline rank separated by '/', runs as name*count "
                               f"(at most {MAX_PLACEMENT_RUN:,} ranks in all), "
                               f"a rank's dp replicas split over groups as a+b, a group named twice holding twice the "
                               f"share (e.g. ib*4/roce*4, ib+roce*8 or ib+ib+roce), got '{raw}'")
        out += [name] * (int(count) if count else 1)
    return tuple(out)
