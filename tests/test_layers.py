"""The layers hold: the runtime's entry points load neither the planner (its search, pulp, the command line)
nor the cost models, and the planning commands never load torch. (`lint-imports` checks every import
statically; this checks what a real process loads.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _loaded(code: str) -> list[str]:
    """Top-level packages a fresh interpreter has loaded after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_runtime_entry_points_do_not_load_the_planner():
    for module in ("runtime.train", "runtime.launch"):
        loaded = _loaded(f"import {module}")
        assert "torch" in loaded  # the probe sees real imports
        assert not {"planner", "pulp", "highspy", "cost_models"} & set(loaded), (module, loaded)


def test_planning_does_not_load_torch():
    code = ("from planner.cli import build_parser\nbuild_parser()\nfrom planner.search import search\n"
            "from specs.cluster_loading import load_cluster\nfrom specs.model_loading import load_model\n"
            "search(load_model('tiny'), load_cluster('cpu-gloo', gpus=4), 16, top=1)")
    loaded = _loaded(code)
    assert "pulp" in loaded and "torch" not in loaded, loaded


def test_the_model_code_holds_no_parallel_code():
    """runtime/models is the single-process model: no collective, process group or parallel module in it (the
    parallel wrappers in runtime/parallel act on it from outside). lint-imports forbids runtime.parallel there; torch's
    distributed package, a part of an external one, is checked here."""
    files = sorted((ROOT / "runtime" / "models").glob("*.py"))
    assert files
    for f in files:
        text = f.read_text()
        assert "torch.distributed" not in text and "import distributed" not in text, f
