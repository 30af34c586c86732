"""``autopar run`` end to end (torchrun, 4 gloo ranks, the default plan) and its one-line errors."""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from planner.cli import main
from planner.defaults import default_plan
from runtime.checkpoint import FORMAT, fingerprint
from runtime.data import SAMPLE_TEXT
from runtime.launch import launch
from runtime.options import RunOptions, worker_argv
from specs.cluster_loading import load_cluster
from specs.errors import AutoparError
from specs.model_loading import load_model
from specs.parallel import ParallelConfig
from specs.planfile import load_plan, make_plan, save_plan

REPO = Path(__file__).resolve().parents[2]


def _rows(path: Path) -> list[dict]:
    """A metrics file's step lines (not its events: a resume's, a restart's)."""
    return [row for line in path.read_text().splitlines() if "step" in (row := json.loads(line))]


def test_default_plan_is_the_tiny_cpu_plan(tmp_path):
    plan = load_plan(default_plan(tmp_path / "p.json")[0])
    assert plan.model.name == "tiny" and plan.world_size == 4 and plan.cluster.backend == "gloo"
    assert (plan.config.tp, plan.config.pp) == (2, 2)
    assert plan.prediction.get("step_time_s", 0) > 0


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[str, list[dict]]:
    """The default plan and the metrics of an uninterrupted 8-step run of it (what interrupted runs must reproduce)."""
    d = tmp_path_factory.mktemp("clean")
    plan, m = str(default_plan(d / "default.json")[0]), d / "m.jsonl"
    assert launch(plan, RunOptions(steps=8, quiet=True, metrics_out=str(m))) == 0
    return plan, _rows(m)


def test_killed_rank_resumes_from_last_checkpoint(tmp_path, capsys, clean):
    """The default plan trains (loss drops); a rank killed before step 7 loses only steps 5-6 (checkpoint at 4);
    then rolled back to step 4 (``--resume-from``), it trains steps 5-8 again as they were, nothing deleted.

    The run is uninterrupted up to the kill, so its steps 5 and 6 are what the resumed run must redo exactly.
    (That a resumed loss curve equals an uninterrupted one over a whole run is test_dp_checkpoint's.)
    """
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    plan = str(default_plan(tmp_path / "default.json")[0])
    common = dict(steps=8, checkpoint_every=4, quiet=True, metrics_out=str(m), checkpoint_dir=str(ck))
    with pytest.raises(AutoparError) as err:
        launch(plan, RunOptions(**common), env={"AUTOPAR_FAULT": "7:1"})
    assert str(err.value).startswith("training failed: worker rank 1 was killed by SIGKILL (workers' log: ")
    assert "\n" not in str(err.value) and err.value.exit_code == 1  # the run broke, not its input (2)
    assert f"last complete checkpoint: {ck}/step_00000004; resume with: autopar run {plan} --checkpoint-dir {ck} " \
        "--resume --steps 8" in str(err.value) and "--checkpoint-every 4" in str(err.value)  # as after Ctrl-C
    before = _rows(m)
    assert [r["step"] for r in before] == [1, 2, 3, 4, 5, 6]
    assert (ck / "latest").read_text().strip() == "step_00000004"

    assert launch(plan, RunOptions(resume=True, **common)) == 0
    rows = _rows(m)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]  # redone: only 5 and 6
    assert [r["loss"] for r in rows[6:8]] == [r["loss"] for r in before[4:6]]
    assert [r["loss"] for r in rows[6:]] == [r["loss"] for r in clean[1][4:]]  # as if never killed
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.5  # 5.6 -> ~3.5: it learns
    for key in ("loss", "grad_norm", "lr", "step_time_s", "predicted_step_time_s", "tokens_per_s", "mfu",
                "peak_memory_GiB", "peak_reserved_GiB", "predicted_memory_GiB"):
        assert all(isinstance(r[key], float) and r[key] > 0 for r in rows), key
    for r in rows:  # the fullest rank's, as the per-rank peaks beside it say
        assert r["peak_memory_GiB"] == max(r["peak_memory_GiB_per_rank"]), r
        assert r["peak_reserved_GiB"] == max(r["peak_reserved_GiB_per_rank"]), r
    assert (ck / "latest").read_text().strip() == "step_00000008"
    resumed = [json.loads(line) for line in m.read_text().splitlines() if '"event"' in line]
    assert resumed == [{"event": "resume", "resumed_after_step": 4, "plan_config": load_plan(plan).config.short()}]

    # rolled back to step 4: the step 8 checkpoint is set aside (neither deleted nor overwritten), 5-8 train again
    old = (ck / "step_00000008" / "meta.json").read_text()
    assert json.loads((ck / "step_00000008" / "meta.json").read_text())["options"] == {
        "checkpoint_every": 4, "keep_checkpoints": None}  # what a resume without them keeps
    assert main(["run", plan, "--checkpoint-dir", str(ck), "--resume-from", "4", "--steps", "8", "--metrics-out",
                 str(m), "--quiet"]) == 0
    aside = list(ck.glob("rolled-back-*"))
    assert len(aside) == 1 and (aside[0] / "step_00000008" / "meta.json").read_text() == old
    assert f"resuming from step_00000004: the newer checkpoint step_00000008 moved to {aside[0]}" in \
        capsys.readouterr().out
    assert (ck / "latest").read_text().strip() == "step_00000008" and (ck / "step_00000008" / "meta.json").exists()
    assert [r["step"] for r in _rows(m)[-4:]] == [5, 6, 7, 8]
    assert [r["loss"] for r in _rows(m)[-4:]] == [r["loss"] for r in rows[-4:]]  # the same steps again


