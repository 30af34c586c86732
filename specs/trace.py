"""Plan any ``nn.Module``: build it on the meta device, trace it, count what the cost model needs.

``--model pkg.module:factory`` calls ``factory()`` under ``torch.device("meta")`` (no memory, no weights),
finds the repeated transformer block (the longest outermost ``nn.ModuleList`` of identical blocks), and measures on one
sequence of meta tensors:

- matmul FLOPs per token of one block, from a ``make_fx`` trace of a middle block called with the arguments
  the model really passes it (torch.fx graph of aten ops: every mm / addmm / bmm / baddbmm / convolution
  node's FLOPs), with attention (scaled-dot-product ops, or the batched matmuls over an s x s score matrix
  they decompose into) counted apart because it grows with the sequence length;
- bytes moved by the block's other (memory-bound) ops, from the same graph;
- bytes of activations one block saves for backward, from autograd's saved-tensor hooks during a forward
  (parameters excluded, each tensor counted once, s x s attention scores excluded as flash attention keeps
  none);
- parameters per block, the embedding (vocabulary and hidden size) and the rest (head).

The result is a ``ModelSpec`` with ``block`` counts that the cost model uses instead of its formulas.
This is the only module of the planner that imports torch.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from specs.errors import AutoparError, needs_torch, validation_message
from specs.model import BlockCounts, ModelSpec

MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution")
ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "scaled_dot_product_attention",
                 "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention_for_cpu")
VIEW_OPS = ("view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "reshape",
            "detach", "alias", "getitem", "<built-in function getitem>", "unbind", "split", "slice", "select",
            "split_with_sizes", "chunk", "lift_fresh_copy", "scalar_tensor", "ones", "zeros", "full", "empty")
HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_head", "n_heads", "nhead")
KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
SEQ_ATTRS = ("seq_length", "max_position_embeddings", "n_positions", "max_seq_len", "block_size")


@contextmanager
def _user_code(ref: str, what: str) -> Iterator[None]:
    """Run the user's code: any failure (sys.exit and other BaseExceptions too) becomes one line naming it."""
    try:
        yield
    except (KeyboardInterrupt, AutoparError):
        raise
    except SystemExit as err:
        raise AutoparError(f"--model {ref}: {what}: it called sys.exit({err.code!r})") from None
    except BaseException as err:  # noqa: BLE001 - user code: whatever it raises is reported, never a traceback
        raise AutoparError(f"--model {ref}: {what}: {type(err).__name__}: {err}") from None


def _factory(ref: str):
    mod_name, _, fn_name = ref.partition(":")
    if not mod_name or not fn_name:
        raise AutoparError(f"--model {ref}: expected pkg.module:factory")
    with _user_code(ref, f"importing {mod_name} failed"):
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as err:
            if err.name and f"{mod_name}.".startswith(f"{err.name}."):  # the module itself, not one it imports
                raise AutoparError(f"--model {ref}: cannot import {mod_name} ({err}); is it on PYTHONPATH?") from None
            raise
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise AutoparError(f"--model {ref}: {mod_name} has no callable {fn_name}")
    return fn


def _find(obj: Any, names: tuple[str, ...]) -> int | None:
    """An integer attribute by any of ``names`` on the object or its ``config``."""
    for o in (obj, getattr(obj, "config", None)):
        if o is None:
            continue
        for n in names:
            v = o.get(n) if isinstance(o, dict) else getattr(o, n, None)
            if isinstance(v, int) and v > 0:
                return v
    return None


def _blocks(model, ref: str):
    """The repeated transformer blocks: the longest of the outermost ModuleLists (a MoE layer's experts are a list
    inside a block) whose children share one type and parameter count. An outermost list of blocks that differ
    (dense and mixture-of-experts layers) is refused rather than planned as something inside them."""
    import torch.nn as nn

    lists = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList) and len(mod) > 0]
    outer = [(name, mod) for name, mod in lists if not any(name.startswith(f"{o}.") for o, _ in lists if o)]
    same = [(name, mod) for name, mod in outer
            if len({(type(m), sum(p.numel() for p in m.parameters())) for m in mod}) == 1]
    if same:
        return max(same, key=lambda x: len(x[1]))
    if outer:
        name = max(outer, key=lambda x: len(x[1]))[0]
        raise AutoparError(f"--model {ref}: the blocks of {name} differ (in type or parameter count, e.g. dense and "
                           "mixture-of-experts layers); autopar traces models whose repeated blocks are identical: "
                           "describe it as a model spec (a moe: section says which layers are experts)")
    raise AutoparError(f"--model {ref}: could not find the repeated transformer blocks; autopar needs the model "
                       "to keep them in an nn.ModuleList of identical blocks (e.g. self.layers = "
                       "nn.ModuleList([Block() for _ in range(n)])) that its forward calls in order")


