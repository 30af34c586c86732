"""The parallel configuration of a plan: its keys, declared once, and the arrays of many configurations.

Each key is a field of :class:`ParallelConfig` whose metadata holds a :class:`Key` (its kind, range and
meaning). Everything else is derived from those declarations: the key list, parsing of ``--plan`` / ``--fix``
strings, the typed ``parallel`` section of plan files, the short text form, and :class:`Candidates` (the
arrays the search prices). Which combinations can run is said once, in ``rules.py``. Adding a key is:
declare it here, add its rules there, its search domain in ``planner/space.py`` and its cost terms.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal

import numpy as np

from specs.errors import AutoparError, did_you_mean
from specs.placement import groups_text, parse_groups, replica_group

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Key:
    """What a plan key is: ``int`` (at least ``minimum``, one of ``choices`` when given), ``bool``, ``name`` (one
    of ``choices``; held as its index in arrays of candidates), ``counts`` (non-negative integers per
    pipeline stage, written ``13/14/14/13``; ``one_count`` also takes one integer for every stage) or ``groups``
    (a node group's name per pipeline rank, written ``ib*4/roce*4`` or ``ib/ib/roce``)."""

    kind: Literal["int", "bool", "name", "counts", "groups"]
    doc: str
    minimum: int = 1
    maximum: int = 1 << 30  # far beyond any real plan: keeps the arithmetic on them in 64-bit integers
    choices: tuple[Any, ...] = ()
    one_count: bool = False
    always_shown: bool = False  # in the short form even at its default
    layout: bool = False  # how the model and batch are split (not only whether communication overlaps)

    @property
    def searched(self) -> bool:
        """Whether the search enumerates this key (per-stage counts come from the ILP or ``--fix``)."""
        return self.kind not in ("counts", "groups")


def _key(default: Any, **kw: Any) -> Any:
    return field(default=default, metadata={"key": Key(**kw)})


# the device mesh's dimensions, outermost first: a tensor-parallel group is contiguous ranks (inside a node) and
# pipeline stages are the outermost blocks (the runtime's DeviceMesh, the cost model's placement of groups)
MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class ParallelConfig:
    """How one training step is split over the GPUs (ranks ordered on the mesh by :data:`MESH_DIMS`)."""

    tp: int = _key(1, kind="int", layout=True, always_shown=True,
                   doc="tensor-parallel size: each layer's weights split tp ways")
    pp: int = _key(1, kind="int", layout=True, always_shown=True, doc="pipeline-parallel stages")
    dp: int = _key(1, kind="int", layout=True, always_shown=True,
                   doc="data-parallel replicas (default: gpus / (tp*pp*cp))")
    cp: int = _key(1, kind="int", layout=True, doc="context-parallel size: the sequence split cp ways")
    ep: int = _key(1, kind="int", layout=True,
                   doc="expert-parallel size: each MoE layer's experts split ep ways over the dp*cp*tp ranks of a "
                       "stage (Megatron-Core's MoE parallel folding)")
    etp: int = _key(1, kind="int", layout=True, doc="expert-tensor-parallel size: each expert's weights split etp ways")
    mbs: int = _key(1, kind="int", layout=True, always_shown=True, doc="micro-batch size in sequences")
    vpp: int = _key(1, kind="int", layout=True, doc="model chunks per pipeline rank (interleaved 1F1B when > 1)")
    sp: bool = _key(False, kind="bool", layout=True,
                    doc="sequence parallelism in the norm/dropout regions (needs tp > 1)")
    recompute: str = _key("none", kind="name", choices=RECOMPUTE, layout=True,
                          doc="activation recompute: none, selective (attention core) or full (whole layers)")
    recompute_layers: int | tuple[int, ...] | None = _key(
        None, kind="counts", one_count=True, minimum=0,
        doc="with recompute=full: layers recomputed per stage (one count for all, or one per stage; default all)")
    zero: int = _key(0, kind="int", minimum=0, choices=(0, 1, 2, 3), layout=True,
                     doc="ZeRO stage: 0 plain DP, 1 distributed optimizer, 2 + sharded grads, 3 + sharded params")
    dp_overlap: bool = _key(False, kind="bool", doc="overlap the DP gradient reduce (and ZeRO gathers) with compute")
    tp_overlap: bool = _key(False, kind="bool", doc="overlap TP collectives with the GEMMs they feed (needs sp)")
    layers: tuple[int, ...] | None = _key(None, kind="counts", minimum=0,
                                          doc="transformer layers per virtual stage (pp*vpp entries)")
    placement: tuple[str, ...] | None = _key(None, kind="groups", layout=True,
                                             doc="the node group of each pipeline rank (pp entries; clusters with "
                                                 "node_groups); a+b splits its dp replicas evenly over groups a, b")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the replicas of each expert, over which its gradients are reduced."""
        return edp(self.dp, self.cp, self.tp, self.ep, self.etp)

    @property
    def sequence_parallel(self) -> bool:
        """Whether sequence parallelism is on (:func:`sp_in_effect`)."""
        return bool(sp_in_effect(self.sp, self.tp))

    @property
    def tensor_overlap(self) -> bool:
        """Whether tensor-parallel communication overlaps its GEMMs (:func:`tp_overlap_in_effect`)."""
        return bool(tp_overlap_in_effect(self.tp_overlap, self.sp, self.tp))

    @property
    def num_chunks(self) -> int:
        return self.pp * self.vpp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh's sizes in :data:`MESH_DIMS` order (ranks numbered row-major over it)."""
        return tuple(getattr(self, d) for d in MESH_DIMS)

    def rank_coords(self, rank: int) -> dict[str, int]:
        """Rank ``rank``'s place on the mesh, ``{"pp", "dp", "cp", "tp"}`` (:data:`MESH_DIMS`)."""
        return dict(zip(MESH_DIMS, map(int, np.unravel_index(rank, self.mesh_shape))))

    def rank_group(self, rank: int) -> str:
        """The node group that rank ``rank`` runs on under the plan's placement (which must be set)."""
        at = self.rank_coords(rank)
        assert self.placement is not None
        return replica_group(self.placement[at["pp"]], at["dp"], self.dp)

    def rank_of(self, pp: int, dp: int, cp: int, tp: int) -> int:
        """The mesh position's rank (:meth:`rank_coords` inverted); with ``pp`` 0, its index among a stage's ranks."""
        return int(np.ravel_multi_index((pp, dp, cp, tp), self.mesh_shape))

    def microbatches(self, global_batch: int) -> int:
        return microbatches(global_batch, self.dp, self.mbs)

    def __post_init__(self) -> None:
        r = self.recompute_layers
        if isinstance(r, tuple) and len(r) == self.pp * self.vpp and len(set(r)) == 1:  # one count per stage, all
            object.__setattr__(self, "recompute_layers", r[0])  # the same: that count (one plan, one form in JSON)

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers per virtual stage in pipeline order (virtual stage j = chunk * pp + rank)."""
        return self.layers if self.layers is not None else default_split(num_layers, self.num_chunks)

    def recomputed_layers(self, vstage: int, layers_in_chunk: int) -> int:
        """Layers of virtual stage ``vstage`` that full recompute recomputes."""
        if self.recompute != "full":
            return 0
        r = self.recompute_layers
        if r is None:
            return layers_in_chunk
        if isinstance(r, tuple):
            r = r[vstage]
        return min(r, layers_in_chunk)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParallelConfig:
        """From a plan file's ``parallel`` object (JSON types); a key of the wrong type or unknown is an error."""
        return cls(**{key_name(k): _typed_value(k, v) for k, v in d.items()})

    def short(self) -> str:
        """Compact text form, e.g. ``tp=8 pp=4 dp=2 mbs=1 vpp=2 sp recompute=selective zero=1``."""
        parts = []
        for f in fields(self):
            k, v, info = f.name, getattr(self, f.name), KEYS[f.name]
            if k == "recompute_layers" or (v == f.default and not info.always_shown):
                continue
            if k == "layers":
                if len(set(v)) > 1:  # an even split is the default one
                    parts.append("layers=" + _counts_text(v))
            elif info.kind == "bool":
                parts.append(k)
            elif k == "placement":
                parts.append("placement=" + groups_text(v))
            elif k == "recompute" and v == "full" and self.recompute_layers is not None:
                parts.append(f"recompute=full({_counts_text(self.recompute_layers)} layers)")
            else:
                parts.append(f"{k}={v}")
        return " ".join(parts)

    def as_keys(self) -> str:
        """The ``--plan`` string that reproduces this configuration."""
        return ",".join(f"{k}={key_text(v)}" for k, v in asdict(self).items() if v is not None)


KEYS: dict[str, Key] = {f.name: f.metadata["key"] for f in fields(ParallelConfig)}
SEARCHED = tuple(k for k, info in KEYS.items() if info.searched)
LAYOUT = tuple(k for k, info in KEYS.items() if info.layout)


def keys_help(columns: int = 80) -> str:
    """The plan keys with what each is, wrapped to ``columns`` (a command's ``--help``)."""
    width = max(map(len, KEYS))
    pad = " " * (width + 4)
    lines = [textwrap.fill(info.doc, columns, initial_indent=f"  {k:<{width}}  ", subsequent_indent=pad)
             for k, info in KEYS.items()]
    return "plan keys (key=value, comma-separated):\n" + "\n".join(lines)
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(ParallelConfig)}
RECOMPUTE_CODE = {name: i for i, name in enumerate(RECOMPUTE)}


