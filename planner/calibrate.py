"""The fit behind ``autopar calibrate`` (planner/commands/calibrate.py) and ``tune``: a profile's efficiency fitted
to measured runs.

Input: runs of plans, as planner/measured_runs.py reads them from metrics files (each run of a file that holds
several is fitted as a run of its own).

Model: five scales on the profile, each a factor on what it measures (:data:`PARAMS`): GEMM rate (the GEMM
table and ``efficiency.gemm``), attention rate (attention table, ``efficiency.attention_*``), memory-bound
bandwidth, the fixed cost per kernel, and communication speed (collective bandwidths up, latencies down).
Every run is re-estimated with the cost model on the scaled profile; the scales minimise the squared log
error between predicted and measured step times, and, where the metrics time every rank's phases, between the
estimate's compute and the run's (forward and backward of its critical stage: what tells a slow GEMM from a slow
collective) (Levenberg-Marquardt on log-scales, bounded to
[1/8, 8] and, on GPUs, to what the datasheet allows (:func:`ceilings`: no GEMM or attention rate above the peak,
no bandwidth above the memory's), with a weak pull towards 1 (:data:`PRIOR`) so that parameters the runs cannot
tell apart stay near the profile's values: one run yields about the smallest change that explains it). The
updated profile is written as a cluster YAML that ``plan / estimate / whatif --cluster`` accept. A fit with a
scale at its bound whose profile still misses the runs by more than 2x (:data:`MISFIT_LIMIT`) is refused: the
runs did not run on that hardware, and no profile is written.
Never imports torch.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from planner.measured_runs import COMPUTE_TERMS, Run
from planner.uncertainty import Z95
from specs.cluster import CALIBRATION_SCALES, Calibration, ClusterSpec
from specs.cluster_loading import list_gpus
from specs.files import utc_now
from specs.json_numbers import rounded

PARAMS = CALIBRATION_SCALES
BOUND = math.log(8.0)  # scales stay within [1/8, 8]
RUN_NOISE = 0.05  # typical log error of a run's median step time the fit allows
PRIOR_LOG_SD = math.log(2.5)  # how far a profile parameter plausibly is off before any run: a factor 2.5
# Pull of each log-scale towards 0, relative to one run's squared log error
PRIOR = (RUN_NOISE / PRIOR_LOG_SD) ** 2
LOOSE_SPREAD = 0.05  # a plan's calibration log sd worth a word in `plan`'s why (x/1.10 at 95%)
MISFIT_LIMIT = math.log(2.0)  # a fit at its limits that still misses the runs by this (mean |log error|) is refused
CALIBRATED_TIES = 8  # the fastest plans whose ties with the best a calibrated profile's spread can widen


# ---- the scaled profile ---------------------------------------------------------------------------
def scaled(cluster: ClusterSpec, s: dict[str, float]) -> ClusterSpec:
    """``cluster`` with its measured speeds multiplied by the scales ``s`` (missing scales: 1)."""
    g, c, a, m, o, n = (s.get(k, 1.0) for k in ("gemm", "gemm", "attention", "memory", "overhead", "comm"))
    gpu = cluster.gpu
    e = gpu.efficiency
    eff = e.model_copy(update={
        "gemm": min(1.0, e.gemm * g), "attention_fwd": min(1.0, e.attention_fwd * a),
        "attention_bwd": min(1.0, e.attention_bwd * a), "kernel_overhead_us": e.kernel_overhead_us * o})
    gpu = gpu.model_copy(update={
        "efficiency": eff,
        "measured_memory_bandwidth_GBps": gpu.mem_bw / 1e9 * m,
        "elementwise_bandwidth_GBps": gpu.elementwise_bandwidth_GBps and gpu.elementwise_bandwidth_GBps * m,
        "reduce_bandwidth_GBps": gpu.reduce_bandwidth_GBps and gpu.reduce_bandwidth_GBps * m,
        "optimizer_bandwidth_GBps": gpu.optimizer_bandwidth_GBps and gpu.optimizer_bandwidth_GBps * m,
        "gemm_table": [p.model_copy(update={"tflops": p.tflops * c}) for p in gpu.gemm_table],
        "attention_table": [p.model_copy(update={"fwd_tflops": p.fwd_tflops * a, "bwd_tflops": p.bwd_tflops * a})
                            for p in gpu.attention_table],
    })
    upd: dict[str, Any] = {"gpu": gpu}
    if n != 1.0:
        upd["intra_node"] = cluster.intra_node.model_copy(update={
            "bandwidth_GBps": cluster.intra_node.bandwidth_GBps * n, "latency_us": cluster.intra_node.latency_us / n})
        if cluster.inter_node is not None:
            i = cluster.inter_node
            upd["inter_node"] = i.model_copy(update={"nic_bandwidth_Gbps": i.nic_bandwidth_Gbps * n,
                                                     "latency_us": i.latency_us / n})
        upd["collectives"] = {
            name: {lv: f.model_copy(update={"alpha_us": f.alpha_us / n, "alpha_per_rank_us": f.alpha_per_rank_us / n,
                                            "busbw_GBps": f.busbw_GBps * n,
                                            "busbw_by_nodes": {k: v * n for k, v in f.busbw_by_nodes.items()}})
                   for lv, f in levels.items()}
            for name, levels in cluster.collectives.items()}
    return cluster.model_copy(update=upd)


def _estimates(runs: list[Run], base: ClusterSpec, s: dict[str, float]) -> list[Any]:
    """Each run's estimate on ``base`` (sized as the run's plan) with scales ``s``."""
    from cost_models.step import estimate

    out = []
    for r in runs:
        pc = r.plan.used_cluster  # the GPUs the run used (a plan may use part of its cluster)
        cl = scaled(base.model_copy(update={"gpus_per_node": pc.gpus_per_node, "num_nodes": pc.num_nodes,
                                            "precision": pc.precision}), s)
        out.append(estimate(r.plan.model, cl, r.plan.config, r.plan.global_batch, validate=False,
                            state=r.plan.state))
    return out


def predict(runs: list[Run], base: ClusterSpec, s: dict[str, float]) -> np.ndarray:
    """Each run's step time re-estimated on ``base`` (sized as the run's plan) with scales ``s``."""
    return np.array([e.step_time_s for e in _estimates(runs, base, s)])


def _log_errors(runs: list[Run], base: ClusterSpec, s: dict[str, float]) -> np.ndarray:
    """The fit's observations, log predicted / measured: each run's step, then the compute of its critical stage
    for each run whose metrics time every rank's phases (a step's time alone cannot tell slow GEMMs from a slow
    collective; its compute can)."""
    ests = _estimates(runs, base, s)
    steps = [math.log(e.step_time_s / r.measured_s) for e, r in zip(ests, runs)]
    priced = [sum(e.breakdown[k] for k in COMPUTE_TERMS) for e in ests]
    compute = [math.log(c / r.stage_compute_s[e.critical_rank])
               for e, r, c in zip(ests, runs, priced) if r.stage_compute_s and c > 0]
    return np.array(steps + compute)


# ---- the fit --------------------------------------------------------------------------------------
def ceilings(base: ClusterSpec) -> dict[str, float]:
    """The largest factor each scale may take before what it scales passes the GPU's datasheet: the GEMM and
    attention rates its peak at the cluster's precision (efficiency 1, and every rate of its tables at most the
    peak), the memory-bound bandwidths its memory bandwidth. None for CPU ranks (gloo), whose "peak" and "datasheet"
    are themselves measured, nor for a GPU autopar has no datasheet of (`autopar profile` on an unknown GPU derives
    its peak and bandwidth from what it measured), nor for the kernel overhead and communication (a link's limit is
    checked apart: ``ClusterSpec.link_problem``)."""
    if base.backend == "gloo" or base.gpu.name not in list_gpus():
        return {}
    gpu, e = base.gpu, base.gpu.efficiency
    peak = gpu.peak(base.precision) / 1e12
    attention = [r for p in gpu.attention_table for r in (p.fwd_tflops, p.bwd_tflops)]
    return {"gemm": min([1.0 / e.gemm, *(peak / p.tflops for p in gpu.gemm_table)]),
            "attention": min([1.0 / e.attention_fwd, 1.0 / e.attention_bwd, *(peak / r for r in attention)]),
            "memory": gpu.memory_bandwidth_GBps * 1e9 / gpu.mem_bw}


def _limits(base: ClusterSpec, params: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each log-scale's (lower, upper) limit on ``base``, and whether the datasheet (:func:`ceilings`) sets the upper
    one. The fit's bound, x1/8 .. x8, holds for a scale's total: on a profile calibrated before, what earlier fits
    applied counts (never a limit that forces a move from ``base`` itself)."""
    done, top = applied_scales(base), ceilings(base)
    lo, hi, by_ceiling = [], [], []
    for p in params:
        moved = math.log(done.get(p, 1.0))
        bound, ceiling = max(0.0, BOUND - moved), max(0.0, math.log(top[p])) if p in top else math.inf
        lo.append(min(0.0, -BOUND - moved))
        hi.append(min(bound, ceiling))
        by_ceiling.append(ceiling < bound)
    return np.array(lo), np.array(hi), np.array(by_ceiling)


