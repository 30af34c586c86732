"""Fused linear + cross-entropy kernel vs the full-logits torch reference (Triton interpreter)."""

import math

import pytest
import torch
from kernel_testutils import assert_close, grads, leaf, needs_triton

import runtime.kernels as K
from runtime.kernels import cross_entropy_op as CE

pytestmark = needs_triton

DTYPES = [torch.float32, torch.bfloat16]


def _inputs(lead, hidden, vocab, dtype, n_ignored=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden) * 3).to(dtype)
    t = torch.randint(0, vocab, lead, generator=g)
    t.view(-1)[:n_ignored] = -100
    return x, w, t


def _run(fn, x, w, t, **kw):
    x1, w1 = leaf(x), leaf(w)
    loss = fn(x1, w1, t, **kw)
    gx, gw = grads(loss, (x1, w1), torch.tensor(1.0))
    return loss, gx, gw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,hidden,vocab,n_ignored,chunk", [
    ((37,), 40, 250, 0, None),       # one chunk
    ((3, 13), 33, 77, 5, 16),        # 3-D leading dims, ignore_index, 3 uneven chunks
    ((64,), 96, 300, 9, 24),
])
def test_linear_cross_entropy(lead, hidden, vocab, n_ignored, chunk, dtype):
    x, w, t = _inputs(lead, hidden, vocab, dtype, n_ignored)
    loss, gx, gw = _run(CE.linear_cross_entropy_triton, x, w, t, chunk_tokens=chunk)
    loss_ref, gx_ref, gw_ref = _run(CE.linear_cross_entropy_reference, x, w, t)
    assert loss.dtype == torch.float32 and gx.dtype == dtype and gw.dtype == dtype
    assert_close(loss, loss_ref, dtype, factor=0.1, what="loss")
    assert_close(gx, gx_ref, dtype, what="dx")
    assert_close(gw, gw_ref, dtype, what="dw")
    if n_ignored:
        assert torch.count_nonzero(gx.reshape(-1, hidden)[:n_ignored]) == 0
    if dtype == torch.float32:  # plain float64 autograd
        x3, w3 = leaf(x.double()), leaf(w.double())
        l64 = torch.nn.functional.cross_entropy((x3 @ w3.t()).reshape(-1, vocab), t.reshape(-1))
        gx64, gw64 = grads(l64, (x3, w3), torch.tensor(1.0, dtype=torch.float64))
        assert_close(loss, l64, dtype, what="loss vs f64")
        assert_close(gx, gx64, dtype, factor=5, what="dx vs f64")
        assert_close(gw, gw64, dtype, factor=5, what="dw vs f64")


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy_multi_block_vocab(monkeypatch, dtype):
    """Vocab wider than one block: the online max / sum-exp loop and the separate gradient pass."""
    monkeypatch.setattr(CE, "MAX_BLOCK_V", 64)
    x, w, t = _inputs((21,), 24, 250, dtype, n_ignored=3)
    loss, gx, gw = _run(K.linear_cross_entropy, x, w, t)
    loss_ref, gx_ref, gw_ref = _run(CE.linear_cross_entropy_reference, x, w, t)
    assert_close(loss, loss_ref, dtype, factor=0.1)
    assert_close(gx, gx_ref, dtype)
    assert_close(gw, gw_ref, dtype)


def test_linear_cross_entropy_grad_scale_and_partial_grads():
    """Upstream gradient scales the precomputed grads; only requested grads are built; no-grad forward."""
    x, w, t = _inputs((19,), 20, 50, torch.float32, n_ignored=2)
    x1, w1 = leaf(x), leaf(w)
    (gx,) = grads(2.5 * K.linear_cross_entropy(x1, w1, t), (x1,), torch.tensor(1.0))
    _, gx_ref, _ = _run(CE.linear_cross_entropy_reference, x, w, t)
    assert_close(gx, 2.5 * gx_ref, torch.float32)

    w2 = leaf(w)
    (gw,) = grads(K.linear_cross_entropy(x, w2, t) * -1.0, (w2,), torch.tensor(1.0))  # x needs no grad
    _, _, gw_ref = _run(CE.linear_cross_entropy_reference, x, w, t)
    assert_close(gw, -gw_ref, torch.float32)

    with torch.no_grad():
        loss = K.linear_cross_entropy(x, w, t)
    assert_close(loss, CE.linear_cross_entropy_reference(x, w, t), torch.float32)


def test_linear_cross_entropy_mixed_dtypes_autocast():
    """bf16 activations, fp32 master weight under CPU autocast: bf16 matmuls, fp32 weight grad."""
    x, w, t = _inputs((2, 9), 32, 120, torch.bfloat16, n_ignored=1)
    w = w.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, gx, gw = _run(K.linear_cross_entropy, x, w, t)
        loss_ref, gx_ref, gw_ref = _run(CE.linear_cross_entropy_reference, x, w, t)
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32
    assert_close(loss, loss_ref, torch.bfloat16, factor=0.1)
    assert_close(gx, gx_ref, torch.bfloat16)
    assert_close(gw, gw_ref, torch.bfloat16)


def test_linear_cross_entropy_fp16():
    """fp16: 1/n_valid is applied after the GEMMs (no underflow of the fp16 logits gradient)."""
    x, w, t = _inputs((300,), 16, 90, torch.float16, n_ignored=7)
    loss, gx, gw = _run(K.linear_cross_entropy, x, w, t)
    x3, w3 = leaf(x.double()), leaf(w.double())
    l64 = torch.nn.functional.cross_entropy(x3 @ w3.t(), t)
    gx64, gw64 = grads(l64, (x3, w3), torch.tensor(1.0, dtype=torch.float64))
    assert gx.dtype == torch.float16
    assert_close(loss, l64, torch.bfloat16, factor=0.1)
    assert_close(gx, gx64, torch.bfloat16, factor=0.5)
    assert_close(gw, gw64, torch.bfloat16, factor=0.5)


def test_linear_cross_entropy_backward_twice_raises():
    x, w, t = _inputs((4,), 8, 30, torch.float32)
    loss = K.linear_cross_entropy(leaf(x), leaf(w), t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


@pytest.mark.parametrize("g", [1.0, 0.0, -3.0])
def test_grad_scale_kernel(g):
    t = torch.randn(5000)
    out = CE.apply_grad_scale(t.clone(), torch.tensor(g), torch.float32)
    assert_close(out, t * g, torch.float32)
    out = CE.apply_grad_scale(t.to(torch.bfloat16), torch.tensor(g), torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, t.to(torch.bfloat16).float() * g, torch.float32)


def test_linear_cross_entropy_all_ignored_matches_torch():
    x, w, t = _inputs((5,), 8, 30, torch.float32, n_ignored=5)
    loss, gx, _ = _run(K.linear_cross_entropy, x, w, t)
    assert math.isnan(loss.item()) == math.isnan(CE.linear_cross_entropy_reference(x, w, t).item())
    assert torch.count_nonzero(gx) == 0


def test_chunk_size_default():
    assert CE._chunk_tokens(8192, 32000, None) == 2048  # 4 balanced chunks of a 128 MiB bf16 logits budget
    assert CE._chunk_tokens(100, 32000, None) == 100
    assert CE._chunk_tokens(100, 50, 7) == 7
