"""`autopar profile` on CPU with gloo: the profile loads, its tables and fits are sane, the commands accept it.

Two gloo ranks are spawned once for the whole module (--quick); the CLI is then exercised on those
measurements without spawning again.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from hardware_profiles import profiler
from hardware_profiles.assemble import cluster_profile, match_gpu
from hardware_profiles.collectives import levels
from hardware_profiles.fit import fit_alpha_beta, fit_nonneg
from planner.cli import main
from specs.cluster import COLLECTIVES, bus_factor
from specs.cluster_loading import load_cluster

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def measured():
    """Rank 0's measurements of a --quick profile with two gloo ranks (spawned once)."""
    return profiler.run_local(2, quick=True, progress=False)


@pytest.fixture(scope="module")
def profile_path(measured, tmp_path_factory):
    """The profile written by `autopar profile --quick --out ...` (CLI path, on the cached measurements)."""
    out = tmp_path_factory.mktemp("prof") / "my-cpu.yaml"
    import planner.commands.profile as command

    mp = pytest.MonkeyPatch()
    # (the command's own name for it: patching the profiler's alone let the command measure again, and the fits
    # then described other timings than ``measured``)
    mp.setattr(command, "run_local", lambda nproc, quick, progress=True: measured)
    try:
        assert main(["profile", "--quick", "--out", str(out)]) == 0
    finally:
        mp.undo()
    return out


