"""Compute cost of single kernels on one GPU: GEMMs, attention, memory-bound (elementwise / norm) ops.

GEMM time = max(FLOPs / (peak x efficiency), bytes / memory bandwidth) + a fixed kernel overhead, where
efficiency = gemm x tile/wave utilisation x K/(K + k_half): large, square-ish GEMMs approach the profile's
``efficiency.gemm``; GEMMs whose output tiles leave SMs idle in the last wave, or with a short K loop, run
slower. All functions broadcast over numpy arrays.

Measured tables (``autopar profile``) hold whole kernel times, fixed per-kernel cost included:
- GEMMs: the modelled time (overhead and memory bound included) is scaled by the measured/modelled time
  ratio at the nearest measured shapes (inverse-distance weights in log m, n, k), so a measured shape
  reproduces its measurement exactly and other shapes inherit their neighbours' correction.
- Attention: the measured forward and backward rates (causal FLOPs/s) of the measured head dimension
  nearest the model's are interpolated over log sequence length; no overhead is added on top.
"""

from __future__ import annotations

import numpy as np

from specs.cluster import ClusterSpec, GPUSpec
from specs.state import DTYPE_BYTES

ArrayLike = np.ndarray | float | int
ATTN_BWD_RATIO = 2.5  # an attention backward's matmul work over its forward's (dQ, dK, dV and the recomputed scores)


def attention_flops(batch_heads: ArrayLike, sq: ArrayLike, sk: ArrayLike, d: ArrayLike,
                    causal_frac: ArrayLike) -> np.ndarray:
    """The forward FLOPs of attention over ``batch_heads`` heads: Q K^T and P V, 2 x sq x sk x d each, times the
    share of the scores a causal mask keeps (``causal_frac``: 0.5 causal, 1 full)."""
    return 4.0 * np.asarray(batch_heads, float) * sq * sk * d * causal_frac

# The output tiles cuBLAS-like libraries choose between, relative to the profile's largest (``gemm_tile_m`` x
# ``gemm_tile_n``, 128 x 256 by default): (m share, n share, relative efficiency). Smaller tiles fill more SMs in a
# short last wave but reuse less of each operand.
_TILES = ((1.0, 1.0, 1.0), (1.0, 0.5, 0.93), (0.5, 0.5, 0.80))


