"""Planning an arbitrary nn.Module: meta-device build, fx trace, counts, and planning it like a preset."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from cost_models.step import estimate  # noqa: E402
from planner.cli import main  # noqa: E402
from planner.search import search  # noqa: E402
from specs.cluster_loading import load_cluster  # noqa: E402
from specs.errors import AutoparError  # noqa: E402
from specs.model import ModelSpec  # noqa: E402
from specs.model_loading import load_model  # noqa: E402
from specs.parallel import ParallelConfig  # noqa: E402
from tests.fixtures import toy_lm  # noqa: E402

REF = "tests.fixtures.toy_lm:build"
H, L, V, S = toy_lm.HIDDEN, toy_lm.LAYERS, toy_lm.VOCAB, toy_lm.SEQ


def test_counts_match_the_architecture():
    m = load_model(REF)
    assert (m.num_layers, m.hidden_size, m.vocab_size, m.seq_length, m.num_attention_heads) == (L, H, V, S, 8)
    assert "traced nn.Module" in m.summary() and "llama" not in m.summary()  # its own block, not a Llama's
    assert m.name == type(toy_lm.build()).__name__  # named for its module's class, not for the factory (build)
    b = m.block
    # QKV 3h^2 + proj h^2 + MLP 8h^2 weights, 2 FLOPs per weight per token
    assert b.fwd_flops_per_token == 2 * 12 * H * H
    assert b.attn_flops_per_token == 4 * S * H  # QK^T and PV over the full s x s
    assert b.params == 12 * H * H + 9 * H + 4 * H  # weights, biases (3h + h + 4h + h), two LayerNorms
    twin = ModelSpec(name="twin", arch="gpt", num_layers=L, hidden_size=H, num_attention_heads=8, vocab_size=V,
                     seq_length=S, attention="flash", dropout=0.0)
    assert m.layer_params_on(1) == twin.layer_params_on(1)
    assert m.model_flops_per_token() == pytest.approx(twin.model_flops_per_token(), rel=0.01)
    # saved activations: what autograd keeps, within 20% of the formula for the same architecture
    from cost_models.memory import layer_activation_bytes

    formula = float(layer_activation_bytes(twin, 2, 1, 1, 1, False, 0)[0]) / S
    assert b.act_bytes_per_token == pytest.approx(formula, rel=0.2)


def test_activations_are_counted_on_the_middle_block_as_the_flops_are():
    """A last block that saves more than the others does not set every block's activations."""
    odd = load_model("tests.fixtures.toy_lm:last_block_hoards").block
    same = load_model("tests.fixtures.toy_lm:uniform_hoarding_blocks").block
    assert odd.act_bytes_per_token == same.act_bytes_per_token
    assert odd.fwd_flops_per_token == same.fwd_flops_per_token


def test_seq_override_retraces_attention():
    m = load_model(REF, seq=64)
    assert m.seq_length == 64 and m.block.attn_flops_per_token == 4 * 64 * H


def test_traced_model_plans_like_a_preset():
    m = load_model(REF)
    c = load_cluster("dgx-a100", gpus=8)
    res = search(m, c, 64, top=3)
    assert res.plans and all(p.config.world == 8 for p in res.plans)
    e = estimate(m, c, ParallelConfig(tp=2, pp=2, dp=2, mbs=2), 64)
    assert e.step_time_s > 0 and e.memory_GiB > 0


def test_cli_plan_with_module(capsys):
    code = main(["plan", "--model", REF, "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "8",
                 "--format", "json"])
    out = capsys.readouterr().out
    assert code == 0 and json.loads(out)["plans"]


def test_the_blocks_are_the_outermost_list_and_the_vocabulary_the_token_lookup():
    """A MoE model's blocks are its layers, not the experts list inside each (8 experts > 4 layers); blocks that
    differ (a dense first layer) are refused; a character model's vocabulary is its 65 tokens, not its larger
    position table, and a sequence beyond that table is refused."""
    m = load_model("tests.fixtures.toy_lm:moe")
    assert (m.num_layers, m.num_attention_heads, m.vocab_size) == (4, 8, 65)
    experts = 8 * (2 * H * H + 2 * H)
    assert m.block.params == 4 * H * H + 4 * H + 4 * H + H * 8 + experts  # attention, norms, router, experts
    with pytest.raises(AutoparError, match="the blocks of layers differ .in type or parameter count"):
        load_model("tests.fixtures.toy_lm:mixed")
    char = load_model("tests.fixtures.toy_lm:char")
    assert (char.vocab_size, char.seq_length) == (65, S)
    with pytest.raises(AutoparError, match=f"a sequence of {2 * S} tokens is beyond the model's table of {S} "
                                           f"positions .* give --seq {S} or less"):
        load_model("tests.fixtures.toy_lm:char", seq=2 * S)
    seg = load_model("tests.fixtures.toy_lm:segmented", seq=4 * S)  # a 2-row token-type table bounds nothing
    assert (seg.vocab_size, seg.seq_length) == (V, 4 * S)


@pytest.mark.parametrize("ref,needle", [
    ("tests.fixtures.no_such_module:build", "cannot import"),
    ("tests.fixtures.toy_lm:missing", "has no callable missing"),
    ("tests.fixtures.toy_lm:not_a_module", "not an nn.Module"),
])
def test_bad_module_refs(ref, needle):
    with pytest.raises(AutoparError, match=needle):
        load_model(ref)


@pytest.mark.parametrize("mod,source,needle", [
    ("ap_syntax", "def f(:\n", "importing ap_syntax failed: SyntaxError"),
    ("ap_import_raises", "raise RuntimeError('import-time failure')\n",
     "importing ap_import_raises failed: RuntimeError: import-time failure"),
    ("ap_import_exits", "import sys\nsys.exit(4)\n", "importing ap_import_exits failed: it called sys.exit(4)"),
    ("ap_factory_raises", "def f():\n    raise ValueError('boom')\n",
     "the factory failed on the meta device: ValueError: boom"),
    ("ap_factory_exits", "def f():\n    import sys\n    sys.exit(3)\n",
     "the factory failed on the meta device: it called sys.exit(3)"),
    ("ap_factory_base", "def f():\n    raise BaseException('weird')\n", "BaseException: weird"),
    ("ap_no_blocks", "import torch.nn as nn\n\ndef f():\n    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))\n",
     "could not find the repeated transformer blocks; autopar needs the model to keep them in an nn.ModuleList"),
])
def test_failing_user_code_is_one_line(tmp_path, monkeypatch, capsys, mod, source, needle):
    (tmp_path / f"{mod}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["estimate", "--model", f"{mod}:f", "--cluster", "cpu-gloo", "--gpus", "1", "--global-batch", "4",
                 "--plan", "tp=1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"autopar: error: --model {mod}:f: ") and needle in err
