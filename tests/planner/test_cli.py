"""The command line: JSON contract, one-line errors with exit 2, plan files, what-if outputs, no torch."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main
from specs.planfile import load_plan

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_estimate_json_contract(capsys):
    code, out, err = run(capsys, "estimate", "--model", "gpt3-175b", "--cluster", "dgx-a100", "--gpus", "64",
                         "--global-batch", "64", "--plan", "tp=8,pp=8,mbs=1,vpp=3,sp=true,recompute=selective",
                         "--format", "json")
    assert code == 0 and err == ""
    d = json.loads(out)
    for key in ("step_time_s", "tokens_per_s", "model_flops_per_step", "mfu", "memory_GiB", "fits", "breakdown"):
        assert key in d
    assert d["tokens_per_s"] == pytest.approx(64 * 2048 / d["step_time_s"], rel=1e-4)
    assert d["mfu"] == pytest.approx(d["model_flops_per_step"] / (d["step_time_s"] * 64 * 312e12), rel=1e-4)
    assert sum(d["breakdown"].values()) == pytest.approx(d["step_time_s"], rel=1e-4)
    assert d["parallel"]["dp"] == 1  # omitted dp = gpus / (tp*pp*cp)


def test_estimate_table(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "llama2-7b", "--cluster", "dgx-h100", "--global-batch", "16",
                       "--plan", "tp=2,pp=2,mbs=1")
    assert code == 0
    assert "step time" in out and "pipeline bubble" in out and "optimizer" in out and "activations" in out
    # a pipeline's table says each rank's work per micro-batch: an uneven stage (4 layers over 3 ranks) shows
    code, out, _ = run(capsys, "estimate", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "3",
                       "--global-batch", "16", "--plan", "pp=3,mbs=1")
    work = re.search(r"by pipeline rank: ([\d.]+) ms / ([\d.]+) ms / ([\d.]+) ms", " ".join(out.split()))
    assert code == 0 and work and float(work[2]) > 1.5 * min(float(work[1]), float(work[3]))
    code, out, _ = run(capsys, "estimate", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "2",
                       "--global-batch", "16", "--plan", "pp=2,vpp=2,mbs=1")  # 4 virtual stages on 2 ranks
    text = " ".join(out.split())
    assert code == 0 and "busiest pipeline rank spends it (rank " in text and " of 2)" in text
    assert re.search(r"by pipeline rank: [\d.]+ ms / [\d.]+ ms; the bubble", text)
    # a deep pipeline's equal middle ranks are one entry with their ranks, not one each
    code, out, _ = run(capsys, "estimate", "--model", "llama3-405b", "--cluster", "dgx-h100", "--gpus", "8192",
                       "--global-batch", "2048", "--plan", "tp=8,pp=64,cp=2,mbs=1,sp=1")
    work = re.search(r"by pipeline rank: ([^;]*);", " ".join(out.split()))
    assert code == 0 and work and work[1].count(" / ") <= 4, work
    spans = [tuple(map(int, x)) for x in re.findall(r"\(ranks (\d+)-(\d+)\)", work[1])]
    assert spans and sum(b - a + 1 for a, b in spans) + work[1].count(" / ") + 1 - len(spans) == 64


def test_per_rank_values_name_runs_of_equal_ones():
    from planner.report import per_rank

    assert per_rank(["1 ms", "2 ms", "2 ms", "3 ms"]) == "1 ms / 2 ms / 2 ms / 3 ms"
    assert per_rank(["1 ms", "2 ms", "2 ms", "2 ms", "3 ms", "3 ms", "3 ms"]) == "1 ms / 2 ms (ranks 1-3) / 3 ms (ranks 4-6)"


BAD = [
    (["estimate", "--model", "nope", "--global-batch", "8", "--plan", "tp=1"], "unknown model 'nope'"),
    (["estimate", "--model", "gpt3-175b", "--global-batch", "8", "--plan", "tp=5"], "tp=5 does not divide"),
    (["estimate", "--model", "gpt3-175b", "--gpus", "64", "--global-batch", "8", "--plan", "tp=8,pp=3"],
     "not divisible by tp*pp*cp"),
    (["estimate", "--model", "gpt3-175b", "--gpus", "64", "--global-batch", "7", "--plan", "tp=8,pp=4"],
     "not divisible by dp*mbs"),
    (["estimate", "--model", "gpt3-175b", "--plan", "tp=8"], "required: --global-batch"),
    (["estimate", "--model", "gpt3-175b", "--global-batch", "8", "--plan", "tp=8", "--gpus", "12"],
     "not a whole number of dgx-a100 nodes"),
    (["estimate", "--model", "gpt3-175b", "--global-batch", "8", "--plan", "tp=8", "--cluster", "nowhere"],
     "unknown cluster 'nowhere'"),
    (["plan", "--model", "gpt3-175b", "--global-batch", "8", "--fix", "tp=x"], "takes an integer"),
    (["whatif", "--model", "gpt3-175b", "--global-batch", "8", "--vary", "colour=red"], "cannot vary 'colour'"),
    (["run", "/nonexistent/plan.json"], "does not exist"),
    (["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "4", "--global-batch", "8", "--fix", "zero=7"],
     "--fix zero=7: must be one of 0, 1, 2, 3"),
    (["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "4", "--global-batch", "8", "--fix", "pp=0"],
     "must be at least 1"),
    (["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "4", "--global-batch", "8", "--fix", "layers=1/1"],
     "sum to 4"),
    (["plan", "--model", "llama2-7b", "--global-batch", "16", "--headroom", "nan"], "--headroom must be between"),
    (["plan", "--model", "llama2-7b", "--global-batch", "16", "--out", "/proc/nonexistent/p.json"],
     "cannot write plan file"),
    (["whatif", "--model", "llama2-7b", "--global-batch", "16", "--vary", "inter_node_bw=inf"], "finite and at least 0.01"),
    (["whatif", "--model", "llama2-7b", "--global-batch", "16", "--vary", "inter_node_bw=100,200"], "is one node here"),
    (["estimate", "--model", "gpt3-175b", "--global-batch", "8", "--plan", "tp=8,pp=0"], "must be at least 1"),
    (["bogus"], "invalid choice"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a[:3]) for a, _ in BAD])
def test_bad_input_one_line_exit_2(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("autopar: error: ")
    assert needle in err
    assert "Traceback" not in err


def test_corrupt_and_mismatched_plan_files(tmp_path, capsys):
    p = tmp_path / "plan.json"
    p.write_text('{"schema": "autopar.plan/1", "model": ')
    code, _, err = run(capsys, "run", str(p))
    assert code == 2 and "not valid JSON" in err
    p.write_text(json.dumps({"schema": "something/9"}))
    code, _, err = run(capsys, "run", str(p))
    assert code == 2 and "schema" in err
    # keys edited to use 12 of two 8-GPU nodes: no part of the cluster; said of the plan file, not of --gpus
    p = tmp_path / "edited.json"  # (plan --out refuses to replace a file that is not a plan, as the one above)
    assert run(capsys, "plan", "--model", "llama2-7b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch",
               "64", "--out", str(p))[0] == 0
    data = json.loads(p.read_text())
    data["parallel"].update(tp=1, pp=3, dp=4, cp=1, vpp=1, sp=False, tp_overlap=False, layers=None)
    p.write_text(json.dumps(data))
    code, _, err = run(capsys, "run", str(p), "--dry-run")
    assert code == 2 and "plan uses 12 of cluster dgx-h100's 16 GPUs" in err and "--gpus" not in err


def test_plan_json_and_plan_file_roundtrip(tmp_path, capsys):
    out_file = tmp_path / "best.json"
    code, out, _ = run(capsys, "plan", "--model", "llama2-7b", "--cluster", "dgx-h100", "--gpus", "16",
                       "--global-batch", "64", "--top", "3", "--out", str(out_file), "--format", "json")
    assert code == 0
    d = json.loads(out)
    assert 1 <= len(d["plans"]) <= 3 and d["search"]["candidates"] > 100 and d["why"]
    times = [p["step_time_s"] for p in d["plans"]]
    assert times == sorted(times)
    plan = load_plan(out_file)
    assert plan.config.to_dict() == d["plans"][0]["parallel"]
    assert plan.prediction["step_time_s"] == pytest.approx(d["plans"][0]["step_time_s"])
    # the plan file keeps the prediction as `plan` printed it, band and keys included (docs/contract.md)
    assert plan.prediction["step_time_band_s"] == d["plans"][0]["step_time_band_s"]
    assert plan.prediction["for"]["parallel"] == d["plans"][0]["parallel"] and plan.prediction_is_current
    assert plan.world_size == 16


def test_tune_takes_top_as_the_design_names_it():
    """../shared/DESIGN.md writes `autopar tune ... [--top K]`; `--trials` is the same option."""
    from planner.cli import build_parser

    base = ["tune", "--model", "tiny", "--cluster", "cpu-gloo", "--global-batch", "16"]
    assert build_parser().parse_args([*base, "--top", "2"]).trials == 2
    assert build_parser().parse_args([*base, "--trials", "4"]).trials == 4
    assert build_parser().parse_args(base).trials == 3


def test_cross_node_tp_flag_estimate_plan_and_plan_file(tmp_path, capsys):
    base = ("--model", "llama2-7b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "64")
    code, _, err = run(capsys, "estimate", *base, "--plan", "tp=16")
    assert code == 2 and "--allow-cross-node-tp" in err and err.count("\n") == 1
    code, out, _ = run(capsys, "estimate", *base, "--plan", "tp=16", "--allow-cross-node-tp", "--format", "json")
    assert code == 0 and json.loads(out)["parallel"]["tp"] == 16
    code, out, _ = run(capsys, "estimate", *base, "--plan", "tp=16", "--allow-cross-node-tp")
    assert code == 0 and "tensor parallelism may span nodes" in out
    out_file = tmp_path / "tp16.json"
    code, out, _ = run(capsys, "plan", *base, "--fix", "tp=16", "--allow-cross-node-tp", "--out", str(out_file),
                       "--format", "json")
    assert code == 0 and all(p["parallel"]["tp"] == 16 and not p["parallel"]["tp_overlap"]
                             for p in json.loads(out)["plans"])
    plan = load_plan(out_file)  # the plan file carries the permission with its cluster
    assert plan.config.tp == 16 and plan.cluster.tp_across_nodes


def test_plan_keeps_the_default_headroom_and_warns_only_without_it(capsys):
    """By default a plan leaves 10% of the GPU free (cost_models/headroom.py); --headroom 0 may choose a fuller plan,
    with a warning naming the margin that clears it."""
    base = ("--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "8", "--global-batch", "1024",
            "--format", "json")
    code, out, _ = run(capsys, "plan", *base)
    d = json.loads(out)
    assert code == 0 and d["search"]["headroom_GiB"] == pytest.approx(8.0) and d["warnings"] == []
    assert all(p["memory_GiB"] <= 0.9 * 80 for p in d["plans"])
    code, out, _ = run(capsys, "plan", *base, "--headroom", "0")
    d = json.loads(out)
    assert code == 0 and d["plans"][0]["memory_GiB"] > 0.9 * 80
    (warning,) = d["warnings"]
    margin = int(re.search(r"--headroom (\d+)", warning).group(1))
    assert margin == 8 and f"{d['plans'][0]['memory_GiB']:.1f} of 80 GiB" in warning
    code, out, _ = run(capsys, "plan", *base, "--headroom", str(margin))
    d = json.loads(out)
    assert code == 0 and d["warnings"] == [] and d["plans"][0]["memory_GiB"] <= 80 - margin


def test_plan_table_explains(capsys):
    code, out, _ = run(capsys, "plan", "--model", "gpt-7.5b", "--cluster", "dgx-a100", "--gpus", "32",
                       "--global-batch", "128")
    assert code == 0 and "why:" in out and "faster than the fastest plan laid out otherwise" in out and "best plan keys:" in out


def test_plan_nothing_fits(capsys):
    code, out, err = run(capsys, "plan", "--model", "llama3-70b", "--cluster", "dgx-a100", "--gpus", "2",
                         "--global-batch", "8", "--format", "json")
    assert code == 2
    d = json.loads(out)
    assert d["plans"] == [] and d["min_gpus"] > 2 and d["closest"]["memory_GiB"] > 80
    assert "no plan fits" in err and "try --gpus" in err


def test_whatif_csv_json_and_plot(tmp_path, capsys):
    png = tmp_path / "w.png"
    code, out, _ = run(capsys, "whatif", "--model", "llama2-13b", "--cluster", "dgx-a100", "--gpus", "32",
                       "--global-batch", "256", "--vary", "inter_node_bw=25,100,400", "--compare", "dp_overlap=false",
                       "--plot", str(png), "--format", "csv")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 6 and {r["curve"] for r in rows} == {"best", "dp_overlap=false"}
    # bandwidth sweeps: throughput relative to the best point of all curves, so the curves compare
    eff = {(r["curve"], float(r["inter_node_bw"])): float(r["scaling_efficiency"]) for r in rows}
    tps = {(r["curve"], float(r["inter_node_bw"])): float(r["tokens_per_s"]) for r in rows}
    top = max(tps.values())
    for k in eff:
        assert eff[k] == pytest.approx(tps[k] / top)
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"
    code, out, _ = run(capsys, "whatif", "--model", "llama2-13b", "--global-batch", "256",
                       "--vary", "gpus=8,16,32", "--format", "json")
    d = json.loads(out)
    pts = d["curves"]["best"]
    assert [p["gpus"] for p in pts] == [8, 16, 32] and pts[0]["scaling_efficiency"] == pytest.approx(1.0)



OLD_CSV = ["curve", "tokens_per_s", "step_time_s", "mfu", "scaling_efficiency", "memory_GiB", "plan", "plan_changed",
           "note"]  # (the varied key second) the columns before error and gpus were added: they keep their places


def whatif_csv(capsys, *argv: str) -> tuple[list[str], list[dict[str, str]]]:
    code, out, err = run(capsys, "whatif", "--model", "tiny", "--global-batch", "64", *argv, "--format", "csv")
    assert code == 0, err
    header = next(csv.reader(io.StringIO(out)))
    return header, list(csv.DictReader(io.StringIO(out)))


def test_whatif_csv_says_why_a_point_has_no_plan(capsys):
    """A point without a plan has the reason in the CSV's error column (empty where there is a plan), as in the
    JSON and the table; the columns that were there keep their places."""
    header, rows = whatif_csv(capsys, "--cluster", "dgx-a100", "--vary", "gpus=8,1000")
    assert header == [OLD_CSV[0], "gpus", *OLD_CSV[1:], "error"]
    assert rows[0]["error"] == "" and float(rows[0]["tokens_per_s"]) > 0
    assert rows[1]["gpus"] == "1000" and rows[1]["tokens_per_s"] == ""
    assert "no parallel configuration of 1000 GPUs" in rows[1]["error"]
    header, rows = whatif_csv(capsys, "--cluster", "dgx-a100", "--gpus", "8",
                              "--vary", "gpu=a100-sxm4-80gb,v100-sxm2-32gb")
    assert header == [OLD_CSV[0], "gpu", *OLD_CSV[1:], "error", "gpus"]
    assert rows[0]["error"] == "" and rows[0]["gpus"] == "8"
    assert "v100-sxm2-32gb has no bf16" in rows[1]["error"] and rows[1]["plan"] == ""


def test_whatif_csv_of_a_node_group_size_sweep_has_its_gpu_count(capsys):
    """--vary group_nodes changes the GPU count along the sweep: the CSV says it (a gpus column, appended), also
    for a point without a plan."""
    header, rows = whatif_csv(capsys, "--cluster", "ib-roce-a100", "--vary", "group_nodes:roce=2,4")
    assert header == [OLD_CSV[0], "group_nodes:roce", *OLD_CSV[1:], "error", "gpus"]
    assert [r["gpus"] for r in rows] == ["80", "96"]  # 8 InfiniBand nodes and 2 or 4 RoCE nodes of 8 GPUs
    assert rows[0]["error"] and rows[1]["error"] == "" and float(rows[1]["tokens_per_s"]) > 0


def test_planning_commands_do_not_import_torch():
    code = (
        "import sys, io, contextlib\n"
        "from planner.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    assert main(['estimate', '--model', 'gpt3-175b', '--global-batch', '8', '--plan', 'tp=8']) == 0\n"
        "    assert main(['plan', '--model', 'tiny', '--cluster', 'cpu-gloo', '--gpus', '4', '--global-batch', '8']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_plan_json_is_the_whole_stdout_when_the_ilp_runs():
    """The stage ILP runs (pipelined finalists): the solver's own banner must not reach stdout (fd 1)."""
    out = subprocess.run([sys.executable, "-m", "planner.cli", "plan", "--model", "gpt3-175b", "--gpus", "64",
                          "--global-batch", "256", "--top", "2", "--format", "json"],
                         capture_output=True, text=True, cwd=ROOT, check=True).stdout
    plans = json.loads(out)["plans"]
    assert len(plans) == 2 and any(p["parallel"]["pp"] > 1 for p in plans)


