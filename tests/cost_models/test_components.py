"""Cost-model components against closed forms written out independently here."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from cost_models import pipeline
from cost_models.comm import CommModel
from cost_models.compute import ComputeModel
from cost_models.memory import layer_activation_bytes, state_bytes
from cost_models.pipeline import (
    STEADY_FROM,
    _extended,
    closed_form,
    peak_inflight_bytes,
    replayed,
    simulate,
    simulate_steps,
    steady_m,
    table_replay,
    wave_replay,
)
from cost_models.step import estimate
from specs.cluster import GemmPoint
from specs.cluster_loading import load_cluster, load_gpu
from specs.model import ModelSpec
from specs.model_loading import load_model
from specs.parallel import Candidates, ParallelConfig
from specs.schedules import build_schedule, virtual_stage
from specs.state import StateSpec


# ---- pipeline simulation ----------------------------------------------------------------------------
def _reference_makespan(sched, fwd, bwd, pp):
    """Fixed-point iteration over start times (independent of the work-queue simulator)."""
    nv = len(fwd)
    end = {}
    changed = True
    while changed:
        changed = False
        for r, acts in enumerate(sched):
            t = 0.0
            for kind, mb, ch in acts:
                v = virtual_stage(r, ch, pp)
                dep_key = ("F", mb, v - 1) if kind == "F" else ("B", mb, v + 1)
                has_dep = (kind == "F" and v > 0) or (kind == "B" and v < nv - 1)
                dep = end.get(dep_key, float("inf")) if has_dep else 0.0
                start = max(t, dep)
                t = start + (fwd[v] if kind == "F" else bwd[v])
                if end.get((kind, mb, v)) != t:
                    end[(kind, mb, v)] = t
                    changed = True
    return max(end.values())


@pytest.mark.parametrize("pp,vpp,m", [(1, 1, 4), (2, 1, 5), (4, 1, 8), (4, 2, 8), (3, 3, 6), (8, 1, 3)])
def test_uniform_pipeline_time(pp, vpp, m):
    f, b = 1.0, 2.0
    res = simulate(build_schedule(pp, vpp, m), [f] * (pp * vpp), [b] * (pp * vpp), pp)
    chunk = f + b
    expected = (m * vpp + pp - 1) * chunk if m >= pp or vpp == 1 else None
    if m < pp:  # fewer micro-batches than stages: fill, then drain, no steady state
        expected = (m + pp - 1) * chunk
    assert res.makespan == pytest.approx(expected)
    assert max(res.rank_busy) == pytest.approx(m * vpp * chunk)


@pytest.mark.parametrize("seed", range(6))
def test_simulation_matches_reference_on_random_stages(seed):
    rnd = random.Random(seed)
    pp = rnd.choice([2, 3, 4])
    vpp = rnd.choice([1, 2])
    m = pp * rnd.choice([1, 2, 3])
    nv = pp * vpp
    fwd = [rnd.uniform(0.5, 2.0) for _ in range(nv)]
    bwd = [2 * x * rnd.uniform(0.8, 1.2) for x in fwd]
    sched = build_schedule(pp, vpp, m)
    assert simulate(sched, fwd, bwd, pp).makespan == pytest.approx(_reference_makespan(sched, fwd, bwd, pp))


@pytest.mark.parametrize("seed", range(4))
def test_the_replay_in_dependency_order_equals_the_replay_rank_by_rank_to_the_bit(seed):
    """simulate_steps' replay (each action once, in the cached dependency order) gives every field of the event
    replay exactly, busy times included; 1F1B with any micro-batch count, interleaved, fewer micro-batches than
    ranks."""
    rnd = random.Random(seed)
    for _ in range(40):
        pp, vpp = rnd.choice([1, 2, 3, 4, 5, 8]), rnd.choice([1, 2, 3])
        m = pp * rnd.randint(1, 6) + (rnd.randint(0, pp - 1) if vpp == 1 else 0)
        fwd = [rnd.uniform(0.5, 2.0) for _ in range(pp * vpp)]
        bwd = [2 * x * rnd.uniform(0.8, 1.2) for x in fwd]
        assert pipeline._replay(pp, vpp, m, tuple(fwd), tuple(bwd)) == simulate(build_schedule(pp, vpp, m), fwd, bwd, pp)


@pytest.mark.parametrize("pp,vpp,m", [(1, 1, 4), (4, 1, 3), (4, 1, 16), (4, 2, 8), (3, 3, 12), (8, 4, 16)])
def test_closed_form_is_exact_for_equal_stages(pp, vpp, m):
    nv = pp * vpp
    f, b = np.full((1, nv), 1.0 / vpp), np.full((1, nv), 2.0 / vpp)
    want = replayed(simulate(build_schedule(pp, vpp, m), f[0].tolist(), b[0].tolist(), pp))
    got = closed_form(f, b, pp, vpp, np.array([m]))
    assert got.rank_end == pytest.approx(want.rank_end)
    if vpp == 1:
        assert got.last_b_end == pytest.approx(want.last_b_end)


@pytest.mark.parametrize("seed", range(6))
def test_closed_form_one_f_one_b_close_to_the_replay(seed):
    """Uneven stages (more layers in the middle, heavy ends): within 3% of the replay."""
    rnd = random.Random(seed)
    pp = rnd.choice([2, 3, 4, 6, 8])
    m = rnd.choice([pp, 2 * pp, 4 * pp + 1])
    layers = np.full(pp, 4.0)
    layers[rnd.sample(range(1, pp - 1), k=max(0, pp - 2) // 2) if pp > 2 else []] += 1
    f = layers * 1.0
    f[0] += rnd.uniform(0, 1.0)
    f[-1] += rnd.uniform(0, 3.0)
    b = 2 * f
    want = simulate(build_schedule(pp, 1, m), f.tolist(), b.tolist(), pp).makespan
    got = closed_form(f[None], b[None], pp, 1, np.array([m])).rank_end.max()
    assert got == pytest.approx(want, rel=0.03)


@pytest.mark.parametrize("seed", range(6))
def test_wave_replay_equals_the_replay(seed):
    """Many candidates at once; exact up to two pipeline groups of micro-batches, extended linearly beyond."""
    rnd = np.random.default_rng(seed)
    pp, vpp = int(rnd.choice([2, 3, 4])), int(rnd.choice([1, 2, 3]))
    nv = pp * vpp
    m = np.array([pp, 2 * pp, 5 * pp, 2 * pp])
    chunk = rnd.uniform(1, 2, vpp)  # chunks of unequal size on every rank
    f = np.repeat(chunk, pp)[None, :] * rnd.uniform(0.95, 1.05, (len(m), nv))
    b = 2 * f
    got = wave_replay(f, b, pp, vpp, m)
    for i in range(len(m)):
        want = replayed(simulate_steps(pp, vpp, int(m[i]), f[i].tolist(), b[i].tolist()))
        rel = 1e-9 if m[i] <= 2 * pp else 0.03
        assert got.rank_end[i] == pytest.approx(want.rank_end[0], rel=rel)
        assert got.last_b_end[i] == pytest.approx(want.last_b_end[0], rel=rel)


@pytest.mark.parametrize("seed", range(4))
def test_table_replay_is_simulate_steps_to_the_bit(seed):
    """The exhaustive search's many-candidate replay gives each candidate exactly what the exact model's replay
    does, for chunks of unequal size and micro-batch counts both replayed whole and long enough to be extended."""
    rnd = np.random.default_rng(seed)
    pp, vpp = int(rnd.choice([2, 3, 4])), int(rnd.choice([1, 2]))
    nv = pp * vpp
    long = (3 * max(STEADY_FROM, 8 * pp) // pp + 2) * pp  # past the full replays, a multiple of pp
    assert steady_m(pp, long) != long
    m = np.array([pp, 3 * pp, pp, 7 * pp, long, long + pp])
    f = rnd.uniform(0.5, 2.0, (len(m), nv))
    b = f * rnd.uniform(1.5, 2.5, (len(m), nv))
    got = table_replay(f, b, pp, vpp, m)
    for i in range(len(m)):
        want = replayed(simulate_steps(pp, vpp, int(m[i]), f[i].tolist(), b[i].tolist()))
        for k in ("rank_end", "last_b_start", "last_b_end"):
            assert np.array_equal(getattr(got, k)[i], getattr(want, k)[0]), (i, k)


def test_table_replay_of_long_batches_extends_only_where_simulate_steps_does():
    """Past the full replays, a candidate whose pipeline has settled is extended linearly and one that has not (an
    interleaved pipeline paced by a cycle through several ranks) is replayed in full, as simulate_steps decides."""
    rnd = np.random.default_rng(1)
    pp, vpp = 4, 2
    m = (3 * max(STEADY_FROM, 8 * pp) // pp + 2) * pp
    f, b = rnd.uniform(0.01, 2, (24, pp * vpp)), rnd.uniform(0.01, 2, (24, pp * vpp))
    settled = [_extended(pp, vpp, m, steady_m(pp, m), fi.tolist(), bi.tolist()) is not None for fi, bi in zip(f, b)]
    assert any(settled) and not all(settled)
    got = table_replay(f, b, pp, vpp, np.full(len(f), m))
    for i in range(len(f)):
        want = replayed(simulate_steps(pp, vpp, m, f[i].tolist(), b[i].tolist()))
        for k in ("rank_end", "last_b_start", "last_b_end"):
            assert np.array_equal(getattr(got, k)[i], getattr(want, k)[0]), (i, k)


def test_bubble_shrinks_with_more_microbatches_and_interleaving():
    def bubble(pp, vpp, m):
        nv = pp * vpp
        r = simulate(build_schedule(pp, vpp, m), [1.0 / vpp] * nv, [2.0 / vpp] * nv, pp)
        return 1 - max(r.rank_busy) / r.makespan

    assert bubble(4, 1, 16) < bubble(4, 1, 8) < bubble(4, 1, 4)
    assert bubble(4, 2, 8) < bubble(4, 1, 8)
    assert bubble(4, 1, 8) == pytest.approx(3 / (8 + 3))  # (p-1)/(m+p-1)


def test_peak_inflight_follows_the_table():
    pp, m = 4, 8
    peaks = peak_inflight_bytes(pp, 1, m, np.full((1, pp), 10.0))
    assert peaks[0].tolist() == [40.0, 30.0, 20.0, 10.0]
    # interleaved: rank 0 holds (2(p-1) + (v-1)p + 1) chunks at its peak (Megatron's warm-up + 1)
    pp, v = 4, 2
    peaks = peak_inflight_bytes(pp, v, 8, np.ones((1, pp * v)))
    assert peaks[0, 0] == 2 * (pp - 1) + (v - 1) * pp + 1


@pytest.mark.parametrize("pp,vpp,m", [(p, v, m) for p in (1, 2, 3, 5, 8) for v in (1, 2, 3) for m in (1, 3, 8, 16, 24, 48)
                                      if v == 1 or (p > 1 and m % p == 0)])
def test_peak_inflight_bytes_equal_the_table_replay(pp, vpp, m):
    """The in-flight vectors are read off the schedule's structure; the peaks equal replaying the table."""
    acts = np.random.default_rng(pp * 100 + vpp * 10 + m).uniform(0.5, 2.0, (3, pp * vpp))
    want = np.zeros((3, pp))
    for r, table in enumerate(build_schedule(pp, vpp, m)):
        held = np.zeros(3)
        for kind, _mb, ch in table:
            held = held + acts[:, virtual_stage(r, ch, pp)] * (1 if kind == "F" else -1)
            want[:, r] = np.maximum(want[:, r], held)
    assert peak_inflight_bytes(pp, vpp, m, acts) == pytest.approx(want, rel=1e-12)


