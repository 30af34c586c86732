"""The vectorised cost model: step time and peak memory of many candidates at once (numpy), to rank them.

It composes exactly the functions of the exact model (``step.estimate``) — per-stage costs, each rank's tail,
each rank's memory — over arrays of candidates grouped by (pp, vpp), with their layer split and recomputed
layers (``ParallelConfig.stage_layers`` / ``recomputed_layers``). The one difference is how the pipeline is
replayed: in closed form (``pipeline.closed_form``) instead of the schedule table, except for interleaved
pipelines whose model chunks differ in size, where the closed form misses the gaps their uneven waves leave;
those are replayed for all candidates at once, for two pipeline groups of micro-batches, and extended
linearly (``pipeline.wave_replay``). The search ranks every candidate with this and re-prices its best ones
exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from cost_models.arrays import by_value, distinct, packed_rows
from cost_models.comm import CommModel
from cost_models.compute import ComputeModel
from cost_models.memory import GiB, rank_memory
from cost_models.pipeline import (
    CLOSED_FORM_OPTIMISM,
    CLOSED_FORM_PESSIMISM,
    closed_form,
    makespan_floor,
    table_replay,
    wave_replay,
)
from cost_models.stages import (
    FULL,
    LayerTerms,
    StageState,
    layer_terms,
    rank_work,
    stage_costs,
    stage_split,
    stage_state,
)
from cost_models.tail import rank_tail
from specs.cluster import ClusterSpec
from specs.model import ModelSpec
from specs.parallel import Candidates, ParallelConfig, microbatches
from specs.state import StateSpec


@dataclass
class BatchResult:
    step_time: np.ndarray  # infinite where not timed
    memory_GiB: np.ndarray
    floor: np.ndarray | None = None  # with ``keep``: the lower bound of each step time the pruning used


Pipeline = Literal["closed", "mixed", "exact"]


def estimate_batch(model: ModelSpec, cluster: ClusterSpec, c: Candidates, global_batch: int,
                   state: StateSpec | None = None, pipeline: Pipeline = "mixed",
                   progress: Callable[..., None] | None = None,
                   fits_GiB: float | None = None, keep: tuple[int, float] | None = None,
                   comm: CommModel | None = None) -> BatchResult:
    """Step time (s) and peak memory per GPU (GiB) of every candidate of ``c``.

    ``pipeline``: "mixed" (the default, described above); "closed" prices even the interleaved pipelines whose
    chunks differ in size in closed form (faster, their times within
    the closed form's bounds, pipeline.CLOSED_FORM_OPTIMISM / _PESSIMISM; memory is the same); "exact"
    replays every candidate's schedule table as the exact model does (slow: ``--exhaustive``). With
    ``fits_GiB`` only the candidates that fit in that much memory per GPU are timed (the others' time is
    infinite).

    Every candidate's memory is worked out (once per distinct stage state: cheap). With ``keep=(k, slack)`` only
    the candidates that fit and may be within ``slack`` times the k-th fastest are timed, in closed form: in
    order of a lower bound of their step time (``pipeline.makespan_floor`` of their ranks' compute, TP/CP
    communication and ZeRO traffic: ``stages.rank_work``), in growing batches, until the next bound is above that
    mark. The others' time is left infinite (not worked out: they cannot be among the fastest). Then, with the
    "mixed" pipeline, those that may be among the k fastest (:func:`may_be_among`) get their uneven waves
    replayed. ``progress`` is called with (candidates priced, all candidates[, share of
    the work done]) as the work goes. ``comm``: the cluster's communication as priced (default: ``CommModel``)."""
    state = state or StateSpec.default(cluster.precision)
    cm, comm = ComputeModel.of(cluster), comm or CommModel(cluster)
    terms = layer_terms(model, cm, comm, c, state)
    floor = np.zeros(len(c))
    uneven = np.zeros(len(c), dtype=bool)  # interleaved chunks of unequal size: the closed form is not exact
    memory, step = np.full(len(c), np.inf), np.full(len(c), np.inf)
    groups = []
    for _, idx in by_value(packed_rows(c.pp, c.vpp)):
        grp = _group(model, state, c, terms, idx, global_batch)
        uneven[idx] = _chunks_differ(grp.vpp, grp.layers)
        memory[idx] = _memory(grp, state, cluster.backend)
        groups.append(grp)
    fits = memory <= fits_GiB if fits_GiB is not None else np.ones(len(c), dtype=bool)
    for grp in groups if keep is not None else []:  # the bound of those that fit
        rows = np.nonzero(fits[grp.idx])[0]
        if len(rows):
            floor[grp.idx[rows]] = makespan_floor(rank_work(model, comm, state, grp.c.take(rows), grp.lt.take(rows),
                                                            grp.layers, grp.recomputed[rows], grp.pp),
                                                  grp.vpp, grp.m[rows])
    if keep is None:
        _time(model, cm, comm, state, cluster.num_gpus, groups, fits, step, pipeline, progress=progress)
        return BatchResult(step_time=step, memory_GiB=memory)
    k, slack = keep
    queue = np.nonzero(fits)[0]
    queue = queue[np.argsort(floor[queue], kind="stable")]  # most promising first, in growing batches
    mark, size = np.inf, 256 * k
    while len(queue) and floor[queue[0]] <= mark:
        batch, queue = queue[:size], queue[size:]
        _time(model, cm, comm, state, cluster.num_gpus, groups, _mask(len(c), batch[floor[batch] <= mark]), step,
              "closed")
        fastest = np.partition(step, k - 1)[k - 1] if len(c) >= k else np.inf
        mark, size = slack * fastest, size * 8
        if progress:
            progress(len(c) - len(queue), len(c))
    if pipeline == "mixed" and np.isfinite(step).any():  # replay the uneven waves where they may matter
        _time(model, cm, comm, state, cluster.num_gpus, groups, may_be_among(step, uneven, k), step, "mixed",
              uneven_only=True)
    if progress:
        progress(len(c), len(c))
    return BatchResult(step_time=step, memory_GiB=memory, floor=floor)


def may_be_among(step: np.ndarray, uneven: np.ndarray, k: int) -> np.ndarray:
    """Which candidates timed ``step`` (closed form where ``uneven``, else exact) may be among the ``k`` fastest
    once the uneven ones are replayed: the replay is at most CLOSED_FORM_OPTIMISM slower and CLOSED_FORM_PESSIMISM
    faster than the closed form, so a candidate whose fastest possible replay is slower than the k-th smallest
    slowest possible time of all cannot be."""
    upper = np.where(uneven, step / (1 - CLOSED_FORM_OPTIMISM), step)
    kth = np.partition(upper, min(k, len(upper)) - 1)[min(k, len(upper)) - 1]
    return np.isfinite(step) & (step / (1 + CLOSED_FORM_PESSIMISM) <= kth)


@dataclass
class _Group:
    """Candidates of one (pp, vpp) (rows ``idx`` of all), their layer split and what their stages hold, worked
    out once per distinct (tp, cp, dp, mbs, sp, recompute, ep, etp, ZeRO >= 2, and ZeRO >= 2 with dp_overlap: a
    reduce-scatter in flight) — rows ``each`` of ``held``."""

    idx: np.ndarray
    c: Candidates
    lt: LayerTerms
    layers: np.ndarray  # [stages]
    recomputed: np.ndarray  # [N, stages]
    m: np.ndarray  # micro-batches
    held: StageState  # of rows ``one`` (the distinct ones)
    one: np.ndarray
    each: np.ndarray  # each row's row of ``held``

    @property
    def pp(self) -> int:
        return int(self.c.pp[0])

    @property
    def vpp(self) -> int:
        return int(self.c.vpp[0])


def _group(model: ModelSpec, state: StateSpec, c: Candidates, terms: LayerTerms, idx: np.ndarray,
           global_batch: int) -> _Group:
    g, lt = c.take(idx), terms.take(idx)
    split = ParallelConfig(pp=int(g.pp[0]), vpp=int(g.vpp[0]), layers=c.layers, recompute="full",
                           recompute_layers=c.recompute_layers)  # the keys all candidates share
    layers, full = stage_split(split, model.num_layers)
    recomputed = np.where(g.recompute[:, None] == FULL, full[None, :], 0.0)
    one, each = distinct(g.tp, g.cp, g.dp, g.mbs, g.sp, g.recompute, g.zero >= 2, g.ep, g.etp,
                         (g.zero >= 2) & g.dp_overlap)
    held = stage_state(model, state, g.take(one), lt.take(one), layers, recomputed[one])
    return _Group(idx, g, lt, layers, recomputed, microbatches(global_batch, g.dp, g.mbs), held, one, each)


def _memory(grp: _Group, state: StateSpec, backend: str) -> np.ndarray:
    """The peak GiB per GPU of a group's candidates. What a rank holds depends on the ZeRO stage and dp_overlap
    only through its buckets and ZeRO-2/3's buffers: it is worked out once for them all."""
    load = grp.held.rank_load(grp.pp, grp.vpp, grp.m[grp.one])
    one, each = distinct(grp.each, grp.c.zero, grp.c.dp_overlap)
    peak = rank_memory(grp.c.take(one), state, backend, load.take(grp.each[one])).total.max(axis=1) / GiB
    return peak[each]


def _chunks_differ(vpp: int, layers: np.ndarray) -> bool:
    """Interleaved model chunks of unequal size: where the closed form is not exact and waves are replayed."""
    return vpp > 1 and len(set(layers.tolist())) > 1


def _mask(n: int, rows: np.ndarray) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[rows] = True
    return out


def _time(model: ModelSpec, cm: ComputeModel, comm: CommModel, state: StateSpec, gpus: int, groups: list[_Group],
          chosen: np.ndarray, step: np.ndarray, pipeline: Pipeline, uneven_only: bool = False,
          progress: Callable[..., None] | None = None) -> None:
    """Write into ``step`` the step time of the ``chosen`` candidates ([N] mask), group by group (``uneven_only``:
    only in the interleaved groups whose chunks differ in size; ``progress``: told the candidates of the groups
    done so far, and the share of the work done: with the "exact" pipeline each candidate's replay takes time in
    proportion to its schedule's actions, pp x vpp x micro-batches, so the deep pipelines, priced last, would make
    a rate of candidates promise too early an end)."""
    exact = pipeline == "exact"

    def work(grp: _Group, rows: np.ndarray) -> float:
        return float(np.sum(grp.m[rows]) * grp.pp * grp.vpp) if exact else float(len(rows))

    picked = [np.nonzero(chosen[grp.idx])[0] for grp in groups]
    total = sum(work(g, r) for g, r in zip(groups, picked)) or 1.0
    done, worked = 0, 0.0
    for grp, rows in zip(groups, picked):
        chunks_differ = _chunks_differ(grp.vpp, grp.layers)
        if not len(rows) or uneven_only and not chunks_differ:
            done += len(grp.idx)
            continue
        replay = {"exact": table_replay, "mixed": wave_replay if chunks_differ else closed_form}
        for part in np.array_split(rows, max(1, len(rows) // 2048)) if exact else [rows]:  # a replay's progress
            if progress:
                progress(done, len(step), worked / total)
            g, m = grp.c.take(part), grp.m[part]
            costs = stage_costs(model, comm, state, g, grp.lt.take(part), grp.layers, grp.recomputed[part], cm.eb,
                                held=grp.held.take(grp.each[part]))
            pipe = replay.get(pipeline, closed_form)(costs.f, costs.b, grp.pp, grp.vpp, m)
            step[grp.idx[part]] = rank_tail(model, cm, comm, state, g, costs, pipe, m, gpus).step_time
            worked += work(grp, part)
            done += len(part)
        done += len(grp.idx) - len(rows)
    if progress:
        progress(done, len(step), 1.0)
