"""How sure the cost model is of a step time: a band per plan and a ranking uncertainty, from its validation.

``planner/residuals.json`` holds measured / predicted step time of every row of the published sets the model is
checked against (benchmarks/validate_published.py writes it, its ``write-residuals`` option; a test keeps it
current): Megatron-LM on Selene (Korthikanti 2022, Narayanan 2021) and Megatron-DeepSpeed on Jean Zay
(BigScience's BLOOM sweep). Nothing is fitted to them; they only say how far off the model has been.

- **Band.** For plans of one kind (pipelined or not), the central 95% of measured / predicted (2.5th to 97.5th
  percentile at the plotting positions k / (n + 1); with fewer than 39 rows, the range seen) over all rows of
  that kind: a plan predicted at T measured between T x low and T x high on those
  stacks. The model leans optimistic (other stacks overlap less and add fixed costs it does not know), so bands
  reach further above the prediction than below.
- **Ranking.** Errors of plans run on one stack move together; what can reorder two plans is how their errors
  differ. ``sigma`` is the standard deviation of log(measured / predicted) within each set (each set's mean
  removed); two plans whose predictions are closer than sigma x sqrt(2) (the spread of the difference of two
  plans' errors) are tied: the model cannot tell which is faster, and `autopar tune` should measure them.
- **Calibrated profiles.** A profile `autopar calibrate` / `tune` wrote carries its fit's uncertainty
  (``ClusterSpec.calibration``): a plan leaning on a scale its runs did not pin (attention at a sequence length
  they did not reach, the network of a node count they did not span) gets its band widened by that.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from specs.errors import AutoparError

RESIDUALS = Path(__file__).with_name("residuals.json")
QUANTILES = (0.025, 0.975)  # the central 95%
Z95 = 1.959964  # ... of a normal distribution


@dataclass(frozen=True)
class Band:
    low: float  # measured / predicted, 2.5th percentile
    high: float  # ... 97.5th percentile
    rows: int  # validation rows of this kind


def _sets(sets: dict[str, list[dict[str, Any]]] | None) -> dict[str, list[dict[str, Any]]]:
    return sets if sets is not None else _stored()


@cache
def _stored() -> dict[str, list[dict[str, Any]]]:
    regenerate = "regenerate it: python benchmarks/validate_published.py --write-residuals planner/residuals.json"
    try:
        sets = json.loads(RESIDUALS.read_text())["sets"]
        ratios = [(r["ratio"], r["pipelined"]) for rows in sets.values() for r in rows]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise AutoparError(f"{RESIDUALS} is missing or unreadable ({type(err).__name__}); {regenerate}") from None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and isinstance(k, bool) for x, k in ratios):
        raise AutoparError(f"{RESIDUALS} needs numbers for ratio and true/false for pipelined; {regenerate}")
    kinds = {k for _, k in ratios}
    if (not all(math.isfinite(x) and x > 0 for x, _ in ratios) or kinds != {True, False}
            or any(len(rows) < 2 for rows in sets.values())):
        raise AutoparError(f"{RESIDUALS} needs positive ratios, both plan kinds and two rows per set; {regenerate}")
    return sets


def band(pipelined: bool, sets: dict[str, list[dict[str, Any]]] | None = None) -> Band:
    """The band of plans of this kind (from ``sets``, default the stored residuals)."""
    ratios = np.sort([r["ratio"] for rows in _sets(sets).values() for r in rows if r["pipelined"] == pipelined])
    n = len(ratios)
    # Quantiles at the plotting positions k / (n + 1) (Hyndman and Fan 1996, definition 6; np.quantile's
    # "weibull", which would import numpy.ma: slow the first time): n rows say nothing of the tails beyond
    # 1 / (n + 1), so with fewer than 39 rows the central 95% is the range seen, not a narrower interpolation.
    lo, hi = np.interp(np.multiply(QUANTILES, n + 1), np.arange(1, n + 1), ratios)
    return Band(low=float(lo), high=float(hi), rows=n)


def ranking_sigma(sets: dict[str, list[dict[str, Any]]] | None = None) -> float:
    """Standard deviation of log(measured / predicted) within a set, pooled over the sets."""
    dev, dof = [], 0
    for rows in _sets(sets).values():
        x = np.log([r["ratio"] for r in rows])
        dev.extend(x - x.mean())
        dof += len(x) - 1
    return float(math.sqrt(sum(d * d for d in dev) / dof))


def step_band(pp: int, step_s: float, spread: float = 0.0) -> tuple[float, float]:
    """Seconds a plan with ``pp`` pipeline stages predicted at ``step_s`` measured within (on the stacks seen),
    widened by a calibrated profile's ``spread`` (the log standard deviation its fit leaves on this plan's step,
    planner/calibrate.py ``calibration_spread``) to the central 95% of that too."""
    b = band(pp > 1)
    widen = math.exp(Z95 * spread)
    return step_s * b.low / widen, step_s * b.high * widen


def in_band(pipelined: bool, measured_s: float, predicted_s: float,
            sets: dict[str, list[dict[str, Any]]] | None = None) -> bool:
    """Whether a measured step lies in the band of its plan's kind around its prediction (bands from ``sets``,
    default the stored residuals)."""
    b = band(pipelined, sets)
    return b.low <= measured_s / predicted_s <= b.high


def tie_margin() -> float:
    """Relative difference below which two predicted step times are a tie (sigma x sqrt 2)."""
    return math.sqrt(2) * ranking_sigma()


def tied_indices(steps: list[float], extra: list[float] | None = None) -> list[int]:
    """Which of ``steps`` (sorted, best first) after the first are tied with it: slower by less than the margin,
    widened for plan i by ``extra[i]`` (the spread a calibrated profile's fit leaves on its difference from the
    first, planner/calibrate.py ``difference_spreads``; plans beyond ``extra`` get none)."""
    def margin(i: int) -> float:
        return math.hypot(tie_margin(), extra[i] if extra and i < len(extra) else 0.0)

    return [i for i, s in enumerate(steps[1:], 1) if s / steps[0] - 1 < margin(i)]


def tied_with_best(steps: list[float], extra: list[float] | None = None) -> int:
    """How many of ``steps`` after the first are tied with it (:func:`tied_indices`)."""
    return len(tied_indices(steps, extra))


def coverage(sets: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Per set: the share of its rows whose measured step lies in the band of their kind made from every *other*
    row (leave one out: a row never widens its own band, so the share can fall short of 1)."""
    def covered(name: str, i: int) -> bool:
        rest = {n: [r for j, r in enumerate(rows) if (n, j) != (name, i)] for n, rows in sets.items()}
        row = sets[name][i]
        if sum(r["pipelined"] == row["pipelined"] for rows in rest.values() for r in rows) == 0:
            return False  # the only row of its kind: no band without it
        return in_band(row["pipelined"], row["ratio"], 1.0, rest)

    return {name: sum(covered(name, i) for i in range(len(rows))) / len(rows) for name, rows in sets.items()}
