"""One stack on two GPUs: MosaicML's llm-foundry tables for A100 80GB and H100 80GB, published in one commit.

    python benchmarks/mosaicml_two_gpus.py [--json out.json]

Both tables (benchmarks/data/README.md) ran the same code (llm-foundry b2a43a147, 2023-10-19: MPT models,
PyTorch FSDP, its Triton attention) on 8 GPUs. Each run is priced as validate_h100.py prices the H100 ones, on the
bundled profile of its GPU (dgx-a100, dgx-h100), nothing fitted. Then, for each run from 8k tokens, where
attention is most of the work, the attention rate that would make the cost model match it with everything else
as bundled: if the misses are that stack's attention kernel, this implied rate is one number per GPU, the same for
every model size and sequence; if they were something else, it would wander. Last, what `autopar calibrate` makes
of each table: fitted on its 8-GPU runs at 2048 tokens (validate_h100.calibration_rows, one per model size), every
other run held out.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from validate_h100 import mosaic, mosaic_runs  # noqa: E402

from planner.calibrate import BOUND, predict  # noqa: E402
from planner.measured_runs import Run  # noqa: E402
from planner.uncertainty import in_band  # noqa: E402
from specs.cluster import ClusterSpec  # noqa: E402
from specs.cluster_loading import load_cluster  # noqa: E402

GPUS = {"A100 80GB": ("mosaicml_llm_foundry_a100_bf16.csv", "dgx-a100"),
        "H100 80GB": ("mosaicml_llm_foundry_h100_bf16.csv", "dgx-h100")}
LONG = 8192  # runs from this many tokens get an implied attention rate


def implied_attention(run: Run, base: ClusterSpec, iters: int = 40) -> float | None:
    """The attention scale on ``base`` at which the cost model predicts ``run``'s measured step (bisection in log
    space within the calibration's bounds), or None when no scale there matches it."""
    def pred(log_a: float) -> float:
        return float(predict([run], base, {"attention": math.exp(log_a)})[0])

    lo, hi = -BOUND, BOUND  # pred falls as the scale grows
    if not pred(hi) <= run.measured_s <= pred(lo):
        return None
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pred(mid) > run.measured_s else (lo, mid)
    return math.exp((lo + hi) / 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args()
    out: dict[str, list[dict]] = {}
    for gpu, (table, cluster) in GPUS.items():
        base = load_cluster(cluster)
        eff, peak = base.gpu.efficiency, base.gpu.peak_tflops[base.precision]
        print(f"== {gpu} ({table}, bundled {cluster}: attention {eff.attention_fwd:.2f} / {eff.attention_bwd:.2f} of "
              f"{peak:g} TFLOP/s forward / backward)")
        print(f"  {'model':9} {'seq':>6} {'GPUs':>4} {'mbs':>4} recompute {'error':>7}  implied attention (fraction "
              "of peak, fwd / bwd)")
        rows = []
        for r, run in mosaic_runs(table, cluster):
            err = float(predict([run], base, {})[0]) / run.measured_s - 1
            a = implied_attention(run, base) if int(r["seq"]) >= LONG and r["gpus"] == "8" else None
            row = {"model": r["model"], "seq": int(r["seq"]), "gpus": int(r["gpus"]), "mbs": int(r["micro_batch"]),
                   "recompute": r["activation_checkpointing"] == "true", "error": err,
                   "implied_attention_fwd": a and a * eff.attention_fwd,
                   "implied_attention_bwd": a and a * eff.attention_bwd}
            rows.append(row)
            implied = (f"  {row['implied_attention_fwd']:.2f} / {row['implied_attention_bwd']:.2f}" if a else "")
            print(f"  {row['model']:9} {row['seq']:6} {row['gpus']:4} {row['mbs']:4} {str(row['recompute']):9} "
                  f"{err:+7.1%}{implied}")
        errs = [abs(r["error"]) for r in rows]
        short_big = [r["error"] for r in rows if r["seq"] <= 4096 and r["model"] in ("mpt-7b", "mpt-13b", "mpt-30b",
                                                                                      "mpt-70b")]
        mean = statistics.mean(r["error"] for r in rows)
        print(f"  all {len(rows)} runs: median |error| {statistics.median(errs):.1%}, within 10%: "
              f"{sum(e <= 0.10 for e in errs)}/{len(errs)}, mean signed {mean:+.1%}")
        print(f"  7B-70B up to 4k tokens: {len(short_big)} runs, {min(short_big):+.1%} .. {max(short_big):+.1%}, "
              f"within 10%: {sum(abs(e) <= 0.10 for e in short_big)}")
        inside = sum(in_band(False, 1.0, 1.0 + r["error"]) for r in rows)  # measured 1, predicted 1 + error
        print(f"  inside the bands of plans without pipelining (planner/uncertainty.py): {inside}/{len(rows)}")
        held = [r for r in mosaic(base, table, cluster)[0] if not r["calibration_run"]]
        print(f"  calibrated on its 8-GPU runs at 2048 tokens, held out: within 10% "
              f"{sum(abs(r['calibrated_error']) <= 0.10 for r in held)}/{len(held)}, inside the bands widened by the "
              f"fit's spread {sum(r['calibrated_in_band'] for r in held)}/{len(held)}")
        for lo_seq in (LONG, 32768):
            fw = [r["implied_attention_fwd"] for r in rows if r["seq"] >= lo_seq and r["implied_attention_fwd"]]
            if fw:
                med = statistics.median(fw)
                print(f"  implied attention forward from {lo_seq} tokens ({len(fw)} runs): median {med:.2f} of peak = "
                      f"{med * peak:.0f} TFLOP/s (range {min(fw):.2f} .. {max(fw):.2f})")
        out[gpu] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
