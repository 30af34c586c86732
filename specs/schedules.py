"""Pipeline schedules as tables of actions: the one description both the runtime and the cost model use.

``build_schedule(pp, vpp, m)[rank]`` is the ordered list of actions that pipeline rank ``rank`` performs in
one training step. ``Action("F", mb, chunk)`` runs the forward of micro-batch ``mb`` through model chunk
``chunk`` of that rank; ``"B"`` its backward. Model chunk ``c`` on rank ``r`` is virtual stage ``c * pp + r``;
activations flow through virtual stages 0, 1, ..., pp*vpp - 1.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np


class Action(NamedTuple):
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int  # model chunk on this rank, 0 .. vpp-1

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


Schedule = list[list[Action]]


def repeating_from(pp: int) -> int:
    """From this many micro-batches on, an (interleaved) 1F1B schedule of ``pp`` ranks only repeats its steady
    pattern: what is held in flight peaks as with this many, and each further ``pp`` adds the same time (the
    cost model's replays and the runtime's memory replay run no more)."""
    return 2 * pp


def virtual_stage(rank: Any, chunk: Any, pp: int) -> Any:
    """The virtual stage that model chunk ``chunk`` of pipeline rank ``rank`` holds (of ``pp`` ranks: chunk-major, so
    stage ``v`` feeds ``v + 1`` on the next rank); element-wise on arrays."""
    return chunk * pp + rank


@lru_cache(maxsize=256)
def schedule_table(pp: int, vpp: int, m: int) -> np.ndarray:
    """The schedule as one integer array, a row per action (rank, 1 for a backward, micro-batch, chunk), each
    rank's actions in the order it runs them. The one definition both build_schedule and the cost model's
    many-candidate replay read.

    Every rank runs W warm-up forwards, then one forward and one backward in turn, then the backwards left.
    1F1B (vpp = 1, PipeDream-flush): W = pp - rank - 1. Megatron's interleaved 1F1B over vpp model chunks per
    rank (needs m % pp == 0): W = 2 (pp - rank - 1) + (vpp - 1) pp, and forwards go in groups of pp micro-batches
    per chunk: forward k runs chunk (k // pp) % vpp on micro-batch (k // (pp vpp)) pp + k % pp; backward k the
    same micro-batch on chunk vpp - 1 - (k // pp) % vpp. W is at most m * vpp. Cached: do not modify."""
    if vpp > 1 and m % pp:
        raise ValueError(f"interleaved schedule needs micro-batches ({m}) divisible by pp ({pp})")
    total = m * vpp
    k = np.arange(total)
    mb, chunk = (k // (pp * vpp)) * pp + k % pp, (k // pp) % vpp
    rank = np.arange(pp)[:, None]
    warm = np.minimum(pp - rank - 1 if vpp == 1 else 2 * (pp - rank - 1) + (vpp - 1) * pp, total)
    steady = total - warm
    # each rank's order: position of forward k and of backward k among its 2 * total actions
    f_pos = np.where(k < warm, k, warm + 2 * (k - warm))
    b_pos = np.where(k < steady, warm + 2 * k + 1, warm + steady + k)
    order = np.argsort(np.concatenate([f_pos, b_pos], axis=1), axis=1, kind="stable")  # [pp, 2 * total]
    back = (order >= total).astype(np.int64)
    idx = order % total
    chunk_of = np.where(back == 1, vpp - 1 - chunk[idx], chunk[idx])
    table = np.stack([np.broadcast_to(rank, order.shape), back, mb[idx], chunk_of], axis=2)
    return table.reshape(-1, 4)


@lru_cache(maxsize=64)
def build_schedule(pp: int, vpp: int, m: int) -> Schedule:
    """The schedule a plan runs, per rank a list of actions (:func:`schedule_table`): 1F1B for vpp == 1 (plain
    gradient accumulation for pp == 1), interleaved 1F1B otherwise.

    Cached: callers must not modify the returned lists."""
    table = schedule_table(pp, vpp, m)
    sched: Schedule = [[] for _ in range(pp)]
    for r, back, mb, chunk in table.tolist():
        sched[r].append(Action("B" if back else "F", mb, chunk))
    return sched
