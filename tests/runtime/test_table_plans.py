"""The planner's best plans for four real GPU cases run: each plan's feature combination, its degrees cut to 2
(8 ranks at most), trains the tiny model under ``autopar run`` and gives the single-process losses.

The cases are those whose best plan the runtime could not execute before it had ZeRO-2/3, context parallelism
and TP overlap: Llama 3 8B on 8 H100s, 70B on 64, 8B at 128k tokens on 64 (cp), 405B on 2048.
"""

from __future__ import annotations

import json
import math

import pytest
from rt_cases import case_plan
from rt_reference import reference_run

from planner.search import search
from runtime.launch import launch
from runtime.options import RunOptions
from specs.cluster_loading import load_cluster
from specs.model_loading import load_model
from specs.parallel import ParallelConfig
from specs.planfile import save_plan

TOL = 1e-5

CASES = [  # (model, sequence length, H100s, global batch)
    ("llama3-8b", None, 8, 64),
    ("llama3-70b", None, 64, 512),
    ("llama3-8b", 131072, 64, 64),
    ("llama3-405b", None, 2048, 2048),
]


def reduced(cfg: ParallelConfig) -> dict:
    """The plan's features with every degree above 1 cut to 2, data parallelism dropped first past 8 ranks."""
    deg = {k: min(getattr(cfg, k), 2) for k in ("tp", "pp", "cp", "dp")}
    if math.prod(deg.values()) > 8:
        deg["dp"] = 1
    return dict(**deg, sp=cfg.sp, tp_overlap=cfg.tp_overlap, zero=cfg.zero, dp_overlap=cfg.dp_overlap,
                recompute=cfg.recompute, sched="interleaved" if cfg.vpp > 1 else "1f1b", arch="llama")


@pytest.mark.parametrize("name,seq,gpus,batch", CASES, ids=[f"{c[0]}-{c[2]}gpus" + ("-128k" if c[1] else "")
                                                            for c in CASES])
def test_best_plan_trains_under_autopar_run(tmp_path, tokens64, name, seq, gpus, batch):
    best = search(load_model(name, seq), load_cluster("dgx-h100", gpus=gpus), batch, top=1).plans[0].config
    case = reduced(best)
    plan = case_plan(case)
    cfg = plan.config
    # the same features as the full-size plan
    assert (cfg.sp, cfg.tp_overlap, cfg.zero, cfg.dp_overlap, cfg.recompute) == \
        (best.sp, best.tp_overlap, best.zero, best.dp_overlap, best.recompute)
    assert all((getattr(cfg, k) > 1) == (getattr(best, k) > 1) for k in ("tp", "pp", "cp", "vpp"))
    path, metrics = tmp_path / "plan.json", tmp_path / "m.jsonl"
    save_plan(plan, path)
    assert launch(str(path), RunOptions(data=tokens64, metrics_out=str(metrics), quiet=True)) == 0
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    want = reference_run(plan, tokens64)["losses"]
    assert len(losses) == len(want) == plan.train.steps
    for got, ref in zip(losses, want):
        assert abs(got - ref) <= TOL * abs(ref), (best.short(), losses, want)