def microbatches(global_batch: int, dp: Any, mbs: Any) -> Any:
    """Micro-batches per step on each data-parallel replica (numbers or arrays of candidates)."""
    return global_batch // (dp * mbs)


def edp(dp: Any, cp: Any, tp: Any, ep: Any, etp: Any) -> Any:
    """Expert-data-parallel size (numbers or arrays): a stage's dp*cp*tp ranks hold ep*etp-way shards of the experts,
    the expert mesh (edp, ep, etp) laid over them with etp innermost (so an ep group's members are etp ranks apart,
    an edp group's ep*etp)."""
    return (dp * cp * tp) // (ep * etp)


SEQ_GROUP = "cptp"  # the group of a sequence's cp x tp shards (MoE aux counts), named so when both exceed 1


def sp_in_effect(sp: Any, tp: Any) -> Any:
    """Whether sequence parallelism is on (arrays broadcast): ``sp`` splits the sequence over the tensor-parallel
    group, so with tp=1 there is none."""
    return np.asarray(sp, dtype=bool) & (np.asarray(tp) > 1)


def tp_overlap_in_effect(tp_overlap: Any, sp: Any, tp: Any) -> Any:
    """Whether tensor-parallel communication overlaps its GEMMs (arrays broadcast): it splits the sequence-parallel
    all-gathers and reduce-scatters, so it needs sequence parallelism in effect."""
    return np.asarray(tp_overlap, dtype=bool) & sp_in_effect(sp, tp)


