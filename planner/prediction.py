"""One plan's prediction as the commands print it and plan files keep it (docs/contract.md): the estimate's JSON,
the plan's keys and its band, and on a calibrated profile the spread its fit leaves on the step."""

from __future__ import annotations

from typing import Any

from planner.calibrate import calibration_spread
from planner.uncertainty import step_band
from specs.cluster import ClusterSpec
from specs.parallel import ParallelConfig


def prediction_json(est: Any, cfg: ParallelConfig, spread: float = 0.0, calibrated: bool = False) -> dict[str, Any]:
    """``{parallel, <estimate>, step_time_band_s[, calibration_log_sd]}`` of an estimate of ``cfg`` whose
    calibration spread (planner/calibrate.py) is ``spread``; ``calibrated``: the profile carries a calibration."""
    out = {"parallel": cfg.to_dict(), **est.to_json(),
           "step_time_band_s": list(step_band(cfg.pp, est.step_time_s, spread))}
    if calibrated:
        out["calibration_log_sd"] = round(spread, 6)
    return out


def plan_prediction(model: Any, cluster: ClusterSpec, cfg: ParallelConfig, est: Any, global_batch: int,
                    state: Any = None) -> dict[str, Any]:
    """:func:`prediction_json` with the plan's calibration spread worked out (none on an uncalibrated profile)."""
    spread, _ = calibration_spread(model, cluster, cfg, global_batch, state)
    return prediction_json(est, cfg, spread, cluster.calibration is not None)