def _same_result(fast, full):
    approx = {"rel": 1e-9}
    assert fast.makespan == pytest.approx(full.makespan, **approx)
    assert fast.rank_end == pytest.approx(full.rank_end, **approx)
    assert fast.rank_busy == pytest.approx(full.rank_busy, **approx)
    assert fast.first_b_start == pytest.approx(full.first_b_start, **approx)
    for mine, theirs in zip(fast.last_b, full.last_b):
        for a, b in zip(mine, theirs):
            assert a == pytest.approx(b, **approx)


@pytest.mark.parametrize("seed", range(8))
def test_long_pipelines_extrapolate_exactly(seed, monkeypatch):
    """With many micro-batches the step is priced from three shorter replays; every field equals the full
    replay's (random, uneven stages with one clearly slowest; 1F1B and interleaved; m not a multiple of the
    group for 1F1B)."""
    monkeypatch.setattr(pipeline, "STEADY_FROM", 8)
    rnd = random.Random(seed)
    pp, vpp = rnd.choice([2, 3, 4, 5]), rnd.choice([1, 2, 3])
    base = max(8, 8 * pp)
    m = 3 * base + pp * rnd.randint(1, 6) + (rnd.randint(1, pp - 1) if vpp == 1 else 0)
    assert pipeline.steady_m(pp, m) < m
    nv = pp * vpp
    fwd = [rnd.uniform(0.5, 1.0) for _ in range(nv)]
    bwd = [2 * x * rnd.uniform(0.9, 1.1) for x in fwd]
    slow = rnd.randrange(pp)  # one rank clearly the bottleneck: its chunks 60% heavier
    for c in range(vpp):
        fwd[c * pp + slow] *= 1.6
        bwd[c * pp + slow] *= 1.6
    full = simulate(build_schedule(pp, vpp, m), fwd, bwd, pp)
    replays, replay = [], pipeline._replay
    monkeypatch.setattr(pipeline, "_replay", lambda pp, vpp, k, *a: replays.append(k) or replay(pp, vpp, k, *a))
    fast = simulate_steps(pp, vpp, m, fwd, bwd)
    assert len(replays) == 3 and max(replays) < m  # three short replays, no fallback to the full one
    _same_result(fast, full)
    # the peak activations (priced from the representative count) are those of the full table
    acts = [rnd.uniform(1.0, 3.0) for _ in range(nv)]
    want = []
    for r, table in enumerate(build_schedule(pp, vpp, m)):
        held = peak = 0.0
        for kind, _mb, ch in table:
            held += acts[virtual_stage(r, ch, pp)] * (1 if kind == "F" else -1)
            peak = max(peak, held)
        want.append(peak)
    assert peak_inflight_bytes(pp, vpp, m, np.array([acts]))[0] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("m", [4000, 20000])
