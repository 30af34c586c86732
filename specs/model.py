"""The model spec: a decoder-only transformer's shapes, and the counts derived from them.

Specs come from a bundled preset, an autopar YAML/JSON file, a Hugging Face ``config.json``
(``hf_config.py``) or a traced ``nn.Module`` (``trace.py``); ``model_loading.load_model`` resolves a
reference to one. Every problem is an :class:`AutoparError` with a one-line message.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal, get_args

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator, model_validator

from specs.errors import AutoparError, bool_only, number_only, whole_only
from specs.moe import MoESpec

# Upper bounds far above any real model (the largest have ~100-200 layers, hidden ~25k, vocabularies ~256k):
# they catch typos and absurd values before they reach the search and the solver.
LIMITS = {"num_layers": 10_000, "hidden_size": 1 << 20, "num_attention_heads": 1 << 16, "num_kv_heads": 1 << 16,
          "ffn_hidden_size": 1 << 22, "vocab_size": 1 << 24, "seq_length": 1 << 26, "head_dim": 1 << 16,
          "sliding_window": 1 << 26, "max_positions": 1 << 26}
TokenIdName = Literal["bos_token_id", "eos_token_id", "pad_token_id"]  # the special tokens a spec may name
TOKEN_ID_NAMES: tuple[str, ...] = get_args(TokenIdName)
MAX_GLOBAL_BATCH = 1 << 20  # sequences per step: hundreds of times the largest published training batches
# RoPE frequency scalings autopar computes (runtime/models/common.py), with the fields each needs; a spec may hold
# others (Hugging Face's yarn, dynamic, longrope, ...): planned (the cost model does not price RoPE), not trained
ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")  # any type's
ROPE_SCALINGS = {"linear": ("factor",), "llama3": ROPE_FIELDS}  # the types the runtime computes, and their fields


def size_problem(name: str, value: int, limit: int) -> str | None:
    """Why ``value`` is not a valid size (a positive integer up to ``limit``), or None."""
    if value <= 0:
        return f"{name} must be a positive integer, got {value}"
    if value > limit:
        return f"{name} must be at most {limit:,} (far beyond any real workload), got {value:,}; check the value"
    return None


class BlockCounts(BaseModel):
    """Per-layer counts of a traced custom model (one repeated block), used instead of the formulas."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    params: int = Field(ge=0)
    fwd_flops_per_token: float = Field(ge=0)  # matmul FLOPs per token in one block's forward, attention excluded
    attn_flops_per_token: float = Field(0.0, ge=0)  # attention-core FLOPs per token (scales with seq)
    act_bytes_per_token: float = Field(ge=0)  # bytes saved for backward per token (16-bit activations)
    elementwise_bytes_per_token: float = Field(0.0, ge=0)  # bytes moved by non-matmul ops per token, forward

    _numbers = field_validator("*", mode="before")(number_only)


