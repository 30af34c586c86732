"""Hugging Face ``config.json`` files (Llama/Mistral/Qwen2-style and GPT-2-style) as autopar spec fields."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from specs.errors import AutoparError
from specs.model import ROPE_FIELDS, ROPE_SCALINGS, TOKEN_ID_NAMES, ModelSpec, past_vocab

_LLAMA_LIKE = {"llama", "mistral", "qwen2", "qwen3", "gemma", "internlm2", "yi", "phi3", "mixtral", "qwen2_moe",
               "qwen3_moe", "olmoe"}  # phi3: fused qkv and
# gate|up projections, the same shapes and counts
_TIED_BY_DEFAULT = {"gemma"}  # tie_word_embeddings when the config leaves it out
# rms_norm_eps when the config leaves it out: transformers' default of each config class (1e-6 for the others)
_RMS_EPS_DEFAULT = {"phi3": 1e-5, "mixtral": 1e-5, "olmoe": 1e-5}
# num_key_value_heads when the config leaves it out: transformers' default of each config class (the others', and a
# null one's, is num_attention_heads)
_KV_HEADS_DEFAULT = {"mistral": 8, "mixtral": 8, "qwen2": 32, "qwen3": 32, "gemma": 16, "qwen2_moe": 16, "qwen3_moe": 4}
# fields that change what a layer computes in ways the cost model does not price
_UNPRICED = {"attn_logit_softcapping": "soft-capped attention scores",
             "final_logit_softcapping": "soft-capped output logits",
             "sliding_window_pattern": "alternating local and global attention layers",
             "layer_types": "layers of different attention kinds"}
_GPT2_LIKE = {"gpt2", "gptj"}  # gptj: rotary, no learned positions


_CAUSAL_LM = ("ForCausalLM", "LMHeadModel")  # how a causal language model's architectures name ends


def _not_causal_lm(cfg: dict[str, Any]) -> str | None:
    """The first of a config's ``architectures`` that is not a causal language model (a reward model's
    ...ForSequenceClassification, an embedding model's bare ...Model: no vocabulary head), or None."""
    names = cfg.get("architectures")
    names = [] if names is None else names if isinstance(names, list) else [names]
    return next((str(n) for n in names if not str(n).endswith(_CAUSAL_LM)), None)


def _model_type(cfg: dict[str, Any]) -> str:
    """A config's model_type in lower case, "" where it gives none (or null)."""
    return "" if cfg.get("model_type") is None else str(cfg["model_type"]).lower()


SEQ_CAP = 8192  # the sequence planned by default: the config's context (4096 when it gives none), at most this


def _sequence(cfg: dict[str, Any], window: int | None = None) -> dict[str, Any]:
    """The sequence planned by default (the context the config declares, up to :data:`SEQ_CAP` and the attention
    window) and that context, kept for export-hf to write back."""
    out: dict[str, Any] = {"seq_length": min(_int(cfg, "max_position_embeddings", 4096), SEQ_CAP, window or SEQ_CAP)}
    if "max_position_embeddings" in cfg:
        out["context_length"] = _int(cfg, "max_position_embeddings")
    return out


def _rope_theta(cfg: dict[str, Any]) -> float:
    """The config's RoPE base, or transformers' default where it gives none (the model spec's default too)."""
    return _float(cfg, "rope_theta", ModelSpec.model_fields["rope_theta"].default)


def _window(cfg: dict[str, Any], mtype: str) -> int | None:
    """The sliding attention window a config's layers use (Mistral 7B v0.1, Phi-3 mini), or None: Qwen's configs
    carry a ``sliding_window`` that applies only with ``use_sliding_window``."""
    if cfg.get("sliding_window") is None or (mtype.startswith("qwen") and not _bool(cfg, "use_sliding_window", False)):
        return None
    return _int(cfg, "sliding_window")


