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


def end_with_parent() -> None:
    """This process gets a SIGTERM when its parent ends (a worker, its torchrun agent: Linux only). The agent starts
    its workers from its main thread, which lasts as long as the agent (the signal follows the thread that forked)."""
    arm = ends_with(os.getppid())
    if arm is not None and os.getppid() != 1:
        arm()
