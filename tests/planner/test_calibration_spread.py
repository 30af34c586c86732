"""A calibrated profile knows what its runs pinned: the fit's posterior spread per scale, and plans that lean on a
scale the runs did not exercise get a wider band (planner/calibrate.py, planner/uncertainty.py)."""

from __future__ import annotations

import json
import math

import pytest

from planner.calibrate import (
    PRIOR,
    PRIOR_LOG_SD,
    RUN_NOISE,
    calibrated,
    calibration_spread,
    difference_spreads,
    fit_scales,
    predict,
    scale_sd,
    step_sensitivity,
)
from planner.cli import main
from planner.measured_runs import Run
from planner.uncertainty import Z95, step_band
from planner.whatif import with_gpu
from specs.cluster_loading import load_cluster
from specs.model import ModelSpec
from specs.parallel import ParallelConfig
from specs.planfile import make_plan, save_plan

TRUTH = {"gemm": 0.85, "attention": 0.5, "memory": 0.7}


def _model(seq: int) -> ModelSpec:
    return ModelSpec(name=f"gpt-{seq}", arch="gpt", num_layers=4, hidden_size=1024, num_attention_heads=8,
                     vocab_size=32000, seq_length=seq, dropout=0.0, attention="flash")


def _short_runs(base):
    """One-GPU runs at 1k tokens, step times the cost model's on ``base`` scaled by TRUTH: attention is a small
    part of them, the network none."""
    runs = []
    for mbs, batch in ((1, 8), (4, 16), (8, 32)):
        plan = make_plan(_model(1024), base.resized(gpus=1), batch, ParallelConfig(mbs=mbs))
        t = float(predict([Run("", plan, 1.0, 1, None)], base, TRUTH)[0])
        runs.append(Run(f"mbs {mbs}", plan, t, 10, None))
    return runs


def test_one_scale_one_run_has_the_gaussian_posterior_spread():
    """One run, one scale: the posterior of a linearised Gaussian model, sd = noise / sqrt(g^2 + prior)."""
    base = load_cluster("dgx-h100")
    run = _short_runs(base)[0]
    fit = fit_scales([run], base, ("gemm",))
    h = 1e-3
    s = fit.scales["gemm"]
    g = (math.log(predict([run], base, {"gemm": s * math.exp(-h)})[0]) - math.log(predict([run], base, {"gemm": s})[0])
         ) / -h
    assert scale_sd(fit)["gemm"] == pytest.approx(RUN_NOISE / math.sqrt(g * g + PRIOR), rel=0.02)


def test_a_scale_the_runs_cannot_see_keeps_the_prior_spread():
    base = load_cluster("dgx-h100")
    sd = scale_sd(fit_scales(_short_runs(base), base))
    assert sd["comm"] == pytest.approx(PRIOR_LOG_SD, rel=0.01)  # one GPU: no collective in any run
    assert sd["gemm"] < 0.5 * PRIOR_LOG_SD  # GEMMs are most of every run


def test_a_plan_beyond_the_runs_gets_a_wider_band():
    base = load_cluster("dgx-h100")
    cl = calibrated(base, fit_scales(_short_runs(base), base)).resized(gpus=1)
    near, _ = calibration_spread(_model(1024), cl, ParallelConfig(mbs=2), 8)
    far, which = calibration_spread(_model(16384), cl, ParallelConfig(mbs=1), 2)
    assert which == "attention" and far > 3 * near and near < 0.1 * PRIOR_LOG_SD
    assert calibration_spread(_model(16384), base.resized(gpus=1), ParallelConfig(mbs=1), 2) == (0.0, None)
    lo, hi = step_band(1, 10.0, far)
    lo0, hi0 = step_band(1, 10.0)
    assert lo == pytest.approx(lo0 / math.exp(Z95 * far)) and hi == pytest.approx(hi0 * math.exp(Z95 * far))