def zero_in_effect(zero: Any, d: Any, experts_d: Any = 1) -> Any:
    """The ZeRO stage a plan runs over ``d`` = dp x cp data-parallel ranks (arrays broadcast), the routed experts'
    state over ``experts_d`` (their :func:`edp`; 1 for a dense model): with one replica of each there is nothing
    to shard, so it runs none (runtime/parallel/data_parallel.py, the cost model's ZeRO memory and traffic, the
    rule that calls such a plan zero=0)."""
    return np.where((np.asarray(d) > 1) | (np.asarray(experts_d) > 1), zero, 0)


def seq_group_name(tp: int, cp: int) -> str:
    """The name the communication ledger gives the cp x tp group of a sequence's shards: with cp or tp of 1 it is
    the same process group as tp's or cp's, and named so."""
    return "tp" if cp == 1 else "cp" if tp == 1 else SEQ_GROUP


def default_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """Layers per virtual stage when none are given: even, the remainder spread over the middle stages (the
    first holds the embedding, the last the LM head)."""
    base, extra = divmod(num_layers, stages)
    order = sorted(range(stages), key=lambda j: (j in (0, stages - 1), abs(j - (stages - 1) / 2)))
    bonus = set(order[:extra])
    return tuple(base + (1 if j in bonus else 0) for j in range(stages))


def key_name(key: str) -> str:
    """``key`` if it is a plan key, else a one-line error naming the closest one."""
    if key not in KEYS:
        raise AutoparError(f"unknown plan key '{key}'{did_you_mean(key, KEYS)}; keys: {', '.join(KEYS)}")
    return key


def key_text(value: Any) -> str:
    """A plan key's value as it is written in ``--plan`` / ``--fix`` (booleans as true/false, counts with /)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], str):
        return groups_text(value)
    return _counts_text(value) if isinstance(value, (tuple, list)) else str(value)


def whole_number(text: str) -> int:
    """``text`` as an integer if it is written as one in ASCII digits (an optional sign), else ValueError: int()
    would also take ``1_0`` and other scripts' digits."""
    t = text.strip()
    if not (t.isascii() and t.lstrip("+-").isdigit() and len(t) - len(t.lstrip("+-")) <= 1):
        raise ValueError(f"not a whole number: {text!r}")
    return int(t)


