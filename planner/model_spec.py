"""Model specs: the transformer shapes autopar plans for.

A spec comes from a bundled preset name, a YAML/JSON file in autopar's own format, a Hugging Face
``config.json`` (Llama/Mistral/Qwen2-style or GPT-2-style), or a traced ``nn.Module`` (see ``trace.py``).
Everything user-facing raises :class:`AutoparError` with a one-line message.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from planner.errors import AutoparError, did_you_mean

PRESET_DIR = Path(__file__).parent / "presets"


class BlockCounts(BaseModel):
    """Per-layer counts of a traced custom model (one repeated block), used instead of the formulas."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    params: int
    fwd_flops_per_token: float  # matmul FLOPs per token in one block's forward, attention excluded
    attn_flops_per_token: float = 0.0  # attention-core FLOPs per token (scales with seq)
    act_bytes_per_token: float  # bytes saved for backward per token (16-bit activations)
    elementwise_bytes_per_token: float = 0.0  # bytes moved by non-matmul ops per token, forward


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

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        for field in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be a positive integer, got {getattr(self, field)}")
        if self.arch == "llama" and self.ffn_hidden_size is None:
            raise ValueError("ffn_hidden_size is required for arch 'llama' (SwiGLU width)")
        for field in ("ffn_hidden_size", "head_dim", "num_kv_heads"):
            v = getattr(self, field)
            if v is not None and v <= 0:
                raise ValueError(f"{field} must be a positive integer, got {v}")
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
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
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


def _int(cfg: dict[str, Any], key: str) -> int:
    """An integer field of a Hugging Face config (floats like 64.0 accepted, 64.7 refused)."""
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or float(v) != int(v) or v <= 0:
        raise ValueError(f"{key} must be a positive integer, got {v!r}")
    return int(v)


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
    try:
        if mtype in ("gpt2", "gpt_neo", "gptj") or "n_embd" in cfg:
            h = _int(cfg, "n_embd")
            inner = cfg.get("n_inner")
            seq = int(cfg.get("n_positions", cfg.get("n_ctx", 1024)))
            return {
                "name": str(name),
                "arch": "gpt",
                "num_layers": _int(cfg, "n_layer"),
                "hidden_size": h,
                "num_attention_heads": _int(cfg, "n_head"),
                "ffn_hidden_size": int(inner) if inner else 4 * h,
                "vocab_size": _int(cfg, "vocab_size"),
                "seq_length": seq,
                "tie_embeddings": bool(cfg.get("tie_word_embeddings", True)),
                "dropout": float(cfg.get("resid_pdrop", 0.1)),
                "norm_eps": float(cfg.get("layer_norm_epsilon", 1e-5)),
            }
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        out: dict[str, Any] = {
            "name": str(name),
            "arch": "llama",
            "num_layers": _int(cfg, "num_hidden_layers"),
            "hidden_size": _int(cfg, "hidden_size"),
            "num_attention_heads": _int(cfg, "num_attention_heads"),
            "num_kv_heads": int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            "ffn_hidden_size": _int(cfg, "intermediate_size"),
            "vocab_size": _int(cfg, "vocab_size"),
            "seq_length": min(max_pos, 8192),
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "norm_eps": float(cfg.get("rms_norm_eps", 1e-5)),
            "rope_theta": float(cfg.get("rope_theta", 10000.0)),
            "qkv_bias": bool(cfg.get("attention_bias", mtype == "qwen2")),
        }
        if cfg.get("head_dim"):
            out["head_dim"] = int(cfg["head_dim"])
        return out
    except KeyError as err:
        raise AutoparError(
            f"Hugging Face config {source}: missing field {err}; expected a Llama/Mistral/Qwen2-style "
            "(hidden_size, num_hidden_layers, intermediate_size, ...) or GPT-2-style (n_embd, n_layer, ...) config"
        ) from None
    except (TypeError, ValueError) as err:
        raise AutoparError(f"Hugging Face config {source}: bad value ({err})") from None


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
    if seq is not None and seq <= 0:
        raise AutoparError(f"--seq must be a positive integer, got {seq}")
    return spec.with_seq(seq)