class RopeScaling(BaseModel):
    """RoPE's frequencies stretched for longer contexts (a Hugging Face config's ``rope_scaling``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    type: str
    factor: float | None = Field(None, gt=0)
    low_freq_factor: float | None = Field(None, gt=0)
    high_freq_factor: float | None = Field(None, gt=0)
    original_max_position_embeddings: int | None = Field(None, ge=1, le=LIMITS["seq_length"])

    _numbers = field_validator("factor", "low_freq_factor", "high_freq_factor", mode="before")(number_only)
    _wholes = field_validator("original_max_position_embeddings", mode="before")(whole_only)

    @model_validator(mode="after")
    def _check(self) -> RopeScaling:
        if self.type in ("", "default"):
            raise ValueError(f"type {self.type!r} is no scaling; drop rope_scaling")
        missing = [k for k in ROPE_SCALINGS.get(self.type, ()) if getattr(self, k) is None]
        if missing:
            raise ValueError(f"type {self.type} needs {', '.join(missing)}")
        # (the context a model was trained at is kept whatever the type: transformers keeps it beside any scaling)
        takes = (*ROPE_SCALINGS.get(self.type, ROPE_FIELDS), "original_max_position_embeddings")
        extra = [k for k in ROPE_FIELDS if k not in takes and getattr(self, k) is not None]
        if extra:
            raise ValueError(f"type {self.type} does not take {', '.join(extra)} (llama3's blend of frequencies): "
                             "drop it")
        if self.type == "llama3" and self.low_freq_factor >= self.high_freq_factor:  # type: ignore[operator]
            raise ValueError(f"low_freq_factor {self.low_freq_factor} must be below high_freq_factor "
                             f"{self.high_freq_factor} (llama3 interpolates between them)")
        return self


def ids_in_vocab(token_ids: dict[str, Any], vocab: Any) -> dict[str, Any]:
    """``token_ids`` without the ids past ``vocab`` tokens (a list keeps its others; one left empty goes)."""
    out = {}
    for key, ids in token_ids.items():
        if isinstance(ids, list):
            ids = [v for v in ids if not _past(v, vocab)]
            if ids:
                out[key] = ids
        elif not _past(ids, vocab):
            out[key] = ids
    return out


def past_vocab(token_ids: dict[str, Any], vocab: Any) -> str:
    """The ids of ``token_ids`` past ``vocab`` tokens, as "bos_token_id 50256, eos_token_id 300" ("" if none)."""
    return ", ".join(f"{k} {v}" for k, ids in token_ids.items() for v in (ids if isinstance(ids, list) else [ids])
                     if _past(v, vocab))


def _past(v: Any, vocab: Any) -> bool:
    """Whether ``v`` is an id at or past ``vocab`` tokens (a vocabulary that is no number bounds nothing here)."""
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    return number(v) and number(vocab) and v >= vocab


class ModelSpec(BaseModel):
    """A decoder-only transformer (the fields are the contract: docs/contract.md, "Model spec")."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str
    arch: Literal["gpt", "llama"]
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int
    seq_length: int = 2048
    tie_embeddings: bool = False
    head_dim: int | None = None
    # How the model is computed, which the cost model prices and the runtime executes.
    # attention: "unfused" = explicit softmax(QK^T)V storing the s*s scores (Megatron 2021/22, the papers'
    # activation formulas); "flash" = fused attention that stores only Q, K, V, O and the log-sum-exp.
    attention: Literal["flash", "unfused"] | None = None
    dropout: float | None = None
    qkv_bias: bool = False
    # The MLP's activation: GPT's "gelu" (the default) or "squared_relu" (relu(x)^2, as Primer and Nemotron-4 use);
    # Llama's gated "swiglu". linear_bias: biases on the QKV, attention-output and MLP projections (GPT's default;
    # False for a GPT-style model without them, e.g. Nemotron-4); Llama has none (qkv_bias adds QKV's).
    activation: Literal["gelu", "squared_relu", "swiglu"] | None = None
    linear_bias: bool | None = None
    # rotary position embeddings on this share of each head's dimensions (Nemotron-4: 0.5, StableLM: 0.25; the rest
    # pass through); default: Llama all of them, GPT none (learned absolute positions). A GPT with it set uses RoPE
    # instead of learned positions.
    rotary_fraction: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    # attention to the last this many tokens only (Mistral 7B v0.1: 4096); autopar prices and trains full
    # attention, which is the same at sequences up to this length, so longer ones are refused
    sliding_window: int | None = None
    # learned positions for this many tokens at most (a Hugging Face GPT-2 config's n_positions: the rows its weights
    # hold), so longer sequences are refused; None (presets, specs): the table grows with the sequence
    max_positions: int | None = None
    # the context a Hugging Face config declares (its max_position_embeddings), which the planned seq_length may be
    # below: export-hf writes it back (None: seq_length); it neither plans nor trains anything
    context_length: int | None = Field(None, ge=1)
    # the special tokens' ids a Hugging Face config declares (bos_token_id, eos_token_id: an id or a list,
    # pad_token_id), which export-hf writes back (None: not known, written null); they neither plan nor train anything
    token_ids: dict[TokenIdName, NonNegativeInt | list[NonNegativeInt]] | None = None
    block: BlockCounts | None = None  # set for traced custom models
    moe: MoESpec | None = None  # mixture-of-experts layers (specs/moe.py); None: every layer dense

    _numbers = field_validator("dropout", "norm_eps", "rope_theta", "rotary_fraction", mode="before")(number_only)

    @model_validator(mode="before")
    @classmethod
    def _ids_in_vocab(cls, data: Any) -> Any:
        """Special tokens' ids past the vocabulary left out (a plan or checkpoint written before spec files refused
        them, `specs.model_loading.model_from_dict`: it loads, and exports the ids its embedding has)."""
        if isinstance(data, dict) and isinstance(data.get("token_ids"), dict):
            kept = ids_in_vocab(data["token_ids"], data.get("vocab_size"))
            data = {**data, "token_ids": kept or None}
        return data
    _wholes = field_validator(*LIMITS, "context_length", mode="before")(whole_only)

    @field_validator("token_ids", mode="before")
    @classmethod
    def _whole_ids(cls, v: Any) -> Any:
        """Token ids are whole numbers (pydantic would read true as 1 and 2.0 as 2)."""
        for x in v.values() if isinstance(v, dict) else ():
            for i in x if isinstance(x, list) else [x]:
                whole_only(i)
        return v

    _switches = field_validator("tie_embeddings", "qkv_bias", "linear_bias", mode="before")(
        lambda v: v if v is None else bool_only(v))

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        for field, limit in LIMITS.items():
            v = getattr(self, field)
            problem = None if v is None else size_problem(field, v, limit)
            if problem:
                raise ValueError(problem)
        problem = self.seq_problem(self.seq_length)
        if problem:
            raise ValueError(problem)
        if self.arch == "llama" and self.ffn_hidden_size is None:
            raise ValueError("ffn_hidden_size is required for arch 'llama' (SwiGLU width)")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}; fix one of them or give head_dim"
            )
        if self.kv_heads <= 0 or self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_kv_heads "
                f"{self.num_kv_heads}"
            )
        if self.rotary_fraction is not None and not 0.0 < self.rotary_fraction <= 1.0:
            raise ValueError(f"rotary_fraction must be in (0, 1] (the share of each head's dimensions RoPE rotates), "
                             f"got {self.rotary_fraction}")
        if self.block is None and self.rope_dims == self.hd and self.hd % 2:
            raise ValueError(f"head_dim {self.hd} is odd, but rotary position embeddings rotate pairs "
                             "of dimensions; use an even head_dim (hidden_size / num_attention_heads)")
        if self.block is None and self.rope_dims > self.hd:
            raise ValueError(f"rotary_fraction {self.rotary_fraction} of a head_dim of {self.hd} leaves no pair of "
                             "dimensions to rotate; use a head_dim of at least 2")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.norm_eps < 0:
            raise ValueError(f"norm_eps must be zero or positive, got {self.norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.arch == "llama" and self.activation not in (None, "swiglu"):
            raise ValueError(f"activation {self.activation!r} needs arch 'gpt' (a non-gated MLP); arch 'llama' is "
                             "SwiGLU: drop activation or use arch gpt")
        if self.arch == "gpt" and self.activation == "swiglu":
            raise ValueError("activation 'swiglu' (a gated MLP) is arch 'llama'; use arch llama, or gelu / "
                             "squared_relu for arch gpt")
        if self.arch == "llama" and self.linear_bias:
            raise ValueError("arch 'llama' has no linear biases; drop linear_bias (qkv_bias adds QKV's)")
        if self.rope_scaling is not None and not self.rope_dims:
            raise ValueError("rope_scaling scales RoPE, but this GPT has learned positions; drop rope_scaling or "
                             "give rotary_fraction")
        if self.max_positions is not None and not self.learned_positions:
            raise ValueError("max_positions bounds learned positions, but this model has RoPE; drop max_positions")
        if self.moe is not None:
            if self.arch != "llama" or self.block is not None:
                raise ValueError("moe needs arch llama (SwiGLU experts); a GPT or traced model has no MoE layers here")
            if self.moe_layers == 0:
                raise ValueError(f"moe.first_dense_layers {self.moe.first_dense_layers} leaves no MoE layer among the "
                                 f"{self.num_layers} layers; lower it or drop moe")
        return self

    # ---- resolved fields -------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_attention_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def attn_impl(self) -> str:
        """GPT defaults to the Megatron papers' unfused attention, Llama to flash attention."""
        if self.attention is not None:
            return self.attention
        return "unfused" if self.arch == "gpt" else "flash"

    def trained(self) -> dict[str, Any]:
        """The spec as training knows it, for telling whether two runs train one model: its JSON without what only
        plans it (the MoE load imbalance) and what only describes it (``name``, ``context_length``, ``token_ids``);
        ``max_positions`` counts (the rows of a learned position table)."""
        out = self.model_dump(mode="json")
        out.pop("context_length", None)
        out.pop("token_ids", None)
        out.pop("name", None)  # what it is called (a preset's name, an exported folder's) is not what it computes
        if self.moe is not None:
            out["moe"] = self.moe.trained()
        return out

    def resolved(self) -> ModelSpec:
        """This spec with every default its arch decides written out (attention, dropout, activation, biases, kv
        heads, MLP width): two specs of one model compare equal whether or not they spelled those out."""
        return self.model_copy(update={"attention": self.attn_impl, "dropout": self.dropout_p, "activation": self.act,
                                       "linear_bias": self.has_bias, "num_kv_heads": self.kv_heads,
                                       "ffn_hidden_size": self.ffn,
                                       "rotary_fraction": None if self.learned_positions else
                                       self.rotary_fraction or 1.0})

    @property
    def learned_positions(self) -> bool:
        """GPT's learned absolute position embedding (unless ``rotary_fraction`` gives it RoPE)."""
        return self.arch == "gpt" and self.rotary_fraction is None

    @property
    def rope_dims(self) -> int:
        """Dimensions of each head RoPE rotates: all of them, ``rotary_fraction`` of them rounded down to an even
        number (at least 2), or 0 with learned positions."""
        if self.learned_positions:
            return 0
        if self.rotary_fraction is None or self.rotary_fraction == 1.0:
            return self.hd
        return max(2, int(self.hd * self.rotary_fraction) // 2 * 2)

    @property
    def act(self) -> str:
        """The MLP's activation: ``activation``, else GeLU for GPT and SwiGLU for Llama."""
        return self.activation or ("gelu" if self.arch == "gpt" else "swiglu")

    @property
    def has_bias(self) -> bool:
        """Whether the QKV, attention-output and MLP projections have biases (GPT's default)."""
        return self.linear_bias if self.linear_bias is not None else self.arch == "gpt"

    @property
    def dropout_p(self) -> float:
        if self.dropout is not None:
            return self.dropout
        return 0.1 if self.arch == "gpt" else 0.0

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.hd

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.hd

    # ---- mixture of experts -----------------------------------------------------------------------
    @cached_property
    def moe_layers(self) -> int:
        """How many layers are MoE layers (0 for a dense model)."""
        return 0 if self.moe is None else int(self.moe.moe_layers_before(self.num_layers))

    @property
    def moe_fraction(self) -> float:
        """The share of layers that are MoE layers: the cost model prices the average layer (docs/cost_model.md)."""
        return self.moe_layers / self.num_layers

    # ---- parameter counts (per GPU under tensor parallelism t: what the runtime allocates) -----------
    def _mlp_params_on(self, t: Any, f: int) -> Any:
        """A tensor-parallel MLP of width ``f`` on one GPU (SwiGLU for Llama: gate | up, each padded to t)."""
        rows = (2 if self.arch == "llama" else 1) * np.ceil(f / t)
        return rows * self.hidden_size + self.hidden_size * np.ceil(f / t)

    def layer_params_on(self, t: Any = 1, ep: Any = 1, etp: Any = 1, moe_share: Any = None) -> Any:
        """Parameters of one transformer layer on one GPU of ``t`` tensor-parallel ranks (numpy-broadcast over t):
        column- and row-parallel weights split t ways, each fused part (q | k | v, gate | up) padded to a
        multiple of t; norms and row-parallel biases whole on every rank. With MoE layers: the average of layers of
        which ``moe_share`` are MoE layers (default :attr:`moe_fraction`: the model's average layer; 0 a dense one,
        1 a MoE one), the routed experts split over ``ep`` x ``etp`` (:meth:`expert_params_on`)."""
        t = np.asarray(t, dtype=float)
        if self.block is not None:  # a traced custom block: its count, split evenly
            return self.block.params / t
        h, qw, kw = self.hidden_size, self.q_width, self.kv_width
        qkv_rows = np.ceil(qw / t) + 2 * np.ceil(kw / t)
        attn = qkv_rows * h + h * np.ceil(qw / t)
        if self.arch == "gpt":  # column-parallel biases split, the row-parallel ones (proj, MLP out) whole
            bias = (qkv_rows if self.has_bias or self.qkv_bias else 0.0) + (np.ceil(self.ffn / t) if self.has_bias
                                                                           else 0.0)
            return attn + self._mlp_params_on(t, self.ffn) + bias + self.replicated_layer_params
        mlp = self._mlp_params_on(t, self.ffn)
        if self.moe is not None:
            phi = self._share(moe_share)
            shared = self._mlp_params_on(t, self.moe.shared_ffn) if self.moe.shared_ffn else 0.0
            mlp = (1 - phi) * mlp + phi * shared + self.expert_params_on(ep, etp, phi)
        return attn + (qkv_rows if self.qkv_bias else 0) + mlp + self.replicated_params(moe_share)

    def _share(self, moe_share: Any) -> Any:
        return self.moe_fraction if moe_share is None else np.asarray(moe_share, dtype=float)

    def expert_params_on(self, ep: Any = 1, etp: Any = 1, moe_share: Any = None) -> Any:
        """The routed experts' parameters of a layer on one GPU (the average layer; ``moe_share`` as in
        :meth:`layer_params_on`): ``num_experts / ep`` experts, each a SwiGLU MLP split ``etp`` ways (0 for a dense
        model). Their gradients are reduced over the expert-data-parallel group, not the data-parallel one."""
        if self.moe is None:
            return np.zeros_like(np.asarray(ep, dtype=float) * np.asarray(etp, dtype=float))
        per_expert = self._mlp_params_on(np.asarray(etp, dtype=float), self.moe.moe_ffn_hidden_size)
        return self._share(moe_share) * self.moe.num_experts / np.asarray(ep, dtype=float) * per_expert

    def active_layer_params(self) -> float:
        """Parameters of the average layer one token's matmuls use: all of a dense layer; in a MoE layer the
        router, the shared experts and ``experts_per_token`` of the routed ones (the MFU numerator's count)."""
        full = float(self.layer_params_on(1))
        if self.moe is None:
            return full
        m = self.moe
        return full - float(self.expert_params_on(1, 1)) * (1 - m.experts_per_token / m.num_experts)

    @property
    def replicated_layer_params(self) -> Any:
        """Parameters of the average layer every tensor-parallel rank holds whole (:meth:`replicated_params`)."""
        return self.replicated_params()

    def replicated_params(self, moe_share: Any = None) -> Any:
        """Parameters of a layer every tensor-parallel rank holds whole: norms and row-parallel biases, and a MoE
        layer's router and shared experts' gate (``moe_share`` as in :meth:`layer_params_on`)."""
        if self.block is not None:
            return 0
        h = self.hidden_size
        if self.arch == "gpt":
            return (6 if self.has_bias else 4) * h  # two LayerNorms (weight, bias), two out biases
        if self.moe is None:
            return 2 * h
        return 2 * h + self._share(moe_share) * h * (self.moe.num_experts + (1 if self.moe.shared_expert_gate else 0))

    @property
    def position_rows(self) -> int:
        """Rows of GPT's learned position table: ``max_positions`` where given (a GPT-2 config's ``n_positions``),
        else the sequence; 0 with RoPE."""
        return (self.max_positions or self.seq_length) if self.learned_positions else 0

    @property
    def position_params(self) -> int:
        """GPT's learned position embedding (every tensor-parallel rank holds it whole); none with RoPE."""
        return self.position_rows * self.hidden_size

    def embedding_params_on(self, t: Any = 1) -> Any:
        """The input embedding on one GPU: a vocabulary shard (padded to a multiple of t), GPT's positions whole."""
        return np.ceil(self.vocab_size / np.asarray(t, dtype=float)) * self.hidden_size + self.position_params

    def head_params_on(self, t: Any = 1, own_output: Any = True) -> Any:
        """The final norm and the LM head on one GPU; ``own_output``: it holds its output weights (not tied to
        an embedding on the same GPU)."""
        norm = 2 * self.hidden_size if self.arch == "gpt" else self.hidden_size
        vocab = np.ceil(self.vocab_size / np.asarray(t, dtype=float)) * self.hidden_size
        return norm + np.where(own_output, vocab, 0.0)

    @property
    def embedding_params(self) -> int:
        """Input embedding (tokens, plus learned positions for GPT)."""
        return int(self.embedding_params_on(1))

    @property
    def head_params(self) -> int:
        """Final norm plus the LM head (zero head weights when tied)."""
        return int(self.head_params_on(1, not self.tie_embeddings))

    @property
    def num_params(self) -> int:
        layers = self.num_layers * float(self.layer_params_on(1))  # exact: the average layer times the layers
        return int(round(layers)) + self.embedding_params + self.head_params

    @property
    def active_params(self) -> int:
        """Parameters one token uses (all of them for a dense model)."""
        return int(round(self.num_layers * self.active_layer_params())) + self.embedding_params + self.head_params

    def model_flops_per_token(self, seq: int | None = None) -> float:
        """Model FLOPs per token for forward + backward, no recompute (the MFU numerator).

        6 x (parameters that do matmuls: every layer and the LM head) + 12 x layers x (heads x head_dim) x seq:
        the Megatron / PaLM convention, attention counted without causal savings. MoE layers count their active
        parameters only (:meth:`active_layer_params`).
        """
        s = seq or self.seq_length
        matmul_params = self.num_layers * self.active_layer_params() + self.vocab_size * self.hidden_size
        if self.block is not None:
            per_layer = 3 * self.block.fwd_flops_per_token + 3 * self.block.attn_flops_per_token * s / self.seq_length
            return self.num_layers * per_layer + 6 * self.vocab_size * self.hidden_size
        return 6.0 * matmul_params + 12.0 * self.num_layers * self.q_width * s

    def seq_problem(self, seq: int) -> str | None:
        """Why the model cannot run at sequence length ``seq`` (beyond its sliding window or learned positions), or
        None."""
        n = self.max_positions
        if n is not None and self.learned_positions and seq > n:
            return (f"sequence length {seq} is beyond {self.name}'s {n} learned positions (max_positions: a "
                    f"Hugging Face config's n_positions, the rows its weights hold); plan it at {n} tokens or fewer "
                    f"(--seq {n})")
        w = self.sliding_window
        if w is None or seq <= w:
            return None
        return (f"sequence length {seq} is beyond {self.name}'s sliding_window of {w} tokens: autopar prices and "
                f"trains full attention, which is sliding-window attention only up to {w} tokens; plan it at {w} "
                f"tokens or fewer (--seq {w})")

    def with_seq(self, seq: int | None) -> ModelSpec:
        if not seq or seq == self.seq_length:
            return self
        problem = self.seq_problem(seq)
        if problem:
            raise AutoparError(problem)
        return self.model_copy(update={"seq_length": seq})

    def summary(self) -> str:
        return (
            f"{self.name}: {'traced nn.Module' if self.block is not None else self.arch}, "
            f"{_count(self.num_params)} params, {self.num_layers} layers, "
            f"hidden {self.hidden_size}, {self.num_attention_heads} heads ({self.kv_heads} kv), "
            f"ffn {self.ffn}, vocab {self.vocab_size}, seq {self.seq_length}, attention {self.attn_impl}"
            + (f", {self.act.replace('_', ' ')} MLP" if self.act == "squared_relu" else "")
            + (", no linear biases" if self.arch == "gpt" and not self.has_bias else "")
            + (f", RoPE on {self.rope_dims} of {self.hd} head dims" if 0 < self.rope_dims < self.hd
               or self.arch == "gpt" and self.rope_dims else "")
            + (f"; {self.moe.summary()}, {_count(self.active_params)} active" if self.moe is not None else "")
        )


def _count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))
