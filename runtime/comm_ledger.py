"""The communication ledger of a step: every collective and send this rank issues, by (op, group, dtype).

Off by default: :func:`recording` hears torch.distributed's calls for the duration of a ``with`` block, as an
observer of :class:`~runtime.comm_hooks.CommHooks` (which wraps them and names their process groups, so every call
site is seen: tensor, sequence and context parallelism, the pipeline, data parallelism and ZeRO, the optimizer's norm,
the step's metrics). Each call is booked, once it has returned, under its op (``all_reduce``, ``all_gather``,
``reduce_scatter``, ``all_to_all``, ``send``, ``broadcast``), the plan group it runs on (named from
:class:`~runtime.parallel.mesh.ParallelGroups`; ``other`` for a group the plan does not name), its dtype, with the
bytes as the cost model counts them (cost_models/comm.py: all-gather output, reduce-scatter input, all-reduce buffer,
bytes sent; an all-to-all's input). Receives mirror sends and are not booked; calls on one-rank groups move nothing
and are not booked either. ``cost_models.ledger.priced_ledger`` is what the cost model priced for the same plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from runtime.comm_hooks import CommCall, CommHooks, group_name
from runtime.parallel.mappings import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE
from runtime.parallel.mesh import ParallelGroups


@dataclass
class Ledger:
    """Calls and bytes per (op, group, dtype) of what ran inside :func:`recording`."""

    calls: Counter = field(default_factory=Counter)
    nbytes: Counter = field(default_factory=Counter)

    def book(self, op: str, group: str, t: torch.Tensor, nbytes: int) -> None:
        key = (op, group, str(t.dtype).removeprefix("torch."))
        self.calls[key] += 1
        self.nbytes[key] += nbytes

    def as_dict(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        return {k: (self.calls[k], self.nbytes[k]) for k in sorted(self.calls)}


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _whole(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    return t, _bytes(t)


def _arg(args: Mapping[str, Any], *names: str) -> Any:
    """The first of ``names`` (one parameter's names across torch releases) among the bound ``args``."""
    for n in names:
        if n in args:
            return args[n]
    raise KeyError(f"none of {names} among the call's arguments {list(args)}")


# torch's call -> (the ledger's op, its bound arguments -> the tensor booked (its dtype) and the bytes the cost
# model counts); batch_isend_irecv is booked op by op (_Booker.returned)
_BOOKED: dict[str, tuple[str, Callable[[Mapping[str, Any]], tuple[torch.Tensor, int]]]] = {
    "all_reduce": ("all_reduce", lambda a: _whole(a["tensor"])),
    "all_gather": ("all_gather", lambda a: (a["tensor"], _bytes(a["tensor"]) * len(a["tensor_list"]))),
    ALL_GATHER_SINGLE: ("all_gather", lambda a: _whole(_arg(a, "output_tensor", "output"))),
    REDUCE_SCATTER_SINGLE: ("reduce_scatter", lambda a: _whole(_arg(a, "input_tensor", "input"))),
    "all_to_all_single": ("all_to_all", lambda a: _whole(a["input"])),
    "isend": ("send", lambda a: _whole(a["tensor"])),
    "send": ("send", lambda a: _whole(a["tensor"])),
    "broadcast": ("broadcast", lambda a: _whole(a["tensor"])),
}


class _Booker:
    """A :class:`~runtime.comm_hooks.CommHooks` observer booking each call that returned into ``ledger``."""

    def __init__(self, ledger: Ledger, names: dict[int, str]) -> None:
        self.ledger, self.names = ledger, names

    def entered(self, op: str, group: str) -> None:
        pass

    def left(self, op: str, group: str) -> None:
        pass

    def returned(self, call: CommCall) -> None:
        if call.op == "batch_isend_irecv":  # each op on its own group; receives mirror sends
            for p in call.args["p2p_op_list"]:
                if p.op is dist.distributed_c10d.isend:
                    self._book("send", p.group, *_whole(p.tensor))
        elif call.op in _BOOKED:
            op, what = _BOOKED[call.op]
            self._book(op, call.args.get("group"), *what(call.args))

    def _book(self, op: str, group: dist.ProcessGroup | None, t: torch.Tensor, nbytes: int) -> None:
        if dist.get_world_size(group) > 1:  # a one-rank group moves nothing
            self.ledger.book(op, group_name(self.names, group), t, nbytes)


@contextmanager
def recording(groups: ParallelGroups) -> Iterator[Ledger]:
    """Book every collective and send issued inside the block (this process only)."""
    ledger = Ledger()
    names = groups.group_names()
    hooks = CommHooks(names, [_Booker(ledger, names)]).start()
    try:
        yield ledger
    finally:
        hooks.stop()
