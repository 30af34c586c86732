"""Placing plans on a cluster's node groups (Holmes' idea: heavy traffic inside fast groups, only pipeline sends
across the slow links between them; Metis': layers by each group's speed).

The search first plans the cluster as if homogeneous at its slowest GPU and link (its top-level profile
fields). Each of those plans whose stage (tp x dp x cp GPUs) divides every group's GPUs is then placed: every
group holds whole pipeline ranks, one contiguous block of them per group; the tensor-, context- and
data-parallel groups stay inside a node group, so only pipeline sends cross groups. Every order of the groups is
tried for each stage shape; layers are split evenly and in proportion to each group's speed per layer (the
placed plan's own stage times under an even split); the fastest placed plans are then balanced further, a layer
at a time to the fastest stage from the slowest one or from the rank that finishes last, while the step gets
faster. Every placed plan is priced exactly (cost_models/placement.py).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np

from cost_models.step import estimate
from planner.refine import PlanResult
from specs.cluster import ClusterSpec
from specs.model import ModelSpec
from specs.parallel import ParallelConfig, groups_text
from specs.state import StateSpec

MAX_BASES = 8  # distinct homogeneous plans placed (fastest first)
MAX_MOVES = 16  # single-layer moves tried per placed plan
MOVED = 3  # placed plans balanced by single-layer moves (the fastest)
ORDERS = 2  # orders of the groups kept per stage shape


def placements(cluster: ClusterSpec, cfg: ParallelConfig) -> list[tuple[str, ...]]:
    """Every placement of ``cfg``'s pipeline ranks as one contiguous block per node group (each group's GPUs
    hold whole ranks of tp*dp*cp GPUs), in every order of the groups; none when a group's GPUs are not a whole
    number of ranks."""
    stage = cfg.tp * cfg.dp * cfg.cp
    groups = cluster.groups
    if any(n % stage for n in groups.values()) or sum(n // stage for n in groups.values()) != cfg.pp:
        return []
    return [tuple(g for g in order for _ in range(groups[g] // stage)) for order in itertools.permutations(groups)]


def proportional_layers(num_layers: int, speed: list[float]) -> tuple[int, ...]:
    """``num_layers`` split over stages in proportion to ``speed`` (at least one each; largest remainders)."""
    share = np.asarray(speed, dtype=float) / sum(speed) * num_layers
    out = np.maximum(1, np.floor(share)).astype(int)
    while out.sum() < num_layers:
        out[int(np.argmax(share - out))] += 1
    while out.sum() > num_layers:
        out[int(np.argmax(np.where(out > 1, out - share, -np.inf)))] -= 1
    return tuple(int(x) for x in out)


def _price(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, global_batch: int, headroom_GiB: float,
           state: StateSpec) -> PlanResult:
    return PlanResult(cfg, estimate(model, cluster, cfg, global_batch, headroom_GiB, state=state))


def _better(a: PlanResult, b: PlanResult | None) -> bool:
    return b is None or (a.estimate.fits, -a.estimate.step_time_s) > (b.estimate.fits, -b.estimate.step_time_s)


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


def moved(model: ModelSpec, cluster: ClusterSpec, best: PlanResult, global_batch: int, headroom_GiB: float,
          state: StateSpec) -> PlanResult:
    """``best`` after single-layer moves to its fastest stage, from its slowest stage or from the pipeline rank
    that finishes last (its data-parallel reduce and optimizer included), while the step gets faster."""
    for _ in range(MAX_MOVES):
        times = best.estimate.stage_time_s
        fast = int(np.argmin(times))
        tried = []
        for slow in dict.fromkeys((int(np.argmax(times)), best.estimate.critical_rank)):
            split = list(best.config.stage_layers(model.num_layers))
            if slow == fast or split[slow] <= 1:
                continue
            split[slow] -= 1
            split[fast] += 1
            tried.append(_price(model, cluster, replace(best.config, layers=tuple(split)), global_batch,
                                headroom_GiB, state))
        better = [c for c in tried if _better(c, best)]
        if not better:
            break
        best = min(better, key=lambda c: c.estimate.step_time_s)
    return best


def place(model: ModelSpec, cluster: ClusterSpec, ranked: list[PlanResult], global_batch: int,
          headroom_GiB: float, state: StateSpec) -> list[PlanResult]:
    """Placed versions of the homogeneous plans ``ranked`` (best first). For the first plan of each stage shape
    (tp, dp, cp) every order of the groups is priced with the layers split evenly and by group speed; each plan
    then takes its shape's :data:`ORDERS` best orders, split by speed; the best :data:`MOVED` placed plans are
    balanced by single-layer moves. Best first, those that fit before those that do not."""
    seen, out = set(), []
    orders_of: dict[tuple[int, int, int], list[tuple[tuple[str, ...], dict[str, float]]]] = {}
    for r in ranked:
        base = replace(r.config, layers=None, recompute_layers=None, placement=None)
        if base in seen:
            continue
        seen.add(base)
        if len(seen) > MAX_BASES:
            break
        keep = r.config.recompute_layers if not isinstance(r.config.recompute_layers, tuple) else None
        base = replace(base, recompute_layers=keep)
        shape = (base.tp, base.dp, base.cp)
        if shape not in orders_of:
            tried = []
            for where in placements(cluster, base):
                even = _price(model, cluster, replace(base, placement=where), global_batch, headroom_GiB, state)
                speeds = _speeds(model, even.config, even)
                split = _price(model, cluster, by_speed(model, even.config, speeds), global_batch, headroom_GiB,
                               state)
                tried += [(even, speeds), (split, speeds)]
            tried.sort(key=lambda t: (not t[0].estimate.fits, t[0].estimate.step_time_s))
            out += [t[0] for t in tried]
            best_orders = list(dict.fromkeys(t[0].config.placement for t in tried))[:ORDERS]
            orders_of[shape] = [(w, next(sp for p, sp in tried if p.config.placement == w)) for w in best_orders]
            continue
        out += [_price(model, cluster, by_speed(model, replace(base, placement=w), speeds), global_batch,
                       headroom_GiB, state) for w, speeds in orders_of[shape]]
    out.sort(key=lambda p: (not p.estimate.fits, p.estimate.step_time_s))
    out[:MOVED] = [moved(model, cluster, p, global_batch, headroom_GiB, state) for p in out[:MOVED]]
    return sorted(out, key=lambda p: (not p.estimate.fits, p.estimate.step_time_s))


def explain_placement(cfg: ParallelConfig, num_layers: int) -> str:
    """One sentence: which stages sit on which group with how many layers, and what crosses groups."""
    assert cfg.placement is not None
    layers = cfg.stage_layers(num_layers)
    parts, start = [], 0
    for g, run in itertools.groupby(range(cfg.pp), key=lambda r: cfg.placement[r]):  # type: ignore[index]
        ranks = list(run)
        held = "/".join(str(layers[j]) for r in ranks for j in range(r, cfg.pp * cfg.vpp, cfg.pp))
        span = f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        parts.append(f"pipeline ranks {span} on {g} ({held} layers)")
        start += len(ranks)
    inside = "tp" + (", cp" if cfg.cp > 1 else "") + (" and dp" if cfg.dp > 1 else "")
    return (f"placement {groups_text(cfg.placement)}: {'; '.join(parts)}; {inside} inside each group, only "
            "pipeline sends cross between groups")