def ceiling_warning(fit: Calibration, base: ClusterSpec) -> str | None:
    """A one-line caution when a fitted scale stopped at what the GPU's datasheet allows (:func:`ceilings`): the runs
    were faster than the profile can be made on that account, so the model overprices something else for them."""
    limit = {"gemm": f"its {base.precision} peak", "attention": f"its {base.precision} peak",
             "memory": f"its memory bandwidth, {base.gpu.memory_bandwidth_GBps:g} GB/s"}
    _, hi, by_ceiling = _limits(base, tuple(fit.scales))
    total = total_scales(base, fit)
    stuck = [f"{k} x{total[k]:.3g} ({limit[k]})" for j, (k, v) in enumerate(fit.scales.items())
             if by_ceiling[j] and math.log(v) >= hi[j] - 1e-6]
    if not stuck:
        return None
    return (f"warning: {', '.join(stuck)} stopped at what the {base.gpu.name}'s datasheet allows: the runs were faster "
            "than those rates can make them, so the model overprices something else for them (`autopar diagnose` "
            "on a run's metrics says where its steps went)")


def fit_scales(runs: list[Run], base: ClusterSpec, params: tuple[str, ...] = PARAMS, iters: int = 30
               ) -> Calibration:
    """Levenberg-Marquardt on log-scales: min sum (log pred - log measured)^2 + PRIOR |log s|^2 over the runs' steps
    and their compute (:func:`_log_errors`), bounded. The objective is a Gaussian posterior (log errors RUN_NOISE, a
    prior PRIOR_LOG_SD on each log-scale), so its curvature at the optimum gives the scales' log covariance: a scale
    the runs cannot see keeps the prior's spread, one they pin gets a narrow one."""
    x = np.zeros(len(params))
    lo, hi, _ = _limits(base, params)

    def resid(v: np.ndarray) -> np.ndarray:
        return np.concatenate([_log_errors(runs, base, dict(zip(params, np.exp(v)))), math.sqrt(PRIOR) * v])

    def jacobian(v: np.ndarray, r: np.ndarray, h: float = 1e-4) -> np.ndarray:
        return np.stack([(resid(v + h * np.eye(len(v))[j]) - r) / h for j in range(len(v))], axis=1)

    r = resid(x)
    observed = len(r) - len(params)  # the runs' steps and compute; the prior's rows follow
    lam = 1e-3
    for _ in range(iters):
        J = jacobian(x, r)
        g, H = J.T @ r, J.T @ J
        improved = False
        for _ in range(8):
            step = np.linalg.solve(H + lam * np.diag(np.diag(H) + 1e-12), -g)
            x_new = np.clip(x + step, lo, hi)
            r_new = resid(x_new)
            if r_new @ r_new < r @ r - 1e-15:
                x, r, lam, improved = x_new, r_new, max(lam / 3, 1e-9), True
                break
            lam *= 4
        if not improved or np.max(np.abs(step)) < 1e-6:
            break
    J = jacobian(x, r)
    # the runs' own misfit, where it exceeds the noise the fit allowed, widens everything (a model that cannot
    # follow the runs knows less than their count says)
    noise2 = max(RUN_NOISE ** 2, float(np.mean(r[:observed] ** 2)))
    cov = noise2 * np.linalg.inv(J.T @ J)  # the prior's rows keep J^T J invertible
    cov = (cov + cov.T) / 2
    # at a bound (the fit's, or the datasheet's) the optimum is not a minimum: keep the prior's spread
    for j in np.flatnonzero((x >= hi - 1e-9) | (x <= lo + 1e-9)):
        cov[j, :] = cov[:, j] = 0.0
        cov[j, j] = PRIOR_LOG_SD ** 2
    # however poorly the runs fit, a fit knows no less of a scale than the prior did: a spread wider than the prior's
    # is shrunk to it (D C D with D diagonal keeps the correlations, and C positive semi-definite)
    shrink = np.minimum(1.0, PRIOR_LOG_SD / np.sqrt(np.maximum(np.diag(cov), 1e-300)))
    cov = cov * np.outer(shrink, shrink)
    return Calibration(runs=len(runs), scales={p: float(np.exp(v)) for p, v in zip(params, x)},
                       log_covariance=tuple(tuple(float(c) for c in row) for row in cov),
                       fitted=tuple(dict.fromkeys(r.fingerprint for r in runs)))


