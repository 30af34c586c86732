"""Data parallelism (overlapped = not overlapped), checkpoints (resume = uninterrupted), bad checkpoints,
and the rank order of the mesh — all inside the shared worker pool."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rt_cases import case_plan

from specs.parallel import ParallelConfig

OVERLAP_CASES = [
    dict(tp=1, pp=2, dp=2, sched="interleaved", zero=0, arch="llama", steps=3),  # two chunks per rank
    dict(tp=2, pp=1, dp=2, sp=True, zero=1, arch="gpt", tied=True, steps=3),
    dict(tp=2, pp=2, dp=2, sched="interleaved", zero=1, arch="gpt", tied=True, steps=3),
    # bf16 parameters, fp32 gradients accumulated by hooks ("main grad"), fp32 master weights
    dict(tp=2, pp=2, dp=2, sp=True, zero=1, arch="llama", tied=True, state="bf16", steps=3),
]


@pytest.mark.parametrize("case", OVERLAP_CASES,
                         ids=["pp2-vpp2-zero0", "tp2-sp-zero1", "tp2-pp2-vpp2-zero1-tied", "bf16-tp2-pp2-sp-zero1-tied"])
def test_overlapped_dp_is_identical_to_not_overlapped(pool, tokens64, case):
    on = pool.run("rt_cases:overlap_run", {**case, "dp_overlap": True}, tokens64)
    off = pool.run("rt_cases:overlap_run", {**case, "dp_overlap": False}, tokens64)
    for a, b in zip(on, off):
        if a is None:
            continue
        assert a["buckets"] > 2  # small buckets: several per chunk
        assert a["losses"] == b["losses"]
        assert a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            np.testing.assert_array_equal(a["params"][name], b["params"][name], err_msg=name)
        # Overlap is real: every bucket but a tied embedding's was reduced during backward, none without it.
        tied = int(case.get("tied", False) and case["pp"] > 1 and name_in_stage(a["params"]))
        assert a["early"] == [a["buckets"] - tied] * 3
        assert b["early"] == [0, 0, 0]


def name_in_stage(params: dict) -> bool:
    return "embed.tok.weight" in params or "head.out.weight" in params


CKPT_CASES = [
    dict(tp=2, pp=2, dp=2, sp=True, sched="interleaved", zero=1, arch="gpt", dropout=0.1, steps=6),
    dict(tp=1, pp=2, dp=2, zero=0, arch="llama", tied=True, steps=6, dp_overlap=True),
    dict(tp=2, pp=1, dp=2, zero=1, arch="llama", state="bf16", steps=6),  # bf16 parameters, fp32 masters
]


@pytest.mark.parametrize("case", CKPT_CASES, ids=["tp2-pp2-dp2-zero1-dropout", "pp2-dp2-tied", "bf16-tp2-dp2-zero1"])
def test_resume_continues_exactly(pool, tokens64, tmp_path, case):
    whole = pool.run("rt_cases:train_with_checkpoints", case, tokens64, str(tmp_path / "a"), [], False)[0]
    first = pool.run("rt_cases:train_with_checkpoints", case, tokens64, str(tmp_path / "b"), [2, 3], False, 4)[0]
    # Step 4 ran but was not saved: resuming starts after step 3 and redoes it.
    rest = pool.run("rt_cases:train_with_checkpoints", case, tokens64, str(tmp_path / "b"), [], True)[0]
    assert len(whole) == 6 and len(first) == 4 and len(rest) == 3
    assert first[:3] + rest == whole
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["latest", "step_00000002", "step_00000003"]


# A checkpoint written at step 4 of a tp=2 pp=2 run resumes under other plans (issue: checkpoints that move).
RESUME_UNDER = {
    "dp4": dict(dp=4, bucket_params=500),  # another gradient bucket size too
    "pp2-vpp2-dp2": dict(pp=2, dp=2, sched="interleaved"),
    "tp2-dp2-zero1": dict(tp=2, dp=2, zero=1),
    "cp2-dp2": dict(cp=2, dp=2),
    "two-ranks-tp2": dict(tp=2),
    "two-ranks-dp2-zero3": dict(dp=2, zero=3),
    # replicas split over two node groups: ZeRO slices owned in the hierarchy's order (runtime/parallel/hierarchy.py)
    "dp4-zero1-split": dict(dp=4, zero=1, placement=("a+b",)),
}
WRITER = dict(tp=2, pp=2, steps=6)


@pytest.mark.parametrize("model", [dict(arch="llama"), dict(arch="gpt", tied=True)], ids=["llama", "gpt-tied"])
def test_a_checkpoint_resumes_under_any_plan(pool, tokens64, tmp_path, model):
    """Train 4 of 6 steps under tp=2 pp=2, save; resume under each plan of RESUME_UNDER: its steps 5-6 lose what
    one uninterrupted single-process run loses (within 1e-5). Parameters, AdamW moments and the step move; the
    tied model's head copy comes back as the embedding."""
    run = lambda case, d, save, resume, stop=None: pool.run(  # noqa: E731
        "rt_cases:train_with_checkpoints", {**model, **case, "steps": 6}, tokens64, str(d), save, resume, stop)[0]
    whole = run({}, tmp_path / "single", [], False)
    first = run(WRITER, tmp_path / "ck", [4], False, 4)
    np.testing.assert_allclose(first, whole[:4], rtol=0, atol=1e-5)
    targets = RESUME_UNDER if model["arch"] == "llama" else {k: RESUME_UNDER[k] for k in ("dp4", "pp2-vpp2-dp2")}
    for name, plan in targets.items():
        rest = run(plan, tmp_path / "ck", [], True)
        assert isinstance(rest, list) and len(rest) == 2, (name, rest)
        np.testing.assert_allclose(rest, whole[4:], rtol=0, atol=1e-5, err_msg=name)


