"""The search space: every valid combination of the plan keys, as arrays of candidates.

Each searched key has a domain here (the values worth trying given the model, the cluster and the keys
before it); ``enumerate_space`` expands the candidates key by key in the order of :func:`domains` and applies every rule
of ``specs/rules.py`` as soon as the keys it reads are known. A ``--fix`` key replaces its domain by the
value(s) given, so when no candidate is left the rule that removed the last ones says why
(:class:`NoPlan`). Outside ``exhaustive`` mode micro-batches above ``PRUNED_MAX_MBS``, interleaving above
``PRUNED_MAX_VPP`` and context parallelism above ``PRUNED_MAX_CP`` are not tried unless fixed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from specs.cluster import ClusterSpec
from specs.errors import AutoparError
from specs.model import ModelSpec
from specs.parallel import DEFAULTS, KEYS, RECOMPUTE, SEARCHED, Candidates, ParallelConfig, key_text, typed_keys
from specs.rules import RULES, PlanContext, Rule

PRUNED_MAX_MBS = 32
PRUNED_MAX_VPP = 8
PRUNED_MAX_CP = 16


def divisors(n: int, limit: int | None = None) -> list[int]:
    """The divisors of ``n`` up to ``limit`` (default: all), ascending, in O(min(limit, sqrt n)) steps."""
    if n <= 0:
        return []
    top = n if limit is None else min(n, limit)
    if top < math.isqrt(n):  # only small divisors wanted: try them directly
        return [d for d in range(1, top + 1) if n % d == 0]
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if n // d != d]
    return [d for d in small + large if d <= top]


# A domain: (the keys it depends on, values to try given those keys' values). Ordered: a key's domain may read
# the keys before it. Values that no rule allows may appear (the rules remove them).
Domain = tuple[tuple[str, ...], Callable[..., list[int]]]


def domains(model: ModelSpec, cluster: ClusterSpec, global_batch: int, exhaustive: bool,
            stages: int | None = None) -> dict[str, Domain]:
    """The values of each searched key worth trying (every key of ``SEARCHED``, in enumeration order);
    ``stages``: a fixed layer split's length, which pp x vpp must equal."""
    G, L = cluster.num_gpus, model.num_layers
    cap = (lambda limit: None) if exhaustive else (lambda limit: limit)  # noqa: E731

    def pp_values(t: int, c: int) -> list[int]:
        if G % (t * c):
            return [1]
        if stages is not None:
            return [p for p in divisors(G // (t * c)) if stages % p == 0]
        return divisors(G // (t * c), L)

    def vpp_values(p: int) -> list[int]:
        if stages is not None:
            return [max(1, stages // p)]
        top = 1 if p == 1 else max(1, L // p)
        return list(range(1, min(top, PRUNED_MAX_VPP if not exhaustive else top) + 1))

    def dp_values(t: int, c: int, p: int) -> list[int]:
        return [G // (t * c * p) if G % (t * c * p) == 0 else 0]  # 0: no whole dp (the rules say so)

    def mbs_values(d: int) -> list[int]:
        return divisors(global_batch // d, cap(PRUNED_MAX_MBS)) if d > 0 and global_batch % d == 0 else [1]

    def ep_values(t: int, c: int, d: int) -> list[int]:
        """Divisors of the expert count that divide the stage's dp*cp*tp ranks."""
        return [1] if model.moe is None or d == 0 else divisors(math.gcd(model.moe.num_experts, t * c * d))

    def etp_values(t: int) -> list[int]:
        """No expert tensor parallelism, or the layer's own tp (Megatron-Core's two usual settings); exhaustive:
        every etp inside a node."""
        if model.moe is None:
            return [1]
        return divisors(cluster.gpus_per_node) if exhaustive else sorted({1, t})

    flash = model.attn_impl == "flash"
    out: dict[str, Domain] = {
        "tp": ((), lambda: divisors(math.gcd(model.num_attention_heads, model.kv_heads, G))),
        "cp": ((), lambda: divisors(G, cap(PRUNED_MAX_CP)) if flash else [1]),
        "pp": (("tp", "cp"), pp_values),
        "vpp": (("pp",), vpp_values),
        "dp": (("tp", "cp", "pp"), dp_values),
        "ep": (("tp", "cp", "dp"), ep_values),
        "etp": (("tp",), etp_values),
        "mbs": (("dp",), mbs_values),
        "sp": ((), lambda: [0, 1]),
        "recompute": ((), lambda: list(range(len(RECOMPUTE)))),
        "zero": ((), lambda: list(KEYS["zero"].choices)),
        "dp_overlap": ((), lambda: [0, 1]),
        "tp_overlap": ((), lambda: [0, 1]),
    }
    assert tuple(sorted(out)) == tuple(sorted(SEARCHED)), "every searched key needs a domain"
    return out


def _code(key: str, value: Any) -> int:
    """A fixed value as it is held in arrays of candidates."""
    info = KEYS[key]
    return info.choices.index(value) if info.kind == "name" else int(value)


def allows_several(v: Any) -> bool:
    """Whether a fixed key's value is a list (or set) of allowed values rather than one value (a tuple is one
    value: ``layers``, ``placement``)."""
    return isinstance(v, (list, set))


UNPLACED = ("none",)  # ``placement=none``: plan a cluster of node groups as homogeneous at its slowest link


def unplaced(keys: dict[str, Any], cluster: ClusterSpec | None = None, flag: str = "--fix"
             ) -> tuple[dict[str, Any], bool]:
    """``keys`` without a ``placement=none``, and whether it was there (the plans are then not placed on the
    cluster's node groups: what ``plan --fix``, ``whatif --compare`` and ``estimate --plan`` mean by it). A
    ``cluster`` without node groups refuses it (``flag`` names where it was given): nothing there is placed."""
    if keys.get("placement") != UNPLACED:
        return keys, False
    if cluster is not None and not cluster.node_groups:
        raise AutoparError(f"{flag} placement=none: cluster {cluster.name} has no node groups, so no plan on it is "
                           "placed; leave placement=none out")
    return {k: v for k, v in keys.items() if k != "placement"}, True


def _fixed_values(key: str, fixed: dict[str, Any]) -> list[int] | None:
    if key not in fixed:
        return None
    v = fixed[key]
    return [_code(key, x) for x in (v if allows_several(v) else [v])]


def _expand(arrays: dict[str, np.ndarray], n: int, key: str, parents: tuple[str, ...],
            values: Callable[..., list[int]]) -> tuple[dict[str, np.ndarray], int]:
    """Every row repeated once per value of ``key`` (the values depend on the row's ``parents``)."""
    kind = bool if KEYS[key].kind == "bool" else np.int64
    if n == 0:
        return {**arrays, key: np.zeros(0, dtype=kind)}, 0
    if not parents:  # the same values for every row
        vs = np.asarray(values(), dtype=np.int64)
        out = {k: np.repeat(a, len(vs)) for k, a in arrays.items()}
        return {**out, key: np.tile(vs, n).astype(kind)}, n * len(vs)
    table = np.stack([arrays[p] for p in parents], axis=1)
    uniq, inv = np.unique(table, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    rows, vals = [], []
    for g, u in enumerate(uniq):
        members = np.nonzero(inv == g)[0]
        vs = np.asarray(values(*(int(x) for x in u)), dtype=np.int64)
        rows.append(np.repeat(members, len(vs)))
        vals.append(np.tile(vs, len(members)))
    idx, col = np.concatenate(rows), np.concatenate(vals)
    out = {k: a[idx] for k, a in arrays.items()}
    out[key] = col.astype(kind)
    return out, len(idx)


def _partial_config(arrays: dict[str, np.ndarray], i: int, unsearched: dict[str, Any]) -> ParallelConfig:
    """Row ``i`` of partly expanded candidates, the keys not yet expanded at their defaults."""
    return Candidates({k: a[i:i + 1] for k, a in arrays.items()}, unsearched).config(0)


class NoPlan(AutoparError):
    """No candidate satisfies the fixed keys and the rules; the message says which rule removed the last, and
    ``problem`` what it found wrong (without its advice, for callers whose advice differs)."""

    def __init__(self, message: str, problem: str = "") -> None:
        super().__init__(message)
        self.problem = problem


def _no_plan(rule: Rule, example: ParallelConfig, x: PlanContext, fixed: dict[str, Any],
             flags: dict[str, str]) -> NoPlan:
    """The error for a space the ``rule`` emptied: about the fixed keys it reads (each named with the option it
    came from, ``flags[key]``), or about the space in general when it reads none."""
    why = rule.why(example, x)
    own = [k for k in rule.keys if k in fixed]
    if own:
        return NoPlan(f"{options_text({k: fixed[k] for k in own}, flags)}: {why}")
    where = f" with {options_text(fixed, flags)}" if fixed else ""
    return NoPlan(f"no parallel configuration of {x.gpus} GPUs fits global batch {x.global_batch} and the model "
                  f"({x.model.num_layers} layers, {x.model.num_attention_heads} heads){where}: the last candidates "
                  f"(e.g. {example.short()}) fail because {why}", f"e.g. {example.short()}: {why.split('; ')[0]}")


def options_text(keys: dict[str, Any], flags: dict[str, str]) -> str:
    """Fixed keys as they were given on the command line, grouped by option: ``--fix tp=2,sp=true --compare
    pp=4`` (a list of allowed values joined with ``|``)."""
    def text(v: Any) -> str:
        return "|".join(map(key_text, v)) if allows_several(v) else key_text(v)

    by_flag: dict[str, list[str]] = {}
    for k, v in keys.items():
        if v is not None:
            by_flag.setdefault(flags.get(k, "--fix"), []).append(f"{k}={text(v)}")
    return " ".join(f"{flag} {','.join(items)}" for flag, items in by_flag.items())


def _kept_as_fixed(rule: Rule, fixed: dict[str, Any]) -> bool:
    """Whether a search-only rule steps aside for what ``--fix`` asked: a ``same`` rule when its key is fixed
    to one value, a ``dominated`` rule when its key is fixed at all."""
    key = rule.keys[0]
    if rule.kind == "same":
        return key in fixed and not allows_several(fixed[key])
    return rule.kind == "dominated" and key in fixed


def enumerate_space(model: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict[str, Any],
                    exhaustive: bool = False, flags: dict[str, str] | None = None) -> Candidates:
    """Every valid configuration, honouring ``fixed`` keys (one value, or a list of allowed values). Raises
    :class:`NoPlan` when none is left, naming each fixed key's option (``flags[key]``, default ``--fix``)."""
    fixed = typed_keys(fixed)  # (the API's callers give Python values: an unknown key or a wrong type is refused)
    x = PlanContext.on(model, cluster, global_batch)
    unsearched = {k: fixed.get(k, DEFAULTS[k]) for k in KEYS
                  if not KEYS[k].searched}
    if unsearched["recompute_layers"] is not None:
        fixed = {"recompute": "full", **fixed}
    known = set(unsearched)
    pending = [r for r in RULES if not _kept_as_fixed(r, fixed)]
    arrays: dict[str, np.ndarray] = {}
    n = 1
    stages = len(unsearched["layers"]) if unsearched["layers"] is not None else None
    for key, (parents, values) in domains(model, cluster, global_batch, exhaustive, stages).items():
        given = _fixed_values(key, fixed)
        arrays, n = _expand(arrays, n, key, () if given is not None else parents,
                            (lambda given=given: given) if given is not None else values)
        known.add(key)
        keep = np.ones(n, dtype=bool)  # the rules that now apply, on one view of the rows, then one compaction
        for rule in [r for r in pending if known.issuperset(r.keys)]:
            pending.remove(rule)
            ok = keep & rule.ok(Candidates(arrays, unsearched), x)
            if n and not ok.any():
                example = _partial_config(arrays, int(np.argmax(keep)), unsearched)
                raise _no_plan(rule, example, x, fixed, flags or {})
            keep = ok
        if not keep.all():
            arrays = {k: a[keep] for k, a in arrays.items()}
            n = int(keep.sum())
    order = np.lexsort([arrays[k] for k in reversed(SEARCHED)])
    return Candidates({k: arrays[k][order] for k in SEARCHED}, unsearched)


def check_fixed_keys(model: ModelSpec, fixed: dict[str, Any], global_batch: int,
                     flags: dict[str, str] | None = None) -> None:
    """Refuse fixed keys that break a rule whatever the cluster (what-if sweeps check this before the sweep):
    the rules that read only fixed keys (checked on as many GPUs as the fixed sizes use, and with no node size,
    the rules about the cluster hold)."""
    fixed = typed_keys(fixed)
    single = {k: v for k, v in fixed.items() if not allows_several(v)}
    cfg = ParallelConfig(**single)
    x = PlanContext(model, cfg.world, global_batch)
    # the choices an error lists (``Rule.lists_choices``), on a GPU count every one of them divides: the sweep's
    # clusters are not known here, and the fixed sizes' own count would list 1 alone
    any_count = replace(x, gpus=cfg.world * model.kv_heads * (model.moe.num_experts if model.moe else 1))
    c = Candidates.of(cfg)
    for rule in RULES:
        if rule.kind == "error" and set(rule.keys) <= set(single) and not rule.ok(c, x)[0]:
            why = rule.why(cfg, any_count if rule.lists_choices else x)
            raise NoPlan(f"{options_text({k: fixed[k] for k in rule.keys}, flags or {})}: {why}")