def same_hardware(a: ClusterSpec, b: ClusterSpec) -> bool:
    """Whether two clusters are one profile at two sizes (``--gpus``/``--nodes``, which also share a CPU host's
    memory between its ranks): the same GPU, links, collectives and calibration."""
    def hardware(c: ClusterSpec) -> dict[str, Any]:
        d = c.model_dump(exclude={"name", "gpus_per_node", "num_nodes", "full_node_gpus", "tp_across_nodes"})
        d["gpu"].pop("memory_GiB")
        return d

    return hardware(a) == hardware(b)


def total_scales(base: ClusterSpec, fit: Calibration) -> dict[str, float]:
    """Each scale ``fit`` fitted on ``base`` as a factor on the profile before any calibration: a profile calibrated
    before carries what earlier fits applied (``base.calibration``)."""
    done = applied_scales(base)
    return {k: done.get(k, 1.0) * v for k, v in fit.scales.items()}


def applied_scales(base: ClusterSpec) -> dict[str, float]:
    """The scales earlier fits applied to ``base`` (none where no calibration wrote it)."""
    return dict(base.calibration.scales) if base.calibration else {}


def refitted_problem(base: ClusterSpec, runs: list[Run], ref: str | None) -> str | None:
    """Why calibrating ``base`` on ``runs`` would count some of them twice (fitted into it before, or given twice in
    ``runs``), or None: the scales they pin would not move, but their spread would narrow as if they were new
    evidence, and the scales they leave loose would drift towards whatever the model's misfit favours."""
    seen: dict[str, str] = {}
    for r in runs:
        if r.fingerprint in seen:
            return (f"{seen[r.fingerprint]} and {r.source} hold the same run (the same plan and step times: a copy?), "
                    "and fitting a run twice counts it twice; give each run once")
        seen[r.fingerprint] = r.source
    old = set(base.calibration.fitted) if base.calibration is not None else set()
    again = [r.source for r in runs if r.fingerprint in old]
    if not again:
        return None
    named = ", ".join(again[:3]) + (f" and {len(again) - 3} more" if len(again) > 3 else "")
    return (f"{named}: already fitted into {ref or base.name} (a calibrated profile), and fitting a run twice counts "
            "it twice; give only runs it has not seen, or calibrate the profile it was made from with all the runs")


