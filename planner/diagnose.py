"""``autopar diagnose metrics.jsonl``: where a run's steps went, which ranks were slow, and the step without them.

Input: a metrics file of ``autopar run --metrics-out`` (each step line carries every rank's phase times,
runtime/phase_clock.py) and the plan it ran (the file's ``plan`` entry, or ``--plan``). Each rank's time in
each phase is its median over the steps after the warm-up. A file that a run and its resume under another plan
both appended to holds several runs (consecutive step lines under one ``plan`` entry, as ``autopar calibrate``
reads them): the last is diagnosed, with a note naming the others, unless ``--steps`` picks steps of another;
``--steps`` that span two runs is a one-line error.

1. **The gap per phase.** The measured phases of the ranks on the pipeline stage the cost model says finishes
   last (median over them) beside ``estimate``'s breakdown of the same plan: compute (forward, backward and
   recompute), tensor/context-parallel communication, the pipeline (p2p transfers and bubble), exposed
   data-parallel communication, the optimizer, and what the model does not price (data, other).
2. **Stragglers** (MegaScale's finding: compare each rank with its peers). A rank's compute (forward +
   backward) and its time per pipeline send are set against the median of its peers: the other ranks of its
   pipeline stage (the same work), or, for a rank alone on its stage, every other rank, each per unit of what
   its stage should take (the estimate's per-stage time). A rank is named when it is ``--threshold`` times
   (default 1.25) its peers in most steps (its fastest quarter of steps, so one hiccup is not a straggler) and
   loses more than 2% of the step that way.
3. **The step without them.** The plan's schedule table replayed (cost_models.pipeline) with each rank's
   measured times: per micro-batch forward and backward of every virtual stage (the slowest of the ranks
   that work in lockstep on it, tp x cp; their communication at the fastest's, whose time is transfer, not
   waiting), the sender's time per send, then data, exposed data-parallel communication (the stage's
   fastest rank: the one the others waited for waits least), optimizer and the rest. Replayed once as
   measured and once with each straggler at its peers' speed; the step without stragglers is the measured
   step less the difference of the two replays (so what the replay leaves out cancels).
Never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from rich.markup import escape
from rich.table import Table

from cost_models.pipeline import simulate_steps
from cost_models.step import Estimate, estimate
from planner.measured_runs import COMPUTE_TERMS, measured_median, stages
from planner.report import fmt_time
from specs.errors import AutoparError
from specs.json_numbers import rounded
from specs.phases import COMPUTE, LATER_PHASES, PHASES
from specs.planfile import PlanFile
from specs.schedules import build_schedule, virtual_stage

# the diagnosis's rows: (name, measured phases, estimate breakdown keys)
ROWS = (("compute", COMPUTE, COMPUTE_TERMS),
        ("tp/cp comm", ("tp_cp_comm",), ("tp_cp_comm",)),
        ("ep comm", ("ep_comm",), ("ep_comm",)),
        ("pipeline p2p + bubble", ("p2p_wait", "p2p_send"), ("pp_p2p", "pipeline_bubble")),
        ("exposed dp comm", ("dp_comm",), ("dp_comm_exposed",)),
        ("optimizer", ("optimizer",), ("optimizer",)),
        ("data", ("data",), ()),
        ("other", ("other",), ()))
MIN_LOSS = 0.02  # a straggler loses more than this share of the step


@dataclass
class Straggler:
    rank: int
    coords: dict[str, int]
    phase: str  # "compute" or "sends"
    ratio: float  # its time / the other ranks' median (per expected work)
    seconds: float  # its time in that phase per step
    peers_seconds: float  # what it would take at the others' median


@dataclass
class Diagnosis:
    plan: str
    steps: int
    measured_step_s: float
    predicted_step_s: float
    critical_stage: int
    phases: list[dict[str, Any]]  # {"phase", "measured_s", "predicted_s", "gap_s"}
    stragglers: list[Straggler]
    replay_s: float  # the replay with every rank as measured
    without_stragglers_s: float  # the measured step less what the replay says the stragglers cost
    ranks: list[dict[str, Any]]  # {"rank", "coords", <phase>: seconds}

    def to_json(self) -> dict[str, Any]:
        return rounded(asdict(self))


# ---- reading --------------------------------------------------------------------------------------
def rank_phases(rows: list[dict[str, Any]], world: int, source: str) -> dict[str, np.ndarray]:
    """Seconds per phase of each step and rank, ``[steps, ranks]``, of ``rows`` (steps carrying ``phases_s``)."""
    per: dict[str, list[list[float]]] = {p: [] for p in PHASES}
    for r in rows:
        ph = r.get("phases_s")
        sizes = {len(v) for v in ph.values() if isinstance(v, list)} if isinstance(ph, dict) else set()
        if isinstance(ph, dict) and len(sizes) == 1:  # a file from before a phase was added: none of its time
            ph = {**{p: [0.0] * next(iter(sizes)) for p in LATER_PHASES}, **ph}
        if len(sizes) == 1 and sizes != {world} and all(isinstance(ph.get(p), list) for p in PHASES):
            raise AutoparError(f"metrics file {source}: step {r['step']} has phase times for {sizes.pop()} ranks, but "
                               f"the plan runs {world}; pass the plan that run used (--plan), or pick its steps "
                               "(--steps)")
        if not isinstance(ph, dict) or any(len(ph.get(p, ())) != world for p in PHASES):
            raise AutoparError(f"metrics file {source}: step {r['step']} has no phase times for {world} ranks; "
                               "write it with this version's `autopar run --metrics-out`")
        for p in PHASES:
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < math.inf
                       for x in ph[p]):
                raise AutoparError(f"metrics file {source}: step {r['step']} has a {p} time that is not a "
                                   "non-negative number of seconds; the file was edited or damaged: write it again "
                                   "with `autopar run --metrics-out`")
            per[p].append(ph[p])
    return {p: np.array(v, dtype=float) for p, v in per.items()}


# ---- the analysis ---------------------------------------------------------------------------------
def sends_per_rank(plan: PlanFile) -> np.ndarray:
    """Pipeline sends per step of each pipeline rank (activations forward, gradients back)."""
    cfg = plan.config
    m, nv = cfg.microbatches(plan.global_batch), cfg.pp * cfg.vpp
    out = np.zeros(cfg.pp)
    for r, acts in enumerate(build_schedule(cfg.pp, cfg.vpp, m)):
        v = [virtual_stage(r, a.chunk, cfg.pp) for a in acts]
        out[r] = sum(1 for a, vv in zip(acts, v) if (a.kind == "F" and vv < nv - 1) or (a.kind == "B" and vv > 0))
    return out


def _measures(plan: PlanFile, ph: dict[str, np.ndarray], stage_work: np.ndarray
              ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """What stragglers are judged on: per phase, each rank's seconds and the work they are for."""
    stage = stages(plan)
    return {"compute": (sum(ph[p] for p in COMPUTE), stage_work[stage]),
            "sends": (ph["p2p_send"], sends_per_rank(plan)[stage])}


