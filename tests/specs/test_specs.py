"""Model specs, presets, Hugging Face configs and hardware profiles."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from specs.cluster_loading import list_clusters, list_gpus, load_cluster, load_gpu
from specs.errors import AutoparError
from specs.model import ModelSpec
from specs.model_loading import load_model

REQUIRED_PRESETS = [
    "gpt-1.7b", "gpt-3.6b", "gpt-7.5b", "gpt-18b", "gpt-39b", "gpt-76b", "gpt-145b", "gpt3-175b", "gpt-310b",
    "gpt-530b", "gpt-1t", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b",
    "mistral-7b", "tiny",
]


@pytest.mark.parametrize("name", REQUIRED_PRESETS)
def test_required_presets_load(name):
    m = load_model(name)
    assert m.num_layers > 0 and m.num_params > 0


@pytest.mark.parametrize("name,billions,tol", [
    ("llama2-7b", 6.74, 0.01), ("llama2-13b", 13.02, 0.01), ("llama2-70b", 68.98, 0.01),
    ("llama3-8b", 8.03, 0.01), ("llama3-70b", 70.55, 0.01), ("llama3-405b", 405.8, 0.01),
    ("mistral-7b", 7.24, 0.01), ("gpt3-175b", 175.0, 0.01), ("gpt-1t", 1008.0, 0.01), ("gpt-530b", 529.6, 0.01),
])
def test_parameter_counts_match_published(name, billions, tol):
    assert load_model(name).num_params / 1e9 == pytest.approx(billions, rel=tol)


def test_model_flops_match_megatron_formula():
    """6*params + attention equals Megatron's 72*B*s*L*h^2*(1 + s/(6h) + V/(12hL)) per sequence."""
    m = load_model("gpt3-175b")
    s, L, h, V = m.seq_length, m.num_layers, m.hidden_size, m.vocab_size
    megatron = 72 * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    ours = m.model_flops_per_token() * s
    assert ours == pytest.approx(megatron, rel=0.005)  # biases and norms are the difference


def test_llama_hf_config(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "architectures": ["LlamaForCausalLM"]}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = load_model(str(p))
    assert (m.arch, m.kv_heads, m.ffn, m.seq_length, m.rope_theta) == ("llama", 8, 14336, 8192, 500000.0)
    assert m.num_params == load_model("llama3-8b").num_params


@pytest.mark.parametrize("mtype", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "mixtral", "qwen2_moe",
                                   "qwen3_moe", "olmoe"])
def test_hf_config_without_rms_norm_eps_reads_transformers_default(tmp_path, mtype):
    """A config.json that leaves rms_norm_eps out means its config class's default, which transformers sets per
    model type (1e-6 for Llama, 1e-5 for Mixtral)."""
    transformers = pytest.importorskip("transformers")
    cls = transformers.AutoConfig.for_model(mtype).__class__
    cfg = {"model_type": mtype, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 4, "intermediate_size": 512, "vocab_size": 1000}
    if mtype in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        cfg.update(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert load_model(str(p)).norm_eps == cls().rms_norm_eps


@pytest.mark.parametrize("mtype", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "mixtral", "qwen2_moe",
                                   "qwen3_moe", "olmoe"])
def test_hf_config_without_num_key_value_heads_reads_transformers_default(tmp_path, mtype):
    """A config.json that leaves num_key_value_heads out means its config class's default (Mistral's and Mixtral's 8,
    Llama's num_attention_heads); a null one means num_attention_heads; a default that does not divide the heads is
    told as the key to write."""
    transformers = pytest.importorskip("transformers")
    cls = transformers.AutoConfig.for_model(mtype).__class__
    cfg = {"model_type": mtype, "hidden_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 32,
           "intermediate_size": 512, "vocab_size": 1000}
    if mtype in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        cfg.update(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128)
    want = cls(**{k: v for k, v in cfg.items() if k != "model_type"}).num_key_value_heads
    assert _hf(tmp_path, cfg).kv_heads == want
    assert _hf(tmp_path, {**cfg, "num_key_value_heads": None}).kv_heads == 32
    if want != 32:
        with pytest.raises(AutoparError, match=f"num_key_value_heads is left out, and {mtype}'s default in "
                                               f"transformers, {want}, does not divide num_attention_heads 10; write "
                                               "num_key_value_heads"):
            _hf(tmp_path, {**cfg, "num_attention_heads": 10, "hidden_size": 640})


