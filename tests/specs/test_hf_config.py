"""Hugging Face configs read as model specs (specs/hf_config.py): the model's name, learned positions' bound on the
sequence, RoPE scaling."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from planner.cli import main
from specs.capabilities import model_problem
from specs.errors import AutoparError
from specs.model import ModelSpec
from specs.model_loading import load_model

LLAMA = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
         "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256, "head_dim": 64,
         "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True}
LLAMA3_SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}  # Llama 3.2 1B's
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}


def test_a_config_file_is_named_by_its_own_name(tmp_path, monkeypatch):
    """config.json (or its folder) takes the folder's name, any other file its own."""
    (tmp_path / "hf").mkdir()
    for name in ("config.json", "qwen2.json"):
        (tmp_path / "hf" / name).write_text(json.dumps({**LLAMA, "model_type": "qwen2"}))
    assert load_model(str(tmp_path / "hf" / "qwen2.json")).name == "qwen2"
    assert load_model(str(tmp_path / "hf" / "config.json")).name == "hf"
    assert load_model(str(tmp_path / "hf")).name == "hf"
    monkeypatch.chdir(tmp_path / "hf")  # given from inside its folder (the README's ./config.json): still the folder's
    assert load_model("./config.json").name == load_model(".").name == load_model("config.json").name == "hf"
    (tmp_path / "linked").symlink_to(tmp_path / "hf")  # a link (a hub cache's snapshot) keeps its own name
    assert load_model(str(tmp_path / "linked" / "config.json")).name == "linked"
    (tmp_path / "hf" / "qwen2.json").write_text(json.dumps({**LLAMA, "_name_or_path": "Qwen/Qwen2-0.5B"}))
    assert load_model(str(tmp_path / "hf" / "qwen2.json")).name == "Qwen/Qwen2-0.5B"  # the config's own name wins


def test_learned_positions_bound_the_sequence(tmp_path, capsys):
    """A GPT-2 config's weights hold n_positions positions (its table, whatever the sequence): a longer --seq is one
    line, as a sliding window's is; a preset is a shape, and its table grows with the sequence."""
    p = tmp_path / "config.json"
    p.write_text(json.dumps(GPT2))
    m = load_model(str(p))
    assert (m.seq_length, m.max_positions) == (1024, 1024)
    assert load_model(str(p), seq=512).position_params == 1024 * 768  # the whole table, whatever the sequence
    assert load_model("tiny-gpt", seq=512).position_params == 512 * load_model("tiny-gpt").hidden_size
    with pytest.raises(AutoparError, match="2048 is beyond .*'s 1024 learned positions .*--seq 1024"):
        load_model(str(p), seq=2048)
    assert main(["plan", "--model", str(p), "--cluster", "dgx-a100", "--gpus", "8", "--global-batch", "8",
                 "--seq", "2048"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1024 learned positions" in err, err
    assert load_model("tiny-gpt", seq=8192).seq_length == 8192  # a preset grows
    p.write_text(json.dumps({**GPT2, "model_type": "gptj", "rotary_dim": 32}))  # RoPE: no table to outgrow
    assert load_model(str(p), seq=4096).max_positions is None
    with pytest.raises(ValidationError, match="max_positions bounds learned positions"):
        ModelSpec(**{**load_model("tiny").model_dump(), "max_positions": 64})


@pytest.mark.parametrize("where", ["rope_scaling", "rope_parameters", "old type key"])
def test_rope_scaling_is_read_wherever_transformers_writes_it(tmp_path, where):
    scaling = {"rope_type": "llama3", **LLAMA3_SCALING}
    cfg = {"rope_scaling": {**LLAMA, "rope_scaling": scaling},
           "rope_parameters": {**LLAMA, "rope_scaling": None, "rope_parameters": {**scaling, "rope_theta": 5e5}},
           "old type key": {**LLAMA, "rope_scaling": {"type": "llama3", **LLAMA3_SCALING}}}[where]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = load_model(str(p))
    assert m.rope_scaling.model_dump() == {"type": "llama3", **LLAMA3_SCALING}
    assert m.rope_theta == 5e5 and model_problem(m) is None
    (tmp_path / "plain.json").write_text(json.dumps(LLAMA))
    plain = load_model(str(tmp_path / "plain.json"))
    assert m.num_params == plain.num_params and plain.rope_scaling is None  # the cost model prices the same shape
    assert ModelSpec(**m.model_dump()) == m  # a plan file keeps it


def test_rope_scalings_the_runtime_does_not_compute_are_planned_not_trained(tmp_path, capsys):
    p = tmp_path / "config.json"
    for rope, want in (({"rope_type": "default", "rope_theta": 1e4}, None),
                       ({"type": "linear", "factor": 2.0}, {"type": "linear", "factor": 2.0}),
                       ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 32}, {"type": "yarn", "factor": 4.0})):
        p.write_text(json.dumps({**LLAMA, "rope_scaling": rope}))
        m = load_model(str(p))
        assert (m.rope_scaling and m.rope_scaling.model_dump(exclude_none=True)) == want
    assert "rope_scaling of type yarn: the runtime computes linear and llama3 RoPE scaling only" in model_problem(m)
    assert main(["plan", "--model", str(p), "--cluster", "dgx-a100", "--gpus", "8", "--global-batch", "8"]) == 0
    capsys.readouterr()
    # llama3 without original_max_position_embeddings takes max_position_embeddings, as transformers does
    p.write_text(json.dumps({**LLAMA, "max_position_embeddings": 4096, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}))
    assert load_model(str(p)).rope_scaling.original_max_position_embeddings == 4096