def peers_expect(stage: np.ndarray, seconds: np.ndarray, work: np.ndarray, r: int) -> float | None:
    """What rank ``r`` would take at its peers' median rate: the other ranks of its pipeline stage (the same
    work), or, alone on its stage, every other rank per unit of its stage's expected work. None: no peers."""
    rate = np.divide(seconds, work, out=np.zeros(len(stage)), where=work > 0)
    others = (work > 0) & (np.arange(len(stage)) != r)
    same = others & (stage == stage[r])
    peers = same if same.any() else others
    return float(np.median(rate[peers])) * float(work[r]) if peers.any() else None


def find_stragglers(plan: PlanFile, ph: dict[str, np.ndarray], stage_work: np.ndarray, step_s: float,
                    threshold: float) -> list[Straggler]:
    """Ranks whose compute or time per send is ``threshold`` times what their peers would take
    (:func:`peers_expect`) and costs more than :data:`MIN_LOSS` of the step."""
    found, stage = [], stages(plan)
    for phase, (seconds, work) in _measures(plan, ph, stage_work).items():
        for r in np.flatnonzero(work > 0):
            expected = peers_expect(stage, seconds, work, int(r))
            if expected and seconds[r] > threshold * expected and seconds[r] - expected > MIN_LOSS * step_s:
                found.append(Straggler(int(r), plan.config.rank_coords(int(r)), phase, float(seconds[r] / expected),
                                       float(seconds[r]), expected))
    return sorted(found, key=lambda s: -(s.seconds - s.peers_seconds))