def test_a_moe_checkpoint_resumes_under_another_plan(pool, tokens64, tmp_path):
    """A MoE model (stacked expert weights, router, gated shared expert) saved at step 4 under pp=2 dp=2 ZeRO-1
    resumes under dp=4 and under pp=2 interleaved: steps 5-6 are the uninterrupted single-process run's."""
    model = {"moe": "gated", "tp": 1}
    run = lambda case, d, save, resume, stop=None: pool.run(  # noqa: E731
        "rt_cases:train_with_checkpoints", {**model, **case, "steps": 6}, tokens64, str(d), save, resume, stop)[0]
    whole = run({}, tmp_path / "single", [], False)
    first = run(dict(pp=2, dp=2, zero=1), tmp_path / "ck", [4], False, 4)
    np.testing.assert_allclose(first, whole[:4], rtol=0, atol=1e-5)
    for plan in (dict(dp=4), dict(pp=2, dp=2, sched="interleaved")):
        np.testing.assert_allclose(run(plan, tmp_path / "ck", [], True), whole[4:], rtol=0, atol=1e-5, err_msg=str(plan))


def test_an_expert_parallel_checkpoint_resumes_under_other_expert_layouts(pool, tokens64, tmp_path):
    """Experts sliced over ep=2 (with tp=2 + sp, dp=2, ZeRO-1 over the expert-data-parallel ranks), and over ep=2 x
    etp=2 (each expert's width split too), saved at step 4 resume under ep=4 without tensor parallelism, and with the
    experts whole (ep=1) under a pipeline: steps 5-6 are the uninterrupted single-process run's."""
    model = {"moe": "softmax"}
    run = lambda case, d, save, resume, stop=None: pool.run(  # noqa: E731
        "rt_cases:train_with_checkpoints", {**model, **case, "steps": 6}, tokens64, str(d), save, resume, stop)[0]
    whole = run({}, tmp_path / "single", [], False)
    for writer in (dict(ep=2, tp=2, sp=True, dp=2, zero=1), dict(ep=2, etp=2, tp=2, sp=True, dp=2, zero=1)):
        ck = tmp_path / f"ck-etp{writer.get('etp', 1)}"
        first = run(writer, ck, [4], False, 4)
        np.testing.assert_allclose(first, whole[:4], rtol=0, atol=1e-5)
        for plan in (dict(ep=4, dp=4, zero=1), dict(ep=1, pp=2, dp=2)):
            np.testing.assert_allclose(run(plan, ck, [], True), whole[4:], rtol=0, atol=1e-5, err_msg=str(plan))


def test_a_longer_resumed_run_keeps_the_plans_learning_rates(pool, tokens64, tmp_path):
    """`autopar run --steps 2`, then `--steps 5 --resume`: the learning rate of every step is that of one
    uninterrupted run (the schedule is the plan's 4 steps, then min_lr), not a schedule redrawn over 5."""
    case = dict(tp=1, pp=1, dp=2, zero=1, steps=4)
    def run(ckpt: str, save_at: list[int], resume: bool, steps: int) -> list[float]:  # learning rates
        return pool.run("rt_cases:train_with_checkpoints", case, tokens64, ckpt, save_at, resume, None, steps, True)[0]

    whole = run(str(tmp_path / "a"), [], False, 5)
    first = run(str(tmp_path / "b"), [2], False, 2)
    rest = run(str(tmp_path / "b"), [], True, 5)
    assert first + rest == whole and len(whole) == 5
    train = case_plan(case).train
    assert whole[0] == whole[1] == pytest.approx(train.lr) and whole[1] > whole[2] > whole[3]
    assert whole[4] == pytest.approx(train.min_lr)  # past the plan's 4 steps


