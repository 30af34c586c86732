"""Multi-rank cases run inside the worker pool (``pool.run("rt_cases:<name>", ...)``), and the plans they use.

Every case function takes the worker's rank first and returns something picklable (numpy arrays), or None
on ranks outside the plan.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from runtime.data import TokenData
from runtime.parallel.buckets import ALIGN
from runtime.parallel.mappings import all_gather_into
from runtime.parallel.mesh import build_groups
from runtime.parallel.tensor_parallel import Nested, ShardSpec
from runtime.trainer import Trainer
from specs.cluster import ClusterSpec
from specs.cluster_loading import cluster_from_dict, load_cluster
from specs.errors import AutoparError
from specs.model import ModelSpec
from specs.moe import MoESpec
from specs.parallel import ParallelConfig
from specs.planfile import PlanFile, TrainConfig, make_plan
from specs.rules import PlanContext, check_plan
from specs.state import StateSpec

TRAIN = TrainConfig(steps=3, lr=3e-3, min_lr=3e-4, warmup_steps=1, weight_decay=0.1, grad_clip=1.0, seed=7)



def gather_full(t: torch.Tensor, spec: ShardSpec | None, group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather a sharded tensor over the tp group and assemble it (replicated tensors come back as is)."""
    if spec is None:
        return t
    shards = [torch.empty_like(t) for _ in range(spec.size)]
    dist.all_gather(shards, t.contiguous(), group=group)
    return spec.assemble(shards)

def case_spec(case: dict[str, Any]) -> ModelSpec:
    """A tiny model for a case: Llama (GQA where tp allows) or GPT (``activation``, ``linear_bias``,
    ``rotary_fraction``, ``max_positions`` as given), 4
    layers, hidden 32, vocab 64, seq 16 (``seq``);
    ``moe``: its layers 0 and 2 a mixture of 8 experts, top-2, one shared expert ("gated": Qwen's sigmoid gate on it,
    "sigmoid": a sigmoid router), or "mixtral": every layer 4 experts, top-2."""
    tp = case.get("tp", 1)
    llama = case.get("arch", "llama") == "llama"
    return ModelSpec(
        name=f"tiny-{case.get('arch', 'llama')}", arch=case.get("arch", "llama"), num_layers=case.get("num_layers", 4),
        hidden_size=32, num_attention_heads=4, num_kv_heads=(2 if tp <= 2 else 4) if llama else None,
        ffn_hidden_size=64 if llama else 96, vocab_size=case.get("vocab", 64), seq_length=case.get("seq", 16),
        tie_embeddings=case.get("tied", False), dropout=case.get("dropout", 0.0), attention=case.get("attention"),
        qkv_bias=case.get("qkv_bias", False), activation=case.get("activation"), linear_bias=case.get("linear_bias"),
        rotary_fraction=case.get("rotary_fraction"), max_positions=case.get("max_positions"),
        moe=_case_moe(case.get("moe")),
    )


def _case_moe(kind: str | None) -> MoESpec | None:
    if kind is None:
        return None
    if kind == "mixtral":  # Mixtral's layout (transformers' MixtralConfig defaults): 4 experts of the MLP's width
        return MoESpec(num_experts=4, experts_per_token=2, moe_ffn_hidden_size=64, aux_loss_coef=0.001)
    return MoESpec(num_experts=8, experts_per_token=2, moe_ffn_hidden_size=32, num_shared_experts=1, layer_freq=2,
                   shared_expert_gate=kind == "gated", router="sigmoid" if kind == "sigmoid" else "softmax")


