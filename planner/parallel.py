"""The parallel configuration of a plan: the ``tp, pp, dp, cp, mbs, vpp, sp, recompute, zero, ...`` keys.

``parse_plan_keys`` reads the ``--plan`` / ``--fix`` strings; ``ParallelConfig.validate`` says in one line
why a combination cannot run. The same object drives the cost model and the runtime.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from planner.errors import AutoparError, did_you_mean
from planner.model_spec import ModelSpec

RECOMPUTE = ("none", "selective", "full")
KEYS = ("tp", "pp", "dp", "cp", "mbs", "vpp", "sp", "recompute", "recompute_layers", "zero",
        "dp_overlap", "tp_overlap", "layers")
BOOL_KEYS = ("sp", "dp_overlap", "tp_overlap")
INT_KEYS = ("tp", "pp", "dp", "cp", "mbs", "vpp", "zero")


@dataclass(frozen=True)
class ParallelConfig:
    """How one training step is split over the GPUs.

    Rank order on the device mesh is (pp, dp, cp, tp) with tp innermost, so a tensor-parallel group is
    contiguous ranks (inside a node) and pipeline stages are the outermost blocks.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    mbs: int = 1
    vpp: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    sp: bool = False  # sequence parallelism in the norm/dropout regions (needs tp > 1 to matter)
    recompute: str = "none"  # none | selective (attention core) | full (whole layers)
    recompute_layers: int | tuple[int, ...] | None = None  # with full: layers recomputed per virtual stage
    # (one count for every stage, or one per stage; None = all)
    zero: int = 0  # 0 plain DP, 1 distributed optimizer, 2 + sharded grads, 3 + sharded params
    dp_overlap: bool = False  # overlap the DP gradient reduce (and ZeRO param gather) with compute
    tp_overlap: bool = False  # overlap TP collectives with the GEMMs they feed (needs sp)
    layers: tuple[int, ...] | None = None  # transformer layers per virtual stage (pp*vpp entries)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def num_chunks(self) -> int:
        return self.pp * self.vpp

    def microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.mbs)

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers per virtual stage in pipeline order (virtual stage j = chunk * pp + rank)."""
        if self.layers is not None:
            return self.layers
        n = self.num_chunks
        base, extra = divmod(num_layers, n)
        # Spread a remainder over the middle stages: the first holds the embedding, the last the LM head.
        order = sorted(range(n), key=lambda j: (j in (0, n - 1), abs(j - (n - 1) / 2)))
        bonus = set(order[:extra])
        return tuple(base + (1 if j in bonus else 0) for j in range(n))

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
        d = asdict(self)
        d["layers"] = list(self.layers) if self.layers is not None else None
        if isinstance(self.recompute_layers, tuple):
            d["recompute_layers"] = list(self.recompute_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParallelConfig:
        """From a plan file's ``parallel`` object (JSON types); a key of the wrong type or unknown is an error."""
        kw: dict[str, Any] = {}
        for key, v in d.items():
            if key not in KEYS:
                raise AutoparError(f"unknown plan key '{key}'{did_you_mean(key, KEYS)}; keys: {', '.join(KEYS)}")
            kw[key] = _typed_value(key, v)
        return cls(**kw)

    def short(self) -> str:
        """Compact text form, e.g. ``tp=8 pp=4 dp=2 mbs=1 vpp=2 sp recompute=selective zero=1``."""
        parts = [f"tp={self.tp}", f"pp={self.pp}", f"dp={self.dp}"]
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        parts.append(f"mbs={self.mbs}")
        if self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        if self.sp:
            parts.append("sp")
        if self.recompute != "none":
            r = f"recompute={self.recompute}"
            if self.recompute == "full" and self.recompute_layers is not None:
                rl = self.recompute_layers
                r += f"({'/'.join(map(str, rl)) if isinstance(rl, tuple) else rl} layers)"
            parts.append(r)
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.dp_overlap:
            parts.append("dp_overlap")
        if self.tp_overlap:
            parts.append("tp_overlap")
        if self.layers is not None and len(set(self.layers)) > 1:
            parts.append("layers=" + "/".join(map(str, self.layers)))
        return " ".join(parts)

    def as_keys(self) -> str:
        """The ``--plan`` string that reproduces this configuration."""
        d = self.to_dict()
        out = []
        for k in KEYS:
            v = d[k]
            if v is None:
                continue
            if k in ("layers", "recompute_layers") and isinstance(v, (list, tuple)):
                v = "/".join(map(str, v))
            elif isinstance(v, bool):
                v = str(v).lower()
            out.append(f"{k}={v}")
        return ",".join(out)

    # ------------------------------------------------------------------------------------------
    def validate(self, model: ModelSpec, gpus: int, global_batch: int, gpus_per_node: int | None = None,
                 tp_across_nodes: bool = False) -> None:
        """Raise AutoparError saying why this configuration cannot run, or return None (tensor parallelism must
        stay inside a node of ``gpus_per_node`` GPUs unless ``tp_across_nodes``, and never straddle nodes)."""
        for k in ("tp", "pp", "dp", "cp", "mbs", "vpp"):
            if getattr(self, k) < 1:
                raise AutoparError(f"{k} must be at least 1, got {getattr(self, k)}")
        if self.recompute not in RECOMPUTE:
            raise AutoparError(f"recompute must be one of {', '.join(RECOMPUTE)}, got '{self.recompute}'")
        if self.zero not in (0, 1, 2, 3):
            raise AutoparError(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.recompute_layers is not None:
            rl = self.recompute_layers
            counts = rl if isinstance(rl, tuple) else (rl,)
            if self.recompute != "full" or min(counts) < 0:
                raise AutoparError("recompute_layers needs recompute=full and non-negative counts")
            if isinstance(rl, tuple) and len(rl) != self.num_chunks:
                raise AutoparError(
                    f"recompute_layers has {len(rl)} entries but pp*vpp = {self.num_chunks} stages need one each")
        check_tp_heads(model, self.tp)
        if self.world != gpus:
            what = f"tp*pp*cp*dp = {self.tp}*{self.pp}*{self.cp}*{self.dp} = {self.world}"
            rest = self.tp * self.pp * self.cp
            hint = (f"; omit dp to use {gpus // rest}" if gpus % rest == 0
                    else f"; {gpus} GPUs are not divisible by tp*pp*cp = {rest}")
            raise AutoparError(f"{what} does not match {gpus} GPUs{hint}")
        if global_batch <= 0:
            raise AutoparError(f"global batch must be positive, got {global_batch}")
        if global_batch % (self.dp * self.mbs):
            raise AutoparError(
                f"global batch {global_batch} is not divisible by dp*mbs = {self.dp}*{self.mbs}; "
                "change --global-batch, dp or mbs"
            )
        m = self.microbatches(global_batch)
        if self.vpp > 1:
            if self.pp == 1:
                raise AutoparError("vpp > 1 (interleaved schedule) needs pp > 1")
            if m % self.pp:
                raise AutoparError(
                    f"the interleaved schedule needs the number of micro-batches ({m}) to be a multiple of "
                    f"pp={self.pp}; change the global batch, mbs or dp, or set vpp=1"
                )
        L = model.num_layers
        if self.layers is not None:
            if len(self.layers) != self.num_chunks:
                raise AutoparError(
                    f"layers has {len(self.layers)} entries but pp*vpp = {self.num_chunks} stages need one each"
                )
            if sum(self.layers) != L or min(self.layers) < 0:
                raise AutoparError(f"layers {'/'.join(map(str, self.layers))} must be non-negative and sum to {L}")
        elif self.num_chunks > L:
            raise AutoparError(f"{L} layers cannot fill pp*vpp = {self.num_chunks} pipeline stages; lower pp or vpp")
        if self.cp > 1:
            if model.seq_length % (2 * self.cp):
                raise AutoparError(
                    f"seq {model.seq_length} must be divisible by 2*cp = {2 * self.cp} (load-balanced causal split)"
                )
            if model.attn_impl != "flash":
                raise AutoparError("cp > 1 needs attention: flash in the model spec (ring attention is blockwise)")
        if self.tp_overlap and not (self.sp and self.tp > 1):
            raise AutoparError("tp_overlap=true needs sp=true and tp > 1 (it splits the SP all-gather/reduce-scatter)")
        if gpus_per_node is not None:
            problem = tp_node_problem(self.tp, gpus, gpus_per_node, tp_across_nodes)
            if problem:
                raise AutoparError(f"tp={self.tp} {problem}")
            if self.tp_overlap and gpus > gpus_per_node and self.tp > gpus_per_node:
                raise AutoparError(f"tp_overlap=true {TP_OVERLAP_ACROSS_NODES}; tp={self.tp} spans nodes of "
                                   f"{gpus_per_node} GPUs: set tp_overlap=false")


TP_OVERLAP_ACROSS_NODES = "needs the tensor-parallel group inside a node (it overlaps over NVLink)"


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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _typed_value(key: str, v: Any) -> Any:
    """Check one JSON value of a plan key and convert lists to tuples."""
    if key in BOOL_KEYS:
        if not isinstance(v, bool):
            raise AutoparError(f"plan key {key} must be true or false, got {json.dumps(v)}")
        return v
    if key in INT_KEYS:
        if not _is_int(v):
            raise AutoparError(f"plan key {key} must be an integer, got {json.dumps(v)}")
        return v
    if key == "recompute":
        if v not in RECOMPUTE:
            raise AutoparError(f"plan key recompute must be one of {', '.join(RECOMPUTE)}, got {json.dumps(v)}")
        return v
    # layers / recompute_layers: null, a list of integers (recompute_layers also one integer)
    if v is None or (key == "recompute_layers" and _is_int(v)):
        return v
    if isinstance(v, list) and v and all(_is_int(x) for x in v):
        return tuple(v)
    one = " or one integer" if key == "recompute_layers" else ""
    raise AutoparError(f"plan key {key} must be a list of integers (one per stage){one} or null, got {json.dumps(v)}")


def _parse_value(key: str, raw: str) -> Any:
    low = raw.strip().lower()
    if key in BOOL_KEYS:
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise AutoparError(f"plan key {key} takes true or false, got '{raw}'")
    if key in INT_KEYS:
        try:
            return int(low)
        except ValueError:
            raise AutoparError(f"plan key {key} takes an integer, got '{raw}'") from None
    if key == "recompute":
        if low not in RECOMPUTE:
            raise AutoparError(f"recompute takes {', '.join(RECOMPUTE)}, got '{raw}'")
        return low
    if key in ("layers", "recompute_layers"):
        try:
            vals = tuple(int(x) for x in low.split("/"))
        except ValueError:
            raise AutoparError(f"{key} takes a count, or counts per stage separated by '/' (e.g. 13/14/14/13), "
                               f"got '{raw}'") from None
        return vals[0] if key == "recompute_layers" and len(vals) == 1 else vals
    raise AutoparError(f"unknown plan key '{key}'")


def parse_plan_keys(text: str) -> dict[str, Any]:
    """Parse ``"tp=8,pp=2,sp=true"`` into a dict of typed values (keys not given are absent)."""
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise AutoparError(f"plan item '{item}' is not key=value; write e.g. \"tp=8,pp=2,mbs=1\"")
        key, raw = (s.strip() for s in item.split("=", 1))
        key = key.lower()
        if key not in KEYS:
            raise AutoparError(f"unknown plan key '{key}'{did_you_mean(key, KEYS)}; keys: {', '.join(KEYS)}")
        if key in out:
            raise AutoparError(f"plan key '{key}' given twice")
        out[key] = _parse_value(key, raw)
    return out


def check_tp_heads(model: ModelSpec, tp: int) -> None:
    heads, kv = model.num_attention_heads, model.kv_heads
    if tp < 1 or heads % tp or kv % tp:
        ok = [t for t in range(1, kv + 1) if heads % t == 0 and kv % t == 0]
        raise AutoparError(
            f"tp={tp} does not divide the model's {heads} attention heads and {kv} kv heads; "
            f"choose tp from {', '.join(map(str, ok))}"
        )


def config_from_keys(keys: dict[str, Any], gpus: int, model: ModelSpec | None = None) -> ParallelConfig:
    """A full configuration from parsed keys; dp defaults to gpus / (tp*pp*cp)."""
    kw = dict(keys)
    for k in ("tp", "pp", "dp", "cp", "mbs", "vpp"):
        if k in kw and kw[k] < 1:
            raise AutoparError(f"plan key {k} must be at least 1, got {kw[k]}")
    if model is not None and "tp" in kw:
        check_tp_heads(model, kw["tp"])
    if "dp" not in kw:
        rest = kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1)
        if rest <= 0 or gpus % rest:
            raise AutoparError(
                f"{gpus} GPUs are not divisible by tp*pp*cp = {rest}; choose factors of {gpus} or give --gpus"
            )
        kw["dp"] = gpus // rest
    return replace(ParallelConfig(), **kw)
