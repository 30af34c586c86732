"""What this machine gives the process asking: the cores it may run on (its affinity, not the machine's count)."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The CPU cores this process may use (a container's or taskset's share; the machine's count where the system
    cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
