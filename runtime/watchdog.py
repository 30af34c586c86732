"""A hang watchdog: a rank that stops making progress ends the run with one line naming the rank and the call.

Every rank counts the communication calls it enters (collectives, sends, receives, barriers, as
:mod:`runtime.comm_hooks` reports them) and the steps it finishes, and knows whether it is blocked inside one
(those calls, or waiting on one's ``Work``); a thread publishes that to the run's rendezvous
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
import threading
import time
from typing import Any

import torch.distributed as dist

from runtime.parallel.mesh import ParallelGroups
from runtime.worker_error import report


class Watchdog:
    """Counts this rank's communication calls and steps; ends the run when progress stops for ``timeout`` s.

    A :class:`~runtime.comm_hooks.CommHooks` observer: it hears every call begin and end."""

    def __init__(self, groups: ParallelGroups, store: dist.Store, timeout: float) -> None:
        self.rank, self.world, self.store, self.timeout = groups.rank, len(groups.ranks), store, timeout
        self.step, self.calls, self.last, self.inside = 0, 0, "none yet", 0
        self._seen, self._since = (0, 0), time.monotonic()
        self._stop = threading.Event()

    # ---- counting ------------------------------------------------------------------------------
    def entered(self, op: str, group: str) -> None:
        if op != "wait":  # waiting on an earlier call's Work is not a new call
            self.calls += 1
            self.last = f"{op} on {group}"
        self.inside += 1

    def left(self, op: str, group: str) -> None:
        self.inside -= 1

    def stepped(self, step: int) -> None:
        self.step = step

    # ---- the thread ----------------------------------------------------------------------------
    def start(self) -> Watchdog:
        """Publish this rank's first record and start the watching thread."""
        self._publish()
        threading.Thread(target=self._watch, daemon=True, name="autopar-watchdog").start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _record(self) -> dict[str, Any]:
        return {"step": self.step, "calls": self.calls, "last": self.last, "inside": self.inside > 0}

    def _watch(self) -> None:
        tick = max(0.2, min(1.0, self.timeout / 10))
        while not self._stop.wait(tick):
            now = (self.step, self.calls)
            if now != self._seen:
                self._seen, self._since = now, time.monotonic()
            if not self._publish():
                return  # the store went away: the run is ending anyway
            if time.monotonic() - self._since > self.timeout:
                self._end()

    def _publish(self) -> bool:
        try:
            self.store.set(f"rank{self.rank}", json.dumps(self._record()))
            return True
        except Exception:  # noqa: BLE001 - a store that is gone
            return False

    def _read(self, r: int) -> dict[str, Any] | None:
        """Rank ``r``'s last record, or None where it never published one (``check`` first: the store's ``get``
        would wait for the key, minutes)."""
        try:
            return json.loads(self.store.get(f"rank{r}")) if self.store.check([f"rank{r}"]) else None
        except Exception:  # noqa: BLE001 - a store that is gone, a record cut short
            return None

    def _end(self) -> None:
        records = {r: self._read(r) for r in range(self.world)}
        silent = [r for r, rec in records.items() if rec is None]
        if silent:  # stopped before its watchdog started (or the store lost its record): the furthest behind
            line = (f"rank {silent[0]} stopped making progress before its first record (it never reported where "
                    "it was: stopped starting up, or frozen)")
            records = {r: rec for r, rec in records.items() if rec is not None}
        else:
            outside = [r for r in records if not records[r]["inside"]]
            behind = min(outside or records, key=lambda r: (records[r]["step"], records[r]["calls"], r))
            rec = records[behind]
            call = f"its call {rec['calls']} ({rec['last']})" if rec["calls"] else "its first communication call"
            line = (f"rank {behind} stopped making progress at step {rec['step'] + 1}, "
                    + (f"inside {call}" if rec["inside"] else f"outside any communication call, after {call}"
                       if rec["calls"] else f"before {call}"))
        waiting = "; ".join(f"rank {r} in {rec['last']}" for r, rec in sorted(records.items())
                            if rec["inside"] and not line.startswith(f"rank {r} "))
        report(f"{line}; the others waited {self.timeout:g} s ({waiting or 'none inside a call'}); look at that "
               "rank (py-spy dump) or raise --collective-timeout")
        os._exit(3)
