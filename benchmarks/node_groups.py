"""Plans placed on clusters of node groups against the same clusters planned as homogeneous at their slowest link.

For each bundled grouped profile (hardware_profiles/clusters: ib-roce-a100, a100-h100-ib, ib-roce-eth-a100,
a100-l40s-mixed) and model, the search's best placed plan (on the whole GPU: headroom 0, as these rows were first
written) beside the best plan that treats the cluster as homogeneous at its slowest GPU and link, both priced by the
cost model; then the planning time of a 3-group, 1,024-GPU cluster (the ib-roce-eth-a100 groups at 64 / 32 / 32
nodes), median of runs in this process.

    python benchmarks/node_groups.py [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.placement import explain_placement  # noqa: E402
from planner.search import search  # noqa: E402
from specs.cluster_loading import cluster_from_dict, load_cluster  # noqa: E402
from specs.files import read_mapping  # noqa: E402
from specs.model_loading import load_model  # noqa: E402

CASES = [("ib-roce-a100", "gpt-1.7b", 512), ("ib-roce-a100", "llama-13b", 512), ("ib-roce-a100", "llama3-70b", 1024),
         ("a100-h100-ib", "llama-13b", 512), ("a100-h100-ib", "llama3-70b", 1024),
         ("ib-roce-eth-a100", "llama-13b", 512), ("ib-roce-eth-a100", "llama3-70b", 1024),
         ("a100-l40s-mixed", "gpt-1.7b", 512), ("a100-l40s-mixed", "llama-13b", 512)]


def big_three_groups():
    """ib-roce-eth-a100's groups at 64, 32 and 32 nodes: 1,024 GPUs."""
    path = Path(__file__).resolve().parents[1] / "hardware_profiles" / "clusters" / "ib-roce-eth-a100.yaml"
    data = read_mapping(path, "cluster profile")
    for g, n in zip(data["node_groups"], (64, 32, 32)):
        g["num_nodes"] = n
    return cluster_from_dict({**data, "name": "three-groups-1024"}, "three-groups-1024")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    print("| cluster | model | global batch | placed plan | step (s) | homogeneous-at-slowest plan | step (s) | "
          "throughput gain |")
    print("|---|---|---|---|---|---|---|---|")
    for name, model_name, batch in CASES:
        cluster, model = load_cluster(name), load_model(model_name)
        res = search(model, cluster, batch, top=1, headroom_GiB=0.0)
        best, homog = res.plans[0], res.homogeneous
        gain = homog.estimate.step_time_s / best.estimate.step_time_s - 1 if homog else float("nan")
        print(f"| {name} | {model_name} | {batch} | {best.config.short()} | {best.estimate.step_time_s:.3f} | "
              f"{homog.config.short() if homog else '-'} | {homog.estimate.step_time_s if homog else float('nan'):.3f} "
              f"| {gain:+.1%} |")
        if best.config.placement is not None:
            print(f"|  |  |  | {explain_placement(best.config, model.num_layers)} |  |  |  |  |")
    cluster = big_three_groups()
    for model_name, batch in (("llama-13b", 1024), ("llama3-70b", 1024)):
        model = load_model(model_name)
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            res = search(model, cluster, batch, top=1, headroom_GiB=0.0)
            times.append(time.perf_counter() - t0)
        print(f"planning {model_name} on {cluster.name} ({cluster.num_gpus} GPUs, 3 groups): median "
              f"{statistics.median(times):.2f} s of {args.runs} (best {res.plans[0].config.short()}, "
              f"{res.plans[0].estimate.step_time_s:.3f} s vs {res.homogeneous.estimate.step_time_s:.3f} s "
              "homogeneous)")


if __name__ == "__main__":
    main()
