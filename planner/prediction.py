"""One plan's prediction as the commands print it and plan files keep it (docs/contract.md): the estimate's JSON,
the plan's keys and its band, on a calibrated profile the spread its fit leaves on the step, and for a mixture of
experts of unknown routing its step at balanced routing."""

from __future__ import annotations

from typing import Any

from cost_models.step import estimate
from planner.calibrate import calibration_spread
from planner.uncertainty import step_band
from specs.cluster import ClusterSpec
from specs.model import ModelSpec
from specs.parallel import ParallelConfig
from specs.state import StateSpec


def prediction_json(est: Any, cfg: ParallelConfig, spread: float = 0.0, calibrated: bool = False,
                    balanced_s: float | None = None) -> dict[str, Any]:
    """``{parallel, <estimate>, step_time_band_s[, calibration_log_sd][, balanced_routing_step_s]}`` of an estimate
    of ``cfg`` whose calibration spread (planner/calibrate.py) is ``spread``; ``calibrated``: the profile carries a
    calibration; ``balanced_s``: :func:`balanced_step_s`, where the band reaches down to."""
    out = {"parallel": cfg.to_dict(), **est.to_json(),
           "step_time_band_s": list(step_band(cfg.pp, est.step_time_s, spread, balanced_s))}
    if calibrated:
        out["calibration_log_sd"] = round(spread, 6)
    if balanced_s is not None:
        out["balanced_routing_step_s"] = round(balanced_s, 6)
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
