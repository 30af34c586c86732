"""``parallelize(model, cfg, groups)``: cut this rank's pipeline chunks out of a meta-device model and apply
tensor/sequence parallelism and recompute; ``materialize`` then allocates and initialises them.

Flags set on parameters (read by the data-parallel layer, the optimizer and the checkpoints):

* ``shard`` — a :class:`~runtime.parallel.tensor_parallel.ShardSpec` for tensor-parallel shards;
* ``sequence_parallel`` — replicated over tp but fed by sequence shards: gradient summed over tp;
* ``tied_embedding`` — the embedding and its copy in the last stage's head (pp > 1): gradients summed
  over the first and last stage;
* ``duplicate`` — a copy of a value counted elsewhere (a replica on tp rank > 0, the head's copy of a tied
  embedding): left out of the gradient norm.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from runtime.models.common import Transformer, init_parameters
from runtime.parallel.mesh import ParallelGroups
from runtime.parallel.recompute import apply_recompute
from runtime.parallel.tensor_parallel import apply_tensor_parallel
from specs.model import ModelSpec
from specs.parallel import ParallelConfig


def stage_layer_ids(cfg: ParallelConfig, num_layers: int, vstage: int) -> range:
    sizes = cfg.stage_layers(num_layers)
    start = sum(sizes[:vstage])
    return range(start, start + sizes[vstage])


def parallelize(model: Transformer, cfg: ParallelConfig, groups: ParallelGroups) -> list[Transformer]:
    """This pipeline rank's model chunks (virtual stages ``c * pp + pp_rank``), still on the meta device."""
    spec = model.spec
    nv = cfg.pp * cfg.vpp
    chunks = []
    for c in range(cfg.vpp):
        v = c * cfg.pp + groups.pp_rank
        st = model.stage(stage_layer_ids(cfg, spec.num_layers, v), first=v == 0, last=v == nv - 1)
        apply_tensor_parallel(st, groups, cfg.sp and cfg.tp > 1)
        apply_recompute(st, cfg, v)
        _mark(st, spec, cfg, groups)
        chunks.append(st)
    return chunks


def _mark(st: Transformer, spec: ModelSpec, cfg: ParallelConfig, groups: ParallelGroups) -> None:
    for p in st.parameters():
        p.duplicate = groups.tp_rank > 0 and not hasattr(p, "shard")  # type: ignore[attr-defined]
        p.tied_embedding = False  # type: ignore[attr-defined]
    if spec.tie_embeddings and cfg.pp > 1:
        if st.embed is not None:
            st.embed.tok.weight.tied_embedding = True  # type: ignore[attr-defined]
        if st.head is not None:
            st.head.out.weight.tied_embedding = True  # type: ignore[attr-defined]
            st.head.out.weight.duplicate = True  # type: ignore[attr-defined]


def materialize(chunks: list[Transformer], spec: ModelSpec, seed: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> None:
    """Allocate the chunks' parameters on ``device`` (keeping their flags and ties) and initialise them."""
    fresh: dict[int, nn.Parameter] = {}
    for mod in itertools.chain.from_iterable(c.modules() for c in chunks):
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in fresh:
                q = nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype), requires_grad=p.requires_grad)
                q.__dict__.update(p.__dict__)
                fresh[id(p)] = q
            mod._parameters[name] = fresh[id(p)]
    for c in chunks:
        init_parameters(c, spec, seed)
