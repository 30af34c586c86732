"""The stage ILP without recompute, solved exactly by a search over its bottleneck (no solver).

With no layer recomputed (planner/ilp.py's r_j = 0) the ILP's objective is (m*vpp - 1) * U, so its optimum is
the smallest U for which some split fits: n_j layers on virtual stage j with n_j * u + extra_j <= U, sum n_j = L,
and each rank's memory sum_j n_j * a_j <= M_r (a_j: a layer's state plus its activations times the stage's
micro-batches in flight; M_r: the capacity left after the rank's fixed bytes). For a given U:

- each stage may hold at most cap_j = floor((U - extra_j) / u) layers and at least one;
- the most layers a rank can hold in memory is found greedily, filling its cheapest stages first (every layer
  of stage j costs a_j, so no other choice holds more);
- U is feasible when every rank fits its minimum and the ranks together can hold L layers; removing layers
  keeps a split feasible, so then one with exactly L exists.

Feasibility grows with U, and the optimal U is one of the values extra_j + k * u: a binary search over them
finds it. The split returned takes layers off the slowest stages first.
"""

from __future__ import annotations

import math

import numpy as np

from planner.stage_problem import StageProblem

Split = tuple[tuple[int, ...], float]  # layers per virtual stage, the ILP's objective


def _layout(p: StageProblem) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Per virtual stage: extra time, memory per layer; and each rank's stages."""
    nv = p.pp * p.vpp
    extra = np.asarray(p.extra_time, dtype=float)
    a = p.state_per_layer + np.asarray(p.inflight, dtype=float) * p.act_full
    ranks = [np.arange(r, nv, p.pp) for r in range(p.pp)]
    return extra, a, ranks


def _budget(p: StageProblem, ranks: list[np.ndarray]) -> np.ndarray:
    """Bytes each rank has left for its layers after its fixed state, activations and allowances."""
    fixed = np.asarray(p.extra_state, dtype=float) + np.asarray(p.inflight, dtype=float) * np.asarray(p.extra_act)
    return np.array([p.capacity - p.fixed_bytes - fixed[js].sum() for js in ranks])


def _caps(u: float, extra: np.ndarray, bound: float, num_layers: int) -> np.ndarray:
    """The most layers each stage may hold for its time to stay within ``bound`` (-1: not even none)."""
    slack = bound - extra + 1e-12 * max(1.0, abs(bound))
    if u <= 0:
        return np.where(slack >= 0, num_layers, -1)
    return np.clip(np.floor(slack / u), -1, num_layers).astype(int)


def _most(caps: np.ndarray, a: np.ndarray, budget: np.ndarray, ranks: list[np.ndarray]) -> np.ndarray | None:
    """The most layers each stage can take under ``caps`` and each rank's memory (cheapest stages first), or None
    when some rank cannot fit one layer per stage."""
    n = np.ones(len(caps), dtype=int)
    for js, left in zip(ranks, budget):
        left -= a[js].sum()
        if left < -1e-6 * max(1.0, abs(left)) or (caps[js] < 1).any():
            return None
        for j in js[np.argsort(a[js], kind="stable")]:
            take = int(caps[j] - 1) if a[j] <= 0 else min(int(caps[j] - 1), int(math.floor(left / a[j] + 1e-9)))
            take = max(take, 0)
            n[j] += take
            left -= take * a[j]
    return n


def solve_without_recompute(p: StageProblem) -> Split | None:
    """The optimal split of ``p`` (which recomputes nothing), or None when none fits."""
    nv, L = p.pp * p.vpp, p.num_layers
    extra, a, ranks = _layout(p)
    budget = _budget(p, ranks)
    slots = p.microbatches * p.vpp - 1
    if p.fixed_layers is not None:
        n = np.array(p.fixed_layers, dtype=int)
        if len(n) != nv:
            return None
        used = np.array([(n[js] * a[js]).sum() for js in ranks])
        if n.sum() != L or (used > budget + 1e-6 * np.maximum(1.0, np.abs(budget))).any():
            return None
        return tuple(int(x) for x in n), slots * float((n * p.layer_time + extra).max())
    if nv > L:
        return None
    u = p.layer_time
    values = np.unique((extra[:, None] + np.arange(1, L + 1)[None, :] * u).ravel())

    def fits(bound: float) -> np.ndarray | None:
        n = _most(_caps(u, extra, bound, L), a, budget, ranks)
        return n if n is not None and n.sum() >= L else None

    lo, hi = 0, len(values) - 1
    if fits(values[hi]) is None:
        return None
    while lo < hi:  # the smallest feasible bound
        mid = (lo + hi) // 2
        if fits(values[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    n = fits(values[lo])
    assert n is not None
    time = n * u + extra
    for _ in range(int(n.sum()) - L):  # take layers off the slowest stages that can spare one
        spare = np.nonzero(n > 1)[0]
        j = spare[np.argmax(time[spare])]
        n[j] -= 1
        time[j] -= u
    return tuple(int(x) for x in n), slots * float(time.max())
