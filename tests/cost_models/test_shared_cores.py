"""CPU ranks beyond a node's measured cores share them: a CPU profile that records its cores (``gpu.cores``, as
`autopar profile` writes it) prices every kernel of a rank that many times slower; GPUs and CPU profiles without
cores are priced as before."""

from __future__ import annotations

import numpy as np
import pytest

from cost_models.compute import ComputeModel
from cost_models.step import estimate
from specs.cluster_loading import load_cluster
from specs.model_loading import load_model
from specs.parallel import ParallelConfig


def _cpu(cores: int | None, gpus: int):
    base = load_cluster("cpu-gloo")
    gpu = base.gpu.model_copy(update={"cores": cores})
    return base.model_copy(update={"gpu": gpu}).resized(gpus=gpus)


def test_the_slowdown_is_ranks_over_cores_on_a_node():
    assert [_cpu(2, g).compute_slowdown for g in (1, 2, 4, 8)] == [1.0, 1.0, 2.0, 4.0]
    assert _cpu(None, 8).compute_slowdown == 1.0  # a profile that does not say: as before
    assert load_cluster("dgx-h100").compute_slowdown == 1.0


@pytest.mark.parametrize("gpu", ["cpu", "h100-sxm5-80gb"])
def test_every_kernel_is_that_many_times_slower(gpu):
    from specs.cluster_loading import load_gpu

    spec = load_gpu(gpu)
    precision = "fp32" if gpu == "cpu" else "bf16"
    one, four = ComputeModel(spec, precision), ComputeModel(spec, precision, slowdown=4.0)
    shapes = (np.array([64.0, 4096]), np.array([128.0, 8192]), np.array([256.0, 1024]))
    np.testing.assert_allclose(four.gemm(*shapes), 4 * one.gemm(*shapes))
    for op in ("memory", "reduce", "stream", "adamw"):
        np.testing.assert_allclose(getattr(four, op)(1e8, 3.0), 4 * getattr(one, op)(1e8, 3.0))
    np.testing.assert_allclose(four.flash_attention(8, 1024, 1024, 64, 0.5),
                               4 * np.array(one.flash_attention(8, 1024, 1024, 64, 0.5)))


def test_a_step_on_shared_cores_computes_slower_and_communicates_as_before():
    model, cfg = load_model("tiny"), ParallelConfig(dp=8, mbs=2)
    shared, alone = (estimate(model, _cpu(c, 8), cfg, 16) for c in (2, None))
    for part in ("forward_compute", "backward_compute"):
        assert shared.breakdown[part] == pytest.approx(4 * alone.breakdown[part], rel=1e-6), part
    assert alone.breakdown["optimizer"] < shared.breakdown["optimizer"] < 4 * alone.breakdown["optimizer"]  # (+ the
    # gradient norm's all-reduce, a collective)
    two = ParallelConfig(dp=2, mbs=8)  # as many ranks as cores: nothing shared
    assert estimate(model, _cpu(2, 2), two, 16).step_time_s == pytest.approx(
        estimate(model, _cpu(None, 2), two, 16).step_time_s)


def test_mfu_counts_the_cores_that_compute():
    """8 ranks on 2 cores: MFU divides by 2 cores' peak, not 8 (it read 4x low), so as many ranks as cores and more
    ranks on the same cores read alike where the step is compute (the runtime's metrics divide by the same)."""
    model = load_model("tiny")
    shared, alone = (estimate(model, _cpu(c, 8), ParallelConfig(dp=8, mbs=2), 16) for c in (2, None))
    cluster = _cpu(2, 8)
    peak2 = 2 * cluster.gpu.peak(cluster.precision)
    assert cluster.peak_flops(1, 8) == pytest.approx(peak2)
    assert shared.mfu == pytest.approx(shared.model_flops_per_step / (shared.step_time_s * peak2))
    assert _cpu(None, 8).peak_flops(1, 8) == pytest.approx(8 * cluster.gpu.peak(cluster.precision))
    assert alone.mfu == pytest.approx(alone.model_flops_per_step / (alone.step_time_s * 4 * peak2))
