"""``autopar tune`` on 4 gloo ranks: it measures the search's top three plans through the launcher, keeps the one
with the smallest measured median step, skips a trial that runs past its time limit, and writes the chosen
plan and a calibrated profile. A test-only variable (``AUTOPAR_SLOW``) makes chosen trials slow."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from planner.cli import main
from planner.search import search
from specs.cluster_loading import load_cluster
from specs.model_loading import load_model
from specs.planfile import TrainConfig, load_plan

ARGS = ["--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "4", "--global-batch", "16"]


@pytest.mark.alone  # the trials' time limit: the machine to itself (tests/conftest.py)
def test_tune_keeps_the_fastest_measured_trial_and_skips_one_past_its_limit(tmp_path, capsys, monkeypatch):
    top = [p.config.short() for p in search(load_model("tiny"), load_cluster("cpu-gloo", gpus=4), 16, top=3).plans]
    assert len(top) == 3
    # the predicted best made slow (measured slower), the second stuck (past the time limit: a trial of 5 steps takes
    # about 6 s here), the third as it is
    monkeypatch.setenv("AUTOPAR_SLOW", f"0.6:{top[0]};120:{top[1]}")
    out = tmp_path / "best.json"
    code = main(["tune", *ARGS, "--steps", "5", "--warmup", "1", "--time-limit", "20", "--dir", str(tmp_path / "t"),
                 "--out", str(out), "--format", "json"])
    assert code == 0
    res = json.loads(capsys.readouterr().out)
    trials = res["trials"]
    assert [t["plan"] for t in trials] == top
    assert [t["status"] for t in trials] == ["ok", "timeout", "ok"]
    assert "time limit of 20 s" in trials[1]["error"] and trials[1]["measured_step_s"] is None
    assert trials[0]["measured_step_s"] > 0.6 > trials[2]["measured_step_s"] > 0
    assert res["chosen"]["plan"] == top[2]
    chosen = load_plan(out)
    assert chosen.config.short() == top[2]
    assert chosen.prediction["measured_step_time_s"] == trials[2]["measured_step_s"]
    assert load_cluster(res["profile"]).gpu.name == load_cluster("cpu-gloo").gpu.name
    assert chosen.prediction["calibrated_profile"] == str(Path(res["profile"]).resolve())
    assert all(t["calibrated_step_s"] > 0 for t in trials if t["status"] == "ok")
    assert chosen.train.steps == TrainConfig().steps  # the plan written trains as `plan --out` would, not 5 steps
    assert load_plan(trials[0]["plan_file"]).train.steps == 5  # the trials' own plans keep their short runs


def test_tune_with_every_trial_failing_still_reports_them(tmp_path, capsys, monkeypatch):
    """No trial finishing is an error (exit 2), but the trials are still reported, each with its status."""
    monkeypatch.setenv("AUTOPAR_SLOW", ";".join(f"120:{p.config.short()}" for p in search(
        load_model("tiny"), load_cluster("cpu-gloo", gpus=4), 16, top=3).plans))
    out = tmp_path / "best.json"
    code = main(["tune", *ARGS, "--steps", "3", "--warmup", "1", "--time-limit", "1", "--dir", str(tmp_path / "t"),
                 "--out", str(out), "--format", "json"])
    assert code == 2
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    assert res["chosen"] is None and res["plan_file"] is None and not out.exists()
    assert res["trials"] and all(t["status"] == "timeout" for t in res["trials"]), res["trials"]
    assert "every trial failed" in res["error"] and res["error"].endswith("--time-limit 1 s, which counts each "
                                                                          "trial's start (processes, imports, groups) "
                                                                          "as well as its steps: give a longer one")
    assert captured.err.strip().splitlines()[-1].startswith("autopar: error:")


def test_ctrl_c_stops_the_tuning(tmp_path, capsys, monkeypatch):
    """Ctrl-C during a trial (the launcher returns 130) marks it interrupted, runs no further trial and exits 130,
    instead of taking the cut-short trial as a measurement."""
    import runtime.launch

    calls = []
    monkeypatch.setattr(runtime.launch, "launch", lambda *a, **k: calls.append(a) or 130)
    code = main(["tune", *ARGS, "--dir", str(tmp_path / "t"), "--format", "json"])
    assert code == 130 and len(calls) == 1
    res = json.loads(capsys.readouterr().out)
    assert [t["status"] for t in res["trials"]][:2] == ["interrupted", "not run"] and res["chosen"] is None


def test_tune_bad_inputs_are_one_line_errors(tmp_path, capsys, monkeypatch):
    temp = tmp_path / "temp"  # where tune makes its folder without --dir: a refused tune leaves none there
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    for argv, needle in [
        (["--steps", "2", "--warmup", "2"], "--steps (2) must be more than --warmup (2)"),
        (["--trials", "0"], "--trials (--top) must be at least 1"),
        (["--warmup", "-1"], "--warmup must be 0 or more"),
        (["--time-limit", "0"], "--time-limit must be more than 0 seconds"),
        (["--dir", str(tmp_path / "afile")], "exists and is not a folder"),
        # the chosen plan over another trial's file: its metrics would then name a changed plan
        (["--out", str(tmp_path / "d" / "trial2.json")], "would replace tune's trial 2's plan file in --dir"),
    ]:
        (tmp_path / "afile").write_text("x")
        folder = [] if "--dir" in argv else ["--dir", str(tmp_path / "d")]
        assert main(["tune", *ARGS, *folder, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
    assert main(["tune", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--global-batch", "64"]) == 2
    assert "has no CUDA GPU" in capsys.readouterr().err  # a GPU profile is not calibrated on this CPU machine
    assert not list(temp.iterdir())
    # a model the runtime cannot train: one line before any trial (each trial failed on it after launch)
    assert main(["tune", *ARGS[2:], "--model", "tests.fixtures.toy_lm:build", "--dir", str(tmp_path / "t")]) == 2
    assert "tune trains its finalists, and model ToyLM was traced" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
    # a --dir holding the profile tune reads under the name it writes its calibrated profile to: refused, unchanged
    own = tmp_path / "mine"
    own.mkdir()
    profile = own / "calibrated.yaml"
    profile.write_text(Path("hardware_profiles/clusters/cpu-gloo.yaml").read_text())
    before = profile.read_bytes()
    argv = [a if a != "cpu-gloo" else str(profile) for a in ARGS]
    assert main(["tune", *argv, "--dir", str(own)]) == 2
    err = capsys.readouterr().err
    assert "is the cluster profile this command reads" in err and "give another --dir" in err
    assert profile.read_bytes() == before and sorted(p.name for p in own.iterdir()) == ["calibrated.yaml"]


def test_tune_on_several_nodes_prints_each_trials_commands(tmp_path, capsys, monkeypatch):
    """On a multi-node cluster the trials cannot start from here: tune writes the finalists' plan files and prints,
    as `autopar run` does, the commands for every node, then the fit that compares them."""
    assert main(["tune", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "64",
                 "--dir", str(tmp_path / "t"), "--steps", "12", "--format", "json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["trials"] and res["chosen"] is None
    for t in res["trials"]:
        plan = load_plan(t["plan_file"])
        assert plan.world_size == 16 and plan.train.steps == 12
        assert any("--nnodes 2" in c and t["plan_file"] in c and "--metrics-out" in c for c in t["commands"]), t
    assert res["calibrate"].startswith("autopar calibrate ") and all(t["metrics"] in res["calibrate"]
                                                                    for t in res["trials"])
    assert main(["tune", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "64",
                 "--dir", str(tmp_path / "u"), "--out", str(tmp_path / "best.json")]) == 2  # nothing to choose here
    assert "--out: on several nodes" in capsys.readouterr().err and not (tmp_path / "best.json").exists()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    (tmp_path / "temp").mkdir()
    assert main(["tune", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "64"]) == 2
    err = capsys.readouterr().err  # a temporary folder here is on this machine only: every node needs the trials
    assert "--dir: on several nodes" in err and "filesystem all nodes share" in err and "\n" not in err.strip()
    assert not [p for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith("autopar-tune-")]


def test_tune_into_a_used_folder_leaves_no_earlier_trial(tmp_path, capsys):
    """A tune into a folder an earlier tune used (with more trials) removes that tune's trial files first, naming
    them, so the folder never mixes two tunes; other files stay. On several nodes, where the trials' metrics and
    the fit are measured on the cluster, an earlier tune's measurements are refused instead of removed."""
    from planner.tune import prepare

    d = tmp_path / "t"
    d.mkdir()
    plan = tmp_path / "plan.json"  # an earlier tune's files are what a tune writes: a plan, metrics, its profile
    assert main(["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--global-batch", "8", "--out", str(plan)]) == 0
    (d / "trial7.json").write_text(plan.read_text())
    (d / "trial7.jsonl").write_text('{"step": 1, "loss": 5.5, "step_time_s": 0.1}\n')
    (d / "calibrated.yaml").write_text("# Calibrated by `autopar tune` at 2026-11-27 from 2 trial(s): x.\nname: x\n")
    for name in ["notes.txt", "trial7.json.bak"]:
        (d / name).write_text("x")
    capsys.readouterr()
    argv = ["tune", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "64",
            "--dir", str(d), "--trials", "2", "--format", "json"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds an earlier tune's measurements (trial7.jsonl, calibrated.yaml)" in err and "another --dir" in err
    assert (d / "trial7.jsonl").exists() and (d / "calibrated.yaml").exists()
    found = prepare(load_model("tiny"), load_cluster("cpu-gloo", gpus=4), 16, d, None, 2, 4, 0.0)
    assert "removed an earlier tune's files" in capsys.readouterr().err
    written = {Path(t.plan_path).name for t in found}
    assert sorted(p.name for p in d.iterdir()) == sorted([*written, "notes.txt", "trial7.json.bak"])
    assert main(argv) == 0  # only its own plan files there now: written again
    assert {Path(t["plan_file"]).name for t in json.loads(capsys.readouterr().out)["trials"]} <= written | {
        "trial1.json", "trial2.json"}


def test_tune_never_removes_a_file_it_did_not_write(tmp_path, capsys):
    """A file of a tune's names that no tune wrote -- the user's own calibrated profile, notes in trial1.json, a
    metrics file of another kind -- is refused in one line and left as it was, before anything is written."""
    d = tmp_path / "t"
    d.mkdir()
    from planner.calibrate import calibrated_by  # the header `autopar calibrate` writes, not tune's
    (d / "calibrated.yaml").write_text(f"# {calibrated_by('autopar calibrate')} at 2026-11-27 from 1 run(s).\nname: x\n")
    cases = {"calibrated.yaml": None, "trial1.json": '{"my": "notes"}', "trial2.jsonl": "my notes\n"}
    argv = ["tune", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "8", "--trials", "1",
            "--steps", "3", "--warmup", "1", "--dir", str(d)]
    for name, text in cases.items():
        if text is not None:
            (d / name).write_text(text)
        before = {p.name: p.read_bytes() for p in d.iterdir()}
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert f"holds {name}, which is not" in err and "give another --dir" in err and "\n" not in err, err
        assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # nothing removed, nothing written
        (d / name).rename(tmp_path / f"kept-{name}")  # the next case alone
