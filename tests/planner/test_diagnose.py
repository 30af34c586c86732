"""``autopar diagnose``'s analysis on phase times made up by hand: the schedule replay against pipelines worked
out on paper, the straggler rule, and its one-line errors (the runs themselves: tests/runtime/test_diagnose_run.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from planner.cli import main
from planner.diagnose import find_stragglers, replay_step, sends_per_rank
from specs.cluster_loading import load_cluster
from specs.model_loading import load_model
from specs.parallel import ParallelConfig
from specs.phases import PHASES
from specs.planfile import make_plan, save_plan


def _plan(gpus: int, global_batch: int, **keys):
    return make_plan(load_model("tiny"), load_cluster("cpu-gloo", gpus=gpus), global_batch, ParallelConfig(**keys))


def _phases(world: int, **given) -> dict[str, np.ndarray]:
    out = {p: np.zeros(world) for p in PHASES}
    out.update({k: np.array(v, dtype=float) for k, v in given.items()})
    return out


def test_replay_of_one_f_one_b_on_paper():
    """pp=2, two micro-batches, forward 1 s and backward 2 s each on both stages. On paper (1F1B):
    r0 F0 0-1, r1 F0 1-2, r0 F1 1-2, r1 B0 2-4, r0 B0 4-6, r1 F1 4-5, r1 B1 5-7, r0 B1 7-9: rank 0 ends at 9.
    Then its data (0.1), optimizer (0.2) and the least "other" of any rank (0.05)."""
    plan = _plan(2, 2, pp=2)
    ph = _phases(2, forward=[2, 2], backward=[4, 4], data=[0.1, 0.1], optimizer=[0.2, 0.2], other=[0.05, 0.3])
    assert replay_step(plan, ph, np.ones(2)) == pytest.approx(9.35)
    # sends cost the sender: 0.5 s per forward send of rank 0 delays everything after it:
    # r0 F0 0-1.5, r1 F0 1.5-2.5, r0 F1 1.5-3, r1 B0 2.5-4.5, r0 B0 4.5-6.5, r1 F1 4.5-5.5, r1 B1 5.5-7.5,
    # r0 B1 7.5-9.5
    assert sends_per_rank(plan).tolist() == [2, 2]
    ph["p2p_send"] = np.array([1.0, 0.0])
    assert replay_step(plan, ph, np.ones(2)) == pytest.approx(9.85)


def test_replay_waits_for_the_slowest_rank_in_lockstep():
    """tp=2: a stage runs at its slower tensor-parallel rank. Rank 1 (stage 0) forwards in 2 s a micro-batch:
    r0 F0 0-2, r1 F0 2-3, r0 F1 2-4, r1 B0 3-5, r0 B0 5-7, r1 F1 5-6, r1 B1 6-8, r0 B1 8-10."""
    plan = _plan(4, 2, tp=2, pp=2)
    ph = _phases(4, forward=[2, 4, 2, 2], backward=[4, 4, 4, 4])
    assert replay_step(plan, ph, np.ones(2)) == pytest.approx(10.0)


def test_a_rank_twice_as_slow_as_its_peers_is_named_and_noise_is_not():
    plan = _plan(4, 8, dp=4)
    work = np.ones(1)
    ph = _phases(4, forward=[1.0, 1.1, 0.95, 2.0], backward=[2.0, 2.2, 1.9, 4.0])
    (s,) = find_stragglers(plan, ph, work, step_s=6.0, threshold=1.25)
    assert (s.rank, s.phase, s.coords) == (3, "compute", dict(pp=0, dp=3, cp=0, tp=0))
    assert s.ratio == pytest.approx(2.0) and s.peers_seconds == pytest.approx(3.0)  # the others' median: 3.0 s
    assert find_stragglers(plan, _phases(4, forward=[1.0, 1.1, 0.95, 1.2]), work, 6.0, 1.25) == []
    # twice as slow, but it loses under 2% of the step: not worth naming
    assert find_stragglers(plan, _phases(4, forward=[0.01, 0.01, 0.01, 0.02]), work, 6.0, 1.25) == []


def test_stages_compare_by_their_expected_work():
    """pp=2: stage 1 is expected to take 3x stage 0; rank 1 taking 3x rank 0 is no straggler, 6x is."""
    plan = _plan(2, 4, pp=2)
    work = np.array([1.0, 3.0])
    assert find_stragglers(plan, _phases(2, forward=[1.0, 3.0]), work, 5.0, 1.25) == []
    (s,) = find_stragglers(plan, _phases(2, forward=[1.0, 6.0]), work, 8.0, 1.25)
    assert (s.rank, s.ratio, s.peers_seconds) == (1, pytest.approx(2.0), pytest.approx(3.0))


def test_ranks_of_the_same_stage_compare_with_each_other_not_the_model():
    """pp=2 dp=2: the model expects stage 1 to take 3x stage 0, it takes 1.5x: the ranks of each stage set the
    measure, so no rank is a straggler; one of stage 1 twice as slow as its stage peer is."""
    plan = _plan(4, 8, pp=2, dp=2)
    work = np.array([1.0, 3.0])
    assert find_stragglers(plan, _phases(4, forward=[1.0, 1.0, 1.5, 1.5]), work, 5.0, 1.25) == []
    (s,) = find_stragglers(plan, _phases(4, forward=[1.0, 1.0, 1.5, 3.0]), work, 5.0, 1.25)
    assert (s.rank, s.coords, s.peers_seconds) == (3, dict(pp=1, dp=1, cp=0, tp=0), pytest.approx(1.5))


def test_bad_input_is_one_line(tmp_path, capsys):
    plan = tmp_path / "p.json"
    save_plan(_plan(2, 4, pp=2), plan)
    old = tmp_path / "old.jsonl"  # written before phase times existed
    old.write_text("".join(json.dumps({"step": i, "step_time_s": 0.1, "plan": str(plan)}) + "\n" for i in (1, 2, 3)))
    other, four = tmp_path / "other.json", tmp_path / "four.json"  # plans the metrics were not written by
    save_plan(_plan(2, 4, tp=2), other)
    save_plan(_plan(4, 4, pp=2, dp=2), four)
    phases = tmp_path / "phases.jsonl"
    phases.write_text(json.dumps({"step": 1, "step_time_s": 0.1, "phases_s": {"forward": [0.1, 0.1]}}) + "\n")
    from specs.phases import PHASES

    def phase_line(step: int, first: float) -> str:
        ph = {p: [first if p == "forward" else 0.01, 0.01] for p in PHASES}
        return json.dumps({"step": step, "step_time_s": 0.1, "plan": str(plan), "phases_s": ph}) + "\n"

    bad_phase, negative = tmp_path / "nan.jsonl", tmp_path / "neg.jsonl"
    bad_phase.write_text(phase_line(1, 0.01) + phase_line(2, float("nan")))  # json writes NaN, and reads it
    negative.write_text(phase_line(1, -1.0) + phase_line(2, 0.01))
    no_plan = tmp_path / "noplan.jsonl"
    no_plan.write_text(json.dumps({"step": 1, "step_time_s": 0.1}) + "\n")
    cases = [([str(old)], "has no phase times for 2 ranks"),
             ([str(no_plan)], "does not say which plan it ran"),
             ([str(tmp_path / "missing.jsonl")], "does not exist"),
             ([str(old), "--threshold", "1"], "--threshold must be a number above 1"),
             ([str(old), "--threshold", "nan"], "--threshold must be a number above 1"),
             ([str(old), "--threshold", "inf"], "--threshold must be a number above 1"),
             ([str(old), "--steps", ""], "--steps is empty"),
             ([str(bad_phase), "--plan", str(plan)], "has a forward time that is not a non-negative number"),
             ([str(negative), "--plan", str(plan)], "time that is not a non-negative number"),
             ([str(old), "--steps", "1,5-2"], "a range must not end before it starts"),
             ([str(old), "--steps", "x"], "expected steps and ranges"),
             ([str(old), "--steps", "7-"], "has no steps in 7-"),
             ([str(old), "--plan", str(other)], "was written by a run of tiny tp=1 pp=2"),
             ([str(phases), "--plan", str(four)], "has 2 ranks' phases, but --plan")]
    for argv, want in cases:
        assert main(["diagnose", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert want in err and err.count("\n") == 1 and "Traceback" not in err, (argv, err)


def _two_run_metrics(tmp_path):
    """A run of a pp=2 plan (steps 1-4, 2 ranks) and its resume under a dp=4 plan (steps 5-10, 4 ranks) in one
    metrics file, as `autopar run --resume --metrics-out` appends them. Each step's time is its phases' sum on
    every rank; the two runs take clearly different times."""
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    save_plan(_plan(2, 4, pp=2), pa)
    save_plan(_plan(4, 8, dp=4), pb)
    lines = []
    for step in range(1, 11):
        world, fwd, path = (2, 0.1 + 0.001 * step, pa) if step <= 4 else (4, 0.3 + 0.001 * step, pb)
        ph = {p: [fwd if p == "forward" else 2 * fwd if p == "backward" else 0.0] * world for p in PHASES}
        lines.append({"step": step, "step_time_s": 3 * fwd, "plan": str(path), "phases_s": ph})
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return m, pa, pb


def test_a_file_of_two_runs_diagnoses_the_last_and_says_so(tmp_path, capsys):
    m, pa, pb = _two_run_metrics(tmp_path)
    assert main(["diagnose", str(m), "--format", "json"]) == 0
    cap = capsys.readouterr()
    d = json.loads(cap.out)
    # steps 5-10 (plan b), less the first as warm-up: median of steps 6-10's 3 x (0.3 + 0.001 step)
    assert d["plan"] == str(pb) and d["steps"] == 5 and len(d["ranks"]) == 4
    assert d["measured_step_s"] == pytest.approx(3 * 0.308)
    assert "holds 2 runs" in cap.err and "diagnosing the last (steps 5-10)" in cap.err and "--steps" in cap.err
    # --steps picks the first run; --plan of the first run picks it too
    for extra in (["--steps", "1-4"], ["--plan", str(pa)]):
        assert main(["diagnose", str(m), "--format", "json", *extra]) == 0, extra
        d = json.loads(capsys.readouterr().out)
        assert len(d["ranks"]) == 2 and d["plan"] == str(pa), extra
    assert main(["diagnose", str(m), "--format", "json", "--steps", "2-4"]) == 0
    assert json.loads(capsys.readouterr().out)["measured_step_s"] == pytest.approx(3 * 0.103)  # no warm-up


def test_steps_across_two_runs_are_one_line_errors(tmp_path, capsys):
    m, pa, pb = _two_run_metrics(tmp_path)
    assert main(["diagnose", str(m), "--steps", "3-6"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "spans 2 runs" in err and "steps 3-4" in err and "steps 5-6" in err, err
    # the plan of one run, with steps of the other: the rank counts disagree
    assert main(["diagnose", str(m), "--steps", "5-", "--plan", str(pa)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has 4 ranks' phases, but --plan" in err, err


def test_phases_of_another_rank_count_name_both_counts(tmp_path, capsys):
    """Steps whose phases are for 4 ranks under a 2-rank plan: the error says so, not that phases are missing."""
    plan = tmp_path / "p.json"
    save_plan(_plan(2, 4, pp=2), plan)
    m = tmp_path / "m.jsonl"
    ph = {p: [0.01] * 4 for p in PHASES}
    m.write_text("".join(json.dumps({"step": s, "step_time_s": 0.1, "plan": str(plan), "phases_s": ph}) + "\n"
                         for s in (1, 2, 3)))
    assert main(["diagnose", str(m)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has phase times for 4 ranks, but the plan runs 2" in err, err


def test_the_shares_of_the_gap_add_up_with_a_total_row():
    """Each phase row is a median over the steps, and medians do not add up to the step's median: the shares are of
    the rows' own total (shown as a last row), so they add up to 100% whatever the step's median is."""
    from planner.diagnose import Diagnosis, diagnosis_tables

    rows = [("compute", 0.5, 0.8), ("tp/cp comm", 0.1, 0.15), ("optimizer", 0.05, 0.05), ("other", 0.0, 0.05)]
    phases = [{"phase": n, "predicted_s": p, "measured_s": m, "gap_s": m - p} for n, p, m in rows]
    d = Diagnosis("p.json", 10, 1.3, 0.65, 0, phases, [], 1.3, 1.3, [])  # the step's median: above the rows' 1.05
    parts = diagnosis_tables(d, "tp=2")
    table = parts[1]
    assert "the rows add up to 1.050 s, the step's own median is 1.300 s" in parts[2]  # said, not left to puzzle
    cells = [list(c._cells) for c in table.columns]
    assert cells[0][-1] == "total" and cells[4][-1] == "100%"
    shares = [int(s.rstrip("%")) for s in cells[4][:-1]]
    assert shares == [75, 12, 0, 12] and abs(sum(shares) - 100) <= 1  # 12.5% rounds to even
    assert cells[2][-1] == "1.050 s" and cells[3][-1] == "+400.00 ms"


def test_a_moe_plans_all_to_all_has_a_row_and_the_predicted_rows_add_up_to_the_step(tmp_path, capsys):
    """The estimate's ``ep_comm`` (a MoE model's all-to-alls) is a row of its own beside the measured ``ep_comm``
    phase, so the predicted rows add up to the predicted step; a metrics file written before that phase existed
    (no ``ep_comm`` in its ``phases_s``) reads as no such time."""
    plan = make_plan(load_model("tiny-moe"), load_cluster("cpu-gloo", gpus=2), 8, ParallelConfig(dp=2, ep=2))
    path = tmp_path / "moe.json"
    save_plan(plan, path)

    def metrics(with_ep: bool):
        lines = []
        for step in range(1, 7):
            ph = {p: [0.05 if p in ("forward", "backward") else 0.01 if p == "ep_comm" else 0.0] * 2 for p in PHASES}
            if not with_ep:
                del ph["ep_comm"]
            lines.append({"step": step, "step_time_s": sum(v[0] for v in ph.values()), "plan": str(path),
                          "phases_s": ph})
        m = tmp_path / f"m{int(with_ep)}.jsonl"
        m.write_text("".join(json.dumps(x) + "\n" for x in lines))
        return m

    for with_ep in (True, False):
        assert main(["diagnose", str(metrics(with_ep)), "--format", "json"]) == 0
        d = json.loads(capsys.readouterr().out)
        rows = {r["phase"]: r for r in d["phases"]}
        assert sum(r["predicted_s"] for r in d["phases"]) == pytest.approx(d["predicted_step_s"], rel=1e-5)
        assert rows["ep comm"]["predicted_s"] > 0
        assert rows["ep comm"]["measured_s"] == pytest.approx(0.01 if with_ep else 0.0)
        assert rows["compute"]["measured_s"] == pytest.approx(0.1)


def test_a_tuned_plan_says_what_tune_measured_beside_its_own_prediction(tmp_path, capsys):
    """A plan `autopar tune` wrote carries the measured and calibrated steps and the calibrated profile: diagnose
    says so (its comparison is with the plan's own prediction, on the profile it was planned on)."""
    from planner.prediction import tuned_note

    path = tmp_path / "best.json"
    assert main(["plan", "--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "8",
                 "--out", str(path)]) == 0
    capsys.readouterr()
    raw = json.loads(path.read_text())
    assert tuned_note(raw["prediction"], "best.json") is None  # a plain plan: nothing to say
    raw["prediction"].update(measured_step_time_s=0.0658, calibrated_step_time_s=0.0774,
                             calibrated_profile=str(tmp_path / "t" / "calibrated.yaml"))
    path.write_text(json.dumps(raw))
    ph = {p: [0.03 if p in ("forward", "backward") else 0.0] * 2 for p in PHASES}
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps({"step": s, "step_time_s": 0.06, "plan": str(path), "phases_s": ph}) + "\n"
                         for s in range(1, 6)))
    assert main(["diagnose", str(m), "--format", "json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["measured_step_s"] == pytest.approx(0.06)
    line = next(x for x in cap.err.splitlines() if "was tuned" in x)
    assert "0.0658 s" in line and "0.0774 s" in line and f"--cluster {tmp_path / 't' / 'calibrated.yaml'}" in line
    assert main(["run", str(path), "--dry-run"]) == 0  # run says the same before it starts
    assert line.split(": `autopar tune`")[1] in capsys.readouterr().out


def test_one_plans_prediction_reads_the_same_in_plan_whatif_and_diagnose(tmp_path, capsys):
    """The same plan's predicted step is written to the same digits by `plan`, `whatif` and `diagnose` (and the plan
    file), so their outputs join on it."""
    path = tmp_path / "p.json"
    args = ["--model", "tiny", "--cluster", "cpu-gloo", "--global-batch", "8"]
    assert main(["plan", *args, "--gpus", "2", "--out", str(path), "--format", "json"]) == 0
    planned = json.loads(capsys.readouterr().out)["plans"][0]
    assert main(["whatif", *args, "--vary", "gpus=2", "--format", "json"]) == 0
    point = json.loads(capsys.readouterr().out)["curves"]["best"][0]
    assert point["parallel"] == planned["parallel"]
    ph = {p: [0.03 if p in ("forward", "backward") else 0.0] * 2 for p in PHASES}
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps({"step": s, "step_time_s": 0.06, "plan": str(path), "phases_s": ph}) + "\n"
                         for s in range(1, 6)))
    assert main(["diagnose", str(m), "--format", "json"]) == 0
    diagnosed = json.loads(capsys.readouterr().out)
    stored = json.loads(path.read_text())["prediction"]["step_time_s"]
    assert planned["step_time_s"] == point["step_time_s"] == diagnosed["predicted_step_s"] == stored
    assert point["step_time_s"] == float(f"{point['step_time_s']:.6g}")


