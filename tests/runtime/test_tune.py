"""``autopar tune`` on 4 gloo ranks: it measures the search's top three plans through the launcher, keeps the one
with the smallest measured median step, skips a trial that runs past its time limit, and writes the chosen
plan and a calibrated profile. A test-only variable (``AUTOPAR_SLOW``) makes chosen trials slow."""

from __future__ import annotations

import json

from planner.cli import main
from planner.search import search
from specs.cluster import load_cluster
from specs.model_loading import load_model
from specs.planfile import load_plan

ARGS = ["--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "4", "--global-batch", "16"]


def test_tune_keeps_the_fastest_measured_trial_and_skips_one_past_its_limit(tmp_path, capsys, monkeypatch):
    top = [p.config.short() for p in search(load_model("tiny"), load_cluster("cpu-gloo", gpus=4), 16, top=3).plans]
    assert len(top) == 3
    # the predicted best made slow (measured slower), the second stuck (past the time limit), the third as it is
    monkeypatch.setenv("AUTOPAR_SLOW", f"0.6:{top[0]};120:{top[1]}")
    out = tmp_path / "best.json"
    code = main(["tune", *ARGS, "--steps", "5", "--warmup", "1", "--time-limit", "30", "--dir", str(tmp_path / "t"),
                 "--out", str(out), "--format", "json"])
    assert code == 0
    res = json.loads(capsys.readouterr().out)
    trials = res["trials"]
    assert [t["plan"] for t in trials] == top
    assert [t["status"] for t in trials] == ["ok", "timeout", "ok"]
    assert "time limit of 30 s" in trials[1]["error"] and trials[1]["measured_step_s"] is None
    assert trials[0]["measured_step_s"] > 0.6 > trials[2]["measured_step_s"] > 0
    assert res["chosen"]["plan"] == top[2]
    chosen = load_plan(out)
    assert chosen.config.short() == top[2]
    assert chosen.prediction["measured_step_time_s"] == trials[2]["measured_step_s"]
    assert load_cluster(res["profile"]).gpu.name == load_cluster("cpu-gloo").gpu.name
    assert all(t["calibrated_step_s"] > 0 for t in trials if t["status"] == "ok")


def test_tune_bad_inputs_are_one_line_errors(tmp_path, capsys):
    for argv, needle in [
        (["--steps", "2", "--warmup", "2"], "--steps (2) must be more than --warmup (2)"),
        (["--trials", "0"], "--trials must be at least 1"),
    ]:
        assert main(["tune", *ARGS, "--dir", str(tmp_path), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert main(["tune", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "64"]) == 2
    assert "runs its trials on this machine" in capsys.readouterr().err