def test_resume_replans_for_the_gpus_there_are_now(tmp_path, capsys, clean):
    """`autopar run --resume --replan --gpus 2`: a run of the default plan on 4 ranks, stopped after step 4,
    continues on 2 ranks under the plan made for them; its steps 5-6 lose what the uninterrupted run loses."""
    plan, whole = clean
    m, ck = tmp_path / "m.jsonl", str(tmp_path / "ck")
    assert main(["run", plan, "--steps", "4", "--checkpoint-dir", ck, "--metrics-out", str(m)]) == 0
    assert main(["run", "--resume", "--replan", "--gpus", "2", "--checkpoint-dir", ck, "--steps", "6",
                 "--metrics-out", str(m)]) == 0
    out = capsys.readouterr().out
    assert "re-planned for 2 GPUs" in out
    assert out.rstrip().endswith(f"autopar: reached step 6; checkpoints in {ck} (newest step_00000006; `--resume` goes "
                                 f"on from it); metrics in {m}")  # where the run left what it wrote
    new = load_plan(Path(ck) / "replanned-2gpus.json")
    assert new.world_size == 2 and new.global_batch == load_plan(plan).global_batch
    rows = _rows(m)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([r["loss"] for r in rows[4:]], [r["loss"] for r in whole[4:6]], atol=1e-5)
    assert main(["run", "--resume", "--checkpoint-dir", ck, "--steps", "7", "--metrics-out", str(m)]) == 0
    assert "resuming under the plan of the newest checkpoint (tp=" in capsys.readouterr().out  # not the default plan
    assert load_plan(Path(ck) / "resumed-plan.json").world_size == 2 and [r["step"] for r in _rows(m)][-1] == 7
    assert main(["run", plan, "--replan", "--resume", "--gpus", "2", "--checkpoint-dir", ck]) == 2
    assert "leave out the plan file" in capsys.readouterr().err
    assert main(["run", "--replan", "--resume", "--gpus", "5", "--checkpoint-dir", ck]) == 2  # 16 sequences, 5 ranks
    err = capsys.readouterr().err
    assert "global batch 16 (a resumed run keeps it) runs on 5 GPUs" in err and "change --global-batch" not in err
    before = sorted(p.name for p in Path(ck).iterdir())  # a dry run writes nothing beside the checkpoints
    for argv in (["--replan", "--gpus", "1"], []):
        assert main(["run", "--resume", *argv, "--checkpoint-dir", ck, "--steps", "9", "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert "a dry run: not written to" in out and "-m runtime.train /" in out and "--resume" in out
    assert sorted(p.name for p in Path(ck).iterdir()) == before


def test_a_rank_that_stops_is_named_and_nothing_is_left_running(tmp_path):
    """Rank 1 stops before step 3 without entering a collective (``AUTOPAR_HANG``): within the timeout the run
    ends with one line naming rank 1 and the call it last made, and no worker is left behind."""
    plan = str(default_plan(tmp_path / "default.json")[0])
    t = time.monotonic()
    with pytest.raises(AutoparError) as err:
        launch(plan, RunOptions(steps=6, quiet=True, collective_timeout=5), env={"AUTOPAR_HANG": "3:1"}, timeout_s=120)
    msg = str(err.value)
    assert msg.startswith("rank 1 stopped making progress at step 3, outside any communication call") and "\n" not in msg
    assert " on " in msg.split("(", 1)[1]  # the call (op on group) it made last
    assert time.monotonic() - t < 60
    left = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if f"runtime.train {plan}" in args:
            left.append(args)
    assert not left, left


def test_young_daly_interval():
    """sqrt(2 x save time x MTBF): a 10 s checkpoint and a failure a day -> 1,314.5 s between checkpoints."""
    from runtime.checkpoint import young_daly_interval_s

    assert young_daly_interval_s(10.0, 86400.0) == pytest.approx(1314.53, abs=0.01)


def test_max_restarts_heals_a_killed_rank(tmp_path, clean, monkeypatch):
    """`--max-restarts 2`: rank 1 killed (SIGKILL) before step 7; torchrun restarts the workers, which resume
    from step 4's checkpoint, redo 5-6 and finish: exit 0, and the final loss is an uninterrupted run's. The run
    leaves nothing in the temporary folder (torchrun's per-attempt folders once stayed there, one per run)."""
    plan, whole = clean
    healed, temp = tmp_path / "healed.jsonl", tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    assert launch(plan, RunOptions(max_restarts=2, metrics_out=str(healed), checkpoint_dir=str(tmp_path / "ck1"),
                                   mtbf_hours=2.0, steps=8, checkpoint_every=4, quiet=True),
                  env={"AUTOPAR_FAULT": "7:1"}) == 0
    lines = [json.loads(line) for line in healed.read_text().splitlines()]
    advice = [r for r in lines if r.get("event") == "checkpoint_interval"]
    assert len(advice) == 2 and advice[0]["after_step"] == 4  # once per attempt, after its first checkpoint
    a = advice[0]
    assert a["young_daly_s"] == pytest.approx((2 * a["save_s"] * 2.0 * 3600) ** 0.5)
    assert a["young_daly_steps"] == max(1, round(a["young_daly_s"] / a["step_s"])) and a["checkpoint_every"] == 4
    events = [r for r in lines if r.get("event") == "restart"]
    assert events == [{"event": "restart", "attempt": 1, "resumed_after_step": 4, "lost_steps": 2}]
    steps = [r["step"] for r in lines if "step" in r]
    assert steps == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    assert [r["loss"] for r in lines if "step" in r][-1] == whole[-1]["loss"]
    assert not list(temp.iterdir())


def test_max_restarts_heals_a_run_over_two_nodes(tmp_path):
    """Two torchrun agents as two nodes (c10d rendezvous, one rank each), rank 0 killed before step 5 while rank 1
    is busy in its own work (not in a collective that would fail with its peer): the first node's agent counts a
    restart, the other's restarts its worker as a change of membership and counts none (as with NCCL, where a dead
    peer fails no call at once); the workers agree that this is the run's second start all the same, resume from
    step 4's checkpoint together and finish with an uninterrupted run's loss (they met in different stores and
    hung before)."""
    import contextlib
    import signal
    import socket

    from runtime.launch import REPO

    plan = _plan(tmp_path, tp=1, pp=1, dp=2, mbs=4, gpus=2)
    clean, healed = tmp_path / "clean.jsonl", tmp_path / "healed.jsonl"
    assert launch(plan, RunOptions(steps=8, metrics_out=str(clean), quiet=True)) == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "AUTOPAR_FAULT": "5:0",
           "AUTOPAR_HANG": "5:1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-id", "two-nodes", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--max-restarts", "1", "-m", "runtime.train", plan, "--steps", "8", "--quiet",
           "--metrics-out", str(healed), "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2",
           "--collective-timeout", "60"]
    nodes = [subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for _ in range(2)]
    try:
        outs = [n.communicate(timeout=300)[1] for n in nodes]
    finally:
        for n in nodes:  # the agents and any worker left (a hung run)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(n.pid, signal.SIGKILL)
    assert [n.returncode for n in nodes] == [0, 0], [o[-600:] for o in outs]
    lines = [json.loads(line) for line in healed.read_text().splitlines()]
    assert [r for r in lines if r.get("event") == "restart"] == [
        {"event": "restart", "attempt": 1, "resumed_after_step": 4, "lost_steps": 0}]
    assert [r["step"] for r in lines if "step" in r] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert _rows(healed)[-1]["loss"] == pytest.approx(_rows(clean)[-1]["loss"], rel=1e-6)


def test_a_diverged_run_is_not_restarted_into_the_same_divergence(tmp_path):
    """`--max-restarts`: a run whose loss turns to nan stops; torchrun's restarts would resume from the same
    checkpoint with the same settings and diverge again, so each stops before training (one nan step in all), and
    the error says how to go on."""
    plan = _plan(tmp_path, tp=1, pp=1, mbs=4, gpus=1)
    data = json.loads(Path(plan).read_text())
    data["train"].update(lr=1e10, min_lr=1e9)
    Path(plan).write_text(json.dumps(data))
    m = tmp_path / "m.jsonl"
    with pytest.raises(AutoparError) as err:
        launch(plan, RunOptions(steps=6, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=1, max_restarts=2, metrics_out=str(m), quiet=True))
    def strict(word: str) -> None:
        raise AssertionError(f"{word} in the metrics: not strict JSON")

    rows = [json.loads(line, parse_constant=strict) for line in m.read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert sum(x is None for x in losses) == 1, losses  # the nan written null: one diverged step, not one per attempt
    assert "nan" in str(err.value)


# ---- bad inputs: one line, before any worker starts ---------------------------------------------

def _plan(tmp_path: Path, **keys) -> str:
    cluster = load_cluster(keys.pop("cluster", "cpu-gloo"), gpus=keys.pop("gpus", None))
    cfg = ParallelConfig(**{"tp": 2, "pp": 2, **keys})
    path = tmp_path / f"plan{len(list(tmp_path.glob('plan*.json')))}.json"
    save_plan(make_plan(load_model("tiny"), cluster, 16, cfg), path)
    return str(path)


def test_bad_inputs_are_one_line_errors(tmp_path):
    cases = []
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "autopar.plan/1", "model": ')
    cases.append((dict(plan_path=str(bad)), "not valid JSON"))
    cases.append((dict(plan_path=_plan(tmp_path), nproc=8), "needs 4 processes"))
    cases.append((dict(plan_path=_plan(tmp_path, gpus=2)), "has 2 GPUs"))
    cases.append((dict(plan_path=_plan(tmp_path), data=str(tmp_path / "missing.u16")), "does not exist"))
    wide = tmp_path / "wide.u16"
    np.array([1, 2, 300] * 100, dtype=np.uint16).tofile(wide)
    cases.append((dict(plan_path=_plan(tmp_path), data=str(wide)), "token id 300"))
    odd = tmp_path / "odd.u16"
    odd.write_bytes(b"abc")
    cases.append((dict(plan_path=_plan(tmp_path), data=str(odd)), "not a whole number"))
    cases.append((dict(plan_path=_plan(tmp_path), resume=True, checkpoint_dir=str(tmp_path / "none")),
                  "no checkpoint to resume from"))
    empty = tmp_path / "empty.npy"
    empty.write_bytes(b"")
    cases.append((dict(plan_path=_plan(tmp_path), data=str(empty)), "empty.npy is empty (0 tokens)"))
    empty_text = tmp_path / "empty.txt"  # named as given, not as its tokenised copy in the cache
    empty_text.write_text("")
    cases.append((dict(plan_path=_plan(tmp_path), data=str(empty_text)), "empty.txt is empty (0 tokens)"))
    # options that would only fail after training: refused before any worker starts
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases.append((dict(plan_path=_plan(tmp_path), checkpoint_dir=str(a_file)), "exists and is not a folder"))
    cases.append((dict(plan_path=_plan(tmp_path), checkpoint_dir=str(a_file / "ck")), "is a file, not a folder"))
    cases.append((dict(plan_path=_plan(tmp_path), metrics_out=str(a_file / "m.jsonl")), "is a file, not a folder"))
    cases.append((dict(plan_path=_plan(tmp_path), metrics_out=str(tmp_path)), "is a directory"))
    cases.append((dict(plan_path=_plan(tmp_path), steps=-1), "--steps must be at least 1 (and below 2^63), got -1"))
    cases.append((dict(plan_path=_plan(tmp_path), checkpoint_every=-1), "--checkpoint-every must be 0"))
    cases.append((dict(plan_path=_plan(tmp_path), max_restarts=2), "--max-restarts needs --checkpoint-dir"))
    cases.append((dict(plan_path=_plan(tmp_path), keep_checkpoints=2), "--keep-checkpoints needs --checkpoint-dir"))
    cases.append((dict(plan_path=_plan(tmp_path), keep_checkpoints=0, checkpoint_dir=str(tmp_path / "k")),
                  "--keep-checkpoints must be at least 1"))
    cases.append((dict(plan_path=_plan(tmp_path), mtbf_hours=0.0), "--mtbf-hours must be a positive number"))
    cases.append((dict(plan_path=_plan(tmp_path), collective_timeout=0.0), "--collective-timeout must be a positive"))
    cases.append((dict(plan_path=_plan(tmp_path), max_restarts=-1, checkpoint_dir=str(tmp_path / "c")),
                  "--max-restarts must be 0 or more"))
    cases.append((dict(plan_path=_plan(tmp_path), checkpoint_every=5), "--checkpoint-every needs --checkpoint-dir"))
    cases.append((dict(plan_path=_plan(tmp_path), mtbf_hours=5.0), "--mtbf-hours needs --checkpoint-dir"))
    cases.append((dict(plan_path=_plan(tmp_path), checkpoint_dir=str(tmp_path / "fresh"), train_from_plan=True),
                  "--train-from-plan says which schedule a resumed run takes"))
    held = tmp_path / "held"  # a run's checkpoint folder, at step 3
    (held / "step_00000003").mkdir(parents=True)
    (held / "step_00000003" / "meta.json").write_text("{}")
    other = tmp_path / "other"  # a checkpoint of the same model at another sequence length: refused before launch
    (other / "step_00000003").mkdir(parents=True)
    longer = load_plan(_plan(tmp_path)).model_copy(update={"seq": 64})
    (other / "step_00000003" / "meta.json").write_text(json.dumps(
        {"format": FORMAT, "step": 3, "plan": fingerprint(longer, longer.state), "checksums": {}}))
    cases.append((dict(plan_path=_plan(tmp_path), checkpoint_dir=str(other), resume=True, steps=8),
                  "is of another run (seq: checkpoint has 64, this run 128)"))
    cases.append((dict(plan_path=_plan(tmp_path), checkpoint_dir=str(other), resume=True, steps=8, dry_run=True),
                  "is of another run (seq: checkpoint has 64, this run 128)"))  # a dry run checks it too
    cases.append((dict(plan_path=_plan(tmp_path), checkpoint_dir=str(held), resume=True, steps=8),
                  "is corrupt (unreadable meta.json)"))
    cases.append((dict(plan_path=_plan(tmp_path), checkpoint_dir=str(held)), "add --resume to continue that run"))
    cases.append((dict(plan_path=_plan(tmp_path), checkpoint_dir=str(held / "step_00000003"), resume=True),
                  f"step_00000003 is one checkpoint; give the folder holding it, --checkpoint-dir {held}"))
    profile = tmp_path / "mine.yaml"  # a file of another kind: the metrics would destroy it
    profile.write_text(Path(REPO, "hardware_profiles", "clusters", "cpu-gloo.yaml").read_text())
    cases.append((dict(plan_path=_plan(tmp_path), metrics_out=str(profile)), f"{profile} exists and is not a "
                  "metrics file"))
    earlier = tmp_path / "earlier.jsonl"  # an earlier run's metrics: a run from scratch would overwrite them
    earlier.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.5}\n')
    cases.append((dict(plan_path=_plan(tmp_path), metrics_out=str(earlier)),
                  f"metrics file {earlier} holds an earlier run's metrics (to step 2)"))
    cases.append((dict(plan_path=_plan(tmp_path), checkpoint_dir=str(held), resume=True, steps=2),
                  "is at step 3, and this run stops at step 2"))
    # a hand-edited plan file: wrong JSON types and values in 'parallel' and 'train'
    base = json.loads(Path(_plan(tmp_path)).read_text())
    for section, key, value, expect in [
            ("parallel", "tp", "2", "plan key tp must be an integer"),
            ("parallel", "tp", 2.0, "plan key tp must be an integer"),
            ("parallel", "tp", None, "plan key tp must be an integer"),
            ("parallel", "sp", "false", "plan key sp must be true or false"),
            ("parallel", "layers", ["a"], "plan key layers must be a list of integers"),
            ("parallel", "recompute_layers", "2", "plan key recompute_layers must be a list of integers"),
            ("parallel", "recompute", "bogus", "plan key recompute must be one of"),
            ("parallel", "tpp", 2, "unknown plan key 'tpp'"),
            ("train", "lr", -1.0, "train.lr"),
            ("train", "betas", [0.9, 1.5], "train.betas"),
            ("train", "seed", -1, "train.seed"),
            ("train", "steps", True, "train.steps")]:
        edited = tmp_path / f"edited-{section}-{key}.json"
        edited.write_text(json.dumps({**base, section: {**base[section], key: value}}))
        cases.append((dict(plan_path=str(edited)), expect))
    for i, (edit, expect) in enumerate([  # a batch that does not split: the file's field, not an option
            ({"global_batch": 7, "parallel": {**base["parallel"], "mbs": 2}}, "or change global_batch"),
            ({"parallel": {**base["parallel"], "dp": 4}}, "the plan needs 16 GPUs (tp=2 pp=2 dp=4")]):
        odd = tmp_path / f"odd{i}.json"
        odd.write_text(json.dumps({**base, **edit}))
        cases.append((dict(plan_path=str(odd)), expect))
    for i, parallel in enumerate([{k: v for k, v in base["parallel"].items() if k != "dp"}, {}]):
        no_dp = tmp_path / f"no-dp{i}.json"  # ran on tp*pp*cp ranks whatever its cluster had
        no_dp.write_text(json.dumps({**base, "parallel": parallel}))
        cases.append((dict(plan_path=str(no_dp)), "field 'parallel': no dp: write it (tp*pp*cp*dp ranks"))
    for kwargs, expect in cases:
        with pytest.raises(AutoparError) as err:
            options = {k: v for k, v in kwargs.items() if k not in ("plan_path", "nproc")}
            launch(kwargs["plan_path"], RunOptions(**options, quiet=True), nproc=kwargs.get("nproc"))
        assert expect in str(err.value) and "\n" not in str(err.value), (kwargs, str(err.value))


def test_multi_node_plan_prints_the_commands(tmp_path, capsys, monkeypatch):
    """The lines for every node name the plan and the outputs by absolute paths (each node's shell is in a folder of
    its own), say where MASTER_ADDR comes from, and give srun's rendezvous the job's id."""
    path = _plan(tmp_path, cluster="dgx-h100", gpus=16, tp=4, pp=2, dp=2)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")  # (``..`` taken out of the paths printed)
    assert launch(f"../{Path(path).name}", RunOptions(steps=5, quiet=True, metrics_out="../out/m.jsonl",
                                                      checkpoint_dir="../ck")) == 0
    out = capsys.readouterr().out
    assert "torchrun --nnodes 2 --nproc-per-node 8" in out and "srun --nodes 2" in out
    assert f"-m runtime.train {path} --steps 5 --metrics-out {tmp_path / 'out' / 'm.jsonl'} --checkpoint-dir " \
           f"{tmp_path / 'ck'} " in out
    assert "MASTER_ADDR: node rank 0's host" in out and "--rdzv-id autopar-$SLURM_JOB_ID" in out


def test_the_printed_commands_survive_a_path_that_needs_quoting(tmp_path):
    """A plan path with a space and a quote: the torchrun line and the script srun hands each node's bash both
    name it as one argument, and node 0's host is looked up on the node (not where the line is typed)."""
    import shlex

    from runtime.launch import multi_node_commands

    odd = tmp_path / "sp ace" / "my 'plan'.json"
    odd.parent.mkdir()
    odd.write_text(Path(_plan(tmp_path, cluster="dgx-h100", gpus=16, tp=4, pp=2, dp=2)).read_text())
    torchrun, srun = multi_node_commands(load_plan(str(odd)), ["-m", "runtime.train",
                                                               *worker_argv(str(odd), RunOptions(steps=5))])
    args = shlex.split(torchrun)
    assert args[args.index("runtime.train") + 1] == str(odd)
    outer = shlex.split(srun)
    assert outer[:6] == ["srun", "--nodes", "2", "--ntasks-per-node", "1", "bash"] and outer[6] == "-c"
    assert len(outer) == 8 and "$(scontrol show hostnames" in outer[7]  # expanded by each node's bash
    inner = shlex.split(outer[7].replace("$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)", "node0"))
    assert inner[inner.index("runtime.train") + 1] == str(odd) and "node0:29500" in inner


def test_dry_run_prints_the_torchrun_command(tmp_path, capsys):
    path = _plan(tmp_path)
    assert launch(path, RunOptions(dry_run=True, quiet=True)) == 0
    # output folders that do not exist yet are fine (the writers create them), and nothing is created here
    new = tmp_path / "new"
    assert launch(path, RunOptions(dry_run=True, quiet=True, metrics_out=str(new / "m.jsonl"), checkpoint_dir=str(new / "ck"))) == 0
    assert not new.exists()
    out = capsys.readouterr().out
    assert "torch.distributed.run --standalone --nproc-per-node 4 -m runtime.train" in out
    # both command lines pass every run option on to the workers (one reading of them, runtime.options)
    from runtime.launch import main as launch_main

    argv = [path, "--dry-run", "--quiet", "--max-restarts", "2", "--checkpoint-dir", str(tmp_path / "ck"),
            "--collective-timeout", "77", "--mtbf-hours", "5"]
    for command in (lambda: main(["run", *argv]), lambda: launch_main(argv)):
        assert command() == 0
        out = capsys.readouterr().out
        assert "--max-restarts 2" in out and "--collective-timeout 77" in out and "--mtbf-hours 5" in out, out
        assert "--quiet" in out.splitlines()[-1].split(), out


def test_dry_run_of_the_default_job_says_what_it_does(tmp_path, capsys, monkeypatch):
    """`autopar run --dry-run` with no plan plans the default job and prints its command; it does not claim to
    train it."""
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    assert main(["run", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "its command:" in out and "training it" not in out
    assert "-m runtime.train " + str(tmp_path / "default-plan.json") in out
    flat = " ".join(out.split())  # (rich wraps the lines)
    assert "tp=2 pp=2 held to show tensor and pipeline parallelism" in flat  # not the free search's best
    assert "`autopar plan --model tiny --cluster cpu-gloo --gpus 4 --global-batch 16` plans it freely" in flat


def test_gpus_without_a_plan_file_says_how_to_run_the_default_job_on_that_many_ranks(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    assert main(["run", "--gpus", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`autopar plan --model tiny --cluster cpu-gloo --gpus 2 --global-batch 16 --out " \
        "plan.json`, then `autopar run plan.json`" in err
    assert not (tmp_path / "default-plan.json").exists()


def test_train_entry_point_errors_and_single_rank_run(tmp_path):
    """``python -m runtime.train``: a 4-rank plan without torchrun is refused in one line; a 1-rank plan runs; a
    run whose loss becomes nan stops in one line and keeps the checkpoints from before it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    four = _plan(tmp_path)
    r = subprocess.run([sys.executable, "-m", "runtime.train", four], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith("autopar error: plan") and "needs 4 processes" in r.stderr
    one = _plan(tmp_path, tp=1, pp=1, mbs=4)
    m = tmp_path / "m.jsonl"
    r = subprocess.run([sys.executable, "-m", "runtime.train", one, "--steps", "2", "--metrics-out", str(m)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "step 2/2" in r.stdout and [row["step"] for row in _rows(m)] == [1, 2]
    # a learning rate that blows the weights up: the step whose loss is nan stops the run before it is saved
    data = json.loads(Path(one).read_text())
    data["train"].update(lr=1e10, min_lr=1e9)
    Path(one).write_text(json.dumps(data))
    ck = tmp_path / "ck"
    r = subprocess.run([sys.executable, "-m", "runtime.train", one, "--steps", "6", "--checkpoint-dir", str(ck),
                        "--checkpoint-every", "1", "--quiet"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "the loss is nan" in r.stderr and "without saving it" in r.stderr and "step_00000001" in r.stderr
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000001"]


def test_a_run_resumed_under_another_plan_keeps_its_schedule(tmp_path):
    """A checkpoint carries its run's learning-rate schedule to the plan that resumes it, whatever that plan's own
    train section says (it is noted once), so the learning rate goes on where it was."""
    from runtime.parallel.optimizer import lr_at

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    first, other = _plan(tmp_path, tp=1, pp=1, mbs=4), _plan(tmp_path, tp=1, pp=1, mbs=2)
    data = json.loads(Path(first).read_text())
    data["train"].update(steps=30, lr=1e-3, min_lr=1e-4)
    Path(first).write_text(json.dumps(data))
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    for plan, extra in ((first, []), (other, ["--resume"])):
        r = subprocess.run([sys.executable, "-m", "runtime.train", plan, "--steps", str(2 + len(extra) * 2),
                            "--checkpoint-dir", str(ck), "--metrics-out", str(m), "--checkpoint-every", "1",
                            "--keep-checkpoints", "3", *extra],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    assert "resuming with the checkpoint's training settings" in r.stdout and "steps 30 (the plan has" in r.stdout
    train = load_plan(first).train
    assert [row["lr"] for row in _rows(m)] == pytest.approx([lr_at(s, train, 30) for s in range(4)])
    assert sorted(p.name for p in ck.glob("step_*")) == [f"step_0000000{i}" for i in (2, 3, 4)]  # --keep-checkpoints
    # --train-from-plan: the resuming plan's own schedule (its default train section, 20 steps)
    r = subprocess.run([sys.executable, "-m", "runtime.train", other, "--steps", "5", "--checkpoint-dir", str(ck),
                        "--metrics-out", str(m), "--resume", "--train-from-plan", "--quiet"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert _rows(m)[-1]["lr"] == pytest.approx(lr_at(4, load_plan(other).train, 20))
    # the seed is the run's: another seed is another run, refused (it is not carried over like the schedule)
    data = json.loads(Path(other).read_text())
    data["train"]["seed"] = 99
    Path(other).write_text(json.dumps(data))
    r = subprocess.run([sys.executable, "-m", "runtime.train", other, "--steps", "6", "--checkpoint-dir", str(ck),
                        "--resume", "--quiet"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "another run" in r.stderr and "seed" in r.stderr, r.stderr


def test_every_plan_the_planner_writes_is_accepted_by_run(tmp_path, capsys):
    """A property over 40 random searches of the tiny models (random GPU counts, batches, sequence lengths and
    fixed keys): every plan file `autopar plan --out` writes passes `autopar run --dry-run`'s checks, and the
    plan command says "train it with" for each; a search the keys make impossible is a one-line error."""
    from planner.cli import main

    rng = np.random.default_rng(2026)
    keys = {"tp": ["1", "2", "4"], "pp": ["1", "2"], "cp": ["1", "2"], "sp": ["true", "false"],
            "zero": ["0", "1", "2", "3"], "recompute": ["none", "selective", "full"], "dp_overlap": ["true"],
            "tp_overlap": ["true", "false"], "mbs": ["1", "2"]}
    written = 0
    for i in range(40):
        fix = ",".join(f"{k}={rng.choice(keys[k])}" for k in rng.choice(list(keys), size=rng.integers(0, 4),
                                                                           replace=False))
        argv = ["plan", "--model", str(rng.choice(["tiny", "tiny-gpt"])), "--cluster", "cpu-gloo",
                "--gpus", str(rng.choice([1, 2, 4, 8])), "--global-batch", str(rng.choice([8, 16, 32])),
                "--seq", str(rng.choice([32, 64, 128])), "--fix", fix, "--out", str(tmp_path / f"p{i}.json")]
        code = main(argv)
        out, err = capsys.readouterr()
        if code != 0:
            assert code == 2 and err.count("\n") == 1 and err.startswith("autopar: error:"), (argv, err)
            continue
        assert "train it with: autopar run" in " ".join(out.split()), argv
        assert main(["run", str(tmp_path / f"p{i}.json"), "--dry-run"]) == 0, (argv, capsys.readouterr().err)
        capsys.readouterr()
        written += 1
    assert written >= 20


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_ctrl_c_says_where_the_run_stopped_and_how_to_resume(tmp_path, how):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) or SIGTERM to `autopar run` alone (as `kill`
    or a scheduler sends it; torchrun and its workers trained on without it): one line with the step reached, the
    last complete checkpoint and the command that resumes, with the run's checkpoint interval; no worker left
    behind; the resume command works."""
    import signal
    import time

    plan = str(default_plan(tmp_path / "p.json")[0])
    m, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    cmd = [sys.executable, "-m", "planner.cli", "run", plan, "--steps", "400", "--metrics-out", str(m),
           "--checkpoint-dir", str(ck), "--checkpoint-every", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (m.exists() and len(m.read_text().splitlines()) >= 5):
        time.sleep(0.2)
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    line = [x for x in err.splitlines() if x.startswith("autopar:")]
    assert len(line) == 1, err
    assert "interrupted after step" in line[0] and "of 400" in line[0], line
    assert f"last complete checkpoint: {ck}/step_" in line[0] and "resume with: autopar run" in line[0], line
    with pytest.raises(ProcessLookupError):  # the group is gone: torchrun and its workers stopped
        os.killpg(proc.pid, 0)
    resume = line[0].split("resume with: ")[1].split()
    assert resume[:3] == ["autopar", "run", plan] and "--resume" in resume
    assert resume[resume.index("--checkpoint-every") + 1] == "2"  # the run's own interval, not the plan's default
    time.sleep(1)
    steps = len(m.read_text().splitlines())
    time.sleep(1.5)  # (a step takes about 0.3 s)
    assert len(m.read_text().splitlines()) == steps  # nothing trains on


def test_the_gradient_norm_is_the_plans_alike(tmp_path):
    """The gradient norm clipping reads (and the metrics report) of the tiny model's 0.8M-parameter buckets: one
    rank and two ZeRO-1 ranks (each norming its half of every bucket) agree to 1e-6 (CPU's fp32 norm, adding a
    bucket's squares one after another, had them 2e-5 apart)."""
    norms = []
    for keys in (dict(tp=1, pp=1, dp=1, mbs=4, gpus=1), dict(tp=1, pp=1, dp=2, mbs=4, zero=1, gpus=2)):
        m = tmp_path / f"m{len(norms)}.jsonl"
        assert launch(_plan(tmp_path, **keys), RunOptions(steps=1, metrics_out=str(m), quiet=True)) == 0
        norms.append(_rows(m)[0]["grad_norm"])
    assert norms[1] == pytest.approx(norms[0], rel=1e-6), norms


def test_a_checkpoint_that_cannot_be_written_is_one_line_with_its_cause(tmp_path):
    """A full disk under a checkpoint save (DCP raises a CheckpointException, a BaseException, holding each rank's
    OSError): one line naming the file system's error and what to do, no traceback, the partial folder removed
    (it holds space a full disk needs); the checkpoint before it kept."""
    plan = _plan(tmp_path, tp=1, pp=1, gpus=1)
    ck = tmp_path / "ck"
    script = (
        "import errno, os, sys\n"
        "import torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint.api import CheckpointException\n"
        "real, calls = dcp.save, []\n"
        "def full(*a, **k):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 1: return real(*a, **k)\n"
        "    raise CheckpointException('save failed', {0: (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), None)})\n"
        "dcp.save = full\n"
        "from runtime.train import main\n"
        f"sys.exit(main([{plan!r}, '--steps', '3', '--checkpoint-dir', {str(ck)!r}, '--checkpoint-every', '1',"
        " '--quiet']))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 1, out.stderr  # the run broke on its way (1), not on its input (2)
    assert out.stderr.strip().splitlines() == [
        f"autopar error (the run broke): cannot write checkpoint {ck}/step_00000002 (No space left on device); the checkpoint "
        "before it (step_00000001) is kept: free space or give another --checkpoint-dir"], out.stderr
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == ["step_00000001"]
    # a failure that is not the file system's (a lost peer, say), at the first save: no advice about space
    other = script.replace("if len(calls) == 1: return real(*a, **k)", "pass").replace(
        "OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))", "RuntimeError('peer lost')").replace(str(ck), str(ck) + "2")
    out = subprocess.run([sys.executable, "-c", other], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"autopar error (the run broke): checkpoint {ck}2/step_00000001 was not written (peer lost)"], out.stderr
    # torch's writer on a full disk may say only "unexpected pos": the disk's free space tells it was full
    full = other.replace("RuntimeError('peer lost')", "RuntimeError('[enforce fail] unexpected pos 704 vs 598')").replace(
        "import errno, os, sys\n", "import errno, os, sys, shutil, collections\n"
        "shutil.disk_usage = lambda p: collections.namedtuple('Usage', 'total used free')(1 << 30, 1 << 30, 4096)\n"
    ).replace(str(ck) + "2", str(ck) + "3")
    out = subprocess.run([sys.executable, "-c", full], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"autopar error (the run broke): cannot write checkpoint {ck}3/step_00000001 (the disk holding it is full: 0 MiB free): free "
        "space or give another --checkpoint-dir"], out.stderr


def test_a_worker_whose_agent_ended_while_it_started_ends_too(tmp_path):
    """A worker of `autopar run` whose torchrun agent ends before the worker can follow it (a tune trial stopped at
    its time limit while its workers still imported torch) exits at once; it used to wait, orphaned, for a
    rendezvous that never came (half an hour). A worker started by hand under torchrun, whose agent may be a
    container's init, is left alone. An agent stand-in starts a slow-starting worker and ends at once."""
    from runtime.ends_with import LAUNCHER_ENV

    worker = ("import os, time; time.sleep(1.5); from runtime.ends_with import end_with_parent; end_with_parent(); "
              "open(os.environ['MARK'], 'w').write('trained on')")
    agent = f"import subprocess, sys; print(subprocess.Popen([sys.executable, '-c', {worker!r}]).pid)"
    for launched in (True, False):
        mark = tmp_path / f"alive-{launched}"
        env = {**os.environ, "MARK": str(mark), "PYTHONPATH": str(REPO), "TORCHELASTIC_RUN_ID": "x",
               LAUNCHER_ENV: str(os.getpid())}
        if not launched:
            del env[LAUNCHER_ENV]
        pid = int(subprocess.run([sys.executable, "-c", agent], env=env, capture_output=True, text=True,
                                 check=True).stdout)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # (not our child: gone, or a zombie where init does not reap)
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.1)
        assert mark.exists() != launched, launched


@pytest.mark.parametrize("killed", ["launcher", "agent"])
def test_a_killed_launcher_takes_its_workers_with_it(tmp_path, killed):
    """SIGKILL to `autopar run` (a scheduler's, the OOM killer's: nothing of it runs after) stops torchrun and its
    workers too; they trained on, orphaned, into a checkpoint folder whose lock had gone with it. The same for
    torchrun's agent killed under a running launcher: its workers end with it."""
    import contextlib
    import signal
    import time

    plan = str(default_plan(tmp_path / "p.json")[0])
    m = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "planner.cli", "run", plan, "--steps", "400", "--metrics-out", str(m)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (m.exists() and len(m.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    def left() -> list[int]:  # torchrun and its workers (in a session of their own): by the plan they name
        pids = []
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and plan.encode() in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
        return pids

    assert len(left()) >= 3  # torchrun and the plan's 2+ ranks (the launcher names it too)
    if killed == "launcher":
        proc.kill()
        proc.wait()
    else:
        agent = [p for p in left() if b"torch.distributed.run" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(agent) == 1
        os.kill(agent[0], signal.SIGKILL)
        assert proc.wait(timeout=120) == 1  # the run broke on its way
    deadline = time.monotonic() + 60
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    stray = left()
    for pid in stray:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not stray, "torchrun or its workers outlived the killed launcher by 60 s"
    steps = len(m.read_text().splitlines())
    time.sleep(2)
    assert len(m.read_text().splitlines()) == steps  # nothing trains on


def test_a_hand_edited_plan_is_re_estimated_at_load(tmp_path, capsys):
    """A plan file whose keys were edited by hand (tp=2 pp=2 -> tp=1 pp=2 dp=2) runs, says its prediction was
    redone, and its metrics carry the new prediction, not the one written for the old keys."""
    from cost_models.step import estimate
    from planner.cli import main

    path = tmp_path / "p.json"
    default_plan(path)
    data = json.loads(path.read_text())
    old = data["prediction"]["step_time_s"]
    data["parallel"].update(tp=1, dp=2, sp=False, tp_overlap=False)
    path.write_text(json.dumps(data))
    plan = load_plan(path)
    assert not plan.prediction_is_current
    est = estimate(plan.model, plan.cluster, plan.config, plan.global_batch, state=plan.state)
    fresh = est.step_time_s
    m = tmp_path / "m.jsonl"
    assert main(["run", str(path), "--steps", "2", "--metrics-out", str(m)]) == 0
    assert f"was edited since its prediction ({old:.4g} s a step); re-estimated" in capsys.readouterr().out
    rows = [r for r in _rows(m) if "step" in r]
    assert rows and all(r["predicted_step_time_s"] == pytest.approx(fresh) for r in rows) and fresh != old
    assert all(r["predicted_memory_GiB"] == pytest.approx(est.memory_GiB) for r in rows)
    assert not any("predicted_memory_GiB_per_rank" in r for r in rows)  # the stored stages were for the old keys
    assert est.memory_GiB != pytest.approx(data["prediction"]["memory_GiB"])
    assert load_plan(default_plan(tmp_path / "fresh.json")[0]).prediction_is_current


def test_a_gpu_plan_edited_past_its_memory_is_refused_and_one_without_prediction_is_estimated(tmp_path, capsys):
    """A GPU plan file edited by hand until the memory model prices it above the GPU's memory is refused before
    launch, in one line (the planner never writes one); a plan file without a prediction gets one at launch."""
    from cost_models.step import estimate
    from planner.search import search

    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", gpus=8)
    best = search(model, cluster, 64, top=1).plans[0]
    path = tmp_path / "big.json"
    save_plan(make_plan(model, cluster, 64, best.config, best.estimate.to_json()), path)
    data = json.loads(path.read_text())
    data["parallel"].update(tp=1, pp=1, dp=8, mbs=8, zero=0, recompute="none", sp=False, tp_overlap=False)
    path.write_text(json.dumps(data))
    plan = load_plan(path)
    need = max(estimate(plan.model, plan.cluster, plan.config, 64, state=plan.state).stage_memory_GiB)
    assert need > 80
    assert main(["run", str(path), "--steps", "1", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"needs {need:.1f} GiB per GPU by the memory model, above the GPU's 80 GiB" in err and "\n" not in err
    bare = tmp_path / "bare.json"
    data = json.loads(Path(_plan(tmp_path, gpus=4)).read_text())
    data.pop("prediction", None)
    bare.write_text(json.dumps(data))
    assert main(["run", str(bare), "--steps", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = load_plan(bare)
    step = estimate(plan.model, plan.cluster, plan.config, plan.global_batch, state=plan.state).step_time_s
    assert "has no prediction; estimated for" in out and f"--predicted-step-time {step!r}" in out


def test_a_plan_the_runtime_cannot_run_is_refused_in_one_line(tmp_path, capsys):
    """A plan file edited into one the runtime does not execute (fused gradient accumulation) is refused in one line
    naming the file, before any note on its edited prediction."""
    path = tmp_path / "p.json"
    default_plan(path)
    data = json.loads(path.read_text())
    data["state"]["fused_accumulation"] = True
    path.write_text(json.dumps(data))
    assert main(["run", str(path), "--steps", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith(f"autopar: error: plan file {path}: state.fused_accumulation=true"), err


def test_a_plan_edited_in_model_cluster_or_state_is_not_current(tmp_path):
    """Not only the keys: a plan file whose model, cluster or state was edited by hand carries a prediction for
    something else; restoring the edit makes it current again, and a file stamped before the inputs were counts as
    current in them."""
    path = tmp_path / "p.json"
    default_plan(path)
    data = json.loads(path.read_text())
    assert load_plan(path).prediction_is_current
    for part, key, value in (("model", "num_layers", 6), ("cluster", "gpus_per_node", 16), ("state", "bucket_params", 999)):
        edited = json.loads(json.dumps(data))
        edited[part][key] = value
        path.write_text(json.dumps(edited))
        assert not load_plan(path).prediction_is_current, part
        del edited["prediction"]["for"]["inputs"]
        path.write_text(json.dumps(edited))
        assert load_plan(path).prediction_is_current, part
    path.write_text(json.dumps(data))
    assert load_plan(path).prediction_is_current
    # parallel keys at their defaults left out (a file written before they existed, or by hand): no edit
    short = json.loads(json.dumps(data))
    defaults = {k: f.default for k, f in ParallelConfig.__dataclass_fields__.items()}
    short["parallel"] = {k: v for k, v in data["parallel"].items() if v != defaults[k] or k in ("tp", "pp", "dp")}
    assert len(short["parallel"]) < len(data["parallel"])
    path.write_text(json.dumps(short))
    assert load_plan(path).prediction_is_current
    short["parallel"]["recompute"] = "full"  # ... but a key given at another value is
    path.write_text(json.dumps(short))
    assert not load_plan(path).prediction_is_current
    path.write_text(json.dumps(data))
    # keys edited to use 2 of the cluster's 4 GPUs: re-estimated on those 2 (it was a rule error about 4 GPUs)
    from planner.commands.run import _fresh_prediction

    data["parallel"].update(tp=1, sp=False, tp_overlap=False)
    path.write_text(json.dumps(data))
    plan = load_plan(path)
    assert plan.world_size == 2 < plan.cluster.num_gpus and plan.used_cluster.num_gpus == 2
    assert _fresh_prediction(plan, str(path)).step_time_s > 0


@pytest.mark.parametrize("sizes,cfg", [
    ((2, 2), ParallelConfig(tp=1, pp=2, dp=2, placement=("a", "b"), layers=(3, 1))),
    ((1, 3), ParallelConfig(tp=1, pp=4, dp=1, placement=("a", "b", "b", "b"), layers=(1, 1, 1, 1))),
], ids=["2+2", "1+3"])
def test_a_placed_plan_runs_as_its_groups_nodes(tmp_path, capsys, sizes, cfg):
    """A plan placed on two node groups (one node each, of 2 and 2 ranks, or 1 and 3: nodes of different sizes;
    uneven layers): `autopar run` prints one torchrun line per group, each with its node's ranks; run as two "nodes"
    on this machine they train to the losses of the same plan run as one node."""
    import socket

    from rt_cases import grouped_cpu_cluster

    from specs.planfile import TrainConfig

    plan = make_plan(load_model("tiny"), grouped_cpu_cluster(sizes[0], ranks_of_b=sizes[1]), 8, cfg,
                     train=TrainConfig(steps=3, warmup_steps=1))
    path = tmp_path / "placed.json"
    save_plan(plan, path)
    assert main(["run", str(path), "--steps", "3", "--metrics-out", str(tmp_path / "nodes.jsonl"), "--quiet"]) == 0
    out = capsys.readouterr().out
    lines = [x.strip() for x in out.splitlines() if x.strip().startswith("torchrun")]
    assert len(lines) == 2 and "# group a, node ranks 0" in out and "# group b, node ranks 1" in out
    assert [f"--nproc-per-node {n} " in line for n, line in zip(sizes, lines)] == [True, True]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "i": "0", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(["bash", "-c", line.replace("--master-port 29500", f"--master-port {port}")],
                              cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for line in lines]
    for p in nodes:
        assert p.wait(timeout=300) == 0, p.stderr.read()[-2000:]
    one = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          "-m", "runtime.train", str(path), "--steps", "3", "--metrics-out", str(tmp_path / "one.jsonl"),
                          "--quiet"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    got, want = (_rows(tmp_path / f"{n}.jsonl") for n in ("nodes", "one"))
    assert [r["step"] for r in got] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-6)
    assert got[-1]["loss"] < got[0]["loss"]


def test_interval_advice_names_a_run_that_checkpoints_only_at_its_end(capsys):
    """--mtbf-hours without --checkpoint-every (the plan's 0: only the last step is saved) says so, not "every 0"."""
    from runtime.train import _advise_interval

    class Log:
        def event(self, **fields):
            self.fields = fields

    log = Log()
    _advise_interval(log, 8, save_s=2.0, step_s=1.0, mtbf_hours=2.0, every=0, quiet=False)
    out = capsys.readouterr().out
    assert "this run: only at its end" in out and "every 0" not in out, out
    assert log.fields["young_daly_steps"] == round((2 * 2.0 * 7200) ** 0.5) and log.fields["checkpoint_every"] == 0
    _advise_interval(log, 8, save_s=2.0, step_s=1.0, mtbf_hours=2.0, every=4, quiet=False)
    assert "this run: every 4 step(s)" in capsys.readouterr().out


@pytest.fixture
def in_process(monkeypatch):
    """The worker's main run in this process as `python -m runtime.train` runs it without torchrun (1-2 s a run less
    than a new process): no launcher's or fault-injection variables, torch's global RNG (which the trainer seeds)
    given back after, and no process group left behind by a run that fails."""
    import torch
    import torch.distributed as dist

    from runtime.train import main as worker

    for name in [n for n in os.environ if n.startswith(("AUTOPAR_", "TORCHELASTIC_"))] + [
            "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"]:
        monkeypatch.delenv(name, raising=False)
    with torch.random.fork_rng():
        try:
            yield worker
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def test_a_run_that_fails_leaves_torch_distributed_unpatched(tmp_path, capfd, monkeypatch, in_process):
    """A step that raises: the worker says so in one line and returns 1, and its communication hooks are taken off
    torch.distributed (a run in this process, as the tests run some, leaves nothing wrapped behind)."""
    import torch.distributed as dist

    from runtime.trainer import Trainer

    def broken(self):
        raise RuntimeError("no step today")

    monkeypatch.setattr(Trainer, "train_step", broken)
    real = dist.all_reduce
    assert in_process([_plan(tmp_path, tp=1, pp=1, mbs=4), "--steps", "2", "--quiet"]) == 1
    assert "RuntimeError: no step today" in capfd.readouterr().err
    assert dist.all_reduce is real


def test_a_resumed_run_goes_on_with_the_data_it_trained_on(tmp_path, capfd, in_process):
    """A resume without --data trains on the file the checkpoint's run trained on (not the bundled sample): its
    losses are the uninterrupted run's; a file since moved is a one-line error, and another --data is noted. (The
    one-rank runs are the worker's main in this process: ``in_process``.)"""
    worker = in_process
    plan = _plan(tmp_path, tp=1, pp=1, mbs=4)
    rng = np.random.default_rng(0)
    words = tmp_path / "words.txt"
    words.write_text(" ".join(rng.choice(["alpha", "beta", "gamma", "delta"], 20000)))

    def train(*extra: str) -> subprocess.CompletedProcess:
        capfd.readouterr()
        code = worker([plan, *extra])
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess([], code, out, err)

    whole, part, ck = tmp_path / "whole.jsonl", tmp_path / "part.jsonl", str(tmp_path / "ck")
    assert train("--steps", "4", "--data", str(words), "--metrics-out", str(whole)).returncode == 0
    assert train("--steps", "2", "--data", str(words), "--checkpoint-dir", ck, "--metrics-out", str(part)
                 ).returncode == 0
    r = train("--steps", "4", "--checkpoint-dir", ck, "--resume", "--metrics-out", str(part))
    assert r.returncode == 0, r.stderr
    assert f"training on the checkpoint's data file {words}" in r.stdout
    assert [row["loss"] for row in _rows(part)] == [row["loss"] for row in _rows(whole)]
    assert all(row["plan_made_for"] == load_plan(plan).made_for for row in _rows(part))  # what calibrate checks
    r = train("--steps", "5", "--checkpoint-dir", ck, "--resume", "--data", str(SAMPLE_TEXT))
    assert r.returncode == 0 and f"the checkpoint's run trained on {words}" in r.stdout, r.stderr
    words.rename(tmp_path / "moved.txt")  # the newest checkpoint (step 5) trained on the sample: still fine
    assert train("--steps", "6", "--checkpoint-dir", ck, "--resume", "--quiet").returncode == 0
    ck2 = str(tmp_path / "ck2")
    moved = tmp_path / "moved.txt"
    assert train("--steps", "1", "--data", str(moved), "--checkpoint-dir", ck2, "--quiet").returncode == 0
    with moved.open("a") as f:  # the file changes under the checkpoint: its windows move, which the resume says
        f.write(" epsilon" * 5000)
    r = train("--steps", "2", "--checkpoint-dir", ck2, "--resume")
    assert r.returncode == 0 and f"{moved} changed since the checkpoint's run trained on it" in r.stdout, r.stderr
    ck3 = str(tmp_path / "ck3")  # a run on the bundled sample resumed on a file of the user's: said too
    assert train("--steps", "1", "--checkpoint-dir", ck3, "--quiet").returncode == 0
    r = train("--steps", "2", "--checkpoint-dir", ck3, "--resume", "--data", str(moved))
    assert r.returncode == 0 and "the checkpoint's run trained on the bundled sample" in r.stdout, r.stderr
    moved.unlink()
    with pytest.raises(AutoparError, match="which is not there any more; give --data FILE"):
        launch(plan, RunOptions(steps=3, checkpoint_dir=ck2, resume=True, quiet=True))


def test_a_checkpoint_that_lost_its_meta_is_refused_and_never_kept_over_a_good_one(tmp_path):
    """The newest checkpoint folder without meta.json (it is renamed into place with it) is a one-line corrupt
    error, not a silent resume from the one before; and pruning keeps complete checkpoints only, so the good one
    is never removed while a broken one stays."""
    from runtime.checkpoint import publish
    from runtime.checkpoint_folder import latest_checkpoint, newest_is_broken

    root = tmp_path / "ck"
    for step in (12, 16):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "meta.json").write_text("{}")
    (root / "step_00000020").mkdir()  # its meta.json lost
    (root / "step_00000007.partial").mkdir()  # an interrupted save: not a checkpoint, not broken
    err = newest_is_broken(root)
    assert err is not None and "checkpoint" in str(err) and "step_00000020 is corrupt (it has no meta.json)" in str(err)
    assert "go on from the one before it with --resume-from 16 (which sets this one aside), or delete it" in str(err)
    with pytest.raises(AutoparError, match="step_00000020 is corrupt"):
        launch(_plan(tmp_path), RunOptions(steps=30, checkpoint_dir=str(root), resume=True, quiet=True))
    from runtime.checkpoint_folder import abandoned, point_latest

    point_latest(root, 16)  # what that --resume-from does: the broken one is then abandoned (set aside), not newest
    assert newest_is_broken(root) is None and [p.name for p in abandoned(root)] == ["step_00000020"]
    (root / "latest").unlink()
    (root / "step_00000008").mkdir()  # an old folder a removal was cut short in: removed by the next pruning
    (root / "step_00000024.partial").mkdir()
    publish(root, root / "step_00000024.partial", {"step": 24}, keep=2, sums={})
    assert sorted(p.name for p in root.iterdir()) == [".autopar-lock", "latest", "step_00000016", "step_00000020",
                                                      "step_00000024"]  # (the lock of the run refused above)
    # (the interrupted save's step_00000007.partial goes too: a checkpoint's size of disk no run would read)
    assert latest_checkpoint(root).name == "step_00000024" and newest_is_broken(root) is None
    fresh = tmp_path / "fresh"  # a fresh run is refused a folder holding any step folder, broken or not: it could
    (fresh / "step_00000020").mkdir(parents=True)  # never resume past it
    with pytest.raises(AutoparError, match="holds a run's checkpoints .the newest step_00000020."):
        launch(_plan(tmp_path), RunOptions(steps=4, checkpoint_dir=str(fresh), quiet=True))


def test_a_roll_back_loses_no_checkpoint(tmp_path, capsys):
    """Resuming from a checkpoint older than others (``latest`` edited by hand, or ``--resume-from``) sets the newer
    ones aside in a rolled-back folder; a worker that saves over a step of such a folder (run by hand, without the
    launcher) sets the old one aside too, and prunes only its own run's checkpoints."""
    from runtime.checkpoint import publish
    from runtime.checkpoint_folder import latest_checkpoint, point_latest, resume_step, roll_back

    def folder(root: Path, step: int, mark: str = "") -> None:
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "meta.json").write_text(mark or "{}")

    root = tmp_path / "ck"
    plan = _plan(tmp_path)
    loaded = load_plan(plan)
    for step in (4, 8, 12):
        folder(root, step, json.dumps({"format": FORMAT, "step": step, "checksums": {},
                                       "plan": fingerprint(loaded, loaded.state)}))
    (root / "latest").write_text("step_00000004\n")  # pointed back by hand
    assert launch(plan, RunOptions(steps=30, checkpoint_dir=str(root), resume=True, dry_run=True)) == 0
    assert "a dry run moves nothing; the run would move step_00000008, step_00000012 (newer than step_00000004" in \
        capsys.readouterr().out
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000004", "step_00000008", "step_00000012"]
    said = roll_back(root)
    aside = next(root.glob("rolled-back-*"))
    assert said.startswith(f"resuming from step_00000004: the newer checkpoints step_00000008, step_00000012 moved "
                           f"to {aside}")
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000008", "step_00000012"]
    assert roll_back(root) is None and latest_checkpoint(root).name == "step_00000004"
    assert said.endswith(f"or move step_00000012 back into {root} and resume with --resume-from 12 to go on from it)")
    os.replace(aside / "step_00000012", root / "step_00000012")  # the advice followed: step 12 is resumed again
    point_latest(root, 12)
    assert roll_back(root) is None and latest_checkpoint(root).name == "step_00000012"
    os.replace(root / "step_00000012", aside / "step_00000012")
    point_latest(root, 4)

    hand = tmp_path / "hand"  # the workers run by hand from a pointed-back latest: the launcher set nothing aside
    for step in (4, 8, 12):
        folder(hand, step, f'{{"old": {step}}}')
    (hand / "latest").write_text("step_00000004\n")
    (hand / "step_00000008.partial").mkdir()
    publish(hand, hand / "step_00000008.partial", {"step": 8}, keep=1, sums={})
    kept = next(hand.glob("rolled-back-*"))
    assert (kept / "step_00000008" / "meta.json").read_text() == '{"old": 8}'  # not overwritten
    assert json.loads((hand / "step_00000008" / "meta.json").read_text())["step"] == 8
    assert (hand / "step_00000012").is_dir() and not (hand / "step_00000004").exists()  # its own older one pruned

    assert [resume_step(t, root) for t in ("10", "step_00000010", str(root / "step_00000010"))] == [10, 10, 10]
    for bad in ("ten", "-3", ""):
        with pytest.raises(AutoparError, match="--resume-from takes a checkpoint's step"):
            resume_step(bad, root)
    with pytest.raises(AutoparError, match=r"--resume-from .*hand/step_00000008 is not in --checkpoint-dir .*ck; give "
                                           r"one of that folder's checkpoints, or --checkpoint-dir .*hand"):
        resume_step(str(hand / "step_00000008"), root)  # (another run's checkpoint, not this folder's of that step)
    with pytest.raises(AutoparError, match=r"step_00000006 does not exist; --resume-from takes one of the complete "
                                           r"checkpoints in .*ck \(those in it: step_00000004\)"):
        point_latest(root, 6)
    other = tmp_path / "other.json"  # a refused --resume-from (another run's plan) changes nothing in the folder
    save_plan(make_plan(load_model("tiny"), load_cluster("cpu-gloo"), 32, ParallelConfig(tp=2, pp=2)), other)
    folder(root, 16, json.dumps({"format": FORMAT, "step": 16, "checksums": {}, "plan": fingerprint(loaded, loaded.state)}))
    (root / "latest").write_text("step_00000016\n")
    before = sorted(p.name for p in root.iterdir())
    assert main(["run", str(other), "--checkpoint-dir", str(root), "--resume-from", "4", "--steps", "30"]) == 2
    assert "is of another run (global_batch: checkpoint has 16, this run 32)" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir() if p.name != ".autopar-lock") == before
    assert (root / "latest").read_text() == "step_00000016\n"
    # nor does one whose checkpoint is damaged: it is checked before the newer ones are set aside, and the error
    # names where else to go on from
    meta4 = json.loads((root / "step_00000004" / "meta.json").read_text())
    (root / "step_00000004" / "__0_0.distcp").write_bytes(b"torn")
    (root / "step_00000004" / "meta.json").write_text(json.dumps({**meta4, "checksums": {"__0_0.distcp": "0"}}))
    assert main(["run", plan, "--checkpoint-dir", str(root), "--resume-from", "4", "--steps", "30"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {root}/step_00000004 is corrupt (__0_0.distcp does not match the checksum it was saved with); " \
           "go on from the newest, step_00000016, with --resume-from 16, or delete it" in err
    assert sorted(p.name for p in root.iterdir() if p.name != ".autopar-lock") == before
    assert (root / "latest").read_text() == "step_00000016\n"
    from runtime.checkpoint import read_meta

    for edit, why in (({"checksums": "0"}, "unreadable meta.json"),  # hand-edited: checksums not a mapping, another
                      ({"step": 5}, "its meta.json says step 5, its folder step 4")):  # step than its folder's
        (root / "step_00000004" / "meta.json").write_text(json.dumps({**meta4, **edit}))
        with pytest.raises(AutoparError, match=f"step_00000004 is corrupt \\({why}\\); go on from the newest"):
            read_meta(root / "step_00000004")
    fresh = tmp_path / "fresh"  # a refused fresh run leaves no folder behind (nor its lock file)
    assert main(["run", str(other), "--checkpoint-dir", str(fresh), "--steps", "0"]) == 2
    assert not fresh.exists()
    for argv, want in ((["--resume-from", "4"], "--resume-from needs --checkpoint-dir"),
                       (["--resume-from", "4", "--checkpoint-dir", str(root), "--dry-run"], "a dry run changes nothing")):
        assert main(["run", plan, *argv]) == 2
        assert want in capsys.readouterr().err
    assert main(["run", plan, "--checkpoint-dir", str(root), "--resume-from", "99", "--dry-run"]) == 2
    assert "step_00000099 does not exist; --resume-from takes one of the complete checkpoints" in \
        capsys.readouterr().err
    # from the newest, a dry run is --resume's: nothing to point back or move
    assert main(["run", plan, "--checkpoint-dir", str(root), "--resume-from", "16", "--steps", "30", "--dry-run"]) == 0
    assert "--resume" in capsys.readouterr().out and (root / "latest").read_text() == "step_00000016\n"


def test_a_checkpoint_folder_s_odd_contents_are_said_before_training(tmp_path, capsys, monkeypatch):
    """What a checkpoint folder holds besides checkpoints: a crash between a checkpoint's rename and ``latest`` never
    makes the next resume set the newest aside; a roll-back's advice names a complete checkpoint, and a corrupt one's
    names those a roll-back set aside; a ``latest`` that is a folder is refused before training (it failed at the
    first save); a lock file that cannot be opened, and old checkpoints that cannot be pruned, are said."""
    import runtime.checkpoint as ckpt
    from runtime.checkpoint import publish
    from runtime.checkpoint_folder import abandoned, in_use, instead_of, latest_checkpoint, roll_back

    def complete(root: Path, step: int) -> None:
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "meta.json").write_text(json.dumps({"step": step}))

    root = tmp_path / "crash"
    complete(root, 4)
    (root / "latest").write_text("step_00000004\n")
    (root / "step_00000008.partial").mkdir()
    real, calls = os.replace, []

    def dies_between(a: Path, b: Path) -> None:  # the rename and ``latest``: the process dies after the first
        calls.append(b)
        if len(calls) == 2:
            raise OSError("killed")
        real(a, b)

    monkeypatch.setattr(ckpt.os, "replace", dies_between)
    with pytest.raises(OSError, match="killed"):
        publish(root, root / "step_00000008.partial", {"step": 8}, sums={})
    monkeypatch.undo()
    assert latest_checkpoint(root).name == "step_00000004" and abandoned(root) == []  # nothing newer to set aside
    complete(root, 12)  # workers run by hand from a pointed-back latest, an abandoned run's step 12 still there:
    assert latest_checkpoint(root).name == "step_00000004"  # at or below the step latest names, not the abandoned one

    root = tmp_path / "ck"
    for step in (4, 12):
        complete(root, step)
    (root / "step_00000016").mkdir()  # no meta.json: no checkpoint to go back to
    (root / "latest").write_text("step_00000004\n")
    said = roll_back(root)
    assert "step_00000012, step_00000016 moved to" in said
    assert said.endswith(f"or move step_00000012 back into {root} and resume with --resume-from 12 to go on from it)")
    aside = next(root.glob("rolled-back-*"))
    assert instead_of(root / "step_00000004") == (
        f"delete it to start afresh; a roll-back set newer checkpoints aside: to go on from the newest, move "
        f"{aside / 'step_00000012'} back into {root} and resume with --resume-from 12")
    (root / "step_00000016").mkdir()
    said = roll_back(root)  # an incomplete folder alone: set aside, with no advice to go back to it
    assert "the newer checkpoint step_00000016 moved to" in said and "or move" not in said

    plan = _plan(tmp_path)
    (root / "latest").unlink()
    (root / "latest").mkdir()
    for resume in (["--resume"], ["--resume-from", "4"]):  # (--resume-from points latest back: it was an internal error)
        assert main(["run", plan, "--checkpoint-dir", str(root), *resume, "--steps", "30"]) == 2
        assert f"checkpoint folder {root}: latest is a folder; it must be the file naming the newest checkpoint" in \
            capsys.readouterr().err

    locked = tmp_path / "locked"
    (locked / ".autopar-lock").mkdir(parents=True)
    with in_use(locked):
        pass
    said = capsys.readouterr().err
    assert f"cannot open {locked}/.autopar-lock" in said and "remove what is there by that name" in said
    full = tmp_path / "full"
    full.mkdir()

    def no_space(path, *a, **k):
        raise OSError(28, os.strerror(28), str(path))

    monkeypatch.setattr(builtins, "open", no_space)
    with in_use(full):  # a folder it may write where the lock file cannot be made (a full disk): the error alone
        pass
    monkeypatch.undo()
    said = capsys.readouterr().err
    assert f"cannot open {full}/.autopar-lock ({os.strerror(28)})" in said and "remove" not in said

    pruned = tmp_path / "pruned"
    for step in (4, 8):
        complete(pruned, step)
    (pruned / "step_00000012.partial").mkdir()
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda *a, **k: None)  # a folder this user cannot remove
    publish(pruned, pruned / "step_00000012.partial", {"step": 12}, keep=2, sums={})
    assert f"could not remove the old checkpoint step_00000004 from {pruned}" in capsys.readouterr().err
    (pruned / "step_00000016.partial").mkdir()
    publish(pruned, pruned / "step_00000016.partial", {"step": 16}, keep=2, sums={})
    said = capsys.readouterr().err  # each stuck folder is said once, when its removal first fails
    assert f"could not remove the old checkpoint step_00000008 from {pruned}" in said and "00000004" not in said


def test_resume_from_a_folder_it_cannot_write_is_one_line_and_changes_nothing(tmp_path, capsys, monkeypatch):
    """--resume-from points ``latest`` back before the run's checks: on a read-only folder that is the checks' one
    line (exit 2), not an internal error, and ``latest`` stays."""
    import errno
    import os

    import specs.files

    root = tmp_path / "ck"
    plan = _plan(tmp_path)
    loaded = load_plan(plan)
    for step in (4, 8):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "meta.json").write_text(json.dumps(
            {"format": FORMAT, "step": step, "checksums": {}, "plan": fingerprint(loaded, loaded.state)}))
    (root / "latest").write_text("step_00000008\n")
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, *a, **k: False if Path(path) == root and mode & os.W_OK
                        else real(path, mode, *a, **k))
    monkeypatch.setattr(specs.files, "_read_only", lambda path: True)
    writes = Path.write_bytes

    def refused(self: Path, data: bytes) -> int:  # what the file system answers a write in it
        if self.parent == root:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return writes(self, data)

    monkeypatch.setattr(Path, "write_bytes", refused)
    assert main(["run", plan, "--checkpoint-dir", str(root), "--resume-from", "4", "--steps", "10"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write checkpoint directory {root}: it is on a read-only file system" in err
    assert (root / "latest").read_text() == "step_00000008\n"


def test_a_dry_run_checks_the_checkpoint_for_the_machines_that_will_run_it(tmp_path, capsys, monkeypatch):
    """A dry run resuming a GPU plan's checkpoint (bf16 state) from a machine without GPUs passes (the command is
    for the GPU nodes); the real launch here would train in fp32 on CPUs, another run, and is refused."""
    import runtime.launch

    monkeypatch.setattr(runtime.launch, "local_gpus", lambda: None)  # (this test's machine has none)
    plan = _plan(tmp_path, cluster="dgx-a100", gpus=4)
    loaded = load_plan(plan)
    ck = tmp_path / "ck" / "step_00000003"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text(json.dumps({"format": FORMAT, "step": 3, "checksums": {},
                                              "plan": fingerprint(loaded, loaded.state)}))
    assert launch(plan, RunOptions(steps=8, checkpoint_dir=str(ck.parent), resume=True, dry_run=True)) == 0
    assert "--resume" in capsys.readouterr().out
    with pytest.raises(AutoparError, match="is of another run .state"):
        launch(plan, RunOptions(steps=8, checkpoint_dir=str(ck.parent), resume=True))


def test_a_metrics_file_is_overwritten_only_when_it_records_no_step(tmp_path):
    """A run from scratch refuses a metrics file with an earlier run's steps; a resumed run and a restart append
    to it, and a file of no step lines (an event, an empty file) is written anew."""
    from runtime.options import check_run_options

    plan = load_plan(_plan(tmp_path))
    m = tmp_path / "m.jsonl"
    m.write_text('{"event": "restart", "attempt": 1}\n')
    assert check_run_options(plan, RunOptions(steps=4, metrics_out=str(m))) == 4
    m.write_text('{"step": 3, "loss": 4.0}\n')
    with pytest.raises(AutoparError, match=r"to step 3\); a run from scratch would overwrite them: give another "
                                           "--metrics-out or delete it$"):  # no checkpoint there to resume from
        check_run_options(plan, RunOptions(steps=4, checkpoint_dir=str(tmp_path / "ck"), metrics_out=str(m)))
    (tmp_path / "ck" / "step_00000003").mkdir(parents=True)
    (tmp_path / "ck" / "step_00000003" / "meta.json").write_text("{}")
    with pytest.raises(AutoparError, match="to step 3.*--resume continues that run"):
        check_run_options(plan, RunOptions(steps=4, checkpoint_dir=str(tmp_path / "ck"), metrics_out=str(m)))
    assert check_run_options(plan, RunOptions(steps=4, checkpoint_dir=str(tmp_path / "ck"), metrics_out=str(m), resume=True)) == 4
    assert check_run_options(plan, RunOptions(steps=4, checkpoint_dir=str(tmp_path / "ck"), metrics_out=str(m)), attempt=1) == 4


def test_checkpoints_written_before_the_data_file_was_recorded_resolved(tmp_path):
    """Older checkpoints named the bundled sample by an install's absolute path (any install's sample is the
    sample) and a --data file as given (a relative path from where that run started: said so when not found)."""
    from runtime.checkpoint import resumed_data

    root = tmp_path / "ck"
    (root / "step_00000003").mkdir(parents=True)
    meta = root / "step_00000003" / "meta.json"
    for saved, want in [("/elsewhere/site-packages/runtime/data/sample.txt", (None, None)), (None, (None, None))]:
        meta.write_text(json.dumps({"format": FORMAT, "step": 3, "plan": {}, "data": saved}))
        assert resumed_data(root, None) == want
    meta.write_text(json.dumps({"format": FORMAT, "step": 3, "plan": {}, "data": "d/up.txt"}))
    with pytest.raises(AutoparError, match="a path relative to where that run started, not found from here"):
        resumed_data(root, None)


def test_the_workers_command_line_reads_back_as_given():
    """The launcher writes each worker's arguments from the options both parse into (the flags declared once, by
    :class:`RunOptions`): every value it passes reads back as itself, the launcher's own options stay with the
    launcher, and options at their defaults are left to the worker's defaults."""
    import argparse
    from dataclasses import asdict, fields

    from runtime.options import add_run_arguments, worker_parser

    values = dict(steps=7, data="d.txt", metrics_out="m.jsonl", checkpoint_dir="ck", checkpoint_every=3,
                  keep_checkpoints=4, resume=True, train_from_plan=True, mtbf_hours=12.5, collective_timeout=60.0,
                  quiet=True)
    given = RunOptions(**values, max_restarts=2, dry_run=True)
    back = vars(worker_parser().parse_args(worker_argv("p.json", given, 0.25, 1.5)))
    assert back == {"plan": "p.json", **values, "predicted_step_time": 0.25, "predicted_memory": 1.5}
    assert RunOptions.from_args(worker_parser().parse_args(worker_argv("p.json", given))) == RunOptions(**values)
    assert worker_argv("p.json", RunOptions(checkpoint_every=0)) == ["p.json", "--checkpoint-every", "0"]
    assert worker_argv("p.json", RunOptions()) == ["p.json"]
    ap = argparse.ArgumentParser()  # `autopar run`'s parser gives every option, the launcher's too
    add_run_arguments(ap)
    argv = ["p.json", *given.flags(*(f.name for f in fields(RunOptions)))]
    assert asdict(RunOptions.from_args(ap.parse_args(argv))) == asdict(given)


def test_a_trial_stopped_by_ctrl_c_says_where_not_how_to_resume(tmp_path):
    """`autopar run` says how to resume after Ctrl-C; a tune trial (which cannot be resumed) only where it stopped."""
    from runtime.launch import interrupted

    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 3, "step_time_s": 0.1}\n')
    assert interrupted("p.json", 8, str(metrics), None, resumable=False) == "interrupted after step 3 of 8"
    assert "give --checkpoint-dir" in interrupted("p.json", 8, str(metrics), None)
    ck = tmp_path / "ck" / "step_00000008"  # stopped after its last step's checkpoint: no resume to suggest
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text("{}")
    assert interrupted("p.json", 8, str(metrics), str(ck.parent)).endswith(
        f"the run's last checkpoint, {ck}, is at its last step: nothing is left to train")
    assert "resume with" in interrupted("p.json", 9, str(metrics), str(ck.parent))


def test_a_resume_keeps_the_checkpointing_its_run_was_given():
    """--keep-checkpoints and --checkpoint-every given to the run that wrote the checkpoint hold for a resume that
    does not give them (a plain --resume would otherwise prune what that run kept), and a resume's own win."""
    import tempfile

    from runtime.checkpoint import resumed_options

    with tempfile.TemporaryDirectory() as d:
        ck = Path(d) / "step_00000004"
        ck.mkdir()
        meta = {"format": FORMAT, "step": 4, "plan": {}, "checksums": {}, "data": None,
                "options": {"checkpoint_every": 1, "keep_checkpoints": 4}}
        (ck / "meta.json").write_text(json.dumps(meta))
        none = {"checkpoint_every": None, "keep_checkpoints": None}
        assert resumed_options(Path(d), none) == (
            {"checkpoint_every": 1, "keep_checkpoints": 4},
            "keeping the checkpoint's run's --checkpoint-every 1 and --keep-checkpoints 4 (give them to change)")
        assert resumed_options(Path(d), {**none, "keep_checkpoints": 2}) == (
            {"checkpoint_every": 1, "keep_checkpoints": 2},
            "keeping the checkpoint's run's --checkpoint-every 1 (give them to change)")
        meta["options"] = {"checkpoint_every": "x", "keep_checkpoints": 0}  # not options: as if none were given
        (ck / "meta.json").write_text(json.dumps(meta))
        assert resumed_options(Path(d), none) == (none, None)


def test_a_checkpoint_folder_is_one_run_s_and_its_latest_names_one_of_its_own(tmp_path):
    """A second run into a folder a run holds is refused before any worker starts; ``latest`` naming a folder
    elsewhere, or holding bytes that are not text, is not followed (the newest complete checkpoint is)."""
    import fcntl

    from runtime.checkpoint_folder import in_use, latest_checkpoint

    root = tmp_path / "ck"
    root.mkdir()
    with open(root / ".autopar-lock", "w") as other:  # another process's run holds it (its own lock, its pid)
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        other.write("4242\n")
        other.flush()
        with pytest.raises(AutoparError, match=r"checkpoint folder .*ck is in use by another run \(process 4242\); "
                                               "wait for it to end"):
            launch(_plan(tmp_path), RunOptions(steps=2, checkpoint_dir=str(root)))
    with in_use(root), in_use(root):  # released when the run ends; a run holding it may enter again
        assert (root / ".autopar-lock").read_text() == f"{os.getpid()}\n"
    for step in (2, 4):
        (root / f"step_{step:08d}").mkdir()
        (root / f"step_{step:08d}" / "meta.json").write_text("{}")
    other = tmp_path / "other" / "step_00000009"
    other.mkdir(parents=True)
    (other / "meta.json").write_text("{}")
    for text in (b"../other/step_00000009\n", b"\xff\xfe", str(other).encode()):
        (root / "latest").write_bytes(text)
        assert latest_checkpoint(root) == root / "step_00000004"
    (root / "latest").write_text("step_00000002\n")  # pointed back: followed
    assert latest_checkpoint(root) == root / "step_00000002"


def test_workers_started_by_hand_hold_the_folder_too(tmp_path, monkeypatch, capfd):
    """A worker started by hand with torchrun (or on a node of a multi-node plan) takes the folder's lock as rank
    0, so a second run into a folder another run holds is refused before it joins a process group; workers of an
    `autopar run` (which holds it and says so in their environment) and ranks other than 0 leave it to their
    launcher."""
    import contextlib
    import fcntl

    from runtime import train
    from runtime.checkpoint_folder import HELD_ENV, held_by_rank

    root = tmp_path / "ck"
    root.mkdir()
    plan = _plan(tmp_path, tp=1, pp=1, gpus=1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(HELD_ENV, raising=False)
    with open(root / ".autopar-lock", "w") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        other.write("4242\n")
        other.flush()
        assert train.main([plan, "--steps", "1", "--checkpoint-dir", str(root)]) == 2
        assert "is in use by another run (process 4242)" in capfd.readouterr().err and not list(root.glob("step_*"))
        monkeypatch.setenv(HELD_ENV, str(root.resolve()))
        assert isinstance(held_by_rank(root, 0), contextlib.nullcontext)
    monkeypatch.delenv(HELD_ENV)
    assert isinstance(held_by_rank(root, 1), contextlib.nullcontext)
    assert isinstance(held_by_rank(None, 0), contextlib.nullcontext)
    assert not isinstance(held_by_rank(root, 0), contextlib.nullcontext)


def test_a_metrics_file_is_told_from_other_files():
    """--metrics-out may overwrite (or append to) a metrics file, whose last line may be cut off mid-write, and no
    other kind of file."""
    from runtime.metrics import is_metrics_data
    from specs.files import text_content

    ok = '{"step": 1, "step_time_s": 0.2}\n{"event": "restart", "attempt": 1}\n{"step": 2, "ste'
    assert is_metrics_data(text_content(ok)) and is_metrics_data(text_content('{"step": 1}\n'))
    for other in ("name: c\ngpus_per_node: 2\n", '{"schema": "autopar.plan/1"}', "a,b\n1,2\n",
                  '{"step": 1}\nnot json\n{"step": 2}\n'):
        assert not is_metrics_data(text_content(other)), other


def test_a_project_folder_with_its_own_runtime_package_does_not_shadow_autopars(tmp_path, monkeypatch):
    """The workers start as `-m runtime.train`, which would put the current folder first on their path: a project
    there with its own `runtime`, `specs` or `planner` package broke every run ("No module named runtime.train")."""
    for pkg in ("runtime", "specs", "planner"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    plan = tmp_path / "p.json"
    save_plan(make_plan(load_model("tiny"), load_cluster("cpu-gloo", gpus=1), 2, ParallelConfig()), plan)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    m = tmp_path / "m.jsonl"
    assert launch(str(plan), RunOptions(steps=1, quiet=True, metrics_out=str(m))) == 0
    assert [r["step"] for r in _rows(m)] == [1]


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--keep-checkpoints", "0"], ["--collective-timeout", "0"],
                                  ["--mtbf-hours", "-1"], ["--max-restarts", "-1"]])
def test_an_option_no_run_takes_is_refused_before_the_default_plan(tmp_path, capsys, monkeypatch, argv):
    """`autopar run` with no plan file plans the default first: a value no run takes is said before that (no plan
    table printed, no default plan written)."""
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "cache"))
    assert main(["run", *argv]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and argv[0] in out.err
    assert not (tmp_path / "cache" / "default-plan.json").exists()


def test_another_runs_checkpoint_is_named_by_the_field_that_differs():
    """The refusal of another run's checkpoint names the innermost field that differs (a MoE model's
    ``model.moe.experts_per_token``, not both whole ``moe`` sections), a field only one side has too."""
    from runtime.checkpoint import _first_difference

    saved = {"model": {"name": "m", "moe": {"num_experts": 8, "experts_per_token": 2}}, "seq": 64}
    ours = {"model": {"name": "m", "moe": {"num_experts": 8, "experts_per_token": 1}}, "seq": 64}
    assert _first_difference(saved, ours) == "model.moe.experts_per_token: checkpoint has 2, this run 1"
    assert _first_difference({"seq": 64}, {"seq": 64, "cp": 2}) == "cp: checkpoint has none, this run 2"
    assert _first_difference({"model": {"moe": None}}, ours) == \
        "model.moe: checkpoint has none, this run a section of 2 fields"  # (a dense model's checkpoint, a MoE run)


def test_a_damaged_checkpoint_says_which_complete_ones_to_go_on_from(tmp_path):
    """The advice for a damaged checkpoint names what is there: the one before it (after a plain resume from the
    newest), or the newest (pointed back at it: newer ones are there), and the one before it too where there is one,
    with what each sets aside; an export names the one before it."""
    from runtime.checkpoint_folder import instead_of

    root = tmp_path / "ck"
    for step in (2, 4, 6, 8):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "meta.json").write_text("{}")
    assert instead_of(root / "step_00000008") == \
        "go on from the one before it with --resume-from 6 (which sets this one aside), or delete it"
    assert instead_of(root / "step_00000004") == (
        "go on from the newest, step_00000008, with --resume-from 8, or from the one before it with --resume-from 2 "
        "(which sets the newer ones aside), or delete it")
    assert instead_of(root / "step_00000002") == "go on from the newest, step_00000008, with --resume-from 8, or " \
        "delete it"
    assert instead_of(root / "step_00000004", exporting=True) == f"export the one before it instead ({root}/step_00000002)"
    assert instead_of(root / "step_00000002", exporting=True) == "no earlier checkpoint is there to use instead"
