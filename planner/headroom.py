"""How much memory a plan may use: the default headroom kept free per GPU, and the warning for tight plans.

The evidence (``python benchmarks/validate_published.py``, benchmarks/RESULTS.md): on BigScience's measured
BLOOM sweep (18 plans that ran on 80 GiB A100s) the memory model's predicted peak is below the measured
nvidia-smi peak by up to 7.7 GiB, 9.7% of the GPU; nvidia-smi counts what a run really needs: the CUDA context,
NCCL's buffers and the caching allocator's blocks, which the model only approximates (memory.py's allowances).
So a plan is chosen only if its predicted peak leaves 10% of the GPU free: every plan of that sweep would then
have fitted as measured. ``--headroom 0`` uses the whole GPU (allowed, with a warning when the plan is tight).
"""

from __future__ import annotations

DEFAULT_FRACTION = 0.10  # of each GPU's memory, kept free by default
MEASURED_EXCESS = 0.097  # the most a measured peak of that sweep ran above the model's, as a fraction of the GPU


def default_headroom_GiB(gpu_GiB: float) -> float:
    """The headroom used when none is given: DEFAULT_FRACTION of the GPU's memory."""
    return DEFAULT_FRACTION * gpu_GiB


def headroom_for(given: float | None, gpu_GiB: float) -> float:
    """``given`` (GiB, as --headroom) or, when None, the default for a GPU of ``gpu_GiB``."""
    return default_headroom_GiB(gpu_GiB) if given is None else given


def memory_warning(stage_GiB: list[float], capacity_GiB: list[float]) -> str | None:
    """A one-line caution when a chosen plan's predicted peak on some pipeline stage (``stage_GiB``) leaves less than
    the default headroom of that stage's GPUs (``capacity_GiB``: on node groups each stage's own) free (only
    possible with a smaller --headroom), or None."""
    used_GiB, gpu_GiB = max(zip(stage_GiB, capacity_GiB), key=lambda s: s[0] / s[1])
    if used_GiB <= gpu_GiB - default_headroom_GiB(gpu_GiB):
        return None
    margin = default_headroom_GiB(gpu_GiB)
    return (f"the best plan fills {used_GiB:.1f} of {gpu_GiB:g} GiB per GPU; measured peaks ran up to "
            f"{MEASURED_EXCESS:.1%} of the GPU above the model's (benchmarks/RESULTS.md), so keep the default "
            f"margin: leave --headroom out "
            f"(--headroom {margin:.3g})")
