"""Single-process pieces: the token data, shard specs, the LR schedule, the metrics lines, gradient bucket bounds,
the per-parameter records, and the model state the runtime keeps or refuses."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from rt_cases import case_spec

from cost_models.params import gradient_groups
from cost_models.step import estimate
from runtime.data import TokenData, open_tokens
from runtime.metrics import MetricsLog
from runtime.models import build_model
from runtime.parallel.data_parallel import bucket_bounds
from runtime.parallel.expert_parallel import apply_expert_parallel
from runtime.parallel.optimizer import lr_at
from runtime.parallel.parallelize import param_infos, stage_layer_ids
from runtime.parallel.params import DP, DP_EMBED, DP_TP, EDP
from runtime.parallel.tensor_parallel import ShardSpec, apply_tensor_parallel
from runtime.trainer import check_supported, executed_state
from specs.capabilities import state_problem
from specs.cluster_loading import load_cluster
from specs.errors import AutoparError
from specs.model_loading import load_model
from specs.parallel import ParallelConfig
from specs.planfile import TrainConfig, make_plan
from specs.state import StateSpec, bucket_count


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
    np.save(tmp_path / "neg.npy", np.r_[np.full(100, -1), np.full(100, 5)].astype(np.int64))
    with pytest.raises(AutoparError, match="token id -1: token ids are 0 or more"):  # not "id 5 ... vocabulary"
        TokenData(tmp_path / "neg.npy", seq=16, vocab_size=256, seed=0)


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
    # a run killed mid-line (or on a full disk) left step 2's line cut off: going on, the next line is a line of its
    # own, not joined to it into a bad line mid-file (its readers skip a cut line only at the end)
    path.write_text(path.read_text()[:-25])
    MetricsLog(plan, path, 3, enabled=True, quiet=True, append=True).record(3, 2.5, 1.0, 1e-3, 1.0, 0.25)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 3]
    path.write_text('{"step": 1, "lo')  # nothing whole: nothing kept
    MetricsLog(plan, path, 3, enabled=True, quiet=True, append=True).record(2, 2.5, 1.0, 1e-3, 1.0, 0.25)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [2]
    staged = make_plan(model, cluster, 16, ParallelConfig(tp=2, pp=2), prediction={"stage_memory_GiB": [0.5, 0.25]})
    row = MetricsLog(staged, None, 2, enabled=True, quiet=True).record(1, 3.0, 1.5, 1e-3, 2.0, 0.4,
                                                                        rank_memory=([0.4, 0.3, 0.2, 0.1], [0.5] * 4))
    assert row["peak_memory_GiB_per_rank"] == [0.4, 0.3, 0.2, 0.1] and row["peak_reserved_GiB_per_rank"] == [0.5] * 4
    assert row["predicted_memory_GiB_per_rank"] == [0.5, 0.5, 0.25, 0.25]  # ranks 0-1 on stage 0, 2-3 on stage 1
    fast = MetricsLog(plan, None, 3, enabled=True)  # the bundled CPU peak is a rough default: a fast CPU beats it
    fast.record(1, 2.5, 1.0, 1e-3, 1e-4, 0.25)
    fast.record(2, 2.5, 1.0, 1e-3, 1e-4, 0.25)
    out = capsys.readouterr().out
    assert out.count("note: MFU above 100%") == 1 and "`autopar profile` measures it" in out
    if Path("/dev/full").exists():  # a full disk: one line naming the file, not the OS error alone
        full = MetricsLog(plan, "/dev/full", 2, enabled=True, quiet=True)
        with pytest.raises(AutoparError, match="cannot write metrics file /dev/full: No space left"):
            full.record(1, 3.0, 1.5, 1e-3, 2.0, 0.25)


def test_metrics_mfu_on_node_groups_is_the_estimates():
    """On a cluster of A100 and H100 node groups the runtime's MFU divides by the peak of the GPUs each pipeline rank
    sits on, as the estimate does: a step as long as predicted measures the predicted MFU (not one over 96 of the
    slowest GPU's peak)."""
    model, cluster = load_model("llama3-8b"), load_cluster("a100-h100-ib")
    cfg = ParallelConfig(tp=8, pp=6, dp=2, placement=("a100",) * 4 + ("h100",) * 2)
    est = estimate(model, cluster, cfg, 96)
    row = MetricsLog(make_plan(model, cluster, 96, cfg), None, 1, enabled=True, quiet=True).record(
        1, 3.0, 1.0, 1e-3, est.step_time_s, 1.0)
    assert row["mfu"] == pytest.approx(est.mfu, rel=1e-9)
    assert cluster.peak_flops(6, 16, cfg.placement) == 64 * 312e12 + 32 * 989e12
    assert cluster.peak_flops(2, 16, ("a100+h100",) * 2) == 16 * 312e12 + 16 * 989e12
    # a plan on part of a cluster: the peak of the GPUs it runs on (tp=4 on a node of 8 H100s: four)
    h100 = load_cluster("dgx-h100")
    part = make_plan(model, h100, 8, ParallelConfig(tp=4))
    row = MetricsLog(part, None, 1, enabled=True, quiet=True).record(1, 3.0, 1.0, 1e-3, 1.0, 1.0)
    assert row["mfu"] == pytest.approx(model.model_flops_per_token(part.seq) * 8 * part.seq / (4 * 989e12))


@pytest.mark.parametrize("n,size,unit,align", [
    (10, 4, 1, 1), (10, 4, 4, 1), (9280, 3000, 2, 1), (9280, 3000, 8, 1), (5, 1, 2, 1), (1, 100, 8, 1),
    (9280, 3000, 2, 64), (10**6, 40_000, 4, 64), (1000, 100, 2, 64), (1, 100, 8, 64)])
def test_bucket_bounds_cut_a_group_into_equal_buckets(n, size, unit, align):
    """ceil(n / size) buckets, contiguous, of equal size within their granularity: unit x align elements (every
    bucket starts aligned), or unit alone where buckets that coarse would leave some empty (1000 elements in 10
    buckets of 2 x 64); padding only at the end."""
    bounds = bucket_bounds(n, size, unit, align)
    k = math.ceil(n / size)
    assert len(bounds) == k == bucket_count(n, size)  # what cost_models.params.gradient_buckets counts
    assert bounds[0][0] == 0 and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    g = unit * align if math.ceil(n / (unit * align)) >= k else unit
    sizes = [e - a for a, e in bounds]
    assert all(x % g == 0 for x in sizes) and max(sizes) - min(sizes) <= g
    assert 0 <= bounds[-1][1] - n < g  # padding only at the group's end, fewer than g elements
    if math.ceil(n / unit) >= k:
        assert min(sizes) > 0
    if g == 1:
        assert max(sizes) <= size


@pytest.mark.parametrize("arch,tied,tp,sp,pp,vpp,moe,ep", [
    ("llama", True, 2, True, 2, 2, None, 1), ("gpt", True, 4, True, 2, 1, None, 1),
    ("gpt", False, 2, False, 1, 1, None, 1), ("llama", True, 1, False, 1, 1, None, 1),
    ("llama", False, 2, True, 2, 1, "gated", 2), ("llama", True, 1, False, 1, 1, "softmax", 4)])
def test_param_records_group_parameters_as_the_cost_model_counts(arch, tied, tp, sp, pp, vpp, moe, ep):
    spec = case_spec(dict(arch=arch, tied=tied, tp=tp, moe=moe))
    cfg = ParallelConfig(tp=tp, sp=sp, pp=pp, vpp=vpp, dp=ep, ep=ep)
    nv = pp * vpp
    priced = gradient_groups(spec, tp, sp and tp > 1, np.array(cfg.stage_layers(spec.num_layers), dtype=float),
                             ep)
    replicated = ("norm.weight", "norm.bias", "pos.weight", "attn.proj.bias", "mlp.proj.bias", "router.weight",
                  "shared_gate.weight")
    for tp_rank in range(tp):
        for v in range(nv):
            st = build_model(spec, "meta").stage(stage_layer_ids(cfg, spec.num_layers, v), first=v == 0,
                                                 last=v == nv - 1)
            g = SimpleNamespace(tp=tp, tp_rank=tp_rank, tp_group=None, cp=1, ep=ep, ep_rank=ep - 1, ep_group=object(),
                                seq_group=object(), etp=1, etp_rank=0, etp_group=None)
            apply_tensor_parallel(st, g, sp and tp > 1)
            apply_expert_parallel(st, g, False)
            infos = param_infos(st, spec, cfg, tp_rank)
            count = dict.fromkeys((DP, DP_TP, DP_EMBED, EDP), 0)
            for name, p in st.named_parameters():
                info = infos[name]
                count[info.reduce] += p.numel()
                expert = ".experts." in name
                assert (info.reduce == EDP) == expert and info.shard_over == ("ep" if expert else "tp")
                sliced = ep > 1 if expert else tp > 1 and not name.endswith(replicated)
                assert info.name == name and (info.shard is not None) == sliced, name
                head_copy = tied and pp > 1 and name == "head.out.weight"
                assert info.init_key == ("embed.tok.weight" if head_copy else name)
                assert info.in_norm == (not head_copy and (info.shard is not None or tp_rank == 0 or expert))
            assert [count[DP], count[DP_TP], count[DP_EMBED], count[EDP]] == [g[v] for g in priced], (tp_rank, v)


def test_runtime_keeps_the_plans_state_or_refuses_it():
    assert state_problem(StateSpec.default("fp32")) is None and state_problem(StateSpec.default("bf16")) is None
    fp16 = state_problem(StateSpec.default("fp16"))
    assert "fp16" in fp16 and "loss scaling" in fp16 and "\n" not in fp16
    mixed = StateSpec(params="bf16", grads="fp32", grad_reduce="bf16", master_weights=True)
    assert "grad_reduce=fp32" in state_problem(mixed)
    fused = state_problem(StateSpec.default("bf16").model_copy(update={"fused_accumulation": True}))
    assert "fused_accumulation=false" in fused and "\n" not in fused
    full = state_problem(StateSpec.default("bf16").model_copy(update={"full_logits": True}))
    assert "full_logits=false" in full and "\n" not in full
    te = state_problem(StateSpec.default("bf16").model_copy(update={"overlap_pieces": (("proj_fprop", 4),)}))
    assert "overlap_pieces" in te and "\n" not in te
    margin = state_problem(StateSpec.default("bf16").model_copy(update={"sm_margin": (("fc2_fprop", 16),)}))
    assert "sm_margin" in margin and "\n" not in margin
    gather = state_problem(StateSpec.default("bf16").model_copy(update={"param_gather_after_step": True}))
    assert "param_gather_after_step=false" in gather and "\n" not in gather
    model = load_model("tiny")
    gpu = make_plan(model, load_cluster("dgx-h100", gpus=1), 16, ParallelConfig(),
                    state=StateSpec.default("bf16").model_copy(update={"bucket_params": 123}))
    check_supported(gpu)
    assert executed_state(gpu, torch.device("cuda", 0)) == gpu.state
    cpu = executed_state(gpu, torch.device("cpu"))  # a CUDA plan on a machine without CUDA: fp32 on the CPU
    assert (cpu.params, cpu.grads, cpu.master_weights, cpu.bucket_params) == ("fp32", "fp32", False, 123)
    with pytest.raises(AutoparError, match="state.params=fp16"):
        check_supported(gpu.model_copy(update={"state": StateSpec.default("fp16")}))


@pytest.mark.parametrize("tokens,vocab", [(8192, 32000), (16384, 51200), (100, 50), (4096, 16000), (70000, 4000)])
def test_the_fused_loss_chunks_its_logits_as_the_cost_model_prices_them(tokens, vocab):
    from runtime.kernels.cross_entropy_op import _chunk_tokens
    from specs.state import fused_loss_rows

    assert _chunk_tokens(tokens, vocab, None) == fused_loss_rows(tokens, vocab)


def test_a_checkpoint_written_before_new_spec_fields_still_belongs_to_its_run():
    """A checkpoint's plan fingerprint from before a field was added to the model spec or the state (activation,
    linear_bias, rotary_fraction, sm_margin) is the same run as today's plan of that model; writing a default out
    (activation: gelu) or leaving it unset is the same run too, while a real difference (another activation) is
    not."""
    from runtime.checkpoint import _normal, _run_of, fingerprint
    from specs.cluster_loading import load_cluster
    from specs.parallel import ParallelConfig
    from specs.planfile import make_plan
    from specs.state import StateSpec

    model = case_spec({"arch": "gpt"})
    plan = make_plan(model, load_cluster("cpu-gloo", gpus=1), 4, ParallelConfig())
    state = StateSpec.default("fp32")
    today = fingerprint(plan, state)
    old = json.loads(json.dumps(today))
    for key in ("activation", "linear_bias", "rotary_fraction"):
        del old["model"][key]
    del old["state"]["sm_margin"]
    assert _run_of(_normal(old)) == _run_of(_normal(today)) and _normal(old) == _normal(today)
    spelled = fingerprint(plan.model_copy(update={"model": model.model_copy(update={"activation": "gelu"})}), state)
    assert _normal(spelled) == _normal(today)
    other = fingerprint(plan.model_copy(update={"model": model.model_copy(update={"activation": "squared_relu"})}),
                        state)
    assert _run_of(_normal(other)) != _run_of(_normal(today))
    broken = {**old, "model": {"name": "x"}}  # corrupt: stays as it is, another run
    assert _run_of(_normal(broken)) != _run_of(_normal(today))


def test_every_token_is_checked_before_training_and_odd_files_are_one_line(tmp_path, monkeypatch, capsys):
    """The range check reads the whole file in chunks before the first step (a file of any size: a bad token late in
    a large file ended a run at its step instead, with advice to resume into the same token); files that are not
    token files say what they are."""
    import runtime.data as data

    monkeypatch.setattr(data, "_CHUNK", 7)  # many chunks: the last one holds the bad token
    toks = np.arange(1000, dtype=np.uint16) % 200
    toks[-1] = 999
    toks.tofile(tmp_path / "late.u16")
    with pytest.raises(AutoparError, match="token id 999"):
        TokenData(tmp_path / "late.u16", seq=16, vocab_size=256, seed=0)
    assert data.token_range(np.load(_saved(tmp_path / "ok.npy", toks[:-1]), mmap_mode="r")) == (0, 199)
    (tmp_path / "dir.u16").mkdir()
    np.save(tmp_path / "be.npy", toks.astype(">u2"))
    np.savez(tmp_path / "z.npz", a=toks)
    (tmp_path / "z.npz").rename(tmp_path / "z.npy")
    (tmp_path / "t.npy").write_text("not numbers")
    for name, msg in (("dir.u16", "is a directory"), ("be.npy", "big-endian"), ("z.npy", "archive of several"),
                      ("t.npy", "not a .npy array of numbers")):
        with pytest.raises(AutoparError, match=msg):
            open_tokens(tmp_path / name)
    (tmp_path / "UP.TXT").write_text("abc")  # suffixes in any case
    np.testing.assert_array_equal(open_tokens(tmp_path / "UP.TXT"), list(b"abc"))
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "file"))  # the cache a file: one line, not FileExistsError
    (tmp_path / "new.txt").write_text("xyz")
    with pytest.raises(AutoparError, match="is a file; set AUTOPAR_CACHE to a writable folder"):
        open_tokens(tmp_path / "new.txt")
    from planner.cli import main

    assert main(["run", "--dry-run"]) == 2  # the default plan goes to the cache too: the same line
    assert "is a file; set AUTOPAR_CACHE" in capsys.readouterr().err
    import errno

    import runtime.data

    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "ro"))  # a read-only cache (a cluster's home): one line, where
    monkeypatch.setattr(runtime.data.tempfile, "TemporaryFile", read_only)  # removing its partial file raised again
    with pytest.raises(AutoparError, match=r"cannot write to the cache folder .*ro \(Read-only file system\); set"):
        open_tokens(tmp_path / "new.txt")


