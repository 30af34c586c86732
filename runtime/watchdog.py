"""A hang watchdog: a rank that stops making progress ends the run with one line naming the rank and the call.

Every rank counts the communication calls it enters (the ``torch.distributed`` functions the runtime calls,
wrapped for the run: collectives, sends, receives, barriers) and the steps it finishes, and knows whether it is
blocked inside one (those calls, or waiting on one's ``Work``); a thread publishes that to the run's rendezvous
store about once a second. When a rank has made no progress for ``timeout`` seconds (no call entered, no step
finished), it reads every rank's record. The rank the others wait for is one that is not inside any call (stuck in
its own work); among several, or when every rank is inside one (mismatched collectives), the one furthest behind.
Every watching rank prints the same line, ``autopar error: rank R stopped making progress at step S ... (last:
<op> on <group>)``, and exits; torchrun then stops the rest, so nothing is left running. A rank that died instead
is torchrun's to report (it restarts or fails the run at once).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from runtime.parallel.mappings import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE
from runtime.parallel.mesh import ParallelGroups

_WATCHED = ("all_reduce", "all_gather", ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE, "broadcast", "send", "recv",
            "isend", "irecv", "batch_isend_irecv", "barrier")



class Watchdog:
    """Counts this rank's communication calls and steps; ends the run when progress stops for ``timeout`` s."""

    def __init__(self, groups: ParallelGroups, store: dist.Store, timeout: float) -> None:
        self.rank, self.world, self.store, self.timeout = groups.rank, len(groups.ranks), store, timeout
        self.names = groups.group_names()
        self.step, self.calls, self.last, self.inside = 0, 0, "none yet", 0
        self._seen, self._since = (0, 0), time.monotonic()
        self._real: dict[str, Any] = {}
        self._stop = threading.Event()

    # ---- counting ------------------------------------------------------------------------------
    def _blocking(self, fn: Any) -> Any:
        """``fn``, with this rank counted as inside a communication call while it runs."""
        def call(*a: Any, **kw: Any) -> Any:
            self.inside += 1
            try:
                return fn(*a, **kw)
            finally:
                self.inside -= 1
        return call

    def _wrap(self, name: str, fn: Any) -> Any:
        """The torch.distributed function ``name``, counted and remembered as the last call (op on group)."""
        blocking = self._blocking(fn)

        def call(*a: Any, **kw: Any) -> Any:
            if name == "batch_isend_irecv":
                group = a[0][0].group if a and a[0] else None
            else:
                group = kw.get("group") or next((x for x in a if isinstance(x, dist.ProcessGroup)), None)
            self.calls += 1
            self.last = f"{name} on {self.names.get(id(group), 'world')}"
            return blocking(*a, **kw)
        return call

    def stepped(self, step: int) -> None:
        self.step = step

    # ---- the thread ----------------------------------------------------------------------------
    def start(self) -> Watchdog:
        """Wrap the communication calls and start the watching thread."""
        for n in _WATCHED:
            if hasattr(dist, n):
                self._real[n] = getattr(dist, n)
                setattr(dist, n, self._wrap(n, self._real[n]))
        self._real_wait = dist.Work.wait
        dist.Work.wait = self._blocking(self._real_wait)
        threading.Thread(target=self._watch, daemon=True, name="autopar-watchdog").start()
        return self

    def stop(self) -> None:
        """Stop watching; the communication calls are torch's own again."""
        self._stop.set()
        for n, fn in self._real.items():
            setattr(dist, n, fn)
        dist.Work.wait = self._real_wait

    def _record(self) -> dict[str, Any]:
        return {"step": self.step, "calls": self.calls, "last": self.last, "inside": self.inside > 0}

    def _watch(self) -> None:
        tick = max(0.2, min(1.0, self.timeout / 10))
        while not self._stop.wait(tick):
            now = (self.step, self.calls)
            if now != self._seen:
                self._seen, self._since = now, time.monotonic()
            try:
                self.store.set(f"rank{self.rank}", json.dumps(self._record()))
            except Exception:  # noqa: BLE001 - the store went away: the run is ending anyway
                return
            if time.monotonic() - self._since > self.timeout:
                self._end()

    def _end(self) -> None:
        records = {}
        for r in range(self.world):
            try:
                records[r] = json.loads(self.store.get(f"rank{r}"))
            except Exception:  # noqa: BLE001 - a rank that never published: treat it as furthest behind
                records[r] = {"step": -1, "calls": -1, "last": "none", "inside": False}
        outside = [r for r in records if not records[r]["inside"]]
        behind = min(outside or records, key=lambda r: (records[r]["step"], records[r]["calls"], r))
        rec = records[behind]
        where = "inside" if rec["inside"] else "outside any communication call, after"
        waiting = "; ".join(f"rank {r} in {records[r]['last']}" for r in sorted(records)
                            if r != behind and records[r]["inside"])
        others = waiting or "none inside a call"
        print(f"autopar error: rank {behind} stopped making progress at step {rec['step'] + 1}, {where} its call "
              f"{rec['calls']} ({rec['last']}); the others waited {self.timeout:g} s ({others}); look at that rank "
              "(py-spy dump) or raise --collective-timeout", file=sys.stderr, flush=True)
        os._exit(3)