def replay_step(plan: PlanFile, ph: dict[str, np.ndarray], chunk_share: np.ndarray) -> float:
    """The step the schedule table gives with these per-rank phase times (see the module docstring)."""
    cfg = plan.config
    pp, vpp, m = cfg.pp, cfg.vpp, cfg.microbatches(plan.global_batch)
    coords = [cfg.rank_coords(r) for r in range(cfg.world)]
    sends = sends_per_rank(plan)
    per_send = np.divide(ph["p2p_send"], sends[[c["pp"] for c in coords]],
                         out=np.zeros(cfg.world), where=sends[[c["pp"] for c in coords]] > 0)
    ends = []
    for dp in range(cfg.dp):
        f, b = np.zeros(pp * vpp), np.zeros(pp * vpp)
        for s in range(pp):
            lock = [r for r, c in enumerate(coords) if c["pp"] == s and c["dp"] == dp]  # tp x cp in lockstep
            fwd, bwd = ph["forward"][lock].max(), ph["backward"][lock].max()
            comm = ph["tp_cp_comm"][lock].min() + ph["ep_comm"][lock].min()
            cf = comm * fwd / (fwd + bwd) if fwd + bwd > 0 else 0.0
            send = per_send[lock].max()
            for c in range(vpp):
                v = virtual_stage(s, c, pp)
                f[v] = chunk_share[v] * (fwd + cf) / m + (send if v < pp * vpp - 1 else 0.0)
                b[v] = chunk_share[v] * (bwd + comm - cf) / m + (send if v > 0 else 0.0)
        sim = simulate_steps(pp, vpp, m, f.tolist(), b.tolist())
        for s in range(pp):
            ends.append((s, dp, sim.rank_end[s]))
    tail = []
    for s, dp, end in ends:
        at_stage = [r for r, c in enumerate(coords) if c["pp"] == s]
        mine = [r for r in at_stage if coords[r]["dp"] == dp]
        tail.append(float(np.median(ph["data"][mine])) + end + float(ph["dp_comm"][at_stage].min())
                    + float(np.median(ph["optimizer"][mine])))
    return max(tail) + float(ph["other"].min())


def _stage_work(est: Estimate, pp: int, vpp: int) -> tuple[np.ndarray, np.ndarray]:
    """Each pipeline rank's expected time per micro-batch, and each virtual stage's share of its rank's."""
    per_v = np.array(est.stage_time_s, dtype=float).reshape(vpp, pp)
    per_rank = per_v.sum(axis=0)
    return per_rank, (per_v / per_rank).reshape(-1)


def diagnose(plan: PlanFile, rows: list[dict[str, Any]], warmup: int | None, threshold: float, source: str,
             plan_name: str) -> Diagnosis:
    cfg = plan.config
    steps = rank_phases(sorted(rows, key=lambda r: r["step"]), cfg.world, source)
    step_s, n = measured_median(rows, warmup, source)
    steps = {p: v[len(rows) - n:] for p, v in steps.items()}  # after the warm-up
    ph = {p: np.median(v, axis=0) for p, v in steps.items()}
    # a straggler is slow in most steps, not in a few: its fastest quarter of steps is still slow
    usual = {p: np.quantile(v, 0.25, axis=0) for p, v in steps.items()}
    est = estimate(plan.model, plan.used_cluster, cfg, plan.global_batch, validate=False, state=plan.state)
    work, share = _stage_work(est, cfg.pp, cfg.vpp)
    slow = find_stragglers(plan, usual, work, step_s, threshold)
    coords = [cfg.rank_coords(r) for r in range(cfg.world)]
    crit = [r for r, c in enumerate(coords) if c["pp"] == est.critical_rank]
    phases = []
    for name, measured, predicted in ROWS:
        meas = float(np.median(sum(ph[p][crit] for p in measured)))
        pred = sum(est.breakdown[k] for k in predicted)
        phases.append({"phase": name, "measured_s": meas, "predicted_s": pred, "gap_s": meas - pred})
    as_measured = replay_step(plan, ph, share)
    fixed = {p: v.copy() for p, v in ph.items()}
    typical = _measures(plan, ph, work)  # medians, as the replay uses
    for s in slow:
        seconds, w = typical[s.phase]
        scale = (peers_expect(stages(plan), seconds, w, s.rank) or seconds[s.rank]) / seconds[s.rank]
        for k in COMPUTE if s.phase == "compute" else ("p2p_send",):
            fixed[k][s.rank] *= scale
    without = step_s - (as_measured - replay_step(plan, fixed, share)) if slow else step_s
    ranks = [{"rank": r, "coords": coords[r], **{p: float(ph[p][r]) for p in PHASES}} for r in range(cfg.world)]
    return Diagnosis(plan_name, n, step_s, est.step_time_s, est.critical_rank, phases, slow, as_measured,
                     without, ranks)


