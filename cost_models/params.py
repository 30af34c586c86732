"""Parameters one GPU holds per virtual pipeline stage (from the model spec's per-GPU counts:
``ModelSpec.layer_params_on`` and its neighbours), and how their gradients are reduced and bucketed. Exact
counts of what the runtime allocates (tests/runtime check them against its tensors). All functions broadcast
over numpy arrays of ``t``.
"""

from __future__ import annotations

import numpy as np

from cost_models.compute import ArrayLike
from specs.model import ModelSpec
from specs.parallel import sp_in_effect
from specs.state import bucket_count


def end_stages(nv: int) -> tuple[np.ndarray, np.ndarray]:
    """[nv] indicators of the first virtual stage (it holds the embedding) and of the last (the head)."""
    first, last = np.zeros(nv), np.zeros(nv)
    first[0], last[-1] = 1.0, 1.0
    return first, last


def per_rank(x: ArrayLike, pp: int, vpp: int) -> np.ndarray:
    """[..., pp * vpp] per virtual stage -> [..., pp, vpp] per rank and model chunk (stage j = chunk * pp + rank)."""
    x = np.asarray(x, dtype=float)
    return x.reshape(*x.shape[:-1], vpp, pp).swapaxes(-1, -2)


def _last(x) -> np.ndarray:
    """A per-candidate value ([...]) against per-stage arrays ([..., stages])."""
    return np.asarray(x, dtype=float)[..., None]


def moe_layers(model: ModelSpec, layers: np.ndarray) -> np.ndarray:
    """How many of each stage's layers are MoE layers ([..., stages] in pipeline order: stage j holds the layers
    after those of stages 0..j-1); zeros for a dense model."""
    layers = np.asarray(layers, dtype=float)
    if model.moe is None:
        return np.zeros_like(layers)
    end = np.cumsum(layers, axis=-1)
    return model.moe.moe_layers_before(end) - model.moe.moe_layers_before(end - layers)


def _per_layer(model: ModelSpec, layers: np.ndarray, count) -> np.ndarray:
    """``count(moe_share)`` summed over each stage's layers: its dense layers' (share 0) and its MoE layers' (1)
    exactly, not the model's average layer."""
    layers = np.asarray(layers, dtype=float)
    moe = moe_layers(model, layers)
    return (layers - moe) * count(0.0) + moe * count(1.0) if model.moe is not None else layers * count(None)


def stage_params(model: ModelSpec, t: ArrayLike, layers: np.ndarray, ep: ArrayLike = 1,
                 etp: ArrayLike = 1) -> np.ndarray:
    """Parameters of each virtual stage on one GPU: ``layers`` is [..., stages] layers per stage (broadcast
    against ``t``, ``ep`` and ``etp`` of shape [...]); the first stage holds the embedding, the last the head (with
    its own copy of a tied embedding when the two are on different stages)."""
    layers = np.asarray(layers, dtype=float)
    t = np.asarray(t, dtype=float)[..., None]
    nv = layers.shape[-1]
    out = _per_layer(model, layers, lambda share: model.layer_params_on(t, _last(ep), _last(etp), share))
    first, last = end_stages(nv)
    return out + first * model.embedding_params_on(t) + last * head_params(model, t, nv)


def head_params(model: ModelSpec, t: ArrayLike, nv: int) -> np.ndarray:
    """The last of ``nv`` stages' final norm and LM head on one GPU (with its own copy of a tied embedding when
    the two are on different stages)."""
    return model.head_params_on(t, (not model.tie_embeddings) or nv > 1)


def expert_params(model: ModelSpec, layers: np.ndarray, ep: ArrayLike, etp: ArrayLike) -> np.ndarray:
    """Of :func:`stage_params`, the routed experts' parameters ([..., stages]): sharded over ep x etp, their gradients
    reduced (and ZeRO-1's optimizer state sharded) over the expert-data-parallel group."""
    return _per_layer(model, layers, lambda share: model.expert_params_on(_last(ep), _last(etp), share))


def gradient_groups(model: ModelSpec, t: ArrayLike, sp: ArrayLike, layers: np.ndarray, ep: ArrayLike = 1,
                    etp: ArrayLike = 1
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each virtual stage's parameters by how their gradients are reduced ([..., stages] like ``layers``):
    (over data parallelism only, also summed over tensor parallelism, also summed with the other end of the
    pipeline, over the expert-data-parallel group instead). With sequence parallelism every parameter held whole
    on the tensor-parallel ranks (norms, row-parallel biases, GPT's positions, a MoE layer's router) sees only its
    sequence shard, so its gradient is summed over tp; a tied embedding split over the first and the last stage
    sums its two gradients; a MoE model's routed experts are reduced over their own replicas (:func:`expert_params`).
    The four add up to :func:`stage_params`."""
    layers = np.asarray(layers, dtype=float)
    nv = layers.shape[-1]
    experts = expert_params(model, layers, ep, etp)
    total = stage_params(model, t, layers, ep, etp) - experts
    t = np.asarray(t, dtype=float)[..., None]
    first, last = end_stages(nv)
    whole = (_per_layer(model, layers, model.replicated_params) + last * model.head_params_on(1, False)  # + final norm
             + first * model.position_params)
    summed = np.where(sp_in_effect(np.asarray(sp)[..., None], t), whole, 0.0)
    tied = np.zeros_like(total)
    if model.tie_embeddings and nv > 1:
        tied = (first + last) * np.ceil(model.vocab_size / t) * model.hidden_size
    return total - summed - tied, summed, tied, experts


def zero3_regather(model: ModelSpec, t: ArrayLike, nv: int) -> np.ndarray:
    """Parameters ZeRO-3 gathers once more per micro-batch: a tied embedding on a single stage is used again by
    the head, so its bucket (the embedding and the first layer) is gathered for the head's forward and kept
    to the embedding's backward (runtime/parallel/data_parallel.py)."""
    t = np.asarray(t, dtype=float)
    if not (model.tie_embeddings and nv == 1):
        return np.zeros_like(t)
    return model.embedding_params_on(t) + model.layer_params_on(t)


def gradient_buckets(groups: tuple[np.ndarray, ...], bucket_params: int) -> np.ndarray:
    """Data-parallel gradient buckets of each stage: each reduce group's parameters cut into equal buckets of at
    most ``bucket_params`` (what the runtime allocates; ZeRO-2/3 use a bucket per layer instead)."""
    return sum(bucket_count(np.asarray(g), bucket_params) for g in groups)
