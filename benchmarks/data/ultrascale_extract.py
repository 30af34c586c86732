"""Write nanotron_ultrascale_h100.csv from the Ultra-Scale Playbook's benchmark figure (benchmarks/data/README.md).

    python benchmarks/data/ultrascale_extract.py benchmarks_interactive.html \\
        > benchmarks/data/nanotron_ultrascale_h100.csv

The figure (``assets/data/benchmarks/benchmarks_interactive.html`` of the playbook) is a Plotly page whose points
carry each run's configuration and measurements in their hover texts; this reads those texts, one row per distinct
published point (the page draws each point twice), the four subplots being the 1B, 3B, 8B and 80B models.
"""

from __future__ import annotations

import csv
import html
import json
import sys

SUBPLOT_MODEL = {"x": "1B", "x2": "3B", "x3": "8B", "x4": "80B"}
KEYS = {"Nodes": "nodes", "DP": "dp", "TP": "tp", "PP": "pp", "MBS": "mbs", "GradAcc": "grad_accum", "ZeRO": "zero",
        "GBS": "global_batch"}
COLUMNS = ["model", "nodes", "dp", "tp", "pp", "mbs", "grad_accum", "zero", "global_batch", "tokens_per_s_per_gpu",
           "mfu_percent", "gpu_memory_GB", "status"]


def _fields(text: str) -> dict[str, str]:
    out = {}
    for line in html.unescape(text).replace("<b>", "").replace("</b>", "").split("<br>"):
        key, sep, value = line.partition(":")
        if sep and value.strip():
            out[key.strip()] = value.strip()
    return out


def points(page: str) -> list[dict[str, str]]:
    """Every distinct point of the figure as a CSV row."""
    start = page.index("[", page.index("Plotly.newPlot("))
    traces, _ = json.JSONDecoder().raw_decode(page[start:])
    rows: dict[tuple, dict[str, str]] = {}
    for trace in traces:
        texts = trace.get("text")
        if not texts or trace.get("xaxis") not in SUBPLOT_MODEL:
            continue
        for text in [texts] if isinstance(texts, str) else texts:
            f = _fields(text)
            row = {"model": SUBPLOT_MODEL[trace["xaxis"]], **{c: f[k] for k, c in KEYS.items()}}
            crashed = f["MFU"] == "nan%"
            row["tokens_per_s_per_gpu"] = "" if crashed else f["tok/s/gpu"].replace(",", "")
            row["mfu_percent"] = "" if crashed else f["MFU"].rstrip("%")
            row["gpu_memory_GB"] = "" if crashed else f["GPU memory"].removesuffix(" GB")
            row["status"] = "crashed_or_oom" if crashed else "ran"
            rows.setdefault(tuple(row.values()), row)
    return list(rows.values())


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        rows = points(f.read())
    w = csv.DictWriter(sys.stdout, COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
