"""BigScience's earlier BLOOM sweeps (February 2022, the same chronicle, cluster and stack as the topology sweep in
validate_published.py) against the cost model: 60 timed runs of alternative plans and model shapes.

    python benchmarks/bloom_prequel.py [--json out.json]

Rows: benchmarks/data/bigscience_tr11_prequel.csv (source and selection in benchmarks/data/README.md). Each run is
priced with its own hidden size, layers and heads on ``jean-zay-a100.yaml`` with the sweep's settings
(validate_published.price_bloom_plan); layers split as the chronicle says DeepSpeed split them (78 layers over 12
stages: 7 on each but the last, which holds 1). Nothing is fitted: these rows are not among the residuals the bands
come from (planner/residuals.json), so the band coverage printed is held out. Per chronicle table (one global
batch, plans and shapes it compared for the same job): rank correlation of time per sample and the regret of the
model's pick (how much slower per sample it measured than the table's measured best). A run a table repeats from
an earlier one (the CSV's ``same_run_as``) counts in both tables' rankings but once in the pooled figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from validate_published import DATA, _rows, price_bloom_plan, spearman  # noqa: E402

from planner.uncertainty import in_band  # noqa: E402
from specs.cluster_loading import load_cluster  # noqa: E402
from specs.model import ModelSpec  # noqa: E402


def deepspeed_split(layers: int, pp: int) -> tuple[int, ...]:
    """Transformer layers per stage as the chronicle reports DeepSpeed's 'type:transformer' partition of its runs:
    ceil(layers / pp) on every stage, the rest on the last (78 over 12: eleven of 7 and one of 1)."""
    each = math.ceil(layers / pp)
    return (each,) * (pp - 1) + (layers - each * (pp - 1),)


def prequel() -> list[dict]:
    """Every timed run, priced: the row's keys plus measured and predicted time per sample and whether the measured
    step lies in the plan's band around the prediction."""
    cluster = load_cluster(str(DATA / "jean-zay-a100.yaml"))
    out = []
    for row in _rows("bigscience_tr11_prequel.csv"):
        h, layers, heads, pp = (int(row[k]) for k in ("hidden", "layers", "heads", "pp"))
        model = ModelSpec(name=f"bloom-h{h}-l{layers}-a{heads}", arch="gpt", num_layers=layers, hidden_size=h,
                          num_attention_heads=heads, vocab_size=250880, seq_length=2048, tie_embeddings=True)
        r = price_bloom_plan(model, cluster, row, deepspeed_split(layers, pp))
        r.update(table=row["table"], date=row["date"], shape=f"h={h} L={layers} heads={heads}",
                 head_dim=h // heads, pp=pp, mbs=int(row["micro_batch"]), repeat=bool(row["same_run_as"]))
        if "predicted_s_per_sample" in r:
            r["ratio"] = r["measured_s_per_sample"] / r["predicted_s_per_sample"]
            r["in_band"] = in_band(pp > 1, r["measured_s_per_sample"], r["predicted_s_per_sample"])
        out.append(r)
    return out


def by_table(rows: list[dict]) -> list[dict]:
    """Per (table, global batch) with at least three runs: rank correlation, the model's pick and its regret."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in rows:
        if "ratio" in r:
            groups[(r["table"], r["global_batch"])].append(r)
    out = []
    for (table, batch), rs in groups.items():
        if len(rs) < 3:
            continue
        meas = [r["measured_s_per_sample"] for r in rs]
        pred = [r["predicted_s_per_sample"] for r in rs]
        pick = rs[min(range(len(rs)), key=lambda i: pred[i])]
        best = rs[min(range(len(rs)), key=lambda i: meas[i])]
        out.append({"table": table, "global_batch": batch, "runs": len(rs), "spearman": spearman(meas, pred),
                    "model_pick": f"{pick['plan']} {pick['shape']}", "measured_best": f"{best['plan']} {best['shape']}",
                    "regret": pick["measured_s_per_sample"] / best["measured_s_per_sample"] - 1})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write rows and summaries here")
    args = ap.parse_args()
    rows = prequel()
    print(f"{'table':18} {'shape':24} {'plan':24} {'B':>5} {'meas s':>7} {'pred s':>7} {'meas/pred':>9}  band")
    for r in rows:
        B = r["global_batch"]
        pred = (f"{r['predicted_s_per_sample'] * B:7.2f} {r['ratio']:9.3f}  {'in' if r['in_band'] else 'OUT'}"
                if "ratio" in r else f"{'no fit':>7}")
        print(f"{r['table']:18} {r['shape']:24} {r['plan']:24} {B:5d} {r['measured_s_per_sample'] * B:7.2f} {pred}"
              f"{'  (repeat)' if r['repeat'] else ''}")
    tables = by_table(rows)
    print()
    for t in tables:
        print(f"{t['table']} (batch {t['global_batch']}, {t['runs']} runs): rank correlation {t['spearman']:.2f}; "
              f"model's pick {t['model_pick']} measures {t['regret']:+.1%} vs the best ({t['measured_best']})")
    timed = [r for r in rows if "ratio" in r and not r["repeat"]]
    inside = sum(r["in_band"] for r in timed)
    ratios = sorted(r["ratio"] for r in timed)
    repeats, unfit = sum(r["repeat"] for r in rows), sum("ratio" not in r for r in rows)
    print(f"\n{len(timed)} distinct runs ({len(rows)} rows, {repeats} repeated in a later table; {unfit} predicted not "
          f"to fit): measured / predicted {ratios[0]:.3f} .. {ratios[-1]:.3f} (median {ratios[len(ratios) // 2]:.3f}); "
          f"inside the bands (held out): {inside}/{len(timed)} ({inside / len(timed):.0%})")
    for label, keep in (("head dim 108 (13824 / 128 heads)", lambda r: r["head_dim"] == 108),
                        ("tp=8 at micro-batch 1-2", lambda r: r["tp"] == 8 and r["mbs"] <= 2),
                        ("tp=8 at micro-batch 4", lambda r: r["tp"] == 8 and r["mbs"] == 4 and r["head_dim"] != 108)):
        sel = [r["ratio"] for r in timed if keep(r)]
        print(f"  {label}: {len(sel)} runs, measured / predicted {min(sel):.3f} .. {max(sel):.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "tables": tables}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