def test_slowly_settling_pipelines_are_replayed_in_full(m):
    """Two near-equal stages, the slightly slower one starting first: the short replays look linear but the
    pipeline has not settled; the result must still be the full replay's."""
    pp, fwd, bwd = 4, [1.5004, 0.814, 1.5, 0.832], [2.4999, 2.0, 2.5, 2.0]
    _same_result(simulate_steps(pp, 1, m, fwd, bwd), simulate(build_schedule(pp, 1, m), fwd, bwd, pp))


# ---- memory ------------------------------------------------------------------------------------------
GPT22 = ModelSpec(name="22b", arch="gpt", num_layers=48, hidden_size=6144, num_attention_heads=64,
                  vocab_size=51200, seq_length=2048)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("b", [1, 4])
def test_korthikanti_activation_formulas(t, b):
    s, h, a = GPT22.seq_length, GPT22.hidden_size, GPT22.num_attention_heads
    sbh = s * b * h

    def acts(sp, rc):
        full, ckpt, _ = layer_activation_bytes(GPT22, 2, t, 1, b, sp, rc)
        return float(ckpt if rc == 2 else full)

    assert acts(False, 0) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert acts(False, 1) == pytest.approx(sbh * (10 + 24 / t))
    assert acts(False, 2) == pytest.approx(2 * sbh)
    if t > 1:
        assert acts(True, 0) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
        assert acts(True, 1) == pytest.approx(34 * sbh / t)
    else:
        assert acts(False, 0) == pytest.approx(sbh * (34 + 5 * a * s / h))


