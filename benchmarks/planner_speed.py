"""How fast `autopar plan` finds a plan: wall time of the whole command and of the search alone.

    python benchmarks/planner_speed.py [--repeat 3] [--json out.json] [--exhaustive]

Cases (issue goals): GPT-3 175B on 1024 A100s (goal <= 2 s) and the 1T GPT on 3072 A100s (goal <= 5 s), two
smaller ones, and two Llama 3 405B cases new users found slow (fixed keys on 16,384 GPUs; 128 GPUs with a batch
of 8, whose long interleaved pipelines make hard stage ILPs). Prints candidates evaluated and median seconds
over --repeat runs. ``--exhaustive`` times `autopar plan --exhaustive`'s search instead (no pruning, every
candidate's schedule replayed) on the EXHAUSTIVE cases.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.search import search  # noqa: E402
from specs.cluster_loading import load_cluster  # noqa: E402
from specs.model_loading import load_model  # noqa: E402
from specs.parallel import parse_plan_keys  # noqa: E402

CASES = [  # (model, cluster, gpus, global batch, --fix, goal in seconds)
    ("gpt3-175b", "dgx-a100", 1024, 1536, "", 2.0),
    ("gpt-1t", "dgx-a100", 3072, 3072, "", 5.0),
    ("llama3-70b", "dgx-h100", 512, 1024, "", None),
    ("llama3-8b", "dgx-h100", 64, 512, "", None),
    ("llama3-405b", "dgx-h100", 16384, 2048, "tp=8,pp=16", None),  # fixed keys: never slower than a free search
    ("llama3-405b", "dgx-h100", 128, 8, "", None),  # long interleaved pipelines: hard stage ILPs
]
EXHAUSTIVE = [  # (model, cluster, gpus, global batch)
    ("llama3-8b", "dgx-a100", 64, 512),
    ("gpt3-175b", "dgx-a100", 1024, 1536),
    ("llama3-70b", "dgx-a100", 512, 1024),
]


def exhaustive(repeat: int) -> list[dict]:
    """The search of `autopar plan --exhaustive` on each EXHAUSTIVE case: candidates and median seconds."""
    rows = []
    print(f"{'model':12} {'gpus':>5} {'candidates':>10} {'search s':>9}  best plan")
    for model, cluster, gpus, batch in EXHAUSTIVE:
        m, c = load_model(model), load_cluster(cluster, gpus=gpus)
        times, res = [], None
        for _ in range(repeat):
            t = time.perf_counter()
            res = search(m, c, batch, exhaustive=True)
            times.append(time.perf_counter() - t)
        row = {"model": model, "cluster": cluster, "gpus": gpus, "global_batch": batch, "candidates": res.candidates,
               "search_s": statistics.median(times), "best": res.plans[0].config.short() if res.plans else None}
        rows.append(row)
        print(f"{model:12} {gpus:5d} {row['candidates']:10,d} {row['search_s']:9.2f}  {row['best']}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--exhaustive", action="store_true", help="time the exhaustive search instead")
    args = ap.parse_args()
    rows = exhaustive(args.repeat) if args.exhaustive else default(args.repeat)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def default(repeat: int) -> list[dict]:
    """`autopar plan` on each CASES row: candidates, median seconds of the search and of the whole command."""
    rows = []
    print(f"{'model':12} {'gpus':>5} {'fixed':>10} {'candidates':>10} {'search s':>9} {'command s':>10} "
          f"{'goal s':>7}  best plan")
    for model, cluster, gpus, batch, fix, goal in CASES:
        m, c = load_model(model), load_cluster(cluster, gpus=gpus)
        search_s, cmd_s = [], []
        res = None
        for _ in range(repeat):
            t = time.perf_counter()
            res = search(m, c, batch, fixed=parse_plan_keys(fix, "--fix"))  # (the command's default headroom)
            search_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "planner.cli", "plan", "--model", model, "--cluster", cluster,
                            "--gpus", str(gpus), "--global-batch", str(batch), "--fix", fix, "--format", "json"],
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            cmd_s.append(time.perf_counter() - t)
        row = {"model": model, "gpus": gpus, "global_batch": batch, "fix": fix, "candidates": res.candidates,
               "search_s": statistics.median(search_s), "command_s": statistics.median(cmd_s), "goal_s": goal,
               "best": res.plans[0].config.short() if res.plans else None}
        rows.append(row)
        print(f"{model:12} {gpus:5d} {fix or '-':>10} {row['candidates']:10,d} {row['search_s']:9.2f} "
              f"{row['command_s']:10.2f} "
              f"{goal if goal else '-':>7}  {row['best']}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
