"""``autopar diagnose`` on real runs (torchrun, 2 gloo ranks, one per core as one per GPU would be): a rank made
slow by the test hook is named with its phase, the phases add up to the step, and the step without it is what
the same run measures on its clean steps. The straggler acts on every other step (4, 6, ..., 28; 3, 5, ..., 27
are clean) and each slow step's "without" is set beside the clean steps next to it (a paired comparison: this
shared 2-core machine's speed drifts by 10-30% within seconds, and separate runs differ by up to 20%). Single
pairs range 0.69-1.78 here, so the median is over 13 pairs; and the clean steps are taken with the straggler's
phase at its peer's, as the "without" is (a run whose rank 1 was 20% slower on its own once set the clean steps:
median 0.81 against the raw clean steps)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from planner.cli import main
from planner.diagnose import diagnose, rank_phases, replay_step
from planner.measured_runs import read_segments, resolve_plan
from runtime.launch import launch
from runtime.options import RunOptions
from specs.cluster_loading import load_cluster
from specs.model_loading import load_model
from specs.parallel import ParallelConfig
from specs.phases import PHASES
from specs.planfile import make_plan, save_plan

pytestmark = pytest.mark.alone  # its runs' steps are timed: the machine to itself (tests/conftest.py)

STEPS, BATCH = 28, 48  # about 0.4 s a clean step: long against the machine's jitter
CLEAN, SLOW = ",".join(str(s) for s in range(3, STEPS, 2)), ",".join(str(s) for s in range(4, STEPS + 1, 2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Rank 1's compute 2x slower on even steps under dp=2; rank 0's sends delayed on even steps under pp=2 (each
    straggler has peers doing the same work: the rank of its stage, or the other sender)."""
    d = tmp_path_factory.mktemp("diagnose")
    out = {}
    for name, keys, hook in (("compute", dict(dp=2), "1:compute:2@4/2"), ("sends", dict(pp=2), "0:send:0.02@4/2")):
        plan = d / f"{name}.json"
        save_plan(make_plan(load_model("tiny"), load_cluster("cpu-gloo", gpus=2), BATCH, ParallelConfig(mbs=2, **keys)),
                  plan)
        out[name] = d / f"{name}.jsonl"
        assert launch(str(plan), RunOptions(steps=STEPS, metrics_out=str(out[name]), quiet=True), env={"AUTOPAR_STRAGGLER": hook}) == 0
    return out


# the injected stragglers are 2x (or far more); on this shared machine a rank is up to 1.3x its peer on its own
THRESHOLD = 1.5


def _diagnose(path: Path, steps: str, capsys) -> dict:
    capsys.readouterr()
    assert main(["diagnose", str(path), "--steps", steps, "--threshold", str(THRESHOLD), "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_rank_s_phases_add_up_to_the_step(runs):
    """Each step's phases cover the step: on rank 0 (whose clock times the step) they sum to it within 5%, and
    what no named phase holds ("other") is under 5% of a step on every rank (median over the steps)."""
    for path in runs.values():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        for r in rows[2:]:
            ph = r["phases_s"]
            assert set(ph) == set(PHASES) and all(len(v) == 2 for v in ph.values())
            assert len(r["peak_memory_GiB_per_rank"]) == len(r["peak_reserved_GiB_per_rank"]) == 2
            assert max(r["peak_memory_GiB_per_rank"]) == pytest.approx(r["peak_memory_GiB"], rel=1e-4)
            total = sum(v[0] for v in ph.values())
            assert abs(total - r["step_time_s"]) <= 0.05 * r["step_time_s"], (path.name, r["step"])
            assert min(ph["forward"]) > 0 and min(ph["backward"]) > 0
            assert max(ph["p2p_wait" if "sends" in path.name else "dp_comm"]) > 0
        for rank in range(2):
            other = [r["phases_s"]["other"][rank] / sum(v[rank] for v in r["phases_s"].values()) for r in rows[2:]]
            assert np.median(other) < 0.05, (path.name, rank)


@pytest.mark.parametrize("kind, rank", [("compute", 1), ("sends", 0)])
def test_a_slow_rank_is_named_with_its_phase_and_the_step_without_it(runs, kind, rank, capsys):
    clean = _diagnose(runs[kind], CLEAN, capsys)
    assert clean["stragglers"] == []
    slow = _diagnose(runs[kind], SLOW, capsys)
    assert [(s["rank"], s["phase"]) for s in slow["stragglers"]] == [(rank, kind)]
    assert slow["measured_step_s"] > 1.2 * clean["measured_step_s"]  # the straggler costs the whole step (1.29x once, loaded)
    assert abs(slow["replay_s"] / slow["measured_step_s"] - 1) < 0.10  # the replay holds as measured
    if kind == "compute":
        # made 2x slower; a busy 2-core machine narrows what its clock sees (1.597 once, under a parallel test run)
        assert THRESHOLD < slow["stragglers"][0]["ratio"] < 2.5
    # each slow step without its straggler against the clean steps beside it, with the straggler's phase at its
    # peer's there too (a rank a little slower on its own, under the threshold, would otherwise set the clean steps
    # and not the "without"); the median over the pairs
    (run,) = read_segments(runs[kind])
    rows, ref = run.rows, run.plan
    plan, by_step = resolve_plan(ref, runs[kind]), {r["step"]: r for r in rows}
    share = np.ones(plan.config.pp * plan.config.vpp)  # vpp = 1: every stage its rank's whole work
    phases = ("forward", "backward") if kind == "compute" else ("p2p_send",)

    def at_peer(row: dict) -> float:  # the clean step with the straggler's phase at its peer's
        ph = {p: v[0] for p, v in rank_phases([row], 2, "").items()}
        fixed = {p: v.copy() for p, v in ph.items()}
        for p in phases:
            fixed[p][rank] = ph[p][1 - rank]
        return row["step_time_s"] - (replay_step(plan, ph, share) - replay_step(plan, fixed, share))

    ratios = []
    for step in range(4, STEPS + 1, 2):
        d = diagnose(plan, [by_step[step]], 0, THRESHOLD, str(runs[kind]), "")
        beside = [at_peer(by_step[s]) for s in (step - 1, step + 1) if s in by_step]
        ratios.append(d.without_stragglers_s / float(np.mean(beside)))
    assert abs(float(np.median(ratios)) - 1) < 0.10, ratios


def test_the_table_names_the_straggler(runs, capsys):
    capsys.readouterr()
    assert main(["diagnose", str(runs["compute"]), "--steps", SLOW]) == 0
    out = capsys.readouterr().out
    assert "where the step went" in out and "straggler: rank 1 (pp 0 dp 1 cp 0 tp 0): compute" in out
    assert "without the stragglers:" in out
