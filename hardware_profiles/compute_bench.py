"""Single-device measurements: GEMMs over a grid of shapes, fused (SDPA) attention, memory bandwidth, the fused
AdamW update's bandwidth.

Every rank of ``autopar profile`` runs these at the same time, so a CPU shared by several ranks is
measured as a run of that many ranks sees it. Times summarise several windows (:class:`Timer`).
Shapes follow the cost model's conventions: a GEMM (m x k) @ (k x n) does 2mnk FLOPs; causal attention
does 4 b h s^2 d / 2 FLOPs forward and 2.5x that backward (cost_models/compute.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hardware_profiles.timing import Timer
from runtime.dtypes import TORCH_DTYPES


@dataclass(frozen=True)
class Grid:
    """What to measure on one kind of device."""

    gemm_m: tuple[int, ...]
    gemm_nk: tuple[int, ...]
    attn_seqs: tuple[int, ...]
    attn_head_dims: tuple[int, ...]
    attn_heads: int
    attn_tokens: int  # batch x seq of every attention measurement
    copy_bytes: int


def grid_for(device: torch.device, quick: bool) -> Grid:
    """GPU: the shapes the cost model asks for planning real models (tokens x multiples of hidden sizes,
    skinny ones included); CPU: small shapes in fp32 (what CPU runs of the tiny presets use)."""
    if device.type == "cuda":
        if quick:
            return Grid((2048, 8192), (512, 2048, 8192), (1024, 4096), (64, 128), 16, 16384, 2**29)
        return Grid((1024, 2048, 4096, 8192, 16384), (256, 512, 1024, 2048, 4096, 8192, 16384),
                    (512, 1024, 2048, 4096, 8192, 16384), (64, 128), 16, 16384, 2**30)
    if quick:
        return Grid((128, 512), (64, 256, 1024), (64, 128, 256), (16, 64), 4, 512, 2**24)
    return Grid((64, 256, 1024), (64, 256, 1024), (64, 128, 256, 512), (16, 64), 4, 1024, 2**26)


def gemm_shapes(g: Grid) -> list[tuple[int, int, int]]:
    return [(m, n, k) for m in g.gemm_m for n in g.gemm_nk for k in g.gemm_nk]


def attention_shapes(g: Grid) -> list[tuple[int, int, int, int]]:
    """(seq, heads, head_dim, batch) with batch x seq = the grid's token count."""
    return [(s, g.attn_heads, d, max(1, g.attn_tokens // s)) for d in g.attn_head_dims for s in g.attn_seqs]


def gemm_calls(device: torch.device, shapes: list[tuple[int, int, int]], dtype: torch.dtype
               ) -> list[Callable[[], object]]:
    """One (m x k) @ (k x n) matmul per shape, on contiguous views of three shared buffers."""
    size = lambda f: max(f(m, n, k) for m, n, k in shapes)  # noqa: E731
    bufs = [torch.randn(size(f), device=device, dtype=dtype)
            for f in (lambda m, n, k: m * k, lambda m, n, k: k * n, lambda m, n, k: m * n)]
    calls = []
    for m, n, k in shapes:
        a, b, out = bufs[0][: m * k].view(m, k), bufs[1][: k * n].view(k, n), bufs[2][: m * n].view(m, n)
        calls.append(lambda a=a, b=b, out=out: torch.matmul(a, b, out=out))
    return calls


def attention_calls(device: torch.device, seq: int, heads: int, head_dim: int, batch: int, dtype: torch.dtype
                    ) -> tuple[Callable[[], object], Callable[[], object]]:
    """Causal SDPA forward (recording autograd, as in training), and forward + backward."""
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

    def fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd() -> None:
        fwd().backward(grad)
        q.grad = k.grad = v.grad = None

    return fwd, fwd_bwd


def time_column_sum(timer: Timer, tokens: int, width: int, dtype: torch.dtype) -> float:
    """Achieved bandwidth (bytes read per second) of a sum over the tokens of a ``[tokens, width]`` tensor: how a
    linear layer's bias gradient is reduced (``grad_output.sum(0)``), which on GPUs runs well below a copy."""
    x = torch.randn(tokens, width, device=timer.device).to(dtype)
    return tokens * width * x.element_size() / timer(lambda: x.sum(0))


def time_copy(timer: Timer, nbytes: int) -> float:
    """Achieved bandwidth (bytes read + written per second) of a large device-to-device copy."""
    n = nbytes // 4
    x = torch.empty(n, device=timer.device, dtype=torch.float32).fill_(1.0)
    y = torch.empty_like(x)
    return 2.0 * n * 4 / timer(lambda: y.copy_(x))


def time_adamw(timer: Timer, nbytes: int, tensors: int = 4) -> float:
    """Achieved bandwidth of torch's fused AdamW update (the runtime's optimizer kernel, ``torch._fused_adamw_``)
    over ``tensors`` fp32 tensors of ``nbytes`` of weights in all: bytes per second counted as the cost model
    counts them (StateSpec.adamw_bytes: gradient, weights and both moments read, the last three written)."""
    n = max(1, nbytes // 4 // tensors)
    w, g, m, v = ([torch.rand(n, device=timer.device) for _ in range(tensors)] for _ in range(4))
    step = torch.zeros((), device=timer.device)
    steps = [step] * tensors

    def update() -> None:
        step.add_(1.0)
        torch._fused_adamw_(w, g, m, v, [], steps, lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1,
                            eps=1e-8, amsgrad=False, maximize=False)

    return 7 * 4 * n * tensors / timer(update)


def time_tiny_op(timer: Timer) -> float:
    """Seconds of the smallest kernel: an in-place add on 16 numbers.

    On CUDA, 100 of them are captured in a CUDA graph and replayed, so the result is the device-side cost
    of a kernel (what a busy GPU, with the host running ahead, pays per kernel); eager launches otherwise.
    """
    x = torch.zeros(16, device=timer.device)
    if timer.cuda:
        try:
            stream = torch.cuda.Stream(timer.device)
            stream.wait_stream(torch.cuda.current_stream(timer.device))
            with torch.cuda.stream(stream):
                for _ in range(3):
                    x.add_(1.0)
            torch.cuda.current_stream(timer.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(100):
                    x.add_(1.0)
            return timer(graph.replay) / 100
        except RuntimeError:
            pass
    return timer(lambda: x.add_(1.0))


def run_all(device: torch.device, precision: str, quick: bool,
            tick: Callable[[str, float], None] = lambda what, done: None,
            sync: Callable[[], object] = lambda: None) -> dict:
    """Every single-device measurement; ``tick(what, fraction)`` reports progress (one unit per shape);
    ``sync()`` (a barrier) keeps the ranks measuring the same thing at the same time."""
    dtype = TORCH_DTYPES[precision]
    g = grid_for(device, quick)
    timer = Timer(device, min_window_s=0.003 if device.type == "cuda" else 0.002, repeats=3 if quick else 5,
                  sync=sync)
    shapes = gemm_shapes(g)
    secs = timer.many(gemm_calls(device, shapes, dtype), lambda f: tick("gemm", f))
    out: dict = {"gemm": [{"m": m, "n": n, "k": k, "seconds": t} for (m, n, k), t in zip(shapes, secs)]}
    ashapes = attention_shapes(g)
    calls = [c for s, h, d, b in ashapes for c in attention_calls(device, s, h, d, b, dtype)]
    secs = timer.many(calls, lambda f: tick("attention", f))
    out["attention"] = []
    for i, (s, h, d, b) in enumerate(ashapes):
        t_f, t_fb = secs[2 * i], secs[2 * i + 1]
        out["attention"].append({"seq": s, "heads": h, "head_dim": d, "batch": b, "fwd_s": t_f,
                                 "bwd_s": max(t_fb - t_f, 0.25 * t_fb)})
    out["copy_Bps"] = time_copy(timer, g.copy_bytes)
    out["adamw_Bps"] = time_adamw(timer, g.copy_bytes // 4)
    if device.type == "cuda":  # the bias gradients' reduction (CPUs: inside layer_probe's elementwise fit)
        out["column_sum_Bps"] = time_column_sum(timer, 16384, 4096 if quick else 8192, dtype)
    tick("memory", 1.0)
    out["tiny_op_s"] = time_tiny_op(timer)
    tick("overhead", 1.0)
    out["timing_spread"] = timer.spread()
    return out


def total_ticks(device: torch.device, quick: bool) -> int:
    g = grid_for(device, quick)
    return len(gemm_shapes(g)) + 2 * len(attention_shapes(g)) + 2
