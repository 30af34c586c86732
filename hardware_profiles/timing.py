"""Timing on CPU (wall clock) and CUDA (events): warm up, size the timing window, summarise the repeats
(median on GPUs, mean on CPUs: see :func:`hardware_profiles.fit.summarise`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import torch

from hardware_profiles.fit import summarise


class Timer:
    """Seconds per call of a function on one device (a CUDA device is synchronised around each window)."""

    def __init__(self, device: torch.device, min_window_s: float = 0.002, repeats: int = 5, warmup: int = 2,
                 sync: Callable[[], object] = lambda: None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stat = "median" if self.cuda else "mean"
        self.min_window_s = min_window_s
        self.repeats = repeats
        self.warmup = warmup
        self.sync_ranks = sync  # a barrier: every rank starts each round together (a CPU shared by ranks)
        self.spreads: list[float] = []  # each measurement's (slowest - fastest) / median window: how busy it was

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def window(self, fn: Callable[[], object], iters: int) -> float:
        """Seconds per call over ``iters`` back-to-back calls."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.sync()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters

    def iterations(self, fn: Callable[[], object]) -> int:
        """Calls per window so a window lasts at least ``min_window_s`` (after warm-up)."""
        for _ in range(self.warmup):
            fn()
        one = self.window(fn, 1)
        return max(1, min(10_000, math.ceil(self.min_window_s / max(one, 1e-7))))

    def __call__(self, fn: Callable[[], object]) -> float:
        """Seconds per call of ``fn`` over ``repeats`` windows."""
        self.sync_ranks()
        iters = self.iterations(fn)
        return self._summary([self.window(fn, iters) for _ in range(self.repeats)])

    def _summary(self, samples: list[float]) -> float:
        """The windows' summary (:func:`summarise`), their spread noted in :attr:`spreads`."""
        mid = float(np.median(samples))
        if mid > 0:
            self.spreads.append((max(samples) - min(samples)) / mid)
        return summarise(samples, self.stat)

    def spread(self) -> float:
        """The median spread of the measurements so far (0 when none): above ``hardware_profiles.fit.BUSY`` the
        machine was busy."""
        return float(np.median(self.spreads)) if self.spreads else 0.0

    def many(self, fns: list[Callable[[], object]], tick: Callable[[float], None] = lambda _: None) -> list[float]:
        """Seconds per call of each function, the repeats taken in rounds over all of them.

        Interleaving spreads a busy spell of a shared machine over every measurement instead of
        spoiling the few that happened to run during it. ``tick(fraction)`` after every window (the
        fractions of one function add up to 1).
        """
        self.sync_ranks()
        iters = [self.iterations(fn) for fn in fns]
        samples: list[list[float]] = [[] for _ in fns]
        for _ in range(self.repeats):
            self.sync_ranks()
            for i, fn in enumerate(fns):
                samples[i].append(self.window(fn, iters[i]))
                tick(1.0 / self.repeats)
        return [self._summary(s) for s in samples]