def _one_attention_kind(key: str, cfg: dict[str, Any], mtype: str) -> bool:
    """``layer_types`` naming one kind for every layer: full attention (what transformers 5 writes for plain Qwen2 and
    Llama configs), or sliding attention where the config's window applies (:func:`_window`; planned at the window,
    as the config without layer_types is): a plain model after all."""
    if key != "layer_types" or not isinstance(cfg[key], list):
        return False
    value = cfg[key]
    if all(v == "full_attention" for v in value):
        return True
    try:
        return all(v == "sliding_attention" for v in value) and _window(cfg, mtype) is not None
    except ValueError:  # a bad window: reading the config says what is wrong
        return True


_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# the mixture-of-experts configs read: the key each gives a field of the moe: section in (read by _moe_fields, named
# in errors by in_config_terms); Mixtral renormalises the top-k weights always (the spec's default), Qwen puts a MoE
# layer every decoder_sparse_step-th layer and may add a shared expert
_OLMOE_KEYS = {"num_experts": "num_experts", "experts_per_token": "num_experts_per_tok",
               "moe_ffn_hidden_size": "intermediate_size", "norm_topk_prob": "norm_topk_prob",
               "aux_loss_coef": "router_aux_loss_coef"}
_QWEN_MOE_KEYS = {**_OLMOE_KEYS, "moe_ffn_hidden_size": "moe_intermediate_size", "layer_freq": "decoder_sparse_step",
                  "shared_ffn_hidden_size": "shared_expert_intermediate_size"}
_MOE_FIELD_KEYS = {"mixtral": {"num_experts": "num_local_experts", "experts_per_token": "num_experts_per_tok",
                               "moe_ffn_hidden_size": "intermediate_size", "aux_loss_coef": "router_aux_loss_coef"},
                   "olmoe": _OLMOE_KEYS, "qwen2_moe": _QWEN_MOE_KEYS, "qwen3_moe": _QWEN_MOE_KEYS}
_MOE_TYPES = set(_MOE_FIELD_KEYS)
# MoE fields of those configs that change what is computed in ways not modelled: what each is, and how to go on (what
# an autopar spec's moe: section, specs/moe.py, can say of it)
_MOE_UNPRICED = {
    "mlp_only_layers": ("dense layers at chosen positions", "an autopar spec's moe: section places dense layers in a "
                        "regular pattern only (first_dense_layers of them, then a MoE layer every layer_freq-th); "
                        "write one where these positions follow such a pattern"),
    "kv_lora_rank": ("multi-head latent attention", "no autopar spec expresses it either (autopar's attention is "
                     "multi-head or grouped-query), so autopar cannot plan this model"),
    "topk_method": ("group-limited expert routing", "an autopar spec's moe: section routes to the top "
                    "experts_per_token of all experts only; write one to plan it with that routing instead")}


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


def _positive(cfg: dict[str, Any], key: str, default: float) -> float:
    """A positive number field of a Hugging Face config; ``default`` when absent."""
    v = _float(cfg, key, default)
    if v <= 0:
        raise ValueError(f"{key} must be a positive number, got {_show(cfg[key])}")
    return v


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


