"""Parameters one GPU holds under tensor parallelism ``t``: per transformer layer, embedding, LM head, and per
virtual pipeline stage. Exact counts of what the runtime allocates (tests/runtime check them against its
tensors): column- and row-parallel weights are split t ways, each fused part (q | k | v, gate | up) and the
vocabulary padded to a multiple of t; norms and the row-parallel biases stay whole on every rank. All
functions broadcast over numpy arrays of ``t``.
"""

from __future__ import annotations

import numpy as np

from specs.model import ModelSpec


def _split(n: int, t: np.ndarray) -> np.ndarray:
    """Rows of an ``n``-row segment on one rank: ceil(n / t) (zero-padded on the last ranks)."""
    return np.ceil(n / t)


def layer_params(model: ModelSpec, t) -> np.ndarray:
    """Parameters of one transformer layer on one GPU."""
    t = np.asarray(t, dtype=float)
    if model.block is not None:  # a traced custom block: its count, split evenly
        return model.block.params / t
    h, f, qw, kw = model.hidden_size, model.ffn, model.q_width, model.kv_width
    qkv_rows = _split(qw, t) + 2 * _split(kw, t)
    mlp_rows = (2 if model.arch == "llama" else 1) * _split(f, t)
    sharded = qkv_rows * h + h * _split(qw, t) + mlp_rows * h + h * _split(f, t)
    if model.arch == "gpt":  # column-parallel biases are split, the row-parallel ones (proj, mlp out) whole
        return sharded + qkv_rows + mlp_rows + 2 * h + 4 * h  # + two LayerNorms (weight and bias)
    return sharded + (qkv_rows if model.qkv_bias else 0) + 2 * h  # + two RMSNorms


def embedding_params(model: ModelSpec, t) -> np.ndarray:
    """The input embedding on one GPU: a vocabulary shard, and GPT's learned positions (whole)."""
    t = np.asarray(t, dtype=float)
    pos = model.seq_length * model.hidden_size if model.arch == "gpt" else 0
    return _split(model.vocab_size, t) * model.hidden_size + pos


def head_params(model: ModelSpec, t, own_output: bool | np.ndarray) -> np.ndarray:
    """The final norm and the LM head on one GPU; ``own_output``: the head holds its output weights (not tied
    to an embedding on the same GPU)."""
    t = np.asarray(t, dtype=float)
    norm = 2 * model.hidden_size if model.arch == "gpt" else model.hidden_size
    return norm + np.where(own_output, _split(model.vocab_size, t) * model.hidden_size, 0.0)


def replicated_layer_params(model: ModelSpec) -> int:
    """Parameters of a layer every tensor-parallel rank holds whole: the norms and the row-parallel biases."""
    if model.block is not None:
        return 0
    h = model.hidden_size
    return 6 * h if model.arch == "gpt" else 2 * h  # GPT: two LayerNorms (weight, bias), attention/MLP out biases


def stage_params(model: ModelSpec, t, layers: np.ndarray) -> np.ndarray:
    """Parameters of each virtual stage on one GPU: ``layers`` is [..., stages] layers per stage (broadcast
    against ``t`` of shape [...]); the first stage holds the embedding, the last the head (with its own copy
    of a tied embedding when the two are on different stages)."""
    layers = np.asarray(layers, dtype=float)
    t = np.asarray(t, dtype=float)[..., None]
    nv = layers.shape[-1]
    out = layers * layer_params(model, t)
    first = np.zeros(nv)
    first[0] = 1.0
    last = np.zeros(nv)
    last[-1] = 1.0
    own = (not model.tie_embeddings) or nv > 1
    return out + first * embedding_params(model, t) + last * head_params(model, t, own)


def gradient_groups(model: ModelSpec, t, sp, layers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each virtual stage's parameters by how their gradients are reduced ([..., stages] like ``layers``):
    (over data parallelism only, also summed over tensor parallelism, also summed with the other end of the
    pipeline). With sequence parallelism every parameter held whole on the tensor-parallel ranks (norms,
    row-parallel biases, GPT's positions) sees only its sequence shard, so its gradient is summed over tp; a tied
    embedding split over the first and the last stage sums its two gradients."""
    layers = np.asarray(layers, dtype=float)
    nv = layers.shape[-1]
    total = stage_params(model, t, layers)
    t = np.asarray(t, dtype=float)[..., None]
    first, last = np.zeros(nv), np.zeros(nv)
    first[0], last[-1] = 1.0, 1.0
    whole = layers * replicated_layer_params(model) + last * head_params(model, 1, False)  # + final norm
    if model.arch == "gpt":
        whole = whole + first * model.seq_length * model.hidden_size
    summed = np.where(np.asarray(sp)[..., None] & (t > 1), whole, 0.0)
    tied = np.zeros_like(total)
    if model.tie_embeddings and nv > 1:
        tied = (first + last) * np.ceil(model.vocab_size / t) * model.hidden_size
    return total - summed - tied, summed, tied


def gradient_buckets(groups: tuple[np.ndarray, ...], bucket_params: int) -> np.ndarray:
    """Data-parallel gradient buckets of each stage: each reduce group's parameters cut into equal buckets of at
    most ``bucket_params`` (what the runtime allocates; ZeRO-2/3 use a bucket per layer instead)."""
    return sum(np.ceil(np.asarray(g) / bucket_params) for g in groups)
