"""The phase clock's bookkeeping: exclusive times, communication attributed by group inside compute only, and
the straggler hook (on a clock the test advances by hand, and on the host clock)."""

from __future__ import annotations

import time

import pytest

from runtime.phase_clock import PhaseClock
from specs.phases import PHASES


class HandMarks:
    """Marks at the time the test says."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def seconds(self, a: float, b: float) -> float:
        return b - a


def test_exclusive_times_and_communication_by_group():
    marks = HandMarks()
    clock = PhaseClock(marks)
    clock.begin()  # t=0, outside any phase: "other"
    marks.t = 1.0
    clock.enter("forward")
    marks.t = 3.0
    clock.entered("all_reduce", "tp")  # inside compute: tensor-parallel communication
    marks.t = 4.0
    clock.left("all_reduce", "tp")
    marks.t = 4.5
    clock.entered("wait", "dp")  # a ZeRO gather waited on inside compute: data-parallel communication
    marks.t = 5.0
    clock.left("wait", "dp")
    clock.entered("all_reduce", "world")  # a group with no phase of its own stays in compute
    marks.t = 6.0
    clock.left("all_reduce", "world")
    clock.entered("all_to_all", "ep")  # a MoE layer's dispatch: expert-parallel communication
    marks.t = 6.25
    clock.left("all_to_all", "ep")
    clock.entered("all_reduce", "cptp")  # the aux loss's counts over a sequence's cp x tp shards: tp/cp
    marks.t = 6.5
    clock.left("all_reduce", "cptp")
    clock.leave()
    with clock.phase("optimizer"):
        clock.entered("all_reduce", "tp")  # outside compute: the enclosing phase's (the norm's reduction)
        marks.t = 7.5
        clock.left("all_reduce", "tp")
    marks.t = 10.0
    got = clock.take()
    assert set(got) == set(PHASES)
    assert got == {**dict.fromkeys(PHASES, 0.0), "other": 1.0 + 2.5, "forward": 2.0 + 0.5 + 1.0,
                   "tp_cp_comm": 1.0 + 0.25, "ep_comm": 0.25, "dp_comm": 0.5, "optimizer": 1.5 - 0.5}
    assert sum(got.values()) == 10.0
    marks.t = 12.0
    assert clock.take()["other"] == 2.0  # the next step starts where the last was taken


def test_the_straggler_hook_slows_compute_and_delays_sends():
    clock = PhaseClock()
    clock.inject(slow_compute=3.0, send_delay_s=0.05)
    clock.begin()
    with clock.phase("forward"):
        time.sleep(0.02)
    with clock.phase("p2p_send"):
        pass
    got = clock.take()
    assert got["forward"] == pytest.approx(0.06, rel=0.5) and got["forward"] >= 0.06
    assert got["p2p_send"] >= 0.05
