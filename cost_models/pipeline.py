"""Pipeline schedule simulation: replay the runtime's action table with per-stage durations.

Each action runs on its pipeline rank after the rank's previous action and after the action it depends on
(forward of the previous virtual stage; backward of the next virtual stage). Point-to-point transfers are
part of the sending action (blocking send/recv, as Megatron's schedules), so stage imbalance, warm-up and
drain bubbles, and interleaving all follow from the table itself rather than from the (p-1)/m formula.
``analytic_makespan`` is the closed form used to rank many candidates quickly; tests check it against the
simulation, and the planner re-ranks its best candidates with the simulation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from planner.schedules import Schedule, build_schedule


@dataclass
class SimResult:
    makespan: float
    rank_end: list[float]  # when each rank finishes its last action
    rank_busy: list[float]  # time each rank spends running actions
    last_b: list[list[tuple[float, float]]]  # [rank][chunk] = (start, end) of that chunk's last backward
    first_b_start: list[float]  # when each rank starts its first backward


def simulate(sched: Schedule, fwd: list[float], bwd: list[float], pp: int) -> SimResult:
    """Replay ``sched`` with ``fwd[v]`` / ``bwd[v]`` seconds per micro-batch on virtual stage v."""
    nv = len(fwd)
    vpp = nv // pp
    m = sum(1 for a in sched[0] if a[0] == "F") // vpp
    unset = -1.0
    end_f = [[unset] * m for _ in range(nv)]
    end_b = [[unset] * m for _ in range(nv)]
    ptr = [0] * pp
    clock = [0.0] * pp
    busy = [0.0] * pp
    last_b = [[(0.0, 0.0)] * vpp for _ in range(pp)]
    first_b = [float("inf")] * pp
    work = deque(range(pp))
    queued = [True] * pp
    while work:
        r = work.popleft()
        queued[r] = False
        acts = sched[r]
        i, t = ptr[r], clock[r]
        n_acts = len(acts)
        woke = -1
        while i < n_acts:
            kind, mb, chunk = acts[i]
            v = chunk * pp + r
            if kind == "F":
                dep = 0.0 if v == 0 else end_f[v - 1][mb]
                if dep == unset:
                    break
                start = t if t > dep else dep
                t = start + fwd[v]
                busy[r] += fwd[v]
                end_f[v][mb] = t
                nxt = v + 1
            else:
                dep = 0.0 if v == nv - 1 else end_b[v + 1][mb]
                if dep == unset:
                    break
                start = t if t > dep else dep
                t = start + bwd[v]
                busy[r] += bwd[v]
                end_b[v][mb] = t
                last_b[r][chunk] = (start, t)
                if start < first_b[r]:
                    first_b[r] = start
                nxt = v - 1
            i += 1
            if 0 <= nxt < nv:
                q = nxt % pp
                if q != r and q != woke and not queued[q]:
                    queued[q] = True
                    work.append(q)
                    woke = q
        ptr[r], clock[r] = i, t
    if any(ptr[r] < len(sched[r]) for r in range(pp)):
        raise ValueError("pipeline schedule deadlocked in simulation")
    return SimResult(makespan=max(clock), rank_end=clock, rank_busy=busy, last_b=last_b, first_b_start=first_b)


# Beyond this many micro-batches a step is priced from three shorter replays (see ``simulate_steps``).
STEADY_FROM = 256


def steady_m(pp: int, m: int) -> int:
    """The micro-batch count that stands for ``m`` in replays: ``m`` itself up to 3 x max(STEADY_FROM, 8 pp)
    (below that one full replay is cheaper than three short ones), otherwise the count at least
    max(STEADY_FROM, 8 pp) that differs from ``m`` by a multiple of pp (the interleaved schedule's group), so
    warm-up, steady pattern and drain are the same as ``m``'s."""
    base = max(STEADY_FROM, 8 * pp)
    if m <= 3 * base:
        return m
    return base + (m - base) % pp


def _affine(a: float, b: float, c: float, n: int) -> float | None:
    """a, b, c at equal steps; the value n steps past a if the steps agree, else None."""
    d1, d2 = b - a, c - b
    if abs(d2 - d1) > 1e-9 * max(1.0, abs(a), abs(c)):
        return None
    return a + n * d1


def simulate_steps(pp: int, vpp: int, m: int, fwd: list[float], bwd: list[float]) -> SimResult:
    """``simulate`` of the plan's schedule with ``m`` micro-batches.

    A pipeline replay is a max-plus recurrence: once the slowest rank is busy without a gap, every group of
    pp more micro-batches adds the same time to every event. For large ``m`` (a global batch of millions of
    sequences) the schedule is replayed at m1 = steady_m(pp, m), m1 + pp and m1 + 2 pp, and every result is
    extended linearly to ``m`` when the two steps agree and the makespan grows exactly as the busiest rank's
    work does (that regime lasts); otherwise (two near-equal stages still settling, or a schedule whose
    steady rate is set by a cycle through several ranks) the full replay runs."""
    m1 = steady_m(pp, m)
    found = None if m1 == m else _extended(pp, vpp, m, m1, fwd, bwd)
    return found if found is not None else simulate(build_schedule(pp, vpp, m), fwd, bwd, pp)


def _extended(pp: int, vpp: int, m: int, m1: int, fwd: list[float], bwd: list[float]) -> SimResult | None:
    """Replays at m1, m1 + pp, m1 + 2 pp extended linearly to ``m`` (m - m1 a multiple of pp), or None when
    they are not yet in the steady regime."""
    runs = [simulate(build_schedule(pp, vpp, k), fwd, bwd, pp) for k in (m1, m1 + pp, m1 + 2 * pp)]
    n = (m - m1) // pp

    def ext(get) -> float | None:
        return _affine(get(runs[0]), get(runs[1]), get(runs[2]), n)

    makespan = ext(lambda r: r.makespan)
    ends = [ext(lambda r, i=i: r.rank_end[i]) for i in range(pp)]
    busy = [ext(lambda r, i=i: r.rank_busy[i]) for i in range(pp)]
    first = [ext(lambda r, i=i: r.first_b_start[i]) for i in range(pp)]
    last = [[(ext(lambda r, i=i, c=c: r.last_b[i][c][0]), ext(lambda r, i=i, c=c: r.last_b[i][c][1]))
             for c in range(vpp)] for i in range(pp)]
    flat = [makespan, *ends, *busy, *first, *(x for row in last for pair in row for x in pair)]
    grow = runs[1].makespan - runs[0].makespan
    busiest = max(b - a for a, b in zip(runs[0].rank_busy, runs[1].rank_busy))
    if any(x is None for x in flat) or abs(grow - busiest) > 1e-9 * max(1.0, runs[1].makespan):
        return None
    return SimResult(makespan=makespan, rank_end=ends, rank_busy=busy, last_b=last, first_b_start=first)


@lru_cache(maxsize=128)
def _inflight_profiles(sched_key: tuple[int, int, int]) -> list[np.ndarray]:
    """Per rank, the distinct vectors of in-flight micro-batches per chunk right after each forward."""
    pp, vpp, m = sched_key
    sched = build_schedule(pp, vpp, m)
    out = []
    for r in range(pp):
        cur = [0] * vpp
        seen = set()
        for kind, _mb, chunk in sched[r]:
            cur[chunk] += 1 if kind == "F" else -1
            if kind == "F":
                seen.add(tuple(cur))
        out.append(np.array(sorted(seen), dtype=float).reshape(-1, vpp))
    return out


def peak_inflight_bytes(pp: int, vpp: int, m: int, act_bytes: list[float]) -> list[float]:
    """Per rank, the most activation bytes held at once (forwards whose backward has not run yet),
    replaying the schedule table (the same for ``m`` and ``steady_m(pp, m)``); ``act_bytes[v]`` is one
    micro-batch's activations on virtual stage v."""
    acts = np.asarray(act_bytes, dtype=float)
    peaks = []
    for r, prof in enumerate(_inflight_profiles((pp, vpp, steady_m(pp, m)))):
        a = acts[[c * pp + r for c in range(vpp)]]
        peaks.append(float((prof @ a).max()) if len(prof) else 0.0)
    return peaks


def inflight_count(pp, vpp, m, rank) -> np.ndarray:
    """Micro-batch chunks in flight at rank's peak (1F1B: pp - rank; interleaved: Megatron's warm-up + 1)."""
    pp, vpp, m, rank = (np.asarray(x, dtype=float) for x in (pp, vpp, m, rank))
    warm = np.where(vpp > 1, (pp - rank - 1) * 2 + (vpp - 1) * pp, pp - rank - 1)
    return np.minimum(m * vpp, warm + 1)


def analytic_makespan(u_max_chunk, u_fill, m, vpp) -> np.ndarray:
    """Closed-form pipeline time for near-uniform stages.

    ``u_max_chunk``: the largest per-chunk (F + B) time on any rank; ``u_fill``: the sum over ranks of each
    rank's mean chunk time (one chunk slot per rank to fill and drain the pipeline). The bottleneck rank runs
    m x vpp chunk slots back to back: T = (m*vpp - 1) * u_max_chunk + u_fill, which for uniform stages is
    (m*vpp + pp - 1) * u_chunk, i.e. Megatron's bubble (pp - 1) / (m * vpp).
    """
    m, vpp = np.asarray(m, dtype=float), np.asarray(vpp, dtype=float)
    return (m * vpp - 1) * u_max_chunk + u_fill
