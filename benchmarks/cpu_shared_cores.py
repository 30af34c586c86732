"""CPU ranks sharing cores: predicted against measured step time of the tiny model on this machine's own profile.

`autopar profile --quick` measures this machine (its cores recorded); then for dp = 1, 2, 4 and 8 ranks (global batch
16) `autopar estimate` prices the plan with and without the recorded cores and `autopar run` trains it for a few
steps. The median step after two warm-up steps is the measurement. Usage:

    OMP_NUM_THREADS=1 python benchmarks/cpu_shared_cores.py [--steps 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

CLI = [sys.executable, "-m", "planner.cli"]
WARMUP = 2


def _cli(*args: str) -> str:
    out = subprocess.run([*CLI, *args], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise SystemExit(f"autopar {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def _predicted(profile: Path, ranks: int) -> float:
    keys = f"dp={ranks},mbs={16 // ranks}"
    out = _cli("estimate", "--model", "tiny", "--cluster", str(profile), "--gpus", str(ranks), "--global-batch", "16",
               "--plan", keys, "--format", "json")
    return float(json.loads(out)["step_time_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        profile = d / "this-cpu.yaml"
        _cli("profile", "--quick", "--out", str(profile))
        data = yaml.safe_load(profile.read_text())
        cores = data["gpu"]["cores"]
        plain = d / "no-cores.yaml"
        plain.write_text(yaml.safe_dump({**data, "gpu": {k: v for k, v in data["gpu"].items() if k != "cores"}}))
        rows = []
        for ranks in (1, 2, 4, 8):
            plan, metrics = d / f"p{ranks}.json", d / f"m{ranks}.jsonl"
            _cli("plan", "--model", "tiny", "--cluster", str(profile), "--gpus", str(ranks), "--global-batch", "16",
                 "--fix", f"dp={ranks},mbs={16 // ranks}", "--out", str(plan))
            _cli("run", str(plan), "--steps", str(args.steps), "--quiet", "--metrics-out", str(metrics))
            lines = [json.loads(line) for line in metrics.read_text().splitlines()]
            steps = [r["step_time_s"] for r in lines if "step" in r][WARMUP:]
            rows.append({"ranks": ranks, "measured_s": statistics.median(steps),
                         "predicted_s": _predicted(profile, ranks),
                         "predicted_without_cores_s": _predicted(plain, ranks)})
    if args.json:
        print(json.dumps({"cores": cores, "rows": rows}, indent=1))
        return
    print(f"this machine's profile: {cores} rank(s) at once, a core each; tiny, global batch 16, "
          f"{args.steps} steps (median after {WARMUP})")
    print("ranks  measured  predicted   error  without cores   error")
    for r in rows:
        m, p, q = r["measured_s"], r["predicted_s"], r["predicted_without_cores_s"]
        print(f"{r['ranks']:5d}  {m:8.3f}  {p:9.3f}  {p / m - 1:+6.0%}  {q:13.3f}  {q / m - 1:+6.0%}")


if __name__ == "__main__":
    main()
