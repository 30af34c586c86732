"""Model specs: the transformer shapes autopar plans for.

A spec comes from a bundled preset name, a YAML/JSON file in autopar's own format, a Hugging Face
``config.json`` (Llama/Mistral/Qwen2-style or GPT-2-style), or a traced ``nn.Module`` (see ``trace.py``).
Everything user-facing raises :class:`AutoparError` with a one-line message.
"""

from __future__ import annotations

import json
import math
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from planner.errors import AutoparError, did_you_mean

PRESET_DIR = Path(__file__).parent / "presets"
# Upper bounds far above any real model (the largest have ~100-200 layers, hidden ~25k, vocabularies ~256k):
# they catch typos and absurd values before they reach the search and the solver.
LIMITS = {"num_layers": 10_000, "hidden_size": 1 << 20, "num_attention_heads": 1 << 16, "num_kv_heads": 1 << 16,
          "ffn_hidden_size": 1 << 22, "vocab_size": 1 << 24, "seq_length": 1 << 26, "head_dim": 1 << 16}


def size_problem(name: str, value: int, limit: int) -> str | None:
    """Why ``value`` is not a valid size (a positive integer up to ``limit``), or None."""
    if value <= 0:
        return f"{name} must be a positive integer, got {value}"
    if value > limit:
        return f"{name} must be at most {limit:,} (far beyond any real workload), got {value:,}; check the value"
    return None


def _not_bool(v: Any) -> Any:
    """Refuse true/false where a number is expected (pydantic would read them as 1 and 0)."""
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got {str(v).lower()}")
    return v


class BlockCounts(BaseModel):
    """Per-layer counts of a traced custom model (one repeated block), used instead of the formulas."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    params: int = Field(ge=0)
    fwd_flops_per_token: float = Field(ge=0)  # matmul FLOPs per token in one block's forward, attention excluded
    attn_flops_per_token: float = Field(0.0, ge=0)  # attention-core FLOPs per token (scales with seq)
    act_bytes_per_token: float = Field(ge=0)  # bytes saved for backward per token (16-bit activations)
    elementwise_bytes_per_token: float = Field(0.0, ge=0)  # bytes moved by non-matmul ops per token, forward

    _numbers = field_validator("*", mode="before")(_not_bool)


class ModelSpec(BaseModel):
    """A decoder-only transformer (contract: ../shared/DESIGN.md, "Model spec")."""

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
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    block: BlockCounts | None = None  # set for traced custom models

    _numbers = field_validator(*LIMITS, "dropout", "norm_eps", "rope_theta", mode="before")(_not_bool)

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        for field, limit in LIMITS.items():
            v = getattr(self, field)
            problem = None if v is None else size_problem(field, v, limit)
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
        if self.arch == "llama" and self.block is None and self.hd % 2:
            raise ValueError(f"head_dim {self.hd} is odd, but rotary position embeddings (arch llama) rotate pairs "
                             "of dimensions; use an even head_dim (hidden_size / num_attention_heads)")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.norm_eps < 0:
            raise ValueError(f"norm_eps must be zero or positive, got {self.norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
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

    # ---- parameter counts ------------------------------------------------------------------
    @cached_property
    def layer_params(self) -> int:
        """Parameters of one transformer layer."""
        if self.block is not None:
            return self.block.params
        h, f = self.hidden_size, self.ffn
        qkv = h * (self.q_width + 2 * self.kv_width)
        proj = self.q_width * h
        if self.arch == "gpt":
            biases = (self.q_width + 2 * self.kv_width) + h + f + h
            return qkv + proj + 2 * h * f + biases + 4 * h  # two LayerNorms (weight + bias)
        bias = (self.q_width + 2 * self.kv_width) if self.qkv_bias else 0
        return qkv + proj + 3 * h * f + bias + 2 * h  # two RMSNorms

    @property
    def embedding_params(self) -> int:
        """Input embedding (tokens, plus learned positions for GPT)."""
        pos = self.seq_length * self.hidden_size if self.arch == "gpt" else 0
        return self.vocab_size * self.hidden_size + pos

    @property
    def head_params(self) -> int:
        """Final norm plus the LM head (zero head weights when tied)."""
        norm = 2 * self.hidden_size if self.arch == "gpt" else self.hidden_size
        return norm + (0 if self.tie_embeddings else self.vocab_size * self.hidden_size)

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.embedding_params + self.head_params

    def model_flops_per_token(self, seq: int | None = None) -> float:
        """Model FLOPs per token for forward + backward, no recompute (the MFU numerator).

        6 x (parameters that do matmuls: every layer and the LM head) + 12 x layers x (heads x head_dim) x seq:
        the Megatron / PaLM convention, attention counted without causal savings.
        """
        s = seq or self.seq_length
        matmul_params = self.num_layers * self.layer_params + self.vocab_size * self.hidden_size
        if self.block is not None:
            per_layer = 3 * self.block.fwd_flops_per_token + 3 * self.block.attn_flops_per_token * s / self.seq_length
            return self.num_layers * per_layer + 6 * self.vocab_size * self.hidden_size
        return 6.0 * matmul_params + 12.0 * self.num_layers * self.q_width * s

    def with_seq(self, seq: int | None) -> ModelSpec:
        return self if not seq or seq == self.seq_length else self.model_copy(update={"seq_length": seq})

    def summary(self) -> str:
        return (
            f"{self.name}: {self.arch}, {_count(self.num_params)} params, {self.num_layers} layers, "
            f"hidden {self.hidden_size}, {self.num_attention_heads} heads ({self.kv_heads} kv), "
            f"ffn {self.ffn}, vocab {self.vocab_size}, seq {self.seq_length}, attention {self.attn_impl}"
        )


def _count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


# ---------------------------------------------------------------------------------------------
def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        return f"unknown field '{loc}'"
    if first.get("type") == "missing":
        return f"missing required field '{loc}'"
    return f"field '{loc}': {msg}" if loc else msg


def model_from_dict(data: dict[str, Any], source: str) -> ModelSpec:
    """Build a spec from a mapping in autopar's format or a Hugging Face config, with one-line errors."""
    if not isinstance(data, dict):
        raise AutoparError(f"model spec {source}: expected a mapping of fields, got {type(data).__name__}")
    if _looks_like_hf(data):
        data = hf_to_spec(data, source)
    data = dict(data)
    data.setdefault("name", Path(source).stem if source else "model")
    unknown = [k for k in data if k not in ModelSpec.model_fields]
    if unknown:
        hint = did_you_mean(unknown[0], ModelSpec.model_fields)
        raise AutoparError(
            f"model spec {source}: unknown field '{unknown[0]}'{hint}; "
            f"allowed fields: {', '.join(ModelSpec.model_fields)}"
        )
    try:
        return ModelSpec(**data)
    except ValidationError as err:
        raise AutoparError(f"model spec {source}: {_one_line(err)}") from None


