"""Every plan computes what one process computes: gradients after step 1 and losses over 3 steps within 1e-5.

The plans form a covering set: every value of tp {1,2,4}, pp {1,2}, dp {1,2}, cp {1,2,4}, sp, schedule (1F1B /
interleaved), recompute {none, selective, full}, ZeRO {0,1,2,3}, arch {llama, gpt}, tied embeddings,
overlapped data parallelism and overlapped tensor parallelism, and every pair of them, appears (where the pair
can run in 8 ranks and means something: sp needs tp > 1, tp_overlap needs sp, ZeRO and dp_overlap need dp x cp
> 1, interleaving needs pp > 1). GPT plans with
cp > 1 use flash attention (context parallelism needs it).
"""

from __future__ import annotations

import itertools

import pytest
from rt_cases import case_plan, case_spec
from rt_reference import merge, reference_run, rel_err

TOL = 1e-5

FACTORS = {
    "tp": [1, 2, 4], "pp": [1, 2], "dp": [1, 2], "cp": [1, 2, 4], "sp": [False, True], "sched": ["1f1b", "interleaved"],
    "recompute": ["none", "selective", "full"], "zero": [0, 1, 2, 3], "arch": ["llama", "gpt"], "tied": [False, True],
    "dp_overlap": [False, True], "tp_overlap": [False, True],
}
DEFAULTS = {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "sp": False, "sched": "1f1b", "recompute": "none", "zero": 0,
            "arch": "llama", "tied": False, "dp_overlap": False, "tp_overlap": False}  # what case_plan and case_spec
# assume

_C = ("tp", "pp", "dp", "sp", "sched", "recompute", "zero", "arch", "tied", "tp_overlap")
CASES = [dict(zip(_C, v)) for v in [
    (1, 1, 1, False, "1f1b", "none", 0, "llama", False, False),
    (2, 2, 2, True, "interleaved", "none", 1, "gpt", True, True),
    (4, 1, 1, True, "1f1b", "selective", 0, "gpt", True, False),
    (1, 2, 2, False, "interleaved", "selective", 1, "llama", False, False),
    (2, 2, 1, False, "interleaved", "full", 0, "llama", True, False),
    (4, 1, 2, True, "1f1b", "full", 1, "gpt", False, False),
    (2, 1, 2, True, "1f1b", "selective", 0, "llama", False, False),
    (1, 2, 1, False, "1f1b", "full", 0, "gpt", True, False),
    (4, 2, 1, False, "interleaved", "none", 0, "llama", True, False),
]]
# Extras: 1F1B over 2 stages with dp and mbs 2, uneven stages with partial recompute, a first stage holding
# nothing but the embedding, a vocabulary that tp does not divide (padded shards), GPT with flash attention
# and overlapped DP, and Nemotron-4's block (a GPT without biases, squared-ReLU MLP, RoPE on half of each head) under
# tp overlap.
CASES += [
    dict(tp=2, pp=2, dp=2, sp=False, sched="1f1b", recompute="none", zero=0, arch="gpt", mbs=2, dp_overlap=True),
    dict(tp=2, pp=2, dp=1, sp=True, sched="1f1b", recompute="full", recompute_layers=1, arch="llama",
         layers=(1, 3), tied=True, tp_overlap=True),
    dict(tp=1, pp=2, dp=1, sp=False, sched="1f1b", recompute="none", zero=0, arch="gpt", layers=(0, 4)),
    dict(tp=4, pp=1, dp=2, sp=True, sched="1f1b", recompute="none", zero=1, arch="llama", vocab=66,
         dp_overlap=True),
    dict(tp=2, pp=1, dp=2, sp=False, sched="1f1b", recompute="selective", zero=1, arch="gpt", attention="flash",
         dp_overlap=True),
    dict(tp=2, pp=2, dp=2, sp=True, sched="interleaved", recompute="selective", zero=1, arch="gpt",
         activation="squared_relu", linear_bias=False, rotary_fraction=0.5, tp_overlap=True,
         dp_overlap=True),  # Nemotron-4's block
]