def _nemotron(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    """NVIDIA's Nemotron (model_type nemotron): a GPT block (LayerNorm, non-gated MLP) with squared ReLU, no linear
    biases, RoPE on ``partial_rotary_factor`` of each head and fused (flash) attention, as NeMo trains it (its
    LayerNorm's zero-centred scale is the same cost)."""
    if cfg.get("hidden_act", "relu2") != "relu2":
        raise ValueError(f"hidden_act must be relu2 in a nemotron config, got {_show(cfg['hidden_act'])}")
    bias = _bool(cfg, "attention_bias", False)
    if _bool(cfg, "mlp_bias", False) != bias:
        raise ValueError("attention_bias and mlp_bias differ; autopar's GPT block has biases on every projection or on "
                         "none")
    heads = _int(cfg, "num_attention_heads")
    out: dict[str, Any] = {
        "name": name, "arch": "gpt", "activation": "squared_relu", "linear_bias": bias, "attention": "flash",
        "num_layers": _int(cfg, "num_hidden_layers"), "hidden_size": _int(cfg, "hidden_size"),
        "num_attention_heads": heads, "num_kv_heads": _int(cfg, "num_key_value_heads", heads),
        "ffn_hidden_size": _int(cfg, "intermediate_size"), "vocab_size": _int(cfg, "vocab_size"),
        **_sequence(cfg),
        "tie_embeddings": _bool(cfg, "tie_word_embeddings", False), "dropout": 0.0,
        "norm_eps": _float(cfg, "norm_eps", 1e-5), "rope_theta": _rope_theta(cfg),
        "rotary_fraction": _float(cfg, "partial_rotary_factor", 0.5),
    }
    if "head_dim" in cfg:
        out["head_dim"] = _int(cfg, "head_dim")
    scaling = _rope_scaling(cfg)
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


def _rope_key(cfg: dict[str, Any]) -> str:
    """Where a config keeps its RoPE scaling: ``rope_scaling``, or (where that is absent or null) transformers 5's
    ``rope_parameters``."""
    return "rope_parameters" if cfg.get("rope_scaling") is None and "rope_parameters" in cfg else "rope_scaling"


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """A config's RoPE scaling as the spec's ``rope_scaling`` (:func:`_rope_key`; ``type`` in older configs), or None
    for plain RoPE."""
    where = _rope_key(cfg)
    rope = cfg.get(where)
    if rope is None:
        return None
    if not isinstance(rope, dict):
        raise ValueError(f"{where} must be a mapping, got {_show(rope)}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    # Phi-3 writes original_max_position_embeddings beside rope_scaling (and it wins there, as in transformers);
    # llama3 without it takes max_position_embeddings
    original = cfg.get("original_max_position_embeddings", rope.get("original_max_position_embeddings"))
    if original is None and kind == "llama3":
        original = cfg.get("max_position_embeddings")
    named = {f"{where}.{k}": v for k, v in {**rope, "original_max_position_embeddings": original}.items()
             if v is not None}
    out: dict[str, Any] = {"type": str(kind)}
    # a type autopar computes: its fields only, and the context it was trained at
    for key in dict.fromkeys((*ROPE_SCALINGS.get(str(kind), ROPE_FIELDS), "original_max_position_embeddings")):
        if f"{where}.{key}" in named:
            read = _int if key.startswith("original") else _positive
            out[key] = read(named, f"{where}.{key}", 1)
    return out


_QK_NORM = {"qwen3": "each head's", "qwen3_moe": "each head's", "olmoe": "the whole projection's"}  # q/k RMSNorms
_DEFAULT_ACT = {"gemma": "gelu_pytorch_tanh"}  # the MLP activation where the config names none (else silu)


def hf_notes(cfg: dict[str, Any]) -> list[str]:
    """What of a config autopar does not keep: what its blocks do not compute (:func:`_block_notes`) and special
    tokens' ids past the vocabulary (transformers' GPT-2 config keeps 50256 whatever its vocab_size)."""
    past = past_vocab(_token_ids(cfg), cfg.get("vocab_size"))  # (ModelSpec leaves them out)
    return _block_notes(cfg) + ([f"{past}: past the vocabulary of {cfg.get('vocab_size')} tokens, not kept (export-hf "
                                 "writes the ids it has)"] if past else [])


def _block_notes(cfg: dict[str, Any]) -> list[str]:
    """What of a config autopar's blocks do not compute (the spec has no field for it): a Llama-style MLP's
    activation other than silu, the MLP's biases, the attention output's bias (InternLM2's every attention bias), q/k
    norms, Gemma's norms and embedding scale, GPT-J's parallel residual. Each is priced as the block autopar computes
    (the same GEMMs) and trained as that block, so the command says so."""
    mtype = _model_type(cfg)
    if mtype == "gptj":
        return ["parallel residual (attention and MLP both read the block's input): priced as the same GEMMs; "
                "`autopar run` trains autopar's GPT block (attention, then the MLP) instead"]
    if "n_embd" in cfg or mtype in _GPT2_LIKE:
        return _gpt2_notes(cfg)
    if mtype == "nemotron":
        return []
    notes = []
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or _DEFAULT_ACT.get(mtype, "silu")
    if act not in ("silu", "swish"):
        notes.append(f"hidden_act {act}: priced as autopar's SwiGLU MLP (the same GEMMs); `autopar run` trains it "
                     "with silu, not this activation")
    if cfg.get("mlp_bias") is True:
        notes.append("mlp_bias: the MLP's biases are neither priced nor trained (autopar's Llama MLP has none)")
    if cfg.get("attention_bias") is True:
        notes.append("attention_bias: q, k and v keep their biases (qkv_bias); the output projection's bias is "
                     "neither priced nor trained")
    if mtype == "internlm2" and cfg.get("bias") is True:
        notes.append("bias: InternLM2's attention biases (wqkv and wo) are neither priced nor trained (autopar's Llama "
                     "attention has none)")
    if mtype in _QK_NORM:
        notes.append(f"q/k norms ({mtype}: an RMSNorm of {_QK_NORM[mtype]} queries and keys): neither priced nor "
                     "trained (autopar's Llama attention has none); export-hf writes the trained model as a Llama")
    try:
        window = _window(cfg, mtype)
        unbounded = _sequence(cfg)["seq_length"]  # the sequence planned by default without the window
    except ValueError:  # a bad field: reading the config says so
        window = None
    if window is not None and window < unbounded:
        notes.append(f"sliding_window {window}: planned at sequence {window} by default (autopar computes full "
                     f"attention, the same as the window's up to {window} tokens); --seq may be at most {window}")
    if mtype == "gemma":
        notes.append("gemma: RMSNorms scaling by 1 + weight and embeddings scaled by sqrt(hidden_size): priced the "
                     "same; `autopar run` trains autopar's Llama block, which export-hf writes as a Llama")
    return notes


GPT2_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # GeLU's tanh form: what autopar's GPT MLP computes


def gpt2_scales_otherwise(cfg: dict[str, Any]) -> bool:
    """Whether a GPT-2 config scales attention scores otherwise than by 1/sqrt(head dim) (autopar's only scaling)."""
    return cfg.get("scale_attn_weights") is False or bool(cfg.get("scale_attn_by_inverse_layer_idx"))


def _gpt2_notes(cfg: dict[str, Any]) -> list[str]:
    """What of a GPT-2 config autopar's GPT block does not compute: an activation other than GeLU's tanh form,
    attention scaled otherwise than by 1/sqrt(head dim)."""
    notes = []
    act = cfg.get("activation_function", "gelu_new")
    if act not in GPT2_TANH_GELU:
        notes.append(f"activation_function {act}: priced as autopar's GeLU MLP (the same GEMMs); `autopar run` trains "
                     "it with GeLU (tanh form), not this activation")
    if gpt2_scales_otherwise(cfg):
        notes.append("scale_attn_weights / scale_attn_by_inverse_layer_idx: priced the same; `autopar run` scales "
                     "attention scores by 1/sqrt(head dim) only")
    return notes


def hf_to_spec(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Translate a Hugging Face config.json (Llama/Mistral/Qwen2-style, GPT-2-style or Nemotron) to spec fields."""
    out = _spec_fields(cfg, source)
    ids = _token_ids(cfg)
    return {**out, "token_ids": ids} if ids else out


def _token_ids(cfg: dict[str, Any]) -> dict[str, Any]:
    """The special tokens' ids the config declares (kept for export-hf to write back): those that are ids, or lists
    of ids (an eos_token_id may list several); anything else (null, -1) is as good as absent (and ids past the
    vocabulary, which ModelSpec leaves out and :func:`hf_notes` names)."""
    def is_id(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    out = {}
    for key in TOKEN_ID_NAMES:
        v = cfg.get(key)
        if is_id(v) or isinstance(v, list) and v and all(is_id(x) for x in v):
            out[key] = v
    return out


def _spec_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """:func:`hf_to_spec` but the token ids."""
    mtype = _model_type(cfg)
    path = Path(os.path.abspath(source)) if source else Path()  # a model folder's config.json is named by its folder
    # (also given as ./config.json or .; a link keeps its own name), any other file by its own name
    file_name = path.parent.name if path.name == "config.json" else path.stem
    name = cfg.get("_name_or_path") or (file_name if source else "") or mtype or "hf-model"
    other = _not_causal_lm(cfg)
    if other:
        base = re.sub(r"(For[A-Z]\w*|Model)$", "", other)  # the family: Llama of LlamaForSequenceClassification
        head = "LMHeadModel" if mtype == "gpt2" else "ForCausalLM"  # (GPT-2's causal LM is GPT2LMHeadModel)
        causal = f'["{base}{head}"]' if base else f"a ...{head} class"
        raise AutoparError(f"Hugging Face config {source}: architectures names {other}, which is not a causal language "
                           "model; autopar plans causal language models, whose output head is the vocabulary; set "
                           f"architectures to {causal} to plan it as one")
    moe_unpriced = next((k for k in _MOE_UNPRICED if cfg.get(k)), None)  # (before the type: DeepSeek's MLA is why)
    if moe_unpriced:
        what, advice = _MOE_UNPRICED[moe_unpriced]
        raise AutoparError(f"Hugging Face config {source}: {moe_unpriced} ({what}) is not something autopar's cost "
                           f"model prices; {advice}")
    if any(cfg.get(k) for k in _MOE_KEYS) and mtype not in _MOE_TYPES:
        raise AutoparError(f"Hugging Face config {source}: model_type '{mtype}' is a mixture-of-experts model autopar "
                           f"does not read; it reads {', '.join(sorted(_MOE_TYPES))} configs, or write an autopar spec "
                           "with a moe: section")
    unpriced = next((k for k in _UNPRICED if cfg.get(k) is not None and not _one_attention_kind(k, cfg, mtype)), None)
    if unpriced:
        what = _UNPRICED[unpriced]
        if unpriced == "layer_types" and isinstance(cfg[unpriced], list) and \
                set(cfg[unpriced]) == {"sliding_attention"}:  # one kind, but no window the config applies
            what = "sliding attention in every layer, with no sliding_window the config applies"
        raise AutoparError(f"Hugging Face config {source}: {unpriced} ({what}) is not something autopar's cost model "
                           "prices; write an autopar spec to plan it as a plain model")
    if mtype and mtype not in _LLAMA_LIKE | _GPT2_LIKE | {"nemotron"}:  # n_embd alone does not make a GPT-2
        raise AutoparError(
            f"Hugging Face config {source}: model_type '{mtype}' is not supported; autopar reads "
            f"Llama-style ({', '.join(sorted(_LLAMA_LIKE))}), GPT-2-style ({', '.join(sorted(_GPT2_LIKE))}) and "
            "Nemotron configs, or write an autopar spec")
    kv_left_out = "num_key_value_heads" not in cfg  # (its default is not a null one's)
    cfg = {k: v for k, v in cfg.items() if not (v is None and k in _NULL_IS_DEFAULT)}
    rope = cfg.get("rope_parameters")  # transformers 5 writes rope_theta and partial_rotary_factor only in here
    if isinstance(rope, dict):
        cfg = {**{k: rope[k] for k in ("rope_theta", "partial_rotary_factor") if k in rope}, **cfg}
    try:
        if mtype in _GPT2_LIKE or not mtype and "n_embd" in cfg:
            h = _int(cfg, "n_embd")
            gptj = mtype == "gptj"  # RoPE on rotary_dim of each head's dimensions (transformers: 64 when left out,
            # the whole head when null), untied, no dropout by default; GPT-2 learns positions, tied, dropout 0.1
            heads = _int(cfg, "n_head")
            if h % heads:  # (the spec's own check would offer head_dim, which a GPT-2 config has not)
                raise AutoparError(f"Hugging Face config {source}: n_embd {h} is not divisible by n_head {heads}; fix "
                                   "one of them")
            hd = h // heads
            dims = (hd if cfg.get("rotary_dim", 64) is None else _int(cfg, "rotary_dim", min(64, hd))) if gptj else 0
            if gptj and not 0 < dims <= hd:
                raise ValueError(f"rotary_dim {dims} must be between 1 and the head dimension {hd} (n_embd / n_head)")
            positions = _int(cfg, "n_positions") if "n_positions" in cfg else _int(cfg, "n_ctx", 1024)
            return {
                "name": str(name),
                "arch": "gpt",
                "num_layers": _int(cfg, "n_layer"),
                "hidden_size": h,
                "num_attention_heads": heads,
                "ffn_hidden_size": _int(cfg, "n_inner", 4 * h),
                "vocab_size": _int(cfg, "vocab_size"),
                "seq_length": positions,
                "tie_embeddings": _bool(cfg, "tie_word_embeddings", not gptj),
                "dropout": _float(cfg, "resid_pdrop", 0.0 if gptj else 0.1),
                "norm_eps": _float(cfg, "layer_norm_epsilon", 1e-5),
                # GPT-J rotates rotary_dim of each head's dimensions and has no learned positions
                **({"rotary_fraction": dims / hd} if gptj else {"max_positions": positions}),  # learned: this many
            }
        if mtype == "nemotron":
            return _nemotron(cfg, str(name))
        heads = _int(cfg, "num_attention_heads")
        default_kv = _KV_HEADS_DEFAULT.get(mtype, heads) if kv_left_out else heads
        if heads % default_kv:
            raise ValueError(f"num_key_value_heads is left out, and {mtype}'s default in transformers, {default_kv}, "
                             f"does not divide num_attention_heads {heads}; write num_key_value_heads")
        window = _window(cfg, mtype)
        out: dict[str, Any] = {
            "name": str(name),
            "arch": "llama",
            "num_layers": _int(cfg, "num_hidden_layers"),
            "hidden_size": _int(cfg, "hidden_size"),
            "num_attention_heads": heads,
            "num_kv_heads": _int(cfg, "num_key_value_heads", default_kv),
            "ffn_hidden_size": _int(cfg, "intermediate_size"),
            "vocab_size": _int(cfg, "vocab_size"),
            **_sequence(cfg, window),
            "tie_embeddings": _bool(cfg, "tie_word_embeddings", mtype in _TIED_BY_DEFAULT),
            "norm_eps": _float(cfg, "rms_norm_eps", _RMS_EPS_DEFAULT.get(mtype, 1e-6)),
            "rope_theta": _rope_theta(cfg),
            "qkv_bias": _bool(cfg, "attention_bias", mtype in ("qwen2", "qwen2_moe")),
        }
        if "head_dim" in cfg:
            out["head_dim"] = _int(cfg, "head_dim")
        if window is not None:
            out["sliding_window"] = window
        rotary = _float(cfg, "partial_rotary_factor", 1.0)
        if rotary != 1.0:
            out["rotary_fraction"] = rotary
        scaling = _rope_scaling(cfg)
        if scaling is not None:
            out["rope_scaling"] = scaling
        if mtype in _MOE_TYPES:
            out["moe"] = _moe_fields(cfg, mtype)
        return out
    except KeyError as err:
        raise AutoparError(
            f"Hugging Face config {source}: missing field {err}; expected a Llama/Mistral/Qwen2-style "
            "(hidden_size, num_hidden_layers, intermediate_size, ...) or GPT-2-style (n_embd, n_layer, ...) config"
        ) from None
    except ValueError as err:
        raise AutoparError(f"Hugging Face config {source}: {err}; fix that field") from None


def _moe_fields(cfg: dict[str, Any], mtype: str) -> dict[str, Any]:
    """The ``moe:`` section of a Mixtral, Qwen2-MoE, Qwen3-MoE (Qwen2-MoE's fields, without shared experts) or OLMoE
    config, read from its keys (:data:`_MOE_FIELD_KEYS`): every layer MoE unless Qwen's ``decoder_sparse_step`` says
    every k-th (layers k-1, 2k-1, ...)."""
    key = _MOE_FIELD_KEYS[mtype]
    out: dict[str, Any] = {
        "num_experts": _int(cfg, key["num_experts"]), "experts_per_token": _int(cfg, key["experts_per_token"]),
        "moe_ffn_hidden_size": _int(cfg, key["moe_ffn_hidden_size"]),
        "aux_loss_coef": _float(cfg, key["aux_loss_coef"], 0.01 if mtype == "olmoe" else 0.001)}
    if "norm_topk_prob" in key:
        out["norm_topk_prob"] = _bool(cfg, key["norm_topk_prob"], False)
    if "layer_freq" in key:
        step, layers = _int(cfg, key["layer_freq"], 1), _int(cfg, "num_hidden_layers")
        if step > layers:  # (the spec's first_dense_layers, step - 1, is no key of the config's to name)
            raise ValueError(f"{key['layer_freq']} {step} is more than num_hidden_layers {layers}, which leaves no "
                             f"MoE layer (every {key['layer_freq']}-th layer is one)")
        out.update(layer_freq=step, first_dense_layers=step - 1)
    shared = key.get("shared_ffn_hidden_size")
    if shared and cfg.get(shared):
        out.update(num_shared_experts=1, shared_ffn_hidden_size=_int(cfg, shared), shared_expert_gate=True)
    return out


_HF_NAMES = {"num_kv_heads": "num_key_value_heads", "num_layers": "num_hidden_layers",
             "ffn_hidden_size": "intermediate_size", "norm_eps": "rms_norm_eps"}  # spec field -> a Llama config's key
_GPT2_NAMES = {"hidden_size": "n_embd", "num_layers": "n_layer", "num_attention_heads": "n_head",
               "ffn_hidden_size": "n_inner", "norm_eps": "layer_norm_epsilon"}


def in_config_terms(message: str, cfg: dict[str, Any]) -> str:
    """A model spec's problem with a spec read from ``cfg`` (the spec's validation message, not the source's name or
    a hint) with the config's own key names (num_key_value_heads, not num_kv_heads) where the config holds that key,
    so that it names what to fix in the file."""
    mtype = _model_type(cfg)
    moe = _MOE_FIELD_KEYS.get(mtype, {})
    if moe:  # the config keeps the moe: section's fields at its top level: the section is no field of the file
        message = message.removeprefix("field 'moe': ")
    names = _GPT2_NAMES if "n_embd" in cfg else {**_HF_NAMES, **{f"moe.{ours}": theirs for ours, theirs in moe.items()},
                                                 "rope_scaling": _rope_key(cfg)}
    # the keys the config holds, and num_key_value_heads where its type's default stood in (the key to write)
    held = {*cfg, *(["num_key_value_heads"] if mtype in _KV_HEADS_DEFAULT else [])}
    names = {ours: theirs for ours, theirs in names.items() if theirs in held}
    if not names:
        return message
    return re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b", lambda m: names[m.group(1)], message)


def looks_like_hf(data: dict[str, Any]) -> bool:
    return "model_type" in data or "num_hidden_layers" in data or "n_layer" in data
