"""Pipeline schedules as tables of actions: the one description both the runtime and the cost model use.

``build_schedule(pp, vpp, m)[rank]`` is the ordered list of actions that pipeline rank ``rank`` performs in
one training step. ``Action("F", mb, chunk)`` runs the forward of micro-batch ``mb`` through model chunk
``chunk`` of that rank; ``"B"`` its backward. Model chunk ``c`` on rank ``r`` is virtual stage ``c * pp + r``;
activations flow through virtual stages 0, 1, ..., pp*vpp - 1.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple


class Action(NamedTuple):
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int  # model chunk on this rank, 0 .. vpp-1

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


Schedule = list[list[Action]]


def virtual_stage(rank: int, chunk: int, pp: int) -> int:
    return chunk * pp + rank


def rank_and_chunk(vstage: int, pp: int) -> tuple[int, int]:
    return vstage % pp, vstage // pp


def one_f_one_b(pp: int, m: int) -> Schedule:
    """PipeDream-flush 1F1B: warm up with (pp - rank - 1) forwards, alternate, then drain backwards."""
    sched: Schedule = []
    for r in range(pp):
        warm = min(pp - r - 1, m)
        acts = [Action("F", i, 0) for i in range(warm)]
        for i in range(m - warm):
            acts.append(Action("F", warm + i, 0))
            acts.append(Action("B", i, 0))
        acts += [Action("B", i, 0) for i in range(m - warm, m)]
        sched.append(acts)
    return sched


def interleaved_1f1b(pp: int, vpp: int, m: int) -> Schedule:
    """Megatron's interleaved 1F1B over ``vpp`` model chunks per rank (needs m % pp == 0).

    Forwards go in groups of ``pp`` micro-batches per chunk: step k runs chunk (k // pp) % vpp on
    micro-batch (k // (pp*vpp)) * pp + k % pp. Backwards visit chunks in reverse order.
    """
    if m % pp:
        raise ValueError(f"interleaved schedule needs micro-batches ({m}) divisible by pp ({pp})")
    total = m * vpp

    def mb(k: int) -> int:
        return (k // (pp * vpp)) * pp + k % pp

    sched: Schedule = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (vpp - 1) * pp, total)
        fwd = [Action("F", mb(k), (k // pp) % vpp) for k in range(total)]
        bwd = [Action("B", mb(k), vpp - 1 - (k // pp) % vpp) for k in range(total)]
        acts = fwd[:warm]
        for i in range(total - warm):
            acts.append(fwd[warm + i])
            acts.append(bwd[i])
        acts += bwd[total - warm:]
        sched.append(acts)
    return sched


@lru_cache(maxsize=64)
def build_schedule(pp: int, vpp: int, m: int) -> Schedule:
    """The schedule a plan runs: 1F1B for vpp == 1 (and plain gradient accumulation for pp == 1).

    Cached: callers must not modify the returned lists."""
    return one_f_one_b(pp, m) if vpp == 1 else interleaved_1f1b(pp, vpp, m)


def check_schedule(sched: Schedule, pp: int, vpp: int, m: int) -> None:
    """Raise ValueError if the table is incomplete or would deadlock (replay with unit durations)."""
    want = {(k, i, c) for k in "FB" for i in range(m) for c in range(vpp)}
    for r, acts in enumerate(sched):
        if sorted(set(acts)) != sorted(acts) or set(acts) != {Action(*a) for a in want}:
            raise ValueError(f"rank {r}: every F and B of every micro-batch and chunk must appear exactly once")
    done: set[tuple[str, int, int]] = set()  # (kind, mb, vstage)
    ptr = [0] * pp
    nv = pp * vpp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while ptr[r] < len(sched[r]):
                a = sched[r][ptr[r]]
                v = virtual_stage(r, a.chunk, pp)
                if a.kind == "F":
                    ready = v == 0 or ("F", a.microbatch, v - 1) in done
                else:
                    ready = ("F", a.microbatch, v) in done and (v == nv - 1 or ("B", a.microbatch, v + 1) in done)
                if not ready:
                    break
                done.add((a.kind, a.microbatch, v))
                ptr[r] += 1
                progress = True
    stuck = [r for r in range(pp) if ptr[r] < len(sched[r])]
    if stuck:
        r = stuck[0]
        raise ValueError(f"schedule deadlocks: rank {r} waits at {sched[r][ptr[r]]}")
