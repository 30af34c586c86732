"""Hugging Face weights in and out (runtime/hf_weights.py): a tiny transformers model imported, trained under
tp=2 pp=2 and exported gives the losses transformers computes with the same weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from rt_cases import case_plan

from planner.cli import main
from runtime.data import TokenData
from runtime.hf_weights import export_hf, import_hf
from specs.errors import AutoparError
from specs.files import _umask

VARIANTS = {  # tiny models as rt_cases.case_spec builds them (hidden 32, 4 layers, 4 heads, 2 kv heads, seq 16)
    "llama": (dict(), transformers.LlamaConfig, {}),
    "qwen2-qkv-bias": (dict(qkv_bias=True), transformers.Qwen2Config, {}),
    "llama-tied": (dict(tied=True), transformers.LlamaConfig, {"tie_word_embeddings": True}),
    "mixtral": (dict(moe="mixtral"), transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


def _hf_model(kind: str, path) -> transformers.PreTrainedModel:
    """A randomly initialised transformers model of the case's shape, saved as safetensors in ``path``."""
    _, config_cls, extra = VARIANTS[kind]
    cfg = config_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64, max_position_embeddings=16, rms_norm_eps=1e-5,
                     rope_theta=10000.0, **{"tie_word_embeddings": False, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():  # transformers initialises norms to one and biases to zero: make them count
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
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
    assert back.config.tie_word_embeddings == (kind == "llama-tied")


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
        assert err.count("\n") == 1 and ("must hold a mapping" in err or "twice" in err), err
    with pytest.raises(AutoparError, match="no checkpoint in"):
        export_hf(tmp_path / "nothing", tmp_path / "out")
    gpt = case_plan({"arch": "gpt", "steps": 2})
    with pytest.raises(AutoparError, match="supported for Llama-family"):
        import_hf(tmp_path / "hf", gpt, tmp_path / "ck2")
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
    with pytest.raises(AutoparError, match="holds a run's checkpoints"):
        export_hf(tmp_path / "ck", tmp_path / "ck")  # into the checkpoint folder itself
    (tmp_path / "fine").mkdir()
    (tmp_path / "fine" / "tokenizer.json").write_text("{}")  # a folder with the tokenizer in it is fine
    out = export_hf(tmp_path / "ck", tmp_path / "fine")
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~_umask()  # not safetensors' private 0600
    meta_path = ck / "meta.json"
    good = json.loads(meta_path.read_text())
    for bad, want in (({"format": 99}, "has format 99"), ({"step": "2"}, "is corrupt"), ({"step": -2}, "is corrupt"),
                      ({"plan": {**good["plan"], "model": {**good["plan"]["model"], "num_layers": 2}}},
                       "holds parameters its model \\(2 layers\\) does not have")):
        meta_path.write_text(json.dumps({**good, **bad}))
        with pytest.raises(AutoparError, match=want):
            export_hf(tmp_path / "ck", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    meta_path.write_text(json.dumps(good))
    shard = next(ck.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # cut short: its checksum says so before DCP reads it
    assert main(["export-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"is corrupt ({shard.name} does not match the checksum" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