def test_plan_says_train_it_only_for_plans_the_runtime_executes(tmp_path, capsys):
    common = ["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "4", "--global-batch", "16"]
    assert main([*common, "--fix", "tp=2,sp=true,tp_overlap=true", "--out", str(tmp_path / "o.json")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"train it with: autopar run {tmp_path / 'o.json'}" in out and "cannot execute" not in out
    assert main(["plan", "--model", "tests.fixtures.toy_lm:build", "--cluster", "cpu-gloo", "--gpus", "1",
                 "--global-batch", "4", "--out", str(tmp_path / "toy.json")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "cannot execute it: model" in out and "traced from its own nn.Module" in out
    assert main([*common, "--runnable", "--out", str(tmp_path / "ok.json")]) == 0
    assert f"train it with: autopar run {tmp_path / 'ok.json'}" in " ".join(capsys.readouterr().out.split())


def test_runnable_is_kept_and_changes_nothing(capsys):
    """Every plan the planner emits is one the runtime executes: --runnable (kept for old scripts) finds the same
    plans, tp_overlap included."""
    common = ["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "8", "--global-batch", "16",
              "--fix", "tp=2,sp=true,tp_overlap=true", "--format", "json"]
    assert main(common) == 0
    plain = json.loads(capsys.readouterr().out)["plans"]
    assert main([*common, "--runnable"]) == 0
    runnable = json.loads(capsys.readouterr().out)["plans"]
    assert [p["parallel"] for p in runnable] == [p["parallel"] for p in plain]
    assert all(p["parallel"]["tp_overlap"] for p in plain)


def test_plan_rows_carry_a_band_and_ties_recommend_tune(capsys):
    """Every plan in `plan --format json` has a band around its step time from the model's validation
    (planner/uncertainty.py); the number of plans tied with the best follows the stated margin, and when there
    are any, "why" says to measure them with `autopar tune`."""
    from planner import uncertainty

    code, out, _ = run(capsys, "plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "512",
                       "--global-batch", "1024", "--format", "json")
    d = json.loads(out)
    assert code == 0
    for p in d["plans"]:
        lo, hi = p["step_time_band_s"]
        assert lo < p["step_time_s"] < hi
        b = uncertainty.band(p["parallel"]["pp"] > 1)
        assert (lo, hi) == pytest.approx((p["step_time_s"] * b.low, p["step_time_s"] * b.high), rel=1e-4)
    steps = [p["step_time_s"] for p in d["plans"]]
    u = d["uncertainty"]
    assert u["tied_with_best"] >= sum(s / steps[0] - 1 < u["tie_margin"] for s in steps[1:]) > 0  # of all refined
    assert "autopar tune" in d["why"] and f"{u['tie_margin']:.1%}" in d["why"]
    code, out, _ = run(capsys, "plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "512",
                       "--global-batch", "1024", "--format", "json", "--top", "1")
    assert json.loads(out)["uncertainty"]["tied_with_best"] == u["tied_with_best"]  # not only the plans shown
    assert "autopar tune --model llama3-70b --cluster dgx-h100 --gpus 512 --global-batch 1024 --dir SHARED_FOLDER" \
        in d["why"]  # the command that tunes what was planned (it left out --gpus: followed, it tuned one node; and
    # on several nodes tune needs the folder every node shares)


def test_a_tie_count_that_ran_out_of_exactly_priced_plans_says_so(capsys):
    """Where every exactly priced plan after the best is tied with it, the count is a lower bound (it grew with
    --top): the JSON says so, and "why" says "or more"."""
    argv = ["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "8", "--format",
            "json"]
    code, out, _ = run(capsys, *argv)
    few = json.loads(out)
    assert code == 0 and few["uncertainty"]["tied_more"] is True and " or more plans are within" in few["why"]
    code, out, _ = run(capsys, *argv, "--top", "30")
    assert json.loads(out)["uncertainty"]["tied_with_best"] >= few["uncertainty"]["tied_with_best"]


def test_a_reader_that_goes_away_ends_the_command_cleanly():
    """`autopar plan | head -1`: the first line arrives, and the command ends with status 0 and nothing on stderr
    (rich alone would exit 1, failing scripts run with `set -o pipefail`)."""
    import subprocess
    import sys

    cmd = (f"set -o pipefail; {sys.executable} -m planner.cli plan --model llama3-8b --cluster dgx-h100 --gpus 64 "
           "--global-batch 512 | head -1")
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("model   llama3-8b") and done.stderr == ""


def test_the_best_plan_keys_line_is_never_wrapped(capsys):
    """The keys line is copied whole into --fix / --plan: a long one (a placement on node groups) stays on one line
    when the output is not a terminal (rich would wrap it at 140 columns, inside a key)."""
    assert main(["plan", "--model", "llama3-8b", "--cluster", "ib-roce-a100", "--global-batch", "256", "--fix",
                 "placement=ib+roce"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("best plan keys: "))
    assert len(line) > 140 and line.endswith("placement=ib+roce")


def test_a_plan_too_big_for_this_machines_memory_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    """Every rank of a CPU run (a gloo plan, or a CUDA plan where there is no CUDA, in fp32) lives in this machine's
    memory: when the memory model prices them above what it has available, `run` refuses in one line before any
    worker starts, naming both; a plan that fits starts as before (here: a dry run, which checks nothing)."""
    import planner.commands.run as run_cmd

    small = tmp_path / "tiny.json"
    assert main(["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "8",
                 "--out", str(small)]) == 0
    big = tmp_path / "big.json"
    assert main(["plan", "--model", "llama3-8b", "--cluster", "dgx-a100", "--gpus", "8", "--global-batch", "8",
                 "--seq", "512", "--out", str(big)]) == 0
    capsys.readouterr()
    monkeypatch.setattr(run_cmd, "available_GiB", lambda: 0.01)
    monkeypatch.setattr("runtime.launch.local_gpus", lambda: None)
    assert main(["run", str(small), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "its 2 ranks would train on this machine's CPU and need about" in err and "0.0 GiB available" in err
    assert "\n" not in err
    assert main(["run", str(big), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "its 8 ranks would train on this machine's CPU in fp32 (no CUDA here)" in err
    need = float(err.split("need about ")[1].split(" GiB")[0])
    assert need > 100  # 8B parameters at 16 bytes each in fp32 with Adam, whatever the split: 120 GiB and more
    assert main(["run", str(small), "--steps", "1", "--dry-run"]) == 0


def test_a_cpu_estimate_s_band_says_it_comes_from_gpu_runs(capsys):
    """The band's residuals are GPU runs: on CPU ranks (gloo, not calibrated) the line says so and names tune."""
    for cluster, said in (("cpu-gloo", True), ("dgx-a100", False)):
        assert main(["estimate", "--model", "tiny", "--cluster", cluster, "--gpus", "1", "--global-batch", "8",
                     "--plan", "mbs=8"]) == 0
        band = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("band"))
        assert ("measured on GPUs: CPU ranks" in band) == said, band


def test_an_estimate_that_does_not_fit_says_by_how_much(capsys):
    """`estimate` of a plan over the GPU's memory says the fullest stage's need against what a plan may use (the
    GPU less its headroom), not only "fits: no"."""
    assert main(["estimate", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch",
                 "512", "--plan", "tp=8,dp=8,mbs=2,sp=true,zero=2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"fits no: \d+\.\d GiB per GPU, above the 72 GiB a plan may use \(80 GiB less 8 GiB kept free: "
                     r"the default headroom", out), out
    assert main(["estimate", "--model", "tiny", "--cluster", "dgx-h100", "--gpus", "1", "--global-batch", "8",
                 "--plan", "mbs=8"]) == 0
    assert "fits no" not in capsys.readouterr().out


def test_a_tie_goes_to_the_plan_recomputing_less_and_why_says_it_is_a_tie(capsys):
    """Llama 3 70B on 64 H100s: selective recompute fills only a wait on the network, the two plans tie exactly; the
    one without it is chosen (its recompute would cost real time on a network faster than priced) and "why" says
    the two sides cancel, not that one outweighs the other."""
    assert main(["plan", "--model", "llama3-70b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch", "128",
                 "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best, second = out["plans"][:2]
    assert best["step_time_s"] == pytest.approx(second["step_time_s"], rel=1e-9)
    assert best["parallel"]["recompute"] == "none" and second["parallel"]["recompute"] == "selective"
    assert "less recomputation, offset by" in out["why"] and "outweigh" not in out["why"]
    from planner.uncertainty import sharded_rows

    assert ("No run behind the bands sharded gradients or parameters as ZeRO-3 does" in out["why"]) == (
        best["parallel"]["zero"] == 3 and sharded_rows() == 0)  # the band borrowed from plans that did not shard
    assert sharded_rows({"a": [{"plan": "tp=8 zero=3", "ratio": 1.0, "pipelined": False},
                               {"plan": "tp=8 zero=1", "ratio": 1.0, "pipelined": True}]}) == 1


def test_a_narrow_terminal_folds_table_cells_and_no_color_means_no_escapes(monkeypatch):
    """A table wider than the terminal folds its cells onto more lines ("685.6k" cut to "685…" would read as another
    number); with NO_COLOR set the console writes no escape codes at all, bold and italics included."""
    from rich.table import Table

    from planner.report import _Console, console

    table = Table(title="plans")
    for col in ("plan", "tokens/s", "MFU"):
        table.add_column(col)
    table.add_row("tp=1 pp=1 dp=64 mbs=1 zero=2 dp_overlap", "685.6k", "62.7%")
    out = io.StringIO()
    _Console(file=out, width=30, color_system=None).print(table)
    text = out.getvalue()
    assert "…" not in text and "685." in text and "6k" in text
    monkeypatch.setenv("FORCE_COLOR", "1")  # as on a terminal
    out = io.StringIO()
    con = console()
    con.file = out
    con.print(table)
    assert "\x1b[" in out.getvalue()
    monkeypatch.setenv("NO_COLOR", "1")
    out = io.StringIO()
    con = console()
    con.file = out
    con.print(table)
    assert "\x1b[" not in out.getvalue()


def _floats(obj):
    if isinstance(obj, float):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _floats(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _floats(v)


def test_every_json_number_is_written_to_6_significant_digits(capsys):
    """docs/contract.md: predictions are written to 6 significant digits everywhere, the memory replay's rows and
    the ranking uncertainty included."""
    pytest.importorskip("torch")  # --verify replays the runtime
    common = ["--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "8", "--format", "json"]
    for argv in (["plan", *common, "--verify"], ["estimate", *common, "--plan", "tp=2", "--verify"],
                 ["whatif", *common[:4], *common[6:], "--vary", "gpus=1,2"]):
        code, out, err = run(capsys, *argv)
        assert code == 0, err
        data = json.loads(out)
        floats = list(_floats(data))
        assert floats and all(float(f"{x:.6g}") == x for x in floats), [x for x in floats if float(f"{x:.6g}") != x]
        if argv[0] != "whatif":
            assert data["memory_replay"], argv


def test_plan_json_of_every_kind_is_written_to_6_significant_digits(capsys):
    """The plan JSON's other parts: a cluster of node groups (its homogeneous baseline, a headroom of mixed GPUs), a
    plan that does not fit (the closest one: pp=1, no bubble), a mixture of experts (its balanced-routing step)."""
    for argv, code_wanted, part in (
            (["--model", "llama3-8b", "--cluster", "a100-h100-ib", "--global-batch", "512"], 0, "homogeneous_baseline"),
            (["--model", "llama3-8b", "--cluster", "a100-l40s-mixed", "--global-batch", "64"], 0, "search"),
            (["--model", "llama3-70b", "--cluster", "dgx-a100", "--gpus", "8", "--global-batch", "64"], 2, "closest"),
            (["--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch", "256"], 0,
             "plans")):
        code, out, err = run(capsys, "plan", *argv, "--format", "json")
        assert code == code_wanted, err
        data = json.loads(out)
        floats = list(_floats(data))
        assert data[part] and all(float(f"{x:.6g}") == x for x in floats), [x for x in floats if float(f"{x:.6g}") != x]
        if part == "closest":
            assert data["closest"]["parallel"]["pp"] == 1 and data["closest"]["bubble_fraction"] == 0.0


def test_plan_says_when_fewer_gpus_train_faster(capsys):
    """Selene's 560 nodes (4,480 GPUs): GPT-3 175B's best plan there needs a 35-stage pipeline, and 512 of the
    nodes train faster outright; plan says so (table and JSON). A power-of-two cluster has nothing to say."""
    code, out, err = run(capsys, "plan", "--model", "gpt3-175b", "--cluster", "selene", "--global-batch", "1536",
                         "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    fewer, best = data["fewer_gpus"], data["plans"][0]
    assert fewer["gpus"] == 4096 and fewer["tokens_per_s"] > 1.02 * best["tokens_per_s"]
    assert fewer["gain"] == pytest.approx(fewer["tokens_per_s"] / best["tokens_per_s"] - 1, rel=1e-4)
    code, out, err = run(capsys, "plan", "--model", "gpt3-175b", "--cluster", "selene", "--global-batch", "1536")
    assert code == 0 and "fewer GPUs: on 4,096 of the 4,480 GPUs (512 nodes)" in " ".join(out.split())
    code, out, err = run(capsys, "plan", "--model", "gpt3-175b", "--cluster", "selene", "--gpus", "4096",
                         "--global-batch", "1536", "--format", "json")
    assert code == 0 and "fewer_gpus" not in json.loads(out)
    # 124 nodes: of 64 and 96 nodes (the largest 2^k and 3 x 2^k below), 96 trains faster; the hint names it
    code, out, err = run(capsys, "plan", "--model", "gpt3-175b", "--cluster", "selene", "--gpus", "992",
                         "--global-batch", "1536", "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["fewer_gpus"]["gpus"] == 768, err
    code, out, err = run(capsys, "plan", "--model", "gpt3-175b", "--cluster", "selene", "--gpus", "512",
                         "--global-batch", "1536", "--format", "json")
    assert code == 0 and json.loads(out)["plans"][0]["tokens_per_s"] < data["fewer_gpus"]["tokens_per_s"]


@pytest.mark.parametrize("command", ["estimate", "plan", "whatif", "tune"])
def test_help_lists_every_plan_key_with_what_it_is(capsys, command):
    from specs.parallel import KEYS

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out.split("plan keys (key=value, comma-separated):\n", 1)[1]
    listed = [line.split()[0] for line in shown.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    assert listed == list(KEYS)
    flat = " ".join(shown.split())
    assert all(" ".join(info.doc.split()) in flat for info in KEYS.values())
