"""SwiGLU and RoPE kernels vs their torch references (Triton interpreter)."""

import pytest
import torch
import torch.nn.functional as F
from kernel_testutils import assert_close, grads, leaf, needs_triton

import runtime.kernels as K
from runtime.kernels import rope_op, swiglu_op

pytestmark = needs_triton

DTYPES = [torch.float32, torch.bfloat16]


# --------------------------------------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (3, 37), (2, 5, 77), (64, 96)])
def test_swiglu(shape, dtype):
    g = torch.Generator().manual_seed(0)
    gate = (3 * torch.randn(shape, generator=g)).to(dtype)
    up, dy = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    a, b = leaf(gate), leaf(up)
    y = K.swiglu(a, b)
    ga, gb = grads(y, (a, b), dy)
    a2, b2 = leaf(gate), leaf(up)
    y_ref = swiglu_op.swiglu_reference(a2, b2)
    ga_ref, gb_ref = grads(y_ref, (a2, b2), dy)
    assert y.dtype == dtype and ga.dtype == dtype
    assert_close(y, y_ref, dtype, what="y")
    assert_close(ga, ga_ref, dtype, what="dgate")
    assert_close(gb, gb_ref, dtype, what="dup")
    if dtype == torch.float32:
        a3, b3 = leaf(gate.double()), leaf(up.double())
        ga64, gb64 = grads(F.silu(a3) * b3, (a3, b3), dy.double())
        assert_close(ga, ga64, dtype, factor=2, what="dgate vs f64")
        assert_close(gb, gb64, dtype, factor=2, what="dup vs f64")


@pytest.mark.parametrize("width", [45, 2100])  # 2100: several column blocks per row
def test_swiglu_halves_of_fused_projection(width):
    """gate/up as the two (row-strided, non-contiguous) halves of one fused gate_up tensor."""
    fused = torch.randn(3, 5, 2 * width)
    gate, up = fused.chunk(2, dim=-1)
    assert not gate.is_contiguous()
    f1 = leaf(fused)
    y = K.swiglu(*f1.chunk(2, dim=-1))
    dy = torch.randn_like(y)
    (gf,) = grads(y, (f1,), dy)
    f2 = leaf(fused)
    (gf_ref,) = grads(swiglu_op.swiglu_reference(*f2.chunk(2, dim=-1)), (f2,), dy)
    assert_close(y, swiglu_op.swiglu_reference(gate, up), torch.float32)
    assert_close(gf, gf_ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 37), (2, 5, 2 * 77), (4, 2 * 2100)])
def test_swiglu_packed(shape, dtype):
    """swiglu_packed(gate_up) == swiglu(*gate_up.chunk(2, -1)); its gradient comes back as one tensor."""
    g = torch.Generator().manual_seed(2)
    gu = (2 * torch.randn(shape, generator=g)).to(dtype)
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype)
    a = leaf(gu)
    y = K.swiglu_packed(a)
    (ga,) = grads(y, (a,), dy)
    b = leaf(gu)
    y_ref = swiglu_op.swiglu_packed_reference(b)
    (gb,) = grads(y_ref, (b,), dy)
    assert y.shape == y_ref.shape and ga.dtype == dtype
    assert_close(y, y_ref, dtype, what="y")
    assert_close(ga, gb, dtype, what="dgate_up")
    # a strided (non-contiguous rows) input works too
    wide = leaf(torch.randn(shape[0], shape[-1] + 6).to(dtype))
    assert_close(K.swiglu_packed(wide[:, 3:-3]), swiglu_op.swiglu_packed_reference(wide[:, 3:-3]), dtype)


# ----------------------------------------------------------------------------------------------- RoPE
def _cos_sin(seq, head_dim, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def _rope_f64(x, cos, sin):
    return rope_op._rotate(x, cos.double(), sin.double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,h,hk,d", [(2, 5, 4, 2, 16), (1, 7, 3, 1, 10), (2, 3, 5, 5, 64),
                                        (1, 3, 16, 16, 128)])
