"""The runtime executes exactly what the cost model priced: for every plan of the equivalence set, each rank's
data-parallel gradient buckets per model chunk are the buckets the cost model counts
(``cost_models.params.gradient_buckets``; under ZeRO-2/3 one per layer, as ``cost_models.stages.zero_traffic``
counts them), and the bytes of its model state — parameter buffers, gradient buffers, master copies and Adam
moments, measured from the tensors it keeps after a step — are the weights, gradients and optimizer state the
cost model prices for its pipeline stage (``cost_models.step.estimate(...).stage_memory_breakdown``).
tests/runtime/test_zero.py runs the same check on its ZeRO-2/3 plans.

The communication ledger (runtime/comm_ledger.py) of a steady step equals the one the cost model priced
(``cost_models.ledger.priced_ledger``) op by op: calls and bytes of every (op, group, dtype) on every rank.
Two differences are allowed and bounded. ZeRO pads each bucket (above): a data-parallel op may move the
padding's bytes too. And under ZeRO with sequence parallelism, the tp-sum of the partial gradients runs on the
slice each rank owns, which holds more or less than the 1/d share the cost model prices per rank: its bytes
summed over a stage's d ranks equal d times the priced bytes, and no rank makes more calls than priced.

The one allowed difference is ZeRO's padding: each bucket is a multiple of the data-parallel group size ``d``
(so it reduce-scatters evenly), which adds at most ``d - 1`` elements per bucket (a split tied embedding's,
under ZeRO-2/3 reduced on its own, counted apart) to what is kept — to each kind in the share kept of it: the
optimizer state 1/d from ZeRO-1 on, the gradients from ZeRO-2, the parameters from ZeRO-3. The ranks report
their padding; the test checks it is within that bound and that it accounts for the difference exactly.

gloo in torch 2.13 reduces, reduce-scatters and all-gathers bf16 tensors, so the bf16 plans (bf16 parameters,
fp32 gradients and master weights: 18 bytes per parameter) run on the gloo pool like the fp32 ones (16 bytes).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from rt_cases import case_plan
from rt_reference import reference_run
from test_equivalence import CASES, MOE_CASES, MOE_EP_CASES, _id

from cost_models.ledger import priced_ledger
from cost_models.params import gradient_buckets, gradient_groups
from cost_models.step import estimate
from runtime.parallel.buckets import ALIGN
from specs.planfile import PlanFile

GiB = 2**30
KINDS = {"weights": "param_bytes", "gradients": "grad_bytes", "optimizer": "optimizer_bytes"}
SHARDED_FROM = {"weights": 3, "gradients": 2, "optimizer": 1}  # the ZeRO stage that keeps 1/d of each kind

# bf16 parameters with fp32 gradients (a "main grad" per parameter) and fp32 master weights: ZeRO-1 with tp, sp,
# interleaving and a tied embedding, and ZeRO-0 over a pipeline.
BF16_CASES = [
    dict(tp=2, pp=2, dp=2, sp=True, sched="interleaved", zero=1, arch="gpt", tied=True, state="bf16"),
    dict(tp=1, pp=2, dp=2, sched="1f1b", zero=0, arch="llama", state="bf16", bucket_params=1000),
]

# context parallelism: ZeRO-1 shards over d = dp x cp (here with a pipeline and a tied embedding, and over cp alone
# with tp + sp)
CP_CASES = [
    dict(cp=2, tp=1, pp=2, dp=2, sched="1f1b", zero=1, arch="llama", tied=True),
    dict(cp=4, tp=2, pp=1, dp=1, sp=True, sched="1f1b", zero=1, arch="gpt", attention="flash"),
]


def priced_buckets(plan: PlanFile) -> np.ndarray:
    """The cost model's gradient buckets of each virtual stage: ZeRO-2/3 (over d > 1 ranks) one per layer, at least
    one (``zero_traffic``'s ``nb``; ``gradient_buckets`` does not take ZeRO into account)."""
    cfg = plan.config
    layers = np.array(cfg.stage_layers(plan.model.num_layers), dtype=float)
    if cfg.zero >= 2 and cfg.dp * cfg.cp > 1:
        return np.maximum(1.0, layers)
    groups = gradient_groups(plan.model, cfg.tp, cfg.sp and cfg.tp > 1, layers, cfg.ep, cfg.etp)
    return gradient_buckets(groups, plan.state.bucket_params)


def check_rank(plan: PlanFile, r: dict, buckets: np.ndarray, priced: dict[str, float]) -> None:
    """One rank's buckets and state bytes against the cost model's."""
    assert r["buckets"] == [int(buckets[v]) for v in r["vstages"]], (r["vstages"], r["buckets"], buckets)
    assert r["stray"] == 0  # every parameter and gradient tensor lives in the buffers (ZeRO-3: or is empty)
    d, pad, nb = r["d"], r["padding"], sum(r["segments"])
    unit = ALIGN * (d if r["zero"] else 1)  # buckets (and ZeRO slices) start aligned: runtime/parallel/buckets.py
    assert 0 <= pad <= (unit - 1) * nb and r["misaligned"] == 0
    for kind, attr in KINDS.items():
        per_param = getattr(plan.state, attr)
        cost = priced[kind] * GiB
        padded = (r["padding_owned"] if r["zero"] >= SHARDED_FROM[kind] else pad) * per_param
        tolerance = (unit - 1) * nb * per_param  # at most unit - 1 padding elements per bucket
        assert abs(r["bytes"][kind] - cost) <= tolerance, (kind, r["bytes"][kind], cost)
        assert r["bytes"][kind] == pytest.approx(cost + padded, rel=1e-12, abs=1e-6), (kind, r["bytes"][kind], cost)


def check_ledger(plan: PlanFile, reports: list[dict]) -> None:
    """Every rank's recorded communication against the priced ledger of its pipeline rank (module docstring)."""
    cfg = plan.config
    priced = priced_ledger(plan.model, plan.cluster, cfg, plan.global_batch, plan.state)
    d = cfg.dp * cfg.cp
    tp_sum = ("all_reduce", "tp", f"{'float32' if plan.state.grad_reduce == 'fp32' else 'bfloat16'}")
    sharded = cfg.zero >= 1 and d > 1 and cfg.sp and cfg.tp > 1
    # the combine carries back the rows a rank received, and the etp exchanges the rows of the etp group: routing decides
    routed = {("all_to_all", "ep", "float32"), ("all_to_all", "etp", "float32")}
    totals: dict[tuple[int, int], int] = {}
    stage: dict[tuple[int, tuple], int] = {}
    for r in reports:
        got, want = r["ledger"], priced[r["pp_rank"]]
        loose = {tp_sum} if sharded else set()  # a rank may own none of the partial gradients
        assert set(got) - loose == set(want) - loose, (r["pp_rank"], sorted(set(got) ^ set(want)))
        for key, (w_calls, w_bytes) in want.items():
            calls, nbytes = got.get(key, (0, 0))
            if sharded and key == tp_sum:
                assert calls <= w_calls, (key, calls, w_calls)
                totals[r["pp_rank"], r["tp_rank"]] = totals.get((r["pp_rank"], r["tp_rank"]), 0) + nbytes
                continue
            assert calls == w_calls, (r["pp_rank"], key, calls, w_calls)
            if key in routed:
                stage[r["pp_rank"], key] = stage.get((r["pp_rank"], key), 0) + nbytes
                continue
            pad = r["padding_max"] * 4 * calls if key[1] in ("dp", "edp") else 0
            assert w_bytes - 1e-6 <= nbytes <= w_bytes + pad + 1e-6, (r["pp_rank"], key, nbytes, w_bytes, pad)
    for (pp_rank, _), nbytes in totals.items():
        assert nbytes == pytest.approx(d * priced[pp_rank][tp_sum][1], rel=1e-12), (pp_rank, nbytes)
    for (pp_rank, key), nbytes in stage.items():  # over a stage's ranks, what was sent is what was received
        assert nbytes == pytest.approx(d * cfg.tp * priced[pp_rank][key][1], rel=1e-12), (pp_rank, key, nbytes)


def check_plan_run(pool, tokens64: str, case: dict) -> list[dict]:
    plan = case_plan(case)
    est = estimate(plan.model, plan.cluster, plan.config, plan.global_batch, validate=False, state=plan.state)
    buckets = priced_buckets(plan)
    reports = [r for r in pool.run("rt_cases:model_state_report", case, tokens64) if r is not None]
    assert len(reports) == plan.world_size
    for r in reports:
        check_rank(plan, r, buckets, est.stage_memory_breakdown[r["pp_rank"]])
    check_ledger(plan, reports)
    return reports


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_buckets_and_state_bytes_are_priced(pool, tokens64, case):
    reports = check_plan_run(pool, tokens64, case)
    assert all(r["dtypes"] == ["torch.float32", "torch.float32"] for r in reports)


@pytest.mark.parametrize("case", MOE_CASES + MOE_EP_CASES, ids=[_id(c) for c in MOE_CASES + MOE_EP_CASES])
def test_moe_state_and_traffic_are_priced(pool, tokens64, case):
    """MoE plans: each stage's experts (sliced over ep, reduced over expert data parallelism), router and shared
    experts, counted per stage (its MoE layers, not the average layer), are the runtime's buckets, state bytes and
    data-parallel traffic; its all-to-alls, count exchanges and aux-loss sums are the priced ones (the combine's
    bytes, which routing decides per rank, summed over the stage's ranks)."""
    check_plan_run(pool, tokens64, case)


@pytest.mark.parametrize("case", BF16_CASES, ids=[_id(c) for c in BF16_CASES])
def test_bf16_state_is_priced_and_trains(pool, tokens64, case):
    reports = check_plan_run(pool, tokens64, case)
    assert all(r["dtypes"] == ["torch.bfloat16", "torch.float32"] for r in reports)
    assert all(r["bytes"]["optimizer"] > 2 * r["bytes"]["weights"] for r in reports)  # master + moments, fp32
    loss = reports[0]["loss"]
    want = reference_run(case_plan({**case, "state": "fp32", "steps": 1}), tokens64)["losses"][0]
    assert math.isfinite(loss) and abs(loss - want) <= 1e-2 * want  # bf16 compute, the fp32 model's loss


@pytest.mark.parametrize("case", CP_CASES, ids=[_id(c) for c in CP_CASES])
def test_context_parallel_state_is_priced(pool, tokens64, case):
    reports = check_plan_run(pool, tokens64, case)
    assert all(r["d"] == case["dp"] * case["cp"] and r["zero"] == 1 for r in reports)