def _counts_text(v: int | Iterable[int]) -> str:
    return "/".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def range_problem(key: str, value: Any) -> str | None:
    """How a typed value is outside its key's declared range (``must be at least 1``), or None."""
    info = KEYS[key]
    if info.kind == "int" and info.choices and value not in info.choices:
        return f"must be one of {', '.join(map(str, info.choices))}"
    if info.kind == "int" and value < info.minimum:
        return f"must be at least {info.minimum}"
    if info.kind == "int" and value > info.maximum:
        return f"must be at most {info.maximum:,}"
    if info.kind == "counts" and value is not None:
        counts = value if isinstance(value, tuple) else (value,)
        if min(counts) < info.minimum:
            return "counts must be non-negative"
    return None


def _typed_value(key: str, v: Any) -> Any:
    """Check one JSON value of a plan key (type and range) and convert lists to tuples."""
    info = KEYS[key]
    if info.kind == "bool" and not isinstance(v, bool):
        raise AutoparError(f"plan key {key} must be true or false, got {json.dumps(v)}")
    if info.kind == "int" and not _is_int(v):
        raise AutoparError(f"plan key {key} must be an integer, got {json.dumps(v)}")
    if info.kind == "name" and v not in info.choices:
        raise AutoparError(f"plan key {key} must be one of {', '.join(info.choices)}, got {json.dumps(v)}")
    if info.kind == "groups":
        if isinstance(v, list) and v and all(isinstance(x, str) and x for x in v):
            v = tuple(v)
        elif v is not None:
            raise AutoparError(f"plan key {key} must be a list of node group names (one per pipeline rank) or null, "
                               f"got {json.dumps(v)}")
    if info.kind == "counts":
        if isinstance(v, list) and v and all(_is_int(x) for x in v):
            v = tuple(v)
        elif not (v is None or (info.one_count and _is_int(v))):
            one = " or one integer" if info.one_count else ""
            raise AutoparError(f"plan key {key} must be a list of integers (one per stage){one} or null, "
                               f"got {json.dumps(v)}")
    problem = range_problem(key, v)
    if problem:
        raise AutoparError(f"plan key {key} {problem}, got {json.dumps(v)}")
    return v


def typed_keys(keys: dict[str, Any]) -> dict[str, Any]:
    """Plan keys given as Python values (the API's ``fixed``): each a plan key, of its type and range (numpy scalars
    taken as Python's); one value, or for a searched key a list or set of allowed values (``layers``, ``placement``
    and ``recompute_layers`` take one value: a list of counts or names is that value); the same one-line errors as
    a plan file's."""
    out: dict[str, Any] = {}
    for k, v in keys.items():
        key_name(k)
        several = isinstance(v, (set, frozenset)) or isinstance(v, list) and KEYS[k].searched
        if several and not KEYS[k].searched:
            raise AutoparError(f"plan key {k} takes one value, got a set of {len(v)}")
        out[k] = [_one_key(k, x) for x in v] if several else _one_key(k, v)
    return out


def _one_key(key: str, v: Any) -> Any:
    """One Python value of a plan key, typed and checked (:func:`_typed_value`)."""
    plain = lambda x: x.item() if isinstance(x, np.generic) else x  # noqa: E731
    v = [plain(x) for x in v] if isinstance(v, (list, tuple)) else plain(v)
    try:
        json.dumps(v)
    except TypeError:
        raise AutoparError(f"plan key {key} takes {KEYS[key].kind} values, got a {type(v).__name__}") from None
    return _typed_value(key, v)


