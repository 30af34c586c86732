"""The plan file: what `autopar plan --out` writes and `autopar run` executes (versioned, validated on load)."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner import __version__
from planner.cluster_spec import ClusterSpec
from planner.errors import AutoparError
from planner.model_spec import ModelSpec, _one_line
from planner.parallel import ParallelConfig

SCHEMA = "autopar.plan/1"


class TrainConfig(BaseModel):
    """Optimizer and schedule settings the runtime uses (AdamW, warmup + cosine)."""

    model_config = ConfigDict(extra="forbid")
    steps: int = 20
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 2
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    seed: int = 1234
    checkpoint_every: int = 0  # steps; 0 = only at the end when a checkpoint dir is given


class PlanFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_: str = Field(SCHEMA, alias="schema")
    autopar_version: str = __version__
    created: str = ""
    model: ModelSpec
    cluster: ClusterSpec
    global_batch: int
    seq: int
    parallel: dict[str, Any]
    prediction: dict[str, Any] = Field(default_factory=dict)
    train: TrainConfig = TrainConfig()

    @property
    def config(self) -> ParallelConfig:
        return ParallelConfig.from_dict(self.parallel)

    @property
    def world_size(self) -> int:
        return self.config.world


def make_plan(model: ModelSpec, cluster: ClusterSpec, global_batch: int, cfg: ParallelConfig,
              prediction: dict[str, Any] | None = None, train: TrainConfig | None = None) -> PlanFile:
    return PlanFile(
        schema=SCHEMA,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        model=model,
        cluster=cluster,
        global_batch=global_batch,
        seq=model.seq_length,
        parallel=cfg.to_dict(),
        prediction=prediction or {},
        train=train or TrainConfig(),
    )


def save_plan(plan: PlanFile, path: str | Path) -> None:
    text = json.dumps(plan.model_dump(mode="json", by_alias=True), indent=2)
    try:
        Path(path).write_text(text + "\n")
    except OSError as err:
        raise AutoparError(f"cannot write plan file {path}: {err.strerror}; check the directory exists") from None


def load_plan(path: str | Path) -> PlanFile:
    """Read and validate a plan file; every way it can be wrong is a one-line AutoparError."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise AutoparError(f"plan file {p} does not exist; write one with `autopar plan ... --out {p}`") from None
    except OSError as err:
        raise AutoparError(f"cannot read plan file {p}: {err.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise AutoparError(
            f"plan file {p} is not valid JSON (truncated or corrupt?); re-create it with `autopar plan --out`"
        ) from None
    if not isinstance(data, dict):
        raise AutoparError(f"plan file {p} must hold a JSON object")
    schema = data.get("schema")
    if schema != SCHEMA:
        raise AutoparError(
            f"plan file {p} has schema {schema!r}, this autopar reads {SCHEMA!r}; "
            "re-create it with `autopar plan --out`")
    try:
        plan = PlanFile.model_validate(data)
        cfg = plan.config
    except ValidationError as err:
        raise AutoparError(f"plan file {p}: {_one_line(err)}") from None
    except TypeError as err:
        raise AutoparError(f"plan file {p}: bad 'parallel' section ({err})") from None
    if plan.seq != plan.model.seq_length:
        raise AutoparError(f"plan file {p}: seq {plan.seq} differs from the model's seq_length {plan.model.seq_length}")
    cfg.validate(plan.model, cfg.world, plan.global_batch, plan.cluster.gpus_per_node)
    return plan
