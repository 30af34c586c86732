"""Placing plans on a cluster's node groups (Holmes' idea: heavy traffic inside fast groups, only pipeline sends
across the slow links between them; Metis': layers by each group's speed).

The search first plans the cluster as if homogeneous at its slowest GPU and link (its top-level profile
fields). Each of those plans whose stage (tp x dp x cp GPUs) divides every group's GPUs is then placed: every
group holds whole pipeline ranks, one contiguous block of them per group; the tensor-, context- and
data-parallel groups stay inside a node group, so only pipeline sends cross groups. Every order of the groups is
tried for each stage shape; layers are split evenly, in proportion to each group's speed per layer (the
placed plan's own stage times under an even split; an interleaved plan also by each rank's total) and as those
times say evens the stages out or makes the step fastest for the plan's micro-batches; the fastest placed plans
are then balanced further, a layer at a time to the fastest stage from the slowest one or the busiest rank's, and
the three these moves leave fastest again from their starts, also by any move to or from those stages and the
ranks that finish first and last, while the step gets faster. Plans whose every pipeline rank splits its
replicas over all the groups (``a+b``) are placed so too. Every placed plan is priced exactly
(cost_models/placement.py). The keys a search holds are held here too: a fixed placement is the only one tried, a
fixed layer split is kept.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from cost_models.headroom import usable_GiB
from cost_models.placement import link
from cost_models.step import estimate, split_estimates
from planner.refine import PlanResult
from specs.cluster import ClusterSpec
from specs.model import ModelSpec
from specs.parallel import ParallelConfig, default_split
from specs.placement import entry_groups, groups_text, splits_replicas
from specs.rules import PlanContext, allowed_splits, placement_problem
from specs.state import StateSpec

MAX_BASES = 8  # distinct homogeneous plans placed as whole pipeline ranks per group (fastest first)
# and beyond them the fastest of each further shape (tp, pp, dp, cp, vpp), up to this many shapes in all: ranked at
# the slowest link, the shapes that gain most from placing (less data-parallel traffic on a slow group, a deeper
# pipeline) may come after several plans of one shape
MAX_SHAPES = 32
MAX_SHARES = 8  # shares of the replicas a split placement may have (the groups' sizes over their gcd, summed)
SPLIT_BASES = 32  # distinct homogeneous plans placed with every pipeline rank split over the groups (one way each)
MAX_MOVES = 16  # single-layer moves tried per placed plan
MOVED = 3  # placed plans balanced by wide single-layer moves (those the narrow moves leave fastest)
WIDE_PRICES = 300  # single-layer moves priced per plan balanced widely (~1 s at 80 layers)
WIDE_ACTIONS = 1_000_000  # and at most this many micro-batch x stage actions replayed for them (many micro-batches:
# each move's schedule replay costs more, and the slowest stage's m-1 repeats, which the narrow moves address, dominate)
ORDERS = 2  # orders of the groups kept per stage shape
MAX_SPLITS = 2000  # layer splits an exhaustive placement tries per plan and order (beyond: the heuristic's alone)


def placements(cluster: ClusterSpec, cfg: ParallelConfig, moe: bool = False) -> list[tuple[str, ...]]:
    """Every placement of ``cfg``'s pipeline ranks as one contiguous block per node group (each group's GPUs
    hold whole ranks of tp*dp*cp GPUs), in every order of the groups; and every pipeline rank split over all of
    them (``a+b``: its dp replicas in shares by the groups' sizes, ``a+a+b`` for a group twice the other's, each group
    running a whole pipeline per share; dp crosses between groups, hierarchically; at most :data:`MAX_SHARES`
    shares). Only those that keep each node in one group."""
    stage = cfg.tp * cfg.dp * cfg.cp
    groups = cluster.groups
    out = []
    if not any(n % stage for n in groups.values()) and sum(n // stage for n in groups.values()) == cfg.pp:
        out = [tuple(g for g in order for _ in range(groups[g] // stage)) for order in itertools.permutations(groups)]
    shares = _shares(cluster)
    if shares and cfg.dp % len(shares) == 0 and cfg.pp * stage == cluster.num_gpus:
        out.append(("+".join(shares),) * cfg.pp)
    return [w for w in out if placement_problem(w, cfg.tp, cfg.dp, cfg.cp, cfg.pp, groups, cluster.node_gpus,
                                                moe) is None]


def _shares(cluster: ClusterSpec) -> list[str]:
    """The shares a split placement (``a+b``) gives each pipeline rank's replicas: a group's name per gcd of the
    groups' GPU counts it holds; empty where the cluster has one group or more than :data:`MAX_SHARES` shares."""
    groups = cluster.groups
    unit = math.gcd(*groups.values()) if groups else 1
    shares = [g for g, n in groups.items() for _ in range(n // unit)]
    return shares if len(groups) > 1 and len(shares) <= MAX_SHARES else []


class GroupView(NamedTuple):
    """A node group's own view (GPU, links, NICs) at the whole cluster's size, its share of the cluster's GPUs, and
    the link from the group to its best-linked other group ((bytes/s per GPU, seconds); None: no other group)."""

    view: ClusterSpec
    share: float
    edge: tuple[float, float] | None


def whole_views(cluster: ClusterSpec) -> list[GroupView]:
    """Each node group's :class:`GroupView` (groups whose node size does not divide the cluster's GPUs left out): how
    the search ranks homogeneous plans for placing on the groups (planner/search.py)."""
    n = cluster.num_gpus
    out = []
    for g in cluster.groups:
        v = cluster.group_view(g)
        if n % v.gpus_per_node == 0:
            links = [link(cluster, (g, h)) for h in cluster.groups if h != g]
            edge = max(links, key=lambda bl: (bl[0], -bl[1])) if links else None
            out.append(GroupView(v.resized(nodes=n // v.gpus_per_node), v.num_gpus / n, edge))
    return out


def split_views(cluster: ClusterSpec) -> tuple[list[ClusterSpec], int] | None:
    """:func:`whole_views` with the smallest GPUs' memory (a split plan's every group holds every stage), and the
    shares a split placement's data-parallel size must be a multiple of; None where no plan splits. A split plan
    (``a+b``) runs a share of every pipeline rank's replicas on each group and the slowest group sets the pace, so
    the slowest group's view prices it roughly, the cross-group part of its data-parallel reduce aside: what ranks
    homogeneous plans for splitting (the merged view prices their data-parallel traffic at the slow link between
    the groups, which the hierarchical reduce mostly keeps inside them; the placed plans are priced exactly)."""
    shares = _shares(cluster)
    if not shares:
        return None
    smallest = min(cluster.memory_sizes_GiB)
    return [v.model_copy(update={"gpu": v.gpu.model_copy(update={"memory_GiB": smallest})})
            for v, _, _ in whole_views(cluster)], len(shares)


def proportional_layers(num_layers: int, speed: list[float]) -> tuple[int, ...]:
    """``num_layers`` split over stages in proportion to ``speed`` (at least one each; largest remainders)."""
    share = np.asarray(speed, dtype=float) / sum(speed) * num_layers
    out = np.maximum(1, np.floor(share)).astype(int)
    while out.sum() < num_layers:
        out[int(np.argmax(share - out))] += 1
    while out.sum() > num_layers:
        out[int(np.argmax(np.where(out > 1, out - share, -np.inf)))] -= 1
    return tuple(int(x) for x in out)


def _price(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, global_batch: int, headroom_GiB: float | None,
           state: StateSpec) -> PlanResult:
    return PlanResult(cfg, estimate(model, cluster, cfg, global_batch, headroom_GiB, state=state))


def _with_splits(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, splits: list[tuple[int, ...]],
                 global_batch: int, headroom_GiB: float | None, state: StateSpec) -> list[PlanResult]:
    """``cfg`` with each of these layer splits that its rules allow, priced together."""
    ok = allowed_splits(cfg, splits, PlanContext.on(model, cluster, global_batch))
    return [PlanResult(replace(cfg, layers=s), e)
            for s, e in zip(ok, split_estimates(model, cluster, cfg, ok, global_batch, headroom_GiB, state))]


def _better(a: PlanResult, b: PlanResult | None) -> bool:
    return b is None or a.rank_key() < b.rank_key()


def _speeds(model: ModelSpec, cfg: ParallelConfig, priced: PlanResult) -> dict[str, float]:
    """Layers per second of each node group, from a placed plan's stage times (each stage's time over its layers)."""
    layers = cfg.stage_layers(model.num_layers)
    groups = cfg.placement or ()
    per_layer = [t / max(n, 1) for t, n in zip(priced.estimate.stage_time_s, layers)]
    nv = cfg.pp * cfg.vpp
    return {g: 1.0 / float(np.mean([per_layer[j] for j in range(nv) if groups[j % cfg.pp] == g])) for g in groups}


def by_speed(model: ModelSpec, cfg: ParallelConfig, speeds: dict[str, float]) -> ParallelConfig:
    """``cfg`` with its layers split in proportion to its stages' groups' ``speeds``."""
    groups = cfg.placement or ()
    nv = cfg.pp * cfg.vpp
    return replace(cfg, layers=proportional_layers(model.num_layers, [speeds[groups[j % cfg.pp]] for j in range(nv)]))


def by_rank_speed(model: ModelSpec, cfg: ParallelConfig, speeds: dict[str, float]) -> ParallelConfig:
    """``cfg`` with each pipeline rank's layers in proportion to its group's ``speeds``, spread evenly over the rank's
    chunks (the first chunks take the odd layers; ``cfg`` unchanged where a rank would hold fewer layers than chunks).
    An interleaved plan's per-chunk shares round the same way on every chunk (:func:`by_speed` may give every chunk
    the same count); a rank's total does not."""
    groups = cfg.placement or ()
    totals = proportional_layers(model.num_layers, [speeds[g] for g in groups])
    if min(totals) < cfg.vpp:
        return cfg
    per = [[n // cfg.vpp + (k < n % cfg.vpp) for k in range(cfg.vpp)] for n in totals]
    return replace(cfg, layers=tuple(per[j % cfg.pp][j // cfg.pp] for j in range(cfg.pp * cfg.vpp)))


def _by_speeds(model: ModelSpec, cfg: ParallelConfig, speeds: dict[str, float]) -> list[ParallelConfig]:
    """``cfg`` split :func:`by_speed`, and for an interleaved plan also :func:`by_rank_speed` where that differs."""
    out = [by_speed(model, cfg, speeds)]
    ranked = by_rank_speed(model, cfg, speeds)
    return out + ([ranked] if cfg.vpp > 1 and ranked.layers not in (out[0].layers, cfg.layers) else [])


def _by_own_speeds(model: ModelSpec, priced: PlanResult) -> ParallelConfig:
    """A placed plan with its layers split by its own groups' speeds (its stage times as priced)."""
    return by_speed(model, priced.config, _speeds(model, priced.config, priced))


def fitted(model: ModelSpec, a: PlanResult, b: PlanResult, microbatches: int) -> list[tuple[int, ...]]:
    """Layer splits that should make the step fast, from two priced splits of the same placed plan: each stage's time
    is taken as linear in its layers (its two points; a stage whose layers did not change gets its group's mean time
    per layer). The split that evens the stages out (layers handed out one at a time to the stage that stays fastest
    with one more, which minimises the slowest stage), and, where it differs, the one that minimises a 1F1B
    pipeline's step over ``microbatches`` (not interleaved): the slowest stage ``microbatches - 1`` times plus every
    stage once; with one micro-batch that puts every layer it can on the fastest groups. None (empty) when the two
    splits do not tell."""
    la, lb = a.config.stage_layers(model.num_layers), b.config.stage_layers(model.num_layers)
    ta, tb = a.estimate.stage_time_s, b.estimate.stage_time_s
    groups = a.config.placement or ()
    pp = a.config.pp
    slope = [(y - x) / (m - n) if m != n else None for x, y, n, m in zip(ta, tb, la, lb)]
    known = [s for s in slope if s is not None and s > 0]
    if not known or len(slope) > model.num_layers:
        return []
    mean = {g: np.mean([s for j, s in enumerate(slope) if s is not None and s > 0 and groups[j % pp] == g] or known)
            for g in groups}
    per = np.array([s if s is not None and s > 0 else float(mean[groups[j % pp]]) for j, s in enumerate(slope)])
    base = np.array([t - p * n for t, p, n in zip(ta, per, la)])
    out = [1] * len(per)
    for _ in range(model.num_layers - len(per)):
        j = min(range(len(per)), key=lambda k: base[k] + per[k] * (out[k] + 1))
        out[j] += 1
    even = tuple(out)
    step = _fewest_step(base, per, model.num_layers, microbatches) if a.config.vpp == 1 else None
    return [even] + ([step] if step is not None and step != even else [])


def _fewest_step(base: np.ndarray, per: np.ndarray, num_layers: int, microbatches: int) -> tuple[int, ...] | None:
    """The split (one layer per stage at least) minimising ``(microbatches - 1) x max + sum`` of the stages' times
    ``base + per x layers``: for every bound on the slowest stage that some stage's count meets exactly, the layers
    go to the cheapest stages first up to it (the least sum under that bound)."""
    stages = len(per)
    bounds = np.unique(base[:, None] + per[:, None] * np.arange(1, num_layers + 1))
    caps = np.clip(np.floor((bounds[:, None] - base) / per + 1e-9), 0, num_layers)
    order = np.argsort(per, kind="stable")
    extra = (caps[:, order] - 1).clip(min=0)
    rest = num_layers - stages
    ok = (caps >= 1).all(axis=1) & (extra.sum(axis=1) >= rest)
    if not ok.any():
        return None
    extra = extra[ok]
    before = np.cumsum(extra, axis=1) - extra
    counts = np.empty_like(extra)
    counts[:, order] = 1 + np.clip(rest - before, 0, extra)
    times = base + per * counts
    best = int(np.argmin((microbatches - 1) * times.max(axis=1) + times.sum(axis=1)))
    return tuple(int(x) for x in counts[best])


def moved(model: ModelSpec, cluster: ClusterSpec, best: PlanResult, global_batch: int, headroom_GiB: float | None,
          state: StateSpec, wide: bool = False) -> PlanResult:
    """``best`` after single-layer moves, the best move of each round while the step gets faster: to its fastest
    (virtual) stage from its slowest one or from the busiest pipeline rank's first. ``wide``: also every other move
    to or from those stages and the first stages of the ranks that finish first and last (their data-parallel
    reduce and optimizer included), up to :data:`WIDE_PRICES` of them priced (fewer where the schedule is long:
    :data:`WIDE_ACTIONS`). With few micro-batches the first rank's last backward waits on every later stage and a
    slower group's reduce shrinks with its layers, so layers moved onto the slowest stage can shorten the step; and
    an interleaved plan's fastest split is not the one that evens its stages out."""
    cfg = best.config
    budget = min(WIDE_PRICES, WIDE_ACTIONS // (cfg.microbatches(global_batch) * cfg.pp * cfg.vpp)) if wide else 0
    for _ in range(MAX_MOVES):
        est = best.estimate
        times, finish = est.stage_time_s, est.rank_finish_s
        slow, fast = [int(np.argmax(times)), est.critical_rank], [int(np.argmin(times))]
        pairs = list(dict.fromkeys((a, b) for a in slow for b in fast if a != b))
        if budget > 0:
            ends = {*slow, *fast, int(np.argmax(finish)), int(np.argmin(finish))}
            more = [(a, b) for a, b in itertools.permutations(range(len(times)), 2)
                    if (a in ends or b in ends) and (a, b) not in pairs]
            pairs += more[:budget]
            budget -= len(more[:budget])
        now = best.config.stage_layers(model.num_layers)
        moves = [tuple(n - (j == a) + (j == b) for j, n in enumerate(now)) for a, b in pairs if now[a] > 1]
        tried = _with_splits(model, cluster, best.config, list(dict.fromkeys(moves)), global_batch, headroom_GiB,
                             state)
        better = [c for c in tried if _better(c, best)]
        if not better:
            break
        best = min(better, key=PlanResult.rank_key)
    return best


def _orders(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, global_batch: int, headroom_GiB: float | None,
            state: StateSpec, hold: bool = False) -> list[tuple[PlanResult, dict[str, float]]]:
    """A placed plan priced with its layers split evenly, by its groups' speed and as :func:`fitted` splits them
    (only evenly when every stage is on the same groups), each with the groups' speeds. ``hold``: only with its own
    split (a fixed one)."""
    even = _price(model, cluster, cfg, global_batch, headroom_GiB, state)
    speeds = _speeds(model, even.config, even)
    if hold or len(set(cfg.placement or ())) == 1:  # every stage on the same groups: no group is faster than another
        return [(even, speeds)]
    split, *by_rank = [_price(model, cluster, c, global_batch, headroom_GiB, state)
                       for c in _by_speeds(model, even.config, speeds)]
    out = [(even, speeds), (split, speeds)] + [(p, speeds) for p in by_rank]
    have = {p.config.stage_layers(model.num_layers) for p, _ in out}
    out += [(_price(model, cluster, replace(even.config, layers=fit), global_batch, headroom_GiB, state), speeds)
            for fit in fitted(model, even, split, cfg.microbatches(global_batch)) if fit not in have]
    return out


def holds_split(fixed: dict[str, Any]) -> bool:
    """Whether ``fixed`` (the plan keys a search holds) fixes the layer split: ``layers``, or per-stage
    ``recompute_layers`` (counts that belong to one split)."""
    counts = fixed.get("recompute_layers")
    return "layers" in fixed or isinstance(counts, tuple) and len(set(counts)) > 1  # (equal counts: one count)


def place(model: ModelSpec, cluster: ClusterSpec, ranked: list[PlanResult], global_batch: int,
          headroom_GiB: float | None, state: StateSpec, exhaustive: bool = False,
          fixed: dict[str, Any] | None = None, progress: Callable[[int, int], None] | None = None
          ) -> list[PlanResult]:
    """Placed versions of the homogeneous plans ``ranked`` (best first). For the first plan of each stage shape
    (tp, dp, cp, vpp) every order of the groups is priced with the layers split evenly, by group speed and as
    :func:`fitted` splits them; the shape's other plans take its :data:`ORDERS` best orders, split by
    the first plan's groups' speeds and by their own; the best :data:`MOVED` placed plans, and the best of each
    shape in each kept order, are then balanced by single-layer moves (:func:`moved`), and the :data:`MOVED` those
    leave fastest by wide ones from their starts. ``exhaustive``: so for
    every plan of ``ranked``, and each also with every layer split (one layer per stage at least) where there are
    at most :data:`MAX_SPLITS` of them. ``fixed``: the plan keys the
    search holds; a fixed ``placement`` is the only one tried, and a fixed split (:func:`holds_split`) is kept.
    ``progress``: told (done, total) as the plans are placed. Best first, those that fit before those that do not."""
    fixed = fixed or {}
    hold = holds_split(fixed)
    out = _placed(model, cluster, ranked, global_batch, headroom_GiB, state, fixed,
                  len(ranked) if exhaustive else None, progress)
    if exhaustive and not hold:
        out += [p for cfg in _bases(ranked, len(ranked)) for where in _ways(cluster, cfg, model.moe is not None, fixed)
                for p in _with_splits(model, cluster, replace(cfg, placement=where),
                                      splits(model.num_layers, cfg.pp * cfg.vpp), global_batch, headroom_GiB, state)]
    out.sort(key=PlanResult.rank_key)
    unique = {_plain(p.config): p for p in reversed(out)}  # a split equal to the even one is the even one
    return sorted(unique.values(), key=PlanResult.rank_key)


def _placed(model: ModelSpec, cluster: ClusterSpec, ranked: list[PlanResult], global_batch: int,
            headroom_GiB: float | None, state: StateSpec, fixed: dict[str, Any], limit: int | None,
            progress: Callable[[int, int], None] | None = None) -> list[PlanResult]:
    """:func:`place`'s heuristic: the placed plans of :func:`_chosen`'s bases (``limit``: that many of each kind
    instead of :data:`MAX_BASES` and :data:`SPLIT_BASES`), best first. ``progress``: told (done, total) of the
    bases and the plans balanced."""
    hold = holds_split(fixed)
    moe = model.moe is not None
    out = []
    orders_of: dict[tuple[tuple[int, int, int, int], bool], list[tuple[tuple[str, ...], dict[str, float]]]] = {}
    small = usable_GiB(headroom_GiB, cluster.memory_sizes_GiB[0])
    chosen = _chosen(cluster, ranked, moe, fixed, small, limit)
    for done, (base, kinds) in enumerate(chosen):
        if progress:
            progress(done, len(chosen) + MOVED)
        shape = (base.tp, base.dp, base.cp, base.vpp)
        for split in kinds:  # True: the replicas split over the groups
            if (shape, split) in orders_of:
                for w, speeds in orders_of[shape, split]:
                    where = replace(base, placement=w)
                    if split or hold:
                        out.append(_price(model, cluster, where, global_batch, headroom_GiB, state))
                        continue
                    # layers by the shape's first plan's groups' speeds, then by its own
                    first, *by_rank = [_price(model, cluster, c, global_batch, headroom_GiB, state)
                                       for c in _by_speeds(model, where, speeds)]
                    own = _by_own_speeds(model, first)
                    out += [first, *by_rank] + ([_price(model, cluster, own, global_batch, headroom_GiB, state)]
                                                if own != first.config else [])
                continue
            ways = [w for w in _ways(cluster, base, moe, fixed) if splits_replicas(w) == split]
            tried = [t for w in ways for t in _orders(model, cluster, replace(base, placement=w), global_batch,
                                                       headroom_GiB, state, hold)]
            tried.sort(key=lambda t: t[0].rank_key())
            out += [t[0] for t in tried]
            best_orders = list(dict.fromkeys(t[0].config.placement for t in tried))[:ORDERS]
            orders_of[shape, split] = [(w, next(sp for p, sp in tried if p.config.placement == w))
                                       for w in best_orders]
    out.sort(key=PlanResult.rank_key)
    if hold:
        if progress:
            progress(len(chosen), len(chosen))
        return out
    firsts = sorted({replace(p.config, layers=None): i for i, p in reversed(list(enumerate(out)))}.values())
    kept = {(shape, w) for (shape, split), orders in orders_of.items() if not split for w, _ in orders}
    per_order = sorted({_shape_order(out[i].config): i for i in reversed(firsts)
                        if _shape_order(out[i].config) in kept}.values())
    # every candidate balanced by the narrow moves first; the wide moves then go to the plans those leave fastest
    # (a start's rank is a poor guide: an interleaved plan's narrow moves often stall where wide ones go far), each
    # wide-moved from its start, and the best also from its next-best split where it interleaves (moves from a
    # faster start, such as a split by rank, can stop at a slower split)
    starts = {i: out[i] for i in set(firsts[:MOVED]) | set(per_order)}
    for done, i in enumerate(sorted(starts)):
        if progress:
            progress(len(chosen) + done, len(chosen) + len(starts) + MOVED)
        out[i] = moved(model, cluster, out[i], global_batch, headroom_GiB, state)
    ahead = sorted(starts, key=lambda i: out[i].rank_key())[:MOVED]
    second = bool(ahead) and out[ahead[0]].config.vpp > 1
    wide = list(dict.fromkeys(ahead + (_two_starts(out, ahead[0], model.num_layers, starts) if second else [])))
    total = len(chosen) + len(starts) + len(wide)
    for done, i in enumerate(wide):
        if progress:
            progress(total - len(wide) + done, total)
        tried = moved(model, cluster, starts.get(i, out[i]), global_batch, headroom_GiB, state, wide=True)
        out[i] = min((tried, out[i]), key=PlanResult.rank_key)
    if progress:
        progress(total, total)
    return out


def _two_starts(out: list[PlanResult], j: int, num_layers: int, starts: dict[int, PlanResult]) -> list[int]:
    """``j`` and the first plan of ``out`` after it (best first) that is the same plan with another layer split
    (``starts``: the plans some of ``out`` were before their moves)."""
    key, split = replace(out[j].config, layers=None), starts.get(j, out[j]).config.stage_layers(num_layers)
    return [j] + [i for i in range(j + 1, len(out)) if replace(out[i].config, layers=None) == key
                  and out[i].config.stage_layers(num_layers) != split][:1]


def _plain(cfg: ParallelConfig) -> ParallelConfig:
    return replace(cfg, layers=None) if cfg.layers == default_split(sum(cfg.layers or ()), cfg.num_chunks) else cfg


def _shape_order(cfg: ParallelConfig) -> tuple[tuple[int, int, int, int], tuple[str, ...] | None]:
    return (cfg.tp, cfg.dp, cfg.cp, cfg.vpp), cfg.placement


def _ways(cluster: ClusterSpec, cfg: ParallelConfig, moe: bool, fixed: dict[str, Any]) -> list[tuple[str, ...]]:
    """:func:`placements` of ``cfg``, only those ``fixed`` allows (a fixed ``placement``: it alone)."""
    held = fixed.get("placement")
    return [w for w in placements(cluster, cfg, moe) if held is None or w == held]


def _chosen(cluster: ClusterSpec, ranked: list[PlanResult], moe: bool, fixed: dict[str, Any], small_GiB: float,
            limit: int | None = None) -> list[tuple[ParallelConfig, set[bool]]]:
    """The first :data:`MAX_BASES` (``limit``) distinct configurations of ``ranked`` the groups hold as whole pipeline
    ranks, then the first of each further shape (tp, pp, dp, cp, vpp), its first within ``small_GiB`` (the
    smallest GPUs') and its one needing the least memory (a shape's fastest plan may need the larger GPUs for
    every stage where a leaner one, placed, fits every group), and the first :data:`SPLIT_BASES` (``limit``)
    whose pipeline ranks can be split over the groups; each with the kinds of placement it was taken for (True:
    split)."""
    most_blocks, most_split = (MAX_BASES, SPLIT_BASES) if limit is None else (limit, limit)
    out, blocks, split, shapes = [], 0, 0, set()
    bases = _bases(ranked, len(ranked), holds_split(fixed))
    shape_of = {cfg: (cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.vpp) for cfg in bases}
    leanest = {shape_of[c]: c for c in sorted(bases, key=lambda c: bases[c], reverse=True)}
    fitting = {shape_of[c]: c for c in reversed(bases) if bases[c] <= small_GiB}
    for cfg in bases:
        kinds = {splits_replicas(w) for w in _ways(cluster, cfg, moe, fixed)}
        shape = shape_of[cfg]
        new_shape = (shape not in shapes and len(shapes) < MAX_SHAPES) or (
            shape in shapes and cfg in (leanest[shape], fitting.get(shape)))
        take = {k for k in kinds if (split < most_split if k else blocks < most_blocks or new_shape)}
        if take:
            out.append((cfg, take))
            blocks, split = blocks + (False in take), split + (True in take)
            shapes |= {shape} if False in take else set()
        if blocks >= most_blocks and split >= most_split and len(shapes) >= MAX_SHAPES:
            break
    return out


def _bases(ranked: list[PlanResult], limit: int, hold: bool = False) -> dict[ParallelConfig, float]:
    """The first ``limit`` distinct configurations of ``ranked`` without their placement and (unless ``hold``: a
    fixed split) their layer split (a plan's per-stage recompute counts dropped: they belong to its split), each with
    its first plan's memory per GPU (GiB), in ``ranked``'s order."""
    seen: dict[ParallelConfig, float] = {}
    for r in ranked:
        cfg = replace(r.config, placement=None)
        if not hold:
            keep = cfg.recompute_layers if not isinstance(cfg.recompute_layers, tuple) else None
            cfg = replace(cfg, layers=None, recompute_layers=keep)
        seen.setdefault(cfg, r.estimate.memory_GiB)
        if len(seen) == limit:
            break
    return seen


def splits(num_layers: int, stages: int) -> list[tuple[int, ...]]:
    """Every split of ``num_layers`` over ``stages`` with at least one layer each (none when there are more than
    :data:`MAX_SPLITS` of them)."""
    if math.comb(num_layers - 1, stages - 1) > MAX_SPLITS:
        return []
    return [tuple(b - a for a, b in zip((0, *cuts), (*cuts, num_layers)))
            for cuts in itertools.combinations(range(1, num_layers), stages - 1)]


def explain_placement(cfg: ParallelConfig, num_layers: int) -> str:
    """One sentence: which stages sit on which group with how many layers, and what crosses groups."""
    assert cfg.placement is not None
    layers = cfg.stage_layers(num_layers)
    parts = []
    for g, run in itertools.groupby(range(cfg.pp), key=lambda r: cfg.placement[r]):  # type: ignore[index]
        ranks = list(run)
        held = "/".join(str(layers[j]) for r in ranks for j in range(r, cfg.pp * cfg.vpp, cfg.pp))
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        names = entry_groups(g)
        share = cfg.dp // len(names)
        where = g if len(names) == 1 else " and ".join(f"{n} ({names.count(n) * share} dp replicas)"
                                                       for n in dict.fromkeys(names))
        parts.append(f"pipeline {span} on {where} ({held} layers)")
    split = splits_replicas(cfg.placement)
    inside = "tp" + (", cp" if cfg.cp > 1 else "") + (" and dp" if cfg.dp > 1 and not split else "")
    crossing = ("the data-parallel reduce crosses between groups hierarchically (reduce-scatter inside each group, "
                "all-reduce across, all-gather inside)" if split else "only pipeline sends cross between groups")
    return f"placement {groups_text(cfg.placement)}: {'; '.join(parts)}; {inside} inside each group, {crossing}"
