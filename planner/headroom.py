"""What the planning commands say of memory: the caution printed when a chosen plan leaves less than the default
headroom free (cost_models/headroom.py), and how much a plan may use."""

from __future__ import annotations

from typing import Any

from cost_models.headroom import MEASURED_EXCESS, default_headroom_GiB, fullest, usable_GiB


def memory_warning(stage_GiB: list[float], capacity_GiB: list[float]) -> str | None:
    """A one-line caution when a chosen plan's predicted peak on some pipeline stage (``stage_GiB``) leaves less than
    the default headroom of that stage's GPUs (``capacity_GiB``: on node groups each stage's own) free (only
    possible with a smaller --headroom), or None."""
    _, used_GiB, gpu_GiB = fullest(stage_GiB, capacity_GiB)
    if used_GiB <= gpu_GiB - default_headroom_GiB(gpu_GiB):
        return None
    margin = default_headroom_GiB(gpu_GiB)
    return (f"the best plan fills {used_GiB:.1f} of {gpu_GiB:g} GiB per GPU; measured peaks ran up to "
            f"{MEASURED_EXCESS:.1%} of the GPU above the model's (benchmarks/RESULTS.md), so keep the default "
            f"margin: leave --headroom out "
            f"(--headroom {margin:.3g})")


def usable_text(headroom_GiB: float | None, cluster: Any) -> str:
    """What a plan may use per GPU, in words: ``43.2 GiB per GPU``, or on node groups of different GPUs the smallest
    and the largest (a placed stage is checked on its own group's GPUs)."""
    sizes = cluster.memory_sizes_GiB
    low = f"{usable_GiB(headroom_GiB, sizes[0]):g} GiB per GPU"
    high = usable_GiB(headroom_GiB, sizes[-1])
    return low if len(sizes) == 1 else f"{low} on the smallest GPUs ({high:g} on the largest)"
