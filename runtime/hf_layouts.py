"""Which Hugging Face tensors each autopar parameter is made of, and the ``config.json`` that describes them, for the
families whose weights mean what autopar's blocks compute: the Llama family (Llama, Mistral, Qwen2; Mixtral's
mixture of experts) and GPT-2.

autopar fuses q/k/v into ``attn.qkv`` and gate/up into ``mlp.gate_up`` (rows in that order), and stacks a MoE
layer's experts (``mlp.experts.gate_up`` [E, 2f, h]: each expert's w1 then w3; ``mlp.experts.down`` [E, h, f]: its
w2). GPT-2 fuses q/k/v as autopar does, but its projections are ``Conv1D`` layers that store each weight as
[in, out], the transpose of autopar's (and torch's) [out, in]. The rest is a renaming.
"""

from __future__ import annotations

from pathlib import Path

from specs.errors import AutoparError
from specs.hf_config import GPT2_TANH_GELU, gpt2_scales_otherwise
from specs.model import TOKEN_ID_NAMES, ModelSpec

_LAYER = {  # autopar name in layer i -> Hugging Face name(s) in model.layers.i (several: fused, in row order)
    "attn_norm.weight": ("input_layernorm.weight",),
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "attn.proj.weight": ("self_attn.o_proj.weight",),
    "mlp_norm.weight": ("post_attention_layernorm.weight",),
    "mlp.gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.down.weight": ("mlp.down_proj.weight",),
}
_MOE = "block_sparse_moe"  # Mixtral's MoE layer
_ENDS = {"embed.tok.weight": "model.embed_tokens.weight", "head.norm.weight": "model.norm.weight",
         "head.out.weight": "lm_head.weight"}
_GPT2_LAYER = {  # autopar name in layer i -> GPT-2's in transformer.h.i (every projection a Conv1D: transposed)
    "attn_norm": "ln_1", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp_norm": "ln_2",
    "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj",
}
_GPT2_ENDS = {"embed.tok.weight": "transformer.wte.weight", "embed.pos.weight": "transformer.wpe.weight",
              "head.norm.weight": "transformer.ln_f.weight", "head.norm.bias": "transformer.ln_f.bias",
              "head.out.weight": "lm_head.weight"}
GPT2_PREFIX = "transformer."  # GPT2LMHeadModel's; the original GPT-2 files (GPT2Model's) name its tensors without it
# the model_types whose weights mean what autopar's blocks compute (others, e.g. Gemma's (1 + w) norms and GeLU MLP,
# or Phi-3's fused projections, are planned from their config but not imported)
IMPORTS = ("llama", "mistral", "mixtral", "qwen2", "gpt2")
# buffers some files carry beside the weights: RoPE's frequencies, GPT-2's causal mask (older transformers)
_BUFFERS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def names(spec: ModelSpec) -> dict[str, tuple[str, ...]]:
    """Every autopar parameter of the model with the Hugging Face tensors it is made of (one-line refusal for a model
    no supported family holds)."""
    return _gpt2_names(spec) if spec.arch == "gpt" else _llama_names(spec)


def _llama_names(spec: ModelSpec) -> dict[str, tuple[str, ...]]:
    if spec.rope_dims != spec.hd:
        raise AutoparError(f"model {spec.name} rotates {spec.rope_dims} of each head's {spec.hd} dimensions "
                           "(rotary_fraction): Hugging Face's Llama, Mistral, Qwen2 and Mixtral rotate all of them, so "
                           "these weights have no Hugging Face counterpart autopar can read or write")
    moe = spec.moe
    if moe is not None and not mixtral_like(spec):
        raise AutoparError(f"model {spec.name} is a mixture of experts other than Mixtral's (every layer MoE, softmax "
                           "top-k renormalised, no shared experts, no QKV biases): Hugging Face weights are supported "
                           "for Mixtral's layout")
    out: dict[str, tuple[str, ...]] = {"embed.tok.weight": (_ENDS["embed.tok.weight"],)}
    for i in range(spec.num_layers):
        for ours, theirs in _LAYER.items():
            if ours == "attn.qkv.bias" and not spec.qkv_bias or moe is not None and ours.startswith("mlp."):
                continue
            out[f"layers.{i}.{ours}"] = tuple(f"model.layers.{i}.{t}" for t in theirs)
        if moe is not None:
            experts = range(moe.num_experts)
            out[f"layers.{i}.mlp.router.weight"] = (f"model.layers.{i}.{_MOE}.gate.weight",)
            out[f"layers.{i}.mlp.experts.gate_up"] = tuple(f"model.layers.{i}.{_MOE}.experts.{e}.{w}.weight"
                                                           for e in experts for w in ("w1", "w3"))
            out[f"layers.{i}.mlp.experts.down"] = tuple(f"model.layers.{i}.{_MOE}.experts.{e}.w2.weight"
                                                        for e in experts)
    out["head.norm.weight"] = (_ENDS["head.norm.weight"],)
    if not spec.tie_embeddings:
        out["head.out.weight"] = (_ENDS["head.out.weight"],)
    return out


