"""RMSNorm, fused add + RMSNorm and LayerNorm kernels vs their torch references (Triton interpreter)."""

import pytest
import torch
from kernel_testutils import assert_close, grads, leaf, needs_triton

import runtime.kernels as K
from runtime.kernels import layer_norm_op, rms_norm_op

pytestmark = needs_triton

SHAPES = [(1, 37), (3, 5, 77), (64, 96), (9, 8), (5, 2050)]  # the last: one wide row per program
DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    w = 1.0 + 0.5 * torch.randn(shape[-1], generator=g)  # fp32 master weight, as under autocast
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, dy


def _rms_f64(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape, dtype):
    x, w, dy = _inputs(shape, dtype)
    x1, w1 = leaf(x), leaf(w)
    y = K.rms_norm(x1, w1, EPS)
    gx, gw = grads(y, (x1, w1), dy)
    x2, w2 = leaf(x), leaf(w)
    y_ref = rms_norm_op.rms_norm_reference(x2, w2, EPS)
    gx_ref, gw_ref = grads(y_ref, (x2, w2), dy)
    assert y.dtype == dtype and gx.dtype == dtype and gw.dtype == w.dtype
    assert_close(y, y_ref, dtype, what="y")
    assert_close(gx, gx_ref, dtype, what="dx")
    assert_close(gw, gw_ref, dtype, what="dw")
    if dtype == torch.float32:  # and against plain float64 autograd
        x3, w3 = leaf(x.double()), leaf(w.double())
        gx64, gw64 = grads(_rms_f64(x3, w3, EPS), (x3, w3), dy.double())
        assert_close(gx, gx64, dtype, factor=5, what="dx vs f64")
        assert_close(gw, gw64, dtype, factor=5, what="dw vs f64")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 37), (3, 5, 77), (64, 96)])
def test_add_rms_norm(shape, dtype):
    x, w, dy = _inputs(shape, dtype)
    r, _, ds = _inputs(shape, dtype, seed=1)
    x1, r1, w1 = leaf(x), leaf(r), leaf(w)
    y, s = K.add_rms_norm(x1, r1, w1, EPS)
    g = grads((y, s), (x1, r1, w1), (dy, ds))
    x2, r2, w2 = leaf(x), leaf(r), leaf(w)
    y_ref, s_ref = rms_norm_op.add_rms_norm_reference(x2, r2, w2, EPS)
    g_ref = grads((y_ref, s_ref), (x2, r2, w2), (dy, ds))
    # fp32: exact; bf16: the interpreter's fp32->bf16 cast may round differently from torch's by an ulp
    assert_close(s, s_ref, dtype, factor=1e-3 if dtype == torch.float32 else 1.0, what="residual")
    assert_close(y, y_ref, dtype, what="y")
    for a, b, name in zip(g, g_ref, ("dx", "dresidual", "dw")):
        assert_close(a, b, dtype, what=name)


def test_add_rms_norm_only_residual_used():
    x, w, _ = _inputs((6, 40), torch.float32)
    x1, r1, w1 = leaf(x), leaf(x.flip(0)), leaf(w)
    _, s = K.add_rms_norm(x1, r1, w1, EPS)
    s.sum().backward()
    assert torch.equal(x1.grad, torch.ones_like(x)) and torch.equal(r1.grad, torch.ones_like(x))
    assert torch.count_nonzero(w1.grad) == 0


