"""Fits used by the profiler: alpha-beta lines through collective timings, and summaries of repeated timings.

Pure numpy (no torch), so the cost model's users and the tests can use it without a device.

The alpha-beta convention is the cost model's (nccl-tests bus bandwidth): a collective moving ``nbytes`` per
rank takes ``alpha + nbytes * factor / busbw`` seconds, with ``factor`` = 2(n-1)/n for all-reduce, (n-1)/n for
all-gather, reduce-scatter and all-to-all, and 1 for point-to-point (``specs.cluster.bus_factor``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AlphaBeta:
    """``time = alpha_s + per_rank_s x (n - 2) + x / bw`` for a group of n ranks, x = bytes x bus factor;
    ``r2`` and ``max_rel_err`` say how well it reproduces the measured times."""

    alpha_s: float
    bw_Bps: float
    r2: float
    max_rel_err: float
    per_rank_s: float = 0.0

    def predict(self, x: np.ndarray | float, n: np.ndarray | float = 2) -> np.ndarray:
        extra = np.maximum(np.asarray(n, dtype=float) - 2.0, 0.0)
        return self.alpha_s + self.per_rank_s * extra + np.asarray(x, dtype=float) / self.bw_Bps


def fit_alpha_beta(x: np.ndarray | list[float], t: np.ndarray | list[float],
                   n: np.ndarray | list[float] | None = None) -> AlphaBeta:
    """Least squares ``t = alpha + per_rank (n - 2) + beta x`` with every coefficient >= 0 and beta > 0,
    minimising relative residuals (timings span microseconds to seconds across message sizes, so each
    point is weighted by 1/t; an unweighted fit would let the largest message decide alpha).

    ``n`` (group sizes; default all 2) lets the latency grow with the group, as a ring's steps do; with one
    group size the per-rank term is zero. If beta would be zero (latency-only, noisy data) it is taken
    from the largest message alone.
    """
    x = np.asarray(x, dtype=float)
    t = np.asarray(t, dtype=float)
    n = np.full_like(x, 2.0) if n is None else np.asarray(n, dtype=float)
    if x.shape != t.shape or x.shape != n.shape or x.size < 2:
        raise ValueError("need at least two (size, time) points of the same shape")
    if np.any(t <= 0) or np.any(x < 0):
        raise ValueError("times must be positive and sizes non-negative")
    extra = np.maximum(n - 2.0, 0.0)
    cols = [np.ones_like(x), x] + ([extra] if np.ptp(extra) > 0 else [])
    coef = fit_nonneg(np.stack(cols, axis=1), t, 1.0 / t)
    alpha, beta = coef[0], coef[1]
    per_rank = coef[2] if len(coef) > 2 else 0.0
    if beta <= 0:
        big = int(np.argmax(x))
        beta = max(t[big] - alpha - per_rank * extra[big], 1e-3 * t[big]) / max(x[big], 1.0)
    pred = alpha + per_rank * extra + beta * x
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return AlphaBeta(alpha_s=float(alpha), bw_Bps=float(1.0 / beta), r2=r2,
                     max_rel_err=float(np.max(np.abs(pred - t) / t)), per_rank_s=float(per_rank))


def fit_nonneg(A: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
    """Weighted least squares ``A x ~ y`` with x >= 0 (active set over the few columns a profile fits)."""
    A, y = np.asarray(A, dtype=float), np.asarray(y, dtype=float)
    w = np.ones_like(y) if w is None else np.asarray(w, dtype=float)
    Aw, yw = A * w[:, None], y * w
    free = list(range(A.shape[1]))
    x = np.zeros(A.shape[1])
    while free:
        sol = np.linalg.lstsq(Aw[:, free], yw, rcond=None)[0]
        if np.all(sol >= 0):
            x[:] = 0.0
            x[free] = sol
            return x
        free.pop(int(np.argmin(sol)))
    return x


BUSY = 0.25  # a median spread of repeated timing windows above this: the machine was not idle while measured


def summarise(samples: list[float] | np.ndarray, how: str = "median") -> float:
    """One number from repeated timings (seconds).

    ``median`` (GPUs): robust to rare interference. ``mean`` (CPUs shared with other processes): a
    training step lasts far longer than a timing window, so it pays the average of the time a window
    loses to being descheduled; the median would hide that and predict an idle machine. The single
    slowest of five or more windows is left out (a one-off stall, not the machine's steady state).
    """
    s = np.sort(np.asarray(samples, dtype=float))
    if s.size == 0:
        raise ValueError("no timings")
    if how != "mean":
        return float(np.median(s))
    return float(np.mean(s[:-1] if s.size >= 5 else s))
