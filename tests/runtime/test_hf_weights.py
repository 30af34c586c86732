"""Hugging Face weights in and out (runtime/hf_weights.py): a tiny transformers model imported, trained under
tp=2 pp=2 and exported gives the losses transformers computes with the same weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from rt_cases import case_plan
from rt_hf_cases import scaled_plan

from planner.cli import main
from runtime.data import TokenData
from runtime.hf_weights import export_hf, import_hf
from runtime.models.common import RopeBase
from specs.errors import AutoparError
from specs.files import _umask
from specs.model import RopeScaling
from specs.model_loading import load_model

VARIANTS = {  # tiny models as rt_cases.case_spec builds them (hidden 32, 4 layers, 4 heads, 2 kv heads, seq 16)
    "llama": (dict(), transformers.LlamaConfig, {}),
    "qwen2-qkv-bias": (dict(qkv_bias=True), transformers.Qwen2Config, {}),
    "llama-tied": (dict(tied=True), transformers.LlamaConfig, {"tie_word_embeddings": True}),
    "mixtral": (dict(moe="mixtral"), transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # GPT-2: Conv1D projections (stored transposed), learned positions (a table longer than the sequence), biases
    "gpt2": (dict(arch="gpt", max_positions=24), transformers.GPT2Config, {}),
    "gpt2-tied": (dict(arch="gpt", tied=True), transformers.GPT2Config, {"tie_word_embeddings": True}),
}


def _hf_model(kind: str, path, **more) -> transformers.PreTrainedModel:
    """A randomly initialised transformers model of the case's shape (its config fields ``more`` added), saved as
    safetensors in ``path``."""
    case, config_cls, extra = VARIANTS[kind]
    if config_cls is transformers.GPT2Config:
        shape = dict(n_embd=32, n_layer=4, n_head=4, n_inner=96, vocab_size=64, layer_norm_epsilon=1e-5,
                     n_positions=case.get("max_positions", 16), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    else:
        shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=16)
    cfg = config_cls(**{**shape, "tie_word_embeddings": False, **extra, **more})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # transformers initialises norms to one and biases to zero: make them count
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


def _hf_loss(model: transformers.PreTrainedModel, data: TokenData, step: int, batch: int) -> float:
    """Mean cross-entropy transformers gives step ``step``'s global batch (what the runtime reports as loss)."""
    inp, tgt = data.batch(step, batch)
    with torch.no_grad():
        logits = model(inp.long()).logits
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1).long()))


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_import_train_export_matches_transformers(pool, tokens64, tmp_path, kind):
    # tp=2 pp=2; MoE (trained with tp=1 so far) under pp=2
    case = {**VARIANTS[kind][0], "tp": 1 if "moe" in VARIANTS[kind][0] else 2, "pp": 2, "steps": 4}
    plan = case_plan(case)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.model_dump_json(by_alias=True))
    hf = _hf_model(kind, tmp_path / "hf")
    data = TokenData(tokens64, plan.seq, plan.model.vocab_size, plan.train.seed)

    assert main(["import-hf", str(tmp_path / "hf"), "--plan", str(plan_path), "--out", str(tmp_path / "ck")]) == 0
    # steps 1-2 from the imported weights under tp=2 pp=2, saved after step 2
    losses = pool.run("rt_cases:train_with_checkpoints", case, tokens64, str(tmp_path / "ck"), [2], True, 2)[0]
    assert isinstance(losses, list), losses
    assert losses[0] == pytest.approx(_hf_loss(hf, data, 0, plan.global_batch), abs=1e-5)

    assert main(["export-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]) == 0
    assert main(["export-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]) == 2  # never overwrites
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    step3 = pool.run("rt_cases:train_with_checkpoints", case, tokens64, str(tmp_path / "ck"), [], True, 3)[0]
    assert len(step3) == 1 and step3[0] == pytest.approx(_hf_loss(back, data, 2, plan.global_batch), abs=1e-5)
    assert back.config.tie_word_embeddings == kind.endswith("-tied")
    if kind.startswith("gpt2"):  # the whole position table, rows past the sequence included, went in and out
        assert back.config.n_positions == hf.config.n_positions


def test_bad_hugging_face_inputs_are_one_line_errors(tmp_path, capsys):
    plan = case_plan({"steps": 2})
    hf = _hf_model("llama", tmp_path / "hf")
    del hf
    weights = tmp_path / "hf" / "model.safetensors"
    from safetensors.torch import load_file, save_file

    full = load_file(str(weights))
    save_file({k: v for k, v in full.items() if "layers.3.mlp.down_proj" not in k}, str(weights))
    with pytest.raises(AutoparError, match="has no weight model.layers.3.mlp.down_proj.weight"):
        import_hf(tmp_path / "hf", plan, tmp_path / "ck")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 6}))
    with pytest.raises(AutoparError, match="num_layers=6 but the plan's model has 4"):
        import_hf(tmp_path / "hf", plan, tmp_path / "ck")
    (tmp_path / "hf" / "config.json").unlink()
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.model_dump_json(by_alias=True))
    capsys.readouterr()  # transformers' progress bars so far
    assert main(["import-hf", str(tmp_path / "hf"), "--plan", str(plan_path), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autopar: error:") and "no config.json" in err and "\n" not in err, err
    assert not (tmp_path / "ck").exists()  # nothing written
    for text in ("[]", '{"model_type": "llama", "hidden_size": 64, "hidden_size": 64}'):  # read as --model reads it
        (tmp_path / "hf" / "config.json").write_text(text)
        assert main(["import-hf", str(tmp_path / "hf"), "--plan", str(plan_path), "--out", str(tmp_path / "ck")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and ("must hold a JSON object" in err or "twice" in err), err
    with pytest.raises(AutoparError, match="no checkpoint in"):
        export_hf(tmp_path / "nothing", tmp_path / "out")
    (tmp_path / "older" / "step_00000002").mkdir(parents=True)  # a newer checkpoint broken: refused, not the one
    (tmp_path / "older" / "step_00000002" / "meta.json").write_text("{}")  # before it exported without a word
    (tmp_path / "older" / "step_00000004").mkdir()
    with pytest.raises(AutoparError, match="step_00000004 is corrupt .*or export an earlier one by its folder"):
        export_hf(tmp_path / "older", tmp_path / "out")
    with pytest.raises(AutoparError, match="older/step_00000002 is corrupt"):  # the chosen step: its own meta read
        export_hf(tmp_path / "older" / "step_00000002", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    gpt = case_plan({"arch": "gpt", "activation": "squared_relu", "steps": 2})
    with pytest.raises(AutoparError, match="squared_relu MLP, where GPT-2's is GeLU with biases: Hugging Face "
                                           "weights are supported for GPT-2's block and the Llama family"):
        import_hf(tmp_path / "hf", gpt, tmp_path / "ck2")
    _hf_model("llama", tmp_path / "hf2")
    with pytest.raises(AutoparError, match="has arch='llama' but the plan's model has 'gpt'"):
        import_hf(tmp_path / "hf2", case_plan({"arch": "gpt", "steps": 2}), tmp_path / "ck2")
    from runtime.hf_weights import names

    partial = case_plan({"steps": 2}).model.model_copy(update={"rotary_fraction": 0.5})  # Hugging Face's rotate all
    with pytest.raises(AutoparError, match="no Hugging Face counterpart"):
        names(partial)


def test_what_import_and_export_refuse_before_writing(tmp_path, capsys):
    """Weights of another shape, a folder already holding a run's checkpoints, an --out that is a file, and a
    checkpoint whose shard is cut short: each one line, nothing written or overwritten."""
    from safetensors.torch import load_file, save_file

    plan = case_plan({"steps": 2})
    _hf_model("llama", tmp_path / "hf")
    ck = import_hf(tmp_path / "hf", plan, tmp_path / "ck")  # a good import first
    with pytest.raises(AutoparError, match="already holds a run's checkpoints"):
        import_hf(tmp_path / "hf", plan, tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.is_dir()) == [ck.name]
    weights = tmp_path / "hf" / "model.safetensors"
    full = load_file(str(weights))
    save_file({**full, "model.layers.0.mlp.down_proj.weight": torch.zeros(3, 3)}, str(weights))
    with pytest.raises(AutoparError, match=r"down_proj.weight has shape \(3, 3\), but the plan's model needs"):
        import_hf(tmp_path / "hf", plan, tmp_path / "ck2")
    assert not (tmp_path / "ck2").exists()
    a_file = tmp_path / "model.json"
    a_file.write_text("keep")
    with pytest.raises(AutoparError, match="exists and is not a folder"):
        export_hf(tmp_path / "ck", a_file)
    assert a_file.read_text() == "keep"
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "config.json").write_text("{}")
    with pytest.raises(AutoparError, match="already holds a model"):
        export_hf(tmp_path / "ck", tmp_path / "busy")
    (tmp_path / "gen").mkdir()  # a user's generation settings (or other weights) beside the tokenizer: kept
    (tmp_path / "gen" / "generation_config.json").write_text('{"temperature": 0.7}')
    with pytest.raises(AutoparError, match=r"already holds a model \(generation_config.json\)"):
        export_hf(tmp_path / "ck", tmp_path / "gen")
    assert (tmp_path / "gen" / "generation_config.json").read_text() == '{"temperature": 0.7}'
    with pytest.raises(AutoparError, match="holds a run's checkpoints"):
        export_hf(tmp_path / "ck", tmp_path / "ck")  # into the checkpoint folder itself
    for into in (ck, ck / "hf"):  # inside a checkpoint: pruning it would remove the export
        with pytest.raises(AutoparError, match=f"is inside checkpoint {ck}, which is removed with all it holds"):
            export_hf(tmp_path / "ck", into)
    assert not (ck / "hf").exists()
    (tmp_path / "fine").mkdir()
    (tmp_path / "fine" / "tokenizer.json").write_text("{}")  # a folder with the tokenizer in it is fine
    out, exported = export_hf(tmp_path / "ck", tmp_path / "fine")
    assert exported == ck
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~_umask()  # not safetensors' private 0600
    meta_path = ck / "meta.json"
    good = json.loads(meta_path.read_text())
    for bad, want in (({"format": 99}, "has format 99"), ({"step": "2"}, "is corrupt"), ({"step": -2}, "is corrupt"),
                      ({"plan": {**good["plan"], "model": {**good["plan"]["model"], "num_layers": 2}}},
                       "holds parameters its model \\(2 layers\\) does not have")):
        meta_path.write_text(json.dumps({**good, **bad}))
        with pytest.raises(AutoparError, match=want) as err:
            export_hf(tmp_path / "ck", tmp_path / "out")
        assert "--resume-from" not in str(err.value)  # an export's advice is another export, not training on
    assert not (tmp_path / "out").exists()
    meta_path.write_text(json.dumps(good))
    shard = next(ck.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # cut short: its checksum says so before DCP reads it
    assert main(["export-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"is corrupt ({shard.name} does not match the checksum" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# the case's head_dim of 8 at rope_theta 10000 has wavelengths 6.3, 63, 628 and 6283 tokens: llama3 keeps the first
# (below 16 / 2), blends the second (below 16 / 0.2) and slows the others
SCALINGS = {"llama3": {"type": "llama3", "factor": 8.0, "low_freq_factor": 0.2, "high_freq_factor": 2.0,
                       "original_max_position_embeddings": 16},
            "linear": {"type": "linear", "factor": 4.0}}


def _hf_rope(scaling: dict) -> dict:
    """A spec's rope_scaling as a Hugging Face config writes it."""
    return {"rope_type": scaling["type"], **{k: v for k, v in scaling.items() if k != "type"}}


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_scaled_rope_frequencies_are_transformers(kind):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=64,
                                   rope_theta=500000.0, rope_scaling=_hf_rope(SCALINGS[kind]))
    theirs, _ = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"))
    cpu = torch.device("cpu")
    ours = RopeBase(500000.0, RopeScaling(**SCALINGS[kind])).inverse_frequencies(128, cpu)
    plain = RopeBase(500000.0).inverse_frequencies(128, cpu)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    assert not torch.equal(ours, plain)
    if kind == "llama3":  # all three regimes: kept, blended, slowed by the factor
        kept, slowed = ours == plain, torch.isclose(ours, plain / 8, rtol=1e-6)
        assert kept.any() and slowed.any() and (~kept & ~slowed).any()


def test_llama3_rope_scaling_imports_trains_under_cp_and_exports(pool, tokens64, tmp_path):
    """A Llama 3.1-style checkpoint (llama3 RoPE scaling): the imported weights give transformers' loss under tp=2
    cp=2 (context-parallel ranks rotate by the same frequencies), which plain RoPE would not, and export-hf writes
    the scaling back."""
    case, scaling = {"tp": 2, "cp": 2, "steps": 2}, SCALINGS["llama3"]
    plan = scaled_plan(case, scaling)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.model_dump_json(by_alias=True))
    hf = _hf_model("llama", tmp_path / "hf", rope_scaling=_hf_rope(scaling), max_position_embeddings=32)
    with torch.no_grad():  # larger attention logits and outputs, so that positions count
        for name, p in hf.named_parameters():
            if "_proj" in name:
                p.mul_(8)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    assert load_model(str(tmp_path / "hf")).rope_scaling == plan.model.rope_scaling
    data = TokenData(tokens64, plan.seq, plan.model.vocab_size, plan.train.seed)
    want = _hf_loss(hf, data, 0, plan.global_batch)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**hf.config.to_dict(), "rope_scaling": None,
                                                                      "rope_parameters": None}))
    plain.load_state_dict(hf.state_dict())
    assert abs(_hf_loss(plain.float().eval(), data, 0, plan.global_batch) - want) > 1e-3  # the scaling matters

    assert main(["import-hf", str(tmp_path / "hf"), "--plan", str(plan_path), "--out", str(tmp_path / "ck")]) == 0
    loss = pool.run("rt_hf_cases:first_loss", case, scaling, tokens64, str(tmp_path / "ck"))[0]
    assert loss == pytest.approx(want, abs=1e-5)

    assert main(["export-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["rope_scaling"] == _hf_rope(scaling)
    assert load_model(str(tmp_path / "out")).rope_scaling == plan.model.rope_scaling
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert _hf_loss(back, data, 0, plan.global_batch) == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("mtype", ["gemma", "phi3", "qwen3", None])
def test_import_refuses_weights_autopar_would_compute_otherwise(tmp_path, mtype):
    """Gemma's (1 + w) norms, GeLU MLP and scaled embeddings, Phi-3's fused projections, Qwen3's q/k norms: their
    configs plan, but their weights are refused in one line naming the model_type, before any is read."""
    hf = tmp_path / "hf"
    hf.mkdir()
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64, max_position_embeddings=16)
    cfg = transformers.AutoConfig.for_model(mtype, **shape).to_dict() if mtype else {**shape,
                                                                                     "num_hidden_layers": 4}
    (hf / "config.json").write_text(json.dumps(cfg))  # no weights at all: none may be read
    load_model(str(hf))  # planned
    plan = case_plan({"steps": 2})
    want = f"has model_type '{mtype}'" if mtype else "has no model_type"
    with pytest.raises(AutoparError, match=f"{want}: import-hf reads llama, mistral, mixtral, qwen2, gpt2 weights only"):
        import_hf(hf, plan, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_import_refuses_an_mlp_or_rope_scaling_autopar_does_not_compute(tmp_path):
    _hf_model("llama", tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    with pytest.raises(AutoparError, match="hidden_act 'gelu': autopar's Llama blocks compute SwiGLU"):
        import_hf(tmp_path / "hf", case_plan({"steps": 2}), tmp_path / "ck")
    yarn = {"type": "yarn", "factor": 4.0}
    cfg_path.write_text(json.dumps({**cfg, "rope_scaling": _hf_rope(yarn)}))
    with pytest.raises(AutoparError, match="rope_scaling of type yarn: the runtime computes linear and llama3"):
        import_hf(tmp_path / "hf", scaled_plan({"steps": 2}, yarn), tmp_path / "ck")
    with pytest.raises(AutoparError, match="has rope_scaling={'type': 'yarn', 'factor': 4.0} but the plan's model has {'type': 'linear'"):
        import_hf(tmp_path / "hf", scaled_plan({"steps": 2}, SCALINGS["linear"]), tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_import_refuses_a_sliding_window_the_plan_does_not_have(tmp_path):
    # a Mistral-style window into a plan of the same shape without one: export-hf would write the model back without
    # its window (transformers would then attend past it)
    _hf_model("llama", tmp_path / "hf")
    cfg_path = tmp_path / "hf" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "sliding_window": 16}))
    with pytest.raises(AutoparError, match="has sliding_window=16 but the plan's model has None"):
        import_hf(tmp_path / "hf", case_plan({"steps": 2}), tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("weight", ["self_attn.k_proj.weight", "mlp.up_proj.weight"])
def test_a_fused_part_of_the_wrong_shape_is_one_line(tmp_path, capsys, weight):
    """A q/k/v or gate/up part of another shape is named with its shape before the parts are joined."""
    from safetensors.torch import load_file, save_file

    _hf_model("llama", tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    save_file({**load_file(str(path)), f"model.layers.2.{weight}": torch.zeros(3, 32)}, str(path))
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(case_plan({"steps": 2}).model_dump_json(by_alias=True))
    capsys.readouterr()
    assert main(["import-hf", str(tmp_path / "hf"), "--plan", str(plan_path), "--out", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    need = "(16, 32)" if "k_proj" in weight else "(64, 32)"
    assert err.count("\n") == 1 and f"model.layers.2.{weight} has shape (3, 32), but the plan's model needs {need}" \
        in err, err
    assert not (tmp_path / "ck").exists()


def test_export_writes_back_the_context_the_config_declares(tmp_path):
    """A model planned from its config.json at a shorter sequence (--seq 128 of a 131,072-token Llama) is exported
    with the context its config declared, not the planned sequence; what only describes the model is not part of
    what a checkpoint's run must share."""
    from runtime.hf_weights import hf_config

    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 131072}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model(str(tmp_path / "config.json"), seq=128)
    assert spec.seq_length == 128 and hf_config(spec)["max_position_embeddings"] == 131072
    assert spec.trained() == spec.model_copy(update={"context_length": None}).trained()
    assert hf_config(spec.model_copy(update={"context_length": None}))["max_position_embeddings"] == 128
    longer = load_model(str(tmp_path / "config.json"), seq=8192).model_copy(update={"context_length": 2048})
    assert hf_config(longer)["max_position_embeddings"] == 8192  # trained past its declared context: that length
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 2 ** 27}))
    assert load_model(str(tmp_path / "config.json")).context_length == 2 ** 27  # describes: no size limit to refuse


def test_export_writes_the_special_tokens_the_config_declared(tmp_path):
    """bos/eos/pad ids read from a model's config.json go back into the export's config and its
    generation_config.json (what generate() stops at); a model that declared none exports them null, not
    transformers' Llama 2 defaults (1, 2)."""
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128256, "bos_token_id": 128000,
           "eos_token_id": [128001, 128009], "pad_token_id": None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model(str(tmp_path / "config.json"))
    assert spec.token_ids == {"bos_token_id": 128000, "eos_token_id": [128001, 128009]}
    assert spec.trained() == spec.model_copy(update={"token_ids": None}).trained()  # a resume need not share them
    assert spec.trained() == spec.model_copy(update={"name": "exported"}).trained()  # nor a name
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "bos_token_id": -1, "eos_token_id": "x"}))
    assert load_model(str(tmp_path / "config.json")).token_ids is None  # not ids: as if absent
    # past the vocabulary (transformers' GPT-2 config keeps 50256 whatever the vocab_size): left out, and said
    from specs.hf_config import hf_notes

    small = {**cfg, "vocab_size": 256, "bos_token_id": 50256, "eos_token_id": [2, 300]}
    (tmp_path / "config.json").write_text(json.dumps(small))
    assert load_model(str(tmp_path / "config.json")).token_ids == {"eos_token_id": [2]}
    assert "bos_token_id 50256, eos_token_id 300: past the vocabulary of 256 tokens, not kept" in hf_notes(small)[-1]
    (tmp_path / "m.yaml").write_text("name: m\narch: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                                     "ffn_hidden_size: 128\nvocab_size: 256\ntoken_ids: {bos_token_id: 300}\n")
    with pytest.raises(AutoparError, match=r"token_ids: bos_token_id 300 past the vocabulary \(vocab_size 256\)"):
        load_model(str(tmp_path / "m.yaml"))  # a spec file of the user's: refused
    stored = type(spec).model_validate({**spec.model_dump(), "vocab_size": 256, "token_ids": {"bos_token_id": 300}})
    assert stored.token_ids is None  # a plan or checkpoint an earlier version wrote: loads, without the id

    for ids in ({"bos_token_id": 1, "eos_token_id": [2, 5]}, None):
        plan = case_plan({"steps": 2})
        plan = plan.model_copy(update={"model": plan.model.model_copy(update={"token_ids": ids})})
        _hf_model("llama", tmp_path / "hf", bos_token_id=None, eos_token_id=None)
        ck = tmp_path / f"ck{bool(ids)}"
        import_hf(tmp_path / "hf", plan, ck)
        out, _ = export_hf(ck, tmp_path / f"out{bool(ids)}")
        config = transformers.AutoConfig.from_pretrained(out)
        if ids:
            gen = transformers.GenerationConfig.from_pretrained(out)
            assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, [2, 5], None)
            assert (config.bos_token_id, config.eos_token_id) == (1, [2, 5])
        else:
            assert not (out / "generation_config.json").exists()
            assert (config.bos_token_id, config.eos_token_id) == (None, None)


def test_an_all_moe_plan_imports_whatever_dense_width_its_spec_keeps(tmp_path, capsys):
    """Every layer a mixture of experts: the spec's ffn_hidden_size is used by no layer, so it need not equal the
    Hugging Face config's intermediate_size (Mixtral keeps the experts' width there); the experts' width must."""
    plan = case_plan({"moe": "mixtral", "tp": 1, "pp": 1})
    _hf_model("mixtral", tmp_path / "hf")
    wide = plan.model.model_copy(update={"ffn_hidden_size": 96})
    path = tmp_path / "plan.json"
    path.write_text(plan.model_copy(update={"model": wide}).model_dump_json(by_alias=True))
    assert main(["import-hf", str(tmp_path / "hf"), "--plan", str(path), "--out", str(tmp_path / "ck")]) == 0
    narrow = wide.model_copy(update={"moe": wide.moe.model_copy(update={"moe_ffn_hidden_size": 32})})
    path.write_text(plan.model_copy(update={"model": narrow}).model_dump_json(by_alias=True))
    assert main(["import-hf", str(tmp_path / "hf"), "--plan", str(path), "--out", str(tmp_path / "ck2")]) == 2
    assert "has moe=" in capsys.readouterr().err


def test_gpt2_as_openai_published_it_and_what_it_refuses(tmp_path):
    """The original GPT-2 files name their tensors without ``transformer.``, keep no lm_head (tied) and carry the
    causal-mask buffers of older transformers: they import to the same weights as transformers' own save. GPT-2
    configs whose weights autopar's block would compute otherwise are refused before a weight is read."""
    from safetensors.torch import load_file, save_file

    from runtime.hf_weights import read_parameters

    plan = case_plan({"arch": "gpt", "tied": True, "steps": 2})
    _hf_model("gpt2-tied", tmp_path / "hf")
    ours = read_parameters(import_hf(tmp_path / "hf", plan, tmp_path / "ck"))[1]
    full = load_file(str(tmp_path / "hf" / "model.safetensors"))
    old = {k.removeprefix("transformer."): v for k, v in full.items() if k != "lm_head.weight"}
    old.update({f"h.{i}.attn.bias": torch.tril(torch.ones(1, 1, 16, 16)) for i in range(4)})
    (tmp_path / "old").mkdir()
    save_file(old, str(tmp_path / "old" / "model.safetensors"))
    (tmp_path / "old" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    theirs = read_parameters(import_hf(tmp_path / "old", plan, tmp_path / "ck-old"))[1]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # a tied config over an lm_head that is not the embedding (transformers loads it untied): refused, not dropped
    save_file({**full, "lm_head.weight": full["transformer.wte.weight"] + 1}, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(AutoparError, match="lm_head.weight that differs from its embeddings, but its config ties"):
        import_hf(tmp_path / "hf", plan, tmp_path / "ck-untied")
    assert torch.equal(ours["layers.0.attn.qkv.weight"], full["transformer.h.0.attn.c_attn.weight"].t())
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    for bad, want in (({"activation_function": "gelu"}, "activation_function 'gelu': autopar's GPT MLP computes "
                                                        "GeLU's tanh approximation"),
                      ({"scale_attn_by_inverse_layer_idx": True}, "scales attention other than by 1/sqrt")):
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(AutoparError, match=want):
            import_hf(tmp_path / "hf", plan, tmp_path / "ck-bad")
    assert not (tmp_path / "ck-bad").exists()
