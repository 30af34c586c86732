"""Every plan computes what one process computes: gradients after step 1 and losses over 3 steps within 1e-5.

The plans form a covering set: every value of tp {1,2,4}, pp {1,2}, dp {1,2}, sp, schedule (1F1B /
interleaved), recompute {none, selective, full}, ZeRO {0,1}, arch {llama, gpt} and tied embeddings, and
every pair of them, appears (where the pair can run in 8 ranks and means something: sp needs tp > 1, ZeRO-1
needs dp > 1, interleaving needs pp > 1).
"""

from __future__ import annotations

import itertools

import pytest
from rt_cases import case_plan
from rt_reference import merge, reference_run, rel_err

TOL = 1e-5

FACTORS = {
    "tp": [1, 2, 4], "pp": [1, 2], "dp": [1, 2], "sp": [False, True], "sched": ["1f1b", "interleaved"],
    "recompute": ["none", "selective", "full"], "zero": [0, 1], "arch": ["llama", "gpt"], "tied": [False, True],
}

_C = ("tp", "pp", "dp", "sp", "sched", "recompute", "zero", "arch", "tied")
CASES = [dict(zip(_C, v)) for v in [
    (1, 1, 1, False, "1f1b", "none", 0, "llama", False),
    (2, 2, 2, True, "interleaved", "none", 1, "gpt", True),
    (4, 1, 1, True, "1f1b", "selective", 0, "gpt", True),
    (1, 2, 2, False, "interleaved", "selective", 1, "llama", False),
    (2, 2, 1, False, "interleaved", "full", 0, "llama", True),
    (4, 1, 2, True, "1f1b", "full", 1, "gpt", False),
    (2, 1, 2, True, "1f1b", "selective", 0, "llama", False),
    (1, 2, 1, False, "1f1b", "full", 0, "gpt", True),
    (4, 2, 1, False, "interleaved", "none", 0, "llama", True),
]]
# Extras: 1F1B over 2 stages with dp and mbs 2, uneven stages with partial recompute, a first stage holding
# nothing but the embedding, a vocabulary that tp does not divide (padded shards), GPT with flash attention
# and overlapped DP.
CASES += [
    dict(tp=2, pp=2, dp=2, sp=False, sched="1f1b", recompute="none", zero=0, arch="gpt", mbs=2, dp_overlap=True),
    dict(tp=2, pp=2, dp=1, sp=True, sched="1f1b", recompute="full", recompute_layers=1, arch="llama",
         layers=(1, 3), tied=True),
    dict(tp=1, pp=2, dp=1, sp=False, sched="1f1b", recompute="none", zero=0, arch="gpt", layers=(0, 4)),
    dict(tp=4, pp=1, dp=2, sp=True, sched="1f1b", recompute="none", zero=1, arch="llama", vocab=66,
         dp_overlap=True),
    dict(tp=2, pp=1, dp=2, sp=False, sched="1f1b", recompute="selective", zero=1, arch="gpt", attention="flash",
         dp_overlap=True),
]


def _feasible(c: dict) -> bool:
    return (c["tp"] * c["pp"] * c["dp"] <= 8 and not (c["sched"] == "interleaved" and c["pp"] == 1)
            and not (c["sp"] and c["tp"] == 1) and not (c["zero"] and c["dp"] == 1))


def test_cases_cover_every_pair():
    names = list(FACTORS)
    every = [dict(zip(names, v)) for v in itertools.product(*FACTORS.values())]
    needed = {(a, c[a], b, c[b]) for c in every if _feasible(c) for a, b in itertools.combinations(names, 2)}
    have = {(a, c.get(a, 0), b, c.get(b, 0)) for c in CASES for a, b in itertools.combinations(names, 2)}
    assert not needed - have, sorted(needed - have)[:5]
    assert all(_feasible({**dict.fromkeys(names, 0), **c}) for c in CASES)


def _id(c: dict) -> str:
    return "-".join(f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in c.items()
                    if k not in ("sched", "arch", "recompute") or v not in ("1f1b", "none")).replace(" ", "")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_plan_matches_single_process(pool, tokens64, case):
    plan = case_plan(case)
    results = pool.run("rt_cases:equivalence", case, tokens64)
    ref = reference_run(plan, tokens64)
    losses = results[0]["losses"]
    assert len(losses) == len(ref["losses"]) == 3
    for got, want in zip(losses, ref["losses"]):
        assert abs(got - want) <= TOL * abs(want), (losses, ref["losses"])
    assert ref["losses"][2] < ref["losses"][0]  # the reference itself learns
    grads = merge(results, "grads")
    tied_copy = plan.model.tie_embeddings and plan.config.pp > 1
    assert set(grads) == set(ref["grads"]) | ({"head.out.weight"} if tied_copy else set())
    for name, g in grads.items():
        want = ref["grads"]["embed.tok.weight" if tied_copy and name == "head.out.weight" else name]
        assert g.shape == want.shape, name
        assert rel_err(g, want) <= TOL, (name, rel_err(g, want))