def test_rope(b, s, h, hk, d, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    k = torch.randn(b, s, hk, d, generator=g).to(dtype)
    dq, dk = torch.randn(q.shape, generator=g).to(dtype), torch.randn(k.shape, generator=g).to(dtype)
    cos, sin = _cos_sin(s, d)
    q1, k1 = leaf(q), leaf(k)
    qo, ko = K.rope(q1, k1, cos, sin)
    gq, gk = grads((qo, ko), (q1, k1), (dq, dk))
    q2, k2 = leaf(q), leaf(k)
    qr, kr = rope_op.rope_reference(q2, k2, cos, sin)
    gq_ref, gk_ref = grads((qr, kr), (q2, k2), (dq, dk))
    assert qo.dtype == dtype and ko.shape == k.shape
    for a, r, name in ((qo, qr, "q"), (ko, kr, "k"), (gq, gq_ref, "dq"), (gk, gk_ref, "dk")):
        assert_close(a, r, dtype, factor=2, what=name)
    if dtype == torch.float32:
        q3, k3 = leaf(q.double()), leaf(k.double())
        out64 = (_rope_f64(q3, cos, sin), _rope_f64(k3, cos, sin))
        gq64, gk64 = grads(out64, (q3, k3), (dq.double(), dk.double()))
        assert_close(gq, gq64, dtype, factor=2, what="dq vs f64")
        assert_close(gk, gk64, dtype, factor=2, what="dk vs f64")


def test_rope_views_of_fused_qkv_and_inplace():
    """q/k as strided views of a fused qkv projection; out-of-place and in-place give the reference."""
    b, s, h, hk, d = 2, 6, 4, 2, 12
    qkv = torch.randn(b, s, (h + 2 * hk) * d)
    cos, sin = _cos_sin(s, d)

    def split(t):
        return t[..., : h * d].view(b, s, h, d), t[..., h * d: (h + hk) * d].view(b, s, hk, d)

    q, k = split(qkv)
    assert not q.is_contiguous()
    qr, kr = rope_op.rope_reference(q, k, cos, sin)
    qo, ko = K.rope(q, k, cos, sin)
    assert_close(qo, qr, torch.float32)
    assert_close(ko, kr, torch.float32)

    # in place with autograd: on non-view, non-leaf tensors it writes into them; on views it falls back
    g = torch.Generator().manual_seed(1)
    q0, k0 = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, hk, d, generator=g)
    qr0, kr0 = rope_op.rope_reference(q0, k0, cos, sin)
    dq, dk = torch.randn_like(q0), torch.randn_like(k0)
    for make_view in (False, True):
        ql, kl = leaf(q0), leaf(k0)
        qa, ka = (ql.view(-1).view(q0.shape), kl.view(-1).view(k0.shape)) if make_view else (ql * 1, kl * 1)
        qo2, ko2 = K.rope(qa, ka, cos, sin, inplace=True)
        assert (qo2.data_ptr() == qa.data_ptr()) == (not make_view)
        assert_close(qo2, qr0, torch.float32)
        assert_close(ko2, kr0, torch.float32)
        gq, gk = grads((qo2, ko2), (ql, kl), (dq, dk))
        ql2, kl2 = leaf(q0), leaf(k0)
        gq_ref, gk_ref = grads(rope_op.rope_reference(ql2, kl2, cos, sin), (ql2, kl2), (dq, dk))
        assert_close(gq, gq_ref, torch.float32)
        assert_close(gk, gk_ref, torch.float32)

    # in place without autograd (inference), on the strided views of qkv
    with torch.no_grad():
        qkv2 = qkv.clone()
        qv, kv = split(qkv2)
        K.rope(qv, kv, cos, sin, inplace=True)
        assert_close(split(qkv2)[0], qr, torch.float32)
        assert_close(split(qkv2)[1], kr, torch.float32)


def test_rope_backward_is_inverse_rotation():
    b, s, h, d = 1, 9, 3, 8
    q, k = torch.randn(b, s, h, d), torch.randn(b, s, 1, d)
    cos, sin = _cos_sin(s, d)
    qo, ko = rope_op.rope_apply(q, k, cos, sin)
    qb, kb = rope_op.rope_apply(qo, ko, cos, sin, backward=True)
    assert_close(qb, q, torch.float32)
    assert_close(kb, k, torch.float32)
