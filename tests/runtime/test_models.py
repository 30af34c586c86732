"""The plain models against from-scratch formulas, parameter counts against the planner, deterministic init."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from runtime.models import build_model
from runtime.models.common import full_init
from runtime.parallel.recompute import is_recomputed, recompute_module
from specs.model import ModelSpec
from specs.model_loading import load_model


def _spec(arch: str, **kw) -> ModelSpec:
    base = dict(name="t", arch=arch, num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50,
                seq_length=12, dropout=0.0)
    base.update({"num_kv_heads": 2, "ffn_hidden_size": 48} if arch == "llama" else {"ffn_hidden_size": 80})
    return ModelSpec(**{**base, **kw})


def _attention(q, k, v):  # [b, s, h, d], causal, kv heads repeated by group
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    n = q.shape[1]
    s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).flatten(2)


def _rope(spec, s):
    """Rotate-half RoPE on each head's first ``spec.rope_dims`` dimensions over ``s`` positions, the rest as they
    are (no rotation with learned positions)."""
    rd = spec.rope_dims
    ang = torch.arange(s)[:, None] * spec.rope_theta ** (-torch.arange(0, rd, 2) / max(rd, 1))[None]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]

    def rot(x):
        a, c, rest = x[..., : rd // 2], x[..., rd // 2: rd], x[..., rd:]
        return torch.cat([a * cos - c * sin, c * cos + a * sin, rest], -1) if rd else x

    return rot


def _llama_loss(P, spec, tok, tgt):
    rms = lambda x, w: x / torch.sqrt((x * x).mean(-1, keepdim=True) + spec.norm_eps) * w  # noqa: E731
    b, s = tok.shape
    hd, nh, nkv = spec.hd, spec.num_attention_heads, spec.kv_heads
    rot = _rope(spec, s)

    h = P["embed.tok.weight"][tok]
    for i in range(spec.num_layers):
        p = lambda n: P[f"layers.{i}.{n}"]  # noqa: B023, E731
        q, k, v = (rms(h, p("attn_norm.weight")) @ p("attn.qkv.weight").T).split([nh * hd, nkv * hd, nkv * hd], -1)
        o = _attention(rot(q.view(b, s, nh, hd)), rot(k.view(b, s, nkv, hd)), v.view(b, s, nkv, hd))
        h = h + o @ p("attn.proj.weight").T
        gate, up = (rms(h, p("mlp_norm.weight")) @ p("mlp.gate_up.weight").T).chunk(2, -1)
        h = h + (gate * torch.sigmoid(gate) * up) @ p("mlp.down.weight").T
    logits = rms(h, P["head.norm.weight"]) @ P["head.out.weight" if "head.out.weight" in P else "embed.tok.weight"].T
    return F.cross_entropy(logits.flatten(0, 1), tgt.flatten())


def _gpt_loss(P, spec, tok, tgt):
    ln = lambda x, n: F.layer_norm(x, (x.shape[-1],), P[n + ".weight"], P[n + ".bias"], spec.norm_eps)  # noqa: E731
    b, s = tok.shape
    nh, hd = spec.num_attention_heads, spec.hd
    rot = _rope(spec, s)

    h = P["embed.tok.weight"][tok] + (P["embed.pos.weight"][:s] if "embed.pos.weight" in P else 0.0)
    bias = lambda n: P.get(n, 0.0)  # noqa: E731 - a model without linear biases has none
    for i in range(spec.num_layers):
        n = f"layers.{i}."
        qkv = ln(h, n + "attn_norm") @ P[n + "attn.qkv.weight"].T + bias(n + "attn.qkv.bias")
        q, k, v = (t.reshape(b, s, nh, hd) for t in qkv.chunk(3, -1))
        h = h + _attention(rot(q), rot(k), v) @ P[n + "attn.proj.weight"].T + bias(n + "attn.proj.bias")
        x = ln(h, n + "mlp_norm") @ P[n + "mlp.fc.weight"].T + bias(n + "mlp.fc.bias")
        if spec.act == "squared_relu":
            x = x.clamp(min=0) ** 2
        else:
            x = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
        h = h + x @ P[n + "mlp.proj.weight"].T + bias(n + "mlp.proj.bias")
    logits = ln(h, "head.norm") @ P["head.out.weight" if "head.out.weight" in P else "embed.tok.weight"].T
    return F.cross_entropy(logits.flatten(0, 1), tgt.flatten())


@pytest.mark.parametrize("arch,attention,tied,extra", [
    ("llama", "flash", False, {}), ("llama", "unfused", True, {}), ("gpt", "unfused", False, {}),
    ("gpt", "flash", True, {}), ("gpt", "flash", False, {"activation": "squared_relu", "linear_bias": False}),
    ("gpt", "flash", False, {"activation": "squared_relu", "linear_bias": False, "rotary_fraction": 0.5}),
    ("gpt", "unfused", True, {"rotary_fraction": 1.0}), ("llama", "flash", False, {"rotary_fraction": 0.25})])
def test_model_matches_from_scratch_formulas(arch, attention, tied, extra):
    spec = _spec(arch, attention=attention, tie_embeddings=tied, **extra)
    if extra.get("linear_bias") is False:  # Nemotron-4's block: no bias on any projection (the norms keep theirs)
        assert not any(n.endswith(".bias") and "norm" not in n for n, _ in build_model(spec, "meta").named_parameters())
    model = build_model(spec, seed=3)
    tok = torch.randint(0, spec.vocab_size, (2, spec.seq_length), generator=torch.Generator().manual_seed(0))
    tgt = tok.roll(-1, 1)
    P = dict(model.named_parameters())
    want = (_llama_loss if arch == "llama" else _gpt_loss)(P, spec, tok, tgt)
    got = model(tok, tgt)
    assert abs(got.item() - want.item()) <= 1e-5 * want.item()
    got.backward()
    g = torch.autograd.grad(want, [P["embed.tok.weight"]])[0]
    assert torch.allclose(P["embed.tok.weight"].grad, g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt", "llama-1b", "gpt-1.7b"])
def test_parameter_count_matches_the_planners(name):
    spec = load_model(name)
    variants = [{"tie_embeddings": t} for t in (False, True)]
    if spec.arch == "gpt":
        variants += [{"linear_bias": False, "activation": "squared_relu", "rotary_fraction": 0.5},
                     {"linear_bias": False, "qkv_bias": True}]
    for update in variants:
        s = ModelSpec(**{**spec.model_dump(), **update})
        assert sum(p.numel() for p in build_model(s, "meta").parameters()) == s.num_params


def test_init_is_a_function_of_seed_and_name():
    spec = load_model("tiny")
    a, b = build_model(spec, seed=5), build_model(spec, seed=5)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    w = full_init("layers.0.attn.qkv.weight", torch.Size([4, 4]), spec, 5, torch.device("cpu"))
    assert not torch.equal(w, full_init("layers.1.attn.qkv.weight", torch.Size([4, 4]), spec, 5, torch.device("cpu")))
    assert not torch.equal(w, full_init("layers.0.attn.qkv.weight", torch.Size([4, 4]), spec, 6, torch.device("cpu")))
    assert torch.equal(full_init("layers.0.attn_norm.weight", torch.Size([3]), spec, 5, torch.device("cpu")),
                       torch.ones(3))
    proj = full_init("layers.0.attn.proj.weight", torch.Size([256, 256]), spec, 5, torch.device("cpu"))
    assert abs(proj.std().item() - 0.02 / math.sqrt(2 * spec.num_layers)) < 1e-3


def test_recompute_keeps_names_and_results():
    spec = _spec("llama", attention="unfused")
    tok = torch.randint(0, spec.vocab_size, (2, spec.seq_length), generator=torch.Generator().manual_seed(1))
    base, rc = build_model(spec, seed=1), build_model(spec, seed=1)
    recompute_module(rc.layers["0"])
    recompute_module(rc.layers["1"].attn.core)
    assert is_recomputed(rc.layers["0"]) and not is_recomputed(rc.layers["1"])
    assert [n for n, _ in base.named_parameters()] == [n for n, _ in rc.named_parameters()]
    base(tok, tok).backward()
    rc(tok, tok).backward()
    for (n, p), (_, q) in zip(base.named_parameters(), rc.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-8), n