def _node_flops(node) -> float:
    """FLOPs of a matmul-like aten node from its output and input shapes."""
    target = str(node.target).split(".")[-2] if "." in str(node.target) else str(node.target)
    out = node.meta.get("val")
    if out is None or not hasattr(out, "shape"):
        return 0.0
    args = [a.meta.get("val") for a in node.args if hasattr(a, "meta")]
    shapes = [tuple(a.shape) for a in args if hasattr(a, "shape")]
    if target in ("mm", "addmm"):
        a = shapes[-2]
        return 2.0 * out.numel() * a[-1]
    if target in ("bmm", "baddbmm"):
        a = shapes[-2]
        return 2.0 * out.numel() * a[-1]
    if target == "convolution":
        w = shapes[1]
        k = 1
        for d in w[1:]:
            k *= d
        return 2.0 * out.numel() * k
    return 0.0


def _attention_flops(node) -> float:
    """Forward FLOPs of a scaled-dot-product attention node (QK^T and PV, full square)."""
    q = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
    k = node.args[1].meta.get("val") if hasattr(node.args[1], "meta") else None
    if q is None or k is None:
        return 0.0
    *batch, sq, d = q.shape
    sk = k.shape[-2]
    n = 1
    for x in batch:
        n *= x
    return 4.0 * n * sq * sk * d


def _is_attention_matmul(node, seq: int) -> bool:
    """A batched matmul of decomposed attention: scores (.., s, s) come out of QK^T or go into PV."""
    out = node.meta.get("val")
    ins = [a.meta.get("val") for a in node.args if hasattr(a, "meta")]
    for t in [out, *ins]:
        if t is not None and hasattr(t, "shape") and len(t.shape) >= 2 and t.shape[-1] == seq and t.shape[-2] == seq:
            return True
    return False