def test_llama_flash_activations_have_no_quadratic_term():
    m = load_model("llama2-7b")
    full1, _, _ = layer_activation_bytes(m, 2, 1, 1, 1, False, 0)
    m2 = m.with_seq(2 * m.seq_length)
    full2, _, _ = layer_activation_bytes(m2, 2, 1, 1, 1, False, 0)
    assert float(full2) == pytest.approx(2 * float(full1))  # linear in sequence length
    # context parallelism divides the tokens each GPU holds
    full_cp, _, _ = layer_activation_bytes(m2, 2, 1, 2, 1, False, 0)
    assert float(full_cp) == pytest.approx(float(full1))


def test_state_bytes_per_parameter():
    bf16 = StateSpec.default("bf16")  # bf16 weights, fp32 gradients, fp32 master + Adam moments
    for zero, d, want in [(0, 8, 18), (1, 8, 6 + 12 / 8), (2, 8, 2 + 16 / 8), (3, 8, 18 / 8), (1, 1, 18)]:
        st = state_bytes(1.0, zero, d, bf16)
        assert float(st.weights + st.grads + st.optimizer) == pytest.approx(want)
    st = state_bytes(1.0, 0, 1, StateSpec.default("fp32"))
    assert float(st.weights + st.grads + st.optimizer) == 16
    st = state_bytes(1.0, 0, 1, StateSpec.default("fp16"))  # fp32 gradients held, reduced in fp16
    assert float(st.weights + st.grads + st.optimizer) == 18


# ---- communication ------------------------------------------------------------------------------------
def test_ring_collectives_inside_a_node():
    c = CommModel(load_cluster("dgx-a100"))
    bw, alpha = 300e9 * 0.8, 3e-6  # NVLink bus bandwidth at 80%, 3 us per hop
    n, S = 8, 1e9
    # alpha-beta ring: (n-1) hops and (n-1)/n of the data per pass; all-reduce is two passes
    assert float(c.all_reduce(S, n)) == pytest.approx(2 * ((n - 1) * alpha + (n - 1) / n * S / bw), rel=1e-6)
    assert float(c.all_gather(S, n)) == pytest.approx((n - 1) * alpha + (n - 1) / n * S / bw, rel=1e-6)
    assert float(c.reduce_scatter(S, n)) == pytest.approx(float(c.all_gather(S, n)))
    assert float(c.all_reduce(S, 1)) == 0.0


def test_group_placement_and_nic_bottleneck():
    cl = load_cluster("dgx-a100", gpus=64)
    c = CommModel(cl)
    k, nodes = c.placement(8, 1)  # a tensor-parallel group: one node
    assert (float(k), float(nodes)) == (8, 1)
    k, nodes = c.placement(8, 8)  # a data-parallel group with tp=8: one GPU per node
    assert (float(k), float(nodes)) == (1, 8)
    S = 4e9
    nic = 25e9 * 0.8  # one 200 Gb/s NIC per GPU at 80% bus efficiency
    assert float(c.all_reduce(S, 8, 8)) == pytest.approx(2 * 7 / 8 * S / nic, rel=1e-4)  # latency negligible
    # the same data-parallel reduce over half the NICs takes twice as long
    half = CommModel(load_cluster("a100-4x200g", gpus=64))
    assert float(half.all_reduce(S, 8, 8)) == pytest.approx(2 * float(c.all_reduce(S, 8, 8)), rel=1e-3)


def test_a_measured_inter_node_fit_is_one_members_share():
    """`autopar profile` measures across nodes with one rank a node (every rank of the node at once), so its fit is
    one GPU's share: a data-parallel ring with k members a node moves k shares, up to NVLink's bandwidth, as the
    analytic model's min(intra, k x NIC) does; one member a node gets the fit itself."""
    from specs.cluster import CollectiveFit

    cl = load_cluster("dgx-a100", gpus=64)
    fit = CollectiveFit(alpha_us=0.0, busbw_GBps=40.0)
    c = CommModel(cl.model_copy(update={"collectives": {"all_gather": {"inter": fit}}}))
    S = 4e9
    one = float(c.all_gather(S, 8, 8))  # tp=8: one member a node
    assert one == pytest.approx(7 / 8 * S / 40e9, rel=1e-9)
    two = float(c.all_gather(S, 16, 4))  # tp=4: two members a node, 8 nodes
    assert two == pytest.approx(15 / 16 * S / 80e9, rel=1e-9)
    full = float(c.all_gather(S, 64, 1))  # every GPU: 8 shares (320 GB/s) would pass NVLink's 240 GB/s
    assert c.bw_intra == pytest.approx(240e9) and full == pytest.approx(63 / 64 * S / 240e9, rel=1e-9)


