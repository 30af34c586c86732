"""What a stage's data-parallel group communicates under each ZeRO stage, and when: the one statement the pricing
(``stages.zero_traffic`` per micro-batch, ``tail.rank_tail`` per step) and the priced ledger (``ledger.py``) read.

ZeRO-0 all-reduces the gradients once per step; ZeRO-1 reduce-scatters them once per step and all-gathers the
updated parameters; ZeRO-2 reduce-scatters them as each micro-batch's backward makes them (its gradients are
sharded) and all-gathers the parameters after the update; ZeRO-3 (its parameters sharded too) all-gathers each
bucket's parameters before its forward and again before its backward, every micro-batch. One collective per bucket
each time; ZeRO-3's extra forward gather of the ends (``params.zero3_regather``) is priced beside these.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike


@dataclass(frozen=True)
class DpOp:
    """One collective of the data-parallel group, per bucket."""

    op: str  # the collective: all_reduce, reduce_scatter or all_gather (CommModel's and torch.distributed's names)
    what: str  # "grads" (the gradients, at grad_reduce precision) or "params" (the parameters, at param precision)
    stages: tuple[int, ...]  # the ZeRO stages that run it
    per_microbatch: int  # times per micro-batch in the forward + backward; 0: once per step, around the update
    in_forward: bool = False  # (per micro-batch) one of those times is before the forward, the rest in the backward


DP_OPS: tuple[DpOp, ...] = (
    DpOp("all_reduce", "grads", (0,), 0),
    DpOp("reduce_scatter", "grads", (1,), 0),
    DpOp("reduce_scatter", "grads", (2, 3), 1),
    DpOp("all_gather", "params", (1, 2), 0),
    DpOp("all_gather", "params", (3,), 2, in_forward=True),
)


def runs(op: DpOp, zero: ArrayLike) -> np.ndarray:
    """Whether ZeRO stage ``zero`` (arrays broadcast; the stage in effect) runs ``op``."""
    z = np.asarray(zero)
    return np.logical_or.reduce([z == s for s in op.stages])  # (np.isin: ten times the time on a search's few rows)


def per_step(what: str) -> tuple[DpOp, ...]:
    """The collectives of ``what`` run once per step, after the last backward (gradients) or the update (parameters)."""
    return tuple(o for o in DP_OPS if o.what == what and not o.per_microbatch)


def per_microbatch(what: str) -> tuple[DpOp, ...]:
    """The collectives of ``what`` run every micro-batch."""
    return tuple(o for o in DP_OPS if o.what == what and o.per_microbatch)
