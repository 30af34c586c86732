"""The stage ILP's memory (planner/stage_problem.py) is the memory model's (cost_models/memory.py): for a plan's
own split, each rank's ILP bytes are at least the estimate's, and for a dense model without interleaving equal on
the rank with the largest temporary (the ILP counts that temporary on every rank, an interleaved rank's
micro-batches in flight chunk by chunk, and a layer's state as the largest a one-layer stage holds: with MoE layers
every other layer, an MoE layer's)."""

from __future__ import annotations

import pytest

from cost_models.memory import GiB
from cost_models.step import estimate
from planner.stage_problem import StageProblem, stage_problem
from specs.cluster_loading import load_cluster
from specs.model_loading import load_model
from specs.parallel import config_from_keys, parse_plan_keys
from specs.state import StateSpec

CASES = [  # (model, cluster, gpus, global batch, plan)
    ("llama3-70b", "dgx-h100", 64, 512, "tp=8,pp=4,mbs=1,sp=true,recompute=selective"),
    ("llama3-70b", "dgx-h100", 64, 512, "tp=8,pp=4,mbs=1,sp=true,recompute=full,zero=3,dp_overlap=true"),
    ("llama3-70b", "dgx-h100", 64, 512, "tp=4,pp=8,mbs=2,recompute=full,recompute_layers=3,zero=2"),
    ("llama3-70b", "dgx-h100", 64, 512, "tp=8,pp=4,vpp=5,mbs=1,sp=true,recompute=full,zero=1"),
    ("tiny-moe", "cpu-gloo", 8, 16, "tp=1,pp=2,ep=2,mbs=1,zero=1"),
    ("mixtral-8x7b", "dgx-h100", 32, 256, "tp=2,pp=4,ep=4,mbs=1,sp=true,zero=1,recompute=full"),
]


def _ilp_rank_bytes(p: StageProblem, layers: tuple[int, ...], redone: list[int]) -> list[float]:
    """Each rank's memory as planner/ilp.py constrains it, for ``layers`` and ``redone`` per virtual stage."""
    return [p.fixed_bytes + sum(layers[j] * p.state_per_layer + p.extra_state[j]
                                + p.inflight[j] * ((layers[j] - redone[j]) * p.act_full + redone[j] * p.act_ckpt
                                                   + p.extra_act[j])
                                for j in range(r, p.pp * p.vpp, p.pp))
            for r in range(p.pp)]


@pytest.mark.parametrize("model,cluster,gpus,batch,plan", CASES)
def test_stage_ilp_memory_is_the_estimates(model, cluster, gpus, batch, plan):
    m, cl = load_model(model, None), load_cluster(cluster, gpus=gpus)
    cfg = config_from_keys(parse_plan_keys(plan), cl.num_gpus)
    est = estimate(m, cl, cfg, batch, validate=False)
    p = stage_problem(m, cl, cfg, batch, 0.0, StateSpec.default(cl.precision))
    layers = cfg.stage_layers(m.num_layers)
    ilp = _ilp_rank_bytes(p, layers, [cfg.recomputed_layers(j, n) for j, n in enumerate(layers)])
    priced = [x * GiB for x in est.stage_memory_GiB]
    assert all(a >= b * (1 - 1e-12) for a, b in zip(ilp, priced)), (ilp, priced)
    temps = [s["temporary"] for s in est.stage_memory_breakdown]
    widest = temps.index(max(temps))
    if cfg.vpp == 1 and m.moe is None:
        assert ilp[widest] == pytest.approx(priced[widest], rel=1e-12)
