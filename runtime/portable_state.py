"""A rank's training state in a form no plan decides, for checkpoints that load under any other plan.

Each parameter is saved as the full tensor it is a piece of, under its model name, and so are its AdamW moments
(``exp_avg``, ``exp_avg_sq``) and its fp32 master copy where the plan keeps one: keys ``<kind>/<name>``. A
rank contributes the pieces it holds and torch.distributed.checkpoint (DCP) does the resharding:

* ZeRO slices are first gathered over the bucket's group (dp x cp; a MoE model's experts: expert data parallel)
  into whole buckets, and cut into the
  parameters the buckets hold (:func:`local_state`); the replicas then hold equal pieces, which DCP writes once.
* A tensor-parallel shard, or a slice of the routed experts over ep and/or etp
  (:class:`~runtime.parallel.tensor_parallel.ShardSpec`: chunk ``r`` of every segment along one dimension,
  zero-padded; ``Nested``: a slice of such a slice), is several blocks of the full tensor (:class:`Blocks`,
  in DCP's protocol for objects that hold chunks of a tensor). A plan with another tp, or none, asks DCP for
  other blocks of the same full tensor, which it reads from the stored ones that overlap them.
* The copy of a tied embedding that a pipelined plan keeps at the head is saved (and loaded) as the embedding:
  the name it is initialised from (``ParamInfo.init_key``).

Loading builds the same keys for the new plan's pieces (:func:`empty_like_local`, :func:`portable`), lets DCP
fill them, and writes them back into the buckets (:func:`take_loaded`, :func:`restore`). While saving or loading,
a rank holds its parameters' unsliced (but tensor-parallel) state once more besides its own.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from runtime.dtypes import TORCH_DTYPES
from runtime.parallel.mappings import all_gather_into
from runtime.parallel.params import ParamInfo
from runtime.trainer import Trainer

Pieces = dict[str, dict[str, torch.Tensor]]  # kind -> checkpoint name -> this rank's (tensor-parallel) tensor


def kinds(tr: Trainer) -> tuple[str, ...]:
    """What is saved per parameter under this plan."""
    master = any(m is not None for m in tr.opt.master)
    return ("param", "exp_avg", "exp_avg_sq") + (("master",) if master else ())


def _whole_buckets(tr: Trainer, i: int) -> dict[str, torch.Tensor]:
    """Bucket ``i``'s flat tensors of every kind, whole (the owned slices gathered over dp x cp under ZeRO)."""
    dp, opt, b = tr.dp, tr.opt, tr.dp.buckets[i]

    def whole(owned: torch.Tensor) -> torch.Tensor:
        if not dp.zero or b.d == 1:
            return owned
        out = torch.empty(b.size, dtype=owned.dtype, device=owned.device)
        all_gather_into(out, owned.contiguous(), b.group)
        return out

    flats = {"param": whole(b.param_shard) if dp.zero >= 3 else b.param_data,
             "exp_avg": whole(opt.exp_avg[i]), "exp_avg_sq": whole(opt.exp_avg_sq[i])}
    if opt.master[i] is not None:
        flats["master"] = whole(opt.master[i])
    return flats


def _layout(tr: Trainer) -> tuple[dict[str, ParamInfo], dict[str, torch.Size]]:
    """This rank's parameters by checkpoint name: their records and (tensor-parallel) shapes."""
    infos: dict[str, ParamInfo] = {}
    shapes: dict[str, torch.Size] = {}
    for b in tr.dp.buckets:
        for s in b.spans:
            infos[s.info.init_key], shapes[s.info.init_key] = s.info, s.shape
    return infos, shapes


def local_state(tr: Trainer) -> tuple[Pieces, dict[str, ParamInfo]]:
    """This rank's parameters (tensor-parallel shards, ZeRO slices gathered) and their state, by checkpoint name."""
    parts: dict[str, dict[str, list[torch.Tensor]]] = {}
    for i, b in enumerate(tr.dp.buckets):
        for kind, flat in _whole_buckets(tr, i).items():
            for s in b.spans:  # a parameter may span two buckets: its pieces come in order
                parts.setdefault(kind, {}).setdefault(s.info.init_key, []).append(flat[s.start:s.end])
    infos, shapes = _layout(tr)
    return {k: {n: torch.cat(v).view(shapes[n]) for n, v in by.items()} for k, by in parts.items()}, infos


