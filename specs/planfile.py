"""The plan file: what `autopar plan --out` writes and `autopar run` executes (versioned, validated on load)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

from specs import __version__
from specs.cluster import ClusterSpec
from specs.errors import AutoparError, validation_message
from specs.files import DuplicateKey, duplicate_text, file_content, parse_json, utc_now, write_text_atomic
from specs.model import MAX_GLOBAL_BATCH, ModelSpec
from specs.parallel import DEFAULTS, ParallelConfig
from specs.rules import PlanContext, check_plan
from specs.state import StateSpec

SCHEMA = "autopar.plan/1"


# JSON types exactly: an integer field takes no true/"3"/2.0, a number field no string or boolean
Int = Annotated[int, Strict()]
Num = Annotated[float, Strict()]
Beta = Annotated[float, Strict(), Field(ge=0.0, lt=1.0)]


MAX_STEPS = 2**63  # steps are counted in 64-bit integers (checkpoint names, torch's step counters)


def is_plan_data(data: Any) -> bool:
    """Whether a file's content (:func:`specs.files.file_content`) is a plan file's, of any schema version, or the
    text of one cut short (a corrupt plan file, which `autopar plan --out` is told to write again)."""
    family = SCHEMA.split("/")[0] + "/"
    if isinstance(data, str):
        return f'"schema": "{family}' in data
    return isinstance(data, dict) and str(data.get("schema", "")).startswith(family)


def steps_problem(flag: str, steps: int) -> str | None:
    """Why ``steps`` (given as ``flag``) is not a run's number of steps; None when it is."""
    return None if 1 <= steps < MAX_STEPS else f"{flag} must be at least 1 (and below 2^63), got {steps}"


class TrainConfig(BaseModel):
    """Optimizer and schedule settings the runtime uses (AdamW, warmup + cosine)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    steps: Int = Field(20, ge=1, lt=MAX_STEPS)
    lr: Num = Field(3e-3, gt=0.0)
    min_lr: Num = Field(3e-4, ge=0.0)
    warmup_steps: Int = Field(2, ge=0, lt=MAX_STEPS)
    weight_decay: Num = Field(0.1, ge=0.0)
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    eps: Num = Field(1e-8, gt=0.0)
    grad_clip: Num = Field(1.0, ge=0.0)  # 0 = no clipping
    seed: Int = Field(1234, ge=0, lt=2**63)
    checkpoint_every: Int = Field(0, ge=0, lt=MAX_STEPS)  # steps; 0 = only at the end when a checkpoint dir is given

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr {self.min_lr:g} is above train.lr {self.lr:g}: the schedule decays from lr "
                             "to min_lr; set min_lr at most lr")
        return self


class PlanFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_: str = Field(SCHEMA, alias="schema")
    autopar_version: str = __version__
    created: str = ""
    model: ModelSpec
    cluster: ClusterSpec
    global_batch: Int = Field(ge=1, le=MAX_GLOBAL_BATCH)
    seq: Int = Field(ge=1)
    parallel: dict[str, Any]
    prediction: dict[str, Any] = Field(default_factory=dict)
    train: TrainConfig = TrainConfig()
    # the model state's precisions and gradient buckets, priced by the planner and allocated by the runtime
    # (plan files written before it existed get the default of their cluster's precision)
    state: StateSpec | None = None

    @field_validator("prediction")
    @classmethod
    def _prediction(cls, v: dict[str, Any]) -> dict[str, Any]:
        """The numbers `autopar run` reports beside its measurements: a step time and a peak, when given."""
        for key, low in (("step_time_s", 0.0), ("memory_GiB", 0.0)):
            x = v.get(key)
            if x is not None and not (isinstance(x, (int, float)) and not isinstance(x, bool)
                                      and low < x < float("inf")):
                raise ValueError(f"prediction.{key} must be a positive number, got {json.dumps(x)}; "
                                 "write the plan again with `autopar plan --out`")
        return v

    @field_validator("parallel")
    @classmethod
    def _dp_given(cls, v: dict[str, Any]) -> dict[str, Any]:
        """A plan file says its data-parallel size: without it the plan would run on tp*pp*cp ranks, whatever
        its cluster has (the planner always writes it)."""
        if "dp" not in v:
            raise ValueError("no dp: write it (tp*pp*cp*dp ranks run the plan), or write the plan "
                             "with `autopar plan --out`")
        return v

    @model_validator(mode="after")
    def _state(self) -> PlanFile:
        if self.state is None:
            self.state = StateSpec.default(self.cluster.precision)
        elif self.state.params != self.cluster.precision:
            raise ValueError(f"state.params={self.state.params} but cluster {self.cluster.name} computes in "
                             f"{self.cluster.precision}: parameters are kept in the compute precision; set "
                             f"state.params={self.cluster.precision} (or the cluster's precision)")
        return self

    @property
    def config(self) -> ParallelConfig:
        return ParallelConfig.from_dict(self.parallel)

    @property
    def world_size(self) -> int:
        return self.config.world

    @property
    def used_cluster(self) -> ClusterSpec:
        """The cluster as the plan uses it: resized to the plan's GPUs when it needs fewer than the cluster has."""
        world = self.config.world
        if world == self.cluster.num_gpus or self.cluster.node_groups:  # node groups: the placement says which
            return self.cluster
        return self.cluster.resized(gpus=world)

    @property
    def made_for(self) -> dict[str, Any]:
        """What this plan is, as a prediction is stamped with it (:func:`_made_for`): its keys, batch, sequence and a
        digest of its model, cluster and state. A run's metrics lines carry it (``plan_made_for``)."""
        return _made_for(self.parallel, self.global_batch, self.seq, self.model, self.cluster, self.state)

    @property
    def prediction_is_current(self) -> bool:
        """Whether ``prediction`` was made for this plan's keys, batch, model, cluster and state (False after a
        hand edit; plan files written before predictions were stamped, or before the inputs were, count as
        current in what they did not stamp)."""
        made_for = self.prediction.get("for")
        if made_for is None:
            return True
        return made_for_difference(made_for, self) is None


