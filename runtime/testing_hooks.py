"""The training loop's testing hooks: faults, hangs, stragglers and slow plans, set from the environment by tests.

- ``AUTOPAR_FAULT=STEP[:RANK]``: rank RANK (default 0) kills itself with SIGKILL just before step STEP (1-based), as
  a crashed node would (on the first attempt only: a restarted run goes on).
- ``AUTOPAR_HANG=STEP[:RANK]``: it sleeps there instead, as a rank stuck in its own work would.
- ``AUTOPAR_STRAGGLER=RANK:compute:FACTOR[@FIRST[/EVERY]]``: rank RANK's forward and backward take FACTOR times as
  long on steps FIRST, FIRST + EVERY, ... (default: every step); ``RANK:send:SECONDS[@FIRST[/EVERY]]`` delays each
  of its pipeline sends on those steps (a straggler for ``autopar diagnose``; :meth:`PhaseClock.inject`).
- ``AUTOPAR_SLOW="0.5:tp=2 pp=1;30:tp=1"``: plans whose short form starts with the text after a colon sleep that
  long after every step (a slow or stuck `autopar tune` trial).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

from runtime.phase_clock import PhaseClock


@dataclass
class StepHooks:
    """One rank's hooks (all off when the variables are unset)."""

    fault: int | None = None  # the step before which the rank kills itself
    hang: int | None = None  # ... or sleeps for good
    straggle: dict[str, float] = field(default_factory=dict)  # PhaseClock.inject's arguments
    first: int = 1  # the first step straggled, and every how many steps
    every: int = 1
    delay_s: float = 0.0  # seconds slept after each step

    @classmethod
    def from_env(cls, rank: int, attempt: int, plan_keys: str) -> StepHooks:
        """This rank's hooks on attempt ``attempt`` (faults and hangs act on the first only) of a plan whose short form
        is ``plan_keys``."""
        hooks = cls(fault=_step_of(os.environ.get("AUTOPAR_FAULT"), rank, attempt),
                    hang=_step_of(os.environ.get("AUTOPAR_HANG"), rank, attempt), delay_s=_delay(plan_keys))
        spec = os.environ.get("AUTOPAR_STRAGGLER")
        if spec:
            spec, _, when = spec.partition("@")
            who, kind, amount = spec.split(":")
            if int(who) == rank:
                first, _, every = when.partition("/")
                hooks.straggle = {"slow_compute" if kind == "compute" else "send_delay_s": float(amount)}
                hooks.first, hooks.every = int(first or 1), int(every or 1)
        return hooks

    def before_step(self, step: int, clock: PhaseClock) -> None:
        """Act before 1-based step ``step``: die, hang, or set the clock's injection for it."""
        if self.fault == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.hang == step:
            time.sleep(1e9)
        if self.straggle:
            n = step - self.first
            clock.inject(**(self.straggle if n >= 0 and n % self.every == 0 else {}))

    def after_step(self) -> None:
        time.sleep(self.delay_s)


def _step_of(spec: str | None, rank: int, attempt: int) -> int | None:
    """``STEP[:RANK]``'s step when it names this rank, on the first attempt only."""
    if not spec or attempt:
        return None
    step, _, who = spec.partition(":")
    return int(step) if int(who or 0) == rank else None


def _delay(plan_keys: str) -> float:
    for item in filter(None, os.environ.get("AUTOPAR_SLOW", "").split(";")):
        seconds, _, prefix = item.partition(":")
        if plan_keys.startswith(prefix):
            return float(seconds)
    return 0.0
