"""Integer program for the pipeline's structure: layers per virtual stage and recomputed layers per stage.

For a fixed (tp, pp, vpp, mbs, ...) the first virtual stage also holds the embedding and the last the LM head
and loss; ranks early in the pipeline keep more micro-batches in flight. The ILP chooses

    n_j  layers in virtual stage j (>= 1, sum = L)
    r_j  of them fully recomputed (0 <= r_j <= n_j; only with recompute=full)

to minimise the closed-form pipeline time (m*vpp - 1) * U + sum_j r_j * rc / vpp, where U bounds every stage's
per-micro-batch time n_j*u + r_j*rc + extra_j, subject to each rank's memory: model state of its layers plus,
per model chunk, (micro-batches in flight) x (activations of its stored and recomputed layers) <= capacity.
Solved with pulp (HiGHS when highspy is installed, else CBC); without recompute to choose, exactly by a search over
U instead (planner/split.py: the same optimum, no solver).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields

import pulp

from planner.split import solve_without_recompute
from planner.stage_problem import StageProblem, StageSolution

# A solve stops on work done, never on time, so the same problem gets the same split on any machine under any load
# (a time limit made `plan` return different plans on a busy machine). HiGHS's branch-and-bound is deterministic.
MIP_NODES = 300  # branch-and-bound nodes a solve may explore; the best split found by then is used
MIP_GAP = 1e-3  # ... or it stops within 0.1% of the proven bound (the cost model is nowhere near that sure)
SAFETY_S = 30.0  # a wall-clock cap only a machine far slower than expected reaches (then, and only then, load matters)


class _HiGHS(pulp.HiGHS):
    """pulp's HiGHS, knowing the status a work limit ends on (kSolutionLimit: absent from pulp's table)."""

    def findSolutionValues(self, lp: pulp.LpProblem) -> tuple[int, int]:  # noqa: N802 - pulp's name
        try:
            return super().findSolutionValues(lp)
        except KeyError:  # the node limit reached: the values are set; keep them if they are a solution
            import highspy

            found = lp.solverModel.getInfo().primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
            return ((pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible) if found
                    else (pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound))


def _solver(nodes: int) -> pulp.LpSolver:
    try:
        import highspy  # noqa: F401

        return _HiGHS(msg=False, timeLimit=SAFETY_S, gapRel=MIP_GAP, mip_max_nodes=nodes)
    except ImportError:  # fall back to the CBC binary bundled with pulp (deterministic, one thread)
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=SAFETY_S, gapRel=MIP_GAP, maxNodes=nodes)


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence the solver's own output, which (HiGHS's banner) goes to the process's stdout whatever ``msg``
    says and would corrupt ``--format json``."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _var_factory(prob: pulp.LpProblem):
    """Variables through PuLP >= 3.3's ``add_variable`` when present, else the classic constructor."""
    if hasattr(prob, "add_variable"):
        return lambda name, lo, hi, cat: prob.add_variable(name, lowBound=lo, upBound=hi, cat=cat)
    return lambda name, lo, hi, cat: pulp.LpVariable(name, lowBound=lo, upBound=hi, cat=cat)


_SOLVED: dict[tuple, StageSolution | None] = {}
_SOLVED_KEPT = 512


def solve_stages(p: StageProblem, nodes: int = MIP_NODES) -> StageSolution | None:
    """Optimal layer split and per-stage recompute (the best found in ``nodes`` branch-and-bound nodes), or None
    when no split fits in memory (or none was found). Remembered by the problem's numbers: a search meets the same
    problem in several of its passes (Llama 3 70B at batch 8 on A100 and L40S groups: 28 solves of 10 problems)."""
    key = (*(tuple(v) if isinstance(v, list) else v for v in (getattr(p, f.name) for f in fields(p))), nodes)
    if key not in _SOLVED:
        if len(_SOLVED) >= _SOLVED_KEPT:
            _SOLVED.clear()
        _SOLVED[key] = _solve(p, nodes)
    return _SOLVED[key]


def _solve(p: StageProblem, nodes: int) -> StageSolution | None:
    nv = p.pp * p.vpp
    if p.num_layers < nv:
        return None
    if not p.allow_recompute:  # no recompute to choose: an exact search over the bottleneck, no solver
        found = solve_without_recompute(p)
        return None if found is None else StageSolution(layers=found[0], recompute_layers=(0,) * nv,
                                                        objective=found[1])
    return solve_with_pulp(p, nodes)


def solve_with_pulp(p: StageProblem, nodes: int = MIP_NODES) -> StageSolution | None:
    """:func:`solve_stages` by the integer program (HiGHS or CBC through pulp), recompute or not."""
    nv = p.pp * p.vpp
    if p.num_layers < nv:
        return None
    prob = pulp.LpProblem("stages", pulp.LpMinimize)
    var = _var_factory(prob)
    lo = 0 if p.fixed_layers is not None and min(p.fixed_layers) == 0 else 1
    n = [var(f"n{j}", lo, p.num_layers, "Integer") for j in range(nv)]
    r = [var(f"r{j}", 0, p.num_layers if p.allow_recompute else 0, "Integer") for j in range(nv)]
    U = var("U", 0, None, "Continuous")
    slots = p.microbatches * p.vpp - 1
    prob += slots * U + pulp.lpSum(r) * (p.recompute_time / p.vpp)
    prob += pulp.lpSum(n) == p.num_layers
    if p.fixed_layers is not None:
        for j, count in enumerate(p.fixed_layers):
            n[j].lowBound = n[j].upBound = count
    for j in range(nv):
        prob += r[j] <= n[j]
        prob += n[j] * p.layer_time + r[j] * p.recompute_time + p.extra_time[j] <= U
    for rank in range(p.pp):
        stages = [c * p.pp + rank for c in range(p.vpp)]
        mem = pulp.lpSum(
            n[j] * p.state_per_layer + p.extra_state[j]
            + p.inflight[j] * ((n[j] - r[j]) * p.act_full + r[j] * p.act_ckpt + p.extra_act[j])
            for j in stages
        )
        prob += mem + p.fixed_bytes <= p.capacity
    with _quiet():
        prob.solve(_solver(nodes))
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    layers = tuple(int(round(x.value())) for x in n)
    rec = tuple(int(round(x.value())) for x in r)
    return StageSolution(layers=layers, recompute_layers=rec, objective=float(pulp.value(prob.objective)))
