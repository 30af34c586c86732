"""A mixture-of-experts layer's description (``moe:`` in a model spec), and the counts that follow from it.

Which layers are MoE: layer ``i`` (0-based) is when ``i >= first_dense_layers`` and ``(i - first_dense_layers)`` is a
multiple of ``layer_freq`` (Megatron-Core's ``moe_layer_freq``; DeepSeek's ``first_k_dense_replace``); the other
layers keep the model's dense MLP (``ffn_hidden_size``). A MoE layer replaces that MLP by a router (a linear map to
``num_experts`` scores, softmax or sigmoid, the top ``experts_per_token`` kept), the routed experts (SwiGLU MLPs of
``moe_ffn_hidden_size``) and ``num_shared_experts`` experts every token passes through (one SwiGLU MLP of
``shared_ffn_hidden_size``, by default their widths summed).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from specs.errors import bool_only, number_only, whole_only

# Expert load imbalance: the busiest expert-parallel rank's routed tokens over the mean. Default: the busiest
# expert's load over the mean measured with an auxiliary load-balancing loss, 1 + MaxVio_global = 1.52 (3B model)
# and 1.72 (1B) in Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"
# (arXiv 2408.15664, Table 2), the larger model's rounded: the busiest expert bounds the busiest rank, so it is
# conservative when a rank holds several experts. Runs that force balanced routing (benchmarks) set 1.0. A spec
# that leaves it unset is priced at the default, and its band reaches down to balanced routing
# (``MoESpec.routing_known``).
DEFAULT_LOAD_IMBALANCE = 1.5


class MoESpec(BaseModel):
    """The mixture-of-experts part of a model spec (docs/contract.md, "Model spec")."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    num_experts: int = Field(ge=1, le=1 << 16)
    experts_per_token: int = Field(ge=1, le=1 << 16)
    moe_ffn_hidden_size: int = Field(ge=1, le=1 << 22)
    num_shared_experts: int = Field(0, ge=0, le=1 << 10)
    shared_ffn_hidden_size: int | None = Field(None, ge=1, le=1 << 24)
    shared_expert_gate: bool = False  # a sigmoid gate on the shared experts' output (Qwen-MoE)
    layer_freq: int = Field(1, ge=1, le=10_000)
    first_dense_layers: int = Field(0, ge=0, le=10_000)
    router: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum to one (Mixtral); False: raw probabilities
    capacity_factor: float | None = Field(None, gt=0, le=1e3)  # None: dropless
    aux_loss_coef: float = Field(0.01, ge=0, le=1e3)
    load_imbalance: float = Field(DEFAULT_LOAD_IMBALANCE, ge=1.0, le=1e3)
    # whether load_imbalance was given (a spec that writes it) or is the default for routing not known; a spec
    # without this key is known exactly when it writes load_imbalance
    load_imbalance_known: StrictBool = False

    _wholes = field_validator("num_experts", "experts_per_token", "moe_ffn_hidden_size", "num_shared_experts",
                              "shared_ffn_hidden_size", "layer_freq", "first_dense_layers", mode="before")(
        lambda v: v if v is None else whole_only(v))
    _numbers = field_validator("capacity_factor", "aux_loss_coef", "load_imbalance", mode="before")(number_only)
    _switches = field_validator("shared_expert_gate", "norm_topk_prob", mode="before")(bool_only)

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: Any) -> Any:
        if isinstance(data, dict) and "load_imbalance_known" not in data:
            data = {**data, "load_imbalance_known": "load_imbalance" in data}
        return data

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"moe.experts_per_token {self.experts_per_token} is more than moe.num_experts "
                             f"{self.num_experts}; a token cannot go to more experts than there are")
        if self.shared_ffn_hidden_size is not None and self.num_shared_experts == 0:
            raise ValueError("moe.shared_ffn_hidden_size is set but moe.num_shared_experts is 0; set both or neither")
        return self

    @property
    def shared_ffn(self) -> int:
        """Width of the shared experts' MLP (0 without them)."""
        if self.num_shared_experts == 0:
            return 0
        return self.shared_ffn_hidden_size or self.num_shared_experts * self.moe_ffn_hidden_size

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_dense_layers and (i - self.first_dense_layers) % self.layer_freq == 0

    def moe_layers_before(self, n: Any) -> Any:
        """How many of layers 0 .. n-1 are MoE layers (numpy-broadcast over n)."""
        n = np.asarray(n, dtype=float)
        return np.maximum(0.0, np.ceil((n - self.first_dense_layers) / self.layer_freq))

    def token_time_factor(self) -> float:
        """How much longer than the balanced mean the busiest rank's experts run: the load imbalance, or with a
        capacity factor the capacity every expert's buffer is padded to."""
        if self.capacity_factor is not None:
            return self.capacity_factor
        return self.load_imbalance

    @property
    def routing_known(self) -> bool:
        """Whether the busiest rank's load is given (a load imbalance, or a capacity factor's padding) rather than the
        unknown routing of a dropless model priced at :data:`DEFAULT_LOAD_IMBALANCE`."""
        return self.capacity_factor is not None or self.load_imbalance_known

    def trained(self) -> dict[str, Any]:
        """The section as training knows it (its given fields): without the load imbalance and the capacity factor,
        which only price it (the runtime is dropless), so a checkpoint or Hugging Face model matches a spec whatever
        routing it assumes."""
        return {k: v for k, v in self.model_dump(mode="json", exclude_none=True).items()
                if k not in ("load_imbalance", "load_imbalance_known", "capacity_factor")}

    def with_imbalance(self, ratio: float) -> MoESpec:
        """This spec with the busiest rank's load given as ``ratio`` x the mean (1.0: balanced routing)."""
        return self.model_copy(update={"load_imbalance": ratio, "load_imbalance_known": True})

    def summary(self) -> str:
        shared = f", {self.num_shared_experts} shared (ffn {self.shared_ffn})" if self.num_shared_experts else ""
        pattern = "" if self.layer_freq == 1 and not self.first_dense_layers else (
            f", every {self.layer_freq} layer(s) from layer {self.first_dense_layers}")
        return (f"MoE {self.num_experts} experts top-{self.experts_per_token} (ffn {self.moe_ffn_hidden_size})"
                f"{shared}{pattern}")
