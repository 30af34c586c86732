"""`autopar calibrate`: recovers known efficiency scales from synthetic runs, and rejects bad metrics in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from planner.calibrate import PARAMS, fit_scales, predict, scaled
from planner.cli import main
from planner.measured_runs import Run, measured_median
from specs.cluster_loading import load_cluster
from specs.errors import AutoparError
from specs.model import ModelSpec
from specs.model_loading import load_model
from specs.parallel import ParallelConfig
from specs.planfile import load_plan, make_plan, save_plan

TRUE = {"gemm": 0.8, "attention": 0.7, "memory": 1.1, "overhead": 2.0, "comm": 0.6}  # within the datasheet


def _cases():
    """Runs on which different parts of the price dominate (GEMMs, attention, overhead, TP and DP traffic,
    memory-bound softmax), so every scale is identifiable."""
    gpt = dict(arch="gpt", dropout=0.0)
    return [
        (load_model("llama-1b"), 1, ParallelConfig(mbs=1), 8),
        (ModelSpec(name="long", arch="llama", num_layers=4, hidden_size=1024, num_attention_heads=8,
                   ffn_hidden_size=2816, vocab_size=32000, seq_length=16384), 1, ParallelConfig(mbs=1), 2),
        (ModelSpec(name="small", num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=1024,
                   seq_length=256, **gpt), 1, ParallelConfig(mbs=1), 4),
        (ModelSpec(name="mid", num_layers=8, hidden_size=2048, num_attention_heads=16, vocab_size=51200,
                   seq_length=2048, **gpt), 8, ParallelConfig(tp=8, mbs=1), 8),
        (load_model("llama-1b"), 8, ParallelConfig(dp=8, mbs=1), 8),
        (ModelSpec(name="wide", num_layers=2, hidden_size=1024, num_attention_heads=16, vocab_size=4096,
                   seq_length=1024, attention="unfused", **gpt), 1, ParallelConfig(mbs=4), 16),
    ]


def _write_runs(tmp_path, base, truth, embed: str = "path", steps: int = 12, phase: float = 0.0):
    """Plan files and metrics files whose step times are the cost model's on ``base`` scaled by ``truth``
    (+-0.3% jitter, shifted by ``phase`` for other measurements of the same plans; a slow first step that the warm-up
    must drop)."""
    paths = []
    for i, (model, gpus, cfg, batch) in enumerate(_cases()):
        plan = make_plan(model, base.resized(gpus=gpus), batch, cfg)
        plan_path = tmp_path / f"plan{i}.json"
        save_plan(plan, plan_path)
        t = float(predict([Run("", plan, 1.0, 1, None)], base, truth)[0])
        jitter = 1 + 0.003 * np.sin(np.arange(steps) * 1.7 + i + phase)
        rows = [{"step": s + 1, "loss": 5.0, "step_time_s": t * (5.0 if s == 0 else jitter[s]),
                 "predicted_step_time_s": plan.prediction.get("step_time_s")} for s in range(steps)]
        if embed == "path":
            rows[0]["plan"] = plan_path.name  # relative to the metrics file
        elif embed == "object":
            rows[0]["plan"] = json.loads(plan_path.read_text())
        m = tmp_path / f"m{i}.jsonl"
        m.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        paths.append((m, plan_path))
    return paths


def test_calibrate_recovers_known_scales(tmp_path, capsys):
    base = load_cluster("dgx-h100")
    runs = _write_runs(tmp_path, base, TRUE)
    out = tmp_path / "calibrated.yaml"
    assert main(["calibrate", *[str(m) for m, _ in runs], "--cluster", "dgx-h100", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "before" in text and "after" in text
    cal = load_cluster(str(out))
    e0, e1 = base.gpu.efficiency, cal.gpu.efficiency
    assert e1.gemm == pytest.approx(e0.gemm * TRUE["gemm"], rel=0.03)
    assert e1.attention_fwd == pytest.approx(e0.attention_fwd * TRUE["attention"], rel=0.03)
    assert e1.kernel_overhead_us == pytest.approx(e0.kernel_overhead_us * TRUE["overhead"], rel=0.03)
    assert cal.gpu.mem_bw == pytest.approx(base.gpu.mem_bw * TRUE["memory"], rel=0.03)
    assert cal.intra_node.bandwidth_GBps == pytest.approx(base.intra_node.bandwidth_GBps * TRUE["comm"], rel=0.03)
    # the written profile predicts the measured runs
    from cost_models.step import estimate
    from specs.planfile import load_plan

    for m, p in runs:
        plan = load_plan(p)
        rows = [json.loads(x) for x in m.read_text().splitlines()]
        med, _ = measured_median(rows, None, str(m))
        est = estimate(plan.model, cal.resized(gpus=plan.cluster.num_gpus), plan.config, plan.global_batch)
        assert est.step_time_s == pytest.approx(med, rel=0.02)


def test_a_fit_stops_at_what_the_datasheet_allows(tmp_path, capsys):
    """Runs faster than the GPU's peak and memory bandwidth allow: the fitted profile stays within them (its GEMM
    efficiency at most 1, every table rate at most the peak, its bandwidth at most the datasheet's) and says so."""
    from specs.cluster import GemmPoint

    base = load_cluster("dgx-h100")
    runs = _write_runs(tmp_path, base, {"gemm": 1.6, "memory": 1.5})
    out = tmp_path / "calibrated.yaml"
    assert main(["calibrate", *[str(m) for m, _ in runs], "--cluster", "dgx-h100", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "stopped at what the h100-sxm5-80gb's datasheet allows" in err and "memory x" in err and "gemm x" in err
    assert "stopped at what" in out.read_text()  # the profile's header says it too
    cal = load_cluster(str(out))
    assert cal.gpu.efficiency.gemm <= 1.0 and cal.gpu.efficiency.gemm == pytest.approx(1.0, rel=1e-3)
    assert cal.gpu.mem_bw <= base.gpu.memory_bandwidth_GBps * 1e9 * (1 + 1e-9)
    assert cal.gpu.mem_bw == pytest.approx(base.gpu.memory_bandwidth_GBps * 1e9, rel=1e-3)
    # a measured GEMM table: its fastest rate reaches the peak and no further
    tabled = base.model_copy(update={"gpu": base.gpu.model_copy(update={
        "gemm_table": [GemmPoint(m=8192, n=8192, k=8192, tflops=800.0), GemmPoint(m=1024, n=1024, k=1024,
                                                                                  tflops=400.0)]})})
    plans = [load_plan(p) for _, p in runs]
    fast = [Run("", plan, 0.5 * float(predict([Run("", plan, 1.0, 1, None)], tabled, {})[0]), 10, None)
            for plan in plans]
    fit = fit_scales(fast, tabled)
    top = max(p.tflops for p in scaled(tabled, fit.scales).gpu.gemm_table)
    assert top == pytest.approx(tabled.gpu.peak("bf16") / 1e12, rel=1e-3)


def test_fit_with_one_run_removes_its_error():
    """One run cannot tell the parameters apart: the fit makes the smallest change that explains it."""
    base = load_cluster("dgx-a100")
    model, gpus, cfg, batch = _cases()[0]
    plan = make_plan(model, base.resized(gpus=gpus), batch, cfg)
    t0 = float(predict([Run("", plan, 1.0, 1, None)], base, {})[0])
    run = Run("", plan, 1.3 * t0, 10, None)
    s = fit_scales([run], base).scales
    assert float(predict([run], base, s)[0]) == pytest.approx(1.3 * t0, rel=0.01)
    assert all(1 / 8 <= v <= 8 for v in s.values()) and s["gemm"] < 1.0


def test_embedded_plan_and_plan_flag(tmp_path, capsys):
    base = load_cluster("dgx-h100")
    runs = _write_runs(tmp_path, base, {"gemm": 0.9}, embed="object")[:2]
    out = tmp_path / "new" / "c.yaml"  # a folder that does not exist yet is created
    assert main(["calibrate", *[str(m) for m, _ in runs], "--fit", "gemm", "--out", str(out)]) == 0
    assert "gemm x0.9" in capsys.readouterr().out
    bare = _write_runs(tmp_path, base, {"gemm": 0.9}, embed="none")[:2]
    args = ["calibrate", *[str(m) for m, _ in bare], "--out", str(out), "--fit", "gemm"]
    assert main(args + sum((["--plan", str(p)] for _, p in bare), [])) == 0
    assert load_cluster(str(out)).gpu.efficiency.gemm == pytest.approx(base.gpu.efficiency.gemm * 0.9, rel=0.02)


def test_scaling_keeps_a_valid_profile():
    base = load_cluster("dgx-h100")
    c = scaled(base, {p: 8.0 for p in PARAMS})
    assert c.gpu.efficiency.gemm <= 1.0 and c.gpu.efficiency.attention_fwd <= 1.0
    assert scaled(base, {}).gpu.mem_bw == pytest.approx(base.gpu.mem_bw)


def test_the_comm_scale_reaches_bandwidths_measured_by_node_count():
    """A profile whose network was measured at several node counts (busbw_by_nodes) is as fast at each of them after
    a comm scale of 2 as twice its bandwidth: the scale reaches every measured count, not only busbw_GBps."""
    from pathlib import Path

    from cost_models.comm import CommModel

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "ultrascale-h100-efa.yaml"
    base = load_cluster(str(path), gpus=512)
    fast = scaled(base, {"comm": 2.0})
    for nodes in (2, 4, 16, 64):
        n = 8 * nodes
        before, after = CommModel(base.resized(gpus=n)), CommModel(fast.resized(gpus=n))
        big = 2.0**34  # bandwidth-bound: latency (halved too) is negligible
        assert float(after.all_gather(big, n)) == pytest.approx(float(before.all_gather(big, n)) / 2, rel=1e-3)


def test_bandwidths_by_node_count_survive_the_files_they_are_written_to(tmp_path):
    """A calibrated profile (YAML, its node counts quoted as text) and a plan file (JSON, whose keys are text) read
    back the same per-node-count bandwidths; a comm scale that takes NVLink past 1.25x its datasheet (a fit, not a
    typo) still loads."""
    from pathlib import Path

    from planner.calibrate import calibrated, profile_yaml
    from specs.cluster import Calibration
    from specs.planfile import load_plan, make_plan, save_plan

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "ultrascale-h100-efa.yaml"
    base = load_cluster(str(path), nodes=2)
    fast = calibrated(base, Calibration(runs=3, scales={"comm": 2.0}, log_covariance=((0.01,),)))
    (tmp_path / "cal.yaml").write_text(profile_yaml(fast, ["calibrated"]))
    again = load_cluster(str(tmp_path / "cal.yaml"))
    assert again.collectives["all_reduce"]["inter"].busbw_by_nodes == fast.collectives["all_reduce"]["inter"].busbw_by_nodes
    plan = make_plan(load_model("llama3-8b"), base, 64, ParallelConfig(tp=8, dp=2))
    save_plan(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json").cluster.collectives == base.collectives


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("", "is empty"),
    ('{"step": 1, "step_time_s": 0.5}\n{"step": 2, "step_\n{"step": 3, "step_time_s": 0.5}\n',
     "line 2 is not valid JSON"),  # corrupt inside: refused
    ('{"step": 1, "step_time_s": 0.5}\n{"step": 2, "step_\n', "line 2 is not valid JSON"),  # whole, yet corrupt
    ('{"loss": 1.0}\n', "no step lines"),
    ('{"step": 1, "step_time_s": -1}\n', "positive number"),
    ('{"step": "a", "step_time_s": 0.5}\n', "step must be a non-negative integer"),
    ('{"step": null, "step_time_s": 0.5}\n', "step must be a non-negative integer"),
    ('{"step": 1, "step_time_s": 0.5}\n', "does not say which plan"),
])
def test_bad_metrics_are_one_line_errors(tmp_path, capsys, content, message):
    m = tmp_path / "m.jsonl"
    if content is not None:
        m.write_text(content)
    assert main(["calibrate", str(m), "--out", str(tmp_path / "o.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopar: error:") and message in err[0]


def test_bad_embedded_plans_are_one_line_errors(tmp_path, capsys):
    """A plan embedded in a metrics file is checked like a plan file: types, schema, plan vs cluster."""
    (m, _), = _write_runs(tmp_path, load_cluster("dgx-h100"), {}, embed="object")[:1]
    rows = [json.loads(line) for line in m.read_text().splitlines()]
    plan = rows[0]["plan"]
    for edit, message in [
            ({"parallel": {**plan["parallel"], "tp": "1"}}, "plan key tp must be an integer"),
            ({"parallel": {**plan["parallel"], "tp": 0}}, "tp must be at least 1"),
            ({"parallel": {**plan["parallel"], "pp": 2, "vpp": 3}}, "embedded plan"),
            ({"parallel": {**plan["parallel"], "dp": 2}}, "the plan needs 2 GPUs (tp=1 pp=1 dp=2"),
            ({"schema": "autopar.plan/9"}, "has schema 'autopar.plan/9'")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text("\n".join(json.dumps({**r, "plan": {**plan, **edit}} if i == 0 else r)
                                 for i, r in enumerate(rows)) + "\n")
        assert main(["calibrate", str(bad), "--out", str(tmp_path / "o.yaml")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "embedded plan" in err[0] and message in err[0], (edit, err)
    assert not (tmp_path / "o.yaml").exists()


def test_bad_options_are_one_line_errors(tmp_path, capsys):
    base = load_cluster("dgx-h100")
    (m, p), (m2, _) = _write_runs(tmp_path, base, {}, embed="none", steps=2)[:2]
    cases = [
        (["--plan", str(p), "--warmup", "2"], "warm-up"),  # both steps are warm-up
        (["--plan", str(p), "--fit", "gemm,bogus"], "unknown parameter 'bogus'"),
        (["--plan", str(p), "--fit", "gemm,gemm"], "'gemm' given twice"),
        (["--plan", str(p), "--fit", ""], "--fit is empty"),  # not every scale, silently
        (["--plan", str(p), "--fit", " , "], "--fit is empty"),
        (["--plan", str(p), "--plan", str(p), "--plan", str(p)], "one --plan for all"),
        (["--plan", str(tmp_path / "missing.json")], "does not exist"),
        (["--plan", str(p), "--out", ""], "must not be empty"),
        (["--plan", str(p), "--out", str(m / "o.yaml")], "is a file, not a folder"),
    ]
    for extra, message in cases:
        out = [] if "--out" in extra else ["--out", str(tmp_path / "o.yaml")]
        assert main(["calibrate", str(m), str(m2), *out, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (extra, err)


def test_calibrate_does_not_import_torch():
    code = ("import sys, planner.calibrate, planner.measured_runs, planner.commands.calibrate, planner.cli; "
            "assert 'torch' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_last_line_cut_off_mid_write_is_skipped_with_a_note(tmp_path, capsys):
    """What a crash mid-write leaves (a last line with no newline that does not parse): the steps before it
    count, and a note says what was skipped."""
    from planner.measured_runs import read_segments

    m = tmp_path / "m.jsonl"
    m.write_text('{"plan": "p.json"}\n{"step": 1, "step_time_s": 0.5}\n{"step": 2, "step_time_s": 0.6}\n{"step": 3, "st')
    (run,) = read_segments(m)
    assert [r["step"] for r in run.rows] == [1, 2] and run.plan == "p.json"
    assert "skipped its last line 4, cut off mid-write" in capsys.readouterr().err
    read_segments(m, notes=False)
    assert capsys.readouterr().err == ""


def test_a_run_with_few_measured_steps_is_warned_about(capsys):
    from planner.measured_runs import MIN_STEPS, measured_median

    rows = [{"step": i, "step_time_s": 0.5 + 0.01 * i} for i in range(1, 5)]
    assert measured_median(rows, 1, "m.jsonl") == (pytest.approx(0.53), 3)
    assert f"only 3 step(s) after the warm-up; a median of fewer than {MIN_STEPS}" in capsys.readouterr().err
    many = [{"step": i, "step_time_s": 0.5} for i in range(1, 12)]
    measured_median(many, 1, "m.jsonl")
    assert capsys.readouterr().err == ""


def test_a_run_of_one_step_is_not_fitted_from_its_warm_up():
    """The default warm-up leaves out at least the first step: a one-step run is refused (it measured allocation and
    compilation, 2.5x a steady step in the walkthrough that found it), unless --warmup 0 asks for it."""
    from planner.measured_runs import measured_median

    one = [{"step": 1, "step_time_s": 0.44}]
    with pytest.raises(AutoparError, match="its one step is the warm-up.*--warmup 0"):
        measured_median(one, None, "m.jsonl")
    assert measured_median(one, 0, "m.jsonl")[0] == pytest.approx(0.44)
    two = [{"step": 1, "step_time_s": 0.44}, {"step": 2, "step_time_s": 0.17}]
    assert measured_median(two, None, "m.jsonl")[0] == pytest.approx(0.17)


def test_a_plan_the_metrics_were_not_written_by_is_refused(tmp_path, capsys):
    """--plan must be the plan that wrote the metrics: a file naming another plan, or holding another rank count's
    phases, is a one-line error rather than a fit of the wrong model."""
    base = load_cluster("dgx-h100")
    (m0, p0), (m1, p1) = _write_runs(tmp_path, base, {"gemm": 0.9}, embed="path")[:2]
    out = str(tmp_path / "c.yaml")
    assert main(["calibrate", str(m0), "--plan", str(p1), "--out", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was written by a run of" in err[0] and "leave --plan out" in err[0], err
    assert main(["calibrate", str(m0), "--plan", str(p0), "--out", out, "--fit", "gemm"]) == 0  # its own plan
    capsys.readouterr()
    rows = [json.loads(line) for line in m1.read_text().splitlines()]
    for r in rows:
        r.pop("plan", None)
        r["phases_s"] = {"forward": [0.1, 0.1]}  # two ranks' phases; the plan runs one
    m1.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["calibrate", str(m1), "--plan", str(p1), "--out", out]) == 2
    assert "has 2 ranks' phases, but --plan" in capsys.readouterr().err


def test_scales_at_the_fits_limit_are_warned_about():
    """A scale the fit pushed to its bound says the runs were not timed on the profile's hardware."""
    from planner.calibrate import bound_warning

    assert bound_warning({"gemm": 0.9, "memory": 1.3}) is None
    warning = bound_warning({"gemm": 0.125, "memory": 1.3, "overhead": 8.0})
    assert "gemm x0.125" in warning and "overhead x8" in warning and "memory" not in warning
    from planner.measured_runs import Run
    from specs.cluster_loading import load_cluster
    from specs.model_loading import load_model
    from specs.parallel import ParallelConfig
    from specs.planfile import make_plan

    cpu = load_cluster("cpu-gloo", gpus=4)  # four ranks on a machine measured to have two cores
    cpu = cpu.model_copy(update={"gpu": cpu.gpu.model_copy(update={"cores": 2})})
    run = Run("m.jsonl", make_plan(load_model("tiny"), cpu, 16, ParallelConfig(dp=4)), 0.2, 10, None)
    crowded = bound_warning({"comm": 0.125}, runs=[run])
    assert "runs put 4 ranks on 2 cores, where a collective waits for peers the cores are not running" in crowded
    assert "far from what the profile describes" not in crowded
    assert "far from what the profile describes" in bound_warning({"gemm": 0.125}, runs=[run])  # not the network's limit
    # the bundled CPU profile does not know this machine's cores; tune's trials ran here, where it says how many
    bundled = Run("m.jsonl", make_plan(load_model("tiny"), load_cluster("cpu-gloo", gpus=4), 16, ParallelConfig(dp=4)),
                  0.2, 10, None)
    assert "far from what the profile describes" in bound_warning({"comm": 0.125}, runs=[bundled])
    assert "runs put 4 ranks on 2 cores" in bound_warning({"comm": 0.125}, runs=[bundled], cores_here=2)
    assert "far from what" in bound_warning({"comm": 0.125}, runs=[bundled], cores_here=4)  # a core each


def test_a_fit_that_predicts_the_steps_worse_says_so():
    from planner.calibrate import worse_fit_warning

    assert worse_fit_warning(0.30, 0.10) is None and worse_fit_warning(0.1, 0.1) is None
    said = worse_fit_warning(0.304, 0.342)
    assert "worse than the profile did (30.4% -> 34.2% mean error)" in said and "keep the profile you had" in said


def _two_plan_metrics(tmp_path, base, truth, steps=(8, 6)):
    """One metrics file that a run of plan A and its resume under plan B both appended to (as `autopar run
    --resume --metrics-out` does): every step line names its plan, the resume's steps go on from A's last step,
    and each run's first step is slow (its own warm-up). Returns the file, the two plan paths and their true
    step times (the cost model's on ``base`` scaled by ``truth``)."""
    cases = _cases()
    lines, plans, times, step = [], [], [], 0
    for tag, (model, gpus, cfg, batch), n in zip("ab", (cases[0], cases[4]), steps):
        plan = make_plan(model, base.resized(gpus=gpus), batch, cfg)
        path = tmp_path / f"{tag}.json"
        save_plan(plan, path)
        t = float(predict([Run("", plan, 1.0, 1, None)], base, truth)[0])
        plans.append(path)
        times.append(t)
        for i in range(n):
            step += 1
            lines.append({"step": step, "step_time_s": t * (4.0 if i == 0 else 1 + 0.002 * (-1) ** i),
                          "plan": str(path)})
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return m, plans, times


def test_a_file_with_runs_of_two_plans_is_fitted_as_two_runs(tmp_path, capsys):
    """A run and its resume under another plan in one metrics file are two measured runs: each paired with its own
    plan, its own warm-up dropped, its own median; the fit recovers the true scale from both."""
    from planner.measured_runs import load_runs

    base = load_cluster("dgx-h100")
    m, (pa, pb), (ta, tb) = _two_plan_metrics(tmp_path, base, {"gemm": 0.8})
    a, b = load_runs([str(m)], None, None)
    assert (a.plan.config, b.plan.config) == (load_plan(pa).config, load_plan(pb).config)
    assert (a.steps, b.steps) == (7, 5)  # 8 and 6 steps, less one warm-up step each
    assert a.measured_s == pytest.approx(ta, rel=0.003) and b.measured_s == pytest.approx(tb, rel=0.003)
    assert (a.source, b.source) == (f"{m} (steps 1-8)", f"{m} (steps 9-14)")
    out = tmp_path / "c.yaml"
    assert main(["calibrate", str(m), "--cluster", "dgx-h100", "--fit", "gemm", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(steps 1-8)" in text and "median of 7 steps" in text and "(steps 9-14)" in text
    assert "median of 5 steps" in text and "(2 run(s))" in text
    assert load_cluster(str(out)).gpu.efficiency.gemm == pytest.approx(base.gpu.efficiency.gemm * 0.8, rel=0.02)


def test_a_one_step_run_beside_others_is_left_out_with_a_note(tmp_path, capsys):
    """A resume of one step under another plan in a file of several runs: that run is left out (its step is
    warm-up), the others fitted; --warmup 0 keeps it."""
    from planner.measured_runs import load_runs

    m, _, _ = _two_plan_metrics(tmp_path, load_cluster("dgx-h100"), {"gemm": 0.8}, steps=(8, 1))
    (a,) = load_runs([str(m)], None, None)
    assert a.source == f"{m} (steps 1-8)" and "left out 1 run(s) of one step" in capsys.readouterr().err
    assert len(load_runs([str(m)], None, 0)) == 2


def test_a_resume_under_the_same_plan_continues_its_run(tmp_path):
    """Lines of one plan around a restart's event line (and lines that leave the plan out) stay one run; the step
    the restart redid counts once, as redone."""
    from planner.measured_runs import read_segments

    m = tmp_path / "m.jsonl"
    rows = [{"step": 1, "step_time_s": 0.9, "plan": "p.json"}, {"step": 2, "step_time_s": 0.5, "plan": "p.json"},
            {"event": "restart", "attempt": 1, "resumed_after_step": 1}, {"step": 2, "step_time_s": 0.6},
            {"step": 3, "step_time_s": 0.5, "plan": "p.json"}, {"step": 4, "step_time_s": 0.2, "plan": "q.json"},
            {"step": 5, "step_time_s": 0.3, "plan": "p.json"}]
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = read_segments(m)
    assert [(s.plan, [r["step"] for r in s.rows]) for s in runs] == [
        ("p.json", [1, 2, 3]), ("q.json", [4]), ("p.json", [5])]
    assert runs[0].rows[1]["step_time_s"] == 0.6


def test_plan_flag_on_a_file_of_several_runs_is_refused(tmp_path, capsys):
    m, (pa, _), _ = _two_plan_metrics(tmp_path, load_cluster("dgx-h100"), {})
    assert main(["calibrate", str(m), "--plan", str(pa), "--out", str(tmp_path / "o.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds 2 runs of different plans" in err[0] and "leave --plan out" in err[0], err
    assert "steps 1-8" in err[0] and "steps 9-14" in err[0]


def _cpu_run(tmp_path, slower: float):
    """A metrics file of a tiny tp=2 pp=2 plan on cpu-gloo whose steps take ``slower`` x what the cost model
    predicts for that plan on dgx-a100 (a CPU run is some 40x slower than an A100's)."""
    plan = make_plan(load_model("tiny"), load_cluster("cpu-gloo", gpus=4), 16, ParallelConfig(tp=2, pp=2, mbs=4))
    save_plan(plan, tmp_path / "p.json")
    t = slower * float(predict([Run("", plan, 1.0, 1, None)], load_cluster("dgx-a100"), {})[0])
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps({"step": s, "step_time_s": t, "plan": "p.json"}) + "\n" for s in range(1, 11)))
    return m, plan


def test_runs_from_other_hardware_are_refused_not_written(tmp_path, capsys):
    """CPU runs calibrated as an A100 profile: no scales within the fit's limits explain them, so the command
    refuses in one line rather than writing a profile that still misses them several-fold."""
    m, _ = _cpu_run(tmp_path, 40.0)
    out = tmp_path / "o.yaml"
    assert main(["calibrate", str(m), "--cluster", "dgx-a100", "--out", str(out)]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopar: error:"), err
    assert "do not look like they ran on --cluster dgx-a100" in err[0] and "leave --cluster out" in err[0]
    assert cap.out == "" and not out.exists()
    # 1.3x the A100's prediction: a correction within the limits, written
    m, _ = _cpu_run(tmp_path, 1.3)
    assert main(["calibrate", str(m), "--cluster", "dgx-a100", "--out", str(out)]) == 0
    assert out.exists() and "mean |error|" in capsys.readouterr().out


def test_runs_far_from_their_plans_hardware_are_refused(tmp_path, capsys):
    """Without --cluster the plans' own profile is calibrated: runs 1000x slower than it are refused too."""
    m, plan = _cpu_run(tmp_path, 1.0)
    t = 1000 * float(predict([Run("", plan, 1.0, 1, None)], plan.cluster, {})[0])
    m.write_text("".join(json.dumps({"step": s, "step_time_s": t, "plan": "p.json"}) + "\n" for s in range(1, 11)))
    assert main(["calibrate", str(m), "--out", str(tmp_path / "o.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hardware their plans carry" in err[0] and "autopar profile" in err[0], err


def _stamped_run(tmp_path, cfg: ParallelConfig, steps: int = 8):
    """A plan file and a metrics file as `autopar run` writes them (each line names the plan and is stamped with
    what it was)."""
    plan = tmp_path / "p.json"
    cluster = load_cluster("cpu-gloo", gpus=4)
    save_plan(make_plan(load_model("tiny"), cluster, 16, cfg), plan)
    stamp = load_plan(plan).made_for
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps({"step": s, "step_time_s": 0.1, "plan": str(plan), "plan_made_for": stamp}) + "\n"
                         for s in range(1, steps + 1)))
    return plan, m


def test_a_plan_file_changed_since_the_run_is_refused(tmp_path, capsys):
    """A plan file re-planned into after its run (another layout) no longer says what the run ran: calibrate and
    diagnose refuse it in one line (the metrics lines' stamp), and a --plan of another layout is refused too."""
    plan, m = _stamped_run(tmp_path, ParallelConfig(tp=2, pp=2))
    save_plan(make_plan(load_model("tiny"), load_cluster("cpu-gloo", gpus=4), 16, ParallelConfig(tp=4)), plan)
    for argv in (["calibrate", str(m), "--out", str(tmp_path / "o.yaml")], ["diagnose", str(m)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"plan file {plan} has changed since metrics file" in err[0], err
        assert "its parallel keys differ" in err[0] and "--plan" in err[0]
    assert main(["calibrate", str(m), "--plan", str(plan), "--out", str(tmp_path / "o.yaml")]) == 2
    assert "was written by a run of another plan than --plan" in capsys.readouterr().err
    assert not (tmp_path / "o.yaml").exists()


def test_calibrate_never_writes_over_the_plan_a_metrics_file_names(tmp_path, capsys):
    plan, m = _stamped_run(tmp_path, ParallelConfig(tp=4))
    before = plan.read_bytes()
    assert main(["calibrate", str(m), "--out", str(plan)]) == 2
    err = capsys.readouterr().err
    assert f"is the plan file {plan} this command reads" in err and plan.read_bytes() == before
    again = os.path.join(str(tmp_path), ".", "m.jsonl")  # the same file by another name
    assert main(["calibrate", str(m), again, "--out", str(tmp_path / "o.yaml")]) == 2
    err = capsys.readouterr().err  # one run counted twice would narrow the fit's spreads
    assert f"metrics file {again} is given twice (also as {m})" in err


def test_a_resume_after_replanning_into_the_same_file_is_two_runs(tmp_path, capsys):
    """A run, the plan file re-planned into (another layout), and the run resumed under it with the same metrics
    file: two runs (the lines' stamps differ). The first no longer has its plan file: it is left out with a note,
    the second is fitted; alone, the changed run is an error that says to pass its plan."""
    from planner.measured_runs import load_runs, read_segments

    plan, m = _stamped_run(tmp_path, ParallelConfig(tp=2, pp=2), steps=6)
    first = m.read_text()
    save_plan(make_plan(load_model("tiny"), load_cluster("cpu-gloo", gpus=4), 16, ParallelConfig(tp=4)), plan)
    stamp = load_plan(plan).made_for
    m.write_text(first + "".join(json.dumps({"step": s, "step_time_s": 0.2, "plan": str(plan),
                                             "plan_made_for": stamp}) + "\n" for s in range(7, 13)))
    runs = read_segments(m)
    assert [[r["step"] for r in s.rows] for s in runs] == [list(range(1, 7)), list(range(7, 13))]
    (run,) = load_runs([str(m)], None, None)
    assert run.plan.config.tp == 4 and run.measured_s == 0.2 and run.source.endswith("(steps 7-12)")
    assert "left out 1 run(s) whose plan file has changed since" in capsys.readouterr().err


def test_runs_on_two_profiles_of_one_gpu_need_cluster(tmp_path, capsys):
    """Runs planned on two measured profiles of one GPU (two `autopar profile`s of a CPU host are both `cpu`): left
    to the plans' own profile, calibrate would price every run on the first one's; it asks which instead. Runs of
    one profile at different sizes are one profile."""
    base = load_cluster("dgx-h100")
    runs = _write_runs(tmp_path, base, TRUE)  # one profile, 1 to 8 GPUs
    out = tmp_path / "cal.yaml"
    assert main(["calibrate", *[str(m) for m, _ in runs[:3]], "--out", str(out)]) == 0
    other = base.model_copy(update={"gpu": base.gpu.model_copy(update={
        "efficiency": base.gpu.efficiency.model_copy(update={"gemm": 0.6})})})
    model, gpus, cfg, batch = _cases()[0]
    plan = make_plan(model, other.resized(gpus=gpus), batch, cfg)
    save_plan(plan, tmp_path / "other.json")
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({"step": s, "step_time_s": 1.0, "plan": "other.json"})
                                                  + "\n" for s in range(1, 9)))
    capsys.readouterr()
    assert main(["calibrate", str(runs[0][0]), str(tmp_path / "other.jsonl"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "the runs were planned on different profiles of h100-sxm5-80gb" in err and "--cluster PROFILE" in err
    assert main(["calibrate", str(runs[0][0]), str(tmp_path / "other.jsonl"), "--cluster", "dgx-h100", "--out",
                 str(out)]) == 0


def test_calibrating_a_calibrated_profile_keeps_totals_within_the_limit(tmp_path, capsys):
    """`calibrate --out` naming its --cluster updates a profile in place: a second fit's factors are recorded as
    totals (what the first applied times what it adds), and the fit's limit (x1/8 .. x8) holds for the total: runs
    that ask for comm x0.1 stop at x0.125, however often they are fitted."""
    base = load_cluster("dgx-h100")
    prof = tmp_path / "p.yaml"
    from planner.calibrate import profile_yaml

    prof.write_text(profile_yaml(base, ["a copy of dgx-h100"]))
    totals = []
    for i in range(2):  # new runs each time (the same runs twice are refused: the next test)
        (tmp_path / f"r{i}").mkdir()
        runs = _write_runs(tmp_path / f"r{i}", base, {"comm": 0.1}, phase=i)
        assert main(["calibrate", *[str(m) for m, _ in runs], "--cluster", str(prof), "--fit", "comm", "--out",
                     str(prof)]) == 0
        cal = load_cluster(str(prof))
        totals.append(cal.calibration.scales["comm"])
        assert cal.intra_node.bandwidth_GBps == pytest.approx(base.intra_node.bandwidth_GBps * totals[-1], rel=1e-6)
    assert totals == pytest.approx([0.125, 0.125], rel=1e-6)
    assert "at the fit's limit" in capsys.readouterr().err
    head = prof.read_text().splitlines()
    assert "the factors are totals" in head[0]
    # each calibration keeps the header of the profile it calibrated (what measured it) under its own
    assert f"# Calibrated from {prof}, whose header read:" in head  # the first calibration's, nested under
    assert f"#   Calibrated from {prof}, whose header read:" in head  # ... and the original's under it
    assert "#     a copy of dgx-h100" in head
    assert sum(line.startswith("#   Calibrated by `autopar calibrate`") for line in head) == 1


def test_runs_fitted_into_a_profile_are_not_fitted_again(tmp_path, capsys):
    """A calibrated profile records the runs fitted into it: calibrating it again on any of them (wherever their file
    now is) is refused in one line naming them, and the profile is left as it was; new runs calibrate it."""
    import shutil

    base = load_cluster("dgx-h100")
    runs = _write_runs(tmp_path, base, TRUE)
    prof = tmp_path / "p.yaml"
    assert main(["calibrate", *[str(m) for m, _ in runs], "--cluster", "dgx-h100", "--out", str(prof)]) == 0
    assert len(load_cluster(str(prof)).calibration.fitted) == len(runs)
    before = prof.read_text()
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copy(runs[0][0], moved / "renamed.jsonl")
    shutil.copy(runs[0][1], moved / runs[0][1].name)  # (the plan its first line names, beside it)
    capsys.readouterr()
    for again in ([str(m) for m, _ in runs], [str(moved / "renamed.jsonl")]):
        assert main(["calibrate", *again, "--cluster", str(prof), "--out", str(prof)]) == 2
        err = capsys.readouterr().err
        assert f"already fitted into {prof} (a calibrated profile)" in err and again[0] in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert prof.read_text() == before
    assert main(["calibrate", *[str(m) for m, _ in runs], "--cluster", str(prof), "--warmup", "3", "--out",
                 str(prof)]) == 2  # another warm-up makes no new run of it
    assert "already fitted into" in capsys.readouterr().err and prof.read_text() == before
    assert main(["calibrate", str(runs[0][0]), str(moved / "renamed.jsonl"), "--cluster", "dgx-h100", "--out",
                 str(tmp_path / "twice.yaml")]) == 2  # a copy given beside its original: the same run twice
    assert f"{runs[0][0]} and {moved / 'renamed.jsonl'} hold the same run" in capsys.readouterr().err
    assert not (tmp_path / "twice.yaml").exists()
    (tmp_path / "new").mkdir()
    fresh = _write_runs(tmp_path / "new", base, TRUE, phase=0.5)  # the same plans measured again
    assert main(["calibrate", *[str(m) for m, _ in fresh], "--cluster", str(prof), "--out", str(prof)]) == 0
    assert len(load_cluster(str(prof)).calibration.fitted) == len(runs) + len(fresh)
