"""Collective timings over torch.distributed (gloo on CPU, NCCL on GPUs), per level of the machine.

Levels, as the cost model uses them (cost_models/comm.py):
- ``intra``: groups of 2, 4, ... consecutive ranks of a node up to the whole node (every group of a size
  runs at the same time); point-to-point pairs neighbouring ranks of a node.
- ``inter`` (several nodes only): the same over nodes with one rank per node, all local ranks' groups at
  once, as when every tensor-parallel rank runs its data-parallel reduce together; point-to-point pairs
  rank r of one node with rank r of the next.

Message sizes follow the cost model's arguments: the all-reduce buffer, the all-gather *output*, the
reduce-scatter *input*, the all-to-all buffer, the bytes sent point-to-point (each pair exchanges at once,
as pipeline stages do in steady state). A timing is the slowest rank's time per call over several windows
(median on GPUs, mean on CPUs: :func:`hardware_profiles.fit.summarise`): back-to-back calls on GPUs, as
nccl-tests; on CPUs each call follows a burst of compute, whose own time is subtracted (:func:`time_slots`).

Node groups (``autopar profile --group``): the levels of every group are measured at once, each restricted to
its group's ranks (``members``) and laid out on its own nodes (``per_node`` ranks each: groups may differ), and
the links between groups as point-to-point exchanges between a node of each (:func:`run_links`); a timing is
then the slowest rank of its own group or link (a *slot*).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hardware_profiles.fit import summarise
from hardware_profiles.timing import Timer
from specs.cluster import COLLECTIVES
from specs.errors import AutoparError

# torch 2.12 renamed the tensor collectives; keep working on older releases.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Level:
    name: str  # "intra" or "inter"
    groups: dict[int, list[list[int]]]  # group size -> disjoint groups of that size (all measured at once)
    pairs: list[tuple[int, int]]  # point-to-point partners


def _sizes(total: int) -> list[int]:
    """Group sizes to measure among ``total`` peers: powers of two from 2, and ``total`` itself."""
    out, g = [], 2
    while g < total:
        if total % g == 0:
            out.append(g)
        g *= 2
    return out + [total] if total > 1 else []


def levels(world: int, local: int, ranks: list[int] | None = None) -> list[Level]:
    """The levels ``world`` ranks on nodes of ``local`` ranks can measure (none for a single rank).

    Inside a node, groups of 2, 4, ... consecutive ranks up to the whole node (as tensor-parallel groups
    are laid out); across nodes, the same over nodes with one rank per node. Every group of a size runs
    at once, so the measurement shares links (and, on CPUs, cores) as training does. ``ranks`` (a node
    group's ranks, node after node) maps position p to global rank ``ranks[p]``; default: ``range(world)``."""
    if ranks is not None:
        return [Level(lv.name, {g: [[ranks[r] for r in grp] for grp in gs] for g, gs in lv.groups.items()},
                      [(ranks[a], ranks[b]) for a, b in lv.pairs]) for lv in levels(world, local)]
    nodes = world // local
    out = []
    if local > 1:
        groups = {g: [list(range(b, b + g)) for b in range(0, world, g)] for g in _sizes(local)}
        pairs = [(n * local + i, n * local + i + 1) for n in range(nodes) for i in range(0, local - 1, 2)]
        out.append(Level("intra", groups, pairs))
    if nodes > 1:
        groups = {g: [[(b + j) * local + i for j in range(g)] for b in range(0, nodes, g) for i in range(local)]
                  for g in _sizes(nodes)}
        pairs = [(n * local + i, (n + 1) * local + i) for n in range(0, nodes - 1, 2) for i in range(local)]
        out.append(Level("inter", groups, pairs))
    return out


def message_sizes(device: torch.device, quick: bool) -> list[int]:
    """Bytes per message: latency-bound to bandwidth-bound (4 KiB-16 MiB on CPUs, 64 KiB-1 GiB on GPUs)."""
    if device.type == "cuda":
        lo, hi, step = (2**18, 2**28, 4) if quick else (2**16, 2**30, 4)
    else:
        lo, hi, step = (2**12, 2**24, 8) if quick else (2**12, 2**24, 4)
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= step
    return sizes


def _op(name: str, group: dist.ProcessGroup, peer: int | None, nbytes: int, device: torch.device
        ) -> Callable[[], None]:
    """A closure running one collective of ``nbytes`` (the cost model's size convention) on ``group``."""
    n = dist.get_world_size(group)
    elems = max(n, nbytes // 4 // n * n)
    buf = torch.ones(elems, device=device)
    if name == "all_reduce":
        return lambda: dist.all_reduce(buf, group=group)
    if name == "all_gather":
        shard = torch.ones(elems // n, device=device)
        return lambda: _all_gather(buf, shard, group=group)
    if name == "reduce_scatter":
        shard = torch.empty(elems // n, device=device)
        return lambda: _reduce_scatter(shard, buf, group=group)
    if name == "all_to_all":
        out = torch.empty_like(buf)
        return lambda: dist.all_to_all_single(out, buf, group=group)
    if name == "p2p":
        recv = torch.empty_like(buf)

        def swap() -> None:
            ops = [dist.P2POp(dist.isend, buf, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return swap
    raise ValueError(name)


def _slowest(x: list[float], device: torch.device, slots: int = 1, slot: int = 0) -> list[list[float]]:
    """Per slot, the largest of every rank's ``x`` (a rank fills its own slot; the others read 0)."""
    t = torch.zeros(slots, len(x), dtype=torch.float64, device=device)
    t[slot] = torch.tensor(x, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_slots(timer: Timer, fns: list[Callable[[], None]] | None, count: int, window_s: float,
               tick: Callable[[float], None] = lambda _: None, gap: Callable[[], None] | None = None,
               slots: int = 1, slot: int = 0) -> list[list[float]] | None:
    """Seconds per call of each of ``count`` collectives on the slowest rank, per slot: ``slots`` disjoint sets
    of ranks measured at once (one for a homogeneous run; node groups, links between groups), a rank timing its
    ``fns`` for its ``slot``. Every rank of the world calls this (``fns`` None: a rank outside every group) and
    gets every slot's times. Repeats are taken in rounds over the sizes, each window after a barrier, so a busy
    spell of a shared machine spreads over all sizes. None when the backend does not implement the collective
    (on every rank, whichever ones found out).

    With ``gap`` (CPUs), every call follows that burst of compute, as collectives follow kernels in a
    training step, and the burst's own time (measured in the same rounds) is subtracted: a rank that waits
    for a descheduled peer pays for it here as it does in a step, which back-to-back calls would hide."""
    dev = timer.device
    calls: list[Callable[[], object]] = list(fns) if fns else [lambda: None] * count
    if gap is not None and fns:
        calls = [lambda fn=fn: (gap(), fn()) for fn in calls]
    missing = 0.0
    try:
        for fn in calls:
            for _ in range(timer.warmup):
                fn()
    except RuntimeError as err:  # a collective this backend does not implement
        if not _unsupported(err):
            raise
        missing = 1.0
    if _slowest([missing], dev)[0][0]:  # every rank leaves together, members or not
        return None
    timer.sync()
    dist.barrier()
    one = [max(col) for col in zip(*_slowest([timer.window(fn, 1) if fns else 0.0 for fn in calls], dev, slots,
                                             slot))]
    iters = [max(1, min(200, int(window_s / max(t, 1e-6)))) for t in one]
    samples: list[list[float]] = [[] for _ in calls]
    gaps: list[float] = []
    for _ in range(timer.repeats):
        if gap is not None:
            dist.barrier()
            gaps.append(timer.window(gap, max(iters)) if fns else 0.0)
        for i, fn in enumerate(calls):
            dist.barrier()
            samples[i].append(timer.window(fn, iters[i]) if fns else 0.0)
            tick(1.0 / timer.repeats)
    times = [summarise(s, timer.stat) for s in samples]
    if gap is not None and fns:
        g = summarise(gaps, timer.stat)
        times = [max(t - g, 0.05 * t) for t in times]
    return _slowest(times, dev, slots, slot)


def compute_gap(device: torch.device) -> Callable[[], None]:
    """About a millisecond of GEMM on a CPU core (two 256^3 matmuls), the compute between two collectives."""
    a, b = torch.randn(256, 256, device=device), torch.randn(256, 256, device=device)
    out = torch.empty(256, 256, device=device)

    def burst() -> None:
        torch.mm(a, b, out=out)
        torch.mm(out, b, out=out)
    return burst


def _unsupported(err: RuntimeError) -> bool:
    msg = str(err).lower()
    return "not supported" in msg or "not implemented" in msg or "unsupported" in msg


Points = dict[str, dict[str, list[tuple[int, int, float]]]]  # {collective: {level: [(n, bytes, seconds)]}}


def run_all(device: torch.device, local: int, quick: bool,
            tick: Callable[[str, float], None] = lambda what, done: None,
            names: tuple[str, ...] = COLLECTIVES) -> Points:
    """``{collective: {level: [(group size, bytes, seconds), ...]}}``; every rank calls it, rank 0 keeps it.

    Collectives the backend lacks are left out (the caller notes which)."""
    return run_groups(device, [local], quick, [list(range(dist.get_world_size()))], tick, names)[0]


def group_levels(per_node: list[int], members: list[list[int]]) -> list[tuple[str, list[Level | None], list[int]]]:
    """Per level (intra, inter): each set of ``members``' :class:`Level` on its nodes of ``per_node`` ranks (None
    where it has none, e.g. the inter-node level of a one-node group, the intra-node level of one-rank nodes) and
    every group size any set measures, ascending."""
    per_set = [{lv.name: lv for lv in levels(len(m), local, m)} for m, local in zip(members, per_node)]
    out = []
    for name in ("intra", "inter"):
        lvs = [p.get(name) for p in per_set]
        if any(lvs):
            out.append((name, lvs, sorted({n for lv in lvs if lv for n in lv.groups})))
    return out


def _new_groups(lvs: list[Level | None], rank: int) -> tuple[dict[int, dist.ProcessGroup], dist.ProcessGroup | None]:
    """Every level's groups and point-to-point pairs (every rank creates all of them, in the same order):
    this rank's group of each size, and its pair's group."""
    mine: dict[int, dist.ProcessGroup] = {}
    pair = None
    for lv in lvs:
        if lv is None:
            continue
        for size, groups in lv.groups.items():
            for g in groups:
                pg = dist.new_group(g)
                if rank in g:
                    mine[size] = pg
        for a, b in lv.pairs:
            pg = dist.new_group([a, b])
            if rank in (a, b):
                pair = pg
    return mine, pair


def _setup(device: torch.device, quick: bool) -> tuple[Timer, float, list[int], Callable[[], None] | None]:
    """The timer, timing window, message sizes and (CPUs) the compute burst before each call."""
    timer = Timer(device, repeats=5 if quick else 7, warmup=2)
    window_s = 0.003 if device.type == "cpu" else 0.005
    return timer, window_s, message_sizes(device, quick), compute_gap(device) if device.type == "cpu" else None


def run_groups(device: torch.device, per_node: list[int], quick: bool, members: list[list[int]],
               tick: Callable[[str, float], None] = lambda what, done: None,
               names: tuple[str, ...] = COLLECTIVES) -> list[Points]:
    """:func:`run_all` for each set of ranks in ``members`` (node groups: their ranks node after node, every rank
    in one set) on its nodes of ``per_node`` ranks, restricted to that set's ranks; all sets are measured at once,
    and every rank gets every set's."""
    rank = dist.get_rank()
    mine = next(i for i, m in enumerate(members) if rank in m)
    timer, window_s, sizes, gap = _setup(device, quick)
    out: list[Points] = [{} for _ in members]
    for lv_name, lvs, group_sizes in group_levels(per_node, members):
        groups, pair_group = _new_groups(lvs, rank)
        peer = next((b if rank == a else a for a, b in lvs[mine].pairs if rank in (a, b)), None) if lvs[mine] else None
        for name in names:
            cases = [2] if name == "p2p" else group_sizes
            got: list[list[tuple[int, int, float]]] | None = [[] for _ in members]
            for n in cases:
                group = pair_group if name == "p2p" else groups.get(n)
                member = group is not None and (peer is not None or name != "p2p")
                fns = [_op(name, group, peer, b, device) for b in sizes] if member else None
                rows = time_slots(timer, fns, len(sizes), window_s, lambda f, name=name: tick(name, f), gap,
                                  len(members), mine)
                if rows is None:  # a collective this backend does not implement
                    got = None
                    break
                for i, lv in enumerate(lvs):
                    if lv is not None and (bool(lv.pairs) if name == "p2p" else n in lv.groups):
                        got[i] += [(n, b, t) for b, t in zip(sizes, rows[i])]
            for i, pts in enumerate(got or []):
                if pts:
                    out[i].setdefault(name, {})[lv_name] = pts
    return out


def run_links(device: torch.device, quick: bool, rounds: list[list[list[tuple[int, int]]]],
              tick: Callable[[str, float], None] = lambda what, done: None) -> list[list[list[tuple[int, float]]]]:
    """Point-to-point between nodes of two groups: per round, per link (its pairs of ranks), ``[(bytes, seconds)]``.

    Every pair of a link exchanges at once (local rank i of one node with local rank i of the other, for every i
    both nodes have, so they share the nodes' NICs as a pipeline's sends do), as do the links of a round (they
    share no node); every rank calls it (a rank in no pair times nothing) and gets every link's slowest pair's
    times."""
    rank = dist.get_rank()
    timer, window_s, sizes, gap = _setup(device, quick)
    out = []
    for links in rounds:
        my_link, group, peer = 0, None, None
        for i, pairs in enumerate(links):  # every rank creates every pair's group, in the same order
            for a, b in pairs:
                pg = dist.new_group([a, b])
                if rank in (a, b):
                    my_link, group, peer = i, pg, b if rank == a else a
        fns = [_op("p2p", group, peer, b, device) for b in sizes] if group is not None else None
        rows = time_slots(timer, fns, len(sizes), window_s, lambda f: tick("links", f), gap, len(links), my_link)
        if rows is None:
            raise AutoparError("this backend has no point-to-point send: the links between groups cannot be measured")
        out.append([list(zip(sizes, row)) for row in rows])
    return out


def total_ticks(device: torch.device, per_node: list[int], quick: bool, members: list[list[int]],
                names: tuple[str, ...] = COLLECTIVES, link_rounds: int = 0) -> int:
    """Progress units of :func:`run_groups` (and ``link_rounds`` rounds of :func:`run_links`): one per size timed."""
    p2p = "p2p" in names
    per = sum(len(sizes) * (len(names) - p2p) + p2p for _, _, sizes in group_levels(per_node, members))
    return (per + link_rounds) * len(message_sizes(device, quick))
