"""The pipeline: the runtime's schedule table replayed with per-stage durations, and the same in closed form.

Each action runs on its pipeline rank after the rank's previous action and after the action it depends on
(forward of the previous virtual stage; backward of the next virtual stage). Point-to-point transfers are
part of the sending action (blocking send/recv, as Megatron's schedules), so stage imbalance, warm-up and
drain bubbles, and interleaving all follow from the table itself rather than from the (p-1)/m formula.

- ``simulate``: the replay of any schedule, rank by rank until each blocks (the definition the others are tested
  against); ``simulate_steps``: the exact model's replay of one plan, the same times from each action once in a
  cached dependency order (several times faster).
- ``closed_form``: the vectorised model's pipeline for many candidates at once; ``wave_replay`` replays many
  candidates at once where the closed form is not accurate (interleaved chunks of unequal size).
- ``inflight_profiles`` / ``peak_inflight_bytes``: how many micro-batches each rank holds at its peak, read off
  the table's structure (the same for both models).
All of them return or take :class:`Replay` timings; tests check each against ``simulate``.
"""

from __future__ import annotations

import array
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from cost_models.arrays import by_value
from specs.schedules import Schedule, repeating_from, schedule_table, virtual_stage


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
            v = virtual_stage(r, chunk, pp)
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
    """``simulate`` of the plan's schedule with ``m`` micro-batches (by :func:`_replay`: the same times to the bit).

    A pipeline replay is a max-plus recurrence: once the slowest rank is busy without a gap, every group of
    pp more micro-batches adds the same time to every event. For large ``m`` (a global batch of millions of
    sequences) the schedule is replayed at m1 = steady_m(pp, m), m1 + pp and m1 + 2 pp, and every result is
    extended linearly to ``m`` when the two steps agree and the makespan grows exactly as the busiest rank's
    work does (that regime lasts); otherwise (two near-equal stages still settling, or a schedule whose
    steady rate is set by a cycle through several ranks) the full replay runs.

    Cached (a search prices a third of its plans' schedules more than once): do not modify the result."""
    return _steps(pp, vpp, m, tuple(fwd), tuple(bwd))


@lru_cache(maxsize=2048)
def _steps(pp: int, vpp: int, m: int, fwd: tuple[float, ...], bwd: tuple[float, ...]) -> SimResult:
    m1 = steady_m(pp, m)
    found = None if m1 == m else _extended(pp, vpp, m, m1, fwd, bwd)
    return found if found is not None else _replay(pp, vpp, m, fwd, bwd)


@dataclass(frozen=True)
class _Order:
    """A schedule for one replay at a time: its actions in an order that runs each after those it waits on (the
    graph's waves), as four columns (action, the rank's previous action, the action whose output it needs, its
    duration's index: fwd then bwd per virtual stage; n = none), each action's duration index in its rank's order,
    and the few actions whose starts a replay reports (as (action, previous, dependency))."""

    columns: tuple[array.array, array.array, array.array, array.array]
    rank_durations: np.ndarray  # [pp, 2 m vpp]
    rank_last: list[int]
    last_b: list[list[tuple[int, int, int]]]  # [rank][chunk]
    first_b: list[tuple[int, int, int]]  # [rank]


@lru_cache(maxsize=128)  # a 175B model's search meets ~80 schedules (16 ranks x 1,024 micro-batches: 0.7 MB)
def _order(pp: int, vpp: int, m: int) -> _Order:
    """:class:`_Order` of the schedule of ``pp``, ``vpp``, ``m`` (from :func:`_levels`), held compactly: the search
    replays many schedules many times each."""
    g = _levels(pp, vpp, m)
    order = np.concatenate(g.waves)
    columns = tuple(array.array("i", x[order].tolist()) for x in (np.arange(len(g.prev)), g.prev, g.dep, g.dur))

    def who(i: int) -> tuple[int, int, int]:
        return i, int(g.prev[i]), int(g.dep[i])

    return _Order(columns=columns, rank_durations=g.dur.reshape(pp, -1).astype(np.int32),  # type: ignore[arg-type]
                  rank_last=g.rank_last.tolist(), last_b=[[who(i) for i in row] for row in g.last_b.tolist()],
                  first_b=[who(i) for i in g.first_b.tolist()])


