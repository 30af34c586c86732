"""What the stage split (planner/ilp.py, planner/split.py) takes and gives: one configuration's per-stage
times and memory, and the layers (and recomputed layers) per virtual stage chosen.

``stage_problem`` reads the inputs off the cost model's own per-stage terms (cost_models/stages.py) and adds
memory up as ``cost_models.memory.rank_memory`` does, with its pieces."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cost_models.comm import CommModel
from cost_models.compute import ComputeModel
from cost_models.headroom import usable_GiB
from cost_models.memory import GiB, fragmentation_bytes, reserved_bytes, state_per_param, temporary_bytes
from cost_models.pipeline import inflight_profiles
from cost_models.stages import LayerTerms, StageCosts, layer_terms, stage_costs
from specs.cluster import ClusterSpec
from specs.model import ModelSpec
from specs.parallel import Candidates, ParallelConfig
from specs.state import StateSpec


@dataclass
class StageProblem:
    num_layers: int
    pp: int
    vpp: int
    microbatches: int
    layer_time: float  # forward + backward of one layer, no recompute
    recompute_time: float  # extra time of fully recomputing one layer
    extra_time: list[float]  # per virtual stage: embedding, head, p2p
    state_per_layer: float  # bytes of weights + grads + optimizer per layer on one GPU
    extra_state: list[float]  # per virtual stage: embedding / head state bytes
    act_full: float  # bytes stored per layer per in-flight micro-batch, no recompute
    act_ckpt: float  # ... with full recompute of that layer
    extra_act: list[float]  # per virtual stage: bytes per in-flight micro-batch (embedding / logits)
    inflight: list[int]  # per virtual stage: micro-batches in flight at the rank's peak
    fixed_bytes: float  # per GPU: temporaries, allowances
    capacity: float  # bytes per GPU
    allow_recompute: bool
    fixed_layers: tuple[int, ...] | None = None  # layers per virtual stage held as given


@dataclass(frozen=True)
class StageSolution:
    layers: tuple[int, ...]
    recompute_layers: tuple[int, ...]
    objective: float


def stage_problem(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, global_batch: int,
                  headroom_GiB: float | None, state: StateSpec, terms: LayerTerms | None = None) -> StageProblem:
    """The ILP's inputs for one configuration, read off the cost model's own per-stage terms: each stage's
    costs with no layers (the embedding, head and sends), with one layer, and with one recomputed layer."""
    cm, comm = ComputeModel.of(cluster), CommModel(cluster)
    c = Candidates.of(replace(cfg, layers=None, recompute_layers=None))
    lt = terms or layer_terms(model, cm, comm, c, state)
    nv, m = cfg.num_chunks, cfg.microbatches(global_batch)
    none, one = np.zeros(nv), np.ones(nv)
    base, plain, redone = (stage_costs(model, comm, state, c, lt, layers, rec, cm.eb)
                           for layers, rec in ((none, none), (one, none), (one, one)))
    u = lambda s: (s.f + s.b)[0]  # noqa: E731 - a stage's time per micro-batch
    return StageProblem(
        num_layers=model.num_layers, pp=cfg.pp, vpp=cfg.vpp, microbatches=m,
        layer_time=float((u(plain) - u(base)).max()), recompute_time=float((u(redone) - u(plain)).max()),
        extra_time=u(base).tolist(), inflight=_inflight(cfg.pp, cfg.vpp, m),
        **_memory_terms(c, state, cluster.backend, base, plain, redone),
        capacity=usable_GiB(headroom_GiB, cluster.gpu.memory_GiB) * GiB, allow_recompute=cfg.recompute == "full",
        fixed_layers=cfg.layers,
    )


def _memory_terms(c: Candidates, state: StateSpec, backend: str, base: StageCosts, plain: StageCosts,
                  redone: StageCosts) -> dict[str, Any]:
    """The ILP's memory coefficients from the costs of stages with no layer (``base``), one layer (``plain``) and
    one recomputed layer (``redone``), each term as ``rank_memory`` counts it (its activations and temporaries with
    their fragmentation)."""
    per_param, per_expert = (float(x[0]) for x in state_per_param(c, state))
    frag = 1.0 + fragmentation_bytes(1.0)  # a dynamic byte with its fragmentation (linear in the bytes)
    # a stage's temporaries as stage_state counts them (a layer's backward with ZeRO's scatter buffer, a fully
    # recomputed layer's rebuilt activations, or the head's), with ZeRO-3's gathered bucket
    work = np.maximum(plain.work_bytes, redone.work_bytes).max(axis=1)
    temporary = temporary_bytes(c, state, work, plain.largest_bucket.max(axis=1)).item()
    return dict(
        state_per_layer=float(((plain.params - plain.expert_params - base.params) * per_param
                               + plain.expert_params * per_expert)[0].max()),
        extra_state=(base.params[0] * per_param).tolist(),
        act_full=float((plain.act_bytes - base.act_bytes)[0].max()) * frag,
        act_ckpt=float((redone.act_bytes - base.act_bytes)[0].max()) * frag,
        extra_act=(base.act_bytes[0] * frag).tolist(),
        fixed_bytes=reserved_bytes(backend) + temporary * frag,
    )


def _inflight(pp: int, vpp: int, m: int) -> list[int]:
    """Per virtual stage: the micro-batches its rank holds in flight at its peak."""
    profiles = inflight_profiles(pp, vpp, m)
    return [int(profiles[j % pp][:, j // pp].max()) for j in range(pp * vpp)]
