"""Bad inputs found by fuzzing: each ends in one line on stderr and exit status 2 (no hang, no traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.cli import main
from planner.space import divisors
from specs.planfile import load_plan

LLAMA = ("name: t\narch: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 128\n"
         "vocab_size: 100\nseq_length: 64\n")
HF = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 64}
CLUSTER = "name: c\ngpus_per_node: 2\nintra_node: {bandwidth_GBps: 300, latency_us: 3}\n"
GPU = "gpu: {name: g, peak_tflops: {bf16: 312}, memory_GiB: 80, memory_bandwidth_GBps: 2000"
ESTIMATE = ["--cluster", "cpu-gloo", "--gpus", "1", "--global-batch", "4", "--plan", "tp=1"]
TINY = ["--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "4", "--global-batch", "16"]
WHATIF = ["whatif", "--model", "tiny", "--cluster", "dgx-a100", "--gpus", "16", "--global-batch", "64",
          "--vary", "inter_node_bw=100,200"]


def fails(capsys, *argv: str) -> str:
    """Run the CLI in-process; assert exit 2 with one line on stderr and no traceback; return that line."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("autopar: error: ") and "Traceback" not in err
    return err


# ---- sizes: divisors in O(sqrt n), generous upper bounds ----------------------------------------------
def test_divisors_are_exact_and_fast():
    for n in range(1, 300):
        for limit in (None, 1, 7, 32, n):
            assert divisors(n, limit) == [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]
    # an O(n) loop would not return from these (no timing asserted: a regression hangs the test visibly)
    assert divisors(2**40)[-3:] == [2**38, 2**39, 2**40]
    assert divisors(999_999_999_989, 32) == [1]  # a prime: only the small divisors are tried


@pytest.mark.parametrize("argv,needle", [
    (["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "4", "--global-batch", "1000000000"],
     "--global-batch must be at most 1,048,576"),
    (["plan", "--model", "tiny", "--cluster", "dgx-a100", "--gpus", "8000000000", "--global-batch", "512"],
     "--gpus 8000000000 asks for 8,000,000,000 GPUs"),
    (["estimate", "--model", "tiny", "--seq", "99999999999", *ESTIMATE], "--seq must be at most"),
])
def test_absurd_sizes_are_refused(capsys, argv, needle):
    assert needle in fails(capsys, *argv)


# ---- model specs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,needle", [
    ("num_layers: 1000000000000000000000000000000", "num_layers must be at most 10,000"),
    ("vocab_size: 1000000000000000", "vocab_size must be at most"),
    ("num_layers: true", "field 'num_layers': expected a number, got true"),
    ('num_layers: "4"', "field 'num_layers': expected a number, got the text '4'; write it without quotes"),
    ("seq_length: 2k", "got the text '2k'; write the number alone, in the unit the field's name gives"),
    ('tie_embeddings: "yes"', "field 'tie_embeddings': expected true or false, got 'yes'"),
    ("moe: {num_experts: 8, experts_per_token: 2, moe_ffn_hidden_size: 64, norm_topk_prob: 1}",
     "expected true or false, got 1"),
    ("norm_eps: -1.0e-5", "norm_eps must be zero or positive"),
    ("rope_theta: -5", "rope_theta must be positive"),
    ("head_dim: 3", "head_dim 3 is odd, but rotary position embeddings"),
    ("block: {params: -5, fwd_flops_per_token: 1, act_bytes_per_token: 1}", "block.params"),
    ("block: {params: 5, fwd_flops_per_token: -1, act_bytes_per_token: 1}", "block.fwd_flops_per_token"),
    ("moe: 8", "field 'moe': expected a section of fields (a mapping), got 8"),
    ("moe: {num_experts: 8.0, experts_per_token: 2, moe_ffn_hidden_size: 64}",
     "field 'moe.num_experts': expected a whole number, got 8.0; write 8"),
    ("token_ids: {bos_token_id: true}", "field 'token_ids': expected a number, got true"),
    ("rope_scaling: {type: linear, factor: 2, low_freq_factor: 1}",
     "type linear does not take low_freq_factor (llama3's blend of frequencies): drop it"),
    ("token_ids: {eos_token_id: [1, 2.0]}", "field 'token_ids': expected a whole number, got 2.0; write 2"),
])
def test_bad_model_specs(tmp_path, capsys, change, needle):
    key = change.split(":")[0]
    text = "".join(line + "\n" for line in LLAMA.splitlines() if not line.startswith(key + ":")) + change + "\n"
    (tmp_path / "m.yaml").write_text(text)
    assert needle in fails(capsys, "estimate", "--model", str(tmp_path / "m.yaml"), *ESTIMATE)


def test_odd_head_dim_is_fine_without_rope(tmp_path, capsys):
    (tmp_path / "m.yaml").write_text(LLAMA.replace("llama", "gpt") + "head_dim: 3\n")
    assert main(["estimate", "--model", str(tmp_path / "m.yaml"), *ESTIMATE, "--format", "json"]) == 0


@pytest.mark.parametrize("field,value,needle", [
    ("num_key_value_heads", 0, "num_key_value_heads must be a positive integer, got 0"),
    ("num_key_value_heads", 2.5, "num_key_value_heads must be a positive integer, got 2.5"),
    ("max_position_embeddings", float("inf"), "max_position_embeddings must be a positive integer, got Infinity"),
    ("rms_norm_eps", None, "rms_norm_eps must be a number, got null"),
    ("head_dim", "x", 'head_dim must be a positive integer, got "x"'),
    ("tie_word_embeddings", "no", 'tie_word_embeddings must be true or false, got "no"'),
    ("vocab_size", 10**400, "vocab_size must be a positive integer, got 1000"),
    ("rope_theta", 10**400, "rope_theta must be a number, got 1000"),
])
def test_bad_hf_fields_are_named(tmp_path, capsys, field, value, needle):
    (tmp_path / "config.json").write_text(json.dumps({**HF, field: value}))
    assert needle in fails(capsys, "estimate", "--model", str(tmp_path / "config.json"), *ESTIMATE)


