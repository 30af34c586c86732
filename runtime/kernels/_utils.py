"""Shared plumbing for the kernels: backend choice, lazy Triton JIT, launch heuristics.

Kernels are written as plain module-level functions and wrapped in :class:`LazyKernel`, which calls
``triton.jit`` on first launch. Triton decides between the compiler and the CPU interpreter when a
function is decorated (it reads ``TRITON_INTERPRET`` then), so building lazily lets tests set
``TRITON_INTERPRET=1`` at any time before the first launch, whatever imported this package earlier.
"""

import functools
import os
import types
from collections.abc import Callable
from typing import Any

import torch

try:  # triton is optional: the pure-torch references work without it
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = types.SimpleNamespace(constexpr=None)  # kernels' annotations still evaluate
    HAS_TRITON = False

_BACKENDS = ("auto", "triton", "torch")
_backend = "auto"


def set_backend(name: str) -> None:
    """Force 'triton' or 'torch' kernels, or 'auto' (Triton on CUDA tensors, torch references otherwise)."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend must be auto, triton or torch, got {name!r}")
    _backend = name


def get_backend() -> str:
    """The backend set by :func:`set_backend`."""
    return _backend


def interpret_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` runs the Triton kernel (True) or the torch reference (False)."""
    if _backend == "torch":
        return False
    if x.device.type == "cuda":
        if HAS_TRITON:
            return True
        if _backend == "triton":
            raise RuntimeError("kernel backend 'triton' was forced but triton is not importable")
        return False
    if _backend == "auto":
        return False
    # forced 'triton' on a non-CUDA tensor: only the interpreter can run it
    if HAS_TRITON and x.device.type == "cpu" and interpret_enabled():
        return True
    raise RuntimeError(
        f"kernel backend 'triton' on a {x.device.type} tensor needs triton and TRITON_INTERPRET=1 "
        "(CPU interpreter); use set_backend('auto') or 'torch' otherwise")


class LazyKernel:
    """A kernel function that is handed to ``triton.jit`` on first launch: ``LazyKernel(fn)[grid](*args)``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._built: dict[bool, Any] = {}
        functools.update_wrapper(self, fn)

    def build(self) -> Any:
        key = interpret_enabled()
        kernel = self._built.get(key)
        if kernel is None:
            if not HAS_TRITON:
                raise RuntimeError("triton is not importable")
            kernel = self._built[key] = triton.jit(self.fn)
        return kernel

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return self.build()[grid]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def num_warps_for(block_elems: int) -> int:
    """Warps for a program that touches ``block_elems`` elements at once (memory-bound kernels)."""
    if block_elems >= 16384:
        return 16
    if block_elems >= 4096:
        return 8
    if block_elems >= 1024:
        return 4
    return 2


@functools.lru_cache(maxsize=16)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on ``device`` (a small stand-in on CPU, where the interpreter runs)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as a 2-D ``[rows, n]`` tensor whose last dim is unit-stride (a view when possible)."""
    t2 = t.reshape(-1, n)
    if n > 1 and t2.stride(1) != 1:
        t2 = t2.contiguous()
    if t2.shape[0] > 1 and t2.stride(0) < n:  # e.g. broadcast rows: materialise
        t2 = t2.contiguous()
    return t2