def test_a_fabric_measured_by_node_count_slows_as_groups_span_more_nodes():
    """busbw_by_nodes: the measured share at each node count, log-log interpolated between them and the nearest
    beyond; 2 nodes at 100 GB/s and 8 at 25 give 50 at 4 (halfway in log), 100 below 2 and 25 past 8."""
    from specs.cluster import CollectiveFit

    fit = CollectiveFit(alpha_us=0.0, busbw_GBps=999.0, busbw_by_nodes={8: 25.0, 2: 100.0})
    assert fit.busbw_at(np.array([2, 4, 8, 16])).tolist() == pytest.approx([100.0, 50.0, 25.0, 25.0])
    cl = load_cluster("dgx-a100", gpus=128)
    c = CommModel(cl.model_copy(update={"collectives": {"reduce_scatter": {"inter": fit}}}))
    S = 1e9
    times = [float(c.reduce_scatter(S, n, 8)) for n in (2, 4, 8, 16)]  # one member a node over 2..16 nodes
    assert times == pytest.approx([S * (n - 1) / n / (bw * 1e9) for n, bw in zip((2, 4, 8, 16), (100, 50, 25, 25))])
    with pytest.raises(ValueError):
        CollectiveFit(alpha_us=0.0, busbw_GBps=1.0, busbw_by_nodes={1: 5.0})  # a count of nodes, from 2


def test_buckets_pay_latency_each():
    c = CommModel(load_cluster("dgx-a100", gpus=512))
    one = float(c.reduce_scatter(1e9, 64, 8))
    many = float(c.bucketed(c.reduce_scatter, 1e9, 10, 64, 8))
    assert many > one
    assert many - one == pytest.approx(9 * (float(c.reduce_scatter(0.0, 64, 8))), rel=1e-6)


# ---- compute ------------------------------------------------------------------------------------------
def test_gemm_time_bounded_by_peak_and_efficiency():
    gpu = load_gpu("a100-sxm4-80gb")
    cm = ComputeModel(gpu, "bf16")
    M = N = K = 8192
    t = float(cm.gemm(M, N, K))
    achieved = 2 * M * N * K / t
    assert achieved <= gpu.peak("bf16") * gpu.efficiency.gemm
    assert achieved >= 0.85 * gpu.peak("bf16") * gpu.efficiency.gemm
    # skinny and short-K GEMMs run at lower efficiency
    assert 2 * 8192 * 128 * 8192 / float(cm.gemm(8192, 128, 8192)) < achieved
    assert 2 * 8192 * 8192 * 64 / float(cm.gemm(8192, 8192, 64)) < achieved


def test_the_profiles_gemm_tile_sets_the_wave_quantisation():
    """``efficiency.gemm_tile_m/n`` is the largest output tile: a GEMM of exactly one wave of 128 x 256 tiles runs
    at the full rate with the default tile, and with a 256 x 256 one takes the next tile (256 x 128, 0.93 of it)."""
    gpu = load_gpu("a100-sxm4-80gb")
    M, N, K = 128 * gpu.sm_count, 256, 4096
    default = float(ComputeModel(gpu, "bf16").gemm_rate(M, N, K))
    assert default == pytest.approx(gpu.peak("bf16") * gpu.efficiency.gemm * K / (K + gpu.efficiency.gemm_k_half))
    big = gpu.model_copy(update={"efficiency": gpu.efficiency.model_copy(update={"gemm_tile_m": 256})})
    assert float(ComputeModel(big, "bf16").gemm_rate(M, N, K)) == pytest.approx(0.93 * default)


def test_measured_gemm_table_overrides():
    gpu = load_gpu("a100-sxm4-80gb")
    table = [GemmPoint(m=4096, n=4096, k=4096, tflops=150.0), GemmPoint(m=8192, n=8192, k=8192, tflops=200.0)]
    cm = ComputeModel(gpu.model_copy(update={"gemm_table": table}), "bf16")
    for p in table:
        t = float(cm.gemm(p.m, p.n, p.k))
        assert 2 * p.m * p.n * p.k / t / 1e12 == pytest.approx(p.tflops, rel=0.02)


def test_flash_attention_time_scales_quadratically():
    cm = ComputeModel(load_gpu("h100-sxm5-80gb"), "bf16")
    f1, b1 = cm.flash_attention(16, 2048, 2048, 128, 0.5)
    f2, b2 = cm.flash_attention(16, 4096, 4096, 128, 0.5)
    o = cm.overhead  # fixed per-kernel cost
    assert (float(f2) - o) / (float(f1) - o) == pytest.approx(4, rel=1e-6)
    assert float(b1) > 2 * float(f1)
    assert np.isfinite(float(b2))


def test_flash_attention_reads_the_measured_rate_at_the_head_dim():
    """A measured table at head dims 64 and 128 (the profiler's GPU grid): each measured dim is priced at its own
    rate, a dim between them linearly in log(head dim), a dim outside at the nearest measured one."""
    from specs.cluster import AttentionPoint

    rates = {64: (300.0, 200.0), 128: (500.0, 400.0)}  # TFLOP/s forward, backward at both sequence lengths
    table = [AttentionPoint(seq=s, heads=16, head_dim=d, batch=1, fwd_tflops=f, bwd_tflops=b)
             for d, (f, b) in rates.items() for s in (1024, 4096)]
    cm = ComputeModel(load_gpu("h100-sxm5-80gb").model_copy(update={"attention_table": table}), "bf16")

    def measured_rates(d: float) -> tuple[float, float]:
        f, b = cm.flash_attention(8, 2048, 2048, d, 0.5)
        flops = 4.0 * 8 * 2048 * 2048 * d * 0.5
        return flops / float(f) / 1e12, 2.5 * flops / float(b) / 1e12

    assert measured_rates(64) == pytest.approx(rates[64])
    assert measured_rates(128) == pytest.approx(rates[128])
    assert measured_rates(2 ** 6.5) == pytest.approx((400.0, 300.0))  # halfway in log(head dim)
    assert measured_rates(32) == pytest.approx(rates[64])
    assert measured_rates(256) == pytest.approx(rates[128])


