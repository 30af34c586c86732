"""Plan search: enumerate every parallel configuration, price them all, refine the best exactly.

1. ``planner.space.enumerate_space`` lists every valid combination of tp, cp, pp, dp, micro-batch, vpp, sp,
   recompute, ZeRO stage, dp_overlap and tp_overlap as numpy arrays (keys in ``fixed`` are held).
2. ``cost_models.batch`` prices all of them at once with the cost model's own terms: every candidate's memory;
   the step time, the pipeline in closed form, of those that fit and whose lower bound (their compute alone)
   leaves them a chance among the fastest; those near the fastest get the pipelines the closed form is least
   sure of replayed.
3. The fastest that fit are re-priced with the exact model (schedule replay) after the ILP (planner/ilp.py,
   via planner/refine.py) has chosen their layer split and per-stage recompute; the result is sorted.
4. On a cluster of node groups, steps 1-3 plan it as homogeneous at its slowest GPU and link (where its groups'
   GPUs differ in memory, also the fastest pipelined plans only the larger GPUs hold); the best of those plans, and
   the fastest of each shape as :func:`_placeable` ranks them for placing (at the merged view, as if placed on the
   groups' own views, and on the slowest group's view for plans split over the groups, also per ZeRO stage), are
   then placed on the groups (planner/placement.py), each stage checked on its own group's GPUs, and the placed ones
   compete with the homogeneous. The :data:`FOCUS` best placements are then searched again each as
   ``--fix placement=`` searches it.
``exhaustive=True`` drops the pruning of the space (every micro-batch size, interleave degree and cp) and
replays every candidate's schedule table as the exact model does, and solves the stage ILP for every finalist (the
default search: for the ILP_SOLVES fastest).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cost_models.batch import BatchResult, estimate_batch
from cost_models.comm import CommModel, EdgeComm
from cost_models.compute import ComputeModel
from cost_models.headroom import check_headroom, usable_GiB
from cost_models.pipeline import CLOSED_FORM_OPTIMISM, CLOSED_FORM_PESSIMISM
from cost_models.stages import layer_terms
from cost_models.step import estimate
from planner.placement import GroupView, place, placements, split_views, whole_views
from planner.refine import PlanResult, refine
from planner.space import enumerate_space, unplaced
from specs.cluster import ClusterSpec
from specs.errors import AutoparError
from specs.model import ModelSpec
from specs.parallel import ParallelConfig, typed_keys
from specs.placement import splits_replicas
from specs.rules import PlanContext, plan_problem, tp_node_problem
from specs.state import StateSpec

__all__ = ["PlanResult", "SearchResult", "enumerate_space", "search", "min_gpus_to_fit"]

# The first ranking prices every candidate's pipeline in closed form, at most CLOSED_FORM_OPTIMISM optimistic and
# CLOSED_FORM_PESSIMISM pessimistic (cost_models/pipeline.py; interleaved chunks of unequal size). A candidate whose
# time T0 is above (1 + pessimism) / (1 - optimism) times the fastest T0 cannot be the fastest: only those below
# this factor, with a margin, get the pipelines the closed form is least sure of replayed.
CLOSED_FORM_SLACK = round((1 + CLOSED_FORM_PESSIMISM) / (1 - CLOSED_FORM_OPTIMISM), 2) + 0.02
# Stage ILPs per search: the fastest finalists whose split the ILP may improve get one each (each stops on a
# node limit, planner/ilp.py), the later ones keep the even split: a hard MIP (64 virtual stages with per-stage
# recompute) must not make planning take minutes, and a count, not a time budget, keeps the plan the same under any
# load (a 1 s budget once gave Llama 3 405B on 8,192 GPUs a 7% slower plan on a busy machine).
ILP_SOLVES = 3  # (an exhaustive search solves it for every finalist)
EXHAUSTIVE_BASES = 32  # homogeneous plans an exhaustive search of a cluster of node groups places every way
SHAPE = ("tp", "pp", "dp", "cp", "vpp")  # a plan's shape: what placing it on node groups depends on
SHAPE_BASES = 16  # shapes (SHAPE) refined to place on node groups, per ranking (whole ranks, split)
# The best placements found are each searched again as ``--fix placement=`` searches them: held, the pool of plans to
# place is that pipeline depth's alone, and a shape's variants (micro-batch, ZeRO, overlap, interleave) that the whole
# search's limits on shapes and bases leave out get placed there.
FOCUS = 2
EDGE_BATCH = 1024  # candidates first priced with their sends across the link between groups (then twice as many)
ROOMIER = 2.0  # the as-if-placed ranking prices a plan on a group whose GPUs it needs up to this many times (it
# holds fewer layers there)
SPLIT_SCAN = 64  # fastest homogeneous plans tried split over the node groups (a+b)


@dataclass
class SearchResult:
    plans: list[PlanResult]  # best first; empty when nothing fits
    candidates: int  # configurations priced
    seconds: float
    closest: PlanResult | None = None  # when nothing fits: the plan needing the least memory
    exhaustive: bool = False
    ranked: list[PlanResult] = field(default_factory=list)  # every exactly-priced plan that fits, best first
    # a cluster of node groups: the best plan of it seen as homogeneous at its slowest GPU and link (what the
    # placed plans above are compared with)
    homogeneous: PlanResult | None = None
    # node groups: the exactly priced plans that fit the largest group's GPUs, fastest first (what may be placed)
    roomy: list[PlanResult] = field(default_factory=list)


def search(model: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict[str, Any] | None = None,
           top: int = 5, exhaustive: bool = False, headroom_GiB: float | None = None, refine_count: int | None = None,
           progress: Callable[..., None] | None = None, flags: dict[str, str] | None = None,
           state: StateSpec | None = None,
           place_groups: bool = True, shapes: tuple[tuple[str, ...], ...] = (),
           views: list[GroupView] | None = None) -> SearchResult:
    """Find the fastest plans that fit; ``fixed`` holds plan keys constant (``flags``: the option each came from, for
    error messages; default ``--fix``). On a cluster of node groups (``place_groups``, unless ``fixed`` holds
    ``placement=none``) the plans placed on the groups compete with those that treat it as homogeneous at its slowest
    link. ``headroom_GiB``: memory kept free per GPU (None: the default, as ``autopar plan``'s, a share of each GPU:
    cost_models/headroom.py). ``progress``: told (done, total[, share of the work]) as candidates are priced and, on
    node groups, as the plans to place are ranked, placed and the best placements searched again (its
    ``stage(name)``, where it has one, told of each such stage first). ``shapes``: sets of plan keys (:data:`SHAPE`,
    say); refine the fastest plan of each of the fastest ``refine_count`` shapes (by each set, as separate searches
    would: the stage ILPs shared out the same), every candidate priced in closed form first, instead of the fastest
    plans (what is placed on node groups: ranked at the merged view, one shape's variants crowd out the shapes
    placing helps most); ranked, with ``views`` (:class:`planner.placement.GroupView`, shares summing to 1), by their
    closed-form times on those views with the layers spread over them (:func:`_as_placed`; node groups' own views:
    roughly the time placed with layers split by speed, where the merged view prices every link as the slowest)."""
    fixed = typed_keys(dict(fixed or {}))  # (the API's lists: a placement or per-stage counts as given in a plan file)
    fixed, no_placement = unplaced(fixed, cluster, (flags or {}).get("placement", "--fix"))
    place_groups = place_groups and not no_placement
    state = state or StateSpec.default(cluster.precision)
    t0 = time.perf_counter()
    if global_batch <= 0:
        raise AutoparError(f"--global-batch must be positive, got {global_batch}")
    check_headroom(headroom_GiB, cluster)
    if fixed.get("recompute_layers") is not None:
        fixed.setdefault("recompute", "full")
    cands = enumerate_space(model, cluster, global_batch, fixed, exhaustive, flags)
    cap = usable_GiB(headroom_GiB, cluster.gpu.memory_GiB)  # the merged view's GPU on node groups (the smallest)
    # plans to place on node groups may need only their largest GPUs' memory (each placed stage is checked on its own)
    room = max(cap, usable_GiB(headroom_GiB, cluster.memory_sizes_GiB[-1]))
    n_ref = refine_count or max(2 * top, 16)
    mode = "exact" if exhaustive else "closed" if shapes else "mixed"
    keep = None if exhaustive or shapes else (n_ref, CLOSED_FORM_SLACK)
    if views:
        res = _as_placed(model, views, cands, global_batch, state, headroom_GiB, (shapes, n_ref) if shapes else None)
        fits = np.isfinite(res.step_time)
    else:
        res = estimate_batch(model, cluster, cands, global_batch, state, mode, progress, fits_GiB=cap, keep=keep)
        fits = res.memory_GiB <= cap
    order = np.argsort(np.where(fits, res.step_time, np.inf), kind="stable")
    n_fit = int(fits.sum())
    sets = max(1, len(shapes))  # rows[i] is in the pool of a search of shapes[k] alone where owned[i, k]
    rows, owned = (_first_of_shapes(cands, order[:n_fit], n_ref, res.memory_GiB, cap, shapes) if shapes
                   else (order[:min(n_ref, n_fit)], np.ones((min(n_ref, n_fit), 1), dtype=bool)))
    if n_fit < top:  # few or none fit: the ones needing the least memory too
        lean = np.argsort(res.memory_GiB)[:8]
        rows, owned = np.concatenate([rows, lean]), np.vstack([owned, np.ones((len(lean), sets), dtype=bool)])
    # node groups of different GPUs: also the fastest pipelined plans only their larger GPUs hold (placed, a group
    # holds whole stages; an unpipelined plan's replicas span every group's GPUs, the smallest too)
    roomier = np.nonzero((res.memory_GiB > cap) & (res.memory_GiB <= room) & (cands.pp > 1))[0]
    if len(roomier) and not views:
        more = estimate_batch(model, cluster, cands.take(roomier), global_batch, state, mode, fits_GiB=room, keep=keep)
        order = np.argsort(more.step_time, kind="stable")
        order = order[np.isfinite(more.step_time[order])]
        at, also = (_first_of_shapes(cands.take(roomier), order, n_ref, more.memory_GiB, cap, shapes) if shapes
                    else (order[:n_ref], np.ones((len(order[:n_ref]), 1), dtype=bool)))
        rows, owned = np.concatenate([rows, roomier[at]]), np.vstack([owned, also])
    pool = [cands.config(int(i)) for i in rows]
    terms = layer_terms(model, ComputeModel.of(cluster), CommModel(cluster), cands.take(rows),
                        state)
    results: dict[ParallelConfig, PlanResult] = {}
    # fastest first: they get the stage ILP, ILP_SOLVES of them (of each set of shapes' own, as if searched alone)
    solves = np.zeros(sets, dtype=int)
    for i, cfg in enumerate(pool):
        found, solved = refine(model, cluster, cfg, global_batch, headroom_GiB, fixed, state,
                               exhaustive or bool((solves[owned[i]] < ILP_SOLVES).any()),
                               terms.take(np.array([i])))
        solves[owned[i]] += solved
        for r in found:
            results[r.config] = r
    plans = sorted((r for r in results.values() if r.estimate.fits),
                   key=PlanResult.rank_key)
    roomy = _fastest([r for r in results.values() if r.estimate.memory_GiB <= room])
    homogeneous = None
    if place_groups and cluster.node_groups:  # a fixed placement too: its layers go by its groups' speeds
        held = fixed.get("placement")
        homogeneous = plans[0] if plans and held is None else None
        pool, keys = roomy, fixed
        if held is not None:  # the plans to place there, as the free search finds them
            keys = {**{k: v for k, v in fixed.items() if k != "placement"}, "pp": len(held)}  # (a fixed pp: the same)
            pool = _fastest(roomy + search(model, cluster, global_batch, keys, headroom_GiB=headroom_GiB, state=state,
                                           exhaustive=exhaustive, refine_count=refine_count, place_groups=False).roomy)
        bases = _placeable(model, cluster, global_batch, keys, headroom_GiB, state, pool, exhaustive,
                           _stage(progress, "rankings of the plans to place"))
        placed = place(model, cluster, bases, global_batch, headroom_GiB, state, exhaustive, fixed,
                       _stage(progress, "plans placed on node groups"))
        if held is None:  # the best placements, searched again as if held
            placed += _focused(model, cluster, global_batch, fixed, headroom_GiB, state, exhaustive, refine_count, top,
                               sorted(plans + placed, key=PlanResult.rank_key),
                               _stage(progress, "searches of the best placements"))
        results.update({p.config: p for p in placed})
        fitting = {p.config: p for p in plans + placed if p.estimate.fits}  # a fixed placement's are in both
        plans = sorted(fitting.values(), key=PlanResult.rank_key)
    closest = None
    if not plans:
        allr = sorted(results.values(), key=lambda r: r.estimate.memory_GiB)
        closest = allr[0] if allr else None
    return SearchResult(plans=plans[:top], candidates=len(cands), seconds=time.perf_counter() - t0,
                        closest=closest, exhaustive=exhaustive, ranked=plans, homogeneous=homogeneous, roomy=roomy)


def _focused(model: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict[str, Any],
             headroom_GiB: float | None, state: StateSpec, exhaustive: bool, refine_count: int | None, top: int,
             ranked: list[PlanResult], progress: Callable[[int, int], None] | None = None) -> list[PlanResult]:
    """The plans of searches that hold each of the first :data:`FOCUS` placements of ``ranked`` (its fitting plans,
    best first), as ``--fix placement=...`` does: the variants (micro-batch, ZeRO, overlap, interleave) and shapes of
    that pipeline depth, ranked among themselves and placed there alone, which the whole search's limits leave out.
    ``progress``: told (done, total) of those searches."""
    where = list(dict.fromkeys(p.config.placement for p in ranked if p.estimate.fits and p.config.placement))[:FOCUS]
    out: list[PlanResult] = []
    for done, w in enumerate(where):
        if progress:
            progress(done, len(where))
        with contextlib.suppress(AutoparError):  # (a fitting plan's own placement: the held search has plans;
            # were it to fail, only this re-search is lost, never the plans found already)
            out += search(model, cluster, global_batch, {**fixed, "placement": w}, top=top, exhaustive=exhaustive,
                          headroom_GiB=headroom_GiB, refine_count=refine_count, state=state).ranked
    if progress:
        progress(len(where), len(where))
    return out


def _stage(progress: Callable[..., None] | None, what: str) -> Callable[[int, int], None] | None:
    """``progress`` (a search's callback) at a stage of the work of its own, ``what``: named to it where it takes a
    name (its ``stage``: :func:`planner.commands.inputs.progress`), then told (done, total) of that stage."""
    if progress is None:
        return None
    if callable(getattr(progress, "stage", None)):
        progress.stage(what)  # type: ignore[attr-defined]
    return lambda done, total: progress(done, total)


def _as_placed(model: ModelSpec, views: list[GroupView], cands: Any, global_batch: int, state: StateSpec,
               headroom_GiB: float | None, need: tuple[tuple[tuple[str, ...], ...], int] | None = None) -> Any:
    """Every candidate's step time with its layers spread over the groups' ``views`` (:func:`_spread` of its
    closed-form times on each, priced where it needs up to :data:`ROOMIER` times the view's GPU memory, the view's
    share of the layers at most its memory's room), and its memory on the first view.

    On each view the pace is its ranks at the group's edge: their pipeline sends cross the link to the next group one
    way (forward out of the group's last rank of a pipeline, backward out of its first) and stay inside it the other,
    both ways where the group holds one rank of a pipeline; so each view's time is taken that share of the way from
    its own links' to its time with every send across that link (``comm.EdgeComm``; no faster than its own). That
    only adds time: with ``need`` (sets of plan keys, a count of shapes), only the candidates needed to rank the
    first that many shapes of each set exactly are priced across, fastest first by their times on their own links
    (the others keep those, lower bounds)."""
    own, room, memory = [], [], None
    caps = [usable_GiB(headroom_GiB, v.view.gpu.memory_GiB) for v in views]
    for (view, share, _), cap in zip(views, caps):
        got = estimate_batch(model, view, cands, global_batch, state, "closed", fits_GiB=ROOMIER * cap)
        own.append(got.step_time)
        room.append(share * cap / got.memory_GiB)
        memory = got.memory_GiB if memory is None else memory
    own_t, room_a = np.stack(own, axis=1), np.stack(room, axis=1)
    shares = np.array([v.share for v in views])
    least = np.asarray(cands.pp) * np.asarray(cands.vpp) / model.num_layers
    step = _spread(own_t, shares, least, room_a)
    lower = step.copy()
    if all(v.edge is None for v in views):
        return BatchResult(step_time=step, memory_GiB=memory)
    order = np.argsort(step, kind="stable")
    order = order[np.isfinite(step[order])]
    done, size = 0, EDGE_BATCH
    while done < len(order):
        rows = order[done:done + size]
        done, size = done + len(rows), 2 * size
        part, t = cands.take(rows), own_t[rows].copy()
        for j, (view, share, edge) in enumerate(views):
            if edge is None or not np.isfinite(t[:, j]).any():
                continue
            across = estimate_batch(model, view, part, global_batch, state, "closed", fits_GiB=ROOMIER * caps[j],
                                    comm=EdgeComm(view, *edge)).step_time
            ways = np.where(share * np.asarray(part.pp) >= 2, 0.5, 1.0)  # of an edge rank's sends, those across
            fine = np.isfinite(t[:, j])
            t[fine, j] += ways[fine] * np.maximum(across[fine] - t[fine, j], 0.0)
        step[rows] = _spread(t, shares, least[rows], room_a[rows])
        if need is not None and done < len(order) and _settled(cands, order[:done], step, *need, lower[order[done]]):
            break
    return BatchResult(step_time=step, memory_GiB=memory)


def _settled(cands: Any, rows: np.ndarray, step: np.ndarray, key_sets: tuple[tuple[str, ...], ...], n: int,
             bound: float) -> bool:
    """Whether, for every set of plan keys, the first ``n`` shapes of the candidates ``rows`` by ``step`` all take
    at most ``bound`` (what every other candidate takes at least)."""
    by_time = rows[np.argsort(step[rows], kind="stable")]
    for keys in key_sets:
        key = np.stack([np.asarray(getattr(cands, k))[by_time] for k in keys], axis=1)
        _, first = np.unique(key, axis=0, return_index=True)
        if len(first) < n or step[by_time[np.sort(first)[n - 1]]] > bound:
            return False
    return True


def _spread(t: np.ndarray, w: np.ndarray, least: np.ndarray, most: np.ndarray) -> np.ndarray:
    """Each row's step time with its layers spread over the groups (columns: ``t`` the time were the whole cluster
    that group's GPUs, infinite where not priced; ``w`` their shares of the ranks, summing to the share of the layers
    they hold: less than 1 where a group has no view) so that they finish together, every group's share of the layers
    at least ``least`` times its share of the ranks (a rank holds one layer per virtual stage at least) and at most
    ``most`` (its memory's room; a stage's memory taken as its layers'); the weighted harmonic mean of ``t`` where no
    bound holds; infinite where a group's room is below its floor or the groups' room is short. A group not priced
    holds nothing."""
    total = float(np.sum(w))
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(np.isfinite(t), w / t, 0.0)
        lo = np.where(rate > 0, w * least[:, None], 0.0)
        hi = np.where(rate > 0, most, 0.0)
        top = np.maximum(hi, lo)  # (a room below the floor rules the row out below)
        a, b = np.zeros(len(t)), np.where(rate > 0, top / rate, 0.0).max(axis=1)
        for _ in range(48):  # the finish time at which the groups' clamped shares add up to theirs of the layers
            mid = (a + b) / 2
            short = np.clip(rate * mid[:, None], lo, top).sum(axis=1) < total
            a, b = np.where(short, mid, a), np.where(short, b, mid)
        x = np.clip(rate * b[:, None], lo, top)
        step = np.where(rate > 0, x / rate, 0.0).max(axis=1)
    tol = 1e-9 * total
    ok = ((lo.sum(axis=1) <= total + tol) & (hi.sum(axis=1) >= total - tol) & (rate.sum(axis=1) > 0)
          & (hi >= lo - tol).all(axis=1))
    return np.where(ok, step, np.inf)


def _first_of_shapes(cands: Any, order: np.ndarray, n: int, memory: np.ndarray, small_GiB: float,
                     key_sets: tuple[tuple[str, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    """The rows of ``order`` (in its order) that :func:`_shape_picks` picks by any of ``key_sets``, and for each
    row and set whether that set picks it."""
    picks = [_shape_picks(cands, order, n, memory, small_GiB, keys) for keys in key_sets]
    at = np.unique(np.concatenate(picks)).astype(int)
    return order[at], np.stack([np.isin(at, p) for p in picks], axis=1)


def _shape_picks(cands: Any, order: np.ndarray, n: int, memory: np.ndarray, small_GiB: float,
                 keys: tuple[str, ...]) -> np.ndarray:
    """Positions in ``order``: the first row of each shape (its plan ``keys``) of ``cands``, for the first ``n``
    shapes, and where others, the first of each of those shapes within ``small_GiB`` (the smallest GPUs') and the one
    needing the least ``memory`` (a shape's fastest may need the largest GPUs for every stage where a leaner one fits
    every group)."""
    if not len(order):
        return np.zeros(0, dtype=int)
    key = np.stack([np.asarray(getattr(cands, k))[order] for k in keys], axis=1)
    _, first, which = np.unique(key, axis=0, return_index=True, return_inverse=True)
    taken = np.sort(first)[:n]
    kept = np.isin(which.ravel(), which.ravel()[taken])
    by_memory = np.nonzero(kept)[0][np.argsort(memory[order[kept]], kind="stable")]
    _, lean = np.unique(which.ravel()[by_memory], return_index=True)
    small = np.nonzero(kept & (memory[order] <= small_GiB))[0]
    _, fits = np.unique(which.ravel()[small], return_index=True)
    return np.union1d(np.union1d(taken, by_memory[lean]), small[fits])


def _placeable(model: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict[str, Any],
               headroom_GiB: float | None, state: StateSpec, plans: list[PlanResult], exhaustive: bool = False,
               progress: Callable[[int, int], None] | None = None) -> list[PlanResult]:
    """The fastest homogeneous plans the node groups can hold: those whose pipeline ranks they hold whole, from
    ``plans``' own (they fit the largest group's GPUs: placed, a stage may sit on them) and from two searches over
    the pipeline depths that give every group whole ranks (unless pp is fixed), each refining the fastest plan of
    its :data:`SHAPE_BASES` (:data:`EXHAUSTIVE_BASES` where ``exhaustive``) fastest shapes, ranked at the merged
    view and as if placed (:func:`planner.placement.whole_views`): ranked at the slowest link, the shapes that gain
    most from placing may not be among ``plans``' first; and those whose every pipeline rank can be split over all
    the groups (``a+b``), from ``plans`` and as :func:`_split_ranked` ranks them (per shape, and per shape and ZeRO
    stage). ``progress``: told (done, total) of those rankings."""
    steps = 1 if "pp" in fixed else 3
    tell = progress or (lambda done, total: None)
    tell(0, steps)
    sizes = list(cluster.groups.values())
    whole = [p for p in plans if all(n % (p.config.tp * p.config.dp * p.config.cp) == 0 for n in sizes)
             and p.config.pp > 1]
    moe = model.moe is not None
    cap = usable_GiB(headroom_GiB, cluster.gpu.memory_GiB)  # a split plan's every rank sits on the smallest GPUs too
    split = [p for p in plans if p.estimate.memory_GiB <= cap][:SPLIT_SCAN] + _split_ranked(
        model, cluster, global_batch, fixed, headroom_GiB, state, exhaustive, plans[0].config if plans else None)
    split = [p for p in split if any(splits_replicas(w) for w in placements(cluster, p.config, moe))]
    tell(1, steps)
    if "pp" in fixed:
        return _fastest(whole + split)
    stage = math.gcd(*sizes)
    depths = [cluster.num_gpus // n for n in range(1, stage + 1) if stage % n == 0 and cluster.num_gpus // n > 1]
    deeper: list[PlanResult] = []
    for done, views in enumerate((None, whole_views(cluster)), start=2):  # ranked at the merged view, as if placed
        try:
            deeper += search(model, cluster, global_batch, fixed={**fixed, "pp": depths}, headroom_GiB=headroom_GiB,
                             state=state, place_groups=False, exhaustive=exhaustive, shapes=(SHAPE,), views=views,
                             refine_count=EXHAUSTIVE_BASES if exhaustive else SHAPE_BASES).roomy
        except AutoparError:  # no such depth fits the rules (say, more stages than layers)
            tell(steps, steps)
            return _fastest(whole + split)
        tell(done, steps)
    return _fastest(whole + deeper + split)


def _split_ranked(model: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict[str, Any],
                  headroom_GiB: float | None, state: StateSpec, exhaustive: bool,
                  probe: ParallelConfig | None) -> list[PlanResult]:
    """The fastest plans to split over the node groups (``a+b``), the fastest of each shape as the slowest group's
    view ranks them (:func:`planner.placement.split_views`; the slowest: the one on which plan ``probe`` is
    slowest, else the one of the least peak), priced on that view (their placed prices are exact); and the
    fastest of each shape and ZeRO stage so ranked (the view prices the data-parallel traffic on one group's
    network, where split it crosses between the groups hierarchically and may favour another stage). None for a
    mixture-of-experts model or where no plan splits. Only the tensor-parallel sizes the merged view's nodes hold."""
    found = split_views(cluster) if model.moe is None else None
    if not found or not found[0]:
        return []
    views, shares = found
    view = min(views, key=lambda v: (v.gpu.peak(cluster.precision), v.nic_bw_per_gpu))
    if probe is not None:
        times = []
        for v in views:
            with contextlib.suppress(AutoparError):  # (a plan one view's nodes cannot hold)
                times.append((estimate(model, v, probe, global_batch, headroom_GiB, state=state).step_time_s, v))
        view = max(times, key=lambda t: t[0])[1] if times else view
    n = cluster.num_gpus
    keys = {"dp": [d for d in range(shares, n + 1, shares) if n % d == 0],
            "tp": [t for t in range(1, cluster.gpus_per_node + 1) if n % t == 0 and tp_node_problem(
                t, n, cluster.gpus_per_node, cluster.tp_across_nodes) is None], **fixed}
    x = PlanContext.on(model, cluster, global_batch)  # what the view's nodes allow and the cluster's do not

    try:
        found = search(model, view, global_batch, keys, headroom_GiB=headroom_GiB, state=state, exhaustive=exhaustive,
                       refine_count=SHAPE_BASES, place_groups=False, shapes=(SHAPE, (*SHAPE, "zero"))).ranked
        return [p for p in found if plan_problem(p.config, x) is None]
    except AutoparError:  # (no plan of such dp fits the rules)
        return []


def _fastest(plans: list[PlanResult]) -> list[PlanResult]:
    """``plans`` without repeats, fastest first (whether they fit the merged view aside: placed, they may)."""
    return sorted({r.config: r for r in plans}.values(), key=lambda r: (r.estimate.step_time_s, r.estimate.memory_GiB))


GROW_LIMIT = 1 << 16  # the largest cluster :func:`min_gpus_to_fit` tries


NODE_SCAN = 64  # whole-node counts below a cluster's that :func:`max_gpus_with_plans` tries before powers of two


def max_gpus_with_plans(model: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict[str, Any]
                        ) -> int | None:
    """The largest GPU count below the cluster's on which the model and batch have any plan at all (memory aside),
    or None: what to suggest when no plan splits the batch and model over the cluster's GPUs. Tried: the
    :data:`NODE_SCAN` whole-node counts below it (1,000 GPUs: 992, 984, ...), then the powers of two below those; within
    one node every count below it (8 GPUs: 7, 6, ...)."""
    node = cluster.gpus_per_node
    whole = [g for g in range(cluster.num_gpus - node, 0, -node)][:NODE_SCAN] if cluster.num_gpus > node else []
    low = min(whole, default=cluster.num_gpus)
    below = list(range(low - 1, 0, -1)) if low <= node else \
        [1 << k for k in range((low - 1).bit_length() - 1, -1, -1)]  # inside one node every count, else powers of 2
    for g in whole + below:
        try:
            enumerate_space(model, cluster.resized(gpus=g), global_batch, fixed, False, None)
            return g
        except AutoparError:
            continue
    return None


def min_gpus_to_fit(model: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict[str, Any],
                    headroom_GiB: float | None = None, limit: int = GROW_LIMIT) -> int | None:
    """A cluster size on which some plan fits, or None past ``limit``: the first doubling of the cluster that fits
    (in whole nodes past one), then, past a node, bisected over whole nodes between it and its half (96 GPUs too few
    for a model: 112, not 192; fitting is not always monotone in the node count, so a smaller size may fit too); an
    AutoparError saying why when the cluster cannot grow (a profile without an inter-node
    network, node groups)."""

    def fits(g: int) -> bool:
        bigger = cluster.resized(gpus=g)  # raises when the cluster cannot grow: the caller says why
        try:
            res = search(model, bigger, global_batch, fixed=fixed, top=1, headroom_GiB=headroom_GiB, refine_count=4)
        except AutoparError:
            return False
        return bool(res.plans)

    node = cluster.full_node_gpus or cluster.gpus_per_node  # a part of a node grows into whole ones

    def grown(g: int) -> int:
        return g if g <= node else -(-g // node) * node

    g = grown(cluster.num_gpus * 2)
    while g <= limit and not fits(g):
        g = grown(g * 2)
    if g > limit:
        return None
    if g // 2 < node:  # within a node: its sizes are the doublings
        return g
    lo, hi = max(g // 2, cluster.num_gpus) // node, g // node  # in whole nodes: lo does not fit, hi does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid * node) else (mid, hi)
    return hi * node
