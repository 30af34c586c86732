"""``allowed_splits``: the layer splits a plan may run with, what does not read the split checked once, are exactly
those :func:`plan_problem` allows one by one (the search's layer moves price hundreds of splits of one plan)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from specs.model_loading import load_model
from specs.parallel import Candidates, ParallelConfig
from specs.rules import RULES, PlanContext, allowed_splits, plan_problem

MODEL = load_model("tiny").model_copy(update={"num_layers": 6})
PLANS = [
    (ParallelConfig(pp=3, dp=2), 32),
    (ParallelConfig(pp=2, vpp=2, dp=2, recompute="full", recompute_layers=(1, 2, 0, 1)), 32),
    (ParallelConfig(tp=2, pp=3), 12),
    (ParallelConfig(pp=3, dp=2), 31),  # a global batch dp does not divide: no split runs
    (ParallelConfig(pp=3, dp=2, tp=3), 32),  # tp does not divide the heads: none either
]
SPLITS = [s for n in (3, 4) for s in itertools.product(range(0, 5), repeat=n)]  # wrong counts, sums, empty stages


@pytest.mark.parametrize("cfg,batch", PLANS)
def test_allowed_splits_are_those_plan_problem_allows(cfg, batch):
    x = PlanContext(MODEL, cfg.pp * cfg.tp * cfg.dp, batch)
    one_by_one = [s for s in SPLITS if plan_problem(replace(cfg, layers=s), x) is None]
    assert allowed_splits(cfg, SPLITS, x) == one_by_one
    assert bool(one_by_one) == (cfg.tp != 3 and batch % cfg.dp == 0)  # the bad plans allow none; the others some


@pytest.mark.parametrize("cfg,batch", PLANS)
def test_a_rule_that_does_not_name_the_split_does_not_read_it(cfg, batch):
    x = PlanContext(MODEL, cfg.pp * cfg.tp * cfg.dp, batch)
    for rule in (r for r in RULES if "layers" not in r.keys):
        seen = {tuple(np.atleast_1d(rule.ok(Candidates.of(replace(cfg, layers=s)), x))) for s in SPLITS[::7]}
        assert len(seen) == 1, rule.keys
