"""The cost model against published Megatron-LM measurements (benchmarks/validate_published.py)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from cost_models.batch import estimate_batch
from cost_models.headroom import default_headroom_GiB
from cost_models.step import estimate
from planner import uncertainty
from planner.search import enumerate_space, search
from specs.cluster_loading import load_cluster
from specs.errors import AutoparError

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("validate_published", ROOT / "benchmarks" / "validate_published.py")
vp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vp)
_spec_h100 = importlib.util.spec_from_file_location("validate_h100", ROOT / "benchmarks" / "validate_h100.py")
vh = importlib.util.module_from_spec(_spec_h100)
_spec_h100.loader.exec_module(vh)
_spec_pre = importlib.util.spec_from_file_location("bloom_prequel", ROOT / "benchmarks" / "bloom_prequel.py")
pre = importlib.util.module_from_spec(_spec_pre)
_spec_pre.loader.exec_module(pre)


def test_korthikanti_iteration_times():
    rows = vp.korthikanti()
    assert len(rows) == 8
    s = vp.summary(rows)
    assert s["mean_abs_error"] <= 0.05, rows
    assert s["max_abs_error"] <= 0.10, rows


def test_korthikanti_alternatives_ranked_as_measured():
    """Korthikanti 2022 timed two plans of each model on the same GPUs (full recompute; selective recompute with
    sequence parallelism): the model orders every pair as measured, and predicts the speedup within 7%."""
    alts = vp.alternative_pairs(vp.korthikanti())
    assert [a["model"] for a in alts] == ["22B", "175B", "530B", "1T"]
    assert all(a["same_order"] for a in alts), alts
    assert all(abs(a["predicted_speedup"] / a["measured_speedup"] - 1) <= 0.07 for a in alts), alts


def test_korthikanti_activation_memory():
    rows = vp.korthikanti_activation_check()
    assert rows and max(abs(r["error"]) for r in rows) <= 0.05


def test_narayanan_iteration_times():
    rows = vp.narayanan()
    assert len(rows) == 10
    assert vp.summary(rows)["mean_abs_error"] <= 0.10, rows


NARAYANAN = vp._rows("narayanan2021_table1.csv")
PAPER_FEATURES = vp.PAPER_FEATURES
# Rows where autopar's cost model prefers less tensor and more pipeline parallelism than the paper chose
# (e.g. 18.4B: tp=2 pp=4 with interleaving is predicted 17% faster than tp=8 pp=1). The paper's own
# configuration is predicted within 0.6-5% of its measured time on these rows; the alternatives were never
# measured (benchmarks/RESULTS.md: even with pipelines slowed by the 2021 code base's measured 8.7%, 18.4B and
# 39.1B stay out of the top 10%; BigScience's measured A100 sweep, test_bloom_sweep_* below, found tp=4 and tp=2
# plans faster than every tp=8 one). Strict xfail: if the model changes to agree, these pass and the marker goes.
MODEL_DISAGREES = {"7.5", "18.4", "39.1"}


def _rows_marked():
    for r in NARAYANAN:
        marks = [pytest.mark.xfail(strict=True, reason="model prefers lower tp / deeper pipeline than the paper")] \
            if r["params_b"] in MODEL_DISAGREES else []
        yield pytest.param(r, id=r["params_b"], marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("row", _rows_marked())
def test_paper_config_ranks_top_ten_percent(row):
    """The planner's best plan is at least as fast as the paper's configuration (tp, pp and full recompute
    as published, the best of the unpublished mbs / vpp), and that configuration ranks in the top 10% of the
    feasible plans built from the paper's features (tp, pp, dp, micro-batch, interleaving, full recompute),
    all priced with the exact model."""
    model = vp._gpt(row["params_b"], row)
    gpus, B = int(row["gpus"]), int(row["global_batch"])
    cluster = load_cluster("selene", gpus=gpus)
    rank = vp.paper_rank(row)
    free = search(model, cluster, B, top=1, state=vp.published_state(cluster, "narayanan2021"))
    assert free.plans[0].estimate.step_time_s <= rank["paper_s"] * (1 + 1e-9)
    assert rank["rank"] <= 0.10, rank


def test_exact_and_closed_form_agree_on_paper_rows():
    """The closed form the search ranks with stays close to the exact (simulated) estimate."""
    for row in NARAYANAN[::3]:
        model = vp._gpt(row["params_b"], row)
        gpus, B, tp, pp = int(row["gpus"]), int(row["global_batch"]), int(row["tp"]), int(row["pp"])
        cluster = load_cluster("selene", gpus=gpus)
        fixed = {**PAPER_FEATURES, "tp": tp, "pp": pp, "dp": gpus // (tp * pp), "mbs": 1, "vpp": 1}
        cands = enumerate_space(model, cluster, B, fixed)
        assert len(cands) == 1
        fast = float(estimate_batch(model, cluster, cands, B).step_time[0])
        exact = estimate(model, cluster, cands.config(0), B).step_time_s
        assert fast == pytest.approx(exact, rel=0.03)


@pytest.fixture(scope="module")
def bloom_sweep():
    rows = vp.bloom_topology()
    return rows, vp.topology_summary(rows)


def test_bloom_sweep_fits_and_memory(bloom_sweep):
    """BigScience's measured BLOOM topology sweep (fp16, ZeRO-1, full recompute on 48 Jean Zay nodes): every
    plan that ran out of memory is predicted not to fit; a plan that ran but is predicted not to (at its even layer
    split) used more of the GPU than the default headroom leaves, so the planner would not choose it either; the
    predicted peak of the fullest GPU is close to the memory nvidia-smi showed."""
    rows, s = bloom_sweep
    assert sum(r["measured_oom"] for r in rows) == 3
    assert not any(r["predicted_fits"] for r in rows if r["measured_oom"])
    refused = [r for r in rows if not r["measured_oom"] and not r["predicted_fits"]]
    assert all(r["measured_GiB"] > 80.0 - default_headroom_GiB(80.0) for r in refused), refused
    assert s["fit_agreement"] >= 17 / 18, s
    assert s["mean_abs_memory_error"] <= 0.12, s
    assert s["max_abs_memory_error"] <= 0.20, s


def test_default_headroom_covers_the_measured_peaks(bloom_sweep):
    """The evidence for the default headroom (cost_models/headroom.py): no measured peak of the sweep was above the
    predicted one by more than the default share of the 80 GiB GPU, so with it every plan chosen would have fit."""
    _, s = bloom_sweep
    assert 0 < s["max_under_GiB"] <= default_headroom_GiB(80.0), s


def test_bloom_prequel_held_out():
    """BigScience's earlier sweeps of the same chronicle (56 runs of plans and model shapes, not among the bands'
    residuals): the bands hold at least 80% of them (issue 12's bar), and in every table of at least 8 runs the plan
    and shape the model ranks first measured within 1% per sample of the table's best (the chronicle's repeated runs
    differ by up to 2.8%)."""
    assert pre.deepspeed_split(78, 12) == (7,) * 11 + (1,) and pre.deepspeed_split(72, 6) == (12,) * 6
    rows = pre.prequel()
    timed = [r for r in rows if "ratio" in r and not r["repeat"]]  # a repeated run counts once
    assert len(timed) == len(rows) - sum(r["repeat"] for r in rows) >= 50
    assert sum(r["in_band"] for r in timed) >= 0.8 * len(timed)
    tables = [t for t in pre.by_table(rows) if t["runs"] >= 8]
    assert len(tables) >= 4 and all(t["regret"] <= 0.01 for t in tables), tables
    assert pre.spearman([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(0.8)


def test_head_dim_benchmark_covers_the_prequel_shapes(capsys):
    """benchmarks/attention_head_dim.py times the unfused attention GEMMs of every (hidden, heads) the prequel ran
    at tp=8 (head dim 108 among them), and says it needs a GPU rather than failing without one."""
    spec = importlib.util.spec_from_file_location("attention_head_dim", ROOT / "benchmarks" / "attention_head_dim.py")
    hd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hd)
    ran = {(int(r["hidden"]), int(r["heads"])) for r in vp._rows("bigscience_tr11_prequel.csv") if r["tp"] == "8"}
    timed = {(c["hidden"], c["heads"]) for c in hd.cases()}
    assert ran <= timed and 108 in {c["head_dim"] for c in hd.cases()}
    assert all(c["batch"] == hd.MBS * c["heads"] // hd.TP for c in hd.cases())
    import torch

    if not torch.cuda.is_available():
        import sys

        argv, sys.argv = sys.argv, ["attention_head_dim.py"]
        try:
            assert hd.main() == 2
        finally:
            sys.argv = argv
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bloom_sweep_model_pick_is_near_the_measured_best(bloom_sweep):
    """Taking the plan the model ranks first among the swept ones costs at most 3% per sample over the
    measured best (the sweep repeated one plan at 110.5 s and 113.5 s: 2.8% apart), and the model's order
    agrees with the measured one more than it disagrees."""
    _, s = bloom_sweep
    assert s["regret"] <= 0.03, s
    assert s["spearman"] > 0.3, s


def test_residuals_behind_the_bands_are_current(bloom_sweep):
    """planner/residuals.json (the plans' +- bands) is what the model gives today on the published rows: re-run
    `python benchmarks/validate_published.py --write-residuals planner/residuals.json` after changing the model."""
    rows, _ = bloom_sweep
    now = vp.residual_rows({"korthikanti2022": vp.korthikanti(), "narayanan2021": vp.narayanan(),
                            "bigscience_tr11_topology": rows, "nvidia_dgxc_h100": vh.nemo()})
    stored = json.loads(uncertainty.RESIDUALS.read_text())["sets"]
    assert stored.keys() == now.keys()
    for name in now:
        assert [(r["plan"], r["pipelined"]) for r in stored[name]] == [(r["plan"], r["pipelined"]) for r in now[name]]
        assert [r["ratio"] for r in stored[name]] == pytest.approx([r["ratio"] for r in now[name]], rel=1e-5)


def test_band_is_a_distribution_free_prediction_interval():
    """The band of n rows is their k-th smallest to k-th largest, k = floor(2.5% of (n + 1)) and at least 1: a new
    row drawn like the others lies inside it with probability at least 1 - 2k / (n + 1) whatever their distribution,
    95% or more from 39 rows on (below, the range seen: (n - 1) / (n + 1)); an interpolated quantile would hold it
    less often."""
    rng = np.random.default_rng(0)
    for n, k in ((20, 1), (60, 1), (79, 2), (200, 5)):
        x = rng.lognormal(0.05, 0.1, n)
        b = uncertainty.band(True, {"s": [{"ratio": v, "pipelined": True} for v in x]})
        assert (b.low, b.high, b.rows) == (np.sort(x)[k - 1], np.sort(x)[n - k], n)
        assert b.coverage == pytest.approx(1 - 2 * k / (n + 1)) and (b.coverage >= 0.95) == (n >= 39)
    n, trials = 120, 4000  # k = 3: holds a new row with probability 1 - 6 / 121 = 95.0%
    draws = rng.standard_t(3, (trials, n + 1))  # heavy tails: no normal band would do
    inside = 0
    for row in draws:
        b = uncertainty.band(False, {"s": [{"ratio": float(np.exp(v)), "pipelined": False} for v in row[:n]]})
        inside += b.low <= np.exp(row[n]) <= b.high
    assert inside / trials >= 0.95 - 3 * math.sqrt(0.05 * 0.95 / trials)


def test_bands_cover_every_published_set():
    """With fewer than 79 rows of a kind the band is the range seen (k = 1): every published row lies in its kind's
    band; with more, all but k - 1 = floor(2.5% of (n + 1)) - 1 at each end. Held out
    (each row's band from the other rows), every set keeps at least the share a range of that many rows is
    expected to hold; the band is wider above the prediction than below (the model is optimistic on stacks other
    than the one it follows)."""
    stored = json.loads(uncertainty.RESIDUALS.read_text())["sets"]
    for kind in (True, False):
        b = uncertainty.band(kind)
        ratios = [r["ratio"] for rows in stored.values() for r in rows if r["pipelined"] == kind]
        inside = sum(b.low <= x <= b.high for x in ratios)
        assert inside >= len(ratios) - 2 * max(0, math.floor(0.025 * (len(ratios) + 1)) - 1), (kind, b)
    for name, rows in stored.items():  # in sample: at least 80% of every set's rows (issue 12's bar)
        assert sum(uncertainty.band(r["pipelined"]).low <= r["ratio"] <= uncertainty.band(r["pipelined"]).high
                   for r in rows) >= 0.8 * len(rows), name
    cov = uncertainty.coverage(stored)
    # a range of n exchangeable rows holds a new one with probability (n - 1) / (n + 1): the floor for the rows
    # pooled (one small set's edge rows, e.g. Korthikanti's A100 rows predicted 2.5-8.4% slow since the fused
    # accumulation's epilogue is priced (measured on an H200, not on an A100) where every other stack runs slower
    # than predicted, can fall outside the band the other sets make: 6 of its 8 held out)
    rows = [sum(r["pipelined"] == k for v in stored.values() for r in v) - 1 for k in (True, False)]
    floor = min((n - 1) / (n + 1) for n in rows)
    pooled = sum(cov[name] * len(stored[name]) for name in cov) / sum(len(v) for v in stored.values())
    assert len(cov) == 4 and pooled >= floor and min(cov.values()) >= 0.7, (cov, pooled, floor)
    # a stack none of the bands' rows come from is held less often (the stacks differ by more than plans on one
    # stack do): below 79 rows a set's band from fewer rows spans less, never more
    new_stack = uncertainty.coverage(stored, "set")
    assert all(new_stack[name] <= cov[name] for name in cov) and min(new_stack.values()) < 0.8, new_stack
    with pytest.raises(ValueError, match="hold_out"):
        uncertainty.coverage(stored, "plan")
    piped = uncertainty.band(True)
    assert piped.low < 1 < piped.high and piped.high - 1 > 1 - piped.low and piped.rows >= 20
    assert 0.01 < uncertainty.ranking_sigma() < 0.2
    margin = uncertainty.tie_margin()
    assert uncertainty.tied_with_best([1.0, 1.0 + margin / 2, 1.0 + 2 * margin]) == 1
    assert uncertainty.tied_with_best([1.0]) == 0


def test_a_missing_or_corrupt_residuals_file_is_one_line(tmp_path, monkeypatch):
    """The bands' data file gone, torn or holding nonsense: one line saying how to write it again."""
    for text in (None, '{"sets": {"a": [{"ratio": 1.0, "pipel', '{"sets": {"a": [{"plan": "x", "pipelined": true, '
                 '"ratio": -1}, {"plan": "y", "pipelined": false, "ratio": 1}]}}',
                 '{"sets": {"a": [{"pipelined": true, "ratio": "0.97"}, {"pipelined": false, "ratio": 1.0}]}}',
                 '{"sets": {"a": [{"pipelined": true, "ratio": 0.97}, {"pipelined": "false", "ratio": 1.0}]}}'):
        path = tmp_path / "residuals.json"
        if text is not None:
            path.write_text(text)
        monkeypatch.setattr(uncertainty, "RESIDUALS", path)
        uncertainty._stored.cache_clear()
        with pytest.raises(AutoparError, match="residuals.json .*regenerate it: python benchmarks/validate_publ"):
            uncertainty.band(True)
        path.unlink(missing_ok=True)
    uncertainty._stored.cache_clear()
