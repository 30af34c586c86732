"""A pool of gloo worker processes, spawned once and reused by many multi-rank test cases.

Starting a process that imports torch costs seconds on a small machine, so the tests start ``world``
workers once (a session fixture), forked from a server that has imported torch and the runtime, and send
them cases: ``pool.run("module:function", *args)`` calls
``function(rank, *args)`` on every worker and returns the results in rank order. A case builds its own
sub-groups over the ranks it needs (``runtime.parallel.mesh.build_groups(..., ranks=...)``); the others
take part in group creation and return None. A failing or hung case marks the pool broken: it is torn down
and the next case starts a fresh one.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import os
import queue
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def _worker(rank: int, world: int, init_method: str, inbox: Any, outbox: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    while True:
        task = inbox.get()
        if task is None:
            break
        ref, args = task
        try:
            mod, fn = ref.split(":")
            outbox.put((rank, True, getattr(importlib.import_module(mod), fn)(rank, *args)))
        except BaseException:  # noqa: BLE001 - reported to the test process
            outbox.put((rank, False, traceback.format_exc()))
        gc.collect()  # frees the case's destroyed process groups (and their gloo threads) now
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world: int) -> None:
        self.world = world
        self.procs: list[Any] = []
        self.store = ""  # the workers' FileStore once started
        self.broken = True

    def _start(self) -> None:
        # A fork server imports torch and the runtime once; each worker is a fork of it (a fresh spawn per
        # worker would import torch eight times over on two cores).
        # (Python 3.11's fork server ignores sys.path when preloading: hand it over in PYTHONPATH.)
        here = Path(__file__).resolve().parent
        paths = [str(here), str(here.parents[1]), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        ctx = mp.get_context("forkserver")
        # torch._dynamo too: torch.utils.checkpoint imports it on its first call (sympy and all: 2 s a process), which
        # every worker of the plans that recompute would otherwise repeat
        ctx.set_forkserver_preload(["rt_cases", "torch._dynamo"])
        fd, store = tempfile.mkstemp(prefix="autopar-pool-")
        os.close(fd)
        os.unlink(store)
        self.store = store  # the workers' FileStore, removed by close()
        self.inboxes = [ctx.Queue() for _ in range(self.world)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, self.world, f"file://{store}", self.inboxes[r], self.outbox),
                                  daemon=True) for r in range(self.world)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, ref: str, *args: Any, timeout: float = 240.0) -> list[Any]:
        """Run ``ref`` on every worker; results in rank order. Raises with the first failing rank's traceback."""
        if self.broken:
            self.close()
            self._start()
        for box in self.inboxes:
            box.put((ref, args))
        results: dict[int, tuple[bool, Any]] = {}
        try:
            while len(results) < self.world:
                rank, ok, value = self.outbox.get(timeout=timeout)
                results[rank] = (ok, value)
                if not ok:
                    break
        except queue.Empty:
            self.broken = True
            raise AssertionError(f"{ref} timed out after {timeout:.0f}s on ranks "
                                 f"{sorted(set(range(self.world)) - set(results))}") from None
        failed = [(r, v) for r, (ok, v) in sorted(results.items()) if not ok]
        if failed:
            self.broken = True
            raise AssertionError(f"{ref} failed on rank {failed[0][0]}:\n{failed[0][1]}")
        return [results[r][1] for r in range(self.world)]

    def close(self) -> None:
        if not self.broken:
            for box in self.inboxes:
                box.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self.procs = []
        self.broken = True
        if self.store:
            Path(self.store).unlink(missing_ok=True)
