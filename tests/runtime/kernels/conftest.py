"""Kernel tests run Triton's CPU interpreter: TRITON_INTERPRET=1 and the 'triton' backend for every test.

Triton reads TRITON_INTERPRET when it is first imported. runtime.kernels imports triton lazily, on the
first kernel launch, which happens inside a test here while the fixture below has the variable set; so
importing runtime.kernels or the models earlier in the session is fine, and the variable is restored
after each test (later tests and their subprocesses do not inherit it). Only an earlier direct
``import triton`` in the same pytest process (e.g. by torch.compile) defeats this: the kernel tests then
skip and say so (run tests/runtime/kernels on its own, or export TRITON_INTERPRET=1).
"""

import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if _ROOT not in sys.path:  # the repo is not necessarily installed
    sys.path.insert(0, _ROOT)


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    """Interpreter on and backend forced to 'triton' for each test; both restored afterwards."""
    import runtime.kernels as K
    from runtime.kernels._utils import triton_interpreted

    if triton_interpreted() is False:
        pytest.skip("triton was imported in compiled mode before TRITON_INTERPRET=1 was set "
                    "(run tests/runtime/kernels on its own or export TRITON_INTERPRET=1)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    previous = K.get_backend()
    K.set_backend("triton")
    yield
    K.set_backend(previous)