def calibrated(base: ClusterSpec, fit: Calibration) -> ClusterSpec:
    """``base`` scaled by the fit, carrying it (plans' bands then widen by its uncertainty) with each scale's total
    (:func:`total_scales`). When ``base`` was calibrated before, the scales this fit left alone (``--fit`` a subset)
    keep their earlier factor and spread."""
    out = scaled(base, fit.scales)
    old = base.calibration
    seen = tuple(dict.fromkeys((*(old.fitted if old is not None else ()), *fit.fitted)))
    total = Calibration(runs=fit.runs, scales=total_scales(base, fit), log_covariance=fit.log_covariance, fitted=seen)
    kept = [k for k in old.scales if k not in fit.scales] if old is not None else []
    if old is not None and kept:
        prev, n = list(old.scales), len(fit.scales)
        cov = np.zeros((n + len(kept), n + len(kept)))
        cov[:n, :n] = np.array(fit.log_covariance)
        for i, k in enumerate(kept, n):
            cov[i, i] = old.log_covariance[prev.index(k)][prev.index(k)]
        total = Calibration(runs=fit.runs, scales={**total.scales, **{k: old.scales[k] for k in kept}},
                            log_covariance=tuple(tuple(float(c) for c in row) for row in cov), fitted=seen)
    return out.model_copy(update={"calibration": total})


def scale_sd(fit: Calibration) -> dict[str, float]:
    """Each fitted scale's log standard deviation."""
    return {p: math.sqrt(fit.log_covariance[i][i]) for i, p in enumerate(fit.scales)}