def _gpt2_problem(spec: ModelSpec) -> str | None:
    """What keeps a GPT spec from being GPT-2's block, or None."""
    if not spec.learned_positions:
        return "rotates its positions (rotary_fraction), where GPT-2 learns them"
    if spec.act != "gelu" or not spec.has_bias:
        return f"has a {spec.act} MLP{'' if spec.has_bias else ' and no biases'}, where GPT-2's is GeLU with biases"
    if spec.kv_heads != spec.num_attention_heads or spec.hd * spec.num_attention_heads != spec.hidden_size:
        return "has grouped key/value heads or a head_dim other than hidden_size / heads, which GPT-2 cannot"
    if spec.moe is not None:
        return "is a mixture of experts"
    return None


def _gpt2_names(spec: ModelSpec) -> dict[str, tuple[str, ...]]:
    problem = _gpt2_problem(spec)
    if problem:
        raise AutoparError(f"model {spec.name} (arch gpt) {problem}: Hugging Face weights are supported for GPT-2's "
                           "block and the Llama family (Llama, Mistral, Qwen2, Mixtral)")
    ends = dict(_GPT2_ENDS)
    if spec.tie_embeddings:
        del ends["head.out.weight"]
    out = {k: (v,) for k, v in ends.items() if not k.startswith("head.")}
    for i in range(spec.num_layers):
        for ours, theirs in _GPT2_LAYER.items():
            for kind in ("weight", "bias"):
                out[f"layers.{i}.{ours}.{kind}"] = (f"transformer.h.{i}.{theirs}.{kind}",)
    return {**out, **{k: (v,) for k, v in ends.items() if k.startswith("head.")}}


def transposed(spec: ModelSpec, ours: str) -> bool:
    """Whether the Hugging Face tensor of parameter ``ours`` is stored transposed (GPT-2's Conv1D projections)."""
    return spec.arch == "gpt" and ours.startswith("layers.") and ours.endswith(".weight") and "norm" not in ours


def is_buffer(name: str) -> bool:
    """A tensor some Hugging Face files carry that is not a weight (read past, never written)."""
    return name.endswith(_BUFFERS)


def mixtral_like(spec: ModelSpec) -> bool:
    m = spec.moe
    return m is not None and (m.layer_freq, m.first_dense_layers, m.num_shared_experts, m.router, m.norm_topk_prob,
                              spec.qkv_bias) == (1, 0, 0, "softmax", True, False)


def rows(spec: ModelSpec, ours: str) -> tuple[int, ...]:
    """The rows of each Hugging Face tensor a fused or stacked parameter is made of (stacked: its leading dims
    merged), in order."""
    if "qkv" in ours:
        return (spec.q_width, spec.kv_width, spec.kv_width)
    if ours.endswith("experts.gate_up"):
        return (spec.moe.moe_ffn_hidden_size,) * (2 * spec.moe.num_experts)  # type: ignore[union-attr]
    if ours.endswith("experts.down"):
        return (spec.hidden_size,) * spec.moe.num_experts  # type: ignore[union-attr]
    return (spec.ffn, spec.ffn)


def stacked(ours: str) -> bool:
    return ours.endswith(("experts.gate_up", "experts.down"))


