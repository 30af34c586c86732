"""Per-kernel overhead and elementwise bandwidth *as the cost model counts kernels and bytes* (CPU runs).

The cost model prices a transformer layer as GEMMs and attention (measured tables) plus memory-bound ops
(norms, activations, residuals, RoPE), each ``nbytes / memory bandwidth + kernels x kernel_overhead_us``
with the bytes and kernel counts of fused GPU kernels. On a CPU the runtime runs those ops as several
unfused torch ops each (its reference kernels), and every op pays Python, dispatcher and autograd costs
synchronously, so both the fixed cost per modelled kernel and the time per modelled byte are larger than a
micro-benchmark of one op shows. So the runtime's own Llama and GPT blocks are run forward and backward at
four small shapes; the time left after the measured GEMM and attention tables is fitted (non-negative least
squares, relative errors) to ``kernels x overhead + bytes / bandwidth`` with the kernels and bytes the
cost model charges for the same layers. The results become ``efficiency.kernel_overhead_us`` and
``elementwise_bandwidth_GBps`` of a CPU profile.

On GPUs the runtime's Triton kernels are the fused kernels the model counts, and the host runs ahead of the
device, so the profiler uses the plain measurements there (compute_bench.py).
"""

from __future__ import annotations

import numpy as np
import torch

from cost_models.comm import CommModel
from cost_models.compute import ComputeModel
from cost_models.layer import layer_cost
from hardware_profiles.fit import fit_nonneg
from hardware_profiles.timing import Timer
from specs.cluster import ClusterSpec, GPUSpec, Link
from specs.model import ModelSpec

# (hidden, heads, seq, batch): overhead-dominated, then more and more bytes
PROBE_SHAPES = ((64, 4, 32, 1), (128, 4, 64, 2), (128, 4, 128, 4), (256, 4, 256, 2))


def probe_specs() -> list[tuple[ModelSpec, int]]:
    """Llama and GPT layers at the probe shapes, with their micro-batch sizes."""
    out = []
    for h, heads, seq, batch in PROBE_SHAPES:
        common = dict(num_layers=1, hidden_size=h, num_attention_heads=heads, vocab_size=64, seq_length=seq,
                      dropout=0.0, attention="flash")
        out.append((ModelSpec(name=f"probe-llama-{h}", arch="llama", num_kv_heads=heads // 2,
                              ffn_hidden_size=2 * h, **common), batch))
        out.append((ModelSpec(name=f"probe-gpt-{h}", arch="gpt", ffn_hidden_size=4 * h, **common), batch))
    return out


class _Part(ComputeModel):
    """The cost model with only one part of its price switched on: ``compute`` (GEMMs and attention, from
    the measured tables), ``bytes`` (memory-bound bytes, in bytes) or ``kernels`` (memory-bound launches)."""

    def __init__(self, gpu: GPUSpec, precision: str, part: str) -> None:
        super().__init__(gpu, precision)
        self.part = part

    def gemm(self, M, N, K, batch=1, sms=None):  # type: ignore[override]
        t = super().gemm(M, N, K, batch, sms)
        return t if self.part == "compute" else 0.0 * t

    def flash_attention(self, batch_heads, sq, sk, d, causal_frac):  # type: ignore[override]
        f, b = super().flash_attention(batch_heads, sq, sk, d, causal_frac)
        return (f, b) if self.part == "compute" else (0.0 * f, 0.0 * b)

    def memory(self, nbytes, kernels=1.0):  # type: ignore[override]
        if self.part == "bytes":
            return np.asarray(nbytes, dtype=float)
        if self.part == "kernels":
            return np.asarray(kernels, dtype=float) + 0.0 * np.asarray(nbytes, dtype=float)
        return 0.0 * np.asarray(nbytes, dtype=float)


def layer_parts(spec: ModelSpec, batch: int, gpu: GPUSpec, precision: str) -> tuple[float, float, float]:
    """(compute seconds from the measured tables, memory-bound bytes, memory-bound kernels) of one layer's
    forward + backward, as the cost model prices it (no parallelism)."""
    cluster = ClusterSpec(name="probe", gpu=gpu, gpus_per_node=1, intra_node=Link(bandwidth_GBps=1.0),
                          precision=precision, backend="gloo" if gpu.name == "cpu" else "nccl")
    comm = CommModel(cluster)
    out = []
    for part in ("compute", "bytes", "kernels"):
        lc = layer_cost(spec, _Part(gpu, precision, part), comm, 1, 1, batch, False, False)
        out.append(float(np.asarray(lc.fwd + lc.bwd)))
    return out[0], out[1], out[2]


def time_layer(timer: Timer, spec: ModelSpec, batch: int, dtype: torch.dtype) -> float:
    """Seconds of one forward + backward of the runtime's block for ``spec``."""
    from runtime.models.gpt import GPTBlock
    from runtime.models.llama import LlamaBlock

    with torch.device(timer.device):
        block = (GPTBlock if spec.arch == "gpt" else LlamaBlock)(spec).to(dtype)
    x = torch.randn(batch, spec.seq_length, spec.hidden_size, device=timer.device, dtype=dtype, requires_grad=True)
    g = torch.randn_like(x)

    def step() -> None:
        block(x).backward(g)
        block.zero_grad(set_to_none=True)
        x.grad = None

    return timer(step)


def measure(timer: Timer, measured: GPUSpec, precision: str, dtype: torch.dtype) -> list[dict[str, float]]:
    """Every probe: its measured seconds and the cost model's parts for it (on the measured tables)."""
    rows = []
    for spec, batch in probe_specs():
        compute, nbytes, kernels = layer_parts(spec, batch, measured, precision)
        rows.append({"probe": spec.name, "seconds": time_layer(timer, spec, batch, dtype), "compute_s": compute,
                     "bytes": nbytes, "kernels": kernels})
    return rows


def fit(rows: list[dict[str, float]], copy_Bps: float, floor_s: float) -> tuple[float, float]:
    """(seconds per modelled kernel, modelled bytes per second) from the probes' residual times.

    Bounds keep a noisy fit physical: a kernel costs at least ``floor_s`` (the smallest op measured), and if
    the bytes term vanishes the copy bandwidth stands in for it."""
    y = np.array([max(r["seconds"] - r["compute_s"], 0.05 * r["seconds"]) for r in rows])
    k = np.array([r["kernels"] for r in rows])
    b = np.array([r["bytes"] for r in rows])
    w = 1.0 / y
    overhead, inv_bw = fit_nonneg(np.stack([k, b], axis=1), y, w)
    if inv_bw <= 0:
        inv_bw = 1.0 / copy_Bps
        overhead = float(fit_nonneg(k[:, None], y - b * inv_bw, w)[0])
    if overhead < floor_s:
        overhead = floor_s
        inv_bw = float(fit_nonneg(b[:, None], y - k * overhead, w)[0]) or 1.0 / copy_Bps
    return overhead, 1.0 / inv_bw
