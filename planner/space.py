"""The search space: every valid combination of the parallel keys, as numpy arrays (``Candidates``).

``check_fixed`` refuses fixed keys no plan can satisfy; ``enumerate_space`` lists tp (dividing the heads,
inside a node), cp (flash attention, load-balanced sequence split), pp (at most the layers), dp, micro-batch,
vpp (needs pp > 1 and micro-batches divisible by pp), sp, recompute, ZeRO stage and the overlaps, honouring
``fixed`` (one value, or a list of allowed values). Outside ``exhaustive`` mode micro-batches above
``PRUNED_MAX_MBS`` and interleaving above ``PRUNED_MAX_VPP`` are not tried unless fixed.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

import numpy as np

from cost_models.batch import Candidates
from cost_models.step import RC_CODE
from planner.cluster_spec import ClusterSpec
from planner.errors import AutoparError
from planner.model_spec import ModelSpec
from planner.parallel import RECOMPUTE, TP_OVERLAP_ACROSS_NODES, ParallelConfig, check_tp_heads, tp_node_problem

RC_NAMES = {v: k for k, v in RC_CODE.items()}
PRUNED_MAX_MBS = 32
PRUNED_MAX_VPP = 8


def _divisors(n: int, limit: int | None = None) -> list[int]:
    """The divisors of ``n`` up to ``limit`` (default: all), ascending, in O(min(limit, sqrt n)) steps."""
    top = n if limit is None else min(n, limit)
    if top < math.isqrt(n):  # only small divisors wanted: try them directly
        return [d for d in range(1, top + 1) if n % d == 0]
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if n // d != d]
    return [d for d in small + large if d <= top]


def _values(key: str, fixed: dict[str, Any], default: list[Any]) -> list[Any]:
    """The values to try for ``key``: the fixed one, the allowed ones when a list is given, else all."""
    if key not in fixed:
        return default
    v = fixed[key]
    return [x for x in default if x in v] if isinstance(v, (list, tuple, set)) else [v]


# What autopar's own runtime executes (`autopar plan --runnable`, and `autopar run`'s default plan).
RUNNABLE = {"cp": 1, "zero": [0, 1], "tp_overlap": False}


def _as_list(v: Any) -> list[Any]:
    return [] if v is None else list(v) if isinstance(v, (list, tuple, set)) else [v]


def check_fixed(model: ModelSpec, cluster: ClusterSpec | None, fixed: dict[str, Any], flag: str = "--fix") -> None:
    """One-line errors for fixed keys that no plan can satisfy (the search then honours every other rule).

    ``flag`` names the option the keys came from; with ``cluster`` None only the checks that hold for any
    cluster run (whatif checks its keys once before a sweep, and against each point's cluster).
    """
    for k in ("tp", "pp", "dp", "cp", "mbs", "vpp"):
        for v in _as_list(fixed.get(k)):
            if v < 1:
                raise AutoparError(f"{flag} {k}={v}: must be at least 1")
    for v in _as_list(fixed.get("zero")):
        if v not in (0, 1, 2, 3):
            raise AutoparError(f"{flag} zero={v}: ZeRO stage must be 0, 1, 2 or 3")
    for t in _as_list(fixed.get("tp")):
        check_tp_heads(model, t)
    for c in _as_list(fixed.get("cp")):
        if c > 1 and model.attn_impl != "flash":
            raise AutoparError(f"{flag} cp={c} needs attention: flash in the model spec")
        if c > 1 and model.seq_length % (2 * c):
            raise AutoparError(f"{flag} cp={c}: seq {model.seq_length} must be divisible by 2*cp = {2 * c}")
    for p in _as_list(fixed.get("pp")):
        if p > model.num_layers:
            raise AutoparError(f"{flag} pp={p}: the model has only {model.num_layers} layers")
    layers = fixed.get("layers")
    if layers is not None:
        if sum(layers) != model.num_layers or min(layers) < 0:
            raise AutoparError(f"{flag} layers={'/'.join(map(str, layers))}: must be non-negative and sum to "
                               f"{model.num_layers}")
        if isinstance(fixed.get("pp"), int) and isinstance(fixed.get("vpp", 1), int) \
                and len(layers) != fixed["pp"] * fixed.get("vpp", 1):
            raise AutoparError(f"{flag} layers has {len(layers)} entries but pp*vpp = "
                               f"{fixed['pp'] * fixed.get('vpp', 1)} stages need one each")
    rl = fixed.get("recompute_layers")
    if rl is not None:
        if fixed.get("recompute", "full") != "full":
            raise AutoparError(f"{flag} recompute_layers needs recompute=full")
        if min(_as_list(rl)) < 0:
            raise AutoparError(f"{flag} recompute_layers: counts must be non-negative")
    if cluster is not None:
        _check_fixed_on(cluster, fixed, flag)


def _check_fixed_on(cluster: ClusterSpec, fixed: dict[str, Any], flag: str) -> None:
    """The fixed keys' checks that depend on the cluster: tp inside a node, the mesh dividing the GPUs."""
    g, G = cluster.gpus_per_node, cluster.num_gpus
    for t in _as_list(fixed.get("tp")):
        if cluster.num_nodes == 1 and t > g:
            raise AutoparError(f"{flag} tp={t}: tensor-parallel groups must fit inside a node ({g} GPUs); "
                               f"use a tp that divides {g}")
        problem = tp_node_problem(t, G, g, cluster.tp_across_nodes)
        if problem:
            raise AutoparError(f"{flag} tp={t}: {problem}")
        if t > g and fixed.get("tp_overlap") is True:
            raise AutoparError(f"{flag} tp={t},tp_overlap=true: tp_overlap {TP_OVERLAP_ACROSS_NODES}; "
                               "set tp_overlap=false")
    sizes = {k: fixed[k] for k in ("tp", "pp", "dp", "cp") if isinstance(fixed.get(k), int)}
    prod = math.prod(sizes.values())
    if G % prod or (len(sizes) == 4 and prod != G):
        shown = {k: v for k, v in sizes.items() if v > 1} or sizes
        raise AutoparError(
            f"{flag} {','.join(f'{k}={v}' for k, v in shown.items())}: tp*pp*dp*cp must equal the {G} GPUs, but "
            f"{'*'.join(shown)} = {prod} {'does not divide' if G % prod else 'is not'} {G}; change {flag} or --gpus")


def enumerate_space(model: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict[str, Any],
                    exhaustive: bool = False) -> Candidates:
    """Every valid configuration (as arrays), honouring ``fixed`` keys."""
    G, L, g = cluster.num_gpus, model.num_layers, cluster.gpus_per_node
    heads, kv = model.num_attention_heads, model.kv_heads

    def tp_ok(t: int) -> bool:  # divides the heads; inside a node (or whole nodes, if allowed), never straddling
        return heads % t == 0 and kv % t == 0 and tp_node_problem(t, G, g, cluster.tp_across_nodes) is None

    def cp_ok(c: int) -> bool:
        return c == 1 or (model.attn_impl == "flash" and model.seq_length % (2 * c) == 0)

    tps = [t for t in _divisors(math.gcd(heads, kv)) if G % t == 0 and tp_ok(t)]
    cps = [1]
    if model.attn_impl == "flash":
        cps = [c for c in _divisors(G, None if exhaustive else 16) if cp_ok(c)]
    n_layers_fixed = len(fixed["layers"]) if fixed.get("layers") is not None else None
    rl = fixed.get("recompute_layers")
    n_rl_fixed = len(rl) if isinstance(rl, tuple) else None
    outer = []
    for t in _values("tp", fixed, tps):
        if not tp_ok(t):
            continue
        for c in _values("cp", fixed, cps):
            if G % (t * c) or not cp_ok(c):
                continue
            pps = _divisors(G // (t * c), L)
            for p in _values("pp", fixed, pps):
                if G % (t * c * p) or p > L:
                    continue
                dp = G // (t * c * p)
                if dp not in _values("dp", fixed, [dp]):
                    continue
                if global_batch % dp:
                    continue
                per_dp = global_batch // dp
                mbs_all = _divisors(per_dp, None if exhaustive else PRUNED_MAX_MBS)
                for b in _values("mbs", fixed, mbs_all):
                    if per_dp % b:
                        continue
                    m = per_dp // b
                    vmax = L // p if p > 1 else 1
                    if not exhaustive:
                        vmax = min(vmax, PRUNED_MAX_VPP)
                    for v in _values("vpp", fixed, list(range(1, vmax + 1))):
                        if v > 1 and (p == 1 or m % p or p * v > L):
                            continue
                        if p * v > L or n_layers_fixed not in (None, p * v) or n_rl_fixed not in (None, p * v):
                            continue
                        outer.append((t, p, dp, c, b, v))
    if not outer:
        return Candidates(*(np.zeros(0, dtype=int) for _ in range(11)))
    inner = list(itertools.product(
        _values("sp", fixed, [False, True]),
        [RC_CODE[r] for r in _values("recompute", fixed, list(RECOMPUTE))],
        _values("zero", fixed, [0, 1, 2, 3]),
        _values("dp_overlap", fixed, [False, True]),
        _values("tp_overlap", fixed, [False, True]),
    ))
    O = np.array(outer, dtype=int)
    I = np.array(inner, dtype=int)
    no, ni = len(O), len(I)
    O = np.repeat(O, ni, axis=0)
    I = np.tile(I, (no, 1))
    t, p, dp, c, b, v = O.T
    sp, rc, zero, dpo, tpo = I.T
    d = dp * c
    ok = ~((sp == 1) & (t == 1)) & ~((tpo == 1) & (sp == 0)) & ~((zero > 0) & (d == 1)) & ~((dpo == 1) & (d == 1))
    if g < G:  # tp_overlap (userbuffers over NVLink) needs the tensor-parallel group inside a node
        ok &= ~((tpo == 1) & (t > g))
    idx = np.nonzero(ok)[0]
    return Candidates(tp=t[idx], pp=p[idx], dp=dp[idx], cp=c[idx], mbs=b[idx], vpp=v[idx], sp=sp[idx].astype(bool),
                      recompute=rc[idx], zero=zero[idx], dp_overlap=dpo[idx].astype(bool),
                      tp_overlap=tpo[idx].astype(bool))


def config_at(c: Candidates, i: int, fixed: dict[str, Any]) -> ParallelConfig:
    cfg = ParallelConfig(tp=int(c.tp[i]), pp=int(c.pp[i]), dp=int(c.dp[i]), cp=int(c.cp[i]), mbs=int(c.mbs[i]),
                         vpp=int(c.vpp[i]), sp=bool(c.sp[i]), recompute=RC_NAMES[int(c.recompute[i])],
                         zero=int(c.zero[i]), dp_overlap=bool(c.dp_overlap[i]), tp_overlap=bool(c.tp_overlap[i]))
    extra = {k: fixed[k] for k in ("layers", "recompute_layers") if k in fixed}
    return replace(cfg, **extra) if extra else cfg


