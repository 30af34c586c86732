"""Where one rank's step went: exclusive time per phase, in the breakdown ``autopar estimate`` prices.

Phases: :data:`specs.phases.PHASES` (what each holds is said there). Times are exclusive: a phase entered inside
another stops the outer one's clock, so a step's phases sum to its time. The runtime marks the phases it knows
(:meth:`PhaseClock.phase`); communication inside forward and backward is attributed by its process group, as a
:class:`~runtime.comm_hooks.CommHooks` observer. On CPU a switch reads the host clock; on CUDA it records an event
on the current stream and the step's events are read once at its end, so a phase's time is the stream's (a wait on a
collective counts as long as the stream stalls), and nothing synchronises mid-step.

Testing hook (:meth:`PhaseClock.inject`, set from ``AUTOPAR_STRAGGLER`` only, runtime/testing_hooks.py): a rank made a
straggler, its compute slower or its sends delayed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from specs.parallel import SEQ_GROUP
from specs.phases import COMPUTE, PHASES

# communication inside forward/backward, by the plan's name of its group (ParallelGroups.group_names)
COMM_PHASE = {"tp": "tp_cp_comm", "cp": "tp_cp_comm", SEQ_GROUP: "tp_cp_comm", "ep": "ep_comm", "etp": "ep_comm",
              "dp": "dp_comm", "edp": "dp_comm", "embed": "dp_comm", "pp": "p2p_wait"}


class HostMarks:
    """Marks on the host clock."""

    def now(self) -> float:
        return time.perf_counter()

    def seconds(self, a: float, b: float) -> float:
        return b - a


class CudaMarks:
    """Marks as CUDA events on the current stream, read after the last one completes."""

    def now(self) -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def seconds(self, a: Any, b: Any) -> float:
        b.synchronize()
        return a.elapsed_time(b) / 1e3


class PhaseClock:
    """Exclusive time per phase of the step between :meth:`begin` and :meth:`take`."""

    def __init__(self, marks: HostMarks | CudaMarks | None = None) -> None:
        self.marks = marks or HostMarks()
        self.slow_compute, self.send_delay_s = 1.0, 0.0  # the testing hook (inject)
        self._frames: list[list[Any]] = [["other", 0.0, time.perf_counter()]]  # [phase, host excl s, since]
        self._pushed: list[bool] = []  # per communication call in flight: whether it entered a phase
        self._log: list[tuple[str, Any]] = []  # (phase running from this mark on, mark)

    def inject(self, slow_compute: float = 1.0, send_delay_s: float = 0.0) -> None:
        """Testing hook: from now on every forward and backward takes ``slow_compute`` times as long (this rank
        spins for the rest) and each pipeline send is delayed ``send_delay_s`` seconds."""
        self.slow_compute, self.send_delay_s = slow_compute, send_delay_s

    # ---- phases --------------------------------------------------------------------------------
    def enter(self, name: str) -> None:
        now = time.perf_counter()
        top = self._frames[-1]
        top[1] += now - top[2]
        self._frames.append([name, 0.0, now])
        self._log.append((name, self.marks.now()))
        if name == "p2p_send" and self.send_delay_s:
            time.sleep(self.send_delay_s)

    def leave(self) -> None:
        name, excl, since = self._frames.pop()
        if name in COMPUTE and self.slow_compute > 1:  # busy, as slower compute would be (a sleep frees the core)
            until = time.perf_counter() + (self.slow_compute - 1) * (excl + time.perf_counter() - since)
            while time.perf_counter() < until:
                pass
        top = self._frames[-1]
        top[2] = time.perf_counter()
        self._log.append((top[0], self.marks.now()))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.enter(name)
        try:
            yield
        finally:
            self.leave()

    # ---- communication (a CommHooks observer) ---------------------------------------------------
    def entered(self, op: str, group: str) -> None:
        phase = COMM_PHASE.get(group) if self._frames[-1][0] in COMPUTE else None
        self._pushed.append(phase is not None)
        if phase is not None:
            self.enter(phase)

    def left(self, op: str, group: str) -> None:
        if self._pushed and self._pushed.pop():
            self.leave()

    # ---- a step --------------------------------------------------------------------------------
    def begin(self) -> None:
        """Start a step: what was counted so far is dropped."""
        self._log = [(self._frames[-1][0], self.marks.now())]

    def take(self) -> dict[str, float]:
        """Seconds per phase since :meth:`begin`."""
        log = [*self._log, ("", self.marks.now())]
        out = dict.fromkeys(PHASES, 0.0)
        for (name, a), (_, b) in zip(log, log[1:]):
            out[name] += self.marks.seconds(a, b)
        self.begin()
        return out