def fitted_text(fit: Calibration) -> str:
    """The fitted scales with their 95% spread, those the runs barely constrain marked."""
    parts = []
    for p, sd in scale_sd(fit).items():
        loose = ", not pinned by these runs" if sd > 0.7 * PRIOR_LOG_SD else ""
        parts.append(f"{p} x{fit.scales[p]:.3g} (x/{math.exp(Z95 * sd):.2f}{loose})")
    return ", ".join(parts)


def step_sensitivity(model: Any, cluster: ClusterSpec, config: Any, global_batch: int, state: Any = None,
                     h: float = 0.01) -> np.ndarray | None:
    """d log(step time) / d log(scale) of a plan for each scale ``cluster.calibration`` fitted (finite differences
    on the cost model, scaled down so no efficiency hits its cap); None for a profile no calibration wrote."""
    fit = cluster.calibration
    if fit is None:
        return None
    from cost_models.step import estimate

    def log_step(cl: ClusterSpec) -> float:
        return math.log(estimate(model, cl, config, global_batch, validate=False, state=state).step_time_s)

    t0 = log_step(cluster)
    return np.array([(log_step(scaled(cluster, {p: math.exp(-h)})) - t0) / -h for p in fit.scales])


def spread_of(g: np.ndarray, fit: Calibration) -> tuple[float, str]:
    """The log standard deviation sqrt(g^T C g) a fit's log covariance C leaves on a step time of sensitivity
    ``g`` (:func:`step_sensitivity`), and the scale contributing most."""
    parts = g * (np.array(fit.log_covariance) @ g)
    return math.sqrt(max(0.0, float(parts.sum()))), list(fit.scales)[int(np.argmax(parts))]


def calibration_spread(model: Any, cluster: ClusterSpec, config: Any, global_batch: int, state: Any = None
                       ) -> tuple[float, str | None]:
    """How uncertain a plan's predicted step time is from the profile's calibration (``cluster.calibration``):
    :func:`spread_of` its :func:`step_sensitivity`; (0, None) for a profile no calibration wrote."""
    g = step_sensitivity(model, cluster, config, global_batch, state)
    if g is None or cluster.calibration is None:
        return 0.0, None
    return spread_of(g, cluster.calibration)


def difference_spreads(sensitivities: list[np.ndarray], fit: Calibration) -> list[float]:
    """For each plan of ``sensitivities`` (:func:`step_sensitivity`, best plan first), the log standard deviation
    the fit leaves on the difference between its step time and the first's, sqrt(d^T C d) with d the difference of
    their sensitivities (what the fit's uncertainty can do to their order)."""
    cov = np.array(fit.log_covariance)
    return [math.sqrt(max(0.0, float((g - sensitivities[0]) @ cov @ (g - sensitivities[0]))))
            for g in sensitivities]


def at_bound(scales: dict[str, float]) -> list[str]:
    """The fitted scales at the fit's limit (x1/8 or x8), as ``name xvalue``."""
    return [f"{k} x{v:.3g}" for k, v in scales.items() if abs(math.log(v)) >= BOUND - 1e-6]


def bound_warning(scales: dict[str, float],
                  fix: str = "calibrate the profile of the machine they ran on (--cluster)",
                  runs: list[Run] | None = None, cores_here: int | None = None) -> str | None:
    """A one-line caution when a fitted scale sits at its limit (x1/8 or x8): the runs are far from the profile's
    hardware (timed on another machine, or on CPUs for a GPU profile), not a correction to trust; ``fix`` says
    what to do instead. Where the limit is communication's and ``runs`` put more CPU ranks on a node than it has
    cores (its profile's, or ``cores_here`` for runs made on this machine: `tune`), that is said instead: their
    collectives wait for peers the cores are not running, which no profile of the machine prices."""
    stuck = at_bound(scales)
    if not stuck:
        return None
    crowded = []  # (ranks on a node, its cores)
    for r in runs or []:
        c = r.plan.used_cluster
        cores = c.gpu.cores or (cores_here if c.backend == "gloo" else None)
        if cores and c.gpus_per_node > cores:
            crowded.append((c.gpus_per_node, cores))
    if crowded and abs(math.log(scales.get("comm", 1.0))) >= BOUND - 1e-6:
        ranks, cores = max(crowded, key=lambda rc: rc[0] / rc[1])
        return (f"warning: {', '.join(stuck)} at the fit's limit (x1/8 .. x8): runs put {ranks} ranks on {cores} "
                f"cores, where a collective waits for peers the cores are not running (the model prices the cores' "
                f"shared compute, not that wait); fit runs of at most {cores} ranks a node for a profile of the "
                "machine")
    return (f"warning: {', '.join(stuck)} at the fit's limit (x1/8 .. x8): these runs are far from what the profile "
            f"describes (run on another machine, or on CPUs under a GPU profile?); {fix}")


