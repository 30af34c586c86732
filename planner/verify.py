"""``autopar estimate --verify``: the memory model beside a replay of the plan's ranks by the runtime.

The replay (``runtime/memory_replay.py``) builds each pipeline rank with the real runtime on the meta device
and counts the bytes it keeps alive; this compares, per pipeline rank, the model state it holds once built and
its peak over a steady step with the memory model's weights + gradients + optimizer state and that plus the
activations and temporaries (the allocator's share, ``allocator_and_reserved``, is not replayed).
"""

from __future__ import annotations

import sys
from typing import Any

from cost_models.memory import GiB
from cost_models.step import Estimate
from specs.errors import AutoparError, needs_torch
from specs.json_numbers import rounded
from specs.planfile import PlanFile


def memory_check(plan: PlanFile, est: Estimate) -> list[dict[str, Any]]:
    """One row per pipeline rank: replayed and predicted state and peak (GiB) and the peak's relative error."""
    try:
        from runtime.memory_replay import replay_rank  # torch: only when asked
    except ImportError as err:
        raise needs_torch("--verify (it replays the runtime on the meta device)", err) from None

    if plan.model.moe is not None:
        raise AutoparError(f"--verify does not replay mixture-of-experts models yet ({plan.model.name}: routing needs "
                           "real token values, which the meta device has none of); leave out --verify")
    rows = []
    for p, parts in enumerate(est.stage_memory_breakdown):
        if sys.stderr.isatty():
            print(f"\rreplaying pipeline rank {p + 1}/{len(est.stage_memory_breakdown)} on the meta device",
                  end="", file=sys.stderr, flush=True)
        r = replay_rank(plan, p)
        state = parts["weights"] + parts["gradients"] + parts["optimizer"]
        peak = state + parts["activations"] + parts["temporary"]
        rows.append(rounded({"pp_rank": r.pp_rank, "state_GiB": r.state_bytes / GiB, "predicted_state_GiB": state,
                             "peak_GiB": r.peak_bytes / GiB, "predicted_peak_GiB": peak,
                             "peak_error": peak / (r.peak_bytes / GiB) - 1 if r.peak_bytes else 0.0}))
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return rows
