"""Backend flag and dispatch: 'auto' uses references on CPU, 'triton' runs the kernels (interpreter)."""

import pytest
import torch
from kernel_testutils import needs_triton

import runtime.kernels as K
from runtime.kernels import _utils, cross_entropy_op, layer_norm_op, rms_norm_op, rope_op, swiglu_op

FUNCTIONS = {  # op -> the autograd Function its kernel path applies
    "rms_norm": (rms_norm_op.RMSNormFunction, lambda x: K.rms_norm(x, torch.ones(8), 1e-6)),
    "add_rms_norm": (rms_norm_op.AddRMSNormFunction, lambda x: K.add_rms_norm(x, x, torch.ones(8), 1e-6)),
    "layer_norm": (layer_norm_op.LayerNormFunction, lambda x: K.layer_norm(x, torch.ones(8), None, 1e-6)),
    "swiglu": (swiglu_op.SwiGLUFunction, lambda x: K.swiglu(x, x)),
    "swiglu_packed": (swiglu_op.SwiGLUPackedFunction, lambda x: K.swiglu_packed(x)),
    "rope": (rope_op.RoPEFunction, lambda x: K.rope(x.view(1, 3, 4, 4), x.view(1, 3, 4, 4),
                                                    torch.ones(3, 2), torch.zeros(3, 2))),
    "linear_cross_entropy": (cross_entropy_op.LinearCrossEntropyFunction, lambda x: K.linear_cross_entropy(
        x, torch.randn(5, 8), torch.zeros(6, dtype=torch.long))),
}


def _count_applies(monkeypatch):
    calls = []
    for fn_cls, _ in FUNCTIONS.values():
        original = fn_cls.apply

        def counting(*args, _orig=original, _name=fn_cls.__name__):
            calls.append(_name)
            return _orig(*args)
        monkeypatch.setattr(fn_cls, "apply", counting)
    return calls


def test_set_backend_validates():
    with pytest.raises(ValueError):
        K.set_backend("cuda")
    K.set_backend("torch")
    assert K.get_backend() == "torch"


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("op", list(FUNCTIONS))
def test_cpu_tensors_use_reference(monkeypatch, backend, op):
    K.set_backend(backend)
    calls = _count_applies(monkeypatch)
    FUNCTIONS[op][1](torch.randn(6, 8))
    assert calls == []


@needs_triton
@pytest.mark.parametrize("op", list(FUNCTIONS))
def test_forced_triton_runs_kernel_in_interpreter(monkeypatch, op):
    K.set_backend("triton")
    calls = _count_applies(monkeypatch)
    FUNCTIONS[op][1](torch.randn(6, 8))
    assert calls == [FUNCTIONS[op][0].__name__]


def test_forced_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    K.set_backend("triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        K.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)


def test_auto_prefers_triton_only_for_cuda(monkeypatch):
    K.set_backend("auto")
    assert not _utils.use_triton(torch.randn(2))
    assert not _utils.use_triton(torch.randn(2, device="meta"))  # fx tracing on meta uses references
    K.set_backend("torch")
    assert not _utils.use_triton(torch.randn(2))


def test_lazy_kernel_builds_on_first_launch():
    lk = _utils.LazyKernel(lambda: None)
    assert lk._built == {}
    assert _utils.next_pow2(37) == 64 and _utils.next_pow2(64) == 64 and _utils.next_pow2(1) == 1
    assert _utils.cdiv(7, 2) == 4


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_native_backend_runs_torchs_fused_norms(monkeypatch, op, dtype, tol):
    """Backend 'native': the plain norms go to torch's own ``F.rms_norm`` / ``F.layer_norm`` (none of our
    Functions), with the reference's values and gradients; the other ops keep 'auto''s choice (references on CPU)."""
    torch.manual_seed(0)
    x0 = torch.randn(6, 8).to(dtype)
    w0 = (1 + 0.1 * torch.randn(8)).to(dtype)
    b0 = (0.1 * torch.randn(8)).to(dtype)

    def run(backend: str):
        K.set_backend(backend)
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        y = K.rms_norm(x, w, 1e-6) if op == "rms_norm" else K.layer_norm(x, w, b, 1e-6)
        y.float().pow(2).sum().backward()
        grads = [x.grad, w.grad] + ([b.grad] if op == "layer_norm" else [])
        return y, grads

    ref, ref_grads = run("torch")
    fused = []
    original = getattr(torch.nn.functional, op)
    monkeypatch.setattr(torch.nn.functional, op, lambda *a, **k: fused.append(op) or original(*a, **k))
    calls = _count_applies(monkeypatch)
    out, grads = run("native")
    assert fused == [op] and calls == []
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r.float(), atol=tol * 10, rtol=tol)
    calls.clear()
    K.swiglu(x0.float(), x0.float())
    assert calls == []
