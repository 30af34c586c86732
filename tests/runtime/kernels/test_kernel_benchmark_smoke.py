"""benchmarks/kernels.py runs end to end (``--smoke``: CPU, interpreter, tiny shapes) and writes its JSON."""

import json
import os
import subprocess
import sys

import pytest
from kernel_testutils import needs_triton

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@needs_triton
@pytest.mark.slow
def test_benchmark_script_smoke(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, os.path.join(_ROOT, "benchmarks", "kernels.py"), "--smoke", "--quick",
                        "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["checks"] and all(c["ok"] for c in data["checks"])
    ops = {row["op"] for row in data["results"]}
    assert {"rms_norm", "add_rms_norm", "layer_norm", "swiglu", "rope", "flce", "flce(amp)"} <= ops
    assert not [row for row in data["results"] if "error" in row]