@pytest.mark.slow
def test_profile_loads_with_sane_tables(profile_path):
    c = load_cluster(str(profile_path))
    assert c.name == "my-cpu" and c.backend == "gloo" and c.precision == "fp32"
    # measured with 2 ranks, but a CPU "node" holds as many ranks as the bundled CPU profile: the README flow
    # (profile, then plan --gpus 4 on it) stays on one node
    assert c.gpus_per_node == load_cluster("cpu-gloo").gpus_per_node == 8 and c.num_nodes == 1
    assert load_cluster(str(profile_path), gpus=4).num_nodes == 1
    g = c.gpu
    # ... so each of its 8 ranks gets an eighth of the host's memory, not the half each of the 2 measured ranks had
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert g.memory_GiB * c.gpus_per_node == pytest.approx(host, rel=0.01)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))  # a rank's threads, as the profiler sets them
    assert g.cores == max(usable // threads, 2)  # a core each, or the 2 ranks measured at once: more share them
    ranks = min(8, 2 * usable)  # the node holds 8
    assert c.resized(gpus=ranks).compute_slowdown == max(1.0, ranks / usable)
    assert len(g.gemm_table) == 18 and all(p.tflops > 0 and math.isfinite(p.tflops) for p in g.gemm_table)
    assert g.attention_table and all(a.fwd_tflops > 0 and a.bwd_tflops > 0 for a in g.attention_table)
    assert {a.head_dim for a in g.attention_table} == {16, 64}
    assert g.measured_memory_bandwidth_GBps and g.measured_memory_bandwidth_GBps > 0
    assert g.elementwise_bandwidth_GBps and g.elementwise_bandwidth_GBps > 0
    assert g.optimizer_bandwidth_GBps and g.optimizer_bandwidth_GBps > 0 and g.opt_bw == g.optimizer_bandwidth_GBps * 1e9
    assert g.efficiency.kernel_overhead_us > 0
    assert 0 < g.efficiency.gemm <= 1 and 0 < g.efficiency.memory <= 1
    # the CPU's "peak" is its best measured GEMM rate
    assert g.peak("fp32") == pytest.approx(max(p.tflops for p in g.gemm_table) * 1e12, rel=1e-3)
    assert set(c.collectives) == set(COLLECTIVES)
    for name, lv in c.collectives.items():
        fit = lv["intra"]
        assert fit.alpha_us >= 0 and fit.busbw_GBps > 0 and fit.alpha_per_rank_us >= 0, name
        assert fit.r2 is not None and fit.r2 <= 1.0, name
    assert "Measured by `autopar profile`" in profile_path.read_text().splitlines()[0]


@pytest.mark.slow
def test_one_node_notes_say_whether_the_profile_can_span_nodes(measured):
    """A CPU has no bundled cluster to take inter-node links from: the note says the profile plans this node only
    (no inter_node section), not that the bundled defaults apply; the profile indeed cannot hold two nodes."""
    prof, notes = profiler.build(measured, "mine")
    assert "inter_node" not in prof
    assert any("no inter_node section" in n for n in notes) and not any("bundled defaults" in n for n in notes)


@pytest.mark.slow
def _least_squares_gap(cols: np.ndarray, t: np.ndarray, c: np.ndarray, free: list[int]) -> float:
    """How far coefficients ``c`` are from the least squares of ``t`` (residuals relative to t) with every
    coefficient >= 0: the largest normalised gradient that moving one of ``free`` (above zero) or raising it (at
    zero) would follow; 0 at the optimum."""
    w2 = 1.0 / t**2
    scale = np.sqrt(np.sum(w2[:, None] * cols**2, axis=0) * np.sum(w2 * t**2)) + 1e-300  # Cauchy-Schwarz bound
    rel = cols.T @ (w2 * (t - cols @ c)) / scale  # minus half the gradient of sum(((t - pred) / t)^2)
    return max(abs(rel[j]) if c[j] > 0 else max(rel[j], 0.0) for j in free)


def test_fits_reproduce_measured_points(measured, profile_path):
    """Every fit is the least-squares line through its points, and the cost model reads it unchanged.

    Checked by the fit's optimality conditions, not by how close the line passes (gloo timings on a shared machine
    scatter as they like): with residuals weighted by 1/t, moving any coefficient the fit kept would not reduce
    the squared error (weighted residuals orthogonal to its column) and raising one it held at zero would not
    either (a non-positive gradient).
    """
    from cost_models.comm import CommModel

    c = load_cluster(str(profile_path))
    comm = CommModel(c)
    for name, per_level in measured["collectives"].items():
        pts = per_level["intra"]
        assert len(pts) == 5 and all(t > 0 for *_, t in pts)
        fit = c.collectives[name]["intra"]
        ns = np.array([n for n, _, _ in pts], dtype=float)
        x = np.array([b * bus_factor(name, n) for n, b, _ in pts])
        t = np.array([t for *_, t in pts])
        beta = 1.0 / (fit.busbw_GBps * 1e9)
        coef = np.array([fit.alpha_us * 1e-6, beta, fit.alpha_per_rank_us * 1e-6])
        cols = np.stack([np.ones_like(x), x, np.maximum(ns - 2, 0)], axis=1)
        fitted = [0, 1, 2] if np.ptp(ns) > 0 else [0, 1]  # one group size: no per-rank term to fit
        pred = cols @ coef
        big = int(np.argmax(x))
        gap = _least_squares_gap(cols, t, coef, fitted)
        if pred[big] == pytest.approx(t[big], rel=1e-3) or beta * x[big] == pytest.approx(1e-3 * t[big], rel=1e-3):
            # beta from the largest message alone, as the fit does when least squares gives it none: the rest is the
            # least-squares fit without it, which indeed leaves beta nothing to gain
            gap = min(gap, _least_squares_gap(cols, t, np.array([coef[0], 0.0, coef[2]]), fitted))
        assert gap < 1e-3, (name, gap)
        # the cost model prices the collective with the same convention
        big = int(np.argmax([b for _, b, _ in pts]))
        n, b, _ = pts[big]
        model = {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather,
                 "reduce_scatter": comm.reduce_scatter, "all_to_all": comm.all_to_all}.get(name)
        got = float(model(b, n)) if model else float(comm.p2p(b, False))
        assert got == pytest.approx(pred[big], rel=1e-6)


@pytest.mark.slow
def test_gemm_table_feeds_the_cost_model(profile_path):
    from cost_models.compute import ComputeModel

    c = load_cluster(str(profile_path))
    cm = ComputeModel(c.gpu, c.precision)
    for p in c.gpu.gemm_table:  # a measured shape takes exactly its measured time
        assert float(cm.gemm(p.m, p.n, p.k)) == pytest.approx(2 * p.m * p.n * p.k / (p.tflops * 1e12), rel=1e-3)
    # the layers' memory-bound ops use the probed elementwise bandwidth, the fused optimizer the copy bandwidth
    assert float(cm.memory(1e6, 0)) == pytest.approx(1e6 / (c.gpu.elementwise_bandwidth_GBps * 1e9))
    assert float(cm.stream(1e6, 0)) == pytest.approx(1e6 / (c.gpu.measured_memory_bandwidth_GBps * 1e9))
    a = c.gpu.attention_table[1]  # measured attention: whole-kernel rate, no overhead on top
    f, _ = cm.flash_attention(a.batch * a.heads, a.seq, a.seq, a.head_dim, 0.5)
    assert float(f) == pytest.approx(2 * a.batch * a.heads * a.seq**2 * a.head_dim / (a.fwd_tflops * 1e12), rel=1e-6)


@pytest.mark.slow
def test_estimate_and_plan_accept_the_profile(profile_path, capsys):
    assert main(["estimate", "--model", "tiny", "--cluster", str(profile_path), "--global-batch", "8",
                 "--plan", "tp=2,mbs=2", "--format", "json"]) == 0
    est = json.loads(capsys.readouterr().out)
    assert est["step_time_s"] > 0 and est["breakdown"]["tp_cp_comm"] > 0
    assert main(["plan", "--model", "tiny", "--cluster", str(profile_path), "--global-batch", "8",
                 "--format", "json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and plans[0]["step_time_s"] > 0
    assert main(["whatif", "--model", "tiny", "--cluster", str(profile_path), "--global-batch", "8",
                 "--vary", "gpus=1,2", "--format", "json"]) == 0


def test_profile_rejects_bad_arguments(tmp_path, capsys):
    assert main(["profile", "--nproc", "0", "--out", str(tmp_path / "x.yaml")]) == 2
    assert main(["profile", "--out", str(tmp_path)]) == 2
    (tmp_path / "a_file").write_text("x")  # refused before measuring, not after
    assert main(["profile", "--quick", "--out", str(tmp_path / "a_file" / "x.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(e.startswith("autopar: error:") for e in err)
    assert "is a directory" in err[1] and "a_file is a file, not a folder" in err[2]
    import torch

    if not torch.cuda.is_available():  # 999 gloo ranks were spawned on a 2-core machine, and it never returned
        assert main(["profile", "--quick", "--nproc", "999", "--out", str(tmp_path / "x.yaml")]) == 2
        assert "--nproc 999: this process may use" in capsys.readouterr().err


# ---- pure pieces (no processes) ---------------------------------------------------------------------
def test_alpha_beta_fit_recovers_a_line():
    x = np.logspace(3, 8, 8)
    ab = fit_alpha_beta(x, 40e-6 + x / 5e9)
    assert ab.alpha_s == pytest.approx(40e-6, rel=1e-6) and ab.bw_Bps == pytest.approx(5e9, rel=1e-6)
    assert ab.r2 == pytest.approx(1.0) and ab.max_rel_err < 1e-9
    n = np.array([2, 2, 4, 4, 8, 8, 2, 8])
    ab = fit_alpha_beta(x, 40e-6 + 7e-6 * (n - 2) + x / 5e9, n)
    assert ab.per_rank_s == pytest.approx(7e-6, rel=1e-6) and ab.alpha_s == pytest.approx(40e-6, rel=1e-6)


def test_alpha_beta_fit_keeps_alpha_non_negative():
    x = np.array([1e6, 2e6, 4e6, 8e6])
    ab = fit_alpha_beta(x, x / 1e9 - 1e-4 * np.array([0.5, 0.4, 0.2, 0.0]) + 1e-4)  # intercept would be < 0
    assert ab.alpha_s >= 0 and ab.bw_Bps > 0
    assert fit_nonneg(np.array([[1.0, 1.0], [1.0, 2.0]]), np.array([3.0, 2.0])).min() >= 0
    with pytest.raises(ValueError):
        fit_alpha_beta([1.0], [1.0])


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    assert bus_factor("reduce_scatter", 2) == 0.5 and bus_factor("p2p", 8) == 1.0


def test_levels_of_a_multi_node_job():
    intra, inter = levels(16, 8)
    assert sorted(intra.groups) == [2, 4, 8] and intra.groups[8] == [list(range(8)), list(range(8, 16))]
    assert all(len(set(g)) == len(g) for gs in intra.groups.values() for g in gs)
    assert inter.groups[2][0] == [0, 8] and len(inter.groups[2]) == 8 and inter.pairs[0] == (0, 8)
    assert levels(1, 1) == [] and [lv.name for lv in levels(2, 2)] == ["intra"]


def test_gpu_names_map_to_bundled_profiles():
    assert match_gpu("NVIDIA H100 80GB HBM3", 79.1) == "h100-sxm5-80gb"
    assert match_gpu("NVIDIA H100 PCIe", 79.6) == "h100-pcie-80gb"
    assert match_gpu("NVIDIA A100-SXM4-40GB", 39.4) == "a100-sxm4-40gb"
    assert match_gpu("NVIDIA A100-SXM4-80GB", 79.2) == "a100-sxm4-80gb"
    assert match_gpu("Some New Accelerator", 10) is None


def test_gpu_measurements_assemble_into_a_profile(tmp_path):
    """The GPU path's assembly (no GPU needed): datasheet peak kept, tables and NCCL fits written."""
    from cost_models.step import estimate
    from hardware_profiles.assemble import to_yaml
    from specs.model_loading import load_model
    from specs.parallel import ParallelConfig

    gemm = [{"m": m, "n": n, "k": k, "seconds": 2 * m * n * k / 700e12} for m in (2048, 8192) for n in (1024, 8192)
            for k in (1024, 8192)]
    attn = [{"seq": s, "heads": 16, "head_dim": 128, "batch": 16384 // s,
             "fwd_s": 2 * 16384 * 16 * s * 128 / 400e12, "bwd_s": 5 * 16384 * 16 * s * 128 / 330e12} for s in (1024, 4096)]
    sizes = [2**16 * 4**i for i in range(6)]
    colls = {c: {"intra": [(n, b, 20e-6 + 3e-6 * (n - 2) + b * bus_factor(c, n) / 360e9) for n in (2, 8) for b in sizes]}
             for c in COLLECTIVES if c != "p2p"}
    colls["p2p"] = {"intra": [(2, b, 10e-6 + b / 300e9) for b in sizes]}
    meas = {"device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "memory_GiB": 79.1, "sm_count": 132},
            "precision": "bf16", "backend": "nccl", "world": 8, "local": 8,
            "compute": {"gemm": gemm, "attention": attn, "copy_Bps": 2.9e12, "tiny_op_s": 2.5e-6,
                        "column_sum_Bps": 1.4e12, "adamw_Bps": 1.9e12}, "collectives": colls}
    prof = cluster_profile(meas, "h100-box")
    out = tmp_path / "h100-box.yaml"
    out.write_text(to_yaml(prof, meas, []))
    c = load_cluster(str(out))
    assert c.gpu.name == "h100-sxm5-80gb" and c.gpu.peak("bf16") == 989e12
    # efficiency.gemm is what a well-shaped GEMM reaches: at least the measured 700 of 989 TFLOP/s
    assert 700 / 989 <= c.gpu.efficiency.gemm <= 0.85
    assert c.gpu.efficiency.kernel_overhead_us == pytest.approx(2.5)
    assert c.gpu.reduce_bandwidth_GBps == pytest.approx(1400) and c.gpu.reduce_bw == pytest.approx(1.4e12)
    assert c.gpu.optimizer_bandwidth_GBps == pytest.approx(1900) and c.gpu.opt_bw == pytest.approx(1.9e12)
    assert c.inter_node is not None  # from the bundled dgx-h100, so --nodes can grow the cluster
    fit = c.collectives["all_reduce"]["intra"]
    assert fit.alpha_us == pytest.approx(20, rel=1e-3) and fit.alpha_per_rank_us == pytest.approx(3, rel=1e-3)
    assert fit.busbw_GBps == pytest.approx(360, rel=1e-3) and fit.r2 == pytest.approx(1.0)
    est = estimate(load_model("llama-1b"), c.resized(nodes=2), ParallelConfig(tp=8, dp=2), 16)
    assert est.step_time_s > 0


def test_bias_gradients_are_priced_at_the_measured_reduction_bandwidth():
    """A GPU profile's measured sum-over-tokens bandwidth prices a GPT layer's bias gradients (read once each);
    without one they stream at the elementwise bandwidth. The measurement itself runs anywhere."""
    import torch

    from cost_models.comm import CommModel
    from cost_models.compute import ComputeModel
    from cost_models.layer import layer_cost
    from hardware_profiles.compute_bench import time_column_sum
    from hardware_profiles.timing import Timer
    from specs.model_loading import model_from_dict

    assert time_column_sum(Timer(torch.device("cpu"), repeats=2), 256, 128, torch.float32) > 0
    cluster = load_cluster("dgx-h100", gpus=1)
    slow = cluster.gpu.model_copy(update={"reduce_bandwidth_GBps": cluster.gpu.ew_bw / 2e9})
    spec = {"name": "g", "arch": "gpt", "num_layers": 2, "hidden_size": 1024, "num_attention_heads": 16,
            "vocab_size": 1000, "seq_length": 512, "attention": "flash", "dropout": 0.0}
    model = model_from_dict(spec, "g")
    one = np.ones(1)
    args = (one, one, 2 * one, np.zeros(1, dtype=bool), np.zeros(1, dtype=bool))
    base = layer_cost(model, ComputeModel(cluster.gpu, "bf16"), CommModel(cluster), *args)
    halved = layer_cost(model, ComputeModel(slow, "bf16"), CommModel(cluster), *args)
    T, h = 2 * 512, 1024
    bias_bytes = T * (3 * h + 4 * h + 2 * h) * 2  # qkv, fc1, and the two h-wide (proj, fc2) biases' gradients
    assert float(halved.bwd[0] - base.bwd[0]) == pytest.approx(bias_bytes / cluster.gpu.ew_bw, rel=1e-9)
    assert float(halved.fwd[0]) == float(base.fwd[0])


def test_the_optimizer_update_is_priced_at_the_measured_adamw_bandwidth():
    """A profile's measured fused-AdamW bandwidth prices the update's bytes (StateSpec.adamw_bytes per parameter of
    the rank's shard); the other passes of the step's tail (averaging, norm, clipping, zeroing, the master copy)
    stay at the copy bandwidth; without one the update streams at the copy bandwidth too. The measurement (torch's
    own fused kernel, as the runtime runs it) gives a positive rate anywhere."""
    import torch

    from cost_models.step import estimate
    from hardware_profiles.compute_bench import time_adamw
    from hardware_profiles.timing import Timer
    from specs.model_loading import load_model
    from specs.parallel import ParallelConfig
    from specs.state import StateSpec

    assert time_adamw(Timer(torch.device("cpu"), repeats=2), 1 << 16) > 0
    cluster = load_cluster("dgx-h100", gpus=1)
    assert cluster.gpu.optimizer_bandwidth_GBps is None and cluster.gpu.opt_bw == cluster.gpu.mem_bw
    slow = cluster.model_copy(update={"gpu": cluster.gpu.model_copy(
        update={"optimizer_bandwidth_GBps": cluster.gpu.mem_bw / 2e9})})
    model, cfg = load_model("llama-1b"), ParallelConfig(mbs=1)
    base, halved = (estimate(model, c, cfg, 1).breakdown for c in (cluster, slow))
    state = StateSpec.default(cluster.precision)
    assert state.adamw_bytes == 28 and state.master_copy_bytes == 4 + 2
    update = model.num_params * state.adamw_bytes / cluster.gpu.mem_bw
    assert halved["optimizer"] - base["optimizer"] == pytest.approx(update, rel=1e-3)
    assert halved["forward_compute"] == base["forward_compute"]


def test_optimizer_step_benchmark_times_the_runtimes_own_update(tmp_path):
    """benchmarks/optimizer_step.py builds the runtime's Trainer and times its optimizer step piece by piece beside
    the cost model's price: on CPU for the tiny model every piece is timed, the AdamW operands are the runtime's
    (views split where weight decay changes), and without CUDA ``--device cuda`` exits 2 with one line."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    root = Path(__file__).resolve().parents[2]
    script = str(root / "benchmarks" / "optimizer_step.py")
    out = tmp_path / "opt.json"
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}
    p = subprocess.run([sys.executable, script, "--device", "cpu", "--models", "tiny", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    (row,) = json.loads(out.read_text())
    t = row["measured_s"]
    assert set(t) >= {"step", "norm", "publish", "adamw", "adamw_flat", "adamw_profile", "adamw_16", "adamw_4096"}
    assert all(v > 0 for v in t.values())
    assert 2 <= row["tensors"] < row["params"] and row["copied_back"] == 0 and row["predicted_s"] > 0
    if not torch.cuda.is_available():
        q = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, env=env)
        assert q.returncode == 2 and "no CUDA GPU" in q.stderr and "Traceback" not in q.stderr, q.stderr


def test_layer_probe_splits_a_layers_price_into_its_parts():
    """The CPU profile's layer probe prices one layer with only one part of the cost model on at a time: the parts
    are positive and the compute part is the GEMMs and attention the full model prices (a ComputeModel subclass
    that must keep the GEMM model's signature: a change to it broke `autopar profile` on CPUs once)."""
    from cost_models.comm import CommModel
    from cost_models.compute import ComputeModel
    from cost_models.layer import layer_cost
    from hardware_profiles.layer_probe import layer_parts, probe_specs
    from specs.cluster_loading import load_gpu

    gpu = load_gpu("h100-sxm5-80gb")
    for spec, batch in probe_specs()[:2]:
        compute, nbytes, kernels = layer_parts(spec, batch, gpu, "bf16")
        assert compute > 0 and nbytes > 0 and kernels > 0
        cluster = load_cluster("dgx-h100", gpus=1)
        whole = layer_cost(spec, ComputeModel(gpu, "bf16"), CommModel(cluster), 1, 1, batch, False, False)
        assert compute < float(whole.fwd + whole.bwd)  # the memory-bound part is left out


@pytest.mark.slow
def test_a_busy_machine_is_said(measured):
    """Each measurement's repeated windows are compared: the profile carries the spread, and a busy one (the
    repeats of one thing 25% apart or more, as on a machine sharing its cores) is a note to profile again."""
    from hardware_profiles.timing import Timer

    assert 0 <= measured["compute"]["timing_spread"] < 10
    timer = Timer(torch.device("cpu"), repeats=3)
    assert timer.spread() == 0 and timer._summary([1.0, 1.5, 1.0]) > 0 and timer.spread() == pytest.approx(0.5)
    busy = {**measured, "compute": {**measured["compute"], "timing_spread": 0.5}}
    assert any("the machine was busy while measured: repeated timings of one thing differed by 50%" in n
               for n in profiler.build(busy, "mine")[1])
    calm = {**measured, "compute": {**measured["compute"], "timing_spread": 0.1}}
    assert not any("busy" in n for n in profiler.build(calm, "mine")[1])
