"""`autopar whatif`: the best plan at each point of a sweep, as a table, CSV, JSON or plot."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.markup import escape

from planner.commands.inputs import load_inputs, progress, spec_files
from specs.errors import AutoparError
from specs.json_numbers import rounded


def whatif_command(args: argparse.Namespace) -> int:
    from planner.whatif import checked_sweep, parse_vary, sweep
    from specs.parallel import parse_plan_keys

    key, values = parse_vary(args.vary)
    resized = key in ("gpus", "nodes")
    model, cluster = load_inputs(args, cores_note=not resized)  # (sized per point: said per point below)
    if args.plot:
        from planner.whatif_plot import plot_file

        plot_file(args.plot, spec_files(args))  # a bad path fails now, not after the sweep
    given = "--nodes" if args.nodes else "--gpus" if args.gpus and key == "gpus" else None
    if key in ("gpus", "nodes") and given:  # (--gpus N with --vary nodes: nodes of N GPUs)
        raise AutoparError(f"--vary {key} sets the cluster's size at each point; leave out {given}")
    if key == "nodes" and args.gpus and args.gpus > cluster.gpus_per_node:
        raise AutoparError(f"--gpus {args.gpus} with --vary nodes: --gpus there sets the GPUs of each node, at most "
                           f"{cluster.name}'s {cluster.gpus_per_node}; leave it out for nodes of "
                           f"{cluster.gpus_per_node}")
    shared = [v for v in values if resized and _shares_cores(cluster, key, v)]
    if shared:  # a CPU profile's node holding more ranks than it has cores at these points
        print(f"note: {cluster.name}: at {key}={','.join(map(str, shared))} a node's ranks share its "
              f"{cluster.gpu.cores} cores (each priced slower by ranks / cores)", file=sys.stderr)
    fixed = parse_plan_keys(args.fix, "--fix")
    more = parse_plan_keys(args.compare, "--compare") if args.compare is not None else {}
    if args.compare is not None and not more:
        raise AutoparError('--compare is empty; give the plan keys the second curve fixes, e.g. --compare '
                           '"dp_overlap=false" (or leave --compare out)')
    if "placement" in more and not cluster.node_groups:
        raise AutoparError(f"--compare placement: cluster {cluster.name} has no node groups to place stages on; "
                           "placement compares plans on a cluster of node groups")
    if args.compare is not None:  # the second curve's bad input fails now, not after the first curve's points
        checked_sweep(model, cluster, args.global_batch, key, values, fixed, args.headroom, more)
    report = progress("points")  # (on a terminal: a sweep of large models takes a while)
    n = len(values) * (2 if args.compare is not None else 1)

    def told(first: int) -> Any:  # the points of one curve, counted among both curves'
        return None if report is None else lambda done, _total: report(first + done, n)

    curves: dict[str, Any] = {"best": sweep(model, cluster, args.global_batch, key, values, fixed, args.headroom,
                                            progress=told(0))}
    if args.compare:
        curves[args.compare] = sweep(model, cluster, args.global_batch, key, values, fixed, args.headroom, more,
                                     progress=told(len(values)))
    if not any(p.get("tokens_per_s") for p in curves["best"]):  # a --compare curve may be all errors
        first = curves["best"][0]
        raise AutoparError(f"no point of the sweep has a plan; at {key}={first['value']}: {first['error']}")
    from planner.whatif import normalize

    normalize(curves, key)
    plot_path = None
    if args.plot:
        from planner.whatif_plot import plot

        plot_path = plot(curves, key, model.name, cluster.name, args.plot)
    if args.format == "json":
        print(json.dumps({"vary": key, "values": values, "curves": rounded(curves)}))
        return 0
    if args.format == "csv":
        import csv

        from planner.whatif import csv_header, csv_rows

        w = csv.writer(sys.stdout)
        w.writerow(csv_header(key))
        w.writerows(csv_rows(rounded(curves), key))
        return 0
    from planner.report import console, print_inputs, whatif_table

    con = console()
    print_inputs(con, model, cluster)
    for name, pts in curves.items():
        con.print(whatif_table(pts, key, "best plan per point" if name == "best" else f"{name}: best plan per point"))
    for note in dict.fromkeys(p["note"] for p in curves["best"] if p.get("note")):
        con.print(f"[yellow]note:[/yellow] {escape(note)}")
    if plot_path:
        con.print(escape(f"wrote {plot_path}"))
    return 0


def _shares_cores(cluster, key: str, value: int) -> bool:
    """Whether a point of a GPU- or node-count sweep puts more ranks on a node than it has cores (a point the
    cluster cannot take says why in the sweep)."""
    from planner.whatif import cluster_at

    try:
        return cluster_at(cluster, key, value)[0].compute_slowdown > 1
    except AutoparError:
        return False
