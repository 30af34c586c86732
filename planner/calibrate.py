"""``autopar calibrate m1.jsonl [m2.jsonl ...] --out updated.yaml``: fit a profile's efficiency to measured runs.

Input: metrics files written by ``autopar run PLAN --metrics-out m.jsonl`` (one JSON object per step with
``step`` and ``step_time_s``), each paired with the plan it ran: from ``--plan`` (one per metrics file, or
one for all), else from a ``plan`` key in the metrics file (a path, or the embedded plan object). A file that a
run and its resume under another plan both appended to holds several runs: consecutive step lines under one
``plan`` entry are one run (a line without the key continues the run before it), each fitted as a run of its
own (``--plan`` is refused for such a file: its lines name their plans). A run's measured step time is the
median over its steps after the warm-up (``--warmup``, default the first 10% and at least one step: a run of one
step is refused unless ``--warmup 0``), taken in each run.

Model: five scales on the profile, each a factor on what it measures (:data:`PARAMS`): GEMM rate (the GEMM
table and ``efficiency.gemm``), attention rate (attention table, ``efficiency.attention_*``), memory-bound
bandwidth, the fixed cost per kernel, and communication speed (collective bandwidths up, latencies down).
Every run is re-estimated with the cost model on the scaled profile; the scales minimise the squared log
error between predicted and measured step times (Levenberg-Marquardt on log-scales, bounded to
[1/8, 8], with a weak pull towards 1 (:data:`PRIOR`) so that parameters the runs cannot tell apart
stay near the profile's values: one run yields about the smallest change that explains it). The
updated profile is written as a cluster YAML that ``plan / estimate / whatif --cluster`` accept. A fit with a
scale at its bound whose profile still misses the runs by more than 2x (:data:`MISFIT_LIMIT`) is refused: the
runs did not run on that hardware, and no profile is written.
Never imports torch.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from planner.uncertainty import Z95
from specs.cluster import CALIBRATION_SCALES, Calibration, ClusterSpec, load_cluster
from specs.errors import AutoparError
from specs.files import check_output_file, write_text_atomic
from specs.planfile import PlanFile, load_plan, plan_from_data

PARAMS = CALIBRATION_SCALES
BOUND = math.log(8.0)  # scales stay within [1/8, 8]
RUN_NOISE = 0.05  # typical log error of a run's median step time the fit allows
PRIOR_LOG_SD = math.log(2.5)  # how far a profile parameter plausibly is off before any run: a factor 2.5
# Pull of each log-scale towards 0, relative to one run's squared log error
PRIOR = (RUN_NOISE / PRIOR_LOG_SD) ** 2
LOOSE_SPREAD = 0.05  # a plan's calibration log sd worth a word in `plan`'s why (x/1.10 at 95%)
MISFIT_LIMIT = math.log(2.0)  # a fit at its limits that still misses the runs by this (mean |log error|) is refused
CALIBRATED_TIES = 8  # the fastest plans whose ties with the best a calibrated profile's spread can widen


@dataclass
class Run:
    """One measured run: where it came from, its plan, and its median step time after warm-up."""

    source: str
    plan: PlanFile
    measured_s: float
    steps: int
    logged_prediction_s: float | None


@dataclass
class Segment:
    """The step lines of a metrics file written under one plan: one run (a resume under the same plan continues
    it; one under another plan starts the next segment)."""

    plan: Any  # the ``plan`` entry its lines carry (a path or an embedded plan); None when no line has one
    rows: list[dict[str, Any]]

    @property
    def span(self) -> str:
        """Its steps, as ``steps A-B``."""
        steps = [r["step"] for r in self.rows]
        return f"steps {min(steps)}-{max(steps)}"

    def describe(self) -> str:
        """Its steps and the plan it names, for messages."""
        name = "an embedded plan" if isinstance(self.plan, dict) else str(self.plan)
        return f"{self.span}: {name}"


def runs_text(segments: list[Segment], most: int = 3) -> str:
    """The runs of a metrics file in a few words (the first ``most``, then how many more)."""
    shown = "; ".join(s.describe() for s in segments[:most])
    return shown + (f"; {len(segments) - most} more" if len(segments) > most else "")


# ---- reading runs ---------------------------------------------------------------------------------
def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], Any]:
    """The step rows of a metrics file and its (last) ``plan`` entry (a path or an embedded plan), if any."""
    segments = read_segments(path)
    return [r for s in segments for r in s.rows], segments[-1].plan


def read_segments(path: str | Path) -> list[Segment]:
    """The runs of a metrics file in file order (:class:`Segment`): consecutive step lines under one ``plan``
    entry. A line without the key continues the run before it; step lines before the first ``plan`` entry belong
    to the run it names. Steps redone after a restart (or a resume from an earlier checkpoint) replace the lines
    first written for them, so each step counts once."""
    segments: list[Segment] = []
    plan: Any = None
    for obj in _metrics_lines(path):
        if "plan" in obj:
            plan = obj["plan"]
        if "step" not in obj or "step_time_s" not in obj:
            continue
        if segments and segments[-1].plan is None:
            segments[-1].plan = plan  # the lines before any plan entry are the first plan's
        if not segments or (plan is not None and plan != segments[-1].plan):
            segments.append(Segment(plan, []))
        rows = segments[-1].rows
        if rows and obj["step"] <= rows[-1]["step"]:  # a restart or resume redoing steps: the redone lines are
            rows[:] = [r for r in rows if r["step"] < obj["step"]]  # the run's history, the first ones lost
        rows.append(obj)
    if segments[-1].plan is None:
        segments[-1].plan = plan  # named only after the step lines
    return segments


def _metrics_lines(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a metrics file, its step lines checked (one-line errors for a bad file)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise AutoparError(f"metrics file {p} does not exist; write one with `autopar run PLAN --metrics-out {p}`"
                           ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise AutoparError(f"cannot read metrics file {p}: {getattr(err, 'strerror', None) or err}") from None
    objs: list[dict[str, Any]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) and not text.endswith("\n"):  # a write cut off by a crash: the steps before count
                print(f"note: metrics file {p}: skipped its last line {i}, cut off mid-write", file=sys.stderr)
                continue
            raise AutoparError(f"metrics file {p} line {i} is not valid JSON (truncated or corrupt?)") from None
        if not isinstance(obj, dict):
            raise AutoparError(f"metrics file {p} line {i} is not a JSON object")
        if "step" in obj and "step_time_s" in obj:
            t, step = obj["step_time_s"], obj["step"]
            if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
                raise AutoparError(f"metrics file {p} line {i}: step_time_s must be a positive number, got {t!r}")
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise AutoparError(f"metrics file {p} line {i}: step must be a non-negative integer, got {step!r}")
        objs.append(obj)
    if not text.strip():
        raise AutoparError(f"metrics file {p} is empty")
    if not any("step" in o and "step_time_s" in o for o in objs):
        raise AutoparError(f"metrics file {p} has no step lines (objects with 'step' and 'step_time_s')")
    return objs


def check_warmup(warmup: int | None) -> None:
    """A one-line error for a negative ``--warmup`` (None: the default)."""
    if warmup is not None and warmup < 0:
        raise AutoparError(f"--warmup must be 0 or more, got {warmup}")


MIN_STEPS = 5  # measured steps after warm-up below which a run's median says little (a warning)


def only_warm_up(rows: list[dict[str, Any]], warmup: int | None) -> bool:
    """Whether a run is nothing but its warm-up under the default ``--warmup`` (one step, which allocates and
    compiles)."""
    return warmup is None and len(rows) == 1


def warm_up_only(source: str) -> AutoparError:
    """The error for a run that is only its warm-up (:func:`only_warm_up`)."""
    return AutoparError(f"metrics file {source}: its one step is the warm-up (the first step of a run allocates and "
                        "compiles: not a measurement); run more steps, or give --warmup 0 to fit it anyway")


def measured_median(rows: list[dict[str, Any]], warmup: int | None, source: str) -> tuple[float, int]:
    """Median step time after the warm-up steps, and how many steps it is over (a note below MIN_STEPS)."""
    if only_warm_up(rows, warmup):
        raise warm_up_only(source)
    rows = sorted(rows, key=lambda r: r["step"])
    skip = warmup if warmup is not None else max(1, len(rows) // 10)
    kept = [r["step_time_s"] for r in rows[skip:]]
    if not kept:
        raise AutoparError(f"metrics file {source}: all {len(rows)} step(s) are warm-up (--warmup {skip}); "
                           "run more steps or lower --warmup")
    if len(kept) < MIN_STEPS:
        print(f"warning: metrics file {source}: only {len(kept)} step(s) after the warm-up; a median of fewer than "
              f"{MIN_STEPS} says little; measure longer runs (autopar run --steps)", file=sys.stderr)
    return float(np.median(kept)), len(kept)


def resolve_plan(ref: Any, metrics: Path) -> PlanFile:
    """The plan a metrics file names: an embedded plan object, or a path (:func:`plan_ref_path`)."""
    if isinstance(ref, dict):
        return plan_from_data(ref, f"metrics file {metrics}: embedded plan")
    return load_plan(plan_ref_path(str(ref), metrics))


def plan_ref_path(ref: str, metrics: Path) -> Path:
    """The path a metrics file's ``plan`` entry names: as written, or relative to the metrics file when it is a
    relative path not found from here."""
    path = Path(ref)
    return path if path.is_absolute() or path.exists() else metrics.parent / path


def load_runs(metrics: list[str], plans: list[str] | None, warmup: int | None) -> list[Run]:
    """Every metrics file with its plan (see the module docstring for how they are paired)."""
    plans = plans or []
    if plans and len(plans) not in (1, len(metrics)):
        raise AutoparError(f"give one --plan for all metrics files or one per file ({len(metrics)}), "
                           f"not {len(plans)}")
    runs, warm_only = [], []
    for i, m in enumerate(metrics):
        segments = read_segments(m)
        if plans and len(segments) > 1:
            raise AutoparError(f"metrics file {m} holds {len(segments)} runs of different plans "
                               f"({runs_text(segments)}); leave --plan out: each run's lines name its plan")
        for seg in segments:
            source = m if len(segments) == 1 else f"{m} ({seg.span})"
            if plans:
                path = plans[i if len(plans) > 1 else 0]
                plan = load_plan(path)
                check_same_run(m, seg.rows, seg.plan, plan, path)
            elif seg.plan is not None:
                plan = resolve_plan(seg.plan, Path(m))
            else:
                raise AutoparError(f"metrics file {m} does not say which plan it ran; pass --plan PLAN.json "
                                   "(one per metrics file, in the same order)")
            if only_warm_up(seg.rows, warmup):  # not a measurement: left out, with a note below
                warm_only.append(source)
                continue
            med, n = measured_median(seg.rows, warmup, source)
            logged = next((r.get("predicted_step_time_s") for r in seg.rows if r.get("predicted_step_time_s")), None)
            runs.append(Run(source, plan, med, n, logged))
    if warm_only and not runs:
        raise warm_up_only(warm_only[0])
    if warm_only:
        print(f"note: left out {len(warm_only)} run(s) of one step, which is warm-up ({', '.join(warm_only)}); "
              "--warmup 0 fits them too", file=sys.stderr)
    return runs


def check_same_run(metrics: str, rows: list[dict[str, Any]], embedded: Any, plan: PlanFile, plan_path: str
                   ) -> None:
    """Refuse a --plan the metrics file was not written by: its ranks (per-rank phases) or, where the file names
    its plan and that plan can still be read, its model and parallel layout."""
    ranks = next((len(v) for r in rows for v in (r.get("phases_s") or {}).values() if isinstance(v, list)), None)
    if ranks is not None and ranks != plan.world_size:
        raise AutoparError(f"metrics file {metrics} has {ranks} ranks' phases, but --plan {plan_path} runs "
                           f"{plan.world_size}; pass the plan that run used")
    if embedded is None:
        return
    try:
        ran = resolve_plan(embedded, Path(metrics))
    except AutoparError:
        return  # the plan it names was moved or removed: the rank count above is all there is to check
    if ran.config != plan.config or ran.model.resolved() != plan.model.resolved():
        raise AutoparError(f"metrics file {metrics} was written by a run of {ran.model.name} "
                           f"{ran.config.short()}, but --plan {plan_path} is {plan.model.name} {plan.config.short()}; "
                           "pass the plan that run used, or leave --plan out (the file names it)")


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
                                            "busbw_GBps": f.busbw_GBps * n}) for lv, f in levels.items()}
            for name, levels in cluster.collectives.items()}
    return cluster.model_copy(update=upd)


def predict(runs: list[Run], base: ClusterSpec, s: dict[str, float]) -> np.ndarray:
    """Each run's step time re-estimated on ``base`` (sized as the run's plan) with scales ``s``."""
    from cost_models.step import estimate

    out = []
    for r in runs:
        pc = r.plan.used_cluster  # the GPUs the run used (a plan may use part of its cluster)
        cl = scaled(base.model_copy(update={"gpus_per_node": pc.gpus_per_node, "num_nodes": pc.num_nodes,
                                            "precision": pc.precision}), s)
        out.append(estimate(r.plan.model, cl, r.plan.config, r.plan.global_batch, validate=False,
                            state=r.plan.state).step_time_s)
    return np.array(out)


# ---- the fit --------------------------------------------------------------------------------------
def fit_scales(runs: list[Run], base: ClusterSpec, params: tuple[str, ...] = PARAMS, iters: int = 30
               ) -> Calibration:
    """Levenberg-Marquardt on log-scales: min sum (log pred - log measured)^2 + PRIOR |log s|^2, bounded. The
    objective is a Gaussian posterior (runs' log errors RUN_NOISE, a prior PRIOR_LOG_SD on each log-scale), so its
    curvature at the optimum gives the scales' log covariance: a scale the runs cannot see keeps the prior's spread,
    one they pin gets a narrow one."""
    y = np.log([r.measured_s for r in runs])
    x = np.zeros(len(params))

    def resid(v: np.ndarray) -> np.ndarray:
        pred = predict(runs, base, dict(zip(params, np.exp(v))))
        return np.concatenate([np.log(pred) - y, math.sqrt(PRIOR) * v])

    def jacobian(v: np.ndarray, r: np.ndarray, h: float = 1e-4) -> np.ndarray:
        return np.stack([(resid(v + h * np.eye(len(v))[j]) - r) / h for j in range(len(v))], axis=1)

    r = resid(x)
    lam = 1e-3
    for _ in range(iters):
        J = jacobian(x, r)
        g, H = J.T @ r, J.T @ J
        improved = False
        for _ in range(8):
            step = np.linalg.solve(H + lam * np.diag(np.diag(H) + 1e-12), -g)
            x_new = np.clip(x + step, -BOUND, BOUND)
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
    noise2 = max(RUN_NOISE ** 2, float(np.mean(r[:len(runs)] ** 2)))
    cov = noise2 * np.linalg.inv(J.T @ J)  # the prior's rows keep J^T J invertible
    cov = (cov + cov.T) / 2
    for j in np.flatnonzero(np.abs(x) >= BOUND - 1e-9):  # at a bound the optimum is not a minimum: keep the prior's
        cov[j, :] = cov[:, j] = 0.0
        cov[j, j] = PRIOR_LOG_SD ** 2
    # however poorly the runs fit, a fit knows no less of a scale than the prior did: a spread wider than the prior's
    # is shrunk to it (D C D with D diagonal keeps the correlations, and C positive semi-definite)
    shrink = np.minimum(1.0, PRIOR_LOG_SD / np.sqrt(np.maximum(np.diag(cov), 1e-300)))
    cov = cov * np.outer(shrink, shrink)
    return Calibration(runs=len(runs), scales={p: float(np.exp(v)) for p, v in zip(params, x)},
                       log_covariance=tuple(tuple(float(c) for c in row) for row in cov))


def calibrated(base: ClusterSpec, fit: Calibration) -> ClusterSpec:
    """``base`` scaled by the fit, carrying it (plans' bands then widen by its uncertainty). When ``base`` was
    calibrated before, the scales this fit left alone (``--fit`` a subset) keep their earlier factor and spread."""
    out = scaled(base, fit.scales)
    old = base.calibration
    kept = [k for k in old.scales if k not in fit.scales] if old is not None else []
    if old is not None and kept:
        prev, n = list(old.scales), len(fit.scales)
        cov = np.zeros((n + len(kept), n + len(kept)))
        cov[:n, :n] = np.array(fit.log_covariance)
        for i, k in enumerate(kept, n):
            cov[i, i] = old.log_covariance[prev.index(k)][prev.index(k)]
        fit = Calibration(runs=fit.runs, scales={**fit.scales, **{k: old.scales[k] for k in kept}},
                          log_covariance=tuple(tuple(float(c) for c in row) for row in cov))
    return out.model_copy(update={"calibration": fit})


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


def bound_warning(scales: dict[str, float]) -> str | None:
    """A one-line caution when a fitted scale sits at its limit (x1/8 or x8): the runs are far from the profile's
    hardware (timed on another machine, or on CPUs for a GPU profile), not a correction to trust."""
    stuck = at_bound(scales)
    if not stuck:
        return None
    return (f"warning: {', '.join(stuck)} at the fit's limit (x1/8 .. x8): these runs did not run on the hardware "
            "the profile describes; calibrate the profile of the machine they ran on (--cluster)")


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


def _errors(pred: np.ndarray, runs: list[Run]) -> np.ndarray:
    return pred / np.array([r.measured_s for r in runs]) - 1.0


def profile_yaml(cluster: ClusterSpec, header: list[str]) -> str:
    data = cluster.model_dump(mode="json")
    return "\n".join(f"# {h}" for h in header) + "\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None,
                                                                        width=120)


def calibrate_command(args: argparse.Namespace) -> int:
    """The CLI entry point (args: metrics, out; optional plan, cluster, warmup, fit)."""
    params = tuple(p.strip() for p in (getattr(args, "fit", None) or ",".join(PARAMS)).split(",") if p.strip())
    bad = [p for p in params if p not in PARAMS]
    if bad or not params:
        raise AutoparError(f"--fit: unknown parameter '{bad[0] if bad else ''}'; choose from {', '.join(PARAMS)}")
    twice = sorted({p for p in params if params.count(p) > 1})
    if twice:
        raise AutoparError(f"--fit: '{twice[0]}' given twice; name each parameter once")
    warmup = getattr(args, "warmup", None)
    check_warmup(warmup)
    plans = getattr(args, "plan", None) or []
    check_output_file(args.out, "calibrated profile", {**{f"metrics file {m}": m for m in args.metrics},
                                                       **{f"plan file {p}": p for p in (
                                                           plans if isinstance(plans, list) else [plans])}})
    runs = load_runs(list(args.metrics), getattr(args, "plan", None), warmup)
    cluster_ref = getattr(args, "cluster", None)
    if cluster_ref:
        base = load_cluster(cluster_ref)
    else:  # the hardware the plans carry, without a one-command permission like --allow-cross-node-tp
        base = runs[0].plan.cluster.model_copy(update={"tp_across_nodes": False})
        other = {r.plan.cluster.gpu.name for r in runs} - {base.gpu.name}
        if other:
            raise AutoparError(f"the runs were planned on different GPUs ({base.gpu.name}, "
                               f"{', '.join(sorted(other))}); pass --cluster PROFILE to say which to calibrate")
    before = predict(runs, base, {})
    fit = fit_scales(runs, base, params)
    after = predict(runs, base, fit.scales)
    mismatch = hardware_mismatch(fit.scales, runs, after, cluster_ref, base)
    if mismatch:
        raise AutoparError(mismatch)
    e0, e1 = _errors(before, runs), _errors(after, runs)
    for r, b, a, eb, ea in zip(runs, before, after, e0, e1):
        print(f"{r.source}: {r.plan.config.short()} on {r.plan.cluster.num_gpus} GPU(s): measured {r.measured_s:.4g} s "
              f"(median of {r.steps} steps), predicted {b:.4g} s ({100 * eb:+.1f}%) -> {a:.4g} s ({100 * ea:+.1f}%)")
    fitted = fitted_text(fit)
    mean0, mean1 = float(np.mean(np.abs(e0))), float(np.mean(np.abs(e1)))
    print(f"fitted scales (x/ their 95% spread): {fitted}")
    warning = bound_warning(fit.scales)
    if warning:
        print(warning, file=sys.stderr)
    print(f"mean |error| {100 * mean0:.1f}% before, {100 * mean1:.1f}% after calibration ({len(runs)} run(s))")
    when = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    header = [f"Calibrated by `autopar calibrate` at {when} from {len(runs)} run(s): {fitted}.",
              f"Mean |predicted/measured - 1|: {100 * mean0:.1f}% before, {100 * mean1:.1f}% after."]
    text = profile_yaml(calibrated(base, fit), header)
    try:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.out, text)
    except OSError as err:
        raise AutoparError(f"cannot write {args.out}: {err.strerror}") from None
    print(f"wrote {args.out}")
    return 0