def case_plan(case: dict[str, Any]) -> PlanFile:
    keys = {k: case[k] for k in ("tp", "pp", "dp", "cp", "ep", "etp", "mbs", "sp", "recompute", "recompute_layers", "zero",
                                  "dp_overlap", "tp_overlap", "layers") if k in case}
    if case.get("sched") == "interleaved":
        keys["vpp"] = 2
    keys.setdefault("mbs", 2 if case.get("tp", 1) == 4 else 1)  # tp=4 collectives are the slow part on 2 cores
    cfg = ParallelConfig(**keys)
    spec = case_spec(case)
    # ``state`` picks the compute precision (default: cpu-gloo's fp32) and with it the model state's precisions (bf16
    # parameters on the CPU: gloo reduces bf16)
    precision = case.get("state", "fp32")
    cluster = load_cluster("cpu-gloo").model_copy(update={"precision": precision})
    context = PlanContext(spec, cfg.world, case.get("global_batch", 8))
    if "placement" in case:  # two simulated node groups of CPU ranks (specs/topology.py)
        a, b = case.get("groups", (cfg.world // 2, cfg.world // 2))  # ranks of group a's node and of b's
        cluster = grouped_cpu_cluster(a, precision, ranks_of_b=b)
        cfg = replace(cfg, placement=case["placement"])
        context = PlanContext.on(spec, cluster, case.get("global_batch", 8))
    check_plan(cfg, context)
    train = TRAIN.model_copy(update={"steps": case.get("steps", 3)})
    # small gradient buckets (several per chunk)
    state = StateSpec.default(precision).model_copy(update={"bucket_params": case.get("bucket_params", 3000)})
    return make_plan(spec, cluster, case.get("global_batch", 8), cfg, train=train, state=state)


def grouped_cpu_cluster(ranks_per_group: int, precision: str = "fp32", ranks_of_b: int | None = None) -> ClusterSpec:
    """Two node groups, ``a`` and ``b``, of one node of ``ranks_per_group`` CPU ranks each (gloo; ``b``'s node of
    ``ranks_of_b`` when given), the second on slower NICs, joined by a slower link."""
    group = lambda name, gbps, n: {"name": name, "gpu": "cpu", "num_nodes": 1, "gpus_per_node": n,  # noqa: E731
                                   "intra_node": {"bandwidth_GBps": 2, "latency_us": 50},
                                   "inter_node": {"nic_bandwidth_Gbps": gbps, "nics_per_node": 1, "latency_us": 50}}
    return cluster_from_dict({"name": "cpu-groups", "backend": "gloo", "precision": precision,
                              "node_groups": [group("a", 10, ranks_per_group),
                                              group("b", 5, ranks_of_b or ranks_per_group)],
                              "between_groups": [{"groups": ["a", "b"], "bandwidth_Gbps_per_node": 2}]}, "cpu-groups")


def full_grads(tr: Trainer) -> dict[str, np.ndarray] | None:
    """Every parameter's synchronised gradient, unsharded (tp shards and ZeRO slices gathered).

    Returned by the rank with tp_rank == dp_rank == 0 of each pipeline stage; None elsewhere.
    """
    g, dp = tr.g, tr.dp
    flat: dict[str, list[torch.Tensor]] = {}
    shapes = {}  # from the spans: a ZeRO-3 parameter is an empty tensor between uses
    for b in dp.buckets:
        full = b.grad_data
        if dp.zero and b.d > 1:  # ZeRO-2/3 keep no whole-bucket gradient: gathered from the slices
            full = torch.empty(b.size, dtype=b.grad_shard.dtype)
            all_gather_into(full, b.grad_shard.contiguous(), b.group)
        for s in b.spans:  # a parameter may span two buckets: its pieces in order
            flat.setdefault(s.info.name, []).append(full[s.start:s.end])
            shapes[s.info.name] = s.shape
    out = {}
    for c in tr.chunks:
        for _, info in tr.params.named(c):
            whole = torch.cat(flat[info.name]).view(shapes[info.name])
            out[info.name] = _unsharded(whole, info, g).float().numpy().copy()
    return out if g.tp_rank == 0 and g.dp_rank == 0 else None


def _unsharded(t: torch.Tensor, info: Any, g: Any) -> torch.Tensor:
    """A parameter's full tensor from every rank's slice (a Nested slice: the inner level first)."""
    spec = info.shard
    if isinstance(spec, Nested):
        return gather_full(gather_full(t, spec.inner, g.etp_group), spec.outer, g.ep_group)
    return gather_full(t, spec, getattr(g, f"{info.shard_over}_group"))


def _trainer(rank: int, case: dict[str, Any], data_path: str, steps: int | None = None
             ) -> tuple[Trainer | None, Any]:
    """This rank's trainer for the case's plan, running ``steps`` steps (default: the plan's train.steps)."""
    plan = case_plan(case)
    groups = build_groups(plan.config, "cpu", ranks=list(range(plan.world_size)),
                          tied_embeddings=plan.model.tie_embeddings, experts=plan.model.moe is not None)
    if groups is None:
        return None, None
    data = TokenData(data_path, plan.seq, plan.model.vocab_size, plan.train.seed)
    tr = Trainer(plan, groups, torch.device("cpu"), data, steps=steps or plan.train.steps)
    return tr, groups


def equivalence(rank: int, case: dict[str, Any], data_path: str) -> dict[str, Any] | None:
    """Gradients after step 1's backward and their norm, and the losses of ``steps`` steps."""
    tr, groups = _trainer(rank, case, data_path)
    if tr is None:
        return None
    try:
        loss_sum = tr.forward_backward()
        grads = full_grads(tr)
        first = tr.finish_step(loss_sum)
        losses = [first.loss]
        while tr.step < tr.steps:
            losses.append(tr.train_step().loss)
        params = {n: p.detach().float().numpy().copy() for c in tr.chunks for n, p in c.named_parameters()}
        return {"grads": grads, "losses": losses, "grad_norm": first.grad_norm, "params": params if groups.tp == 1 and groups.dp_rank == 0 else None,
                "hierarchical": groups.dp_hierarchy is not None, "misaligned": _misaligned(tr.dp)}
    finally:
        dist.barrier(group=groups.world)
        groups.destroy()


def train_with_checkpoints(rank: int, case: dict[str, Any], data_path: str, ckpt_dir: str, save_at: list[int],
                           resume: bool, stop_after: int | None = None, steps: int | None = None,
                           lrs: bool = False) -> list[float] | str | None:
    """Losses (``lrs``: learning rates) of the steps this call runs: resume from ``ckpt_dir`` if asked, save after
    the steps in ``save_at``, stop after ``stop_after`` steps of a run of ``steps`` (as ``autopar run --steps``;
    default: the plan's). An AutoparError comes back as its message."""
    from runtime.checkpoint import load_checkpoint, save_checkpoint

    tr, groups = _trainer(rank, case, data_path, steps)
    if tr is None:
        return None
    try:
        if resume:
            load_checkpoint(tr, Path(ckpt_dir))
        out = []
        while tr.step < (stop_after or tr.steps):
            st = tr.train_step()
            out.append(st.lr if lrs else st.loss)
            if tr.step in save_at:
                save_checkpoint(tr, Path(ckpt_dir))
        return out
    except AutoparError as err:
        return f"AutoparError: {err}"
    finally:
        dist.barrier(group=groups.world)
        groups.destroy()


def overlap_run(rank: int, case: dict[str, Any], data_path: str) -> dict[str, Any] | None:
    """Losses and this rank's final local parameters, plus how many buckets were reduced during backward."""
    tr, groups = _trainer(rank, case, data_path)
    if tr is None:
        return None
    try:
        early, losses = [], []
        while tr.step < tr.steps:
            inp, tgt = tr.data.batch(tr.step, tr.plan.global_batch, groups.dp_rank, tr.cfg.dp)
            tr.dp.zero_grad()
            loss_sum = tr.runner.step(inp.split(tr.cfg.mbs), tgt.split(tr.cfg.mbs))
            early.append(sum(b.launched for b in tr.dp.buckets))  # launched before finish_grad_sync
            tr.dp.finish_grad_sync()
            losses.append(tr.finish_step(loss_sum).loss)
        tr.dp.wait_param_gather()
        params = {n: p.detach().float().numpy().copy() for c in tr.chunks for n, p in c.named_parameters()}
        return {"losses": losses, "params": params, "early": early, "buckets": len(tr.dp.buckets)}
    finally:
        dist.barrier(group=groups.world)
        groups.destroy()


def mesh_layout(rank: int, cfg: dict[str, int]) -> dict[str, Any] | None:
    """This rank's coordinates and the members of its groups."""
    c = ParallelConfig(**cfg)
    g = build_groups(c, "cpu", ranks=list(range(c.world)))
    if g is None:
        return None
    try:
        members = {name: dist.get_process_group_ranks(getattr(g, f"{name}_group"))
                   for name in ("tp", "dp", "cp", "dpcp", "pp", "mp")}
        return {"coord": (g.pp_rank, g.dp_rank, g.cp_rank, g.tp_rank), "dpcp_rank": g.dpcp_rank, **members}
    finally:
        dist.barrier(group=g.world)
        g.destroy()


def p2p_volume(rank: int, case: dict[str, Any], data_path: str) -> dict[str, Any] | None:
    """Elements of every pipeline send of one step, next to one micro-batch's boundary activation, and the
    losses of two steps (the second depends on the gradients the backward sends carried)."""
    tr, groups = _trainer(rank, case, data_path)
    if tr is None:
        return None
    sent: list[int] = []
    real = dist.isend

    def spy(t, *a, **k):
        sent.append(t.numel())
        return real(t, *a, **k)

    dist.isend = spy
    try:
        loss_sum = tr.forward_backward()
        dist.isend = real
        losses = [tr.finish_step(loss_sum).loss, tr.train_step().loss]
        return {"sent": sent, "act": math.prod(tr.runner.act_shape), "tp": groups.tp, "losses": losses}
    finally:
        dist.isend = real
        dist.barrier(group=groups.world)
        groups.destroy()


def _nbytes(tensors: list[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ---- context parallelism (tests/runtime/test_context_parallel.py) -------------------------------------------


def cp_activation_bytes(rank: int, cp: int, spec_json: str, dtype: str) -> dict[str, Any] | None:
    """One forward of a model's layers (no embedding / head) on cp ranks ``0 .. cp-1``, one sequence: the bytes of
    the activations autograd keeps for backward on this rank (every tensor a layer saves, counted once per storage,
    parameters left out), and the number of tokens the rank held."""
    from runtime.models import build_model
    from runtime.parallel.context_parallel import local_positions
    from runtime.parallel.parallelize import materialize, parallelize

    spec = ModelSpec.model_validate_json(spec_json)
    cfg = ParallelConfig(cp=cp)
    groups = build_groups(cfg, "cpu", ranks=list(range(cp)))
    if groups is None:
        return None
    try:
        torch_dtype = getattr(torch, dtype)
        (chunk,), table = parallelize(build_model(spec, "meta"), cfg, groups)
        materialize([chunk], table, spec, seed=1, device=torch.device("cpu"), dtype=torch_dtype)
        params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
        tokens = torch.randint(0, spec.vocab_size, (1, spec.seq_length), generator=torch.Generator().manual_seed(0))
        if cp > 1:
            tokens = tokens[:, local_positions(spec.seq_length, cp, groups.cp_rank)]
        x = chunk.embed(tokens).detach().requires_grad_()
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                kept[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = x
            for layer in chunk.layers.values():
                y = layer(y)
        y.float().sum().backward()  # the backward runs too (its collectives pair up on every rank)
        return {"bytes": sum(kept.values()), "tokens": tokens.shape[1]}
    finally:
        dist.barrier(group=groups.world)
        groups.destroy()


# ---- ZeRO-2/3 (tests/runtime/test_zero.py, test_priced_equals_executed.py) -------------------------------------


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a freed ZeRO-3 bucket's storage has 0)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _misaligned(dp: Any) -> int:
    """Buckets, and their owned slices, that start off an ``ALIGN``-element boundary of their buffers."""
    return sum(t.storage_offset() % ALIGN != 0 for b in dp.buckets for t in (b.param_shard, b.grad_shard))


def _padding(b: Any) -> int:
    return b.size - sum(s.end - s.start for s in b.spans)


def model_state_report(rank: int, case: dict[str, Any], data_path: str) -> dict[str, Any] | None:
    """After one step, for every ZeRO stage: this rank's buckets per model chunk as the cost model counts them
    (ZeRO-2/3: one per layer) and as it pads them (a split tied embedding's is its own), its model state's bytes
    by kind measured from every tensor it keeps (the chunks' buffers, ZeRO-3's per-bucket gather buffers, master
    copies and Adam moments), the padding elements (whole-bucket coordinates: ZeRO shards them with the rest),
    and the parameter and gradient tensors holding memory outside the buffers; then the communication ledger of a
    second, steady step (runtime/comm_ledger.py)."""
    from runtime.comm_ledger import recording

    tr, groups = _trainer(rank, case, data_path)
    if tr is None:
        return None
    try:
        loss = tr.train_step().loss
        dp, opt = tr.dp, tr.opt
        pbufs, gbufs = [p for p, _ in dp.buffers], [g for _, g in dp.buffers]
        gathered = [b.param_data for b in dp.buckets if dp.zero >= 3]
        inside = {t.untyped_storage().data_ptr() for t in pbufs + gbufs}
        stray = [t for c in tr.chunks for p in c.parameters() for t in (p.data, p.grad)
                 if t is not None and t.numel() and t.untyped_storage().data_ptr() not in inside]
        chunks = range(len(tr.chunks))
        report = {
            "pp_rank": groups.pp_rank, "vstages": [c * groups.pp + groups.pp_rank for c in chunks],
            "buckets": [len({b.unit for b in dp.buckets if b.chunk == c}) for c in chunks],
            "segments": [sum(b.chunk == c for b in dp.buckets) for c in chunks],
            "bytes": {"weights": _storage_bytes(pbufs) + _storage_bytes(gathered), "gradients": _storage_bytes(gbufs),
                      "optimizer": _nbytes(opt.master + opt.exp_avg + opt.exp_avg_sq)},
            "padding": sum(_padding(b) for b in dp.buckets), "padding_max": max(map(_padding, dp.buckets), default=0),
            "padding_owned": sum(_padding(b) / (b.d if dp.zero else 1) for b in dp.buckets),
            "misaligned": _misaligned(dp),
            "dtypes": [str(pbufs[0].dtype), str(gbufs[0].dtype)], "zero": dp.zero,
            "d": max([dp.d] + [b.d for b in dp.buckets]),
            "stray": len(stray), "loss": loss, "tp_rank": groups.tp_rank,
        }
        with recording(groups) as ledger:
            tr.train_step()
        return {**report, "ledger": ledger.as_dict()}
    finally:
        dist.barrier(group=groups.world)
        groups.destroy()


def zero_overlap_run(rank: int, case: dict[str, Any], data_path: str) -> dict[str, Any] | None:
    """Losses of ``steps`` steps and, after them, this rank's parameter and gradient buffers as kept (ZeRO-3:
    its slices only) and how many buckets were reduce-scattered during the last backward."""
    tr, groups = _trainer(rank, case, data_path)
    if tr is None:
        return None
    try:
        losses, early = [], 0
        while tr.step < tr.steps:
            inp, tgt = tr.data.batch(tr.step, tr.plan.global_batch, groups.dp_rank, tr.cfg.dp)
            tr.dp.zero_grad()
            loss_sum = tr.runner.step(inp.split(tr.cfg.mbs), tgt.split(tr.cfg.mbs))
            early = sum(b.launched for b in tr.dp.buckets)
            tr.dp.finish_grad_sync()
            losses.append(tr.finish_step(loss_sum).loss)
        tr.dp.wait_param_gather()
        return {"losses": losses, "early": early, "buckets": len(tr.dp.buckets),
                "buffers": [t.float().numpy().copy() for pair in tr.dp.buffers for t in pair]}
    finally:
        dist.barrier(group=groups.world)
        groups.destroy()


def zero_traffic_run(rank: int, case: dict[str, Any], data_path: str) -> dict[str, Any] | None:
    """One step, watched: the reduce-scatters of each bucket, the most buckets' parameters gathered at once (ZeRO-3)
    and whether any parameter holds memory afterwards; with the micro-batches and buckets of this rank."""
    tr, groups = _trainer(rank, case, data_path)
    if tr is None:
        return None
    try:
        dp, scatters, most = tr.dp, [], [0]
        scatter, gather = dp._scatter, dp._gather

        def count_scatter(b):
            scatters.append(dp.buckets.index(b))
            return scatter(b)

        def count_gather(buckets, wait):
            gather(buckets, wait)
            most[0] = max(most[0], sum(b.gathered for b in dp.buckets))

        dp._scatter, dp._gather = count_scatter, count_gather
        tr.train_step()
        held = sum(p.numel() for c in tr.chunks for p in c.parameters())
        return {"scatters": scatters, "most_gathered": most[0], "held": held, "m": tr.m, "vpp": len(tr.chunks),
                "buckets": len(dp.buckets), "units": [b.unit for b in dp.buckets]}
    finally:
        dist.barrier(group=groups.world)
        groups.destroy()


def tp_collectives(rank: int, case: dict[str, Any], data_path: str) -> dict[str, Any] | None:
    """One step's count of sequence-parallel all-gathers and reduce-scatters, and of collective-matmul ring
    passes (runtime/parallel/collective_matmul.py), on this rank; and the step's loss."""
    from runtime.parallel import collective_matmul, mappings

    tr, groups = _trainer(rank, case, data_path)
    if tr is None:
        return None
    counts = {"gather": 0, "scatter": 0, "ring": 0}
    real = (mappings.all_gather_into, mappings.reduce_scatter_into, collective_matmul._pass_on)

    def counted(key, fn):
        def spy(*a, **k):
            counts[key] += 1
            return fn(*a, **k)
        return spy

    mappings.all_gather_into = counted("gather", real[0])
    mappings.reduce_scatter_into = counted("scatter", real[1])
    collective_matmul._pass_on = counted("ring", real[2])
    try:
        loss = tr.finish_step(tr.forward_backward()).loss
        return {**counts, "loss": loss, "tp": groups.tp, "microbatches": tr.cfg.microbatches(tr.plan.global_batch)}
    finally:
        mappings.all_gather_into, mappings.reduce_scatter_into, collective_matmul._pass_on = real
        dist.barrier(group=groups.world)
        groups.destroy()



def hierarchy_collectives(rank: int, parts: int, eager: bool = False) -> dict[str, float]:
    """runtime/parallel/hierarchy.py on every pool rank as one dp group split over ``parts`` node groups: several
    chains of each collective in flight at once, waited newest first, against the flat collectives; largest
    differences. ``eager``: the GPUs' way (every step issued at once), here without a side stream."""
    from runtime.parallel.hierarchy import hierarchies

    world = dist.get_world_size()
    h = hierarchies(torch.arange(world).view(1, world, 1, 1), [parts], rank, eager)
    assert h is not None
    gen = torch.Generator().manual_seed(rank)
    xs = [torch.randn(world * (3 + k), generator=gen) for k in range(5)]  # sizes a multiple of the group's
    flat = [x.clone() for x in xs]
    for f in flat:
        dist.all_reduce(f)
    own = [slice(h.rank * x.numel() // world, (h.rank + 1) * x.numel() // world) for x in xs]
    odd = [x[:-1].clone() for x in xs]  # all-reduce pads what the inner groups cannot split evenly
    reduced = [h.all_reduce(y) for y in odd]
    scattered = [x.clone() for x in xs]
    shards = [h.reduce_scatter_into(s[o], s) for s, o in zip(scattered, own)]  # in place, as ZeRO does
    late = xs[0][:-1].clone()
    mixed = h.all_reduce(late)  # a 3-step chain behind 2-step ones in one queue
    for w in reversed([*reduced, *shards, mixed]):
        w.wait()
    gathered = [torch.zeros_like(x) for x in xs]
    for g, f, o in zip(gathered, flat, own):
        g[o] = f[o]
    chains = [h.all_gather_into(g, g[o]) for g, o in zip(gathered, own)]
    while not all(c.is_completed() for c in chains):
        pass
    err = lambda pairs: max(float((a - b).abs().max()) for a, b in pairs)  # noqa: E731
    return {"all_reduce": err(zip([*odd, late], [*(f[:-1] for f in flat), flat[0][:-1]])), "owned": float(h.rank),
            "reduce_scatter": err((s[o], f[o]) for s, f, o in zip(scattered, flat, own)),
            "all_gather": err(zip(gathered, flat))}
