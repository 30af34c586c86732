"""ZeRO-2 and ZeRO-3 execute what one process computes, the same overlapped or not, and keep the state the cost
model prices; their checkpoints resume exactly.

The cases cover, for each of zero 2 and 3, dp=2 with tp=2 (with and without SP), pp=2 (1F1B and interleaved),
tied embeddings (split over the pipeline's ends, and on one stage), recompute full and selective, GPT and Llama,
dp_overlap on and off; plus a first stage holding only the embedding (a chunk without layers: one bucket), dp=4,
cp=2 (ZeRO shards over dp x cp), and bf16 parameters with fp32 gradients and master weights.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_equivalence import ZERO_CASES, _id
from test_priced_equals_executed import check_plan_run


@pytest.mark.parametrize("case", ZERO_CASES + [
    dict(zero=3, tp=2, pp=2, dp=2, sp=True, sched="interleaved", arch="gpt", tied=True, state="bf16", steps=1),
], ids=[_id(c) for c in ZERO_CASES] + ["bf16-zero3"])
def test_zero_state_is_priced(pool, tokens64, case):
    """One bucket per layer, as ``cost_models.stages.zero_traffic`` counts them; ZeRO-2 keeps 1/d of the gradients,
    ZeRO-3 also 1/d of the parameters (nothing gathered between steps): the cost model's bytes."""
    reports = check_plan_run(pool, tokens64, case)
    assert all(r["zero"] == case["zero"] for r in reports)


@pytest.mark.parametrize("case", [
    dict(zero=2, tp=2, pp=2, dp=2, sp=True, sched="interleaved", arch="gpt", tied=True),
    dict(zero=3, tp=1, pp=2, dp=2, sched="interleaved", recompute="full", arch="llama", tied=True, state="bf16"),
], ids=["zero2-tp2-sp-vpp2-tied", "zero3-pp2-vpp2-full-tied-bf16"])
def test_overlapped_zero_is_identical_to_not_overlapped(pool, tokens64, case):
    on = pool.run("rt_cases:zero_overlap_run", {**case, "dp_overlap": True}, tokens64)
    off = pool.run("rt_cases:zero_overlap_run", {**case, "dp_overlap": False}, tokens64)
    for a, b in zip(on, off):
        if a is None:
            continue
        assert a["losses"] == b["losses"]
        for x, y in zip(a["buffers"], b["buffers"], strict=True):
            np.testing.assert_array_equal(x, y)
        assert a["early"] == b["early"] == a["buckets"]  # every bucket reduce-scattered during backward


@pytest.mark.parametrize("case", [
    dict(zero=2, tp=2, pp=2, dp=2, sp=True, sched="interleaved", arch="gpt", tied=True, dropout=0.1, steps=6),
    dict(zero=3, tp=2, pp=1, dp=2, arch="llama", recompute="full", steps=6, dp_overlap=True),
    dict(zero=3, tp=1, pp=2, dp=2, arch="gpt", tied=True, state="bf16", steps=6),
], ids=["zero2-tp2-pp2-vpp2-dropout", "zero3-tp2-dp2-full", "zero3-pp2-tied-bf16"])
def test_zero_resume_continues_exactly(pool, tokens64, tmp_path, case):
    whole = pool.run("rt_cases:train_with_checkpoints", case, tokens64, str(tmp_path / "a"), [], False)[0]
    first = pool.run("rt_cases:train_with_checkpoints", case, tokens64, str(tmp_path / "b"), [2, 3], False, 4)[0]
    rest = pool.run("rt_cases:train_with_checkpoints", case, tokens64, str(tmp_path / "b"), [], True)[0]
    assert len(whole) == 6 and len(first) == 4 and len(rest) == 3
    assert first[:3] + rest == whole


@pytest.mark.parametrize("overlap", [False, True])
def test_zero3_reduces_every_microbatch_and_gathers_two_layers_at_most(pool, tokens64, overlap):
    """Every bucket is reduce-scattered once per micro-batch; at most two buckets' parameters are gathered at once
    (the running layer and, with overlap, the prefetched one; the first and last bucket hold the embedding and the
    head); nothing is kept gathered after the step."""
    case = dict(zero=3, tp=1, pp=2, dp=2, sched="interleaved", arch="llama", num_layers=8, dp_overlap=overlap)
    for r in pool.run("rt_cases:zero_traffic_run", case, tokens64):
        if r is None:
            continue
        assert sorted(r["scatters"]) == sorted(list(range(r["buckets"])) * r["m"])
        assert r["buckets"] == 4 and r["units"] == [1, 0, 1, 0]  # 2 layers per chunk, last layer first
        assert r["most_gathered"] == (2 if overlap else 1)
        assert r["held"] == 0