def _looks_like_hf(data: dict[str, Any]) -> bool:
    return "model_type" in data or "num_hidden_layers" in data or "n_layer" in data


_LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "internlm2", "yi"}
_GPT2_LIKE = {"gpt2"}
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


_NULL_IS_DEFAULT = ("num_key_value_heads", "head_dim", "n_inner")  # Hugging Face writes null for "the default"


def _show(v: Any) -> str:
    """A config value as it is written in JSON (null, true, "x", Infinity)."""
    return json.dumps(v, default=str)


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer field of a Hugging Face config (64.0 accepted, 64.7 refused); ``default`` when absent."""
    v = cfg[key] if default is None or key in cfg else default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v) or v != int(v) or v <= 0:
        raise ValueError(f"{key} must be a positive integer, got {_show(v)}")
    return int(v)


def _float(cfg: dict[str, Any], key: str, default: float) -> float:
    """A finite number field of a Hugging Face config; ``default`` when absent."""
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
        raise ValueError(f"{key} must be a number, got {_show(v)}")
    return float(v)


def _finite(v: int | float) -> bool:
    """A JSON number that fits a float (json reads 400-digit integers as Python ints)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _bool(cfg: dict[str, Any], key: str, default: bool) -> bool:
    """A true/false field of a Hugging Face config; ``default`` when absent."""
    v = cfg.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be true or false, got {_show(v)}")
    return v