@pytest.mark.parametrize("gpus,cfg,shard_add", [(1, ParallelConfig(mbs=2), 0.0),
                                                 (2, ParallelConfig(mbs=2, dp=2, zero=2), 3 * 4 / 2)])
def test_gradient_accumulation_is_a_pass_per_micro_batch_unless_the_gemms_fuse_it(gpus, cfg, shard_add):
    """autopar's runtime adds each micro-batch's gradient (parameter precision) into the fp32 buffer: 2 + 2 x 4
    bytes per parameter at the elementwise bandwidth, plus under ZeRO-2 the owned slice's add (3 x 4 / d); a state
    with Megatron-LM's fused accumulation has no such pass, its GEMMs' epilogue reads and writes the fp32 buffer in
    place of a bf16 output (2 x 4 - 2 bytes). Priced in the backward, once per micro-batch."""
    model, cluster = load_model("llama-1b"), load_cluster("dgx-h100", gpus=gpus)
    plain = StateSpec.default("bf16")
    fused = plain.model_copy(update={"fused_accumulation": True})
    a, b = (estimate(model, cluster, cfg, 16, state=s) for s in (plain, fused))
    micro_batches = 16 // (cfg.mbs * cfg.dp)
    expected = micro_batches * model.num_params * ((2 + 2 * 4 + shard_add) - (2 * 4 - 2)) / cluster.gpu.ew_bw
    assert a.breakdown["backward_compute"] - b.breakdown["backward_compute"] == pytest.approx(expected, rel=1e-6)
    assert a.step_time_s - b.step_time_s == pytest.approx(expected, rel=1e-6)


def test_the_heads_memory_is_one_logits_chunk_of_the_fused_loss_or_the_whole_logits():
    """On GPUs autopar's fused loss holds one balanced chunk of at most 2^26 16-bit logits, an fp32 loss per token and
    the head's weight gradient; Megatron-LM's loss (a full-logits state) all the logits, in 16 bits and fp32;
    autopar's reference loss on CPUs three fp32 copies of them at its backward's peak."""
    from cost_models.stages import layer_terms

    model = load_model("llama-1b")  # V 32000, h 2048, seq 4096
    T, h, V = 2 * 4096, 2048, 32000
    plain = StateSpec.default("bf16")
    full = plain.model_copy(update={"full_logits": True})
    rows = 2048  # 2^26 // 32000 = 2097 rows at most: 4 chunks of 2048 (a multiple of 64)
    norm = T * h * (2 + 4)  # the final norm's input and its backward's fp32 working copy
    fused = 2 * 2 * T * h + norm + rows * V * 2 + 4 * T + V * h * 2
    whole = 2 * 2 * T * h + norm + T * (2 + 4) * V
    reference = 2 * 2 * T * h + norm + T * 3 * 4 * V  # the log-softmax's fp32 output and the two fp32 gradients
    c = Candidates.of(ParallelConfig(mbs=2))
    for cluster, state, expected in ((load_cluster("dgx-h100", gpus=1), plain, fused),
                                     (load_cluster("dgx-h100", gpus=1), full, whole),
                                     (load_cluster("cpu-gloo", gpus=1).model_copy(update={"precision": "bf16"}), plain,
                                      reference)):
        lt = layer_terms(model, ComputeModel(cluster.gpu, "bf16"), CommModel(cluster), c, state)
        assert float(lt.act_head[0]) == expected, cluster.name


