"""The MoE layer of the plain model (runtime/models/moe.py) against independent computations: its parameter count
is the spec's, its output is every token's top-k experts summed by hand, ties route to the lower expert, and its
aux loss reaches the router as the explicit loss would."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.models import build_model
from runtime.models.moe import MoE
from specs.model import ModelSpec
from specs.model_loading import load_model
from specs.moe import MoESpec

torch.manual_seed(0)


def _spec(**moe) -> ModelSpec:
    base = dict(num_experts=6, experts_per_token=2, moe_ffn_hidden_size=24)
    return ModelSpec(name="m", arch="llama", num_layers=3, hidden_size=16, num_attention_heads=2,
                     ffn_hidden_size=40, vocab_size=50, seq_length=8, moe=MoESpec(**{**base, **moe}))


@pytest.mark.parametrize("spec", [
    load_model("tiny-moe"), _spec(num_shared_experts=2, shared_expert_gate=True, first_dense_layers=1),
    _spec(layer_freq=2, first_dense_layers=1),
])
def test_parameter_count_is_the_specs(spec):
    model = build_model(spec, "meta")
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


def _moe(**kw) -> MoE:
    m = MoE(_spec(**kw))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


@pytest.mark.parametrize("kw", [{}, {"router": "sigmoid"}, {"norm_topk_prob": False, "num_shared_experts": 1},
                                {"num_shared_experts": 1, "shared_expert_gate": True}])
def test_output_is_each_tokens_experts_summed_by_hand(kw):
    m = _moe(**kw).eval()
    x = torch.randn(2, 5, 16)
    got = m(x)
    spec = m.moe
    for b in range(2):
        for s in range(5):
            t = x[b, s]
            logits = m.router.weight @ t
            p = torch.softmax(logits, 0) if spec.router == "softmax" else torch.sigmoid(logits)
            top = sorted(range(spec.num_experts), key=lambda e: (-p[e].item(), e))[: spec.experts_per_token]
            w = p[top] / (p[top].sum() if spec.norm_topk_prob else 1.0)
            want = torch.zeros(16)
            for e, we in zip(top, w):
                gate, up = (m.experts.gate_up[e] @ t).chunk(2)
                want += we * (m.experts.down[e] @ (F.silu(gate) * up))
            if m.shared is not None:
                gate, up = (m.shared.gate_up.weight @ t).chunk(2)
                sh = m.shared.down.weight @ (F.silu(gate) * up)
                want += torch.sigmoid(m.shared_gate.weight @ t) * sh if m.shared_gate is not None else sh
            torch.testing.assert_close(got[b, s], want, rtol=1e-5, atol=1e-5)


def test_ties_route_to_the_lower_expert():
    m = _moe()
    with torch.no_grad():
        m.router.weight.zero_()  # every expert scores the same
    _, choice, weight = m.route(torch.randn(3, 4, 16))
    assert (choice == torch.tensor([0, 1])).all() and torch.allclose(weight, torch.full_like(weight, 0.5))


def test_aux_loss_reaches_the_router_as_the_explicit_loss():
    """Training mode adds d(coef x aux) in the backward; the same as adding coef x aux to the loss explicitly."""
    m = _moe(aux_loss_coef=0.3)
    x = torch.randn(2, 5, 16)
    g = torch.randn(2, 5, 16)
    (m.train()(x) * g).sum().backward()
    injected = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    out = m.eval()(x)
    probs, choice, _ = m.route(x)
    ((out * g).sum() + 0.3 * m.aux_loss(probs, choice)).backward()
    assert injected["router.weight"].norm() > 0
    for n, p in m.named_parameters():
        torch.testing.assert_close(injected[n], p.grad, rtol=1e-5, atol=1e-7)


def test_aux_loss_is_per_sequence_so_micro_batches_add_up():
    """Half-batches with losses and aux gradients scaled by 1/2 give the whole batch's gradients (fp32 sums in
    another order: 1e-6 absolute on gradients of order 0.1; seeded, as the test order moves the global generator)."""
    torch.manual_seed(0)
    m = _moe(aux_loss_coef=0.5).train()
    x, g = torch.randn(4, 5, 16), torch.randn(4, 5, 16)
    (m(x) * g).sum().div(4).backward()
    whole = m.router.weight.grad.clone()
    m.zero_grad()
    m.aux_scale = 0.5
    for half in (slice(0, 2), slice(2, 4)):
        (m(x[half]) * g[half]).sum().div(2).mul(0.5).backward()
    torch.testing.assert_close(m.router.weight.grad, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_loop(dtype):
    """The grouped-GEMM path of ``kernels.experts_swiglu`` (torch's grouped_mm, what CUDA runs) gives the loop's
    outputs and gradients, with an expert that received no rows among them."""
    from runtime import kernels
    from runtime.kernels.experts_op import grouped_ok
    counts = torch.tensor([5, 0, 3, 8])
    x = torch.randn(int(counts.sum()), 32, dtype=dtype)
    gate_up, down = torch.randn(4, 48, 32, dtype=dtype) / 6, torch.randn(4, 32, 24, dtype=dtype) / 5
    assert grouped_ok(x, gate_up, down)
    runs = {}
    for backend in ("triton", "torch"):  # grouped on the kernel path, the loop on the reference path
        kernels.set_backend(backend)
        try:
            leaves = [t.clone().requires_grad_() for t in (x, gate_up, down)]
            y = kernels.experts_swiglu(*leaves, counts)
            y.float().square().sum().backward()
            runs[backend] = [y.detach().float()] + [t.grad.float() for t in leaves]
        finally:
            kernels.set_backend("auto")
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the two sum their products in other orders
    for got, want in zip(runs["triton"], runs["torch"]):
        assert (got - want).norm() <= tol * want.norm()
    assert runs["torch"][2][1].abs().sum() == 0  # the empty expert's gate_up gets a zero gradient
