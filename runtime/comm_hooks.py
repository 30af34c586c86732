"""One wrapping of the torch.distributed calls the runtime makes, for a run: observers hear each call begin and end.

The runtime calls torch.distributed through the ``dist`` module, so replacing those functions for the duration of
a run sees every call site (tensor, sequence and context parallelism, the pipeline, data parallelism and ZeRO,
the optimizer, the step's metrics). Each call is reported as ``entered(op, group)`` before it runs and
``left(op, group)`` after it returns (or raises), with ``op`` torch's name of the function and ``group`` the plan's
name of its process group (:func:`group_name`). An asynchronous call's ``Work`` remembers its group: waiting on it is
reported as op ``wait`` on that group (``"?"`` when it came from a call not wrapped here). An observer that also
has ``returned(call)`` (:class:`CallObserver`) then hears each call that returned, with its arguments bound to their
parameter names (:class:`CommCall`); waits are not calls.

Observers: the hang watchdog (which rank stopped, inside which call), the phase clock (how long a step spends in
communication on each group) and the communication ledger (:mod:`runtime.comm_ledger`: what each call moved).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

from runtime.parallel.mappings import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE

# the torch.distributed functions wrapped (those of them this torch has)
CALLS = ("all_reduce", "all_gather", ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE, "all_to_all_single", "broadcast",
         "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier")
UNNAMED = "other"  # the name of a process group the plan does not name
_MAX_PENDING = 100_000  # Works never waited on (fire and forget) are forgotten past this many


def group_name(names: Mapping[int, str], group: dist.ProcessGroup | None) -> str:
    """The plan's name of ``group`` (``names``: :meth:`~runtime.parallel.mesh.ParallelGroups.group_names`, by ``id``).

    ``None`` is torch's default group (the job's world in a run); a group the plan does not name is
    :data:`UNNAMED`, never mistaken for one it prices."""
    return names.get(id(dist.group.WORLD if group is None else group), UNNAMED)


def _group_arg(op: str, args: Mapping[str, Any]) -> dist.ProcessGroup | None:
    """The process group a call with bound ``args`` runs on (a batch of point-to-point ops: its first op's)."""
    if op == "batch_isend_irecv":
        ops = args.get("p2p_op_list") or []
        return ops[0].group if ops else None
    return args.get("group")


@dataclass(frozen=True)
class CommCall:
    """A wrapped call that returned: torch's name of it, the plan's name of its group, its bound arguments (only
    those the caller passed: a missing ``group`` is the default one)."""

    op: str
    group: str
    args: Mapping[str, Any]


class CommObserver(Protocol):
    def entered(self, op: str, group: str) -> None: ...

    def left(self, op: str, group: str) -> None: ...


@runtime_checkable
class CallObserver(CommObserver, Protocol):
    """An observer that also hears each call that returned, with its arguments."""

    def returned(self, call: CommCall) -> None: ...


class CommHooks:
    """Wraps :data:`CALLS` and ``Work.wait`` between :meth:`start` and :meth:`stop`; tells every observer."""

    def __init__(self, names: dict[int, str], observers: list[CommObserver] | None = None) -> None:
        self.names = names
        self.observers: list[CommObserver] = []
        self._callers: list[CallObserver] = []  # the observers that also hear calls returned
        for o in observers or []:
            self.add(o)
        self._groups: dict[int, str] = {}  # id(Work) -> its group, until waited on
        self._real: dict[str, Any] = {}
        self._real_wait: Any = None

    def add(self, observer: CommObserver) -> None:
        self.observers.append(observer)
        if isinstance(observer, CallObserver):
            self._callers.append(observer)

    def _around(self, op: str, group: str, fn: Any, /, *a: Any, **kw: Any) -> Any:
        for o in self.observers:
            o.entered(op, group)
        try:
            return fn(*a, **kw)
        finally:
            for o in reversed(self.observers):
                o.left(op, group)

    def _remember(self, out: Any, group: str) -> None:
        """The group of each ``Work`` a call returned, for its wait."""
        for w in out if isinstance(out, list) else [out]:
            if isinstance(w, dist.Work):
                if len(self._groups) > _MAX_PENDING:
                    self._groups.clear()
                self._groups[id(w)] = group

    def _wrap(self, op: str, fn: Any) -> Any:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*a: Any, **kw: Any) -> Any:
            try:
                args = sig.bind(*a, **kw).arguments
            except TypeError:
                return fn(*a, **kw)  # not a valid call: torch says why
            group = group_name(self.names, _group_arg(op, args))
            out = self._around(op, group, fn, *a, **kw)
            self._remember(out, group)
            if self._callers:
                done = CommCall(op, group, args)
                for o in self._callers:
                    o.returned(done)
            return out
        return call

    def start(self) -> CommHooks:
        for n in CALLS:
            if hasattr(dist, n):
                self._real[n] = getattr(dist, n)
                setattr(dist, n, self._wrap(n, self._real[n]))
        real_wait = self._real_wait = dist.Work.wait
        hooks = self

        def wait(work: dist.Work, *a: Any, **kw: Any) -> Any:
            return hooks._around("wait", hooks._groups.pop(id(work), "?"), real_wait, work, *a, **kw)

        dist.Work.wait = wait
        return self

    def stop(self) -> None:
        """torch's own functions again."""
        for n, fn in self._real.items():
            setattr(dist, n, fn)
        self._real.clear()
        if self._real_wait is not None:
            dist.Work.wait = self._real_wait
            self._real_wait = None
