"""``autopar estimate --verify``: the memory model beside a replay of the plan's ranks by the runtime.

The replay (``runtime/memory_replay.py``) builds each pipeline rank with the real runtime on the meta device
and counts the bytes it keeps alive; this compares, per pipeline rank, the model state it holds once built and
its peak over a steady step with the memory model's weights + gradients + optimizer state and that plus the
activations and temporaries (the allocator's share, ``allocator_and_reserved``, is not replayed).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from cost_models.memory import GiB
from cost_models.step import Estimate
from specs.errors import AutoparError, RunFailed, needs_torch
from specs.host import usable_cores
from specs.json_numbers import rounded
from specs.model import ModelSpec
from specs.planfile import PlanFile


def check_verifiable(model: ModelSpec) -> None:
    """Refuse ``--verify`` where it cannot replay (no torch, a mixture-of-experts model): before a search, not after."""
    try:
        import runtime.memory_replay  # noqa: F401 - torch: only when asked
    except ImportError as err:
        raise needs_torch("--verify (it replays the runtime on the meta device)", err) from None
    if model.moe is not None:
        raise AutoparError(f"--verify does not replay mixture-of-experts models yet ({model.name}: routing needs "
                           "real token values, which the meta device has none of); leave out --verify")


POOL_AFTER_S = 20.0  # replays left that would take longer than this one after another run in parallel processes


def memory_check(plan: PlanFile, est: Estimate) -> list[dict[str, Any]]:
    """One row per pipeline rank: replayed and predicted state and peak (GiB) and the peak's relative error."""
    check_verifiable(plan.model)
    rows = []
    parts = est.stage_memory_breakdown
    for r in _replays(plan, len(parts)):
        p = parts[r.pp_rank]
        state = p["weights"] + p["gradients"] + p["optimizer"]
        peak = state + p["activations"] + p["temporary"]
        rows.append(rounded({"pp_rank": r.pp_rank, "state_GiB": r.state_bytes / GiB, "predicted_state_GiB": state,
                             "peak_GiB": r.peak_bytes / GiB, "predicted_peak_GiB": peak,
                             "peak_error": peak / (r.peak_bytes / GiB) - 1 if r.peak_bytes else 0.0}))
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return rows


def _replays(plan: PlanFile, ranks: int) -> Iterator[Any]:
    """Each pipeline rank's replay in order (``runtime.memory_replay.RankReplay``): the first here, and the rest
    in as many processes as there are cores (each its own fake process group) where one after another they would
    take more than :data:`POOL_AFTER_S` (a 405B pipeline of 16 ranks with overlapped tensor parallelism: minutes)."""
    from runtime.memory_replay import replay_rank

    def said(p: int) -> None:
        if sys.stderr.isatty():
            print(f"\rreplaying pipeline rank {p + 1}/{ranks} on the meta device", end="", file=sys.stderr, flush=True)

    said(0)
    t0 = time.perf_counter()
    yield _kept(plan, 0)
    workers = min(ranks - 1, usable_cores())
    if workers < 2 or (time.perf_counter() - t0) * (ranks - 1) <= POOL_AFTER_S:
        for p in range(1, ranks):
            said(p)
            yield _kept(plan, p)
        return
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"),  # (a fork of a process that ran
                               initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN))  # torch may hang)
    try:
        for p, r in enumerate(pool.map(replay_rank, [plan] * (ranks - 1), range(1, ranks)), start=1):
            said(p)  # (this one and those before it are done)
            yield r
    except BrokenProcessPool:
        raise RunFailed(f"a process replaying {plan.model.name}'s pipeline ranks ended before it was done (killed for "
                        "memory?); run --verify on a machine with more memory, or leave it out") from None
    finally:  # (Ctrl-C: the replays still running are not waited for)
        for proc in list(getattr(pool, "_processes", {}).values()):
            proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)


def _kept(plan: PlanFile, p: int) -> Any:
    """Pipeline rank ``p``'s replay here, with Ctrl-C kept (:func:`_ctrl_c_kept`)."""
    from runtime.memory_replay import replay_rank

    with _ctrl_c_kept() as pressed:
        r = replay_rank(plan, p)
    if pressed:  # Ctrl-C landed in a tensor's finalizer, where Python prints and drops it: stop here instead
        raise KeyboardInterrupt
    return r


@contextlib.contextmanager
def _ctrl_c_kept() -> Iterator[list[bool]]:
    """While the block runs, Ctrl-C raises as usual and is also recorded (the list holds True): the replay frees
    meta tensors in finalizers, and a KeyboardInterrupt raised inside one is printed and dropped by Python."""
    pressed: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield pressed
        return

    def handler(signum: int, frame: Any) -> None:
        pressed.append(True)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, old)