def test_hf_null_means_default(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**HF, "num_key_value_heads": None, "head_dim": None}))
    assert main(["estimate", "--model", str(tmp_path / "config.json"), *ESTIMATE, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] > 0


# ---- cluster and GPU profiles ---------------------------------------------------------------------------
@pytest.mark.parametrize("gpu_extra,cluster_extra,needle", [
    (", efficiency: {kernel_overhead_us: -5}", "", "field 'efficiency.kernel_overhead_us'"),
    (", efficiency: {gemm_tile_m: 0}", "", "field 'efficiency.gemm_tile_m'"),
    (", efficiency: {memory: 0}", "", "efficiency.memory must be in (0, 1]"),
    ("", "num_nodes: true\n", "field 'num_nodes': expected a number, got true"),
    (", peak_tflops: {bf16: true}", "", "field 'peak_tflops': expected a number, got true"),
    ("", "backend: true\n", "field 'backend': got true; use 'nccl' or 'gloo'"),
    ("", "num_nodes: 1000000000\ninter_node: {nic_bandwidth_Gbps: 200, nics_per_node: 8}\n",
     "GPUs is beyond autopar's limit"),
    ("", "num_nodes: 2.0\n", "field 'num_nodes': expected a whole number, got 2.0; write 2"),
    (", sm_count: 132.0", "", "inline GPU profile: field 'sm_count': expected a whole number, got 132.0; write 132"),
    (", gemm_table: [{m: 8192, n: 8192, k: 8192, tflops: 2500}]", "",
     "gemm_table m=8192 n=8192 k=8192: 2500 TFLOP/s is above its bf16 peak of 312 TFLOP/s"),
    (", attention_table: [{seq: 2048, heads: 8, head_dim: 128, fwd_tflops: 200, bwd_tflops: 400}]", "",
     "attention_table seq=2048 heads=8 head_dim=128 bwd: 400 TFLOP/s is above its bf16 peak"),
])
def test_bad_physical_quantities(tmp_path, capsys, gpu_extra, cluster_extra, needle):
    key = gpu_extra[2:].split(":")[0] if gpu_extra else None
    gpu = GPU.replace("peak_tflops: {bf16: 312}", gpu_extra[2:]) if key == "peak_tflops" else GPU + gpu_extra
    (tmp_path / "c.yaml").write_text(CLUSTER + gpu + "}\n" + cluster_extra)
    err = fails(capsys, "estimate", "--model", "tiny", "--cluster", str(tmp_path / "c.yaml"), "--global-batch", "4",
                "--plan", "tp=1")
    assert needle in err


# ---- user text printed through rich and matplotlib ---------------------------------------------------------
def test_markup_in_names_is_printed_as_text(tmp_path, capsys):
    (tmp_path / "m.yaml").write_text(LLAMA.replace("name: t", "name: '[/x]'"))
    (tmp_path / "c.yaml").write_text(CLUSTER.replace("name: c", "name: '[/oops]'") + GPU + "}\n")
    (tmp_path / "[").mkdir()
    common = ["--model", str(tmp_path / "m.yaml"), "--cluster", str(tmp_path / "c.yaml"), "--global-batch", "4"]
    for argv in (["estimate", *common, "--plan", "tp=1"], ["plan", *common, "--out", str(tmp_path / "[/p].json")],
                 ["whatif", *common, "--vary", "intra_node_bw=100,200"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "model   [/x]:" in out and "cluster [/oops]:" in out
    assert (tmp_path / "[" / "p].json").exists()


def test_plot_title_with_dollars_and_the_path_written(tmp_path, capsys):
    (tmp_path / "m.yaml").write_text(LLAMA.replace("name: t", "name: '$\\badcmd{$'"))
    code = main(["whatif", "--model", str(tmp_path / "m.yaml"), "--cluster", "cpu-gloo", "--global-batch", "4",
                 "--vary", "gpus=1,2", "--plot", str(tmp_path / "plot")])
    assert code == 0
    assert f"wrote {tmp_path / 'plot.png'}" in capsys.readouterr().out
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert "is a directory" in fails(capsys, "whatif", "--model", "tiny", "--cluster", "cpu-gloo", "--global-batch",
                                     "4", "--vary", "gpus=1,2", "--plot", str(tmp_path))
    deep = tmp_path / "new" / "folder" / "p.png"  # a folder not there yet is made, as for --out
    assert main(["whatif", "--model", "tiny", "--cluster", "cpu-gloo", "--global-batch", "4", "--vary", "gpus=1,2",
                 "--plot", str(deep)]) == 0
    assert deep.read_bytes()[:4] == b"\x89PNG"
    again = ["whatif", "--model", "tiny", "--cluster", "cpu-gloo", "--global-batch", "4", "--vary", "gpus=1,2"]
    assert main([*again, "--plot", str(deep)]) == 0  # an earlier plot is replaced, of any format matplotlib writes
    for name in ("p.svgz", "p.pdf", "p.svg", "p.raw"):
        assert main([*again, "--plot", str(tmp_path / name)]) == 0 and main([*again, "--plot", str(tmp_path / name)]) == 0
    plan = tmp_path / "plan.png"  # a file of another kind (a plan named .png) is not
    assert main(["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--global-batch", "4", "--out", str(plan)]) == 0
    kept = plan.read_bytes()
    capsys.readouterr()
    assert "exists and is not a plot" in fails(capsys, *again, "--plot", str(plan)) and plan.read_bytes() == kept


def test_an_output_named_as_a_folder_is_refused_and_a_path_is_never_a_preset(tmp_path, capsys, monkeypatch):
    """`--out pdir/` (a folder that does not exist yet) would write a file named pdir: refused, nothing written; a
    model given as a path (./llama3-8b) that does not exist is not read as the preset of that name."""
    monkeypatch.chdir(tmp_path)
    assert "names a folder (it ends in /)" in fails(capsys, "plan", *TINY, "--out", "pdir/")
    assert "names a folder (it ends in /)" in fails(capsys, "whatif", "--model", "tiny", "--cluster", "cpu-gloo",
                                                    "--global-batch", "4", "--vary", "gpus=1,2", "--plot", "qdir/")
    assert list(tmp_path.iterdir()) == []
    assert "model file ./llama3-8b does not exist" in fails(capsys, "estimate", "--model", "./llama3-8b", *ESTIMATE)


# ---- whatif: inputs that fail every point ----------------------------------------------------------------
@pytest.mark.parametrize("argv,needle", [
    ([*WHATIF[:-3], "0", *WHATIF[-2:]], "--global-batch must be a positive integer, got 0"),
    ([*WHATIF[:-3], "-5", *WHATIF[-2:]], "--global-batch must be a positive integer, got -5"),
    ([*WHATIF, "--fix", "tp=3"], "tp=3 does not divide the model's 8 attention heads"),
    ([*WHATIF, "--fix", "pp=99"], "--fix pp=99: the model has only 4 layers"),
    ([*WHATIF, "--compare", "tp=0"], "--compare tp=0: must be at least 1"),
    ([*WHATIF, "--compare", "zero=9"], "--compare zero=9: must be one of 0, 1, 2, 3"),
    (["whatif", "--model", "tiny", "--cluster", "cpu-gloo", "--global-batch", "64", "--vary", "inter_node_bw=100,200"],
     "--vary inter_node_bw: cluster cpu-gloo has no inter_node section"),
    (["whatif", "--model", "tiny", "--cluster", "cpu-gloo", "--global-batch", "64", "--vary", "nics_per_node=1,2"],
     "--vary nics_per_node: cluster cpu-gloo has no inter_node section"),
    (["whatif", "--model", "llama3-70b", "--cluster", "dgx-a100", "--global-batch", "8", "--vary", "gpus=1,2"],
     "no point of the sweep has a plan; at gpus=1: no plan fits; the closest ("),
    (["whatif", "--model", "tiny", "--cluster", "dgx-a100", "--global-batch", "64", "--vary", "gpus=8,16",
      "--compare", "placement=none"], "--compare placement: cluster dgx-a100 has no node groups"),
    ([*WHATIF, "--fix", "placement=none"], "--fix placement=none: cluster dgx-a100 has no node groups"),
    (["plan", "--model", "tiny", "--cluster", "dgx-a100", "--global-batch", "64", "--fix", "placement=none"],
     "--fix placement=none: cluster dgx-a100 has no node groups"),
    (["estimate", "--model", "tiny", *ESTIMATE[:-1], "tp=1,placement=none"],
     "--plan placement=none: cluster cpu-gloo has no node groups"),
    (["whatif", "--model", "llama3-70b", "--cluster", "dgx-h100", "--global-batch", "512", "--vary", "gpus=16"],
     "GiB per GPU, of 72 usable (80 less 8 headroom)"),
])
def test_whatif_global_errors(capsys, argv, needle):
    assert needle in fails(capsys, *argv)


def test_a_gpu_count_the_cluster_cannot_take_is_a_point_that_says_so(capsys):
    """12 GPUs of 8-GPU nodes: that point of the sweep says why (naming the sweep, not a --gpus never given); the
    points beside it are planned."""
    code = main(["whatif", "--model", "tiny", "--cluster", "dgx-h100", "--global-batch", "64", "--vary",
                 "gpus=4,12,16", "--format", "json"])
    assert code == 0
    pts = json.loads(capsys.readouterr().out)["curves"]["best"]
    assert [p["value"] for p in pts] == [4, 12, 16]
    assert "plan" in pts[0] and "plan" in pts[2] and "plan" not in pts[1]
    assert pts[1]["error"].startswith("--vary gpus=12 is not a whole number of dgx-h100 nodes")


def test_whatif_compare_curve_may_have_no_plan(capsys):
    """Only the best curve must have a plan somewhere: a --compare curve of error points is still printed."""
    code = main(["whatif", "--model", "llama2-70b", "--cluster", "dgx-a100", "--global-batch", "64", "--vary",
                 "gpus=32,64", "--compare", "zero=0,tp=1,pp=1,cp=1", "--format", "json"])
    assert code == 0
    curves = json.loads(capsys.readouterr().out)["curves"]
    assert all(p["tokens_per_s"] > 0 for p in curves["best"])
    assert all(not p.get("tokens_per_s") and "no plan fits" in p["error"] for p in curves["zero=0,tp=1,pp=1,cp=1"])


def test_whatif_mesh_errors_name_both_flags(capsys):
    code = main(["whatif", "--model", "tiny", "--cluster", "dgx-a100", "--global-batch", "64", "--vary", "gpus=8,16",
                 "--fix", "tp=4", "--compare", "pp=4", "--format", "json"])
    assert code == 0
    pts = json.loads(capsys.readouterr().out)["curves"]["pp=4"]
    assert pts[0]["error"].startswith("--fix tp=4 --compare pp=4: 8 GPUs are not divisible by tp*pp*cp = 16")


def test_whatif_compare_row_errors_name_compare(capsys):
    code = main(["whatif", "--model", "tiny", "--cluster", "dgx-a100", "--global-batch", "64", "--vary", "gpus=2,8",
                 "--compare", "tp=4", "--format", "json"])
    assert code == 0
    pts = json.loads(capsys.readouterr().out)["curves"]["tp=4"]
    assert pts[0]["error"].startswith("--compare tp=4: 2 GPUs are not divisible by tp*pp*cp = 4")
    assert pts[1]["tokens_per_s"] > 0



@pytest.mark.parametrize("flag", ["--fix", "--compare"])
@pytest.mark.parametrize("keys,needle", [("bogus=1", "unknown plan key 'bogus'"), ("tp=2,tp=4", "given twice"),
                                         ("tp", "is not key=value")])
def test_whatif_key_errors_name_the_option(capsys, flag, keys, needle):
    """whatif names --fix and --compare keys apart: an unknown, repeated or malformed key says which option it is
    in."""
    err = fails(capsys, *WHATIF, flag, keys)
    assert err.startswith(f"autopar: error: {flag} {keys}: ") and needle in err


def test_a_short_gpu_name_is_refused_with_the_names_it_may_mean(capsys):
    """`--vary gpu=h100`: the value and the option are named, with the bundled GPUs whose names begin with it."""
    err = fails(capsys, "whatif", "--model", "tiny", "--cluster", "cpu-gloo", "--global-batch", "16", "--vary",
                "gpu=h100,a100-sxm4-80gb")
    assert err.startswith("autopar: error: --vary gpu=h100: unknown GPU 'h100' (did you mean 'h100-pcie-80gb' or "
                          "'h100-sxm5-80gb'?)")

# ---- empty paths ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,option", [
    (["plan", *TINY, "--out", ""], "--out"),
    (["whatif", *TINY, "--vary", "gpus=1,2", "--plot", ""], "--plot"),
    (["run", "--data", ""], "--data"),
    (["run", "--metrics-out", " "], "--metrics-out"),
])
def test_empty_paths_are_errors(capsys, argv, option):
    assert f"argument {option}: must not be empty" in fails(capsys, *argv)


# ---- messages --------------------------------------------------------------------------------------------
def test_fixed_mesh_that_does_not_match_the_gpus(capsys):
    err = fails(capsys, "plan", *TINY, "--fix", "tp=2,pp=2,dp=2")
    assert "--fix tp=2,pp=2,dp=2: tp*pp*cp*dp = 2*2*1*2 = 8 does not match 4 GPUs; omit dp to use 1" in err
    assert "{" not in err and "global batch" not in err


def test_runnable_refuses_a_cluster_whose_state_the_runtime_cannot_keep(tmp_path, capsys):
    cluster = tmp_path / "fp16.yaml"
    cluster.write_text("name: fp16box\ngpu: v100-sxm2-32gb\ngpus_per_node: 4\nintra_node: {bandwidth_GBps: 150}\n"
                       "precision: fp16\n")
    err = fails(capsys, "plan", "--model", "tiny", "--cluster", str(cluster), "--global-batch", "16", "--runnable")
    assert "--runnable: cluster fp16box computes in fp16" in err and "no loss scaling" in err


def test_an_option_given_twice_is_refused_and_fix_keys_add_up(capsys):
    """argparse would keep the last of two values silently: a value option given twice is one line, while several
    --fix options add their keys up (a key given twice is refused)."""
    assert "--gpus is given twice" in fails(capsys, "plan", *TINY, "--gpus", "8")
    assert "--top is given twice (--trials and --top are one option)" in fails(capsys, "tune", *TINY, "--trials", "2",
                                                                             "--top", "3")
    assert "--plan is given twice; give it once, with comma-separated keys" in fails(
        capsys, "estimate", "--model", "tiny", *ESTIMATE, "--plan", "tp=1")
    assert "--vary is given twice; give it once: one key with comma-separated values" in fails(
        capsys, *WHATIF, "--vary", "gpus=8,16")
    assert "plan key 'tp' given twice" in fails(capsys, "plan", *TINY, "--fix", "tp=2", "--fix", "tp=1")
    for command in (["plan", *TINY], [*WHATIF], ["tune", *TINY]):  # not "nothing fixed" without a word
        assert '--fix is empty; give the plan keys to hold, e.g. --fix "tp=2,pp=2"' in fails(capsys, *command, "--fix",
                                                                                            " ")
    err = fails(capsys, "import-hf", "hf", "--plan", "p.json", "--plan", "p.json", "--out", "x")  # a file: no keys
    assert err.strip().endswith("--plan is given twice; give it once"), err
    assert main(["plan", *TINY, "--fix", "tp=2", "--fix", "pp=2", "--format", "json"]) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]["parallel"]
    assert (best["tp"], best["pp"]) == (2, 2)


