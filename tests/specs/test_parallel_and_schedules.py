"""Plan keys, validation of configurations, and the pipeline schedule tables."""

from __future__ import annotations

import itertools

import pytest

from specs.errors import AutoparError
from specs.model_loading import load_model
from specs.parallel import ParallelConfig, config_from_keys, parse_plan_keys
from specs.rules import PlanContext, check_plan
from specs.schedules import Action, Schedule, build_schedule, virtual_stage

GPT = load_model("gpt3-175b")


def test_parse_keys_types_and_dp_default():
    keys = parse_plan_keys("tp=8, pp=4,mbs=2,sp=true,recompute=selective,zero=1,dp_overlap=yes,layers=24/24/24/24")
    cfg = config_from_keys(keys, 1024)
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.mbs, cfg.sp, cfg.recompute, cfg.zero, cfg.dp_overlap) == \
        (8, 4, 32, 2, True, "selective", 1, True)
    assert cfg.layers == (24, 24, 24, 24)
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert config_from_keys(parse_plan_keys(cfg.as_keys()), 1024) == cfg


@pytest.mark.parametrize("text,needle", [
    ("tp=8,pp", "is not key=value"),
    ("tpp=8", "did you mean 'tp'"),
    ("tp=eight", "takes an integer"),
    ("sp=maybe", "takes true or false"),
    ("recompute=some", "recompute takes none, selective, full"),
    ("tp=2,tp=4", "given twice"),
    ("layers=1/x", "counts per stage"),
])
def test_bad_keys(text, needle):
    with pytest.raises(AutoparError, match=needle):
        parse_plan_keys(text)


@pytest.mark.parametrize("keys,gpus,batch,needle", [
    ("tp=5", 64, 64, "tp=5 does not divide the model's 96 attention heads"),
    ("tp=8,pp=8,dp=2", 64, 64, r"does not match 64 GPUs"),
    ("tp=8,pp=3", 64, 64, "not divisible by tp\\*pp\\*cp = 24"),
    ("tp=8,pp=8,mbs=3", 64, 64, "global batch 64 is not divisible by mbs=3, whatever dp"),
    ("tp=8,pp=4,mbs=4", 64, 60, "global batch 60 is not divisible by dp\\*mbs = 2\\*4"),
    ("tp=8,pp=8,vpp=3", 64, 36, "multiple of pp=8"),
    ("tp=8,vpp=2", 8, 8, "needs pp > 1"),
    ("tp=8,pp=8,layers=10/10/10/10/10/10/10/10", 64, 64, "must be non-negative and sum to 96"),
    ("tp=8,pp=8,layers=48/48", 64, 64, "has 2 entries"),
    ("tp=8,tp_overlap=true", 8, 8, "tp_overlap=true needs sp=true"),
    ("tp=8,cp=2", 16, 16, "cp > 1 needs attention: flash"),
    ("tp=8,recompute_layers=2", 8, 8, "needs recompute=full"),
    ("tp=16", 16, 16, "spans 2 nodes .* --allow-cross-node-tp"),
    ("tp=12", 24, 24, "would straddle nodes of 8 GPUs"),
])
def test_invalid_configs_say_why(keys, gpus, batch, needle):
    with pytest.raises(AutoparError, match=needle):
        cfg = config_from_keys(parse_plan_keys(keys), gpus)
        check_plan(cfg, PlanContext(GPT, gpus, batch, 8))


def test_cross_node_tensor_parallelism_only_when_allowed():
    """Whole nodes may form one tensor-parallel group when allowed; a group straddling a node boundary, or
    overlapping its collectives (userbuffers over NVLink) across nodes, never."""
    across, inside = PlanContext(GPT, 32, 32, 8, tp_across_nodes=True), PlanContext(GPT, 32, 32, 8)
    ok = config_from_keys(parse_plan_keys("tp=16,sp=true"), 32)
    check_plan(ok, across)
    with pytest.raises(AutoparError, match="spans 2 nodes"):
        check_plan(ok, inside)
    with pytest.raises(AutoparError, match="straddle nodes of 8 GPUs; use a tp that divides 8 or a multiple of 8"):
        check_plan(config_from_keys(parse_plan_keys("tp=12"), 24), PlanContext(GPT, 24, 24, 8, tp_across_nodes=True))
    with pytest.raises(AutoparError, match="tp_overlap=true needs the tensor-parallel group inside a node"):
        check_plan(config_from_keys(parse_plan_keys("tp=16,sp=true,tp_overlap=true"), 32), across)
    # inside one node nothing changes
    check_plan(config_from_keys(parse_plan_keys("tp=8,sp=true,tp_overlap=true"), 8), PlanContext(GPT, 8, 8, 8))


def test_stage_layers_even_and_remainder():
    cfg = ParallelConfig(pp=4)
    assert cfg.stage_layers(96) == (24, 24, 24, 24)
    uneven = cfg.stage_layers(98)
    assert sum(uneven) == 98 and uneven[0] == uneven[-1] == 24  # extras go to the middle stages
    assert ParallelConfig(pp=4, vpp=3).stage_layers(96) == (8,) * 12


