"""Which parallel configurations can run: one table of rules, each a predicate and a one-line reason.

The same table serves three callers:

* :func:`check_plan` (``estimate``, plan files, the runtime) raises the reason of the first rule a
  configuration breaks;
* the search's enumeration (``planner/space.py``) applies every rule to arrays of candidates, each as soon as
  the keys it reads are known, so the space holds only valid plans;
* ``--fix`` keys no plan can satisfy are reported with the reason of the rule that removed the last candidate.

A rule reads the configuration as arrays (:class:`~specs.parallel.Candidates`: one entry per candidate, names
as codes) and returns one boolean per entry; its reason reads one decoded :class:`ParallelConfig`.
Two kinds of rules are not errors, only for the search: ``same`` rules drop candidates that run the same as
another one (sp with tp=1, ZeRO or overlapped DP with one replica), so each plan is priced once, unless the
key is fixed to that one value; ``dominated`` rules drop candidates that are never faster and use no less
memory (the same plan without an overlap it could use), unless the key is fixed (to a value or a list).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from specs.cluster import ClusterSpec
from specs.errors import AutoparError, counted
from specs.model import ModelSpec
from specs.parallel import (
    KEYS,
    RECOMPUTE_CODE,
    Candidates,
    ParallelConfig,
    default_split,
    edp,
    key_text,
    microbatches,
    range_problem,
    sp_in_effect,
    tp_overlap_in_effect,
    zero_in_effect,
)
from specs.placement import entry_groups, splits_replicas


@dataclass(frozen=True)
class PlanContext:
    """What the rules check a configuration against: the model, the GPUs it runs on and the global batch;
    with ``gpus_per_node`` also where tensor-parallel groups sit (None: placement not checked)."""

    model: ModelSpec
    gpus: int
    global_batch: int
    gpus_per_node: int | None = None
    tp_across_nodes: bool = False
    groups: tuple[tuple[str, int], ...] = ()  # (name, GPUs) of the cluster's node groups, when it has them
    node_gpus: tuple[tuple[str, int], ...] = ()  # (name, GPUs per node) of the same groups

    @classmethod
    def on(cls, model: ModelSpec, cluster: ClusterSpec, global_batch: int, gpus: int | None = None) -> PlanContext:
        """The context of ``cluster`` (or of ``gpus`` of its GPUs, for a plan needing fewer than it has)."""
        return cls(model, cluster.num_gpus if gpus is None else gpus, global_batch, cluster.gpus_per_node,
                   cluster.tp_across_nodes, tuple(cluster.groups.items()),
                   tuple(cluster.node_gpus.items()))


@dataclass(frozen=True)
class Rule:
    keys: tuple[str, ...]  # the plan keys it reads: the search applies it once all of them are enumerated
    ok: Callable[[Candidates, PlanContext], np.ndarray]
    why: Callable[[ParallelConfig, PlanContext], str]
    kind: Literal["error", "same", "dominated"] = "error"  # same / dominated: not errors (see above)
    # its ``why`` lists the values that fit the GPU count (tp from the heads' divisors, ep from the experts'): checked
    # before a cluster is known (a what-if sweep's keys), they are listed for any count
    lists_choices: bool = False


def _stages(c: Candidates) -> np.ndarray:
    return c.pp * c.vpp


def _heads_ok(c: Candidates, x: PlanContext) -> np.ndarray:
    return (x.model.num_attention_heads % c.tp == 0) & (x.model.kv_heads % c.tp == 0)


def _heads_why(cfg: ParallelConfig, x: PlanContext) -> str:
    heads, kv = x.model.num_attention_heads, x.model.kv_heads
    ok = [t for t in range(1, kv + 1) if heads % t == 0 and kv % t == 0 and x.gpus % t == 0  # ... that also fit
          and (x.gpus_per_node is None or tp_node_problem(t, x.gpus, x.gpus_per_node, x.tp_across_nodes) is None)]
    failing = [f"{n} {what}" for n, what in ((heads, "attention heads"), (kv, "kv heads")) if n % cfg.tp]
    if kv == heads:  # no grouped-query attention: one count
        failing = failing[:1]
    return f"tp={cfg.tp} does not divide the model's {' and '.join(failing)}; choose tp from {', '.join(map(str, ok))}"


def cp_split_problem(seq: int, cp: int) -> str | None:
    """Why ``seq`` tokens cannot be split over ``cp`` context-parallel ranks (each takes two of ``2 cp`` equal
    chunks, one early and one late, so causal attention's work is balanced); None when they can."""
    if seq % (2 * cp):
        return (f"seq {seq} must be divisible by 2*cp = {2 * cp} (load-balanced causal split); plan another --seq "
                "or a smaller cp")
    return None


def tp_node_problem(tp: int, gpus: int, gpus_per_node: int, across: bool) -> str | None:
    """Why a tensor-parallel group of ``tp`` cannot sit on nodes of ``gpus_per_node`` GPUs, or None. Groups
    are contiguous ranks: inside one node when tp divides the node size; whole nodes when tp is a multiple
    of it (only with ``across``); anything else would straddle a node boundary."""
    g = gpus_per_node
    if gpus <= g or g % tp == 0:
        return None
    if tp % g == 0:
        return None if across else (
            f"spans {tp // g} nodes ({g} GPUs per node); use a tp that divides {g}, or allow it with "
            "--allow-cross-node-tp (tp_across_nodes: true in the cluster profile)")
    return f"would straddle nodes of {g} GPUs; use a tp that divides {g}" + (
        f" or a multiple of {g}" if across else "")


def _tp_node_ok(c: Candidates, x: PlanContext) -> np.ndarray:
    g, t = x.gpus_per_node, c.tp
    if g is None or x.gpus <= g:
        return np.ones(len(t), dtype=bool)
    return (g % t == 0) | ((t % g == 0) & x.tp_across_nodes)


def _world_why(cfg: ParallelConfig, x: PlanContext) -> str:
    rest = cfg.tp * cfg.pp * cfg.cp
    if x.gpus % rest:
        return (f"{x.gpus} GPUs are not divisible by tp*pp*cp = {rest} ({cfg.tp}*{cfg.pp}*{cfg.cp}); choose tp, pp "
                f"and cp whose product divides {x.gpus}")
    return (f"tp*pp*cp*dp = {cfg.tp}*{cfg.pp}*{cfg.cp}*{cfg.dp} = {cfg.world} does not match {x.gpus} GPUs; "
            f"omit dp to use {x.gpus // rest}")


def _counts_match(counts: object, c: Candidates) -> np.ndarray:
    """Per-stage counts (a tuple) have pp*vpp entries; a single count or None always matches."""
    return _stages(c) == len(counts) if isinstance(counts, tuple) else np.ones(len(c), dtype=bool)


def _stage_splits(c: Candidates, x: PlanContext) -> dict[int, tuple[int, ...]]:
    """Layers per virtual stage for each stage count among the candidates (the fixed split, or the default)."""
    return {int(n): c.layers if c.layers is not None and len(c.layers) == n else default_split(x.model.num_layers,
                                                                                                   int(n))
            for n in np.unique(_stages(c))}


def _no_empty_middle(layers: tuple[int, ...] | None) -> bool:
    """No empty stage (virtual stage, in schedule order) between the first and the last: an empty first or last
    one only holds the embedding or the head."""
    return layers is None or all(n > 0 for n in layers[1:-1])


def _recompute_within(r: object, layers: tuple[int, ...]) -> bool:
    """Recomputed layers per stage no more than the stage holds (one count: no more than the largest stage)."""
    if r is None:
        return True
    if isinstance(r, tuple):
        return len(r) != len(layers) or all(a <= b for a, b in zip(r, layers))  # a count mismatch: its own rule
    return int(r) <= max(layers)  # type: ignore[call-overload]


def _recompute_ok(c: Candidates, x: PlanContext) -> np.ndarray:
    ok = np.ones(len(c), dtype=bool)
    if c.recompute_layers is None:  # the search's usual case: nothing to check, no pass over the candidates
        return ok
    stages = _stages(c)
    for n, layers in _stage_splits(c, x).items():  # one check per stage count, not per candidate
        ok[stages == n] = _recompute_within(c.recompute_layers, layers)
    return ok


def _recompute_why(cfg: ParallelConfig, x: PlanContext) -> str:
    r, layers = cfg.recompute_layers, cfg.stage_layers(x.model.num_layers)
    text = "/".join(map(str, r)) if isinstance(r, tuple) else str(r)
    return (f"recompute_layers={text} recomputes more layers than a stage holds ({'/'.join(map(str, layers))} per "
            "stage); give at most each stage's layers, or leave it out to recompute them all")


def _experts(x: PlanContext) -> int:
    """The model's routed experts (1 for a dense model, so only ep=1 divides them)."""
    return x.model.moe.num_experts if x.model.moe is not None else 1


def _dense_why(cfg: ParallelConfig, x: PlanContext) -> str:
    return (f"ep={cfg.ep}, etp={cfg.etp}: expert parallelism needs a mixture-of-experts model (moe: in the model "
            f"spec); {x.model.name} is dense, use ep=1 and etp=1")


def _expert_split_why(cfg: ParallelConfig, x: PlanContext) -> str:
    """Why ep*etp does not divide the stage's dp*cp*tp: the example's split, or, when ep*etp divides no split of
    the GPUs at all, that (the example's dp/cp/tp were not the user's choice)."""
    split = cfg.ep * cfg.etp
    where = "(the experts are split over a stage's data-, context- and tensor-parallel ranks)"
    if x.gpus % split:
        return (f"ep*etp = {cfg.ep}*{cfg.etp} must divide a stage's dp*cp*tp, a divisor of the {x.gpus} GPUs, "
                f"which {split} is not {where}")
    return f"ep*etp = {cfg.ep}*{cfg.etp} must divide dp*cp*tp = {cfg.dp}*{cfg.cp}*{cfg.tp} {where}"


def _ep_why(cfg: ParallelConfig, x: PlanContext) -> str:
    if x.model.moe is None:  # a dense model: the same line whichever rule sees it first
        return _dense_why(cfg, x)
    n = _experts(x)
    return f"ep={cfg.ep} does not divide the model's {n} experts; choose ep from " + ", ".join(
        str(e) for e in range(1, n + 1) if n % e == 0 and x.gpus % (e * cfg.etp) == 0)  # (... that also fit)


def _sp_on(c: Candidates) -> np.ndarray:
    return sp_in_effect(c.sp, c.tp)


def _placement_ok(c: Candidates, x: PlanContext) -> np.ndarray:
    """Every node group's GPUs hold whole pipeline ranks or whole equal shares of their dp replicas, each node in one
    group (:func:`placement_problem`, once per distinct stage shape)."""
    if c.placement is None:
        return np.ones(len(c), dtype=bool)
    shapes = np.stack([np.broadcast_to(c.tp, len(c)), np.broadcast_to(c.dp, len(c)), np.broadcast_to(c.cp, len(c)),
                       np.broadcast_to(c.pp, len(c))], axis=1)
    uniq, back = np.unique(shapes, axis=0, return_inverse=True)
    moe = x.model.moe is not None
    ok = np.array([placement_problem(c.placement, *map(int, u), dict(x.groups), _node_gpus(x), moe) is None
                   for u in uniq], dtype=bool)
    return ok[np.asarray(back).reshape(-1)]


def _tied_ends_alike(c: Candidates, x: PlanContext) -> bool:
    """A tied embedding's two ends own the same ZeRO-2/3 slices: both split over as many node groups (or no
    placement, or no tie)."""
    p = c.placement
    return p is None or not x.model.tie_embeddings or len(entry_groups(p[0])) == len(entry_groups(p[-1]))


def _node_gpus(x: PlanContext) -> dict[str, int]:
    return dict(x.node_gpus) or {g: x.gpus_per_node or x.gpus for g, _ in x.groups}


def placement_names_problem(placement: tuple[str, ...], names: Iterable[str], pp: int | None = None) -> str | None:
    """Why ``placement`` cannot be one of a cluster with node groups ``names`` whatever their sizes (none; a group it
    does not have; not one entry per pipeline rank of ``pp``, where known), or None."""
    text, names = f"placement={key_text(placement)}", list(names)
    if not names:
        return f"{text}: the cluster has no node_groups; leave placement out"
    unknown = sorted({g for e in placement for g in entry_groups(e) if g not in names})
    if unknown:
        return f"{text}: unknown node group {', '.join(unknown)}; the cluster's groups are {', '.join(names)}"
    if pp is not None and len(placement) != pp:
        return f"{text} names {counted(len(placement), 'pipeline rank')} but pp={pp}; give one group per pipeline rank"
    return None


def placement_problem(placement: tuple[str, ...], tp: int, dp: int, cp: int, pp: int, names: dict[str, int],
                      node_gpus: dict[str, int], moe: bool = False) -> str | None:
    """Why ``placement`` does not put this stage shape on node groups ``names`` (GPUs each, in nodes of ``node_gpus``
    GPUs), or None: one entry per pipeline rank naming known groups, each entry's groups an equal share
    of its dp replicas (not for a mixture-of-experts model, ``moe``: its experts' reduce runs over other groups than
    dp x cp), every group's GPUs covered exactly, and every node's GPUs in one group (each run of consecutive ranks
    on a group a whole number of its nodes)."""
    text = f"placement={key_text(placement)}"
    named = placement_names_problem(placement, names, pp)
    if named:
        return named
    if moe and splits_replicas(placement):
        return (f"{text} splits the replicas of a mixture-of-experts model over groups, which autopar does not do yet "
                "(the experts' reduce would cross them flat); give each group whole pipeline ranks")
    split = next((e for e in placement if dp % len(entry_groups(e))), None)
    if split is not None:
        return f"{text}: {split} splits dp={dp} replicas over {len(entry_groups(split))} groups; dp must divide evenly"
    stage = tp * dp * cp
    held = {g: sum(stage // len(entry_groups(e)) * entry_groups(e).count(g) for e in placement) for g in names}
    if held != names:
        have = ", ".join(f"{g}: {held[g]} of {n}" for g, n in names.items())
        return (f"{text} does not cover the ranks: each group's GPUs must hold whole pipeline ranks of tp*dp*cp = "
                f"{stage} GPUs, or equal shares of their dp replicas ({have})")
    runs: list[list] = []
    for e in placement:  # in rank order: each pipeline rank's shares of its replicas, a run of ranks each
        shared = entry_groups(e)
        for g in shared:
            if runs and runs[-1][0] == g:
                runs[-1][1] += stage // len(shared)
            else:
                runs.append([g, stage // len(shared)])
    bad = next(((g, n) for g, n in runs if n % node_gpus[g]), None)
    if bad is not None:
        return (f"{text} puts the GPUs of one node in two groups (a run of {counted(bad[1], 'rank')} on {bad[0]}, "
                "whose nodes "
                f"hold {node_gpus[bad[0]]} GPUs; a pipeline rank tp*dp*cp = {stage}): keep each node's ranks in one "
                "group")
    return None


def _placement_why(cfg: ParallelConfig, x: PlanContext) -> str:
    n = len(cfg.placement or ())
    if n and x.gpus % n and not placement_names_problem(cfg.placement or (), dict(x.groups)):  # no pp that many ranks
        return (f"placement={key_text(cfg.placement)} names {counted(n, 'pipeline rank')}, which do not divide the "
                f"{x.gpus} GPUs (pp must): give a number of ranks that does")
    return placement_problem(cfg.placement or (), cfg.tp, cfg.dp, cfg.cp, cfg.pp, dict(x.groups), _node_gpus(x),
                             x.model.moe is not None) or "placement is fine"


RULES: tuple[Rule, ...] = (
    Rule(("tp",), _heads_ok, _heads_why, lists_choices=True),
    Rule(("tp",), _tp_node_ok, lambda cfg, x: f"tp={cfg.tp} " + str(
        tp_node_problem(cfg.tp, x.gpus, x.gpus_per_node or x.gpus, x.tp_across_nodes))),
    Rule(("cp",), lambda c, x: (c.cp == 1) | (x.model.attn_impl == "flash"),
         lambda cfg, x: "cp > 1 needs attention: flash in the model spec (ring attention is blockwise; a Hugging "
                        "Face config is read with its family's default: write a YAML spec from it to set it)"),
    Rule(("cp",), lambda c, x: (c.cp == 1) | (x.model.dropout_p == 0),
         lambda cfg, x: f"cp > 1 needs the model without attention dropout (dropout: 0 in the model spec; it has "
                        f"{x.model.dropout_p:g})"),
    Rule(("cp",), lambda c, x: (c.cp == 1) | (x.model.seq_length % (2 * c.cp) == 0),
         lambda cfg, x: str(cp_split_problem(x.model.seq_length, cfg.cp))),
    Rule(("pp", "vpp", "layers"), lambda c, x: (_stages(c) <= x.model.num_layers) | (c.layers is not None),
         lambda cfg, x: f"the model has only {x.model.num_layers} layers, fewer than pp*vpp = {cfg.num_chunks} "
                        "pipeline stages; lower pp or vpp"),
    Rule(("pp", "vpp"), lambda c, x: (c.vpp == 1) | (c.pp > 1),
         lambda cfg, x: "vpp > 1 (interleaved schedule) needs pp > 1"),
    Rule(("pp", "vpp", "layers"), lambda c, x: _counts_match(c.layers, c),
         lambda cfg, x: f"layers has {len(cfg.layers or ())} entries but pp*vpp = {cfg.num_chunks} stages need "
                        "one each"),
    Rule(("layers",), lambda c, x: np.full(len(c), c.layers is None or sum(c.layers) == x.model.num_layers),
         lambda cfg, x: f"layers {'/'.join(map(str, cfg.layers or ()))} must be non-negative and sum to "
                        f"{x.model.num_layers}"),
    Rule(("layers",), lambda c, x: np.full(len(c), _no_empty_middle(c.layers)),
         lambda cfg, x: f"layers {'/'.join(map(str, cfg.layers or ()))} leaves a stage between others empty, which "
                        "the runtime cannot pass activations through; give every stage between the first and the "
                        "last at least one layer"),
    Rule(("recompute", "recompute_layers"),
         lambda c, x: (c.recompute == RECOMPUTE_CODE["full"]) | (c.recompute_layers is None),
         lambda cfg, x: "recompute_layers needs recompute=full"),
    Rule(("pp", "vpp", "recompute_layers"), lambda c, x: _counts_match(c.recompute_layers, c),
         lambda cfg, x: f"recompute_layers has {len(cfg.recompute_layers)} entries but pp*vpp = "  # type: ignore
                        f"{cfg.num_chunks} stages need one each"),
    Rule(("pp", "vpp", "layers", "recompute_layers"), _recompute_ok, _recompute_why),
    Rule(("tp", "pp", "cp", "dp"), lambda c, x: c.tp * c.pp * c.cp * c.dp == x.gpus, _world_why),
    # mixture of experts (specs/moe.py): ep and etp split the experts over a stage's dp*cp*tp ranks
    Rule(("ep", "etp"), lambda c, x: (x.model.moe is not None) | ((c.ep == 1) & (c.etp == 1)), _dense_why),
    Rule(("ep",), lambda c, x: _experts(x) % c.ep == 0, _ep_why, lists_choices=True),
    Rule(("tp", "cp", "dp", "ep", "etp"), lambda c, x: (c.tp * c.cp * c.dp) % (c.ep * c.etp) == 0,
         _expert_split_why),
    Rule(("etp",), lambda c, x: (x.gpus_per_node is None) | (x.gpus <= (x.gpus_per_node or 0))
         | ((x.gpus_per_node or 1) % c.etp == 0),
         lambda cfg, x: f"etp={cfg.etp} would straddle nodes of {x.gpus_per_node} GPUs; use an etp that divides "
                        f"{x.gpus_per_node}"),
    Rule(("sp", "tp"), lambda c, x: (x.model.moe is None) | (c.tp == 1) | c.sp,
         lambda cfg, x: f"tp={cfg.tp} with MoE layers needs sp=true (the experts take the sequence-parallel tokens, "
                        "as Megatron-Core requires)"),
    Rule(("zero",), lambda c, x: (x.model.moe is None) | (c.zero <= 1),
         lambda cfg, x: f"zero={cfg.zero}: ZeRO-2/3 of a mixture-of-experts model is not modelled; use zero=1 "
                        "(the distributed optimizer, as Megatron-Core's MoE runs) or zero=0"),
    Rule(("dp", "mbs"), lambda c, x: x.global_batch % (c.dp * c.mbs) == 0,
         lambda cfg, x: (f"global batch {x.global_batch} is not divisible by dp*mbs = {cfg.dp}*{cfg.mbs}; "
                         "change --global-batch, dp or mbs") if x.global_batch % cfg.mbs == 0 else
                        (f"global batch {x.global_batch} is not divisible by mbs={cfg.mbs}, whatever dp; use an mbs "
                         "that divides it, or change --global-batch")),
    Rule(("pp", "vpp", "dp", "mbs"),
         lambda c, x: (c.vpp == 1) | (microbatches(x.global_batch, c.dp, c.mbs) % c.pp == 0),
         lambda cfg, x: f"the interleaved schedule needs the number of micro-batches "
                        f"({cfg.microbatches(x.global_batch)}) to be a multiple of pp={cfg.pp}; change the global "
                        "batch, mbs or dp, or set vpp=1"),
    Rule(("sp", "tp", "cp"), lambda c, x: ~_sp_on(c) | (x.model.seq_length % (c.cp * c.tp) == 0),
         lambda cfg, x: f"sp=true with tp={cfg.tp} needs seq {x.model.seq_length}"
                        f"{f' / cp={cfg.cp}' if cfg.cp > 1 else ''} divisible by tp (sequence parallelism splits "
                        "it tp ways); plan another --seq, or sp=false"),
    Rule(("tp_overlap", "sp", "tp"), lambda c, x: ~c.tp_overlap | tp_overlap_in_effect(c.tp_overlap, c.sp, c.tp),
         lambda cfg, x: "tp_overlap=true needs sp=true and tp > 1 (it splits the SP all-gather/reduce-scatter)"),
    Rule(("tp", "tp_overlap"),
         lambda c, x: ~c.tp_overlap | (x.gpus_per_node is None) | (x.gpus <= (x.gpus_per_node or 0))
         | (c.tp <= (x.gpus_per_node or 0)),
         lambda cfg, x: f"tp_overlap=true needs the tensor-parallel group inside a node (it overlaps over NVLink); "
                        f"tp={cfg.tp} spans nodes of {x.gpus_per_node} GPUs: set tp_overlap=false"),
    Rule(("placement", "pp", "tp", "dp", "cp"), _placement_ok, _placement_why),
    Rule(("placement", "zero", "pp"), lambda c, x: ~((c.zero >= 2) & (c.pp > 1)) | _tied_ends_alike(c, x),
         lambda cfg, x: f"placement={key_text(cfg.placement)} with zero={cfg.zero} and a tied embedding: the first and "
                        "last pipeline ranks own different slices of it (one is split over more node groups than "
                        "the other); split both ends alike, or use zero=1"),
    # the same plan as another candidate: not errors, just not enumerated twice
    Rule(("sp", "tp"), lambda c, x: ~(c.sp & (c.tp == 1)), lambda cfg, x: "sp=true with tp=1 is sp=false",
         kind="same"),
    Rule(("zero", "dp", "cp", "tp", "ep", "etp"), lambda c, x: (c.zero == 0) | (zero_in_effect(c.zero, c.dp * c.cp, (
        edp(c.dp, c.cp, c.tp, c.ep, c.etp) if x.model.moe else 1)) > 0),
         lambda cfg, x: "ZeRO with one data-parallel replica is zero=0", kind="same"),
    Rule(("dp_overlap", "dp", "cp"), lambda c, x: ~c.dp_overlap | (c.dp * c.cp > 1),
         lambda cfg, x: "dp_overlap with one data-parallel replica is dp_overlap=false", kind="same"),
    # never faster than another candidate and no less memory (the cost model hides overlapped communication
    # behind compute, never adds to it): only priced when asked for with --fix. Not so tp_overlap: it runs each
    # GEMM beside a collective in tp pieces, which can cost more than the communication it hides (both searched).
    Rule(("dp_overlap", "dp", "cp"), lambda c, x: c.dp_overlap | (c.dp * c.cp == 1),
         lambda cfg, x: "dp_overlap=false is never faster than dp_overlap=true", kind="dominated"),
)


def plan_problem(cfg: ParallelConfig, x: PlanContext) -> str | None:
    """Why ``cfg`` cannot run in context ``x`` (the first rule it breaks), or None."""
    return _problem(cfg, x, KEYS, RULES)


def _problem(cfg: ParallelConfig, x: PlanContext, keys: Iterable[str], rules: Iterable[Rule]) -> str | None:
    """:func:`plan_problem` over ``keys``' ranges and ``rules`` only."""
    for k in keys:
        problem = range_problem(k, getattr(cfg, k))
        if problem:
            return f"{k}={key_text(getattr(cfg, k))}: {problem}"
    if x.global_batch <= 0:
        return f"global batch must be positive, got {x.global_batch}"
    c = Candidates.of(cfg)
    for rule in rules:
        if rule.kind == "error" and not bool(rule.ok(c, x)[0]):
            return rule.why(cfg, x)
    return None


# what reads a plan's layer split and what does not (the keys a rule reads are its keys)
_SPLIT_RULES = [r for r in RULES if "layers" in r.keys]
_OTHER_RULES = [r for r in RULES if "layers" not in r.keys]
_OTHER_KEYS = [k for k in KEYS if k != "layers"]


def allowed_splits(cfg: ParallelConfig, splits: list[tuple[int, ...]], x: PlanContext) -> list[tuple[int, ...]]:
    """The layer splits of ``splits`` that ``cfg`` may run with in ``x`` (those without a :func:`plan_problem`): what
    does not read the split is checked once (the search tries hundreds of splits of one plan)."""
    if _problem(cfg, x, _OTHER_KEYS, _OTHER_RULES) is not None:
        return []
    return [s for s in splits if _problem(replace(cfg, layers=s), x, ("layers",), _SPLIT_RULES) is None]


def check_plan(cfg: ParallelConfig, x: PlanContext) -> None:
    """Raise AutoparError saying why ``cfg`` cannot run in context ``x``; return None when it can."""
    problem = plan_problem(cfg, x)
    if problem:
        raise AutoparError(problem)