@pytest.mark.parametrize("rope,want", [
    ({"rope_type": "llama3", **LLAMA3_SCALING, "factor": "8"}, "rope_scaling.factor must be a number"),
    ({"rope_type": "llama3", **LLAMA3_SCALING, "low_freq_factor": 4.0}, "low_freq_factor 4.0 must be below"),
    ({"rope_type": "linear"}, "type linear needs factor"),
    ({"rope_type": "linear", "factor": -2.0}, r"rope_scaling.factor must be a positive number, got -2.0; fix that"),
    ([], "rope_scaling must be a mapping"),
])
def test_bad_rope_scaling_is_one_line(tmp_path, rope, want):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({**LLAMA, "rope_scaling": rope}))
    with pytest.raises(AutoparError, match=want) as err:
        load_model(str(p))
    assert "\n" not in str(err.value)


def test_rope_scaling_needs_rope():
    with pytest.raises(ValidationError, match="rope_scaling scales RoPE, but this GPT has learned positions"):
        ModelSpec(**{**load_model("tiny-gpt").model_dump(), "rope_scaling": {"type": "linear", "factor": 2.0}})


def test_a_config_that_makes_no_model_is_told_in_its_own_key_names(tmp_path):
    """The spec's rule (heads a multiple of kv heads) said with the config's keys, so the error names what to fix."""
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 2, "num_attention_heads": 9,
                             "num_key_value_heads": 4, "intermediate_size": 1536, "vocab_size": 49152}))
    with pytest.raises(AutoparError, match=r"^Hugging Face config .*config.json: num_attention_heads 9 must be a "
                                           r"multiple of num_key_value_heads 4$"):
        load_model(str(p))
    p.write_text(json.dumps({"model_type": "nemotron", "hidden_size": 64, "num_hidden_layers": 2, "norm_eps": -1,
                             "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 256}))
    with pytest.raises(AutoparError, match=r": norm_eps must be zero or positive"):  # Nemotron's own key
        load_model(str(p))
    p.write_text(json.dumps({**GPT2, "n_embd": 770}))  # 770 wide, 12 heads; a GPT-2 config has no head_dim to give
    with pytest.raises(AutoparError, match=r": n_embd 770 is not divisible by n_head 12; fix one of them$"):
        load_model(str(p))
    p.write_text(json.dumps({**GPT2, "n_embd": 770, "model_type": "gptj", "head_dim": 70}))  # nor a GPT-J's
    with pytest.raises(AutoparError, match=r": n_embd 770 is not divisible by n_head 12; fix one of them$"):
        load_model(str(p))


def test_the_window_note_names_the_sequence_planned():
    """A window shorter than the sequence planned without it (the config's context, or 4,096 where it gives none)
    is said; one longer is not; a config whose fields are bad says nothing here (reading it says what is wrong)."""
    from specs.hf_config import hf_notes

    base = {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 256}
    assert not [n for n in hf_notes({**base, "sliding_window": 6000}) if "sliding_window" in n]  # planned at 4096
    assert [n for n in hf_notes({**base, "sliding_window": 2047}) if n.startswith("sliding_window 2047: planned at "
                                                                                 "sequence 2047")]
    assert hf_notes({**base, "sliding_window": 2047, "max_position_embeddings": None}) == []


def test_gptj_and_gpt2_configs_read_with_their_own_defaults_and_notes(tmp_path, capsys):
    """GPT-J's defaults are not GPT-2's (untied, no dropout, RoPE on 64 dimensions: the whole head when rotary_dim is
    null); a GPT-2 config whose activation or attention scaling autopar's GPT block does not compute is planned as
    that block with a note, as a Llama config's hidden_act is."""
    p = tmp_path / "config.json"
    gptj = {**GPT2, "model_type": "gptj", "n_embd": 2048, "n_head": 16}  # head dim 128
    p.write_text(json.dumps(gptj))
    m = load_model(str(p))
    assert (m.tie_embeddings, m.dropout, m.rope_dims, m.max_positions) == (False, 0.0, 64, None)
    p.write_text(json.dumps({**gptj, "rotary_dim": None}))
    assert load_model(str(p)).rope_dims == 128
    p.write_text(json.dumps({**gptj, "rotary_dim": 256}))
    with pytest.raises(AutoparError, match="rotary_dim 256 must be between 1 and the head dimension 128"):
        load_model(str(p))
    m = load_model(_write(tmp_path / "gpt2.json", GPT2))
    assert (m.tie_embeddings, m.dropout, m.max_positions) == (True, 0.1, 1024)
    notes: list[str] = []
    load_model(_write(tmp_path / "relu.json", {**GPT2, "activation_function": "relu", "scale_attn_weights": False}),
               notes=notes)
    assert len(notes) == 2 and "activation_function relu" in notes[0] and "1/sqrt(head dim) only" in notes[1]
    notes.clear()
    load_model(_write(tmp_path / "plain.json", GPT2), notes=notes)
    assert notes == []


def _write(path, data) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def test_a_null_model_type_is_none_given(tmp_path):
    """``"model_type": null`` reads as a config without one (a Llama-style or, with n_embd, a GPT-2-style config),
    not as a model type 'none'."""
    llama = {k: v for k, v in LLAMA.items() if k != "model_type"}
    null = load_model(_write(tmp_path / "null.json", {**llama, "model_type": None}))
    assert null == load_model(_write(tmp_path / "null.json", llama)) and null.arch == "llama"
    assert load_model(_write(tmp_path / "gpt2.json", {**GPT2, "model_type": None})).arch == "gpt"


@pytest.mark.parametrize("cfg,arch,causal", [
    ({**LLAMA, "architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification",
     '["LlamaForCausalLM"]'),  # a reward model: a score head, no vocabulary
    ({**LLAMA, "model_type": "mistral", "architectures": ["MistralModel"]}, "MistralModel",
     '["MistralForCausalLM"]'),  # an embedding model: no head at all
    ({**GPT2, "architectures": ["GPT2Model"]}, "GPT2Model", '["GPT2LMHeadModel"]'),
])
def test_a_config_of_no_causal_language_model_is_refused(tmp_path, cfg, arch, causal):
    """A config whose architectures is not a causal LM would be planned with a vocabulary head it has not: one line
    naming it and the class to write; ...ForCausalLM and ...LMHeadModel, or no architectures, read as before."""
    with pytest.raises(AutoparError) as err:
        load_model(_write(tmp_path / "config.json", cfg))
    assert str(err.value).endswith(f": architectures names {arch}, which is not a causal language model; autopar "
                                   "plans causal language models, whose output head is the vocabulary; set "
                                   f"architectures to {causal} to plan it as one")
    plain = load_model(_write(tmp_path / "config.json", {k: v for k, v in cfg.items() if k != "architectures"}))
    assert load_model(_write(tmp_path / "config.json", {**cfg, "architectures": json.loads(causal)})) == plain


def test_only_the_spec_s_problem_is_said_in_the_config_s_key_names(tmp_path):
    """The hint of a config missing a field, and the file's path, keep their words; the spec's rule is said with the
    config's keys."""
    gpt2 = {k: v for k, v in GPT2.items() if k != "n_head"}
    with pytest.raises(AutoparError, match=r"missing field 'n_head'; expected a Llama/Mistral/Qwen2-style "
                                           r"\(hidden_size, num_hidden_layers, intermediate_size, ...\) or "
                                           r"GPT-2-style \(n_embd, n_layer, ...\) config$"):
        load_model(_write(tmp_path / "config.json", gpt2))
    (tmp_path / "num_kv_heads").mkdir()
    with pytest.raises(AutoparError, match=r"^Hugging Face config .*/num_kv_heads/config.json: num_attention_heads 32 "
                                           r"must be a multiple of num_key_value_heads 5$"):
        load_model(_write(tmp_path / "num_kv_heads" / "config.json", {**LLAMA, "num_key_value_heads": 5}))


MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
QWEN3_MOE = {**LLAMA, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 768}


@pytest.mark.parametrize("cfg,want", [
    ({**MIXTRAL, "num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than num_local_experts 8; a token cannot "
                                            "go to more experts than there are"),
    ({**QWEN3_MOE, "num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than num_experts 8; a token cannot go to "
                                              "more experts than there are"),
    ({**MIXTRAL, "router_aux_loss_coef": -1}, "field 'router_aux_loss_coef': must be at least 0, got -1"),
    ({**QWEN3_MOE, "decoder_sparse_step": 100}, "decoder_sparse_step 100 is more than num_hidden_layers 16, which "
                                                "leaves no MoE layer (every decoder_sparse_step-th layer is one); fix "
                                                "that field"),
    ({**LLAMA, "rope_parameters": {"rope_type": "linear"}}, "field 'rope_parameters': type linear needs factor"),
    ({**LLAMA, "rope_parameters": {"rope_type": "linear", "factor": 0}}, "rope_parameters.factor must be a positive "
                                                                         "number, got 0; fix that field"),
])
def test_moe_and_rope_problems_are_told_in_the_config_s_key_names(tmp_path, cfg, want):
    """docs/contract.md: errors name what to fix in the file; a config keeps the moe: section's fields at its top
    level under keys of its type's (Mixtral's num_local_experts, Qwen's num_experts), and RoPE scaling in rope_scaling
    or rope_parameters."""
    with pytest.raises(AutoparError) as err:
        load_model(_write(tmp_path / "config.json", cfg))
    assert str(err.value).endswith(f"config.json: {want}")


def test_refusals_of_moe_configs_give_advice_that_can_be_followed(tmp_path):
    """Multi-head latent attention (DeepSeek-V2/V3, whatever the model_type) is said to be beyond any autopar spec, not
    sent to a moe: section or to another model's preset; Qwen's mlp_only_layers is sent to the regular patterns a
    moe: section expresses (first_dense_layers, layer_freq)."""
    deepseek = {**LLAMA, "model_type": "deepseek_v2", "n_routed_experts": 64, "kv_lora_rank": 512}
    for cfg in (deepseek, {**LLAMA, "kv_lora_rank": 512}):
        with pytest.raises(AutoparError) as err:
            load_model(_write(tmp_path / "config.json", cfg))
        assert str(err.value).endswith(": kv_lora_rank (multi-head latent attention) is not something autopar's cost "
                                       "model prices; no autopar spec expresses it either (autopar's attention is "
                                       "multi-head or grouped-query), so autopar cannot plan this model")
    with pytest.raises(AutoparError) as err:
        load_model(_write(tmp_path / "config.json", {**QWEN3_MOE, "mlp_only_layers": [0, 5]}))
    assert "moe: section places dense layers in a regular pattern only (first_dense_layers of them, then a MoE layer " \
           "every layer_freq-th); write one where these positions follow such a pattern" in str(err.value)
    with pytest.raises(AutoparError) as err:  # a DeepSeek MoE of standard attention: a moe: section can say it
        load_model(_write(tmp_path / "config.json", {k: v for k, v in deepseek.items() if k != "kv_lora_rank"}))
    assert str(err.value).endswith("or write an autopar spec with a moe: section")
