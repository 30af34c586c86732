"""One wrapping of the torch.distributed calls the runtime makes, for a run: observers hear each call begin and end.

The runtime calls torch.distributed through the ``dist`` module, so replacing those functions for the duration of
a run sees every call site (tensor, sequence and context parallelism, the pipeline, data parallelism and ZeRO,
the optimizer, the step's metrics). Each call is reported as ``entered(op, group)`` before it runs and
``left(op, group)`` after it returns, with ``group`` the plan's name for its process group
(:meth:`~runtime.parallel.mesh.ParallelGroups.group_names`). An asynchronous call's ``Work`` remembers its group:
waiting on it is reported as op ``wait`` on that group (``"?"`` when it came from a call not wrapped here).

Observers: the hang watchdog (which rank stopped, inside which call) and the phase clock (how long a step spends
in communication on each group).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist

from runtime.parallel.mappings import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE

CALLS = ("all_reduce", "all_gather", ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE, "all_to_all_single", "broadcast",
         "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier")
_MAX_PENDING = 100_000  # Works never waited on (fire and forget) are forgotten past this many


class CommObserver(Protocol):
    def entered(self, op: str, group: str) -> None: ...

    def left(self, op: str, group: str) -> None: ...


class CommHooks:
    """Wraps :data:`CALLS` and ``Work.wait`` between :meth:`start` and :meth:`stop`; tells every observer."""

    def __init__(self, names: dict[int, str], observers: list[CommObserver] | None = None) -> None:
        self.names = names
        self.observers: list[CommObserver] = list(observers or [])
        self._groups: dict[int, str] = {}  # id(Work) -> its group, until waited on
        self._real: dict[str, Any] = {}
        self._real_wait: Any = None

    def add(self, observer: CommObserver) -> None:
        self.observers.append(observer)

    def _around(self, op: str, group: str, fn: Any, /, *a: Any, **kw: Any) -> Any:
        for o in self.observers:
            o.entered(op, group)
        try:
            return fn(*a, **kw)
        finally:
            for o in reversed(self.observers):
                o.left(op, group)

    def _group_of(self, name: str, a: tuple[Any, ...], kw: dict[str, Any]) -> str:
        if name == "batch_isend_irecv":
            g = a[0][0].group if a and a[0] else None
        else:
            g = kw.get("group") or next((x for x in a if isinstance(x, dist.ProcessGroup)), None)
        return self.names.get(id(g), "world")

    def _wrap(self, name: str, fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            group = self._group_of(name, a, kw)
            out = self._around(name, group, fn, *a, **kw)
            works = out if isinstance(out, list) else [out]
            for w in works:
                if isinstance(w, dist.Work):
                    if len(self._groups) > _MAX_PENDING:
                        self._groups.clear()
                    self._groups[id(w)] = group
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