def test_squared_relu_is_priced_as_the_passes_torch_runs():
    """The squared ReLU (Nemotron-4's MLP, run unfused as torch.pow(relu(x), 2) by Megatron-LM and the runtime) is
    priced at the element passes autograd really makes: counted here from the aten ops it dispatches (2 forward
    kernels, 4 passes; backward SQUARED_RELU_BWD_PASSES), and a GPT layer with it costs that much more memory time
    than with GeLU's one fused kernel each way (2 and 3 passes)."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from cost_models.layer import SQUARED_RELU_BWD_PASSES, layer_cost

    n = 4096

    class Passes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kernels = self.passes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            full = [a for a in (*args, out) if isinstance(a, torch.Tensor) and a.numel() == n]
            if full and func.__name__.split(".")[0] not in ("detach", "view", "alias", "empty_like", "ones_like"):
                self.kernels += 1
                self.passes += len(full)
            return out

    x = torch.randn(n, requires_grad=True)
    fwd = Passes()
    with fwd:
        y = torch.pow(F.relu(x), 2)
    bwd = Passes()
    g = torch.randn(n)
    with bwd:
        y.backward(g)
    assert (fwd.kernels, fwd.passes) == (2, 4)
    assert (bwd.kernels, bwd.passes) == (4, SQUARED_RELU_BWD_PASSES)

    gpu = load_gpu("h100-sxm5-80gb")
    cm, comm = ComputeModel(gpu, "bf16"), CommModel(load_cluster("dgx-h100", gpus=8))
    spec = dict(name="g", arch="gpt", num_layers=2, hidden_size=1024, num_attention_heads=16, vocab_size=1000,
                seq_length=2048, attention="flash", dropout=0.0)
    gelu = layer_cost(ModelSpec(**spec), cm, comm, 2, 1, 1, True, False)
    sq = layer_cost(ModelSpec(**spec, activation="squared_relu"), cm, comm, 2, 1, 1, True, False)
    ffw = 2048 * 4096 / 2
    eb = cm.eb
    np.testing.assert_allclose(sq.fwd - gelu.fwd, cm.memory(ffw * 4 * eb, 2) - cm.memory(ffw * 2 * eb))
    np.testing.assert_allclose(sq.bwd - gelu.bwd, cm.memory(ffw * 10 * eb, 4) - cm.memory(ffw * 3 * eb))
    nobias = layer_cost(ModelSpec(**spec, linear_bias=False), cm, comm, 2, 1, 1, True, False)
    assert np.all(nobias.bwd < gelu.bwd) and np.allclose(nobias.fwd, gelu.fwd)  # only the bias-gradient sums go


def test_a_gpt_with_rope_prices_the_rotation_and_no_learned_positions():
    """A GPT block given rotary_fraction runs RoPE (a pass over q and k each way, as Llama's, whatever share of the
    dimensions it rotates) and has no learned position embedding: no position parameters, no position add in the
    embedding's forward."""
    from cost_models.layer import end_cost, layer_cost

    gpu = load_gpu("h100-sxm5-80gb")
    cm, comm = ComputeModel(gpu, "bf16"), CommModel(load_cluster("dgx-h100", gpus=8))
    spec = dict(name="g", arch="gpt", num_layers=2, hidden_size=1024, num_attention_heads=8, vocab_size=1000,
                seq_length=2048, attention="flash", dropout=0.0)
    learned, half, full = (ModelSpec(**spec, **kw) for kw in ({}, {"rotary_fraction": 0.5}, {"rotary_fraction": 1.0}))
    assert (learned.rope_dims, half.rope_dims, full.rope_dims) == (0, 64, 128)
    assert learned.position_params == 2048 * 1024 and half.position_params == full.position_params == 0
    a, b = (layer_cost(m, cm, comm, 2, 1, 1, True, False) for m in (learned, half))
    T, qk = 2048, 1024 + 1024
    rope = cm.memory(T * qk / 2 * 2 * cm.eb)
    np.testing.assert_allclose(b.fwd - a.fwd, rope)
    np.testing.assert_allclose(b.bwd - a.bwd, rope)
    np.testing.assert_allclose(layer_cost(full, cm, comm, 2, 1, 1, True, False).fwd, b.fwd)
    e_learned, e_rope = (end_cost(m, cm, comm, 2, 1, 1, True) for m in (learned, half))
    assert float(e_rope.embed_f) < float(e_learned.embed_f)