def test_recompute_layers_per_stage():
    cfg = ParallelConfig(pp=2, recompute="full", recompute_layers=(3, 1))
    assert cfg.recomputed_layers(0, 4) == 3 and cfg.recomputed_layers(1, 4) == 1
    assert ParallelConfig(recompute="full").recomputed_layers(0, 7) == 7
    assert ParallelConfig(recompute="selective").recomputed_layers(0, 7) == 0


# ---- schedules ------------------------------------------------------------------------------------
def check_schedule(sched: Schedule, pp: int, vpp: int, m: int) -> None:
    """Raise ValueError if the table is incomplete or would deadlock (replay with unit durations)."""
    want = {(k, i, c) for k in "FB" for i in range(m) for c in range(vpp)}
    for r, acts in enumerate(sched):
        if sorted(set(acts)) != sorted(acts) or set(acts) != {Action(*a) for a in want}:
            raise ValueError(f"rank {r}: every F and B of every micro-batch and chunk must appear exactly once")
    done: set[tuple[str, int, int]] = set()  # (kind, mb, vstage)
    ptr = [0] * pp
    nv = pp * vpp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while ptr[r] < len(sched[r]):
                a = sched[r][ptr[r]]
                v = virtual_stage(r, a.chunk, pp)
                if a.kind == "F":
                    ready = v == 0 or ("F", a.microbatch, v - 1) in done
                else:
                    ready = ("F", a.microbatch, v) in done and (v == nv - 1 or ("B", a.microbatch, v + 1) in done)
                if not ready:
                    break
                done.add((a.kind, a.microbatch, v))
                ptr[r] += 1
                progress = True
    stuck = [r for r in range(pp) if ptr[r] < len(sched[r])]
    if stuck:
        r = stuck[0]
        raise ValueError(f"schedule deadlocks: rank {r} waits at {sched[r][ptr[r]]}")


@pytest.mark.parametrize("pp,vpp,m", [(p, v, m) for p, v, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 3), (1, 2, 4, 8, 12))
                                      if not (v > 1 and (p == 1 or m % p))])
def test_schedules_complete_and_deadlock_free(pp, vpp, m):
    check_schedule(build_schedule(pp, vpp, m), pp, vpp, m)


def test_1f1b_warmup_and_inflight():
    pp, m = 4, 8
    sched = build_schedule(pp, 1, m)
    for r, acts in enumerate(sched):
        warm = 0
        while acts[warm].kind == "F":
            warm += 1
        assert warm == min(pp - r, m)  # pp - r - 1 warm-up forwards, then the steady-state forward
        inflight = peak = 0
        for a in acts:
            inflight += 1 if a.kind == "F" else -1
            peak = max(peak, inflight)
        assert peak == min(pp - r, m)


def test_interleaved_matches_megatron_definition():
    """Forward k runs chunk (k // pp) % v on micro-batch (k // (pp v)) pp + k % pp; backwards mirror it."""
    pp, v, m = 4, 2, 8
    sched = build_schedule(pp, v, m)
    for r, acts in enumerate(sched):
        fwd = [a for a in acts if a.kind == "F"]
        bwd = [a for a in acts if a.kind == "B"]
        for k, a in enumerate(fwd):
            assert (a.chunk, a.microbatch) == ((k // pp) % v, (k // (pp * v)) * pp + k % pp)
        for k, a in enumerate(bwd):
            assert (a.chunk, a.microbatch) == (v - 1 - (k // pp) % v, (k // (pp * v)) * pp + k % pp)
        warm = next(i for i, a in enumerate(acts) if a.kind == "B") - 1
        assert warm == min((pp - r - 1) * 2 + (v - 1) * pp, m * v)


def test_check_schedule_detects_deadlock():
    sched = build_schedule(2, 1, 2)
    bad = [list(sched[0]), list(reversed(sched[1]))]  # last rank starts with a backward it cannot run
    with pytest.raises(ValueError, match="deadlock"):
        check_schedule(bad, 2, 1, 2)
    with pytest.raises(ValueError, match="exactly once"):
        check_schedule([sched[0][:-1], sched[1]], 2, 1, 2)


def test_one_recompute_count_per_stage_all_equal_is_that_count():
    """The search's per-stage counts that are all one count are that count: one plan, one form in plan and estimate
    JSON ([31] and 31 read as two plans); counts that differ, or of another length (a mistake), stay as given."""
    one = ParallelConfig(pp=2, recompute="full", recompute_layers=(3, 3))
    assert one == ParallelConfig(pp=2, recompute="full", recompute_layers=3) and one.to_dict()["recompute_layers"] == 3
    assert ParallelConfig(pp=2, recompute="full", recompute_layers=(3, 2)).recompute_layers == (3, 2)
    assert ParallelConfig(pp=2, recompute="full", recompute_layers=(3, 3, 3)).recompute_layers == (3, 3, 3)