class Blocks:
    """Rectangular blocks of one full tensor held by this rank, by their offsets in it, in the protocol DCP uses
    for objects that hold chunks of a tensor (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``): saved as chunks of the full tensor, loaded with any overlapping stored chunks."""

    def __init__(self, full: torch.Size, blocks: list[tuple[torch.Size, torch.Tensor]]) -> None:
        self.full, self.blocks = full, blocks

    def size(self) -> torch.Size:
        return self.full

    def __create_write_items__(self, fqn: str, _obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.full))
                for off, t in self.blocks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=t.size()) for off, t in self.blocks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, t in self.blocks:
            if off == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no block at {index.offset}")


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds the blocks of a :class:`Blocks` value."""

    def lookup_object(self, index: MetadataIndex) -> object:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Blocks) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also finds the blocks of a :class:`Blocks` value (and keeps such values
    away from its set-up, which replaces objects it does not know by None)."""

    def set_up_planner(self, state_dict: dict, metadata=None, is_coordinator: bool = False) -> None:  # noqa: ANN001
        blocks = {k: v for k, v in state_dict.items() if isinstance(v, Blocks)}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in blocks}, metadata, is_coordinator)
        self.state_dict.update(blocks)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Blocks) else super().lookup_tensor(index)


def portable(pieces: Pieces, infos: dict[str, ParamInfo]) -> dict[str, object]:
    """The DCP state dict of ``pieces``, keys ``<kind>/<name>``: whole tensors as they are, tensor-parallel shards as
    :class:`Blocks` (copies: after a load, :func:`take_loaded` brings them back into ``pieces``)."""
    out: dict[str, object] = {}
    for kind, by in pieces.items():
        for name, t in by.items():
            spec = infos[name].shard
            if spec is None:
                out[f"{kind}/{name}"] = t
                continue
            blocks = [(torch.Size(b.full), b.of(t).contiguous()) for b in spec.blocks(t.shape)]
            out[f"{kind}/{name}"] = Blocks(spec.full_shape(t.shape), blocks)
    return out


def empty_like_local(tr: Trainer) -> tuple[Pieces, dict[str, ParamInfo]]:
    """Zero tensors shaped as this rank's pieces, to load into (padding stays zero)."""
    infos, shapes = _layout(tr)
    pieces: Pieces = {}
    for kind in kinds(tr):
        dtype = TORCH_DTYPES[tr.state.params] if kind == "param" else torch.float32
        pieces[kind] = {n: torch.zeros(shapes[n], dtype=dtype, device=tr.device) for n in shapes}
    return pieces, infos


def restore(tr: Trainer, pieces: Pieces) -> None:
    """Write loaded pieces into the buckets: the parameters (ZeRO-3: the owned slices), the moments and masters."""
    dp, opt = tr.dp, tr.opt
    taken: dict[str, int] = {}  # elements of each parameter already placed (it may span two buckets)
    for i, b in enumerate(dp.buckets):
        whole = {k: torch.zeros(b.size, dtype=b.param_shard.dtype if k == "param" else torch.float32,
                                device=tr.device) for k in pieces}
        for s in b.spans:
            name, n = s.info.init_key, s.end - s.start
            at = taken.get(name, 0)
            for k in pieces:
                whole[k][s.start:s.end] = pieces[k][name].reshape(-1)[at:at + n]
            taken[name] = at + n
        with torch.no_grad():
            if dp.zero >= 3:
                b.param_shard.copy_(whole["param"][b.lo:b.hi])
                if b.gathered:
                    b.param_data.copy_(whole["param"])
            else:
                b.param_data.copy_(whole["param"])
            opt.exp_avg[i].copy_(whole["exp_avg"][b.lo:b.hi])
            opt.exp_avg_sq[i].copy_(whole["exp_avg_sq"][b.lo:b.hi])
            if opt.master[i] is not None:
                opt.master[i].copy_(whole["master"][b.lo:b.hi])


def take_loaded(state: dict[str, object], pieces: Pieces, infos: dict[str, ParamInfo]) -> None:
    """Copy what DCP loaded into :func:`portable`'s blocks back into ``pieces`` (whole tensors load in place; the
    padding of shards stays zero)."""
    for kind, by in pieces.items():
        for name, t in by.items():
            spec = infos[name].shard
            if spec is None:
                continue
            blocks = state[f"{kind}/{name}"]
            assert isinstance(blocks, Blocks)
            for b, (_, loaded) in zip(spec.blocks(t.shape), blocks.blocks):
                b.of(t).copy_(loaded)