def _replay(pp: int, vpp: int, m: int, fwd: tuple[float, ...], bwd: tuple[float, ...]) -> SimResult:
    """:func:`simulate` of the schedule of ``pp``, ``vpp``, ``m`` (the same max-and-add, so the same times to the
    bit), action by action in the dependency order :func:`_order` caches instead of rank by rank as they block."""
    o = _order(pp, vpp, m)
    dur = fwd + bwd
    end = [0.0] * (len(o.columns[0]) + 1)  # the last: "none"
    for i, p, q, d in zip(*o.columns):
        a, b = end[p], end[q]
        end[i] = (a if a > b else b) + dur[d]

    def start(i: int, p: int, q: int) -> float:
        a, b = end[p], end[q]
        return a if a > b else b

    rank_end = [end[i] for i in o.rank_last]
    busy = np.cumsum(np.asarray(dur)[o.rank_durations], axis=1)[:, -1]  # sequential, as the replay adds
    return SimResult(makespan=max(rank_end), rank_end=rank_end, rank_busy=busy.tolist(),
                     last_b=[[(start(*w), end[w[0]]) for w in row] for row in o.last_b],
                     first_b_start=[start(*w) for w in o.first_b])


def _extended(pp: int, vpp: int, m: int, m1: int, fwd: tuple[float, ...], bwd: tuple[float, ...]) -> SimResult | None:
    """Replays at m1, m1 + pp, m1 + 2 pp extended linearly to ``m`` (m - m1 a multiple of pp), or None when
    they are not yet in the steady regime."""
    runs = [_replay(pp, vpp, k, fwd, bwd) for k in (m1, m1 + pp, m1 + 2 * pp)]
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


def inflight_profiles(pp: int, vpp: int, m: int) -> np.ndarray:
    """[pp, K, vpp]: per rank, the distinct vectors of micro-batches in flight per model chunk right after each
    forward of the schedule table (forwards whose backward has not run yet), less those another vector holds
    at least as many of in every chunk (they never set a peak), padded with zero rows (1F1B: the largest count
    only). From 2 pp micro-batches on, more only repeat the steady pattern: the profile is that of 2 pp (the
    brute-force replays in tests/cost_models check it)."""
    return _profiles(pp, vpp, min(m, repeating_from(pp)))


@lru_cache(maxsize=256)
def _profiles(pp: int, vpp: int, m: int) -> np.ndarray:
    if vpp == 1:  # 1F1B: rank r holds at most pp - r micro-batches (its warm-up forwards and one more)
        return np.minimum(m, pp - np.arange(pp)).astype(float).reshape(pp, 1, 1)
    _rank, back, _mb, chunk = schedule_table(pp, vpp, m).reshape(pp, -1, 4).transpose(2, 0, 1)  # [pp, 2 m vpp]
    sign = np.where(back == 1, -1, 1).astype(np.int32)
    held = np.cumsum(sign[..., None] * (chunk[..., None] == np.arange(vpp)), axis=1)  # [pp, 2 m vpp, vpp]
    after_forward = held[back == 0].reshape(pp, -1, vpp)
    base = int(after_forward.max()) + 1
    if base ** vpp * pp < 2 ** 62:  # each (rank, vector) as one integer
        codes = after_forward @ base ** np.arange(vpp) + np.arange(pp)[:, None] * base ** vpp
        first = np.unique(codes.ravel(), return_index=True)[1]
        rank, vectors = first // after_forward.shape[1], after_forward.reshape(-1, vpp)[first]
    else:
        ranked = np.concatenate([np.repeat(np.arange(pp), after_forward.shape[1])[:, None],
                                 after_forward.reshape(-1, vpp)], axis=1)
        unique = np.unique(ranked, axis=0)
        rank, vectors = unique[:, 0], unique[:, 1:]
    counts = np.bincount(rank, minlength=pp)
    slot = np.arange(len(rank)) - np.repeat(np.cumsum(counts) - counts, counts)
    padded = np.full((pp, counts.max(), vpp), -1)
    padded[rank, slot] = vectors
    geq = np.ones((pp, counts.max(), counts.max()), dtype=bool)  # [pp, j, i]: row j >= row i in every chunk
    for c in range(vpp):
        geq &= padded[:, :, None, c] >= padded[:, None, :, c]
    keep = (geq.sum(axis=1) == 1) & (padded[..., 0] >= 0)
    first = np.argsort(~keep, axis=1, kind="stable")  # kept rows first
    kept = np.take_along_axis(np.where(keep[..., None], padded, 0), first[..., None], axis=1)
    return kept[:, :keep.sum(axis=1).max()].astype(float)


