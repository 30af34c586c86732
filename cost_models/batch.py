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

from cost_models.comm import CommModel
from cost_models.compute import ComputeModel
from cost_models.memory import GiB, rank_load, rank_memory
from cost_models.pipeline import (
    CLOSED_FORM_OPTIMISM,
    CLOSED_FORM_PESSIMISM,
    closed_form,
    makespan_floor,
    table_replay,
    wave_replay,
)
from cost_models.stages import FULL, layer_terms, packed_rows, rank_work, stage_costs, stage_state
from cost_models.tail import rank_tail
from specs.cluster import ClusterSpec
from specs.model import ModelSpec
from specs.parallel import Candidates, ParallelConfig, microbatches
from specs.state import StateSpec


@dataclass
class BatchResult:
    step_time: np.ndarray  # infinite where not timed
    memory_GiB: np.ndarray  # infinite where not worked out (with ``keep``)
    floor: np.ndarray | None = None  # with ``keep``: the lower bound of each step time the pruning used


Pipeline = Literal["closed", "mixed", "exact"]


def estimate_batch(model: ModelSpec, cluster: ClusterSpec, c: Candidates, global_batch: int,
                   state: StateSpec | None = None, pipeline: Pipeline = "mixed",
                   progress: Callable[[int, int], None] | None = None,
                   fits_GiB: float | None = None, keep: tuple[int, float] | None = None) -> BatchResult:
    """Step time (s) and peak memory per GPU (GiB) of every candidate of ``c``.

    ``pipeline``: "mixed" (the default, described above); "closed" prices even the interleaved pipelines whose
    chunks differ in size in closed form (faster, their times within about 11%; memory is the same); "exact"
    replays every candidate's schedule table as the exact model does (slow: ``--exhaustive``). With
    ``fits_GiB`` only the candidates that fit in that much memory per GPU are timed (the others' time is
    infinite).

    With ``keep=(k, slack)`` only the candidates that may be within ``slack`` times the k-th fastest are priced,
    in closed form: in order of a lower bound of their step time (``pipeline.makespan_floor`` of their ranks'
    compute, TP/CP communication and ZeRO traffic: ``stages.rank_work``), in growing batches, each batch's
    memory worked out and those that fit timed, until the next bound is above that mark. The others' time and
    memory are left infinite (not worked out: they cannot be among the fastest). Then, with the "mixed"
    pipeline, those that may be among the k fastest (:func:`may_be_among`) get their uneven waves replayed.
    ``progress`` is called with (candidates priced, all candidates) as the work goes."""
    state = state or StateSpec.default(cluster.precision)
    cm, comm = ComputeModel(cluster.gpu, cluster.precision), CommModel(cluster)
    terms = layer_terms(model, cm, comm, c)
    floor = np.zeros(len(c))
    uneven = np.zeros(len(c), dtype=bool)  # interleaved chunks of unequal size: the closed form is not exact
    groups = []
    group = packed_rows(c.pp, c.vpp)
    for key in np.unique(group):
        idx = np.nonzero(group == key)[0]
        pp, vpp = int(c.pp[idx[0]]), int(c.vpp[idx[0]])
        g, lt = c.take(idx), terms.take(idx)
        split = ParallelConfig(pp=pp, vpp=vpp, layers=c.layers, recompute="full",
                               recompute_layers=c.recompute_layers)  # the keys all candidates share
        layers = np.array(split.stage_layers(model.num_layers), dtype=float)
        full = np.array([split.recomputed_layers(j, int(n)) for j, n in enumerate(layers)], dtype=float)
        recomputed = np.where(g.recompute[:, None] == FULL, full[None, :], 0.0)
        m = microbatches(global_batch, g.dp, g.mbs)
        uneven[idx] = _chunks_differ(vpp, layers)
        if keep is not None:
            floor[idx] = makespan_floor(rank_work(model, comm, state, g, lt, layers, recomputed, pp), pp, vpp, m)
        groups.append((idx, g, lt, layers, recomputed, m))
    memory, step = np.full(len(c), np.inf), np.full(len(c), np.inf)

    def price(rows: np.ndarray, how: Pipeline) -> None:  # memory, then the time of those that fit
        chosen = _mask(len(c), rows)
        _memory(model, state, cluster.backend, groups, chosen, memory)
        fit = chosen & (memory <= fits_GiB) if fits_GiB is not None else chosen
        _time(model, cm, comm, state, cluster.num_gpus, groups, fit, step, how,
              progress=progress if keep is None else None)

    if keep is None:
        price(np.arange(len(c)), pipeline)
        return BatchResult(step_time=step, memory_GiB=memory)
    k, slack = keep
    queue = np.argsort(floor, kind="stable")  # most promising first, in growing batches
    mark, size = np.inf, 32 * k
    while len(queue) and floor[queue[0]] <= mark:
        batch, queue = queue[:size], queue[size:]
        price(batch[floor[batch] <= mark], "closed")
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


