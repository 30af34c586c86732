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
from cost_models.memory import GiB, rank_memory
from cost_models.pipeline import closed_form, table_replay, wave_replay
from cost_models.stages import FULL, layer_terms, stage_costs
from cost_models.tail import rank_tail
from specs.cluster import ClusterSpec
from specs.model import ModelSpec
from specs.parallel import Candidates, ParallelConfig, microbatches
from specs.state import StateSpec


@dataclass
class BatchResult:
    step_time: np.ndarray
    memory_GiB: np.ndarray


Pipeline = Literal["closed", "mixed", "exact"]


def estimate_batch(model: ModelSpec, cluster: ClusterSpec, c: Candidates, global_batch: int,
                   state: StateSpec | None = None, pipeline: Pipeline = "mixed",
                   progress: Callable[[int, int], None] | None = None,
                   fits_GiB: float | None = None) -> BatchResult:
    """Step time (s) and peak memory per GPU (GiB) of every candidate of ``c``.

    ``pipeline``: "mixed" (the default, described above); "closed" prices even the interleaved pipelines whose
    chunks differ in size in closed form (faster, their times within about 11%; memory is the same); "exact"
    replays every candidate's schedule table as the exact model does (slow: ``--exhaustive``). With
    ``fits_GiB`` only the candidates that fit in that much memory per GPU are timed (the others' time is
    infinite). ``progress`` is called with (candidates priced, all candidates) after each group."""
    state = state or StateSpec.default(cluster.precision)
    cm, comm = ComputeModel(cluster.gpu, cluster.precision), CommModel(cluster)
    terms = layer_terms(model, cm, comm, c)
    step, memory = np.zeros(len(c)), np.zeros(len(c))
    done = 0
    groups = np.stack([c.pp, c.vpp], axis=1)
    for pp, vpp in np.unique(groups, axis=0):
        idx = np.nonzero((c.pp == pp) & (c.vpp == vpp))[0]
        g = c.take(idx)
        split = ParallelConfig(pp=int(pp), vpp=int(vpp), layers=c.layers, recompute="full",
                               recompute_layers=c.recompute_layers)  # the keys all candidates share
        layers = np.array(split.stage_layers(model.num_layers), dtype=float)
        full = np.array([split.recomputed_layers(j, int(n)) for j, n in enumerate(layers)], dtype=float)
        recomputed = np.where(g.recompute[:, None] == FULL, full[None, :], 0.0)
        costs = stage_costs(model, comm, state, g, terms.take(idx), layers, recomputed, cm.eb)
        m = microbatches(global_batch, g.dp, g.mbs)
        mem = rank_memory(g, state, cluster.backend, m, costs.params, costs.act_bytes, costs.work_bytes,
                          costs.largest_bucket)
        memory[idx] = mem.total.max(axis=1) / GiB
        timed = np.nonzero(memory[idx] <= fits_GiB)[0] if fits_GiB is not None else np.arange(len(idx))
        step[idx] = np.inf
        if len(timed):
            g, costs, m = g.take(timed), costs.take(timed), m[timed]
            chunks_differ = vpp > 1 and len(set(layers.tolist())) > 1
            replay = {"exact": table_replay, "mixed": wave_replay if chunks_differ else closed_form}
            pipe = replay.get(pipeline, closed_form)(costs.f, costs.b, int(pp), int(vpp), m)
            step[idx[timed]] = rank_tail(model, cm, comm, state, g, costs, pipe, m, cluster.num_gpus).step_time
        done += len(idx)
        if progress:
            progress(done, len(c))
    return BatchResult(step_time=step, memory_GiB=memory)