def worse_fit_warning(before: float, after: float) -> str | None:
    """A one-line caution when the fitted profile predicts the runs' steps worse than the profile did (mean absolute
    relative errors ``before`` and ``after``): the fit weighs each run's compute phases beside its step, and phases
    that disagree with the step (ranks sharing cores, a noisy machine) pull it away; None when it did better."""
    if after <= before:
        return None
    return (f"warning: the fit predicts these runs' steps worse than the profile did ({100 * before:.1f}% -> "
            f"{100 * after:.1f}% mean error): their compute phases disagree with their steps (ranks sharing cores, "
            "a busy machine?); keep the profile you had, or calibrate on longer or quieter runs")


def hardware_mismatch(scales: dict[str, float], runs: list[Run], fitted: np.ndarray, cluster_ref: str | None,
                      base: ClusterSpec) -> str | None:
    """Why a fit is not worth writing, or None: a scale at the fit's limit while the fitted profile still misses
    the runs by more than :data:`MISFIT_LIMIT` (mean absolute log error): the runs did not run on ``base``'s
    hardware, and no correction within the limits makes it so."""
    stuck = at_bound(scales)
    miss = float(np.mean(np.abs(np.log(fitted / np.array([r.measured_s for r in runs])))))
    if not stuck or miss <= MISFIT_LIMIT:
        return None
    off = (f"even with {', '.join(stuck)} (the fit's limits, x1/8 .. x8) it predicts them x{math.exp(miss):.3g} off "
           "on average")
    if cluster_ref:
        return (f"the runs do not look like they ran on --cluster {cluster_ref} ({base.gpu.name}): {off}; name the "
                "profile of the machine they ran on, or leave --cluster out to calibrate the one their plans carry")
    return (f"the runs do not look like they ran on the hardware their plans carry ({base.name}, {base.gpu.name}): "
            f"{off}; measure the machine they ran on (`autopar profile --out mine.yaml`) and pass --cluster mine.yaml")


def relative_errors(pred: np.ndarray, runs: list[Run]) -> np.ndarray:
    """Each run's predicted / measured - 1."""
    return pred / np.array([r.measured_s for r in runs]) - 1.0


def calibrated_profile_text(base: ClusterSpec, fit: Calibration, by: str, runs: str, more: list[str] | None = None
                            ) -> str:
    """The profile file ``by`` (a command) writes: ``base`` calibrated by ``fit``, headed by when and from what
    (``runs``: "5 run(s)") it was fitted, its scales, and ``more`` lines."""
    out = calibrated(base, fit)
    assert out.calibration is not None
    again = " (on a profile calibrated before: the factors are totals)" if base.calibration else ""
    header = f"{calibrated_by(by)} at {utc_now()} from {runs}: {fitted_text(out.calibration)}{again}."
    return profile_yaml(out, [header, *(more or [])])


def source_header(ref: str | None) -> list[str]:
    """The comment lines heading profile file ``ref`` (what measured it, where and when), kept under a calibrated
    copy's own header; none for a profile that is not a file of its own (a bundled name, the cluster a plan carries)."""
    path = Path(ref) if ref else None
    if path is None or not path.is_file():
        return []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    head = [line[1:].removeprefix(" ").rstrip() for line in itertools.takewhile(lambda x: x.startswith("#"), lines)]
    return [f"Calibrated from {ref}, whose header read:", *(f"  {h}" for h in head)] if head else []


def calibrated_by(by: str) -> str:
    """How the header of a profile that command ``by`` calibrated begins (after its "# ")."""
    return f"Calibrated by `{by}`"


def profile_yaml(cluster: ClusterSpec, header: list[str]) -> str:
    """A profile as YAML under ``header`` lines (comments), its numbers to 6 significant digits as every command
    writes them (a fit's 4307.999999999999 us is 4308)."""
    data = rounded(cluster.model_dump(mode="json"))
    return "\n".join(f"# {h}" for h in header) + "\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None,
                                                                        width=120)