# ZeRO-2/3 (tests/runtime/test_zero.py adds their overlap, state and checkpoint checks)
_Z = ("zero", "tp", "pp", "dp", "sp", "sched", "recompute", "arch", "tied", "dp_overlap")
ZERO_CASES = [dict(zip(_Z, v)) for v in [
    (2, 2, 2, 2, True, "interleaved", "selective", "gpt", True, True),
    (2, 2, 1, 2, False, "1f1b", "full", "llama", False, False),
    (2, 1, 2, 2, False, "1f1b", "full", "gpt", True, False),
    (3, 2, 2, 2, True, "1f1b", "full", "llama", True, True),  # with tp_overlap (below)
    (3, 2, 2, 2, False, "interleaved", "selective", "llama", False, False),
    (3, 1, 1, 4, False, "1f1b", "selective", "gpt", True, True),
]]
ZERO_CASES += [
    dict(zero=3, tp=1, pp=2, dp=2, sched="1f1b", recompute="none", arch="gpt", layers=(0, 4), dp_overlap=False),
    dict(zero=3, tp=1, pp=2, dp=2, cp=2, sched="1f1b", recompute="none", arch="llama", tied=True, dp_overlap=True),
]
ZERO_CASES[3]["tp_overlap"] = True


# context parallelism (tests/runtime/test_context_parallel.py checks its pieces and activation memory)
CP_CASES = [
    dict(cp=2, tp=1, pp=1, dp=1, sp=False, sched="1f1b", recompute="none", zero=0, arch="llama"),
    dict(cp=4, tp=2, pp=1, dp=1, sp=True, sched="1f1b", recompute="selective", zero=0, arch="llama", tp_overlap=True),
    dict(cp=2, tp=2, pp=2, dp=1, sp=False, sched="1f1b", recompute="full", zero=0, arch="gpt", attention="flash",
         tied=True),
    dict(cp=2, tp=1, pp=2, dp=2, sp=False, sched="interleaved", recompute="none", zero=1, arch="llama", tied=True,
         dp_overlap=True),
    dict(cp=4, tp=1, pp=1, dp=2, sp=False, sched="1f1b", recompute="selective", zero=1, arch="gpt",
         attention="flash", rotary_fraction=0.5),  # partial RoPE at each cp rank's global positions
    dict(cp=4, tp=1, pp=2, dp=1, sp=False, sched="1f1b", recompute="full", zero=0, arch="llama", tied=True,
         recompute_layers=1),
    dict(cp=2, tp=2, pp=1, dp=2, sp=True, sched="1f1b", recompute="none", zero=0, arch="gpt", attention="flash",
         tied=True, mbs=2, dp_overlap=True),
]
# pairs the lists above leave out
CASES += ZERO_CASES + CP_CASES + [
    dict(tp=4, pp=1, dp=1, cp=2, sp=True, sched="1f1b", recompute="selective", zero=2, arch="llama", dp_overlap=True,
         tp_overlap=True),
    dict(tp=1, pp=2, dp=1, cp=4, sched="interleaved", recompute="none", zero=3, arch="gpt", attention="flash",
         dp_overlap=True),
    dict(tp=1, pp=1, dp=1, cp=4, recompute="none", zero=2, arch="llama"),
    dict(tp=2, pp=2, dp=1, cp=2, sp=True, sched="1f1b", recompute="full", zero=1, arch="llama", tied=True),
    dict(tp=4, pp=1, dp=2, sp=True, recompute="none", zero=3, arch="gpt"),
]


def _feasible(c: dict) -> bool:
    d = c["dp"] * c["cp"]
    return (c["tp"] * c["pp"] * d <= 8 and not (c["sched"] == "interleaved" and c["pp"] == 1)
            and not (c["sp"] and c["tp"] == 1) and not (c["zero"] and d == 1) and not (c["dp_overlap"] and d == 1)
            and not (c["tp_overlap"] and not c["sp"]))


def test_cases_cover_every_pair():
    names = list(FACTORS)
    every = [dict(zip(names, v)) for v in itertools.product(*FACTORS.values())]
    needed = {(a, c[a], b, c[b]) for c in every if _feasible(c) for a, b in itertools.combinations(names, 2)}
    full = [{**DEFAULTS, **c} for c in CASES]
    have = {(a, c[a], b, c[b]) for c in full for a, b in itertools.combinations(names, 2)}
    assert not needed - have, sorted(needed - have, key=str)[:5]
    assert all(_feasible(c) for c in full)


