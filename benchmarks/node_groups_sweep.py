"""How often the default search on clusters of node groups misses a plan that holding one key finds.

For every bundled cluster of node groups x model x global batch, the default search's best plan, then the search with
one key held at each other value (tp 1/2/4/8; pp 1/2/4/8 and the depths that give every group whole ranks; mbs 1/2/4;
vpp 1/2/4; cp 1/2). Holding a key only removes options, so a held search that is faster is a plan the default search
missed. Prints each miss over 1% and a summary (misses, the worst, search times). The whole grid takes about 45
minutes on one core; `--models` and `--batches` cut it.

    python benchmarks/node_groups_sweep.py [--models llama-1b,llama3-8b] [--batches 1,8,64] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.search import search  # noqa: E402
from specs.cluster_loading import load_cluster  # noqa: E402
from specs.errors import AutoparError  # noqa: E402
from specs.model_loading import load_model  # noqa: E402

CLUSTERS = ["ib-roce-a100", "a100-h100-ib", "ib-roce-eth-a100", "a100-l40s-mixed"]
MODELS = ["llama-1b", "gpt-1.7b", "llama3-8b", "llama-13b", "qwen3-30b-a3b", "mixtral-8x7b", "llama3-70b", "gpt3-175b"]
BATCHES = [1, 8, 64, 512, 1024]
MISS = 0.01


def _best(model, cluster, batch: int, fixed: dict | None = None) -> tuple[float | None, str | None, float]:
    t = time.perf_counter()
    try:
        res = search(model, cluster, batch, fixed=fixed, top=1)
    except AutoparError:  # a held value no plan takes
        return None, None, time.perf_counter() - t
    best = res.plans[0] if res.plans else None
    return (best.estimate.step_time_s if best else None, best.config.short() if best else None,
            time.perf_counter() - t)


def _held_values(model, cluster) -> dict[str, list[int]]:
    stage = math.gcd(*cluster.groups.values())
    depths = {cluster.num_gpus // d for d in range(1, stage + 1) if stage % d == 0 and 1 < cluster.num_gpus // d <= 32}
    return {"tp": [1, 2, 4, 8], "pp": sorted(p for p in {1, 2, 4, 8} | depths if p <= model.num_layers),
            "mbs": [1, 2, 4], "vpp": [1, 2, 4], "cp": [1, 2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--json", help="also write every search's result here, one JSON object a line")
    args = ap.parse_args()
    out = open(args.json, "w") if args.json else None  # noqa: SIM115 - closed at the end
    cases, misses, ratios, times, no_plan = 0, [], [], [], []
    for batch in map(int, args.batches.split(",")):
        for cname in CLUSTERS:
            cluster = load_cluster(cname)
            for mname in args.models.split(","):
                model = load_model(mname)
                step, plan, dt = _best(model, cluster, batch)
                times.append(dt)
                found = [(step, plan, "default")] if step else []
                for key, values in _held_values(model, cluster).items():
                    for v in values:
                        s, p, _ = _best(model, cluster, batch, {key: v})
                        if s:
                            found.append((s, p, f"{key}={v}"))
                if out:
                    print(json.dumps({"cluster": cname, "model": mname, "batch": batch, "default_step_s": step,
                                      "default_plan": plan, "search_s": dt,
                                      "held": [{"step_s": s, "plan": p, "held": h} for s, p, h in found[1:]]}),
                          file=out, flush=True)
                if not found:
                    continue
                cases += 1
                best = min(found)
                if step is None:
                    no_plan.append((cname, mname, batch, best))
                    continue
                ratios.append(step / best[0])
                if step > (1 + MISS) * best[0]:
                    misses.append((cname, mname, batch, step, plan, best))
                    print(f"miss: {cname} {mname} batch {batch}: default {step:.4g} s ({plan}); {best[2]} finds "
                          f"{best[0]:.4g} s ({best[1]}), {step / best[0] - 1:+.1%}", flush=True)
    for cname, mname, batch, best in no_plan:
        print(f"no plan: {cname} {mname} batch {batch}, though {best[2]} finds {best[0]:.4g} s")
    print(f"{cases} cases with a plan: the default within {MISS:.0%} of every held search in {cases - len(misses)} "
          f"(worst {max(ratios, default=1) - 1:+.1%}), no plan in {len(no_plan)}; default search "
          f"median {statistics.median(times):.2f} s, max {max(times):.2f} s")


if __name__ == "__main__":
    main()
