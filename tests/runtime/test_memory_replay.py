"""The memory replay (runtime/memory_replay.py, ``autopar estimate --verify``): the runtime's ranks built on the
meta device in a fake process group, every live byte counted.

The replayed model state of every plan of the equivalence set is what the cost model prices for that pipeline
stage (weights, gradients, optimizer state; :func:`kept` allows ZeRO's bucket padding and the small tensors
kept between steps), and the peak holds it plus the
activations of a steady step. The peak's agreement with the activation model is reported, not asserted
(benchmarks/RESULTS.md, "Memory replay": within 3.5% on llama-1b without SP or CP; the tiny models here are
dominated by small buffers the model does not count).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from rt_cases import case_plan
from test_equivalence import CASES, ZERO_CASES, _id

from cost_models.step import estimate
from runtime.memory_replay import LiveBytes, replay

GiB = 2**30


def kept(priced: float) -> float:
    """The most a rank may keep between steps beside its priced state: ZeRO's padding of each bucket to a multiple
    of dp (well under 0.1% here), the step counter and RoPE's tables (a few KiB)."""
    return 1.001 * priced + 32 * 1024


def test_live_bytes_counts_each_storage_once_until_freed():
    with LiveBytes() as live:
        a = torch.empty(1000, device="meta")  # 4000 bytes
        view = a[10:20]
        b = torch.empty(250, dtype=torch.bfloat16, device="meta")  # 500 bytes
        assert live.live == 4500
        del a
        assert live.live == 4500  # the view keeps the storage alive
        del view
        assert live.live == 500 and live.peak == 4500
        live.reset_peak()
        c = b * 2  # a new 500-byte storage
        assert live.peak == 1000 and float(c.sum()) == 0.0  # host reads of meta values are zero


@pytest.mark.parametrize("case", CASES + ZERO_CASES, ids=_id)
def test_replayed_state_is_the_priced_state(case):
    plan = case_plan(case)
    est = estimate(plan.model, plan.cluster, plan.config, plan.global_batch, validate=False, state=plan.state)
    for r, parts in zip(replay(plan), est.stage_memory_breakdown, strict=True):
        priced = (parts["weights"] + parts["gradients"] + parts["optimizer"]) * GiB
        assert priced <= r.state_bytes <= kept(priced), (r, priced)
        assert r.peak_bytes > r.state_bytes


@pytest.mark.parametrize("command", [["estimate", "--plan", "tp=2,pp=2"], ["plan", "--fix", "tp=2,pp=2"]])
def test_verify_reports_every_pipeline_rank(command):
    out = subprocess.run([sys.executable, "-m", "planner.cli", command[0], "--model", "tiny", "--cluster", "cpu-gloo",
                          "--gpus", "4", "--global-batch", "16", *command[1:], "--verify", "--format", "json"],
                         capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)["memory_replay"]
    assert [r["pp_rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["predicted_state_GiB"] <= r["state_GiB"] <= kept(r["predicted_state_GiB"] * GiB) / GiB
        assert r["peak_GiB"] > r["state_GiB"]
        assert r["peak_error"] == pytest.approx(r["predicted_peak_GiB"] / r["peak_GiB"] - 1, abs=1e-5)  # (rounded)


def test_a_long_verify_replays_the_pipeline_ranks_in_parallel_processes(monkeypatch):
    """Replays that would take long one after another run in a pool of processes (each its own fake process group):
    the same rows, in pipeline order, as one after another in this process."""
    import planner.verify as verify

    plan = case_plan({"pp": 4, "tp": 1, "steps": 2})
    est = estimate(plan.model, plan.cluster, plan.config, plan.global_batch, validate=False, state=plan.state)
    here = verify.memory_check(plan, est)
    started = []
    real = verify.multiprocessing.get_context
    monkeypatch.setattr(verify.multiprocessing, "get_context", lambda kind: started.append(kind) or real(kind))
    monkeypatch.setattr(verify, "POOL_AFTER_S", 0.0)
    monkeypatch.setattr(verify, "usable_cores", lambda: 2)  # (a 1-core runner too)
    assert verify.memory_check(plan, est) == here and started == ["spawn"]
    assert [r["pp_rank"] for r in here] == [0, 1, 2, 3]


def test_a_replay_process_that_dies_is_one_line_not_a_hang(tmp_path, monkeypatch):
    """A pool process killed mid-replay (the OOM killer, on the deep pipelines the pool is for) ends --verify with
    one line saying so; a pool that lost its task waited for it forever."""
    import planner.verify as verify
    from specs.errors import RunFailed

    (tmp_path / "sitecustomize.py").write_text(  # the pool's processes (spawned: they start afresh) kill rank 2's
        "import os, signal\n"
        "import runtime.memory_replay as m\n"
        "real = m.replay_rank\n"
        "m.replay_rank = lambda plan, p: os.kill(os.getpid(), signal.SIGKILL) if p == 2 else real(plan, p)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    monkeypatch.setattr(verify, "POOL_AFTER_S", 0.0)
    monkeypatch.setattr(verify, "usable_cores", lambda: 2)
    plan = case_plan({"pp": 4, "tp": 1, "steps": 2})
    est = estimate(plan.model, plan.cluster, plan.config, plan.global_batch, validate=False, state=plan.state)
    with pytest.raises(RunFailed, match="ended before it was done .killed for memory"):
        verify.memory_check(plan, est)


@pytest.mark.parametrize("plan_text", ["tp=8,pp=1,mbs=1,sp=true,zero=1", "tp=1,pp=2,mbs=1,zero=3",
                                       "tp=2,pp=2,mbs=1,cp=2,sp=true", "tp=2,pp=4,mbs=1,sp=true,layers=0/6/6/4",
                                       "tp=1,pp=4,mbs=1,layers=4/6/6/0"])
def test_llama_1b_peaks_are_the_priced_peaks_within_3_percent(plan_text):
    """On llama-1b (8 H100s) every pipeline rank's replayed peak (state, activations and temporaries) is the cost
    model's within 3%: plans whose fullest moment is the LM head's fused loss (under SP, under ZeRO-3 with the head
    bucket's reduce-scatter), a CP layer's backward, or a stage of the embedding alone (its weight's dense gradient:
    the model left it out, 11-18% low) or of the head alone (the final norm's, 3% low)."""
    from specs.cluster_loading import load_cluster
    from specs.model_loading import load_model
    from specs.parallel import config_from_keys, parse_plan_keys
    from specs.planfile import make_plan

    model, cluster = load_model("llama-1b"), load_cluster("dgx-h100", gpus=8)
    cfg = config_from_keys(parse_plan_keys(plan_text), cluster.num_gpus)
    plan = make_plan(model, cluster, 16, cfg)
    est = estimate(model, cluster, cfg, 16, validate=False, state=plan.state)
    for r, parts in zip(replay(plan), est.stage_memory_breakdown, strict=True):
        priced = sum(v for k, v in parts.items() if k != "allocator_and_reserved") * GiB
        assert abs(priced / r.peak_bytes - 1) <= 0.03, (r, priced / GiB)


def test_verify_of_a_moe_model_is_refused_before_the_search(monkeypatch, capsys):
    """--verify cannot replay routing on the meta device: plan refuses it in one line before searching (an
    --exhaustive search's minutes were spent first, then nothing printed)."""
    import planner.search
    from planner.cli import main

    monkeypatch.setattr(planner.search, "search", lambda *a, **k: pytest.fail("searched first"))
    assert main(["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "8",
                 "--verify"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not replay mixture-of-experts models yet" in err