def test_an_abbreviated_or_misspelled_option_is_refused_and_named(capsys):
    """argparse takes an unambiguous prefix for the option (``--gpu`` as ``--gpus``, ``--ver`` as ``--verify``): a
    typo then runs something else. Prefixes are refused; a misspelled option is named (with the nearest one) before a
    required one it stands for is said to be missing."""
    assert "unrecognized arguments: --gpu 8" in fails(capsys, "plan", "--model", "tiny", "--global-batch", "16",
                                                       "--gpu", "8")
    assert "unrecognized arguments: --ver" in fails(capsys, "plan", *TINY, "--ver")
    err = fails(capsys, "plan", "--global_batch", "64", "--model", "tiny")
    assert "unknown option --global_batch (did you mean --global-batch?)" in err and "required" not in err
    assert "unknown option --global_batch (did you" in fails(capsys, "plan", "--global_batch=64", "--model", "tiny")
    assert "the following arguments are required: --global-batch" in fails(capsys, "plan", "--model", "tiny")


def test_a_gpu_profile_a_cluster_profile_names_but_that_is_not_there_names_both(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("name: c\ngpu: ./nothere.yaml\ngpus_per_node: 2\n")
    err = fails(capsys, "plan", "--model", "tiny", "--cluster", "c.yaml", "--global-batch", "8")
    assert err.startswith("autopar: error: cluster profile c.yaml: gpu: GPU profile ./nothere.yaml does not exist")
    assert f"(looked for in {Path.cwd()})" in err
    (tmp_path / "g.yaml").write_text("name: g\nnode_groups:\n- {name: a, gpu: a100-sxm4-80gx, num_nodes: 1, "
                                     "gpus_per_node: 2, intra_node: {bandwidth_GBps: 300}}\n")
    err = fails(capsys, "plan", "--model", "tiny", "--cluster", "g.yaml", "--global-batch", "8")
    assert "node_groups[0]: gpu: unknown GPU 'a100-sxm4-80gx' (did you mean 'a100-sxm4-80gb'?)" in err


def test_an_odd_sequence_needs_no_even_split_without_context_parallelism(tmp_path, capsys):
    """The load-balanced causal split (2 x cp chunks) is context parallelism's: with cp = 1 any length plans."""
    assert main(["estimate", "--model", "tiny", *ESTIMATE[:-2], "--plan", "tp=1,cp=1", "--seq", "127"]) == 0
    capsys.readouterr()
    assert "divisible by 2*cp = 4" in fails(capsys, "estimate", "--model", "tiny", "--cluster", "dgx-a100", "--gpus",
                                            "2", "--global-batch", "4", "--plan", "cp=2", "--seq", "127")


def test_a_key_given_twice_is_refused_in_every_file(tmp_path, capsys):
    """YAML and JSON parsers keep the last of two equal keys silently: a model spec, a cluster profile, a Hugging
    Face config or a plan file that gives one twice is one line naming it."""
    (tmp_path / "m.yaml").write_text(LLAMA + "hidden_size: 128\n")
    assert "gives 'hidden_size' twice (the second at line 9); keep one" in fails(
        capsys, "estimate", "--model", str(tmp_path / "m.yaml"), *ESTIMATE)
    (tmp_path / "c.yaml").write_text(CLUSTER + GPU + "}\ngpus_per_node: 4\n")
    assert "cluster profile" in fails(capsys, "plan", "--model", "tiny", "--cluster", str(tmp_path / "c.yaml"),
                                      "--gpus", "2", "--global-batch", "4")
    (tmp_path / "config.json").write_text(json.dumps(HF)[:-1] + ', "hidden_size": 128}')
    assert "gives 'hidden_size' twice" in fails(capsys, "estimate", "--model", str(tmp_path / "config.json"),
                                                *ESTIMATE)
    assert main(["plan", *TINY, "--out", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    text = (tmp_path / "p.json").read_text()
    (tmp_path / "p.json").write_text(text.replace('"schema"', '"global_batch": 8,\n  "schema"', 1))
    assert "gives 'global_batch' twice" in fails(capsys, "run", str(tmp_path / "p.json"), "--dry-run")


def test_a_folder_given_as_the_cluster_is_named_as_a_folder(tmp_path, capsys):
    (tmp_path / "mine.yaml").write_text(CLUSTER)
    err = fails(capsys, "plan", "--model", "tiny", "--cluster", str(tmp_path), "--gpus", "2", "--global-batch", "4")
    assert f"cluster profile {tmp_path} is a folder; give a profile file inside it (mine.yaml there)" in err


def test_a_plan_file_is_replaced_whole_or_not_at_all(tmp_path, capsys, monkeypatch):
    """Plan files are written to a temporary file and renamed: when the write fails, the old plan is still whole
    and no temporary file is left."""
    import os

    out = tmp_path / "p.json"
    assert main(["plan", *TINY, "--out", str(out)]) == 0
    capsys.readouterr()
    before = out.read_text()

    def broken(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    assert "cannot write plan file" in fails(capsys, "plan", *TINY, "--fix", "tp=2", "--out", str(out))
    assert out.read_text() == before and [f.name for f in tmp_path.iterdir()] == ["p.json"]


def test_more_recomputed_layers_than_a_stage_holds_is_refused(capsys):
    """recompute_layers counts layers of a stage: more than it holds was capped silently (and written in the plan)."""
    assert "recompute_layers=99 recomputes more layers than a stage holds" in fails(
        capsys, "plan", *TINY, "--fix", "recompute_layers=99")
    assert "recompute_layers=3/1 recomputes more layers than a stage holds (2/2 per stage)" in fails(
        capsys, "estimate", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "8",
        "--plan", "pp=2,recompute=full,recompute_layers=3/1")
    assert main(["estimate", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "8",
                 "--plan", "pp=2,recompute=full,recompute_layers=2/1"]) == 0


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux's /proc")
def test_an_output_the_file_system_refuses_is_named_before_the_work(capsys):
    """Permissions can say yes where the file system says no (/proc, as root): the output path is tried before the
    search (or tune's trials) start, not after."""
    assert "cannot write plan file /proc/plan.json" in fails(capsys, "plan", *TINY, "--out", "/proc/plan.json")
    assert "nothing can be created in /proc" in fails(capsys, "tune", *TINY, "--out", "/proc/x/plan.json")


# ---- found by a bad-input hunt (session 20) ----------------------------------------------------------
def test_an_output_is_never_one_of_the_inputs(tmp_path, capsys):
    """`--out` / `--metrics-out` naming the model spec, cluster profile, plan or metrics file the command reads is
    refused before anything is written: the input is still there, byte for byte."""
    spec = tmp_path / "m.yaml"
    spec.write_text(LLAMA)
    cluster = tmp_path / "c.yaml"
    cluster.write_text("name: c\ngpu: a100-sxm4-80gb\ngpus_per_node: 8\n")
    plan = tmp_path / "p.json"
    assert main(["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "1", "--global-batch", "2",
                 "--out", str(plan)]) == 0
    capsys.readouterr()
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1}\n')
    before = {p: p.read_bytes() for p in (spec, cluster, plan, metrics)}
    assert "is the model spec this command reads" in fails(
        capsys, "plan", "--model", str(spec), "--cluster", "cpu-gloo", "--gpus", "1", "--global-batch", "2",
        "--out", str(spec))
    assert "is the cluster profile this command reads" in fails(
        capsys, "plan", "--model", "tiny", "--cluster", str(cluster), "--gpus", "8", "--global-batch", "8",
        "--out", str(tmp_path / "." / "c.yaml"))
    assert "is the plan file this command reads" in fails(capsys, "run", str(plan), "--metrics-out", str(plan))
    assert "is the metrics file" in fails(capsys, "calibrate", str(metrics), "--out", str(metrics))
    for command in (["calibrate", str(metrics), "--out", str(tmp_path / "o.yaml")], ["diagnose", str(metrics)]):
        assert "--warmup must be 0 or more, got -1" in fails(capsys, *command, "--warmup", "-1")
    assert "is the model spec this command reads" in fails(
        capsys, "whatif", "--model", str(spec), "--cluster", "dgx-a100", "--global-batch", "8", "--vary",
        "gpus=8,16", "--plot", str(spec))
    assert {p: p.read_bytes() for p in before} == before


def test_an_output_never_replaces_a_file_of_another_kind(tmp_path, capsys):
    """`plan --out` / `tune --out` replace only a plan file, `calibrate --out` / `profile --out` only a cluster
    profile (named .yaml or .yml: a profile is YAML): a model spec, a plan or a profile of the user's in their way is
    refused before anything is measured or written, byte for byte as it was; an empty file is anything's."""
    spec = tmp_path / "m.yaml"
    spec.write_text(LLAMA)
    plan = tmp_path / "p.json"
    assert main(["plan", *TINY, "--out", str(plan)]) == 0
    assert main(["plan", *TINY, "--fix", "tp=2", "--out", str(plan)]) == 0  # a plan over a plan
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1}\n')
    capsys.readouterr()
    before = {p: p.read_bytes() for p in (spec, plan)}
    for argv, what in [(["plan", *TINY], "plan file"), (["tune", *TINY], "plan file"),
                       (["calibrate", str(metrics)], "calibrated profile"), (["profile", "--quick"], "profile")]:
        assert f"{spec} exists and is not a {what}: writing the {what} there would destroy it" in fails(
            capsys, *argv, "--out", str(spec)), argv
    for argv in (["calibrate", str(metrics)], ["profile", "--quick"]):
        assert "profiles are written as YAML; name it .yaml or .yml" in fails(
            capsys, *argv, "--out", str(tmp_path / "profile.json"))
    assert {p: p.read_bytes() for p in before} == before
    empty = tmp_path / "empty.json"
    empty.write_text("")
    assert main(["plan", *TINY, "--out", str(empty)]) == 0 and load_plan(empty).world_size == 4


def test_what_a_hf_config_has_and_autopar_does_not_compute_is_said(tmp_path, capsys):
    """A Llama-style config's activation other than silu, MLP biases, output-projection bias, q/k norms and Gemma's
    norms have no place in the spec: planning it says so on stderr, each once; a config without them says nothing.
    A config with GPT-2's key names but another model_type (StarCoder's multi-query gpt_bigcode, CTRL's dff) is not
    read as a GPT-2."""
    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 128}
    cfg = tmp_path / "config.json"
    for extra, notes in [({}, []), ({"hidden_act": "silu", "attention_bias": False}, []),
                         ({"hidden_act": "gelu_pytorch_tanh"}, ["hidden_act gelu_pytorch_tanh: priced as autopar's "
                                                                "SwiGLU MLP (the same GEMMs); `autopar run` trains it "
                                                                "with silu"]),
                         ({"mlp_bias": True, "attention_bias": True},
                          ["mlp_bias: the MLP's biases are neither priced nor trained",
                           "attention_bias: q, k and v keep their biases (qkv_bias); the output projection's bias"]),
                         ({"model_type": "internlm2", "bias": True},  # wqkv's and wo's biases
                          ["bias: InternLM2's attention biases (wqkv and wo) are neither priced nor trained"]),
                         ({"model_type": "internlm2", "bias": False}, []),
                         ({"model_type": "mistral", "sliding_window": 100},  # Phi-3 mini's window is 2047
                          ["sliding_window 100: planned at sequence 100 by default"]),
                         ({"model_type": "mistral", "sliding_window": 4096}, []),  # beyond the context: no note
                         ({"model_type": "qwen3", "head_dim": 16},
                          ["q/k norms (qwen3: an RMSNorm of each head's queries and keys): neither priced nor trained"]),
                         ({"model_type": "gemma", "head_dim": 16},  # no activation named: transformers' gelu (tanh)
                          ["hidden_act gelu_pytorch_tanh: priced as", "gemma: RMSNorms scaling by 1 + weight"]),
                         ({"model_type": "gemma", "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu"},
                          ["hidden_act gelu_pytorch_tanh: priced as", "gemma: RMSNorms scaling by 1 + weight"])]:
        cfg.write_text(json.dumps({**base, **extra}))
        assert main(["plan", "--model", str(cfg), "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "8"]) == 0
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: model")]
        assert len(err) == len(notes) and all(n in line for n, line in zip(notes, err)), (extra, err)
    gpt2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128, "vocab_size": 256}
    for mtype in ("gpt_bigcode", "ctrl", "codegen", "openai-gpt"):
        cfg.write_text(json.dumps({**gpt2, "model_type": mtype, "multi_query": True, "dff": 512}))
        assert f"model_type '{mtype}' is not supported" in fails(capsys, "plan", "--model", str(cfg), "--cluster",
                                                                 "cpu-gloo", "--gpus", "2", "--global-batch", "8")
    cfg.write_text(json.dumps({**gpt2, "model_type": "gptj", "rotary_dim": 8}))
    assert main(["plan", "--model", str(cfg), "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "8"]) == 0
    assert "parallel residual (attention and MLP both read the block's input)" in capsys.readouterr().err


def test_an_empty_or_shapeless_file_and_a_short_list_are_said_plainly(tmp_path, capsys):
    """Not pydantic's or Python's words (NoneType, 'train.betas.1' missing): what the file or field lacks."""
    spec = tmp_path / "m.yaml"
    for text, needle in [("", f"model spec {spec} is empty; write its fields"),
                         ("- a\n- b\n", "must hold a mapping of fields (`key: value` lines), not a list")]:
        spec.write_text(text)
        assert needle in fails(capsys, "estimate", "--model", str(spec), *ESTIMATE)
    plan = tmp_path / "p.json"
    assert main(["plan", *TINY, "--out", str(plan)]) == 0
    data = json.loads(plan.read_text())
    plan.write_text(json.dumps({**data, "train": {**data["train"], "betas": [0.9]}}))
    capsys.readouterr()
    assert "field 'train.betas' has too few items (1)" in fails(capsys, "run", str(plan), "--dry-run")


def test_a_corrupt_plan_is_called_corrupt_and_may_be_written_again(tmp_path, capsys):
    """A plan file with a JSON slip YAML would forgive (a trailing comma) is not JSON, not "YAML"; a plan file cut
    short is still a plan file: `plan --out` writes it again, as the error says to."""
    plan = tmp_path / "p.json"
    assert main(["plan", *TINY, "--out", str(plan)]) == 0
    text = plan.read_text()
    plan.write_text(text.rstrip().removesuffix("}") + ",}")
    capsys.readouterr()
    err = fails(capsys, "run", str(plan), "--dry-run")
    assert "is not valid JSON (truncated or corrupt?)" in err and "YAML" not in err
    plan.write_text(text[: len(text) // 2])
    assert "is not valid JSON" in fails(capsys, "run", str(plan), "--dry-run")
    assert main(["plan", *TINY, "--out", str(plan)]) == 0 and load_plan(plan).world_size == 4


def test_a_cpu_node_of_more_ranks_than_cores_is_noted(tmp_path, capsys):
    gpu = tmp_path / "cpu2.yaml"
    gpu.write_text("name: cpu2\npeak_tflops: {fp32: 0.05}\nmemory_GiB: 16\nmemory_bandwidth_GBps: 10\ncores: 2\n")
    cluster = tmp_path / "c.yaml"
    cluster.write_text("name: c\ngpu: cpu2.yaml\ngpus_per_node: 8\nbackend: gloo\nprecision: fp32\n"
                       "intra_node: {bandwidth_GBps: 2, latency_us: 50}\n")
    common = ["--model", "tiny", "--cluster", str(cluster), "--global-batch", "16"]
    assert main(["plan", *common]) == 0
    assert "note: c: 8 ranks a node share its 2 cores (each priced 4x slower); --gpus 2 plans a core each" in (
        capsys.readouterr().err)
    assert main(["plan", *common, "--gpus", "2"]) == 0 and "share its" not in capsys.readouterr().err


def test_a_file_of_another_kind_is_named_as_such(tmp_path, capsys):
    """A model spec given to `run`, a plan given as a metrics file or to `estimate --plan`, a JSON file without a
    plan's schema: each says what the file is and which command takes it, not "corrupt"."""
    spec = tmp_path / "m.yaml"
    spec.write_text(LLAMA)
    plan = tmp_path / "p.json"
    assert main(["plan", *TINY, "--out", str(plan)]) == 0
    other = tmp_path / "config.json"
    other.write_text('{"hidden_size": 64}')
    capsys.readouterr()
    assert f"{spec} is YAML (a model spec or cluster profile?), not a plan file" in fails(capsys, "run", str(spec))
    assert f"plan file {other} is not a plan file (it has no \"schema\"" in fails(capsys, "run", str(other))
    assert f"{plan} is a plan file, not a metrics file" in fails(
        capsys, "calibrate", str(plan), "--out", str(tmp_path / "c.yaml"))
    assert f"`autopar run {plan} --dry-run` checks it" in fails(capsys, "estimate", *TINY, "--plan", str(plan))
    gone = tmp_path / "gone.json"  # the plan a run ran, moved since: a new plan of that name would not be it
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "step_time_s": 0.1, "plan": str(gone)}) + "\n"
                               for i in range(1, 6)))
    for command in (["calibrate", str(metrics), "--out", str(tmp_path / "c.yaml")], ["diagnose", str(metrics)]):
        assert (f"plan file {gone}, which metrics file {metrics} ran, is not there any more; pass the plan file the "
                "run used with --plan") in fails(capsys, *command)


@pytest.mark.parametrize("argv,needle", [
    (["run", "--mtbf-hours", "inf", "--checkpoint-dir", "ck"], "--mtbf-hours must be a positive number"),
    (["run", "--collective-timeout", "inf"], "--collective-timeout must be a positive number"),
    (["whatif", "--model", "tiny", "--cluster", "ib-roce-a100", "--global-batch", "64", "--vary",
      "group_nodes:roce=1.5"], "--vary group_nodes:roce takes whole numbers"),
    (["whatif", "--model", "tiny", "--cluster", "ib-roce-a100", "--global-batch", "64", "--vary",
      "group_bw:ib=abc"], "--vary group_bw:ib takes numbers"),
    ([*WHATIF[:5], *WHATIF[7:-2], "--vary", "gpus=0"], "whole numbers of at least 1"),
    ([*WHATIF[:-2], "--vary", "gpus=8,16"], "--vary gpus sets the cluster's size at each point; leave out --gpus"),
    ([*WHATIF[:-2], "--vary", "nodes=1,2"], "--gpus 16 with --vary nodes: --gpus there sets the GPUs of each node, "
                                            "at most dgx-a100's 8"),
    (["estimate", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "\uff18", "--global-batch", "4", "--plan",
      "tp=1"], "--gpus: takes a whole number"),
    (["estimate", "--model", "tiny", *ESTIMATE[:-1], "tp=1_0"], "plan key tp takes an integer, got '1_0'"),
    (["estimate", "--model", "tiny", *ESTIMATE[:-1], "tp=2 pp=2"],
     "plan key tp: '2 pp=2' holds another key=value; separate keys with commas, as in \"tp=2,pp=2\""),
    (["estimate", "--model", "tiny", *ESTIMATE[:-1], "tp==2"], "plan key tp: 'tp==2' has one '=' too many; write tp=2"),
    (["estimate", "--model", "tiny", *ESTIMATE[:-1], "tp=2=3"],  # (its advice was the bad input itself)
     "plan key tp: '2=3' is not one value; give tp one value, and separate keys with commas, as in \"tp=2,pp=2\""),
    (["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "4", "--global-batch", "64", "--fix", "mbs=3"],
     "global batch 64 is not divisible by mbs=3, whatever dp"),
    (["plan", "--model", "tiny", "--cluster", "ib-roce-a100", "--global-batch", "128", "--fix",
      "placement=ib*99999999999999999"], "at most 65,536 ranks in all"),
    (["plan", "--model", "tiny", "--cluster", "ib-roce-a100", "--global-batch", "128", "--fix",
      "placement=" + "/".join(["ib*60000"] * 3)], "at most 65,536 ranks in all"),
    (["plan", "--model", "tiny", "--cluster", "ib-roce-a100", "--global-batch", "128", "--fix",
      "placement=ib*" + "9" * 5000], "at most 65,536 ranks in all"),
    (["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "1", "--global-batch", "2", "--steps",
      "99999999999999999999999", "--out", "p.json"], "--steps must be at least 1 (and below 2^63)"),
    (["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "1", "--global-batch", "2", "--steps", "80"],
     "--steps sets the training steps written into the plan file: give --out FILE"),
    (["run", "--resume", "--replan", "--gpus", "0", "--checkpoint-dir", "ck"], "--gpus must be at least 1"),
    (["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "3", "--global-batch", "6", "--fix",
      "pp=3,layers=2/0/2"], "layers 2/0/2 leaves a stage between others empty"),
    (["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "8", "--fix",
      "pp=2,vpp=2,layers=2/1/0/1"], "layers 2/1/0/1 leaves a stage between others empty"),
])
def test_bad_flag_values(capsys, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    if argv[0] == "run" and "--replan" not in argv:
        assert main(["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "1", "--global-batch", "2",
                     "--out", "p.json"]) == 0
        capsys.readouterr()
        argv = ["run", "p.json", *argv[1:]]
    assert needle in fails(capsys, *argv)


def test_bad_files_found_by_the_hunt(tmp_path, capsys, monkeypatch):
    """YAML's yes/on are not switches; a node group whose profile is made of node groups (itself, say) is one
    line, not endless recursion; paths inside a profile are read from its folder; two entries linking the same
    groups and an empty node_groups are refused; a pipe as a spec is refused, not read forever."""
    spec = tmp_path / "m.yaml"
    spec.write_text(LLAMA + "tie_embeddings: yes\n")
    assert "field 'tie_embeddings': expected true or false, got 'yes'" in fails(
        capsys, "estimate", "--model", str(spec), *ESTIMATE)
    for value, shown in (("yes", "'yes'"), ("off", "'off'"), ('"true"', "'true'"), ("1", "1")):  # in a profile too
        (tmp_path / "tpx.yaml").write_text("name: c\ngpu: a100-sxm4-80gb\ngpus_per_node: 8\nintra_node: "
                                           f"{{bandwidth_GBps: 300}}\ntp_across_nodes: {value}\n")
        assert f"field 'tp_across_nodes': expected true or false, got {shown}" in fails(
            capsys, "estimate", "--model", "tiny", "--cluster", str(tmp_path / "tpx.yaml"), "--global-batch", "8",
            "--plan", "tp=1")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "self.yaml").write_text("name: x\nnode_groups:\n  - {name: a, profile: self.yaml, "
                                                "num_nodes: 1}\n")
    assert "is itself made of node groups" in fails(capsys, "estimate", "--model", "tiny", "--cluster",
                                                   str(tmp_path / "sub" / "self.yaml"), "--global-batch", "8",
                                                   "--plan", "tp=1")
    (tmp_path / "sub" / "g.yaml").write_text("name: g\npeak_tflops: {bf16: 312}\nmemory_GiB: 80\n"
                                             "memory_bandwidth_GBps: 2000\n")
    (tmp_path / "sub" / "c.yaml").write_text("name: c\ngpu: g.yaml\ngpus_per_node: 2\n"
                                             "intra_node: {bandwidth_GBps: 300}\n")
    monkeypatch.chdir(tmp_path)  # not the profile's folder: g.yaml is found beside c.yaml all the same
    assert main(["estimate", "--model", "tiny", "--cluster", "sub/c.yaml", "--global-batch", "8", "--plan",
                 "tp=1", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] > 0
    groups = ("name: x\nnode_groups:\n  - {name: a, gpu: a100-sxm4-80gb, num_nodes: 1, gpus_per_node: 8, "
              "inter_node: {nic_bandwidth_Gbps: 200, nics_per_node: 8}}\n  - {name: b, gpu: a100-sxm4-80gb, "
              "num_nodes: 1, gpus_per_node: 8, inter_node: {nic_bandwidth_Gbps: 200, nics_per_node: 8}}\n")
    (tmp_path / "twice.yaml").write_text(groups + "between_groups:\n  - {groups: [a, b], bandwidth_Gbps_per_node: 10}"
                                         "\n  - {groups: [b, a], bandwidth_Gbps_per_node: 20}\n")
    assert "links a and b twice" in fails(capsys, "estimate", "--model", "tiny", "--cluster", "twice.yaml",
                                          "--global-batch", "16", "--plan", "tp=1")
    (tmp_path / "loop.yaml").write_text(groups + "between_groups:\n  - {groups: [a, b], bandwidth_Gbps_per_node: 10}"
                                        "\n  - {groups: [a, a], bandwidth_Gbps_per_node: 20}\n")
    assert "between_groups links group a to itself" in fails(capsys, "estimate", "--model", "tiny", "--cluster",
                                                              "loop.yaml", "--global-batch", "16", "--plan", "tp=1")
    (tmp_path / "loop.yaml").write_text(groups + "between_groups:\n  - {groups: [a, b], bandwidth_Gbps_per_node: 10}"
                                        "\n  - {groups: [c, c], bandwidth_Gbps_per_node: 20}\n")  # a typo: unknown
    assert "between_groups names group 'c', which is not one of the node_groups" in fails(
        capsys, "estimate", "--model", "tiny", "--cluster", "loop.yaml", "--global-batch", "16", "--plan", "tp=1")
    (tmp_path / "empty.yaml").write_text("name: e\nnode_groups: []\n")
    assert "node_groups is empty" in fails(capsys, "estimate", "--model", "tiny", "--cluster", "empty.yaml",
                                           "--global-batch", "8", "--plan", "tp=1")
    import os

    os.mkfifo(tmp_path / "pipe.yaml")
    assert "is not a regular file" in fails(capsys, "estimate", "--model", "pipe.yaml", *ESTIMATE)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert "is a link to nothing" in fails(capsys, "estimate", "--model", "loop", *ESTIMATE)


def test_replan_can_grow_a_plan_made_below_a_node():
    """`plan --gpus 2` on an 8-GPU node keeps a node of 2 that remembers the full node (``full_node_gpus``), so
    `run --resume --replan --gpus 4` re-plans on the real node, for a bundled profile and one of the user's own;
    a plan file written before clusters remembered it gets the bundled node when its cluster is a bundled one."""
    from planner.commands.run import _full_size
    from specs.cluster_loading import load_cluster

    small = load_cluster("cpu-gloo", gpus=2)
    assert small.gpus_per_node == 2 and small.full_node_gpus == 8 and _full_size(small) is small
    grown = small.resized(gpus=4)
    assert (grown.gpus_per_node, grown.full_node_gpus) == (4, 8) and small.resized(gpus=8) == load_cluster("cpu-gloo")
    mine = load_cluster("cpu-gloo").model_copy(update={"name": "mine"}).resized(gpus=2)  # a profile of one's own
    assert _full_size(mine).resized(gpus=4).num_gpus == 4
    assert load_cluster("dgx-h100", gpus=2).resized(nodes=2).full_node_gpus is None  # nodes of the cut size: that is the node now
    from specs.cluster import ClusterSpec

    edited = ClusterSpec.model_validate({**small.model_dump(), "gpus_per_node": 8})  # a file edited since: the
    assert edited.full_node_gpus is None  # edit holds, the stale node size goes
    old = small.model_copy(update={"full_node_gpus": None})  # as plan files written before held it
    assert _full_size(old).resized(gpus=4).num_gpus == 4
    odd = old.model_copy(update={"name": "mine"})
    assert _full_size(odd) is odd
    slower = old.intra_node.model_copy(update={"bandwidth_GBps": old.intra_node.bandwidth_GBps / 2})
    edited = old.model_copy(update={"intra_node": slower})  # a profile of its own under a bundled name: kept
    assert _full_size(edited) is edited


def test_no_plan_fits_on_a_cluster_that_cannot_grow_says_why(capsys):
    """When nothing fits and the profile cannot be resized (no inter-node network; node groups sized by their
    profile), the error says so instead of claiming that no cluster size up to the limit fits."""
    err = fails(capsys, "plan", "--model", "llama3-70b", "--cluster", "cpu-gloo", "--global-batch", "8")
    assert "no plan fits" in err and "a larger cluster is not tried" in err and "no inter_node section" in err
    err = fails(capsys, "plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "16", "--global-batch", "16")
    assert "cluster cpu-gloo is one node of 8 GPUs (no inter_node section), so it cannot hold 16: use --gpus 8" in err
    assert "no cluster size up to" not in err
    err = fails(capsys, "plan", "--model", "gpt-1t", "--cluster", "dgx-a100", "--gpus", "8", "--global-batch", "8")
    assert "try --gpus" in err


def test_an_odd_seq_that_rules_out_cp_is_named_when_nothing_fits(capsys):
    """At 131,071 tokens no context-parallel split exists, so no plan of Llama 3 70B fits 64 H100s; the error names
    the length and the length that plans (which does), not only a memory shortfall and more GPUs."""
    err = fails(capsys, "plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch",
                "64", "--seq", "131071")
    assert "sequence length 131071 rules out context parallelism" in err and "--seq 131072 fits (" in err, err
    assert "and, an odd length, sequence parallelism" in err
    assert "cp=" in err.split("--seq 131072 fits (")[1]
    assert main(["plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch", "64",
                 "--seq", "131072"]) == 0
    capsys.readouterr()
    err = fails(capsys, "plan", "--model", "llama3-70b", "--cluster", "dgx-a100", "--gpus", "2", "--global-batch",
                "8")  # a length that splits: no word of it
    assert "rules out context parallelism" not in err


@pytest.mark.parametrize("nics", ["nic_bandwidth_Gbps: true, nics_per_node: 8", "nic_bandwidth_Gbps: 400, nics_per_node: false",
                                  "nic_bandwidth_Gbps: 400, nics_per_node: 8, latency_us: true"])
def test_a_node_groups_nics_refuse_true_and_false_as_numbers(tmp_path, capsys, nics):
    """A node group's NICs are read as a homogeneous cluster's are (one schema): true/false is not a number."""
    path = tmp_path / "groups.yaml"
    path.write_text("name: two\nnode_groups:\n"
                    "  - {name: a, gpu: a100-sxm4-80gb, num_nodes: 1, gpus_per_node: 8,\n"
                    "     inter_node: {nic_bandwidth_Gbps: 200, nics_per_node: 8}}\n"
                    f"  - {{name: b, gpu: h100-sxm5-80gb, num_nodes: 1, gpus_per_node: 8, inter_node: {{{nics}}}}}\n"
                    "default_between: {bandwidth_Gbps_per_node: 800}\n")
    err = fails(capsys, "plan", "--model", "tiny", "--cluster", str(path), "--global-batch", "8")
    field = next(kv.split(":")[0] for kv in nics.split(", ") if kv.endswith(("true", "false")))
    assert "expected a number, got" in err and field in err, err


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["model"].update(num_layers=4.0), "field 'model.num_layers': expected a whole number, got 4.0"),
    (lambda d: d["model"].update(hidden_size=64.5), "expected a whole number, got 64.5"),
    (lambda d: d["train"].update(lr=1e-3, min_lr=1e-2), "train.min_lr 0.01 is above train.lr 0.001"),
    (lambda d: d.update(global_batch=10**9), "field 'global_batch'"),  # the limit --global-batch has (specs.model)
])
def test_hand_edited_plan_files_are_checked_exactly(tmp_path, capsys, edit, needle):
    """A plan file's whole numbers are whole (4.0 is refused as global_batch 16.0 is), and its schedule decays."""
    path = tmp_path / "plan.json"
    assert main(["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "1", "--global-batch", "4",
                 "--out", str(path)]) == 0
    capsys.readouterr()
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    assert needle in fails(capsys, "run", str(path), "--dry-run")


def test_a_missing_group_profile_names_the_file_that_refers_to_it(tmp_path, capsys):
    path = tmp_path / "groups.yaml"
    path.write_text("name: g\nnode_groups:\n  - {name: a, profile: nothere.yaml, num_nodes: 2}\n"
                    "  - {name: b, profile: dgx-a100, num_nodes: 2}\n"
                    "default_between: {bandwidth_Gbps_per_node: 25}\n")
    err = fails(capsys, "plan", "--model", "tiny", "--cluster", str(path), "--global-batch", "8")
    assert f"cluster profile {path}: node_groups[0].profile: cluster profile nothere.yaml does not exist" in err


def test_an_empty_plan_to_estimate_is_refused(capsys):
    """`--plan "$PLAN"` with the variable unset priced the default plan without a word: refused, with an example."""
    for empty in ("", " ", ","):
        err = fails(capsys, "estimate", "--model", "tiny", *ESTIMATE[:-2], "--plan", empty)
        assert "--plan is empty; give the plan to price" in err


@pytest.mark.parametrize("vary, needle", [
    ("gpus=16,16,32", "--vary gpus gives 16 twice; give each point once"),
    ("inter_node_bw=100,100.0", "--vary inter_node_bw gives 100 twice"),
    ("gpu=h100-sxm5-80gb,h100-sxm5-80gb", "--vary gpu gives h100-sxm5-80gb twice"),
    ("gpus=16,,32", "--vary gpus=16,,32 has an empty value"),
])
def test_a_what_if_point_given_twice_or_empty_is_refused(capsys, vary, needle):
    """Duplicate points were planned and drawn twice, and an empty item dropped without a word."""
    argv = [a if not a.startswith("inter_node_bw=") else vary for a in WHATIF]
    assert needle in fails(capsys, *argv)


def test_an_empty_compare_is_refused(capsys):
    assert "--compare is empty" in fails(capsys, *WHATIF, "--compare", "")


def test_a_gpu_count_no_plan_splits_over_suggests_one_that_does(capsys, tmp_path):
    """Selene's 4,480 GPUs (35 x 128) hold no plan of tiny at global batch 16: the batch rule's advice alone (change
    the batch, dp or mbs) missed that another GPU count plans; the error names one that does."""
    err = fails(capsys, "plan", "--model", "tiny", "--cluster", "selene", "--global-batch", "16")
    assert "not divisible by dp*mbs" in err and "a plan of tiny exists on 4,096: --gpus 4096" in err
    # the largest whole-node count below that plans, not only powers of two: 1,000 GPUs (125 nodes) -> 124 nodes
    err = fails(capsys, "plan", "--model", "gpt3-175b", "--cluster", "selene", "--gpus", "1000", "--global-batch",
                "1536")
    assert "a plan of gpt3-175b exists on 992: --gpus 992" in err
    # inside one node every count below it (7 heads, batch 7 on 8 GPUs: 7 plans, dp=7; powers of two gave 4)
    (tmp_path / "prime.yaml").write_text("name: prime\narch: llama\nnum_layers: 7\nhidden_size: 1302\n"
                                         "num_attention_heads: 7\nnum_kv_heads: 1\nffn_hidden_size: 3001\n"
                                         "vocab_size: 50257\nseq_length: 4099\n")
    err = fails(capsys, "plan", "--model", str(tmp_path / "prime.yaml"), "--gpus", "8", "--global-batch", "7")
    assert "a plan of prime exists on 7: --gpus 7" in err
    assert main(["plan", "--model", "tiny", "--cluster", "selene", "--gpus", "4096", "--global-batch", "16",
                 "--format", "json"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("missing,argv", [
    ("runtime.memory_replay", ["estimate", "--model", "tiny", *ESTIMATE, "--verify"]),
    ("runtime.memory_replay", ["plan", *TINY, "--verify"]),
    ("runtime.launch", ["run", "--dry-run"]),
])
def test_a_command_that_needs_torch_says_how_to_install_it(capsys, monkeypatch, missing, argv):
    """On an install without the `run` extra (no PyTorch) the commands and options that need it say so in one line,
    naming the extra (--verify said "internal error: ModuleNotFoundError" once)."""
    import sys

    monkeypatch.setitem(sys.modules, missing, None)  # its import fails as torch's absence would make it fail
    line = fails(capsys, *argv)
    assert "needs PyTorch" in line and "pip install 'autopar[run]'" in line


@pytest.mark.parametrize("flag", ["--compare", "--fix"])
def test_a_what_if_tp_that_divides_no_heads_lists_the_ones_that_do(capsys, flag):
    """A sweep's keys are checked before its clusters are known: the tp values the error offers are every divisor of
    the heads (tiny: 1, 2, 4), not only those of the bad key's own GPU count (3 GPUs: 1)."""
    err = fails(capsys, "whatif", "--model", "tiny", "--cluster", "cpu-gloo", "--global-batch", "16", "--vary",
                "gpus=4,8", flag, "tp=3")
    assert f"{flag} tp=3: tp=3 does not divide the model's 8 attention heads and 4 kv heads; choose tp from 1, 2, 4" \
        in err


def test_a_metrics_file_that_is_not_text_or_has_a_bare_step_is_refused(capsys, tmp_path):
    """A binary file, and a line with a step but no step time (no line `autopar run` writes), were an OS decode
    error without advice and a line skipped without a word."""
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xff\xfe garbage\n")
    assert "is not text (not UTF-8): give the JSON-lines file" in fails(capsys, "diagnose", str(binary))
    bare = tmp_path / "s.jsonl"
    bare.write_text('{"step": 1, "step_time_s": 0.5}\n{"step": "x"}\n')
    assert "line 2 has a step but no step_time_s" in fails(capsys, "diagnose", str(bare))


def test_a_gpu_whose_table_passes_its_peak_is_refused_in_a_node_group_and_a_what_if(tmp_path, capsys):
    """The fastest group's GPU (not the one the merged view keeps) is checked too, in one line naming its group; a
    what-if point of such a GPU is an error point; a calibrated profile whose table a fit scaled past the peak says
    to calibrate again."""
    root = Path(__file__).resolve().parents[2]
    gpu = (root / "hardware_profiles" / "gpus" / "h100-sxm5-80gb.yaml").read_text()
    (tmp_path / "fast.yaml").write_text(gpu.replace("name: h100-sxm5-80gb", "name: h100-fast") +
                                        "\ngemm_table: [{m: 8192, n: 8192, k: 8192, tflops: 1500}]\n")
    mixed = (root / "hardware_profiles" / "clusters" / "a100-h100-ib.yaml").read_text()
    (tmp_path / "mixed.yaml").write_text(mixed.replace("gpu: h100-sxm5-80gb", "gpu: fast.yaml"))
    err = fails(capsys, "plan", "--model", "llama3-8b", "--cluster", str(tmp_path / "mixed.yaml"), "--global-batch",
                "512")
    assert "node group h100: gpu h100-fast: gemm_table m=8192 n=8192 k=8192: 1500 TFLOP/s is above its bf16 peak" \
        in err
    assert main(["whatif", "--model", "llama3-8b", "--cluster", "dgx-h100", "--global-batch", "64", "--vary",
                 f"gpu=h100-sxm5-80gb,{tmp_path / 'fast.yaml'}", "--format", "json"]) == 0
    pts = json.loads(capsys.readouterr().out)["curves"]["best"]
    assert "plan" in pts[0] and "1500 TFLOP/s is above its bf16 peak" in pts[1]["error"]
    from specs.cluster import table_rate_problem
    from specs.cluster_loading import load_gpu

    said = table_rate_problem(load_gpu(str(tmp_path / "fast.yaml")), "bf16", "nccl", calibrated=True)
    assert "a calibration scaled it there" in said and "calibrate the profile it was fitted on again" in said
