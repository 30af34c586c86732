"""Replay a plan's ranks on the meta device and count the bytes they keep alive: a check of the memory model.

Each pipeline rank of the plan (tensor-, data- and context-parallel ranks hold the same) is built by the real
runtime (:class:`runtime.trainer.Trainer`) on the meta device, in a fake process group of the plan's world
size (collectives and sends return at once, nothing is computed or allocated), and trained for two steps
while a dispatch mode counts every tensor storage from its creation until it is freed. What it reports:

- ``state_bytes``: live between steps (weights, gradient buffers, optimizer state);
- ``peak_bytes``: the most live at once in a steady step (the second): the state, the activations of the
  micro-batches in flight, and the temporaries of the op running at that moment. A step runs at most 2 pp
  micro-batches (``specs.schedules.repeating_from``): more only repeat the same pattern and peak.

No allocator is replayed (its rounding and fragmentation, the CUDA context and NCCL buffers are the memory
model's ``allocator_and_reserved``). The runtime's ops are counted as they run on a GPU: its Triton kernels'
allocations and saved tensors (launches skipped), and attention through ``F.scaled_dot_product_attention`` as a
fused (flash) kernel keeps it: its output and an fp32 log-sum-exp per head and token, the three input gradients
in the backward (the meta device would otherwise take the unfused math path).
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from runtime.parallel.mesh import build_groups
from runtime.trainer import Trainer
from specs.errors import AutoparError
from specs.planfile import PlanFile
from specs.schedules import repeating_from

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the meta tensor storages alive (each storage once, from the op that made it until it
    is freed, following its resizes: ZeRO-3 frees gathered parameters by resizing their storage to zero) and the
    most at once since :meth:`reset_peak`. A tensor's value read on the host (``float(t)``, ``if t > x``) reads
    as zero: nothing is computed on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> its id
        self._bytes: dict[int, int] = {}  # id -> bytes counted

    def __enter__(self):
        original = torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = original(storage, size)
            if storage in self._seen:
                self._count(id(storage), storage.nbytes())
            return out

        self._patch = mock.patch.object(torch.UntypedStorage, "resize_", resize_)
        self._patch.start()
        return super().__enter__()

    def __exit__(self, *exc):
        self._patch.stop()
        return super().__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak = self.live

    def _count(self, key: int, nbytes: int) -> None:
        self.live += nbytes - self._bytes.get(key, 0)
        self._bytes[key] = nbytes
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self._bytes.pop(key, 0)  # (0: a finalizer cut short by Ctrl-C may run again at exit)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        key = id(storage)
        self._seen[storage] = key
        weakref.finalize(storage, self._free, key)
        self._count(key, storage.nbytes())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _LOCAL_SCALAR and args[0].device.type == "meta":
            return False if args[0].dtype == torch.bool else 0
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                self._track(t)
        return out


class _FusedAttention(torch.autograd.Function):
    """The memory of a fused attention kernel: it keeps q, k, v, its output and an fp32 log-sum-exp [b, h, s];
    its backward makes the gradients of q, k and v."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _out, _lse = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fused_attention(q, k, v, *args, **kwargs) -> torch.Tensor:
    return _FusedAttention.apply(q, k, v)


class _Tokens:
    """Zero tokens of a step's rows (their values do not matter on the meta device)."""

    def __init__(self, seq: int) -> None:
        self.seq = seq

    def batch(self, step: int, global_batch: int, dp_rank: int = 0, dp: int = 1,
              positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        cols = self.seq if positions is None else len(positions)
        rows = torch.zeros(global_batch // dp, cols, dtype=torch.int64)
        return rows, rows.clone()


@contextlib.contextmanager
def _kernels_as_on_gpu() -> Iterator[None]:
    """The runtime's fused ops take their Triton path, as on CUDA, with every kernel launch skipped: what they
    allocate and save for the backward is counted, nothing is computed. (Without triton installed, the torch
    references that CPU runs use are counted; they keep more, e.g. fp32 copies in the norms.)"""
    import runtime.kernels as kernels

    try:
        from triton.runtime.jit import KernelInterface
    except ImportError:
        yield
        return
    with mock.patch.object(kernels, "use_triton", lambda x: True), \
            mock.patch.object(KernelInterface, "__getitem__", lambda self, grid: lambda *a, **k: None):
        yield


@dataclass
class RankReplay:
    pp_rank: int
    state_bytes: int
    peak_bytes: int


@contextlib.contextmanager
def _fake_world(plan: PlanFile, rank: int) -> Iterator[None]:
    """A fake process group of the plan's world size in which this process is ``rank``."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    except ImportError as err:  # pragma: no cover - a torch build without its testing package
        raise AutoparError(f"the memory replay needs torch's fake process group ({err}); use a full torch "
                           "install") from None
    if dist.is_initialized():
        raise AutoparError("the memory replay runs in a process without a process group")
    dist.init_process_group("meta:fake,cpu:fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    try:
        yield
    finally:
        with _quiet_stderr():  # c10d warns that the fake group has no backend for "undefined" devices
            dist.destroy_process_group()


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Native code's writes to stderr dropped for the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def replay_rank(plan: PlanFile, pp_rank: int) -> RankReplay:
    """Build pipeline rank ``pp_rank`` of ``plan`` on the meta device and train it two steps, counting bytes."""
    cfg = plan.config
    rank = pp_rank * cfg.dp * cfg.cp * cfg.tp  # (pp, dp, cp, tp) rank order: dp, cp and tp rank 0
    m = min(cfg.microbatches(plan.global_batch), repeating_from(cfg.pp))  # more only repeat the same peak
    plan = plan.model_copy(update={"global_batch": m * cfg.mbs * cfg.dp})
    with _fake_world(plan, rank):
        groups = build_groups(cfg, "meta", tied_embeddings=plan.model.tie_embeddings,
                              experts=plan.model.moe is not None)
        with LiveBytes() as live, mock.patch.object(F, "scaled_dot_product_attention", _fused_attention), \
                _kernels_as_on_gpu():
            trainer = Trainer(plan, groups, torch.device("meta"), _Tokens(plan.seq), steps=2)  # type: ignore[arg-type]
            trainer.train_step()  # the first step also makes the optimizer's lazily created state
            live.reset_peak()
            trainer.train_step()
            peak, state = live.peak, live.live
            del trainer
    return RankReplay(pp_rank=pp_rank, state_bytes=state, peak_bytes=peak)


def replay(plan: PlanFile) -> list[RankReplay]:
    """Every pipeline rank's :func:`replay_rank`."""
    return [replay_rank(plan, p) for p in range(plan.config.pp)]
