"""Several layer splits of one placed plan priced together (the search's layer moves) give, row by row, the numbers
of pricing each split alone (many replayed as one table, a few one at a time): 1F1B, interleaved, a rank split over
groups, and a batch long enough for the replay's steady-state extension."""

from __future__ import annotations

import random
from dataclasses import asdict, replace

import pytest

from cost_models.step import estimate, split_estimates
from specs.cluster_loading import load_cluster
from specs.model_loading import load_model
from specs.parallel import config_from_keys, parse_plan_keys
from specs.state import StateSpec

CASES = [
    ("a100-h100-ib", "gpt-1.7b", 64, "tp=2,pp=3,dp=16,sp=true,zero=1,placement=h100/a100*2"),
    ("a100-h100-ib", "gpt-1.7b", 16384, "tp=2,pp=3,dp=16,sp=true,placement=a100/h100/a100"),  # 1,024 micro-batches
    ("a100-l40s-mixed", "mixtral-8x7b", 64, "tp=2,pp=4,dp=4,cp=2,ep=8,vpp=2,sp=true,zero=1,placement=a100*2/l40s*2"),
    ("ib-roce-a100", "llama-13b", 1024, "tp=2,pp=4,dp=16,sp=true,recompute=full,placement=ib+roce*4"),
]


def _random_splits(rng: random.Random, layers: int, stages: int, n: int) -> list[tuple[int, ...]]:
    cuts = [sorted(rng.sample(range(1, layers), stages - 1)) for _ in range(n)]
    return [tuple(b - a for a, b in zip([0, *k], [*k, layers])) for k in cuts]


@pytest.mark.parametrize("cluster_name, model_name, batch, keys", CASES)
def test_splits_priced_together_equal_each_priced_alone(cluster_name, model_name, batch, keys):
    cluster, model = load_cluster(cluster_name), load_model(model_name)
    cfg = config_from_keys(parse_plan_keys(keys), cluster.num_gpus)
    state = StateSpec.default(cluster.precision)
    splits = _random_splits(random.Random(batch), model.num_layers, cfg.pp * cfg.vpp, 5)
    together = split_estimates(model, cluster, cfg, splits, batch, None, state)
    assert len(together) == len(splits)
    alone = [estimate(model, cluster, replace(cfg, layers=s), batch, None, state=state) for s in splits]
    assert [asdict(e) for e in together] == [asdict(e) for e in alone]
    few = split_estimates(model, cluster, cfg, splits[:2], batch, None, state)  # (replayed one at a time)
    assert [asdict(e) for e in few] == [asdict(e) for e in alone[:2]]
    assert len({e.step_time_s for e in alone}) > 1  # the splits differ in what they cost
