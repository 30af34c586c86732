"""Single-process pieces: the token data, shard specs, the LR schedule, the metrics lines."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from runtime.data import TokenData, open_tokens
from runtime.metrics import MetricsLog
from runtime.parallel.optimizer import lr_at
from runtime.parallel.tensor_parallel import ShardSpec
from specs.cluster import load_cluster
from specs.errors import AutoparError
from specs.model_loading import load_model
from specs.parallel import ParallelConfig
from specs.planfile import TrainConfig, make_plan


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "t.u16"
    np.random.default_rng(0).integers(0, 100, 5000).astype(np.uint16).tofile(path)
    return path


def test_global_batch_is_the_same_whatever_the_split(token_file):
    data = TokenData(token_file, seq=16, vocab_size=100, seed=3)
    for step in (0, 7):
        inp, tgt = data.batch(step, 8)
        assert inp.shape == (8, 16) and torch.equal(inp[:, 1:], tgt[:, :-1])
        for dp in (2, 4, 8):
            parts = [data.batch(step, 8, r, dp) for r in range(dp)]
            assert torch.equal(torch.cat([p[0] for p in parts]), inp)
            assert torch.equal(torch.cat([p[1] for p in parts]), tgt)
    assert not torch.equal(data.batch(0, 8)[0], data.batch(1, 8)[0])
    again = TokenData(token_file, seq=16, vocab_size=100, seed=3)
    assert torch.equal(again.batch(7, 8)[0], data.batch(7, 8)[0])
    assert not torch.equal(TokenData(token_file, seq=16, vocab_size=100, seed=4).batch(7, 8)[0], data.batch(7, 8)[0])


def test_each_epoch_visits_every_window_once(token_file):
    data = TokenData(token_file, seq=16, vocab_size=100, seed=3)
    toks = np.fromfile(token_file, dtype=np.uint16)
    n = (len(toks) - 1) // 16
    for epoch in (0, 1):
        rows = data.samples(epoch * n, n)
        starts = sorted(next(w for w in range(n) if np.array_equal(toks[w * 16:w * 16 + 17], r)) for r in rows)
        assert starts == list(range(n))
    assert not np.array_equal(data.samples(0, 5), data.samples(n, 5))  # reshuffled per epoch


def test_token_file_formats(tmp_path):
    tokens = np.arange(1000) % 300
    np.save(tmp_path / "a.npy", tokens.astype(np.uint32))
    tokens.astype(np.uint32).tofile(tmp_path / "a.u32")
    tokens.astype(np.uint16).tofile(tmp_path / "a.bin")
    for name in ("a.npy", "a.u32", "a.bin"):
        np.testing.assert_array_equal(open_tokens(tmp_path / name), tokens)
    (tmp_path / "a.txt").write_text("héllo")
    np.testing.assert_array_equal(open_tokens(tmp_path / "a.txt"), list("héllo".encode()))
    np.save(tmp_path / "f.npy", np.zeros(10, dtype=np.float32))
    bad = [("f.npy", "expected a 1-D array"), ("a.csv", "unknown format"), ("nope.u16", "does not exist")]
    (tmp_path / "a.csv").write_text("1,2")
    for name, msg in bad:
        with pytest.raises(AutoparError, match=msg):
            open_tokens(tmp_path / name)
    with pytest.raises(AutoparError, match="fewer than one sequence"):
        TokenData(tmp_path / "a.u32", seq=2000, vocab_size=300, seed=0)
    with pytest.raises(AutoparError, match="token id 299"):
        TokenData(tmp_path / "a.u32", seq=16, vocab_size=256, seed=0)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_shard_spec_round_trip_with_segments_and_padding(tp):
    full = torch.randn(7 + 5 + 5, 3)
    shards = [ShardSpec(0, (7, 5, 5), r, tp).take(full) for r in range(tp)]
    per = sum(-(-s // tp) for s in (7, 5, 5))
    assert all(s.shape == (per, 3) for s in shards)
    assert torch.equal(ShardSpec(0, (7, 5, 5), 0, tp).assemble(shards), full)
    # rank r holds chunk r of each segment: the first rows of its q, k and v parts
    c = -(-7 // tp)
    assert torch.equal(shards[0][:c], full[:c])
    cols = torch.randn(2, 10)
    parts = [ShardSpec(1, (10,), r, tp).take(cols) for r in range(tp)]
    assert torch.equal(ShardSpec(1, (10,), 0, tp).assemble(parts), cols)
    if 10 % tp:
        assert torch.all(parts[-1][:, 10 - (tp - 1) * -(-10 // tp):] == 0)  # zero padding


def test_lr_schedule_warmup_then_cosine():
    tc = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=4)
    assert [lr_at(s, tc, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(9, tc, 14) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert lr_at(14, tc, 14) == pytest.approx(0.1) and lr_at(20, tc, 14) == pytest.approx(0.1)
    assert lr_at(6, tc, 14) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.2)))


def test_metrics_lines(tmp_path, capsys):
    model, cluster = load_model("tiny"), load_cluster("cpu-gloo", gpus=4)
    plan = make_plan(model, cluster, 16, ParallelConfig(tp=2, pp=2), prediction={"step_time_s": 0.5})
    path = tmp_path / "m.jsonl"
    log = MetricsLog(plan, path, total_steps=2, enabled=True)
    row = log.record(1, 3.0, 1.5, 1e-3, 2.0, 0.25)
    log.close()
    tokens = 16 * 128
    assert row["tokens_per_s"] == tokens / 2.0 and row["predicted_step_time_s"] == 0.5
    assert row["mfu"] == pytest.approx(model.model_flops_per_token(128) * tokens / (2.0 * 4 * 0.05e12))
    assert json.loads(path.read_text()) == row
    assert "step 1/2" in capsys.readouterr().out
    MetricsLog(plan, path, 2, enabled=True, quiet=True, append=True).record(2, 2.5, 1.0, 1e-3, 1.0, 0.25)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    assert capsys.readouterr().out == ""
