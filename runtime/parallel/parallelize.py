"""``parallelize(model, cfg, groups)``: cut this rank's pipeline chunks out of a meta-device model, apply
tensor/sequence parallelism, recompute and context parallelism, and record each parameter's
:class:`~runtime.parallel.params.ParamInfo` (its shard, the groups that reduce its gradient, whether the norm counts
it, its init key); ``materialize`` then allocates and initialises the chunks.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from runtime.models.common import Transformer, init_parameters
from runtime.parallel.context_parallel import apply_context_parallel
from runtime.parallel.expert_parallel import apply_expert_parallel, routed_expert_params
from runtime.parallel.mesh import ParallelGroups
from runtime.parallel.params import DP, DP_EMBED, DP_TP, EDP, ParamInfo, ParamTable
from runtime.parallel.recompute import apply_recompute
from runtime.parallel.tensor_parallel import apply_tensor_parallel, param_shards
from specs.model import ModelSpec
from specs.parallel import ParallelConfig
from specs.schedules import virtual_stage

EMBED, HEAD = "embed.tok.weight", "head.out.weight"


def stage_layer_ids(cfg: ParallelConfig, num_layers: int, vstage: int) -> range:
    sizes = cfg.stage_layers(num_layers)
    start = sum(sizes[:vstage])
    return range(start, start + sizes[vstage])


def parallelize(model: Transformer, cfg: ParallelConfig,
                groups: ParallelGroups) -> tuple[list[Transformer], ParamTable]:
    """This pipeline rank's model chunks (virtual stages ``c * pp + pp_rank``), still on the meta device, and the
    record of each of their parameters."""
    spec = model.spec
    nv = cfg.pp * cfg.vpp
    chunks: list[Transformer] = []
    infos: dict[str, ParamInfo] = {}
    for c in range(cfg.vpp):
        v = virtual_stage(groups.pp_rank, c, cfg.pp)
        st = model.stage(stage_layer_ids(cfg, spec.num_layers, v), first=v == 0, last=v == nv - 1)
        apply_tensor_parallel(st, groups, cfg.sequence_parallel, cfg.tensor_overlap)
        apply_expert_parallel(st, groups, cfg.sequence_parallel)
        apply_recompute(st, cfg, v)
        apply_context_parallel(st, groups, cfg.sequence_parallel)  # after recompute: see its docstring
        infos.update(param_infos(st, spec, cfg, groups.tp_rank))
        chunks.append(st)
    return chunks, ParamTable(infos)


def param_infos(st: Transformer, spec: ModelSpec, cfg: ParallelConfig, tp_rank: int) -> dict[str, ParamInfo]:
    """The records of one (tensor-parallel) stage's parameters, by full name.

    Under sequence parallelism a parameter held whole on every tp rank sees one sequence shard: its gradient is
    also summed over tp. A tied embedding split over the two ends of the pipeline (pp > 1) sums its two
    gradients; the head's copy is drawn as the embedding and left out of the norm, as is every replica of a
    whole parameter on tp rank > 0. A MoE layer's routed experts are sliced over ep and reduced over the
    expert-data-parallel group (expert_parallel.py)."""
    shards = param_shards(st)
    experts = routed_expert_params(st)
    sp = cfg.sequence_parallel
    split_tied = spec.tie_embeddings and cfg.pp > 1
    out = {}
    for name, p in st.named_parameters():
        shard = shards.get(id(p))
        head_copy = split_tied and name == HEAD
        if id(p) in experts:
            out[name] = ParamInfo(name, shard, EDP, True, name, experts[id(p)])
            continue
        if split_tied and name in (EMBED, HEAD):
            reduce = DP_EMBED
        else:
            reduce = DP_TP if sp and shard is None else DP
        in_norm = not head_copy and (shard is not None or tp_rank == 0)
        out[name] = ParamInfo(name, shard, reduce, in_norm, EMBED if head_copy else name)
    return out


def materialize(chunks: list[Transformer], table: ParamTable, spec: ModelSpec, seed: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> None:
    """Allocate the chunks' parameters on ``device`` in ``dtype`` (keeping ties) and initialise them."""
    fresh: dict[int, nn.Parameter] = {}
    for mod in itertools.chain.from_iterable(c.modules() for c in chunks):
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in fresh:
                fresh[id(p)] = nn.Parameter(torch.empty(p.shape, device=device, dtype=dtype),
                                            requires_grad=p.requires_grad)
            mod._parameters[name] = fresh[id(p)]
    for c in chunks:
        init_parameters(c, spec, seed, table.infos)