def peak_inflight_bytes(pp: int, vpp: int, m: int, act_bytes: np.ndarray) -> np.ndarray:
    """[N, pp]: per rank, the most activation bytes held at once, from ``act_bytes`` [N, pp * vpp] (one
    micro-batch's activations on each virtual stage)."""
    acts = np.asarray(act_bytes, dtype=float)
    prof = inflight_profiles(pp, vpp, m)  # [pp, K, vpp]
    if vpp == 1:  # one vector per rank: its peak count
        return acts * prof.max(axis=1)[:, 0][None, :]
    per_rank = acts.reshape(acts.shape[0], vpp, pp).transpose(2, 0, 1)  # [pp, N, vpp]
    return np.matmul(per_rank, prof.transpose(0, 2, 1)).max(axis=2).T  # [pp, N, K]: bytes at each vector


@dataclass
class Replay:
    """When each rank finishes its pipeline work in one step, and when each model chunk's last backward runs
    ([N, pp] and [N, pp, vpp] arrays); the exact model gets them from the schedule replay, the vectorised
    model from the closed form."""

    rank_end: np.ndarray
    last_b_start: np.ndarray
    last_b_end: np.ndarray


REPLAY_FIELDS = ("rank_end", "last_b_start", "last_b_end")


def replayed(sim: SimResult) -> Replay:
    """A schedule replay's result as a (one-candidate) :class:`Replay`."""
    starts = np.array([[s for s, _ in row] for row in sim.last_b])
    ends = np.array([[e for _, e in row] for row in sim.last_b])
    return Replay(rank_end=np.array([sim.rank_end]), last_b_start=starts[None], last_b_end=ends[None])


