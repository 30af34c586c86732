"""What cutting a GEMM into pieces costs, measured against the cost model (GPU only).

    python benchmarks/gemm_pieces.py [--profile h100.yaml] [--reps 20] [--json out.json]

To overlap a tensor-parallel collective with its GEMM, the GEMM runs as several GEMMs over slices of its tokens
(autopar's collective matmul: tp pieces; Transformer Engine's ring exchange: tp or tp/2, its pipelined
reduce-scatter: 4). The cost model prices that as ``pieces`` GEMMs of M / pieces tokens through its GEMM model
(``ComputeModel.linear``, docs/cost_model.md "Tensor-parallel overlap"). This times, for the forward GEMM of each
projection of each tensor-parallel NeMo H100 recipe (benchmarks/data/nvidia_dgxc_h100_bf16.csv, one row per
recipe: tokens of one micro-batch, shapes from ``cost_models.layer.projection_shapes``), the whole GEMM and the
same work in 2, 4 and tp pieces run back to back, and prints each measured slowdown beside the model's on the
given profile (default: the bundled dgx-h100).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from validate_h100 import CLUSTER, nemo_case  # noqa: E402
from wgrad_accumulation import _time, has_cuda, recipe_rows  # noqa: E402

from cost_models.compute import ComputeModel  # noqa: E402
from cost_models.layer import projection_shapes  # noqa: E402
from specs.cluster_loading import load_cluster  # noqa: E402


def measure(m: int, n: int, k: int, pieces: list[int], reps: int) -> dict[int, float]:
    """Median ms of y[m, n] = x[m, k] W^T run whole and as ``p`` GEMMs over token slices, for each p."""
    import torch

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wt = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def run(p: int) -> None:
        step = m // p
        for i in range(p):
            torch.mm(x[i * step:(i + 1) * step], wt, out=y[i * step:(i + 1) * step])

    return {p: _time(lambda p=p: run(p), reps) for p in pieces}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=CLUSTER, help="cluster profile whose GEMM model is compared (default "
                    "the bundled dgx-h100; an `autopar profile` YAML of this GPU compares like with like)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per form (median reported)")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    if not has_cuda("gemm_pieces.py"):
        return 2
    cluster = load_cluster(args.profile)
    cm = ComputeModel(cluster.gpu, cluster.precision)
    print(f"model: {args.profile}")
    rows = []
    for r in recipe_rows():
        model, _, cfg, _ = nemo_case(r)
        if cfg.tp == 1:
            continue
        m = cfg.mbs * model.seq_length // cfg.cp
        pieces = sorted({1, 2, 4, cfg.tp})
        print(f"== {model.name}: tp={cfg.tp}, {m} tokens a micro-batch; measured (model) time of p pieces / whole")
        for name, (n, k) in projection_shapes(model, cfg.tp).items():
            n, k = int(n), int(k)
            ms = measure(m, n, k, pieces, args.reps)
            pred = {p: float(cm.linear(m, n, k, pieces=p)[0]) * 1e3 for p in pieces}
            print(f"  {name:8} {m}x{n}x{k}: whole {ms[1]:.3f} ms (model {pred[1]:.3f}); " + ", ".join(
                f"{p}: x{ms[p] / ms[1]:.3f} (x{pred[p] / pred[1]:.3f})" for p in pieces[1:]))
            rows.append({"model": model.name, "gemm": name, "mnk": [m, n, k], "measured_ms": ms, "model_ms": pred})
    meas = [r["measured_ms"][p] / r["measured_ms"][1] - 1 for r in rows for p in r["measured_ms"] if p > 1]
    pred = [r["model_ms"][p] / r["model_ms"][1] - 1 for r in rows for p in r["model_ms"] if p > 1]
    if meas:
        print(f"slowdown of the pieces over {len(meas)} (GEMM, p) pairs: measured mean {sum(meas) / len(meas):+.1%}, "
              f"model mean {sum(pred) / len(pred):+.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
