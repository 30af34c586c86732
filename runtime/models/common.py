"""Pieces shared by the GPT and Llama models: attention, norms, embeddings, the LM head, the stage skeleton.

The models are plain single-device PyTorch with no parallel code. ``runtime.parallel.parallelize`` swaps
modules (column/row-parallel linears, vocab-parallel embedding and loss) and cuts pipeline stages out of a
model built on the meta device; it relies on the attribute names used here (``qkv``, ``proj``, ``gate_up``,
``down``, ``fc``, ``tok``, ``pos``, ``out``, ``core``, ``rope``, ``n_heads``, ``n_kv_heads``). Positions are
modules too (``Rotary`` for RoPE, ``LearnedPositions`` for GPT), so a rank whose tokens sit elsewhere in the
sequence swaps them rather than the model knowing.

Parameter names are stable whatever the plan (``layers.7.attn.qkv.weight`` is the same tensor, or a shard
of it, on every plan), and :func:`init_parameters` initialises each parameter from a generator seeded by
``(seed, name)`` in its full unsharded shape, so every plan starts from identical weights.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from runtime import kernels
from specs.errors import AutoparError
from specs.model import ModelSpec, RopeScaling

# ---- normalisation ------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)


def make_norm(spec: ModelSpec) -> nn.Module:
    norm = LayerNorm if spec.arch == "gpt" else RMSNorm
    return norm(spec.hidden_size, spec.norm_eps)


class SwiGLU(nn.Module):
    """``down(silu(gate) * up)`` of width ``ffn`` with a fused ``gate_up`` projection laid out ``[gate | up]``."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one op over the fused projection: its backward writes d(gate_up) in one buffer (no cat)
        return self.down(kernels.swiglu_packed(self.gate_up(x)))


# ---- attention ----------------------------------------------------------------------------------

_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa: kv heads not copied


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d)) V with a causal mask; q ``[b, s, h, d]``, k/v ``[b, s, kv, d]`` -> ``[b, s, h*d]``.

    ``impl="flash"`` uses F.scaled_dot_product_attention; ``"unfused"`` materialises the scores (what
    selective recompute is for).
    """

    def __init__(self, impl: str, dropout_p: float) -> None:
        super().__init__()
        self.impl = impl
        self.dropout_p = dropout_p

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s, h, d = q.shape
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        p = self.dropout_p if self.training else 0.0
        gqa = k.shape[1] != h
        if self.impl == "flash" and gqa and _SDPA_GQA and q.dtype in (torch.float16, torch.bfloat16):
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=True)
        elif self.impl == "flash":
            if gqa:
                k, v = k.repeat_interleave(h // k.shape[1], dim=1), v.repeat_interleave(h // k.shape[1], dim=1)
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            if gqa:
                k, v = k.repeat_interleave(h // k.shape[1], dim=1), v.repeat_interleave(h // k.shape[1], dim=1)
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
            probs = torch.softmax(scores.float().masked_fill(causal, float("-inf")), dim=-1).to(q.dtype)
            o = F.dropout(probs, p) @ v
        return o.transpose(1, 2).reshape(b, s, h * d)


@dataclass(frozen=True)
class RopeBase:
    """RoPE's base wavelength and the scaling of its frequencies (a spec's ``rope_theta`` and ``rope_scaling``)."""

    theta: float
    scaling: RopeScaling | None = None

    def inverse_frequencies(self, dims: int, device: torch.device) -> torch.Tensor:
        """The ``dims / 2`` rotation speeds (radians per position); scaled ones turn slower, so that positions
        beyond the pretraining context look like ones inside it."""
        inv = 1.0 / self.theta ** (torch.arange(0, dims, 2, dtype=torch.float32, device=device) / dims)
        sc = self.scaling
        if sc is None:
            return inv
        if sc.type == "linear":  # every position divided by factor
            return inv / sc.factor
        if sc.type != "llama3":
            raise AutoparError(f"rope_scaling type {sc.type} is not one the runtime computes "
                               "(specs/capabilities.py refuses it before training)")
        # llama3: wavelengths beyond original / low_freq_factor slowed by factor, below original / high_freq_factor
        # kept; in between a blend whose share kept grows linearly in original / wavelength
        turns = sc.original_max_position_embeddings * inv / (2 * math.pi)  # turns over the pretraining context
        kept = ((turns - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)).clamp(0.0, 1.0)
        return kept * inv + (1.0 - kept) * inv / sc.factor


def rope_tables(positions: torch.Tensor, head_dim: int, base: RopeBase) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin, ``[len(positions), head_dim / 2]``, at the given token positions."""
    freqs = torch.outer(positions.to(torch.float32), base.inverse_frequencies(head_dim, positions.device))
    return freqs.cos(), freqs.sin()