def _id(c: dict) -> str:
    return "-".join(f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in c.items()
                    if k not in ("sched", "arch", "recompute") or v not in ("1f1b", "none")).replace(" ", "")


# Mixture of experts (layers 0 and 2: 8 experts, top-2, one shared expert), which the runtime trains with tp=1 and
# cp=1 so far: every micro-batch count (the aux loss's gradient is scaled as the loss is), pp with 1F1B and
# interleaving, dp with ZeRO-1 and overlap, full and selective recompute, the shared expert's gate, a sigmoid router.
MOE_CASES = [
    dict(moe="softmax", tp=1, pp=1, dp=1),
    dict(moe="gated", tp=1, pp=2, dp=2, sched="interleaved", zero=1),
    dict(moe="sigmoid", tp=1, pp=2, dp=1, recompute="full"),
    dict(moe="softmax", tp=1, pp=1, dp=2, recompute="selective", zero=1, dp_overlap=True),
    dict(moe="gated", tp=1, pp=2, dp=2, mbs=2),
]

# Expert parallelism (ep in {1, 2, 4}) with tensor (and sequence) parallelism in {1, 2}, pipelines of 1 and 2 stages
# and data parallelism in {1, 2}: every pair of their values that fits 8 ranks (ep = 4 with dp = 1 needs tp = 4 or
# cp), under ZeRO-1, overlap, interleaving, recompute and context parallelism besides.
MOE_EP_CASES = [
    dict(moe="softmax", ep=2, tp=1, pp=1, dp=2),
    dict(moe="gated", ep=2, tp=2, sp=True, pp=2, dp=1),
    dict(moe="softmax", ep=4, tp=2, sp=True, pp=1, dp=2, zero=1, dp_overlap=True, tp_overlap=True),
    dict(moe="sigmoid", ep=4, tp=2, sp=True, pp=2, dp=2, zero=1),
    dict(moe="softmax", ep=4, tp=1, pp=1, dp=4, recompute="full"),
    dict(moe="gated", ep=1, tp=2, sp=True, pp=2, dp=2, sched="interleaved"),
    dict(moe="softmax", ep=2, tp=2, sp=True, pp=1, dp=2, zero=1, recompute="selective"),
    dict(moe="mixtral", ep=2, tp=1, pp=2, dp=2, sched="interleaved", zero=1),
    # context parallelism: the aux loss's counts summed over cp (and tp) ranks, the cp ranks' gradients averaged
    dict(moe="softmax", ep=2, cp=2, tp=1, pp=1, dp=1),
    dict(moe="gated", ep=4, cp=2, tp=2, sp=True, pp=1, dp=1, zero=1),
    dict(moe="sigmoid", ep=2, cp=2, tp=1, pp=2, dp=2, recompute="full"),
    # expert tensor parallelism: each expert's width split etp ways (with and without ep, with and without tp)
    dict(moe="softmax", ep=2, etp=2, tp=2, sp=True, pp=1, dp=2),
    dict(moe="gated", ep=1, etp=2, tp=2, sp=True, pp=2, dp=1, recompute="full"),
    dict(moe="sigmoid", ep=2, etp=2, tp=2, sp=True, pp=2, dp=2, zero=1),
    dict(moe="softmax", ep=1, etp=2, tp=1, pp=1, dp=2, zero=1),
]


# Plans placed on two simulated node groups (rt_cases.grouped_cpu_cluster: ranks 0-1 / 0-3 group a, the rest b)
# with uneven layers per group.
GROUP_CASES = [
    dict(tp=1, pp=2, dp=2, placement=("a", "b"), layers=(3, 1)),
    dict(tp=2, pp=4, dp=1, sp=True, placement=("a", "a", "b", "b"), layers=(2, 1, 1, 0), zero=0),
    # every pipeline rank's dp replicas split over both groups: the dp x cp collectives hierarchical
    # (runtime/parallel/hierarchy.py), under ZeRO-0 (padded all-reduce), ZeRO-1 (owned slices in hierarchy order)
    # and ZeRO-3 (parameters gathered through it)
    dict(tp=1, pp=1, dp=4, placement=("a+b",), bucket_params=2999),
    dict(tp=1, pp=1, dp=4, placement=("a+b",), zero=1, dp_overlap=True),
    dict(tp=2, pp=1, dp=2, sp=True, placement=("a+b",), zero=3),
    # groups of 4 and 2 ranks: the replicas in three shares, two on a (a+a+b)
    dict(tp=1, pp=1, dp=6, placement=("a+a+b",), groups=(4, 2), zero=1, global_batch=12),
]

