"""One plan's prediction as the commands print it and plan files keep it (docs/contract.md): the estimate's JSON,
the plan's keys and its band, on a calibrated profile the spread its fit leaves on the step, and for a mixture of
experts of unknown routing its step at balanced routing."""

from __future__ import annotations

from typing import Any

from cost_models.step import estimate
from planner.calibrate import calibration_spread
from planner.uncertainty import step_band
from specs.cluster import ClusterSpec
from specs.json_numbers import sig6
from specs.model import ModelSpec
from specs.parallel import ParallelConfig
from specs.state import StateSpec


def prediction_json(est: Any, cfg: ParallelConfig, spread: float = 0.0, calibrated: bool = False,
                    balanced_s: float | None = None) -> dict[str, Any]:
    """``{parallel, <estimate>, step_time_band_s[, calibration_log_sd][, balanced_routing_step_s]}`` of an estimate
    of ``cfg`` whose calibration spread (planner/calibrate.py) is ``spread``; ``calibrated``: the profile carries a
    calibration; ``balanced_s``: :func:`balanced_step_s`, where the band reaches down to."""
    out = {"parallel": cfg.to_dict(), **est.to_json(),
           "step_time_band_s": [sig6(x) for x in step_band(cfg.pp, est.step_time_s, spread, balanced_s)]}
    if calibrated:
        out["calibration_log_sd"] = sig6(spread)
    if balanced_s is not None:
        out["balanced_routing_step_s"] = sig6(balanced_s)
    return out


def balanced_step_s(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, global_batch: int,
                    state: StateSpec | None = None) -> float | None:
    """A mixture of experts whose routing imbalance is not known (``MoESpec.routing_known``): the step of ``cfg``
    with balanced routing, the low end of its band. None for other models."""
    if model.moe is None or model.moe.routing_known:
        return None
    balanced = model.model_copy(update={"moe": model.moe.with_imbalance(1.0)})
    return estimate(balanced, cluster, cfg, global_batch, state=state).step_time_s


def plan_prediction(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, est: Any, global_batch: int,
                    state: StateSpec | None = None) -> dict[str, Any]:
    """:func:`prediction_json` with the plan's calibration spread and balanced-routing step worked out."""
    spread, _ = calibration_spread(model, cluster, cfg, global_batch, state)
    return prediction_json(est, cfg, spread, cluster.calibration is not None,
                           balanced_step_s(model, cluster, cfg, global_batch, state))


def tuned_note(prediction: dict[str, Any] | None, plan_name: str) -> str | None:
    """A line for a plan `autopar tune` wrote (its prediction carries the measured and calibrated steps): the
    plan's own prediction is priced on the profile it was planned on, the calibrated one on the profile tune fitted
    to the trials, which a later run and diagnose are compared against only when planned on that profile."""
    p = prediction or {}
    measured, calibrated = p.get("measured_step_time_s"), p.get("calibrated_step_time_s")
    if not isinstance(measured, (int, float)) or not isinstance(calibrated, (int, float)):
        return None
    where = p.get("calibrated_profile")
    on = f"its calibrated profile ({where})" if where else "its calibrated profile"
    again = f": plan on --cluster {where} to predict with the measurements folded in" if where else ""
    return (f"{plan_name} was tuned: `autopar tune` measured it at {measured:.4g} s a step and {on} prices it at "
            f"{calibrated:.4g} s; the prediction compared here ({p.get('step_time_s', 0):.4g} s) is on the profile it "
            f"was planned on{again}")