class Rotary(nn.Module):
    """RoPE tables (cos, sin) for a module's ``s`` tokens, cached; they sit at positions ``0 .. s-1``.

    ``positions`` is the hook: a module whose tokens sit elsewhere in the sequence (a context-parallel rank's
    chunks) overrides it, passing ``theta`` (the base with its scaling) on whole."""

    def __init__(self, head_dim: int, theta: RopeBase | float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta if isinstance(theta, RopeBase) else RopeBase(theta)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def positions(self, s: int, device: torch.device) -> torch.Tensor:
        return torch.arange(s, device=device)

    def forward(self, s: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (s, device)
        if key not in self._tables:
            self._tables[key] = rope_tables(self.positions(s, device), self.head_dim, self.theta)
        return self._tables[key]


class Attention(nn.Module):
    """Self-attention with a fused ``qkv`` projection laid out ``[q (heads*hd) | k (kv*hd) | v (kv*hd)]``.

    ``n_heads`` / ``n_kv_heads`` are the heads this module computes (tensor parallelism lowers them).
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.hd = spec.num_attention_heads, spec.kv_heads, spec.hd
        self.rope = Rotary(spec.rope_dims, RopeBase(spec.rope_theta, spec.rope_scaling)) if spec.rope_dims else None
        self.qkv = nn.Linear(spec.hidden_size, spec.q_width + 2 * spec.kv_width, bias=spec.has_bias or spec.qkv_bias)
        self.proj = nn.Linear(spec.q_width, spec.hidden_size, bias=spec.has_bias)
        self.core = CoreAttention(spec.attn_impl, spec.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s, _ = qkv.shape  # the full sequence, also when x is a sequence-parallel shard
        hd, nq, nkv = self.hd, self.n_heads, self.n_kv_heads
        q, k, v = qkv.split((nq * hd, nkv * hd, nkv * hd), dim=-1)
        q, k, v = q.view(b, s, nq, hd), k.view(b, s, nkv, hd), v.view(b, s, nkv, hd)
        if self.rope is not None:
            q, k = self._rotate(q, k, s)
            # q and k are new tensors now; a view v would keep the whole fused output alive for the backward
            v = v.contiguous()
        return self.proj(self.core(q, k, v))


    def _rotate(self, q: torch.Tensor, k: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on each head's first ``rope.head_dim`` dimensions (all of them, or a ``rotary_fraction``); the rest
        pass through."""
        rd = self.rope.head_dim
        if rd == self.hd:
            return kernels.rope(q, k, *self.rope(s, q.device))
        qr, kr = kernels.rope(q[..., :rd].contiguous(), k[..., :rd].contiguous(), *self.rope(s, q.device))
        return torch.cat((qr, q[..., rd:]), -1), torch.cat((kr, k[..., rd:]), -1)


# ---- embeddings and head ------------------------------------------------------------------------


class TokenEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class LearnedPositions(nn.Module):
    """GPT's learned absolute positions; ``forward(seq)`` returns the rows this module's tokens use."""

    def __init__(self, max_seq: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_seq, dim))

    def forward(self, seq: int) -> torch.Tensor:
        return self.weight[:seq]


class Embedding(nn.Module):
    """Tokens (+ learned positions and dropout for GPT) -> hidden states ``[b, s, h]``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.tok = TokenEmbedding(spec.vocab_size, spec.hidden_size)
        self.pos = LearnedPositions(spec.position_rows, spec.hidden_size) if spec.learned_positions else None
        self.dropout_p = spec.dropout_p if spec.arch == "gpt" else 0.0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        if self.pos is not None:
            x = x + self.pos(tokens.shape[1])
        return F.dropout(x, self.dropout_p, self.training)


class OutputLayer(nn.Module):
    """The LM head: ``loss(x, target)`` = mean cross-entropy of ``x @ weight.T`` (logits never leave the op)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim))

    def loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return kernels.linear_cross_entropy(x.flatten(0, -2), self.weight, target.reshape(-1))