def part_shapes(spec: ModelSpec, ours: str, parts: int, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shape of each of the ``parts`` Hugging Face tensors parameter ``ours`` (of ``shape``) is made of."""
    if parts == 1:
        return [shape[::-1] if transposed(spec, ours) else shape]
    rest = shape[2:] if stacked(ours) else shape[1:]
    return [(n, *rest) for n in rows(spec, ours)]


def check_importable(cfg: Path, raw: dict[str, object]) -> None:
    """Refuse, before any weight is read, a config whose weights autopar's blocks would compute otherwise."""
    mtype = raw.get("model_type")
    if mtype not in IMPORTS:
        what = f"model_type '{mtype}'" if mtype else "no model_type"
        raise AutoparError(f"{cfg} has {what}: import-hf reads {', '.join(IMPORTS)} weights only (those autopar's "
                           "blocks compute as transformers does); plan the model from its config and train it from "
                           "autopar's initialisation instead")
    if mtype == "gpt2":
        act = raw.get("activation_function", "gelu_new")
        if act not in GPT2_TANH_GELU:
            raise AutoparError(f"{cfg} has activation_function '{act}': autopar's GPT MLP computes GeLU's tanh "
                               f"approximation ({', '.join(GPT2_TANH_GELU)}), so import-hf cannot read these weights")
        if gpt2_scales_otherwise(raw):
            raise AutoparError(f"{cfg} scales attention other than by 1/sqrt(head dim) (scale_attn_weights, "
                               "scale_attn_by_inverse_layer_idx): autopar's attention cannot compute these weights")
        return
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise AutoparError(f"{cfg} has hidden_act '{act}': autopar's Llama blocks compute SwiGLU (silu) MLPs only, "
                           "so import-hf cannot read these weights")


def hf_config(spec: ModelSpec) -> dict[str, object]:
    """A ``config.json`` for the model: GPT-2 for a GPT, Mixtral when it has MoE layers, Qwen2 when it has QKV
    biases, else Llama (or Mistral, with a sliding window)."""
    if spec.arch == "gpt":
        return _gpt2_config(spec)
    qwen = spec.qkv_bias
    if spec.moe is not None:
        moe = spec.moe
        return {**hf_config(spec.model_copy(update={"moe": None, "ffn_hidden_size": moe.moe_ffn_hidden_size})),
                "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
                "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": False}
    window = {"sliding_window": spec.sliding_window, **({"use_sliding_window": True} if qwen else {})} if (
        spec.sliding_window is not None) else {}
    mistral = bool(window) and not qwen  # Llama's config has no sliding window; Mistral's (the same blocks) has
    return {
        "architectures": ["Qwen2ForCausalLM" if qwen else "MistralForCausalLM" if mistral else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "mistral" if mistral else "llama", **window,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.kv_heads, "head_dim": spec.hd,
        "vocab_size": spec.vocab_size, "max_position_embeddings": max(spec.context_length or 0, spec.seq_length),
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta, "tie_word_embeddings": spec.tie_embeddings, "hidden_act": "silu",
        "torch_dtype": "float32", **({} if qwen else {"attention_bias": False, "mlp_bias": False}),
        **({} if spec.rope_scaling is None else {"rope_scaling": _rope_scaling(spec)}),
        **token_ids(spec),
    }


def _gpt2_config(spec: ModelSpec) -> dict[str, object]:
    names(spec)  # refuses a GPT that is not GPT-2's block
    p = spec.dropout_p
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "n_embd": spec.hidden_size, "n_layer": spec.num_layers, "n_head": spec.num_attention_heads,
        "n_inner": spec.ffn, "vocab_size": spec.vocab_size, "n_positions": spec.position_rows,
        "layer_norm_epsilon": spec.norm_eps, "activation_function": "gelu_new",
        "resid_pdrop": p, "embd_pdrop": p, "attn_pdrop": p, "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": "float32", **token_ids(spec),
    }


def token_ids(spec: ModelSpec) -> dict[str, object]:
    """The special tokens' ids as a config writes them: those the model's Hugging Face config declared, the others
    null (left out, transformers would assume Llama 2's 1 and 2, which a model trained on other tokens lacks)."""
    known = spec.token_ids or {}
    return {key: known.get(key) for key in TOKEN_ID_NAMES}


def _rope_scaling(spec: ModelSpec) -> dict[str, object]:
    """The model's RoPE scaling as transformers writes it (``rope_type`` and its fields)."""
    sc = spec.rope_scaling.model_dump(exclude_none=True)  # type: ignore[union-attr]
    return {"rope_type": sc.pop("type"), **sc}