MADE_FOR_PARTS = {"parallel": "its parallel keys", "global_batch": "its global batch", "seq": "its sequence length",
                  "inputs": "its model, cluster or state"}  # what each part of :func:`_made_for` is, for messages


def made_for_difference(stamped: dict[str, Any], plan: PlanFile) -> str | None:
    """What of ``plan`` differs from the plan a stamp (:attr:`PlanFile.made_for`) was made for, in words; None when
    nothing differs (a stamp without ``inputs``, from before they were stamped, counts as current in them; one
    without its keys, batch or sequence does not)."""
    now = plan.made_for
    changed = [MADE_FOR_PARTS[k] for k in MADE_FOR_PARTS
               if (k in stamped or k != "inputs") and _stamp_part(k, stamped.get(k)) != _stamp_part(k, now[k])]
    return ", ".join(changed) or None


def _stamp_part(key: str, value: Any) -> Any:
    """A stamp's part as compared: parallel keys left out of a file (an older or a hand-written one) at their
    defaults, so that writing a default out, or leaving it out, is no edit."""
    if key != "parallel" or not isinstance(value, dict):
        return value
    return {**DEFAULTS, **value}


def _made_for(parallel: dict[str, Any], global_batch: int, seq: int, model: ModelSpec, cluster: ClusterSpec,
              state: StateSpec | None) -> dict[str, Any]:
    """What a prediction was made for: the plan's keys, batch and sequence, and a digest of the model, cluster and
    state (their non-default fields, so a field a later version adds does not count as an edit)."""
    inputs = {"model": model, "cluster": cluster, "state": state or StateSpec.default(cluster.precision)}
    text = json.dumps({k: v.model_dump(mode="json", by_alias=True, exclude_defaults=True) for k, v in inputs.items()},
                      sort_keys=True)
    return {"parallel": parallel, "global_batch": global_batch, "seq": seq,
            "inputs": hashlib.sha256(text.encode()).hexdigest()[:16]}


def make_plan(model: ModelSpec, cluster: ClusterSpec, global_batch: int, cfg: ParallelConfig,
              prediction: dict[str, Any] | None = None, train: TrainConfig | None = None,
              state: StateSpec | None = None) -> PlanFile:
    return PlanFile(
        schema=SCHEMA,
        created=utc_now(),
        model=model,
        cluster=cluster,
        global_batch=global_batch,
        seq=model.seq_length,
        parallel=cfg.to_dict(),
        prediction={**{k: v for k, v in prediction.items() if k != "parallel"},  # `for` holds the plan's keys
                    "for": _made_for(cfg.to_dict(), global_batch, model.seq_length, model, cluster, state)}
        if prediction else {},
        train=train or TrainConfig(),
        state=state or StateSpec.default(cluster.precision),
    )