# ---- the table ------------------------------------------------------------------------------------
def _signed(seconds: float) -> str:
    return f"{'+' if seconds >= 0 else '-'}{fmt_time(abs(seconds))}"


def _where(coords: dict[str, int]) -> str:
    return " ".join(f"{k} {v}" for k, v in coords.items())


def diagnosis_tables(d: Diagnosis, plan_keys: str) -> list[Table | str]:
    """``autopar diagnose``'s output: the gap per phase, every rank's phases, the stragglers and the replay."""
    off = d.predicted_step_s / d.measured_step_s - 1  # as calibrate prints it: positive, predicted slower
    steps = f"{d.steps} step{'s' if d.steps != 1 else ''}"
    head = (f"{escape(plan_keys)}: measured {fmt_time(d.measured_step_s)} a step (median of {steps}), "
            f"predicted {fmt_time(d.predicted_step_s)} ({100 * off:+.0f}%)")
    phases = Table(title=f"where the step went (pipeline stage {d.critical_stage}, the one predicted to finish last)",
                   header_style="bold")
    for col in ("phase", "predicted", "measured", "gap", "share of the gap"):
        phases.add_column(col, justify="left" if col == "phase" else "right")
    # shares of the rows' own total gap, so they add up to 100% (each row is a median over the steps, and medians
    # do not add up to the step's median: the total row shows by how much)
    net = sum(p["gap_s"] for p in d.phases)
    moved = sum(abs(p["gap_s"]) for p in d.phases)
    for p in d.phases:
        # shares of a net gap that is small beside what moved (phases off both ways) would read -481% / +427%
        share = f"{round(100 * p['gap_s'] / net) + 0:.0f}%" if abs(net) > 0.25 * moved > 0 else "-"
        phases.add_row(p["phase"], fmt_time(p["predicted_s"]), fmt_time(p["measured_s"]), _signed(p["gap_s"]), share)
    total = {k: sum(p[k] for p in d.phases) for k in ("predicted_s", "measured_s")}
    phases.add_row("total", fmt_time(total["predicted_s"]), fmt_time(total["measured_s"]), _signed(net),
                   "100%" if abs(net) > 0.25 * moved > 0 else "-", style="bold")
    ranks = Table(title="each rank's step (median seconds)", header_style="bold")
    cols = PHASES
    for col in ("rank", "where", *cols):
        ranks.add_column(col, justify="right")
    slow = {s.rank for s in d.stragglers}
    for r in d.ranks[:64]:
        mark = "*" if r["rank"] in slow else ""
        ranks.add_row(f"{r['rank']}{mark}", _where(r["coords"]), *(fmt_time(r[c]) for c in cols))
    out: list[Table | str] = [head, phases]
    if abs(total["measured_s"] - d.measured_step_s) > 0.01 * d.measured_step_s:
        out.append(f"(each row is its phase's median over the steps, on the stage's ranks: the rows add up to "
                   f"{fmt_time(total['measured_s'])}, the step's own median is {fmt_time(d.measured_step_s)})")
    out.append(ranks)
    if len(d.ranks) > 64:
        out.append(f"({len(d.ranks) - 64} more ranks in --format json)")
    for s in d.stragglers:
        out.append(f"[bold]straggler:[/bold] rank {s.rank} ({_where(s.coords)}): {s.phase} {s.ratio:.2f}x its peers "
                   f"({fmt_time(s.seconds)} a step where they would take {fmt_time(s.peers_seconds)}, in its fastest "
                   "quarter of steps: slow in most steps, not in a few)")
    if not d.stragglers:
        out.append("no stragglers: every rank's compute and sends are within the threshold of its peers'")
    out.append(f"the schedule replayed with the measured times: {fmt_time(d.replay_s)} a step (measured "
               f"{fmt_time(d.measured_step_s)})")
    if d.stragglers:
        saved = d.measured_step_s - d.without_stragglers_s
        out.append(f"without the stragglers: {fmt_time(d.without_stragglers_s)} a step ({fmt_time(saved)}, "
                   f"{100 * saved / d.measured_step_s:.0f}% of it, lost to them)")
    return out