def test_calibrate_writes_the_fit_and_plan_widens_its_bands(tmp_path, capsys):
    base = load_cluster("dgx-h100")
    metrics = []
    for i, run in enumerate(_short_runs(base)):
        p = tmp_path / f"plan{i}.json"
        save_plan(run.plan, p)
        m = tmp_path / f"m{i}.jsonl"
        m.write_text("".join(json.dumps({"step": s, "step_time_s": run.measured_s, **({"plan": p.name} if s == 1
                                                                                     else {})}) + "\n"
                             for s in range(1, 6)))
        metrics.append(str(m))
    out = tmp_path / "cal.yaml"
    assert main(["calibrate", *metrics, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "comm x1 (x/" in text and "not pinned by these runs" in text
    cal = load_cluster(str(out))
    assert cal.calibration is not None and cal.calibration.runs == 3
    assert set(cal.calibration.scales) == {"gemm", "attention", "memory", "overhead", "comm"}
    args = ["plan", "--model", "tiny", "--gpus", "1", "--global-batch", "8", "--format", "json", "--top", "1"]
    assert main([*args, "--cluster", str(out)]) == 0
    row = json.loads(capsys.readouterr().out)["plans"][0]
    assert row["calibration_log_sd"] > 0
    lo, hi = row["step_time_band_s"]
    lo0, hi0 = step_band(1, row["step_time_s"])
    assert lo < lo0 and hi > hi0
    est = ["estimate", "--model", "tiny", "--gpus", "1", "--global-batch", "8", "--plan", "mbs=2", "--format", "json"]
    assert main([*est, "--cluster", str(out)]) == 0
    calibrated_est = json.loads(capsys.readouterr().out)
    assert main([*est, "--cluster", "dgx-h100"]) == 0
    plain_est = json.loads(capsys.readouterr().out)
    assert plain_est["step_time_band_s"] == pytest.approx(list(step_band(1, plain_est["step_time_s"])), rel=1e-4)
    assert "calibration_log_sd" not in plain_est and calibrated_est["calibration_log_sd"] > 0
    lo, hi = calibrated_est["step_time_band_s"]
    assert (lo, hi) == pytest.approx(step_band(1, calibrated_est["step_time_s"], calibrated_est["calibration_log_sd"]),
                                     rel=1e-4)
    # another GPU type: the calibration of this one's runs no longer applies
    assert with_gpu(cal, "a100-sxm4-80gb")[0].calibration is None
    same = with_gpu(cal, cal.gpu.name)[0]  # its own GPU keeps the calibrated profile, not the bundled one
    assert same.calibration == cal.calibration and same.gpu == cal.gpu


@pytest.mark.parametrize("edit, message", [
    ({"log_covariance": [[0.01, 0.0]]}, "must be 1 x 1"),
    ({"log_covariance": [[-0.01]]}, "non-negative diagonal"),
    ({"scales": {"gemm": 0.0}}, "positive factor"),
    ({"scales": {"bogus": 1.0}}, "bogus"),
])
def test_a_bad_calibration_block_is_a_one_line_error(tmp_path, capsys, edit, message):
    import yaml

    data = load_cluster("dgx-h100").model_dump(mode="json")
    data["calibration"] = {"runs": 2, "scales": {"gemm": 0.9}, "log_covariance": [[0.01]], **edit}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    assert main(["plan", "--model", "tiny", "--cluster", str(bad), "--gpus", "1", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_what_the_calibration_left_unpinned_can_tie_plans():
    """Two plans whose difference leans on a scale the runs did not pin (the network, after one-GPU runs) are
    tied by the fit's spread; two that differ only where the runs looked are not; and tied plans are the
    finalists tune measures."""
    from planner.tune import finalists
    from planner.uncertainty import tie_margin, tied_indices

    base = load_cluster("dgx-h100")
    cl = calibrated(base, fit_scales(_short_runs(base), base)).resized(gpus=8)
    model = _model(1024)
    same, comm, micro = ParallelConfig(dp=8, mbs=1), ParallelConfig(tp=8, mbs=8), ParallelConfig(dp=8, mbs=2)
    spreads = difference_spreads([step_sensitivity(model, cl, c, 16) for c in (same, comm, micro, same)],
                                 cl.calibration)
    assert spreads[0] == 0 and spreads[3] == pytest.approx(0, abs=1e-9)
    assert spreads[1] > 3 * spreads[2] and spreads[1] > tie_margin() > spreads[2]
    assert step_sensitivity(model, base.resized(gpus=8), comm, 16) is None  # an uncalibrated profile: nothing to add
    steps = [1.0, 1.0 + 2 * tie_margin(), 1.0 + 2 * tie_margin()]
    assert tied_indices(steps) == [] and tied_indices(steps, [0.0, spreads[1], spreads[2]]) == [1]

    class Plan:
        def __init__(self, s):
            self.estimate = type("E", (), {"step_time_s": s})()

    plans = [Plan(s) for s in steps]
    assert finalists(plans, 3) == plans[:1]
    assert finalists(plans, 3, [0.0, spreads[1], spreads[2]]) == [plans[0], plans[1]]


def test_a_poor_fit_and_a_scale_at_its_bound_are_not_trusted():
    """The runs' misfit beyond the allowed noise widens the spreads, and a scale stuck at the fit's bound keeps the
    prior's spread (its optimum is not a minimum)."""
    base = load_cluster("dgx-h100")
    runs = _short_runs(base)
    good = scale_sd(fit_scales(runs, base, ("gemm",)))["gemm"]
    clash = [runs[0], Run("x2", runs[0].plan, 2 * runs[0].measured_s, 10, None)]  # one plan, two disagreeing steps
    assert scale_sd(fit_scales(clash, base, ("gemm",)))["gemm"] > 2 * good
    stuck = fit_scales([Run("", runs[0].plan, 100 * runs[0].measured_s, 10, None)], base, ("gemm",))
    assert stuck.scales["gemm"] == pytest.approx(1 / 8) and scale_sd(stuck)["gemm"] == pytest.approx(PRIOR_LOG_SD)


def test_refitting_some_scales_keeps_the_others_spread():
    base = load_cluster("dgx-h100")
    runs = _short_runs(base)
    first = calibrated(base, fit_scales(runs, base))
    again = calibrated(first, fit_scales(runs, first, ("gemm",)))
    assert list(again.calibration.scales)[0] == "gemm" and set(again.calibration.scales) == set(first.calibration.scales)
    assert scale_sd(again.calibration)["comm"] == pytest.approx(scale_sd(first.calibration)["comm"])
    assert again.gpu.mem_bw == pytest.approx(first.gpu.mem_bw)  # the kept scales are not applied twice


def test_a_fit_far_off_never_knows_less_than_the_prior():
    """CPU-like runs (40x an A100's prediction) on the A100 profile leave a huge misfit; it widens the spreads, but
    no further than the prior's: the printed spread stays at most x/exp(1.96 PRIOR_LOG_SD), not astronomical."""
    from planner.calibrate import fitted_text
    from specs.model_loading import load_model

    base = load_cluster("dgx-a100")
    for cfg in (ParallelConfig(tp=2, pp=2, mbs=4), ParallelConfig(mbs=4)):
        plan = make_plan(load_model("tiny"), load_cluster("cpu-gloo", gpus=cfg.world), 16, cfg)
        t = float(predict([Run("", plan, 1.0, 1, None)], base, {})[0])
        fit = fit_scales([Run("", plan, 40 * t, 10, None)], base)
        assert all(sd <= PRIOR_LOG_SD * (1 + 1e-9) for sd in scale_sd(fit).values()), scale_sd(fit)
        widest = max(float(part.split("x/")[1].split(",")[0].rstrip(")")) for part in fitted_text(fit).split("(")[1:])
        assert widest == pytest.approx(math.exp(Z95 * PRIOR_LOG_SD), abs=0.01)


def test_a_run_s_compute_tells_a_slow_collective_from_slow_gemms():
    """One data-parallel run whose step is slow from its gradient reduce (its network 5x slower than the profile),
    its compute as priced: from the step alone the fit cannot tell which scale is off, and the GEMMs take their
    share of the blame; with the run's compute phases beside it, the GEMMs stay as priced and the network takes it."""
    from planner.calibrate import _estimates
    from planner.measured_runs import COMPUTE_TERMS as COMPUTE

    base = load_cluster("dgx-a100", gpus=16)
    plan = make_plan(_model(1024), base, 64, ParallelConfig(dp=16, mbs=4, dp_overlap=False))
    truth = _estimates([Run("", plan, 1.0, 1, None)], base, {"comm": 0.2})[0]
    compute = sum(truth.breakdown[k] for k in COMPUTE)
    step_only = fit_scales([Run("", plan, truth.step_time_s, 10, None)], base)
    both = fit_scales([Run("", plan, truth.step_time_s, 10, None, (compute,))], base)
    assert step_only.scales["gemm"] < 0.5 and step_only.scales["comm"] > 0.5  # 2.8x slow GEMMs, as a user saw
    assert both.scales["gemm"] == pytest.approx(1.0, abs=0.1) and both.scales["comm"] == pytest.approx(0.2, rel=0.2)