def test_bad_checkpoints_are_one_line_errors(pool, tokens64, tmp_path):
    case = dict(tp=2, pp=1, dp=2, zero=1, arch="llama", steps=2)
    run = lambda c, d, resume: pool.run("rt_cases:train_with_checkpoints", c, tokens64, str(d), [1], resume, 1)[0]  # noqa: E731
    msg = run(case, tmp_path / "none", True)
    assert msg.startswith("AutoparError: no checkpoint to resume from")
    assert isinstance(run(case, tmp_path / "ck", False), list)
    msg = run({**case, "arch": "gpt"}, tmp_path / "ck", True)  # another model: refused
    assert msg.startswith("AutoparError:") and "another run" in msg and "model" in msg
    msg = run({**case, "global_batch": 16}, tmp_path / "ck", True)  # the data position would not carry over
    assert msg.startswith("AutoparError:") and "global_batch" in msg and "\n" not in msg
    shard = next((tmp_path / "ck" / "step_00000001").glob("*.distcp"))
    intact = shard.read_bytes()
    flipped = bytearray(intact)
    flipped[len(flipped) // 2] ^= 0xFF  # one byte changed on disk: the same size, still loadable
    shard.write_bytes(bytes(flipped))
    msg = run(case, tmp_path / "ck", True)
    assert msg.startswith("AutoparError:") and f"corrupt ({shard.name} does not match the checksum" in msg
    shard.write_bytes(intact[:100])
    msg = run(case, tmp_path / "ck", True)
    assert msg.startswith("AutoparError:") and "corrupt" in msg and "\n" not in msg
    shard.unlink()  # deleted: said so, not "does not match"
    msg = run(case, tmp_path / "ck", True)
    assert msg.startswith("AutoparError:") and f"corrupt ({shard.name} is missing" in msg
    meta = tmp_path / "ck" / "step_00000001" / "meta.json"
    good = json.loads(meta.read_text())
    for broken in ("{not json", json.dumps({**good, "plan": "x"}), json.dumps({**good, "step": -5}),
                   json.dumps({**good, "step": "1"}), json.dumps({**good, "checksums": []}),
                   json.dumps({**good, "checksums": {"__0_0.distcp": 7}})):
        meta.write_text(broken)
        msg = run(case, tmp_path / "ck", True)
        assert msg.startswith("AutoparError: checkpoint") and "corrupt (unreadable meta.json)" in msg, broken
    meta.write_text(json.dumps({k: v for k, v in good.items() if k != "format"}))  # written before format 2
    msg = run(case, tmp_path / "ck", True)
    assert msg.startswith("AutoparError: checkpoint") and "format 1" in msg and "start without --resume" in msg


def test_mesh_rank_order_puts_tp_innermost(pool):
    cfg = dict(tp=2, pp=2, dp=2)
    res = pool.run("rt_cases:mesh_layout", cfg)
    for rank, r in enumerate(res):
        pp, dp, cp, tp = r["coord"]
        assert rank == ((pp * 2 + dp) * 1 + cp) * 2 + tp
        assert r["tp"] == [rank - tp, rank - tp + 1]  # contiguous
        assert r["dp"] == [pp * 4 + tp, pp * 4 + 2 + tp]
        assert r["pp"] == [dp * 2 + tp, 4 + dp * 2 + tp]
        assert r["mp"] == sorted([dp * 2, dp * 2 + 1, 4 + dp * 2, 4 + dp * 2 + 1])
        assert r["cp"] == [rank] and r["dpcp"] == r["dp"] and r["dpcp_rank"] == dp
        assert ParallelConfig(**cfg).rank_coords(rank) == dict(pp=pp, dp=dp, cp=cp, tp=tp)  # what diagnose reads


def test_mesh_data_parallel_group_spans_dp_and_cp(pool):
    """Data parallelism reduces over dp x cp: the ranks of one (pp, tp) position, dp major, cp minor."""
    res = pool.run("rt_cases:mesh_layout", dict(tp=2, dp=2, cp=2))
    for rank, r in enumerate(res):
        pp, dp, cp, tp = r["coord"]
        assert rank == (dp * 2 + cp) * 2 + tp
        assert r["cp"] == [(dp * 2 + c) * 2 + tp for c in range(2)]
        assert r["dpcp"] == [(d * 2 + c) * 2 + tp for d in range(2) for c in range(2)]
        assert r["dpcp"].index(rank) == r["dpcp_rank"] == dp * 2 + cp
        assert r["mp"] == r["tp"]  # the gradient norm's group: one replica of the dp x cp reduced gradients
        assert ParallelConfig(tp=2, dp=2, cp=2).rank_coords(rank) == dict(pp=pp, dp=dp, cp=cp, tp=tp)


def test_checkpoint_meta_records_the_data_position(pool, tokens64, tmp_path):
    case = dict(tp=1, pp=1, dp=2, steps=2)
    pool.run("rt_cases:train_with_checkpoints", case, tokens64, str(tmp_path), [2], False)
    meta = json.loads((Path(tmp_path) / "step_00000002" / "meta.json").read_text())
    assert meta["step"] == 2 and meta["samples"] == 16 and meta["plan"]["parallel"]["dp"] == 2


@pytest.mark.parametrize("sp", [False, True])
def test_dropout_keeps_tensor_parallel_replicas_identical(pool, tokens64, sp):
    """Dropout on a replicated activation must draw the same mask on every tp rank, or the replicas drift."""
    res = pool.run("rt_cases:overlap_run", dict(tp=2, dp=1, sp=sp, arch="gpt", dropout=0.2, steps=2), tokens64)
    a, b = res[0]["params"], res[1]["params"]
    replicated = [n for n in a if n.endswith(("norm.weight", "norm.bias", "proj.bias", "pos.weight"))]
    assert len(replicated) == 4 * 6 + 2 + 1  # per layer 2 norms x (weight, bias) + 2 row-parallel biases
    for name in replicated:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert res[0]["losses"][1] < res[0]["losses"][0] + 1.0  # trains at all with dropout on


def test_pipeline_sends_are_tensor_parallel_slices(pool, tokens64):
    """Without SP every tp rank sends 1/tp of a boundary activation (or gradient) and the receivers
    all-gather it (Megatron's scatter/gather, as the cost model prices it); the step's loss is what whole
    sends give (the tp=1 plan of the same model), and so is the next step's, which follows from the gradients
    the backward sends carried."""
    case = dict(tp=2, pp=2, dp=1, sp=False, arch="gpt", mbs=2)
    res = [r for r in pool.run("rt_cases:p2p_volume", case, tokens64) if r]
    assert len(res) == 4
    for r in res:
        assert r["sent"] and all(n * r["tp"] == r["act"] for n in r["sent"])
    whole = [r for r in pool.run("rt_cases:p2p_volume", {**case, "tp": 1}, tokens64) if r]
    assert all(n == whole[0]["act"] for r in whole for n in r["sent"])
    assert res[0]["losses"] == pytest.approx(whole[0]["losses"], rel=1e-5)


def test_what_only_plans_a_model_does_not_make_another_run():
    """A checkpoint of a MoE model written when plan files held load_imbalance 1.5 (no load_imbalance_known), and
    one whose plan gives the imbalance later (as `plan` advises), are of the same run as the spec now; the same
    holds for import-hf's check of the moe section. A GPT's max_positions sizes its learned position table: another
    run."""
    from runtime.checkpoint import _normal, _run_of
    from runtime.hf_weights import _shown
    from specs.model_loading import load_model

    spec = load_model("tiny-moe")
    fp = lambda model: {"model": model, "parallel": {}, "global_batch": 8, "seq": 64, "seed": 1,  # noqa: E731
                        "world_size": 2, "state": {}}
    now = _run_of(_normal(fp(spec.model_dump(mode="json"))))
    old = spec.model_dump(mode="json")
    del old["moe"]["load_imbalance_known"]
    assert _run_of(_normal(fp(old))) == now
    given = spec.model_copy(update={"moe": spec.moe.with_imbalance(1.2)})
    assert _run_of(_normal(fp(given.model_dump(mode="json")))) == now
    assert _shown(given.moe) == _shown(spec.moe)
    capped = spec.model_copy(update={"moe": spec.moe.model_copy(update={"capacity_factor": 1.25})})
    assert _run_of(_normal(fp(capped.model_dump(mode="json")))) == now  # priced only: the runtime is dropless
    from runtime.hf_weights import names
    from specs.errors import AutoparError

    mixtral = load_model("mixtral-8x7b")
    names(mixtral.model_copy(update={"moe": mixtral.moe.model_copy(update={"capacity_factor": 1.25})}))  # Mixtral's
    with pytest.raises(AutoparError, match="no QKV biases"):  # Mixtral has none: export would drop them
        names(mixtral.model_copy(update={"qkv_bias": True}))
    other = spec.model_copy(update={"moe": spec.moe.model_copy(update={"experts_per_token": 1})})
    assert _run_of(_normal(fp(other.model_dump(mode="json")))) != now  # what training computes still counts
    gpt = load_model("tiny-gpt")
    bounded = gpt.model_copy(update={"max_positions": 4096})
    assert _run_of(_normal(fp(bounded.model_dump(mode="json")))) != _run_of(_normal(fp(gpt.model_dump(mode="json"))))
