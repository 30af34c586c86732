"""Shared fixtures and the machine lock of parallel runs. Planner and cost-model tests never import torch.

The suite runs on two pytest-xdist workers (``-n 2``; the README's test command). A test marked ``alone`` (its
assertions are about measured time: a trial's time limit, a straggler's ratio) has the machine to itself: the
workers share a readers-writer lock of two files (:class:`MachineLock`), every other test holding it shared.

What the code under test leaves in the temporary folder on purpose (a failed run's workers' log, a dry run's plan) or
cannot remove (torchrun's folders under a test that kills it) goes to one folder of the run's own (``TMPDIR``),
removed at its end; pytest's own ``tmp_path`` folders stay where pytest keeps them."""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the longest modules (benchmarks/RESULTS.md, "The test suite's time"), started first: a worker handed one of them
# last would run it alone at the end
LONGEST_FIRST = ("planner/test_node_groups.py", "runtime/test_launch.py", "runtime/test_equivalence.py",
                 "runtime/test_priced_equals_executed.py", "runtime/test_dp_checkpoint.py", "planner/test_whatif_plot.py")
RUN_TMP_ENV = "AUTOPAR_TEST_TMP"  # the run's temporary folder (its workers inherit it and the lock files in it)


class MachineLock:
    """A readers-writer lock over processes (``flock`` on two files in ``folder``): every test passes a turnstile
    first, which a test that wants the machine alone holds while it waits for the tests running to end, so that the
    other worker cannot keep starting new ones."""

    def __init__(self, folder: Path) -> None:
        self.turn = open(folder / "turn", "a+")  # noqa: SIM115 - held for the worker's life
        self.use = open(folder / "use", "a+")  # noqa: SIM115

    @contextlib.contextmanager
    def held(self, alone: bool) -> Iterator[None]:
        fcntl.flock(self.turn, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.use, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(self.turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.use, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(self.turn, fcntl.LOCK_UN)


_LOCK = pytest.StashKey[MachineLock]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: a test timing what it runs; it has the machine to itself")
    if hasattr(config, "workerinput"):
        if os.environ.get(RUN_TMP_ENV):
            config.stash[_LOCK] = MachineLock(Path(os.environ[RUN_TMP_ENV]))
        return
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())  # (pytest's folders: where they were)
    multiprocessing.util.get_temp_dir()  # (and multiprocessing's, which it removes itself after the folder is gone)
    folder = tempfile.mkdtemp(prefix="autopar-tests-")
    os.environ[RUN_TMP_ENV] = os.environ["TMPDIR"] = tempfile.tempdir = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        folder = os.environ.pop(RUN_TMP_ENV, None)
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # (each worker collects alike: the same order on both)
        def rank(item: pytest.Item) -> int:
            where = item.path.relative_to(ROOT / "tests").as_posix() if item.path.is_relative_to(ROOT) else ""
            return LONGEST_FIRST.index(where) if where in LONGEST_FIRST else len(LONGEST_FIRST)

        items.sort(key=rank)  # (stable: each module's tests keep their order)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    lock = item.config.stash.get(_LOCK, None)
    if lock is None:
        yield
        return
    with lock.held(item.get_closest_marker("alone") is not None):
        yield