def test_a_run_whose_ranks_shared_cores_says_so(tmp_path, capsys):
    """4 ranks on a node its profile measured with 2 cores: the ranks took turns, which diagnose says beside its
    tables (its waits and stragglers are the sharing's as much as the plan's); a core each: nothing said."""
    cpu = load_cluster("cpu-gloo")
    ph = {p: [0.03 if p in ("forward", "backward") else 0.0] * 4 for p in PHASES}
    for cores, said in ((2, True), (8, False)):
        prof = cpu.model_copy(update={"gpu": cpu.gpu.model_copy(update={"cores": cores})}).resized(gpus=4)
        path = tmp_path / f"p{cores}.json"
        save_plan(make_plan(load_model("tiny"), prof, 16, ParallelConfig(dp=4)), path)
        m = tmp_path / f"m{cores}.jsonl"
        m.write_text("".join(json.dumps({"step": s, "step_time_s": 0.06, "plan": str(path), "phases_s": ph}) + "\n"
                             for s in range(1, 6)))
        capsys.readouterr()
        assert main(["diagnose", str(m), "--format", "json"]) == 0
        err = capsys.readouterr().err
        assert ("this run put 4 ranks on nodes of 2 cores (its profile)" in err) is said, err


def test_a_file_of_another_kind_is_named_as_one(tmp_path, capsys):
    """A metrics file given as --plan, a cluster profile given as the metrics: each named for what it is."""
    plan = tmp_path / "p.json"
    save_plan(_plan(2, 8, dp=2), plan)
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps({"step": s, "step_time_s": 0.06, "plan": str(plan)}) + "\n" for s in range(1, 4)))
    prof = tmp_path / "c.yaml"
    prof.write_text("name: c\ngpu: h100-sxm5-80gb\ngpus_per_node: 8\n")
    for argv, said in (([str(m), "--plan", str(m)], "holds JSON lines (a run's metrics file?), not a plan"),
                       ([str(prof)], "is YAML (a model spec or cluster profile?), not a metrics file")):
        assert main(["diagnose", *argv]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1
