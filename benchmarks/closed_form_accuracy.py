"""How far the vectorised model the search ranks with is from the exact model, over random candidates.

    python benchmarks/closed_form_accuracy.py [--per-case 300] [--seed 2026]

Both price every candidate with the same terms; the vectorised one prices the pipeline in closed form (or
replays it for many candidates at once) instead of replaying the schedule table one candidate at a time.
Prints, per model/cluster case and over all, the relative step-time difference (median, 95th percentile,
max) and the largest memory difference, and the range of the closed form alone (the search's first ranking,
which replays nothing). tests/cost_models/test_closed_form.py holds the bounds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_models.batch import estimate_batch  # noqa: E402
from cost_models.step import estimate  # noqa: E402
from planner.space import enumerate_space  # noqa: E402
from specs.cluster_loading import load_cluster  # noqa: E402
from specs.model_loading import load_model  # noqa: E402

CASES = [  # (model, seq, cluster, gpus, global batch): GPT and Llama, A100 and H100, long sequences with cp
    ("gpt-18b", None, "selene", 256, 1024),
    ("gpt-7.5b", None, "dgx-a100", 128, 512),
    ("llama3-8b", None, "dgx-h100", 8, 64),
    ("llama3-70b", None, "dgx-h100", 64, 512),
    ("llama-1b", 32768, "dgx-h100", 16, 64),
    ("llama3-8b", 131072, "dgx-h100", 64, 64),
    ("llama2-13b", None, "a100-4x200g", 64, 512),
]


# overlapped and not overlapped communication both (the search leaves out the plans that could overlap the
# data-parallel reduce but do not, as never faster)
BOTH_OVERLAPS = {"dp_overlap": [False, True], "tp_overlap": [False, True]}


def sample(per_case: int = 300, seed: int = 2026) -> list[dict]:
    """One row per random candidate of every case: its plan and both models' step time and memory."""
    rng = np.random.default_rng(seed)
    rows = []
    for name, seq, cluster_name, gpus, batch in CASES:
        model, cluster = load_model(name, seq), load_cluster(cluster_name, gpus=gpus)
        space = enumerate_space(model, cluster, batch, BOTH_OVERLAPS)
        pick = space.take(rng.choice(len(space), size=min(per_case, len(space)), replace=False))
        fast = estimate_batch(model, cluster, pick, batch)
        closed = estimate_batch(model, cluster, pick, batch, pipeline="closed").step_time
        for i in range(len(pick)):
            cfg = pick.config(i)
            exact = estimate(model, cluster, cfg, batch, validate=False)
            rows.append({"case": f"{name} {cluster_name} x{gpus}" + (f" seq {seq}" if seq else ""), "config": cfg,
                         "arch": model.arch, "gpu": cluster.gpu.name,
                         "time_error": fast.step_time[i] / exact.step_time_s - 1,
                         "closed_error": closed[i] / exact.step_time_s - 1,
                         "memory_error": fast.memory_GiB[i] / exact.memory_GiB - 1})
    return rows


def _line(label: str, rows: list[dict]) -> str:
    t = np.abs([r["time_error"] for r in rows])
    m = np.abs([r["memory_error"] for r in rows])
    return (f"{label:34s} n={len(rows):5d}  step time p50 {np.median(t):6.2%}  p95 {np.quantile(t, 0.95):6.2%}  "
            f"max {t.max():6.2%}   memory max {m.max():7.3%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-case", type=int, default=300)
    ap.add_argument("--seed", type=int, default=2026)
    a = ap.parse_args()
    t0 = time.perf_counter()
    rows = sample(a.per_case, a.seed)
    for case in dict.fromkeys(r["case"] for r in rows):
        print(_line(case, [r for r in rows if r["case"] == case]))
    print(_line("all", rows))
    closed = [r["closed_error"] for r in rows]
    print(f"the closed form alone (no replays): {min(closed):+.2%} to {max(closed):+.2%} (what the search's "
          "first ranking assumes)")
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
