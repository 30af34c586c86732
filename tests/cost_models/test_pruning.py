"""The search times only the candidates that may be among the fastest: each candidate's lower bound (its
pipeline's compute, TP/CP communication and ZeRO traffic, ``pipeline.makespan_floor`` of ``stages.rank_work``)
never exceeds its closed-form step time, so pruning by it changes no ranking the search uses."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from cost_models.batch import estimate_batch, may_be_among
from cost_models.pipeline import closed_form, makespan_floor
from planner.search import CLOSED_FORM_SLACK
from planner.space import enumerate_space
from specs.cluster_loading import load_cluster
from specs.model_loading import load_model

_path = Path(__file__).resolve().parents[2] / "benchmarks" / "closed_form_accuracy.py"
_spec = importlib.util.spec_from_file_location("closed_form_accuracy", _path)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.mark.parametrize("pp,vpp", [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 3), (8, 4)])
def test_makespan_floor_is_below_the_closed_form(pp, vpp):
    rng = np.random.default_rng(pp * 10 + vpp)
    n = 400
    f, b = rng.uniform(0.1, 2.0, (n, pp * vpp)), rng.uniform(0.1, 4.0, (n, pp * vpp))
    m = rng.choice([pp, 2 * pp, 4 * pp, 7 * pp], size=n)
    if vpp == 1:
        m = m + rng.integers(0, pp, size=n)
    per_rank = (f + b).reshape(n, vpp, pp).sum(axis=1)
    work = per_rank * rng.uniform(0.5, 1.0, per_rank.shape)  # any lower bound of each rank's work
    makespan = closed_form(f, b, pp, vpp, m).rank_end[:, 0]  # rank 0 ends last
    assert (makespan_floor(work, vpp, m) <= makespan * (1 + 1e-12)).all()
    # tight where the closed form is exact: equal stages, the work exactly known
    u = rng.uniform(0.1, 2.0, (n, 1))
    equal = np.broadcast_to(u, (n, pp * vpp))
    exact = closed_form(equal, 2 * equal, pp, vpp, m).rank_end[:, 0]
    assert makespan_floor(np.broadcast_to(3 * vpp * u, (n, pp)), vpp, m) == pytest.approx(exact, rel=1e-12)


@pytest.fixture(scope="module", params=bench.CASES, ids=lambda c: f"{c[0]}-{c[2]}x{c[3]}" + (f"-seq{c[1]}" if c[1]
                                                                                         else ""))
def case(request):
    name, seq, cluster_name, gpus, batch = request.param
    model, cluster = load_model(name, seq), load_cluster(cluster_name, gpus=gpus)
    space = enumerate_space(model, cluster, batch, bench.BOTH_OVERLAPS)  # overlaps on and off: both priced
    return model, cluster, space, batch


def test_the_floor_never_exceeds_the_step_time(case):
    """On every candidate of GPT and Llama cases (A100 and H100, long sequences with cp, ZeRO 0-3, overlaps on
    and off, interleaved pipelines): floor <= closed-form step time."""
    model, cluster, space, batch = case
    full = estimate_batch(model, cluster, space, batch, pipeline="closed")
    pruned = estimate_batch(model, cluster, space, batch, pipeline="closed", fits_GiB=np.inf, keep=(16, 1.25))
    assert (pruned.floor <= full.step_time * (1 + 1e-9)).all(), (pruned.floor / full.step_time).max()
    assert {int(z) for z in space.zero} == {0, 1, 2, 3}


def test_pruning_keeps_what_the_search_reads(case):
    """Memory worked out as without pruning, for every candidate; every candidate that fits and whose bound is
    below the final mark timed; the same k fastest in the same order, every candidate within the slack of the
    fastest timed (and their uneven pipelines replayed), each timed one priced as without pruning."""
    model, cluster, space, batch = case
    cap = cluster.gpu.memory_GiB
    full = estimate_batch(model, cluster, space, batch, fits_GiB=cap)  # "mixed" everywhere
    closed = estimate_batch(model, cluster, space, batch, pipeline="closed", fits_GiB=cap)
    pruned = estimate_batch(model, cluster, space, batch, fits_GiB=cap, keep=(16, CLOSED_FORM_SLACK))
    assert np.array_equal(pruned.memory_GiB, full.memory_GiB)  # every candidate's, as without pruning
    timed = np.isfinite(pruned.step_time)
    assert timed.sum() < np.isfinite(full.step_time).sum() or len(space) < 3000
    fits = np.isfinite(closed.step_time)
    mark = CLOSED_FORM_SLACK * np.sort(closed.step_time[fits])[15]
    assert timed[fits & (pruned.floor <= mark)].all()
    uneven = ~np.isclose(closed.step_time, full.step_time, rtol=1e-12, atol=0) & fits
    near = may_be_among(closed.step_time, uneven, 16)  # those whose replay may put them among the 16 fastest
    assert near.sum() >= 16 or near.sum() == fits.sum()
    assert timed[near].all()
    assert np.allclose(pruned.step_time[near], full.step_time[near], rtol=1e-12, atol=0)
    rest = timed & ~near
    assert np.allclose(pruned.step_time[rest], closed.step_time[rest], rtol=1e-12, atol=0)
    expected = np.where(near, full.step_time, closed.step_time)  # what the search used to rank before pruning
    top = np.argsort(expected, kind="stable")[:16]
    assert np.array_equal(np.argsort(pruned.step_time, kind="stable")[:16], top)