class ComputeModel:
    """Kernel times on one GPU at one compute precision."""

    def __init__(self, gpu: GPUSpec, precision: str = "bf16", slowdown: float = 1.0) -> None:
        """``slowdown``: every kernel that many times slower than the profile's rates (CPU ranks sharing cores,
        ``ClusterSpec.compute_slowdown``; :meth:`of` passes it)."""
        self.gpu = gpu
        self.precision = precision
        self.eb = DTYPE_BYTES[precision]
        self.peak = gpu.peak(precision) / slowdown
        self.e = gpu.efficiency
        self.overhead = self.e.kernel_overhead_us * 1e-6 * slowdown
        self.mem_bw = gpu.mem_bw / slowdown
        self.ew_bw = gpu.ew_bw / slowdown
        self.reduce_bw = gpu.reduce_bw / slowdown
        self.opt_bw = gpu.opt_bw / slowdown
        self._table = None
        if gpu.gemm_table:
            t = np.array([[p.m, p.n, p.k, p.tflops * 1e12 / slowdown] for p in gpu.gemm_table], dtype=float)
            measured = 2.0 * t[:, 0] * t[:, 1] * t[:, 2] / t[:, 3]
            ratio = measured / self._gemm_model(t[:, 0], t[:, 1], t[:, 2], 1.0)
            self._table = (np.log(t[:, :3]), ratio)
        self._attn: dict[float, np.ndarray] = {}  # head_dim -> rows (seq, fwd FLOP/s, bwd FLOP/s) by seq
        if gpu.attention_table:
            a = np.array([[p.seq, p.head_dim, p.fwd_tflops * 1e12 / slowdown, p.bwd_tflops * 1e12 / slowdown]
                          for p in gpu.attention_table], dtype=float)
            for d in np.unique(a[:, 1]):
                rows = a[a[:, 1] == d][:, [0, 2, 3]]
                self._attn[float(d)] = rows[np.argsort(rows[:, 0])]

    @classmethod
    def of(cls, cluster: ClusterSpec) -> ComputeModel:
        """The kernels of ``cluster``'s GPUs at its precision, as many ranks a node as it has."""
        return cls(cluster.gpu, cluster.precision, cluster.compute_slowdown)

    # ---- GEMM ---------------------------------------------------------------------------------
    def _shape_eff(self, M: np.ndarray, N: np.ndarray, K: np.ndarray, batch: np.ndarray,
                   sms: ArrayLike | None = None) -> np.ndarray:
        """The share of the GPU's SMs the best tile keeps busy over its waves; on ``sms`` SMs (some kept for a
        collective beside it) the waves are of that many tiles and the rest of the GPU idles."""
        sm = self.gpu.sm_count
        used = sm if sms is None else np.asarray(sms, dtype=float)
        best = np.zeros(np.broadcast(M, N, K, batch, used).shape)
        for fm, fn, q in _TILES:
            tm, tn = max(1.0, fm * self.e.gemm_tile_m), max(1.0, fn * self.e.gemm_tile_n)
            tiles = np.ceil(M / tm) * np.ceil(N / tn) * batch
            waves = np.ceil(tiles / used)
            best = np.maximum(best, q * tiles / (waves * sm))
        return best * K / (K + self.e.gemm_k_half)

    def gemm_rate(self, M: ArrayLike, N: ArrayLike, K: ArrayLike, batch: ArrayLike = 1,
                   sms: ArrayLike | None = None) -> np.ndarray:
        """Modelled FLOP/s of a GEMM before any measured correction (on ``sms`` of the SMs, default all)."""
        M, N, K, batch = (np.asarray(x, dtype=float) for x in (M, N, K, batch))
        return self.peak * self.e.gemm * self._shape_eff(M, N, K, batch, sms)

    def _correction(self, M: np.ndarray, N: np.ndarray, K: np.ndarray) -> np.ndarray | float:
        if self._table is None:
            return 1.0
        pts, ratio = self._table
        q = np.stack(np.broadcast_arrays(np.log(M), np.log(N), np.log(K)), axis=-1)
        d = np.sqrt(((q[..., None, :] - pts) ** 2).sum(-1))  # distance to every measured shape
        nearest = np.argsort(d, axis=-1)[..., :4]
        dn = np.take_along_axis(d, nearest, -1)
        w = 1.0 / (dn + 1e-3) ** 2
        return (w * ratio[nearest]).sum(-1) / w.sum(-1)

    def _gemm_model(self, M: np.ndarray, N: np.ndarray, K: np.ndarray, batch: np.ndarray | float,
                    sms: ArrayLike | None = None) -> np.ndarray:
        """Modelled seconds (compute or memory bound, plus the fixed cost) before any measured correction."""
        flops = 2.0 * M * N * K * batch
        nbytes = self.eb * (M * K + K * N + M * N) * batch
        return np.maximum(flops / self.gemm_rate(M, N, K, batch, sms), nbytes / self.mem_bw) + self.overhead

    def gemm(self, M: ArrayLike, N: ArrayLike, K: ArrayLike, batch: ArrayLike = 1,
             sms: ArrayLike | None = None) -> np.ndarray:
        """Seconds for ``batch`` GEMMs of (M x K) @ (K x N), on ``sms`` of the GPU's SMs (default all of them;
        a measured table's correction, taken on the whole GPU, applies either way)."""
        M, N, K, batch = (np.maximum(np.asarray(x, dtype=float), 1.0) for x in (M, N, K, batch))
        return self._gemm_model(M, N, K, batch, sms) * self._correction(M, N, K)

    def linear(self, M: ArrayLike, N: ArrayLike, K: ArrayLike, batch: ArrayLike = 1, pieces: ArrayLike = 1,
               dgrad_pieces: ArrayLike | None = None, fprop_sms: ArrayLike | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Forward, data-gradient and weight-gradient GEMMs of a linear layer y = x W^T over M tokens; ``pieces`` /
        ``dgrad_pieces`` > 1 run the forward / data gradient as that many GEMMs of M / pieces tokens each (a
        collective matmul's ring steps), the weight gradient always as one; ``fprop_sms``: the SMs the forward
        runs on (default all)."""
        M = np.asarray(M, dtype=float)
        pf = np.asarray(pieces, dtype=float)
        pd = pf if dgrad_pieces is None else np.asarray(dgrad_pieces, dtype=float)
        return (pf * self.gemm(M / pf, N, K, batch, fprop_sms), pd * self.gemm(M / pd, K, N, batch),
                self.gemm(N, K, M, batch))

    def gemm_fwd_bwd(self, M: ArrayLike, N: ArrayLike, K: ArrayLike, batch: ArrayLike = 1
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Forward, and backward (data gradient + weight gradient) of a linear layer y = x W^T."""
        fwd, dgrad, wgrad = self.linear(M, N, K, batch)
        return fwd, dgrad + wgrad

    # ---- memory-bound ops ----------------------------------------------------------------------
    def memory(self, nbytes: ArrayLike, kernels: float = 1.0) -> np.ndarray:
        """Seconds of a layer's memory-bound ops moving ``nbytes`` in ``kernels`` launches (norms, activations,
        residuals: the profile's elementwise bandwidth where measured, which on CPUs covers unfused ops)."""
        return np.asarray(nbytes, dtype=float) / self.ew_bw + kernels * self.overhead

    def reduce(self, nbytes: ArrayLike, kernels: float = 1.0) -> np.ndarray:
        """Seconds of sums over tokens reading ``nbytes`` in ``kernels`` launches (bias gradients), at the profile's
        measured reduction bandwidth where it has one."""
        return np.asarray(nbytes, dtype=float) / self.reduce_bw + kernels * self.overhead

    def stream(self, nbytes: ArrayLike, kernels: float = 1.0) -> np.ndarray:
        """Seconds of plain streaming kernels over flat buffers (copies, scaling, zeroing) moving ``nbytes``."""
        return np.asarray(nbytes, dtype=float) / self.mem_bw + kernels * self.overhead

    def adamw(self, nbytes: ArrayLike, kernels: float = 1.0) -> np.ndarray:
        """Seconds of the fused AdamW update moving ``nbytes`` (StateSpec.adamw_bytes per parameter), at the
        profile's measured optimizer bandwidth where it has one."""
        return np.asarray(nbytes, dtype=float) / self.opt_bw + kernels * self.overhead

    # ---- attention core ------------------------------------------------------------------------
    def _attention_rates(self, sk: ArrayLike, d: float) -> tuple[np.ndarray, np.ndarray]:
        """The measured table's forward and backward FLOP/s at key length ``sk`` and head dim ``d``: linear in
        log(seq) within each measured head dim, then linear in log(head dim) between the two measured dims around
        ``d`` (the nearest measured dim outside their range: no extrapolation). The rate per FLOP falls at small
        head dims (less work per loaded tile: on an H200 at seq 2048, cuDNN's kernel ran 0.77x / 0.82x the head
        dim 128 rate forward / backward at head dim 64; benchmarks/RESULTS.md, session 29)."""
        key = np.log(np.asarray(sk, dtype=float))

        def at(dim: float) -> tuple[np.ndarray, np.ndarray]:
            rows = self._attn[dim]
            seqs = np.log(rows[:, 0])
            return np.interp(key, seqs, rows[:, 1]), np.interp(key, seqs, rows[:, 2])

        dims = np.array(sorted(self._attn))
        x = float(np.clip(np.log(d), np.log(dims[0]), np.log(dims[-1])))
        hi = int(min(np.searchsorted(np.log(dims), x), len(dims) - 1))
        lo = max(hi - 1, 0)
        if lo == hi:
            return at(float(dims[hi]))
        w = (x - np.log(dims[lo])) / (np.log(dims[hi]) - np.log(dims[lo]))
        (f0, b0), (f1, b1) = at(float(dims[lo])), at(float(dims[hi]))
        return f0 + w * (f1 - f0), b0 + w * (b1 - b0)

    def flash_attention(self, batch_heads: ArrayLike, sq: ArrayLike, sk: ArrayLike, d: ArrayLike,
                        causal_frac: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Fused attention forward and backward (backward does ATTN_BWD_RATIO x the forward's matmul work), at
        the profile's measured rates for this key length and head dim where it has an attention table."""
        flops = attention_flops(batch_heads, sq, sk, d, causal_frac)
        if self._attn:
            fwd_rate, bwd_rate = self._attention_rates(sk, float(np.mean(d)))
            return flops / fwd_rate, ATTN_BWD_RATIO * flops / bwd_rate
        fwd_rate = self.peak * self.e.attention_fwd
        bwd_rate = self.peak * self.e.attention_bwd
        return flops / fwd_rate + self.overhead, ATTN_BWD_RATIO * flops / bwd_rate + self.overhead
