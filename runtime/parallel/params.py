"""One record per parameter, built once by :func:`runtime.parallel.parallelize.parallelize`: which slice of the
full tensor it holds, which groups reduce its gradient, whether the gradient norm counts it, and the name its
initial value is drawn from. The data-parallel layer, the optimizer, initialisation and the checkpoints read
these records; nothing is stored on the parameters themselves.

Reduce groups (``ParamInfo.reduce``), each a group of gradient buckets of its own:

* ``("dp",)`` — summed over the data-parallel ranks (dp x cp) only;
* ``("dp", "tp")`` — held whole on every tensor-parallel rank but fed by a sequence shard (sequence
  parallelism): after the data-parallel reduce, also summed over tp;
* ``("dp", "embed")`` — a tied embedding split over the first and the last pipeline stage: first summed with
  the other end of the pipeline, then over dp;
* ``("edp",)`` — a mixture-of-experts layer's routed experts: summed over the expert-data-parallel ranks (those
  of the stage that hold the same experts, :mod:`runtime.parallel.mesh`), which see every token of the
  data-parallel and tensor-parallel ranks between them, then averaged over dp x cp like the others.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from torch import nn

from runtime.parallel.tensor_parallel import Sharding

Reduce = tuple[str, ...]
DP: Reduce = ("dp",)
DP_TP: Reduce = ("dp", "tp")
DP_EMBED: Reduce = ("dp", "embed")
EDP: Reduce = ("edp",)


@dataclass(frozen=True)
class ParamInfo:
    """How one parameter (by its full model name) is sharded, reduced, counted and initialised."""

    name: str
    shard: Sharding | None  # the slice it holds; None: held whole
    reduce: Reduce  # the groups its gradient is summed over, in order (DP, DP_TP, DP_EMBED or EDP)
    in_norm: bool  # counted in the gradient norm (False for copies counted elsewhere)
    init_key: str  # the name whose (seed, name) draw initialises it
    # the group whose ranks hold the other slices: "tp"; for routed experts "ep", "etp", or "ep+etp" (Nested)
    shard_over: str = "tp"


@dataclass(frozen=True)
class ParamTable:
    """The :class:`ParamInfo` of every parameter of this rank's chunks, by full name (stable across
    re-allocation: ``materialize`` swaps the meta tensors for real ones, the names stay)."""

    infos: Mapping[str, ParamInfo]

    def __getitem__(self, name: str) -> ParamInfo:
        return self.infos[name]

    def named(self, module: nn.Module) -> Iterator[tuple[nn.Parameter, ParamInfo]]:
        """``module``'s parameters (each once) with their records."""
        for name, p in module.named_parameters():
            yield p, self.infos[name]