def save_plan(plan: PlanFile, path: str | Path) -> None:
    text = json.dumps(plan.model_dump(mode="json", by_alias=True), indent=2)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # a folder --out names but that is not there yet
        write_text_atomic(path, text + "\n")
    except OSError as err:
        raise AutoparError(f"cannot write plan file {path}: {err.strerror}; check the folder is writable") from None


def load_plan(path: str | Path) -> PlanFile:
    """Read and validate a plan file; every way it can be wrong is a one-line AutoparError."""
    p = Path(path)
    try:
        data = parse_json(p.read_text())
    except DuplicateKey as err:
        raise AutoparError(f"plan file {p} {duplicate_text(err)}") from None
    except FileNotFoundError:
        raise AutoparError(f"plan file {p} does not exist; write one with `autopar plan ... --out {p}`") from None
    except OSError as err:
        raise AutoparError(f"cannot read plan file {p}: {err.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        content = file_content(p)
        if isinstance(content, dict) and not is_plan_data(content):  # (YAML also reads JSON with a stray comma)
            raise AutoparError(f"{p} is YAML (a model spec or cluster profile?), not a plan file: plans are the JSON "
                               "files `autopar plan --out` writes") from None
        if _json_lines(p):
            raise AutoparError(f"{p} holds JSON lines (a run's metrics file?), not a plan: plans are the JSON files "
                               "`autopar plan --out` writes") from None
        raise AutoparError(
            f"plan file {p} is not valid JSON (truncated or corrupt?); re-create it with `autopar plan --out`"
        ) from None
    return plan_from_data(data, f"plan file {p}")



def plan_from_data(data: Any, source: str) -> PlanFile:
    """Validate a plan's JSON object (from a file, or embedded in a metrics file); ``source`` starts the
    one-line error."""
    if not isinstance(data, dict):
        raise AutoparError(f"{source} must hold a JSON object")
    schema = data.get("schema")
    if schema is None:
        raise AutoparError(f"{source} is not a plan file (it has no \"schema\": \"{SCHEMA}\"); write one with "
                           "`autopar plan --out`")
    if schema != SCHEMA:
        raise AutoparError(f"{source} has schema {schema!r}, this autopar reads {SCHEMA!r}; "
                           "re-create it with `autopar plan --out`")
    try:
        plan = PlanFile.model_validate(data)
    except ValidationError as err:
        raise AutoparError(f"{source}: {validation_message(err, PlanFile)}") from None
    try:
        cfg = plan.config
        if plan.seq != plan.model.seq_length:
            raise AutoparError(f"seq {plan.seq} differs from the model's seq_length {plan.model.seq_length}")
        if cfg.world > plan.cluster.num_gpus:  # before the rules: a batch that does not split is its consequence
            raise AutoparError(f"the plan needs {cfg.world} GPUs ({cfg.short()}) but its cluster {plan.cluster.name} "
                               f"has {plan.cluster.num_gpus} GPUs; re-plan for this cluster")
        try:
            check_plan(cfg, PlanContext.on(plan.model, plan.cluster, plan.global_batch, gpus=cfg.world))
        except AutoparError as err:  # a plan file's batch is its global_batch, not a command's option
            raise AutoparError(str(err).replace("--global-batch", "global_batch")) from None
        try:
            plan.used_cluster  # noqa: B018 - resizing is the check
        except AutoparError:
            raise AutoparError(f"the plan uses {cfg.world} of cluster {plan.cluster.name}'s {plan.cluster.num_gpus} "
                               "GPUs, not a part the cluster can be cut to (whole nodes, or its node groups as they "
                               f"are); re-plan for {cfg.world} GPUs or for the whole cluster") from None
    except AutoparError as err:
        raise AutoparError(f"{source}: {err}") from None
    return plan


def _json_lines(p: Path) -> bool:
    """Whether a file is JSON objects one a line (what `autopar run --metrics-out` writes), more than one."""
    try:
        lines = [x for x in p.read_text().splitlines() if x.strip()]
        return len(lines) > 1 and all(isinstance(json.loads(x), dict) for x in lines[:3])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