def model_from_module(ref: str, seq: int | None = None) -> ModelSpec:
    """Build, trace and count ``pkg.module:factory`` (see module docstring)."""
    try:
        import torch
        import torch.nn as nn
        from torch.fx.experimental.proxy_tensor import make_fx
    except ImportError as err:
        raise needs_torch("--model pkg.module:factory", err) from None
    fn = _factory(ref)
    with _user_code(ref, "the factory failed on the meta device"), torch.device("meta"):
        model = fn()
    if not isinstance(model, nn.Module):
        raise AutoparError(f"--model {ref}: the factory returned {type(model).__name__}, not an nn.Module")
    prefix, blocks = _blocks(model, ref)
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeds:
        raise AutoparError(f"--model {ref}: no nn.Embedding found; autopar plans token-input language models")
    s = seq or _find(model, SEQ_ATTRS) or ModelSpec.model_fields["seq_length"].default
    heads = _find(blocks[0], HEAD_ATTRS) or _find(model, HEAD_ATTRS)
    for sub in blocks[0].modules():
        heads = heads or _find(sub, HEAD_ATTRS)
    kv = _find(model, KV_ATTRS) or heads

    ids = torch.zeros(1, s, dtype=torch.long, device="meta")
    mid = len(blocks) // 2  # a middle block: representative, free of first/last special cases
    captured: dict[str, Any] = {}

    def grab(module, args, kwargs) -> None:
        captured.setdefault("call", (args, kwargs))

    looked_up: dict[int, bool] = {}  # each embedding the forward called: with the token ids (or positions, ...)

    def lookup(module, args) -> None:
        t = args[0] if args else None
        looked_up.setdefault(id(module), t is ids or getattr(t, "_base", None) is ids)  # the ids or a view of them

    hooks = [blocks[mid].register_forward_pre_hook(grab, with_kwargs=True),
             *(e.register_forward_pre_hook(lookup) for e in embeds)]
    try:
        with _user_code(ref, "the forward failed on meta tensors"), torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    if "call" not in captured:
        raise AutoparError(f"--model {ref}: the forward never called the repeated blocks ({prefix})")
    # the vocabulary: the embedding the token ids index (a character model's 65 tokens, not its 256 positions)
    tokens_in = [e for e in embeds if looked_up.get(id(e))] or embeds
    emb = max(tokens_in, key=lambda m: m.num_embeddings)
    vocab, hidden = emb.num_embeddings, emb.embedding_dim
    declared = _find(model, SEQ_ATTRS)  # a learned position table: not indexed by the ids, the declared length
    short = [e for e in embeds if looked_up.get(id(e)) is False and e.num_embeddings == declared and declared < s]
    if short and tokens_in is not embeds:  # (where the token embedding was told apart from the others)
        raise AutoparError(f"--model {ref}: a sequence of {s} tokens is beyond the model's table of "
                           f"{short[0].num_embeddings} positions (an nn.Embedding indexed by position); give --seq "
                           f"{short[0].num_embeddings} or less")
    args, kwargs = captured["call"]
    with _user_code(ref, "tracing a block failed"):
        gm = make_fx(lambda *a: blocks[mid](*a, **kwargs))(*args)
    mm, attn, moved = _graph_counts(gm, s)
    with _user_code(ref, "the forward failed on meta tensors"):
        saved = _saved_bytes(model, blocks, ids)

    tokens = float(s)
    total = sum(p.numel() for p in model.parameters())
    block_params = sum(p.numel() for p in blocks[0].parameters())
    rest = total - len(blocks) * block_params - vocab * hidden
    counts = BlockCounts(
        params=block_params,
        fwd_flops_per_token=mm / tokens,
        attn_flops_per_token=attn / tokens,
        act_bytes_per_token=saved[mid] / tokens * (2.0 / 4.0 if _is_fp32(model) else 1.0),
        elementwise_bytes_per_token=moved / tokens * (2.0 / 4.0 if _is_fp32(model) else 1.0),
    )
    name = type(model).__name__  # the module's class (ToyLM), not the factory's name (build)
    try:
        return ModelSpec(
            name=name, arch="llama", num_layers=len(blocks), hidden_size=hidden,
            num_attention_heads=heads or 1, num_kv_heads=kv or heads or 1, ffn_hidden_size=4 * hidden,
            vocab_size=vocab, seq_length=s, tie_embeddings=rest < vocab * hidden // 2, attention="flash",
            dropout=0.0, head_dim=max(1, hidden // (heads or 1)), block=counts,
        )
    except ValidationError as err:
        raise AutoparError(f"--model {ref}: the traced model is out of range: {validation_message(err)}") from None


def _graph_counts(gm, s: int) -> tuple[float, float, float]:
    """A traced block's matmul FLOPs, attention FLOPs and bytes its memory-bound ops move, for ``s`` tokens."""
    mm = attn = moved = 0.0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        base = name.split(".")[1] if name.startswith("aten.") else name
        if base in MATMUL_OPS:
            if base in ("bmm", "baddbmm") and _is_attention_matmul(node, s):
                attn += _node_flops(node)
            else:
                mm += _node_flops(node)
        elif base in ATTENTION_OPS:
            attn += _attention_flops(node)
        elif base not in VIEW_OPS:
            val = node.meta.get("val")
            if hasattr(val, "numel") and hasattr(val, "element_size"):
                moved += 2.0 * val.numel() * val.element_size()  # written, then read once
    return mm, attn, moved


def _saved_bytes(model, blocks, ids) -> dict[int, float]:
    """Bytes each block (by its index in ``blocks``) saves for backward in one forward of ``ids``."""
    import torch

    s = ids.shape[-1]
    saved: dict[int, float] = defaultdict(float)
    params = {id(p) for p in model.parameters()}
    current: list[int] = []
    seen: set[int] = set()

    def pack(t):
        # s x s score tensors are what the meta device's math attention saves; the flash kernels the runtime
        # uses on GPUs keep only the log-sum-exp, so they are not counted.
        base = t._base if t._base is not None else t  # views share their base's memory
        scores = base.dim() >= 2 and base.shape[-1] == s and base.shape[-2] == s
        if current and id(base) not in params and id(base) not in seen and not scores:
            seen.add(id(base))
            saved[current[-1]] += base.numel() * base.element_size()
        return t

    def enter(j: int):
        def hook(module, args) -> None:
            current.append(j)
        return hook

    def leave(module, args, output) -> None:
        current.pop()

    hooks = []
    for j, b in enumerate(blocks):
        hooks.append(b.register_forward_pre_hook(enter(j)))
        hooks.append(b.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return saved


def _is_fp32(model) -> bool:
    """Models built in fp32 on meta: counts are rescaled to 16-bit activations, as training runs them."""
    import torch

    p = next(model.parameters(), None)
    return p is not None and p.dtype == torch.float32