def _saved(path, arr):
    np.save(path, arr)
    return path


def test_a_texts_earlier_tokens_leave_the_cache(tmp_path, monkeypatch):
    """A .txt file edited and trained on again: its new tokens are cached and its earlier version's removed (a copy
    twice the text's size per version otherwise); another text of the same name elsewhere keeps its own."""
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    text, twin = tmp_path / "a" / "corpus.txt", tmp_path / "b" / "corpus.txt"
    text.write_text("first version " * 10)
    twin.write_text("another corpus " * 10)
    first, other = open_tokens(text).filename, open_tokens(twin).filename
    text.write_text("second version " * 10)
    second = open_tokens(text)
    np.testing.assert_array_equal(second, list(("second version " * 10).encode()))
    cached = sorted(p.name for p in (tmp_path / "cache").glob("*.u16"))
    assert Path(second.filename).name in cached and Path(other).name in cached and len(cached) == 2
    assert not Path(first).exists() and not Path(f"{first}.source").exists()
    assert open_tokens(twin).filename == other  # still cached: not tokenised again


def test_workers_take_the_launchers_verdict_on_an_unchanged_data_file(tmp_path, monkeypatch):
    """The launcher checks the data file once and hands its verdict to its workers (one scan at start, not one per
    rank); a file changed since, or a verdict about another file, is read and checked again."""
    import runtime.data as data

    scans = []
    real = data.token_range
    monkeypatch.setattr(data, "token_range", lambda arr: scans.append(1) or real(arr))
    toks = np.arange(1000, dtype=np.uint16) % 200
    toks.tofile(tmp_path / "a.u16")
    first = TokenData(tmp_path / "a.u16", seq=16, vocab_size=256, seed=0)
    monkeypatch.setenv(data.CHECKED_ENV, first.verdict())
    again = TokenData(tmp_path / "a.u16", seq=16, vocab_size=256, seed=0)
    assert len(scans) == 1 and again.range == (0, 199)
    assert torch.equal(again.batch(3, 8)[0], first.batch(3, 8)[0])
    with pytest.raises(AutoparError, match="vocabulary is 100"):  # the range is still held against this model
        TokenData(tmp_path / "a.u16", seq=16, vocab_size=100, seed=0)
    toks[-1] = 999
    toks.tofile(tmp_path / "a.u16")  # rewritten (a new modification time): checked again
    os.utime(tmp_path / "a.u16", ns=(1, 1))
    with pytest.raises(AutoparError, match="token id 999"):
        TokenData(tmp_path / "a.u16", seq=16, vocab_size=256, seed=0)
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path / "cache"))
    (tmp_path / "t.txt").write_bytes(bytes(range(60, 120)) * 4)
    text = TokenData(tmp_path / "t.txt", seq=16, vocab_size=256, seed=0)
    monkeypatch.setenv(data.CHECKED_ENV, text.verdict())
    monkeypatch.setattr(data, "tokenize_text", lambda p: pytest.fail("tokenised again"))
    assert TokenData(tmp_path / "t.txt", seq=16, vocab_size=256, seed=0).range == (60, 119)


