"""How sure the cost model is of a step time: a band per plan and a ranking uncertainty, from its validation.

``planner/residuals.json`` holds measured / predicted step time of every row of the published sets the model is
checked against (benchmarks/validate_published.py writes it, its ``write-residuals`` option; a test keeps it
current): Megatron-LM on Selene (Korthikanti 2022, Narayanan 2021) and Megatron-DeepSpeed on Jean Zay
(BigScience's BLOOM sweep). Nothing is fitted to them; they only say how far off the model has been.

- **Band.** For plans of one kind (pipelined or not), a prediction interval of measured / predicted from all
  rows of that kind: the k-th smallest to the k-th largest, k = floor(0.025 (n + 1)) and at least 1 (the
  distribution-free interval of conformal prediction: at least 95% from 39 rows on, the range seen below): a plan
  predicted at T measured between T x low and T x high on those stacks. The model leans optimistic (other
  stacks overlap less and add fixed costs it does not know), so bands reach further above the prediction than
  below.
- **Ranking.** Errors of plans run on one stack move together; what can reorder two plans is how their errors
  differ. ``sigma`` is the standard deviation of log(measured / predicted) within each set (each set's mean
  removed); two plans whose predictions are closer than sigma x sqrt(2) (the spread of the difference of two
  plans' errors) are tied: the model cannot tell which is faster, and `autopar tune` should measure them.
- **Unknown routing.** A mixture of experts of routing not known (``MoESpec.routing_known``): the band reaches
  down from its step at balanced routing (docs/cost_model.md, "Load imbalance").
- **Calibrated profiles.** A profile `autopar calibrate` / `tune` wrote carries its fit's uncertainty
  (``ClusterSpec.calibration``): a plan leaning on a scale its runs did not pin (attention at a sequence length
  they did not reach, the network of a node count they did not span) gets its band widened by that.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from specs.errors import AutoparError

RESIDUALS = Path(__file__).with_name("residuals.json")
TAIL = 0.025  # each side's share outside the band: 95% inside
Z95 = 1.959964  # ... of a normal distribution


@dataclass(frozen=True)
class Band:
    low: float  # measured / predicted, the k-th smallest of the rows (``band``)
    high: float  # ... the k-th largest
    rows: int  # validation rows of this kind
    coverage: float  # the probability it holds a new row like them, at least (below 39 rows, under 95%)


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


def sharded_rows(sets: dict[str, list[dict[str, Any]]] | None = None) -> int:
    """The validation rows whose plan sharded gradients or parameters (ZeRO-2/3): a band has seen such runs only
    where this is above 0."""
    return sum(1 for rows in _sets(sets).values() for r in rows if re.search(r"\bzero=[23]\b", str(r.get("plan"))))


def band(pipelined: bool, sets: dict[str, list[dict[str, Any]]] | None = None) -> Band:
    """The band of plans of this kind (from ``sets``, default the stored residuals)."""
    ratios = np.sort([r["ratio"] for rows in _sets(sets).values() for r in rows if r["pipelined"] == pipelined])
    n = len(ratios)
    # A new row exchangeable with n seen ones is the k-th smallest or below with probability k / (n + 1), so the
    # k-th smallest to the k-th largest holds it with probability at least 1 - 2k / (n + 1) (Vovk, Gammerman and
    # Shafer 2005; Lei et al. 2018, "Distribution-free predictive inference for regression"): k = 2.5% of (n + 1),
    # rounded down, keeps that at 95% or more from 39 rows on (an interpolated quantile between order statistics
    # would not). Below 39 rows k would be 0: no finite band holds 95%, and the range seen, the widest the rows can
    # say, holds a new row with probability (n - 1) / (n + 1) (``Band.coverage``).
    k = max(1, math.floor(TAIL * (n + 1)))
    lo, hi = ratios[k - 1], ratios[n - k]
    return Band(low=float(lo), high=float(hi), rows=n, coverage=1 - 2 * k / (n + 1))


def ranking_sigma(sets: dict[str, list[dict[str, Any]]] | None = None) -> float:
    """Standard deviation of log(measured / predicted) within a set, pooled over the sets."""
    dev, dof = [], 0
    for rows in _sets(sets).values():
        x = np.log([r["ratio"] for r in rows])
        dev.extend(x - x.mean())
        dof += len(x) - 1
    return float(math.sqrt(sum(d * d for d in dev) / dof))


def step_band(pp: int, step_s: float, spread: float = 0.0, balanced_s: float | None = None) -> tuple[float, float]:
    """Seconds a plan with ``pp`` pipeline stages predicted at ``step_s`` measured within (on the stacks seen),
    widened by a calibrated profile's ``spread`` (the log standard deviation its fit leaves on this plan's step,
    planner/calibrate.py ``calibration_spread``) to the central 95% of that too. ``balanced_s``: a mixture of
    experts whose routing imbalance is not known, its step at balanced routing; the band reaches down to it."""
    b = band(pp > 1)
    widen = math.exp(Z95 * spread)
    low = min(step_s, balanced_s) if balanced_s is not None else step_s
    return low * b.low / widen, step_s * b.high * widen


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


def coverage(sets: dict[str, list[dict[str, Any]]], hold_out: str = "row") -> dict[str, float]:
    """Per set: the share of its rows whose measured step lies in the band of their kind made from the rest:
    every *other* row (``hold_out="row"``: a row never widens its own band, so the share can fall short of 1) or
    the *other sets* only (``"set"``: how the bands do on a stack none of their rows come from)."""
    def covered(name: str, i: int) -> bool:
        rest = {n: [r for j, r in enumerate(rows) if (n, j) != (name, i) and (hold_out == "row" or n != name)]
                for n, rows in sets.items()}
        row = sets[name][i]
        if sum(r["pipelined"] == row["pipelined"] for rows in rest.values() for r in rows) == 0:
            return False  # the only rows of their kind: no band without them
        return in_band(row["pipelined"], row["ratio"], 1.0, rest)

    if hold_out not in ("row", "set"):
        raise ValueError(f"hold_out is 'row' or 'set', not {hold_out!r}")
    return {name: sum(covered(name, i) for i in range(len(rows))) / len(rows) for name, rows in sets.items()}