def test_a_sliding_window_bounds_the_sequence(tmp_path, capsys):
    """Mistral 7B v0.1 attends to its last 4096 tokens: autopar computes full attention, the same up to 4096 tokens,
    so it plans that model at 4096 by default and refuses a longer --seq in one line; a Qwen2 config's window is
    off unless use_sliding_window says otherwise; export-hf writes the window back (as a Mistral config)."""
    from planner.cli import main
    from runtime.hf_weights import hf_config

    cfg = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
           "max_position_embeddings": 32768, "sliding_window": 4096}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = load_model(str(p))
    assert (m.seq_length, m.sliding_window) == (4096, 4096)
    assert hf_config(m)["model_type"] == "mistral" and hf_config(m)["sliding_window"] == 4096
    assert main(["plan", "--model", str(p), "--cluster", "dgx-a100", "--gpus", "8", "--global-batch", "8",
                 "--seq", "8192"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "beyond" in err and "sliding_window of 4096" in err and "--seq 4096" in err
    p.write_text(json.dumps({**cfg, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}))
    assert load_model(str(p)).sliding_window is None and load_model(str(p)).seq_length == 8192
    p.write_text(json.dumps({**cfg, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}))
    assert load_model(str(p)).sliding_window == 4096
    with pytest.raises(ValidationError, match="beyond"):
        ModelSpec(**{**load_model("mistral-7b").model_dump(), "sliding_window": 1024, "seq_length": 2048})
    assert load_model("mistral-7b").sliding_window == load_model("mistral-7b").seq_length == 4096  # v0.1's window


def test_a_model_folder_reads_its_config_json(tmp_path):
    """``--model DIR`` (a downloaded Hugging Face model) reads DIR/config.json; a folder without one is a one-line
    error naming what to give instead."""
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "max_position_embeddings": 8192, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert load_model(str(tmp_path)).num_params == load_model("llama3-8b").num_params
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AutoparError, match="model folder .*empty has no config.json; give"):
        load_model(str(empty))


def _hf(tmp_path, cfg: dict):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return load_model(str(p))


def test_phi3_and_gemma_hf_configs(tmp_path):
    """Phi-3 (fused qkv and gate|up: Llama's shapes) and Gemma (head_dim 256, embeddings tied unless the config
    says otherwise) read as Llama-style; their published sizes: Phi-3-mini 3.82B, Gemma-7B 8.54B."""
    phi3 = _hf(tmp_path, {"model_type": "phi3", "hidden_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 32,
                          "num_key_value_heads": 32, "intermediate_size": 8192, "vocab_size": 32064,
                          "max_position_embeddings": 4096, "tie_word_embeddings": False})
    assert phi3.arch == "llama" and phi3.num_params / 1e9 == pytest.approx(3.82, rel=0.01)
    gemma = _hf(tmp_path, {"model_type": "gemma", "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
                           "num_key_value_heads": 16, "head_dim": 256, "intermediate_size": 24576, "vocab_size": 256000,
                           "max_position_embeddings": 8192})
    assert gemma.tie_embeddings and gemma.num_params / 1e9 == pytest.approx(8.54, rel=0.01)


@pytest.mark.parametrize("field,value", [("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
                                         ("sliding_window_pattern", 2)])
def test_configs_the_cost_model_cannot_price_are_refused_naming_the_field(tmp_path, field, value):
    cfg = {"model_type": "gemma2", "hidden_size": 2304, "num_hidden_layers": 26, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 9216, "vocab_size": 256000, field: value}
    with pytest.raises(AutoparError, match=f"{field} .* is not something autopar's cost model prices"):
        _hf(tmp_path, cfg)


def test_layer_types_of_one_kind_are_a_plain_model(tmp_path):
    """transformers 5 writes ``layer_types`` into plain Qwen2/Llama configs (full attention everywhere), and into
    sliding-window ones (Mistral 7B v0.1; Qwen2 with use_sliding_window and max_window_layers 0) sliding attention
    everywhere: planned as the config without them, at the window; mixed kinds, and sliding attention with no window
    to slide, are still refused."""
    cfg = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 2, "num_attention_heads": 14,
           "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936}
    assert _hf(tmp_path, {**cfg, "layer_types": ["full_attention"] * 2}).num_layers == 2
    windowed = {**cfg, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 0}
    sliding = _hf(tmp_path, {**windowed, "layer_types": ["sliding_attention"] * 2})
    assert sliding == _hf(tmp_path, windowed) and (sliding.sliding_window, sliding.seq_length) == (4096, 4096)
    mistral = {**cfg, "model_type": "mistral", "sliding_window": 4096}
    assert _hf(tmp_path, {**mistral, "layer_types": ["sliding_attention"] * 2}) == _hf(tmp_path, mistral)
    mixed = "layer_types .layers of different attention kinds. is not something autopar's cost model prices"
    unslid = "layer_types .sliding attention in every layer, with no sliding_window the config applies. is not"
    for bad, why in (({**cfg, "layer_types": ["full_attention", "sliding_attention"]}, mixed),
                     ({**mistral, "layer_types": ["full_attention", "sliding_attention"]}, mixed),
                     ({**cfg, "layer_types": ["sliding_attention"] * 2}, unslid)):  # Qwen's window: use_sliding_window
        with pytest.raises(AutoparError, match=why):
            _hf(tmp_path, bad)


def test_qwen2_hf_config_has_qkv_bias(tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
           "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
           "max_position_embeddings": 32768, "tie_word_embeddings": True}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = load_model(str(p))
    assert m.qkv_bias and m.tie_embeddings and m.seq_length == 8192
    # Qwen2-0.5B has 494M parameters (tied embeddings)
    assert m.num_params / 1e6 == pytest.approx(494, rel=0.01)


def test_gpt2_hf_config(tmp_path):
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
           "vocab_size": 50257, "n_inner": None, "resid_pdrop": 0.1}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = load_model(str(p))
    assert (m.arch, m.ffn, m.tie_embeddings, m.seq_length) == ("gpt", 3072, True, 1024)
    assert m.num_params / 1e6 == pytest.approx(124.4, rel=0.005)  # GPT-2 small


def test_rope_settings_read_wherever_transformers_writes_them(tmp_path):
    """transformers 5 writes rope_theta and partial_rotary_factor only inside rope_parameters (read there too, the
    top level winning); GPT-J rotates rotary_dim of each head's dimensions and has no learned positions; a head too
    narrow for any rotated pair is one line."""
    from specs.hf_config import hf_to_spec

    llama = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 512, "vocab_size": 1000, "rope_parameters": {"rope_type": "default",
                                                                              "rope_theta": 500000.0}}
    assert hf_to_spec(llama, "x")["rope_theta"] == 500000.0
    assert hf_to_spec({**llama, "rope_theta": 1e4}, "x")["rope_theta"] == 1e4
    nemotron = {"model_type": "nemotron", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                "intermediate_size": 512, "vocab_size": 1000,
                "rope_parameters": {"rope_theta": 5e4, "partial_rotary_factor": 0.25}}
    spec = hf_to_spec(nemotron, "x")
    assert (spec["rope_theta"], spec["rotary_fraction"]) == (5e4, 0.25)
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "gptj", "n_embd": 4096, "n_layer": 28, "n_head": 16, "rotary_dim": 64,
                             "n_positions": 2048, "vocab_size": 50400, "tie_word_embeddings": False}))
    gptj = load_model(str(p))
    assert (gptj.rope_dims, gptj.hd, gptj.learned_positions, gptj.position_params) == (64, 256, False, 0)
    with pytest.raises(ValidationError, match="leaves no pair of dimensions to rotate"):
        ModelSpec(name="x", arch="gpt", num_layers=1, hidden_size=8, num_attention_heads=8, vocab_size=10,
                  seq_length=8, rotary_fraction=0.5)


