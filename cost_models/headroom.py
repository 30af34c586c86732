"""How much memory a plan may use: the headroom kept free on each GPU, by default a share of that GPU's memory.

The evidence (``python benchmarks/validate_published.py``, benchmarks/RESULTS.md): on BigScience's measured
BLOOM sweep (18 plans that ran on 80 GiB A100s) the memory model's predicted peak is below the measured
nvidia-smi peak by up to 7.7 GiB, 9.7% of the GPU; nvidia-smi counts what a run really needs: the CUDA context,
NCCL's buffers and the caching allocator's blocks, which the model only approximates (memory.py's allowances).
So a plan is chosen only if its predicted peak leaves 10% of the GPU free: every plan of that sweep would then
have fitted as measured. ``--headroom 0`` uses the whole GPU (allowed, with a warning when the plan is tight).
"""

from __future__ import annotations

from typing import Any

from specs.errors import AutoparError

DEFAULT_FRACTION = 0.10  # of each GPU's memory, kept free by default
MEASURED_EXCESS = 0.097  # the most a measured peak of that sweep ran above the model's, as a fraction of the GPU


def default_headroom_GiB(gpu_GiB: float) -> float:
    """The headroom used when none is given: DEFAULT_FRACTION of the GPU's memory."""
    return DEFAULT_FRACTION * gpu_GiB


def headroom_for(given: float | None, gpu_GiB: float) -> float:
    """GiB kept free on a GPU of ``gpu_GiB``: ``given`` (as --headroom: the same on every GPU) or, when None, the
    default share of that GPU (on node groups each stage's own GPUs; a plan fits when every stage leaves its
    headroom free, cost_models/step.py)."""
    return default_headroom_GiB(gpu_GiB) if given is None else given


def usable_GiB(given: float | None, gpu_GiB: float) -> float:
    """What a plan may use of a GPU of ``gpu_GiB``: its memory less :func:`headroom_for`."""
    return gpu_GiB - headroom_for(given, gpu_GiB)


def fullest(stage_GiB: list[float], capacity_GiB: list[float]) -> tuple[int, float, float]:
    """(stage, GiB, GPU GiB) of the pipeline stage whose peak is the largest share of its GPU's memory (node groups:
    each stage on its own GPUs)."""
    stage = max(range(len(stage_GiB)), key=lambda i: stage_GiB[i] / capacity_GiB[i])
    return stage, stage_GiB[stage], capacity_GiB[stage]


def check_headroom(headroom_GiB: float | None, cluster: Any) -> None:
    """Refuse a headroom that is not a share of the GPU's memory (negative, NaN, all of it or more)."""
    h = headroom_GiB
    if h is not None and not (h == h and 0 <= h < cluster.gpu.memory_GiB):  # h == h: not NaN
        raise AutoparError(f"--headroom must be between 0 and the GPU's {cluster.gpu.memory_GiB:g} GiB, got {h}")
