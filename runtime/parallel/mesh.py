"""Process groups for a plan, built on a DeviceMesh.

Rank order on the mesh is ``(pp, dp, cp, tp)`` with **tp innermost**: global rank
``r = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``. A tensor-parallel group is ``tp``
consecutive ranks (inside one node); pipeline stages are the outermost blocks of ``dp*cp*tp`` ranks.

A mixture-of-experts model's routed experts fold the ``dp*cp*tp`` ranks of each stage into ``(edp, ep, etp)`` (etp
innermost, as Megatron-Core's MoE parallel folding and ``specs.parallel.edp``): the ``ep`` ranks of an expert-parallel
group hold different experts and exchange tokens; the ``edp`` ranks of an expert-data-parallel group hold the same
experts and reduce their gradients; the ``etp`` ranks of an expert-tensor-parallel group split each expert's width.

Nothing is global: :func:`build_groups` returns a :class:`ParallelGroups` that is passed to whatever
needs a group. It may be built over a subset of the world (the tests run several plans inside one pool
of workers); every rank of the default group must call it, and ranks outside the subset get ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from runtime.parallel.hierarchy import Hierarchy, hierarchies
from specs.parallel import MESH_DIMS, SEQ_GROUP, ParallelConfig
from specs.placement import entry_groups

# The ranks of a pipeline stage folded for a mixture-of-experts model's routed experts (etp innermost), the stage
# outermost as on the mesh (:data:`MESH_DIMS`)
EXPERT_DIMS = ("pp", "edp", "ep", "etp")

# group attribute -> short name (ParallelGroups.group_names); the first match names a group object used for several
_GROUP_NAMES = (("tp_group", "tp"), ("cp_group", "cp"), ("dpcp_group", "dp"), ("dp_group", "dp"),
                ("act_group", "pp"), ("grad_group", "pp"), ("pp_group", "pp"), ("embed_group", "embed"),
                ("mp_group", "mp"), ("ep_group", "ep"), ("edp_group", "edp"), ("etp_group", "etp"),
                ("seq_group", SEQ_GROUP),
                ("world", "world"))


@dataclass
class ParallelGroups:
    """This rank's coordinates and the groups it takes part in (all ``ProcessGroup``s)."""

    cfg: ParallelConfig
    mesh: DeviceMesh
    ranks: list[int]  # global ranks of the job in mesh order
    rank: int  # global rank
    pp_rank: int
    dp_rank: int
    cp_rank: int
    tp_rank: int
    world: dist.ProcessGroup  # every rank of the job
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dpcp_group: dist.ProcessGroup  # dp x cp: where data parallelism reduces gradients and ZeRO shards state
    pp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup  # tp x pp ranks holding one replica of the reduced gradients: grad-norm sums
    act_group: dist.ProcessGroup  # pipeline activations (forward direction)
    grad_group: dist.ProcessGroup  # pipeline gradients (backward direction); separate so each FIFO stays ordered
    embed_group: dist.ProcessGroup | None  # first + last pipeline stage, for a tied embedding (pp > 1)
    ep_group: dist.ProcessGroup | None = None  # MoE: the ranks that split the experts and exchange tokens (ep > 1)
    seq_group: dist.ProcessGroup | None = None  # MoE: the cp x tp ranks holding shards of the same sequences
    etp_group: dist.ProcessGroup | None = None  # MoE: the ranks that split each expert's width (etp > 1)
    etp_rank: int = 0
    edp_group: dist.ProcessGroup | None = None  # MoE: the ranks that hold the same experts (expert data parallel)
    ep_rank: int = 0
    edp_rank: int = 0
    # a pipeline rank split over node groups (placement a+b): its dp x cp collectives, hierarchical over the groups
    dp_hierarchy: Hierarchy | None = None

    @property
    def tp(self) -> int:
        return self.cfg.tp

    @property
    def dp(self) -> int:
        return self.cfg.dp

    @property
    def pp(self) -> int:
        return self.cfg.pp

    @property
    def cp(self) -> int:
        return self.cfg.cp

    @property
    def dpcp(self) -> int:
        """Ranks of the data-parallel group (dp x cp): each holds a replica of the same parameters."""
        return self.cfg.dp * self.cfg.cp

    @property
    def ep(self) -> int:
        return self.cfg.ep

    @property
    def etp(self) -> int:
        return self.cfg.etp

    @property
    def edp(self) -> int:
        """Ranks of the expert-data-parallel group: ``dp*cp*tp / (ep*etp)``."""
        return self.cfg.edp

    @property
    def dpcp_rank(self) -> int:
        """This rank's index in ``dpcp_group`` (dp major, cp minor, as on the mesh), the ZeRO slice it owns; split
        over node groups, the slice its :class:`Hierarchy` owns."""
        if self.dp_hierarchy is not None:
            return self.dp_hierarchy.rank
        return self.dp_rank * self.cfg.cp + self.cp_rank

    @property
    def dp_reduce_group(self) -> dist.ProcessGroup | Hierarchy:
        """Where gradients are reduced and ZeRO state sharded and gathered: ``dpcp_group``, or its hierarchy."""
        return self.dp_hierarchy if self.dp_hierarchy is not None else self.dpcp_group

    def global_rank(self, pp: int, dp: int, cp: int, tp: int) -> int:
        return self.ranks[self.cfg.rank_of(pp, dp, cp, tp)]

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of the same (dp, cp, tp) position on pipeline rank ``pp_rank`` (mod pp)."""
        return self.global_rank(pp_rank % self.pp, self.dp_rank, self.cp_rank, self.tp_rank)

    def group_names(self) -> dict[int, str]:
        """A short name for each of this rank's groups, by ``id`` (what the communication ledger and the hang
        watchdog call them; a group object used for several is named by the first)."""
        names: dict[int, str] = {}
        for attr, name in _GROUP_NAMES:
            g = getattr(self, attr)
            if g is not None:
                names.setdefault(id(g), name)
        for g in self.dp_hierarchy.groups if self.dp_hierarchy is not None else ():
            names.setdefault(id(g), "dp")
        return names

    def destroy(self) -> None:
        """Free the groups this object created (the job's, the mesh's and the extra ones)."""
        mine = {self.world, self.mp_group, self.dpcp_group, self.act_group, self.grad_group, self.embed_group,
                self.ep_group, self.edp_group, self.seq_group, self.etp_group, *self.mesh.get_all_groups(),
                *(self.dp_hierarchy.groups if self.dp_hierarchy is not None else ())}
        for g in mine:
            if g is not None and g is not dist.group.WORLD:
                dist.destroy_process_group(g)


def _new_groups(layout: torch.Tensor, names: tuple[str, ...], me: int,
                dims: tuple[str, ...] = MESH_DIMS) -> dist.ProcessGroup | None:
    """Create one group per index of the dims of ``layout`` (named by ``dims``) not in ``names``: each group spans
    those ``names`` (every rank calls); return the one holding ``me``."""
    keep = [dims.index(name) for name in names]
    order = [d for d in range(layout.dim()) if d not in keep] + keep
    flat = layout.permute(order).reshape(-1, int(torch.tensor([layout.shape[d] for d in keep]).prod()))
    mine = None
    for row in flat.tolist():
        g = dist.new_group(row)
        if me in row:
            mine = g
    return mine


def build_groups(cfg: ParallelConfig, device_type: str, ranks: list[int] | None = None,
                 tied_embeddings: bool = False, experts: bool = False) -> ParallelGroups | None:
    """Build the mesh and groups of a plan over ``ranks`` (default: the whole world).

    ``tied_embeddings`` adds the first-and-last-stage groups that sum a tied embedding's gradient (pp > 1);
    ``experts`` (a mixture-of-experts model) the expert-parallel and expert-data-parallel groups.
    """
    world = dist.get_world_size()
    ranks = list(range(world)) if ranks is None else list(ranks)
    if len(ranks) != cfg.world:
        raise ValueError(f"the plan needs {cfg.world} ranks, got {len(ranks)}")
    me = dist.get_rank()
    layout = torch.tensor(ranks, dtype=torch.int64).view(cfg.mesh_shape)
    mesh = DeviceMesh(device_type, layout, mesh_dim_names=MESH_DIMS)
    job = dist.group.WORLD if len(ranks) == world else dist.new_group(ranks)
    mp = _new_groups(layout, ("pp", "tp"), me)  # cp ranks hold the same gradients after the dp x cp reduce
    dpcp = _new_groups(layout, ("dp", "cp"), me) if cfg.cp > 1 else None  # dp x 1 is the mesh's dp group
    act, grad = dist.new_group(ranks), dist.new_group(ranks)  # p2p only: one group each over the job
    embed = None
    if cfg.pp > 1 and tied_embeddings:
        ends = layout[[0, cfg.pp - 1]]  # [2, dp, cp, tp]: the first and the last stage
        embed = _new_groups(ends, ("pp",), me)
    folded = layout.reshape([getattr(cfg, d) for d in EXPERT_DIMS])
    ep = _new_groups(folded, ("ep",), me, EXPERT_DIMS) if experts and cfg.ep > 1 else None
    etp = _new_groups(folded, ("etp",), me, EXPERT_DIMS) if experts and cfg.etp > 1 else None
    edp = _new_groups(folded, ("edp",), me, EXPERT_DIMS) if experts else None
    seq = _new_groups(layout, ("cp", "tp"), me) if experts and cfg.cp > 1 and cfg.tp > 1 else None
    parts = [len(entry_groups(e)) for e in cfg.placement] if cfg.placement else [1] * cfg.pp
    hier = hierarchies(layout, parts, me, eager=device_type == "cuda") if max(parts) > 1 else None
    if me not in ranks:
        return None
    coord = mesh.get_coordinate()
    assert coord is not None
    at = dict(zip(MESH_DIMS, coord))
    folded_at = dict(zip(EXPERT_DIMS, map(int, (folded == me).nonzero()[0])))  # its place among the experts' ranks
    return ParallelGroups(
        cfg=cfg, mesh=mesh, ranks=ranks, rank=me,
        pp_rank=at["pp"], dp_rank=at["dp"], cp_rank=at["cp"], tp_rank=at["tp"],
        world=job, tp_group=mesh.get_group("tp"), dp_group=mesh.get_group("dp"), cp_group=mesh.get_group("cp"),
        dpcp_group=mesh.get_group("dp") if dpcp is None else dpcp, pp_group=mesh.get_group("pp"), mp_group=mp,
        act_group=act, grad_group=grad, embed_group=embed, ep_group=ep, edp_group=edp,
        seq_group=seq if seq is not None else mesh.get_group("cp" if cfg.cp > 1 else "tp") if experts else None,
        ep_rank=folded_at["ep"], edp_rank=folded_at["edp"], etp_group=etp, etp_rank=folded_at["etp"],
        dp_hierarchy=hier,
    )