def test_yaml_spec_and_seq_override(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("name: mine\narch: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                 "ffn_hidden_size: 128\nvocab_size: 100\n")
    m = load_model(str(p), seq=512)
    assert m.seq_length == 512 and m.kv_heads == 4 and m.attn_impl == "flash"


@pytest.mark.parametrize("text,needle", [
    ("name: x\narch: llama\nnum_layers: 2\nhiden_size: 64\n", "unknown field 'hiden_size' (did you mean 'hidden_size'?)"),
    ("name: x\narch: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 10\n",
     "ffn_hidden_size is required"),
    ("name: x\narch: gpt\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 5\nvocab_size: 10\n",
     "not divisible by num_attention_heads"),
    ("name: x\narch: bert\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 10\n", "arch"),
    ("name: x\narch: gpt\nnum_layers: two\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 10\n", "num_layers"),
    ("name: x\narch: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 10\n"
     "ffn_hidden_size: 128\nactivation: squared_relu\n", "needs arch 'gpt'"),
    ("name: x\narch: gpt\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 10\n"
     "activation: swiglu\n", "is arch 'llama'"),
    ("name: x\narch: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 10\n"
     "ffn_hidden_size: 128\nlinear_bias: true\n", "no linear biases"),
    ("name: x\narch: gpt\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 10\n"
     "activation: relu\n", "activation"),
    ("name: x\narch: gpt\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 10\n"
     "rotary_fraction: 1.5\n", "rotary_fraction must be in (0, 1]"),
    ("name: x\narch: gpt\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 10\n"
     "rotary_fraction: true\n", "rotary_fraction"),
    ("name: [x\n", "not valid YAML at line"),
    ("- 1\n- 2\n", "must hold a mapping"),
    ("name: x\narch: gpt\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 10\n", "missing required field 'num_layers'"),
    # a misspelt key inside a section: named, with its section's closest field (a misspelt required one is also
    # missing, and the unknown name is the one to fix)
    ("name: x\narch: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 10\n"
     "ffn_hidden_size: 128\nmoe: {num_experts: 8, experts_per_tok: 2, moe_ffn_hidden_size: 64}\n",
     "unknown field 'moe.experts_per_tok' (did you mean 'experts_per_token'?)"),
    ("name: x\narch: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nvocab_size: 10\n"
     "ffn_hidden_size: 128\nmoe: {num_experts: 8, experts_per_token: 2, moe_ffn_hidden_size: 64, routr: softmax}\n",
     "unknown field 'moe.routr' (did you mean 'router'?)"),
])
def test_bad_specs_give_one_line_errors(tmp_path, text, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(AutoparError) as err:
        load_model(str(p))
    msg = str(err.value)
    assert needle in msg and "\n" not in msg


@pytest.mark.parametrize("cfg,needle", [
    ({"model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
      "intermediate_size": 10944, "vocab_size": 102400, "n_routed_experts": 64}, "mixture-of-experts model autopar"),
    ({"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
      "intermediate_size": 14336, "vocab_size": 32000, "num_local_experts": 8}, "missing field 'num_experts_per_tok'"),
    ({"model_type": "gpt_neox", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
      "intermediate_size": 16384, "vocab_size": 50432}, "model_type 'gpt_neox' is not supported"),
    ({"model_type": "llama", "hidden_size": 64.7, "num_hidden_layers": 2, "num_attention_heads": 4,
      "intermediate_size": 128, "vocab_size": 100}, "hidden_size must be a positive integer"),
    ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
      "vocab_size": 100}, "missing field 'num_hidden_layers'"),
])
def test_bad_hf_configs(tmp_path, cfg, needle):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    with pytest.raises(AutoparError, match=needle):
        load_model(str(p))


@pytest.mark.parametrize("extra,needle", [
    ("intra_node: {bandwidth_GBps: 0}", "field 'intra_node.bandwidth_GBps': must be above 0, got 0"),
    ("intra_node: {bandwidth_GBps: 300}\nnum_nodes: 2\ninter_node: {nic_bandwidth_Gbps: 200, nics_per_node: 0}",
     "field 'inter_node.nics_per_node': must be at least 1, got 0"),
    ("intra_node: {bandwidth_GBps: .nan}", "finite"),
    ("intra_node: {bandwidth_GBps: 300}\ncollectives: {allreduce: {intra: {alpha_us: 1, busbw_GBps: 1}}}",
     "collectives"),
    ("intra_node: {bandwidth_GBps: 300}\ncollectives: {all_reduce: {intra: {alpha_us: 1, busbw_GBps: 1, "
     "alpha_per_rnk_us: 2}}}", r"unknown field 'collectives.all_reduce.intra.alpha_per_rnk_us'"),  # under a dict
    ("intra_node: {bandwidth_GBps: 300}\ncollectives: {all_gather: {intra: {alpha_us: 1, busbw_GBps: 1, "
     "busbw_by_nodes: {2: 5}}}}", "node counts describe collectives across nodes; give them under inter"),
    ("num_nodes: 2\ninter_node: {nic_bandwidth_GBps: 50, nics_per_node: 8}",  # bytes for bits: the name says which
     r"unknown field 'inter_node.nic_bandwidth_GBps' \(did you mean 'nic_bandwidth_Gbps'\?\)"),
])
def test_bad_cluster_values(tmp_path, extra, needle):
    p = tmp_path / "c.yaml"
    p.write_text("name: c\ngpu: a100-sxm4-80gb\ngpus_per_node: 8\n" + extra + "\n")
    with pytest.raises(AutoparError, match=needle):
        load_cluster(str(p))


def test_binary_file_is_refused(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(AutoparError, match="not a text file"):
        load_model(str(p))


def test_unknown_preset_suggests():
    with pytest.raises(AutoparError, match="did you mean 'llama2-7b'"):
        load_model("llama2-7")


def test_missing_file():
    with pytest.raises(AutoparError, match="does not exist"):
        load_model("/nonexistent/model.yaml")


def test_bundled_gpus_and_clusters():
    for g in ("a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm5-80gb", "h200-sxm-141gb"):
        assert g in list_gpus()
        gpu = load_gpu(g)
        assert gpu.peak("bf16") > 1e14
    for c in ("dgx-a100", "dgx-h100", "a100-4x200g", "cpu-gloo"):
        assert c in list_clusters()
    dgx = load_cluster("dgx-h100")
    assert dgx.intra_node.bandwidth_GBps == 450 and dgx.inter_node.nic_bandwidth_Gbps == 400
    half = load_cluster("a100-4x200g")
    assert half.nic_bw_per_gpu == pytest.approx(load_cluster("dgx-a100").nic_bw_per_gpu / 2)


def test_cluster_resize():
    c = load_cluster("dgx-a100", gpus=1024)
    assert (c.num_nodes, c.num_gpus) == (128, 1024)
    assert load_cluster("dgx-a100", nodes=3).num_gpus == 24
    assert load_cluster("dgx-a100", gpus=4).gpus_per_node == 4
    with pytest.raises(AutoparError, match="not a whole number of dgx-a100 nodes"):
        load_cluster("dgx-a100", gpus=12)
    with pytest.raises(AutoparError, match="unknown cluster 'dgx-a10'"):
        load_cluster("dgx-a10")
    assert load_cluster("dgx-a100", gpus=2).gpu.memory_GiB == 80  # a GPU's memory is its own


def test_cpu_ranks_share_the_host_s_memory():
    """A CPU profile's memory per rank is the host's over its ranks: fewer ranks each hold more (a 312M-parameter
    model planned for one rank of a measured 23 GiB machine was refused for 23/8 GiB), and the node grown back
    shares it as before."""
    cpu = load_cluster("cpu-gloo")
    host = cpu.gpu.memory_GiB * cpu.gpus_per_node
    for ranks in (1, 2, 4, 8):
        assert load_cluster("cpu-gloo", gpus=ranks).gpu.memory_GiB * ranks == host
    assert cpu.resized(gpus=2).resized(gpus=8) == cpu and cpu.resized(gpus=2).resized(gpus=4).gpu.memory_GiB == host / 4


def test_cluster_file_errors(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: c\ngpu: a100-sxm4-80gb\ngpus_per_node: 8\nnum_nodes: 2\nintra_node: {bandwidth_GBps: 300}\n")
    with pytest.raises(AutoparError, match="needs an inter_node section"):
        load_cluster(str(p))
    p.write_text("name: c\ngpu: tpu-v9\ngpus_per_node: 8\nintra_node: {bandwidth_GBps: 300}\n")
    with pytest.raises(AutoparError, match="unknown GPU 'tpu-v9'"):
        load_cluster(str(p))
    p.write_text("name: c\ngpu: {name: g, peak_tflops: {bf16: 100}, memory_GiB: 10, memory_bandwidth_GBps: 100, "
                 "efficiency: {gemm: 1.5}}\ngpus_per_node: 1\nintra_node: {bandwidth_GBps: 1}\n")
    with pytest.raises(AutoparError, match=r"efficiency.gemm must be in \(0, 1\]"):
        load_cluster(str(p))


def test_a_precision_the_gpu_lacks_is_a_one_line_error(tmp_path):
    """A V100 (no bf16) cluster asked to compute in bf16 is refused, naming what it has and what to use; CPU ranks
    (gloo) compute in any precision."""
    p = tmp_path / "v100.yaml"
    p.write_text("name: v100box\ngpu: v100-sxm2-32gb\ngpus_per_node: 8\nintra_node: {bandwidth_GBps: 150}\n"
                 "precision: bf16\n")
    with pytest.raises(AutoparError, match="precision bf16: GPU v100-sxm2-32gb has no bf16 .*; use precision fp16"):
        load_cluster(str(p))
    p.write_text(p.read_text().replace("bf16", "fp16"))
    assert load_cluster(str(p)).precision == "fp16"
    assert load_cluster("cpu-gloo").model_copy(update={"precision": "bf16"}).precision_problem() is None


def test_gpu_profiles_carry_their_node_link_and_clusters_respect_it(tmp_path):
    """Every bundled GPU (the CPU aside) says how its platform joins the GPUs of a node; every bundled cluster's
    intra-node link is one its GPU has; a profile without intra_node gets the GPU's own; a profile that pairs a
    PCIe-only GPU with NVSwitch bandwidth is one line naming the link it has."""
    for name in list_gpus():
        gpu = load_gpu(name)
        assert (gpu.node_link is None) == (name == "cpu"), name
    for name in list_clusters():
        c = load_cluster(name)
        assert c.link_problem() is None and (c.gpu.node_link is None
                                             or c.intra_node.bandwidth_GBps == c.gpu.node_link.bandwidth_GBps), name
    assert load_gpu("l40s-48gb").node_link.kind == "pcie" and "fp8" in load_gpu("h100-sxm5-80gb").peak_tflops
    assert "fp8" not in load_gpu("a100-sxm4-80gb").peak_tflops
    p = tmp_path / "c.yaml"
    p.write_text("name: c\ngpu: h100-pcie-80gb\ngpus_per_node: 8\n")
    assert load_cluster(str(p)).intra_node.bandwidth_GBps == 64
    p.write_text("name: c\ngpu: l40s-48gb\ngpus_per_node: 8\nintra_node: {bandwidth_GBps: 450}\n")
    with pytest.raises(AutoparError, match=r"intra_node bandwidth_GBps 450: GPU l40s-48gb has PCIe \(32 GB/s per "
                                           r"GPU\) inside a node; use at most 40 \(1.25x its 32\), or leave intra_node out"):
        load_cluster(str(p))
    p.write_text("name: c\ngpu: {name: g, peak_tflops: {bf16: 100}, memory_GiB: 10, memory_bandwidth_GBps: 100}\n"
                 "gpus_per_node: 8\n")
    with pytest.raises(AutoparError, match="missing 'intra_node' .*GPU g has no node_link to take it from"):
        load_cluster(str(p))
    p.write_text("name: c\ngpu: h100-sxm5-80gb\ngpus_per_node: 8\nintra_node: {bandwidth_GBps: 480}\n")
    assert load_cluster(str(p)).intra_node.bandwidth_GBps == 480  # measured NVLink SHARP all-reduces read above


def test_nemotron_hf_config(tmp_path):
    """A Hugging Face Nemotron config (model_type nemotron) plans as a GPT block with squared ReLU, no linear biases
    and RoPE on its partial_rotary_factor of each head (no learned positions); a config it cannot describe is one
    line naming the field."""
    cfg = {"model_type": "nemotron", "hidden_size": 6144, "num_hidden_layers": 32, "num_attention_heads": 48,
           "num_key_value_heads": 8, "intermediate_size": 24576, "vocab_size": 256000, "max_position_embeddings": 4096,
           "hidden_act": "relu2", "partial_rotary_factor": 0.5, "attention_bias": False, "mlp_bias": False,
           "tie_word_embeddings": False, "norm_eps": 1e-5}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = load_model(str(p))
    assert (m.arch, m.act, m.has_bias, m.kv_heads, m.rope_dims, m.hd, m.position_params, m.attn_impl) == (
        "gpt", "squared_relu", False, 8, 64, 128, 0, "flash")
    emb = 2 * 256000 * 6144  # Parmar et al. 2024: 3.2B embedding and 12.5B non-embedding parameters
    assert abs(emb / 1e9 - 3.2) < 0.1 and abs((m.num_params - emb) / 1e9 - 12.5) < 0.05
    for bad, needle in (({"hidden_act": "gelu"}, "hidden_act must be relu2"),
                        ({"mlp_bias": True}, "attention_bias and mlp_bias differ")):
        p.write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(AutoparError) as err:
            load_model(str(p))
        assert needle in str(err.value) and "\n" not in str(err.value)


def test_usable_cores_are_the_affinitys_not_the_machines(monkeypatch):
    """A container's or taskset's share of the cores counts, where the system can say; else the machine's count."""
    from specs import host

    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    monkeypatch.setattr(host.os, "cpu_count", lambda: 64)
    assert host.usable_cores() == 3
    monkeypatch.delattr(host.os, "sched_getaffinity", raising=False)
    assert host.usable_cores() == 64
    monkeypatch.setattr(host.os, "cpu_count", lambda: None)
    assert host.usable_cores() == 1