def test_a_data_file_rewritten_or_removed_during_a_run_is_named(tmp_path):
    """A worker reading a memory-mapped file truncated under it dies of SIGBUS, which names no file: the launcher asks
    its TokenData whether the file changed since it was read, and says so."""
    toks = np.arange(1000, dtype=np.uint16) % 200
    toks.tofile(tmp_path / "a.u16")
    data = TokenData(tmp_path / "a.u16", seq=16, vocab_size=256, seed=0)
    assert data.changed() is None
    toks[:100].tofile(tmp_path / "a.u16")
    assert "a.u16 was rewritten while the run read it (size 2,000 -> 200 bytes)" in data.changed()
    (tmp_path / "a.u16").unlink()
    assert "a.u16 was removed while the run read it" in data.changed()


def test_a_checkpoints_files_checked_on_several_threads_name_each_changed_or_missing_one(tmp_path):
    """The launcher and the export check a whole checkpoint in one process, several files at once: every changed
    and every missing file is named, in name order, whatever the threads; a worker's share is its own."""
    from runtime.checkpoint import checksums, corrupt_files

    names = [f"__{i}_0.distcp" for i in range(12)]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(os.urandom(1000 + i))
    meta = {"checksums": checksums(tmp_path, names)}
    (tmp_path / names[3]).write_bytes(b"torn")
    (tmp_path / names[7]).unlink()
    want = sorted([names[3], names[7]])
    assert [corrupt_files(tmp_path, meta, threads=t) for t in (1, 4, 64)] == [want] * 3
    mine = sorted(meta["checksums"])
    assert corrupt_files(tmp_path, meta, share=1, shares=2, threads=4) == [n for n in want if mine.index(n) % 2 == 1]
    assert corrupt_files(tmp_path, {}, threads=4) == []