def table_replay(f: np.ndarray, b: np.ndarray, pp: int, vpp: int, m: np.ndarray) -> Replay:
    """:func:`simulate_steps` of every candidate (``f``, ``b``: [N, pp * vpp]; ``m``: [N]): the exact model's
    pipeline, for many candidates. Candidates with the same micro-batch count are replayed together, one dependency
    wave at a time (the same max-and-add as :func:`simulate`, so the same times to the bit), a long batch by the
    same checked steady-state extension as ``simulate_steps`` (``_extended_many``), falling back to the full
    replay where it does not hold."""
    m = np.asarray(m)
    n = f.shape[0]
    out = Replay(rank_end=np.zeros((n, pp)), last_b_start=np.zeros((n, pp, vpp)), last_b_end=np.zeros((n, pp, vpp)))
    for mi, rows in by_value(m):
        longest = max(mi, steady_m(pp, mi) + 2 * pp)
        block = max(16, REPLAY_FLOATS // (2 * (longest + pp) * pp * vpp))  # the replay keeps every action's end
        for lo in range(0, len(rows), block):
            part = rows[lo:lo + block]
            full = np.ones(len(part), dtype=bool)
            if steady_m(pp, mi) != mi:
                got, steady = _extended_many(f[part], b[part], pp, vpp, mi)
                _put(out, part[steady], got, steady)
                full = ~steady
            if full.any():
                _put(out, part[full], _waves_replay(f[part[full]], b[part[full]], pp, vpp, mi), slice(None))
    return out


def _put(out: Replay, rows: np.ndarray, got: Replay, which: np.ndarray | slice) -> None:
    """Write rows ``which`` of ``got`` into rows ``rows`` of ``out``."""
    for k in REPLAY_FIELDS:
        getattr(out, k)[rows] = getattr(got, k)[which]


# How far the closed form may be from the replay, for interleaved chunks of unequal size (it is exact otherwise):
# at most 12% optimistic and 8% pessimistic (tests/cost_models/test_closed_form.py holds it on random candidates).
CLOSED_FORM_OPTIMISM, CLOSED_FORM_PESSIMISM = 0.12, 0.08


def closed_form(f: np.ndarray, b: np.ndarray, pp: int, vpp: int, m: np.ndarray) -> Replay:
    """The pipeline of candidates with per-virtual-stage forward ``f`` and backward ``b`` times ([N, pp * vpp]),
    ``m`` micro-batches each ([N]), in closed form instead of a replay (tests/cost_models compare the two).

    1F1B (vpp = 1): some stage k paces the pipeline. Its first forward starts once the earlier stages have run
    one each, it idles once until its first backward comes back (the later stages' round trip, less the
    pp - 1 - k forwards it runs meanwhile), then runs its m forwards and backwards back to back, and the last
    backward still passes the earlier stages: T = max_k [sum_{j<k} u_j + m u_k + max(0, sum_{j>k} u_j -
    (pp - 1 - k) f_k)], u = f + b; exact for equal stages, within a few percent otherwise.

    Interleaved (vpp > 1): the busiest rank runs m * vpp chunk slots back to back (each its mean chunk time),
    and one slot per rank fills and drains the pipeline: T = (m vpp - 1) max_r u_r / vpp + sum_j u_j / vpp, u_r
    the rank's forward + backward over its chunks (for equal stages, Megatron's (m vpp + pp - 1) slots). It
    is not accurate for chunks of unequal size on one rank (their waves leave gaps): :func:`wave_replay`.

    The last backward wave runs from the last stage down to the first, so rank r ends sum_{j<r} b_j before T;
    chunk c's last backward ends c groups of pp backward slots before its rank ends."""
    n = f.shape[0]
    m = np.asarray(m, dtype=float)
    if vpp == 1:
        u = f + b
        before = np.cumsum(u, axis=1) - u
        after = u.sum(axis=1, keepdims=True) - before - u
        idle = np.maximum(0.0, after - (pp - 1 - np.arange(pp))[None, :] * f)
        makespan = (before + m[:, None] * u + idle).max(axis=1)
    else:
        u = (f + b).reshape(n, vpp, pp)
        makespan = (m * vpp - 1) * u.sum(axis=1).max(axis=1) / vpp + u.sum(axis=(1, 2)) / vpp
    b_first = b[:, :pp]  # chunk 0 of each rank: the last backward wave
    ahead = np.concatenate([np.zeros((n, 1)), np.cumsum(b_first, axis=1)[:, :-1]], axis=1)
    rank_end = makespan[:, None] - ahead
    b_rc = b.reshape(n, vpp, pp).transpose(0, 2, 1)  # [N, pp, vpp]
    mean_b = b_rc.mean(axis=2, keepdims=True)
    end = rank_end[:, :, None] - np.arange(vpp)[None, None, :] * pp * mean_b
    return Replay(rank_end=rank_end, last_b_start=end - b_rc, last_b_end=end)


def makespan_floor(work: np.ndarray, vpp: int, m: np.ndarray) -> np.ndarray:
    """[N]: a lower bound of :func:`closed_form`'s makespan from a lower bound of each rank's forward + backward
    work over its chunks per micro-batch (``work``: [N, pp]). Interleaved: the closed form is increasing in every
    stage's time and its busiest rank is at least the busiest of ``work``. 1F1B: every stage runs m micro-batches,
    and the last stage's m follow one pass of all the others."""
    m = np.asarray(m, dtype=float)
    busiest, total = work.max(axis=1), work.sum(axis=1)
    if vpp == 1:
        return np.maximum(m * busiest, total + (m - 1) * work[:, -1])
    return (m * vpp - 1) * busiest / vpp + total / vpp


@dataclass(frozen=True)
class _Levels:
    """A schedule as a dependency graph in waves: the actions of one wave depend only on earlier waves."""

    waves: tuple[np.ndarray, ...]  # action ids per wave
    prev: np.ndarray  # the rank's previous action (n = none)
    dep: np.ndarray  # the action whose output it needs (n = none)
    dur: np.ndarray  # index of its duration: kind * nv + virtual stage
    rank_last: np.ndarray  # [pp] each rank's last action
    last_b: np.ndarray  # [pp, vpp] each chunk's last backward
    first_b: np.ndarray  # [pp] each rank's first backward


@lru_cache(maxsize=16)  # a long batch's graph holds tens of MB (2 x 39 chunks x 1,024 micro-batches: 27 MB)
def _levels(pp: int, vpp: int, m: int) -> _Levels:
    nv = pp * vpp
    rank, back, mb, chunk = schedule_table(pp, vpp, m).T
    v = virtual_stage(rank, chunk, pp)
    n = len(rank)
    ids = np.arange(n)
    where = np.full((2, nv, m), n)  # action id of (forward/backward, virtual stage, micro-batch)
    where[back, v, mb] = ids
    prev = np.where(np.r_[False, rank[1:] == rank[:-1]], ids - 1, n)
    dep = np.where(back, where[1, np.minimum(v + 1, nv - 1), mb], where[0, np.maximum(v - 1, 0), mb])
    dep = np.where(back & (v == nv - 1) | ~back & (v == 0), n, dep)
    level = np.array(_depths(prev.tolist(), dep.tolist(), np.r_[0, np.nonzero(np.diff(rank))[0] + 1, n].tolist()))
    order = np.argsort(level, kind="stable")
    cuts = np.nonzero(np.diff(level[order]))[0] + 1
    last_b = np.zeros((pp, vpp), dtype=np.int64)
    np.maximum.at(last_b, (rank[back == 1], v[back == 1] // pp), ids[back == 1])
    first_b = np.full(pp, n, dtype=np.int64)
    np.minimum.at(first_b, rank[back == 1], ids[back == 1])
    rank_last = np.r_[np.nonzero(np.diff(rank))[0], n - 1]
    return _Levels(waves=tuple(np.split(order, cuts)), prev=prev, dep=dep, dur=back * nv + v, rank_last=rank_last,
                   last_b=last_b, first_b=first_b)


def _depths(prev: list[int], dep: list[int], bounds: list[int]) -> list[int]:
    """Each action's depth in the dependency graph (1 + the deeper of its rank predecessor and its data
    dependency; index n = none, depth 0), advancing every rank as far as its dependencies allow."""
    n = len(prev)
    depth, done = [0] * (n + 1), [False] * n + [True]
    ptr, left = bounds[:-1], n
    while left:
        moved = 0
        for r, end in enumerate(bounds[1:]):
            i = ptr[r]
            while i < end and done[dep[i]]:
                a, b = depth[prev[i]], depth[dep[i]]
                depth[i] = 1 + (a if a > b else b)
                done[i] = True
                i += 1
            moved += i - ptr[r]
            ptr[r] = i
        if not moved:
            raise ValueError("pipeline schedule deadlocked")
        left -= moved
    return depth[:n]


def _waves_ends(f: np.ndarray, b: np.ndarray, pp: int, vpp: int, m: int) -> tuple[_Levels, np.ndarray]:
    """The schedule of ``m`` micro-batches replayed for many candidates at once, one dependency wave at a time:
    the schedule's graph and every action's end ([actions + 1, N]; the last row, "none", stays 0)."""
    g = _levels(pp, vpp, m)
    durations = np.concatenate([f, b], axis=1).T  # [2 * nv, N]
    end = np.zeros((len(g.prev) + 1, f.shape[0]))
    for wave in g.waves:
        end[wave] = np.maximum(end[g.prev[wave]], end[g.dep[wave]]) + durations[g.dur[wave]]
    return g, end


def _start(g: _Levels, end: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """When actions ``ids`` start: after the rank's previous action and the one whose output they need."""
    return np.maximum(end[g.prev[ids]], end[g.dep[ids]])


def _waves_replay(f: np.ndarray, b: np.ndarray, pp: int, vpp: int, m: int) -> Replay:
    """:func:`simulate` of the schedule of ``m`` micro-batches for many candidates at once."""
    g, end = _waves_ends(f, b, pp, vpp, m)
    return Replay(rank_end=end[g.rank_last].T, last_b_start=_start(g, end, g.last_b).transpose(2, 0, 1),
                  last_b_end=end[g.last_b].transpose(2, 0, 1))


def _extended_many(f: np.ndarray, b: np.ndarray, pp: int, vpp: int, m: int) -> tuple[Replay, np.ndarray]:
    """:func:`_extended` for many candidates at once: their replays at m1 = steady_m(pp, m), m1 + pp and m1 + 2 pp
    extended linearly to ``m``, and [N] whether each candidate was in the steady regime (the rest need the full
    replay), by the same checks."""
    m1 = steady_m(pp, m)
    u = (f + b).reshape(len(f), vpp, pp).sum(axis=1)  # [N, pp] each rank's work per micro-batch
    runs = []
    for k in (m1, m1 + pp, m1 + 2 * pp):
        g, end = _waves_ends(f, b, pp, vpp, k)
        rank_end = end[g.rank_last].T
        runs.append([rank_end.max(axis=1, keepdims=True), rank_end, k * u, _start(g, end, g.first_b).T,
                     _start(g, end, g.last_b).transpose(2, 0, 1), end[g.last_b].transpose(2, 0, 1)])
    steps = (m - m1) // pp
    ok = np.ones(len(f), dtype=bool)
    ext = []
    for a, b2, c in zip(*runs):
        d1, d2 = b2 - a, c - b2
        scale = np.maximum(1.0, np.maximum(np.abs(a), np.abs(c)))
        ok &= (np.abs(d2 - d1) <= 1e-9 * scale).reshape(len(f), -1).all(axis=1)
        ext.append(a + steps * d1)
    grow = runs[1][0][:, 0] - runs[0][0][:, 0]
    busiest = (runs[1][2] - runs[0][2]).max(axis=1)
    ok &= np.abs(grow - busiest) <= 1e-9 * np.maximum(1.0, runs[1][0][:, 0])
    return Replay(rank_end=ext[1], last_b_start=ext[4], last_b_end=ext[5]), ok


REPLAY_FLOATS = 1 << 23  # end times held at once by a many-candidate replay (64 MiB)


def wave_replay(f: np.ndarray, b: np.ndarray, pp: int, vpp: int, m: np.ndarray) -> Replay:
    """The schedule replayed for many candidates at once (``f``, ``b``: [N, pp * vpp]; ``m``: [N]). Up to two
    pipeline groups of micro-batches the replay is exact; beyond, it replays ``m1`` and ``m1 + pp`` micro-batches
    and extends every time linearly to ``m`` (the max-plus steady state :func:`simulate_steps` checks for)."""
    m = np.asarray(m)
    n = f.shape[0]
    out = Replay(rank_end=np.zeros((n, pp)), last_b_start=np.zeros((n, pp, vpp)), last_b_end=np.zeros((n, pp, vpp)))
    short = np.minimum(m, repeating_from(pp))  # interleaved plans have m a multiple of pp
    for mi, rows in by_value(short):
        block = max(16, REPLAY_FLOATS // (2 * (int(mi) + pp) * pp * vpp))  # the replay keeps every action's end
        for lo in range(0, len(rows), block):
            part = rows[lo:lo + block]
            one = _waves_replay(f[part], b[part], pp, vpp, int(mi))
            grow = m[part] > mi
            if grow.any():
                two = _waves_replay(f[part], b[part], pp, vpp, int(mi) + pp)
                steps = ((m[part] - mi) / pp)[:, None]
                for name in REPLAY_FIELDS:
                    a, c = getattr(one, name), getattr(two, name)
                    s = steps.reshape((-1,) + (1,) * (a.ndim - 1))
                    setattr(one, name, np.where(grow.reshape(s.shape), a + (c - a) * s, a))
            for name in REPLAY_FIELDS:
                getattr(out, name)[part] = getattr(one, name)
    return out
