"""A failing worker's line: written whole, and read back as one message."""

from __future__ import annotations

from runtime.launch import _failure, _input_error, _root_exit
from runtime.worker_error import MAX_BYTES, report
from specs.errors import WORKER_BROKE_PREFIX, WORKER_ERROR_PREFIX, AutoparError, RunFailed


def test_a_worker_error_is_one_line_in_one_write(capfd, monkeypatch):
    """The whole line, its newline included, goes out in one os.write (two ranks failing at once cannot run their
    lines together), on one line whatever the message's own line breaks, and within a pipe's atomic size."""
    import runtime.worker_error as we

    writes = []
    real = we.os.write
    monkeypatch.setattr(we.os, "write", lambda fd, data: writes.append((fd, data)) or real(fd, data))
    report("checkpoint x is corrupt:\n  the file ends early;   use an earlier one")
    assert writes == [(2, f"{WORKER_ERROR_PREFIX} checkpoint x is corrupt: the file ends early; use an earlier one\n"
                          .encode())]
    assert capfd.readouterr().err.count("\n") == 1
    writes.clear()
    report("é" * 5000)  # cut to fit, on a character boundary
    assert len(writes[0][1]) <= MAX_BYTES + 1 and writes[0][1].decode().endswith("\n")
    writes.clear()
    report("cannot write checkpoint x (the disk holding it is full)", broke=True)  # a RunFailed: marked
    assert writes == [(2, f"{WORKER_BROKE_PREFIX} cannot write checkpoint x (the disk holding it is full)\n".encode())]


def test_a_doubled_line_is_read_as_one_message():
    """Two ranks' copies of the same error run into one line (as older workers could write them) read as one."""
    msg = "rank 1 stopped making progress at step 3; raise --collective-timeout"
    doubled = f"{WORKER_ERROR_PREFIX} {msg}{WORKER_ERROR_PREFIX} {msg}\n"
    assert _failure("", [doubled], 1) == msg
    assert _failure("", [f"{WORKER_ERROR_PREFIX} {msg}\n"], 1) == msg


def test_a_worker_that_aborts_after_its_error_is_reported_by_its_error():
    """A rank that printed autopar's error and then aborted on its way out (in a library's teardown) is reported by
    its error; a rank killed (SIGKILL), or aborted without one, by the signal, not by its peers' lost-peer
    exceptions or what they made of the loss."""
    log = "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -6 (pid: 7)\n"
    corrupt = f"{WORKER_ERROR_PREFIX} checkpoint ck/step_00000004 is corrupt (.metadata is missing)\n"
    peer = f"{WORKER_ERROR_PREFIX} rank 0: RuntimeError: Connection closed by peer\n"
    assert _failure(log, [peer, corrupt], 1) == "checkpoint ck/step_00000004 is corrupt (.metadata is missing)"
    assert _failure(log, [peer], 1) == "training failed: worker rank 1 was killed by signal 6"
    killed = log.replace("-6", "-9")  # killed (the OOM killer): the cause, whatever the others made of it
    assert _failure(killed, [peer, corrupt], 1) == "training failed: worker rank 1 was killed by signal 9"


def test_a_bad_input_exits_2_and_a_broken_run_1():
    """What the workers stopped with decides `autopar run`'s exit status: one of autopar's bad-input lines (a
    corrupt checkpoint; its worker exited 2) is the input's fault (2); a run that broke on its way (its worker
    exited 1: a full disk, an internal error) or the watchdog's hang verdict is the run's (1), as a killed worker
    is."""
    corrupt = "checkpoint ck/step_00000004 is corrupt (.metadata is missing)"
    full = "cannot write checkpoint ck/step_00000006: the disk holding it is full"
    internal, hang = "rank 0: RuntimeError: Connection closed by peer", "rank 1 stopped making progress at step 3"
    lines = [f"{WORKER_ERROR_PREFIX} {x}\n" for x in (corrupt, full, internal, hang)]
    assert _input_error(corrupt, lines, 2) and _input_error(corrupt, lines, None)
    assert not _input_error(full, lines, 1) and not _input_error(internal, lines, 1)
    assert not _input_error(internal, lines, None) and not _input_error(hang, lines, None)
    assert not _input_error("training failed: worker rank 1 was killed by SIGKILL", lines, -9)
    assert _root_exit("Root Cause (first observed failure):\n[0]:\n  rank : 1\n  exitcode  : 2 (pid: 7)\n") == 2
    # a worker's RunFailed is marked as such: exit 1 even where its end says nothing (it aborted on its way out, -6)
    # or where the line alone would read as a bad input's
    marked = [f"{WORKER_BROKE_PREFIX} {full}\n"]
    aborted = "Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : -6 (pid: 7)\n"
    assert _failure(aborted, marked, 1) == full
    assert not _input_error(full, marked, -6) and not _input_error(full, marked, None)
    assert _failure("", [f"{WORKER_BROKE_PREFIX} {full}{WORKER_ERROR_PREFIX} {full}\n"], 1) == full  # run together
    assert RunFailed("x").exit_code == 1 and AutoparError("x").exit_code == 2 and issubclass(RunFailed, AutoparError)


WATCHED = """
import time, types, torch.distributed as dist
from runtime.watchdog import Watchdog
main = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
store = dist.PrefixStore("autopar/attempt_0/watchdog", dist.TCPStore("localhost", main.port, is_master=False))
Watchdog(types.SimpleNamespace(rank=0, ranks=[0, 1]), store, timeout=2.0).start()
time.sleep(200)
"""


def test_a_rank_that_never_reported_is_named_within_the_timeout():
    """Rank 1 froze before its watchdog first published: rank 0's watchdog names it after the timeout (2 s here),
    not after the store's own wait for its record (300 s)."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    t = time.monotonic()
    done = subprocess.run([sys.executable, "-c", WATCHED], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 3, done.stderr
    assert time.monotonic() - t < 60
    assert done.stderr.strip().splitlines()[-1].endswith(
        "rank 1 stopped making progress before its first record (it never reported where it was: stopped starting "
        "up, or frozen); the others waited 2 s (none inside a call); look at that rank (py-spy dump) or raise "
        "--collective-timeout")
