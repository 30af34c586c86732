"""Shared plumbing for the kernels: backend choice, lazy Triton import and JIT, launch heuristics.

Triton picks between its compiler and its CPU interpreter when ``triton`` is first imported (its own
``tl.sum``/``tl.max`` are ``@jit`` functions built then) and again when each kernel is decorated: both
read ``TRITON_INTERPRET``. So this package never imports triton at import time. Kernels are plain
module-level functions (string annotations, ``from __future__ import annotations``) wrapped in
:class:`LazyKernel`, which imports triton, binds ``tl`` in the kernel's module and calls ``triton.jit`` on
first launch. Tests can therefore set ``TRITON_INTERPRET=1`` at any point before the first launch, even
after this package (or the models using it) were imported, as long as nothing imported triton before.
"""

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None  # optional: the torch references need nothing

_BACKENDS = ("auto", "triton", "torch", "native")
_backend = "auto"


def set_backend(name: str) -> None:
    """Force 'triton' or 'torch' kernels, or 'auto' (Triton on CUDA tensors, torch references otherwise), or
    'native': as 'auto', except that the plain norms run torch's own fused ``F.rms_norm`` / ``F.layer_norm`` on
    every device (a GPU session measured them 3-4x faster forward + backward than our kernels in the kernel
    benchmark; `benchmarks/single_gpu_step.py --backends auto,native` compares whole steps before it becomes the
    default)."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend must be auto, triton, torch or native, got {name!r}")
    _backend = name


def get_backend() -> str:
    """The backend set by :func:`set_backend`."""
    return _backend


def interpret_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def native_norms() -> bool:
    """Whether the plain norms run torch's own fused ops (backend 'native')."""
    return _backend == "native"


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
    if _backend in ("auto", "native"):
        return False
    # forced 'triton' on a non-CUDA tensor: only the interpreter can run it
    if HAS_TRITON and x.device.type == "cpu" and interpret_enabled():
        return True
    raise RuntimeError(
        f"kernel backend 'triton' on a {x.device.type} tensor needs triton and TRITON_INTERPRET=1 "
        "(CPU interpreter); use set_backend('auto') or 'torch' otherwise")


def triton_interpreted() -> bool | None:
    """Whether the imported triton was set up for the interpreter (None: triton not imported yet)."""
    import sys

    std = sys.modules.get("triton.language.standard")
    if std is None:
        return None
    return type(std.sum).__name__ == "InterpretedFunction"


class LazyKernel:
    """A kernel function that is handed to ``triton.jit`` on first launch: ``LazyKernel(fn)[grid](*args)``.

    ``helpers``: plain module-level functions the kernel calls; each is jitted on build and its module name is
    rebound to the jitted version (Triton resolves callees by name at compile time); every build re-jits the
    plain function kept here."""

    def __init__(self, fn: Callable[..., Any], helpers: tuple[Callable[..., Any], ...] = ()) -> None:
        self.fn = fn
        self.helpers = helpers
        self._built: dict[bool, Any] = {}
        functools.update_wrapper(self, fn)

    def build(self) -> Any:
        key = interpret_enabled()
        kernel = self._built.get(key)
        if kernel is None:
            if not HAS_TRITON:
                raise RuntimeError("triton is not importable")
            triton = importlib.import_module("triton")
            if triton_interpreted() != key:
                raise RuntimeError(
                    f"TRITON_INTERPRET={int(key)} now, but triton was imported with the other setting; "
                    "set TRITON_INTERPRET before anything imports triton")
            self.fn.__globals__["tl"] = importlib.import_module("triton.language")
            for helper in self.helpers:
                helper.__globals__["tl"] = self.fn.__globals__["tl"]
                self.fn.__globals__[helper.__name__] = triton.jit(helper)
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


MAX_ROW = 65536  # the widest row one program of a row-wise (norm) kernel holds; wider rows use the reference


@dataclass
class RowKernelConfig:
    """Launch knobs of the row-wise (norm) kernels; module-level instances are tuned by the benchmark."""

    fwd_elems: int = 4096  # elements one forward program holds (rows x padded hidden): several short rows
    bwd_elems: int = 4096  # the same for one backward loop iteration
    bwd_programs_per_sm: int = 2  # backward programs (each loops over row blocks, owns a dweight partial)
    fwd_warps: int | None = None  # None: from the block size
    bwd_warps: int | None = None

    def block(self, n: int, backward: bool = False) -> tuple[int, int, int]:
        """(rows per block, padded hidden, num_warps) for rows of ``n`` elements."""
        block_n = next_pow2(n)
        block_m = max(1, min(16, (self.bwd_elems if backward else self.fwd_elems) // block_n))
        warps = self.bwd_warps if backward else self.fwd_warps
        return block_m, block_n, warps or num_warps_for(block_m * block_n)

    def bwd_grid(self, rows: int, block_m: int, device: torch.device) -> tuple[int, int]:
        """(programs, row blocks per program) for the backward."""
        n_blocks = cdiv(rows, block_m)
        per_prog = cdiv(n_blocks, max(1, min(n_blocks, self.bwd_programs_per_sm * sm_count(device))))
        return max(1, cdiv(n_blocks, per_prog)), per_prog


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
