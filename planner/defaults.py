"""The plan `autopar run` trains when given none: the planner's best plan for the tiny model on 4 CPU ranks."""

from __future__ import annotations

from pathlib import Path

from planner.prediction import plan_prediction
from planner.search import SearchResult, search
from specs.cluster_loading import load_cluster
from specs.model_loading import load_model
from specs.planfile import TrainConfig, make_plan, save_plan

MODEL, CLUSTER, RANKS, GLOBAL_BATCH = "tiny", "cpu-gloo", 4, 16
FIXED = {"tp": 2, "pp": 2}  # show tensor and pipeline parallelism at work
TRAIN = TrainConfig(steps=40, warmup_steps=4)  # a longer schedule than TrainConfig's default, the same rates


def plan_command(ranks: int = RANKS) -> str:
    """The `autopar plan` command that plans the default job freely on ``ranks`` ranks."""
    return f"autopar plan --model {MODEL} --cluster {CLUSTER} --gpus {ranks} --global-batch {GLOBAL_BATCH}"


def default_plan(path: str | Path) -> tuple[Path, SearchResult]:
    """Plan the default job and write the best plan to ``path``."""
    model, cluster = load_model(MODEL), load_cluster(CLUSTER, gpus=RANKS)
    res = search(model, cluster, GLOBAL_BATCH, fixed=FIXED, top=3)
    best = res.plans[0]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pred = plan_prediction(model, cluster, best.config, best.estimate, GLOBAL_BATCH)
    save_plan(make_plan(model, cluster, GLOBAL_BATCH, best.config, pred, TRAIN), out)
    return out, res
