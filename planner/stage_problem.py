"""What the stage split (planner/ilp.py, planner/split.py) takes and gives: one configuration's per-stage
times and memory, and the layers (and recomputed layers) per virtual stage chosen."""

from __future__ import annotations

from dataclasses import dataclass


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


@dataclass
class StageSolution:
    layers: tuple[int, ...]
    recompute_layers: tuple[int, ...]
    objective: float
