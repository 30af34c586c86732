"""The one wrapping of torch.distributed (runtime/comm_hooks.py) and the ledger that observes it
(runtime/comm_ledger.py), on the gloo pool: what observers hear of each call and in which order, how groups are
named (a plan's group by its name, no group as the default one, any other group ``other``), waits on a call's
``Work``, the bytes booked, and torch's own functions once stopped."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from runtime.comm_hooks import CALLS, CommCall, CommHooks
from runtime.comm_ledger import _BOOKED, recording
from runtime.parallel.mappings import ALL_GATHER_SINGLE


class Heard:
    """An observer writing down what it hears: (event, op, group)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def entered(self, op: str, group: str) -> None:
        self.events.append(("entered", op, group))

    def left(self, op: str, group: str) -> None:
        self.events.append(("left", op, group))

    def returned(self, call: CommCall) -> None:
        self.events.append(("returned", call.op, call.group))


class Named:
    """What :func:`recording` reads of a ParallelGroups: its groups' names."""

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names

    def group_names(self) -> dict[int, str]:
        return self.names


def hooks_case(rank: int) -> dict[str, Any]:
    """Ranks 0 and 1 talk on a named pair group, an unnamed one and their own one-rank group; every rank
    all-reduces on the default group. The ledger records inside the hooks (its wrapping over theirs)."""
    pair, unnamed = dist.new_group([0, 1]), dist.new_group([0, 1])
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    names = {id(pair): "tp", id(solo): "mp", id(dist.group.WORLD): "world"}
    real_all_reduce, real_wait = dist.all_reduce, dist.Work.wait
    heard = Heard()
    hooks = CommHooks(names, [heard]).start()
    try:
        with recording(Named(names)) as ledger:
            dist.all_reduce(torch.ones(1))
            if rank < 2:
                t = torch.ones(4)
                dist.all_reduce(t, group=pair)
                dist.all_reduce(t, dist.ReduceOp.SUM, unnamed, True).wait()  # the group passed positionally
                getattr(dist, ALL_GATHER_SINGLE)(torch.empty(8), t, group=pair)
                recv, peer = torch.empty(4), 1 - rank
                ops = [dist.P2POp(dist.distributed_c10d.isend, t, peer, pair),
                       dist.P2POp(dist.distributed_c10d.irecv, recv, peer, pair)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                dist.all_reduce(torch.ones(2, dtype=torch.float64), group=solo)
    finally:
        hooks.stop()
    restored = dist.all_reduce is real_all_reduce and dist.Work.wait is real_wait
    # torch's synchronous calls wait on their own Work inside the call: heard as a wait on "?", left out here
    events = [e for e in heard.events if e[2] != "?"]
    return {"events": events, "ledger": ledger.as_dict(), "restored": restored}


def test_the_ledger_books_only_calls_the_hooks_wrap():
    assert set(_BOOKED) <= set(CALLS)


def test_observers_hear_every_call_and_the_ledger_books_it(pool):
    out = pool.run("test_comm_hooks:hooks_case")
    assert all(r["restored"] for r in out)
    world = [("entered", "all_reduce", "world"), ("left", "all_reduce", "world"), ("returned", "all_reduce", "world")]
    for r in out[2:]:
        assert r["events"] == world
        assert r["ledger"] == {("all_reduce", "world", "float32"): (1, 4)}
    calls = [("all_reduce", "world"), ("all_reduce", "tp"), ("all_reduce", "other"), ("wait", "other"),
             (ALL_GATHER_SINGLE, "tp"), ("batch_isend_irecv", "tp"), ("wait", "tp"), ("wait", "tp"),
             ("all_reduce", "mp")]
    want = [(e, op, g) for op, g in calls for e in ("entered", "left", *(("returned",) if op != "wait" else ()))]
    for r in out[:2]:
        assert r["events"] == want
        assert r["ledger"] == {  # not the receive, nor the one-rank group's reduction
            ("all_gather", "tp", "float32"): (1, 32), ("all_reduce", "other", "float32"): (1, 16),
            ("all_reduce", "tp", "float32"): (1, 16), ("all_reduce", "world", "float32"): (1, 4),
            ("send", "tp", "float32"): (1, 16)}
