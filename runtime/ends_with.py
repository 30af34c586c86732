"""A process that ends when the one that started it ends, however that ends (a SIGKILL from a scheduler or the OOM
killer included): torchrun with `autopar run`, and each training worker with its torchrun agent. Else they trained
on, orphaned, into a checkpoint folder whose lock had gone with their parent."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable


def ends_with(parent: int) -> Callable[[], None] | None:
    """What makes a process get a SIGTERM when process ``parent`` ends however it ends: a child's ``preexec_fn``
    (torchrun under `autopar run`, which passes the signal on to its workers) or called in the process itself. It
    exits at once where the parent has ended already. Linux only (prctl's PR_SET_PDEATHSIG); elsewhere None. prctl
    is looked up here, so that a forked child only calls it (no loading or allocating between fork and exec)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # ended already, before the line above
            os._exit(1)

    return arm


LAUNCHER_ENV = "AUTOPAR_LAUNCHER_PID"  # set by `autopar run` for its workers: its own pid, their agent's parent


def end_with_parent() -> None:
    """This process gets a SIGTERM when its parent ends (a worker, its torchrun agent: Linux only). The agent starts
    its workers from its main thread, which lasts as long as the agent (the signal follows the thread that forked).
    A worker of `autopar run` whose agent ended before this call (while it imported torch: a trial stopped at its
    time limit) exits at once: its parent is then not the agent `autopar run` started (it was taken in by init or
    a subreaper), which a worker started by hand under torchrun cannot tell (its agent may be a container's init)."""
    parent = os.getppid()
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher and _parent_of(parent) not in (None, launcher):
        os._exit(1)
    arm = ends_with(parent)
    if arm is not None and parent != 1:
        arm()


def _parent_of(pid: int) -> str | None:
    """Process ``pid``'s parent's pid (Linux's /proc), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[1]  # (the name, in parentheses, may hold spaces)
    except (OSError, IndexError):
        return None