def _parse_value(key: str, raw: str, flag: str) -> Any:
    """One ``--plan`` / ``--fix`` value, typed and range-checked (errors name ``flag``)."""
    info, low = KEYS[key], raw.strip().lower()
    value: Any
    if raw.startswith("=") and info.kind != "groups":  # tp==2: one = too many
        raise AutoparError(f"plan key {key}: '{key}={raw}' has one '=' too many; write {key}={raw.lstrip('=')}")
    if "=" in raw and info.kind != "groups":
        parts = f"{key}={raw}".split()
        if len(parts) == 1:  # tp=2=3: no second key to separate
            raise AutoparError(f"plan key {key}: '{raw}' is not one value; give {key} one value, and separate keys "
                               "with commas, as in \"tp=2,pp=2\"")
        raise AutoparError(f"plan key {key}: '{raw}' holds another key=value; separate keys with commas, as in "
                           f"\"{','.join(parts)}\"")
    if info.kind == "bool":
        if low not in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            raise AutoparError(f"plan key {key} takes true or false (or 1/0, yes/no, on/off), got '{raw}'")
        value = low in ("true", "1", "yes", "on")
    elif info.kind == "int":
        try:
            value = whole_number(low)
        except ValueError:
            raise AutoparError(f"plan key {key} takes an integer, got '{raw}'") from None
    elif info.kind == "name":
        if low not in info.choices:
            raise AutoparError(f"{key} takes {', '.join(info.choices)}, got '{raw}'")
        value = low
    elif info.kind == "groups":
        value = parse_groups(raw)
    else:
        try:
            counts = tuple(whole_number(x) for x in low.split("/"))
        except ValueError:
            raise AutoparError(f"{key} takes a count, or counts per stage separated by '/' (e.g. 13/14/14/13), "
                               f"got '{raw}'") from None
        value = counts[0] if info.one_count and len(counts) == 1 else counts
    problem = range_problem(key, value)
    if problem:
        raise AutoparError(f"{flag} {key}={raw.strip()}: {problem}")
    return value


def parse_plan_keys(text: str, flag: str = "--plan") -> dict[str, Any]:
    """Parse ``"tp=8,pp=2,sp=true"`` (the value of option ``flag``) into a dict of typed values (keys not given
    are absent); every error names ``flag``, so that --fix's and --compare's read apart."""
    try:
        return _plan_keys(text, flag)
    except AutoparError as err:
        if str(err).startswith(flag):
            raise
        raise AutoparError(f"{flag} {(text or '').strip()}: {err}") from None


def _plan_keys(text: str, flag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            plan_file = (f" (a plan file holds its prediction; `autopar run {item} --dry-run` checks it)"
                         if item.endswith(".json") else "")
            raise AutoparError(f"plan item '{item}' is not key=value; write e.g. \"tp=8,pp=2,mbs=1\"{plan_file}")
        key, raw = (s.strip() for s in item.split("=", 1))
        key = key_name(key.lower())
        if key in out:
            raise AutoparError(f"plan key '{key}' given twice")
        out[key] = _parse_value(key, raw, flag)
    return out


def config_from_keys(keys: dict[str, Any], gpus: int) -> ParallelConfig:
    """A full configuration from parsed keys; dp defaults to gpus / (tp*pp*cp) (when that is not a whole
    number, the rules say so)."""
    kw = dict(keys)
    if "dp" not in kw:
        rest = kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1)
        kw["dp"] = max(1, gpus // rest)
    return replace(ParallelConfig(), **kw)


class Candidates:
    """Many configurations as parallel numpy arrays, one entry each, for the search and the vectorised cost
    model. Keys the search does not enumerate (``layers``, ``recompute_layers``) hold one value for all
    entries; ``name`` keys hold codes (the index of the name in the key's choices: ``RECOMPUTE_CODE``)."""

    def __init__(self, arrays: dict[str, np.ndarray], unsearched: dict[str, Any] | None = None) -> None:
        self.arrays = arrays
        self.unsearched = {k: (unsearched or {}).get(k, DEFAULTS[k]) for k in KEYS if not KEYS[k].searched}

    def __getattr__(self, key: str) -> Any:
        if key in ("arrays", "unsearched"):  # not set yet (unpickling)
            raise AttributeError(key)
        if key in self.arrays:
            return self.arrays[key]
        if key in self.unsearched:
            return self.unsearched[key]
        raise AttributeError(key)

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values()))) if self.arrays else 0

    def take(self, idx: np.ndarray) -> Candidates:
        return Candidates({k: a[idx] for k, a in self.arrays.items()}, self.unsearched)

    def config(self, i: int) -> ParallelConfig:
        """Entry ``i`` as a configuration."""
        kw: dict[str, Any] = dict(self.unsearched)
        for k, a in self.arrays.items():
            info, v = KEYS[k], a[i].item()
            kw[k] = info.choices[v] if info.kind == "name" else bool(v) if info.kind == "bool" else int(v)
        return ParallelConfig(**kw)

    @classmethod
    def of(cls, cfg: ParallelConfig) -> Candidates:
        """One configuration as arrays of length one."""
        arrays = {}
        for k in SEARCHED:
            v = getattr(cfg, k)
            arrays[k] = np.array([KEYS[k].choices.index(v) if KEYS[k].kind == "name" else v])
        return cls(arrays, {k: getattr(cfg, k) for k in KEYS if not KEYS[k].searched})