ALL = CASES + MOE_CASES + MOE_EP_CASES + GROUP_CASES


@pytest.mark.parametrize("case", ALL, ids=[_id(c) for c in ALL])
def test_plan_matches_single_process(pool, tokens64, case):
    plan = case_plan(case)
    results = pool.run("rt_cases:equivalence", case, tokens64)
    ref = reference_run(plan, tokens64)
    losses = results[0]["losses"]
    assert len(losses) == len(ref["losses"]) == 3
    split = any("+" in e for e in case.get("placement", ()))
    assert all(r["hierarchical"] == split for r in results if r is not None)
    assert all(r["misaligned"] == 0 for r in results if r is not None)  # runtime/parallel/buckets.py, ALIGN
    for got, want in zip(losses, ref["losses"]):
        assert abs(got - want) <= TOL * abs(want), (losses, ref["losses"])
    assert ref["losses"][2] < ref["losses"][0]  # the reference itself learns
    # the gradient norm clipping reads (and the metrics report) is the whole gradient's, however the plan slices it
    assert abs(results[0]["grad_norm"] - ref["grad_norm"]) <= 1e-6 * ref["grad_norm"], (results[0], ref["grad_norm"])
    grads = merge(results, "grads")
    tied_copy = plan.model.tie_embeddings and plan.config.pp > 1
    assert set(grads) == set(ref["grads"]) | ({"head.out.weight"} if tied_copy else set())
    for name, g in grads.items():
        want = ref["grads"]["embed.tok.weight" if tied_copy and name == "head.out.weight" else name]
        assert g.shape == want.shape, name
        assert rel_err(g, want) <= TOL, (name, rel_err(g, want))


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_overlap_decomposes_every_layer_collective(pool, tokens64, tp):
    """With tp_overlap each layer's two all-gathers and two reduce-scatters, forward and backward, run as tp - 1
    ring passes beside the GEMM pieces instead of one collective; the embedding's and the head's stay whole.
    The loss is the non-overlapped plan's."""
    case = dict(tp=tp, pp=1, dp=1, sp=True, recompute="none", arch="gpt", steps=1)
    plain = pool.run("rt_cases:tp_collectives", case, tokens64)[0]
    ovl = pool.run("rt_cases:tp_collectives", {**case, "tp_overlap": True}, tokens64)[0]
    per_layer = 2 * 2 * 2 * case_spec(case).num_layers * plain["microbatches"]  # (AG, RS) x 2, fwd and bwd
    assert plain["ring"] == 0
    assert ovl["ring"] == per_layer * (tp - 1)
    assert plain["gather"] + plain["scatter"] - (ovl["gather"] + ovl["scatter"]) == per_layer
    assert ovl["gather"] + ovl["scatter"] > 0  # embedding and head
    assert abs(ovl["loss"] - plain["loss"]) <= TOL * abs(plain["loss"])


@pytest.mark.parametrize("parts,eager", [(2, False), (4, False), (2, True)], ids=["2", "4", "2-eager"])
def test_hierarchical_collectives_equal_the_flat_ones(pool, parts, eager):
    """A dp group of 8 ranks split over 2 or 4 node groups: the hierarchical all-reduce (sizes the inner groups do
    not divide), reduce-scatter (in place, each rank its owned slice) and all-gather, several in flight at once
    (chains of different lengths in one queue) and waited out of order, give the flat collectives' results; each rank
    owns a different slice. ``eager``: every step issued at once, as on GPUs."""
    results = pool.run("rt_cases:hierarchy_collectives", parts, eager)
    assert sorted(r["owned"] for r in results) == list(range(8))
    for r in results:
        assert max(r["all_reduce"], r["reduce_scatter"], r["all_gather"]) < 1e-5, r