def hf_to_spec(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Translate a Hugging Face config.json (Llama/Mistral/Qwen2-style or GPT-2-style) to spec fields."""
    mtype = str(cfg.get("model_type", "")).lower()
    name = cfg.get("_name_or_path") or (Path(source).parent.name if source else "") or mtype or "hf-model"
    if any(cfg.get(k) for k in _MOE_KEYS):
        raise AutoparError(f"Hugging Face config {source}: model_type '{mtype}' is a mixture-of-experts model; "
                           "autopar plans dense transformers only")
    gpt2_keys = "n_embd" in cfg
    if mtype and mtype not in _LLAMA_LIKE | _GPT2_LIKE and not gpt2_keys:
        raise AutoparError(
            f"Hugging Face config {source}: model_type '{mtype}' is not supported; autopar reads "
            f"Llama-style ({', '.join(sorted(_LLAMA_LIKE))}) and GPT-2-style configs, or write an autopar spec")
    cfg = {k: v for k, v in cfg.items() if not (v is None and k in _NULL_IS_DEFAULT)}
    try:
        if mtype in ("gpt2", "gpt_neo", "gptj") or "n_embd" in cfg:
            h = _int(cfg, "n_embd")
            return {
                "name": str(name),
                "arch": "gpt",
                "num_layers": _int(cfg, "n_layer"),
                "hidden_size": h,
                "num_attention_heads": _int(cfg, "n_head"),
                "ffn_hidden_size": _int(cfg, "n_inner", 4 * h),
                "vocab_size": _int(cfg, "vocab_size"),
                "seq_length": _int(cfg, "n_positions") if "n_positions" in cfg else _int(cfg, "n_ctx", 1024),
                "tie_embeddings": _bool(cfg, "tie_word_embeddings", True),
                "dropout": _float(cfg, "resid_pdrop", 0.1),
                "norm_eps": _float(cfg, "layer_norm_epsilon", 1e-5),
            }
        heads = _int(cfg, "num_attention_heads")
        out: dict[str, Any] = {
            "name": str(name),
            "arch": "llama",
            "num_layers": _int(cfg, "num_hidden_layers"),
            "hidden_size": _int(cfg, "hidden_size"),
            "num_attention_heads": heads,
            "num_kv_heads": _int(cfg, "num_key_value_heads", heads),
            "ffn_hidden_size": _int(cfg, "intermediate_size"),
            "vocab_size": _int(cfg, "vocab_size"),
            "seq_length": min(_int(cfg, "max_position_embeddings", 4096), 8192),
            "tie_embeddings": _bool(cfg, "tie_word_embeddings", False),
            "norm_eps": _float(cfg, "rms_norm_eps", 1e-5),
            "rope_theta": _float(cfg, "rope_theta", 10000.0),
            "qkv_bias": _bool(cfg, "attention_bias", mtype == "qwen2"),
        }
        if "head_dim" in cfg:
            out["head_dim"] = _int(cfg, "head_dim")
        return out
    except KeyError as err:
        raise AutoparError(
            f"Hugging Face config {source}: missing field {err}; expected a Llama/Mistral/Qwen2-style "
            "(hidden_size, num_hidden_layers, intermediate_size, ...) or GPT-2-style (n_embd, n_layer, ...) config"
        ) from None
    except ValueError as err:
        raise AutoparError(f"Hugging Face config {source}: {err}; fix that field") from None


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def read_mapping(path: Path, what: str) -> dict[str, Any]:
    """Read a YAML or JSON file into a mapping, with a one-line error for every way it can be wrong."""
    try:
        text = path.read_text()
    except OSError as err:
        raise AutoparError(f"cannot read {what} {path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise AutoparError(f"{what} {path} is not a text file (not UTF-8); give a YAML or JSON file") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else (
            f" at line {err.lineno}" if isinstance(err, json.JSONDecodeError) else "")
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise AutoparError(f"{what} {path} is not valid {kind}{where}; fix the syntax") from None
    if not isinstance(data, dict):
        raise AutoparError(f"{what} {path} must hold a mapping of fields, not {type(data).__name__}")
    return data


def load_model(ref: str, seq: int | None = None) -> ModelSpec:
    """Resolve a model reference: preset name, spec/config file path, or ``pkg.module:factory``."""
    path = Path(ref)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if not path.exists():
            raise AutoparError(
                f"model file {ref} does not exist; give a preset ({', '.join(list_presets())}) or a path")
        spec = model_from_dict(read_mapping(path, "model spec"), str(path))
    elif (PRESET_DIR / f"{ref}.yaml").exists():
        spec = model_from_dict(read_mapping(PRESET_DIR / f"{ref}.yaml", "preset"), ref)
    elif ":" in ref:
        from planner.trace import model_from_module  # imports torch: only on this path

        spec = model_from_module(ref, seq)
    else:
        raise AutoparError(
            f"unknown model '{ref}'{did_you_mean(ref, list_presets())}; use a preset "
            f"({', '.join(list_presets())}), a YAML/JSON spec, a Hugging Face config.json or pkg.module:factory"
        )
    problem = None if seq is None else size_problem("--seq", seq, LIMITS["seq_length"])
    if problem:
        raise AutoparError(problem)
    return spec.with_seq(seq)