def _memory(model: ModelSpec, state: StateSpec, backend: str, groups: list, chosen: np.ndarray,
            memory: np.ndarray) -> None:
    """Write into ``memory`` the peak GiB per GPU of the ``chosen`` candidates ([N] mask), group by group. What a
    rank holds does not depend on the ZeRO stage or the overlaps: it is worked out once for them all."""
    for idx, g, lt, layers, recomputed, m in groups:
        rows = np.nonzero(chosen[idx])[0]
        if not len(rows):
            continue
        g, lt, recomputed, m = g.take(rows), lt.take(rows), recomputed[rows], m[rows]
        pp, vpp = int(g.pp[0]), int(g.vpp[0])
        _, one, each = np.unique(packed_rows(g.tp, g.cp, g.dp, g.mbs, g.sp, g.recompute), return_index=True,
                                 return_inverse=True)
        held = stage_state(model, state, g.take(one), lt.take(one), layers, recomputed[one])
        load = rank_load(pp, vpp, m[one], held.params, held.act_bytes, held.work_bytes,
                         held.largest_bucket).take(each.reshape(-1))
        memory[idx[rows]] = rank_memory(g, state, backend, load).total.max(axis=1) / GiB


def _chunks_differ(vpp: int, layers: np.ndarray) -> bool:
    """Interleaved model chunks of unequal size: where the closed form is not exact and waves are replayed."""
    return vpp > 1 and len(set(layers.tolist())) > 1


def _mask(n: int, rows: np.ndarray) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[rows] = True
    return out


def _time(model: ModelSpec, cm: ComputeModel, comm: CommModel, state: StateSpec, gpus: int, groups: list,
          chosen: np.ndarray, step: np.ndarray, pipeline: Pipeline, uneven_only: bool = False,
          progress: Callable[[int, int], None] | None = None) -> None:
    """Write into ``step`` the step time of the ``chosen`` candidates ([N] mask), group by group (``uneven_only``:
    only in the interleaved groups whose chunks differ in size; ``progress``: told the candidates of the groups
    done so far)."""
    done = 0
    for idx, g, lt, layers, recomputed, m in groups:
        done += len(idx)
        if progress:
            progress(done - len(idx), len(step))
        pp, vpp = int(g.pp[0]), int(g.vpp[0])
        chunks_differ = _chunks_differ(vpp, layers)
        rows = np.nonzero(chosen[idx])[0]
        if not len(rows) or uneven_only and not chunks_differ:
            continue
        g, m = g.take(rows), m[rows]
        costs = stage_costs(model, comm, state, g, lt.take(rows), layers, recomputed[rows], cm.eb)
        replay = {"exact": table_replay, "mixed": wave_replay if chunks_differ else closed_form}
        pipe = replay.get(pipeline, closed_form)(costs.f, costs.b, pp, vpp, m)
        step[idx[rows]] = rank_tail(model, cm, comm, state, g, costs, pipe, m, gpus).step_time
    if progress:
        progress(done, len(step))