class Head(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = make_norm(spec)
        self.out = OutputLayer(spec.vocab_size, spec.hidden_size)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.out.loss(self.norm(x), target)


# ---- the model (or one pipeline stage of it) ----------------------------------------------------


class Transformer(nn.Module):
    """Embedding -> layers -> head, or any contiguous slice of it (a pipeline stage).

    ``forward(x, target)``: ``x`` is token ids when the stage holds the embedding, hidden states otherwise;
    returns the mean loss when it holds the head, hidden states otherwise. Layers keep their global index
    in their names (``layers.5``), so a stage's parameter names are the full model's.
    """

    def __init__(self, spec: ModelSpec, block: type[nn.Module], layer_ids: Iterable[int] | None = None,
                 first: bool = True, last: bool = True) -> None:
        super().__init__()
        self.spec = spec
        ids = range(spec.num_layers) if layer_ids is None else layer_ids
        self.embed = Embedding(spec) if first else None
        self.layers = nn.ModuleDict({str(i): block(spec, i) for i in ids})
        self.head = Head(spec) if last else None
        if first and last and spec.tie_embeddings:
            self.head.out.weight = self.embed.tok.weight

    @property
    def first(self) -> bool:
        return self.embed is not None

    @property
    def last(self) -> bool:
        return self.head is not None

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.head is not None:
            return self.head(x, target)
        return x

    def stage(self, layer_ids: Iterable[int], first: bool, last: bool) -> Transformer:
        """A pipeline stage sharing this model's modules: the given layers, plus embedding / head.

        A stage holding the head but not the embedding of a tied model gets its own output weight, to hold a
        copy of the embedding (``parallelize`` records that it is initialised from ``embed.tok.weight`` and
        that the two gradients are summed).
        """
        st = Transformer.__new__(Transformer)
        nn.Module.__init__(st)
        st.spec = self.spec
        st.embed = self.embed if first else None
        st.layers = nn.ModuleDict({str(i): self.layers[str(i)] for i in layer_ids})
        st.head = self.head if last else None
        if last and not first and self.spec.tie_embeddings:
            head = Head.__new__(Head)
            nn.Module.__init__(head)
            head.norm = self.head.norm
            with torch.device(self.head.out.weight.device):
                head.out = OutputLayer(*self.head.out.weight.shape)
            st.head = head
        return st


# ---- deterministic initialisation ---------------------------------------------------------------

_OUT_PROJ = ("attn.proj.weight", "mlp.down.weight", "mlp.proj.weight", "mlp.experts.down", "mlp.shared.down.weight")


def init_std(name: str, spec: ModelSpec) -> float | None:
    """Normal std for a weight, or None for ones (norm weights) / zeros (biases)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(".bias"):
        return 0.0
    if name.endswith(_OUT_PROJ):
        return 0.02 / math.sqrt(2 * spec.num_layers)
    return 0.02


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def full_init(name: str, shape: torch.Size, spec: ModelSpec, seed: int, device: torch.device) -> torch.Tensor:
    """The unsharded initial value of parameter ``name`` (identical whatever the plan)."""
    std = init_std(name, spec)
    if device.type == "meta":  # a memory replay: no values
        return torch.empty(shape, device=device)
    if std is None:
        return torch.ones(shape, device=device)
    if std == 0.0:
        return torch.zeros(shape, device=device)
    # drawn on the CPU whatever the device, so GPU and CPU runs of one seed start from the same weights
    gen = torch.Generator()
    gen.manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen).to(device)


class Sharding(Protocol):
    """Which slice of a full tensor a parameter holds (``runtime.parallel.tensor_parallel.ShardSpec``)."""

    def full_shape(self, local: torch.Size) -> torch.Size: ...

    def take(self, full: torch.Tensor) -> torch.Tensor: ...


class InitInfo(Protocol):
    """What initialisation needs to know of a parameter (``runtime.parallel.params.ParamInfo``)."""

    @property
    def shard(self) -> Sharding | None: ...

    @property
    def init_key(self) -> str: ...


@torch.no_grad()
def init_parameters(model: nn.Module, spec: ModelSpec, seed: int, infos: Mapping[str, InitInfo] | None = None) -> None:
    """Initialise every parameter from ``(seed, its full name)`` in its full shape, then keep its shard.

    ``infos`` (by parameter name) may say that a parameter holds a slice of the full tensor (``shard``) or
    copies another parameter's initial value (``init_key``, for a tied head); without it every parameter is
    whole and drawn under its own name.
    """
    for name, p in model.named_parameters():
        info = infos[name] if infos is not None else None
        key = info.init_key if info is not None else name
        shard = info.shard if info is not None else None
        shape = shard.full_shape(p.shape) if shard is not None else p.shape
        full = full_init(key, shape, spec, seed, p.device)
        p.copy_(shard.take(full) if shard is not None else full)