def _ln_f64(x, w, b, eps):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm(shape, dtype, bias):
    x, w, dy = _inputs(shape, dtype)
    x = x + 3.0  # non-zero mean
    b = 0.1 * torch.randn(shape[-1]) if bias else None
    ins = (leaf(x), leaf(w)) + ((leaf(b),) if bias else ())
    y = K.layer_norm(ins[0], ins[1], ins[2] if bias else None, EPS)
    g = grads(y, ins, dy)
    ref_ins = (leaf(x), leaf(w)) + ((leaf(b),) if bias else ())
    y_ref = layer_norm_op.layer_norm_reference(ref_ins[0], ref_ins[1], ref_ins[2] if bias else None, EPS)
    g_ref = grads(y_ref, ref_ins, dy)
    assert y.dtype == dtype
    assert_close(y, y_ref, dtype, what="y")
    for a, r, name in zip(g, g_ref, ("dx", "dw", "db")):
        assert_close(a, r, dtype, factor=2, what=name)
    if dtype == torch.float32:
        ins64 = tuple(leaf(t.double()) for t in (x, w) + ((b,) if bias else ()))
        y64 = _ln_f64(ins64[0], ins64[1], ins64[2] if bias else None, EPS)
        g64 = grads(y64, ins64, dy.double())
        assert_close(y, y64, dtype, factor=5, what="y vs f64")
        for a, r, name in zip(g, g64, ("dx", "dw", "db")):
            assert_close(a, r, dtype, factor=20, what=name + " vs f64")


@pytest.mark.parametrize("op", ["rms", "add_rms", "ln"])
def test_norms_non_contiguous(op):
    """Strided inputs (a column slice of a wider tensor, a transposed view) and many-row programs."""
    base = torch.randn(24, 70)
    w = torch.randn(33)
    for x in (base[:, 5:38], torch.randn(33, 24).t()):
        assert not x.is_contiguous()
        x1, x2 = leaf(x), leaf(x)
        if op == "rms":
            y, y_ref = K.rms_norm(x1, w, EPS), rms_norm_op.rms_norm_reference(x2, w, EPS)
        elif op == "add_rms":
            y, y_ref = K.add_rms_norm(x1, x1 * 0.5, w, EPS)[0], rms_norm_op.add_rms_norm_reference(
                x2, x2 * 0.5, w, EPS)[0]
        else:
            y, y_ref = K.layer_norm(x1, w, None, EPS), layer_norm_op.layer_norm_reference(x2, w, None, EPS)
        dy = torch.randn_like(y).t().contiguous().t()  # a non-contiguous incoming gradient too
        (gx,) = grads(y, (x1,), dy)
        (gx_ref,) = grads(y_ref, (x2,), dy)
        assert_close(y, y_ref, torch.float32)
        assert_close(gx, gx_ref, torch.float32)


def test_rms_norm_many_programs_partial_dw():
    """More row blocks than backward programs: each program loops and accumulates its dweight partial."""
    x, w, dy = _inputs((61, 96), torch.float32)  # 61 rows, 4 CPU 'SMs' -> 8 programs of several rows
    x1, w1 = leaf(x), leaf(w)
    gw = grads(K.rms_norm(x1, w1, EPS), (w1,), dy)[0]
    x2, w2 = leaf(x), leaf(w)
    gw_ref = grads(rms_norm_op.rms_norm_reference(x2, w2, EPS), (w2,), dy)[0]
    assert_close(gw, gw_ref, torch.float32)


def test_add_rms_norm_mixed_dtypes():
    """bf16 branch output + fp32 residual stream (autocast models): fp32 sum and norm, grads in each dtype."""
    x, w, dy = _inputs((6, 5, 40), torch.bfloat16)
    r = torch.randn(6, 5, 40)
    x1, r1, w1 = leaf(x), leaf(r), leaf(w)
    y, s = K.add_rms_norm(x1, r1, w1, EPS)
    assert y.dtype == s.dtype == torch.float32
    g = grads((y, s), (x1, r1, w1), (dy.float(), dy.float()))
    x2, r2, w2 = leaf(x), leaf(r), leaf(w)
    y_ref, s_ref = rms_norm_op.add_rms_norm_reference(x2, r2, w2, EPS)
    g_ref = grads((y_ref, s_ref), (x2, r2, w2), (dy.float(), dy.float()))
    assert_close(y, y_ref, torch.float32)
    assert_close(s, s_ref, torch.float32)
    assert g[0].dtype == torch.bfloat16 and g[1].dtype == torch.float32
    for a, b in zip(g, g_ref):
        assert_close(a, b, torch.bfloat16 if a.dtype == torch.bfloat16 else torch.float32)