def test_the_loss_is_priced_as_each_stack_runs_it():
    """Megatron's vocab-parallel cross-entropy over the whole logits (one kernel per torch op) is priced at the bytes
    its ops move, counted here from the aten ops a transcription of Megatron-Core v0.9's
    ``VocabParallelCrossEntropy`` steps dispatches on 16-bit logits (38 bytes a logit forward, 14 backward);
    Megatron-Core's compiled fusion moves fewer, autopar's fused loss fewest; and the head's time follows."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from cost_models.layer import end_cost, loss_traffic

    tokens, vocab = 64, 1000
    n = tokens * vocab

    class Bytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kernels = self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            given = (*args, *(v for k, v in kwargs.items() if k != "out"))  # out= is written, not read
            reads = [a for a in given if isinstance(a, torch.Tensor) and a.numel() == n]
            writes = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                      if isinstance(o, torch.Tensor) and o.numel() == n]
            # views move nothing; the targets' gather and update touch one logit a token
            small = ("view", "_unsafe_view", "detach", "alias", "index", "index_put_")
            if (reads or writes) and func.__name__.split(".")[0] not in small:
                self.kernels += 1
                self.bytes += sum(t.element_size() * t.numel() for t in (*reads, *writes))
            return out

    logits = torch.randn(tokens, vocab).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,))
    fwd = Bytes()
    with fwd:  # calculate_logits_max, calculate_predicted_logits, calculate_cross_entropy_loss
        x = logits.float()
        x_max = torch.max(x, dim=-1)[0]
        x -= x_max.unsqueeze(-1)
        predicted = x[torch.arange(tokens), target].clone()
        torch.exp(x, out=x)
        sum_exp = x.sum(dim=-1)
        loss = torch.log(sum_exp) - predicted
        x.div_(sum_exp.unsqueeze(-1))
    bwd = Bytes()
    with bwd:  # calculate_gradients, then autograd's cast of the fp32 gradient to the logits' dtype
        x[torch.arange(tokens), target] -= 1.0
        x.mul_(torch.ones(tokens).unsqueeze(-1))
        x.to(torch.bfloat16)
    assert loss.shape == (tokens,)
    fb, fk, bb, bk = loss_traffic(2, True, False, 8, vocab)
    assert (fwd.kernels, fwd.bytes) == (int(fk), int(fb) * n)
    assert (bwd.kernels, bwd.bytes) == (int(bk), int(bb) * n)

    cm = ComputeModel(load_gpu("h100-sxm5-80gb"), "bf16")
    comm = CommModel(load_cluster("dgx-h100", gpus=8))
    model = load_model("llama-1b")
    heads = [end_cost(model, cm, comm, 2, 1, 1, True, whole, fused)
             for whole, fused in ((False, False), (True, True), (True, False))]
    times = [float(e.head_f + e.head_b) for e in heads]
    assert times[0] < times[1] < times[2]
    unfused, fused = loss_traffic(2, True, False, 2, 16000), loss_traffic(2, True, True, 2, 16000)
    logits_per_rank = 4096 * 16000
    np.testing.assert_allclose(times[2] - times[1], cm.memory(logits_per_rank * (unfused[0] + unfused[2]),
                                                              unfused[1] + unfused[3])
                               - cm.memory(logits_per_rank * (fused[0] + fused[2]), fused[1] + fused[3]))
    one_block, two_reads = loss_traffic(2, False, False, 1, 32000), loss_traffic(2, False, False, 1, 50000)
    assert float(one_block[0]) == 4 and float(two_reads[0]) == 6  # read once or twice, write the gradient
    assert float(loss_traffic(2, False, False, 2, 16000)[1]) == 2  # vocab-parallel: statistics, then gradient


def test_the_fused_loss_makes_the_heads_gradients_in_its_forward():
    """autopar's chunked loss computes the LM head's input and weight gradients in its forward (its backward only
    scales them; kernels.py times its 'fwd' with them): those GEMMs are priced in the forward pass (the breakdown's
    forward_compute). A whole-logits loss (Megatron's, and the CPU ranks' reference loss) makes them in the
    backward."""
    from cost_models.layer import end_cost

    cm = ComputeModel(load_gpu("h100-sxm5-80gb"), "bf16")
    comm = CommModel(load_cluster("dgx-h100", gpus=1))
    model = load_model("llama-1b")
    T, h, V = model.seq_length, model.hidden_size, model.vocab_size
    lm_f, lm_b = (float(x) for x in cm.gemm_fwd_bwd(T, V, h))
    norm_b = float(cm.memory(T * h * 3 * 2, 2))
    ours, whole = end_cost(model, cm, comm, 1, 1, 1, False), end_cost(model, cm, comm, 1, 1, 1, False, True, False)
    assert float(ours.head_b) == pytest.approx(norm_b)  # no GEMM left in the backward
    assert float(ours.head_f) > lm_f + lm_b
    assert float(whole.head_b) > norm_b + lm_b


def test_loss_fusion_describes_a_loss_over_the_whole_logits():
    """``loss_fusion`` (Megatron-Core's compiled loss) says how a whole-logits loss runs: without ``full_logits`` it is
    refused with a message naming both; the runtime refuses a whole-logits state (its loss is chunked)."""
    from pydantic import ValidationError

    from specs.capabilities import state_problem

    base = StateSpec.default("bf16").model_dump()
    with pytest.raises(ValidationError, match="set full_logits=true with it"):
        StateSpec.model_validate({**base, "loss_fusion": True})
    both = StateSpec.model_validate({**base, "loss_fusion": True, "full_logits": True})
    assert both.loss_fusion and "full_logits=false" in state_problem(both)


def test_the_priced_ledger_of_zero_on_one_replica_is_zero_0s():
    """One data-parallel replica runs without ZeRO (the runtime's DataParallel): its priced communication is the
    ZeRO-0 plan's, collective for collective."""
    from cost_models.ledger import priced_ledger

    model, cluster = load_model("tiny"), load_cluster("cpu-gloo", gpus=4)
    state = StateSpec.default("fp32")
    for cfg in (ParallelConfig(tp=4), ParallelConfig(tp=2, pp=2, sp=True)):
        plain = priced_ledger(model, cluster, cfg, 16, state)
        for z in (1, 2, 3):
            assert priced_ledger(model, cluster, replace(cfg, zero=z), 16, state) == plain, (cfg, z)


def test_an_edge_view_prices_every_pipeline_send_as_a_send_between_the_groups():
    """``EdgeComm`` (a group's view whose pipeline sends all leave the group) prices a send, in or across its nodes,
    as the placed model prices one stage's send to the other group (``cross_send``), and its collectives as the
    view's own."""
    from cost_models.comm import EdgeComm
    from cost_models.placement import cross_send, link
    from specs.cluster_loading import load_cluster

    c = load_cluster("a100-l40s-mixed")
    view = c.group_view("a100")
    edge, own = EdgeComm(view, *link(c, ("a100", "l40s"))), CommModel(view)
    act, t = 64e6, 2
    across = cross_send(c, "a100", "l40s", act, t, True, CommModel(c.group_view("l40s")))
    np.testing.assert_allclose(edge.p2p(np.array([act / t] * 2), np.array([False, True])), [across] * 2)
    assert own.p2p(act / t, True) < across  # (the link between the groups is the narrower)
    assert edge.all_reduce(1e9, 8, 1) == own.all_reduce(1e9, 8, 1)
